//! A deleted Pod: its instance stopped, its final status written, then
//! the Pod removed.

use super::*;

impl Cx<'_> {
    /// Graceful deletion: stop the instance, confirm it is gone, then let the Pod go.
    ///
    /// Before the Pod goes, its final status is written, as the kubelet's is
    /// when it has stopped a Pod's containers: their ends, and a terminal phase.
    pub(super) async fn finalize(
        &self,
        rec: &PodRecord,
        grace: u32,
    ) -> Result<Action, ReconcileError> {
        let uid = &*rec.uid;
        if rec.progress.delete_sent {
            return Ok(Action::Done);
        }
        self.admitter.release(uid);
        // Read before the delete call, which may remove a stopped instance at once.
        let mut seen = None;
        let mut final_written = rec.terminal();
        if !final_written {
            seen = self.provider.get(uid).await?;
            if let Some(i) = seen.as_ref().filter(|i| {
                matches!(
                    i.phase,
                    vkd_provider::InstancePhase::Succeeded | vkd_provider::InstancePhase::Failed
                )
            }) {
                // Stopped: every container's end is known.
                self.write_final_status(rec, Some(i.clone())).await?;
                final_written = true;
            }
        }
        if let Err(e) = self
            .provider
            .delete(&self.fence(), uid, Duration::from_secs(grace.into()))
            .await
        {
            let note = format!(
                "backend {} could not delete instance: {e}; retrying",
                self.provider.name()
            );
            self.events
                .repeating_event(rec, "DeletionFailed", &note, "Delete")
                .await;
            return Err(e.into());
        }
        if let Some(i) = self.provider.get(uid).await? {
            debug!(instance = %i.id, "waiting for the backend to confirm deletion");
            return Ok(Action::After(DELETE_CONFIRM));
        }
        if !final_written {
            // Gone before its end was seen: the kubelet's unknown ends.
            self.write_final_status(rec, seen).await?;
        }
        self.audit_removed(
            uid,
            &rec.key(),
            rec.instance_id.as_deref().unwrap_or(""),
            self.settings.epoch,
            Decided::Removed,
            "pod deleted",
        );
        self.throttle("delete").await;
        let api: Api<Pod> = Api::namespaced(self.client.clone(), &rec.namespace);
        let params = DeleteParams {
            grace_period_seconds: Some(0),
            preconditions: Some(Preconditions {
                uid: Some(uid.to_owned()),
                resource_version: None,
            }),
            ..DeleteParams::default()
        };
        match api.delete(&rec.name, &params).await {
            // Accepted, already gone, or the name now belongs to a newer Pod.
            Ok(_) => {}
            Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => {}
            Err(e) => return Err(e.into()),
        }
        self.update(uid, |p| p.delete_sent = true);
        Ok(Action::Done)
    }

    /// The status of a Pod whose instance is stopped for good (see
    /// [`status::terminal_instance`]), from the instance as last seen.
    pub(super) async fn write_final_status(
        &self,
        rec: &PodRecord,
        seen: Option<Instance>,
    ) -> Result<(), ReconcileError> {
        // An instance already gone (removed in a partition, say) left no IP to
        // report: the status keeps the IP it has.
        let known = seen.is_some();
        let inst = status::terminal_instance(rec, seen, SystemTime::now());
        self.write_status_of(rec, Some(&inst), &Waiting::Creating, known)
            .await
    }
}
