//! Shared by the e2e suites: a vkd process per test and JSON helpers.
#![allow(dead_code, unreachable_pub)]

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

use anyhow::{Context, Result, ensure};
use serde_json::Value;
use vkd_e2e::{Cluster, at, condition, repo_root};

pub const VKD: &str = env!("CARGO_BIN_EXE_vkd");

/// A vkd process for one test; killed when dropped.
pub struct Vkd {
    pub node: String,
    pub state_dir: PathBuf,
    pub log: PathBuf,
    pub kubelet_port: u16,
    pub args: Vec<String>,
    child: Option<Child>,
}

pub fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

impl Vkd {
    pub fn start(c: &Cluster, node: &str, extra: &[&str]) -> Result<Self> {
        Self::start_with_fleet(c, node, "demo.yaml", extra)
    }

    pub fn start_with_fleet(c: &Cluster, node: &str, fleet: &str, extra: &[&str]) -> Result<Self> {
        let fleet = repo_root().join("testdata/fleets").join(fleet);
        Self::start_provider(c, node, "sim", &fleet, extra)
    }

    /// vkd on the process provider, with `testdata/process/e2e.yaml`.
    pub fn start_process(c: &Cluster, node: &str, extra: &[&str]) -> Result<Self> {
        let config = repo_root().join("testdata/process/e2e.yaml");
        Self::start_provider(c, node, "process", &config, extra)
    }

    pub fn start_provider(
        c: &Cluster,
        node: &str,
        provider: &str,
        config: &std::path::Path,
        extra: &[&str],
    ) -> Result<Self> {
        // Processes run as an unprivileged user, who must reach the sandboxes: the
        // process provider's state goes under the temp dir, not the (maybe private) checkout.
        let state_dir = if provider == "process" {
            std::env::temp_dir().join(format!("vkd-e2e-{}-{node}", std::process::id()))
        } else {
            c.dir().join("vkd-state").join(node)
        };
        std::fs::create_dir_all(&state_dir)?;
        let fleet = config;
        let kubelet_port = free_port()?;
        let mut args: Vec<String> = vec![
            "run".into(),
            "--kubeconfig".into(),
            c.kubeconfig().display().to_string(),
            "--node-name".into(),
            node.into(),
            "--provider".into(),
            provider.into(),
            "--provider-config".into(),
            fleet.display().to_string(),
            "--state-dir".into(),
            state_dir.display().to_string(),
            "--admin-port".into(),
            free_port()?.to_string(),
            "--kubelet-port".into(),
            kubelet_port.to_string(),
        ];
        args.extend(extra.iter().map(|s| (*s).to_owned()));
        let mut vkd = Self {
            node: node.into(),
            state_dir,
            log: c.log_path(&format!("vkd-{node}")),
            kubelet_port,
            args,
            child: None,
        };
        vkd.spawn()?;
        Ok(vkd)
    }

    pub fn spawn(&mut self) -> Result<()> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)?;
        let child = Command::new(VKD)
            .args(&self.args)
            .env("RUST_LOG", "info,kube=warn")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .context("starting vkd")?;
        self.child = Some(child);
        Ok(())
    }

    /// SIGKILL: no chance to clean up, as when a node or a container dies.
    pub fn kill(&mut self) -> Result<()> {
        if let Some(mut child) = self.child.take() {
            child.kill()?;
            child.wait()?;
        }
        Ok(())
    }

    /// The daemon's resident memory.
    pub fn rss_kib(&self) -> Option<u64> {
        let pid = self.child.as_ref()?.id();
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
        let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
        line.split_whitespace().nth(1)?.parse().ok()
    }

    /// The sim backend's instances, read from its state directory by `vkd sim list`.
    pub fn instances(&self) -> Result<Vec<Value>> {
        let out = Command::new(VKD)
            .args(["sim", "list", "--json", "--node", &self.node, "--state-dir"])
            .arg(&self.state_dir)
            .output()?;
        ensure!(
            out.status.success(),
            "vkd sim list: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(serde_json::from_slice::<Value>(&out.stdout)?
            .as_array()
            .cloned()
            .unwrap_or_default())
    }
}

impl Vkd {
    /// Kills what the process provider left running (shims and their containers'
    /// process groups) and removes its state; for the end of a suite.
    pub fn reap_processes(&self) {
        let pods = self.state_dir.join("process/pods");
        let Ok(entries) = std::fs::read_dir(&pods) else {
            return;
        };
        for e in entries.flatten() {
            let dir = e.path();
            if let Ok(text) = std::fs::read_to_string(dir.join("shim.pid"))
                && let Some(pid) = text.split_whitespace().next()
            {
                let _ = Command::new("kill").args(["-9", pid]).status();
            }
            if let Ok(bytes) = std::fs::read(dir.join("status.json"))
                && let Ok(v) = serde_json::from_slice::<Value>(&bytes)
            {
                for list in ["init", "containers"] {
                    for c in at(&v, list).as_array().into_iter().flatten() {
                        if let Some(pid) = c["process"]["pid"].as_i64() {
                            let _ = Command::new("kill")
                                .args(["-9", "--", &format!("-{pid}")])
                                .status();
                        }
                    }
                }
            }
        }
        if self.state_dir.starts_with(std::env::temp_dir()) {
            let _ = std::fs::remove_dir_all(&self.state_dir);
        }
    }
}

impl Drop for Vkd {
    fn drop(&mut self) {
        let _ = self.kill();
    }
}

pub fn items(v: &Value) -> Vec<Value> {
    at(v, "items").as_array().cloned().unwrap_or_default()
}

pub fn str_at<'a>(v: &'a Value, path: &str) -> &'a str {
    at(v, path).as_str().unwrap_or_default()
}

pub fn running_and_ready(p: &Value) -> bool {
    at(p, "status.phase") == "Running"
        && condition(p, "Ready").is_some_and(|c| c["status"] == "True")
}

/// Pod UIDs against instance owners: the backend runs exactly the Pods, once each.
pub fn assert_one_instance_per_pod(vkd: &Vkd, pods: &[Value]) -> Result<()> {
    let instances = vkd.instances()?;
    let owners: Vec<&str> = instances.iter().map(|i| str_at(i, "podUID")).collect();
    let unique: BTreeSet<&str> = owners.iter().copied().collect();
    ensure!(
        unique.len() == owners.len(),
        "duplicate instances for one Pod: {owners:?}"
    );
    let uids: BTreeSet<&str> = pods.iter().map(|p| str_at(p, "metadata.uid")).collect();
    ensure!(unique == uids, "instances {unique:?} != pods {uids:?}");
    for p in pods {
        let uid = str_at(p, "metadata.uid");
        let ann = at(p, "metadata.annotations")
            .get("vkd.io/instance-id")
            .and_then(Value::as_str)
            .unwrap_or_default();
        let inst = instances
            .iter()
            .find(|i| str_at(i, "podUID") == uid)
            .context("no instance")?;
        ensure!(
            ann == str_at(inst, "instance"),
            "pod {uid} names instance {ann:?}, backend has {}",
            inst["instance"]
        );
    }
    Ok(())
}
