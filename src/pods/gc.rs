//! Collecting what the backend holds and no Pod owns: orphans and
//! duplicates, deleted behind the mass-deletion brake.

use super::*;

impl PodController {
    /// Collects orphans and duplicates: after the first sync, whenever a Pod
    /// disappears, and every `gc_interval`.
    pub(super) async fn collect(&self, shutdown: CancellationToken) {
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                () = self.gc_wake.notified() => {
                    // Let a burst of disappearances arrive, then look once.
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
                () = tokio::time::sleep(self.settings.gc_interval) => {}
            }
            if self.synced() {
                // Stopped mid-pass when the term ends: no delete of an ended term.
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    () = self.gc_pass() => {}
                }
            }
        }
    }

    /// One pass: instances without a Pod are orphans to remove (unless the brake
    /// holds), extra instances of one Pod are duplicates to remove; instances
    /// with a Pod are adopted by their Pods' reconciles (never created again).
    pub(super) async fn gc_pass(&self) {
        let instances = match self.provider.list(&self.settings.node).await {
            Ok(i) => i,
            Err(e) => {
                warn!(error = %e, "listing backend instances for collection failed");
                return;
            }
        };
        let listed = instances.len();
        *self.last_gc_pass.lock().unwrap_or_else(|p| p.into_inner()) = Some(SystemTime::now());
        let plan = {
            let records = self.records();
            crate::fencing::plan(
                &self.settings.node,
                instances,
                |uid| records.contains_key(uid),
                self.settings.brake,
            )
        };
        let mut unowned: std::collections::BTreeMap<String, i64> = Default::default();
        for i in plan.orphans.iter().chain(&plan.duplicates) {
            *unowned.entry(format!("{:?}", i.phase)).or_default() += 1;
        }
        *self
            .unowned_phases
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = unowned.into_iter().collect();
        for d in &plan.duplicates {
            self.shared.metrics.duplicates_found.inc();
            self.cx().audit_removed(
                &d.owner.uid,
                &d.owner.to_string(),
                &d.id,
                d.epoch,
                Decided::Removed,
                "duplicate instance (a newer epoch has one for this Pod)",
            );
            if let Err(e) = self
                .provider
                .delete_instance(&self.fence(), &d.id, Duration::ZERO)
                .await
            {
                warn!(error = %e, instance = %d.id, "deleting a duplicate instance failed; next pass retries");
            }
        }
        if let Some(why) = &plan.braked {
            self.shared.metrics.gc_braked.inc();
            warn!(
                orphans = plan.orphans.len(),
                listed, "orphan collection braked: {why}"
            );
            self.cx().decided("", "", "", Decided::Braked, why.clone());
            self.events.node_event("OrphanDeletionBraked", why).await;
            return;
        }
        let n = plan.orphans.len();
        for o in plan.orphans {
            self.approved_orphans
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .insert(o.owner.uid.clone());
            self.queue.add(&o.owner.uid);
        }
        debug!(listed, orphans = n, "collection pass");
    }

    /// An instance whose Pod is gone from the API (force-deleted, or deleted while
    /// vkd was down) is removed, but only once the watch has synced.
    pub(super) async fn remove_orphan(&self, uid: &str) -> Result<Action, ReconcileError> {
        self.admitter.release(uid);
        let done = |this: &Self| {
            this.approved_orphans
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .remove(uid);
        };
        let Some(instance) = self.provider.get(uid).await? else {
            done(self);
            return Ok(Action::Done);
        };
        if instance.node != self.settings.node {
            done(self);
            return Ok(Action::Done);
        }
        self.provider
            .delete(&self.fence(), uid, Duration::ZERO)
            .await?;
        match self.provider.get(uid).await? {
            Some(_) => Ok(Action::After(DELETE_CONFIRM)),
            None => {
                self.cx().audit_removed(
                    uid,
                    &instance.owner.to_string(),
                    &instance.id,
                    self.settings.epoch,
                    Decided::Removed,
                    "pod gone from the API",
                );
                self.shared.metrics.orphans_removed.inc();
                done(self);
                Ok(Action::Done)
            }
        }
    }
}
