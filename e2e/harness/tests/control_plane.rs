//! Smoke test of the real control plane built by `e2e/cluster`: what every other
//! e2e suite relies on, checked through the real kubectl.

use std::process::ExitCode;
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

const NODE: &str = "smoke-silent-node";

fn renew_lease(c: &Cluster) -> Result<()> {
    let now = micro_time(SystemTime::now());
    c.apply(&format!(
        r#"
apiVersion: coordination.k8s.io/v1
kind: Lease
metadata: {{name: {NODE}, namespace: kube-node-lease}}
spec: {{holderIdentity: {NODE}, leaseDurationSeconds: 40, renewTime: "{now}"}}
"#
    ))
    .map(drop)
}

fn silent_node_goes_not_ready_and_unreachable(c: &Cluster) -> Result<()> {
    // Tainted so the other tests' Pods never land here.
    c.apply(&format!(
        r#"
apiVersion: v1
kind: Node
metadata:
  name: {NODE}
  labels: {{kubernetes.io/hostname: {NODE}}}
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
        NODE,
        "--subresource=status",
        "--type=merge",
        "-p",
        &status,
    ])?;
    for _ in 0..3 {
        renew_lease(c)?;
        std::thread::sleep(Duration::from_secs(2));
    }
    let node = c.kubectl_json(&["get", "node", NODE])?;
    ensure!(
        condition(&node, "Ready").is_some_and(|r| r["status"] == "True"),
        "node not Ready while its lease is renewed: {}",
        at(&node, "status.conditions")
    );
    let renewed_at = SystemTime::now();

    // Stop renewing; the node lifecycle controller must notice after the grace period.
    let node = wait_for(
        "the silent node to be NotReady and tainted unreachable",
        Duration::from_secs(90),
        || {
            let node = c.kubectl_json(&["get", "node", NODE])?;
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
    let table = c.kubectl(&["get", "node", NODE, "--no-headers"])?;
    ensure!(
        table.contains("NotReady"),
        "kubectl get node shows {table:?}"
    );
    eprintln!(
        "silent node marked NotReady {:.1}s after its last lease renewal",
        waited.as_secs_f64()
    );
    c.kubectl(&["delete", "node", NODE])?;
    c.kubectl(&["delete", "lease", NODE, "-n", "kube-node-lease"])?;
    Ok(())
}
