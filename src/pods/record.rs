//! The compact per-Pod record: what vkd must remember about a Pod between watch
//! events, instead of a cached copy of the whole object.

use std::collections::BTreeMap;
use std::time::SystemTime;

use k8s_openapi::api::core::v1::Pod;
use vkd_provider::{ContainerSpec, InstanceSpec, PodRef, Resources, RestartPolicy, quantity};

use super::status::{self, CONDITIONS, StatusView};

/// Why a Pod spec cannot be turned into an instance spec.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{reason}: {message}")]
pub struct SpecError {
    pub reason: &'static str,
    pub message: String,
}

#[derive(Clone, Debug)]
pub struct ContainerInfo {
    pub name: Box<str>,
    pub image: Box<str>,
}

/// When each step of a Pod's start happened.
#[derive(Clone, Debug, Default)]
pub struct Timeline {
    pub bound: Option<SystemTime>,
    pub observed: Option<SystemTime>,
    pub admitted: Option<SystemTime>,
    pub accepted: Option<SystemTime>,
    pub started: Option<SystemTime>,
    pub ready: Option<SystemTime>,
}

impl Timeline {
    /// `bound=<time> observed=+12ms admitted=+13ms ...`, offsets from the binding.
    pub fn render(&self) -> String {
        let base = self.bound.or(self.observed);
        let mut out = Vec::new();
        if let Some(b) = self.bound {
            out.push(format!("bound={}", status::time(b)));
        }
        for (name, t) in [
            ("observed", self.observed),
            ("admitted", self.admitted),
            ("accepted", self.accepted),
            ("started", self.started),
            ("ready", self.ready),
        ] {
            if let (Some(t), Some(base)) = (t, base) {
                let ms = t.duration_since(base).map_or(0, |d| d.as_millis());
                out.push(format!("{name}=+{ms}ms"));
            }
        }
        out.join(" ")
    }
}

/// One Pod bound to this node.
#[derive(Clone, Debug)]
pub struct PodRecord {
    pub namespace: Box<str>,
    pub name: Box<str>,
    pub uid: Box<str>,
    pub containers: Box<[ContainerInfo]>,
    /// Set once the Pod has a deletionTimestamp: the grace period in seconds.
    pub deletion_grace: Option<u32>,
    /// The instance spec, kept only until the instance is created.
    pub pending: Option<Box<InstanceSpec>>,
    /// Why the Pod spec cannot run at all (found when the record was built).
    pub spec_error: Option<SpecError>,
    /// The status as the API server holds it.
    pub observed: StatusView,
    /// The digest of `observed`.
    pub observed_digest: u64,
    pub start_time: Option<SystemTime>,
    /// lastTransitionTime of each of our conditions, with the status it belongs to.
    pub condition_times: [Option<(bool, SystemTime)>; 4],
    pub timeline: Timeline,
    /// A queued Event was already published for this Pod.
    pub queued_event_sent: bool,
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

    /// The phase the API server holds is terminal: nothing more to do but deletion.
    pub fn terminal(&self) -> bool {
        self.observed.phase == "Succeeded" || self.observed.phase == "Failed"
    }

    /// When condition `t` took status `s`, if the API already holds it that way.
    pub fn condition_since(&self, t: &str, s: bool) -> Option<SystemTime> {
        let i = CONDITIONS.iter().position(|c| *c == t)?;
        self.condition_times[i]
            .filter(|(st, _)| *st == s)
            .map(|(_, at)| at)
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
                    condition_times[i] = Some((c.status == "True", SystemTime::from(at.0)));
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
            .map(|t| SystemTime::from(t.0));
        let mut timeline = previous.map(|p| p.timeline.clone()).unwrap_or_default();
        timeline.bound = timeline.bound.or(bound);
        timeline.observed = timeline.observed.or(Some(now));
        let created = observed.instance_id.is_some();
        let (pending, spec_error) =
            if created || previous.is_some_and(|p| p.pending.is_none() && p.spec_error.is_none()) {
                (None, None)
            } else {
                match instance_spec(pod, node) {
                    Ok(s) => (Some(Box::new(s)), None),
                    Err(e) => (None, Some(e)),
                }
            };
        Some(Self {
            namespace: meta.namespace.clone().unwrap_or_default().into(),
            name: meta.name.clone().unwrap_or_default().into(),
            uid: uid.into(),
            containers: spec
                .containers
                .iter()
                .map(|c| ContainerInfo {
                    name: c.name.as_str().into(),
                    image: c.image.clone().unwrap_or_default().into(),
                })
                .collect(),
            deletion_grace: meta.deletion_timestamp.as_ref().map(|_| {
                meta.deletion_grace_period_seconds
                    .and_then(|g| u32::try_from(g).ok())
                    .unwrap_or(30)
            }),
            pending,
            spec_error,
            observed_digest: observed.digest(),
            observed,
            start_time: api_status
                .and_then(|s| s.start_time.as_ref())
                .map(|t| SystemTime::from(t.0))
                .or(previous.and_then(|p| p.start_time)),
            condition_times,
            timeline,
            queued_event_sent: previous.is_some_and(|p| p.queued_event_sent),
        })
    }
}

/// Sums container requests the way the scheduler does (limits stand in for
/// missing requests), and the larger of that and any single init container.
fn resources(spec: &k8s_openapi::api::core::v1::PodSpec) -> Result<Resources, SpecError> {
    let one = |c: &k8s_openapi::api::core::v1::Container| -> Result<Resources, SpecError> {
        let res = c.resources.as_ref();
        let get = |name: &str| {
            res.and_then(|r| r.requests.as_ref().and_then(|m| m.get(name)))
                .or_else(|| res.and_then(|r| r.limits.as_ref().and_then(|m| m.get(name))))
                .map(|q| q.0.clone())
        };
        let invalid = |what: &str, e: quantity::QuantityError| SpecError {
            reason: "InvalidResources",
            message: format!("container {}: {what}: {e}", c.name),
        };
        Ok(Resources {
            cpu_millis: get("cpu")
                .map(|q| quantity::cpu_millis(&q))
                .transpose()
                .map_err(|e| invalid("cpu", e))?
                .unwrap_or(0),
            memory_bytes: get("memory")
                .map(|q| quantity::bytes(&q))
                .transpose()
                .map_err(|e| invalid("memory", e))?
                .unwrap_or(0),
            gpus: get("nvidia.com/gpu")
                .map(|q| quantity::count(&q))
                .transpose()
                .map_err(|e| invalid("nvidia.com/gpu", e))?
                .map_or(Ok(0), u32::try_from)
                .map_err(|_| SpecError {
                    reason: "InvalidResources",
                    message: format!("container {}: too many nvidia.com/gpu", c.name),
                })?,
        })
    };
    let mut total = Resources::default();
    for c in &spec.containers {
        let r = one(c)?;
        total.cpu_millis += r.cpu_millis;
        total.memory_bytes += r.memory_bytes;
        total.gpus += r.gpus;
    }
    for c in spec.init_containers.iter().flatten() {
        let r = one(c)?;
        total.cpu_millis = total.cpu_millis.max(r.cpu_millis);
        total.memory_bytes = total.memory_bytes.max(r.memory_bytes);
        total.gpus = total.gpus.max(r.gpus);
    }
    Ok(total)
}

/// What the provider is told about a Pod.
pub fn instance_spec(pod: &Pod, node: &str) -> Result<InstanceSpec, SpecError> {
    let meta = &pod.metadata;
    let spec = pod.spec.as_ref().ok_or(SpecError {
        reason: "InvalidSpec",
        message: "the Pod has no spec".into(),
    })?;
    let restart_policy = match spec.restart_policy.as_deref() {
        None | Some("Always") => RestartPolicy::Always,
        Some("OnFailure") => RestartPolicy::OnFailure,
        Some("Never") => RestartPolicy::Never,
        Some(other) => {
            return Err(SpecError {
                reason: "InvalidSpec",
                message: format!("restartPolicy {other:?}"),
            });
        }
    };
    let containers = spec
        .containers
        .iter()
        .map(|c| ContainerSpec {
            name: c.name.clone(),
            image: c.image.clone().unwrap_or_default(),
            command: c.command.clone().unwrap_or_default(),
            args: c.args.clone().unwrap_or_default(),
            env: c
                .env
                .iter()
                .flatten()
                .filter_map(|e| e.value.clone().map(|v| (e.name.clone(), v)))
                .collect(),
        })
        .collect();
    Ok(InstanceSpec {
        pod: PodRef {
            uid: meta.uid.clone().unwrap_or_default(),
            namespace: meta.namespace.clone().unwrap_or_default(),
            name: meta.name.clone().unwrap_or_default(),
        },
        node: node.to_owned(),
        containers,
        resources: resources(spec)?,
        restart_policy,
        annotations: meta
            .annotations
            .clone()
            .unwrap_or_default()
            .into_iter()
            .collect::<BTreeMap<_, _>>(),
        placement: None,
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
    fn resources_are_summed_like_the_scheduler() {
        let p = pod(json!({
            "metadata": {"name": "p", "namespace": "ns", "uid": "u1"},
            "spec": {
                "containers": [
                    {"name": "a", "image": "x", "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"nvidia.com/gpu": "2"}}},
                    {"name": "b", "image": "y", "resources": {"requests": {"cpu": "1"}}}
                ],
                "initContainers": [{"name": "i", "image": "z", "resources": {"requests": {"cpu": "4"}}}]
            }
        }));
        let s = instance_spec(&p, "vk").unwrap();
        assert_eq!(
            s.resources,
            Resources {
                cpu_millis: 4000,
                memory_bytes: 1 << 30,
                gpus: 2
            }
        );
        assert_eq!(s.pod.uid, "u1");
        assert_eq!(s.restart_policy, RestartPolicy::Always);
    }

    #[test]
    fn bad_quantities_name_the_container() {
        let p = pod(json!({
            "metadata": {"name": "p", "namespace": "ns", "uid": "u1"},
            "spec": {"containers": [{"name": "a", "image": "x", "resources": {"requests": {"nvidia.com/gpu": "1.5"}}}]}
        }));
        let e = instance_spec(&p, "vk").unwrap_err();
        assert_eq!(e.reason, "InvalidResources");
        assert!(e.message.contains("container a"), "{e}");
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
    }
}
