//! The per-Pod sandbox directory: the only channel between the provider (in the
//! daemon) and the shim (which outlives it).
//!
//! ```text
//! <state>/pods/<uid>/
//!   instance.json   who owns it, epoch, id, when        written once by the provider
//!   spec.json       what to run (0600: it holds Secret values)
//!   env/<container>.json  the container's environment, for the launcher (0600)
//!   shim.pid        "<pid> <start ticks>" of the shim   written by the shim
//!   status.json     container states                    rewritten by the shim
//!   stop            grace seconds, when deletion began  written by the provider
//!   root/           the Pod's filesystem view: mountPaths and workingDirs live here
//!   volumes/<name>/ materialized volumes
//!   volume-files.json the files of each file volume, after a refresh (0600)
//!   logs/<container>/current.log, current.log.1, previous.log
//!   ephemeral/<name>.json an ephemeral container to start (0600, in a 0700
//!                   directory): its spec and launch   written by the provider
//!   mounts/<n>.json launch n's mount plan, with namespaces (root's, 0600)
//!                                                     written by the provider
//!   etc/            hosts, hostname, resolv.conf for the Pod, with namespaces
//!   termination/<c> container c's termination message file, with namespaces
//!   rootfs/         where each container's root is assembled, in its own
//!                   mount namespace (empty as the host sees it)
//!   network.json    the Pod's network namespace and CNI attachment, recorded
//!                   before ADD runs (0600)              written by the provider
//!   attach/<n>      the stdin of launch n (`stdin: true`), a Unix socket the
//!                   shim listens on (in a 0700 directory)  made by the shim
//! ```

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use serde::{Deserialize, Serialize};
use vkd_provider::{ContainerStatus, InstancePhase, InstanceSpec, PodRef};

use crate::procfs::ProcessId;

/// Whether container `c`'s termination message file (`rel`, under the root)
/// is a file of its own, with namespaces: not one inside a volume it mounts,
/// which is the volume's.
pub fn own_termination_file(c: &vkd_provider::ContainerSpec, rel: &Path) -> bool {
    let at = Path::new("/").join(rel);
    !c.mounts.iter().any(|m| at.starts_with(&m.path))
}

/// What the provider records about an instance when it creates it.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct InstanceRecord {
    pub id: String,
    pub owner: PodRef,
    pub node: String,
    pub epoch: u64,
    pub host: String,
    pub created_at: SystemTime,
    /// Requests, for capacity accounting.
    pub cpu_millis: u64,
    pub memory_bytes: u64,
    /// The Pod's own IP, where it has a network namespace (`network`).
    #[serde(default)]
    pub ip: Option<String>,
    /// The GPUs it was given (`gpus` in the config).
    #[serde(default)]
    pub gpus: Vec<String>,
}

/// What the shim runs.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ShimSpec {
    pub spec: InstanceSpec,
    /// Per container (init containers included): the executable resolved at admission,
    /// the full argv, the environment and the working directory.
    pub containers: Vec<Launch>,
    pub run_as: Option<(u32, u32)>,
    pub log_max_bytes: u64,
    /// Where the shim makes the Pod's cgroup, when there is a cgroup v2 hierarchy.
    #[serde(default)]
    pub cgroup: Option<crate::cgroup::CgroupParent>,
    /// The most processes the Pod may have (`podPidsLimit`), in its cgroup.
    #[serde(default)]
    pub pids_limit: Option<u64>,
    /// The same as RLIMIT_NPROC where the cgroup cannot hold it (set only when
    /// the config names `podPidsLimit` itself).
    #[serde(default)]
    pub pids_rlimit: Option<u64>,
    /// Each container runs in namespaces of its own, from `mounts/<n>.json`
    /// (`isolation`); false for host processes and for a spec from before.
    #[serde(default)]
    pub isolated: bool,
    /// The Pod's own IP, where it has a network namespace: where probes
    /// without a host connect.
    #[serde(default)]
    pub pod_ip: Option<String>,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Launch {
    pub name: String,
    pub argv: Vec<String>,
    pub env: Vec<(String, String)>,
    pub cwd: PathBuf,
    /// terminationMessagePath mapped into the Pod's root, relative to it (as
    /// mountPaths and workingDirs are); `None` when it names the root itself.
    #[serde(default)]
    pub termination_log: Option<PathBuf>,
}

/// One container as the shim reports it.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ContainerRun {
    pub status: ContainerStatus,
    /// The running process, for exec, stats and cleanup.
    pub process: Option<ProcessId>,
    pub cgroup: Option<PathBuf>,
    pub started_at: Option<SystemTime>,
}

/// The shim's view of the Pod, rewritten on every change.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct StatusFile {
    pub phase: InstancePhase,
    pub init: Vec<ContainerRun>,
    pub containers: Vec<ContainerRun>,
    pub started_at: Option<SystemTime>,
    pub message: Option<String>,
    /// The shim has finished: every process it started is gone.
    pub done: bool,
    /// The ephemeral containers the shim started, in the order it took their
    /// requests (`ephemeral/<name>.json`). `None`: a shim from before
    /// ephemeral containers, which never starts them.
    #[serde(default)]
    pub ephemeral: Option<Vec<ContainerRun>>,
    /// The pause launcher holding the Pod's shared PID namespace
    /// (`shareProcessNamespace`), while it runs.
    #[serde(default)]
    pub pause: Option<ProcessId>,
    /// The latest events of the containers (probes that failed or warned),
    /// at most [`EVENTS_KEPT`].
    #[serde(default)]
    pub events: Vec<vkd_provider::ContainerEvent>,
}

/// How many container events `status.json` keeps: vkd reads them within
/// seconds, so only a burst beyond this between two reads loses any.
pub const EVENTS_KEPT: usize = 32;

#[derive(Clone, Debug)]
pub struct Sandbox {
    pub dir: PathBuf,
}

impl Sandbox {
    pub fn new(dir: PathBuf) -> Self {
        Self { dir }
    }

    pub fn instance(&self) -> PathBuf {
        self.dir.join("instance.json")
    }
    pub fn spec(&self) -> PathBuf {
        self.dir.join("spec.json")
    }
    pub fn status(&self) -> PathBuf {
        self.dir.join("status.json")
    }
    pub fn shim_pid(&self) -> PathBuf {
        self.dir.join("shim.pid")
    }
    pub fn stop(&self) -> PathBuf {
        self.dir.join("stop")
    }
    pub fn root(&self) -> PathBuf {
        self.dir.join("root")
    }
    pub fn volumes(&self) -> PathBuf {
        self.dir.join("volumes")
    }
    /// The container's environment, read by the launcher (never by a process of the Pod).
    pub fn env_file(&self, container: &str) -> PathBuf {
        self.dir.join("env").join(format!("{container}.json"))
    }

    /// Writes the environment file of `launch` unless it is there already
    /// (sandboxes made before the launcher took its environment from a file).
    pub fn ensure_env_file(&self, launch: &Launch) -> std::io::Result<PathBuf> {
        let path = self.env_file(&launch.name);
        if !path.exists() {
            let dir = self.dir.join("env");
            std::fs::create_dir_all(&dir)?;
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700))?;
            write_json(&path, &launch.env, 0o600)?;
        }
        Ok(path)
    }

    /// Launch `index`'s mount plan (see `isolation`).
    pub fn mount_plan(&self, index: usize) -> PathBuf {
        self.dir.join("mounts").join(format!("{index}.json"))
    }

    /// Ephemeral container `name`'s mount plan.
    pub fn ephemeral_mount_plan(&self, name: &str) -> PathBuf {
        self.dir
            .join("mounts")
            .join(format!("ephemeral-{name}.json"))
    }

    /// With namespaces: where vkd holds the namespaces of this Pod's
    /// containers, `<state>/ns/<uid>`, outside the sandbox (which every
    /// container of the Pod sees), on a mount of its own.
    pub fn held_root(&self) -> PathBuf {
        let uid = self.dir.file_name().unwrap_or_default();
        match self.dir.parent().and_then(Path::parent) {
            Some(state) => state.join("ns").join(uid),
            None => self.dir.join("ns"),
        }
    }

    /// Where container `container`'s namespaces are held (see `isolation::hold`).
    pub fn held_namespaces(&self, container: &str) -> PathBuf {
        self.held_root().join(container)
    }

    /// With namespaces: each container's termination message file, by
    /// container name, bound at its terminationMessagePath.
    pub fn termination_dir(&self) -> PathBuf {
        self.dir.join("termination")
    }

    /// The Pod's own /etc files, with namespaces.
    pub fn etc(&self) -> PathBuf {
        self.dir.join("etc")
    }

    /// Where containers' roots are assembled (see `isolation`).
    pub fn rootfs(&self) -> PathBuf {
        self.dir.join("rootfs")
    }

    /// The directory of the stdin sockets (see [`Self::attach_socket`]).
    pub fn attach_dir(&self) -> PathBuf {
        self.dir.join("attach")
    }

    /// The socket that feeds launch `index`'s stdin: by index, not by name, so
    /// the path stays within a socket address's 108 bytes.
    pub fn attach_socket(&self, index: usize) -> PathBuf {
        self.attach_dir().join(index.to_string())
    }

    /// The files vkd wrote into each file volume at its last refresh, by
    /// volume name (root's, 0600): what a refresh may remove. Absent until
    /// the first refresh, when the files of `spec.json` are the ones written.
    pub fn volume_files(&self) -> PathBuf {
        self.dir.join("volume-files.json")
    }

    pub fn logs(&self, container: &str) -> PathBuf {
        self.dir.join("logs").join(container)
    }

    pub fn read_status(&self) -> std::io::Result<Option<StatusFile>> {
        read_json(&self.status())
    }

    pub fn read_instance(&self) -> std::io::Result<Option<InstanceRecord>> {
        read_json(&self.instance())
    }

    pub fn read_spec(&self) -> std::io::Result<Option<ShimSpec>> {
        read_json(&self.spec())
    }

    pub fn shim_process(&self) -> Option<ProcessId> {
        let text = std::fs::read_to_string(self.shim_pid()).ok()?;
        ProcessId::parse(&text)
    }

    /// The grace period deletion asked for, once it was asked.
    pub fn stop_requested(&self) -> Option<u64> {
        let text = std::fs::read_to_string(self.stop()).ok()?;
        text.trim().parse().ok()
    }
}

/// Opens `rel` under the directory `root` without following any link on the
/// way (nor at the end) and without leaving `root`: what a Pod controls (its
/// root is its own) can never turn a read or write by root elsewhere. Uses
/// openat2 where the kernel has it, else walks the path one directory at a time.
pub fn open_beneath(
    root: &Path,
    rel: &Path,
    flags: rustix::fs::OFlags,
    mode: rustix::fs::Mode,
) -> std::io::Result<std::fs::File> {
    use rustix::fs::{OFlags, ResolveFlags};
    let dir_flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
    let base = rustix::fs::open(root, dir_flags, rustix::fs::Mode::empty())?;
    let flags = flags | OFlags::NOFOLLOW | OFlags::CLOEXEC | OFlags::NONBLOCK;
    let resolve = ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS;
    match rustix::fs::openat2(&base, rel, flags, mode, resolve) {
        Ok(fd) => return Ok(fd.into()),
        Err(rustix::io::Errno::NOSYS) => {}
        Err(e) => return Err(e.into()),
    }
    let mut dir = base;
    let parts: Vec<_> = rel.components().collect();
    for (n, part) in parts.iter().enumerate() {
        let std::path::Component::Normal(name) = part else {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("{} is not a plain relative path", rel.display()),
            ));
        };
        if n + 1 == parts.len() {
            return Ok(rustix::fs::openat(&dir, *name, flags, mode)?.into());
        }
        dir = rustix::fs::openat(&dir, *name, dir_flags, rustix::fs::Mode::empty())?;
    }
    Err(std::io::Error::new(
        std::io::ErrorKind::InvalidInput,
        "an empty path",
    ))
}

pub fn read_json<T: for<'de> Deserialize<'de>>(path: &Path) -> std::io::Result<Option<T>> {
    match std::fs::read(path) {
        Ok(bytes) => serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

/// Writes through a temporary file and a rename, so a reader never sees half a file.
pub fn write_atomic(path: &Path, bytes: &[u8], mode: u32) -> std::io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(mode)
        .open(&tmp)?;
    f.write_all(bytes)?;
    f.sync_all()?;
    std::fs::rename(&tmp, path)
}

pub fn write_json<T: Serialize>(path: &Path, value: &T, mode: u32) -> std::io::Result<()> {
    let bytes = serde_json::to_vec(value)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
    write_atomic(path, &bytes, mode)
}
