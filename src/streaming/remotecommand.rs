//! The remotecommand protocol (exec and attach) on SPDY.
//!
//! For exec and attach the client opens `error`, then `stdin`, `stdout`,
//! `stderr` (not with a tty) and `resize` (with a tty) streams; vkd waits for the
//! set it asked for (30 s at most), runs the command, FINs stdout and stderr
//! (the client reads them to EOF before the error stream), writes one
//! metav1.Status on the error stream, and ends the session with GOAWAY.

use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use serde_json::json;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::io::StreamReader;
use vkd_provider::{BoxRead, StreamIo, TermSize};

use super::spdy::headers::get;
use super::spdy::session::{IncomingStream, Session, StreamWriter};

/// How long the client has to open its streams.
pub const STREAM_CREATION_TIMEOUT: Duration = Duration::from_secs(30);

/// Exec and attach protocols served over SPDY, most preferred first. v5 differs
/// from v4 only on WebSocket, so over SPDY the two behave the same.
pub const EXEC_PROTOCOLS: [&str; 2] = ["v5.channel.k8s.io", "v4.channel.k8s.io"];

/// Which streams the request asked for (`input`, `output`, `error`, `tty`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Requested {
    pub stdin: bool,
    pub stdout: bool,
    pub stderr: bool,
    pub tty: bool,
}

impl Requested {
    /// With a tty the kubelet drops stderr: the terminal merges it into stdout.
    pub fn normalized(mut self) -> Self {
        if self.tty {
            self.stderr = false;
        }
        self
    }
}

#[derive(Debug, thiserror::Error)]
pub enum StreamSetupError {
    #[error("timed out waiting for the client to open its streams")]
    Timeout,
    #[error("the connection closed before all streams were opened")]
    Closed,
}

/// The streams of one exec or attach, ready for the provider.
#[derive(Debug)]
pub struct Channels {
    pub io: StreamIo,
    error: StreamWriter,
    pumps: Vec<JoinHandle<()>>,
    session: Session,
}

/// A reader over a stream's inbound data.
pub fn reader(data: mpsc::Receiver<Bytes>) -> BoxRead {
    let stream = ReceiverStream::new(data).map(Ok::<_, std::io::Error>);
    Box::new(StreamReader::new(stream))
}

/// Parses the resize stream: JSON objects one after another.
fn spawn_resize(mut data: mpsc::Receiver<Bytes>) -> mpsc::Receiver<TermSize> {
    let (tx, rx) = mpsc::channel(16);
    tokio::spawn(async move {
        let mut buf: Vec<u8> = Vec::new();
        while let Some(chunk) = data.recv().await {
            buf.extend_from_slice(&chunk);
            let mut consumed = 0;
            {
                let mut it = serde_json::Deserializer::from_slice(&buf).into_iter::<TermSize>();
                loop {
                    match it.next() {
                        Some(Ok(size)) => {
                            consumed = it.byte_offset();
                            if tx.send(size).await.is_err() {
                                return;
                            }
                        }
                        Some(Err(e)) if e.is_eof() => break,
                        // Not a size: the stream is unusable, stop reading it.
                        Some(Err(_)) => return,
                        None => break,
                    }
                }
            }
            buf.drain(..consumed);
            if buf.len() > 4096 {
                return;
            }
        }
    });
    rx
}

/// Collects the streams of an exec or attach session.
pub async fn accept(
    session: Session,
    mut incoming: mpsc::Receiver<IncomingStream>,
    want: Requested,
) -> Result<Channels, StreamSetupError> {
    let want = want.normalized();
    let mut error = None;
    let mut io = StreamIo {
        stdin: None,
        stdout: None,
        stderr: None,
        tty: want.tty,
        resize: None,
    };
    let mut pumps = Vec::new();
    let (mut got_stdin, mut got_stdout, mut got_stderr, mut got_resize) =
        (false, false, false, false);
    let deadline = tokio::time::Instant::now() + STREAM_CREATION_TIMEOUT;
    loop {
        let complete = error.is_some()
            && got_stdin == want.stdin
            && got_stdout == want.stdout
            && got_stderr == want.stderr
            && got_resize == want.tty;
        if complete {
            break;
        }
        let stream = tokio::time::timeout_at(deadline, incoming.recv())
            .await
            .map_err(|_| StreamSetupError::Timeout)?
            .ok_or(StreamSetupError::Closed)?;
        match get(&stream.headers, "streamtype").unwrap_or_default() {
            "error" => error = Some(stream.writer),
            "stdin" if want.stdin => {
                io.stdin = Some(reader(stream.data));
                got_stdin = true;
            }
            "stdout" if want.stdout => {
                let (w, pump) = stream.writer.into_async_write();
                io.stdout = Some(w);
                pumps.push(pump);
                got_stdout = true;
            }
            "stderr" if want.stderr => {
                let (w, pump) = stream.writer.into_async_write();
                io.stderr = Some(w);
                pumps.push(pump);
                got_stderr = true;
            }
            "resize" if want.tty => {
                io.resize = Some(spawn_resize(stream.data));
                got_resize = true;
            }
            _ => {
                session
                    .reset(stream.id, super::spdy::frame::RST_CANCEL)
                    .await
            }
        }
    }
    // Later streams are not expected; keep the receiver drained so the reader never blocks.
    let drain = session.clone();
    tokio::spawn(async move {
        while let Some(s) = incoming.recv().await {
            drain.reset(s.id, super::spdy::frame::RST_CANCEL).await;
        }
    });
    Ok(Channels {
        io,
        error: error.ok_or(StreamSetupError::Closed)?,
        pumps,
        session,
    })
}

/// How an exec or attach ended.
#[derive(Debug)]
pub enum Outcome {
    Exited(i32),
    Error(String),
}

/// The metav1.Status the client reads from the error stream.
pub fn status_json(outcome: &Outcome, command: &[String]) -> serde_json::Value {
    match outcome {
        Outcome::Exited(0) => json!({"metadata": {}, "status": "Success"}),
        Outcome::Exited(code) => json!({
            "metadata": {},
            "status": "Failure",
            "message": format!(
                "command terminated with non-zero exit code: error executing command {:?}, exit code {code}",
                command
            ),
            "reason": "NonZeroExitCode",
            "details": {"causes": [{"reason": "ExitCode", "message": code.to_string()}]},
        }),
        Outcome::Error(message) => json!({
            "metadata": {},
            "status": "Failure",
            "message": message,
            "reason": "InternalError",
            "code": 500,
        }),
    }
}

impl Channels {
    /// Sends the outcome once stdout and stderr are finished, then ends the session.
    /// `io` must have been handed to the provider (and dropped) by then.
    pub async fn finish(self, outcome: Outcome, command: &[String]) {
        for pump in self.pumps {
            let _ = pump.await;
        }
        let status = status_json(&outcome, command).to_string();
        self.error.write(status.as_bytes()).await;
        self.error.fin().await;
        self.session.close().await;
    }

    /// Splits off the provider's streams, keeping what `finish` needs.
    pub fn take_io(&mut self) -> StreamIo {
        std::mem::replace(
            &mut self.io,
            StreamIo {
                stdin: None,
                stdout: None,
                stderr: None,
                tty: false,
                resize: None,
            },
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_codes_become_statuses() {
        let ok = status_json(&Outcome::Exited(0), &[]);
        assert_eq!(ok["status"], "Success");
        let bad = status_json(&Outcome::Exited(3), &["false".into()]);
        assert_eq!(bad["reason"], "NonZeroExitCode");
        assert_eq!(bad["details"]["causes"][0]["reason"], "ExitCode");
        assert_eq!(bad["details"]["causes"][0]["message"], "3");
        let err = status_json(&Outcome::Error("boom".into()), &[]);
        assert_eq!(err["code"], 500);
    }

    #[test]
    fn tty_drops_stderr() {
        let r = Requested {
            stdin: true,
            stdout: true,
            stderr: true,
            tty: true,
        }
        .normalized();
        assert!(!r.stderr);
    }

    #[tokio::test]
    async fn resize_stream_parses_split_json() {
        let (tx, rx) = mpsc::channel(4);
        let mut sizes = spawn_resize(rx);
        tx.send(Bytes::from_static(b"{\"Width\":80,\"Hei"))
            .await
            .unwrap();
        tx.send(Bytes::from_static(
            b"ght\":24}{\"Width\":100,\"Height\":40}",
        ))
        .await
        .unwrap();
        assert_eq!(
            sizes.recv().await,
            Some(TermSize {
                width: 80,
                height: 24
            })
        );
        assert_eq!(
            sizes.recv().await,
            Some(TermSize {
                width: 100,
                height: 40
            })
        );
    }
}
