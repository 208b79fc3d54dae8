//! The kubelet HTTP API on the port the Node advertises: HTTPS (rustls; HTTP/2
//! where the client offers it, HTTP/1.1 for upgrades), authenticated and
//! authorized as a kubelet does, serving logs, exec, attach, port-forward,
//! stats and pod lists from the provider.

// Handlers return an early error Response as Err: it is sent at once, never carried far.
#![allow(clippy::result_large_err)]

pub mod auth;
mod conn;
mod explain;
mod idle;
pub mod logs;
pub mod nodes;
pub mod stats;
mod streams;
pub mod tls;

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::SystemTime;

use bytes::Bytes;
use futures::StreamExt;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::header::HeaderValue;
use hyper::{Request, Response, StatusCode};
use k8s_openapi::api::core::v1::Pod;
use kube::api::ListParams;
use kube::{Api, Client};
use serde_json::json;
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, info_span};
use vkd_provider::ProviderError;

use crate::pods::PodIndex;
use auth::{AuthError, Authenticator, User};
pub use conn::{
    DEFAULT_HEADER_TIMEOUT, DEFAULT_IDLE_TIMEOUT, DEFAULT_MAX_CONNECTIONS, HANDSHAKE_TIMEOUT,
    Limits, default_per_peer,
};
pub use idle::DEFAULT_STREAM_IDLE_TIMEOUT;
use nodes::Target;

type Body = UnsyncBoxBody<Bytes, std::io::Error>;

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("kubelet API TLS: {0}")]
    Tls(#[from] tls::TlsError),
    #[error("binding the kubelet API on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
}

/// One listener's kubelet API: the Nodes it answers for (one, or every per-host
/// Node on a shared port) and who may ask what of them.
pub struct KubeletApi {
    nodes: BTreeMap<String, NodeApi>,
    auth: Authenticator,
    metrics: Arc<crate::metrics::Metrics>,
}

/// What one Node's kubelet paths are answered from.
struct NodeApi {
    pods: PodIndex,
    client: Client,
    usage: stats::NodeUsage,
}

impl std::fmt::Debug for KubeletApi {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeletApi")
            .field("nodes", &self.nodes.keys().collect::<Vec<_>>())
            .field("auth", &self.auth)
            .finish_non_exhaustive()
    }
}

/// A metav1.Status response, as the kubelet and apiserver write errors.
pub fn status(code: StatusCode, reason: &str, message: &str) -> Response<Body> {
    let body = json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {},
        "status": "Failure", "message": message, "reason": reason, "code": code.as_u16(),
    });
    let mut r = Response::new(full(body.to_string()));
    *r.status_mut() = code;
    r.headers_mut()
        .insert("content-type", HeaderValue::from_static("application/json"));
    r
}

fn full(b: impl Into<Bytes>) -> Body {
    Full::new(b.into())
        .map_err(|never: Infallible| match never {})
        .boxed_unsync()
}

fn text(code: StatusCode, body: impl Into<Bytes>) -> Response<Body> {
    let mut r = Response::new(full(body));
    *r.status_mut() = code;
    r
}

fn json_response(v: &serde_json::Value) -> Response<Body> {
    let mut r = Response::new(full(v.to_string()));
    r.headers_mut()
        .insert("content-type", HeaderValue::from_static("application/json"));
    r
}

fn provider_error(e: &ProviderError) -> Response<Body> {
    match e {
        ProviderError::Unsupported {
            provider,
            capability,
        } => status(
            StatusCode::NOT_IMPLEMENTED,
            "NotImplemented",
            &format!("provider {provider} does not support {capability}"),
        ),
        ProviderError::NotFound { .. } => status(StatusCode::NOT_FOUND, "NotFound", &e.to_string()),
        ProviderError::Invalid { message, .. } => {
            status(StatusCode::BAD_REQUEST, "BadRequest", message)
        }
        _ => status(
            StatusCode::INTERNAL_SERVER_ERROR,
            "InternalError",
            &e.to_string(),
        ),
    }
}

impl KubeletApi {
    /// The kubelet API of `nodes` (their Pod indexes), of the `nodes_served`
    /// Nodes this process serves in all.
    pub fn new(
        nodes: Vec<PodIndex>,
        client: Client,
        anonymous: bool,
        nodes_served: usize,
        metrics: Arc<crate::metrics::Metrics>,
    ) -> Arc<Self> {
        let nodes = nodes
            .into_iter()
            .map(|pods| {
                let api = NodeApi {
                    client: client.clone(),
                    usage: stats::NodeUsage::new(nodes_served),
                    pods,
                };
                (api.pods.node().to_owned(), api)
            })
            .collect();
        Arc::new(Self {
            nodes,
            auth: Authenticator::new(client, anonymous),
            metrics,
        })
    }

    /// Binds now, serves with the default [`Limits`] until shutdown.
    pub async fn serve(
        self: Arc<Self>,
        addr: SocketAddr,
        config: rustls::ServerConfig,
        shutdown: CancellationToken,
    ) -> Result<tokio::task::JoinHandle<()>, ApiError> {
        self.serve_with(addr, config, Limits::default(), shutdown)
            .await
    }

    /// Binds now, serves until shutdown, within `limits`.
    pub async fn serve_with(
        self: Arc<Self>,
        addr: SocketAddr,
        config: rustls::ServerConfig,
        limits: Limits,
        shutdown: CancellationToken,
    ) -> Result<tokio::task::JoinHandle<()>, ApiError> {
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|source| ApiError::Bind { addr, source })?;
        let acceptor = TlsAcceptor::from(Arc::new(config));
        let token = shutdown.clone();
        let metrics = Arc::clone(&self.metrics);
        Ok(tokio::spawn(conn::accept_loop(
            listener,
            limits,
            shutdown,
            move |tcp, peer, slot| {
                let this = Arc::clone(&self);
                let service = move |tls: &rustls::ServerConnection| {
                    let cert_user = cert_user(tls);
                    move |req| Arc::clone(&this).handle(req, cert_user.clone())
                };
                tokio::spawn(conn::serve_tls(
                    acceptor.clone(),
                    tcp,
                    peer,
                    slot,
                    limits,
                    token.clone(),
                    service,
                ));
            },
            move |why| metrics.kubelet_api_refused(why.label()),
        )))
    }

    async fn handle(
        self: Arc<Self>,
        req: Request<Incoming>,
        cert_user: Option<User>,
    ) -> Response<Body> {
        let path = req.uri().path().to_owned();
        let span = info_span!("kubelet_api", method = %req.method(), path = %path);
        async move {
            let authz = req
                .headers()
                .get("authorization")
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned);
            let user = match self.auth.authenticate(cert_user, authz.as_deref()).await {
                Ok(u) => u,
                Err(e) => return auth_response(&e),
            };
            let served: Vec<&str> = self.nodes.keys().map(String::as_str).collect();
            let target = nodes::resolve(&path, &served, |ns, pod| {
                self.nodes
                    .iter()
                    .find(|(_, n)| n.pods.lookup(ns, pod).is_some())
                    .map(|(name, _)| name.as_str())
            });
            let method = req.method().as_str();
            match target {
                Target::Node { node, path } => {
                    if let Err(r) = self.authorize(&user, method, &path, &[&node]).await {
                        return r;
                    }
                    match self.nodes.get(&node) {
                        Some(api) => api.route(req, &path).await,
                        None => status(StatusCode::NOT_FOUND, "NotFound", "no such node"),
                    }
                }
                Target::Unserved { node, path } => {
                    if let Err(r) = self.authorize(&user, method, &path, &[&node]).await {
                        return r;
                    }
                    status(
                        StatusCode::NOT_FOUND,
                        "NotFound",
                        &format!(
                            "node \"{node}\" is not served on this port (it serves {})",
                            served.join(", ")
                        ),
                    )
                }
                Target::NoPod {
                    namespace,
                    pod,
                    path,
                } => {
                    if let Err(r) = self.authorize(&user, method, &path, &served).await {
                        return r;
                    }
                    status(
                        StatusCode::NOT_FOUND,
                        "NotFound",
                        &format!(
                            "pod \"{pod}\" in namespace \"{namespace}\" not found on nodes {}",
                            served.join(", ")
                        ),
                    )
                }
                Target::Unnamed { path } => {
                    if let Err(r) = self.authorize(&user, method, &path, &served).await {
                        return r;
                    }
                    if path == "/healthz" {
                        return text(StatusCode::OK, "ok");
                    }
                    status(
                        StatusCode::NOT_FOUND,
                        "NotFound",
                        &nodes::unnamed_message(&path, &served),
                    )
                }
            }
        }
        .instrument(span)
        .await
    }

    /// `vkd explain pod` is authorized as reading the Pod; every other path as
    /// the kubelet authorizes it, on each Node in `nodes`.
    async fn authorize(
        &self,
        user: &User,
        method: &str,
        path: &str,
        nodes: &[&str],
    ) -> Result<(), Response<Body>> {
        match explain::pod_read(path)? {
            Some((ns, name)) => self
                .auth
                .authorize_pod_read(user, &ns, &name)
                .await
                .map_err(|e| auth_response(&e)),
            None => {
                let attrs = auth::attributes(method, path);
                for node in nodes {
                    self.auth
                        .authorize(user, node, &attrs)
                        .await
                        .map_err(|e| auth_response(&e))?;
                }
                Ok(())
            }
        }
    }
}

impl NodeApi {
    /// Answers `path` (the request's, without a `/nodes/<node>` prefix).
    async fn route(&self, req: Request<Incoming>, path: &str) -> Response<Body> {
        let query = req.uri().query().unwrap_or_default().to_owned();
        let parts: Vec<&str> = path.trim_start_matches('/').split('/').collect();
        let get_or_post = matches!(*req.method(), hyper::Method::GET | hyper::Method::POST);
        let is_get = *req.method() == hyper::Method::GET;
        match parts.as_slice() {
            ["healthz"] => text(StatusCode::OK, "ok"),
            ["pods"] | ["pods", ""] => self.pods_list().await,
            ["runningpods"] | ["runningpods", ""] => self.running_pods().await,
            ["containerLogs", ns, pod, container] => self.logs(ns, pod, container, &query).await,
            ["exec", ns, pod, container] | ["exec", ns, pod, _, container] if get_or_post => {
                self.remotecommand(req, ns, pod, container, &query, true)
                    .await
            }
            ["attach", ns, pod, container] | ["attach", ns, pod, _, container] if get_or_post => {
                self.remotecommand(req, ns, pod, container, &query, false)
                    .await
            }
            ["portForward", ns, pod] | ["portForward", ns, pod, _] if get_or_post => {
                self.port_forward(req, ns, pod).await
            }
            ["explain", what @ ..] if is_get => self.explain(what).await,
            ["stats", "summary"] | ["stats", "summary", ""] => {
                json_response(&stats::summary(&self.pods, &self.usage).await)
            }
            ["metrics", "resource"] => {
                let mut r = text(
                    StatusCode::OK,
                    stats::resource_metrics(&self.pods, &self.usage).await,
                );
                r.headers_mut().insert(
                    "content-type",
                    HeaderValue::from_static("text/plain; version=0.0.4"),
                );
                r
            }
            _ => status(
                StatusCode::NOT_FOUND,
                "NotFound",
                &format!("no kubelet API route for {path}"),
            ),
        }
    }

    fn find(&self, ns: &str, pod: &str, container: Option<&str>) -> Result<String, Response<Body>> {
        let Some((uid, containers)) = self.pods.lookup(ns, pod) else {
            return Err(status(
                StatusCode::NOT_FOUND,
                "NotFound",
                &format!(
                    "pod \"{pod}\" in namespace \"{ns}\" not found on node {}",
                    self.pods.node()
                ),
            ));
        };
        if let Some(c) = container
            && !containers.iter().any(|n| n == c)
        {
            return Err(status(
                StatusCode::NOT_FOUND,
                "NotFound",
                &format!("container \"{c}\" not found in pod \"{ns}/{pod}\""),
            ));
        }
        Ok(uid)
    }

    async fn logs(&self, ns: &str, pod: &str, container: &str, query: &str) -> Response<Body> {
        let q = match logs::parse_query(query) {
            Ok(q) => q,
            Err(m) => return status(StatusCode::UNPROCESSABLE_ENTITY, "Invalid", &m),
        };
        let uid = match self.find(ns, pod, Some(container)) {
            Ok(u) => u,
            Err(r) => return r,
        };
        let request = q.request(SystemTime::now());
        match self.pods.provider().logs(&uid, container, request).await {
            Ok(lines) => {
                let body = logs::shape(lines, &q, SystemTime::now())
                    .map(|b| Ok::<_, std::io::Error>(Frame::data(b)));
                let mut r = Response::new(BodyExt::boxed_unsync(StreamBody::new(body)));
                r.headers_mut()
                    .insert("content-type", HeaderValue::from_static("text/plain"));
                r
            }
            Err(e) => provider_error(&e),
        }
    }

    async fn pods_list(&self) -> Response<Body> {
        let api: Api<Pod> = Api::all(self.client.clone());
        // From the API server's watch cache (resourceVersion 0), not a quorum
        // read of etcd: what a scraper polls costs the control plane little.
        // vkd keeps a compact record per Pod, not the object the kubelet's
        // pod manager holds, so the objects come from there.
        let params = ListParams::default()
            .fields(&format!("spec.nodeName={}", self.pods.node()))
            .match_any();
        match api.list(&params).await {
            Ok(list) => json_response(&json!({
                "kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": list.items,
            })),
            Err(e) => status(
                StatusCode::INTERNAL_SERVER_ERROR,
                "InternalError",
                &e.to_string(),
            ),
        }
    }

    async fn running_pods(&self) -> Response<Body> {
        match self.pods.provider().list(self.pods.node()).await {
            Ok(instances) => {
                let items: Vec<_> = instances
                    .iter()
                    .filter(|i| i.phase == vkd_provider::InstancePhase::Running)
                    .map(|i| {
                        json!({
                            "metadata": {"name": i.owner.name, "namespace": i.owner.namespace, "uid": i.owner.uid},
                            "spec": {"containers": i.containers.iter().map(|c| json!({"name": c.name})).collect::<Vec<_>>()},
                        })
                    })
                    .collect();
                json_response(
                    &json!({"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": items}),
                )
            }
            Err(e) => provider_error(&e),
        }
    }
}

/// The user a verified client certificate names, if the client sent one.
fn cert_user(tls: &rustls::ServerConnection) -> Option<User> {
    tls.peer_certificates()
        .and_then(|c| c.first())
        .and_then(tls::identity_of)
        .map(|(name, groups)| User {
            name,
            groups,
            uid: None,
        })
}

fn auth_response(e: &AuthError) -> Response<Body> {
    match e {
        AuthError::Unauthorized(m) => status(StatusCode::UNAUTHORIZED, "Unauthorized", m),
        AuthError::Forbidden(m) => status(StatusCode::FORBIDDEN, "Forbidden", m),
        AuthError::Review(_) => status(
            StatusCode::INTERNAL_SERVER_ERROR,
            "InternalError",
            &e.to_string(),
        ),
    }
}
