//! Admission before binding: the devices vkd publishes carry the binding
//! condition [`RESERVED`] and the failure condition [`REJECTED`], so the
//! scheduler, once it has allocated a Pod's claims on them, waits in PreBind
//! until vkd says on the claim whether the backend holds the placement.
//!
//! For each unbound Pod whose claims are allocated on this daemon's pools,
//! the node's admitter decides on exactly the allocated GPUs (as the create
//! step would, and keeping the reservation the create step then uses):
//! - fits: `BackendReserved=True`; the scheduler binds, vkd creates;
//! - must wait: `BackendReserved=False`, reason `BackendQueued` and what it
//!   waits for; looked at again every [`RECHECK`]. The Pod stays unbound.
//!   After `--queue-timeout`, or when the scheduler's own `bindingTimeout`
//!   (10 minutes unless its DynamicResources args say otherwise) runs out
//!   first, the allocation fails and the Pod is scheduled again;
//! - never: `BackendRejected=True` with the backend's reason: the scheduler
//!   fails PreBind, frees the devices and schedules the Pod again, to another
//!   Node if one fits.
//!
//! A reservation whose Pod was deallocated, deleted or bound elsewhere is
//! released.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{DeviceRequestAllocationResult, ResourceClaim};
use kube::runtime::watcher;
use kube::{Api, Client};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};
use vkd_provider::{Admission, Placement};

use super::devices::{self, Layout};
use super::{DraError, Settings};
use crate::explain::Action;
use crate::topology::Admitter;

pub use super::devices::{REJECTED, RESERVED};
/// How often a Pod the backend queues is looked at again.
pub const RECHECK: Duration = Duration::from_secs(5);

/// One Node this daemon serves, as admission before binding sees it.
#[derive(Clone)]
pub struct NodeSide {
    pub node: String,
    pub per_host: bool,
    pub admitter: Arc<Admitter>,
    pub queue_timeout: Duration,
}

impl std::fmt::Debug for NodeSide {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeSide")
            .field("node", &self.node)
            .finish_non_exhaustive()
    }
}

/// What vkd last said for one unbound Pod.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Said {
    Reserved(Placement),
    Queued(String),
    Rejected,
}

#[derive(Debug)]
struct Tracked {
    namespace: String,
    name: String,
    node: usize,
    said: Said,
    /// The allocation it answered (`pool/device`, sorted).
    devices: Vec<String>,
    /// Whether the answer reached the claims.
    written: bool,
    /// The claims it was answered on (the scheduler's claim for extended
    /// resources may reach the Pod's status only after its watch event).
    claims: Vec<String>,
    since: Instant,
}

pub struct Binder {
    client: Client,
    metrics: Arc<crate::metrics::Metrics>,
    /// Writes vkd's answers on the claims.
    answers: super::answer::Answers,
    settings: Settings,
    nodes: Vec<NodeSide>,
    /// Where each answer is kept for `vkd explain pod`, with the epoch it was given at.
    decisions: Arc<crate::explain::DecisionLog>,
    epoch: u64,
    /// Unbound Pods vkd has answered for, by UID.
    tracked: tokio::sync::Mutex<HashMap<String, Tracked>>,
    /// What each claim holds of this daemon's pools (`vkd_dra_allocated_devices`).
    allocations: std::sync::Mutex<super::allocated::Allocated>,
}

impl std::fmt::Debug for Binder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Binder")
            .field("nodes", &self.nodes)
            .finish_non_exhaustive()
    }
}

impl Binder {
    pub fn new(
        client: Client,
        settings: Settings,
        nodes: Vec<NodeSide>,
        metrics: Arc<crate::metrics::Metrics>,
        decisions: Arc<crate::explain::DecisionLog>,
        epoch: u64,
    ) -> Self {
        let answers = super::answer::Answers::new(
            client.clone(),
            nodes.first().map(|n| n.node.clone()),
            Arc::clone(&metrics),
            settings.driver.clone(),
        );
        Self {
            client,
            metrics,
            answers,
            settings,
            nodes,
            decisions,
            epoch,
            tracked: tokio::sync::Mutex::default(),
            allocations: std::sync::Mutex::default(),
        }
    }

    /// Watches the claims until `shutdown`, answering for the Pods whose
    /// devices are this daemon's.
    pub async fn run(self: Arc<Self>, shutdown: CancellationToken) -> Result<(), DraError> {
        let api: Api<ResourceClaim> = Api::all(self.client.clone());
        let mut claims = watcher(api, watcher::Config::default()).boxed();
        let mut tick = tokio::time::interval(RECHECK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return Ok(()),
                _ = tick.tick() => self.recheck().await,
                event = claims.next() => match event {
                    Some(Ok(watcher::Event::Apply(c) | watcher::Event::InitApply(c))) => {
                        self.count(&c, false);
                        self.claim_changed(&c).await;
                    }
                    Some(Ok(watcher::Event::Delete(c))) => {
                        self.count(&c, true);
                        self.claim_changed(&c).await;
                    }
                    Some(Ok(watcher::Event::Init)) => self.relist(false),
                    Some(Ok(watcher::Event::InitDone)) => self.relist(true),
                    Some(Err(e)) => {
                        warn!(error = %e, "the ResourceClaim watch failed; it resumes");
                        tokio::time::sleep(Duration::from_secs(1)).await;
                    }
                    None => return Ok(()),
                },
            }
        }
    }

    /// Whether `pool` is one of this daemon's Nodes' pools.
    fn ours(&self, pool: &str) -> bool {
        self.nodes.iter().any(|n| {
            Layout {
                node: &n.node,
                per_host: n.per_host,
                driver: &self.settings.driver,
            }
            .owns(pool)
        })
    }

    /// Counts what a claim holds of this daemon's pools (`gone`: nothing now).
    fn count(&self, claim: &ResourceClaim, gone: bool) {
        let Some(uid) = claim.metadata.uid.clone() else {
            return;
        };
        let pools: Vec<String> = if gone {
            Vec::new()
        } else {
            devices::allocated(claim)
                .into_iter()
                .filter(|r| r.driver == self.settings.driver && self.ours(&r.pool))
                .map(|r| r.pool)
                .collect()
        };
        self.publish_counts(|a| a.claim(uid, pools));
    }

    /// A relist of the claims begins (`done` false) or ends: at its end, the
    /// claims it did not see are gone.
    fn relist(&self, done: bool) {
        self.publish_counts(|a| {
            if done {
                a.relist_done()
            } else {
                a.relist_started();
                Vec::new()
            }
        });
    }

    /// Changes the counts with `change`, and sets the metric of each pool it changed.
    fn publish_counts(&self, change: impl FnOnce(&mut super::allocated::Allocated) -> Vec<String>) {
        let mut a = self
            .allocations
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for pool in change(&mut a) {
            self.metrics.dra_allocated(&pool, a.count(&pool));
        }
    }

    /// The Pods a changed claim concerns, looked at again: those vkd answered
    /// for on it (it may be deallocated or released since), and those it is
    /// reserved for while its devices wait for vkd's answer. A claim already
    /// answered, of a Pod vkd no longer tracks (bound), costs nothing.
    async fn claim_changed(&self, claim: &ResourceClaim) {
        let Some(ns) = claim.metadata.namespace.clone() else {
            return;
        };
        let name = claim.metadata.name.clone().unwrap_or_default();
        let mut pods: Vec<(String, String)> = self
            .tracked
            .lock()
            .await
            .iter()
            .filter(|(_, t)| t.namespace == ns && t.claims.contains(&name))
            .map(|(uid, t)| (t.name.clone(), uid.clone()))
            .collect();
        if devices::awaits_answer(claim, &self.settings.driver) {
            for (pod, uid) in devices::reserved_pods(claim) {
                if !pods.iter().any(|(_, u)| *u == uid) {
                    pods.push((pod, uid));
                }
            }
        }
        if pods.is_empty() {
            return;
        }
        debug!(claim = %name, "claim changed");
        for (pod, uid) in pods {
            self.consider(&ns, &pod, &uid, std::slice::from_ref(&name))
                .await;
        }
    }

    /// The queued Pods, and any whose claims changed unseen, looked at again.
    async fn recheck(&self) {
        let pods: Vec<(String, String, String, Vec<String>)> = self
            .tracked
            .lock()
            .await
            .iter()
            .map(|(uid, t)| {
                (
                    t.namespace.clone(),
                    t.name.clone(),
                    uid.clone(),
                    t.claims.clone(),
                )
            })
            .collect();
        for (ns, name, uid, claims) in pods {
            self.consider(&ns, &name, &uid, &claims).await;
        }
    }

    async fn forget(&self, uid: &str, release: bool) {
        if let Some(t) = self.tracked.lock().await.remove(uid)
            && release
        {
            self.nodes[t.node].admitter.release(uid);
            info!(pod = %format!("{}/{}", t.namespace, t.name), "released the reservation made before binding");
        }
    }

    /// Answers for one unbound Pod: reserve, queue or reject its allocation.
    /// `hints`: claims reserved for it that its status may not list yet.
    async fn consider(&self, ns: &str, name: &str, uid: &str, hints: &[String]) {
        if let Err(e) = self.answer(ns, name, uid, hints).await {
            warn!(pod = %format!("{ns}/{name}"), error = %e, "admission before binding failed; trying again");
        }
    }

    async fn answer(
        &self,
        ns: &str,
        name: &str,
        uid: &str,
        hints: &[String],
    ) -> Result<(), DraError> {
        let api_err = |what: String| move |source| DraError::Api { what, source };
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), ns);
        let pod = pods
            .get_opt(name)
            .await
            .map_err(api_err(format!("reading Pod {ns}/{name}")))?;
        let Some(pod) = pod.filter(|p| p.metadata.uid.as_deref() == Some(uid)) else {
            self.forget(uid, true).await;
            return Ok(());
        };
        if let Some(bound) = pod.spec.as_ref().and_then(|s| s.node_name.as_deref()) {
            // Bound: the node's Pod controller takes over (and the reservation,
            // when bound here); bound elsewhere, nothing is held for it.
            let here = self.nodes.iter().any(|n| n.node == bound);
            self.forget(uid, !here).await;
            return Ok(());
        }
        if pod.metadata.deletion_timestamp.is_some() {
            self.forget(uid, true).await;
            return Ok(());
        }
        // Its claims, and the results of them that are this daemon's.
        let claims_api: Api<ResourceClaim> = Api::namespaced(self.client.clone(), ns);
        let mut claims = Vec::new();
        let mut names = Vec::new();
        for r in devices::claim_refs(&pod) {
            let Some(claim) = r.claim else {
                return Ok(());
            };
            names.push(claim);
        }
        for h in hints {
            if !names.contains(h) {
                names.push(h.clone());
            }
        }
        for claim in &names {
            let Some(c) = claims_api
                .get_opt(claim)
                .await
                .map_err(api_err(format!("reading ResourceClaim {ns}/{claim}")))?
            else {
                continue;
            };
            claims.push(c);
        }
        let mut mine: Vec<(String, DeviceRequestAllocationResult)> = Vec::new();
        let mut waiting_on_us = false;
        for c in &claims {
            let reserved = devices::reserved_pods(c).iter().any(|(_, u)| u == uid);
            for r in devices::allocated(c) {
                if r.driver != self.settings.driver {
                    continue;
                }
                waiting_on_us |=
                    reserved && r.binding_conditions.as_ref().is_some_and(|b| !b.is_empty());
                mine.push((c.metadata.name.clone().unwrap_or_default(), r));
            }
        }
        if !waiting_on_us {
            // Deallocated (a failure or the scheduler's timeout) or not ours.
            self.forget(uid, true).await;
            return Ok(());
        }
        let mut devices: Vec<String> = mine
            .iter()
            .map(|(_, r)| format!("{}/{}", r.pool, r.device))
            .collect();
        devices.sort();
        let Some((index, side, hosts)) = self.side_of(&mine).await? else {
            return Ok(());
        };
        let layout = Layout {
            node: &side.node,
            per_host: side.per_host,
            driver: &self.settings.driver,
        };
        let placement = match devices::placement(&layout, &hosts, &mine) {
            Ok(Some(p)) => p,
            Ok(None) => return Ok(()),
            Err(e) => {
                self.decided(index, uid, ns, name, Action::Rejected, &e.0, &devices);
                self.track(uid, ns, name, index, Said::Rejected, &devices, &names)
                    .await;
                self.answers
                    .say(
                        &claims,
                        &pod,
                        false,
                        Some(("UnusableResourceClaim", &e.0)),
                        None,
                    )
                    .await?;
                self.written(uid).await;
                return Ok(());
            }
        };
        let previous = self
            .tracked
            .lock()
            .await
            .get(uid)
            .filter(|t| t.devices == devices)
            .map(|t| (t.said.clone(), t.since, t.written));
        match &previous {
            Some((Said::Reserved(p), _, true))
                if *p == placement && side.admitter.held_placement(uid).as_ref() == Some(p) =>
            {
                return Ok(());
            }
            Some((Said::Rejected, _, true)) => return Ok(()),
            _ => {}
        }
        let previous = previous.map(|(said, since, _)| (said, since));
        let mut spec = crate::pods::spec::pending(&pod, &side.node)
            .map_err(|e| DraError::Spec(e.message))?
            .spec;
        devices::place(&mut spec, placement.clone());
        let admission = side
            .admitter
            .admit(&spec)
            .await
            .map_err(|e| DraError::Provider(e.to_string()))?;
        match admission {
            Admission::Fits(p) => {
                let message = format!(
                    "backend holds host {} GPUs {} for it",
                    p.host,
                    p.gpu_ids.join(",")
                );
                self.decided(index, uid, ns, name, Action::Admitted, &message, &devices);
                // Tracked before it is said: a failed write leaves the
                // reservation to be said again, or released, never leaked.
                self.track(
                    uid,
                    ns,
                    name,
                    index,
                    Said::Reserved(p.clone()),
                    &devices,
                    &names,
                )
                .await;
                self.answers
                    .say(
                        &claims,
                        &pod,
                        true,
                        None,
                        Some(("BackendReserved", &message)),
                    )
                    .await?;
                self.written(uid).await;
                info!(pod = %format!("{ns}/{name}"), host = %p.host, "reserved before binding");
            }
            Admission::Queued { reason } => {
                let waited = previous
                    .as_ref()
                    .map_or(Duration::ZERO, |(_, since)| since.elapsed());
                if waited >= side.queue_timeout {
                    let message = format!(
                        "waited {}s for the backend (--queue-timeout {}s): {reason}",
                        waited.as_secs(),
                        side.queue_timeout.as_secs()
                    );
                    self.decided(index, uid, ns, name, Action::Rejected, &message, &devices);
                    self.track(uid, ns, name, index, Said::Rejected, &devices, &names)
                        .await;
                    self.answers
                        .say(
                            &claims,
                            &pod,
                            false,
                            Some(("BackendQueueTimeout", &message)),
                            None,
                        )
                        .await?;
                    self.written(uid).await;
                    return Ok(());
                }
                let new = previous.as_ref().map(|(s, _)| s) != Some(&Said::Queued(reason.clone()));
                self.track(
                    uid,
                    ns,
                    name,
                    index,
                    Said::Queued(reason.clone()),
                    &devices,
                    &names,
                )
                .await;
                if new {
                    self.decided(index, uid, ns, name, Action::Queued, &reason, &devices);
                    self.answers
                        .say(&claims, &pod, false, None, Some(("BackendQueued", &reason)))
                        .await?;
                    self.written(uid).await;
                    info!(pod = %format!("{ns}/{name}"), %reason, "queued before binding");
                }
            }
            Admission::Rejected { reason, message } => {
                self.decided(
                    index,
                    uid,
                    ns,
                    name,
                    Action::Rejected,
                    &format!("{reason}: {message}"),
                    &devices,
                );
                self.track(uid, ns, name, index, Said::Rejected, &devices, &names)
                    .await;
                self.answers
                    .say(&claims, &pod, false, Some((&reason, &message)), None)
                    .await?;
                self.written(uid).await;
                info!(pod = %format!("{ns}/{name}"), %reason, %message, "rejected before binding");
            }
        }
        Ok(())
    }

    /// Keeps an answer in the decision log (`vkd explain pod` shows them:
    /// the binding conditions' history).
    #[allow(clippy::too_many_arguments)]
    fn decided(
        &self,
        node: usize,
        uid: &str,
        ns: &str,
        name: &str,
        action: Action,
        why: &str,
        devices: &[String],
    ) {
        self.decisions.record(
            &self.nodes[node].node,
            uid,
            &format!("{ns}/{name}"),
            "",
            self.epoch,
            action,
            format!("before binding, on devices {}: {why}", devices.join(", ")),
        );
    }

    #[allow(clippy::too_many_arguments)]
    async fn track(
        &self,
        uid: &str,
        ns: &str,
        name: &str,
        node: usize,
        said: Said,
        devices: &[String],
        claims: &[String],
    ) {
        let mut tracked = self.tracked.lock().await;
        let since = tracked
            .get(uid)
            .filter(|t| t.devices == devices)
            .map_or_else(Instant::now, |t| t.since);
        tracked.insert(
            uid.to_owned(),
            Tracked {
                namespace: ns.to_owned(),
                name: name.to_owned(),
                node,
                said,
                devices: devices.to_vec(),
                written: false,
                claims: claims.to_vec(),
                since,
            },
        );
    }

    /// The answer tracked for `uid` reached its claims.
    async fn written(&self, uid: &str) {
        if let Some(t) = self.tracked.lock().await.get_mut(uid) {
            t.written = true;
        }
    }

    /// The Node whose pools hold these devices, with its hosts.
    async fn side_of(
        &self,
        results: &[(String, DeviceRequestAllocationResult)],
    ) -> Result<Option<(usize, &NodeSide, Vec<vkd_provider::HostSlice>)>, DraError> {
        let Some((_, first)) = results.first() else {
            return Ok(None);
        };
        for (i, side) in self.nodes.iter().enumerate() {
            let hosts = side
                .admitter
                .hosts()
                .await
                .map_err(|e| DraError::Provider(e.to_string()))?;
            let layout = Layout {
                node: &side.node,
                per_host: side.per_host,
                driver: &self.settings.driver,
            };
            if hosts.iter().any(|h| layout.pool(&h.name) == first.pool) {
                return Ok(Some((i, side, hosts)));
            }
        }
        Ok(None)
    }
}
