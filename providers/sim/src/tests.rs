use std::time::Duration;

use vkd_provider::conformance::{Kit, sample_spec};
use vkd_provider::{Admission, Fence, InstancePhase, Provider, ProviderError};

use super::*;

const FLEET: &str = r#"
latency: {start: 50ms, ready: 50ms}
hosts:
- name: host-a
  cpu: "16"
  memory: 64Gi
  gpus: [{count: 4, model: H100, memory: 80Gi, nvlink_domain: nvl-a}]
- name: host-b
  cpu: "16"
  memory: 64Gi
  gpus: [{count: 4, model: H100, memory: 80Gi, nvlink_domain: nvl-b}]
"#;

fn provider(dir: &Path) -> SimProvider {
    SimProvider::open(Fleet::parse(FLEET, "test").unwrap(), dir).unwrap()
}

fn tempdir() -> PathBuf {
    let d = std::env::temp_dir().join(format!("vkd-sim-test-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn fence(epoch: u64) -> Fence {
    Fence {
        node: "n".into(),
        epoch,
    }
}

#[tokio::test]
async fn conformance() {
    let dir = tempdir();
    let p = provider(&dir);
    Kit::new(&p, "n", sample_spec).run().await.unwrap();
    std::fs::remove_dir_all(dir).ok();
}

#[tokio::test]
async fn state_outlives_the_provider() {
    let dir = tempdir();
    let first = provider(&dir);
    let created = first
        .create(&fence(1), &sample_spec("n", "pod-1"))
        .await
        .unwrap();
    drop(first);
    let second = provider(&dir);
    let listed = second.list("n").await.unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].id, created.id);
    // Creating again after the restart adopts, never duplicates.
    let again = second
        .create(&fence(1), &sample_spec("n", "pod-1"))
        .await
        .unwrap();
    assert_eq!(again.id, created.id);
    assert_eq!(read_records(&dir).unwrap().len(), 1);
    // The fence survives too.
    assert!(matches!(
        second.create(&fence(0), &sample_spec("n", "pod-2")).await,
        Err(ProviderError::Fenced { current: 1, .. })
    ));
    std::fs::remove_dir_all(dir).ok();
}

#[tokio::test]
async fn instance_runs_then_becomes_ready() {
    let dir = tempdir();
    let p = provider(&dir);
    let i = p
        .create(&fence(1), &sample_spec("n", "pod-r"))
        .await
        .unwrap();
    assert_eq!(i.phase, InstancePhase::Pending);
    tokio::time::sleep(Duration::from_millis(150)).await;
    let i = p.get("pod-r").await.unwrap().unwrap();
    assert_eq!(i.phase, InstancePhase::Running);
    assert!(i.containers[0].ready);
    assert!(i.ip.as_deref().unwrap().starts_with("10."));
    std::fs::remove_dir_all(dir).ok();
}

#[tokio::test]
async fn gpus_are_accounted_per_host() {
    let dir = tempdir();
    let p = provider(&dir);
    let mut spec = sample_spec("n", "gpu-1");
    spec.resources.gpus = 4;
    let Admission::Fits(place) = p.admit(&spec).await.unwrap() else {
        panic!()
    };
    assert_eq!(place.gpu_ids.len(), 4);
    p.create(&fence(1), &spec).await.unwrap();
    let mut second = sample_spec("n", "gpu-2");
    second.resources.gpus = 4;
    p.create(&fence(1), &second).await.unwrap();
    let cap = p.capacity().await.unwrap();
    assert_eq!(cap.hosts.iter().map(|h| h.gpus_free()).sum::<usize>(), 0);
    let mut third = sample_spec("n", "gpu-3");
    third.resources.gpus = 1;
    assert!(matches!(
        p.admit(&third).await.unwrap(),
        Admission::Queued { .. }
    ));
    assert!(matches!(
        p.create(&fence(1), &third).await,
        Err(ProviderError::Rejected { .. })
    ));
    third.resources.gpus = 8;
    assert!(
        matches!(p.admit(&third).await.unwrap(), Admission::Rejected { ref reason, .. } if reason == "TopologyUnsatisfiable")
    );
    p.delete(&fence(1), "gpu-1", Duration::ZERO).await.unwrap();
    third.resources.gpus = 4;
    assert!(matches!(p.admit(&third).await.unwrap(), Admission::Fits(_)));
    std::fs::remove_dir_all(dir).ok();
}

#[tokio::test]
async fn unrunnable_specs_are_invalid() {
    let dir = tempdir();
    let p = provider(&dir);
    let mut spec = sample_spec("n", "bad-1");
    spec.annotations
        .insert(behaviour::BEHAVIOR.into(), "explode".into());
    assert!(matches!(
        p.admit(&spec).await,
        Err(ProviderError::Invalid { .. })
    ));
    assert!(matches!(
        p.create(&fence(1), &spec).await,
        Err(ProviderError::Invalid { .. })
    ));
    let spec = sample_spec("n", "../../etc/passwd");
    assert!(matches!(
        p.create(&fence(1), &spec).await,
        Err(ProviderError::Invalid { .. })
    ));
    assert!(read_records(&dir).unwrap().is_empty());
    std::fs::remove_dir_all(dir).ok();
}

#[tokio::test]
async fn graceful_stop_takes_the_stop_delay() {
    let dir = tempdir();
    let p = provider(&dir);
    let mut spec = sample_spec("n", "slow-stop");
    spec.annotations
        .insert(behaviour::STOP_DELAY.into(), "300ms".into());
    p.create(&fence(1), &spec).await.unwrap();
    p.delete(&fence(1), "slow-stop", Duration::from_secs(30))
        .await
        .unwrap();
    assert!(
        p.get("slow-stop").await.unwrap().is_some(),
        "gone before its stop delay"
    );
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert!(p.get("slow-stop").await.unwrap().is_none());
    assert!(read_records(&dir).unwrap().is_empty());
    std::fs::remove_dir_all(dir).ok();
}

/// Rewrites a stored record, as a bad value that reached the disk would be.
fn edit_record(dir: &Path, uid: &str, edit: impl FnOnce(&mut serde_json::Value)) {
    let path = dir.join("instances").join(format!("{uid}.json"));
    let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    edit(&mut v);
    std::fs::write(&path, serde_json::to_vec(&v).unwrap()).unwrap();
}

#[tokio::test]
async fn a_huge_duration_annotation_is_refused_at_create() {
    let dir = tempdir();
    let p = provider(&dir);
    let mut spec = sample_spec("n", "huge-1");
    spec.annotations
        .insert(behaviour::CRASH_AFTER.into(), "18000000000000000000".into());
    match p.create(&fence(1), &spec).await {
        Err(ProviderError::Invalid { message, .. }) => {
            assert!(message.contains(behaviour::CRASH_AFTER), "{message}")
        }
        other => panic!("{other:?}"),
    }
    assert!(read_records(&dir).unwrap().is_empty());
    std::fs::remove_dir_all(dir).ok();
}

#[tokio::test]
async fn bad_times_already_stored_cannot_panic() {
    let dir = tempdir();
    let first = provider(&dir);
    for uid in ["huge-run", "huge-crash", "end-of-time"] {
        first
            .create(&fence(1), &sample_spec("n", uid))
            .await
            .unwrap();
    }
    drop(first);
    // Written before durations were bounded, or by hand.
    edit_record(&dir, "huge-run", |v| {
        v["spec"]["annotations"][behaviour::BEHAVIOR] = "exit".into();
        v["spec"]["annotations"][behaviour::RUN_FOR] = "18000000000000000000".into();
    });
    edit_record(&dir, "huge-crash", |v| {
        v["spec"]["annotations"][behaviour::CRASH_AFTER] = "18000000000000000000".into();
    });
    edit_record(&dir, "end-of-time", |v| {
        v["created_at"] = serde_json::json!({
            "secs_since_epoch": i64::MAX,
            "nanos_since_epoch": 999_999_999,
        });
    });
    let p = provider(&dir);
    assert_eq!(p.list("n").await.unwrap().len(), 3);
    for uid in ["huge-run", "huge-crash", "end-of-time"] {
        assert!(p.get(uid).await.unwrap().is_some());
        let _ = p.stats(uid).await;
        p.delete(&fence(1), uid, Duration::from_secs(u64::MAX))
            .await
            .unwrap();
    }
    p.takeover(&fence(2)).await.unwrap();
    assert!(p.list("n").await.unwrap().is_empty());
    std::fs::remove_dir_all(dir).ok();
}

#[tokio::test]
async fn a_corrupt_record_affects_only_its_own_pod() {
    let dir = tempdir();
    let first = provider(&dir);
    for uid in ["pod-ok", "pod-bad"] {
        first
            .create(&fence(1), &sample_spec("n", uid))
            .await
            .unwrap();
    }
    drop(first);
    let bad = dir.join("instances").join("pod-bad.json");
    let text = std::fs::read(&bad).unwrap();
    std::fs::write(&bad, &text[..text.len() / 2]).unwrap();
    let p = provider(&dir);
    let listed = p.list("n").await.unwrap();
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].owner.uid, "pod-ok");
    assert!(p.get("pod-bad").await.unwrap().is_none());
    // Moved aside, kept for a look, and counted.
    assert!(!bad.exists());
    let aside: Vec<_> = std::fs::read_dir(dir.join("instances"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("pod-bad.json.corrupt-"))
        .collect();
    assert_eq!(aside.len(), 1, "{aside:?}");
    assert_eq!(p.corrupt_records(), 1);
    // The rest keeps working, the lost Pod's UID too.
    p.create(&fence(1), &sample_spec("n", "pod-bad"))
        .await
        .unwrap();
    assert_eq!(read_records(&dir).unwrap().len(), 2);
    std::fs::remove_dir_all(dir).ok();
}

#[tokio::test]
async fn a_garbage_fence_file_refuses_mutations_by_name() {
    let dir = tempdir();
    provider(&dir);
    let file = dir.join("fences").join("n");
    std::fs::write(&file, "garbage").unwrap();
    let p = provider(&dir);
    let named = |e: ProviderError| e.to_string().contains(&file.display().to_string());
    assert!(named(p.takeover(&fence(5)).await.unwrap_err()));
    assert!(named(
        p.create(&fence(5), &sample_spec("n", "pod-1"))
            .await
            .unwrap_err()
    ));
    assert!(named(
        p.delete(&fence(5), "pod-1", Duration::ZERO)
            .await
            .unwrap_err()
    ));
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "garbage");
    std::fs::remove_dir_all(dir).ok();
}

#[tokio::test]
async fn a_held_fence_lock_does_not_stall_the_runtime() {
    use std::sync::atomic::{AtomicU32, Ordering};
    let dir = tempdir();
    let p = provider(&dir);
    // Another daemon holds the node's fence lock through a mutation.
    let book = vkd_provider::fence::FenceBook::new(&dir.join("fences")).unwrap();
    let held = book.check(&fence(1)).unwrap();
    let holder = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(300));
        drop(held);
    });
    let ticks = Arc::new(AtomicU32::new(0));
    let ticker = tokio::spawn({
        let ticks = Arc::clone(&ticks);
        async move {
            loop {
                tokio::time::sleep(Duration::from_millis(10)).await;
                ticks.fetch_add(1, Ordering::Relaxed);
            }
        }
    });
    p.create(&fence(1), &sample_spec("n", "pod-1"))
        .await
        .unwrap();
    ticker.abort();
    holder.join().unwrap();
    let n = ticks.load(Ordering::Relaxed);
    assert!(
        n >= 3,
        "the runtime ran {n} ticks while create waited for the lock"
    );
    std::fs::remove_dir_all(dir).ok();
}

#[tokio::test]
async fn init_containers_complete_and_sidecars_run_until_the_pod_ends() {
    use vkd_provider::{ContainerSpec, ContainerState, RestartPolicy};
    let dir = tempdir();
    let p = provider(&dir);
    let mut spec = sample_spec("n", "pod-init");
    spec.restart_policy = RestartPolicy::Never;
    spec.annotations
        .insert(behaviour::BEHAVIOR.into(), "exit".into());
    spec.annotations
        .insert(behaviour::RUN_FOR.into(), "200ms".into());
    spec.init_containers = vec![
        ContainerSpec {
            name: "setup".into(),
            image: "busybox".into(),
            ..Default::default()
        },
        ContainerSpec {
            name: "proxy".into(),
            image: "envoy".into(),
            restart_always: true,
            ..Default::default()
        },
    ];
    let i = p.create(&fence(1), &spec).await.unwrap();
    assert_eq!(i.init_containers.len(), 2);
    for c in i.init_containers.iter().chain(&i.containers) {
        assert!(
            matches!(&c.state, ContainerState::Waiting { reason, .. } if reason == "PodInitializing"),
            "{c:?}"
        );
    }
    tokio::time::sleep(Duration::from_millis(150)).await;
    let i = p.get("pod-init").await.unwrap().unwrap();
    assert!(
        matches!(&i.init_containers[0].state, ContainerState::Terminated(t) if t.exit_code == 0)
    );
    assert!(i.init_containers[1].has_started() && i.init_containers[1].ready);
    assert_eq!(i.phase, InstancePhase::Running);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let i = p.get("pod-init").await.unwrap().unwrap();
    assert_eq!(i.phase, InstancePhase::Succeeded);
    let ContainerState::Terminated(t) = &i.init_containers[1].state else {
        panic!("the sidecar stops with the Pod: {:?}", i.init_containers[1]);
    };
    let ContainerState::Terminated(main) = &i.containers[0].state else {
        panic!("{:?}", i.containers[0]);
    };
    assert_eq!((t.exit_code, t.finished_at), (0, main.finished_at));
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn records_from_before_init_statuses_still_parse() {
    // An Instance (and a ContainerStatus) written without the newer fields.
    let old = serde_json::json!({
        "id": "sim-1", "owner": {"uid": "u", "namespace": "ns", "name": "p"},
        "node": "n", "epoch": 1, "phase": "Running",
        "containers": [{"name": "a", "state": {"Running": {"started_at": {"secs_since_epoch": 1, "nanos_since_epoch": 0}}},
                        "last_termination": null, "ready": true, "restart_count": 0, "container_id": null}],
        "ip": null, "host": null,
        "created_at": {"secs_since_epoch": 1, "nanos_since_epoch": 0}, "started_at": null, "message": null
    });
    let i: vkd_provider::Instance = serde_json::from_value(old).unwrap();
    assert!(i.init_containers.is_empty());
    assert_eq!(i.containers[0].started, None);
    assert!(i.containers[0].has_started());
}
