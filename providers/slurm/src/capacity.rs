//! A Slurm cluster's nodes as host slices: one slice per node that takes
//! jobs, its GPU GRES as GPUs counted (`gpus_by_count`: Slurm picks which
//! device), never a sum across nodes.

use vkd_provider::{Gpu, HostSlice};

use crate::slurm::NodeRow;

/// The slices of the nodes that take jobs (down, drained and failing ones left out).
pub(crate) fn host_slices(nodes: &[NodeRow]) -> Vec<HostSlice> {
    nodes
        .iter()
        .filter(|n| n.usable())
        .map(|n| {
            let free_gpus = n.gpu_count().saturating_sub(n.gpus_allocated);
            let gpus = n
                .gpus
                .iter()
                .flat_map(|(kind, count)| (0..*count).map(move |_| kind.clone()))
                .enumerate()
                .map(|(i, kind)| Gpu {
                    id: format!("{}-gpu{i}", n.name),
                    model: if kind.is_empty() { "gpu".into() } else { kind },
                    free: i < free_gpus as usize,
                    ..Gpu::default()
                })
                .collect();
            HostSlice {
                name: n.name.clone(),
                cpu_millis_total: u64::from(n.cpus) * 1000,
                cpu_millis_free: u64::from(n.cpus.saturating_sub(n.cpus_allocated)) * 1000,
                memory_bytes_total: n.memory_mib.saturating_mul(1 << 20),
                memory_bytes_free: n
                    .memory_mib
                    .saturating_sub(n.memory_allocated_mib)
                    .saturating_mul(1 << 20),
                gpus,
                gpus_by_count: true,
                max_pods: n.cpus.max(1),
                labels: [("slurm.vkd.io/partitions".to_owned(), n.partitions.join("."))]
                    .into_iter()
                    .collect(),
                ..HostSlice::default()
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_usable_node_is_a_slice_with_its_gres_counted() {
        let node = |name: &str, gpus: u32, used: u32, state: &str| NodeRow {
            name: name.into(),
            cpus: 8,
            cpus_allocated: 2,
            memory_mib: 1000,
            memory_allocated_mib: 250,
            gpus: vec![("h100".into(), gpus)],
            gpus_allocated: used,
            state: state.into(),
            ..NodeRow::default()
        };
        let slices = host_slices(&[
            node("n1", 4, 1, "MIXED"),
            node("n2", 2, 0, "IDLE"),
            node("n3", 2, 0, "DOWN+DRAIN"),
        ]);
        assert_eq!(slices.len(), 2);
        assert_eq!(slices[0].gpus.len(), 4);
        assert_eq!(slices[0].gpus_free(), 3);
        assert_eq!(slices[0].gpus[0].model, "h100");
        assert_eq!(slices[0].cpu_millis_free, 6000);
        assert_eq!(slices[0].memory_bytes_free, 750 << 20);
        assert!(slices[0].gpus_by_count);
        assert_eq!(slices[1].gpus_free(), 2);
    }
}
