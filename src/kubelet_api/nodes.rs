//! Which Node a kubelet API request is for. A listener serves one Node, or, in
//! per-host mode with `--shared-kubelet-port`, every Node of the daemon. A
//! `/nodes/<node>/` prefix names the Node (each Node's
//! `metrics.k8s.io/resource-metrics-path` annotation points metrics-server ≥0.7
//! there); a Pod's path is its Pod's Node's; a node-wide path without the prefix
//! on a shared port is no one Node's and is answered with where to ask: giving it
//! every Node's figures at once is how a virtual node comes to report the whole
//! backend as its own (Liqo #3209).

/// Where a Node's kubelet paths are on a shared port: `/nodes/<node>/...`.
pub const PREFIX: &str = "/nodes/";

/// The annotation metrics-server ≥0.7 reads a Node's resource-metrics path from.
pub const RESOURCE_METRICS_PATH_ANNOTATION: &str = "metrics.k8s.io/resource-metrics-path";

/// The path of Node `node`'s resource metrics on a shared port.
pub fn resource_metrics_path(node: &str) -> String {
    format!("{PREFIX}{node}/metrics/resource")
}

#[derive(Debug, PartialEq, Eq)]
pub(super) enum Target {
    /// Node `node`, at `path` (the prefix taken off).
    Node { node: String, path: String },
    /// The prefix names a Node this listener does not serve.
    Unserved { node: String, path: String },
    /// A Pod's path, and no Node this listener serves holds the Pod.
    NoPod {
        namespace: String,
        pod: String,
        path: String,
    },
    /// A node-wide path without the prefix, on a port that serves several Nodes.
    Unnamed { path: String },
}

/// The Pod (namespace, name) a kubelet path is about, if it is about one.
pub(super) fn pod_of(path: &str) -> Option<(&str, &str)> {
    let parts: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    match parts.as_slice() {
        [
            "containerLogs" | "exec" | "attach" | "portForward",
            ns,
            pod,
            ..,
        ]
        | ["explain", "pod", ns, pod] => Some((ns, pod)),
        _ => None,
    }
}

/// Whose `path` is: `served` are the Nodes this listener answers for (at least
/// one); `holder` says which of them holds a Pod.
pub(super) fn resolve<'a>(
    path: &str,
    served: &[&'a str],
    holder: impl Fn(&str, &str) -> Option<&'a str>,
) -> Target {
    if let Some(rest) = path.strip_prefix(PREFIX) {
        let (node, rest) = rest.split_once('/').unwrap_or((rest, ""));
        let path = format!("/{rest}");
        return if served.contains(&node) {
            Target::Node {
                node: node.to_owned(),
                path,
            }
        } else {
            Target::Unserved {
                node: node.to_owned(),
                path,
            }
        };
    }
    if let [only] = served {
        return Target::Node {
            node: (*only).to_owned(),
            path: path.to_owned(),
        };
    }
    match pod_of(path) {
        Some((ns, pod)) => match holder(ns, pod) {
            Some(node) => Target::Node {
                node: node.to_owned(),
                path: path.to_owned(),
            },
            None => Target::NoPod {
                namespace: ns.to_owned(),
                pod: pod.to_owned(),
                path: path.to_owned(),
            },
        },
        None => Target::Unnamed {
            path: path.to_owned(),
        },
    }
}

/// What a node-wide path without the prefix gets on a shared port.
pub(super) fn unnamed_message(path: &str, served: &[&str]) -> String {
    format!(
        "this port serves the kubelet API of {} Nodes ({}): one Node's {path} is at {PREFIX}<node>{path}",
        served.len(),
        served.join(", ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn on(path: &str) -> Target {
        let served = ["vk-a", "vk-b"];
        resolve(path, &served, |ns, pod| match (ns, pod) {
            ("team", "on-b") => Some("vk-b"),
            _ => None,
        })
    }

    fn node(node: &str, path: &str) -> Target {
        Target::Node {
            node: node.into(),
            path: path.into(),
        }
    }

    #[test]
    fn the_prefix_names_the_node_and_a_pods_path_finds_its_node() {
        assert_eq!(
            on("/nodes/vk-a/metrics/resource"),
            node("vk-a", "/metrics/resource")
        );
        assert_eq!(
            on("/nodes/vk-b/containerLogs/team/on-b/c"),
            node("vk-b", "/containerLogs/team/on-b/c")
        );
        assert_eq!(on("/nodes/vk-b"), node("vk-b", "/"));
        assert_eq!(
            on("/nodes/vk-c/stats/summary"),
            Target::Unserved {
                node: "vk-c".into(),
                path: "/stats/summary".into()
            }
        );
        for path in [
            "/containerLogs/team/on-b/c",
            "/exec/team/on-b/c",
            "/attach/team/on-b/uid/c",
            "/portForward/team/on-b",
            "/explain/pod/team/on-b",
        ] {
            assert_eq!(on(path), node("vk-b", path), "{path}");
        }
        assert_eq!(
            on("/exec/team/elsewhere/c"),
            Target::NoPod {
                namespace: "team".into(),
                pod: "elsewhere".into(),
                path: "/exec/team/elsewhere/c".into()
            }
        );
    }

    #[test]
    fn a_node_wide_path_without_the_prefix_is_no_one_nodes_on_a_shared_port() {
        for path in ["/metrics/resource", "/stats/summary", "/pods", "/healthz"] {
            assert_eq!(on(path), Target::Unnamed { path: path.into() });
        }
        assert!(
            unnamed_message("/stats/summary", &["vk-a", "vk-b"]).ends_with(
                "(vk-a, vk-b): one Node's /stats/summary is at /nodes/<node>/stats/summary"
            )
        );
        // One Node on the port: every path is that Node's, as on a kubelet.
        let one = resolve("/metrics/resource", &["vk"], |_, _| None);
        assert_eq!(one, node("vk", "/metrics/resource"));
        assert_eq!(
            resource_metrics_path("vk-a"),
            "/nodes/vk-a/metrics/resource"
        );
    }
}
