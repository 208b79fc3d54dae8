//! The HTTP GET of httpGet probes and hooks, as the kubelet's prober makes it
//! (`pkg/probe/http` on Go's `net/http` client), through hyper's HTTP/1
//! client: the request is built from parts (an `http::Uri`, a header map),
//! never written by hand, so a tenant's path, host or header cannot add a
//! line or a request of its own. What Go's client refuses to send (control
//! characters in a host, a header name or value; here in a path as well) is
//! refused with its words and nothing is sent.
//!
//! As the kubelet's: `kube-probe/<major>.<minor>` as the user agent and
//! `Accept: */*` unless the action names them, the action's `Host` header as
//! the request's host, `Connection: close`, redirects followed on the same
//! host only (ten requests at most, with Go's `Referer`), a redirect
//! elsewhere ending it (a success the kubelet reports with a warning that
//! carries the start of its body), at most 10 KiB of a body read, and with
//! `scheme: HTTPS` TLS without verifying the server (`tls`).

use std::path::Path;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::time::Instant;

use super::dial::dial;

mod headers;
mod target;

use headers::Headers;
use target::{Target, has_scheme};

/// The user agent of every probe, as the kubelet's (`kube-probe/<major>.<minor>`).
pub(super) const USER_AGENT: &str = "kube-probe/1.37";

/// The user agent of a hook's request, as the kubelet's
/// (`kube-lifecycle/<major>.<minor>`).
pub(super) const HOOK_USER_AGENT: &str = "kube-lifecycle/1.37";

/// The most of a body read, as the kubelet's prober reads.
const BODY_MAX: usize = 10 << 10;

/// Go's client stops at the tenth request of a chain of redirects.
const MOST_REQUESTS: usize = 10;

/// What Go's client says when its timeout ends the request.
const TIMED_OUT: &str =
    "context deadline exceeded (Client.Timeout exceeded while awaiting headers)";

/// An httpGet action, as the shim is given it.
#[derive(Debug)]
pub(super) struct Get<'a> {
    pub(super) https: bool,
    pub(super) host: &'a str,
    pub(super) port: u16,
    pub(super) path: &'a str,
    pub(super) headers: &'a [(String, String)],
    /// [`USER_AGENT`] for a probe, [`HOOK_USER_AGENT`] for a hook, unless
    /// the action names one.
    pub(super) user_agent: &'a str,
}

/// What an HTTP GET of a probe or hook came to.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum HttpOutcome {
    /// The final status code, not a redirect's.
    Status(u16),
    /// A redirect that was not followed (to another host, without a
    /// `Location`, or a 3xx no client follows), with the start of its body.
    Redirected { body: String },
}

/// Why an HTTP GET gave no outcome.
#[derive(Debug, thiserror::Error)]
pub(super) enum HttpError {
    /// The action makes no request the kubelet's prober would send (its
    /// "probe errored and resulted in unknown state"); nothing was sent.
    #[error("{0}")]
    Unbuildable(String),
    /// The request failed, or Go's client would refuse to send it (then
    /// nothing was sent): `Get "<url>": <why>`.
    #[error("Get {url:?}: {why}")]
    Get { url: String, why: String },
    /// The answer came but its body could not be read (the kubelet's "probe
    /// errored and resulted in failure state").
    #[error("{0}")]
    Body(String),
}

/// An HTTP GET for probes and hooks, from inside the network namespace at
/// `netns` where the Pod has one, all of it within `timeout`.
pub(super) async fn http_get(
    get: &Get<'_>,
    netns: Option<&Path>,
    timeout: Duration,
) -> Result<HttpOutcome, HttpError> {
    let mut at = Target::first(get).map_err(HttpError::Unbuildable)?;
    let headers = Headers::of(get.headers, get.user_agent)
        .map_err(|why| HttpError::Get { url: at.url(), why })?;
    // The timeout is the tenant's number: a deadline past the clock's range
    // is a year away instead.
    let now = Instant::now();
    let deadline = now
        .checked_add(timeout)
        .unwrap_or(now + Duration::from_secs(365 * 86_400));
    let mut host = headers.host.clone().unwrap_or_else(|| at.authority.clone());
    let mut referer = None;
    for made in 1..=MOST_REQUESTS {
        let request = headers.request(&at, &host, referer.take());
        let reply =
            match tokio::time::timeout_at(deadline, exchange(&at, request, netns, timeout)).await {
                Ok(r) => r.map_err(|why| HttpError::Get { url: at.url(), why })?,
                Err(_) => {
                    return Err(HttpError::Get {
                        url: at.url(),
                        why: TIMED_OUT.into(),
                    });
                }
            };
        let follows = matches!(reply.code, 301 | 302 | 303 | 307 | 308);
        let location = reply.location.as_deref().filter(|_| follows);
        let Some(location) = location else {
            return outcome(reply);
        };
        let next = at.resolve(location).map_err(|why| HttpError::Get {
            url: at.url(),
            why: format!("failed to parse Location header {location:?}: {why}"),
        })?;
        // The kubelet's redirect check: another host ends the chain with
        // this answer, then Go's limit.
        if next.host != at.host {
            return outcome(reply);
        }
        if made >= MOST_REQUESTS {
            return Err(HttpError::Get {
                url: location.to_owned(),
                why: format!("stopped after {MOST_REQUESTS} redirects"),
            });
        }
        if next.scheme != "http" && next.scheme != "https" {
            return Err(HttpError::Get {
                url: next.url(),
                why: format!("unsupported protocol scheme {:?}", next.scheme),
            });
        }
        // Go keeps a Host the action named through a redirect whose
        // Location has no scheme (`//h/p` included): the previous request's.
        if headers.host.is_none() || has_scheme(location) {
            host = next.authority.clone();
        }
        referer = (!(at.scheme == "https" && next.scheme == "http")).then(|| at.url());
        at = next;
    }
    Err(HttpError::Get {
        url: at.url(),
        why: format!("stopped after {MOST_REQUESTS} redirects"),
    })
}

/// The outcome of the last answer of a chain.
fn outcome(reply: Reply) -> Result<HttpOutcome, HttpError> {
    let body = reply.body.map_err(HttpError::Body)?;
    if (300..400).contains(&reply.code) {
        return Ok(HttpOutcome::Redirected {
            body: String::from_utf8_lossy(&body).into_owned(),
        });
    }
    Ok(HttpOutcome::Status(reply.code))
}

/// The parts of an answer a probe uses.
struct Reply {
    code: u16,
    location: Option<String>,
    /// The start of its body (at most [`BODY_MAX`]), or why it could not be read.
    body: Result<Vec<u8>, String>,
}

/// One request on a connection of its own to `at`.
async fn exchange(
    at: &Target,
    request: Result<http::Request<Empty<Bytes>>, String>,
    netns: Option<&Path>,
    timeout: Duration,
) -> Result<Reply, String> {
    let request = request?;
    let tcp = dial(netns, &at.host, at.port, timeout)
        .await
        .map_err(|e| e.go_text(&at.host, at.port))?;
    if at.scheme == "https" {
        let tls = super::tls::connect(&at.host, tcp)
            .await
            .map_err(|e| e.to_string())?;
        send(EofEnds(tls), request).await
    } else {
        send(tcp, request).await
    }
}

/// Sends `request` over `io` with hyper's HTTP/1 client and reads the answer.
async fn send<T>(io: T, request: http::Request<Empty<Bytes>>) -> Result<Reply, String>
where
    T: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let (mut sender, conn) = hyper::client::conn::http1::Builder::new()
        // Names as Go writes them (`User-Agent`), which some servers expect.
        .title_case_headers(true)
        .handshake(TokioIo::new(io))
        .await
        .map_err(|e| hyper_text(&e))?;
    let work = async {
        let response = sender
            .send_request(request)
            .await
            .map_err(|e| hyper_text(&e))?;
        let code = response.status().as_u16();
        let location = response
            .headers()
            .get(http::header::LOCATION)
            .map(|l| String::from_utf8_lossy(l.as_bytes()).into_owned());
        let body = read_at_most(response.into_body(), BODY_MAX).await;
        Ok(Reply {
            code,
            location,
            body,
        })
    };
    // The connection is driven beside the exchange, in this task: nothing of
    // it outlives the probe. Once it ends, what it delivered is read.
    let mut conn = std::pin::pin!(conn);
    let mut work = std::pin::pin!(work);
    tokio::select! {
        r = &mut work => r,
        _ = &mut conn => work.await,
    }
}

/// The first `max` bytes of `body`.
async fn read_at_most(mut body: hyper::body::Incoming, max: usize) -> Result<Vec<u8>, String> {
    let mut out = Vec::new();
    while out.len() < max {
        match body.frame().await {
            None => break,
            Some(Err(e)) if cut_short(&e) => return Err("unexpected EOF".into()),
            Some(Err(e)) => return Err(hyper_text(&e)),
            Some(Ok(frame)) => {
                if let Ok(data) = frame.into_data() {
                    let room = max - out.len();
                    out.extend_from_slice(&data[..data.len().min(room)]);
                }
            }
        }
    }
    Ok(out)
}

/// A body that ended before its length: Go's `unexpected EOF`.
fn cut_short(e: &hyper::Error) -> bool {
    e.is_incomplete_message()
        || std::error::Error::source(e)
            .and_then(|c| c.downcast_ref::<std::io::Error>())
            .is_some_and(|io| io.kind() == std::io::ErrorKind::UnexpectedEof)
}

/// A hyper error with its cause, which its own words leave out.
fn hyper_text(e: &hyper::Error) -> String {
    if e.is_incomplete_message() {
        // Go's words for a connection closed before its answer.
        return "EOF".into();
    }
    match std::error::Error::source(e) {
        Some(cause) => format!("{e}: {cause}"),
        None => e.to_string(),
    }
}

/// A TLS stream where a peer that closes without its close_notify (as many
/// servers do after `Connection: close`) ends the stream, as Go's client
/// takes it.
struct EofEnds<S>(S);

impl<S: AsyncRead + Unpin> AsyncRead for EofEnds<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        match Pin::new(&mut self.0).poll_read(cx, buf) {
            Poll::Ready(Err(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                Poll::Ready(Ok(()))
            }
            other => other,
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for EofEnds<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)] // a failed unwrap is a failed test
    use super::target::request_target;

    use std::sync::{Arc, Mutex};

    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    const SECOND: Duration = Duration::from_secs(1);

    fn get<'a>(port: u16, path: &'a str, headers: &'a [(String, String)]) -> Get<'a> {
        Get {
            https: false,
            host: "127.0.0.1",
            port,
            path,
            headers,
            user_agent: USER_AGENT,
        }
    }

    fn headers(h: &[(&str, &str)]) -> Vec<(String, String)> {
        h.iter()
            .map(|(n, v)| ((*n).to_owned(), (*v).to_owned()))
            .collect()
    }

    /// A listener no request may reach: whether anything connected to it.
    struct Untouched(std::net::TcpListener);

    impl Untouched {
        fn new() -> (Self, u16) {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.set_nonblocking(true).unwrap();
            let port = l.local_addr().unwrap().port();
            (Self(l), port)
        }

        fn reached(&self) -> bool {
            self.0.accept().is_ok()
        }
    }

    /// What a server got: every request's head, as it came.
    type Seen = Arc<Mutex<Vec<String>>>;

    /// A server on loopback that answers each request with what `answer`
    /// makes of its target and the server's port; what it got is kept.
    async fn server(answer: fn(&str, u16) -> String) -> (u16, Seen) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let seen: Seen = Arc::default();
        let kept = Arc::clone(&seen);
        tokio::spawn(async move {
            loop {
                let Ok((mut c, _)) = listener.accept().await else {
                    return;
                };
                let kept = Arc::clone(&kept);
                tokio::spawn(async move {
                    let mut head = Vec::new();
                    let mut buf = [0u8; 4096];
                    while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 1 << 16 {
                        match c.read(&mut buf).await {
                            Ok(0) | Err(_) => break,
                            Ok(n) => head.extend_from_slice(&buf[..n]),
                        }
                    }
                    let head = String::from_utf8_lossy(&head).into_owned();
                    let target = head.split(' ').nth(1).unwrap_or_default().to_owned();
                    kept.lock().unwrap().push(head);
                    let _ = c.write_all(answer(&target, port).as_bytes()).await;
                    let _ = c.shutdown().await;
                });
            }
        });
        (port, seen)
    }

    fn ok(_: &str, _: u16) -> String {
        "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok".into()
    }

    /// Finding 2 of issue 51: CR LF in a path wrote a second request, with a
    /// body, to any loopback service. Every control character in a path is
    /// refused, with the words of the kubelet's URL parser, and nothing
    /// reaches the server.
    #[tokio::test]
    async fn a_control_character_in_a_path_is_refused_and_nothing_is_sent() {
        let (listener, port) = Untouched::new();
        let smuggled =
            "/x HTTP/1.1\r\nHost: a\r\n\r\nPOST /apis HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}";
        for path in [smuggled, "/x\n", "/x\r", "/x\0", "/x\x1b", "/x\x7f", "/x\t"] {
            let e = http_get(&get(port, path, &[]), None, SECOND)
                .await
                .unwrap_err();
            assert!(matches!(e, HttpError::Unbuildable(_)), "{path:?}: {e:?}");
            assert_eq!(
                e.to_string(),
                format!("parse {path:?}: net/url: invalid control character in URL")
            );
        }
        assert!(!listener.reached(), "a request went out");
    }

    /// A header name or value with control characters (a tab aside, as Go
    /// allows), the `Host` header's included, is refused with the words of
    /// Go's client, and nothing reaches the server.
    #[tokio::test]
    async fn a_control_character_in_a_header_is_refused_and_nothing_is_sent() {
        let (listener, port) = Untouched::new();
        let url = format!("http://127.0.0.1:{port}/x");
        let cases = [
            (
                headers(&[("x-a", "v\r\nX-Evil: 1")]),
                "net/http: invalid header field value for \"X-A\"",
            ),
            (
                headers(&[("X-A", "v\0")]),
                "net/http: invalid header field value for \"X-A\"",
            ),
            (
                headers(&[("X-A", "v\x7f")]),
                "net/http: invalid header field value for \"X-A\"",
            ),
            (
                headers(&[("X\r\nA", "v")]),
                "net/http: invalid header field name \"X\\r\\nA\"",
            ),
            (
                headers(&[("X A", "v")]),
                "net/http: invalid header field name \"X A\"",
            ),
            (
                headers(&[("Host", "a\r\n\r\nGET /admin HTTP/1.1")]),
                "net/http: invalid header field value for \"Host\"",
            ),
        ];
        for (given, words) in &cases {
            let e = http_get(&get(port, "/x", given), None, SECOND)
                .await
                .unwrap_err();
            assert_eq!(e.to_string(), format!("Get {url:?}: {words}"), "{given:?}");
        }
        assert!(!listener.reached(), "a request went out");
    }

    /// A host with control characters (or anything else a URL's host cannot
    /// hold) is refused as the kubelet's request building refuses it, and
    /// nothing is dialled.
    #[tokio::test]
    async fn a_control_character_in_a_host_is_refused_and_nothing_is_sent() {
        let (listener, port) = Untouched::new();
        for (host, words) in [
            (
                "127.0.0.1\r\nX-Evil",
                format!(
                    "parse \"http://127.0.0.1%0D%0AX-Evil:{port}/x\": invalid URL escape \"%0D\""
                ),
            ),
            (
                "127.0.0.1\0",
                format!("parse \"http://127.0.0.1%00:{port}/x\": invalid URL escape \"%00\""),
            ),
            (
                "127.0.0.1/x",
                format!("parse \"http://127.0.0.1%2Fx:{port}/x\": invalid URL escape \"%2F\""),
            ),
            (
                "a b",
                format!("parse \"http://a%20b:{port}/x\": invalid URL escape \"%20\""),
            ),
        ] {
            let mut g = get(port, "/x", &[]);
            g.host = host;
            let e = http_get(&g, None, SECOND).await.unwrap_err();
            assert!(matches!(e, HttpError::Unbuildable(_)), "{host:?}: {e:?}");
            assert_eq!(e.to_string(), words);
        }
        assert!(!listener.reached(), "a request went out");
    }

    /// The request goes out as Go's client writes the kubelet's: `Host`,
    /// the kubelet's user agent, the rest by name, `Connection: close`, no
    /// body and no length.
    #[tokio::test]
    async fn the_request_is_the_kubelets() {
        let (port, seen) = server(ok).await;
        let given = headers(&[("x-custom-id", "a\tb"), ("Authorization", "Bearer t")]);
        let got = http_get(&get(port, "/a b?c=d e#frag", &given), None, SECOND)
            .await
            .unwrap();
        assert_eq!(got, HttpOutcome::Status(200));
        assert_eq!(
            seen.lock().unwrap().as_slice(),
            [format!(
                "GET /a%20b?c=d%20e HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\
                 User-Agent: kube-probe/1.37\r\nAccept: */*\r\nAuthorization: Bearer t\r\n\
                 X-Custom-Id: a\tb\r\nConnection: close\r\n\r\n"
            )]
        );
    }

    /// The action's own `Host`, `User-Agent` and `Accept` replace the
    /// kubelet's; an empty `Accept` sends none; a `Content-Length` is never
    /// the action's to send.
    #[tokio::test]
    async fn the_actions_own_host_agent_and_accept_are_sent() {
        let (port, seen) = server(ok).await;
        let given = headers(&[
            ("host", "pod.example:8443"),
            ("User-Agent", "mine/1"),
            ("Accept", ""),
            ("Content-Length", "5"),
        ]);
        http_get(&get(port, "healthz", &given), None, SECOND)
            .await
            .unwrap();
        let given = headers(&[("Host", "bad host/"), ("Accept", "text/plain")]);
        http_get(&get(port, "/", &given), None, SECOND)
            .await
            .unwrap();
        assert_eq!(
            seen.lock().unwrap().as_slice(),
            [
                "GET /healthz HTTP/1.1\r\nHost: pod.example:8443\r\nUser-Agent: mine/1\r\n\
                 Connection: close\r\n\r\n"
                    .to_owned(),
                // Go sends an empty Host for one that is no host.
                "GET / HTTP/1.1\r\nHost: \r\nUser-Agent: kube-probe/1.37\r\n\
                 Accept: text/plain\r\nConnection: close\r\n\r\n"
                    .to_owned(),
            ]
        );
    }

    #[test]
    fn a_path_is_the_request_target_the_kubelet_sends() {
        for (path, target) in [
            ("/healthz", "/healthz"),
            ("healthz", "/healthz"),
            ("", "/"),
            ("/a b", "/a%20b"),
            ("/x?a=1&b=2", "/x?a=1&b=2"),
            ("/x#frag", "/x"),
            ("/a%2Fb", "/a%2Fb"),
            ("/é", "/%C3%A9"),
            ("/{json}", "/%7Bjson%7D"),
            ("http://elsewhere:9/x?y", "/x?y"),
            ("//elsewhere/x", "/x"),
            ("%zz?x", "/%25zz%3Fx"),
            ("?q", "/?q"),
        ] {
            assert_eq!(request_target(path).as_deref(), Ok(target), "{path:?}");
        }
    }

    fn redirect(to: &str) -> String {
        let body = format!("<a href=\"{to}\">Found</a>.");
        format!(
            "HTTP/1.1 302 Found\r\nLocation: {to}\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
    }

    /// Redirects on the same host are followed (relative, absolute, to
    /// another port), each request naming the last as its `Referer`; one
    /// elsewhere ends the chain with the start of its body.
    #[tokio::test]
    async fn redirects_are_followed_on_the_same_host_only() {
        fn answer(target: &str, port: u16) -> String {
            match target {
                "/start" => redirect("next"),
                "/next" => redirect(&format!("http://127.0.0.1:{port}/last?x=1")),
                "/last?x=1" => ok(target, port),
                "/away" => redirect("http://0.0.0.0/"),
                _ => "HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n".into(),
            }
        }
        let (port, seen) = server(answer).await;
        let got = http_get(&get(port, "/start", &[]), None, SECOND)
            .await
            .unwrap();
        assert_eq!(got, HttpOutcome::Status(200));
        {
            let seen = seen.lock().unwrap();
            assert_eq!(seen.len(), 3, "{seen:?}");
            assert!(seen[1].starts_with("GET /next HTTP/1.1\r\n"), "{seen:?}");
            assert!(
                seen[1].contains(&format!("\r\nReferer: http://127.0.0.1:{port}/start\r\n")),
                "{seen:?}"
            );
            assert!(
                seen[2].starts_with("GET /last?x=1 HTTP/1.1\r\n"),
                "{seen:?}"
            );
        }
        let got = http_get(&get(port, "/away", &[]), None, SECOND)
            .await
            .unwrap();
        assert_eq!(
            got,
            HttpOutcome::Redirected {
                body: "<a href=\"http://0.0.0.0/\">Found</a>.".into()
            }
        );
        assert_eq!(
            seen.lock().unwrap().len(),
            4,
            "the redirect elsewhere was followed"
        );
        let got = http_get(&get(port, "/missing", &[]), None, SECOND)
            .await
            .unwrap();
        assert_eq!(got, HttpOutcome::Status(404));
    }

    /// Go's client makes ten requests of a chain at most.
    #[tokio::test]
    async fn a_chain_of_redirects_stops_after_ten() {
        fn answer(target: &str, _: u16) -> String {
            let n: u32 = target.trim_start_matches('/').parse().unwrap_or(0);
            redirect(&format!("/{}", n + 1))
        }
        let (port, seen) = server(answer).await;
        let e = http_get(&get(port, "/0", &[]), None, SECOND)
            .await
            .unwrap_err();
        assert_eq!(e.to_string(), "Get \"/10\": stopped after 10 redirects");
        assert_eq!(seen.lock().unwrap().len(), 10);
    }

    /// At most 10 KiB of a redirect's body is kept, and a body cut short
    /// fails as the kubelet's reading fails.
    #[tokio::test]
    async fn a_body_is_read_to_10_kib_at_most() {
        fn answer(target: &str, _: u16) -> String {
            match target {
                "/big" => {
                    let body = "y".repeat(1 << 20);
                    format!(
                        "HTTP/1.1 302 Found\r\nLocation: http://elsewhere/\r\nContent-Length: {}\r\n\r\n{body}",
                        body.len()
                    )
                }
                // Shorter than it says.
                _ => "HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nshort".into(),
            }
        }
        let (port, _) = server(answer).await;
        let got = http_get(&get(port, "/big", &[]), None, SECOND)
            .await
            .unwrap();
        assert_eq!(
            got,
            HttpOutcome::Redirected {
                body: "y".repeat(10 << 10)
            }
        );
        let e = http_get(&get(port, "/short", &[]), None, SECOND)
            .await
            .unwrap_err();
        assert!(
            matches!(&e, HttpError::Body(w) if w == "unexpected EOF"),
            "{e:?}"
        );
    }

    /// A server that never answers fails the GET when its timeout ends, in
    /// Go's client's words.
    #[tokio::test]
    async fn a_silent_server_fails_when_the_timeout_ends() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((c, _)) = listener.accept().await {
                held.push(c);
            }
        });
        let e = http_get(&get(port, "/x", &[]), None, Duration::from_millis(300))
            .await
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            format!(
                "Get \"http://127.0.0.1:{port}/x\": context deadline exceeded \
                 (Client.Timeout exceeded while awaiting headers)"
            )
        );
        let (_closed, port) = Untouched::new();
        drop(_closed);
        let e = http_get(&get(port, "/x", &[]), None, SECOND)
            .await
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            format!(
                "Get \"http://127.0.0.1:{port}/x\": dial tcp 127.0.0.1:{port}: connect: connection refused"
            )
        );
    }

    /// A TLS server on loopback with a self-signed certificate (no node
    /// would trust it), closing without its close_notify, answering with no
    /// length: the body ends with the connection.
    async fn self_signed_https_server() -> u16 {
        use rustls_pki_types::{PrivateKeyDer, PrivatePkcs8KeyDer};
        let ck = rcgen::generate_simple_self_signed(vec!["pod.example".to_owned()]).unwrap();
        let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(ck.signing_key.serialize_der()));
        let config = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(vec![ck.cert.der().clone()], key)
        .unwrap();
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        tokio::spawn(async move {
            while let Ok((c, _)) = listener.accept().await {
                let acceptor = acceptor.clone();
                tokio::spawn(async move {
                    let Ok(mut tls) = acceptor.accept(c).await else {
                        return;
                    };
                    let mut buf = [0u8; 2048];
                    let _ = tls.read(&mut buf).await;
                    let _ = tls
                        .write_all(b"HTTP/1.1 302 Found\r\nConnection: close\r\n\r\nmoved")
                        .await;
                    let _ = tls.flush().await;
                    // No close_notify: the TCP connection just ends.
                    let (tcp, _) = tls.into_inner();
                    drop(tcp);
                });
            }
        });
        port
    }

    /// `scheme: HTTPS` skips verifying the certificate; a server that does
    /// not speak TLS fails.
    #[tokio::test]
    async fn https_skips_verifying_and_needs_tls() {
        let port = self_signed_https_server().await;
        let mut g = get(port, "/ready", &[]);
        g.https = true;
        let got = http_get(&g, None, Duration::from_secs(5)).await.unwrap();
        assert_eq!(
            got,
            HttpOutcome::Redirected {
                body: "moved".into()
            }
        );
        let (plain, _) = server(ok).await;
        g.port = plain;
        let e = http_get(&g, None, Duration::from_secs(5))
            .await
            .unwrap_err();
        assert!(
            e.to_string()
                .starts_with(&format!("Get \"https://127.0.0.1:{plain}/ready\": ")),
            "{e}"
        );
    }

    #[test]
    fn a_location_resolves_against_the_current_url() {
        let at = Target::first(&get(8080, "/a/b?q", &[])).unwrap();
        let to = |l: &str| at.resolve(l).map(|t| (t.scheme, t.host, t.port, t.target));
        let ok = |s: &str, h: &str, p: u16, t: &str| Ok((s.into(), h.into(), p, t.into()));
        assert_eq!(to("/healthz"), ok("http", "127.0.0.1", 8080, "/healthz"));
        assert_eq!(to("c"), ok("http", "127.0.0.1", 8080, "/a/c"));
        assert_eq!(to("../c?d"), ok("http", "127.0.0.1", 8080, "/c?d"));
        assert_eq!(to("?z"), ok("http", "127.0.0.1", 8080, "/a/b?z"));
        assert_eq!(
            to("https://127.0.0.1:9090/x?y=1"),
            ok("https", "127.0.0.1", 9090, "/x?y=1")
        );
        assert_eq!(to("http://127.0.0.1"), ok("http", "127.0.0.1", 80, "/"));
        assert_eq!(to("//[::1]:7/x"), ok("http", "::1", 7, "/x"));
        assert_eq!(to("HTTP://0.0.0.0/h"), ok("http", "0.0.0.0", 80, "/h"));
        assert_eq!(to("ftp://10.0.0.5/").map(|t| t.0), Ok("ftp".into()));
        assert_eq!(
            to("http://127.0.0.1:notaport/"),
            Err("invalid port \":notaport\" after host".into())
        );
        assert_eq!(to("mailto:x").map(|t| t.1), Ok(String::new()));
    }

    /// Finding 6 of issue 51: with the Pod's namespace, `127.0.0.1` is the
    /// Pod's loopback: the GET reaches the server inside it and not the one
    /// on the host's loopback at the same port. Root only.
    #[tokio::test]
    async fn a_get_from_a_pod_namespace_reaches_the_pods_loopback() {
        let host_side = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        host_side.set_nonblocking(true).unwrap();
        let port = host_side.local_addr().unwrap().port();
        let Some((_ns, path, inside)) = super::super::dial::tests::namespace_with_listener(port)
        else {
            return;
        };
        let served = std::thread::spawn(move || {
            super::super::dial::tests::answer_one(
                &inside,
                Duration::from_secs(5),
                b"HTTP/1.1 204 No Content\r\n\r\n",
            )
        });
        let got = http_get(&get(port, "/", &[]), Some(&path), Duration::from_secs(5))
            .await
            .unwrap();
        assert_eq!(got, HttpOutcome::Status(204));
        assert!(served.join().unwrap());
        assert!(
            host_side.accept().is_err(),
            "the host's loopback was reached"
        );
    }
}
