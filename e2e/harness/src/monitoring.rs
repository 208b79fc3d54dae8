//! A real Prometheus (Debian's build) and kube-state-metrics (Go modules)
//! beside a suite's cluster, both from `e2e/cluster build-monitoring`: the
//! dashboard's queries are evaluated by the engine a user runs them on.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use serde_json::Value;

use crate::{Cluster, free_port, repo_root, spawn_logged, wait_for};

/// How often Prometheus scrapes here: two samples (what `rate` needs) come
/// within seconds.
pub const SCRAPE_INTERVAL: Duration = Duration::from_secs(2);

/// The directory with `prometheus` and `kube-state-metrics`, built or unpacked
/// once and cached by `e2e/cluster`.
pub fn binaries() -> Result<PathBuf> {
    let out = Command::new(repo_root().join("e2e/cluster"))
        .arg("build-monitoring")
        .stdin(Stdio::null())
        .stderr(Stdio::inherit())
        .output()
        .context("running e2e/cluster build-monitoring")?;
    if !out.status.success() {
        bail!("e2e/cluster build-monitoring failed ({})", out.status);
    }
    Ok(PathBuf::from(String::from_utf8(out.stdout)?.trim()))
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
    child: Child,
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
        let child = spawn_logged(&bin, &args, &c.log_path("prometheus"), "")?;
        let mut p = Self { child, port };
        let log = c.log_path("prometheus");
        wait_for("Prometheus to be ready", Duration::from_secs(30), || {
            if let Some(status) = p.child.try_wait()? {
                bail!("prometheus exited ({status}); see {}", log.display());
            }
            Ok(p.get("/-/ready").ok().map(|_| ()))
        })?;
        Ok(p)
    }

    fn get(&self, path: &str) -> Result<String> {
        let out = Command::new("curl")
            .args(["-sSf", "--max-time", "10"])
            .arg(format!("http://127.0.0.1:{}{path}", self.port))
            .output()?;
        if !out.status.success() {
            bail!("GET {path}: {}", String::from_utf8_lossy(&out.stderr));
        }
        Ok(String::from_utf8(out.stdout)?)
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

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// kube-state-metrics on loopback, reading the cluster as its admin.
#[derive(Debug)]
pub struct KubeStateMetrics {
    child: Child,
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
        let child = spawn_logged(&bin, &args, &c.log_path("kube-state-metrics"), "")?;
        let mut k = Self { child, port };
        let log = c.log_path("kube-state-metrics");
        wait_for(
            "kube-state-metrics to serve",
            Duration::from_secs(60),
            || {
                if let Some(status) = k.child.try_wait()? {
                    bail!(
                        "kube-state-metrics exited ({status}); see {}",
                        log.display()
                    );
                }
                let ok = Command::new("curl")
                    .args(["-sSf", "--max-time", "5"])
                    .arg(format!("http://127.0.0.1:{port}/metrics"))
                    .output()?;
                Ok(String::from_utf8_lossy(&ok.stdout)
                    .contains("kube_pod_info")
                    .then_some(()))
            },
        )?;
        Ok(k)
    }
}

impl Drop for KubeStateMetrics {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// prometheus-adapter serving `custom.metrics.k8s.io` from a [`Prometheus`],
/// with the rules in `testdata/monitoring/adapter-rules.yaml`; stopped on drop.
#[derive(Debug)]
pub struct PrometheusAdapter {
    child: Child,
    pub port: u16,
}

impl PrometheusAdapter {
    /// Deploys the adapter's objects on `c`, starts it against `prometheus`,
    /// and waits until the APIService `v1beta1.custom.metrics.k8s.io` is
    /// Available.
    pub fn start(c: &Cluster, prometheus: &Prometheus) -> Result<Self> {
        let bin = binaries()?.join("prometheus-adapter");
        let port = free_port()?;
        let manifest = std::fs::read_to_string(
            repo_root().join("testdata/monitoring/prometheus-adapter.yaml"),
        )?
        .replace("port: PORT", &format!("port: {port}"));
        c.kubectl_stdin(&["apply", "-f", "-"], Some(&manifest))?;
        let kubeconfig = c.dir().join("kubeconfig-prometheus-adapter");
        c.write_token_kubeconfig(&kubeconfig, "kube-system", "prometheus-adapter")?;
        let certs = c.dir().join("prometheus-adapter-certs");
        std::fs::create_dir_all(&certs)?;
        let kc = kubeconfig.display().to_string();
        let rules = repo_root().join("testdata/monitoring/adapter-rules.yaml");
        let args: Vec<String> = vec![
            format!("--lister-kubeconfig={kc}"),
            format!("--authentication-kubeconfig={kc}"),
            format!("--authorization-kubeconfig={kc}"),
            format!("--secure-port={port}"),
            "--bind-address=127.0.0.1".into(),
            format!("--cert-dir={}", certs.display()),
            format!("--prometheus-url=http://127.0.0.1:{}/", prometheus.port),
            format!("--config={}", rules.display()),
            // Series new since it started are found within seconds.
            "--metrics-relist-interval=5s".into(),
        ];
        let log = c.log_path("prometheus-adapter");
        let child = spawn_logged(&bin, &args, &log, "")?;
        let mut a = Self { child, port };
        wait_for(
            "the custom.metrics.k8s.io APIService to be Available",
            Duration::from_secs(90),
            || {
                if let Some(status) = a.child.try_wait()? {
                    bail!(
                        "prometheus-adapter exited ({status}); see {}",
                        log.display()
                    );
                }
                let s = c.kubectl_json(&["get", "apiservice", "v1beta1.custom.metrics.k8s.io"])?;
                Ok(crate::condition(&s, "Available")
                    .filter(|a| a["status"] == "True")
                    .map(|_| ()))
            },
        )?;
        Ok(a)
    }
}

impl Drop for PrometheusAdapter {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
