//! What code outside the Pod layer sees of it: reads only. The kubelet API,
//! the admin server and the stats handlers hold a [`PodIndex`], never the
//! controller, so nothing outside `pods` can start, change or stop a Pod;
//! the controller's own reads are visible inside `pods` only.

use std::sync::Arc;

use vkd_provider::{PodRef, Provider, ProviderError};

use super::PodController;
use crate::explain::{InstanceAnswer, NodeAnswer, PodAnswer};

/// A read-only view of one node's Pods. Cheap to clone.
#[derive(Clone, Debug)]
pub struct PodIndex(Arc<PodController>);

impl PodIndex {
    /// The node these Pods are bound to.
    pub fn node(&self) -> &str {
        self.0.node()
    }

    /// The backend, for reads (logs, exec, stats, listings).
    pub fn provider(&self) -> &Arc<dyn Provider> {
        self.0.provider()
    }

    pub fn metrics(&self) -> &Arc<crate::metrics::Metrics> {
        self.0.metrics()
    }

    /// True once the first full list of this node's Pods was processed.
    pub fn synced(&self) -> bool {
        self.0.synced()
    }

    /// The UID and container names of a Pod bound to this node.
    pub fn lookup(&self, namespace: &str, name: &str) -> Option<(String, Vec<String>)> {
        self.0.lookup(namespace, name)
    }

    /// Every Pod bound to this node: UID, namespace, name.
    pub fn pods(&self) -> Vec<PodRef> {
        self.0.pods()
    }

    /// Keys waiting in the reconcile queue.
    pub fn queue_depth(&self) -> usize {
        self.0.queue_depth()
    }

    /// Since the node's Lease was last renewed.
    pub fn lease_age(&self) -> Option<std::time::Duration> {
        self.0.lease_age()
    }

    /// Pods by the phase the API server holds.
    pub fn phases(&self) -> Vec<(String, i64)> {
        self.0.phases()
    }

    /// Pods by their instance's phase in the backend.
    pub fn backend_phases(&self) -> Vec<(String, i64)> {
        self.0.backend_phases()
    }

    /// Pods deleted and waiting for their instance to go.
    pub fn deletions_pending(&self) -> usize {
        self.0.deletions_pending()
    }

    pub async fn explain_pod(&self, namespace: &str, name: &str) -> Option<PodAnswer> {
        self.0.explain_pod(namespace, name).await
    }

    pub async fn explain_node(&self) -> NodeAnswer {
        self.0.explain_node().await
    }

    pub async fn explain_instance(&self, id: &str) -> Result<InstanceAnswer, ProviderError> {
        self.0.explain_instance(id).await
    }
}

impl PodController {
    /// The read-only view of this controller's Pods.
    pub fn index(self: &Arc<Self>) -> PodIndex {
        PodIndex(Arc::clone(self))
    }
}
