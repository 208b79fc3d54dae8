//! vkd: a Virtual Kubelet provider daemon.
//!
//! [`run`] wires the parts together: a [`node::NodeAgent`] that keeps the virtual
//! Node registered, leased and its status current; a [`pods::PodController`] that
//! runs the Pods bound to it as backend instances; and a small admin server. One
//! [`CancellationToken`] stops them all.

pub mod admin;
pub mod api_client;
pub mod cli;
pub mod config;
pub mod dra;
pub mod explain;
pub mod fencing;
pub mod gpu_usage;
pub mod kubelet_api;
pub mod metrics;
pub mod node;
pub mod pods;
pub mod streaming;
pub mod tasks;
pub mod telemetry;
pub mod topology;

use std::collections::BTreeMap;
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
    /// A critical task stopped while the daemon ran.
    #[error(transparent)]
    Task(#[from] tasks::TaskError),
    /// Another replica holds the lease now, or a backend refused our epoch; this
    /// replica stopped acting. The supervisor restarts it as a standby.
    #[error("leadership lost: {0}")]
    LostLeadership(String),
}

/// The epoch every mutation carries when leader election is off.
pub const STATIC_EPOCH: u64 = 1;

/// Builds the configured provider. A malformed provider config is a config
/// error. The `grpc` provider is not built but connected ([`connect_provider`]).
pub fn build_provider(cfg: &Config) -> Result<Arc<dyn Provider>, Error> {
    build_in_tree_with(
        cfg.provider,
        cfg.provider_config.as_deref(),
        &cfg.state_dir,
        &cfg.host_port_reservations,
    )
}

/// Reserves `ports` (each with what serves it) host-wide for good
/// (`--host-port-reservations`): the process provider of every vkd on the
/// host refuses them as a Pod's hostPort, also while this vkd restarts and
/// nothing listens on them. The process provider run as root (the only one
/// that gives Pods host ports) must reserve; any other vkd may run as a user
/// that cannot write there, and says so.
fn reserve_ports(cfg: &Config, ports: &BTreeMap<u16, String>) -> Result<(), Error> {
    use std::os::unix::fs::MetadataExt;
    let reservations = vkd_process::hostport::Reservations::new(&cfg.host_port_reservations);
    // /proc/self is owned by the process's effective user.
    let root = std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0);
    match reservations.reserve(ports, &cfg.node_name) {
        Ok(()) => Ok(()),
        Err(e) if cfg.provider == config::ProviderKind::Process && root => Err(Error::Provider {
            provider: "process",
            message: format!("reserving vkd's ports on the host: {e}"),
        }),
        Err(e) => {
            tracing::warn!(error = %e, "vkd's ports are not reserved on the host: a process Pod of another vkd could take one as a hostPort while this one restarts");
            Ok(())
        }
    }
}

/// Connects the `grpc` provider's plugin and asks its protocol version, each
/// call bounded by the provider timeout. A plugin that does not answer, or
/// speaks another version, is an error naming its endpoint.
pub async fn connect_provider(cfg: &Config) -> Result<Arc<dyn Provider>, Error> {
    let endpoint = cfg.provider_endpoint.clone().ok_or_else(|| {
        Error::Config(config::ConfigError {
            field: "provider-endpoint".into(),
            message: "required by the grpc provider".into(),
        })
    })?;
    let plugin = vkd_grpc::GrpcProvider::connect(endpoint.clone(), cfg.provider_timeout)
        .await
        .map_err(|e| Error::Provider {
            provider: "grpc",
            message: e.to_string(),
        })?;
    info!(plugin = plugin.name(), %endpoint, "provider plugin connected");
    Ok(Arc::new(plugin))
}

/// An in-tree provider of `kind`, with its config file and its state under
/// `state_dir` (what `vkd run` builds, and `vkd provider-serve` serves).
pub fn build_in_tree(
    kind: ProviderKind,
    provider_config: Option<&std::path::Path>,
    state_dir: &std::path::Path,
) -> Result<Arc<dyn Provider>, Error> {
    let reservations = std::path::Path::new(vkd_process::hostport::DEFAULT_RESERVATIONS);
    build_in_tree_with(kind, provider_config, state_dir, reservations)
}

/// [`build_in_tree`], with the host's port reservations at `reservations`.
fn build_in_tree_with(
    kind: ProviderKind,
    provider_config: Option<&std::path::Path>,
    state_dir: &std::path::Path,
    reservations: &std::path::Path,
) -> Result<Arc<dyn Provider>, Error> {
    match kind {
        ProviderKind::Grpc => Err(Error::Config(config::ConfigError {
            field: "provider".into(),
            message: "grpc is a plugin vkd connects to, not one it builds".into(),
        })),
        ProviderKind::Process => {
            let mut config = match provider_config {
                Some(path) => vkd_process::ProcessConfig::load(path).map_err(|e| {
                    Error::Config(config::ConfigError {
                        field: "provider-config".into(),
                        message: e.to_string(),
                    })
                })?,
                None => vkd_process::ProcessConfig::default(),
            };
            config.host_ports.reservations = reservations.to_owned();
            // The vkd binary is also the shim and the launcher (`vkd process-shim`).
            let exe = std::env::current_exe().map_err(|e| Error::Provider {
                provider: "process",
                message: format!("locating the vkd binary: {e}"),
            })?;
            let provider =
                vkd_process::ProcessProvider::open(config, &state_dir.join("process"), exe)
                    .map_err(|e| {
                        // A field of the provider config that this host cannot honour.
                        if e.is_config() {
                            Error::Config(config::ConfigError {
                                field: "provider-config".into(),
                                message: e.to_string(),
                            })
                        } else {
                            Error::Provider {
                                provider: "process",
                                message: e.to_string(),
                            }
                        }
                    })?;
            info!(
                limits = provider.limits_mode(),
                isolation = provider.isolation_mode(),
                tracking = provider.tracking_mode(),
                run_as = ?provider.run_as(),
                "process provider ready"
            );
            Ok(Arc::new(provider))
        }
        ProviderKind::Sim => {
            let fleet_path = provider_config.unwrap_or(std::path::Path::new(""));
            let fleet = vkd_sim::Fleet::load(fleet_path).map_err(|e| {
                Error::Config(config::ConfigError {
                    field: "provider-config".into(),
                    message: e.to_string(),
                })
            })?;
            let provider =
                vkd_sim::SimProvider::open(fleet, &state_dir.join("sim")).map_err(|e| {
                    Error::Provider {
                        provider: "sim",
                        message: e.to_string(),
                    }
                })?;
            Ok(Arc::new(provider))
        }
        ProviderKind::Kubernetes => {
            let path = provider_config.unwrap_or(std::path::Path::new(""));
            let config_error = |e: vkd_kubernetes::ConfigError| {
                Error::Config(config::ConfigError {
                    field: "provider-config".into(),
                    message: e.to_string(),
                })
            };
            let config = vkd_kubernetes::KubernetesConfig::load(path).map_err(config_error)?;
            let provider =
                vkd_kubernetes::KubernetesProvider::open(config).map_err(config_error)?;
            info!(cluster = provider.cluster(), "kubernetes provider ready");
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
/// slice (`<node-name>-<host>`) in per-host mode, each with its own kubelet port
/// (or all on one with `--shared-kubelet-port`).
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
                    let i = if cfg.shared_kubelet_port { 0 } else { i };
                    let port = u16::try_from(usize::from(cfg.kubelet_port) + i)
                        .ok()
                        .filter(|p| *p != cfg.admin_port)
                        .ok_or_else(|| {
                            Error::Config(config::ConfigError {
                                field: "kubelet-port".into(),
                                message: format!(
                                    "no port left for host {} (its port would be {}, past 65535 or \
                                     the admin port): use --shared-kubelet-port",
                                    h.name,
                                    usize::from(cfg.kubelet_port) + i
                                ),
                            })
                        })?;
                    let suffix = topology::node_suffix(&h.name);
                    if suffix.is_empty() {
                        return Err(Error::Provider {
                            provider: "per-host",
                            message: format!("host {:?} gives no Node name", h.name),
                        });
                    }
                    Ok((
                        format!("{}-{suffix}", cfg.node_name),
                        Some(h.name.clone()),
                        port,
                    ))
                })
                .collect::<Result<Vec<_>, Error>>()
                .and_then(distinct_nodes)
        }
    }
}

/// Refuses two hosts that would be one Node (`gpu_1` and `gpu.1`, or the
/// same name twice): two agents would run the same Pods.
fn distinct_nodes(
    nodes: Vec<(String, Option<String>, u16)>,
) -> Result<Vec<(String, Option<String>, u16)>, Error> {
    let mut seen: std::collections::HashMap<&str, &str> = std::collections::HashMap::new();
    for (name, host, _) in &nodes {
        let host = host.as_deref().unwrap_or_default();
        if let Some(first) = seen.insert(name, host) {
            return Err(Error::Provider {
                provider: "per-host",
                message: format!("hosts {first:?} and {host:?} would both be Node {name}"),
            });
        }
    }
    Ok(nodes)
}

/// Runs the daemon until `shutdown` is cancelled. With leader election, it waits
/// as a standby until it holds the leader lease, acts while it holds it, and
/// goes back to standby when it loses it (another replica took it, it could not
/// be renewed, or a backend refused the epoch): it never acts without it. A
/// critical task that stops ends the daemon with an error naming it.
pub async fn run(
    cfg: Config,
    provider: Arc<dyn Provider>,
    shutdown: CancellationToken,
) -> Result<(), Error> {
    let metrics = Arc::new(metrics::Metrics::default());
    let clients = ApiClients::new(&cfg, &metrics).await?;
    let provider =
        metrics::Instrumented::wrap(provider, Arc::clone(&metrics), cfg.provider_timeout);
    reserve_ports(&cfg, &cfg.policy.node_ports)?;
    let admin_state = admin::AdminState::new(Arc::clone(&provider), Arc::clone(&metrics));
    let admin = admin::serve(
        (cfg.admin_bind, cfg.admin_port).into(),
        admin_state.clone(),
        shutdown.clone(),
    )
    .await
    .map_err(Error::Admin)?;
    // The admin server outlives terms: if it stops, everything stops.
    let mut daemon = tasks::Critical::new(shutdown.clone());
    daemon.adopt("admin server", admin);
    let elector = cfg
        .leader
        .clone()
        .map(|s| Arc::new(fencing::leader::LeaderElector::new(clients.node.clone(), s)));
    let partition_fenced: Arc<std::sync::Mutex<std::collections::HashSet<String>>> = Arc::default();
    let replica = cfg
        .leader
        .as_ref()
        .map_or_else(config::hostname, |l| l.identity.clone());
    let decisions = Arc::new(explain::DecisionLog::new(
        replica.clone(),
        explain::DECISIONS_KEPT,
    ));
    let result = loop {
        let leadership = match &elector {
            Some(e) => match e.lead(&shutdown).await {
                Ok(l) => l,
                Err(_) => break Ok(()),
            },
            None => fencing::leader::Leadership::fixed(STATIC_EPOCH, &shutdown),
        };
        let term = leadership.term.clone();
        metrics.leader.set(1);
        metrics
            .epoch
            .set(i64::try_from(term.epoch()).unwrap_or(i64::MAX));
        let shared = pods::Shared {
            metrics: Arc::clone(&metrics),
            term: term.clone(),
            last_lease_renewal: Arc::default(),
            partition_fenced: Arc::clone(&partition_fenced),
            services: None,
            decisions: Arc::clone(&decisions),
            leadership: explain::Leadership {
                replica: replica.clone(),
                epoch: term.epoch(),
                since: std::time::SystemTime::now(),
                elected: elector.is_some(),
            },
        };
        let acted = act(&cfg, &provider, &clients, &shared, &admin_state).await;
        admin_state.set_standby();
        metrics.leader.set(0);
        let ended = leadership.finish().await;
        if shutdown.is_cancelled() {
            break acted;
        }
        match ended {
            fencing::term::Ended::Taken(why) | fencing::term::Ended::Unrenewed(why) => {
                tracing::error!(reason = %why, epoch = term.epoch(), "leadership lost; stopped all work, back to standby");
                if elector.is_none() {
                    break Err(Error::LostLeadership(why));
                }
            }
            // A bug in the holder: restart rather than guess.
            fencing::term::Ended::Abandoned(why) => break Err(Error::LostLeadership(why)),
            fencing::term::Ended::Shutdown => {
                if let Err(e) = acted {
                    break Err(e);
                }
            }
        }
    };
    shutdown.cancel();
    let stopped = daemon.join().await;
    result.and(stopped.map_err(Error::from))
}

/// The leader's work: the Nodes, their Pods and kubelet APIs, until the term ends.
async fn act(
    cfg: &Config,
    provider: &Arc<dyn Provider>,
    clients: &ApiClients,
    shared: &pods::Shared,
    admin_state: &admin::AdminState,
) -> Result<(), Error> {
    let term = &shared.term;
    let (epoch, work) = (term.epoch(), term.work());
    let mut tasks = tasks::Critical::new(work.clone());
    // One cached Service watch for every node's Pods (service env variables).
    let (services, watch) = pods::services::Services::watch(clients.watch.clone(), work.clone());
    tasks.spawn("service watch", watch);
    let shared = &pods::Shared {
        services: Some(services),
        ..shared.clone()
    };
    let mut controllers = Vec::new();
    let mut binding_sides = Vec::new();
    let mut registered = Vec::new();
    let mut listeners: BTreeMap<u16, Vec<pods::PodIndex>> = BTreeMap::new();
    let mut configured = Vec::new();
    let nodes = nodes(cfg, provider.as_ref()).await?;
    let nodes_served = nodes.len();
    // Every node's kubelet port is the node's, not a Pod's (per-host mode
    // listens on one per host, from --kubelet-port up).
    let mut policy = cfg.policy.clone();
    for (name, _, port) in &nodes {
        policy
            .node_ports
            .entry(*port)
            .or_insert_with(|| format!("vkd's kubelet API of node {name}"));
    }
    reserve_ports(cfg, &policy.node_ports)?;
    for (name, host, port) in nodes {
        let fence = vkd_provider::Fence {
            node: name.clone(),
            epoch,
        };
        if let Err(e) = provider.takeover(&fence).await {
            if let vkd_provider::ProviderError::Fenced { .. } = e {
                term.supersede(format!("a backend refused epoch {epoch}: {e}"));
            }
            return Err(Error::Provider {
                provider: "takeover",
                message: format!("node {name} at epoch {epoch}: {e}"),
            });
        }
        let node_shared = per_node(shared);
        let pods = pods::PodController::new(
            pods::Settings {
                node: name.clone(),
                host_ip: cfg.node_address.to_string(),
                epoch,
                concurrency: cfg.reconcile_concurrency,
                create_concurrency: cfg.create_concurrency,
                qps: cfg.kube_qps,
                burst: cfg.kube_burst,
                policy: policy.clone(),
                host: host.clone(),
                queue_timeout: cfg.queue_timeout,
                gc_interval: cfg.gc_interval,
                brake: cfg.brake,
                partition_fence_after: cfg.partition_fence_after,
                lifecycle_events: cfg.lifecycle_events,
                status_merge_window: cfg.status_merge_window,
                event_qps: cfg.event_qps,
                event_burst: cfg.event_burst,
                dra: cfg.dra.clone(),
            },
            clients.pods.clone(),
            clients.watch.clone(),
            Arc::clone(provider),
            node_shared.clone(),
        );
        listeners.entry(port).or_default().push(pods.index());
        configured.push((name, host, port, pods, node_shared));
    }
    // A kubelet API per port (each Node's own, or every Node's on a shared
    // one), listening before any Node says where it is.
    for (port, indexes) in listeners {
        let names: Vec<String> = indexes.iter().map(|i| i.node().to_owned()).collect();
        let names: Vec<&str> = names.iter().map(String::as_str).collect();
        let tls = kubelet_api::tls::server_config(&cfg.tls, &names, cfg.node_address)
            .map_err(kubelet_api::ApiError::from)?;
        let what = format!("kubelet API of node {}", names.join(", "));
        let server = kubelet_api::KubeletApi::new(
            indexes,
            clients.pods.clone(),
            cfg.anonymous_auth,
            nodes_served,
            Arc::clone(&shared.metrics),
        )
        .serve_with(
            (cfg.kubelet_bind, port).into(),
            tls,
            cfg.kubelet_api,
            work.clone(),
        )
        .await?;
        tasks.adopt(what, server);
    }
    for (name, host, port, pods, node_shared) in configured {
        let agent = node::NodeAgent::new(
            node::Settings {
                name: name.clone(),
                address: cfg.node_address.to_string(),
                kubelet_port: port,
                resource_metrics_path: cfg
                    .shared_kubelet_port
                    .then(|| kubelet_api::nodes::resource_metrics_path(&name)),
                labels: cfg.node_labels.clone(),
                taints: cfg.node_taints.clone(),
                max_pods: cfg.max_pods,
                lease_renew_interval: cfg.lease_renew_interval,
                lease_duration: cfg.lease_duration,
                status_report_interval: cfg.status_report_interval,
                policy: cfg.policy.to_string(),
                host,
                dra: cfg.dra.clone(),
            },
            clients.node.clone(),
            Arc::clone(provider),
            Arc::clone(&node_shared.last_lease_renewal),
        )
        .with_metrics(Arc::clone(&shared.metrics));
        let (tx, rx) = watch::channel(false);
        registered.push(rx);
        tasks.spawn(
            format!("node agent of node {name}"),
            agent.run(work.clone(), tx),
        );
        tasks.spawn(
            format!("pod controller of node {name}"),
            Arc::clone(&pods).run(work.clone()),
        );
        tasks.spawn(
            format!("GPU usage of node {name}"),
            gpu_usage::run(pods.index(), Arc::clone(&shared.metrics), work.clone()),
        );
        binding_sides.push(dra::binding::NodeSide {
            node: name.clone(),
            per_host: cfg.node_mode == config::NodeMode::PerHost,
            admitter: pods.admitter(),
            queue_timeout: cfg.queue_timeout,
        });
        controllers.push(pods);
        info!(node = %name, port, "virtual node configured");
    }
    // One reader of the backend's events for every node, routing each to
    // the node that holds its Pod.
    tasks.spawn(
        "provider events",
        pods::route_backend_events(Arc::clone(provider), controllers.clone(), work.clone()),
    );
    if let Some(dra) = cfg.dra.clone().filter(|d| d.binding_conditions) {
        let binder = Arc::new(dra::binding::Binder::new(
            clients.pods.clone(),
            dra,
            binding_sides,
            Arc::clone(&shared.metrics),
            Arc::clone(&shared.decisions),
            epoch,
        ));
        tasks.spawn("DRA admission before binding", binder.run(work.clone()));
    }
    admin_state.set_active(
        registered,
        controllers.iter().map(pods::PodController::index).collect(),
    );
    info!(
        nodes = controllers.len(),
        provider = provider.name(),
        epoch,
        "vkd starting"
    );
    tasks.join().await.map_err(Error::from)
}

/// What one node's controller shares: the daemon's, with a lease clock of
/// its own, so one node's renewals never hide another's failure from its
/// partition watch (per-host mode runs many nodes in one process).
fn per_node(shared: &pods::Shared) -> pods::Shared {
    pods::Shared {
        last_lease_renewal: Arc::default(),
        ..shared.clone()
    }
}

#[cfg(test)]
mod per_node_tests {
    use std::sync::Arc;
    use std::sync::atomic::Ordering;

    /// Per-host mode: host-a's renewals leave host-b's clock where it was, so
    /// host-b's partition watch still sees its own lease go unrenewed; what
    /// the term shares (the partition-fenced Pods, the metrics) stays shared.
    #[test]
    fn each_node_keeps_its_own_lease_clock() {
        let daemon = crate::testing::shared(Arc::default());
        let (a, b) = (super::per_node(&daemon), super::per_node(&daemon));
        a.last_lease_renewal.store(1_000, Ordering::Release);
        assert_eq!(b.last_lease_renewal.load(Ordering::Acquire), 0);
        assert!(Arc::ptr_eq(&a.partition_fenced, &b.partition_fenced));
        assert!(Arc::ptr_eq(&a.metrics, &b.metrics));
    }
}

#[cfg(test)]
pub(crate) mod testing {
    //! Fakes for unit tests: an in-process API server and a provider.

    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex};
    use std::time::{Duration, SystemTime};

    use async_trait::async_trait;
    use futures::StreamExt;
    use futures::stream::BoxStream;
    use http_body_util::BodyExt;
    use hyper::http;
    use serde_json::{Value, json};
    use vkd_provider::{
        Admission, Capacity, CapacityKind, Fence, Health, Instance, InstanceEvent, InstanceSpec,
        Provider, ProviderError, Result,
    };

    /// One request the fake API server received.
    #[derive(Clone, Debug)]
    pub(crate) struct Seen {
        pub method: String,
        pub path: String,
        pub body: Value,
    }

    pub(crate) type Log = Arc<Mutex<Vec<Seen>>>;

    /// A `kube::Client` answered in-process by `answer` (status code, JSON body);
    /// every request is recorded in the returned log.
    pub(crate) fn fake_api(
        answer: impl Fn(&Seen) -> (u16, Value) + Send + Sync + 'static,
    ) -> (kube::Client, Log) {
        let log: Log = Arc::default();
        let answer = Arc::new(answer);
        let seen = Arc::clone(&log);
        let service = tower::service_fn(move |req: http::Request<kube::client::Body>| {
            let (answer, seen) = (Arc::clone(&answer), Arc::clone(&seen));
            async move {
                let (parts, body) = req.into_parts();
                let bytes = body
                    .collect()
                    .await
                    .map(|b| b.to_bytes())
                    .unwrap_or_default();
                let request = Seen {
                    method: parts.method.to_string(),
                    path: parts.uri.path().to_owned(),
                    body: serde_json::from_slice(&bytes).unwrap_or(Value::Null),
                };
                let (code, reply) = answer(&request);
                seen.lock().unwrap().push(request);
                let response = http::Response::builder()
                    .status(code)
                    .header("content-type", "application/json")
                    .body(http_body_util::Full::new(bytes::Bytes::from(
                        reply.to_string(),
                    )))
                    .unwrap();
                Ok::<_, std::convert::Infallible>(response)
            }
        });
        (kube::Client::new(service, "default"), log)
    }

    /// What the Pod controllers share, for one at epoch 1 with these metrics.
    pub(crate) fn shared(metrics: Arc<crate::metrics::Metrics>) -> crate::pods::Shared {
        crate::pods::Shared {
            metrics,
            term: crate::fencing::term::Term::new(1, &tokio_util::sync::CancellationToken::new()),
            last_lease_renewal: Arc::default(),
            partition_fenced: Arc::default(),
            services: None,
            decisions: Arc::new(crate::explain::DecisionLog::new("test", 64)),
            leadership: crate::explain::Leadership {
                replica: "test".into(),
                epoch: 1,
                since: SystemTime::UNIX_EPOCH,
                elected: false,
            },
        }
    }

    /// A Kubernetes Status body for an error answer.
    pub(crate) fn status(code: u16, reason: &str) -> (u16, Value) {
        (
            code,
            json!({"apiVersion": "v1", "kind": "Status", "status": "Failure",
                   "message": reason, "reason": reason, "code": code}),
        )
    }

    /// A provider that counts its calls; `capacity()` answers the first
    /// `capacity_answers` calls and never returns after that.
    #[derive(Debug)]
    pub(crate) struct FakeProvider {
        calls: Mutex<Vec<&'static str>>,
        capacity_answers: usize,
        capacity_asked: AtomicUsize,
        health: Mutex<Health>,
    }

    impl FakeProvider {
        pub(crate) fn new(capacity_answers: usize) -> Arc<Self> {
            Arc::new(Self {
                calls: Mutex::default(),
                capacity_answers,
                capacity_asked: AtomicUsize::new(0),
                health: Mutex::new(Health::Healthy),
            })
        }

        /// What `health()` answers from now on.
        pub(crate) fn set_health(&self, health: Health) {
            *self.health.lock().unwrap() = health;
        }

        /// Calls made so far: of `op`, or of every operation with `None`.
        pub(crate) fn calls(&self, op: Option<&str>) -> usize {
            let calls = self.calls.lock().unwrap();
            calls.iter().filter(|c| op.is_none_or(|o| o == **c)).count()
        }

        fn called(&self, op: &'static str) {
            self.calls.lock().unwrap().push(op);
        }
    }

    #[async_trait]
    impl Provider for FakeProvider {
        fn name(&self) -> &str {
            "fake"
        }
        async fn health(&self) -> Health {
            self.called("health");
            self.health.lock().unwrap().clone()
        }
        async fn capacity(&self) -> Result<Capacity> {
            self.called("capacity");
            if self.capacity_asked.fetch_add(1, Ordering::SeqCst) >= self.capacity_answers {
                std::future::pending::<()>().await;
            }
            Ok(Capacity {
                hosts: Vec::new(),
                kind: CapacityKind::Live,
                observed_at: SystemTime::now(),
                refresh_interval: Duration::from_secs(10),
            })
        }
        async fn admit(&self, _spec: &InstanceSpec) -> Result<Admission> {
            self.called("admit");
            Ok(Admission::Queued {
                reason: "fake".into(),
            })
        }
        async fn create(&self, _fence: &Fence, _spec: &InstanceSpec) -> Result<Instance> {
            self.called("create");
            Err(ProviderError::transient("fake"))
        }
        async fn get(&self, _uid: &str) -> Result<Option<Instance>> {
            self.called("get");
            Ok(None)
        }
        async fn delete(&self, _fence: &Fence, _uid: &str, _grace: Duration) -> Result<()> {
            self.called("delete");
            Ok(())
        }
        async fn list(&self, _node: &str) -> Result<Vec<Instance>> {
            self.called("list");
            Ok(Vec::new())
        }
        fn events(&self) -> BoxStream<'static, InstanceEvent> {
            futures::stream::pending().boxed()
        }
        async fn start_ephemeral(
            &self,
            _fence: &Fence,
            _uid: &str,
            _container: &vkd_provider::ContainerSpec,
        ) -> Result<()> {
            self.called("start_ephemeral");
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_that_would_be_one_node_are_refused() {
        let node = |name: &str, host: &str| (name.to_owned(), Some(host.to_owned()), 10250);
        let fine = vec![node("vk-gpu-1", "gpu_1"), node("vk-gpu-2", "gpu_2")];
        assert_eq!(distinct_nodes(fine.clone()).expect("distinct"), fine);
        let twice = vec![node("vk-gpu-1", "gpu_1"), node("vk-gpu-1", "gpu.1")];
        let why = distinct_nodes(twice).expect_err("one Node").to_string();
        assert!(
            why.contains("\"gpu_1\" and \"gpu.1\" would both be Node vk-gpu-1"),
            "{why}"
        );
    }
}
