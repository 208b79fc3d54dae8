//! The daemon's own metrics (prometheus-client), served at the admin port's
//! `/metrics`. Object UIDs and instance ids go in logs, never in labels: every
//! label here has a small, fixed set of values.

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use futures::stream::BoxStream;
use prometheus_client::encoding::text::{encode_eof, encode_registry};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use vkd_provider::{
    Admission, Capabilities, Capacity, Duplex, Fence, Health, Instance, InstanceEvent,
    InstanceSpec, LogRequest, Logs, PodStats, Provider, ProviderError, Result, StreamIo,
};

type Labels = Vec<(String, String)>;

const PHASES: [&str; 4] = ["Pending", "Running", "Succeeded", "Failed"];

fn labels(pairs: &[(&str, &str)]) -> Labels {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

fn seconds_histogram() -> Histogram {
    // 1 ms to about 65 s.
    Histogram::new(exponential_buckets(0.001, 2.0, 17))
}

#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    /// Backend instances found beside a newer one for the same Pod UID.
    pub duplicates_found: Counter,
    /// Instances deleted because their Pod was gone.
    pub orphans_removed: Counter,
    /// Collection passes the brake stopped.
    pub gc_braked: Counter,
    /// Backend calls refused because they carried an old epoch.
    pub fenced_refused: Counter,
    /// Instances stopped by the partition policy.
    pub partition_fenced: Counter,
    /// Pods with a deletionTimestamp whose instance is not yet confirmed gone.
    pub deletions_pending: Gauge,
    /// 1 while this replica holds the leader lease.
    pub leader: Gauge,
    /// The epoch this replica acts under.
    pub epoch: Gauge,
    /// Connections opened to the API server (each a TLS handshake).
    pub api_connections: Counter,
    reconcile_duration: Family<Labels, Histogram, fn() -> Histogram>,
    reconcile_errors: Family<Labels, Counter>,
    queue_depth: Gauge,
    api_writes: Family<Labels, Counter>,
    api_throttled: Counter<f64, std::sync::atomic::AtomicU64>,
    events_dropped: Counter,
    kubelet_api_refused: Family<Labels, Counter>,
    dra_devices: Family<Labels, Gauge>,
    dra_admissions: Family<Labels, Counter>,
    dra_allocated: Family<Labels, Gauge>,
    lease_age: Gauge<f64, std::sync::atomic::AtomicU64>,
    provider_duration: Family<Labels, Histogram, fn() -> Histogram>,
    provider_errors: Family<Labels, Counter>,
    pods: Family<Labels, Gauge>,
    instances: Family<Labels, Gauge>,
    startup: Family<Labels, Histogram, fn() -> Histogram>,
    heap: Gauge,
    /// Each Pod's GPUs, with DCGM exporter's names (not under `vkd_`).
    pub gpu_usage: crate::gpu_usage::GpuUsage,
}

/// Reads the bytes the process holds on its heap; the binary installs one when
/// its global allocator counts them (a library cannot choose the allocator).
static HEAP_PROBE: std::sync::OnceLock<fn() -> usize> = std::sync::OnceLock::new();

/// Installs the heap probe behind `vkd_heap_bytes` (first call wins).
pub fn set_heap_probe(probe: fn() -> usize) {
    let _ = HEAP_PROBE.set(probe);
}

/// Bytes on the heap now, when a probe is installed.
pub fn heap_bytes() -> Option<usize> {
    HEAP_PROBE.get().map(|probe| probe())
}

impl Default for Metrics {
    fn default() -> Self {
        let mut r = Registry::with_prefix("vkd");
        macro_rules! reg {
            ($name:expr, $help:expr, $metric:expr) => {{
                let m = $metric;
                r.register($name, $help, m.clone());
                m
            }};
        }
        let hist = || {
            Family::<Labels, Histogram, fn() -> Histogram>::new_with_constructor(
                seconds_histogram as fn() -> Histogram,
            )
        };
        Self {
            duplicates_found: reg!("duplicate_instances_found", "Backend instances found beside a newer one for the same Pod UID", Counter::default()),
            orphans_removed: reg!("orphans_removed", "Instances deleted because their Pod was gone", Counter::default()),
            gc_braked: reg!("gc_braked", "Collection passes the mass-deletion brake stopped", Counter::default()),
            fenced_refused: reg!("fenced_operations_refused", "Backend calls refused because they carried an old epoch", Counter::default()),
            partition_fenced: reg!("partition_fenced_instances", "Instances stopped by the partition policy", Counter::default()),
            deletions_pending: reg!("deletions_pending", "Pods being deleted whose instance is not yet confirmed gone", Gauge::default()),
            leader: reg!("leader", "1 while this replica holds the leader lease", Gauge::default()),
            epoch: reg!("epoch", "The epoch this replica acts under", Gauge::default()),
            api_connections: reg!("api_connections_opened", "Connections opened to the API server, each a TLS handshake; a climb under steady load means --kube-idle-timeout is shorter than the gaps between writes", Counter::default()),
            reconcile_duration: reg!("reconcile_duration_seconds", "How long one reconcile of a Pod took, by outcome", hist()),
            reconcile_errors: reg!("reconcile_errors", "Failed reconciles by cause", Family::default()),
            queue_depth: reg!("queue_depth", "Pods waiting in the reconcile queue", Gauge::default()),
            api_writes: reg!("api_writes", "Writes to the API server for Pods, by kind", Family::default()),
            api_throttled: reg!("api_throttled_seconds", "Time Pod writes waited for the client rate limiter", Counter::default()),
            events_dropped: reg!("events_dropped", "Pod Events not sent: over --event-qps (InstanceCreated only) or too many waiting for the API server", Counter::default()),
            dra_devices: reg!("dra_devices", "GPUs published as DRA devices, by pool (--dra)", Family::default()),
            dra_admissions: reg!("dra_admissions_before_binding", "Answers to the scheduler's binding conditions, by pool and answer (reserved, queued, rejected)", Family::default()),
            dra_allocated: reg!("dra_allocated_devices", "Devices of this daemon's pools that the scheduler has allocated to a claim, by pool (--dra)", Family::default()),
            kubelet_api_refused: reg!("kubelet_api_connections_refused", "Kubelet API connections closed as soon as accepted: every slot taken (limit) or the peer address holding its share (peer_limit)", Family::default()),
            lease_age: reg!("node_lease_renewal_age_seconds", "Seconds since the node lease was last renewed", Gauge::default()),
            provider_duration: reg!("provider_call_duration_seconds", "Provider calls by operation", hist()),
            provider_errors: reg!("provider_errors", "Failed provider calls by operation and kind", Family::default()),
            pods: reg!("pods", "Pods on this replica's nodes by the phase the API server holds", Family::default()),
            instances: reg!("backend_instances", "Instances for this replica's nodes, by phase, as vkd last saw them: each Pod's from the status vkd last wrote for it, those without a Pod as the last collection pass found them (no backend call per scrape)", Family::default()),
            startup: reg!("startup_stage_seconds", "Seconds from binding to each startup stage (observed, admitted, accepted, started, ready)", hist()),
            heap: reg!("heap_bytes", "Bytes the daemon holds on its heap (backend state of embedded providers included)", Gauge::default()),
            registry: r,
            gpu_usage: crate::gpu_usage::GpuUsage::default(),
        }
        .with_zeros()
    }
}

/// The causes `reconcile_errors` counts (`ReconcileError::metric_label`).
const RECONCILE_CAUSES: [&str; 7] = [
    "not_found",
    "unsupported",
    "fenced",
    "invalid",
    "rejected",
    "transient",
    "kube_api",
];
const OPERATIONS: [&str; 14] = [
    "capacity",
    "admit",
    "create",
    "get",
    "delete",
    "takeover",
    "delete_instance",
    "list",
    "logs",
    "exec",
    "attach",
    "port_forward",
    "stats",
    "start_ephemeral",
];

impl Metrics {
    /// Known label values start at 0, so rates and dashboards work before the
    /// first error.
    fn with_zeros(self) -> Self {
        for cause in RECONCILE_CAUSES {
            let _ = self
                .reconcile_errors
                .get_or_create(&labels(&[("cause", cause)]));
        }
        for op in OPERATIONS {
            for kind in RECONCILE_CAUSES.iter().filter(|k| **k != "kube_api") {
                let _ = self
                    .provider_errors
                    .get_or_create(&labels(&[("operation", op), ("kind", kind)]));
            }
        }
        for kind in ["status", "delete", "event"] {
            let _ = self.api_writes.get_or_create(&labels(&[("kind", kind)]));
        }
        for reason in ["limit", "peer_limit"] {
            let _ = self
                .kubelet_api_refused
                .get_or_create(&labels(&[("reason", reason)]));
        }
        // Histograms too: the first Pod after a start shows in `rate()`
        // only if its series was there, at 0, a scrape before.
        for (stage, _) in crate::pods::model::Timeline::default().stages() {
            let _ = self.startup.get_or_create(&labels(&[("stage", stage)]));
        }
        for outcome in ["ok", "error"] {
            let _ = self
                .reconcile_duration
                .get_or_create(&labels(&[("outcome", outcome)]));
        }
        for op in OPERATIONS {
            let _ = self
                .provider_duration
                .get_or_create(&labels(&[("operation", op)]));
        }
        self
    }

    /// The OpenMetrics text exposition.
    pub fn render(&self) -> String {
        if let Some(bytes) = heap_bytes() {
            self.heap.set(i64::try_from(bytes).unwrap_or(i64::MAX));
        }
        let mut out = String::new();
        if encode_registry(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out.push_str(&self.gpu_usage.render());
        let _ = encode_eof(&mut out);
        out
    }

    /// A kubelet API connection closed at accept, by `reason` (`limit`, `peer_limit`).
    pub fn kubelet_api_refused(&self, reason: &str) {
        self.kubelet_api_refused
            .get_or_create(&labels(&[("reason", reason)]))
            .inc();
    }

    /// A pool's published devices (0 once its host is gone).
    pub fn dra_devices(&self, pool: &str, devices: usize) {
        self.dra_devices
            .get_or_create(&labels(&[("pool", pool)]))
            .set(i64::try_from(devices).unwrap_or(i64::MAX));
    }

    /// A pool's devices allocated to claims now.
    pub fn dra_allocated(&self, pool: &str, devices: usize) {
        self.dra_allocated
            .get_or_create(&labels(&[("pool", pool)]))
            .set(i64::try_from(devices).unwrap_or(i64::MAX));
    }

    /// One answer given before binding for devices of `pool`.
    pub fn dra_admission(&self, pool: &str, answer: &str) {
        self.dra_admissions
            .get_or_create(&labels(&[("pool", pool), ("answer", answer)]))
            .inc();
    }

    pub fn reconciled(&self, outcome: &str, took: Duration) {
        self.reconcile_duration
            .get_or_create(&labels(&[("outcome", outcome)]))
            .observe(took.as_secs_f64());
    }

    pub fn reconcile_failed(&self, cause: &str) {
        self.reconcile_errors
            .get_or_create(&labels(&[("cause", cause)]))
            .inc();
    }

    pub fn api_write(&self, kind: &str, throttled: Duration) {
        self.api_writes
            .get_or_create(&labels(&[("kind", kind)]))
            .inc();
        self.api_throttled.inc_by(throttled.as_secs_f64());
    }

    pub fn event_dropped(&self) {
        self.events_dropped.inc();
    }

    #[cfg(test)]
    pub fn events_dropped(&self) -> u64 {
        self.events_dropped.get()
    }

    /// A Pod became Ready: how long each stage took from its binding.
    pub fn started(&self, stages: &[(&str, Duration)]) {
        for (stage, d) in stages {
            self.startup
                .get_or_create(&labels(&[("stage", stage)]))
                .observe(d.as_secs_f64());
        }
    }

    /// Gauges read at scrape time.
    pub fn set_snapshot(
        &self,
        queue: usize,
        lease_age: Option<Duration>,
        pods: &[(String, i64)],
        instances: &[(String, i64)],
    ) {
        self.queue_depth
            .set(i64::try_from(queue).unwrap_or(i64::MAX));
        self.lease_age
            .set(lease_age.map_or(f64::NAN, |d| d.as_secs_f64()));
        // Every phase is always there (0 when none), so a dashboard never sees a gap.
        for (family, counts) in [(&self.pods, pods), (&self.instances, instances)] {
            family.clear();
            for phase in PHASES {
                family.get_or_create(&labels(&[("phase", phase)])).set(0);
            }
            for (phase, n) in counts {
                family.get_or_create(&labels(&[("phase", phase)])).set(*n);
            }
        }
    }

    fn provider_call<T>(&self, op: &str, started: Instant, result: &Result<T>) {
        self.provider_duration
            .get_or_create(&labels(&[("operation", op)]))
            .observe(started.elapsed().as_secs_f64());
        if let Err(e) = result {
            self.provider_errors
                .get_or_create(&labels(&[("operation", op), ("kind", e.kind())]))
                .inc();
        }
    }
}

/// A provider whose every call is timed, counted and given a deadline.
///
/// The deadline (`--provider-timeout`, as the kubelet's
/// `--runtime-request-timeout`) keeps a backend that stops answering from
/// stalling whoever waits on it: such a call fails as a transient error that
/// names the call, and is retried as any transient error is. A deletion also
/// gets the grace period it was given. Streaming calls are bounded only while
/// they start: `logs` hands back its follow stream within the deadline and the
/// stream then lives as long as the client reads it; `exec`, `attach` and
/// `port_forward` last as long as the session itself, so they get none (they
/// end with the client's connection or the process).
/// A provider that blocks its thread instead of awaiting cannot be cut short.
#[derive(Debug)]
pub struct Instrumented {
    inner: Arc<dyn Provider>,
    metrics: Arc<Metrics>,
    deadline: Duration,
}

impl Instrumented {
    pub fn wrap(
        inner: Arc<dyn Provider>,
        metrics: Arc<Metrics>,
        deadline: Duration,
    ) -> Arc<dyn Provider> {
        Arc::new(Self {
            inner,
            metrics,
            deadline,
        })
    }

    /// Runs `call` within `deadline`; past it, a transient error naming the call.
    async fn bounded<T>(
        &self,
        op: &str,
        deadline: Duration,
        call: impl Future<Output = Result<T>>,
    ) -> Result<T> {
        match tokio::time::timeout(deadline, call).await {
            Ok(result) => result,
            Err(_) => Err(ProviderError::transient(format!(
                "provider {}: {op} did not answer within {}",
                self.inner.name(),
                human(deadline)
            ))),
        }
    }
}

/// `2m`, `90s`, `1.5s`, `250ms`: how a deadline is written in a message.
fn human(d: Duration) -> String {
    let secs = d.as_secs();
    if d.subsec_nanos() == 0 && secs >= 60 && secs.is_multiple_of(60) {
        format!("{}m", secs / 60)
    } else if d >= Duration::from_secs(1) {
        format!("{}s", d.as_secs_f64())
    } else {
        format!("{}ms", d.as_millis())
    }
}

/// Times and counts a call, within the standard deadline or a given one.
macro_rules! timed {
    ($self:ident, $op:literal, $call:expr) => {
        timed!($self, $op, $self.deadline, $call)
    };
    ($self:ident, $op:literal, $deadline:expr, $call:expr) => {{
        let started = Instant::now();
        let result = $self.bounded($op, $deadline, $call).await;
        $self.metrics.provider_call($op, started, &result);
        result
    }};
}

/// Times and counts a streaming call, which has no deadline (see [`Instrumented`]).
macro_rules! unbounded {
    ($self:ident, $op:literal, $call:expr) => {{
        let started = Instant::now();
        let result = $call.await;
        $self.metrics.provider_call($op, started, &result);
        result
    }};
}

#[async_trait]
impl Provider for Instrumented {
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }
    fn identity(&self) -> Vec<(String, String)> {
        self.inner.identity()
    }
    async fn health(&self) -> Health {
        // A backend too slow to say whether it is healthy is not.
        match tokio::time::timeout(self.deadline, self.inner.health()).await {
            Ok(h) => h,
            Err(_) => Health::Unhealthy {
                reason: "ProviderTimeout".into(),
                message: format!("health did not answer within {}", human(self.deadline)),
            },
        }
    }
    async fn capacity(&self) -> Result<Capacity> {
        timed!(self, "capacity", self.inner.capacity())
    }
    async fn admit(&self, spec: &InstanceSpec) -> Result<Admission> {
        timed!(self, "admit", self.inner.admit(spec))
    }
    async fn create(&self, fence: &Fence, spec: &InstanceSpec) -> Result<Instance> {
        timed!(self, "create", self.inner.create(fence, spec))
    }
    async fn get(&self, uid: &str) -> Result<Option<Instance>> {
        timed!(self, "get", self.inner.get(uid))
    }
    async fn delete(&self, fence: &Fence, uid: &str, grace: Duration) -> Result<()> {
        timed!(
            self,
            "delete",
            self.deadline.saturating_add(grace),
            self.inner.delete(fence, uid, grace)
        )
    }
    async fn takeover(&self, fence: &Fence) -> Result<()> {
        timed!(self, "takeover", self.inner.takeover(fence))
    }
    async fn delete_instance(&self, fence: &Fence, id: &str, grace: Duration) -> Result<()> {
        timed!(
            self,
            "delete_instance",
            self.deadline.saturating_add(grace),
            self.inner.delete_instance(fence, id, grace)
        )
    }
    async fn list(&self, node: &str) -> Result<Vec<Instance>> {
        timed!(self, "list", self.inner.list(node))
    }
    fn events(&self) -> BoxStream<'static, InstanceEvent> {
        self.inner.events()
    }
    async fn logs(&self, uid: &str, container: &str, request: LogRequest) -> Result<Logs> {
        // The deadline covers reading the history and starting the follow
        // stream; the stream itself is not cut.
        timed!(self, "logs", self.inner.logs(uid, container, request))
    }
    async fn exec(
        &self,
        uid: &str,
        container: &str,
        command: Vec<String>,
        io: StreamIo,
    ) -> Result<i32> {
        unbounded!(self, "exec", self.inner.exec(uid, container, command, io))
    }
    async fn attach(&self, uid: &str, container: &str, io: StreamIo) -> Result<()> {
        unbounded!(self, "attach", self.inner.attach(uid, container, io))
    }
    async fn port_forward(&self, uid: &str, port: u16, stream: Box<dyn Duplex>) -> Result<()> {
        unbounded!(
            self,
            "port_forward",
            self.inner.port_forward(uid, port, stream)
        )
    }
    async fn stats(&self, uid: &str) -> Result<PodStats> {
        timed!(self, "stats", self.inner.stats(uid))
    }
    async fn describe(&self, uid: &str) -> Result<Vec<(String, String)>> {
        timed!(self, "describe", self.inner.describe(uid))
    }
    async fn update_volumes(
        &self,
        fence: &Fence,
        uid: &str,
        volumes: &[vkd_provider::Volume],
    ) -> Result<()> {
        timed!(
            self,
            "update_volumes",
            self.inner.update_volumes(fence, uid, volumes)
        )
    }
    async fn start_ephemeral(
        &self,
        fence: &Fence,
        uid: &str,
        container: &vkd_provider::ContainerSpec,
    ) -> Result<()> {
        timed!(
            self,
            "start_ephemeral",
            self.inner.start_ephemeral(fence, uid, container)
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::FakeProvider;

    #[tokio::test(start_paused = true)]
    async fn a_call_that_never_answers_fails_transiently_at_its_deadline() {
        let metrics = Arc::new(Metrics::default());
        let provider = Instrumented::wrap(
            FakeProvider::new(0),
            Arc::clone(&metrics),
            Duration::from_secs(120),
        );
        let started = tokio::time::Instant::now();
        let err = provider.capacity().await.unwrap_err();
        assert_eq!(started.elapsed(), Duration::from_secs(120));
        assert_eq!(err.kind(), "transient");
        assert_eq!(
            err.to_string(),
            "transient backend error: provider fake: capacity did not answer within 2m"
        );
        assert!(
            metrics
                .render()
                .contains("vkd_provider_errors_total{operation=\"capacity\",kind=\"transient\"} 1"),
            "the timeout is counted as a provider error"
        );
        // Calls that answer are untouched.
        assert_eq!(provider.list("vk").await.unwrap().len(), 0);
    }

    /// Every optional call reaches the provider: one the wrapper did not
    /// forward would answer with the trait's default, Unsupported.
    #[tokio::test]
    async fn ephemeral_containers_reach_the_provider() {
        let fake = FakeProvider::new(0);
        let provider = Instrumented::wrap(
            Arc::clone(&fake) as Arc<dyn Provider>,
            Arc::new(Metrics::default()),
            Duration::from_secs(120),
        );
        let fence = Fence {
            node: "vk".into(),
            epoch: 1,
        };
        let c = vkd_provider::ContainerSpec {
            name: "debugger".into(),
            ..Default::default()
        };
        provider.start_ephemeral(&fence, "u1", &c).await.unwrap();
        assert_eq!(fake.calls(Some("start_ephemeral")), 1);
    }

    #[test]
    fn kubelet_api_refusals_are_counted_by_reason() {
        let m = Metrics::default();
        let text = m.render();
        for reason in ["limit", "peer_limit"] {
            let zero =
                format!("vkd_kubelet_api_connections_refused_total{{reason=\"{reason}\"}} 0");
            assert!(text.contains(&zero), "{text}");
        }
        m.kubelet_api_refused("peer_limit");
        assert!(
            m.render()
                .contains("vkd_kubelet_api_connections_refused_total{reason=\"peer_limit\"} 1")
        );
    }

    #[test]
    fn deadlines_read_as_written() {
        assert_eq!(human(Duration::from_secs(120)), "2m");
        assert_eq!(human(Duration::from_secs(90)), "90s");
        assert_eq!(human(Duration::from_millis(1500)), "1.5s");
        assert_eq!(human(Duration::from_millis(250)), "250ms");
    }
}
