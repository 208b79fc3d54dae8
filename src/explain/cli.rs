//! The `vkd explain` command, also run as `kubectl vkd explain` (a copy or a
//! link of the binary named `kubectl-vkd` on the PATH).
//!
//! It reads what the user may read from the API server (the Pod, its owners,
//! its Events, the Node) with the user's own kubeconfig, and asks the vkd
//! behind the node for its side through the API server's node proxy (or, with
//! `--kubelet`, directly, where vkd checks the user's own token). Nothing is
//! read with more privilege than the user has.

use std::path::PathBuf;
use std::time::SystemTime;

use clap::{Args, Subcommand, ValueEnum};
use k8s_openapi::api::core::v1::{Event, Node, Pod, Taint, Toleration};
use kube::api::{ListParams, ObjectMeta};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Api, Client};
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::{InstanceAnswer, NodeAnswer, PodAnswer};

/// `vkd explain`: why a Pod waits, why an instance exists, why nothing moved.
#[derive(Debug, Args)]
pub struct ExplainArgs {
    #[command(subcommand)]
    pub what: Target,
    /// `text` for people, `json` for tools.
    #[arg(short = 'o', long, value_enum, default_value_t = Output::Text, global = true)]
    pub output: Output,
    /// The kubeconfig to use (default: $KUBECONFIG, then ~/.kube/config).
    #[arg(long, global = true)]
    pub kubeconfig: Option<PathBuf>,
    /// The kubeconfig context to use.
    #[arg(long, global = true)]
    pub context: Option<String>,
    /// Ask vkd's kubelet API directly, at the Node's InternalIP and kubelet
    /// port, with your own credentials, instead of through the API server's
    /// node proxy (which needs `nodes/proxy`, and which refuses loopback and
    /// link-local node addresses). vkd then authorizes you itself: `get` on
    /// the Pod for a Pod, `nodes/proxy` for a node or an instance.
    #[arg(long, global = true)]
    pub direct: bool,
    /// Like `--direct`, at this URL (`https://HOST:10250`): for a user who may
    /// not read the Node, or a vkd reached some other way.
    #[arg(long, global = true)]
    pub kubelet: Option<String>,
    /// CA bundle (PEM) that vkd's serving certificate chains to, when asked directly.
    #[arg(long, global = true)]
    pub kubelet_ca: Option<PathBuf>,
    /// When asked directly: do not check vkd's serving certificate (your
    /// credentials go to whoever answers).
    #[arg(long, global = true)]
    pub insecure_skip_tls_verify_kubelet: bool,
}

#[derive(Debug, Subcommand)]
pub enum Target {
    /// A Pod: its owners, binding, admission, instance, timeline, restarts,
    /// the decisions that name it, and why it did (not) move.
    Pod {
        /// `NAMESPACE/NAME`, or `NAME` with `--namespace`.
        pod: String,
        #[arg(short = 'n', long)]
        namespace: Option<String>,
    },
    /// A virtual node: what it advertises and why, reservations, waiting
    /// Pods, instances no Pod owns and what collection will do, the leader.
    Node { name: String },
    /// A backend instance: whose it is, or why it is an orphan or a
    /// duplicate, and what will happen to it.
    Instance {
        id: String,
        /// The virtual node whose backend holds it (default: ask every vkd node).
        #[arg(long)]
        node: Option<String>,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Output {
    Text,
    Json,
}

#[derive(Debug, thiserror::Error)]
pub enum ExplainError {
    #[error("kubeconfig: {0}")]
    Kubeconfig(String),
    /// The API server or vkd refused the user.
    #[error("refused: {0}")]
    Refused(String),
    #[error("not found: {0}")]
    NotFound(String),
    #[error("kubernetes API: {0}")]
    Api(String),
    #[error("{0}")]
    Usage(String),
}

impl ExplainError {
    fn of(e: kube::Error, what: &str) -> Self {
        match e {
            kube::Error::Api(s) if s.code == 403 => Self::Refused(format!("{what}: {}", s.message)),
            kube::Error::Api(s) if s.code == 404 => {
                Self::NotFound(format!("{what}: {}", s.message))
            }
            other => Self::Api(format!("{what}: {other}")),
        }
    }
}

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
    pub vkd: Option<NodeAnswer>,
    pub vkd_error: Option<String>,
    pub sources: Vec<String>,
}

#[derive(Clone, Debug, Serialize)]
pub struct InstanceExplanation {
    pub vkd: InstanceAnswer,
    pub sources: Vec<String>,
}

/// Runs `vkd explain` and prints the answer.
pub async fn run(args: ExplainArgs) -> Result<(), ExplainError> {
    let pod = match &args.what {
        Target::Pod { pod, namespace } => Some(pod_name(pod, namespace.as_deref())?),
        Target::Node { name } => {
            checked("node", name, |b| {
                b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.'
            })?;
            None
        }
        Target::Instance { id, node } => {
            // Backend ids go into the request's path: no query, fragment or escapes.
            checked("instance id", id, |b| {
                b.is_ascii_alphanumeric() || b"-._:/".contains(&b)
            })?;
            if id
                .split('/')
                .any(|part| part.is_empty() || part == "." || part == "..")
            {
                return Err(ExplainError::Usage(format!("{id:?} is not an instance id")));
            }
            if let Some(n) = node {
                checked("node", n, |b| {
                    b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.'
                })?;
            }
            None
        }
    };
    let out = Explainer::new(&args).await?;
    let text = match &args.what {
        Target::Pod { .. } => {
            let (ns, name) = pod.unwrap_or_default();
            let e = out.pod(&ns, &name).await?;
            emit(args.output, &e, super::render::pod)
        }
        Target::Node { name } => {
            let e = out.node(name).await?;
            emit(args.output, &e, super::render::node)
        }
        Target::Instance { id, node } => {
            let e = out.instance(id, node.as_deref()).await?;
            emit(args.output, &e, super::render::instance)
        }
    };
    print!("{text}");
    Ok(())
}

/// `what` is 1 to 253 bytes, each one `allowed`.
fn checked(what: &str, value: &str, allowed: impl Fn(u8) -> bool) -> Result<(), ExplainError> {
    if value.is_empty() || value.len() > 253 || !value.bytes().all(allowed) {
        return Err(ExplainError::Usage(format!(
            "{value:?} is not a valid {what}"
        )));
    }
    Ok(())
}

/// `NAMESPACE/NAME`, or `NAME` with `--namespace` (default `default`).
fn pod_name(pod: &str, namespace: Option<&str>) -> Result<(String, String), ExplainError> {
    let (ns, name) = match (pod.split_once('/'), namespace) {
        (Some(_), Some(_)) => {
            return Err(ExplainError::Usage(
                "give the Pod as NAMESPACE/NAME or as NAME with --namespace, not both".into(),
            ));
        }
        (Some((ns, name)), None) => (ns, name),
        (None, ns) => (ns.unwrap_or("default"), pod),
    };
    let valid = |s: &str| {
        !s.is_empty()
            && s.len() <= 253
            && s.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
    };
    if !valid(ns) || !valid(name) {
        return Err(ExplainError::Usage(format!(
            "{pod:?} is not a Pod name: NAMESPACE/NAME, lowercase letters, digits, '-' and '.'"
        )));
    }
    Ok((ns.to_owned(), name.to_owned()))
}

fn emit<T: Serialize>(output: Output, value: &T, text: fn(&T) -> String) -> String {
    match output {
        Output::Json => serde_json::to_string_pretty(value)
            .map(|s| s + "\n")
            .unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}\n")),
        Output::Text => text(value),
    }
}

struct Explainer {
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
    async fn new(args: &ExplainArgs) -> Result<Self, ExplainError> {
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
    async fn kubelet_url(&self, node: &str) -> Result<String, ExplainError> {
        let nodes: Api<Node> = Api::all(self.client.clone());
        let n = nodes.get(node).await.map_err(|e| {
            ExplainError::of(
                e,
                &format!("reading node {node} for its address (or give --kubelet)"),
            )
        })?;
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

    /// `GET path` on the vkd behind `node`.
    async fn ask<T: DeserializeOwned>(&self, node: &str, path: &str) -> Result<T, ExplainError> {
        let direct_client;
        let (client, url) = match &self.direct {
            Some(d) => {
                let base = match &d.url {
                    Some(u) => u.clone(),
                    None => self.kubelet_url(node).await?,
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
        match &self.direct {
            Some(_) => format!("vkd's kubelet API, GET {path}"),
            None => format!("kubectl get --raw /api/v1/nodes/{node}/proxy{path}"),
        }
    }

    async fn pod(&self, ns: &str, name: &str) -> Result<PodExplanation, ExplainError> {
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
            match self.ask::<PodAnswer>(&node_name, &path).await {
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

    async fn node(&self, name: &str) -> Result<NodeExplanation, ExplainError> {
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
        let (vkd, vkd_error) = match self.ask::<NodeAnswer>(name, "/explain/node").await {
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
        Ok(NodeExplanation {
            node: name.to_owned(),
            ready,
            advertised,
            published,
            taints,
            vkd,
            vkd_error,
            sources,
        })
    }

    async fn instance(
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
            match self.ask::<InstanceAnswer>(n, &path).await {
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
        return format!("waiting ({})", w.reason.clone().unwrap_or_default());
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

fn ready_condition(node: &Node) -> Option<String> {
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

fn taint_text(t: &Taint) -> String {
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

/// Whether a toleration tolerates a taint, as the scheduler and the taint
/// manager match them.
fn tolerates(tol: &Toleration, taint: &Taint) -> bool {
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
        let answer: NodeAnswer = e.ask("vk", "/explain/node").await.unwrap();
        assert_eq!(answer.leadership.epoch, 3);
        assert_eq!(
            log.lock().unwrap()[0].path,
            "/api/v1/nodes/vk/proxy/explain/node"
        );
        let refused = e.ask::<PodAnswer>("vk", "/explain/pod/ns/secret").await;
        assert!(
            matches!(refused, Err(ExplainError::Refused(_))),
            "{refused:?}"
        );
        assert_eq!(
            e.via("vk", "/explain/node"),
            "kubectl get --raw /api/v1/nodes/vk/proxy/explain/node"
        );
    }

    #[test]
    fn pod_names_are_checked_before_anything_is_asked() {
        assert_eq!(pod_name("ns/p", None).unwrap(), ("ns".into(), "p".into()));
        assert_eq!(
            pod_name("p", Some("ns")).unwrap(),
            ("ns".into(), "p".into())
        );
        assert_eq!(pod_name("p", None).unwrap(), ("default".into(), "p".into()));
        for bad in ["a/b/c", "ns/", "/p", "NS/p", "ns/p?x=1"] {
            assert!(
                matches!(pod_name(bad, None), Err(ExplainError::Usage(_))),
                "{bad}"
            );
        }
        assert!(matches!(
            pod_name("a/b", Some("x")),
            Err(ExplainError::Usage(_))
        ));
    }

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
