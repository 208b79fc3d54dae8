//! Refreshing a running Pod's file volumes (configMap, secret, downwardAPI,
//! projected) in place, as the kubelet does when their sources change.
//!
//! A volume's directory belongs to the Pod's user, who may have replaced any
//! part of it with a link to somewhere else by the time the provider (maybe
//! root) writes. So every step goes through directory descriptors opened
//! without following links, and every file is a new one renamed over the old
//! name: nothing outside the volume is ever opened for writing, and a reader
//! sees a file's old bytes or its new ones, never a mix.

use std::collections::BTreeSet;
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

/// Writes one volume's files under `vol` and removes what is no longer listed.
fn refresh(vol: &OwnedFd, files: &[VolumeFile], owner: (u32, u32)) -> std::io::Result<()> {
    let invalid = |m: String| std::io::Error::new(std::io::ErrorKind::InvalidInput, m);
    let mut keep: BTreeSet<Vec<&str>> = BTreeSet::new();
    for f in files {
        let parts = parts(&f.path).ok_or_else(|| invalid(format!("file path {:?}", f.path)))?;
        for n in 1..parts.len() {
            keep.insert(parts[..n].to_vec());
        }
        keep.insert(parts.clone());
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
        rustix::fs::fchmod(&file, Mode::from_raw_mode(f.mode & 0o7777))?;
        rustix::fs::fchown(&file, Some(uid(owner)), Some(gid(owner)))?;
        drop(file);
        rustix::fs::renameat(&dir, tmp.as_str(), &dir, *name)?;
    }
    remove_unlisted(vol, &mut Vec::new(), &keep)
}

/// Removes, below `dir` (at `at` in the volume), every entry `keep` does not list.
fn remove_unlisted(
    dir: &OwnedFd,
    at: &mut Vec<String>,
    keep: &BTreeSet<Vec<&str>>,
) -> std::io::Result<()> {
    let mut entries = Vec::new();
    for e in rustix::fs::Dir::read_from(dir)? {
        let e = e?;
        let name = e.file_name().to_string_lossy().into_owned();
        if name != "." && name != ".." {
            entries.push((name, e.file_type() == rustix::fs::FileType::Directory));
        }
    }
    for (name, is_dir) in entries {
        at.push(name.clone());
        let listed = keep
            .iter()
            .any(|k| k.len() == at.len() && k.iter().zip(at.iter()).all(|(a, b)| a == b));
        if is_dir {
            if let Ok(sub) = open_dir(dir, &name) {
                remove_unlisted(&sub, at, keep)?;
            }
            if !listed {
                let _ = rustix::fs::unlinkat(dir, name.as_str(), AtFlags::REMOVEDIR);
            }
        } else if !listed {
            rustix::fs::unlinkat(dir, name.as_str(), AtFlags::empty())?;
        }
        at.pop();
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
            let vol = open_dir(&all, &v.name).map_err(|e| io(e.into()))?;
            refresh(&vol, files, self.inner.run_as).map_err(io)?;
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
        refresh(
            &vol,
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
        let names: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 2, "no temporary file is left: {names:?}");
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
        let err = refresh(&vol, &[file("sub/victim", "owned")], me());
        assert!(err.is_err());
        refresh(&vol, &[file("key", "new")], me()).unwrap();
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
