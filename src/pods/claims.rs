//! The kubelet's side of DRA: before a Pod's instance is created, its
//! ResourceClaims are read and their allocation becomes the placement the
//! provider gets (one host, exactly the allocated GPUs); once the instance
//! exists, each device's status on the claim says where it runs.
//!
//! As the kubelet: a claim that is missing, not made from its template yet,
//! not reserved for this Pod or not allocated holds the Pod in
//! ContainerCreating with a `FailedPrepareDynamicResources` Event, and is
//! read again. An allocation vkd cannot run (devices of another node, another
//! driver, two hosts, a device the backend no longer has) fails the Pod,
//! naming the claim: waiting would never help.

use k8s_openapi::api::core::v1::NodeSelector;
use k8s_openapi::api::resource::v1::{DeviceRequestAllocationResult, ResourceClaim};
use kube::Api;
use kube::api::{Patch, PatchParams};
use serde_json::json;
use vkd_provider::{Instance, Placement};

use super::admission::{NodeView, matches_term};
use super::*;
use crate::dra::devices::{self, Layout};

/// The reason a Pod fails with when its claims' allocation cannot run here.
pub(super) const UNUSABLE: &str = "UnusableResourceClaim";

/// What the claims say before the create.
pub(super) enum Prepared {
    /// No claim with devices of this node: the Pod is placed as any other.
    Nothing,
    /// Exactly these GPUs of this host; `claims` for the device status.
    Placed {
        placement: Placement,
        claims: Vec<(ResourceClaim, Vec<DeviceRequestAllocationResult>)>,
    },
    /// Not yet: the message says what is awaited.
    Wait(String),
    /// Never here: the message names the claim.
    Unusable(String),
}

fn selects(selector: Option<&NodeSelector>, node: &NodeView) -> bool {
    selector.is_none_or(|s| s.node_selector_terms.iter().any(|t| matches_term(t, node)))
}

impl Cx<'_> {
    /// Reads the Pod's claims and what they allocate.
    pub(super) async fn prepare_claims(
        &self,
        pending: &spec::Pending,
    ) -> Result<Prepared, ReconcileError> {
        if pending.claims.is_empty() {
            return Ok(Prepared::Nothing);
        }
        let pod = &pending.spec.pod;
        let Some(dra) = &self.settings.dra else {
            return Ok(Prepared::Wait(format!(
                "node {} does not serve DRA devices (vkd runs without --dra), so it cannot prepare ResourceClaim {}",
                self.settings.node,
                pending.claims[0]
                    .claim
                    .as_deref()
                    .unwrap_or(&pending.claims[0].entry)
            )));
        };
        let node = self
            .node_view
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .unwrap_or_else(|| {
                Arc::new(NodeView {
                    name: self.settings.node.clone(),
                    labels: Default::default(),
                    no_execute: Vec::new(),
                    pods: None,
                })
            });
        let api: Api<ResourceClaim> = Api::namespaced(self.client.clone(), &pod.namespace);
        let mut claims = Vec::new();
        let mut results = Vec::new();
        for r in &pending.claims {
            let Some(name) = &r.claim else {
                return Ok(Prepared::Wait(format!(
                    "pod {}/{} has no claim made for its entry {:?} yet",
                    pod.namespace, pod.name, r.entry
                )));
            };
            let claim = match api.get_opt(name).await {
                Ok(Some(c)) => c,
                Ok(None) => {
                    return Ok(Prepared::Wait(format!(
                        "fetch ResourceClaim {name}: not found"
                    )));
                }
                Err(e) => return Err(e.into()),
            };
            let claim_uid = claim.metadata.uid.clone().unwrap_or_default();
            if r.generated
                && !claim
                    .metadata
                    .owner_references
                    .iter()
                    .flatten()
                    .any(|o| o.controller == Some(true) && o.uid == pod.uid)
            {
                return Ok(Prepared::Wait(format!(
                    "ResourceClaim {name} was not created for pod {}/{} (pod is not owner)",
                    pod.namespace, pod.name
                )));
            }
            let status = claim.status.as_ref();
            let reserved = status
                .and_then(|s| s.reserved_for.as_ref())
                .is_some_and(|r| r.iter().any(|c| c.uid == pod.uid));
            if !reserved {
                return Ok(Prepared::Wait(format!(
                    "pod {} ({}) is not allowed to use ResourceClaim {name} ({claim_uid})",
                    pod.name, pod.uid
                )));
            }
            let Some(allocation) = status.and_then(|s| s.allocation.as_ref()) else {
                return Ok(Prepared::Wait(format!(
                    "ResourceClaim {name} is not allocated"
                )));
            };
            if !selects(allocation.node_selector.as_ref(), &node) {
                return Ok(Prepared::Unusable(format!(
                    "ResourceClaim {name} is allocated to devices another node reaches, not node {}",
                    self.settings.node
                )));
            }
            let mine: Vec<DeviceRequestAllocationResult> = allocation
                .devices
                .as_ref()
                .and_then(|d| d.results.clone())
                .unwrap_or_default();
            results.extend(mine.iter().map(|d| (name.clone(), d.clone())));
            claims.push((claim, mine));
        }
        let hosts = self.admitter.hosts().await?;
        let layout = Layout {
            node: &self.settings.node,
            per_host: self.settings.host.is_some(),
            driver: &dra.driver,
        };
        Ok(match devices::placement(&layout, &hosts, &results) {
            Ok(Some(placement)) => Prepared::Placed { placement, claims },
            Ok(None) => Prepared::Nothing,
            Err(e) => Prepared::Unusable(e.0),
        })
    }

    /// Says on each claim where its devices run: the host, the GPU and the
    /// instance, with a `Ready` condition. A failed write is logged: the
    /// instance runs either way.
    pub(super) async fn write_device_status(
        &self,
        claims: &[(ResourceClaim, Vec<DeviceRequestAllocationResult>)],
        placement: &Placement,
        instance: &Instance,
    ) {
        let Some(dra) = &self.settings.dra else {
            return;
        };
        let layout = Layout {
            node: &self.settings.node,
            per_host: self.settings.host.is_some(),
            driver: &dra.driver,
        };
        let hosts = self.admitter.hosts().await.unwrap_or_default();
        let names: std::collections::BTreeMap<String, String> = hosts
            .iter()
            .find(|h| h.name == placement.host)
            .map(|h| {
                devices::host_devices(h)
                    .into_iter()
                    .map(|d| (d.name, d.id.to_owned()))
                    .collect()
            })
            .unwrap_or_default();
        let now = crate::pods::status::time(SystemTime::now());
        for (claim, results) in claims {
            let (Some(name), Some(ns)) = (&claim.metadata.name, &claim.metadata.namespace) else {
                continue;
            };
            let devices: Vec<serde_json::Value> = results
                .iter()
                .filter(|r| r.driver == dra.driver && r.pool == layout.pool(&placement.host))
                .map(|r| {
                    json!({
                        "driver": r.driver, "pool": r.pool, "device": r.device,
                        "data": {
                            "host": placement.host,
                            "uuid": names.get(&r.device).cloned().unwrap_or_default(),
                            "instance": instance.id,
                        },
                        "conditions": [{
                            "type": "Ready", "status": "True", "reason": "InstanceCreated",
                            "message": format!("instance {} runs on host {} with this device", instance.id, placement.host),
                            "lastTransitionTime": now,
                        }],
                    })
                })
                .collect();
            if devices.is_empty() {
                continue;
            }
            let body = devices::device_status(name, ns, devices);
            self.throttle("claim_status").await;
            let api: Api<ResourceClaim> = Api::namespaced(self.client.clone(), ns);
            if let Err(e) = api
                .patch_status(
                    name,
                    &PatchParams::apply("vkd").force(),
                    &Patch::Apply(body),
                )
                .await
            {
                warn!(claim = %name, error = %e, "writing the ResourceClaim's device status failed");
            }
        }
    }

    /// Holds the Pod in ContainerCreating while its claims are not ready,
    /// with the kubelet's Event.
    pub(super) async fn claims_not_ready(
        &self,
        rec: &PodRecord,
        message: &str,
    ) -> Result<(), ReconcileError> {
        warn!(message, "the Pod's ResourceClaims are not ready");
        self.write_status(rec, None, &Waiting::Creating).await?;
        self.events.event(
            rec,
            EventType::Warning,
            "FailedPrepareDynamicResources",
            &format!("Failed to prepare dynamic resources: {message}"),
            "Create",
        );
        Ok(())
    }
}
