//! One container's life in the shim: each run (start, postStart, probes,
//! stop), the state it ends in, and its restarts by restartPolicy with the
//! kubelet's back-off.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use rustix::process::Signal;
use tokio::time::Instant;
use vkd_provider::{ContainerSpec, ContainerState, RestartPolicy, Terminated};

use super::probes::{ProbeOutcome, Probes};
use super::start::await_program;
use super::{Ended, LONGEST_WAIT, Shim, after, far_future, waiting};
use crate::procfs::exit_code;
use crate::sandbox::Launch;

const BACKOFF_START: Duration = Duration::from_secs(10);
const BACKOFF_MAX: Duration = Duration::from_secs(300);
/// A container that ran this long without failing starts its back-off afresh.
const BACKOFF_RESET: Duration = Duration::from_secs(600);

impl Shim {
    /// Runs one container until it ends for good; true when it ended well
    /// (for an init container: exited 0).
    pub(super) async fn run_container(self: Arc<Self>, i: usize, init: bool) -> bool {
        let (spec, launch) = self.container(i, init);
        let policy = self.spec.spec.restart_policy;
        let sidecar = self.sidecar(i, init);
        let mut backoff: Option<Duration> = None;
        let mut restarts = 0u32;
        loop {
            if self.stopping_for(sidecar) {
                return false;
            }
            let started = Instant::now();
            let (ended, oom, started_at) = self.run_once(i, init, restarts > 0).await;
            let finished_at = SystemTime::now();
            let term = self.terminated(spec, launch, ended, oom, started_at, finished_at);
            let ok = term.exit_code == 0;
            // A sidecar restarts whenever it ends, whatever the Pod's restartPolicy.
            let restart = !self.stopping_for(sidecar)
                && (sidecar
                    || match (policy, init) {
                        (RestartPolicy::Never, _) => false,
                        (RestartPolicy::Always, false) => true,
                        _ => !ok,
                    });
            if !restart {
                self.set(i, init, |c| {
                    c.status.state = ContainerState::Terminated(term);
                    c.status.ready = false;
                    c.status.started = Some(false);
                    c.process = None;
                });
                return ok;
            }
            if started.elapsed() >= BACKOFF_RESET {
                backoff = None;
            }
            // The kubelet restarts at once the first time, then backs off 10 s, 20 s, ... 5 min.
            if let Some(delay) = backoff {
                let message = format!(
                    "back-off {}s restarting failed container={} pod={}_{}",
                    delay.as_secs(),
                    spec.name,
                    self.spec.spec.pod.name,
                    self.spec.spec.pod.namespace
                );
                self.set(i, init, |c| {
                    c.status.state = waiting("CrashLoopBackOff", Some(message));
                    c.status.last_termination = Some(term.clone());
                    c.status.ready = false;
                    c.status.started = Some(false);
                    c.process = None;
                });
                tokio::select! {
                    () = tokio::time::sleep(delay) => {}
                    () = self.stop_wanted(sidecar) => {}
                }
            } else {
                self.set(i, init, |c| {
                    c.status.last_termination = Some(term.clone());
                    c.status.ready = false;
                    c.status.started = Some(false);
                });
            }
            backoff = Some(backoff.map_or(BACKOFF_START, |d| (d * 2).min(BACKOFF_MAX)));
            restarts += 1;
            self.set(i, init, |c| c.status.restart_count = restarts);
        }
    }

    /// How a run ended, as the container's state: `Completed`, `Error` or
    /// `OOMKilled` with its termination message, or `StartError`.
    pub(super) fn terminated(
        &self,
        spec: &ContainerSpec,
        launch: &Launch,
        ended: Ended,
        oom: bool,
        started_at: Option<SystemTime>,
        finished_at: SystemTime,
    ) -> Terminated {
        match ended {
            Ended::Exited(st) => {
                let code = exit_code(st);
                let reason = if oom {
                    "OOMKilled"
                } else if code == 0 {
                    "Completed"
                } else {
                    "Error"
                };
                Terminated {
                    exit_code: code,
                    reason: reason.into(),
                    message: self.termination_message(spec, launch, code),
                    started_at,
                    finished_at,
                }
            }
            Ended::StartFailed(message) => Terminated {
                exit_code: 128,
                reason: "StartError".into(),
                message: Some(message),
                started_at: None,
                finished_at,
            },
        }
    }

    /// One run: start, log, hooks, probes, until the process exits.
    /// Returns how it ended, whether the kernel killed it for memory, and when it started.
    pub(super) async fn run_once(
        &self,
        i: usize,
        init: bool,
        restarted: bool,
    ) -> (Ended, bool, Option<SystemTime>) {
        let (spec, launch) = self.container(i, init);
        let (writer, cgroup) = match self.prepare_run(spec, launch, restarted) {
            Ok(p) => p,
            Err(why) => return (Ended::StartFailed(why), false, None),
        };
        let index = self.launch_index(i, init);
        let (mut child, run) = match self.spawn_run(
            spec,
            launch,
            &writer,
            cgroup.as_deref(),
            Some(self.sandbox.mount_plan(index)),
        ) {
            Ok(r) => r,
            Err(why) => return (Ended::StartFailed(why), false, None),
        };
        self.set_stdin(index, child.stdin.take());
        if self.spec.isolated {
            await_program(&mut child, run.process).await;
        }
        let (process, started_at) = (run.process, run.started_at);
        let no_readiness = spec.readiness_probe.is_none() && spec.startup_probe.is_none();
        let sidecar = self.sidecar(i, init);
        // A regular init container is never ready while it runs; a sidecar is,
        // as a container is.
        let may_be_ready = !init || sidecar;
        // Started (the kubelet's `started`): past postStart and the startupProbe.
        let started_now = spec.post_start.is_none() && spec.startup_probe.is_none();
        self.set(i, init, |c| {
            c.status.state = ContainerState::Running { started_at };
            c.status.ready = no_readiness && may_be_ready;
            c.status.started = Some(started_now);
            c.status.container_id = Some(run.id.clone());
            c.process = process;
            c.cgroup = run.cgroup.clone();
            c.started_at = Some(started_at);
        });
        let group = process;
        let exit = child.wait();
        tokio::pin!(exit);
        let mut kill_at: Option<Instant> = None;
        let mut terminating = false;
        // A stopping sidecar, its preStop hook run, waits for its turn until this deadline.
        let mut turn_by: Option<Instant> = None;
        let mut changed = self.changed.subscribe();
        if let Some(h) = &spec.post_start {
            let grace = self.spec.spec.termination_grace;
            if let Some(why) = self
                .handle(h, launch, spec, grace, super::handler::Purpose::Hook)
                .await
                .failure()
            {
                self.note(&format!(
                    "postStart hook failed for container {}: {why}",
                    spec.name
                ));
                self.record_event(
                    &spec.name,
                    true,
                    ("FailedPostStartHook", "PostStart"),
                    format!("PostStartHook failed: {why}"),
                );
                terminating = true;
                kill_at = Some(self.terminate(group, None, launch, spec).await);
            }
        }
        let begin = Instant::now();
        let mut probes = Probes::new(spec, begin);
        let mut marked_started = started_now;
        let status = loop {
            if !terminating && !marked_started && probes.started {
                marked_started = true;
                self.set(i, init, |c| c.status.started = Some(true));
            }
            if let Some(by) = turn_by
                && (Instant::now() >= by || self.sidecar_turn(i))
            {
                turn_by = None;
                if let Some(g) = group {
                    self.ask_to_stop(g);
                }
                // The kubelet's floor: never less than 2 s between SIGTERM and SIGKILL.
                kill_at = Some(by.max(after(Duration::from_secs(2))));
            }
            let next = probes
                .next_due()
                .min(kill_at.unwrap_or_else(far_future))
                .min(turn_by.unwrap_or_else(far_future));
            tokio::select! {
                st = &mut exit => break st,
                () = self.stop_wanted(sidecar), if !terminating => {
                    terminating = true;
                    if sidecar {
                        turn_by = Some(self.pre_stop(spec.pre_stop.as_deref(), launch, spec).await);
                    } else {
                        kill_at = Some(self.terminate(group, spec.pre_stop.as_deref(), launch, spec).await);
                    }
                }
                r = changed.changed(), if turn_by.is_some() => {
                    if r.is_err() {
                        turn_by = Some(Instant::now());
                    }
                }
                () = tokio::time::sleep_until(next) => {
                    if kill_at.is_some_and(|k| Instant::now() >= k) {
                        if let Some(g) = group { g.signal_group(Signal::KILL); }
                        kill_at = None;
                        continue;
                    }
                    if terminating { continue; }
                    match probes.run_due(self, launch, spec).await {
                        ProbeOutcome::Nothing => {}
                        ProbeOutcome::Ready(r) => {
                            let ready = r && may_be_ready;
                            self.set(i, init, |c| c.status.ready = ready);
                        }
                        ProbeOutcome::Restart(why, grace) => {
                            self.note(&why);
                            self.record_event(&spec.name, false, ("Killing", "Kill"), why);
                            terminating = true;
                            let grace = grace.map(|g| g.min(LONGEST_WAIT));
                            kill_at = Some(self.terminate_within(grace, group, spec.pre_stop.as_deref(), launch, spec).await);
                        }
                    }
                }
            }
        };
        self.end_run(run, status).await
    }
}
