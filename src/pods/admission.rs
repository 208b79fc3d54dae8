//! The kubelet's own admission of a Pod to its node (pkg/kubelet/lifecycle,
//! predicate.go): a Pod bound here by name, past the scheduler, that a kubelet
//! would reject is rejected the same way, with the kubelet's reason and
//! message, before anything of it reaches the backend. Workload controllers
//! read that rejection: a StatefulSet recreates the Pod, an operator that pins
//! `nodeName` sees `NodePorts` or `NodeAffinity`.
//!
//! Pure: the Pod's requirements, the Node as last seen, and what the Pods
//! already admitted here use. Resources that fit no host are the topology
//! admitter's (`TopologyUnsatisfiable`, `OutOf<resource>`), which runs after.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    Node, NodeSelector, NodeSelectorRequirement, NodeSelectorTerm, PodSpec, Taint, Toleration,
};

/// The kubelet's OS label; a virtual node is always linux.
const OS_LABEL: &str = "kubernetes.io/os";
const NODE_OS: &str = "linux";

/// What a Pod asks of its node, kept only until it is admitted.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Requirements {
    /// The Pod's `kubernetes.io/os` label (the kubelet checks the label, not the selector).
    os_label: Option<Box<str>>,
    /// `spec.os.name`.
    os_field: Option<Box<str>>,
    node_selector: BTreeMap<String, String>,
    /// `requiredDuringSchedulingIgnoredDuringExecution`.
    affinity: Option<NodeSelector>,
    tolerations: Vec<Toleration>,
}

impl Requirements {
    pub fn of(labels: Option<&BTreeMap<String, String>>, spec: &PodSpec) -> Self {
        Self {
            os_label: labels
                .and_then(|l| l.get(OS_LABEL))
                .map(|v| v.as_str().into()),
            os_field: spec.os.as_ref().map(|o| o.name.as_str().into()),
            node_selector: spec.node_selector.clone().unwrap_or_default(),
            affinity: spec
                .affinity
                .as_ref()
                .and_then(|a| a.node_affinity.as_ref())
                .and_then(|a| {
                    a.required_during_scheduling_ignored_during_execution
                        .clone()
                }),
            tolerations: spec.tolerations.clone().unwrap_or_default(),
        }
    }
}

/// What a Pod's record keeps for admission: its requirements until it is
/// admitted, and the host ports it holds for as long as it runs. `None` in
/// the record for the many running Pods without host ports.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct NodeClaim {
    pub requirements: Option<Requirements>,
    pub host_ports: Box<[HostPortUse]>,
}

impl NodeClaim {
    /// `awaits_admission`: the requirements are kept too.
    pub fn of(
        labels: Option<&BTreeMap<String, String>>,
        spec: &PodSpec,
        awaits_admission: bool,
    ) -> Option<Box<Self>> {
        let host_ports = host_ports(spec).unwrap_or_default();
        let requirements = awaits_admission.then(|| Requirements::of(labels, spec));
        (requirements.is_some() || !host_ports.is_empty()).then(|| {
            Box::new(Self {
                requirements,
                host_ports,
            })
        })
    }

    /// Admitted: only the host ports are kept.
    pub fn admitted(claim: &mut Option<Box<Self>>) {
        if let Some(c) = claim.as_deref_mut() {
            c.requirements = None;
        }
        if claim.as_ref().is_some_and(|c| c.host_ports.is_empty()) {
            *claim = None;
        }
    }
}

/// One `hostPort` a Pod holds on the node, as the scheduler's NodePorts
/// plugin keys it: an empty IP is every address, an empty protocol is TCP.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostPortUse {
    ip: Box<str>,
    protocol: Box<str>,
    port: u16,
}

impl HostPortUse {
    const ALL: &str = "0.0.0.0";

    /// Whether `self`, asked for, conflicts with `held`.
    fn conflicts(&self, held: &Self) -> bool {
        self.port == held.port
            && self.protocol == held.protocol
            && (*self.ip == *Self::ALL || *held.ip == *Self::ALL || self.ip == held.ip)
    }
}

/// The host ports of the Pod's containers and its sidecars (init containers
/// with `restartPolicy: Always`, which run as long as it does); `None` for the
/// many Pods without one.
pub fn host_ports(spec: &PodSpec) -> Option<Box<[HostPortUse]>> {
    let sidecars = spec
        .init_containers
        .iter()
        .flatten()
        .filter(|c| c.restart_policy.as_deref() == Some("Always"));
    let ports: Vec<HostPortUse> = sidecars
        .chain(&spec.containers)
        .flat_map(|c| c.ports.iter().flatten())
        .filter_map(|p| {
            let port = u16::try_from(p.host_port?).ok().filter(|p| *p > 0)?;
            let ip = p.host_ip.as_deref().filter(|ip| !ip.is_empty());
            let protocol = p.protocol.as_deref().filter(|p| !p.is_empty());
            Some(HostPortUse {
                ip: ip.unwrap_or(HostPortUse::ALL).into(),
                protocol: protocol.unwrap_or("TCP").into(),
                port,
            })
        })
        .collect();
    (!ports.is_empty()).then(|| ports.into_boxed_slice())
}

/// What admission reads of the Node.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct NodeView {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    /// Its NoExecute taints: the only effect the kubelet admits against.
    pub no_execute: Vec<Taint>,
    /// `status.allocatable.pods` (`None`: not reported yet).
    pub pods: Option<u64>,
}

impl NodeView {
    pub fn of(node: &Node) -> Self {
        let pods = node
            .status
            .as_ref()
            .and_then(|s| s.allocatable.as_ref())
            .and_then(|a| a.get("pods"))
            .and_then(|q| q.0.parse().ok());
        Self {
            name: node.metadata.name.clone().unwrap_or_default(),
            labels: node.metadata.labels.clone().unwrap_or_default(),
            no_execute: node
                .spec
                .as_ref()
                .and_then(|s| s.taints.as_ref())
                .into_iter()
                .flatten()
                .filter(|t| t.effect == "NoExecute")
                .cloned()
                .collect(),
            pods,
        }
    }
}

/// What the Pods already admitted to the node use.
#[derive(Debug, Default)]
pub struct InUse<'a> {
    pub pods: u64,
    pub host_ports: Vec<&'a HostPortUse>,
}

/// Why the node refuses a Pod: the kubelet's reason, and its message (the
/// Pod's status says "Pod was rejected: " before it, as the kubelet's does).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Rejection {
    pub reason: String,
    pub message: String,
}

impl Rejection {
    fn predicate(name: &str, description: &str) -> Self {
        Self {
            reason: name.into(),
            message: format!("Predicate {name} failed: {description}"),
        }
    }

    /// Only the node's labels refused it: worth a second look at a fresher Node.
    pub fn is_node_affinity(&self) -> bool {
        self.reason == "NodeAffinity"
    }
}

/// The kubelet's checks, in its order; the first that fails is the answer.
pub fn admit(
    req: &Requirements,
    ports: Option<&[HostPortUse]>,
    node: &NodeView,
    in_use: &InUse<'_>,
) -> Result<(), Rejection> {
    let node_os = node.labels.get(OS_LABEL).map_or(NODE_OS, String::as_str);
    if req.os_label.as_deref().is_some_and(|os| os != node_os) {
        return Err(Rejection {
            reason: "PodOSSelectorNodeLabelDoesNotMatch".into(),
            message: "Failed to admit pod as the `kubernetes.io/os` label doesn't match node label"
                .into(),
        });
    }
    if req.os_field.as_deref().is_some_and(|os| os != NODE_OS) {
        return Err(Rejection {
            reason: "PodOSNotSupported".into(),
            message: "Failed to admit pod as the OS field doesn't match node OS".into(),
        });
    }
    if let Some(capacity) = node.pods
        && in_use.pods.saturating_add(1) > capacity
    {
        return Err(Rejection {
            reason: "OutOfpods".into(),
            message: format!(
                "Node didn't have enough resource: pods, requested: 1, used: {}, capacity: {capacity}",
                in_use.pods
            ),
        });
    }
    if !matches_affinity(req, node) {
        return Err(Rejection::predicate(
            "NodeAffinity",
            "node(s) didn't match Pod's node affinity/selector",
        ));
    }
    let taken = ports
        .into_iter()
        .flatten()
        .any(|want| in_use.host_ports.iter().any(|held| want.conflicts(held)));
    if taken {
        return Err(Rejection::predicate(
            "NodePorts",
            "node(s) didn't have free ports for the requested pod ports",
        ));
    }
    let untolerated = node
        .no_execute
        .iter()
        .any(|taint| !req.tolerations.iter().any(|t| tolerates(t, taint)));
    if untolerated {
        return Err(Rejection::predicate(
            "TaintToleration",
            "node(s) had taints that the pod didn't tolerate",
        ));
    }
    Ok(())
}

/// On a node that serves its GPUs through DRA, which lists no
/// `nvidia.com/gpu` in its allocatable, a Pod asking for `nvidia.com/gpu`
/// gets GPUs only through the claim the scheduler makes for it
/// (`status.extendedResourceClaimStatus`). One bound here past the scheduler
/// has none: refused as a kubelet refuses a resource the node has none of
/// (the kubelet itself drops such a request and runs the Pod without the
/// device, which its own code calls a caveat to fix; a GPU Pod run without
/// its GPUs, or queued for ones it can never be given, helps nobody).
pub fn gpus_behind_claims(
    spec: &vkd_provider::InstanceSpec,
    claims: &[crate::dra::devices::ClaimRef],
) -> Result<(), Rejection> {
    let requested = spec.resources.gpus;
    let claimed = claims
        .iter()
        .any(|c| c.entry == crate::dra::devices::EXTENDED_RESOURCES_ENTRY);
    if requested == 0 || claimed {
        return Ok(());
    }
    Err(Rejection {
        reason: "OutOfnvidia.com/gpu".into(),
        message: format!(
            "Node didn't have enough resource: nvidia.com/gpu, requested: {requested}, used: 0, capacity: 0"
        ),
    })
}

/// `nodeSelector` and the required node affinity, as the scheduler matches them.
fn matches_affinity(req: &Requirements, node: &NodeView) -> bool {
    let selector_ok = req
        .node_selector
        .iter()
        .all(|(k, v)| node.labels.get(k) == Some(v));
    selector_ok
        && req.affinity.as_ref().is_none_or(|a| {
            a.node_selector_terms
                .iter()
                .any(|term| matches_term(term, node))
        })
}

/// One term: every expression and field holds; a term with none matches nothing.
pub(super) fn matches_term(term: &NodeSelectorTerm, node: &NodeView) -> bool {
    let expressions = term.match_expressions.as_deref().unwrap_or_default();
    let fields = term.match_fields.as_deref().unwrap_or_default();
    if expressions.is_empty() && fields.is_empty() {
        return false;
    }
    expressions
        .iter()
        .all(|r| matches_requirement(r, node.labels.get(&r.key).map(String::as_str)))
        && fields.iter().all(|r| {
            r.key == "metadata.name"
                && matches!(r.operator.as_str(), "In" | "NotIn")
                && matches_requirement(r, Some(&node.name))
        })
}

fn matches_requirement(r: &NodeSelectorRequirement, value: Option<&str>) -> bool {
    let values = r.values.as_deref().unwrap_or_default();
    let number = |v: &str| v.parse::<i64>().ok();
    match r.operator.as_str() {
        "In" => value.is_some_and(|v| values.iter().any(|w| w == v)),
        "NotIn" => value.is_none_or(|v| !values.iter().any(|w| w == v)),
        "Exists" => value.is_some(),
        "DoesNotExist" => value.is_none(),
        "Gt" | "Lt" => {
            let (Some(have), [want]) = (value.and_then(number), values) else {
                return false;
            };
            let Some(want) = number(want) else {
                return false;
            };
            if r.operator == "Gt" {
                have > want
            } else {
                have < want
            }
        }
        _ => false,
    }
}

/// Whether a toleration tolerates a taint, as the scheduler and the taint
/// manager match them.
pub fn tolerates(tol: &Toleration, taint: &Taint) -> bool {
    let effect_ok = tol
        .effect
        .as_deref()
        .is_none_or(|e| e.is_empty() || e == taint.effect);
    let key_ok =
        tol.key.as_deref().is_none_or(|k| k.is_empty()) || tol.key.as_deref() == Some(&taint.key);
    let value_ok = match tol.operator.as_deref() {
        Some("Exists") => true,
        _ => tol.value.as_deref().unwrap_or("") == taint.value.as_deref().unwrap_or(""),
    };
    let empty_key_needs_exists = tol.key.as_deref().is_none_or(|k| k.is_empty())
        && tol.operator.as_deref() != Some("Exists");
    effect_ok && key_ok && value_ok && !empty_key_needs_exists
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn gpus_without_the_schedulers_claim_are_refused_on_a_dra_node() {
        use crate::dra::devices::{ClaimRef, EXTENDED_RESOURCES_ENTRY};
        let mut pinned = vkd_provider::conformance::sample_spec("vk-1", "u");
        pinned.resources.gpus = 2;
        let got = gpus_behind_claims(&pinned, &[]).unwrap_err();
        assert_eq!(got.reason, "OutOfnvidia.com/gpu");
        assert_eq!(
            got.message,
            "Node didn't have enough resource: nvidia.com/gpu, requested: 2, used: 0, capacity: 0"
        );
        // A claim of the Pod's own does not stand for the extended resource.
        let own = ClaimRef {
            entry: "gpu".into(),
            claim: Some("c".into()),
            generated: false,
        };
        assert!(gpus_behind_claims(&pinned, std::slice::from_ref(&own)).is_err());
        // The scheduler's claim behind `nvidia.com/gpu` carries them.
        let scheduled = ClaimRef {
            entry: EXTENDED_RESOURCES_ENTRY.into(),
            claim: Some("p-extended-resources-x".into()),
            generated: false,
        };
        assert_eq!(gpus_behind_claims(&pinned, &[own, scheduled]), Ok(()));
        pinned.resources.gpus = 0;
        assert_eq!(gpus_behind_claims(&pinned, &[]), Ok(()));
    }

    fn spec(v: serde_json::Value) -> PodSpec {
        serde_json::from_value(v).unwrap()
    }

    fn node() -> NodeView {
        NodeView {
            name: "vk-1".into(),
            labels: [("kubernetes.io/os", "linux"), ("zone", "a"), ("gen", "5")]
                .into_iter()
                .map(|(k, v)| (k.into(), v.into()))
                .collect(),
            no_execute: Vec::new(),
            pods: Some(110),
        }
    }

    fn check(s: &PodSpec, node: &NodeView, in_use: &InUse<'_>) -> Result<(), Rejection> {
        admit(
            &Requirements::of(None, s),
            host_ports(s).as_deref(),
            node,
            in_use,
        )
    }

    fn reason(r: Result<(), Rejection>) -> String {
        r.err().map(|r| r.reason).unwrap_or_default()
    }

    #[test]
    fn a_selector_or_affinity_the_node_lacks_is_node_affinity() {
        let empty = InUse::default();
        let lacking = spec(json!({"containers": [], "nodeSelector": {"zone": "b"}}));
        let got = check(&lacking, &node(), &empty).unwrap_err();
        assert_eq!(got.reason, "NodeAffinity");
        assert_eq!(
            got.message,
            "Predicate NodeAffinity failed: node(s) didn't match Pod's node affinity/selector"
        );
        let ok = spec(json!({"containers": [], "nodeSelector": {"zone": "a"}}));
        assert_eq!(check(&ok, &node(), &empty), Ok(()));
        let affinity = |exprs: serde_json::Value| {
            spec(json!({"containers": [], "affinity": {"nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": exprs}}}}))
        };
        let term = |key: &str, op: &str, values: &[&str]| json!([{"matchExpressions": [{"key": key, "operator": op, "values": values}]}]);
        for (t, fits) in [
            (term("zone", "In", &["a", "b"]), true),
            (term("zone", "NotIn", &["a"]), false),
            (term("missing", "NotIn", &["a"]), true),
            (term("zone", "Exists", &[]), true),
            (term("zone", "DoesNotExist", &[]), false),
            (term("gen", "Gt", &["4"]), true),
            (term("gen", "Lt", &["4"]), false),
            (term("zone", "Gt", &["4"]), false),
            (term("zone", "Sideways", &["a"]), false),
            (json!([{}]), false),
            (
                json!([{"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["vk-1"]}]}]),
                true,
            ),
            // Terms are ORed.
            (
                json!([{"matchExpressions": [{"key": "zone", "operator": "In", "values": ["b"]}]},
                       {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}]),
                true,
            ),
        ] {
            let got = check(&affinity(t.clone()), &node(), &empty);
            assert_eq!(got.is_ok(), fits, "{t}: {got:?}");
        }
    }

    #[test]
    fn a_host_port_in_use_is_node_ports() {
        let web = spec(
            json!({"containers": [{"name": "c", "ports": [{"containerPort": 80, "hostPort": 8080}]}]}),
        );
        let held = host_ports(&web).unwrap();
        let in_use = InUse {
            pods: 1,
            host_ports: held.iter().collect(),
        };
        let got = check(&web, &node(), &in_use).unwrap_err();
        assert_eq!(got.reason, "NodePorts");
        assert_eq!(
            got.message,
            "Predicate NodePorts failed: node(s) didn't have free ports for the requested pod ports"
        );
        let udp = spec(
            json!({"containers": [{"name": "c", "ports": [{"containerPort": 80, "hostPort": 8080, "protocol": "UDP"}]}]}),
        );
        assert_eq!(check(&udp, &node(), &in_use), Ok(()));
        // A specific address conflicts with every address, and not with another one.
        let on = |ip: &str| {
            spec(
                json!({"containers": [{"name": "c", "ports": [{"containerPort": 80, "hostPort": 9090, "hostIP": ip}]}]}),
            )
        };
        let held = host_ports(&on("10.0.0.1")).unwrap();
        let in_use = InUse {
            pods: 1,
            host_ports: held.iter().collect(),
        };
        assert_eq!(reason(check(&on("0.0.0.0"), &node(), &in_use)), "NodePorts");
        assert_eq!(
            reason(check(&on("10.0.0.1"), &node(), &in_use)),
            "NodePorts"
        );
        assert_eq!(check(&on("10.0.0.2"), &node(), &in_use), Ok(()));
        // An init container that ends holds no port; a sidecar does.
        let init = |policy: Option<&str>| {
            spec(json!({"containers": [], "initContainers": [
            {"name": "i", "restartPolicy": policy, "ports": [{"containerPort": 1, "hostPort": 7070}]}]}))
        };
        assert!(host_ports(&init(None)).is_none());
        assert!(host_ports(&init(Some("Always"))).is_some());
    }

    #[test]
    fn the_pods_capacity_and_no_execute_taints_and_os_are_checked() {
        let plain = spec(json!({"containers": []}));
        let mut small = node();
        small.pods = Some(3);
        let got = check(
            &plain,
            &small,
            &InUse {
                pods: 3,
                ..InUse::default()
            },
        )
        .unwrap_err();
        assert_eq!(got.reason, "OutOfpods");
        assert_eq!(
            got.message,
            "Node didn't have enough resource: pods, requested: 1, used: 3, capacity: 3"
        );
        assert_eq!(
            check(
                &plain,
                &small,
                &InUse {
                    pods: 2,
                    ..InUse::default()
                }
            ),
            Ok(())
        );

        let mut tainted = node();
        tainted.no_execute.push(Taint {
            key: "dedicated".into(),
            value: Some("gpu".into()),
            effect: "NoExecute".into(),
            time_added: None,
        });
        assert_eq!(
            reason(check(&plain, &tainted, &InUse::default())),
            "TaintToleration"
        );
        let tolerant = spec(json!({"containers": [], "tolerations": [
            {"key": "dedicated", "operator": "Equal", "value": "gpu", "effect": "NoExecute"}]}));
        assert_eq!(check(&tolerant, &tainted, &InUse::default()), Ok(()));
        let everything = spec(json!({"containers": [], "tolerations": [{"operator": "Exists"}]}));
        assert_eq!(check(&everything, &tainted, &InUse::default()), Ok(()));

        let windows = spec(json!({"containers": [], "os": {"name": "windows"}}));
        assert_eq!(
            reason(check(&windows, &node(), &InUse::default())),
            "PodOSNotSupported"
        );
        let labels: BTreeMap<String, String> = [(OS_LABEL.to_owned(), "windows".to_owned())].into();
        let got = admit(
            &Requirements::of(Some(&labels), &plain),
            None,
            &node(),
            &InUse::default(),
        );
        assert_eq!(reason(got), "PodOSSelectorNodeLabelDoesNotMatch");
    }
}
