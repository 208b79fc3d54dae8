//! Where an upstream Pod lives downstream. Names derive from the upstream UID
//! alone, so a retried or repeated create (after a restart, a failover, a lost
//! reply) meets the Pod it made before instead of making a second one.

/// Labels on every downstream Pod vkd makes, and on nothing else (the
/// admission policy in `manifests/downstream` refuses them to anyone else).
pub const OWNER_UID: &str = "vkd.io/owner-uid";
/// The upstream virtual node the Pod belongs to.
pub const OWNER_NODE: &str = "vkd.io/owner-node";
/// The epoch of the fence the Pod was created under (compared by the
/// downstream API server with the fence object, see `fence`).
pub const EPOCH: &str = "vkd.io/epoch";
/// Annotations: the upstream Pod's namespace and name.
pub const OWNER_NAMESPACE: &str = "vkd.io/owner-namespace";
pub const OWNER_NAME: &str = "vkd.io/owner-name";
/// Labels on every downstream namespace vkd makes: that vkd made it, and for
/// which upstream namespace (a namespace serves one upstream namespace only).
pub const MANAGED: &str = "vkd.io/managed";
pub const UPSTREAM_NAMESPACE: &str = "vkd.io/upstream-namespace";
/// The Pod Security level a namespace enforces.
pub const POD_SECURITY: &str = "pod-security.kubernetes.io/enforce";

const MAX_NAME: usize = 63;
/// `-` and 16 hex digits: the tail of a hashed namespace name.
const HASH_TAIL: usize = 17;

/// The downstream Pod's name: `vkd-<uid>`.
pub fn pod_name(uid: &str) -> String {
    format!("vkd-{uid}")
}

/// The Secret holding the files of the Pod's `index`-th file volume.
pub fn volume_secret_name(uid: &str, index: usize) -> String {
    format!("vkd-{uid}-v{index}")
}

/// How upstream namespaces map to downstream ones.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mapping {
    pub prefix: String,
    /// vkd's own namespace (the fences'): never a Pod's.
    pub fence_namespace: String,
}

impl Mapping {
    /// The downstream namespace for upstream namespace `ns`: `prefix + ns`
    /// when that is a name no hashed form, and none of the cluster's or vkd's
    /// own namespaces, can be; otherwise its start and a hash of the whole
    /// (`vkd-system-0123456789abcdef`). A literal never ends the way a hashed
    /// name does, so the two kinds never meet, and two upstream namespaces
    /// share one only by a hash collision, which the namespace's record of
    /// its upstream namespace then refuses (`ownership`).
    pub fn namespace(&self, ns: &str) -> String {
        let full = format!("{}{ns}", self.prefix);
        let reserved = full == self.fence_namespace || full == "default";
        if full.len() <= MAX_NAME && !looks_hashed(&full) && !reserved {
            return full;
        }
        let hash = format!("{:016x}", fnv1a(full.as_bytes()));
        let keep = (MAX_NAME - HASH_TAIL).min(full.len());
        // `full` is ASCII (a DNS label and a prefix checked as one), so any cut
        // is a char boundary; `get` keeps a bad one from panicking all the same.
        let head = full.get(..keep).unwrap_or(&self.prefix);
        let head = head.trim_end_matches('-');
        format!("{head}-{hash}")
    }
}

/// Ends in `-` and 16 lowercase hex digits, as a hashed name does.
fn looks_hashed(name: &str) -> bool {
    let b = name.as_bytes();
    b.len() >= HASH_TAIL
        && b[b.len() - HASH_TAIL] == b'-'
        && b[b.len() - HASH_TAIL + 1..]
            .iter()
            .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(c))
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

    fn mapping() -> Mapping {
        Mapping {
            prefix: "vkd-".into(),
            fence_namespace: "vkd-system".into(),
        }
    }

    #[test]
    fn namespaces_stay_valid_and_distinct() {
        let m = mapping();
        assert_eq!(m.namespace("team-a"), "vkd-team-a");
        let a = m.namespace(&"a".repeat(63));
        let b = m.namespace(&format!("{}b", "a".repeat(62)));
        assert!(a.len() <= 63 && b.len() <= 63, "{a} {b}");
        assert_ne!(a, b);
        assert!(looks_hashed(&a) && a.starts_with("vkd-aaa"), "{a}");
        assert_eq!(a, m.namespace(&"a".repeat(63)), "stable");
    }

    #[test]
    fn a_literal_name_never_equals_a_hashed_one() {
        let m = mapping();
        // The collision this mapping once allowed: a 59-character upstream
        // name spelling another's hashed form.
        let long = "a".repeat(63);
        let hashed = m.namespace(&long);
        let spelled = hashed.strip_prefix("vkd-").unwrap_or_default().to_owned();
        assert_eq!(spelled.len(), 59);
        let other = m.namespace(&spelled);
        assert_ne!(other, hashed, "{spelled} and {long} share {hashed}");
        assert!(other.len() <= 63 && looks_hashed(&other), "{other}");
        // Both stay valid namespace names.
        for n in [&hashed, &other] {
            assert!(
                n.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                    && !n.ends_with('-'),
                "{n}"
            );
        }
        // Hex-like but not a hash's shape stays literal.
        assert_eq!(m.namespace("build-1234"), "vkd-build-1234");
    }

    #[test]
    fn vkds_own_namespace_and_defaults_are_never_a_pods() {
        let m = mapping();
        let system = m.namespace("system");
        assert_ne!(system, "vkd-system");
        // The example docs/kubernetes-provider.md gives.
        assert_eq!(system, "vkd-system-ac6db1e8c446e6f0");
        let d = Mapping {
            prefix: "d".into(),
            fence_namespace: "vkd-system".into(),
        };
        assert_ne!(d.namespace("efault"), "default");
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
