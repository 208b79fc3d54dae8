//! The Kubernetes provider's config file (`--provider-config`, YAML).
//!
//! ```yaml
//! kubeconfig: /etc/vkd/downstream.kubeconfig   # the downstream cluster (required)
//! namespacePrefix: "vkd-"         # upstream namespace ns runs downstream in vkd-ns
//! hostSelector: "gpu=true"        # which downstream Nodes count as hosts (default: all)
//! gpuResource: nvidia.com/gpu     # the extended resource that counts GPUs
//! gpuLabels:                      # where a Node says what its GPUs are (GPU Feature Discovery's names)
//!   product: nvidia.com/gpu.product
//!   memory: nvidia.com/gpu.memory # MiB per GPU
//!   count: nvidia.com/gpu.count
//!   clique: nvidia.com/gpu.clique # an NVLink domain
//! clusterName: gpu-east           # in instance ids (default: the kubeconfig's cluster)
//! fenceNamespace: vkd-system      # where the fence objects live downstream
//! podSecurity: baseline           # enforced in the namespaces vkd creates downstream
//! outageGrace: 5m                 # the upstream Node stays Ready this long with the downstream unreachable
//! gpuMetrics:                     # where the downstream's DCGM exporter figures are (default: nowhere)
//!   prometheusUrl: http://prometheus.gpu-east.example:9090
//!   # or, through the downstream API server's service proxy:
//!   # prometheusService: monitoring/prometheus-k8s:9090
//! ```

use std::path::{Path, PathBuf};

use serde::Deserialize;

/// Label names that describe a Node's GPUs.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct GpuLabels {
    #[serde(default = "GpuLabels::default_product")]
    pub product: String,
    #[serde(default = "GpuLabels::default_memory")]
    pub memory: String,
    #[serde(default = "GpuLabels::default_count")]
    pub count: String,
    #[serde(default = "GpuLabels::default_clique")]
    pub clique: String,
}

impl GpuLabels {
    fn default_product() -> String {
        "nvidia.com/gpu.product".into()
    }
    fn default_memory() -> String {
        "nvidia.com/gpu.memory".into()
    }
    fn default_count() -> String {
        "nvidia.com/gpu.count".into()
    }
    fn default_clique() -> String {
        "nvidia.com/gpu.clique".into()
    }
}

impl Default for GpuLabels {
    fn default() -> Self {
        Self {
            product: Self::default_product(),
            memory: Self::default_memory(),
            count: Self::default_count(),
            clique: Self::default_clique(),
        }
    }
}

#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct KubernetesConfig {
    /// The downstream cluster's kubeconfig.
    pub kubeconfig: PathBuf,
    #[serde(default = "default_prefix")]
    pub namespace_prefix: String,
    /// A label selector over the downstream Nodes; empty: every Node.
    #[serde(default)]
    pub host_selector: String,
    #[serde(default = "default_gpu")]
    pub gpu_resource: String,
    #[serde(default)]
    pub gpu_labels: GpuLabels,
    /// The downstream cluster's name in instance ids and annotations
    /// (default: the kubeconfig's current cluster).
    #[serde(default)]
    pub cluster_name: Option<String>,
    /// Where vkd keeps its fence objects in the downstream cluster (the
    /// namespace `manifests/downstream` binds the fence policy to).
    #[serde(default = "default_fence_namespace")]
    pub fence_namespace: String,
    /// The Pod Security level enforced in the namespaces vkd creates
    /// downstream (`privileged`, `baseline`, `restricted`): the upstream
    /// namespace's level does not travel with the Pod, so the downstream
    /// cluster enforces its own.
    #[serde(default = "default_pod_security")]
    pub pod_security: String,
    /// How long the upstream Node stays Ready while the downstream API server
    /// cannot be reached (its Pods run on); after it, the Node goes
    /// Ready=False and the upstream node lifecycle controller evicts by the
    /// Pods' tolerations. A duration (`90s`, `5m`); `0s` goes at once.
    #[serde(default = "default_outage_grace")]
    pub outage_grace: String,
    /// Where the downstream Pods' GPU use is read (`crate::gpu_metrics`).
    #[serde(default)]
    pub gpu_metrics: Option<GpuMetricsConfig>,
}

/// The downstream cluster's Prometheus, which scrapes its DCGM exporter.
#[derive(Clone, Debug, Default, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct GpuMetricsConfig {
    /// Its URL (`http://` or `https://`), asked with no credentials.
    #[serde(default)]
    pub prometheus_url: Option<String>,
    /// `namespace/name:port` of its Service downstream, asked through the
    /// downstream API server's service proxy with vkd's downstream credentials
    /// (`get` on `services/proxy` there).
    #[serde(default)]
    pub prometheus_service: Option<String>,
}

fn default_outage_grace() -> String {
    "5m".into()
}

fn default_pod_security() -> String {
    "baseline".into()
}

fn default_fence_namespace() -> String {
    "vkd-system".into()
}

fn default_prefix() -> String {
    "vkd-".into()
}
fn default_gpu() -> String {
    "nvidia.com/gpu".into()
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("reading {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("{path}: {field}: {message}")]
    Invalid {
        path: PathBuf,
        field: &'static str,
        message: String,
    },
}

/// Past a day, an outage is a lost cluster, not one to wait for.
const MAX_OUTAGE_GRACE: std::time::Duration = std::time::Duration::from_secs(24 * 3600);

impl KubernetesConfig {
    /// [`Self::outage_grace`], checked by [`Self::parse`].
    pub fn outage_grace(&self) -> std::time::Duration {
        vkd_provider::parse_duration(&self.outage_grace).unwrap_or_default()
    }

    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        Self::parse(&text, path)
    }

    /// Parses and checks config text; `path` names it in errors.
    pub fn parse(text: &str, path: &Path) -> Result<Self, ConfigError> {
        let cfg: Self = serde_yaml_ng::from_str(text).map_err(|e| ConfigError::Parse {
            path: path.to_owned(),
            message: e.to_string(),
        })?;
        let invalid = |field, message: String| ConfigError::Invalid {
            path: path.to_owned(),
            field,
            message,
        };
        if cfg.kubeconfig.as_os_str().is_empty() {
            return Err(invalid("kubeconfig", "is empty".into()));
        }
        // The prefix starts a namespace name, with at least one character
        // after it. Empty, upstream `kube-system` would run in the downstream
        // `kube-system`; and `kube-` names are the cluster's own.
        let prefix = cfg.namespace_prefix.as_str();
        if prefix.is_empty() || prefix.starts_with("kube-") || "kube-".starts_with(prefix) {
            return Err(invalid(
                "namespacePrefix",
                format!(
                    "{prefix:?} must not be empty, and no namespace it starts may begin with \"kube-\" (the cluster's own)"
                ),
            ));
        }
        let probe = format!("{prefix}a");
        if !vkd_provider::is_dns_label(&probe) || cfg.namespace_prefix.len() > 20 {
            return Err(invalid(
                "namespacePrefix",
                format!(
                    "{:?} must be lowercase letters, digits and '-', start with a letter or digit, at most 20 characters",
                    cfg.namespace_prefix
                ),
            ));
        }
        if cfg.gpu_resource.is_empty() || !cfg.gpu_resource.contains('/') {
            return Err(invalid(
                "gpuResource",
                format!(
                    "{:?} is not an extended resource name (domain/name)",
                    cfg.gpu_resource
                ),
            ));
        }
        if let Some(name) = &cfg.cluster_name
            && (name.is_empty() || name.contains('/'))
        {
            return Err(invalid(
                "clusterName",
                format!("{name:?} must be non-empty and without '/'"),
            ));
        }
        if !matches!(
            cfg.pod_security.as_str(),
            "privileged" | "baseline" | "restricted"
        ) {
            return Err(invalid(
                "podSecurity",
                format!(
                    "{:?} is not privileged, baseline or restricted",
                    cfg.pod_security
                ),
            ));
        }
        match vkd_provider::parse_duration(&cfg.outage_grace) {
            Some(d) if d <= MAX_OUTAGE_GRACE => {}
            _ => {
                return Err(invalid(
                    "outageGrace",
                    format!(
                        "{:?} is not a duration of at most 24h (90s, 5m)",
                        cfg.outage_grace
                    ),
                ));
            }
        }
        if let Some(g) = &cfg.gpu_metrics {
            let url_ok = |u: &str| {
                (u.starts_with("http://") || u.starts_with("https://"))
                    && u.parse::<http::Uri>().is_ok_and(|u| u.host().is_some())
            };
            let service_ok = |s: &str| {
                let Some((ns, rest)) = s.split_once('/') else {
                    return false;
                };
                let (name, port) = rest.split_once(':').unwrap_or((rest, ""));
                vkd_provider::is_dns_label(ns)
                    && vkd_provider::is_dns_label(name)
                    && (port.is_empty() || port.parse::<u16>().is_ok_and(|p| p > 0))
            };
            match (&g.prometheus_url, &g.prometheus_service) {
                (Some(u), None) if url_ok(u) => {}
                (None, Some(s)) if service_ok(s) => {}
                (Some(u), None) => {
                    return Err(invalid(
                        "gpuMetrics.prometheusUrl",
                        format!("{u:?} is not an http:// or https:// URL with a host"),
                    ));
                }
                (None, Some(s)) => {
                    return Err(invalid(
                        "gpuMetrics.prometheusService",
                        format!("{s:?} is not namespace/name or namespace/name:port"),
                    ));
                }
                _ => {
                    return Err(invalid(
                        "gpuMetrics",
                        "give one of prometheusUrl and prometheusService".into(),
                    ));
                }
            }
        }
        if !vkd_provider::is_dns_label(&cfg.fence_namespace) {
            return Err(invalid(
                "fenceNamespace",
                format!("{:?} is not a namespace name", cfg.fence_namespace),
            ));
        }
        Ok(cfg)
    }

    /// How upstream namespaces map to downstream ones.
    pub fn mapping(&self) -> crate::naming::Mapping {
        crate::naming::Mapping {
            prefix: self.namespace_prefix.clone(),
            fence_namespace: self.fence_namespace.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // a failed unwrap is a failed test
    use super::*;

    fn parse(text: &str) -> Result<KubernetesConfig, ConfigError> {
        KubernetesConfig::parse(text, Path::new("k.yaml"))
    }

    #[test]
    fn defaults_are_gpu_feature_discoverys_names() {
        let c = parse("kubeconfig: /k").unwrap();
        assert_eq!(c.namespace_prefix, "vkd-");
        assert_eq!(c.gpu_resource, "nvidia.com/gpu");
        assert_eq!(c.gpu_labels.product, "nvidia.com/gpu.product");
        assert_eq!(c.gpu_labels.clique, "nvidia.com/gpu.clique");
        assert!(c.host_selector.is_empty());
        assert_eq!(c.pod_security, "baseline");
        assert_eq!(c.outage_grace(), std::time::Duration::from_secs(300));
        assert_eq!(c.gpu_metrics, None);
        let c =
            parse("kubeconfig: /k\ngpuMetrics: {prometheusService: monitoring/prom:9090}").unwrap();
        assert_eq!(
            c.gpu_metrics.unwrap().prometheus_service.as_deref(),
            Some("monitoring/prom:9090")
        );
    }

    #[test]
    fn bad_config_names_its_field() {
        for (text, field) in [
            ("kubeconfig: ''", "kubeconfig"),
            ("kubeconfig: /k\nnamespacePrefix: Bad_", "namespacePrefix"),
            ("kubeconfig: /k\nnamespacePrefix: ''", "namespacePrefix"),
            ("kubeconfig: /k\nnamespacePrefix: kube-", "namespacePrefix"),
            (
                "kubeconfig: /k\nnamespacePrefix: kube-vkd-",
                "namespacePrefix",
            ),
            ("kubeconfig: /k\nnamespacePrefix: kube", "namespacePrefix"),
            ("kubeconfig: /k\ngpuResource: gpu", "gpuResource"),
            ("kubeconfig: /k\npodSecurity: lax", "podSecurity"),
            ("kubeconfig: /k\noutageGrace: soon", "outageGrace"),
            ("kubeconfig: /k\noutageGrace: 48h", "outageGrace"),
            ("kubeconfig: /k\ngpuMetrics: {}", "gpuMetrics"),
            (
                "kubeconfig: /k\ngpuMetrics: {prometheusUrl: 'ftp://x', prometheusService: m/p}",
                "gpuMetrics",
            ),
            (
                "kubeconfig: /k\ngpuMetrics: {prometheusUrl: 'prometheus:9090'}",
                "gpuMetrics.prometheusUrl",
            ),
            (
                "kubeconfig: /k\ngpuMetrics: {prometheusService: 'prometheus:9090'}",
                "gpuMetrics.prometheusService",
            ),
            (
                "kubeconfig: /k\ngpuMetrics: {prometheusService: 'm/p:0'}",
                "gpuMetrics.prometheusService",
            ),
        ] {
            let e = parse(text).unwrap_err();
            assert!(
                matches!(&e, ConfigError::Invalid { field: f, .. } if *f == field),
                "{text}: {e}"
            );
        }
        let typo = parse("kubeconfig: /k\nhostSelectr: x").unwrap_err();
        assert!(typo.to_string().contains("hostSelectr"), "{typo}");
        assert!(
            parse("namespacePrefix: x").is_err(),
            "kubeconfig is required"
        );
    }
}
