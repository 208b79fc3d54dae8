//! What vkd and a provider exchange: the instance spec, the instance as it
//! runs, capacity as host slices, capabilities, health and events.

use std::collections::BTreeMap;
use std::fmt;
use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};

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
#[non_exhaustive]
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
    /// A probe's `grpc.health.v1.Health/Check` call to the Pod's IP (never a
    /// hook's: the API allows it only in probes).
    Grpc {
        port: u16,
        /// The service the check names; empty for the server as a whole.
        #[serde(default)]
        service: String,
        /// `mode: TLS`: over TLS, the server's certificate not verified.
        #[serde(default)]
        tls: bool,
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
#[non_exhaustive]
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
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Gpu {
    pub id: String,
    pub model: String,
    pub memory_mib: u64,
    pub nvlink_domain: Option<String>,
    pub numa_node: Option<u32>,
    pub pcie_root: Option<String>,
    /// Whether the whole GPU may be given to a Pod: nobody holds it, whole
    /// or in part.
    pub free: bool,
    /// MIG-style compute slices the GPU divides into (7 on an A100 or H100);
    /// 0 when it cannot be partitioned.
    #[serde(default)]
    pub compute_slices: u32,
    /// The partitions it offers. Partitions and the whole GPU share its
    /// compute slices and memory: a Pod holds the whole GPU or some
    /// partitions, never both, and partitions in use never sum past the GPU.
    #[serde(default)]
    pub partitions: Vec<GpuPartition>,
}

/// A MIG-style slice of a GPU, given to a Pod like a GPU (its id in
/// [`Placement::gpu_ids`]).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuPartition {
    /// Unique on its host, like a GPU id.
    pub id: String,
    /// The profile, `3g.40gb`.
    pub profile: String,
    pub compute_slices: u32,
    pub memory_mib: u64,
    /// A Pod holds it.
    pub in_use: bool,
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
    /// The backend knows how many GPUs are free, not which (a downstream
    /// Kubernetes Node): a placement's GPU ids are held by count, any free
    /// GPU standing for a named one that is not.
    #[serde(default)]
    pub gpus_by_count: bool,
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
            for p in &mut g.partitions {
                p.in_use = false;
            }
        }
        h
    }

    /// Marks the GPUs and partitions `ids` names as held (ids of neither are
    /// ignored): what a backend reports for the Pods it runs.
    pub fn hold<'a>(&mut self, ids: impl IntoIterator<Item = &'a String>) {
        for id in ids {
            self.try_hold(id);
        }
    }

    /// Whether all of `ids` can be given to one Pod now: each a free GPU, or
    /// a partition that is free and fits beside the partitions in use.
    pub fn can_hold(&self, ids: &[String]) -> bool {
        let mut h = self.clone();
        ids.iter().all(|id| h.try_hold(id))
    }

    /// Holds one GPU or partition; false when it was not free (it is held
    /// all the same, so a backend's report of what runs is taken as it is).
    fn try_hold(&mut self, id: &str) -> bool {
        if self.gpus_by_count
            && self.gpus.iter().any(|g| g.id == id && !g.free)
            && let Some(other) = self.gpus.iter_mut().find(|g| g.free)
        {
            other.free = false;
            return true;
        }
        for g in &mut self.gpus {
            if g.id == id {
                let ok = g.free;
                g.free = false;
                return ok;
            }
            if let Some(i) = g.partitions.iter().position(|p| p.id == id) {
                let ok = g.partition_free(&g.partitions[i]);
                g.partitions[i].in_use = true;
                g.free = false;
                return ok;
            }
        }
        false
    }
}

impl Gpu {
    /// Held whole by a Pod (not free, and no partition is what holds it).
    pub fn held_whole(&self) -> bool {
        !self.free && !self.partitions.iter().any(|p| p.in_use)
    }

    /// Whether partition `p` of this GPU can be given now: not in use, the
    /// GPU not held whole, and room beside the partitions in use.
    pub fn partition_free(&self, p: &GpuPartition) -> bool {
        let (compute, memory) =
            self.partitions
                .iter()
                .filter(|q| q.in_use)
                .fold((0u64, 0u64), |(c, m), q| {
                    (
                        c.saturating_add(u64::from(q.compute_slices)),
                        m.saturating_add(q.memory_mib),
                    )
                });
        // A backend's figures: sums that do not fit are too big, not wrapped.
        !p.in_use
            && !self.held_whole()
            && compute.saturating_add(u64::from(p.compute_slices)) <= u64::from(self.compute_slices)
            && memory.saturating_add(p.memory_mib) <= self.memory_mib
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
    /// Reports each container's GPUs and their use ([`ContainerStats::gpus`]),
    /// which vkd exports with DCGM exporter's names and labels.
    #[serde(default)]
    pub gpu_usage: Support,
    /// The backend keeps its own queue and places Pods itself (an HPC
    /// scheduler): vkd asks [`Provider::admit`] alone rather than deciding on
    /// the host slices' free room, and a Pod that must wait is created and
    /// waits in the backend, its instance `Pending` with the backend's reason
    /// (the containers `Waiting`, reason `BackendQueued`). The host slices
    /// still say what the Node advertises.
    #[serde(default)]
    pub backend_queue: Support,
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
            ("gpu-usage", self.gpu_usage),
            ("backend-queue", self.backend_queue),
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
    /// The GPUs the container uses and how much of each, where the backend
    /// measures them (empty where it does not).
    #[serde(default)]
    pub gpus: Vec<GpuStats>,
}

/// One GPU's use by one container, as DCGM exporter reports it per Pod.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuStats {
    /// The GPU's id on its host (the host slice's id).
    pub id: String,
    /// Its index on the host (DCGM's `gpu`, the `nvidiaN` device's N).
    pub index: u32,
    pub model: String,
    /// The backend host it is on.
    pub host: String,
    /// Percent of the time a kernel ran, 0 to 100 (`DCGM_FI_DEV_GPU_UTIL`).
    pub utilization_percent: u32,
    pub memory_used_bytes: u64,
    pub memory_total_bytes: u64,
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
