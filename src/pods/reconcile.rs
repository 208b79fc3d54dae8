//! The workers and the reconcile: each takes a Pod from the queue and runs
//! the decision table, which names the step that does what is next.

use super::*;

impl PodController {
    pub(super) async fn worker(&self, shutdown: CancellationToken, lane: Lane) {
        loop {
            let uid = tokio::select! {
                _ = shutdown.cancelled() => return,
                k = self.queue.next_in(lane == Lane::Create) => k,
            };
            let pod = self
                .records()
                .get(&uid)
                .map(|r| r.key())
                .unwrap_or_default();
            let span = info_span!("reconcile", pod_uid = %uid, pod = %pod);
            let started = std::time::Instant::now();
            // The term's end stops a reconcile where it is, not after a slow
            // backend answers: nothing of an ended term may act on.
            let outcome = tokio::select! {
                biased;
                _ = shutdown.cancelled() => {
                    span.in_scope(|| debug!("reconcile stopped: the term ended"));
                    return;
                }
                o = self.reconcile(&uid, lane).instrument(span.clone()) => o,
            };
            let metrics = &self.shared.metrics;
            metrics.reconciled(
                if outcome.is_ok() { "ok" } else { "error" },
                started.elapsed(),
            );
            if let Err(e) = &outcome {
                metrics.reconcile_failed(e.metric_label());
            }
            match outcome {
                Ok(Action::Done) => self.queue.forget(&uid),
                Ok(Action::After(d)) => {
                    self.queue.forget(&uid);
                    self.queue.add_after(&uid, d);
                }
                Ok(Action::WriteLater) => {
                    self.queue.forget(&uid);
                    // Marked dirty while held: queued again once released below.
                    self.queue.add(&uid);
                }
                Err(ReconcileError::Provider(ProviderError::Fenced { node, current, got })) => {
                    self.shared.metrics.fenced_refused.inc();
                    span.in_scope(|| {
                        warn!(
                            %node,
                            current,
                            got,
                            "the backend refused our epoch: a newer replica acts for this node; stopping"
                        )
                    });
                    self.shared.term.supersede(format!(
                        "a backend refused epoch {got}: node {node} is at epoch {current}"
                    ));
                }
                Err(e) => {
                    let retry_in = self.queue.retry(&uid);
                    span.in_scope(|| warn!(error = %e, cause = e.metric_label(), ?retry_in, "reconcile failed"));
                }
            }
            self.queue.done(&uid);
        }
    }

    /// The decision table: what a Pod's record says is next, and the step
    /// that does it.
    pub(super) async fn reconcile(&self, uid: &str, lane: Lane) -> Result<Action, ReconcileError> {
        let cx = self.cx();
        let rec = self.store.get(uid);
        let Some(rec) = rec else {
            let approved = self
                .approved_orphans
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .contains(uid);
            if approved {
                return self.remove_orphan(uid).await;
            }
            // The Pod is gone: a collection pass (with its brake) decides.
            self.admitter.release(uid);
            self.events.forget(uid);
            self.gc_wake.notify_one();
            return Ok(Action::Done);
        };
        if let Some(grace) = rec.deletion_grace {
            return cx.finalize(&rec, grace).await;
        }
        if rec.terminal() {
            return Ok(Action::Done);
        }
        if let Some(e) = &rec.spec_error {
            return cx.fail(&rec, e.reason, &e.message).await;
        }
        if let (Some(d), Some(start)) = (rec.active_deadline, rec.start_time)
            && d.left(start.time(), SystemTime::now())
                .is_some_and(|left| left.is_zero())
        {
            return cx.stop_and_fail(&rec, &deadline::exceeded(d)).await;
        }
        if let Some(message) = rec.evicting() {
            let failure = Failure {
                reason: eviction::REASON,
                message,
                grace: eviction::GRACE,
                event_type: EventType::Warning,
            };
            return cx.stop_and_fail(&rec, &failure).await;
        }
        let image_wait = rec
            .image_backoff()
            .and_then(|b| b.retry_at.time().duration_since(SystemTime::now()).ok())
            .filter(|left| !left.is_zero());
        let instance = match self.provider.get(uid).await? {
            Some(i) => i,
            None if self
                .shared
                .partition_fenced
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .contains(uid) =>
            {
                let message = format!(
                    "vkd stopped instance {} of this Pod while it could not reach the API server \
                     (vkd.io/partition-policy: fence)",
                    rec.instance_id.as_deref().unwrap_or("(unknown)")
                );
                return cx.fail(&rec, "PartitionFenced", &message).await;
            }
            None if rec.instance_id.is_some() || rec.pending.is_none() => {
                let message = format!(
                    "backend {} no longer has instance {} of this Pod; not starting a second copy",
                    self.provider.name(),
                    rec.instance_id.as_deref().unwrap_or("(unknown)")
                );
                return cx.fail(&rec, "InstanceLost", &message).await;
            }
            // Backing off an image the backend could not run.
            None if image_wait.is_some() => return Ok(cx.deadline_action(uid, image_wait)),
            None => {
                // The node's admission first, as the kubelet's: a Pod it refuses
                // never reaches the backend.
                if !rec.progress.admitted
                    && rec.pending.is_some()
                    && let Err(rejection) = cx.admit_to_node(&rec).await?
                {
                    return cx.reject(&rec, &rejection).await;
                }
                match cx.start(&rec).await? {
                    Start::Running(_) if lane == Lane::Create => return Ok(Action::WriteLater),
                    Start::Running(i) => *i,
                    Start::Queued(reason) => {
                        let since = rec
                            .progress
                            .queued_since
                            .map_or_else(SystemTime::now, Stamp::time);
                        let timeout = rec
                        .pending
                        .as_ref()
                        .and_then(|p| p.spec.annotations.get(QUEUE_TIMEOUT_ANNOTATION))
                        .map(|t| match vkd_provider::duration::parse(t) {
                            Ok(d) => d,
                            // Longer than a year reads as "wait as long as vkd can".
                            Err(vkd_provider::duration::DurationError::TooLong { .. }) => {
                                vkd_provider::duration::MAX_DURATION
                            }
                            Err(e) => {
                                warn!(annotation = QUEUE_TIMEOUT_ANNOTATION, error = %e, "using --queue-timeout");
                                self.settings.queue_timeout
                            }
                        })
                        .unwrap_or(self.settings.queue_timeout);
                        let waited = since.elapsed().unwrap_or_default();
                        if waited >= timeout {
                            let message = format!(
                                "waited {}s in the backend queue (timeout {}s): {reason}",
                                waited.as_secs(),
                                timeout.as_secs()
                            );
                            return cx.fail(&rec, "BackendQueueTimeout", &message).await;
                        }
                        cx.queued(&rec, &reason).await?;
                        return Ok(Action::After(QUEUED_RECHECK.min(timeout - waited)));
                    }
                    Start::ConfigError(message) => {
                        warn!(message, "container config incomplete");
                        let waiting = Waiting::ConfigError(message);
                        let changed = status::desired_view(&rec, None, &waiting).digest()
                            != rec.observed_digest;
                        cx.write_status(&rec, None, &waiting).await?;
                        if changed && let Waiting::ConfigError(message) = &waiting {
                            // The kubelet's Event for a container it cannot configure;
                            // once per new message, not once per retry.
                            let note = format!("Error: {message}");
                            cx.events
                                .event(&rec, EventType::Warning, "Failed", &note, "Create");
                        }
                        return Ok(cx.deadline_action(uid, Some(CONFIG_RECHECK)));
                    }
                    Start::ImagePull(message) => {
                        let wait = cx.image_unavailable(&rec, message).await?;
                        return Ok(cx.deadline_action(uid, Some(wait)));
                    }
                    Start::Claims(message) => {
                        cx.claims_not_ready(&rec, &message).await?;
                        return Ok(cx.deadline_action(uid, Some(CONFIG_RECHECK)));
                    }
                    Start::Sandbox(message) => {
                        let wait = cx.sandbox_not_created(&rec, message).await?;
                        return Ok(cx.deadline_action(uid, Some(wait)));
                    }
                    Start::Failed(reason, message) => {
                        return cx.fail(&rec, &reason, &message).await;
                    }
                }
            }
        };
        if instance.epoch < self.settings.epoch && !rec.progress.adoption_noted {
            let detail = format!(
                "found instance {} made under epoch {} on host {}; took it on at epoch {} rather than create another",
                instance.id,
                instance.epoch,
                instance.host.as_deref().unwrap_or("-"),
                self.settings.epoch
            );
            cx.decided(uid, &rec.key(), &instance.id, Decided::Adopted, detail);
            cx.update(uid, |p| p.adoption_noted = true);
        }
        if instance.phase != vkd_provider::InstancePhase::Pending {
            // Running or ended: the backend's own figures show what it uses.
            self.admitter.release(uid);
        }
        self.events.container_events(&rec, &instance).await;
        // New entries of spec.ephemeralContainers (kubectl debug) start now.
        let mut rec = rec;
        cx.start_ephemeral(&mut rec, &instance).await?;
        if let Some(left) = cx.first_status_held(&rec, &instance) {
            // Written when the backend says it started, or when the window ends.
            return Ok(cx.deadline_action(uid, Some(left)));
        }
        cx.write_status(&rec, Some(&instance), &Waiting::Creating)
            .await?;
        let refresh_in = if instance.phase == vkd_provider::InstancePhase::Running {
            cx.refresh_volumes(&rec).await?
        } else {
            None
        };
        let recheck = match (ephemeral::recheck(&rec), refresh_in) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        Ok(cx.deadline_action(uid, recheck))
    }
}
