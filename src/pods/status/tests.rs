use std::time::{Duration, SystemTime};

use k8s_openapi::api::core::v1::Pod;
use serde_json::json;
use vkd_provider::{ContainerState, ContainerStatus, Instance, InstancePhase, PodRef, Terminated};

use super::*;
use crate::pods::model::PodRecord;

fn record() -> PodRecord {
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": "web-1", "namespace": "ns", "uid": "u1"},
        "spec": {"containers": [{"name": "app", "image": "nginx"}, {"name": "side", "image": "envoy"}]},
        "status": {"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "True"}]}
    }))
    .unwrap();
    super::record_of(&pod, "vk", SystemTime::now()).unwrap()
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
                started: None,
            })
            .collect(),
        ip: Some("10.100.0.2".into()),
        host: Some("host-a".into()),
        created_at: t0,
        started_at: Some(t0),
        message: None,
        init_containers: Vec::new(),
        ephemeral_containers: Vec::new(),
        host_ip: None,
        events: Vec::new(),
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
fn a_backends_numbers_and_addresses_the_api_would_refuse_are_not_written() {
    let rec = record();
    let mut inst = instance(
        InstancePhase::Running,
        [(running(), true), (running(), true)],
    );
    inst.ip = Some("10.100.0.2; rm".into());
    inst.host_ip = Some("gpu-host-7".into());
    inst.containers[0].restart_count = u32::MAX;
    let v = desired_view(&rec, Some(&inst), &Waiting::Creating);
    let body = patch_body(&rec, &v, Some(&inst), "192.0.2.1", SystemTime::now());
    let s = &body["status"];
    assert!(s.get("podIP").is_none(), "{s}");
    assert_eq!(s["hostIP"], "192.0.2.1");
    assert_eq!(s["containerStatuses"][0]["restartCount"], i32::MAX);
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
    let terminated = &body["status"]["containerStatuses"][1]["state"]["terminated"];
    assert_eq!(terminated["exitCode"], 137);
    // It never started: no end time either, never an end without a start
    // (Kubernetes' own node e2e checks for that).
    assert!(terminated["startedAt"].is_null(), "{terminated}");
    assert!(terminated["finishedAt"].is_null(), "{terminated}");
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

/// A Pod with two init containers (the second a sidecar) and one container.
fn init_record(restart_policy: &str) -> PodRecord {
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": "web-1", "namespace": "ns", "uid": "u1"},
        "spec": {
            "restartPolicy": restart_policy,
            "initContainers": [
                {"name": "init1", "image": "busybox"},
                {"name": "proxy", "image": "envoy", "restartPolicy": "Always"}
            ],
            "containers": [{"name": "app", "image": "nginx"}]
        },
        "status": {"phase": "Pending"}
    }))
    .unwrap();
    super::record_of(&pod, "vk", SystemTime::now()).unwrap()
}

fn status_of(name: &str, state: ContainerState) -> ContainerStatus {
    ContainerStatus {
        name: name.into(),
        state,
        last_termination: None,
        ready: false,
        restart_count: 0,
        container_id: Some(format!("process://{name}")),
        started: None,
    }
}

fn waiting(reason: &str) -> ContainerState {
    ContainerState::Waiting {
        reason: reason.into(),
        message: None,
    }
}

fn ended(code: i32) -> ContainerState {
    ContainerState::Terminated(Terminated {
        exit_code: code,
        reason: if code == 0 { "Completed" } else { "Error" }.into(),
        message: None,
        started_at: None,
        finished_at: SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_002),
    })
}

fn init_instance(
    phase: InstancePhase,
    init: Vec<ContainerStatus>,
    app: ContainerStatus,
) -> Instance {
    let mut i = instance(phase, [(running(), true), (running(), true)]);
    i.containers = vec![app];
    i.init_containers = init;
    i
}

fn condition(body: &serde_json::Value, t: &str) -> serde_json::Value {
    body["status"]["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["type"] == t)
        .cloned()
        .unwrap()
}

/// What was written reads back from the Pod as the same view (no patch loop).
fn round_trips(rec: &PodRecord, v: &StatusView, inst: Option<&Instance>) {
    let body = patch_body(rec, v, inst, "127.0.0.1", SystemTime::now());
    let mut pod = json!({"metadata": {"name": "web-1", "namespace": "ns", "uid": "u1"},
        "spec": {"containers": [{"name": "app", "image": "nginx"}]}});
    pod["metadata"]["annotations"] = body["metadata"]["annotations"].clone();
    let mut status = body["status"].clone();
    strip_nulls(&mut status);
    pod["status"] = status;
    let pod: Pod = serde_json::from_value(pod).unwrap();
    assert_eq!(&view_of_pod(&pod), v);
}

#[test]
fn init_containers_have_statuses_and_hold_initialized() {
    let rec = init_record("Always");
    // Before the instance exists: everything waits, Initialized is False.
    let v = desired_view(&rec, None, &Waiting::Creating);
    assert_eq!(v.init_containers.len(), 2);
    assert!(v.init_containers.iter().chain(&v.containers).all(
        |c| matches!(&c.state, StateView::Waiting { reason, .. } if reason == "PodInitializing")
    ));
    assert_eq!(v.conditions[1], Some(false));
    let body = patch_body(&rec, &v, None, "127.0.0.1", SystemTime::now());
    let init = condition(&body, "Initialized");
    assert_eq!(init["reason"], "ContainersNotInitialized");
    assert_eq!(
        init["message"],
        "containers with incomplete status: [init1 proxy]"
    );
    assert_eq!(body["status"]["initContainerStatuses"][1]["name"], "proxy");
    round_trips(&rec, &v, None);
    // Queued: the first init container says why (kubectl: Init:BackendQueued).
    let v = desired_view(&rec, None, &Waiting::Queued("no GPU".into()));
    assert!(
        matches!(&v.init_containers[0].state, StateView::Waiting { reason, .. } if reason == "BackendQueued")
    );

    // init1 runs; the backend's "ContainerCreating" for app reads PodInitializing.
    let inst = init_instance(
        InstancePhase::Pending,
        vec![
            status_of("init1", running()),
            status_of("proxy", waiting("PodInitializing")),
        ],
        status_of("app", waiting("ContainerCreating")),
    );
    let v = desired_view(&rec, Some(&inst), &Waiting::Creating);
    assert_eq!(v.phase, "Pending");
    assert_eq!(
        v.conditions,
        [Some(true), Some(false), Some(false), Some(false)]
    );
    assert!(
        matches!(&v.containers[0].state, StateView::Waiting { reason, .. } if reason == "PodInitializing")
    );
    assert!(
        !v.init_containers[0].ready,
        "a running init container is not ready"
    );
    let body = patch_body(&rec, &v, Some(&inst), "127.0.0.1", SystemTime::now());
    assert!(
        body["status"]["initContainerStatuses"][0]["state"]["running"]["startedAt"].is_string()
    );
    round_trips(&rec, &v, Some(&inst));

    // init1 completed, the sidecar started but not ready: Initialized, not Ready.
    let mut proxy = status_of("proxy", running());
    proxy.started = Some(true);
    let inst = init_instance(
        InstancePhase::Running,
        vec![status_of("init1", ended(0)), proxy.clone()],
        ContainerStatus {
            ready: true,
            ..status_of("app", running())
        },
    );
    let v = desired_view(&rec, Some(&inst), &Waiting::Creating);
    assert_eq!(
        v.conditions,
        [Some(true), Some(true), Some(false), Some(false)]
    );
    assert!(
        v.init_containers[0].ready,
        "a completed init container is ready"
    );
    let body = patch_body(&rec, &v, Some(&inst), "127.0.0.1", SystemTime::now());
    assert_eq!(
        condition(&body, "Ready")["message"],
        "containers with unready status: [proxy]"
    );
    assert_eq!(body["status"]["initContainerStatuses"][1]["started"], true);
    round_trips(&rec, &v, Some(&inst));
    // The sidecar's readiness counts toward the Pod's.
    let mut inst = inst;
    inst.init_containers[1].ready = true;
    let v = desired_view(&rec, Some(&inst), &Waiting::Creating);
    assert_eq!(v.conditions, [Some(true); 4]);
}

#[test]
fn a_failing_init_container_is_reported_as_the_kubelet_does() {
    // restartPolicy Always: back-off, the Pod stays Pending, both incomplete.
    let rec = init_record("Always");
    let mut init1 = status_of(
        "init1",
        ContainerState::Waiting {
            reason: "CrashLoopBackOff".into(),
            message: Some("back-off 10s restarting failed container".into()),
        },
    );
    init1.restart_count = 2;
    init1.last_termination = Some(Terminated {
        exit_code: 1,
        reason: "Error".into(),
        message: None,
        started_at: None,
        finished_at: SystemTime::UNIX_EPOCH,
    });
    let inst = init_instance(
        InstancePhase::Pending,
        vec![init1, status_of("proxy", waiting("PodInitializing"))],
        status_of("app", waiting("PodInitializing")),
    );
    let v = desired_view(&rec, Some(&inst), &Waiting::Creating);
    assert_eq!(v.phase, "Pending");
    let body = patch_body(&rec, &v, Some(&inst), "127.0.0.1", SystemTime::now());
    let init = condition(&body, "Initialized");
    assert_eq!(init["status"], "False");
    assert_eq!(
        init["message"],
        "containers with incomplete status: [init1 proxy]"
    );
    let s = &body["status"]["initContainerStatuses"][0];
    assert_eq!(s["state"]["waiting"]["reason"], "CrashLoopBackOff");
    assert_eq!(s["lastState"]["terminated"]["exitCode"], 1);
    assert_eq!(s["restartCount"], 2);

    // restartPolicy Never: the Pod fails, the container never leaves PodInitializing.
    let rec = init_record("Never");
    let inst = init_instance(
        InstancePhase::Failed,
        vec![status_of("init1", ended(0)), status_of("proxy", ended(2))],
        status_of("app", waiting("PodInitializing")),
    );
    let v = desired_view(&rec, Some(&inst), &Waiting::Creating);
    assert_eq!(v.phase, "Failed");
    let body = patch_body(&rec, &v, Some(&inst), "127.0.0.1", SystemTime::now());
    assert_eq!(
        condition(&body, "Initialized")["message"],
        "containers with incomplete status: [proxy]"
    );
    assert_eq!(condition(&body, "Ready")["reason"], "PodFailed");
    assert_eq!(
        body["status"]["containerStatuses"][0]["state"]["waiting"]["reason"],
        "PodInitializing"
    );
}

#[test]
fn a_stopped_instance_gives_the_final_status() {
    let rec = init_record("Always");
    let mut proxy = status_of("proxy", ended(0));
    proxy.started = Some(false);
    // The backend saw every end: exit codes as they were, Succeeded when all exited 0.
    let inst = init_instance(
        InstancePhase::Running,
        vec![status_of("init1", ended(0)), proxy.clone()],
        status_of("app", ended(0)),
    );
    let end = terminal_instance(&rec, Some(inst), SystemTime::now());
    assert_eq!(end.phase, InstancePhase::Succeeded);
    let v = desired_view(&rec, Some(&end), &Waiting::Creating);
    assert_eq!(v.phase, "Succeeded");
    assert_eq!(v.conditions[1], Some(true));
    let body = patch_body(&rec, &v, Some(&end), "127.0.0.1", SystemTime::now());
    assert_eq!(condition(&body, "Initialized")["reason"], "PodCompleted");
    assert_eq!(
        body["status"]["containerStatuses"][0]["state"]["terminated"]["reason"],
        "Completed"
    );
    // The instance went before its end was seen: what still ran ended unknown (137).
    let mut sidecar = status_of("proxy", running());
    sidecar.started = Some(true);
    let inst = init_instance(
        InstancePhase::Running,
        vec![status_of("init1", ended(0)), sidecar],
        status_of("app", running()),
    );
    let end = terminal_instance(&rec, Some(inst), SystemTime::now());
    assert_eq!(end.phase, InstancePhase::Failed);
    for c in end.containers.iter().chain(&end.init_containers[1..]) {
        assert!(
            matches!(&c.state, ContainerState::Terminated(t) if t.exit_code == 137 && t.reason == "ContainerStatusUnknown"),
            "{c:?}"
        );
        assert!(!c.ready && !c.has_started());
    }
    assert!(
        matches!(&end.init_containers[0].state, ContainerState::Terminated(t) if t.exit_code == 0)
    );
    let v = desired_view(&rec, Some(&end), &Waiting::Creating);
    assert_eq!(v.phase, "Failed");
    round_trips(&rec, &v, Some(&end));
    // Never seen at all (deleted while queued): Failed, with no instance named.
    let end = terminal_instance(&record(), None, SystemTime::now());
    assert_eq!(end.phase, InstancePhase::Failed);
    let v = desired_view(&record(), Some(&end), &Waiting::Creating);
    assert_eq!(v.instance_id, None);
    assert!(
        v.containers
            .iter()
            .all(|c| matches!(&c.state, StateView::Terminated { exit_code: 137, .. }))
    );
    // Not initialized: the containers keep waiting, the init container that ran ends unknown.
    let inst = init_instance(
        InstancePhase::Pending,
        vec![
            status_of("init1", running()),
            ContainerStatus {
                container_id: None,
                ..status_of("proxy", waiting("PodInitializing"))
            },
        ],
        ContainerStatus {
            container_id: None,
            ..status_of("app", waiting("PodInitializing"))
        },
    );
    let end = terminal_instance(&rec, Some(inst), SystemTime::now());
    assert_eq!(end.phase, InstancePhase::Failed);
    assert!(matches!(
        end.containers[0].state,
        ContainerState::Waiting { .. }
    ));
    assert!(matches!(
        end.init_containers[1].state,
        ContainerState::Waiting { .. }
    ));
    assert!(
        matches!(&end.init_containers[0].state, ContainerState::Terminated(t) if t.exit_code == 137)
    );
}

#[test]
fn observed_generation_is_written_and_read_back() {
    // Since 1.34 the kubelet answers each spec generation in status and conditions;
    // a new generation alone must make the status differ from what is stored.
    let mut rec = record();
    rec.seen_mut().generation = 3;
    let inst = instance(
        InstancePhase::Running,
        [(running(), true), (running(), true)],
    );
    let mut v = desired_view(&rec, Some(&inst), &Waiting::Creating);
    v.observed_generation = Some(rec.generation);
    let body = patch_body(&rec, &v, Some(&inst), "127.0.0.1", SystemTime::now());
    assert_eq!(body["status"]["observedGeneration"], 3);
    assert_eq!(condition(&body, "Ready")["observedGeneration"], 3);
    // The scheduler's condition too, as the kubelet writes it back. Bound by
    // spec.nodeName, it has no time yet, and gets one.
    let scheduled = condition(&body, "PodScheduled");
    assert_eq!(scheduled["observedGeneration"], 3);
    assert_eq!(scheduled["status"], "True");
    assert!(scheduled["lastTransitionTime"].is_string());
    // Bound by the scheduler, its transition time stays the scheduler's
    // (merged by type, not written).
    let mut bound = rec.clone();
    bound.progress.timeline.bound = Some(crate::pods::model::Stamp::now());
    let body2 = patch_body(&bound, &v, Some(&inst), "127.0.0.1", SystemTime::now());
    assert!(
        condition(&body2, "PodScheduled")
            .get("lastTransitionTime")
            .is_none()
    );
    let mut pod = json!({
        "metadata": {"name": "web-1", "namespace": "ns", "uid": "u1", "generation": 3},
        "spec": {"containers": [{"name": "app", "image": "nginx"}, {"name": "side", "image": "envoy"}]},
    });
    pod["metadata"]["annotations"] = body["metadata"]["annotations"].clone();
    let mut status = body["status"].clone();
    strip_nulls(&mut status);
    pod["status"] = status;
    let pod: Pod = serde_json::from_value(pod).unwrap();
    assert_eq!(view_of_pod(&pod).digest(), v.digest());
    let mut next = v.clone();
    next.observed_generation = Some(4);
    assert_ne!(view_of_pod(&pod).digest(), next.digest());
}

#[test]
fn an_unmet_readiness_gate_keeps_ready_false() {
    let mut rec = record();
    rec.seen_mut().readiness_gates_ready = false;
    let inst = instance(
        InstancePhase::Running,
        [(running(), true), (running(), true)],
    );
    let v = desired_view(&rec, Some(&inst), &Waiting::Creating);
    let body = patch_body(&rec, &v, Some(&inst), "127.0.0.1", SystemTime::now());
    assert_eq!(condition(&body, "ContainersReady")["status"], "True");
    assert_eq!(condition(&body, "Ready")["status"], "False");
    assert_eq!(
        condition(&body, "Ready")["reason"],
        "ReadinessGatesNotReady"
    );
    rec.seen_mut().readiness_gates_ready = true;
    let v = desired_view(&rec, Some(&inst), &Waiting::Creating);
    let body = patch_body(&rec, &v, Some(&inst), "127.0.0.1", SystemTime::now());
    assert_eq!(condition(&body, "Ready")["status"], "True");
}
