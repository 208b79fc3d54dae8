//! End-to-end: the metrics chain through vkd's nodes, as a cluster admin has
//! it. A real metrics-server (built from Go modules) behind the aggregation
//! layer scrapes vkd's kubelet port with its ServiceAccount's token; `kubectl
//! top` and the HorizontalPodAutoscaler read it through the API server.

use std::collections::BTreeMap;
use std::process::ExitCode;
use std::sync::Mutex;
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use serde_json::Value;
use vkd_e2e::metrics_server::{MetricsServer, RESOLUTION};
use vkd_e2e::monitoring::{Job, KubeStateMetrics, Prometheus, PrometheusAdapter};
use vkd_e2e::{Cluster, Suite, at, condition, repo_root, wait_for};

mod common;
use common::hpa::{self, burner};
use common::{Vkd, items, running_and_ready, users_client_ca};

/// A sample's value as Prometheus writes it: a number, or NaN where a
/// quantile had no observations.
fn number(v: &str) -> Option<f64> {
    v.parse::<f64>().ok().filter(|n| n.is_finite())
}

fn main() -> ExitCode {
    let code = Suite::new("metrics", &[]).run(&[
        (
            "kubectl_top_on_an_idle_and_a_busy_process_node",
            top_process,
        ),
        (
            "kubectl_top_on_per_host_sim_nodes_shows_each_its_own_pods",
            |c| top_per_host_sim(c, false),
        ),
        (
            "per_host_sim_nodes_on_one_shared_kubelet_port_keep_their_own_pods",
            |c| top_per_host_sim(c, true),
        ),
        (
            "hpa_scales_a_process_deployment_up_under_load_and_back_down",
            hpa,
        ),
        (
            "every_dashboard_query_returns_series_from_a_real_prometheus",
            dashboard,
        ),
        (
            "an_hpa_scales_on_gpu_utilisation_through_prometheus_adapter",
            gpu_hpa,
        ),
    ]);
    *METRICS_SERVER.lock().unwrap_or_else(|p| p.into_inner()) = None;
    code
}

static METRICS_SERVER: Mutex<Option<std::result::Result<MetricsServer, String>>> = Mutex::new(None);

/// The suite's metrics-server, started once.
fn metrics_server(c: &Cluster) -> Result<()> {
    let mut slot = METRICS_SERVER.lock().unwrap_or_else(|p| p.into_inner());
    slot.get_or_insert_with(|| MetricsServer::start(c).map_err(|e| format!("{e:#}")))
        .as_ref()
        .map(|_| ())
        .map_err(|e| anyhow::anyhow!("metrics-server did not start: {e}"))
}

/// A CPU quantity as `kubectl top` prints it ("250m", "2") in millicores.
fn millicores(text: &str) -> Result<u64> {
    Ok(match text.strip_suffix('m') {
        Some(m) => m.parse()?,
        None => text.parse::<u64>()? * 1000,
    })
}

/// A memory quantity as `kubectl top` prints it ("32Mi") in MiB, rounded up
/// (so "512Ki" is 1, not 0).
fn mebibytes(text: &str) -> Result<u64> {
    for (suffix, kib) in [("Ki", 1), ("Mi", 1 << 10), ("Gi", 1 << 20)] {
        if let Some(n) = text.strip_suffix(suffix) {
            return Ok((n.parse::<u64>()? * kib).div_ceil(1 << 10));
        }
    }
    bail!("memory {text:?} in a unit this test does not read")
}

/// `kubectl top` rows: name -> (CPU millicores, memory MiB).
fn top(c: &Cluster, args: &[&str]) -> Result<BTreeMap<String, (u64, u64)>> {
    let mut all = vec!["top"];
    all.extend_from_slice(args);
    all.push("--no-headers");
    let out = c.kubectl(&all)?;
    let mut rows = BTreeMap::new();
    for line in out.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        // node: NAME CPU CPU% MEMORY MEMORY%; pod: NAME CPU MEMORY
        let (name, cpu, mem) = match f.as_slice() {
            [n, cpu, _, mem, _] | [n, cpu, mem] => (*n, *cpu, *mem),
            _ => bail!("a kubectl top row this test does not read: {line:?}"),
        };
        rows.insert(name.to_owned(), (millicores(cpu)?, mebibytes(mem)?));
    }
    Ok(rows)
}

/// The node's row in `kubectl top node`, once metrics-server has it.
fn top_node(c: &Cluster, node: &str) -> Result<(u64, u64)> {
    wait_for(&format!("kubectl top node {node}"), RESOLUTION * 6, || {
        Ok(top(c, &["node", node])?.remove(node))
    })
}

fn node_ready(c: &Cluster, node: &str) -> Result<()> {
    wait_for(&format!("{node} Ready"), Duration::from_secs(60), || {
        let n = c.kubectl_json(&["get", "node", node])?;
        Ok(condition(&n, "Ready")
            .is_some_and(|c| c["status"] == "True")
            .then_some(()))
    })
}

fn wait_ready(c: &Cluster, ns: &str, name: &str) -> Result<Value> {
    wait_for(&format!("{name} Ready"), Duration::from_secs(60), || {
        let p = c.kubectl_json(&["get", "pod", name, "-n", ns])?;
        Ok(running_and_ready(&p).then_some(p))
    })
}

fn process_vkd(c: &Cluster, node: &str, label: &str, ns: &str) -> Result<Vkd> {
    let v = Vkd::start_process(
        c,
        node,
        &[
            "--node-label",
            &format!("vkd.io/e2e={label}"),
            "--client-ca-file",
            c.env("VKD_E2E_KUBELET_CLIENT_CA")?,
            "--allowed-namespace",
            ns,
        ],
    )?;
    c.namespace(ns)?;
    node_ready(c, node)?;
    Ok(v)
}

fn top_process(c: &Cluster) -> Result<()> {
    const NS: &str = "metrics-top";
    const NODE: &str = "vk-mtop";
    metrics_server(c)?;
    let vkd = process_vkd(c, NODE, "mtop", NS)?;
    let result = (|| -> Result<()> {
        // Idle: no Pods, and still a row: vkd's own overhead, not 0.
        let (cpu, mem) = top_node(c, NODE)?;
        let rss_mib = vkd.rss_kib().context("vkd's RSS")? / 1024;
        eprintln!("idle {NODE}: {cpu}m {mem}Mi (vkd's RSS {rss_mib}Mi)");
        ensure!(
            mem > 0 && mem <= rss_mib * 2,
            "an idle node reads vkd's memory: {mem}Mi against an RSS of {rss_mib}Mi"
        );

        // Busy: a burner at a core and an idle Pod beside it.
        let pod = |name: &str| {
            format!(
                "apiVersion: v1\nkind: Pod\nmetadata: {{name: {name}, namespace: {NS}}}\nspec:\n  \
                 nodeSelector: {{vkd.io/e2e: mtop}}\n  \
                 tolerations: [{{key: virtual-kubelet.io/provider, operator: Exists}}]\n{}",
                burner(2)
            )
        };
        c.apply(&pod("busy"))?;
        c.apply(&pod("idle"))?;
        wait_ready(c, NS, "busy")?;
        wait_ready(c, NS, "idle")?;
        c.kubectl(&["exec", "-n", NS, "busy", "--", "touch", "/load/on"])?;
        let pods = wait_for(
            "kubectl top pod to show the burner busy and the idle Pod",
            RESOLUTION * 8,
            || {
                let rows = top(c, &["pod", "-n", NS])?;
                let busy = rows.get("busy").is_some_and(|(cpu, _)| *cpu >= 300);
                Ok((busy && rows.contains_key("idle")).then_some(rows))
            },
        )?;
        eprintln!("kubectl top pod -n {NS}: {pods:?}");
        let (idle_cpu, idle_mem) = pods["idle"];
        ensure!(idle_cpu < 100 && idle_mem > 0, "idle: {:?}", pods["idle"]);
        let (busy_cpu, busy_mem) = pods["busy"];
        ensure!(busy_mem > 0, "busy: {:?}", pods["busy"]);
        let (node_cpu, node_mem) =
            wait_for("the node's CPU to count the burner", RESOLUTION * 4, || {
                let row = top(c, &["node", NODE])?.remove(NODE);
                Ok(row.filter(|(cpu, _)| *cpu >= busy_cpu / 2))
            })?;
        eprintln!("busy {NODE}: {node_cpu}m {node_mem}Mi (burner {busy_cpu}m)");
        // As a person sees it.
        eprintln!(
            "$ kubectl top pod -n {NS}\n{}$ kubectl top node {NODE}\n{}",
            c.kubectl(&["top", "pod", "-n", NS])?,
            c.kubectl(&["top", "node", NODE])?
        );
        ensure!(node_mem >= busy_mem + idle_mem, "{node_mem}Mi");

        // The burner ends: the node's counter keeps its time (metrics-server
        // would drop a node whose counter went back), the node still reads.
        c.kubectl(&["delete", "pod", "-n", NS, "busy", "idle", "--wait=true"])?;
        std::thread::sleep(RESOLUTION * 2);
        let after = top_node(c, NODE)?;
        eprintln!("after the Pods ended {NODE}: {after:?}");
        ensure!(
            after.0 < busy_cpu / 2,
            "the node's CPU falls when the burner ends: {after:?}"
        );
        Ok(())
    })();
    drop(vkd);
    result
}

/// Per-host sim Nodes, each on its own kubelet port or all on one
/// (`--shared-kubelet-port`, where metrics-server follows each Node's
/// `metrics.k8s.io/resource-metrics-path`): each shows only its own Pods, and
/// logs and exec reach the Pod on whichever Node it is.
fn top_per_host_sim(c: &Cluster, shared: bool) -> Result<()> {
    let (ns, node) = if shared {
        ("metrics-shared", "vk-msh")
    } else {
        ("metrics-ph", "vk-mph")
    };
    metrics_server(c)?;
    let fleet = repo_root().join("testdata/fleets/two-by-four.yaml");
    let label = format!("vkd.io/e2e={node}");
    // The cluster's users' CA too, for `vkd explain --direct` as the admin.
    let client_ca = users_client_ca(c)?;
    let mut args = vec![
        "--node-label",
        &label,
        "--node-mode",
        "per-host",
        "--client-ca-file",
        &client_ca,
    ];
    if shared {
        args.push("--shared-kubelet-port=true");
    }
    let _vkd = Vkd::start_provider(c, node, "sim", &fleet, &args)?;
    c.namespace(ns)?;
    let (a, b) = (format!("{node}-host-a"), format!("{node}-host-b"));
    let (a, b) = (a.as_str(), b.as_str());
    node_ready(c, a)?;
    node_ready(c, b)?;
    let ports = [a, b]
        .map(|n| Ok::<_, anyhow::Error>(kubelet_endpoint(c, n)?.0))
        .into_iter()
        .collect::<Result<Vec<_>>>()?;
    ensure!(
        (ports[0] == ports[1]) == shared,
        "kubelet ports {ports:?}, shared: {shared}"
    );
    // Two Pods on host-a, each using what its annotations say; host-b idle.
    let pod = |name: &str, on: &str, cpu: &str, mem: &str| {
        c.apply(&format!(
            "apiVersion: v1\nkind: Pod\nmetadata:\n  name: {name}\n  namespace: {ns}\n  \
             annotations: {{sim.vkd.io/cpu-usage: {cpu}, sim.vkd.io/memory-usage: {mem}}}\n\
             spec:\n  nodeName: {on}\n  \
             tolerations: [{{key: virtual-kubelet.io/provider, operator: Exists}}]\n  \
             containers: [{{name: main, image: example/main:1}}]\n"
        ))
    };
    pod("a-big", a, "700m", "300Mi")?;
    pod("a-small", a, "30m", "20Mi")?;
    wait_ready(c, ns, "a-big")?;
    wait_ready(c, ns, "a-small")?;
    let pods = wait_for(
        "kubectl top pod to show both sim Pods",
        RESOLUTION * 6,
        || {
            let rows = top(c, &["pod", "-n", ns])?;
            Ok((rows.len() == 2).then_some(rows))
        },
    )?;
    eprintln!("kubectl top pod -n {ns}: {pods:?}");
    ensure!(
        pods["a-big"].1 == 300 && pods["a-small"].1 == 20,
        "memory as annotated: {pods:?}"
    );
    ensure!(
        (650..=750).contains(&pods["a-big"].0) && (20..=40).contains(&pods["a-small"].0),
        "CPU as annotated: {pods:?}"
    );
    let (cpu_a, mem_a) = top_node(c, a)?;
    let (cpu_b, mem_b) = top_node(c, b)?;
    eprintln!("{a}: {cpu_a}m {mem_a}Mi; {b} (idle): {cpu_b}m {mem_b}Mi");
    ensure!(mem_a >= 320 && cpu_a >= 700, "{a} counts its Pods");
    ensure!(
        mem_b > 0 && mem_b < 320 && cpu_b < 700,
        "{b} reads its share of vkd, none of host-a's Pods"
    );
    // What each Node's kubelet port serves metrics-server, read as it reads
    // it (its token, the port the Node advertises, the path it annotates):
    // its own Pods only.
    for (n, mine) in [(a, true), (b, false)] {
        let (code, text) = scrape(c, n, None)?;
        ensure!(code == 200, "scraping {n}: {code} {text}");
        for pod in ["a-big", "a-small"] {
            let listed = text.contains(&format!("pod=\"{pod}\""));
            ensure!(listed == mine, "{n} lists {pod}: {listed}\n{text}");
        }
    }
    if shared {
        // The node-wide path without a Node's name is no one Node's: refused
        // with where to ask, never every Node's figures at once.
        let (code, text) = scrape(c, a, Some("/metrics/resource"))?;
        eprintln!("/metrics/resource on the shared port: {code} {text}");
        ensure!(
            code == 404 && text.contains("/nodes/<node>/metrics/resource") && text.contains(b),
            "{code} {text}"
        );
        // `vkd explain node` names the Node it asks about on the shared port.
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_vkd"))
            .args(["explain", "node", b, "-o", "json", "--direct"])
            .arg("--insecure-skip-tls-verify-kubelet")
            .env("KUBECONFIG", c.kubeconfig())
            .output()?;
        ensure!(
            out.status.success(),
            "vkd explain node {b}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let answer: Value = serde_json::from_slice(&out.stdout)?;
        ensure!(
            answer["vkd"]["node"] == b && answer["vkd"]["pods"] == 0,
            "vkd explain node {b} on the shared port: {answer}"
        );
    }
    // Logs and exec find each Pod on its own Node.
    pod("b-one", b, "10m", "10Mi")?;
    wait_ready(c, ns, "b-one")?;
    for name in ["a-big", "b-one"] {
        let said = c.kubectl(&["exec", "-n", ns, name, "--", "echo", &format!("hi-{name}")])?;
        ensure!(
            said.trim() == format!("hi-{name}"),
            "exec in {name}: {said:?}"
        );
        let logs = c.kubectl(&["logs", "-n", ns, name, "--tail=1"])?;
        ensure!(!logs.trim().is_empty(), "logs of {name} are empty");
    }
    c.kubectl(&["delete", "namespace", ns, "--wait=true", "--timeout=60s"])?;
    Ok(())
}

/// The kubelet port a Node advertises and the resource-metrics path it
/// annotates (metrics-server's default when it has none).
fn kubelet_endpoint(c: &Cluster, node: &str) -> Result<(u64, String)> {
    let n = c.kubectl_json(&["get", "node", node])?;
    let port = at(&n, "status.daemonEndpoints.kubeletEndpoint.Port")
        .as_u64()
        .context("the Node's kubelet port")?;
    let path = n["metadata"]["annotations"]["metrics.k8s.io/resource-metrics-path"]
        .as_str()
        .unwrap_or("/metrics/resource")
        .to_owned();
    Ok((port, path))
}

/// The status and body of `node`'s resource metrics (or `path`), with
/// metrics-server's token, from the kubelet port its Node advertises.
fn scrape(c: &Cluster, node: &str, path: Option<&str>) -> Result<(u16, String)> {
    let (port, annotated) = kubelet_endpoint(c, node)?;
    let kubeconfig = std::fs::read_to_string(c.dir().join("kubeconfig-metrics-server"))?;
    let token = kubeconfig
        .split("token: '")
        .nth(1)
        .and_then(|t| t.split('\'').next())
        .context("metrics-server's token")?;
    let out = std::process::Command::new("curl")
        .args(["-sSk", "--max-time", "20", "-w", "\n%{http_code}", "-H"])
        .arg(format!("Authorization: Bearer {token}"))
        .arg(format!(
            "https://127.0.0.1:{port}{}",
            path.unwrap_or(&annotated)
        ))
        .output()?;
    ensure!(
        out.status.success(),
        "scraping {node}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout)?;
    let (body, code) = text.rsplit_once('\n').context("curl's status line")?;
    Ok((code.trim().parse()?, body.to_owned()))
}

fn hpa(c: &Cluster) -> Result<()> {
    const NS: &str = "metrics-hpa";
    const NODE: &str = "vk-mhpa";
    metrics_server(c)?;
    let vkd = process_vkd(c, NODE, "mhpa", NS)?;
    let result = (|| -> Result<()> {
        let t = hpa::scale_up_and_down(
            c,
            NS,
            "      nodeSelector: {vkd.io/e2e: mhpa}\n",
            Duration::from_secs(240),
        )?;
        eprintln!("process node: {t}");
        c.kubectl(&["delete", "namespace", NS, "--wait=true", "--timeout=90s"])?;
        Ok(())
    })();
    drop(vkd);
    result
}

/// Every panel of manifests/grafana/vkd-dashboard.json, its queries evaluated
/// by a real Prometheus that scrapes vkd (as the PodMonitor does) and
/// kube-state-metrics, on a sim node with Pods, one of them on two GPUs.
fn dashboard(c: &Cluster) -> Result<()> {
    const NS: &str = "metrics-dash";
    const NODE: &str = "vk-mdash";
    let fleet = repo_root().join("testdata/fleets/two-by-four.yaml");
    let vkd = Vkd::start_provider(
        c,
        NODE,
        "sim",
        &fleet,
        &["--node-label", "vkd.io/e2e=mdash"],
    )?;
    node_ready(c, NODE)?;
    c.namespace(NS)?;
    let admin = vkd.admin_port()?.to_string();
    let ksm = KubeStateMetrics::start(c)?;
    let job = |name: &str, port: &str| Job {
        name: name.into(),
        target: format!("127.0.0.1:{port}"),
        path: "/metrics".into(),
        honor_labels: true,
    };
    let prom = Prometheus::start(
        c,
        &[
            job("vkd", &admin),
            job("kube-state-metrics", &ksm.port.to_string()),
        ],
    )?;
    wait_for("both targets up", Duration::from_secs(60), || {
        let t = prom.targets()?;
        Ok((t.len() == 2 && t.iter().all(|(_, h, _)| h == "up")).then_some(()))
    })?;
    // Pods made while Prometheus watches, so rates and quantiles have
    // observations in their windows.
    for (name, extra) in [
        (
            "train",
            "annotations: {sim.vkd.io/gpu-utilization: \"73\", sim.vkd.io/gpu-memory-usage: 20Gi}",
        ),
        ("web-1", "annotations: {}"),
        ("web-2", "annotations: {}"),
    ] {
        let gpus = if name == "train" {
            "limits: {nvidia.com/gpu: 2}"
        } else {
            ""
        };
        c.apply(&format!(
            "apiVersion: v1\nkind: Pod\nmetadata:\n  name: {name}\n  namespace: {NS}\n  {extra}\n\
             spec:\n  nodeSelector: {{vkd.io/e2e: mdash}}\n  \
             tolerations: [{{key: virtual-kubelet.io/provider, operator: Exists}}]\n  \
             containers: [{{name: main, image: example/main:1, resources: {{{gpus}}}}}]\n"
        ))?;
    }
    for name in ["train", "web-1", "web-2"] {
        wait_ready(c, NS, name)?;
    }

    // The GPU Pod's series, with DCGM exporter's names and labels.
    let gpu = wait_for(
        "DCGM_FI_DEV_GPU_UTIL for the GPU Pod",
        Duration::from_secs(60),
        || {
            let s = prom.query(&format!(
                "DCGM_FI_DEV_GPU_UTIL{{namespace=\"{NS}\",pod=\"train\"}}"
            ))?;
            Ok((s.len() == 2).then_some(s))
        },
    )?;
    for (labels, value) in &gpu {
        ensure!(value == "73", "{labels} {value}");
        ensure!(
            labels["container"] == "main"
                && labels["modelName"] == "H100-SXM5-80GB"
                && labels["Hostname"]
                    .as_str()
                    .is_some_and(|h| h.starts_with("host-"))
                && labels["UUID"].as_str().is_some_and(|u| u.contains("-gpu"))
                && labels["gpu"]
                    .as_str()
                    .is_some_and(|g| g.parse::<u32>().is_ok()),
            "DCGM labels: {labels}"
        );
    }
    let used = prom.query(&format!(
        "sum(DCGM_FI_DEV_FB_USED{{namespace=\"{NS}\",pod=\"train\"}})"
    ))?;
    ensure!(
        used.first().map(|(_, v)| v.as_str()) == Some("40960"),
        "20 GiB on each of 2 GPUs: {used:?}"
    );

    let dash: Value = serde_json::from_str(&std::fs::read_to_string(
        repo_root().join("manifests/grafana/vkd-dashboard.json"),
    )?)?;
    let mut report = Vec::new();
    for panel in at(&dash, "panels").as_array().into_iter().flatten() {
        let title = panel["title"].as_str().unwrap_or_default();
        for t in panel["targets"].as_array().into_iter().flatten() {
            let expr = t["expr"]
                .as_str()
                .unwrap_or_default()
                .replace("$node", NODE);
            let refid = t["refId"].as_str().unwrap_or_default();
            // Rates need two samples in their window; quantiles an
            // observation: both come within a few scrapes.
            let got = wait_for(
                &format!("panel {title:?} {refid}: {expr}"),
                Duration::from_secs(60),
                || {
                    let s = prom.query(&expr)?;
                    Ok(s.iter().any(|(_, v)| number(v).is_some()).then_some(s))
                },
            )?;
            let values: Vec<String> = got
                .iter()
                .filter(|(_, v)| number(v).is_some())
                .take(3)
                .map(|(m, v)| {
                    let labels: Vec<String> = m
                        .as_object()
                        .into_iter()
                        .flatten()
                        .map(|(k, v)| format!("{k}={}", v.as_str().unwrap_or_default()))
                        .collect();
                    format!("{{{}}} {v}", labels.join(","))
                })
                .collect();
            report.push(format!(
                "{title} [{refid}]: {} series; {}",
                got.len(),
                values.join("; ")
            ));
        }
    }
    eprintln!(
        "dashboard queries against Prometheus:\n  {}",
        report.join("\n  ")
    );
    drop(prom);
    drop(ksm);
    c.kubectl(&["delete", "namespace", NS, "--wait=true", "--timeout=60s"])?;
    drop(vkd);
    Ok(())
}

/// A custom-metrics HPA on `DCGM_FI_DEV_GPU_UTIL`, as NVIDIA documents it for
/// DCGM exporter, fed by vkd's series through a real Prometheus and
/// prometheus-adapter: 1 -> 3 Pods while each GPU reads 90%, back to 1 when
/// a rollout brings them to 10%.
fn gpu_hpa(c: &Cluster) -> Result<()> {
    const NS: &str = "metrics-gpu-hpa";
    const NODE: &str = "vk-mgpu";
    let fleet = repo_root().join("testdata/fleets/two-by-four.yaml");
    let vkd = Vkd::start_provider(c, NODE, "sim", &fleet, &["--node-label", "vkd.io/e2e=mgpu"])?;
    node_ready(c, NODE)?;
    c.namespace(NS)?;
    let admin = vkd.admin_port()?.to_string();
    let prom = Prometheus::start(
        c,
        &[Job {
            name: "vkd".into(),
            target: format!("127.0.0.1:{admin}"),
            path: "/metrics".into(),
            honor_labels: true,
        }],
    )?;
    let _adapter = PrometheusAdapter::start(c, &prom)?;
    let deployment = |utilisation: u32| {
        format!(
            r#"
apiVersion: apps/v1
kind: Deployment
metadata: {{name: train, namespace: {NS}}}
spec:
  replicas: 1
  selector: {{matchLabels: {{app: train}}}}
  template:
    metadata:
      labels: {{app: train}}
      annotations: {{sim.vkd.io/gpu-utilization: "{utilisation}"}}
    spec:
      nodeSelector: {{vkd.io/e2e: mgpu}}
      tolerations: [{{key: virtual-kubelet.io/provider, operator: Exists}}]
      terminationGracePeriodSeconds: 1
      containers: [{{name: main, image: example/train:1, resources: {{limits: {{nvidia.com/gpu: 1}}}}}}]
"#
        )
    };
    c.apply(&deployment(90))?;
    c.apply(&format!(
        r#"
apiVersion: autoscaling/v2
kind: HorizontalPodAutoscaler
metadata: {{name: train, namespace: {NS}}}
spec:
  scaleTargetRef: {{apiVersion: apps/v1, kind: Deployment, name: train}}
  minReplicas: 1
  maxReplicas: 3
  metrics:
  - type: Pods
    pods:
      metric: {{name: DCGM_FI_DEV_GPU_UTIL}}
      target: {{type: AverageValue, averageValue: "50"}}
  behavior:
    scaleDown: {{stabilizationWindowSeconds: 0}}
"#
    ))?;
    let started = std::time::Instant::now();
    let ready_pods = || -> Result<usize> {
        let pods = c.kubectl_json(&["get", "pods", "-n", NS, "-l", "app=train"])?;
        Ok(items(&pods).iter().filter(|p| running_and_ready(p)).count())
    };
    let hpa_reads = |c: &Cluster| -> Result<Option<String>> {
        let h = c.kubectl_json(&["get", "hpa", "train", "-n", NS])?;
        Ok(at(&h, "status.currentMetrics").get(0).and_then(|m| {
            at(m, "pods.current.averageValue")
                .as_str()
                .map(str::to_owned)
        }))
    };
    wait_for("3 GPU Pods at 90%", Duration::from_secs(240), || {
        Ok((ready_pods()? == 3).then_some(()))
    })?;
    let up = started.elapsed().as_secs_f64();
    let read = hpa_reads(c)?.unwrap_or_default();
    // Each Pod's figure as the HPA asks for it (a new Pod's within vkd's
    // refresh and a scrape).
    let values = wait_for(
        "custom.metrics.k8s.io to give each of the 3 Pods 90",
        Duration::from_secs(60),
        || {
            let custom = c.kubectl(&[
                "get",
                "--raw",
                &format!(
                    "/apis/custom.metrics.k8s.io/v1beta1/namespaces/{NS}/pods/*/DCGM_FI_DEV_GPU_UTIL"
                ),
            ])?;
            let custom: Value = serde_json::from_str(&custom)?;
            let values: Vec<String> = at(&custom, "items")
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|i| i["value"].as_str().map(str::to_owned))
                .collect();
            Ok((values.len() == 3 && values.iter().all(|v| v == "90")).then_some(values))
        },
    )?;
    // The work gets lighter: a rollout to 10% per GPU, then back to one Pod.
    let lighter = std::time::Instant::now();
    c.apply(&deployment(10))?;
    wait_for("one GPU Pod at 10%", Duration::from_secs(240), || {
        let pods = items(&c.kubectl_json(&["get", "pods", "-n", NS, "-l", "app=train"])?);
        let h = c.kubectl_json(&["get", "hpa", "train", "-n", NS])?;
        Ok((pods.len() == 1 && at(&h, "status.desiredReplicas").as_u64() == Some(1)).then_some(()))
    })?;
    eprintln!(
        "GPU HPA: 1 -> 3 Pods at 90% in {up:.1}s (the HPA read {read}; custom.metrics.k8s.io \
         per Pod {values:?}); back to 1 Pod {:.1}s after the rollout to 10%",
        lighter.elapsed().as_secs_f64()
    );
    c.kubectl(&["delete", "namespace", NS, "--wait=true", "--timeout=60s"])?;
    drop(vkd);
    Ok(())
}
