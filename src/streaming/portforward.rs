//! Port-forward on top of SPDY (a data and an error stream per connection,
//! paired by `requestid`) and of WebSocket (a data and an error channel per
//! port, in [`super::websocket`]), and how one forwarded connection ends.
//!
//! The kubelet's runtime returns from a port-forward as soon as either
//! direction is done, and the kubelet then closes the data and the error
//! stream: so when the server in the Pod closes its side, the client reads
//! EOF at once. vkd does the same whatever the provider does with the other
//! direction: when the provider shuts down the write half of the stream it was
//! given (the Pod side's output ended), the data stream is half-closed (FIN)
//! once everything before it is sent, and the error stream is closed; the
//! provider's call goes on until the client closes its side.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use futures::future::BoxFuture;
use tokio::io::{AsyncWrite, AsyncWriteExt};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tracing::debug;
use vkd_provider::{BoxWrite, Duplex};

use super::remotecommand::reader;
use super::spdy::frame::RST_PROTOCOL_ERROR;
use super::spdy::headers::get;
use super::spdy::session::{IncomingStream, Session};

/// The SPDY subprotocol of port-forward.
pub const PROTOCOL: &str = "portforward.k8s.io";

/// Connects one forwarded connection to a port of the Pod: the provider's
/// `port_forward`. An error is the message for the client's error stream.
pub type Connect =
    Arc<dyn Fn(u16, Box<dyn Duplex>) -> BoxFuture<'static, Result<(), String>> + Send + Sync>;

/// One forwarded connection, as a transport sets it up.
pub struct Forward {
    pub port: u16,
    /// The data stream both ways, for the provider.
    pub data: Box<dyn Duplex>,
    /// The error stream: a failure is written here; shutting it down closes it
    /// (SPDY: FIN).
    pub error: BoxWrite,
    /// Ends once what `error` got has been handed to the connection.
    pub error_pump: JoinHandle<()>,
    /// Resolves once the provider has shut down `data`'s write half and all
    /// that it wrote has been handed to the connection, FIN included.
    pub output_end: OutputEnd,
}

impl std::fmt::Debug for Forward {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Forward")
            .field("port", &self.port)
            .finish_non_exhaustive()
    }
}

/// The end of a data stream's output: the provider's shutdown (a write half
/// dropped without one is told by the call returning, with its error if any),
/// then the pump that carries what was written before it to the connection.
#[derive(Debug)]
pub struct OutputEnd {
    shutdown: oneshot::Receiver<()>,
    pump: JoinHandle<()>,
}

/// Wraps the write half given to the provider so that its shutdown is seen.
/// `pump` is the task that carries what `write` receives to the connection
/// and ends its stream there once `write` is shut down or dropped.
pub fn watch_output<W>(write: W, pump: JoinHandle<()>) -> (BoxWrite, OutputEnd)
where
    W: AsyncWrite + Send + Unpin + 'static,
{
    let (tx, rx) = oneshot::channel();
    let w = ShutdownSignal {
        inner: write,
        signal: Some(tx),
    };
    (Box::new(w), OutputEnd { shutdown: rx, pump })
}

/// A writer that tells, once, that it was shut down.
struct ShutdownSignal<W> {
    inner: W,
    signal: Option<oneshot::Sender<()>>,
}

impl<W: AsyncWrite + Unpin> AsyncWrite for ShutdownSignal<W> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        let r = Pin::new(&mut this.inner).poll_shutdown(cx);
        if r.is_ready()
            && let Some(tx) = this.signal.take()
        {
            let _ = tx.send(());
        }
        r
    }
}

/// How long a finished call's output may take to reach the connection.
const DRAIN_WAIT: Duration = Duration::from_secs(5);

/// Runs one forwarded connection and ends it toward the client as the kubelet
/// does: when the provider's call returns (its error written to the error
/// stream first) or the Pod side's output ends, the error stream is closed
/// once the data stream's output has ended. Returns when both have been handed
/// to the connection; a call still running goes on in its own task until the
/// client closes its side.
pub async fn run(fwd: Forward, connect: &Connect) {
    let Forward {
        port,
        data,
        mut error,
        error_pump,
        output_end: OutputEnd { shutdown, mut pump },
    } = fwd;
    let mut call = tokio::spawn(connect(port, data));
    let pod_closed = async {
        if shutdown.await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    tokio::select! {
        biased;
        r = &mut call => {
            // The stream was dropped with the call: its output drains.
            let _ = tokio::time::timeout(DRAIN_WAIT, &mut pump).await;
            match r {
                Ok(Ok(())) => {}
                Ok(Err(message)) => {
                    let _ = error.write_all(message.as_bytes()).await;
                }
                Err(e) => debug!(port, error = %e, "port-forward task failed"),
            }
        }
        () = pod_closed => {
            let _ = (&mut pump).await;
            debug!(port, "the Pod side closed the connection; ending the client's streams");
            tokio::spawn(async move {
                if let Ok(Err(message)) = call.await {
                    debug!(port, %message, "port-forward ended after the Pod side closed");
                }
            });
        }
    }
    let _ = error.shutdown().await;
    drop(error);
    let _ = tokio::time::timeout(DRAIN_WAIT, error_pump).await;
}

/// Pairs SPDY port-forward streams by `requestid` and runs each pair with
/// `connect`. Runs until the client closes the connection.
pub async fn serve_spdy(
    session: Session,
    mut incoming: mpsc::Receiver<IncomingStream>,
    connect: Connect,
) {
    let mut errors: HashMap<String, IncomingStream> = HashMap::new();
    let mut waiting_data: HashMap<String, (u16, IncomingStream)> = HashMap::new();
    while let Some(stream) = incoming.recv().await {
        let request = get(&stream.headers, "requestid")
            .unwrap_or_default()
            .to_owned();
        let Some(port) = get(&stream.headers, "port")
            .and_then(|p| p.parse::<u16>().ok())
            .filter(|p| *p > 0)
        else {
            session.reset(stream.id, RST_PROTOCOL_ERROR).await;
            continue;
        };
        let pair = match get(&stream.headers, "streamtype").unwrap_or_default() {
            "error" => match waiting_data.remove(&request) {
                Some((port, data)) => Some((port, data, stream)),
                None => {
                    errors.insert(request, stream);
                    None
                }
            },
            "data" => match errors.remove(&request) {
                Some(error) => Some((port, stream, error)),
                None => {
                    waiting_data.insert(request, (port, stream));
                    None
                }
            },
            _ => {
                session.reset(stream.id, RST_PROTOCOL_ERROR).await;
                None
            }
        };
        if let Some((port, data, error)) = pair {
            let fwd = spdy_forward(port, data, error);
            let connect = Arc::clone(&connect);
            tokio::spawn(async move { run(fwd, &connect).await });
        }
    }
}

fn spdy_forward(port: u16, data: IncomingStream, error: IncomingStream) -> Forward {
    let read = reader(data.data);
    let (write, pump) = data.writer.into_async_write();
    let (write, output_end) = watch_output(write, pump);
    // The client sends nothing on the error stream; its pump FINs it when
    // `error` is shut down or dropped.
    let (error, error_pump) = error.writer.into_async_write();
    Forward {
        port,
        data: Box::new(tokio::io::join(read, write)),
        error,
        error_pump,
        output_end,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::streaming::spdy::frame::{FLAG_FIN, Frame};
    use crate::streaming::spdy::headers::HeaderEncoder;
    use crate::streaming::spdy::testing::data;
    use bytes::BytesMut;
    use tokio::io::{AsyncReadExt, DuplexStream};

    fn syn(enc: &mut HeaderEncoder, id: u32, kind: &str, request: &str, port: &str) -> Vec<u8> {
        let headers = [("streamtype", kind), ("requestid", request), ("port", port)];
        crate::streaming::spdy::testing::syn(enc, id, &headers, false)
    }

    /// What a stream carried toward the client: its data and whether it ended.
    #[derive(Debug, Default)]
    struct Seen {
        data: Vec<u8>,
        fin: bool,
    }

    /// Reads frames until `done` says enough, or fails after 5 s.
    async fn read_until(
        io: &mut DuplexStream,
        seen: &mut HashMap<u32, Seen>,
        done: impl Fn(&HashMap<u32, Seen>) -> bool,
    ) {
        let mut buf = BytesMut::new();
        tokio::time::timeout(Duration::from_secs(5), async {
            while !done(seen) {
                while let Some(f) = Frame::decode(&mut buf).unwrap() {
                    if let Frame::Data {
                        stream_id,
                        flags,
                        data,
                    } = f
                    {
                        let s = seen.entry(stream_id).or_default();
                        s.data.extend_from_slice(&data);
                        s.fin |= flags & FLAG_FIN != 0;
                    }
                }
                if done(seen) {
                    break;
                }
                assert!(io.read_buf(&mut buf).await.unwrap() > 0, "closed: {seen:?}");
            }
        })
        .await
        .unwrap_or_else(|_| panic!("timed out; the client saw {seen:?}"));
    }

    /// A session with one data/error pair for port 8080 (data 1, error 3).
    async fn one_pair(connect: Connect) -> DuplexStream {
        let (mut client, server) = tokio::io::duplex(1 << 20);
        let (session, incoming) = Session::spawn(server);
        tokio::spawn(serve_spdy(session, incoming, connect));
        let mut enc = HeaderEncoder::default();
        client
            .write_all(&syn(&mut enc, 1, "error", "0", "8080"))
            .await
            .unwrap();
        client
            .write_all(&syn(&mut enc, 3, "data", "0", "8080"))
            .await
            .unwrap();
        client
    }

    /// The Pod's server answers and closes its side, as a provider's
    /// `copy_bidirectional` passes on: the client sees the answer, then EOF on
    /// the data stream and on the error stream, while its own side is still open.
    #[tokio::test]
    async fn the_pod_side_closing_ends_both_streams() {
        let (held_tx, mut held_rx) = mpsc::channel::<Box<dyn Duplex>>(1);
        let connect: Connect = Arc::new(move |_port, mut stream: Box<dyn Duplex>| {
            let held = held_tx.clone();
            Box::pin(async move {
                stream.write_all(b"bye").await.map_err(|e| e.to_string())?;
                stream.shutdown().await.map_err(|e| e.to_string())?;
                // Still reading the client's side, as copy_bidirectional does.
                let _ = held.send(stream).await;
                std::future::pending::<()>().await;
                Ok(())
            })
        });
        let mut client = one_pair(connect).await;
        let mut seen = HashMap::new();
        read_until(&mut client, &mut seen, |s| {
            s.get(&1).is_some_and(|e| e.fin) && s.get(&3).is_some_and(|d| d.fin)
        })
        .await;
        assert_eq!(seen[&3].data, b"bye");
        assert!(seen[&1].data.is_empty(), "{seen:?}");
        // The client's side was still open throughout: the provider kept its stream.
        let mut stream = held_rx.recv().await.unwrap();
        client.write_all(&data(3, b"late", true)).await.unwrap();
        let mut rest = Vec::new();
        stream.read_to_end(&mut rest).await.unwrap();
        assert_eq!(rest, b"late");
    }

    /// A failed connection reports on the error stream, then closes both.
    #[tokio::test]
    async fn a_failure_is_written_before_the_error_stream_closes() {
        let connect: Connect = Arc::new(|port, _stream| {
            Box::pin(async move { Err(format!("error forwarding port {port}: refused")) })
        });
        let mut client = one_pair(connect).await;
        let mut seen = HashMap::new();
        read_until(&mut client, &mut seen, |s| {
            s.get(&1).is_some_and(|e| e.fin) && s.get(&3).is_some_and(|d| d.fin)
        })
        .await;
        assert_eq!(
            String::from_utf8_lossy(&seen[&1].data),
            "error forwarding port 8080: refused"
        );
    }
}
