//! The streams of the kubelet API: exec and attach (SPDY/3.1 or WebSocket) and
//! port-forward (SPDY, the kubelet's WebSocket channels, or the tunnel), each
//! negotiated as the kubelet does and served on the upgraded connection.

use std::sync::Arc;

use bytes::Bytes;
use hyper::body::Incoming;
use hyper::header::{CONNECTION, HeaderValue, UPGRADE};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tracing::{Instrument, debug, info_span, warn};

use super::{Body, NodeApi, full, logs, provider_error, status};
use crate::streaming::portforward::{self, Connect};
use crate::streaming::remotecommand::{self, EXEC_PROTOCOLS, Outcome, Requested};
use crate::streaming::spdy::session::Session;
use crate::streaming::websocket::{self, Protocol};

impl NodeApi {
    pub(super) async fn remotecommand(
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

    pub(super) async fn port_forward(
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
