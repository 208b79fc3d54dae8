//! The kubelet API's connections: the accept loop (a cap on open connections,
//! and a smaller one per client address so one peer cannot take them all;
//! back-off on accept errors; both logged at a bounded rate) and HTTP serving
//! with a header timeout and an idle timeout, as the kubelet's Go server has
//! read and idle timeouts. A request in flight (a long response such as
//! `logs -f`) and an upgraded stream (exec, attach, port-forward) are never cut.
//!
//! A client that offers `h2` in ALPN gets HTTP/2, as from the kubelet's Go
//! server (the apiserver's transport does, for logs and stats); upgrades
//! (exec, attach, port-forward) come on HTTP/1.1, which their clients ask for.

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use hyper::body::{Frame, Incoming, SizeHint};
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};
use tokio::time::Instant;
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use super::Body;

/// `--kubelet-api-max-connections` when unset: far more than the API server
/// and scrapers open, and well under the usual 1024 descriptors, so a flood
/// cannot take the descriptors that reconciles and the provider need.
pub const DEFAULT_MAX_CONNECTIONS: usize = 512;

/// `--kubelet-api-max-connections-per-peer` when unset: a quarter of the
/// slots (at least one), so one peer flooding the port leaves three quarters
/// to the others, while the API server, which opens one connection per exec,
/// attach and port-forward stream, still gets many.
pub fn default_per_peer(max_connections: usize) -> usize {
    (max_connections / 4).max(1)
}
/// `--kubelet-api-header-timeout` when unset (hyper's default; the API server uses 32 s).
pub const DEFAULT_HEADER_TIMEOUT: Duration = Duration::from_secs(30);
/// `--kubelet-api-idle-timeout` when unset: the kubelet's, and the API
/// server's idle timeout for its connections to kubelets.
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(90);
/// Time for the TLS handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// The first wait after a failed accept; it doubles up to [`MAX_BACKOFF`].
const MIN_BACKOFF: Duration = Duration::from_millis(10);
const MAX_BACKOFF: Duration = Duration::from_secs(1);
/// At most one log line per this period for each kind of trouble.
const LOG_PERIOD: Duration = Duration::from_secs(10);
/// Streams one HTTP/2 connection may have open at once (Go's default, which
/// the kubelet serves with).
const MAX_CONCURRENT_STREAMS: u32 = 250;

/// Bounds on the kubelet API's connections.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Connections open at once, TLS handshakes included; more are closed at accept.
    pub max_connections: usize,
    /// Of those, the most one client address may hold.
    pub max_connections_per_peer: usize,
    /// Time for the TLS handshake.
    pub handshake_timeout: Duration,
    /// Time to send a whole request head: from the handshake for the first
    /// request, from its first byte for the next ones.
    pub header_timeout: Duration,
    /// Time a connection with no request in flight may wait for the next one.
    pub idle_timeout: Duration,
    /// Time an upgraded stream (exec, attach, port-forward) may move nothing.
    pub stream_idle_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_connections: DEFAULT_MAX_CONNECTIONS,
            max_connections_per_peer: default_per_peer(DEFAULT_MAX_CONNECTIONS),
            handshake_timeout: HANDSHAKE_TIMEOUT,
            header_timeout: DEFAULT_HEADER_TIMEOUT,
            idle_timeout: DEFAULT_IDLE_TIMEOUT,
            stream_idle_timeout: super::idle::DEFAULT_STREAM_IDLE_TIMEOUT,
        }
    }
}

/// Where connections come from: a [`TcpListener`], or a fake in tests.
pub(crate) trait Accept: Send {
    type Conn: Send + 'static;
    fn accept(&mut self) -> impl Future<Output = io::Result<(Self::Conn, SocketAddr)>> + Send;
}

impl Accept for TcpListener {
    type Conn = TcpStream;
    async fn accept(&mut self) -> io::Result<(TcpStream, SocketAddr)> {
        TcpListener::accept(self).await
    }
}

/// The wait after an accept error: MIN_BACKOFF, doubling up to MAX_BACKOFF.
pub(crate) fn next_backoff(prev: Option<Duration>) -> Duration {
    prev.map_or(MIN_BACKOFF, |d| d.saturating_mul(2).min(MAX_BACKOFF))
}

/// Lets one log line through per period and counts the events in between.
#[derive(Debug)]
pub(crate) struct Throttle {
    period: Duration,
    last: Option<Instant>,
    held: u64,
}

impl Throttle {
    pub(crate) fn new(period: Duration) -> Self {
        Self {
            period,
            last: None,
            held: 0,
        }
    }

    /// Counts an event; `Some(events since the last line, this one included)`
    /// when a line is due.
    pub(crate) fn hit(&mut self, now: Instant) -> Option<u64> {
        self.held = self.held.saturating_add(1);
        if self
            .last
            .is_some_and(|last| now.saturating_duration_since(last) < self.period)
        {
            return None;
        }
        self.last = Some(now);
        Some(std::mem::take(&mut self.held))
    }
}

/// Why a connection was closed as soon as it was accepted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Refused {
    /// Every slot is taken.
    Limit,
    /// Its peer address holds its share of the slots.
    PeerLimit,
}

impl Refused {
    /// The `reason` label of `vkd_kubelet_api_connections_refused_total`.
    pub(crate) fn label(self) -> &'static str {
        match self {
            Self::Limit => "limit",
            Self::PeerLimit => "peer_limit",
        }
    }
}

/// Open connections per peer address.
type PeerCounts = Arc<Mutex<HashMap<IpAddr, usize>>>;

/// The kubelet API's connection slots: `max_connections` in all, of which one
/// peer address holds at most `max_connections_per_peer`.
#[derive(Debug)]
pub(crate) struct Slots {
    // Semaphore::new panics past MAX_PERMITS (about 2^61): far beyond any fd limit.
    total: Arc<Semaphore>,
    per_peer: PeerCounts,
    max_per_peer: usize,
}

/// One connection's slot: freed, in all and for its peer, when dropped.
#[derive(Debug)]
pub(crate) struct Slot {
    _total: OwnedSemaphorePermit,
    peer: IpAddr,
    per_peer: PeerCounts,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut counts = self.per_peer.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(n) = counts.get_mut(&self.peer) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                counts.remove(&self.peer);
            }
        }
    }
}

impl Slots {
    pub(crate) fn new(limits: &Limits) -> Self {
        Self {
            total: Arc::new(Semaphore::new(
                limits.max_connections.min(Semaphore::MAX_PERMITS),
            )),
            per_peer: Arc::default(),
            max_per_peer: limits.max_connections_per_peer.max(1),
        }
    }

    /// A slot for a connection from `peer`, unless all are taken or `peer`
    /// holds its share. An IPv4 peer seen through an IPv6 socket counts as itself.
    pub(crate) fn try_acquire(&self, peer: IpAddr) -> Result<Slot, Refused> {
        let peer = peer.to_canonical();
        let mut counts = self.per_peer.lock().unwrap_or_else(PoisonError::into_inner);
        let held = counts.get(&peer).copied().unwrap_or(0);
        if held >= self.max_per_peer {
            return Err(Refused::PeerLimit);
        }
        let total = Arc::clone(&self.total)
            .try_acquire_owned()
            .map_err(|_| Refused::Limit)?;
        counts.insert(peer, held.saturating_add(1));
        Ok(Slot {
            _total: total,
            peer,
            per_peer: Arc::clone(&self.per_peer),
        })
    }

    /// Slots free in all.
    #[cfg(test)]
    fn available(&self) -> usize {
        self.total.available_permits()
    }
}

/// Accepts until shutdown, handing each connection with its slot to `serve`.
/// Past `limits.max_connections`, or past `limits.max_connections_per_peer`
/// from one address, a connection is closed at once and `refused` told why
/// (the slot is what bounds descriptors; the share per peer keeps one Pod
/// flooding the port from taking what the API server needs for `kubectl
/// exec`); accept errors (EMFILE above all) are retried after a growing
/// pause, not at once, so a full descriptor table cannot spin the loop.
pub(crate) async fn accept_loop<L, F, R>(
    mut listener: L,
    limits: Limits,
    shutdown: CancellationToken,
    mut serve: F,
    mut refused: R,
) where
    L: Accept,
    F: FnMut(L::Conn, SocketAddr, Slot),
    R: FnMut(Refused),
{
    let slots = Slots::new(&limits);
    let mut backoff: Option<Duration> = None;
    let mut failures = Throttle::new(LOG_PERIOD);
    let mut at_limit = Throttle::new(LOG_PERIOD);
    let mut at_peer_limit = Throttle::new(LOG_PERIOD);
    loop {
        let accepted = tokio::select! {
            biased;
            _ = shutdown.cancelled() => return,
            a = listener.accept() => a,
        };
        match accepted {
            Ok((conn, peer)) => {
                backoff = None;
                match slots.try_acquire(peer.ip()) {
                    Ok(slot) => serve(conn, peer, slot),
                    Err(why) => {
                        drop(conn);
                        refused(why);
                        match why {
                            Refused::Limit => {
                                if let Some(n) = at_limit.hit(Instant::now()) {
                                    warn!(%peer, refused = n, max_connections = limits.max_connections,
                                        "kubelet API at its connection limit, closing new connections");
                                }
                            }
                            Refused::PeerLimit => {
                                if let Some(n) = at_peer_limit.hit(Instant::now()) {
                                    warn!(%peer, refused = n,
                                        max_connections_per_peer = limits.max_connections_per_peer,
                                        "a kubelet API peer holds its share of the connections, \
                                         closing its new ones");
                                }
                            }
                        }
                    }
                }
            }
            Err(e) => {
                let wait = next_backoff(backoff);
                backoff = Some(wait);
                if let Some(n) = failures.hit(Instant::now()) {
                    warn!(error = %e, failures = n, retry_in = ?wait, "kubelet API accept failed");
                }
                tokio::select! {
                    biased;
                    _ = shutdown.cancelled() => return,
                    _ = tokio::time::sleep(wait) => {}
                }
            }
        }
    }
}

/// What a connection is doing, for its timers.
#[derive(Clone, Copy, Debug, Default)]
struct Activity {
    /// Requests whose response has not been sent whole.
    in_flight: usize,
    /// Bytes of the next request head arrived (or the connection is new).
    head_started: bool,
}

type Tracker = Arc<watch::Sender<Activity>>;

/// The connection's stream, holding its slot (upgraded streams keep it too)
/// and telling the timers when a request starts to arrive.
#[derive(Debug)]
struct Tracked<IO> {
    io: IO,
    tracker: Tracker,
    /// When bytes last moved; stops the stream once upgraded and idle.
    clock: super::idle::Clock,
    /// Bytes read between requests start a request head (HTTP/1). Over
    /// HTTP/2 they may be pings and settings: only a request counts.
    heads: bool,
    _slot: Slot,
}

impl<IO: AsyncRead + Unpin> AsyncRead for Tracked<IO> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if let Some(e) = this.clock.poll_stopped(cx) {
            return Poll::Ready(Err(e));
        }
        let before = buf.filled().len();
        let r = Pin::new(&mut this.io).poll_read(cx, buf);
        if matches!(r, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            this.clock.wind();
        }
        if this.heads && matches!(r, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            this.tracker.send_if_modified(|a| {
                let starts = a.in_flight == 0 && !a.head_started;
                a.head_started |= starts;
                starts
            });
        }
        r
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for Tracked<IO> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if let Some(e) = this.clock.poll_stopped(cx) {
            return Poll::Ready(Err(e));
        }
        let r = Pin::new(&mut this.io).poll_write(cx, buf);
        if matches!(r, Poll::Ready(Ok(1..))) {
            this.clock.wind();
        }
        r
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if let Some(e) = this.clock.poll_stopped(cx) {
            return Poll::Ready(Err(e));
        }
        let r = Pin::new(&mut this.io).poll_write_vectored(cx, bufs);
        if matches!(r, Poll::Ready(Ok(1..))) {
            this.clock.wind();
        }
        r
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }
}

/// A request in flight, from its head until hyper drops its response body.
#[derive(Debug)]
struct InFlight(Tracker);

impl InFlight {
    fn start(tracker: &Tracker) -> Self {
        tracker.send_modify(|a| {
            a.in_flight = a.in_flight.saturating_add(1);
            a.head_started = false;
        });
        Self(Arc::clone(tracker))
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0
            .send_modify(|a| a.in_flight = a.in_flight.saturating_sub(1));
    }
}

/// A response body that keeps its request in flight while it is sent, and
/// never ends in the same write as its last data.
///
/// hyper writes the last chunk of a body and its end (HTTP/1's terminating
/// chunk) together when the end follows at once, in one TLS record. Go's
/// HTTP/1 client then returns that data together with EOF, and readers that
/// stop at EOF without using the data lose it: the apiserver's WebSocket log
/// streamer is one, and `kubectl logs` over WebSocket came back empty. So
/// after data the end waits one turn, in which the connection flushes.
struct Tracking {
    body: Body,
    _request: InFlight,
    /// The last frame handed out was data, with no wait since.
    after_data: bool,
    /// The body has ended; the connection is told on the next poll.
    ended: bool,
}

impl Tracking {
    fn new(body: Body, request: InFlight) -> Self {
        Self {
            body,
            _request: request,
            after_data: false,
            ended: false,
        }
    }
}

impl hyper::body::Body for Tracking {
    type Data = Bytes;
    type Error = io::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, io::Error>>> {
        let this = self.get_mut();
        if this.ended {
            return Poll::Ready(None);
        }
        match Pin::new(&mut this.body).poll_frame(cx) {
            Poll::Ready(None) if this.after_data => {
                this.ended = true;
                // hyper flushes what it has while the body is pending.
                cx.waker().wake_by_ref();
                Poll::Pending
            }
            Poll::Ready(Some(Ok(frame))) => {
                this.after_data = frame.is_data();
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Pending => {
                this.after_data = false;
                Poll::Pending
            }
            other => other,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.ended || self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// Resolves when the connection waited too long for a request head: the
/// header timeout once one started (or on a new connection), the idle timeout
/// before. Never while a request is in flight.
async fn expiry(mut activity: watch::Receiver<Activity>, limits: Limits) -> &'static str {
    loop {
        let now = *activity.borrow_and_update();
        let (wait, why) = match now {
            Activity { in_flight: 1.., .. } => {
                if activity.changed().await.is_err() {
                    std::future::pending::<()>().await;
                }
                continue;
            }
            Activity {
                head_started: true, ..
            } => (limits.header_timeout, "header timeout"),
            _ => (limits.idle_timeout, "idle timeout"),
        };
        tokio::select! {
            _ = tokio::time::sleep(wait) => return why,
            changed = activity.changed() => if changed.is_err() {
                std::future::pending::<()>().await;
            },
        }
    }
}

/// TCP keepalive, as the kubelet's Go server sets it: a peer that vanished
/// (a node rebooted, a NAT forgot the flow) is found in about a minute
/// instead of holding a stream until the idle timeout.
fn keep_alive(tcp: &TcpStream) {
    let every = Duration::from_secs(15);
    let keepalive = socket2::TcpKeepalive::new()
        .with_time(every)
        .with_interval(every);
    if let Err(e) = socket2::SockRef::from(tcp).set_tcp_keepalive(&keepalive) {
        debug!(error = %e, "TCP keepalive not set");
    }
}

/// Serves one kubelet API connection: the TLS handshake within its limit,
/// then HTTP/2 if the client chose it in ALPN, else HTTP/1, with the service
/// `service` makes from the TLS session.
pub(crate) async fn serve_tls<M, S, Fut>(
    acceptor: TlsAcceptor,
    tcp: TcpStream,
    peer: SocketAddr,
    slot: Slot,
    limits: Limits,
    shutdown: CancellationToken,
    service: M,
) where
    M: FnOnce(&rustls::ServerConnection) -> S,
    S: Fn(Request<Incoming>) -> Fut + Send + 'static,
    Fut: Future<Output = Response<Body>> + Send + 'static,
{
    keep_alive(&tcp);
    let tls = match tokio::time::timeout(limits.handshake_timeout, acceptor.accept(tcp)).await {
        Ok(Ok(tls)) => tls,
        Ok(Err(e)) => return debug!(%peer, error = %e, "TLS handshake failed"),
        Err(_) => return debug!(%peer, "TLS handshake timed out"),
    };
    let h2 = tls.get_ref().1.alpn_protocol() == Some(b"h2");
    let service = service(tls.get_ref().1);
    if h2 {
        serve_h2(tls, peer, slot, limits, shutdown, service).await;
    } else {
        serve_http(tls, peer, slot, limits, shutdown, service).await;
    }
}

/// The stream wrapped for the timers, and `service` wrapped to keep each
/// request in flight until its response is sent.
#[allow(clippy::type_complexity)]
fn tracked<IO, S, Fut>(
    io: IO,
    slot: Slot,
    heads: bool,
    service: S,
) -> (
    Tracked<IO>,
    watch::Receiver<Activity>,
    impl hyper::service::Service<
        Request<Incoming>,
        Response = Response<Tracking>,
        Error = Infallible,
        Future = impl Future<Output = Result<Response<Tracking>, Infallible>> + Send + 'static,
    > + Send
    + 'static,
)
where
    S: Fn(Request<Incoming>) -> Fut + Send + 'static,
    Fut: Future<Output = Response<Body>> + Send + 'static,
{
    // A new connection owes its first request head at once (as Go's ReadHeaderTimeout).
    let (tracker, activity) = watch::channel(Activity {
        in_flight: 0,
        head_started: true,
    });
    let tracker = Arc::new(tracker);
    let io = Tracked {
        io,
        tracker: Arc::clone(&tracker),
        clock: super::idle::Clock::new(),
        heads,
        _slot: slot,
    };
    let svc = hyper::service::service_fn(move |req| {
        let request = InFlight::start(&tracker);
        let response = service(req);
        async move {
            let response = response.await;
            Ok::<_, Infallible>(response.map(|body| Tracking::new(body, request)))
        }
    });
    (io, activity, svc)
}

/// Serves HTTP/2 on one connection until it ends, times out or shutdown. The
/// first request is due within the header timeout; after that the connection
/// may wait for the next one for the idle timeout, and is then told to go
/// away (GOAWAY: the client retries elsewhere what it sent meanwhile) and
/// dropped if it is still idle a timeout later.
pub(crate) async fn serve_h2<IO, S, Fut>(
    io: IO,
    peer: SocketAddr,
    slot: Slot,
    limits: Limits,
    shutdown: CancellationToken,
    service: S,
) where
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    S: Fn(Request<Incoming>) -> Fut + Send + 'static,
    Fut: Future<Output = Response<Body>> + Send + 'static,
{
    let (io, activity, svc) = tracked(io, slot, false, service);
    let mut conn = std::pin::pin!(
        hyper::server::conn::http2::Builder::new(TokioExecutor::new())
            .timer(TokioTimer::new())
            .max_concurrent_streams(MAX_CONCURRENT_STREAMS)
            .serve_connection(TokioIo::new(io), svc)
    );
    let mut going_away = false;
    loop {
        tokio::select! {
            r = conn.as_mut() => {
                if let Err(e) = r {
                    debug!(%peer, error = %e, "kubelet API HTTP/2 connection ended");
                }
                return;
            }
            why = expiry(activity.clone(), limits) => {
                if going_away {
                    return debug!(%peer, "kubelet API HTTP/2 connection closed: {why}");
                }
                debug!(%peer, "kubelet API HTTP/2 connection going away: {why}");
                going_away = true;
                conn.as_mut().graceful_shutdown();
            }
            _ = shutdown.cancelled() => return,
        }
    }
}

/// Serves HTTP/1 (with upgrades) on one connection until it ends, times out
/// or shutdown. `slot` is held as long as the stream, upgraded ones included.
pub(crate) async fn serve_http<IO, S, Fut>(
    io: IO,
    peer: SocketAddr,
    slot: Slot,
    limits: Limits,
    shutdown: CancellationToken,
    service: S,
) where
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    S: Fn(Request<Incoming>) -> Fut + Send + 'static,
    Fut: Future<Output = Response<Body>> + Send + 'static,
{
    let (io, activity, svc) = tracked(io, slot, true, service);
    let idle = io.clock.watch();
    // hyper's own header timer runs from the moment a connection waits for a
    // request (so it spans idle time too): a backstop behind `expiry`.
    let conn = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.idle_timeout.saturating_add(limits.header_timeout))
        .serve_connection(TokioIo::new(io), svc)
        .with_upgrades();
    tokio::select! {
        r = conn => if let Err(e) = r {
            debug!(%peer, error = %e, "kubelet API connection ended");
        },
        why = expiry(activity, limits) => return debug!(%peer, "kubelet API connection closed: {why}"),
        _ = shutdown.cancelled() => return,
    }
    // Upgraded (exec, attach, port-forward), the stream lives on in its
    // handler: closed when idle too long, or at shutdown. A connection that
    // simply ended has dropped its stream, and this returns at once.
    super::idle::close_when_idle(idle, limits.stream_idle_timeout, shutdown).await;
    debug!(%peer, "kubelet API stream ended");
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::StreamExt;
    use http_body_util::{BodyExt, StreamBody};
    use hyper::StatusCode;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    const SHORT: Limits = Limits {
        max_connections: 64,
        max_connections_per_peer: 64,
        handshake_timeout: HANDSHAKE_TIMEOUT,
        header_timeout: Duration::from_millis(400),
        idle_timeout: Duration::from_millis(1200),
        stream_idle_timeout: Duration::from_secs(3600),
    };

    /// `/stream`: ten chunks 250 ms apart; `/upgrade`: a 101, then an echo;
    /// anything else: `ok`.
    async fn service(req: Request<Incoming>) -> Response<Body> {
        match req.uri().path() {
            "/stream" => {
                let chunks = futures::stream::iter(0..10).then(|i| async move {
                    tokio::time::sleep(Duration::from_millis(250)).await;
                    Ok::<_, io::Error>(Frame::data(Bytes::from(format!("chunk {i}\n"))))
                });
                Response::new(BodyExt::boxed_unsync(StreamBody::new(chunks)))
            }
            "/upgrade" => {
                let mut req = req;
                tokio::spawn(async move {
                    if let Ok(up) = hyper::upgrade::on(&mut req).await {
                        let (mut r, mut w) = tokio::io::split(TokioIo::new(up));
                        let _ = tokio::io::copy(&mut r, &mut w).await;
                    }
                });
                let mut r = super::super::text(StatusCode::SWITCHING_PROTOCOLS, "");
                let h = r.headers_mut();
                h.insert(
                    "connection",
                    hyper::header::HeaderValue::from_static("upgrade"),
                );
                h.insert("upgrade", hyper::header::HeaderValue::from_static("echo"));
                r
            }
            _ => super::super::text(StatusCode::OK, "ok"),
        }
    }

    /// A plain-TCP server with the kubelet API's connection layer and `limits`.
    async fn server(limits: Limits) -> (SocketAddr, CancellationToken) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let shutdown = CancellationToken::new();
        let token = shutdown.clone();
        tokio::spawn(accept_loop(
            listener,
            limits,
            shutdown.clone(),
            move |tcp, peer, slot| {
                tokio::spawn(serve_http(tcp, peer, slot, limits, token.clone(), service));
            },
            |_| {},
        ));
        (addr, shutdown)
    }

    /// Reads until the server closes; Err(elapsed) if it is still open after `within`.
    async fn closed_within<S: AsyncRead + Unpin>(
        s: &mut S,
        within: Duration,
    ) -> Result<Vec<u8>, Duration> {
        let start = std::time::Instant::now();
        let mut got = Vec::new();
        let read = async {
            let mut buf = [0u8; 4096];
            loop {
                match s.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => got.extend_from_slice(&buf[..n]),
                }
            }
        };
        match tokio::time::timeout(within, read).await {
            Ok(()) => Ok(got),
            Err(_) => Err(start.elapsed()),
        }
    }

    #[tokio::test]
    async fn half_request_lines_are_closed_after_the_header_timeout() {
        let (addr, _shutdown) = server(SHORT).await;
        let start = std::time::Instant::now();
        let mut conns = Vec::new();
        for i in 0..40 {
            let mut s = TcpStream::connect(addr).await.unwrap();
            // Half a request line, or (every fourth) nothing at all.
            if i % 4 != 0 {
                s.write_all(b"GET /healthz HT").await.unwrap();
            }
            conns.push(s);
        }
        for (i, s) in conns.iter_mut().enumerate() {
            let r = closed_within(s, Duration::from_secs(10)).await;
            assert!(r.is_ok(), "connection {i} still open after {r:?}");
        }
        let took = start.elapsed();
        assert!(
            took >= SHORT.header_timeout && took < SHORT.idle_timeout * 3,
            "closed after {took:?}"
        );
    }

    /// The kubelet API's TLS (a certificate for localhost from files) in front
    /// of the connection layer, and a client that trusts it.
    async fn tls_server(
        limits: Limits,
        dir: &std::path::Path,
    ) -> (SocketAddr, tokio_rustls::TlsConnector) {
        std::fs::create_dir_all(dir).unwrap();
        let ck = rcgen::generate_simple_self_signed(vec!["localhost".to_owned()]).unwrap();
        let settings = crate::kubelet_api::tls::TlsSettings {
            cert_file: Some(dir.join("tls.crt")),
            key_file: Some(dir.join("tls.key")),
            client_ca_file: None,
        };
        std::fs::write(dir.join("tls.crt"), ck.cert.pem()).unwrap();
        std::fs::write(dir.join("tls.key"), ck.signing_key.serialize_pem()).unwrap();
        let config = crate::kubelet_api::tls::server_config(
            &settings,
            &["vk"],
            std::net::IpAddr::from([127, 0, 0, 1]),
        )
        .unwrap();
        let acceptor = TlsAcceptor::from(Arc::new(config));
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let shutdown = CancellationToken::new();
        tokio::spawn(accept_loop(
            listener,
            limits,
            shutdown.clone(),
            move |tcp, peer, slot| {
                let service = |_: &rustls::ServerConnection| service;
                tokio::spawn(serve_tls(
                    acceptor.clone(),
                    tcp,
                    peer,
                    slot,
                    limits,
                    shutdown.clone(),
                    service,
                ));
            },
            |_| {},
        ));
        let mut roots = rustls::RootCertStore::empty();
        roots.add(ck.cert.der().clone()).unwrap();
        let client = rustls::ClientConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
        (addr, tokio_rustls::TlsConnector::from(Arc::new(client)))
    }

    #[tokio::test]
    async fn tls_half_request_lines_and_silent_handshakes_are_closed() {
        let dir = std::env::temp_dir().join(format!("vkd-conn-tls-{}", std::process::id()));
        let limits = Limits {
            handshake_timeout: Duration::from_millis(800),
            ..SHORT
        };
        let (addr, connector) = tls_server(limits, &dir).await;
        let name = rustls_pki_types::ServerName::try_from("localhost").unwrap();
        let start = std::time::Instant::now();
        let mut whole = connector
            .connect(name.clone(), TcpStream::connect(addr).await.unwrap())
            .await
            .unwrap();
        whole
            .write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .unwrap();
        let mut buf = [0u8; 1024];
        let n = whole.read(&mut buf).await.unwrap();
        assert!(buf[..n].starts_with(b"HTTP/1.1 200"), "{:?}", &buf[..n]);
        let mut halves = Vec::new();
        for _ in 0..40 {
            let tcp = TcpStream::connect(addr).await.unwrap();
            let mut s = connector.connect(name.clone(), tcp).await.unwrap();
            s.write_all(b"GET /healthz HT").await.unwrap();
            s.flush().await.unwrap();
            halves.push(s);
        }
        // Never says hello: the handshake timeout.
        let mut silent = TcpStream::connect(addr).await.unwrap();
        for (i, s) in halves.iter_mut().enumerate() {
            let r = closed_within(s, Duration::from_secs(10)).await;
            assert!(r.is_ok(), "TLS connection {i} still open after {r:?}");
        }
        let r = closed_within(&mut silent, Duration::from_secs(10)).await;
        assert!(
            r.is_ok(),
            "a connection without a handshake still open after {r:?}"
        );
        let took = start.elapsed();
        assert!(took >= limits.header_timeout, "closed after {took:?}");
        std::fs::remove_dir_all(dir).ok();
    }

    #[tokio::test]
    async fn idle_connections_are_closed_but_not_streams_or_upgrades() {
        let (addr, _shutdown) = server(SHORT).await;

        // Idle after one request: closed at the idle timeout, not the header timeout.
        let mut idle = TcpStream::connect(addr).await.unwrap();
        idle.write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .unwrap();
        let mut buf = [0u8; 1024];
        let n = idle.read(&mut buf).await.unwrap();
        assert!(buf[..n].starts_with(b"HTTP/1.1 200"));
        let start = std::time::Instant::now();
        let r = closed_within(&mut idle, Duration::from_secs(10)).await;
        assert!(r.is_ok(), "idle connection still open after {r:?}");
        let took = start.elapsed();
        assert!(
            took >= SHORT.idle_timeout - Duration::from_millis(100),
            "closed after {took:?}, before the idle timeout"
        );

        // A response that takes longer than both timeouts is sent whole.
        let mut stream = TcpStream::connect(addr).await.unwrap();
        stream
            .write_all(b"GET /stream HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            .await
            .unwrap();
        let body = closed_within(&mut stream, Duration::from_secs(20))
            .await
            .unwrap();
        let body = String::from_utf8_lossy(&body);
        assert!(body.contains("chunk 9\n"), "{body}");

        // An upgraded stream quiet for longer than both is still served.
        let mut up = TcpStream::connect(addr).await.unwrap();
        up.write_all(
            b"GET /upgrade HTTP/1.1\r\nhost: x\r\nconnection: upgrade\r\nupgrade: echo\r\n\r\n",
        )
        .await
        .unwrap();
        let n = up.read(&mut buf).await.unwrap();
        assert!(buf[..n].starts_with(b"HTTP/1.1 101"), "{:?}", &buf[..n]);
        tokio::time::sleep(SHORT.idle_timeout + SHORT.header_timeout * 2).await;
        up.write_all(b"still here").await.unwrap();
        let n = tokio::time::timeout(Duration::from_secs(5), up.read(&mut buf))
            .await
            .unwrap()
            .unwrap();
        assert_eq!(&buf[..n], b"still here");
    }

    /// `--streaming-connection-idle-timeout`: an upgraded stream that moves
    /// bytes lives on past it; one that moves nothing for that long is closed.
    #[tokio::test]
    async fn an_idle_upgraded_stream_is_closed_at_the_streaming_idle_timeout() {
        let limits = Limits {
            stream_idle_timeout: Duration::from_millis(1500),
            ..SHORT
        };
        let (addr, _shutdown) = server(limits).await;
        let mut up = TcpStream::connect(addr).await.unwrap();
        up.write_all(
            b"GET /upgrade HTTP/1.1\r\nhost: x\r\nconnection: upgrade\r\nupgrade: echo\r\n\r\n",
        )
        .await
        .unwrap();
        let mut buf = [0u8; 1024];
        let n = up.read(&mut buf).await.unwrap();
        assert!(buf[..n].starts_with(b"HTTP/1.1 101"), "{:?}", &buf[..n]);
        // Busy for twice the timeout: served throughout.
        for _ in 0..6 {
            tokio::time::sleep(Duration::from_millis(500)).await;
            up.write_all(b"ping").await.unwrap();
            let n = tokio::time::timeout(Duration::from_secs(5), up.read(&mut buf))
                .await
                .unwrap()
                .unwrap();
            assert_eq!(&buf[..n], b"ping");
        }
        // Then quiet: closed about the timeout later.
        let start = std::time::Instant::now();
        let r = closed_within(&mut up, Duration::from_secs(10)).await;
        assert!(r.is_ok(), "an idle stream still open after {r:?}");
        let took = start.elapsed();
        assert!(
            took >= Duration::from_millis(1400),
            "closed after {took:?}, before the timeout"
        );
    }

    #[tokio::test]
    async fn kubelet_api_connections_keep_tcp_alive() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let _client = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (accepted, _) = listener.accept().await.unwrap();
        assert!(!socket2::SockRef::from(&accepted).keepalive().unwrap());
        keep_alive(&accepted);
        let socket = socket2::SockRef::from(&accepted);
        assert!(socket.keepalive().unwrap());
        assert_eq!(
            socket.tcp_keepalive_time().unwrap(),
            Duration::from_secs(15)
        );
        assert_eq!(
            socket.tcp_keepalive_interval().unwrap(),
            Duration::from_secs(15)
        );
    }

    #[tokio::test]
    async fn connections_past_the_cap_are_closed_at_once() {
        let (addr, _shutdown) = server(Limits {
            max_connections: 2,
            // Long enough that only the cap can close anything here.
            header_timeout: Duration::from_secs(60),
            idle_timeout: Duration::from_secs(60),
            ..SHORT
        })
        .await;
        let mut first = TcpStream::connect(addr).await.unwrap();
        let mut second = TcpStream::connect(addr).await.unwrap();
        let mut third = TcpStream::connect(addr).await.unwrap();
        assert!(
            closed_within(&mut third, Duration::from_secs(2))
                .await
                .is_ok(),
            "a third connection was kept past a cap of 2"
        );
        for s in [&mut first, &mut second] {
            assert!(closed_within(s, Duration::from_millis(300)).await.is_err());
        }
        // A closed connection frees its slot.
        drop(first);
        let mut held = false;
        for _ in 0..50 {
            let mut next = TcpStream::connect(addr).await.unwrap();
            if closed_within(&mut next, Duration::from_millis(200))
                .await
                .is_err()
            {
                held = true;
                break;
            }
        }
        assert!(held, "the slot of a closed connection was not freed");
    }

    #[test]
    fn one_peer_holds_at_most_its_share_of_the_slots() {
        let slots = Slots::new(&Limits {
            max_connections: 5,
            max_connections_per_peer: 2,
            ..SHORT
        });
        let (pod, apiserver, scraper): (IpAddr, IpAddr, IpAddr) = (
            [10, 0, 0, 7].into(),
            [10, 0, 0, 1].into(),
            "fd00::9".parse().unwrap(),
        );
        let first = slots.try_acquire(pod).unwrap();
        let _second = slots.try_acquire(pod).unwrap();
        // The same address seen through an IPv6 socket is the same peer.
        let mapped: IpAddr = "::ffff:10.0.0.7".parse().unwrap();
        for p in [pod, mapped] {
            assert_eq!(slots.try_acquire(p).unwrap_err(), Refused::PeerLimit);
        }
        // Others still get in, up to the cap.
        let a = slots.try_acquire(apiserver).unwrap();
        let b = slots.try_acquire(apiserver).unwrap();
        let _c = slots.try_acquire(scraper).unwrap();
        assert_eq!(slots.try_acquire(scraper).unwrap_err(), Refused::Limit);
        // A closed connection frees its slot in all and for its peer.
        drop(first);
        let _again = slots.try_acquire(pod).unwrap();
        assert_eq!(slots.available(), 0);
        assert_eq!(slots.try_acquire(pod).unwrap_err(), Refused::PeerLimit);
        // Peers with nothing open are forgotten.
        drop((a, b));
        assert!(!slots.per_peer.lock().unwrap().contains_key(&apiserver));
    }

    /// Over real sockets: a peer at its share has its next connection closed
    /// at once, and counted, while a second address still connects.
    #[tokio::test]
    async fn a_peer_at_its_share_is_refused_while_another_connects() {
        let limits = Limits {
            max_connections: 8,
            max_connections_per_peer: 2,
            header_timeout: Duration::from_secs(60),
            idle_timeout: Duration::from_secs(60),
            ..SHORT
        };
        let listener = TcpListener::bind("0.0.0.0:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let shutdown = CancellationToken::new();
        let token = shutdown.clone();
        let refusals = Arc::new(Mutex::new(Vec::new()));
        let counted = Arc::clone(&refusals);
        tokio::spawn(accept_loop(
            listener,
            limits,
            shutdown.clone(),
            move |tcp, peer, slot| {
                tokio::spawn(serve_http(tcp, peer, slot, limits, token.clone(), service));
            },
            move |why| counted.lock().unwrap().push(why),
        ));
        // Every 127/8 address is this host's, so each is a peer of its own.
        let from = |last: u8| async move {
            let s = tokio::net::TcpSocket::new_v4().unwrap();
            s.bind(SocketAddr::from(([127, 0, 0, last], 0))).unwrap();
            s.connect(SocketAddr::from(([127, 0, 0, 1], port)))
                .await
                .unwrap()
        };
        let mut held = vec![from(1).await, from(1).await];
        let mut third = from(1).await;
        assert!(
            closed_within(&mut third, Duration::from_secs(2))
                .await
                .is_ok(),
            "a third connection from one peer was kept past its share of 2"
        );
        let mut other = from(2).await;
        other
            .write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
            .await
            .unwrap();
        let mut buf = [0u8; 1024];
        let n = tokio::time::timeout(Duration::from_secs(5), other.read(&mut buf))
            .await
            .unwrap()
            .unwrap();
        assert!(buf[..n].starts_with(b"HTTP/1.1 200"), "{:?}", &buf[..n]);
        for s in &mut held {
            assert!(closed_within(s, Duration::from_millis(300)).await.is_err());
        }
        assert_eq!(*refusals.lock().unwrap(), [Refused::PeerLimit]);
        assert_eq!(Refused::PeerLimit.label(), "peer_limit");
        shutdown.cancel();
    }

    #[tokio::test]
    async fn upgraded_streams_keep_their_slot() {
        let (client, server_side) = tokio::io::duplex(4096);
        let slots = Slots::new(&Limits {
            max_connections: 1,
            ..SHORT
        });
        let peer = SocketAddr::from(([127, 0, 0, 1], 1));
        let slot = slots.try_acquire(peer.ip()).unwrap();
        tokio::spawn(serve_http(
            server_side,
            peer,
            slot,
            SHORT,
            CancellationToken::new(),
            service,
        ));
        let (mut r, mut w) = tokio::io::split(client);
        w.write_all(
            b"GET /upgrade HTTP/1.1\r\nhost: x\r\nconnection: upgrade\r\nupgrade: echo\r\n\r\n",
        )
        .await
        .unwrap();
        let mut buf = [0u8; 1024];
        let n = r.read(&mut buf).await.unwrap();
        assert!(buf[..n].starts_with(b"HTTP/1.1 101"));
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(slots.available(), 0, "an upgraded stream lost its slot");
        drop((r, w));
        tokio::time::timeout(Duration::from_secs(5), async {
            while slots.available() == 0 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await
        .unwrap();
    }

    /// A TLS client of `tls_server` offering `alpn`.
    async fn tls_client(
        addr: SocketAddr,
        connector: &tokio_rustls::TlsConnector,
        alpn: &[&[u8]],
    ) -> tokio_rustls::client::TlsStream<TcpStream> {
        let mut config = rustls::ClientConfig::clone(connector.config());
        config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
        let name = rustls_pki_types::ServerName::try_from("localhost").unwrap();
        connector
            .connect(name, TcpStream::connect(addr).await.unwrap())
            .await
            .unwrap()
    }

    /// A client offering h2 gets HTTP/2 (streamed bodies arrive whole, across
    /// both timeouts); one offering http/1.1 alone gets HTTP/1.1 and its upgrades.
    #[tokio::test]
    async fn h2_when_offered_and_http1_for_upgrades() {
        let dir = std::env::temp_dir().join(format!("vkd-conn-h2-{}", std::process::id()));
        let (addr, connector) = tls_server(SHORT, &dir).await;

        let tls = tls_client(addr, &connector, &[b"h2", b"http/1.1"]).await;
        assert_eq!(tls.get_ref().1.alpn_protocol(), Some(&b"h2"[..]));
        let (mut send, conn) =
            hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tls))
                .await
                .unwrap();
        tokio::spawn(conn);
        for path in ["/healthz", "/stream"] {
            let req = Request::get(format!("https://localhost{path}"))
                .body(http_body_util::Empty::<Bytes>::new())
                .unwrap();
            let resp = send.send_request(req).await.unwrap();
            assert_eq!(resp.version(), hyper::Version::HTTP_2);
            assert_eq!(resp.status(), StatusCode::OK);
            let body = resp.into_body().collect().await.unwrap().to_bytes();
            let body = String::from_utf8_lossy(&body);
            assert!(
                body == "ok" || body.ends_with("chunk 9\n"),
                "{path}: {body}"
            );
        }

        let mut tls = tls_client(addr, &connector, &[b"http/1.1"]).await;
        assert_eq!(tls.get_ref().1.alpn_protocol(), Some(&b"http/1.1"[..]));
        tls.write_all(
            b"GET /upgrade HTTP/1.1\r\nhost: x\r\nconnection: upgrade\r\nupgrade: echo\r\n\r\n",
        )
        .await
        .unwrap();
        let mut buf = [0u8; 1024];
        let n = tls.read(&mut buf).await.unwrap();
        assert!(buf[..n].starts_with(b"HTTP/1.1 101"), "{:?}", &buf[..n]);
        tls.write_all(b"ping").await.unwrap();
        let n = tls.read(&mut buf).await.unwrap();
        assert_eq!(&buf[..n], b"ping");
        std::fs::remove_dir_all(dir).ok();
    }

    /// An HTTP/2 connection with nothing in flight is sent away after the idle
    /// timeout, and closed; its slot is freed.
    #[tokio::test]
    async fn idle_h2_connections_are_closed() {
        let dir = std::env::temp_dir().join(format!("vkd-conn-h2-idle-{}", std::process::id()));
        let (addr, connector) = tls_server(SHORT, &dir).await;
        let tls = tls_client(addr, &connector, &[b"h2"]).await;
        let (mut send, conn) =
            hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(tls))
                .await
                .unwrap();
        let conn = tokio::spawn(conn);
        let req = Request::get("https://localhost/healthz")
            .body(http_body_util::Empty::<Bytes>::new())
            .unwrap();
        assert_eq!(
            send.send_request(req).await.unwrap().status(),
            StatusCode::OK
        );
        let start = std::time::Instant::now();
        tokio::time::timeout(Duration::from_secs(10), conn)
            .await
            .expect("an idle HTTP/2 connection was kept")
            .unwrap()
            .ok();
        let took = start.elapsed();
        assert!(
            took >= SHORT.idle_timeout - Duration::from_millis(100),
            "closed after {took:?}, before the idle timeout"
        );
        std::fs::remove_dir_all(dir).ok();
    }

    /// A body's last data and its end go out in two writes: the end waits one
    /// turn (woken at once) after data.
    #[tokio::test]
    async fn a_body_ends_after_its_last_data_is_flushed() {
        use hyper::body::Body as _;
        let (tracker, _activity) = watch::channel(Activity::default());
        let tracker = Arc::new(tracker);
        let chunks = futures::stream::iter(["a", "b"])
            .map(|c| Ok::<_, io::Error>(Frame::data(Bytes::from_static(c.as_bytes()))));
        let body = BodyExt::boxed_unsync(StreamBody::new(chunks));
        let mut body = Tracking::new(body, InFlight::start(&tracker));
        let woken = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        struct Count(Arc<std::sync::atomic::AtomicUsize>);
        impl std::task::Wake for Count {
            fn wake(self: Arc<Self>) {
                self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            }
        }
        let waker = std::task::Waker::from(Arc::new(Count(Arc::clone(&woken))));
        let mut cx = Context::from_waker(&waker);
        let mut polls = Vec::new();
        for _ in 0..4 {
            polls.push(match Pin::new(&mut body).poll_frame(&mut cx) {
                Poll::Ready(Some(Ok(f))) => format!("{:?}", f.into_data().unwrap()),
                Poll::Ready(Some(Err(e))) => format!("error {e}"),
                Poll::Ready(None) => "end".to_owned(),
                Poll::Pending => "pending".to_owned(),
            });
        }
        assert_eq!(polls, [r#"b"a""#, r#"b"b""#, "pending", "end"]);
        assert_eq!(woken.load(std::sync::atomic::Ordering::SeqCst), 1);
        assert!(body.is_end_stream());
        assert_eq!(
            tracker.borrow().in_flight,
            1,
            "sent whole only when dropped"
        );
        drop(body);
        assert_eq!(tracker.borrow().in_flight, 0);
    }

    /// Fails or succeeds as scripted, noting when it was called; then cancels.
    struct Scripted {
        script: Vec<bool>,
        calls: Arc<std::sync::Mutex<Vec<Instant>>>,
        done: CancellationToken,
    }

    impl Accept for Scripted {
        type Conn = ();
        async fn accept(&mut self) -> io::Result<((), SocketAddr)> {
            self.calls.lock().unwrap().push(Instant::now());
            if self.script.is_empty() {
                self.done.cancel();
                return std::future::pending().await;
            }
            if self.script.remove(0) {
                Ok(((), SocketAddr::from(([127, 0, 0, 1], 1))))
            } else {
                Err(io::Error::from_raw_os_error(24)) // EMFILE
            }
        }
    }

    #[tokio::test(start_paused = true)]
    async fn accept_errors_back_off_and_success_resets() {
        let calls = Arc::new(std::sync::Mutex::new(Vec::new()));
        let done = CancellationToken::new();
        let mut script = vec![false; 9];
        script.extend([true, false, false]);
        let listener = Scripted {
            script,
            calls: Arc::clone(&calls),
            done: done.clone(),
        };
        tokio::time::timeout(
            Duration::from_secs(60),
            accept_loop(
                listener,
                Limits {
                    max_connections: 4,
                    ..SHORT
                },
                done,
                |(), _, _| {},
                |_| {},
            ),
        )
        .await
        .expect("the accept loop did not stop");
        let calls = calls.lock().unwrap();
        let gaps: Vec<u128> = calls
            .windows(2)
            .map(|w| (w[1] - w[0]).as_millis())
            .collect();
        assert_eq!(
            gaps,
            [10, 20, 40, 80, 160, 320, 640, 1000, 1000, 0, 10, 20],
            "waits between accepts"
        );
    }

    #[test]
    fn backoff_doubles_to_a_second() {
        let mut d = None;
        let waits: Vec<u128> = (0..10)
            .map(|_| {
                let w = next_backoff(d);
                d = Some(w);
                w.as_millis()
            })
            .collect();
        assert_eq!(waits, [10, 20, 40, 80, 160, 320, 640, 1000, 1000, 1000]);
        assert_eq!(next_backoff(Some(Duration::MAX)), MAX_BACKOFF);
    }

    #[test]
    fn throttle_lets_one_line_per_period() {
        let t0 = Instant::now();
        let mut t = Throttle::new(Duration::from_secs(10));
        assert_eq!(t.hit(t0), Some(1));
        for s in 1..10 {
            assert_eq!(t.hit(t0 + Duration::from_secs(s)), None);
        }
        assert_eq!(t.hit(t0 + Duration::from_secs(10)), Some(10));
        assert_eq!(t.hit(t0 + Duration::from_secs(11)), None);
    }
}
