//! vkd: a Virtual Kubelet provider daemon.
//!
//! [`run`] wires the parts together: a [`node::NodeAgent`] that keeps the virtual
//! Node registered, leased and its status current; a [`pods::PodController`] that
//! runs the Pods bound to it as backend instances; and a small admin server. One
//! [`CancellationToken`] stops them all.

pub mod admin;
pub mod api_client;
pub mod config;
pub mod fencing;
pub mod kubelet_api;
pub mod metrics;
pub mod node;
pub mod pods;
pub mod streaming;
pub mod telemetry;
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
    /// Another replica holds the lease now, or a backend refused our epoch; this
    /// replica stopped acting. The supervisor restarts it as a standby.
    #[error("leadership lost: {0}")]
    LostLeadership(String),
}

/// The epoch every mutation carries when leader election is off.
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

/// One client per kind of traffic, each with its own connection (HTTP/2 puts
/// all of a client's requests on one): lease renewals never queue behind Pod
/// writes, and the Pod watch's events never wait behind the writes' responses.
struct ApiClients {
    /// The Node, its lease and the leader lease.
    node: Client,
    /// Pod status writes, deletions and Events.
    pods: Client,
    /// The Pod watch.
    watch: Client,
}

impl ApiClients {
    /// Reads the kubeconfig (or the in-cluster config) once for all three.
    async fn new(cfg: &Config, metrics: &metrics::Metrics) -> Result<Self, Error> {
        let kube_cfg = kube_config(cfg).await?;
        let client = |http2| {
            api_client::build(
                kube_cfg.clone(),
                cfg.kube_idle_timeout,
                http2,
                metrics.api_connections.clone(),
            )
            .map_err(|e| Error::Kube(e.to_string()))
        };
        Ok(Self {
            node: client(cfg.kube_http2)?,
            pods: client(cfg.kube_http2)?,
            // HTTP/1.1 always: on an HTTP/2 connection shared with writes, watch
            // events reached vkd 1.5 s late (p50) in a 1,000-Pod burst.
            watch: client(false)?,
        })
    }
}

async fn kube_config(cfg: &Config) -> Result<kube::Config, Error> {
    match &cfg.kubeconfig {
        Some(path) => {
            let kc = kube::config::Kubeconfig::read_from(path)
                .map_err(|e| Error::Kube(e.to_string()))?;
            kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
                .await
                .map_err(|e| Error::Kube(e.to_string()))
        }
        None => kube::Config::infer()
            .await
            .map_err(|e| Error::Kube(e.to_string())),
    }
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

/// Runs the daemon until `shutdown` is cancelled. With leader election, it waits
/// as a standby until it holds the leader lease, acts while it holds it, and
/// goes back to standby when it loses it (another replica took it, it could not
/// be renewed, or a backend refused the epoch): it never acts without it.
pub async fn run(
    cfg: Config,
    provider: Arc<dyn Provider>,
    shutdown: CancellationToken,
) -> Result<(), Error> {
    let metrics = Arc::new(metrics::Metrics::default());
    let clients = ApiClients::new(&cfg, &metrics).await?;
    let provider = metrics::Instrumented::wrap(provider, Arc::clone(&metrics));
    let admin_state = admin::AdminState::new(Arc::clone(&provider), Arc::clone(&metrics));
    let admin = admin::serve(
        (cfg.admin_bind, cfg.admin_port).into(),
        admin_state.clone(),
        shutdown.clone(),
    )
    .await
    .map_err(Error::Admin)?;
    let elector = cfg
        .leader
        .clone()
        .map(|s| fencing::leader::LeaderElector::new(clients.node.clone(), s));
    let partition_fenced: Arc<std::sync::Mutex<std::collections::HashSet<String>>> = Arc::default();
    let result = loop {
        let epoch = match &elector {
            Some(e) => match e.acquire(&shutdown).await {
                Ok(epoch) => epoch,
                Err(_) => break Ok(()),
            },
            None => STATIC_EPOCH,
        };
        metrics.leader.set(1);
        metrics.epoch.set(i64::try_from(epoch).unwrap_or(i64::MAX));
        // Everything the term does stops at once when leadership goes.
        let work = shutdown.child_token();
        let shared = pods::Shared {
            metrics: Arc::clone(&metrics),
            superseded: CancellationToken::new(),
            last_lease_renewal: Arc::default(),
            partition_fenced: Arc::clone(&partition_fenced),
            unrenewed: Arc::default(),
        };
        let holder = {
            let (work, shared, outer) = (work.clone(), shared.clone(), shutdown.clone());
            let elector = elector.as_ref().map(|e| {
                fencing::leader::LeaderElector::new(clients.node.clone(), e.settings().clone())
            });
            tokio::spawn(async move {
                let refused = || fencing::leader::Held::Taken("a backend refused our epoch".into());
                let held = match &elector {
                    Some(e) => tokio::select! {
                        h = e.hold(epoch, &work) => h,
                        () = shared.superseded.cancelled() => refused(),
                    },
                    None => tokio::select! {
                        () = work.cancelled() => fencing::leader::Held::Shutdown,
                        () = shared.superseded.cancelled() => refused(),
                    },
                };
                match &held {
                    fencing::leader::Held::Shutdown => {
                        if let Some(e) = &elector
                            && outer.is_cancelled()
                        {
                            // A clean stop hands the lease over at once.
                            e.release(epoch).await;
                        }
                    }
                    fencing::leader::Held::Unrenewed(why) => {
                        *shared.unrenewed.lock().unwrap_or_else(|p| p.into_inner()) =
                            Some(why.clone());
                    }
                    fencing::leader::Held::Taken(_) => {}
                }
                work.cancel();
                held
            })
        };
        let acted = act(
            &cfg,
            &provider,
            epoch,
            &clients,
            &shared,
            &admin_state,
            work.clone(),
        )
        .await;
        work.cancel();
        admin_state.set_standby();
        metrics.leader.set(0);
        let held = holder.await.unwrap_or(fencing::leader::Held::Shutdown);
        if shutdown.is_cancelled() {
            break acted;
        }
        match held {
            fencing::leader::Held::Taken(why) | fencing::leader::Held::Unrenewed(why) => {
                tracing::error!(reason = %why, epoch, "leadership lost; stopped all work, back to standby");
                if elector.is_none() {
                    break Err(Error::LostLeadership(why));
                }
            }
            fencing::leader::Held::Shutdown => {
                if let Err(e) = acted {
                    break Err(e);
                }
            }
        }
    };
    shutdown.cancel();
    let _ = admin.await;
    result
}

/// The leader's work: the Nodes, their Pods and kubelet APIs, until `shutdown`.
async fn act(
    cfg: &Config,
    provider: &Arc<dyn Provider>,
    epoch: u64,
    clients: &ApiClients,
    shared: &pods::Shared,
    admin_state: &admin::AdminState,
    shutdown: CancellationToken,
) -> Result<(), Error> {
    let mut controllers = Vec::new();
    let mut agents = Vec::new();
    let mut servers = Vec::new();
    let mut registered = Vec::new();
    for (name, host, port) in nodes(cfg, provider.as_ref()).await? {
        let fence = vkd_provider::Fence {
            node: name.clone(),
            epoch,
        };
        if let Err(e) = provider.takeover(&fence).await {
            if let vkd_provider::ProviderError::Fenced { .. } = e {
                shared.superseded.cancel();
            }
            return Err(Error::Provider {
                provider: "takeover",
                message: format!("node {name} at epoch {epoch}: {e}"),
            });
        }
        let pods = pods::PodController::new(
            pods::Settings {
                node: name.clone(),
                host_ip: cfg.node_address.to_string(),
                epoch,
                concurrency: cfg.reconcile_concurrency,
                create_concurrency: cfg.create_concurrency,
                qps: cfg.kube_qps,
                burst: cfg.kube_burst,
                policy: cfg.policy.clone(),
                host: host.clone(),
                queue_timeout: cfg.queue_timeout,
                gc_interval: cfg.gc_interval,
                brake: cfg.brake,
                partition_fence_after: cfg.partition_fence_after,
                lifecycle_events: cfg.lifecycle_events,
            },
            clients.pods.clone(),
            clients.watch.clone(),
            Arc::clone(provider),
            shared.clone(),
        );
        let tls = kubelet_api::tls::server_config(&cfg.tls, &name, cfg.node_address)
            .map_err(kubelet_api::ApiError::from)?;
        servers.push(
            kubelet_api::KubeletApi::new(
                Arc::clone(&pods),
                clients.pods.clone(),
                cfg.anonymous_auth,
            )
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
            clients.node.clone(),
            Arc::clone(provider),
            Arc::clone(&shared.last_lease_renewal),
        );
        let (tx, rx) = watch::channel(false);
        registered.push(rx);
        agents.push((agent, tx));
        controllers.push(pods);
        info!(node = %name, port, "virtual node configured");
    }
    admin_state.set_active(registered, controllers.clone());
    info!(
        nodes = controllers.len(),
        provider = provider.name(),
        epoch,
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
    for k in servers {
        let _ = k.await;
    }
    node_result.map_err(Error::from)
}
