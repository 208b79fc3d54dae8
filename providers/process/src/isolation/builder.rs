//! The builder of a container's root: the host's tree bound (read-only by
//! default) beneath a tmpfs, what the container has of its own, and mount
//! points made in tmpfs covers, never in the host's directories.

use std::os::fd::AsRawFd;
use std::path::{Component, Path, PathBuf};

use rustix::mount::MountFlags;

use super::{
    DEVICES, IsolationError, NODEV, NOEXEC, NOSUID, OWN, RDONLY, Result, err, errno, restrict,
    tmpfs,
};

/// Assembles a container's root.
pub(super) struct Builder<'a> {
    pub(super) root: &'a Path,
    pub(super) read_only: bool,
    /// The tmpfs mounts made for the root and for new mount points.
    pub(super) covers: Vec<PathBuf>,
    /// The directories whose entries are the container's own (in a tmpfs
    /// made here), where a mount point may be made: never the host's.
    pub(super) ours: Vec<PathBuf>,
}

impl Builder<'_> {
    /// Fills the (empty, writable) directory `to` with binds of what `from`
    /// holds, but `skip`: directories and files are bound, links copied.
    pub(super) fn replicate(&mut self, from: &Path, to: &Path, skip: &[&str]) -> Result<()> {
        for entry in std::fs::read_dir(from).map_err(err("reading", from))? {
            let entry = entry.map_err(err("reading", from))?;
            let name = entry.file_name();
            if skip.iter().any(|s| name == *s) {
                continue;
            }
            let (src, dst) = (entry.path(), to.join(&name));
            let kind = entry.file_type().map_err(err("reading", &src))?;
            if kind.is_symlink() {
                let target = std::fs::read_link(&src).map_err(err("reading", &src))?;
                std::os::unix::fs::symlink(target, &dst).map_err(err("linking", &dst))?;
                continue;
            }
            if kind.is_dir() {
                std::fs::create_dir(&dst).map_err(err("making", &dst))?;
            } else {
                std::fs::File::create(&dst).map_err(err("making", &dst))?;
            }
            rustix::mount::mount_bind_recursive(&src, &dst).map_err(errno("binding", &dst))?;
            // A setuid program or a device node of the host gives a Pod nothing.
            let ro = if self.read_only { RDONLY } else { 0 };
            restrict(&dst, NOSUID | NODEV | ro)?;
        }
        Ok(())
    }

    /// /proc, /dev, /tmp and /sys of the container's own.
    pub(super) fn own_dirs(&mut self) -> Result<()> {
        let at = |p: &str| self.root.join(p);
        for d in OWN {
            std::fs::create_dir(at(d)).map_err(err("making", &at(d)))?;
        }
        self.ours.extend([at("tmp"), at("dev")]);
        let proc = at("proc");
        rustix::mount::mount(
            "proc",
            &proc,
            "proc",
            MountFlags::NOSUID | MountFlags::NODEV | MountFlags::NOEXEC,
            None,
        )
        .map_err(errno("mounting proc on", &proc))?;
        let sys = at("sys");
        rustix::mount::mount_bind_recursive("/sys", &sys).map_err(errno("binding", &sys))?;
        restrict(&sys, RDONLY | NOSUID | NODEV | NOEXEC)?;
        tmpfs(&at("tmp"), "mode=1777")?;
        let dev = at("dev");
        tmpfs(&dev, "mode=0755")?;
        for d in DEVICES {
            let host = Path::new("/dev").join(d);
            if !host.exists() {
                continue;
            }
            let node = dev.join(d);
            std::fs::File::create(&node).map_err(err("making", &node))?;
            rustix::mount::mount_bind(&host, &node).map_err(errno("binding", &node))?;
        }
        let shm = dev.join("shm");
        std::fs::create_dir(&shm).map_err(err("making", &shm))?;
        tmpfs(&shm, "mode=1777")?;
        for (name, target) in [
            ("fd", "/proc/self/fd"),
            ("stdin", "/proc/self/fd/0"),
            ("stdout", "/proc/self/fd/1"),
            ("stderr", "/proc/self/fd/2"),
        ] {
            let link = dev.join(name);
            std::os::unix::fs::symlink(target, &link).map_err(err("linking", &link))?;
        }
        Ok(())
    }

    /// The host path in the root where `target` (as the container sees it)
    /// is mounted, made if missing: a directory when `dir`, else an empty
    /// file. Links on the way resolve within the root, never out of it.
    pub(super) fn mount_point(&mut self, target: &Path, dir: bool) -> Result<PathBuf> {
        let mut rest: Vec<std::ffi::OsString> = Vec::new();
        push_components(&mut rest, target)?;
        rest.reverse();
        let mut at = self.root.to_owned();
        let mut hops = 0;
        while let Some(part) = rest.pop() {
            if part == ".." {
                if at != self.root {
                    at.pop();
                }
                continue;
            }
            let next = at.join(&part);
            match next.symlink_metadata() {
                Ok(m) if m.file_type().is_symlink() => {
                    hops += 1;
                    if hops > 40 {
                        return Err(IsolationError::Invalid(format!(
                            "{}: too many links",
                            target.display()
                        )));
                    }
                    let link = std::fs::read_link(&next).map_err(err("reading", &next))?;
                    if link.is_absolute() {
                        at = self.root.to_owned();
                    }
                    let mut more = Vec::new();
                    push_components(&mut more, &link)?;
                    rest.extend(more.into_iter().rev());
                }
                Ok(m) if m.is_dir() => at = next,
                Ok(_) if rest.is_empty() && !dir => at = next,
                Ok(_) => {
                    return Err(IsolationError::Invalid(format!(
                        "{} is not a directory in the container",
                        target.display()
                    )));
                }
                Err(_) => {
                    self.writable(&at)?;
                    if rest.is_empty() && !dir {
                        std::fs::File::create(&next).map_err(err("making", &next))?;
                    } else {
                        std::fs::create_dir(&next).map_err(err("making", &next))?;
                        self.ours.push(next.clone());
                    }
                    at = next;
                }
            }
        }
        Ok(at)
    }

    /// Makes directory `dir` of the root writable for new entries: it is in
    /// a tmpfs already, or it is covered with one that binds what it held.
    pub(super) fn writable(&mut self, dir: &Path) -> Result<()> {
        if self.ours.iter().any(|o| o == dir) {
            return Ok(());
        }
        // What the directory holds stays reachable through its handle once covered.
        let held = std::fs::File::open(dir).map_err(err("opening", dir))?;
        let meta = held.metadata().map_err(err("reading", dir))?;
        use std::os::unix::fs::MetadataExt;
        tmpfs(
            dir,
            &format!(
                "mode={:o},uid={},gid={}",
                meta.mode() & 0o7777,
                meta.uid(),
                meta.gid()
            ),
        )?;
        self.covers.push(dir.to_owned());
        self.ours.push(dir.to_owned());
        let from = PathBuf::from(format!("/proc/self/fd/{}", held.as_raw_fd()));
        self.replicate(&from, dir, &[])
    }
}

/// Pushes the normal components of `path` (and `..`) onto `out`.
fn push_components(out: &mut Vec<std::ffi::OsString>, path: &Path) -> Result<()> {
    for c in path.components() {
        match c {
            Component::Normal(p) => out.push(p.to_owned()),
            Component::ParentDir => out.push("..".into()),
            Component::RootDir | Component::CurDir => {}
            Component::Prefix(_) => {
                return Err(IsolationError::Invalid(format!(
                    "{}: not a Unix path",
                    path.display()
                )));
            }
        }
    }
    Ok(())
}
