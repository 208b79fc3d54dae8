//! A simulated GPU fleet: hosts from a fleet file, instances whose containers
//! behave as their Pod's annotations say, latencies and injected faults.
//!
//! The backend's state lives in a directory (`instances/<pod-uid>.json`,
//! `fences/<node>`), written before a call returns, so it outlives the daemon: a
//! restarted vkd finds the same instances, and `vkd sim list --state-dir DIR`
//! shows them from outside the daemon. Container states are derived from the
//! creation time (see [`behaviour`]), so the simulation keeps "running" while no
//! daemon is up. Init containers complete (exit 0) the moment an instance
//! starts; sidecars (`restart_always`) start then and stop when the last
//! container ends for good.
//!
//! A record that no longer parses (a truncated file, say) is moved aside to
//! `<uid>.json.corrupt-<unix-ms>` with an error in the log naming it; only its
//! own Pod is affected (the daemon sees the instance lost). A fence file that
//! holds no epoch refuses every mutation for its node, by name, until repaired.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use futures::StreamExt;
use futures::stream::BoxStream;
use tokio::sync::broadcast;
use tokio_stream::wrappers::BroadcastStream;
use vkd_provider::{
    Admission, Capabilities, Capacity, ContainerStatus, Fence, Health, Instance, InstanceEvent,
    InstanceSpec, Provider, ProviderError, Result,
};

pub mod behaviour;
mod by_hand;
pub mod fleet;
mod state;
pub mod streams;
mod usage;

pub use by_hand::create_by_hand;
pub use fleet::{Fleet, FleetError};
pub use state::{CorruptRecord, Record, Scan, StateError, read_records, scan_records};
use state::{State, io_err};

use behaviour::Behaviour;

#[derive(Debug)]
struct Inner {
    fleet: Fleet,
    dir: PathBuf,
    state: Mutex<State>,
    events: broadcast::Sender<InstanceEvent>,
    fences: vkd_provider::fence::FenceBook,
    /// Corrupt records moved aside since open.
    corrupt: std::sync::atomic::AtomicU64,
}

/// The simulated backend. Cheap to clone.
#[derive(Clone, Debug)]
pub struct SimProvider {
    inner: Arc<Inner>,
}

fn valid_uid(uid: &str) -> Result<()> {
    if uid.is_empty()
        || uid.len() > 128
        || !uid.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
    {
        return Err(ProviderError::invalid(
            "InvalidUID",
            format!("pod uid {uid:?} is not a UID the sim backend can store"),
        ));
    }
    Ok(())
}

impl SimProvider {
    /// Opens (creating if needed) the state directory and loads what it holds.
    pub fn open(fleet: Fleet, state_dir: &Path) -> Result<Self, StateError> {
        for sub in ["instances", "fences"] {
            let d = state_dir.join(sub);
            std::fs::create_dir_all(&d).map_err(io_err(&d))?;
        }
        let (events, _) = broadcast::channel(4096);
        let provider = Self {
            inner: Arc::new(Inner {
                fleet,
                dir: state_dir.to_owned(),
                state: Mutex::new(State::default()),
                events,
                fences: vkd_provider::fence::FenceBook::new(&state_dir.join("fences"))
                    .map_err(io_err(&state_dir.join("fences")))?,
                corrupt: std::sync::atomic::AtomicU64::new(0),
            }),
        };
        {
            let mut st = provider.state();
            st.hosts = provider.inner.fleet.hosts.clone();
            st.fleet_mtime = provider.fleet_mtime();
        }
        provider.reload()?;
        Ok(provider)
    }

    pub fn fleet(&self) -> &Fleet {
        &self.inner.fleet
    }

    fn fleet_mtime(&self) -> Option<SystemTime> {
        let path = self.inner.fleet.source.as_ref()?;
        std::fs::metadata(path).and_then(|m| m.modified()).ok()
    }

    /// Capacity can change over time: when the fleet file changed (checked at
    /// most once a second), its hosts are read again. Latencies and faults stay
    /// as they were at start. A file that no longer parses keeps the old hosts.
    fn refresh_hosts(&self, st: &mut State) {
        if st
            .fleet_checked
            .is_some_and(|t| t.elapsed() < Duration::from_secs(1))
        {
            return;
        }
        st.fleet_checked = Some(std::time::Instant::now());
        let mtime = self.fleet_mtime();
        if mtime == st.fleet_mtime {
            return;
        }
        st.fleet_mtime = mtime;
        let Some(path) = &self.inner.fleet.source else {
            return;
        };
        match Fleet::load(path) {
            Ok(f) => st.hosts = f.hosts,
            Err(e) => {
                tracing::warn!(error = %e, "sim: fleet file changed but does not load; keeping the old hosts")
            }
        }
    }

    pub(crate) fn state(&self) -> MutexGuard<'_, State> {
        // A poisoned lock only means a panic elsewhere; the data is still consistent
        // because every mutation is completed before the guard drops.
        self.inner.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Corrupt instance records moved aside since the provider opened.
    pub fn corrupt_records(&self) -> u64 {
        self.inner
            .corrupt
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Reads the records from disk again (after another daemon may have acted).
    /// Blocking file I/O: async callers run it on the blocking pool.
    fn reload(&self) -> Result<(), StateError> {
        let scan = scan_records(&self.inner.dir)?;
        for c in &scan.corrupt {
            self.quarantine(c);
        }
        self.report_bad_fences();
        let mut st = self.state();
        st.records.clear();
        st.usage.clear();
        for rec in scan.records {
            st.account(&rec, true);
            st.records.insert(rec.spec.pod.uid.clone(), Box::new(rec));
        }
        Ok(())
    }

    /// Moves a corrupt record aside (kept for a look, out of every later
    /// scan) and says so loudly; its Pod's instance is then lost, no other.
    fn quarantine(&self, c: &CorruptRecord) {
        self.inner
            .corrupt
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let ms = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis());
        let mut aside = c.path.clone().into_os_string();
        aside.push(format!(".corrupt-{ms}"));
        let aside = PathBuf::from(aside);
        match std::fs::rename(&c.path, &aside) {
            Ok(()) => tracing::error!(
                path = %c.path.display(),
                moved_to = %aside.display(),
                error = %c.message,
                "sim: corrupt instance record moved aside; its Pod's instance is lost"
            ),
            // Not moved (a read-only directory, say): skipped now, reported
            // again at the next load.
            Err(e) => tracing::error!(
                path = %c.path.display(),
                error = %c.message,
                rename_error = %e,
                "sim: corrupt instance record skipped; its Pod's instance is lost"
            ),
        }
    }

    /// Says at load which nodes' fence files are corrupt; their mutations are
    /// refused (by [`vkd_provider::fence::FenceBook`]) until they are repaired.
    fn report_bad_fences(&self) {
        let dir = self.inner.dir.join("fences");
        let Ok(entries) = std::fs::read_dir(&dir) else {
            return;
        };
        for entry in entries.flatten() {
            let name = entry.file_name();
            let Some(node) = name.to_str().filter(|n| !n.starts_with('.')) else {
                continue; // the fence lock and temporary files
            };
            if let Err(e) = self.inner.fences.current(node) {
                tracing::error!(node, error = %e, "sim: fence file unusable");
            }
        }
    }

    fn record_path(&self, uid: &str) -> PathBuf {
        self.inner.dir.join("instances").join(format!("{uid}.json"))
    }

    fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), StateError> {
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, bytes).map_err(io_err(&tmp))?;
        std::fs::rename(&tmp, path).map_err(io_err(path))
    }

    /// Refuses a stale epoch, also one another process recorded; records a
    /// newer one durably. The guard holds the fence lock until the caller's
    /// mutation is done. Taken on the blocking pool and before the state lock,
    /// so waiting for another daemon's lock stalls neither the runtime nor
    /// this provider's other calls.
    async fn check_fence(&self, fence: &Fence) -> Result<vkd_provider::fence::FenceGuard> {
        self.inner.fences.check_async(fence).await
    }

    fn behaviour(spec: &InstanceSpec) -> Result<Behaviour> {
        behaviour::from_annotations(&spec.annotations)
            .map_err(|m| ProviderError::invalid("UnsupportedBehavior", m))
    }

    /// The hosts with what is free on each now.
    fn free_hosts(&self, st: &State) -> Vec<vkd_provider::HostSlice> {
        st.hosts
            .iter()
            .map(|h| {
                let mut h = h.clone();
                if let Some(u) = st.usage.get(&h.name) {
                    h.cpu_millis_free = h.cpu_millis_total.saturating_sub(u.cpu_millis);
                    h.memory_bytes_free = h.memory_bytes_total.saturating_sub(u.memory_bytes);
                    h.hold(&u.gpus);
                    h.pods_running = u.pods;
                }
                h
            })
            .collect()
    }

    fn decide(&self, st: &State, spec: &InstanceSpec) -> Admission {
        vkd_provider::topology::decide(&st.hosts, &self.free_hosts(st), spec)
    }

    fn observe(&self, rec: &Record, now: SystemTime) -> (Instance, Option<SystemTime>) {
        let b = Self::behaviour(&rec.spec).unwrap_or(Behaviour {
            kind: behaviour::Kind::Run,
            exit_code: 0,
            run_for: Duration::ZERO,
            crash_after: None,
            stop_delay: Duration::ZERO,
            cpu_usage_millis: None,
            memory_usage_bytes: None,
            gpu_utilization_percent: None,
            gpu_memory_usage_bytes: None,
        });
        let lat = &self.inner.fleet.latency;
        let observed: Vec<_> = rec
            .spec
            .containers
            .iter()
            .map(|_| behaviour::observe(&b, rec.spec.restart_policy, lat, rec.created_at, now))
            .collect();
        let phase = behaviour::phase(&observed);
        let mut next = observed.iter().filter_map(|o| o.next_change).min();
        if let Some(stop) = rec.stop_at {
            next = Some(next.map_or(stop, |n| n.min(stop)));
        }
        let started_at = observed
            .iter()
            .filter_map(|o| match &o.state {
                vkd_provider::ContainerState::Running { started_at } => Some(*started_at),
                _ => o.last_termination.as_ref().and_then(|t| t.started_at),
            })
            .min();
        let init_containers = Self::observe_init(rec, lat, &observed, phase, now);
        let has_init = !rec.spec.init_containers.is_empty();
        let containers = rec
            .spec
            .containers
            .iter()
            .zip(observed)
            .map(|(c, mut o)| {
                let creating = matches!(&o.state, vkd_provider::ContainerState::Waiting { reason, .. } if reason == "ContainerCreating");
                if creating && has_init {
                    // As the kubelet: a container waits for the init containers.
                    o.state = vkd_provider::ContainerState::Waiting {
                        reason: "PodInitializing".into(),
                        message: None,
                    };
                }
                ContainerStatus {
                    name: c.name.clone(),
                    container_id: (!creating).then(|| format!("sim://{}-{}", rec.id, c.name)),
                    state: o.state,
                    last_termination: o.last_termination,
                    ready: o.ready && rec.stop_at.is_none(),
                    restart_count: o.restart_count,
                    started: None,
                }
            })
            .collect();
        let instance = Instance {
            id: rec.id.clone(),
            owner: rec.spec.pod.clone(),
            node: rec.spec.node.clone(),
            epoch: rec.epoch,
            phase,
            containers,
            ip: Some(rec.ip.clone()),
            host: Some(rec.placement.host.clone()),
            created_at: rec.created_at,
            started_at,
            message: None,
            init_containers,
            // Not simulated: start_ephemeral answers Unsupported.
            ephemeral_containers: Vec::new(),
            host_ip: None,
            events: Vec::new(),
        };
        (instance, next)
    }

    /// The init containers: each regular one completes the moment the instance
    /// starts; a sidecar (`restart_always`) starts then, is ready once the
    /// containers would be, and is stopped (exit 0) when the last container ends
    /// for good.
    fn observe_init(
        rec: &Record,
        lat: &fleet::Latency,
        containers: &[behaviour::Observed],
        phase: vkd_provider::InstancePhase,
        now: SystemTime,
    ) -> Vec<ContainerStatus> {
        use vkd_provider::{ContainerState, InstancePhase, Terminated};
        let start = rec.created_at.checked_add(lat.start).filter(|s| now >= *s);
        let ended = matches!(phase, InstancePhase::Succeeded | InstancePhase::Failed);
        let last_end = containers
            .iter()
            .filter_map(|o| match &o.state {
                ContainerState::Terminated(t) => Some(t.finished_at),
                _ => None,
            })
            .max();
        rec.spec
            .init_containers
            .iter()
            .map(|c| {
                let (state, ready, started) = match start {
                    None => (
                        ContainerState::Waiting {
                            reason: "PodInitializing".into(),
                            message: None,
                        },
                        false,
                        false,
                    ),
                    Some(start) if c.restart_always && !ended => (
                        ContainerState::Running { started_at: start },
                        rec.stop_at.is_none()
                            && start.checked_add(lat.ready).is_some_and(|r| now >= r),
                        true,
                    ),
                    Some(start) => {
                        let finished_at = if c.restart_always {
                            last_end.unwrap_or(start)
                        } else {
                            start
                        };
                        (
                            ContainerState::Terminated(Terminated {
                                exit_code: 0,
                                reason: "Completed".into(),
                                message: None,
                                started_at: Some(start),
                                finished_at,
                            }),
                            false,
                            false,
                        )
                    }
                };
                ContainerStatus {
                    name: c.name.clone(),
                    container_id: start.map(|_| format!("sim://{}-{}", rec.id, c.name)),
                    state,
                    last_termination: None,
                    ready,
                    restart_count: 0,
                    started: Some(started),
                }
            })
            .collect()
    }

    /// Removes the record if its stop time has passed; true if it is gone.
    fn reap(&self, st: &mut State, uid: &str, now: SystemTime) -> Result<bool> {
        let Some(rec) = st.records.get(uid) else {
            return Ok(true);
        };
        if rec.stop_at.is_none_or(|t| t > now) {
            return Ok(false);
        }
        let path = self.record_path(uid);
        match std::fs::remove_file(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(io_err(&path)(e).into()),
        }
        if let Some(rec) = st.records.remove(uid) {
            vkd_provider::release_spare(&mut st.records);
            st.account(&rec, false);
            self.journal("stopped", &rec, rec.stop_at.unwrap_or(now));
        }
        Ok(true)
    }

    /// Appends to `journal.jsonl`: when each instance was created and when it
    /// stopped, by the backend's clock (what a test holds against the control plane).
    fn journal(&self, event: &str, rec: &Record, at: SystemTime) {
        use std::io::Write;
        let at_ms = at
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis());
        let line = serde_json::json!({
            "atMs": at_ms,
            "event": event,
            "podUID": rec.spec.pod.uid,
            "pod": rec.spec.pod.to_string(),
            "instance": rec.id,
            "node": rec.spec.node,
            "epoch": rec.epoch,
        });
        let path = self.inner.dir.join("journal.jsonl");
        let written = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .and_then(|mut f| writeln!(f, "{line}"));
        if let Err(e) = written {
            tracing::warn!(path = %path.display(), error = %e, "sim: writing the journal");
        }
    }

    /// Wakes at each future state change of an instance and announces it.
    fn watch(&self, uid: &str) {
        if !self.state().tickers.insert(uid.to_owned()) {
            return;
        }
        let this = self.clone();
        let uid = uid.to_owned();
        let Ok(handle) = tokio::runtime::Handle::try_current() else {
            self.state().tickers.remove(&uid);
            return;
        };
        handle.spawn(async move {
            // However the ticker ends (a panic included), the instance is
            // free to get a new one: none is left marked as watched by a
            // task that is gone, with its changes never announced.
            struct Ticking(SimProvider, String);
            impl Drop for Ticking {
                fn drop(&mut self) {
                    self.0.state().tickers.remove(&self.1);
                }
            }
            let _ticking = Ticking(this.clone(), uid.clone());
            loop {
                let now = SystemTime::now();
                let next = {
                    let st = this.state();
                    st.records.get(&uid).and_then(|r| this.observe(r, now).1)
                };
                let Some(next) = next else { break };
                tokio::time::sleep(next.duration_since(now).unwrap_or_default()).await;
                let _ = this.get(&uid).await;
                let _ = this
                    .inner
                    .events
                    .send(InstanceEvent::Changed { uid: uid.clone() });
            }
        });
    }

    fn roll(rate: f64) -> bool {
        rate > 0.0 && fastrand::f64() < rate
    }
}

#[async_trait]
impl Provider for SimProvider {
    fn name(&self) -> &str {
        "sim"
    }

    fn capabilities(&self) -> Capabilities {
        use vkd_provider::Support::Supported;
        Capabilities {
            logs: Supported,
            exec: Supported,
            attach: Supported,
            port_forward: Supported,
            stats: Supported,
            pod_network: Supported,
            gpu_usage: Supported,
            ..Default::default()
        }
    }

    async fn health(&self) -> Health {
        if self.inner.fleet.faults.unhealthy {
            Health::Unhealthy {
                reason: "SimFaultInjected".into(),
                message: "the fleet file sets faults.unhealthy".into(),
            }
        } else {
            Health::Healthy
        }
    }

    async fn capacity(&self) -> Result<Capacity> {
        let mut st = self.state();
        self.refresh_hosts(&mut st);
        Ok(Capacity {
            hosts: self.free_hosts(&st),
            kind: self.inner.fleet.kind,
            observed_at: SystemTime::now(),
            refresh_interval: self.inner.fleet.refresh_interval,
        })
    }

    async fn takeover(&self, fence: &Fence) -> Result<()> {
        let fenced = self.check_fence(fence).await?;
        // Another daemon may have created or deleted instances since this one
        // last read the state directory.
        let this = self.clone();
        tokio::task::spawn_blocking(move || this.reload())
            .await
            .map_err(|e| ProviderError::transient(format!("sim: reloading the state: {e}")))??;
        drop(fenced);
        let uids: Vec<String> = self.state().records.keys().cloned().collect();
        for uid in uids {
            self.watch(&uid);
        }
        Ok(())
    }

    async fn admit(&self, spec: &InstanceSpec) -> Result<Admission> {
        valid_uid(&spec.pod.uid)?;
        Self::behaviour(spec)?;
        latency(self.inner.fleet.latency.admit).await;
        let mut st = self.state();
        self.refresh_hosts(&mut st);
        Ok(self.decide(&st, spec))
    }

    async fn create(&self, fence: &Fence, spec: &InstanceSpec) -> Result<Instance> {
        valid_uid(&spec.pod.uid)?;
        Self::behaviour(spec)?;
        if spec.node != fence.node {
            return Err(ProviderError::invalid(
                "NodeMismatch",
                format!(
                    "pod is for node {} but the fence is for {}",
                    spec.node, fence.node
                ),
            ));
        }
        latency(self.inner.fleet.latency.create).await;
        if Self::roll(self.inner.fleet.faults.create_error_rate) {
            return Err(ProviderError::transient(
                "injected create fault (faults.create_error_rate)",
            ));
        }
        let uid = spec.pod.uid.clone();
        let fenced = self.check_fence(fence).await?;
        let instance = {
            let mut st = self.state();
            let now = SystemTime::now();
            if let Some(rec) = st.records.get(&uid) {
                self.observe(rec, now).0
            } else {
                let placement = match self.decide(&st, spec) {
                    Admission::Fits(p) => p,
                    Admission::Queued { reason } => {
                        return Err(ProviderError::Rejected { message: reason });
                    }
                    Admission::Rejected { reason, message } => {
                        return Err(ProviderError::Rejected {
                            message: format!("{reason}: {message}"),
                        });
                    }
                };
                let host_index = self
                    .inner
                    .fleet
                    .hosts
                    .iter()
                    .position(|h| h.name == placement.host)
                    .unwrap_or(0);
                let used = st.usage.get(&placement.host).map(|u| &u.ips);
                // Past the highest address in use first (no scan of thousands of
                // Pods on a busy host), then the lowest gap.
                let above = used.map_or(2, |u| u.last().map_or(2, |l| l + 1));
                let ip_n = (above < 65_534)
                    .then_some(above)
                    .or_else(|| (2..65_534u32).find(|n| used.is_none_or(|u| !u.contains(n))))
                    .ok_or_else(|| ProviderError::Rejected {
                        message: format!("no pod IPs left on host {}", placement.host),
                    })?;
                let rec = Record {
                    id: format!("sim-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]),
                    spec: InstanceSpec {
                        placement: Some(placement.clone()),
                        ..spec.clone()
                    },
                    epoch: fence.epoch,
                    created_at: now,
                    placement,
                    ip: format!(
                        "10.{}.{}.{}",
                        100 + (host_index % 150),
                        ip_n / 256,
                        ip_n % 256
                    ),
                    stop_at: None,
                };
                let bytes = serde_json::to_vec(&rec)
                    .map_err(|e| ProviderError::transient(e.to_string()))?;
                Self::write_atomic(&self.record_path(&uid), &bytes)?;
                st.account(&rec, true);
                let instance = self.observe(&rec, now).0;
                self.journal("created", &rec, now);
                st.records.insert(uid.clone(), Box::new(rec));
                instance
            }
        };
        drop(fenced);
        self.watch(&uid);
        let _ = self.inner.events.send(InstanceEvent::Changed { uid });
        Ok(instance)
    }

    async fn get(&self, uid: &str) -> Result<Option<Instance>> {
        let now = SystemTime::now();
        let mut st = self.state();
        if self.reap(&mut st, uid, now)? {
            return Ok(None);
        }
        Ok(st.records.get(uid).map(|r| self.observe(r, now).0))
    }

    async fn delete(&self, fence: &Fence, uid: &str, grace: Duration) -> Result<()> {
        valid_uid(uid)?;
        if Self::roll(self.inner.fleet.faults.delete_error_rate) {
            return Err(ProviderError::transient(
                "injected delete fault (faults.delete_error_rate)",
            ));
        }
        let fenced = self.check_fence(fence).await?;
        {
            let mut st = self.state();
            let now = SystemTime::now();
            let Some(rec) = st.records.get(uid) else {
                return Ok(());
            };
            let delay = Self::behaviour(&rec.spec)
                .map(|b| b.stop_delay)
                .unwrap_or_default();
            // A stop past what the clock holds would never come: stop now.
            let stop_at = now.checked_add(delay.min(grace)).unwrap_or(now);
            if rec.stop_at.is_none_or(|t| t > stop_at) {
                let mut rec = rec.clone();
                rec.stop_at = Some(stop_at);
                let bytes = serde_json::to_vec(&rec)
                    .map_err(|e| ProviderError::transient(e.to_string()))?;
                Self::write_atomic(&self.record_path(uid), &bytes)?;
                st.records.insert(uid.to_owned(), rec);
            }
            self.reap(&mut st, uid, now)?;
        }
        drop(fenced);
        self.watch(uid);
        let _ = self.inner.events.send(InstanceEvent::Changed {
            uid: uid.to_owned(),
        });
        Ok(())
    }

    async fn list(&self, node: &str) -> Result<Vec<Instance>> {
        let now = SystemTime::now();
        let uids: Vec<String> = {
            let mut st = self.state();
            self.pick_up_outside_records(&mut st);
            let all: Vec<String> = st.records.keys().cloned().collect();
            let mut live = Vec::new();
            for uid in all {
                if !self.reap(&mut st, &uid, now)? {
                    live.push(uid);
                }
            }
            live
        };
        let mut out = Vec::new();
        for uid in uids {
            let observed = {
                let st = self.state();
                st.records
                    .get(&uid)
                    .filter(|r| r.spec.node == node)
                    .map(|r| self.observe(r, now))
            };
            if let Some((i, next)) = observed {
                // Only an instance with a change ahead needs a ticker (after a
                // restart, say); a steady one would get a task that ends at once.
                if next.is_some() {
                    self.watch(&uid);
                }
                out.push(i);
            }
        }
        out.sort_by_key(|r| r.created_at);
        Ok(out)
    }

    async fn logs(
        &self,
        uid: &str,
        container: &str,
        request: vkd_provider::LogRequest,
    ) -> Result<vkd_provider::Logs> {
        self.sim_logs(uid, container, request).await
    }

    async fn exec(
        &self,
        uid: &str,
        container: &str,
        command: Vec<String>,
        io: vkd_provider::StreamIo,
    ) -> Result<i32> {
        self.sim_exec(uid, container, command, io).await
    }

    async fn attach(&self, uid: &str, container: &str, io: vkd_provider::StreamIo) -> Result<()> {
        self.sim_attach(uid, container, io).await
    }

    async fn port_forward(
        &self,
        uid: &str,
        _port: u16,
        stream: Box<dyn vkd_provider::Duplex>,
    ) -> Result<()> {
        self.sim_port_forward(uid, stream).await
    }

    async fn stats(&self, uid: &str) -> Result<vkd_provider::PodStats> {
        self.sim_stats(uid).await
    }

    async fn describe(&self, uid: &str) -> Result<Vec<(String, String)>> {
        let st = self.state();
        let Some(r) = st.records.get(uid) else {
            return Ok(Vec::new());
        };
        let mut out = vec![
            ("sim instance".to_owned(), r.id.clone()),
            ("host".to_owned(), r.placement.host.clone()),
            (
                "GPUs".to_owned(),
                if r.placement.gpu_ids.is_empty() {
                    "none".to_owned()
                } else {
                    r.placement.gpu_ids.join(",")
                },
            ),
            ("made under epoch".to_owned(), r.epoch.to_string()),
            (
                "record".to_owned(),
                self.record_path(uid).display().to_string(),
            ),
        ];
        if let Some(stop) = r.stop_at {
            let left = stop
                .duration_since(SystemTime::now())
                .unwrap_or_default()
                .as_secs();
            out.push(("stop requested; gone in".to_owned(), format!("{left}s")));
        }
        Ok(out)
    }

    fn events(&self) -> BoxStream<'static, InstanceEvent> {
        BroadcastStream::new(self.inner.events.subscribe())
            .map(|r| r.unwrap_or(InstanceEvent::Resync))
            .boxed()
    }
}

/// Waits out a configured backend latency. Zero means no wait at all: a zero
/// `sleep` still waits for the timer's next tick, which under load is
/// milliseconds, and admission holds its turn across it.
async fn latency(d: Duration) {
    if !d.is_zero() {
        tokio::time::sleep(d).await;
    }
}

#[cfg(test)]
mod tests;
