//! The durable half of fencing, for providers that keep state in files: the
//! highest epoch seen per node, in `<dir>/<node>`.
//!
//! Every mutation checks and records the epoch under an exclusive file lock
//! held until the mutation is done ([`FenceGuard`]), and reads the file each
//! time, so an old daemon in another process that has not yet noticed it lost
//! the lead is refused as soon as the new one has acted once.

use std::io::Write;
use std::path::{Path, PathBuf};

use crate::{Fence, ProviderError, Result};

#[derive(Clone, Debug)]
pub struct FenceBook {
    dir: PathBuf,
}

/// Holds the node's fence lock; the mutation it guards happens while it lives.
#[derive(Debug)]
pub struct FenceGuard {
    _lock: std::fs::File,
}

fn io(path: &Path) -> impl Fn(std::io::Error) -> ProviderError + '_ {
    move |e| ProviderError::transient(format!("{}: {e}", path.display()))
}

impl FenceBook {
    pub fn new(dir: &Path) -> std::io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        Ok(Self {
            dir: dir.to_owned(),
        })
    }

    /// The highest epoch recorded for `node` (0 when none).
    pub fn current(&self, node: &str) -> u64 {
        std::fs::read_to_string(self.dir.join(node))
            .ok()
            .and_then(|t| t.trim().parse().ok())
            .unwrap_or(0)
    }

    /// Refuses an epoch below the recorded one; records a higher one durably.
    pub fn check(&self, fence: &Fence) -> Result<FenceGuard> {
        let node = &fence.node;
        if node.is_empty() || node.contains('/') || node.starts_with('.') {
            return Err(ProviderError::invalid(
                "InvalidNode",
                format!("node name {node:?}"),
            ));
        }
        let lock_path = self.dir.join(format!(".{node}.lock"));
        let lock = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(io(&lock_path))?;
        lock.lock().map_err(io(&lock_path))?;
        let current = self.current(node);
        if fence.epoch < current {
            return Err(ProviderError::Fenced {
                node: node.clone(),
                current,
                got: fence.epoch,
            });
        }
        if fence.epoch > current {
            let path = self.dir.join(node);
            let tmp = self.dir.join(format!(".{node}.tmp"));
            let mut f = std::fs::File::create(&tmp).map_err(io(&tmp))?;
            f.write_all(fence.epoch.to_string().as_bytes())
                .and_then(|()| f.sync_all())
                .map_err(io(&tmp))?;
            std::fs::rename(&tmp, &path).map_err(io(&path))?;
        }
        Ok(FenceGuard { _lock: lock })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fence(epoch: u64) -> Fence {
        Fence {
            node: "vk".into(),
            epoch,
        }
    }

    #[test]
    fn a_lower_epoch_is_refused_across_instances() {
        let dir = std::env::temp_dir().join(format!("vkd-fence-{}", std::process::id()));
        let a = FenceBook::new(&dir).unwrap();
        let b = FenceBook::new(&dir).unwrap();
        drop(a.check(&fence(5)).unwrap());
        // Another process (another book on the same directory) moved on.
        drop(b.check(&fence(7)).unwrap());
        match a.check(&fence(5)) {
            Err(ProviderError::Fenced { current, got, .. }) => assert_eq!((current, got), (7, 5)),
            other => panic!("{other:?}"),
        }
        assert!(a.check(&fence(7)).is_ok());
        assert!(matches!(
            a.check(&Fence {
                node: "../x".into(),
                epoch: 9
            }),
            Err(ProviderError::Invalid { .. })
        ));
        let _ = std::fs::remove_dir_all(dir);
    }
}
