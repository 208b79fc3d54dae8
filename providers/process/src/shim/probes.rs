//! Startup, liveness and readiness probes of one container run, as the
//! kubelet's prober runs them: thresholds, periods, the startup probe gating
//! the others.

use std::time::Duration;

use tokio::time::Instant;
use vkd_provider::{ContainerSpec, Probe};

use super::handler::{Purpose, Verdict};
use super::{Shim, after, far_future};
use crate::sandbox::Launch;

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

    /// Runs the probe once (`kind`: `Startup`, `Liveness`, `Readiness`),
    /// gives its Event and records its result ([`ProbeState::record`]).
    async fn run(
        &mut self,
        shim: &Shim,
        launch: &Launch,
        spec: &ContainerSpec,
        kind: &str,
    ) -> Option<bool> {
        let verdict = shim
            .handle(
                &self.probe.handler,
                launch,
                spec,
                self.probe.timeout,
                Purpose::Probe,
            )
            .await;
        shim.probe_event(spec, kind, &verdict);
        self.record(&verdict)
    }

    /// Records a result; `Some(passing)` when the probe's verdict changed or
    /// holds. A probe that errored (no request the kubelet would make, a body
    /// cut short) counts for nothing, as the kubelet's prober worker throws
    /// such a result away: only its Event is given.
    fn record(&mut self, verdict: &Verdict) -> Option<bool> {
        self.next = after(self.probe.period);
        if matches!(verdict, Verdict::Errored { .. }) {
            return None;
        }
        if verdict.passed() {
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
            let result = s.run(shim, launch, spec, "Startup").await;
            match result {
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
            let result = l.run(shim, launch, spec, "Liveness").await;
            if result == Some(false) {
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
            let result = r.run(shim, launch, spec, "Readiness").await;
            if let Some(v) = result
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
mod tests {
    use super::*;

    /// As the kubelet's prober worker: a result that came with an error (no
    /// request the kubelet would make, a body cut short) is thrown away,
    /// neither a failure nor a success; a failure counts.
    #[test]
    fn an_errored_probe_counts_for_nothing() {
        let probe = Probe {
            handler: vkd_provider::Handler::TcpSocket {
                host: None,
                port: 80,
            },
            initial_delay: Duration::ZERO,
            period: Duration::from_secs(1),
            timeout: Duration::from_secs(1),
            success_threshold: 1,
            failure_threshold: 1,
            termination_grace: None,
        };
        let mut state = ProbeState::new(&probe, Instant::now());
        let errored = Verdict::Errored {
            result: "failure",
            why: "unexpected EOF".into(),
        };
        assert_eq!(state.record(&errored), None);
        assert_eq!(state.failures, 0);
        assert_eq!(
            state.record(&Verdict::Failure("refused".into())),
            Some(false)
        );
        assert_eq!(state.record(&errored), None);
        assert_eq!(state.record(&Verdict::Success), Some(true));
    }
}
