//! A downstream Pod's usage, from the downstream metrics API
//! (`metrics.k8s.io/v1beta1` PodMetrics, served by metrics-server).
//!
//! The metrics API, not the downstream kubelets' `/stats/summary` through the
//! node proxy: reading it needs `get` on `pods.metrics.k8s.io` alone, where
//! the node proxy needs `nodes/proxy`, which reaches every kubelet endpoint
//! (exec included). What it costs: the metrics API gives a CPU rate and the
//! working set, not the cumulative CPU time or the RSS. The cumulative time
//! is summed here from the rates over the windows seen (what `kubectl top`
//! and a scraper of `container_cpu_usage_seconds_total` need); the RSS is
//! reported as 0.

use std::collections::HashMap;
use std::time::{Duration, SystemTime};

use serde_json::Value;
use vkd_provider::{ContainerStats, PodRef, PodStats, quantity};

/// Per container: the end of the last window counted, and the CPU
/// nanoseconds summed up to it.
pub type CpuTotals = HashMap<String, (SystemTime, u64)>;

#[derive(Debug, thiserror::Error)]
pub enum StatsError {
    #[error("the downstream PodMetrics has no {0}")]
    Missing(&'static str),
    #[error("the downstream PodMetrics has a bad {field}: {message}")]
    Bad {
        field: &'static str,
        message: String,
    },
}

fn time_of(v: &Value, field: &'static str) -> Result<SystemTime, StatsError> {
    let text = v.as_str().ok_or(StatsError::Missing(field))?;
    let t: jiff::Timestamp = text.parse().map_err(|e: jiff::Error| StatsError::Bad {
        field,
        message: e.to_string(),
    })?;
    Ok(SystemTime::from(t))
}

/// The window as Go writes a duration ("10.5s", "1m0s"); at most an hour.
fn window_of(v: &Value) -> Result<Duration, StatsError> {
    let text = v.as_str().ok_or(StatsError::Missing("window"))?;
    let bad = || StatsError::Bad {
        field: "window",
        message: format!("{text:?} is not a duration of at most 1h"),
    };
    // One number and unit at a time: a new part starts where a digit follows a letter.
    let mut total = Duration::ZERO;
    let mut rest = text;
    while !rest.is_empty() {
        let unit_at = rest
            .find(|c: char| !c.is_ascii_digit() && c != '.')
            .ok_or_else(bad)?;
        let end = rest[unit_at..]
            .find(|c: char| c.is_ascii_digit())
            .map_or(rest.len(), |i| unit_at + i);
        let part = vkd_provider::parse_duration(&rest[..end]).ok_or_else(bad)?;
        total = total.checked_add(part).ok_or_else(bad)?;
        rest = &rest[end..];
    }
    if text.is_empty() || total > Duration::from_secs(3600) {
        return Err(bad());
    }
    Ok(total)
}

/// `metrics` (a PodMetrics object) as the Pod's stats; `totals` holds the
/// CPU time summed so far for this Pod and is brought up to date.
pub fn pod_stats(
    pod: PodRef,
    start_time: SystemTime,
    metrics: &Value,
    totals: &mut CpuTotals,
) -> Result<PodStats, StatsError> {
    let at = time_of(&metrics["timestamp"], "timestamp")?;
    let window = window_of(&metrics["window"])?;
    let list = metrics["containers"]
        .as_array()
        .ok_or(StatsError::Missing("containers"))?;
    let mut containers = Vec::with_capacity(list.len());
    for c in list {
        let name = c["name"]
            .as_str()
            .ok_or(StatsError::Missing("container name"))?;
        let quantity_of =
            |field: &'static str, parse: fn(&str) -> Result<u64, quantity::QuantityError>| {
                let text = c["usage"][field]
                    .as_str()
                    .ok_or(StatsError::Missing(field))?;
                parse(text).map_err(|e: quantity::QuantityError| StatsError::Bad {
                    field,
                    message: e.to_string(),
                })
            };
        let nano_cores = quantity_of("cpu", quantity::cpu_nanos)?;
        let working_set = quantity_of("memory", quantity::bytes)?;
        // The first window counts whole; a later one from where the last ended.
        let (last, total) = totals
            .get(name)
            .copied()
            .unwrap_or((at.checked_sub(window).unwrap_or(at), 0));
        let total = match at.duration_since(last) {
            Ok(span) if !span.is_zero() => {
                let used = u128::from(nano_cores) * span.as_nanos() / 1_000_000_000;
                let total = total.saturating_add(u64::try_from(used).unwrap_or(u64::MAX));
                totals.insert(name.to_owned(), (at, total));
                total
            }
            // The same window again, or an older one: nothing more was used.
            _ => total,
        };
        containers.push(ContainerStats {
            name: name.to_owned(),
            start_time,
            cpu_usage_core_nanoseconds: total,
            cpu_usage_nano_cores: nano_cores,
            memory_working_set_bytes: working_set,
            memory_rss_bytes: 0,
            ephemeral_storage_bytes: None,
            gpus: Vec::new(),
        });
    }
    // A container no longer reported keeps no total.
    totals.retain(|name, _| containers.iter().any(|c| &c.name == name));
    Ok(PodStats {
        pod,
        start_time,
        time: at,
        containers,
        ephemeral_storage_bytes: None,
        volumes: Vec::new(),
    })
}

/// Each GPU to the container DCGM names, else to the first container (so a
/// sum over containers counts each GPU once).
pub fn attach_gpus(stats: &mut PodStats, gpus: &[(String, vkd_provider::GpuStats)]) {
    for (container, gpu) in gpus {
        let at = stats
            .containers
            .iter()
            .position(|c| &c.name == container)
            .unwrap_or(0);
        if let Some(c) = stats.containers.get_mut(at) {
            c.gpus.push(gpu.clone());
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // a failed unwrap is a failed test
    use serde_json::json;

    use super::*;

    fn metrics(timestamp: &str, cpu: &str, memory: &str) -> Value {
        json!({
            "apiVersion": "metrics.k8s.io/v1beta1", "kind": "PodMetrics",
            "metadata": {"name": "vkd-u1", "namespace": "vkd-ns"},
            "timestamp": timestamp, "window": "10s",
            "containers": [{"name": "main", "usage": {"cpu": cpu, "memory": memory}}],
        })
    }

    fn owner() -> PodRef {
        PodRef {
            uid: "u1".into(),
            namespace: "ns".into(),
            name: "web".into(),
        }
    }

    #[test]
    fn rates_and_working_set_map_and_cpu_time_accumulates_over_windows() {
        let mut totals = CpuTotals::new();
        let start = SystemTime::UNIX_EPOCH;
        let s = pod_stats(
            owner(),
            start,
            &metrics("2026-12-03T10:00:00Z", "250m", "64Mi"),
            &mut totals,
        )
        .unwrap();
        let c = &s.containers[0];
        assert_eq!(c.cpu_usage_nano_cores, 250_000_000);
        assert_eq!(c.memory_working_set_bytes, 64 << 20);
        // A quarter core over the 10 s window.
        assert_eq!(c.cpu_usage_core_nanoseconds, 2_500_000_000);
        // The same sample again adds nothing; the next one adds its span.
        let again = pod_stats(
            owner(),
            start,
            &metrics("2026-12-03T10:00:00Z", "250m", "64Mi"),
            &mut totals,
        )
        .unwrap();
        assert_eq!(
            again.containers[0].cpu_usage_core_nanoseconds,
            2_500_000_000
        );
        let next = pod_stats(
            owner(),
            start,
            &metrics("2026-12-03T10:00:20Z", "123456n", "1Gi"),
            &mut totals,
        )
        .unwrap();
        assert_eq!(
            next.containers[0].cpu_usage_core_nanoseconds,
            2_500_000_000 + 123_456 * 20
        );
        assert_eq!(next.containers[0].cpu_usage_nano_cores, 123_456);
    }

    #[test]
    fn gpus_go_to_the_container_dcgm_names_or_the_first() {
        let mut totals = CpuTotals::new();
        let mut s = pod_stats(
            owner(),
            SystemTime::UNIX_EPOCH,
            &metrics("2026-12-03T10:00:00Z", "250m", "64Mi"),
            &mut totals,
        )
        .unwrap();
        let gpu = |id: &str| vkd_provider::GpuStats {
            id: id.into(),
            ..Default::default()
        };
        attach_gpus(
            &mut s,
            &[("main".into(), gpu("a")), ("gone".into(), gpu("b"))],
        );
        let ids: Vec<&str> = s.containers[0].gpus.iter().map(|g| g.id.as_str()).collect();
        assert_eq!(ids, ["a", "b"]);
    }

    #[test]
    fn windows_are_read_as_go_writes_them() {
        for (text, secs) in [
            ("10s", 10.0),
            ("1m0s", 60.0),
            ("10.5s", 10.5),
            ("1m30s", 90.0),
        ] {
            assert_eq!(
                window_of(&json!(text)).unwrap(),
                Duration::from_secs_f64(secs),
                "{text}"
            );
        }
        for bad in ["", "10", "s", "2h", "1m0", "-1s"] {
            assert!(window_of(&json!(bad)).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_bad_reply_is_an_error_not_a_panic() {
        let mut totals = CpuTotals::new();
        for bad in [
            json!({}),
            json!({"timestamp": "never", "window": "10s", "containers": []}),
            json!({"timestamp": "2026-12-03T10:00:00Z", "window": "99999h", "containers": []}),
            metrics("2026-12-03T10:00:00Z", "lots", "1Mi"),
            metrics("2026-12-03T10:00:00Z", "1", "-1Mi"),
            metrics("2026-12-03T10:00:00Z", "99999999999999999999", "1Mi"),
        ] {
            assert!(
                pod_stats(owner(), SystemTime::UNIX_EPOCH, &bad, &mut totals).is_err(),
                "{bad}"
            );
        }
    }
}
