//! What `vkd explain` reads, and from where: the API server with the user's
//! own credentials, and the vkd behind the node (through the node proxy, or
//! directly with `--direct`/`--kubelet`).

use std::time::SystemTime;

use k8s_openapi::api::core::v1::{Event, Node, Pod};
use kube::api::{ListParams, ObjectMeta};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Api, Client};
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::ExplainError;
use super::movement::{TaintEffect, movement, ready_condition, taint_text};
use crate::explain::{InstanceAnswer, NodeAnswer, PodAnswer};

/// One step up a Pod's chain of controllers.
#[derive(Clone, Debug, Serialize)]
pub struct Owner {
    pub kind: String,
    pub name: String,
    pub uid: String,
    /// Why the step above it could not be read, if it could not.
    pub note: Option<String>,
}

/// How the Pod came to this node.
#[derive(Clone, Debug, Serialize)]
pub struct Binding {
    pub node: String,
    /// The PodScheduled condition's time.
    pub at: Option<String>,
    /// Who bound it, from the `Scheduled` Event, or why that is not known.
    pub by: String,
}

#[derive(Clone, Debug, Serialize)]
pub struct ContainerRun {
    pub name: String,
    pub state: String,
    pub restarts: i32,
    /// The previous run's end: exit code and reason.
    pub last_exit: Option<String>,
}

#[derive(Clone, Debug, Serialize)]
pub struct EventLine {
    pub at: String,
    pub kind: String,
    pub reason: String,
    pub from: String,
    pub message: String,
}

/// Everything `vkd explain pod` says.
#[derive(Clone, Debug, Serialize)]
pub struct PodExplanation {
    pub pod: String,
    pub uid: String,
    pub phase: String,
    pub owners: Vec<Owner>,
    pub binding: Option<Binding>,
    /// The node's Ready condition (`status since T: reason`).
    pub node_ready: Option<String>,
    pub taints: Vec<TaintEffect>,
    /// Why the Pod did or did not move off a node that is not Ready.
    pub movement: Vec<String>,
    /// `vkd.io/partition-policy` as set on the Pod (`keep` when unset).
    pub partition_policy: String,
    pub containers: Vec<ContainerRun>,
    pub events: Vec<EventLine>,
    /// Its DRA claims, their devices and binding conditions.
    pub claims: Vec<super::dra::ClaimView>,
    pub vkd: Option<PodAnswer>,
    /// Why vkd's side is missing.
    pub vkd_error: Option<String>,
    pub sources: Vec<String>,
}

#[derive(Clone, Debug, Serialize)]
pub struct NodeExplanation {
    pub node: String,
    pub ready: Option<String>,
    /// `resource: capacity / allocatable`, as the Node advertises.
    pub advertised: Vec<(String, String)>,
    /// The Node's `vkd.io/*` labels and annotations (capacity semantics).
    pub published: Vec<(String, String)>,
    pub taints: Vec<String>,
    /// Its DRA pools and what is allocated of them.
    pub pools: Vec<super::dra::PoolView>,
    /// What of the pools could not be read.
    pub pools_error: Option<String>,
    pub vkd: Option<NodeAnswer>,
    pub vkd_error: Option<String>,
    pub sources: Vec<String>,
}

#[derive(Clone, Debug, Serialize)]
pub struct InstanceExplanation {
    pub vkd: InstanceAnswer,
    pub sources: Vec<String>,
}

/// Where `vkd explain` reads from: the user's kubeconfig, and how vkd's
/// kubelet API is reached.
#[derive(Debug, Default)]
pub struct Source {
    /// Default: $KUBECONFIG, then ~/.kube/config.
    pub kubeconfig: Option<std::path::PathBuf>,
    pub context: Option<String>,
    /// Ask vkd at the Node's address instead of through the node proxy.
    pub direct: bool,
    /// Ask vkd at this URL (implies direct).
    pub kubelet: Option<String>,
    /// The CA vkd's serving certificate chains to, when asked directly.
    pub kubelet_ca: Option<std::path::PathBuf>,
    pub insecure_skip_tls_verify_kubelet: bool,
}

/// `path` of Node `node` on vkd's kubelet API, whichever Nodes its port serves.
fn node_path(node: &str, path: &str) -> String {
    format!("{}{node}{path}", crate::kubelet_api::nodes::PREFIX)
}

pub(crate) struct Explainer {
    client: Client,
    /// How vkd's kubelet API is asked directly (`--direct`, `--kubelet`),
    /// with the user's credentials; `None`: through the node proxy.
    direct: Option<Direct>,
}

struct Direct {
    /// The user's kubeconfig, with vkd's TLS trust.
    config: kube::Config,
    /// `--kubelet`; else the Node's own address.
    url: Option<String>,
}

impl Explainer {
    pub(crate) async fn new(args: &Source) -> Result<Self, ExplainError> {
        let options = KubeConfigOptions {
            context: args.context.clone(),
            ..KubeConfigOptions::default()
        };
        let bad = |e: &dyn std::fmt::Display| ExplainError::Kubeconfig(e.to_string());
        let config = match &args.kubeconfig {
            Some(path) => {
                let kc = Kubeconfig::read_from(path)
                    .map_err(|e| ExplainError::Kubeconfig(format!("{}: {e}", path.display())))?;
                kube::Config::from_custom_kubeconfig(kc, &options)
                    .await
                    .map_err(|e| bad(&e))?
            }
            None if args.context.is_some() => kube::Config::from_kubeconfig(&options)
                .await
                .map_err(|e| bad(&e))?,
            None => kube::Config::infer().await.map_err(|e| bad(&e))?,
        };
        let direct = if args.direct || args.kubelet.is_some() {
            let mut c = config.clone();
            c.accept_invalid_certs = args.insecure_skip_tls_verify_kubelet;
            c.root_cert = match &args.kubelet_ca {
                Some(ca) => Some(read_pem_certs(ca)?),
                // vkd's certificate is not the API server's: without a CA
                // for it, the system's roots decide.
                None => None,
            };
            // The kubeconfig's server name is the API server's, not vkd's.
            c.tls_server_name = None;
            if let Some(url) = &args.kubelet {
                url.parse::<hyper::Uri>()
                    .map_err(|e| ExplainError::Usage(format!("--kubelet {url:?}: {e}")))?;
            }
            Some(Direct {
                config: c,
                url: args.kubelet.clone(),
            })
        } else {
            None
        };
        let client =
            Client::try_from(config).map_err(|e| ExplainError::Kubeconfig(e.to_string()))?;
        Ok(Self { client, direct })
    }

    /// The kubelet API's URL the Node publishes: its InternalIP and port.
    /// `known` is the Node when it was read already.
    async fn kubelet_url(&self, node: &str, known: Option<&Node>) -> Result<String, ExplainError> {
        let n = match known {
            Some(n) => n.clone(),
            None => Api::<Node>::all(self.client.clone())
                .get(node)
                .await
                .map_err(|e| {
                    ExplainError::of(
                        e,
                        &format!("reading node {node} for its address (or give --kubelet)"),
                    )
                })?,
        };
        let status = n.status.unwrap_or_default();
        let port = status
            .daemon_endpoints
            .and_then(|d| d.kubelet_endpoint)
            .map_or(10250, |e| e.port);
        let address = status
            .addresses
            .unwrap_or_default()
            .into_iter()
            .find(|a| a.type_ == "InternalIP")
            .map(|a| a.address)
            .ok_or_else(|| {
                ExplainError::NotFound(format!("node {node} publishes no InternalIP"))
            })?;
        let host = if address.contains(':') {
            format!("[{address}]")
        } else {
            address
        };
        Ok(format!("https://{host}:{port}"))
    }

    /// `GET path` on the vkd behind `node` (`known`: the Node, if read already).
    async fn ask<T: DeserializeOwned>(
        &self,
        node: &str,
        known: Option<&Node>,
        path: &str,
    ) -> Result<T, ExplainError> {
        // Named, as on a port that serves several Nodes (`--shared-kubelet-port`).
        let path = &node_path(node, path);
        let direct_client;
        let (client, url) = match &self.direct {
            Some(d) => {
                let base = match &d.url {
                    Some(u) => u.clone(),
                    None => self.kubelet_url(node, known).await?,
                };
                let mut c = d.config.clone();
                c.cluster_url = base
                    .parse()
                    .map_err(|e| ExplainError::Usage(format!("vkd's URL {base:?}: {e}")))?;
                direct_client = Client::try_from(c)
                    .map_err(|e| ExplainError::Kubeconfig(format!("asking vkd directly: {e}")))?;
                (&direct_client, path.to_owned())
            }
            None => (&self.client, format!("/api/v1/nodes/{node}/proxy{path}")),
        };
        let req = hyper::http::Request::get(url)
            .body(Vec::new())
            .map_err(|e| ExplainError::Usage(e.to_string()))?;
        let text = client
            .request_text(req)
            .await
            .map_err(|e| ExplainError::of(e, &format!("vkd on node {node}")))?;
        serde_json::from_str(&text).map_err(|e| {
            ExplainError::Api(format!(
                "vkd on node {node} answered what is not an explanation ({e}): {}",
                text.chars().take(200).collect::<String>()
            ))
        })
    }

    fn via(&self, node: &str, path: &str) -> String {
        let path = node_path(node, path);
        match &self.direct {
            Some(_) => format!("vkd's kubelet API, GET {path}"),
            None => format!("kubectl get --raw /api/v1/nodes/{node}/proxy{path}"),
        }
    }

    pub(crate) async fn pod(&self, ns: &str, name: &str) -> Result<PodExplanation, ExplainError> {
        let pods: Api<Pod> = Api::namespaced(self.client.clone(), ns);
        let pod = pods
            .get(name)
            .await
            .map_err(|e| ExplainError::of(e, &format!("pod {ns}/{name}")))?;
        let uid = pod.metadata.uid.clone().unwrap_or_default();
        let spec = pod.spec.clone().unwrap_or_default();
        let status = pod.status.clone().unwrap_or_default();
        let node_name = spec.node_name.clone().unwrap_or_default();
        let mut sources = vec![format!(
            "kubectl get pod -n {ns} {name} -o yaml (uid {uid})"
        )];
        let owners = self.owners(ns, &pod.metadata).await;
        let events = self.events(ns, &uid).await;
        match &events {
            Ok(_) => sources.push(format!(
                "kubectl get events -n {ns} --field-selector involvedObject.uid={uid}"
            )),
            Err(e) => sources.push(format!("the Pod's Events: {e}")),
        }
        let events_readable = events.is_ok();
        let events = events.unwrap_or_default();
        let binding = (!node_name.is_empty()).then(|| {
            let at = status
                .conditions
                .iter()
                .flatten()
                .find(|c| c.type_ == "PodScheduled" && c.status == "True")
                .and_then(|c| c.last_transition_time.as_ref())
                .map(|t| t.0.to_string());
            let by = events
                .iter()
                .find(|e| e.reason == "Scheduled")
                .map(|e| format!("{} ({})", e.from, e.message))
                .unwrap_or_else(|| {
                    if events_readable {
                        "no Scheduled Event: spec.nodeName was set by whoever created the Pod, or the Event has expired".into()
                    } else {
                        "not known: the Pod's Events could not be read".into()
                    }
                });
            Binding {
                node: node_name.clone(),
                at,
                by,
            }
        });
        let node = if node_name.is_empty() {
            None
        } else {
            let nodes: Api<Node> = Api::all(self.client.clone());
            match nodes.get(&node_name).await {
                Ok(n) => {
                    sources.push(format!("kubectl get node {node_name} -o yaml"));
                    Some(n)
                }
                Err(e) => {
                    sources.push(ExplainError::of(e, &format!("node {node_name}")).to_string());
                    None
                }
            }
        };
        let partition_policy = pod
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(crate::fencing::PARTITION_POLICY_ANNOTATION))
            .cloned()
            .unwrap_or_else(|| "keep".into());
        let (vkd, vkd_error) = if node_name.is_empty() {
            (None, Some("the Pod is not bound to a node yet".to_owned()))
        } else {
            let path = format!("/explain/pod/{ns}/{name}");
            match self
                .ask::<PodAnswer>(&node_name, node.as_ref(), &path)
                .await
            {
                Ok(a) => {
                    sources.push(format!(
                        "{} (replica {}, epoch {})",
                        self.via(&node_name, &path),
                        a.leadership.replica,
                        a.leadership.epoch
                    ));
                    if !a.decisions.is_empty() {
                        sources.push(format!(
                            "vkd's log: target vkd::audit and \"instance created\" lines with pod_uid={uid}"
                        ));
                    }
                    if let Some(i) = &a.instance {
                        sources.push(format!("backend {}: instance {}", a.backend, i.id));
                    }
                    (Some(a), None)
                }
                Err(e) => (None, Some(e.to_string())),
            }
        };
        let (node_ready, taints, movement) = movement(
            &pod,
            node.as_ref(),
            &partition_policy,
            vkd.as_ref(),
            SystemTime::now(),
        );
        let containers = status
            .init_container_statuses
            .iter()
            .flatten()
            .chain(status.container_statuses.iter().flatten())
            .map(|c| ContainerRun {
                name: c.name.clone(),
                state: container_state(c.state.as_ref()),
                restarts: c.restart_count,
                last_exit: c
                    .last_state
                    .as_ref()
                    .and_then(|s| s.terminated.as_ref())
                    .map(|t| {
                        format!(
                            "exit code {} ({})",
                            t.exit_code,
                            t.reason.clone().unwrap_or_default()
                        )
                    }),
            })
            .collect();
        let claims = super::dra::pod_claims(&self.client, &pod).await;
        if !claims.is_empty() {
            sources.push(format!("kubectl get resourceclaims -n {ns} -o yaml"));
        }
        Ok(PodExplanation {
            pod: format!("{ns}/{name}"),
            uid,
            phase: status.phase.clone().unwrap_or_default(),
            owners,
            binding,
            node_ready,
            taints,
            movement,
            partition_policy,
            containers,
            events,
            claims,
            vkd,
            vkd_error,
            sources,
        })
    }

    /// The chain of controllers above an object, nearest first.
    async fn owners(&self, ns: &str, meta: &ObjectMeta) -> Vec<Owner> {
        let mut out = Vec::new();
        let mut next = controller_of(meta);
        // A chain longer than this is a loop or not worth printing.
        for _ in 0..6 {
            let Some(r) = next.take() else { break };
            let mut owner = Owner {
                kind: r.kind.clone(),
                name: r.name.clone(),
                uid: r.uid.clone(),
                note: None,
            };
            let gvk = kube::api::GroupVersionKind::from(r.clone());
            match kube::discovery::pinned_kind(&self.client, &gvk).await {
                Ok((resource, caps)) => {
                    let api: Api<kube::api::DynamicObject> =
                        if caps.scope == kube::discovery::Scope::Namespaced {
                            Api::namespaced_with(self.client.clone(), ns, &resource)
                        } else {
                            Api::all_with(self.client.clone(), &resource)
                        };
                    match api.get(&r.name).await {
                        Ok(obj) => next = controller_of(&obj.metadata),
                        Err(e) => owner.note = Some(ExplainError::of(e, "reading it").to_string()),
                    }
                }
                Err(e) => owner.note = Some(format!("its kind is not served: {e}")),
            }
            out.push(owner);
        }
        out
    }

    async fn events(&self, ns: &str, uid: &str) -> Result<Vec<EventLine>, ExplainError> {
        let api: Api<Event> = Api::namespaced(self.client.clone(), ns);
        let list = api
            .list(&ListParams::default().fields(&format!("involvedObject.uid={uid}")))
            .await
            .map_err(|e| ExplainError::of(e, "events"))?;
        let mut out: Vec<(String, EventLine)> = list
            .items
            .into_iter()
            .map(|e| {
                let at = e
                    .last_timestamp
                    .map(|t| t.0.to_string())
                    .or_else(|| e.event_time.map(|t| t.0.to_string()))
                    .or_else(|| e.metadata.creation_timestamp.map(|t| t.0.to_string()))
                    .unwrap_or_default();
                let from = e
                    .reporting_component
                    .filter(|c| !c.is_empty())
                    .or_else(|| e.source.and_then(|s| s.component))
                    .unwrap_or_default();
                let line = EventLine {
                    at: at.clone(),
                    kind: e.type_.unwrap_or_default(),
                    reason: e.reason.unwrap_or_default(),
                    from,
                    message: e.message.unwrap_or_default(),
                };
                (at, line)
            })
            .collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(out.into_iter().map(|(_, l)| l).collect())
    }

    pub(crate) async fn node(&self, name: &str) -> Result<NodeExplanation, ExplainError> {
        let nodes: Api<Node> = Api::all(self.client.clone());
        let node = nodes
            .get(name)
            .await
            .map_err(|e| ExplainError::of(e, &format!("node {name}")))?;
        let mut sources = vec![format!("kubectl get node {name} -o yaml")];
        let status = node.status.clone().unwrap_or_default();
        let ready = ready_condition(&node);
        let mut advertised = Vec::new();
        let (cap, alloc) = (
            status.capacity.unwrap_or_default(),
            status.allocatable.unwrap_or_default(),
        );
        for (k, v) in &cap {
            let a = alloc.get(k).map_or("-", |q| q.0.as_str());
            advertised.push((k.clone(), format!("{} / {a}", v.0)));
        }
        let mut published: Vec<(String, String)> = node
            .metadata
            .labels
            .iter()
            .flatten()
            .chain(node.metadata.annotations.iter().flatten())
            .filter(|(k, _)| k.starts_with("vkd.io/"))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        published.sort();
        let taints = node
            .spec
            .as_ref()
            .and_then(|s| s.taints.clone())
            .unwrap_or_default()
            .iter()
            .map(taint_text)
            .collect();
        let (vkd, vkd_error) = match self
            .ask::<NodeAnswer>(name, Some(&node), "/explain/node")
            .await
        {
            Ok(a) => {
                sources.push(format!(
                    "{} (replica {}, epoch {})",
                    self.via(name, "/explain/node"),
                    a.leadership.replica,
                    a.leadership.epoch
                ));
                if a.leadership.elected {
                    sources.push(format!(
                        "the leader lease: kubectl get lease -A --field-selector metadata.name=vkd-{name}"
                    ));
                }
                sources.push(format!(
                    "the slices: vkd's admin port, GET /slices; the backend {}'s own list",
                    a.backend
                ));
                (Some(a), None)
            }
            Err(e) => (None, Some(e.to_string())),
        };
        let (pools, pools_error, pool_sources) = super::dra::node_pools(&self.client, name).await;
        sources.extend(pool_sources);
        Ok(NodeExplanation {
            node: name.to_owned(),
            ready,
            advertised,
            published,
            taints,
            pools,
            pools_error,
            vkd,
            vkd_error,
            sources,
        })
    }

    pub(crate) async fn instance(
        &self,
        id: &str,
        node: Option<&str>,
    ) -> Result<InstanceExplanation, ExplainError> {
        let path = format!("/explain/instance/{id}");
        let nodes: Vec<String> = match node {
            Some(n) => vec![n.to_owned()],
            None => {
                let api: Api<Node> = Api::all(self.client.clone());
                api.list(&ListParams::default().labels("type=virtual-kubelet"))
                    .await
                    .map_err(|e| ExplainError::of(e, "listing the virtual nodes (or give --node)"))?
                    .items
                    .into_iter()
                    .filter_map(|n| n.metadata.name)
                    .collect()
            }
        };
        let mut gone = None;
        let mut errors = Vec::new();
        for n in &nodes {
            match self.ask::<InstanceAnswer>(n, None, &path).await {
                Ok(a) if a.verdict != "gone" || a.decisions.iter().any(|d| d.instance == id) => {
                    return Ok(self.instance_sources(a, n, &path));
                }
                Ok(a) => gone = gone.or(Some((a, n.clone()))),
                Err(e) => errors.push(format!("{n}: {e}")),
            }
        }
        match gone {
            Some((a, n)) => Ok(self.instance_sources(a, &n, &path)),
            None if errors.is_empty() => Err(ExplainError::NotFound(format!(
                "no virtual node to ask about instance {id}"
            ))),
            None => Err(ExplainError::Api(errors.join("; "))),
        }
    }

    fn instance_sources(&self, a: InstanceAnswer, node: &str, path: &str) -> InstanceExplanation {
        let mut sources = vec![format!(
            "{} (replica {}, epoch {})",
            self.via(node, path),
            a.leadership.replica,
            a.leadership.epoch
        )];
        sources.push(format!(
            "backend {}: its own list of node {node}'s instances (instance {})",
            a.backend, a.id
        ));
        if let Some(i) = &a.instance {
            sources.push(format!(
                "kubectl get pods -A --field-selector metadata.uid={} (none: the Pod is gone)",
                i.owner.uid
            ));
        }
        if !a.decisions.is_empty() {
            sources.push(format!("vkd's log: target vkd::audit, instance={}", a.id));
        }
        InstanceExplanation { vkd: a, sources }
    }
}

fn read_pem_certs(path: &std::path::Path) -> Result<Vec<Vec<u8>>, ExplainError> {
    use rustls_pki_types::pem::PemObject;
    let bad = |e: String| ExplainError::Usage(format!("--kubelet-ca {}: {e}", path.display()));
    let certs: Vec<Vec<u8>> = rustls_pki_types::CertificateDer::pem_file_iter(path)
        .map_err(|e| bad(e.to_string()))?
        .map(|c| c.map(|c| c.to_vec()).map_err(|e| bad(e.to_string())))
        .collect::<Result<_, _>>()?;
    if certs.is_empty() {
        return Err(bad("no certificate in it".into()));
    }
    Ok(certs)
}

fn controller_of(
    meta: &ObjectMeta,
) -> Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference> {
    meta.owner_references
        .iter()
        .flatten()
        .find(|r| r.controller == Some(true))
        .cloned()
}

fn container_state(s: Option<&k8s_openapi::api::core::v1::ContainerState>) -> String {
    let Some(s) = s else {
        return "unknown".into();
    };
    if let Some(w) = &s.waiting {
        return format!(
            "waiting ({}){}",
            w.reason.clone().unwrap_or_default(),
            w.message
                .as_ref()
                .map(|m| format!(": {m}"))
                .unwrap_or_default()
        );
    }
    if let Some(r) = &s.running {
        return format!(
            "running since {}",
            r.started_at
                .as_ref()
                .map(|t| t.0.to_string())
                .unwrap_or_default()
        );
    }
    if let Some(t) = &s.terminated {
        return format!(
            "terminated: exit code {} ({})",
            t.exit_code,
            t.reason.clone().unwrap_or_default()
        );
    }
    "unknown".into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn vkd_is_asked_through_the_node_proxy() {
        let (client, log) = crate::testing::fake_api(|req| {
            if req.path.contains("/explain/pod/ns/secret") {
                return crate::testing::status(403, "Forbidden");
            }
            (
                200,
                serde_json::json!({"node": "vk", "backend": "sim", "host": null,
                    "leadership": {"replica": "r", "epoch": 3, "since": "2026-01-01T00:00:00.000Z", "elected": true},
                    "capacity": null, "capacity_error": "down", "reservations": [], "waiting": [],
                    "pods": 0, "instances": 0, "unowned": [], "list_error": null,
                    "collection": {"interval_seconds": 60, "last_pass": null, "braked": null,
                        "brake_max_fraction": 0.5, "brake_min_count": 10, "allow_mass_delete": false},
                    "recent": [], "partition_fence_after_seconds": 30, "lease_renewed_seconds_ago": null}),
            )
        });
        let e = Explainer {
            client,
            direct: None,
        };
        let answer: NodeAnswer = e.ask("vk", None, "/explain/node").await.unwrap();
        assert_eq!(answer.leadership.epoch, 3);
        assert_eq!(
            log.lock().unwrap()[0].path,
            "/api/v1/nodes/vk/proxy/nodes/vk/explain/node"
        );
        let refused = e
            .ask::<PodAnswer>("vk", None, "/explain/pod/ns/secret")
            .await;
        assert!(
            matches!(refused, Err(ExplainError::Refused(_))),
            "{refused:?}"
        );
        assert_eq!(
            e.via("vk", "/explain/node"),
            "kubectl get --raw /api/v1/nodes/vk/proxy/nodes/vk/explain/node"
        );
    }
}
