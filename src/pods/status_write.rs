//! Writing a Pod's status to the API server when it differs from what the
//! server holds.

use super::*;

impl Cx<'_> {
    pub(super) async fn write_status(
        &self,
        rec: &PodRecord,
        instance: Option<&Instance>,
        waiting: &Waiting,
    ) -> Result<(), ReconcileError> {
        // A backend with Pod networking reports the IP itself, maybe later; a
        // hostNetwork Pod has the host's on any backend.
        let shares_host_ip = instance.is_some()
            && (rec.host_network
                || self.provider.capabilities().pod_network != vkd_provider::Support::Supported);
        self.write_status_of(rec, instance, waiting, shares_host_ip)
            .await
    }

    /// [`Self::write_status`]; `host_ip_as_pod_ip` says whether an instance with
    /// no IP of its own shares the host's (false when the instance is gone and
    /// its IP unknown: the Pod keeps the IP it has, never a second one).
    pub(super) async fn write_status_of(
        &self,
        rec: &PodRecord,
        instance: Option<&Instance>,
        waiting: &Waiting,
        host_ip_as_pod_ip: bool,
    ) -> Result<(), ReconcileError> {
        let mut view = status::desired_view(rec, instance, waiting);
        // A spec change (a new generation) is answered even when nothing else moved.
        view.observed_generation = (rec.generation > 0).then_some(rec.generation);
        if view.pod_ip.is_none() && host_ip_as_pod_ip {
            // A backend without Pod networking (processes) shares the host's, as
            // hostNetwork Pods do: the kubelet reports the host IP as the Pod IP.
            view.pod_ip = Some(self.settings.host_ip.clone());
        }
        if view.digest() == rec.observed_digest {
            return Ok(());
        }
        let now = SystemTime::now();
        // The timeline and the start time are the steps' (admission and
        // creation may have written the stored record's since `rec` was read).
        let running = view
            .containers
            .iter()
            .any(|c| c.state == status::StateView::Running);
        let ready = view.conditions[3] == Some(true);
        let timeline = self.update(&rec.uid, |p| {
            if running {
                p.timeline.started.get_or_insert(now.into());
            }
            let newly_ready = ready && p.timeline.ready.is_none();
            if newly_ready {
                p.timeline.ready = Some(now.into());
            }
            (p.timeline.clone(), newly_ready)
        });
        let Some((timeline, newly_ready)) = timeline else {
            debug!("the Pod is gone; its status is not written");
            return Ok(());
        };
        if newly_ready && let Some(base) = timeline.bound.or(timeline.observed).map(Stamp::time) {
            let since = |x: Option<Stamp>| x.and_then(|x| x.time().duration_since(base).ok());
            let stages: Vec<(&str, Duration)> = timeline
                .stages()
                .into_iter()
                .filter_map(|(n, x)| Some((n, since(x)?)))
                .collect();
            self.shared.metrics.started(&stages);
        }
        // What the patch says the Pod's clock started at.
        let start = Stamp::from(status::start_time(rec, &timeline, now));
        let body =
            status::patch_body_at(rec, &timeline, &view, instance, &self.settings.host_ip, now);
        self.patch_status(rec, body).await?;
        debug!(phase = %view.phase, "status written");
        let observed = view.observed();
        self.touch(&rec.uid, |r| {
            r.observe(&observed, now);
            r.observe_start(start);
        });
        Ok(())
    }

    /// How much longer a new instance's first status is held back: while it is
    /// only being created, for `--status-merge-window` after the create, so
    /// that an instance that starts at once costs one status write, not a
    /// ContainerCreating one and then a Running one. The kubelet's status
    /// manager merges the same way what changes before its next sync. `None`:
    /// write now (a status of this instance was written, it is past the
    /// window, or something a person must see has happened).
    pub(super) fn first_status_held(
        &self,
        rec: &PodRecord,
        instance: &Instance,
    ) -> Option<Duration> {
        let window = self.settings.status_merge_window;
        if window.is_zero()
            || rec.instance_id.is_some()
            || instance.phase != vkd_provider::InstancePhase::Pending
            || !only_being_created(instance)
        {
            return None;
        }
        let accepted = rec.progress.timeline.accepted?.time();
        let held = SystemTime::now()
            .duration_since(accepted)
            .unwrap_or_default();
        window.checked_sub(held).filter(|left| !left.is_zero())
    }

    /// Patches the status of `rec`'s Pod, and only of that Pod: the patch
    /// carries its UID, as the kubelet's does, so a Pod deleted and made
    /// again under the same name (a StatefulSet's) is never given the old
    /// one's status or instance. That refusal, like a Pod already gone, is
    /// not an error: the watch brings the new Pod as a Pod of its own.
    pub(super) async fn patch_status(
        &self,
        rec: &PodRecord,
        mut body: serde_json::Value,
    ) -> Result<(), ReconcileError> {
        if let Some(body) = body.as_object_mut() {
            let meta = body
                .entry("metadata")
                .or_insert_with(|| serde_json::json!({}));
            if let Some(meta) = meta.as_object_mut() {
                meta.insert("uid".into(), serde_json::json!(&*rec.uid));
            }
        }
        self.throttle("status").await;
        // The answer (the whole Pod) is not read: the watch brings it anyway,
        // and decoding it for nothing costs CPU on every write of a storm.
        let request =
            kube::core::Request::new(<Pod as kube::Resource>::url_path(&(), Some(&rec.namespace)))
                .patch_subresource(
                    "status",
                    &rec.name,
                    &PatchParams::default(),
                    &Patch::Strategic(body),
                )
                .map_err(kube::Error::BuildRequest)?;
        match self.client.request_text(request).await {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(s)) if s.code == 404 || replaced(s.code, &s.message) => {
                debug!("the Pod is gone or was replaced; its status is not written");
                Ok(())
            }
            Err(e) => Err(e.into()),
        }
    }
}

/// The API server's answer to a patch whose UID is not the Pod's: the name
/// now belongs to another Pod (422, "metadata.uid: ... field is immutable";
/// 409 where a server checks it as a precondition).
fn replaced(code: u16, message: &str) -> bool {
    code == 409 || (code == 422 && message.contains("metadata.uid"))
}

/// Every container of the instance waits only for its creation (or for the
/// init containers before it): nothing has run, failed or been refused.
fn only_being_created(instance: &Instance) -> bool {
    instance
        .init_containers
        .iter()
        .chain(&instance.containers)
        .all(|c| {
            matches!(&c.state, vkd_provider::ContainerState::Waiting { reason, .. }
                if reason == "ContainerCreating" || reason == "PodInitializing")
        })
}
