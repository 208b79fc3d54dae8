//! A SPDY/3.1 server session over an upgraded connection.
//!
//! One task reads frames, one writes them. The client opens every stream
//! (SYN_STREAM); each is answered at once with SYN_REPLY and handed to the caller
//! as an [`IncomingStream`]. PINGs from the client are echoed. Like the Go
//! implementation (spdystream), flow control is not enforced in either
//! direction: WINDOW_UPDATE and SETTINGS are ignored, so large outputs never
//! stall on a 64 KiB window. Any malformed frame ends the session with
//! GOAWAY(PROTOCOL_ERROR).

use std::collections::HashMap;

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::mpsc;
use tracing::debug;

use super::frame::{FLAG_FIN, Frame, GOAWAY_OK, GOAWAY_PROTOCOL_ERROR, RST_PROTOCOL_ERROR};
use super::headers::{HeaderDecoder, HeaderEncoder, Headers};

/// Data frames vkd sends carry at most this much.
const CHUNK: usize = 32 * 1024;

enum Out {
    Frame(Frame),
    Reply(u32),
    /// Send GOAWAY with this status and close the connection.
    Close(u32),
}

/// A stream the client opened.
#[derive(Debug)]
pub struct IncomingStream {
    pub id: u32,
    pub headers: Headers,
    /// Data from the client; ends at FIN or RST_STREAM.
    pub data: mpsc::Receiver<Bytes>,
    pub writer: StreamWriter,
}

/// Sends data on one stream.
#[derive(Clone, Debug)]
pub struct StreamWriter {
    id: u32,
    out: mpsc::Sender<Out>,
}

impl std::fmt::Debug for Out {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Out::Frame(fr) => write!(f, "Frame({fr:?})"),
            Out::Reply(id) => write!(f, "Reply({id})"),
            Out::Close(s) => write!(f, "Close({s})"),
        }
    }
}

impl StreamWriter {
    /// Sends `bytes` (split into frames); false once the session is gone.
    pub async fn write(&self, bytes: &[u8]) -> bool {
        for chunk in bytes.chunks(CHUNK) {
            let frame = Frame::Data {
                stream_id: self.id,
                flags: 0,
                data: Bytes::copy_from_slice(chunk),
            };
            if self.out.send(Out::Frame(frame)).await.is_err() {
                return false;
            }
        }
        true
    }

    /// Half-closes the stream from vkd's side.
    pub async fn fin(&self) {
        let _ = self
            .out
            .send(Out::Frame(Frame::Data {
                stream_id: self.id,
                flags: FLAG_FIN,
                data: Bytes::new(),
            }))
            .await;
    }

    /// An `AsyncWrite` for this stream: what is written is sent as DATA frames,
    /// and shutting it down (or dropping it) sends FIN. Await the handle to know
    /// everything was handed to the session.
    pub fn into_async_write(self) -> (vkd_provider::BoxWrite, tokio::task::JoinHandle<()>) {
        let (near, mut far) = tokio::io::duplex(64 * 1024);
        let pump = tokio::spawn(async move {
            let mut buf = vec![0u8; CHUNK];
            loop {
                match far.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => {
                        if !self.write(&buf[..n]).await {
                            return;
                        }
                    }
                }
            }
            self.fin().await;
        });
        (Box::new(near), pump)
    }
}

/// Controls the whole session.
#[derive(Clone, Debug)]
pub struct Session {
    out: mpsc::Sender<Out>,
}

impl Session {
    /// Starts reading and writing `io`; streams the client opens arrive on the receiver.
    pub fn spawn<IO>(io: IO) -> (Self, mpsc::Receiver<IncomingStream>)
    where
        IO: AsyncRead + AsyncWrite + Send + 'static,
    {
        let (read, write) = tokio::io::split(io);
        let (out_tx, out_rx) = mpsc::channel(256);
        let (streams_tx, streams_rx) = mpsc::channel(16);
        tokio::spawn(write_loop(write, out_rx));
        tokio::spawn(read_loop(read, out_tx.clone(), streams_tx));
        (Self { out: out_tx }, streams_rx)
    }

    /// GOAWAY(OK), then close the connection once queued frames are written.
    pub async fn close(&self) {
        let _ = self.out.send(Out::Close(GOAWAY_OK)).await;
    }

    /// Resets a stream (e.g. one the handler did not expect).
    pub async fn reset(&self, id: u32, status: u32) {
        let _ = self
            .out
            .send(Out::Frame(Frame::RstStream {
                stream_id: id,
                status,
            }))
            .await;
    }
}

async fn write_loop<W: AsyncWrite + Unpin>(mut w: W, mut rx: mpsc::Receiver<Out>) {
    let mut enc = HeaderEncoder::default();
    let mut buf = BytesMut::with_capacity(64 * 1024);
    let mut last_id = 0u32;
    while let Some(first) = rx.recv().await {
        let mut close = None;
        let mut next = Some(first);
        // Batch whatever is queued into one write.
        while let Some(item) = next.take() {
            match item {
                Out::Frame(f) => f.encode(&mut buf),
                Out::Reply(id) => {
                    last_id = last_id.max(id);
                    match enc.encode(&[]) {
                        Ok(block) => Frame::SynReply {
                            stream_id: id,
                            flags: 0,
                            block: block.into(),
                        }
                        .encode(&mut buf),
                        Err(_) => close = Some(GOAWAY_PROTOCOL_ERROR),
                    }
                }
                Out::Close(status) => close = Some(status),
            }
            if close.is_some() || buf.len() > 256 * 1024 {
                break;
            }
            next = rx.try_recv().ok();
        }
        if let Some(status) = close {
            Frame::GoAway {
                last_good: last_id,
                status,
            }
            .encode(&mut buf);
        }
        if w.write_all(&buf).await.is_err() {
            return;
        }
        buf.clear();
        if close.is_some() {
            let _ = w.flush().await;
            let _ = w.shutdown().await;
            return;
        }
        if rx.is_empty() {
            let _ = w.flush().await;
        }
    }
    let _ = w.shutdown().await;
}

async fn read_loop<R: AsyncRead + Unpin>(
    mut r: R,
    out: mpsc::Sender<Out>,
    streams: mpsc::Sender<IncomingStream>,
) {
    let mut dec = HeaderDecoder::default();
    let mut buf = BytesMut::with_capacity(64 * 1024);
    let mut inbound: HashMap<u32, mpsc::Sender<Bytes>> = HashMap::new();
    let mut last_id = 0u32;
    let status = 'session: loop {
        loop {
            let frame = match Frame::decode(&mut buf) {
                Ok(Some(f)) => f,
                Ok(None) => break,
                Err(e) => {
                    debug!(error = %e, "SPDY protocol error");
                    break 'session GOAWAY_PROTOCOL_ERROR;
                }
            };
            match frame {
                Frame::SynStream {
                    stream_id,
                    flags,
                    block,
                    ..
                } => {
                    let headers = match dec.decode(&block) {
                        Ok(h) => h,
                        Err(e) => {
                            debug!(error = %e, "bad SPDY header block");
                            break 'session GOAWAY_PROTOCOL_ERROR;
                        }
                    };
                    if stream_id % 2 == 0 || stream_id <= last_id {
                        let _ = out
                            .send(Out::Frame(Frame::RstStream {
                                stream_id,
                                status: RST_PROTOCOL_ERROR,
                            }))
                            .await;
                        continue;
                    }
                    last_id = stream_id;
                    let (tx, rx) = mpsc::channel(64);
                    if flags & FLAG_FIN == 0 {
                        inbound.insert(stream_id, tx);
                    }
                    let _ = out.send(Out::Reply(stream_id)).await;
                    let stream = IncomingStream {
                        id: stream_id,
                        headers,
                        data: rx,
                        writer: StreamWriter {
                            id: stream_id,
                            out: out.clone(),
                        },
                    };
                    if streams.send(stream).await.is_err() {
                        break 'session GOAWAY_OK;
                    }
                }
                Frame::Data {
                    stream_id,
                    flags,
                    data,
                } => {
                    if let Some(tx) = inbound.get(&stream_id)
                        && !data.is_empty()
                        && tx.send(data).await.is_err()
                    {
                        inbound.remove(&stream_id);
                    }
                    if flags & FLAG_FIN != 0 {
                        inbound.remove(&stream_id);
                    }
                }
                Frame::RstStream { stream_id, .. } => {
                    inbound.remove(&stream_id);
                }
                Frame::Ping { id } => {
                    // Echo the client's pings (odd ids); ours would be even.
                    if id % 2 == 1 {
                        let _ = out.send(Out::Frame(Frame::Ping { id })).await;
                    }
                }
                Frame::GoAway { .. } => break 'session GOAWAY_OK,
                Frame::Headers { block, .. } => {
                    // Keep the decompression context in step; the content is unused.
                    if dec.decode(&block).is_err() {
                        break 'session GOAWAY_PROTOCOL_ERROR;
                    }
                }
                Frame::SynReply { .. }
                | Frame::Settings
                | Frame::WindowUpdate { .. }
                | Frame::Unknown { .. } => {}
            }
        }
        match r.read_buf(&mut buf).await {
            // The client is gone (as Go's spdystream does, the session ends with
            // it): the connection, and its kubelet API slot, are let go now rather
            // than when the command the session started ends.
            Ok(0) | Err(_) => break 'session GOAWAY_OK,
            Ok(_) => {}
        }
    };
    drop(inbound);
    let _ = out.send(Out::Close(status)).await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::streaming::spdy::headers::get;
    use crate::streaming::spdy::testing::data;

    /// A minimal client: encodes frames with its own header context.
    struct Client {
        enc: HeaderEncoder,
        dec: HeaderDecoder,
    }

    impl Client {
        fn syn(&mut self, id: u32, kind: &str, fin: bool) -> Vec<u8> {
            super::super::testing::syn(&mut self.enc, id, &[("streamtype", kind)], fin)
        }
    }

    async fn read_frames(
        io: &mut tokio::io::DuplexStream,
        buf: &mut BytesMut,
        n: usize,
    ) -> Vec<Frame> {
        let mut frames = Vec::new();
        while frames.len() < n {
            while let Some(f) = Frame::decode(buf).unwrap() {
                frames.push(f);
            }
            if frames.len() >= n {
                break;
            }
            assert!(
                io.read_buf(buf).await.unwrap() > 0,
                "connection closed early: {frames:?}"
            );
        }
        frames
    }

    #[tokio::test]
    async fn streams_replies_pings_and_data() {
        let (mut client_io, server_io) = tokio::io::duplex(1 << 20);
        let (session, mut streams) = Session::spawn(server_io);
        let mut client = Client {
            enc: HeaderEncoder::default(),
            dec: HeaderDecoder::default(),
        };
        client_io
            .write_all(&client.syn(1, "stdin", false))
            .await
            .unwrap();
        client_io
            .write_all(&client.syn(3, "stdout", true))
            .await
            .unwrap();
        let mut stdin = streams.recv().await.unwrap();
        assert_eq!(get(&stdin.headers, "streamtype"), Some("stdin"));
        let stdout = streams.recv().await.unwrap();
        client_io.write_all(&data(1, b"hi", true)).await.unwrap();
        assert_eq!(stdin.data.recv().await.unwrap(), Bytes::from_static(b"hi"));
        assert!(
            stdin.data.recv().await.is_none(),
            "FIN ends the inbound data"
        );

        let mut ping = BytesMut::new();
        Frame::Ping { id: 7 }.encode(&mut ping);
        client_io.write_all(&ping).await.unwrap();
        let big = vec![b'x'; 200_000];
        assert!(stdout.writer.write(&big).await);
        stdout.writer.fin().await;

        let mut buf = BytesMut::new();
        let mut got = 0usize;
        let (mut replies, mut pings, mut goaway, mut fin) = (0, 0, false, false);
        let mut closed = false;
        while !goaway {
            if !closed && pings == 1 && fin {
                session.close().await;
                closed = true;
            }
            for f in read_frames(&mut client_io, &mut buf, 1).await {
                match f {
                    Frame::SynReply { block, .. } => {
                        client.dec.decode(&block).unwrap();
                        replies += 1;
                    }
                    Frame::Ping { id: 7 } => pings += 1,
                    Frame::Data {
                        stream_id: 3,
                        flags,
                        data,
                    } => {
                        got += data.len();
                        fin |= flags & FLAG_FIN != 0;
                    }
                    Frame::GoAway { .. } => goaway = true,
                    other => panic!("unexpected {other:?}"),
                }
            }
        }
        assert_eq!((replies, pings), (2, 1));
        assert_eq!(
            got,
            big.len(),
            "large output arrives whole, no window stall"
        );
        assert!(fin);
    }

    #[tokio::test]
    async fn garbage_gets_goaway_protocol_error() {
        let (mut client_io, server_io) = tokio::io::duplex(1 << 16);
        let (_session, _streams) = Session::spawn(server_io);
        client_io
            .write_all(&[0x80, 2, 0, 1, 0, 0, 0, 0])
            .await
            .unwrap();
        let mut buf = BytesMut::new();
        let frames = read_frames(&mut client_io, &mut buf, 1).await;
        assert_eq!(
            frames[0],
            Frame::GoAway {
                last_good: 0,
                status: GOAWAY_PROTOCOL_ERROR
            }
        );
    }

    /// A client that went away ends the session (and frees its connection) even
    /// while the session's handle, held by a running command, is still alive.
    #[tokio::test]
    async fn a_vanished_client_ends_the_session() {
        use tokio::io::AsyncReadExt;
        let (mut client_io, server_io) = tokio::io::duplex(1 << 16);
        let (_session, _streams) = Session::spawn(server_io);
        client_io.shutdown().await.unwrap();
        let mut rest = Vec::new();
        let closed = tokio::time::timeout(
            std::time::Duration::from_secs(2),
            client_io.read_to_end(&mut rest),
        )
        .await;
        assert!(closed.is_ok(), "the server kept the connection open");
    }
}
