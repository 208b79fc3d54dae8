//! The watches of the downstream cluster (its Nodes, vkd's namespaces and
//! every Pod), the view they keep (every Pod's requests for capacity, and of
//! vkd's own Pods what `kept` keeps), and the ownership bookkeeping of the
//! Pods they show: which are vkd's, and where each upstream UID's Pod lives.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use futures::stream::BoxStream;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Node, Pod};
use kube::api::ListParams;
use kube::config::KubeConfigOptions;
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client};
use tokio::sync::broadcast;
use tracing::{info, warn};
use vkd_provider::{Instance, InstanceEvent, ProviderError, Result};

use crate::kept::{KeptPods, Relisted};
use crate::ownership::{self, Claims, NotOurs};
use crate::{KubernetesProvider, checked_uid, lock, naming, owner_uid, status, transient};

/// How long a call waits for the first listing of the downstream cluster.
const FIRST_SYNC: Duration = Duration::from_secs(20);

/// The watches' view of the downstream cluster.
pub(crate) struct Downstream {
    pub(crate) client: Client,
    pub(crate) nodes: Store<Node>,
    /// vkd's own Pods, as much of them as vkd reads back (`kept`).
    pub(crate) pods: KeptPods,
    pub(crate) judge: Judge,
    /// What every Pod bound to each Node requests, from the Pod watch.
    pub(crate) usage: Arc<Mutex<crate::capacity::Usage>>,
    /// Whether each watch has listed once.
    listed: Listed,
    /// The nodes' fences (`fence`), as the downstream API server holds them.
    pub(crate) fences: Store<ConfigMap>,
    /// The watches' tasks: one that ended (a panic; they retry errors for
    /// ever) leaves its view stale, which every call then says (`stopped`).
    tasks: Vec<(&'static str, tokio::task::JoinHandle<()>)>,
    /// The last error of either watch, for the error of a call that waits
    /// for them (a bad hostSelector, missing RBAC, an unreachable server).
    watch_error: Arc<Mutex<Option<String>>>,
}

/// Whether each watch has listed the downstream cluster once (its view is
/// whole). Not kube's `Store::wait_until_ready`: that wakes only the last of
/// several tasks that wait at once (one oneshot receiver, one waker), so the
/// Pod watch, waiting for the namespaces while a call waited too, could sleep
/// for ever and every call then said "not listed yet". A `watch` channel
/// wakes every waiter.
#[derive(Clone)]
struct Listed {
    nodes: Signal,
    namespaces: Signal,
    fences: Signal,
    /// `usage` and `pods` hold a whole listing.
    pods: Signal,
}

type Signal = tokio::sync::watch::Receiver<bool>;

/// Waits until `signal` says listed (or its watch is gone).
async fn listed(signal: &Signal) {
    signal.clone().wait_for(|l| *l).await.ok();
}

/// Says listed when `ev` ends a listing (the reflector has applied it).
fn note_listed<K>(tx: &tokio::sync::watch::Sender<bool>, ev: &watcher::Result<watcher::Event<K>>) {
    if matches!(ev, Ok(watcher::Event::InitDone)) {
        tx.send_replace(true);
    }
}

/// Runs a reflector's `stream` for as long as the process: says when it has
/// listed, and keeps its last error for the calls that wait on it.
fn follow<K: Send + 'static>(
    what: &'static str,
    stream: impl futures::Stream<Item = watcher::Result<watcher::Event<K>>> + Send + 'static,
    watch_error: &Arc<Mutex<Option<String>>>,
) -> (Signal, (&'static str, tokio::task::JoinHandle<()>)) {
    let (tx, signal) = tokio::sync::watch::channel(false);
    let watch_error = Arc::clone(watch_error);
    let task = tokio::spawn(async move {
        futures::pin_mut!(stream);
        while let Some(ev) = stream.next().await {
            note_listed(&tx, &ev);
            if let Err(e) = ev {
                warn!(error = %e, "downstream {what}");
                *lock(&watch_error) = Some(format!("{what}: {e}"));
            }
        }
    });
    (signal, (what, task))
}

/// Where each upstream UID's downstream Pod lives: every Pod that passes
/// the ownership check as the watch lists it or `create` returned it; removed
/// when the watch sees it deleted, so it holds only live Pods.
pub(crate) type SharedClaims = Arc<Mutex<Claims>>;

impl Downstream {
    /// Why the view cannot be trusted: a watch whose task ended.
    pub(crate) fn stopped(&self) -> Option<String> {
        first_stopped(&self.tasks)
    }
}

fn first_stopped(tasks: &[(&'static str, tokio::task::JoinHandle<()>)]) -> Option<String> {
    let (name, _) = tasks.iter().find(|(_, t)| t.is_finished())?;
    Some(format!(
        "downstream: the {name} stopped; what vkd knows of the downstream cluster is stale (restart vkd)"
    ))
}

/// Downstream Pod UID -> (upstream UID, grace seconds) of the deletes vkd
/// sent (see `KubernetesProvider::delete_pod`).
pub(crate) type DeletesSent = Arc<Mutex<HashMap<String, (String, u64)>>>;

/// Downstream namespace -> the upstream namespace vkd made it for, for the
/// namespaces this process made or checked (the watch may not show them yet).
pub(crate) type Verified = Arc<Mutex<HashMap<String, String>>>;

/// Decides whether a downstream Pod is one vkd made (`ownership`), from the
/// namespaces the watch shows and those this process made.
#[derive(Clone)]
pub(crate) struct Judge {
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

    pub(crate) fn check<'a>(
        &self,
        pod: &'a Pod,
    ) -> std::result::Result<ownership::Claim<'a>, NotOurs> {
        ownership::check_pod(pod, &self.mapping, |ns| self.recorded(ns))
    }

    /// Whether `pod` is vkd's: made where and as vkd makes its Pods, and the
    /// one recorded for its upstream UID.
    pub(crate) fn believe(&self, claims: &Claims, pod: &Pod) -> std::result::Result<(), NotOurs> {
        let claim = self.check(pod)?;
        claims.is_home(
            claim.uid,
            pod.metadata.namespace.as_deref().unwrap_or_default(),
            pod.metadata.uid.as_deref().unwrap_or_default(),
        )
    }
}

/// Several downstream Pods claim `uid` and vkd has no record of which it
/// made: it acts on none (retried; the cluster's admin removes the other).
fn contested(uid: &str, why: &NotOurs) -> ProviderError {
    ProviderError::transient(format!(
        "downstream: upstream Pod {uid}: {why} (Pods with vkd's labels that vkd did not make; \
         remove them downstream)"
    ))
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

impl KubernetesProvider {
    pub(crate) async fn downstream(&self) -> Result<&Downstream> {
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
        let mut tasks: Vec<(&'static str, tokio::task::JoinHandle<()>)> = Vec::new();
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
        let (nodes_listed, task) = follow("Node watch", stream, &watch_error);
        tasks.push(task);
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
        let (namespaces_listed, task) = follow("Namespace watch", stream, &watch_error);
        tasks.push(task);
        // The fences: every write is checked against its node's (`fence::check`).
        let (fences, writer) = reflector::store();
        let stream = reflector::reflector(
            writer,
            watcher(
                Api::<ConfigMap>::namespaced(client.clone(), &self.config.fence_namespace),
                watcher::Config::default().labels(&format!("{}=true", crate::fence::FENCE_LABEL)),
            )
            .modify(|c: &mut ConfigMap| slim(&mut c.metadata)),
        )
        .default_backoff();
        let (fences_listed, task) = follow("fence watch", stream, &watch_error);
        tasks.push(task);
        let judge = Judge {
            mapping: self.config.mapping(),
            namespaces: namespaces.clone(),
            verified: Arc::clone(&self.verified),
        };
        // Every Pod: capacity counts other tenants' Pods too; only vkd's are kept.
        let pods = KeptPods::default();
        let stream =
            watcher(Api::<Pod>::all(client.clone()), watcher::Config::default()).default_backoff();
        let kept = pods.clone();
        let (events, claims) = (self.events.clone(), Arc::clone(&self.claims));
        let deletes_sent = Arc::clone(&self.deletes_sent);
        let usage: Arc<Mutex<crate::capacity::Usage>> = Arc::default();
        let (pod_usage, gpu) = (Arc::clone(&usage), self.config.gpu_resource.clone());
        let (listed_tx, pods_listed) = tokio::sync::watch::channel(false);
        let pod_error = Arc::clone(&watch_error);
        let (pod_judge, ns_ready) = (judge.clone(), namespaces_listed.clone());
        tasks.push(("Pod watch", tokio::spawn(async move {
            // Pods are judged by their namespaces: list those first.
            listed(&ns_ready).await;
            // Pods with vkd's labels that are not vkd's, reported once each.
            let mut foreign: HashSet<String> = HashSet::new();
            // vkd's Pods in the listing under way (a relist reports no deletions).
            let mut listed: HashSet<(String, String, String)> = HashSet::new();
            // Every Pod's requests as the listing under way finds them.
            let mut relisted = crate::capacity::Usage::default();
            // vkd's Pods as the listing under way finds them.
            let mut relisted_pods = Relisted::default();
            futures::pin_mut!(stream);
            while let Some(ev) = stream.next().await {
                // Kept before anyone is told of the change.
                match &ev {
                    Ok(watcher::Event::InitApply(p)) => {
                        relisted.apply(p, &gpu);
                        if owner_uid(p).is_some() {
                            relisted_pods.apply(p);
                        }
                    }
                    Ok(watcher::Event::Apply(p)) => {
                        lock(&pod_usage).apply(p, &gpu);
                        if owner_uid(p).is_some() {
                            kept.apply(p);
                        } else {
                            // Its owner label was taken off: no longer one to keep.
                            kept.delete(p);
                        }
                    }
                    Ok(watcher::Event::Delete(p)) => {
                        lock(&pod_usage).delete(p);
                        kept.delete(p);
                    }
                    Ok(watcher::Event::InitDone) => {
                        *lock(&pod_usage) = std::mem::take(&mut relisted);
                        kept.replace(std::mem::take(&mut relisted_pods));
                        listed_tx.send_replace(true);
                    }
                    Ok(watcher::Event::Init) => {
                        relisted = crate::capacity::Usage::default();
                        relisted_pods = Relisted::default();
                    }
                    Err(_) => {}
                }
                let (pod, gone) = match ev {
                    Ok(watcher::Event::InitApply(p)) => (p, None),
                    Ok(watcher::Event::Apply(p)) => (p, Some(false)),
                    Ok(watcher::Event::Delete(p)) => (p, Some(true)),
                    Ok(watcher::Event::InitDone) => {
                        // A relist reports no deletions: what it lacks is gone.
                        let present: HashSet<&str> =
                            listed.iter().map(|(_, _, pod)| pod.as_str()).collect();
                        lock(&deletes_sent).retain(|pod, _| present.contains(pod.as_str()));
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
                if gone == Some(true) {
                    lock(&deletes_sent).remove(&pod_uid);
                }
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
        })));
        info!(cluster = %self.cluster, "watching the downstream cluster");
        Downstream {
            client,
            nodes,
            pods,
            judge,
            usage,
            listed: Listed {
                nodes: nodes_listed,
                namespaces: namespaces_listed,
                fences: fences_listed,
                pods: pods_listed,
            },
            fences,
            watch_error,
            tasks,
        }
    }

    /// The downstream view, once both watches have listed.
    pub(crate) async fn synced(&self) -> Result<&Downstream> {
        let d = self.downstream().await?;
        if let Some(why) = d.stopped() {
            return Err(ProviderError::transient(why));
        }
        let l = &d.listed;
        let ready = async {
            listed(&l.nodes).await;
            listed(&l.namespaces).await;
            listed(&l.fences).await;
            listed(&l.pods).await;
        };
        if tokio::time::timeout(FIRST_SYNC, ready).await.is_err() {
            let waiting: Vec<&str> = [
                ("Nodes", &l.nodes),
                ("Namespaces", &l.namespaces),
                ("fences", &l.fences),
                ("Pods", &l.pods),
            ]
            .into_iter()
            .filter_map(|(what, signal)| (!*signal.borrow()).then_some(what))
            .collect();
            let why = lock(&d.watch_error)
                .clone()
                .unwrap_or_else(|| "no answer yet".into());
            return Err(ProviderError::transient(format!(
                "downstream: not listed yet ({}: {why})",
                waiting.join(", ")
            )));
        }
        Ok(d)
    }

    /// vkd's downstream Pod of `uid`: from the watch, or from the API server
    /// when the watch does not show it (it may lag a create, this replica's
    /// or, just before a takeover, the last one's). Only a Pod that passes the
    /// ownership check is returned (`ownership`); where several claim the UID
    /// and vkd has no record of making one, none is, and the call fails.
    pub(crate) async fn find(&self, uid: &str) -> Result<Option<Arc<Pod>>> {
        let uid = checked_uid(uid)?;
        let d = self.synced().await?;
        // A contest is settled below by asking the API server.
        let home = lock(&self.claims).home(uid).ok().flatten().cloned();
        let name = naming::pod_name(uid);
        if let Some(home) = home {
            let found = match d.pods.get(&home.namespace, &name) {
                Some(p) => Some(Arc::new(p.pod())),
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
}

/// The instances of `node` among `pods`: only vkd's own, so another's Pod is
/// never taken for an orphan or a duplicate to delete.
pub(crate) fn own_instances<P: std::borrow::Borrow<Pod>>(
    cluster: &str,
    judge: &Judge,
    claims: &Claims,
    pods: impl Iterator<Item = P>,
    node: &str,
) -> Vec<Instance> {
    pods.filter(|p| judge.believe(claims, p.borrow()).is_ok())
        .filter_map(|p| status::instance(cluster, p.borrow()))
        .filter(|i| i.node == node)
        .collect()
}

/// Change notifications from the broadcast; a receiver that fell behind is
/// told to list everything again.
pub(crate) fn tokio_stream_of(
    rx: broadcast::Receiver<InstanceEvent>,
) -> BoxStream<'static, InstanceEvent> {
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

    /// Every task that waits for a listing wakes when it ends: the Pod watch
    /// waits for the namespaces while calls wait for all four at once. (kube's
    /// `Store::wait_until_ready` woke only the last waiter, and a replica's
    /// Pod watch slept for ever behind its first call.)
    #[tokio::test]
    async fn every_waiter_wakes_when_a_listing_ends() {
        let (tx, signal) = tokio::sync::watch::channel(false);
        let waiters: Vec<_> = (0..3)
            .map(|_| {
                let signal = signal.clone();
                tokio::spawn(async move { listed(&signal).await })
            })
            .collect();
        // Let each register before the listing ends.
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        note_listed::<Pod>(&tx, &Ok(watcher::Event::Init));
        assert!(!*signal.borrow());
        note_listed::<Pod>(&tx, &Ok(watcher::Event::InitDone));
        for w in waiters {
            tokio::time::timeout(Duration::from_secs(5), w)
                .await
                .expect("a waiter slept through the end of the listing")
                .unwrap();
        }
    }

    /// A watch task that died (a panic) is named, rather than its view
    /// trusted on; running ones say nothing.
    #[tokio::test]
    async fn a_stopped_watch_is_named() {
        let running = tokio::spawn(std::future::pending::<()>());
        let dead = tokio::spawn(async { panic!("a bug in the watch") });
        let tasks = vec![("Node watch", running), ("Pod watch", dead)];
        for _ in 0..100 {
            if tasks[1].1.is_finished() {
                break;
            }
            tokio::task::yield_now().await;
        }
        let why = super::first_stopped(&tasks).unwrap();
        assert!(why.contains("the Pod watch stopped"), "{why}");
        assert_eq!(super::first_stopped(&tasks[..1]), None);
    }

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
}
