//! vkd: a Virtual Kubelet provider daemon.
//!
//! [`run`] wires the parts together: a [`node::NodeAgent`] that keeps the virtual
//! Node registered, leased and its status current; a [`pods::PodController`] that
//! runs the Pods bound to it as backend instances; and a small admin server. One
//! [`CancellationToken`] stops them all.

pub mod admin;
pub mod config;
pub mod kubelet_api;
pub mod node;
pub mod pods;
pub mod streaming;
pub mod topology;

use std::sync::Arc;

use kube::Client;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::info;
use vkd_provider::Provider;

use config::{Config, ProviderKind};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The configuration is unusable (exit 64).
    #[error("invalid configuration: {0}")]
    Config(#[from] config::ConfigError),
    #[error("provider {provider}: {message}")]
    Provider {
        provider: &'static str,
        message: String,
    },
    #[error("kubernetes client: {0}")]
    Kube(String),
    #[error("admin server: {0}")]
    Admin(#[source] std::io::Error),
    #[error(transparent)]
    Node(#[from] node::NodeError),
    #[error(transparent)]
    KubeletApi(#[from] kubelet_api::ApiError),
}

/// The epoch every mutation carries until leader election assigns real ones.
pub const STATIC_EPOCH: u64 = 1;

/// Builds the configured provider. A malformed provider config is a config error.
pub fn build_provider(cfg: &Config) -> Result<Arc<dyn Provider>, Error> {
    match cfg.provider {
        ProviderKind::Process => {
            let config = match &cfg.provider_config {
                Some(path) => vkd_process::ProcessConfig::load(path).map_err(|e| {
                    Error::Config(config::ConfigError {
                        field: "provider-config".into(),
                        message: e.to_string(),
                    })
                })?,
                None => vkd_process::ProcessConfig::default(),
            };
            // The vkd binary is also the shim and the launcher (`vkd process-shim`).
            let exe = std::env::current_exe().map_err(|e| Error::Provider {
                provider: "process",
                message: format!("locating the vkd binary: {e}"),
            })?;
            let provider =
                vkd_process::ProcessProvider::open(config, &cfg.state_dir.join("process"), exe)
                    .map_err(|e| Error::Provider {
                        provider: "process",
                        message: e.to_string(),
                    })?;
            info!(
                limits = provider.limits_mode(),
                run_as = ?provider.run_as(),
                "process provider ready"
            );
            Ok(Arc::new(provider))
        }
        ProviderKind::Sim => {
            let fleet_path = cfg
                .provider_config
                .as_deref()
                .unwrap_or(std::path::Path::new(""));
            let fleet = vkd_sim::Fleet::load(fleet_path).map_err(|e| {
                Error::Config(config::ConfigError {
                    field: "provider-config".into(),
                    message: e.to_string(),
                })
            })?;
            let provider =
                vkd_sim::SimProvider::open(fleet, &cfg.state_dir.join("sim")).map_err(|e| {
                    Error::Provider {
                        provider: "sim",
                        message: e.to_string(),
                    }
                })?;
            Ok(Arc::new(provider))
        }
    }
}

async fn client(cfg: &Config) -> Result<Client, Error> {
    let kube_cfg = match &cfg.kubeconfig {
        Some(path) => {
            let kc = kube::config::Kubeconfig::read_from(path)
                .map_err(|e| Error::Kube(e.to_string()))?;
            kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
                .await
                .map_err(|e| Error::Kube(e.to_string()))?
        }
        None => kube::Config::infer()
            .await
            .map_err(|e| Error::Kube(e.to_string()))?,
    };
    Client::try_from(kube_cfg).map_err(|e| Error::Kube(e.to_string()))
}

/// The Nodes this daemon registers: one for the whole backend, or one per host
/// slice (`<node-name>-<host>`) in per-host mode, each with its own kubelet port.
async fn nodes(
    cfg: &Config,
    provider: &dyn Provider,
) -> Result<Vec<(String, Option<String>, u16)>, Error> {
    match cfg.node_mode {
        config::NodeMode::Aggregate => Ok(vec![(cfg.node_name.clone(), None, cfg.kubelet_port)]),
        config::NodeMode::PerHost => {
            let cap = provider.capacity().await.map_err(|e| Error::Provider {
                provider: "per-host",
                message: format!("reading the host slices: {e}"),
            })?;
            if cap.hosts.is_empty() {
                return Err(Error::Provider {
                    provider: "per-host",
                    message: "the provider reports no host slices to make nodes of".into(),
                });
            }
            cap.hosts
                .iter()
                .enumerate()
                .map(|(i, h)| {
                    let port = u16::try_from(usize::from(cfg.kubelet_port) + i).map_err(|_| {
                        Error::Config(config::ConfigError {
                            field: "kubelet-port".into(),
                            message: format!("no port left for host {}", h.name),
                        })
                    })?;
                    let name = format!("{}-{}", cfg.node_name, topology::node_suffix(&h.name));
                    Ok((name, Some(h.name.clone()), port))
                })
                .collect()
        }
    }
}

/// Runs the daemon until `shutdown` is cancelled.
pub async fn run(
    cfg: Config,
    provider: Arc<dyn Provider>,
    shutdown: CancellationToken,
) -> Result<(), Error> {
    // Two clients, two connection pools: lease renewals never queue behind Pod writes.
    let node_client = client(&cfg).await?;
    let pod_client = client(&cfg).await?;
    let mut controllers = Vec::new();
    let mut agents = Vec::new();
    let mut servers = Vec::new();
    let mut registered = Vec::new();
    for (name, host, port) in nodes(&cfg, provider.as_ref()).await? {
        let pods = pods::PodController::new(
            pods::Settings {
                node: name.clone(),
                host_ip: cfg.node_address.to_string(),
                epoch: STATIC_EPOCH,
                concurrency: cfg.reconcile_concurrency,
                qps: cfg.kube_qps,
                burst: cfg.kube_burst,
                policy: cfg.policy.clone(),
                host: host.clone(),
                queue_timeout: cfg.queue_timeout,
            },
            pod_client.clone(),
            Arc::clone(&provider),
        );
        let tls = kubelet_api::tls::server_config(&cfg.tls, &name, cfg.node_address)
            .map_err(kubelet_api::ApiError::from)?;
        servers.push(
            kubelet_api::KubeletApi::new(Arc::clone(&pods), pod_client.clone(), cfg.anonymous_auth)
                .serve((cfg.kubelet_bind, port).into(), tls, shutdown.clone())
                .await?,
        );
        let agent = node::NodeAgent::new(
            node::Settings {
                name: name.clone(),
                address: cfg.node_address.to_string(),
                kubelet_port: port,
                labels: cfg.node_labels.clone(),
                taints: cfg.node_taints.clone(),
                max_pods: cfg.max_pods,
                lease_renew_interval: cfg.lease_renew_interval,
                lease_duration: cfg.lease_duration,
                status_report_interval: cfg.status_report_interval,
                policy: cfg.policy.to_string(),
                host,
            },
            node_client.clone(),
            Arc::clone(&provider),
        );
        let (tx, rx) = watch::channel(false);
        registered.push(rx);
        agents.push((agent, tx));
        controllers.push(pods);
        info!(node = %name, port, "virtual node configured");
    }
    let admin = admin::serve(
        (cfg.admin_bind, cfg.admin_port).into(),
        admin::Readiness {
            registered,
            pods: controllers.clone(),
        },
        shutdown.clone(),
    )
    .await
    .map_err(Error::Admin)?;
    info!(
        nodes = controllers.len(),
        provider = provider.name(),
        "vkd starting"
    );
    let pod_tasks: Vec<_> = controllers
        .iter()
        .map(|p| tokio::spawn(Arc::clone(p).run(shutdown.clone())))
        .collect();
    let node_tasks: Vec<_> = agents
        .into_iter()
        .map(|(agent, tx)| {
            let shutdown = shutdown.clone();
            tokio::spawn(async move { agent.run(shutdown, tx).await })
        })
        .collect();
    let mut node_result = Ok(());
    for t in node_tasks {
        if let Ok(Err(e)) = t.await
            && node_result.is_ok()
        {
            node_result = Err(e);
        }
    }
    shutdown.cancel();
    for t in pod_tasks {
        let _ = t.await;
    }
    let _ = admin.await;
    for k in servers {
        let _ = k.await;
    }
    node_result.map_err(Error::from)
}
