//! Logs, exec, attach and port-forward through the downstream API server's
//! Pod subresources: the downstream kubelet does the work, vkd relays bytes.

use std::time::SystemTime;

use futures::{AsyncBufReadExt, StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Status;
use kube::Api;
use kube::api::{AttachParams, AttachedProcess, LogParams, TerminalSize};
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use vkd_provider::{Duplex, LogLine, LogRequest, Logs, ProviderError, Result, StreamIo};

fn failed(what: &str, e: impl std::fmt::Display) -> ProviderError {
    ProviderError::transient(format!("downstream {what}: {e}"))
}

/// A line as the API server writes it with `timestamps=true`:
/// `<RFC 3339 time> <text>`. A line without a readable time keeps all its text.
fn parse_line(line: &str) -> LogLine {
    let (time, text) = match line.split_once(' ') {
        Some((t, rest)) => match t.parse::<jiff::Timestamp>() {
            Ok(ts) => (SystemTime::from(ts), rest),
            Err(_) => (SystemTime::now(), line),
        },
        None => (SystemTime::now(), line),
    };
    let mut bytes = Vec::with_capacity(text.len() + 1);
    bytes.extend_from_slice(text.as_bytes());
    bytes.push(b'\n');
    LogLine {
        time,
        bytes: bytes.into(),
    }
}

/// The log so far and, when following, what comes after it. vkd applies
/// since, tail, limitBytes and timestamps to what this returns.
pub(crate) async fn logs(
    api: &Api<Pod>,
    name: &str,
    container: &str,
    req: LogRequest,
) -> Result<Logs> {
    let params = LogParams {
        container: Some(container.to_owned()),
        previous: req.previous,
        timestamps: true,
        ..LogParams::default()
    };
    // Only what the request's bounds leave comes over the wire. The limit
    // counts the timestamp before each line too (vkd needs them), up to 32
    // bytes on a line of one byte, so the downstream limit is 32 times it.
    let history_params = LogParams {
        tail_lines: req.tail_lines.and_then(|n| i64::try_from(n).ok()),
        since_time: req.since.and_then(|t| jiff::Timestamp::try_from(t).ok()),
        limit_bytes: req
            .limit_bytes
            .and_then(|n| i64::try_from(n.saturating_mul(32)).ok()),
        ..params.clone()
    };
    let mut history = Vec::new();
    let mut lines = api
        .log_stream(name, &history_params)
        .await
        .map_err(|e| failed("log", e))?
        .lines();
    while let Some(line) = lines.try_next().await.map_err(|e| failed("log", e))? {
        history.push(parse_line(&line));
    }
    if !req.follow {
        return Ok(Logs {
            history,
            follow: None,
        });
    }
    // Follow from the last line read; lines stamped with the same instant
    // that were already read are skipped, so nothing is shown twice.
    let last = history.last().map(|l| l.time);
    let mut seen_at_last = history
        .iter()
        .rev()
        .take_while(|l| Some(l.time) == last)
        .count();
    let params = LogParams {
        follow: true,
        since_time: last.and_then(|t| jiff::Timestamp::try_from(t).ok()),
        ..params
    };
    let stream = api
        .log_stream(name, &params)
        .await
        .map_err(|e| failed("log", e))?
        .lines()
        .take_while(|l| std::future::ready(l.is_ok()))
        .filter_map(|l| std::future::ready(l.ok().map(|l| parse_line(&l))))
        .filter(move |l| {
            let keep = match last {
                Some(t) if l.time < t => false,
                Some(t) if l.time == t && seen_at_last > 0 => {
                    seen_at_last -= 1;
                    false
                }
                _ => true,
            };
            std::future::ready(keep)
        });
    Ok(Logs {
        history,
        follow: Some(stream.boxed()),
    })
}

async fn pump<R, W>(from: Option<R>, to: Option<W>, close: bool)
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    if let (Some(mut from), Some(mut to)) = (from, to) {
        // A client that went away ends the copy; that is no error of the session.
        let _ = tokio::io::copy(&mut from, &mut to).await;
        if close {
            let _ = to.shutdown().await;
        } else {
            let _ = to.flush().await;
        }
    }
}

fn params(container: &str, io: &StreamIo) -> AttachParams {
    AttachParams {
        container: Some(container.to_owned()),
        stdin: io.stdin.is_some(),
        stdout: io.stdout.is_some(),
        stderr: io.stderr.is_some() && !io.tty,
        tty: io.tty,
        ..AttachParams::default()
    }
}

/// Relays `io` to an attached process until its output ends; returns its exit code.
async fn relay(mut process: AttachedProcess, io: StreamIo) -> Result<i32> {
    let StreamIo {
        stdin,
        stdout,
        stderr,
        resize,
        ..
    } = io;
    let status = process.take_status();
    if let (Some(mut sizes), Some(sender)) = (resize, process.terminal_size()) {
        tokio::spawn(async move {
            while let Some(s) = sizes.recv().await {
                let size = TerminalSize {
                    width: s.width,
                    height: s.height,
                };
                if futures::SinkExt::send(&mut sender.clone(), size)
                    .await
                    .is_err()
                {
                    return;
                }
            }
        });
    }
    let input = tokio::spawn(pump(stdin, process.stdin(), true));
    let out = pump(process.stdout(), stdout, false);
    let err = pump(process.stderr(), stderr, false);
    tokio::join!(out, err);
    input.abort();
    let status = match status {
        Some(s) => s.await,
        None => None,
    };
    let _ = process.join().await;
    Ok(exit_code(status.as_ref()))
}

/// The exit code a remote command's final status carries (the kubelet's
/// `NonZeroExitCode` with an `ExitCode` cause); 0 on success.
fn exit_code(status: Option<&Status>) -> i32 {
    let Some(s) = status else { return 0 };
    if s.status.as_deref() == Some("Success") {
        return 0;
    }
    s.details
        .as_ref()
        .and_then(|d| d.causes.as_ref())
        .into_iter()
        .flatten()
        .find(|c| c.reason.as_deref() == Some("ExitCode"))
        .and_then(|c| c.message.as_deref()?.parse().ok())
        .unwrap_or(1)
}

pub(crate) async fn exec(
    api: &Api<Pod>,
    name: &str,
    container: &str,
    command: Vec<String>,
    io: StreamIo,
) -> Result<i32> {
    let process = api
        .exec(name, command, &params(container, &io))
        .await
        .map_err(|e| failed("exec", e))?;
    relay(process, io).await
}

pub(crate) async fn attach(
    api: &Api<Pod>,
    name: &str,
    container: &str,
    io: StreamIo,
) -> Result<()> {
    let process = api
        .attach(name, &params(container, &io))
        .await
        .map_err(|e| failed("attach", e))?;
    relay(process, io).await.map(|_| ())
}

pub(crate) async fn port_forward(
    api: &Api<Pod>,
    name: &str,
    port: u16,
    mut stream: Box<dyn Duplex>,
) -> Result<()> {
    let mut forwarder = api
        .portforward(name, &[port])
        .await
        .map_err(|e| failed("port-forward", e))?;
    let mut remote = forwarder
        .take_stream(port)
        .ok_or_else(|| failed("port-forward", "no stream for the port"))?;
    let _ = tokio::io::copy_bidirectional(&mut stream, &mut remote).await;
    drop(remote);
    forwarder.abort();
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use super::*;

    /// A downstream API server that answers every request with `body` and
    /// keeps the paths and queries it was asked.
    fn downstream(body: &'static str) -> (Api<Pod>, Arc<Mutex<Vec<String>>>) {
        let asked = Arc::new(Mutex::new(Vec::new()));
        let seen = Arc::clone(&asked);
        let server = tower::service_fn(move |req: http::Request<kube::client::Body>| {
            seen.lock().unwrap().push(req.uri().to_string());
            let body = http_body_util::Full::new(bytes::Bytes::from_static(body.as_bytes()));
            async move { Ok::<_, std::convert::Infallible>(http::Response::new(body)) }
        });
        let client = kube::Client::new(server, "default");
        (Api::namespaced(client, "vkd-team-a"), asked)
    }

    #[tokio::test]
    async fn only_what_the_read_shows_is_asked_of_the_downstream() {
        let (api, asked) = downstream("2026-12-06T00:00:03Z third\n2026-12-06T00:00:04Z fourth\n");
        let since = SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1_796_515_200);
        let req = LogRequest {
            tail_lines: Some(2),
            since: Some(since),
            limit_bytes: Some(100),
            ..LogRequest::default()
        };
        let got = logs(&api, "vkd-0123", "main", req).await.unwrap();
        let text: Vec<&[u8]> = got.history.iter().map(|l| &l.bytes[..]).collect();
        assert_eq!(text, [&b"third\n"[..], b"fourth\n"]);
        let asked = asked.lock().unwrap().clone();
        let [uri] = asked.as_slice() else {
            panic!("one read, not {asked:?}");
        };
        assert!(
            uri.starts_with("/api/v1/namespaces/vkd-team-a/pods/vkd-0123/log?"),
            "{uri}"
        );
        for part in [
            "container=main",
            "timestamps=true",
            "tailLines=2",
            "sinceTime=2026-12-06T00%3A00%3A00Z",
            // The timestamps count against the limit too: room for them.
            "limitBytes=3200",
        ] {
            assert!(uri.contains(part), "{part} not in {uri}");
        }
    }

    #[tokio::test]
    async fn an_unbounded_read_asks_for_the_whole_log() {
        let (api, asked) = downstream("");
        logs(&api, "vkd-0123", "main", LogRequest::default())
            .await
            .unwrap();
        let uri = asked.lock().unwrap()[0].clone();
        for part in ["tailLines", "sinceTime", "limitBytes"] {
            assert!(!uri.contains(part), "{part} in {uri}");
        }
    }

    #[test]
    fn log_lines_keep_their_time_and_text() {
        let l = parse_line("2026-01-01T00:00:01.5Z hello world");
        assert_eq!(&l.bytes[..], b"hello world\n");
        assert_eq!(
            l.time,
            SystemTime::UNIX_EPOCH + std::time::Duration::from_millis(1_767_225_601_500)
        );
        let raw = parse_line("no-time-here");
        assert_eq!(&raw.bytes[..], b"no-time-here\n");
    }

    #[test]
    fn exit_codes_come_from_the_status() {
        assert_eq!(exit_code(None), 0);
        let status = |v| serde_json::from_value::<Status>(v).ok();
        let failed = status(serde_json::json!({
            "status": "Failure", "reason": "NonZeroExitCode", "message": "exit 3",
            "details": {"causes": [{"reason": "ExitCode", "message": "3"}]}
        }));
        assert_eq!(exit_code(failed.as_ref()), 3);
        let ok = status(serde_json::json!({"status": "Success"}));
        assert_eq!(exit_code(ok.as_ref()), 0);
        let other = status(serde_json::json!({"status": "Failure", "reason": "InternalError"}));
        assert_eq!(exit_code(other.as_ref()), 1);
    }
}
