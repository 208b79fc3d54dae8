//! `vkd explain`'s DRA part (docs/dra.md): a Pod's claims with their devices
//! and binding conditions, and a Node's pools with what is allocated of them.
//! Read from the API server with the user's own credentials; what the user
//! may not read is said, not guessed.

use std::collections::BTreeMap;
use std::fmt::Write;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{ResourceClaim, ResourceSlice};
use kube::api::ListParams;
use kube::{Api, Client};
use serde::Serialize;

use crate::dra::devices;

/// A condition on an allocated device: vkd's binding conditions, `Ready`.
#[derive(Clone, Debug, Serialize)]
pub struct DeviceCondition {
    #[serde(rename = "type")]
    pub type_: String,
    pub status: String,
    pub reason: String,
    pub message: String,
    /// When it last changed.
    pub since: String,
}

#[derive(Clone, Debug, Serialize)]
pub struct ClaimDevice {
    pub request: String,
    pub driver: String,
    pub pool: String,
    pub device: String,
    /// The binding conditions the scheduler waits for on it.
    pub binding_conditions: Vec<String>,
    pub conditions: Vec<DeviceCondition>,
    /// The device status vkd wrote (`host`, `uuid`, `instance`).
    pub data: Option<String>,
}

/// One of a Pod's claims.
#[derive(Clone, Debug, Serialize)]
pub struct ClaimView {
    /// The Pod's name for it, and the claim's own.
    pub pod_claim: String,
    pub claim: Option<String>,
    /// `allocated`, `not allocated`, `not created yet` or why it is unreadable.
    pub state: String,
    /// The Pods it is reserved for.
    pub reserved_for: Vec<String>,
    pub devices: Vec<ClaimDevice>,
}

/// A Pod's claims, as the API server holds them now.
pub async fn pod_claims(client: &Client, pod: &Pod) -> Vec<ClaimView> {
    let ns = pod.metadata.namespace.clone().unwrap_or_default();
    let api: Api<ResourceClaim> = Api::namespaced(client.clone(), &ns);
    let mut out = Vec::new();
    for r in devices::claim_refs(pod) {
        let mut view = ClaimView {
            pod_claim: r.entry.clone(),
            claim: r.claim.clone(),
            state: "not created yet (the Pod's status names no claim for it)".into(),
            reserved_for: Vec::new(),
            devices: Vec::new(),
        };
        if let Some(name) = &r.claim {
            match api.get_opt(name).await {
                Ok(Some(c)) => fill(&mut view, &c),
                Ok(None) => view.state = "deleted".into(),
                Err(e) => view.state = format!("unreadable: {e}"),
            }
        }
        out.push(view);
    }
    out
}

fn fill(view: &mut ClaimView, c: &ResourceClaim) {
    let status = c.status.clone().unwrap_or_default();
    view.reserved_for = devices::reserved_pods(c)
        .into_iter()
        .map(|(name, _)| name)
        .collect();
    if status.allocation.is_none() {
        view.state =
            "not allocated: the scheduler has not placed it (the Pod never runs before it is)"
                .into();
        return;
    }
    view.state = "allocated".into();
    let per_device = status.devices.unwrap_or_default();
    for r in devices::allocated(c) {
        let st = per_device
            .iter()
            .find(|d| d.driver == r.driver && d.pool == r.pool && d.device == r.device);
        view.devices.push(ClaimDevice {
            request: r.request.clone(),
            driver: r.driver.clone(),
            pool: r.pool.clone(),
            device: r.device.clone(),
            binding_conditions: r.binding_conditions.clone().unwrap_or_default(),
            conditions: st
                .and_then(|d| d.conditions.clone())
                .unwrap_or_default()
                .into_iter()
                .map(|c| DeviceCondition {
                    type_: c.type_,
                    status: c.status,
                    reason: c.reason,
                    message: c.message,
                    since: c.last_transition_time.0.to_string(),
                })
                .collect(),
            data: st.and_then(|d| d.data.as_ref()).map(|d| d.0.to_string()),
        });
    }
}

/// One pool on a Node, and what of it is allocated.
#[derive(Clone, Debug, Serialize)]
pub struct PoolView {
    pub driver: String,
    pub pool: String,
    pub generation: i64,
    pub slices: usize,
    /// Devices at the current generation.
    pub devices: usize,
    /// Counter sets (partitionable GPUs).
    pub counter_sets: usize,
    /// `device -> namespace/claim (reserved for ...)`, by device.
    pub allocated: BTreeMap<String, String>,
}

/// The Node's pools (its ResourceSlices), and each allocated device with its
/// claim; what could not be read; the sources read.
pub async fn node_pools(
    client: &Client,
    node: &str,
) -> (Vec<PoolView>, Option<String>, Vec<String>) {
    let mut sources = Vec::new();
    let slices: Api<ResourceSlice> = Api::all(client.clone());
    let list = match slices
        .list(&ListParams::default().fields(&format!("spec.nodeName={node}")))
        .await
    {
        Ok(l) => l.items,
        Err(e) => return (Vec::new(), Some(format!("ResourceSlices: {e}")), sources),
    };
    sources.push(format!(
        "kubectl get resourceslices --field-selector spec.nodeName={node}"
    ));
    let mut pools: BTreeMap<(String, String), PoolView> = BTreeMap::new();
    for s in &list {
        let key = (s.spec.driver.clone(), s.spec.pool.name.clone());
        let p = pools.entry(key).or_insert_with(|| PoolView {
            driver: s.spec.driver.clone(),
            pool: s.spec.pool.name.clone(),
            generation: s.spec.pool.generation,
            slices: 0,
            devices: 0,
            counter_sets: 0,
            allocated: BTreeMap::new(),
        });
        if s.spec.pool.generation > p.generation {
            (p.generation, p.slices, p.devices, p.counter_sets) = (s.spec.pool.generation, 0, 0, 0);
        }
        if s.spec.pool.generation == p.generation {
            p.slices += 1;
            p.devices += s.spec.devices.as_ref().map_or(0, Vec::len);
            p.counter_sets += s.spec.shared_counters.as_ref().map_or(0, Vec::len);
        }
    }
    if pools.is_empty() {
        return (Vec::new(), None, sources);
    }
    let claims: Api<ResourceClaim> = Api::all(client.clone());
    let error = match claims.list(&ListParams::default()).await {
        Ok(list) => {
            sources.push("kubectl get resourceclaims -A".into());
            for c in &list.items {
                let name = format!(
                    "{}/{}",
                    c.metadata.namespace.as_deref().unwrap_or_default(),
                    c.metadata.name.as_deref().unwrap_or_default()
                );
                let pods: Vec<String> = devices::reserved_pods(c)
                    .into_iter()
                    .map(|(p, _)| p)
                    .collect();
                for r in devices::allocated(c) {
                    if let Some(p) = pools.get_mut(&(r.driver.clone(), r.pool.clone())) {
                        let holder = if pods.is_empty() {
                            name.clone()
                        } else {
                            format!("{name} (reserved for {})", pods.join(", "))
                        };
                        p.allocated.insert(r.device, holder);
                    }
                }
            }
            None
        }
        Err(e) => Some(format!(
            "what is allocated: listing ResourceClaims in all namespaces: {e}"
        )),
    };
    (pools.into_values().collect(), error, sources)
}

/// The claims section of `vkd explain pod`.
pub fn render_claims(out: &mut String, claims: &[ClaimView]) {
    if claims.is_empty() {
        return;
    }
    let _ = writeln!(out, "\nResource claims (DRA):");
    for c in claims {
        let _ = writeln!(
            out,
            "  {}{}: {}",
            c.pod_claim,
            c.claim
                .as_ref()
                .filter(|n| **n != c.pod_claim)
                .map(|n| format!(" (claim {n})"))
                .unwrap_or_default(),
            c.state
        );
        if !c.reserved_for.is_empty() {
            let _ = writeln!(out, "    reserved for {}", c.reserved_for.join(", "));
        }
        for d in &c.devices {
            let _ = writeln!(
                out,
                "    {} -> {}/{} ({}){}",
                d.request,
                d.pool,
                d.device,
                d.driver,
                if d.binding_conditions.is_empty() {
                    String::new()
                } else {
                    format!(", binding conditions {}", d.binding_conditions.join(", "))
                }
            );
            for k in &d.conditions {
                let _ = writeln!(
                    out,
                    "      {}={} since {}: {}{}",
                    k.type_,
                    k.status,
                    k.since,
                    k.reason,
                    if k.message.is_empty() {
                        String::new()
                    } else {
                        format!(" ({})", k.message)
                    }
                );
            }
            if let Some(data) = &d.data {
                let _ = writeln!(out, "      device status: {data}");
            }
        }
    }
}

/// The pools section of `vkd explain node`.
pub fn render_pools(out: &mut String, pools: &[PoolView], error: Option<&str>) {
    if pools.is_empty() && error.is_none() {
        return;
    }
    let _ = writeln!(out, "\nDRA pools (ResourceSlices of this Node):");
    for p in pools {
        let _ = writeln!(
            out,
            "  {} ({}) generation {}: {} devices in {} slices{}, {} allocated",
            p.pool,
            p.driver,
            p.generation,
            p.devices,
            p.slices,
            if p.counter_sets == 0 {
                String::new()
            } else {
                format!(", {} counter sets (partitionable GPUs)", p.counter_sets)
            },
            p.allocated.len()
        );
        for (device, holder) in &p.allocated {
            let _ = writeln!(out, "    {device}: {holder}");
        }
    }
    if let Some(e) = error {
        let _ = writeln!(out, "  cannot say: {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_claim_is_told_with_its_devices_conditions_and_status() {
        let claim: ResourceClaim = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "train-gpus-x1", "namespace": "ns"},
            "spec": {},
            "status": {
                "reservedFor": [{"resource": "pods", "name": "train", "uid": "u1"}],
                "allocation": {"devices": {"results": [{
                    "request": "gpus", "driver": "gpu.vkd.io", "pool": "vk-host-a",
                    "device": "host-a-gpu1", "bindingConditions": ["vkd.io/BackendReserved"],
                }]}},
                "devices": [{
                    "driver": "gpu.vkd.io", "pool": "vk-host-a", "device": "host-a-gpu1",
                    "conditions": [{
                        "type": "vkd.io/BackendReserved", "status": "False",
                        "reason": "BackendQueued", "message": "waiting for 8 cpu",
                        "lastTransitionTime": "2026-12-06T10:00:00Z",
                    }],
                    "data": {"host": "host-a"},
                }],
            },
        }))
        .unwrap();
        let mut view = ClaimView {
            pod_claim: "gpus".into(),
            claim: Some("train-gpus-x1".into()),
            state: String::new(),
            reserved_for: Vec::new(),
            devices: Vec::new(),
        };
        fill(&mut view, &claim);
        let mut out = String::new();
        render_claims(&mut out, &[view]);
        for line in [
            "gpus (claim train-gpus-x1): allocated",
            "reserved for train",
            "gpus -> vk-host-a/host-a-gpu1 (gpu.vkd.io), binding conditions vkd.io/BackendReserved",
            "vkd.io/BackendReserved=False since 2026-12-06T10:00:00Z: BackendQueued (waiting for 8 cpu)",
            r#"device status: {"host":"host-a"}"#,
        ] {
            assert!(out.contains(line), "{line:?} not in\n{out}");
        }
        let mut unallocated = ClaimView {
            pod_claim: "gpus".into(),
            claim: Some("c".into()),
            state: String::new(),
            reserved_for: Vec::new(),
            devices: Vec::new(),
        };
        fill(&mut unallocated, &ResourceClaim::default());
        assert!(unallocated.state.starts_with("not allocated"));
    }

    #[test]
    fn a_pool_says_what_is_allocated_and_what_could_not_be_read() {
        let pool = PoolView {
            driver: "gpu.vkd.io".into(),
            pool: "vk-host-a".into(),
            generation: 3,
            slices: 2,
            devices: 12,
            counter_sets: 4,
            allocated: BTreeMap::from([("host-a-gpu0".into(), "ns/c (reserved for p)".into())]),
        };
        let mut out = String::new();
        render_pools(&mut out, &[pool], Some("listing ResourceClaims: forbidden"));
        assert!(out.contains("vk-host-a (gpu.vkd.io) generation 3: 12 devices in 2 slices, 4 counter sets (partitionable GPUs), 1 allocated"), "{out}");
        assert!(
            out.contains("    host-a-gpu0: ns/c (reserved for p)"),
            "{out}"
        );
        assert!(
            out.contains("cannot say: listing ResourceClaims: forbidden"),
            "{out}"
        );
    }
}
