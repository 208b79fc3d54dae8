//! Startup, liveness and readiness probes of one container run, as the
//! kubelet's prober runs them: thresholds, periods, the startup probe gating
//! the others, and a minimal HTTP GET for httpGet probes and hooks.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::time::Instant;
use vkd_provider::{ContainerSpec, Probe};

use super::{Shim, after, far_future};
use crate::sandbox::Launch;

/// What an HTTP GET of a probe or hook came to.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum HttpOutcome {
    /// The final status code.
    Status(u16),
    /// A redirect that was not followed (to another host, or without a
    /// `Location`), with the start of its body.
    Redirected { body: String },
}

/// An HTTP GET for probes and hooks. Like the kubelet's prober, it follows
/// redirects to the same host (at most 10); a redirect elsewhere ends it, a
/// success the kubelet reports with a warning.
pub(super) async fn http_get(
    host: &str,
    port: u16,
    path: &str,
    headers: &[(String, String)],
) -> std::io::Result<HttpOutcome> {
    let (mut port, mut path) = (port, path.to_owned());
    for _ in 0..=10 {
        let reply = get_once(host, port, &path, headers).await?;
        if !(300..400).contains(&reply.code) {
            return Ok(HttpOutcome::Status(reply.code));
        }
        match reply.location.and_then(|l| local_target(host, port, &l)) {
            Some((p, rest)) => (port, path) = (p, rest),
            None => {
                return Ok(HttpOutcome::Redirected {
                    body: String::from_utf8_lossy(&reply.body).into_owned(),
                });
            }
        }
    }
    Err(std::io::Error::other("stopped after 10 redirects"))
}

/// Where a `Location` leads, when it is on `host`: its port and path.
fn local_target(host: &str, port: u16, location: &str) -> Option<(u16, String)> {
    if location.starts_with('/') {
        return Some((port, location.to_owned()));
    }
    let rest = location
        .strip_prefix("http://")
        .or_else(|| location.strip_prefix("https://"))?;
    let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
    let (name, port_text) = match authority.strip_prefix('[') {
        Some(inner) => {
            let (h, after) = inner.split_once(']')?;
            (h, after.strip_prefix(':'))
        }
        None => match authority.rsplit_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (authority, None),
        },
    };
    let default = if location.starts_with("https") {
        443
    } else {
        80
    };
    let p = match port_text {
        Some(t) => t.parse().ok()?,
        None => default,
    };
    (name == host).then(|| {
        let path = if path.is_empty() { "/" } else { path };
        (p, path.to_owned())
    })
}

/// The parts of an HTTP response a probe uses.
struct Reply {
    code: u16,
    location: Option<String>,
    /// The start of the body (at most 10 KiB), read for a redirect only.
    body: Vec<u8>,
}

/// The most of a redirect's body kept, as the kubelet's prober reads.
const BODY_MAX: usize = 10 << 10;

/// One GET.
async fn get_once(
    host: &str,
    port: u16,
    path: &str,
    headers: &[(String, String)],
) -> std::io::Result<Reply> {
    let mut s = tokio::net::TcpStream::connect((host, port)).await?;
    let mut req = format!(
        "GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nUser-Agent: kube-probe/1.37\r\nAccept: */*\r\nConnection: close\r\n"
    );
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    s.write_all(req.as_bytes()).await?;
    // The status line and headers, up to 16 KiB.
    let mut head = Vec::with_capacity(1024);
    let mut buf = [0u8; 1024];
    let end = loop {
        if let Some(at) = head.windows(4).position(|w| w == b"\r\n\r\n") {
            break Some(at);
        }
        if head.len() >= 16 << 10 {
            break None;
        }
        let m = s.read(&mut buf).await?;
        if m == 0 {
            break None;
        }
        head.extend_from_slice(&buf[..m]);
    };
    let (head, mut body) = match end {
        Some(at) => (head[..at].to_vec(), head[at + 4..].to_vec()),
        None => (head, Vec::new()),
    };
    let text = String::from_utf8_lossy(&head);
    let bad = || std::io::Error::new(std::io::ErrorKind::InvalidData, "not an HTTP response");
    let mut lines = text.split("\r\n");
    let status = lines
        .next()
        .filter(|l| l.starts_with("HTTP/"))
        .ok_or_else(bad)?;
    let code: u16 = status
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(bad)?;
    let fields: Vec<(&str, &str)> = lines
        .take_while(|l| !l.is_empty())
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim(), v.trim()))
        .collect();
    let field = |name: &str| {
        fields
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| *v)
    };
    let location = field("location").map(str::to_owned);
    if (300..400).contains(&code) && end.is_some() {
        // Up to its length, or to the end of the connection (`Connection: close`).
        let want = field("content-length")
            .and_then(|l| l.parse::<usize>().ok())
            .unwrap_or(BODY_MAX)
            .min(BODY_MAX);
        while body.len() < want {
            let m = s.read(&mut buf).await?;
            if m == 0 {
                break;
            }
            body.extend_from_slice(&buf[..m]);
        }
        body.truncate(want);
    } else {
        body.clear();
    }
    Ok(Reply {
        code,
        location,
        body,
    })
}

pub(super) enum ProbeOutcome {
    Nothing,
    Ready(bool),
    /// Restart the container, with the probe's own grace period if it has one.
    Restart(String, Option<Duration>),
}

struct ProbeState {
    probe: Probe,
    next: Instant,
    successes: u32,
    failures: u32,
}

impl ProbeState {
    fn new(p: &Probe, begin: Instant) -> Self {
        Self {
            probe: p.clone(),
            next: begin + p.initial_delay,
            successes: 0,
            failures: 0,
        }
    }

    /// Records a result; `Some(passing)` when the probe's verdict changed or holds.
    fn record(&mut self, ok: bool) -> Option<bool> {
        self.next = after(self.probe.period);
        if ok {
            self.failures = 0;
            self.successes += 1;
            (self.successes >= self.probe.success_threshold).then_some(true)
        } else {
            self.successes = 0;
            self.failures += 1;
            (self.failures >= self.probe.failure_threshold).then_some(false)
        }
    }
}

pub(super) struct Probes {
    startup: Option<ProbeState>,
    liveness: Option<ProbeState>,
    readiness: Option<ProbeState>,
    pub(super) started: bool,
    ready: Option<bool>,
}

impl Probes {
    pub(super) fn new(spec: &ContainerSpec, begin: Instant) -> Self {
        Self {
            startup: spec
                .startup_probe
                .as_ref()
                .map(|p| ProbeState::new(p, begin)),
            liveness: spec
                .liveness_probe
                .as_ref()
                .map(|p| ProbeState::new(p, begin)),
            readiness: spec
                .readiness_probe
                .as_ref()
                .map(|p| ProbeState::new(p, begin)),
            started: spec.startup_probe.is_none(),
            ready: None,
        }
    }

    pub(super) fn next_due(&self) -> Instant {
        let mut next = far_future();
        if !self.started {
            if let Some(s) = &self.startup {
                next = next.min(s.next);
            }
            return next;
        }
        for p in [&self.liveness, &self.readiness].into_iter().flatten() {
            next = next.min(p.next);
        }
        next
    }

    pub(super) async fn run_due(
        &mut self,
        shim: &Shim,
        launch: &Launch,
        spec: &ContainerSpec,
    ) -> ProbeOutcome {
        let now = Instant::now();
        if !self.started {
            let Some(s) = self.startup.as_mut() else {
                return ProbeOutcome::Nothing;
            };
            if s.next > now {
                return ProbeOutcome::Nothing;
            }
            let verdict = shim
                .handle(&s.probe.handler, launch, spec, s.probe.timeout)
                .await;
            shim.probe_event(spec, "Startup", &verdict);
            match s.record(verdict.passed()) {
                Some(true) => {
                    self.started = true;
                    let begin = Instant::now();
                    for p in [&mut self.liveness, &mut self.readiness]
                        .into_iter()
                        .flatten()
                    {
                        p.next = begin + p.probe.initial_delay;
                    }
                    if self.readiness.is_none() {
                        return ProbeOutcome::Ready(true);
                    }
                }
                Some(false) => {
                    return ProbeOutcome::Restart(
                        format!(
                            "Container {} failed startup probe, will be restarted",
                            spec.name
                        ),
                        s.probe.termination_grace,
                    );
                }
                None => {}
            }
            return ProbeOutcome::Nothing;
        }
        if let Some(l) = self.liveness.as_mut()
            && l.next <= now
        {
            let verdict = shim
                .handle(&l.probe.handler, launch, spec, l.probe.timeout)
                .await;
            shim.probe_event(spec, "Liveness", &verdict);
            if l.record(verdict.passed()) == Some(false) {
                return ProbeOutcome::Restart(
                    format!(
                        "Container {} failed liveness probe, will be restarted",
                        spec.name
                    ),
                    l.probe.termination_grace,
                );
            }
        }
        if let Some(r) = self.readiness.as_mut()
            && r.next <= now
        {
            let verdict = shim
                .handle(&r.probe.handler, launch, spec, r.probe.timeout)
                .await;
            shim.probe_event(spec, "Readiness", &verdict);
            if let Some(v) = r.record(verdict.passed())
                && self.ready != Some(v)
            {
                self.ready = Some(v);
                return ProbeOutcome::Ready(v);
            }
        }
        ProbeOutcome::Nothing
    }
}

#[cfg(test)]
mod redirect_tests {
    use super::local_target;

    #[test]
    fn only_redirects_to_the_same_host_are_followed() {
        assert_eq!(
            local_target("10.0.0.5", 8080, "/healthz"),
            Some((8080, "/healthz".into()))
        );
        assert_eq!(
            local_target("10.0.0.5", 8080, "http://10.0.0.5:9090/x?y=1"),
            Some((9090, "/x?y=1".into()))
        );
        assert_eq!(
            local_target("10.0.0.5", 8080, "http://10.0.0.5"),
            Some((80, "/".into()))
        );
        assert_eq!(
            local_target("10.0.0.5", 8080, "http://0.0.0.0/healthz"),
            None
        );
        assert_eq!(local_target("10.0.0.5", 8080, "ftp://10.0.0.5/"), None);
        assert_eq!(
            local_target("10.0.0.5", 8080, "http://10.0.0.5:notaport/"),
            None
        );
    }
}
