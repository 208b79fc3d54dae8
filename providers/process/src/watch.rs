//! The provider's watch on its Pods: it reads the shims' status files and
//! turns their changes into instance events.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use vkd_provider::InstanceEvent;

use crate::sandbox::Sandbox;
use crate::{Inner, ProcessProvider};

/// How long a deleted instance whose shim has ended stays readable before the
/// watcher removes it (when no delete call removes it first).
const STOPPED_KEPT: Duration = Duration::from_secs(2);

/// Polls the sandboxes and announces changes; stops when the provider is dropped.
pub(super) fn run(inner: std::sync::Weak<Inner>) {
    let mut seen: HashMap<String, (Option<SystemTime>, bool)> = HashMap::new();
    // Sandboxes whose dead shim's leftovers were killed already.
    let mut ended: std::collections::HashSet<String> = std::collections::HashSet::new();
    // Stopped sandboxes (deletion asked, shim gone), since when.
    let mut stopped: HashMap<String, std::time::Instant> = HashMap::new();
    loop {
        std::thread::sleep(Duration::from_millis(250));
        let Some(inner) = inner.upgrade() else {
            return;
        };
        let mut now_seen = HashMap::new();
        if let Ok(entries) = std::fs::read_dir(inner.dir.join("pods")) {
            for e in entries.flatten() {
                let uid = e.file_name().to_string_lossy().into_owned();
                if uid.starts_with('.') {
                    continue;
                }
                let sb = Sandbox::new(e.path());
                let mtime = std::fs::metadata(sb.status())
                    .and_then(|m| m.modified())
                    .ok();
                let shim = sb.shim_process();
                let alive = shim.is_some_and(|p| p.alive());
                let provider = ProcessProvider {
                    inner: Arc::clone(&inner),
                };
                if !alive && sb.stop_requested().is_some() {
                    // Finishes a delete (the stop file is written only under a
                    // valid fence), after a moment: until then `get` still shows
                    // how each container ended, for the Pod's final status; the
                    // daemon's next delete call removes it at once.
                    let since = *stopped
                        .entry(uid.clone())
                        .or_insert_with(std::time::Instant::now);
                    if since.elapsed() >= STOPPED_KEPT {
                        if let Err(e) = provider.remove(&sb) {
                            eprintln!("process provider: removing sandbox {uid}: {e}");
                        }
                        continue;
                    }
                }
                // status.json is read only for a dead shim, not every tick for every Pod.
                let dead_unfinished = shim.is_some()
                    && !alive
                    && !ended.contains(&uid)
                    && !sb.read_status().ok().flatten().is_some_and(|s| s.done);
                if dead_unfinished && ended.insert(uid.clone()) {
                    // The supervisor died without ending the Pod (reported Failed):
                    // nothing may keep running for it.
                    provider.kill_leftovers(&sb);
                }
                now_seen.insert(uid, (mtime, alive));
            }
        }
        for (uid, v) in &now_seen {
            if seen.get(uid) != Some(v) {
                let _ = inner
                    .events
                    .send(InstanceEvent::Changed { uid: uid.clone() });
            }
        }
        for uid in seen.keys() {
            if !now_seen.contains_key(uid) {
                let _ = inner
                    .events
                    .send(InstanceEvent::Changed { uid: uid.clone() });
            }
        }
        ended.retain(|uid| now_seen.contains_key(uid));
        stopped.retain(|uid, _| now_seen.contains_key(uid));
        seen = now_seen;
    }
}
