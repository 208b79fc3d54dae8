//! Each Pod's GPU use, exported on vkd's `/metrics` with the names and labels
//! DCGM exporter gives them (`DCGM_FI_DEV_GPU_UTIL{namespace,pod,container,
//! gpu,UUID,device,modelName,Hostname}`), so the prometheus-adapter rules and
//! dashboards people already have for GPU nodes work for a virtual node,
//! where DCGM exporter (a DaemonSet) cannot run.
//!
//! A task per node asks the provider for its Pods' figures every
//! [`REFRESH`], when its hosts have GPUs at all; a scrape renders the last
//! answers and never calls the backend. Only providers that say they measure
//! GPU use (`Capabilities::gpu_usage`) are asked. These series carry Pod
//! names as labels, as DCGM exporter's do: one per GPU a Pod holds.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Mutex;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use vkd_provider::{PodStats, Support};

use crate::pods::PodIndex;

/// How often a node's Pods are asked: DCGM exporter's default interval is
/// 30 s, Prometheus' a minute; 15 s keeps up with either.
pub const REFRESH: Duration = Duration::from_secs(15);
/// How long one refresh waits for its Pods' figures, all together.
const DEADLINE: Duration = Duration::from_secs(10);

/// One GPU held by one container.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Series {
    labels: Vec<(&'static str, String)>,
    utilization_percent: u32,
    used_mib: u64,
    free_mib: u64,
}

/// A metric family: its name, help, and each series' value.
type Family = (&'static str, &'static str, fn(&Series) -> u64);

/// The last figures of every node's GPU Pods.
#[derive(Debug, Default)]
pub struct GpuUsage {
    by_node: Mutex<BTreeMap<String, Vec<Series>>>,
}

impl GpuUsage {
    /// Replaces `node`'s series with those of `stats`.
    pub fn set(&self, node: &str, stats: &[PodStats]) {
        let mut series = Vec::new();
        for s in stats {
            for c in &s.containers {
                for g in &c.gpus {
                    series.push(Series {
                        labels: vec![
                            ("gpu", g.index.to_string()),
                            ("UUID", g.id.clone()),
                            ("device", format!("nvidia{}", g.index)),
                            ("modelName", g.model.clone()),
                            ("Hostname", g.host.clone()),
                            ("container", c.name.clone()),
                            ("namespace", s.pod.namespace.clone()),
                            ("pod", s.pod.name.clone()),
                        ],
                        utilization_percent: g.utilization_percent.min(100),
                        used_mib: g.memory_used_bytes >> 20,
                        free_mib: g.memory_total_bytes.saturating_sub(g.memory_used_bytes) >> 20,
                    });
                }
            }
        }
        self.by_node
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert(node.to_owned(), series);
    }

    /// The series in OpenMetrics text, without the closing `# EOF`; nothing
    /// when no Pod holds a GPU.
    pub fn render(&self) -> String {
        let by_node = self
            .by_node
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let all: Vec<&Series> = by_node.values().flatten().collect();
        let mut out = String::new();
        if all.is_empty() {
            return out;
        }
        let families: [Family; 3] = [
            ("DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %).", |s| {
                u64::from(s.utilization_percent)
            }),
            (
                "DCGM_FI_DEV_FB_USED",
                "Framebuffer memory used (in MiB).",
                |s| s.used_mib,
            ),
            (
                "DCGM_FI_DEV_FB_FREE",
                "Framebuffer memory free (in MiB).",
                |s| s.free_mib,
            ),
        ];
        for (name, help, value) in families {
            let _ = writeln!(out, "# HELP {name} {help}");
            let _ = writeln!(out, "# TYPE {name} gauge");
            for s in &all {
                let labels: Vec<String> = s
                    .labels
                    .iter()
                    .map(|(k, v)| format!("{k}=\"{}\"", escape(v)))
                    .collect();
                let _ = writeln!(out, "{name}{{{}}} {}", labels.join(","), value(s));
            }
        }
        out
    }
}

/// A label value as the text formats want it.
fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// Asks `pods`' provider for their figures every [`REFRESH`] until `stop`;
/// then the node's series go (a replica that stops serving the node, on
/// shutdown or a lost lease, exports none of its Pods).
pub async fn run(
    pods: PodIndex,
    metrics: std::sync::Arc<crate::metrics::Metrics>,
    stop: CancellationToken,
) -> Result<(), std::convert::Infallible> {
    if pods.provider().capabilities().gpu_usage != Support::Supported {
        stop.cancelled().await;
        return Ok(());
    }
    let mut every = tokio::time::interval(REFRESH);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = stop.cancelled() => break,
            _ = every.tick() => {}
        }
        // A backend without GPUs (a CPU fleet) costs no call per Pod.
        let has_gpus = pods
            .provider()
            .capacity()
            .await
            .is_ok_and(|c| c.hosts.iter().any(|h| !h.gpus.is_empty()));
        let stats = if has_gpus {
            let asked = crate::kubelet_api::stats::collect_from(
                pods.provider().as_ref(),
                pods.pods(),
                DEADLINE,
            );
            tokio::select! {
                () = stop.cancelled() => break,
                stats = asked => stats,
            }
        } else {
            Vec::new()
        };
        metrics.gpu_usage.set(pods.node(), &stats);
    }
    metrics.gpu_usage.set(pods.node(), &[]);
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::time::SystemTime;

    use vkd_provider::{ContainerStats, GpuStats, PodRef, PodStats};

    fn pod(name: &str, gpus: &[(u32, u32)]) -> PodStats {
        PodStats {
            pod: PodRef {
                uid: format!("uid-{name}"),
                namespace: "team".into(),
                name: name.into(),
            },
            start_time: SystemTime::UNIX_EPOCH,
            time: SystemTime::UNIX_EPOCH,
            containers: vec![ContainerStats {
                name: "train".into(),
                start_time: SystemTime::UNIX_EPOCH,
                cpu_usage_core_nanoseconds: 1,
                cpu_usage_nano_cores: 1,
                memory_working_set_bytes: 1,
                memory_rss_bytes: 1,
                ephemeral_storage_bytes: None,
                gpus: gpus
                    .iter()
                    .map(|&(index, util)| GpuStats {
                        id: format!("host-a-gpu{index}"),
                        index,
                        model: "H100 \"SXM\"".into(),
                        host: "host-a".into(),
                        utilization_percent: util,
                        memory_used_bytes: 20 << 30,
                        memory_total_bytes: 80 << 30,
                    })
                    .collect(),
            }],
            ephemeral_storage_bytes: None,
            volumes: Vec::new(),
        }
    }

    #[test]
    fn each_gpu_a_pod_holds_is_a_series_with_dcgm_labels() {
        let u = super::GpuUsage::default();
        assert_eq!(u.render(), "", "no GPU Pods, no families");
        u.set(
            "vk-a",
            &[pod("a", &[(0, 73), (1, 250)]), pod("cpu-only", &[])],
        );
        u.set("vk-b", &[pod("b", &[(3, 5)])]);
        let text = u.render();
        assert!(
            text.contains(
                "DCGM_FI_DEV_GPU_UTIL{gpu=\"0\",UUID=\"host-a-gpu0\",device=\"nvidia0\",\
                 modelName=\"H100 \\\"SXM\\\"\",Hostname=\"host-a\",container=\"train\",\
                 namespace=\"team\",pod=\"a\"} 73\n"
            ),
            "{text}"
        );
        assert!(text.contains("pod=\"a\"} 100\n"), "at most 100%: {text}");
        assert!(text.contains("DCGM_FI_DEV_FB_USED{gpu=\"3\""), "{text}");
        assert!(
            text.contains("pod=\"b\"} 61440\n"),
            "80 GiB - 20 GiB free: {text}"
        );
        assert_eq!(text.matches("# TYPE").count(), 3);
        assert_eq!(text.matches("DCGM_FI_DEV_GPU_UTIL{").count(), 3);
        // A node's Pods are replaced, the other node's kept.
        u.set("vk-a", &[]);
        assert_eq!(u.render().matches("DCGM_FI_DEV_GPU_UTIL{").count(), 1);
    }
}
