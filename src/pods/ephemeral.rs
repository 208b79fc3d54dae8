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

use k8s_openapi::api::core::v1::{Container, Pod};
use kube::runtime::events::EventType;
use serde_json::Value;
use tracing::{info, warn};
use vkd_provider::{ContainerState, ContainerStatus, Instance, InstancePhase, ProviderError};

use super::record::{ContainerInfo, PodRecord};
use super::spec::{self, Pending};
use super::status::{ContainerView, StateView, StatusView};
use super::{CONFIG_RECHECK, PodController, ReconcileError};

/// The waiting reason of an ephemeral container the provider cannot run.
pub const UNSUPPORTED_REASON: &str = "EphemeralContainersUnsupported";

/// What the record keeps about a Pod's ephemeral containers (none for most Pods).
#[derive(Clone, Debug, Default)]
pub struct Ephemeral {
    /// `spec.ephemeralContainers`, in order.
    pub containers: Box<[ContainerInfo]>,
    /// The Pod's pending spec with the ones still to hand over as its
    /// containers (env declared, not yet resolved); `None` once none waits.
    pub pending: Option<Box<Pending>>,
    /// Handed to the provider: it reports them from then on.
    pub handed: Vec<Box<str>>,
    /// Not started, and why.
    pub refused: Vec<Refusal>,
    /// `targetContainerName` by ephemeral container: whose process
    /// namespace each joins, where the backend gives containers their own.
    pub targets: Box<[(Box<str>, Box<str>)]>,
}

/// Why an ephemeral container did not start.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    pub name: Box<str>,
    pub reason: Box<str>,
    pub message: Box<str>,
    /// Tried again (something it refers to may appear, as the kubelet retries
    /// CreateContainerConfigError); otherwise it will never start here.
    pub retry: bool,
}

impl Ephemeral {
    /// From the Pod, carrying over what an earlier record knew.
    pub fn of(pod: &Pod, node: &str, previous: Option<&Ephemeral>) -> Option<Box<Self>> {
        let list = pod.spec.as_ref()?.ephemeral_containers.as_ref()?;
        if list.is_empty() {
            return None;
        }
        let containers: Box<[ContainerInfo]> = list
            .iter()
            .map(|e| ContainerInfo {
                name: e.name.as_str().into(),
                image: e.image.clone().unwrap_or_default().into(),
                sidecar: false,
            })
            .collect();
        let targets = list
            .iter()
            .filter_map(|e| {
                let target = e.target_container_name.as_deref()?;
                Some((e.name.as_str().into(), target.into()))
            })
            .collect();
        let mut this = Self {
            containers,
            targets,
            pending: None,
            handed: previous.map(|p| p.handed.clone()).unwrap_or_default(),
            refused: previous.map(|p| p.refused.clone()).unwrap_or_default(),
        };
        let waiting: Vec<&str> = this
            .containers
            .iter()
            .map(|c| &*c.name)
            .filter(|n| this.waits(n))
            .collect();
        if !waiting.is_empty() {
            match pending(pod, node, &waiting) {
                Ok(p) => this.pending = Some(Box::new(p)),
                Err(e) => {
                    let refusals: Vec<Refusal> = waiting
                        .iter()
                        .map(|n| Refusal {
                            name: (*n).into(),
                            reason: e.reason.into(),
                            message: e.message.as_str().into(),
                            retry: false,
                        })
                        .collect();
                    for r in refusals {
                        this.refuse(r);
                    }
                }
            }
        }
        Some(Box::new(this))
    }

    /// Still to be handed over: neither handed nor refused for good.
    fn waits(&self, name: &str) -> bool {
        !self.handed.iter().any(|h| &**h == name)
            && !self.refused.iter().any(|r| &*r.name == name && !r.retry)
    }

    fn refusal(&self, name: &str) -> Option<&Refusal> {
        self.refused.iter().find(|r| &*r.name == name)
    }

    fn refuse(&mut self, r: Refusal) {
        self.refused.retain(|o| o.name != r.name);
        self.refused.push(r);
    }

    /// Some are still to be handed over (after a missing ConfigMap appears, say).
    pub fn retrying(&self) -> bool {
        self.pending.is_some()
    }
}

/// An ephemeral container as the Pod spec's container type (the same fields
/// but `targetContainerName`, which only a container runtime with process
/// namespaces acts on).
fn as_container(e: &k8s_openapi::api::core::v1::EphemeralContainer) -> Option<Container> {
    let mut v = serde_json::to_value(e).ok()?;
    if let Value::Object(m) = &mut v {
        m.remove("targetContainerName");
    }
    serde_json::from_value(v).ok()
}

/// The Pod's pending spec with the ephemeral containers `names` as its only
/// containers and no volumes (the instance has them): what [`spec::Resolver`]
/// resolves them from, with the Pod's fields, Services and other containers'
/// resources as the Pod's own containers see them.
fn pending(pod: &Pod, node: &str, names: &[&str]) -> Result<Pending, spec::SpecError> {
    let mut whole = pod.clone();
    let invalid = |message: String| spec::SpecError {
        reason: "InvalidSpec",
        message,
    };
    if let Some(s) = whole.spec.as_mut() {
        for e in s.ephemeral_containers.iter().flatten() {
            if names.contains(&e.name.as_str()) {
                let c = as_container(e).ok_or_else(|| {
                    invalid(format!("ephemeral container {} cannot be read", e.name))
                })?;
                s.containers.push(c);
            }
        }
    }
    let mut p = spec::pending(&whole, node)?;
    let wanted = |n: &str| names.contains(&n);
    let all = p.spec.init_containers.iter().chain(&p.spec.containers);
    let keep: Vec<bool> = all.map(|c| wanted(&c.name)).collect();
    let mut keep_env = keep.iter();
    p.env.retain(|_| keep_env.next().copied().unwrap_or(false));
    p.spec.containers.retain(|c| wanted(&c.name));
    p.spec.init_containers.clear();
    p.volumes.clear();
    for c in &mut p.spec.containers {
        // As the API allows: no probes, hooks or resources; and never restarted.
        c.restart_always = false;
    }
    Ok(p)
}

/// The view of each ephemeral container, for [`StatusView`]: as the instance
/// reports it, else why it waits.
pub fn views(rec: &PodRecord, instance: Option<&Instance>) -> Vec<ContainerView> {
    let Some(e) = rec.ephemeral.as_deref() else {
        return Vec::new();
    };
    let default_reason = if rec.init_containers.is_empty() {
        "ContainerCreating"
    } else {
        "PodInitializing"
    };
    e.containers
        .iter()
        .map(|c| {
            let reported = instance.and_then(|i| {
                let s = i.ephemeral_containers.iter().find(|s| *s.name == *c.name)?;
                Some((s, ended(i)))
            });
            let (state, container_id) = match reported {
                Some((s, over)) => (state_view(&s.state, over), s.container_id.clone()),
                None => {
                    let (reason, message) = match e.refusal(&c.name) {
                        Some(r) => (r.reason.to_string(), Some(r.message.to_string())),
                        None => (default_reason.to_owned(), None),
                    };
                    (StateView::Waiting { reason, message }, None)
                }
            };
            ContainerView {
                name: c.name.to_string(),
                state,
                last_exit_code: None,
                ready: false,
                started: false,
                restart_count: 0,
                container_id,
            }
        })
        .collect()
}

fn ended(i: &Instance) -> bool {
    matches!(i.phase, InstancePhase::Succeeded | InstancePhase::Failed)
}

/// Exit code and reason of a container the instance ended without reporting
/// its end, as the kubelet writes one it cannot find when the Pod is terminated.
const UNKNOWN: (i32, &str) = (137, "ContainerStatusUnknown");

fn state_view(s: &ContainerState, over: bool) -> StateView {
    match s {
        ContainerState::Waiting { reason, message } => StateView::Waiting {
            reason: reason.clone(),
            message: message.clone(),
        },
        ContainerState::Running { .. } if over => StateView::Terminated {
            exit_code: UNKNOWN.0,
            reason: UNKNOWN.1.into(),
        },
        ContainerState::Running { .. } => StateView::Running,
        ContainerState::Terminated(t) => StateView::Terminated {
            exit_code: t.exit_code,
            reason: t.reason.clone(),
        },
    }
}

/// `status.ephemeralContainerStatuses` for `view`: as `containerStatuses`,
/// but never ready and without `started` (the kubelet's prober, which sets
/// it, knows only the Pod's own containers).
pub fn statuses_json(rec: &PodRecord, view: &StatusView, instance: Option<&Instance>) -> Value {
    let specs = rec
        .ephemeral
        .as_deref()
        .map_or(&[][..], |e| &e.containers[..]);
    let statuses = view
        .ephemeral
        .iter()
        .map(|c| {
            let backend: Option<&ContainerStatus> = instance
                .filter(|i| !ended(i))
                .and_then(|i| i.ephemeral_containers.iter().find(|s| s.name == c.name))
                .or_else(|| {
                    // An ended instance: only recorded ends are taken as they are.
                    instance
                        .and_then(|i| i.ephemeral_containers.iter().find(|s| s.name == c.name))
                        .filter(|s| !matches!(s.state, ContainerState::Running { .. }))
                });
            let mut v = super::status::container_json(specs, c, backend);
            if let Value::Object(m) = &mut v {
                m.remove("started");
            }
            v
        })
        .collect();
    Value::Array(statuses)
}

impl PodController {
    /// Hands the ephemeral containers that wait to the provider, once each;
    /// returns the record as it stands after.
    pub(super) async fn start_ephemeral(
        &self,
        mut rec: PodRecord,
        instance: &Instance,
    ) -> Result<PodRecord, ReconcileError> {
        let Some(mut eph) = rec.ephemeral.take() else {
            return Ok(rec);
        };
        let Some(pending) = eph.pending.take() else {
            rec.ephemeral = Some(eph);
            return Ok(rec);
        };
        let outcome = self.hand_over(&rec, &mut eph, &pending, instance).await;
        // What is still to be handed over keeps its spec for the next try.
        let left = pending.spec.containers.iter().any(|c| eph.waits(&c.name));
        if left {
            eph.pending = Some(pending);
        }
        let (handed, refused) = (eph.handed.clone(), eph.refused.clone());
        self.touch(&rec.uid, |r| {
            if let Some(stored) = r.ephemeral.as_deref_mut() {
                for h in &handed {
                    if !stored.handed.contains(h) {
                        stored.handed.push(h.clone());
                    }
                }
                stored.refused = refused.clone();
                // A watch event meanwhile may have added one: its spec stays.
                let waits = |p: &Pending| p.spec.containers.iter().any(|c| stored.waits(&c.name));
                if !stored.pending.as_deref().is_some_and(waits) {
                    stored.pending = None;
                }
            }
        });
        rec.ephemeral = Some(eph);
        outcome.map(|()| rec)
    }

    async fn hand_over(
        &self,
        rec: &PodRecord,
        eph: &mut Ephemeral,
        pending: &Pending,
        instance: &Instance,
    ) -> Result<(), ReconcileError> {
        let resolver = self.resolver(pending).await?;
        for (i, c) in pending.spec.containers.iter().enumerate() {
            let name = c.name.as_str();
            if !eph.waits(name) {
                continue;
            }
            if instance.ephemeral_containers.iter().any(|s| s.name == name) {
                // The backend has it (a restart of vkd, a retried reconcile).
                eph.handed.push(name.into());
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
                    self.refused(rec, eph, name, "CreateContainerConfigError", &message, true);
                    continue;
                }
                Err(spec::ResolveError::Spec(e)) => {
                    self.refused(rec, eph, name, e.reason, &e.message, false);
                    continue;
                }
            };
            let Some(mut spec) = resolved.containers.into_iter().next() else {
                continue;
            };
            spec.target_container = eph
                .targets
                .iter()
                .find(|(n, _)| &**n == name)
                .map(|(_, t)| t.clone());
            match self
                .provider
                .start_ephemeral(&self.fence(), &rec.uid, &spec)
                .await
            {
                Ok(()) => {
                    info!(container = name, image = %spec.image, "ephemeral container handed to the backend");
                    eph.handed.push(name.into());
                    eph.refused.retain(|r| &*r.name != name);
                }
                Err(ProviderError::Unsupported { provider, .. }) => {
                    let message = format!(
                        "backend {provider} does not run ephemeral containers (kubectl debug); \
                         the container will not start on this node: use kubectl exec into a \
                         container of the Pod, or a node whose provider runs them"
                    );
                    self.refused(rec, eph, name, UNSUPPORTED_REASON, &message, false);
                }
                Err(ProviderError::Invalid { reason, message }) => {
                    // An image it cannot run reads as the kubelet's failed pull.
                    let reason = if reason == vkd_provider::IMAGE_NOT_RUNNABLE {
                        "ErrImagePull"
                    } else {
                        &reason
                    };
                    self.refused(rec, eph, name, reason, &message, false);
                }
                Err(ProviderError::Rejected { message }) => {
                    self.refused(rec, eph, name, "BackendRejected", &message, true);
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
        eph: &mut Ephemeral,
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
        if eph.refusal(name) == Some(&r) {
            return;
        }
        warn!(
            container = name,
            reason, message, "ephemeral container not started"
        );
        let note = format!("ephemeral container {name}: {reason}: {message}");
        self.event(rec, EventType::Warning, "Failed", &note, "Start");
        eph.refuse(r);
    }
}

/// When to look at a Pod again for its ephemeral containers: while one waits
/// for something it refers to (a ConfigMap, a Secret), as the kubelet retries.
pub fn recheck(rec: &PodRecord) -> Option<std::time::Duration> {
    rec.ephemeral
        .as_deref()
        .is_some_and(Ephemeral::retrying)
        .then_some(CONFIG_RECHECK)
}

#[cfg(test)]
mod tests {
    use std::time::SystemTime;

    use serde_json::json;
    use vkd_provider::{PodRef, Terminated};

    use super::*;

    fn pod(ephemeral: Value) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": "p", "namespace": "ns", "uid": "u1",
                "labels": {"app": "web"},
                "annotations": {"vkd.io/instance-id": "proc-1"}},
            "spec": {
                "containers": [{"name": "main", "image": "busybox",
                    "resources": {"limits": {"memory": "64Mi"}},
                    "volumeMounts": [{"name": "data", "mountPath": "/data"}]}],
                "volumes": [{"name": "data", "emptyDir": {}}],
                "ephemeralContainers": ephemeral,
            },
            "status": {"phase": "Running"}
        }))
        .unwrap()
    }

    fn debugger() -> Value {
        json!({"name": "debugger", "image": "busybox:1.36",
            "command": ["sh", "-c", "echo $(WHO)"], "targetContainerName": "main",
            "stdin": true, "tty": true,
            "env": [{"name": "WHO", "value": "dbg"},
                {"name": "APP", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['app']"}}}],
            "volumeMounts": [{"name": "data", "mountPath": "/data"}]})
    }

    fn instance(ephemeral: Vec<ContainerStatus>, phase: InstancePhase) -> Instance {
        Instance {
            id: "proc-1".into(),
            owner: PodRef {
                uid: "u1".into(),
                namespace: "ns".into(),
                name: "p".into(),
            },
            node: "vk".into(),
            epoch: 1,
            phase,
            containers: Vec::new(),
            ip: None,
            host: None,
            created_at: SystemTime::UNIX_EPOCH,
            started_at: None,
            message: None,
            init_containers: Vec::new(),
            ephemeral_containers: ephemeral,
            host_ip: None,
            events: Vec::new(),
        }
    }

    fn status(name: &str, state: ContainerState) -> ContainerStatus {
        ContainerStatus {
            name: name.into(),
            state,
            last_termination: None,
            ready: false,
            restart_count: 0,
            container_id: Some(format!("process://u1-{name}-7")),
            started: None,
        }
    }

    #[test]
    fn a_pod_without_ephemeral_containers_keeps_nothing() {
        assert!(Ephemeral::of(&pod(json!([])), "vk", None).is_none());
        let r = PodRecord::from_pod(&pod(json!([])), "vk", None, SystemTime::now()).unwrap();
        assert!(r.ephemeral.is_none());
        assert!(views(&r, None).is_empty());
    }

    /// `kubectl debug --profile=sysadmin` asks for a privileged container: the
    /// node policy refuses it as it would a container of the Pod's own, and
    /// only the ephemeral container being handed over is checked.
    #[test]
    fn privileged_ephemeral_containers_need_the_policy() {
        let mut dbg = debugger();
        dbg["securityContext"] = json!({"privileged": true});
        let p = pending(
            &pod(json!([dbg, {"name": "plain", "image": "busybox"}])),
            "vk",
            &["debugger"],
        )
        .unwrap();
        let e = spec::check_host_access(&spec::Policy::default(), &p).unwrap_err();
        assert_eq!(e.reason, "PrivilegedNotAllowed");
        assert!(
            e.message
                .starts_with("ephemeral container debugger: securityContext.privileged"),
            "{e}"
        );
        let allowed = spec::Policy {
            allow_privileged: true,
            ..spec::Policy::default()
        };
        assert_eq!(spec::check_host_access(&allowed, &p), Ok(()));
        let p = pending(
            &pod(json!([dbg, {"name": "plain", "image": "busybox"}])),
            "vk",
            &["plain"],
        )
        .unwrap();
        assert_eq!(
            spec::check_host_access(&spec::Policy::default(), &p),
            Ok(())
        );
    }

    /// A new entry gets a spec of its own, built as the Pod's containers are
    /// (its env declared, to be resolved), without volumes (the instance has them).
    #[test]
    fn new_entries_get_a_pending_spec_of_their_own() {
        let e = Ephemeral::of(&pod(json!([debugger()])), "vk", None).unwrap();
        assert_eq!(&*e.containers[0].name, "debugger");
        assert_eq!(&*e.containers[0].image, "busybox:1.36");
        let p = e.pending.as_deref().unwrap();
        assert_eq!(p.spec.containers.len(), 1);
        assert!(p.spec.init_containers.is_empty());
        let c = &p.spec.containers[0];
        assert_eq!(c.name, "debugger");
        assert_eq!(c.command, ["sh", "-c", "echo $(WHO)"]);
        assert_eq!(c.mounts[0].path, "/data");
        assert_eq!(p.env.len(), 1);
        assert_eq!(p.env[0].env.len(), 2);
        assert!(p.volumes.is_empty());
        // Another container's resources stay readable (resourceFieldRef).
        assert!(p.resources.contains_key("main"));
        assert_eq!(p.fields.get("metadata.labels['app']").unwrap(), "web");

        // Handed over: the next record keeps no spec for it; a second entry gets one.
        let mut handed = *e;
        handed.handed.push("debugger".into());
        let two = json!([debugger(), {"name": "two", "image": "busybox"}]);
        let e2 = Ephemeral::of(&pod(two), "vk", Some(&handed)).unwrap();
        let names: Vec<&str> = e2
            .pending
            .as_deref()
            .unwrap()
            .spec
            .containers
            .iter()
            .map(|c| c.name.as_str())
            .collect();
        assert_eq!(names, ["two"]);
        let mut done = *e2;
        done.handed.push("two".into());
        let two = json!([debugger(), {"name": "two", "image": "busybox"}]);
        assert!(
            Ephemeral::of(&pod(two), "vk", Some(&done))
                .unwrap()
                .pending
                .is_none()
        );
    }

    #[test]
    fn statuses_follow_the_instance_or_say_why_they_wait() {
        let mut r =
            PodRecord::from_pod(&pod(json!([debugger()])), "vk", None, SystemTime::now()).unwrap();
        // Not reported yet: the kubelet's default.
        let v = views(&r, Some(&instance(Vec::new(), InstancePhase::Running)));
        assert_eq!(
            v[0].state,
            StateView::Waiting {
                reason: "ContainerCreating".into(),
                message: None
            }
        );
        // Refused: the reason and message, not silence.
        r.ephemeral.as_mut().unwrap().refuse(Refusal {
            name: "debugger".into(),
            reason: UNSUPPORTED_REASON.into(),
            message: "backend sim does not run ephemeral containers".into(),
            retry: false,
        });
        let v = views(&r, None);
        assert!(
            matches!(&v[0].state, StateView::Waiting { reason, message: Some(m) }
                if reason == UNSUPPORTED_REASON && m.contains("sim")),
            "{v:?}"
        );
        // Reported: as the backend says.
        let t = Terminated {
            exit_code: 0,
            reason: "Completed".into(),
            message: None,
            started_at: Some(SystemTime::UNIX_EPOCH),
            finished_at: SystemTime::UNIX_EPOCH,
        };
        let inst = instance(
            vec![status("debugger", ContainerState::Terminated(t))],
            InstancePhase::Running,
        );
        let mut view = StatusView {
            ephemeral: views(&r, Some(&inst)),
            ..Default::default()
        };
        assert_eq!(
            view.ephemeral[0].state,
            StateView::Terminated {
                exit_code: 0,
                reason: "Completed".into()
            }
        );
        let json = statuses_json(&r, &view, Some(&inst));
        let s = &json[0];
        assert_eq!(s["name"], "debugger");
        assert_eq!(s["image"], "busybox:1.36");
        assert_eq!(s["ready"], false);
        assert!(s.get("started").is_none(), "{s}");
        assert_eq!(s["state"]["terminated"]["exitCode"], 0);
        assert_eq!(s["state"]["terminated"]["reason"], "Completed");
        assert_eq!(s["containerID"], "process://u1-debugger-7");
        // Running in an instance that ended without recording its end: unknown, as the kubelet.
        let ended = instance(
            vec![status(
                "debugger",
                ContainerState::Running {
                    started_at: SystemTime::UNIX_EPOCH,
                },
            )],
            InstancePhase::Succeeded,
        );
        view.ephemeral = views(&r, Some(&ended));
        assert_eq!(
            view.ephemeral[0].state,
            StateView::Terminated {
                exit_code: 137,
                reason: "ContainerStatusUnknown".into()
            }
        );
        let json = statuses_json(&r, &view, Some(&ended));
        assert_eq!(json[0]["state"]["terminated"]["exitCode"], 137);
    }

    /// What the API server holds after our patch reads back as the view we
    /// wrote: no second patch for the same state.
    #[test]
    fn the_written_status_reads_back_as_the_same_view() {
        let r =
            PodRecord::from_pod(&pod(json!([debugger()])), "vk", None, SystemTime::now()).unwrap();
        let inst = instance(
            vec![status(
                "debugger",
                ContainerState::Running {
                    started_at: SystemTime::UNIX_EPOCH,
                },
            )],
            InstancePhase::Running,
        );
        let view = StatusView {
            ephemeral: views(&r, Some(&inst)),
            ..Default::default()
        };
        let mut p = pod(json!([debugger()]));
        p.status = Some(
            serde_json::from_value(json!({
                "ephemeralContainerStatuses": statuses_json(&r, &view, Some(&inst))
            }))
            .unwrap(),
        );
        assert_eq!(
            super::super::status::view_of_pod(&p).ephemeral,
            view.ephemeral
        );
    }

    /// The reconcile loop against a fake API server and a scripted backend.
    mod controller {
        use std::sync::Arc;
        use std::time::Duration;

        use serde_json::{Value, json};
        use vkd_provider::{ContainerState, InstancePhase};

        use super::super::super::test_support::{
            Scripted, controller, events, patches, wait_events,
        };
        use super::super::super::{Action, Lane};
        use super::{UNSUPPORTED_REASON, instance, status};
        use crate::testing::Log;

        fn pod_with_debugger() -> k8s_openapi::api::core::v1::Pod {
            let mut p = super::pod(json!([super::debugger()]));
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
}
