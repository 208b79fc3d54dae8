//! The node agent: registers the virtual Node, renews its Lease every 10 s (on
//! its own task, [`lease`]), and posts its status when it changes and at least
//! every 5 minutes, as the kubelet does. When the provider is unhealthy or does
//! not answer, the Node says Ready=False with a reason rather than going silent.
//! A backend that is only unreachable (its instances run on) leaves the Node
//! Ready and sets the `BackendUnreachable` condition instead.

mod lease;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use futures::{FutureExt, StreamExt};
use k8s_openapi::api::core::v1::Node;
use kube::api::{Patch, PatchParams};
use kube::{Api, Client};
use serde_json::{Value, json};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, info, warn};
use vkd_provider::{Capacity, Health, Provider};

use crate::config::Taint;
use crate::pods::status::time;

const FIELD_MANAGER: &str = "vkd";
/// After a provider change, wait this long for more before looking at capacity.
const CHANGE_SETTLE: Duration = Duration::from_millis(500);

#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error("registering node {node}: {source}")]
    Register {
        node: String,
        #[source]
        source: kube::Error,
    },
    /// The lease task stopped while the agent ran: the Node would go NotReady
    /// with nobody saying why, so the agent stops too.
    #[error("node {node}: the lease task stopped: {reason}")]
    LeaseStopped { node: String, reason: String },
}

#[derive(Clone, Debug)]
pub struct Settings {
    pub name: String,
    pub address: String,
    pub kubelet_port: u16,
    /// Where metrics-server reads this Node's resource metrics, when the port
    /// serves other Nodes too (`metrics.k8s.io/resource-metrics-path`).
    pub resource_metrics_path: Option<String>,
    pub labels: BTreeMap<String, String>,
    pub taints: Vec<Taint>,
    pub max_pods: Option<u32>,
    pub lease_renew_interval: Duration,
    pub lease_duration: Duration,
    pub status_report_interval: Duration,
    /// Who may run what here, for the `vkd.io/policy` annotation.
    pub policy: String,
    /// In per-host mode, the one host slice this Node stands for.
    pub host: Option<String>,
    /// Publish the GPUs as DRA ResourceSlices rather than `nvidia.com/gpu`.
    pub dra: Option<crate::dra::Settings>,
}

pub struct NodeAgent {
    settings: Settings,
    client: Client,
    provider: Arc<dyn Provider>,
    /// Unix milliseconds of the last successful lease renewal, for the partition policy.
    last_renewal: Arc<std::sync::atomic::AtomicU64>,
    /// The Node's ResourceSlices, with DRA on.
    slices: Option<crate::dra::publish::Publisher>,
}

impl NodeAgent {
    /// Counts what the Node publishes through DRA on these metrics.
    pub fn with_metrics(mut self, metrics: Arc<crate::metrics::Metrics>) -> Self {
        self.slices = self.slices.map(|s| s.with_metrics(metrics));
        self
    }
}

impl std::fmt::Debug for NodeAgent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeAgent")
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

/// A condition's status, reason and message.
type Wanted = (&'static str, String, String);

/// vkd's own Node condition, True while the provider cannot reach its backend
/// (as NetworkUnavailable is True while the network is): the Node can stay
/// Ready through the outage, and this says why nothing moves.
pub const BACKEND_UNREACHABLE: &str = "BackendUnreachable";

/// One condition as last posted, to keep its lastTransitionTime.
#[derive(Clone, Debug, PartialEq)]
struct Posted {
    status: &'static str,
    reason: String,
    message: String,
    since: SystemTime,
}

impl NodeAgent {
    pub fn new(
        settings: Settings,
        client: Client,
        provider: Arc<dyn Provider>,
        last_renewal: Arc<std::sync::atomic::AtomicU64>,
    ) -> Self {
        let slices = settings.dra.clone().map(|dra| {
            crate::dra::publish::Publisher::new(
                client.clone(),
                dra,
                settings.name.clone(),
                settings.host.is_some(),
            )
        });
        Self {
            settings,
            client,
            provider,
            last_renewal,
            slices,
        }
    }

    fn labels(&self) -> BTreeMap<String, String> {
        let mut labels: BTreeMap<String, String> = [
            ("type", "virtual-kubelet"),
            ("kubernetes.io/os", "linux"),
            ("kubernetes.io/arch", ARCH),
            ("kubernetes.io/role", "agent"),
            ("kubernetes.io/hostname", self.settings.name.as_str()),
            ("vkd.io/provider", self.provider.name()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
        labels.extend(self.settings.labels.clone());
        labels
    }

    /// Creates or updates the Node (server-side apply: vkd owns its labels and taints,
    /// and the capacity labels and annotations, which are applied again when they change).
    async fn register(&self, cap: Option<&Capacity>) -> Result<String, NodeError> {
        let api: Api<Node> = Api::all(self.client.clone());
        let taints: Vec<Value> = self
            .settings
            .taints
            .iter()
            .map(|t| json!({"key": t.key, "value": t.value, "effect": t.effect}))
            .collect();
        let caps = self.provider.capabilities().supported();
        let (topo_labels, topo_annotations) = self.topology(cap);
        let mut labels = self.labels();
        labels.extend(topo_labels);
        let mut annotations: BTreeMap<String, String> = [
            (
                "vkd.io/capabilities",
                if caps.is_empty() {
                    "none".to_owned()
                } else {
                    caps.join(",")
                },
            ),
            ("node.alpha.kubernetes.io/ttl", "0".to_owned()),
            ("vkd.io/policy", self.settings.policy.clone()),
            ("vkd.io/capacity-observed-at", time(SystemTime::now())),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect();
        annotations.extend(topo_annotations);
        if let Some(path) = &self.settings.resource_metrics_path {
            annotations.insert(
                crate::kubelet_api::nodes::RESOURCE_METRICS_PATH_ANNOTATION.to_owned(),
                path.clone(),
            );
        }
        // Only its own keys: the provider cannot overwrite vkd's.
        let identity: Vec<(String, String)> = self
            .provider
            .identity()
            .into_iter()
            .filter(|(k, _)| k.starts_with("vkd.io/") && !annotations.contains_key(k))
            .collect();
        annotations.extend(identity);
        let node = json!({
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": self.settings.name,
                "labels": labels,
                "annotations": annotations,
            },
            "spec": { "taints": taints },
        });
        let params = PatchParams::apply(FIELD_MANAGER).force();
        let node = api
            .patch(&self.settings.name, &params, &Patch::Apply(node))
            .await
            .map_err(|source| NodeError::Register {
                node: self.settings.name.clone(),
                source,
            })?;
        Ok(node.metadata.uid.unwrap_or_default())
    }

    /// What the capacity means, as labels and annotations.
    fn topology(
        &self,
        cap: Option<&Capacity>,
    ) -> (BTreeMap<String, String>, BTreeMap<String, String>) {
        cap.map(|c| crate::topology::node_metadata(c, self.settings.host.is_some()))
            .unwrap_or_default()
    }

    /// The provider's capacity, only this Node's host in per-host mode.
    async fn capacity(&self) -> vkd_provider::Result<Capacity> {
        let mut cap = self.provider.capacity().await?;
        if let Some(h) = &self.settings.host {
            cap.hosts.retain(|s| &s.name == h);
        }
        Ok(cap)
    }

    /// The Ready and BackendUnreachable conditions and the capacity, from the provider.
    async fn observe(&self) -> ([Wanted; 2], Option<Capacity>) {
        let name = self.provider.name().to_owned();
        let reachable = || {
            (
                "False",
                "BackendReachable".to_owned(),
                format!("provider {name} reaches its backend"),
            )
        };
        match self.provider.health().await {
            Health::Unhealthy { reason, message } => (
                [
                    (
                        "False",
                        reason,
                        format!("provider {name} is unhealthy: {message}"),
                    ),
                    reachable(),
                ],
                self.capacity().await.ok(),
            ),
            Health::Unreachable {
                reason,
                message,
                past_grace,
            } => {
                let ready = if past_grace {
                    (
                        "False",
                        reason.clone(),
                        format!(
                            "provider {name} has not reached its backend for longer than its grace: {message}"
                        ),
                    )
                } else {
                    (
                        "True",
                        "KubeletReady".to_owned(),
                        format!(
                            "vkd is posting ready status; provider {name} cannot reach its backend, whose instances run on unobserved"
                        ),
                    )
                };
                // Its last view of the backend: what it holds is still held.
                (
                    [ready, ("True", reason, message)],
                    self.capacity().await.ok(),
                )
            }
            Health::Healthy => match self.capacity().await {
                Ok(c) => (
                    [
                        (
                            "True",
                            "KubeletReady".into(),
                            format!("vkd is posting ready status; provider {name} is healthy"),
                        ),
                        reachable(),
                    ],
                    Some(c),
                ),
                Err(e) => (
                    [
                        (
                            "False",
                            "ProviderCapacityUnavailable".into(),
                            format!("provider {name} did not report capacity: {e}"),
                        ),
                        reachable(),
                    ],
                    None,
                ),
            },
        }
    }

    fn resources(&self, cap: Option<&Capacity>) -> Value {
        let hosts = cap.map(|c| c.hosts.as_slice()).unwrap_or_default();
        // The same figures a downward-API read of an unset limit gives.
        let crate::pods::spec::Allocatable {
            cpu_millis: cpu,
            memory_bytes: mem,
        } = crate::topology::allocatable(hosts);
        let (mut gpus, mut pods, mut disk) = (0usize, 0u64, 0u64);
        for h in hosts {
            gpus += h.gpus.len();
            pods += u64::from(h.max_pods);
            disk = disk.saturating_add(h.ephemeral_storage_bytes);
        }
        if let Some(max) = self.settings.max_pods {
            pods = u64::from(max);
        }
        let mut resources = json!({
            "cpu": vkd_provider::quantity::format_cpu(cpu),
            "memory": mem.to_string(),
            "pods": pods.to_string(),
        });
        // With DRA the GPUs are devices in ResourceSlices: counted once, there.
        if self.slices.is_none() {
            resources["nvidia.com/gpu"] = json!(gpus.to_string());
        }
        // Only where the backend says: a figure it left out is not claimed.
        if disk > 0 {
            resources["ephemeral-storage"] = json!(disk.to_string());
        }
        resources
    }

    fn status_body(
        &self,
        conditions: &[(&'static str, Posted)],
        cap: Option<&Capacity>,
        heartbeat: SystemTime,
    ) -> Value {
        let resources = self.resources(cap);
        let conditions: Vec<Value> = conditions
            .iter()
            .map(|(t, p)| {
                json!({
                    "type": t, "status": p.status, "reason": p.reason, "message": p.message,
                    "lastHeartbeatTime": time(heartbeat), "lastTransitionTime": time(p.since),
                })
            })
            .collect();
        json!({
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": { "name": self.settings.name },
            "status": {
                "capacity": resources,
                "allocatable": resources,
                "conditions": conditions,
                "addresses": [
                    {"type": "InternalIP", "address": self.settings.address},
                    {"type": "Hostname", "address": self.settings.name},
                ],
                "daemonEndpoints": {"kubeletEndpoint": {"Port": self.settings.kubelet_port}},
                // vkd serves WebSocket v5 itself, so the apiserver need not translate to SPDY.
                "declaredFeatures": ["ExtendWebSocketsToKubelet"],
                "nodeInfo": {
                    "machineID": self.settings.name,
                    "systemUUID": self.settings.name,
                    "bootID": "",
                    "kernelVersion": "",
                    "osImage": format!("vkd {}", env!("CARGO_PKG_VERSION")),
                    "containerRuntimeVersion": format!("{}://{}", self.provider.name(), env!("CARGO_PKG_VERSION")),
                    "kubeletVersion": format!("v1.37.2-vkd.{}", env!("CARGO_PKG_VERSION")),
                    "kubeProxyVersion": "",
                    "operatingSystem": "linux",
                    "architecture": ARCH,
                },
            },
        })
    }

    /// Runs until shutdown. `registered` turns true once the Node exists.
    pub async fn run(
        self,
        shutdown: CancellationToken,
        registered: watch::Sender<bool>,
    ) -> Result<(), NodeError> {
        let (owner, node_uid) = watch::channel(None);
        let lease_stop = shutdown.child_token();
        let _stop_lease = lease_stop.clone().drop_guard();
        let mut lease = tokio::spawn(
            lease::NodeLease {
                client: self.client.clone(),
                node: self.settings.name.clone(),
                duration: self.settings.lease_duration,
                interval: self.settings.lease_renew_interval,
                renewed: Arc::clone(&self.last_renewal),
            }
            .run(node_uid, lease_stop)
            .in_current_span(),
        );
        // Provider calls may take up to their deadline: shutdown does not wait for them.
        tokio::select! {
            // Shutdown first: it also stops the lease task, which is then no failure.
            biased;
            () = shutdown.cancelled() => Ok(()),
            joined = &mut lease => Err(NodeError::LeaseStopped {
                node: self.settings.name.clone(),
                reason: match joined {
                    Ok(()) => "it ended".into(),
                    Err(e) => e.to_string(),
                },
            }),
            never = self.report(&owner, &registered) => match never {},
        }
    }

    /// Registers the Node, then keeps its status current; never returns.
    async fn report(
        &self,
        owner: &watch::Sender<Option<String>>,
        registered: &watch::Sender<bool>,
    ) -> std::convert::Infallible {
        let initial = self.capacity().await.ok();
        let mut last_meta = self.topology(initial.as_ref());
        let node_uid = loop {
            match self.register(initial.as_ref()).await {
                Ok(uid) => break uid,
                Err(e) => {
                    warn!(error = %e, "node registration failed; retrying in 2s");
                    tokio::time::sleep(Duration::from_secs(2)).await;
                }
            }
        };
        info!(node = %self.settings.name, "node registered");
        owner.send_replace(Some(node_uid.clone()));
        let _ = registered.send(true);
        let api: Api<Node> = Api::all(self.client.clone());
        let mut posted: Vec<(&'static str, Posted)> = Vec::new();
        let mut last_content: Option<Value> = None;
        let mut last_post = SystemTime::UNIX_EPOCH;
        let mut tick = tokio::time::interval(self.settings.lease_renew_interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // Instances starting and stopping change what is free: look again soon after.
        let mut changes = self.provider.events();
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                Some(_) = changes.next() => {
                    tokio::time::sleep(CHANGE_SETTLE).await;
                    while let Some(Some(_)) = changes.next().now_or_never() {}
                }
            }
            let now = SystemTime::now();
            let ([(status, reason, message), backend], cap) = self.observe().await;
            if let (Some(slices), Some(cap)) = (&self.slices, &cap)
                && let Err(e) = slices.sync(&cap.hosts, &node_uid).await
            {
                warn!(error = %e, "publishing the node's ResourceSlices failed; trying again at the next look");
            }
            let meta = self.topology(cap.as_ref());
            if cap.is_some() && meta != last_meta {
                match self.register(cap.as_ref()).await {
                    Ok(_) => {
                        info!(
                            slices = meta.1.get("vkd.io/slices").map_or("", String::as_str),
                            "node capacity metadata updated"
                        );
                        last_meta = meta;
                    }
                    Err(e) => warn!(error = %e, "updating the node's capacity labels failed"),
                }
            }
            let wanted: [(&'static str, &'static str, String, String); 5] = [
                ("Ready", status, reason, message),
                (BACKEND_UNREACHABLE, backend.0, backend.1, backend.2),
                (
                    "MemoryPressure",
                    "False",
                    "KubeletHasSufficientMemory".into(),
                    "the provider manages memory".into(),
                ),
                (
                    "DiskPressure",
                    "False",
                    "KubeletHasNoDiskPressure".into(),
                    "the provider manages disk".into(),
                ),
                (
                    "PIDPressure",
                    "False",
                    "KubeletHasSufficientPID".into(),
                    "the provider manages processes".into(),
                ),
            ];
            let next: Vec<(&'static str, Posted)> = wanted
                .into_iter()
                .map(|(t, status, reason, message)| {
                    let since = posted
                        .iter()
                        .find(|(pt, p)| *pt == t && p.status == status)
                        .map_or(now, |(_, p)| p.since);
                    (
                        t,
                        Posted {
                            status,
                            reason,
                            message,
                            since,
                        },
                    )
                })
                .collect();
            let content = self.status_body(&next, cap.as_ref(), SystemTime::UNIX_EPOCH);
            let due = now.duration_since(last_post).unwrap_or_default()
                >= self.settings.status_report_interval;
            if last_content.as_ref() == Some(&content) && !due {
                continue;
            }
            let body = self.status_body(&next, cap.as_ref(), now);
            match api
                .patch_status(
                    &self.settings.name,
                    &PatchParams::apply(FIELD_MANAGER).force(),
                    &Patch::Apply(body),
                )
                .await
            {
                Ok(_) => {
                    if posted.first().map(|(_, p)| p.status) != Some(status) {
                        info!(ready = status, reason = %next[0].1.reason, "node status posted");
                    }
                    posted = next;
                    last_content = Some(content);
                    last_post = now;
                }
                Err(e) => warn!(error = %e, "posting node status failed"),
            }
        }
    }
}

/// The architecture as Go (and so Kubernetes) names it.
const ARCH: &str = match std::env::consts::ARCH.as_bytes() {
    b"x86_64" => "amd64",
    b"aarch64" => "arm64",
    _ => std::env::consts::ARCH,
};

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU64, Ordering};

    use serde_json::json;

    use super::*;
    use crate::testing::{FakeProvider, Log, Seen, fake_api, status};

    const RENEW: Duration = Duration::from_millis(50);

    fn settings() -> Settings {
        Settings {
            name: "vk".into(),
            address: "10.0.0.1".into(),
            kubelet_port: 10250,
            resource_metrics_path: None,
            labels: BTreeMap::new(),
            taints: Vec::new(),
            max_pods: None,
            lease_renew_interval: RENEW,
            lease_duration: Duration::from_secs(40),
            status_report_interval: Duration::from_secs(300),
            policy: String::new(),
            host: None,
            dra: None,
        }
    }

    /// The API server's side: the Node, its status and its Lease.
    fn answer(req: &Seen) -> (u16, serde_json::Value) {
        match (req.method.as_str(), req.path.as_str()) {
            ("PATCH", "/api/v1/nodes/vk" | "/api/v1/nodes/vk/status") => (
                200,
                json!({"apiVersion": "v1", "kind": "Node",
                       "metadata": {"name": "vk", "uid": "node-uid"}}),
            ),
            ("PATCH", "/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/vk") => (
                200,
                json!({"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                       "metadata": {"name": "vk", "resourceVersion": "1"}}),
            ),
            _ => status(404, "NotFound"),
        }
    }

    fn lease_writes(log: &Log) -> Vec<serde_json::Value> {
        log.lock()
            .unwrap()
            .iter()
            .filter(|s| s.path.ends_with("/leases/vk"))
            .map(|s| s.body.clone())
            .collect()
    }

    fn age_ms(renewed: &AtomicU64) -> u64 {
        let now = u64::try_from(
            SystemTime::now()
                .duration_since(SystemTime::UNIX_EPOCH)
                .unwrap()
                .as_millis(),
        )
        .unwrap();
        now.saturating_sub(renewed.load(Ordering::Acquire))
    }

    /// Runs the agent for a while against a provider whose `capacity()` answers
    /// `answers` times and then hangs: the lease writes seen, how long ago the
    /// last renewal was, and whether the agent then stopped on shutdown.
    async fn run_with_hanging_capacity(answers: usize) -> (Vec<serde_json::Value>, u64, bool) {
        let (client, log) = fake_api(answer);
        let provider = FakeProvider::new(answers);
        let renewed = Arc::new(AtomicU64::new(0));
        let agent = NodeAgent::new(settings(), client, provider.clone(), Arc::clone(&renewed));
        let shutdown = CancellationToken::new();
        let (tx, _rx) = watch::channel(false);
        let task = tokio::spawn(agent.run(shutdown.clone(), tx));
        tokio::time::sleep(RENEW * 8).await;
        assert!(
            provider.calls(Some("capacity")) > answers,
            "capacity() was asked again and hangs"
        );
        let leases = lease_writes(&log);
        let age = age_ms(&renewed);
        shutdown.cancel();
        // A provider call that never returns does not hold up the shutdown either.
        let stopped = tokio::time::timeout(Duration::from_secs(2), task).await;
        (leases, age, stopped.is_ok())
    }

    // Paused time: the intervals pass as soon as every task waits, so the
    // counts do not depend on how busy the machine is.
    #[tokio::test(start_paused = true)]
    async fn the_lease_is_renewed_while_capacity_hangs_at_start() {
        let (leases, age, stopped) = run_with_hanging_capacity(0).await;
        assert!(leases.len() >= 4, "lease renewed {} times", leases.len());
        // What the partition watch reads stays fresh, so no Pod is fenced.
        assert!(
            age < 10 * RENEW.as_millis() as u64,
            "last renewal {age} ms ago"
        );
        assert!(stopped, "the agent stopped on shutdown");
    }

    // Paused time: the intervals pass as soon as every task waits, so the
    // counts do not depend on how busy the machine is.
    #[tokio::test(start_paused = true)]
    async fn the_lease_is_renewed_while_capacity_hangs_later() {
        let (leases, age, stopped) = run_with_hanging_capacity(2).await;
        assert!(leases.len() >= 4, "lease renewed {} times", leases.len());
        assert!(
            age < 10 * RENEW.as_millis() as u64,
            "last renewal {age} ms ago"
        );
        assert!(stopped, "the agent stopped on shutdown");
        // Once the Node exists, the lease names it as its owner.
        let last = leases.last().unwrap();
        assert_eq!(last["metadata"]["ownerReferences"][0]["uid"], "node-uid");
    }

    /// The conditions of the last status the agent posted, by type.
    fn posted_conditions(log: &Log) -> BTreeMap<String, serde_json::Value> {
        let log = log.lock().unwrap();
        let last = log
            .iter()
            .rev()
            .find(|s| s.path.ends_with("/nodes/vk/status"))
            .expect("a status was posted");
        last.body["status"]["conditions"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| (c["type"].as_str().unwrap().to_owned(), c.clone()))
            .collect()
    }

    // An unreachable backend keeps the Node Ready (its instances run on) and
    // says so in its own condition, until the backend says its grace is over.
    #[tokio::test(start_paused = true)]
    async fn an_unreachable_backend_is_a_condition_of_its_own_and_ready_until_its_grace() {
        let (client, log) = fake_api(answer);
        let provider = FakeProvider::new(usize::MAX);
        let agent = NodeAgent::new(
            settings(),
            client,
            provider.clone(),
            Arc::new(AtomicU64::new(0)),
        );
        let shutdown = CancellationToken::new();
        let (tx, _rx) = watch::channel(false);
        let task = tokio::spawn(agent.run(shutdown.clone(), tx));
        tokio::time::sleep(RENEW * 3).await;
        let c = posted_conditions(&log);
        assert_eq!(c["Ready"]["status"], "True");
        assert_eq!(c[BACKEND_UNREACHABLE]["status"], "False");
        provider.set_health(Health::Unreachable {
            reason: "DownstreamUnreachable".into(),
            message: "no answer".into(),
            past_grace: false,
        });
        tokio::time::sleep(RENEW * 3).await;
        let c = posted_conditions(&log);
        assert_eq!(c["Ready"]["status"], "True", "{c:?}");
        assert_eq!(c[BACKEND_UNREACHABLE]["status"], "True");
        assert_eq!(c[BACKEND_UNREACHABLE]["reason"], "DownstreamUnreachable");
        assert_eq!(c[BACKEND_UNREACHABLE]["message"], "no answer");
        provider.set_health(Health::Unreachable {
            reason: "DownstreamUnreachable".into(),
            message: "no answer".into(),
            past_grace: true,
        });
        tokio::time::sleep(RENEW * 3).await;
        let c = posted_conditions(&log);
        assert_eq!(c["Ready"]["status"], "False", "{c:?}");
        assert_eq!(c["Ready"]["reason"], "DownstreamUnreachable");
        assert_eq!(c[BACKEND_UNREACHABLE]["status"], "True");
        shutdown.cancel();
        let _ = task.await;
    }
}
