//! An API server behind the test API server's aggregation layer
//! (metrics-server, prometheus-adapter), deployed as a cluster admin deploys
//! one: its ServiceAccount, RBAC and APIService from a manifest whose
//! APIService reaches it through an ExternalName `localhost` Service (loopback
//! Endpoints are refused by validation), `port: PORT` replaced by the port it
//! serves on. It runs on loopback with its ServiceAccount's token.

use std::path::Path;
use std::time::Duration;

use anyhow::Result;

use crate::{Cluster, Daemon, condition, free_port, repo_root, wait_for};

/// A running aggregated API server; stopped on drop.
#[derive(Debug)]
pub struct Aggregated {
    _daemon: Daemon,
    pub port: u16,
}

/// What sets one aggregated API server apart.
#[derive(Debug)]
pub struct Spec<'a> {
    /// Its name: the log's, the cert directory's, the kubeconfig's.
    pub name: &'a str,
    pub bin: &'a Path,
    /// Its objects, relative to the repository.
    pub manifest: &'a str,
    /// Its ServiceAccount in kube-system.
    pub account: &'a str,
    /// The APIService that is Available once it serves.
    pub api_service: &'a str,
    /// Flags beyond the serving and authentication ones all of them take.
    pub args: Vec<String>,
}

impl Aggregated {
    /// Deploys `spec`'s objects on `c`, starts it, and waits until its
    /// APIService is Available.
    pub fn start(c: &Cluster, spec: Spec<'_>) -> Result<Self> {
        let port = free_port()?;
        let manifest = std::fs::read_to_string(repo_root().join(spec.manifest))?
            .replace("port: PORT", &format!("port: {port}"));
        c.kubectl_stdin(&["apply", "-f", "-"], Some(&manifest))?;
        let kubeconfig = c.dir().join(format!("kubeconfig-{}", spec.name));
        c.write_token_kubeconfig(&kubeconfig, "kube-system", spec.account)?;
        let certs = c.dir().join(format!("{}-certs", spec.name));
        std::fs::create_dir_all(&certs)?;
        let kc = kubeconfig.display();
        let mut args = vec![
            format!("--authentication-kubeconfig={kc}"),
            format!("--authorization-kubeconfig={kc}"),
            format!("--secure-port={port}"),
            "--bind-address=127.0.0.1".into(),
            format!("--cert-dir={}", certs.display()),
        ];
        args.extend(spec.args);
        let mut daemon = Daemon::start(c, spec.name, spec.bin, &args)?;
        wait_for(
            &format!("the APIService {} to be Available", spec.api_service),
            Duration::from_secs(90),
            || {
                daemon.ensure_running()?;
                let s = c.kubectl_json(&["get", "apiservice", spec.api_service])?;
                Ok(condition(&s, "Available")
                    .filter(|a| a["status"] == "True")
                    .map(|_| ()))
            },
        )?;
        Ok(Self {
            _daemon: daemon,
            port,
        })
    }
}
