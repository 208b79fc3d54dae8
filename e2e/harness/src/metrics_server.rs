//! metrics-server beside a suite's cluster, deployed as a cluster admin deploys
//! it (ServiceAccount, RBAC, APIService through the aggregation layer) but run
//! as a process on loopback. It scrapes every Node's kubelet port, vkd's
//! included, with its ServiceAccount's token, so `kubectl top` and the HPA see
//! exactly what a real cluster's would.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result, bail};

use crate::{Cluster, condition, free_port, repo_root, spawn_logged, wait_for};

/// How often metrics-server scrapes (its floor is 10 s). CPU is a counter, so
/// a Pod's usage is known a resolution after its second scrape.
pub const RESOLUTION: Duration = Duration::from_secs(10);

/// A running metrics-server; stopped on drop.
#[derive(Debug)]
pub struct MetricsServer {
    child: Child,
    pub port: u16,
}

/// The metrics-server binary, built from Go modules and cached by `e2e/cluster`.
pub fn binary() -> Result<PathBuf> {
    let out = Command::new(repo_root().join("e2e/cluster"))
        .arg("build-metrics-server")
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .output()
        .context("running e2e/cluster build-metrics-server")?;
    if !out.status.success() {
        bail!("e2e/cluster build-metrics-server failed ({})", out.status);
    }
    let dir = String::from_utf8(out.stdout)?;
    Ok(PathBuf::from(dir.trim()).join("metrics-server"))
}

impl MetricsServer {
    /// Deploys metrics-server's objects on `c`, starts it, and waits until the
    /// APIService `v1beta1.metrics.k8s.io` is Available.
    pub fn start(c: &Cluster) -> Result<Self> {
        let bin = binary()?;
        let port = free_port()?;
        let manifest = std::fs::read_to_string(
            repo_root().join("testdata/metrics-server/metrics-server.yaml"),
        )?
        .replace("port: PORT", &format!("port: {port}"));
        c.kubectl_stdin(&["apply", "-f", "-"], Some(&manifest))?;
        let kubeconfig = c.dir().join("kubeconfig-metrics-server");
        c.write_token_kubeconfig(&kubeconfig, "kube-system", "metrics-server")?;
        let certs = c.dir().join("metrics-server-certs");
        std::fs::create_dir_all(&certs)?;
        let kc = kubeconfig.display().to_string();
        let args: Vec<String> = [
            format!("--kubeconfig={kc}"),
            format!("--authentication-kubeconfig={kc}"),
            format!("--authorization-kubeconfig={kc}"),
            format!("--secure-port={port}"),
            "--bind-address=127.0.0.1".into(),
            format!("--cert-dir={}", certs.display()),
            // vkd's kubelet port, from the Node as a kubelet's.
            "--kubelet-use-node-status-port".into(),
            "--kubelet-preferred-address-types=InternalIP".into(),
            // The kubelets' serving certificates are self-signed here, as on
            // most clusters that run metrics-server.
            "--kubelet-insecure-tls".into(),
            format!("--metric-resolution={}s", RESOLUTION.as_secs()),
            // Under the resolution, as it must be; over vkd's 8 s deadline
            // for a scrape's Pods, so a slow Pod costs its figures, not the node's.
            "--kubelet-request-timeout=9s".into(),
        ]
        .into();
        let child = spawn_logged(&bin, &args, &c.log_path("metrics-server"), "")?;
        let mut server = Self { child, port };
        let log = c.log_path("metrics-server");
        wait_for(
            "the metrics.k8s.io APIService to be Available",
            Duration::from_secs(90),
            || {
                if let Some(status) = server.child.try_wait()? {
                    bail!("metrics-server exited ({status}); see {}", log.display());
                }
                let s = c.kubectl_json(&["get", "apiservice", "v1beta1.metrics.k8s.io"])?;
                Ok(condition(&s, "Available")
                    .filter(|a| a["status"] == "True")
                    .map(|_| ()))
            },
        )?;
        Ok(server)
    }
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
