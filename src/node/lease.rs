//! The Node's Lease in `kube-node-lease`: its heartbeat. It is renewed on its
//! own task, as the kubelet's node lease controller is, apart from the status
//! loop that waits on the provider: a backend that stops answering makes the
//! Node say Ready=False with a reason, but never stops the heartbeat (which
//! would make the Node NotReady, and vkd's own partition watch fence Pods,
//! while the API server is reachable).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

use k8s_openapi::api::coordination::v1::Lease;
use kube::api::{Patch, PatchParams};
use kube::{Api, Client};
use serde_json::json;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::warn;

use super::FIELD_MANAGER;

pub(super) struct NodeLease {
    pub(super) client: Client,
    pub(super) node: String,
    pub(super) duration: Duration,
    pub(super) interval: Duration,
    /// Unix milliseconds of the last successful renewal, for the partition policy.
    pub(super) renewed: Arc<AtomicU64>,
}

impl NodeLease {
    /// Renews every `interval` until `stop`. The Lease names the Node as its
    /// owner once the Node's UID is known (`owner`); until then it is renewed
    /// without, as the kubelet does, so registering (which waits on the
    /// provider's capacity) never holds the heartbeat up.
    pub(super) async fn run(self, owner: watch::Receiver<Option<String>>, stop: CancellationToken) {
        let mut tick = tokio::time::interval(self.interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                _ = tick.tick() => {}
            }
            let uid = owner.borrow().clone();
            // A renewal that hangs must not delay the next one.
            match tokio::time::timeout(self.interval, self.renew(uid.as_deref())).await {
                Ok(Ok(())) => {
                    let ms = SystemTime::now()
                        .duration_since(SystemTime::UNIX_EPOCH)
                        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
                    self.renewed.store(ms, Ordering::Release);
                }
                Ok(Err(e)) => {
                    warn!(error = %e, node = %self.node, "renewing the node lease failed")
                }
                Err(_) => warn!(
                    node = %self.node,
                    "renewing the node lease took longer than {}s",
                    self.interval.as_secs_f64()
                ),
            }
        }
    }

    async fn renew(&self, node_uid: Option<&str>) -> Result<(), kube::Error> {
        let api: Api<Lease> = Api::namespaced(self.client.clone(), "kube-node-lease");
        let mut metadata = json!({ "name": self.node });
        if let Some(uid) = node_uid {
            metadata["ownerReferences"] = json!([{
                "apiVersion": "v1", "kind": "Node", "name": self.node, "uid": uid,
            }]);
        }
        let lease = json!({
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": metadata,
            "spec": {
                "holderIdentity": self.node,
                "leaseDurationSeconds": self.duration.as_secs(),
                "renewTime": jiff::Timestamp::now().strftime("%Y-%m-%dT%H:%M:%S%.6fZ").to_string(),
            },
        });
        api.patch(
            &self.node,
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(lease),
        )
        .await
        .map(drop)
    }
}
