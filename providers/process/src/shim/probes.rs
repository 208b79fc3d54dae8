//! Startup, liveness and readiness probes of one container run, as the
//! kubelet's prober runs them: thresholds, periods, the startup probe gating
//! the others, and a minimal HTTP GET for httpGet probes and hooks.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::time::Instant;
use vkd_provider::{ContainerSpec, Probe};

use super::{Shim, after, far_future};
use crate::sandbox::Launch;

/// A minimal HTTP/1.1 GET for probes; returns the status code.
pub(super) async fn http_get(
    host: &str,
    port: u16,
    path: &str,
    headers: &[(String, String)],
) -> std::io::Result<u16> {
    let mut s = tokio::net::TcpStream::connect((host, port)).await?;
    let mut req = format!(
        "GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nUser-Agent: kube-probe/1.37\r\nAccept: */*\r\nConnection: close\r\n"
    );
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    s.write_all(req.as_bytes()).await?;
    let mut head = [0u8; 64];
    let mut n = 0;
    while n < 12 {
        let m = s.read(&mut head[n..]).await?;
        if m == 0 {
            break;
        }
        n += m;
    }
    let text = String::from_utf8_lossy(&head[..n]);
    text.split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .filter(|_| text.starts_with("HTTP/"))
        .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::InvalidData, "not an HTTP response"))
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
            let ok = shim
                .handle(&s.probe.handler, launch, spec, s.probe.timeout)
                .await;
            match s.record(ok) {
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
                            "container {} failed its startup probe, will be restarted",
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
            let ok = shim
                .handle(&l.probe.handler, launch, spec, l.probe.timeout)
                .await;
            if l.record(ok) == Some(false) {
                return ProbeOutcome::Restart(
                    format!(
                        "container {} failed its liveness probe, will be restarted",
                        spec.name
                    ),
                    l.probe.termination_grace,
                );
            }
        }
        if let Some(r) = self.readiness.as_mut()
            && r.next <= now
        {
            let ok = shim
                .handle(&r.probe.handler, launch, spec, r.probe.timeout)
                .await;
            if let Some(v) = r.record(ok)
                && self.ready != Some(v)
            {
                self.ready = Some(v);
                return ProbeOutcome::Ready(v);
            }
        }
        ProbeOutcome::Nothing
    }
}
