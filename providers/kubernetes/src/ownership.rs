//! Which downstream objects are vkd's.
//!
//! Anyone who may create a Pod somewhere downstream can give it vkd's labels
//! and an upstream UID. Believing such a Pod would let it take another
//! tenant's place: vkd would stream `exec` and `logs` to it, or delete the
//! real Pod as its "duplicate". So a downstream Pod is vkd's only when all of
//! this holds:
//!
//! - it carries vkd's labels and annotations (`naming`);
//! - its name is the one vkd gives that upstream UID;
//! - its namespace is the one the mapping gives its upstream namespace, and
//!   that namespace is one vkd made for exactly that upstream namespace (its
//!   `vkd.io/managed` and `vkd.io/upstream-namespace` labels), never vkd's own;
//! - where vkd recorded the downstream UID of the Pod it made (at create, or
//!   when it first saw it), the object has that UID ([`Claims`]).
//!
//! Anything else is someone else's object: vkd leaves it alone, never deletes
//! it and never streams to it. The admission policy in `manifests/downstream`
//! refuses vkd's labels to anyone but vkd, so such objects should not exist;
//! these checks hold where it is bypassed (a cluster admin) or missing.

use std::collections::{HashMap, HashSet};

use k8s_openapi::api::core::v1::{Namespace, Pod};

use crate::naming::{self, Mapping};

/// Why a downstream object is not vkd's.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NotOurs {
    #[error("it has no {0} label")]
    MissingLabel(&'static str),
    #[error("it has no {0} annotation")]
    MissingAnnotation(&'static str),
    #[error("it is named {found}, where vkd names that Pod {want}")]
    Name { found: String, want: String },
    #[error(
        "it is in namespace {found}, where vkd runs upstream namespace {upstream}'s Pods in {want}"
    )]
    Namespace {
        found: String,
        upstream: String,
        want: String,
    },
    #[error("namespace {0} is vkd's own (the fences'); vkd runs no Pod there")]
    OwnNamespace(String),
    #[error("namespace {0} is not one vkd made (no {label}=true label)", label = naming::MANAGED)]
    Unmanaged(String),
    #[error("namespace {namespace} was made for upstream namespace {recorded}, not {claimed}")]
    OtherUpstream {
        namespace: String,
        recorded: String,
        claimed: String,
    },
    #[error("it has downstream UID {found}; the Pod vkd made there is {recorded}")]
    Uid { found: String, recorded: String },
    #[error("{0} downstream Pods claim this upstream Pod; vkd acts on none of them")]
    Contested(usize),
}

/// What a namespace says of itself: `Ok(Some(upstream))` when vkd made it
/// for that upstream namespace, `Ok(None)` when vkd made it before it
/// recorded upstream namespaces (adopted on its next use), an error when it
/// is not vkd's to use.
pub fn namespace_upstream<'a>(
    ns: &'a Namespace,
    mapping: &Mapping,
) -> Result<Option<&'a str>, NotOurs> {
    let name = ns.metadata.name.as_deref().unwrap_or_default();
    if name == mapping.fence_namespace {
        return Err(NotOurs::OwnNamespace(name.to_owned()));
    }
    let labels = ns.metadata.labels.as_ref();
    let label = |k: &str| labels.and_then(|l| l.get(k)).map(String::as_str);
    if label(naming::MANAGED) != Some("true") {
        return Err(NotOurs::Unmanaged(name.to_owned()));
    }
    Ok(label(naming::UPSTREAM_NAMESPACE))
}

/// What a downstream Pod claims: the upstream Pod it stands for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Claim<'a> {
    pub uid: &'a str,
    pub upstream_namespace: &'a str,
}

/// Checks that `pod` is where, and named as, vkd would make it, in a
/// namespace vkd made for its upstream namespace. `recorded` says, for a
/// downstream namespace, what vkd knows of it (see [`namespace_upstream`]).
pub fn check_pod<'a>(
    pod: &'a Pod,
    mapping: &Mapping,
    recorded: impl Fn(&str) -> Result<Option<String>, NotOurs>,
) -> Result<Claim<'a>, NotOurs> {
    let meta = &pod.metadata;
    let label = |k: &'static str| {
        meta.labels
            .as_ref()
            .and_then(|l| l.get(k))
            .map(String::as_str)
            .ok_or(NotOurs::MissingLabel(k))
    };
    let uid = label(naming::OWNER_UID)?;
    label(naming::OWNER_NODE)?;
    let upstream = meta
        .annotations
        .as_ref()
        .and_then(|a| a.get(naming::OWNER_NAMESPACE))
        .map(String::as_str)
        .ok_or(NotOurs::MissingAnnotation(naming::OWNER_NAMESPACE))?;
    let name = meta.name.as_deref().unwrap_or_default();
    let want = naming::pod_name(uid);
    if name != want {
        return Err(NotOurs::Name {
            found: name.to_owned(),
            want,
        });
    }
    let namespace = meta.namespace.as_deref().unwrap_or_default();
    let want = mapping.namespace(upstream);
    if namespace != want {
        return Err(NotOurs::Namespace {
            found: namespace.to_owned(),
            upstream: upstream.to_owned(),
            want,
        });
    }
    if namespace == mapping.fence_namespace {
        return Err(NotOurs::OwnNamespace(namespace.to_owned()));
    }
    match recorded(namespace)? {
        Some(r) if r != upstream => Err(NotOurs::OtherUpstream {
            namespace: namespace.to_owned(),
            recorded: r,
            claimed: upstream.to_owned(),
        }),
        // Recorded for it, or made before vkd recorded it: the mapping above
        // is then all there is to go on.
        _ => Ok(Claim {
            uid,
            upstream_namespace: upstream,
        }),
    }
}

/// A downstream Pod that passed [`check_pod`] for an upstream UID.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Home {
    pub namespace: String,
    /// The downstream Pod's own UID.
    pub pod_uid: String,
    /// vkd created it in this process (or met it at its create): the record
    /// wins over any other claimant.
    pub made: bool,
}

/// Per upstream UID, the downstream Pods that pass [`check_pod`] for it.
/// Only one can be vkd's (its name and namespace are fixed by the upstream
/// Pod); where more than one claims a UID, the one vkd made wins, and without
/// that record vkd believes none of them rather than guess.
#[derive(Debug, Default)]
pub struct Claims {
    by_uid: HashMap<String, Vec<Home>>,
}

impl Claims {
    /// Records the Pod vkd made (or met at its create) for `uid`.
    pub fn made(&mut self, uid: &str, namespace: &str, pod_uid: &str) {
        let homes = self.by_uid.entry(uid.to_owned()).or_default();
        homes.retain(|h| h.namespace != namespace);
        for h in homes.iter_mut() {
            h.made = false;
        }
        homes.push(Home {
            namespace: namespace.to_owned(),
            pod_uid: pod_uid.to_owned(),
            made: true,
        });
    }

    /// A claimant the watch showed. A Pod that replaced the one vkd made in
    /// the same place is not recorded: vkd never makes a Pod twice.
    pub fn seen(&mut self, uid: &str, namespace: &str, pod_uid: &str) -> Result<(), NotOurs> {
        let homes = self.by_uid.entry(uid.to_owned()).or_default();
        if let Some(h) = homes.iter_mut().find(|h| h.namespace == namespace) {
            if h.pod_uid == pod_uid {
                return Ok(());
            }
            if h.made {
                return Err(NotOurs::Uid {
                    found: pod_uid.to_owned(),
                    recorded: h.pod_uid.clone(),
                });
            }
            h.pod_uid = pod_uid.to_owned();
            return Ok(());
        }
        homes.push(Home {
            namespace: namespace.to_owned(),
            pod_uid: pod_uid.to_owned(),
            made: false,
        });
        Ok(())
    }

    /// The Pod `pod_uid` in `namespace` is gone.
    pub fn gone(&mut self, uid: &str, namespace: &str, pod_uid: &str) {
        if let Some(homes) = self.by_uid.get_mut(uid) {
            homes.retain(|h| !(h.namespace == namespace && h.pod_uid == pod_uid));
            if homes.is_empty() {
                self.by_uid.remove(uid);
            }
        }
    }

    /// After a full listing: claimants learnt from the watch that it no
    /// longer shows are gone (a relist reports no deletions). What vkd made
    /// is kept: its absence is for `find` to see.
    pub fn relisted(&mut self, present: &HashSet<(String, String, String)>) {
        self.by_uid.retain(|uid, homes| {
            homes.retain(|h| {
                h.made || present.contains(&(uid.clone(), h.namespace.clone(), h.pod_uid.clone()))
            });
            !homes.is_empty()
        });
    }

    /// What the API server lists for `uid` now (namespace, Pod UID) replaces
    /// the claimants learnt before; what vkd made is kept. Returns vkd's Pod.
    pub fn settle(
        &mut self,
        uid: &str,
        present: &[(String, String)],
    ) -> Result<Option<&Home>, NotOurs> {
        if let Some(homes) = self.by_uid.get_mut(uid) {
            homes.retain(|h| h.made);
        }
        for (ns, pod_uid) in present {
            // One in the place of what vkd made is not recorded.
            let _ = self.seen(uid, ns, pod_uid);
        }
        if self.by_uid.get(uid).is_some_and(Vec::is_empty) {
            self.by_uid.remove(uid);
        }
        self.home(uid)
    }

    /// vkd's Pod for `uid`: `Ok(None)` when none is known.
    pub fn home(&self, uid: &str) -> Result<Option<&Home>, NotOurs> {
        let Some(homes) = self.by_uid.get(uid) else {
            return Ok(None);
        };
        if let Some(made) = homes.iter().find(|h| h.made) {
            return Ok(Some(made));
        }
        match homes.as_slice() {
            [] => Ok(None),
            [one] => Ok(Some(one)),
            many => Err(NotOurs::Contested(many.len())),
        }
    }

    /// Whether the downstream Pod `pod_uid` in `namespace` is vkd's for `uid`.
    pub fn is_home(&self, uid: &str, namespace: &str, pod_uid: &str) -> Result<(), NotOurs> {
        match self.home(uid)? {
            Some(h) if h.namespace == namespace && h.pod_uid == pod_uid => Ok(()),
            Some(h) => Err(NotOurs::Uid {
                found: pod_uid.to_owned(),
                recorded: h.pod_uid.clone(),
            }),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // a failed unwrap is a failed test
    use super::*;
    use serde_json::json;

    fn mapping() -> Mapping {
        Mapping {
            prefix: "vkd-".into(),
            fence_namespace: "vkd-system".into(),
        }
    }

    fn pod(name: &str, namespace: &str, uid: &str, upstream_ns: &str) -> Pod {
        serde_json::from_value(json!({
            "metadata": {
                "name": name, "namespace": namespace, "uid": format!("down-{name}"),
                "labels": {"vkd.io/owner-uid": uid, "vkd.io/owner-node": "vk", "vkd.io/epoch": "99999"},
                "annotations": {"vkd.io/owner-namespace": upstream_ns, "vkd.io/owner-name": "web"}
            }
        }))
        .unwrap()
    }

    fn ns(name: &str, labels: serde_json::Value) -> Namespace {
        serde_json::from_value(json!({"metadata": {"name": name, "labels": labels}})).unwrap()
    }

    /// The namespaces vkd made: vkd-team for upstream team.
    fn recorded(name: &str) -> Result<Option<String>, NotOurs> {
        match name {
            "vkd-team" => Ok(Some("team".into())),
            "vkd-legacy" => Ok(None),
            "vkd-other" => Ok(Some("someone-else".into())),
            _ => Err(NotOurs::Unmanaged(name.into())),
        }
    }

    #[test]
    fn vkds_own_pod_is_believed() {
        let p = pod("vkd-u1", "vkd-team", "u1", "team");
        let c = check_pod(&p, &mapping(), recorded).unwrap();
        assert_eq!((c.uid, c.upstream_namespace), ("u1", "team"));
        // Made by a vkd before namespaces recorded their upstream one.
        let p = pod("vkd-u1", "vkd-legacy", "u1", "legacy");
        assert!(check_pod(&p, &mapping(), recorded).is_ok());
    }

    #[test]
    fn decoys_are_not_believed() {
        let m = mapping();
        // The reported attack: vkd's name and labels in the tenant's own namespace.
        let decoy = pod("vkd-u1", "tenant", "u1", "team");
        assert!(matches!(
            check_pod(&decoy, &m, recorded),
            Err(NotOurs::Namespace { .. })
        ));
        // ... claiming an upstream namespace that maps to the tenant's.
        let decoy = pod("vkd-u1", "tenant", "u1", "../tenant");
        assert!(check_pod(&decoy, &m, recorded).is_err());
        let decoy = pod("vkd-u1", "vkd-tenant", "u1", "tenant");
        assert_eq!(
            check_pod(&decoy, &m, recorded),
            Err(NotOurs::Unmanaged("vkd-tenant".into()))
        );
        // In vkd's namespace, but not under the name vkd gives the UID.
        let decoy = pod("decoy", "vkd-team", "u1", "team");
        assert!(matches!(
            check_pod(&decoy, &m, recorded),
            Err(NotOurs::Name { .. })
        ));
        // A namespace vkd made for another upstream namespace.
        let decoy = pod("vkd-u1", "vkd-other", "u1", "other");
        assert!(matches!(
            check_pod(&decoy, &m, recorded),
            Err(NotOurs::OtherUpstream { .. })
        ));
        // Without vkd's labels or annotation.
        let mut bare = pod("vkd-u1", "vkd-team", "u1", "team");
        bare.metadata.annotations = None;
        assert!(matches!(
            check_pod(&bare, &m, recorded),
            Err(NotOurs::MissingAnnotation(_))
        ));
        bare.metadata.labels = None;
        assert!(matches!(
            check_pod(&bare, &m, recorded),
            Err(NotOurs::MissingLabel(_))
        ));
    }

    #[test]
    fn namespaces_vkd_did_not_make_are_not_its_own() {
        let m = mapping();
        let made = ns(
            "vkd-team",
            json!({"vkd.io/managed": "true", "vkd.io/upstream-namespace": "team"}),
        );
        assert_eq!(namespace_upstream(&made, &m), Ok(Some("team")));
        let legacy = ns("vkd-team", json!({"vkd.io/managed": "true"}));
        assert_eq!(namespace_upstream(&legacy, &m), Ok(None));
        let tenants = ns("vkd-team", json!({"team": "x"}));
        assert!(matches!(
            namespace_upstream(&tenants, &m),
            Err(NotOurs::Unmanaged(_))
        ));
        // The fence namespace is never a Pod's, whatever its labels say.
        let own = ns("vkd-system", json!({"vkd.io/managed": "true"}));
        assert!(matches!(
            namespace_upstream(&own, &m),
            Err(NotOurs::OwnNamespace(_))
        ));
    }

    #[test]
    fn the_recorded_pod_wins_and_an_unrecorded_contest_believes_none() {
        let mut c = Claims::default();
        assert_eq!(c.home("u1"), Ok(None));
        c.made("u1", "vkd-team", "p1");
        // A second claimant elsewhere, and a replacement in the same place.
        c.seen("u1", "vkd-x", "decoy").unwrap();
        assert!(matches!(
            c.seen("u1", "vkd-team", "p2"),
            Err(NotOurs::Uid { .. })
        ));
        assert_eq!(c.home("u1").unwrap().unwrap().pod_uid, "p1");
        c.is_home("u1", "vkd-team", "p1").unwrap();
        assert!(c.is_home("u1", "vkd-x", "decoy").is_err());
        // After a restart (no record of making it): two claimants, none believed.
        let mut c = Claims::default();
        c.seen("u1", "vkd-team", "p1").unwrap();
        c.seen("u1", "vkd-x", "decoy").unwrap();
        assert_eq!(c.home("u1"), Err(NotOurs::Contested(2)));
        assert!(c.is_home("u1", "vkd-team", "p1").is_err());
        c.gone("u1", "vkd-x", "decoy");
        assert_eq!(c.home("u1").unwrap().unwrap().pod_uid, "p1");
        c.gone("u1", "vkd-team", "p1");
        assert_eq!(c.home("u1"), Ok(None));
        // Asking the API server settles a contest the watch left behind.
        let mut c = Claims::default();
        c.seen("u1", "vkd-team", "p1").unwrap();
        c.seen("u1", "vkd-x", "gone-since").unwrap();
        assert!(c.home("u1").is_err());
        let now = [("vkd-team".to_owned(), "p1".to_owned())];
        assert_eq!(c.settle("u1", &now).unwrap().unwrap().pod_uid, "p1");
        assert_eq!(c.settle("u1", &[]), Ok(None));
        // A relist drops claimants whose deletion the watch never reported,
        // never the record of what vkd made.
        let mut c = Claims::default();
        c.made("u1", "vkd-team", "p1");
        c.seen("u2", "vkd-team", "stale").unwrap();
        c.seen("u3", "vkd-team", "p3").unwrap();
        let present = HashSet::from([("u3".to_owned(), "vkd-team".to_owned(), "p3".to_owned())]);
        c.relisted(&present);
        assert_eq!(c.home("u1").unwrap().unwrap().pod_uid, "p1");
        assert_eq!(c.home("u2"), Ok(None));
        assert_eq!(c.home("u3").unwrap().unwrap().pod_uid, "p3");
    }
}
