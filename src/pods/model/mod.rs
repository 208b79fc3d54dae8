//! The compact per-Pod record, as plain data: what vkd must remember about a
//! Pod between watch events, instead of a cached copy of the whole object.
//!
//! It has three parts, each with its own writer:
//! - [`Seen`]: what the API server holds, rebuilt whole from each watch event
//!   (and brought up to date by a status write the server accepted, through
//!   [`PodRecord::observe`]); steps read it through `Deref` and cannot change it;
//! - `pending`: the instance spec, from the watch until the create step takes it;
//! - [`Progress`]: what the steps learn, which the watch never touches.
//!
//! No I/O and nothing from the steps or the controller above: a feature's
//! state is here ([`features`]), its behaviour in its step.

pub mod features;
pub mod progress;
pub mod stamp;

use std::hash::{Hash, Hasher};
use std::time::SystemTime;

use k8s_openapi::api::core::v1::Pod;
use vkd_provider::PodRef;

pub use features::{EphemeralProgress, EphemeralSpec, Refusal, StorageLimits, VolumeProgress};
pub use progress::{Failing, ImageBackoff, Progress};
pub use stamp::{Phase, Stamp, Timeline};

use super::admission::NodeClaim;
pub use super::spec::SpecError;
use super::spec::{Pending, pending};

/// The conditions vkd owns (PodScheduled belongs to the scheduler).
pub const CONDITIONS: [&str; 4] = [
    "PodReadyToStartContainers",
    "Initialized",
    "ContainersReady",
    "Ready",
];

#[derive(Clone, Debug)]
pub struct ContainerInfo {
    pub name: Box<str>,
    pub image: Box<str>,
    /// An init container with `restartPolicy: Always` (a sidecar).
    pub sidecar: bool,
}

impl ContainerInfo {
    fn of(c: &k8s_openapi::api::core::v1::Container, init: bool) -> Self {
        Self {
            name: c.name.as_str().into(),
            image: c.image.clone().unwrap_or_default().into(),
            sidecar: init && c.restart_policy.as_deref() == Some("Always"),
        }
    }
}

/// What the API server holds of a Pod's status, as far as the record keeps
/// it: made by the status layer from the Pod or from a status it wrote.
#[derive(Clone, Debug, Default)]
pub struct Observed {
    pub phase: Phase,
    pub instance_id: Option<Box<str>>,
    /// The digest of the whole status view: what tells a change from none.
    pub digest: u64,
    /// The status of each of [`CONDITIONS`] (`None`: absent).
    pub conditions: [Option<bool>; 4],
}

/// What the API server holds of one Pod bound to this node.
#[derive(Clone, Debug)]
pub struct Seen {
    pub namespace: Box<str>,
    pub name: Box<str>,
    pub uid: Box<str>,
    pub containers: Box<[ContainerInfo]>,
    /// The init containers, in order.
    pub init_containers: Box<[ContainerInfo]>,
    /// Set once the Pod has a deletionTimestamp: the grace period in seconds.
    pub deletion_grace: Option<u32>,
    /// Why the Pod spec cannot run at all (found when the record was built).
    pub spec_error: Option<Box<SpecError>>,
    /// The phase the API server holds.
    pub phase: Phase,
    /// The instance the API server's copy names (`vkd.io/instance-id`).
    pub instance_id: Option<Box<str>>,
    /// The digest of the status the API server holds: the whole view is
    /// not kept, only what tells a change from none.
    pub observed_digest: u64,
    /// `status.startTime` as the API server holds it.
    pub start_time: Option<Stamp>,
    /// lastTransitionTime of each of our conditions, with the status it
    /// belongs to (bit `i` of `condition_true`): the pair in 9 bytes, not 16.
    condition_times: [Option<Stamp>; 4],
    condition_true: u8,
    /// `vkd.io/partition-policy: fence`: stop the instance in a partition.
    pub fence_on_partition: bool,
    /// `spec.hostNetwork`: the Pod's IP is the host's, on any backend.
    pub host_network: bool,
    /// `spec.activeDeadlineSeconds` (mutable: read from every update).
    pub active_deadline: Option<ActiveDeadline>,
    /// The digest of the labels and annotations of a Pod whose volumes follow
    /// their sources (`None`: it has none).
    pub volume_metadata: Option<std::num::NonZeroU64>,
    /// Local ephemeral storage limits, enforced by eviction (`None`: it has none).
    pub storage_limits: Option<Box<StorageLimits>>,
    /// `spec.ephemeralContainers` (`None`: it has none).
    pub ephemeral: Option<Box<EphemeralSpec>>,
    /// `metadata.generation`: what `status.observedGeneration` says was seen.
    pub generation: i64,
    /// Every condition `spec.readinessGates` names is True in the Pod's status
    /// (true when it names none): Ready waits for it, as on the kubelet.
    pub readiness_gates_ready: bool,
    /// What it asks of the node until it is admitted, and the host ports it
    /// holds (`None`: neither).
    pub node_claim: Option<Box<NodeClaim>>,
}

/// One Pod bound to this node.
#[derive(Clone, Debug)]
pub struct PodRecord {
    seen: Seen,
    /// The instance spec, kept only until the instance is created.
    pub pending: Option<Box<Pending>>,
    pub progress: Progress,
}

impl std::ops::Deref for PodRecord {
    type Target = Seen;

    fn deref(&self) -> &Seen {
        &self.seen
    }
}

/// `spec.activeDeadlineSeconds`, and the grace period the containers get
/// when it passes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ActiveDeadline {
    /// Seconds from `status.startTime`; values past `u32::MAX` (136 years)
    /// are clamped to it.
    pub seconds: u32,
    pub grace_seconds: u32,
}

impl ActiveDeadline {
    fn of(spec: &k8s_openapi::api::core::v1::PodSpec) -> Option<Self> {
        let clamp = |v: i64| u32::try_from(v.max(0)).unwrap_or(u32::MAX);
        spec.active_deadline_seconds.map(|s| Self {
            seconds: clamp(s),
            grace_seconds: clamp(spec.termination_grace_period_seconds.unwrap_or(30)),
        })
    }

    /// How long until the deadline passes (zero once it has), measured from
    /// `start`; `None` when it lies beyond what a clock can hold.
    pub fn left(self, start: SystemTime, now: SystemTime) -> Option<std::time::Duration> {
        let at = start.checked_add(std::time::Duration::from_secs(self.seconds.into()))?;
        Some(at.duration_since(now).unwrap_or_default())
    }
}

impl PodRecord {
    /// The record of a Pod seen for the first time.
    pub fn new(pod: &Pod, node: &str, observed: Observed, now: SystemTime) -> Option<Self> {
        let mut progress = Progress::default();
        let (seen, pending) = Seen::of(pod, node, observed, &progress, true)?;
        progress.timeline.bound = bound(pod);
        progress.timeline.observed = Some(now.into());
        progress.volumes = seen.volume_metadata.map(|metadata| {
            Box::new(VolumeProgress {
                metadata,
                written: None,
                due: (now + crate::pods::model::VOLUME_PERIOD).into(),
            })
        });
        Some(Self {
            seen,
            pending,
            progress,
        })
    }

    /// The watch brings a newer copy of the Pod: what the API server holds is
    /// read again; what the steps learned stays as it is. The instance spec
    /// is read again only while no instance was made from it.
    pub fn update(&mut self, pod: &Pod, node: &str, observed: Observed) {
        let wants_spec = self.pending.is_some() || self.seen.spec_error.is_some();
        if let Some((seen, pending)) = Seen::of(pod, node, observed, &self.progress, wants_spec) {
            self.seen = seen;
            self.pending = pending;
        }
    }

    /// The API server accepted a status this record's Pod now holds: until the
    /// watch brings it back, the record reads as if it had (`now`: when the
    /// conditions that changed took their status).
    pub fn observe(&mut self, observed: &Observed, now: SystemTime) {
        for (i, s) in observed.conditions.iter().enumerate() {
            if let Some(s) = *s
                && self.seen.condition(i).is_none_or(|(old, _)| old != s)
            {
                self.seen.set_condition(i, s, now.into());
            }
        }
        self.seen.phase = observed.phase;
        self.seen.instance_id.clone_from(&observed.instance_id);
        self.seen.observed_digest = observed.digest;
    }

    /// The API server accepted `status.startTime` as `at` (when it had none).
    pub fn observe_start(&mut self, at: Stamp) {
        self.seen.start_time.get_or_insert(at);
    }

    /// The node admitted it: what it asked of the node is no longer kept,
    /// only the host ports it holds.
    pub fn admit(&mut self) {
        self.progress.admitted = true;
        NodeClaim::admitted(&mut self.seen.node_claim);
    }

    /// Its instance was made from the pending spec, which is dropped.
    pub fn created(&mut self) {
        self.pending = None;
    }

    /// What the watch saw, to change in a test.
    #[cfg(test)]
    pub fn seen_mut(&mut self) -> &mut Seen {
        &mut self.seen
    }

    pub fn pod_ref(&self) -> PodRef {
        PodRef {
            uid: self.uid.to_string(),
            namespace: self.namespace.to_string(),
            name: self.name.to_string(),
        }
    }

    pub fn key(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }

    /// It counts against the node's pods and host ports: admitted, or running
    /// from before, and not ended.
    pub fn holds_node(&self) -> bool {
        !self.terminal()
            && (self.progress.admitted || (self.pending.is_none() && self.spec_error.is_none()))
    }

    /// The phase the API server holds is terminal: nothing more to do but deletion.
    pub fn terminal(&self) -> bool {
        matches!(self.phase, Phase::Succeeded | Phase::Failed)
    }

    /// Seen for the first time and waiting for its instance: a new binding,
    /// which the reconcile queue serves first.
    pub fn awaits_create(&self) -> bool {
        self.pending.is_some()
            && self.instance_id.is_none()
            && self.deletion_grace.is_none()
            && self.spec_error.is_none()
            && !self.terminal()
    }

    /// When condition `t` took status `s`, if the API already holds it that way.
    pub fn condition_since(&self, t: &str, s: bool) -> Option<SystemTime> {
        let i = CONDITIONS.iter().position(|c| *c == t)?;
        self.condition(i)
            .filter(|(st, _)| *st == s)
            .map(|(_, at)| at.time())
    }

    /// The digest of the images of its containers: a start back-off counted
    /// on other images no longer holds.
    pub fn images_digest(&self) -> u64 {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        for c in self.containers.iter().chain(self.init_containers.iter()) {
            c.image.hash(&mut h);
        }
        h.finish()
    }

    /// The start back-off that holds for its images now.
    pub fn image_backoff(&self) -> Option<&ImageBackoff> {
        self.progress
            .image_backoff
            .as_deref()
            .filter(|b| b.images == self.images_digest())
    }

    /// Why the Pod is being evicted, once it is.
    pub fn evicting(&self) -> Option<&str> {
        self.progress.failing.as_deref()?.evicting.as_deref()
    }

    /// What the steps learned of its ephemeral containers, if anything.
    pub fn ephemeral_progress(&self) -> Option<&EphemeralProgress> {
        self.progress.ephemeral.as_deref()
    }

    /// Why ephemeral container `name` did not start, if it did not.
    pub fn ephemeral_refusal(&self, name: &str) -> Option<&Refusal> {
        self.ephemeral_progress()
            .and_then(|p| p.refusal(name))
            .or_else(|| {
                let e = self.ephemeral.as_deref()?;
                e.unreadable.iter().find(|r| &*r.name == name)
            })
    }

    /// Some ephemeral containers are still to be handed over (after a missing
    /// ConfigMap appears, say).
    pub fn ephemeral_retrying(&self) -> bool {
        let Some(pending) = self.ephemeral.as_deref().and_then(|e| e.pending.as_deref()) else {
            return false;
        };
        let progress = self.ephemeral_progress();
        pending
            .spec
            .containers
            .iter()
            .any(|c| progress.is_none_or(|p| p.waits(&c.name)))
    }
}

/// How often a running Pod's volume sources are read again: the kubelet's
/// sync period, with which its volumes follow their ConfigMaps and Secrets.
pub const VOLUME_PERIOD: std::time::Duration = std::time::Duration::from_secs(60);

impl Seen {
    /// What the API server holds of `pod`, with its instance spec when
    /// `wants_spec` (until an instance is made from it).
    fn of(
        pod: &Pod,
        node: &str,
        observed: Observed,
        progress: &Progress,
        wants_spec: bool,
    ) -> Option<(Self, Option<Box<Pending>>)> {
        let meta = &pod.metadata;
        let uid = meta.uid.as_deref()?;
        let spec = pod.spec.as_ref()?;
        let api_status = pod.status.as_ref();
        let created = observed.instance_id.is_some();
        let (pending, spec_error) = if created || !wants_spec {
            (None, None)
        } else {
            match pending(pod, node) {
                Ok(s) => (Some(Box::new(s)), None),
                Err(e) => (None, Some(Box::new(e))),
            }
        };
        let node_claim = NodeClaim::of(
            meta.labels.as_ref(),
            spec,
            !progress.admitted && pending.is_some(),
        );
        let containers: Box<[ContainerInfo]> = spec
            .containers
            .iter()
            .map(|c| ContainerInfo::of(c, false))
            .collect();
        let init_containers: Box<[ContainerInfo]> = spec
            .init_containers
            .iter()
            .flatten()
            .map(|c| ContainerInfo::of(c, true))
            .collect();
        let mut seen = Self {
            namespace: meta.namespace.clone().unwrap_or_default().into(),
            name: meta.name.clone().unwrap_or_default().into(),
            uid: uid.into(),
            containers,
            init_containers,
            deletion_grace: meta.deletion_timestamp.as_ref().map(|_| {
                meta.deletion_grace_period_seconds
                    .and_then(|g| u32::try_from(g).ok())
                    .unwrap_or(30)
            }),
            spec_error,
            observed_digest: observed.digest,
            phase: observed.phase,
            instance_id: observed.instance_id,
            start_time: api_status
                .and_then(|s| s.start_time.as_ref())
                .map(|t| Stamp::from(SystemTime::from(t.0))),
            condition_times: [None; 4],
            condition_true: 0,
            fence_on_partition: meta
                .annotations
                .as_ref()
                .and_then(|a| a.get(crate::fencing::PARTITION_POLICY_ANNOTATION))
                .is_some_and(|v| v == "fence"),
            host_network: spec.host_network.unwrap_or(false),
            active_deadline: ActiveDeadline::of(spec),
            storage_limits: StorageLimits::of(spec),
            volume_metadata: features::volume_metadata(pod),
            ephemeral: EphemeralSpec::of(pod, node, progress.ephemeral.as_deref()),
            generation: meta.generation.unwrap_or(0),
            readiness_gates_ready: readiness_gates_ready(spec, api_status),
            node_claim,
        };
        if let Some(conds) = api_status.and_then(|s| s.conditions.as_ref()) {
            for (i, t) in CONDITIONS.iter().enumerate() {
                if let Some(c) = conds.iter().find(|c| c.type_ == *t)
                    && let Some(at) = &c.last_transition_time
                {
                    seen.set_condition(i, c.status == "True", SystemTime::from(at.0).into());
                }
            }
        }
        Some((seen, pending))
    }

    /// Condition `i` of [`CONDITIONS`]: its status and since when, if known.
    fn condition(&self, i: usize) -> Option<(bool, Stamp)> {
        let at = (*self.condition_times.get(i)?)?;
        Some((self.condition_true & (1 << i) != 0, at))
    }

    fn set_condition(&mut self, i: usize, status: bool, at: Stamp) {
        if let Some(slot) = self.condition_times.get_mut(i) {
            *slot = Some(at);
            if status {
                self.condition_true |= 1 << i;
            } else {
                self.condition_true &= !(1 << i);
            }
        }
    }
}

/// When the scheduler bound `pod` (its PodScheduled condition).
fn bound(pod: &Pod) -> Option<Stamp> {
    let conditions = pod.status.as_ref()?.conditions.as_ref()?;
    let scheduled = conditions
        .iter()
        .find(|c| c.type_ == "PodScheduled" && c.status == "True")?;
    let at = scheduled.last_transition_time.as_ref()?;
    Some(Stamp::from(SystemTime::from(at.0)))
}

/// Whether each condition type `spec.readinessGates` lists is True in `status`.
fn readiness_gates_ready(
    spec: &k8s_openapi::api::core::v1::PodSpec,
    status: Option<&k8s_openapi::api::core::v1::PodStatus>,
) -> bool {
    spec.readiness_gates.iter().flatten().all(|gate| {
        status
            .and_then(|s| s.conditions.as_ref())
            .into_iter()
            .flatten()
            .any(|c| c.type_ == gate.condition_type && c.status == "True")
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(v: serde_json::Value) -> Pod {
        serde_json::from_value(v).unwrap()
    }

    /// What the status layer would say the API holds, as far as these tests look.
    fn observed(p: &Pod) -> Observed {
        Observed {
            phase: Phase::parse(
                p.status
                    .as_ref()
                    .and_then(|s| s.phase.as_deref())
                    .unwrap_or(""),
            ),
            instance_id: p
                .metadata
                .annotations
                .as_ref()
                .and_then(|a| a.get("vkd.io/instance-id"))
                .map(|s| s.as_str().into()),
            ..Observed::default()
        }
    }

    #[test]
    fn record_keeps_transition_times_and_deletion() {
        let p = pod(json!({
            "metadata": {"name": "p", "namespace": "ns", "uid": "u1",
                "deletionTimestamp": "2026-01-01T00:00:00Z", "deletionGracePeriodSeconds": 5,
                "annotations": {"vkd.io/instance-id": "sim-1"}},
            "spec": {"containers": [{"name": "a", "image": "x"}]},
            "status": {"phase": "Running", "conditions": [
                {"type": "Ready", "status": "True", "lastTransitionTime": "2026-01-01T00:00:00Z"},
                {"type": "PodScheduled", "status": "True", "lastTransitionTime": "2025-12-31T23:59:59Z"}
            ]}
        }));
        let r = PodRecord::new(&p, "vk", observed(&p), SystemTime::now()).unwrap();
        assert_eq!(r.deletion_grace, Some(5));
        assert!(r.pending.is_none(), "an instance exists; no spec kept");
        assert!(r.condition_since("Ready", true).is_some());
        assert!(r.condition_since("Ready", false).is_none());
        assert!(r.progress.timeline.bound.is_some());
        assert!(
            r.progress
                .timeline
                .render()
                .starts_with("bound=2025-12-31T23:59:59Z observed=+")
        );
        assert_eq!(r.active_deadline, None);
    }

    /// A watch event reads again what the API server holds and nothing else:
    /// whatever the steps learned stays, with no list of fields to carry
    /// over; a start back-off counts only for the images it was counted on.
    #[test]
    fn a_watch_event_keeps_what_the_steps_learned() {
        let with = |phase: &str, image: &str| {
            pod(json!({
                "metadata": {"name": "p", "namespace": "ns", "uid": "u1"},
                "spec": {"containers": [{"name": "a", "image": image}],
                    "ephemeralContainers": [{"name": "dbg", "image": "busybox"}]},
                "status": {"phase": phase}
            }))
        };
        let first = with("Pending", "x");
        let mut r = PodRecord::new(&first, "vk", observed(&first), SystemTime::now()).unwrap();
        assert!(r.pending.is_some() && r.awaits_create());
        r.admit();
        r.progress.queued_since = Some(Stamp::now());
        r.progress.adoption_noted = true;
        r.progress.delete_sent = true;
        r.progress.timeline.accepted = Some(Stamp::now());
        r.progress.image_backoff = Some(Box::new(ImageBackoff {
            images: r.images_digest(),
            failures: 2,
            retry_at: Stamp::now(),
        }));
        r.progress.failing_mut().evicting = Some("too big".into());
        r.progress
            .ephemeral
            .get_or_insert_with(Box::default)
            .hand("dbg");
        r.created();
        let learned = format!("{:?}", r.progress);

        let running = with("Running", "x");
        r.update(&running, "vk", observed(&running));
        assert_eq!(r.phase, Phase::Running, "what the API holds is read again");
        assert_eq!(
            format!("{:?}", r.progress),
            learned,
            "what the steps learned stays"
        );
        assert!(
            r.pending.is_none(),
            "no spec is read again once the instance is made"
        );
        assert_eq!(r.image_backoff().map(|b| b.failures), Some(2));
        assert_eq!(r.evicting(), Some("too big"));
        assert!(
            r.ephemeral.as_deref().unwrap().pending.is_none(),
            "the handed ephemeral container gets no spec again"
        );

        let new_image = with("Running", "y");
        r.update(&new_image, "vk", observed(&new_image));
        assert!(r.image_backoff().is_none(), "a new image starts afresh");
    }

    /// Ready waits for every condition spec.readinessGates names to be True.
    #[test]
    fn readiness_gates_hold_ready_until_their_conditions_are_true() {
        let with = |conditions: serde_json::Value| {
            let p = pod(json!({
                "metadata": {"name": "p", "namespace": "ns", "uid": "u1"},
                "spec": {"readinessGates": [{"conditionType": "k8s.io/a"}, {"conditionType": "k8s.io/b"}],
                    "containers": [{"name": "a", "image": "x"}]},
                "status": {"phase": "Running", "conditions": conditions}
            }));
            PodRecord::new(&p, "vk", observed(&p), SystemTime::now())
                .unwrap()
                .readiness_gates_ready
        };
        assert!(!with(json!([])));
        assert!(!with(json!([{"type": "k8s.io/a", "status": "True"}])));
        assert!(!with(json!([{"type": "k8s.io/a", "status": "True"},
            {"type": "k8s.io/b", "status": "False"}])));
        assert!(with(json!([{"type": "k8s.io/a", "status": "True"},
            {"type": "k8s.io/b", "status": "True"}])));
        let none = pod(json!({
            "metadata": {"name": "p", "namespace": "ns", "uid": "u1"},
            "spec": {"containers": [{"name": "a", "image": "x"}]}
        }));
        assert!(
            PodRecord::new(&none, "vk", observed(&none), SystemTime::now())
                .unwrap()
                .readiness_gates_ready
        );
    }

    /// activeDeadlineSeconds is tenant input: any i64 is read without overflow,
    /// and the deadline counts from status.startTime.
    #[test]
    fn active_deadline_is_clamped_and_counted_from_the_start() {
        let with = |deadline: i64| {
            let p = pod(json!({
                "metadata": {"name": "p", "namespace": "ns", "uid": "u1"},
                "spec": {"activeDeadlineSeconds": deadline, "terminationGracePeriodSeconds": 3,
                    "containers": [{"name": "a", "image": "x"}]},
                "status": {"phase": "Running", "startTime": "2026-01-01T00:00:00Z"}
            }));
            PodRecord::new(&p, "vk", observed(&p), SystemTime::now()).unwrap()
        };
        let r = with(5);
        let d = r.active_deadline.unwrap();
        assert_eq!((d.seconds, d.grace_seconds), (5, 3));
        let start = r.start_time.unwrap().time();
        let s = std::time::Duration::from_secs;
        assert_eq!(d.left(start, start + s(2)), Some(s(3)));
        assert_eq!(d.left(start, start + s(5)), Some(s(0)));
        assert_eq!(d.left(start, start + s(3600)), Some(s(0)));
        let huge = with(i64::MAX).active_deadline.unwrap();
        assert_eq!(huge.seconds, u32::MAX);
        assert!(huge.left(start, start).unwrap() > s(100 * 365 * 86400));
        // A start at the end of representable time leaves no deadline rather than wrapping.
        if let Some(far) = SystemTime::UNIX_EPOCH.checked_add(s(i64::MAX.unsigned_abs() - 10)) {
            assert_eq!(huge.left(far, far), None);
        }
        assert_eq!(with(-7).active_deadline.unwrap().seconds, 0);
    }
}
