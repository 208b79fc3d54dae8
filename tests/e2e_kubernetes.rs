//! End-to-end: the kubernetes provider, with two real control planes.
//!
//! Downstream, vkd runs the process provider as a node of its own cluster;
//! upstream, vkd runs the kubernetes provider against that cluster. Every check
//! goes through the upstream kubectl, except where a test looks downstream to
//! see what really exists there.

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Command, ExitCode, Stdio};
use std::sync::Mutex;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use serde_json::Value;
use vkd_e2e::metrics_server::{MetricsServer, RESOLUTION};
use vkd_e2e::monitoring::{Job, Prometheus};
use vkd_e2e::{Cluster, Suite, at, wait_for};

mod common;
use common::{Vkd, admin_get, items, running_and_ready, str_at};

/// The upstream virtual node.
const UP_NODE: &str = "vk-offload";
/// The downstream process node.
const DOWN_NODE: &str = "vk-down-proc";
/// The downstream process node's address (a loopback one of its own).
const DOWN_NODE_IP: &str = "127.0.0.2";
/// The downstream sim vkd in per-host mode: two hosts with 4 GPUs each.
const DOWN_GPU: &str = "vk-down-gpu";
const NS: &str = "offload";
/// The identity `manifests/downstream` gives vkd downstream: the only one
/// its admission policy lets set vkd's labels.
const VKD_SA: &str = "system:serviceaccount:vkd-system:vkd-downstream";

struct Chain {
    down: Cluster,
    _down_vkd: Vkd,
    _down_gpu: Vkd,
    up_vkd: Vkd,
    /// metrics-server on each cluster, started by the test that needs them.
    metrics: Option<(MetricsServer, MetricsServer)>,
    /// The downstream Prometheus, scraping the downstream GPU node's vkd as
    /// a downstream cluster's scrapes its DCGM exporter.
    _down_prometheus: Prometheus,
}

static CHAIN: Mutex<Option<std::result::Result<Chain, String>>> = Mutex::new(None);

fn main() -> ExitCode {
    let code = Suite::new("kubernetes-up", &[]).run(&[
        (
            "offloaded_pod_runs_two_hops_down_with_logs_exec_and_deletion",
            offloaded_pod,
        ),
        (
            "capacity_is_the_downstream_nodes_and_a_stale_epoch_is_refused_downstream",
            capacity_and_fence,
        ),
        (
            "gpu_pods_are_admitted_on_downstream_host_slices_with_other_tenants_counted",
            gpu_slices,
        ),
        (
            "sigkill_during_50_creates_three_times_leaves_one_downstream_pod_each",
            kill_during_creates,
        ),
        (
            "logs_follow_spdy_exec_and_port_forward_through_the_chain",
            streams,
        ),
        (
            "a_force_deleted_pods_downstream_pod_is_collected",
            force_deleted,
        ),
        (
            "a_60s_downstream_outage_evicts_nothing_and_converges",
            downstream_outage,
        ),
        (
            "the_articles_deployment_runs_downstream_as_written_and_leaves_nothing",
            articles_deployment,
        ),
        (
            "a_downstream_decoy_is_refused_by_admission_and_ignored_by_vkd",
            decoy,
        ),
        (
            "upstream_namespace_system_runs_in_a_namespace_of_its_own_under_pod_security",
            system_namespace,
        ),
        (
            "a_volume_too_large_for_a_secret_fails_the_pod_saying_so",
            volume_too_large,
        ),
        (
            "a_deposed_replica_is_refused_every_downstream_write",
            deposed_replica,
        ),
        (
            "kubectl_top_shows_an_offloaded_pods_downstream_figures",
            top_through_the_chain,
        ),
        (
            "hpa_scales_an_offloaded_deployment_up_under_load_and_back_down",
            hpa_through_the_chain,
        ),
    ]);
    // Stop the downstream cluster and both daemons.
    drop(CHAIN.lock().unwrap_or_else(|p| p.into_inner()).take());
    code
}

/// Starts the downstream cluster, its process node and the upstream vkd once.
fn chain<T>(up: &Cluster, f: impl FnOnce(&mut Chain) -> Result<T>) -> Result<T> {
    let mut slot = CHAIN.lock().unwrap_or_else(|p| p.into_inner());
    let chain = slot.get_or_insert_with(|| start_chain(up).map_err(|e| format!("{e:#}")));
    match chain {
        Ok(c) => f(c),
        Err(e) => anyhow::bail!("the chain did not start: {e}"),
    }
}

fn start_chain(up: &Cluster) -> Result<Chain> {
    let down = Cluster::up("kubernetes-down", &[])?;
    let ca = down.env("VKD_E2E_KUBELET_CLIENT_CA")?.to_owned();
    let down_vkd = Vkd::start_process(
        &down,
        DOWN_NODE,
        &[
            "--client-ca-file",
            &ca,
            "--node-label",
            "gpu-pool=a",
            // Not the upstream node's address, so the suite can tell the
            // Pod's hostIP came from downstream.
            "--node-address",
            DOWN_NODE_IP,
            // Where the article's external execution lands downstream.
            "--node-label",
            "platform.example.com/execution=external",
        ],
    )?;
    wait_ready(&down, DOWN_NODE)?;
    let down_gpu = Vkd::start_with_fleet(
        &down,
        DOWN_GPU,
        "two-by-four.yaml",
        &["--node-mode", "per-host", "--node-label", "gpu-pool=a"],
    )?;
    for host in ["host-a", "host-b"] {
        wait_ready(&down, &format!("{DOWN_GPU}-{host}"))?;
    }
    let down_prometheus = Prometheus::start(
        &down,
        &[Job {
            name: "dcgm".into(),
            target: format!("127.0.0.1:{}", down_gpu.admin_port()?),
            path: "/metrics".into(),
            honor_labels: true,
        }],
    )?;
    let config = up.dir().join("kubernetes-provider.yaml");
    std::fs::write(
        &config,
        format!(
            "kubeconfig: {}\nclusterName: down\nhostSelector: gpu-pool=a\n\
             gpuMetrics: {{prometheusUrl: 'http://127.0.0.1:{}'}}\n",
            // Only what manifests/downstream grants: the suite proves it is enough.
            down.token_kubeconfig("manifests/downstream", "vkd-downstream")?
                .display(),
            down_prometheus.port
        ),
    )?;
    let ca = up.env("VKD_E2E_KUBELET_CLIENT_CA")?.to_owned();
    let up_vkd = Vkd::start_provider(
        up,
        UP_NODE,
        "kubernetes",
        &config,
        &[
            "--client-ca-file",
            &ca,
            "--node-label",
            "vkd.io/e2e=offload",
            "--gc-interval",
            "5s",
            // So a privileged Pod reaches the downstream cluster, whose own
            // Pod Security is what this suite shows refusing it.
            "--allow-privileged",
            "true",
        ],
    )?;
    wait_ready(up, UP_NODE)?;
    up.namespace(NS)?;
    Ok(Chain {
        down,
        _down_vkd: down_vkd,
        _down_gpu: down_gpu,
        up_vkd,
        metrics: None,
        _down_prometheus: down_prometheus,
    })
}

/// The epoch the upstream node's fence downstream holds.
fn fence_epoch(down: &Cluster) -> Result<u64> {
    down.kubectl(&[
        "get",
        "configmap",
        &format!("vkd-fence-{UP_NODE}"),
        "-n",
        "vkd-system",
        "-o",
        "jsonpath={.data.epoch}",
    ])?
    .trim()
    .parse()
    .context("the fence's epoch")
}

fn wait_ready(c: &Cluster, node: &str) -> Result<Value> {
    wait_for(
        &format!("node {node} Ready"),
        Duration::from_secs(60),
        || {
            let n = c.kubectl_json(&["get", "node", node]);
            Ok(n.ok()
                .filter(|n| vkd_e2e::condition(n, "Ready").is_some_and(|r| r["status"] == "True")))
        },
    )
}

fn pod(name: &str, body: &str) -> String {
    format!(
        r#"
apiVersion: v1
kind: Pod
metadata: {{name: {name}, namespace: {NS}}}
spec:
  nodeSelector: {{vkd.io/e2e: offload}}
  tolerations: [{{key: virtual-kubelet.io/provider, operator: Exists}}]
{body}
"#
    )
}

fn wait_running(c: &Cluster, name: &str) -> Result<Value> {
    wait_for(
        &format!("{name} Running and Ready upstream"),
        Duration::from_secs(90),
        || {
            let p = c.kubectl_json(&["get", "pod", name, "-n", NS])?;
            Ok(running_and_ready(&p).then_some(p))
        },
    )
}

/// `kubectl exec` upstream with `stdin`; returns (exit code, stdout).
fn exec(c: &Cluster, args: &[&str], stdin: &str) -> Result<(i32, String)> {
    let mut cmd = Command::new(c.env("VKD_E2E_KUBECTL")?);
    cmd.env("KUBECONFIG", c.kubeconfig())
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn()?;
    if let Some(mut pipe) = child.stdin.take() {
        pipe.write_all(stdin.as_bytes())?;
    }
    let out = child.wait_with_output()?;
    Ok((
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    ))
}

/// Runs a `sleep` Pod upstream; returns its UID once it is Running.
fn sleeper(up: &Cluster, name: &str) -> Result<String> {
    up.apply(&pod(
        name,
        "  containers:\n  - {name: main, image: busybox, command: [sleep, '3600']}",
    ))?;
    let p = wait_running(up, name)?;
    Ok(str_at(&p, "metadata.uid").to_owned())
}

/// `kubectl top pod NAME` upstream: (CPU millicores, memory MiB) once known.
fn top_pod(up: &Cluster, name: &str) -> Result<Option<(u64, u64)>> {
    let Ok(out) = up.kubectl(&["top", "pod", name, "-n", NS, "--no-headers"]) else {
        return Ok(None);
    };
    let f: Vec<&str> = out.split_whitespace().collect();
    let (Some(cpu), Some(mem)) = (f.get(1), f.get(2)) else {
        return Ok(None);
    };
    let cpu = match cpu.strip_suffix('m') {
        Some(m) => m.parse()?,
        None => cpu.parse::<u64>()? * 1000,
    };
    let mem = mem.strip_suffix("Mi").context("memory in Mi")?.parse()?;
    Ok(Some((cpu, mem)))
}

/// metrics-server on both clusters, once.
fn metrics_servers(ch: &mut Chain, up: &Cluster) -> Result<()> {
    if ch.metrics.is_none() {
        ch.metrics = Some((MetricsServer::start(&ch.down)?, MetricsServer::start(up)?));
    }
    Ok(())
}

/// An HPA upstream scales a Deployment whose Pods run downstream, on the
/// figures that come up the chain (docs/resource-metrics.md).
fn hpa_through_the_chain(up: &Cluster) -> Result<()> {
    // Under the chain's lock, as every test here: an outage or a SIGKILL
    // of vkd beside it would be read as the HPA's doing, and its Pods as
    // theirs.
    chain(up, |ch| {
        metrics_servers(ch, up)?;
        let t = common::hpa::scale_up_and_down(
            up,
            NS,
            "      nodeSelector: {vkd.io/e2e: offload}\n      automountServiceAccountToken: false\n",
            Duration::from_secs(300),
        )?;
        eprintln!("kubernetes provider: {t}");
        up.kubectl(&[
            "delete",
            "hpa,deployment",
            "burner",
            "-n",
            NS,
            "--wait=true",
        ])?;
        wait_for("the burners gone", Duration::from_secs(90), || {
            Ok((common::hpa::replicas(up, NS)? == 0).then_some(()))
        })
    })
}

/// The metrics chain two hops down: metrics-server downstream scrapes the
/// process node the Pod runs on, vkd's kubernetes provider reads the
/// downstream PodMetrics, metrics-server upstream scrapes vkd.
fn top_through_the_chain(up: &Cluster) -> Result<()> {
    chain(up, |ch| {
        metrics_servers(ch, up)?;
        // The node reads before the burner is there: what it runs and vkd's
        // own share, never `metrics not available yet`.
        let before = wait_for("kubectl top node before the burner", RESOLUTION * 6, || {
            let out = up
                .kubectl(&["top", "node", UP_NODE, "--no-headers"])
                .unwrap_or_default();
            Ok((!out.trim().is_empty()).then_some(out))
        })?;
        eprintln!(
            "kubectl top node {UP_NODE} before the burner: {}",
            before.trim()
        );
        up.apply(&pod(
            "hot",
            "  containers:\n  - {name: main, image: busybox, command: [sh, -c, 'while :; do :; done']}",
        ))?;
        let uid = str_at(&wait_running(up, "hot")?, "metadata.uid").to_owned();
        let downstream = wait_for(
            "the downstream kubectl top to show the burner",
            RESOLUTION * 8,
            || {
                let Some(p) = downstream_pods(&ch.down, &uid)?.into_iter().next() else {
                    return Ok(None);
                };
                let (ns, name) = (
                    str_at(&p, "metadata.namespace"),
                    str_at(&p, "metadata.name"),
                );
                let out = ch
                    .down
                    .kubectl(&["top", "pod", name, "-n", ns, "--no-headers"])
                    .unwrap_or_default();
                Ok((!out.is_empty()).then_some(out))
            },
        )?;
        let (cpu, mem) = wait_for(
            "the upstream kubectl top to show the burner's downstream figures",
            RESOLUTION * 10,
            || Ok(top_pod(up, "hot")?.filter(|(cpu, _)| *cpu >= 300)),
        )?;
        let node = up.kubectl(&["top", "node", UP_NODE, "--no-headers"])?;
        eprintln!(
            "kubectl top pod hot: {cpu}m {mem}Mi upstream; downstream: {}; node: {}",
            downstream.trim(),
            node.trim()
        );
        ensure!(mem > 0, "memory {mem}Mi");
        delete_and_wait(up, "pod", "hot")
    })
}

/// Deletes an upstream object of `kind` in NS and waits until it is gone.
fn delete_and_wait(up: &Cluster, kind: &str, name: &str) -> Result<()> {
    up.kubectl(&[
        "delete",
        kind,
        name,
        "-n",
        NS,
        "--wait=true",
        "--timeout=90s",
    ])?;
    Ok(())
}

/// Waits for upstream Pod `name` to be Failed; returns it.
fn wait_failed(up: &Cluster, name: &str) -> Result<Value> {
    wait_for(&format!("{name} to fail"), Duration::from_secs(60), || {
        let p = up.kubectl_json(&["get", "pod", name, "-n", NS])?;
        Ok((at(&p, "status.phase") == "Failed").then_some(p))
    })
}

/// A CPU quantity ("32", "2500m") in millicores; 0 when it is not one.
fn cpu_millis(q: &Value) -> u64 {
    let q = q.as_str().unwrap_or_default();
    match q.strip_suffix('m') {
        Some(m) => m.parse().unwrap_or(0),
        None => q.parse::<u64>().map_or(0, |c| c * 1000),
    }
}

/// The downstream objects of `kind` that belong to upstream Pod `uid`.
/// The downstream Pods of upstream Pod `uid`, in any namespace.
fn downstream_pods(down: &Cluster, uid: &str) -> Result<Vec<Value>> {
    Ok(items(&down.kubectl_json(&[
        "get",
        "pods",
        "-A",
        "-l",
        &format!("vkd.io/owner-uid={uid}"),
    ])?))
}

fn owned(down: &Cluster, kind: &str, ns: &str, uid: &str) -> Result<Value> {
    down.kubectl_json(&[
        "get",
        kind,
        "-n",
        ns,
        "-l",
        &format!("vkd.io/owner-uid={uid}"),
    ])
}

fn offloaded_pod(up: &Cluster) -> Result<()> {
    chain(up, |ch| {
        let down = &ch.down;
        up.apply(&format!(
            "apiVersion: v1\nkind: ConfigMap\nmetadata: {{name: greeting, namespace: {NS}}}\ndata: {{word: hello-upstream, app.conf: 'x=1'}}\n"
        ))?;
        up.apply(&pod(
            "web",
            r#"  automountServiceAccountToken: false
  containers:
  - name: main
    image: busybox
    command: [sh, -c, "echo started-$GREETING; while true; do sleep 1; done"]
    env:
    - name: GREETING
      valueFrom: {configMapKeyRef: {name: greeting, key: word}}
    ports: [{containerPort: 8080}]
    volumeMounts: [{name: cfg, mountPath: /etc/cfg}, {name: info, mountPath: /etc/podinfo}]
  volumes:
  - {name: cfg, configMap: {name: greeting}}
  - {name: info, downwardAPI: {items: [{path: labels, fieldRef: {fieldPath: metadata.labels}}]}}"#,
        ))?;
        let p = wait_running(up, "web")?;
        let uid = str_at(&p, "metadata.uid").to_owned();
        let down_name = format!("vkd-{uid}");
        let down_ns = format!("vkd-{NS}");
        // Downstream: one Pod named from the upstream UID, on the process node,
        // with the spec as written and the env resolved upstream.
        let dp = down.kubectl_json(&["get", "pod", &down_name, "-n", &down_ns])?;
        ensure!(str_at(&dp, "spec.nodeName") == DOWN_NODE, "{dp}");
        ensure!(
            at(&dp, "metadata.labels")["vkd.io/owner-uid"] == uid.as_str(),
            "{dp}"
        );
        ensure!(
            at(&dp, "metadata.labels")["vkd.io/owner-node"] == UP_NODE,
            "{dp}"
        );
        ensure!(
            at(&dp, "spec.containers")[0]["ports"][0]["containerPort"] == 8080,
            "{dp}"
        );
        ensure!(
            at(&dp, "spec.containers")[0]["env"][0]["value"] == "hello-upstream",
            "the env is resolved upstream: {dp}"
        );
        let id = at(&p, "metadata.annotations")["vkd.io/instance-id"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        ensure!(
            id == format!("down/{down_ns}/{down_name}"),
            "instance id {id:?}"
        );
        // Where it runs, as the downstream reports it: the Node (an
        // annotation) and its address (hostIP, and the podIP of a process).
        ensure!(
            at(&p, "metadata.annotations")["vkd.io/host"] == DOWN_NODE,
            "{p}"
        );
        ensure!(
            at(&p, "status.hostIP") == DOWN_NODE_IP
                && at(&p, "status.hostIPs")[0]["ip"] == DOWN_NODE_IP
                && at(&p, "status.hostIPs").as_array().map(Vec::len) == Some(1),
            "hostIP upstream: {}",
            at(&p, "status")
        );
        ensure!(at(&p, "status.podIP") == at(&dp, "status.podIP"), "{p}");
        // `vkd explain` names the downstream cluster, Pod and node, read
        // with only manifests/downstream's RBAC.
        let explained = Command::new(common::VKD)
            .args([
                "explain",
                "pod",
                &format!("{NS}/web"),
                "-o",
                "json",
                "--kubeconfig",
            ])
            .arg(common::service_account_kubeconfig(up)?)
            .arg("--kubelet")
            .arg(format!("https://127.0.0.1:{}", ch.up_vkd.kubelet_port))
            .arg("--insecure-skip-tls-verify-kubelet")
            .output()?;
        ensure!(
            explained.status.success(),
            "vkd explain: {}",
            String::from_utf8_lossy(&explained.stderr)
        );
        let explained: Value = serde_json::from_slice(&explained.stdout)?;
        let details: Vec<(String, String)> =
            serde_json::from_value(explained["vkd"]["backend_details"].clone())?;
        let detail = |k: &str| {
            details
                .iter()
                .find(|(key, _)| key == k)
                .map(|(_, v)| v.as_str())
                .unwrap_or_default()
        };
        ensure!(
            detail("downstream cluster") == "down"
                && detail("downstream Pod").starts_with(&format!("{down_ns}/{down_name} "))
                && detail("downstream node") == DOWN_NODE
                && detail("downstream events").is_empty(),
            "{details:?}"
        );
        eprintln!("vkd explain pod {NS}/web, the backend's details: {details:?}");
        // The upstream Node names the cluster it stands for.
        let node = up.kubectl_json(&["get", "node", UP_NODE])?;
        let node_annotations = at(&node, "metadata.annotations");
        ensure!(
            node_annotations["vkd.io/downstream-cluster"] == "down"
                && node_annotations["vkd.io/downstream-server"]
                    .as_str()
                    .is_some_and(|s| s.starts_with("https://127.0.0.1:")),
            "{node_annotations}"
        );
        // The configMap's content went down as a Secret the downstream Pod owns.
        let secrets = owned(down, "secrets", &down_ns, &uid)?;
        let secret = items(&secrets)
            .into_iter()
            .next()
            .context("no volume Secret downstream")?;
        ensure!(
            at(&secret, "metadata.ownerReferences")[0]["name"] == down_name.as_str(),
            "{secret}"
        );
        // Logs and exec, two hops down.
        let logs = wait_for("the log upstream", Duration::from_secs(30), || {
            let l = up.kubectl(&["logs", "web", "-n", NS])?;
            Ok(l.contains("started-hello-upstream").then_some(l))
        })?;
        eprintln!("logs through the chain: {}", logs.trim());
        let (code, out) = exec(
            up,
            &[
                "exec",
                "web",
                "-n",
                NS,
                "--",
                "sh",
                "-c",
                "echo out; exit 3",
            ],
            "",
        )?;
        ensure!(code == 3 && out.trim() == "out", "exec gave {code} {out:?}");
        let (code, out) = exec(
            up,
            &["exec", "-i", "web", "-n", NS, "--", "cat"],
            "ping-through-two-hops\n",
        )?;
        ensure!(
            code == 0 && out.trim() == "ping-through-two-hops",
            "exec -i gave {code} {out:?}"
        );
        // A volume follows its source upstream: a label set upstream reaches
        // the file two hops down (the downstream kubelet re-reads its
        // Secrets once a minute).
        up.kubectl(&["label", "pod", "web", "-n", NS, "color=blue"])?;
        let changed = std::time::Instant::now();
        wait_for(
            "the new label in the downward API file two hops down",
            Duration::from_secs(120),
            || {
                // A process Pod finds its mounts under its root (issue 19 gives
                // it a mount namespace).
                let (_, out) = exec(
                    up,
                    &[
                        "exec",
                        "web",
                        "-n",
                        NS,
                        "--",
                        "sh",
                        "-c",
                        "cat \"$VKD_POD_ROOT/etc/podinfo/labels\"",
                    ],
                    "",
                )?;
                Ok(out.contains("color=\"blue\"").then_some(()))
            },
        )?;
        eprintln!(
            "volume refresh through the chain: {:.1}s",
            changed.elapsed().as_secs_f64()
        );
        // Deleting upstream deletes downstream, and finalizes only after.
        delete_and_wait(up, "pod", "web")?;
        let left = owned(down, "pods", &down_ns, &uid)?;
        ensure!(
            items(&left).is_empty(),
            "the downstream Pod outlived the upstream one: {left}"
        );
        wait_for("the volume Secret to go", Duration::from_secs(60), || {
            let s = owned(down, "secrets", &down_ns, &uid)?;
            Ok(items(&s).is_empty().then_some(()))
        })?;
        // A downstream Pod deleted by someone else fails its upstream Pod,
        // saying so, and is never made again.
        let uid = sleeper(up, "victim")?;
        down.kubectl(&[
            "delete",
            "pod",
            &format!("vkd-{uid}"),
            "-n",
            &down_ns,
            "--wait=false",
        ])?;
        let failed = wait_failed(up, "victim")?;
        let message = str_at(&failed, "status.message");
        ensure!(
            message.contains("someone other than vkd")
                || message.contains("no longer has instance"),
            "{failed}"
        );
        eprintln!("downstream deletion seen upstream: {message}");
        std::thread::sleep(Duration::from_secs(3));
        let again = owned(down, "pods", &down_ns, &uid)?;
        ensure!(
            items(&again)
                .iter()
                .all(|p| !at(p, "metadata.deletionTimestamp").is_null()),
            "made again downstream: {again}"
        );
        delete_and_wait(up, "pod", "victim")?;
        Ok(())
    })
}

fn capacity_and_fence(up: &Cluster) -> Result<()> {
    chain(up, |ch| {
        let down = &ch.down;
        // The upstream Node advertises the downstream hosts' allocatable: the
        // process node and the two sim hosts the selector names.
        let pool = down.kubectl_json(&["get", "nodes", "-l", "gpu-pool=a"])?;
        let hosts = items(&pool);
        ensure!(hosts.len() == 3, "{} downstream hosts", hosts.len());
        let down_cpu: u64 = hosts
            .iter()
            .map(|n| cpu_millis(&at(n, "status.allocatable")["cpu"]))
            .sum();
        let want = wait_for(
            "the upstream Node's capacity",
            Duration::from_secs(30),
            || {
                let un = up.kubectl_json(&["get", "node", UP_NODE])?;
                let a = at(&un, "status.allocatable");
                Ok(
                    (cpu_millis(&a["cpu"]) == down_cpu && a["nvidia.com/gpu"] == "8")
                        .then_some(a.clone()),
                )
            },
        );
        ensure!(
            want.is_ok(),
            "upstream allocatable is not the downstream hosts' sum ({down_cpu}m, 8 GPUs): {want:?}"
        );
        // The fence downstream holds the upstream vkd's epoch.
        let epoch = fence_epoch(down)?;
        ensure!(epoch >= 1, "epoch {epoch}");
        // A create from an older epoch, as a stale replica would send it
        // (with vkd's identity: only it may set vkd's labels), is refused by
        // the downstream API server itself.
        let stale = format!(
            "apiVersion: v1\nkind: Pod\nmetadata:\n  name: vkd-stale\n  namespace: default\n  labels: {{vkd.io/owner-node: {UP_NODE}, vkd.io/owner-uid: stale, vkd.io/epoch: '{}'}}\nspec:\n  containers: [{{name: main, image: busybox}}]\n",
            epoch - 1
        );
        let refused = wait_for(
            "the fence to be enforced",
            Duration::from_secs(30),
            || match down.kubectl_stdin(
                &[&format!("--as={VKD_SA}"), "create", "-f", "-"],
                Some(&stale),
            ) {
                Ok(_) => {
                    down.kubectl(&[
                        "delete",
                        "pod",
                        "vkd-stale",
                        "-n",
                        "default",
                        "--wait=false",
                    ])?;
                    Ok(None)
                }
                Err(e) => Ok(Some(format!("{e:#}"))),
            },
        )?;
        ensure!(
            refused.contains("vkd-fence"),
            "refused for another reason: {refused}"
        );
        eprintln!("stale-epoch create refused downstream: {refused}");
        ensure!(ch.up_vkd.pid().is_some(), "the upstream vkd is running");
        // The namespaces vkd makes downstream enforce Pod Security (baseline):
        // a privileged Pod fails upstream saying why, instead of running there.
        up.apply(&pod(
            "privileged",
            "  containers:\n  - name: main\n    image: busybox\n    command: [sleep, '60']\n    securityContext: {privileged: true}",
        ))?;
        let p = wait_failed(up, "privileged")?;
        let message = str_at(&p, "status.message");
        ensure!(message.contains("PodSecurity"), "{}", at(&p, "status"));
        eprintln!("privileged Pod: {message}");
        delete_and_wait(up, "pod", "privileged")?;
        Ok(())
    })
}

fn gpu_pod(name: &str, gpus: u32) -> String {
    pod(
        name,
        &format!(
            "  containers:\n  - name: main\n    image: busybox\n    command: [sleep, '3600']\n    resources: {{limits: {{nvidia.com/gpu: {gpus}}}}}"
        ),
    )
}

/// The downstream host (Node) an upstream Pod runs on, once it is Running.
fn downstream_host(up: &Cluster, down: &Cluster, name: &str) -> Result<String> {
    let p = wait_running(up, name)?;
    let uid = str_at(&p, "metadata.uid");
    let dp = down.kubectl_json(&[
        "get",
        "pod",
        &format!("vkd-{uid}"),
        "-n",
        &format!("vkd-{NS}"),
    ])?;
    Ok(str_at(&dp, "spec.nodeName").to_owned())
}

fn gpu_slices(up: &Cluster) -> Result<()> {
    chain(up, |ch| {
        // A Pod's figures, GPUs included, ride on the downstream metrics API.
        metrics_servers(ch, up)?;
        let down = &ch.down;
        let (host_a, host_b) = (format!("{DOWN_GPU}-host-a"), format!("{DOWN_GPU}-host-b"));
        // 8 GPUs: the upstream Node's sum says yes, no downstream host does.
        up.apply(&gpu_pod("eight", 8))?;
        let p = wait_failed(up, "eight")?;
        let message = str_at(&p, "status.message");
        ensure!(
            at(&p, "status.reason") == "TopologyUnsatisfiable"
                && message.contains(&format!("{host_a} 4"))
                && message.contains(&format!("{host_b} 4")),
            "{}",
            at(&p, "status")
        );
        eprintln!("8 GPUs through the chain: {message}");
        // Another tenant takes host A's four GPUs downstream, by name.
        down.apply(&format!(
            "apiVersion: v1\nkind: Pod\nmetadata: {{name: tenant, namespace: default}}\nspec:\n  nodeName: {host_a}\n  containers:\n  - name: main\n    image: busybox\n    resources: {{limits: {{nvidia.com/gpu: 4}}}}\n"
        ))?;
        // So the first 4-GPU Pod from upstream goes to host B...
        up.apply(&gpu_pod("four-1", 4))?;
        let h1 = downstream_host(up, down, "four-1")?;
        ensure!(
            h1 == host_b,
            "four-1 went to {h1} although the tenant holds {host_a}"
        );
        // Its GPUs' use, as the downstream Prometheus has it from the
        // downstream node, comes up on the upstream vkd's metrics under the
        // upstream Pod's name.
        let gpus = wait_for(
            "four-1's GPU figures upstream",
            Duration::from_secs(90),
            || {
                let (_, text) = admin_get(&ch.up_vkd, "/metrics")?;
                let series = |name: &str| -> Vec<String> {
                    text.lines()
                        .filter(|l| {
                            l.starts_with(&format!("{name}{{"))
                                && l.contains(&format!("namespace=\"{NS}\""))
                                && l.contains("pod=\"four-1\"")
                        })
                        .map(str::to_owned)
                        .collect()
                };
                let (util, used) = (
                    series("DCGM_FI_DEV_GPU_UTIL"),
                    series("DCGM_FI_DEV_FB_USED"),
                );
                Ok((util.len() == 4 && used.len() == 4).then_some((util, used)))
            },
        )?;
        eprintln!("four-1's GPUs upstream:\n  {}", gpus.0.join("\n  "));
        for line in gpus.0.iter().chain(&gpus.1) {
            ensure!(line.contains("Hostname=\"host-b\""), "{line}");
        }
        let node = up.kubectl_json(&["get", "node", UP_NODE])?;
        let caps = node["metadata"]["annotations"]["vkd.io/capabilities"].clone();
        ensure!(
            caps.as_str()
                .is_some_and(|c| c.split(',').any(|c| c == "gpu-usage")),
            "the upstream Node's capabilities: {caps}"
        );
        // The sim's defaults downstream: 80% busy, half of 80 GiB in use.
        ensure!(gpus.0.iter().all(|l| l.ends_with(" 80")), "{:?}", gpus.0);
        ensure!(gpus.1.iter().all(|l| l.ends_with(" 40960")), "{:?}", gpus.1);
        // ... and a second waits, visibly, until the tenant's Pod is gone.
        up.apply(&gpu_pod("four-2", 4))?;
        let waiting = wait_for(
            "four-2 to wait as BackendQueued",
            Duration::from_secs(60),
            || {
                let p = up.kubectl_json(&["get", "pod", "four-2", "-n", NS])?;
                let w = at(&p, "status.containerStatuses")[0]["state"]["waiting"].clone();
                Ok((w["reason"] == "BackendQueued").then_some(w))
            },
        )?;
        eprintln!("four-2 waits: {}", waiting["message"]);
        down.kubectl(&[
            "delete",
            "pod",
            "tenant",
            "-n",
            "default",
            "--wait=true",
            "--timeout=60s",
        ])?;
        let h2 = downstream_host(up, down, "four-2")?;
        ensure!(h2 == host_a, "four-2 went to {h2}");
        for name in ["eight", "four-1", "four-2"] {
            delete_and_wait(up, "pod", name)?;
        }
        Ok(())
    })
}

/// Upstream Pod UID -> its downstream Pods (every one vkd made for this node).
fn downstream_by_owner(down: &Cluster) -> Result<std::collections::BTreeMap<String, Vec<String>>> {
    let pods = down.kubectl_json(&[
        "get",
        "pods",
        "-A",
        "-l",
        &format!("vkd.io/owner-node={UP_NODE}"),
    ])?;
    let mut by_owner = std::collections::BTreeMap::<String, Vec<String>>::new();
    for p in items(&pods) {
        let owner = at(&p, "metadata.labels")["vkd.io/owner-uid"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        by_owner
            .entry(owner)
            .or_default()
            .push(str_at(&p, "metadata.name").to_owned());
    }
    Ok(by_owner)
}

fn upstream_uids(up: &Cluster, selector: &str) -> Result<Vec<String>> {
    let pods = up.kubectl_json(&["get", "pods", "-n", NS, "-l", selector])?;
    Ok(items(&pods)
        .iter()
        .map(|p| str_at(p, "metadata.uid").to_owned())
        .collect())
}

fn kill_during_creates(up: &Cluster) -> Result<()> {
    chain(up, |ch| {
        for round in 0..3 {
            let batch = format!("storm-{round}");
            let docs: Vec<String> = (0..50)
                .map(|i| {
                    format!(
                        "apiVersion: v1\nkind: Pod\nmetadata: {{name: {batch}-{i}, namespace: {NS}, labels: {{batch: {batch}}}}}\nspec:\n  nodeSelector: {{vkd.io/e2e: offload}}\n  tolerations: [{{key: virtual-kubelet.io/provider, operator: Exists}}]\n  automountServiceAccountToken: false\n  containers: [{{name: main, image: busybox, command: [sleep, '3600']}}]\n"
                    )
                })
                .collect();
            up.apply(&docs.join("---\n"))?;
            // Somewhere in the middle of the creates: SIGKILL, then a new vkd.
            std::thread::sleep(Duration::from_millis(300 + 700 * round));
            ch.up_vkd.kill()?;
            ch.up_vkd.spawn()?;
            let selector = format!("batch={batch}");
            wait_for(
                &format!("{batch}: 50 Pods Running upstream"),
                Duration::from_secs(180),
                || {
                    let pods = up.kubectl_json(&["get", "pods", "-n", NS, "-l", &selector])?;
                    let ready = items(&pods).iter().filter(|p| running_and_ready(p)).count();
                    Ok((ready == 50).then_some(()))
                },
            )?;
            let uids = upstream_uids(up, &selector)?;
            let by_owner = downstream_by_owner(&ch.down)?;
            for uid in &uids {
                let made = by_owner.get(uid).map_or(0, Vec::len);
                ensure!(
                    made == 1,
                    "{batch}: upstream Pod {uid} has {made} downstream Pods"
                );
            }
            eprintln!(
                "{batch}: vkd killed and restarted during 50 creates; one downstream Pod each"
            );
            up.kubectl(&[
                "delete",
                "pods",
                "-n",
                NS,
                "-l",
                &selector,
                "--wait=true",
                "--timeout=180s",
            ])?;
            let left = downstream_by_owner(&ch.down)?;
            let stray: Vec<_> = uids.iter().filter(|u| left.contains_key(*u)).collect();
            ensure!(
                stray.is_empty(),
                "{batch}: downstream Pods left after deletion: {stray:?}"
            );
        }
        Ok(())
    })
}

fn downstream_outage(up: &Cluster) -> Result<()> {
    chain(up, |ch| {
        let down = &ch.down;
        up.apply(&format!(
            "apiVersion: apps/v1\nkind: Deployment\nmetadata: {{name: steady, namespace: {NS}}}\nspec:\n  replicas: 3\n  selector: {{matchLabels: {{app: steady}}}}\n  template:\n    metadata: {{labels: {{app: steady}}}}\n    spec:\n      nodeSelector: {{vkd.io/e2e: offload}}\n      tolerations: [{{key: virtual-kubelet.io/provider, operator: Exists}}]\n      automountServiceAccountToken: false\n      containers: [{{name: main, image: busybox, command: [sleep, '3600']}}]\n"
        ))?;
        let steady = || -> Result<usize> {
            let pods = up.kubectl_json(&["get", "pods", "-n", NS, "-l", "app=steady"])?;
            Ok(items(&pods).iter().filter(|p| running_and_ready(p)).count())
        };
        wait_for("3 steady Pods Ready", Duration::from_secs(90), || {
            Ok((steady()? == 3).then_some(()))
        })?;
        let uids = upstream_uids(up, "app=steady")?;
        let before = downstream_by_owner(down)?;
        let pid: u32 = std::fs::read_to_string(down.dir().join("pids/kube-apiserver.pid"))?
            .trim()
            .parse()?;
        let signal = |sig: &str| -> Result<()> {
            let st = Command::new("kill")
                .args([sig, &pid.to_string()])
                .status()?;
            ensure!(st.success(), "kill {sig} {pid}");
            Ok(())
        };
        signal("-STOP")?;
        let mut said = String::new();
        let outage = (|| -> Result<()> {
            for _ in 0..6 {
                std::thread::sleep(Duration::from_secs(10));
                let pods = up.kubectl_json(&["get", "pods", "-n", NS, "-l", "app=steady"])?;
                for p in items(&pods) {
                    ensure!(
                        at(&p, "status.phase") == "Running"
                            && at(&p, "metadata.deletionTimestamp").is_null(),
                        "an upstream Pod moved during the outage: {}",
                        at(&p, "status")
                    );
                }
                // Ready throughout (the Pods run on), with the outage in a
                // condition of its own.
                let n = up.kubectl_json(&["get", "node", UP_NODE])?;
                let ready = vkd_e2e::condition(&n, "Ready");
                ensure!(
                    ready.is_some_and(|r| r["status"] == "True"),
                    "the upstream Node left Ready during the outage: {ready:?}"
                );
                if let Some(r) = vkd_e2e::condition(&n, "BackendUnreachable")
                    && r["status"] == "True"
                {
                    said = format!("{}: {}", r["reason"], r["message"]);
                }
            }
            Ok(())
        })();
        signal("-CONT")?;
        outage?;
        ensure!(
            said.contains("DownstreamUnreachable"),
            "the upstream Node never said the downstream was unreachable"
        );
        eprintln!("during the outage the upstream Node said: {said}");
        let back = std::time::Instant::now();
        wait_for(
            "the upstream Node and Pods to converge",
            Duration::from_secs(30),
            || {
                let n = up.kubectl_json(&["get", "node", UP_NODE])?;
                let ready = vkd_e2e::condition(&n, "Ready").is_some_and(|r| r["status"] == "True");
                let reached = vkd_e2e::condition(&n, "BackendUnreachable")
                    .is_some_and(|r| r["status"] == "False");
                Ok((ready && reached && steady()? == 3).then_some(()))
            },
        )?;
        let converged = back.elapsed();
        ensure!(
            upstream_uids(up, "app=steady")? == uids,
            "upstream Pods were replaced"
        );
        let after = downstream_by_owner(down)?;
        ensure!(
            after == before,
            "downstream Pods changed: {before:?} -> {after:?}"
        );
        eprintln!(
            "downstream API server stopped 60 s: nothing evicted or duplicated; converged {:.1}s after it returned",
            converged.as_secs_f64()
        );
        delete_and_wait(up, "deployment", "steady")?;
        Ok(())
    })
}

fn kubectl_cmd(c: &Cluster) -> Result<Command> {
    let mut cmd = Command::new(c.env("VKD_E2E_KUBECTL")?);
    cmd.env("KUBECONFIG", c.kubeconfig());
    Ok(cmd)
}

fn streams(up: &Cluster) -> Result<()> {
    chain(up, |_| {
        // logs -f: every line, in order, ending when the container ends two hops down.
        up.apply(&pod(
            "talker",
            r#"  restartPolicy: Never
  containers:
  - name: main
    image: busybox
    command: [sh, -c, "sleep 2; i=0; while [ $i -lt 12 ]; do echo line $i; i=$((i+1)); sleep 0.25; done"]"#,
        ))?;
        wait_running(up, "talker")?;
        let started = std::time::Instant::now();
        let mut child = kubectl_cmd(up)?
            .args(["logs", "-f", "talker", "-n", NS])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()?;
        let out = child.stdout.take().context("no stdout")?;
        let mut lines = Vec::new();
        for line in BufReader::new(out).lines() {
            lines.push(line?);
            ensure!(
                started.elapsed() < Duration::from_secs(60),
                "logs -f did not end"
            );
        }
        ensure!(child.wait()?.success(), "kubectl logs -f failed");
        let want: Vec<String> = (0..12).map(|i| format!("line {i}")).collect();
        ensure!(lines == want, "logs -f gave {lines:?}");
        eprintln!(
            "logs -f through the chain: 12 lines in order in {:.1}s",
            started.elapsed().as_secs_f64()
        );

        // exec over SPDY too (kubectl's fallback), with stdin and an exit code.
        up.apply(&pod(
            "web",
            r#"  containers:
  - name: main
    image: python:3.12
    command: [sh, -c, "exec python3 -m http.server 18527 --bind 127.0.0.1"]
    ports: [{containerPort: 18527}]
    readinessProbe: {tcpSocket: {port: 18527}, periodSeconds: 1}"#,
        ))?;
        wait_running(up, "web")?;
        let mut cmd = kubectl_cmd(up)?;
        cmd.env("KUBECTL_REMOTE_COMMAND_WEBSOCKETS", "false")
            .args([
                "exec",
                "-i",
                "web",
                "-n",
                NS,
                "--",
                "sh",
                "-c",
                "read x; echo got-$x; exit 4",
            ])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = cmd.spawn()?;
        child.stdin.take().context("stdin")?.write_all(b"spdy\n")?;
        let out = child.wait_with_output()?;
        let stdout = String::from_utf8_lossy(&out.stdout);
        ensure!(
            out.status.code() == Some(4) && stdout.trim() == "got-spdy",
            "SPDY exec gave {:?} {stdout:?} {}",
            out.status.code(),
            String::from_utf8_lossy(&out.stderr)
        );

        // port-forward: an HTTP GET reaches the server two hops down.
        let port = common::free_port()?;
        let mut child = kubectl_cmd(up)?
            .args([
                "port-forward",
                "-n",
                NS,
                "pod/web",
                &format!("{port}:18527"),
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()?;
        let got = (|| -> Result<String> {
            let mut conn = wait_for("the port-forward listener", Duration::from_secs(20), || {
                Ok(std::net::TcpStream::connect(("127.0.0.1", port)).ok())
            })?;
            conn.set_read_timeout(Some(Duration::from_secs(15)))?;
            conn.write_all(b"GET / HTTP/1.0\r\nHost: x\r\n\r\n")?;
            let mut reply = String::new();
            conn.read_to_string(&mut reply)?;
            Ok(reply)
        })();
        let _ = child.kill();
        let _ = child.wait();
        let reply = got?;
        ensure!(
            reply.starts_with("HTTP/1.0 200"),
            "port-forward reply: {reply:?}"
        );
        eprintln!(
            "port-forward through the chain: {}",
            reply.lines().next().unwrap_or_default()
        );
        for name in ["talker", "web"] {
            delete_and_wait(up, "pod", name)?;
        }
        Ok(())
    })
}

fn force_deleted(up: &Cluster) -> Result<()> {
    chain(up, |ch| {
        let uid = sleeper(up, "ghost")?;
        // Gone upstream at once, with no grace for vkd to act within.
        up.kubectl(&[
            "delete",
            "pod",
            "ghost",
            "-n",
            NS,
            "--force",
            "--grace-period=0",
        ])?;
        let started = std::time::Instant::now();
        wait_for(
            "the orphan to be collected downstream",
            Duration::from_secs(60),
            || {
                let left = downstream_by_owner(&ch.down)?;
                Ok((!left.contains_key(&uid)).then_some(()))
            },
        )?;
        eprintln!(
            "force-deleted upstream: its downstream Pod collected {:.1}s later",
            started.elapsed().as_secs_f64()
        );
        Ok(())
    })
}

/// The Deployment of the article vkd answers (its section 10.2), exactly as
/// written there: the upstream virtual node carries the article's label and
/// taint, and its image runs on the downstream process node
/// (`testdata/process/e2e.yaml` maps it to an HTTP server with `/ready`).
const ARTICLE_DEPLOYMENT: &str = r#"
apiVersion: apps/v1
kind: Deployment
metadata:
  name: external-http
  namespace: platform-demo
spec:
  replicas: 6
  selector:
    matchLabels:
      app: external-http
  template:
    metadata:
      labels:
        app: external-http
    spec:
      nodeSelector:
        platform.example.com/execution: external
      tolerations:
        - key: platform.example.com/execution
          operator: Equal
          value: external
          effect: NoSchedule
      containers:
        - name: http
          image: registry.example.com/platform/demo-http:1.0
          ports:
            - containerPort: 8080
          resources:
            requests:
              cpu: 250m
              memory: 256Mi
            limits:
              cpu: "1"
              memory: 512Mi
          readinessProbe:
            httpGet:
              path: /ready
              port: 8080
"#;

fn articles_deployment(up: &Cluster) -> Result<()> {
    chain(up, |ch| {
        let down = &ch.down;
        // A second upstream virtual node, configured as the article assumes:
        // its label and NoSchedule taint, and the downstream Nodes labelled
        // for external execution as its hosts.
        let config = up.dir().join("kubernetes-external.yaml");
        std::fs::write(
            &config,
            format!(
                "kubeconfig: {}\nclusterName: down\nhostSelector: platform.example.com/execution=external\n",
                down.token_kubeconfig("manifests/downstream", "vkd-downstream")?
                    .display()
            ),
        )?;
        let ca = up.env("VKD_E2E_KUBELET_CLIENT_CA")?.to_owned();
        let _external = Vkd::start_provider(
            up,
            "vk-external",
            "kubernetes",
            &config,
            &[
                "--client-ca-file",
                &ca,
                "--node-label",
                "platform.example.com/execution=external",
                "--node-taint",
                "platform.example.com/execution=external:NoSchedule",
            ],
        )?;
        wait_ready(up, "vk-external")?;
        let nodes = up.kubectl(&[
            "get",
            "nodes",
            "-l",
            "platform.example.com/execution=external",
            "-o",
            "name",
        ])?;
        ensure!(nodes.trim() == "node/vk-external", "{nodes}");
        up.namespace("platform-demo")?;
        up.apply(ARTICLE_DEPLOYMENT)?;
        let started = std::time::Instant::now();
        let pods = || {
            up.kubectl_json(&[
                "get",
                "pods",
                "-n",
                "platform-demo",
                "-l",
                "app=external-http",
            ])
        };
        wait_for(
            "the article's 6 replicas Running and Ready upstream",
            Duration::from_secs(180),
            || {
                let p = pods()?;
                let ready = items(&p).iter().filter(|p| running_and_ready(p)).count();
                Ok((ready == 6).then_some(()))
            },
        )?;
        eprintln!(
            "the article's Deployment: 6 of 6 Ready upstream {:.1}s after apply",
            started.elapsed().as_secs_f64()
        );
        let upstream = pods()?;
        for p in items(&upstream) {
            ensure!(str_at(&p, "spec.nodeName") == "vk-external", "{p}");
        }
        // Downstream: six real instances, Ready by their own kubelet's probe
        // of /ready, on the node labelled for external execution.
        let downstream = down.kubectl_json(&["get", "pods", "-n", "vkd-platform-demo"])?;
        let live: Vec<Value> = items(&downstream)
            .into_iter()
            .filter(|p| at(p, "metadata.deletionTimestamp").is_null())
            .collect();
        ensure!(live.len() == 6, "downstream: {downstream}");
        for p in &live {
            ensure!(str_at(p, "spec.nodeName") == DOWN_NODE, "{p}");
            ensure!(
                running_and_ready(p),
                "not Ready downstream: {}",
                at(p, "status")
            );
            ensure!(
                at(p, "spec.containers")[0]["readinessProbe"]["httpGet"]["path"] == "/ready",
                "{p}"
            );
        }
        // And reachable: one replica answers /ready from inside, two hops down.
        let name = str_at(&items(&upstream)[0], "metadata.name").to_owned();
        let (code, out) = exec(
            up,
            &[
                "exec",
                &name,
                "-n",
                "platform-demo",
                "--",
                "python3",
                "-c",
                "import urllib.request as u; print(u.urlopen('http://127.0.0.1:8080/ready').read().decode().strip())",
            ],
            "",
        )?;
        ensure!(
            code == 0 && out.trim() == "ready",
            "exec gave {code} {out:?}"
        );
        // Deleting the Deployment upstream leaves nothing downstream.
        up.kubectl(&[
            "delete",
            "deployment",
            "external-http",
            "-n",
            "platform-demo",
            "--wait=true",
            "--timeout=90s",
        ])?;
        wait_for("no replica upstream", Duration::from_secs(90), || {
            Ok(items(&pods()?).is_empty().then_some(()))
        })?;
        wait_for(
            "nothing of the Deployment downstream",
            Duration::from_secs(60),
            || {
                let mut left = Vec::new();
                for kind in ["pods", "secrets", "configmaps"] {
                    let l = down.kubectl_json(&["get", kind, "-n", "vkd-platform-demo"])?;
                    left.extend(
                        items(&l)
                            .into_iter()
                            .map(|o| format!("{kind}/{}", str_at(&o, "metadata.name")))
                            // The namespace's own root CA bundle is the cluster's, not vkd's.
                            .filter(|n| n != "configmaps/kube-root-ca.crt"),
                    );
                }
                Ok(left.is_empty().then_some(()))
            },
        )?;
        Ok(())
    })
}

/// A downstream Pod with vkd's labels, name and owner annotations for
/// upstream Pod `uid`, and a far higher epoch than vkd's: a decoy.
fn decoy_pod(ns: &str, name: &str, uid: &str) -> String {
    format!(
        r#"apiVersion: v1
kind: Pod
metadata:
  name: {name}
  namespace: {ns}
  labels: {{vkd.io/owner-uid: {uid}, vkd.io/owner-node: {UP_NODE}, vkd.io/epoch: '9999999999'}}
  annotations: {{vkd.io/owner-namespace: {NS}, vkd.io/owner-name: victim}}
spec:
  nodeName: {DOWN_NODE}
  tolerations: [{{operator: Exists}}]
  containers:
  - name: main
    image: busybox
    command: [sh, -c, "echo i-am-the-decoy; sleep 3600"]
    env: [{{name: MARK, value: decoy}}]
"#
    )
}

fn decoy(up: &Cluster) -> Result<()> {
    chain(up, |ch| {
        let down = &ch.down;
        up.apply(&pod(
            "victim",
            r#"  containers:
  - name: main
    image: busybox
    command: [sh, -c, "echo i-am-the-real-one; sleep 3600"]
    env: [{name: MARK, value: real}]"#,
        ))?;
        let p = wait_running(up, "victim")?;
        let uid = str_at(&p, "metadata.uid").to_owned();
        let (down_ns, name) = (format!("vkd-{NS}"), format!("vkd-{uid}"));
        let real = down.kubectl_json(&["get", "pod", &name, "-n", &down_ns])?;
        let real_uid = str_at(&real, "metadata.uid").to_owned();
        // A downstream tenant who may create Pods in her own namespace, and
        // nothing else.
        down.namespace("tenant-a")?;
        down.apply(
            "apiVersion: v1\nkind: ServiceAccount\nmetadata: {name: tenant, namespace: tenant-a}\n---\n\
             apiVersion: rbac.authorization.k8s.io/v1\nkind: Role\nmetadata: {name: pods, namespace: tenant-a}\n\
             rules: [{apiGroups: [''], resources: [pods], verbs: [create]}]\n---\n\
             apiVersion: rbac.authorization.k8s.io/v1\nkind: RoleBinding\nmetadata: {name: pods, namespace: tenant-a}\n\
             roleRef: {apiGroup: rbac.authorization.k8s.io, kind: Role, name: pods}\n\
             subjects: [{kind: ServiceAccount, name: tenant, namespace: tenant-a}]\n",
        )?;
        let as_tenant = "--as=system:serviceaccount:tenant-a:tenant";
        let planted = decoy_pod("tenant-a", &name, &uid);
        // (a) The downstream API server refuses her the decoy...
        let refused = match down.kubectl_stdin(&[as_tenant, "create", "-f", "-"], Some(&planted)) {
            Ok(out) => anyhow::bail!("the tenant planted a decoy: {out}"),
            Err(e) => format!("{e:#}"),
        };
        ensure!(
            refused.contains("vkd-owner-labels"),
            "refused for another reason: {refused}"
        );
        eprintln!("the tenant's decoy refused downstream: {refused}");
        // ... though she may create Pods there (a server-side dry run goes
        // through the same admission and makes nothing).
        let plain: String = planted
            .lines()
            .filter(|l| !l.contains("vkd.io/"))
            .map(|l| format!("{l}\n"))
            .collect();
        down.kubectl_stdin(
            &[as_tenant, "create", "--dry-run=server", "-f", "-"],
            Some(&plain),
        )?;
        // (b) Planted anyway, by the admin with vkd's own identity (the
        // policy bypassed): in the tenant's namespace, and beside the real
        // Pod under another name.
        let beside = decoy_pod(&down_ns, "decoy", &uid);
        down.kubectl_stdin(
            &[&format!("--as={VKD_SA}"), "create", "-f", "-"],
            Some(&format!("{planted}---\n{beside}")),
        )?;
        // Nobody else may change vkd's labels on it, the admin included.
        let relabel = down.kubectl(&[
            "label",
            "pod",
            &name,
            "-n",
            "tenant-a",
            "vkd.io/owner-uid=someone-else",
            "--overwrite",
        ]);
        ensure!(
            relabel
                .as_ref()
                .is_err_and(|e| format!("{e:#}").contains("vkd-owner-labels")),
            "the admin relabelled a Pod: {relabel:?}"
        );
        let still_there = |ns: &str, n: &str| -> Result<()> {
            let p = down.kubectl_json(&["get", "pod", n, "-n", ns])?;
            ensure!(
                at(&p, "metadata.deletionTimestamp").is_null(),
                "vkd deleted {ns}/{n}"
            );
            Ok(())
        };
        // Over several collection passes (every 5 s), vkd deletes nothing:
        // neither its own Pod as a "duplicate" of the decoy's epoch, nor the
        // decoys, which are not its own.
        std::thread::sleep(Duration::from_secs(12));
        let now = down.kubectl_json(&["get", "pod", &name, "-n", &down_ns])?;
        ensure!(
            str_at(&now, "metadata.uid") == real_uid
                && at(&now, "metadata.deletionTimestamp").is_null(),
            "the victim's downstream Pod was replaced or deleted: {now}"
        );
        still_there("tenant-a", &name)?;
        still_there(&down_ns, "decoy")?;
        let victim = up.kubectl_json(&["get", "pod", "victim", "-n", NS])?;
        ensure!(running_and_ready(&victim), "{}", at(&victim, "status"));
        // Logs and exec reach the real Pod, never a decoy.
        let logs = up.kubectl(&["logs", "victim", "-n", NS])?;
        ensure!(
            logs.contains("i-am-the-real-one") && !logs.contains("decoy"),
            "logs: {logs:?}"
        );
        let (code, out) = exec(
            up,
            &[
                "exec",
                "victim",
                "-n",
                NS,
                "--",
                "sh",
                "-c",
                "echo mark=$MARK",
            ],
            "",
        )?;
        ensure!(
            code == 0 && out.trim() == "mark=real",
            "exec gave {code} {out:?}"
        );
        eprintln!(
            "decoys planted with vkd's labels and epoch 9999999999: ignored; the real Pod kept, logs and exec reach it"
        );
        // Deleting the victim upstream deletes its own Pod, and the decoys
        // outlive it: they are not orphans of vkd's.
        delete_and_wait(up, "pod", "victim")?;
        let left = owned(down, "pods", &down_ns, &uid)?;
        ensure!(
            items(&left)
                .iter()
                .all(|p| str_at(p, "metadata.uid") != real_uid),
            "the victim's downstream Pod outlived it: {left}"
        );
        std::thread::sleep(Duration::from_secs(6));
        still_there("tenant-a", &name)?;
        still_there(&down_ns, "decoy")?;
        for (ns, n) in [("tenant-a", name.as_str()), (down_ns.as_str(), "decoy")] {
            down.kubectl(&["delete", "pod", n, "-n", ns, "--wait=true", "--timeout=60s"])?;
        }
        Ok(())
    })
}

fn system_namespace(up: &Cluster) -> Result<()> {
    chain(up, |ch| {
        let down = &ch.down;
        // `system` would map to vkd-system, vkd's own namespace downstream.
        up.namespace("system")?;
        let in_system = |name: &str, body: &str| {
            format!(
                "apiVersion: v1\nkind: Pod\nmetadata: {{name: {name}, namespace: system}}\nspec:\n  \
                 nodeSelector: {{vkd.io/e2e: offload}}\n  \
                 tolerations: [{{key: virtual-kubelet.io/provider, operator: Exists}}]\n{body}"
            )
        };
        up.apply(&in_system(
            "root",
            "  hostPID: true\n  containers:\n  - name: main\n    image: busybox\n    command: [sleep, '60']\n    securityContext: {privileged: true}\n",
        ))?;
        let p = wait_for("root to fail", Duration::from_secs(60), || {
            let p = up.kubectl_json(&["get", "pod", "root", "-n", "system"])?;
            Ok((at(&p, "status.phase") == "Failed").then_some(p))
        })?;
        let message = str_at(&p, "status.message");
        ensure!(
            at(&p, "status.reason") == "DownstreamForbidden"
                && message.contains("PodSecurity")
                && message.contains("hostPID"),
            "{}",
            at(&p, "status")
        );
        eprintln!("a privileged hostPID Pod of upstream namespace system: {message}");
        // Nothing of vkd's in vkd's own namespace, which refuses such a Pod
        // by itself.
        let own =
            down.kubectl_json(&["get", "pods", "-n", "vkd-system", "-l", "vkd.io/owner-uid"])?;
        ensure!(items(&own).is_empty(), "vkd's Pods in vkd-system: {own}");
        let direct = down.kubectl_stdin(
            &["create", "--dry-run=server", "-f", "-"],
            Some(
                "apiVersion: v1\nkind: Pod\nmetadata: {name: root, namespace: vkd-system}\n\
                 spec:\n  hostPID: true\n  containers: [{name: main, image: busybox}]\n",
            ),
        );
        ensure!(
            direct
                .as_ref()
                .is_err_and(|e| format!("{e:#}").contains("violates PodSecurity")),
            "a hostPID Pod admitted in vkd-system: {direct:?}"
        );
        // Upstream `system` has a namespace of its own, made by vkd, with
        // Pod Security enforced, where an ordinary Pod runs.
        up.apply(&in_system(
            "plain",
            "  containers:\n  - {name: main, image: busybox, command: [sleep, '3600']}\n",
        ))?;
        let plain = wait_for("plain Running", Duration::from_secs(90), || {
            let p = up.kubectl_json(&["get", "pod", "plain", "-n", "system"])?;
            Ok(running_and_ready(&p).then_some(p))
        })?;
        let made = down.kubectl_json(&[
            "get",
            "namespaces",
            "-l",
            "vkd.io/upstream-namespace=system",
        ])?;
        let made = items(&made);
        ensure!(made.len() == 1, "{made:?}");
        let ns = str_at(&made[0], "metadata.name").to_owned();
        let labels = at(&made[0], "metadata.labels");
        ensure!(
            ns != "vkd-system"
                && ns.starts_with("vkd-system-")
                && labels["vkd.io/managed"] == "true"
                && labels["pod-security.kubernetes.io/enforce"] == "baseline",
            "{}",
            made[0]
        );
        let id = at(&plain, "metadata.annotations")["vkd.io/instance-id"]
            .as_str()
            .unwrap_or_default();
        ensure!(id.starts_with(&format!("down/{ns}/")), "instance id {id:?}");
        eprintln!("upstream namespace system runs downstream in {ns}");
        for name in ["root", "plain"] {
            up.kubectl(&[
                "delete",
                "pod",
                name,
                "-n",
                "system",
                "--wait=true",
                "--timeout=90s",
            ])?;
        }
        Ok(())
    })
}

fn volume_too_large(up: &Cluster) -> Result<()> {
    chain(up, |_| {
        // Two ConfigMaps of 600 KiB: each fits its own object, together they
        // are past the 1 MiB a downstream Secret holds. (`create`, not
        // `apply`: apply would copy them into an annotation.)
        for part in ["part-a", "part-b"] {
            up.kubectl_stdin(
                &["create", "-f", "-"],
                Some(&format!(
                    "apiVersion: v1\nkind: ConfigMap\nmetadata: {{name: {part}, namespace: {NS}}}\ndata: {{blob: {}}}\n",
                    "x".repeat(600 * 1024)
                )),
            )?;
        }
        up.apply(&pod(
            "bulky",
            r#"  containers:
  - name: main
    image: busybox
    command: [sleep, '3600']
    volumeMounts: [{name: models, mountPath: /models}]
  volumes:
  - name: models
    projected:
      sources:
      - configMap: {name: part-a, items: [{key: blob, path: a}]}
      - configMap: {name: part-b, items: [{key: blob, path: b}]}"#,
        ))?;
        let p = wait_failed(up, "bulky")?;
        let message = str_at(&p, "status.message");
        ensure!(
            at(&p, "status.reason") == "VolumeTooLarge"
                && message.contains("\"models\"")
                && message.contains("1228800 bytes"),
            "{}",
            at(&p, "status")
        );
        eprintln!("a 1.2 MiB volume: {message}");
        delete_and_wait(up, "pod", "bulky")?;
        for part in ["part-a", "part-b"] {
            up.kubectl(&["delete", "configmap", part, "-n", NS])?;
        }
        Ok(())
    })
}

/// A replica whose term ended (its node's fence downstream was raised by the
/// replica that took over) tries every write the provider makes: creating a
/// Pod (with its namespace and volume Secrets), deleting a Pod by its
/// upstream UID and by its instance id, rewriting a volume Secret. Each is
/// refused, by vkd against its watch of the fence, and the Secret write also
/// by the downstream API server; nothing downstream changes.
fn deposed_replica(up: &Cluster) -> Result<()> {
    use vkd_provider::{Fence, Provider, ProviderError, Volume, VolumeFile, VolumeSource};
    chain(up, |ch| {
        let down = &ch.down;
        up.kubectl(&[
            "create",
            "configmap",
            "settings",
            "-n",
            NS,
            "--from-literal=mode=live",
        ])?;
        up.apply(&pod(
            "kept",
            r#"  containers:
  - name: main
    image: busybox
    command: [sleep, '3600']
    volumeMounts: [{name: settings, mountPath: /settings}]
  volumes:
  - name: settings
    configMap: {name: settings}"#,
        ))?;
        let p = wait_running(up, "kept")?;
        let uid = str_at(&p, "metadata.uid").to_owned();
        let instance = at(&p, "metadata.annotations")["vkd.io/instance-id"]
            .as_str()
            .context("no instance id")?
            .to_owned();
        let epoch = fence_epoch(down)?;
        let secrets = |ns: &str| owned(down, "secrets", ns, &uid);
        let ns = downstream_pods(down, &uid)?
            .first()
            .map(|p| str_at(p, "metadata.namespace").to_owned())
            .context("no downstream Pod")?;
        let secret_before = items(&secrets(&ns)?)
            .first()
            .cloned()
            .context("no volume Secret downstream")?;

        // The replica before: same identity downstream, the epoch before.
        let stale = Fence {
            node: UP_NODE.into(),
            epoch: epoch - 1,
        };
        let config =
            vkd_kubernetes::KubernetesConfig::load(&up.dir().join("kubernetes-provider.yaml"))?;
        let provider = vkd_kubernetes::KubernetesProvider::open(config)?;
        // As vkd runs it: on several threads.
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()?;
        // Its first call waits for its watches to list the downstream
        // cluster, and must get there: a Pod watch that never woke once left
        // every call of such a replica at "not listed yet".
        runtime
            .block_on(provider.list(UP_NODE))
            .context("the replica's first list of the downstream cluster")?;
        let spec: vkd_provider::InstanceSpec = serde_json::from_value(serde_json::json!({
            "pod": {"uid": "0badf00d-0000-4000-8000-000000000001", "namespace": NS, "name": "late"},
            "node": UP_NODE,
            "containers": [],
            "resources": vkd_provider::Resources::default(),
            "restart_policy": "Always",
            "pod_spec": "{\"containers\": [{\"name\": \"main\", \"image\": \"busybox\"}]}",
        }))?;
        let volumes = [Volume {
            name: "settings".into(),
            source: VolumeSource::Files {
                files: vec![VolumeFile {
                    path: "mode".into(),
                    data: b"stale".to_vec(),
                    mode: 0o644,
                }],
            },
        }];
        let answers = runtime.block_on(async {
            [
                ("create", provider.create(&stale, &spec).await.map(|_| ())),
                (
                    "delete",
                    provider.delete(&stale, &uid, Duration::ZERO).await,
                ),
                (
                    "delete_instance",
                    provider
                        .delete_instance(&stale, &instance, Duration::ZERO)
                        .await,
                ),
                (
                    "update_volumes",
                    provider.update_volumes(&stale, &uid, &volumes).await,
                ),
            ]
        });
        for (call, answer) in answers {
            ensure!(
                matches!(answer, Err(ProviderError::Fenced { current, got, .. }) if current == epoch && got == epoch - 1),
                "{call} by epoch {} after the takeover at {epoch}: {answer:?}",
                epoch - 1
            );
            eprintln!("stale {call}: refused");
        }
        // The API server's own layer: a Secret write that carries the old
        // epoch is refused, whoever sends it (an update here as the admin, as
        // vkd's identity may not read Secrets, which kubectl patch does first;
        // a create as vkd's identity).
        let name = str_at(&secret_before, "metadata.name").to_owned();
        let patch = format!(
            r#"{{"metadata":{{"labels":{{"vkd.io/epoch":"{}"}}}},"data":{{"f0":"c3RhbGU="}}}}"#,
            epoch - 1
        );
        let refused = down.kubectl(&[
            "patch",
            "secret",
            &name,
            "-n",
            &ns,
            "--type=merge",
            "-p",
            &patch,
        ]);
        ensure!(
            refused
                .as_ref()
                .is_err_and(|e| format!("{e:#}").contains("vkd-fence")),
            "a stale-epoch Secret update was not refused downstream: {refused:?}"
        );
        let decoy = format!(
            "apiVersion: v1\nkind: Secret\nmetadata:\n  name: vkd-stale-secret\n  namespace: {ns}\n  labels: {{vkd.io/owner-node: {UP_NODE}, vkd.io/owner-uid: {uid}, vkd.io/epoch: '{}'}}\ndata: {{f0: c3RhbGU=}}\n",
            epoch - 1
        );
        let refused = down.kubectl_stdin(
            &[&format!("--as={VKD_SA}"), "create", "-f", "-"],
            Some(&decoy),
        );
        ensure!(
            refused
                .as_ref()
                .is_err_and(|e| format!("{e:#}").contains("vkd-fence")),
            "a stale-epoch Secret create was not refused downstream: {refused:?}"
        );
        // Nothing changed: the Pod runs on, upstream and down, with its data.
        let p = wait_running(up, "kept")?;
        ensure!(str_at(&p, "metadata.uid") == uid, "the Pod was replaced");
        let after = owned(down, "pods", &ns, &uid)?;
        ensure!(
            items(&after).len() == 1
                && at(&items(&after)[0], "metadata.deletionTimestamp").is_null(),
            "the downstream Pod was touched: {after}"
        );
        let secret_after = items(&secrets(&ns)?)
            .first()
            .cloned()
            .context("the Secret is gone")?;
        ensure!(
            secret_after["data"] == secret_before["data"],
            "the volume Secret was rewritten: {} -> {}",
            secret_before["data"],
            secret_after["data"]
        );
        ensure!(
            down.kubectl_json(&[
                "get",
                "pods",
                "-A",
                "-l",
                "vkd.io/owner-uid=0badf00d-0000-4000-8000-000000000001"
            ])
            .map(|l| items(&l).is_empty())?,
            "the stale create made a Pod"
        );
        delete_and_wait(up, "pod", "kept")?;
        up.kubectl(&["delete", "configmap", "settings", "-n", NS])?;
        Ok(())
    })
}
