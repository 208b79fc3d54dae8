//! End-to-end: the deployment manifests apply to the real API server, and vkd
//! does its job with nothing but the manifests' ServiceAccount and RBAC.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use serde_json::Value;
use vkd_e2e::{Cluster, Suite, at, repo_root, wait_for};

mod common;
use common::{Vkd, apiserver_addr, running_and_ready, str_at};

fn main() -> ExitCode {
    Suite::serial("manifests", &[]).run(&[
        ("manifests_apply_server_dry_run_then_for_real", apply),
        (
            "vkd_works_under_the_service_account_alone",
            under_service_account,
        ),
        ("a_removed_rule_fails_the_named_operation", removed_rule),
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

/// A kubeconfig holding only a token of the manifests' ServiceAccount, minted
/// through TokenRequest.
fn service_account_kubeconfig(c: &Cluster) -> Result<String> {
    let token = c.kubectl(&[
        "create",
        "token",
        "vkd",
        "-n",
        "vkd-system",
        "--duration=2h",
    ])?;
    let path = c.dir().join("kubeconfig-vkd-sa");
    std::fs::write(
        &path,
        format!(
            "apiVersion: v1\nkind: Config\nclusters: [{{name: c, cluster: {{server: 'https://{}', certificate-authority: '{}'}}}}]\n\
             users: [{{name: vkd, user: {{token: '{}'}}}}]\ncontexts: [{{name: c, context: {{cluster: c, user: vkd}}}}]\ncurrent-context: c\n",
            apiserver_addr(c)?,
            c.env("VKD_E2E_CA")?,
            token.trim()
        ),
    )?;
    Ok(path.display().to_string())
}

fn start(c: &Cluster, node: &str, label: &str) -> Result<Vkd> {
    let kubeconfig = service_account_kubeconfig(c)?;
    Vkd::start_process(
        c,
        node,
        &[
            "--kubeconfig",
            &kubeconfig,
            "--leader-election-namespace",
            "vkd-system",
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
    // Events: a Pod that cannot run fails with an Event.
    c.apply(&pod(&ns, "unrunnable", "sa", "nginx:1.27"))?;
    wait_for("the failure Event", Duration::from_secs(60), || {
        let ev = c.kubectl_json(&[
            "get",
            "events",
            "-n",
            &ns,
            "--field-selector",
            "involvedObject.name=unrunnable,reason=ImageNotRunnable",
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
