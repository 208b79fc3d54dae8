//! Opening the provider: the checks that make its state safe to run as root
//! (who owns every directory above it, who can reach it), and which of its
//! modes (namespaces, cgroups) this host allows.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use tokio::sync::broadcast;

use crate::{
    Inner, ProcessConfig, ProcessProvider, cgroup, claim, config, disk, hostname, isolation,
    network, watch,
};

#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    #[error("state directory {path}: {source}")]
    State {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("the shim executable {0} does not exist")]
    Shim(PathBuf),
    #[error(
        "vkd runs as uid {uid}, not root, so every Pod would run as vkd itself: it could read \
         vkd's credentials (its ServiceAccount token reads Secrets), its state and other Pods' \
         Secret values, and signal vkd. Run vkd as root on the host (Pods then run as \
         runAsUser, default 65534), or use a provider that runs no host processes (--provider sim)"
    )]
    RunsAsDaemon { uid: u32 },
    #[error("runAsUser and runAsGroup must not be 0: Pods would run as root, whom vkd runs as")]
    RootPods,
    #[error("process provider config: cgroupParent: {0}")]
    Cgroup(#[from] cgroup::CgroupError),
    #[error(
        "process provider config: isolation is namespaces, but this host cannot make mount and \
         PID namespaces for Pods (vkd must run as root, with CAP_SYS_ADMIN); use auto or host"
    )]
    NoNamespaces,
    #[error(
        "process provider config: network gives each Pod a network namespace, which needs \
         isolation: namespaces (vkd as root, with CAP_SYS_ADMIN); this node runs Pods as host \
         processes"
    )]
    NetworkNeedsNamespaces,
    #[error("process provider config: {0}")]
    Network(#[from] network::NetworkError),
    #[error("{0}")]
    HostPorts(#[from] crate::hostport::HostPortError),
    #[error(
        "{path} (owner uid {owner}, mode {mode:o}) could be replaced by a Pod's user: every \
         directory above the state must be root's and not writable by others (or sticky, as \
         /tmp is), since vkd runs as root what the state describes"
    )]
    Insecure {
        path: PathBuf,
        owner: u32,
        mode: u32,
    },
    #[error(
        "{path} is not reachable by uid {uid} ({blocker} has mode {mode:o}), so Pods could not \
         use their own sandbox: put --state-dir under a world-traversable directory \
         (for example /var/lib/vkd) or set runAsUser in the process provider config"
    )]
    Unreachable {
        path: PathBuf,
        uid: u32,
        blocker: PathBuf,
        mode: u32,
    },
}

impl OpenError {
    /// Whether the provider config is what is wrong (a field says what it
    /// cannot have), rather than the host or the state directory.
    pub fn is_config(&self) -> bool {
        matches!(
            self,
            Self::Cgroup(_)
                | Self::RootPods
                | Self::NoNamespaces
                | Self::NetworkNeedsNamespaces
                | Self::Network(network::NetworkError::Config { .. })
        )
    }
}

impl ProcessProvider {
    /// Opens (or creates) the state under `dir`. `shim_exe` is the program that
    /// answers `process-shim` and `process-launch` (the vkd binary itself).
    pub fn open(config: ProcessConfig, dir: &Path, shim_exe: PathBuf) -> Result<Self, OpenError> {
        let provider = Self::open_unwatched(config, dir, shim_exe)?;
        provider.recover();
        let weak = Arc::downgrade(&provider.inner);
        std::thread::Builder::new()
            .name("process-watch".into())
            .spawn(move || watch::run(weak))
            .map_err(|source| OpenError::State {
                path: provider.inner.dir.clone(),
                source,
            })?;
        Ok(provider)
    }

    /// The provider without its background watch (which finishes deletes and
    /// ends what dead shims left): for tests of the calls alone.
    pub(super) fn open_unwatched(
        config: ProcessConfig,
        dir: &Path,
        shim_exe: PathBuf,
    ) -> Result<Self, OpenError> {
        let Some((uid, gid)) = config.run_as() else {
            return Err(OpenError::RunsAsDaemon {
                uid: rustix::process::geteuid().as_raw(),
            });
        };
        if uid == 0 || gid == 0 {
            return Err(OpenError::RootPods);
        }
        if !shim_exe.is_file() {
            return Err(OpenError::Shim(shim_exe));
        }
        for sub in ["pods", "fences", claim::DIR] {
            let p = dir.join(sub);
            std::fs::create_dir_all(&p).map_err(|source| OpenError::State {
                path: p.clone(),
                source,
            })?;
        }
        let dir = &std::path::absolute(dir).map_err(|source| OpenError::State {
            path: dir.to_owned(),
            source,
        })?;
        secure_state(dir)?;
        let cgroup = config.cgroup_parent()?;
        if let Some((blocker, mode)) = blocker(&dir.join("pods"), uid, gid) {
            return Err(OpenError::Unreachable {
                path: dir.to_owned(),
                uid,
                blocker,
                mode,
            });
        }
        let isolated = match config.isolation {
            config::IsolationMode::Host => false,
            config::IsolationMode::Auto => isolation::available(&shim_exe),
            config::IsolationMode::Namespaces if isolation::available(&shim_exe) => true,
            config::IsolationMode::Namespaces => return Err(OpenError::NoNamespaces),
        };
        let user_namespaces = isolated && isolation::user_namespaces_available(&shim_exe);
        if isolated {
            // Where containers' namespaces are held (root's alone).
            let held = dir.join("ns");
            make_private_dir(&held).map_err(|source| OpenError::State {
                path: held.clone(),
                source,
            })?;
        }
        let network = match &config.network {
            Some(_) if !isolated => return Err(OpenError::NetworkNeedsNamespaces),
            Some(n) => Some(network::Network::load(n, dir)?),
            None => None,
        };
        if network.is_some() {
            // Every node on the host that gives out hostPorts sees this
            // one's Pods, and it theirs (crate::hostport).
            crate::hostport::Reservations::new(&config.host_ports.reservations)
                .register_pods(&dir.join("pods"))?;
        }
        let (events, _) = broadcast::channel(1024);
        let provider = Self {
            inner: Arc::new(Inner {
                dir: dir.to_owned(),
                run_as: (uid, gid),
                cgroup,
                config,
                shim_exe,
                host: hostname(),
                events,
                fences: vkd_provider::fence::FenceBook::new(&dir.join("fences")).map_err(
                    |source| OpenError::State {
                        path: dir.join("fences"),
                        source,
                    },
                )?,
                cpu_samples: Mutex::default(),
                disk: disk::Measurements::default(),
                isolated,
                user_namespaces,
                network,
            }),
        };
        provider.upgrade_sandboxes();
        Ok(provider)
    }

    /// How Pods are isolated here: `namespaces` (each container in mount, PID
    /// and UTS namespaces of its own) or `host` (host processes).
    /// Whether Pods with `hostUsers: false` can run here: with namespaces,
    /// where the kernel allows user namespaces.
    pub fn user_namespaces(&self) -> bool {
        self.inner.user_namespaces
    }

    pub fn isolation_mode(&self) -> &'static str {
        if self.inner.isolated {
            "namespaces"
        } else {
            "host"
        }
    }

    /// How limits are enforced here: `cgroup-v2` when the Pod cgroups get the
    /// memory, cpu and pids controllers, else `rlimit` (memory as RLIMIT_DATA,
    /// processes as RLIMIT_NPROC of the run-as user, no CPU limit).
    pub fn limits_mode(&self) -> &'static str {
        if self
            .inner
            .cgroup
            .as_ref()
            .is_some_and(|c| c.enforces_limits())
        {
            "cgroup-v2"
        } else {
            "rlimit"
        }
    }

    /// How a Pod's processes are found to end them with it: `cgroup-v2` (every
    /// process, exec sessions included), else `subreaper` (what the shim's
    /// containers, hooks and probes start, however they detach).
    pub fn tracking_mode(&self) -> &'static str {
        if self.inner.cgroup.is_some() {
            "cgroup-v2"
        } else {
            "subreaper"
        }
    }

    pub fn run_as(&self) -> Option<(u32, u32)> {
        Some(self.inner.run_as)
    }
}

/// Makes the state directories root's alone to write, and checks every directory
/// above them: one a Pod's user could rename or fill would let it plant a sandbox
/// that root then runs.
pub(super) fn secure_state(dir: &Path) -> Result<(), OpenError> {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let me = rustix::process::geteuid().as_raw();
    let state_err = |path: &Path| {
        let path = path.to_owned();
        move |source| OpenError::State { path, source }
    };
    let ours = [
        dir.parent(),
        Some(dir),
        Some(&dir.join("pods")),
        Some(&dir.join("fences")),
        Some(&dir.join(claim::DIR)),
    ];
    for p in ours.into_iter().flatten() {
        let m = std::fs::metadata(p).map_err(state_err(p))?;
        if m.uid() == me && m.mode() & 0o022 != 0 {
            std::fs::set_permissions(p, std::fs::Permissions::from_mode(m.mode() & 0o7755))
                .map_err(state_err(p))?;
        }
    }
    let mut p = PathBuf::new();
    for c in dir.join("pods").components() {
        p.push(c);
        let m = std::fs::metadata(&p).map_err(state_err(&p))?;
        let mode = m.mode() & 0o7777;
        let sticky = mode & 0o1000 != 0;
        let others_write = mode & 0o002 != 0 || (mode & 0o020 != 0 && m.gid() != 0);
        if (m.uid() != 0 && m.uid() != me) || (others_write && !sticky) {
            return Err(OpenError::Insecure {
                path: p,
                owner: m.uid(),
                mode,
            });
        }
    }
    Ok(())
}

/// The first directory on the way to `path` that `uid`/`gid` may not traverse.
pub(super) fn blocker(path: &Path, uid: u32, gid: u32) -> Option<(PathBuf, u32)> {
    use std::os::unix::fs::MetadataExt;
    let mut p = PathBuf::new();
    for c in path.components() {
        p.push(c);
        let m = std::fs::metadata(&p).ok()?;
        let mode = m.mode();
        let ok = if m.uid() == uid {
            mode & 0o100 != 0
        } else if m.gid() == gid {
            mode & 0o010 != 0
        } else {
            mode & 0o001 != 0
        };
        if !ok {
            return Some((p, mode & 0o7777));
        }
    }
    None
}

/// Makes `dir` (and its parents), mode 0700.
fn make_private_dir(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(dir)?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
}
