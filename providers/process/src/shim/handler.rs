//! Hook and probe actions (exec, httpGet, tcpSocket, sleep, grpc) as the
//! shim runs them: an exec in the container's cgroup and, with namespaces, in
//! its namespaces. Each gives the kubelet's verdict and the output its Events
//! carry (`Liveness probe failed: …`).

use std::time::Duration;

use rustix::process::Signal;
use tokio::io::AsyncReadExt;
use vkd_provider::{ContainerSpec, Handler};

use super::Shim;
use super::dial::dial;
use super::http::{Get, HttpError, HttpOutcome, http_get};
use crate::sandbox::Launch;

/// The most of an action's output kept for its Event, as the kubelet's prober
/// reads at most 10 KiB.
const OUTPUT_MAX: usize = 10 << 10;

/// What an action came to, as the kubelet's prober results.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Verdict {
    Success,
    /// A success the kubelet reports with a `ProbeWarning` Event: an httpGet
    /// redirected to another host, which is not followed.
    Warning(String),
    Failure(String),
    /// The action could not be run as asked (the kubelet's "probe errored
    /// and resulted in <result> state"): a hook's failure; a probe's result
    /// that counts neither way, as the kubelet's prober worker drops it.
    Errored {
        result: &'static str,
        why: String,
    },
}

impl Verdict {
    pub(super) fn passed(&self) -> bool {
        self.failure().is_none()
    }

    /// Why the action failed, when it did.
    pub(super) fn failure(&self) -> Option<&str> {
        match self {
            Self::Success | Self::Warning(_) => None,
            Self::Failure(why) | Self::Errored { why, .. } => Some(why),
        }
    }
}

/// What an action is run for: the kubelet's prober and its hook runner
/// send different user agents and read an HTTP answer differently.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Purpose {
    Probe,
    Hook,
}

impl Shim {
    /// Runs a hook or probe action.
    pub(super) async fn handle(
        &self,
        h: &Handler,
        launch: &Launch,
        spec: &ContainerSpec,
        timeout: Duration,
        purpose: Purpose,
    ) -> Verdict {
        match h {
            Handler::Exec { command } => self.run_exec(command, launch, spec, timeout).await,
            Handler::HttpGet {
                host,
                port,
                path,
                headers,
                https,
            } => {
                let get = Get {
                    https: *https,
                    host: self.action_host(host.as_deref()),
                    port: *port,
                    path,
                    headers,
                    user_agent: match purpose {
                        Purpose::Probe => super::http::USER_AGENT,
                        Purpose::Hook => super::http::HOOK_USER_AGENT,
                    },
                };
                match http_get(&get, self.netns(), timeout).await {
                    // The kubelet's hook runner reads no status: any answer is done.
                    Ok(_) if purpose == Purpose::Hook => Verdict::Success,
                    Ok(HttpOutcome::Status(code)) if (200..400).contains(&code) => Verdict::Success,
                    Ok(HttpOutcome::Status(code)) => {
                        // As the kubelet: never the body of a failure (kubernetes#99425).
                        Verdict::Failure(format!("HTTP probe failed with statuscode: {code}"))
                    }
                    Ok(HttpOutcome::Redirected { body }) => Verdict::Warning(format!(
                        "Probe terminated redirects, Response body: {body}"
                    )),
                    // No request the kubelet would make: nothing was sent.
                    Err(HttpError::Unbuildable(why)) => Verdict::Errored {
                        result: "unknown",
                        why,
                    },
                    Err(HttpError::Body(why)) => Verdict::Errored {
                        result: "failure",
                        why,
                    },
                    Err(e @ HttpError::Get { .. }) => Verdict::Failure(e.to_string()),
                }
            }
            Handler::TcpSocket { host, port } => {
                let host = self.action_host(host.as_deref());
                let connect = dial(self.netns(), host, *port, timeout);
                match tokio::time::timeout(timeout, connect).await {
                    Ok(Ok(_)) => Verdict::Success,
                    Ok(Err(e)) => Verdict::Failure(e.go_text(host, *port)),
                    Err(_) => Verdict::Failure(format!(
                        "dial tcp {}: i/o timeout",
                        authority(host, *port)
                    )),
                }
            }
            Handler::Sleep { seconds } => {
                tokio::time::sleep(Duration::from_secs(*seconds).min(timeout)).await;
                Verdict::Success
            }
            Handler::Grpc { port, service, tls } => {
                let target = super::grpc::Target {
                    host: self.action_host(None),
                    netns: self.netns(),
                    port: *port,
                    service,
                    tls: *tls,
                };
                match super::grpc::check(&target, timeout).await {
                    Ok(()) => Verdict::Success,
                    Err(why) => Verdict::Failure(why),
                }
            }
            other => Verdict::Failure(format!("this provider does not run {other:?}")),
        }
    }

    /// Where a network action goes: the host it names, else the Pod's IP
    /// (127.0.0.1 without a Pod network).
    fn action_host<'a>(&'a self, named: Option<&'a str>) -> &'a str {
        named
            .filter(|h| !h.is_empty())
            .or(self.spec.pod_ip.as_deref())
            .unwrap_or("127.0.0.1")
    }

    /// The Pod's network namespace, where network actions connect from; none
    /// without a Pod network (they connect from the host's, as the
    /// kubelet's prober does).
    fn netns(&self) -> Option<&std::path::Path> {
        self.netns.as_deref()
    }

    /// An exec action: through the launcher as the container's processes
    /// run, its stdout and stderr together kept (the first 10 KiB) for the
    /// verdict.
    async fn run_exec(
        &self,
        command: &[String],
        launch: &Launch,
        spec: &ContainerSpec,
        timeout: Duration,
    ) -> Verdict {
        // Hooks and probes run in the container's cgroup, as its processes do.
        let cgroup = self
            .pod_cgroup
            .as_ref()
            .map(|p| p.join(&spec.name))
            .filter(|d| d.is_dir());
        // With namespaces, in the container's own.
        let held = self.sandbox.held_namespaces(&spec.name);
        let isolation = if self.spec.isolated {
            match self.process_of(&spec.name) {
                Some(p) => Some(crate::launch::Isolation::Enter {
                    launcher: p.pid,
                    held: &held,
                }),
                None => return Verdict::Failure("the container is not running".into()),
            }
        } else {
            None
        };
        let mut cmd = match self.command(launch, command, spec, cgroup.as_deref(), isolation) {
            Ok(c) => c,
            Err(e) => return Verdict::Failure(format!("preparing the command: {e}")),
        };
        let (reader, writer) = match std::io::pipe() {
            Ok(p) => p,
            Err(e) => return Verdict::Failure(format!("a pipe for the output: {e}")),
        };
        let second = match writer.try_clone() {
            Ok(w) => w,
            Err(e) => return Verdict::Failure(format!("a pipe for the output: {e}")),
        };
        cmd.stdout(std::process::Stdio::from(writer))
            .stderr(std::process::Stdio::from(second))
            .kill_on_drop(true);
        let spawned = self.spawn(&mut cmd);
        // The command's copies of the pipe's write end go, so the read ends
        // when the process (and what it left holding it) does.
        drop(cmd);
        let mut child = match spawned {
            Ok(c) => c,
            Err(e) => return Verdict::Failure(format!("starting {command:?}: {e}")),
        };
        let mut output =
            tokio::net::unix::pipe::Receiver::from_owned_fd(std::os::fd::OwnedFd::from(reader))
                .ok();
        let own = child.id();
        let pid = own.and_then(|p| i32::try_from(p).ok());
        let mut out = Vec::new();
        let ran = tokio::time::timeout(timeout, async {
            let mut buf = [0u8; 4096];
            loop {
                tokio::select! {
                    st = child.wait() => return st,
                    n = read_some(&mut output, &mut buf) => match n {
                        Some(n) => keep(&mut out, &buf[..n]),
                        None => output = None,
                    },
                }
            }
        })
        .await;
        let verdict = match ran {
            Ok(Ok(st)) => {
                // What the command wrote last, unless something it left keeps
                // the pipe open.
                if output.is_some() {
                    let _ = tokio::time::timeout(Duration::from_millis(100), async {
                        let mut buf = [0u8; 4096];
                        while let Some(n) = read_some(&mut output, &mut buf).await {
                            keep(&mut out, &buf[..n]);
                        }
                    })
                    .await;
                }
                let text = String::from_utf8_lossy(&out).into_owned();
                if st.success() {
                    Verdict::Success
                } else {
                    Verdict::Failure(text)
                }
            }
            Ok(Err(e)) => Verdict::Failure(format!("waiting for the command: {e}")),
            Err(_) => {
                if let Some(p) = pid.and_then(rustix::process::Pid::from_raw) {
                    let _ = rustix::process::kill_process_group(p, Signal::KILL);
                }
                // Reaped here, so its PID is never left for another to wait on.
                let _ = child.wait().await;
                Verdict::Failure(format!("command {:?} timed out", command.join(" ")))
            }
        };
        self.forget(own);
        verdict
    }
}

/// Reads from `output` while it is open: `None` at its end (or with none).
async fn read_some(
    output: &mut Option<tokio::net::unix::pipe::Receiver>,
    buf: &mut [u8],
) -> Option<usize> {
    match output {
        Some(r) => match r.read(buf).await {
            Ok(0) | Err(_) => None,
            Ok(n) => Some(n),
        },
        None => std::future::pending().await,
    }
}

/// Appends `bytes` to `out` up to [`OUTPUT_MAX`].
fn keep(out: &mut Vec<u8>, bytes: &[u8]) {
    let room = OUTPUT_MAX.saturating_sub(out.len());
    out.extend_from_slice(&bytes[..bytes.len().min(room)]);
}

/// `host:port`, with an IPv6 address in brackets.
pub(super) fn authority(host: &str, port: u16) -> String {
    if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// An I/O error as Go's net package words the common ones (what the
/// kubelet's probe Events say), without Rust's `(os error N)`.
pub(super) fn io_text(e: &std::io::Error) -> String {
    use std::io::ErrorKind;
    match e.kind() {
        ErrorKind::ConnectionRefused => "connect: connection refused".into(),
        ErrorKind::ConnectionReset => "read: connection reset by peer".into(),
        ErrorKind::TimedOut => "i/o timeout".into(),
        ErrorKind::HostUnreachable => "connect: no route to host".into(),
        ErrorKind::NetworkUnreachable => "connect: network is unreachable".into(),
        _ => e.to_string(),
    }
}
