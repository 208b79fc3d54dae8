//! The state each feature keeps in a record, and how it is read from a Pod:
//! what the watch sees of ephemeral containers, storage limits and the
//! metadata downwardAPI volumes show, and what the steps learn of them.
//! Pure data; the behaviour is in the feature's step.

use std::hash::{Hash, Hasher};

use k8s_openapi::api::core::v1::{Container, Pod, PodSpec};
use serde_json::Value;
use vkd_provider::PodStats;

use super::ContainerInfo;
use crate::pods::spec::{self, Pending};

/// What the watch sees of `spec.ephemeralContainers` (none for most Pods).
#[derive(Clone, Debug, Default)]
pub struct EphemeralSpec {
    /// `spec.ephemeralContainers`, in order.
    pub containers: Box<[ContainerInfo]>,
    /// `targetContainerName` by ephemeral container: whose process
    /// namespace each joins, where the backend gives containers their own.
    pub targets: Box<[(Box<str>, Box<str>)]>,
    /// The Pod's pending spec with the ones that waited when the Pod was
    /// read as its containers (env declared, not yet resolved); `None` when
    /// none waited.
    pub pending: Option<Box<Pending>>,
    /// Those whose spec cannot be read at all, and why (never tried).
    pub unreadable: Vec<Refusal>,
}

/// What the steps learned of a Pod's ephemeral containers.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EphemeralProgress {
    /// Handed to the provider: it reports them from then on.
    pub handed: Vec<Box<str>>,
    /// Not started, and why.
    pub refused: Vec<Refusal>,
}

/// Why an ephemeral container did not start.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    pub name: Box<str>,
    pub reason: Box<str>,
    pub message: Box<str>,
    /// Tried again (something it refers to may appear, as the kubelet retries
    /// CreateContainerConfigError); otherwise it will never start here.
    pub retry: bool,
}

impl EphemeralProgress {
    /// Still to be handed over: neither handed nor refused for good.
    pub fn waits(&self, name: &str) -> bool {
        !self.handed.iter().any(|h| &**h == name)
            && !self.refused.iter().any(|r| &*r.name == name && !r.retry)
    }

    pub fn refusal(&self, name: &str) -> Option<&Refusal> {
        self.refused.iter().find(|r| &*r.name == name)
    }

    /// Notes why `r.name` did not start (replacing an older reason).
    pub fn refuse(&mut self, r: Refusal) {
        self.refused.retain(|o| o.name != r.name);
        self.refused.push(r);
    }

    /// Notes that `name` was handed to the provider.
    pub fn hand(&mut self, name: &str) {
        if !self.handed.iter().any(|h| &**h == name) {
            self.handed.push(name.into());
        }
        self.refused.retain(|r| &*r.name != name);
    }
}

impl EphemeralSpec {
    /// From the Pod; `progress` says which were handed over or refused, so
    /// only the others get a pending spec.
    pub fn of(pod: &Pod, node: &str, progress: Option<&EphemeralProgress>) -> Option<Box<Self>> {
        let list = pod.spec.as_ref()?.ephemeral_containers.as_ref()?;
        if list.is_empty() {
            return None;
        }
        let containers: Box<[ContainerInfo]> = list
            .iter()
            .map(|e| ContainerInfo {
                name: e.name.as_str().into(),
                image: e.image.clone().unwrap_or_default().into(),
                sidecar: false,
            })
            .collect();
        let targets = list
            .iter()
            .filter_map(|e| {
                let target = e.target_container_name.as_deref()?;
                Some((e.name.as_str().into(), target.into()))
            })
            .collect();
        let mut this = Self {
            containers,
            targets,
            pending: None,
            unreadable: Vec::new(),
        };
        let waits = |n: &str| progress.is_none_or(|p| p.waits(n));
        let waiting: Vec<&str> = this
            .containers
            .iter()
            .map(|c| &*c.name)
            .filter(|n| waits(n))
            .collect();
        if !waiting.is_empty() {
            match ephemeral_pending(pod, node, &waiting) {
                Ok(p) => this.pending = Some(Box::new(p)),
                Err(e) => {
                    this.unreadable = waiting
                        .iter()
                        .map(|n| Refusal {
                            name: (*n).into(),
                            reason: e.reason.into(),
                            message: e.message.as_str().into(),
                            retry: false,
                        })
                        .collect();
                }
            }
        }
        Some(Box::new(this))
    }
}

/// An ephemeral container as the Pod spec's container type (the same fields
/// but `targetContainerName`, which only a container runtime with process
/// namespaces acts on).
fn as_container(e: &k8s_openapi::api::core::v1::EphemeralContainer) -> Option<Container> {
    let mut v = serde_json::to_value(e).ok()?;
    if let Value::Object(m) = &mut v {
        m.remove("targetContainerName");
    }
    serde_json::from_value(v).ok()
}

/// The Pod's pending spec with the ephemeral containers `names` as its only
/// containers and no volumes (the instance has them): what [`spec::Resolver`]
/// resolves them from, with the Pod's fields, Services and other containers'
/// resources as the Pod's own containers see them.
pub fn ephemeral_pending(
    pod: &Pod,
    node: &str,
    names: &[&str],
) -> Result<Pending, spec::SpecError> {
    let mut whole = pod.clone();
    let invalid = |message: String| spec::SpecError {
        reason: "InvalidSpec",
        message,
    };
    if let Some(s) = whole.spec.as_mut() {
        for e in s.ephemeral_containers.iter().flatten() {
            if names.contains(&e.name.as_str()) {
                let c = as_container(e).ok_or_else(|| {
                    invalid(format!("ephemeral container {} cannot be read", e.name))
                })?;
                s.containers.push(c);
            }
        }
    }
    let mut p = spec::pending(&whole, node)?;
    let wanted = |n: &str| names.contains(&n);
    let all = p.spec.init_containers.iter().chain(&p.spec.containers);
    let keep: Vec<bool> = all.map(|c| wanted(&c.name)).collect();
    let mut keep_env = keep.iter();
    p.env.retain(|_| keep_env.next().copied().unwrap_or(false));
    p.spec.containers.retain(|c| wanted(&c.name));
    p.spec.init_containers.clear();
    p.volumes.clear();
    for c in &mut p.spec.containers {
        // As the API allows: no probes, hooks or resources; and never restarted.
        c.restart_always = false;
    }
    Ok(p)
}

/// The digest of a Pod's labels and annotations, which downwardAPI volumes
/// show: `None` for a Pod without volumes that follow their sources.
pub fn volume_metadata(pod: &Pod) -> Option<std::num::NonZeroU64> {
    let spec = pod.spec.as_ref()?;
    if !spec.volumes.iter().flatten().any(spec::refreshable) {
        return None;
    }
    let mut h = std::collections::hash_map::DefaultHasher::new();
    pod.metadata.labels.hash(&mut h);
    pod.metadata.annotations.hash(&mut h);
    Some(std::num::NonZeroU64::new(h.finish()).unwrap_or(std::num::NonZeroU64::MIN))
}

/// What the volume refresh learned of a Pod whose volumes follow their sources.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VolumeProgress {
    /// [`volume_metadata`] as the last refresh (or the first sight) saw it:
    /// a Pod whose labels or annotations changed since is due at once.
    pub metadata: std::num::NonZeroU64,
    /// The digest of the content the instance's volumes hold, once known.
    pub written: Option<u64>,
    /// When the sources are read next.
    pub due: super::Stamp,
}

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
            gpus: Vec::new(),
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
