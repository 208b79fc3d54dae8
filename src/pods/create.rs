//! Resolving, admitting and creating a Pod's instance.

use super::claims::{self, Prepared};
use super::*;

pub(super) enum Start {
    Running(Box<Instance>),
    Queued(String),
    ConfigError(String),
    /// The backend cannot run an image: waits as after a failed image pull.
    ImagePull(String),
    /// The backend could not set up what the Pod runs in: waits, as the
    /// kubelet after `FailedCreatePodSandBox`.
    Sandbox(String),
    /// The Pod's ResourceClaims are not ready for it yet (DRA).
    Claims(String),
    Failed(String, String),
}

impl Start {
    /// The start cannot succeed as the spec is: the Pod fails, unless only an
    /// image is missing, which the kubelet waits out.
    pub(super) fn failed(reason: String, message: String) -> Self {
        if reason == vkd_provider::IMAGE_NOT_RUNNABLE {
            Self::ImagePull(message)
        } else if reason == vkd_provider::SANDBOX_NOT_CREATED {
            Self::Sandbox(message)
        } else {
            Self::Failed(reason, message)
        }
    }
}

impl Cx<'_> {
    /// Places the Pod on the backend and creates its instance (the node
    /// admitted it before).
    pub(super) async fn start(&self, rec: &PodRecord) -> Result<Start, ReconcileError> {
        let Some(pending) = rec.pending.as_deref() else {
            return Ok(Start::Failed(
                "InstanceLost".into(),
                "no spec to create the instance from".into(),
            ));
        };
        let resolver = self.resolver(pending).await?;
        let spec = match resolver.resolve(pending).await {
            Ok(s) => s,
            Err(spec::ResolveError::Spec(e)) => {
                return Ok(Start::Failed(e.reason.into(), e.message));
            }
            Err(spec::ResolveError::Config(message)) => return Ok(Start::ConfigError(message)),
            Err(spec::ResolveError::Kube(e)) => return Err(e.into()),
        };
        let (spec, claims) = match self.prepare_claims(pending).await? {
            Prepared::Nothing => (spec, Vec::new()),
            Prepared::Placed { placement, claims } => {
                let mut spec = spec;
                crate::dra::devices::place(&mut spec, placement);
                (spec, claims)
            }
            Prepared::Wait(message) => return Ok(Start::Claims(message)),
            Prepared::Unusable(message) => {
                self.decided(
                    &rec.uid,
                    &rec.key(),
                    "",
                    Decided::Rejected,
                    format!("{}: {message}", claims::UNUSABLE),
                );
                return Ok(Start::Failed(claims::UNUSABLE.into(), message));
            }
        };
        let spec = &spec;
        // A create that failed without an answer (a deadline, a cut connection)
        // may have made the instance: it is retried on the same placement, whose
        // reservation was kept, never admitted afresh onto other GPUs.
        let (admission, seen) = match self.admitter.held_placement(&rec.uid) {
            Some(placement) => (
                Ok(Admission::Fits(placement)),
                "the placement it already holds (a create is retried)".to_owned(),
            ),
            None => match self.admitter.admit_seeing(spec).await {
                Ok((a, seen)) => (Ok(a), seen),
                Err(e) => (Err(e), String::new()),
            },
        };
        let admission = match admission {
            Ok(a) => a,
            Err(ProviderError::Invalid { reason, message }) => {
                self.decided(
                    &rec.uid,
                    &rec.key(),
                    "",
                    Decided::Rejected,
                    format!("{reason}: {message}"),
                );
                return Ok(Start::failed(reason, message));
            }
            Err(e) => return Err(e.into()),
        };
        self.update(&rec.uid, |p| p.timeline.admitted = Some(Stamp::now()));
        let seen = if seen.is_empty() {
            String::new()
        } else {
            format!(" (slices seen: {seen})")
        };
        let placement = match admission {
            Admission::Fits(p) => p,
            Admission::Queued { reason } => {
                if rec.progress.queued_since.is_none() {
                    self.decided(
                        &rec.uid,
                        &rec.key(),
                        "",
                        Decided::Queued,
                        format!("{reason}{seen}"),
                    );
                }
                return Ok(Start::Queued(reason));
            }
            Admission::Rejected { reason, message } => {
                self.decided(
                    &rec.uid,
                    &rec.key(),
                    "",
                    Decided::Rejected,
                    format!("{reason}: {message}{seen}"),
                );
                return Ok(Start::failed(reason, message));
            }
        };
        self.decided(
            &rec.uid,
            &rec.key(),
            "",
            Decided::Admitted,
            format!(
                "placed on host {}{}{seen}",
                if placement.host.is_empty() {
                    "(backend's choice)"
                } else {
                    &placement.host
                },
                if placement.gpu_ids.is_empty() {
                    String::new()
                } else {
                    format!(", GPUs {}", placement.gpu_ids.join(","))
                }
            ),
        );
        let gpus = if placement.gpu_ids.is_empty() {
            String::new()
        } else {
            format!(", GPUs {}", placement.gpu_ids.join(","))
        };
        let mut spec = spec.clone();
        spec.placement = Some(placement);
        let instance = match self.provider.create(&self.fence(), &spec).await {
            Ok(i) => i,
            Err(ProviderError::Rejected { message }) => {
                self.admitter.refused(&rec.uid);
                if rec.progress.queued_since.is_none() {
                    let detail = format!("the backend refused the create: {message}");
                    self.decided(&rec.uid, &rec.key(), "", Decided::Queued, detail);
                }
                return Ok(Start::Queued(message));
            }
            Err(ProviderError::Invalid { reason, message }) => {
                self.admitter.release(&rec.uid);
                return Ok(Start::failed(reason, message));
            }
            // Kept: the backend may have made it (see `held_placement` above).
            Err(e) => return Err(e.into()),
        };
        self.admitter.created(&rec.uid);
        if let Some(placement) = &spec.placement
            && !claims.is_empty()
        {
            self.write_device_status(&claims, placement, &instance)
                .await;
        }
        self.decided(
            &rec.uid,
            &rec.key(),
            &instance.id,
            Decided::Created,
            format!(
                "backend {} created instance {} on host {}{gpus}",
                self.provider.name(),
                instance.id,
                instance.host.as_deref().unwrap_or("-"),
            ),
        );
        let written = rec
            .progress
            .volumes
            .is_some()
            .then(|| volume_refresh::created_digest(pending, &spec));
        self.touch(&rec.uid, |r| {
            r.created();
            r.progress.timeline.accepted = Some(Stamp::now());
            if let Some(v) = r.progress.volumes.as_deref_mut() {
                v.written = v.written.or(written);
            }
        });
        if self.settings.lifecycle_events {
            // One Normal Event per Pod: admission and creation together, so the
            // happy path costs one Event write, not one per step.
            let note = format!(
                "backend {} admitted it and created instance {} on host {}{gpus} (epoch {})",
                self.provider.name(),
                instance.id,
                instance.host.as_deref().unwrap_or("-"),
                self.settings.epoch
            );
            self.events.paced_event(
                rec,
                EventType::Normal,
                "InstanceCreated",
                &note,
                "Create",
                events::Pace::ShedOverRate,
            );
        }
        info!(
            instance = %instance.id,
            host = instance.host.as_deref().unwrap_or(""),
            epoch = self.settings.epoch,
            backend = self.provider.name(),
            "instance created"
        );
        Ok(Start::Running(Box::new(instance)))
    }

    pub(super) async fn queued(&self, rec: &PodRecord, reason: &str) -> Result<(), ReconcileError> {
        self.write_status(rec, None, &Waiting::Queued(reason.to_owned()))
            .await?;
        if rec.progress.queued_since.is_none() {
            self.events
                .event(rec, EventType::Normal, "BackendQueued", reason, "Admit");
            self.update(&rec.uid, |p| p.queued_since = Some(Stamp::now()));
        }
        Ok(())
    }
}
