//! A Pod that fails: its spec cannot run, the node or the backend refused
//! it, or it fails while its containers may still run (its active deadline
//! passed, it is evicted), which stops them first.

use super::*;

use super::cx::Failure;

impl Cx<'_> {
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
                        "startTime": status::time(status::start_time(rec, &rec.progress.timeline, now)),
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
        self.events.event(
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
                    "startTime": status::time(status::start_time(rec, &rec.progress.timeline, SystemTime::now())),
                }
            });
            self.patch_status(rec, body).await?;
            let observed = view.observed();
            self.touch(&rec.uid, |r| r.observe(&observed, SystemTime::now()));
            self.events
                .event(rec, EventType::Warning, reason, event_message, "Admit");
        }
        Ok(Action::Done)
    }
}
