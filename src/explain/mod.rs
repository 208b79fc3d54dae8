//! `vkd explain`: why a Pod waits, why an instance exists, why nothing moved.
//!
//! The daemon keeps one bounded log of its recent decisions ([`DecisionLog`]:
//! admissions, creations, adoptions, removals, fences, brakes), shared by all
//! its nodes, instead of a history per Pod: its memory does not grow with the
//! number of Pods. The kubelet API serves what the daemon knows of a Pod, a
//! node or an instance as JSON ([`PodAnswer`], [`NodeAnswer`],
//! [`InstanceAnswer`]), authorized as the kubelet authorizes its own API; the
//! `vkd explain` command ([`crate::cli::explain`]) joins that with what the
//! user may read from the API server and prints it with the sources a person
//! can check. This module is the daemon's side only: the data it keeps and
//! serves; nothing here reads flags or talks to the user.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::SystemTime;

use serde::{Deserialize, Serialize};

/// How many decisions the daemon keeps: about 300 bytes each, so at most
/// about 1.2 MiB whatever the number of Pods (docs/scale.md).
pub const DECISIONS_KEPT: usize = 4096;
/// A decision's sentence is cut here (at a character boundary), so a fleet
/// of many hosts cannot make one entry large.
pub const DETAIL_MAX: usize = 400;

/// Times in answers as RFC 3339 text (to the millisecond), for people and tools.
mod rfc3339 {
    use std::time::SystemTime;

    use serde::{Deserialize, Deserializer, Serializer};

    pub(super) fn text(t: SystemTime) -> String {
        jiff::Timestamp::try_from(t)
            .map(|ts| ts.strftime("%Y-%m-%dT%H:%M:%S%.3fZ").to_string())
            .unwrap_or_else(|_| "1970-01-01T00:00:00.000Z".into())
    }

    pub(super) fn parse(s: &str) -> Result<SystemTime, String> {
        s.parse::<jiff::Timestamp>()
            .map(SystemTime::from)
            .map_err(|e| format!("time {s:?}: {e}"))
    }

    pub(super) fn serialize<S: Serializer>(t: &SystemTime, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&text(*t))
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<SystemTime, D::Error> {
        parse(&String::deserialize(d)?).map_err(serde::de::Error::custom)
    }

    pub(super) mod option {
        use std::time::SystemTime;

        use serde::{Deserialize, Deserializer, Serializer};

        pub(in super::super) fn serialize<S: Serializer>(
            t: &Option<SystemTime>,
            s: S,
        ) -> Result<S::Ok, S::Error> {
            match t {
                Some(t) => s.serialize_str(&super::text(*t)),
                None => s.serialize_none(),
            }
        }

        pub(in super::super) fn deserialize<'de, D: Deserializer<'de>>(
            d: D,
        ) -> Result<Option<SystemTime>, D::Error> {
            Option::<String>::deserialize(d)?
                .map(|s| super::parse(&s).map_err(serde::de::Error::custom))
                .transpose()
        }
    }
}

/// A time as an answer writes it.
pub fn time_text(t: SystemTime) -> String {
    rfc3339::text(t)
}

/// What a decision was.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Action {
    /// Admission found a place and reserved it.
    Admitted,
    /// Admission found no place now; the Pod waits (BackendQueued).
    Queued,
    /// Admission refused the Pod for good.
    Rejected,
    /// The backend created the instance.
    Created,
    /// This replica found the instance made under an older epoch and took it on.
    Adopted,
    /// The instance was removed (its Pod deleted, gone, or a duplicate).
    Removed,
    /// The partition policy stopped the instance.
    Fenced,
    /// A collection pass kept orphans because the brake held.
    Braked,
}

/// One decision, as the log keeps it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Decision {
    #[serde(with = "rfc3339")]
    pub at: SystemTime,
    pub node: String,
    /// Empty for a node-wide decision (a brake).
    pub pod_uid: String,
    /// `namespace/name`.
    pub pod: String,
    /// The backend's id, when there is an instance.
    pub instance: String,
    pub action: Action,
    /// The replica that decided (its leader identity) and its epoch.
    pub replica: String,
    pub epoch: u64,
    pub detail: String,
}

/// The daemon's recent decisions, oldest first, at most [`DECISIONS_KEPT`].
#[derive(Debug)]
pub struct DecisionLog {
    replica: String,
    kept: usize,
    entries: Mutex<VecDeque<Decision>>,
}

impl DecisionLog {
    pub fn new(replica: impl Into<String>, kept: usize) -> Self {
        Self {
            replica: replica.into(),
            kept: kept.max(1),
            entries: Mutex::new(VecDeque::new()),
        }
    }

    pub fn replica(&self) -> &str {
        &self.replica
    }

    fn entries(&self) -> std::sync::MutexGuard<'_, VecDeque<Decision>> {
        self.entries.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records a decision; the oldest goes when the log is full.
    #[allow(clippy::too_many_arguments)]
    pub fn record(
        &self,
        node: &str,
        pod_uid: &str,
        pod: &str,
        instance: &str,
        epoch: u64,
        action: Action,
        detail: impl Into<String>,
    ) {
        let mut detail: String = detail.into();
        if detail.len() > DETAIL_MAX {
            let mut cut = DETAIL_MAX;
            while !detail.is_char_boundary(cut) {
                cut -= 1;
            }
            detail.truncate(cut);
            detail.push_str(" ...");
        }
        let d = Decision {
            at: SystemTime::now(),
            node: node.to_owned(),
            pod_uid: pod_uid.to_owned(),
            pod: pod.to_owned(),
            instance: instance.to_owned(),
            action,
            replica: self.replica.clone(),
            epoch,
            detail,
        };
        let mut entries = self.entries();
        while entries.len() >= self.kept {
            entries.pop_front();
        }
        entries.push_back(d);
    }

    /// The decisions about a Pod UID or an instance id (either may be empty).
    pub fn about(&self, pod_uid: &str, instance: &str) -> Vec<Decision> {
        self.entries()
            .iter()
            .filter(|d| {
                (!pod_uid.is_empty() && d.pod_uid == pod_uid)
                    || (!instance.is_empty() && d.instance == instance)
            })
            .cloned()
            .collect()
    }

    /// The latest sentence of `action` for each Pod UID, in one pass.
    pub fn latest(&self, action: Action) -> std::collections::HashMap<String, String> {
        self.entries()
            .iter()
            .filter(|d| d.action == action)
            .map(|d| (d.pod_uid.clone(), d.detail.clone()))
            .collect()
    }

    /// The most recent decisions of one node with these actions, newest last.
    pub fn recent(&self, node: &str, actions: &[Action], at_most: usize) -> Vec<Decision> {
        let mut out: Vec<Decision> = self
            .entries()
            .iter()
            .rev()
            .filter(|d| d.node == node && actions.contains(&d.action))
            .take(at_most)
            .cloned()
            .collect();
        out.reverse();
        out
    }
}

/// The leader lease this replica acts under.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Leadership {
    /// The lease holder identity (`--leader-election-identity`), or the
    /// host name when leader election is off.
    pub replica: String,
    pub epoch: u64,
    /// When this replica's term began.
    #[serde(with = "rfc3339")]
    pub since: SystemTime,
    /// False when leader election is off (one replica, a fixed epoch).
    pub elected: bool,
}

/// What admission holds for a Pod that is admitted but not yet running.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reservation {
    pub pod_uid: String,
    pub pod: String,
    pub host: String,
    pub gpu_ids: Vec<String>,
    pub cpu_millis: u64,
    pub memory_bytes: u64,
    /// The backend has the instance (and counts its CPU and memory itself).
    pub created: bool,
}

/// A Pod waiting in the backend queue.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Waiting {
    pub pod_uid: String,
    pub pod: String,
    #[serde(with = "rfc3339")]
    pub since: SystemTime,
    /// The admission's answer: what does not fit, naming the slices.
    pub reason: String,
}

/// The partition policy as it applies to a Pod now.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Partition {
    /// `fence` or `keep` (`vkd.io/partition-policy`; `keep` when unset).
    pub policy: String,
    /// `--partition-fence-after`: how long without a node lease renewal
    /// before a `fence` Pod's instance is stopped.
    pub fence_after_seconds: u64,
    /// Seconds since the node lease was last renewed (`None`: not yet).
    pub lease_renewed_seconds_ago: Option<f64>,
    /// This Pod's instance was stopped by the policy.
    pub fenced: bool,
}

/// One step of a Pod's start.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stage {
    pub stage: String,
    #[serde(with = "rfc3339")]
    pub at: SystemTime,
}

/// What vkd knows of one Pod (`GET /explain/pod/{namespace}/{name}`).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PodAnswer {
    pub node: String,
    pub backend: String,
    pub leadership: Leadership,
    pub pod_uid: String,
    pub pod: String,
    /// The phase the API server holds, as vkd last saw it.
    pub phase: String,
    /// Each step of the start with when it happened (`bound` first).
    pub timeline: Vec<Stage>,
    pub reservation: Option<Reservation>,
    /// Set while the Pod waits in the backend queue.
    pub waiting: Option<Waiting>,
    /// 1-based place among this node's waiting Pods (oldest first), and how many wait.
    pub queue_position: Option<(usize, usize)>,
    /// The host slices as the backend reports them now (while the Pod waits).
    pub slices: Option<Capacity>,
    pub instance: Option<vkd_provider::Instance>,
    /// The backend's own details of the instance (its GPUs, a downstream Pod).
    pub backend_details: Vec<(String, String)>,
    pub partition: Partition,
    pub decisions: Vec<Decision>,
}

/// The host slices and their semantics.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Capacity {
    /// `live` or `quota`.
    pub kind: String,
    #[serde(with = "rfc3339")]
    pub observed_at: SystemTime,
    pub refresh_seconds: u64,
    pub hosts: Vec<Slice>,
}

/// One host slice, in the figures a person compares with a Pod's request.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Slice {
    pub host: String,
    pub gpus_free: usize,
    pub gpus_total: usize,
    /// GPUs free in each NVLink domain (`domain:free`).
    pub nvlink_free: Vec<String>,
    pub gpu_model: String,
    pub cpu_millis_free: u64,
    pub memory_bytes_free: u64,
    pub cpu_millis_total: u64,
    pub memory_bytes_total: u64,
    pub pods_running: u32,
    pub max_pods: u32,
}

impl Capacity {
    pub fn of(cap: &vkd_provider::Capacity, host: Option<&str>) -> Self {
        let hosts = cap
            .hosts
            .iter()
            .filter(|h| host.is_none_or(|mine| mine == h.name))
            .map(|h| {
                let mut nvlink: Vec<String> = Vec::new();
                for g in &h.gpus {
                    let Some(d) = &g.nvlink_domain else { continue };
                    let entry = format!(
                        "{d}:{}",
                        h.gpus
                            .iter()
                            .filter(|x| x.free && x.nvlink_domain.as_ref() == Some(d))
                            .count()
                    );
                    if !nvlink.contains(&entry) {
                        nvlink.push(entry);
                    }
                }
                Slice {
                    host: h.name.clone(),
                    gpus_free: h.gpus_free(),
                    gpus_total: h.gpus.len(),
                    nvlink_free: nvlink,
                    gpu_model: h.gpus.first().map(|g| g.model.clone()).unwrap_or_default(),
                    cpu_millis_free: h.cpu_millis_free,
                    memory_bytes_free: h.memory_bytes_free,
                    cpu_millis_total: h.cpu_millis_total,
                    memory_bytes_total: h.memory_bytes_total,
                    pods_running: h.pods_running,
                    max_pods: h.max_pods,
                }
            })
            .collect();
        Self {
            kind: cap.kind.to_string(),
            observed_at: cap.observed_at,
            refresh_seconds: cap.refresh_interval.as_secs(),
            hosts,
        }
    }
}

/// An instance the backend holds that no Pod of this node owns, and what
/// collection does with it.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Unowned {
    pub instance: vkd_provider::Instance,
    /// `orphan` (its Pod is gone) or `duplicate` (its Pod has a newer one).
    pub kind: String,
    /// What the next collection pass does with it, and when.
    pub action: String,
}

/// How orphan collection stands on a node.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Collection {
    pub interval_seconds: u64,
    /// When the last pass ran (`None`: none yet, the Pod watch not synced).
    #[serde(with = "rfc3339::option")]
    pub last_pass: Option<SystemTime>,
    /// Why the brake holds now, if it would.
    pub braked: Option<String>,
    /// The brake's limits: a pass deletes at most this share of the node's
    /// instances once at least `brake_min_count` are orphans.
    pub brake_max_fraction: f64,
    pub brake_min_count: usize,
    pub allow_mass_delete: bool,
}

/// What vkd knows of one of its nodes (`GET /explain/node`).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct NodeAnswer {
    pub node: String,
    pub backend: String,
    pub leadership: Leadership,
    /// The host this node stands for (per-host mode), else all of them.
    pub host: Option<String>,
    pub capacity: Option<Capacity>,
    /// Why capacity could not be read.
    pub capacity_error: Option<String>,
    pub reservations: Vec<Reservation>,
    pub waiting: Vec<Waiting>,
    pub pods: usize,
    pub instances: usize,
    pub unowned: Vec<Unowned>,
    /// Why the backend's instances could not be listed.
    pub list_error: Option<String>,
    pub collection: Collection,
    /// The latest removals, fences and brakes on this node.
    pub recent: Vec<Decision>,
    pub partition_fence_after_seconds: u64,
    pub lease_renewed_seconds_ago: Option<f64>,
}

/// What vkd knows of one backend instance (`GET /explain/instance/{id}`).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct InstanceAnswer {
    pub node: String,
    pub backend: String,
    pub leadership: Leadership,
    pub id: String,
    /// The instance as the backend lists it now (`None`: not there).
    pub instance: Option<vkd_provider::Instance>,
    pub backend_details: Vec<(String, String)>,
    /// `owned`, `orphan`, `duplicate` or `gone`.
    pub verdict: String,
    /// Why, in a sentence.
    pub why: String,
    /// What happens to it next.
    pub action: String,
    pub collection: Collection,
    pub decisions: Vec<Decision>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_log_keeps_the_newest_and_finds_by_uid_or_instance() {
        let log = DecisionLog::new("r1", 3);
        for i in 0..5 {
            log.record(
                "vk",
                &format!("u{i}"),
                "ns/p",
                &format!("i{i}"),
                7,
                Action::Created,
                "x",
            );
        }
        assert!(log.about("u0", "").is_empty(), "the oldest went");
        assert_eq!(log.about("u4", "").len(), 1);
        assert_eq!(log.about("", "i3")[0].pod_uid, "u3");
        assert_eq!(log.about("u2", "")[0].replica, "r1");
        let recent = log.recent("vk", &[Action::Created], 2);
        let uids: Vec<&str> = recent.iter().map(|d| d.pod_uid.as_str()).collect();
        assert_eq!(uids, ["u3", "u4"]);
        assert!(log.recent("other", &[Action::Created], 2).is_empty());
        log.record("vk", "u4", "ns/p", "", 7, Action::Queued, "first");
        log.record("vk", "u4", "ns/p", "", 7, Action::Queued, "second");
        assert_eq!(log.latest(Action::Queued)["u4"], "second");
        // A long sentence is cut, on a character boundary.
        log.record(
            "vk",
            "u9",
            "ns/p",
            "",
            7,
            Action::Queued,
            "é".repeat(DETAIL_MAX),
        );
        let d = &log.about("u9", "")[0].detail;
        assert!(
            d.len() <= DETAIL_MAX + 4 && d.ends_with(" ..."),
            "{}",
            d.len()
        );
    }

    #[test]
    fn times_travel_as_rfc3339_text() {
        let log = DecisionLog::new("r1", 3);
        log.record("vk", "u", "ns/p", "i", 1, Action::Queued, "waits");
        let d = log.about("u", "").remove(0);
        let json = serde_json::to_value(&d).unwrap();
        let at = json["at"].as_str().unwrap();
        assert!(at.ends_with('Z') && at.contains('T'), "{at}");
        assert_eq!(json["action"], "queued");
        let back: Decision = serde_json::from_value(json).unwrap();
        let drift = back
            .at
            .duration_since(d.at)
            .unwrap_or_else(|e| e.duration());
        assert!(drift < std::time::Duration::from_millis(1), "{drift:?}");
        assert!(
            serde_json::from_value::<Decision>(serde_json::json!({"at": "yesterday"})).is_err()
        );
    }
}
