//! Command line, environment and config file, merged and validated into [`Config`].
//!
//! Precedence: a flag, then its environment variable, then the config file
//! (`--config`, YAML with the flags' names as keys), then the default. Any invalid
//! value is a [`ConfigError`] that names the field; `main` exits 64 (EX_USAGE).

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};
use serde::Deserialize;

/// Pod writes per second when neither flag nor file says (`--kube-qps`).
pub const DEFAULT_KUBE_QPS: u32 = 1000;
/// `--kube-burst` when unset.
pub const DEFAULT_KUBE_BURST: u32 = 2000;
/// The kubelet's --event-qps and --event-burst defaults.
const DEFAULT_EVENT_QPS: u32 = 50;
const DEFAULT_EVENT_BURST: u32 = 100;
/// `--reconcile-concurrency` when unset.
pub const DEFAULT_RECONCILE_CONCURRENCY: usize = 64;
/// `--create-concurrency` when unset.
pub const DEFAULT_CREATE_CONCURRENCY: usize = 16;
#[derive(Debug, Parser)]
#[command(name = "vkd", version, about = "A Virtual Kubelet provider daemon")]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Register the virtual node and run its Pods on the provider.
    Run(Box<RunArgs>),
    /// Inspect the simulated backend from outside the daemon.
    #[command(subcommand)]
    Sim(SimCommand),
    /// Inspect the process backend from outside the daemon.
    #[command(subcommand)]
    Process(ProcessCommand),
    /// Why a Pod waits, why an instance exists, why nothing moved: evidence
    /// from the Pod to the backend, with its sources.
    Explain(crate::cli::explain::ExplainArgs),
    /// Serve an in-tree provider over the provider protocol, as a plugin for
    /// `vkd run --provider grpc` (docs/provider-protocol.md).
    ProviderServe(crate::cli::provider::ProviderServeArgs),
    /// Check a provider plugin against the provider contract, over the wire,
    /// and report every check.
    ProviderConformance(crate::cli::provider::ProviderConformanceArgs),
}

#[derive(Debug, Subcommand)]
pub enum ProcessCommand {
    /// List the process backend's instances and their host processes.
    List {
        /// The daemon's state directory (the provider keeps its state in DIR/process).
        #[arg(long, env = "VKD_STATE_DIR")]
        state_dir: PathBuf,
        /// Only instances of this node.
        #[arg(long)]
        node: Option<String>,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Debug, Subcommand)]
pub enum SimCommand {
    /// List the sim backend's instances (what really runs), for comparing with Pods.
    List {
        /// The daemon's state directory (the sim keeps its state in DIR/sim).
        #[arg(long, env = "VKD_STATE_DIR")]
        state_dir: PathBuf,
        /// Only instances of this node.
        #[arg(long)]
        node: Option<String>,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Write an instance into the sim backend by hand, as someone starting
    /// one with the backend's own tool would: vkd did not make it, and a
    /// running daemon finds it at its next list (for drills of orphan
    /// collection and `vkd explain instance`).
    Create {
        /// The daemon's state directory (the sim keeps its state in DIR/sim).
        #[arg(long, env = "VKD_STATE_DIR")]
        state_dir: PathBuf,
        /// The virtual node the instance is labelled for.
        #[arg(long)]
        node: String,
        /// The Pod it claims to belong to, `NAMESPACE/NAME`.
        #[arg(long)]
        pod: String,
        /// The Pod UID it claims (default: a new random one, so no Pod owns it).
        #[arg(long)]
        uid: Option<String>,
        /// The host slice it runs on.
        #[arg(long, default_value = "host-a")]
        host: String,
        /// The epoch it claims to be made under.
        #[arg(long, default_value_t = 1)]
        epoch: u64,
    },
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

/// `vkd run` flags. Every flag has an environment fallback and a config-file key.
#[derive(Debug, Default, Args)]
pub struct RunArgs {
    /// YAML config file whose keys are the flag names (e.g. `node-name: vk-1`).
    #[arg(long, env = "VKD_CONFIG")]
    pub config: Option<PathBuf>,
    /// kubeconfig to use; in-cluster config when absent.
    #[arg(long, env = "KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
    /// Name of the virtual Node to register.
    #[arg(long, env = "VKD_NODE_NAME")]
    pub node_name: Option<String>,
    /// Backend: `process` (the default: Pods as local processes), `sim` (a
    /// simulated GPU fleet), `kubernetes` (Pods as Pods of a second cluster)
    /// or `grpc` (a provider plugin at --provider-endpoint).
    #[arg(long, env = "VKD_PROVIDER")]
    pub provider: Option<String>,
    /// Where the `grpc` provider's plugin listens: `unix:///path.sock[?peer-uid=N]`
    /// or `tls://host:port?cert=..&key=..&ca=..`; plain TCP is refused
    /// (docs/provider-protocol.md).
    #[arg(long, env = "VKD_PROVIDER_ENDPOINT")]
    pub provider_endpoint: Option<String>,
    /// The provider's own config file (`sim`: the fleet file; `process`: image map
    /// and run-as user, optional).
    #[arg(long, env = "VKD_PROVIDER_CONFIG")]
    pub provider_config: Option<PathBuf>,
    /// Where vkd and its providers keep state that outlives the process.
    #[arg(long, env = "VKD_STATE_DIR")]
    pub state_dir: Option<PathBuf>,
    /// The directory every vkd on the host shares to reserve the ports it
    /// serves (kubelet API, admin server), for good: the process provider
    /// never gives one out as a Pod's hostPort, also while its vkd restarts.
    /// Default /var/lib/vkd/host-ports; root's, writable by no one else.
    #[arg(long, env = "VKD_HOST_PORT_RESERVATIONS")]
    pub host_port_reservations: Option<PathBuf>,
    /// Port of the kubelet API, advertised in the Node's daemonEndpoints.
    #[arg(long, env = "VKD_KUBELET_PORT")]
    pub kubelet_port: Option<u16>,
    /// Address the kubelet API binds to. Default 0.0.0.0 (all interfaces), as
    /// the kubelet's --address: the API server connects to the Node's
    /// InternalIP (--node-address) on the kubelet port, whichever interface
    /// carries it, and every request is authenticated and authorized. Give the
    /// node address to listen on it alone.
    #[arg(long, env = "VKD_KUBELET_BIND")]
    pub kubelet_bind: Option<IpAddr>,
    /// Most kubelet API connections open at once per node listener (TLS
    /// handshakes and exec, attach and port-forward streams included); past it
    /// new connections are closed at once. Keep it, times the listeners, under
    /// the descriptor limit (`ulimit -n`). Default 512.
    #[arg(long, env = "VKD_KUBELET_API_MAX_CONNECTIONS")]
    pub kubelet_api_max_connections: Option<usize>,
    /// Most of those one client address may hold, so that one Pod (or any
    /// one peer) flooding the port leaves the rest to the API server and
    /// scrapers; past it that peer's new connections are closed at once.
    /// Default a quarter of --kubelet-api-max-connections (128).
    #[arg(long, env = "VKD_KUBELET_API_MAX_CONNECTIONS_PER_PEER")]
    pub kubelet_api_max_connections_per_peer: Option<usize>,
    /// How long a kubelet API client may take to send a request's headers,
    /// counted from the TLS handshake or the request's first byte (`30s`).
    #[arg(long, env = "VKD_KUBELET_API_HEADER_TIMEOUT")]
    pub kubelet_api_header_timeout: Option<String>,
    /// How long a kubelet API connection with no request in flight may wait
    /// for the next one (`90s`, the kubelet's). Responses being sent (`logs -f`)
    /// and exec, attach and port-forward streams are never cut.
    #[arg(long, env = "VKD_KUBELET_API_IDLE_TIMEOUT")]
    pub kubelet_api_idle_timeout: Option<String>,
    /// How long an exec, attach or port-forward stream may move no byte
    /// either way before it is closed (`4h`, the kubelet's flag and default).
    #[arg(long, env = "VKD_STREAMING_CONNECTION_IDLE_TIMEOUT")]
    pub streaming_connection_idle_timeout: Option<String>,
    /// Serving certificate (PEM) of the kubelet API; reloaded when it changes.
    /// Without it, a self-signed certificate for the node name and address is made at start.
    #[arg(long, env = "VKD_TLS_CERT_FILE")]
    pub tls_cert_file: Option<PathBuf>,
    /// Private key (PEM) of the serving certificate.
    #[arg(long, env = "VKD_TLS_PRIVATE_KEY_FILE")]
    pub tls_private_key_file: Option<PathBuf>,
    /// CA bundle (PEM) that client certificates must chain to (the apiserver's
    /// --kubelet-client-certificate is signed by it).
    #[arg(long, env = "VKD_CLIENT_CA_FILE")]
    pub client_ca_file: Option<PathBuf>,
    /// Let requests without credentials in as system:anonymous (still authorized).
    #[arg(long, env = "VKD_ANONYMOUS_AUTH")]
    pub anonymous_auth: Option<bool>,
    /// Port of the admin server (/livez, /readyz).
    #[arg(long, env = "VKD_ADMIN_PORT")]
    pub admin_port: Option<u16>,
    /// Address the admin server binds to.
    #[arg(long, env = "VKD_ADMIN_BIND")]
    pub admin_bind: Option<IpAddr>,
    /// The Node's InternalIP (and every Pod's hostIP); defaults to $POD_IP, then 127.0.0.1.
    #[arg(long, env = "VKD_NODE_ADDRESS")]
    pub node_address: Option<IpAddr>,
    /// Extra Node labels, `key=value`, repeatable or comma-separated.
    #[arg(long = "node-label", env = "VKD_NODE_LABELS", value_delimiter = ',')]
    pub node_labels: Vec<String>,
    /// Node taints `key=value:Effect`, replacing the default
    /// `virtual-kubelet.io/provider=<provider>:NoSchedule`; `none` for no taint.
    #[arg(long = "node-taint", env = "VKD_NODE_TAINTS", value_delimiter = ',')]
    pub node_taints: Vec<String>,
    /// Requests per second to the API server for Pod writes (lease renewals are
    /// separate). Default 1000: a guard against a runaway loop; the API
    /// server's priority and fairness is what bounds vkd in a busy cluster.
    #[arg(long, env = "VKD_KUBE_QPS")]
    pub kube_qps: Option<u32>,
    /// Burst above the QPS for Pod writes. Default 2000.
    #[arg(long, env = "VKD_KUBE_BURST")]
    pub kube_burst: Option<u32>,
    /// Pods reconciled at once (each mostly waits on the API server). Default 64.
    #[arg(long, env = "VKD_RECONCILE_CONCURRENCY")]
    pub reconcile_concurrency: Option<usize>,
    /// Workers that only create the instances of newly bound Pods and hand
    /// the status write to the other workers, so a new Pod never waits for a
    /// worker that waits on the API server. Default 16.
    #[arg(long, env = "VKD_CREATE_CONCURRENCY")]
    pub create_concurrency: Option<usize>,
    /// How long a connection to the API server may stay idle before it is
    /// closed: a burst opens one per busy worker, and each idle one holds
    /// about 70 KB of buffers. Default 10s.
    #[arg(long, env = "VKD_KUBE_IDLE_TIMEOUT")]
    pub kube_idle_timeout: Option<String>,
    /// Offer HTTP/2 for Pod writes and the Node: one connection for all of
    /// them, less memory and fewer handshakes, but the API server allows 100
    /// requests at once on it, which bounds a burst. Default false (HTTP/1.1).
    #[arg(long, env = "VKD_KUBE_HTTP2")]
    pub kube_http2: Option<bool>,
    /// Maximum Pods the node advertises; defaults to what the provider's hosts can hold.
    #[arg(long, env = "VKD_MAX_PODS")]
    pub max_pods: Option<u32>,
    /// Log format.
    #[arg(long, env = "VKD_LOG_FORMAT", value_enum)]
    pub log_format: Option<LogFormat>,
    /// Namespaces whose Pods may run on this node (others end Failed); default all.
    #[arg(
        long = "allowed-namespace",
        env = "VKD_ALLOWED_NAMESPACES",
        value_delimiter = ','
    )]
    pub allowed_namespaces: Vec<String>,
    /// Whether Secret content (env, volumes, ServiceAccount tokens) may be handed to the backend.
    #[arg(long, env = "VKD_ALLOW_SECRETS")]
    pub allow_secrets: Option<bool>,
    /// Whether ConfigMap content may be handed to the backend.
    #[arg(long, env = "VKD_ALLOW_CONFIG_MAPS")]
    pub allow_config_maps: Option<bool>,
    /// Whether hostPath volumes are allowed (default false).
    #[arg(long, env = "VKD_ALLOW_HOST_PATH")]
    pub allow_host_path: Option<bool>,
    /// Whether Pods may use the host's namespaces (hostNetwork, hostPID,
    /// hostIPC), privileged containers, or capabilities beyond the container
    /// runtime's default set (default false: each hands a Pod the host).
    #[arg(long, env = "VKD_ALLOW_PRIVILEGED")]
    pub allow_privileged: Option<bool>,
    /// `aggregate`: one Node for the whole backend; `per-host`: one Node per host
    /// slice, named `<node-name>-<host>`, each on its own kubelet port from --kubelet-port up
    /// (or all on one: --shared-kubelet-port).
    #[arg(long, env = "VKD_NODE_MODE", value_enum)]
    pub node_mode: Option<NodeMode>,
    /// Per-host mode: every Node on the one --kubelet-port, each Node's paths
    /// under `/nodes/<node>/` (its `metrics.k8s.io/resource-metrics-path` says
    /// where metrics-server finds its figures; docs/kubelet-api.md).
    #[arg(long, env = "VKD_SHARED_KUBELET_PORT")]
    pub shared_kubelet_port: Option<bool>,
    /// How long a Pod may wait for backend capacity before it fails (`10m`, `90s`).
    #[arg(long, env = "VKD_QUEUE_TIMEOUT")]
    pub queue_timeout: Option<String>,
    /// Active/passive replicas: act only while holding the leader Lease (default true).
    #[arg(long, env = "VKD_LEADER_ELECT")]
    pub leader_elect: Option<bool>,
    /// Namespace of the leader Lease; defaults to $POD_NAMESPACE, then `default`.
    #[arg(long, env = "VKD_LEADER_ELECTION_NAMESPACE")]
    pub leader_election_namespace: Option<String>,
    /// This replica's identity in the leader Lease; defaults to $POD_NAME, then the hostname.
    #[arg(long, env = "VKD_REPLICA_ID")]
    pub replica_id: Option<String>,
    /// How long the leader Lease is valid without renewal (`15s`).
    #[arg(long, env = "VKD_LEADER_LEASE_DURATION")]
    pub leader_lease_duration: Option<String>,
    /// How often orphans and duplicate instances are collected (`60s`).
    #[arg(long, env = "VKD_GC_INTERVAL")]
    pub gc_interval: Option<String>,
    /// The share of a node's instances one collection pass may delete as orphans (0.5).
    #[arg(long, env = "VKD_GC_MAX_DELETE_FRACTION")]
    pub gc_max_delete_fraction: Option<f64>,
    /// Delete orphans even past the brake: when the Pods really are gone.
    #[arg(long, env = "VKD_GC_ALLOW_MASS_DELETE")]
    pub gc_allow_mass_delete: Option<bool>,
    /// Stop `vkd.io/partition-policy: fence` instances after the node lease went
    /// unrenewed this long (`30s`); keep it below node-monitor-grace-period plus
    /// the Pods' unreachable toleration (docs/fencing.md).
    #[arg(long, env = "VKD_PARTITION_FENCE_AFTER")]
    pub partition_fence_after: Option<String>,
    /// A Normal Event when a Pod's instance is created (`InstanceCreated`, with
    /// the host, GPUs, instance id and epoch); queueing and failures always get
    /// one. Default true.
    #[arg(long, env = "VKD_LIFECYCLE_EVENTS")]
    pub lifecycle_events: Option<bool>,
    /// How long a new instance's ContainerCreating status is held back
    /// (`1s` by default, at most `10s`; `0s` writes it at once): an instance
    /// that starts within it gets one status write, Running, as the kubelet's
    /// status manager merges what changes before its sync. One that takes
    /// longer shows ContainerCreating when the window ends.
    #[arg(long, env = "VKD_STATUS_MERGE_WINDOW")]
    pub status_merge_window: Option<String>,
    /// One-off Pod Events per second to the API server, as the kubelet's
    /// --event-qps (default 50). Beyond it and its burst, the per-Pod
    /// `InstanceCreated` is dropped and counted rather than sent later; the
    /// others (queueing, failures) wait their turn.
    #[arg(long, env = "VKD_EVENT_QPS")]
    pub event_qps: Option<u32>,
    /// Burst above --event-qps, as the kubelet's --event-burst (default 100).
    #[arg(long, env = "VKD_EVENT_BURST")]
    pub event_burst: Option<u32>,
    /// How long one provider call may take before it fails as a transient
    /// error (`2m`, the kubelet's --runtime-request-timeout); a deletion also
    /// gets its grace period. Streaming calls are bounded only while starting.
    #[arg(long, env = "VKD_PROVIDER_TIMEOUT")]
    pub provider_timeout: Option<String>,
    /// Publish the hosts' GPUs as DRA ResourceSlices (resource.k8s.io/v1) and
    /// run Pods on the devices their ResourceClaims were allocated; the Node
    /// then no longer advertises `nvidia.com/gpu` (docs/dra.md). Default false.
    #[arg(long, env = "VKD_DRA")]
    pub dra: Option<bool>,
    /// The DRA driver name of the slices (default `gpu.vkd.io`; `gpu.nvidia.com`
    /// lets NVIDIA's DeviceClasses and claims match).
    #[arg(long, env = "VKD_DRA_DRIVER")]
    pub dra_driver: Option<String>,
    /// With --dra: the published devices carry binding conditions, so the
    /// scheduler binds a Pod only once the backend holds its placement, and a
    /// backend's refusal sends it back to scheduling (default true).
    #[arg(long, env = "VKD_DRA_BINDING_CONDITIONS")]
    pub dra_binding_conditions: Option<bool>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum NodeMode {
    #[default]
    Aggregate,
    PerHost,
}

/// The config file: the same names as the flags.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
struct FileConfig {
    kubeconfig: Option<PathBuf>,
    node_name: Option<String>,
    provider: Option<String>,
    provider_endpoint: Option<String>,
    provider_config: Option<PathBuf>,
    state_dir: Option<PathBuf>,
    host_port_reservations: Option<PathBuf>,
    kubelet_port: Option<u16>,
    kubelet_bind: Option<IpAddr>,
    kubelet_api_max_connections: Option<usize>,
    kubelet_api_max_connections_per_peer: Option<usize>,
    kubelet_api_header_timeout: Option<String>,
    kubelet_api_idle_timeout: Option<String>,
    streaming_connection_idle_timeout: Option<String>,
    tls_cert_file: Option<PathBuf>,
    tls_private_key_file: Option<PathBuf>,
    client_ca_file: Option<PathBuf>,
    anonymous_auth: Option<bool>,
    admin_port: Option<u16>,
    admin_bind: Option<IpAddr>,
    node_address: Option<IpAddr>,
    #[serde(default)]
    node_labels: BTreeMap<String, String>,
    node_taints: Option<Vec<String>>,
    kube_qps: Option<u32>,
    kube_burst: Option<u32>,
    event_qps: Option<u32>,
    event_burst: Option<u32>,
    reconcile_concurrency: Option<usize>,
    create_concurrency: Option<usize>,
    kube_idle_timeout: Option<String>,
    kube_http2: Option<bool>,
    max_pods: Option<u32>,
    log_format: Option<LogFormat>,
    allowed_namespaces: Option<Vec<String>>,
    allow_secrets: Option<bool>,
    allow_config_maps: Option<bool>,
    allow_host_path: Option<bool>,
    allow_privileged: Option<bool>,
    node_mode: Option<NodeMode>,
    shared_kubelet_port: Option<bool>,
    queue_timeout: Option<String>,
    leader_elect: Option<bool>,
    leader_election_namespace: Option<String>,
    replica_id: Option<String>,
    leader_lease_duration: Option<String>,
    gc_interval: Option<String>,
    gc_max_delete_fraction: Option<f64>,
    gc_allow_mass_delete: Option<bool>,
    partition_fence_after: Option<String>,
    lifecycle_events: Option<bool>,
    status_merge_window: Option<String>,
    provider_timeout: Option<String>,
    dra: Option<bool>,
    dra_driver: Option<String>,
    dra_binding_conditions: Option<bool>,
}

/// A configuration problem, naming the field.
#[derive(Debug, thiserror::Error)]
#[error("{field}: {message}")]
pub struct ConfigError {
    pub field: String,
    pub message: String,
}

pub(crate) fn bad(field: &str, message: impl Into<String>) -> ConfigError {
    ConfigError {
        field: field.to_owned(),
        message: message.into(),
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Taint {
    pub key: String,
    pub value: Option<String>,
    pub effect: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProviderKind {
    Process,
    Sim,
    Kubernetes,
    /// A plugin over the provider protocol.
    Grpc,
}

impl ProviderKind {
    pub fn name(self) -> &'static str {
        match self {
            Self::Process => "process",
            Self::Sim => "sim",
            Self::Kubernetes => "kubernetes",
            Self::Grpc => "grpc",
        }
    }
}

/// The validated configuration.
#[derive(Clone, Debug)]
pub struct Config {
    pub kubeconfig: Option<PathBuf>,
    pub node_name: String,
    pub provider: ProviderKind,
    /// Required for `sim`; optional for `process`.
    pub provider_config: Option<PathBuf>,
    /// Required for `grpc`: where its plugin listens.
    pub provider_endpoint: Option<vkd_grpc::Endpoint>,
    pub state_dir: PathBuf,
    /// Where every vkd on the host reserves its ports (`--host-port-reservations`).
    pub host_port_reservations: PathBuf,
    pub kubelet_port: u16,
    pub kubelet_bind: IpAddr,
    /// Connection cap and timeouts of the kubelet API.
    pub kubelet_api: crate::kubelet_api::Limits,
    pub tls: crate::kubelet_api::tls::TlsSettings,
    pub anonymous_auth: bool,
    pub admin_port: u16,
    pub admin_bind: IpAddr,
    pub node_address: IpAddr,
    pub node_labels: BTreeMap<String, String>,
    pub node_taints: Vec<Taint>,
    pub kube_qps: u32,
    pub kube_burst: u32,
    pub reconcile_concurrency: usize,
    pub create_concurrency: usize,
    pub kube_idle_timeout: Duration,
    pub kube_http2: bool,
    pub max_pods: Option<u32>,
    pub log_format: LogFormat,
    pub policy: crate::pods::spec::Policy,
    pub node_mode: NodeMode,
    /// Per-host mode: one kubelet port for every Node.
    pub shared_kubelet_port: bool,
    pub queue_timeout: Duration,
    /// `None`: leader election off (one replica, a fixed epoch).
    pub leader: Option<crate::fencing::leader::LeaderSettings>,
    pub gc_interval: Duration,
    pub brake: crate::fencing::Brake,
    pub partition_fence_after: Duration,
    pub lifecycle_events: bool,
    /// `--status-merge-window`.
    pub status_merge_window: Duration,
    pub event_qps: u32,
    pub event_burst: u32,
    /// The deadline of one provider call (`--provider-timeout`).
    pub provider_timeout: Duration,
    /// `None`: DRA off (`--dra`).
    pub dra: Option<crate::dra::Settings>,
    /// How often the node lease is renewed (the kubelet's 10 s).
    pub lease_renew_interval: Duration,
    /// The lease duration (the kubelet's 40 s).
    pub lease_duration: Duration,
    /// Status is posted on change, and at least this often (the kubelet's 5 min).
    pub status_report_interval: Duration,
}

/// The longest `--status-merge-window`: the kubelet's status manager syncs
/// every Pod's status at least this often.
const MAX_STATUS_MERGE_WINDOW: Duration = Duration::from_secs(10);

/// `--status-merge-window`: 1s unless given; `0s` turns merging off.
fn status_merge_window(v: Option<String>) -> Result<Duration, ConfigError> {
    let Some(t) = v else {
        return Ok(Duration::from_secs(1));
    };
    match vkd_provider::parse_duration(&t) {
        Some(d) if d <= MAX_STATUS_MERGE_WINDOW => Ok(d),
        Some(_) => Err(bad(
            "status-merge-window",
            format!(
                "{t:?} is longer than {}s: a state that lasts that long must be shown",
                MAX_STATUS_MERGE_WINDOW.as_secs()
            ),
        )),
        None => Err(bad(
            "status-merge-window",
            format!("{t:?} is not a duration like 1s or 500ms"),
        )),
    }
}

/// A DNS-1123 subdomain, as Node names must be.
fn check_node_name(name: &str) -> Result<(), ConfigError> {
    let ok = !name.is_empty()
        && name.len() <= 253
        && name.split('.').all(|part| {
            !part.is_empty()
                && part
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                && !part.starts_with('-')
                && !part.ends_with('-')
        });
    if ok {
        Ok(())
    } else {
        Err(bad(
            "node-name",
            format!("{name:?} is not a valid Node name (lowercase DNS-1123 subdomain)"),
        ))
    }
}

fn parse_taint(text: &str) -> Result<Taint, ConfigError> {
    let field = "node-taint";
    let (kv, effect) = text
        .rsplit_once(':')
        .ok_or_else(|| bad(field, format!("{text:?} is not key=value:Effect")))?;
    if !["NoSchedule", "PreferNoSchedule", "NoExecute"].contains(&effect) {
        return Err(bad(
            field,
            format!("{text:?}: effect {effect:?} is not NoSchedule, PreferNoSchedule or NoExecute"),
        ));
    }
    let (key, value) = match kv.split_once('=') {
        Some((k, v)) => (k, Some(v.to_owned())),
        None => (kv, None),
    };
    if key.is_empty() {
        return Err(bad(field, format!("{text:?} has an empty key")));
    }
    Ok(Taint {
        key: key.to_owned(),
        value,
        effect: effect.to_owned(),
    })
}

impl Config {
    /// Merges flags and env (already in `args`) over the config file and defaults.
    pub fn from_args(args: RunArgs) -> Result<Self, ConfigError> {
        let file = match &args.config {
            Some(path) => read_file(path)?,
            None => FileConfig::default(),
        };
        let node_name = args
            .node_name
            .or(file.node_name)
            .ok_or_else(|| bad("node-name", "required (flag --node-name or VKD_NODE_NAME)"))?;
        check_node_name(&node_name)?;
        let provider = match args.provider.or(file.provider).as_deref() {
            None | Some("process") => ProviderKind::Process,
            Some("sim") => ProviderKind::Sim,
            Some("kubernetes") => ProviderKind::Kubernetes,
            Some("grpc") => ProviderKind::Grpc,
            Some(other) => {
                return Err(bad(
                    "provider",
                    format!("unknown provider {other:?}; known: process, sim, kubernetes, grpc"),
                ));
            }
        };
        let provider_endpoint = args
            .provider_endpoint
            .or(file.provider_endpoint)
            .map(|e| e.parse::<vkd_grpc::Endpoint>())
            .transpose()
            .map_err(|e| bad("provider-endpoint", e.to_string()))?;
        if provider == ProviderKind::Grpc && provider_endpoint.is_none() {
            return Err(bad(
                "provider-endpoint",
                "required: the grpc provider needs its plugin's endpoint (unix:///path.sock, or tls://host:port?cert=..&key=..&ca=..)",
            ));
        }
        let provider_config = args.provider_config.or(file.provider_config);
        if provider == ProviderKind::Sim && provider_config.is_none() {
            return Err(bad(
                "provider-config",
                "required: the sim provider needs a fleet file",
            ));
        }
        if provider == ProviderKind::Kubernetes && provider_config.is_none() {
            return Err(bad(
                "provider-config",
                "required: the kubernetes provider needs its config (the downstream kubeconfig)",
            ));
        }
        let allowed_namespaces = if args.allowed_namespaces.is_empty() {
            file.allowed_namespaces.unwrap_or_default()
        } else {
            args.allowed_namespaces
        };
        let kubelet_port = args.kubelet_port.or(file.kubelet_port).unwrap_or(10250);
        let admin_port = args.admin_port.or(file.admin_port).unwrap_or(10256);
        if kubelet_port == 0 {
            return Err(bad("kubelet-port", "must be 1 to 65535"));
        }
        if admin_port == kubelet_port {
            return Err(bad(
                "admin-port",
                format!("{admin_port} is also the kubelet port"),
            ));
        }
        let policy = crate::pods::spec::Policy {
            allowed_namespaces: allowed_namespaces
                .into_iter()
                .filter(|n| !n.is_empty())
                .collect(),
            allow_secrets: args.allow_secrets.or(file.allow_secrets).unwrap_or(true),
            allow_config_maps: args
                .allow_config_maps
                .or(file.allow_config_maps)
                .unwrap_or(true),
            allow_host_path: args
                .allow_host_path
                .or(file.allow_host_path)
                .unwrap_or(false),
            allow_privileged: args
                .allow_privileged
                .or(file.allow_privileged)
                .unwrap_or(false),
            // Per-host mode adds the other nodes' kubelet ports (`crate::run`).
            node_ports: BTreeMap::from([
                (
                    kubelet_port,
                    "vkd's kubelet API (--kubelet-port)".to_owned(),
                ),
                (admin_port, "vkd's admin server (--admin-port)".to_owned()),
            ]),
        };
        let node_address = match args.node_address.or(file.node_address) {
            Some(a) => a,
            None => match std::env::var("POD_IP") {
                Ok(ip) if !ip.is_empty() => ip.parse().map_err(|_| {
                    bad(
                        "node-address",
                        format!("$POD_IP {ip:?} is not an IP address"),
                    )
                })?,
                _ => IpAddr::from([127, 0, 0, 1]),
            },
        };
        let mut node_labels = file.node_labels;
        for l in &args.node_labels {
            let (k, v) = l
                .split_once('=')
                .ok_or_else(|| bad("node-label", format!("{l:?} is not key=value")))?;
            if k.is_empty() {
                return Err(bad("node-label", format!("{l:?} has an empty key")));
            }
            node_labels.insert(k.to_owned(), v.to_owned());
        }
        let taint_texts = if args.node_taints.is_empty() {
            file.node_taints
        } else {
            Some(args.node_taints)
        };
        let node_taints = match taint_texts {
            None => vec![Taint {
                key: "virtual-kubelet.io/provider".into(),
                value: Some(provider.name().into()),
                effect: "NoSchedule".into(),
            }],
            Some(list) if list.iter().any(|t| t == "none") => Vec::new(),
            Some(list) => list
                .iter()
                .map(|t| parse_taint(t))
                .collect::<Result<_, _>>()?,
        };
        let tls = crate::kubelet_api::tls::TlsSettings {
            cert_file: args.tls_cert_file.or(file.tls_cert_file),
            key_file: args.tls_private_key_file.or(file.tls_private_key_file),
            client_ca_file: args.client_ca_file.or(file.client_ca_file),
        };
        if tls.cert_file.is_some() != tls.key_file.is_some() {
            return Err(bad(
                "tls-cert-file",
                "--tls-cert-file and --tls-private-key-file must be given together",
            ));
        }
        for (field, path) in [
            ("tls-cert-file", &tls.cert_file),
            ("tls-private-key-file", &tls.key_file),
            ("client-ca-file", &tls.client_ca_file),
        ] {
            if let Some(p) = path
                && !p.is_file()
            {
                return Err(bad(
                    field,
                    format!("{} is not a readable file", p.display()),
                ));
            }
        }
        // One node here carries thousands of Pods, not a kubelet's hundred: the
        // API server's priority and fairness is the real limit, this only a guard.
        let kube_qps = args.kube_qps.or(file.kube_qps).unwrap_or(DEFAULT_KUBE_QPS);
        let kube_burst = args
            .kube_burst
            .or(file.kube_burst)
            .unwrap_or(DEFAULT_KUBE_BURST);
        if kube_qps == 0 {
            return Err(bad("kube-qps", "must be at least 1"));
        }
        if kube_burst == 0 {
            return Err(bad("kube-burst", "must be at least 1"));
        }
        let event_qps = args
            .event_qps
            .or(file.event_qps)
            .unwrap_or(DEFAULT_EVENT_QPS);
        let event_burst = args
            .event_burst
            .or(file.event_burst)
            .unwrap_or(DEFAULT_EVENT_BURST);
        if event_qps == 0 {
            return Err(bad("event-qps", "must be at least 1"));
        }
        if event_burst == 0 {
            return Err(bad("event-burst", "must be at least 1"));
        }
        let duration = |field: &str,
                        v: Option<String>,
                        default: u64|
         -> Result<Duration, ConfigError> {
            match v {
                None => Ok(Duration::from_secs(default)),
                Some(t) => vkd_provider::parse_duration(&t)
                    .filter(|d| !d.is_zero())
                    .ok_or_else(|| bad(field, format!("{t:?} is not a duration like 90s or 10m"))),
            }
        };
        let queue_timeout = duration(
            "queue-timeout",
            args.queue_timeout.or(file.queue_timeout),
            600,
        )?;
        let gc_interval = duration("gc-interval", args.gc_interval.or(file.gc_interval), 60)?;
        let kube_idle_timeout = duration(
            "kube-idle-timeout",
            args.kube_idle_timeout.or(file.kube_idle_timeout),
            10,
        )?;
        let max_connections = match args
            .kubelet_api_max_connections
            .or(file.kubelet_api_max_connections)
        {
            None => crate::kubelet_api::DEFAULT_MAX_CONNECTIONS,
            Some(0) => return Err(bad("kubelet-api-max-connections", "must be at least 1")),
            Some(n) => n,
        };
        let kubelet_api = crate::kubelet_api::Limits {
            max_connections,
            max_connections_per_peer: match args
                .kubelet_api_max_connections_per_peer
                .or(file.kubelet_api_max_connections_per_peer)
            {
                None => crate::kubelet_api::default_per_peer(max_connections),
                Some(0) => {
                    return Err(bad(
                        "kubelet-api-max-connections-per-peer",
                        "must be at least 1",
                    ));
                }
                Some(n) => n,
            },
            header_timeout: duration(
                "kubelet-api-header-timeout",
                args.kubelet_api_header_timeout
                    .or(file.kubelet_api_header_timeout),
                crate::kubelet_api::DEFAULT_HEADER_TIMEOUT.as_secs(),
            )?,
            idle_timeout: duration(
                "kubelet-api-idle-timeout",
                args.kubelet_api_idle_timeout
                    .or(file.kubelet_api_idle_timeout),
                crate::kubelet_api::DEFAULT_IDLE_TIMEOUT.as_secs(),
            )?,
            stream_idle_timeout: duration(
                "streaming-connection-idle-timeout",
                args.streaming_connection_idle_timeout
                    .or(file.streaming_connection_idle_timeout),
                crate::kubelet_api::DEFAULT_STREAM_IDLE_TIMEOUT.as_secs(),
            )?,
            ..Default::default()
        };
        let provider_timeout = duration(
            "provider-timeout",
            args.provider_timeout.or(file.provider_timeout),
            120,
        )?;
        let dra_driver = args
            .dra_driver
            .or(file.dra_driver)
            .unwrap_or_else(|| crate::dra::devices::VKD_DOMAIN.to_owned());
        if dra_driver.len() > 63 || check_node_name(&dra_driver).is_err() {
            return Err(bad(
                "dra-driver",
                format!("{dra_driver:?} is not a DNS subdomain of at most 63 characters"),
            ));
        }
        let dra = args
            .dra
            .or(file.dra)
            .unwrap_or(false)
            .then(|| crate::dra::Settings {
                driver: dra_driver,
                binding_conditions: args
                    .dra_binding_conditions
                    .or(file.dra_binding_conditions)
                    .unwrap_or(true),
            });
        let status_merge_window =
            status_merge_window(args.status_merge_window.or(file.status_merge_window))?;
        let partition_fence_after = duration(
            "partition-fence-after",
            args.partition_fence_after.or(file.partition_fence_after),
            30,
        )?;
        let lease_duration = duration(
            "leader-lease-duration",
            args.leader_lease_duration.or(file.leader_lease_duration),
            15,
        )?;
        if lease_duration < Duration::from_secs(3) {
            return Err(bad("leader-lease-duration", "must be at least 3s"));
        }
        let max_fraction = args
            .gc_max_delete_fraction
            .or(file.gc_max_delete_fraction)
            .unwrap_or(0.5);
        if !(0.0..=1.0).contains(&max_fraction) {
            return Err(bad("gc-max-delete-fraction", "must be between 0 and 1"));
        }
        let brake = crate::fencing::Brake {
            max_fraction,
            allow_mass_delete: args
                .gc_allow_mass_delete
                .or(file.gc_allow_mass_delete)
                .unwrap_or(false),
            ..Default::default()
        };
        let env = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        let leader = args
            .leader_elect
            .or(file.leader_elect)
            .unwrap_or(true)
            .then(|| crate::fencing::leader::LeaderSettings {
                namespace: args
                    .leader_election_namespace
                    .clone()
                    .or(file.leader_election_namespace.clone())
                    .or_else(|| env("POD_NAMESPACE"))
                    .unwrap_or_else(|| "default".into()),
                name: format!("vkd-{node_name}"),
                identity: args
                    .replica_id
                    .clone()
                    .or(file.replica_id.clone())
                    .or_else(|| env("POD_NAME"))
                    .unwrap_or_else(hostname),
                lease_duration,
                // Stop acting well before anyone else may start (client-go's 15/10/2).
                renew_deadline: lease_duration * 2 / 3,
                retry_period: (lease_duration / 7).max(Duration::from_millis(500)),
            });
        let workers = |flag: Option<usize>, file: Option<usize>, default, field| {
            let n = flag.or(file).unwrap_or(default);
            if (1..=4096).contains(&n) {
                Ok(n)
            } else {
                Err(bad(field, "must be 1 to 4096"))
            }
        };
        let reconcile_concurrency = workers(
            args.reconcile_concurrency,
            file.reconcile_concurrency,
            DEFAULT_RECONCILE_CONCURRENCY,
            "reconcile-concurrency",
        )?;
        let create_concurrency = workers(
            args.create_concurrency,
            file.create_concurrency,
            DEFAULT_CREATE_CONCURRENCY,
            "create-concurrency",
        )?;
        Ok(Self {
            kubeconfig: args.kubeconfig.or(file.kubeconfig),
            node_name,
            provider,
            provider_config,
            provider_endpoint,
            state_dir: args
                .state_dir
                .or(file.state_dir)
                .unwrap_or_else(|| PathBuf::from("/var/lib/vkd")),
            host_port_reservations: args
                .host_port_reservations
                .or(file.host_port_reservations)
                .unwrap_or_else(|| PathBuf::from(vkd_process::hostport::DEFAULT_RESERVATIONS)),
            kubelet_port,
            kubelet_bind: args
                .kubelet_bind
                .or(file.kubelet_bind)
                .unwrap_or(IpAddr::from([0, 0, 0, 0])),
            kubelet_api,
            tls,
            anonymous_auth: args.anonymous_auth.or(file.anonymous_auth).unwrap_or(false),
            admin_port,
            admin_bind: args
                .admin_bind
                .or(file.admin_bind)
                .unwrap_or(IpAddr::from([127, 0, 0, 1])),
            node_address,
            node_labels,
            node_taints,
            kube_qps,
            kube_burst,
            reconcile_concurrency,
            create_concurrency,
            kube_idle_timeout,
            kube_http2: args.kube_http2.or(file.kube_http2).unwrap_or(false),
            max_pods: args.max_pods.or(file.max_pods),
            log_format: args.log_format.or(file.log_format).unwrap_or_default(),
            policy,
            node_mode: args.node_mode.or(file.node_mode).unwrap_or_default(),
            shared_kubelet_port: args
                .shared_kubelet_port
                .or(file.shared_kubelet_port)
                .unwrap_or(false),
            queue_timeout,
            leader,
            gc_interval,
            brake,
            partition_fence_after,
            lifecycle_events: args
                .lifecycle_events
                .or(file.lifecycle_events)
                .unwrap_or(true),
            status_merge_window,
            event_qps,
            event_burst,
            provider_timeout,
            dra,
            lease_renew_interval: Duration::from_secs(10),
            lease_duration: Duration::from_secs(40),
            status_report_interval: Duration::from_secs(300),
        })
    }
}

pub(crate) fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_owned())
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "vkd".into())
}

fn read_file(path: &Path) -> Result<FileConfig, ConfigError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| bad("config", format!("reading {}: {e}", path.display())))?;
    serde_yaml_ng::from_str(&text).map_err(|e| bad("config", format!("{}: {e}", path.display())))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(node: &str) -> RunArgs {
        RunArgs {
            node_name: Some(node.into()),
            provider_config: Some("fleet.yaml".into()),
            ..Default::default()
        }
    }

    #[test]
    fn defaults_follow_the_kubelet() {
        let c = Config::from_args(args("vk-1")).unwrap();
        assert_eq!(c.kubelet_port, 10250);
        assert_eq!(c.lease_duration, Duration::from_secs(40));
        assert_eq!(c.provider, ProviderKind::Process);
        assert_eq!(
            c.node_taints,
            [Taint {
                key: "virtual-kubelet.io/provider".into(),
                value: Some("process".into()),
                effect: "NoSchedule".into()
            }]
        );
        assert!(c.policy.allowed_namespaces.is_empty() && !c.policy.allow_host_path);
        assert!(c.policy.allow_secrets && c.policy.allow_config_maps);
        assert!(!c.policy.allow_privileged);
        assert_eq!(
            c.policy.node_ports.keys().copied().collect::<Vec<_>>(),
            [10250, 10256]
        );
    }

    #[test]
    fn the_status_merge_window_is_a_second_unless_set() {
        let c = Config::from_args(args("vk")).unwrap();
        assert_eq!(c.status_merge_window, Duration::from_secs(1));
        let with = |t: &str| {
            let mut a = args("vk");
            a.status_merge_window = Some(t.into());
            Config::from_args(a)
        };
        assert_eq!(with("0s").unwrap().status_merge_window, Duration::ZERO);
        assert_eq!(
            with("250ms").unwrap().status_merge_window,
            Duration::from_millis(250)
        );
        for bad in ["11s", "1h", "soon", "-1s"] {
            let e = with(bad).unwrap_err();
            assert_eq!(e.field, "status-merge-window", "{bad}");
            assert!(e.to_string().contains(bad), "{e}");
        }
    }

    #[test]
    fn policy_flags_are_read() {
        let mut a = args("vk");
        a.allowed_namespaces = vec!["team-a".into(), "team-b".into()];
        a.allow_secrets = Some(false);
        a.allow_host_path = Some(true);
        a.allow_privileged = Some(true);
        a.kubelet_port = Some(11250);
        let c = Config::from_args(a).unwrap();
        assert_eq!(c.policy.allowed_namespaces, ["team-a", "team-b"]);
        assert!(!c.policy.allow_secrets && c.policy.allow_host_path);
        assert!(c.policy.allow_privileged);
        assert!(c.policy.node_ports[&11250].contains("--kubelet-port"));
        assert!(c.policy.node_ports[&10256].contains("--admin-port"));
        // The flags as written on a command line.
        let Command::Run(run) = Cli::try_parse_from([
            "vkd",
            "run",
            "--allow-privileged",
            "true",
            "--kubelet-api-max-connections-per-peer",
            "64",
        ])
        .unwrap()
        .command
        else {
            panic!("not run");
        };
        assert_eq!(run.allow_privileged, Some(true));
        assert_eq!(run.kubelet_api_max_connections_per_peer, Some(64));
        // The process provider runs without a config file (no image mapped); sim does not.
        let mut a = args("vk");
        a.provider_config = None;
        assert!(Config::from_args(a).unwrap().provider_config.is_none());
    }

    #[test]
    fn errors_name_the_field() {
        let e = Config::from_args(args("Not_A_Node")).unwrap_err();
        assert_eq!(e.field, "node-name");
        let mut a = args("vk");
        a.provider = Some("cloud".into());
        assert_eq!(Config::from_args(a).unwrap_err().field, "provider");
        let mut a = args("vk");
        a.node_taints = vec!["k=v:Sometimes".into()];
        assert_eq!(Config::from_args(a).unwrap_err().field, "node-taint");
        let mut a = args("vk");
        a.node_labels = vec!["novalue".into()];
        assert_eq!(Config::from_args(a).unwrap_err().field, "node-label");
        let mut a = args("vk");
        a.provider = Some("sim".into());
        a.provider_config = None;
        assert_eq!(Config::from_args(a).unwrap_err().field, "provider-config");
        let mut a = args("vk");
        a.provider = Some("kubernetes".into());
        a.provider_config = None;
        assert_eq!(Config::from_args(a).unwrap_err().field, "provider-config");
        let mut a = args("vk");
        a.provider = Some("grpc".into());
        assert_eq!(
            Config::from_args(a).unwrap_err().field,
            "provider-endpoint",
            "a plugin needs its endpoint"
        );
        let mut a = args("vk");
        a.provider = Some("grpc".into());
        a.provider_endpoint = Some("unix://relative.sock".into());
        assert_eq!(Config::from_args(a).unwrap_err().field, "provider-endpoint");
        let mut a = args("vk");
        a.provider = Some("grpc".into());
        a.provider_endpoint = Some("unix:///run/vkd/provider.sock".into());
        let c = Config::from_args(a).unwrap();
        assert_eq!(c.provider, ProviderKind::Grpc);
        assert_eq!(
            c.provider_endpoint,
            Some(vkd_grpc::Endpoint::unix("/run/vkd/provider.sock"))
        );
        // Plain TCP authenticates no one, and a Pod sharing the host's
        // network reaches its loopback.
        for plain in ["tcp://127.0.0.1:7070", "http://127.0.0.1:7070"] {
            let mut a = args("vk");
            a.provider = Some("grpc".into());
            a.provider_endpoint = Some(plain.into());
            let e = Config::from_args(a).unwrap_err();
            assert_eq!(e.field, "provider-endpoint");
            assert!(e.message.contains("plain TCP is refused"), "{}", e.message);
        }
        let mut a = args("vk");
        a.admin_port = Some(10250);
        assert_eq!(Config::from_args(a).unwrap_err().field, "admin-port");
        let mut a = args("vk");
        a.create_concurrency = Some(0);
        assert_eq!(
            Config::from_args(a).unwrap_err().field,
            "create-concurrency",
            "new Pods need workers of their own"
        );
        assert_eq!(
            Config::from_args(args("vk")).unwrap().create_concurrency,
            DEFAULT_CREATE_CONCURRENCY
        );
        let mut a = args("vk");
        a.kube_idle_timeout = Some("0s".into());
        assert_eq!(Config::from_args(a).unwrap_err().field, "kube-idle-timeout");
    }

    #[test]
    fn kubelet_api_limits_are_read() {
        let c = Config::from_args(args("vk")).unwrap();
        assert_eq!(c.kubelet_api, crate::kubelet_api::Limits::default());
        assert_eq!(c.kubelet_api.max_connections_per_peer, 128);
        assert_eq!(c.kubelet_bind, IpAddr::from([0, 0, 0, 0]));
        let mut a = args("vk");
        a.kubelet_api_max_connections = Some(8);
        a.kubelet_api_header_timeout = Some("5s".into());
        a.kubelet_api_idle_timeout = Some("2m".into());
        let c = Config::from_args(a).unwrap().kubelet_api;
        assert_eq!(c.max_connections, 8);
        assert_eq!(c.max_connections_per_peer, 2, "a quarter of the slots");
        assert_eq!(c.header_timeout, Duration::from_secs(5));
        assert_eq!(c.idle_timeout, Duration::from_secs(120));
        let mut a = args("vk");
        a.kubelet_api_max_connections = Some(3);
        let c = Config::from_args(a).unwrap().kubelet_api;
        assert_eq!(c.max_connections_per_peer, 1, "never none");
        let mut a = args("vk");
        a.kubelet_api_max_connections_per_peer = Some(64);
        assert_eq!(
            Config::from_args(a)
                .unwrap()
                .kubelet_api
                .max_connections_per_peer,
            64
        );
        let mut a = args("vk");
        a.kubelet_api_max_connections_per_peer = Some(0);
        assert_eq!(
            Config::from_args(a).unwrap_err().field,
            "kubelet-api-max-connections-per-peer"
        );
        let mut a = args("vk");
        a.kubelet_api_max_connections = Some(0);
        assert_eq!(
            Config::from_args(a).unwrap_err().field,
            "kubelet-api-max-connections"
        );
        let mut a = args("vk");
        a.kubelet_api_idle_timeout = Some("0s".into());
        assert_eq!(
            Config::from_args(a).unwrap_err().field,
            "kubelet-api-idle-timeout"
        );
    }

    #[test]
    fn file_is_merged_under_flags() {
        let dir = std::env::temp_dir().join(format!("vkd-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("vkd.yaml");
        std::fs::write(
            &path,
            "node-name: from-file\nkubelet-port: 11250\nnode-labels: {zone: a}\nnode-taints: [none]\n\
             allow-privileged: true\nkubelet-api-max-connections-per-peer: 16\n\
             shared-kubelet-port: true\n",
        )
        .unwrap();
        let mut a = args("from-flag");
        a.config = Some(path.clone());
        let c = Config::from_args(a).unwrap();
        assert_eq!(c.node_name, "from-flag");
        assert_eq!(c.kubelet_port, 11250);
        assert_eq!(c.node_labels["zone"], "a");
        assert!(c.node_taints.is_empty());
        assert!(c.policy.allow_privileged);
        assert_eq!(c.kubelet_api.max_connections_per_peer, 16);
        assert!(c.shared_kubelet_port);
        std::fs::write(&path, "node-nmae: typo\n").unwrap();
        let mut a = args("x");
        a.config = Some(path);
        let e = Config::from_args(a).unwrap_err();
        assert!(e.to_string().contains("unknown field `node-nmae`"), "{e}");
        std::fs::remove_dir_all(dir).ok();
    }

    #[test]
    fn taints_parse() {
        assert_eq!(
            parse_taint("platform.example.com/execution=external:NoSchedule").unwrap(),
            Taint {
                key: "platform.example.com/execution".into(),
                value: Some("external".into()),
                effect: "NoSchedule".into()
            }
        );
        assert_eq!(parse_taint("gpu:NoExecute").unwrap().value, None);
        assert!(parse_taint("=v:NoSchedule").is_err());
    }

    #[test]
    fn provider_timeout_is_read() {
        let c = Config::from_args(args("vk")).unwrap();
        assert_eq!(c.provider_timeout, Duration::from_secs(120));
        let mut a = args("vk");
        a.provider_timeout = Some("30s".into());
        assert_eq!(
            Config::from_args(a).unwrap().provider_timeout,
            Duration::from_secs(30)
        );
        let mut a = args("vk");
        a.provider_timeout = Some("0s".into());
        assert_eq!(Config::from_args(a).unwrap_err().field, "provider-timeout");
    }
}
