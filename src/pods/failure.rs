//! A Pod that fails: its spec cannot run, its active deadline passed, it
//! is evicted, or its image cannot run (which waits as a failed pull).

use super::*;

/// Why a Pod fails while its containers may still run, and how they stop.
pub(super) struct Failure<'a> {
    pub(super) reason: &'a str,
    pub(super) message: &'a str,
    /// The grace period its containers get.
    pub(super) grace: Duration,
    pub(super) event_type: EventType,
}

/// The first wait before a start that failed on an image is tried again;
/// it doubles up to [`IMAGE_BACKOFF_MAX`], as the kubelet's image back-off.
pub(super) const IMAGE_BACKOFF: Duration = Duration::from_secs(10);

pub(super) const IMAGE_BACKOFF_MAX: Duration = Duration::from_secs(300);

impl Cx<'_> {
    /// The backend cannot run a container's image. As the kubelet after a
    /// failed pull, the Pod stays Pending with its containers waiting in
    /// `ErrImagePull`, then `ImagePullBackOff`, and the start is tried again
    /// after a back-off that doubles from [`IMAGE_BACKOFF`] to
    /// [`IMAGE_BACKOFF_MAX`]; an update of the Pod (a fixed image) tries at once.
    pub(super) async fn image_unavailable(
        &self,
        rec: &PodRecord,
        message: String,
    ) -> Result<Action, ReconcileError> {
        let backoff = rec.image_backoff().is_some();
        let waiting = Waiting::ImagePull {
            message: message.clone(),
            backoff,
        };
        self.write_status(rec, None, &waiting).await?;
        let (failures, wait) = self.back_off_start(rec);
        warn!(%message, failures, "image not runnable; waiting as after a failed pull");
        // The kubelet's pair of Events, once each rather than at every retry.
        match failures {
            1 => self.event(
                rec,
                EventType::Warning,
                "Failed",
                &format!("Failed to pull image: {message}"),
                "Pull",
            ),
            2 => self.event(
                rec,
                EventType::Normal,
                "BackOff",
                &format!("Back-off pulling image: {message}"),
                "Pull",
            ),
            _ => {}
        }
        Ok(self.deadline_action(&rec.uid, Some(wait)))
    }

    /// The backend could not set up the Pod's sandbox (its network, say) and
    /// gave back what it had. As the kubelet, the Pod stays Pending with its
    /// containers `ContainerCreating`, each failed attempt is a Warning
    /// `FailedCreatePodSandBox`, and the start is tried again after the same
    /// back-off as an image's (the record's start back-off).
    pub(super) async fn sandbox_not_created(
        &self,
        rec: &PodRecord,
        message: String,
    ) -> Result<Action, ReconcileError> {
        self.write_status(rec, None, &Waiting::Creating).await?;
        let (failures, wait) = self.back_off_start(rec);
        warn!(%message, failures, "the backend could not create the Pod's sandbox; trying again");
        self.event(
            rec,
            EventType::Warning,
            vkd_provider::SANDBOX_NOT_CREATED,
            &format!("Failed to create pod sandbox: {message}"),
            "Create",
        );
        Ok(self.deadline_action(&rec.uid, Some(wait)))
    }

    /// Counts a start that failed and sets when the next may be tried: after
    /// [`IMAGE_BACKOFF`], doubling to [`IMAGE_BACKOFF_MAX`]. Returns the
    /// failures in a row and the wait.
    fn back_off_start(&self, rec: &PodRecord) -> (u8, Duration) {
        let failures = rec
            .image_backoff()
            .map_or(0, |b| b.failures)
            .saturating_add(1);
        let wait = IMAGE_BACKOFF
            .saturating_mul(1 << u32::from(failures.min(8) - 1))
            .min(IMAGE_BACKOFF_MAX);
        let backoff = model::ImageBackoff {
            images: rec.images_digest(),
            failures,
            retry_at: Stamp::from(SystemTime::now() + wait),
        };
        self.update(&rec.uid, |p| p.image_backoff = Some(Box::new(backoff)));
        (failures, wait)
    }

    /// What follows a reconcile that leaves the Pod running or waiting: it is
    /// looked at again when its active deadline passes, or after `otherwise`.
    /// Read from the stored record, whose start time a status write may just
    /// have set.
    pub(super) fn deadline_action(&self, uid: &str, otherwise: Option<Duration>) -> Action {
        let left = self.store.lock().get(uid).and_then(|r| {
            if r.terminal() {
                return None;
            }
            r.active_deadline?
                .left(r.start_time?.time(), SystemTime::now())
                .map(|l| l.min(DEADLINE_RECHECK_MAX))
        });
        match (left, otherwise) {
            (Some(l), Some(o)) => Action::After(l.min(o)),
            (Some(d), None) | (None, Some(d)) => Action::After(d),
            (None, None) => Action::Done,
        }
    }

    /// `activeDeadlineSeconds` passed: as the kubelet, stop the containers
    /// (with the Pod's grace period) and fail the Pod with `DeadlineExceeded`.
    pub(super) async fn exceed_deadline(
        &self,
        rec: &PodRecord,
        deadline: model::ActiveDeadline,
    ) -> Result<Action, ReconcileError> {
        let failure = Failure {
            reason: DEADLINE_REASON,
            message: DEADLINE_MESSAGE,
            grace: Duration::from_secs(deadline.grace_seconds.into()),
            event_type: EventType::Normal,
        };
        self.stop_and_fail(rec, &failure).await
    }

    /// As the kubelet's killPod with a status function: stop the containers
    /// within `failure.grace` and fail the Pod with its reason and message.
    /// As the kubelet's status manager, the phase turns terminal only once no
    /// container can still run: until the backend confirms, the Pod is looked
    /// at again every [`DELETE_CONFIRM`]. Containers whose end the backend did
    /// not report read as the kubelet writes those it cannot find when it
    /// terminates a Pod (`ContainerStatusUnknown`, exit code 137).
    pub(super) async fn stop_and_fail(
        &self,
        rec: &PodRecord,
        failure: &Failure<'_>,
    ) -> Result<Action, ReconcileError> {
        use vkd_provider::InstancePhase;
        let uid = &*rec.uid;
        self.admitter.release(uid);
        let current = self.provider.get(uid).await?;
        if let Some(i) = &current
            && !matches!(i.phase, InstancePhase::Succeeded | InstancePhase::Failed)
        {
            let last_seen = Box::new(i.clone());
            let first = self
                .update(uid, |p| {
                    p.failing_mut().stopping.replace(last_seen).is_none()
                })
                .unwrap_or(true);
            if first {
                info!(instance = %i.id, reason = failure.reason, "stopping the instance");
            }
            self.provider
                .delete(&self.fence(), uid, failure.grace)
                .await?;
            return Ok(Action::After(DELETE_CONFIRM));
        }
        let last_seen = self.update(uid, model::Progress::take_stopping).flatten();
        let instance = current.or(last_seen.map(|i| *i));
        let now = SystemTime::now();
        let last_instance = instance.clone().map(Box::new);
        let (view, body) = match instance {
            Some(inst) => {
                // Every container ended as a deleted Pod's do; the failure
                // fails the Pod whatever they did.
                let mut inst = status::terminal_instance(rec, Some(inst), now);
                inst.phase = InstancePhase::Failed;
                inst.message = None;
                let mut view = status::desired_view(rec, Some(&inst), &Waiting::Creating);
                view.reason = Some(failure.reason.into());
                view.message = Some(failure.message.into());
                // The host's IP, unless the backend gives Pods their own.
                if view.pod_ip.is_none()
                    && (rec.host_network
                        || self.provider.capabilities().pod_network
                            != vkd_provider::Support::Supported)
                {
                    view.pod_ip = Some(self.settings.host_ip.clone());
                }
                let body = status::patch_body(rec, &view, Some(&inst), &self.settings.host_ip, now);
                (view, body)
            }
            None => {
                let view = status::failed_view(failure.reason, failure.message);
                let body = serde_json::json!({
                    "status": {
                        "phase": "Failed",
                        "reason": failure.reason,
                        "message": failure.message,
                        "hostIP": self.settings.host_ip,
                        "startTime": status::time(rec.start_time.map_or(now, Stamp::time)),
                    }
                });
                (view, body)
            }
        };
        warn!(
            reason = failure.reason,
            message = failure.message,
            "pod failed"
        );
        if let Err(e) = self.patch_status(rec, body).await {
            // Kept for the retry: the instance is gone, its last states are not.
            if let Some(i) = last_instance {
                self.update(uid, |p| p.failing_mut().stopping = Some(i));
            }
            return Err(e);
        }
        let observed = view.observed();
        self.touch(&rec.uid, |r| {
            r.progress.failing = None;
            r.observe(&observed, now);
        });
        self.event(
            rec,
            failure.event_type,
            failure.reason,
            failure.message,
            "Kill",
        );
        Ok(Action::Done)
    }

    pub(super) async fn fail(
        &self,
        rec: &PodRecord,
        reason: &str,
        message: &str,
    ) -> Result<Action, ReconcileError> {
        self.fail_saying(rec, reason, message, message).await
    }

    /// The node refused the Pod: Failed, with the kubelet's "Pod was rejected"
    /// in its status and the bare message in the Warning Event.
    pub(super) async fn reject(
        &self,
        rec: &PodRecord,
        rejection: &super::admission::Rejection,
    ) -> Result<Action, ReconcileError> {
        let status_message = format!("Pod was rejected: {}", rejection.message);
        self.fail_saying(rec, &rejection.reason, &status_message, &rejection.message)
            .await
    }

    async fn fail_saying(
        &self,
        rec: &PodRecord,
        reason: &str,
        message: &str,
        event_message: &str,
    ) -> Result<Action, ReconcileError> {
        self.admitter.release(&rec.uid);
        let view = status::failed_view(reason, message);
        if view.digest() != rec.observed_digest {
            warn!(reason, message, "pod failed");
            let body = serde_json::json!({
                "status": {
                    "phase": "Failed",
                    "reason": reason,
                    "message": message,
                    "hostIP": self.settings.host_ip,
                    "startTime": status::time(rec.start_time.map_or_else(SystemTime::now, Stamp::time)),
                }
            });
            self.patch_status(rec, body).await?;
            let observed = view.observed();
            self.touch(&rec.uid, |r| r.observe(&observed, SystemTime::now()));
            self.event(rec, EventType::Warning, reason, event_message, "Admit");
        }
        Ok(Action::Done)
    }
}
