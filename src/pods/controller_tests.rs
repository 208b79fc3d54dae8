//! The reconcile loop against a fake API server and a scripted provider:
//! active deadlines and containers that cannot be configured.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use serde_json::json;
use vkd_provider::Instance;

use super::test_support::{
    Scripted, answer, controller, controller_answering, controller_with, events, patches,
    wait_events,
};
use super::{Action, Lane, PodController};
use tokio_util::sync::CancellationToken;

fn running_instance() -> Instance {
    let t = json!({"secs_since_epoch": 1_767_225_600, "nanos_since_epoch": 0});
    serde_json::from_value(json!({
        "id": "i-1",
        "owner": {"uid": "u1", "namespace": "ns", "name": "p"},
        "node": "vk",
        "epoch": 1,
        "phase": "Running",
        "containers": [{"name": "main", "state": {"Running": {"started_at": t}},
            "last_termination": null, "ready": true, "restart_count": 0,
            "container_id": "scripted://1"}],
        "ip": null,
        "host": null,
        "created_at": t,
        "started_at": t,
        "message": null
    }))
    .unwrap()
}

/// A running Pod whose activeDeadlineSeconds has passed: the instance is
/// stopped with the Pod's grace period, and only once the backend no longer
/// runs it is the Pod Failed with the kubelet's reason and message.
#[tokio::test]
async fn a_passed_active_deadline_stops_the_instance_then_fails_the_pod() {
    let provider = Arc::new(Scripted::default());
    *provider.instance.lock().unwrap() = Some(running_instance());
    let (c, log) = controller(Arc::clone(&provider));
    let start = SystemTime::now() - Duration::from_secs(60);
    let pod: k8s_openapi::api::core::v1::Pod = serde_json::from_value(json!({
        "metadata": {"name": "p", "namespace": "ns", "uid": "u1",
            "annotations": {"vkd.io/instance-id": "i-1"}},
        "spec": {"nodeName": "vk", "activeDeadlineSeconds": 5, "terminationGracePeriodSeconds": 7,
            "containers": [{"name": "main", "image": "x"}]},
        "status": {"phase": "Running", "startTime": super::status::time(start)}
    }))
    .unwrap();
    c.upsert(&pod);

    let first = c.reconcile("u1", Lane::Any).await.unwrap();
    assert_eq!(first, Action::After(super::DELETE_CONFIRM));
    assert_eq!(
        *provider.deletes.lock().unwrap(),
        vec![("u1".to_owned(), Duration::from_secs(7))]
    );
    assert!(patches(&log).is_empty(), "Failed while it may still run");

    // The backend confirms: the instance is gone.
    *provider.instance.lock().unwrap() = None;
    let second = c.reconcile("u1", Lane::Any).await.unwrap();
    assert_eq!(second, Action::Done);
    let p = patches(&log);
    assert_eq!(p.len(), 1, "{p:?}");
    let s = &p[0]["status"];
    assert_eq!(s["phase"], "Failed");
    assert_eq!(s["reason"], super::DEADLINE_REASON);
    assert_eq!(
        s["message"],
        "Pod was active on the node longer than the specified deadline"
    );
    let term = &s["containerStatuses"][0]["state"]["terminated"];
    assert_eq!(term["exitCode"], 137, "{s}");
    assert_eq!(term["reason"], "ContainerStatusUnknown");
    let ready = s["conditions"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["type"] == "Ready")
        .unwrap();
    assert_eq!(ready["status"], "False");
    let e = wait_events(&log, 1).await;
    assert_eq!(e[0]["reason"], "DeadlineExceeded");
    assert_eq!(e[0]["type"], "Normal");
    assert!(c.records()["u1"].progress.failing.is_none());
    // Terminal now: nothing more is done.
    assert_eq!(c.reconcile("u1", Lane::Any).await.unwrap(), Action::Done);
    assert_eq!(patches(&log).len(), 1);
}

/// Every status patch names the Pod's UID, as the kubelet's does: a Pod
/// deleted and made again under the same name (a StatefulSet's) while a
/// reconcile of the old one is in flight refuses the old one's status and
/// instance id, and that refusal reads as the old Pod being gone.
#[tokio::test]
async fn a_status_patch_is_for_its_pods_uid_only() {
    let provider = Arc::new(Scripted::default());
    *provider.instance.lock().unwrap() = Some(running_instance());
    let replaced = std::sync::atomic::AtomicBool::new(false);
    let replaced = Arc::new(replaced);
    let now_replaced = Arc::clone(&replaced);
    let (c, log) = controller_answering(
        Arc::clone(&provider),
        |_| {},
        move |req| {
            let uid = &req.body["metadata"]["uid"];
            if req.method == "PATCH" && now_replaced.load(std::sync::atomic::Ordering::SeqCst) {
                // What kube-apiserver answers when the name has a new UID.
                let message = format!(
                    "Pod \"p\" is invalid: metadata.uid: Invalid value: {uid}: field is immutable"
                );
                return (
                    422,
                    json!({"apiVersion": "v1", "kind": "Status", "status": "Failure",
                        "message": message, "reason": "Invalid", "code": 422}),
                );
            }
            answer(req)
        },
    );
    let pod = |phase: &str| -> k8s_openapi::api::core::v1::Pod {
        serde_json::from_value(json!({
            "metadata": {"name": "p", "namespace": "ns", "uid": "u1",
                "annotations": {"vkd.io/instance-id": "i-1"}},
            "spec": {"nodeName": "vk", "containers": [{"name": "main", "image": "x"}]},
            "status": {"phase": phase}
        }))
        .unwrap()
    };
    c.upsert(&pod("Pending"));
    c.reconcile("u1", Lane::Any).await.unwrap();
    let p = patches(&log);
    assert_eq!(p.len(), 1, "{p:?}");
    assert_eq!(p[0]["metadata"]["uid"], "u1", "{}", p[0]);
    assert_eq!(p[0]["status"]["phase"], "Running");
    // The name now holds another Pod: the old one's next write is refused,
    // and the reconcile ends as for a Pod that is gone, not as a failure.
    replaced.store(true, std::sync::atomic::Ordering::SeqCst);
    provider
        .instance
        .lock()
        .unwrap()
        .as_mut()
        .unwrap()
        .containers[0]
        .restart_count = 1;
    let after = c.reconcile("u1", Lane::Any).await;
    assert!(after.is_ok(), "{after:?}");
    let p = patches(&log);
    assert_eq!(p.len(), 2, "{p:?}");
    assert_eq!(p[1]["metadata"]["uid"], "u1");
}

/// A deadline still ahead requeues the Pod for when it passes; a huge one
/// (tenant input) is clamped instead of overflowing the queue's clock.
#[tokio::test]
async fn a_running_pod_is_looked_at_again_at_its_deadline() {
    let provider = Arc::new(Scripted::default());
    *provider.instance.lock().unwrap() = Some(running_instance());
    let (c, _log) = controller(Arc::clone(&provider));
    for (deadline, want_max) in [
        (30_i64, Duration::from_secs(30)),
        (i64::MAX, super::DEADLINE_RECHECK_MAX),
    ] {
        let pod: k8s_openapi::api::core::v1::Pod = serde_json::from_value(json!({
            "metadata": {"name": "p", "namespace": "ns", "uid": "u1",
                "annotations": {"vkd.io/instance-id": "i-1"}},
            "spec": {"nodeName": "vk", "activeDeadlineSeconds": deadline,
                "containers": [{"name": "main", "image": "x"}]},
            "status": {"phase": "Running", "startTime": super::status::time(SystemTime::now())}
        }))
        .unwrap();
        c.upsert(&pod);
        match c.reconcile("u1", Lane::Any).await.unwrap() {
            Action::After(d) => assert!(
                d <= want_max && d + Duration::from_secs(5) >= want_max,
                "{deadline}: {d:?}"
            ),
            other => panic!("{deadline}: {other:?}"),
        }
    }
    assert!(provider.deletes.lock().unwrap().is_empty());
}

/// A container that cannot be configured waits with CreateContainerConfigError
/// and the kubelet's Warning `Failed` Event, sent once, not on every retry.
#[tokio::test]
async fn a_config_error_has_the_kubelets_event_once() {
    let provider = Arc::new(Scripted::default());
    let (c, log) = controller(Arc::clone(&provider));
    let pod: k8s_openapi::api::core::v1::Pod = serde_json::from_value(json!({
        "metadata": {"name": "p", "namespace": "ns", "uid": "u1"},
        "spec": {"nodeName": "vk", "containers": [{"name": "main", "image": "x",
            "env": [{"name": "X", "valueFrom": {"secretKeyRef": {"name": "nosuch", "key": "k"}}}]}]}
    }))
    .unwrap();
    c.upsert(&pod);
    let a = c.reconcile("u1", Lane::Any).await.unwrap();
    assert_eq!(a, Action::After(super::CONFIG_RECHECK));
    let p = patches(&log);
    let waiting = &p[0]["status"]["containerStatuses"][0]["state"]["waiting"];
    assert_eq!(waiting["reason"], "CreateContainerConfigError");
    assert_eq!(waiting["message"], "secret \"nosuch\" not found");
    let e = wait_events(&log, 1).await;
    assert_eq!(e.len(), 1);
    assert_eq!(e[0]["type"], "Warning");
    assert_eq!(e[0]["reason"], "Failed");
    assert_eq!(e[0]["note"], "Error: secret \"nosuch\" not found");
    // The retry finds the same: no second write, no second Event.
    c.reconcile("u1", Lane::Any).await.unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(patches(&log).len(), 1);
    assert_eq!(events(&log).len(), 1);
}

/// A deleted Pod whose instance is already gone (removed in a partition, say):
/// its final status says the containers ended, and keeps the Pod's IP rather
/// than adding the host's as a second one (which the API server refuses).
#[tokio::test]
async fn the_final_status_of_a_gone_instance_keeps_the_pod_ip() {
    let provider = Arc::new(Scripted::default());
    let (c, log) = controller(Arc::clone(&provider));
    let pod: k8s_openapi::api::core::v1::Pod = serde_json::from_value(json!({
        "metadata": {"name": "p", "namespace": "ns", "uid": "u1",
            "deletionTimestamp": "2026-01-01T00:00:00Z", "deletionGracePeriodSeconds": 30,
            "annotations": {"vkd.io/instance-id": "i-1"}},
        "spec": {"nodeName": "vk", "containers": [{"name": "main", "image": "x"}]},
        "status": {"phase": "Running", "podIP": "10.100.0.2", "podIPs": [{"ip": "10.100.0.2"}],
            "startTime": "2026-01-01T00:00:00Z"}
    }))
    .unwrap();
    c.upsert(&pod);
    for _ in 0..5 {
        if c.reconcile("u1", Lane::Any).await.unwrap() == Action::Done {
            break;
        }
    }
    let p = patches(&log);
    let last = p.last().expect("a final status was written");
    let s = &last["status"];
    assert_eq!(
        s["containerStatuses"][0]["state"]["terminated"]["exitCode"], 137,
        "{s}"
    );
    assert!(s.get("podIP").is_none() && s.get("podIPs").is_none(), "{s}");
}

/// A Pod over its storage limit is evicted as the kubelet evicts it: its
/// containers get one second, and once the backend no longer runs them the
/// Pod is Failed with reason Evicted and a Warning Event.
#[tokio::test]
async fn an_evicted_pod_is_stopped_then_failed_as_evicted() {
    let provider = Arc::new(Scripted::default());
    *provider.instance.lock().unwrap() = Some(running_instance());
    let (c, log) = controller(Arc::clone(&provider));
    let pod: k8s_openapi::api::core::v1::Pod = serde_json::from_value(json!({
        "metadata": {"name": "p", "namespace": "ns", "uid": "u1",
            "annotations": {"vkd.io/instance-id": "i-1"}},
        "spec": {"nodeName": "vk", "containers": [{"name": "main", "image": "x",
            "resources": {"limits": {"ephemeral-storage": "5Mi"}}}]},
        "status": {"phase": "Running", "startTime": super::status::time(SystemTime::now())}
    }))
    .unwrap();
    c.upsert(&pod);
    let message = "Pod ephemeral local storage usage exceeds the total limit of containers 5Mi. ";
    c.update("u1", |p| p.failing_mut().evicting = Some(message.into()));

    assert_eq!(
        c.reconcile("u1", Lane::Any).await.unwrap(),
        Action::After(super::DELETE_CONFIRM)
    );
    assert_eq!(
        *provider.deletes.lock().unwrap(),
        vec![("u1".to_owned(), super::eviction::GRACE)]
    );
    *provider.instance.lock().unwrap() = None;
    assert_eq!(c.reconcile("u1", Lane::Any).await.unwrap(), Action::Done);
    let p = patches(&log);
    assert_eq!(p.len(), 1, "{p:?}");
    assert_eq!(p[0]["status"]["phase"], "Failed");
    assert_eq!(p[0]["status"]["reason"], "Evicted");
    assert_eq!(p[0]["status"]["message"], message);
    let e = wait_events(&log, 1).await;
    assert_eq!(e[0]["reason"], "Evicted");
    assert_eq!(e[0]["type"], "Warning");
    assert_eq!(e[0]["reportingController"], "kubelet");
    assert!(
        c.records()["u1"].progress.failing.is_none(),
        "nothing is kept once the Pod failed"
    );
}

/// An image the backend cannot run leaves the Pod Pending as a failed pull
/// does on the kubelet: ErrImagePull, then ImagePullBackOff, retried with a
/// doubling back-off; it never fails the Pod.
#[tokio::test]
async fn an_image_the_backend_cannot_run_waits_as_a_failed_pull() {
    let provider = Arc::new(Scripted::default());
    *provider.admission.lock().unwrap() = Some(vkd_provider::Admission::Rejected {
        reason: vkd_provider::IMAGE_NOT_RUNNABLE.into(),
        message: "container main: image \"nope\" is not mapped".into(),
    });
    let (c, log) = controller(Arc::clone(&provider));
    let pod: k8s_openapi::api::core::v1::Pod = serde_json::from_value(json!({
        "metadata": {"name": "p", "namespace": "ns", "uid": "u1"},
        "spec": {"nodeName": "vk", "containers": [{"name": "main", "image": "nope"}]},
    }))
    .unwrap();
    c.upsert(&pod);

    assert_eq!(
        c.reconcile("u1", Lane::Any).await.unwrap(),
        Action::After(Duration::from_secs(10))
    );
    // Woken early (the echo of its own status write): it keeps backing off.
    match c.reconcile("u1", Lane::Any).await.unwrap() {
        Action::After(d) => assert!(d <= Duration::from_secs(10) && d > Duration::from_secs(8)),
        other => panic!("{other:?}"),
    }
    assert_eq!(patches(&log).len(), 1, "no second try before the back-off");
    // Once it has passed, it tries again, waits twice as long, and says so.
    c.update("u1", |p| {
        p.image_backoff.as_mut().unwrap().retry_at = SystemTime::UNIX_EPOCH.into();
    });
    assert_eq!(
        c.reconcile("u1", Lane::Any).await.unwrap(),
        Action::After(Duration::from_secs(20))
    );
    let p = patches(&log);
    let reasons: Vec<&str> = p
        .iter()
        .map(|p| {
            assert_eq!(p["status"]["phase"], "Pending", "{p}");
            p["status"]["containerStatuses"][0]["state"]["waiting"]["reason"]
                .as_str()
                .unwrap()
        })
        .collect();
    assert_eq!(reasons, ["ErrImagePull", "ImagePullBackOff"]);
    let e = wait_events(&log, 2).await;
    let e: Vec<(&str, &str)> = e
        .iter()
        .map(|e| (e["type"].as_str().unwrap(), e["reason"].as_str().unwrap()))
        .collect();
    assert!(e.contains(&("Warning", "Failed")), "{e:?}");
    assert!(e.contains(&("Normal", "BackOff")), "{e:?}");
}

/// A sandbox the backend could not create (a CNI failure) leaves the Pod
/// Pending and ContainerCreating, with a Warning FailedCreatePodSandBox
/// naming why, and the start is tried again with a back-off: it never
/// fails the Pod, as on the kubelet.
#[tokio::test]
async fn a_sandbox_the_backend_could_not_create_is_retried_as_the_kubelet_does() {
    let provider = Arc::new(Scripted::default());
    *provider.admission.lock().unwrap() = Some(vkd_provider::Admission::Rejected {
        reason: vkd_provider::SANDBOX_NOT_CREATED.into(),
        message: "CNI plugin bridge (ADD): no IP addresses available".into(),
    });
    let (c, log) = controller(Arc::clone(&provider));
    let pod: k8s_openapi::api::core::v1::Pod = serde_json::from_value(json!({
        "metadata": {"name": "p", "namespace": "ns", "uid": "u1"},
        "spec": {"nodeName": "vk", "containers": [{"name": "main", "image": "busybox"}]},
    }))
    .unwrap();
    c.upsert(&pod);
    assert_eq!(
        c.reconcile("u1", Lane::Any).await.unwrap(),
        Action::After(Duration::from_secs(10))
    );
    c.update("u1", |p| {
        p.image_backoff.as_mut().unwrap().retry_at = SystemTime::UNIX_EPOCH.into();
    });
    assert_eq!(
        c.reconcile("u1", Lane::Any).await.unwrap(),
        Action::After(Duration::from_secs(20))
    );
    for p in patches(&log) {
        assert_eq!(p["status"]["phase"], "Pending", "{p}");
        let waiting = &p["status"]["containerStatuses"][0]["state"]["waiting"];
        assert_eq!(waiting["reason"], "ContainerCreating", "{p}");
    }
    // One series (a repeat counts on it, as the kubelet's do).
    let e = wait_events(&log, 1).await;
    assert!(
        !e.is_empty()
            && e.iter().all(|e| e["type"] == "Warning"
                && e["reason"] == "FailedCreatePodSandBox"
                && e["note"]
                    .as_str()
                    .unwrap()
                    .contains("no IP addresses available")),
        "{e:?}"
    );
}

/// Over the Event rate (the kubelet's --event-qps and --event-burst) the
/// per-Pod `InstanceCreated` is dropped and counted at once, while a Warning
/// waits for its turn and is sent.
#[tokio::test]
async fn over_the_event_rate_instance_created_is_shed_and_a_warning_waits() {
    use super::events::Pace;
    use kube::runtime::events::EventType;
    let (c, log) = controller_with(Arc::new(Scripted::default()), |s| {
        s.event_qps = 1;
        s.event_burst = 2;
    });
    let mut records = Vec::new();
    for i in 0..4 {
        let pod: k8s_openapi::api::core::v1::Pod = serde_json::from_value(json!({
            "metadata": {"name": format!("p{i}"), "namespace": "ns", "uid": format!("u{i}")},
            "spec": {"nodeName": "vk", "containers": [{"name": "main", "image": "x"}]}
        }))
        .unwrap();
        c.upsert(&pod);
        records.push(super::PodRecord::clone(&c.records()[&format!("u{i}")]));
    }
    for rec in &records {
        c.events.paced_event(
            rec,
            EventType::Normal,
            "InstanceCreated",
            "created",
            "Create",
            Pace::ShedOverRate,
        );
    }
    c.events
        .event(&records[3], EventType::Warning, "Failed", "boom", "Create");
    let mut sent = events(&log);
    for _ in 0..60 {
        if sent.len() >= 3 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        sent = events(&log);
    }
    let mut created: Vec<&str> = sent
        .iter()
        .filter(|e| e["reason"] == "InstanceCreated")
        .map(|e| e["regarding"]["name"].as_str().unwrap())
        .collect();
    created.sort_unstable();
    assert_eq!(created, ["p0", "p1"], "the burst: {sent:?}");
    assert!(
        sent.iter()
            .any(|e| e["reason"] == "Failed" && e["type"] == "Warning"),
        "the Warning waited for a token and was sent: {sent:?}"
    );
    assert_eq!(c.shared.metrics.events_dropped(), 2);
}

/// Events still waiting for their turn when the term ends go with it: a
/// replica whose term is over (a newer one acts for the node) sends nothing
/// more about its Pods.
#[tokio::test]
async fn events_still_waiting_when_the_term_ends_are_not_sent() {
    use kube::runtime::events::EventType;
    let (c, log) = controller_with(Arc::new(Scripted::default()), |s| {
        s.event_qps = 1;
        s.event_burst = 1;
    });
    let pod: k8s_openapi::api::core::v1::Pod = serde_json::from_value(json!({
        "metadata": {"name": "p", "namespace": "ns", "uid": "u1"},
        "spec": {"nodeName": "vk", "containers": [{"name": "main", "image": "x"}]}
    }))
    .unwrap();
    c.upsert(&pod);
    let rec = super::PodRecord::clone(&c.records()["u1"]);
    for note in ["first", "second", "third"] {
        c.events
            .event(&rec, EventType::Warning, "Failed", note, "Create");
    }
    let sent = wait_events(&log, 1).await;
    assert_eq!(sent[0]["note"], "first");
    c.shared.term.supersede("a newer replica took the node");
    // Two more turns of the Event rate pass: nothing more is sent.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let sent = events(&log);
    assert_eq!(sent.len(), 1, "sent after the term ended: {sent:?}");
}

/// Pods bound by name that a kubelet would refuse fail as the kubelet fails
/// them, and none of them reaches the backend: a host port another Pod holds
/// (NodePorts), a selector the Node does not satisfy (NodeAffinity), more Pods
/// than the Node's `pods` (OutOfpods).
#[tokio::test]
async fn the_node_rejects_what_a_kubelet_rejects() {
    let provider = Arc::new(Scripted::default());
    *provider.admission.lock().unwrap() = Some(vkd_provider::Admission::Queued {
        reason: "scripted".into(),
    });
    let (c, log) = controller(Arc::clone(&provider));
    let pod = |uid: &str, extra: serde_json::Value| {
        let mut spec = json!({"nodeName": "vk", "containers": [{"name": "main", "image": "x"}]});
        for (k, v) in extra.as_object().unwrap() {
            spec[k] = v.clone();
        }
        let p: k8s_openapi::api::core::v1::Pod = serde_json::from_value(json!({
            "metadata": {"name": uid, "namespace": "ns", "uid": uid},
            "spec": spec,
        }))
        .unwrap();
        c.upsert(&p);
    };
    let port = json!({"containers": [{"name": "main", "image": "x",
        "ports": [{"containerPort": 80, "hostPort": 8080}]}]});
    pod("a", port.clone());
    pod("b", port);
    pod("c", json!({"nodeSelector": {"zone": "b"}}));
    pod("d", json!({"nodeSelector": {"zone": "a"}}));
    pod("e", json!({}));
    pod("f", json!({}));
    for uid in ["a", "b", "c", "d", "e", "f"] {
        c.reconcile(uid, Lane::Any).await.unwrap();
    }
    let failed: Vec<(String, String)> = patches(&log)
        .iter()
        .filter(|p| p["status"]["phase"] == "Failed")
        .map(|p| {
            (
                p["status"]["reason"].as_str().unwrap().to_owned(),
                p["status"]["message"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    assert_eq!(
        failed,
        [
            (
                "NodePorts".to_owned(),
                "Pod was rejected: Predicate NodePorts failed: node(s) didn't have free ports for the requested pod ports".to_owned()
            ),
            (
                "NodeAffinity".to_owned(),
                "Pod was rejected: Predicate NodeAffinity failed: node(s) didn't match Pod's node affinity/selector".to_owned()
            ),
            (
                "OutOfpods".to_owned(),
                "Pod was rejected: Node didn't have enough resource: pods, requested: 1, used: 3, capacity: 3".to_owned()
            ),
        ]
    );
    let e = wait_events(&log, 6).await;
    let ports = e.iter().find(|e| e["reason"] == "NodePorts").unwrap();
    assert_eq!(ports["type"], "Warning");
    assert_eq!(
        ports["note"],
        "Predicate NodePorts failed: node(s) didn't have free ports for the requested pod ports"
    );
    // The admitted three are queued by the backend; the rejected never asked it.
    let records = c.records();
    let admitted: Vec<&str> = ["a", "b", "c", "d", "e", "f"]
        .into_iter()
        .filter(|u| records[*u].progress.admitted)
        .collect();
    assert_eq!(admitted, ["a", "d", "e"]);
}

/// The term's end stops a reconcile that waits on the backend at once: the
/// controller does not wait out a slow provider before the next term acts.
#[tokio::test]
async fn the_terms_end_stops_a_reconcile_in_flight() {
    let provider = Arc::new(Scripted {
        get_hangs: true,
        ..Scripted::default()
    });
    let (c, _log) = controller(Arc::clone(&provider));
    let pod: k8s_openapi::api::core::v1::Pod = serde_json::from_value(json!({
        "metadata": {"name": "p", "namespace": "ns", "uid": "u1"},
        "spec": {"nodeName": "vk", "containers": [{"name": "main", "image": "x"}]}
    }))
    .unwrap();
    c.upsert(&pod);
    let work = tokio_util::sync::CancellationToken::new();
    let running = tokio::spawn(Arc::clone(&c).run(work.clone()));
    // Until a worker holds the Pod (in the backend call that never answers).
    for _ in 0..200 {
        if c.queue_depth() == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    work.cancel();
    let stopped = tokio::time::timeout(Duration::from_secs(2), running).await;
    assert!(
        stopped.is_ok(),
        "the controller waited for a backend call after its term ended"
    );
}

/// Per-host mode: every node hears every backend event. One for a Pod of
/// another node queues nothing here (and so wakes no collection pass); one
/// for this node's Pod queues it.
/// Per-host mode: one vkd serves a node per backend host from one provider.
/// The backend's events are read once, not once per node, and each goes to
/// the node that holds its Pod: the other nodes are not woken, an event of a
/// Pod no node holds costs none of them anything, and a resync reaches all.
#[tokio::test]
async fn backend_events_are_read_once_and_go_to_the_node_that_holds_the_pod() {
    let provider = Arc::new(Scripted::default());
    let (tx, rx) = futures::channel::mpsc::unbounded();
    *provider.events.lock().unwrap() = Some(rx);
    let (a, _) = controller(Arc::clone(&provider));
    let (b, _) = controller_with(Arc::clone(&provider), |s| s.node = "vk-2".into());
    for (c, uid) in [(&a, "u1"), (&b, "u2")] {
        let pod: k8s_openapi::api::core::v1::Pod = serde_json::from_value(json!({
            "metadata": {"name": uid, "namespace": "ns", "uid": uid},
            "spec": {"nodeName": c.node(), "containers": [{"name": "main", "image": "x"}]}
        }))
        .unwrap();
        c.upsert(&pod);
    }
    let drain = |c: &Arc<PodController>| {
        let c = Arc::clone(c);
        async move {
            let mut taken = Vec::new();
            while c.queue_depth() > 0 {
                taken.push(c.queue.next_in(false).await);
            }
            for uid in &taken {
                c.queue.done(uid);
            }
            taken
        }
    };
    drain(&a).await;
    drain(&b).await;
    let stop = CancellationToken::new();
    let router = tokio::spawn(super::route_backend_events(
        Arc::clone(&provider) as Arc<dyn vkd_provider::Provider>,
        vec![Arc::clone(&a), Arc::clone(&b)],
        stop.clone(),
    ));
    let changed = |uid: &str| vkd_provider::InstanceEvent::Changed { uid: uid.into() };
    tx.unbounded_send(changed("u2")).unwrap();
    tx.unbounded_send(changed("no-nodes-pod")).unwrap();
    tx.unbounded_send(changed("u1")).unwrap();
    tokio::time::timeout(Duration::from_secs(5), async {
        while a.queue_depth() + b.queue_depth() < 2 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .unwrap();
    assert_eq!(drain(&a).await, ["u1"]);
    assert_eq!(drain(&b).await, ["u2"]);
    tx.unbounded_send(vkd_provider::InstanceEvent::Resync)
        .unwrap();
    tokio::time::timeout(Duration::from_secs(5), async {
        while a.queue_depth() + b.queue_depth() < 2 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await
    .unwrap();
    assert_eq!(
        provider
            .event_streams
            .load(std::sync::atomic::Ordering::SeqCst),
        1,
        "one stream for both nodes"
    );
    stop.cancel();
    router.await.unwrap().unwrap();
}

/// An instance of the Scripted backend being created (its container waits
/// with `reason`), made `created_ago` before now by vkd.
fn creating(c: &PodController, provider: &Scripted, reason: &str, created_ago: Duration) {
    let mut i = running_instance();
    i.phase = vkd_provider::InstancePhase::Pending;
    i.started_at = None;
    i.containers[0].ready = false;
    i.containers[0].state = vkd_provider::ContainerState::Waiting {
        reason: reason.into(),
        message: None,
    };
    *provider.instance.lock().unwrap() = Some(i);
    let pod: k8s_openapi::api::core::v1::Pod = serde_json::from_value(json!({
        "metadata": {"name": "p", "namespace": "ns", "uid": "u1"},
        "spec": {"nodeName": "vk", "containers": [{"name": "main", "image": "x"}]},
    }))
    .unwrap();
    c.upsert(&pod);
    let at = super::model::Stamp::from(SystemTime::now() - created_ago);
    c.store.update("u1", |p| {
        p.timeline.admitted = Some(at);
        p.timeline.accepted = Some(at);
    });
}

/// A controller on the Scripted backend with a 1 s status merge window.
fn windowed() -> (Arc<Scripted>, Arc<PodController>, crate::testing::Log) {
    let provider = Arc::new(Scripted::default());
    let (c, log) = controller_with(Arc::clone(&provider), |s| {
        s.status_merge_window = Duration::from_secs(1);
    });
    (provider, c, log)
}

/// An instance that starts within the merge window gets one status write,
/// Running, not ContainerCreating and then Running; its startTime is when
/// the node admitted it, as the kubelet's, not when the write went out.
#[tokio::test]
async fn an_instance_that_starts_within_the_window_gets_one_status_write() {
    let (provider, c, log) = windowed();
    creating(
        &c,
        &provider,
        "ContainerCreating",
        Duration::from_millis(200),
    );
    let held = c.reconcile("u1", Lane::Any).await.unwrap();
    let Action::After(left) = held else {
        panic!("written at once: {held:?}");
    };
    // The window counts from the create, 200 ms ago.
    assert!(left <= Duration::from_millis(800), "{left:?}");
    assert!(patches(&log).is_empty(), "{:?}", patches(&log));

    // The backend says it runs (its event queues the Pod at once).
    *provider.instance.lock().unwrap() = Some(running_instance());
    c.reconcile("u1", Lane::Any).await.unwrap();
    let p = patches(&log);
    assert_eq!(p.len(), 1, "{p:?}");
    assert_eq!(p[0]["status"]["phase"], "Running");
    assert!(p[0]["status"]["containerStatuses"][0]["state"]["running"].is_object());
    let admitted = c
        .store
        .get("u1")
        .unwrap()
        .progress
        .timeline
        .admitted
        .unwrap();
    assert_eq!(
        p[0]["status"]["startTime"],
        json!(super::status::time(admitted.time()))
    );
}

/// An instance still being created when the window ends shows
/// ContainerCreating, so a person sees what lasts; one whose container waits
/// for anything else (an image it cannot pull) is written at once, and with
/// the window off nothing is held.
#[tokio::test]
async fn what_lasts_or_needs_a_look_is_written_without_waiting() {
    let (provider, c, log) = windowed();
    creating(
        &c,
        &provider,
        "ContainerCreating",
        Duration::from_millis(1200),
    );
    c.reconcile("u1", Lane::Any).await.unwrap();
    let p = patches(&log);
    assert_eq!(p.len(), 1, "{p:?}");
    assert_eq!(p[0]["status"]["phase"], "Pending");
    assert_eq!(
        p[0]["status"]["containerStatuses"][0]["state"]["waiting"]["reason"],
        "ContainerCreating"
    );

    let (provider, c, log) = windowed();
    creating(&c, &provider, "ErrImagePull", Duration::ZERO);
    c.reconcile("u1", Lane::Any).await.unwrap();
    let p = patches(&log);
    assert_eq!(p.len(), 1, "{p:?}");
    assert_eq!(
        p[0]["status"]["containerStatuses"][0]["state"]["waiting"]["reason"],
        "ErrImagePull"
    );

    let provider = Arc::new(Scripted::default());
    let (c, log) = controller(Arc::clone(&provider));
    creating(&c, &provider, "ContainerCreating", Duration::ZERO);
    c.reconcile("u1", Lane::Any).await.unwrap();
    assert_eq!(patches(&log).len(), 1, "window 0s: written at once");
}
