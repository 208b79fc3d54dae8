//! vkd on `--provider grpc` with `vkd-slurm` as its plugin, on a real Slurm
//! cluster (three slurmd with 4, 2 and 2 GPUs) and the suite's real control
//! plane: what a user sees through kubectl.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use anyhow::{Result, ensure};
use serde_json::Value;
use vkd_e2e::slurm::SlurmCluster;
use vkd_e2e::{Cluster, wait_for};

use crate::common::{Plugin, Vkd, items, running_and_ready, sibling_binary, str_at};

const NODE: &str = "vk-slurm";
const NS: &str = "e2e-slurm";

fn pod(name: &str, gpus: u32, script: &str) -> String {
    let limits = if gpus > 0 {
        format!("\n    resources: {{limits: {{nvidia.com/gpu: {gpus}}}}}")
    } else {
        String::new()
    };
    format!(
        "apiVersion: v1\nkind: Pod\nmetadata: {{name: {name}, namespace: {NS}}}\nspec:\n  \
         nodeSelector: {{vkd.io/e2e: slurm}}\n  \
         tolerations: [{{key: virtual-kubelet.io/provider, operator: Exists}}]\n  \
         terminationGracePeriodSeconds: 5\n  \
         containers:\n  - name: main\n    image: busybox\n    \
         command: [sh, -c, {script:?}]{limits}\n"
    )
}

fn get(c: &Cluster, name: &str) -> Result<Value> {
    c.kubectl_json(&["get", "pod", name, "-n", NS])
}

fn running(c: &Cluster, name: &str, secs: u64) -> Result<Value> {
    wait_for(
        &format!("{name} Running"),
        Duration::from_secs(secs),
        || {
            let p = get(c, name)?;
            Ok(running_and_ready(&p).then_some(p))
        },
    )
}

/// The Slurm jobs of this node's Pods, by job name (`vkd-<uid>`).
fn jobs(slurm: &SlurmCluster) -> Result<Vec<(u64, String, String)>> {
    Ok(slurm
        .jobs()?
        .into_iter()
        .filter(|(_, name, _, _)| name.starts_with("vkd-"))
        .map(|(id, name, state, _)| (id, name, state))
        .collect())
}

pub(crate) fn pods_run_as_slurm_jobs(c: &Cluster) -> Result<()> {
    let state = c.dir().join("slurm-plugin");
    let lua = vkd_slurm_lua(&state)?;
    let slurm = SlurmCluster::start(&c.dir().join("slurm"), &[4, 2, 2], Some(&lua))?;
    let socket = c.dir().join("slurm-plugin.sock");
    let mut plugin = Plugin::start(
        c,
        "vkd-slurm",
        sibling_binary("vkd-slurm")?,
        vec![
            "serve".into(),
            format!("--listen=unix://{}", socket.display()),
            format!("--state-dir={}", state.display()),
            format!("--slurm-conf={}", slurm.conf().display()),
            "--poll=500ms".into(),
            // The test cluster runs its jobs as the test's user, root here.
            "--jobs-as-root".into(),
        ],
        Vec::new(),
        socket.clone(),
    )?;
    let unused = vkd_e2e::repo_root().join("testdata/fleets/demo.yaml");
    let mut vkd = Vkd::start_provider(
        c,
        NODE,
        "grpc",
        &unused,
        &[
            "--provider-endpoint",
            &format!("unix://{}", socket.display()),
            "--node-label",
            "vkd.io/e2e=slurm",
            "--client-ca-file",
            c.env("VKD_E2E_KUBELET_CLIENT_CA")?,
        ],
    )?;
    let outcome = scenario(c, &slurm, &mut vkd, &mut plugin);
    if outcome.is_err() {
        eprintln!("{}", slurm.diagnostics());
    }
    outcome
}

fn vkd_slurm_lua(state: &std::path::Path) -> Result<String> {
    let out = std::process::Command::new(sibling_binary("vkd-slurm")?)
        .arg("job-submit-lua")
        .arg(format!("--state-dir={}", state.display()))
        .output()?;
    ensure!(out.status.success(), "vkd-slurm job-submit-lua: {out:?}");
    Ok(String::from_utf8(out.stdout)?)
}

fn scenario(c: &Cluster, slurm: &SlurmCluster, vkd: &mut Vkd, plugin: &mut Plugin) -> Result<()> {
    crate::ready_condition(c, NODE, "True")?;
    let node = c.kubectl_json(&["get", "node", NODE])?;
    ensure!(
        node["status"]["allocatable"]["nvidia.com/gpu"] == "8",
        "the Node's GPUs: {}",
        node["status"]["allocatable"]
    );
    c.namespace(NS)?;

    // Logs and exec reach the job.
    c.apply(&pod("hello", 0, "echo hello from slurm; exec sleep 600"))?;
    running(c, "hello", 60)?;
    let said = c.kubectl(&[
        "exec",
        "-n",
        NS,
        "hello",
        "--",
        "sh",
        "-c",
        "echo in job $SLURM_JOB_ID",
    ])?;
    ensure!(said.starts_with("in job "), "exec said {said:?}");
    let logs = wait_for("hello's log", Duration::from_secs(20), || {
        let l = c.kubectl(&["logs", "-n", NS, "hello"])?;
        Ok(l.contains("hello from slurm").then_some(l))
    })?;
    eprintln!("kubectl logs hello: {logs:?}; exec: {said:?}");

    // No node has 8 GPUs: the Pod fails in Slurm's words.
    c.apply(&pod("eight", 8, "true"))?;
    let eight = wait_for("eight Failed", Duration::from_secs(60), || {
        let p = get(c, "eight")?;
        Ok((str_at(&p, "status.phase") == "Failed").then_some(p))
    })?;
    ensure!(
        str_at(&eight, "status.reason") == "SlurmRejected"
            && str_at(&eight, "status.message")
                .contains("Requested node configuration is not available"),
        "eight: {}",
        eight["status"]
    );
    eprintln!(
        "eight: {} {}",
        str_at(&eight, "status.reason"),
        str_at(&eight, "status.message")
    );

    // Two 4-GPU Pods: the second waits in Slurm's queue with its reason, then runs.
    c.apply(&pod("four-a", 4, "exec sleep 600"))?;
    running(c, "four-a", 60)?;
    c.apply(&pod("four-b", 4, "echo four-b ran; exec sleep 600"))?;
    let queued = wait_for("four-b BackendQueued", Duration::from_secs(60), || {
        let p = get(c, "four-b")?;
        let waiting = &p["status"]["containerStatuses"][0]["state"]["waiting"];
        Ok((waiting["reason"] == "BackendQueued").then(|| waiting["message"].clone()))
    })?;
    ensure!(
        queued
            .as_str()
            .unwrap_or_default()
            .ends_with("is pending: Resources"),
        "four-b waits: {queued}"
    );
    eprintln!("four-b waiting: BackendQueued {queued}");
    let ended = Instant::now();
    c.kubectl(&["delete", "pod", "four-a", "-n", NS, "--wait=false"])?;
    running(c, "four-b", 90)?;
    eprintln!(
        "four-b ran {:.1}s after four-a's delete",
        ended.elapsed().as_secs_f64()
    );

    // vkd killed while it creates: one job per Pod, none left after.
    let burst: Vec<String> = (0..8).map(|i| format!("burst-{i}")).collect();
    let yaml: String = burst
        .iter()
        .map(|n| format!("---\n{}", pod(n, 0, "exec sleep 600")))
        .collect();
    c.apply(&yaml)?;
    std::thread::sleep(Duration::from_millis(1500));
    vkd.kill()?;
    vkd.spawn()?;
    for n in &burst {
        running(c, n, 90)?;
    }
    let uids: BTreeSet<String> = items(&c.kubectl_json(&["get", "pods", "-n", NS])?)
        .iter()
        .map(|p| format!("vkd-{}", str_at(p, "metadata.uid")))
        .collect();
    let live: Vec<String> = jobs(slurm)?
        .into_iter()
        .filter(|(_, _, state)| state == "RUNNING" || state == "PENDING")
        .map(|(_, name, _)| name)
        .collect();
    let distinct: BTreeSet<&String> = live.iter().collect();
    ensure!(
        distinct.len() == live.len() && live.iter().all(|j| uids.contains(j)),
        "jobs after the restart: {live:?} for Pods {uids:?}"
    );
    ensure!(
        live.len() == burst.len() + 2,
        "{} live jobs: {live:?}",
        live.len()
    );

    // The plugin dies: the Node says why, nothing is lost; back, it adopts all.
    let before = jobs(slurm)?;
    plugin.kill()?;
    let down = crate::ready_condition(c, NODE, "False")?;
    ensure!(
        down["reason"] == "ProviderPluginUnreachable",
        "with the plugin killed: {down}"
    );
    ensure!(
        running_and_ready(&get(c, "hello")?),
        "hello while the plugin is down"
    );
    plugin.spawn()?;
    crate::ready_condition(c, NODE, "True")?;
    running(c, "hello", 30)?;
    let after = jobs(slurm)?;
    ensure!(before == after, "jobs before {before:?}, after {after:?}");
    let said = c.kubectl(&["exec", "-n", NS, "hello", "--", "echo", "back"])?;
    ensure!(said.trim() == "back", "exec after the return: {said:?}");

    // Every Pod deleted: no job left.
    c.kubectl(&["delete", "namespace", NS, "--wait=true", "--timeout=90s"])?;
    wait_for("no jobs left", Duration::from_secs(30), || {
        let left = jobs(slurm)?
            .into_iter()
            .filter(|(_, _, s)| s != "COMPLETED" && s != "CANCELLED")
            .count();
        Ok((left == 0).then_some(()))
    })?;
    Ok(())
}
