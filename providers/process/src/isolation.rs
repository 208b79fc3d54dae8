//! Containers in their own namespaces, where vkd runs as root: each container
//! gets a mount, PID and UTS namespace of its own, built by the launcher
//! (`launch`) before it drops to the run-as user. What the container sees:
//!
//! - the host's tree, read-only by default (`hostRootReadOnly`), so the
//!   programs an image maps to are where they are on the host;
//! - its own /proc (only its own processes), /dev (null, zero, full, random,
//!   urandom, tty, shm), /tmp, and /sys read-only;
//! - the Pod's volumes, subPaths, termination message file and /etc/hosts,
//!   /etc/hostname and /etc/resolv.conf, each at the path the spec names;
//! - no other Pod's sandbox: the provider's state directory is hidden, and
//!   only this Pod's sandbox is shown again, at its own path, so
//!   `$VKD_POD_ROOT` means what it means without namespaces.
//!
//! A mount point the host lacks is made without touching the host: the
//! nearest directory above it is covered with a tmpfs that holds binds of what
//! was there, and the new directory or file is made in that tmpfs.
//! `kubectl exec`, probes and hooks enter the container's namespaces
//! ([`join`]). The program is its PID namespace's init, as in a container: when
//! it ends, every process it left ends with it.

use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use rustix::mount::{MountFlags, MountPropagationFlags, UnmountFlags};
use serde::{Deserialize, Serialize};

mod builder;

use builder::Builder;

/// What one container's mount namespace holds besides the host's tree: the
/// provider writes it at create (`mounts/<n>.json`, root's), the launcher
/// builds it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MountPlan {
    /// A directory of the host where the container's root is assembled, in
    /// the container's own mount namespace (nothing there is seen outside).
    pub root: PathBuf,
    /// The host's tree is seen read-only.
    pub host_root_read_only: bool,
    /// The Pod's hostname, in its own UTS namespace.
    pub hostname: String,
    /// Host directories covered by an empty directory (the provider's state).
    pub hide: Vec<PathBuf>,
    /// What is mounted where, in the order given (parents before children).
    pub binds: Vec<Bind>,
    /// The container's workingDir, made (empty) if the tree lacks it, as a
    /// runtime makes it.
    #[serde(default)]
    pub working_dir: Option<PathBuf>,
    /// The Pod's network namespace (a bind mount of one), joined first;
    /// `None` keeps the host's network.
    #[serde(default)]
    pub netns: Option<PathBuf>,
    /// Mount points detached (with all beneath them) from the container's
    /// mount namespace: the other Pods' network namespaces.
    #[serde(default)]
    pub detach: Vec<PathBuf>,
    /// A user namespace of its own, mapping only these ids (each to
    /// itself), made once the tree is built; `None` where the kernel allows
    /// none. No other id, root's least, exists in it: a setuid-root program
    /// gives nothing, and files of unmapped owners read as nobody's.
    #[serde(default)]
    pub user_namespace: Option<IdentityMap>,
}

/// The ids a container's user namespace maps, each to the same id outside.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct IdentityMap {
    /// The run-as user, and the owners of the setuid programs the image's
    /// `files` keep (so they work as without a user namespace).
    pub uids: Vec<u32>,
    /// The run-as group, the Pod's fsGroup, and the groups of the image's
    /// setgid programs.
    pub gids: Vec<u32>,
}

impl IdentityMap {
    fn lines(ids: impl IntoIterator<Item = u32>) -> String {
        let mut ids: Vec<u32> = ids.into_iter().collect();
        ids.sort_unstable();
        ids.dedup();
        ids.iter().map(|id| format!("{id} {id} 1\n")).collect()
    }

    /// Writes the maps of process `pid`, which has just made the namespace
    /// (by a process with CAP_SETUID and CAP_SETGID outside it: the launcher
    /// as root).
    pub fn write(&self, pid: i32) -> Result<()> {
        if self.uids.contains(&0) || self.gids.contains(&0) {
            return Err(IsolationError::Invalid(
                "a container's user namespace never maps root".into(),
            ));
        }
        for (file, text) in [
            ("uid_map", Self::lines(self.uids.iter().copied())),
            ("gid_map", Self::lines(self.gids.iter().copied())),
        ] {
            let path = PathBuf::from(format!("/proc/{pid}/{file}"));
            std::fs::write(&path, text).map_err(err("writing", &path))?;
        }
        Ok(())
    }
}

/// Gives the calling process (single-threaded, pivoted into its root) a
/// user namespace of its own; its maps are written from outside
/// ([`IdentityMap::write`]).
pub fn new_user_namespace() -> Result<()> {
    unshare(rustix::thread::UnshareFlags::NEWUSER)
}

/// One bind mount: `source` on the host at `target` in the container.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Bind {
    pub source: PathBuf,
    /// Absolute, as the container sees it.
    pub target: PathBuf,
    pub read_only: bool,
    /// A missing source is skipped rather than an error.
    #[serde(default)]
    pub optional: bool,
    /// The volume `source` lies in: what the source resolves to (through
    /// any link a Pod planted in the volume) must stay inside it.
    #[serde(default)]
    pub within: Option<PathBuf>,
    /// Setuid and setgid bits take effect (an image's own file not owned by
    /// root); every other bind is `nosuid,nodev`.
    #[serde(default)]
    pub allow_suid: bool,
}

/// Why a container's namespaces could not be made or entered.
#[derive(Debug, thiserror::Error)]
pub enum IsolationError {
    #[error("{what} {path}: {source}")]
    Mount {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{0}")]
    Invalid(String),
}

type Result<T> = std::result::Result<T, IsolationError>;

fn err<'a>(
    what: &'static str,
    path: &'a Path,
) -> impl FnOnce(std::io::Error) -> IsolationError + 'a {
    move |source| IsolationError::Mount {
        what,
        path: path.to_owned(),
        source,
    }
}

fn errno<'a>(
    what: &'static str,
    path: &'a Path,
) -> impl FnOnce(rustix::io::Errno) -> IsolationError + 'a {
    move |e| IsolationError::Mount {
        what,
        path: path.to_owned(),
        source: e.into(),
    }
}

/// The top-level host entries a container never gets as they are: it has its
/// own of each.
const OWN: [&str; 4] = ["proc", "dev", "tmp", "sys"];

/// The device nodes a container's /dev holds, as a runtime's does.
const DEVICES: [&str; 6] = ["null", "zero", "full", "random", "urandom", "tty"];

/// Makes a new mount and UTS namespace for the calling process, which is
/// already the init of a new PID namespace, and moves it into the container's
/// root. Single-threaded callers only (the launcher).
pub fn enter_new(plan: &MountPlan) -> Result<()> {
    if let Some(netns) = &plan.netns {
        let f = std::fs::File::open(netns).map_err(err("opening", netns))?;
        rustix::thread::move_into_link_name_space(
            std::os::fd::AsFd::as_fd(&f),
            Some(rustix::thread::LinkNameSpaceType::Network),
        )
        .map_err(errno("entering the network namespace", netns))?;
    }
    unshare(rustix::thread::UnshareFlags::NEWNS | rustix::thread::UnshareFlags::NEWUTS)?;
    // Nothing mounted from here on reaches the host.
    rustix::mount::mount_change(
        "/",
        MountPropagationFlags::REC | MountPropagationFlags::PRIVATE,
    )
    .map_err(errno("making private", Path::new("/")))?;
    for d in &plan.detach {
        // Gone from this namespace alone (it is private now); not a mount
        // point, or none there, leaves nothing to detach.
        match rustix::mount::unmount(d, UnmountFlags::DETACH) {
            Ok(()) | Err(rustix::io::Errno::INVAL | rustix::io::Errno::NOENT) => {}
            Err(e) => return Err(errno("detaching", d)(e)),
        }
    }
    // Other Pods' mounts under the hidden state (tmpfs volumes, network
    // namespaces) leave this namespace, so no container holds them alive;
    // what this container binds from stays.
    for h in &plan.hide {
        for m in mounts_under(h) {
            if plan
                .binds
                .iter()
                .any(|b| m.starts_with(&b.source) || b.source.starts_with(&m))
            {
                continue;
            }
            match rustix::mount::unmount(&m, UnmountFlags::DETACH) {
                Ok(()) | Err(rustix::io::Errno::INVAL | rustix::io::Errno::NOENT) => {}
                Err(e) => return Err(errno("detaching", &m)(e)),
            }
        }
    }
    let root = &plan.root;
    if !root.is_absolute() {
        return Err(IsolationError::Invalid(format!(
            "the container root {} is not absolute",
            root.display()
        )));
    }
    tmpfs(root, "mode=0755")?;
    let mut builder = Builder {
        root,
        read_only: plan.host_root_read_only,
        covers: vec![root.clone()],
        ours: vec![root.clone()],
    };
    builder.replicate(Path::new("/"), root, &OWN)?;
    builder.own_dirs()?;
    for dir in &plan.hide {
        let at = builder.mount_point(dir, true)?;
        tmpfs(&at, "mode=0755")?;
        builder.covers.push(at.clone());
        builder.ours.push(at);
    }
    for b in &plan.binds {
        match b.source.symlink_metadata() {
            Err(_) if b.optional => continue,
            Err(e) => return Err(err("volume", &b.source)(e)),
            Ok(_) => {}
        }
        // Held open from the check to the mount, so a link swapped in
        // between cannot redirect it.
        let held = match &b.within {
            Some(volume) => Some(open_within(&b.source, volume)?),
            None => None,
        };
        let source = match &held {
            Some(fd) => PathBuf::from(format!("/proc/self/fd/{}", fd.as_raw_fd())),
            None => b.source.clone(),
        };
        let dir = source.is_dir();
        let at = builder.mount_point(&b.target, dir)?;
        rustix::mount::mount_bind_recursive(&source, &at).map_err(errno("binding", &at))?;
        drop(held);
        // What is made under it from now on would be made in the volume.
        builder.ours.retain(|o| *o != at);
        let mut attrs = if b.allow_suid { 0 } else { NOSUID | NODEV };
        if b.read_only {
            attrs |= RDONLY;
        }
        if attrs != 0 {
            restrict(&at, attrs)?;
        }
    }
    if let Some(wd) = &plan.working_dir {
        builder.mount_point(wd, true)?;
    }
    // The directories made for mount points are fixed too.
    if plan.host_root_read_only {
        for c in &builder.covers {
            rustix::mount::mount_remount(
                c,
                MountFlags::RDONLY | MountFlags::NOSUID | MountFlags::NODEV,
                "",
            )
            .map_err(errno("making read-only", c))?;
        }
    }
    if !plan.hostname.is_empty() {
        rustix::system::sethostname(plan.hostname.as_bytes())
            .map_err(errno("setting the hostname", Path::new(&plan.hostname)))?;
    }
    // The new root replaces the host's; the old one goes entirely.
    std::env::set_current_dir(root).map_err(err("entering", root))?;
    rustix::process::pivot_root(".", ".").map_err(errno("pivot_root", root))?;
    rustix::mount::unmount(".", UnmountFlags::DETACH)
        .map_err(errno("detaching the host's root", root))?;
    std::env::set_current_dir("/").map_err(err("entering", Path::new("/")))?;
    Ok(())
}

/// The namespaces vkd holds for each container, by their /proc names.
const HELD: [&str; 5] = ["net", "uts", "mnt", "pid", "user"];

/// Holds the namespaces of process `pid` (a container's first process, its
/// namespaces complete, before the Pod's program runs) in `dir`: a bind
/// mount of each on a file there, root's. `kubectl exec`, probes and hooks
/// enter these ([`join_held`]), never what a container's processes are in
/// now, so a namespace a Pod makes for itself is never entered from outside
/// it. A container's earlier run's are replaced.
pub fn hold(dir: &Path, pid: i32) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    if let Some(parent) = dir.parent() {
        std::fs::create_dir_all(parent).map_err(err("making", parent))?;
    }
    match std::fs::create_dir(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(err("making", dir)(e)),
    }
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
        .map_err(err("securing", dir))?;
    for name in HELD {
        let file = dir.join(name);
        unhold(&file)?;
        std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(false)
            .open(&file)
            .map_err(err("making", &file))?;
        rustix::mount::mount_bind(ns_path(pid, name), &file).map_err(errno("holding", &file))?;
        // Mount namespaces made from now on get no copy of it.
        rustix::mount::mount_change(&file, MountPropagationFlags::PRIVATE)
            .map_err(errno("holding", &file))?;
    }
    Ok(())
}

/// Lets go of every namespace held at or under `dir` and removes it.
pub fn release_held(dir: &Path) -> Result<()> {
    unmount_under(dir)?;
    match std::fs::remove_dir_all(dir) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(err("removing", dir)(e)),
    }
}

fn unhold(file: &Path) -> Result<()> {
    while is_nsfs(file) {
        rustix::mount::unmount(file, UnmountFlags::DETACH).map_err(errno("letting go of", file))?;
    }
    Ok(())
}

/// Whether `path` is a namespace (an nsfs bind mount).
fn is_nsfs(path: &Path) -> bool {
    const NSFS_MAGIC: i64 = 0x6e73_6673;
    // f_type's width differs between targets.
    #[allow(clippy::unnecessary_cast)]
    rustix::fs::statfs(path).is_ok_and(|s| s.f_type as i64 == NSFS_MAGIC)
}

/// Opens the namespaces held in `dir`, each checked to be one.
fn open_held(dir: &Path, name: &str) -> Result<std::fs::File> {
    let file = dir.join(name);
    if !is_nsfs(&file) {
        return Err(IsolationError::Invalid(format!(
            "no {name} namespace is held for this container at {} (a container started \
             before vkd held its namespaces cannot be entered; restart the Pod)",
            file.display()
        )));
    }
    std::fs::File::open(&file).map_err(err("opening", &file))
}

/// Refuses a container whose program (`program`, its PID namespace's init)
/// is no longer in the namespaces vkd made for it: it made new ones of its
/// own, and entering what it chose could hand a process from outside to it.
pub fn check_unchanged(dir: &Path, program: i32) -> Result<()> {
    use std::os::unix::fs::MetadataExt;
    for name in HELD {
        let held = open_held(dir, name)?
            .metadata()
            .map_err(err("reading", &dir.join(name)))?;
        let now_path = ns_path(program, name);
        let now = ns_file(program, name)?
            .metadata()
            .map_err(err("reading", &now_path))?;
        if (held.dev(), held.ino()) != (now.dev(), now.ino()) {
            return Err(IsolationError::Invalid(format!(
                "the container's {name} namespace changed since it started (its program \
                 made one of its own); refusing to enter it"
            )));
        }
    }
    Ok(())
}

/// Enters the network, UTS and mount namespaces held in `dir`: `kubectl
/// exec`, probes and hooks see what the container sees. Its PID namespace is
/// entered by the caller's parent ([`join_held_pid`]).
pub fn join_held(dir: &Path) -> Result<()> {
    use rustix::thread::LinkNameSpaceType as Ns;
    // All are opened before any is entered: `dir` is the host's path.
    let net = open_held(dir, "net")?;
    let uts = open_held(dir, "uts")?;
    let mnt = open_held(dir, "mnt")?;
    let user = open_held(dir, "user")?;
    for (f, kind, name) in [
        (&net, Ns::Network, "net"),
        (&uts, Ns::HostNameAndNISDomainName, "uts"),
        (&mnt, Ns::Mount, "mnt"),
    ] {
        rustix::thread::move_into_link_name_space(std::os::fd::AsFd::as_fd(f), Some(kind))
            .map_err(errno("entering the namespace", &dir.join(name)))?;
    }
    // Last: once in it, nothing outside may be entered. A container without
    // one holds the host's, which is entered already.
    use std::os::unix::fs::MetadataExt;
    let own = std::fs::metadata("/proc/self/ns/user")
        .map_err(err("reading", Path::new("/proc/self/ns/user")))?;
    let held = user.metadata().map_err(err("reading", &dir.join("user")))?;
    if (own.dev(), own.ino()) != (held.dev(), held.ino()) {
        rustix::thread::move_into_link_name_space(std::os::fd::AsFd::as_fd(&user), Some(Ns::User))
            .map_err(errno("entering the namespace", &dir.join("user")))?;
    }
    Ok(())
}

/// Makes the caller's next children members of the PID namespace held in `dir`.
pub fn join_held_pid(dir: &Path) -> Result<()> {
    let f = open_held(dir, "pid")?;
    rustix::thread::move_into_link_name_space(
        std::os::fd::AsFd::as_fd(&f),
        Some(rustix::thread::LinkNameSpaceType::ProcessID),
    )
    .map_err(errno("entering the namespace", &dir.join("pid")))
}

/// Makes the caller's next children members of process `pid`'s PID namespace.
pub fn join_pid(pid: i32) -> Result<()> {
    let f = ns_file(pid, "pid")?;
    rustix::thread::move_into_link_name_space(
        std::os::fd::AsFd::as_fd(&f),
        Some(rustix::thread::LinkNameSpaceType::ProcessID),
    )
    .map_err(errno("entering the namespace", &ns_path(pid, "pid")))
}

/// Makes the caller's next children the init of a PID namespace of their own.
pub fn new_pid_namespace() -> Result<()> {
    unshare(rustix::thread::UnshareFlags::NEWPID)
}

/// The container's program behind launcher process `pid`: with namespaces the
/// launcher waits in the host's PID namespace while its one child, the
/// program, is the init of the container's. Without, `pid` itself.
pub fn program_of(pid: i32) -> i32 {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .ok()
        .and_then(|t| t.split_whitespace().next()?.parse().ok())
        .unwrap_or(pid)
}

/// Whether the container's program behind launcher `pid` has started: the
/// launcher's child has replaced itself (exec) with the program, so the
/// container's namespaces and root are complete. Until then the child may
/// still be in the host's mount namespace, or before its pivot: joining it
/// then would join the host's.
pub fn program_started(pid: i32) -> bool {
    let program = program_of(pid);
    program != pid && !crate::procfs::is_launcher(program)
}

/// Opens `source` (O_PATH) only if what it resolves to lies in `volume`, as
/// resolved too; checked again on the open handle itself.
fn open_within(source: &Path, volume: &Path) -> Result<std::os::fd::OwnedFd> {
    use rustix::fs::{Mode, OFlags};
    let root = std::fs::canonicalize(volume).map_err(err("resolving", volume))?;
    let leaves = || {
        IsolationError::Invalid(format!(
            "{} leads out of its volume {}",
            source.display(),
            volume.display()
        ))
    };
    let real = std::fs::canonicalize(source).map_err(err("resolving", source))?;
    if !real.starts_with(&root) {
        return Err(leaves());
    }
    let fd = rustix::fs::open(
        &real,
        OFlags::PATH | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(errno("opening", &real))?;
    let now = std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()))
        .map_err(err("resolving", &real))?;
    if !now.starts_with(&root) {
        return Err(leaves());
    }
    Ok(fd)
}

fn ns_path(pid: i32, ns: &str) -> PathBuf {
    PathBuf::from(format!("/proc/{pid}/ns/{ns}"))
}

fn ns_file(pid: i32, ns: &str) -> Result<std::fs::File> {
    let p = ns_path(pid, ns);
    std::fs::File::open(&p).map_err(err("opening", &p))
}

#[allow(unsafe_code)]
fn unshare(flags: rustix::thread::UnshareFlags) -> Result<()> {
    // SAFETY: the flags never include FILES, the one that makes file
    // descriptors thread-local; the launcher is single-threaded besides.
    unsafe { rustix::thread::unshare_unsafe(flags) }.map_err(errno("unshare", Path::new("/")))
}

fn tmpfs(at: &Path, options: &str) -> Result<()> {
    let options = std::ffi::CString::new(options)
        .map_err(|_| IsolationError::Invalid(format!("tmpfs options {options:?}")))?;
    rustix::mount::mount(
        "tmpfs",
        at,
        "tmpfs",
        MountFlags::NOSUID | MountFlags::NODEV,
        Some(options.as_c_str()),
    )
    .map_err(errno("mounting a tmpfs on", at))
}

/// Mounts a tmpfs on `at` for a memory-backed emptyDir: open to every user
/// of the Pod (0777), of `size` bytes at most (at least a page: 0 would mean
/// no limit), on the host, so every container of the Pod binds the same.
pub fn mount_tmpfs(at: &Path, size: Option<u64>) -> Result<()> {
    let options = match size {
        Some(bytes) => format!("mode=0777,size={}", bytes.max(4096)),
        None => "mode=0777".to_owned(),
    };
    tmpfs(at, &options)
}

/// The mount points at or under `dir`, deepest first, from the caller's
/// /proc/self/mountinfo.
pub fn mounts_under(dir: &Path) -> Vec<PathBuf> {
    let Ok(text) = std::fs::read("/proc/self/mountinfo") else {
        return Vec::new();
    };
    let mut found: Vec<PathBuf> = text
        .split(|b| *b == b'\n')
        .filter_map(|line| line.split(|b| *b == b' ').nth(4))
        .map(|p| PathBuf::from(unescape(p)))
        .filter(|p| p.starts_with(dir))
        .collect();
    found.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    found.dedup();
    found
}

/// mountinfo's octal escapes (`\040` for a space) undone.
fn unescape(field: &[u8]) -> std::ffi::OsString {
    use std::os::unix::ffi::OsStringExt;
    let mut out = Vec::with_capacity(field.len());
    let mut i = 0;
    while i < field.len() {
        let oct = field
            .get(i + 1..i + 4)
            .filter(|d| field[i] == b'\\' && d.iter().all(|c| (b'0'..=b'7').contains(c)));
        match oct {
            Some(d) => {
                out.push(
                    d.iter()
                        .fold(0u8, |n, c| n.wrapping_mul(8).wrapping_add(c - b'0')),
                );
                i += 4;
            }
            None => {
                out.push(field[i]);
                i += 1;
            }
        }
    }
    std::ffi::OsString::from_vec(out)
}

/// Detaches every mount at or under `dir` (a sandbox's tmpfs volumes), so
/// the directory can be removed.
pub fn unmount_under(dir: &Path) -> Result<()> {
    for m in mounts_under(dir) {
        match rustix::mount::unmount(&m, UnmountFlags::DETACH) {
            Ok(()) | Err(rustix::io::Errno::INVAL | rustix::io::Errno::NOENT) => {}
            Err(e) => return Err(errno("unmounting", &m)(e)),
        }
    }
    Ok(())
}

/// `mount_setattr` attributes.
pub(crate) const RDONLY: u64 = 0x1;
pub(crate) const NOSUID: u64 = 0x2;
pub(crate) const NODEV: u64 = 0x4;
pub(crate) const NOEXEC: u64 = 0x8;

/// Sets `attrs` (read-only, nosuid, nodev, noexec) on the mount at `at` and
/// every mount under it, keeping their other flags (`mount_setattr` with
/// AT_RECURSIVE).
#[allow(unsafe_code)]
fn restrict(at: &Path, attrs: u64) -> Result<()> {
    #[repr(C)]
    struct MountAttr {
        attr_set: u64,
        attr_clr: u64,
        propagation: u64,
        userns_fd: u64,
    }
    const AT_RECURSIVE: libc::c_int = 0x8000;
    let path = std::ffi::CString::new(at.as_os_str().as_encoded_bytes())
        .map_err(|_| IsolationError::Invalid(format!("{} holds a NUL byte", at.display())))?;
    let attr = MountAttr {
        attr_set: attrs,
        attr_clr: 0,
        propagation: 0,
        userns_fd: 0,
    };
    // SAFETY: `path` is a NUL-terminated string and `attr` a mount_attr of the
    // size passed, both alive for the call; the kernel only reads them.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            libc::AT_FDCWD,
            path.as_ptr(),
            AT_RECURSIVE,
            &attr as *const MountAttr,
            std::mem::size_of::<MountAttr>(),
        )
    };
    if rc != 0 {
        return Err(err("restricting", at)(std::io::Error::last_os_error()));
    }
    Ok(())
}

/// Whether this host can give containers namespaces: vkd is root and the
/// kernel allows new mount and PID namespaces (checked in a child, as the
/// caller is threaded).
pub fn available(launcher: &Path) -> bool {
    rustix::process::geteuid().is_root() && launcher_says_yes(launcher, "--check-namespaces")
}

/// Whether the kernel lets the launcher give containers user namespaces
/// (some hosts disable them: `user.max_user_namespaces=0`).
pub fn user_namespaces_available(launcher: &Path) -> bool {
    launcher_says_yes(launcher, "--check-user-namespaces")
}

/// Runs one of the launcher's checks in a child of its own.
fn launcher_says_yes(launcher: &Path, check: &str) -> bool {
    std::process::Command::new(launcher)
        .args(["process-launch", check])
        .env_clear()
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// The check behind [`user_namespaces_available`], in the launcher.
pub fn check_user() -> bool {
    unshare(rustix::thread::UnshareFlags::NEWUSER).is_ok()
}

/// The check behind [`available`], in the launcher.
pub fn check() -> bool {
    unshare(
        rustix::thread::UnshareFlags::NEWNS
            | rustix::thread::UnshareFlags::NEWPID
            | rustix::thread::UnshareFlags::NEWUTS,
    )
    .is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_escapes_are_undone_and_bad_ones_kept() {
        assert_eq!(unescape(br"/a\040b"), "/a b");
        assert_eq!(unescape(br"/tab\011x\134"), "/tab\tx\\");
        assert_eq!(unescape(br"/odd\09"), r"/odd\09");
        assert_eq!(unescape(br"/end\"), r"/end\");
    }

    /// Held namespaces are entered only while the container's program is
    /// still in them: one that moved to a namespace of its own is refused.
    #[test]
    fn a_container_whose_namespaces_changed_is_refused() {
        if !rustix::process::geteuid().is_root() {
            return;
        }
        let base = std::env::temp_dir().join(format!("vkd-held-{}", std::process::id()));
        std::fs::create_dir_all(&base).unwrap();
        let held = base.join("pod").join("main");
        // A process in a mount namespace of its own, as a container's program.
        let mut child = std::process::Command::new("unshare")
            .args(["-m", "sleep", "30"])
            .spawn()
            .unwrap();
        let pid = i32::try_from(child.id()).unwrap();
        let moved = (0..100).any(|_| {
            std::thread::sleep(std::time::Duration::from_millis(20));
            std::fs::read_link(format!("/proc/{pid}/ns/mnt")).ok()
                != std::fs::read_link("/proc/self/ns/mnt").ok()
        });
        assert!(moved, "unshare did not make a mount namespace");
        hold(&held, pid).unwrap();
        check_unchanged(&held, pid).unwrap();
        // Another process (this one) is not in what was held for it.
        let refused = check_unchanged(&held, std::process::id() as i32).unwrap_err();
        assert!(refused.to_string().contains("changed"), "{refused}");
        // Held again (a restart): the earlier hold is replaced, not stacked.
        hold(&held, pid).unwrap();
        let _ = child.kill();
        let _ = child.wait();
        // Still held after the process is gone, until released.
        assert!(is_nsfs(&held.join("mnt")));
        release_held(&base.join("pod")).unwrap();
        assert!(!base.join("pod").exists());
        let _ = std::fs::remove_dir_all(&base);
    }

    #[test]
    fn the_root_is_found_under_itself() {
        assert!(mounts_under(Path::new("/")).contains(&PathBuf::from("/")));
        assert!(mounts_under(Path::new("/no/such/dir/anywhere")).is_empty());
    }
}
