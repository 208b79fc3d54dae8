//! `vkd explain` on a real control plane, for the three questions a platform
//! must answer before it goes live: why is there an extra instance, why did
//! this not fail over, why does the node have capacity but the Pod still
//! queues. And a user who may not read a Pod may not explain it.
#![allow(clippy::unwrap_used)]

use std::process::{Command, ExitCode, Output};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use serde_json::Value;
use vkd_e2e::{Cluster, Suite, at, condition, wait_for};

mod common;
use common::{Proxy, VKD, Vkd, apiserver_addr, items, running_and_ready, str_at, users_client_ca};

fn main() -> ExitCode {
    // A short node-monitor grace period, so a partition shows as a taint quickly.
    Suite::serial("explain", &["--node-monitor-grace-period", "16s"]).run(&[
        (
            "extra_instances_are_explained_as_orphans_with_what_collection_does",
            extra_instances,
        ),
        (
            "a_queued_pod_is_explained_by_the_slices_that_do_not_fit",
            queued_on_slices,
        ),
        (
            "a_pod_that_did_not_move_is_explained_by_taint_toleration_and_policy",
            did_not_move,
        ),
    ])
}

/// `vkd explain ARGS` as the cluster's admin. It asks vkd directly: the API
/// server's node proxy refuses loopback node addresses, and every vkd here
/// serves on 127.0.0.1 (with a self-signed certificate).
fn explain(c: &Cluster, args: &[&str]) -> Result<Output> {
    Ok(Command::new(VKD)
        .arg("explain")
        .args(args)
        .args(["--direct", "--insecure-skip-tls-verify-kubelet"])
        .env("KUBECONFIG", c.kubeconfig())
        .output()?)
}

/// A vkd the cluster's users can reach with their client certificates, as a
/// kubelet trusts the cluster's client CA (and the API server's own).
fn start(c: &Cluster, node: &str, extra: &[&str]) -> Result<Vkd> {
    let bundle = users_client_ca(c)?;
    let mut args = extra.to_vec();
    args.extend(["--client-ca-file", &bundle]);
    Vkd::start(c, node, &args)
}

fn explain_json(c: &Cluster, args: &[&str]) -> Result<Value> {
    let mut all = args.to_vec();
    all.extend(["-o", "json"]);
    let out = explain(c, &all)?;
    ensure!(
        out.status.success(),
        "vkd explain {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).context("vkd explain -o json")
}

fn explain_text(c: &Cluster, args: &[&str]) -> Result<String> {
    let out = explain(c, args)?;
    ensure!(
        out.status.success(),
        "vkd explain {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn pod_yaml(ns: &str, name: &str, selector: &str, gpus: u32, extra: &str) -> String {
    let limits = if gpus > 0 {
        format!("\n    resources: {{limits: {{nvidia.com/gpu: {gpus}}}}}")
    } else {
        String::new()
    };
    format!(
        "apiVersion: v1\nkind: Pod\nmetadata: {{name: {name}, namespace: {ns}}}\nspec:\n  nodeSelector: {{vkd.io/e2e: {selector}}}\n  tolerations: [{{key: virtual-kubelet.io/provider, operator: Exists}}{extra}]\n  containers:\n  - name: main\n    image: example/app:1{limits}\n"
    )
}

fn pod(c: &Cluster, ns: &str, name: &str) -> Result<Value> {
    c.kubectl_json(&["get", "pod", "-n", ns, name])
}

fn ready(c: &Cluster, ns: &str, names: &[&str]) -> Result<()> {
    wait_for("the Pods Ready", Duration::from_secs(60), || {
        for n in names {
            if !running_and_ready(&pod(c, ns, n)?) {
                return Ok(None);
            }
        }
        Ok(Some(()))
    })
}

fn instance_of(vkd: &Vkd, uid: &str) -> Result<Option<Value>> {
    Ok(vkd
        .instances()?
        .into_iter()
        .find(|i| str_at(i, "podUID") == uid))
}

fn extra_instances(c: &Cluster) -> Result<()> {
    let ns = c.namespace("explain-extra")?;
    // Collection every 10 minutes: the hand-made instance stays long enough
    // to be asked about (the first pass runs at start, before it exists).
    let mut vkd = start(
        c,
        "vk-extra",
        &["--node-label", "vkd.io/e2e=extra", "--gc-interval", "10m"],
    )?;
    for n in ["keep-a", "keep-b"] {
        c.apply(&pod_yaml(&ns, n, "extra", 0, ""))?;
    }
    ready(c, &ns, &["keep-a", "keep-b"])?;

    // 1. An instance made in the backend by hand, for a Pod that never was.
    let made = Command::new(VKD)
        .args(["sim", "create", "--node", "vk-extra", "--pod"])
        .arg(format!("{ns}/handmade"))
        .arg("--state-dir")
        .arg(&vkd.state_dir)
        .output()?;
    ensure!(
        made.status.success(),
        "vkd sim create: {}",
        String::from_utf8_lossy(&made.stderr)
    );
    let handmade = String::from_utf8(made.stdout)?.trim().to_owned();
    let answer = explain_json(c, &["instance", &handmade, "--node", "vk-extra"])?;
    let vkd_side = &answer["vkd"];
    ensure!(vkd_side["verdict"] == "orphan", "{answer:#}");
    let why = str_at(vkd_side, "why");
    ensure!(
        why.contains("no Pod with uid") && why.contains(&format!("{ns}/handmade")),
        "{why}"
    );
    let action = str_at(vkd_side, "action");
    ensure!(
        action.contains("deleted at the next collection pass, at the latest in")
            && action.contains("every 600s"),
        "the action names the next pass: {action}"
    );
    ensure!(
        at(vkd_side, "collection.braked").is_null(),
        "the brake holds: {answer:#}"
    );
    let node = explain_json(c, &["node", "vk-extra"])?;
    let unowned = node["vkd"]["unowned"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    ensure!(
        unowned
            .iter()
            .any(|u| str_at(u, "instance.id") == handmade && u["kind"] == "orphan"),
        "explain node does not list the hand-made orphan: {node:#}"
    );
    let text = explain_text(c, &["instance", &handmade])?;
    ensure!(
        text.contains(": orphan") && text.contains("next: deleted"),
        "{text}"
    );
    eprintln!("--- vkd explain instance {handmade} (made by hand)\n{text}");

    // 2. An instance left by a SIGKILL during its create: vkd dies as the
    // backend returns the instance, before it writes the Pod's status, and
    // the Pod is force-deleted while vkd is down.
    c.apply(&pod_yaml(&ns, "victim", "extra", 0, ""))?;
    let uid = wait_for("the victim's uid", Duration::from_secs(30), || {
        let p = pod(c, &ns, "victim")?;
        Ok(Some(str_at(&p, "metadata.uid").to_owned()).filter(|u| !u.is_empty()))
    })?;
    let started = Instant::now();
    let left = loop {
        if let Some(i) = instance_of(&vkd, &uid)? {
            vkd.kill()?;
            break i;
        }
        ensure!(
            started.elapsed() < Duration::from_secs(30),
            "no instance for the victim"
        );
        std::thread::sleep(Duration::from_millis(5));
    };
    let left_id = str_at(&left, "instance").to_owned();
    c.kubectl(&[
        "delete",
        "pod",
        "victim",
        "-n",
        &ns,
        "--grace-period=0",
        "--force",
    ])?;
    vkd.spawn()?;
    // The restarted vkd collects it right after its Pod watch syncs.
    wait_for(
        "the left instance collected",
        Duration::from_secs(60),
        || Ok(instance_of(&vkd, &uid)?.is_none().then_some(())),
    )?;
    let answer = wait_for("vkd to answer again", Duration::from_secs(30), || {
        Ok(explain_json(c, &["instance", &left_id, "--node", "vk-extra"]).ok())
    })?;
    let vkd_side = &answer["vkd"];
    ensure!(vkd_side["verdict"] == "gone", "{answer:#}");
    let decisions = vkd_side["decisions"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let removed = decisions
        .iter()
        .find(|d| d["action"] == "removed")
        .with_context(|| format!("no removal among the decisions: {answer:#}"))?;
    ensure!(
        str_at(removed, "detail").contains("pod gone from the API")
            && str_at(removed, "pod_uid") == uid,
        "{removed:#}"
    );
    ensure!(str_at(vkd_side, "why").contains("removed it"), "{answer:#}");
    let text = explain_text(c, &["instance", &left_id, "--node", "vk-extra"])?;
    eprintln!("--- vkd explain instance {left_id} (left by SIGKILL during create)\n{text}");
    // The restart's first pass took the hand-made orphan too, and says so.
    let again = explain_json(c, &["instance", &handmade, "--node", "vk-extra"])?;
    ensure!(
        again["vkd"]["verdict"] == "gone"
            && str_at(&again["vkd"], "why").contains("pod gone from the API"),
        "{again:#}"
    );
    c.kubectl(&["delete", "namespace", &ns, "--wait=true", "--timeout=60s"])?;
    Ok(())
}

fn queued_on_slices(c: &Cluster) -> Result<()> {
    let ns = c.namespace("explain-gpu")?;
    // testdata/fleets/demo.yaml: host-a and host-b with 4 GPUs each.
    let vkd = start(c, "vk-gpu", &["--node-label", "vkd.io/e2e=gpu"])?;
    // 3 + 3 GPUs: one on each host, 1 GPU left on each.
    c.apply(&pod_yaml(&ns, "three-a", "gpu", 3, ""))?;
    ready(c, &ns, &["three-a"])?;
    c.apply(&pod_yaml(&ns, "three-b", "gpu", 3, ""))?;
    ready(c, &ns, &["three-b"])?;
    // 2 GPUs: the Node has 8 - 6 = 2 left, so the scheduler binds it; no
    // single host has 2 free.
    c.apply(&pod_yaml(&ns, "two", "gpu", 2, ""))?;
    wait_for("two waiting BackendQueued", Duration::from_secs(60), || {
        let p = pod(c, &ns, "two")?;
        let reason = str_at(&p, "status.containerStatuses.0.state.waiting.reason").to_owned();
        Ok((reason == "BackendQueued").then_some(()))
    })?;
    let answer = explain_json(c, &["pod", &format!("{ns}/two")])?;
    let vkd_side = &answer["vkd"];
    let reason = str_at(vkd_side, "waiting.reason");
    ensure!(
        reason.contains("largest free slice is 1")
            && reason.contains("host-a 1")
            && reason.contains("host-b 1"),
        "{answer:#}"
    );
    let slices = vkd_side["slices"]["hosts"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let free: Vec<(String, u64)> = slices
        .iter()
        .filter(|h| h["gpus_total"].as_u64() > Some(0))
        .map(|h| {
            (
                str_at(h, "host").to_owned(),
                h["gpus_free"].as_u64().unwrap_or(99),
            )
        })
        .collect();
    ensure!(
        free == [("host-a".to_owned(), 1), ("host-b".to_owned(), 1)],
        "{free:?}"
    );
    ensure!(
        vkd_side["queue_position"] == serde_json::json!([1, 1]),
        "{answer:#}"
    );
    let node = c.kubectl_json(&["get", "node", "vk-gpu"])?;
    ensure!(
        at(&node, "status.allocatable")["nvidia.com/gpu"] == "8",
        "the Node should advertise 8 GPUs: {}",
        at(&node, "status.allocatable")
    );
    let decisions = vkd_side["decisions"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    ensure!(
        decisions.iter().any(|d| d["action"] == "queued"),
        "{answer:#}"
    );
    let text = explain_text(c, &["pod", "two", "-n", &ns])?;
    ensure!(
        text.contains("BackendQueued") && text.contains("host-a") && text.contains("1/4 GPU free"),
        "{text}"
    );
    eprintln!("--- vkd explain pod {ns}/two\n{text}");
    let node_text = explain_text(c, &["node", "vk-gpu"])?;
    ensure!(
        node_text.contains(&format!("{ns}/two")) && node_text.contains("largest free slice"),
        "{node_text}"
    );
    eprintln!("--- vkd explain node vk-gpu\n{node_text}");

    // As a kubectl plugin.
    let bin = c.dir().join("plugin-bin");
    std::fs::create_dir_all(&bin)?;
    let link = bin.join("kubectl-vkd");
    if !link.exists() {
        std::os::unix::fs::symlink(VKD, &link)?;
    }
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let plugin = Command::new(c.env("VKD_E2E_KUBECTL")?)
        .args(["vkd", "explain", "pod", &format!("{ns}/two")])
        .env("PATH", path)
        .env("KUBECONFIG", c.kubeconfig())
        .output()?;
    let plugin_text = String::from_utf8_lossy(&plugin.stdout);
    ensure!(
        plugin.status.success() && plugin_text.contains("BackendQueued"),
        "kubectl vkd explain: {plugin_text} {}",
        String::from_utf8_lossy(&plugin.stderr)
    );

    // A user who may not read the Pod may not explain it; one who may read
    // Pods in the namespace may, without any right on the node.
    let token = |sa: &str| -> Result<String> {
        c.kubectl(&["create", "serviceaccount", sa, "-n", &ns])?;
        Ok(c.kubectl(&["create", "token", sa, "-n", &ns])?
            .trim()
            .to_owned())
    };
    let nobody = token("nobody")?;
    let reader = token("reader")?;
    c.kubectl(&[
        "create",
        "role",
        "read-pods",
        "-n",
        &ns,
        "--verb=get",
        "--resource=pods",
    ])?;
    c.kubectl(&[
        "create",
        "rolebinding",
        "read-pods",
        "-n",
        &ns,
        "--role=read-pods",
        &format!("--serviceaccount={ns}:reader"),
    ])?;
    let kubeconfig = c.dir().join("kubeconfig-nobody");
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\nclusters: [{{name: c, cluster: {{server: 'https://{}', certificate-authority: '{}'}}}}]\n\
             users: [{{name: u, user: {{token: '{nobody}'}}}}]\ncontexts: [{{name: c, context: {{cluster: c, user: u}}}}]\ncurrent-context: c\n",
            apiserver_addr(c)?,
            c.env("VKD_E2E_CA")?
        ),
    )?;
    let refused = Command::new(VKD)
        .args(["explain", "pod", &format!("{ns}/two"), "--kubeconfig"])
        .arg(&kubeconfig)
        .output()?;
    let err = String::from_utf8_lossy(&refused.stderr);
    ensure!(
        !refused.status.success()
            && err.contains("refused")
            && err.contains("cannot get resource \"pods\""),
        "a user without get pods: {err}"
    );
    ensure!(refused.stdout.is_empty(), "it printed an answer anyway");
    // vkd's own endpoint checks too, with the caller's own token.
    let direct = |token: &str, path: &str| -> Result<(String, String)> {
        let out = Command::new("curl")
            .args(["-sk", "-o", "-", "-w", "\n%{http_code}", "-H"])
            .arg(format!("Authorization: Bearer {token}"))
            .arg(format!("https://127.0.0.1:{}{path}", vkd.kubelet_port))
            .output()?;
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let (body, code) = text.rsplit_once('\n').unwrap_or((&text, ""));
        Ok((code.to_owned(), body.to_owned()))
    };
    let pod_path = format!("/explain/pod/{ns}/two");
    let (code, body) = direct(&nobody, &pod_path)?;
    ensure!(
        code == "403" && body.contains("cannot get resource \\\"pods\\\" \\\"two\\\""),
        "{code} {body}"
    );
    let (code, body) = direct(&reader, &pod_path)?;
    ensure!(
        code == "200" && body.contains("\"pod_uid\""),
        "{code} {body}"
    );
    // The reader explains it with the CLI too: what it may not read (the
    // Node, the Events) is said, not fatal.
    let reader_config = c.dir().join("kubeconfig-reader");
    std::fs::write(
        &reader_config,
        std::fs::read_to_string(&kubeconfig)?.replace(&nobody, &reader),
    )?;
    let read = Command::new(VKD)
        .args(["explain", "pod", &format!("{ns}/two"), "--kubeconfig"])
        .arg(&reader_config)
        .arg("--kubelet")
        .arg(format!("https://127.0.0.1:{}", vkd.kubelet_port))
        .arg("--insecure-skip-tls-verify-kubelet")
        .output()?;
    let read_text = String::from_utf8_lossy(&read.stdout);
    ensure!(
        read.status.success()
            && read_text.contains("largest free slice is 1")
            && read_text.contains("cannot list resource \"events\""),
        "a Pod reader: {read_text} {}",
        String::from_utf8_lossy(&read.stderr)
    );
    let (code, _) = direct(&reader, "/explain/node")?;
    ensure!(code == "403", "a Pod reader explained the node: {code}");
    eprintln!("refused: {}", err.trim());
    c.kubectl(&["delete", "namespace", &ns, "--wait=true", "--timeout=60s"])?;
    drop(vkd);
    Ok(())
}

fn did_not_move(c: &Cluster) -> Result<()> {
    let ns = c.namespace("explain-stay")?;
    let proxy = Proxy::start(apiserver_addr(c)?)?;
    let kubeconfig = proxy.kubeconfig(c)?.display().to_string();
    let far = start(
        c,
        "vk-far",
        &[
            "--node-label",
            "vkd.io/e2e=stay",
            "--kubeconfig",
            &kubeconfig,
            // One replica without leader election: a replica that cannot
            // renew its leader lease stops serving altogether (it must not
            // act), and there would be no vkd to ask during the partition.
            "--leader-elect",
            "false",
        ],
    )?;
    // A Ready node beside it, so the zone is not in "full disruption" (when
    // more than 55% of the nodes are not Ready, nothing is tainted or evicted).
    let _near = start(c, "vk-near", &["--node-label", "vkd.io/e2e=near"])?;
    wait_for("vk-near Ready", Duration::from_secs(60), || {
        let n = c.kubectl_json(&["get", "node", "vk-near"])?;
        Ok(condition(&n, "Ready")
            .is_some_and(|c| c["status"] == "True")
            .then_some(()))
    })?;
    for n in items(&c.kubectl_json(&["get", "nodes"])?) {
        let name = str_at(&n, "metadata.name");
        if name != "vk-far" && name != "vk-near" {
            c.kubectl(&["delete", "node", name, "--wait=false"])?;
        }
    }
    c.apply(&format!(
        "apiVersion: apps/v1\nkind: Deployment\nmetadata: {{name: stay, namespace: {ns}}}\nspec:\n  replicas: 1\n  selector: {{matchLabels: {{app: stay}}}}\n  template:\n    metadata: {{labels: {{app: stay}}}}\n    spec:\n      nodeSelector: {{vkd.io/e2e: stay}}\n      tolerations:\n      - {{key: virtual-kubelet.io/provider, operator: Exists}}\n      - {{key: node.kubernetes.io/unreachable, operator: Exists, effect: NoExecute, tolerationSeconds: 600}}\n      containers: [{{name: main, image: example/app:1}}]\n"
    ))?;
    let name = wait_for("the stay Pod Ready", Duration::from_secs(60), || {
        let ps = items(&c.kubectl_json(&["get", "pods", "-n", &ns])?);
        Ok(ps
            .iter()
            .find(|p| running_and_ready(p))
            .map(|p| str_at(p, "metadata.name").to_owned()))
    })?;
    // Asked once before the partition: vkd authorizes the admin then, and
    // keeps that answer for 5 minutes, as the kubelet's webhook authorizer
    // does; during the partition it cannot ask the API server.
    let before = explain_json(c, &["pod", &format!("{ns}/{name}")])?;
    ensure!(
        before["movement"].as_array().is_some_and(Vec::is_empty) && !before["vkd"].is_null(),
        "a Ready node: {before:#}"
    );
    proxy.cut();
    let cut = Instant::now();
    wait_for(
        "vk-far tainted unreachable",
        Duration::from_secs(90),
        || {
            let n = c.kubectl_json(&["get", "node", "vk-far"])?;
            let tainted = at(&n, "spec.taints").as_array().is_some_and(|ts| {
                ts.iter().any(|t| {
                    t["key"] == "node.kubernetes.io/unreachable" && t["effect"] == "NoExecute"
                })
            });
            Ok(tainted.then_some(()))
        },
    )?;
    let tainted_after = cut.elapsed();
    let answer = explain_json(c, &["pod", &format!("{ns}/{name}")]);
    let text = explain_text(c, &["pod", &format!("{ns}/{name}")]);
    proxy.heal();
    let (answer, text) = (answer?, text?);
    let p = pod(c, &ns, &name)?;
    ensure!(
        str_at(&p, "spec.nodeName") == "vk-far" && at(&p, "metadata.deletionTimestamp").is_null(),
        "the Pod moved or is being deleted: {p:#}"
    );
    ensure!(
        str_at(&answer, "node_ready").starts_with("Ready=Unknown"),
        "{answer:#}"
    );
    let taint = answer["taints"]
        .as_array()
        .and_then(|ts| {
            ts.iter()
                .find(|t| str_at(t, "taint").starts_with("node.kubernetes.io/unreachable"))
        })
        .cloned()
        .with_context(|| format!("no unreachable taint in {answer:#}"))?;
    ensure!(
        taint["toleration_seconds"] == 600 && taint["tolerated"] == true,
        "{taint:#}"
    );
    ensure!(
        str_at(&taint, "verdict").contains("tolerated for 600 s"),
        "{taint:#}"
    );
    let movement = answer["movement"].to_string();
    ensure!(
        movement.contains("partition policy keep") && movement.contains("stays bound"),
        "{movement}"
    );
    let vkd_side = &answer["vkd"];
    if vkd_side.is_null() {
        bail!("vkd did not answer: {answer:#}");
    }
    ensure!(vkd_side["partition"]["policy"] == "keep", "{answer:#}");
    ensure!(
        vkd_side["partition"]["lease_renewed_seconds_ago"].as_f64() > Some(10.0),
        "vkd says it renewed its lease recently while cut off: {answer:#}"
    );
    ensure!(
        !at(vkd_side, "instance").is_null(),
        "the instance is not running: {answer:#}"
    );
    ensure!(
        text.contains("Why it is (not) moving") && text.contains("tolerated for 600 s"),
        "{text}"
    );
    eprintln!(
        "--- (tainted {:.0}s after the cut) vkd explain pod {ns}/{name}\n{text}",
        tainted_after.as_secs_f64()
    );
    c.kubectl(&["delete", "namespace", &ns, "--wait=true", "--timeout=60s"])?;
    drop(far);
    Ok(())
}
