//! A Pod's directory under the state dir: what the provider and the job's
//! runner share. The state dir must be on a filesystem both the host of
//! `vkd-slurm` and every compute node see at the same path (the cluster's
//! shared filesystem), as a Slurm job's output files already are.
//!
//! ```text
//! <state>/pods/<uid>/spec.json          the InstanceSpec (written before sbatch)
//!                    job-id              the Slurm job id (written after sbatch)
//!                    job.sh              the batch script: execs the runner
//!                    job.out             the batch script's own output
//!                    deleted             the deletion's deadline (unix ms)
//!                    work/               the containers' working directory
//!                    logs/<c>.log        CRI log lines: <RFC 3339> <stream> F <text>
//!                    logs/<c>.previous.log  the run before the last restart
//!                    containers/<c>.json what the runner saw of a container
//! ```

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use serde::{Deserialize, Serialize};
use vkd_provider::{InstanceSpec, ProviderError, is_dns_label};

/// One run of a container that ended.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Exit {
    pub code: i32,
    pub started_at: SystemTime,
    pub finished_at: SystemTime,
}

/// What the runner saw of a container: written by the runner, read by the provider.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ContainerRecord {
    pub restarts: u32,
    /// Running since then (its step started).
    pub running_since: Option<SystemTime>,
    /// Its latest run ended so; `None` while it runs or before it ran.
    pub exit: Option<Exit>,
    /// The run before that.
    pub last: Option<Exit>,
}

/// A Pod UID as a path segment: what the API server gives (a UUID), and
/// nothing that could leave the directory.
pub fn checked_uid(uid: &str) -> Result<&str, ProviderError> {
    if !uid.is_empty()
        && uid.len() <= 64
        && uid.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
    {
        Ok(uid)
    } else {
        Err(ProviderError::invalid(
            "InvalidPodUID",
            format!("{uid:?} is not a Pod UID (letters, digits and '-', at most 64)"),
        ))
    }
}

/// A container name as a file name.
pub fn checked_container(name: &str) -> Result<&str, ProviderError> {
    if is_dns_label(name) {
        Ok(name)
    } else {
        Err(ProviderError::invalid(
            "InvalidContainerName",
            format!("{name:?} is not a container name (a DNS label)"),
        ))
    }
}

/// The most of a spec read back: what one protocol message may carry.
const SPEC_MAX: u64 = 64 << 20;
/// The most of a container record read back.
const RECORD_MAX: u64 = 64 << 10;
/// The most of a one-number file (job id, deadline) read back.
const NUMBER_MAX: u64 = 64;

/// Opens a file the job may have written, with its length: never through a
/// link, never a FIFO or device (a job runs the tenant's code where these
/// files are).
pub fn open_regular(path: &Path) -> std::io::Result<(std::fs::File, u64)> {
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)?;
    let meta = f.metadata()?;
    if meta.is_file() {
        Ok((f, meta.len()))
    } else {
        Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "not a regular file",
        ))
    }
}

/// A file's bytes, refused when it is longer than `max`.
pub fn read_bounded(path: &Path, max: u64) -> std::io::Result<Vec<u8>> {
    use std::io::Read;
    let too_long = || {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("longer than {max} bytes"),
        )
    };
    let (f, len) = open_regular(path)?;
    if len > max {
        return Err(too_long());
    }
    // Bounded again: the file may grow while it is read.
    let mut bytes = Vec::new();
    f.take(max.saturating_add(1)).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > max {
        return Err(too_long());
    }
    Ok(bytes)
}

fn read_number(path: &Path) -> Option<u64> {
    std::str::from_utf8(&read_bounded(path, NUMBER_MAX).ok()?)
        .ok()?
        .trim()
        .parse()
        .ok()
}

fn io_error(path: &Path) -> impl Fn(std::io::Error) -> ProviderError + '_ {
    move |e| ProviderError::transient(format!("{}: {e}", path.display()))
}

/// A Pod's directory.
#[derive(Clone, Debug)]
pub struct PodDir {
    pub path: PathBuf,
}

impl PodDir {
    pub fn new(state: &Path, uid: &str) -> Result<Self, ProviderError> {
        Ok(Self {
            path: pods_root(state).join(checked_uid(uid)?),
        })
    }

    pub fn spec(&self) -> PathBuf {
        self.path.join("spec.json")
    }
    pub fn job_id_file(&self) -> PathBuf {
        self.path.join("job-id")
    }
    pub fn script(&self) -> PathBuf {
        self.path.join("job.sh")
    }
    pub fn output(&self) -> PathBuf {
        self.path.join("job.out")
    }
    pub fn work(&self) -> PathBuf {
        self.path.join("work")
    }
    pub fn deleted_file(&self) -> PathBuf {
        self.path.join("deleted")
    }
    pub fn log(&self, container: &str) -> PathBuf {
        self.path.join("logs").join(format!("{container}.log"))
    }
    pub fn previous_log(&self, container: &str) -> PathBuf {
        self.path
            .join("logs")
            .join(format!("{container}.previous.log"))
    }
    fn record_file(&self, container: &str) -> PathBuf {
        self.path
            .join("containers")
            .join(format!("{container}.json"))
    }

    pub fn exists(&self) -> bool {
        self.spec().exists()
    }

    /// Makes the directory and writes what the job needs before it is submitted.
    pub fn prepare(&self, spec: &InstanceSpec, runner: &Path) -> Result<(), ProviderError> {
        for d in [
            self.path.clone(),
            self.work(),
            self.path.join("logs"),
            self.path.join("containers"),
        ] {
            std::fs::create_dir_all(&d).map_err(io_error(&d))?;
        }
        let json = serde_json::to_vec(spec)
            .map_err(|e| ProviderError::transient(format!("the spec as JSON: {e}")))?;
        write_atomically(&self.spec(), &json)?;
        // Both paths are the provider's own (the state dir, a checked UID, its
        // own binary): nothing of the Pod's reaches the shell.
        let script = format!(
            "#!/bin/sh\nexec {} run-job {}\n",
            shell_quote(&runner.display().to_string()),
            shell_quote(&self.path.display().to_string())
        );
        write_atomically(&self.script(), script.as_bytes())
    }

    pub fn read_spec(&self) -> Result<InstanceSpec, ProviderError> {
        let path = self.spec();
        let bytes = read_bounded(&path, SPEC_MAX).map_err(io_error(&path))?;
        serde_json::from_slice(&bytes)
            .map_err(|e| ProviderError::transient(format!("{} is not a spec: {e}", path.display())))
    }

    pub fn job_id(&self) -> Option<u64> {
        read_number(&self.job_id_file())
    }

    pub fn set_job_id(&self, id: u64) -> Result<(), ProviderError> {
        write_atomically(&self.job_id_file(), id.to_string().as_bytes())
    }

    /// The deletion's deadline, once a deletion was asked for.
    pub fn deleted(&self) -> Option<SystemTime> {
        let ms = read_number(&self.deleted_file())?;
        Some(SystemTime::UNIX_EPOCH + std::time::Duration::from_millis(ms))
    }

    pub fn set_deleted(&self, deadline: SystemTime) -> Result<(), ProviderError> {
        let ms = deadline
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis());
        write_atomically(&self.deleted_file(), ms.to_string().as_bytes())
    }

    pub fn record(&self, container: &str) -> ContainerRecord {
        read_bounded(&self.record_file(container), RECORD_MAX)
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .unwrap_or_default()
    }

    pub fn set_record(&self, container: &str, r: &ContainerRecord) -> Result<(), ProviderError> {
        let json = serde_json::to_vec(r)
            .map_err(|e| ProviderError::transient(format!("a container record: {e}")))?;
        write_atomically(&self.record_file(container), &json)
    }

    /// When anything a container reported last changed (for change events).
    pub fn changed_at(&self) -> Option<SystemTime> {
        std::fs::read_dir(self.path.join("containers"))
            .ok()?
            .filter_map(|e| e.ok()?.metadata().ok()?.modified().ok())
            .max()
    }

    pub fn remove(&self) -> Result<(), ProviderError> {
        match std::fs::remove_dir_all(&self.path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(io_error(&self.path)(e)),
            _ => Ok(()),
        }
    }
}

/// Where the Pods' directories are.
pub fn pods_root(state: &Path) -> PathBuf {
    state.join("pods")
}

/// Replaces a file whole: a reader sees the old bytes or the new. The
/// temporary file is made anew (a link or file left in its place is
/// removed, never written through).
pub fn write_atomically(path: &Path, bytes: &[u8]) -> Result<(), ProviderError> {
    use std::os::unix::fs::OpenOptionsExt;
    let tmp = path.with_extension("tmp");
    match std::fs::remove_file(&tmp) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(io_error(&tmp)(e)),
        _ => {}
    }
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&tmp)
        .map_err(io_error(&tmp))?;
    f.write_all(bytes).map_err(io_error(&tmp))?;
    std::fs::rename(&tmp, path).map_err(io_error(path))
}

fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn files_the_job_can_replace_are_never_followed_or_read_past_their_bound() {
        let state = std::env::temp_dir().join(format!("vkd-slurm-poddir-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&state);
        let pod = PodDir::new(&state, "0f3c9a2e").expect("a uid");
        std::fs::create_dir_all(&pod.path).expect("dir");
        // A job id that is a link to another file: not read.
        let elsewhere = state.join("elsewhere");
        std::fs::write(&elsewhere, "42").expect("file");
        std::os::unix::fs::symlink(&elsewhere, pod.job_id_file()).expect("link");
        assert_eq!(pod.job_id(), None);
        // A temporary file planted as a link: removed, not written through.
        std::os::unix::fs::symlink(&elsewhere, pod.path.join("deleted.tmp")).expect("link");
        pod.set_deleted(SystemTime::UNIX_EPOCH).expect("written");
        assert_eq!(std::fs::read_to_string(&elsewhere).expect("kept"), "42");
        assert_eq!(pod.deleted(), Some(SystemTime::UNIX_EPOCH));
        // A spec too large to be one is refused, not read whole.
        std::fs::write(
            pod.spec(),
            vec![b' '; usize::try_from(SPEC_MAX).expect("fits") + 1],
        )
        .expect("spec");
        let e = pod.read_spec().expect_err("too long");
        assert!(e.to_string().contains("longer than"), "{e}");
        std::fs::remove_dir_all(&state).expect("cleanup");
    }

    #[test]
    fn only_a_uid_or_a_container_name_becomes_a_path() {
        assert!(checked_uid("0f3c9a2e-1b7d-4c55-9e0a-2b8d1f6e7a90").is_ok());
        for bad in ["", "..", "a/b", "../../etc", "x y", &"a".repeat(65)] {
            assert!(checked_uid(bad).is_err(), "{bad:?}");
        }
        assert!(checked_container("main").is_ok());
        for bad in ["", "..", "a/b", "Main", "-x"] {
            assert!(checked_container(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn the_script_quotes_its_paths() {
        assert_eq!(shell_quote("/a b/it's"), r"'/a b/it'\''s'");
    }
}
