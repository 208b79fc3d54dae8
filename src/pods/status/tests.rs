use std::time::{Duration, SystemTime};

use k8s_openapi::api::core::v1::Pod;
use serde_json::json;
use vkd_provider::{ContainerState, ContainerStatus, Instance, InstancePhase, PodRef, Terminated};

use super::*;
use crate::pods::record::PodRecord;

fn record() -> PodRecord {
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": "web-1", "namespace": "ns", "uid": "u1"},
        "spec": {"containers": [{"name": "app", "image": "nginx"}, {"name": "side", "image": "envoy"}]},
        "status": {"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "True"}]}
    }))
    .unwrap();
    PodRecord::from_pod(&pod, "vk", None, SystemTime::now()).unwrap()
}

fn instance(phase: InstancePhase, states: [(ContainerState, bool); 2]) -> Instance {
    let t0 = SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000);
    Instance {
        id: "sim-abc".into(),
        owner: PodRef {
            uid: "u1".into(),
            namespace: "ns".into(),
            name: "web-1".into(),
        },
        node: "vk".into(),
        epoch: 1,
        phase,
        containers: ["app", "side"]
            .into_iter()
            .zip(states)
            .map(|(name, (state, ready))| ContainerStatus {
                name: name.into(),
                state,
                last_termination: None,
                ready,
                restart_count: 0,
                container_id: Some(format!("sim://sim-abc-{name}")),
            })
            .collect(),
        ip: Some("10.100.0.2".into()),
        host: Some("host-a".into()),
        created_at: t0,
        started_at: Some(t0),
        message: None,
    }
}

fn running() -> ContainerState {
    ContainerState::Running {
        started_at: SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_001),
    }
}

#[test]
fn waiting_pods_say_why() {
    let rec = record();
    let v = desired_view(
        &rec,
        None,
        &Waiting::Queued("waiting for 4 free nvidia.com/gpu".into()),
    );
    assert_eq!(v.phase, "Pending");
    assert_eq!(v.containers.len(), 2);
    assert_eq!(
        v.containers[0].state,
        StateView::Waiting {
            reason: "BackendQueued".into(),
            message: Some("waiting for 4 free nvidia.com/gpu".into())
        }
    );
    assert_eq!(
        v.conditions,
        [Some(false), Some(true), Some(false), Some(false)]
    );
}

#[test]
fn ready_only_when_every_container_is() {
    let rec = record();
    let half = instance(
        InstancePhase::Running,
        [(running(), true), (running(), false)],
    );
    let v = desired_view(&rec, Some(&half), &Waiting::Creating);
    assert_eq!(v.phase, "Running");
    assert_eq!(
        v.conditions,
        [Some(true), Some(true), Some(false), Some(false)]
    );
    let body = patch_body(&rec, &v, Some(&half), "127.0.0.1", SystemTime::now());
    let ready = body["status"]["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["type"] == "Ready")
        .unwrap();
    assert_eq!(ready["reason"], "ContainersNotReady");
    assert_eq!(ready["message"], "containers with unready status: [side]");

    let all = instance(
        InstancePhase::Running,
        [(running(), true), (running(), true)],
    );
    let v = desired_view(&rec, Some(&all), &Waiting::Creating);
    assert_eq!(v.conditions, [Some(true); 4]);
    assert_eq!(v.pod_ip.as_deref(), Some("10.100.0.2"));
    assert_eq!(v.instance_id.as_deref(), Some("sim-abc"));
}

#[test]
fn patch_is_kubelet_shaped() {
    let rec = record();
    let inst = instance(
        InstancePhase::Running,
        [(running(), true), (running(), true)],
    );
    let v = desired_view(&rec, Some(&inst), &Waiting::Creating);
    let body = patch_body(&rec, &v, Some(&inst), "192.0.2.1", SystemTime::now());
    let s = &body["status"];
    assert_eq!(s["phase"], "Running");
    assert_eq!(s["podIP"], "10.100.0.2");
    assert_eq!(s["podIPs"][0]["ip"], "10.100.0.2");
    assert_eq!(s["hostIP"], "192.0.2.1");
    assert!(s["startTime"].as_str().unwrap().ends_with('Z'));
    let c = &s["containerStatuses"][0];
    assert_eq!(c["name"], "app");
    assert_eq!(c["image"], "nginx");
    assert_eq!(c["containerID"], "sim://sim-abc-app");
    assert_eq!(c["started"], true);
    assert_eq!(c["state"]["running"]["startedAt"], "2027-01-15T08:00:01Z");
    // The other states are cleared explicitly: a strategic merge would keep them.
    assert!(c["state"].get("waiting").is_some_and(|w| w.is_null()));
    assert_eq!(body["metadata"]["annotations"][INSTANCE_ID], "sim-abc");
    assert!(
        !s["conditions"]
            .as_array()
            .unwrap()
            .iter()
            .any(|c| c["type"] == "PodScheduled")
    );
}

#[test]
fn terminated_containers_map_exit_codes() {
    let rec = record();
    let t = |code: i32, reason: &str| {
        ContainerState::Terminated(Terminated {
            exit_code: code,
            reason: reason.into(),
            message: None,
            started_at: None,
            finished_at: SystemTime::UNIX_EPOCH,
        })
    };
    let inst = instance(
        InstancePhase::Failed,
        [(t(0, "Completed"), false), (t(137, "OOMKilled"), false)],
    );
    let v = desired_view(&rec, Some(&inst), &Waiting::Creating);
    assert_eq!(v.phase, "Failed");
    assert_eq!(
        v.containers[1].state,
        StateView::Terminated {
            exit_code: 137,
            reason: "OOMKilled".into()
        }
    );
    assert_eq!(
        v.conditions[0],
        Some(false),
        "a finished Pod's sandbox is gone"
    );
    let body = patch_body(&rec, &v, Some(&inst), "127.0.0.1", SystemTime::now());
    assert_eq!(
        body["status"]["containerStatuses"][1]["state"]["terminated"]["exitCode"],
        137
    );
}

#[test]
fn what_we_wrote_reads_back_as_the_same_view() {
    // The no-op check: after our patch is applied, the watched Pod's view equals the desired one.
    let rec = record();
    let inst = instance(
        InstancePhase::Running,
        [(running(), true), (running(), false)],
    );
    let v = desired_view(&rec, Some(&inst), &Waiting::Creating);
    let body = patch_body(&rec, &v, Some(&inst), "127.0.0.1", SystemTime::now());
    let mut pod = json!({
        "metadata": {"name": "web-1", "namespace": "ns", "uid": "u1"},
        "spec": {"containers": [{"name": "app", "image": "nginx"}, {"name": "side", "image": "envoy"}]},
    });
    pod["metadata"]["annotations"] = body["metadata"]["annotations"].clone();
    let mut status = body["status"].clone();
    strip_nulls(&mut status);
    pod["status"] = status;
    let pod: Pod = serde_json::from_value(pod).unwrap();
    assert_eq!(view_of_pod(&pod), v);
    assert_eq!(view_of_pod(&pod).digest(), v.digest());
}

fn strip_nulls(v: &mut serde_json::Value) {
    match v {
        serde_json::Value::Object(m) => {
            m.retain(|_, x| !x.is_null());
            m.values_mut().for_each(strip_nulls);
        }
        serde_json::Value::Array(a) => a.iter_mut().for_each(strip_nulls),
        _ => {}
    }
}

#[test]
fn failed_admission_view() {
    let v = failed_view(
        "TopologyUnsatisfiable",
        "needs 8 nvidia.com/gpu on one host",
    );
    assert_eq!(v.phase, "Failed");
    assert_eq!(v.reason.as_deref(), Some("TopologyUnsatisfiable"));
}
