//! A downstream Pod's status as vkd's [`Instance`]: what the downstream
//! kubelet reported, passed through as a kubelet would report it upstream.

use std::time::SystemTime;

use k8s_openapi::api::core::v1::{self as core, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use vkd_provider::{ContainerState, ContainerStatus, Instance, InstancePhase, PodRef, Terminated};

use crate::naming;

fn time(t: Option<&Time>) -> Option<SystemTime> {
    t.map(|t| SystemTime::from(t.0))
}

fn terminated(t: &core::ContainerStateTerminated) -> Terminated {
    let started_at = time(t.started_at.as_ref());
    Terminated {
        exit_code: t.exit_code,
        reason: t.reason.clone().unwrap_or_else(|| {
            if t.exit_code == 0 {
                "Completed"
            } else {
                "Error"
            }
            .into()
        }),
        message: t.message.clone().filter(|m| !m.is_empty()),
        started_at,
        // The API requires finishedAt; a kubelet that omitted it ended the
        // container no earlier than it started.
        finished_at: time(t.finished_at.as_ref())
            .or(started_at)
            .unwrap_or(SystemTime::UNIX_EPOCH),
    }
}

fn state(s: Option<&core::ContainerState>) -> ContainerState {
    let waiting = |reason: &str, message: Option<String>| ContainerState::Waiting {
        reason: reason.into(),
        message,
    };
    let Some(s) = s else {
        return waiting("ContainerCreating", None);
    };
    if let Some(t) = &s.terminated {
        return ContainerState::Terminated(terminated(t));
    }
    if let Some(r) = &s.running {
        return ContainerState::Running {
            started_at: time(r.started_at.as_ref()).unwrap_or(SystemTime::UNIX_EPOCH),
        };
    }
    let w = s.waiting.as_ref();
    waiting(
        w.and_then(|w| w.reason.as_deref())
            .unwrap_or("ContainerCreating"),
        w.and_then(|w| w.message.clone()),
    )
}

fn container(c: &core::ContainerStatus) -> ContainerStatus {
    ContainerStatus {
        name: c.name.clone(),
        state: state(c.state.as_ref()),
        last_termination: c
            .last_state
            .as_ref()
            .and_then(|s| s.terminated.as_ref())
            .map(terminated),
        ready: c.ready,
        restart_count: u32::try_from(c.restart_count).unwrap_or(0),
        container_id: c.container_id.clone().filter(|id| !id.is_empty()),
        started: c.started,
    }
}

/// Each container of `names`, with its reported status or waiting to be created.
fn statuses(names: &[&str], reported: Option<&Vec<core::ContainerStatus>>) -> Vec<ContainerStatus> {
    names
        .iter()
        .map(|name| {
            reported
                .into_iter()
                .flatten()
                .find(|c| c.name == *name)
                .map_or_else(|| ContainerStatus::creating(name), container)
        })
        .collect()
}

fn as_refs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

/// The instance a downstream Pod is; `None` for a Pod vkd did not make.
pub fn instance(cluster: &str, pod: &Pod) -> Option<Instance> {
    let meta = &pod.metadata;
    let labels = meta.labels.as_ref()?;
    let annotations = meta.annotations.as_ref();
    let uid = labels.get(naming::OWNER_UID)?.clone();
    let node = labels.get(naming::OWNER_NODE)?.clone();
    let epoch = labels
        .get(naming::EPOCH)
        .and_then(|e| e.parse().ok())
        .unwrap_or(0);
    let annotation = |k: &str| {
        annotations
            .and_then(|a| a.get(k))
            .cloned()
            .unwrap_or_default()
    };
    let namespace = meta.namespace.clone().unwrap_or_default();
    let name = meta.name.clone().unwrap_or_default();
    let spec = pod.spec.as_ref();
    let status = pod.status.as_ref();
    let names = |list: Option<&Vec<core::Container>>| -> Vec<String> {
        list.into_iter().flatten().map(|c| c.name.clone()).collect()
    };
    let main = names(spec.map(|s| &s.containers));
    let init = names(spec.and_then(|s| s.init_containers.as_ref()));
    let phase = match status.and_then(|s| s.phase.as_deref()) {
        Some("Running") => InstancePhase::Running,
        Some("Succeeded") => InstancePhase::Succeeded,
        Some("Failed") => InstancePhase::Failed,
        _ => InstancePhase::Pending,
    };
    let reason = status.and_then(|s| s.reason.clone());
    let message = status.and_then(|s| s.message.clone());
    let message = match (reason, message) {
        (Some(r), Some(m)) => Some(format!("downstream {r}: {m}")),
        (Some(r), None) => Some(format!("downstream {r}")),
        (None, m) => m,
    };
    Some(Instance {
        id: naming::instance_id(cluster, &namespace, &name),
        owner: PodRef {
            uid,
            namespace: annotation(naming::OWNER_NAMESPACE),
            name: annotation(naming::OWNER_NAME),
        },
        node,
        epoch,
        phase,
        containers: statuses(
            &as_refs(&main),
            status.and_then(|s| s.container_statuses.as_ref()),
        ),
        ip: status
            .and_then(|s| s.pod_ip.clone())
            .filter(|ip| !ip.is_empty()),
        host: spec.and_then(|s| s.node_name.clone()),
        created_at: time(meta.creation_timestamp.as_ref()).unwrap_or_else(SystemTime::now),
        started_at: time(status.and_then(|s| s.start_time.as_ref())),
        message,
        init_containers: statuses(
            &as_refs(&init),
            status.and_then(|s| s.init_container_statuses.as_ref()),
        ),
        ephemeral_containers: Vec::new(),
        // The downstream kubelet's Events stay in the downstream cluster.
        events: Vec::new(),
        host_ip: status
            .and_then(|s| s.host_ip.clone())
            .filter(|ip| !ip.is_empty()),
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // a failed unwrap is a failed test
    use super::*;
    use serde_json::json;

    fn pod(status: serde_json::Value) -> Pod {
        serde_json::from_value(json!({
            "metadata": {
                "name": "vkd-u1", "namespace": "vkd-team",
                "creationTimestamp": "2026-01-01T00:00:00Z",
                "labels": {"vkd.io/owner-uid": "u1", "vkd.io/owner-node": "vk", "vkd.io/epoch": "3"},
                "annotations": {"vkd.io/owner-namespace": "team", "vkd.io/owner-name": "web"}
            },
            "spec": {
                "nodeName": "host-a",
                "initContainers": [{"name": "setup", "image": "x"}],
                "containers": [{"name": "main", "image": "x"}, {"name": "side", "image": "x"}]
            },
            "status": status
        }))
        .unwrap()
    }

    #[test]
    fn reports_what_the_downstream_kubelet_reported() {
        let p = pod(json!({
            "phase": "Running", "podIP": "10.1.0.7", "startTime": "2026-01-01T00:00:01Z",
            "initContainerStatuses": [{"name": "setup", "image": "x", "imageID": "", "ready": true, "restartCount": 0,
                "state": {"terminated": {"exitCode": 0, "reason": "Completed",
                    "startedAt": "2026-01-01T00:00:01Z", "finishedAt": "2026-01-01T00:00:02Z"}}}],
            "containerStatuses": [{"name": "main", "image": "x", "imageID": "", "ready": true, "restartCount": 2,
                "started": true, "containerID": "process://abc",
                "state": {"running": {"startedAt": "2026-01-01T00:00:03Z"}},
                "lastState": {"terminated": {"exitCode": 137, "reason": "OOMKilled",
                    "finishedAt": "2026-01-01T00:00:02Z"}}}]
        }));
        let i = instance("down", &p).unwrap();
        assert_eq!(i.id, "down/vkd-team/vkd-u1");
        assert_eq!(
            (
                i.owner.uid.as_str(),
                i.owner.namespace.as_str(),
                i.owner.name.as_str()
            ),
            ("u1", "team", "web")
        );
        assert_eq!((i.node.as_str(), i.epoch), ("vk", 3));
        assert_eq!(i.phase, InstancePhase::Running);
        assert_eq!(i.ip.as_deref(), Some("10.1.0.7"));
        assert_eq!(i.host.as_deref(), Some("host-a"));
        let main = &i.containers[0];
        assert!(main.ready && main.restart_count == 2 && main.started == Some(true));
        assert!(matches!(main.state, ContainerState::Running { .. }));
        assert_eq!(main.last_termination.as_ref().unwrap().reason, "OOMKilled");
        assert_eq!(main.container_id.as_deref(), Some("process://abc"));
        // Not yet reported: waiting to be created, never ready.
        assert!(
            matches!(&i.containers[1].state, ContainerState::Waiting { reason, .. } if reason == "ContainerCreating")
        );
        assert!(
            matches!(&i.init_containers[0].state, ContainerState::Terminated(t) if t.exit_code == 0)
        );
    }

    #[test]
    fn an_eviction_says_so_and_foreign_pods_are_not_instances() {
        let p = pod(
            json!({"phase": "Failed", "reason": "Evicted", "message": "The node was low on resource: memory."}),
        );
        let i = instance("down", &p).unwrap();
        assert_eq!(i.phase, InstancePhase::Failed);
        assert_eq!(
            i.message.as_deref(),
            Some("downstream Evicted: The node was low on resource: memory.")
        );
        let mut foreign = p.clone();
        foreign.metadata.labels = None;
        assert!(instance("down", &foreign).is_none());
    }
}
