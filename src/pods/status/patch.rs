//! The strategic-merge patch for pods/status that turns the API's status
//! into a view (written in one place, `status_write.rs`).

use std::time::SystemTime;

use serde_json::{Value, json};
use vkd_provider::{ContainerState, ContainerStatus, Instance};

use super::*;
use crate::pods::model::{ContainerInfo, PodRecord, Stamp, Timeline};

/// RFC 3339 with seconds, as metav1.Time is written.
pub fn time(t: SystemTime) -> String {
    crate::pods::model::stamp::rfc3339(t)
}

/// The Pod's `status.startTime`: what the API server holds, else when the
/// node admitted it (the kubelet starts the clock there, not when the first
/// status reaches the server, which a merged write may hold back), else `now`.
pub fn start_time(rec: &PodRecord, timeline: &Timeline, now: SystemTime) -> SystemTime {
    rec.start_time
        .or(timeline.admitted)
        .map_or(now, Stamp::time)
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
    patch_body_at(rec, &rec.progress.timeline, view, instance, host_ip, now)
}

/// [`patch_body`] with the startup timeline as the steps have it now (it may
/// be newer than `rec`'s copy).
pub fn patch_body_at(
    rec: &PodRecord,
    timeline: &Timeline,
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
        .filter(|ip| ip.parse::<std::net::IpAddr>().is_ok())
        .unwrap_or(host_ip);
    status.insert("hostIP".into(), json!(host_ip));
    // Replaced, not merged by `ip`: a host IP that changes (the downstream
    // Pod's Node became known) must not leave the old one first in the list.
    status.insert(
        "hostIPs".into(),
        json!([{ "ip": host_ip }, { "$patch": "replace" }]),
    );
    status.insert(
        "startTime".into(),
        json!(time(start_time(rec, timeline, now))),
    );
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
        if timeline.bound.is_none() {
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
    annotations.insert(TIMELINE.into(), json!(timeline.render()));
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
pub(super) fn condition_reason(
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

pub(in crate::pods) fn container_json(
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
        // The API's int32; a backend's larger count is held at its top.
        "restartCount": c.restart_count.min(i32::MAX.unsigned_abs()),
        "state": state,
        "lastState": last,
    })
}
