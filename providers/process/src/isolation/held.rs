//! The namespaces vkd holds for each container: bind mounts of them, made
//! once a container's namespaces are complete and before its program runs,
//! entered by `kubectl exec`, probes and hooks instead of what the
//! container's processes are in now.

use std::path::Path;

use rustix::mount::{MountPropagationFlags, UnmountFlags};

use super::{IsolationError, Result, err, errno, ns_file, ns_path, unmount_under};

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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // a failed unwrap is a failed test
    use super::*;

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
}
