//! A start that failed on an image the backend cannot run, or on a sandbox
//! it could not create: the Pod waits as after a failed pull, and the start
//! is tried again after a back-off, as the kubelet's.

use super::*;

/// The first wait before a start that failed on an image is tried again;
/// it doubles up to [`IMAGE_BACKOFF_MAX`], as the kubelet's image back-off.
pub(super) const IMAGE_BACKOFF: Duration = Duration::from_secs(10);

pub(super) const IMAGE_BACKOFF_MAX: Duration = Duration::from_secs(300);

impl Cx<'_> {
    /// The backend cannot run a container's image. As the kubelet after a
    /// failed pull, the Pod stays Pending with its containers waiting in
    /// `ErrImagePull`, then `ImagePullBackOff`, and the start is tried again
    /// after a back-off that doubles from [`IMAGE_BACKOFF`] to
    /// [`IMAGE_BACKOFF_MAX`]; an update of the Pod (a fixed image) tries at once.
    /// Returns how long until the next try.
    pub(super) async fn image_unavailable(
        &self,
        rec: &PodRecord,
        message: String,
    ) -> Result<Duration, ReconcileError> {
        let backoff = rec.image_backoff().is_some();
        let waiting = Waiting::ImagePull {
            message: message.clone(),
            backoff,
        };
        self.write_status(rec, None, &waiting).await?;
        let (failures, wait) = self.back_off_start(rec);
        warn!(%message, failures, "image not runnable; waiting as after a failed pull");
        // The kubelet's pair of Events, once each rather than at every retry.
        match failures {
            1 => self.events.event(
                rec,
                EventType::Warning,
                "Failed",
                &format!("Failed to pull image: {message}"),
                "Pull",
            ),
            2 => self.events.event(
                rec,
                EventType::Normal,
                "BackOff",
                &format!("Back-off pulling image: {message}"),
                "Pull",
            ),
            _ => {}
        }
        Ok(wait)
    }

    /// The backend could not set up the Pod's sandbox (its network, say) and
    /// gave back what it had. As the kubelet, the Pod stays Pending with its
    /// containers `ContainerCreating`, each failed attempt is a Warning
    /// `FailedCreatePodSandBox`, and the start is tried again after the same
    /// back-off as an image's (the record's start back-off).
    pub(super) async fn sandbox_not_created(
        &self,
        rec: &PodRecord,
        message: String,
    ) -> Result<Duration, ReconcileError> {
        self.write_status(rec, None, &Waiting::Creating).await?;
        let (failures, wait) = self.back_off_start(rec);
        warn!(%message, failures, "the backend could not create the Pod's sandbox; trying again");
        self.events.event(
            rec,
            EventType::Warning,
            vkd_provider::SANDBOX_NOT_CREATED,
            &format!("Failed to create pod sandbox: {message}"),
            "Create",
        );
        Ok(wait)
    }

    /// Counts a start that failed and sets when the next may be tried: after
    /// [`IMAGE_BACKOFF`], doubling to [`IMAGE_BACKOFF_MAX`]. Returns the
    /// failures in a row and the wait.
    fn back_off_start(&self, rec: &PodRecord) -> (u8, Duration) {
        let failures = rec
            .image_backoff()
            .map_or(0, |b| b.failures)
            .saturating_add(1);
        let wait = IMAGE_BACKOFF
            .saturating_mul(1 << u32::from(failures.min(8) - 1))
            .min(IMAGE_BACKOFF_MAX);
        let backoff = model::ImageBackoff {
            images: rec.images_digest(),
            failures,
            retry_at: Stamp::from(SystemTime::now() + wait),
        };
        self.update(&rec.uid, |p| p.image_backoff = Some(Box::new(backoff)));
        (failures, wait)
    }
}
