//! vkd provider: each Pod runs as a Pod of a second ("downstream") Kubernetes
//! cluster, on the downstream Node vkd admitted it to.
//!
//! - Capacity: one host slice per downstream Node that counts as a host,
//!   kept current by watches of the Nodes and of every Pod (`capacity`).
//! - Create: one Pod per upstream UID, named from it (`naming`), so a repeated
//!   create meets the first one; the spec as the user wrote it (`translate`),
//!   in a namespace vkd made for the upstream one, with Pod Security enforced.
//! - Ownership: only Pods vkd made are believed (`ownership`); anything else
//!   with vkd's labels is ignored, never deleted, never streamed to.
//! - Fencing: every write is checked against the node's watched fence, and
//!   the downstream API server refuses a stale epoch's Pod and Secret writes
//!   (`fence`).
//! - Status, logs, exec, attach, port-forward: from the downstream API server
//!   (`status`, `streams`).

pub mod capacity;
pub mod config;
mod describe;
pub mod fence;
pub mod gpu_metrics;
pub mod kept;
mod namespaces;
pub mod naming;
pub mod ownership;
mod secrets;
pub mod stats;
pub mod status;
mod streams;
pub mod translate;
mod watch;

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use futures::stream::BoxStream;
use k8s_openapi::api::core::v1::{Pod, Secret};
use kube::Api;
use kube::api::{DeleteParams, Patch, PatchParams, PostParams, Preconditions};
use kube::config::Kubeconfig;
use tokio::sync::{OnceCell, broadcast};
use tracing::info;
use vkd_provider::{
    Admission, Capabilities, Capacity, CapacityKind, Duplex, Fence, Health, Instance,
    InstanceEvent, InstancePhase, InstanceSpec, LogRequest, Logs, PodStats, Provider,
    ProviderError, Result, StreamIo, Support, Volume,
};

pub use config::{ConfigError, KubernetesConfig};
use watch::{Downstream, SharedClaims, Verified, own_instances, tokio_stream_of};

/// How long a health probe of the downstream API server may take.
const PROBE: Duration = Duration::from_secs(5);
/// A namespace's PodMetrics by Pod name.
type PodMetrics = Arc<HashMap<String, serde_json::Value>>;

/// How long a namespace's PodMetrics list serves the Pods of a scrape
/// (metrics-server samples every 15 s).
const METRICS_FRESH: Duration = Duration::from_secs(5);

pub struct KubernetesProvider {
    config: KubernetesConfig,
    kubeconfig: Kubeconfig,
    cluster: String,
    downstream: OnceCell<Downstream>,
    events: broadcast::Sender<InstanceEvent>,
    claims: SharedClaims,
    /// Downstream namespaces known to exist and to be vkd's.
    verified: Verified,
    namespace_create: tokio::sync::Mutex<()>,
    /// UIDs whose downstream Pod vkd itself asked to delete: any other
    /// deletion is someone else's, and the upstream Pod fails saying so.
    deleting: Mutex<HashSet<String>>,
    /// Downstream Pod UID -> (its upstream UID, the grace in seconds it was
    /// deleted with): vkd's finalize asks again every half second until the
    /// Pod is gone, and the watch may not show the deletion yet; a repeat
    /// sends nothing unless it shortens the grace (as a kubelet's second
    /// delete may). Dropped when the watch sees the Pod go.
    deletes_sent: watch::DeletesSent,
    /// Since when health probes have failed (none: the last one answered).
    unreachable_since: Mutex<Option<(std::time::Instant, jiff::Timestamp)>>,
    /// CPU time summed from the metrics API's rates, per upstream UID
    /// (`stats`); dropped with the Pod.
    cpu_totals: Mutex<HashMap<String, stats::CpuTotals>>,
    /// PodMetrics per downstream namespace, as last listed (`namespace_metrics`).
    metrics: tokio::sync::Mutex<HashMap<String, (std::time::Instant, PodMetrics)>>,
    /// The downstream Prometheus's DCGM figures (`gpuMetrics`).
    gpu: Option<gpu_metrics::GpuMetrics>,
}

impl fmt::Debug for KubernetesProvider {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KubernetesProvider")
            .field("cluster", &self.cluster)
            .field("connected", &self.downstream.initialized())
            .finish()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn transient(what: &str, e: impl fmt::Display) -> ProviderError {
    ProviderError::transient(format!("downstream: {what}: {e}"))
}

fn not_found(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 404)
}

fn conflict(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 409)
}

/// A UID vkd will put in a label selector: what the API server generates.
fn checked_uid(uid: &str) -> Result<&str> {
    let ok = !uid.is_empty()
        && uid.len() <= 63
        && uid.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-');
    if ok {
        Ok(uid)
    } else {
        Err(ProviderError::invalid(
            "InvalidUID",
            format!("pod UID {uid:?} is not a label value"),
        ))
    }
}

/// The kubeconfig's current context.
fn current_context(kubeconfig: &Kubeconfig) -> Option<&kube::config::Context> {
    let current = kubeconfig.current_context.as_deref();
    kubeconfig
        .contexts
        .iter()
        .find(|c| Some(c.name.as_str()) == current)?
        .context
        .as_ref()
}

fn owner_uid(p: &Pod) -> Option<&str> {
    p.metadata
        .labels
        .as_ref()?
        .get(naming::OWNER_UID)
        .map(String::as_str)
}

impl KubernetesProvider {
    /// Reads the config and the downstream kubeconfig; connects on first use.
    pub fn open(config: KubernetesConfig) -> Result<Self, ConfigError> {
        let kubeconfig =
            Kubeconfig::read_from(&config.kubeconfig).map_err(|e| ConfigError::Invalid {
                path: config.kubeconfig.clone(),
                field: "kubeconfig",
                message: e.to_string(),
            })?;
        let cluster = config.cluster_name.clone().unwrap_or_else(|| {
            current_context(&kubeconfig)
                .map(|c| c.cluster.clone())
                .filter(|c| !c.is_empty() && !c.contains('/'))
                .unwrap_or_else(|| "downstream".into())
        });
        let gpu = config
            .gpu_metrics
            .as_ref()
            .map(gpu_metrics::GpuMetrics::new)
            .transpose()
            .map_err(|e| ConfigError::Invalid {
                path: config.kubeconfig.clone(),
                field: "gpuMetrics",
                message: e.to_string(),
            })?;
        let (events, _) = broadcast::channel(4096);
        Ok(Self {
            config,
            kubeconfig,
            cluster,
            downstream: OnceCell::new(),
            events,
            claims: Arc::default(),
            verified: Arc::default(),
            namespace_create: tokio::sync::Mutex::default(),
            deleting: Mutex::default(),
            deletes_sent: Arc::default(),
            unreachable_since: Mutex::default(),
            cpu_totals: Mutex::default(),
            metrics: tokio::sync::Mutex::default(),
            gpu,
        })
    }

    /// The downstream cluster's name in instance ids.
    pub fn cluster(&self) -> &str {
        &self.cluster
    }

    fn pods_api(&self, d: &Downstream, namespace: &str) -> Api<Pod> {
        Api::namespaced(d.client.clone(), namespace)
    }

    fn instance(&self, pod: &Pod) -> Result<Instance> {
        status::instance(&self.cluster, pod).ok_or_else(|| {
            ProviderError::transient(
                "downstream: a Pod without vkd's labels where vkd's Pod should be",
            )
        })
    }

    async fn delete_pod(&self, d: &Downstream, pod: &Pod, grace: Duration) -> Result<()> {
        if pod.metadata.deletion_timestamp.is_some() {
            return Ok(());
        }
        let (Some(ns), Some(name)) = (&pod.metadata.namespace, &pod.metadata.name) else {
            return Ok(());
        };
        let pod_uid = pod.metadata.uid.clone().unwrap_or_default();
        let sent = lock(&self.deletes_sent).get(&pod_uid).map(|(_, g)| *g);
        if sent.is_some_and(|g| g <= grace.as_secs()) {
            return Ok(());
        }
        let params = DeleteParams {
            grace_period_seconds: Some(u32::try_from(grace.as_secs()).unwrap_or(u32::MAX)),
            preconditions: pod.metadata.uid.clone().map(|uid| Preconditions {
                uid: Some(uid),
                resource_version: None,
            }),
            ..DeleteParams::default()
        };
        match self.pods_api(d, ns).delete(name, &params).await {
            Ok(_) => {
                let owner = owner_uid(pod).unwrap_or_default().to_owned();
                lock(&self.deletes_sent).insert(pod_uid, (owner, grace.as_secs()));
                Ok(())
            }
            // Gone already, or a later Pod of the same name (the precondition).
            Err(e) if not_found(&e) || conflict(&e) => Ok(()),
            Err(e) => Err(transient("deleting the Pod", e)),
        }
    }

    async fn hosts(&self) -> Result<Vec<vkd_provider::HostSlice>> {
        let d = self.synced().await?;
        let nodes = d.nodes.state();
        Ok(capacity::host_slices(
            nodes.iter().map(|n| &**n),
            &lock(&d.usage),
            &self.config,
        ))
    }

    /// The slice of one downstream Node (none when the selector does not name it).
    async fn host(&self, name: &str) -> Result<Vec<vkd_provider::HostSlice>> {
        let d = self.synced().await?;
        let node = d.nodes.get(&kube::runtime::reflector::ObjectRef::new(name));
        Ok(capacity::host_slices(
            node.as_deref(),
            &lock(&d.usage),
            &self.config,
        ))
    }

    /// The PodMetrics of downstream namespace `ns` by Pod name: one list per
    /// namespace per scrape (a scrape asks for every Pod at once), kept for
    /// [`METRICS_FRESH`], instead of one GET per Pod.
    async fn namespace_metrics(&self, d: &Downstream, ns: &str) -> Result<PodMetrics> {
        let mut cache = self.metrics.lock().await;
        if let Some((at, list)) = cache.get(ns)
            && at.elapsed() < METRICS_FRESH
        {
            return Ok(Arc::clone(list));
        }
        let request =
            http::Request::get(format!("/apis/metrics.k8s.io/v1beta1/namespaces/{ns}/pods"))
                .body(Vec::new())
                .map_err(|e| transient("stats request", e))?;
        let list: serde_json::Value = match d.client.request(request).await {
            Ok(m) => m,
            Err(e) if not_found(&e) => {
                return Err(ProviderError::transient(format!(
                    "downstream: no PodMetrics in {ns} (is metrics-server installed in cluster {}?)",
                    self.cluster
                )));
            }
            Err(e) => return Err(transient("listing PodMetrics", e)),
        };
        let by_name: HashMap<String, serde_json::Value> = list["items"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|m| Some((m["metadata"]["name"].as_str()?.to_owned(), m.clone())))
            .collect();
        let by_name = Arc::new(by_name);
        // Namespaces vkd no longer asks about leave with their age.
        cache.retain(|_, (at, _)| at.elapsed() < METRICS_FRESH);
        cache.insert(
            ns.to_owned(),
            (std::time::Instant::now(), Arc::clone(&by_name)),
        );
        Ok(by_name)
    }

    /// Refuses a write of a replica whose node was taken over (`fence::check`).
    fn fenced(&self, d: &Downstream, fence: &Fence) -> Result<()> {
        fence::check(&d.fences, &self.config.fence_namespace, fence)
    }

    async fn running(&self, uid: &str) -> Result<(Api<Pod>, String)> {
        let pod = self
            .find(uid)
            .await?
            .ok_or_else(|| ProviderError::NotFound {
                uid: uid.to_owned(),
            })?;
        let d = self.synced().await?;
        let ns = pod.metadata.namespace.clone().unwrap_or_default();
        let name = pod.metadata.name.clone().unwrap_or_default();
        Ok((self.pods_api(d, &ns), name))
    }
}

#[async_trait]
impl Provider for KubernetesProvider {
    fn name(&self) -> &str {
        "kubernetes"
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            logs: Support::Supported,
            exec: Support::Supported,
            attach: Support::Supported,
            port_forward: Support::Supported,
            stats: Support::Supported,
            volumes: Support::Supported,
            limits: Support::Supported,
            ephemeral_containers: Support::Unsupported,
            pod_spec: Support::Supported,
            pod_network: Support::Supported,
            // The downstream metrics API has no GPU figures: its Prometheus
            // has what its DCGM exporter says, where the config names it.
            gpu_usage: if self.gpu.is_some() {
                Support::Supported
            } else {
                Support::Unsupported
            },
            backend_queue: Support::Unsupported,
        }
    }

    fn identity(&self) -> Vec<(String, String)> {
        let server = current_context(&self.kubeconfig)
            .and_then(|c| {
                self.kubeconfig
                    .clusters
                    .iter()
                    .find(|k| k.name == c.cluster)
            })
            .and_then(|k| k.cluster.as_ref()?.server.clone());
        let mut out = vec![
            ("vkd.io/downstream-cluster".to_owned(), self.cluster.clone()),
            (
                "vkd.io/downstream-namespace-prefix".to_owned(),
                self.config.namespace_prefix.clone(),
            ),
        ];
        if let Some(server) = server {
            out.push(("vkd.io/downstream-server".to_owned(), server));
        }
        out
    }

    async fn health(&self) -> Health {
        if let Some(why) = self.downstream.get().and_then(Downstream::stopped) {
            // Not an outage: the view is stale while the cluster answers.
            return Health::Unhealthy {
                reason: "DownstreamWatchStopped".into(),
                message: why,
            };
        }
        let problem = match self.downstream().await {
            Err(e) => Some(e.to_string()),
            Ok(d) => match tokio::time::timeout(PROBE, d.client.apiserver_version()).await {
                Ok(Ok(_)) => None,
                Ok(Err(e)) => Some(e.to_string()),
                Err(_) => Some(format!("no answer within {PROBE:?}")),
            },
        };
        let mut since = lock(&self.unreachable_since);
        let Some(problem) = problem else {
            *since = None;
            return Health::Healthy;
        };
        // Its Pods run on without their API server: unobserved, not lost.
        let (started, at) =
            *since.get_or_insert_with(|| (std::time::Instant::now(), jiff::Timestamp::now()));
        Health::Unreachable {
            reason: "DownstreamUnreachable".into(),
            // The same words on every probe, so the Node is not rewritten for each.
            message: format!(
                "the downstream cluster {} has not answered since {}: {problem}",
                self.cluster,
                at.round(jiff::Unit::Second).unwrap_or(at)
            ),
            past_grace: started.elapsed() >= self.config.outage_grace(),
        }
    }

    async fn capacity(&self) -> Result<Capacity> {
        Ok(Capacity {
            hosts: self.hosts().await?,
            kind: CapacityKind::Live,
            observed_at: SystemTime::now(),
            refresh_interval: Duration::from_secs(10),
        })
    }

    async fn admit(&self, spec: &InstanceSpec) -> Result<Admission> {
        checked_uid(&spec.pod.uid)?;
        // vkd's admission placed it already: only that Node is read again.
        let free = match &spec.placement {
            Some(p) => self.host(&p.host).await?,
            None => self.hosts().await?,
        };
        let whole: Vec<_> = free.iter().map(vkd_provider::HostSlice::whole).collect();
        Ok(vkd_provider::topology::decide(&whole, &free, spec))
    }

    async fn create(&self, fence: &Fence, spec: &InstanceSpec) -> Result<Instance> {
        let uid = checked_uid(&spec.pod.uid)?;
        let d = self.synced().await?;
        self.fenced(d, fence)?;
        let namespace = self.config.mapping().namespace(&spec.pod.namespace);
        let translated = translate::downstream_pod(spec, fence, &namespace)?;
        self.ensure_namespace(d, &namespace, &spec.pod.namespace)
            .await?;
        let api = self.pods_api(d, &namespace);
        let name = naming::pod_name(uid);
        let pod = match api.create(&PostParams::default(), &translated.pod).await {
            Ok(p) => p,
            Err(e) if conflict(&e) => {
                // Made by an earlier try: the same Pod, if it is this UID's
                // and where vkd puts it.
                let p = api
                    .get(&name)
                    .await
                    .map_err(|e| transient("reading the Pod", e))?;
                let mine = d
                    .judge
                    .check(&p)
                    .is_ok_and(|c| c.uid == uid && c.upstream_namespace == spec.pod.namespace);
                if !mine {
                    return Err(ProviderError::invalid(
                        "NameConflict",
                        format!("downstream Pod {namespace}/{name} exists and is not this Pod's"),
                    ));
                }
                p
            }
            Err(e) => {
                if let Some(fenced) = fence::denial(&fence.node, fence.epoch, &e) {
                    return Err(fenced);
                }
                if not_found(&e) {
                    // The namespace went away (someone deleted it): made again next time.
                    lock(&self.verified).remove(&namespace);
                }
                if let kube::Error::Api(s) = &e
                    && s.code == 403
                    && s.message.contains("violates PodSecurity")
                {
                    return Err(ProviderError::invalid(
                        "DownstreamForbidden",
                        format!("the downstream cluster refused the Pod: {}", s.message),
                    ));
                }
                if let kube::Error::Api(s) = &e
                    && s.code == 422
                {
                    return Err(ProviderError::invalid(
                        "DownstreamInvalid",
                        format!("the downstream API server refused the Pod: {}", s.message),
                    ));
                }
                return Err(transient("creating the Pod", e));
            }
        };
        let pod_uid = pod.metadata.uid.as_deref().unwrap_or_default();
        lock(&self.claims).made(uid, &namespace, pod_uid);
        self.create_secrets(d, fence, &pod, translated.secrets)
            .await?;
        self.instance(&pod)
    }

    async fn get(&self, uid: &str) -> Result<Option<Instance>> {
        let Some(pod) = self.find(uid).await? else {
            lock(&self.deleting).remove(uid);
            return Ok(None);
        };
        let mut instance = self.instance(&pod)?;
        let ended = matches!(
            instance.phase,
            InstancePhase::Succeeded | InstancePhase::Failed
        );
        if pod.metadata.deletion_timestamp.is_some()
            && !ended
            && !lock(&self.deleting).contains(uid)
        {
            // Deleted or evicted downstream by someone else: the Pod fails
            // (its controller replaces it); vkd never makes it again itself.
            instance.phase = InstancePhase::Failed;
            instance.message = Some(format!(
                "the downstream Pod {} is being deleted by someone other than vkd",
                instance.id
            ));
        }
        Ok(Some(instance))
    }

    async fn delete(&self, fence: &Fence, uid: &str, grace: Duration) -> Result<()> {
        lock(&self.cpu_totals).remove(uid);
        let Some(pod) = self.find(uid).await? else {
            return Ok(());
        };
        let d = self.synced().await?;
        self.fenced(d, fence)?;
        lock(&self.deleting).insert(uid.to_owned());
        self.delete_pod(d, &pod, grace).await
    }

    async fn takeover(&self, fence: &Fence) -> Result<()> {
        let d = self.downstream().await?;
        fence::check_installed(&d.client).await?;
        fence::raise(
            &d.client,
            &self.config.fence_namespace,
            &fence.node,
            fence.epoch,
        )
        .await?;
        info!(node = %fence.node, epoch = fence.epoch, cluster = %self.cluster, "downstream fence raised");
        Ok(())
    }

    async fn delete_instance(&self, fence: &Fence, id: &str, grace: Duration) -> Result<()> {
        let Some((ns, name)) = naming::parse_instance_id(&self.cluster, id) else {
            return Err(ProviderError::invalid(
                "UnknownInstance",
                format!("{id:?} is not an instance of cluster {}", self.cluster),
            ));
        };
        let d = self.synced().await?;
        self.fenced(d, fence)?;
        let pod = match self.pods_api(d, ns).get_opt(name).await {
            Ok(Some(p)) => p,
            Ok(None) => return Ok(()),
            Err(e) => return Err(transient("reading the Pod", e)),
        };
        // Never another's Pod, whatever labels it carries.
        let believed = d.judge.believe(&lock(&self.claims), &pod);
        let (Some(uid), Ok(())) = (owner_uid(&pod), believed.as_ref()) else {
            let why = believed
                .err()
                .map_or_else(String::new, |e| format!(": {e}"));
            return Err(ProviderError::invalid(
                "UnknownInstance",
                format!("{id} is not a Pod vkd made{why}"),
            ));
        };
        self.fenced(d, fence)?;
        lock(&self.deleting).insert(uid.to_owned());
        self.delete_pod(d, &pod, grace).await
    }

    async fn list(&self, node: &str) -> Result<Vec<Instance>> {
        let d = self.synced().await?;
        let kept = d.pods.all();
        let claims = lock(&self.claims);
        // One rebuilt Pod at a time, not all of them at once.
        Ok(own_instances(
            &self.cluster,
            &d.judge,
            &claims,
            kept.iter().map(|p| p.pod()),
            node,
        ))
    }

    fn events(&self) -> BoxStream<'static, InstanceEvent> {
        let rx = self.events.subscribe();
        tokio_stream_of(rx)
    }

    async fn update_volumes(&self, fence: &Fence, uid: &str, volumes: &[Volume]) -> Result<()> {
        let pod = self
            .find(uid)
            .await?
            .ok_or_else(|| ProviderError::NotFound {
                uid: uid.to_owned(),
            })?;
        let d = self.synced().await?;
        self.fenced(d, fence)?;
        let ns = pod.metadata.namespace.as_deref().unwrap_or_default();
        let api: Api<Secret> = Api::namespaced(d.client.clone(), ns);
        // Each write carries this replica's epoch, which the downstream fence
        // policy checks; the downstream kubelet then refreshes the files.
        let labels = translate::secret_labels(uid, fence);
        for (name, data) in translate::refreshed_secrets(&pod, volumes)? {
            let patch = serde_json::json!({ "metadata": { "labels": labels }, "data": data });
            if let Err(e) = api
                .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
            {
                return Err(fence::denial(&fence.node, fence.epoch, &e)
                    .unwrap_or_else(|| transient("updating a volume Secret", e)));
            }
        }
        Ok(())
    }

    async fn describe(&self, uid: &str) -> Result<Vec<(String, String)>> {
        self.describe_downstream(uid).await
    }

    async fn stats(&self, uid: &str) -> Result<PodStats> {
        let pod = self
            .find(uid)
            .await?
            .ok_or_else(|| ProviderError::NotFound {
                uid: uid.to_owned(),
            })?;
        let owner = self.instance(&pod)?.owner;
        let d = self.synced().await?;
        let ns = pod.metadata.namespace.as_deref().unwrap_or_default();
        let name = pod.metadata.name.as_deref().unwrap_or_default();
        let metrics = self
            .namespace_metrics(d, ns)
            .await?
            .get(name)
            .cloned()
            .ok_or_else(|| {
                ProviderError::transient(format!(
                    "downstream: no metrics for {ns}/{name} (is metrics-server installed in cluster {}?)",
                    self.cluster
                ))
            })?;
        let start = pod
            .status
            .as_ref()
            .and_then(|s| s.start_time.as_ref())
            .map_or_else(SystemTime::now, |t| SystemTime::from(t.0));
        let mut found = {
            let mut totals = lock(&self.cpu_totals);
            let mine = totals.entry(uid.to_owned()).or_default();
            stats::pod_stats(owner, start, &metrics, mine)
                .map_err(|e| ProviderError::transient(format!("downstream: {e}")))?
        };
        if let Some(gpu) = &self.gpu {
            // The CPU and memory figures stand without the GPUs': a
            // Prometheus that does not answer costs only these.
            match gpu.of_namespace(&d.client, ns).await {
                Ok(by_pod) => {
                    if let Some(gpus) = by_pod.get(name) {
                        stats::attach_gpus(&mut found, gpus);
                    }
                }
                Err(e) => tracing::debug!(error = %e, "no GPU figures for {ns}/{name}"),
            }
        }
        Ok(found)
    }

    async fn logs(&self, uid: &str, container: &str, request: LogRequest) -> Result<Logs> {
        let (api, name) = self.running(uid).await?;
        streams::logs(&api, &name, container, request).await
    }

    async fn exec(
        &self,
        uid: &str,
        container: &str,
        command: Vec<String>,
        io: StreamIo,
    ) -> Result<i32> {
        let (api, name) = self.running(uid).await?;
        streams::exec(&api, &name, container, command, io).await
    }

    async fn attach(&self, uid: &str, container: &str, io: StreamIo) -> Result<()> {
        let (api, name) = self.running(uid).await?;
        streams::attach(&api, &name, container, io).await
    }

    async fn port_forward(&self, uid: &str, port: u16, stream: Box<dyn Duplex>) -> Result<()> {
        let (api, name) = self.running(uid).await?;
        streams::port_forward(&api, &name, port, stream).await
    }
}
