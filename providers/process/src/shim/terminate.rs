//! How a container's run ends: its preStop hook within the grace period,
//! then SIGTERM, then SIGKILL at the deadline; and what the end of a run
//! leaves to clean up (its process group, its cgroup, its log pumps).

use std::path::Path;
use std::process::ExitStatus;
use std::time::{Duration, SystemTime};

use rustix::process::Signal;
use tokio::time::Instant;
use vkd_provider::{ContainerSpec, Handler};

use super::{Ended, Run, Shim, after};
use crate::procfs::ProcessId;
use crate::sandbox::Launch;

impl Shim {
    /// After a container's process exited (`status`): what it left in its
    /// process group and its cgroup is killed, orphans reaped, its log
    /// flushed, its cgroup removed. Returns how it ended, whether the kernel
    /// killed it for memory, and when it started.
    pub(super) async fn end_run(
        &self,
        run: Run,
        status: std::io::Result<ExitStatus>,
    ) -> (Ended, bool, Option<SystemTime>) {
        self.forget(run.child_pid);
        // Whatever the container left in its group goes with it, as with a container's cgroup.
        if let Some(pid) = run
            .process
            .and_then(|g| rustix::process::Pid::from_raw(g.pid))
        {
            let _ = rustix::process::kill_process_group(pid, Signal::KILL);
        }
        if let Some(cg) = &run.cgroup {
            crate::cgroup::kill(cg);
        }
        // What the run left re-parented here is reaped before a restart counts
        // its processes against the Pod's limit again.
        tokio::time::sleep(Duration::from_millis(50)).await;
        self.reap_orphans(false);
        for p in run.pumps {
            let _ = tokio::time::timeout(Duration::from_secs(2), p).await;
        }
        let oom = run
            .cgroup
            .as_deref()
            .is_some_and(|cg| oom_kills(cg) > run.oom_before);
        if let Some(cg) = &run.cgroup {
            let _ = std::fs::remove_dir(cg);
        }
        match status {
            Ok(st) => (Ended::Exited(st), oom, Some(run.started_at)),
            Err(e) => (
                Ended::StartFailed(format!("waiting for the process: {e}")),
                oom,
                Some(run.started_at),
            ),
        }
    }

    /// Runs preStop within the grace period; returns when the grace period ends.
    pub(super) async fn pre_stop(
        &self,
        pre_stop: Option<&Handler>,
        launch: &Launch,
        spec: &ContainerSpec,
    ) -> Instant {
        self.pre_stop_within(self.grace(), pre_stop, launch, spec)
            .await
    }

    pub(super) async fn pre_stop_within(
        &self,
        grace: Duration,
        pre_stop: Option<&Handler>,
        launch: &Launch,
        spec: &ContainerSpec,
    ) -> Instant {
        let deadline = after(grace);
        if let Some(h) = pre_stop {
            // The hook bounds itself by `grace`; an outer timeout would drop it
            // half way and leave its process unreaped.
            if let Some(why) = self
                .handle(h, launch, spec, grace, super::handler::Purpose::Hook)
                .await
                .failure()
            {
                self.record_event(
                    &spec.name,
                    true,
                    ("FailedPreStopHook", "PreStop"),
                    format!("PreStopHook failed: {why}"),
                );
            }
        }
        deadline
    }

    /// Runs preStop (within the grace period), sends SIGTERM, and returns when to send SIGKILL.
    pub(super) async fn terminate(
        &self,
        group: Option<ProcessId>,
        pre_stop: Option<&Handler>,
        launch: &Launch,
        spec: &ContainerSpec,
    ) -> Instant {
        self.terminate_within(None, group, pre_stop, launch, spec)
            .await
    }

    /// As `terminate`, with `grace` instead of the Pod's when given (a
    /// probe's own terminationGracePeriodSeconds, as the kubelet uses it).
    pub(super) async fn terminate_within(
        &self,
        grace: Option<Duration>,
        group: Option<ProcessId>,
        pre_stop: Option<&Handler>,
        launch: &Launch,
        spec: &ContainerSpec,
    ) -> Instant {
        let grace = grace.unwrap_or_else(|| self.grace());
        let deadline = self.pre_stop_within(grace, pre_stop, launch, spec).await;
        if let Some(g) = group {
            self.ask_to_stop(g);
        }
        // Like the kubelet, a preStop hook that used the whole grace period still
        // leaves the process 2 s between SIGTERM and SIGKILL.
        let floor = if pre_stop.is_some() {
            Duration::from_secs(2)
        } else {
            Duration::ZERO
        };
        deadline.max(after(floor))
    }
}

pub(super) fn oom_kills(cgroup: &Path) -> u64 {
    std::fs::read_to_string(cgroup.join("memory.events"))
        .ok()
        .and_then(|t| {
            t.lines()
                .find_map(|l| l.strip_prefix("oom_kill ")?.trim().parse().ok())
        })
        .unwrap_or(0)
}
