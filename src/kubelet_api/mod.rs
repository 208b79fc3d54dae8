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
pub mod stats;
pub mod tls;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::SystemTime;

use bytes::Bytes;
use futures::StreamExt;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::header::{CONNECTION, HeaderValue, UPGRADE};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use k8s_openapi::api::core::v1::Pod;
use kube::api::ListParams;
use kube::{Api, Client};
use serde_json::json;
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, info_span, warn};
use vkd_provider::ProviderError;

use crate::pods::PodIndex;
use crate::streaming::portforward::{self, Connect};
use crate::streaming::remotecommand::{self, EXEC_PROTOCOLS, Outcome, Requested};
use crate::streaming::spdy::session::Session;
use crate::streaming::websocket::{self, Protocol};
use auth::{AuthError, Authenticator, User};
pub use conn::{
    DEFAULT_HEADER_TIMEOUT, DEFAULT_IDLE_TIMEOUT, DEFAULT_MAX_CONNECTIONS, HANDSHAKE_TIMEOUT,
    Limits, default_per_peer,
};
pub use idle::DEFAULT_STREAM_IDLE_TIMEOUT;

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

pub struct KubeletApi {
    pods: PodIndex,
    auth: Authenticator,
    client: Client,
    usage: stats::NodeUsage,
}

impl std::fmt::Debug for KubeletApi {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KubeletApi")
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
    /// The kubelet API of one of the `nodes_served` Nodes this process serves.
    pub fn new(pods: PodIndex, client: Client, anonymous: bool, nodes_served: usize) -> Arc<Self> {
        let auth = Authenticator::new(client.clone(), pods.node().to_owned(), anonymous);
        Arc::new(Self {
            pods,
            auth,
            client,
            usage: stats::NodeUsage::new(nodes_served),
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
        let metrics = Arc::clone(self.pods.metrics());
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
            // `vkd explain pod` is authorized as reading the Pod; every other
            // path as the kubelet authorizes it.
            let pod_read = match explain::pod_read(&path) {
                Ok(p) => p,
                Err(not_found) => return not_found,
            };
            let allowed = match &pod_read {
                Some((ns, name)) => self.auth.authorize_pod_read(&user, ns, name).await,
                None => {
                    let attrs = auth::attributes(req.method().as_str(), &path);
                    self.auth.authorize(&user, &attrs).await
                }
            };
            if let Err(e) = allowed {
                return auth_response(&e);
            }
            self.route(req).await
        }
        .instrument(span)
        .await
    }

    async fn route(&self, req: Request<Incoming>) -> Response<Body> {
        let path = req.uri().path().to_owned();
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

    async fn remotecommand(
        &self,
        mut req: Request<Incoming>,
        ns: &str,
        pod: &str,
        container: &str,
        query: &str,
        exec: bool,
    ) -> Response<Body> {
        let uid = match self.find(ns, pod, Some(container)) {
            Ok(u) => u,
            Err(r) => return r,
        };
        let caps = self.pods.provider().capabilities();
        let supported = if exec { caps.exec } else { caps.attach };
        if supported == vkd_provider::Support::Unsupported {
            return provider_error(&self.pods.provider().unsupported(if exec {
                "exec"
            } else {
                "attach"
            }));
        }
        let pairs = logs::query_pairs(query);
        let flag = |k: &str| {
            pairs
                .iter()
                .any(|(n, v)| n == k && matches!(v.as_str(), "1" | "true" | "True" | ""))
        };
        let want = Requested {
            stdin: flag("input"),
            stdout: flag("output"),
            stderr: flag("error"),
            tty: flag("tty"),
        };
        let command: Vec<String> = pairs
            .iter()
            .filter(|(k, _)| k == "command")
            .map(|(_, v)| v.clone())
            .collect();
        if exec && command.is_empty() {
            return status(
                StatusCode::BAD_REQUEST,
                "BadRequest",
                "exec needs at least one command parameter",
            );
        }
        if !(want.stdin || want.stdout || want.stderr) {
            return status(
                StatusCode::BAD_REQUEST,
                "BadRequest",
                "you must specify at least one of stdin, stdout, stderr",
            );
        }
        let provider = Arc::clone(self.pods.provider());
        let container = container.to_owned();
        let span =
            info_span!("stream", pod_uid = %uid, kind = if exec { "exec" } else { "attach" });
        if is_websocket(&req) {
            let offered = offered_protocols(&req);
            let offered: Vec<&str> = offered.iter().map(String::as_str).collect();
            let Some(protocol) = Protocol::for_exec(&offered) else {
                return no_common_protocol(&offered);
            };
            let response = match websocket_accept(&req, protocol.name()) {
                Ok(r) => r,
                Err(r) => return r,
            };
            tokio::spawn(
                async move {
                    let upgraded = match hyper::upgrade::on(&mut req).await {
                        Ok(u) => u,
                        Err(e) => return debug!(error = %e, "upgrade failed"),
                    };
                    let cmd = command.clone();
                    websocket::serve_channels(upgraded, protocol, want, command, |io| async move {
                        run_stream(provider.as_ref(), exec, &uid, &container, cmd, io).await
                    })
                    .await;
                }
                .instrument(span),
            );
            return response;
        }
        let protocol = match negotiate(&req, &EXEC_PROTOCOLS) {
            Ok(p) => p,
            Err(r) => return r,
        };
        tokio::spawn(
            async move {
                let upgraded = match hyper::upgrade::on(&mut req).await {
                    Ok(u) => u,
                    Err(e) => return debug!(error = %e, "upgrade failed"),
                };
                let (session, incoming) = Session::spawn(TokioIo::new(upgraded));
                let mut channels = match remotecommand::accept(session, incoming, want).await {
                    Ok(c) => c,
                    Err(e) => return warn!(error = %e, "stream setup failed"),
                };
                let io = channels.take_io();
                let outcome = run_stream(
                    provider.as_ref(),
                    exec,
                    &uid,
                    &container,
                    command.clone(),
                    io,
                )
                .await;
                debug!(?outcome, "stream finished");
                channels.finish(outcome, &command).await;
            }
            .instrument(span),
        );
        switching(protocol)
    }

    async fn port_forward(
        &self,
        mut req: Request<Incoming>,
        ns: &str,
        pod: &str,
    ) -> Response<Body> {
        let uid = match self.find(ns, pod, None) {
            Ok(u) => u,
            Err(r) => return r,
        };
        if self.pods.provider().capabilities().port_forward == vkd_provider::Support::Unsupported {
            return provider_error(&self.pods.provider().unsupported("port-forward"));
        }
        let connect = connector(Arc::clone(self.pods.provider()), uid);
        if is_websocket(&req) {
            let offered = offered_protocols(&req);
            let offered: Vec<&str> = offered.iter().map(String::as_str).collect();
            if websocket::wants_tunnel(&offered) {
                if !offered.contains(&websocket::TUNNEL_PROTOCOL) {
                    return no_common_protocol(&offered);
                }
                let response = match websocket_accept(&req, Some(websocket::TUNNEL_PROTOCOL)) {
                    Ok(r) => r,
                    Err(r) => return r,
                };
                tokio::spawn(async move {
                    let upgraded = match hyper::upgrade::on(&mut req).await {
                        Ok(u) => u,
                        Err(e) => return debug!(error = %e, "upgrade failed"),
                    };
                    forward_ports(websocket::tunnel(upgraded).await, connect).await;
                });
                return response;
            }
            // The kubelet's own WebSocket port-forward: channels per `port`.
            let pairs = logs::query_pairs(req.uri().query().unwrap_or_default());
            let ports = match websocket::ports(&pairs) {
                Ok(p) => p,
                Err(m) => return status(StatusCode::BAD_REQUEST, "BadRequest", &m),
            };
            let Some(protocol) = Protocol::for_port_forward(&offered) else {
                return no_common_protocol(&offered);
            };
            let response = match websocket_accept(&req, protocol.name()) {
                Ok(r) => r,
                Err(r) => return r,
            };
            tokio::spawn(async move {
                let upgraded = match hyper::upgrade::on(&mut req).await {
                    Ok(u) => u,
                    Err(e) => return debug!(error = %e, "upgrade failed"),
                };
                websocket::serve_port_forward(upgraded, protocol, ports, connect).await;
            });
            return response;
        }
        let protocol = match negotiate(&req, &[portforward::PROTOCOL]) {
            Ok(p) => p,
            Err(r) => return r,
        };
        tokio::spawn(async move {
            let upgraded = match hyper::upgrade::on(&mut req).await {
                Ok(u) => u,
                Err(e) => return debug!(error = %e, "upgrade failed"),
            };
            forward_ports(TokioIo::new(upgraded), connect).await;
        });
        switching(protocol)
    }
}

/// The provider's port-forward to the Pod `uid`, for the stream protocols.
fn connector(provider: Arc<dyn vkd_provider::Provider>, uid: String) -> Connect {
    Arc::new(move |port, stream| {
        let provider = Arc::clone(&provider);
        let uid = uid.clone();
        Box::pin(async move {
            provider
                .port_forward(&uid, port, stream)
                .await
                .map_err(|e| format!("error forwarding port {port} to pod {uid}: {e}"))
        })
    })
}

/// Serves a SPDY port-forward session on `io` until the client closes it.
async fn forward_ports<IO>(io: IO, connect: Connect)
where
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + 'static,
{
    let (session, incoming) = Session::spawn(io);
    let closer = session.clone();
    portforward::serve_spdy(session, incoming, connect).await;
    closer.close().await;
}

async fn run_stream(
    provider: &dyn vkd_provider::Provider,
    exec: bool,
    uid: &str,
    container: &str,
    command: Vec<String>,
    io: vkd_provider::StreamIo,
) -> Outcome {
    if exec {
        match provider.exec(uid, container, command, io).await {
            Ok(code) => Outcome::Exited(code),
            Err(e) => Outcome::Error(e.to_string()),
        }
    } else {
        match provider.attach(uid, container, io).await {
            Ok(()) => Outcome::Exited(0),
            Err(e) => Outcome::Error(e.to_string()),
        }
    }
}

fn is_websocket(req: &Request<Incoming>) -> bool {
    req.headers()
        .get(UPGRADE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.eq_ignore_ascii_case("websocket"))
}

/// The WebSocket subprotocols the client offers, in its order.
fn offered_protocols(req: &Request<Incoming>) -> Vec<String> {
    req.headers()
        .get_all("sec-websocket-protocol")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .filter(|v| !v.is_empty())
        .map(str::to_owned)
        .collect()
}

/// A WebSocket upgrade without a subprotocol vkd serves: 403, as the kubelet answers.
fn no_common_protocol(offered: &[&str]) -> Response<Body> {
    status(
        StatusCode::FORBIDDEN,
        "Forbidden",
        &format!("requested WebSocket subprotocols {offered:?} are not supported"),
    )
}

/// The 101 answer to a WebSocket upgrade, naming `protocol` if there is one.
fn websocket_accept(
    req: &Request<Incoming>,
    protocol: Option<&'static str>,
) -> Result<Response<Body>, Response<Body>> {
    let Some(key) = req.headers().get("sec-websocket-key") else {
        return Err(status(
            StatusCode::BAD_REQUEST,
            "BadRequest",
            "missing Sec-WebSocket-Key",
        ));
    };
    let accept = tokio_tungstenite::tungstenite::handshake::derive_accept_key(key.as_bytes());
    let mut r = Response::new(full(Bytes::new()));
    *r.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
    let h = r.headers_mut();
    h.insert(CONNECTION, HeaderValue::from_static("Upgrade"));
    h.insert(UPGRADE, HeaderValue::from_static("websocket"));
    if let Some(p) = protocol {
        h.insert("sec-websocket-protocol", HeaderValue::from_static(p));
    }
    if let Ok(v) = HeaderValue::from_str(&accept) {
        h.insert("sec-websocket-accept", v);
    }
    Ok(r)
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

/// Picks the first protocol the client offers that vkd serves (SPDY upgrade only).
fn negotiate(
    req: &Request<Incoming>,
    ours: &[&'static str],
) -> Result<&'static str, Response<Body>> {
    let upgrade = req
        .headers()
        .get(UPGRADE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    if !upgrade.eq_ignore_ascii_case("SPDY/3.1") {
        return Err(status(
            StatusCode::BAD_REQUEST,
            "BadRequest",
            &format!("this endpoint needs a SPDY/3.1 upgrade, got Upgrade: {upgrade:?}"),
        ));
    }
    let offered: Vec<String> = req
        .headers()
        .get_all("x-stream-protocol-version")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|v| v.trim().to_owned())
        .filter(|v| !v.is_empty())
        .collect();
    if offered.is_empty() {
        return Err(status(
            StatusCode::BAD_REQUEST,
            "BadRequest",
            "missing X-Stream-Protocol-Version",
        ));
    }
    for o in &offered {
        if let Some(p) = ours.iter().find(|p| **p == o.as_str()) {
            return Ok(p);
        }
    }
    let mut r = status(
        StatusCode::FORBIDDEN,
        "Forbidden",
        &format!("no common stream protocol: offered {offered:?}, supported {ours:?}"),
    );
    for p in ours {
        r.headers_mut().append(
            "x-accepted-stream-protocol-versions",
            HeaderValue::from_static(p),
        );
    }
    Err(r)
}

fn switching(protocol: &'static str) -> Response<Body> {
    let mut r = Response::new(full(Bytes::new()));
    *r.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
    let h = r.headers_mut();
    h.insert(CONNECTION, HeaderValue::from_static("Upgrade"));
    h.insert(UPGRADE, HeaderValue::from_static("SPDY/3.1"));
    h.insert(
        "x-stream-protocol-version",
        HeaderValue::from_static(protocol),
    );
    r
}
