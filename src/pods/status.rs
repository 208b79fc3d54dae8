//! Pod status the way the kubelet writes it, from a backend instance.
//!
//! Two sides are reduced to one comparable [`StatusView`]: what the API server
//! holds (from the watch) and what the backend says now. A status patch is sent
//! only when the two views differ, so an unchanged Pod costs no write, also right
//! after a restart. Times are left out of the view: they ride along with a real
//! change, never cause one.

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::time::SystemTime;

use k8s_openapi::api::core::v1::Pod;
use serde_json::{Value, json};
use vkd_provider::{ContainerState, ContainerStatus, Instance, InstancePhase, Terminated};

use super::record::{ContainerInfo, PodRecord};

/// The annotation that names the backend instance of a Pod.
pub const INSTANCE_ID: &str = "vkd.io/instance-id";
/// The host slice the instance runs on (a downstream cluster's Node).
pub const HOST: &str = "vkd.io/host";
/// The annotation with the startup timeline.
pub const TIMELINE: &str = "vkd.io/timeline";

/// The conditions vkd owns (PodScheduled belongs to the scheduler).
pub const CONDITIONS: [&str; 4] = [
    "PodReadyToStartContainers",
    "Initialized",
    "ContainersReady",
    "Ready",
];

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum StateView {
    Waiting {
        reason: String,
        message: Option<String>,
    },
    Running,
    Terminated {
        exit_code: i32,
        reason: String,
    },
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ContainerView {
    pub name: String,
    pub state: StateView,
    pub last_exit_code: Option<i32>,
    pub ready: bool,
    /// The kubelet's `started`: running, past postStart and the startupProbe.
    pub started: bool,
    pub restart_count: u32,
    pub container_id: Option<String>,
}

impl ContainerView {
    /// A container that has not run yet, waiting for `reason`.
    fn waiting(name: &str, reason: &str, message: Option<String>) -> Self {
        Self {
            name: name.to_owned(),
            state: StateView::Waiting {
                reason: reason.to_owned(),
                message,
            },
            last_exit_code: None,
            ready: false,
            started: false,
            restart_count: 0,
            container_id: None,
        }
    }

    fn of(s: &ContainerStatus) -> Self {
        Self {
            name: s.name.clone(),
            state: state_view(&s.state),
            last_exit_code: s.last_termination.as_ref().map(|t| t.exit_code),
            ready: s.ready,
            started: s.has_started(),
            restart_count: s.restart_count,
            container_id: s.container_id.clone(),
        }
    }
}

/// The parts of a Pod's status that vkd decides, without times.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct StatusView {
    pub phase: String,
    pub reason: Option<String>,
    pub message: Option<String>,
    /// Status of each of [`CONDITIONS`]; `None` when absent.
    pub conditions: [Option<bool>; 4],
    pub containers: Vec<ContainerView>,
    pub init_containers: Vec<ContainerView>,
    /// `ephemeralContainerStatuses` (see [`super::ephemeral`]).
    pub ephemeral: Vec<ContainerView>,
    pub pod_ip: Option<String>,
    pub instance_id: Option<String>,
    /// `status.observedGeneration`: the Pod's generation the status answers to
    /// (the kubelet writes it, and into each condition, since 1.34).
    pub observed_generation: Option<i64>,
}

impl StatusView {
    pub fn digest(&self) -> u64 {
        let mut h = DefaultHasher::new();
        self.hash(&mut h);
        h.finish()
    }
}

/// The view of what the API server holds.
pub fn view_of_pod(pod: &Pod) -> StatusView {
    let status = pod.status.clone().unwrap_or_default();
    let conditions = CONDITIONS.map(|t| {
        status
            .conditions
            .as_ref()
            .and_then(|cs| cs.iter().find(|c| c.type_ == t))
            .map(|c| c.status == "True")
    });
    let containers = api_views(status.container_statuses);
    let init_containers = api_views(status.init_container_statuses);
    let ephemeral = api_views(status.ephemeral_container_statuses);
    StatusView {
        phase: status.phase.unwrap_or_default(),
        reason: status.reason,
        message: status.message,
        conditions,
        containers,
        init_containers,
        ephemeral,
        pod_ip: status.pod_ip,
        observed_generation: status.observed_generation,
        instance_id: pod
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(INSTANCE_ID).cloned()),
    }
}

fn api_views(
    statuses: Option<Vec<k8s_openapi::api::core::v1::ContainerStatus>>,
) -> Vec<ContainerView> {
    statuses
        .unwrap_or_default()
        .into_iter()
        .map(|c| {
            let state = c.state.unwrap_or_default();
            let state = if let Some(w) = state.waiting {
                StateView::Waiting {
                    reason: w.reason.unwrap_or_default(),
                    message: w.message,
                }
            } else if let Some(t) = state.terminated {
                StateView::Terminated {
                    exit_code: t.exit_code,
                    reason: t.reason.unwrap_or_default(),
                }
            } else {
                StateView::Running
            };
            ContainerView {
                name: c.name,
                state,
                last_exit_code: c.last_state.and_then(|s| s.terminated).map(|t| t.exit_code),
                ready: c.ready,
                started: c.started.unwrap_or(false),
                restart_count: u32::try_from(c.restart_count).unwrap_or(0),
                container_id: c.container_id,
            }
        })
        .collect()
}

/// Where a Pod stands before it has an instance.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Waiting {
    /// Admitted, being created.
    Creating,
    /// The backend has no room yet; the reason says what it waits for.
    Queued(String),
    /// Something the spec refers to is missing (a ConfigMap, a key, a ServiceAccount).
    ConfigError(String),
    /// The backend cannot run an image ([`vkd_provider::IMAGE_NOT_RUNNABLE`]);
    /// `backoff` once it failed before and vkd waits to try again.
    ImagePull { message: String, backoff: bool },
}

fn state_view(s: &ContainerState) -> StateView {
    match s {
        ContainerState::Waiting { reason, message } => StateView::Waiting {
            reason: reason.clone(),
            message: message.clone(),
        },
        ContainerState::Running { .. } => StateView::Running,
        ContainerState::Terminated(t) => StateView::Terminated {
            exit_code: t.exit_code,
            reason: t.reason.clone(),
        },
    }
}

/// The view vkd wants, from the backend's instance (or where the Pod waits).
///
/// Init containers are reported as the kubelet reports them: a regular one is
/// ready once it exited 0, a sidecar as a container is; the containers wait
/// (`PodInitializing`) until the init containers are done, and `Initialized`
/// holds once each regular init container completed and each sidecar started
/// (or once a container has run, or the Pod succeeded).
pub fn desired_view(rec: &PodRecord, instance: Option<&Instance>, waiting: &Waiting) -> StatusView {
    let has_init = !rec.init_containers.is_empty();
    let Some(inst) = instance else {
        let (reason, message) = match waiting {
            Waiting::Creating => ("ContainerCreating", None),
            Waiting::Queued(why) => ("BackendQueued", Some(why.clone())),
            Waiting::ConfigError(why) => ("CreateContainerConfigError", Some(why.clone())),
            Waiting::ImagePull { message, backoff } => (
                if *backoff {
                    "ImagePullBackOff"
                } else {
                    "ErrImagePull"
                },
                Some(message.clone()),
            ),
        };
        // With init containers the first one says why (`kubectl get` prints
        // Init:<reason>), and the rest wait for it.
        let init_containers = rec
            .init_containers
            .iter()
            .enumerate()
            .map(|(i, c)| match waiting {
                Waiting::Queued(_) | Waiting::ConfigError(_) | Waiting::ImagePull { .. }
                    if i == 0 =>
                {
                    ContainerView::waiting(&c.name, reason, message.clone())
                }
                _ => ContainerView::waiting(&c.name, "PodInitializing", None),
            })
            .collect();
        let containers = rec
            .containers
            .iter()
            .map(|c| {
                if has_init {
                    ContainerView::waiting(&c.name, "PodInitializing", None)
                } else {
                    ContainerView::waiting(&c.name, reason, message.clone())
                }
            })
            .collect();
        return StatusView {
            phase: "Pending".into(),
            conditions: [Some(false), Some(!has_init), Some(false), Some(false)],
            containers,
            init_containers,
            ephemeral: super::ephemeral::views(rec, None),
            ..Default::default()
        };
    };
    let init_containers: Vec<ContainerView> = rec
        .init_containers
        .iter()
        .map(
            |c| match inst.init_containers.iter().find(|s| *s.name == *c.name) {
                Some(s) => {
                    let mut v = ContainerView::of(s);
                    if !c.sidecar {
                        v.ready =
                            matches!(&s.state, ContainerState::Terminated(t) if t.exit_code == 0);
                    }
                    v
                }
                None => ContainerView::waiting(&c.name, "PodInitializing", None),
            },
        )
        .collect();
    let phase = match inst.phase {
        InstancePhase::Pending => "Pending",
        InstancePhase::Running => "Running",
        InstancePhase::Succeeded => "Succeeded",
        InstancePhase::Failed => "Failed",
    };
    let mut containers: Vec<ContainerView> = rec
        .containers
        .iter()
        .map(
            |c| match inst.containers.iter().find(|s| *s.name == *c.name) {
                Some(s) => ContainerView::of(s),
                None if has_init => ContainerView::waiting(&c.name, "PodInitializing", None),
                None => ContainerView::waiting(&c.name, "ContainerCreating", None),
            },
        )
        .collect();
    let initialized = phase == "Succeeded"
        || containers
            .iter()
            .any(|c| !matches!(c.state, StateView::Waiting { .. }))
        || incomplete_init(rec, &init_containers).is_empty();
    if !initialized {
        for c in &mut containers {
            if matches!(&c.state, StateView::Waiting { reason, .. } if reason == "ContainerCreating")
            {
                c.state = StateView::Waiting {
                    reason: "PodInitializing".into(),
                    message: None,
                };
            }
        }
    }
    let all_ready = !containers.is_empty()
        && containers.iter().all(|c| c.ready)
        && sidecars(rec, &init_containers).all(|c| c.ready);
    let unstarted = |c: &ContainerView| {
        matches!(&c.state, StateView::Waiting { reason, .. }
            if reason == "ContainerCreating" || reason == "PodInitializing")
    };
    let sandbox_ready = !matches!(inst.phase, InstancePhase::Pending)
        || !containers.iter().chain(&init_containers).all(unstarted);
    let terminal = matches!(inst.phase, InstancePhase::Succeeded | InstancePhase::Failed);
    StatusView {
        phase: phase.into(),
        reason: None,
        message: inst.message.clone(),
        conditions: [
            Some(sandbox_ready && !terminal),
            Some(initialized),
            Some(all_ready),
            Some(all_ready && rec.readiness_gates_ready),
        ],
        containers,
        init_containers,
        ephemeral: super::ephemeral::views(rec, Some(inst)),
        pod_ip: inst.ip.clone(),
        instance_id: (!inst.id.is_empty()).then(|| inst.id.clone()),
        observed_generation: None,
    }
}

/// The views of the sidecars among `init` (the views of `rec`'s init containers).
fn sidecars<'a>(
    rec: &'a PodRecord,
    init: &'a [ContainerView],
) -> impl Iterator<Item = &'a ContainerView> + 'a {
    rec.init_containers
        .iter()
        .zip(init)
        .filter(|(c, _)| c.sidecar)
        .map(|(_, v)| v)
}

/// The init containers that keep the Pod from being initialized: a regular
/// one that has not completed, a sidecar that has not started.
fn incomplete_init<'a>(rec: &PodRecord, init: &'a [ContainerView]) -> Vec<&'a str> {
    rec.init_containers
        .iter()
        .zip(init)
        .filter(|(c, v)| if c.sidecar { !v.started } else { !v.ready })
        .map(|(_, v)| v.name.as_str())
        .collect()
}

/// The instance as it stands once it is stopped for good (the Pod is being
/// deleted), for the Pod's final status, as the kubelet's status manager
/// terminates a Pod: a container that did not end is written as one the kubelet
/// could not find (`ContainerStatusUnknown`, exit code 137); the phase is
/// Succeeded when every container exited 0, else Failed, whatever the
/// restartPolicy. `seen` is the instance as last seen (`None`: never seen).
pub fn terminal_instance(rec: &PodRecord, seen: Option<Instance>, now: SystemTime) -> Instance {
    let mut inst = seen.unwrap_or_else(|| Instance {
        id: rec.instance_id.as_deref().unwrap_or_default().to_owned(),
        owner: rec.pod_ref(),
        node: String::new(),
        epoch: 0,
        phase: InstancePhase::Failed,
        containers: Vec::new(),
        ip: None,
        host: None,
        created_at: now,
        started_at: None,
        message: None,
        init_containers: Vec::new(),
        ephemeral_containers: Vec::new(),
        host_ip: None,
        events: Vec::new(),
    });
    let unknown = |started_at: Option<SystemTime>| {
        ContainerState::Terminated(Terminated {
            exit_code: 137,
            reason: "ContainerStatusUnknown".into(),
            message: Some("The container could not be located when the pod was terminated".into()),
            started_at,
            finished_at: now,
        })
    };
    let blank = |c: &ContainerInfo| ContainerStatus {
        name: c.name.to_string(),
        state: unknown(None),
        last_termination: None,
        ready: false,
        restart_count: 0,
        container_id: None,
        started: Some(false),
    };
    let completed = |s: &ContainerStatus| {
        matches!(&s.state, ContainerState::Terminated(t) if t.exit_code == 0)
            || s.last_termination
                .as_ref()
                .is_some_and(|t| t.exit_code == 0)
    };
    // Once the Pod has initialized, a container with no end is a failed one.
    let initialized = rec.init_containers.is_empty()
        || inst.containers.iter().any(|c| {
            !matches!(c.state, ContainerState::Waiting { .. }) || c.last_termination.is_some()
        })
        || inst.init_containers.last().is_some_and(completed);
    if initialized {
        for c in rec.containers.iter() {
            if !inst.containers.iter().any(|s| *s.name == *c.name) {
                inst.containers.push(blank(c));
            }
        }
    }
    // A container waiting to run again has no end either; an init container
    // only once it ever ran (the ones after it never started).
    let containers = inst.containers.iter_mut().map(|c| (c, initialized));
    let init = inst.init_containers.iter_mut().map(|c| {
        let ran = c.container_id.is_some() || c.last_termination.is_some();
        (c, ran)
    });
    for (c, ended_if_waiting) in containers.chain(init) {
        c.ready = false;
        c.started = Some(false);
        match &c.state {
            ContainerState::Running { started_at } => c.state = unknown(Some(*started_at)),
            ContainerState::Waiting { .. } if ended_if_waiting => c.state = unknown(None),
            _ => {}
        }
    }
    let succeeded = rec.containers.iter().all(|c| {
        inst.containers
            .iter()
            .find(|s| *s.name == *c.name)
            .is_some_and(|s| matches!(&s.state, ContainerState::Terminated(t) if t.exit_code == 0))
    });
    inst.phase = if succeeded {
        InstancePhase::Succeeded
    } else {
        InstancePhase::Failed
    };
    inst
}

/// The view of a Pod the backend refused for good.
pub fn failed_view(reason: &str, message: &str) -> StatusView {
    StatusView {
        phase: "Failed".into(),
        reason: Some(reason.to_owned()),
        message: Some(message.to_owned()),
        ..Default::default()
    }
}

/// RFC 3339 with seconds, as metav1.Time is written.
pub fn time(t: SystemTime) -> String {
    jiff::Timestamp::try_from(t)
        .map(|ts| ts.strftime("%Y-%m-%dT%H:%M:%SZ").to_string())
        .unwrap_or_else(|_| "1970-01-01T00:00:00Z".into())
}

/// The strategic-merge patch for pods/status that turns the API's status into `view`.
///
/// Conditions keep their lastTransitionTime unless their status changes; the
/// instance id and the timeline travel in the same request as annotations.
pub fn patch_body(
    rec: &PodRecord,
    view: &StatusView,
    instance: Option<&Instance>,
    host_ip: &str,
    now: SystemTime,
) -> Value {
    let mut status = serde_json::Map::new();
    status.insert("phase".into(), json!(view.phase));
    if let Some(g) = view.observed_generation {
        status.insert("observedGeneration".into(), json!(g));
    }
    status.insert("reason".into(), json!(view.reason));
    status.insert("message".into(), json!(view.message));
    // The backend's machine where it says (a downstream Node), else this node.
    let host_ip = instance
        .and_then(|i| i.host_ip.as_deref())
        .unwrap_or(host_ip);
    status.insert("hostIP".into(), json!(host_ip));
    // Replaced, not merged by `ip`: a host IP that changes (the downstream
    // Pod's Node became known) must not leave the old one first in the list.
    status.insert(
        "hostIPs".into(),
        json!([{ "ip": host_ip }, { "$patch": "replace" }]),
    );
    let start = rec.start_time.map_or(now, super::record::Stamp::time);
    status.insert("startTime".into(), json!(time(start)));
    if let Some(ip) = &view.pod_ip {
        status.insert("podIP".into(), json!(ip));
        status.insert("podIPs".into(), json!([{ "ip": ip }]));
    }
    let mut conditions: Vec<Value> = CONDITIONS
        .iter()
        .zip(view.conditions.iter())
        .filter_map(|(t, s)| s.map(|s| (t, s)))
        .map(|(t, s)| {
            let since = rec.condition_since(t, s).unwrap_or(now);
            let mut c = json!({
                "type": t,
                "status": if s { "True" } else { "False" },
                "lastTransitionTime": time(since),
                "lastProbeTime": null,
            });
            if let Some(g) = view.observed_generation {
                c["observedGeneration"] = json!(g);
            }
            let (reason, message) = condition_reason(rec, view, t, s);
            c["reason"] = json!(reason);
            c["message"] = json!(message);
            c
        })
        .collect();
    if let Some(g) = view.observed_generation
        && !conditions.is_empty()
    {
        // The scheduler's condition, which the kubelet writes back with the
        // generation it saw; merged by type, so its transition time stays.
        let mut scheduled =
            json!({"type": "PodScheduled", "status": "True", "observedGeneration": g});
        // Bound by spec.nodeName: no scheduler wrote one, so it starts now.
        if rec.timeline.bound.is_none() {
            scheduled["lastTransitionTime"] = json!(time(now));
        }
        conditions.push(scheduled);
    }
    if !conditions.is_empty() {
        status.insert("conditions".into(), Value::Array(conditions));
    }
    if !view.containers.is_empty() {
        let statuses: Vec<Value> = view
            .containers
            .iter()
            .map(|c| {
                let backend = instance.and_then(|i| i.containers.iter().find(|s| s.name == c.name));
                container_json(&rec.containers, c, backend)
            })
            .collect();
        status.insert("containerStatuses".into(), Value::Array(statuses));
    }
    if !view.init_containers.is_empty() {
        let statuses: Vec<Value> = view
            .init_containers
            .iter()
            .map(|c| {
                let backend =
                    instance.and_then(|i| i.init_containers.iter().find(|s| s.name == c.name));
                container_json(&rec.init_containers, c, backend)
            })
            .collect();
        status.insert("initContainerStatuses".into(), Value::Array(statuses));
    }
    if !view.ephemeral.is_empty() {
        let statuses = super::ephemeral::statuses_json(rec, view, instance);
        status.insert("ephemeralContainerStatuses".into(), statuses);
    }
    let mut annotations = serde_json::Map::new();
    if let Some(id) = &view.instance_id {
        annotations.insert(INSTANCE_ID.into(), json!(id));
    }
    annotations.insert(TIMELINE.into(), json!(rec.timeline.render()));
    if let Some(host) = instance.and_then(|i| i.host.as_deref()) {
        annotations.insert(HOST.into(), json!(host));
    }
    json!({
        "metadata": { "annotations": annotations },
        "status": status,
    })
}

/// The reason and message of condition `t` with status `s`, as the kubelet
/// writes them (both `None` where it writes none).
fn condition_reason(
    rec: &PodRecord,
    view: &StatusView,
    t: &str,
    s: bool,
) -> (Option<&'static str>, Option<String>) {
    let terminal = match view.phase.as_str() {
        "Succeeded" => Some("PodCompleted"),
        "Failed" => Some("PodFailed"),
        _ => None,
    };
    match (t, s) {
        ("Initialized", true) if view.phase == "Succeeded" => (Some("PodCompleted"), None),
        ("Initialized", false) => {
            let incomplete = incomplete_init(rec, &view.init_containers);
            (
                Some("ContainersNotInitialized"),
                Some(format!(
                    "containers with incomplete status: [{}]",
                    incomplete.join(" ")
                )),
            )
        }
        ("Ready" | "ContainersReady", false) if terminal.is_some() => (terminal, None),
        ("Ready" | "ContainersReady", false) => {
            let not_ready: Vec<&str> = sidecars(rec, &view.init_containers)
                .chain(&view.containers)
                .filter(|c| !c.ready)
                .map(|c| c.name.as_str())
                .collect();
            if not_ready.is_empty() {
                if t == "Ready" && !rec.readiness_gates_ready {
                    // The containers are ready; a readiness gate is not (yet) True.
                    (Some("ReadinessGatesNotReady"), None)
                } else {
                    (None, None)
                }
            } else {
                (
                    Some("ContainersNotReady"),
                    Some(format!(
                        "containers with unready status: [{}]",
                        not_ready.join(" ")
                    )),
                )
            }
        }
        _ => (None, None),
    }
}

pub(super) fn container_json(
    specs: &[ContainerInfo],
    c: &ContainerView,
    backend: Option<&ContainerStatus>,
) -> Value {
    let image = specs
        .iter()
        .find(|s| *s.name == *c.name)
        .map(|s| s.image.to_string())
        .unwrap_or_default();
    let terminated_json = |t: &vkd_provider::Terminated| {
        json!({"waiting": null, "running": null, "terminated": {
            "exitCode": t.exit_code,
            "reason": t.reason,
            "message": t.message,
            "startedAt": t.started_at.map(time),
            // A container that never started has no times at all, as the
            // kubelet reports one it could not find: an end without a start
            // is a status no kubelet writes.
            "finishedAt": t.started_at.map(|_| time(t.finished_at)),
            "containerID": c.container_id,
        }})
    };
    let state = match backend.map(|b| &b.state) {
        Some(ContainerState::Running { started_at }) => {
            json!({"waiting": null, "terminated": null, "running": {"startedAt": time(*started_at)}})
        }
        Some(ContainerState::Terminated(t)) => terminated_json(t),
        _ => match &c.state {
            StateView::Waiting { reason, message } => {
                json!({"running": null, "terminated": null, "waiting": {"reason": reason, "message": message}})
            }
            StateView::Terminated { exit_code, reason } => {
                json!({"waiting": null, "running": null, "terminated": {
                    "exitCode": exit_code, "reason": reason, "containerID": c.container_id,
                }})
            }
            StateView::Running => {
                json!({"running": null, "terminated": null, "waiting": {"reason": "ContainerCreating"}})
            }
        },
    };
    let last = backend
        .and_then(|b| b.last_termination.as_ref())
        .map_or_else(
            || json!({"waiting": null, "running": null, "terminated": null}),
            terminated_json,
        );
    json!({
        "name": c.name,
        "image": image,
        "imageID": "",
        "containerID": c.container_id,
        "ready": c.ready,
        "started": c.started,
        "restartCount": c.restart_count,
        "state": state,
        "lastState": last,
    })
}

#[cfg(test)]
mod tests;
