//! The downstream cluster's capacity as vkd's host slices: one per Node that
//! counts as a host (the selector), is Ready and schedulable, with what the
//! Node allocates less what every non-terminal Pod bound there requests (all
//! tenants', not only vkd's), and its GPUs from the labels NVIDIA's GPU
//! Feature Discovery publishes.

use std::collections::{BTreeMap, HashMap};

use k8s_openapi::api::core::v1::{Container, Node, Pod};
use vkd_provider::{Gpu, HostSlice, quantity};

use crate::config::KubernetesConfig;

/// What a Pod asks of its Node, summed as the scheduler sums it: the
/// containers (and sidecars) together, or an init container with the sidecars
/// started before it, whichever is larger, plus the Pod's overhead.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Requests {
    pub cpu_millis: u64,
    pub memory_bytes: u64,
    pub gpus: u64,
}

impl Requests {
    fn add(self, o: Self) -> Self {
        Self {
            cpu_millis: self.cpu_millis.saturating_add(o.cpu_millis),
            memory_bytes: self.memory_bytes.saturating_add(o.memory_bytes),
            gpus: self.gpus.saturating_add(o.gpus),
        }
    }

    fn sub(self, o: Self) -> Self {
        Self {
            cpu_millis: self.cpu_millis.saturating_sub(o.cpu_millis),
            memory_bytes: self.memory_bytes.saturating_sub(o.memory_bytes),
            gpus: self.gpus.saturating_sub(o.gpus),
        }
    }

    fn max(self, o: Self) -> Self {
        Self {
            cpu_millis: self.cpu_millis.max(o.cpu_millis),
            memory_bytes: self.memory_bytes.max(o.memory_bytes),
            gpus: self.gpus.max(o.gpus),
        }
    }

    fn of_list(
        list: Option<&BTreeMap<String, k8s_openapi::apimachinery::pkg::api::resource::Quantity>>,
        gpu: &str,
    ) -> Self {
        let get = |k: &str| list.and_then(|l| l.get(k)).map(|q| q.0.as_str());
        Self {
            cpu_millis: get("cpu")
                .and_then(|q| quantity::cpu_millis(q).ok())
                .unwrap_or(0),
            memory_bytes: get("memory")
                .and_then(|q| quantity::bytes(q).ok())
                .unwrap_or(0),
            gpus: get(gpu).and_then(|q| q.parse().ok()).unwrap_or(0),
        }
    }

    fn of_container(c: &Container, gpu: &str) -> Self {
        let r = c.resources.as_ref();
        // A limit without a request is the request (the API server stores it so).
        let requests = r.and_then(|r| r.requests.as_ref());
        let limits = r.and_then(|r| r.limits.as_ref());
        let req = Self::of_list(requests, gpu);
        let lim = Self::of_list(limits, gpu);
        let pick = |a: u64, b: u64| if a == 0 { b } else { a };
        Self {
            cpu_millis: pick(req.cpu_millis, lim.cpu_millis),
            memory_bytes: pick(req.memory_bytes, lim.memory_bytes),
            gpus: pick(req.gpus, lim.gpus),
        }
    }

    /// The requests of `pod`, counting `gpu` as the GPU resource.
    pub fn of_pod(pod: &Pod, gpu: &str) -> Self {
        let Some(spec) = pod.spec.as_ref() else {
            return Self::default();
        };
        let inits = spec.init_containers.as_deref().unwrap_or_default();
        let sidecar = |c: &Container| c.restart_policy.as_deref() == Some("Always");
        let mut running = spec
            .containers
            .iter()
            .map(|c| Self::of_container(c, gpu))
            .fold(Self::default(), Self::add);
        let mut sidecars = Self::default();
        let mut peak = Self::default();
        for c in inits {
            let r = Self::of_container(c, gpu);
            if sidecar(c) {
                sidecars = sidecars.add(r);
            } else {
                peak = peak.max(r.add(sidecars));
            }
        }
        running = running.add(sidecars);
        let overhead = Self::of_list(spec.overhead.as_ref(), gpu);
        running.max(peak).add(overhead)
    }
}

/// What the non-terminal Pods bound to each Node request, kept from the Pod
/// watch's events (each Pod once, by UID), so that capacity is read per Node
/// and not summed again over every Pod of the cluster for each admission.
#[derive(Debug, Default)]
pub struct Usage {
    pods: HashMap<String, (String, Requests)>,
    nodes: HashMap<String, (Requests, u32)>,
}

impl Usage {
    /// The usage of `pods` (every Pod of the cluster), as a relist builds it.
    pub fn of<'a>(pods: impl IntoIterator<Item = &'a Pod>, gpu: &str) -> Self {
        let mut u = Self::default();
        for p in pods {
            u.apply(p, gpu);
        }
        u
    }

    /// `pod` as it is now: what it held before is replaced.
    pub fn apply(&mut self, pod: &Pod, gpu: &str) {
        self.delete(pod);
        let node = pod.spec.as_ref().and_then(|s| s.node_name.as_deref());
        let (Some(uid), Some(node)) = (pod.metadata.uid.as_deref(), node) else {
            return;
        };
        if !holds_resources(pod) {
            return;
        }
        let r = Requests::of_pod(pod, gpu);
        let e = self.nodes.entry(node.to_owned()).or_default();
        e.0 = e.0.add(r);
        e.1 = e.1.saturating_add(1);
        self.pods.insert(uid.to_owned(), (node.to_owned(), r));
    }

    /// `pod` is gone: it holds nothing.
    pub fn delete(&mut self, pod: &Pod) {
        let Some((node, r)) = pod
            .metadata
            .uid
            .as_deref()
            .and_then(|uid| self.pods.remove(uid))
        else {
            return;
        };
        if let Some(e) = self.nodes.get_mut(&node) {
            e.0 = e.0.sub(r);
            e.1 = e.1.saturating_sub(1);
            if e.1 == 0 {
                self.nodes.remove(&node);
            }
        }
    }

    fn on(&self, node: &str) -> (Requests, u32) {
        self.nodes.get(node).copied().unwrap_or_default()
    }
}

/// A Pod that still holds what it requested on its Node.
fn holds_resources(pod: &Pod) -> bool {
    let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
    !matches!(phase, Some("Succeeded" | "Failed"))
}

/// The Node is Ready and takes new Pods.
fn schedulable(node: &Node) -> bool {
    let unschedulable = node
        .spec
        .as_ref()
        .and_then(|s| s.unschedulable)
        .unwrap_or(false);
    let ready = node
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
    ready && !unschedulable
}

/// The host slices of `nodes` (already those the selector names), less what
/// `used` says the Pods bound to each request.
pub fn host_slices<'a>(
    nodes: impl IntoIterator<Item = &'a Node>,
    used: &Usage,
    config: &KubernetesConfig,
) -> Vec<HostSlice> {
    let gpu = config.gpu_resource.as_str();
    let mut hosts: Vec<HostSlice> = nodes
        .into_iter()
        .filter(|n| schedulable(n))
        .filter_map(|n| {
            let name = n.metadata.name.clone()?;
            let alloc = n.status.as_ref().and_then(|s| s.allocatable.as_ref());
            let total = Requests::of_list(alloc, gpu);
            let get = |k: &str| alloc.and_then(|a| a.get(k)).map(|q| q.0.as_str());
            // A quantity: the API server writes 20000 as "20k". One it cannot
            // read places nothing; none at all is the kubelet's default.
            let max_pods = get("pods").map_or(110, |q| {
                quantity::count(q)
                    .ok()
                    .and_then(|n| u32::try_from(n).ok())
                    .unwrap_or(0)
            });
            let disk = get("ephemeral-storage")
                .and_then(|q| quantity::bytes(q).ok())
                .unwrap_or(0);
            let (taken, pods_running) = used.on(&name);
            let labels = n.metadata.labels.clone().unwrap_or_default();
            let label = |key: &str| labels.get(key).map(String::as_str);
            let model = label(&config.gpu_labels.product)
                .unwrap_or("unknown")
                .to_owned();
            let memory_mib = label(&config.gpu_labels.memory)
                .and_then(|m| m.parse().ok())
                .unwrap_or(0);
            let clique = label(&config.gpu_labels.clique).map(str::to_owned);
            let free = total.gpus.saturating_sub(taken.gpus);
            let gpus = (0..total.gpus.min(1024))
                .map(|i| Gpu {
                    id: format!("{name}-gpu{i}"),
                    model: model.clone(),
                    memory_mib,
                    nvlink_domain: clique.clone(),
                    numa_node: None,
                    pcie_root: None,
                    // Kubernetes says how many are free, not which.
                    free: i < free,
                    ..Default::default()
                })
                .collect();
            Some(HostSlice {
                cpu_millis_total: total.cpu_millis,
                cpu_millis_free: total.cpu_millis.saturating_sub(taken.cpu_millis),
                memory_bytes_total: total.memory_bytes,
                memory_bytes_free: total.memory_bytes.saturating_sub(taken.memory_bytes),
                gpus,
                rdma_domain: None,
                labels: labels
                    .iter()
                    .filter(|(k, _)| {
                        k.starts_with("nvidia.com/") || k.starts_with("topology.kubernetes.io/")
                    })
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect(),
                cached_models: Vec::new(),
                ephemeral_storage_bytes: disk,
                max_pods,
                pods_running,
                name,
                gpus_by_count: true,
            })
        })
        .collect();
    hosts.sort_by(|a, b| a.name.cmp(&b.name));
    hosts
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // a failed unwrap is a failed test
    use super::*;
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
    use serde_json::json;

    /// Kept from events, the usage is what summing every Pod again gives:
    /// a Pod that ends or goes frees what it held, a Pod seen twice counts once.
    #[test]
    fn usage_kept_from_events_is_the_sum_of_the_pods() {
        let pod = |uid: &str, node: &str, cpu: &str, phase: &str| -> Pod {
            serde_json::from_value(json!({
                "metadata": {"name": uid, "uid": uid},
                "spec": {"nodeName": node, "containers": [
                    {"name": "c", "resources": {"requests": {"cpu": cpu, "nvidia.com/gpu": "1"}}}]},
                "status": {"phase": phase}
            }))
            .unwrap()
        };
        let mut kept = Usage::default();
        let gpu = "nvidia.com/gpu";
        for p in [
            pod("a", "n1", "1", "Running"),
            pod("b", "n1", "2", "Pending"),
            pod("c", "n2", "500m", "Running"),
        ] {
            kept.apply(&p, gpu);
        }
        kept.apply(&pod("b", "n1", "2", "Running"), gpu);
        kept.apply(&pod("a", "n1", "1", "Succeeded"), gpu);
        kept.delete(&pod("c", "n2", "500m", "Running"));
        let now = [
            pod("a", "n1", "1", "Succeeded"),
            pod("b", "n1", "2", "Running"),
        ];
        let summed = Usage::of(&now, gpu);
        for node in ["n1", "n2"] {
            assert_eq!(kept.on(node), summed.on(node), "{node}");
        }
        assert_eq!(
            kept.on("n1"),
            (
                Requests {
                    cpu_millis: 2000,
                    memory_bytes: 0,
                    gpus: 1
                },
                1
            )
        );
        assert_eq!(kept.on("n2"), (Requests::default(), 0));
    }

    fn config() -> KubernetesConfig {
        KubernetesConfig::parse("kubeconfig: /k", std::path::Path::new("k.yaml")).unwrap()
    }

    fn node(name: &str, ready: &str, unschedulable: bool, gpus: u32) -> Node {
        serde_json::from_value(json!({
            "metadata": {"name": name, "labels": {
                "nvidia.com/gpu.product": "H100-SXM", "nvidia.com/gpu.memory": "81559",
                "nvidia.com/gpu.clique": "c1", "team": "ignored"}},
            "spec": {"unschedulable": unschedulable},
            "status": {
                "conditions": [{"type": "Ready", "status": ready}],
                "allocatable": {"cpu": "8", "memory": "32Gi", "pods": "20",
                    "ephemeral-storage": "100Gi", "nvidia.com/gpu": gpus.to_string()}
            }
        }))
        .unwrap()
    }

    fn pod(node: &str, phase: &str, cpu: &str, gpus: u32, init_cpu: &str) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": "p", "uid": format!("{node}-{phase}-{cpu}-{gpus}-{init_cpu}")},
            "spec": {
                "nodeName": node,
                "initContainers": [{"name": "i", "resources": {"requests": {"cpu": init_cpu}}}],
                "containers": [
                    {"name": "a", "resources": {"requests": {"cpu": cpu, "memory": "1Gi"},
                        "limits": {"nvidia.com/gpu": gpus.to_string()}}},
                    {"name": "b", "resources": {"limits": {"cpu": "500m"}}}
                ]
            },
            "status": {"phase": phase}
        }))
        .unwrap()
    }

    #[test]
    fn every_tenants_running_pods_use_a_ready_nodes_capacity() {
        let nodes = [
            node("a", "True", false, 4),
            node("b", "False", false, 4),
            node("c", "True", true, 4),
        ];
        let pods = [
            pod("a", "Running", "1", 1, "100m"),
            pod("a", "Pending", "2", 2, "6"),
            pod("a", "Succeeded", "4", 1, "100m"),
            pod("b", "Running", "1", 1, "100m"),
        ];
        let hosts = host_slices(&nodes, &Usage::of(&pods, "nvidia.com/gpu"), &config());
        assert_eq!(hosts.len(), 1, "NotReady and cordoned nodes are no hosts");
        let a = &hosts[0];
        assert_eq!(a.name, "a");
        assert_eq!(a.cpu_millis_total, 8000);
        // 1.5 cores for the first; the second's init container (6) outweighs its 2.5.
        assert_eq!(a.cpu_millis_free, 8000 - 1500 - 6000);
        assert_eq!(a.memory_bytes_free, 30 << 30);
        assert_eq!((a.gpus.len(), a.gpus_free()), (4, 1));
        assert_eq!(a.gpus[0].model, "H100-SXM");
        assert_eq!(a.gpus[0].memory_mib, 81559);
        assert_eq!(a.gpus[0].nvlink_domain.as_deref(), Some("c1"));
        assert_eq!((a.max_pods, a.pods_running), (20, 2));
        assert_eq!(a.ephemeral_storage_bytes, 100 << 30);
        assert!(a.labels.contains_key("nvidia.com/gpu.product") && !a.labels.contains_key("team"));
        // Pods as the API server writes a large count.
        let mut big = node("big", "True", false, 0);
        if let Some(alloc) = big.status.as_mut().and_then(|s| s.allocatable.as_mut()) {
            alloc.insert("pods".into(), Quantity("20k".into()));
        }
        let hosts = host_slices(&[big], &Usage::default(), &config());
        assert_eq!(hosts[0].max_pods, 20_000);
    }

    #[test]
    fn sidecars_count_beside_the_containers() {
        let p: Pod = serde_json::from_value(json!({
            "metadata": {"name": "p"},
            "spec": {
                "initContainers": [
                    {"name": "side", "restartPolicy": "Always", "resources": {"requests": {"cpu": "1"}}},
                    {"name": "setup", "resources": {"requests": {"cpu": "2"}}}
                ],
                "containers": [{"name": "a", "resources": {"requests": {"cpu": "500m"}}}],
                "overhead": {"cpu": "100m"}
            }
        }))
        .unwrap();
        // max(0.5 + 1 sidecar, 2 + 1 sidecar) + 0.1 overhead
        assert_eq!(Requests::of_pod(&p, "nvidia.com/gpu").cpu_millis, 3100);
    }
}
