//! Why a Pod did or did not move off a node that is not Ready: the node's
//! NoExecute taints against the Pod's tolerations, as the taint manager
//! matches them, and vkd's partition policy meanwhile.

use std::time::SystemTime;

use k8s_openapi::api::core::v1::{Node, Pod, Taint, Toleration};
use serde::Serialize;

use crate::explain::PodAnswer;
use crate::pods::admission::tolerates;

/// A NoExecute taint on the node and what it means for this Pod.
#[derive(Clone, Debug, Serialize)]
pub struct TaintEffect {
    pub taint: String,
    pub added: Option<String>,
    /// The matching toleration's seconds (`None`: forever, or no toleration).
    pub toleration_seconds: Option<i64>,
    pub tolerated: bool,
    pub verdict: String,
}

pub(super) fn ready_condition(node: &Node) -> Option<String> {
    let c = node
        .status
        .as_ref()?
        .conditions
        .as_ref()?
        .iter()
        .find(|c| c.type_ == "Ready")?;
    Some(format!(
        "Ready={} since {}{}",
        c.status,
        c.last_transition_time
            .as_ref()
            .map(|t| t.0.to_string())
            .unwrap_or_default(),
        c.reason
            .as_ref()
            .map(|r| format!(" ({r}: {})", c.message.clone().unwrap_or_default()))
            .unwrap_or_default()
    ))
}

pub(super) fn taint_text(t: &Taint) -> String {
    format!(
        "{}{}:{}{}",
        t.key,
        t.value
            .as_ref()
            .map(|v| format!("={v}"))
            .unwrap_or_default(),
        t.effect,
        t.time_added
            .as_ref()
            .map(|a| format!(" (added {})", a.0))
            .unwrap_or_default()
    )
}

/// Why the Pod did or did not move off its node: the node's Ready condition,
/// each NoExecute taint against the Pod's tolerations (the taint manager's
/// rule: evicted when a taint is not tolerated, or once the shortest
/// `tolerationSeconds` since the taint was added has passed), and vkd's
/// partition policy for the instance meanwhile.
pub fn movement(
    pod: &Pod,
    node: Option<&Node>,
    policy: &str,
    vkd: Option<&PodAnswer>,
    now: SystemTime,
) -> (Option<String>, Vec<TaintEffect>, Vec<String>) {
    let Some(node) = node else {
        return (None, Vec::new(), Vec::new());
    };
    let ready = ready_condition(node);
    let is_ready = ready
        .as_deref()
        .is_some_and(|r| r.starts_with("Ready=True"));
    let tolerations = pod
        .spec
        .as_ref()
        .and_then(|s| s.tolerations.clone())
        .unwrap_or_default();
    let mut effects = Vec::new();
    let mut lines = Vec::new();
    let taints = node
        .spec
        .as_ref()
        .and_then(|s| s.taints.clone())
        .unwrap_or_default();
    let deleting = pod.metadata.deletion_timestamp.is_some();
    for t in taints.iter().filter(|t| t.effect == "NoExecute") {
        let added = t.time_added.as_ref().map(|a| a.0);
        let matching: Vec<&Toleration> =
            tolerations.iter().filter(|tol| tolerates(tol, t)).collect();
        let forever = matching.iter().any(|tol| tol.toleration_seconds.is_none());
        let seconds = matching
            .iter()
            .filter_map(|tol| tol.toleration_seconds)
            .min()
            .filter(|_| !forever);
        let verdict = match (matching.is_empty(), seconds, added) {
            (true, _, _) => "not tolerated: the taint manager evicts the Pod at once".to_owned(),
            (false, None, _) => {
                "tolerated without a time limit: never evicted for this taint".to_owned()
            }
            (false, Some(s), Some(added)) => {
                let due = added
                    .checked_add(jiff::SignedDuration::from_secs(s.max(0)))
                    .unwrap_or(added);
                let left =
                    due.as_second() - jiff::Timestamp::try_from(now).map_or(0, |n| n.as_second());
                let default = if s == 300
                    && (t.key == "node.kubernetes.io/unreachable"
                        || t.key == "node.kubernetes.io/not-ready")
                {
                    " (300 s is what the DefaultTolerationSeconds admission plugin gives a Pod that sets none)"
                } else {
                    ""
                };
                if left > 0 {
                    format!(
                        "tolerated for {s} s{default}: evicted at {due}, in {left} s, unless the node is Ready again"
                    )
                } else {
                    format!(
                        "tolerated for {s} s{default}: eviction was due at {due}, {} s ago",
                        -left
                    )
                }
            }
            (false, Some(s), None) => format!("tolerated for {s} s from when the taint was added"),
        };
        effects.push(TaintEffect {
            taint: taint_text(t),
            added: added.map(|a| a.to_string()),
            toleration_seconds: seconds,
            tolerated: !matching.is_empty(),
            verdict,
        });
    }
    if !is_ready {
        if effects.is_empty() {
            lines.push(
                "the node is not Ready, but has no NoExecute taint yet: the node lifecycle controller adds node.kubernetes.io/unreachable (or not-ready) only after --node-monitor-grace-period without a heartbeat; until then nothing is evicted".to_owned(),
            );
        }
        for e in &effects {
            lines.push(format!("{}: {}", e.taint, e.verdict));
        }
        if deleting {
            lines.push("the Pod is being deleted: vkd finalizes it once its instance is gone; a controller creates the replacement as soon as the deletion begins".to_owned());
        } else if effects.iter().all(|e| e.tolerated) && !effects.is_empty() {
            lines.push("so the Pod stays bound to this node, and its controller makes no replacement until it is evicted".to_owned());
        }
    }
    let partition = vkd.map(|a| &a.partition);
    let policy_line = match (policy, partition) {
        ("fence", Some(p)) => format!(
            "partition policy fence (vkd.io/partition-policy): vkd stops the instance once it has not renewed the node lease for {} s{}{}",
            p.fence_after_seconds,
            p.lease_renewed_seconds_ago
                .map(|s| format!("; last renewed {s:.0} s ago"))
                .unwrap_or_default(),
            if p.fenced { "; it has stopped it" } else { "" }
        ),
        ("fence", None) => "partition policy fence (vkd.io/partition-policy): vkd stops the instance once it cannot renew the node lease for --partition-fence-after (vkd did not answer, so not known how long)".to_owned(),
        (_, Some(p)) => format!(
            "partition policy {policy} (vkd.io/partition-policy; keep is the default): vkd leaves the instance running while it cannot reach the API server{}",
            p.lease_renewed_seconds_ago
                .map(|s| format!("; it last renewed the node lease {s:.0} s ago"))
                .unwrap_or_default()
        ),
        (_, None) => format!(
            "partition policy {policy} (vkd.io/partition-policy; keep is the default): vkd leaves the instance running while it cannot reach the API server"
        ),
    };
    if !is_ready || policy == "fence" {
        lines.push(policy_line);
    }
    (ready, effects, lines)
}

#[cfg(test)]
mod tests {
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;

    use super::*;

    fn node(ready: &str, taints: Vec<Taint>) -> Node {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "vk"},
            "spec": {"taints": taints},
            "status": {"conditions": [{"type": "Ready", "status": ready,
                "lastTransitionTime": "2026-01-01T00:00:00Z", "reason": "NodeStatusUnknown",
                "message": "Kubelet stopped posting node status."}]}
        }))
        .unwrap()
    }

    fn unreachable(added: &str) -> Taint {
        Taint {
            key: "node.kubernetes.io/unreachable".into(),
            effect: "NoExecute".into(),
            time_added: Some(Time(added.parse().unwrap())),
            value: None,
        }
    }

    fn pod(tolerations: serde_json::Value) -> Pod {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p", "namespace": "ns"},
            "spec": {"containers": [], "tolerations": tolerations}
        }))
        .unwrap()
    }

    fn at(s: &str) -> SystemTime {
        SystemTime::from(s.parse::<jiff::Timestamp>().unwrap())
    }

    #[test]
    fn a_tolerated_unreachable_taint_says_when_eviction_is_due() {
        let p = pod(serde_json::json!([
            {"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300}
        ]));
        let n = node("Unknown", vec![unreachable("2026-01-01T00:00:10Z")]);
        let (ready, effects, lines) =
            movement(&p, Some(&n), "keep", None, at("2026-01-01T00:01:10Z"));
        assert!(ready.unwrap().starts_with("Ready=Unknown"));
        assert_eq!(effects[0].toleration_seconds, Some(300));
        assert!(
            effects[0].verdict.contains("in 240 s"),
            "{}",
            effects[0].verdict
        );
        assert!(effects[0].verdict.contains("DefaultTolerationSeconds"));
        let all = lines.join("\n");
        assert!(all.contains("stays bound"), "{all}");
        assert!(all.contains("partition policy keep"), "{all}");
    }

    #[test]
    fn no_toleration_or_an_endless_one_are_told_apart() {
        let n = node("Unknown", vec![unreachable("2026-01-01T00:00:10Z")]);
        let (_, effects, _) = movement(
            &pod(serde_json::json!([])),
            Some(&n),
            "keep",
            None,
            SystemTime::now(),
        );
        assert!(!effects[0].tolerated && effects[0].verdict.contains("at once"));
        let forever = pod(serde_json::json!([{"operator": "Exists"}]));
        let (_, effects, _) = movement(&forever, Some(&n), "keep", None, SystemTime::now());
        assert!(
            effects[0].verdict.contains("without a time limit"),
            "{}",
            effects[0].verdict
        );
        // A key-less toleration with Equal matches nothing.
        let bad = pod(serde_json::json!([{"operator": "Equal", "effect": "NoExecute"}]));
        let (_, effects, _) = movement(&bad, Some(&n), "keep", None, SystemTime::now());
        assert!(!effects[0].tolerated);
    }

    /// By default vkd is asked through the API server's node proxy, and its
    /// refusal reaches the user as a refusal.
    #[test]
    fn a_ready_node_without_taints_says_nothing_about_moving() {
        let n = node("True", Vec::new());
        let (_, effects, lines) = movement(
            &pod(serde_json::json!([])),
            Some(&n),
            "keep",
            None,
            SystemTime::now(),
        );
        assert!(effects.is_empty() && lines.is_empty(), "{lines:?}");
        let (_, _, lines) = movement(
            &pod(serde_json::json!([])),
            Some(&n),
            "fence",
            None,
            SystemTime::now(),
        );
        assert!(lines[0].contains("partition policy fence"), "{lines:?}");
    }
}
