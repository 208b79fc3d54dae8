//! With namespaces: what each container's mount namespace holds (its mount
//! plan, read by the launcher as root) and the Pod's /etc files.

use std::path::{Path, PathBuf};

use vkd_provider::{InstanceSpec, VolumeSource};

use crate::ProcessProvider;
use crate::sandbox::{self, Launch, Sandbox};

impl ProcessProvider {
    /// With namespaces: each launch's mount plan and the Pod's /etc files,
    /// root's, read by the launcher as root before it drops to the Pod's user.
    pub(super) fn write_mount_plans(
        &self,
        sb: &Sandbox,
        spec: &InstanceSpec,
        launches: &[Launch],
        pod_ip: Option<&str>,
    ) -> std::io::Result<()> {
        let etc = sb.etc();
        std::fs::create_dir_all(&etc)?;
        std::fs::create_dir_all(sb.rootfs())?;
        std::fs::create_dir_all(sb.termination_dir())?;
        std::fs::create_dir_all(sb.mount_plan(0).parent().unwrap_or(&sb.dir))?;
        let hostname = pod_hostname(&spec.pod.name);
        // The kubelet's managed file: the Pod's IP names the Pod (the
        // loopback does, where it shares the host's network).
        let own = pod_ip.unwrap_or("127.0.0.1");
        let hosts = format!(
            "# Kubernetes-managed hosts file.\n127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n\
             fe00::0\tip6-localnet\nfe00::1\tip6-allnodes\nfe00::2\tip6-allrouters\n{own}\t{hostname}\n"
        );
        // The host's resolver, which a Pod on a node network reaches too.
        let resolv = std::fs::read("/etc/resolv.conf").unwrap_or_default();
        for (name, data) in [
            ("hosts", hosts.as_bytes()),
            ("hostname", format!("{hostname}\n").as_bytes()),
            ("resolv.conf", &resolv),
        ] {
            sandbox::write_atomic(&etc.join(name), data, 0o644)?;
        }
        let specs = spec.init_containers.iter().chain(&spec.containers);
        for (i, (c, l)) in specs.zip(launches).enumerate() {
            self.write_mount_plan(sb, spec, c, l, pod_ip.is_some(), &sb.mount_plan(i))?;
        }
        Ok(())
    }

    /// Container `c`'s mount plan (see [`mount_plan`]), in the Pod's network
    /// namespace where it has one (`own_network`), written to `to`.
    pub(crate) fn write_mount_plan(
        &self,
        sb: &Sandbox,
        spec: &InstanceSpec,
        c: &vkd_provider::ContainerSpec,
        l: &Launch,
        own_network: bool,
        to: &Path,
    ) -> std::io::Result<()> {
        let mut plan = mount_plan(self, sb, spec, c, l, &pod_hostname(&spec.pod.name));
        if spec.user_namespace {
            let (uid, gid) = self.inner.run_as;
            let mut map = crate::isolation::IdentityMap {
                uids: vec![uid],
                gids: std::iter::once(gid).chain(spec.fs_group).collect(),
            };
            // The owners of the image's setuid and setgid programs that keep
            // their bits: the kernel honours the bits only where both the
            // file's user and group are mapped.
            for b in plan.binds.iter().filter(|b| b.allow_suid) {
                use std::os::unix::fs::MetadataExt;
                if let Ok(m) = std::fs::metadata(&b.source)
                    && m.mode() & 0o6000 != 0
                {
                    map.uids.push(m.uid());
                    map.gids.push(m.gid());
                }
            }
            plan.user_namespace = Some(map);
        }
        if let Some(net) = &self.inner.network {
            // No container holds another Pod's network namespace alive.
            plan.detach.push(net.netns_dir().to_owned());
            if own_network {
                plan.netns = Some(net.netns_dir().join(&spec.pod.uid));
            }
        }
        if let Some(dir) = to.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let json = serde_json::to_vec(&plan).map_err(std::io::Error::other)?;
        sandbox::write_atomic(to, &json, 0o600)
    }
}

/// The Pod's hostname as the kubelet makes it: its name, cut to 63
/// characters without a trailing `-` or `.` (a hostname is at most 64 bytes).
fn pod_hostname(name: &str) -> String {
    let cut: String = name.chars().take(63).collect();
    cut.trim_end_matches(['-', '.']).to_owned()
}

/// What container `c` sees (see `isolation`): the Pod's /etc files, its
/// volumes at their mountPaths (parents first; a volume at /etc/hosts wins
/// over the Pod's file, as under the kubelet), and its termination message
/// file. Nothing else of the sandbox: the directory that holds the volumes
/// is vkd's, and a container that could rename a volume there could put a
/// link in its place for the next container's bind to follow.
fn mount_plan(
    p: &ProcessProvider,
    sb: &Sandbox,
    spec: &InstanceSpec,
    c: &vkd_provider::ContainerSpec,
    l: &Launch,
    hostname: &str,
) -> crate::isolation::MountPlan {
    use crate::isolation::Bind;
    let bind = |source: PathBuf, target: PathBuf, read_only: bool| Bind {
        source,
        target,
        read_only,
        optional: false,
        within: None,
        allow_suid: false,
    };
    let mut binds = Vec::new();
    for f in ["hosts", "hostname", "resolv.conf"] {
        binds.push(bind(sb.etc().join(f), Path::new("/etc").join(f), false));
    }
    let image = p.inner.config.image(&c.image);
    // The programs an image maps to are where they are on the host, even
    // under /tmp, which is the container's own: their directories are shown
    // there, read-only. Only what the operator's image mapping names (its
    // PATH and entrypoint), never the Pod's own PATH or command: nothing a
    // Pod writes chooses what is mounted into it.
    let state = std::fs::canonicalize(&p.inner.dir).unwrap_or_else(|_| p.inner.dir.clone());
    for d in image.map(|i| image_dirs(i, &state)).unwrap_or_default() {
        binds.push(bind(d.clone(), d, true));
    }
    // The image's own files, read-only; a volume at the same path wins. A
    // setuid program among them keeps its bit only when root does not own
    // it (no Pod becomes host root through its image).
    if let Some(image) = image {
        for (at, source) in &image.files {
            binds.push(Bind {
                allow_suid: suid_allowed(source),
                ..bind(source.clone(), at.clone(), true)
            });
        }
    }
    let mut mounts: Vec<&vkd_provider::Mount> = c.mounts.iter().collect();
    mounts.sort_by_key(|m| Path::new(&m.path).components().count());
    for m in &mounts {
        let source = spec.volumes.iter().find(|v| v.name == m.volume);
        let volume = match source.map(|v| &v.source) {
            // The operator allowed the path (`--allow-host-path`): what it
            // names now, its links resolved here, by vkd.
            Some(VolumeSource::HostPath { path }) => {
                std::fs::canonicalize(path).unwrap_or_else(|_| PathBuf::from(path))
            }
            _ => sb.volumes().join(&m.volume),
        };
        // The kubelet mounts what it writes from the API read-only, whatever
        // the spec says (a Pod that rewrote its Secret's files would read
        // its own words as the Secret's).
        let api_data = matches!(source.map(|v| &v.source), Some(VolumeSource::Files { .. }));
        let mut source = volume.clone();
        if let Some(sub) = &m.sub_path {
            source.push(sub);
        }
        // A volume the Pod writes may hold links: the bind never leaves it
        // (the launcher opens the volume without following a link, then the
        // subPath beneath it).
        binds.push(Bind {
            within: Some(volume),
            ..bind(source, PathBuf::from(&m.path), m.read_only || api_data)
        });
    }
    // The message file is the shim's, in the sandbox; one under a volume is
    // the volume's own file already.
    if let Some(rel) = &l.termination_log
        && sandbox::own_termination_file(c, rel)
    {
        binds.push(Bind {
            optional: true,
            ..bind(
                sb.termination_dir().join(&c.name),
                Path::new("/").join(rel),
                false,
            )
        });
    }
    crate::isolation::MountPlan {
        root: sb.rootfs(),
        host_root_read_only: p.inner.config.host_root_read_only,
        hostname: hostname.to_owned(),
        hide: vec![p.inner.dir.clone()],
        binds,
        working_dir: Some(l.cwd.clone()),
        netns: None,
        detach: Vec::new(),
        user_namespace: None,
    }
}

/// The directories under the host's /tmp that an image mapping names (its
/// `path` and its entrypoint's directory), resolved: what a container's own
/// /tmp would hide. A name that resolves elsewhere (`/tmp/../proc`) or into
/// vkd's state is not one of them.
fn image_dirs(image: &crate::config::ImageMap, state: &Path) -> Vec<PathBuf> {
    let entry = image
        .entrypoint
        .first()
        .and_then(|p| Path::new(p).parent().map(Path::to_owned));
    let mut dirs: Vec<PathBuf> = image
        .search_path()
        .split(':')
        .map(PathBuf::from)
        .chain(entry)
        .filter_map(|d| std::fs::canonicalize(d).ok())
        .filter(|d| {
            d.starts_with("/tmp") && d != Path::new("/tmp") && !d.starts_with(state) && d.is_dir()
        })
        .collect();
    dirs.sort();
    dirs.dedup();
    dirs
}

/// Whether an image's file may keep a setuid or setgid bit: not when root
/// (uid or gid 0) would be what it gives.
fn suid_allowed(source: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(source).is_ok_and(|m| {
        let (setuid, setgid) = (m.mode() & 0o4000 != 0, m.mode() & 0o2000 != 0);
        let gives_root = (setuid && m.uid() == 0) || (setgid && m.gid() == 0);
        !gives_root
    })
}

#[cfg(test)]
mod tests {
    use super::pod_hostname;

    #[test]
    fn a_hostname_is_cut_as_the_kubelet_cuts_it() {
        assert_eq!(pod_hostname("web-0"), "web-0");
        let long = format!("{}-{}", "a".repeat(62), "b".repeat(10));
        assert_eq!(pod_hostname(&long), "a".repeat(62));
        assert_eq!(pod_hostname(&"c".repeat(80)).len(), 63);
    }
}
