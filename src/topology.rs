//! Placement with reservation, and what a Node says about its capacity.
//!
//! [`Admitter`] decides where a Pod goes from the provider's host slices (one
//! host, GPUs in one NVLink domain when asked), minus what it has already
//! promised to Pods that are admitted but not yet running. It takes one Pod at a
//! time, so two concurrent 4-GPU Pods can never be given the same 4 free GPUs;
//! the provider is told the GPUs to use and may still refuse.
//!
//! The slices are asked of the provider once per its refresh interval, not for
//! every decision: a burst of Pods is decided on one [`Snapshot`]. What the
//! snapshot cannot show yet is what vkd did after asking for it, and that is
//! exactly what the reservations hold: a Pod created after the snapshot was
//! asked for keeps counting its CPU and memory, and one released after it
//! (running now, or ended) stays a ghost until a newer snapshot shows the
//! backend's own figures. A decision that does not fit on a snapshot from
//! before this call is made again on a fresh one, so a Pod is queued or
//! refused only on what the backend says now.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use vkd_provider::topology::decide;
use vkd_provider::{
    Admission, Capacity, HostSlice, InstanceSpec, Placement, Provider, ProviderError, Support,
};

/// The longest a snapshot of the slices is decided on, whatever the provider's
/// refresh interval says.
const SNAPSHOT_MAX_AGE: Duration = Duration::from_secs(30);

/// What admission promised one Pod. The ticks are [`Book::asked`] at the moment.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Reservation {
    host: String,
    gpu_ids: Vec<String>,
    cpu_millis: u64,
    memory_bytes: u64,
    /// The backend has the instance (and counts its CPU and memory itself,
    /// in snapshots asked for after this tick).
    created: Option<u64>,
    /// The Pod no longer holds it (running or ended): kept only until a
    /// snapshot asked for after this tick shows the backend's own figures.
    released: Option<u64>,
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
            created: self.created.is_some(),
        }
    }

    /// Whether a snapshot asked for at tick `asked` may lack what this holds.
    fn unseen_by(&self, asked: u64) -> bool {
        self.released.is_none_or(|t| t >= asked)
    }

    /// Whether the backend's CPU and memory figures at tick `asked` leave this out.
    fn uncounted_by(&self, asked: u64) -> bool {
        self.created.is_none_or(|t| t >= asked)
    }

    /// Takes what it holds from `free`, the slices of `snapshot`: its GPUs,
    /// and its CPU, memory and Pod while the snapshot does not count them.
    fn take_from(&self, free: &mut [HostSlice], snapshot: &Snapshot) {
        let Some(h) = snapshot
            .index
            .get(&self.host)
            .and_then(|&i| free.get_mut(i))
        else {
            return;
        };
        h.hold(&self.gpu_ids);
        if self.uncounted_by(snapshot.asked) {
            h.cpu_millis_free = h.cpu_millis_free.saturating_sub(self.cpu_millis);
            h.memory_bytes_free = h.memory_bytes_free.saturating_sub(self.memory_bytes);
            h.pods_running = h.pods_running.saturating_add(1);
        }
    }
}

/// The provider's slices as asked for at one tick.
#[derive(Debug)]
struct Snapshot {
    /// Whether the provider has host slices at all (a backend without them decides alone).
    sliced: bool,
    /// The hosts this Admitter places on, as the provider reported them, and with everything free.
    free: Vec<HostSlice>,
    total: Vec<HostSlice>,
    /// Each host's place in `free`, for the reservations counted on every decision.
    index: HashMap<String, usize>,
    asked: u64,
    at: Instant,
    max_age: Duration,
}

/// Reservations and the snapshot they are counted against, under one lock so
/// that every change is stamped in order with the snapshots.
#[derive(Debug, Default)]
struct Book {
    /// Bumped each time the provider is asked for its slices.
    asked: u64,
    reserved: HashMap<String, Reservation>,
    snapshot: Option<Arc<Snapshot>>,
    /// The slices of snapshot `.0` less every reservation: what the next Pod
    /// without one of its own may use. Kept up to date as Pods are placed, so
    /// a storm's decisions do not each walk thousands of reservations; dropped
    /// when one is removed (made again at the next decision).
    free: Option<(u64, Vec<HostSlice>)>,
}

#[derive(Debug)]
pub struct Admitter {
    provider: Arc<dyn Provider>,
    /// Per-host nodes place only on their own host.
    host: Option<String>,
    turn: tokio::sync::Mutex<()>,
    book: Mutex<Book>,
}

impl Admitter {
    pub fn new(provider: Arc<dyn Provider>, host: Option<String>) -> Self {
        Self {
            provider,
            host,
            turn: tokio::sync::Mutex::new(()),
            book: Mutex::default(),
        }
    }

    fn book(&self) -> MutexGuard<'_, Book> {
        self.book.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The slices to decide on: the snapshot while it is younger than the
    /// provider's refresh interval, unless `fresh`; else asked for now.
    /// Returns whether it was asked for in this call.
    async fn snapshot(&self, fresh: bool) -> Result<(Arc<Snapshot>, bool), ProviderError> {
        let asked = {
            let mut book = self.book();
            if !fresh
                && let Some(s) = &book.snapshot
                && s.at.elapsed() < s.max_age
            {
                return Ok((Arc::clone(s), false));
            }
            book.asked += 1;
            book.asked
        };
        let cap = self.provider.capacity().await?;
        let free: Vec<HostSlice> = cap
            .hosts
            .iter()
            .filter(|h| self.host.as_ref().is_none_or(|mine| *mine == h.name))
            .cloned()
            .collect();
        let snapshot = Arc::new(Snapshot {
            sliced: !cap.hosts.is_empty(),
            total: free.iter().map(HostSlice::whole).collect(),
            index: free
                .iter()
                .enumerate()
                .map(|(i, h)| (h.name.clone(), i))
                .collect(),
            free,
            asked,
            at: Instant::now(),
            max_age: cap.refresh_interval.min(SNAPSHOT_MAX_AGE),
        });
        let mut book = self.book();
        if book.snapshot.as_ref().is_none_or(|s| s.asked < asked) {
            book.snapshot = Some(Arc::clone(&snapshot));
            // Ghosts released before this snapshot was asked for are in its figures.
            book.reserved.retain(|_, r| r.unseen_by(asked));
            book.free = None;
        }
        Ok((snapshot, true))
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
        // A placement the spec brings (a DRA allocation) is already on this
        // node's host: the Pod's claims were checked against its pools.
        if let Some(h) = &self.host
            && spec.placement.is_none()
        {
            spec.placement = Some(Placement {
                host: h.clone(),
                gpu_ids: Vec::new(),
            });
        }
        // A backend with its own queue (an HPC scheduler) places and queues
        // Pods itself: its admission alone says whether a Pod can ever run.
        if self.provider.capabilities().backend_queue == Support::Supported {
            return Ok((self.provider.admit(&spec).await?, String::new()));
        }
        let (mut snapshot, mut fresh) = self.snapshot(false).await?;
        loop {
            if !snapshot.sliced {
                // A backend without host slices decides alone.
                return Ok((self.provider.admit(&spec).await?, String::new()));
            }
            let free = self.free(&snapshot, uid);
            let seen = seen_slices(&free);
            let answer = match decide(&snapshot.total, &free, &spec) {
                Admission::Fits(placement) => {
                    let mut placed = spec.clone();
                    placed.placement = Some(placement);
                    self.provider.admit(&placed).await?
                }
                other => other,
            };
            if let Admission::Fits(p) = &answer {
                let r = Reservation {
                    host: p.host.clone(),
                    gpu_ids: p.gpu_ids.clone(),
                    cpu_millis: spec.resources.cpu_millis,
                    memory_bytes: spec.resources.memory_bytes,
                    created: None,
                    released: None,
                };
                let mut book = self.book();
                if let Some((asked, free)) = book.free.as_mut()
                    && *asked == snapshot.asked
                {
                    r.take_from(free, &snapshot);
                }
                if book.reserved.insert(uid.to_owned(), r).is_some() {
                    // It replaced one the kept slices had taken.
                    book.free = None;
                }
                return Ok((answer, seen));
            }
            if fresh {
                return Ok((answer, seen));
            }
            // Queued or refused on what the backend says now, never on an old snapshot.
            (snapshot, fresh) = self.snapshot(true).await?;
        }
    }

    /// The hosts this Admitter places on, each as it is with nothing running
    /// (what a DRA allocation is read against).
    pub async fn hosts(&self) -> Result<Vec<HostSlice>, ProviderError> {
        Ok(self.snapshot(false).await?.0.total.clone())
    }

    /// What admission holds for one Pod (`pod`: its `namespace/name`).
    pub fn reservation(&self, uid: &str, pod: &str) -> Option<crate::explain::Reservation> {
        self.book()
            .reserved
            .get(uid)
            .filter(|r| r.released.is_none())
            .map(|r| r.explained(uid, pod))
    }

    /// Every reservation held, oldest Pod name first; `pod_of` names a UID's Pod.
    pub fn reservations(
        &self,
        pod_of: impl Fn(&str) -> Option<String>,
    ) -> Vec<crate::explain::Reservation> {
        let mut out: Vec<_> = self
            .book()
            .reserved
            .iter()
            .filter(|(_, r)| r.released.is_none())
            .map(|(uid, r)| r.explained(uid, &pod_of(uid).unwrap_or_else(|| "(no Pod)".into())))
            .collect();
        out.sort_by(|a, b| a.pod.cmp(&b.pod));
        out
    }

    /// The snapshot's hosts less what other Pods hold that it cannot show.
    fn free(&self, snapshot: &Snapshot, uid: &str) -> Vec<HostSlice> {
        let mut book = self.book();
        let own = book.reserved.contains_key(uid);
        if !own
            && let Some((asked, free)) = &book.free
            && *asked == snapshot.asked
        {
            return free.clone();
        }
        let mut free = snapshot.free.clone();
        for (owner, r) in &book.reserved {
            if r.unseen_by(snapshot.asked) && owner != uid {
                r.take_from(&mut free, snapshot);
            }
        }
        if !own {
            book.free = Some((snapshot.asked, free.clone()));
        }
        free
    }

    /// The backend created the instance: it counts CPU and memory in the
    /// slices it reports from now on; the GPUs stay held until the instance
    /// runs or ends.
    pub fn created(&self, uid: &str) {
        let mut book = self.book();
        let now = book.asked;
        if let Some(r) = book.reserved.get_mut(uid)
            && r.created.is_none()
        {
            r.created = Some(now);
        }
    }

    /// Where a Pod's held reservation places it, if it holds one.
    pub fn held_placement(&self, uid: &str) -> Option<Placement> {
        self.book()
            .reserved
            .get(uid)
            .filter(|r| r.released.is_none())
            .map(|r| Placement {
                host: r.host.clone(),
                gpu_ids: r.gpu_ids.clone(),
            })
    }

    /// The instance runs, ended, or will not be made: nothing more to hold.
    /// What the backend made is still counted until a snapshot shows it.
    pub fn release(&self, uid: &str) {
        let mut book = self.book();
        let now = book.asked;
        let seen_by = book.snapshot.as_ref().map_or(0, |s| s.asked);
        let Some(r) = book.reserved.get_mut(uid) else {
            return;
        };
        if r.released.is_some() {
            return;
        }
        match r.created {
            // Never made, or already in the snapshot's figures and holding no GPUs.
            None => {
                book.reserved.remove(uid);
                book.free = None;
            }
            Some(t) if t < seen_by && r.gpu_ids.is_empty() => {
                book.reserved.remove(uid);
                book.free = None;
            }
            // Still unseen by every snapshot up to now: it holds as it did.
            Some(_) => r.released = Some(now),
        }
    }

    /// The backend refused a create admission placed: its figures moved in a
    /// way vkd did not cause (another tenant, a host going away), so the
    /// next decision reads them afresh.
    pub fn refused(&self, uid: &str) {
        self.release(uid);
        self.book().snapshot = None;
    }

    /// How many Pods hold a reservation now.
    pub fn held(&self) -> usize {
        self.book()
            .reserved
            .values()
            .filter(|r| r.released.is_none())
            .count()
    }

    /// The cpu and memory the Node reports as allocatable (its host, in
    /// per-host mode): what a downward-API read of an unset limit gives.
    pub async fn allocatable(&self) -> Result<crate::pods::spec::Allocatable, ProviderError> {
        let (snapshot, _) = self.snapshot(false).await?;
        Ok(allocatable(&snapshot.total))
    }
}

/// The free slices admission decided on, for a person: the hosts with the
/// most free GPUs first, at most [`SEEN_HOSTS`] of them.
fn seen_slices(free: &[HostSlice]) -> String {
    let mut hosts: Vec<&HostSlice> = free.iter().collect();
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
                    ..Default::default()
                })
                .collect(),
            max_pods: 110,
            ..Default::default()
        }
    }

    fn four_gpus(uid: &str) -> InstanceSpec {
        let mut s = sample_spec("vk", uid);
        s.resources.gpus = 4;
        s
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn concurrent_admissions_never_share_gpus() {
        let a = Arc::new(Admitter::new(Backend::fixed(), None));
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
        let a = Admitter::new(Backend::fixed(), None);
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

    /// The slices kept less every reservation are, after any mix of
    /// placements, creates and releases, what a walk over the reservations
    /// gives.
    #[tokio::test]
    async fn the_kept_free_slices_match_a_walk_over_every_reservation() {
        let a = Admitter::new(Backend::fixed(), None);
        let walked = |a: &Admitter| {
            let book = a.book();
            let snapshot = Arc::clone(book.snapshot.as_ref().unwrap());
            let mut free = snapshot.free.clone();
            for r in book.reserved.values() {
                if r.unseen_by(snapshot.asked) {
                    r.take_from(&mut free, &snapshot);
                }
            }
            (snapshot, free)
        };
        for i in 0..12u32 {
            let uid = format!("p{i}");
            let mut spec = pod(&uid, 500 + u64::from(i) * 100, i % 3);
            spec.resources.memory_bytes = 1 << 30;
            assert!(matches!(a.admit(&spec).await.unwrap(), Admission::Fits(_)));
            match i % 4 {
                0 => a.release(&uid),
                1 => a.created(&uid),
                2 => {
                    a.created(&uid);
                    a.release(&uid);
                }
                _ => {}
            }
            let (snapshot, expected) = walked(&a);
            assert_eq!(a.free(&snapshot, "nobody"), expected, "after {uid}");
        }
    }

    #[tokio::test]
    async fn a_per_host_admitter_places_only_on_its_host() {
        let a = Admitter::new(Backend::fixed(), Some("host-b".into()));
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

    /// A backend of hosts with 4 GPUs and 32 cpu. [`Backend::fixed`]'s answers
    /// never move (only vkd's reservations keep Pods apart);
    /// [`Backend::tracking`]'s count the instances it was given, as a real
    /// one's do once it has them.
    #[derive(Debug, Default)]
    struct Backend {
        hosts: Vec<&'static str>,
        counting: bool,
        made: Mutex<HashMap<String, (Vec<String>, u64)>>,
        asked: std::sync::atomic::AtomicUsize,
    }

    impl Backend {
        /// Two hosts, `host-a` and `host-b`, always wholly free.
        fn fixed() -> Arc<Self> {
            Arc::new(Self {
                hosts: vec!["host-a", "host-b"],
                ..Self::default()
            })
        }
        /// One host, `h`, less what it was given.
        fn tracking() -> Arc<Self> {
            Arc::new(Self {
                hosts: vec!["h"],
                counting: true,
                ..Self::default()
            })
        }
        fn asked(&self) -> usize {
            self.asked.load(std::sync::atomic::Ordering::SeqCst)
        }
        fn ended(&self, uid: &str) {
            self.made.lock().unwrap().remove(uid);
        }
    }

    #[async_trait]
    impl Provider for Backend {
        fn name(&self) -> &str {
            "test"
        }
        async fn health(&self) -> Health {
            Health::Healthy
        }
        async fn capacity(&self) -> Result<Capacity> {
            self.asked.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            // A slow answer widens the window in which two admissions could race.
            tokio::time::sleep(Duration::from_millis(5)).await;
            let mut hosts: Vec<HostSlice> = self.hosts.iter().map(|n| host(n)).collect();
            if self.counting {
                for (gpus, cpu) in self.made.lock().unwrap().values() {
                    let h = &mut hosts[0];
                    h.cpu_millis_free -= cpu;
                    h.pods_running += 1;
                    for g in h.gpus.iter_mut().filter(|g| gpus.contains(&g.id)) {
                        g.free = false;
                    }
                }
            }
            Ok(Capacity {
                hosts,
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

    /// Admits `spec`; when it fits, the backend makes it and it runs, as the
    /// controller's create and first status do.
    async fn start(a: &Admitter, backend: &Backend, spec: &InstanceSpec) -> bool {
        let Admission::Fits(p) = a.admit(spec).await.unwrap() else {
            return false;
        };
        backend.made.lock().unwrap().insert(
            spec.pod.uid.clone(),
            (p.gpu_ids.clone(), spec.resources.cpu_millis),
        );
        a.created(&spec.pod.uid);
        a.release(&spec.pod.uid);
        true
    }

    fn pod(uid: &str, cpu_millis: u64, gpus: u32) -> InstanceSpec {
        let mut s = sample_spec("vk", uid);
        s.resources.cpu_millis = cpu_millis;
        s.resources.memory_bytes = 0;
        s.resources.gpus = gpus;
        s
    }

    #[tokio::test]
    async fn a_burst_is_decided_on_one_snapshot_of_the_slices() {
        let backend = Backend::tracking();
        let a = Admitter::new(Arc::clone(&backend) as Arc<dyn Provider>, None);
        for i in 0..30 {
            assert!(start(&a, &backend, &pod(&format!("p{i}"), 1000, 0)).await);
        }
        assert_eq!(backend.asked(), 1, "one capacity read for 30 decisions");
        // The 33rd cpu does not exist: the snapshot (32 free) would take it,
        // what vkd made since (30) does not, and a fresh read confirms.
        assert!(start(&a, &backend, &pod("p30", 2000, 0)).await);
        assert!(!start(&a, &backend, &pod("p31", 1000, 0)).await);
        assert_eq!(backend.asked(), 2, "the refusal was read again, once");
        assert_eq!(a.held(), 0);
    }

    #[tokio::test]
    async fn gpus_given_since_the_snapshot_are_never_given_twice_and_an_ended_pods_come_back_at_once()
     {
        let backend = Backend::tracking();
        let a = Admitter::new(Arc::clone(&backend) as Arc<dyn Provider>, None);
        for i in 0..4 {
            assert!(start(&a, &backend, &pod(&format!("g{i}"), 0, 1)).await);
        }
        assert_eq!(backend.asked(), 1);
        // Running now, released, and still not in the snapshot: not free.
        match a.admit(&pod("g4", 0, 1)).await.unwrap() {
            Admission::Queued { reason } => {
                assert!(reason.contains("largest free slice is 0"), "{reason}")
            }
            other => panic!("a GPU was given twice: {other:?}"),
        }
        // One ends: its GPU is given again without waiting for the interval.
        let freed = backend.made.lock().unwrap()["g2"].0.clone();
        backend.ended("g2");
        let Admission::Fits(p) = a.admit(&pod("g5", 0, 1)).await.unwrap() else {
            panic!("the ended Pod's GPU was not given again");
        };
        assert_eq!(p.gpu_ids, freed);
    }

    #[tokio::test]
    async fn a_create_the_backend_refused_is_placed_again_on_a_fresh_read() {
        let backend = Backend::tracking();
        let a = Admitter::new(Arc::clone(&backend) as Arc<dyn Provider>, None);
        assert!(start(&a, &backend, &pod("mine", 0, 1)).await);
        // Another tenant takes the other three, which the snapshot cannot show.
        let taken = backend.made.lock().unwrap()["mine"].0.clone();
        let rest: Vec<String> = (0..4)
            .map(|i| format!("h-gpu{i}"))
            .filter(|g| !taken.contains(g))
            .collect();
        backend
            .made
            .lock()
            .unwrap()
            .insert("theirs".into(), (rest, 0));
        assert!(matches!(
            a.admit(&pod("next", 0, 1)).await.unwrap(),
            Admission::Fits(_)
        ));
        // The backend's create says no: the next try reads the slices again.
        a.refused("next");
        assert!(matches!(
            a.admit(&pod("next", 0, 1)).await.unwrap(),
            Admission::Queued { .. }
        ));
        assert_eq!(backend.asked(), 2);
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
