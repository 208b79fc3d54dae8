//! WebSocket on the kubelet API: the channel protocols of exec and attach, the
//! port-forward channels, and `SPDY/3.1+portforward.k8s.io` (SPDY frames
//! inside binary messages) for port-forward.
//!
//! Each message is `[channel][payload]`. For exec and attach the channels are
//! 0 stdin, 1 stdout, 2 stderr, 3 error, 4 resize; for port-forward, 2i is the
//! data and 2i+1 the error channel of the i-th `port`. The subprotocols, as the
//! kubelet serves them:
//!
//! | subprotocol | messages | channel 3 |
//! |---|---|---|
//! | none, `channel.k8s.io` | binary, the channel a byte | the failure's message, nothing on success |
//! | `base64.channel.k8s.io` | text: the channel an ASCII digit, the payload base64 | as above |
//! | `v4.channel.k8s.io` | binary | the metav1.Status as JSON, success included |
//! | `v4.base64.channel.k8s.io` | text, base64 | the Status as JSON |
//! | `v5.channel.k8s.io` | binary, and `[255, channel]` half-closes a channel | the Status as JSON |
//!
//! Port-forward takes no subprotocol, `v4.channel.k8s.io` or
//! `v4.base64.channel.k8s.io`; the first message on each of a port's channels
//! is the port number, 2 bytes little-endian.

use std::time::Duration;

use bytes::Bytes;
use futures::stream::SplitStream;
use futures::{SinkExt, StreamExt};
use hyper::upgrade::Upgraded;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::protocol::{CloseFrame, Role};
use vkd_provider::{StreamIo, TermSize};

use super::portforward::{self, Connect, Forward};
use super::remotecommand::{Outcome, Requested, status_json};

pub const CHANNEL_PROTOCOL: &str = "v5.channel.k8s.io";
pub const TUNNEL_PROTOCOL: &str = "SPDY/3.1+portforward.k8s.io";

pub const STDIN: u8 = 0;
pub const STDOUT: u8 = 1;
pub const STDERR: u8 = 2;
pub const ERROR: u8 = 3;
pub const RESIZE: u8 = 4;
pub const CLOSE: u8 = 255;

/// A channel subprotocol.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Protocol {
    /// The client offered no subprotocol: binary, as `channel.k8s.io`.
    Unnamed,
    /// `channel.k8s.io`
    V1,
    /// `base64.channel.k8s.io`
    V1Base64,
    /// `v4.channel.k8s.io`
    V4,
    /// `v4.base64.channel.k8s.io`
    V4Base64,
    /// `v5.channel.k8s.io`
    V5,
}

impl Protocol {
    /// The name to answer in `Sec-WebSocket-Protocol`; none for [`Protocol::Unnamed`].
    pub fn name(self) -> Option<&'static str> {
        match self {
            Self::Unnamed => None,
            Self::V1 => Some("channel.k8s.io"),
            Self::V1Base64 => Some("base64.channel.k8s.io"),
            Self::V4 => Some("v4.channel.k8s.io"),
            Self::V4Base64 => Some("v4.base64.channel.k8s.io"),
            Self::V5 => Some(CHANNEL_PROTOCOL),
        }
    }

    fn from_name(name: &str) -> Option<Self> {
        [Self::V1, Self::V1Base64, Self::V4, Self::V4Base64, Self::V5]
            .into_iter()
            .find(|p| p.name() == Some(name))
    }

    /// Text messages with base64 payloads.
    pub fn base64(self) -> bool {
        matches!(self, Self::V1Base64 | Self::V4Base64)
    }

    /// The Status goes on channel 3 as JSON, success included.
    pub fn status_json(self) -> bool {
        matches!(self, Self::V4 | Self::V4Base64 | Self::V5)
    }

    /// `[255, channel]` half-closes a channel.
    pub fn stream_close(self) -> bool {
        self == Self::V5
    }

    /// The protocol the kubelet serves exec or attach with, given the
    /// subprotocols the client offers in its order: v5 if offered at all (the
    /// kubelet sends those to its stream translator), else the first offered
    /// that it knows, or none if none is offered. `None`: nothing in common.
    pub fn for_exec(offered: &[&str]) -> Option<Self> {
        if offered.contains(&CHANNEL_PROTOCOL) {
            return Some(Self::V5);
        }
        if offered.is_empty() {
            return Some(Self::Unnamed);
        }
        offered
            .iter()
            .find_map(|o| Self::from_name(o).filter(|p| *p != Self::V5))
    }

    /// The protocol of a channel port-forward: the first offered of
    /// `v4.channel.k8s.io` and `v4.base64.channel.k8s.io`, or none if none is
    /// offered.
    pub fn for_port_forward(offered: &[&str]) -> Option<Self> {
        if offered.is_empty() {
            return Some(Self::Unnamed);
        }
        offered
            .iter()
            .find_map(|o| Self::from_name(o).filter(|p| matches!(p, Self::V4 | Self::V4Base64)))
    }
}

/// Whether the client asks for SPDY tunnelled in WebSocket (any offered
/// `SPDY/3.1+*.k8s.io`), as the kubelet tells its tunnelling port-forward.
pub fn wants_tunnel(offered: &[&str]) -> bool {
    offered
        .iter()
        .any(|o| o.starts_with("SPDY/3.1+") && o.ends_with(".k8s.io"))
}

/// One client message, decoded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ChannelMessage {
    Data { channel: u8, payload: Bytes },
    Close { channel: u8 },
}

#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum ChannelError {
    #[error("empty channel message")]
    Empty,
    #[error("close message must be 2 bytes, got {0}")]
    BadClose(usize),
    #[error("payload is not base64")]
    Base64,
}

/// Decodes one binary message of `v5.channel.k8s.io`.
pub fn decode(msg: &Bytes) -> Result<ChannelMessage, ChannelError> {
    decode_as(Protocol::V5, msg)
}

/// Decodes one message (binary or text alike) of `protocol`.
pub fn decode_as(protocol: Protocol, msg: &Bytes) -> Result<ChannelMessage, ChannelError> {
    match msg.first() {
        None => Err(ChannelError::Empty),
        Some(&CLOSE) if protocol.stream_close() && msg.len() == 2 => {
            Ok(ChannelMessage::Close { channel: msg[1] })
        }
        Some(&CLOSE) if protocol.stream_close() => Err(ChannelError::BadClose(msg.len())),
        Some(&digit) if protocol.base64() => Ok(ChannelMessage::Data {
            channel: digit.wrapping_sub(b'0'),
            payload: base64_decode(&msg[1..]).ok_or(ChannelError::Base64)?.into(),
        }),
        Some(&channel) => Ok(ChannelMessage::Data {
            channel,
            payload: msg.slice(1..),
        }),
    }
}

/// One message on `channel` in `protocol`'s framing.
pub fn encode(protocol: Protocol, channel: u8, data: &[u8]) -> Message {
    if protocol.base64() {
        let mut text = String::with_capacity(1 + data.len().div_ceil(3) * 4);
        text.push(char::from(b'0'.wrapping_add(channel)));
        base64_encode(data, &mut text);
        Message::Text(text.into())
    } else {
        let mut v = Vec::with_capacity(data.len() + 1);
        v.push(channel);
        v.extend_from_slice(data);
        Message::Binary(v.into())
    }
}

/// Standard base64 with padding, decoded as Go's `base64.StdEncoding`
/// decodes it for the kubelet: unused trailing bits are not checked.
const BASE64: base64::engine::GeneralPurpose = base64::engine::GeneralPurpose::new(
    &base64::alphabet::STANDARD,
    base64::engine::GeneralPurposeConfig::new().with_decode_allow_trailing_bits(true),
);

fn base64_encode(data: &[u8], out: &mut String) {
    base64::Engine::encode_string(&BASE64, data, out);
}

/// [`BASE64`]'s bytes, line breaks skipped (as Go's decoder skips them);
/// `None` if it is not base64.
fn base64_decode(text: &[u8]) -> Option<Vec<u8>> {
    let text: Vec<u8> = text
        .iter()
        .copied()
        .filter(|c| !matches!(c, b'\r' | b'\n'))
        .collect();
    base64::Engine::decode(&BASE64, text).ok()
}

type Socket = WebSocketStream<TokioIo<Upgraded>>;

async fn socket(upgraded: Upgraded) -> Socket {
    WebSocketStream::from_raw_socket(TokioIo::new(upgraded), Role::Server, None).await
}

/// The payload of a client message, binary or text; `None` at its Close or
/// the end of the connection.
async fn next_payload(source: &mut SplitStream<Socket>) -> Option<Option<Bytes>> {
    match source.next().await? {
        Ok(Message::Binary(b)) => Some(Some(b)),
        Ok(Message::Text(t)) => Some(Some(t.into())),
        Ok(Message::Close(_)) | Err(_) => None,
        Ok(_) => Some(None),
    }
}

/// Sends what `out` receives until a Close, then closes the socket.
fn spawn_writer(
    mut sink: futures::stream::SplitSink<Socket, Message>,
) -> (mpsc::Sender<Message>, JoinHandle<()>) {
    let (out_tx, mut out_rx) = mpsc::channel::<Message>(64);
    let writer = tokio::spawn(async move {
        while let Some(m) = out_rx.recv().await {
            let close = matches!(m, Message::Close(_));
            if sink.send(m).await.is_err() || close {
                break;
            }
        }
        let _ = sink.close().await;
    });
    (out_tx, writer)
}

/// A writer whose bytes go out as messages on `channel`; the task ends when
/// the writer is shut down or dropped, once all is queued.
fn output(
    out: &mpsc::Sender<Message>,
    protocol: Protocol,
    channel: u8,
) -> (DuplexStream, JoinHandle<()>) {
    let (near, mut far) = tokio::io::duplex(64 * 1024);
    let tx = out.clone();
    let pump = tokio::spawn(async move {
        let mut buf = vec![0u8; 32 * 1024];
        while let Ok(n) = far.read(&mut buf).await {
            if n == 0 || tx.send(encode(protocol, channel, &buf[..n])).await.is_err() {
                break;
            }
        }
    });
    (near, pump)
}

/// A normal close (1000): client-go treats a close without a status (1005) as an error.
fn normal_close() -> Message {
    Message::Close(Some(CloseFrame {
        code: CloseCode::Normal,
        reason: "".into(),
    }))
}

/// Sends a normal Close after what is queued, then reads up to the client's
/// Close for a bounded time. The client answers our Close with its own (RFC
/// 6455 7.1.1); dropping the socket before reading it leaves bytes unread, the
/// kernel resets the connection, and the client sees an abnormal closure
/// (1006) after the output.
async fn finish(out: mpsc::Sender<Message>, writer: JoinHandle<()>, mut reader: JoinHandle<()>) {
    let _ = out.send(normal_close()).await;
    drop(out);
    let _ = writer.await;
    if tokio::time::timeout(CLOSE_WAIT, &mut reader).await.is_err() {
        reader.abort();
    }
}

/// Runs an exec or attach over WebSocket in `protocol`. `run` gets the provider's streams.
// A write in a match guard would run for every message; keep it in the arm.
#[allow(clippy::collapsible_match)]
pub async fn serve_channels<F, Fut>(
    upgraded: Upgraded,
    protocol: Protocol,
    want: Requested,
    command: Vec<String>,
    run: F,
) where
    F: FnOnce(StreamIo) -> Fut,
    Fut: std::future::Future<Output = Outcome>,
{
    let want = want.normalized();
    let (sink, mut source) = socket(upgraded).await.split();
    let (out_tx, writer) = spawn_writer(sink);
    // The server speaks first: an empty message on the lowest writable channel.
    let first = if want.stdout {
        STDOUT
    } else if want.stderr {
        STDERR
    } else {
        ERROR
    };
    let _ = out_tx.send(encode(protocol, first, &[])).await;

    let mut pumps = Vec::new();
    let mut output = |channel: u8| {
        let (near, pump) = output(&out_tx, protocol, channel);
        pumps.push(pump);
        Box::new(near) as vkd_provider::BoxWrite
    };
    let stdout = want.stdout.then(|| output(STDOUT));
    let stderr = want.stderr.then(|| output(STDERR));
    let (stdin_near, mut stdin_far) = tokio::io::duplex(64 * 1024);
    let (resize_tx, resize_rx) = mpsc::channel::<TermSize>(16);
    let reader = tokio::spawn(async move {
        let mut stdin_open = true;
        while let Some(msg) = next_payload(&mut source).await {
            let Some(bytes) = msg else { continue };
            match decode_as(protocol, &bytes) {
                Ok(ChannelMessage::Data {
                    channel: STDIN,
                    payload,
                }) if stdin_open => {
                    if stdin_far.write_all(&payload).await.is_err() {
                        stdin_open = false;
                    }
                }
                Ok(ChannelMessage::Data {
                    channel: RESIZE,
                    payload,
                }) => {
                    if let Ok(size) = serde_json::from_slice::<TermSize>(&payload) {
                        let _ = resize_tx.try_send(size);
                    }
                }
                Ok(ChannelMessage::Close { channel: STDIN }) => {
                    let _ = stdin_far.shutdown().await;
                    stdin_open = false;
                }
                _ => {}
            }
        }
        let _ = stdin_far.shutdown().await;
    });
    let io = StreamIo {
        stdin: want
            .stdin
            .then(|| Box::new(stdin_near) as vkd_provider::BoxRead),
        stdout,
        stderr,
        tty: want.tty,
        resize: want.tty.then_some(resize_rx),
    };
    let outcome = run(io).await;
    for p in pumps {
        let _ = p.await;
    }
    let status = status_json(&outcome, &command);
    if protocol.status_json() {
        let _ = out_tx
            .send(encode(protocol, ERROR, status.to_string().as_bytes()))
            .await;
    } else if !matches!(outcome, Outcome::Exited(0)) {
        // Before v4 the error channel carries the failure's message alone.
        let message = status["message"].as_str().unwrap_or_default();
        let _ = out_tx
            .send(encode(protocol, ERROR, message.as_bytes()))
            .await;
    }
    finish(out_tx, writer, reader).await;
}

/// How long a finished stream waits for the client's Close before dropping the
/// connection.
const CLOSE_WAIT: Duration = Duration::from_secs(2);

/// The ports of a WebSocket port-forward: every `port` query value, each a
/// comma-separated list of ports above 0. The message is a 400's.
pub fn ports(pairs: &[(String, String)]) -> Result<Vec<u16>, String> {
    let mut ports = Vec::new();
    for (_, value) in pairs.iter().filter(|(k, _)| k == "port") {
        if value.is_empty() {
            return Err("query parameter \"port\" cannot be empty".into());
        }
        for p in value.split(',') {
            let port = p
                .parse::<u16>()
                .map_err(|_| format!("unable to parse {value:?} as a port"))?;
            if port == 0 {
                return Err(format!("port {value:?} must be > 0"));
            }
            ports.push(port);
        }
    }
    if ports.is_empty() {
        return Err("query parameter \"port\" is required".into());
    }
    Ok(ports)
}

/// Port-forward over WebSocket channels in `protocol`: one connection to each
/// of `ports`, for as long as the socket is open. The socket is closed once
/// every connection has ended toward the client (see [`portforward::run`]),
/// as the kubelet closes it when its last forward returns.
pub async fn serve_port_forward(
    upgraded: Upgraded,
    protocol: Protocol,
    ports: Vec<u16>,
    connect: Connect,
) {
    let (sink, mut source) = socket(upgraded).await.split();
    let (out_tx, writer) = spawn_writer(sink);
    let mut inbound = Vec::with_capacity(ports.len());
    let mut forwards = Vec::with_capacity(ports.len());
    for (i, &port) in ports.iter().enumerate() {
        // Channel numbers are one byte: ports past the 128th get none.
        let Ok(data_channel) = u8::try_from(i * 2) else {
            break;
        };
        let error_channel = data_channel.wrapping_add(1);
        for channel in [data_channel, error_channel] {
            let _ = out_tx
                .send(encode(protocol, channel, &port.to_le_bytes()))
                .await;
        }
        let (read, far) = tokio::io::duplex(64 * 1024);
        inbound.push(Some(far));
        let (write, pump) = output(&out_tx, protocol, data_channel);
        let (write, output_end) = portforward::watch_output(write, pump);
        let (error, error_pump) = output(&out_tx, protocol, error_channel);
        forwards.push(Forward {
            port,
            data: Box::new(tokio::io::join(read, write)),
            error: Box::new(error),
            error_pump,
            output_end,
        });
    }
    let reader = tokio::spawn(async move {
        while let Some(msg) = next_payload(&mut source).await {
            let Some(bytes) = msg else { continue };
            let Ok(ChannelMessage::Data { channel, payload }) = decode_as(protocol, &bytes) else {
                continue;
            };
            // Only data channels read; the error channels are the server's.
            if channel % 2 != 0 {
                continue;
            }
            if let Some(slot) = inbound.get_mut(usize::from(channel / 2))
                && let Some(w) = slot
                && w.write_all(&payload).await.is_err()
            {
                *slot = None;
            }
        }
        // The client is gone: every connection's input ends.
        drop(inbound);
    });
    let runs = forwards.into_iter().map(|fwd| {
        let connect = std::sync::Arc::clone(&connect);
        async move { portforward::run(fwd, &connect).await }
    });
    futures::future::join_all(runs).await;
    finish(out_tx, writer, reader).await;
}

/// Port-forward over WebSocket: SPDY frames carried in binary messages. Returns
/// a byte stream to hand to the SPDY session.
#[allow(clippy::collapsible_match)]
pub async fn tunnel(upgraded: Upgraded) -> tokio::io::DuplexStream {
    let (mut sink, mut source) = socket(upgraded).await.split();
    let (near, far) = tokio::io::duplex(256 * 1024);
    let (mut far_read, mut far_write) = tokio::io::split(far);
    tokio::spawn(async move {
        while let Some(Ok(msg)) = source.next().await {
            match msg {
                Message::Binary(b) => {
                    if far_write.write_all(&b).await.is_err() {
                        break;
                    }
                }
                Message::Close(_) => break,
                _ => {}
            }
        }
        let _ = far_write.shutdown().await;
    });
    tokio::spawn(async move {
        let mut buf = vec![0u8; 32 * 1024];
        while let Ok(n) = far_read.read(&mut buf).await {
            if n == 0
                || sink
                    .send(Message::Binary(Bytes::copy_from_slice(&buf[..n])))
                    .await
                    .is_err()
            {
                break;
            }
        }
        let _ = sink.close().await;
    });
    near
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn channel_messages() {
        assert_eq!(
            decode(&Bytes::from_static(b"\x00hi")),
            Ok(ChannelMessage::Data {
                channel: 0,
                payload: Bytes::from_static(b"hi")
            })
        );
        assert_eq!(
            decode(&Bytes::from_static(&[255, 0])),
            Ok(ChannelMessage::Close { channel: 0 })
        );
        assert_eq!(
            decode(&Bytes::from_static(&[255, 0, 1])),
            Err(ChannelError::BadClose(3))
        );
        assert_eq!(decode(&Bytes::new()), Err(ChannelError::Empty));
    }

    #[test]
    fn older_protocols_have_no_close_message() {
        for p in [Protocol::Unnamed, Protocol::V1, Protocol::V4] {
            assert_eq!(
                decode_as(p, &Bytes::from_static(&[255, 0])),
                Ok(ChannelMessage::Data {
                    channel: 255,
                    payload: Bytes::from_static(&[0])
                }),
                "{p:?}"
            );
        }
    }

    #[test]
    fn base64_framing() {
        let m = encode(Protocol::V1Base64, 1, b"hello\n");
        assert_eq!(m, Message::Text("1aGVsbG8K".into()));
        assert_eq!(
            encode(Protocol::V4Base64, 3, b""),
            Message::Text("3".into())
        );
        assert_eq!(
            encode(Protocol::V4, 2, b"x"),
            Message::Binary(Bytes::from_static(b"\x02x"))
        );
        assert_eq!(
            decode_as(Protocol::V4Base64, &Bytes::from_static(b"0aGk=")),
            Ok(ChannelMessage::Data {
                channel: 0,
                payload: Bytes::from_static(b"hi")
            })
        );
        assert_eq!(
            decode_as(Protocol::V1Base64, &Bytes::from_static(b"0a!==")),
            Err(ChannelError::Base64)
        );
    }

    #[test]
    fn base64_round_trips() {
        let all: Vec<u8> = (0..=255).collect();
        for len in 0..all.len() {
            let mut text = String::new();
            base64_encode(&all[..len], &mut text);
            assert_eq!(text.len(), len.div_ceil(3) * 4);
            assert_eq!(base64_decode(text.as_bytes()).as_deref(), Some(&all[..len]));
        }
        for bad in ["a", "ab=", "a===", "ab==cd==", "ab=c", "????"] {
            assert_eq!(base64_decode(bad.as_bytes()), None, "{bad}");
        }
        assert_eq!(
            base64_decode(b"aGVs\r\nbG8=").as_deref(),
            Some(&b"hello"[..])
        );
    }

    #[test]
    fn exec_protocol_is_the_kubelets_choice() {
        use Protocol::*;
        let cases: &[(&[&str], Option<Protocol>)] = &[
            (&[], Some(Unnamed)),
            (&["v5.channel.k8s.io"], Some(V5)),
            // v5 anywhere wins: the kubelet sends it to its v5 translator.
            (&["v4.channel.k8s.io", "v5.channel.k8s.io"], Some(V5)),
            (&["base64.channel.k8s.io", "channel.k8s.io"], Some(V1Base64)),
            (&["channel.k8s.io", "base64.channel.k8s.io"], Some(V1)),
            (
                &["v4.base64.channel.k8s.io", "v4.channel.k8s.io"],
                Some(V4Base64),
            ),
            (&["foo", "v4.channel.k8s.io"], Some(V4)),
            (&["SPDY/3.1+portforward.k8s.io"], None),
            (&["v3.channel.k8s.io"], None),
        ];
        for (offered, want) in cases {
            assert_eq!(Protocol::for_exec(offered), *want, "{offered:?}");
        }
    }

    #[test]
    fn port_forward_protocol_is_the_kubelets_choice() {
        use Protocol::*;
        let cases: &[(&[&str], Option<Protocol>)] = &[
            (&[], Some(Unnamed)),
            (&["v4.channel.k8s.io"], Some(V4)),
            (
                &["v4.base64.channel.k8s.io", "v4.channel.k8s.io"],
                Some(V4Base64),
            ),
            (&["channel.k8s.io", "v4.channel.k8s.io"], Some(V4)),
            (&["v5.channel.k8s.io"], None),
            (&["portforward.k8s.io"], None),
        ];
        for (offered, want) in cases {
            assert_eq!(Protocol::for_port_forward(offered), *want, "{offered:?}");
        }
        assert!(wants_tunnel(&[
            "v4.channel.k8s.io",
            "SPDY/3.1+portforward.k8s.io"
        ]));
        assert!(!wants_tunnel(&["v4.channel.k8s.io"]));
    }

    #[test]
    fn port_query() {
        let q = |s: &str| crate::kubelet_api::logs::query_pairs(s);
        assert_eq!(
            ports(&q("port=80&port=8080,9090")),
            Ok(vec![80, 8080, 9090])
        );
        assert!(ports(&q("")).is_err());
        assert!(ports(&q("port=")).is_err());
        assert!(ports(&q("port=0")).is_err());
        assert!(ports(&q("port=65536")).is_err());
        assert!(ports(&q("port=http")).is_err());
    }
}
