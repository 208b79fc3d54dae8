//! `kubectl attach`: a container's output from now on, from its log, and with
//! `stdin: true`, its stdin through the shim's socket (`shim::stdin`), which
//! outlives vkd. Output is the log's, so stdout and stderr arrive merged, as
//! with a tty; the session ends when the container stops.

use futures::StreamExt;
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
        let (index, wants_stdin) = spec
            .spec
            .init_containers
            .iter()
            .chain(&spec.spec.containers)
            .enumerate()
            .find(|(_, c)| c.name == container)
            .map(|(i, c)| (i, c.stdin))
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
        let feed = match (stdin, wants_stdin) {
            (Some(mut input), true) => {
                let path = sb.attach_socket(index);
                let mut socket = tokio::net::UnixStream::connect(&path).await.map_err(|e| {
                    ProviderError::transient(format!(
                        "container {container:?}: its stdin is not open ({e})"
                    ))
                })?;
                Some(tokio::spawn(async move {
                    let _ = tokio::io::copy(&mut input, &mut socket).await;
                    let _ = socket.shutdown().await;
                }))
            }
            _ => None,
        };
        if let Some(mut lines) = logs.follow {
            let mut out = stdout.or(stderr);
            while let Some(line) = lines.next().await {
                let Some(w) = out.as_mut() else { continue };
                if w.write_all(&line.bytes).await.is_err() || w.flush().await.is_err() {
                    // The client went away.
                    break;
                }
            }
        }
        if let Some(feed) = feed {
            feed.abort();
        }
        Ok(())
    }
}
