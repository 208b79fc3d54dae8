//! A partition from the API server: what the node does while it cannot
//! renew its lease (`vkd.io/partition-policy`).

use super::*;

impl PodController {
    /// Stops the instances of `fence`-policy Pods when the node lease has not
    /// been renewed for `partition_fence_after`: by then the control plane may
    /// be about to replace them elsewhere.
    pub(super) async fn partition_watch(&self, shutdown: CancellationToken) {
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                () = tokio::time::sleep(Duration::from_secs(1)) => {}
            }
            let last = self.shared.last_lease_renewal.load(Ordering::Acquire);
            if last == 0 {
                continue;
            }
            let now = SystemTime::now()
                .duration_since(SystemTime::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64);
            let silent = Duration::from_millis(now.saturating_sub(last));
            if silent < self.settings.partition_fence_after {
                continue;
            }
            self.fence_for_partition(&format!("node lease not renewed for {}s", silent.as_secs()))
                .await;
        }
    }

    /// Stops the instances of Pods annotated `vkd.io/partition-policy: fence`.
    /// Called while this replica's epoch is still the newest: when the node lease
    /// went unrenewed too long, and when leadership is lost for want of renewal
    /// (before anyone else can take over).
    pub async fn fence_for_partition(&self, why: &str) {
        let fenced = |uid: &str| {
            self.shared
                .partition_fenced
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .contains(uid)
        };
        let targets: Vec<PodRecord> = self
            .records()
            .values()
            .filter(|r| r.fence_on_partition && r.pending.is_none() && !fenced(&r.uid))
            .map(|r| PodRecord::clone(r))
            .collect();
        for rec in targets {
            self.cx().audit_removed(
                &rec.uid,
                &rec.key(),
                rec.instance_id.as_deref().unwrap_or(""),
                self.settings.epoch,
                Decided::Fenced,
                &format!("partition: {why} (vkd.io/partition-policy: fence)"),
            );
            match self
                .provider
                .delete(&self.fence(), &rec.uid, Duration::ZERO)
                .await
            {
                Ok(()) => {
                    self.shared.metrics.partition_fenced.inc();
                    self.shared
                        .partition_fenced
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .insert(rec.uid.to_string());
                }
                Err(e) => {
                    warn!(error = %e, pod = %rec.key(), "partition fence: stopping the instance failed")
                }
            }
        }
    }
}
