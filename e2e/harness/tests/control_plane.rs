//! Smoke test of the real control plane built by `e2e/cluster`: what every other
//! e2e suite relies on, checked through the real kubectl.

use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime};

use anyhow::{Context, Result, bail, ensure};
use vkd_e2e::{Cluster, Suite, at, condition, micro_time, wait_for};

/// Short enough that a silent node goes NotReady within the test's patience.
const GRACE: &str = "16s";

fn main() -> ExitCode {
    Suite::new(
        "control-plane",
        &[
            "--node-monitor-grace-period",
            GRACE,
            "--node-monitor-period",
            "2s",
        ],
    )
    .run(&[
        ("server_reports_v1_37", server_reports_v1_37),
        (
            "scheduler_and_controller_manager_are_healthy",
            scheduler_and_controller_manager_are_healthy,
        ),
        (
            "deployment_without_nodes_stays_unschedulable",
            deployment_without_nodes_stays_unschedulable,
        ),
        (
            "silent_node_goes_not_ready_and_unreachable",
            silent_node_goes_not_ready_and_unreachable,
        ),
    ])
}

fn server_reports_v1_37(c: &Cluster) -> Result<()> {
    let v = c.kubectl_json(&["version"])?;
    let server = at(&v, "serverVersion.gitVersion")
        .as_str()
        .unwrap_or_default();
    ensure!(
        server.starts_with("v1.37."),
        "server reports {server:?}, want v1.37.x"
    );
    ensure!(
        at(&v, "serverVersion.minor") == "37",
        "server minor is {}",
        at(&v, "serverVersion.minor")
    );
    let client = at(&v, "clientVersion.gitVersion")
        .as_str()
        .unwrap_or_default();
    ensure!(
        client.starts_with("v1.37."),
        "kubectl reports {client:?}, want v1.37.x"
    );
    Ok(())
}

fn scheduler_and_controller_manager_are_healthy(c: &Cluster) -> Result<()> {
    for (component, url) in [
        ("kube-scheduler", c.env("VKD_E2E_SCHEDULER")?),
        (
            "kube-controller-manager",
            c.env("VKD_E2E_CONTROLLER_MANAGER")?,
        ),
    ] {
        // kubectl against the component's own secure port, verified with the cluster CA.
        let server = format!("--server={url}");
        let health = c.kubectl(&[&server, "get", "--raw", "/healthz"])?;
        ensure!(
            health.trim() == "ok",
            "{component} /healthz said {health:?}"
        );
    }
    let ready = c.kubectl(&["get", "--raw", "/readyz"])?;
    ensure!(
        ready.trim() == "ok",
        "kube-apiserver /readyz said {ready:?}"
    );
    Ok(())
}

const DEPLOYMENT: &str = r#"
apiVersion: apps/v1
kind: Deployment
metadata: {name: web, namespace: smoke-unschedulable}
spec:
  replicas: 3
  selector: {matchLabels: {app: web}}
  template:
    metadata: {labels: {app: web}}
    spec:
      containers:
      - {name: web, image: registry.k8s.io/pause:3.10}
"#;

fn deployment_without_nodes_stays_unschedulable(c: &Cluster) -> Result<()> {
    let ns = c.namespace("smoke-unschedulable")?;
    c.apply(DEPLOYMENT)?;
    let unschedulable = || -> Result<Option<usize>> {
        let pods = c.kubectl_json(&["get", "pods", "-n", &ns, "-l", "app=web"])?;
        let items = at(&pods, "items").as_array().cloned().unwrap_or_default();
        let stuck = items
            .iter()
            .filter(|p| at(p, "status.phase") == "Pending" && at(p, "spec.nodeName").is_null())
            .filter(|p| {
                condition(p, "PodScheduled")
                    .is_some_and(|c| c["status"] == "False" && c["reason"] == "Unschedulable")
            })
            .count();
        if items.len() > 3 {
            bail!("{} pods for 3 replicas", items.len());
        }
        Ok((stuck == 3).then_some(stuck))
    };
    wait_for(
        "3 Pods Pending with PodScheduled=False/Unschedulable",
        Duration::from_secs(90),
        unschedulable,
    )?;
    // They stay that way: nothing binds them while no node can take them.
    std::thread::sleep(Duration::from_secs(3));
    ensure!(
        unschedulable()? == Some(3),
        "the Pods did not stay unschedulable"
    );
    let deploy = c.kubectl_json(&["get", "deployment", "web", "-n", &ns])?;
    ensure!(
        at(&deploy, "status.readyReplicas").is_null(),
        "readyReplicas set: {deploy}"
    );
    c.kubectl(&["delete", "namespace", &ns, "--wait=false"])?;
    Ok(())
}

const SILENT: &str = "smoke-silent-node";
const HEALTHY: &str = "smoke-healthy-node";

fn renew_lease(c: &Cluster, node: &str) -> Result<()> {
    let now = micro_time(SystemTime::now());
    c.apply(&format!(
        r#"
apiVersion: coordination.k8s.io/v1
kind: Lease
metadata: {{name: {node}, namespace: kube-node-lease}}
spec: {{holderIdentity: {node}, leaseDurationSeconds: 40, renewTime: "{now}"}}
"#
    ))
    .map(drop)
}

/// Registers a Node the way a kubelet does: object, Ready status, then a lease.
fn register_node(c: &Cluster, node: &str) -> Result<()> {
    // Tainted so the other tests' Pods never land here.
    c.apply(&format!(
        r#"
apiVersion: v1
kind: Node
metadata:
  name: {node}
  labels: {{kubernetes.io/hostname: {node}}}
spec:
  taints:
  - {{key: vkd.io/e2e, value: smoke, effect: NoSchedule}}
"#
    ))?;
    let now = micro_time(SystemTime::now());
    let status = format!(
        r#"{{"status":{{"conditions":[{{"type":"Ready","status":"True","reason":"KubeletReady",
        "message":"posted by the e2e test","lastHeartbeatTime":"{now}","lastTransitionTime":"{now}"}}]}}}}"#
    );
    c.kubectl(&[
        "patch",
        "node",
        node,
        "--subresource=status",
        "--type=merge",
        "-p",
        &status,
    ])?;
    renew_lease(c, node)
}

/// The node lifecycle controller only taints NoExecute (and so evicts) while part
/// of the zone is healthy: a zone whose every node is silent counts as a full
/// disruption, where it stops evicting. So a second node keeps heartbeating.
fn silent_node_goes_not_ready_and_unreachable(c: &Cluster) -> Result<()> {
    register_node(c, HEALTHY)?;
    register_node(c, SILENT)?;
    let stop = AtomicBool::new(false);
    let result = std::thread::scope(|s| {
        let heartbeat = s.spawn(|| -> Result<()> {
            while !stop.load(Ordering::Relaxed) {
                renew_lease(c, HEALTHY)?;
                std::thread::sleep(Duration::from_secs(2));
            }
            Ok(())
        });
        let result = watch_silent_node(c);
        stop.store(true, Ordering::Relaxed);
        match heartbeat.join() {
            Ok(Err(e)) => Err(e.context("heartbeat of the healthy node")),
            _ => result,
        }
    });
    for node in [SILENT, HEALTHY] {
        c.kubectl(&["delete", "node", node])?;
        c.kubectl(&["delete", "lease", node, "-n", "kube-node-lease"])?;
    }
    result
}

fn watch_silent_node(c: &Cluster) -> Result<()> {
    for _ in 0..2 {
        renew_lease(c, SILENT)?;
        std::thread::sleep(Duration::from_secs(2));
    }
    let node = c.kubectl_json(&["get", "node", SILENT])?;
    ensure!(
        condition(&node, "Ready").is_some_and(|r| r["status"] == "True"),
        "node not Ready while its lease is renewed: {}",
        at(&node, "status.conditions")
    );
    let renewed_at = SystemTime::now();

    // Stop renewing; the node lifecycle controller must notice after the grace period.
    let node = wait_for(
        "the silent node to be NotReady and tainted unreachable:NoExecute",
        Duration::from_secs(90),
        || {
            let node = c.kubectl_json(&["get", "node", SILENT])?;
            let ready = condition(&node, "Ready").context("no Ready condition")?;
            let tainted = at(&node, "spec.taints").as_array().is_some_and(|ts| {
                ts.iter().any(|t| {
                    t["key"] == "node.kubernetes.io/unreachable" && t["effect"] == "NoExecute"
                })
            });
            Ok((ready["status"] == "Unknown" && tainted).then_some(node))
        },
    )?;
    let waited = renewed_at.elapsed().unwrap_or_default();
    let ready = condition(&node, "Ready").context("no Ready condition")?;
    ensure!(
        ready["reason"] == "NodeStatusUnknown",
        "Ready reason {}",
        ready["reason"]
    );
    ensure!(
        waited >= Duration::from_secs(10),
        "marked NotReady after {waited:?}, before the {GRACE} grace period could pass"
    );
    let table = c.kubectl(&["get", "node", SILENT, "--no-headers"])?;
    ensure!(
        table.contains("NotReady"),
        "kubectl get node shows {table:?}"
    );
    let healthy = c.kubectl_json(&["get", "node", HEALTHY])?;
    ensure!(
        condition(&healthy, "Ready").is_some_and(|r| r["status"] == "True"),
        "the heartbeating node went NotReady too"
    );
    eprintln!(
        "silent node marked NotReady and unreachable {:.1}s after its last lease renewal",
        waited.as_secs_f64()
    );
    Ok(())
}
