//! Ephemeral containers (`kubectl debug`, the `pods/ephemeralcontainers`
//! subresource): new entries of `spec.ephemeralContainers` in a Pod that runs
//! here are resolved like the Pod's own containers (env, `$(VAR)`s, mounts of
//! its volumes) and handed to the provider once each
//! ([`vkd_provider::Provider::start_ephemeral`]); they are never restarted.
//! Their state comes back in the instance and goes to
//! `status.ephemeralContainerStatuses` as the kubelet writes it. One the
//! provider cannot run waits with the reason and a Warning Event says why,
//! never silently.
//!
//! The record keeps their names and images, which ones were handed over or
//! refused, and (only while some wait) the Pod's pending spec for them: the
//! provider is idempotent on the name, and after a restart of vkd the
//! instance says which ones it has, so nothing is started twice.

use kube::runtime::events::EventType;
use tracing::{info, warn};
use vkd_provider::{Instance, ProviderError};

use super::cx::Cx;
use super::model::{EphemeralProgress, PodRecord, Refusal};
use super::spec::{self, Pending};
use super::{CONFIG_RECHECK, ReconcileError};

pub use super::status::ephemeral::UNSUPPORTED_REASON;

impl Cx<'_> {
    /// Hands the ephemeral containers that wait to the provider, once each,
    /// and notes what became of them in the record's progress (the stored
    /// record's and `rec`'s, which the status is written from next).
    pub(super) async fn start_ephemeral(
        &self,
        rec: &mut PodRecord,
        instance: &Instance,
    ) -> Result<(), ReconcileError> {
        if !rec.ephemeral_retrying() {
            return Ok(());
        }
        let Some(pending) = rec.ephemeral.as_deref().and_then(|e| e.pending.as_deref()) else {
            return Ok(());
        };
        let mut progress = rec.ephemeral_progress().cloned().unwrap_or_default();
        let outcome = self.hand_over(rec, &mut progress, pending, instance).await;
        // Only this Pod's reconcile writes it, and one runs at a time.
        let progress = Some(Box::new(progress));
        self.update(&rec.uid, |p| p.ephemeral.clone_from(&progress));
        rec.progress.ephemeral = progress;
        outcome
    }

    async fn hand_over(
        &self,
        rec: &PodRecord,
        progress: &mut EphemeralProgress,
        pending: &Pending,
        instance: &Instance,
    ) -> Result<(), ReconcileError> {
        let resolver = self.resolver(pending).await?;
        for (i, c) in pending.spec.containers.iter().enumerate() {
            let name = c.name.as_str();
            if !progress.waits(name) {
                continue;
            }
            if instance.ephemeral_containers.iter().any(|s| s.name == name) {
                // The backend has it (a restart of vkd, a retried reconcile).
                progress.hand(name);
                continue;
            }
            // One at a time, as the kubelet: one's missing ConfigMap holds back no other.
            let mut alone = pending.clone();
            alone.spec.containers = vec![c.clone()];
            alone.env = pending.env.get(i).cloned().into_iter().collect();
            let resolved = match resolver.resolve(&alone).await {
                Ok(s) => s,
                Err(spec::ResolveError::Kube(e)) => return Err(e.into()),
                Err(spec::ResolveError::Config(message)) => {
                    self.refused(
                        rec,
                        progress,
                        name,
                        "CreateContainerConfigError",
                        &message,
                        true,
                    );
                    continue;
                }
                Err(spec::ResolveError::Spec(e)) => {
                    self.refused(rec, progress, name, e.reason, &e.message, false);
                    continue;
                }
            };
            let Some(mut spec) = resolved.containers.into_iter().next() else {
                continue;
            };
            spec.target_container = rec
                .ephemeral
                .as_deref()
                .and_then(|e| e.targets.iter().find(|(n, _)| &**n == name))
                .map(|(_, t)| t.clone());
            match self
                .provider
                .start_ephemeral(&self.fence(), &rec.uid, &spec)
                .await
            {
                Ok(()) => {
                    info!(container = name, image = %spec.image, "ephemeral container handed to the backend");
                    progress.hand(name);
                }
                Err(ProviderError::Unsupported { provider, .. }) => {
                    let message = format!(
                        "backend {provider} does not run ephemeral containers (kubectl debug); \
                         the container will not start on this node: use kubectl exec into a \
                         container of the Pod, or a node whose provider runs them"
                    );
                    self.refused(rec, progress, name, UNSUPPORTED_REASON, &message, false);
                }
                Err(ProviderError::Invalid { reason, message }) => {
                    // An image it cannot run reads as the kubelet's failed pull.
                    let reason = if reason == vkd_provider::IMAGE_NOT_RUNNABLE {
                        "ErrImagePull"
                    } else {
                        &reason
                    };
                    self.refused(rec, progress, name, reason, &message, false);
                }
                Err(ProviderError::Rejected { message }) => {
                    self.refused(rec, progress, name, "BackendRejected", &message, true);
                }
                // The instance is gone: the reconcile that follows says so.
                Err(ProviderError::NotFound { .. }) => return Ok(()),
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }

    /// Records why `name` did not start, with a Warning Event the first time
    /// (or when the reason changes).
    fn refused(
        &self,
        rec: &PodRecord,
        progress: &mut EphemeralProgress,
        name: &str,
        reason: &str,
        message: &str,
        retry: bool,
    ) {
        let r = Refusal {
            name: name.into(),
            reason: reason.into(),
            message: message.into(),
            retry,
        };
        if progress.refusal(name) == Some(&r) {
            return;
        }
        warn!(
            container = name,
            reason, message, "ephemeral container not started"
        );
        let note = format!("ephemeral container {name}: {reason}: {message}");
        self.events
            .event(rec, EventType::Warning, "Failed", &note, "Start");
        progress.refuse(r);
    }
}

/// When to look at a Pod again for its ephemeral containers: while one waits
/// for something it refers to (a ConfigMap, a Secret), as the kubelet retries.
pub fn recheck(rec: &PodRecord) -> Option<std::time::Duration> {
    rec.ephemeral_retrying().then_some(CONFIG_RECHECK)
}

/// The reconcile loop against a fake API server and a scripted backend.
#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use serde_json::{Value, json};
    use vkd_provider::{ContainerState, InstancePhase};

    use super::super::test_support::{Scripted, controller, events, patches, wait_events};
    use super::super::{Action, Lane};
    use super::UNSUPPORTED_REASON;
    use crate::pods::status::ephemeral::tests::{debugger, instance, pod, status};
    use crate::testing::Log;

    fn pod_with_debugger() -> k8s_openapi::api::core::v1::Pod {
        let mut p = pod(json!([debugger()]));
        p.spec.as_mut().unwrap().node_name = Some("vk".into());
        p
    }

    fn ephemeral_status(log: &Log) -> Value {
        let p = patches(log);
        p.last().unwrap()["status"]["ephemeralContainerStatuses"][0].clone()
    }

    /// A new ephemeral container is resolved (env, fieldRefs) and handed
    /// over once; its status follows the backend's, and lookup (logs,
    /// exec) knows its name.
    #[tokio::test]
    async fn a_new_ephemeral_container_is_started_once_and_reported() {
        let provider = Arc::new(Scripted {
            runs_ephemeral: true,
            ..Default::default()
        });
        *provider.instance.lock().unwrap() = Some(instance(Vec::new(), InstancePhase::Running));
        let (c, log) = controller(Arc::clone(&provider));
        c.upsert(&pod_with_debugger());
        assert_eq!(c.reconcile("u1", Lane::Any).await.unwrap(), Action::Done);
        let started = provider.started.lock().unwrap().clone();
        assert_eq!(started.len(), 1);
        let s = &started[0];
        assert_eq!(s.name, "debugger");
        assert_eq!(s.command, ["sh", "-c", "echo dbg"], "$(VAR) expanded");
        assert!(s.env.contains(&("APP".into(), "web".into())), "{:?}", s.env);
        let st = ephemeral_status(&log);
        assert_eq!(st["state"]["waiting"]["reason"], "ContainerCreating");
        assert_eq!(st["image"], "busybox:1.36");
        let (_, names) = c.lookup("ns", "p").unwrap();
        assert!(names.contains(&"debugger".to_owned()), "{names:?}");

        // The backend runs it; a watch event (the status we wrote) and
        // later reconciles never start it again.
        *provider.instance.lock().unwrap() = Some(instance(
            vec![status(
                "debugger",
                ContainerState::Running {
                    started_at: std::time::SystemTime::UNIX_EPOCH,
                },
            )],
            InstancePhase::Running,
        ));
        c.upsert(&pod_with_debugger());
        c.reconcile("u1", Lane::Any).await.unwrap();
        c.reconcile("u1", Lane::Any).await.unwrap();
        assert_eq!(provider.started.lock().unwrap().len(), 1);
        let st = ephemeral_status(&log);
        assert!(st["state"]["running"]["startedAt"].is_string(), "{st}");
        assert!(events(&log).is_empty());
    }

    /// A backend without ephemeral containers: the container waits with
    /// the reason and a message, and one Warning Event says so.
    #[tokio::test]
    async fn an_unsupported_backend_says_so_in_the_status_and_an_event() {
        let provider = Arc::new(Scripted::default());
        *provider.instance.lock().unwrap() = Some(instance(Vec::new(), InstancePhase::Running));
        let (c, log) = controller(Arc::clone(&provider));
        c.upsert(&pod_with_debugger());
        assert_eq!(c.reconcile("u1", Lane::Any).await.unwrap(), Action::Done);
        let st = ephemeral_status(&log);
        let waiting = &st["state"]["waiting"];
        assert_eq!(waiting["reason"], UNSUPPORTED_REASON);
        assert!(
            waiting["message"]
                .as_str()
                .unwrap()
                .contains("backend scripted does not run ephemeral containers"),
            "{st}"
        );
        let e = wait_events(&log, 1).await;
        assert_eq!(e.len(), 1);
        assert_eq!(e[0]["type"], "Warning");
        assert_eq!(e[0]["reason"], "Failed");
        assert!(e[0]["note"].as_str().unwrap().contains("debugger"), "{e:?}");
        // Not asked again: no second write, no second Event, also
        // after a watch event rebuilt the record.
        c.reconcile("u1", Lane::Any).await.unwrap();
        assert_eq!(patches(&log).len(), 1);
        c.upsert(&pod_with_debugger());
        c.reconcile("u1", Lane::Any).await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(events(&log).len(), 1);
        let st = ephemeral_status(&log);
        assert_eq!(st["state"]["waiting"]["reason"], UNSUPPORTED_REASON);
    }
}
