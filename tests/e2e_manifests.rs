//! End-to-end: the deployment manifests apply to the real API server, and vkd
//! does its job with nothing but the manifests' ServiceAccount and RBAC.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use serde_json::Value;
use vkd_e2e::{Cluster, Suite, at, repo_root, wait_for};

mod common;
use common::{Vkd, admin_get, items, running_and_ready, str_at};

fn main() -> ExitCode {
    Suite::serial("manifests", &[]).run(&[
        ("manifests_apply_server_dry_run_then_for_real", apply),
        (
            "vkd_works_under_the_service_account_alone",
            under_service_account,
        ),
        ("a_removed_rule_fails_the_named_operation", removed_rule),
        ("metrics_parse_move_and_feed_the_dashboard", observability),
    ])
}

fn base() -> String {
    repo_root().join("manifests/base").display().to_string()
}

fn apply(c: &Cluster) -> Result<()> {
    // A server-side dry run cannot place objects in a namespace that does not
    // exist yet, so the Namespace goes first, for real.
    let ns = repo_root().join("manifests/base/namespace.yaml");
    c.kubectl(&["apply", "--server-side", "-f", &ns.display().to_string()])?;
    let dry = c.kubectl(&["apply", "--server-side", "--dry-run=server", "-k", &base()])?;
    ensure!(dry.contains("serverside-applied (server dry run)"), "{dry}");
    ensure!(
        c.kubectl_json(&["get", "clusterrole", "vkd"]).is_err(),
        "the dry run created objects"
    );
    applied(c)?;
    for (kind, name, ns) in [
        ("namespace", "vkd-system", ""),
        ("serviceaccount", "vkd", "vkd-system"),
        ("clusterrole", "vkd", ""),
        ("clusterrolebinding", "vkd", ""),
        ("role", "vkd-node-lease", "kube-node-lease"),
        ("role", "vkd-leader", "vkd-system"),
        ("deployment", "vkd", "vkd-system"),
        ("service", "vkd", "vkd-system"),
        ("configmap", "vkd-provider", "vkd-system"),
        ("flowschema", "vkd-heartbeats", ""),
    ] {
        let mut args = vec!["get", kind, name];
        if !ns.is_empty() {
            args.extend(["-n", ns]);
        }
        c.kubectl_json(&args)
            .with_context(|| format!("{kind} {name} was not created"))?;
    }
    let d = c.kubectl_json(&["get", "deployment", "vkd", "-n", "vkd-system"])?;
    ensure!(at(&d, "spec.replicas") == 2);
    Ok(())
}

fn applied(c: &Cluster) -> Result<()> {
    c.kubectl(&["apply", "--server-side", "--force-conflicts", "-k", &base()])?;
    Ok(())
}

/// vkd on the process provider; the e2e helper gives it the ServiceAccount's
/// token kubeconfig (`common::service_account_kubeconfig`).
fn start(c: &Cluster, node: &str, label: &str) -> Result<Vkd> {
    Vkd::start_process(
        c,
        node,
        &[
            "--node-label",
            label,
            "--client-ca-file",
            c.env("VKD_E2E_KUBELET_CLIENT_CA")?,
        ],
    )
}

fn pod(ns: &str, name: &str, selector: &str, image: &str) -> String {
    format!(
        r#"
apiVersion: v1
kind: Pod
metadata: {{name: {name}, namespace: {ns}}}
spec:
  nodeSelector: {{vkd.io/e2e: {selector}}}
  tolerations: [{{key: virtual-kubelet.io/provider, operator: Exists}}]
  containers:
  - name: main
    image: {image}
    command: [sh, -c, "echo started as $GREETING; sleep 3600"]
    env:
    - {{name: GREETING, valueFrom: {{configMapKeyRef: {{name: greeting, key: text}}}}}}
    - {{name: PASSWORD, valueFrom: {{secretKeyRef: {{name: password, key: value}}}}}}
"#
    )
}

fn under_service_account(c: &Cluster) -> Result<()> {
    applied(c)?;
    let vkd = start(c, "vk-sa", "vkd.io/e2e=sa")?;
    let ns = c.namespace("sa-run")?;
    c.kubectl(&[
        "create",
        "configmap",
        "greeting",
        "-n",
        &ns,
        "--from-literal=text=configmap-value",
    ])?;
    c.kubectl(&[
        "create",
        "secret",
        "generic",
        "password",
        "-n",
        &ns,
        "--from-literal=value=s3cret",
    ])?;
    // Node registration and heartbeat, leader Lease, Pod watch and status, env
    // from a ConfigMap and a Secret, the ServiceAccount token volume (TokenRequest).
    c.apply(&pod(&ns, "works", "sa", "busybox"))?;
    let p = wait_for(
        "the Pod Ready under the ServiceAccount",
        Duration::from_secs(60),
        || {
            let p = c.kubectl_json(&["get", "pod", "works", "-n", &ns])?;
            Ok(running_and_ready(&p).then_some(p))
        },
    )?;
    let lease = c.kubectl_json(&["get", "lease", "vkd-vk-sa", "-n", "vkd-system"])?;
    ensure!(!str_at(&lease, "spec.holderIdentity").is_empty());
    // The kubelet API: logs and exec through the apiserver (TokenReview/SAR are not
    // used for the apiserver's client certificate, but the calls go through vkd).
    let logs = c.kubectl(&["logs", "works", "-n", &ns])?;
    ensure!(logs.contains("started as configmap-value"), "{logs}");
    let out = c.kubectl(&[
        "exec",
        "works",
        "-n",
        &ns,
        "--",
        "sh",
        "-c",
        "echo $PASSWORD; wc -c < $VKD_POD_ROOT/var/run/secrets/kubernetes.io/serviceaccount/token",
    ])?;
    let mut lines = out.lines();
    ensure!(lines.next() == Some("s3cret"), "{out}");
    let token_len: usize = lines.next().unwrap_or("0").trim().parse()?;
    ensure!(
        token_len > 100,
        "no ServiceAccount token in the volume: {out}"
    );
    // Events: a Pod whose image cannot run gets the kubelet's Warning, found
    // as a kubelet's Events are.
    c.apply(&pod(&ns, "unrunnable", "sa", "nginx:1.27"))?;
    wait_for("the failure Event", Duration::from_secs(60), || {
        let ev = c.kubectl_json(&[
            "get",
            "events",
            "-n",
            &ns,
            "--field-selector",
            "involvedObject.name=unrunnable,reason=Failed,source=kubelet,type=Warning",
        ])?;
        Ok((!common::items(&ev).is_empty()).then_some(()))
    })?;
    // Deletion: finalized only by vkd.
    c.kubectl(&[
        "delete",
        "pod",
        "works",
        "unrunnable",
        "-n",
        &ns,
        "--wait=true",
        "--timeout=60s",
    ])?;
    let log = std::fs::read_to_string(&vkd.log)?;
    ensure!(
        !log.contains("forbidden"),
        "vkd hit a forbidden call: {}",
        forbidden_lines(&log)
    );
    eprintln!(
        "service account: Pod {} Ready, logs, exec, env and token volume, Events and deletion all worked with the manifests' RBAC",
        str_at(&p, "metadata.name")
    );
    vkd.reap_processes();
    Ok(())
}

fn forbidden_lines(log: &str) -> String {
    log.lines()
        .filter(|l| l.contains("forbidden"))
        .take(3)
        .collect::<Vec<_>>()
        .join("\n")
}

fn removed_rule(c: &Cluster) -> Result<()> {
    applied(c)?;
    let role = c.kubectl_json(&["get", "clusterrole", "vkd"])?;
    let index = at(&role, "rules")
        .as_array()
        .and_then(|rules| {
            rules.iter().position(|r| {
                r["resources"]
                    .as_array()
                    .is_some_and(|rs| rs.iter().any(|x| x == "pods/status"))
            })
        })
        .context("no pods/status rule")?;
    c.kubectl(&[
        "patch",
        "clusterrole",
        "vkd",
        "--type=json",
        "-p",
        &format!(r#"[{{"op": "remove", "path": "/rules/{index}"}}]"#),
    ])?;
    let result = (|| -> Result<()> {
        let vkd = start(c, "vk-norule", "vkd.io/e2e=norule")?;
        let ns = c.namespace("sa-norule")?;
        c.kubectl(&[
            "create",
            "configmap",
            "greeting",
            "-n",
            &ns,
            "--from-literal=text=x",
        ])?;
        c.kubectl(&[
            "create",
            "secret",
            "generic",
            "password",
            "-n",
            &ns,
            "--from-literal=value=y",
        ])?;
        c.apply(&pod(&ns, "stuck", "norule", "busybox"))?;
        let line = wait_for(
            "vkd to report the forbidden status write",
            Duration::from_secs(60),
            || {
                let log = std::fs::read_to_string(&vkd.log)?;
                Ok(log
                    .lines()
                    .find(|l| l.contains("forbidden") && l.contains("pods/status"))
                    .map(str::to_owned))
            },
        )?;
        ensure!(
            line.contains("system:serviceaccount:vkd-system:vkd") && line.contains("patch"),
            "{line}"
        );
        let p = c.kubectl_json(&["get", "pod", "stuck", "-n", &ns])?;
        ensure!(
            at(&p, "status.phase") == "Pending"
                && at(&p, "status.containerStatuses") == &Value::Null,
            "status was written: {}",
            at(&p, "status")
        );
        eprintln!("removed rule: {}", line.trim());
        vkd.reap_processes();
        Ok(())
    })();
    applied(c)?;
    result
}

fn scrape(vkd: &Vkd) -> Result<(String, prometheus_parse::Scrape)> {
    let (code, body) = admin_get(vkd, "/metrics")?;
    ensure!(code == 200, "/metrics answered {code}");
    let lines = body.lines().map(|l| Ok(l.to_owned()));
    let parsed = prometheus_parse::Scrape::parse(lines).context("the metrics do not parse")?;
    Ok((body, parsed))
}

fn sample(s: &prometheus_parse::Scrape, name: &str, label: Option<(&str, &str)>) -> f64 {
    s.samples
        .iter()
        .filter(|x| x.metric == name)
        .filter(|x| label.is_none_or(|(k, v)| x.labels.get(k) == Some(v)))
        .map(|x| match x.value {
            prometheus_parse::Value::Counter(v)
            | prometheus_parse::Value::Gauge(v)
            | prometheus_parse::Value::Untyped(v) => v,
            prometheus_parse::Value::Histogram(ref h) => {
                h.iter().map(|b| b.count).fold(0.0, f64::max)
            }
            _ => 0.0,
        })
        .sum()
}

fn observability(c: &Cluster) -> Result<()> {
    let vkd = Vkd::start(c, "vk-obs", &["--node-label", "vkd.io/e2e=obs"])?;
    let ns = c.namespace("obs")?;
    wait_for("the Node", Duration::from_secs(60), || {
        Ok(c.kubectl_json(&["get", "node", "vk-obs"])
            .is_ok()
            .then_some(()))
    })?;
    let (_, before) = scrape(&vkd)?;
    let writes_before = sample(&before, "vkd_api_writes_total", Some(("kind", "status")));
    for i in 0..3 {
        c.apply(&format!(
            "apiVersion: v1\nkind: Pod\nmetadata: {{name: o{i}, namespace: {ns}}}\nspec:\n  nodeSelector: {{vkd.io/e2e: obs}}\n  tolerations: [{{key: virtual-kubelet.io/provider, operator: Exists}}]\n  containers: [{{name: main, image: example/app:1}}]\n"
        ))?;
    }
    let ps = wait_for("3 Pods Ready", Duration::from_secs(60), || {
        let ps = items(&c.kubectl_json(&["get", "pods", "-n", &ns])?);
        Ok((ps.len() == 3 && ps.iter().all(running_and_ready)).then_some(ps))
    })?;
    // The timeline annotation has every stage, in order.
    for p in &ps {
        let t = at(p, "metadata.annotations")["vkd.io/timeline"]
            .as_str()
            .unwrap_or_default()
            .to_owned();
        let stages: Vec<(&str, u64)> = t
            .split_whitespace()
            .skip(1)
            .filter_map(|kv| {
                let (k, v) = kv.split_once("=+")?;
                Some((k, v.strip_suffix("ms")?.parse().ok()?))
            })
            .collect();
        let names: Vec<&str> = stages.iter().map(|(k, _)| *k).collect();
        ensure!(t.starts_with("bound="), "{t}");
        ensure!(
            names == ["observed", "admitted", "accepted", "started", "ready"],
            "{t}"
        );
        ensure!(
            stages.windows(2).all(|w| w[0].1 <= w[1].1),
            "stages out of order: {t}"
        );
    }
    let (_, after) = wait_for(
        "the gauges to show 3 running",
        Duration::from_secs(30),
        || {
            let (body, s) = scrape(&vkd)?;
            let ok = sample(&s, "vkd_pods", Some(("phase", "Running"))) == 3.0
                && sample(&s, "vkd_backend_instances", Some(("phase", "Running"))) == 3.0;
            Ok(ok.then_some((body, s)))
        },
    )?;
    ensure!(
        sample(&after, "vkd_api_writes_total", Some(("kind", "status"))) >= writes_before + 3.0
    );
    ensure!(
        sample(
            &after,
            "vkd_startup_stage_seconds_count",
            Some(("stage", "ready"))
        ) >= 3.0
    );
    ensure!(
        sample(
            &after,
            "vkd_provider_call_duration_seconds_count",
            Some(("operation", "create"))
        ) >= 3.0
    );
    ensure!(sample(&after, "vkd_leader", None) == 1.0);
    c.kubectl(&[
        "delete",
        "pods",
        "--all",
        "-n",
        &ns,
        "--wait=true",
        "--timeout=60s",
    ])?;
    let (body, gone) = scrape(&vkd)?;
    ensure!(sample(&gone, "vkd_api_writes_total", Some(("kind", "delete"))) >= 3.0);
    ensure!(sample(&gone, "vkd_backend_instances", Some(("phase", "Running"))) == 0.0);
    // One Event per Pod on the happy path, naming the backend, host and instance
    // (a step-per-Event design would cost three writes per Pod).
    let ev = items(&c.kubectl_json(&["get", "events", "-n", &ns])?);
    let created: Vec<&Value> = ev
        .iter()
        .filter(|e| str_at(e, "reason") == "InstanceCreated")
        .collect();
    ensure!(!created.is_empty(), "no InstanceCreated Event");
    for e in &created {
        let note = str_at(e, "message");
        ensure!(
            note.contains("backend sim admitted it and created instance sim-")
                && note.contains("on host"),
            "InstanceCreated Event says too little: {note}"
        );
    }
    ensure!(
        !ev.iter()
            .any(|e| ["Admitted", "InstanceDeleted"].contains(&str_at(e, "reason"))),
        "per-step Events are back: each costs a write per Pod"
    );
    // The dashboard asks only for metrics that exist (kube-state-metrics' aside).
    let dash = std::fs::read_to_string(repo_root().join("manifests/grafana/vkd-dashboard.json"))?;
    let dash: Value = serde_json::from_str(&dash)?;
    let mut names = std::collections::BTreeSet::new();
    for p in at(&dash, "panels").as_array().into_iter().flatten() {
        for t in p["targets"].as_array().into_iter().flatten() {
            let expr = t["expr"].as_str().unwrap_or_default();
            for word in expr.split(|ch: char| !(ch.is_ascii_alphanumeric() || ch == '_')) {
                if word.starts_with("vkd_") {
                    names.insert(word.to_owned());
                }
            }
        }
    }
    ensure!(names.len() >= 10, "{names:?}");
    for n in &names {
        let base = ["_bucket", "_count", "_sum"]
            .iter()
            .fold(n.as_str(), |acc, s| acc.strip_suffix(s).unwrap_or(acc));
        ensure!(
            body.lines()
                .any(|l| l.starts_with(&format!("# TYPE {base} "))
                    || l.starts_with(&format!(
                        "# TYPE {} ",
                        base.strip_suffix("_total").unwrap_or(base)
                    ))),
            "the dashboard uses {n}, which vkd does not export"
        );
    }
    eprintln!(
        "observability: /metrics parses ({} samples), counters moved, timeline in order, Events present, dashboard uses {} existing metrics",
        after.samples.len(),
        names.len()
    );
    Ok(())
}
