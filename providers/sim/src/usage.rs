//! What a simulated Pod uses: CPU and memory per running container, and its
//! GPUs, as its annotations say (behaviour.rs) or derived from its requests
//! and its GPUs' size. Never 0 for a running container: metrics-server takes
//! a 0 for a container with no figures and drops the whole Pod.

use std::time::SystemTime;

use vkd_provider::{
    ContainerState, ContainerStats, GpuStats, HostSlice, Placement, PodStats, ProviderError, Result,
};

use crate::SimProvider;
use crate::behaviour::{Behaviour, from_annotations};

/// A GPU's utilisation when the Pod does not say.
const DEFAULT_GPU_UTILIZATION: u32 = 80;

impl SimProvider {
    pub(crate) async fn sim_stats(&self, uid: &str) -> Result<PodStats> {
        let inst = self.instance(uid).await?;
        // What each running container uses, and the Pod's GPUs, read under
        // one look at the record.
        let (cpu_millis, memory, gpus) = {
            let st = self.state();
            let r = st.records.get(uid).ok_or_else(|| ProviderError::NotFound {
                uid: uid.to_owned(),
            })?;
            let said = from_annotations(&r.spec.annotations).ok();
            let n = u64::try_from(r.spec.containers.len().max(1)).unwrap_or(1);
            let cpu_millis = said
                .and_then(|b| b.cpu_usage_millis)
                .unwrap_or((r.spec.resources.cpu_millis / n / 2).max(50));
            let memory = said
                .and_then(|b| b.memory_usage_bytes)
                .unwrap_or((r.spec.resources.memory_bytes / n / 2).max(8 << 20));
            (cpu_millis, memory, gpu_stats(&st.hosts, &r.placement, said))
        };
        let now = SystemTime::now();
        let mut gpus = Some(gpus);
        let containers = inst
            .containers
            .iter()
            .filter_map(|c| match &c.state {
                ContainerState::Running { started_at } => Some((c, *started_at)),
                _ => None,
            })
            .map(|(c, start)| {
                let up = now.duration_since(start).unwrap_or_default();
                ContainerStats {
                    name: c.name.clone(),
                    start_time: start,
                    cpu_usage_nano_cores: cpu_millis.saturating_mul(1_000_000),
                    cpu_usage_core_nanoseconds: (up.as_nanos() as u64 / 1000)
                        .saturating_mul(cpu_millis)
                        .max(1),
                    memory_working_set_bytes: memory,
                    memory_rss_bytes: memory - memory / 4,
                    ephemeral_storage_bytes: None,
                    // The Pod's GPUs are its first running container's, so a
                    // sum over containers counts each GPU once.
                    gpus: gpus.take().unwrap_or_default(),
                }
            })
            .collect();
        Ok(PodStats {
            pod: inst.owner,
            start_time: inst.started_at.unwrap_or(inst.created_at),
            time: now,
            containers,
            ephemeral_storage_bytes: None,
            volumes: Vec::new(),
        })
    }
}

/// The GPUs (and MIG-style partitions) a placement holds, each with its use.
fn gpu_stats(hosts: &[HostSlice], placement: &Placement, said: Option<Behaviour>) -> Vec<GpuStats> {
    let Some(host) = hosts.iter().find(|h| h.name == placement.host) else {
        return Vec::new();
    };
    let utilization = said
        .and_then(|b| b.gpu_utilization_percent)
        .unwrap_or(DEFAULT_GPU_UTILIZATION);
    placement
        .gpu_ids
        .iter()
        .filter_map(|id| {
            host.gpus.iter().enumerate().find_map(|(index, g)| {
                let memory_mib = if g.id == *id {
                    g.memory_mib
                } else {
                    g.partitions.iter().find(|p| p.id == *id)?.memory_mib
                };
                let total = memory_mib.saturating_mul(1 << 20);
                let used = said
                    .and_then(|b| b.gpu_memory_usage_bytes)
                    .unwrap_or(total / 2)
                    .min(total);
                Some(GpuStats {
                    id: id.clone(),
                    index: u32::try_from(index).unwrap_or(u32::MAX),
                    model: g.model.clone(),
                    host: host.name.clone(),
                    utilization_percent: utilization,
                    memory_used_bytes: used,
                    memory_total_bytes: total,
                })
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use vkd_provider::{Gpu, GpuPartition, HostSlice, Placement};

    use crate::behaviour::{GPU_MEMORY_USAGE, GPU_UTILIZATION, from_annotations};

    fn host() -> HostSlice {
        let gpu = |i: u32| Gpu {
            id: format!("h-gpu{i}"),
            model: "H100".into(),
            memory_mib: 81920,
            free: false,
            compute_slices: 7,
            partitions: vec![GpuPartition {
                id: format!("h-gpu{i}-3g40gb-0"),
                profile: "3g.40gb".into(),
                compute_slices: 3,
                memory_mib: 40960,
                in_use: true,
            }],
            ..Default::default()
        };
        HostSlice {
            name: "h".into(),
            gpus: vec![gpu(0), gpu(1)],
            ..Default::default()
        }
    }

    #[test]
    fn a_placements_gpus_are_reported_with_what_the_pod_says() {
        let placement = Placement {
            host: "h".into(),
            gpu_ids: vec!["h-gpu1".into(), "h-gpu0-3g40gb-0".into(), "gone".into()],
        };
        let said: BTreeMap<String, String> = [(GPU_UTILIZATION, "73"), (GPU_MEMORY_USAGE, "50Gi")]
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        let g = super::gpu_stats(&[host()], &placement, from_annotations(&said).ok());
        assert_eq!(
            g.len(),
            2,
            "an id the host does not have is left out: {g:?}"
        );
        assert_eq!((g[0].index, g[0].utilization_percent), (1, 73));
        assert_eq!(g[0].memory_used_bytes, 50 << 30);
        assert_eq!((g[1].index, g[1].memory_total_bytes), (0, 40 << 30));
        assert_eq!(
            g[1].memory_used_bytes,
            40 << 30,
            "never more than the partition has"
        );
        let g = super::gpu_stats(&[host()], &placement, None);
        assert_eq!(g[0].utilization_percent, super::DEFAULT_GPU_UTILIZATION);
        assert_eq!(g[0].memory_used_bytes, 40 << 30, "half the GPU");
    }
}
