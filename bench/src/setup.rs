//! What both modes start: a control plane, the bench namespace, a vkd.

use std::path::PathBuf;

use anyhow::{Result, bail};
use kube::Client;
use vkd_e2e::{Cluster, repo_root};

use super::{Args, NAMESPACE, NODE, admin_client, sibling, wait_until};

/// A control plane with the limits given on the command line.
pub(crate) fn cluster_up(name: &str, args: &Args, extra: &[&str]) -> Result<Cluster> {
    let limits = [
        "--max-requests-inflight".to_owned(),
        args.max_requests_inflight.to_string(),
        "--max-mutating-requests-inflight".to_owned(),
        args.max_mutating_requests_inflight.to_string(),
        "--component-qps".to_owned(),
        args.component_qps.to_string(),
    ];
    let all: Vec<&str> = limits
        .iter()
        .map(String::as_str)
        .chain(extra.iter().copied())
        .collect();
    Cluster::up(name, &all)
}

/// The bench namespace, once its default ServiceAccount exists; an admin client.
pub(crate) async fn bench_namespace(cluster: &Cluster) -> Result<Client> {
    cluster.kubectl(&["create", "namespace", NAMESPACE])?;
    let client = admin_client(cluster).await?;
    wait_until("the bench namespace's default ServiceAccount", 60, || {
        cluster
            .kubectl(&["get", "serviceaccount", "default", "-n", NAMESPACE])
            .is_ok()
    })
    .await?;
    Ok(client)
}

/// `--vkd-binary`, or the vkd beside this binary.
pub(crate) fn vkd_binary(args: &Args) -> Result<PathBuf> {
    match &args.vkd_binary {
        Some(path) if path.exists() => Ok(path.clone()),
        Some(path) => bail!("--vkd-binary {} not found", path.display()),
        None => sibling("vkd"),
    }
}

/// What one vkd runs: its node, provider, the provider's config and extra flags.
#[derive(Debug)]
pub(crate) struct Role<'a> {
    pub(crate) node: &'a str,
    pub(crate) provider: &'a str,
    pub(crate) config: PathBuf,
    pub(crate) extra: &'a [&'a str],
}

impl Role<'_> {
    /// The sim on `many.yaml` (one host, zero latency), node `vk-bench`.
    pub(crate) fn sim() -> Self {
        Role {
            node: NODE,
            provider: "sim",
            config: repo_root().join("testdata/fleets/many.yaml"),
            extra: &["--node-label", "vkd.io/bench=true"],
        }
    }
}

/// The sim served over the provider protocol (`vkd provider-serve`), its
/// state where the in-process sim's would be; killed on drop.
#[derive(Debug)]
pub(crate) struct Plugin {
    child: std::process::Child,
    socket: PathBuf,
}

impl Plugin {
    pub(crate) fn start(cluster: &Cluster, vkd: &std::path::Path) -> Result<Self> {
        let state = cluster.dir().join("vkd-state");
        std::fs::create_dir_all(&state)?;
        let socket = cluster.dir().join("plugin.sock");
        let args: Vec<String> = vec![
            "provider-serve".into(),
            "--provider".into(),
            "sim".into(),
            "--provider-config".into(),
            repo_root()
                .join("testdata/fleets/many.yaml")
                .display()
                .to_string(),
            "--state-dir".into(),
            state.display().to_string(),
            "--listen".into(),
            format!("unix://{}", socket.display()),
        ];
        let child = vkd_e2e::spawn_logged(vkd, &args, &cluster.log_path("plugin"), "info")?;
        let plugin = Self { child, socket };
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while !plugin.socket.exists() {
            if std::time::Instant::now() > deadline {
                bail!("the plugin made no socket at {}", plugin.socket.display());
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        Ok(plugin)
    }

    pub(crate) fn endpoint(&self) -> String {
        format!("unix://{}", self.socket.display())
    }

    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Plugin {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
