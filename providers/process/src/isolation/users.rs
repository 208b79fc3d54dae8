//! A container's user namespace: only the run-as ids, each mapped to itself.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::{IsolationError, Result, err, unshare};

/// The ids a container's user namespace maps, each to the same id outside.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct IdentityMap {
    /// The run-as user, and the owners of the setuid programs the image's
    /// `files` keep (so they work as without a user namespace).
    pub uids: Vec<u32>,
    /// The run-as group, the Pod's fsGroup, and the groups of the image's
    /// setgid programs.
    pub gids: Vec<u32>,
}

impl IdentityMap {
    fn lines(ids: impl IntoIterator<Item = u32>) -> String {
        let mut ids: Vec<u32> = ids.into_iter().collect();
        ids.sort_unstable();
        ids.dedup();
        ids.iter().map(|id| format!("{id} {id} 1\n")).collect()
    }

    /// Writes the maps of process `pid`, which has just made the namespace
    /// (by a process with CAP_SETUID and CAP_SETGID outside it: the launcher
    /// as root).
    pub fn write(&self, pid: i32) -> Result<()> {
        if self.uids.contains(&0) || self.gids.contains(&0) {
            return Err(IsolationError::Invalid(
                "a container's user namespace never maps root".into(),
            ));
        }
        for (file, text) in [
            ("uid_map", Self::lines(self.uids.iter().copied())),
            ("gid_map", Self::lines(self.gids.iter().copied())),
        ] {
            let path = PathBuf::from(format!("/proc/{pid}/{file}"));
            std::fs::write(&path, text).map_err(err("writing", &path))?;
        }
        Ok(())
    }
}

/// Gives the calling process (single-threaded, pivoted into its root) a
/// user namespace of its own; its maps are written from outside
/// ([`IdentityMap::write`]).
pub fn new_user_namespace() -> Result<()> {
    unshare(rustix::thread::UnshareFlags::NEWUSER)
}
