//! Ephemeral containers (`kubectl debug`): the provider's side.
//!
//! The provider checks and resolves the container as it does the Pod's own
//! (image map, argv, environment, working directory), writes its environment
//! file and a request, `ephemeral/<name>.json` (root's, 0600, in a 0700
//! directory), and the Pod's shim does the rest (see `shim::ephemeral`): it
//! starts the container once, as it starts the others (launcher, run-as user,
//! rlimits, the Pod's cgroup), writes its log, records its state in
//! `status.json` and stops it when the Pod ends. The shim is what outlives
//! vkd, so a request written before a restart of vkd is still carried out and
//! the container's exit is still recorded.

use std::path::Path;

use serde::{Deserialize, Serialize};
use vkd_provider::{
    ContainerSpec, ContainerState, ContainerStatus, Fence, InstanceEvent, InstancePhase,
    InstanceSpec, ProviderError, Result,
};

use crate::ProcessProvider;
use crate::sandbox::{self, Launch, Sandbox, StatusFile};

/// What the provider hands the shim for one ephemeral container.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(crate) struct EphemeralRequest {
    pub spec: ContainerSpec,
    pub launch: Launch,
}

/// The directory of the requests.
pub(crate) fn dir(sb: &Sandbox) -> std::path::PathBuf {
    sb.dir.join("ephemeral")
}

pub(crate) fn request_path(sb: &Sandbox, name: &str) -> std::path::PathBuf {
    dir(sb).join(format!("{name}.json"))
}

/// The names of the requests in the sandbox, sorted.
pub(crate) fn requested(sb: &Sandbox) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir(sb))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let stem = name.strip_suffix(".json")?;
            valid_name(stem).then(|| stem.to_owned())
        })
        .collect();
    names.sort();
    names
}

pub(crate) fn read_request(sb: &Sandbox, name: &str) -> std::io::Result<Option<EphemeralRequest>> {
    sandbox::read_json(&request_path(sb, name))
}

/// A container name as the API allows it (a DNS label): it becomes a file
/// name and a cgroup here, so nothing else is taken.
pub(crate) fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 63
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !name.starts_with('-')
        && !name.ends_with('-')
}

/// The ephemeral containers of an instance, as `Instance::ephemeral_containers`:
/// those the shim took, then requests it has not taken yet.
pub(crate) fn statuses(sb: &Sandbox, st: Option<&StatusFile>) -> Vec<ContainerStatus> {
    let taken: Vec<ContainerStatus> = st
        .and_then(|s| s.ephemeral.as_ref())
        .map(|list| list.iter().map(|c| c.status.clone()).collect())
        .unwrap_or_default();
    let over = st.is_some_and(|s| s.done);
    let mut out = taken;
    for name in requested(sb) {
        if out.iter().any(|c| c.name == name) {
            continue;
        }
        let state = if over {
            ContainerState::Waiting {
                reason: "PodNotRunning".into(),
                message: Some("the Pod ended before its ephemeral container could start".into()),
            }
        } else {
            ContainerState::Waiting {
                reason: "ContainerCreating".into(),
                message: None,
            }
        };
        out.push(ContainerStatus {
            name,
            state,
            last_termination: None,
            ready: false,
            restart_count: 0,
            container_id: None,
            started: None,
        });
    }
    out
}

/// The launch of ephemeral container `name`, for exec.
pub(crate) fn launch(sb: &Sandbox, name: &str) -> Option<Launch> {
    if !valid_name(name) {
        return None;
    }
    read_request(sb, name).ok().flatten().map(|r| r.launch)
}

fn not_running(message: impl Into<String>) -> ProviderError {
    ProviderError::invalid("PodNotRunning", message)
}

impl ProcessProvider {
    /// Hands ephemeral container `c` to the shim of Pod `uid`, once.
    pub(crate) fn start_ephemeral_blocking(
        &self,
        fence: &Fence,
        uid: &str,
        c: &ContainerSpec,
    ) -> Result<()> {
        let _fenced = self.check_fence(fence)?;
        let not_found = || ProviderError::NotFound {
            uid: uid.to_owned(),
        };
        let (sb, rec, st) = self.read(uid)?.ok_or_else(not_found)?;
        if rec.node != fence.node {
            return Err(not_found());
        }
        let name = c.name.as_str();
        if !valid_name(name) {
            return Err(ProviderError::invalid(
                "InvalidSpec",
                format!("ephemeral container name {name:?} is not a DNS label"),
            ));
        }
        if request_path(&sb, name).exists() {
            return Ok(());
        }
        let shim_spec = sb
            .read_spec()
            .map_err(crate::io_err(&sb.spec()))?
            .ok_or_else(not_found)?;
        let pod = &shim_spec.spec;
        let others: Vec<&ContainerSpec> =
            pod.init_containers.iter().chain(&pod.containers).collect();
        if others.iter().any(|o| o.name == name) {
            return Err(ProviderError::invalid(
                "InvalidSpec",
                format!("the Pod already has a container named {name}"),
            ));
        }
        let Some(st) = st else {
            return Err(ProviderError::transient(
                "the Pod's supervisor (shim) has not started yet",
            ));
        };
        if st.ephemeral.is_none() {
            return Err(ProviderError::invalid(
                "EphemeralContainersUnsupported",
                "this Pod's supervisor (shim) was started by a vkd without ephemeral containers; \
                 Pods created after the upgrade can run them",
            ));
        }
        if st.done || matches!(st.phase, InstancePhase::Succeeded | InstancePhase::Failed) {
            return Err(not_running(
                "the Pod's containers have ended; an ephemeral container starts only in a running Pod",
            ));
        }
        if sb.stop_requested().is_some() || !sb.shim_process().is_some_and(|p| p.alive()) {
            return Err(not_running(
                "the Pod is stopping; an ephemeral container starts only in a running Pod",
            ));
        }
        // The Pod's containers share one root: an ephemeral container sees the
        // mounts they made, and makes none of its own.
        for m in &c.mounts {
            let mounted = others.iter().flat_map(|o| &o.mounts).any(|o| {
                o.volume == m.volume
                    && o.path.trim_end_matches('/') == m.path.trim_end_matches('/')
                    && o.sub_path == m.sub_path
            });
            if !mounted {
                return Err(ProviderError::invalid(
                    "InvalidSpec",
                    format!(
                        "ephemeral container {name}: volumeMount {} of volume {} is not mounted \
                         there by a container of the Pod; the process provider gives all \
                         containers of a Pod one filesystem view, so an ephemeral container \
                         can use only the mounts the Pod's containers have",
                        m.path, m.volume
                    ),
                ));
            }
        }
        let alone = InstanceSpec {
            containers: vec![c.clone()],
            init_containers: Vec::new(),
            ..pod.clone()
        };
        let isolated = self.inner.isolated;
        let launch = self
            .launches(&alone, &sb.root(), isolated)?
            .pop()
            .ok_or_else(|| ProviderError::transient("no launch for the ephemeral container"))?;
        if isolated {
            // Namespaces of its own, as the Pod's containers have, in the
            // Pod's network; its target's PID namespace is joined by the shim.
            if let Some(target) = &c.target_container
                && !others.iter().any(|o| *o.name == **target)
            {
                return Err(ProviderError::invalid(
                    "InvalidSpec",
                    format!("ephemeral container {name}: no container {target:?} to target"),
                ));
            }
            let plan = sb.ephemeral_mount_plan(name);
            let own_network = rec.ip.is_some();
            self.write_mount_plan(&sb, pod, c, &launch, own_network, &plan)
                .map_err(crate::io_err(&plan))?;
        }
        // Fresh: a leftover of an earlier attempt may hold an older environment.
        let env_file = sb.env_file(name);
        match std::fs::remove_file(&env_file) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(crate::io_err(&env_file)(e)),
        }
        sb.ensure_env_file(&launch)
            .map_err(crate::io_err(&env_file))?;
        let d = dir(&sb);
        make_private_dir(&d).map_err(crate::io_err(&d))?;
        let path = request_path(&sb, name);
        let request = EphemeralRequest {
            spec: c.clone(),
            launch,
        };
        sandbox::write_json(&path, &request, 0o600).map_err(crate::io_err(&path))?;
        let _ = self.inner.events.send(InstanceEvent::Changed {
            uid: uid.to_owned(),
        });
        Ok(())
    }
}

/// A directory only root may read (requests hold the container's environment).
fn make_private_dir(d: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    match std::fs::create_dir(d) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e),
    }
    std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o700))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // a failed unwrap is a failed test
    use super::*;

    #[test]
    fn only_dns_labels_are_names() {
        for ok in ["debugger", "debugger-2", "a", "x1"] {
            assert!(valid_name(ok), "{ok}");
        }
        for bad in ["", "..", "a/b", "A", "-a", "a-", "a.b", &"a".repeat(64)] {
            assert!(!valid_name(bad), "{bad}");
        }
    }

    #[test]
    fn requests_not_yet_taken_read_as_creating_or_never_started() {
        let dir =
            std::env::temp_dir().join(format!("vkd-ephemeral-{}", uuid::Uuid::new_v4().simple()));
        let sb = Sandbox::new(dir.clone());
        make_private_dir(&sb.dir).unwrap();
        make_private_dir(&super::dir(&sb)).unwrap();
        let req = EphemeralRequest {
            spec: ContainerSpec {
                name: "dbg".into(),
                ..Default::default()
            },
            launch: Launch::default(),
        };
        sandbox::write_json(&request_path(&sb, "dbg"), &req, 0o600).unwrap();
        // A temporary file of a write in progress is no request.
        std::fs::write(super::dir(&sb).join("other.tmp42"), b"{").unwrap();
        let mut st = StatusFile {
            phase: InstancePhase::Running,
            init: Vec::new(),
            containers: Vec::new(),
            started_at: None,
            message: None,
            done: false,
            ephemeral: Some(Vec::new()),
            pause: None,
            events: Vec::new(),
        };
        let s = statuses(&sb, Some(&st));
        assert_eq!(s.len(), 1);
        assert!(
            matches!(&s[0].state, ContainerState::Waiting { reason, .. } if reason == "ContainerCreating")
        );
        st.done = true;
        let s = statuses(&sb, Some(&st));
        assert!(
            matches!(&s[0].state, ContainerState::Waiting { reason, .. } if reason == "PodNotRunning")
        );
        // Taken by the shim: its own status counts, once.
        st.ephemeral = Some(vec![crate::shim::run_of(
            "dbg",
            ContainerState::Running {
                started_at: std::time::SystemTime::now(),
            },
        )]);
        let s = statuses(&sb, Some(&st));
        assert_eq!(s.len(), 1);
        assert!(matches!(s[0].state, ContainerState::Running { .. }));
        assert_eq!(launch(&sb, "dbg").unwrap().name, "");
        assert!(launch(&sb, "../dbg").is_none());
        let _ = std::fs::remove_dir_all(dir);
    }
}
