//! The contract between vkd and a backend.
//!
//! A provider runs one *instance* per Pod, keyed by the Pod UID: `create` is
//! idempotent on that key, so a retried or repeated create never starts a second
//! copy. Every mutating call carries a [`Fence`]; a backend remembers the highest
//! epoch it has seen for a node and refuses lower ones, which is what stops an old
//! daemon from acting after a new one took over. Capacity is reported as host
//! slices, admission is explicit, and optional capabilities default to
//! [`ProviderError::Unsupported`].
//!
//! Providers depend on this crate only, never on vkd itself. The [`conformance`]
//! module is a kit every provider runs in its own tests.

use std::collections::BTreeMap;
use std::fmt;
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use futures::stream::BoxStream;
use serde::{Deserialize, Serialize};

/// Gives back a collection's spare room once most of its entries are gone: a
/// hash map keeps the capacity of its largest size, so after 10,000 Pods come
/// and go it would hold their slots for good. Shrinks only when it is a quarter
/// full or less, so the cost (a rehash) is paid once per large drop, not per
/// removal.
pub fn release_spare<C: Spare>(collection: &mut C) {
    if collection.capacity() > 1024 && collection.capacity() / 4 > collection.len() {
        collection.shrink_to(collection.len() * 2);
    }
}

/// A collection [`release_spare`] can shrink.
pub trait Spare {
    fn capacity(&self) -> usize;
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    fn shrink_to(&mut self, min_capacity: usize);
}

macro_rules! spare {
    ($t:ty, $($g:tt)*) => {
        impl<$($g)*> Spare for $t {
            fn capacity(&self) -> usize {
                self.capacity()
            }
            fn len(&self) -> usize {
                self.len()
            }
            fn shrink_to(&mut self, min_capacity: usize) {
                self.shrink_to(min_capacity);
            }
        }
    };
}
spare!(std::collections::HashMap<K, V, S>, K: std::hash::Hash + Eq, V, S: std::hash::BuildHasher);
spare!(std::collections::HashSet<K, S>, K: std::hash::Hash + Eq, S: std::hash::BuildHasher);
spare!(std::collections::VecDeque<T>, T);

pub mod conformance;
pub mod duration;
pub mod fence;
pub mod quantity;
pub mod topology;

/// The authority under which a mutation is made: which virtual node, at which epoch.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Fence {
    pub node: String,
    pub epoch: u64,
}

/// The Pod an instance belongs to.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct PodRef {
    pub uid: String,
    pub namespace: String,
    pub name: String,
}

impl fmt::Display for PodRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// What a backend may need to know about a container.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ContainerSpec {
    pub name: String,
    pub image: String,
    #[serde(default)]
    pub command: Vec<String>,
    #[serde(default)]
    pub args: Vec<String>,
    /// Resolved environment, in order (valueFrom and envFrom already looked up).
    #[serde(default)]
    pub env: Vec<(String, String)>,
    /// As in the Pod spec; a backend without its own filesystem maps it (see its docs).
    #[serde(default)]
    pub working_dir: Option<String>,
    #[serde(default)]
    pub mounts: Vec<Mount>,
    #[serde(default)]
    pub limits: Limits,
    // Probes and hooks are boxed: most containers have none, and a backend
    // keeps a spec per instance (inline they were most of a ContainerSpec).
    #[serde(default)]
    pub startup_probe: Option<Box<Probe>>,
    #[serde(default)]
    pub liveness_probe: Option<Box<Probe>>,
    #[serde(default)]
    pub readiness_probe: Option<Box<Probe>>,
    #[serde(default)]
    pub post_start: Option<Box<Handler>>,
    #[serde(default)]
    pub pre_stop: Option<Box<Handler>>,
    /// An init container with `restartPolicy: Always`: a sidecar. It starts in
    /// its place among the init containers, the next one starts once it has
    /// started (postStart done, startupProbe passed), it keeps running (restarted
    /// whenever it exits, whatever the Pod's restartPolicy), counts toward
    /// readiness, and is stopped after the containers, in reverse order.
    /// Meaningless on a container that is not an init container.
    #[serde(default)]
    pub restart_always: bool,
    /// terminationMessagePath: where the container writes its termination
    /// message, read (at most [`MAX_TERMINATION_MESSAGE`] bytes, the end of the
    /// file) when it exits. `None`: the API's default,
    /// [`DEFAULT_TERMINATION_MESSAGE_PATH`].
    #[serde(default)]
    pub termination_message_path: Option<String>,
    #[serde(default)]
    pub termination_message_policy: TerminationMessagePolicy,
    /// `stdin: true`: the container's stdin stays open for `kubectl attach -i`
    /// (else it reads end-of-file at once).
    #[serde(default)]
    pub stdin: bool,
    /// `stdinOnce: true`: stdin closes when the first attach session ends.
    #[serde(default)]
    pub stdin_once: bool,
    /// `tty: true`, as the Pod says (a backend without terminals ignores it).
    #[serde(default)]
    pub tty: bool,
    /// The variables of `env` whose value is the Pod's IP (a `fieldRef` to
    /// `status.podIP` or `status.podIPs`). They carry the host's IP, which is
    /// the Pod's unless the backend gives it one of its own; such a backend
    /// sets them to that IP before the container starts, as the kubelet does.
    #[serde(default)]
    pub pod_ip_env: Vec<String>,
    /// What the container's `securityContext` asks of the process's
    /// privileges; `None` when it asks nothing (boxed, as the probes: most
    /// containers have none, and a backend keeps a spec per instance).
    #[serde(default)]
    pub security: Option<Box<SecurityContext>>,
    /// An ephemeral container's `targetContainerName`: the container whose
    /// process namespace it joins (`None` for the Pod's own containers).
    #[serde(default)]
    pub target_container: Option<Box<str>>,
}

/// The privilege fields of a container's `securityContext`, as written (the
/// node policy has already refused what the node does not allow).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SecurityContext {
    /// `allowPrivilegeEscalation`; `None` is the runtime's default (allowed).
    #[serde(default)]
    pub allow_privilege_escalation: Option<bool>,
    /// `capabilities.drop`, as written (`ALL`, `NET_RAW`, `CAP_KILL`, ...).
    #[serde(default)]
    pub drop_capabilities: Vec<String>,
    /// `capabilities.add`, as written.
    #[serde(default)]
    pub add_capabilities: Vec<String>,
    /// `privileged`.
    #[serde(default)]
    pub privileged: bool,
}

/// terminationMessagePath when the Pod does not say (the API server's default).
pub const DEFAULT_TERMINATION_MESSAGE_PATH: &str = "/dev/termination-log";

impl ContainerSpec {
    /// Where the container writes its termination message (the Pod's path or the default).
    pub fn termination_message_path(&self) -> &str {
        self.termination_message_path
            .as_deref()
            .unwrap_or(DEFAULT_TERMINATION_MESSAGE_PATH)
    }
}

/// The most of a termination message file that is read, from its end (as the kubelet).
pub const MAX_TERMINATION_MESSAGE: usize = 4096;
/// With `FallbackToLogsOnError`, how many of the log's last lines become the message,
pub const TERMINATION_MESSAGE_LOG_LINES: usize = 80;
/// and at most how many of their last bytes (both as the kubelet).
pub const TERMINATION_MESSAGE_LOG_BYTES: usize = 2048;

/// terminationMessagePolicy.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum TerminationMessagePolicy {
    /// The message is what the container wrote to its termination message file.
    #[default]
    File,
    /// As `File`, but a container that failed (non-zero exit) and wrote no
    /// message gets the tail of its log instead.
    FallbackToLogsOnError,
}

/// A container's resource limits (absent: unlimited).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Limits {
    pub cpu_millis: Option<u64>,
    pub memory_bytes: Option<u64>,
}

/// A volume mounted into a container.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Mount {
    pub volume: String,
    pub path: String,
    #[serde(default)]
    pub sub_path: Option<String>,
    #[serde(default)]
    pub read_only: bool,
}

/// An action run against a container: a probe's check or a lifecycle hook.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Handler {
    Exec {
        command: Vec<String>,
    },
    HttpGet {
        host: Option<String>,
        port: u16,
        path: String,
        https: bool,
        headers: Vec<(String, String)>,
    },
    TcpSocket {
        host: Option<String>,
        port: u16,
    },
    Sleep {
        seconds: u64,
    },
}

/// A probe, with the kubelet's defaults already applied.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Probe {
    pub handler: Handler,
    pub initial_delay: Duration,
    pub period: Duration,
    pub timeout: Duration,
    pub success_threshold: u32,
    pub failure_threshold: u32,
    /// The probe's own `terminationGracePeriodSeconds`: the grace a container
    /// this (liveness or startup) probe restarts gets instead of the Pod's.
    #[serde(default)]
    pub termination_grace: Option<Duration>,
}

/// A Pod volume, with the content vkd resolved from the API.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Volume {
    pub name: String,
    pub source: VolumeSource,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum VolumeSource {
    EmptyDir {
        size_limit: Option<u64>,
        /// `medium: Memory`: a tmpfs, where the backend can mount one.
        #[serde(default)]
        memory: bool,
    },
    /// configMap, secret, downwardAPI and projected volumes: files vkd wrote out.
    Files { files: Vec<VolumeFile> },
    /// Allowed only where the node policy allows hostPath.
    HostPath { path: String },
}

/// One file of a volume, its path relative to the volume root.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeFile {
    pub path: String,
    pub data: Vec<u8>,
    pub mode: u32,
}

/// Resources a Pod asks for, summed the way the scheduler sums them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Resources {
    pub cpu_millis: u64,
    pub memory_bytes: u64,
    pub gpus: u32,
}

/// How the kubelet restarts containers of a Pod.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum RestartPolicy {
    #[default]
    Always,
    OnFailure,
    Never,
}

/// Everything a backend is told about a Pod when it is admitted or created.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct InstanceSpec {
    pub pod: PodRef,
    pub node: String,
    pub containers: Vec<ContainerSpec>,
    pub resources: Resources,
    pub restart_policy: RestartPolicy,
    /// The Pod's annotations; backends read their own keys (for example `sim.vkd.io/*`).
    #[serde(default)]
    pub annotations: BTreeMap<String, String>,
    /// Where admission placed the Pod; `None` lets the backend choose.
    #[serde(default)]
    pub placement: Option<Placement>,
    /// Run to completion, in order, before `containers` start.
    #[serde(default)]
    pub init_containers: Vec<ContainerSpec>,
    /// Filled in only for providers that declare the `volumes` capability.
    #[serde(default)]
    pub volumes: Vec<Volume>,
    /// terminationGracePeriodSeconds (30 s when the Pod does not say).
    #[serde(default = "default_grace")]
    pub termination_grace: Duration,
    /// The upstream Pod's `spec` as the API server holds it (JSON), beside the
    /// translation above, for a backend that runs the Pod as a Pod (the
    /// kubernetes provider keeps ports, probes, securityContext as written).
    /// Filled in only for providers that declare [`Capabilities::pod_spec`];
    /// references in it (ConfigMaps, Secrets, fieldRefs) are resolved in
    /// `containers[].env` and `volumes`, which a backend uses instead.
    #[serde(default)]
    pub pod_spec: Option<String>,
    /// `spec.hostNetwork`: the Pod shares the host's network and IP, even on a
    /// backend that gives Pods networks of their own.
    #[serde(default)]
    pub host_network: bool,
    /// `spec.shareProcessNamespace`: the containers share one PID namespace.
    #[serde(default)]
    pub share_process_namespace: bool,
    /// The containers' ports that ask for a `hostPort`, for a backend with
    /// Pod networks to map (the scheduler has kept them unique on the node).
    #[serde(default)]
    pub host_ports: Vec<HostPort>,
    /// `spec.securityContext.fsGroup`: the group that owns the Pod's volumes
    /// (an emptyDir is setgid to it), as the kubelet applies it.
    #[serde(default)]
    pub fs_group: Option<u32>,
    /// `spec.hostUsers: false`: the Pod's containers get a user namespace
    /// of their own, where the backend can give one (a backend that cannot
    /// refuses the Pod rather than run it with the host's users).
    #[serde(default)]
    pub user_namespace: bool,
}

/// A container port published on the host (`ports[].hostPort`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostPort {
    pub container_port: u16,
    pub host_port: u16,
    /// `TCP`, `UDP` or `SCTP`, as in the Pod spec.
    pub protocol: String,
    /// `hostIP`, when the port is published on one address only.
    #[serde(default)]
    pub host_ip: Option<String>,
}

fn default_grace() -> Duration {
    Duration::from_secs(30)
}

/// Where an instance runs: a host slice and, for GPU Pods, which GPUs.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Placement {
    pub host: String,
    #[serde(default)]
    pub gpu_ids: Vec<String>,
}

/// The backend's answer to "could you run this Pod?", given before anything is created.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Admission {
    Fits(Placement),
    /// It could run once capacity frees; `reason` says what it waits for.
    Queued {
        reason: String,
    },
    /// It can never run here.
    Rejected {
        reason: String,
        message: String,
    },
}

/// A backend instance, as the backend reports it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Instance {
    /// The backend's own id for the instance (not the Pod UID).
    pub id: String,
    pub owner: PodRef,
    pub node: String,
    /// The epoch of the fence it was created under.
    pub epoch: u64,
    pub phase: InstancePhase,
    pub containers: Vec<ContainerStatus>,
    pub ip: Option<String>,
    /// The host slice it runs on.
    pub host: Option<String>,
    pub created_at: SystemTime,
    pub started_at: Option<SystemTime>,
    /// A human-readable message for the whole instance (why it failed, for example).
    pub message: Option<String>,
    /// The init containers, in the spec's order (empty for a backend, or a
    /// record, from before they were reported).
    #[serde(default)]
    pub init_containers: Vec<ContainerStatus>,
    /// The ephemeral containers ([`Provider::start_ephemeral`]) the backend
    /// knows of, in the order they were started. Empty for a backend without
    /// them, or a record from before they were reported.
    #[serde(default)]
    pub ephemeral_containers: Vec<ContainerStatus>,
    /// The IP of the machine it runs on, where that is not the virtual
    /// node's own (a downstream cluster's Node): the Pod's `hostIP`.
    #[serde(default)]
    pub host_ip: Option<String>,
    /// What the backend saw happen to the containers that the kubelet reports
    /// as Events (a probe that failed or warned), the most recent last; a
    /// backend keeps a bounded number. Empty for a backend without them.
    #[serde(default)]
    pub events: Vec<ContainerEvent>,
}

/// Something that happened to a container, which vkd publishes as the
/// kubelet's Event about the Pod (`Unhealthy`, `ProbeWarning`, `Killing`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ContainerEvent {
    /// Grows by one with each event of the instance: vkd publishes each once.
    pub seq: u64,
    pub time: SystemTime,
    pub container: String,
    /// A Warning Event, else Normal.
    pub warning: bool,
    pub reason: String,
    pub message: String,
    /// What was being done (`Liveness`, `Readiness`, `Startup`, `Kill`,
    /// `PostStart`, `PreStop`): with the reason, what tells one series of
    /// repeats from another.
    #[serde(default)]
    pub action: String,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum InstancePhase {
    /// Accepted; containers are being created.
    Pending,
    Running,
    /// Every container ended and none will restart; `Succeeded` when all exited 0.
    Succeeded,
    Failed,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ContainerStatus {
    pub name: String,
    pub state: ContainerState,
    /// The previous run's end, when the container restarted.
    pub last_termination: Option<Terminated>,
    pub ready: bool,
    pub restart_count: u32,
    /// `<backend>://<id>`, as the kubelet writes containerID.
    pub container_id: Option<String>,
    /// Running and past its postStart hook and startupProbe (the kubelet's
    /// `started`). `None`: the backend does not say; running counts as started.
    #[serde(default)]
    pub started: Option<bool>,
}

impl ContainerStatus {
    /// A container not created yet: waiting as `ContainerCreating`.
    pub fn creating(name: &str) -> Self {
        Self {
            name: name.to_owned(),
            state: ContainerState::Waiting {
                reason: "ContainerCreating".into(),
                message: None,
            },
            last_termination: None,
            ready: false,
            restart_count: 0,
            container_id: None,
            started: Some(false),
        }
    }

    /// Whether the container has started, as the kubelet reports `started`.
    pub fn has_started(&self) -> bool {
        matches!(self.state, ContainerState::Running { .. }) && self.started.unwrap_or(true)
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum ContainerState {
    Waiting {
        reason: String,
        message: Option<String>,
    },
    Running {
        started_at: SystemTime,
    },
    Terminated(Terminated),
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Terminated {
    pub exit_code: i32,
    pub reason: String,
    pub message: Option<String>,
    pub started_at: Option<SystemTime>,
    pub finished_at: SystemTime,
}

/// A GPU on a host slice.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Gpu {
    pub id: String,
    pub model: String,
    pub memory_mib: u64,
    pub nvlink_domain: Option<String>,
    pub numa_node: Option<u32>,
    pub pcie_root: Option<String>,
    pub free: bool,
}

/// One host of a backend: what it has and what is free on it now.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostSlice {
    pub name: String,
    pub cpu_millis_total: u64,
    pub cpu_millis_free: u64,
    pub memory_bytes_total: u64,
    pub memory_bytes_free: u64,
    pub gpus: Vec<Gpu>,
    pub rdma_domain: Option<String>,
    #[serde(default)]
    pub labels: BTreeMap<String, String>,
    #[serde(default)]
    pub cached_models: Vec<String>,
    /// Local ephemeral storage on the host, in bytes (the Node's
    /// `ephemeral-storage`); 0 when the backend does not say.
    #[serde(default)]
    pub ephemeral_storage_bytes: u64,
    /// How many Pods the host can run.
    pub max_pods: u32,
    /// How many it runs now.
    #[serde(default)]
    pub pods_running: u32,
}

impl HostSlice {
    pub fn gpus_free(&self) -> usize {
        self.gpus.iter().filter(|g| g.free).count()
    }

    /// The host as it is with nothing running: what could ever fit on it.
    pub fn whole(&self) -> Self {
        let mut h = self.clone();
        h.cpu_millis_free = h.cpu_millis_total;
        h.memory_bytes_free = h.memory_bytes_total;
        h.pods_running = 0;
        for g in &mut h.gpus {
            g.free = true;
        }
        h
    }
}

/// Whether a capacity figure is what is really free, or a ceiling the backend grants.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum CapacityKind {
    Live,
    Quota,
}

impl fmt::Display for CapacityKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Live => "live",
            Self::Quota => "quota",
        })
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Capacity {
    pub hosts: Vec<HostSlice>,
    pub kind: CapacityKind,
    pub observed_at: SystemTime,
    pub refresh_interval: Duration,
}

/// Whether a provider offers an optional capability.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum Support {
    Supported,
    #[default]
    Unsupported,
}

/// Optional capabilities; everything defaults to unsupported.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Capabilities {
    pub logs: Support,
    pub exec: Support,
    pub attach: Support,
    pub port_forward: Support,
    pub stats: Support,
    /// Materializes volume content (configMap, secret, downwardAPI, projected files).
    pub volumes: Support,
    /// Enforces container resource limits.
    pub limits: Support,
    /// Starts ephemeral containers (`kubectl debug`) in a running instance.
    #[serde(default)]
    pub ephemeral_containers: Support,
    /// Wants [`InstanceSpec::pod_spec`], the Pod's spec as written.
    #[serde(default)]
    pub pod_spec: Support,
    /// Instances get an IP of their own ([`Instance::ip`]), perhaps only
    /// once they run. Without it a Pod shares the host's IP, as a
    /// hostNetwork Pod does; with it the Pod has no IP until the backend
    /// reports one (a Pod's IP never changes once written).
    #[serde(default)]
    pub pod_network: Support,
}

impl Capabilities {
    /// The supported capability names, for the Node annotation.
    pub fn supported(&self) -> Vec<&'static str> {
        [
            ("logs", self.logs),
            ("exec", self.exec),
            ("attach", self.attach),
            ("port-forward", self.port_forward),
            ("stats", self.stats),
            ("volumes", self.volumes),
            ("limits", self.limits),
            ("ephemeral-containers", self.ephemeral_containers),
            ("pod-spec", self.pod_spec),
            ("pod-network", self.pod_network),
        ]
        .into_iter()
        .filter(|(_, s)| *s == Support::Supported)
        .map(|(n, _)| n)
        .collect()
    }
}

/// Whether the backend can take work now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Health {
    Healthy,
    Unhealthy {
        reason: String,
        message: String,
    },
    /// The backend's control API cannot be reached, but what it already runs
    /// goes on running (a remote cluster whose API server is down): its
    /// instances are not lost, only unobserved. The Node stays Ready, so that
    /// an outage the backend rides out evicts nothing, and says so in a
    /// condition of its own. `past_grace`: the outage has lasted longer than
    /// the backend wants its Pods kept waiting for it, so the Node goes
    /// Ready=False too and the node lifecycle controller replaces them.
    Unreachable {
        reason: String,
        message: String,
        past_grace: bool,
    },
}

/// Something about an instance changed; the receiver calls `get` to see what.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum InstanceEvent {
    Changed {
        uid: String,
    },
    /// Events were lost (the receiver fell behind): list everything again.
    Resync,
}

/// Which log a read wants and whether it continues.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LogRequest {
    /// The previous run of the container (after a restart).
    pub previous: bool,
    /// Keep streaming new lines until the container stops.
    pub follow: bool,
    /// Only the last this many lines of what was written (`tailLines`).
    pub tail_lines: Option<u64>,
    /// Only lines written at or after this time (`sinceSeconds`, `sinceTime`).
    pub since: Option<SystemTime>,
    /// Only about this many bytes of content, from the start of what the
    /// other bounds leave (`limitBytes`).
    pub limit_bytes: Option<u64>,
}

/// One line of a container's log, with the time it was written.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LogLine {
    pub time: SystemTime,
    /// The line's bytes, including its trailing newline.
    pub bytes: bytes::Bytes,
}

/// What a log read returns: the lines written so far, and with `follow` the lines
/// still to come (ending when the container stops). A backend reads only what
/// the request's bounds leave where it can (a tenant's log may be gigabytes);
/// vkd applies sinceSeconds, sinceTime, tailLines, limitBytes and timestamps
/// on top, exactly, so a backend may return more than asked, never less.
pub struct Logs {
    pub history: Vec<LogLine>,
    pub follow: Option<BoxStream<'static, LogLine>>,
}

impl fmt::Debug for Logs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Logs")
            .field("history", &self.history.len())
            .field("follow", &self.follow.is_some())
            .finish()
    }
}

/// A terminal size sent by a client (`kubectl exec -t` on resize).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TermSize {
    #[serde(rename = "Width")]
    pub width: u16,
    #[serde(rename = "Height")]
    pub height: u16,
}

pub type BoxRead = Box<dyn tokio::io::AsyncRead + Send + Unpin>;
pub type BoxWrite = Box<dyn tokio::io::AsyncWrite + Send + Unpin>;

/// The streams of an exec or attach session. Absent streams were not requested.
pub struct StreamIo {
    pub stdin: Option<BoxRead>,
    pub stdout: Option<BoxWrite>,
    /// `None` with a tty: stderr goes to stdout.
    pub stderr: Option<BoxWrite>,
    pub tty: bool,
    pub resize: Option<tokio::sync::mpsc::Receiver<TermSize>>,
}

impl fmt::Debug for StreamIo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StreamIo")
            .field("stdin", &self.stdin.is_some())
            .field("stdout", &self.stdout.is_some())
            .field("stderr", &self.stderr.is_some())
            .field("tty", &self.tty)
            .finish()
    }
}

/// A byte stream both ways, for port-forward.
pub trait Duplex: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin {}
impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin> Duplex for T {}

/// Resource usage of one container at a moment.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ContainerStats {
    pub name: String,
    pub start_time: SystemTime,
    /// CPU used since start.
    pub cpu_usage_core_nanoseconds: u64,
    /// Current CPU rate.
    pub cpu_usage_nano_cores: u64,
    pub memory_working_set_bytes: u64,
    pub memory_rss_bytes: u64,
    /// Local ephemeral storage the container alone uses (its writable layer
    /// and logs); `None` where the backend cannot tell it from the Pod's.
    #[serde(default)]
    pub ephemeral_storage_bytes: Option<u64>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PodStats {
    pub pod: PodRef,
    pub start_time: SystemTime,
    pub time: SystemTime,
    pub containers: Vec<ContainerStats>,
    /// Local ephemeral storage the Pod uses now, in bytes: what it wrote
    /// outside its persistent volumes (its writable files, emptyDirs on disk,
    /// logs), as the kubelet sums it. `None`: the backend does not measure it,
    /// and no ephemeral-storage limit is enforced for the Pod.
    #[serde(default)]
    pub ephemeral_storage_bytes: Option<u64>,
    /// Usage of the Pod's local volumes the backend measures (emptyDirs).
    #[serde(default)]
    pub volumes: Vec<VolumeStats>,
}

/// Bytes used in one of a Pod's volumes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeStats {
    pub name: String,
    pub used_bytes: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum ProviderError {
    /// No instance for that Pod UID.
    #[error("no instance for pod {uid}")]
    NotFound { uid: String },
    /// The provider does not offer this capability.
    #[error("provider {provider} does not support {capability}")]
    Unsupported {
        provider: String,
        capability: &'static str,
    },
    /// The call's epoch is older than one the backend has seen for the node.
    #[error("fenced: node {node} is at epoch {current}, call carried epoch {got}")]
    Fenced {
        node: String,
        current: u64,
        got: u64,
    },
    /// The Pod cannot run on this backend as specified; the Pod should fail.
    #[error("{reason}: {message}")]
    Invalid { reason: String, message: String },
    /// The backend has no room for it.
    #[error("rejected: {message}")]
    Rejected { message: String },
    /// Try again later.
    #[error("transient backend error: {message}")]
    Transient { message: String },
}

impl ProviderError {
    pub fn transient(message: impl Into<String>) -> Self {
        Self::Transient {
            message: message.into(),
        }
    }

    pub fn invalid(reason: impl Into<String>, message: impl Into<String>) -> Self {
        Self::Invalid {
            reason: reason.into(),
            message: message.into(),
        }
    }

    /// A short label for metrics and logs.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::NotFound { .. } => "not_found",
            Self::Unsupported { .. } => "unsupported",
            Self::Fenced { .. } => "fenced",
            Self::Invalid { .. } => "invalid",
            Self::Rejected { .. } => "rejected",
            Self::Transient { .. } => "transient",
        }
    }
}

pub type Result<T, E = ProviderError> = std::result::Result<T, E>;

/// The reason a provider gives (in [`Admission::Rejected`] or
/// [`ProviderError::Invalid`]) when it cannot obtain or run a container's
/// image. vkd treats it as the kubelet treats a failed image pull: the Pod
/// stays Pending, its containers wait (`ErrImagePull`, then
/// `ImagePullBackOff`), and the start is tried again with a back-off, so a
/// Pod whose image is then fixed runs.
pub const IMAGE_NOT_RUNNABLE: &str = "ImageNotRunnable";

/// The reason a provider gives ([`ProviderError::Invalid`]) when it could
/// not set up what a Pod runs in (its network, say) and has given back what
/// it had set up: the kubelet's `FailedCreatePodSandBox`. vkd keeps the Pod
/// Pending (`ContainerCreating`), says why in a Warning Event, and tries the
/// start again with a back-off, as the kubelet retries a sandbox.
pub const SANDBOX_NOT_CREATED: &str = "FailedCreatePodSandBox";

/// A backend that runs Pods as instances. Object-safe: vkd holds an `Arc<dyn Provider>`.
#[async_trait]
pub trait Provider: Send + Sync + fmt::Debug {
    /// A short name, used in taints, messages and metrics ("sim", "process").
    fn name(&self) -> &str;

    fn capabilities(&self) -> Capabilities {
        Capabilities::default()
    }

    /// Which backend the Node stands for, as annotations under `vkd.io/`
    /// (a downstream cluster's name and server, for example). Fixed for the
    /// provider's life.
    fn identity(&self) -> Vec<(String, String)> {
        Vec::new()
    }

    async fn health(&self) -> Health;

    async fn capacity(&self) -> Result<Capacity>;

    /// Could the backend run this Pod? Nothing is created or reserved by this call.
    async fn admit(&self, spec: &InstanceSpec) -> Result<Admission>;

    /// Creates the instance for `spec.pod.uid`, or returns the existing one.
    async fn create(&self, fence: &Fence, spec: &InstanceSpec) -> Result<Instance>;

    /// The instance of a Pod UID, `None` when there is none (or it is fully gone).
    async fn get(&self, uid: &str) -> Result<Option<Instance>>;

    /// Stops and removes the instance, giving its containers `grace` to exit.
    /// Deleting what does not exist succeeds; a later `get` confirms it is gone.
    async fn delete(&self, fence: &Fence, uid: &str, grace: Duration) -> Result<()>;

    /// This daemon now acts for `fence.node` at `fence.epoch` (it took the
    /// leader lease): forget anything cached, another replica may have acted
    /// meanwhile. Providers that read their state fresh need not override it.
    async fn takeover(&self, _fence: &Fence) -> Result<()> {
        Ok(())
    }

    /// Removes one instance by its backend id: for a duplicate (more than one
    /// instance for a Pod UID) in backends where that can happen. Optional.
    async fn delete_instance(&self, _fence: &Fence, _id: &str, _grace: Duration) -> Result<()> {
        Err(self.unsupported("delete-instance"))
    }

    /// Every instance the backend holds for `node`.
    async fn list(&self, node: &str) -> Result<Vec<Instance>>;

    /// Change notifications. Each call returns a new subscription.
    fn events(&self) -> BoxStream<'static, InstanceEvent>;

    /// A container's log. Optional.
    async fn logs(&self, _uid: &str, _container: &str, _request: LogRequest) -> Result<Logs> {
        Err(self.unsupported("logs"))
    }

    /// Runs `command` in a container; resolves to its exit code. Optional.
    async fn exec(
        &self,
        _uid: &str,
        _container: &str,
        _command: Vec<String>,
        _io: StreamIo,
    ) -> Result<i32> {
        Err(self.unsupported("exec"))
    }

    /// Attaches to a container's main process until it ends or the client leaves. Optional.
    async fn attach(&self, _uid: &str, _container: &str, _io: StreamIo) -> Result<()> {
        Err(self.unsupported("attach"))
    }

    /// Carries one port-forward connection to `port` of the Pod. Optional.
    async fn port_forward(&self, _uid: &str, _port: u16, _stream: Box<dyn Duplex>) -> Result<()> {
        Err(self.unsupported("port-forward"))
    }

    /// Starts an ephemeral container (`kubectl debug`, the Pod's
    /// `spec.ephemeralContainers`) in the running instance of `uid`, where
    /// the Pod's other containers run. It is started once and never
    /// restarted: it runs until it exits or the instance ends, and its state
    /// is reported in [`Instance::ephemeral_containers`] under its name.
    /// Idempotent on the name: a container the instance already has is not
    /// started again (`Ok`). `container` is resolved like any other (env,
    /// mounts of the Pod's volumes); it has no probes, hooks, ports or
    /// resources. Optional (capability `ephemeral_containers`).
    async fn start_ephemeral(
        &self,
        _fence: &Fence,
        _uid: &str,
        _container: &ContainerSpec,
    ) -> Result<()> {
        Err(self.unsupported("ephemeral containers"))
    }

    /// The content of the Pod's file volumes (configMap, secret, downwardAPI,
    /// projected; only [`VolumeSource::Files`]) changed: make each volume hold
    /// exactly `volumes`' files now, as the kubelet refreshes them while the
    /// Pod runs. Each file is replaced whole (a reader sees the old bytes or
    /// the new, never a mix), and files no longer listed are removed. Volumes
    /// not named are left as they are. Optional, for providers with the
    /// `volumes` capability; without it a running Pod keeps its first content.
    async fn update_volumes(&self, _fence: &Fence, _uid: &str, _volumes: &[Volume]) -> Result<()> {
        Err(self.unsupported("volume updates"))
    }

    /// Resource usage of a Pod's containers. Optional.
    async fn stats(&self, _uid: &str) -> Result<PodStats> {
        Err(self.unsupported("stats"))
    }

    /// The backend's own account of a Pod's instance, as `(what, value)`
    /// pairs for a person (`vkd explain`): its GPUs, the names of a
    /// downstream object, what the backend saw happen. Optional; empty by
    /// default. Never mutates anything.
    async fn describe(&self, _uid: &str) -> Result<Vec<(String, String)>> {
        Ok(Vec::new())
    }

    /// The error for an optional capability this provider lacks.
    fn unsupported(&self, capability: &'static str) -> ProviderError {
        ProviderError::Unsupported {
            provider: self.name().to_owned(),
            capability,
        }
    }
}

/// Reads an annotation-style duration: "250us", "500ms", "3s", "2m", "1h" or
/// plain seconds, at most [`duration::MAX_DURATION`] (365 days) so that adding
/// it to a clock cannot overflow; [`duration::parse`] says what is wrong.
pub fn parse_duration(text: &str) -> Option<Duration> {
    duration::parse(text).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("500ms"), Some(Duration::from_millis(500)));
        assert_eq!(parse_duration("250us"), Some(Duration::from_micros(250)));
        assert_eq!(parse_duration("3s"), Some(Duration::from_secs(3)));
        assert_eq!(parse_duration("2"), Some(Duration::from_secs(2)));
        assert_eq!(parse_duration("1.5m"), Some(Duration::from_secs(90)));
        assert_eq!(parse_duration("-1s"), None);
        assert_eq!(parse_duration("3 days"), None);
        assert_eq!(parse_duration(""), None);
    }

    #[test]
    fn durations_are_bounded() {
        // Past the bound a duration would overflow the clock it is added to.
        assert_eq!(parse_duration("18000000000000000000"), None);
        assert_eq!(parse_duration("9000000000000000h"), None);
        assert_eq!(parse_duration("8761h"), None);
        assert_eq!(
            parse_duration("8760h"),
            Some(Duration::from_secs(365 * 86_400))
        );
        assert_eq!(parse_duration("0.000001s"), Some(Duration::from_micros(1)));
        assert_eq!(parse_duration("1.2.3s"), None);
    }

    #[test]
    fn capabilities_default_to_unsupported() {
        assert!(Capabilities::default().supported().is_empty());
        let c = Capabilities {
            logs: Support::Supported,
            ..Default::default()
        };
        assert_eq!(c.supported(), ["logs"]);
    }
}
