//! End-to-end: GPU capacity as per-host topology slices, on the real control
//! plane with the real scheduler, with a fleet of two hosts with 4 GPUs each.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use serde_json::Value;
use vkd_e2e::{Cluster, Suite, at, condition, repo_root, wait_for};

mod common;
use common::{Vkd, admin_get, items, running_and_ready, str_at};

fn main() -> ExitCode {
    Suite::new("topology", &[]).run(&[
        (
            "aggregate_node_places_whole_pods_queues_and_tracks_capacity",
            aggregate,
        ),
        ("per_host_nodes_let_the_scheduler_decide", per_host),
    ])
}

fn gpu_pod(ns: &str, name: &str, selector: &str, gpus: u32, annotations: &str) -> String {
    format!(
        r#"
apiVersion: v1
kind: Pod
metadata: {{name: {name}, namespace: {ns}, annotations: {{{annotations}}}}}
spec:
  nodeSelector: {{vkd.io/e2e: {selector}}}
  tolerations: [{{key: virtual-kubelet.io/provider, operator: Exists}}]
  containers:
  - name: train
    image: example/train:1
    resources: {{limits: {{nvidia.com/gpu: {gpus}}}, requests: {{cpu: "2", memory: 8Gi}}}}
"#
    )
}

/// The Pod already bound to `node`, past the scheduler.
fn bound(pod: String, node: &str) -> String {
    pod.replace(
        "  containers:",
        &format!("  nodeName: {node}\n  containers:"),
    )
}

fn annotation(v: &Value, key: &str) -> String {
    at(v, "metadata.annotations")
        .get(key)
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_owned()
}

fn label(v: &Value, key: &str) -> String {
    at(v, "metadata.labels")
        .get(key)
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_owned()
}

fn host_of(vkd: &Vkd, uid: &str) -> Result<String> {
    let inst = vkd.instances()?;
    let i = inst
        .iter()
        .find(|i| str_at(i, "podUID") == uid)
        .context("no instance for the Pod")?;
    Ok(str_at(i, "host").to_owned())
}

fn wait_ready(c: &Cluster, ns: &str, name: &str) -> Result<Value> {
    wait_for(&format!("{name} Ready"), Duration::from_secs(60), || {
        let p = c.kubectl_json(&["get", "pod", name, "-n", ns])?;
        Ok(running_and_ready(&p).then_some(p))
    })
}

fn aggregate(c: &Cluster) -> Result<()> {
    let fleet = c.dir().join("two-by-four.yaml");
    let original = std::fs::read_to_string(repo_root().join("testdata/fleets/two-by-four.yaml"))?;
    std::fs::write(&fleet, &original)?;
    let vkd = Vkd::start_provider(
        c,
        "vk-agg",
        "sim",
        &fleet,
        &["--node-label", "vkd.io/e2e=agg", "--queue-timeout", "5m"],
    )?;
    let ns = c.namespace("topo-agg")?;
    let node = wait_for("vk-agg with 8 GPUs", Duration::from_secs(60), || {
        let n = c.kubectl_json(&["get", "node", "vk-agg"])?;
        Ok((at(&n, "status.capacity")["nvidia.com/gpu"] == "8").then_some(n))
    })?;
    ensure!(
        label(&node, "vkd.io/gpu.max-per-pod") == "4",
        "{}",
        at(&node, "metadata.labels")
    );
    ensure!(
        label(&node, "vkd.io/gpu.model") == "H100-SXM5-80GB",
        "{}",
        at(&node, "metadata.labels")
    );
    ensure!(
        label(&node, "vkd.io/gpu.memory-mib") == "81920",
        "{}",
        at(&node, "metadata.labels")
    );
    ensure!(annotation(&node, "vkd.io/capacity-kind") == "live");
    ensure!(annotation(&node, "vkd.io/capacity-refresh") == "5s");
    ensure!(!annotation(&node, "vkd.io/capacity-observed-at").is_empty());
    let slices = annotation(&node, "vkd.io/slices");
    ensure!(
        slices.starts_with("host-a gpu 4/4 H100-SXM5-80GB") && slices.contains("; host-b gpu 4/4"),
        "{slices}"
    );

    // The same slices for a person, from the admin server.
    let (_, table) = admin_get(&vkd, "/slices")?;
    ensure!(
        table.contains("capacity: live") && table.contains("host-a") && table.contains("4/4"),
        "{table}"
    );
    eprintln!("/slices:\n{table}");

    // 8 GPUs: the sum says yes, no host does.
    c.apply(&gpu_pod(&ns, "eight", "agg", 8, ""))?;
    let p = wait_for("the 8-GPU Pod to fail", Duration::from_secs(60), || {
        let p = c.kubectl_json(&["get", "pod", "eight", "-n", &ns])?;
        Ok((at(&p, "status.phase") == "Failed").then_some(p))
    })?;
    ensure!(
        at(&p, "status.reason") == "TopologyUnsatisfiable",
        "{}",
        at(&p, "status")
    );
    ensure!(
        at(&p, "status.message")
            == "needs 8 nvidia.com/gpu on one host; largest slice is 4: host-a 4, host-b 4",
        "{}",
        at(&p, "status.message")
    );

    // Two 4-GPU Pods: one per host.
    for name in ["four-1", "four-2"] {
        c.apply(&gpu_pod(&ns, name, "agg", 4, ""))?;
    }
    let p1 = wait_ready(c, &ns, "four-1")?;
    let p2 = wait_ready(c, &ns, "four-2")?;
    let h1 = host_of(&vkd, str_at(&p1, "metadata.uid"))?;
    let h2 = host_of(&vkd, str_at(&p2, "metadata.uid"))?;
    ensure!(h1 != h2, "both on {h1}");
    wait_for(
        "no free slice left on the Node",
        Duration::from_secs(30),
        || {
            let n = c.kubectl_json(&["get", "node", "vk-agg"])?;
            Ok((annotation(&n, "vkd.io/gpu.max-free-per-pod") == "0").then_some(()))
        },
    )?;

    // A third waits, visibly, and runs when one of the first two goes. The real
    // scheduler would hold it back (the Node's 8 are allocated), so it is bound
    // by name, as another scheduler or a user may do.
    c.apply(&bound(gpu_pod(&ns, "four-3", "agg", 4, ""), "vk-agg"))?;
    let p3 = wait_for(
        "four-3 to wait as BackendQueued",
        Duration::from_secs(60),
        || {
            let p = c.kubectl_json(&["get", "pod", "four-3", "-n", &ns])?;
            let w = &at(&p, "status.containerStatuses")[0]["state"]["waiting"];
            Ok((w["reason"] == "BackendQueued").then_some(p))
        },
    )?;
    ensure!(at(&p3, "status.phase") == "Pending");
    let msg = at(&p3, "status.containerStatuses")[0]["state"]["waiting"]["message"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    ensure!(
        msg == "waiting for 4 free nvidia.com/gpu on one host; largest free slice is 0: host-a 0, host-b 0",
        "{msg}"
    );
    wait_for("a BackendQueued Event", Duration::from_secs(30), || {
        let ev = c.kubectl_json(&[
            "get",
            "events",
            "-n",
            &ns,
            "--field-selector",
            "involvedObject.name=four-3,reason=BackendQueued",
        ])?;
        Ok((!items(&ev).is_empty()).then_some(()))
    })?;
    c.kubectl(&[
        "delete",
        "pod",
        "four-1",
        "-n",
        &ns,
        "--wait=true",
        "--timeout=60s",
    ])?;
    let p3 = wait_ready(c, &ns, "four-3")?;
    let h3 = host_of(&vkd, str_at(&p3, "metadata.uid"))?;
    ensure!(h3 == h1, "four-3 went to {h3}, the freed host is {h1}");

    // Capacity changes in the backend reach the Node.
    std::fs::write(
        &fleet,
        original.replacen(
            "- {count: 4, model: H100-SXM5-80GB, memory: 80Gi, nvlink_domain: nvl-b",
            "- {count: 6, model: H100-SXM5-80GB, memory: 80Gi, nvlink_domain: nvl-b",
            1,
        ),
    )?;
    let node = wait_for(
        "the Node to show host-b's 6 GPUs",
        Duration::from_secs(60),
        || {
            let n = c.kubectl_json(&["get", "node", "vk-agg"])?;
            Ok((at(&n, "status.capacity")["nvidia.com/gpu"] == "10").then_some(n))
        },
    )?;
    ensure!(
        label(&node, "vkd.io/gpu.max-per-pod") == "6",
        "{}",
        at(&node, "metadata.labels")
    );
    let slices = annotation(&node, "vkd.io/slices");
    ensure!(slices.contains("host-b gpu 2/6"), "{slices}");

    // A Pod that waits longer than its queue timeout fails and says why.
    c.apply(&bound(
        gpu_pod(&ns, "impatient", "agg", 4, "vkd.io/queue-timeout: 3s"),
        "vk-agg",
    ))?;
    let p = wait_for(
        "the impatient Pod to time out",
        Duration::from_secs(60),
        || {
            let p = c.kubectl_json(&["get", "pod", "impatient", "-n", &ns])?;
            Ok((at(&p, "status.phase") == "Failed").then_some(p))
        },
    )?;
    ensure!(
        at(&p, "status.reason") == "BackendQueueTimeout",
        "{}",
        at(&p, "status")
    );
    ensure!(
        str_at(&p, "status.message").contains("largest free slice is 2"),
        "{}",
        at(&p, "status.message")
    );
    eprintln!(
        "aggregate: 8-GPU Pod TopologyUnsatisfiable; four-1 on {h1}, four-2 on {h2}; four-3 queued then ran on {h3}; capacity 8 -> 10 reached the Node; {}",
        str_at(&p, "status.message")
    );
    c.kubectl(&["delete", "namespace", &ns, "--wait=true", "--timeout=60s"])?;
    Ok(())
}

fn per_host(c: &Cluster) -> Result<()> {
    let fleet = repo_root().join("testdata/fleets/two-by-four.yaml");
    let _vkd = Vkd::start_provider(
        c,
        "vk-ph",
        "sim",
        &fleet,
        &[
            "--node-label",
            "vkd.io/e2e=ph",
            "--node-mode",
            "per-host",
            "--client-ca-file",
            c.env("VKD_E2E_KUBELET_CLIENT_CA")?,
        ],
    )?;
    let ns = c.namespace("topo-ph")?;
    for (node, host) in [("vk-ph-host-a", "host-a"), ("vk-ph-host-b", "host-b")] {
        let n = wait_for(&format!("{node} Ready"), Duration::from_secs(60), || {
            let n = c.kubectl_json(&["get", "node", node])?;
            let ready = condition(&n, "Ready").is_some_and(|c| c["status"] == "True");
            Ok(ready.then_some(n))
        })?;
        ensure!(
            at(&n, "status.capacity")["nvidia.com/gpu"] == "4",
            "{node}: {}",
            at(&n, "status.capacity")
        );
        ensure!(label(&n, "vkd.io/host") == host);
        ensure!(label(&n, "vkd.io/nvlink-domains") == format!("nvl-{}", &host[5..]));
        ensure!(label(&n, "vkd.io/rdma-domain").starts_with("rdma-"));
        let slices = annotation(&n, "vkd.io/slices");
        ensure!(
            slices.starts_with(host) && !slices.contains(';'),
            "{node}: {slices}"
        );
    }
    let nodes = c.kubectl_json(&["get", "nodes", "-l", "vkd.io/e2e=ph"])?;
    ensure!(
        items(&nodes).len() == 2,
        "per-host nodes: {}",
        items(&nodes).len()
    );

    c.apply(&gpu_pod(&ns, "eight", "ph", 8, ""))?;
    for name in ["four-1", "four-2"] {
        c.apply(&gpu_pod(&ns, name, "ph", 4, ""))?;
    }
    let p1 = wait_ready(c, &ns, "four-1")?;
    let p2 = wait_ready(c, &ns, "four-2")?;
    let (n1, n2) = (str_at(&p1, "spec.nodeName"), str_at(&p2, "spec.nodeName"));
    ensure!(n1 != n2, "both 4-GPU Pods on {n1}");
    // The real scheduler never binds 8 GPUs to a node that has 4.
    let eight = wait_for(
        "the 8-GPU Pod to be Unschedulable",
        Duration::from_secs(60),
        || {
            let p = c.kubectl_json(&["get", "pod", "eight", "-n", &ns])?;
            let unschedulable = condition(&p, "PodScheduled")
                .is_some_and(|c| c["status"] == "False" && c["reason"] == "Unschedulable");
            Ok(unschedulable.then_some(p))
        },
    )?;
    ensure!(
        str_at(&eight, "spec.nodeName").is_empty(),
        "bound to {}",
        str_at(&eight, "spec.nodeName")
    );
    ensure!(at(&eight, "status.phase") == "Pending");
    let why = str_at(
        condition(&eight, "PodScheduled").unwrap_or(&Value::Null),
        "message",
    )
    .to_owned();
    ensure!(why.contains("nvidia.com/gpu"), "{why}");
    // Each node serves its own kubelet API.
    for name in ["four-1", "four-2"] {
        c.kubectl(&["logs", name, "-n", &ns, "--tail=1"])?;
    }
    eprintln!("per-host: four-1 on {n1}, four-2 on {n2}; eight Pending: {why}");
    c.kubectl(&["delete", "namespace", &ns, "--wait=true", "--timeout=60s"])?;
    Ok(())
}
