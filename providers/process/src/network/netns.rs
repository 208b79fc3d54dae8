//! The Pod's network namespace: made and kept as a bind mount, removed, and
//! entered by a thread of its own for a port-forward.

use std::path::Path;
use std::time::Duration;

use super::{NetworkError, Result};

/// Makes `dir` (root's, 0700) a mount point of its own, with private
/// propagation, unless it is one already.
pub(super) fn keep_apart(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::create_dir_all(dir)?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))?;
    let dir = std::fs::canonicalize(dir)?;
    if !is_mount_point(&dir)? {
        rustix::mount::mount_bind(&dir, &dir)?;
    }
    rustix::mount::mount_change(&dir, rustix::mount::MountPropagationFlags::PRIVATE)?;
    Ok(())
}

fn is_mount_point(dir: &Path) -> std::io::Result<bool> {
    let st = rustix::fs::statx(
        rustix::fs::CWD,
        dir,
        rustix::fs::AtFlags::SYMLINK_NOFOLLOW,
        rustix::fs::StatxFlags::BASIC_STATS,
    )?;
    let mount_root = rustix::fs::StatxAttributes::MOUNT_ROOT;
    if !st.stx_attributes_mask.contains(mount_root) {
        return Err(std::io::Error::other(
            "statx reports no STATX_ATTR_MOUNT_ROOT",
        ));
    }
    Ok(st.stx_attributes.contains(mount_root))
}

/// Makes a network namespace and keeps it at `path` (a bind mount of the
/// namespace on an empty file). A namespace already there, from an attempt
/// that died half way, is kept.
pub(super) fn make_netns(path: &Path) -> Result<()> {
    let err = |source: std::io::Error| NetworkError::Namespace {
        path: path.to_owned(),
        source,
    };
    if is_netns(path) {
        return Ok(());
    }
    std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .map_err(err)?;
    let target = path.to_owned();
    // A thread of its own enters the new namespace and ends there: no other
    // thread of this process ever changes its network.
    std::thread::Builder::new()
        .name("netns".into())
        .spawn(move || -> std::io::Result<()> {
            unshare_net()?;
            // Per namespace, read by the opener's: what runtimes set for Pods.
            std::fs::write("/proc/sys/net/ipv4/ip_unprivileged_port_start", "0")?;
            let _ = std::fs::write("/proc/sys/net/ipv4/ping_group_range", "0 2147483647");
            rustix::mount::mount_bind("/proc/thread-self/ns/net", &target)?;
            Ok(())
        })
        .map_err(err)?
        .join()
        .map_err(|_| err(std::io::Error::other("the namespace thread panicked")))?
        .map_err(err)
}

#[allow(unsafe_code)]
fn unshare_net() -> std::io::Result<()> {
    // SAFETY: NEWNET only changes the calling thread's network namespace; no
    // file descriptor table or memory is shared differently afterwards.
    unsafe { rustix::thread::unshare_unsafe(rustix::thread::UnshareFlags::NEWNET) }
        .map_err(Into::into)
}

/// Whether `path` holds a network namespace (an nsfs bind mount).
fn is_netns(path: &Path) -> bool {
    const NSFS_MAGIC: i64 = 0x6e73_6673;
    // f_type's width differs between targets.
    #[allow(clippy::unnecessary_cast)]
    rustix::fs::statfs(path).is_ok_and(|s| s.f_type as i64 == NSFS_MAGIC)
}

/// Unmounts and removes the namespace file at `path`, if there is one.
pub(super) fn remove_netns(path: &Path) -> Result<()> {
    let err = |source: std::io::Error| NetworkError::Namespace {
        path: path.to_owned(),
        source,
    };
    while is_netns(path) {
        rustix::mount::unmount(path, rustix::mount::UnmountFlags::DETACH)
            .map_err(|e| err(e.into()))?;
    }
    match std::fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(err(e)),
    }
}

/// Opens a TCP connection to the first of `addrs` that answers, from inside
/// the network namespace at `netns`, as a runtime's port-forward does: a
/// thread of its own enters the namespace, connects (each try bounded by
/// `timeout`) and ends there; the socket keeps the namespace it was made in.
/// The outer error: the namespace could not be entered, so nothing was
/// tried from anywhere else; the inner one: the connection's.
pub fn connect_in(
    netns: &Path,
    addrs: &[std::net::SocketAddr],
    timeout: Duration,
) -> std::io::Result<std::io::Result<std::net::TcpStream>> {
    let (netns, addrs) = (netns.to_owned(), addrs.to_vec());
    // connect_timeout refuses a zero timeout.
    let timeout = timeout.max(Duration::from_millis(1));
    std::thread::Builder::new()
        .name("netns-connect".into())
        .spawn(move || {
            enter(&netns)?;
            let mut last = None;
            for addr in &addrs {
                match std::net::TcpStream::connect_timeout(addr, timeout) {
                    Ok(s) => return Ok(Ok(s)),
                    Err(e) => last = Some(e),
                }
            }
            Ok(Err(last.unwrap_or_else(|| {
                std::io::Error::new(std::io::ErrorKind::NotFound, "no address to connect to")
            })))
        })?
        .join()
        .map_err(|_| std::io::Error::other("the connecting thread panicked"))?
}

/// Moves the calling thread into the network namespace at `netns`.
fn enter(netns: &Path) -> std::io::Result<()> {
    let f = std::fs::File::open(netns)?;
    rustix::thread::move_into_link_name_space(
        std::os::fd::AsFd::as_fd(&f),
        Some(rustix::thread::LinkNameSpaceType::Network),
    )?;
    Ok(())
}
