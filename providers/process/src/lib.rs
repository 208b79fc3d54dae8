//! The process provider: runs each Pod's containers as host processes.
//!
//! There is no image pull and no filesystem isolation. The config maps image
//! names to something runnable here ([`config::ImageMap`]); a Pod whose image or
//! command has no such mapping is rejected at admission with the reason.
//!
//! Each Pod gets a sandbox directory ([`sandbox`]) and a supervisor process, the
//! shim ([`shim`]), started detached so it outlives vkd. The provider only
//! writes the sandbox, starts or signals the shim, and reads what the shim
//! records; after a restart it finds every running Pod again in the state
//! directory and checks each shim's identity (PID plus start time) before
//! trusting or signalling it. `create` is idempotent on the Pod UID: a sandbox
//! that exists is never started twice.

mod attach;
pub mod cgroup;
pub mod config;
mod disk;
mod ephemeral;
pub mod isolation;
pub mod launch;
mod listing;
pub mod logs;
pub mod network;
mod prepare;
pub mod procfs;
pub mod sandbox;
pub mod shim;
mod stream;
mod volumes;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use futures::StreamExt;
use futures::stream::BoxStream;
use rustix::process::Signal;
use tokio::io::AsyncWriteExt;
use tokio::sync::broadcast;
use vkd_provider::{
    Admission, Capabilities, Capacity, CapacityKind, ContainerState, ContainerStats, Duplex, Fence,
    Health, HostSlice, Instance, InstanceEvent, InstancePhase, InstanceSpec, LogRequest, Logs,
    Placement, PodStats, Provider, ProviderError, Result, StreamIo, Support, Volume,
};

pub use config::ProcessConfig;
pub use listing::{Listing, read_listings};
use sandbox::{InstanceRecord, Launch, Sandbox, ShimSpec, StatusFile};
use stream::{copy_out, exec_tty};

/// Runs the shim or launcher part when `args` (the whole argv) asks for one;
/// `None` when it is a normal invocation.
pub fn dispatch(args: &[String]) -> Option<i32> {
    match args.get(1).map(String::as_str) {
        Some("process-shim") => Some(shim::main(Path::new(args.get(2)?))),
        Some("process-launch") => Some(launch::main(&args[2..])),
        _ => None,
    }
}

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

/// Makes the state directories root's alone to write, and checks every directory
/// above them: one a Pod's user could rename or fill would let it plant a sandbox
/// that root then runs.
fn secure_state(dir: &Path) -> Result<(), OpenError> {
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
fn blocker(path: &Path, uid: u32, gid: u32) -> Option<(PathBuf, u32)> {
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

#[derive(Debug)]
struct Inner {
    dir: PathBuf,
    config: ProcessConfig,
    shim_exe: PathBuf,
    host: String,
    run_as: (u32, u32),
    cgroup: Option<cgroup::CgroupParent>,
    events: broadcast::Sender<InstanceEvent>,
    fences: vkd_provider::fence::FenceBook,
    /// The last CPU sample per container, for the usage rate.
    cpu_samples: Mutex<HashMap<(String, String), (SystemTime, u64)>>,
    /// Recent disk measurements of the sandboxes.
    disk: disk::Measurements,
    /// Containers get namespaces of their own (`isolation`).
    isolated: bool,
    /// Pods get network namespaces of their own (`network`).
    network: Option<network::Network>,
}

#[derive(Debug)]
struct RunningContainer {
    launch: Launch,
    cgroup: Option<PathBuf>,
    memory: Option<u64>,
    pids_limit: Option<u64>,
    /// The cgroup hierarchy the shim used, from spec.json.
    controllers: Option<cgroup::CgroupParent>,
    env_file: PathBuf,
    /// With namespaces: the container's launcher, whose namespaces exec enters.
    process: Option<i32>,
}

#[derive(Clone, Debug)]
pub struct ProcessProvider {
    inner: Arc<Inner>,
}

/// `spec` with the Pod's own IP in the variables that name it
/// ([`vkd_provider::ContainerSpec::pod_ip_env`]).
fn with_pod_ip<'a>(spec: &'a InstanceSpec, ip: Option<&str>) -> std::borrow::Cow<'a, InstanceSpec> {
    let Some(ip) = ip else {
        return std::borrow::Cow::Borrowed(spec);
    };
    let mut spec = spec.clone();
    for c in spec.init_containers.iter_mut().chain(&mut spec.containers) {
        for (k, v) in &mut c.env {
            if c.pod_ip_env.contains(k) {
                ip.clone_into(v);
            }
        }
    }
    std::borrow::Cow::Owned(spec)
}

fn io_err(path: &Path) -> impl Fn(std::io::Error) -> ProviderError + '_ {
    move |e| ProviderError::transient(format!("{}: {e}", path.display()))
}

fn hostname() -> String {
    rustix::system::uname()
        .nodename()
        .to_string_lossy()
        .into_owned()
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
            .spawn(move || watch(weak))
            .map_err(|source| OpenError::State {
                path: provider.inner.dir.clone(),
                source,
            })?;
        Ok(provider)
    }

    /// The provider without its background watch (which finishes deletes and
    /// ends what dead shims left): for tests of the calls alone.
    fn open_unwatched(
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
        for sub in ["pods", "fences"] {
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
        let network = match &config.network {
            Some(_) if !isolated => return Err(OpenError::NetworkNeedsNamespaces),
            Some(n) => Some(network::Network::load(n, dir)?),
            None => None,
        };
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
                network,
            }),
        };
        Ok(provider)
    }

    /// How Pods are isolated here: `namespaces` (each container in mount, PID
    /// and UTS namespaces of its own) or `host` (host processes).
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

    fn pods_dir(&self) -> PathBuf {
        self.inner.dir.join("pods")
    }

    fn sandbox(&self, uid: &str) -> Sandbox {
        Sandbox::new(self.pods_dir().join(uid))
    }

    /// Leftovers of a create that died half way: sandboxes still being built are
    /// removed; a sandbox whose shim was never started gets it now.
    fn recover(&self) {
        let Ok(entries) = std::fs::read_dir(self.pods_dir()) else {
            return;
        };
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let sb = Sandbox::new(e.path());
            // A removal or a create that died half way.
            if name.starts_with('.') || !sb.instance().exists() {
                if let Err(e) = self.discard(&sb.dir) {
                    eprintln!("process provider: {name}: {e}");
                }
                continue;
            }
            if sb.shim_process().is_none()
                && !sb.status().exists()
                && let Err(e) = self.spawn_shim(&sb)
            {
                eprintln!("process provider: starting the shim of {name}: {e}");
            }
        }
    }

    /// Removes a sandbox nothing runs in (a create that failed or died half
    /// way), giving back its network first.
    fn discard(&self, dir: &Path) -> Result<()> {
        network::release(dir).map_err(|e| {
            ProviderError::transient(format!("releasing the network of {}: {e}", dir.display()))
        })?;
        isolation::unmount_under(dir).map_err(|e| {
            ProviderError::transient(format!("unmounting under {}: {e}", dir.display()))
        })?;
        match std::fs::remove_dir_all(dir) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(io_err(dir)(e)),
        }
    }

    /// With `network`, and unless the Pod uses the host's: makes the Pod's
    /// network namespace and runs CNI ADD, recorded first so that DEL can
    /// follow whatever happens next; returns the Pod's IP.
    fn attach_network(&self, sb: &Sandbox, spec: &InstanceSpec) -> Result<Option<String>> {
        let Some(net) = self.inner.network.as_ref().filter(|_| !spec.host_network) else {
            return Ok(None);
        };
        let mut a = net.attachment(&spec.pod, &spec.host_ports);
        let path = network::record_path(&sb.dir);
        network::record(&sb.dir, &a).map_err(io_err(&path))?;
        let ip = a.add().map_err(|e| {
            ProviderError::transient(format!("setting up the network of {}: {e}", spec.pod))
        })?;
        a.ip = Some(ip.clone());
        network::record(&sb.dir, &a).map_err(io_err(&path))?;
        Ok(Some(ip))
    }

    /// Refuses a stale epoch, also one another process recorded; the guard holds
    /// the fence lock until the caller's mutation is done.
    fn check_fence(&self, fence: &Fence) -> Result<vkd_provider::fence::FenceGuard> {
        self.inner.fences.check(fence)
    }

    fn spawn_shim(&self, sb: &Sandbox) -> std::io::Result<()> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(sb.dir.join("shim.log"))?;
        let err = log.try_clone()?;
        let mut cmd = std::process::Command::new(&self.inner.shim_exe);
        {
            use std::os::unix::process::CommandExt;
            cmd.arg("process-shim")
                .arg(&sb.dir)
                .stdin(std::process::Stdio::null())
                .stdout(log)
                .stderr(err)
                .process_group(0);
        }
        let pid = spawn_reaped(cmd)?;
        if let Some(id) = i32::try_from(pid).ok().and_then(procfs::ProcessId::of) {
            // Written here as well as by the shim, so nothing sees a sandbox without one.
            if sb.shim_process().is_none() {
                sandbox::write_atomic(&sb.shim_pid(), id.render().as_bytes(), 0o644)?;
            }
        }
        Ok(())
    }

    fn instance_of(&self, sb: &Sandbox, rec: InstanceRecord, st: Option<StatusFile>) -> Instance {
        let ephemeral_containers = ephemeral::statuses(sb, st.as_ref());
        // The shim writes the kubelet's waiting reasons itself: PodInitializing
        // for a container while the init containers run.
        let (phase, containers, init_containers, started_at, message) = match st {
            Some(s) => (
                s.phase,
                s.containers.into_iter().map(|c| c.status).collect(),
                s.init.into_iter().map(|c| c.status).collect(),
                s.started_at,
                s.message,
            ),
            None => (InstancePhase::Pending, Vec::new(), Vec::new(), None, None),
        };
        let _ = sb;
        Instance {
            id: rec.id,
            owner: rec.owner,
            node: rec.node,
            epoch: rec.epoch,
            phase,
            containers,
            ip: rec.ip,
            host: Some(rec.host),
            created_at: rec.created_at,
            started_at,
            message,
            init_containers,
            ephemeral_containers,
            host_ip: None,
        }
    }

    /// Kills what a dead shim left behind (checked by identity) and removes the sandbox.
    fn remove(&self, sb: &Sandbox) -> Result<()> {
        self.kill_leftovers(sb);
        // Whatever the Pod started, however it detached, ends with it: in the
        // cgroup the shim made (recorded in spec.json), else where the config says.
        let pod_uid = sb.dir.file_name().unwrap_or_default().to_string_lossy();
        let parent = match sb.read_spec() {
            Ok(Some(spec)) => spec.cgroup.map(|c| c.dir),
            _ => self.inner.cgroup.as_ref().map(|c| c.dir.clone()),
        };
        if let Some(parent) = parent
            && !cgroup::remove(&cgroup::pod_dir(&parent, &pod_uid), Duration::from_secs(5))
        {
            return Err(ProviderError::transient(format!(
                "the cgroup of Pod {pod_uid} still holds processes after SIGKILL"
            )));
        }
        // The IP goes back to the pool before the record of it goes.
        network::release(&sb.dir).map_err(|e| {
            ProviderError::transient(format!("releasing the network of Pod {pod_uid}: {e}"))
        })?;
        // tmpfs volumes, which a removal would otherwise empty and then fail on.
        isolation::unmount_under(&sb.dir).map_err(|e| {
            ProviderError::transient(format!("unmounting the volumes of Pod {pod_uid}: {e}"))
        })?;
        // Rename first, so a half-removed sandbox is never taken for a live one.
        let uid = sb
            .dir
            .file_name()
            .unwrap_or_default()
            .to_string_lossy()
            .into_owned();
        let grave = self
            .pods_dir()
            .join(format!(".gone-{uid}-{}", uuid::Uuid::new_v4().simple()));
        match std::fs::rename(&sb.dir, &grave) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(io_err(&sb.dir)(e)),
        }
        std::fs::remove_dir_all(&grave).map_err(io_err(&grave))?;
        let _ = self.inner.events.send(InstanceEvent::Changed { uid });
        Ok(())
    }

    /// Kills what a dead shim left: the recorded process groups (checked by
    /// identity) and the Pod's cgroup.
    fn kill_leftovers(&self, sb: &Sandbox) {
        if let Ok(Some(st)) = sb.read_status() {
            for c in st
                .init
                .iter()
                .chain(&st.containers)
                .chain(st.ephemeral.iter().flatten())
            {
                if let Some(p) = c.process {
                    p.signal_group(Signal::KILL);
                }
            }
            if let Some(p) = st.pause {
                p.signal_group(Signal::KILL);
            }
        }
        let pod_uid = sb.dir.file_name().unwrap_or_default().to_string_lossy();
        if let Ok(Some(spec)) = sb.read_spec()
            && let Some(cg) = spec.cgroup
        {
            cgroup::kill(&cgroup::pod_dir(&cg.dir, &pod_uid));
        }
    }

    fn read(&self, uid: &str) -> Result<Option<(Sandbox, InstanceRecord, Option<StatusFile>)>> {
        if uid.is_empty() || uid.contains('/') || uid.starts_with('.') {
            return Ok(None);
        }
        let sb = self.sandbox(uid);
        let Some(rec) = sb.read_instance().map_err(io_err(&sb.instance()))? else {
            return Ok(None);
        };
        let st = sb.read_status().map_err(io_err(&sb.status()))?;
        Ok(Some((sb, rec, st)))
    }

    /// What `kubectl exec` into `container` runs as: its launch, its cgroup, its
    /// memory limit (as an rlimit where there is no cgroup) and its environment file.
    fn running_process(&self, uid: &str, container: &str) -> Result<RunningContainer> {
        let not_found = || ProviderError::NotFound {
            uid: uid.to_owned(),
        };
        let (sb, _, st) = self.read(uid)?.ok_or_else(not_found)?;
        let spec = sb
            .read_spec()
            .map_err(io_err(&sb.spec()))?
            .ok_or_else(not_found)?;
        let launch = spec
            .containers
            .iter()
            .rev()
            .find(|l| l.name == container)
            .cloned()
            .or_else(|| ephemeral::launch(&sb, container))
            .ok_or_else(|| {
                ProviderError::invalid(
                    "NotFound",
                    format!("no container {container:?} in this Pod"),
                )
            })?;
        let run = st
            .iter()
            .flat_map(|s| {
                s.containers
                    .iter()
                    .chain(&s.init)
                    .chain(s.ephemeral.iter().flatten())
            })
            .find(|c| {
                c.status.name == container
                    && matches!(c.status.state, ContainerState::Running { .. })
            })
            .ok_or_else(|| {
                ProviderError::invalid(
                    "ContainerNotRunning",
                    format!("container {container:?} is not running"),
                )
            })?;
        let env_file = sb
            .ensure_env_file(&launch)
            .map_err(io_err(&sb.env_file(&launch.name)))?;
        let memory = spec
            .spec
            .init_containers
            .iter()
            .chain(&spec.spec.containers)
            .find(|c| c.name == container)
            .and_then(|c| c.limits.memory_bytes);
        Ok(RunningContainer {
            launch,
            cgroup: run.cgroup.clone(),
            memory,
            pids_limit: spec.pids_rlimit,
            controllers: spec.cgroup,
            env_file,
            // Ephemeral containers run without namespaces of their own.
            process: run
                .process
                .filter(|_| spec.isolated && spec.containers.iter().any(|l| l.name == container))
                .map(|p| p.pid),
        })
    }

    fn exec_command(&self, run: &RunningContainer, command: &[String]) -> std::process::Command {
        // The hierarchy the shim made the Pod's cgroup in, as spec.json records it.
        let (data_limit, nproc_limit) = launch::rlimits(
            run.controllers.as_ref().filter(|_| run.cgroup.is_some()),
            run.memory,
            run.pids_limit,
        );
        launch::LaunchArgs {
            cgroup: run.cgroup.as_deref(),
            data_limit,
            nproc_limit,
            user: Some(self.inner.run_as),
            env_file: &run.env_file,
            cwd: &run.launch.cwd,
            isolation: run.process.map(launch::Isolation::Enter),
            argv: command,
        }
        .command(&self.inner.shim_exe)
    }

    fn usage(&self) -> (u64, u64, u32) {
        let mut cpu = 0;
        let mut mem = 0;
        let mut n = 0;
        if let Ok(entries) = std::fs::read_dir(self.pods_dir()) {
            for e in entries.flatten() {
                let sb = Sandbox::new(e.path());
                let Ok(Some(rec)) = sb.read_instance() else {
                    continue;
                };
                let done = sb.read_status().ok().flatten().is_some_and(|s| s.done);
                if !done {
                    cpu += rec.cpu_millis;
                    mem += rec.memory_bytes;
                    n += 1;
                }
            }
        }
        (cpu, mem, n)
    }

    /// The size of the filesystem the Pods' sandboxes are on: the Node's
    /// ephemeral-storage, as the kubelet reports its root directory's.
    fn disk_total(&self) -> u64 {
        rustix::fs::statvfs(self.pods_dir()).map_or(0, |v| v.f_blocks.saturating_mul(v.f_frsize))
    }

    fn totals(&self) -> (u64, u64) {
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get()) as u64;
        (cpus * 1000, procfs::mem_total().unwrap_or(0))
    }
}

impl ProcessProvider {
    fn create_blocking(&self, fence: &Fence, spec: &InstanceSpec) -> Result<Instance> {
        let _fenced = self.check_fence(fence)?;
        let uid = &spec.pod.uid;
        if let Some((sb, rec, st)) = self.read(uid)? {
            return Ok(self.instance_of(&sb, rec, st));
        }
        if uid.is_empty() || uid.contains('/') || uid.starts_with('.') {
            return Err(ProviderError::invalid(
                "InvalidSpec",
                format!("Pod UID {uid:?}"),
            ));
        }
        let sb = self.sandbox(uid);
        // Checked before anything is made: a spec that cannot run leaves nothing.
        self.launches(spec, &sb.root(), self.inner.isolated)?;
        // A directory without instance.json is a create that died half way: start over.
        if sb.dir.exists() {
            self.discard(&sb.dir)?;
        }
        std::fs::create_dir(&sb.dir).map_err(io_err(&sb.dir))?;
        let built = (|| -> Result<InstanceRecord> {
            let pod_ip = self.attach_network(&sb, spec)?;
            let spec: &InstanceSpec = &with_pod_ip(spec, pod_ip.as_deref());
            let launches = self.launches(spec, &sb.root(), self.inner.isolated)?;
            self.materialize(&sb, spec, &launches, pod_ip.as_deref())?;
            for l in &launches {
                sb.ensure_env_file(l)
                    .map_err(io_err(&sb.env_file(&l.name)))?;
            }
            let shim_spec = ShimSpec {
                spec: spec.clone(),
                containers: launches.clone(),
                run_as: Some(self.inner.run_as),
                log_max_bytes: self.inner.config.log_max_bytes,
                cgroup: self.inner.cgroup.clone(),
                pids_limit: self.inner.config.pids_limit(),
                pids_rlimit: self.inner.config.pids_rlimit(),
                isolated: self.inner.isolated,
                pod_ip: pod_ip.clone(),
            };
            sandbox::write_json(&sb.spec(), &shim_spec, 0o600).map_err(io_err(&sb.spec()))?;
            let rec = InstanceRecord {
                id: format!("proc-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]),
                owner: spec.pod.clone(),
                node: spec.node.clone(),
                epoch: fence.epoch,
                host: self.inner.host.clone(),
                created_at: SystemTime::now(),
                cpu_millis: spec.resources.cpu_millis,
                memory_bytes: spec.resources.memory_bytes,
                ip: pod_ip,
            };
            // Written last: its presence is what makes the sandbox an instance.
            sandbox::write_json(&sb.instance(), &rec, 0o644).map_err(io_err(&sb.instance()))?;
            Ok(rec)
        })();
        let rec = match built {
            Ok(r) => r,
            Err(e) => {
                let _ = self.discard(&sb.dir);
                return Err(e);
            }
        };
        if let Err(e) = self.spawn_shim(&sb) {
            // Nothing runs yet: gone, so a retried create starts afresh.
            let _ = self.discard(&sb.dir);
            return Err(ProviderError::transient(format!(
                "starting the shim for {}: {e}",
                spec.pod
            )));
        }
        let _ = self
            .inner
            .events
            .send(InstanceEvent::Changed { uid: uid.clone() });
        Ok(self.instance_of(&sb, rec, None))
    }

    /// Reads the instance, with no side effect: a dead shim's leftovers are
    /// removed only by a fenced delete.
    fn get_blocking(&self, uid: &str) -> Result<Option<Instance>> {
        let Some((sb, rec, st)) = self.read(uid)? else {
            return Ok(None);
        };
        let shim = sb.shim_process();
        let shim_alive = shim.is_some_and(|p| p.alive());
        let done = st.as_ref().is_some_and(|s| s.done);
        let mut inst = self.instance_of(&sb, rec, st);
        if !shim_alive && shim.is_some() && !done {
            // The supervisor is gone but never said it finished: nothing runs the Pod any more.
            inst.phase = InstancePhase::Failed;
            inst.message = Some("the process supervisor (shim) of this Pod exited unexpectedly; see shim.log in its sandbox".into());
        }
        Ok(Some(inst))
    }

    fn delete_blocking(&self, fence: &Fence, uid: &str, grace: Duration) -> Result<()> {
        let _fenced = self.check_fence(fence)?;
        if uid.is_empty() || uid.contains('/') || uid.starts_with('.') {
            return Ok(());
        }
        // Only the directory, the stop file and the shim's identity are needed:
        // a torn record must not keep its Pod from being deleted.
        let sb = self.sandbox(uid);
        if !sb.dir.exists() {
            return Ok(());
        }
        if sb.stop_requested().is_none() {
            sandbox::write_atomic(&sb.stop(), grace.as_secs().to_string().as_bytes(), 0o644)
                .map_err(io_err(&sb.stop()))?;
        }
        match sb.shim_process() {
            Some(p) if p.alive() => {
                p.signal(Signal::TERM);
                Ok(())
            }
            _ => self.remove(&sb),
        }
    }

    /// Every instance of `node`. A sandbox whose records cannot be read is left
    /// out, named on stderr: it affects only its own Pod, whose `get` fails naming
    /// the file, never the listing (and so orphan collection) of the whole node.
    fn list_blocking(&self, node: &str) -> Result<Vec<Instance>> {
        let mut out = Vec::new();
        let dir = self.pods_dir();
        for e in std::fs::read_dir(&dir).map_err(io_err(&dir))?.flatten() {
            let uid = e.file_name().to_string_lossy().into_owned();
            if uid.starts_with('.') {
                continue;
            }
            match self.get_blocking(&uid) {
                Ok(Some(inst)) if inst.node == node => out.push(inst),
                Ok(_) => {}
                Err(e) => eprintln!("process provider: sandbox {uid} left out of the list: {e}"),
            }
        }
        Ok(out)
    }

    /// Per-container usage from /proc (a scan per container): off the runtime.
    fn stats_blocking(&self, uid: &str) -> Result<PodStats> {
        let not_found = || ProviderError::NotFound {
            uid: uid.to_owned(),
        };
        let (sb, rec, st) = self.read(uid)?.ok_or_else(not_found)?;
        let usage = self.inner.disk.get(uid, &sb.dir);
        let now = SystemTime::now();
        let page = procfs::page_size();
        let mut containers = Vec::new();
        for c in st
            .iter()
            .flat_map(|s| s.containers.iter().chain(s.ephemeral.iter().flatten()))
        {
            let Some(p) = c.process.filter(|p| p.alive()) else {
                continue;
            };
            let (mut ticks, mut rss) = (0, 0);
            for pid in procfs::group_members(p.pid) {
                if let Some(s) = procfs::stat(pid) {
                    ticks += s.utime_ticks + s.stime_ticks;
                    rss += s.rss_pages * page;
                }
            }
            let usage = ticks * (1_000_000_000 / procfs::TICKS_PER_SECOND);
            let key = (uid.to_owned(), c.status.name.clone());
            let rate = {
                let mut samples = self
                    .inner
                    .cpu_samples
                    .lock()
                    .map_err(|_| ProviderError::transient("cpu samples poisoned"))?;
                let rate = samples.get(&key).and_then(|(t, u)| {
                    let dt = now.duration_since(*t).ok()?.as_nanos() as u64;
                    (dt > 0).then(|| usage.saturating_sub(*u).saturating_mul(1_000_000_000) / dt)
                });
                samples.insert(key, (now, usage));
                rate.unwrap_or(0)
            };
            containers.push(ContainerStats {
                name: c.status.name.clone(),
                start_time: c.started_at.unwrap_or(rec.created_at),
                cpu_usage_core_nanoseconds: usage,
                cpu_usage_nano_cores: rate,
                memory_working_set_bytes: rss,
                memory_rss_bytes: rss,
                // The containers share the Pod's writable directory: only the
                // Pod's total is known.
                ephemeral_storage_bytes: None,
            });
        }
        Ok(PodStats {
            pod: rec.owner,
            start_time: st.and_then(|s| s.started_at).unwrap_or(rec.created_at),
            time: now,
            containers,
            // Past the walk's bounds: more than any limit can allow.
            ephemeral_storage_bytes: Some(usage.as_ref().map_or(u64::MAX, |u| u.total)),
            volumes: usage
                .map(|u| u.volumes)
                .unwrap_or_default()
                .into_iter()
                .map(|(name, used_bytes)| vkd_provider::VolumeStats { name, used_bytes })
                .collect(),
        })
    }

    /// Runs filesystem and process work off the async runtime's threads.
    async fn blocking<T: Send + 'static>(
        &self,
        work: impl FnOnce(&Self) -> Result<T> + Send + 'static,
    ) -> Result<T> {
        let this = self.clone();
        tokio::task::spawn_blocking(move || work(&this))
            .await
            .map_err(|e| ProviderError::transient(format!("process provider task failed: {e}")))?
    }
}

/// Starts `cmd` and leaves its reaping to the runtime's SIGCHLD handling (a
/// dropped tokio child is reaped in the background), so no thread waits per Pod.
/// Without a runtime (a provider opened outside one) a waiter thread does it.
/// After a restart of vkd, init reaps the shims it started earlier.
fn spawn_reaped(cmd: std::process::Command) -> std::io::Result<u32> {
    if tokio::runtime::Handle::try_current().is_ok() {
        let child = tokio::process::Command::from(cmd)
            .kill_on_drop(false)
            .spawn()?;
        return child
            .id()
            .ok_or_else(|| std::io::Error::other("the shim exited before it was seen"));
    }
    let mut cmd = cmd;
    let mut child = cmd.spawn()?;
    let pid = child.id();
    std::thread::spawn(move || {
        let _ = child.wait();
    });
    Ok(pid)
}

/// How long a deleted instance whose shim has ended stays readable before the
/// watcher removes it (when no delete call removes it first).
const STOPPED_KEPT: Duration = Duration::from_secs(2);

/// Polls the sandboxes and announces changes; stops when the provider is dropped.
fn watch(inner: std::sync::Weak<Inner>) {
    let mut seen: HashMap<String, (Option<SystemTime>, bool)> = HashMap::new();
    // Sandboxes whose dead shim's leftovers were killed already.
    let mut ended: std::collections::HashSet<String> = std::collections::HashSet::new();
    // Stopped sandboxes (deletion asked, shim gone), since when.
    let mut stopped: HashMap<String, std::time::Instant> = HashMap::new();
    loop {
        std::thread::sleep(Duration::from_millis(250));
        let Some(inner) = inner.upgrade() else {
            return;
        };
        let mut now_seen = HashMap::new();
        if let Ok(entries) = std::fs::read_dir(inner.dir.join("pods")) {
            for e in entries.flatten() {
                let uid = e.file_name().to_string_lossy().into_owned();
                if uid.starts_with('.') {
                    continue;
                }
                let sb = Sandbox::new(e.path());
                let mtime = std::fs::metadata(sb.status())
                    .and_then(|m| m.modified())
                    .ok();
                let shim = sb.shim_process();
                let alive = shim.is_some_and(|p| p.alive());
                let provider = ProcessProvider {
                    inner: Arc::clone(&inner),
                };
                if !alive && sb.stop_requested().is_some() {
                    // Finishes a delete (the stop file is written only under a
                    // valid fence), after a moment: until then `get` still shows
                    // how each container ended, for the Pod's final status; the
                    // daemon's next delete call removes it at once.
                    let since = *stopped
                        .entry(uid.clone())
                        .or_insert_with(std::time::Instant::now);
                    if since.elapsed() >= STOPPED_KEPT {
                        if let Err(e) = provider.remove(&sb) {
                            eprintln!("process provider: removing sandbox {uid}: {e}");
                        }
                        continue;
                    }
                }
                // status.json is read only for a dead shim, not every tick for every Pod.
                let dead_unfinished = shim.is_some()
                    && !alive
                    && !ended.contains(&uid)
                    && !sb.read_status().ok().flatten().is_some_and(|s| s.done);
                if dead_unfinished && ended.insert(uid.clone()) {
                    // The supervisor died without ending the Pod (reported Failed):
                    // nothing may keep running for it.
                    provider.kill_leftovers(&sb);
                }
                now_seen.insert(uid, (mtime, alive));
            }
        }
        for (uid, v) in &now_seen {
            if seen.get(uid) != Some(v) {
                let _ = inner
                    .events
                    .send(InstanceEvent::Changed { uid: uid.clone() });
            }
        }
        for uid in seen.keys() {
            if !now_seen.contains_key(uid) {
                let _ = inner
                    .events
                    .send(InstanceEvent::Changed { uid: uid.clone() });
            }
        }
        ended.retain(|uid| now_seen.contains_key(uid));
        stopped.retain(|uid, _| now_seen.contains_key(uid));
        seen = now_seen;
    }
}

#[async_trait]
impl Provider for ProcessProvider {
    fn name(&self) -> &str {
        "process"
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            logs: Support::Supported,
            exec: Support::Supported,
            attach: Support::Supported,
            port_forward: Support::Supported,
            stats: Support::Supported,
            volumes: Support::Supported,
            limits: Support::Supported,
            ephemeral_containers: Support::Supported,
            pod_spec: Support::Unsupported,
            pod_network: if self.inner.network.is_some() {
                Support::Supported
            } else {
                Support::Unsupported
            },
        }
    }

    fn identity(&self) -> Vec<(String, String)> {
        vec![
            (
                "vkd.io/isolation".to_owned(),
                self.isolation_mode().to_owned(),
            ),
            (
                "vkd.io/pod-network".to_owned(),
                self.inner
                    .network
                    .as_ref()
                    .map_or("host".to_owned(), |n| format!("cni:{}", n.name())),
            ),
        ]
    }

    async fn health(&self) -> Health {
        match std::fs::metadata(self.pods_dir()) {
            Ok(m) if m.is_dir() => Health::Healthy,
            _ => Health::Unhealthy {
                reason: "StateDirMissing".into(),
                message: format!("{} is not a directory", self.pods_dir().display()),
            },
        }
    }

    async fn capacity(&self) -> Result<Capacity> {
        let (cpu_total, mem_total) = self.totals();
        let (cpu, mem, n) = self.blocking(|p| Ok(p.usage())).await?;
        Ok(Capacity {
            hosts: vec![HostSlice {
                name: self.inner.host.clone(),
                cpu_millis_total: cpu_total,
                cpu_millis_free: cpu_total.saturating_sub(cpu),
                memory_bytes_total: mem_total,
                memory_bytes_free: mem_total.saturating_sub(mem),
                gpus: Vec::new(),
                rdma_domain: None,
                labels: Default::default(),
                cached_models: Vec::new(),
                ephemeral_storage_bytes: self.disk_total(),
                max_pods: self.inner.config.max_pods,
                pods_running: n,
            }],
            kind: CapacityKind::Live,
            observed_at: SystemTime::now(),
            refresh_interval: Duration::from_secs(10),
        })
    }

    async fn admit(&self, spec: &InstanceSpec) -> Result<Admission> {
        if spec.resources.gpus > 0 {
            return Ok(Admission::Rejected {
                reason: "TopologyUnsatisfiable".into(),
                message: format!(
                    "needs {} nvidia.com/gpu; host {} has none",
                    spec.resources.gpus, self.inner.host
                ),
            });
        }
        if let Err(ProviderError::Invalid { reason, message }) = self.launches(
            spec,
            &self.sandbox(&spec.pod.uid).root(),
            self.inner.isolated,
        ) {
            return Ok(Admission::Rejected { reason, message });
        }
        let (cpu_total, mem_total) = self.totals();
        let r = spec.resources;
        if r.cpu_millis > cpu_total || r.memory_bytes > mem_total {
            return Ok(Admission::Rejected {
                reason: "OutOfResources".into(),
                message: format!(
                    "requests {}m cpu and {} bytes memory; host {} has {}m and {} bytes in all",
                    r.cpu_millis, r.memory_bytes, self.inner.host, cpu_total, mem_total
                ),
            });
        }
        let (cpu, mem, n) = self.blocking(|p| Ok(p.usage())).await?;
        if n >= self.inner.config.max_pods {
            return Ok(Admission::Queued {
                reason: format!("host {} runs its maximum of {n} Pods", self.inner.host),
            });
        }
        if r.cpu_millis > cpu_total.saturating_sub(cpu)
            || r.memory_bytes > mem_total.saturating_sub(mem)
        {
            return Ok(Admission::Queued {
                reason: format!(
                    "waiting for {}m cpu and {} bytes memory on host {} ({}m and {} bytes free)",
                    r.cpu_millis,
                    r.memory_bytes,
                    self.inner.host,
                    cpu_total.saturating_sub(cpu),
                    mem_total.saturating_sub(mem)
                ),
            });
        }
        Ok(Admission::Fits(Placement {
            host: self.inner.host.clone(),
            gpu_ids: Vec::new(),
        }))
    }

    async fn create(&self, fence: &Fence, spec: &InstanceSpec) -> Result<Instance> {
        let (fence, spec) = (fence.clone(), spec.clone());
        self.blocking(move |p| p.create_blocking(&fence, &spec))
            .await
    }

    async fn get(&self, uid: &str) -> Result<Option<Instance>> {
        let uid = uid.to_owned();
        self.blocking(move |p| p.get_blocking(&uid)).await
    }

    async fn delete(&self, fence: &Fence, uid: &str, grace: Duration) -> Result<()> {
        let (fence, uid) = (fence.clone(), uid.to_owned());
        self.blocking(move |p| p.delete_blocking(&fence, &uid, grace))
            .await
    }

    async fn list(&self, node: &str) -> Result<Vec<Instance>> {
        let node = node.to_owned();
        self.blocking(move |p| p.list_blocking(&node)).await
    }

    fn events(&self) -> BoxStream<'static, InstanceEvent> {
        let rx = self.inner.events.subscribe();
        futures::stream::unfold(rx, |mut rx| async move {
            match rx.recv().await {
                Ok(ev) => Some((ev, rx)),
                Err(broadcast::error::RecvError::Lagged(_)) => Some((InstanceEvent::Resync, rx)),
                Err(broadcast::error::RecvError::Closed) => None,
            }
        })
        .boxed()
    }

    async fn logs(&self, uid: &str, container: &str, request: LogRequest) -> Result<Logs> {
        let not_found = || ProviderError::NotFound {
            uid: uid.to_owned(),
        };
        let (sb, _, st) = self.read(uid)?.ok_or_else(not_found)?;
        let known = st.as_ref().is_some_and(|s| {
            s.containers
                .iter()
                .chain(&s.init)
                .chain(s.ephemeral.iter().flatten())
                .any(|c| c.status.name == container)
        });
        if !known {
            return Err(ProviderError::invalid(
                "NotFound",
                format!("no container {container:?} in this Pod"),
            ));
        }
        let dir = sb.logs(container);
        if request.previous {
            let (history, _) = logs::read_file(&logs::previous(&dir), 0).map_err(io_err(&dir))?;
            if history.is_empty() && !logs::previous(&dir).exists() {
                return Err(ProviderError::invalid(
                    "NotFound",
                    format!("previous terminated container {container:?} not found"),
                ));
            }
            return Ok(Logs {
                history,
                follow: None,
            });
        }
        let (mut history, _) = logs::read_file(&logs::rotated(&dir), 0).map_err(io_err(&dir))?;
        let (cur, offset) = logs::read_file(&logs::current(&dir), 0).map_err(io_err(&dir))?;
        history.extend(cur);
        let follow = request.follow.then(|| {
            let state = (
                sb,
                container.to_owned(),
                offset,
                Vec::<vkd_provider::LogLine>::new(),
                false,
            );
            futures::stream::unfold(
                state,
                |(sb, name, mut offset, mut buf, mut ending)| async move {
                    loop {
                        if let Some(l) = buf.pop() {
                            return Some((l, (sb, name, offset, buf, ending)));
                        }
                        if ending {
                            return None;
                        }
                        let dir = sb.logs(&name);
                        let path = logs::current(&dir);
                        let len = std::fs::metadata(&path).map_or(0, |m| m.len());
                        if len < offset {
                            offset = 0; // rotated, or a new run started
                        }
                        if let Ok((lines, next)) = logs::read_file(&path, offset) {
                            offset = next;
                            buf = lines;
                            buf.reverse();
                        }
                        if buf.is_empty() {
                            let running = sb.read_status().ok().flatten().is_some_and(|s| {
                                s.containers
                                    .iter()
                                    .chain(&s.init)
                                    .chain(s.ephemeral.iter().flatten())
                                    .any(|c| {
                                        c.status.name == name
                                            && !matches!(
                                                c.status.state,
                                                ContainerState::Terminated(_)
                                            )
                                    })
                                    && !s.done
                            });
                            if !running {
                                // One last read after the container stopped, then the stream ends.
                                ending = true;
                                if let Ok((lines, next)) = logs::read_file(&path, offset) {
                                    offset = next;
                                    buf = lines;
                                    buf.reverse();
                                }
                                continue;
                            }
                            tokio::time::sleep(Duration::from_millis(200)).await;
                        }
                    }
                },
            )
            .boxed()
        });
        Ok(Logs { history, follow })
    }

    async fn exec(
        &self,
        uid: &str,
        container: &str,
        command: Vec<String>,
        io: StreamIo,
    ) -> Result<i32> {
        if command.is_empty() {
            return Err(ProviderError::invalid(
                "InvalidRequest",
                "exec needs a command",
            ));
        }
        let run = {
            let (uid, container) = (uid.to_owned(), container.to_owned());
            self.blocking(move |p| p.running_process(&uid, &container))
                .await?
        };
        let std_cmd = self.exec_command(&run, &command);
        if io.tty {
            return exec_tty(std_cmd, io).await;
        }
        let mut cmd = tokio::process::Command::from(std_cmd);
        cmd.stdin(if io.stdin.is_some() {
            std::process::Stdio::piped()
        } else {
            std::process::Stdio::null()
        })
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .process_group(0)
        .kill_on_drop(true);
        let mut child = cmd
            .spawn()
            .map_err(|e| ProviderError::transient(format!("starting exec: {e}")))?;
        let StreamIo {
            stdin,
            stdout,
            stderr,
            ..
        } = io;
        let feed = match (stdin, child.stdin.take()) {
            (Some(mut from), Some(mut to)) => Some(tokio::spawn(async move {
                let _ = tokio::io::copy(&mut from, &mut to).await;
                let _ = to.shutdown().await;
            })),
            _ => None,
        };
        let out = copy_out(child.stdout.take(), stdout);
        let err = copy_out(child.stderr.take(), stderr);
        let (_, _, status) = tokio::join!(out, err, child.wait());
        if let Some(f) = feed {
            f.abort();
        }
        let status =
            status.map_err(|e| ProviderError::transient(format!("waiting for exec: {e}")))?;
        Ok(shim::exit_code(status))
    }

    async fn attach(&self, uid: &str, container: &str, io: StreamIo) -> Result<()> {
        self.attach_container(uid, container, io).await
    }

    async fn port_forward(&self, uid: &str, port: u16, mut stream: Box<dyn Duplex>) -> Result<()> {
        let Some((sb, rec, _)) = self.read(uid)? else {
            return Err(ProviderError::NotFound {
                uid: uid.to_owned(),
            });
        };
        let attachment = network::attachment_of(&sb.dir).map_err(io_err(&sb.dir))?;
        if rec.ip.is_some() && attachment.is_none() {
            // Never the host's loopback in place of a Pod's own.
            return Err(ProviderError::invalid(
                "NotRunning",
                format!("Pod {uid} has ended: its network is gone"),
            ));
        }
        let refused =
            |e: std::io::Error| ProviderError::transient(format!("connecting to port {port}: {e}"));
        // In the Pod's own network, its loopback, as a runtime's port-forward.
        let mut upstream = match attachment {
            Some(a) => {
                let std = tokio::task::spawn_blocking(move || {
                    network::connect_in(&a.netns, port, Duration::from_secs(10))
                })
                .await
                .map_err(|e| ProviderError::transient(format!("connecting to port {port}: {e}")))?
                .map_err(refused)?;
                std.set_nonblocking(true).map_err(refused)?;
                tokio::net::TcpStream::from_std(std).map_err(refused)?
            }
            None => tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .map_err(refused)?,
        };
        let _ = tokio::io::copy_bidirectional(&mut stream, &mut upstream).await;
        Ok(())
    }

    async fn update_volumes(&self, fence: &Fence, uid: &str, volumes: &[Volume]) -> Result<()> {
        let (fence, uid, volumes) = (fence.clone(), uid.to_owned(), volumes.to_vec());
        self.blocking(move |p| p.update_volumes_blocking(&fence, &uid, &volumes))
            .await
    }

    async fn stats(&self, uid: &str) -> Result<PodStats> {
        let uid = uid.to_owned();
        self.blocking(move |p| p.stats_blocking(&uid)).await
    }

    async fn start_ephemeral(
        &self,
        fence: &Fence,
        uid: &str,
        container: &vkd_provider::ContainerSpec,
    ) -> Result<()> {
        let (fence, uid, container) = (fence.clone(), uid.to_owned(), container.clone());
        self.blocking(move |p| p.start_ephemeral_blocking(&fence, &uid, &container))
            .await
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // a failed unwrap is a failed test
    use super::*;

    /// A directory above the state that the Pods' user could write (and so rename
    /// and replace) is refused; the state directory itself is made root's alone.
    #[test]
    fn the_state_tree_must_be_roots_alone() {
        use std::os::unix::fs::PermissionsExt;
        let base = std::env::temp_dir().join(format!("vkd-tree-{}", uuid::Uuid::new_v4().simple()));
        let open = |dir: &Path| {
            let config = ProcessConfig {
                cgroup_parent: "none".into(),
                ..Default::default()
            };
            ProcessProvider::open_unwatched(config, dir, std::env::current_exe().unwrap())
        };
        std::fs::create_dir_all(base.join("shared")).unwrap();
        std::fs::set_permissions(base.join("shared"), std::fs::Permissions::from_mode(0o777))
            .unwrap();
        let err = open(&base.join("shared/state/process")).unwrap_err();
        assert!(
            matches!(&err, OpenError::Insecure { path, .. } if path.ends_with("shared")),
            "{err}"
        );
        // An emptyDir-like state directory (0777, ours) is tightened, not refused.
        std::fs::create_dir_all(base.join("own/state")).unwrap();
        std::fs::set_permissions(
            base.join("own/state"),
            std::fs::Permissions::from_mode(0o777),
        )
        .unwrap();
        open(&base.join("own/state/process")).unwrap();
        let mode = std::fs::metadata(base.join("own/state"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o755);
        let _ = std::fs::remove_dir_all(base);
    }

    /// Reads have no side effects: a stopped sandbox whose shim is gone is still
    /// there after `get` and `list`, and the process it records is not signalled.
    #[test]
    fn reads_never_kill_or_remove() {
        use std::os::unix::process::CommandExt;
        let dir = std::env::temp_dir().join(format!("vkd-reads-{}", uuid::Uuid::new_v4().simple()));
        let config = ProcessConfig {
            cgroup_parent: "none".into(),
            ..Default::default()
        };
        let exe = std::env::current_exe().unwrap();
        let p = ProcessProvider::open_unwatched(config, &dir, exe).unwrap();
        let sb = p.sandbox("u-read");
        std::fs::create_dir_all(&sb.dir).unwrap();
        let rec = InstanceRecord {
            id: "proc-1".into(),
            owner: vkd_provider::PodRef {
                namespace: "ns".into(),
                name: "pod".into(),
                uid: "u-read".into(),
            },
            node: "node-p".into(),
            epoch: 1,
            host: "h".into(),
            created_at: SystemTime::now(),
            cpu_millis: 0,
            memory_bytes: 0,
            ip: None,
        };
        sandbox::write_json(&sb.instance(), &rec, 0o644).unwrap();
        let mut own = std::process::Command::new("sleep")
            .arg("30")
            .process_group(0)
            .spawn()
            .unwrap();
        let id = procfs::ProcessId::of(own.id() as i32).unwrap();
        let mut run = shim::run_of(
            "main",
            ContainerState::Running {
                started_at: SystemTime::now(),
            },
        );
        run.process = Some(id);
        let status = StatusFile {
            phase: InstancePhase::Running,
            init: Vec::new(),
            containers: vec![run],
            started_at: None,
            message: None,
            done: false,
            ephemeral: None,
            pause: None,
        };
        sandbox::write_json(&sb.status(), &status, 0o644).unwrap();
        // A shim identity that is no longer alive, and a stop that was asked for.
        let dead = procfs::ProcessId {
            pid: id.pid,
            start_ticks: id.start_ticks + 1,
        };
        sandbox::write_atomic(&sb.shim_pid(), dead.render().as_bytes(), 0o644).unwrap();
        sandbox::write_atomic(&sb.stop(), b"0", 0o644).unwrap();
        let inst = p.get_blocking("u-read").unwrap().unwrap();
        assert_eq!(inst.phase, InstancePhase::Failed);
        assert_eq!(p.list_blocking("node-p").unwrap().len(), 1);
        std::thread::sleep(Duration::from_millis(200));
        assert!(
            own.try_wait().unwrap().is_none(),
            "a read killed a recorded process"
        );
        assert!(sb.dir.exists(), "a read removed the sandbox");
        p.delete_blocking(
            &Fence {
                node: "node-p".into(),
                epoch: 1,
            },
            "u-read",
            Duration::ZERO,
        )
        .unwrap();
        assert!(own.wait().unwrap().code().is_none(), "the delete kills it");
        assert!(!sb.dir.exists());
        let _ = std::fs::remove_dir_all(dir);
    }
}
