//! metrics-server beside a suite's cluster, deployed as a cluster admin deploys
//! it (ServiceAccount, RBAC, APIService through the aggregation layer) but run
//! as a process on loopback. It scrapes every Node's kubelet port, vkd's
//! included, with its ServiceAccount's token, so `kubectl top` and the HPA see
//! exactly what a real cluster's would.

use std::time::Duration;

use anyhow::Result;

use crate::Cluster;
use crate::aggregated::{Aggregated, Spec};

/// How often metrics-server scrapes (its floor is 10 s). CPU is a counter, so
/// a Pod's usage is known a resolution after its second scrape.
pub const RESOLUTION: Duration = Duration::from_secs(10);

/// A running metrics-server; stopped on drop.
#[derive(Debug)]
pub struct MetricsServer {
    _server: Aggregated,
}

impl MetricsServer {
    /// Deploys metrics-server's objects on `c`, starts it, and waits until the
    /// APIService `v1beta1.metrics.k8s.io` is Available.
    pub fn start(c: &Cluster) -> Result<Self> {
        let bin = crate::built("build-metrics-server")?.join("metrics-server");
        let kubeconfig = c.dir().join("kubeconfig-metrics-server");
        Aggregated::start(
            c,
            Spec {
                name: "metrics-server",
                bin: &bin,
                manifest: "testdata/metrics-server/metrics-server.yaml",
                account: "metrics-server",
                api_service: "v1beta1.metrics.k8s.io",
                args: vec![
                    format!("--kubeconfig={}", kubeconfig.display()),
                    // vkd's kubelet port, from the Node as a kubelet's.
                    "--kubelet-use-node-status-port".into(),
                    "--kubelet-preferred-address-types=InternalIP".into(),
                    // The kubelets' serving certificates are self-signed here,
                    // as on most clusters that run metrics-server.
                    "--kubelet-insecure-tls".into(),
                    format!("--metric-resolution={}s", RESOLUTION.as_secs()),
                    // Under the resolution, as it must be; over vkd's 8 s
                    // deadline for a scrape's Pods, so a slow Pod costs its
                    // figures, not the node's.
                    "--kubelet-request-timeout=9s".into(),
                ],
            },
        )
        .map(|server| Self { _server: server })
    }
}
