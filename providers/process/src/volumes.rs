//! Refreshing a running Pod's file volumes (configMap, secret, downwardAPI,
//! projected) in place, as the kubelet does when their sources change.
//!
//! A volume's directory belongs to the Pod's user, who may have replaced any
//! part of it with a link to somewhere else by the time the provider (maybe
//! root) writes. So every step goes through directory descriptors opened
//! without following links, and every file is a new one renamed over the old
//! name: nothing outside the volume is ever opened for writing, and a reader
//! sees a file's old bytes or its new ones, never a mix.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Component, Path};

use rustix::fs::{AtFlags, Mode, OFlags};
use vkd_provider::{Fence, ProviderError, Result, Volume, VolumeFile, VolumeSource};

use crate::ProcessProvider;

/// The name temporary files take while they are written: never a key of a
/// ConfigMap or Secret, which cannot start with `..`.
const TMP_PREFIX: &str = "..vkd-tmp-";

fn open_dir(at: impl AsFd, name: &str) -> rustix::io::Result<OwnedFd> {
    rustix::fs::openat(
        at,
        name,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )
}

/// A file path of a volume as its parts; `None` when it could leave the volume.
fn parts(path: &str) -> Option<Vec<&str>> {
    let parts: Vec<&str> = Path::new(path)
        .components()
        .map(|c| match c {
            Component::Normal(p) => p.to_str(),
            _ => None,
        })
        .collect::<Option<_>>()?;
    (!parts.is_empty() && parts.iter().all(|p| !p.starts_with(TMP_PREFIX))).then_some(parts)
}

/// Opens the directory at `dirs` below `vol`, never through a link.
fn open_path(vol: &OwnedFd, dirs: &[&str]) -> rustix::io::Result<OwnedFd> {
    let mut dir = vol.try_clone().map_err(|_| rustix::io::Errno::MFILE)?;
    for d in dirs {
        dir = open_dir(&dir, d)?;
    }
    Ok(dir)
}

/// Removes from `vol` the files vkd wrote before (`old`) that `files` no
/// longer lists, and then the directories that held only them; what the Pod
/// made itself is left alone, and nothing else is walked. Then writes `files`.
fn refresh(
    vol: &OwnedFd,
    old: &[String],
    files: &[VolumeFile],
    owner: (u32, u32),
) -> std::io::Result<()> {
    let invalid = |m: String| std::io::Error::new(std::io::ErrorKind::InvalidInput, m);
    let new: Vec<Vec<&str>> = files
        .iter()
        .map(|f| parts(&f.path).ok_or_else(|| invalid(format!("file path {:?}", f.path))))
        .collect::<Result<_, _>>()?;
    let listed: BTreeSet<&[&str]> = new.iter().map(Vec::as_slice).collect();
    let needed_dirs: BTreeSet<&[&str]> = new
        .iter()
        .flat_map(|p| (1..p.len()).map(move |n| &p[..n]))
        .collect();
    let mut emptied: BTreeSet<Vec<&str>> = BTreeSet::new();
    for gone in old.iter().filter_map(|p| parts(p)) {
        if listed.contains(gone.as_slice()) {
            continue;
        }
        let Some((name, dirs)) = gone.split_last() else {
            continue;
        };
        if let Ok(dir) = open_path(vol, dirs) {
            let _ = rustix::fs::unlinkat(&dir, *name, AtFlags::empty());
        }
        for n in 1..gone.len() {
            if !needed_dirs.contains(&gone[..n]) {
                emptied.insert(gone[..n].to_vec());
            }
        }
    }
    // Deepest first; a directory something else still holds stays.
    for dir in emptied.iter().rev() {
        if let Some((name, parents)) = dir.split_last()
            && let Ok(parent) = open_path(vol, parents)
        {
            let _ = rustix::fs::unlinkat(&parent, *name, AtFlags::REMOVEDIR);
        }
    }
    for (f, parts) in files.iter().zip(&new) {
        let (name, dirs) = parts.split_last().ok_or_else(|| invalid(f.path.clone()))?;
        let mut dir = vol.try_clone()?;
        for d in dirs {
            dir = match open_dir(&dir, d) {
                Ok(fd) => fd,
                Err(rustix::io::Errno::NOENT) => {
                    rustix::fs::mkdirat(&dir, *d, Mode::from_raw_mode(0o755))?;
                    let fd = open_dir(&dir, d)?;
                    rustix::fs::fchown(&fd, Some(uid(owner)), Some(gid(owner)))?;
                    fd
                }
                Err(e) => return Err(e.into()),
            };
        }
        let tmp = format!("{TMP_PREFIX}{name}");
        let _ = rustix::fs::unlinkat(&dir, tmp.as_str(), AtFlags::empty());
        let fd = rustix::fs::openat(
            &dir,
            tmp.as_str(),
            OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::from_raw_mode(0o600),
        )?;
        let mut file = std::fs::File::from(fd);
        file.write_all(&f.data)?;
        // Owner first, then the mode: a set-id bit is never given to root's file.
        rustix::fs::fchown(&file, Some(uid(owner)), Some(gid(owner)))?;
        rustix::fs::fchmod(&file, Mode::from_raw_mode(f.mode & 0o777))?;
        drop(file);
        rustix::fs::renameat(&dir, tmp.as_str(), &dir, *name)?;
    }
    Ok(())
}

fn uid(owner: (u32, u32)) -> rustix::process::Uid {
    rustix::process::Uid::from_raw(owner.0)
}

fn gid(owner: (u32, u32)) -> rustix::process::Gid {
    rustix::process::Gid::from_raw(owner.1)
}

impl ProcessProvider {
    pub(crate) fn update_volumes_blocking(
        &self,
        fence: &Fence,
        uid: &str,
        volumes: &[Volume],
    ) -> Result<()> {
        let _fenced = self.check_fence(fence)?;
        let not_found = || ProviderError::NotFound {
            uid: uid.to_owned(),
        };
        let (sb, rec, _) = self.read(uid)?.ok_or_else(not_found)?;
        if rec.node != fence.node {
            return Err(not_found());
        }
        let spec = sb
            .read_spec()
            .map_err(crate::io_err(&sb.spec()))?
            .ok_or_else(not_found)?;
        let io = |e: std::io::Error| {
            ProviderError::transient(format!("refreshing the volumes of pod {uid}: {e}"))
        };
        let sandbox = rustix::fs::open(
            &sb.dir,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| io(e.into()))?;
        let all = open_dir(&sandbox, "volumes").map_err(|e| io(e.into()))?;
        let mut written: BTreeMap<String, Vec<String>> =
            crate::sandbox::read_json(&sb.volume_files())
                .map_err(crate::io_err(&sb.volume_files()))?
                .unwrap_or_default();
        let save = |written: &BTreeMap<String, Vec<String>>| {
            crate::sandbox::write_json(&sb.volume_files(), written, 0o600)
                .map_err(crate::io_err(&sb.volume_files()))
        };
        for v in volumes {
            let VolumeSource::Files { files } = &v.source else {
                continue;
            };
            // Only a file volume the Pod was made with: a name is never a path.
            let known = spec
                .spec
                .volumes
                .iter()
                .any(|s| s.name == v.name && matches!(s.source, VolumeSource::Files { .. }));
            if !known || parts(&v.name).is_none_or(|p| p.len() != 1) {
                return Err(ProviderError::invalid(
                    "InvalidSpec",
                    format!("pod {uid} has no file volume {:?}", v.name),
                ));
            }
            let old = written.get(&v.name).cloned().unwrap_or_else(|| {
                spec.spec
                    .volumes
                    .iter()
                    .filter(|s| s.name == v.name)
                    .flat_map(|s| match &s.source {
                        VolumeSource::Files { files } => {
                            files.iter().map(|f| f.path.clone()).collect()
                        }
                        _ => Vec::new(),
                    })
                    .collect()
            });
            let new: Vec<String> = files.iter().map(|f| f.path.clone()).collect();
            // Until the refresh is through, either set may be on disk.
            let mut either = old.clone();
            either.extend(new.iter().filter(|p| !old.contains(p)).cloned());
            written.insert(v.name.clone(), either);
            save(&written)?;
            let vol = open_dir(&all, &v.name).map_err(|e| io(e.into()))?;
            refresh(&vol, &old, files, self.inner.run_as).map_err(io)?;
            written.insert(v.name.clone(), new);
            save(&written)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // a failed unwrap is a failed test
    use super::*;

    fn file(path: &str, data: &str) -> VolumeFile {
        VolumeFile {
            path: path.into(),
            data: data.as_bytes().to_vec(),
            mode: 0o644,
        }
    }

    fn me() -> (u32, u32) {
        (
            rustix::process::geteuid().as_raw(),
            rustix::process::getegid().as_raw(),
        )
    }

    #[test]
    fn a_refresh_rewrites_adds_and_removes_files() {
        let dir = std::env::temp_dir().join(format!("vkd-vol-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(dir.join("old/deep")).unwrap();
        std::fs::write(dir.join("data-1"), "value-1").unwrap();
        std::fs::write(dir.join("old/deep/gone"), "x").unwrap();
        let vol =
            rustix::fs::open(&dir, OFlags::RDONLY | OFlags::DIRECTORY, Mode::empty()).unwrap();
        let old = ["data-1".to_owned(), "old/deep/gone".to_owned()];
        std::fs::write(dir.join("made-by-the-pod"), "mine").unwrap();
        refresh(
            &vol,
            &old,
            &[file("data-1", "value-2"), file("sub/data-3", "value-3")],
            me(),
        )
        .unwrap();
        assert_eq!(
            std::fs::read_to_string(dir.join("data-1")).unwrap(),
            "value-2"
        );
        assert_eq!(
            std::fs::read_to_string(dir.join("sub/data-3")).unwrap(),
            "value-3"
        );
        assert!(!dir.join("old").exists(), "what is no longer listed goes");
        assert!(
            dir.join("made-by-the-pod").exists(),
            "what vkd did not write stays"
        );
        let names: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 3, "no temporary file is left: {names:?}");
        // A key that becomes a directory's name, and back.
        let was = ["data-1".to_owned(), "sub/data-3".to_owned()];
        refresh(&vol, &was, &[file("sub", "flat")], me()).unwrap();
        assert_eq!(std::fs::read_to_string(dir.join("sub")).unwrap(), "flat");
        refresh(&vol, &["sub".to_owned()], &[file("sub/x", "deep")], me()).unwrap();
        assert_eq!(std::fs::read_to_string(dir.join("sub/x")).unwrap(), "deep");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_link_the_pod_planted_is_never_followed() {
        let dir = std::env::temp_dir().join(format!("vkd-vol-{}", uuid::Uuid::new_v4().simple()));
        let outside = dir.with_extension("outside");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::create_dir_all(&outside).unwrap();
        std::fs::write(outside.join("victim"), "safe").unwrap();
        // The Pod made its volume's `sub` a link to a directory it may not write.
        std::os::unix::fs::symlink(&outside, dir.join("sub")).unwrap();
        std::os::unix::fs::symlink(outside.join("victim"), dir.join("key")).unwrap();
        let vol =
            rustix::fs::open(&dir, OFlags::RDONLY | OFlags::DIRECTORY, Mode::empty()).unwrap();
        let err = refresh(&vol, &[], &[file("sub/victim", "owned")], me());
        assert!(err.is_err());
        // Nor is one in the way of removing an old file.
        refresh(&vol, &["sub/victim".into()], &[], me()).unwrap();
        refresh(&vol, &[], &[file("key", "new")], me()).unwrap();
        assert_eq!(
            std::fs::read_to_string(outside.join("victim")).unwrap(),
            "safe"
        );
        assert!(
            !dir.join("key").symlink_metadata().unwrap().is_symlink(),
            "the link was replaced, not followed"
        );
        std::fs::remove_dir_all(&dir).unwrap();
        std::fs::remove_dir_all(&outside).unwrap();
    }

    #[test]
    fn paths_that_leave_the_volume_are_refused() {
        assert!(parts("a/../../etc/passwd").is_none());
        assert!(parts("/etc/passwd").is_none());
        assert!(parts("").is_none());
        assert!(parts("..vkd-tmp-x").is_none());
        assert_eq!(parts("a/b").unwrap(), ["a", "b"]);
    }
}
