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
