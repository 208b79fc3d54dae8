//! The streams of [`GrpcProvider`]: exec and attach sessions (stdin and
//! resizes out, stdout, stderr and the exit code back) and the byte pump
//! port-forward shares with them.

use tokio::io::AsyncWriteExt;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use vkd_provider::{BoxWrite, ProviderError, Result, StreamIo};

use super::{GrpcProvider, bad_answer};
use crate::convert::error_of;
use crate::pb;

/// Sends what `from` gives as the messages `wrap` makes, then `end`.
pub(super) fn feed<R, T>(
    from: R,
    to: mpsc::Sender<T>,
    wrap: fn(Vec<u8>) -> T,
    end: T,
) -> tokio::task::JoinHandle<()>
where
    R: tokio::io::AsyncRead + Unpin + Send + 'static,
    T: Send + 'static,
{
    tokio::spawn(async move {
        if crate::pump(from, &to, wrap).await {
            let _ = to.send(end).await;
        }
    })
}

impl GrpcProvider {
    /// Exec or attach: stdin and resizes go out as they come; stdout, stderr
    /// and the exit code come back.
    pub(super) async fn session(
        &self,
        uid: &str,
        container: &str,
        command: Vec<String>,
        io: StreamIo,
        exec: bool,
    ) -> Result<i32> {
        let StreamIo {
            stdin,
            mut stdout,
            mut stderr,
            tty,
            resize,
        } = io;
        let (tx, rx) = mpsc::channel(16);
        let start = pb::StreamStart {
            uid: uid.into(),
            container: container.into(),
            command,
            stdin: stdin.is_some(),
            stdout: stdout.is_some(),
            stderr: stderr.is_some(),
            tty,
        };
        let _ = tx
            .send(pb::StreamIn {
                msg: Some(pb::stream_in::Msg::Start(start)),
            })
            .await;
        let outgoing = ReceiverStream::new(rx);
        let call = async {
            if exec {
                self.client().exec(outgoing).await
            } else {
                self.client().attach(outgoing).await
            }
        };
        let mut answers = tokio::time::timeout(self.timeout, call)
            .await
            .map_err(|_| {
                ProviderError::transient("provider plugin: no stream within the deadline")
            })?
            .map_err(|s| error_of(&s))?
            .into_inner();
        let mut feeders = Vec::new();
        if let Some(input) = stdin {
            feeders.push(feed(
                input,
                tx.clone(),
                |b| pb::StreamIn {
                    msg: Some(pb::stream_in::Msg::Stdin(b)),
                },
                pb::StreamIn {
                    msg: Some(pb::stream_in::Msg::StdinEnd(true)),
                },
            ));
        }
        if let Some(mut sizes) = resize {
            let tx = tx.clone();
            feeders.push(tokio::spawn(async move {
                while let Some(s) = sizes.recv().await {
                    let m = pb::StreamIn {
                        msg: Some(pb::stream_in::Msg::Resize(pb::TermSize {
                            width: s.width.into(),
                            height: s.height.into(),
                        })),
                    };
                    if tx.send(m).await.is_err() {
                        return;
                    }
                }
            }));
        }
        drop(tx);
        // Output goes to the caller while the caller reads it; once every
        // stream it asked for is gone (it hung up), the call ends, and with
        // it the session in the plugin.
        let asked_output = stdout.is_some() || stderr.is_some();
        let result = loop {
            match answers.message().await {
                Ok(Some(pb::StreamOut { msg: Some(m) })) => match m {
                    pb::stream_out::Msg::Exit(code) => break Ok(code),
                    pb::stream_out::Msg::Stdout(b) => write_or_drop(&mut stdout, &b).await,
                    // With a tty, stderr is stdout.
                    pb::stream_out::Msg::Stderr(b) if stderr.is_some() => {
                        write_or_drop(&mut stderr, &b).await;
                    }
                    pb::stream_out::Msg::Stderr(b) => write_or_drop(&mut stdout, &b).await,
                },
                Ok(Some(_)) => {}
                Ok(None) => break Err(bad_answer("the stream ended without an exit code".into())),
                Err(s) => break Err(error_of(&s)),
            }
            if asked_output && stdout.is_none() && stderr.is_none() {
                break Err(ProviderError::transient(
                    "the caller stopped reading the session's output",
                ));
            }
        };
        for w in [stdout.as_mut(), stderr.as_mut()].into_iter().flatten() {
            let _ = w.flush().await;
            let _ = w.shutdown().await;
        }
        for f in feeders {
            f.abort();
        }
        result
    }
}

/// Writes `bytes` to the caller's stream; a stream that fails is dropped
/// (the caller went away), never written again.
async fn write_or_drop(to: &mut Option<BoxWrite>, bytes: &[u8]) {
    if let Some(out) = to.as_mut()
        && out.write_all(bytes).await.is_err()
    {
        *to = None;
    }
}
