//! A real Prometheus (Debian's build) and kube-state-metrics (Go modules)
//! beside a suite's cluster, both from `e2e/cluster build-monitoring`: the
//! dashboard's queries are evaluated by the engine a user runs them on.

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use anyhow::{Result, bail};
use serde_json::Value;

use crate::aggregated::{Aggregated, Spec};
use crate::{Cluster, Daemon, free_port, repo_root, wait_for};

/// How often Prometheus scrapes here: two samples (what `rate` needs) come
/// within seconds.
pub const SCRAPE_INTERVAL: Duration = Duration::from_secs(2);

/// The directory with `prometheus`, `kube-state-metrics` and
/// `prometheus-adapter`, built or unpacked once and cached by `e2e/cluster`.
pub fn binaries() -> Result<PathBuf> {
    crate::built("build-monitoring")
}

/// One scrape job: a target `host:port` and its path.
#[derive(Clone, Debug)]
pub struct Job {
    pub name: String,
    pub target: String,
    pub path: String,
    /// Keep the scraped series' own `namespace`/`pod` labels (as a
    /// PodMonitor with `honorLabels: true` does).
    pub honor_labels: bool,
}

/// A running Prometheus; stopped on drop.
#[derive(Debug)]
pub struct Prometheus {
    _daemon: Daemon,
    pub port: u16,
}

impl Prometheus {
    /// Starts Prometheus scraping `jobs` every [`SCRAPE_INTERVAL`] and waits
    /// until it answers queries.
    pub fn start(c: &Cluster, jobs: &[Job]) -> Result<Self> {
        let bin = binaries()?.join("prometheus");
        let dir = c.dir().join("prometheus");
        std::fs::create_dir_all(dir.join("data"))?;
        let mut config = format!(
            "global: {{scrape_interval: {0}s, evaluation_interval: {0}s}}\nscrape_configs:\n",
            SCRAPE_INTERVAL.as_secs()
        );
        for j in jobs {
            config.push_str(&format!(
                "- job_name: {}\n  metrics_path: {}\n  honor_labels: {}\n  static_configs: [{{targets: ['{}']}}]\n",
                j.name, j.path, j.honor_labels, j.target
            ));
        }
        let config_path = dir.join("prometheus.yml");
        std::fs::write(&config_path, config)?;
        let port = free_port()?;
        let args: Vec<String> = vec![
            format!("--config.file={}", config_path.display()),
            format!("--storage.tsdb.path={}", dir.join("data").display()),
            format!("--web.listen-address=127.0.0.1:{port}"),
        ];
        let mut daemon = Daemon::start(c, "prometheus", &bin, &args)?;
        wait_for("Prometheus to be ready", Duration::from_secs(30), || {
            daemon.ensure_running()?;
            Ok(get(port, "/-/ready").ok().map(|_| ()))
        })?;
        Ok(Self {
            _daemon: daemon,
            port,
        })
    }

    fn get(&self, path: &str) -> Result<String> {
        get(self.port, path)
    }

    /// The instant vector `expr` evaluates to now: each series' labels and value.
    pub fn query(&self, expr: &str) -> Result<Vec<(Value, String)>> {
        let out = Command::new("curl")
            .args(["-sSf", "--max-time", "10", "-G", "--data-urlencode"])
            .arg(format!("query={expr}"))
            .arg(format!("http://127.0.0.1:{}/api/v1/query", self.port))
            .output()?;
        if !out.status.success() {
            bail!("query {expr}: {}", String::from_utf8_lossy(&out.stderr));
        }
        let v: Value = serde_json::from_slice(&out.stdout)?;
        if v["status"] != "success" {
            bail!("query {expr}: {v}");
        }
        Ok(v["data"]["result"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|s| {
                let value = s["value"][1].as_str().unwrap_or_default().to_owned();
                (s["metric"].clone(), value)
            })
            .collect())
    }

    /// Each target's job and health (`up`, `down`, `unknown`) and last error.
    pub fn targets(&self) -> Result<Vec<(String, String, String)>> {
        let v: Value = serde_json::from_str(&self.get("/api/v1/targets")?)?;
        Ok(v["data"]["activeTargets"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|t| {
                let s = |v: &Value| v.as_str().unwrap_or_default().to_owned();
                (s(&t["labels"]["job"]), s(&t["health"]), s(&t["lastError"]))
            })
            .collect())
    }
}

/// GET `path` from a loopback HTTP server on `port`; the body.
fn get(port: u16, path: &str) -> Result<String> {
    let out = Command::new("curl")
        .args(["-sSf", "--max-time", "10"])
        .arg(format!("http://127.0.0.1:{port}{path}"))
        .output()?;
    if !out.status.success() {
        bail!("GET {path}: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(String::from_utf8(out.stdout)?)
}

/// kube-state-metrics on loopback, reading the cluster as its admin.
#[derive(Debug)]
pub struct KubeStateMetrics {
    _daemon: Daemon,
    pub port: u16,
}

impl KubeStateMetrics {
    pub fn start(c: &Cluster) -> Result<Self> {
        let bin = binaries()?.join("kube-state-metrics");
        let (port, telemetry) = (free_port()?, free_port()?);
        let args: Vec<String> = vec![
            format!("--kubeconfig={}", c.kubeconfig().display()),
            "--host=127.0.0.1".into(),
            format!("--port={port}"),
            "--telemetry-host=127.0.0.1".into(),
            format!("--telemetry-port={telemetry}"),
            "--resources=pods,nodes".into(),
        ];
        let mut daemon = Daemon::start(c, "kube-state-metrics", &bin, &args)?;
        wait_for(
            "kube-state-metrics to serve",
            Duration::from_secs(60),
            || {
                daemon.ensure_running()?;
                Ok(get(port, "/metrics")
                    .ok()
                    .filter(|m| m.contains("kube_pod_info"))
                    .map(|_| ()))
            },
        )?;
        Ok(Self {
            _daemon: daemon,
            port,
        })
    }
}

/// prometheus-adapter serving `custom.metrics.k8s.io` from a [`Prometheus`],
/// with the rules in `testdata/monitoring/adapter-rules.yaml`; stopped on drop.
#[derive(Debug)]
pub struct PrometheusAdapter {
    _server: Aggregated,
}

impl PrometheusAdapter {
    /// Deploys the adapter's objects on `c`, starts it against `prometheus`,
    /// and waits until the APIService `v1beta1.custom.metrics.k8s.io` is
    /// Available.
    pub fn start(c: &Cluster, prometheus: &Prometheus) -> Result<Self> {
        let bin = binaries()?.join("prometheus-adapter");
        let kubeconfig = c.dir().join("kubeconfig-prometheus-adapter");
        let rules = repo_root().join("testdata/monitoring/adapter-rules.yaml");
        Aggregated::start(
            c,
            Spec {
                name: "prometheus-adapter",
                bin: &bin,
                manifest: "testdata/monitoring/prometheus-adapter.yaml",
                account: "prometheus-adapter",
                api_service: "v1beta1.custom.metrics.k8s.io",
                args: vec![
                    format!("--lister-kubeconfig={}", kubeconfig.display()),
                    format!("--prometheus-url=http://127.0.0.1:{}/", prometheus.port),
                    format!("--config={}", rules.display()),
                    // Series new since it started are found within seconds.
                    "--metrics-relist-interval=5s".into(),
                ],
            },
        )
        .map(|server| Self { _server: server })
    }
}
