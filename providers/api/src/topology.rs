//! Does a Pod fit on one host slice? Never on a sum of hosts: two hosts with 4
//! free GPUs each are not a place for an 8-GPU Pod.
//!
//! vkd decides placement with this before it calls a provider (and reserves what
//! it chose); providers may use it to check a placement they are given.

use std::collections::BTreeMap;

use crate::{Admission, HostSlice, InstanceSpec, Placement, quantity};

/// Pod annotation: `nvlink` asks for all of the Pod's GPUs in one NVLink domain.
pub const GPU_TOPOLOGY_ANNOTATION: &str = "vkd.io/gpu-topology";

/// What a Pod needs from one host.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Request {
    pub cpu_millis: u64,
    pub memory_bytes: u64,
    pub gpus: usize,
    pub same_nvlink: bool,
}

impl Request {
    pub fn of(spec: &InstanceSpec) -> Self {
        Self {
            cpu_millis: spec.resources.cpu_millis,
            memory_bytes: spec.resources.memory_bytes,
            gpus: spec.resources.gpus as usize,
            same_nvlink: spec
                .annotations
                .get(GPU_TOPOLOGY_ANNOTATION)
                .is_some_and(|v| v == "nvlink"),
        }
    }
}

fn gpu_summary(hosts: &[&HostSlice], free: bool) -> String {
    hosts
        .iter()
        .map(|h| {
            let n = if free { h.gpus_free() } else { h.gpus.len() };
            format!("{} {n}", h.name)
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// GPU groups that may serve a same-NVLink request: one per domain; a GPU with
/// no domain is a group of its own.
fn nvlink_groups(h: &HostSlice, free_only: bool) -> BTreeMap<String, Vec<&str>> {
    let mut groups: BTreeMap<String, Vec<&str>> = BTreeMap::new();
    for g in h.gpus.iter().filter(|g| !free_only || g.free) {
        let key = match &g.nvlink_domain {
            Some(d) => format!("{}/{d}", h.name),
            None => format!("{}/{}", h.name, g.id),
        };
        groups.entry(key).or_default().push(&g.id);
    }
    groups
}

fn domain_summary(hosts: &[&HostSlice], free: bool) -> (usize, String) {
    let mut largest = 0;
    let mut parts = Vec::new();
    for h in hosts {
        for (k, v) in nvlink_groups(h, free) {
            largest = largest.max(v.len());
            parts.push(format!("{k} {}", v.len()));
        }
    }
    (largest, parts.join(", "))
}

fn gib(bytes: u64) -> String {
    format!("{:.1}Gi", bytes as f64 / f64::from(1u32 << 30))
}

/// Places `spec` on one of `free` (the hosts as they are now); `total` is the
/// same hosts with everything free, to tell "never" from "not now". A placement
/// already in the spec (per-host nodes, or a check of vkd's choice) limits the
/// choice to that host and, when it names GPUs, to those GPUs.
pub fn decide(total: &[HostSlice], free: &[HostSlice], spec: &InstanceSpec) -> Admission {
    let r = Request::of(spec);
    let wanted = spec.placement.as_ref();
    let only = |h: &&HostSlice| wanted.is_none_or(|p| p.host == h.name);
    let total: Vec<&HostSlice> = total.iter().filter(only).collect();
    let free: Vec<&HostSlice> = free.iter().filter(only).collect();
    if let Some(p) = wanted.filter(|p| !p.gpu_ids.is_empty()) {
        return decide_exact(total.first().copied(), free.first().copied(), &r, p);
    }
    let gpus = r.gpus;
    let fleet_gpus: usize = total.iter().map(|h| h.gpus.len()).sum();
    if gpus > fleet_gpus {
        return Admission::Rejected {
            reason: "OutOfnvidia.com/gpu".into(),
            message: format!(
                "needs {gpus} nvidia.com/gpu; {} has {fleet_gpus} ({})",
                if wanted.is_some() {
                    "this host"
                } else {
                    "the whole fleet"
                },
                gpu_summary(&total, false)
            ),
        };
    }
    let gpus_ever = |h: &HostSlice| {
        if r.same_nvlink {
            nvlink_groups(h, false).values().any(|g| g.len() >= gpus)
        } else {
            h.gpus.len() >= gpus
        }
    };
    let could_ever = |h: &&HostSlice| {
        h.cpu_millis_total >= r.cpu_millis && h.memory_bytes_total >= r.memory_bytes && gpus_ever(h)
    };
    if !total.iter().any(could_ever) {
        let message = if r.same_nvlink && gpus > 0 && !total.iter().any(|h| gpus_ever(h)) {
            let (largest, parts) = domain_summary(&total, false);
            format!(
                "needs {gpus} nvidia.com/gpu in one NVLink domain; largest domain is {largest}: {parts}"
            )
        } else if !total.iter().any(|h| h.gpus.len() >= gpus) {
            format!(
                "needs {gpus} nvidia.com/gpu on one host; largest slice is {}: {}",
                total.iter().map(|h| h.gpus.len()).max().unwrap_or(0),
                gpu_summary(&total, false)
            )
        } else {
            let cpu = total.iter().map(|h| h.cpu_millis_total).max().unwrap_or(0);
            let mem = total
                .iter()
                .map(|h| h.memory_bytes_total)
                .max()
                .unwrap_or(0);
            format!(
                "needs {} cpu, {} memory and {gpus} nvidia.com/gpu on one host; the largest host has {} cpu and {} memory",
                quantity::format_cpu(r.cpu_millis),
                gib(r.memory_bytes),
                quantity::format_cpu(cpu),
                gib(mem)
            )
        };
        return Admission::Rejected {
            reason: "TopologyUnsatisfiable".into(),
            message,
        };
    }
    let pick = |h: &HostSlice| pick_gpus(h, gpus, r.same_nvlink);
    let fits_now = |h: &&&HostSlice| {
        h.pods_running < h.max_pods
            && h.cpu_millis_free >= r.cpu_millis
            && h.memory_bytes_free >= r.memory_bytes
            && pick(h).is_some()
    };
    // GPU Pods take the tightest host that fits (leaving big slices whole);
    // others take the host with most free CPU, GPU hosts last.
    let best = free.iter().filter(fits_now).min_by_key(|h| {
        if gpus > 0 {
            (h.gpus_free() as u64, u64::MAX - h.cpu_millis_free)
        } else {
            (h.gpus.len() as u64, u64::MAX - h.cpu_millis_free)
        }
    });
    match best {
        Some(h) => Admission::Fits(Placement {
            host: h.name.clone(),
            gpu_ids: pick(h).unwrap_or_default(),
        }),
        None => Admission::Queued {
            reason: if gpus > 0 && r.same_nvlink {
                let (largest, parts) = domain_summary(&free, true);
                format!(
                    "waiting for {gpus} free nvidia.com/gpu in one NVLink domain; largest free is {largest}: {parts}"
                )
            } else if gpus > 0 && free.iter().any(|h| pick(h).is_some()) {
                // The GPUs are free; the host that has them lacks CPU, memory or room.
                format!(
                    "waiting for {} cpu and {} memory free on a host with {gpus} free nvidia.com/gpu; {}",
                    quantity::format_cpu(r.cpu_millis),
                    gib(r.memory_bytes),
                    free.iter()
                        .filter(|h| pick(h).is_some())
                        .map(|h| format!(
                            "{} has {} cpu, {} memory, {} Pods free",
                            h.name,
                            quantity::format_cpu(h.cpu_millis_free),
                            gib(h.memory_bytes_free),
                            h.max_pods.saturating_sub(h.pods_running)
                        ))
                        .collect::<Vec<_>>()
                        .join(", ")
                )
            } else if gpus > 0 {
                format!(
                    "waiting for {gpus} free nvidia.com/gpu on one host; largest free slice is {}: {}",
                    free.iter().map(|h| h.gpus_free()).max().unwrap_or(0),
                    gpu_summary(&free, true)
                )
            } else {
                format!(
                    "waiting for a host with {} cpu and {} memory free",
                    quantity::format_cpu(r.cpu_millis),
                    gib(r.memory_bytes)
                )
            },
        },
    }
}

/// A placement that names its GPUs (or partitions): the scheduler's DRA
/// allocation, or vkd's own earlier choice. Checked, never replaced: `Fits`
/// exactly it, `Queued` while some of it is held, `Rejected` when it could
/// never run here.
fn decide_exact(
    total: Option<&HostSlice>,
    free: Option<&HostSlice>,
    r: &Request,
    p: &Placement,
) -> Admission {
    let never = |message: String| Admission::Rejected {
        reason: "TopologyUnsatisfiable".into(),
        message,
    };
    let ids = p.gpu_ids.join(", ");
    let Some(whole) = total else {
        return never(format!("no host {} for GPUs {ids}", p.host));
    };
    let known = |id: &String| {
        whole
            .gpus
            .iter()
            .any(|g| g.id == *id || g.partitions.iter().any(|q| q.id == *id))
    };
    if let Some(unknown) = p.gpu_ids.iter().find(|id| !known(id)) {
        return never(format!("host {} has no GPU or partition {unknown}", p.host));
    }
    if p.gpu_ids.len() != r.gpus {
        return never(format!(
            "the placement names {} GPUs ({ids}) for a Pod of {} nvidia.com/gpu",
            p.gpu_ids.len(),
            r.gpus
        ));
    }
    if !whole.can_hold(&p.gpu_ids) {
        return never(format!(
            "GPUs {ids} cannot be held together on host {}: a GPU is given whole or as partitions, and its partitions fit in its compute slices and memory",
            p.host
        ));
    }
    if r.same_nvlink {
        let domains: std::collections::BTreeSet<&str> = whole
            .gpus
            .iter()
            .filter(|g| p.gpu_ids.contains(&g.id))
            .map(|g| g.nvlink_domain.as_deref().unwrap_or(&g.id))
            .collect();
        if domains.len() > 1 || whole.gpus.iter().all(|g| !p.gpu_ids.contains(&g.id)) {
            return never(format!(
                "needs its GPUs in one NVLink domain; {ids} on host {} are in {}",
                p.host,
                if domains.is_empty() {
                    "none (partitions)".to_owned()
                } else {
                    domains.into_iter().collect::<Vec<_>>().join(", ")
                }
            ));
        }
    }
    if whole.cpu_millis_total < r.cpu_millis || whole.memory_bytes_total < r.memory_bytes {
        return never(format!(
            "needs {} cpu and {} memory; host {} has {} cpu and {} memory",
            quantity::format_cpu(r.cpu_millis),
            gib(r.memory_bytes),
            p.host,
            quantity::format_cpu(whole.cpu_millis_total),
            gib(whole.memory_bytes_total)
        ));
    }
    let Some(h) = free else {
        return Admission::Queued {
            reason: format!("waiting for host {} to report its capacity", p.host),
        };
    };
    if !h.can_hold(&p.gpu_ids) {
        let held: Vec<&str> = p
            .gpu_ids
            .iter()
            .filter(|id| !h.can_hold(std::slice::from_ref(*id)))
            .map(String::as_str)
            .collect();
        return Admission::Queued {
            reason: format!(
                "waiting for {} on host {} to be free (held by running Pods)",
                if held.is_empty() {
                    ids.clone()
                } else {
                    held.join(", ")
                },
                p.host
            ),
        };
    }
    if h.pods_running >= h.max_pods
        || h.cpu_millis_free < r.cpu_millis
        || h.memory_bytes_free < r.memory_bytes
    {
        return Admission::Queued {
            reason: format!(
                "waiting for {} cpu and {} memory free on host {}, which has GPUs {ids} free; it has {} cpu, {} memory, {} Pods free",
                quantity::format_cpu(r.cpu_millis),
                gib(r.memory_bytes),
                p.host,
                quantity::format_cpu(h.cpu_millis_free),
                gib(h.memory_bytes_free),
                h.max_pods.saturating_sub(h.pods_running)
            ),
        };
    }
    Admission::Fits(p.clone())
}

/// `n` free GPUs of one host: from one NVLink domain when one has enough (required
/// with `same_nvlink`), otherwise any.
fn pick_gpus(h: &HostSlice, n: usize, same_nvlink: bool) -> Option<Vec<String>> {
    if n == 0 {
        return Some(Vec::new());
    }
    let groups = nvlink_groups(h, true);
    // The smallest domain that is big enough, so large domains stay whole.
    let inside = groups
        .values()
        .filter(|g| g.len() >= n)
        .min_by_key(|g| g.len());
    if let Some(g) = inside {
        return Some(g.iter().take(n).map(|s| (*s).to_owned()).collect());
    }
    if same_nvlink || h.gpus_free() < n {
        return None;
    }
    Some(
        h.gpus
            .iter()
            .filter(|g| g.free)
            .take(n)
            .map(|g| g.id.clone())
            .collect(),
    )
}

/// `host-a gpu 4/4 H100 cpu 30/32 mem 200Gi/256Gi pods 1/110` (free/total), one
/// host per `; `-separated part: the Node's compact summary.
pub fn summary(hosts: &[HostSlice]) -> String {
    hosts
        .iter()
        .map(|h| {
            let mut models: Vec<&str> = h.gpus.iter().map(|g| g.model.as_str()).collect();
            models.sort_unstable();
            models.dedup();
            let gpu = if h.gpus.is_empty() {
                String::new()
            } else {
                format!(
                    " gpu {}/{} {}",
                    h.gpus_free(),
                    h.gpus.len(),
                    models.join("+")
                )
            };
            format!(
                "{}{gpu} cpu {}/{} mem {}/{} pods {}/{}",
                h.name,
                quantity::format_cpu(h.cpu_millis_free),
                quantity::format_cpu(h.cpu_millis_total),
                gib(h.memory_bytes_free),
                gib(h.memory_bytes_total),
                h.max_pods.saturating_sub(h.pods_running),
                h.max_pods
            )
        })
        .collect::<Vec<_>>()
        .join("; ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Gpu;
    use crate::conformance::sample_spec;

    fn host(name: &str, domains: &[(&str, usize)]) -> HostSlice {
        let mut gpus = Vec::new();
        for (d, n) in domains {
            for _ in 0..*n {
                gpus.push(Gpu {
                    id: format!("{name}-gpu{}", gpus.len()),
                    model: "H100".into(),
                    memory_mib: 81920,
                    nvlink_domain: (!d.is_empty()).then(|| (*d).to_owned()),
                    numa_node: None,
                    pcie_root: None,
                    free: true,
                    ..Default::default()
                });
            }
        }
        HostSlice {
            name: name.into(),
            cpu_millis_total: 32_000,
            cpu_millis_free: 32_000,
            memory_bytes_total: 256 << 30,
            memory_bytes_free: 256 << 30,
            gpus,
            max_pods: 110,
            ..Default::default()
        }
    }

    fn two_by_four() -> Vec<HostSlice> {
        vec![host("host-a", &[("nv0", 4)]), host("host-b", &[("nv1", 4)])]
    }

    fn wants(gpus: u32) -> InstanceSpec {
        let mut s = sample_spec("n", "u");
        s.resources.gpus = gpus;
        s
    }

    fn nvlink(gpus: u32) -> InstanceSpec {
        let mut s = wants(gpus);
        s.annotations
            .insert(GPU_TOPOLOGY_ANNOTATION.into(), "nvlink".into());
        s
    }

    #[test]
    fn eight_gpus_never_fit_two_hosts_of_four() {
        let hosts = two_by_four();
        match decide(&hosts, &hosts, &wants(8)) {
            Admission::Rejected { reason, message } => {
                assert_eq!(reason, "TopologyUnsatisfiable");
                assert_eq!(
                    message,
                    "needs 8 nvidia.com/gpu on one host; largest slice is 4: host-a 4, host-b 4"
                );
            }
            other => panic!("{other:?}"),
        }
        match decide(&hosts, &hosts, &wants(9)) {
            Admission::Rejected { reason, .. } => assert_eq!(reason, "OutOfnvidia.com/gpu"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn busy_hosts_queue_and_name_the_free_slices() {
        let total = two_by_four();
        let mut free = total.clone();
        free[0].gpus[0].free = false;
        free[1].gpus[0].free = false;
        match decide(&total, &free, &wants(4)) {
            Admission::Queued { reason } => assert!(
                reason.contains("largest free slice is 3: host-a 3, host-b 3"),
                "{reason}"
            ),
            other => panic!("{other:?}"),
        }
        match decide(&total, &free, &wants(3)) {
            Admission::Fits(p) => assert_eq!(p.gpu_ids.len(), 3),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn gpu_pods_take_the_tightest_host() {
        let total = two_by_four();
        let mut free = total.clone();
        free[1].gpus[0].free = false;
        match decide(&total, &free, &wants(2)) {
            Admission::Fits(p) => {
                assert_eq!(p.host, "host-b");
                assert_eq!(p.gpu_ids, ["host-b-gpu1", "host-b-gpu2"]);
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn cpu_and_memory_must_fit_on_the_gpu_host() {
        let total = two_by_four();
        let mut free = total.clone();
        free[0].cpu_millis_free = 1000; // host-a has its GPUs but not the CPU
        let mut s = wants(4);
        s.resources.cpu_millis = 8000;
        match decide(&total, &free, &s) {
            Admission::Fits(p) => assert_eq!(p.host, "host-b"),
            other => panic!("{other:?}"),
        }
        s.resources.cpu_millis = 64_000;
        assert!(matches!(
            decide(&total, &free, &s),
            Admission::Rejected { reason, .. } if reason == "TopologyUnsatisfiable"
        ));
    }

    #[test]
    fn nvlink_requests_stay_in_one_domain() {
        // host-a: two domains of 2; host-b: one domain of 4.
        let total = vec![
            host("host-a", &[("nv0", 2), ("nv1", 2)]),
            host("host-b", &[("nv2", 4)]),
        ];
        match decide(&total, &total, &nvlink(4)) {
            Admission::Fits(p) => assert_eq!(p.host, "host-b"),
            other => panic!("{other:?}"),
        }
        // Without the annotation host-a's four GPUs would do.
        let mut free = total.clone();
        for g in &mut free[1].gpus {
            g.free = false;
        }
        assert!(
            matches!(decide(&total, &free, &wants(4)), Admission::Fits(p) if p.host == "host-a")
        );
        match decide(&total, &free, &nvlink(4)) {
            Admission::Queued { reason } => assert!(
                reason.contains("in one NVLink domain; largest free is 2"),
                "{reason}"
            ),
            other => panic!("{other:?}"),
        }
        let split = vec![host("host-a", &[("nv0", 2), ("nv1", 2)])];
        match decide(&split, &split, &nvlink(3)) {
            Admission::Rejected { reason, message } => {
                assert_eq!(reason, "TopologyUnsatisfiable");
                assert_eq!(
                    message,
                    "needs 3 nvidia.com/gpu in one NVLink domain; largest domain is 2: host-a/nv0 2, host-a/nv1 2"
                );
            }
            other => panic!("{other:?}"),
        }
        // Two GPUs go to the domain that has exactly two, keeping the big one whole.
        match decide(&total, &total, &nvlink(2)) {
            Admission::Fits(p) => assert_eq!(p.gpu_ids, ["host-a-gpu0", "host-a-gpu1"]),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_given_placement_is_checked_not_replaced() {
        let total = two_by_four();
        let mut s = wants(2);
        s.placement = Some(Placement {
            host: "host-b".into(),
            gpu_ids: vec!["host-b-gpu2".into(), "host-b-gpu3".into()],
        });
        assert!(
            matches!(decide(&total, &total, &s), Admission::Fits(p) if p.gpu_ids == ["host-b-gpu2", "host-b-gpu3"])
        );
        let mut free = total.clone();
        free[1].gpus[3].free = false;
        assert!(matches!(
            decide(&total, &free, &s),
            Admission::Queued { .. }
        ));
        // A per-host node's 8-GPU Pod names only its own host.
        let mut s = wants(8);
        s.placement = Some(Placement {
            host: "host-a".into(),
            gpu_ids: vec![],
        });
        assert!(
            matches!(decide(&total, &total, &s), Admission::Rejected { message, .. } if message.contains("this host has 4 (host-a 4)"))
        );
    }

    fn partitioned_host() -> HostSlice {
        let part = |id: &str, profile: &str, c: u32, m: u64| crate::GpuPartition {
            id: id.into(),
            profile: profile.into(),
            compute_slices: c,
            memory_mib: m << 10,
            in_use: false,
        };
        let mut h = host("host-m", &[("nvl-m", 1)]);
        let g = &mut h.gpus[0];
        g.compute_slices = 7;
        g.partitions = vec![
            part("g0-3g-0", "3g.40gb", 3, 40),
            part("g0-3g-1", "3g.40gb", 3, 40),
            part("g0-1g-0", "1g.10gb", 1, 10),
        ];
        h
    }

    fn placed(ids: &[&str]) -> InstanceSpec {
        let mut s = wants(u32::try_from(ids.len()).unwrap());
        s.placement = Some(Placement {
            host: "host-m".into(),
            gpu_ids: ids.iter().map(|s| (*s).to_owned()).collect(),
        });
        s
    }

    #[test]
    fn a_gpu_is_given_whole_or_as_partitions_that_fit_in_it() {
        let total = vec![partitioned_host()];
        let gpu = total[0].gpus[0].id.clone();
        let fits = |free: &[HostSlice], ids: &[&str]| {
            matches!(decide(&total, free, &placed(ids)), Admission::Fits(_))
        };
        assert!(fits(&total, &[&gpu]));
        assert!(fits(&total, &["g0-3g-0", "g0-3g-1"]));
        // The whole GPU held: none of its partitions; a partition held: not the whole GPU.
        let mut free = total.clone();
        free[0].hold([&gpu]);
        assert!(!fits(&free, &["g0-1g-0"]));
        let mut free = total.clone();
        free[0].hold([&"g0-1g-0".to_owned()]);
        assert!(!free[0].gpus[0].free);
        assert!(
            matches!(decide(&total, &free, &placed(&[&gpu])), Admission::Queued { reason } if reason.contains(&gpu))
        );
        assert!(!fits(&free, &["g0-3g-0", "g0-3g-1"]));
        assert!(fits(&free, &["g0-3g-0"]));
        // Never: two 3g.40gb use the GPU's 80Gi, so a 1g.10gb cannot join them;
        // a partition with its own GPU; an id the host does not have.
        for ids in [
            vec!["g0-3g-0", "g0-3g-1", "g0-1g-0"],
            vec![gpu.as_str(), "g0-1g-0"],
            vec!["g9"],
        ] {
            assert!(
                matches!(decide(&total, &total, &placed(&ids)), Admission::Rejected { reason, .. } if reason == "TopologyUnsatisfiable"),
                "{ids:?}"
            );
        }
        assert_eq!(total[0].whole(), total[0]);
    }

    #[test]
    fn a_backends_huge_partition_figures_are_too_big_not_wrapped() {
        let mut host = partitioned_host();
        let gpu = &mut host.gpus[0];
        for p in &mut gpu.partitions {
            p.in_use = false;
        }
        gpu.partitions[0].in_use = true;
        gpu.partitions[0].memory_mib = u64::MAX;
        gpu.partitions[0].compute_slices = u32::MAX;
        let other = gpu.partitions[1].clone();
        assert!(!gpu.partition_free(&other));
    }

    #[test]
    fn a_backend_that_counts_gpus_holds_any_free_one_for_a_named_one() {
        let mut free = vec![host("host-m", &[("nvl", 4)])];
        free[0].gpus_by_count = true;
        free[0].gpus[3].free = false; // one of four taken, which one unknown
        let fits = |free: &[HostSlice], ids: &[&str]| {
            let total: Vec<HostSlice> = free.iter().map(HostSlice::whole).collect();
            matches!(decide(&total, free, &placed(ids)), Admission::Fits(_))
        };
        assert!(fits(&free, &["host-m-gpu3"]));
        assert!(fits(&free, &["host-m-gpu2", "host-m-gpu3"]));
        assert!(fits(&free, &["host-m-gpu0", "host-m-gpu1", "host-m-gpu3"]));
        assert!(!fits(
            &free,
            &["host-m-gpu0", "host-m-gpu1", "host-m-gpu2", "host-m-gpu3"]
        ));
        // A backend that knows which: the named GPU itself.
        free[0].gpus_by_count = false;
        assert!(!fits(&free, &["host-m-gpu3"]));
    }

    #[test]
    fn summary_is_compact() {
        let mut hosts = two_by_four();
        hosts[0].gpus[0].free = false;
        hosts[0].pods_running = 1;
        assert_eq!(
            summary(&hosts[..1]),
            "host-a gpu 3/4 H100 cpu 32/32 mem 256.0Gi/256.0Gi pods 109/110"
        );
    }
}
