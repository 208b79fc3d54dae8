//! The first step, when the record is built: what can be checked from the
//! Pod alone, and the little kept to finish later.

use std::collections::BTreeMap;
use std::time::Duration;

use super::*;
use k8s_openapi::api::core::v1::{
    Container, EnvFromSource, EnvVar, Pod, PodSpec, Volume as KubeVolume,
};
use vkd_provider::{InstanceSpec, PodRef, Resources, RestartPolicy, quantity};

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
    /// The ResourceClaims it uses, as the kubelet finds them.
    pub claims: Vec<crate::dra::devices::ClaimRef>,
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
        claims: crate::dra::devices::claim_refs(pod),
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
