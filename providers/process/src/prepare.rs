//! Admission-time resolution of what each container runs (argv, environment,
//! working directory) and the building of a fresh sandbox: volumes and the
//! mount links under the Pod's root.

use std::path::{Path, PathBuf};

use vkd_provider::{InstanceSpec, ProviderError, Result, VolumeSource};

use crate::ProcessProvider;
use crate::sandbox::{self, Launch, Sandbox};

mod plan;

/// The GPUs a container may use, as CUDA and NVIDIA's container runtime read them.
const CUDA_VISIBLE: &str = "CUDA_VISIBLE_DEVICES";
const NVIDIA_VISIBLE: &str = "NVIDIA_VISIBLE_DEVICES";

impl ProcessProvider {
    /// Resolves what each container runs: argv, environment, working directory.
    /// `isolated`: the containers get namespaces (`isolation`), so a
    /// workingDir is the path the spec names, not one under the Pod's root.
    pub(crate) fn launches(
        &self,
        spec: &InstanceSpec,
        root: &Path,
        isolated: bool,
    ) -> Result<Vec<Launch>> {
        if spec.user_namespace && !self.inner.user_namespaces {
            return Err(ProviderError::invalid(
                "UserNamespacesUnsupported",
                "the Pod asks for hostUsers: false, and this node gives containers no user \
                 namespaces (it needs isolation: namespaces and a kernel that allows them)",
            ));
        }
        let mut out = Vec::new();
        for c in spec.init_containers.iter().chain(&spec.containers) {
            let image = self.inner.config.image(&c.image).ok_or_else(|| {
                ProviderError::invalid(
                    vkd_provider::IMAGE_NOT_RUNNABLE,
                    format!(
                        "container {}: image {:?} is not mapped to anything runnable on this host; \
                         add it to images in the process provider config",
                        c.name, c.image
                    ),
                )
            })?;
            let argv = image.argv(&c.command, &c.args);
            if argv.is_empty() {
                return Err(ProviderError::invalid(
                    vkd_provider::IMAGE_NOT_RUNNABLE,
                    format!(
                        "container {}: no command, and image {:?} has no entrypoint in the process provider config",
                        c.name, c.image
                    ),
                ));
            }
            let cwd = match &c.working_dir {
                Some(wd) => {
                    // Inside the Pod's root, as mountPath: `..` would leave it.
                    let rel = Path::new(wd.trim_start_matches('/'));
                    if rel.components().any(|p| {
                        !matches!(
                            p,
                            std::path::Component::Normal(_) | std::path::Component::CurDir
                        )
                    }) {
                        return Err(ProviderError::invalid(
                            "InvalidSpec",
                            format!(
                                "container {}: workingDir {wd:?} leaves the Pod's root",
                                c.name
                            ),
                        ));
                    }
                    // With namespaces, the path the spec names, as a runtime's.
                    if isolated {
                        Path::new("/").join(rel)
                    } else {
                        root.join(rel)
                    }
                }
                None if isolated => PathBuf::from("/"),
                None => root.to_owned(),
            };
            // With namespaces the Pod's root is the container's own `/`:
            // nothing of the sandbox on the host is shown in a container.
            let own_root = if isolated {
                "/".to_owned()
            } else {
                root.display().to_string()
            };
            let mut env: Vec<(String, String)> = vec![
                ("PATH".into(), image.search_path().to_owned()),
                ("HOME".into(), own_root.clone()),
                ("HOSTNAME".into(), spec.pod.name.clone()),
            ];
            for (k, v) in &c.env {
                env.retain(|(n, _)| n != k);
                env.push((k.clone(), v.clone()));
            }
            if !self.inner.config.gpus.is_empty() {
                // On a GPU host the GPUs a container sees are vkd's placement,
                // never the Pod's own env (which could name them all).
                let ids = spec
                    .placement
                    .as_ref()
                    .map(|p| p.gpu_ids.join(","))
                    .unwrap_or_default();
                env.retain(|(n, _)| n != CUDA_VISIBLE && n != NVIDIA_VISIBLE);
                env.push((
                    NVIDIA_VISIBLE.into(),
                    if ids.is_empty() {
                        "void".into()
                    } else {
                        ids.clone()
                    },
                ));
                env.push((CUDA_VISIBLE.into(), ids));
            }
            env.push(("VKD_POD_ROOT".into(), own_root.clone()));
            let own = [("VKD_POD_ROOT".to_owned(), own_root)];
            let argv: Vec<String> = argv.iter().map(|a| expand_own(a, &own)).collect();
            let program = &argv[0];
            let path = env
                .iter()
                .rev()
                .find(|(k, _)| k == "PATH")
                .map_or(image.search_path(), |(_, v)| v.as_str());
            let resolved = if program.contains('/') {
                let p = if Path::new(program).is_absolute() {
                    PathBuf::from(program)
                } else {
                    cwd.join(program)
                };
                // A relative program may come from a volume that exists only
                // once materialized; with namespaces an absolute one may be
                // one of the image's files, bound at its path.
                let image_file = image
                    .files
                    .get(Path::new(program))
                    .filter(|_| isolated)
                    .is_some_and(|source| is_executable(source));
                if Path::new(program).is_absolute() && !is_executable(&p) && !image_file {
                    return Err(not_found(&c.name, program, path, &c.image));
                }
                p
            } else {
                path.split(':')
                    .map(|d| Path::new(d).join(program))
                    .find(|p| is_executable(p))
                    .ok_or_else(|| not_found(&c.name, program, path, &c.image))?
            };
            let mut argv = argv;
            argv[0] = resolved.display().to_string();
            out.push(Launch {
                name: c.name.clone(),
                argv,
                env,
                cwd,
                termination_log: termination_log(c.termination_message_path()),
            });
        }
        Ok(out)
    }

    /// Gives the finished Pod root and volumes to the run-as user, depth first,
    /// never through a link: every directory is opened beneath the one
    /// above it without following a link (`O_NOFOLLOW`), and every owner set
    /// on the name within its opened directory (`AT_SYMLINK_NOFOLLOW`), so a
    /// link swapped in for a directory mid-walk ends the walk there instead
    /// of handing over what it points to. `owner` says who gets each path
    /// other than the run-as user: a volume's fsGroup, a subPath directory
    /// that stays root's.
    fn hand_over(
        &self,
        dir: &Path,
        owner: &dyn Fn(&Path) -> Option<(u32, u32)>,
    ) -> std::io::Result<()> {
        let (Some(parent), Some(name)) = (dir.parent(), dir.file_name()) else {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("{} has no parent", dir.display()),
            ));
        };
        let parent = rustix::fs::open(
            parent,
            rustix::fs::OFlags::RDONLY
                | rustix::fs::OFlags::DIRECTORY
                | rustix::fs::OFlags::CLOEXEC,
            rustix::fs::Mode::empty(),
        )?;
        self.hand_over_at(&parent, name, dir, owner)
    }

    fn hand_over_at(
        &self,
        parent: &std::os::fd::OwnedFd,
        name: &std::ffi::OsStr,
        path: &Path,
        owner: &dyn Fn(&Path) -> Option<(u32, u32)>,
    ) -> std::io::Result<()> {
        use rustix::fs::{AtFlags, FileType, Mode, OFlags};
        let st = rustix::fs::statat(parent, name, AtFlags::SYMLINK_NOFOLLOW)?;
        if FileType::from_raw_mode(st.st_mode) == FileType::Directory {
            let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
            let dir = rustix::fs::openat(parent, name, flags, Mode::empty())?;
            for n in crate::isolation::entry_names(&dir)? {
                self.hand_over_at(&dir, &n, &path.join(&n), owner)?;
            }
        }
        let (u, g) = owner(path).unwrap_or(self.inner.run_as);
        rustix::fs::chownat(
            parent,
            name,
            Some(rustix::fs::Uid::from_raw(u)),
            Some(rustix::fs::Gid::from_raw(g)),
            AtFlags::SYMLINK_NOFOLLOW,
        )?;
        Ok(())
    }

    fn mkdirs(&self, base: &Path, rel: &Path) -> std::io::Result<PathBuf> {
        let mut p = base.to_owned();
        for part in rel.components() {
            if let std::path::Component::Normal(s) = part {
                p.push(s);
                if !p.exists() {
                    std::fs::create_dir(&p)?;
                }
            }
        }
        Ok(p)
    }

    /// Writes volumes and mount links into a fresh sandbox.
    pub(crate) fn materialize(
        &self,
        sb: &Sandbox,
        spec: &InstanceSpec,
        launches: &[Launch],
        pod_ip: Option<&str>,
    ) -> Result<()> {
        use std::os::unix::fs::PermissionsExt;
        let e = |e: std::io::Error| ProviderError::transient(format!("building the sandbox: {e}"));
        for d in [sb.root(), sb.volumes()] {
            std::fs::create_dir_all(&d).map_err(e)?;
        }
        for v in &spec.volumes {
            let vdir = sb.volumes().join(&v.name);
            match &v.source {
                VolumeSource::HostPath { path } => {
                    std::os::unix::fs::symlink(path, &vdir).map_err(e)?;
                }
                VolumeSource::EmptyDir { size_limit, memory } => {
                    std::fs::create_dir_all(&vdir).map_err(e)?;
                    // medium: Memory, where vkd may mount (with namespaces): a
                    // tmpfs of sizeLimit, else of the host's memory, as the
                    // kubelet sizes it. Without, a directory (documented).
                    if *memory && self.inner.isolated {
                        // As the kubelet sizes it: the smallest of sizeLimit,
                        // the Pod's memory limit (where every container has
                        // one) and the host's memory. A tmpfs's pages are not
                        // charged where limits are rlimits, so without this a
                        // Pod could fill the host's memory through it.
                        let host = crate::procfs::mem_total().filter(|m| *m > 0);
                        let size = [*size_limit, pod_memory_limit(spec), host]
                            .into_iter()
                            .flatten()
                            .min();
                        crate::isolation::mount_tmpfs(&vdir, size).map_err(|err| {
                            ProviderError::transient(format!("building the sandbox: {err}"))
                        })?;
                    }
                }
                VolumeSource::Files { files } => {
                    std::fs::create_dir_all(&vdir).map_err(e)?;
                    for f in files {
                        let rel = Path::new(&f.path);
                        let parent = rel.parent().unwrap_or(Path::new(""));
                        let dir = self.mkdirs(&vdir, parent).map_err(e)?;
                        let target = dir.join(rel.file_name().unwrap_or_default());
                        sandbox::write_atomic(&target, &f.data, f.mode).map_err(e)?;
                        std::fs::set_permissions(&target, std::fs::Permissions::from_mode(f.mode))
                            .map_err(e)?;
                    }
                }
                other => {
                    return Err(ProviderError::invalid(
                        "UnsupportedVolume",
                        format!(
                            "volume {:?}: the process provider does not know the kind {other:?}",
                            v.name
                        ),
                    ));
                }
            }
        }
        // subPath directories vkd makes in an emptyDir, which stay root's, as
        // the kubelet makes them (see below).
        let mut sub_dirs: Vec<(String, PathBuf)> = Vec::new();
        for c in spec.init_containers.iter().chain(&spec.containers) {
            for m in &c.mounts {
                let mut target = sb.volumes().join(&m.volume);
                if let Some(sub) = &m.sub_path {
                    if sub.split('/').any(|s| s == "..") || sub.starts_with('/') {
                        return Err(ProviderError::invalid(
                            "InvalidSpec",
                            format!("container {}: subPath {sub:?} leaves the volume", c.name),
                        ));
                    }
                    target = target.join(sub);
                    let base = sb.volumes().join(&m.volume);
                    let empty_dir = spec.volumes.iter().any(|v| {
                        v.name == m.volume && matches!(v.source, VolumeSource::EmptyDir { .. })
                    });
                    let made = make_sub_path(&base, Path::new(sub)).map_err(|err| {
                        ProviderError::invalid(
                            "InvalidSpec",
                            format!("container {}: subPath {sub:?}: {err}", c.name),
                        )
                    })?;
                    if empty_dir {
                        sub_dirs.extend(made.into_iter().map(|d| (m.volume.clone(), d)));
                    }
                }
                let rel = Path::new(m.path.trim_start_matches('/'));
                if rel
                    .components()
                    .any(|c| matches!(c, std::path::Component::ParentDir))
                    || rel.as_os_str().is_empty()
                {
                    return Err(ProviderError::invalid(
                        "InvalidSpec",
                        format!("container {}: mountPath {:?}", c.name, m.path),
                    ));
                }
                // With namespaces each container mounts at its own paths
                // (its mount plan); the links serve only the Pod's root
                // without them, where containers share one. (Made with
                // namespaces too, a link for /data/conf would land in the
                // volume at /data, a host path for the Pod to follow.)
                if self.inner.isolated {
                    continue;
                }
                let parent = rel.parent().unwrap_or(Path::new(""));
                let dir = self.mkdirs(&sb.root(), parent).map_err(e)?;
                let link = dir.join(rel.file_name().unwrap_or_default());
                match std::fs::read_link(&link) {
                    Ok(existing) if existing == target => continue,
                    Ok(_) | Err(_) if link.symlink_metadata().is_ok() => {
                        return Err(ProviderError::invalid(
                            "InvalidSpec",
                            format!(
                                "container {}: mountPath {} is taken by another mount",
                                c.name, m.path
                            ),
                        ));
                    }
                    _ => {}
                }
                std::os::unix::fs::symlink(&target, &link).map_err(e)?;
            }
        }
        for l in launches {
            if let Ok(rel) = l.cwd.strip_prefix(sb.root()) {
                self.mkdirs(&sb.root(), rel).map_err(e)?;
            }
        }
        // The directory of each termination message file; the shim makes the
        // file itself, empty, before each run. A path through a mount (a link)
        // gets none: the shim reads and writes it only through real directories.
        for rel in launches.iter().filter_map(|l| l.termination_log.as_deref()) {
            let mut dir = sb.root();
            for part in rel.parent().into_iter().flat_map(Path::components) {
                dir.push(part);
                match dir.symlink_metadata() {
                    Ok(m) if m.is_dir() => {}
                    Ok(_) => break,
                    Err(_) => std::fs::create_dir(&dir).map_err(e)?,
                }
            }
        }
        // Modes first, while the tree is root's alone: a mode set after the
        // hand-over would follow a link the Pod's user put in its place.
        for v in &spec.volumes {
            let vdir = sb.volumes().join(&v.name);
            let mode = match v.source {
                // An emptyDir is open to every user of the Pod, as the kubelet
                // makes it; a memory one is a tmpfs root, sticky as the
                // kubelet's is. With fsGroup it is setgid (and the group's,
                // below), so what the Pod makes in it is the group's too.
                VolumeSource::EmptyDir { memory, .. } => {
                    let sticky = if memory && self.inner.isolated {
                        0o1000
                    } else {
                        0
                    };
                    let setgid = if spec.fs_group.is_some() { 0o2000 } else { 0 };
                    0o777 | sticky | setgid
                }
                // The files keep the Pod's modes (0644 by default, Secrets
                // too), so the directory keeps everyone but the Pod's user
                // out. With fsGroup the files are readable by the group, as
                // the kubelet gives them (the directory still keeps the
                // host's users out).
                VolumeSource::Files { ref files } => {
                    if spec.fs_group.is_some() {
                        for f in files {
                            // Where the file was written: its path's names only.
                            let rel: PathBuf = Path::new(&f.path)
                                .components()
                                .filter(|c| matches!(c, std::path::Component::Normal(_)))
                                .collect();
                            let mode = std::fs::Permissions::from_mode((f.mode & 0o777) | 0o440);
                            std::fs::set_permissions(vdir.join(rel), mode).map_err(e)?;
                        }
                    }
                    0o700
                }
                // Refused when the sandbox was filled (above).
                _ => continue,
            };
            // A subPath directory the kubelet makes has the volume's mode,
            // set before the volume opens to others (chmod follows a link).
            for (_, dir) in sub_dirs.iter().filter(|(name, _)| *name == v.name) {
                std::fs::set_permissions(dir, std::fs::Permissions::from_mode(mode)).map_err(e)?;
            }
            std::fs::set_permissions(&vdir, std::fs::Permissions::from_mode(mode)).map_err(e)?;
        }
        self.hand_over(&sb.root(), &|_| None).map_err(e)?;
        // The volumes are the run-as user's, in fsGroup where the Pod names
        // one; a subPath directory vkd made stays root's, as the kubelet's.
        let (run_as_user, _) = self.inner.run_as;
        let grouped: Vec<PathBuf> = spec
            .volumes
            .iter()
            .filter(|v| !matches!(v.source, VolumeSource::HostPath { .. }))
            .map(|v| sb.volumes().join(&v.name))
            .collect();
        let owner = |p: &Path| {
            let group = spec
                .fs_group
                .filter(|_| grouped.iter().any(|v| p.starts_with(v)));
            if sub_dirs.iter().any(|(_, d)| d == p) {
                Some((0, group.unwrap_or(0)))
            } else {
                group.map(|g| (run_as_user, g))
            }
        };
        // Each volume's, never `volumes/` itself: it stays root's, so no
        // Pod's user can put a link where a volume was.
        for v in &spec.volumes {
            if !matches!(v.source, VolumeSource::HostPath { .. }) {
                self.hand_over(&sb.volumes().join(&v.name), &owner)
                    .map_err(e)?;
            }
        }
        if self.inner.isolated {
            self.write_mount_plans(sb, spec, launches, pod_ip)
                .map_err(e)?;
        }
        Ok(())
    }
}

impl ProcessProvider {
    /// Brings the sandboxes of Pods a vkd before this one made up to what
    /// holds now, with namespaces: no one but root lists a sandbox,
    /// `volumes/` is root's, and each container's mount plan is written
    /// again (the shim reads it at each start), so no container started from
    /// here on sees the sandbox or binds a volume through a link. A volume
    /// the Pod already replaced with a link is refused at its next start,
    /// never followed. Such a Pod's containers keep the environment they
    /// were given (`$VKD_POD_ROOT`, `HOME`: the sandbox's path), which a
    /// container that restarts no longer has: recreate them (docs).
    /// Best effort: what fails is said on stderr and the Pod left as it was.
    pub(crate) fn upgrade_sandboxes(&self) {
        use std::os::unix::fs::PermissionsExt;
        if !self.inner.isolated {
            return;
        }
        let Ok(entries) = std::fs::read_dir(self.pods_dir()) else {
            return;
        };
        for entry in entries.flatten() {
            let Ok(kind) = entry.file_type() else {
                continue;
            };
            if !kind.is_dir() {
                continue;
            }
            let sb = Sandbox::new(entry.path());
            let Ok(Some(shim)) = sb.read_spec() else {
                continue;
            };
            if !shim.isolated {
                continue;
            }
            // A sandbox made 0700 is this vkd's own kind: nothing to do.
            if std::fs::metadata(&sb.dir).is_ok_and(|m| m.permissions().mode() & 0o077 == 0) {
                continue;
            }
            // 0711, not a new sandbox's 0700: a container started before
            // has its sandbox bound in and its HOME there, and keeps both
            // until it restarts; no one but root can list it or replace
            // what is in it.
            let upgraded =
                std::fs::set_permissions(&sb.dir, std::fs::Permissions::from_mode(0o711))
                    .and_then(|()| {
                        let volumes = sb.volumes();
                        match volumes.symlink_metadata() {
                            Ok(m) if m.is_dir() => {
                                std::os::unix::fs::lchown(&volumes, Some(0), Some(0))?;
                                std::fs::set_permissions(
                                    &volumes,
                                    std::fs::Permissions::from_mode(0o755),
                                )
                            }
                            // A Pod replaced it: its containers' binds are refused.
                            Ok(_) => std::fs::remove_file(&volumes)
                                .and_then(|()| std::fs::create_dir(&volumes)),
                            Err(_) => Ok(()),
                        }
                    })
                    .and_then(|()| {
                        self.write_mount_plans(
                            &sb,
                            &shim.spec,
                            &shim.containers,
                            shim.pod_ip.as_deref(),
                        )
                    });
            if let Err(e) = upgraded {
                // The provider has no logger of its own; vkd keeps stderr.
                eprintln!(
                    "process provider: the sandbox {} could not be brought up to date: {e}",
                    sb.dir.display()
                );
            }
        }
    }
}

/// Makes what is missing of the subPath `sub` beneath the volume `base`, as
/// the kubelet's `doSafeMakeDir`: what exists is resolved by the kernel
/// beneath the volume (a link there may lead within it, never out), and
/// each missing directory is made beneath the one opened before it, no link
/// followed. A hostPath may hold what an earlier Pod planted. Returns the
/// directories it made.
fn make_sub_path(base: &Path, sub: &Path) -> std::io::Result<Vec<PathBuf>> {
    use rustix::fs::{Mode, OFlags, ResolveFlags};
    let path_flags = OFlags::PATH | OFlags::CLOEXEC;
    let root = rustix::fs::open(
        base,
        OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    let beneath = ResolveFlags::BENEATH | ResolveFlags::NO_MAGICLINKS;
    match rustix::fs::openat2(&root, sub, path_flags, Mode::empty(), beneath) {
        Ok(_) => return Ok(Vec::new()),
        Err(rustix::io::Errno::NOENT) => {}
        Err(rustix::io::Errno::XDEV) => {
            return Err(std::io::Error::other("it leads out of its volume"));
        }
        // A kernel before openat2: every name walked below, none followed.
        Err(rustix::io::Errno::NOSYS) => {}
        Err(e) => return Err(e.into()),
    }
    let mut made = Vec::new();
    let mut dir = root;
    let mut at = base.to_owned();
    for part in sub.components() {
        let std::path::Component::Normal(name) = part else {
            continue;
        };
        at.push(name);
        use crate::isolation::StepError;
        let fail = |why: &str| std::io::Error::other(format!("{} {why}", at.display()));
        dir = match crate::isolation::open_or_make(&dir, name, true) {
            Ok((fd, fresh)) => {
                if fresh {
                    made.push(at.clone());
                }
                fd
            }
            // What is missing beyond a link is never made through it.
            Err(StepError::Link) => return Err(fail("is a link: nothing is made through it")),
            Err(StepError::NotDirectory | StepError::NotFile) => {
                return Err(fail("is not a directory"));
            }
            Err(StepError::Io(e)) => return Err(e.into()),
        };
    }
    Ok(made)
}

/// The Pod's memory limit, the sum of its containers' where each has one
/// (an init container's alone where it is larger), as the kubelet reckons it.
fn pod_memory_limit(spec: &InstanceSpec) -> Option<u64> {
    let sum = spec
        .containers
        .iter()
        .map(|c| c.limits.memory_bytes)
        .try_fold(0u64, |a, m| Some(a.saturating_add(m?)))?;
    let init = spec
        .init_containers
        .iter()
        .map(|c| c.limits.memory_bytes)
        .try_fold(0u64, |a, m| Some(a.max(m?)))?;
    Some(sum.max(init))
}

/// terminationMessagePath as a path under the Pod's root, resolved the way an
/// absolute path is (`/a/../b` is `/b`); `None` for the root itself.
pub(crate) fn termination_log(path: &str) -> Option<PathBuf> {
    let mut rel = PathBuf::new();
    for part in Path::new(path).components() {
        match part {
            std::path::Component::Normal(p) => rel.push(p),
            std::path::Component::ParentDir => {
                rel.pop();
            }
            _ => {}
        }
    }
    (!rel.as_os_str().is_empty()).then_some(rel)
}

fn expand_own(text: &str, vars: &[(String, String)]) -> String {
    let mut out = text.to_owned();
    for (k, v) in vars {
        out = out.replace(&format!("$({k})"), v);
    }
    out
}

fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

fn not_found(container: &str, program: &str, path: &str, image: &str) -> ProviderError {
    ProviderError::invalid(
        "ExecutableNotFound",
        format!(
            "container {container}: executable {program:?} not found in PATH {path} (image {image:?})"
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::make_sub_path;

    /// A subPath's missing directories are made beneath the volume, never
    /// through a link a Pod planted there (a hostPath keeps what an earlier
    /// Pod left), and one that leads out is refused.
    #[test]
    fn a_sub_path_is_made_beneath_its_volume_and_never_through_a_link() {
        let dir = std::env::temp_dir().join(format!("vkd-sub-path-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let (volume, outside) = (dir.join("volume"), dir.join("outside"));
        std::fs::create_dir_all(volume.join("in")).unwrap();
        std::fs::create_dir_all(&outside).unwrap();
        std::os::unix::fs::symlink(&outside, volume.join("out")).unwrap();
        std::os::unix::fs::symlink("in", volume.join("inside")).unwrap();
        let made = make_sub_path(&volume, std::path::Path::new("a/b")).unwrap();
        assert_eq!(made, [volume.join("a"), volume.join("a/b")]);
        assert!(volume.join("a/b").is_dir());
        // What exists is not made again, through an inside link too.
        assert!(
            make_sub_path(&volume, std::path::Path::new("a/b"))
                .unwrap()
                .is_empty()
        );
        assert!(
            make_sub_path(&volume, std::path::Path::new("inside"))
                .unwrap()
                .is_empty()
        );
        // Out of the volume, by a link: refused, and nothing made there.
        let e = make_sub_path(&volume, std::path::Path::new("out/new")).unwrap_err();
        assert!(e.to_string().contains("leads out"), "{e}");
        assert!(!outside.join("new").exists());
        // Missing beyond an inside link: nothing made through it.
        assert!(make_sub_path(&volume, std::path::Path::new("inside/new")).is_err());
        assert!(!volume.join("in/new").exists());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
