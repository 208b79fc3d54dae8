//! The node policy: who may run what on this node, and what a Pod asks of
//! the host beyond its sandbox.

use std::collections::BTreeMap;

use super::*;
use k8s_openapi::api::core::v1::{Container, PodSpec};

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
pub(super) fn capability_name(name: &str) -> String {
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
pub(super) fn host_access(spec: &PodSpec, all: &[&Container]) -> HostAccess {
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
