//! The WebSocket channel protocol `v5.channel.k8s.io` for exec and attach, which
//! the apiserver sends straight to a kubelet that declares
//! `ExtendWebSocketsToKubelet`, and `SPDY/3.1+portforward.k8s.io` (SPDY frames
//! inside binary messages) for port-forward.
//!
//! Each binary message is `[channel][payload]`: 0 stdin, 1 stdout, 2 stderr,
//! 3 error (the metav1.Status), 4 resize. v5 adds `[255, channel]`, by which the
//! client half-closes a channel (stdin, in practice).

use bytes::Bytes;
use futures::{SinkExt, StreamExt};
use hyper::upgrade::Upgraded;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;
use tokio_tungstenite::WebSocketStream;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::protocol::{CloseFrame, Role};
use vkd_provider::{StreamIo, TermSize};

use super::remotecommand::{Outcome, Requested, status_json};

pub const CHANNEL_PROTOCOL: &str = "v5.channel.k8s.io";
pub const TUNNEL_PROTOCOL: &str = "SPDY/3.1+portforward.k8s.io";

pub const STDIN: u8 = 0;
pub const STDOUT: u8 = 1;
pub const STDERR: u8 = 2;
pub const ERROR: u8 = 3;
pub const RESIZE: u8 = 4;
pub const CLOSE: u8 = 255;

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
}

/// Decodes one binary message of the channel protocol.
pub fn decode(msg: &Bytes) -> Result<ChannelMessage, ChannelError> {
    match msg.first() {
        None => Err(ChannelError::Empty),
        Some(&CLOSE) if msg.len() == 2 => Ok(ChannelMessage::Close { channel: msg[1] }),
        Some(&CLOSE) => Err(ChannelError::BadClose(msg.len())),
        Some(&channel) => Ok(ChannelMessage::Data {
            channel,
            payload: msg.slice(1..),
        }),
    }
}

fn framed(channel: u8, data: &[u8]) -> Message {
    let mut v = Vec::with_capacity(data.len() + 1);
    v.push(channel);
    v.extend_from_slice(data);
    Message::Binary(v.into())
}

async fn socket(upgraded: Upgraded) -> WebSocketStream<TokioIo<Upgraded>> {
    WebSocketStream::from_raw_socket(TokioIo::new(upgraded), Role::Server, None).await
}

/// Runs an exec or attach over WebSocket v5. `run` gets the provider's streams.
// A write in a match guard would run for every message; keep it in the arm.
#[allow(clippy::collapsible_match)]
pub async fn serve_channels<F, Fut>(
    upgraded: Upgraded,
    want: Requested,
    command: Vec<String>,
    run: F,
) where
    F: FnOnce(StreamIo) -> Fut,
    Fut: std::future::Future<Output = Outcome>,
{
    let want = want.normalized();
    let (mut sink, mut source) = socket(upgraded).await.split();
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
    // The server speaks first: an empty message on the lowest writable channel.
    let first = if want.stdout {
        STDOUT
    } else if want.stderr {
        STDERR
    } else {
        ERROR
    };
    let _ = out_tx.send(framed(first, &[])).await;

    let mut pumps = Vec::new();
    let mut output = |channel: u8| {
        let (near, mut far) = tokio::io::duplex(64 * 1024);
        let tx = out_tx.clone();
        pumps.push(tokio::spawn(async move {
            let mut buf = vec![0u8; 32 * 1024];
            while let Ok(n) = far.read(&mut buf).await {
                if n == 0 || tx.send(framed(channel, &buf[..n])).await.is_err() {
                    break;
                }
            }
        }));
        Box::new(near) as vkd_provider::BoxWrite
    };
    let stdout = want.stdout.then(|| output(STDOUT));
    let stderr = want.stderr.then(|| output(STDERR));
    let (stdin_near, mut stdin_far) = tokio::io::duplex(64 * 1024);
    let (resize_tx, resize_rx) = mpsc::channel::<TermSize>(16);
    let mut reader = tokio::spawn(async move {
        let mut stdin_open = true;
        while let Some(Ok(msg)) = source.next().await {
            let bytes = match msg {
                Message::Binary(b) => b,
                Message::Close(_) => break,
                _ => continue,
            };
            match decode(&bytes) {
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
    let status = status_json(&outcome, &command).to_string();
    let _ = out_tx.send(framed(ERROR, status.as_bytes())).await;
    // A normal close (1000): client-go treats a close without a status (1005) as an error.
    let close = CloseFrame {
        code: CloseCode::Normal,
        reason: "".into(),
    };
    let _ = out_tx.send(Message::Close(Some(close))).await;
    drop(out_tx);
    let _ = writer.await;
    // The client answers our Close with its own (RFC 6455 7.1.1). Dropping
    // the socket before reading it leaves bytes unread, the kernel resets the
    // connection, and the client sees an abnormal closure (1006) after the
    // output; so read up to its Close, for a bounded time.
    if tokio::time::timeout(CLOSE_WAIT, &mut reader).await.is_err() {
        reader.abort();
    }
}

/// How long a finished exec waits for the client's Close before dropping the
/// connection.
const CLOSE_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

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
}
