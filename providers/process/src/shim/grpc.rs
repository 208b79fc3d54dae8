//! The gRPC probe, as the kubelet's prober makes it (`pkg/probe/grpc`): one
//! `grpc.health.v1.Health/Check` call over HTTP/2 to the Pod's IP, in
//! plaintext or, with `mode: TLS`, over TLS without verifying the server.
//! Like grpc-go's blocking dial, a connection that fails is tried again until
//! the probe's timeout; the verdict's words are the kubelet's, since a person
//! reads them in the `Unhealthy` Event.

use std::time::Duration;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::time::Instant;

/// The path of the health-checking protocol's one call.
const CHECK_PATH: &str = "/grpc.health.v1.Health/Check";
/// The most of a reply read: a health answer is a few bytes, so anything
/// longer is not one (and is not kept).
const REPLY_MAX: usize = 16 << 10;
/// The wait between two tries to connect, as grpc-go's first back-off.
const RECONNECT_AFTER: Duration = Duration::from_secs(1);

/// `grpc.health.v1.HealthCheckRequest`.
#[derive(Clone, PartialEq, prost::Message)]
struct HealthCheckRequest {
    #[prost(string, tag = "1")]
    service: String,
}

/// `grpc.health.v1.HealthCheckResponse`.
#[derive(Clone, PartialEq, prost::Message)]
struct HealthCheckResponse {
    #[prost(int32, tag = "1")]
    status: i32,
}

/// `HealthCheckResponse.ServingStatus.SERVING`.
const SERVING: i32 = 1;

/// Where and how a gRPC probe checks.
#[derive(Debug)]
pub(super) struct Target<'a> {
    pub(super) host: &'a str,
    /// The Pod's network namespace, where it has one: connected from there.
    pub(super) netns: Option<&'a std::path::Path>,
    pub(super) port: u16,
    pub(super) service: &'a str,
    pub(super) tls: bool,
}

/// Checks `target`'s health within `timeout`: `Ok` when it answers
/// `SERVING`, otherwise the kubelet's words for what happened.
pub(super) async fn check(target: &Target<'_>, timeout: Duration) -> Result<(), String> {
    let addr = super::handler::authority(target.host, target.port);
    // The timeout is the tenant's number: a deadline past the clock's range
    // is a year away instead.
    let now = Instant::now();
    let deadline = now
        .checked_add(timeout)
        .unwrap_or(now + Duration::from_secs(365 * 86_400));
    let seconds = timeout.as_secs();
    let connected = tokio::time::timeout_at(deadline, connect(target, timeout)).await;
    let Ok(stream) = connected else {
        return Err(format!(
            "timeout: failed to connect service {addr:?} within {seconds}s: context deadline exceeded"
        ));
    };
    let stream = stream?;
    let call = match stream {
        Stream::Plain(s) => {
            tokio::time::timeout_at(deadline, call(s, &addr, target, deadline)).await
        }
        Stream::Tls(s) => {
            tokio::time::timeout_at(deadline, call(*s, &addr, target, deadline)).await
        }
    };
    match call {
        Err(_) => Err(format!(
            "timeout: health rpc did not complete within {seconds}s"
        )),
        Ok(Err(e)) => Err(e.verdict()),
        Ok(Ok(status)) if status == SERVING => Ok(()),
        Ok(Ok(status)) => Err(format!(
            "service unhealthy (responded with {:?})",
            serving_status_name(status)
        )),
    }
}

enum Stream {
    Plain(tokio::net::TcpStream),
    Tls(Box<tokio_rustls::client::TlsStream<tokio::net::TcpStream>>),
}

/// A connection to the target, tried again until it is made (the caller
/// bounds it with the probe's timeout); a Pod network namespace that cannot
/// be entered fails at once.
async fn connect(target: &Target<'_>, timeout: Duration) -> Result<Stream, String> {
    loop {
        match connect_once(target, timeout).await {
            Ok(s) => return Ok(s),
            Err(e @ super::dial::DialError::Namespace { .. }) => return Err(e.to_string()),
            // Refused or unreachable: the server may be starting.
            Err(_) => tokio::time::sleep(RECONNECT_AFTER).await,
        }
    }
}

async fn connect_once(
    target: &Target<'_>,
    timeout: Duration,
) -> Result<Stream, super::dial::DialError> {
    let tcp = super::dial::dial(target.netns, target.host, target.port, timeout).await?;
    tcp.set_nodelay(true)?;
    if target.tls {
        let tls = super::tls::connect_h2(target.host, tcp).await?;
        Ok(Stream::Tls(Box::new(tls)))
    } else {
        Ok(Stream::Plain(tcp))
    }
}

/// Why a call got no health answer.
#[derive(Debug, PartialEq, Eq)]
enum CallError {
    /// The HTTP/2 connection or stream failed.
    Transport(String),
    /// The server answered with a gRPC status other than OK.
    Status { code: u32, message: String },
    /// What came back is not a health answer.
    Malformed(String),
}

impl CallError {
    /// The kubelet's words (grpc-go's `rpc error: code = … desc = …`).
    fn verdict(&self) -> String {
        match self {
            Self::Status { code: 12, message } => format!(
                "error: this server does not implement the grpc health protocol (grpc.health.v1.Health): {message}"
            ),
            Self::Status { code, message } => format!(
                "error: health rpc probe failed: rpc error: code = {} desc = {message}",
                code_name(*code)
            ),
            Self::Transport(e) => {
                format!("error: health rpc probe failed: rpc error: code = Unavailable desc = {e}")
            }
            Self::Malformed(e) => {
                format!("error: health rpc probe failed: rpc error: code = Internal desc = {e}")
            }
        }
    }
}

/// One Check call on a new HTTP/2 connection over `io`: the status the
/// server answered.
async fn call<T>(
    io: T,
    addr: &str,
    target: &Target<'_>,
    deadline: Instant,
) -> Result<i32, CallError>
where
    T: AsyncRead + AsyncWrite + Unpin,
{
    let transport = |e: h2::Error| CallError::Transport(e.to_string());
    let (client, connection) = h2::client::handshake(io).await.map_err(transport)?;
    let exchange = async move {
        let mut client = client.ready().await.map_err(transport)?;
        let scheme = if target.tls { "https" } else { "http" };
        let left = deadline.saturating_duration_since(Instant::now());
        let request = http::Request::post(format!("{scheme}://{addr}{CHECK_PATH}"))
            .header(http::header::CONTENT_TYPE, "application/grpc")
            .header(http::header::TE, "trailers")
            .header(http::header::USER_AGENT, super::http::USER_AGENT)
            .header("grpc-timeout", format!("{}m", left.as_millis().max(1)))
            .body(())
            .map_err(|e| CallError::Malformed(e.to_string()))?;
        let (reply, mut send) = client.send_request(request, false).map_err(transport)?;
        send.send_data(request_frame(target.service), true)
            .map_err(transport)?;
        let (head, mut body) = reply.await.map_err(transport)?.into_parts();
        if head.status != http::StatusCode::OK {
            return Err(CallError::Malformed(format!(
                "unexpected HTTP status code received from server: {}",
                head.status.as_u16()
            )));
        }
        // A server that fails the call at once sends its status in the
        // headers ("Trailers-Only").
        if let Some(status) = grpc_status(&head.headers)? {
            return Err(status);
        }
        let mut message = BytesMut::new();
        while let Some(chunk) = body.data().await {
            let chunk = chunk.map_err(transport)?;
            let _ = body.flow_control().release_capacity(chunk.len());
            if message.len() + chunk.len() > REPLY_MAX {
                return Err(CallError::Malformed(format!(
                    "a reply of more than {REPLY_MAX} bytes"
                )));
            }
            message.extend_from_slice(&chunk);
        }
        let trailers = body
            .trailers()
            .await
            .map_err(transport)?
            .unwrap_or_default();
        match grpc_status(&trailers)? {
            Some(status) => Err(status),
            None if trailers.contains_key("grpc-status") => read_reply(message.freeze()),
            None => Err(CallError::Malformed(
                "the server sent no grpc-status".into(),
            )),
        }
    };
    // The connection is driven beside the call; once it ends, the call ends
    // with the stream's error (or with what had arrived).
    let drive = async move {
        let _ = connection.await;
        std::future::pending::<std::convert::Infallible>().await
    };
    tokio::select! {
        answer = exchange => answer,
        never = drive => match never {},
    }
}

/// A request message as gRPC frames it: no compression, its length, the
/// protobuf.
fn request_frame(service: &str) -> Bytes {
    let message = prost::Message::encode_to_vec(&HealthCheckRequest {
        service: service.to_owned(),
    });
    let mut frame = BytesMut::with_capacity(5 + message.len());
    frame.put_u8(0);
    frame.put_u32(u32::try_from(message.len()).unwrap_or(u32::MAX));
    frame.extend_from_slice(&message);
    frame.freeze()
}

/// The serving status in a reply's body: exactly one uncompressed message.
fn read_reply(mut body: Bytes) -> Result<i32, CallError> {
    let malformed = |m: &str| Err(CallError::Malformed(m.to_owned()));
    if body.len() < 5 {
        return malformed("the reply holds no message");
    }
    let compressed = body.get_u8();
    let length = usize::try_from(body.get_u32()).unwrap_or(usize::MAX);
    if compressed != 0 {
        return malformed("a compressed reply, which was not asked for");
    }
    if length != body.len() {
        return malformed("the reply's length does not match its message");
    }
    match <HealthCheckResponse as prost::Message>::decode(body) {
        Ok(r) => Ok(r.status),
        Err(e) => Err(CallError::Malformed(format!(
            "the reply is not a HealthCheckResponse: {e}"
        ))),
    }
}

/// A gRPC status other than OK in `headers`, if it carries one.
fn grpc_status(headers: &http::HeaderMap) -> Result<Option<CallError>, CallError> {
    let Some(code) = headers.get("grpc-status") else {
        return Ok(None);
    };
    let code: u32 = code
        .to_str()
        .ok()
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| CallError::Malformed(format!("grpc-status {code:?} is not a code")))?;
    if code == 0 {
        return Ok(None);
    }
    let message = headers
        .get("grpc-message")
        .map(|m| {
            percent_encoding::percent_decode(m.as_bytes())
                .decode_utf8_lossy()
                .into_owned()
        })
        .unwrap_or_default();
    Ok(Some(CallError::Status { code, message }))
}

/// grpc-go's name of a status code.
fn code_name(code: u32) -> String {
    let name = match code {
        1 => "Canceled",
        2 => "Unknown",
        3 => "InvalidArgument",
        4 => "DeadlineExceeded",
        5 => "NotFound",
        6 => "AlreadyExists",
        7 => "PermissionDenied",
        8 => "ResourceExhausted",
        9 => "FailedPrecondition",
        10 => "Aborted",
        11 => "OutOfRange",
        12 => "Unimplemented",
        13 => "Internal",
        14 => "Unavailable",
        15 => "DataLoss",
        16 => "Unauthenticated",
        other => return format!("Code({other})"),
    };
    name.to_owned()
}

/// The protocol's name of a serving status.
fn serving_status_name(status: i32) -> String {
    match status {
        0 => "UNKNOWN".into(),
        1 => "SERVING".into(),
        2 => "NOT_SERVING".into(),
        3 => "SERVICE_UNKNOWN".into(),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A listener on a free loopback port.
    async fn listen() -> (tokio::net::TcpListener, u16) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let port = listener.local_addr().expect("addr").port();
        (listener, port)
    }

    /// A health server on loopback: each connection's one call gets `answer`
    /// for the service it names.
    async fn server(answer: fn(&str) -> Answer) -> u16 {
        let (listener, port) = listen().await;
        tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                tokio::spawn(serve(tcp, answer));
            }
        });
        port
    }

    enum Answer {
        Status(i32),
        /// A gRPC error in the headers, as grpc-go sends one (Trailers-Only).
        Error(u32, &'static str),
        /// These bytes as the reply's body.
        Body(Vec<u8>),
        /// Never any answer.
        Silence,
    }

    async fn serve<T>(io: T, answer: fn(&str) -> Answer)
    where
        T: AsyncRead + AsyncWrite + Unpin,
    {
        let Ok(mut connection) = h2::server::handshake(io).await else {
            return;
        };
        while let Some(Ok((request, mut respond))) = connection.accept().await {
            let (head, mut body) = request.into_parts();
            assert_eq!(head.uri.path(), CHECK_PATH);
            assert_eq!(head.headers["content-type"], "application/grpc");
            let mut frame = Vec::new();
            while let Some(Ok(chunk)) = body.data().await {
                frame.extend_from_slice(&chunk);
            }
            let asked =
                <HealthCheckRequest as prost::Message>::decode(&frame[5..]).expect("a request");
            let ok = http::Response::builder().header("content-type", "application/grpc");
            match answer(&asked.service) {
                Answer::Status(status) => {
                    let mut body = Vec::new();
                    let m = prost::Message::encode_to_vec(&HealthCheckResponse { status });
                    body.push(0);
                    body.extend_from_slice(&u32::try_from(m.len()).expect("short").to_be_bytes());
                    body.extend_from_slice(&m);
                    send(
                        respond.send_response(ok.body(()).expect("head"), false),
                        body,
                    );
                }
                Answer::Body(body) => {
                    send(
                        respond.send_response(ok.body(()).expect("head"), false),
                        body,
                    );
                }
                Answer::Error(code, message) => {
                    let head = ok
                        .header("grpc-status", code.to_string())
                        .header("grpc-message", message)
                        .body(())
                        .expect("head");
                    let _ = respond.send_response(head, true);
                }
                Answer::Silence => {
                    tokio::time::sleep(Duration::from_secs(60)).await;
                }
            }
        }
    }

    fn send(stream: Result<h2::SendStream<Bytes>, h2::Error>, body: Vec<u8>) {
        let mut stream = stream.expect("stream");
        stream.send_data(body.into(), false).expect("data");
        let mut trailers = http::HeaderMap::new();
        trailers.insert("grpc-status", http::HeaderValue::from_static("0"));
        stream.send_trailers(trailers).expect("trailers");
    }

    fn at(port: u16, service: &str) -> Target<'_> {
        Target {
            host: "127.0.0.1",
            netns: None,
            port,
            service,
            tls: false,
        }
    }

    #[tokio::test]
    async fn a_serving_answer_passes_and_any_other_fails_with_its_name() {
        let port = server(|service| match service {
            "" => Answer::Status(SERVING),
            "db" => Answer::Status(2),
            _ => Answer::Status(3),
        })
        .await;
        let second = Duration::from_secs(1);
        assert_eq!(check(&at(port, ""), second).await, Ok(()));
        assert_eq!(
            check(&at(port, "db"), second).await,
            Err("service unhealthy (responded with \"NOT_SERVING\")".into())
        );
        assert_eq!(
            check(&at(port, "cache"), second).await,
            Err("service unhealthy (responded with \"SERVICE_UNKNOWN\")".into())
        );
    }

    #[tokio::test]
    async fn a_server_without_the_health_service_is_named_as_the_kubelet_names_it() {
        let port = server(|_| Answer::Error(12, "unknown service grpc.health.v1.Health")).await;
        assert_eq!(
            check(&at(port, ""), Duration::from_secs(1)).await,
            Err("error: this server does not implement the grpc health protocol (grpc.health.v1.Health): unknown service grpc.health.v1.Health".into())
        );
        let port = server(|_| Answer::Error(5, "unknown%20service")).await;
        assert_eq!(
            check(&at(port, "x"), Duration::from_secs(1)).await,
            Err(
                "error: health rpc probe failed: rpc error: code = NotFound desc = unknown service"
                    .into()
            )
        );
    }

    #[test]
    fn a_reply_is_one_uncompressed_health_message_of_its_stated_length() {
        assert_eq!(
            read_reply(Bytes::from_static(&[0, 0, 0, 0, 2, 8, 1])),
            Ok(SERVING)
        );
        assert_eq!(read_reply(Bytes::from_static(&[0, 0, 0, 0, 0])), Ok(0));
        for (body, says) in [
            (&[0, 0, 0][..], "holds no message"),
            (&[1, 0, 0, 0, 2, 8, 1], "compressed"),
            (&[0, 0, 0, 0, 9, 8, 1], "length does not match"),
            (&[0, 0xff, 0xff, 0xff, 0xff, 8, 1], "length does not match"),
            (
                &[0, 0, 0, 0, 2, 8, 1, 0, 0, 0, 0, 0],
                "length does not match",
            ),
            (&[0, 0, 0, 0, 2, 0xff, 0xff], "not a HealthCheckResponse"),
        ] {
            let read = read_reply(Bytes::copy_from_slice(body));
            assert!(
                matches!(&read, Err(CallError::Malformed(m)) if m.contains(says)),
                "{body:?} read as {read:?}"
            );
        }
    }

    #[tokio::test]
    async fn what_is_not_a_health_answer_fails_the_probe() {
        let port = server(|_| Answer::Body(vec![0, 0, 0])).await;
        assert_eq!(
            check(&at(port, ""), Duration::from_secs(1)).await,
            Err("error: health rpc probe failed: rpc error: code = Internal desc = the reply holds no message".into())
        );
        let port = server(|_| Answer::Body(vec![0; REPLY_MAX + 1])).await;
        assert_eq!(
            check(&at(port, ""), Duration::from_secs(1)).await,
            Err("error: health rpc probe failed: rpc error: code = Internal desc = a reply of more than 16384 bytes".into())
        );
    }

    /// [`server`] over TLS with a self-signed certificate (no node trusts
    /// it), serving only a client that offers HTTP/2 by ALPN, as grpc-go does.
    async fn tls_server(answer: fn(&str) -> Answer) -> u16 {
        use rustls::pki_types::{PrivateKeyDer, PrivatePkcs8KeyDer};
        let ck = rcgen::generate_simple_self_signed(vec!["pod.example".to_owned()])
            .expect("a certificate");
        let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(ck.signing_key.serialize_der()));
        let mut config = rustls::ServerConfig::builder_with_provider(std::sync::Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .expect("versions")
        .with_no_client_auth()
        .with_single_cert(vec![ck.cert.der().clone()], key)
        .expect("config");
        config.alpn_protocols = vec![b"h2".to_vec()];
        let acceptor = tokio_rustls::TlsAcceptor::from(std::sync::Arc::new(config));
        let (listener, port) = listen().await;
        tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                let acceptor = acceptor.clone();
                tokio::spawn(async move {
                    let Ok(tls) = acceptor.accept(tcp).await else {
                        return;
                    };
                    if tls.get_ref().1.alpn_protocol() == Some(b"h2") {
                        serve(tls, answer).await;
                    }
                });
            }
        });
        port
    }

    #[tokio::test]
    async fn mode_tls_speaks_http2_over_tls_to_a_certificate_nobody_trusts() {
        let port = tls_server(|_| Answer::Status(SERVING)).await;
        let tls = Target {
            tls: true,
            ..at(port, "")
        };
        assert_eq!(check(&tls, Duration::from_secs(2)).await, Ok(()));
        // Plaintext against it fails, as the kubelet's does.
        let plain = check(&at(port, ""), Duration::from_secs(2)).await;
        assert!(plain.is_err(), "{plain:?}");
        // TLS against a plaintext server never connects.
        let port = server(|_| Answer::Status(SERVING)).await;
        let tls = Target {
            tls: true,
            ..at(port, "")
        };
        let refused = check(&tls, Duration::from_secs(1)).await;
        assert!(
            matches!(&refused, Err(m) if m.starts_with("timeout: failed to connect service")),
            "{refused:?}"
        );
    }

    #[tokio::test]
    async fn a_port_nobody_serves_fails_when_the_timeout_ends() {
        let unused = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let port = unused.local_addr().expect("addr").port();
        drop(unused);
        let started = std::time::Instant::now();
        let verdict = check(&at(port, ""), Duration::from_secs(1)).await;
        assert_eq!(
            verdict,
            Err(format!(
                "timeout: failed to connect service \"127.0.0.1:{port}\" within 1s: context deadline exceeded"
            ))
        );
        assert!(started.elapsed() >= Duration::from_millis(900));
    }

    #[tokio::test]
    async fn a_server_that_never_answers_fails_when_the_timeout_ends() {
        let port = server(|_| Answer::Silence).await;
        assert_eq!(
            check(&at(port, ""), Duration::from_secs(1)).await,
            Err("timeout: health rpc did not complete within 1s".into())
        );
    }
}
