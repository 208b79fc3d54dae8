//! The Pod controller: watches the Pods bound to this node, runs each as a backend
//! instance, writes their status, and finalizes their deletion once the backend
//! confirms the instance is gone.

#[cfg(test)]
mod controller_tests;
pub mod ephemeral;
pub mod eviction;
pub mod queue;
pub mod record;
pub mod services;
pub mod spec;
pub mod status;
#[cfg(test)]
mod test_support;
pub mod volume_refresh;

use std::collections::{HashMap, HashSet};
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use futures::StreamExt;
use governor::{DefaultDirectRateLimiter, Quota, RateLimiter};
use k8s_openapi::api::core::v1::{ObjectReference, Pod};
use kube::api::{DeleteParams, Patch, PatchParams, PostParams, Preconditions};
use kube::runtime::events::{Event as KubeEvent, EventType, Recorder, Reporter};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client};
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, info, info_span, warn};
use vkd_provider::{Admission, Fence, Instance, InstanceEvent, Provider, ProviderError, Support};

use queue::WorkQueue;
use record::{PodRecord, Stamp};
use status::Waiting;

/// How often a Pod that waits for backend capacity is looked at again.
const QUEUED_RECHECK: Duration = Duration::from_secs(5);
/// Pod annotation: how long this Pod may wait in the backend queue ("10m").
pub const QUEUE_TIMEOUT_ANNOTATION: &str = "vkd.io/queue-timeout";
/// How often a Pod whose ConfigMap, Secret or ServiceAccount is missing tries again.
const CONFIG_RECHECK: Duration = Duration::from_secs(5);
/// How often deletion is checked for confirmation while the backend stops an instance.
const DELETE_CONFIRM: Duration = Duration::from_millis(500);
/// Every record is reconciled at least this often, in case a backend event was lost.
const RESYNC: Duration = Duration::from_secs(60);
/// The kubelet's reason and message for a Pod past `activeDeadlineSeconds`.
pub const DEADLINE_REASON: &str = "DeadlineExceeded";
pub const DEADLINE_MESSAGE: &str = "Pod was active on the node longer than the specified deadline";
/// A Pod whose deadline is further away is looked at again after this long
/// (and on every resync), so no timer is kept for years.
const DEADLINE_RECHECK_MAX: Duration = Duration::from_secs(3600);
/// The first wait before a start that failed on an image is tried again;
/// it doubles up to [`IMAGE_BACKOFF_MAX`], as the kubelet's image back-off.
const IMAGE_BACKOFF: Duration = Duration::from_secs(10);
const IMAGE_BACKOFF_MAX: Duration = Duration::from_secs(300);

/// Why a Pod fails while its containers may still run, and how they stop.
struct Failure<'a> {
    reason: &'a str,
    message: &'a str,
    /// The grace period its containers get.
    grace: Duration,
    event_type: EventType,
}

/// The reporting controller of vkd's Pod Events: the kubelet's own name, as
/// the node's kubelet is what vkd is. Users and tools find a node's Pod
/// Events by it (`kubectl get events --field-selector source=kubelet`, which
/// the API server answers from reportingController for events.k8s.io Events).
/// The reporting instance is the node name, so which vkd reported it stays plain.
const EVENT_REPORTER: &str = "kubelet";

/// Pod Events being sent at once, beside the reconciles.
const EVENTS_IN_FLIGHT: usize = 32;
/// Pod Events waiting to be sent (about a kilobyte each). Beyond this many an
/// Event is dropped and counted (`vkd_events_dropped_total`), as the kubelet's
/// event broadcaster drops them: a busy API server must not slow creates, and
/// the Pod's status and the audit log still carry what the Event said.
const EVENTS_PENDING: usize = 1024;

#[derive(Debug, thiserror::Error)]
pub enum ReconcileError {
    #[error("provider: {0}")]
    Provider(#[from] ProviderError),
    #[error("kubernetes API: {0}")]
    Kube(#[from] kube::Error),
}

impl ReconcileError {
    /// A short cause for logs and metrics.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Self::Provider(e) => e.kind(),
            Self::Kube(_) => "kube_api",
        }
    }
}

/// What to do with a key after a successful reconcile.
#[derive(Debug, PartialEq, Eq)]
enum Action {
    Done,
    After(Duration),
    /// The instance was created by a create worker: another worker writes the
    /// status, so this one is free for the next new Pod at once.
    WriteLater,
}

/// Which keys a worker takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Lane {
    /// Any key; newly bound Pods when no other key waits.
    Any,
    /// Only newly bound Pods; their status is written by an `Any` worker.
    Create,
}

#[derive(Debug, Clone)]
pub struct Settings {
    pub node: String,
    pub host_ip: String,
    pub epoch: u64,
    pub concurrency: usize,
    /// Workers that serve only newly bound Pods (see `Action::WriteLater`).
    pub create_concurrency: usize,
    pub qps: u32,
    pub burst: u32,
    pub policy: spec::Policy,
    /// The backend host this node stands for (per-host mode), or `None` for all.
    pub host: Option<String>,
    /// How long a Pod may wait in the backend queue before it fails
    /// (`vkd.io/queue-timeout` on the Pod overrides it).
    pub queue_timeout: Duration,
    /// How often orphans and duplicates are collected (also after every sync).
    pub gc_interval: Duration,
    pub brake: crate::fencing::Brake,
    /// With no node lease renewal for this long, instances of Pods annotated
    /// `vkd.io/partition-policy: fence` are stopped.
    pub partition_fence_after: Duration,
    /// Publish Normal Events for each step (admitted, created, deleted), not only
    /// for queueing and failures.
    pub lifecycle_events: bool,
}

/// What the Pod controllers share with the rest of the daemon.
#[derive(Clone, Debug)]
pub struct Shared {
    pub metrics: Arc<crate::metrics::Metrics>,
    /// The leadership term they act in: a backend refusing its epoch ends it,
    /// and when it ends unrenewed they apply the partition policy first.
    pub term: crate::fencing::term::Term,
    /// Unix milliseconds of the last successful node lease renewal (0: none yet).
    pub last_lease_renewal: Arc<std::sync::atomic::AtomicU64>,
    /// Pod UIDs whose instance the partition policy stopped (kept across
    /// leadership terms, so the Pod later fails with the right reason).
    pub partition_fenced: Arc<Mutex<HashSet<String>>>,
    /// The cluster's Services, for the service environment variables.
    pub services: Option<services::Services>,
}

pub struct PodController {
    settings: Settings,
    client: Client,
    /// The Pod watch's own client, so its events never queue behind writes.
    watch_client: Client,
    provider: Arc<dyn Provider>,
    /// Boxed: a map's slots stay allocated at its largest size and are only
    /// 60-90% full, so a slot should be a pointer, not a whole record.
    records: Mutex<HashMap<String, Box<PodRecord>>>,
    queue: Arc<WorkQueue>,
    /// Pod writes wait here; the node lease uses another client and never does.
    limiter: Arc<DefaultDirectRateLimiter>,
    /// Events being sent: a worker hands its Event to a task and goes on; the
    /// task waits for one of these slots.
    event_slots: Arc<tokio::sync::Semaphore>,
    /// Events handed to tasks and not yet sent ([`EVENTS_PENDING`]).
    event_backlog: Arc<tokio::sync::Semaphore>,
    recorder: Recorder,
    synced: AtomicBool,
    admitter: crate::topology::Admitter,
    shared: Shared,
    gc_wake: tokio::sync::Notify,
    /// Orphans a collection pass decided to delete.
    approved_orphans: Mutex<HashSet<String>>,
    /// Instances being stopped because their Pod fails (its active deadline
    /// passed, or it is evicted), as last seen: the ends of their containers
    /// go into the Pod's final status.
    stopping_to_fail: Mutex<HashMap<String, Box<Instance>>>,
    /// Pods being evicted for breaking a storage limit, with the message.
    evicting: Mutex<HashMap<String, String>>,
    /// Instances without a Pod of their own (orphans and duplicates) by phase,
    /// as the last collection pass found them; with the Pods' own instances
    /// this is `vkd_backend_instances`, so a scrape never lists the backend.
    unowned_phases: Mutex<Vec<(String, i64)>>,
}

impl std::fmt::Debug for PodController {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PodController")
            .field("node", &self.settings.node)
            .finish_non_exhaustive()
    }
}

fn nz(n: u32) -> NonZeroU32 {
    NonZeroU32::new(n).unwrap_or(NonZeroU32::MIN)
}

impl PodController {
    pub fn new(
        settings: Settings,
        client: Client,
        watch_client: Client,
        provider: Arc<dyn Provider>,
        shared: Shared,
    ) -> Arc<Self> {
        let limiter = Arc::new(RateLimiter::direct(
            Quota::per_second(nz(settings.qps)).allow_burst(nz(settings.burst)),
        ));
        let recorder = Recorder::new(
            client.clone(),
            Reporter {
                controller: EVENT_REPORTER.into(),
                instance: Some(settings.node.clone()),
            },
        );
        let admitter = crate::topology::Admitter::new(Arc::clone(&provider), settings.host.clone());
        Arc::new(Self {
            admitter,
            shared,
            gc_wake: tokio::sync::Notify::new(),
            approved_orphans: Mutex::default(),
            stopping_to_fail: Mutex::default(),
            evicting: Mutex::default(),
            unowned_phases: Mutex::default(),
            settings,
            client,
            watch_client,
            provider,
            records: Mutex::default(),
            queue: WorkQueue::new(Duration::from_millis(200), Duration::from_secs(30)),
            limiter,
            event_slots: Arc::new(tokio::sync::Semaphore::new(EVENTS_IN_FLIGHT)),
            event_backlog: Arc::new(tokio::sync::Semaphore::new(EVENTS_PENDING)),
            recorder,
            synced: AtomicBool::new(false),
        })
    }

    /// True once the first full list of this node's Pods was processed.
    pub fn synced(&self) -> bool {
        self.synced.load(Ordering::Acquire)
    }

    /// The UID and container names of a Pod bound to this node.
    pub fn lookup(&self, namespace: &str, name: &str) -> Option<(String, Vec<String>)> {
        self.records()
            .values()
            .find(|r| &*r.namespace == namespace && &*r.name == name)
            .map(|r| {
                (
                    r.uid.to_string(),
                    r.containers
                        .iter()
                        .chain(r.init_containers.iter())
                        .chain(r.ephemeral.iter().flat_map(|e| e.containers.iter()))
                        .map(|c| c.name.to_string())
                        .collect(),
                )
            })
    }

    /// Every Pod bound to this node: UID, namespace, name.
    pub fn pods(&self) -> Vec<vkd_provider::PodRef> {
        self.records().values().map(|r| r.pod_ref()).collect()
    }

    pub fn node(&self) -> &str {
        &self.settings.node
    }

    pub fn provider(&self) -> &Arc<dyn Provider> {
        &self.provider
    }

    fn records(&self) -> MutexGuard<'_, HashMap<String, Box<PodRecord>>> {
        self.records.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn fence(&self) -> Fence {
        Fence {
            node: self.settings.node.clone(),
            epoch: self.settings.epoch,
        }
    }

    /// Runs until shutdown. A worker, the watch or the collector that stops
    /// before then stops the rest, and the error names it.
    pub async fn run(
        self: Arc<Self>,
        shutdown: CancellationToken,
    ) -> Result<(), crate::tasks::TaskError> {
        let mut tasks = crate::tasks::Critical::new(shutdown.clone());
        let node = &self.settings.node;
        let lanes = std::iter::repeat_n(Lane::Any, self.settings.concurrency).chain(
            std::iter::repeat_n(Lane::Create, self.settings.create_concurrency),
        );
        for (i, lane) in lanes.enumerate() {
            let (this, token) = (Arc::clone(&self), shutdown.clone());
            tasks.spawn(format!("pod worker {i} of node {node}"), async move {
                this.worker(token, lane).await;
                Ok::<(), std::convert::Infallible>(())
            });
        }
        macro_rules! task {
            ($name:literal, $method:ident) => {{
                let (this, token) = (Arc::clone(&self), shutdown.clone());
                tasks.spawn(format!("{} of node {node}", $name), async move {
                    this.$method(token).await;
                    Ok::<(), std::convert::Infallible>(())
                });
            }};
        }
        task!("pod watch", watch);
        task!("provider events", provider_events);
        task!("resync", resync);
        task!("collector", collect);
        task!("partition watch", partition_watch);
        task!("storage watch", storage_watch);
        let result = tasks.join().await;
        if let Some(why) = self.shared.term.unrenewed() {
            self.fence_for_partition(&why).await;
        }
        result
    }

    async fn watch(&self, shutdown: CancellationToken) {
        let pods: Api<Pod> = Api::all(self.watch_client.clone());
        let cfg =
            watcher::Config::default().fields(&format!("spec.nodeName={}", self.settings.node));
        let mut stream = watcher(pods, cfg).default_backoff().boxed();
        let mut seen: Option<HashSet<String>> = None;
        loop {
            let event = tokio::select! {
                _ = shutdown.cancelled() => return,
                e = stream.next() => e,
            };
            match event {
                None => return,
                Some(Err(e)) => warn!(error = %e, "pod watch failed; retrying"),
                Some(Ok(watcher::Event::Init)) => seen = Some(HashSet::new()),
                Some(Ok(watcher::Event::InitApply(pod))) => {
                    if let Some(uid) = self.upsert(&pod)
                        && let Some(seen) = seen.as_mut()
                    {
                        seen.insert(uid);
                    }
                }
                Some(Ok(watcher::Event::Apply(pod))) => {
                    self.upsert(&pod);
                }
                Some(Ok(watcher::Event::Delete(pod))) => {
                    if let Some(uid) = pod.metadata.uid {
                        let mut records = self.records();
                        records.remove(&uid);
                        vkd_provider::release_spare(&mut *records);
                        drop(records);
                        self.queue.add(&uid);
                    }
                }
                Some(Ok(watcher::Event::InitDone)) => {
                    // Pods that vanished while the watch was down count as deleted.
                    if let Some(seen) = seen.take() {
                        let gone: Vec<String> = self
                            .records()
                            .keys()
                            .filter(|uid| !seen.contains(*uid))
                            .cloned()
                            .collect();
                        for uid in gone {
                            self.records().remove(&uid);
                            self.queue.add(&uid);
                        }
                    }
                    if !self.synced.swap(true, Ordering::AcqRel) {
                        info!(
                            pods = self.records().len(),
                            "pod watch synced; collecting orphans"
                        );
                        self.gc_pass().await;
                    }
                }
            }
        }
    }

    /// Collects orphans and duplicates: after the first sync, whenever a Pod
    /// disappears, and every `gc_interval`.
    async fn collect(&self, shutdown: CancellationToken) {
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                () = self.gc_wake.notified() => {
                    // Let a burst of disappearances arrive, then look once.
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
                () = tokio::time::sleep(self.settings.gc_interval) => {}
            }
            if self.synced() {
                self.gc_pass().await;
            }
        }
    }

    /// One pass: instances without a Pod are orphans to remove (unless the brake
    /// holds), extra instances of one Pod are duplicates to remove; instances
    /// with a Pod are adopted by their Pods' reconciles (never created again).
    async fn gc_pass(&self) {
        let instances = match self.provider.list(&self.settings.node).await {
            Ok(i) => i,
            Err(e) => {
                warn!(error = %e, "listing backend instances for collection failed");
                return;
            }
        };
        let listed = instances.len();
        let plan = {
            let records = self.records();
            crate::fencing::plan(
                &self.settings.node,
                instances,
                |uid| records.contains_key(uid),
                self.settings.brake,
            )
        };
        let mut unowned: std::collections::BTreeMap<String, i64> = Default::default();
        for i in plan.orphans.iter().chain(&plan.duplicates) {
            *unowned.entry(format!("{:?}", i.phase)).or_default() += 1;
        }
        *self
            .unowned_phases
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = unowned.into_iter().collect();
        for d in &plan.duplicates {
            self.shared.metrics.duplicates_found.inc();
            crate::fencing::audit(
                &d.owner.uid,
                &d.owner.to_string(),
                &self.settings.node,
                self.provider.name(),
                &d.id,
                d.epoch,
                "duplicate instance (a newer epoch has one for this Pod)",
            );
            if let Err(e) = self
                .provider
                .delete_instance(&self.fence(), &d.id, Duration::ZERO)
                .await
            {
                warn!(error = %e, instance = %d.id, "deleting a duplicate instance failed; next pass retries");
            }
        }
        if let Some(why) = &plan.braked {
            self.shared.metrics.gc_braked.inc();
            warn!(
                orphans = plan.orphans.len(),
                listed, "orphan collection braked: {why}"
            );
            self.node_event("OrphanDeletionBraked", why).await;
            return;
        }
        let n = plan.orphans.len();
        for o in plan.orphans {
            self.approved_orphans
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(o.owner.uid.clone());
            self.queue.add(&o.owner.uid);
        }
        debug!(listed, orphans = n, "collection pass");
    }

    /// Stops the instances of `fence`-policy Pods when the node lease has not
    /// been renewed for `partition_fence_after`: by then the control plane may
    /// be about to replace them elsewhere.
    async fn partition_watch(&self, shutdown: CancellationToken) {
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                () = tokio::time::sleep(Duration::from_secs(1)) => {}
            }
            let last = self.shared.last_lease_renewal.load(Ordering::Acquire);
            if last == 0 {
                continue;
            }
            let now = SystemTime::now()
                .duration_since(SystemTime::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64);
            let silent = Duration::from_millis(now.saturating_sub(last));
            if silent < self.settings.partition_fence_after {
                continue;
            }
            self.fence_for_partition(&format!("node lease not renewed for {}s", silent.as_secs()))
                .await;
        }
    }

    /// Stops the instances of Pods annotated `vkd.io/partition-policy: fence`.
    /// Called while this replica's epoch is still the newest: when the node lease
    /// went unrenewed too long, and when leadership is lost for want of renewal
    /// (before anyone else can take over).
    pub async fn fence_for_partition(&self, why: &str) {
        let fenced = |uid: &str| {
            self.shared
                .partition_fenced
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .contains(uid)
        };
        let targets: Vec<PodRecord> = self
            .records()
            .values()
            .filter(|r| r.fence_on_partition && r.pending.is_none() && !fenced(&r.uid))
            .map(|r| PodRecord::clone(r))
            .collect();
        for rec in targets {
            crate::fencing::audit(
                &rec.uid,
                &rec.key(),
                &self.settings.node,
                self.provider.name(),
                rec.instance_id.as_deref().unwrap_or(""),
                self.settings.epoch,
                &format!("partition: {why} (vkd.io/partition-policy: fence)"),
            );
            match self
                .provider
                .delete(&self.fence(), &rec.uid, Duration::ZERO)
                .await
            {
                Ok(()) => {
                    self.shared.metrics.partition_fenced.inc();
                    self.shared
                        .partition_fenced
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .insert(rec.uid.to_string());
                }
                Err(e) => {
                    warn!(error = %e, pod = %rec.key(), "partition fence: stopping the instance failed")
                }
            }
        }
    }

    async fn node_event(&self, reason: &str, note: &str) {
        let reference = ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Node".into()),
            name: Some(self.settings.node.clone()),
            ..ObjectReference::default()
        };
        let ev = KubeEvent {
            type_: EventType::Warning,
            reason: reason.to_owned(),
            note: Some(note.chars().take(1000).collect()),
            action: "Collect".into(),
            secondary: None,
        };
        if let Err(e) = self.recorder.publish(&ev, &reference).await {
            warn!(error = %e, reason, "publishing event failed");
        }
    }

    /// Waits for the Pod-write rate limiter and counts the write.
    async fn throttle(&self, kind: &str) {
        throttle(&self.limiter, &self.shared.metrics, kind).await;
    }

    /// Time since the node lease was last renewed, once it has been.
    pub fn lease_age(&self) -> Option<Duration> {
        let last = self.shared.last_lease_renewal.load(Ordering::Acquire);
        (last > 0).then(|| {
            let now = SystemTime::now()
                .duration_since(SystemTime::UNIX_EPOCH)
                .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
            Duration::from_millis(now.saturating_sub(last))
        })
    }

    /// Pods waiting in the reconcile queue.
    pub fn queue_depth(&self) -> usize {
        self.queue.len()
    }

    /// Pods by the phase the API server holds.
    pub fn phases(&self) -> Vec<(String, i64)> {
        let mut by: std::collections::BTreeMap<String, i64> = Default::default();
        for r in self.records().values() {
            *by.entry(r.phase.as_str().to_owned()).or_default() += 1;
        }
        by.into_iter().collect()
    }

    /// The backend's instances by phase, from what the controller knows: each
    /// Pod's instance in the phase last written from it (until its deletion is
    /// confirmed), and the instances without a Pod from the last collection pass.
    pub fn backend_phases(&self) -> Vec<(String, i64)> {
        let mut by: std::collections::BTreeMap<String, i64> = Default::default();
        for r in self.records().values() {
            if r.instance_id.is_some() && !r.delete_sent {
                *by.entry(r.phase.as_str().to_owned()).or_default() += 1;
            }
        }
        let unowned = self
            .unowned_phases
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        for (phase, n) in unowned {
            *by.entry(phase).or_default() += n;
        }
        by.into_iter().collect()
    }

    /// Pods being deleted whose instance is not yet confirmed gone.
    pub fn deletions_pending(&self) -> usize {
        self.records()
            .values()
            .filter(|r| r.deletion_grace.is_some())
            .count()
    }

    fn upsert(&self, pod: &Pod) -> Option<String> {
        let uid = pod.metadata.uid.clone()?;
        let mut records = self.records();
        let previous = records.get(&uid).map(|r| &**r);
        let first_seen = previous.is_none();
        let rec = PodRecord::from_pod(pod, &self.settings.node, previous, SystemTime::now())?;
        let urgent = first_seen && rec.awaits_create();
        records.insert(uid.clone(), Box::new(rec));
        drop(records);
        if urgent {
            self.queue.add_first(&uid);
        } else {
            self.queue.add(&uid);
        }
        Some(uid)
    }

    async fn provider_events(&self, shutdown: CancellationToken) {
        let mut events = self.provider.events();
        loop {
            let ev = tokio::select! {
                _ = shutdown.cancelled() => return,
                e = events.next() => e,
            };
            match ev {
                None => {
                    // A provider without (more) events: the periodic resync still
                    // visits every Pod, so this is no reason to stop the node.
                    warn!("the provider's event stream ended; relying on resync");
                    shutdown.cancelled().await;
                    return;
                }
                Some(InstanceEvent::Changed { uid }) => self.queue.add(&uid),
                Some(InstanceEvent::Resync) => self.enqueue_all(),
            }
        }
    }

    async fn resync(&self, shutdown: CancellationToken) {
        let mut tick = tokio::time::interval(RESYNC);
        tick.tick().await;
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tick.tick() => self.enqueue_all(),
            }
        }
    }

    fn enqueue_all(&self) {
        let uids: Vec<String> = self.records().keys().cloned().collect();
        for uid in uids {
            self.queue.add(&uid);
        }
    }

    async fn worker(&self, shutdown: CancellationToken, lane: Lane) {
        loop {
            let uid = tokio::select! {
                _ = shutdown.cancelled() => return,
                k = self.queue.next_in(lane == Lane::Create) => k,
            };
            let pod = self
                .records()
                .get(&uid)
                .map(|r| r.key())
                .unwrap_or_default();
            let span = info_span!("reconcile", pod_uid = %uid, pod = %pod);
            let started = std::time::Instant::now();
            let outcome = self.reconcile(&uid, lane).instrument(span.clone()).await;
            let metrics = &self.shared.metrics;
            metrics.reconciled(
                if outcome.is_ok() { "ok" } else { "error" },
                started.elapsed(),
            );
            if let Err(e) = &outcome {
                metrics.reconcile_failed(e.metric_label());
            }
            match outcome {
                Ok(Action::Done) => self.queue.forget(&uid),
                Ok(Action::After(d)) => {
                    self.queue.forget(&uid);
                    self.queue.add_after(&uid, d);
                }
                Ok(Action::WriteLater) => {
                    self.queue.forget(&uid);
                    // Marked dirty while held: queued again once released below.
                    self.queue.add(&uid);
                }
                Err(ReconcileError::Provider(ProviderError::Fenced { node, current, got })) => {
                    self.shared.metrics.fenced_refused.inc();
                    span.in_scope(|| {
                        warn!(
                            %node,
                            current,
                            got,
                            "the backend refused our epoch: a newer replica acts for this node; stopping"
                        )
                    });
                    self.shared.term.supersede(format!(
                        "a backend refused epoch {got}: node {node} is at epoch {current}"
                    ));
                }
                Err(e) => {
                    let retry_in = self.queue.retry(&uid);
                    span.in_scope(|| warn!(error = %e, cause = e.metric_label(), ?retry_in, "reconcile failed"));
                }
            }
            self.queue.done(&uid);
        }
    }

    async fn reconcile(&self, uid: &str, lane: Lane) -> Result<Action, ReconcileError> {
        let rec = self.records().get(uid).map(|r| PodRecord::clone(r));
        let Some(rec) = rec else {
            let approved = self
                .approved_orphans
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .contains(uid);
            if approved {
                return self.remove_orphan(uid).await;
            }
            // The Pod is gone: a collection pass (with its brake) decides.
            self.admitter.release(uid);
            self.stopping_to_fail().remove(uid);
            self.evicting().remove(uid);
            self.gc_wake.notify_one();
            return Ok(Action::Done);
        };
        if let Some(grace) = rec.deletion_grace {
            return self.finalize(&rec, grace).await;
        }
        if rec.terminal() {
            return Ok(Action::Done);
        }
        if let Some(e) = &rec.spec_error {
            return self.fail(&rec, e.reason, &e.message).await;
        }
        if let (Some(d), Some(start)) = (rec.active_deadline, rec.start_time)
            && d.left(start.time(), SystemTime::now())
                .is_some_and(|left| left.is_zero())
        {
            return self.exceed_deadline(&rec, d).await;
        }
        let eviction = self.evicting().get(uid).cloned();
        if let Some(message) = eviction {
            let failure = Failure {
                reason: eviction::REASON,
                message: &message,
                grace: eviction::GRACE,
                event_type: EventType::Warning,
            };
            return self.stop_and_fail(&rec, &failure).await;
        }
        let image_wait = rec
            .image_retry_at
            .and_then(|at| at.time().duration_since(SystemTime::now()).ok())
            .filter(|left| !left.is_zero());
        let instance = match self.provider.get(uid).await? {
            Some(i) => i,
            None if self
                .shared
                .partition_fenced
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .contains(uid) =>
            {
                let message = format!(
                    "vkd stopped instance {} of this Pod while it could not reach the API server \
                     (vkd.io/partition-policy: fence)",
                    rec.instance_id.as_deref().unwrap_or("(unknown)")
                );
                return self.fail(&rec, "PartitionFenced", &message).await;
            }
            None if rec.instance_id.is_some() || rec.pending.is_none() => {
                let message = format!(
                    "backend {} no longer has instance {} of this Pod; not starting a second copy",
                    self.provider.name(),
                    rec.instance_id.as_deref().unwrap_or("(unknown)")
                );
                return self.fail(&rec, "InstanceLost", &message).await;
            }
            // Backing off an image the backend could not run.
            None if image_wait.is_some() => return Ok(self.deadline_action(uid, image_wait)),
            None => match self.start(&rec).await? {
                Start::Running(_) if lane == Lane::Create => return Ok(Action::WriteLater),
                Start::Running(i) => *i,
                Start::Queued(reason) => {
                    let since = rec.queued_since.map_or_else(SystemTime::now, Stamp::time);
                    let timeout = rec
                        .pending
                        .as_ref()
                        .and_then(|p| p.spec.annotations.get(QUEUE_TIMEOUT_ANNOTATION))
                        .map(|t| match vkd_provider::duration::parse(t) {
                            Ok(d) => d,
                            // Longer than a year reads as "wait as long as vkd can".
                            Err(vkd_provider::duration::DurationError::TooLong { .. }) => {
                                vkd_provider::duration::MAX_DURATION
                            }
                            Err(e) => {
                                warn!(annotation = QUEUE_TIMEOUT_ANNOTATION, error = %e, "using --queue-timeout");
                                self.settings.queue_timeout
                            }
                        })
                        .unwrap_or(self.settings.queue_timeout);
                    let waited = since.elapsed().unwrap_or_default();
                    if waited >= timeout {
                        let message = format!(
                            "waited {}s in the backend queue (timeout {}s): {reason}",
                            waited.as_secs(),
                            timeout.as_secs()
                        );
                        return self.fail(&rec, "BackendQueueTimeout", &message).await;
                    }
                    self.queued(&rec, &reason).await?;
                    return Ok(Action::After(QUEUED_RECHECK.min(timeout - waited)));
                }
                Start::ConfigError(message) => {
                    warn!(message, "container config incomplete");
                    let waiting = Waiting::ConfigError(message);
                    let changed =
                        status::desired_view(&rec, None, &waiting).digest() != rec.observed_digest;
                    self.write_status(&rec, None, &waiting).await?;
                    if changed && let Waiting::ConfigError(message) = &waiting {
                        // The kubelet's Event for a container it cannot configure;
                        // once per new message, not once per retry.
                        let note = format!("Error: {message}");
                        self.event(&rec, EventType::Warning, "Failed", &note, "Create");
                    }
                    return Ok(self.deadline_action(uid, Some(CONFIG_RECHECK)));
                }
                Start::ImagePull(message) => return self.image_unavailable(&rec, message).await,
                Start::Failed(reason, message) => return self.fail(&rec, &reason, &message).await,
            },
        };
        if instance.phase != vkd_provider::InstancePhase::Pending {
            // Running or ended: the backend's own figures show what it uses.
            self.admitter.release(uid);
        }
        // New entries of spec.ephemeralContainers (kubectl debug) start now.
        let rec = self.start_ephemeral(rec, &instance).await?;
        self.write_status(&rec, Some(&instance), &Waiting::Creating)
            .await?;
        let refresh_in = if instance.phase == vkd_provider::InstancePhase::Running {
            self.refresh_volumes(&rec).await?
        } else {
            None
        };
        let recheck = match (ephemeral::recheck(&rec), refresh_in) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        Ok(self.deadline_action(uid, recheck))
    }

    /// The backend cannot run a container's image. As the kubelet after a
    /// failed pull, the Pod stays Pending with its containers waiting in
    /// `ErrImagePull`, then `ImagePullBackOff`, and the start is tried again
    /// after a back-off that doubles from [`IMAGE_BACKOFF`] to
    /// [`IMAGE_BACKOFF_MAX`]; an update of the Pod (a fixed image) tries at once.
    async fn image_unavailable(
        &self,
        rec: &PodRecord,
        message: String,
    ) -> Result<Action, ReconcileError> {
        let backoff = rec.image_failures > 0;
        let waiting = Waiting::ImagePull {
            message: message.clone(),
            backoff,
        };
        self.write_status(rec, None, &waiting).await?;
        let failures = rec.image_failures.saturating_add(1);
        let wait = IMAGE_BACKOFF
            .saturating_mul(1 << u32::from(failures.min(8) - 1))
            .min(IMAGE_BACKOFF_MAX);
        let retry_at = Stamp::from(SystemTime::now() + wait);
        self.touch(&rec.uid, |r| {
            r.image_failures = failures;
            r.image_retry_at = Some(retry_at);
        });
        warn!(%message, failures, "image not runnable; waiting as after a failed pull");
        // The kubelet's pair of Events, once each rather than at every retry.
        match failures {
            1 => self.event(
                rec,
                EventType::Warning,
                "Failed",
                &format!("Failed to pull image: {message}"),
                "Pull",
            ),
            2 => self.event(
                rec,
                EventType::Normal,
                "BackOff",
                &format!("Back-off pulling image: {message}"),
                "Pull",
            ),
            _ => {}
        }
        Ok(self.deadline_action(&rec.uid, Some(wait)))
    }

    /// What follows a reconcile that leaves the Pod running or waiting: it is
    /// looked at again when its active deadline passes, or after `otherwise`.
    /// Read from the stored record, whose start time a status write may just
    /// have set.
    fn deadline_action(&self, uid: &str, otherwise: Option<Duration>) -> Action {
        let left = self.records().get(uid).and_then(|r| {
            if r.terminal() {
                return None;
            }
            r.active_deadline?
                .left(r.start_time?.time(), SystemTime::now())
                .map(|l| l.min(DEADLINE_RECHECK_MAX))
        });
        match (left, otherwise) {
            (Some(l), Some(o)) => Action::After(l.min(o)),
            (Some(d), None) | (None, Some(d)) => Action::After(d),
            (None, None) => Action::Done,
        }
    }

    fn stopping_to_fail(&self) -> MutexGuard<'_, HashMap<String, Box<Instance>>> {
        self.stopping_to_fail
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    fn evicting(&self) -> MutexGuard<'_, HashMap<String, String>> {
        self.evicting.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `activeDeadlineSeconds` passed: as the kubelet, stop the containers
    /// (with the Pod's grace period) and fail the Pod with `DeadlineExceeded`.
    async fn exceed_deadline(
        &self,
        rec: &PodRecord,
        deadline: record::ActiveDeadline,
    ) -> Result<Action, ReconcileError> {
        let failure = Failure {
            reason: DEADLINE_REASON,
            message: DEADLINE_MESSAGE,
            grace: Duration::from_secs(deadline.grace_seconds.into()),
            event_type: EventType::Normal,
        };
        self.stop_and_fail(rec, &failure).await
    }

    /// As the kubelet's killPod with a status function: stop the containers
    /// within `failure.grace` and fail the Pod with its reason and message.
    /// As the kubelet's status manager, the phase turns terminal only once no
    /// container can still run: until the backend confirms, the Pod is looked
    /// at again every [`DELETE_CONFIRM`]. Containers whose end the backend did
    /// not report read as the kubelet writes those it cannot find when it
    /// terminates a Pod (`ContainerStatusUnknown`, exit code 137).
    async fn stop_and_fail(
        &self,
        rec: &PodRecord,
        failure: &Failure<'_>,
    ) -> Result<Action, ReconcileError> {
        use vkd_provider::InstancePhase;
        let uid = &*rec.uid;
        self.admitter.release(uid);
        let current = self.provider.get(uid).await?;
        if let Some(i) = &current
            && !matches!(i.phase, InstancePhase::Succeeded | InstancePhase::Failed)
        {
            let first = self
                .stopping_to_fail()
                .insert(uid.to_owned(), Box::new(i.clone()))
                .is_none();
            if first {
                info!(instance = %i.id, reason = failure.reason, "stopping the instance");
            }
            self.provider
                .delete(&self.fence(), uid, failure.grace)
                .await?;
            return Ok(Action::After(DELETE_CONFIRM));
        }
        let last_seen = self.stopping_to_fail().remove(uid);
        let instance = current.or(last_seen.map(|i| *i));
        let now = SystemTime::now();
        let last_instance = instance.clone().map(Box::new);
        let (view, body) = match instance {
            Some(inst) => {
                // Every container ended as a deleted Pod's do; the failure
                // fails the Pod whatever they did.
                let mut inst = status::terminal_instance(rec, Some(inst), now);
                inst.phase = InstancePhase::Failed;
                inst.message = None;
                let mut view = status::desired_view(rec, Some(&inst), &Waiting::Creating);
                view.reason = Some(failure.reason.into());
                view.message = Some(failure.message.into());
                if view.pod_ip.is_none() {
                    view.pod_ip = Some(self.settings.host_ip.clone());
                }
                let body = status::patch_body(rec, &view, Some(&inst), &self.settings.host_ip, now);
                (view, body)
            }
            None => {
                let view = status::failed_view(failure.reason, failure.message);
                let body = serde_json::json!({
                    "status": {
                        "phase": "Failed",
                        "reason": failure.reason,
                        "message": failure.message,
                        "hostIP": self.settings.host_ip,
                        "startTime": status::time(rec.start_time.map_or(now, Stamp::time)),
                    }
                });
                (view, body)
            }
        };
        warn!(
            reason = failure.reason,
            message = failure.message,
            "pod failed"
        );
        if let Err(e) = self.patch_status(rec, body).await {
            // Kept for the retry: the instance is gone, its last states are not.
            if let Some(i) = last_instance {
                self.stopping_to_fail().insert(uid.to_owned(), i);
            }
            return Err(e);
        }
        self.evicting().remove(uid);
        self.touch(&rec.uid, |r| r.observe(&view));
        self.event(
            rec,
            failure.event_type,
            failure.reason,
            failure.message,
            "Kill",
        );
        Ok(Action::Done)
    }

    /// What resolves `pending` (ConfigMaps, Secrets, Services, fieldRefs) for
    /// this node; with the node's allocatable when the spec reads it.
    async fn resolver(
        &self,
        pending: &spec::Pending,
    ) -> Result<spec::Resolver<'_>, ReconcileError> {
        let allocatable = if pending.reads_allocatable {
            Some(self.admitter.allocatable().await?)
        } else {
            None
        };
        Ok(spec::Resolver {
            client: &self.client,
            policy: &self.settings.policy,
            host_ip: &self.settings.host_ip,
            volumes: self.provider.capabilities().volumes == Support::Supported,
            services: self.shared.services.as_ref(),
            allocatable,
        })
    }

    /// Admits and creates the instance.
    async fn start(&self, rec: &PodRecord) -> Result<Start, ReconcileError> {
        let Some(pending) = rec.pending.as_deref() else {
            return Ok(Start::Failed(
                "InstanceLost".into(),
                "no spec to create the instance from".into(),
            ));
        };
        let resolver = self.resolver(pending).await?;
        let spec = match resolver.resolve(pending).await {
            Ok(s) => s,
            Err(spec::ResolveError::Spec(e)) => {
                return Ok(Start::Failed(e.reason.into(), e.message));
            }
            Err(spec::ResolveError::Config(message)) => return Ok(Start::ConfigError(message)),
            Err(spec::ResolveError::Kube(e)) => return Err(e.into()),
        };
        let spec = &spec;
        // A create that failed without an answer (a deadline, a cut connection)
        // may have made the instance: it is retried on the same placement, whose
        // reservation was kept, never admitted afresh onto other GPUs.
        let admission = match self.admitter.held_placement(&rec.uid) {
            Some(placement) => Ok(Admission::Fits(placement)),
            None => self.admitter.admit(spec).await,
        };
        let admission = match admission {
            Ok(a) => a,
            Err(ProviderError::Invalid { reason, message }) => {
                return Ok(Start::failed(reason, message));
            }
            Err(e) => return Err(e.into()),
        };
        self.touch(&rec.uid, |r| r.timeline.admitted = Some(Stamp::now()));
        let placement = match admission {
            Admission::Fits(p) => p,
            Admission::Queued { reason } => return Ok(Start::Queued(reason)),
            Admission::Rejected { reason, message } => return Ok(Start::failed(reason, message)),
        };
        let gpus = if placement.gpu_ids.is_empty() {
            String::new()
        } else {
            format!(", GPUs {}", placement.gpu_ids.join(","))
        };
        let mut spec = spec.clone();
        spec.placement = Some(placement);
        let instance = match self.provider.create(&self.fence(), &spec).await {
            Ok(i) => i,
            Err(ProviderError::Rejected { message }) => {
                self.admitter.release(&rec.uid);
                return Ok(Start::Queued(message));
            }
            Err(ProviderError::Invalid { reason, message }) => {
                self.admitter.release(&rec.uid);
                return Ok(Start::failed(reason, message));
            }
            // Kept: the backend may have made it (see `held_placement` above).
            Err(e) => return Err(e.into()),
        };
        self.admitter.created(&rec.uid);
        let written = rec
            .volume_refresh
            .is_some()
            .then(|| volume_refresh::created_digest(pending, &spec));
        self.touch(&rec.uid, |r| {
            r.timeline.accepted = Some(Stamp::now());
            r.pending = None;
            if let Some(v) = r.volume_refresh.as_deref_mut() {
                v.written = v.written.or(written);
            }
        });
        if self.settings.lifecycle_events {
            // One Normal Event per Pod: admission and creation together, so the
            // happy path costs one Event write, not one per step.
            let note = format!(
                "backend {} admitted it and created instance {} on host {}{gpus} (epoch {})",
                self.provider.name(),
                instance.id,
                instance.host.as_deref().unwrap_or("-"),
                self.settings.epoch
            );
            self.event(rec, EventType::Normal, "InstanceCreated", &note, "Create");
        }
        info!(
            instance = %instance.id,
            host = instance.host.as_deref().unwrap_or(""),
            epoch = self.settings.epoch,
            backend = self.provider.name(),
            "instance created"
        );
        Ok(Start::Running(Box::new(instance)))
    }

    /// Updates the stored record, if the Pod still has one.
    fn touch(&self, uid: &str, f: impl FnOnce(&mut PodRecord)) {
        if let Some(r) = self.records().get_mut(uid) {
            f(r);
        }
    }

    async fn queued(&self, rec: &PodRecord, reason: &str) -> Result<(), ReconcileError> {
        self.write_status(rec, None, &Waiting::Queued(reason.to_owned()))
            .await?;
        if rec.queued_since.is_none() {
            self.event(rec, EventType::Normal, "BackendQueued", reason, "Admit");
            self.touch(&rec.uid, |r| r.queued_since = Some(Stamp::now()));
        }
        Ok(())
    }

    async fn fail(
        &self,
        rec: &PodRecord,
        reason: &str,
        message: &str,
    ) -> Result<Action, ReconcileError> {
        self.admitter.release(&rec.uid);
        let view = status::failed_view(reason, message);
        if view.digest() != rec.observed_digest {
            warn!(reason, message, "pod failed");
            let body = serde_json::json!({
                "status": {
                    "phase": "Failed",
                    "reason": reason,
                    "message": message,
                    "hostIP": self.settings.host_ip,
                    "startTime": status::time(rec.start_time.map_or_else(SystemTime::now, Stamp::time)),
                }
            });
            self.patch_status(rec, body).await?;
            self.touch(&rec.uid, |r| r.observe(&view));
            self.event(rec, EventType::Warning, reason, message, "Admit");
        }
        Ok(Action::Done)
    }

    async fn write_status(
        &self,
        rec: &PodRecord,
        instance: Option<&Instance>,
        waiting: &Waiting,
    ) -> Result<(), ReconcileError> {
        self.write_status_of(rec, instance, waiting, instance.is_some())
            .await
    }

    /// [`Self::write_status`]; `host_ip_as_pod_ip` says whether an instance with
    /// no IP of its own shares the host's (false when the instance is gone and
    /// its IP unknown: the Pod keeps the IP it has, never a second one).
    async fn write_status_of(
        &self,
        rec: &PodRecord,
        instance: Option<&Instance>,
        waiting: &Waiting,
        host_ip_as_pod_ip: bool,
    ) -> Result<(), ReconcileError> {
        let mut view = status::desired_view(rec, instance, waiting);
        // A spec change (a new generation) is answered even when nothing else moved.
        view.observed_generation = (rec.generation > 0).then_some(rec.generation);
        if view.pod_ip.is_none() && host_ip_as_pod_ip {
            // A backend without Pod networking (processes) shares the host's, as
            // hostNetwork Pods do: the kubelet reports the host IP as the Pod IP.
            view.pod_ip = Some(self.settings.host_ip.clone());
        }
        if view.digest() == rec.observed_digest {
            return Ok(());
        }
        let now = SystemTime::now();
        // The stored record may be newer: admission and creation touch its timeline.
        let mut rec = self
            .records()
            .get(&*rec.uid)
            .map(|r| PodRecord::clone(r))
            .unwrap_or_else(|| rec.clone());
        if view
            .containers
            .iter()
            .any(|c| c.state == status::StateView::Running)
        {
            rec.timeline.started.get_or_insert(now.into());
        }
        if view.conditions[3] == Some(true) && rec.timeline.ready.is_none() {
            rec.timeline.ready = Some(now.into());
            let t = &rec.timeline;
            if let Some(base) = t.bound.or(t.observed).map(Stamp::time) {
                let since = |x: Option<Stamp>| x.and_then(|x| x.time().duration_since(base).ok());
                let stages: Vec<(&str, Duration)> = t
                    .stages()
                    .into_iter()
                    .filter_map(|(n, x)| Some((n, since(x)?)))
                    .collect();
                self.shared.metrics.started(&stages);
            }
        }
        if rec.start_time.is_none() {
            rec.start_time = Some(now.into());
        }
        let body = status::patch_body(&rec, &view, instance, &self.settings.host_ip, now);
        self.patch_status(&rec, body).await?;
        debug!(phase = %view.phase, "status written");
        self.touch(&rec.uid, |r| {
            for (i, s) in view.conditions.iter().enumerate() {
                if let Some(s) = *s
                    && r.condition_times[i].is_none_or(|(old, _)| old != s)
                {
                    r.condition_times[i] = Some((s, now.into()));
                }
            }
            r.timeline = rec.timeline.clone();
            r.start_time = rec.start_time;
            r.observe(&view);
        });
        Ok(())
    }

    async fn patch_status(
        &self,
        rec: &PodRecord,
        body: serde_json::Value,
    ) -> Result<(), ReconcileError> {
        self.throttle("status").await;
        let api: Api<Pod> = Api::namespaced(self.client.clone(), &rec.namespace);
        match api
            .patch_status(&rec.name, &PatchParams::default(), &Patch::Strategic(body))
            .await
        {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// Graceful deletion: stop the instance, confirm it is gone, then let the Pod go.
    ///
    /// Before the Pod goes, its final status is written, as the kubelet's is
    /// when it has stopped a Pod's containers: their ends, and a terminal phase.
    async fn finalize(&self, rec: &PodRecord, grace: u32) -> Result<Action, ReconcileError> {
        let uid = &*rec.uid;
        if rec.delete_sent {
            return Ok(Action::Done);
        }
        self.admitter.release(uid);
        // Read before the delete call, which may remove a stopped instance at once.
        let mut seen = None;
        let mut final_written = rec.terminal();
        if !final_written {
            seen = self.provider.get(uid).await?;
            if let Some(i) = seen.as_ref().filter(|i| {
                matches!(
                    i.phase,
                    vkd_provider::InstancePhase::Succeeded | vkd_provider::InstancePhase::Failed
                )
            }) {
                // Stopped: every container's end is known.
                self.write_final_status(rec, Some(i.clone())).await?;
                final_written = true;
            }
        }
        if let Err(e) = self
            .provider
            .delete(&self.fence(), uid, Duration::from_secs(grace.into()))
            .await
        {
            let note = format!(
                "backend {} could not delete instance: {e}; retrying",
                self.provider.name()
            );
            self.repeating_event(rec, "DeletionFailed", &note, "Delete")
                .await;
            return Err(e.into());
        }
        if let Some(i) = self.provider.get(uid).await? {
            debug!(instance = %i.id, "waiting for the backend to confirm deletion");
            return Ok(Action::After(DELETE_CONFIRM));
        }
        if !final_written {
            // Gone before its end was seen: the kubelet's unknown ends.
            self.write_final_status(rec, seen).await?;
        }
        crate::fencing::audit(
            uid,
            &rec.key(),
            &self.settings.node,
            self.provider.name(),
            rec.instance_id.as_deref().unwrap_or(""),
            self.settings.epoch,
            "pod deleted",
        );
        self.throttle("delete").await;
        let api: Api<Pod> = Api::namespaced(self.client.clone(), &rec.namespace);
        let params = DeleteParams {
            grace_period_seconds: Some(0),
            preconditions: Some(Preconditions {
                uid: Some(uid.to_owned()),
                resource_version: None,
            }),
            ..DeleteParams::default()
        };
        match api.delete(&rec.name, &params).await {
            // Accepted, already gone, or the name now belongs to a newer Pod.
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => {}
            Err(e) => return Err(e.into()),
        }
        self.touch(uid, |r| r.delete_sent = true);
        Ok(Action::Done)
    }

    /// The status of a Pod whose instance is stopped for good (see
    /// [`status::terminal_instance`]), from the instance as last seen.
    async fn write_final_status(
        &self,
        rec: &PodRecord,
        seen: Option<Instance>,
    ) -> Result<(), ReconcileError> {
        // An instance already gone (removed in a partition, say) left no IP to
        // report: the status keeps the IP it has.
        let known = seen.is_some();
        let inst = status::terminal_instance(rec, seen, SystemTime::now());
        self.write_status_of(rec, Some(&inst), &Waiting::Creating, known)
            .await
    }

    /// An instance whose Pod is gone from the API (force-deleted, or deleted while
    /// vkd was down) is removed, but only once the watch has synced.
    async fn remove_orphan(&self, uid: &str) -> Result<Action, ReconcileError> {
        self.admitter.release(uid);
        let done = |this: &Self| {
            this.approved_orphans
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(uid);
        };
        let Some(instance) = self.provider.get(uid).await? else {
            done(self);
            return Ok(Action::Done);
        };
        if instance.node != self.settings.node {
            done(self);
            return Ok(Action::Done);
        }
        self.provider
            .delete(&self.fence(), uid, Duration::ZERO)
            .await?;
        match self.provider.get(uid).await? {
            Some(_) => Ok(Action::After(DELETE_CONFIRM)),
            None => {
                crate::fencing::audit(
                    uid,
                    &instance.owner.to_string(),
                    &self.settings.node,
                    self.provider.name(),
                    &instance.id,
                    self.settings.epoch,
                    "pod gone from the API",
                );
                self.shared.metrics.orphans_removed.inc();
                done(self);
                Ok(Action::Done)
            }
        }
    }

    /// Publishes a one-off Event about a Pod. It is created directly, not through
    /// kube's `Recorder`: the Recorder keeps every Event it sent for six minutes
    /// (to count repeats as a series), which at thousands of Pods is kilobytes per
    /// Pod for Events that never repeat.
    fn event(&self, rec: &PodRecord, type_: EventType, reason: &str, note: &str, action: &str) {
        use k8s_openapi::api::events::v1::Event;
        use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
        let waiting = match Arc::clone(&self.event_backlog).try_acquire_owned() {
            Ok(w) => w,
            Err(tokio::sync::TryAcquireError::NoPermits) => {
                self.shared.metrics.event_dropped();
                debug!(
                    reason,
                    "event dropped: {EVENTS_PENDING} are waiting to be sent"
                );
                return;
            }
            Err(tokio::sync::TryAcquireError::Closed) => return,
        };
        let event = Event {
            metadata: ObjectMeta {
                // A generateName must itself be a valid name but for a trailing dash.
                generate_name: Some(format!("{}-", rec.name)),
                namespace: Some(rec.namespace.to_string()),
                ..ObjectMeta::default()
            },
            event_time: Some(MicroTime(jiff::Timestamp::now())),
            type_: Some(
                match type_ {
                    EventType::Normal => "Normal",
                    EventType::Warning => "Warning",
                }
                .to_owned(),
            ),
            reason: Some(reason.to_owned()),
            note: Some(note.chars().take(1000).collect()),
            action: Some(action.to_owned()),
            reporting_controller: Some(EVENT_REPORTER.to_owned()),
            reporting_instance: Some(self.settings.node.clone()),
            regarding: Some(Self::pod_reference(rec)),
            ..Event::default()
        };
        let api: Api<Event> = Api::namespaced(self.client.clone(), &rec.namespace);
        let slots = Arc::clone(&self.event_slots);
        let limiter = Arc::clone(&self.limiter);
        let metrics = Arc::clone(&self.shared.metrics);
        let reason = reason.to_owned();
        tokio::spawn(
            async move {
                let Ok(slot) = slots.acquire_owned().await else {
                    return;
                };
                throttle(&limiter, &metrics, "event").await;
                if let Err(e) = api.create(&PostParams::default(), &event).await {
                    warn!(error = %e, reason, "publishing event failed");
                }
                drop((slot, waiting));
            }
            .in_current_span(),
        );
    }

    fn pod_reference(rec: &PodRecord) -> ObjectReference {
        ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Pod".into()),
            name: Some(rec.name.to_string()),
            namespace: Some(rec.namespace.to_string()),
            uid: Some(rec.uid.to_string()),
            ..ObjectReference::default()
        }
    }

    /// An Event that may repeat (a deletion the backend keeps refusing): kube's
    /// `Recorder` turns the repeats into one Event with a count.
    async fn repeating_event(&self, rec: &PodRecord, reason: &str, note: &str, action: &str) {
        self.throttle("event").await;
        let ev = KubeEvent {
            type_: EventType::Warning,
            reason: reason.to_owned(),
            note: Some(note.chars().take(1000).collect()),
            action: action.to_owned(),
            secondary: None,
        };
        if let Err(e) = self.recorder.publish(&ev, &Self::pod_reference(rec)).await {
            warn!(error = %e, reason, "publishing event failed");
        }
    }
}

/// Waits for the Pod-write rate limiter and counts the write.
async fn throttle(
    limiter: &DefaultDirectRateLimiter,
    metrics: &crate::metrics::Metrics,
    kind: &str,
) {
    let waited = std::time::Instant::now();
    limiter.until_ready().await;
    metrics.api_write(kind, waited.elapsed());
}

enum Start {
    Running(Box<Instance>),
    Queued(String),
    ConfigError(String),
    /// The backend cannot run an image: waits as after a failed image pull.
    ImagePull(String),
    Failed(String, String),
}

impl Start {
    /// The start cannot succeed as the spec is: the Pod fails, unless only an
    /// image is missing, which the kubelet waits out.
    fn failed(reason: String, message: String) -> Self {
        if reason == vkd_provider::IMAGE_NOT_RUNNABLE {
            Self::ImagePull(message)
        } else {
            Self::Failed(reason, message)
        }
    }
}
