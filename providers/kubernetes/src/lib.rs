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
//! - Fencing: the downstream API server refuses a stale epoch (`fence`).
//! - Status, logs, exec, attach, port-forward: from the downstream API server
//!   (`status`, `streams`).

pub mod capacity;
pub mod config;
mod describe;
pub mod fence;
pub mod naming;
pub mod ownership;
pub mod stats;
pub mod status;
mod streams;
pub mod translate;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use futures::StreamExt;
use futures::stream::BoxStream;
use k8s_openapi::api::core::v1::{Namespace, Node, Pod, Secret};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams, Preconditions};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client};
use tokio::sync::{OnceCell, broadcast};
use tracing::{info, warn};
use vkd_provider::{
    Admission, Capabilities, Capacity, CapacityKind, Duplex, Fence, Health, Instance,
    InstanceEvent, InstancePhase, InstanceSpec, LogRequest, Logs, PodStats, Provider,
    ProviderError, Result, StreamIo, Support, Volume,
};

pub use config::{ConfigError, KubernetesConfig};
use ownership::{Claims, NotOurs};

/// How long a call waits for the first listing of the downstream cluster.
const FIRST_SYNC: Duration = Duration::from_secs(20);
/// How long a health probe of the downstream API server may take.
const PROBE: Duration = Duration::from_secs(5);

/// The watches' view of the downstream cluster.
struct Downstream {
    client: Client,
    nodes: Store<Node>,
    pods: Store<Pod>,
    /// Namespaces labelled as vkd's (`vkd.io/managed=true`).
    namespaces: Store<Namespace>,
    judge: Judge,
    /// The last error of either watch, for the error of a call that waits
    /// for them (a bad hostSelector, missing RBAC, an unreachable server).
    watch_error: Arc<Mutex<Option<String>>>,
}

/// Where each upstream UID's downstream Pod lives: every Pod that passes
/// the ownership check as the watch lists it or `create` returned it; removed
/// when the watch sees it deleted, so it holds only live Pods.
type SharedClaims = Arc<Mutex<Claims>>;

/// Downstream namespace -> the upstream namespace vkd made it for, for the
/// namespaces this process made or checked (the watch may not show them yet).
type Verified = Arc<Mutex<HashMap<String, String>>>;

/// Decides whether a downstream Pod is one vkd made (`ownership`), from the
/// namespaces the watch shows and those this process made.
#[derive(Clone)]
struct Judge {
    mapping: naming::Mapping,
    namespaces: Store<Namespace>,
    verified: Verified,
}

impl Judge {
    /// What vkd knows of downstream namespace `ns` (see `ownership::namespace_upstream`).
    fn recorded(&self, ns: &str) -> std::result::Result<Option<String>, NotOurs> {
        if let Some(n) = self.namespaces.get(&ObjectRef::new(ns)) {
            return ownership::namespace_upstream(&n, &self.mapping).map(|u| u.map(str::to_owned));
        }
        // Made by this process; the watch has not shown it yet.
        lock(&self.verified)
            .get(ns)
            .cloned()
            .map(Some)
            .ok_or_else(|| NotOurs::Unmanaged(ns.to_owned()))
    }

    fn check<'a>(&self, pod: &'a Pod) -> std::result::Result<ownership::Claim<'a>, NotOurs> {
        ownership::check_pod(pod, &self.mapping, |ns| self.recorded(ns))
    }

    /// Whether `pod` is vkd's: made where and as vkd makes its Pods, and the
    /// one recorded for its upstream UID.
    fn believe(&self, claims: &Claims, pod: &Pod) -> std::result::Result<(), NotOurs> {
        let claim = self.check(pod)?;
        claims.is_home(
            claim.uid,
            pod.metadata.namespace.as_deref().unwrap_or_default(),
            pod.metadata.uid.as_deref().unwrap_or_default(),
        )
    }
}

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
    /// Since when health probes have failed (none: the last one answered).
    unreachable_since: Mutex<Option<(std::time::Instant, jiff::Timestamp)>>,
    /// CPU time summed from the metrics API's rates, per upstream UID
    /// (`stats`); dropped with the Pod.
    cpu_totals: Mutex<HashMap<String, stats::CpuTotals>>,
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

/// An answer that says the request itself is refused, and will be again:
/// not a passing state (a conflict, too many requests, a gone namespace).
fn refused(code: u16) -> bool {
    (400..500).contains(&code) && !matches!(code, 404 | 408 | 409 | 429)
}

/// Several downstream Pods claim `uid` and vkd has no record of which it
/// made: it acts on none (retried; the cluster's admin removes the other).
fn contested(uid: &str, why: &NotOurs) -> ProviderError {
    ProviderError::transient(format!(
        "downstream: upstream Pod {uid}: {why} (Pods with vkd's labels that vkd did not make; \
         remove them downstream)"
    ))
}

fn namespace_conflict(namespace: &str, held: &str, upstream: &str) -> ProviderError {
    ProviderError::invalid(
        "NamespaceConflict",
        format!(
            "the downstream namespace {namespace} holds upstream namespace {held}'s Pods; \
             vkd does not put upstream namespace {upstream}'s there"
        ),
    )
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

/// What the stores keep of an object's metadata: not its managedFields nor
/// kubectl's copy of the last applied object, which vkd never reads and
/// which are often most of the object (every tenant's Pod is held).
fn slim(meta: &mut kube::api::ObjectMeta) {
    meta.managed_fields = None;
    if let Some(a) = meta.annotations.as_mut() {
        a.remove("kubectl.kubernetes.io/last-applied-configuration");
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
            unreachable_since: Mutex::default(),
            cpu_totals: Mutex::default(),
        })
    }

    /// The downstream cluster's name in instance ids.
    pub fn cluster(&self) -> &str {
        &self.cluster
    }

    async fn downstream(&self) -> Result<&Downstream> {
        self.downstream
            .get_or_try_init(|| async {
                let options = KubeConfigOptions::default();
                let cfg = kube::Config::from_custom_kubeconfig(self.kubeconfig.clone(), &options)
                    .await
                    .map_err(|e| transient("reading the kubeconfig", e))?;
                let client = Client::try_from(cfg).map_err(|e| transient("client", e))?;
                Ok(self.watch(client))
            })
            .await
    }

    /// Starts the Node and Pod watches; they run as long as the process.
    fn watch(&self, client: Client) -> Downstream {
        let mut node_watch = watcher::Config::default();
        if !self.config.host_selector.is_empty() {
            node_watch = node_watch.labels(&self.config.host_selector);
        }
        let watch_error: Arc<Mutex<Option<String>>> = Arc::default();
        let (nodes, writer) = reflector::store();
        let stream = reflector::reflector(
            writer,
            watcher(Api::<Node>::all(client.clone()), node_watch).modify(|n: &mut Node| {
                slim(&mut n.metadata);
                // A real Node lists every image it holds: capacity needs none.
                if let Some(s) = n.status.as_mut() {
                    s.images = None;
                }
            }),
        )
        .default_backoff();
        let node_error = Arc::clone(&watch_error);
        tokio::spawn(async move {
            futures::pin_mut!(stream);
            while let Some(ev) = stream.next().await {
                if let Err(e) = ev {
                    warn!(error = %e, "downstream Node watch");
                    *lock(&node_error) = Some(format!("Node watch: {e}"));
                }
            }
        });
        // The namespaces vkd made: where its Pods may be.
        let (namespaces, writer) = reflector::store();
        let stream = reflector::reflector(
            writer,
            watcher(
                Api::<Namespace>::all(client.clone()),
                watcher::Config::default().labels(&format!("{}=true", naming::MANAGED)),
            )
            .modify(|n: &mut Namespace| slim(&mut n.metadata)),
        )
        .default_backoff();
        let ns_error = Arc::clone(&watch_error);
        tokio::spawn(async move {
            futures::pin_mut!(stream);
            while let Some(ev) = stream.next().await {
                if let Err(e) = ev {
                    warn!(error = %e, "downstream Namespace watch");
                    *lock(&ns_error) = Some(format!("Namespace watch: {e}"));
                }
            }
        });
        let judge = Judge {
            mapping: self.config.mapping(),
            namespaces: namespaces.clone(),
            verified: Arc::clone(&self.verified),
        };
        // Every Pod: capacity counts other tenants' Pods too.
        let (pods, writer) = reflector::store();
        let stream = reflector::reflector(
            writer,
            watcher(Api::<Pod>::all(client.clone()), watcher::Config::default())
                .modify(|p: &mut Pod| slim(&mut p.metadata)),
        )
        .default_backoff();
        let (events, claims) = (self.events.clone(), Arc::clone(&self.claims));
        let pod_error = Arc::clone(&watch_error);
        let (pod_judge, ns_ready) = (judge.clone(), namespaces.clone());
        tokio::spawn(async move {
            // Pods are judged by their namespaces: list those first.
            ns_ready.wait_until_ready().await.ok();
            // Pods with vkd's labels that are not vkd's, reported once each.
            let mut foreign: HashSet<String> = HashSet::new();
            // vkd's Pods in the listing under way (a relist reports no deletions).
            let mut listed: HashSet<(String, String, String)> = HashSet::new();
            futures::pin_mut!(stream);
            while let Some(ev) = stream.next().await {
                let (pod, gone) = match ev {
                    Ok(watcher::Event::InitApply(p)) => (p, None),
                    Ok(watcher::Event::Apply(p)) => (p, Some(false)),
                    Ok(watcher::Event::Delete(p)) => (p, Some(true)),
                    Ok(watcher::Event::InitDone) => {
                        lock(&claims).relisted(&std::mem::take(&mut listed));
                        let _ = events.send(InstanceEvent::Resync);
                        continue;
                    }
                    Ok(watcher::Event::Init) => {
                        listed.clear();
                        foreign.clear();
                        continue;
                    }
                    Err(e) => {
                        warn!(error = %e, "downstream Pod watch");
                        *lock(&pod_error) = Some(format!("Pod watch: {e}"));
                        continue;
                    }
                };
                if owner_uid(&pod).is_none() {
                    continue;
                }
                let pod_uid = pod.metadata.uid.clone().unwrap_or_default();
                let ns = pod.metadata.namespace.clone().unwrap_or_default();
                let claim = pod_judge.check(&pod);
                let noted = match claim {
                    Ok(claim) => {
                        let mut claims = lock(&claims);
                        if gone == Some(true) {
                            claims.gone(claim.uid, &ns, &pod_uid);
                            Ok(claim.uid)
                        } else {
                            if gone.is_none() {
                                listed.insert((claim.uid.to_owned(), ns.clone(), pod_uid.clone()));
                            }
                            claims.seen(claim.uid, &ns, &pod_uid).map(|()| claim.uid)
                        }
                    }
                    Err(e) => Err(e),
                };
                match noted {
                    // A listing ends with Resync, which covers its Pods.
                    Ok(uid) if gone.is_some() => {
                        let _ = events.send(InstanceEvent::Changed {
                            uid: uid.to_owned(),
                        });
                    }
                    Ok(_) => {}
                    Err(_) if gone == Some(true) => {
                        foreign.remove(&pod_uid);
                    }
                    Err(why) => {
                        if foreign.insert(pod_uid) {
                            warn!(
                                pod = %format!("{ns}/{}", pod.metadata.name.as_deref().unwrap_or_default()),
                                %why,
                                "a downstream Pod with vkd's labels that vkd did not make: ignored"
                            );
                        }
                    }
                }
            }
        });
        info!(cluster = %self.cluster, "watching the downstream cluster");
        Downstream {
            client,
            nodes,
            pods,
            namespaces,
            judge,
            watch_error,
        }
    }

    /// The downstream view, once both watches have listed.
    async fn synced(&self) -> Result<&Downstream> {
        let d = self.downstream().await?;
        let ready = async {
            d.nodes.wait_until_ready().await.ok();
            d.namespaces.wait_until_ready().await.ok();
            d.pods.wait_until_ready().await.ok();
        };
        tokio::time::timeout(FIRST_SYNC, ready).await.map_err(|_| {
            let why = lock(&d.watch_error)
                .clone()
                .unwrap_or_else(|| "no answer yet".into());
            ProviderError::transient(format!("downstream: not listed yet ({why})"))
        })?;
        Ok(d)
    }

    fn pods_api(&self, d: &Downstream, namespace: &str) -> Api<Pod> {
        Api::namespaced(d.client.clone(), namespace)
    }

    /// vkd's downstream Pod of `uid`: from the watch, or from the API server
    /// when the watch does not show it (it may lag a create, this replica's
    /// or, just before a takeover, the last one's). Only a Pod that passes the
    /// ownership check is returned (`ownership`); where several claim the UID
    /// and vkd has no record of making one, none is, and the call fails.
    async fn find(&self, uid: &str) -> Result<Option<Arc<Pod>>> {
        let uid = checked_uid(uid)?;
        let d = self.synced().await?;
        // A contest is settled below by asking the API server.
        let home = lock(&self.claims).home(uid).ok().flatten().cloned();
        let name = naming::pod_name(uid);
        if let Some(home) = home {
            let found = match d.pods.get(&ObjectRef::new(&name).within(&home.namespace)) {
                Some(p) => Some(p),
                None => self
                    .pods_api(d, &home.namespace)
                    .get_opt(&name)
                    .await
                    .map_err(|e| transient("reading the Pod", e))?
                    .map(Arc::new),
            };
            let Some(p) = found else {
                lock(&self.claims).gone(uid, &home.namespace, &home.pod_uid);
                return Ok(None);
            };
            let found_uid = p.metadata.uid.as_deref().unwrap_or_default();
            let believed = d.judge.check(&p).map(|_| ()).and_then(|()| {
                if found_uid == home.pod_uid {
                    Ok(())
                } else {
                    Err(NotOurs::Uid {
                        found: found_uid.to_owned(),
                        recorded: home.pod_uid.clone(),
                    })
                }
            });
            return match believed {
                Ok(()) => Ok(Some(p)),
                // Replaced by a Pod vkd did not make: vkd's is gone, and the
                // record stays, so the other one is never taken for it.
                Err(why) => {
                    warn!(%uid, %why, "the downstream Pod in vkd's place is not vkd's");
                    Ok(None)
                }
            };
        }
        // Not one the watch has shown: only the API server can say.
        let api: Api<Pod> = Api::all(d.client.clone());
        let listed = api
            .list(&ListParams::default().labels(&format!("{}={uid}", naming::OWNER_UID)))
            .await
            .map_err(|e| transient("listing Pods", e))?;
        let mut mine = Vec::new();
        for p in listed.items {
            match d.judge.check(&p) {
                Ok(_) => mine.push(p),
                Err(why) => {
                    let at = format!(
                        "{}/{}",
                        p.metadata.namespace.as_deref().unwrap_or_default(),
                        p.metadata.name.as_deref().unwrap_or_default()
                    );
                    warn!(%uid, pod = %at, %why, "a downstream Pod claims this UID and is not vkd's: ignored");
                }
            }
        }
        let present: Vec<(String, String)> = mine
            .iter()
            .map(|p| {
                (
                    p.metadata.namespace.clone().unwrap_or_default(),
                    p.metadata.uid.clone().unwrap_or_default(),
                )
            })
            .collect();
        let mut claims = lock(&self.claims);
        let Some(home) = claims
            .settle(uid, &present)
            .map_err(|e| contested(uid, &e))?
        else {
            return Ok(None);
        };
        Ok(mine
            .into_iter()
            .find(|p| {
                p.metadata.namespace.as_deref() == Some(&home.namespace)
                    && p.metadata.uid.as_deref() == Some(&home.pod_uid)
            })
            .map(Arc::new))
    }

    /// Makes sure `namespace` is a downstream namespace vkd made for upstream
    /// namespace `upstream`: creates it (vkd's labels, Pod Security enforced
    /// at the configured level), or checks the one there. vkd places no Pod in
    /// a namespace it did not make, nor in one made for another upstream
    /// namespace.
    async fn ensure_namespace(
        &self,
        d: &Downstream,
        namespace: &str,
        upstream: &str,
    ) -> Result<()> {
        let known = || -> Option<Result<()>> {
            let verified = lock(&self.verified);
            let held = verified.get(namespace)?;
            Some(if held == upstream {
                Ok(())
            } else {
                Err(namespace_conflict(namespace, held, upstream))
            })
        };
        if let Some(r) = known() {
            return r;
        }
        // One create at a time: a burst of Pods in a new namespace makes it once.
        let _one = self.namespace_create.lock().await;
        if let Some(r) = known() {
            return r;
        }
        let api: Api<Namespace> = Api::all(d.client.clone());
        let level = self.config.pod_security.clone();
        let ns = Namespace {
            metadata: kube::api::ObjectMeta {
                name: Some(namespace.to_owned()),
                labels: Some(BTreeMap::from([
                    (naming::MANAGED.to_owned(), "true".to_owned()),
                    (naming::UPSTREAM_NAMESPACE.to_owned(), upstream.to_owned()),
                    (naming::POD_SECURITY.to_owned(), level.clone()),
                ])),
                ..Default::default()
            },
            ..Namespace::default()
        };
        match api.create(&PostParams::default(), &ns).await {
            Ok(_) => {}
            Err(e) if conflict(&e) => {
                let existing = api
                    .get(namespace)
                    .await
                    .map_err(|e| transient("reading the namespace", e))?;
                match ownership::namespace_upstream(&existing, &self.config.mapping()) {
                    Ok(Some(held)) if held != upstream => {
                        return Err(namespace_conflict(namespace, held, upstream));
                    }
                    Ok(_) => {}
                    Err(why) => {
                        return Err(ProviderError::invalid(
                            "NamespaceNotManaged",
                            format!(
                                "the downstream namespace {namespace} exists and vkd did not make it ({why}); \
                                 vkd places Pods only in namespaces it made: remove it downstream, or give vkd \
                                 another namespacePrefix"
                            ),
                        ));
                    }
                }
                // Made by a vkd that did not record the upstream namespace,
                // or stripped of its Pod Security label: both put back.
                let labels = existing.metadata.labels.unwrap_or_default();
                let mut missing = serde_json::Map::new();
                if labels.get(naming::UPSTREAM_NAMESPACE).map(String::as_str) != Some(upstream) {
                    missing.insert(naming::UPSTREAM_NAMESPACE.into(), upstream.into());
                }
                if !labels.contains_key(naming::POD_SECURITY) {
                    missing.insert(naming::POD_SECURITY.into(), level.into());
                }
                if !missing.is_empty() {
                    let patch = serde_json::json!({ "metadata": { "labels": missing } });
                    api.patch(namespace, &PatchParams::default(), &Patch::Merge(&patch))
                        .await
                        .map_err(|e| transient("labelling the namespace", e))?;
                }
            }
            Err(e) => return Err(transient("creating the namespace", e)),
        }
        lock(&self.verified).insert(namespace.to_owned(), upstream.to_owned());
        Ok(())
    }

    /// Creates the Secrets of `pod`'s volumes, owned by it (so the downstream
    /// garbage collector removes them with it). Existing ones are kept. A
    /// Secret the API server refuses fails the Pod with the API server's
    /// words, and its downstream Pod is removed: it would otherwise wait,
    /// Pending, for a Secret that never comes.
    async fn create_secrets(
        &self,
        d: &Downstream,
        pod: &Pod,
        secrets: Vec<translate::VolumeSecret>,
    ) -> Result<()> {
        let (Some(ns), Some(name), Some(uid)) = (
            pod.metadata.namespace.as_deref(),
            pod.metadata.name.as_deref(),
            pod.metadata.uid.as_deref(),
        ) else {
            return Err(ProviderError::transient(
                "downstream: the Pod came back without its identity",
            ));
        };
        let api: Api<Secret> = Api::namespaced(d.client.clone(), ns);
        for translate::VolumeSecret { volume, mut secret } in secrets {
            secret.metadata.owner_references = Some(vec![OwnerReference {
                api_version: "v1".into(),
                kind: "Pod".into(),
                name: name.to_owned(),
                uid: uid.to_owned(),
                controller: Some(true),
                block_owner_deletion: None,
            }]);
            let secret_name = secret.metadata.name.clone().unwrap_or_default();
            match api.create(&PostParams::default(), &secret).await {
                Ok(_) => {}
                Err(e) if conflict(&e) => {}
                Err(kube::Error::Api(s)) if refused(s.code) => {
                    if let Some(owner) = owner_uid(pod) {
                        lock(&self.deleting).insert(owner.to_owned());
                    }
                    if let Err(e) = self.delete_pod(d, pod, Duration::ZERO).await {
                        warn!(error = %e, pod = %format!("{ns}/{name}"), "removing a Pod whose volume was refused");
                    }
                    return Err(ProviderError::invalid(
                        "VolumeRefused",
                        format!(
                            "the downstream API server refused Secret {secret_name}, which carries volume {volume:?}: {} ({})",
                            s.message, s.code
                        ),
                    ));
                }
                Err(e) => return Err(transient("creating a volume Secret", e)),
            }
        }
        Ok(())
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
        let params = DeleteParams {
            grace_period_seconds: Some(u32::try_from(grace.as_secs()).unwrap_or(u32::MAX)),
            preconditions: pod.metadata.uid.clone().map(|uid| Preconditions {
                uid: Some(uid),
                resource_version: None,
            }),
            ..DeleteParams::default()
        };
        match self.pods_api(d, ns).delete(name, &params).await {
            Ok(_) => Ok(()),
            // Gone already, or a later Pod of the same name (the precondition).
            Err(e) if not_found(&e) || conflict(&e) => Ok(()),
            Err(e) => Err(transient("deleting the Pod", e)),
        }
    }

    async fn hosts(&self) -> Result<Vec<vkd_provider::HostSlice>> {
        let d = self.synced().await?;
        let (nodes, pods) = (d.nodes.state(), d.pods.state());
        Ok(capacity::host_slices(
            nodes.iter().map(|n| &**n),
            pods.iter().map(|p| &**p),
            &self.config,
        ))
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
        let free = self.hosts().await?;
        let whole: Vec<_> = free.iter().map(vkd_provider::HostSlice::whole).collect();
        Ok(vkd_provider::topology::decide(&whole, &free, spec))
    }

    async fn create(&self, fence: &Fence, spec: &InstanceSpec) -> Result<Instance> {
        let uid = checked_uid(&spec.pod.uid)?;
        let d = self.synced().await?;
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
        self.create_secrets(d, &pod, translated.secrets).await?;
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

    async fn delete(&self, _fence: &Fence, uid: &str, grace: Duration) -> Result<()> {
        lock(&self.cpu_totals).remove(uid);
        let Some(pod) = self.find(uid).await? else {
            return Ok(());
        };
        lock(&self.deleting).insert(uid.to_owned());
        let d = self.synced().await?;
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

    async fn delete_instance(&self, _fence: &Fence, id: &str, grace: Duration) -> Result<()> {
        let Some((ns, name)) = naming::parse_instance_id(&self.cluster, id) else {
            return Err(ProviderError::invalid(
                "UnknownInstance",
                format!("{id:?} is not an instance of cluster {}", self.cluster),
            ));
        };
        let d = self.synced().await?;
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
        lock(&self.deleting).insert(uid.to_owned());
        self.delete_pod(d, &pod, grace).await
    }

    async fn list(&self, node: &str) -> Result<Vec<Instance>> {
        let d = self.synced().await?;
        let pods = d.pods.state();
        let claims = lock(&self.claims);
        Ok(own_instances(
            &self.cluster,
            &d.judge,
            &claims,
            pods.iter().map(|p| &**p),
            node,
        ))
    }

    fn events(&self) -> BoxStream<'static, InstanceEvent> {
        let rx = self.events.subscribe();
        tokio_stream_of(rx)
    }

    async fn update_volumes(&self, _fence: &Fence, uid: &str, volumes: &[Volume]) -> Result<()> {
        let pod = self
            .find(uid)
            .await?
            .ok_or_else(|| ProviderError::NotFound {
                uid: uid.to_owned(),
            })?;
        let d = self.synced().await?;
        let ns = pod.metadata.namespace.as_deref().unwrap_or_default();
        let api: Api<Secret> = Api::namespaced(d.client.clone(), ns);
        // The downstream kubelet then refreshes the files, as for any Secret.
        for (name, data) in translate::refreshed_secrets(&pod, volumes)? {
            let patch = serde_json::json!({ "data": data });
            api.patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
                .await
                .map_err(|e| transient("updating a volume Secret", e))?;
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
        let request = http::Request::get(format!(
            "/apis/metrics.k8s.io/v1beta1/namespaces/{ns}/pods/{name}"
        ))
        .body(Vec::new())
        .map_err(|e| transient("stats request", e))?;
        let metrics: serde_json::Value = match d.client.request(request).await {
            Ok(m) => m,
            Err(e) if not_found(&e) => {
                return Err(ProviderError::transient(format!(
                    "downstream: no metrics for {ns}/{name} (is metrics-server installed in cluster {}?)",
                    self.cluster
                )));
            }
            Err(e) => return Err(transient("reading PodMetrics", e)),
        };
        let start = pod
            .status
            .as_ref()
            .and_then(|s| s.start_time.as_ref())
            .map_or_else(SystemTime::now, |t| SystemTime::from(t.0));
        let mut totals = lock(&self.cpu_totals);
        let mine = totals.entry(uid.to_owned()).or_default();
        stats::pod_stats(owner, start, &metrics, mine)
            .map_err(|e| ProviderError::transient(format!("downstream: {e}")))
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

/// The instances of `node` among `pods`: only vkd's own, so another's Pod is
/// never taken for an orphan or a duplicate to delete.
fn own_instances<'a>(
    cluster: &str,
    judge: &Judge,
    claims: &Claims,
    pods: impl Iterator<Item = &'a Pod>,
    node: &str,
) -> Vec<Instance> {
    pods.filter(|p| judge.believe(claims, p).is_ok())
        .filter_map(|p| status::instance(cluster, p))
        .filter(|i| i.node == node)
        .collect()
}

/// Change notifications from the broadcast; a receiver that fell behind is
/// told to list everything again.
fn tokio_stream_of(rx: broadcast::Receiver<InstanceEvent>) -> BoxStream<'static, InstanceEvent> {
    futures::stream::unfold(rx, |mut rx| async move {
        match rx.recv().await {
            Ok(ev) => Some((ev, rx)),
            Err(broadcast::error::RecvError::Lagged(_)) => Some((InstanceEvent::Resync, rx)),
            Err(broadcast::error::RecvError::Closed) => None,
        }
    })
    .boxed()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // a failed unwrap is a failed test
    use super::*;
    use serde_json::json;

    fn judge(namespaces: serde_json::Value) -> Judge {
        let (store, mut writer) = reflector::store();
        for n in namespaces.as_array().unwrap() {
            let n: Namespace = serde_json::from_value(n.clone()).unwrap();
            writer.apply_watcher_event(&watcher::Event::Apply(n));
        }
        Judge {
            mapping: naming::Mapping {
                prefix: "vkd-".into(),
                fence_namespace: "vkd-system".into(),
            },
            namespaces: store,
            verified: Arc::default(),
        }
    }

    fn pod(name: &str, ns: &str, pod_uid: &str, owner: &str, epoch: u64) -> Pod {
        serde_json::from_value(json!({
            "metadata": {
                "name": name, "namespace": ns, "uid": pod_uid,
                "creationTimestamp": "2026-01-01T00:00:00Z",
                "labels": {"vkd.io/owner-uid": owner, "vkd.io/owner-node": "vk", "vkd.io/epoch": epoch.to_string()},
                "annotations": {"vkd.io/owner-namespace": "offload", "vkd.io/owner-name": "victim"}
            }
        }))
        .unwrap()
    }

    #[test]
    fn a_decoy_is_never_an_instance_so_never_a_duplicate_to_delete() {
        let j = judge(json!([
            {"metadata": {"name": "vkd-offload", "labels": {"vkd.io/managed": "true", "vkd.io/upstream-namespace": "offload"}}},
            // A tenant's namespace with the prefix vkd uses, not made by vkd.
            {"metadata": {"name": "vkd-tenant", "labels": {"team": "t"}}}
        ]));
        let real = pod("vkd-victim", "vkd-offload", "real", "victim", 3);
        let decoys = [
            // The reported attack: vkd's name, labels and a higher epoch in
            // the tenant's own namespace.
            pod("vkd-victim", "tenant-a", "d1", "victim", 9_999_999),
            pod("vkd-victim", "vkd-tenant", "d2", "victim", 9_999_999),
            // Beside the real one under another name.
            pod("decoy", "vkd-offload", "d3", "victim", 9_999_999),
            // In vkd's own namespace.
            pod("vkd-victim", "vkd-system", "d4", "victim", 9_999_999),
        ];
        let mut claims = Claims::default();
        claims.made("victim", "vkd-offload", "real");
        let all: Vec<&Pod> = std::iter::once(&real).chain(decoys.iter()).collect();
        let listed = own_instances("down", &j, &claims, all.iter().copied(), "vk");
        let ids: Vec<&str> = listed.iter().map(|i| i.id.as_str()).collect();
        assert_eq!(ids, ["down/vkd-offload/vkd-victim"]);
        // The same without a record of making it (after a restart).
        let listed = own_instances("down", &j, &Claims::default(), all.iter().copied(), "vk");
        assert_eq!(listed.len(), 1);
        // A Pod in vkd's place with another UID than the one vkd made.
        let replaced = pod("vkd-victim", "vkd-offload", "other", "victim", 4);
        assert!(matches!(
            j.believe(&claims, &replaced),
            Err(NotOurs::Uid { .. })
        ));
    }

    #[test]
    fn a_namespace_this_process_made_counts_before_the_watch_shows_it() {
        let j = judge(json!([]));
        let p = pod("vkd-victim", "vkd-offload", "real", "victim", 1);
        assert!(j.believe(&Claims::default(), &p).is_err());
        lock(&j.verified).insert("vkd-offload".into(), "offload".into());
        assert!(j.believe(&Claims::default(), &p).is_ok());
        lock(&j.verified).insert("vkd-offload".into(), "elsewhere".into());
        assert!(matches!(
            j.believe(&Claims::default(), &p),
            Err(NotOurs::OtherUpstream { .. })
        ));
    }

    #[test]
    fn only_a_lasting_refusal_fails_a_volume() {
        for code in [400, 403, 413, 422] {
            assert!(refused(code), "{code}");
        }
        for code in [404, 409, 429, 500, 503] {
            assert!(!refused(code), "{code}");
        }
    }
}
