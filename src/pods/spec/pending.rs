//! The first step, when the record is built: what can be checked from the
//! Pod alone, and the little kept to finish later.

use std::collections::BTreeMap;
use std::time::Duration;

use super::*;
use k8s_openapi::api::core::v1::{
    Container, EnvFromSource, EnvVar, Pod, PodSpec, Volume as KubeVolume,
};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use vkd_provider::{
    ContainerSpec, Handler, InstanceSpec, Limits, Mount, PodRef, Probe, Resources, RestartPolicy,
    quantity,
};

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

pub(super) const SUPPORTED_VOLUMES: &[&str] = &[
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
pub(super) fn fs_group(
    spec: &k8s_openapi::api::core::v1::PodSpec,
) -> Result<Option<u32>, SpecError> {
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
pub(super) fn sub_path_exprs(c: &Container) -> Vec<(usize, String)> {
    c.volume_mounts
        .iter()
        .flatten()
        .enumerate()
        .filter_map(|(i, m)| Some((i, m.sub_path_expr.clone().filter(|e| !e.is_empty())?)))
        .collect()
}

/// Whether any `resourceFieldRef` (env or downward API volume) asks for a
/// limit, which reads as the node's allocatable when the container sets none.
pub(super) fn reads_allocatable(spec: &PodSpec) -> bool {
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
pub(super) fn volume_kind(v: &KubeVolume) -> String {
    match serde_json::to_value(v) {
        Ok(serde_json::Value::Object(m)) => m
            .keys()
            .find(|k| *k != "name")
            .cloned()
            .unwrap_or_else(|| "unknown".into()),
        _ => "unknown".into(),
    }
}

pub(super) fn fields(pod: &Pod) -> BTreeMap<String, String> {
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

pub(super) fn resource_fields(c: &Container) -> BTreeMap<String, String> {
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
pub(super) fn pod_ip_env(c: &Container) -> Vec<String> {
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
pub(super) fn host_ports(
    containers: &[&Container],
) -> Result<Vec<vkd_provider::HostPort>, SpecError> {
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

pub(super) fn container(c: &Container, volumes: &[&str]) -> Result<ContainerSpec, SpecError> {
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
pub(super) fn security_context(
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

pub(super) fn port_of(
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

pub(super) fn handler(
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

pub(super) fn probe(
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
pub(super) fn resources(spec: &PodSpec) -> Result<Resources, SpecError> {
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
