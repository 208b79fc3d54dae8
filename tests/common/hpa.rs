//! An `autoscaling/v2` HPA on a Deployment of CPU burners: scaled from 1 to
//! 2 or more under load and back to 1 when it stops, with the timeline of
//! the scale-up. metrics-server must serve the cluster.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use serde_json::Value;
use vkd_e2e::metrics_server::RESOLUTION;
use vkd_e2e::{Cluster, at, wait_for};

use super::{items, running_and_ready};

/// A process node's Pod running a shell loop that burns a core while the
/// file /load/on exists (an emptyDir), and idles otherwise.
/// Its spec's `containers` and `volumes`, indented by `n`.
pub fn burner(n: usize) -> String {
    [
        "containers:",
        "- name: burner",
        "  image: busybox:1.36",
        "  command: [sh, -c, 'while :; do if [ -e /load/on ]; then :; else sleep 1; fi; done']",
        "  resources: {requests: {cpu: 100m, memory: 32Mi}}",
        "  volumeMounts: [{name: load, mountPath: /load}]",
        "volumes: [{name: load, emptyDir: {}}]",
    ]
    .iter()
    .map(|l| format!("{}{l}\n", " ".repeat(n)))
    .collect()
}

/// A CPU quantity as the metrics API writes it ("123456789n", "5m", "1") in nanocores.
fn nanocores(q: &str) -> Option<u64> {
    for (suffix, scale) in [("n", 1), ("u", 1_000), ("m", 1_000_000)] {
        if let Some(n) = q.strip_suffix(suffix) {
            return n.parse::<u64>().ok()?.checked_mul(scale);
        }
    }
    q.parse::<u64>().ok()?.checked_mul(1_000_000_000)
}

pub fn hpa_status(c: &Cluster, ns: &str) -> Result<Value> {
    c.kubectl_json(&["get", "hpa", "burner", "-n", ns])
}

pub fn replicas(c: &Cluster, ns: &str) -> Result<usize> {
    Ok(items(&c.kubectl_json(&["get", "pods", "-n", ns, "-l", "app=burner"])?).len())
}

/// Seconds since `start`, for the timeline.
fn since(start: Instant) -> f64 {
    start.elapsed().as_secs_f64()
}

/// What the scale-up took, in seconds from the load.
#[derive(Debug)]
pub struct Timeline {
    /// metrics-server's figure for the loaded Pod passed 200m.
    pub metric: f64,
    /// The HPA wanted 2 or more replicas.
    pub decision: f64,
    pub created: f64,
    pub ready: f64,
    /// The new Pod's `vkd.io/timeline`.
    pub vkd: String,
    /// From the load's end to one Pod again.
    pub back_to_one: f64,
}

impl std::fmt::Display for Timeline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "HPA timeline from load (s): metric above target {:.1}, decision {:.1}, new Pod \
             created {:.1}, Ready {:.1} (polled); the new Pod's timeline on vkd's clock: {}; \
             back to 1 Pod {:.1}s after the load stopped",
            self.metric, self.decision, self.created, self.ready, self.vkd, self.back_to_one
        )
    }
}

/// Deployment `burner` and its HPA (50% of 100m, 1 to 3 replicas, no
/// scale-down window) in `ns`; `placement`: the Pod template's lines that
/// send it to the node (6 spaces in). Load on in the first Pod, 2 or more
/// Pods Ready, load off, back to 1.
pub fn scale_up_and_down(
    c: &Cluster,
    ns: &str,
    placement: &str,
    patience: Duration,
) -> Result<Timeline> {
    c.apply(&format!(
        r#"
apiVersion: apps/v1
kind: Deployment
metadata: {{name: burner, namespace: {ns}}}
spec:
  replicas: 1
  selector: {{matchLabels: {{app: burner}}}}
  template:
    metadata: {{labels: {{app: burner}}}}
    spec:
      tolerations: [{{key: virtual-kubelet.io/provider, operator: Exists}}]
{placement}
      terminationGracePeriodSeconds: 2
{}---
apiVersion: autoscaling/v2
kind: HorizontalPodAutoscaler
metadata: {{name: burner, namespace: {ns}}}
spec:
  scaleTargetRef: {{apiVersion: apps/v1, kind: Deployment, name: burner}}
  minReplicas: 1
  maxReplicas: 3
  metrics:
  - type: Resource
    resource: {{name: cpu, target: {{type: Utilization, averageUtilization: 50}}}}
  behavior:
    scaleDown: {{stabilizationWindowSeconds: 0}}
"#,
        burner(6)
    ))?;
    // Settled at one Pod, the HPA reading its idle usage.
    let first = wait_for("the first burner Ready", Duration::from_secs(90), || {
        let pods = items(&c.kubectl_json(&["get", "pods", "-n", ns, "-l", "app=burner"])?);
        Ok(pods.into_iter().find(running_and_ready).map(|p| {
            at(&p, "metadata.name")
                .as_str()
                .unwrap_or_default()
                .to_owned()
        }))
    })?;
    wait_for("the HPA to read the idle Pod's CPU", RESOLUTION * 8, || {
        let h = hpa_status(c, ns)?;
        let util = at(&h, "status.currentMetrics")
            .get(0)
            .map(|m| at(m, "resource.current.averageUtilization").clone());
        Ok(util.filter(Value::is_number).map(|_| ()))
    })?;

    // Load on: the timeline of the scale-up.
    let load = Instant::now();
    c.kubectl(&["exec", "-n", ns, &first, "--", "touch", "/load/on"])?;
    let (mut metric, mut decision, mut created, mut ready) = (None, None, None, None);
    let mut timeline = String::new();
    let deadline = Instant::now() + patience;
    while ready.is_none() {
        ensure!(
            Instant::now() < deadline,
            "no second Pod Ready in {patience:?}"
        );
        if metric.is_none() {
            let m = c.kubectl(&[
                "get",
                "--raw",
                &format!("/apis/metrics.k8s.io/v1beta1/namespaces/{ns}/pods/{first}"),
            ]);
            let m = m.ok().and_then(|t| serde_json::from_str::<Value>(&t).ok());
            let cpu =
                m.and_then(|m| nanocores(at(&m, "containers").get(0)?["usage"]["cpu"].as_str()?));
            if cpu.is_some_and(|n| n >= 200_000_000) {
                metric = Some(since(load));
            }
        }
        let h = hpa_status(c, ns)?;
        if decision.is_none() && at(&h, "status.desiredReplicas").as_u64().unwrap_or(0) >= 2 {
            decision = Some(since(load));
        }
        let pods = items(&c.kubectl_json(&["get", "pods", "-n", ns, "-l", "app=burner"])?);
        if created.is_none() && pods.len() >= 2 {
            created = Some(since(load));
        }
        if let Some(p) = pods
            .iter()
            .find(|p| running_and_ready(p) && at(p, "metadata.name") != first.as_str())
        {
            ready = Some(since(load));
            timeline = at(p, "metadata.annotations")
                .get("vkd.io/timeline")
                .and_then(Value::as_str)
                .unwrap_or("(none)")
                .to_owned();
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let metric = metric.unwrap_or(f64::NAN);
    let decision = decision.context("Pods made without the HPA's decision")?;
    let (created, ready) = (created.unwrap_or(decision), ready.unwrap_or(0.0));

    // Load off: back to one.
    let off = Instant::now();
    c.kubectl(&["exec", "-n", ns, &first, "--", "rm", "/load/on"])?;
    wait_for("the HPA to scale back to 1", patience, || {
        let h = hpa_status(c, ns)?;
        let n = replicas(c, ns)?;
        Ok((at(&h, "status.desiredReplicas").as_u64() == Some(1) && n == 1).then_some(()))
    })?;
    Ok(Timeline {
        metric,
        decision,
        created,
        ready,
        vkd: timeline,
        back_to_one: since(off),
    })
}
