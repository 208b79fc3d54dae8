//! Does a Pod fit on one host of the fleet? Never on a sum of hosts: two hosts with
//! 4 free GPUs each are not a place for an 8-GPU Pod.

use vkd_provider::{Admission, HostSlice, InstanceSpec, Placement, quantity};

fn gpu_summary(hosts: &[HostSlice], free: bool) -> String {
    hosts
        .iter()
        .map(|h| {
            format!(
                "{} {}",
                h.name,
                if free { h.gpus_free() } else { h.gpus.len() }
            )
        })
        .collect::<Vec<_>>()
        .join(", ")
}

fn gib(bytes: u64) -> String {
    format!("{:.1}Gi", bytes as f64 / f64::from(1u32 << 30))
}

/// `total` is the fleet with everything free, `free` the same hosts as they are now.
pub fn decide(total: &[HostSlice], free: &[HostSlice], spec: &InstanceSpec) -> Admission {
    let r = spec.resources;
    let gpus = r.gpus as usize;
    let fleet_gpus: usize = total.iter().map(|h| h.gpus.len()).sum();
    if gpus > fleet_gpus {
        return Admission::Rejected {
            reason: "OutOfnvidia.com/gpu".into(),
            message: format!(
                "needs {gpus} nvidia.com/gpu; the whole fleet has {fleet_gpus} ({})",
                gpu_summary(total, false)
            ),
        };
    }
    let could_ever = |h: &HostSlice| {
        h.cpu_millis_total >= r.cpu_millis
            && h.memory_bytes_total >= r.memory_bytes
            && h.gpus.len() >= gpus
    };
    if !total.iter().any(could_ever) {
        let message = if !total.iter().any(|h| h.gpus.len() >= gpus) {
            format!(
                "needs {gpus} nvidia.com/gpu on one host; largest slice is {}: {}",
                total.iter().map(|h| h.gpus.len()).max().unwrap_or(0),
                gpu_summary(total, false)
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
    let fits_now = |h: &&HostSlice| {
        h.pods_running < h.max_pods
            && h.cpu_millis_free >= r.cpu_millis
            && h.memory_bytes_free >= r.memory_bytes
            && h.gpus_free() >= gpus
    };
    // GPU Pods take the tightest host that fits (leaving big slices whole);
    // others take the host with most free CPU.
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
            gpu_ids: pick_gpus(h, gpus),
        }),
        None => Admission::Queued {
            reason: if gpus > 0 {
                format!(
                    "waiting for {gpus} free nvidia.com/gpu on one host; largest free slice is {}: {}",
                    free.iter().map(HostSlice::gpus_free).max().unwrap_or(0),
                    gpu_summary(free, true)
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

/// Free GPUs on one host, from a single NVLink domain when one has enough.
fn pick_gpus(h: &HostSlice, n: usize) -> Vec<String> {
    if n == 0 {
        return Vec::new();
    }
    let free: Vec<_> = h.gpus.iter().filter(|g| g.free).collect();
    let mut domains: Vec<_> = free
        .iter()
        .filter_map(|g| g.nvlink_domain.as_deref())
        .collect();
    domains.sort_unstable();
    domains.dedup();
    for d in domains {
        let inside: Vec<_> = free
            .iter()
            .filter(|g| g.nvlink_domain.as_deref() == Some(d))
            .collect();
        if inside.len() >= n {
            return inside.iter().take(n).map(|g| g.id.clone()).collect();
        }
    }
    free.iter().take(n).map(|g| g.id.clone()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Fleet;
    use vkd_provider::conformance::sample_spec;

    fn two_by_four() -> Vec<HostSlice> {
        Fleet::parse(
            "hosts:\n- {name: host-a, cpu: '32', memory: 256Gi, gpus: [{count: 4, model: H100, memory: 80Gi}]}\n- {name: host-b, cpu: '32', memory: 256Gi, gpus: [{count: 4, model: H100, memory: 80Gi}]}",
            "t",
        )
        .unwrap()
        .hosts
    }

    fn wants(gpus: u32) -> InstanceSpec {
        let mut s = sample_spec("n", "u");
        s.resources.gpus = gpus;
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
            Admission::Queued { reason } => {
                assert!(
                    reason.contains("largest free slice is 3: host-a 3, host-b 3"),
                    "{reason}"
                )
            }
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
}
