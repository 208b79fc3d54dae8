//! A container's termination message, as the kubelet keeps it: the file at
//! its terminationMessagePath made afresh (empty, the Pod's user's) for each
//! run, and its end read back when the run ends; with FallbackToLogsOnError,
//! the end of the log when the file says nothing.

use std::path::PathBuf;

use vkd_provider::{ContainerSpec, ContainerState};

use super::{Shim, lock};
use crate::sandbox::Launch;

impl Shim {
    /// Before a run: the container's termination message file, empty, as the
    /// kubelet makes a new one for each container it starts. Left as it is while
    /// another container of the Pod that writes the same file runs.
    pub(super) fn fresh_termination_log(&self, launch: &Launch) {
        use rustix::fs::{Mode, OFlags};
        let Some((root, rel)) = self.termination_file(launch) else {
            return;
        };
        let rel = rel.as_path();
        let shared = !self.spec.isolated && {
            let st = lock(&self.status);
            st.init.iter().chain(&st.containers).any(|c| {
                c.status.name != launch.name
                    && matches!(c.status.state, ContainerState::Running { .. })
                    && self.spec.containers.iter().any(|l| {
                        l.name == c.status.name && l.termination_log.as_deref() == Some(rel)
                    })
            })
        };
        if shared {
            return;
        }
        let made = match crate::sandbox::open_beneath(
            &root,
            rel,
            OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL,
            Mode::from_raw_mode(0o666),
        ) {
            Ok(f) => {
                // Root made it: it becomes the Pod's, writable by the container.
                let owner = self
                    .spec
                    .run_as
                    .map(|(u, g)| (rustix::fs::Uid::from_raw(u), rustix::fs::Gid::from_raw(g)));
                let done = owner.map_or(Ok(()), |(u, g)| rustix::fs::fchown(&f, Some(u), Some(g)));
                done.and_then(|()| rustix::fs::fchmod(&f, Mode::from_raw_mode(0o666)))
                    .map_err(std::io::Error::from)
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                crate::sandbox::open_beneath(&root, rel, OFlags::WRONLY, Mode::empty()).and_then(
                    |f| {
                        if self.owned_by_pod(&f) {
                            f.set_len(0)
                        } else {
                            Ok(())
                        }
                    },
                )
            }
            Err(e) => Err(e),
        };
        if let Err(e) = made {
            self.note(&format!(
                "container {}: no termination message file at /{}: {e}",
                launch.name,
                rel.display()
            ));
        }
    }

    /// Where `launch`'s termination message file is, as a directory of the
    /// host and a path beneath it: with namespaces, a file of the
    /// container's own (bound at its terminationMessagePath), else the path
    /// under the Pod's root.
    pub(super) fn termination_file(&self, launch: &Launch) -> Option<(PathBuf, PathBuf)> {
        let rel = launch.termination_log.as_deref()?;
        let spec = self
            .spec
            .spec
            .init_containers
            .iter()
            .chain(&self.spec.spec.containers)
            .find(|c| c.name == launch.name);
        match spec {
            Some(c) if self.spec.isolated && crate::sandbox::own_termination_file(c, rel) => {
                Some((self.sandbox.termination_dir(), PathBuf::from(&launch.name)))
            }
            _ => Some((self.sandbox.root(), rel.to_owned())),
        }
    }

    /// A regular file the Pod's user owns (what root may read or truncate for it).
    pub(super) fn owned_by_pod(&self, f: &std::fs::File) -> bool {
        use std::os::unix::fs::MetadataExt;
        f.metadata()
            .is_ok_and(|m| m.is_file() && self.spec.run_as.is_none_or(|(u, _)| m.uid() == u))
    }

    /// The termination message of a run that exited with `code`, as the kubelet
    /// reads it: the end of the container's termination message file, or with
    /// `FallbackToLogsOnError` and a failure, the end of its log when the file
    /// says nothing.
    pub(super) fn termination_message(
        &self,
        spec: &ContainerSpec,
        launch: &Launch,
        code: i32,
    ) -> Option<String> {
        use std::io::{Read, Seek};
        let from_file = self.termination_file(launch).and_then(|(root, rel)| {
            let rel = rel.as_path();
            let f = crate::sandbox::open_beneath(
                &root,
                rel,
                rustix::fs::OFlags::RDONLY,
                rustix::fs::Mode::empty(),
            );
            let mut f = match f {
                Ok(f) => f,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
                Err(e) => {
                    self.note(&format!(
                        "container {}: reading the termination message /{}: {e}",
                        spec.name,
                        rel.display()
                    ));
                    return None;
                }
            };
            if !self.owned_by_pod(&f) {
                return None;
            }
            let max = vkd_provider::MAX_TERMINATION_MESSAGE as u64;
            let len = f.metadata().map_or(0, |m| m.len());
            let mut buf = Vec::new();
            f.seek(std::io::SeekFrom::Start(len.saturating_sub(max)))
                .and_then(|_| f.take(max).read_to_end(&mut buf))
                .ok()?;
            Some(String::from_utf8_lossy(&buf).into_owned())
        });
        let fallback = spec.termination_message_policy
            == vkd_provider::TerminationMessagePolicy::FallbackToLogsOnError
            && code != 0;
        match from_file {
            Some(m) if !m.is_empty() => Some(m),
            _ if fallback => {
                let tail = crate::logs::tail(
                    &self.sandbox.logs(&spec.name),
                    vkd_provider::TERMINATION_MESSAGE_LOG_LINES,
                    vkd_provider::TERMINATION_MESSAGE_LOG_BYTES,
                );
                (!tail.is_empty()).then(|| String::from_utf8_lossy(&tail).into_owned())
            }
            _ => None,
        }
    }
}
