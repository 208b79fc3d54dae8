//! What the controller's steps learn of a Pod: written by them only, never by
//! the watch, so a watch event cannot lose any of it and a field added here
//! needs no carrying over.

use vkd_provider::Instance;

use super::features::{EphemeralProgress, VolumeProgress};
use super::{Stamp, Timeline};

#[derive(Clone, Debug, Default)]
pub struct Progress {
    pub timeline: Timeline,
    /// When the backend first queued this Pod (and its Event was published).
    pub queued_since: Option<Stamp>,
    /// The node admitted it (the kubelet's admission, [`crate::pods::admission`]).
    pub admitted: bool,
    /// This replica logged that it took on an instance an older epoch made.
    pub adoption_noted: bool,
    /// vkd's own final delete of the Pod was accepted: the watch's Delete event
    /// is all that is left (an update seen before it must not delete again).
    pub delete_sent: bool,
    /// Starts that failed on an image the backend cannot run, or on a sandbox
    /// it could not create (`None`: none since the images last changed).
    pub image_backoff: Option<Box<ImageBackoff>>,
    /// The Pod is being failed while its instance may still run.
    pub failing: Option<Box<Failing>>,
    /// For a Pod whose volumes follow their sources.
    pub volumes: Option<Box<VolumeProgress>>,
    /// What became of its ephemeral containers.
    pub ephemeral: Option<Box<EphemeralProgress>>,
}

/// The start back-off, for the images it was counted on: as the kubelet's, a
/// new image starts afresh.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ImageBackoff {
    /// [`super::PodRecord::images_digest`] when the failures were counted.
    pub images: u64,
    /// Failures in a row.
    pub failures: u8,
    /// When the next start may be tried.
    pub retry_at: Stamp,
}

/// A Pod failing while its containers may still run (today's reasons: it is
/// evicted, or its active deadline passed).
#[derive(Clone, Debug, Default)]
pub struct Failing {
    /// Evicted for breaking a storage limit, with the kubelet's message.
    pub evicting: Option<Box<str>>,
    /// The instance being stopped, as last seen: the ends of its containers
    /// go into the Pod's final status.
    pub stopping: Option<Box<Instance>>,
}

impl Progress {
    /// The failing state, made when first needed.
    pub fn failing_mut(&mut self) -> &mut Failing {
        self.failing.get_or_insert_with(Box::default)
    }

    /// The instance being stopped, taken (its Pod's failure is written).
    pub fn take_stopping(&mut self) -> Option<Box<Instance>> {
        self.failing.as_mut()?.stopping.take()
    }
}
