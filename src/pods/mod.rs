//! The Pod controller: watches the Pods bound to this node, runs each as a backend
//! instance, writes their status, and finalizes their deletion once the backend
//! confirms the instance is gone.
//!
//! Where to start reading: [`model`] (what a Pod's record holds, and who writes
//! each part), `reconcile.rs` (the decision table: which step runs next),
//! `cx.rs` (what a step may use), then the step you are changing (`create.rs`,
//! `node_fit.rs`, `failure.rs`, `deadline.rs`, `image_backoff.rs`,
//! `finalize.rs`, `ephemeral.rs`, `volume_refresh.rs`, `status_write.rs`).
//! Translation is below them ([`spec`], [`status`], [`admission`]); the
//! inputs (`watch.rs`) and the collector (`gc.rs`, `partition.rs`,
//! `eviction.rs`) are the controller's. docs/architecture.md has the picture.

pub mod admission;
mod claims;
#[cfg(test)]
mod controller_tests;
mod create;
mod cx;
mod deadline;
pub mod ephemeral;
mod events;
pub mod eviction;
mod explain;
mod failure;
mod finalize;
mod gc;
mod image_backoff;
mod index;
pub mod model;
mod node_fit;
mod partition;
pub mod queue;
mod reconcile;
pub mod services;
pub mod spec;
pub mod status;
mod status_write;
mod store;
#[cfg(test)]
mod test_support;
pub mod volume_refresh;
mod watch;

pub use index::PodIndex;
pub use watch::route_backend_events;

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

use crate::explain::Action as Decided;
use create::Start;
use cx::Cx;
use cx::Failure;
use events::EventSink;
use model::{PodRecord, Stamp};
use queue::WorkQueue;
use status::Waiting;
use store::PodStore;

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
    /// How long a new instance's ContainerCreating status is held back, so
    /// that one that starts at once gets a single status write (zero: none).
    pub status_merge_window: Duration,
    /// Pod Events per second and their burst (the kubelet's --event-qps, --event-burst).
    pub event_qps: u32,
    pub event_burst: u32,
    /// DRA on: Pods run on the devices their ResourceClaims hold.
    pub dra: Option<crate::dra::Settings>,
}

/// What the Pod controllers share with the rest of the daemon.
#[derive(Clone, Debug)]
pub struct Shared {
    pub metrics: Arc<crate::metrics::Metrics>,
    /// The leadership term they act in: a backend refusing its epoch ends it,
    /// and when it ends unrenewed they apply the partition policy first.
    pub term: crate::fencing::term::Term,
    /// Unix milliseconds of the last successful renewal of this node's lease
    /// (0: none yet); each node has its own.
    pub last_lease_renewal: Arc<std::sync::atomic::AtomicU64>,
    /// Pod UIDs whose instance the partition policy stopped (kept across
    /// leadership terms, so the Pod later fails with the right reason).
    pub partition_fenced: Arc<Mutex<HashSet<String>>>,
    /// The cluster's Services, for the service environment variables.
    pub services: Option<services::Services>,
    /// The daemon's recent decisions, for `vkd explain` (kept across terms).
    pub decisions: Arc<crate::explain::DecisionLog>,
    /// The leader lease this term acts under.
    pub leadership: crate::explain::Leadership,
}

pub struct PodController {
    settings: Settings,
    client: Client,
    /// The Pod watch's own client, so its events never queue behind writes.
    watch_client: Client,
    provider: Arc<dyn Provider>,
    store: PodStore,
    queue: Arc<WorkQueue>,
    /// Pod writes wait here; the node lease uses another client and never does.
    writes: Arc<DefaultDirectRateLimiter>,
    events: EventSink,
    synced: AtomicBool,
    admitter: Arc<crate::topology::Admitter>,
    shared: Shared,
    gc_wake: tokio::sync::Notify,
    /// Orphans a collection pass decided to delete.
    approved_orphans: Mutex<HashSet<String>>,
    /// Instances without a Pod of their own (orphans and duplicates) by phase,
    /// as the last collection pass found them; with the Pods' own instances
    /// this is `vkd_backend_instances`, so a scrape never lists the backend.
    unowned_phases: Mutex<Vec<(String, i64)>>,
    /// When the last collection pass listed the backend.
    last_gc_pass: Mutex<Option<SystemTime>>,
    /// The Node as admission last read it ([`node_fit`]).
    node_view: Mutex<Option<Arc<admission::NodeView>>>,
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
        let writes = Arc::new(RateLimiter::direct(
            Quota::per_second(nz(settings.qps)).allow_burst(nz(settings.burst)),
        ));
        let events = EventSink::new(&settings, &client, Arc::clone(&writes), &shared);
        let admitter = Arc::new(crate::topology::Admitter::new(
            Arc::clone(&provider),
            settings.host.clone(),
        ));
        Arc::new(Self {
            admitter,
            shared,
            gc_wake: tokio::sync::Notify::new(),
            approved_orphans: Mutex::default(),
            unowned_phases: Mutex::default(),
            last_gc_pass: Mutex::default(),
            settings,
            client,
            watch_client,
            provider,
            store: PodStore::default(),
            queue: WorkQueue::new(Duration::from_millis(200), Duration::from_secs(30)),
            writes,
            events,
            synced: AtomicBool::new(false),
            node_view: Mutex::default(),
        })
    }

    /// True once the first full list of this node's Pods was processed.
    pub(super) fn synced(&self) -> bool {
        self.synced.load(Ordering::Acquire)
    }

    /// The UID and container names of a Pod bound to this node.
    pub(super) fn lookup(&self, namespace: &str, name: &str) -> Option<(String, Vec<String>)> {
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
    pub(super) fn pods(&self) -> Vec<vkd_provider::PodRef> {
        self.records().values().map(|r| r.pod_ref()).collect()
    }

    pub(super) fn node(&self) -> &str {
        &self.settings.node
    }

    /// The daemon's metrics (the kubelet API counts its refusals there).
    pub(super) fn metrics(&self) -> &Arc<crate::metrics::Metrics> {
        &self.shared.metrics
    }

    pub(super) fn provider(&self) -> &Arc<dyn Provider> {
        &self.provider
    }

    fn records(&self) -> MutexGuard<'_, HashMap<String, Box<PodRecord>>> {
        self.store.lock()
    }

    /// The node's placement and reservations, which DRA's admission before
    /// binding shares ([`crate::dra::binding`]).
    pub fn admitter(&self) -> Arc<crate::topology::Admitter> {
        Arc::clone(&self.admitter)
    }

    /// What the steps work with (see [`cx`]).
    fn cx(&self) -> Cx<'_> {
        Cx {
            settings: &self.settings,
            client: &self.client,
            provider: &self.provider,
            admitter: &self.admitter,
            shared: &self.shared,
            store: &self.store,
            events: &self.events,
            writes: &self.writes,
            node_view: &self.node_view,
        }
    }

    fn fence(&self) -> Fence {
        self.cx().fence()
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
        task!("node watch", node_watch);
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

    /// Time since the node lease was last renewed, once it has been.
    pub(super) fn lease_age(&self) -> Option<Duration> {
        let last = self.shared.last_lease_renewal.load(Ordering::Acquire);
        (last > 0).then(|| {
            let now = SystemTime::now()
                .duration_since(SystemTime::UNIX_EPOCH)
                .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
            Duration::from_millis(now.saturating_sub(last))
        })
    }

    /// Pods waiting in the reconcile queue.
    pub(super) fn queue_depth(&self) -> usize {
        self.queue.len()
    }

    /// Pods by the phase the API server holds.
    pub(super) fn phases(&self) -> Vec<(String, i64)> {
        let mut by: std::collections::BTreeMap<String, i64> = Default::default();
        for r in self.records().values() {
            *by.entry(r.phase.as_str().to_owned()).or_default() += 1;
        }
        by.into_iter().collect()
    }

    /// The backend's instances by phase, from what the controller knows: each
    /// Pod's instance in the phase last written from it (until its deletion is
    /// confirmed), and the instances without a Pod from the last collection pass.
    pub(super) fn backend_phases(&self) -> Vec<(String, i64)> {
        let mut by: std::collections::BTreeMap<String, i64> = Default::default();
        for r in self.records().values() {
            if r.instance_id.is_some() && !r.progress.delete_sent {
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
    pub(super) fn deletions_pending(&self) -> usize {
        self.records()
            .values()
            .filter(|r| r.deletion_grace.is_some())
            .count()
    }

    /// Updates what the steps learned of a Pod ([`PodStore::update`]).
    #[cfg(test)]
    fn update<R>(&self, uid: &str, f: impl FnOnce(&mut model::Progress) -> R) -> Option<R> {
        self.store.update(uid, f)
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
