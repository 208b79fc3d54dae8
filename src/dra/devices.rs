//! Host slices as DRA devices, and an allocation back as a placement: the pure
//! mapping both of vkd's DRA sides use (the publisher writes what
//! [`slices`] returns; the create step reads an allocation with
//! [`placement`]). No I/O.
//!
//! - One pool per host, named after the Node that stands for it: in per-host
//!   mode the Node itself (as NVIDIA's driver names its pools), in aggregate
//!   mode `<node>-<host>`. Every slice carries `nodeName` = that Node.
//! - One device per GPU, named after its id when the id is a DNS label (the
//!   sim's `host-a-gpu0`), else `gpu-<index>`. A GPU with MIG-style
//!   partitions is a partitionable device: a counter set per GPU (compute
//!   slices and memory) that the whole GPU and each partition (`type: mig`,
//!   `profile`, `parentUUID`) consume, so the scheduler never allocates a
//!   partition beside its whole GPU, nor partitions past the GPU.
//! - Attributes a GPU Pod selects on: `type`, `uuid`, `productName`,
//!   `architecture`/`cudaComputeCapability` for models vkd knows, `memory` as
//!   capacity, and vkd's own `gpu.vkd.io/host` and `gpu.vkd.io/nvlinkDomain`
//!   (host-qualified, so a domain name a backend reuses on every host never
//!   joins two hosts). The standard `resource.kubernetes.io/pcieRoot` and
//!   `numaNode` are published only in per-host mode, where they mean what they
//!   mean on bare metal; in aggregate mode they would repeat on every host and
//!   a `matchAttribute` on them would co-select GPUs of different hosts, so the
//!   host-qualified `gpu.vkd.io/pcieRoot` and `gpu.vkd.io/numaNode` stand in.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::{
    Counter, CounterSet, Device, DeviceAttribute, DeviceCapacity, DeviceCounterConsumption,
    DeviceRequestAllocationResult, ResourceClaim, ResourcePool, ResourceSliceSpec,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use vkd_provider::{Gpu, HostSlice, InstanceSpec, Placement, is_dns_label};

/// vkd's attribute domain (and its default driver name).
pub const VKD_DOMAIN: &str = "gpu.vkd.io";
/// The attribute a claim matches on to keep its GPUs on one host.
pub const HOST_ATTRIBUTE: &str = "gpu.vkd.io/host";
/// The attribute a claim matches on to keep its GPUs in one NVLink domain.
pub const NVLINK_ATTRIBUTE: &str = "gpu.vkd.io/nvlinkDomain";
/// The binding condition every device carries (with binding conditions on):
/// the backend holds the placement (`dra::binding`).
pub const RESERVED: &str = "vkd.io/BackendReserved";
/// The binding failure condition: the backend can never run it.
pub const REJECTED: &str = "vkd.io/BackendRejected";
/// The API's limit on devices in one ResourceSlice.
pub const MAX_DEVICES_PER_SLICE: usize = 128;
/// Its limit when the devices consume counters.
const MAX_COUNTING_DEVICES_PER_SLICE: usize = 64;
/// Its limit on counter sets in one ResourceSlice.
const MAX_COUNTER_SETS_PER_SLICE: usize = 8;
const PCIE_ROOT: &str = "resource.kubernetes.io/pcieRoot";
const NUMA_NODE: &str = "resource.kubernetes.io/numaNode";

/// Where a pool's slices go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout<'a> {
    /// The Node the slices name (`nodeName`).
    pub node: &'a str,
    /// Per-host mode: the Node stands for exactly one host.
    pub per_host: bool,
    pub driver: &'a str,
}

impl Layout<'_> {
    /// The pool of one host.
    pub fn pool(&self, host: &str) -> String {
        if self.per_host {
            self.node.to_owned()
        } else {
            format!("{}-{}", self.node, crate::topology::node_suffix(host))
        }
    }

    /// Whether `pool` is one [`Layout::pool`] names for some host of this Node.
    pub fn owns(&self, pool: &str) -> bool {
        if self.per_host {
            pool == self.node
        } else {
            pool.strip_prefix(self.node)
                .and_then(|rest| rest.strip_prefix('-'))
                .is_some_and(|suffix| !suffix.is_empty())
        }
    }
}

/// One pool as it should be published: the slices' specs, generation unset (0).
#[derive(Clone, Debug, PartialEq)]
pub struct PoolSpec {
    pub pool: String,
    pub host: String,
    pub slices: Vec<ResourceSliceSpec>,
}

impl PoolSpec {
    pub fn devices(&self) -> usize {
        self.slices
            .iter()
            .map(|s| s.devices.as_ref().map_or(0, Vec::len))
            .sum()
    }
}

/// One device of a host: a whole GPU, or a partition of one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostDevice<'a> {
    /// The device's name in its pool.
    pub name: String,
    /// The backend's id for it (a GPU's or a partition's), what a placement names.
    pub id: &'a str,
    gpu: usize,
    partition: Option<usize>,
}

/// The devices of a host, in its order (each GPU, then its partitions): named
/// after their ids when every id is a distinct DNS label (the sim's
/// `host-a-gpu0`, `host-a-gpu0-3g40gb-0`), else `gpu-<i>` and `gpu-<i>-<j>`
/// for all of them (never a mix, so a name always means one device).
pub fn host_devices(h: &HostSlice) -> Vec<HostDevice<'_>> {
    let mut devices = Vec::new();
    for (i, g) in h.gpus.iter().enumerate() {
        devices.push(HostDevice {
            name: format!("gpu-{i}"),
            id: &g.id,
            gpu: i,
            partition: None,
        });
        for (j, p) in g.partitions.iter().enumerate() {
            devices.push(HostDevice {
                name: format!("gpu-{i}-{j}"),
                id: &p.id,
                gpu: i,
                partition: Some(j),
            });
        }
    }
    let mut seen = std::collections::BTreeSet::new();
    if devices
        .iter()
        .all(|d| is_dns_label(d.id) && seen.insert(d.id))
    {
        for d in &mut devices {
            d.name = d.id.to_owned();
        }
    }
    devices
}

/// The counter set of a partitionable GPU, and what the whole GPU or one
/// partition consumes of it: compute slices and memory.
const COMPUTE_SLICES: &str = "compute-slices";
const MEMORY: &str = "memory";

fn counters(compute_slices: u32, memory_mib: u64) -> BTreeMap<String, Counter> {
    BTreeMap::from([
        (
            COMPUTE_SLICES.to_owned(),
            Counter {
                value: Quantity(compute_slices.to_string()),
            },
        ),
        (
            MEMORY.to_owned(),
            Counter {
                value: Quantity(format!("{memory_mib}Mi")),
            },
        ),
    ])
}

/// Whether the GPU is published as a partitionable device.
fn partitionable(g: &Gpu) -> bool {
    g.compute_slices > 0 && !g.partitions.is_empty()
}

fn string(v: impl Into<String>) -> DeviceAttribute {
    DeviceAttribute {
        string: Some(v.into()),
        ..Default::default()
    }
}

/// Architecture and compute capability of the models vkd knows by name; a
/// backend's model string decides (`H100-SXM5-80GB`, `NVIDIA A100-SXM4-40GB`).
fn architecture(model: &str) -> Option<(&'static str, &'static str)> {
    let m = model.to_ascii_uppercase();
    let table: [(&str, &str, &str); 9] = [
        ("GB200", "Blackwell", "10.0.0"),
        ("B200", "Blackwell", "10.0.0"),
        ("H200", "Hopper", "9.0.0"),
        ("H100", "Hopper", "9.0.0"),
        ("L40", "Ada Lovelace", "8.9.0"),
        ("L4", "Ada Lovelace", "8.9.0"),
        ("A100", "Ampere", "8.0.0"),
        ("V100", "Volta", "7.0.0"),
        ("T4", "Turing", "7.5.0"),
    ];
    table
        .iter()
        .find(|(key, _, _)| {
            m.split(|c: char| !c.is_ascii_alphanumeric())
                .any(|word| word == *key)
        })
        .map(|(_, arch, cc)| (*arch, *cc))
}

/// Device `d` of host `h`; `counter_set` names its GPU's counter set (the
/// GPU's own device name: counter sets and devices are named apart).
fn device(
    layout: &Layout<'_>,
    h: &HostSlice,
    d: &HostDevice<'_>,
    counter_set: &str,
    binding: bool,
) -> Device {
    let g = &h.gpus[d.gpu];
    let part = d.partition.map(|j| &g.partitions[j]);
    let mut attributes: BTreeMap<String, DeviceAttribute> = BTreeMap::new();
    attributes.insert(
        "type".into(),
        string(if part.is_some() { "mig" } else { "gpu" }),
    );
    attributes.insert("uuid".into(), string(d.id));
    attributes.insert("productName".into(), string(g.model.clone()));
    if let Some((arch, cc)) = architecture(&g.model) {
        attributes.insert("architecture".into(), string(arch));
        attributes.insert(
            "cudaComputeCapability".into(),
            DeviceAttribute {
                version: Some(cc.into()),
                ..Default::default()
            },
        );
    }
    attributes.insert(HOST_ATTRIBUTE.into(), string(h.name.clone()));
    match part {
        // A partition has no NVLink peer: a claim that matches on the domain
        // never gets one.
        Some(p) => {
            attributes.insert("profile".into(), string(p.profile.clone()));
            attributes.insert("parentUUID".into(), string(g.id.clone()));
        }
        None => {
            let domain = g.nvlink_domain.as_deref().unwrap_or(&g.id);
            attributes.insert(
                NVLINK_ATTRIBUTE.into(),
                string(format!("{}/{domain}", h.name)),
            );
        }
    }
    if let Some(root) = &g.pcie_root {
        if layout.per_host {
            attributes.insert(PCIE_ROOT.into(), string(root.clone()));
        }
        attributes.insert(
            format!("{VKD_DOMAIN}/pcieRoot"),
            string(format!("{}/{root}", h.name)),
        );
    }
    if let Some(numa) = g.numa_node {
        if layout.per_host {
            attributes.insert(
                NUMA_NODE.into(),
                DeviceAttribute {
                    int: Some(i64::from(numa)),
                    ..Default::default()
                },
            );
        }
        attributes.insert(
            format!("{VKD_DOMAIN}/numaNode"),
            string(format!("{}/{numa}", h.name)),
        );
    }
    let memory_mib = part.map_or(g.memory_mib, |p| p.memory_mib);
    let capacity = BTreeMap::from([(
        "memory".to_owned(),
        DeviceCapacity {
            value: Quantity(format!("{memory_mib}Mi")),
            ..Default::default()
        },
    )]);
    let consumes = partitionable(g).then(|| {
        let (c, m) = part.map_or((g.compute_slices, g.memory_mib), |p| {
            (p.compute_slices, p.memory_mib)
        });
        vec![DeviceCounterConsumption {
            counter_set: counter_set.to_owned(),
            counters: counters(c, m),
            ..Default::default()
        }]
    });
    Device {
        name: d.name.clone(),
        attributes: Some(attributes),
        capacity: Some(capacity),
        consumes_counters: consumes,
        binding_conditions: binding.then(|| vec![RESERVED.to_owned()]),
        binding_failure_conditions: binding.then(|| vec![REJECTED.to_owned()]),
        ..Default::default()
    }
}

/// The pools of `hosts` (each host that has GPUs), as `layout` places them;
/// with `binding`, each device carries vkd's binding conditions. A host with
/// partitionable GPUs also gets slices of their counter sets (the API keeps
/// counters and devices in separate slices of the pool).
pub fn pools(layout: &Layout<'_>, hosts: &[HostSlice], binding: bool) -> Vec<PoolSpec> {
    hosts
        .iter()
        .filter(|h| !h.gpus.is_empty())
        .map(|h| {
            let pool = layout.pool(&h.name);
            let listed = host_devices(h);
            // Each GPU's device name, by GPU index: its counter set's name too.
            let gpu_names: Vec<&str> = listed
                .iter()
                .filter(|d| d.partition.is_none())
                .map(|d| d.name.as_str())
                .collect();
            let devices: Vec<Device> = listed
                .iter()
                .map(|d| device(layout, h, d, gpu_names[d.gpu], binding))
                .collect();
            let counter_sets: Vec<CounterSet> = h
                .gpus
                .iter()
                .zip(&gpu_names)
                .filter(|(g, _)| partitionable(g))
                .map(|(g, name)| CounterSet {
                    name: (*name).to_owned(),
                    counters: counters(g.compute_slices, g.memory_mib),
                })
                .collect();
            let per_slice = if counter_sets.is_empty() {
                MAX_DEVICES_PER_SLICE
            } else {
                MAX_COUNTING_DEVICES_PER_SLICE
            };
            let slice = |devices, shared_counters| ResourceSliceSpec {
                driver: layout.driver.to_owned(),
                node_name: Some(layout.node.to_owned()),
                pool: ResourcePool {
                    name: pool.clone(),
                    generation: 0,
                    resource_slice_count: 0,
                },
                devices,
                shared_counters,
                ..Default::default()
            };
            let mut slices: Vec<ResourceSliceSpec> = counter_sets
                .chunks(MAX_COUNTER_SETS_PER_SLICE)
                .map(|sets| slice(None, Some(sets.to_vec())))
                .chain(
                    devices
                        .chunks(per_slice)
                        .map(|devices| slice(Some(devices.to_vec()), None)),
                )
                .collect();
            let count = i64::try_from(slices.len()).unwrap_or(i64::MAX);
            for s in &mut slices {
                s.pool.resource_slice_count = count;
            }
            PoolSpec {
                pool,
                host: h.name.clone(),
                slices,
            }
        })
        .collect()
}

/// `spec` placed on an allocation: that host, exactly those GPUs, and as
/// many GPUs as they are (a claim's Pod need not ask for `nvidia.com/gpu`).
pub fn place(spec: &mut InstanceSpec, placement: Placement) {
    spec.resources.gpus = u32::try_from(placement.gpu_ids.len()).unwrap_or(u32::MAX);
    spec.placement = Some(placement);
}

/// Whether some device of `driver` the claim holds waits for its binding
/// conditions: neither [`RESERVED`] nor [`REJECTED`] is true on it yet.
pub fn awaits_answer(claim: &ResourceClaim, driver: &str) -> bool {
    let said = |r: &DeviceRequestAllocationResult| {
        claim
            .status
            .iter()
            .flat_map(|s| s.devices.iter().flatten())
            .filter(|d| d.driver == r.driver && d.pool == r.pool && d.device == r.device)
            .flat_map(|d| d.conditions.iter().flatten())
            .any(|c| (c.type_ == RESERVED || c.type_ == REJECTED) && c.status == "True")
    };
    allocated(claim).iter().any(|r| {
        r.driver == driver
            && r.binding_conditions.as_ref().is_some_and(|b| !b.is_empty())
            && !said(r)
    })
}

/// The name of a pool's `i`th slice: stable, so a new leader writes over its
/// predecessor's slices rather than beside them.
pub fn slice_name(driver: &str, pool: &str, i: usize) -> String {
    let driver: String = driver
        .chars()
        .map(|c| if c == '.' { '-' } else { c })
        .collect();
    format!("{pool}-{driver}-{i}")
}

/// The Pods a claim is reserved for: (name, uid).
pub fn reserved_pods(claim: &ResourceClaim) -> Vec<(String, String)> {
    claim
        .status
        .iter()
        .flat_map(|s| s.reserved_for.iter().flatten())
        .filter(|r| r.resource == "pods" && r.api_group.as_deref().unwrap_or("").is_empty())
        .map(|r| (r.name.clone(), r.uid.clone()))
        .collect()
}

/// The devices a claim is allocated (none while it is not).
pub fn allocated(claim: &ResourceClaim) -> Vec<DeviceRequestAllocationResult> {
    claim
        .status
        .as_ref()
        .and_then(|s| s.allocation.as_ref())
        .and_then(|a| a.devices.as_ref())
        .and_then(|d| d.results.clone())
        .unwrap_or_default()
}

/// The two binding conditions of a device, as vkd answers the scheduler:
/// [`RESERVED`] true when the backend holds the placement (`why` says what it
/// holds or waits for), [`REJECTED`] true with the backend's reason when it
/// never can.
pub fn binding_conditions(
    reserved: bool,
    rejected: Option<(&str, &str)>,
    why: Option<(&str, &str)>,
    pod: &str,
    now: &str,
) -> serde_json::Value {
    let (reason, message) = why.unwrap_or(("BackendRejected", "the backend refused it"));
    serde_json::json!([
        {
            "type": RESERVED,
            "status": if reserved { "True" } else { "False" },
            "reason": reason, "message": message, "lastTransitionTime": now,
        },
        {
            "type": REJECTED,
            "status": if rejected.is_some() { "True" } else { "False" },
            "reason": rejected.map_or("BackendAccepts", |r| r.0),
            "message": rejected.map_or_else(
                || format!("the backend can run Pod {pod}"),
                |r| r.1.to_owned(),
            ),
            "lastTransitionTime": now,
        },
    ])
}

/// The server-side apply body of a claim's `status.devices` entries (each
/// `{driver, pool, device, ...}`): its writer owns only those entries.
pub fn device_status(
    name: &str,
    namespace: &str,
    devices: Vec<serde_json::Value>,
) -> serde_json::Value {
    serde_json::json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": name, "namespace": namespace},
        "status": {"devices": devices},
    })
}

/// [`ClaimRef::entry`] of the claim the scheduler makes for a Pod's
/// extended resources that DRA serves.
pub const EXTENDED_RESOURCES_ENTRY: &str = "extended resources";

/// A ResourceClaim a Pod uses, as the kubelet finds it
/// (`resourceclaim.Name` in Kubernetes).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClaimRef {
    /// The Pod's name for it (`spec.resourceClaims[].name`), or
    /// `extended resources` for the scheduler's claim behind `nvidia.com/gpu`.
    pub entry: String,
    /// The ResourceClaim's name; `None` while the claim of a template has
    /// not been made yet.
    pub claim: Option<String>,
    /// Made from a template for this Pod: it must be owned by the Pod.
    pub generated: bool,
}

/// The claims of `pod`, in its order, then the scheduler's claim for
/// extended resources that DRA serves. A template entry whose status says no
/// claim is needed is left out, as the kubelet does.
pub fn claim_refs(pod: &Pod) -> Vec<ClaimRef> {
    let Some(spec) = &pod.spec else {
        return Vec::new();
    };
    let status = pod.status.as_ref();
    let generated: BTreeMap<&str, Option<&str>> = status
        .and_then(|s| s.resource_claim_statuses.as_ref())
        .into_iter()
        .flatten()
        .map(|s| (s.name.as_str(), s.resource_claim_name.as_deref()))
        .collect();
    let mut refs = Vec::new();
    for c in spec.resource_claims.iter().flatten() {
        if let Some(name) = &c.resource_claim_name {
            refs.push(ClaimRef {
                entry: c.name.clone(),
                claim: Some(name.clone()),
                generated: false,
            });
        } else if c.resource_claim_template_name.is_some() {
            match generated.get(c.name.as_str()) {
                Some(None) => {}
                Some(Some(name)) => refs.push(ClaimRef {
                    entry: c.name.clone(),
                    claim: Some((*name).to_owned()),
                    generated: true,
                }),
                None => refs.push(ClaimRef {
                    entry: c.name.clone(),
                    claim: None,
                    generated: true,
                }),
            }
        }
    }
    if let Some(ext) = status.and_then(|s| s.extended_resource_claim_status.as_ref()) {
        refs.push(ClaimRef {
            entry: EXTENDED_RESOURCES_ENTRY.into(),
            claim: Some(ext.resource_claim_name.clone()),
            generated: false,
        });
    }
    refs
}

/// Why an allocation cannot be run here: the Pod is refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Unusable(pub String);

/// The placement of the devices `results` (of any number of claims) allocate
/// on `hosts`: one host and its GPU ids. `Ok(None)` when none of them is this
/// driver's. Devices of another driver, of a pool that is not this Node's, or
/// on two hosts cannot be run here.
pub fn placement(
    layout: &Layout<'_>,
    hosts: &[HostSlice],
    results: &[(String, DeviceRequestAllocationResult)],
) -> Result<Option<Placement>, Unusable> {
    let mut placed: Option<Placement> = None;
    for (claim, r) in results {
        if r.driver != layout.driver {
            return Err(Unusable(format!(
                "ResourceClaim {claim}: device {}/{} is of driver {}, which node {} does not serve (it serves {})",
                r.pool, r.device, r.driver, layout.node, layout.driver
            )));
        }
        let Some(h) = hosts.iter().find(|h| layout.pool(&h.name) == r.pool) else {
            return Err(Unusable(format!(
                "ResourceClaim {claim}: pool {} is not one of node {}'s",
                r.pool, layout.node
            )));
        };
        let devices = host_devices(h);
        let Some(d) = devices.iter().find(|d| d.name == r.device) else {
            return Err(Unusable(format!(
                "ResourceClaim {claim}: host {} has no device {} (it has {})",
                h.name,
                r.device,
                devices
                    .iter()
                    .map(|d| d.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        };
        let id = d.id.to_owned();
        match &mut placed {
            None => {
                placed = Some(Placement {
                    host: h.name.clone(),
                    gpu_ids: vec![id],
                });
            }
            Some(p) if p.host == h.name => {
                if !p.gpu_ids.contains(&id) {
                    p.gpu_ids.push(id);
                }
            }
            Some(p) => {
                return Err(Unusable(format!(
                    "ResourceClaim {claim}: device {} is on host {}, another device of the Pod on host {}; a Pod runs on one host (match on {HOST_ATTRIBUTE})",
                    r.device, h.name, p.host
                )));
            }
        }
    }
    Ok(placed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use vkd_provider::Gpu;

    fn host(name: &str, n: usize, domain: &str) -> HostSlice {
        HostSlice {
            name: name.into(),
            gpus: (0..n)
                .map(|i| Gpu {
                    id: format!("{name}-gpu{i}"),
                    model: "H100-SXM5-80GB".into(),
                    memory_mib: 81920,
                    nvlink_domain: Some(domain.into()),
                    numa_node: Some(0),
                    pcie_root: Some("pci0000:00".into()),
                    free: true,
                    ..Default::default()
                })
                .collect(),
            max_pods: 110,
            ..Default::default()
        }
    }

    fn attr<'a>(d: &'a Device, k: &str) -> &'a DeviceAttribute {
        &d.attributes.as_ref().unwrap()[k]
    }

    #[test]
    fn a_layout_owns_exactly_the_pools_it_names() {
        let aggregate = Layout {
            node: "vk",
            per_host: false,
            driver: VKD_DOMAIN,
        };
        assert!(aggregate.owns(&aggregate.pool("host-a")));
        for other in ["vk", "vk-", "vk2-host-a", "v"] {
            assert!(!aggregate.owns(other), "{other}");
        }
        let per_host = Layout {
            node: "vk-host-a",
            per_host: true,
            driver: VKD_DOMAIN,
        };
        assert!(per_host.owns(&per_host.pool("host-a")));
        assert!(!per_host.owns("vk-host-a-x") && !per_host.owns("vk"));
    }

    #[test]
    fn aggregate_mode_has_a_pool_per_host_and_nothing_that_joins_hosts() {
        let layout = Layout {
            node: "vk",
            per_host: false,
            driver: VKD_DOMAIN,
        };
        let pools = pools(
            &layout,
            &[host("host-a", 4, "nvl"), host("host-b", 4, "nvl")],
            true,
        );
        assert_eq!(pools.len(), 2);
        assert_eq!(pools[0].pool, "vk-host-a");
        assert_eq!(pools[1].pool, "vk-host-b");
        let s = &pools[0].slices[0];
        assert_eq!(s.node_name.as_deref(), Some("vk"));
        assert_eq!(s.pool.resource_slice_count, 1);
        let d = &s.devices.as_ref().unwrap()[0];
        assert_eq!(d.name, "host-a-gpu0");
        assert_eq!(attr(d, "type").string.as_deref(), Some("gpu"));
        assert_eq!(attr(d, HOST_ATTRIBUTE).string.as_deref(), Some("host-a"));
        // The same domain name on two hosts is two domains.
        assert_eq!(
            attr(d, NVLINK_ATTRIBUTE).string.as_deref(),
            Some("host-a/nvl")
        );
        assert_eq!(
            attr(d, "cudaComputeCapability").version.as_deref(),
            Some("9.0.0")
        );
        let keys = d.attributes.as_ref().unwrap();
        assert!(!keys.contains_key(PCIE_ROOT) && !keys.contains_key(NUMA_NODE));
        assert_eq!(
            attr(d, "gpu.vkd.io/pcieRoot").string.as_deref(),
            Some("host-a/pci0000:00")
        );
        assert_eq!(d.capacity.as_ref().unwrap()["memory"].value.0, "81920Mi");
        assert_eq!(
            d.binding_conditions.as_deref(),
            Some(&["vkd.io/BackendReserved".to_owned()][..])
        );
    }

    #[test]
    fn per_host_mode_publishes_the_standard_attributes_in_the_nodes_pool() {
        let layout = Layout {
            node: "vk-host-a",
            per_host: true,
            driver: "gpu.nvidia.com",
        };
        let pools = pools(&layout, &[host("host-a", 2, "nvl")], false);
        assert_eq!(pools[0].pool, "vk-host-a");
        let d = &pools[0].slices[0].devices.as_ref().unwrap()[1];
        assert_eq!(attr(d, PCIE_ROOT).string.as_deref(), Some("pci0000:00"));
        assert_eq!(attr(d, NUMA_NODE).int, Some(0));
        assert_eq!(pools[0].slices[0].driver, "gpu.nvidia.com");
    }

    #[test]
    fn a_big_host_is_split_into_slices_and_ids_that_are_no_labels_get_indexes() {
        let mut h = host("host-a", 130, "nvl");
        h.gpus[3].id = "GPU-ABC".into();
        let layout = Layout {
            node: "vk",
            per_host: false,
            driver: VKD_DOMAIN,
        };
        let pools = pools(&layout, &[h], false);
        assert_eq!(pools[0].slices.len(), 2);
        assert_eq!(pools[0].devices(), 130);
        assert!(
            pools[0]
                .slices
                .iter()
                .all(|s| s.pool.resource_slice_count == 2)
        );
        assert_eq!(
            pools[0].slices[1].devices.as_ref().unwrap()[0].name,
            "gpu-128"
        );
        // Hosts without GPUs have no pool.
        assert!(super::pools(&layout, &[host("cpu-only", 0, "")], false).is_empty());
    }

    fn result(pool: &str, device: &str) -> (String, DeviceRequestAllocationResult) {
        (
            "ns/claim".into(),
            DeviceRequestAllocationResult {
                driver: VKD_DOMAIN.into(),
                pool: pool.into(),
                device: device.into(),
                request: "gpus".into(),
                ..Default::default()
            },
        )
    }

    #[test]
    fn an_allocation_is_the_placement_on_exactly_its_gpus() {
        let layout = Layout {
            node: "vk",
            per_host: false,
            driver: VKD_DOMAIN,
        };
        let hosts = [host("host-a", 4, "nvl"), host("host-b", 4, "nvl")];
        let p = placement(
            &layout,
            &hosts,
            &[
                result("vk-host-b", "host-b-gpu3"),
                result("vk-host-b", "host-b-gpu1"),
            ],
        )
        .unwrap()
        .unwrap();
        assert_eq!(p.host, "host-b");
        assert_eq!(p.gpu_ids, ["host-b-gpu3", "host-b-gpu1"]);
        assert_eq!(placement(&layout, &hosts, &[]).unwrap(), None);
    }

    #[test]
    fn partitions_are_devices_that_share_their_gpus_counters() {
        let layout = Layout {
            node: "vk",
            per_host: false,
            driver: VKD_DOMAIN,
        };
        let mut h = host("host-m", 2, "nvl");
        h.gpus[1].compute_slices = 7;
        h.gpus[1].partitions = ["3g.40gb", "3g.40gb", "1g.10gb"]
            .iter()
            .enumerate()
            .map(|(k, profile)| vkd_provider::GpuPartition {
                id: format!("host-m-gpu1-p{k}"),
                profile: (*profile).into(),
                compute_slices: if k < 2 { 3 } else { 1 },
                memory_mib: if k < 2 { 40 << 10 } else { 10 << 10 },
                in_use: false,
            })
            .collect();
        let pools = pools(&layout, std::slice::from_ref(&h), true);
        let slices = &pools[0].slices;
        // Counters and devices in separate slices of one pool.
        assert_eq!(slices.len(), 2);
        assert!(slices.iter().all(|s| s.pool.resource_slice_count == 2));
        let sets = slices[0].shared_counters.as_ref().unwrap();
        assert!(slices[0].devices.is_none());
        assert_eq!(sets.len(), 1, "only the partitionable GPU has counters");
        assert_eq!(sets[0].name, "host-m-gpu1");
        assert_eq!(sets[0].counters[COMPUTE_SLICES].value.0, "7");
        assert_eq!(sets[0].counters[MEMORY].value.0, "81920Mi");
        let devices = slices[1].devices.as_ref().unwrap();
        let names: Vec<&str> = devices.iter().map(|d| d.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "host-m-gpu0",
                "host-m-gpu1",
                "host-m-gpu1-p0",
                "host-m-gpu1-p1",
                "host-m-gpu1-p2"
            ]
        );
        assert!(devices[0].consumes_counters.is_none());
        let whole = &devices[1].consumes_counters.as_ref().unwrap()[0];
        assert_eq!(whole.counter_set, "host-m-gpu1");
        assert_eq!(whole.counters[COMPUTE_SLICES].value.0, "7");
        let mig = &devices[2];
        assert_eq!(attr(mig, "type").string.as_deref(), Some("mig"));
        assert_eq!(attr(mig, "profile").string.as_deref(), Some("3g.40gb"));
        assert_eq!(
            attr(mig, "parentUUID").string.as_deref(),
            Some("host-m-gpu1")
        );
        assert!(
            !mig.attributes
                .as_ref()
                .unwrap()
                .contains_key(NVLINK_ATTRIBUTE)
        );
        assert_eq!(mig.capacity.as_ref().unwrap()["memory"].value.0, "40960Mi");
        let used = &mig.consumes_counters.as_ref().unwrap()[0];
        assert_eq!(
            (
                used.counters[COMPUTE_SLICES].value.0.as_str(),
                used.counters[MEMORY].value.0.as_str()
            ),
            ("3", "40960Mi")
        );
        // An allocated partition is placed by its id.
        let p = placement(&layout, &[h], &[result("vk-host-m", "host-m-gpu1-p2")])
            .unwrap()
            .unwrap();
        assert_eq!(p.gpu_ids, ["host-m-gpu1-p2"]);
    }

    #[test]
    fn allocations_vkd_cannot_run_are_refused_naming_the_claim() {
        let layout = Layout {
            node: "vk",
            per_host: false,
            driver: VKD_DOMAIN,
        };
        let hosts = [host("host-a", 4, "nvl"), host("host-b", 4, "nvl")];
        let two_hosts = placement(
            &layout,
            &hosts,
            &[
                result("vk-host-a", "host-a-gpu0"),
                result("vk-host-b", "host-b-gpu0"),
            ],
        )
        .unwrap_err();
        assert!(
            two_hosts.0.contains("a Pod runs on one host"),
            "{two_hosts}"
        );
        let other_node = placement(&layout, &hosts, &[result("other-host-a", "x")]).unwrap_err();
        assert!(
            other_node
                .0
                .starts_with("ResourceClaim ns/claim: pool other-host-a"),
            "{other_node}"
        );
        let gone = placement(&layout, &hosts, &[result("vk-host-a", "host-a-gpu9")]).unwrap_err();
        assert!(gone.0.contains("has no device host-a-gpu9"), "{gone}");
        let mut foreign = result("vk-host-a", "host-a-gpu0");
        foreign.1.driver = "gpu.nvidia.com".into();
        assert!(placement(&layout, &hosts, &[foreign]).is_err());
    }

    #[test]
    fn a_claim_says_whom_it_is_reserved_for_and_what_it_holds() {
        let claim: ResourceClaim = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "c", "namespace": "ns"},
            "spec": {},
            "status": {
                "reservedFor": [
                    {"resource": "pods", "name": "p", "uid": "u1"},
                    {"resource": "things", "apiGroup": "example.com", "name": "t", "uid": "u2"},
                ],
                "allocation": {"devices": {"results": [
                    {"request": "gpus", "driver": VKD_DOMAIN, "pool": "vk-host-a", "device": "host-a-gpu1"},
                ]}},
            },
        }))
        .unwrap();
        assert_eq!(reserved_pods(&claim), [("p".to_owned(), "u1".to_owned())]);
        assert_eq!(allocated(&claim)[0].device, "host-a-gpu1");
        let unallocated = ResourceClaim::default();
        assert!(allocated(&unallocated).is_empty() && reserved_pods(&unallocated).is_empty());
    }

    #[test]
    fn a_claim_awaits_vkds_answer_until_a_binding_condition_is_true() {
        let claim = |conditions: serde_json::Value| -> ResourceClaim {
            serde_json::from_value(serde_json::json!({
                "metadata": {"name": "c", "namespace": "ns"},
                "spec": {},
                "status": {
                    "allocation": {"devices": {"results": [{
                        "request": "gpus", "driver": VKD_DOMAIN, "pool": "vk-host-a",
                        "device": "host-a-gpu0", "bindingConditions": [RESERVED],
                        "bindingFailureConditions": [REJECTED],
                    }]}},
                    "devices": [{"driver": VKD_DOMAIN, "pool": "vk-host-a",
                                 "device": "host-a-gpu0", "conditions": conditions}],
                },
            }))
            .unwrap()
        };
        let queued = binding_conditions(
            false,
            None,
            Some(("BackendQueued", "cpu")),
            "p",
            "2026-12-06T00:00:00Z",
        );
        let held = binding_conditions(
            true,
            None,
            Some(("BackendReserved", "ok")),
            "p",
            "2026-12-06T00:00:00Z",
        );
        let refused =
            binding_conditions(false, Some(("X", "no")), None, "p", "2026-12-06T00:00:00Z");
        assert!(awaits_answer(&claim(serde_json::json!([])), VKD_DOMAIN));
        assert!(awaits_answer(&claim(queued), VKD_DOMAIN));
        assert!(!awaits_answer(&claim(held), VKD_DOMAIN));
        assert!(!awaits_answer(&claim(refused), VKD_DOMAIN));
        assert!(!awaits_answer(
            &claim(serde_json::json!([])),
            "gpu.nvidia.com"
        ));
    }

    #[test]
    fn binding_conditions_say_reserved_queued_or_rejected() {
        let status = |v: &serde_json::Value| {
            (
                v[0]["status"].as_str().unwrap().to_owned(),
                v[1]["status"].as_str().unwrap().to_owned(),
            )
        };
        let held = binding_conditions(true, None, Some(("BackendReserved", "holds")), "p", "t");
        assert_eq!(status(&held), ("True".into(), "False".into()));
        assert_eq!(held[0]["type"], RESERVED);
        let queued = binding_conditions(false, None, Some(("BackendQueued", "cpu")), "p", "t");
        assert_eq!(status(&queued), ("False".into(), "False".into()));
        assert_eq!(queued[0]["reason"], "BackendQueued");
        let refused =
            binding_conditions(false, Some(("TopologyUnsatisfiable", "no")), None, "p", "t");
        assert_eq!(status(&refused), ("False".into(), "True".into()));
        assert_eq!(refused[1]["reason"], "TopologyUnsatisfiable");
        assert_eq!(refused[1]["type"], REJECTED);
    }

    #[test]
    fn claims_are_found_as_the_kubelet_finds_them() {
        let pod: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p", "namespace": "ns", "uid": "u"},
            "spec": {"containers": [], "resourceClaims": [
                {"name": "direct", "resourceClaimName": "shared"},
                {"name": "made", "resourceClaimTemplateName": "t"},
                {"name": "not-yet", "resourceClaimTemplateName": "t"},
                {"name": "not-needed", "resourceClaimTemplateName": "t"},
            ]},
            "status": {
                "resourceClaimStatuses": [
                    {"name": "made", "resourceClaimName": "p-made-x1"},
                    {"name": "not-needed"},
                ],
                "extendedResourceClaimStatus": {"resourceClaimName": "p-extended-resources-x2", "requestMappings": []},
            },
        }))
        .unwrap();
        let refs = claim_refs(&pod);
        let names: Vec<(&str, Option<&str>, bool)> = refs
            .iter()
            .map(|r| (r.entry.as_str(), r.claim.as_deref(), r.generated))
            .collect();
        assert_eq!(
            names,
            [
                ("direct", Some("shared"), false),
                ("made", Some("p-made-x1"), true),
                ("not-yet", None, true),
                ("extended resources", Some("p-extended-resources-x2"), false),
            ]
        );
    }
}
