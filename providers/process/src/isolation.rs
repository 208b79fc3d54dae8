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
mod held;
mod users;

use builder::Builder;
pub use held::{check_unchanged, hold, join_held, join_held_pid, release_held};
pub use users::{IdentityMap, new_user_namespace};

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
        volume_roots: Vec::new(),
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
        // Bound through the handle opened beneath the volume, so a link
        // swapped in after the open cannot redirect it.
        let held = match &b.within {
            Some(volume) => Some(open_within(&b.source, volume)?),
            None => None,
        };
        let source = match &held {
            Some(fd) => PathBuf::from(format!("/proc/self/fd/{}", fd.as_raw_fd())),
            None => b.source.clone(),
        };
        let dir = source.is_dir();
        let mut attrs = if b.allow_suid { 0 } else { NOSUID | NODEV };
        if b.read_only {
            attrs |= RDONLY;
        }
        match builder.resolve(&b.target, dir)? {
            builder::Target::Path(at) => {
                rustix::mount::mount_bind_recursive(&source, &at).map_err(errno("binding", &at))?;
                // What is made under it from now on would be made in the volume.
                builder.ours.retain(|o| *o != at);
                if attrs != 0 {
                    restrict(&at, attrs)?;
                }
                if b.within.is_some() {
                    builder.volume_roots.push(at);
                }
            }
            // Inside another volume: a detached copy of the source, its
            // flags set before it is attached, moved onto the held place
            // (never a name the Pod could swap meanwhile).
            builder::Target::InVolume(place) => {
                use rustix::mount::{MoveMountFlags, OpenTreeFlags};
                let tree = rustix::mount::open_tree(
                    rustix::fs::CWD,
                    &source,
                    OpenTreeFlags::OPEN_TREE_CLONE
                        | OpenTreeFlags::OPEN_TREE_CLOEXEC
                        | OpenTreeFlags::AT_RECURSIVE,
                )
                .map_err(errno("binding", &b.target))?;
                if attrs != 0 {
                    restrict_fd(&tree, attrs, &b.target)?;
                }
                rustix::mount::move_mount(
                    &tree,
                    "",
                    &place,
                    "",
                    MoveMountFlags::MOVE_MOUNT_F_EMPTY_PATH
                        | MoveMountFlags::MOVE_MOUNT_T_EMPTY_PATH,
                )
                .map_err(errno("binding", &b.target))?;
            }
        }
        drop(held);
    }
    if let Some(wd) = &plan.working_dir {
        builder.resolve(wd, true)?;
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

/// Opens `source` (O_PATH), which lies in `volume`, without ever leaving it.
/// The volume itself is vkd's (made by it, in a directory no Pod reaches):
/// its own name is never followed as a link. What lies beneath it (a
/// subPath) the Pod may have written: it is resolved by the kernel beneath
/// the volume's handle (`openat2` with `RESOLVE_BENEATH`), so a link there
/// may lead within the volume, as the kubelet allows, but never out of it,
/// not even for an instant between a check and the open.
fn open_within(source: &Path, volume: &Path) -> Result<std::os::fd::OwnedFd> {
    use rustix::fs::{Mode, OFlags, ResolveFlags};
    let leaves = || {
        IsolationError::Invalid(format!(
            "{} leads out of its volume {}",
            source.display(),
            volume.display()
        ))
    };
    let rel = source.strip_prefix(volume).map_err(|_| leaves())?;
    let flags = OFlags::PATH | OFlags::CLOEXEC;
    let is_link = |fd: &std::os::fd::OwnedFd| {
        rustix::fs::fstat(fd)
            .is_ok_and(|st| rustix::fs::FileType::from_raw_mode(st.st_mode).is_symlink())
    };
    // With O_PATH and O_NOFOLLOW a link opens as itself: refused, not bound.
    let base = rustix::fs::open(volume, flags | OFlags::NOFOLLOW, Mode::empty())
        .map_err(errno("opening", volume))?;
    if is_link(&base) {
        return Err(IsolationError::Invalid(format!(
            "volume {} is a link, not what vkd made",
            volume.display()
        )));
    }
    if rel.as_os_str().is_empty() {
        return Ok(base);
    }
    if rel
        .components()
        .any(|c| !matches!(c, std::path::Component::Normal(_)))
    {
        return Err(leaves());
    }
    let resolve = ResolveFlags::BENEATH | ResolveFlags::NO_MAGICLINKS;
    match rustix::fs::openat2(&base, rel, flags, Mode::empty(), resolve) {
        Ok(fd) => Ok(fd),
        Err(rustix::io::Errno::XDEV | rustix::io::Errno::LOOP) => Err(leaves()),
        // A kernel before openat2 (5.6): every name in turn, none a link.
        Err(rustix::io::Errno::NOSYS) => {
            let mut dir = base;
            for part in rel.components() {
                let name = part.as_os_str();
                dir = rustix::fs::openat(&dir, name, flags | OFlags::NOFOLLOW, Mode::empty())
                    .map_err(errno("opening", source))?;
                if is_link(&dir) {
                    return Err(leaves());
                }
            }
            Ok(dir)
        }
        Err(e) => Err(errno("opening", source)(e)),
    }
}

/// Why [`open_or_make`] stopped.
#[derive(Debug)]
pub(crate) enum StepError {
    /// The name is a link: never followed, nothing made through it.
    Link,
    NotDirectory,
    NotFile,
    Io(rustix::io::Errno),
}

/// Opens `name` in the open directory `dir` (O_PATH) without following it,
/// making it where missing (root's: a directory when `want_dir`, else an
/// empty file), as a runtime makes a mount point in its rootfs; says
/// whether it made it. A walk of these steps never leaves `dir`.
pub(crate) fn open_or_make(
    dir: &std::os::fd::OwnedFd,
    name: &std::ffi::OsStr,
    want_dir: bool,
) -> std::result::Result<(std::os::fd::OwnedFd, bool), StepError> {
    use rustix::fs::{FileType, Mode, OFlags};
    // With O_PATH and O_NOFOLLOW a link opens as itself, to be told apart.
    let flags = OFlags::PATH | OFlags::NOFOLLOW | OFlags::CLOEXEC;
    let (opened, made) = match rustix::fs::openat(dir, name, flags, Mode::empty()) {
        Ok(fd) => (fd, false),
        Err(rustix::io::Errno::NOENT) => {
            let made = if want_dir {
                rustix::fs::mkdirat(dir, name, Mode::from_raw_mode(0o755))
            } else {
                let create = OFlags::WRONLY
                    | OFlags::CREATE
                    | OFlags::EXCL
                    | OFlags::NOFOLLOW
                    | OFlags::CLOEXEC;
                rustix::fs::openat(dir, name, create, Mode::from_raw_mode(0o644)).map(drop)
            };
            let made = match made {
                Ok(()) => true,
                Err(rustix::io::Errno::EXIST) => false,
                Err(e) => return Err(StepError::Io(e)),
            };
            let fd = rustix::fs::openat(dir, name, flags, Mode::empty()).map_err(StepError::Io)?;
            (fd, made)
        }
        Err(e) => return Err(StepError::Io(e)),
    };
    let kind = rustix::fs::fstat(&opened)
        .map(|st| FileType::from_raw_mode(st.st_mode))
        .map_err(StepError::Io)?;
    match kind {
        FileType::Symlink => Err(StepError::Link),
        FileType::Directory => Ok((opened, made)),
        _ if want_dir => Err(StepError::NotDirectory),
        FileType::RegularFile => Ok((opened, made)),
        _ => Err(StepError::NotFile),
    }
}

/// The names in the open directory `dir`, but `.` and `..`: read whole
/// first, so what is done to each cannot disturb the reading.
pub(crate) fn entry_names(
    dir: &std::os::fd::OwnedFd,
) -> rustix::io::Result<Vec<std::ffi::OsString>> {
    use std::os::unix::ffi::OsStrExt;
    let mut names = Vec::new();
    for entry in rustix::fs::Dir::read_from(dir)? {
        let entry = entry?;
        let name = entry.file_name().to_bytes();
        if name != b"." && name != b".." {
            names.push(std::ffi::OsStr::from_bytes(name).to_owned());
        }
    }
    Ok(names)
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

/// `struct mount_attr`, as `mount_setattr` reads it.
#[repr(C)]
struct MountAttr {
    attr_set: u64,
    attr_clr: u64,
    propagation: u64,
    userns_fd: u64,
}

/// `mount_setattr` attributes.
pub(crate) const RDONLY: u64 = 0x1;
pub(crate) const NOSUID: u64 = 0x2;
pub(crate) const NODEV: u64 = 0x4;
pub(crate) const NOEXEC: u64 = 0x8;

/// Sets `attrs` (read-only, nosuid, nodev, noexec) on the mount at `at` and
/// every mount under it, keeping their other flags (`mount_setattr` with
/// AT_RECURSIVE).
fn restrict(at: &Path, attrs: u64) -> Result<()> {
    let path = std::ffi::CString::new(at.as_os_str().as_encoded_bytes())
        .map_err(|_| IsolationError::Invalid(format!("{} holds a NUL byte", at.display())))?;
    mount_setattr(libc::AT_FDCWD, &path, 0, attrs).map_err(err("restricting", at))
}

/// [`restrict`] for a detached mount tree held by `tree` (AT_EMPTY_PATH);
/// `what` names it in an error.
fn restrict_fd(tree: &std::os::fd::OwnedFd, attrs: u64, what: &Path) -> Result<()> {
    mount_setattr(tree.as_raw_fd(), c"", libc::AT_EMPTY_PATH, attrs)
        .map_err(err("restricting", what))
}

/// `mount_setattr(dirfd, path, AT_RECURSIVE | flags)` setting `attrs`.
#[allow(unsafe_code)]
fn mount_setattr(
    dirfd: libc::c_int,
    path: &std::ffi::CStr,
    flags: libc::c_int,
    attrs: u64,
) -> std::io::Result<()> {
    const AT_RECURSIVE: libc::c_int = 0x8000;
    let attr = MountAttr {
        attr_set: attrs,
        attr_clr: 0,
        propagation: 0,
        userns_fd: 0,
    };
    // SAFETY: `path` is a NUL-terminated string and `attr` a mount_attr of
    // the size passed, both alive for the call; the kernel only reads them;
    // `dirfd` is AT_FDCWD or a descriptor the caller holds open.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            dirfd,
            path.as_ptr(),
            AT_RECURSIVE | flags,
            &attr as *const MountAttr,
            std::mem::size_of::<MountAttr>(),
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
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

    #[test]
    fn a_bind_source_never_leaves_its_volume_through_a_link() {
        let dir = std::env::temp_dir().join(format!("vkd-open-within-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let volume = dir.join("volumes/data");
        std::fs::create_dir_all(volume.join("sub/deep")).unwrap();
        std::os::unix::fs::symlink("/", volume.join("root")).unwrap();
        std::os::unix::fs::symlink("../../..", volume.join("up")).unwrap();
        std::os::unix::fs::symlink("sub/deep", volume.join("inside")).unwrap();
        let within = |rel: &str| open_within(&volume.join(rel), &volume);
        let real = |fd: std::os::fd::OwnedFd| {
            std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd())).unwrap()
        };
        // The volume itself, a directory beneath it, and a link that stays inside.
        assert_eq!(real(open_within(&volume, &volume).unwrap()), volume);
        assert_eq!(real(within("sub/deep").unwrap()), volume.join("sub/deep"));
        assert_eq!(real(within("inside").unwrap()), volume.join("sub/deep"));
        // Links that lead out, by an absolute name or by `..`, are refused.
        for out in ["root", "up", "root/etc", "up/volumes"] {
            let e = within(out).unwrap_err().to_string();
            assert!(e.contains("leads out of its volume"), "{out}: {e}");
        }
        // A source not under the volume it names is refused unopened.
        assert!(open_within(Path::new("/etc"), &volume).is_err());
        // A link put where the volume was is never followed, even to a
        // directory inside the sandbox.
        std::fs::rename(&volume, dir.join("moved")).unwrap();
        std::os::unix::fs::symlink("/", &volume).unwrap();
        for rel in ["", "etc"] {
            let e = within(rel).unwrap_err().to_string();
            assert!(
                e.contains("is a link") || e.contains("Not a directory"),
                "{rel:?}: {e}"
            );
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_root_is_found_under_itself() {
        assert!(mounts_under(Path::new("/")).contains(&PathBuf::from("/")));
        assert!(mounts_under(Path::new("/no/such/dir/anywhere")).is_empty());
    }
}
