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

/// Runs the daemon until `shutdown` is cancelled.
pub async fn run(
    cfg: Config,
    provider: Arc<dyn Provider>,
    shutdown: CancellationToken,
) -> Result<(), Error> {
    // Two clients, two connection pools: lease renewals never queue behind Pod writes.
    let node_client = client(&cfg).await?;
    let pod_client = client(&cfg).await?;
    let pods = pods::PodController::new(
        pods::Settings {
            node: cfg.node_name.clone(),
            host_ip: cfg.node_address.to_string(),
            epoch: STATIC_EPOCH,
            concurrency: cfg.reconcile_concurrency,
            qps: cfg.kube_qps,
            burst: cfg.kube_burst,
            policy: cfg.policy.clone(),
        },
        pod_client.clone(),
        Arc::clone(&provider),
    );
    let tls = kubelet_api::tls::server_config(&cfg.tls, &cfg.node_name, cfg.node_address)
        .map_err(kubelet_api::ApiError::from)?;
    let kubelet = kubelet_api::KubeletApi::new(Arc::clone(&pods), pod_client, cfg.anonymous_auth)
        .serve(
            (cfg.kubelet_bind, cfg.kubelet_port).into(),
            tls,
            shutdown.clone(),
        )
        .await?;
    let agent = node::NodeAgent::new(
        node::Settings {
            name: cfg.node_name.clone(),
            address: cfg.node_address.to_string(),
            kubelet_port: cfg.kubelet_port,
            labels: cfg.node_labels.clone(),
            taints: cfg.node_taints.clone(),
            max_pods: cfg.max_pods,
            lease_renew_interval: cfg.lease_renew_interval,
            lease_duration: cfg.lease_duration,
            status_report_interval: cfg.status_report_interval,
            policy: cfg.policy.to_string(),
        },
        node_client,
        Arc::clone(&provider),
    );
    let (registered_tx, registered) = watch::channel(false);
    let admin = admin::serve(
        (cfg.admin_bind, cfg.admin_port).into(),
        admin::Readiness {
            registered,
            pods: Arc::clone(&pods),
        },
        shutdown.clone(),
    )
    .await
    .map_err(Error::Admin)?;
    info!(node = %cfg.node_name, provider = provider.name(), "vkd starting");
    let pod_task = tokio::spawn(Arc::clone(&pods).run(shutdown.clone()));
    let node_result = agent.run(shutdown.clone(), registered_tx).await;
    shutdown.cancel();
    let _ = pod_task.await;
    let _ = admin.await;
    let _ = kubelet.await;
    node_result.map_err(Error::from)
}
