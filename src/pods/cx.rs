//! What a step works with: a small context of the services it may use, not
//! the controller. A step (create, finalize, fail, the image back-off,
//! ephemeral containers, the volume refresh, the status write, the node's
//! admission) sees the API client, the provider under this term's fence, the
//! admitter, the records, the Event sink and the decision log, and nothing of
//! the watch, the work queue or the collector. Steps call the services here
//! (the fence, writes, Events, decisions, the resolver), the one status
//! writer (`status_write.rs`) and the provider; never another step: what
//! comes next is the reconcile's decision table's to say.

use std::sync::Arc;

use governor::DefaultDirectRateLimiter;
use k8s_openapi::api::core::v1::Node;
use kube::Client;
use vkd_provider::{Fence, Provider};

use super::admission::NodeView;
use super::events::EventSink;
use super::model::PodRecord;
use super::store::PodStore;
use super::{ReconcileError, Settings, Shared, spec};
use crate::explain::Action as Decided;

/// Why a Pod fails while its containers may still run, and how they stop
/// (what the decision table hands [`Cx::stop_and_fail`]).
pub(super) struct Failure<'a> {
    pub(super) reason: &'a str,
    pub(super) message: &'a str,
    /// The grace period its containers get.
    pub(super) grace: std::time::Duration,
    pub(super) event_type: kube::runtime::events::EventType,
}

pub(super) struct Cx<'a> {
    pub(super) settings: &'a Settings,
    pub(super) client: &'a Client,
    pub(super) provider: &'a Arc<dyn Provider>,
    pub(super) admitter: &'a crate::topology::Admitter,
    pub(super) shared: &'a Shared,
    pub(super) store: &'a PodStore,
    pub(super) events: &'a EventSink,
    /// Pod writes wait here; the node lease uses another client and never does.
    pub(super) writes: &'a DefaultDirectRateLimiter,
    /// The Node as admission last read it.
    pub(super) node_view: &'a std::sync::Mutex<Option<Arc<NodeView>>>,
}

impl Cx<'_> {
    /// The fence every mutation of the backend carries in this term.
    pub(super) fn fence(&self) -> Fence {
        Fence {
            node: self.settings.node.clone(),
            epoch: self.settings.epoch,
        }
    }

    /// Waits for the Pod-write rate limiter and counts the write.
    pub(super) async fn throttle(&self, kind: &str) {
        super::throttle(self.writes, &self.shared.metrics, kind).await;
    }

    /// Updates the stored record, if the Pod still has one.
    pub(super) fn touch(&self, uid: &str, f: impl FnOnce(&mut PodRecord)) {
        self.store.touch(uid, f);
    }

    /// Updates what the steps learned of a Pod ([`PodStore::update`]).
    pub(super) fn update<R>(
        &self,
        uid: &str,
        f: impl FnOnce(&mut super::model::Progress) -> R,
    ) -> Option<R> {
        self.store.update(uid, f)
    }

    /// Records a decision in the daemon's log ([`crate::explain::DecisionLog`]).
    pub(super) fn decided(
        &self,
        uid: &str,
        pod: &str,
        instance: &str,
        action: Decided,
        detail: impl Into<String>,
    ) {
        self.shared.decisions.record(
            &self.settings.node,
            uid,
            pod,
            instance,
            self.settings.epoch,
            action,
            detail,
        );
    }

    /// The audit line of an instance removed or stopped, and its decision.
    pub(super) fn audit_removed(
        &self,
        uid: &str,
        pod: &str,
        instance: &str,
        instance_epoch: u64,
        action: Decided,
        cause: &str,
    ) {
        crate::fencing::audit(
            uid,
            pod,
            &self.settings.node,
            self.provider.name(),
            instance,
            instance_epoch,
            cause,
        );
        let detail = if instance_epoch == self.settings.epoch {
            cause.to_owned()
        } else {
            format!("{cause} (instance made under epoch {instance_epoch})")
        };
        self.decided(uid, pod, instance, action, detail);
    }

    /// What resolves `pending` (ConfigMaps, Secrets, Services, fieldRefs) for
    /// this node; with the node's allocatable when the spec reads it.
    pub(super) async fn resolver(
        &self,
        pending: &spec::Pending,
    ) -> Result<spec::Resolver<'_>, ReconcileError> {
        let allocatable = if pending.reads_allocatable {
            Some(self.admitter.allocatable().await?)
        } else {
            None
        };
        Ok(spec::Resolver {
            client: self.client,
            policy: &self.settings.policy,
            host_ip: &self.settings.host_ip,
            volumes: self.provider.capabilities().volumes == vkd_provider::Support::Supported,
            services: self.shared.services.as_ref(),
            allocatable,
        })
    }

    /// Keeps the Node as admission reads it.
    pub(super) fn set_node_view(&self, node: &Node) -> Arc<NodeView> {
        let view = Arc::new(NodeView::of(node));
        *self.node_view.lock().unwrap_or_else(|p| p.into_inner()) = Some(Arc::clone(&view));
        view
    }
}
