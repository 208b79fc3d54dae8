//! The durable half of fencing, for providers that keep state in files: the
//! highest epoch seen per node, in `<dir>/<node>`.
//!
//! Every mutation checks and records the epoch under an exclusive file lock
//! held until the mutation is done ([`FenceGuard`]), and reads the file each
//! time, so an old daemon in another process that has not yet noticed it lost
//! the lead is refused as soon as the new one has acted once.
//!
//! A fence file that does not hold an epoch refuses every epoch until someone
//! repairs it: read as 0 it would let any epoch through, an old daemon's too.
//!
//! [`FenceBook::check`] blocks (a file lock, an fsync): async callers use
//! [`FenceBook::check_async`], which runs it on tokio's blocking pool.

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

    /// The fence file of `node`.
    pub fn path(&self, node: &str) -> PathBuf {
        self.dir.join(node)
    }

    /// The highest epoch recorded for `node` (0 when none). A file that cannot
    /// be read, or holds no epoch, is an error naming it, never 0.
    pub fn current(&self, node: &str) -> Result<u64> {
        let path = self.path(node);
        let bytes = match std::fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
            Err(e) => return Err(io(&path)(e)),
        };
        std::str::from_utf8(&bytes)
            .ok()
            .and_then(|t| t.trim().parse().ok())
            .ok_or_else(|| {
                let shown: String = String::from_utf8_lossy(&bytes).chars().take(40).collect();
                ProviderError::transient(format!(
                    "fence file {} is corrupt ({shown:?} is not an epoch): refusing every \
                     epoch for node {node} until it is repaired; write the node's current \
                     epoch into it (the vkd.io/epoch annotation of Lease vkd-{node})",
                    path.display()
                ))
            })
    }

    /// Refuses an epoch below the recorded one; records a higher one durably.
    /// Blocks on the lock and an fsync: from async code use [`Self::check_async`].
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
        let current = self.current(node)?;
        if fence.epoch < current {
            return Err(ProviderError::Fenced {
                node: node.clone(),
                current,
                got: fence.epoch,
            });
        }
        if fence.epoch > current {
            let path = self.path(node);
            let tmp = self.dir.join(format!(".{node}.tmp"));
            let mut f = std::fs::File::create(&tmp).map_err(io(&tmp))?;
            f.write_all(fence.epoch.to_string().as_bytes())
                .and_then(|()| f.sync_all())
                .map_err(io(&tmp))?;
            std::fs::rename(&tmp, &path).map_err(io(&path))?;
            // The rename is durable only once the directory is: a crash could
            // otherwise bring back the lower epoch (or no file, epoch 0).
            std::fs::File::open(&self.dir)
                .and_then(|d| d.sync_all())
                .map_err(io(&self.dir))?;
        }
        Ok(FenceGuard { _lock: lock })
    }

    /// [`Self::check`] on tokio's blocking pool, so waiting for another
    /// daemon's lock never stalls a runtime thread. Hold the guard (it is
    /// `Send`) until the mutation is done; take no other lock before this one.
    pub async fn check_async(&self, fence: &Fence) -> Result<FenceGuard> {
        let (book, f) = (self.clone(), fence.clone());
        tokio::task::spawn_blocking(move || book.check(&f))
            .await
            .map_err(|e| {
                ProviderError::transient(format!("fence check for node {}: {e}", fence.node))
            })?
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

    #[test]
    fn a_garbage_fence_file_refuses_every_epoch() {
        let dir = std::env::temp_dir().join(format!("vkd-fence-garbage-{}", std::process::id()));
        let book = FenceBook::new(&dir).unwrap();
        let file = dir.join("vk");
        for garbage in ["", "\u{0}\u{0}\u{0}", "12x", "-3"] {
            std::fs::write(&file, garbage).unwrap();
            for epoch in [0, 5, u64::MAX] {
                let e = book.check(&fence(epoch)).unwrap_err();
                assert!(
                    matches!(&e, ProviderError::Transient { message } if message.contains(&file.display().to_string())),
                    "{garbage:?} at {epoch}: {e}"
                );
            }
            // Refused, never repaired to whatever epoch came along.
            assert_eq!(std::fs::read_to_string(&file).unwrap(), garbage);
        }
        let _ = std::fs::remove_dir_all(dir);
    }

    #[tokio::test]
    async fn check_async_fences_like_check() {
        let dir = std::env::temp_dir().join(format!("vkd-fence-async-{}", std::process::id()));
        let book = FenceBook::new(&dir).unwrap();
        drop(book.check_async(&fence(3)).await.unwrap());
        assert_eq!(book.current("vk").unwrap(), 3);
        assert!(matches!(
            book.check_async(&fence(2)).await,
            Err(ProviderError::Fenced { current: 3, .. })
        ));
        let _ = std::fs::remove_dir_all(dir);
    }
}
