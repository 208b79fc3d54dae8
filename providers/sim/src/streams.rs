//! The sim's optional capabilities: logs, exec, attach, port-forward and stats.
//!
//! - **Logs**: a running container writes `sim: <ns>/<pod> <container> line <n>`
//!   every `sim.vkd.io/log-interval` (default 1s) from its start, so the log of
//!   any moment is known exactly. `previous` is the run before the last restart.
//!   At most [`MAX_HISTORY`] lines of history are kept.
//! - **Exec** runs built-in commands (no shell, no processes): `echo ARGS`, `cat`
//!   (stdin to stdout), `env` / `printenv`, `hostname`, `true`, `false`,
//!   `exit N`, `sleep SECONDS`, `stty size` (rows and columns of the last resize),
//!   `yes N` (N lines of "y"), and `sh -c "<one of these>"`. Anything else writes
//!   `sim: <cmd>: command not found` to stderr and exits 127, as a shell does.
//! - **Attach** streams the container's new log lines and answers each stdin line
//!   with `sim: attach received: <line>`, until the container stops.
//! - **Port-forward** to any port is an echo server.
//! - **Stats** are synthetic but stable: half the requested CPU (at least 50m) and
//!   half the requested memory (at least 8 MiB) per container.

use std::time::{Duration, SystemTime};

use bytes::Bytes;
use futures::StreamExt;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use vkd_provider::{
    ContainerState, Duplex, InstanceSpec, LogLine, LogRequest, Logs, ProviderError, Result,
    StreamIo, TermSize, parse_duration,
};

use crate::SimProvider;

pub const LOG_INTERVAL: &str = "sim.vkd.io/log-interval";
/// The most history lines a log read returns (the newest ones).
pub const MAX_HISTORY: u64 = 100_000;

/// One run of a container: when it started and, if it ended, when.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Run {
    start: SystemTime,
    end: Option<SystemTime>,
}

fn log_interval(spec: &InstanceSpec) -> Duration {
    spec.annotations
        .get(LOG_INTERVAL)
        .and_then(|v| parse_duration(v))
        .filter(|d| *d >= Duration::from_micros(100))
        .unwrap_or(Duration::from_secs(1))
}

fn line(spec: &InstanceSpec, container: &str, n: u64, time: SystemTime) -> LogLine {
    LogLine {
        time,
        bytes: Bytes::from(format!(
            "sim: {}/{} {container} line {n}\n",
            spec.pod.namespace, spec.pod.name
        )),
    }
}

/// How many lines a run writes in `span` (one at its start).
fn lines_in(span: Duration, every: Duration) -> u64 {
    u64::try_from(span.as_nanos() / every.as_nanos())
        .unwrap_or(u64::MAX)
        .saturating_add(1)
}

/// When line `n` of a run is written; `None` past what the clock holds.
fn line_time(start: SystemTime, every: Duration, n: u64) -> Option<SystemTime> {
    let nanos = every.as_nanos().checked_mul(u128::from(n))?;
    let secs = u64::try_from(nanos / 1_000_000_000).ok()?;
    start.checked_add(Duration::new(secs, (nanos % 1_000_000_000) as u32))
}

/// Lines of `run` from index `from` written before `until`.
fn lines_between(
    spec: &InstanceSpec,
    container: &str,
    run: Run,
    from: u64,
    until: SystemTime,
) -> Vec<LogLine> {
    let every = log_interval(spec);
    let stop = run.end.map_or(until, |e| e.min(until));
    let Ok(span) = stop.duration_since(run.start) else {
        return Vec::new();
    };
    let count = lines_in(span, every);
    let first = from.max(count.saturating_sub(MAX_HISTORY));
    (first..count)
        .filter_map(|n| Some(line(spec, container, n, line_time(run.start, every, n)?)))
        .filter(|l| l.time < stop || (run.end.is_none() && l.time <= stop))
        .collect()
}

fn not_running(what: &str) -> ProviderError {
    ProviderError::invalid("ContainerNotRunning", what.to_owned())
}

impl SimProvider {
    /// The instance of `uid`, or NotFound.
    pub(crate) async fn instance(&self, uid: &str) -> Result<vkd_provider::Instance> {
        vkd_provider::Provider::get(self, uid)
            .await?
            .ok_or_else(|| ProviderError::NotFound {
                uid: uid.to_owned(),
            })
    }

    fn spec_of(&self, uid: &str) -> Result<InstanceSpec> {
        self.state()
            .records
            .get(uid)
            .map(|r| r.spec.clone())
            .ok_or_else(|| ProviderError::NotFound {
                uid: uid.to_owned(),
            })
    }

    /// The current and previous run of a container, observed now.
    async fn runs(&self, uid: &str, container: &str) -> Result<(Option<Run>, Option<Run>)> {
        let inst = self.instance(uid).await?;
        let c = inst
            .containers
            .iter()
            .find(|c| c.name == container)
            .ok_or_else(|| {
                ProviderError::invalid(
                    "ContainerNotFound",
                    format!("container {container} is not valid for pod {}", inst.owner),
                )
            })?;
        let last = c.last_termination.as_ref().and_then(|t| {
            t.started_at.map(|start| Run {
                start,
                end: Some(t.finished_at),
            })
        });
        Ok(match &c.state {
            ContainerState::Running { started_at } => (
                Some(Run {
                    start: *started_at,
                    end: None,
                }),
                last,
            ),
            ContainerState::Terminated(t) => (
                t.started_at.map(|start| Run {
                    start,
                    end: Some(t.finished_at),
                }),
                last,
            ),
            ContainerState::Waiting { .. } => (last, last),
        })
    }

    pub(crate) async fn sim_logs(
        &self,
        uid: &str,
        container: &str,
        req: LogRequest,
    ) -> Result<Logs> {
        let spec = self.spec_of(uid)?;
        let (current, previous) = self.runs(uid, container).await?;
        let run = if req.previous {
            previous.ok_or_else(|| {
                ProviderError::invalid(
                    "NoPreviousContainer",
                    format!(
                        "previous terminated container \"{container}\" in pod \"{}\" not found",
                        spec.pod.name
                    ),
                )
            })?
        } else {
            current.ok_or_else(|| {
                ProviderError::invalid(
                    "ContainerWaiting",
                    format!("container \"{container}\" in pod \"{}\" is waiting to start: ContainerCreating", spec.pod.name),
                )
            })?
        };
        let now = SystemTime::now();
        let history = lines_between(&spec, container, run, 0, now);
        let follow = (req.follow && !req.previous).then(|| {
            let next = history.len() as u64 + lines_skipped(&spec, run, now);
            self.follow_lines(spec, container.to_owned(), uid.to_owned(), run, next)
        });
        Ok(Logs { history, follow })
    }

    /// New lines of `run` from index `next` on, until the run ends or the instance goes.
    fn follow_lines(
        &self,
        spec: InstanceSpec,
        container: String,
        uid: String,
        run: Run,
        next: u64,
    ) -> futures::stream::BoxStream<'static, LogLine> {
        let this = self.clone();
        let every = log_interval(&spec);
        futures::stream::unfold((next, run, false), move |(n, mut run, ended)| {
            let (this, spec, container, uid) =
                (this.clone(), spec.clone(), container.clone(), uid.clone());
            async move {
                if ended {
                    return None;
                }
                let at = line_time(run.start, every, n)?;
                loop {
                    if let Some(end) = run.end
                        && at >= end
                    {
                        return None;
                    }
                    let now = SystemTime::now();
                    if at <= now {
                        return Some((line(&spec, &container, n, at), (n + 1, run, false)));
                    }
                    tokio::time::sleep(
                        at.duration_since(now)
                            .unwrap_or_default()
                            .min(Duration::from_millis(250)),
                    )
                    .await;
                    // Has the run ended meanwhile (exit, crash, deletion)?
                    match this.runs(&uid, &container).await {
                        Ok((Some(cur), _)) if cur.start == run.start => run = cur,
                        Ok((_, Some(prev))) if prev.start == run.start => run = prev,
                        _ => return None,
                    }
                }
            }
        })
        .boxed()
    }

    pub(crate) async fn sim_exec(
        &self,
        uid: &str,
        container: &str,
        command: Vec<String>,
        mut io: StreamIo,
    ) -> Result<i32> {
        let (current, _) = self.runs(uid, container).await?;
        if current.is_none_or(|r| r.end.is_some()) {
            return Err(not_running(&format!(
                "container {container} is not running"
            )));
        }
        let spec = self.spec_of(uid)?;
        let code = run_builtin(&spec, container, command, &mut io).await;
        if let Some(out) = io.stdout.as_mut() {
            let _ = out.flush().await;
            let _ = out.shutdown().await;
        }
        if let Some(err) = io.stderr.as_mut() {
            let _ = err.flush().await;
            let _ = err.shutdown().await;
        }
        Ok(code)
    }

    pub(crate) async fn sim_attach(
        &self,
        uid: &str,
        container: &str,
        mut io: StreamIo,
    ) -> Result<()> {
        let (current, _) = self.runs(uid, container).await?;
        let run = current
            .filter(|r| r.end.is_none())
            .ok_or_else(|| not_running(&format!("container {container} is not running")))?;
        let spec = self.spec_of(uid)?;
        let now = SystemTime::now();
        let next = lines_between(&spec, container, run, 0, now).len() as u64
            + lines_skipped(&spec, run, now);
        let mut lines = self.follow_lines(spec, container.to_owned(), uid.to_owned(), run, next);
        let mut stdout = io.stdout.take();
        let mut stdin = io.stdin.take().map(|s| BufReader::new(s).lines());
        loop {
            tokio::select! {
                l = lines.next() => match l {
                    Some(l) => if let Some(out) = stdout.as_mut() && out.write_all(&l.bytes).await.is_err() { break },
                    None => break,
                },
                input = async { match stdin.as_mut() { Some(s) => s.next_line().await, None => std::future::pending().await } } => match input {
                    Ok(Some(text)) => {
                        if let Some(out) = stdout.as_mut() {
                            let _ = out.write_all(format!("sim: attach received: {text}\n").as_bytes()).await;
                        }
                    }
                    _ => stdin = None,
                },
            }
        }
        if let Some(mut out) = stdout {
            let _ = out.shutdown().await;
        }
        Ok(())
    }

    pub(crate) async fn sim_port_forward(&self, uid: &str, stream: Box<dyn Duplex>) -> Result<()> {
        let inst = self.instance(uid).await?;
        if inst.phase != vkd_provider::InstancePhase::Running {
            return Err(not_running("the pod is not running"));
        }
        let (mut r, mut w) = tokio::io::split(stream);
        let _ = tokio::io::copy(&mut r, &mut w).await;
        let _ = w.shutdown().await;
        Ok(())
    }
}

/// History lines dropped by the [`MAX_HISTORY`] cap before the returned ones.
fn lines_skipped(spec: &InstanceSpec, run: Run, now: SystemTime) -> u64 {
    let every = log_interval(spec);
    let stop = run.end.map_or(now, |e| e.min(now));
    let count = stop
        .duration_since(run.start)
        .map_or(0, |d| lines_in(d, every));
    count.saturating_sub(MAX_HISTORY)
}

async fn write(out: &mut Option<vkd_provider::BoxWrite>, bytes: &[u8]) {
    if let Some(o) = out.as_mut() {
        let _ = o.write_all(bytes).await;
    }
}

async fn run_builtin(
    spec: &InstanceSpec,
    container: &str,
    command: Vec<String>,
    io: &mut StreamIo,
) -> i32 {
    let mut argv = command;
    if argv.len() == 3 && (argv[0] == "sh" || argv[0] == "/bin/sh") && argv[1] == "-c" {
        argv = argv[2].split_whitespace().map(str::to_owned).collect();
    }
    let Some(cmd) = argv.first().cloned() else {
        write(&mut io.stderr, b"sim: no command given\n").await;
        return 126;
    };
    let args = &argv[1..];
    match cmd.as_str() {
        "echo" => {
            write(&mut io.stdout, format!("{}\n", args.join(" ")).as_bytes()).await;
            0
        }
        "cat" => {
            if let (Some(input), Some(out)) = (io.stdin.as_mut(), io.stdout.as_mut()) {
                let mut buf = vec![0u8; 32 * 1024];
                loop {
                    match input.read(&mut buf).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => {
                            if out.write_all(&buf[..n]).await.is_err() {
                                break;
                            }
                        }
                    }
                }
            }
            0
        }
        "env" | "printenv" => {
            let mut text = format!("HOSTNAME={}\n", spec.pod.name);
            if let Some(c) = spec.containers.iter().find(|c| c.name == container) {
                for (k, v) in &c.env {
                    text.push_str(&format!("{k}={v}\n"));
                }
            }
            write(&mut io.stdout, text.as_bytes()).await;
            0
        }
        "hostname" => {
            write(&mut io.stdout, format!("{}\n", spec.pod.name).as_bytes()).await;
            0
        }
        "true" => 0,
        "false" => 1,
        "exit" => args
            .first()
            .and_then(|a| a.parse::<u8>().ok())
            .map_or(0, i32::from),
        "sleep" => {
            let secs = args
                .first()
                .and_then(|a| a.parse::<f64>().ok())
                .unwrap_or(0.0)
                .clamp(0.0, 3600.0);
            tokio::time::sleep(Duration::from_secs_f64(secs)).await;
            0
        }
        "yes" => {
            let n = args
                .first()
                .and_then(|a| a.parse::<u64>().ok())
                .unwrap_or(1)
                .min(100_000_000);
            let chunk = "y\n".repeat(8192);
            let mut left = n;
            while left > 0 {
                let k = left.min(8192);
                write(&mut io.stdout, &chunk.as_bytes()[..(k as usize) * 2]).await;
                left -= k;
            }
            0
        }
        "stty" if args == ["size"] => {
            let mut size = TermSize::default();
            if let Some(rx) = io.resize.as_mut() {
                // The client sends the terminal size right after the streams open.
                if let Ok(Some(s)) = tokio::time::timeout(Duration::from_secs(2), rx.recv()).await {
                    size = s;
                }
                while let Ok(s) = rx.try_recv() {
                    size = s;
                }
            }
            write(
                &mut io.stdout,
                format!("{} {}\n", size.height, size.width).as_bytes(),
            )
            .await;
            0
        }
        other => {
            let target = if io.tty {
                &mut io.stdout
            } else {
                &mut io.stderr
            };
            write(
                target,
                format!("sim: {other}: command not found\n").as_bytes(),
            )
            .await;
            127
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vkd_provider::conformance::sample_spec;

    #[test]
    fn log_lines_are_deterministic() {
        let spec = sample_spec("n", "u");
        let t0 = SystemTime::UNIX_EPOCH + Duration::from_secs(1000);
        let run = Run {
            start: t0,
            end: None,
        };
        let lines = lines_between(&spec, "main", run, 0, t0 + Duration::from_millis(2500));
        assert_eq!(lines.len(), 3);
        assert_eq!(lines[2].bytes, "sim: conformance/pod-u main line 2\n");
        assert_eq!(lines[2].time, t0 + Duration::from_secs(2));
        let ended = Run {
            start: t0,
            end: Some(t0 + Duration::from_secs(2)),
        };
        assert_eq!(
            lines_between(&spec, "main", ended, 0, t0 + Duration::from_secs(100)).len(),
            2
        );
    }
}
