//! Heap held per Pod record (and per instance of the embedded sim backend,
//! and per downstream Pod the kubernetes provider keeps),
//! measured with dhat and held against stored baselines
//! (`tests/baselines/pod_record_bytes`), the way kube-rs gates its
//! reflector's memory: a change that makes every Pod cost more fails here, long
//! before anyone runs the 10,000-Pod benchmark.
//!
//! `VKD_UPDATE_BASELINES=1 cargo test --test record_memory` writes the measured
//! figure as the new baseline (commit it with the change that explains it).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;
use std::time::SystemTime;

use k8s_openapi::api::core::v1::Pod;
use serde_json::json;
use vkd::pods::model::PodRecord;
use vkd::pods::status::record_of;

#[global_allocator]
static ALLOC: dhat::Alloc = dhat::Alloc;

const PODS: usize = 10_000;
/// A record may grow this much over the baseline before the gate fails.
const TOLERANCE: f64 = 1.10;
const BASELINE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/baselines/pod_record_bytes"
);

/// A Pod as the watch delivers it once vkd has written its status: Running and
/// Ready, with an instance, managed fields and the scheduler's condition.
fn running_pod(i: usize) -> Pod {
    let uid = format!("6f1c2a9e-0000-4000-8000-{i:012}");
    serde_json::from_value(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": format!("web-7d9f8b6c5d-{i:05}"),
            "namespace": "team-a",
            "uid": uid,
            "resourceVersion": "123456",
            "creationTimestamp": "2026-12-01T10:00:00Z",
            "labels": {"app": "web", "pod-template-hash": "7d9f8b6c5d"},
            "annotations": {
                "vkd.io/instance-id": format!("sim-{i:012x}"),
                "vkd.io/timeline": "bound=2026-12-01T10:00:00Z observed=+3ms admitted=+4ms accepted=+5ms started=+5ms ready=+5ms"
            },
            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "web-7d9f8b6c5d",
                                 "uid": "11111111-2222-3333-4444-555555555555", "controller": true}],
            "managedFields": [{"manager": "kube-controller-manager", "operation": "Update", "apiVersion": "v1",
                               "fieldsType": "FieldsV1", "fieldsV1": {"f:metadata": {"f:labels": {}}}}]
        },
        "spec": {
            "nodeName": "vk-1",
            "nodeSelector": {"type": "virtual-kubelet"},
            "tolerations": [{"key": "virtual-kubelet.io/provider", "operator": "Exists"}],
            "containers": [{
                "name": "main",
                "image": "example/web:1.4.2",
                "env": [{"name": "MODE", "value": "serve"}],
                "resources": {"requests": {"cpu": "100m", "memory": "64Mi"}}
            }]
        },
        "status": {
            "phase": "Running",
            "hostIP": "10.0.0.5",
            "podIP": format!("10.100.{}.{}", i / 250, i % 250 + 2),
            "startTime": "2026-12-01T10:00:00Z",
            "conditions": [
                {"type": "PodReadyToStartContainers", "status": "True", "lastTransitionTime": "2026-12-01T10:00:00Z"},
                {"type": "Initialized", "status": "True", "lastTransitionTime": "2026-12-01T10:00:00Z"},
                {"type": "ContainersReady", "status": "True", "lastTransitionTime": "2026-12-01T10:00:00Z"},
                {"type": "Ready", "status": "True", "lastTransitionTime": "2026-12-01T10:00:00Z"},
                {"type": "PodScheduled", "status": "True", "lastTransitionTime": "2026-12-01T10:00:00Z"}
            ],
            "containerStatuses": [{
                "name": "main", "ready": true, "started": true, "restartCount": 0,
                "image": "example/web:1.4.2", "imageID": "",
                "containerID": format!("sim://sim-{i:012x}/main"),
                "state": {"running": {"startedAt": "2026-12-01T10:00:00Z"}}
            }]
        }
    }))
    .unwrap()
}

/// Heap per instance the embedded sim backend keeps (it lives in the daemon's
/// process, so the benchmark's heap figure includes it; gated too).
fn sim_bytes_per_instance(pods: &[Pod]) -> usize {
    use vkd_provider::{Fence, Provider};
    let dir = std::env::temp_dir().join(format!("vkd-record-memory-{}", std::process::id()));
    let fleet = vkd_sim::Fleet::load(
        &std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("testdata/fleets/many.yaml"),
    )
    .unwrap();
    let sim = vkd_sim::SimProvider::open(fleet, &dir).unwrap();
    let fence = Fence {
        node: "vk-1".into(),
        epoch: 1,
    };
    let specs: Vec<_> = pods
        .iter()
        .map(|p| {
            let mut p = p.clone();
            p.metadata.annotations = None; // no instance yet: the record keeps its spec
            let rec = record_of(&p, "vk-1", SystemTime::now()).unwrap();
            rec.pending.unwrap().spec
        })
        .collect();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let before = dhat::HeapStats::get().curr_bytes;
    rt.block_on(async {
        for spec in &specs {
            sim.create(&fence, spec).await.unwrap();
            // The ticker each create spawns runs beside the next create, as on
            // the daemon's runtime; a zero-latency create no longer yields by
            // itself, and 10,000 tickers run at once leave more behind.
            tokio::task::yield_now().await;
        }
    });
    let after = dhat::HeapStats::get().curr_bytes;
    drop(rt);
    drop(sim);
    let _ = std::fs::remove_dir_all(&dir);
    (after.saturating_sub(before)) / specs.len()
}

/// Heap per downstream Pod the kubernetes provider keeps of its own Pods
/// (`vkd_kubernetes::kept`): what an upstream vkd holds for each offloaded
/// Pod beyond its record. The Pod is the one the provider makes of
/// `running_pod`, as the downstream watch shows it Running.
fn kept_downstream_bytes(pods: &[Pod]) -> usize {
    use std::sync::Arc;
    use vkd_kubernetes::kept::KeptPod;
    let downstream: Vec<Pod> =
        pods.iter()
            .map(|p| {
                let mut d = p.clone();
                let uid = p.metadata.uid.clone().unwrap();
                d.metadata.name = Some(format!("vkd-{uid}"));
                d.metadata.namespace = Some("vkd-team-a".into());
                d.metadata.uid = Some(format!("d-{uid}"));
                d.metadata.owner_references = None;
                let labels = d.metadata.labels.get_or_insert_default();
                labels.insert("vkd.io/owner-uid".into(), uid.clone());
                labels.insert("vkd.io/owner-node".into(), "vk-1".into());
                labels.insert("vkd.io/epoch".into(), "1".into());
                let annotations = d.metadata.annotations.get_or_insert_default();
                annotations.insert("vkd.io/owner-namespace".into(), "team-a".into());
                annotations.insert("vkd.io/owner-name".into(), p.metadata.name.clone().unwrap());
                let spec = d.spec.as_mut().unwrap();
                spec.volumes = Some(vec![serde_json::from_value(json!({
                "name": "kube-api-access-x1y2z",
                "secret": {"secretName": format!("vkd-{uid}-v0"), "defaultMode": 420, "items": [
                    {"key": "token", "path": "token"}, {"key": "ca.crt", "path": "ca.crt"},
                    {"key": "namespace", "path": "namespace"}]}
            }))
            .unwrap()]);
                d
            })
            .collect();
    let before = dhat::HeapStats::get().curr_bytes;
    let mut kept: HashMap<(Box<str>, Box<str>), Arc<KeptPod>> = HashMap::new();
    for d in &downstream {
        let key = (
            d.metadata.namespace.as_deref().unwrap().into(),
            d.metadata.name.as_deref().unwrap().into(),
        );
        kept.insert(key, Arc::new(KeptPod::of(d)));
    }
    let after = dhat::HeapStats::get().curr_bytes;
    drop(kept);
    (after.saturating_sub(before)) / downstream.len()
}

fn main() {
    let _profiler = dhat::Profiler::builder().testing().build();
    println!(
        "record_memory: inline sizes: PodRecord {} B, sim Record {} B, InstanceSpec {} B, ContainerSpec {} B",
        std::mem::size_of::<PodRecord>(),
        std::mem::size_of::<vkd_sim::Record>(),
        std::mem::size_of::<vkd_provider::InstanceSpec>(),
        std::mem::size_of::<vkd_provider::ContainerSpec>(),
    );
    let pods: Vec<Pod> = (0..PODS).map(running_pod).collect();
    let now = SystemTime::now();
    let before = dhat::HeapStats::get().curr_bytes;
    // What the controller keeps: a map from UID to boxed record, grown one
    // insert at a time as the watch delivers them.
    let mut records: HashMap<String, Box<PodRecord>> = HashMap::new();
    for p in &pods {
        let rec = record_of(p, "vk-1", now).unwrap();
        records.insert(rec.uid.to_string(), Box::new(rec));
    }
    let after = dhat::HeapStats::get().curr_bytes;
    let per_pod = (after - before) / PODS;
    assert!(records.values().all(|r| r.pending.is_none()));
    let sim_per_pod = sim_bytes_per_instance(&pods);
    let kept_per_pod = kept_downstream_bytes(&pods);
    drop(pods);

    println!("record_memory: {per_pod} bytes of heap per Running Pod record ({PODS} records)");
    println!(
        "record_memory: {kept_per_pod} bytes of heap per downstream Pod the kubernetes provider keeps"
    );
    let measured = [
        ("pod_record", per_pod),
        ("sim_instance", sim_per_pod),
        ("kept_downstream_pod", kept_per_pod),
    ];
    if std::env::var_os("VKD_UPDATE_BASELINES").is_some() {
        let text: String = measured.iter().map(|(k, v)| format!("{k} {v}\n")).collect();
        std::fs::write(BASELINE, text).unwrap();
        println!("record_memory: baselines updated: {measured:?}");
        return;
    }
    let text = std::fs::read_to_string(BASELINE).unwrap_or_else(|e| {
        panic!("no baseline at {BASELINE} ({e}); run with VKD_UPDATE_BASELINES=1")
    });
    for (what, got) in measured {
        let baseline: usize = text
            .lines()
            .find_map(|l| l.strip_prefix(what)?.trim().parse().ok())
            .unwrap_or_else(|| panic!("{BASELINE} has no {what} line"));
        let limit = (baseline as f64 * TOLERANCE) as usize;
        println!("record_memory: {what}: {got} bytes, baseline {baseline}, limit {limit}");
        assert!(
            got <= limit,
            "{what} now holds {got} bytes of heap per Pod, over the baseline {baseline} (+10% = {limit}); \
             make it smaller, or run with VKD_UPDATE_BASELINES=1 and commit the baseline with the reason"
        );
        if got < baseline * 9 / 10 {
            println!(
                "record_memory: {what}: {got} is well under the baseline {baseline}; consider lowering it"
            );
        }
    }
    drop(records);
}
