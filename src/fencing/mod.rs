//! Never lose, leak or double-run an instance: leader election with epochs
//! ([`leader`]), orphan and duplicate collection with a brake ([`plan`]), the
//! partition policy, and one audit line for every instance vkd deletes.

pub mod leader;
pub mod term;

use std::collections::HashMap;

use tracing::warn;
use vkd_provider::Instance;

/// Pod annotation: what to do with the instance when vkd cannot reach the API
/// server for longer than `--partition-fence-after`: `fence` stops it, `keep`
/// (the default) leaves it running.
pub const PARTITION_POLICY_ANNOTATION: &str = "vkd.io/partition-policy";

/// The audit line every removal of an instance writes (once, when the backend
/// confirmed it, or when it was ordered for duplicates and partition fences).
#[allow(clippy::too_many_arguments)]
pub fn audit(
    uid: &str,
    pod: &str,
    node: &str,
    backend: &str,
    instance: &str,
    epoch: u64,
    cause: &str,
) {
    warn!(
        target: "vkd::audit",
        pod_uid = %uid,
        pod,
        node,
        backend,
        instance,
        epoch,
        cause,
        "instance removed"
    );
}

/// How much one collection pass may delete without an override.
#[derive(Clone, Copy, Debug)]
pub struct Brake {
    /// The share of the node's instances one pass may delete as orphans.
    pub max_fraction: f64,
    /// Below this many orphans the brake never holds (one force-deleted Pod
    /// is not a mass deletion).
    pub min_count: usize,
    /// Delete anyway (`--gc-allow-mass-delete`), for when the Pods really are gone.
    pub allow_mass_delete: bool,
}

impl Default for Brake {
    fn default() -> Self {
        Self {
            max_fraction: 0.5,
            min_count: 10,
            allow_mass_delete: false,
        }
    }
}

/// What one collection pass does.
#[derive(Debug, Default)]
pub struct Plan {
    /// Instances whose Pod is gone: deleted unless the brake holds.
    pub orphans: Vec<Instance>,
    /// More than one instance for a Pod UID: all but the newest epoch go.
    pub duplicates: Vec<Instance>,
    /// Why the orphans are kept this time.
    pub braked: Option<String>,
}

/// Plans a pass over `instances` (the backend's list for `node`); `has_pod`
/// says whether a Pod UID still has a Pod.
pub fn plan(
    node: &str,
    instances: Vec<Instance>,
    has_pod: impl Fn(&str) -> bool,
    brake: Brake,
) -> Plan {
    // Only this node's instances count toward the brake's fraction: a
    // backend that lists other nodes' too must not dilute it.
    let ours: Vec<Instance> = instances.into_iter().filter(|i| i.node == node).collect();
    let total = ours.len();
    let mut by_owner: HashMap<String, Vec<Instance>> = HashMap::new();
    for i in ours {
        by_owner.entry(i.owner.uid.clone()).or_default().push(i);
    }
    let mut out = Plan::default();
    for (uid, mut list) in by_owner {
        // The newest epoch wins; among equals, the newest instance.
        list.sort_by_key(|i| (i.epoch, i.created_at));
        let Some(keep) = list.pop() else { continue };
        out.duplicates.extend(list);
        if !has_pod(&uid) {
            out.orphans.push(keep);
        }
    }
    let n = out.orphans.len();
    let limit = (brake.max_fraction * total as f64).floor() as usize;
    if n >= brake.min_count && n > limit && !brake.allow_mass_delete {
        out.braked = Some(format!(
            "{n} of {total} instances on node {node} have no Pod; one pass may delete at most {limit} \
             ({:.0}%). Nothing was deleted: check the Pod list (a wrong namespace, an emptied cluster, \
             an apiserver restored from backup), or run vkd with --gc-allow-mass-delete if these Pods \
             really are gone",
            brake.max_fraction * 100.0
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, SystemTime};

    use vkd_provider::{InstancePhase, PodRef};

    use super::*;

    fn inst(uid: &str, id: &str, epoch: u64, age_s: u64) -> Instance {
        Instance {
            id: id.into(),
            owner: PodRef {
                uid: uid.into(),
                namespace: "ns".into(),
                name: format!("p-{uid}"),
            },
            node: "vk".into(),
            epoch,
            phase: InstancePhase::Running,
            containers: Vec::new(),
            ip: None,
            host: None,
            created_at: SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000 - age_s),
            started_at: None,
            message: None,
            init_containers: Vec::new(),
            ephemeral_containers: Vec::new(),
            host_ip: None,
            events: Vec::new(),
        }
    }

    #[test]
    fn duplicates_keep_the_newest_epoch() {
        let p = plan(
            "vk",
            vec![
                inst("a", "old", 3, 10),
                inst("a", "new", 4, 100),
                inst("a", "same-epoch-older", 4, 200),
                inst("b", "only", 1, 5),
            ],
            |_| true,
            Brake::default(),
        );
        let mut gone: Vec<&str> = p.duplicates.iter().map(|i| i.id.as_str()).collect();
        gone.sort_unstable();
        assert_eq!(gone, ["old", "same-epoch-older"]);
        assert!(p.orphans.is_empty() && p.braked.is_none());
    }

    #[test]
    fn the_brake_holds_for_a_mass_orphaning_only() {
        let many: Vec<Instance> = (0..20)
            .map(|i| inst(&format!("u{i}"), &format!("i{i}"), 1, 1))
            .collect();
        // The Pod list looks empty: everything would be an orphan.
        let p = plan("vk", many.clone(), |_| false, Brake::default());
        assert_eq!(p.orphans.len(), 20);
        let why = p.braked.expect("braked");
        assert!(
            why.contains("20 of 20 instances") && why.contains("--gc-allow-mass-delete"),
            "{why}"
        );
        // The override lets it through.
        let p = plan(
            "vk",
            many.clone(),
            |_| false,
            Brake {
                allow_mass_delete: true,
                ..Brake::default()
            },
        );
        assert!(p.braked.is_none());
        // A few orphans among many Pods are ordinary.
        let p = plan(
            "vk",
            many.clone(),
            |u| u != "u1" && u != "u2",
            Brake::default(),
        );
        assert_eq!((p.orphans.len(), p.braked.is_none()), (2, true));
        // One force-deleted Pod of one is not a mass deletion.
        let p = plan("vk", many[..1].to_vec(), |_| false, Brake::default());
        assert!(p.braked.is_none());
    }

    #[test]
    fn other_nodes_instances_do_not_dilute_the_brake() {
        // A shared backend lists three nodes' instances; this node's Pod list
        // looks empty. Its 10 instances are all it may judge by.
        let mut all: Vec<Instance> = (0..10)
            .map(|i| inst(&format!("u{i}"), &format!("i{i}"), 1, 1))
            .collect();
        for (n, node) in ["vk-2", "vk-3"].iter().enumerate() {
            all.extend((0..10).map(|i| {
                let mut o = inst(&format!("o{n}-{i}"), &format!("o{n}-{i}"), 1, 1);
                o.node = (*node).into();
                o
            }));
        }
        let p = plan("vk", all, |_| false, Brake::default());
        assert_eq!(p.orphans.len(), 10);
        let why = p.braked.expect("braked");
        assert!(why.contains("10 of 10 instances on node vk"), "{why}");
    }

    #[test]
    fn other_nodes_are_not_touched() {
        let mut other = inst("x", "elsewhere", 1, 1);
        other.node = "vk-2".into();
        let p = plan("vk", vec![other], |_| false, Brake::default());
        assert!(p.orphans.is_empty());
    }
}
