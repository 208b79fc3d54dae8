//! cgroup v2 for Pods: one group per Pod (`vkd-pod-<uid>`) with a child per
//! container, so every process a Pod starts, however it detaches (setsid, double
//! fork, `kubectl exec`), is found and ended with the Pod through `cgroup.kill`.
//!
//! Limits need the memory, cpu and pids controllers enabled for the Pod groups.
//! A hierarchy without them (a hybrid host, where the controllers stay on v1)
//! still tracks and kills processes; the limits then fall back to rlimits, and
//! the provider says so (`limits_mode`).

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// `CGROUP2_SUPER_MAGIC` from linux/magic.h: what statfs reports for cgroup2.
const CGROUP2_MAGIC: u64 = 0x6367_7270;

/// A cgroup v2 directory the Pods' groups are made in, and which controllers
/// they get.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CgroupParent {
    pub dir: PathBuf,
    pub memory: bool,
    pub cpu: bool,
    pub pids: bool,
}

impl CgroupParent {
    /// Every limit the spec can ask for is enforced by the cgroup.
    pub fn enforces_limits(&self) -> bool {
        self.memory && self.cpu && self.pids
    }
}

#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    #[error("{0} is not a cgroup v2 directory (not on a cgroup2 filesystem)")]
    NotCgroup2(PathBuf),
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "{path}: the {missing} controller(s) cannot be enabled for child groups, so Pod limits \
         would not apply (cgroup.controllers lists {available:?})"
    )]
    Controllers {
        path: PathBuf,
        missing: String,
        available: String,
    },
}

fn is_cgroup2(path: &Path) -> bool {
    rustix::fs::statfs(path).is_ok_and(|s| s.f_type as u64 == CGROUP2_MAGIC)
}

/// Enables memory, cpu and pids for child groups where the hierarchy has them,
/// and reports which are on.
fn enable_controllers(dir: &Path) -> CgroupParent {
    let available = std::fs::read_to_string(dir.join("cgroup.controllers")).unwrap_or_default();
    let wanted: Vec<&str> = ["memory", "cpu", "pids"]
        .into_iter()
        .filter(|c| available.split_whitespace().any(|a| a == *c))
        .collect();
    for c in &wanted {
        // One at a time: one refused controller must not keep the others off.
        let _ = std::fs::write(dir.join("cgroup.subtree_control"), format!("+{c}"));
    }
    let on = std::fs::read_to_string(dir.join("cgroup.subtree_control")).unwrap_or_default();
    let has = |c: &str| on.split_whitespace().any(|a| a == c);
    CgroupParent {
        dir: dir.to_owned(),
        memory: has("memory"),
        cpu: has("cpu"),
        pids: has("pids"),
    }
}

/// An explicit `cgroupParent`: it must be a cgroup v2 directory where the Pod
/// limits can be enforced.
pub fn validate(dir: &Path) -> Result<CgroupParent, CgroupError> {
    std::fs::metadata(dir).map_err(|source| CgroupError::Io {
        path: dir.to_owned(),
        source,
    })?;
    if !is_cgroup2(dir) || !dir.join("cgroup.procs").exists() {
        return Err(CgroupError::NotCgroup2(dir.to_owned()));
    }
    let parent = enable_controllers(dir);
    if !parent.enforces_limits() {
        let missing: Vec<&str> = [
            ("memory", parent.memory),
            ("cpu", parent.cpu),
            ("pids", parent.pids),
        ]
        .into_iter()
        .filter(|(_, on)| !on)
        .map(|(c, _)| c)
        .collect();
        return Err(CgroupError::Controllers {
            path: dir.to_owned(),
            missing: missing.join(", "),
            available: std::fs::read_to_string(dir.join("cgroup.controllers"))
                .unwrap_or_default()
                .trim()
                .to_owned(),
        });
    }
    Ok(parent)
}

/// `cgroupParent: auto`: our own group in the unified hierarchy, wherever it is
/// mounted, if we may create groups in it.
pub fn detect() -> Option<CgroupParent> {
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    // Fields: id parent major:minor root mount-point options ... - fstype source options
    let mount = mountinfo.lines().find_map(|l| {
        let (left, right) = l.split_once(" - ")?;
        (right.split_whitespace().next()? == "cgroup2").then_some(())?;
        let f: Vec<&str> = left.split_whitespace().collect();
        let (root, point) = (f.get(3)?, f.get(4)?);
        (*root == "/").then(|| PathBuf::from(point))
    })?;
    let own = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let rel = own.lines().find_map(|l| l.strip_prefix("0::"))?;
    let dir = mount.join(rel.trim().trim_start_matches('/'));
    if !is_cgroup2(&dir) || rustix::fs::access(&dir, rustix::fs::Access::WRITE_OK).is_err() {
        return None;
    }
    Some(enable_controllers(&dir))
}

/// The group of one Pod.
pub fn pod_dir(parent: &Path, pod_uid: &str) -> PathBuf {
    parent.join(format!("vkd-pod-{pod_uid}"))
}

/// Makes the Pod's group, its controllers for the containers' groups, and its
/// process limit.
pub fn create_pod(
    parent: &CgroupParent,
    pod_uid: &str,
    pids_limit: Option<u64>,
) -> std::io::Result<PathBuf> {
    let dir = pod_dir(&parent.dir, pod_uid);
    match std::fs::create_dir(&dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e),
    }
    for (c, on) in [
        ("memory", parent.memory),
        ("cpu", parent.cpu),
        ("pids", parent.pids),
    ] {
        if on {
            std::fs::write(dir.join("cgroup.subtree_control"), format!("+{c}"))?;
        }
    }
    if let (true, Some(n)) = (parent.pids, pids_limit) {
        std::fs::write(dir.join("pids.max"), n.to_string())?;
    }
    Ok(dir)
}

/// Ends every process in `dir` and its children: `cgroup.kill` (Linux 5.14),
/// else SIGKILL to each PID the group lists.
pub fn kill(dir: &Path) {
    if std::fs::write(dir.join("cgroup.kill"), "1").is_ok() {
        return;
    }
    for pid in procs(dir) {
        if let Some(p) = rustix::process::Pid::from_raw(pid) {
            let _ = rustix::process::kill_process(p, rustix::process::Signal::KILL);
        }
    }
}

/// The PIDs in `dir` and every group below it.
pub fn procs(dir: &Path) -> Vec<i32> {
    let mut out: Vec<i32> = std::fs::read_to_string(dir.join("cgroup.procs"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect();
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                out.extend(procs(&e.path()));
            }
        }
    }
    out
}

/// Kills what is left in the group and removes it, children first; waits up to
/// `patience` for killed processes to leave. False when it could not be removed.
pub fn remove(dir: &Path, patience: std::time::Duration) -> bool {
    if !dir.exists() {
        return true;
    }
    let until = std::time::Instant::now() + patience;
    loop {
        // Again each time: without cgroup.kill, a process may fork between the
        // reading of cgroup.procs and its SIGKILL.
        kill(dir);
        if remove_tree(dir) {
            return true;
        }
        if std::time::Instant::now() >= until {
            return false;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

fn remove_tree(dir: &Path) -> bool {
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                remove_tree(&e.path());
            }
        }
    }
    match std::fs::remove_dir(dir) {
        Ok(()) => true,
        Err(e) => e.kind() == std::io::ErrorKind::NotFound,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plain_directory_is_not_a_cgroup() {
        let dir = std::env::temp_dir().join(format!("vkd-cg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("cgroup.procs"), "").unwrap();
        let err = validate(&dir).unwrap_err();
        assert!(matches!(err, CgroupError::NotCgroup2(_)), "{err}");
        assert!(err.to_string().contains("not a cgroup v2 directory"));
        let _ = std::fs::remove_dir_all(&dir);
        assert!(matches!(validate(&dir), Err(CgroupError::Io { .. })));
    }
}
