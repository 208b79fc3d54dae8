//! End-to-end: vkd with the sim provider on the real control plane, checked
//! through the real kubectl and the sim backend's own listing (`vkd sim list`).
//!
//! Each test runs its own vkd with its own node name and state directory, so the
//! tests of the suite share one cluster without seeing each other's Pods.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, ExitCode};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use serde_json::Value;
use vkd_e2e::{Cluster, Suite, at, condition, repo_root, wait_for};

mod common;
#[path = "plugins/slurm.rs"]
mod slurm;
use common::{Plugin, VKD, Vkd, assert_one_instance_per_pod, items, running_and_ready, str_at};

const GRACE: &str = "16s";

fn main() -> ExitCode {
    Suite::new(
        "vkd-sim",
        &[
            "--node-monitor-grace-period",
            GRACE,
            "--node-monitor-period",
            "2s",
        ],
    )
    .run(&[
        (
            "external_http_deployment_runs_scales_and_deletes",
            external_http_deployment,
        ),
        (
            "gpu_and_unrunnable_pods_fail_with_reasons",
            gpu_and_unrunnable_pods_fail,
        ),
        (
            "node_lease_kill_not_ready_and_restart_adopts",
            kill_and_restart_adopts,
        ),
        ("the_node_rejects_what_a_kubelet_rejects", kubelet_admission),
        ("bad_input_exits_64_with_the_field", bad_input_exits_64),
        (
            "unhealthy_provider_makes_the_node_not_ready",
            unhealthy_provider,
        ),
        (
            "a_provider_plugin_over_grpc_runs_pods_and_is_adopted_back",
            provider_plugin,
        ),
        (
            "pods_run_as_slurm_jobs_through_the_slurm_plugin",
            slurm::pods_run_as_slurm_jobs,
        ),
    ])
}

fn external_http_deployment(c: &Cluster) -> Result<()> {
    let vkd = Vkd::start(
        c,
        "vk-external",
        &[
            "--node-label",
            "platform.example.com/execution=external",
            "--node-taint",
            "platform.example.com/execution=external:NoSchedule",
        ],
    )?;
    wait_for("node vk-external Ready", Duration::from_secs(30), || {
        let n = c.kubectl_json(&["get", "node", "vk-external"])?;
        Ok(condition(&n, "Ready")
            .is_some_and(|r| r["status"] == "True")
            .then_some(()))
    })?;
    let manifest =
        std::fs::read_to_string(repo_root().join("manifests/examples/external-http.yaml"))?;
    let applied = Instant::now();
    c.apply(&manifest)?;
    let ns = "platform-demo";
    let pods = wait_for(
        "6 Running and Ready Pods with podIP",
        Duration::from_secs(90),
        || {
            let pods =
                items(&c.kubectl_json(&["get", "pods", "-n", ns, "-l", "app=external-http"])?);
            let ok = pods.len() == 6
                && pods.iter().all(|p| {
                    running_and_ready(p)
                        && !str_at(p, "status.podIP").is_empty()
                        && str_at(p, "spec.nodeName") == "vk-external"
                        && at(p, "metadata.annotations")
                            .get("vkd.io/instance-id")
                            .is_some()
                });
            Ok(ok.then_some(pods))
        },
    )?;
    eprintln!(
        "external-http: 6 Pods Running and Ready {:.2}s after apply",
        applied.elapsed().as_secs_f64()
    );
    for p in &pods {
        let timeline = at(p, "metadata.annotations")
            .get("vkd.io/timeline")
            .cloned()
            .unwrap_or_default();
        eprintln!(
            "  {} {}",
            str_at(p, "metadata.name"),
            timeline.as_str().unwrap_or_default()
        );
        let timeline = timeline.as_str().unwrap_or_default();
        for step in [
            "bound=",
            "observed=",
            "admitted=",
            "accepted=",
            "started=",
            "ready=",
        ] {
            ensure!(
                timeline.contains(step),
                "timeline {timeline:?} lacks {step}"
            );
        }
    }
    assert_one_instance_per_pod(&vkd, &pods)?;
    eprintln!(
        "external-http: vkd RSS {} KiB with 6 Pods",
        vkd.rss_kib().unwrap_or(0)
    );

    c.kubectl(&[
        "scale",
        "deployment",
        "external-http",
        "-n",
        ns,
        "--replicas=2",
    ])?;
    let remaining = wait_for(
        "2 Pods and 2 instances after scaling to 2",
        Duration::from_secs(60),
        || {
            let pods =
                items(&c.kubectl_json(&["get", "pods", "-n", ns, "-l", "app=external-http"])?);
            Ok((pods.len() == 2
                && pods.iter().all(running_and_ready)
                && vkd.instances()?.len() == 2)
                .then_some(pods))
        },
    )?;
    assert_one_instance_per_pod(&vkd, &remaining)?;

    c.kubectl(&[
        "delete",
        "deployment",
        "external-http",
        "-n",
        ns,
        "--wait=false",
    ])?;
    wait_for(
        "no Pod and no instance after deleting the Deployment",
        Duration::from_secs(60),
        || {
            let pods = items(&c.kubectl_json(&["get", "pods", "-n", ns])?);
            Ok((pods.is_empty() && vkd.instances()?.is_empty()).then_some(()))
        },
    )?;
    Ok(())
}

fn pod_yaml(ns: &str, name: &str, selector: &str, annotations: &str, resources: &str) -> String {
    format!(
        r#"
apiVersion: v1
kind: Pod
metadata: {{name: {name}, namespace: {ns}, annotations: {{{annotations}}}}}
spec:
  nodeSelector: {{vkd.io/e2e: {selector}}}
  tolerations: [{{key: virtual-kubelet.io/provider, operator: Exists}}]
  containers:
  - name: main
    image: example/main:1
    resources: {{{resources}}}
"#
    )
}

fn gpu_and_unrunnable_pods_fail(c: &Cluster) -> Result<()> {
    let vkd = Vkd::start(c, "vk-gpu", &["--node-label", "vkd.io/e2e=gpu"])?;
    let ns = c.namespace("e2e-gpu")?;
    c.apply(&pod_yaml(
        &ns,
        "eight-gpus",
        "gpu",
        "",
        "limits: {nvidia.com/gpu: 8}",
    ))?;
    c.apply(&pod_yaml(
        &ns,
        "sixteen-gpus",
        "gpu",
        "",
        "limits: {nvidia.com/gpu: 16}",
    ))?;
    // Bound by name, past the scheduler, as a user may do: vkd's own admission must refuse it.
    c.apply(
        &pod_yaml(
            &ns,
            "sixteen-bound",
            "gpu",
            "",
            "limits: {nvidia.com/gpu: 16}",
        )
        .replace("  containers:", "  nodeName: vk-gpu\n  containers:"),
    )?;
    c.apply(&pod_yaml(
        &ns,
        "unrunnable",
        "gpu",
        "sim.vkd.io/behavior: explode",
        "",
    ))?;
    c.apply(&pod_yaml(
        &ns,
        "four-gpus",
        "gpu",
        "",
        "limits: {nvidia.com/gpu: 4}",
    ))?;
    let expect = [
        (
            "eight-gpus",
            "TopologyUnsatisfiable",
            "needs 8 nvidia.com/gpu on one host; largest slice is 4: host-a 4, host-b 4, cpu-1 0",
        ),
        (
            "sixteen-bound",
            "OutOfnvidia.com/gpu",
            "needs 16 nvidia.com/gpu; the whole fleet has 8",
        ),
        (
            "unrunnable",
            "UnsupportedBehavior",
            "sim.vkd.io/behavior=\"explode\"",
        ),
    ];
    for (name, reason, message) in expect {
        let pod = wait_for(&format!("{name} to fail"), Duration::from_secs(60), || {
            let p = c.kubectl_json(&["get", "pod", name, "-n", &ns])?;
            Ok((at(&p, "status.phase") == "Failed").then_some(p))
        })?;
        ensure!(
            str_at(&pod, "status.reason") == reason,
            "{name}: reason {}",
            pod["status"]["reason"]
        );
        let got = str_at(&pod, "status.message");
        ensure!(
            got.contains(message),
            "{name}: message {got:?} lacks {message:?}"
        );
        let events = c.kubectl(&[
            "get",
            "events",
            "-n",
            &ns,
            "--field-selector",
            &format!("involvedObject.name={name},type=Warning"),
        ])?;
        ensure!(
            events.contains(reason),
            "{name}: no Warning event with {reason}: {events}"
        );
    }
    // The Node advertises 8 GPUs in all, so the real scheduler never binds 16.
    let pod = c.kubectl_json(&["get", "pod", "sixteen-gpus", "-n", &ns])?;
    let scheduled = condition(&pod, "PodScheduled").context("no PodScheduled")?;
    ensure!(
        scheduled["reason"] == "Unschedulable"
            && scheduled["message"]
                .as_str()
                .unwrap_or_default()
                .contains("Insufficient nvidia.com/gpu"),
        "sixteen-gpus: {scheduled}"
    );
    wait_for("the 4-GPU Pod to run", Duration::from_secs(60), || {
        let p = c.kubectl_json(&["get", "pod", "four-gpus", "-n", &ns])?;
        Ok(running_and_ready(&p).then_some(()))
    })?;
    let instances = vkd.instances()?;
    ensure!(
        instances.len() == 1,
        "only the 4-GPU Pod has an instance: {instances:?}"
    );
    ensure!(
        at(&instances[0], "gpus").as_array().map(Vec::len) == Some(4),
        "{:?}",
        instances[0]
    );
    c.kubectl(&["delete", "namespace", &ns, "--wait=false"])?;
    Ok(())
}

/// Pods bound by name, past the scheduler, that a kubelet would refuse:
/// each fails with the kubelet's reason and "Pod was rejected: ..." and never
/// reaches the backend; the ones a kubelet takes run. (An untolerated
/// NoExecute taint is the unit tests': here the taint manager deletes such a
/// Pod as soon as it is bound.)
fn kubelet_admission(c: &Cluster) -> Result<()> {
    let node = "vk-admit";
    let vkd = Vkd::start(
        c,
        node,
        &["--node-label", "vkd.io/e2e=admit", "--max-pods", "4"],
    )?;
    let ns = c.namespace("e2e-admit")?;
    let pod = |name: &str, extra: &str| {
        format!(
            r#"
apiVersion: v1
kind: Pod
metadata: {{name: {name}, namespace: {ns}}}
spec:
  nodeName: {node}
  {extra}
  containers:
  - name: main
    image: example/main:1
    ports: [{{containerPort: 80, hostPort: 18080}}]
"#
        )
    };
    let phase = |name: &str| -> Result<Value> {
        wait_for(
            &format!("{name} to run or fail"),
            Duration::from_secs(60),
            || {
                let p = c.kubectl_json(&["get", "pod", name, "-n", &ns])?;
                Ok(
                    matches!(at(&p, "status.phase").as_str(), Some("Running" | "Failed"))
                        .then_some(p),
                )
            },
        )
    };
    let rejected = |name: &str, reason: &str, message: &str| -> Result<()> {
        let p = phase(name)?;
        ensure!(
            str_at(&p, "status.phase") == "Failed" && str_at(&p, "status.reason") == reason,
            "{name}: {}",
            p["status"]
        );
        let want = format!("Pod was rejected: {message}");
        ensure!(
            str_at(&p, "status.message") == want,
            "{name}: message {:?}, want {want:?}",
            p["status"]["message"]
        );
        let events = c.kubectl(&[
            "get",
            "events",
            "-n",
            &ns,
            "--field-selector",
            &format!("involvedObject.name={name},type=Warning,reason={reason}"),
        ])?;
        ensure!(
            events.contains(message),
            "{name}: no Warning {reason} Event: {events}"
        );
        Ok(())
    };
    c.apply(&pod("first", ""))?;
    ensure!(
        str_at(&phase("first")?, "status.phase") == "Running",
        "first did not run"
    );
    c.apply(&pod("same-port", ""))?;
    rejected(
        "same-port",
        "NodePorts",
        "Predicate NodePorts failed: node(s) didn't have free ports for the requested pod ports",
    )?;
    c.apply(&pod("udp", "").replace("hostPort: 18080}", "hostPort: 18080, protocol: UDP}"))?;
    ensure!(
        str_at(&phase("udp")?, "status.phase") == "Running",
        "udp did not run"
    );
    c.apply(&pod("elsewhere", "nodeSelector: {vkd.io/e2e: elsewhere}").replace("18080", "18081"))?;
    rejected(
        "elsewhere",
        "NodeAffinity",
        "Predicate NodeAffinity failed: node(s) didn't match Pod's node affinity/selector",
    )?;
    // A label added a moment ago counts, as on the kubelet.
    c.kubectl(&["label", "node", node, "vkd.io/e2e-added=now"])?;
    c.apply(&pod("added", "nodeSelector: {vkd.io/e2e-added: now}").replace("18080", "18082"))?;
    ensure!(
        str_at(&phase("added")?, "status.phase") == "Running",
        "added did not run"
    );
    c.apply(&pod("fourth", "").replace("18080", "18084"))?;
    ensure!(
        str_at(&phase("fourth")?, "status.phase") == "Running",
        "fourth did not run"
    );
    c.apply(&pod("fifth", "").replace("18080", "18085"))?;
    rejected(
        "fifth",
        "OutOfpods",
        "Node didn't have enough resource: pods, requested: 1, used: 4, capacity: 4",
    )?;
    let mut owners: Vec<String> = vkd
        .instances()?
        .iter()
        .map(|i| str_at(i, "name").to_owned())
        .collect();
    owners.sort();
    ensure!(
        owners == ["added", "first", "fourth", "udp"],
        "only the admitted Pods reach the backend: {owners:?}"
    );
    c.kubectl(&["delete", "namespace", &ns, "--wait=false"])?;
    Ok(())
}

fn lease_renew_time(c: &Cluster, node: &str) -> Result<String> {
    let lease = c.kubectl_json(&["get", "lease", node, "-n", "kube-node-lease"])?;
    Ok(str_at(&lease, "spec.renewTime").to_owned())
}

const RESTART_DEPLOYMENT: &str = r#"
apiVersion: apps/v1
kind: Deployment
metadata: {name: steady, namespace: e2e-restart}
spec:
  replicas: 3
  selector: {matchLabels: {app: steady}}
  template:
    metadata: {labels: {app: steady}}
    spec:
      nodeSelector: {vkd.io/e2e: restart}
      tolerations: [{key: virtual-kubelet.io/provider, operator: Exists}]
      containers:
      - {name: app, image: example/steady:1, resources: {requests: {cpu: 100m, memory: 64Mi}}}
"#;

fn kill_and_restart_adopts(c: &Cluster) -> Result<()> {
    let node = "vk-restart";
    let mut vkd = Vkd::start(c, node, &["--node-label", "vkd.io/e2e=restart"])?;
    let n = wait_for("node vk-restart Ready", Duration::from_secs(30), || {
        let n = c.kubectl_json(&["get", "node", node])?;
        Ok(condition(&n, "Ready")
            .is_some_and(|r| r["status"] == "True")
            .then_some(n))
    })?;
    check_node_object(&n)?;

    c.namespace("e2e-restart")?;
    c.apply(RESTART_DEPLOYMENT)?;
    let pods = wait_for("3 Running Pods", Duration::from_secs(60), || {
        let pods = items(&c.kubectl_json(&["get", "pods", "-n", "e2e-restart"])?);
        Ok((pods.len() == 3 && pods.iter().all(running_and_ready)).then_some(pods))
    })?;
    assert_one_instance_per_pod(&vkd, &pods)?;
    let before: BTreeMap<String, String> = vkd
        .instances()?
        .iter()
        .map(|i| {
            (
                str_at(i, "podUID").to_owned(),
                str_at(i, "instance").to_owned(),
            )
        })
        .collect();

    let first = lease_renew_time(c, node)?;
    wait_for(
        "the node lease's renewTime to advance",
        Duration::from_secs(30),
        || Ok((lease_renew_time(c, node)? != first).then_some(())),
    )?;

    vkd.kill()?;
    let killed = Instant::now();
    wait_for(
        "the node lifecycle controller to mark vk-restart NotReady",
        Duration::from_secs(90),
        || {
            let n = c.kubectl_json(&["get", "node", node])?;
            Ok(condition(&n, "Ready")
                .is_some_and(|r| r["status"] == "Unknown" && r["reason"] == "NodeStatusUnknown")
                .then_some(()))
        },
    )?;
    eprintln!(
        "vk-restart NotReady {:.1}s after SIGKILL",
        killed.elapsed().as_secs_f64()
    );
    // The backend kept running without the daemon.
    ensure!(
        vkd.instances()?.len() == 3,
        "instances vanished with the daemon"
    );

    vkd.spawn()?;
    let restarted = Instant::now();
    wait_for("vk-restart Ready again", Duration::from_secs(60), || {
        let n = c.kubectl_json(&["get", "node", node])?;
        Ok(condition(&n, "Ready")
            .is_some_and(|r| r["status"] == "True")
            .then_some(()))
    })?;
    eprintln!(
        "vk-restart Ready {:.1}s after restart",
        restarted.elapsed().as_secs_f64()
    );
    let pods = wait_for("the same 3 Pods Running", Duration::from_secs(30), || {
        let pods = items(&c.kubectl_json(&["get", "pods", "-n", "e2e-restart"])?);
        Ok((pods.len() == 3 && pods.iter().all(running_and_ready)).then_some(pods))
    })?;
    let after: BTreeMap<String, String> = vkd
        .instances()?
        .iter()
        .map(|i| {
            (
                str_at(i, "podUID").to_owned(),
                str_at(i, "instance").to_owned(),
            )
        })
        .collect();
    ensure!(
        before == after,
        "instances changed across the restart: {before:?} -> {after:?}"
    );
    assert_one_instance_per_pod(&vkd, &pods)?;
    for p in &pods {
        ensure!(
            at(p, "status.containerStatuses.0.restartCount") == 0,
            "a container restarted"
        );
    }
    c.kubectl(&["delete", "namespace", "e2e-restart", "--wait=false"])?;
    wait_for(
        "no instance after deleting the namespace",
        Duration::from_secs(60),
        || Ok(vkd.instances()?.is_empty().then_some(())),
    )?;
    Ok(())
}

/// What a platform team sees on the Node.
fn check_node_object(n: &Value) -> Result<()> {
    let labels = at(n, "metadata.labels");
    for (k, v) in [
        ("type", "virtual-kubelet"),
        ("kubernetes.io/os", "linux"),
        ("kubernetes.io/role", "agent"),
        ("vkd.io/e2e", "restart"),
    ] {
        ensure!(
            labels.get(k).and_then(Value::as_str) == Some(v),
            "label {k} is {:?}",
            labels.get(k)
        );
    }
    ensure!(labels.get("kubernetes.io/arch").is_some(), "no arch label");
    let taints = at(n, "spec.taints").as_array().cloned().unwrap_or_default();
    ensure!(
        taints
            .iter()
            .any(|t| t["key"] == "virtual-kubelet.io/provider"
                && t["value"] == "sim"
                && t["effect"] == "NoSchedule"),
        "default taint missing: {taints:?}"
    );
    let cap = at(n, "status.capacity");
    ensure!(
        cap["nvidia.com/gpu"] == "8",
        "gpu capacity {}",
        cap["nvidia.com/gpu"]
    );
    ensure!(cap["cpu"] == "160", "cpu capacity {}", cap["cpu"]);
    ensure!(cap["pods"] == "420", "pods capacity {}", cap["pods"]);
    ensure!(
        at(n, "status.allocatable") == cap,
        "allocatable differs from capacity"
    );
    ensure!(
        str_at(n, "status.nodeInfo.kubeletVersion").contains("vkd"),
        "nodeInfo {}",
        n["status"]["nodeInfo"]
    );
    ensure!(
        at(n, "status.daemonEndpoints.kubeletEndpoint.Port")
            .as_u64()
            .is_some_and(|p| p > 0),
        "no kubelet port"
    );
    let addresses = at(n, "status.addresses")
        .as_array()
        .cloned()
        .unwrap_or_default();
    ensure!(
        addresses
            .iter()
            .any(|a| a["type"] == "InternalIP" && a["address"] == "127.0.0.1"),
        "addresses {addresses:?}"
    );
    let ready = condition(n, "Ready").context("no Ready condition")?;
    ensure!(
        ready["reason"] == "KubeletReady",
        "Ready reason {}",
        ready["reason"]
    );
    Ok(())
}

fn run_vkd(args: &[&str]) -> Result<(i32, String)> {
    let out = Command::new(VKD)
        .args(args)
        .env_remove("KUBECONFIG")
        .output()?;
    Ok((
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    ))
}

fn bad_input_exits_64(_c: &Cluster) -> Result<()> {
    let good = repo_root().join("testdata/fleets/demo.yaml");
    let typo = repo_root().join("testdata/bad/fleet-typo.yaml");
    let process_typo = repo_root().join("testdata/bad/process-typo.yaml");
    let tmp = std::env::temp_dir().join(format!("vkd-bad-{}", std::process::id()));
    let state = tmp.display().to_string();
    let cases: Vec<(Vec<String>, &str)> = vec![
        (
            vec![
                "run".into(),
                "--node-name".into(),
                "vk".into(),
                "--provider".into(),
                "sim".into(),
                "--provider-config".into(),
                path(&typo),
                "--state-dir".into(),
                state.clone(),
            ],
            "provider-config",
        ),
        (
            vec![
                "run".into(),
                "--node-name".into(),
                "vk".into(),
                "--provider-config".into(),
                path(&process_typo),
                "--state-dir".into(),
                state.clone(),
            ],
            "imagez",
        ),
        (
            vec![
                "run".into(),
                "--node-name".into(),
                "vk".into(),
                "--provider-config".into(),
                path(&repo_root().join("testdata/bad/process-cgroup-parent.yaml")),
                "--state-dir".into(),
                state.clone(),
            ],
            "cgroupParent",
        ),
        (
            vec!["run".into(), "--no-such-flag".into()],
            "--no-such-flag",
        ),
        (
            vec!["run".into(), "--provider-config".into(), path(&good)],
            "node-name",
        ),
        (
            vec![
                "run".into(),
                "--node-name".into(),
                "Bad_Name".into(),
                "--provider-config".into(),
                path(&good),
            ],
            "node-name",
        ),
        (
            vec![
                "run".into(),
                "--node-name".into(),
                "vk".into(),
                "--provider-config".into(),
                path(&good),
                "--node-taint".into(),
                "k=v:Maybe".into(),
            ],
            "node-taint",
        ),
        (
            vec![
                "run".into(),
                "--node-name".into(),
                "vk".into(),
                "--provider-config".into(),
                "/nonexistent/fleet.yaml".into(),
            ],
            "provider-config",
        ),
    ];
    let mut cases = cases;
    for (file, field) in [
        ("kubernetes-typo.yaml", "hostSelectr"),
        ("kubernetes-no-kubeconfig.yaml", "kubeconfig"),
        ("kubernetes-outage-grace.yaml", "outageGrace"),
    ] {
        cases.push((
            [
                "run",
                "--node-name",
                "vk",
                "--provider",
                "kubernetes",
                "--provider-config",
                &path(&repo_root().join("testdata/bad").join(file)),
                "--state-dir",
                &state,
            ]
            .map(str::to_owned)
            .to_vec(),
            field,
        ));
    }
    for (args, field) in cases {
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        let (code, stderr) = run_vkd(&refs)?;
        if code != 64 || !stderr.contains(field) {
            bail!("vkd {args:?}: exit {code}, stderr {stderr:?}; want 64 naming {field}");
        }
        ensure!(!stderr.contains("panicked"), "vkd panicked: {stderr}");
    }
    let (_, stderr) = run_vkd(&[
        "run",
        "--node-name",
        "vk",
        "--provider",
        "sim",
        "--provider-config",
        &path(&typo),
        "--state-dir",
        &state,
    ])?;
    ensure!(
        stderr.contains("unknown field `memroy`"),
        "the typo is not named: {stderr}"
    );
    std::fs::remove_dir_all(&tmp).ok();
    Ok(())
}

fn path(p: &Path) -> String {
    p.display().to_string()
}

fn unhealthy_provider(c: &Cluster) -> Result<()> {
    let _vkd = Vkd::start_with_fleet(
        c,
        "vk-unhealthy",
        "unhealthy.yaml",
        &["--node-label", "vkd.io/e2e=unhealthy"],
    )?;
    let ready = wait_for(
        "vk-unhealthy to report Ready=False",
        Duration::from_secs(30),
        || {
            let n = c.kubectl_json(&["get", "node", "vk-unhealthy"])?;
            Ok(condition(&n, "Ready")
                .filter(|r| r["status"] == "False")
                .cloned())
        },
    )?;
    ensure!(
        ready["reason"] == "SimFaultInjected",
        "reason {}",
        ready["reason"]
    );
    let message = ready["message"].as_str().unwrap_or_default();
    ensure!(
        message.contains("provider sim is unhealthy"),
        "message {message:?}"
    );
    // Not silent: the lease is still renewed, so the controller does not call it Unknown.
    let lease = c.kubectl_json(&["get", "lease", "vk-unhealthy", "-n", "kube-node-lease"])?;
    ensure!(
        !str_at(&lease, "spec.renewTime").is_empty(),
        "no lease renewal"
    );
    Ok(())
}

fn ready_condition(c: &Cluster, node: &str, status: &str) -> Result<Value> {
    wait_for(
        &format!("{node} Ready={status}"),
        Duration::from_secs(40),
        || {
            let n = c.kubectl_json(&["get", "node", node])?;
            Ok(condition(&n, "Ready")
                .filter(|r| r["status"] == status)
                .cloned())
        },
    )
}

/// vkd on `--provider grpc`, its provider the sim in a process of its own
/// (`vkd provider-serve`): a Pod runs with logs and exec through the protocol;
/// when the plugin is killed the Node goes not Ready saying why and nothing
/// is lost; when it is back the Node is Ready and the same instance serves
/// the Pod, never a second one.
fn provider_plugin(c: &Cluster) -> Result<()> {
    const NODE: &str = "vk-plugin";
    const NS: &str = "e2e-plugin";
    let mut plugin = Plugin::sim(c, "plugin-sim")?;
    let endpoint = format!("unix://{}", path(&plugin.socket));
    let unused = repo_root().join("testdata/fleets/demo.yaml");
    let _vkd = Vkd::start_provider(
        c,
        NODE,
        "grpc",
        &unused,
        &[
            "--provider-endpoint",
            &endpoint,
            "--node-label",
            "vkd.io/e2e=plugin",
            "--client-ca-file",
            c.env("VKD_E2E_KUBELET_CLIENT_CA")?,
        ],
    )?;
    ready_condition(c, NODE, "True")?;
    let n = c.kubectl_json(&["get", "node", NODE])?;
    let caps = n["metadata"]["annotations"]["vkd.io/capabilities"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    ensure!(
        caps.split(',').any(|c| c == "exec") && caps.split(',').any(|c| c == "logs"),
        "the plugin's capabilities on the Node: {caps:?}"
    );
    c.namespace(NS)?;
    c.apply(&format!(
        "apiVersion: v1\nkind: Pod\nmetadata: {{name: web, namespace: {NS}}}\nspec:\n  \
         nodeSelector: {{vkd.io/e2e: plugin}}\n  \
         tolerations: [{{key: virtual-kubelet.io/provider, operator: Exists}}]\n  \
         containers: [{{name: main, image: example/web:1}}]\n"
    ))?;
    let pod = wait_for("web Running", Duration::from_secs(60), || {
        let p = c.kubectl_json(&["get", "pod", "web", "-n", NS])?;
        Ok(running_and_ready(&p).then_some(p))
    })?;
    let uid = str_at(&pod, "metadata.uid").to_owned();
    let said = c.kubectl(&["exec", "-n", NS, "web", "--", "echo", "through-the-plugin"])?;
    ensure!(said.trim() == "through-the-plugin", "exec said {said:?}");
    wait_for("a log line", Duration::from_secs(20), || {
        let logs = c.kubectl(&["logs", "-n", NS, "web", "--tail=1"])?;
        Ok((!logs.trim().is_empty()).then_some(()))
    })?;
    let before = plugin.instances(NODE)?;
    ensure!(before.len() == 1, "instances before: {before:?}");
    // The plugin dies: the Node says why, the Pod stays.
    plugin.kill()?;
    let down = ready_condition(c, NODE, "False")?;
    eprintln!("with the plugin killed: {down}");
    ensure!(
        down["reason"] == "ProviderPluginUnreachable"
            && down["message"]
                .as_str()
                .unwrap_or_default()
                .contains("provider.sock"),
        "{down}"
    );
    let p = c.kubectl_json(&["get", "pod", "web", "-n", NS])?;
    ensure!(
        str_at(&p, "metadata.uid") == uid && str_at(&p, "status.phase") == "Running",
        "the Pod while the plugin is down: {}",
        at(&p, "status")
    );
    // Back from its state: Ready again, the same one instance.
    plugin.spawn()?;
    ready_condition(c, NODE, "True")?;
    let p = wait_for("web Ready again", Duration::from_secs(30), || {
        let p = c.kubectl_json(&["get", "pod", "web", "-n", NS])?;
        Ok(running_and_ready(&p).then_some(p))
    })?;
    ensure!(str_at(&p, "metadata.uid") == uid, "a new Pod");
    let after = plugin.instances(NODE)?;
    ensure!(
        after.len() == 1 && after[0]["instance"] == before[0]["instance"],
        "instances before {before:?}, after {after:?}"
    );
    let said = c.kubectl(&["exec", "-n", NS, "web", "--", "echo", "back"])?;
    ensure!(said.trim() == "back", "exec after the return said {said:?}");
    c.kubectl(&[
        "delete",
        "pod",
        "web",
        "-n",
        NS,
        "--wait=true",
        "--timeout=60s",
    ])?;
    let gone = plugin.instances(NODE)?;
    ensure!(gone.is_empty(), "instances after the delete: {gone:?}");
    Ok(())
}
