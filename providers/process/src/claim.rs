//! Claims on sandboxes: one create or removal of a Pod at a time, without the
//! node's fence lock.
//!
//! CNI plugins take seconds, or hang until their bound, so a create or a
//! removal runs them outside the fence lock, which every other Pod's create
//! and delete needs; a claim keeps two of them off one sandbox instead. It is
//! an flock on `<state>/claims/<name>`: it holds across vkd processes on one
//! state directory, it ends with the process that held it (a crash leaves no
//! stale claim), and the file goes when the claim ends.

use std::fs::{File, OpenOptions, TryLockError};
use std::path::{Path, PathBuf};

/// Where the claims are kept, under the state directory.
pub(crate) const DIR: &str = "claims";

/// A held claim; dropping it gives it up.
#[derive(Debug)]
pub(crate) struct Claim {
    _lock: File,
    path: PathBuf,
}

impl Claim {
    /// Takes the claim on `name` (a Pod UID, or a sandbox's name on its way
    /// out) in `dir`; `None` when another create or removal holds it.
    pub(crate) fn try_take(dir: &Path, name: &str) -> std::io::Result<Option<Self>> {
        use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
        let path = dir.join(name);
        // A holder removes the file as it gives the claim up, so a lock won on
        // a file that is no longer at `path` is no claim: open it again.
        for _ in 0..100 {
            let file = OpenOptions::new()
                .create(true)
                .truncate(false)
                .write(true)
                .mode(0o600)
                .open(&path)?;
            match file.try_lock() {
                Ok(()) => {}
                Err(TryLockError::WouldBlock) => return Ok(None),
                Err(TryLockError::Error(e)) => return Err(e),
            }
            let held = file.metadata()?;
            match std::fs::symlink_metadata(&path) {
                Ok(m) if m.ino() == held.ino() && m.dev() == held.dev() => {
                    return Ok(Some(Self { _lock: file, path }));
                }
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(e),
            }
        }
        Ok(None)
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        // Removed while still locked, then unlocked as the file closes: a
        // newcomer finds either the locked file or none.
        let _ = std::fs::remove_file(&self.path);
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // a failed unwrap is a failed test
    use super::*;

    #[test]
    fn one_holder_at_a_time_and_nothing_left_after() {
        let dir = std::env::temp_dir().join(format!("vkd-claims-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let a = Claim::try_take(&dir, "u1").unwrap().unwrap();
        assert!(Claim::try_take(&dir, "u1").unwrap().is_none());
        let b = Claim::try_take(&dir, "u2").unwrap().unwrap();
        drop(a);
        assert!(!dir.join("u1").exists());
        let again = Claim::try_take(&dir, "u1").unwrap();
        assert!(again.is_some());
        drop((again, b));
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
