//! `/stats/summary` and `/metrics/resource` from the provider's per-Pod stats.
//! The node figures are the sums of its Pods (a virtual node has no host of its own).

use std::fmt::Write as _;
use std::time::{Duration, SystemTime};

use futures::StreamExt;
use serde_json::{Value, json};
use vkd_provider::{PodRef, PodStats, Provider};

use crate::pods::PodIndex;
use crate::pods::status::time;

/// How long one scrape waits for its Pods' figures, all together: a Pod
/// that has not answered by then is left out of this scrape, as the kubelet
/// leaves out a container its stats provider has no figures for. Under
/// metrics-server's 10 s request timeout.
const SCRAPE_DEADLINE: Duration = Duration::from_secs(8);
/// Pods asked at once.
const SCRAPE_CONCURRENCY: usize = 32;

async fn collect(pods: &PodIndex) -> Vec<PodStats> {
    collect_from(pods.provider().as_ref(), pods.pods(), SCRAPE_DEADLINE).await
}

/// Every Pod's stats, asked concurrently, within one deadline.
async fn collect_from(
    provider: &dyn Provider,
    pods: Vec<PodRef>,
    deadline: Duration,
) -> Vec<PodStats> {
    let until = tokio::time::Instant::now() + deadline;
    // Unordered, so one Pod that never answers holds no other back.
    let mut got: Vec<(usize, PodStats)> = futures::stream::iter(pods.into_iter().enumerate())
        .map(|(i, p)| async move {
            let answer = tokio::time::timeout_at(until, provider.stats(&p.uid)).await;
            answer.ok().and_then(Result::ok).map(|s| (i, s))
        })
        .buffer_unordered(SCRAPE_CONCURRENCY)
        .filter_map(std::future::ready)
        .collect()
        .await;
    got.sort_unstable_by_key(|(i, _)| *i);
    got.into_iter().map(|(_, s)| s).collect()
}

fn cpu(t: SystemTime, nano_cores: u64, core_ns: u64) -> Value {
    json!({"time": time(t), "usageNanoCores": nano_cores, "usageCoreNanoSeconds": core_ns})
}

fn memory(t: SystemTime, working_set: u64, rss: u64) -> Value {
    json!({"time": time(t), "usageBytes": working_set, "workingSetBytes": working_set, "rssBytes": rss,
           "pageFaults": 0, "majorPageFaults": 0})
}

fn sums(s: &PodStats) -> (u64, u64, u64, u64) {
    s.containers.iter().fold((0, 0, 0, 0), |(a, b, c, d), x| {
        (
            a + x.cpu_usage_nano_cores,
            b + x.cpu_usage_core_nanoseconds,
            c + x.memory_working_set_bytes,
            d + x.memory_rss_bytes,
        )
    })
}

pub async fn summary(pods: &PodIndex) -> Value {
    let stats = collect(pods).await;
    let now = SystemTime::now();
    let mut node = (0, 0, 0, 0);
    let pod_values: Vec<Value> = stats
        .iter()
        .map(|s| {
            let (nc, ns, ws, rss) = sums(s);
            node = (node.0 + nc, node.1 + ns, node.2 + ws, node.3 + rss);
            let mut pod = json!({
                "podRef": {"name": s.pod.name, "namespace": s.pod.namespace, "uid": s.pod.uid},
                "startTime": time(s.start_time),
                "containers": s.containers.iter().map(|c| json!({
                    "name": c.name,
                    "startTime": time(c.start_time),
                    "cpu": cpu(s.time, c.cpu_usage_nano_cores, c.cpu_usage_core_nanoseconds),
                    "memory": memory(s.time, c.memory_working_set_bytes, c.memory_rss_bytes),
                })).collect::<Vec<_>>(),
                "cpu": cpu(s.time, nc, ns),
                "memory": memory(s.time, ws, rss),
            });
            // Where the backend measures disk, as the kubelet's summary has it.
            if let Some(used) = s.ephemeral_storage_bytes {
                pod["ephemeral-storage"] = json!({"time": time(s.time), "usedBytes": used});
            }
            if !s.volumes.is_empty() {
                pod["volume"] = s
                    .volumes
                    .iter()
                    .map(|v| json!({"time": time(s.time), "name": v.name, "usedBytes": v.used_bytes}))
                    .collect();
            }
            pod
        })
        .collect();
    json!({
        "node": {
            "nodeName": pods.node(),
            "startTime": time(now),
            "cpu": cpu(now, node.0, node.1),
            "memory": memory(now, node.2, node.3),
        },
        "pods": pod_values,
    })
}

fn millis(t: SystemTime) -> u128 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis())
}

/// Prometheus text in the kubelet's resource metrics shape.
pub async fn resource_metrics(pods: &PodIndex) -> String {
    let stats = collect(pods).await;
    let now = millis(SystemTime::now());
    let mut out = String::new();
    let (mut node_cpu, mut node_mem) = (0u64, 0u64);
    let mut container_lines = (String::new(), String::new(), String::new());
    let mut pod_lines = (String::new(), String::new());
    for s in &stats {
        let (_, ns, ws, _) = sums(s);
        node_cpu += ns;
        node_mem += ws;
        let ts = millis(s.time);
        let (pod, namespace) = (&s.pod.name, &s.pod.namespace);
        for c in &s.containers {
            let labels = format!(
                "container=\"{}\",namespace=\"{namespace}\",pod=\"{pod}\"",
                c.name
            );
            let _ = writeln!(
                container_lines.0,
                "container_cpu_usage_seconds_total{{{labels}}} {} {ts}",
                c.cpu_usage_core_nanoseconds as f64 / 1e9
            );
            let _ = writeln!(
                container_lines.1,
                "container_memory_working_set_bytes{{{labels}}} {} {ts}",
                c.memory_working_set_bytes
            );
            let _ = writeln!(
                container_lines.2,
                "container_start_time_seconds{{{labels}}} {} {ts}",
                millis(c.start_time) as f64 / 1e3
            );
        }
        let labels = format!("namespace=\"{namespace}\",pod=\"{pod}\"");
        let _ = writeln!(
            pod_lines.0,
            "pod_cpu_usage_seconds_total{{{labels}}} {} {ts}",
            ns as f64 / 1e9
        );
        let _ = writeln!(
            pod_lines.1,
            "pod_memory_working_set_bytes{{{labels}}} {ws} {ts}"
        );
    }
    let sections = [
        (
            "container_cpu_usage_seconds_total",
            "counter",
            "Cumulative cpu time consumed by the container in core-seconds",
            &container_lines.0,
        ),
        (
            "container_memory_working_set_bytes",
            "gauge",
            "Current working set of the container in bytes",
            &container_lines.1,
        ),
        (
            "container_start_time_seconds",
            "gauge",
            "Start time of the container since unix epoch in seconds",
            &container_lines.2,
        ),
        (
            "pod_cpu_usage_seconds_total",
            "counter",
            "Cumulative cpu time consumed by the pod in core-seconds",
            &pod_lines.0,
        ),
        (
            "pod_memory_working_set_bytes",
            "gauge",
            "Current working set of the pod in bytes",
            &pod_lines.1,
        ),
    ];
    let _ = writeln!(
        out,
        "# HELP node_cpu_usage_seconds_total Cumulative cpu time consumed by the node in core-seconds"
    );
    let _ = writeln!(out, "# TYPE node_cpu_usage_seconds_total counter");
    let _ = writeln!(
        out,
        "node_cpu_usage_seconds_total {} {now}",
        node_cpu as f64 / 1e9
    );
    let _ = writeln!(
        out,
        "# HELP node_memory_working_set_bytes Current working set of the node in bytes"
    );
    let _ = writeln!(out, "# TYPE node_memory_working_set_bytes gauge");
    let _ = writeln!(out, "node_memory_working_set_bytes {node_mem} {now}");
    for (name, kind, help, lines) in sections {
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} {kind}");
        out.push_str(lines);
    }
    let _ = writeln!(
        out,
        "# HELP resource_scrape_error 1 if there was an error while getting container metrics, 0 otherwise"
    );
    let _ = writeln!(out, "# TYPE resource_scrape_error gauge");
    let _ = writeln!(out, "resource_scrape_error 0");
    out
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use async_trait::async_trait;
    use futures::stream::BoxStream;
    use vkd_provider::{
        Admission, Capacity, Fence, Health, Instance, InstanceEvent, InstanceSpec, PodRef,
        PodStats, Provider, ProviderError, Result,
    };

    /// Each Pod's figures take a second; the Pod `stuck`'s never come.
    #[derive(Debug)]
    struct Slow;

    #[async_trait]
    impl Provider for Slow {
        fn name(&self) -> &str {
            "slow"
        }
        async fn health(&self) -> Health {
            Health::Healthy
        }
        async fn capacity(&self) -> Result<Capacity> {
            Err(ProviderError::transient("unused"))
        }
        async fn admit(&self, _: &InstanceSpec) -> Result<Admission> {
            Err(ProviderError::transient("unused"))
        }
        async fn create(&self, _: &Fence, _: &InstanceSpec) -> Result<Instance> {
            Err(ProviderError::transient("unused"))
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
            Box::pin(futures::stream::pending())
        }
        async fn stats(&self, uid: &str) -> Result<PodStats> {
            if uid == "stuck" {
                std::future::pending::<()>().await;
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
            Ok(PodStats {
                pod: pod(uid),
                start_time: std::time::SystemTime::UNIX_EPOCH,
                time: std::time::SystemTime::UNIX_EPOCH,
                containers: Vec::new(),
                ephemeral_storage_bytes: None,
                volumes: Vec::new(),
            })
        }
    }

    fn pod(uid: &str) -> PodRef {
        PodRef {
            uid: uid.into(),
            namespace: "ns".into(),
            name: uid.into(),
        }
    }

    /// 100 Pods of a second each answer in seconds, not in 100; a Pod that
    /// never answers costs the scrape its deadline, not the scrape itself.
    #[tokio::test(start_paused = true)]
    async fn a_scrape_asks_pods_at_once_within_one_deadline() {
        let mut pods: Vec<PodRef> = (0..100).map(|i| pod(&format!("p{i}"))).collect();
        pods.insert(50, pod("stuck"));
        let started = tokio::time::Instant::now();
        let got = super::collect_from(&Slow, pods, Duration::from_secs(8)).await;
        let took = started.elapsed();
        assert_eq!(got.len(), 100, "every Pod but the stuck one");
        assert_eq!(got[50].pod.uid, "p50", "in the Pods' order");
        assert!(took <= Duration::from_secs(8), "{took:?}");
    }
}
