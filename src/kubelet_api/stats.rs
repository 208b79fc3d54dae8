//! `/stats/summary` and `/metrics/resource` from the provider's per-Pod stats.
//!
//! A virtual node has no host of its own, so its figures are what it stands
//! for: its Pods, the Pods that ran on it before (CPU is a counter, and
//! metrics-server drops a node whose counter goes back), and vkd's own
//! process, shared among the Nodes it serves. An idle node so reads vkd's
//! overhead, never 0 (metrics-server drops a node that reads 0).

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::Mutex;
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

/// The Pods asked (by UID) and the figures of those that answered.
async fn collect(pods: &PodIndex) -> (Vec<String>, Vec<PodStats>) {
    let asked = pods.pods();
    let uids = asked.iter().map(|p| p.uid.clone()).collect();
    let stats = collect_from(pods.provider().as_ref(), asked, SCRAPE_DEADLINE).await;
    (uids, stats)
}

/// vkd's own CPU time (ns) and resident memory (bytes), read from /proc as
/// the process provider reads its Pods'.
fn own_usage() -> (u64, u64) {
    use vkd_process::procfs;
    let Some(s) = i32::try_from(std::process::id())
        .ok()
        .and_then(procfs::stat)
    else {
        return (0, 0);
    };
    let tick = 1_000_000_000 / procfs::TICKS_PER_SECOND;
    (
        s.utime_ticks
            .saturating_add(s.stime_ticks)
            .saturating_mul(tick),
        s.rss_pages.saturating_mul(procfs::page_size()),
    )
}

/// One reading of a node's figures.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NodeSample {
    pub cpu_core_ns: u64,
    pub cpu_nano_cores: u64,
    pub working_set_bytes: u64,
    pub rss_bytes: u64,
}

#[derive(Debug, Default)]
struct Counters {
    /// Each Pod's CPU counter when last read.
    last: HashMap<String, u64>,
    /// CPU of the Pods that have left the node.
    retired: u64,
    /// The node's counter when last read, and when.
    node: Option<(SystemTime, u64)>,
    /// vkd's share of its own CPU when last read, and when.
    own: Option<(SystemTime, u64)>,
}

/// A node's CPU counter across its Pods' lives, and its share of vkd.
#[derive(Debug)]
pub struct NodeUsage {
    /// How many Nodes this process serves: each reads its share of vkd.
    share_of: u64,
    counters: Mutex<Counters>,
}

impl NodeUsage {
    pub fn new(nodes_served: usize) -> Self {
        Self {
            share_of: u64::try_from(nodes_served.max(1)).unwrap_or(1),
            counters: Mutex::default(),
        }
    }

    /// The node's figures from this scrape: `asked` the Pods on the node,
    /// `stats` those that answered, `own` vkd's (CPU ns, bytes).
    fn observe(
        &self,
        asked: &[String],
        stats: &[PodStats],
        own: (u64, u64),
        now: SystemTime,
    ) -> NodeSample {
        let mut c = self
            .counters
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let (own_cpu, own_memory) = (own.0 / self.share_of, own.1 / self.share_of);
        let (mut working_set, mut rss, mut rate) = (own_memory, own_memory, 0u64);
        for s in stats {
            let (nc, ns, ws, r) = sums(s);
            // A Pod's counter goes back only when its backend lost it (an
            // instance made again); the node's must not.
            let seen = c.last.entry(s.pod.uid.clone()).or_default();
            *seen = (*seen).max(ns);
            working_set = working_set.saturating_add(ws);
            rss = rss.saturating_add(r);
            rate = rate.saturating_add(nc);
        }
        // A Pod not asked has left the node; one asked that did not answer
        // keeps its last figure.
        let asked: std::collections::HashSet<&str> = asked.iter().map(String::as_str).collect();
        let mut retired = 0u64;
        c.last.retain(|uid, ns| {
            let here = asked.contains(uid.as_str());
            if !here {
                retired = retired.saturating_add(*ns);
            }
            here
        });
        c.retired = c.retired.saturating_add(retired);
        let pods: u64 = c.last.values().fold(0, |a, n| a.saturating_add(*n));
        let measured = own_cpu.saturating_add(c.retired).saturating_add(pods);
        let cpu = c.node.map_or(measured, |(_, before)| measured.max(before));
        // The rate: the Pods' own (what their providers measure now) and
        // vkd's share since the last reading.
        if let Some((then, own_before)) = c.own {
            let dt = now.duration_since(then).map_or(0, |d| d.as_nanos());
            let used = u128::from(own_cpu.saturating_sub(own_before)) * 1_000_000_000;
            if let Some(own_rate) = used.checked_div(dt) {
                rate = rate.saturating_add(u64::try_from(own_rate).unwrap_or(u64::MAX));
            }
        }
        c.own = Some((now, own_cpu));
        c.node = Some((now, cpu));
        NodeSample {
            cpu_core_ns: cpu,
            cpu_nano_cores: rate,
            working_set_bytes: working_set.max(1),
            rss_bytes: rss,
        }
    }
}

/// Every Pod's stats, asked concurrently, within one deadline.
pub(crate) async fn collect_from(
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

/// A Pod's figures: the sums of its containers' (CPU nanocores, CPU ns,
/// working set, RSS). A provider's figures are its own: they add up without
/// overflowing.
fn sums(s: &PodStats) -> (u64, u64, u64, u64) {
    s.containers.iter().fold((0, 0, 0, 0), |(a, b, c, d), x| {
        (
            a.saturating_add(x.cpu_usage_nano_cores),
            b.saturating_add(x.cpu_usage_core_nanoseconds),
            c.saturating_add(x.memory_working_set_bytes),
            d.saturating_add(x.memory_rss_bytes),
        )
    })
}

pub async fn summary(pods: &PodIndex, usage: &NodeUsage) -> Value {
    let (asked, stats) = collect(pods).await;
    let now = SystemTime::now();
    let node = usage.observe(&asked, &stats, own_usage(), now);
    let pod_values: Vec<Value> = stats
        .iter()
        .map(|s| {
            let (nc, ns, ws, rss) = sums(s);
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
            "cpu": cpu(now, node.cpu_nano_cores, node.cpu_core_ns),
            "memory": memory(now, node.working_set_bytes, node.rss_bytes),
        },
        "pods": pod_values,
    })
}

fn millis(t: SystemTime) -> u128 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis())
}

/// Prometheus text in the kubelet's resource metrics shape.
pub async fn resource_metrics(pods: &PodIndex, usage: &NodeUsage) -> String {
    let (asked, stats) = collect(pods).await;
    let at = SystemTime::now();
    let node = usage.observe(&asked, &stats, own_usage(), at);
    let now = millis(at);
    let mut out = String::new();
    let mut container_lines = (String::new(), String::new(), String::new());
    let mut pod_lines = (String::new(), String::new());
    for s in &stats {
        let (_, ns, ws, _) = sums(s);
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
        node.cpu_core_ns as f64 / 1e9
    );
    let _ = writeln!(
        out,
        "# HELP node_memory_working_set_bytes Current working set of the node in bytes"
    );
    let _ = writeln!(out, "# TYPE node_memory_working_set_bytes gauge");
    let _ = writeln!(
        out,
        "node_memory_working_set_bytes {} {now}",
        node.working_set_bytes
    );
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

    fn figures(uid: &str, cpu_ns: u64, working_set: u64) -> PodStats {
        PodStats {
            pod: pod(uid),
            start_time: std::time::SystemTime::UNIX_EPOCH,
            time: std::time::SystemTime::UNIX_EPOCH,
            containers: vec![vkd_provider::ContainerStats {
                name: "c".into(),
                start_time: std::time::SystemTime::UNIX_EPOCH,
                cpu_usage_nano_cores: 250_000_000,
                cpu_usage_core_nanoseconds: cpu_ns,
                memory_working_set_bytes: working_set,
                memory_rss_bytes: working_set,
                ephemeral_storage_bytes: None,
                gpus: Vec::new(),
            }],
            ephemeral_storage_bytes: None,
            volumes: Vec::new(),
        }
    }

    /// An idle node reads its share of vkd; its CPU counter keeps what its
    /// Pods used after they leave, and never goes back.
    #[test]
    fn a_node_reads_its_share_of_vkd_and_its_counter_never_goes_back() {
        let t0 = std::time::SystemTime::UNIX_EPOCH + Duration::from_secs(1000);
        let at = |s: u64| t0 + Duration::from_secs(s);
        let usage = super::NodeUsage::new(2);
        let own = (4_000_000_000, 40 << 20);
        let idle = usage.observe(&[], &[], own, at(0));
        assert_eq!(idle.cpu_core_ns, 2_000_000_000, "half of vkd's CPU");
        assert_eq!(idle.working_set_bytes, 20 << 20, "half of vkd's memory");

        let asked = ["a".to_owned(), "b".to_owned()];
        let busy = usage.observe(
            &asked,
            &[
                figures("a", 3_000_000_000, 1 << 20),
                figures("b", 1_000_000_000, 1 << 20),
            ],
            own,
            at(10),
        );
        assert_eq!(busy.cpu_core_ns, 6_000_000_000);
        assert_eq!(busy.working_set_bytes, (20 << 20) + (2 << 20));
        assert_eq!(
            busy.cpu_nano_cores, 500_000_000,
            "the Pods' rates; vkd used none"
        );

        // b did not answer this time: its last figure stands. a ended.
        // vkd used 2 s more (1 s its share) in these 10 s.
        let own = (6_000_000_000, 40 << 20);
        let later = usage.observe(&asked[1..], &[], own, at(20));
        assert_eq!(later.cpu_core_ns, 7_000_000_000, "a's time is kept");
        assert_eq!(later.cpu_nano_cores, 100_000_000, "vkd's share's rate");
        assert_eq!(later.working_set_bytes, 20 << 20);
        // b's backend lost count (an instance made again): no step back.
        let after = usage.observe(&asked[1..], &[figures("b", 10, 1)], own, at(30));
        assert_eq!(after.cpu_core_ns, 7_000_000_000);
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
