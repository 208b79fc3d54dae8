//! The compact per-Pod record: what vkd must remember about a Pod between watch
//! events, instead of a cached copy of the whole object.

use std::time::SystemTime;

use k8s_openapi::api::core::v1::Pod;
use vkd_provider::PodRef;

use super::status::{self, CONDITIONS, StatusView};

pub use super::spec::SpecError;
use super::spec::{Pending, pending};

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

/// A wall-clock time to the millisecond in 8 bytes (`Option<Stamp>` too), half
/// a `SystemTime`: a record keeps a dozen of them for each of thousands of Pods.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Stamp(std::num::NonZeroU64);

impl Stamp {
    pub fn now() -> Self {
        SystemTime::now().into()
    }

    pub fn time(self) -> SystemTime {
        SystemTime::UNIX_EPOCH + std::time::Duration::from_millis(self.0.get())
    }
}

impl From<SystemTime> for Stamp {
    fn from(t: SystemTime) -> Self {
        let ms = t
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(1, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        Self(std::num::NonZeroU64::new(ms).unwrap_or(std::num::NonZeroU64::MIN))
    }
}

/// When each step of a Pod's start happened.
#[derive(Clone, Debug, Default)]
pub struct Timeline {
    pub bound: Option<Stamp>,
    pub observed: Option<Stamp>,
    pub admitted: Option<Stamp>,
    pub accepted: Option<Stamp>,
    pub started: Option<Stamp>,
    pub ready: Option<Stamp>,
}

impl Timeline {
    /// The steps after the binding, in order, with when each happened.
    pub fn stages(&self) -> [(&'static str, Option<Stamp>); 5] {
        [
            ("observed", self.observed),
            ("admitted", self.admitted),
            ("accepted", self.accepted),
            ("started", self.started),
            ("ready", self.ready),
        ]
    }

    /// `bound=<time> observed=+12ms admitted=+13ms ...`, offsets from the binding.
    pub fn render(&self) -> String {
        let base = self.bound.or(self.observed).map(Stamp::time);
        let mut out = Vec::new();
        if let Some(b) = self.bound {
            out.push(format!("bound={}", status::time(b.time())));
        }
        for (name, t) in self.stages() {
            if let (Some(t), Some(base)) = (t.map(Stamp::time), base) {
                let ms = t.duration_since(base).map_or(0, |d| d.as_millis());
                out.push(format!("{name}=+{ms}ms"));
            }
        }
        out.join(" ")
    }
}

/// A Pod's phase, as the API server holds it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Phase {
    /// No phase written yet.
    #[default]
    None,
    Pending,
    Running,
    Succeeded,
    Failed,
    Unknown,
}

impl Phase {
    pub fn parse(s: &str) -> Self {
        match s {
            "" => Self::None,
            "Pending" => Self::Pending,
            "Running" => Self::Running,
            "Succeeded" => Self::Succeeded,
            "Failed" => Self::Failed,
            _ => Self::Unknown,
        }
    }

    /// The name for metrics; a Pod with no phase yet counts as Pending.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::None | Self::Pending => "Pending",
            Self::Running => "Running",
            Self::Succeeded => "Succeeded",
            Self::Failed => "Failed",
            Self::Unknown => "Unknown",
        }
    }
}

/// One Pod bound to this node.
#[derive(Clone, Debug)]
pub struct PodRecord {
    pub namespace: Box<str>,
    pub name: Box<str>,
    pub uid: Box<str>,
    pub containers: Box<[ContainerInfo]>,
    /// The init containers, in order.
    pub init_containers: Box<[ContainerInfo]>,
    /// Set once the Pod has a deletionTimestamp: the grace period in seconds.
    pub deletion_grace: Option<u32>,
    /// The instance spec, kept only until the instance is created.
    pub pending: Option<Box<Pending>>,
    /// Why the Pod spec cannot run at all (found when the record was built).
    pub spec_error: Option<Box<SpecError>>,
    /// The phase the API server holds.
    pub phase: Phase,
    /// The instance the API server's copy names (`vkd.io/instance-id`).
    pub instance_id: Option<Box<str>>,
    /// The digest of the status the API server holds ([`StatusView::digest`]):
    /// the whole view is not kept, only what tells a change from none.
    pub observed_digest: u64,
    pub start_time: Option<Stamp>,
    /// lastTransitionTime of each of our conditions, with the status it belongs to.
    pub condition_times: [Option<(bool, Stamp)>; 4],
    pub timeline: Timeline,
    /// When the backend first queued this Pod (and its Event was published).
    pub queued_since: Option<Stamp>,
    /// `vkd.io/partition-policy: fence`: stop the instance in a partition.
    pub fence_on_partition: bool,
    /// `spec.hostNetwork`: the Pod's IP is the host's, on any backend.
    pub host_network: bool,
    /// This replica logged that it took on an instance an older epoch made.
    pub adoption_noted: bool,
    /// vkd's own final delete of the Pod was accepted: the watch's Delete event
    /// is all that is left (an update seen before it must not delete again).
    pub delete_sent: bool,
    /// `spec.activeDeadlineSeconds` (mutable: read from every update).
    pub active_deadline: Option<ActiveDeadline>,
    /// For a Pod whose volumes follow their sources (`None`: it has none).
    pub volume_refresh: Option<Box<super::volume_refresh::VolumeRefresh>>,
    /// How many starts in a row failed on an image the backend cannot run
    /// (or on a sandbox it could not create), and when the next may be
    /// tried; both reset when an image changes.
    pub image_failures: u8,
    pub image_retry_at: Option<Stamp>,
    /// Local ephemeral storage limits, enforced by eviction (`None`: it has none).
    pub storage_limits: Option<Box<super::eviction::StorageLimits>>,
    /// `spec.ephemeralContainers` and what became of them (`None`: it has none).
    pub ephemeral: Option<Box<super::ephemeral::Ephemeral>>,
    /// `metadata.generation`: what `status.observedGeneration` says was seen.
    pub generation: i64,
    /// Every condition `spec.readinessGates` names is True in the Pod's status
    /// (true when it names none): Ready waits for it, as on the kubelet.
    pub readiness_gates_ready: bool,
    /// The node admitted it (the kubelet's admission, [`super::admission`]);
    /// a Pod found with its instance was admitted before.
    pub admitted: bool,
    /// What it asks of the node until it is admitted, and the host ports it
    /// holds (`None`: neither).
    pub node_claim: Option<Box<super::admission::NodeClaim>>,
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
        !self.terminal() && (self.admitted || (self.pending.is_none() && self.spec_error.is_none()))
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

    /// Notes that the API server now holds `view`.
    pub fn observe(&mut self, view: &StatusView) {
        self.phase = Phase::parse(&view.phase);
        self.instance_id = view.instance_id.as_deref().map(Into::into);
        self.observed_digest = view.digest();
    }

    /// When condition `t` took status `s`, if the API already holds it that way.
    pub fn condition_since(&self, t: &str, s: bool) -> Option<SystemTime> {
        let i = CONDITIONS.iter().position(|c| *c == t)?;
        self.condition_times[i]
            .filter(|(st, _)| *st == s)
            .map(|(_, at)| at.time())
    }

    /// Builds the record from a Pod, carrying over what an earlier record knew.
    pub fn from_pod(
        pod: &Pod,
        node: &str,
        previous: Option<&PodRecord>,
        now: SystemTime,
    ) -> Option<Self> {
        let meta = &pod.metadata;
        let uid = meta.uid.as_deref()?;
        let spec = pod.spec.as_ref()?;
        let observed = status::view_of_pod(pod);
        let api_status = pod.status.as_ref();
        let mut condition_times = [None; 4];
        if let Some(conds) = api_status.and_then(|s| s.conditions.as_ref()) {
            for (i, t) in CONDITIONS.iter().enumerate() {
                if let Some(c) = conds.iter().find(|c| c.type_ == *t)
                    && let Some(at) = &c.last_transition_time
                {
                    condition_times[i] = Some((c.status == "True", SystemTime::from(at.0).into()));
                }
            }
        }
        let bound = api_status
            .and_then(|s| s.conditions.as_ref())
            .and_then(|cs| {
                cs.iter()
                    .find(|c| c.type_ == "PodScheduled" && c.status == "True")
            })
            .and_then(|c| c.last_transition_time.as_ref())
            .map(|t| Stamp::from(SystemTime::from(t.0)));
        let mut timeline = previous.map(|p| p.timeline.clone()).unwrap_or_default();
        timeline.bound = timeline.bound.or(bound);
        timeline.observed = timeline.observed.or(Some(now.into()));
        let created = observed.instance_id.is_some();
        let observed_digest = observed.digest();
        let (pending, spec_error) =
            if created || previous.is_some_and(|p| p.pending.is_none() && p.spec_error.is_none()) {
                (None, None)
            } else {
                match pending(pod, node) {
                    Ok(s) => (Some(Box::new(s)), None),
                    Err(e) => (None, Some(Box::new(e))),
                }
            };
        let admitted = previous.is_some_and(|p| p.admitted);
        let node_claim = super::admission::NodeClaim::of(
            meta.labels.as_ref(),
            spec,
            !admitted && pending.is_some(),
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
        // The image back-off is per image, as the kubelet's: a new one starts afresh.
        let images = |cs: &[ContainerInfo]| cs.iter().map(|c| c.image.clone()).collect::<Vec<_>>();
        let same_images = previous.is_some_and(|p| {
            images(&p.containers) == images(&containers)
                && images(&p.init_containers) == images(&init_containers)
        });
        let (image_failures, image_retry_at) = match previous {
            Some(p) if same_images => (p.image_failures, p.image_retry_at),
            _ => (0, None),
        };
        Some(Self {
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
            pending,
            spec_error,
            observed_digest,
            phase: Phase::parse(&observed.phase),
            instance_id: observed.instance_id.map(Into::into),
            start_time: api_status
                .and_then(|s| s.start_time.as_ref())
                .map(|t| Stamp::from(SystemTime::from(t.0)))
                .or(previous.and_then(|p| p.start_time)),
            condition_times,
            timeline,
            queued_since: previous.and_then(|p| p.queued_since),
            fence_on_partition: meta
                .annotations
                .as_ref()
                .and_then(|a| a.get(crate::fencing::PARTITION_POLICY_ANNOTATION))
                .is_some_and(|v| v == "fence"),
            host_network: spec.host_network.unwrap_or(false),
            delete_sent: previous.is_some_and(|p| p.delete_sent),
            adoption_noted: previous.is_some_and(|p| p.adoption_noted),
            active_deadline: ActiveDeadline::of(spec),
            storage_limits: super::eviction::StorageLimits::of(spec),
            image_failures,
            image_retry_at,
            volume_refresh: super::volume_refresh::VolumeRefresh::of(
                pod,
                previous.and_then(|p| p.volume_refresh.as_deref()),
                now,
            ),
            ephemeral: super::ephemeral::Ephemeral::of(
                pod,
                node,
                previous.and_then(|p| p.ephemeral.as_deref()),
            ),
            generation: meta.generation.unwrap_or(0),
            readiness_gates_ready: readiness_gates_ready(spec, api_status),
            node_claim,
            admitted,
        })
    }
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
        let r = PodRecord::from_pod(&p, "vk", None, SystemTime::now()).unwrap();
        assert_eq!(r.deletion_grace, Some(5));
        assert!(r.pending.is_none(), "an instance exists; no spec kept");
        assert!(r.condition_since("Ready", true).is_some());
        assert!(r.condition_since("Ready", false).is_none());
        assert!(r.timeline.bound.is_some());
        assert!(
            r.timeline
                .render()
                .starts_with("bound=2025-12-31T23:59:59Z observed=+")
        );
        assert_eq!(r.active_deadline, None);
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
            PodRecord::from_pod(&p, "vk", None, SystemTime::now())
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
            PodRecord::from_pod(&none, "vk", None, SystemTime::now())
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
            PodRecord::from_pod(&p, "vk", None, SystemTime::now()).unwrap()
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
