//! End-to-end fault injection: vkd must never lose, leak or double-run an
//! instance. Real control plane, real kubectl, the sim backend's own records and
//! journal as the witness.

use std::process::{Command, ExitCode};
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context, Result, bail, ensure};
use serde_json::Value;
use vkd_e2e::{Cluster, Suite, at, condition, repo_root, wait_for};

mod common;
use common::{
    Proxy, Vkd, admin_get, apiserver_addr, assert_one_instance_per_pod, items, journal, metric,
    running_and_ready, str_at,
};

fn main() -> ExitCode {
    // A short node-monitor grace period, so a partition turns into evictions quickly.
    Suite::serial("fencing", &["--node-monitor-grace-period", "16s"]).run(&[
        (
            "sigkill_during_200_creates_leaves_one_instance_each",
            sigkill_rounds,
        ),
        (
            "failover_raises_the_epoch_and_refuses_the_old_one",
            failover,
        ),
        ("mass_orphaning_trips_the_brake", brake),
        (
            "apiserver_outage_keeps_instances_and_converges",
            apiserver_outage,
        ),
        (
            "partition_fence_stops_before_the_replacement_keep_survives",
            partition,
        ),
    ])
}

fn many() -> std::path::PathBuf {
    repo_root().join("testdata/fleets/many.yaml")
}

fn pods(c: &Cluster, ns: &str) -> Result<Vec<Value>> {
    Ok(items(&c.kubectl_json(&["get", "pods", "-n", ns])?))
}

fn deployment(
    ns: &str,
    name: &str,
    selector: &str,
    replicas: u32,
    extra_meta: &str,
    tolerations: &str,
) -> String {
    format!(
        r#"
apiVersion: apps/v1
kind: Deployment
metadata: {{name: {name}, namespace: {ns}}}
spec:
  replicas: {replicas}
  selector: {{matchLabels: {{app: {name}}}}}
  template:
    metadata: {{labels: {{app: {name}}}, annotations: {{{extra_meta}}}}}
    spec:
      nodeSelector: {{vkd.io/e2e: {selector}}}
      tolerations: [{{key: virtual-kubelet.io/provider, operator: Exists}}{tolerations}]
      containers:
      - {{name: main, image: example/app:1}}
"#
    )
}

fn random_ms(lo: u64, hi: u64) -> u64 {
    let nanos = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| u64::from(d.subsec_nanos()));
    lo + nanos % (hi - lo).max(1)
}

/// All `n` Pods of the namespace Running and Ready, and exactly one instance each.
fn converged(c: &Cluster, vkd: &Vkd, ns: &str, n: usize, within: Duration) -> Result<Vec<Value>> {
    let ps = wait_for(&format!("{n} Pods Ready"), within, || {
        let ps = pods(c, ns)?;
        let ready = ps.iter().filter(|p| running_and_ready(p)).count();
        Ok((ps.len() == n && ready == n).then_some(ps))
    })?;
    // The backend settles too: instances of Pods deleted meanwhile are gone.
    wait_for(
        "the backend to hold exactly the Pods",
        Duration::from_secs(30),
        || Ok(assert_one_instance_per_pod(vkd, &ps).is_ok().then_some(())),
    )?;
    assert_one_instance_per_pod(vkd, &ps)?;
    Ok(ps)
}

fn sigkill_rounds(c: &Cluster) -> Result<()> {
    let ns = c.namespace("fence-kill")?;
    let mut vkd = Vkd::start_provider(
        c,
        "vk-kill",
        "sim",
        &many(),
        &[
            "--node-label",
            "vkd.io/e2e=kill",
            "--kube-qps",
            "300",
            "--kube-burst",
            "600",
        ],
    )?;
    c.apply(&deployment(&ns, "burst", "kill", 0, "", ""))?;
    let mut figures = Vec::new();
    for round in 1..=10 {
        c.kubectl(&["scale", "deployment/burst", "-n", &ns, "--replicas=200"])?;
        // Most creates are under way in the first 2.5 s (200 Pods at ~100/s).
        let at_ms = random_ms(100, 2500);
        std::thread::sleep(Duration::from_millis(at_ms));
        let before = vkd.instances()?.len();
        vkd.kill()?;
        vkd.spawn()?;
        let started = Instant::now();
        converged(c, &vkd, &ns, 200, Duration::from_secs(120))
            .with_context(|| format!("round {round}: killed {at_ms} ms into the creates"))?;
        figures.push(format!(
            "round {round}: SIGKILL at +{at_ms}ms with {before} instances, 200/200 Ready and one instance each {:.1}s after restart",
            started.elapsed().as_secs_f64()
        ));
        c.kubectl(&["scale", "deployment/burst", "-n", &ns, "--replicas=0"])?;
        wait_for(
            "every Pod and instance gone",
            Duration::from_secs(120),
            || Ok((pods(c, &ns)?.is_empty() && vkd.instances()?.is_empty()).then_some(())),
        )?;
    }
    for f in &figures {
        eprintln!("{f}");
    }
    Ok(())
}

fn lease(c: &Cluster, node: &str) -> Result<(String, u64)> {
    let l = c.kubectl_json(&["get", "lease", &format!("vkd-{node}"), "-n", "vkd-system"])?;
    let epoch = at(&l, "metadata.annotations")
        .get("vkd.io/epoch")
        .and_then(Value::as_str)
        .and_then(|e| e.parse().ok())
        .unwrap_or(0);
    Ok((str_at(&l, "spec.holderIdentity").to_owned(), epoch))
}

fn signal(pid: u32, sig: &str) -> Result<()> {
    let st = Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()?;
    ensure!(st.success(), "kill {sig} {pid}");
    Ok(())
}

fn failover(c: &Cluster) -> Result<()> {
    let ns = c.namespace("fence-ha")?;
    let node = "vk-ha";
    let fleet = repo_root().join("testdata/fleets/demo.yaml");
    let replica = |id: &str| -> Result<Vkd> {
        Vkd::start_provider(
            c,
            node,
            "sim",
            &fleet,
            &[
                "--node-label",
                "vkd.io/e2e=ha",
                "--replica-id",
                id,
                "--leader-lease-duration",
                "6s",
            ],
        )
    };
    let mut a = replica("replica-a")?;
    wait_for("replica-a to lead", Duration::from_secs(60), || {
        Ok((lease(c, node)?.0 == "replica-a").then_some(()))
    })?;
    let b = replica("replica-b")?;
    wait_for("replica-b to be a standby", Duration::from_secs(30), || {
        let (code, body) = admin_get(&b, "/readyz").unwrap_or((0, String::new()));
        Ok((code == 503 && body.contains("standby")).then_some(()))
    })?;
    c.apply(&deployment(&ns, "ha", "ha", 3, "", ""))?;
    let before = converged(c, &a, &ns, 3, Duration::from_secs(60))?;
    let ids = |v: &Vkd| -> Result<Vec<String>> {
        let mut ids: Vec<String> = v
            .instances()?
            .iter()
            .map(|i| str_at(i, "instance").to_owned())
            .collect();
        ids.sort();
        Ok(ids)
    };
    let ids_before = ids(&a)?;
    let (_, epoch_a) = lease(c, node)?;

    // The active one dies; the standby takes over within the lease duration.
    a.kill()?;
    let killed = Instant::now();
    wait_for(
        "replica-b to take the lease",
        Duration::from_secs(30),
        || Ok((lease(c, node)?.0 == "replica-b").then_some(())),
    )?;
    let handover = killed.elapsed();
    let (_, epoch_b) = lease(c, node)?;
    ensure!(epoch_b > epoch_a, "epoch {epoch_a} -> {epoch_b}");
    ensure!(
        handover <= Duration::from_secs(6 + 2),
        "handover took {handover:?} with a 6s lease"
    );
    let after = converged(c, &b, &ns, 3, Duration::from_secs(60))?;
    ensure!(
        ids(&b)? == ids_before,
        "instances changed over the handover"
    );
    let uids = |ps: &[Value]| -> Vec<String> {
        let mut u: Vec<String> = ps
            .iter()
            .map(|p| str_at(p, "metadata.uid").to_owned())
            .collect();
        u.sort();
        u
    };
    ensure!(
        uids(&after) == uids(&before),
        "Pods were replaced over the handover"
    );

    // A call the old leader might still have in flight is refused by the backend.
    let sim = vkd_sim::SimProvider::open(vkd_sim::Fleet::load(&fleet)?, &b.state_dir.join("sim"))?;
    let victim = str_at(&after[0], "metadata.uid").to_owned();
    let old = vkd_provider::Fence {
        node: node.into(),
        epoch: epoch_a,
    };
    let replay = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?
        .block_on(<vkd_sim::SimProvider as vkd_provider::Provider>::delete(
            &sim,
            &old,
            &victim,
            Duration::ZERO,
        ));
    match replay {
        Err(vkd_provider::ProviderError::Fenced { current, got, .. }) => {
            ensure!(
                current == epoch_b && got == epoch_a,
                "fenced at {current}, got {got}"
            );
        }
        other => bail!("a delete at the old epoch {epoch_a} was not refused: {other:?}"),
    }
    drop(sim);
    ensure!(
        ids(&b)? == ids_before,
        "the replayed delete removed something"
    );

    // A leader that is paused past its lease comes back as a standby and acts no more.
    a.spawn()?;
    std::thread::sleep(Duration::from_secs(2));
    let b_pid = b.pid().context("replica-b not running")?;
    signal(b_pid, "-STOP")?;
    let paused = Instant::now();
    let takeover = wait_for(
        "replica-a to take over from the paused leader",
        Duration::from_secs(30),
        || Ok((lease(c, node)?.0 == "replica-a").then_some(paused.elapsed())),
    );
    signal(b_pid, "-CONT")?;
    let takeover = takeover?;
    wait_for("replica-b to step down", Duration::from_secs(30), || {
        let (code, body) = admin_get(&b, "/readyz").unwrap_or((0, String::new()));
        Ok((code == 503 && body.contains("standby")).then_some(()))
    })?;
    let (_, m) = admin_get(&b, "/metrics")?;
    ensure!(
        metric(&m, "vkd_leader") == Some(0.0),
        "replica-b still leads: {m}"
    );
    let (_, epoch_a2) = lease(c, node)?;
    ensure!(epoch_a2 > epoch_b);
    converged(c, &a, &ns, 3, Duration::from_secs(60))?;
    ensure!(
        ids(&a)? == ids_before,
        "instances changed over the second handover"
    );
    eprintln!(
        "failover: SIGKILL handover {:.1}s (lease 6s), epoch {epoch_a} -> {epoch_b}; old-epoch delete refused; \
         paused leader replaced after {:.1}s, epoch -> {epoch_a2}, stepped down on resume; instances unchanged: {ids_before:?}",
        handover.as_secs_f64(),
        takeover.as_secs_f64()
    );
    c.kubectl(&["delete", "namespace", &ns, "--wait=true", "--timeout=60s"])?;
    Ok(())
}

fn brake(c: &Cluster) -> Result<()> {
    let ns = c.namespace("fence-brake")?;
    let mut vkd = Vkd::start_provider(
        c,
        "vk-brake",
        "sim",
        &many(),
        &["--node-label", "vkd.io/e2e=brake"],
    )?;
    for i in 0..12 {
        c.apply(&format!(
            "apiVersion: v1\nkind: Pod\nmetadata: {{name: p{i}, namespace: {ns}}}\nspec:\n  nodeSelector: {{vkd.io/e2e: brake}}\n  tolerations: [{{key: virtual-kubelet.io/provider, operator: Exists}}]\n  containers: [{{name: main, image: example/app:1}}]\n"
        ))?;
    }
    converged(c, &vkd, &ns, 12, Duration::from_secs(60))?;
    vkd.kill()?;
    // While vkd is down every Pod disappears: the Pod list looks empty.
    c.kubectl(&[
        "delete",
        "pods",
        "--all",
        "-n",
        &ns,
        "--grace-period=0",
        "--force",
    ])?;
    vkd.spawn()?;
    let ev = wait_for(
        "an OrphanDeletionBraked Event",
        Duration::from_secs(60),
        || {
            let ev = c.kubectl_json(&[
                "get",
                "events",
                "-n",
                "default",
                "--field-selector",
                "reason=OrphanDeletionBraked",
            ])?;
            Ok(items(&ev).into_iter().find(|e| {
                str_at(e, "regarding.name") == "vk-brake"
                    || str_at(e, "involvedObject.name") == "vk-brake"
            }))
        },
    )?;
    std::thread::sleep(Duration::from_secs(2));
    ensure!(
        vkd.instances()?.len() == 12,
        "the brake let instances go: {}",
        vkd.instances()?.len()
    );
    let (_, m) = admin_get(&vkd, "/metrics")?;
    ensure!(
        metric(&m, "vkd_gc_braked_total").is_some_and(|v| v >= 1.0),
        "{m}"
    );
    let note = str_at(&ev, "note").to_owned() + str_at(&ev, "message");
    ensure!(note.contains("12 of 12 instances"), "{note}");
    // With the override, they go.
    vkd.kill()?;
    vkd.args
        .extend(["--gc-allow-mass-delete".into(), "true".into()]);
    vkd.spawn()?;
    wait_for("the orphans to be removed", Duration::from_secs(60), || {
        Ok(vkd.instances()?.is_empty().then_some(()))
    })?;
    let (_, m) = admin_get(&vkd, "/metrics")?;
    ensure!(metric(&m, "vkd_orphans_removed_total") == Some(12.0), "{m}");
    eprintln!(
        "brake: 12 of 12 orphaned instances kept, Event: {note}; removed with --gc-allow-mass-delete"
    );
    Ok(())
}

fn apiserver_pid(c: &Cluster) -> Result<u32> {
    Ok(
        std::fs::read_to_string(c.dir().join("pids/kube-apiserver.pid"))?
            .trim()
            .parse()?,
    )
}

fn apiserver_outage(c: &Cluster) -> Result<()> {
    let ns = c.namespace("fence-outage")?;
    let vkd = Vkd::start_provider(
        c,
        "vk-outage",
        "sim",
        &many(),
        &["--node-label", "vkd.io/e2e=outage"],
    )?;
    c.apply(&deployment(&ns, "steady", "outage", 3, "", ""))?;
    c.apply(&format!(
        "apiVersion: v1\nkind: Pod\nmetadata: {{name: finisher, namespace: {ns}, annotations: {{sim.vkd.io/behavior: exit, sim.vkd.io/run-for: 25s}}}}\nspec:\n  restartPolicy: Never\n  nodeSelector: {{vkd.io/e2e: outage}}\n  tolerations: [{{key: virtual-kubelet.io/provider, operator: Exists}}]\n  containers: [{{name: main, image: example/app:1}}]\n"
    ))?;
    converged(c, &vkd, &ns, 4, Duration::from_secs(60))?;
    let ids = || -> Result<Vec<String>> {
        let mut v: Vec<String> = vkd
            .instances()?
            .iter()
            .map(|i| str_at(i, "instance").to_owned())
            .collect();
        v.sort();
        Ok(v)
    };
    let before = ids()?;
    let pid = apiserver_pid(c)?;
    signal(pid, "-STOP")?;
    let outage = (|| -> Result<()> {
        for _ in 0..6 {
            std::thread::sleep(Duration::from_secs(10));
            ensure!(
                ids()? == before,
                "instances changed during the outage: {:?}",
                ids()?
            );
        }
        Ok(())
    })();
    signal(pid, "-CONT")?;
    outage?;
    let back = Instant::now();
    wait_for("statuses to converge", Duration::from_secs(30), || {
        let ps = pods(c, &ns)?;
        let steady = ps
            .iter()
            .filter(|p| str_at(p, "metadata.name").starts_with("steady") && running_and_ready(p))
            .count();
        let finished = ps.iter().any(|p| {
            str_at(p, "metadata.name") == "finisher" && at(p, "status.phase") == "Succeeded"
        });
        Ok((steady == 3 && finished).then_some(()))
    })?;
    let converge = back.elapsed();
    ensure!(ids()? == before, "instances changed after the outage");
    eprintln!(
        "apiserver outage: 60s frozen, {} instances kept, statuses (finisher Succeeded meanwhile) converged {:.1}s after it returned",
        before.len(),
        converge.as_secs_f64()
    );
    c.kubectl(&["delete", "namespace", &ns, "--wait=true", "--timeout=60s"])?;
    Ok(())
}

fn partition(c: &Cluster) -> Result<()> {
    let ns = c.namespace("fence-part")?;
    let proxy = Proxy::start(apiserver_addr(c)?)?;
    let kubeconfig = proxy.kubeconfig(c)?.display().to_string();
    let far = Vkd::start_provider(
        c,
        "vk-far",
        "sim",
        &many(),
        &[
            "--node-label",
            "vkd.io/e2e=part",
            "--kubeconfig",
            &kubeconfig,
            "--leader-election-namespace",
            "vkd-system",
            "--leader-lease-duration",
            "6s",
        ],
    )?;
    // Evicted 5 s after the node is seen unreachable.
    let tolerate = ", {key: node.kubernetes.io/unreachable, operator: Exists, effect: NoExecute, tolerationSeconds: 5}, {key: node.kubernetes.io/not-ready, operator: Exists, effect: NoExecute, tolerationSeconds: 5}";
    c.apply(&deployment(
        &ns,
        "fenced",
        "part",
        1,
        "vkd.io/partition-policy: fence",
        tolerate,
    ))?;
    c.apply(&deployment(&ns, "kept", "part", 1, "", tolerate))?;
    let old = converged(c, &far, &ns, 2, Duration::from_secs(60))?;
    let uid_of = |ps: &[Value], app: &str| -> String {
        ps.iter()
            .find(|p| str_at(p, "metadata.name").starts_with(app))
            .map(|p| str_at(p, "metadata.uid").to_owned())
            .unwrap_or_default()
    };
    let (old_fenced, old_kept) = (uid_of(&old, "fenced"), uid_of(&old, "kept"));
    // A second node, reachable, for the replacements.
    let near = Vkd::start_provider(
        c,
        "vk-near",
        "sim",
        &many(),
        &["--node-label", "vkd.io/e2e=part"],
    )?;
    wait_for("vk-near Ready", Duration::from_secs(60), || {
        let n = c.kubectl_json(&["get", "node", "vk-near"])?;
        Ok(condition(&n, "Ready")
            .is_some_and(|c| c["status"] == "True")
            .then_some(()))
    })?;
    // The node lifecycle controller stops evicting in a zone where more than 55%
    // of the nodes are unready (a "full disruption"): the Nodes earlier tests left
    // behind, whose daemons are gone, must not count.
    for n in items(&c.kubectl_json(&["get", "nodes"])?) {
        let name = str_at(&n, "metadata.name");
        if name != "vk-far" && name != "vk-near" {
            c.kubectl(&["delete", "node", name, "--wait=false"])?;
        }
    }
    proxy.cut();
    let cut_at = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)?
        .as_millis() as u64;
    // The control plane replaces both on vk-near.
    let replaced = wait_for(
        "both replacements Ready on vk-near",
        Duration::from_secs(90),
        || {
            let ps = pods(c, &ns)?;
            let on_near: Vec<Value> = ps
                .into_iter()
                .filter(|p| str_at(p, "spec.nodeName") == "vk-near" && running_and_ready(p))
                .collect();
            Ok((on_near.len() == 2).then_some(on_near))
        },
    )?;
    let (new_fenced, new_kept) = (uid_of(&replaced, "fenced"), uid_of(&replaced, "kept"));
    let far_log = journal(&far)?;
    let near_log = journal(&near)?;
    let when = |log: &[(String, String, u64)], event: &str, uid: &str| {
        log.iter()
            .find(|(e, u, _)| e == event && u == uid)
            .map(|(_, _, t)| *t)
    };
    let stopped =
        when(&far_log, "stopped", &old_fenced).context("the fenced instance was not stopped")?;
    let started = when(&near_log, "created", &new_fenced).context("no replacement instance")?;
    ensure!(
        stopped < started,
        "old instance stopped at {stopped}, replacement created at {started}"
    );
    ensure!(
        when(&far_log, "stopped", &old_kept).is_none(),
        "the keep-policy instance was stopped during the partition"
    );
    ensure!(
        far.instances()?
            .iter()
            .any(|i| str_at(i, "podUID") == old_kept),
        "the keep-policy instance is gone during the partition"
    );
    // Heal: the old keep-policy instance is cleaned up, the replacements stay.
    proxy.heal();
    let healed = Instant::now();
    wait_for(
        "the old kept instance to be removed after the heal",
        Duration::from_secs(90),
        || {
            Ok((!far
                .instances()?
                .iter()
                .any(|i| str_at(i, "podUID") == old_kept))
            .then_some(()))
        },
    )?;
    let cleaned = healed.elapsed();
    // The old Pod's object goes a moment after its instance: vk-far
    // finalizes it once the instance is gone.
    let settled = wait_for("the 2 replacements alone", Duration::from_secs(30), || {
        let ps = pods(c, &ns)?;
        Ok((ps.len() == 2 && ps.iter().all(running_and_ready)).then_some(()))
    });
    ensure!(
        settled.is_ok(),
        "after the heal: {} Pods",
        pods(c, &ns)?.len()
    );
    ensure!(
        far.instances()?.is_empty(),
        "vk-far still runs {:?}",
        far.instances()?
    );
    ensure!(near.instances()?.len() == 2);
    let _ = new_kept;
    eprintln!(
        "partition: fence policy stopped the old instance {:.1}s after the cut, {:.1}s before its replacement was created on vk-near; \
         keep policy instance survived the partition and was removed {:.1}s after the heal",
        (stopped.saturating_sub(cut_at)) as f64 / 1000.0,
        (started - stopped) as f64 / 1000.0,
        cleaned.as_secs_f64()
    );
    c.kubectl(&["delete", "namespace", &ns, "--wait=true", "--timeout=60s"])?;
    Ok(())
}
