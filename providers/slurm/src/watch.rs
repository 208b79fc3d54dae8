//! What Slurm says of the provider's jobs: one `squeue` for every Pod,
//! shared by the callers that wait for it and kept for a poll interval, and
//! the change events vkd reacts to, from what changed between two polls (a
//! job's state, reason or node; a container's record).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use tokio_util::sync::CancellationToken;
use vkd_provider::{InstanceEvent, Result};

use crate::instance::uid_of;
use crate::pod_dir::pods_root;
use crate::slurm::JobRow;
use crate::{SlurmProvider, lock, slurm_error};

/// What `squeue` said last, by Pod UID.
#[derive(Debug, Default)]
pub(crate) struct Jobs {
    rows: Arc<HashMap<String, JobRow>>,
    at: Option<Instant>,
}

impl SlurmProvider {
    /// The jobs by Pod UID, asked of Slurm when the last answer is older than `max_age`.
    pub(crate) async fn jobs(&self, max_age: Duration) -> Result<Arc<HashMap<String, JobRow>>> {
        let fresh = |jobs: &Jobs| {
            jobs.at
                .filter(|at| at.elapsed() <= max_age)
                .map(|_| Arc::clone(&jobs.rows))
        };
        if let Some(rows) = fresh(&lock(&self.inner.jobs)) {
            return Ok(rows);
        }
        let asked = Instant::now();
        let _turn = self.inner.refreshing.lock().await;
        {
            let jobs = lock(&self.inner.jobs);
            if jobs.at.is_some_and(|at| at >= asked) {
                return Ok(Arc::clone(&jobs.rows));
            }
        }
        let rows = self.inner.config.slurm.jobs().await.map_err(slurm_error)?;
        let mut by_uid: HashMap<String, JobRow> = HashMap::new();
        for row in rows {
            let Some(uid) = uid_of(&row.name) else {
                continue;
            };
            // Of two jobs for one Pod (never made here), the live and newest one.
            let better = by_uid
                .get(uid)
                .is_none_or(|old| (row.active(), row.id) > (old.active(), old.id));
            if better {
                by_uid.insert(uid.to_owned(), row);
            }
        }
        let rows = Arc::new(by_uid);
        *lock(&self.inner.jobs) = Jobs {
            rows: Arc::clone(&rows),
            at: Some(Instant::now()),
        };
        Ok(rows)
    }

    pub(crate) fn remember(&self, uid: &str, row: JobRow) {
        // Copied only while a caller still holds the last answer.
        Arc::make_mut(&mut lock(&self.inner.jobs).rows).insert(uid.to_owned(), row);
    }

    pub(crate) fn changed(&self, uid: &str) {
        let _ = self.inner.events.send(InstanceEvent::Changed {
            uid: uid.to_owned(),
        });
    }

    /// Asks Slurm what changed every poll interval, and says which Pods did.
    pub(crate) async fn watch(self, shutdown: CancellationToken) {
        let mut seen: HashMap<String, String> = HashMap::new();
        let mut tick = tokio::time::interval(self.inner.config.poll);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                () = shutdown.cancelled() => return,
            }
            let Ok(rows) = self.jobs(self.inner.config.poll / 2).await else {
                continue;
            };
            let mut now: HashMap<String, String> = HashMap::new();
            for (uid, row) in rows.iter() {
                now.insert(
                    uid.clone(),
                    format!("{}|{}|{}", row.state, row.reason, row.nodes),
                );
            }
            if let Ok(dirs) = std::fs::read_dir(pods_root(self.state())) {
                for entry in dirs.flatten() {
                    let uid = entry.file_name().to_string_lossy().into_owned();
                    let Ok(pod) = self.pod(&uid) else { continue };
                    let stamp = pod
                        .changed_at()
                        .and_then(|t| t.duration_since(SystemTime::UNIX_EPOCH).ok())
                        .map_or(0, |d| d.as_nanos());
                    now.entry(uid).or_default().push_str(&format!("|{stamp}"));
                }
            }
            for (uid, print) in &now {
                if seen.get(uid) != Some(print) {
                    self.changed(uid);
                }
            }
            for uid in seen.keys().filter(|u| !now.contains_key(*u)) {
                self.changed(uid);
            }
            seen = now;
        }
    }
}
