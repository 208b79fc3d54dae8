//! The node's admission step: the Node as it is now (watched, so `kubectl
//! label node` and `kubectl taint node` count from the next Pod on) and the
//! Pods already admitted, through the kubelet's checks ([`admission`]).

use k8s_openapi::api::core::v1::Node;

use super::admission::{self, InUse, NodeView, Rejection};
use super::*;

impl Cx<'_> {
    /// The Node read now, not from the watch (it may lag a label just added).
    async fn fresh_node_view(&self) -> Result<Arc<NodeView>, ReconcileError> {
        let nodes: Api<Node> = Api::all(self.client.clone());
        let node = nodes.get(&self.settings.node).await?;
        Ok(self.set_node_view(&node))
    }

    /// Admits the Pod to the node as the kubelet does, or says why not. Checks
    /// and marks under the records' lock, so two Pods asking for one host port
    /// at once never both get it.
    pub(super) async fn admit_to_node(
        &self,
        rec: &PodRecord,
    ) -> Result<Result<(), Rejection>, ReconcileError> {
        let cached = self
            .node_view
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let node = match cached {
            Some(n) => n,
            None => self.fresh_node_view().await?,
        };
        let verdict = match self.admit_against(&rec.uid, &node) {
            // As the kubelet: when only the labels refused it, look at the Node again.
            Err(r) if r.is_node_affinity() => {
                let node = self.fresh_node_view().await?;
                self.admit_against(&rec.uid, &node)
            }
            other => other,
        };
        if let Err(rejection) = &verdict {
            let detail = format!("{}: {}", rejection.reason, rejection.message);
            self.decided(&rec.uid, &rec.key(), "", Decided::Rejected, detail);
        }
        Ok(verdict)
    }

    fn admit_against(&self, uid: &str, node: &NodeView) -> Result<(), Rejection> {
        let mut records = self.store.lock();
        let Some(rec) = records.get(uid) else {
            return Ok(());
        };
        if rec.progress.admitted {
            return Ok(());
        }
        // The Pod itself holds nothing yet (not admitted, its spec pending), so
        // the others need no telling apart from it: no UID compared per Pod.
        let counts_itself = rec.holds_node();
        let mut in_use = InUse::default();
        for other in records
            .values()
            .filter(|r| r.holds_node() && (!counts_itself || *r.uid != *uid))
        {
            in_use.pods += 1;
            let held = other.node_claim.as_deref().map(|c| &*c.host_ports);
            in_use.host_ports.extend(held.into_iter().flatten());
        }
        let asks_nothing = admission::Requirements::default();
        let claim = rec.node_claim.as_deref();
        let wanted = claim
            .and_then(|c| c.requirements.as_ref())
            .unwrap_or(&asks_nothing);
        admission::admit(wanted, claim.map(|c| &*c.host_ports), node, &in_use)?;
        if self.settings.dra.is_some()
            && let Some(pending) = rec.pending.as_deref()
        {
            admission::gpus_behind_claims(&pending.spec, &pending.claims)?;
        }
        if let Some(rec) = records.get_mut(uid) {
            rec.admit();
        }
        Ok(())
    }
}
