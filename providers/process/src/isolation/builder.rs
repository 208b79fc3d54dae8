//! The builder of a container's root: the host's tree bound (read-only by
//! default) beneath a tmpfs, what the container has of its own, and mount
//! points made in tmpfs covers, never in the host's directories.

use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
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
    /// Where the Pod's volumes are mounted in the root: what lies beneath
    /// one the Pod writes, and may change while the root is built.
    pub(super) volume_roots: Vec<PathBuf>,
}

/// Where something is mounted in the container's root: a path of the
/// root that only this builder reaches, or a place inside one of the Pod's
/// volumes, held open (reached and made by descriptors, never by name).
pub(super) enum Target {
    Path(PathBuf),
    InVolume(OwnedFd),
}

impl Builder<'_> {
    /// Fills the (empty, writable) directory `to` with binds of what `from`
    /// holds, but `skip`: directories and files are bound, links copied.
    /// Each entry is opened (without following it) before it is looked at
    /// and bound through that handle: what `from` holds may be a place
    /// others write, and a name swapped for a link between the look and the
    /// bind would bind what the link points to.
    pub(super) fn replicate(&mut self, from: &Path, to: &Path, skip: &[&str]) -> Result<()> {
        use rustix::fs::{FileType, Mode, OFlags};
        let dir = rustix::fs::open(
            from,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(errno("reading", from))?;
        let names = super::entry_names(&dir).map_err(errno("reading", from))?;
        for name in names.into_iter().filter(|n| !skip.iter().any(|s| n == *s)) {
            let (src, dst) = (from.join(&name), to.join(&name));
            let held = match rustix::fs::openat(
                &dir,
                &name,
                OFlags::PATH | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                Mode::empty(),
            ) {
                Ok(fd) => fd,
                // Gone since it was listed: nothing to show.
                Err(rustix::io::Errno::NOENT) => continue,
                Err(e) => return Err(errno("opening", &src)(e)),
            };
            let kind = rustix::fs::fstat(&held)
                .map(|st| FileType::from_raw_mode(st.st_mode))
                .map_err(errno("reading", &src))?;
            if kind == FileType::Symlink {
                let target = rustix::fs::readlinkat(&dir, &name, Vec::new())
                    .map_err(errno("reading", &src))?;
                let target = std::ffi::OsStr::from_bytes(target.as_bytes());
                std::os::unix::fs::symlink(target, &dst).map_err(err("linking", &dst))?;
                continue;
            }
            if kind == FileType::Directory {
                std::fs::create_dir(&dst).map_err(err("making", &dst))?;
            } else {
                std::fs::File::create(&dst).map_err(err("making", &dst))?;
            }
            let source = PathBuf::from(format!("/proc/self/fd/{}", held.as_raw_fd()));
            rustix::mount::mount_bind_recursive(&source, &dst).map_err(errno("binding", &dst))?;
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
    /// file. Links on the way resolve within the root, never out of it. Only
    /// for places no volume holds (see [`Builder::resolve`]).
    pub(super) fn mount_point(&mut self, target: &Path, dir: bool) -> Result<PathBuf> {
        match self.resolve(target, dir)? {
            Target::Path(at) => Ok(at),
            Target::InVolume(_) => Err(IsolationError::Invalid(format!(
                "{} lies in a volume",
                target.display()
            ))),
        }
    }

    /// Where `target` (as the container sees it) is mounted, made if
    /// missing: a directory when `dir`, else an empty file. Links on the way
    /// resolve within the root, never out of it; past a volume's mount
    /// point, what the Pod wrote is walked by descriptors, no link followed,
    /// and what is missing is made in the volume, as a runtime makes a mount
    /// point in its rootfs.
    pub(super) fn resolve(&mut self, target: &Path, dir: bool) -> Result<Target> {
        let mut rest: Vec<std::ffi::OsString> = Vec::new();
        push_components(&mut rest, target)?;
        rest.reverse();
        let mut at = self.root.to_owned();
        let mut hops = 0;
        while let Some(part) = rest.pop() {
            if self.volume_roots.contains(&at) {
                rest.push(part);
                rest.reverse();
                return in_volume(&at, &rest, dir, target).map(Target::InVolume);
            }
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
        Ok(Target::Path(at))
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

/// `parts` beneath the volume mounted at `volume`, each opened beneath the
/// one before without following a link (a link there is refused: the Pod
/// wrote it), the missing ones made there (root's, as a runtime makes
/// them): a directory, or for the last part an empty file unless `dir`.
fn in_volume(
    volume: &Path,
    parts: &[std::ffi::OsString],
    dir: bool,
    target: &Path,
) -> Result<OwnedFd> {
    use super::StepError;
    use rustix::fs::{Mode, OFlags};
    let mut cur = rustix::fs::open(
        volume,
        OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(errno("opening", volume))?;
    let refuse = |why: &str| {
        IsolationError::Invalid(format!(
            "mount point {}: {why} in the volume at {}",
            target.display(),
            volume.display()
        ))
    };
    for (i, name) in parts.iter().enumerate() {
        if name == ".." {
            return Err(refuse("`..`"));
        }
        let want_dir = i + 1 < parts.len() || dir;
        cur = match super::open_or_make(&cur, name, want_dir) {
            Ok((fd, _)) => fd,
            Err(StepError::Link) => return Err(refuse("a link")),
            Err(StepError::NotDirectory) => return Err(refuse("not a directory")),
            Err(StepError::NotFile) => return Err(refuse("not a regular file")),
            Err(StepError::Io(e)) => return Err(errno("making", target)(e)),
        };
    }
    Ok(cur)
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
