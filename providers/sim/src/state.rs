//! The sim's state, apart from its behaviour: the instance records as they
//! are on disk, and what they use of each host. No I/O beyond the records
//! directory, nothing async.

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use serde::{Deserialize, Serialize};
use vkd_provider::{InstanceSpec, Placement, ProviderError};

/// One instance as stored on disk.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Record {
    pub id: String,
    pub spec: InstanceSpec,
    pub epoch: u64,
    pub created_at: SystemTime,
    pub placement: Placement,
    pub ip: String,
    /// Set once deletion was asked for: when the instance will be gone.
    pub stop_at: Option<SystemTime>,
}

#[derive(Debug, thiserror::Error)]
pub enum StateError {
    #[error("sim state {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("sim state {path}: {message}")]
    Corrupt { path: String, message: String },
}

pub(crate) fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> StateError + '_ {
    move |source| StateError::Io {
        path: path.display().to_string(),
        source,
    }
}

impl From<StateError> for ProviderError {
    fn from(e: StateError) -> Self {
        ProviderError::transient(e.to_string())
    }
}

/// A record file that could not be read as a record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CorruptRecord {
    pub path: PathBuf,
    pub message: String,
}

/// What a state directory holds: the records, and the files that are not records.
#[derive(Debug, Default)]
pub struct Scan {
    /// Oldest first.
    pub records: Vec<Record>,
    pub corrupt: Vec<CorruptRecord>,
}

/// Reads every instance record in a state directory; a file that does not
/// parse as its Pod's record is listed in `corrupt`, not an error, so it costs
/// only its own Pod. A file that cannot be read at all fails the scan.
pub fn scan_records(state_dir: &Path) -> Result<Scan, StateError> {
    let dir = state_dir.join("instances");
    let entries = match std::fs::read_dir(&dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Scan::default()),
        Err(e) => return Err(io_err(&dir)(e)),
    };
    let mut scan = Scan::default();
    for entry in entries {
        let path = entry.map_err(io_err(&dir))?.path();
        if path.extension().is_none_or(|e| e != "json") {
            continue;
        }
        let parsed = match std::fs::read(&path) {
            Ok(text) => serde_json::from_slice::<Record>(&text).map_err(|e| e.to_string()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            // A read that failed (EMFILE, EIO, ...) says nothing about the record:
            // the scan fails as a whole and is retried, nothing is set aside.
            Err(e) => return Err(io_err(&path)(e)),
        };
        // The file name is the key every later write and removal uses.
        let parsed = parsed.and_then(|rec| {
            let stem = path.file_stem().and_then(|s| s.to_str());
            if stem == Some(rec.spec.pod.uid.as_str()) {
                Ok(rec)
            } else {
                Err(format!(
                    "holds the record of pod uid {:?}",
                    rec.spec.pod.uid
                ))
            }
        });
        match parsed {
            Ok(rec) => scan.records.push(rec),
            Err(message) => scan.corrupt.push(CorruptRecord { path, message }),
        }
    }
    scan.records.sort_by_key(|r| r.created_at);
    Ok(scan)
}

/// Reads every instance record in a state directory (what `vkd sim list`
/// shows); a corrupt one is an error naming it ([`scan_records`] reads past it).
pub fn read_records(state_dir: &Path) -> Result<Vec<Record>, StateError> {
    let scan = scan_records(state_dir)?;
    match scan.corrupt.into_iter().next() {
        Some(c) => Err(StateError::Corrupt {
            path: c.path.display().to_string(),
            message: c.message,
        }),
        None => Ok(scan.records),
    }
}

#[derive(Debug, Default)]
pub(crate) struct HostUsage {
    pub(crate) cpu_millis: u64,
    pub(crate) memory_bytes: u64,
    pub(crate) pods: u32,
    pub(crate) gpus: BTreeSet<String>,
    pub(crate) ips: BTreeSet<u32>,
}

#[derive(Debug, Default)]
pub(crate) struct State {
    /// Boxed, so the map's spare slots cost a pointer each, not a record.
    pub(crate) records: HashMap<String, Box<Record>>,
    pub(crate) usage: HashMap<String, HostUsage>,
    pub(crate) tickers: BTreeSet<String>,
    /// The hosts with everything free, as the fleet file says now.
    pub(crate) hosts: Vec<vkd_provider::HostSlice>,
    /// The records directory's modification time at the last look for
    /// records written from outside ([`create_by_hand`]).
    pub(crate) instances_mtime: Option<SystemTime>,
    /// The fleet file's modification time when its hosts were last read.
    pub(crate) fleet_mtime: Option<SystemTime>,
    pub(crate) fleet_checked: Option<std::time::Instant>,
}

impl State {
    pub(crate) fn account(&mut self, rec: &Record, add: bool) {
        let u = self.usage.entry(rec.placement.host.clone()).or_default();
        let r = rec.spec.resources;
        let ip = ip_index(&rec.ip);
        if add {
            u.cpu_millis = u.cpu_millis.saturating_add(r.cpu_millis);
            u.memory_bytes = u.memory_bytes.saturating_add(r.memory_bytes);
            u.pods = u.pods.saturating_add(1);
            u.gpus.extend(rec.placement.gpu_ids.iter().cloned());
            u.ips.extend(ip);
        } else {
            u.cpu_millis = u.cpu_millis.saturating_sub(r.cpu_millis);
            u.memory_bytes = u.memory_bytes.saturating_sub(r.memory_bytes);
            u.pods = u.pods.saturating_sub(1);
            for g in &rec.placement.gpu_ids {
                u.gpus.remove(g);
            }
            if let Some(ip) = ip {
                u.ips.remove(&ip);
            }
        }
    }
}

/// The host-local part of a pod IP (`10.H.x.y` -> x*256+y).
pub(crate) fn ip_index(ip: &str) -> Option<u32> {
    let mut parts = ip.split('.').skip(2).map(|p| p.parse::<u32>().ok());
    Some(parts.next()?? * 256 + parts.next()??)
}
