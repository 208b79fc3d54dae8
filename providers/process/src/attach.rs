//! `kubectl attach`: a container's output from now on, from its log, and with
//! `stdin: true`, its stdin through the shim's socket (`shim::stdin`), which
//! outlives vkd. Output is the log's, so stdout and stderr arrive merged, as
//! with a tty. The session ends when the container stops, or, as containerd's
//! attach, when the client's stdin ends on a container without `stdinOnce`
//! (or with a tty): the session detaches and the container keeps its stdin.
//! With `stdinOnce` the shim closes the container's stdin instead, and the
//! session shows what the container writes until it stops.

use futures::future::FusedFuture;
use futures::{FutureExt, StreamExt};
use tokio::io::AsyncWriteExt;
use vkd_provider::{LogRequest, Provider, ProviderError, Result, StreamIo};

use crate::{ProcessProvider, io_err};

impl ProcessProvider {
    pub(crate) async fn attach_container(
        &self,
        uid: &str,
        container: &str,
        io: StreamIo,
    ) -> Result<()> {
        let not_found = || ProviderError::NotFound {
            uid: uid.to_owned(),
        };
        let (sb, _, _) = self.read(uid)?.ok_or_else(not_found)?;
        let spec = sb
            .read_spec()
            .map_err(io_err(&sb.spec()))?
            .ok_or_else(not_found)?;
        let (index, wants_stdin, closes_stdin) = spec
            .spec
            .init_containers
            .iter()
            .chain(&spec.spec.containers)
            .enumerate()
            .find(|(_, c)| c.name == container)
            .map(|(i, c)| (i, c.stdin, c.stdin_once && !c.tty))
            .ok_or_else(|| {
                ProviderError::invalid(
                    "NotFound",
                    format!("no container {container:?} in this Pod"),
                )
            })?;
        // Only what is written from now on, as a runtime's attach.
        let logs = self
            .logs(
                uid,
                container,
                LogRequest {
                    follow: true,
                    ..LogRequest::default()
                },
            )
            .await?;
        let StreamIo {
            stdin,
            stdout,
            stderr,
            ..
        } = io;
        // A container without `stdin: true` has none to attach to (kubectl says so).
        let mut feed = match (stdin, wants_stdin) {
            (Some(mut input), true) => {
                let path = sb.attach_socket(index);
                let mut socket = tokio::net::UnixStream::connect(&path).await.map_err(|e| {
                    ProviderError::transient(format!(
                        "container {container:?}: its stdin is not open ({e})"
                    ))
                })?;
                async move {
                    let _ = tokio::io::copy(&mut input, &mut socket).await;
                    let _ = socket.shutdown().await;
                }
                .boxed()
                .fuse()
            }
            _ => futures::future::Fuse::terminated(),
        };
        if let Some(mut lines) = logs.follow {
            let mut out = stdout.or(stderr);
            loop {
                tokio::select! {
                    line = lines.next() => {
                        let Some(line) = line else { break };
                        let Some(w) = out.as_mut() else { continue };
                        if w.write_all(&line.bytes).await.is_err() || w.flush().await.is_err() {
                            // The client went away.
                            break;
                        }
                    }
                    () = &mut feed, if !feed.is_terminated() => {
                        if !closes_stdin {
                            break;
                        }
                    }
                }
            }
        }
        Ok(())
    }
}
