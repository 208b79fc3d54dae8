//! A downstream Pod's GPU use, from the downstream cluster's Prometheus: what
//! its DCGM exporter writes (`DCGM_FI_DEV_GPU_UTIL`, `DCGM_FI_DEV_FB_USED`,
//! `DCGM_FI_DEV_FB_FREE`, labelled with the Pod's `namespace`, `pod` and
//! `container`, as NVIDIA's prometheus-adapter rule reads them). The metrics API
//! has no GPUs, so this is the only place the downstream says them.
//!
//! One instant query per downstream namespace, kept for a few seconds, instead
//! of one per Pod. Every figure is the downstream's word: checked, bounded, and
//! a Pod with too many series keeps only the first [`MAX_GPUS_PER_POD`].

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::Value;
use vkd_provider::GpuStats;

use crate::config::GpuMetricsConfig;

/// How long one namespace's answer is used for.
const FRESH: Duration = Duration::from_secs(5);
/// How long Prometheus has to answer.
const TIMEOUT: Duration = Duration::from_secs(3);
/// More GPUs than any node holds: the rest of a Pod's series are dropped.
pub const MAX_GPUS_PER_POD: usize = 64;
const MIB: u64 = 1 << 20;

const UTIL: &str = "DCGM_FI_DEV_GPU_UTIL";
const USED: &str = "DCGM_FI_DEV_FB_USED";
const FREE: &str = "DCGM_FI_DEV_FB_FREE";

#[derive(Debug, thiserror::Error)]
pub enum GpuMetricsError {
    #[error("gpuMetrics: {0}")]
    Config(String),
    #[error("asking the downstream Prometheus: {0}")]
    Query(String),
    #[error("the downstream Prometheus answered what is not a vector: {0}")]
    Answer(String),
}

/// A Pod's GPUs, each with the container DCGM names (empty: none named).
pub type PodGpus = Vec<(String, GpuStats)>;
/// Downstream Pod name -> its GPUs.
pub type ByPod = HashMap<String, PodGpus>;

enum Source {
    /// Prometheus at its own URL, with a client of its own (made in the
    /// runtime, at the first question).
    Url(Box<kube::Config>, tokio::sync::OnceCell<kube::Client>),
    /// Through the downstream API server's service proxy, at this path.
    Service(String),
}

pub struct GpuMetrics {
    source: Source,
    cache: tokio::sync::Mutex<HashMap<String, (Instant, Arc<ByPod>)>>,
}

impl std::fmt::Debug for GpuMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let source = match &self.source {
            Source::Url(c, _) => c.cluster_url.to_string(),
            Source::Service(p) => p.clone(),
        };
        f.debug_struct("GpuMetrics")
            .field("source", &source)
            .finish_non_exhaustive()
    }
}

impl GpuMetrics {
    /// What the config's `gpuMetrics` names (checked by its parse).
    pub fn new(cfg: &GpuMetricsConfig) -> Result<Self, GpuMetricsError> {
        let source = match (&cfg.prometheus_url, &cfg.prometheus_service) {
            (Some(url), None) => {
                let uri: http::Uri = url
                    .parse()
                    .map_err(|e| GpuMetricsError::Config(format!("prometheusUrl {url:?}: {e}")))?;
                let mut config = kube::Config::new(uri);
                config.connect_timeout = Some(TIMEOUT);
                config.read_timeout = Some(TIMEOUT);
                Source::Url(Box::new(config), tokio::sync::OnceCell::new())
            }
            (None, Some(service)) => {
                let (namespace, name) = service.split_once('/').ok_or_else(|| {
                    GpuMetricsError::Config(format!(
                        "prometheusService {service:?} is not namespace/name:port"
                    ))
                })?;
                Source::Service(format!(
                    "/api/v1/namespaces/{namespace}/services/{name}/proxy"
                ))
            }
            _ => {
                return Err(GpuMetricsError::Config(
                    "give one of prometheusUrl and prometheusService".into(),
                ));
            }
        };
        Ok(Self {
            source,
            cache: tokio::sync::Mutex::default(),
        })
    }

    /// The GPUs of every Pod in downstream namespace `namespace`; `downstream`
    /// is the downstream API server's client (for the service proxy).
    pub async fn of_namespace(
        &self,
        downstream: &kube::Client,
        namespace: &str,
    ) -> Result<Arc<ByPod>, GpuMetricsError> {
        let mut cache = self.cache.lock().await;
        if let Some((at, found)) = cache.get(namespace)
            && at.elapsed() < FRESH
        {
            return Ok(Arc::clone(found));
        }
        let query: String = form_urlencoded::Serializer::new(String::new())
            .append_pair("query", &query_of(namespace))
            .finish();
        let (client, base) = match &self.source {
            Source::Url(config, client) => {
                let client = client
                    .get_or_try_init(|| async {
                        kube::Client::try_from(kube::Config::clone(config))
                    })
                    .await
                    .map_err(|e| GpuMetricsError::Query(e.to_string()))?;
                (client, "")
            }
            Source::Service(path) => (downstream, path.as_str()),
        };
        let request = http::Request::get(format!("{base}/api/v1/query?{query}"))
            .body(Vec::new())
            .map_err(|e| GpuMetricsError::Query(e.to_string()))?;
        let answer: Value = tokio::time::timeout(TIMEOUT, client.request(request))
            .await
            .map_err(|_| GpuMetricsError::Query(format!("no answer within {TIMEOUT:?}")))?
            .map_err(|e| GpuMetricsError::Query(e.to_string()))?;
        let found = Arc::new(parse(&answer)?);
        cache.retain(|_, (at, _)| at.elapsed() < FRESH);
        cache.insert(namespace.to_owned(), (Instant::now(), Arc::clone(&found)));
        Ok(found)
    }
}

/// PromQL text for a label value: `"` and `\` escaped.
fn quoted(value: &str) -> String {
    format!("\"{}\"", value.replace('\\', "\\\\").replace('"', "\\\""))
}

/// Every DCGM series of a Pod in `namespace`.
fn query_of(namespace: &str) -> String {
    format!(
        "{{__name__=~\"{UTIL}|{USED}|{FREE}\",namespace={},pod!=\"\"}}",
        quoted(namespace)
    )
}

/// One GPU's figures as they come, by series.
#[derive(Default)]
struct Reading {
    container: String,
    stats: GpuStats,
    used_mib: Option<f64>,
    free_mib: Option<f64>,
}

/// A Prometheus instant-vector answer as each Pod's GPUs.
pub fn parse(answer: &Value) -> Result<ByPod, GpuMetricsError> {
    if answer["status"] != "success" {
        return Err(GpuMetricsError::Answer(format!(
            "status {}: {}",
            answer["status"], answer["error"]
        )));
    }
    let result = answer["data"]["result"]
        .as_array()
        .ok_or_else(|| GpuMetricsError::Answer("no data.result list".into()))?;
    // (pod, GPU) -> its reading, in the order first seen.
    let mut readings: Vec<((String, String), Reading)> = Vec::new();
    for series in result {
        let labels = &series["metric"];
        let label = |name: &str| labels[name].as_str().unwrap_or_default().to_owned();
        let (Some(metric), Some(value)) = (
            labels["__name__"].as_str(),
            series["value"][1]
                .as_str()
                .and_then(|v| v.parse::<f64>().ok())
                .filter(|v| v.is_finite() && *v >= 0.0),
        ) else {
            continue;
        };
        let pod = label("pod");
        let uuid = label("UUID");
        let gpu = label("gpu");
        if pod.is_empty() || (uuid.is_empty() && gpu.is_empty()) {
            continue;
        }
        let key = (
            pod,
            if uuid.is_empty() {
                gpu.clone()
            } else {
                uuid.clone()
            },
        );
        let at = match readings.iter().position(|(k, _)| *k == key) {
            Some(i) => i,
            None => {
                if readings.iter().filter(|((p, _), _)| *p == key.0).count() >= MAX_GPUS_PER_POD {
                    continue;
                }
                let stats = GpuStats {
                    id: key.1.clone(),
                    index: gpu.parse().unwrap_or(0),
                    model: label("modelName"),
                    host: label("Hostname"),
                    ..GpuStats::default()
                };
                readings.push((
                    key,
                    Reading {
                        container: label("container"),
                        stats,
                        ..Reading::default()
                    },
                ));
                readings.len() - 1
            }
        };
        let reading = &mut readings[at].1;
        match metric {
            UTIL => reading.stats.utilization_percent = value.min(100.0) as u32,
            USED => reading.used_mib = Some(value),
            FREE => reading.free_mib = Some(value),
            _ => {}
        }
    }
    let bytes = |mib: f64| (mib.min((u64::MAX / MIB) as f64) as u64).saturating_mul(MIB);
    let mut by_pod = ByPod::new();
    for ((pod, _), mut r) in readings {
        let used = r.used_mib.map_or(0, bytes);
        r.stats.memory_used_bytes = used;
        r.stats.memory_total_bytes = used.saturating_add(r.free_mib.map_or(0, bytes));
        by_pod.entry(pod).or_default().push((r.container, r.stats));
    }
    Ok(by_pod)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // a failed unwrap is a failed test
    use super::*;
    use serde_json::json;

    fn series(metric: &str, pod: &str, uuid: &str, gpu: &str, value: &str) -> Value {
        json!({
            "metric": {
                "__name__": metric, "namespace": "vkd-team", "pod": pod, "container": "main",
                "UUID": uuid, "gpu": gpu, "modelName": "NVIDIA H100", "Hostname": "host-b",
            },
            "value": [1_700_000_000.0, value],
        })
    }

    fn answer(result: Vec<Value>) -> Value {
        json!({"status": "success", "data": {"resultType": "vector", "result": result}})
    }

    #[test]
    fn each_gpu_of_a_pod_is_read_from_its_three_series() {
        let found = parse(&answer(vec![
            series(UTIL, "vkd-1", "GPU-a", "0", "73"),
            series(USED, "vkd-1", "GPU-a", "0", "40960"),
            series(FREE, "vkd-1", "GPU-a", "0", "40960"),
            series(UTIL, "vkd-1", "GPU-b", "1", "250"),
            series(UTIL, "vkd-2", "GPU-c", "2", "NaN"),
            series(UTIL, "vkd-2", "GPU-c", "2", "-1"),
        ]))
        .unwrap();
        let one = &found["vkd-1"];
        assert_eq!(one.len(), 2);
        let (container, a) = &one[0];
        assert_eq!(container, "main");
        assert_eq!(
            (a.id.as_str(), a.index, a.model.as_str(), a.host.as_str()),
            ("GPU-a", 0, "NVIDIA H100", "host-b")
        );
        assert_eq!(a.utilization_percent, 73);
        assert_eq!(a.memory_used_bytes, 40960 * MIB);
        assert_eq!(a.memory_total_bytes, 81920 * MIB);
        // A percentage past 100 is 100; a value that is no figure is dropped.
        assert_eq!(one[1].1.utilization_percent, 100);
        assert!(!found.contains_key("vkd-2"));
    }

    #[test]
    fn a_failed_or_shapeless_answer_is_an_error_and_a_flood_is_cut() {
        assert!(parse(&json!({"status": "error", "error": "bad query"})).is_err());
        assert!(parse(&json!({"status": "success", "data": {}})).is_err());
        let many: Vec<Value> = (0..MAX_GPUS_PER_POD + 10)
            .map(|i| series(UTIL, "vkd-1", &format!("GPU-{i}"), &i.to_string(), "1"))
            .collect();
        assert_eq!(
            parse(&answer(many)).unwrap()["vkd-1"].len(),
            MAX_GPUS_PER_POD
        );
    }

    #[test]
    fn the_namespace_is_quoted_in_the_query() {
        assert_eq!(
            query_of("vkd-team"),
            "{__name__=~\"DCGM_FI_DEV_GPU_UTIL|DCGM_FI_DEV_FB_USED|DCGM_FI_DEV_FB_FREE\",namespace=\"vkd-team\",pod!=\"\"}"
        );
        assert_eq!(quoted("a\"b\\"), "\"a\\\"b\\\\\"");
    }
}
