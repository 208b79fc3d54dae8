//! How much disk a Pod's sandbox takes: the Pod's ephemeral storage, as the
//! kubelet measures it for `/stats/summary` and for eviction.
//!
//! Most of a sandbox belongs to the Pod's user, who may change it while it is
//! measured (vkd may be root). So the walk goes through directory descriptors
//! opened without following links, never leaves the sandbox's filesystem, and
//! holds names rather than paths. It is bounded in entries and in depth: a
//! sandbox past either bound is reported as unmeasurable, which eviction
//! treats as over any limit, so making many files is no way around one.

use std::ffi::CString;
use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use rustix::fs::{AtFlags, FileType, Mode, OFlags};

/// The most directory entries one measurement reads.
const MAX_ENTRIES: usize = 1_000_000;
/// The deepest a measurement goes below the sandbox.
const MAX_DEPTH: usize = 128;
/// A measurement younger than this is reused: the kubelet's figures are
/// periodic too, and a scrape of `/stats/summary` must not walk every Pod.
const REUSE_FOR: Duration = Duration::from_secs(10);

/// A sandbox's disk use: the whole, and each directory under `volumes/`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Usage {
    pub(crate) total: u64,
    pub(crate) volumes: Vec<(String, u64)>,
}

/// The sandbox had more entries, or deeper directories, than a walk reads.
#[derive(Debug)]
struct Unmeasurable;

fn open_dir(at: impl AsFd, name: &std::ffi::CStr) -> rustix::io::Result<OwnedFd> {
    rustix::fs::openat(
        at,
        name,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )
}

/// The bytes of disk a file takes, as du counts them.
fn blocks(st: &rustix::fs::Stat) -> u64 {
    u64::try_from(st.st_blocks).unwrap_or(0).saturating_mul(512)
}

struct Walk {
    device: u64,
    entries_left: usize,
}

impl Walk {
    /// Adds the blocks of `dir`'s entries to `used`; returns its subdirectories.
    fn read(&mut self, dir: &OwnedFd, used: &mut u64) -> Result<Vec<CString>, Unmeasurable> {
        let mut subdirs = Vec::new();
        let Ok(entries) = rustix::fs::Dir::read_from(dir) else {
            return Ok(subdirs);
        };
        for entry in entries {
            let Ok(entry) = entry else { break };
            let name = entry.file_name();
            if name.to_bytes() == b"." || name.to_bytes() == b".." {
                continue;
            }
            self.entries_left = self.entries_left.checked_sub(1).ok_or(Unmeasurable)?;
            let Ok(st) = rustix::fs::statat(dir, name, AtFlags::SYMLINK_NOFOLLOW) else {
                continue;
            };
            if st.st_dev != self.device {
                continue;
            }
            *used = used.saturating_add(blocks(&st));
            if FileType::from_raw_mode(st.st_mode) == FileType::Directory {
                subdirs.push(name.to_owned());
            }
        }
        Ok(subdirs)
    }

    /// Bytes under the open directory `top`, not counting `top` itself (and
    /// nothing when `top` is on another filesystem).
    fn under(&mut self, top: OwnedFd) -> Result<u64, Unmeasurable> {
        let mut used = 0;
        if rustix::fs::fstat(&top).map_or(true, |st| st.st_dev != self.device) {
            return Ok(used);
        }
        let subdirs = self.read(&top, &mut used)?;
        let mut stack = vec![(top, subdirs)];
        loop {
            let next = match stack.last_mut() {
                None => return Ok(used),
                Some((fd, names)) => names.pop().map(|n| open_dir(&*fd, &n)),
            };
            match next {
                None => {
                    stack.pop();
                }
                Some(Ok(sub)) => {
                    // Opened without following a link, but it could have been
                    // swapped for a mount point since it was looked at.
                    if rustix::fs::fstat(&sub).map_or(true, |st| st.st_dev != self.device) {
                        continue;
                    }
                    if stack.len() >= MAX_DEPTH {
                        return Err(Unmeasurable);
                    }
                    let subdirs = self.read(&sub, &mut used)?;
                    stack.push((sub, subdirs));
                }
                Some(Err(_)) => {}
            }
        }
    }
}

/// Measures the sandbox at `dir` (root's, trusted), with each volume's share;
/// `None` when it is past the bounds.
pub(crate) fn measure(dir: &Path) -> Option<Usage> {
    let top = rustix::fs::open(
        dir,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .ok()?;
    let device = rustix::fs::fstat(&top).ok()?.st_dev;
    let mut walk = Walk {
        device,
        entries_left: MAX_ENTRIES,
    };
    let mut usage = Usage::default();
    let names = walk.read(&top, &mut usage.total).ok()?;
    for name in names {
        let Ok(sub) = open_dir(&top, &name) else {
            continue;
        };
        if name.to_bytes() != b"volumes" {
            usage.total = usage.total.saturating_add(walk.under(sub).ok()?);
            continue;
        }
        if rustix::fs::fstat(&sub).map_or(true, |st| st.st_dev != device) {
            continue;
        }
        let mut own = 0;
        for volume in walk.read(&sub, &mut own).ok()? {
            let Ok(vdir) = open_dir(&sub, &volume) else {
                continue;
            };
            let Ok(st) = rustix::fs::fstat(&vdir) else {
                continue;
            };
            if st.st_dev != device {
                continue;
            }
            let content = walk.under(vdir).ok()?;
            usage.total = usage.total.saturating_add(content);
            if let Ok(name) = volume.into_string() {
                usage
                    .volumes
                    .push((name, blocks(&st).saturating_add(content)));
            }
        }
        // Each volume directory's own blocks are in `own` (and its figure).
        usage.total = usage.total.saturating_add(own);
    }
    Some(usage)
}

/// Recent measurements per Pod UID.
#[derive(Debug, Default)]
pub(crate) struct Measurements(Mutex<std::collections::HashMap<String, (Instant, Option<Usage>)>>);

impl Measurements {
    /// The Pod's usage, measured now unless a recent figure exists.
    pub(crate) fn get(&self, uid: &str, dir: &Path) -> Option<Usage> {
        let now = Instant::now();
        {
            let cache = self.0.lock().unwrap_or_else(|p| p.into_inner());
            if let Some((at, usage)) = cache.get(uid)
                && now.duration_since(*at) < REUSE_FOR
            {
                return usage.clone();
            }
        }
        let usage = measure(dir);
        let mut cache = self.0.lock().unwrap_or_else(|p| p.into_inner());
        cache.retain(|_, (at, _)| now.duration_since(*at) < REUSE_FOR);
        cache.insert(uid.to_owned(), (now, usage.clone()));
        usage
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // a failed unwrap is a failed test
    use super::*;

    fn sandbox() -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("vkd-du-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(dir.join("root")).unwrap();
        std::fs::create_dir_all(dir.join("volumes/scratch")).unwrap();
        dir
    }

    #[test]
    fn usage_counts_what_the_pod_wrote_and_no_link_out() {
        let dir = sandbox();
        std::fs::write(dir.join("root/file"), vec![1u8; 3 << 20]).unwrap();
        std::fs::write(dir.join("volumes/scratch/data"), vec![1u8; 1 << 20]).unwrap();
        // A link to elsewhere (a hostPath, or a Pod's trick) is not its disk.
        std::os::unix::fs::symlink("/usr", dir.join("root/host")).unwrap();
        std::os::unix::fs::symlink("/usr", dir.join("volumes/host")).unwrap();
        let u = measure(&dir).unwrap();
        assert!(u.total >= 4 << 20, "{u:?}");
        assert!(u.total < 5 << 20, "{u:?}: a link was followed");
        assert_eq!(u.volumes.len(), 1, "{u:?}");
        assert_eq!(u.volumes[0].0, "scratch");
        assert!(
            u.volumes[0].1 >= 1 << 20 && u.volumes[0].1 < 2 << 20,
            "{u:?}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_tree_past_the_depth_bound_is_unmeasurable() {
        let dir = sandbox();
        let mut deep = dir.join("root");
        for _ in 0..MAX_DEPTH + 2 {
            deep.push("d");
        }
        std::fs::create_dir_all(&deep).unwrap();
        assert!(measure(&dir).is_none());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_recent_measurement_is_reused() {
        let dir = sandbox();
        let m = Measurements::default();
        let first = m.get("u", &dir).unwrap();
        std::fs::write(dir.join("root/later"), vec![1u8; 1 << 20]).unwrap();
        assert_eq!(m.get("u", &dir).unwrap(), first);
        assert!(measure(&dir).unwrap().total > first.total);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
