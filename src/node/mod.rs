//! The node agent: registers the virtual Node, renews its Lease every 10 s, and
//! posts its status when it changes and at least every 5 minutes, as the kubelet
//! does. When the provider is unhealthy the Node says Ready=False with a reason
//! rather than going silent.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use futures::{FutureExt, StreamExt};
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Node;
use kube::api::{Patch, PatchParams};
use kube::{Api, Client};
use serde_json::{Value, json};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};
use vkd_provider::{Capacity, Health, Provider};

use crate::config::Taint;
use crate::pods::status::time;

const FIELD_MANAGER: &str = "vkd";
/// After a provider change, wait this long for more before looking at capacity.
const CHANGE_SETTLE: Duration = Duration::from_millis(500);
/// A renewal this close to due is done now rather than a tick late.
const RENEW_SLACK: Duration = Duration::from_millis(500);

#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    #[error("registering node {node}: {source}")]
    Register {
        node: String,
        #[source]
        source: kube::Error,
    },
}

#[derive(Clone, Debug)]
pub struct Settings {
    pub name: String,
    pub address: String,
    pub kubelet_port: u16,
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
}

pub struct NodeAgent {
    settings: Settings,
    client: Client,
    provider: Arc<dyn Provider>,
    /// Unix milliseconds of the last successful lease renewal, for the partition policy.
    last_renewal: Arc<std::sync::atomic::AtomicU64>,
}

impl std::fmt::Debug for NodeAgent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeAgent")
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

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
        Self {
            settings,
            client,
            provider,
            last_renewal,
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

    async fn renew_lease(&self, node_uid: &str) -> Result<(), kube::Error> {
        let api: Api<Lease> = Api::namespaced(self.client.clone(), "kube-node-lease");
        let lease = json!({
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": {
                "name": self.settings.name,
                "ownerReferences": [{
                    "apiVersion": "v1", "kind": "Node",
                    "name": self.settings.name, "uid": node_uid,
                }],
            },
            "spec": {
                "holderIdentity": self.settings.name,
                "leaseDurationSeconds": self.settings.lease_duration.as_secs(),
                "renewTime": jiff::Timestamp::now().strftime("%Y-%m-%dT%H:%M:%S%.6fZ").to_string(),
            },
        });
        api.patch(
            &self.settings.name,
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(lease),
        )
        .await
        .map(drop)
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

    /// The Ready condition and the capacity, from the provider.
    async fn observe(&self) -> ((&'static str, String, String), Option<Capacity>) {
        let name = self.provider.name().to_owned();
        match self.provider.health().await {
            Health::Unhealthy { reason, message } => (
                (
                    "False",
                    reason,
                    format!("provider {name} is unhealthy: {message}"),
                ),
                self.capacity().await.ok(),
            ),
            Health::Healthy => match self.capacity().await {
                Ok(c) => (
                    (
                        "True",
                        "KubeletReady".into(),
                        format!("vkd is posting ready status; provider {name} is healthy"),
                    ),
                    Some(c),
                ),
                Err(e) => (
                    (
                        "False",
                        "ProviderCapacityUnavailable".into(),
                        format!("provider {name} did not report capacity: {e}"),
                    ),
                    None,
                ),
            },
        }
    }

    fn resources(&self, cap: Option<&Capacity>) -> Value {
        let (mut cpu, mut mem, mut gpus, mut pods) = (0u64, 0u64, 0usize, 0u64);
        for h in cap.map(|c| c.hosts.as_slice()).unwrap_or_default() {
            cpu += h.cpu_millis_total;
            mem += h.memory_bytes_total;
            gpus += h.gpus.len();
            pods += u64::from(h.max_pods);
        }
        if let Some(max) = self.settings.max_pods {
            pods = u64::from(max);
        }
        json!({
            "cpu": vkd_provider::quantity::format_cpu(cpu),
            "memory": mem.to_string(),
            "pods": pods.to_string(),
            "nvidia.com/gpu": gpus.to_string(),
        })
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
        let initial = self.capacity().await.ok();
        let mut last_meta = self.topology(initial.as_ref());
        let node_uid = loop {
            match self.register(initial.as_ref()).await {
                Ok(uid) => break uid,
                Err(e) => {
                    warn!(error = %e, "node registration failed; retrying in 2s");
                    tokio::select! {
                        _ = shutdown.cancelled() => return Err(e),
                        _ = tokio::time::sleep(Duration::from_secs(2)) => {}
                    }
                }
            }
        };
        info!(node = %self.settings.name, "node registered");
        let _ = registered.send(true);
        let api: Api<Node> = Api::all(self.client.clone());
        let mut posted: Vec<(&'static str, Posted)> = Vec::new();
        let mut last_content: Option<Value> = None;
        let mut last_post = SystemTime::UNIX_EPOCH;
        let mut tick = tokio::time::interval(self.settings.lease_renew_interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // Instances starting and stopping change what is free: look again soon after.
        let mut changes = self.provider.events();
        let mut last_renew: Option<tokio::time::Instant> = None;
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return Ok(()),
                _ = tick.tick() => {}
                Some(_) = changes.next() => {
                    tokio::time::sleep(CHANGE_SETTLE).await;
                    while let Some(Some(_)) = changes.next().now_or_never() {}
                }
            }
            let renew_due = last_renew
                .is_none_or(|t| t.elapsed() + RENEW_SLACK >= self.settings.lease_renew_interval);
            if renew_due {
                match self.renew_lease(&node_uid).await {
                    Ok(()) => {
                        last_renew = Some(tokio::time::Instant::now());
                        let ms = SystemTime::now()
                            .duration_since(SystemTime::UNIX_EPOCH)
                            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
                        self.last_renewal
                            .store(ms, std::sync::atomic::Ordering::Release);
                    }
                    Err(e) => warn!(error = %e, "renewing the node lease failed"),
                }
            }
            let now = SystemTime::now();
            let ((status, reason, message), cap) = self.observe().await;
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
            let wanted: [(&'static str, &'static str, String, String); 4] = [
                ("Ready", status, reason, message),
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
