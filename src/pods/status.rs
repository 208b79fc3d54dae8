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
use vkd_provider::{ContainerState, Instance, InstancePhase};

use super::record::PodRecord;

/// The annotation that names the backend instance of a Pod.
pub const INSTANCE_ID: &str = "vkd.io/instance-id";
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
    pub restart_count: u32,
    pub container_id: Option<String>,
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
    pub pod_ip: Option<String>,
    pub instance_id: Option<String>,
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
    let containers = status
        .container_statuses
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
                restart_count: u32::try_from(c.restart_count).unwrap_or(0),
                container_id: c.container_id,
            }
        })
        .collect();
    StatusView {
        phase: status.phase.unwrap_or_default(),
        reason: status.reason,
        message: status.message,
        conditions,
        containers,
        pod_ip: status.pod_ip,
        instance_id: pod
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(INSTANCE_ID).cloned()),
    }
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
pub fn desired_view(rec: &PodRecord, instance: Option<&Instance>, waiting: &Waiting) -> StatusView {
    let Some(inst) = instance else {
        let (reason, message) = match waiting {
            Waiting::Creating => ("ContainerCreating".to_owned(), None),
            Waiting::Queued(why) => ("BackendQueued".to_owned(), Some(why.clone())),
            Waiting::ConfigError(why) => {
                ("CreateContainerConfigError".to_owned(), Some(why.clone()))
            }
        };
        return StatusView {
            phase: "Pending".into(),
            conditions: [Some(false), Some(true), Some(false), Some(false)],
            containers: rec
                .containers
                .iter()
                .map(|c| ContainerView {
                    name: c.name.to_string(),
                    state: StateView::Waiting {
                        reason: reason.clone(),
                        message: message.clone(),
                    },
                    last_exit_code: None,
                    ready: false,
                    restart_count: 0,
                    container_id: None,
                })
                .collect(),
            ..Default::default()
        };
    };
    let containers: Vec<ContainerView> = rec
        .containers
        .iter()
        .map(
            |c| match inst.containers.iter().find(|s| *s.name == *c.name) {
                Some(s) => ContainerView {
                    name: s.name.clone(),
                    state: state_view(&s.state),
                    last_exit_code: s.last_termination.as_ref().map(|t| t.exit_code),
                    ready: s.ready,
                    restart_count: s.restart_count,
                    container_id: s.container_id.clone(),
                },
                None => ContainerView {
                    name: c.name.to_string(),
                    state: StateView::Waiting {
                        reason: "ContainerCreating".into(),
                        message: None,
                    },
                    last_exit_code: None,
                    ready: false,
                    restart_count: 0,
                    container_id: None,
                },
            },
        )
        .collect();
    let all_ready = !containers.is_empty() && containers.iter().all(|c| c.ready);
    let phase = match inst.phase {
        InstancePhase::Pending => "Pending",
        InstancePhase::Running => "Running",
        InstancePhase::Succeeded => "Succeeded",
        InstancePhase::Failed => "Failed",
    };
    let sandbox_ready = !matches!(inst.phase, InstancePhase::Pending)
        || containers
            .iter()
            .any(|c| !matches!(&c.state, StateView::Waiting { reason, .. } if reason == "ContainerCreating"));
    let terminal = matches!(inst.phase, InstancePhase::Succeeded | InstancePhase::Failed);
    StatusView {
        phase: phase.into(),
        reason: None,
        message: inst.message.clone(),
        conditions: [
            Some(sandbox_ready && !terminal),
            Some(true),
            Some(all_ready),
            Some(all_ready),
        ],
        containers,
        pod_ip: inst.ip.clone(),
        instance_id: Some(inst.id.clone()),
    }
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
    status.insert("reason".into(), json!(view.reason));
    status.insert("message".into(), json!(view.message));
    status.insert("hostIP".into(), json!(host_ip));
    status.insert("hostIPs".into(), json!([{ "ip": host_ip }]));
    let start = rec.start_time.map_or(now, super::record::Stamp::time);
    status.insert("startTime".into(), json!(time(start)));
    if let Some(ip) = &view.pod_ip {
        status.insert("podIP".into(), json!(ip));
        status.insert("podIPs".into(), json!([{ "ip": ip }]));
    }
    let conditions: Vec<Value> = CONDITIONS
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
            if !s && (*t == "Ready" || *t == "ContainersReady") {
                let not_ready: Vec<&str> = view
                    .containers
                    .iter()
                    .filter(|c| !c.ready)
                    .map(|c| c.name.as_str())
                    .collect();
                if !not_ready.is_empty() {
                    c["reason"] = json!("ContainersNotReady");
                    c["message"] = json!(format!(
                        "containers with unready status: [{}]",
                        not_ready.join(" ")
                    ));
                }
            } else {
                c["reason"] = Value::Null;
                c["message"] = Value::Null;
            }
            c
        })
        .collect();
    if !conditions.is_empty() {
        status.insert("conditions".into(), Value::Array(conditions));
    }
    if !view.containers.is_empty() {
        let statuses: Vec<Value> = view
            .containers
            .iter()
            .map(|c| container_json(rec, c, instance))
            .collect();
        status.insert("containerStatuses".into(), Value::Array(statuses));
    }
    let mut annotations = serde_json::Map::new();
    if let Some(id) = &view.instance_id {
        annotations.insert(INSTANCE_ID.into(), json!(id));
    }
    annotations.insert(TIMELINE.into(), json!(rec.timeline.render()));
    json!({
        "metadata": { "annotations": annotations },
        "status": status,
    })
}

fn container_json(rec: &PodRecord, c: &ContainerView, instance: Option<&Instance>) -> Value {
    let backend = instance.and_then(|i| i.containers.iter().find(|s| s.name == c.name));
    let image = rec
        .containers
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
            "finishedAt": time(t.finished_at),
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
            _ => {
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
        "started": matches!(c.state, StateView::Running),
        "restartCount": c.restart_count,
        "state": state,
        "lastState": last,
    })
}

#[cfg(test)]
mod tests;
