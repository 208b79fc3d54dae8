//! Local ephemeral storage limits, enforced as the kubelet's eviction manager
//! enforces them: a Pod whose emptyDir outgrows its `sizeLimit`, whose usage
//! outgrows the sum of its containers' `ephemeral-storage` limits, or one of
//! whose containers outgrows its own, is evicted: its containers are stopped
//! at once and the Pod fails with reason `Evicted`. The usage figures come from
//! the provider's stats; a provider that does not measure them enforces nothing.

use std::time::Duration;

use k8s_openapi::api::core::v1::{Container, PodSpec};
use tokio_util::sync::CancellationToken;
use tracing::{info_span, warn};
use vkd_provider::{PodStats, Support};

use super::PodController;

/// How often usage is measured: the kubelet's eviction manager's period.
pub const CHECK_EVERY: Duration = Duration::from_secs(10);

/// The status reason and Event reason of an eviction, as the kubelet's.
pub const REASON: &str = "Evicted";

/// The grace period an evicted Pod's containers get, as the kubelet gives
/// for a limit it enforces (`immediateEvictionGracePeriodSeconds`).
pub const GRACE: Duration = Duration::from_secs(1);

/// The storage limits of one Pod, kept in its record only when it has any.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StorageLimits {
    /// The Pod's limit: its containers' `ephemeral-storage` limits summed as
    /// the kubelet's `PodLimits` sums them.
    pub pod: Option<u64>,
    /// Each container (and sidecar) with its own limit.
    pub containers: Box<[(Box<str>, u64)]>,
    /// Each emptyDir on disk with a `sizeLimit`.
    pub empty_dirs: Box<[(Box<str>, u64)]>,
}

/// A container's `ephemeral-storage` limit; zero counts (in the Pod's sum,
/// as the kubelet's `PodLimits` counts it).
fn ephemeral_limit(c: &Container) -> Option<u64> {
    let q = c
        .resources
        .as_ref()?
        .limits
        .as_ref()?
        .get("ephemeral-storage")?;
    vkd_provider::quantity::bytes(&q.0).ok()
}

impl StorageLimits {
    /// The limits in `spec`; `None` when it sets none.
    pub fn of(spec: &PodSpec) -> Option<Box<Self>> {
        let inits = spec.init_containers.as_deref().unwrap_or_default();
        let sidecar = |c: &Container| c.restart_policy.as_deref() == Some("Always");
        let long_running = spec
            .containers
            .iter()
            .chain(inits.iter().filter(|c| sidecar(c)));
        let limits: Vec<(Box<str>, u64)> = long_running
            .filter_map(|c| Some((c.name.as_str().into(), ephemeral_limit(c)?)))
            .collect();
        // What runs together at the end, or the largest init container with the
        // sidecars started before it: the larger one is the Pod's.
        let mut pod: Option<u64> = limits.iter().map(|(_, b)| *b).reduce(u64::saturating_add);
        // A container's own limit of zero is no limit (the kubelet skips it).
        let containers: Box<[(Box<str>, u64)]> =
            limits.into_iter().filter(|(_, b)| *b > 0).collect();
        let mut sidecars_before = 0u64;
        for c in inits {
            let limit = ephemeral_limit(c);
            if sidecar(c) {
                sidecars_before = sidecars_before.saturating_add(limit.unwrap_or(0));
            } else if let Some(l) = limit {
                let during = l.saturating_add(sidecars_before);
                pod = Some(pod.map_or(during, |p| p.max(during)));
            }
        }
        let empty_dirs: Box<[(Box<str>, u64)]> = spec
            .volumes
            .iter()
            .flatten()
            .filter_map(|v| {
                let e = v.empty_dir.as_ref()?;
                // Memory is held by the memory limit, not by this one.
                if e.medium.as_deref() == Some("Memory") {
                    return None;
                }
                let size = vkd_provider::quantity::bytes(&e.size_limit.as_ref()?.0).ok()?;
                (size > 0).then(|| (v.name.as_str().into(), size))
            })
            .collect();
        (pod.is_some() || !empty_dirs.is_empty()).then(|| {
            Box::new(Self {
                pod,
                containers,
                empty_dirs,
            })
        })
    }

    /// Why `stats` breaks a limit, in the kubelet's words and order (emptyDir,
    /// then the Pod, then a container); `None` while it keeps them all.
    pub fn exceeded(&self, stats: &PodStats) -> Option<String> {
        for (name, limit) in &self.empty_dirs {
            if let Some(v) = stats.volumes.iter().find(|v| *v.name == **name)
                && v.used_bytes > *limit
            {
                return Some(format!(
                    "Usage of EmptyDir volume {name:?} exceeds the limit {:?}. ",
                    quantity(*limit)
                ));
            }
        }
        if let (Some(limit), Some(used)) = (self.pod, stats.ephemeral_storage_bytes)
            && used > limit
        {
            return Some(format!(
                "Pod ephemeral local storage usage exceeds the total limit of containers {}. ",
                quantity(limit)
            ));
        }
        for (name, limit) in &self.containers {
            if let Some(used) = stats
                .containers
                .iter()
                .find(|c| *c.name == **name)
                .and_then(|c| c.ephemeral_storage_bytes)
                && used > *limit
            {
                return Some(format!(
                    "Container {name} exceeded its local ephemeral storage limit {:?}. ",
                    quantity(*limit)
                ));
            }
        }
        None
    }
}

/// Bytes as the API writes a quantity: in the largest binary unit that
/// divides them, else the largest decimal one, else plain.
fn quantity(bytes: u64) -> String {
    if bytes == 0 {
        return "0".into();
    }
    for (shift, unit) in [
        (60, "Ei"),
        (50, "Pi"),
        (40, "Ti"),
        (30, "Gi"),
        (20, "Mi"),
        (10, "Ki"),
    ] {
        if bytes.trailing_zeros() >= shift {
            return format!("{}{unit}", bytes >> shift);
        }
    }
    for (power, unit) in [
        (18, "E"),
        (15, "P"),
        (12, "T"),
        (9, "G"),
        (6, "M"),
        (3, "k"),
    ] {
        let scale = 10u64.pow(power);
        if bytes.is_multiple_of(scale) {
            return format!("{}{unit}", bytes / scale);
        }
    }
    bytes.to_string()
}

/// A Pod the eviction manager looks at: running, and not being deleted.
fn evictable(r: &super::record::PodRecord) -> bool {
    r.instance_id.is_some()
        && r.deletion_grace.is_none()
        && r.phase == super::record::Phase::Running
}

impl PodController {
    /// Measures the storage of each running Pod that has a limit, every
    /// [`CHECK_EVERY`], and queues those that broke one for eviction.
    pub(super) async fn storage_watch(&self, shutdown: CancellationToken) {
        if self.provider.capabilities().stats != Support::Supported {
            // Nothing to measure; a task that ended would stop the node.
            shutdown.cancelled().await;
            return;
        }
        let mut tick = tokio::time::interval(CHECK_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tick.tick() => {}
            }
            let watched: Vec<(String, String, Box<StorageLimits>)> = self
                .records()
                .values()
                .filter(|r| evictable(r))
                .filter_map(|r| Some((r.uid.to_string(), r.key(), r.storage_limits.clone()?)))
                .collect();
            for (uid, key, limits) in watched {
                if self.evicting().contains_key(&uid) {
                    continue;
                }
                let stats = tokio::select! {
                    _ = shutdown.cancelled() => return,
                    s = self.provider.stats(&uid) => s,
                };
                let Ok(stats) = stats else { continue };
                let Some(message) = limits.exceeded(&stats) else {
                    continue;
                };
                // Still running as it was when the pass began: not ended,
                // deleted or failed meanwhile.
                if !self.records().get(&uid).is_some_and(|r| evictable(r)) {
                    continue;
                }
                info_span!("pod", pod = %key, %uid).in_scope(|| {
                    warn!(reason = REASON, %message, "evicting the pod");
                });
                self.evicting().insert(uid.clone(), message);
                self.queue.add(&uid);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use vkd_provider::{ContainerStats, PodRef, VolumeStats};

    fn spec(v: serde_json::Value) -> PodSpec {
        serde_json::from_value(v).unwrap()
    }

    fn stats(pod: Option<u64>, volumes: &[(&str, u64)]) -> PodStats {
        PodStats {
            pod: PodRef {
                uid: "u".into(),
                namespace: "ns".into(),
                name: "p".into(),
            },
            start_time: std::time::SystemTime::UNIX_EPOCH,
            time: std::time::SystemTime::UNIX_EPOCH,
            containers: Vec::new(),
            ephemeral_storage_bytes: pod,
            volumes: volumes
                .iter()
                .map(|(n, b)| VolumeStats {
                    name: (*n).into(),
                    used_bytes: *b,
                })
                .collect(),
        }
    }

    #[test]
    fn a_pod_without_limits_keeps_nothing() {
        let s = spec(json!({
            "containers": [{"name": "a", "resources": {"limits": {"cpu": "1"}}}],
            "volumes": [{"name": "v", "emptyDir": {}}],
        }));
        assert_eq!(StorageLimits::of(&s), None);
    }

    #[test]
    fn the_pod_limit_sums_its_containers_and_weighs_init_containers() {
        let s = spec(json!({
            "initContainers": [
                {"name": "side", "restartPolicy": "Always",
                 "resources": {"limits": {"ephemeral-storage": "1Mi"}}},
                {"name": "big-init", "resources": {"limits": {"ephemeral-storage": "10Mi"}}},
            ],
            "containers": [
                {"name": "a", "resources": {"limits": {"ephemeral-storage": "2Mi"}}},
                {"name": "b"},
                {"name": "c", "resources": {"limits": {"ephemeral-storage": "3Mi"}}},
            ],
        }));
        let l = StorageLimits::of(&s).unwrap();
        // The init container runs beside the sidecar: 11Mi beats 1 + 2 + 3.
        assert_eq!(l.pod, Some(11 << 20));
        let names: Vec<&str> = l.containers.iter().map(|(n, _)| &**n).collect();
        assert_eq!(names, ["a", "c", "side"]);
    }

    #[test]
    fn usage_over_a_limit_evicts_with_the_kubelets_message() {
        let s = spec(json!({
            "containers": [{"name": "bar", "resources": {"limits": {"ephemeral-storage": "5Mi"}}}],
            "volumes": [
                {"name": "scratch", "emptyDir": {"sizeLimit": "1Mi"}},
                {"name": "ram", "emptyDir": {"medium": "Memory", "sizeLimit": "1Ki"}},
            ],
        }));
        let l = StorageLimits::of(&s).unwrap();
        assert_eq!(
            l.empty_dirs.len(),
            1,
            "a memory emptyDir is the memory limit's"
        );
        assert_eq!(
            l.exceeded(&stats(Some(5 << 20), &[("scratch", 1 << 20)])),
            None
        );
        assert_eq!(
            l.exceeded(&stats(Some(10 << 20), &[])).as_deref(),
            Some("Pod ephemeral local storage usage exceeds the total limit of containers 5Mi. ")
        );
        assert_eq!(
            l.exceeded(&stats(Some(10 << 20), &[("scratch", 2 << 20)]))
                .as_deref(),
            Some("Usage of EmptyDir volume \"scratch\" exceeds the limit \"1Mi\". "),
            "the emptyDir is looked at first"
        );
        // A backend that does not measure usage evicts nobody.
        assert_eq!(l.exceeded(&stats(None, &[])), None);
        let mut st = stats(None, &[]);
        st.containers.push(ContainerStats {
            name: "bar".into(),
            start_time: std::time::SystemTime::UNIX_EPOCH,
            cpu_usage_core_nanoseconds: 0,
            cpu_usage_nano_cores: 0,
            memory_working_set_bytes: 0,
            memory_rss_bytes: 0,
            ephemeral_storage_bytes: Some(6 << 20),
        });
        assert_eq!(
            l.exceeded(&st).as_deref(),
            Some("Container bar exceeded its local ephemeral storage limit \"5Mi\". ")
        );
    }

    #[test]
    fn quantities_read_as_the_api_writes_them() {
        assert_eq!(quantity(5 << 20), "5Mi");
        assert_eq!(quantity(1536), "1536");
        assert_eq!(quantity(3 << 30), "3Gi");
        assert_eq!(quantity(1000), "1k");
        assert_eq!(quantity(5_000_000), "5M");
        assert_eq!(quantity(1001), "1001");
        assert_eq!(quantity(0), "0");
    }
}
