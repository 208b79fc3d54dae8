//! Instances written into the sim's state from outside the daemon, as
//! someone starting one with a backend's own tool would leave them (`vkd sim
//! create`): vkd did not make them, and a running daemon's backend holds them
//! from its next list.

use std::path::Path;
use std::time::SystemTime;

use vkd_provider::InstanceSpec;

use crate::{Record, SimProvider, State, StateError, io_err, valid_uid};

/// Writes an instance record into a state directory from outside the
/// daemon (`vkd sim create`): an instance vkd did not make, as a person
/// starting one with the backend's own tool would leave. A running daemon's
/// backend holds it from its next list on. Refuses a UID that has a record.
pub fn create_by_hand(
    state_dir: &Path,
    node: &str,
    pod: vkd_provider::PodRef,
    host: &str,
    epoch: u64,
) -> Result<Record, StateError> {
    let dir = state_dir.join("instances");
    std::fs::create_dir_all(&dir).map_err(io_err(&dir))?;
    let path = dir.join(format!("{}.json", pod.uid));
    let corrupt = |message: String| StateError::Corrupt {
        path: path.display().to_string(),
        message,
    };
    if valid_uid(&pod.uid).is_err() {
        return Err(corrupt(format!(
            "{:?} is not a UID the sim can store",
            pod.uid
        )));
    }
    if path.exists() {
        return Err(corrupt("an instance of this Pod UID exists".into()));
    }
    let spec: InstanceSpec = serde_json::from_value(serde_json::json!({
        "pod": pod,
        "node": node,
        "containers": [{"name": "main", "image": "example/app:1"}],
        "resources": {"cpu_millis": 0, "memory_bytes": 0, "gpus": 0},
        "restart_policy": "Always",
        "placement": {"host": host},
    }))
    .map_err(|e| corrupt(e.to_string()))?;
    let rec = Record {
        id: format!("sim-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]),
        spec,
        epoch,
        created_at: SystemTime::now(),
        placement: vkd_provider::Placement {
            host: host.to_owned(),
            gpu_ids: Vec::new(),
        },
        ip: String::new(),
        stop_at: None,
    };
    let bytes = serde_json::to_vec(&rec).map_err(|e| corrupt(e.to_string()))?;
    SimProvider::write_atomic(&path, &bytes)?;
    Ok(rec)
}

impl SimProvider {
    /// Holds the records written into the directory from outside since the
    /// last look ([`create_by_hand`]): the backend has them, as a real one has
    /// an instance someone started by hand. Looked for only when the
    /// directory changed; the daemon's own records are all held already.
    pub(crate) fn pick_up_outside_records(&self, st: &mut State) {
        let dir = self.inner.dir.join("instances");
        let mtime = std::fs::metadata(&dir).and_then(|m| m.modified()).ok();
        if mtime.is_none() || mtime == st.instances_mtime {
            return;
        }
        st.instances_mtime = mtime;
        let Ok(entries) = std::fs::read_dir(&dir) else {
            return;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            let Some(uid) = path
                .file_stem()
                .and_then(|s| s.to_str())
                .filter(|_| path.extension().is_some_and(|e| e == "json"))
            else {
                continue;
            };
            if st.records.contains_key(uid) {
                continue;
            }
            let parsed = std::fs::read(&path)
                .ok()
                .and_then(|b| serde_json::from_slice::<Record>(&b).ok())
                .filter(|r| r.spec.pod.uid == uid);
            if let Some(rec) = parsed {
                tracing::warn!(instance = %rec.id, pod_uid = uid, "sim: holds an instance written into its state from outside");
                st.account(&rec, true);
                st.records.insert(uid.to_owned(), Box::new(rec));
            }
        }
    }
}
