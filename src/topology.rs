//! Placement with reservation, and what a Node says about its capacity.
//!
//! [`Admitter`] decides where a Pod goes from the provider's host slices (one
//! host, GPUs in one NVLink domain when asked), minus what it has already
//! promised to Pods that are admitted but not yet running. It takes one Pod at a
//! time, so two concurrent 4-GPU Pods can never be given the same 4 free GPUs;
//! the provider is told the GPUs to use and may still refuse.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};

use vkd_provider::topology::decide;
use vkd_provider::{
    Admission, Capacity, HostSlice, InstanceSpec, Placement, Provider, ProviderError,
};

/// What admission promised one Pod.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Reservation {
    host: String,
    gpu_ids: Vec<String>,
    cpu_millis: u64,
    memory_bytes: u64,
    /// The backend has the instance (and counts its CPU and memory itself).
    created: bool,
}

impl Reservation {
    fn explained(&self, uid: &str, pod: &str) -> crate::explain::Reservation {
        crate::explain::Reservation {
            pod_uid: uid.to_owned(),
            pod: pod.to_owned(),
            host: self.host.clone(),
            gpu_ids: self.gpu_ids.clone(),
            cpu_millis: self.cpu_millis,
            memory_bytes: self.memory_bytes,
            created: self.created,
        }
    }
}

#[derive(Debug)]
pub struct Admitter {
    provider: Arc<dyn Provider>,
    /// Per-host nodes place only on their own host.
    host: Option<String>,
    turn: tokio::sync::Mutex<()>,
    reserved: Mutex<HashMap<String, Reservation>>,
}

impl Admitter {
    pub fn new(provider: Arc<dyn Provider>, host: Option<String>) -> Self {
        Self {
            provider,
            host,
            turn: tokio::sync::Mutex::new(()),
            reserved: Mutex::default(),
        }
    }

    fn reserved(&self) -> MutexGuard<'_, HashMap<String, Reservation>> {
        self.reserved.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Decides and reserves. `Fits` carries the placement to create with.
    pub async fn admit(&self, spec: &InstanceSpec) -> Result<Admission, ProviderError> {
        Ok(self.admit_seeing(spec).await?.0)
    }

    /// [`Self::admit`], with the free slices it decided on, for a person
    /// (`host-a 1/4 GPU free, ...`; empty for a backend without slices).
    pub async fn admit_seeing(
        &self,
        spec: &InstanceSpec,
    ) -> Result<(Admission, String), ProviderError> {
        let _turn = self.turn.lock().await;
        let uid = spec.pod.uid.as_str();
        let mut spec = spec.clone();
        if let Some(h) = &self.host {
            spec.placement = Some(Placement {
                host: h.clone(),
                gpu_ids: Vec::new(),
            });
        }
        let cap = self.provider.capacity().await?;
        if cap.hosts.is_empty() {
            // A backend without host slices decides alone.
            return Ok((self.provider.admit(&spec).await?, String::new()));
        }
        let (total, free) = self.views(&cap.hosts, uid);
        let seen = seen_slices(&free, self.host.as_deref());
        let placement = match decide(&total, &free, &spec) {
            Admission::Fits(p) => p,
            other => return Ok((other, seen)),
        };
        spec.placement = Some(placement);
        let answer = self.provider.admit(&spec).await?;
        if let Admission::Fits(p) = &answer {
            self.reserved().insert(
                uid.to_owned(),
                Reservation {
                    host: p.host.clone(),
                    gpu_ids: p.gpu_ids.clone(),
                    cpu_millis: spec.resources.cpu_millis,
                    memory_bytes: spec.resources.memory_bytes,
                    created: false,
                },
            );
        }
        Ok((answer, seen))
    }

    /// What admission holds for one Pod (`pod`: its `namespace/name`).
    pub fn reservation(&self, uid: &str, pod: &str) -> Option<crate::explain::Reservation> {
        self.reserved().get(uid).map(|r| r.explained(uid, pod))
    }

    /// Every reservation held, oldest Pod name first; `pod_of` names a UID's Pod.
    pub fn reservations(
        &self,
        pod_of: impl Fn(&str) -> Option<String>,
    ) -> Vec<crate::explain::Reservation> {
        let mut out: Vec<_> = self
            .reserved()
            .iter()
            .map(|(uid, r)| r.explained(uid, &pod_of(uid).unwrap_or_else(|| "(no Pod)".into())))
            .collect();
        out.sort_by(|a, b| a.pod.cmp(&b.pod));
        out
    }

    /// The hosts with everything free, and as they are now less what other Pods hold.
    fn views(&self, hosts: &[HostSlice], uid: &str) -> (Vec<HostSlice>, Vec<HostSlice>) {
        let total = hosts.iter().map(HostSlice::whole).collect();
        let mut free = hosts.to_vec();
        for (owner, r) in self.reserved().iter() {
            if owner == uid {
                continue;
            }
            let Some(h) = free.iter_mut().find(|h| h.name == r.host) else {
                continue;
            };
            for g in h.gpus.iter_mut().filter(|g| r.gpu_ids.contains(&g.id)) {
                g.free = false;
            }
            if !r.created {
                h.cpu_millis_free = h.cpu_millis_free.saturating_sub(r.cpu_millis);
                h.memory_bytes_free = h.memory_bytes_free.saturating_sub(r.memory_bytes);
                h.pods_running += 1;
            }
        }
        (total, free)
    }

    /// The backend created the instance: it counts CPU and memory from now on;
    /// the GPUs stay held until the instance runs or ends.
    pub fn created(&self, uid: &str) {
        if let Some(r) = self.reserved().get_mut(uid) {
            r.created = true;
        }
    }

    /// Where a Pod's held reservation places it, if it holds one.
    pub fn held_placement(&self, uid: &str) -> Option<Placement> {
        self.reserved().get(uid).map(|r| Placement {
            host: r.host.clone(),
            gpu_ids: r.gpu_ids.clone(),
        })
    }

    /// The instance runs, ended, or will not be made: nothing more to hold.
    pub fn release(&self, uid: &str) {
        self.reserved().remove(uid);
    }

    /// How many Pods hold a reservation now.
    pub fn held(&self) -> usize {
        self.reserved().len()
    }

    /// The cpu and memory the Node reports as allocatable (its host, in
    /// per-host mode): what a downward-API read of an unset limit gives.
    pub async fn allocatable(&self) -> Result<crate::pods::spec::Allocatable, ProviderError> {
        let cap = self.provider.capacity().await?;
        let hosts = cap
            .hosts
            .iter()
            .filter(|h| self.host.as_ref().is_none_or(|mine| *mine == h.name));
        Ok(allocatable(hosts))
    }
}

/// The free slices admission decided on, for a person: the hosts with the
/// most free GPUs first, at most [`SEEN_HOSTS`] of them.
fn seen_slices(free: &[HostSlice], only: Option<&str>) -> String {
    let mut hosts: Vec<&HostSlice> = free
        .iter()
        .filter(|h| only.is_none_or(|mine| mine == h.name))
        .collect();
    hosts.sort_by_key(|h| {
        (
            std::cmp::Reverse(h.gpus_free()),
            std::cmp::Reverse(h.cpu_millis_free),
        )
    });
    let mut out: Vec<String> = hosts
        .iter()
        .take(SEEN_HOSTS)
        .map(|h| {
            format!(
                "{} {}/{} GPU, {}m CPU free",
                h.name,
                h.gpus_free(),
                h.gpus.len(),
                h.cpu_millis_free
            )
        })
        .collect();
    if hosts.len() > SEEN_HOSTS {
        out.push(format!("{} more hosts", hosts.len() - SEEN_HOSTS));
    }
    out.join(", ")
}

/// How many hosts an admission decision names.
const SEEN_HOSTS: usize = 4;

/// The Node's allocatable cpu and memory: the sum of its host slices' totals.
pub fn allocatable<'a>(
    hosts: impl IntoIterator<Item = &'a HostSlice>,
) -> crate::pods::spec::Allocatable {
    hosts
        .into_iter()
        .fold(crate::pods::spec::Allocatable::default(), |a, h| {
            crate::pods::spec::Allocatable {
                cpu_millis: a.cpu_millis.saturating_add(h.cpu_millis_total),
                memory_bytes: a.memory_bytes.saturating_add(h.memory_bytes_total),
            }
        })
}

/// A Kubernetes label value from free text: `[A-Za-z0-9._-]`, at most 63, alphanumeric ends.
pub fn label_value(text: &str) -> String {
    let cleaned: String = text
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '-'
            }
        })
        .take(63)
        .collect();
    cleaned
        .trim_matches(|c: char| !c.is_ascii_alphanumeric())
        .to_owned()
}

/// A Node name part from a host name: lowercase DNS label characters.
pub fn node_suffix(host: &str) -> String {
    label_value(&host.to_ascii_lowercase().replace(['_', '.'], "-"))
}

/// Labels and annotations that say what the Node's capacity means. `per_host`
/// adds the host's own topology labels.
pub fn node_metadata(
    cap: &Capacity,
    per_host: bool,
) -> (BTreeMap<String, String>, BTreeMap<String, String>) {
    let mut labels = BTreeMap::new();
    let mut annotations = BTreeMap::new();
    let hosts = &cap.hosts;
    let gpus: Vec<_> = hosts.iter().flat_map(|h| &h.gpus).collect();
    if !gpus.is_empty() {
        let largest = hosts.iter().map(|h| h.gpus.len()).max().unwrap_or(0);
        labels.insert("vkd.io/gpu.max-per-pod".into(), largest.to_string());
        let mut models: Vec<&str> = gpus.iter().map(|g| g.model.as_str()).collect();
        models.sort_unstable();
        models.dedup();
        let model = if models.len() == 1 {
            label_value(models[0])
        } else {
            "mixed".into()
        };
        labels.insert("vkd.io/gpu.model".into(), model);
        let mem = gpus.iter().map(|g| g.memory_mib).min().unwrap_or(0);
        labels.insert("vkd.io/gpu.memory-mib".into(), mem.to_string());
        let free_largest = hosts.iter().map(HostSlice::gpus_free).max().unwrap_or(0);
        annotations.insert(
            "vkd.io/gpu.max-free-per-pod".into(),
            free_largest.to_string(),
        );
    }
    if per_host && let Some(h) = hosts.first() {
        labels.insert("vkd.io/host".into(), label_value(&h.name));
        let mut domains: Vec<&str> = h
            .gpus
            .iter()
            .filter_map(|g| g.nvlink_domain.as_deref())
            .collect();
        domains.sort_unstable();
        domains.dedup();
        if !domains.is_empty() {
            labels.insert(
                "vkd.io/nvlink-domains".into(),
                label_value(&domains.join(".")),
            );
        }
        if let Some(r) = &h.rdma_domain {
            labels.insert("vkd.io/rdma-domain".into(), label_value(r));
        }
        // The names NVIDIA's GPU Feature Discovery gives a real GPU node, so
        // that a vkd (or anything else) reading this cluster as a downstream
        // sees vkd's hosts as it would see real ones. Only for one host: they
        // describe a machine, not a sum.
        if let Some(g) = h.gpus.first() {
            labels.insert("nvidia.com/gpu.product".into(), label_value(&g.model));
            labels.insert("nvidia.com/gpu.memory".into(), g.memory_mib.to_string());
            labels.insert("nvidia.com/gpu.count".into(), h.gpus.len().to_string());
            if let [one] = domains.as_slice() {
                labels.insert("nvidia.com/gpu.clique".into(), label_value(one));
            }
        }
    }
    annotations.insert("vkd.io/capacity-kind".into(), cap.kind.to_string());
    annotations.insert(
        "vkd.io/capacity-refresh".into(),
        format!("{}s", cap.refresh_interval.as_secs()),
    );
    annotations.insert(
        "vkd.io/slices".into(),
        vkd_provider::topology::summary(hosts),
    );
    (labels, annotations)
}

/// The host slices as a table a person reads (the admin server's `/slices`).
pub fn slices_table(cap: &Capacity) -> String {
    use std::fmt::Write;
    let mut out = format!(
        "capacity: {} (observed {}, refreshed every {}s)\n",
        cap.kind,
        crate::pods::status::time(cap.observed_at),
        cap.refresh_interval.as_secs()
    );
    let _ = writeln!(
        out,
        "{:<16} {:>9} {:<16} {:<16} {:>13} {:>19} {:>9} RDMA",
        "HOST", "GPU FREE", "MODEL", "NVLINK", "CPU FREE", "MEMORY FREE", "PODS"
    );
    let gib = |b: u64| format!("{:.0}Gi", b as f64 / f64::from(1u32 << 30));
    for h in &cap.hosts {
        let mut models: Vec<&str> = h.gpus.iter().map(|g| g.model.as_str()).collect();
        models.sort_unstable();
        models.dedup();
        let mut domains: Vec<String> = h
            .gpus
            .iter()
            .filter_map(|g| g.nvlink_domain.as_ref())
            .map(|d| {
                let free = h
                    .gpus
                    .iter()
                    .filter(|g| g.free && g.nvlink_domain.as_ref() == Some(d))
                    .count();
                format!("{d}:{free}")
            })
            .collect();
        domains.dedup();
        let _ = writeln!(
            out,
            "{:<16} {:>9} {:<16} {:<16} {:>13} {:>19} {:>9} {}",
            h.name,
            format!("{}/{}", h.gpus_free(), h.gpus.len()),
            if models.is_empty() {
                "-".to_owned()
            } else {
                models.join("+")
            },
            if domains.is_empty() {
                "-".to_owned()
            } else {
                domains.join(",")
            },
            format!(
                "{}/{}",
                vkd_provider::quantity::format_cpu(h.cpu_millis_free),
                vkd_provider::quantity::format_cpu(h.cpu_millis_total)
            ),
            format!("{}/{}", gib(h.memory_bytes_free), gib(h.memory_bytes_total)),
            format!("{}/{}", h.pods_running, h.max_pods),
            h.rdma_domain.as_deref().unwrap_or("-"),
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, SystemTime};

    use async_trait::async_trait;
    use futures::stream::BoxStream;
    use vkd_provider::conformance::sample_spec;
    use vkd_provider::{CapacityKind, Fence, Gpu, Health, Instance, InstanceEvent, Result};

    use super::*;

    /// A backend with two hosts of 4 GPUs whose own answers never move: only
    /// vkd's reservations keep Pods apart.
    #[derive(Debug)]
    struct Fixed;

    fn host(name: &str) -> HostSlice {
        HostSlice {
            name: name.into(),
            cpu_millis_total: 32_000,
            cpu_millis_free: 32_000,
            memory_bytes_total: 256 << 30,
            memory_bytes_free: 256 << 30,
            gpus: (0..4)
                .map(|i| Gpu {
                    id: format!("{name}-gpu{i}"),
                    model: "H100 80GB".into(),
                    memory_mib: 81920,
                    nvlink_domain: Some(format!("{name}-nv")),
                    numa_node: None,
                    pcie_root: None,
                    free: true,
                })
                .collect(),
            max_pods: 110,
            ..Default::default()
        }
    }

    #[async_trait]
    impl Provider for Fixed {
        fn name(&self) -> &str {
            "fixed"
        }
        async fn health(&self) -> Health {
            Health::Healthy
        }
        async fn capacity(&self) -> Result<Capacity> {
            // A slow answer widens the window in which two admissions could race.
            tokio::time::sleep(Duration::from_millis(5)).await;
            Ok(Capacity {
                hosts: vec![host("host-a"), host("host-b")],
                kind: CapacityKind::Live,
                observed_at: SystemTime::now(),
                refresh_interval: Duration::from_secs(10),
            })
        }
        async fn admit(&self, spec: &InstanceSpec) -> Result<Admission> {
            Ok(Admission::Fits(spec.placement.clone().unwrap_or_default()))
        }
        async fn create(&self, _: &Fence, _: &InstanceSpec) -> Result<Instance> {
            Err(self.unsupported("create"))
        }
        async fn get(&self, _: &str) -> Result<Option<Instance>> {
            Ok(None)
        }
        async fn delete(&self, _: &Fence, _: &str, _: Duration) -> Result<()> {
            Ok(())
        }
        async fn list(&self, _: &str) -> Result<Vec<Instance>> {
            Ok(Vec::new())
        }
        fn events(&self) -> BoxStream<'static, InstanceEvent> {
            Box::pin(futures::stream::empty())
        }
    }

    fn four_gpus(uid: &str) -> InstanceSpec {
        let mut s = sample_spec("vk", uid);
        s.resources.gpus = 4;
        s
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn concurrent_admissions_never_share_gpus() {
        let a = Arc::new(Admitter::new(Arc::new(Fixed), None));
        let tasks: Vec<_> = (0..3)
            .map(|i| {
                let a = Arc::clone(&a);
                tokio::spawn(async move { a.admit(&four_gpus(&format!("u{i}"))).await.unwrap() })
            })
            .collect();
        let mut placed = Vec::new();
        let mut queued = 0;
        for t in tasks {
            match t.await.unwrap() {
                Admission::Fits(p) => placed.push(p),
                Admission::Queued { reason } => {
                    assert!(reason.contains("largest free slice is 0"), "{reason}");
                    queued += 1;
                }
                other => panic!("{other:?}"),
            }
        }
        assert_eq!((placed.len(), queued), (2, 1));
        assert_ne!(placed[0].host, placed[1].host, "{placed:?}");
        let mut ids: Vec<_> = placed.iter().flat_map(|p| p.gpu_ids.clone()).collect();
        ids.sort();
        ids.dedup();
        assert_eq!(ids.len(), 8, "every GPU given once");
        assert_eq!(a.held(), 2);
    }

    #[tokio::test]
    async fn reservations_hold_until_released_and_count_cpu_until_created() {
        let a = Admitter::new(Arc::new(Fixed), None);
        let mut big = four_gpus("big");
        big.resources.cpu_millis = 30_000;
        let Admission::Fits(placed) = a.admit(&big).await.unwrap() else {
            panic!("big does not fit");
        };
        // What a retried create reuses: the same host and the same GPUs.
        assert_eq!(a.held_placement("big"), Some(placed));
        assert_eq!(a.held_placement("nobody"), None);
        // host-a (tightest after the first) cannot take 4 GPUs; host-b can, but not 30 cpu twice.
        let mut cpu = sample_spec("vk", "cpu");
        cpu.resources.cpu_millis = 20_000;
        let first = match a.admit(&cpu).await.unwrap() {
            Admission::Fits(p) => p.host,
            other => panic!("{other:?}"),
        };
        a.release("cpu");
        a.created("big");
        // Once created, the backend counts big's CPU; vkd no longer does.
        let again = match a.admit(&cpu).await.unwrap() {
            Admission::Fits(p) => p.host,
            other => panic!("{other:?}"),
        };
        assert!(!first.is_empty() && !again.is_empty());
        a.release("big");
        a.release("cpu");
        assert_eq!(a.held(), 0);
        // A re-admission of the same Pod does not collide with its own reservation.
        assert!(matches!(
            a.admit(&four_gpus("x")).await.unwrap(),
            Admission::Fits(_)
        ));
        assert!(matches!(
            a.admit(&four_gpus("x")).await.unwrap(),
            Admission::Fits(_)
        ));
        assert_eq!(a.held(), 1);
    }

    #[tokio::test]
    async fn a_per_host_admitter_places_only_on_its_host() {
        let a = Admitter::new(Arc::new(Fixed), Some("host-b".into()));
        for uid in ["p1", "p2"] {
            let mut s = sample_spec("vk", uid);
            s.resources.gpus = 2;
            match a.admit(&s).await.unwrap() {
                Admission::Fits(p) => assert_eq!(p.host, "host-b"),
                other => panic!("{other:?}"),
            }
        }
        let mut s = sample_spec("vk", "p3");
        s.resources.gpus = 1;
        assert!(matches!(
            a.admit(&s).await.unwrap(),
            Admission::Queued { .. }
        ));
    }

    #[test]
    fn metadata_describes_the_largest_fit() {
        let cap = Capacity {
            hosts: vec![host("host-a"), host("host-b")],
            kind: CapacityKind::Quota,
            observed_at: SystemTime::now(),
            refresh_interval: Duration::from_secs(10),
        };
        let (labels, ann) = node_metadata(&cap, false);
        assert_eq!(labels["vkd.io/gpu.max-per-pod"], "4");
        assert_eq!(labels["vkd.io/gpu.model"], "H100-80GB");
        assert_eq!(labels["vkd.io/gpu.memory-mib"], "81920");
        assert_eq!(ann["vkd.io/capacity-kind"], "quota");
        assert!(
            !labels.contains_key("nvidia.com/gpu.count"),
            "GPU Feature Discovery's labels describe one machine, not a sum"
        );
        assert!(ann["vkd.io/slices"].starts_with("host-a gpu 4/4"));
        let (labels, _) = node_metadata(
            &Capacity {
                hosts: vec![host("host-b")],
                ..cap
            },
            true,
        );
        assert_eq!(labels["vkd.io/host"], "host-b");
        assert_eq!(labels["vkd.io/nvlink-domains"], "host-b-nv");
        assert_eq!(labels["nvidia.com/gpu.product"], "H100-80GB");
        assert_eq!(labels["nvidia.com/gpu.memory"], "81920");
        assert_eq!(labels["nvidia.com/gpu.count"], "4");
        assert_eq!(labels["nvidia.com/gpu.clique"], "host-b-nv");
        assert_eq!(node_suffix("Host_A.rack1"), "host-a-rack1");
    }
}
