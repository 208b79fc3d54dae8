//! From a Pod to what a provider is told: the instance spec.
//!
//! Two steps. [`pending`] runs when the record is built, with no API calls: it
//! checks what can be checked from the Pod alone (resources, probes, volume
//! types) and keeps the little it needs to finish later. [`resolve`] runs just
//! before admission: it applies the node policy and reads the ConfigMaps,
//! Secrets and ServiceAccount tokens that env and volumes refer to, so a
//! provider never talks to the API server itself.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::authentication::v1::{BoundObjectReference, TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{
    ConfigMap, Container, EnvFromSource, EnvVar, KeyToPath, Pod, PodSpec, Secret, ServiceAccount,
    Volume as KubeVolume,
};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::api::PostParams;
use kube::{Api, Client};
use vkd_provider::{
    ContainerSpec, Handler, InstanceSpec, Limits, Mount, PodRef, Probe, Resources, RestartPolicy,
    Volume, VolumeFile, VolumeSource, quantity,
};

/// Why a Pod spec cannot be turned into an instance spec.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{reason}: {message}")]
pub struct SpecError {
    pub reason: &'static str,
    pub message: String,
}

fn spec_error(reason: &'static str, message: impl Into<String>) -> SpecError {
    SpecError {
        reason,
        message: message.into(),
    }
}

/// Who may run what on this node; enforced for every provider.
#[derive(Clone, Debug)]
pub struct Policy {
    /// Namespaces whose Pods may run here; empty means all.
    pub allowed_namespaces: Vec<String>,
    pub allow_secrets: bool,
    pub allow_config_maps: bool,
    pub allow_host_path: bool,
    /// Host namespaces (`hostNetwork`, `hostPID`, `hostIPC`), privileged
    /// containers and capabilities beyond the runtime's default set. Off by
    /// default: each gives a Pod the host, whatever the backend.
    pub allow_privileged: bool,
    /// The ports vkd itself listens on, and what listens there: never a Pod's
    /// `hostPort`, whatever the other settings.
    pub node_ports: BTreeMap<u16, String>,
}

/// `namespaces=a,b secrets=allowed configmaps=allowed hostpath=refused
/// privileged=refused`, for the Node.
impl std::fmt::Display for Policy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let yes = |b: bool| if b { "allowed" } else { "refused" };
        let namespaces = if self.allowed_namespaces.is_empty() {
            "all".to_owned()
        } else {
            self.allowed_namespaces.join(",")
        };
        write!(
            f,
            "namespaces={namespaces} secrets={} configmaps={} hostpath={} privileged={}",
            yes(self.allow_secrets),
            yes(self.allow_config_maps),
            yes(self.allow_host_path),
            yes(self.allow_privileged)
        )
    }
}

impl Default for Policy {
    fn default() -> Self {
        Self {
            allowed_namespaces: Vec::new(),
            allow_secrets: true,
            allow_config_maps: true,
            allow_host_path: false,
            allow_privileged: false,
            node_ports: BTreeMap::new(),
        }
    }
}

/// The capabilities a container runtime gives every container (containerd's
/// and CRI-O's default set): adding one of these asks for nothing more.
pub const DEFAULT_CAPABILITIES: &[&str] = &[
    "CHOWN",
    "DAC_OVERRIDE",
    "FSETID",
    "FOWNER",
    "MKNOD",
    "NET_RAW",
    "SETGID",
    "SETUID",
    "SETFCAP",
    "SETPCAP",
    "NET_BIND_SERVICE",
    "SYS_CHROOT",
    "KILL",
    "AUDIT_WRITE",
];

/// A capability's name as runtimes read it: upper case, without `CAP_`.
fn capability_name(name: &str) -> String {
    let upper = name.trim().to_ascii_uppercase();
    match upper.strip_prefix("CAP_") {
        Some(rest) => rest.to_owned(),
        None => upper,
    }
}

/// What a Pod asks of the host beyond a container's sandbox: checked against
/// the node policy when resolving, so every provider gets the same answer.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HostAccess {
    /// The host namespaces it joins, by field: `hostNetwork`, `hostPID`, `hostIPC`.
    pub namespaces: Vec<&'static str>,
    /// The containers that ask for something (most Pods: none).
    pub containers: Vec<ContainerAccess>,
}

/// What one container asks of the host.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ContainerAccess {
    pub name: String,
    /// `container`, `init container` or `ephemeral container`, for messages.
    pub kind: &'static str,
    /// `securityContext.privileged: true`.
    pub privileged: bool,
    /// `securityContext.capabilities.add` outside [`DEFAULT_CAPABILITIES`], as written.
    pub extra_capabilities: Vec<String>,
    /// Its `hostPort`s.
    pub host_ports: Vec<u16>,
}

/// The [`HostAccess`] of a Pod whose containers (init first) are `all`.
fn host_access(spec: &PodSpec, all: &[&Container]) -> HostAccess {
    let namespaces = [
        ("hostNetwork", spec.host_network),
        ("hostPID", spec.host_pid),
        ("hostIPC", spec.host_ipc),
    ]
    .into_iter()
    .filter(|(_, on)| *on == Some(true))
    .map(|(field, _)| field)
    .collect();
    let n_init = spec.init_containers.as_ref().map_or(0, Vec::len);
    let ephemeral = |name: &str| {
        spec.ephemeral_containers
            .iter()
            .flatten()
            .any(|e| e.name == name)
    };
    let containers = all
        .iter()
        .enumerate()
        .filter_map(|(i, c)| {
            let sc = c.security_context.as_ref();
            let privileged = sc.and_then(|s| s.privileged) == Some(true);
            let extra_capabilities: Vec<String> = sc
                .and_then(|s| s.capabilities.as_ref())
                .and_then(|caps| caps.add.as_ref())
                .into_iter()
                .flatten()
                .filter(|name| !DEFAULT_CAPABILITIES.contains(&capability_name(name).as_str()))
                .cloned()
                .collect();
            let host_ports: Vec<u16> = c
                .ports
                .iter()
                .flatten()
                .filter_map(|p| u16::try_from(p.host_port?).ok().filter(|&h| h != 0))
                .collect();
            if !privileged && extra_capabilities.is_empty() && host_ports.is_empty() {
                return None;
            }
            let kind = if i < n_init {
                "init container"
            } else if ephemeral(&c.name) {
                "ephemeral container"
            } else {
                "container"
            };
            Some(ContainerAccess {
                name: c.name.clone(),
                kind,
                privileged,
                extra_capabilities,
                host_ports,
            })
        })
        .collect();
    HostAccess {
        namespaces,
        containers,
    }
}

/// Refuses what `p` asks of the host that the node policy does not give:
/// host namespaces, privileged containers and added capabilities without
/// [`Policy::allow_privileged`], and any `hostPort` vkd listens on. Only the
/// containers `p` still holds count (an ephemeral container is resolved alone).
pub fn check_host_access(policy: &Policy, p: &Pending) -> Result<(), SpecError> {
    let node = &p.spec.node;
    let refused = "the node policy has privileged=refused";
    if !policy.allow_privileged
        && let Some(field) = p.host_access.namespaces.first()
    {
        return Err(spec_error(
            "HostNamespacesNotAllowed",
            format!(
                "spec.{field} is true: node {node} runs no Pod in the host's network, PID or \
                 IPC namespace ({refused})"
            ),
        ));
    }
    let held = |name: &str| {
        p.spec
            .init_containers
            .iter()
            .chain(&p.spec.containers)
            .any(|c| c.name == name)
    };
    for c in p.host_access.containers.iter().filter(|c| held(&c.name)) {
        let who = format!("{} {}", c.kind, c.name);
        if !policy.allow_privileged && c.privileged {
            return Err(spec_error(
                "PrivilegedNotAllowed",
                format!(
                    "{who}: securityContext.privileged is true: node {node} runs no privileged \
                     container ({refused})"
                ),
            ));
        }
        if !policy.allow_privileged && !c.extra_capabilities.is_empty() {
            return Err(spec_error(
                "CapabilitiesNotAllowed",
                format!(
                    "{who}: securityContext.capabilities.add has {}: node {node} adds no \
                     capability beyond the container runtime's default set ({refused})",
                    c.extra_capabilities.join(", ")
                ),
            ));
        }
        for port in &c.host_ports {
            if let Some(user) = policy.node_ports.get(port) {
                return Err(spec_error(
                    "HostPortNotAllowed",
                    format!(
                        "{who}: hostPort {port} is the port of {user} on node {node}; \
                         no Pod is given a port the node itself uses"
                    ),
                ));
            }
        }
    }
    Ok(())
}

/// What resolving found.
#[derive(Debug, thiserror::Error)]
pub enum ResolveError {
    /// The Pod can never run here as written: it ends Failed.
    #[error(transparent)]
    Spec(#[from] SpecError),
    /// Something it refers to is missing; the kubelet retries this
    /// (CreateContainerConfigError), and so do we.
    #[error("{0}")]
    Config(String),
    #[error("kubernetes API: {0}")]
    Kube(#[from] kube::Error),
}

/// The environment of one container as the Pod declares it.
#[derive(Clone, Debug, Default)]
pub struct ContainerEnv {
    pub env_from: Vec<EnvFromSource>,
    pub env: Vec<EnvVar>,
    /// `subPathExpr` of the container's mounts: (index in its mounts, expression).
    pub sub_path_exprs: Vec<(usize, String)>,
}

/// An instance spec waiting for its references to be read.
#[derive(Clone, Debug)]
pub struct Pending {
    pub spec: InstanceSpec,
    /// Init containers first, then containers, as in `spec`.
    pub env: Vec<ContainerEnv>,
    pub volumes: Vec<KubeVolume>,
    pub service_account: String,
    /// Downward-API values known from the Pod (`metadata.name`, `metadata.labels['k']`, ...).
    pub fields: BTreeMap<String, String>,
    /// Per container: `limits.cpu` and friends, as the downward API renders them.
    pub resources: BTreeMap<String, BTreeMap<String, String>>,
    /// Pod-level `resources.limits` (cpu, memory): what an unset container
    /// limit reads as in the downward API, before the node's allocatable.
    pub pod_limits: BTreeMap<String, String>,
    /// Some `resourceFieldRef` may read the node's allocatable (a limit not set).
    pub reads_allocatable: bool,
    /// `enableServiceLinks` (default true).
    pub service_links: bool,
    /// What the Pod asks of the host, for [`check_host_access`].
    pub host_access: HostAccess,
}

/// The node's allocatable cpu and memory, which an unset limit reads as.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Allocatable {
    pub cpu_millis: u64,
    pub memory_bytes: u64,
}

const SUPPORTED_VOLUMES: &[&str] = &[
    "emptyDir",
    "configMap",
    "secret",
    "downwardAPI",
    "projected",
    "hostPath",
];

/// Builds the pending spec from the Pod alone.
pub fn pending(pod: &Pod, node: &str) -> Result<Pending, SpecError> {
    let meta = &pod.metadata;
    let spec = pod
        .spec
        .as_ref()
        .ok_or_else(|| spec_error("InvalidSpec", "the Pod has no spec"))?;
    let restart_policy = match spec.restart_policy.as_deref() {
        None | Some("Always") => RestartPolicy::Always,
        Some("OnFailure") => RestartPolicy::OnFailure,
        Some("Never") => RestartPolicy::Never,
        Some(other) => {
            return Err(spec_error(
                "InvalidSpec",
                format!("restartPolicy {other:?}"),
            ));
        }
    };
    for v in spec.volumes.iter().flatten() {
        let kind = volume_kind(v);
        if !SUPPORTED_VOLUMES.contains(&kind.as_str()) {
            return Err(spec_error(
                "UnsupportedVolume",
                format!(
                    "volume {:?} is of type {kind}; this node supports {}",
                    v.name,
                    SUPPORTED_VOLUMES.join(", ")
                ),
            ));
        }
    }
    let volume_names: Vec<&str> = spec
        .volumes
        .iter()
        .flatten()
        .map(|v| v.name.as_str())
        .collect();
    let all: Vec<&Container> = spec
        .init_containers
        .iter()
        .flatten()
        .chain(spec.containers.iter())
        .collect();
    let mut built = Vec::with_capacity(all.len());
    for c in &all {
        built.push(container(c, &volume_names)?);
    }
    let n_init = spec.init_containers.as_ref().map_or(0, Vec::len);
    let mut containers = built.split_off(n_init);
    for c in &mut containers {
        c.restart_always = false;
    }
    let grace = spec
        .termination_grace_period_seconds
        .map_or(30, |g| g.max(0).unsigned_abs());
    Ok(Pending {
        spec: InstanceSpec {
            pod: PodRef {
                uid: meta.uid.clone().unwrap_or_default(),
                namespace: meta.namespace.clone().unwrap_or_default(),
                name: meta.name.clone().unwrap_or_default(),
            },
            node: node.to_owned(),
            containers,
            resources: resources(spec)?,
            restart_policy,
            annotations: meta
                .annotations
                .clone()
                .unwrap_or_default()
                .into_iter()
                .collect(),
            placement: None,
            init_containers: built,
            volumes: Vec::new(),
            termination_grace: Duration::from_secs(grace),
            pod_spec: None,
            host_network: spec.host_network.unwrap_or(false),
            share_process_namespace: spec.share_process_namespace.unwrap_or(false),
            host_ports: host_ports(&all)?,
            fs_group: fs_group(spec)?,
            user_namespace: spec.host_users == Some(false),
        },
        env: all
            .iter()
            .map(|c| ContainerEnv {
                env_from: c.env_from.clone().unwrap_or_default(),
                env: c.env.clone().unwrap_or_default(),
                sub_path_exprs: sub_path_exprs(c),
            })
            .collect(),
        volumes: spec.volumes.clone().unwrap_or_default(),
        service_account: spec
            .service_account_name
            .clone()
            .unwrap_or_else(|| "default".into()),
        fields: fields(pod),
        resources: all
            .iter()
            .map(|c| (c.name.clone(), resource_fields(c)))
            .collect(),
        pod_limits: spec
            .resources
            .as_ref()
            .and_then(|r| r.limits.as_ref())
            .into_iter()
            .flatten()
            .map(|(k, q)| (k.clone(), q.0.clone()))
            .collect(),
        reads_allocatable: reads_allocatable(spec),
        service_links: spec.enable_service_links.unwrap_or(true),
        host_access: host_access(spec, &all),
    })
}

/// `spec.securityContext.fsGroup`, a Pod's number: a group ID (0 to
/// 4294967294) or a clear error, never a wrapped one.
fn fs_group(spec: &k8s_openapi::api::core::v1::PodSpec) -> Result<Option<u32>, SpecError> {
    let Some(g) = spec.security_context.as_ref().and_then(|c| c.fs_group) else {
        return Ok(None);
    };
    match u32::try_from(g) {
        Ok(g) if g != u32::MAX => Ok(Some(g)),
        _ => Err(spec_error(
            "InvalidSpec",
            format!("securityContext.fsGroup {g} is not a group ID (0 to 4294967294)"),
        )),
    }
}

/// The mounts' `subPathExpr`s, by mount index.
fn sub_path_exprs(c: &Container) -> Vec<(usize, String)> {
    c.volume_mounts
        .iter()
        .flatten()
        .enumerate()
        .filter_map(|(i, m)| Some((i, m.sub_path_expr.clone().filter(|e| !e.is_empty())?)))
        .collect()
}

/// Whether any `resourceFieldRef` (env or downward API volume) asks for a
/// limit, which reads as the node's allocatable when the container sets none.
fn reads_allocatable(spec: &PodSpec) -> bool {
    let limit =
        |r: &k8s_openapi::api::core::v1::ResourceFieldSelector| r.resource.starts_with("limits.");
    let env = spec
        .init_containers
        .iter()
        .flatten()
        .chain(&spec.containers)
        .flat_map(|c| c.env.iter().flatten())
        .filter_map(|e| e.value_from.as_ref()?.resource_field_ref.as_ref())
        .any(limit);
    let volumes = spec.volumes.iter().flatten().any(|v| {
        let projected = v
            .projected
            .iter()
            .flat_map(|p| p.sources.iter().flatten())
            .filter_map(|s| s.downward_api.as_ref())
            .flat_map(|d| d.items.iter().flatten());
        v.downward_api
            .iter()
            .flat_map(|d| d.items.iter().flatten())
            .chain(projected)
            .filter_map(|i| i.resource_field_ref.as_ref())
            .any(limit)
    });
    env || volumes
}

/// The volume's type: the one field of the union that is set.
fn volume_kind(v: &KubeVolume) -> String {
    match serde_json::to_value(v) {
        Ok(serde_json::Value::Object(m)) => m
            .keys()
            .find(|k| *k != "name")
            .cloned()
            .unwrap_or_else(|| "unknown".into()),
        _ => "unknown".into(),
    }
}

fn fields(pod: &Pod) -> BTreeMap<String, String> {
    let meta = &pod.metadata;
    let mut f = BTreeMap::new();
    let mut put = |k: &str, v: Option<&String>| {
        if let Some(v) = v {
            f.insert(k.to_owned(), v.clone());
        }
    };
    put("metadata.name", meta.name.as_ref());
    put("metadata.namespace", meta.namespace.as_ref());
    put("metadata.uid", meta.uid.as_ref());
    let spec = pod.spec.as_ref();
    put("spec.nodeName", spec.and_then(|s| s.node_name.as_ref()));
    put(
        "spec.serviceAccountName",
        spec.and_then(|s| s.service_account_name.as_ref()),
    );
    for (prefix, map) in [
        ("metadata.labels", meta.labels.as_ref()),
        ("metadata.annotations", meta.annotations.as_ref()),
    ] {
        let map = map.cloned().unwrap_or_default();
        // The downward API's file format: one `key="value"` per line, sorted.
        let rendered: Vec<String> = map.iter().map(|(k, v)| format!("{k}={v:?}")).collect();
        f.insert(prefix.to_owned(), rendered.join("\n"));
        for (k, v) in map {
            f.insert(format!("{prefix}['{k}']"), v);
        }
    }
    f
}

fn resource_fields(c: &Container) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let res = c.resources.as_ref();
    for (kind, map) in [
        ("limits", res.and_then(|r| r.limits.as_ref())),
        ("requests", res.and_then(|r| r.requests.as_ref())),
    ] {
        for (name, q) in map.into_iter().flatten() {
            out.insert(format!("{kind}.{name}"), q.0.clone());
        }
    }
    out
}

/// The names in `c`'s env whose final value is the Pod's IP (the last
/// declaration of a name wins, as in [`Resolver::env`]).
fn pod_ip_env(c: &Container) -> Vec<String> {
    let mut names: Vec<String> = Vec::new();
    for e in c.env.iter().flatten() {
        names.retain(|n| *n != e.name);
        let path = e
            .value_from
            .as_ref()
            .and_then(|v| v.field_ref.as_ref())
            .map(|f| f.field_path.as_str());
        if matches!(path, Some("status.podIP" | "status.podIPs")) {
            names.push(e.name.clone());
        }
    }
    names
}

/// Every container port with a `hostPort`, checked: both ports in 1..=65535.
fn host_ports(containers: &[&Container]) -> Result<Vec<vkd_provider::HostPort>, SpecError> {
    let mut out = Vec::new();
    for c in containers {
        for p in c.ports.iter().flatten() {
            let Some(host_port) = p.host_port.filter(|&h| h != 0) else {
                continue;
            };
            let port = |n: i32, what: &str| {
                u16::try_from(n).ok().filter(|&n| n != 0).ok_or_else(|| {
                    spec_error(
                        "InvalidSpec",
                        format!("container {}: {what} {n} is not in 1-65535", c.name),
                    )
                })
            };
            // What reaches the network plugins (root's) is checked here too,
            // not only by the API server.
            let protocol = p.protocol.clone().unwrap_or_else(|| "TCP".into());
            if !matches!(protocol.as_str(), "TCP" | "UDP" | "SCTP") {
                return Err(spec_error(
                    "InvalidSpec",
                    format!("container {}: port protocol {protocol:?}", c.name),
                ));
            }
            let host_ip = p.host_ip.clone().filter(|h| !h.is_empty());
            if let Some(ip) = &host_ip
                && ip.parse::<std::net::IpAddr>().is_err()
            {
                return Err(spec_error(
                    "InvalidSpec",
                    format!("container {}: hostIP {ip:?} is not an IP address", c.name),
                ));
            }
            out.push(vkd_provider::HostPort {
                container_port: port(p.container_port, "containerPort")?,
                host_port: port(host_port, "hostPort")?,
                protocol,
                host_ip,
            });
        }
    }
    Ok(out)
}

fn container(c: &Container, volumes: &[&str]) -> Result<ContainerSpec, SpecError> {
    let ports: BTreeMap<&str, u16> = c
        .ports
        .iter()
        .flatten()
        .filter_map(|p| {
            let n = p.name.as_deref()?;
            Some((n, u16::try_from(p.container_port).ok()?))
        })
        .collect();
    let probe = |what: &str, p: Option<&k8s_openapi::api::core::v1::Probe>| {
        p.map(|p| probe(&c.name, what, p, &ports)).transpose()
    };
    let hook = |what: &str, h: Option<&k8s_openapi::api::core::v1::LifecycleHandler>| {
        h.map(|h| {
            handler(
                &c.name,
                what,
                h.exec.as_ref().and_then(|e| e.command.clone()),
                h.http_get.as_ref(),
                h.tcp_socket.as_ref(),
                h.sleep.as_ref().map(|s| s.seconds),
                &ports,
            )
        })
        .transpose()
    };
    let limits = c.resources.as_ref().and_then(|r| r.limits.as_ref());
    let invalid = |what: &str, e: quantity::QuantityError| {
        spec_error(
            "InvalidResources",
            format!("container {}: {what}: {e}", c.name),
        )
    };
    let mut mounts = Vec::new();
    for m in c.volume_mounts.iter().flatten() {
        if !volumes.contains(&m.name.as_str()) {
            return Err(spec_error(
                "InvalidSpec",
                format!(
                    "container {}: volumeMount of unknown volume {:?}",
                    c.name, m.name
                ),
            ));
        }
        mounts.push(Mount {
            volume: m.name.clone(),
            path: m.mount_path.clone(),
            sub_path: m.sub_path.clone().filter(|s| !s.is_empty()),
            read_only: m.read_only.unwrap_or(false),
        });
    }
    let lifecycle = c.lifecycle.as_ref();
    Ok(ContainerSpec {
        name: c.name.clone(),
        image: c.image.clone().unwrap_or_default(),
        command: c.command.clone().unwrap_or_default(),
        args: c.args.clone().unwrap_or_default(),
        env: Vec::new(),
        working_dir: c.working_dir.clone().filter(|w| !w.is_empty()),
        mounts,
        limits: Limits {
            cpu_millis: limits
                .and_then(|l| l.get("cpu"))
                .map(|q| quantity::cpu_millis(&q.0))
                .transpose()
                .map_err(|e| invalid("limits.cpu", e))?,
            memory_bytes: limits
                .and_then(|l| l.get("memory"))
                .map(|q| quantity::memory_limit(&q.0))
                .transpose()
                .map(Option::flatten)
                .map_err(|e| invalid("limits.memory", e))?,
        },
        startup_probe: probe("startupProbe", c.startup_probe.as_ref())?.map(Box::new),
        liveness_probe: probe("livenessProbe", c.liveness_probe.as_ref())?.map(Box::new),
        readiness_probe: probe("readinessProbe", c.readiness_probe.as_ref())?.map(Box::new),
        post_start: hook("postStart", lifecycle.and_then(|l| l.post_start.as_ref()))?.map(Box::new),
        pre_stop: hook("preStop", lifecycle.and_then(|l| l.pre_stop.as_ref()))?.map(Box::new),
        // Only an init container can be restartable (a sidecar); `pending` clears it for the others.
        restart_always: c.restart_policy.as_deref() == Some("Always"),
        // `None` stands for the API server's default (no copy kept per Pod).
        termination_message_path: c
            .termination_message_path
            .clone()
            .filter(|p| !p.is_empty() && p != vkd_provider::DEFAULT_TERMINATION_MESSAGE_PATH),
        termination_message_policy: match c.termination_message_policy.as_deref() {
            Some("FallbackToLogsOnError") => {
                vkd_provider::TerminationMessagePolicy::FallbackToLogsOnError
            }
            _ => vkd_provider::TerminationMessagePolicy::File,
        },
        pod_ip_env: pod_ip_env(c),
        stdin: c.stdin.unwrap_or(false),
        stdin_once: c.stdin_once.unwrap_or(false),
        tty: c.tty.unwrap_or(false),
        security: security_context(c.security_context.as_ref()),
        target_container: None,
    })
}

/// The privilege fields of a container's securityContext; `None` when it
/// sets none of them.
fn security_context(
    sc: Option<&k8s_openapi::api::core::v1::SecurityContext>,
) -> Option<Box<vkd_provider::SecurityContext>> {
    let caps = sc.and_then(|s| s.capabilities.as_ref());
    let asked = vkd_provider::SecurityContext {
        allow_privilege_escalation: sc.and_then(|s| s.allow_privilege_escalation),
        drop_capabilities: caps.and_then(|c| c.drop.clone()).unwrap_or_default(),
        add_capabilities: caps.and_then(|c| c.add.clone()).unwrap_or_default(),
        privileged: sc.and_then(|s| s.privileged).unwrap_or(false),
    };
    (asked != vkd_provider::SecurityContext::default()).then(|| Box::new(asked))
}

fn port_of(
    container: &str,
    what: &str,
    port: &IntOrString,
    ports: &BTreeMap<&str, u16>,
) -> Result<u16, SpecError> {
    match port {
        IntOrString::Int(n) => u16::try_from(*n).ok().filter(|p| *p > 0).ok_or_else(|| {
            spec_error(
                "InvalidProbe",
                format!("container {container}: {what} port {n} is not a port number"),
            )
        }),
        IntOrString::String(name) => ports.get(name.as_str()).copied().ok_or_else(|| {
            spec_error(
                "InvalidProbe",
                format!("container {container}: {what} port {name:?} names no containerPort"),
            )
        }),
    }
}

fn handler(
    container: &str,
    what: &str,
    exec: Option<Vec<String>>,
    http: Option<&k8s_openapi::api::core::v1::HTTPGetAction>,
    tcp: Option<&k8s_openapi::api::core::v1::TCPSocketAction>,
    sleep: Option<i64>,
    ports: &BTreeMap<&str, u16>,
) -> Result<Handler, SpecError> {
    if let Some(command) = exec {
        if command.is_empty() {
            return Err(spec_error(
                "InvalidProbe",
                format!("container {container}: {what} exec has an empty command"),
            ));
        }
        return Ok(Handler::Exec { command });
    }
    if let Some(h) = http {
        let https = match h.scheme.as_deref() {
            None | Some("HTTP") => false,
            Some("HTTPS") => true,
            Some(other) => {
                return Err(spec_error(
                    "InvalidProbe",
                    format!("container {container}: {what} scheme {other:?}"),
                ));
            }
        };
        return Ok(Handler::HttpGet {
            host: h.host.clone().filter(|s| !s.is_empty()),
            port: port_of(container, what, &h.port, ports)?,
            path: h.path.clone().unwrap_or_else(|| "/".into()),
            https,
            headers: h
                .http_headers
                .iter()
                .flatten()
                .map(|x| (x.name.clone(), x.value.clone()))
                .collect(),
        });
    }
    if let Some(t) = tcp {
        return Ok(Handler::TcpSocket {
            host: t.host.clone().filter(|s| !s.is_empty()),
            port: port_of(container, what, &t.port, ports)?,
        });
    }
    if let Some(seconds) = sleep {
        return Ok(Handler::Sleep {
            seconds: seconds.max(0).unsigned_abs(),
        });
    }
    Err(spec_error(
        "InvalidProbe",
        format!(
            "container {container}: {what} has no handler this node supports (exec, httpGet, tcpSocket, sleep)"
        ),
    ))
}

fn probe(
    container: &str,
    what: &str,
    p: &k8s_openapi::api::core::v1::Probe,
    ports: &BTreeMap<&str, u16>,
) -> Result<Probe, SpecError> {
    if p.grpc.is_some() {
        return Err(spec_error(
            "InvalidProbe",
            format!("container {container}: {what} grpc probes are not supported on this node"),
        ));
    }
    let secs = |v: Option<i32>, default: u64| {
        Duration::from_secs(v.map_or(default, |v| u64::from(v.max(0).unsigned_abs())))
    };
    let count = |v: Option<i32>, default: u32| v.map_or(default, |v| v.max(1).unsigned_abs());
    Ok(Probe {
        handler: handler(
            container,
            what,
            p.exec.as_ref().and_then(|e| e.command.clone()),
            p.http_get.as_ref(),
            p.tcp_socket.as_ref(),
            None,
            ports,
        )?,
        initial_delay: secs(p.initial_delay_seconds, 0),
        period: secs(p.period_seconds, 10).max(Duration::from_secs(1)),
        timeout: secs(p.timeout_seconds, 1).max(Duration::from_secs(1)),
        success_threshold: count(p.success_threshold, 1),
        failure_threshold: count(p.failure_threshold, 3),
        termination_grace: p
            .termination_grace_period_seconds
            .map(|g| Duration::from_secs(g.max(0).unsigned_abs())),
    })
}

/// Sums container requests the way the scheduler does (limits stand in for
/// missing requests), and the larger of that and any single init container.
fn resources(spec: &PodSpec) -> Result<Resources, SpecError> {
    let one = |c: &Container| -> Result<Resources, SpecError> {
        let res = c.resources.as_ref();
        let get = |name: &str| {
            res.and_then(|r| r.requests.as_ref().and_then(|m| m.get(name)))
                .or_else(|| res.and_then(|r| r.limits.as_ref().and_then(|m| m.get(name))))
                .map(|q| q.0.clone())
        };
        let invalid = |what: &str, e: quantity::QuantityError| {
            spec_error(
                "InvalidResources",
                format!("container {}: {what}: {e}", c.name),
            )
        };
        Ok(Resources {
            cpu_millis: get("cpu")
                .map(|q| quantity::cpu_millis(&q))
                .transpose()
                .map_err(|e| invalid("cpu", e))?
                .unwrap_or(0),
            memory_bytes: get("memory")
                .map(|q| quantity::bytes(&q))
                .transpose()
                .map_err(|e| invalid("memory", e))?
                .unwrap_or(0),
            gpus: get("nvidia.com/gpu")
                .map(|q| quantity::count(&q))
                .transpose()
                .map_err(|e| invalid("nvidia.com/gpu", e))?
                .map_or(Ok(0), u32::try_from)
                .map_err(|_| {
                    spec_error(
                        "InvalidResources",
                        format!("container {}: too many nvidia.com/gpu", c.name),
                    )
                })?,
        })
    };
    let mut total = Resources::default();
    let too_much = |what: &str| {
        spec_error(
            "InvalidResources",
            format!("the Pod's {what} requests add up past what any node holds"),
        )
    };
    for c in &spec.containers {
        let r = one(c)?;
        total.cpu_millis =
            (total.cpu_millis.checked_add(r.cpu_millis)).ok_or_else(|| too_much("cpu"))?;
        total.memory_bytes =
            (total.memory_bytes.checked_add(r.memory_bytes)).ok_or_else(|| too_much("memory"))?;
        total.gpus = (total.gpus.checked_add(r.gpus)).ok_or_else(|| too_much("nvidia.com/gpu"))?;
    }
    for c in spec.init_containers.iter().flatten() {
        let r = one(c)?;
        total.cpu_millis = total.cpu_millis.max(r.cpu_millis);
        total.memory_bytes = total.memory_bytes.max(r.memory_bytes);
        total.gpus = total.gpus.max(r.gpus);
    }
    Ok(total)
}

/// Expands `$(VAR)` from `env` the way the kubelet does: `$$` escapes, and an
/// unknown name is left as written.
pub fn expand(text: &str, env: &[(String, String)]) -> String {
    expand_with(text, |name| {
        env.iter()
            .rev()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    })
}

/// [`expand`] with the values from `lookup`.
fn expand_with<'v>(text: &str, mut lookup: impl FnMut(&str) -> Option<&'v str>) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(i) = rest.find('$') {
        out.push_str(&rest[..i]);
        let after = &rest[i + 1..];
        if let Some(tail) = after.strip_prefix('$') {
            out.push('$');
            rest = tail;
        } else if let Some(inner) = after.strip_prefix('(')
            && let Some(end) = inner.find(')')
        {
            let name = &inner[..end];
            match lookup(name) {
                Some(v) => out.push_str(v),
                None => {
                    out.push_str("$(");
                    out.push_str(name);
                    out.push(')');
                }
            }
            rest = &inner[end + 1..];
        } else {
            out.push('$');
            rest = after;
        }
    }
    out.push_str(rest);
    out
}

/// Expands a mount's `subPathExpr` as the kubelet does: every `$(VAR)` must
/// name a variable with a value, and the result must stay inside the volume
/// (relative, no `..`). Anything else leaves the container unconfigurable.
pub fn expand_sub_path(expr: &str, env: &[(String, String)]) -> Result<String, String> {
    let mut missing = std::collections::BTreeSet::new();
    let expanded = expand_with(expr, |name| {
        let value = env
            .iter()
            .rev()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
            .filter(|v| !v.is_empty());
        if value.is_none() {
            missing.insert(name.to_owned());
        }
        Some(value.unwrap_or(""))
    });
    if !missing.is_empty() {
        let names: Vec<String> = missing.into_iter().collect();
        return Err(format!("missing value for {}", names.join(", ")));
    }
    if expanded.starts_with('/') {
        return Err(format!(
            "error SubPath `{expanded}` must not be an absolute path"
        ));
    }
    if expanded.split('/').any(|s| s == "..") {
        return Err(format!(
            "unable to provision SubPath `{expanded}`: must not contain '..'"
        ));
    }
    Ok(expanded)
}

/// A volume whose files vkd writes from the API's objects and the Pod's own
/// fields, which can change while the Pod runs: configMap, secret,
/// downwardAPI, and projected ones of those. A projected ServiceAccount token
/// is not refreshed with them (each read would request a new token), so a
/// volume that holds one keeps its first content.
pub fn refreshable(v: &KubeVolume) -> bool {
    let token = v
        .projected
        .iter()
        .flat_map(|p| p.sources.iter().flatten())
        .any(|s| s.service_account_token.is_some());
    !token
        && (v.config_map.is_some()
            || v.secret.is_some()
            || v.downward_api.is_some()
            || v.projected.is_some())
}

/// Reads what a pending spec refers to and returns the spec a provider gets.
/// `volumes` is whether the provider materializes volume content.
#[allow(missing_debug_implementations)]
pub struct Resolver<'a> {
    pub client: &'a Client,
    pub policy: &'a Policy,
    pub host_ip: &'a str,
    pub volumes: bool,
    /// The cluster's Services, for the service environment variables; `None`
    /// gives none (as a kubelet without an API server).
    pub services: Option<&'a super::services::Services>,
    /// The node's allocatable, for `resourceFieldRef`s of unset limits; needed
    /// only when [`Pending::reads_allocatable`].
    pub allocatable: Option<Allocatable>,
}

/// Where key/value content comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Source {
    ConfigMap,
    Secret,
}

/// The kubelet's words for a missing ConfigMap or Secret (the API's NotFound):
/// `configmap "name" not found`.
fn not_found(source: Source, name: &str) -> String {
    let kind = match source {
        Source::ConfigMap => "configmap",
        Source::Secret => "secret",
    };
    format!("{kind} {name:?} not found")
}

/// A ConfigMap's or Secret's keys and bytes; `None` when it does not exist.
type Data = Option<BTreeMap<String, Vec<u8>>>;

/// What one resolve already read, so each object is fetched once.
#[derive(Default)]
struct Fetched(BTreeMap<(Source, String), Data>);

impl Resolver<'_> {
    pub async fn resolve(&self, p: &Pending) -> Result<InstanceSpec, ResolveError> {
        let ns = &p.spec.pod.namespace;
        let policy = self.policy;
        if !policy.allowed_namespaces.is_empty() && !policy.allowed_namespaces.contains(ns) {
            return Err(spec_error(
                "NamespaceNotAllowed",
                format!(
                    "node {} runs Pods only from namespaces {}",
                    p.spec.node,
                    policy.allowed_namespaces.join(", ")
                ),
            )
            .into());
        }
        check_host_access(policy, p)?;
        let mut fetched = Fetched::default();
        let mut spec = p.spec.clone();
        let fields = self.fields(p);
        let services = match self.services {
            Some(s) => s
                .env(ns, p.service_links)
                .await
                .map_err(|e| ResolveError::Config(e.to_string()))?,
            None => Vec::new(),
        };
        let mut all: Vec<&mut ContainerSpec> = spec
            .init_containers
            .iter_mut()
            .chain(spec.containers.iter_mut())
            .collect();
        for (c, declared) in all.iter_mut().zip(&p.env) {
            let env = self
                .env(ns, &c.name, declared, &fields, p, &services, &mut fetched)
                .await?;
            c.command = c.command.iter().map(|s| expand(s, &env)).collect();
            c.args = c.args.iter().map(|s| expand(s, &env)).collect();
            for (i, expr) in &declared.sub_path_exprs {
                let sub = expand_sub_path(expr, &env).map_err(ResolveError::Config)?;
                if let Some(m) = c.mounts.get_mut(*i) {
                    m.sub_path = Some(sub).filter(|s| !s.is_empty());
                }
            }
            c.env = env;
        }
        for v in &p.volumes {
            if self.volumes {
                let source = self.volume(ns, v, &fields, p, &mut fetched).await?;
                spec.volumes.push(Volume {
                    name: v.name.clone(),
                    source,
                });
            } else {
                // Nothing is read for a backend that does not use volume content,
                // but the policy still says what may be asked for.
                self.check_policy(v)?;
            }
        }
        Ok(spec)
    }

    /// The downward-API values of `p`, with the ones the node knows.
    fn fields(&self, p: &Pending) -> BTreeMap<String, String> {
        let mut fields = p.fields.clone();
        for f in [
            "status.hostIP",
            "status.hostIPs",
            "status.podIP",
            "status.podIPs",
        ] {
            fields.insert(f.into(), self.host_ip.to_owned());
        }
        fields
    }

    /// The [`refreshable`] volumes of `p` as they read now: what a running
    /// Pod's volumes are refreshed to.
    pub async fn file_volumes(&self, p: &Pending) -> Result<Vec<Volume>, ResolveError> {
        let fields = self.fields(p);
        let mut fetched = Fetched::default();
        let mut out = Vec::new();
        for v in p.volumes.iter().filter(|v| refreshable(v)) {
            let source = self
                .volume(&p.spec.pod.namespace, v, &fields, p, &mut fetched)
                .await?;
            out.push(Volume {
                name: v.name.clone(),
                source,
            });
        }
        Ok(out)
    }

    fn check_policy(&self, v: &KubeVolume) -> Result<(), SpecError> {
        let projected = v.projected.iter().flat_map(|p| p.sources.iter().flatten());
        let secret = v.secret.is_some()
            || projected
                .clone()
                .any(|s| s.secret.is_some() || s.service_account_token.is_some());
        let config_map =
            v.config_map.is_some() || projected.clone().any(|s| s.config_map.is_some());
        let refuse = |reason: &'static str, what: &str| {
            Err(spec_error(
                reason,
                format!(
                    "volume {}: the node policy hands no {what} to this backend",
                    v.name
                ),
            ))
        };
        if secret && !self.policy.allow_secrets {
            return refuse("SecretsNotAllowed", "Secrets or ServiceAccount tokens");
        }
        if config_map && !self.policy.allow_config_maps {
            return refuse("ConfigMapsNotAllowed", "ConfigMaps");
        }
        if v.host_path.is_some() && !self.policy.allow_host_path {
            return refuse("HostPathNotAllowed", "hostPath volumes");
        }
        Ok(())
    }

    /// The kubelet's `makeEnvironmentVariables`: envFrom, then env (which
    /// overrides it, and whose `$(VAR)`s read what came before and the service
    /// variables), then the service variables the Pod did not set itself.
    #[allow(clippy::too_many_arguments)]
    async fn env(
        &self,
        ns: &str,
        container: &str,
        declared: &ContainerEnv,
        fields: &BTreeMap<String, String>,
        p: &Pending,
        services: &[(String, String)],
        fetched: &mut Fetched,
    ) -> Result<Vec<(String, String)>, ResolveError> {
        let mut env: Vec<(String, String)> = Vec::new();
        let set = |env: &mut Vec<(String, String)>, k: String, v: String| {
            env.retain(|(n, _)| *n != k);
            env.push((k, v));
        };
        for from in &declared.env_from {
            let prefix = from.prefix.clone().unwrap_or_default();
            let (data, name, optional, what) = if let Some(r) = &from.config_map_ref {
                (
                    self.source(ns, &r.name, Source::ConfigMap, fetched).await?,
                    &r.name,
                    r.optional.unwrap_or(false),
                    Source::ConfigMap,
                )
            } else if let Some(r) = &from.secret_ref {
                (
                    self.source(ns, &r.name, Source::Secret, fetched).await?,
                    &r.name,
                    r.optional.unwrap_or(false),
                    Source::Secret,
                )
            } else {
                continue;
            };
            match data {
                Some(d) => {
                    for (k, v) in d {
                        set(&mut env, format!("{prefix}{k}"), lossy(&v));
                    }
                }
                None if optional => {}
                None => return Err(ResolveError::Config(not_found(what, name))),
            }
        }
        for e in &declared.env {
            let value = match &e.value_from {
                None => expand_with(e.value.as_deref().unwrap_or(""), |name| {
                    env.iter()
                        .rev()
                        .chain(services)
                        .find(|(k, _)| k == name)
                        .map(|(_, v)| v.as_str())
                }),
                Some(src) => {
                    let key_ref = src
                        .config_map_key_ref
                        .as_ref()
                        .map(|r| (Source::ConfigMap, &r.name, &r.key, r.optional))
                        .or_else(|| {
                            src.secret_key_ref
                                .as_ref()
                                .map(|r| (Source::Secret, &r.name, &r.key, r.optional))
                        });
                    if let Some((source, name, key, optional)) = key_ref {
                        let optional = optional.unwrap_or(false);
                        match self.source(ns, name, source, fetched).await? {
                            None if optional => continue,
                            None => return Err(ResolveError::Config(not_found(source, name))),
                            Some(mut data) => match data.remove(key.as_str()) {
                                Some(v) => lossy(&v),
                                None if optional => continue,
                                None => {
                                    return Err(ResolveError::Config(format!(
                                        "couldn't find key {key} in {source:?} {ns}/{name}"
                                    )));
                                }
                            },
                        }
                    } else if let Some(f) = &src.field_ref {
                        field(fields, &f.field_path)?
                    } else if let Some(r) = &src.resource_field_ref {
                        let of = r.container_name.as_deref().unwrap_or(container);
                        resource_field(
                            p,
                            of,
                            &r.resource,
                            r.divisor.as_ref().map(|d| &d.0),
                            self.allocatable,
                        )?
                    } else {
                        return Err(spec_error(
                            "InvalidSpec",
                            format!("env {} has a valueFrom this node does not support", e.name),
                        )
                        .into());
                    }
                }
            };
            set(&mut env, e.name.clone(), value);
        }
        let own: std::collections::HashSet<String> = env.iter().map(|(n, _)| n.clone()).collect();
        env.extend(services.iter().filter(|(k, _)| !own.contains(k)).cloned());
        Ok(env)
    }

    /// A ConfigMap's or Secret's content, if the node policy lets it reach the backend.
    async fn source(
        &self,
        ns: &str,
        name: &str,
        source: Source,
        fetched: &mut Fetched,
    ) -> Result<Data, ResolveError> {
        let (allowed, reason, what) = match source {
            Source::ConfigMap => (
                self.policy.allow_config_maps,
                "ConfigMapsNotAllowed",
                "ConfigMaps",
            ),
            Source::Secret => (self.policy.allow_secrets, "SecretsNotAllowed", "Secrets"),
        };
        if !allowed {
            return Err(spec_error(
                reason,
                format!("the node policy hands no {what} to this backend (wanted {name:?})"),
            )
            .into());
        }
        let cache_key = (source, name.to_owned());
        if let Some(d) = fetched.0.get(&cache_key) {
            return Ok(d.clone());
        }
        // Text and binary keys, as bytes.
        let merge = |text: Option<BTreeMap<String, String>>,
                     bytes: Option<BTreeMap<String, k8s_openapi::ByteString>>| {
            let mut out: BTreeMap<String, Vec<u8>> = text
                .unwrap_or_default()
                .into_iter()
                .map(|(k, v)| (k, v.into_bytes()))
                .collect();
            for (k, v) in bytes.unwrap_or_default() {
                out.insert(k, v.0);
            }
            out
        };
        let data = match source {
            Source::ConfigMap => Api::<ConfigMap>::namespaced(self.client.clone(), ns)
                .get_opt(name)
                .await?
                .map(|cm| merge(cm.data, cm.binary_data)),
            Source::Secret => Api::<Secret>::namespaced(self.client.clone(), ns)
                .get_opt(name)
                .await?
                // stringData is write-only in the API; data holds everything.
                .map(|s| merge(s.string_data, s.data)),
        };
        fetched.0.insert(cache_key, data.clone());
        Ok(data)
    }

    async fn token(
        &self,
        p: &Pending,
        audience: Option<&str>,
        expiration: Option<i64>,
    ) -> Result<Vec<u8>, ResolveError> {
        if !self.policy.allow_secrets {
            return Err(spec_error(
                "SecretsNotAllowed",
                "the node policy hands no credentials to this backend, and the Pod mounts a \
                 ServiceAccount token (set automountServiceAccountToken: false)",
            )
            .into());
        }
        let api: Api<ServiceAccount> = Api::namespaced(self.client.clone(), &p.spec.pod.namespace);
        let request = TokenRequest {
            spec: Some(TokenRequestSpec {
                audiences: audience.map(|a| vec![a.to_owned()]),
                expiration_seconds: Some(expiration.unwrap_or(3607)),
                bound_object_ref: Some(BoundObjectReference {
                    api_version: Some("v1".into()),
                    kind: Some("Pod".into()),
                    name: Some(p.spec.pod.name.clone()),
                    uid: Some(p.spec.pod.uid.clone()),
                }),
                ..Default::default()
            }),
            ..Default::default()
        };
        let made = api
            .create_token_request(&p.service_account, &PostParams::default(), &request)
            .await
            .map_err(|e| match e {
                kube::Error::Api(s) if s.code == 404 => ResolveError::Config(format!(
                    "serviceaccount {:?} not found",
                    p.service_account
                )),
                e => e.into(),
            })?;
        Ok(made
            .status
            .and_then(|s| s.token)
            .unwrap_or_default()
            .into_bytes())
    }

    async fn volume(
        &self,
        ns: &str,
        v: &KubeVolume,
        fields: &BTreeMap<String, String>,
        p: &Pending,
        fetched: &mut Fetched,
    ) -> Result<VolumeSource, ResolveError> {
        if let Some(e) = &v.empty_dir {
            let size_limit = e
                .size_limit
                .as_ref()
                .map(|q| quantity::bytes(&q.0))
                .transpose()
                .map_err(|e| spec_error("InvalidSpec", format!("volume {}: {e}", v.name)))?;
            return Ok(VolumeSource::EmptyDir {
                size_limit,
                memory: e.medium.as_deref() == Some("Memory"),
            });
        }
        if let Some(h) = &v.host_path {
            if !self.policy.allow_host_path {
                return Err(spec_error(
                    "HostPathNotAllowed",
                    format!("volume {}: the node policy does not allow hostPath", v.name),
                )
                .into());
            }
            return Ok(VolumeSource::HostPath {
                path: h.path.clone(),
            });
        }
        let mut files = Vec::new();
        if let Some(c) = &v.config_map {
            let data = self.source(ns, &c.name, Source::ConfigMap, fetched).await?;
            let mode = c.default_mode.unwrap_or(0o644);
            project(
                &mut files,
                data,
                c.items.as_deref(),
                mode,
                c.optional,
                Source::ConfigMap,
                &c.name,
            )?;
        } else if let Some(s) = &v.secret {
            let name = s.secret_name.clone().unwrap_or_default();
            let data = self.source(ns, &name, Source::Secret, fetched).await?;
            let mode = s.default_mode.unwrap_or(0o644);
            project(
                &mut files,
                data,
                s.items.as_deref(),
                mode,
                s.optional,
                Source::Secret,
                &name,
            )?;
        } else if let Some(d) = &v.downward_api {
            let mode = d.default_mode.unwrap_or(0o644);
            for item in d.items.iter().flatten() {
                let data = downward(
                    fields,
                    p,
                    item.field_ref.as_ref(),
                    item.resource_field_ref.as_ref(),
                    self.allocatable,
                )?;
                files.push(file(
                    &item.path,
                    data.into_bytes(),
                    item.mode.unwrap_or(mode),
                )?);
            }
        } else if let Some(pr) = &v.projected {
            let mode = pr.default_mode.unwrap_or(0o644);
            for src in pr.sources.iter().flatten() {
                if let Some(c) = &src.config_map {
                    let data = self.source(ns, &c.name, Source::ConfigMap, fetched).await?;
                    project(
                        &mut files,
                        data,
                        c.items.as_deref(),
                        mode,
                        c.optional,
                        Source::ConfigMap,
                        &c.name,
                    )?;
                } else if let Some(s) = &src.secret {
                    let data = self.source(ns, &s.name, Source::Secret, fetched).await?;
                    project(
                        &mut files,
                        data,
                        s.items.as_deref(),
                        mode,
                        s.optional,
                        Source::Secret,
                        &s.name,
                    )?;
                } else if let Some(d) = &src.downward_api {
                    for item in d.items.iter().flatten() {
                        let data = downward(
                            fields,
                            p,
                            item.field_ref.as_ref(),
                            item.resource_field_ref.as_ref(),
                            self.allocatable,
                        )?;
                        files.push(file(
                            &item.path,
                            data.into_bytes(),
                            item.mode.unwrap_or(mode),
                        )?);
                    }
                } else if let Some(t) = &src.service_account_token {
                    let token = self
                        .token(p, t.audience.as_deref(), t.expiration_seconds)
                        .await?;
                    files.push(file(&t.path, token, 0o600)?);
                } else {
                    return Err(spec_error(
                        "UnsupportedVolume",
                        format!(
                            "volume {}: a projected source this node does not support",
                            v.name
                        ),
                    )
                    .into());
                }
            }
        }
        Ok(VolumeSource::Files { files })
    }
}

fn lossy(v: &[u8]) -> String {
    String::from_utf8_lossy(v).into_owned()
}

fn field(fields: &BTreeMap<String, String>, path: &str) -> Result<String, ResolveError> {
    if let Some(v) = fields.get(path) {
        return Ok(v.clone());
    }
    if path.starts_with("metadata.labels[") || path.starts_with("metadata.annotations[") {
        return Ok(String::new());
    }
    Err(spec_error("InvalidSpec", format!("unsupported fieldRef {path:?}")).into())
}

/// A container's resource as the downward API reads it. As the kubelet's
/// `defaultPodLimitsForDownwardAPI`: a cpu or memory limit that is not set (or
/// zero) reads as the Pod-level limit, else as the node's allocatable; an unset
/// request reads as 0.
fn resource_field(
    p: &Pending,
    container: &str,
    resource: &str,
    divisor: Option<&String>,
    allocatable: Option<Allocatable>,
) -> Result<String, ResolveError> {
    let bad = |e: quantity::QuantityError| {
        ResolveError::from(spec_error(
            "InvalidSpec",
            format!("resourceFieldRef {resource}: {e}"),
        ))
    };
    let is_zero = |v: &str| quantity::bytes(v).is_ok_and(|n| n == 0);
    let set = p
        .resources
        .get(container)
        .and_then(|r| r.get(resource).cloned());
    let defaulted = match resource.strip_prefix("limits.") {
        Some(name @ ("cpu" | "memory")) if set.as_deref().is_none_or(is_zero) => {
            let pod = p.pod_limits.get(name).filter(|v| !is_zero(v)).cloned();
            match (pod, allocatable) {
                (Some(v), _) => Some(v),
                (None, Some(a)) if name == "cpu" => Some(format!("{}m", a.cpu_millis)),
                (None, Some(a)) => Some(a.memory_bytes.to_string()),
                (None, None) => {
                    return Err(ResolveError::Config(format!(
                        "resourceFieldRef {resource}: container {container} sets no limit and \
                         the node's allocatable is not known yet"
                    )));
                }
            }
        }
        _ => None,
    };
    let value = defaulted.or(set).unwrap_or_else(|| "0".into());
    if resource.ends_with(".cpu") {
        let millis = quantity::cpu_millis(&value).map_err(bad)?;
        // The apiserver stores an unset divisor as "0"; like the kubelet, a zero
        // divisor means the default: one core, one byte.
        let div = divisor
            .map(|d| quantity::cpu_millis(d))
            .transpose()
            .map_err(bad)?
            .filter(|d| *d > 0)
            .unwrap_or(1000);
        Ok(millis.div_ceil(div).to_string())
    } else {
        let bytes = quantity::bytes(&value).map_err(bad)?;
        let div = divisor
            .map(|d| quantity::bytes(d))
            .transpose()
            .map_err(bad)?
            .filter(|d| *d > 0)
            .unwrap_or(1);
        Ok(bytes.div_ceil(div).to_string())
    }
}

fn downward(
    fields: &BTreeMap<String, String>,
    p: &Pending,
    field_ref: Option<&k8s_openapi::api::core::v1::ObjectFieldSelector>,
    resource_ref: Option<&k8s_openapi::api::core::v1::ResourceFieldSelector>,
    allocatable: Option<Allocatable>,
) -> Result<String, ResolveError> {
    if let Some(f) = field_ref {
        return field(fields, &f.field_path);
    }
    if let Some(r) = resource_ref {
        let container = r.container_name.as_deref().unwrap_or_default();
        return resource_field(
            p,
            container,
            &r.resource,
            r.divisor.as_ref().map(|d| &d.0),
            allocatable,
        );
    }
    Err(spec_error(
        "InvalidSpec",
        "a downwardAPI item with neither fieldRef nor resourceFieldRef",
    )
    .into())
}

/// A relative file path inside a volume; `..` and absolute paths are refused.
fn file(path: &str, data: Vec<u8>, mode: i32) -> Result<VolumeFile, ResolveError> {
    let ok = !path.is_empty()
        && !path.starts_with('/')
        && path.split('/').all(|s| !s.is_empty() && s != "..");
    if !ok {
        return Err(spec_error("InvalidSpec", format!("volume file path {path:?}")).into());
    }
    Ok(VolumeFile {
        path: path.to_owned(),
        data,
        mode: mode.max(0).unsigned_abs() & 0o777,
    })
}

/// Writes a ConfigMap's or Secret's keys as files, with the modes the Pod
/// gives (the API server defaults defaultMode to 0644), as the kubelet does: a
/// backend keeps other users out of the volume itself (the process provider's
/// volume directories are the Pod user's alone).
fn project(
    files: &mut Vec<VolumeFile>,
    data: Option<BTreeMap<String, Vec<u8>>>,
    items: Option<&[KeyToPath]>,
    mode: i32,
    optional: Option<bool>,
    source: Source,
    name: &str,
) -> Result<(), ResolveError> {
    let Some(mut data) = data else {
        if optional.unwrap_or(false) {
            return Ok(());
        }
        return Err(ResolveError::Config(not_found(source, name)));
    };
    match items {
        None => {
            for (k, v) in data {
                files.push(file(&k, v, mode)?);
            }
        }
        Some(items) => {
            for it in items {
                let Some(v) = data.remove(&it.key) else {
                    if optional.unwrap_or(false) {
                        continue;
                    }
                    // The volume plugins' words.
                    return Err(ResolveError::Config(match source {
                        Source::ConfigMap => {
                            format!("configmap references non-existent config key: {}", it.key)
                        }
                        Source::Secret => {
                            format!("references non-existent secret key: {}", it.key)
                        }
                    }));
                };
                files.push(file(&it.path, v, it.mode.unwrap_or(mode))?);
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(v: serde_json::Value) -> Pod {
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn resources_are_summed_like_the_scheduler() {
        let p = pod(json!({
            "metadata": {"name": "p", "namespace": "ns", "uid": "u1"},
            "spec": {
                "containers": [
                    {"name": "a", "image": "x", "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"nvidia.com/gpu": "2"}}},
                    {"name": "b", "image": "y", "resources": {"requests": {"cpu": "1"}}}
                ],
                "initContainers": [{"name": "i", "image": "z", "resources": {"requests": {"cpu": "4"}}}]
            }
        }));
        let s = pending(&p, "vk").unwrap().spec;
        assert_eq!(
            s.resources,
            Resources {
                cpu_millis: 4000,
                memory_bytes: 1 << 30,
                gpus: 2
            }
        );
        assert_eq!(s.pod.uid, "u1");
        assert_eq!(s.restart_policy, RestartPolicy::Always);
        assert_eq!(s.init_containers.len(), 1);
        assert_eq!(s.containers.len(), 2);
        assert_eq!(s.termination_grace, Duration::from_secs(30));
    }

    /// What a backend with Pod networks needs: hostNetwork, the hostPorts
    /// (checked, since network plugins run as root), and which variables
    /// name the Pod's IP (the last declaration of a name wins).
    #[test]
    fn host_ports_host_network_and_pod_ip_variables_reach_the_spec() {
        let p = pod(json!({
            "metadata": {"name": "p", "namespace": "ns", "uid": "u1"},
            "spec": {
                "hostNetwork": true,
                "containers": [{"name": "a", "image": "x",
                    "ports": [{"containerPort": 8080, "hostPort": 30080},
                              {"containerPort": 53, "hostPort": 5353, "protocol": "UDP", "hostIP": "127.0.0.1"},
                              {"containerPort": 9090}],
                    "env": [
                        {"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                        {"name": "IPS", "valueFrom": {"fieldRef": {"fieldPath": "status.podIPs"}}},
                        {"name": "HOST", "valueFrom": {"fieldRef": {"fieldPath": "status.hostIP"}}},
                        {"name": "IPS", "value": "overridden"}
                    ]}]
            }
        }));
        let s = pending(&p, "vk").unwrap().spec;
        assert!(s.host_network);
        assert_eq!(
            s.host_ports,
            vec![
                vkd_provider::HostPort {
                    container_port: 8080,
                    host_port: 30080,
                    protocol: "TCP".into(),
                    host_ip: None
                },
                vkd_provider::HostPort {
                    container_port: 53,
                    host_port: 5353,
                    protocol: "UDP".into(),
                    host_ip: Some("127.0.0.1".into())
                }
            ]
        );
        assert_eq!(s.containers[0].pod_ip_env, vec!["IP".to_owned()]);
        for (port, why) in [
            (
                json!({"containerPort": 80, "hostPort": 70000}),
                "hostPort 70000",
            ),
            (
                json!({"containerPort": 80, "hostPort": 80, "protocol": "ICMP"}),
                "protocol",
            ),
            (
                json!({"containerPort": 80, "hostPort": 80, "hostIP": "a;b"}),
                "hostIP",
            ),
        ] {
            let bad = pod(json!({
                "metadata": {"name": "p", "namespace": "ns", "uid": "u1"},
                "spec": {"containers": [{"name": "a", "image": "x", "ports": [port]}]}
            }));
            let e = pending(&bad, "vk").err().unwrap().to_string();
            assert!(e.contains(why), "{e}");
        }
    }

    /// A sidecar is an init container with `restartPolicy: Always`; the
    /// termination message settings travel with each container.
    #[test]
    fn sidecars_and_termination_messages_reach_the_spec() {
        let p = pod(json!({
            "metadata": {"name": "p", "namespace": "ns", "uid": "u1"},
            "spec": {
                "initContainers": [
                    {"name": "setup", "image": "x"},
                    {"name": "proxy", "image": "x", "restartPolicy": "Always"}
                ],
                "containers": [
                    {"name": "a", "image": "x", "terminationMessagePath": "/dev/termination-log",
                     "terminationMessagePolicy": "File"},
                    {"name": "b", "image": "x", "terminationMessagePath": "/tmp/why",
                     "terminationMessagePolicy": "FallbackToLogsOnError"}
                ]
            }
        }));
        let s = pending(&p, "vk").unwrap().spec;
        let sidecars: Vec<bool> = s.init_containers.iter().map(|c| c.restart_always).collect();
        assert_eq!(sidecars, [false, true]);
        assert!(s.containers.iter().all(|c| !c.restart_always));
        let (a, b) = (&s.containers[0], &s.containers[1]);
        assert_eq!(
            a.termination_message_path, None,
            "the default is not kept per Pod"
        );
        assert_eq!(a.termination_message_path(), "/dev/termination-log");
        assert_eq!(
            a.termination_message_policy,
            vkd_provider::TerminationMessagePolicy::File
        );
        assert_eq!(b.termination_message_path(), "/tmp/why");
        assert_eq!(
            b.termination_message_policy,
            vkd_provider::TerminationMessagePolicy::FallbackToLogsOnError
        );
    }

    #[test]
    fn bad_quantities_name_the_container() {
        let p = pod(json!({
            "metadata": {"name": "p", "namespace": "ns", "uid": "u1"},
            "spec": {"containers": [{"name": "a", "image": "x", "resources": {"requests": {"nvidia.com/gpu": "1.5"}}}]}
        }));
        let e = pending(&p, "vk").unwrap_err();
        assert_eq!(e.reason, "InvalidResources");
        assert!(e.message.contains("container a"), "{e}");
    }

    /// `securityContext.fsGroup` reaches the spec; a number that is no group
    /// ID is refused by name, never wrapped.
    #[test]
    fn fs_group_is_a_group_id_or_a_clear_error() {
        let with = |fs_group: serde_json::Value| {
            pending(
                &pod(json!({
                    "metadata": {"name": "p", "namespace": "ns", "uid": "u1"},
                    "spec": {"securityContext": {"fsGroup": fs_group},
                             "containers": [{"name": "a", "image": "x"}]}
                })),
                "vk",
            )
        };
        assert_eq!(with(json!(123)).unwrap().spec.fs_group, Some(123));
        assert_eq!(with(json!(0)).unwrap().spec.fs_group, Some(0));
        for bad in [json!(-1), json!(4_294_967_295_i64), json!(i64::MAX)] {
            let e = with(bad.clone()).unwrap_err();
            assert_eq!(e.reason, "InvalidSpec", "{bad}");
            assert!(e.message.contains("fsGroup"), "{e}");
        }
    }

    /// Every quantity form the apiserver admits is read; what no process could
    /// run in (a memory limit of half a byte) and sums past u64 are refused by name.
    #[test]
    fn quantities_read_as_the_apiserver_does() {
        let with = |resources: serde_json::Value| {
            pending(
                &pod(json!({
                    "metadata": {"name": "p", "namespace": "ns", "uid": "u1"},
                    "spec": {"containers": [{"name": "a", "image": "x", "resources": resources}]}
                })),
                "vk",
            )
        };
        let s =
            with(json!({"requests": {"cpu": "1e0", "memory": "1Ei"}, "limits": {"memory": "2Ei"}}))
                .unwrap()
                .spec;
        assert_eq!(s.resources.cpu_millis, 1000);
        assert_eq!(s.resources.memory_bytes, 1 << 60);
        assert_eq!(s.containers[0].limits.memory_bytes, Some(2 << 60));
        let e = with(json!({"limits": {"memory": "500m"}})).unwrap_err();
        assert_eq!(e.reason, "InvalidResources");
        assert!(
            e.message.contains("limits.memory") && e.message.contains("500m"),
            "{e}"
        );
        let huge = pending(
            &pod(json!({
                "metadata": {"name": "p", "namespace": "ns", "uid": "u1"},
                "spec": {"containers": [
                    {"name": "a", "image": "x", "resources": {"requests": {"memory": "10E"}}},
                    {"name": "b", "image": "x", "resources": {"requests": {"memory": "10E"}}}
                ]}
            })),
            "vk",
        )
        .unwrap_err();
        assert_eq!(huge.reason, "InvalidResources");
    }

    #[test]
    fn probes_get_kubelet_defaults_and_named_ports() {
        let p = pod(json!({
            "metadata": {"name": "p", "namespace": "ns", "uid": "u1"},
            "spec": {"containers": [{"name": "web", "image": "x",
                "ports": [{"name": "http", "containerPort": 8080}],
                "readinessProbe": {"httpGet": {"port": "http", "path": "/ready"}},
                "livenessProbe": {"tcpSocket": {"port": 8080}, "periodSeconds": 2, "failureThreshold": 1},
                "lifecycle": {"preStop": {"exec": {"command": ["sh", "-c", "echo bye"]}}}}]}
        }));
        let c = &pending(&p, "vk").unwrap().spec.containers[0];
        let r = c.readiness_probe.as_ref().unwrap();
        assert_eq!(r.period, Duration::from_secs(10));
        assert_eq!(r.failure_threshold, 3);
        assert!(
            matches!(&r.handler, Handler::HttpGet { port: 8080, path, .. } if path == "/ready")
        );
        let l = c.liveness_probe.as_ref().unwrap();
        assert_eq!((l.period, l.failure_threshold), (Duration::from_secs(2), 1));
        assert!(
            matches!(c.pre_stop.as_deref(), Some(Handler::Exec { command }) if command.len() == 3)
        );
    }

    #[test]
    fn malformed_probes_and_volumes_fail_clearly() {
        let p = pod(json!({
            "metadata": {"name": "p", "namespace": "ns", "uid": "u1"},
            "spec": {"containers": [{"name": "web", "image": "x",
                "readinessProbe": {"httpGet": {"port": "nosuch"}}}]}
        }));
        let e = pending(&p, "vk").unwrap_err();
        assert_eq!(e.reason, "InvalidProbe");
        assert!(
            e.message.contains("\"nosuch\" names no containerPort"),
            "{e}"
        );

        let p = pod(json!({
            "metadata": {"name": "p", "namespace": "ns", "uid": "u1"},
            "spec": {"containers": [{"name": "web", "image": "x"}],
                "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "c"}}]}
        }));
        let e = pending(&p, "vk").unwrap_err();
        assert_eq!(e.reason, "UnsupportedVolume");
        assert!(e.message.contains("persistentVolumeClaim"), "{e}");
    }

    #[test]
    fn secret_files_have_the_pods_modes() {
        let data: BTreeMap<String, Vec<u8>> = [("k".to_owned(), b"v".to_vec())].into();
        let mut files = Vec::new();
        project(
            &mut files,
            Some(data.clone()),
            None,
            0o644,
            None,
            Source::Secret,
            "s",
        )
        .unwrap();
        project(
            &mut files,
            Some(data),
            None,
            0o644,
            None,
            Source::ConfigMap,
            "c",
        )
        .unwrap();
        assert_eq!((files[0].mode, files[1].mode), (0o644, 0o644));
        let missing = project(&mut files, None, None, 0o644, None, Source::Secret, "gone");
        assert!(
            matches!(missing, Err(ResolveError::Config(m)) if m == "secret \"gone\" not found")
        );
        assert!(
            project(
                &mut files,
                None,
                None,
                0o644,
                Some(true),
                Source::Secret,
                "gone"
            )
            .is_ok()
        );
    }

    #[test]
    fn expansion_follows_the_kubelet() {
        let env = vec![
            ("A".to_owned(), "1".to_owned()),
            ("B".to_owned(), "x y".to_owned()),
        ];
        assert_eq!(expand("$(A)-$(B)", &env), "1-x y");
        assert_eq!(expand("$$(A) $(C) $A $", &env), "$(A) $(C) $A $");
        assert_eq!(expand("$(unterminated", &env), "$(unterminated");
    }

    #[test]
    fn downward_fields_and_resources() {
        let p = pod(json!({
            "metadata": {"name": "p", "namespace": "ns", "uid": "u1", "labels": {"app": "web"}},
            "spec": {"containers": [{"name": "web", "image": "x",
                "resources": {"limits": {"memory": "64Mi", "cpu": "250m"}}}]}
        }));
        let pend = pending(&p, "vk").unwrap();
        assert_eq!(
            field(&pend.fields, "metadata.labels['app']").unwrap(),
            "web"
        );
        assert_eq!(
            field(&pend.fields, "metadata.labels").unwrap(),
            "app=\"web\""
        );
        assert_eq!(
            resource_field(&pend, "web", "limits.memory", None, None).unwrap(),
            "67108864"
        );
        assert_eq!(
            resource_field(&pend, "web", "limits.cpu", None, None).unwrap(),
            "1"
        );
        let mi = "1Mi".to_owned();
        assert_eq!(
            resource_field(&pend, "web", "limits.memory", Some(&mi), None).unwrap(),
            "64"
        );
        // The divisor the apiserver stores when none is given: cores, rounded up.
        let zero = "0".to_owned();
        assert_eq!(
            resource_field(&pend, "web", "limits.cpu", Some(&zero), None).unwrap(),
            "1"
        );
        assert_eq!(
            resource_field(&pend, "web", "limits.memory", Some(&zero), None).unwrap(),
            "67108864"
        );
        assert!(file("../etc/passwd", vec![], 0o644).is_err());
        assert!(file("/abs", vec![], 0o644).is_err());
        assert_eq!(file("a/b", vec![], 0o4755).unwrap().mode, 0o755);
    }

    /// The kubelet's subpath expansion: every reference must have a value, and
    /// the result must stay inside the volume.
    #[test]
    fn sub_path_expr_follows_the_kubelet() {
        let env = vec![
            ("POD_NAME".to_owned(), "foo".to_owned()),
            ("ANNOTATION".to_owned(), "mypath".to_owned()),
            ("EMPTY".to_owned(), String::new()),
            ("UP".to_owned(), "..".to_owned()),
            ("ABS".to_owned(), "/tmp".to_owned()),
        ];
        assert_eq!(
            expand_sub_path("$(ANNOTATION)/$(POD_NAME)", &env).unwrap(),
            "mypath/foo"
        );
        assert_eq!(
            expand_sub_path("a$$(POD_NAME)", &env).unwrap(),
            "a$(POD_NAME)"
        );
        assert_eq!(
            expand_sub_path("$(NOPE)/$(EMPTY)/$(POD_NAME)", &env).unwrap_err(),
            "missing value for EMPTY, NOPE"
        );
        assert_eq!(
            expand_sub_path("$(UP)", &env).unwrap_err(),
            "unable to provision SubPath `..`: must not contain '..'"
        );
        assert!(expand_sub_path("a/$(UP)/b", &env).is_err());
        assert!(expand_sub_path("a..b", &env).is_ok());
        assert_eq!(
            expand_sub_path("$(ABS)", &env).unwrap_err(),
            "error SubPath `/tmp` must not be an absolute path"
        );
    }

    /// As the kubelet's defaultPodLimitsForDownwardAPI: an unset (or zero)
    /// limit reads as the Pod-level limit, else the node's allocatable; an
    /// unset request reads as 0, never as something else.
    #[test]
    fn unset_limits_read_as_node_allocatable() {
        let p = pod(json!({
            "metadata": {"name": "p", "namespace": "ns", "uid": "u1"},
            "spec": {"containers": [
                {"name": "bare", "image": "x",
                    "env": [{"name": "CPU", "valueFrom": {"resourceFieldRef": {"resource": "limits.cpu"}}}]},
                {"name": "set", "image": "x",
                    "resources": {"limits": {"cpu": "0", "memory": "64Mi"}, "requests": {"cpu": "250m"}}}
            ]}
        }));
        let pend = pending(&p, "vk").unwrap();
        assert!(pend.reads_allocatable);
        let node = Some(Allocatable {
            cpu_millis: 7500,
            memory_bytes: 16 << 30,
        });
        let read = |c: &str, r: &str, d: Option<&str>| {
            let d = d.map(str::to_owned);
            resource_field(&pend, c, r, d.as_ref(), node)
                .map_err(|e| e.to_string())
                .unwrap()
        };
        assert_eq!(read("bare", "limits.cpu", None), "8");
        assert_eq!(read("bare", "limits.cpu", Some("1m")), "7500");
        assert_eq!(read("bare", "limits.memory", Some("1Gi")), "16");
        assert_eq!(read("bare", "requests.cpu", None), "0");
        assert_eq!(read("bare", "requests.memory", None), "0");
        // A zero limit is no limit.
        assert_eq!(read("set", "limits.cpu", Some("1m")), "7500");
        assert_eq!(read("set", "limits.memory", Some("1Mi")), "64");
        assert_eq!(read("set", "requests.cpu", Some("1m")), "250");
        // Unknown allocatable: retried, never a made-up figure.
        assert!(matches!(
            resource_field(&pend, "bare", "limits.cpu", None, None),
            Err(ResolveError::Config(_))
        ));
        // Pod-level limits come before the node's.
        let p = pod(json!({
            "metadata": {"name": "p", "namespace": "ns", "uid": "u1"},
            "spec": {"resources": {"limits": {"cpu": "2", "memory": "1Gi"}},
                "containers": [{"name": "c", "image": "x"}],
                "volumes": [{"name": "d", "downwardAPI": {"items": [
                    {"path": "mem", "resourceFieldRef": {"containerName": "c", "resource": "limits.memory"}}]}}]}
        }));
        let pend = pending(&p, "vk").unwrap();
        assert!(pend.reads_allocatable);
        assert_eq!(
            resource_field(&pend, "c", "limits.cpu", None, node).unwrap(),
            "2"
        );
        // Nothing reads a limit: the provider is not asked for capacity.
        let p = pod(json!({
            "metadata": {"name": "p", "namespace": "ns", "uid": "u1"},
            "spec": {"containers": [{"name": "c", "image": "x",
                "env": [{"name": "R", "valueFrom": {"resourceFieldRef": {"resource": "requests.cpu"}}}]}]}
        }));
        assert!(!pending(&p, "vk").unwrap().reads_allocatable);
    }

    /// A Pod `spec` in namespace `app`, pending on node `vk`.
    fn pending_spec(spec: serde_json::Value) -> Pending {
        pending(
            &pod(json!({"metadata": {"name": "p", "namespace": "app", "uid": "u1"}, "spec": spec})),
            "vk",
        )
        .unwrap()
    }

    #[test]
    fn host_namespaces_privileged_and_capabilities_need_the_policy() {
        let policy = Policy::default();
        assert!(!policy.allow_privileged, "off by default");
        let c = json!({"name": "c", "image": "x"});
        let refused = |spec: serde_json::Value| check_host_access(&policy, &pending_spec(spec));
        // Nothing asked: nothing refused.
        assert_eq!(refused(json!({"containers": [c]})), Ok(()));
        for field in ["hostNetwork", "hostPID", "hostIPC"] {
            let e = refused(json!({field: true, "containers": [c]})).unwrap_err();
            assert_eq!(e.reason, "HostNamespacesNotAllowed", "{field}");
            assert!(e.message.contains(&format!("spec.{field} is true")), "{e}");
            assert!(e.message.contains("privileged=refused"), "{e}");
            // false is what the default says.
            assert_eq!(refused(json!({field: false, "containers": [c]})), Ok(()));
        }
        let privileged = |name: &str| json!({"name": name, "image": "x", "securityContext": {"privileged": true}});
        for (spec, who) in [
            (json!({"containers": [c, privileged("p")]}), "container p"),
            (
                json!({"initContainers": [privileged("i")], "containers": [c]}),
                "init container i",
            ),
            (
                json!({"initContainers": [{"name": "s", "image": "x", "restartPolicy": "Always",
                    "securityContext": {"privileged": true}}], "containers": [c]}),
                "init container s",
            ),
        ] {
            let e = refused(spec).unwrap_err();
            assert_eq!(e.reason, "PrivilegedNotAllowed");
            assert!(
                e.message
                    .starts_with(&format!("{who}: securityContext.privileged is true")),
                "{e}"
            );
        }
        let caps = |add: serde_json::Value| {
            json!({"containers": [{"name": "c", "image": "x",
                "securityContext": {"capabilities": {"add": add, "drop": ["ALL"]}}}]})
        };
        // The runtime's default set, as runtimes read names: any case, CAP_ or not.
        assert_eq!(
            refused(caps(json!([
                "NET_BIND_SERVICE",
                "cap_chown",
                "Kill",
                "CAP_SYS_CHROOT"
            ]))),
            Ok(())
        );
        for (add, named) in [
            (json!(["SYS_ADMIN"]), "SYS_ADMIN"),
            (
                json!(["chown", "cap_net_admin", "SYS_PTRACE"]),
                "cap_net_admin, SYS_PTRACE",
            ),
            (json!(["ALL"]), "ALL"),
            (json!(["CAP_"]), "CAP_"),
        ] {
            let e = refused(caps(add)).unwrap_err();
            assert_eq!(e.reason, "CapabilitiesNotAllowed");
            assert!(
                e.message.starts_with(&format!(
                    "container c: securityContext.capabilities.add has {named}:"
                )),
                "{e}"
            );
        }
        // With the policy, all of it runs.
        let allowed = Policy {
            allow_privileged: true,
            ..Policy::default()
        };
        let spec = json!({"hostNetwork": true, "hostPID": true, "hostIPC": true,
            "initContainers": [privileged("i")],
            "containers": [{"name": "c", "image": "x", "securityContext":
                {"privileged": true, "capabilities": {"add": ["SYS_ADMIN"]}}}]});
        assert_eq!(check_host_access(&allowed, &pending_spec(spec)), Ok(()));
    }

    #[test]
    fn the_nodes_own_ports_are_never_a_pods_host_port() {
        let policy = Policy {
            // Not even with every other door open.
            allow_privileged: true,
            node_ports: BTreeMap::from([
                (10250, "vkd's kubelet API (--kubelet-port)".to_owned()),
                (10256, "vkd's admin server (--admin-port)".to_owned()),
            ]),
            ..Policy::default()
        };
        let with_port = |port: u16, protocol: &str| {
            pending_spec(
                json!({"containers": [{"name": "web", "image": "x", "ports": [
                {"containerPort": 8080, "hostPort": 8080},
                {"containerPort": 9000, "hostPort": port, "protocol": protocol}]}]}),
            )
        };
        assert_eq!(check_host_access(&policy, &with_port(9000, "TCP")), Ok(()));
        for (port, user) in [(10250, "--kubelet-port"), (10256, "--admin-port")] {
            for protocol in ["TCP", "UDP"] {
                let e = check_host_access(&policy, &with_port(port, protocol)).unwrap_err();
                assert_eq!(e.reason, "HostPortNotAllowed");
                assert!(
                    e.message
                        .starts_with(&format!("container web: hostPort {port} is ")),
                    "{e}"
                );
                assert!(
                    e.message.contains(user) && e.message.contains("node vk"),
                    "{e}"
                );
            }
        }
        // hostNetwork: the API server sets hostPort to containerPort.
        let e = check_host_access(
            &policy,
            &pending_spec(
                json!({"hostNetwork": true, "initContainers": [{"name": "i", "image": "x",
                "ports": [{"containerPort": 10250, "hostPort": 10250}]}],
                "containers": [{"name": "c", "image": "x"}]}),
            ),
        )
        .unwrap_err();
        assert_eq!(e.reason, "HostPortNotAllowed");
        assert!(
            e.message.starts_with("init container i: hostPort 10250"),
            "{e}"
        );
    }

    #[test]
    fn the_node_shows_the_privileged_policy() {
        assert_eq!(
            Policy::default().to_string(),
            "namespaces=all secrets=allowed configmaps=allowed hostpath=refused privileged=refused"
        );
        let p = Policy {
            allow_privileged: true,
            ..Policy::default()
        };
        assert!(p.to_string().ends_with(" privileged=allowed"), "{p}");
    }

    /// The refusals end a resolve as the other policy refusals do: the Pod fails.
    #[tokio::test]
    async fn resolve_refuses_what_the_policy_does_not_give() {
        let (client, _log) = crate::testing::fake_api(|_| crate::testing::status(404, "NotFound"));
        let policy = Policy {
            node_ports: BTreeMap::from([(10250, "vkd's kubelet API (--kubelet-port)".into())]),
            ..Policy::default()
        };
        let resolver = |policy| Resolver {
            client: &client,
            policy,
            host_ip: "192.0.2.1",
            volumes: false,
            services: None,
            allocatable: None,
        };
        for (spec, reason) in [
            (
                json!({"hostPID": true, "containers": [{"name": "c", "image": "x"}]}),
                "HostNamespacesNotAllowed",
            ),
            (
                json!({"containers": [{"name": "c", "image": "x",
                    "ports": [{"containerPort": 80, "hostPort": 10250}]}]}),
                "HostPortNotAllowed",
            ),
        ] {
            match resolver(&policy).resolve(&pending_spec(spec)).await {
                Err(ResolveError::Spec(e)) => assert_eq!(e.reason, reason),
                other => panic!("{other:?}"),
            }
        }
        let allowed = Policy {
            allow_privileged: true,
            ..Policy::default()
        };
        let spec = json!({"hostPID": true, "containers": [{"name": "c", "image": "x"}]});
        assert!(
            resolver(&allowed)
                .resolve(&pending_spec(spec))
                .await
                .is_ok()
        );
    }

    /// A whole resolve against a fake API server: service variables, the
    /// kubelet's wording for what is missing, subPathExpr and allocatable.
    #[tokio::test]
    async fn resolve_builds_the_kubelets_environment() {
        use crate::testing::{Seen, fake_api, status};
        let (client, _log) = fake_api(|req: &Seen| match req.path.as_str() {
            "/api/v1/namespaces/app/configmaps/cfg" => (
                200,
                json!({"apiVersion": "v1", "kind": "ConfigMap",
                    "metadata": {"name": "cfg", "namespace": "app"}, "data": {"k": "v"}}),
            ),
            "/api/v1/namespaces/app/secrets/sec" => (
                200,
                json!({"apiVersion": "v1", "kind": "Secret",
                    "metadata": {"name": "sec", "namespace": "app"}, "data": {"k": "dg=="}}),
            ),
            _ => status(404, "NotFound"),
        });
        let svc =
            |ns: &str, name: &str, ip: &str, port: i32| -> k8s_openapi::api::core::v1::Service {
                serde_json::from_value(json!({
                    "metadata": {"name": name, "namespace": ns},
                    "spec": {"clusterIP": ip, "ports": [{"port": port}]}
                }))
                .unwrap()
            };
        let services = super::super::services::Services::fixed(vec![
            svc("default", "kubernetes", "10.96.0.1", 443),
            svc("app", "fooservice", "10.96.0.7", 8765),
        ]);
        let policy = Policy::default();
        let resolver = Resolver {
            client: &client,
            policy: &policy,
            host_ip: "192.0.2.1",
            volumes: true,
            services: Some(&services),
            allocatable: Some(Allocatable {
                cpu_millis: 4000,
                memory_bytes: 8 << 30,
            }),
        };
        let with = |env: serde_json::Value, mounts: serde_json::Value, links: bool| {
            pending(
                &pod(json!({
                    "metadata": {"name": "p", "namespace": "app", "uid": "u1",
                        "annotations": {"sub": "mypath"}},
                    "spec": {
                        "enableServiceLinks": links,
                        "containers": [{"name": "c", "image": "x", "command": ["$(FOOSERVICE_SERVICE_HOST)"],
                            "env": env, "volumeMounts": mounts}],
                        "volumes": [{"name": "w", "emptyDir": {}}]
                    }
                })),
                "vk",
            )
            .unwrap()
        };
        let p = with(
            json!([
                {"name": "FOOSERVICE_SERVICE_PORT", "value": "override"},
                {"name": "URL", "value": "https://$(KUBERNETES_SERVICE_HOST):$(KUBERNETES_SERVICE_PORT)"},
                {"name": "ANNOTATION", "valueFrom": {"fieldRef": {"fieldPath": "metadata.annotations['sub']"}}},
                {"name": "CPU", "valueFrom": {"resourceFieldRef": {"resource": "limits.cpu"}}},
                {"name": "MEM", "valueFrom": {"resourceFieldRef": {"resource": "limits.memory", "divisor": "1Mi"}}}
            ]),
            json!([{"name": "w", "mountPath": "/sub", "subPathExpr": "$(ANNOTATION)/$(CPU)"},
                   {"name": "w", "mountPath": "/all"}]),
            true,
        );
        let spec = resolver.resolve(&p).await.unwrap();
        let c = &spec.containers[0];
        let get = |k: &str| c.env.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
        assert_eq!(get("KUBERNETES_SERVICE_HOST"), Some("10.96.0.1"));
        assert_eq!(get("KUBERNETES_SERVICE_PORT"), Some("443"));
        assert_eq!(get("KUBERNETES_PORT_443_TCP"), Some("tcp://10.96.0.1:443"));
        assert_eq!(get("FOOSERVICE_SERVICE_HOST"), Some("10.96.0.7"));
        assert_eq!(get("FOOSERVICE_PORT_8765_TCP_PORT"), Some("8765"));
        // The Pod's own value wins, once, before the service variables.
        assert_eq!(get("FOOSERVICE_SERVICE_PORT"), Some("override"));
        assert_eq!(
            c.env
                .iter()
                .filter(|(n, _)| n == "FOOSERVICE_SERVICE_PORT")
                .count(),
            1
        );
        assert_eq!(c.env[0].0, "FOOSERVICE_SERVICE_PORT");
        assert_eq!(get("URL"), Some("https://10.96.0.1:443"));
        assert_eq!(get("CPU"), Some("4"));
        assert_eq!(get("MEM"), Some("8192"));
        assert_eq!(c.command, vec!["10.96.0.7".to_owned()]);
        assert_eq!(c.mounts[0].sub_path.as_deref(), Some("mypath/4"));
        assert_eq!(c.mounts[1].sub_path, None);

        // enableServiceLinks: false keeps only the master service's variables.
        let p = with(json!([]), json!([]), false);
        let spec = resolver.resolve(&p).await.unwrap();
        let names: Vec<&str> = spec.containers[0]
            .env
            .iter()
            .map(|(n, _)| n.as_str())
            .collect();
        assert!(names.contains(&"KUBERNETES_SERVICE_HOST"), "{names:?}");
        assert!(
            !names.iter().any(|n| n.starts_with("FOOSERVICE")),
            "{names:?}"
        );

        // What the kubelet says when something is missing.
        let config_error = |p: Pending| {
            let resolver = &resolver;
            async move {
                match resolver.resolve(&p).await {
                    Err(ResolveError::Config(m)) => m,
                    other => panic!("{other:?}"),
                }
            }
        };
        let key = |kind: &str, name: &str, key: &str| json!([{"name": "X", "valueFrom": {kind: {"name": name, "key": key}}}]);
        for (env, want) in [
            (
                key("secretKeyRef", "gone", "k"),
                "secret \"gone\" not found",
            ),
            (
                key("configMapKeyRef", "gone", "k"),
                "configmap \"gone\" not found",
            ),
            (
                key("secretKeyRef", "sec", "nokey"),
                "couldn't find key nokey in Secret app/sec",
            ),
            (
                key("configMapKeyRef", "cfg", "nokey"),
                "couldn't find key nokey in ConfigMap app/cfg",
            ),
            (json!([{"name": "A", "value": ".."}]), "$(A)"),
        ] {
            let mounts = if want == "$(A)" {
                json!([{"name": "w", "mountPath": "/s", "subPathExpr": "$(A)"}])
            } else {
                json!([])
            };
            let got = config_error(with(env, mounts, true)).await;
            let want = if want == "$(A)" {
                "unable to provision SubPath `..`: must not contain '..'"
            } else {
                want
            };
            assert_eq!(got, want);
        }
        // An optional reference to what is missing is skipped.
        let optional = json!([{"name": "X", "valueFrom": {"secretKeyRef": {"name": "gone", "key": "k", "optional": true}}},
            {"name": "Y", "valueFrom": {"secretKeyRef": {"name": "sec", "key": "k"}}}]);
        let spec = resolver
            .resolve(&with(optional, json!([]), true))
            .await
            .unwrap();
        assert!(
            spec.containers[0]
                .env
                .iter()
                .any(|(n, v)| n == "Y" && v == "v")
        );
        assert!(!spec.containers[0].env.iter().any(|(n, _)| n == "X"));
    }
}
