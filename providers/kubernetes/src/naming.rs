//! Where an upstream Pod lives downstream. Names derive from the upstream UID
//! alone, so a retried or repeated create (after a restart, a failover, a lost
//! reply) meets the Pod it made before instead of making a second one.

/// Labels on every downstream Pod vkd makes, and on nothing else.
pub const OWNER_UID: &str = "vkd.io/owner-uid";
/// The upstream virtual node the Pod belongs to.
pub const OWNER_NODE: &str = "vkd.io/owner-node";
/// The epoch of the fence the Pod was created under (compared by the
/// downstream API server with the fence object, see `fence`).
pub const EPOCH: &str = "vkd.io/epoch";
/// Annotations: the upstream Pod's namespace and name, for a person reading
/// the downstream cluster.
pub const OWNER_NAMESPACE: &str = "vkd.io/owner-namespace";
pub const OWNER_NAME: &str = "vkd.io/owner-name";

const MAX_NAME: usize = 63;

/// The downstream Pod's name: `vkd-<uid>`.
pub fn pod_name(uid: &str) -> String {
    format!("vkd-{uid}")
}

/// The Secret holding the files of the Pod's `index`-th file volume.
pub fn volume_secret_name(uid: &str, index: usize) -> String {
    format!("vkd-{uid}-v{index}")
}

/// The downstream namespace for upstream namespace `ns`: `prefix + ns`, and
/// where that is longer than a namespace may be, its start with a hash of the
/// whole, so two long upstream names never share a downstream namespace.
pub fn namespace(prefix: &str, ns: &str) -> String {
    let full = format!("{prefix}{ns}");
    if full.len() <= MAX_NAME {
        return full;
    }
    let hash = format!("{:016x}", fnv1a(full.as_bytes()));
    let keep = MAX_NAME - hash.len() - 1;
    // `full` is ASCII (a DNS label and a prefix checked as one), so any cut is a char boundary.
    let head = full[..keep].trim_end_matches('-');
    format!("{head}-{hash}")
}

/// FNV-1a: stable across builds and platforms, unlike std's hasher.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// The instance id: `<cluster>/<namespace>/<name>`, which says where to look.
pub fn instance_id(cluster: &str, namespace: &str, name: &str) -> String {
    format!("{cluster}/{namespace}/{name}")
}

/// Splits an instance id back into namespace and name, if it is one of this cluster's.
pub fn parse_instance_id<'a>(cluster: &str, id: &'a str) -> Option<(&'a str, &'a str)> {
    let rest = id.strip_prefix(cluster)?.strip_prefix('/')?;
    let (ns, name) = rest.split_once('/')?;
    (!ns.is_empty() && !name.is_empty() && !name.contains('/')).then_some((ns, name))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn namespaces_stay_valid_and_distinct() {
        assert_eq!(namespace("vkd-", "team-a"), "vkd-team-a");
        let a = namespace("vkd-", &"a".repeat(63));
        let b = namespace("vkd-", &format!("{}b", "a".repeat(62)));
        assert!(a.len() <= 63 && b.len() <= 63, "{a} {b}");
        assert_ne!(a, b);
        assert!(!a.contains("--") || a.starts_with("vkd-"), "{a}");
        assert_eq!(a, namespace("vkd-", &"a".repeat(63)), "stable");
    }

    #[test]
    fn instance_ids_round_trip() {
        let id = instance_id("down", "vkd-ns", "vkd-u1");
        assert_eq!(parse_instance_id("down", &id), Some(("vkd-ns", "vkd-u1")));
        assert_eq!(parse_instance_id("other", &id), None);
        assert_eq!(parse_instance_id("down", "down/ns"), None);
        assert_eq!(parse_instance_id("down", "down/ns/a/b"), None);
    }
}
