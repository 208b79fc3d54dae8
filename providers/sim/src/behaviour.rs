//! What a simulated container does, chosen by the Pod's annotations, and its state
//! at any moment as a pure function of the creation time. Because the state is
//! derived rather than stored, a restarted daemon sees exactly what the backend
//! "did" meanwhile.
//!
//! | annotation | values | default |
//! |---|---|---|
//! | `sim.vkd.io/behavior` | `run` (forever), `exit` (exit after `run-for`), `crash-loop` (exit non-zero after `run-for`) | `run` |
//! | `sim.vkd.io/exit-code` | exit code for `exit` and `crash-loop` | 0 for `exit`, 1 for `crash-loop` |
//! | `sim.vkd.io/run-for` | how long each run lasts, e.g. `2s` | `2s` |
//! | `sim.vkd.io/crash-after` | fault injection: the first run dies with 137 after this long | none |
//! | `sim.vkd.io/stop-delay` | how long the instance takes to stop after SIGTERM (capped by the grace period) | `0s` |
//! | `sim.vkd.io/cpu-usage` | CPU each running container uses, a quantity (`250m`, `1`) | half its share of the Pod's requests, at least `50m` |
//! | `sim.vkd.io/memory-usage` | working set of each running container (`64Mi`) | half its share of the Pod's requests, at least `8Mi` |
//! | `sim.vkd.io/gpu-utilization` | percent of time each of the Pod's GPUs is busy, 0 to 100 | `80` |
//! | `sim.vkd.io/gpu-memory-usage` | memory used on each of the Pod's GPUs (at most the GPU's) | half the GPU's |
//!
//! Durations are at most 365 days. Times are computed with checked arithmetic:
//! a moment past what the clock can represent (from a record written before
//! the bound, say) is "never", not a panic.
//!
//! Restarts follow the Pod's restartPolicy with the kubelet's CrashLoopBackOff:
//! 10 s, doubling, capped at 5 minutes.

use std::collections::BTreeMap;
use std::time::{Duration, SystemTime};

use vkd_provider::{ContainerState, InstancePhase, RestartPolicy, Terminated, duration};

use crate::fleet::Latency;

pub const BEHAVIOR: &str = "sim.vkd.io/behavior";
pub const EXIT_CODE: &str = "sim.vkd.io/exit-code";
pub const RUN_FOR: &str = "sim.vkd.io/run-for";
pub const CRASH_AFTER: &str = "sim.vkd.io/crash-after";
pub const STOP_DELAY: &str = "sim.vkd.io/stop-delay";
pub const CPU_USAGE: &str = "sim.vkd.io/cpu-usage";
pub const MEMORY_USAGE: &str = "sim.vkd.io/memory-usage";
pub const GPU_UTILIZATION: &str = "sim.vkd.io/gpu-utilization";
pub const GPU_MEMORY_USAGE: &str = "sim.vkd.io/gpu-memory-usage";

/// At most 1,024 cores and 64 TiB per container: far past any host, and so
/// far from overflowing the counters they are multiplied into.
const MAX_CPU_USAGE_MILLIS: u64 = 1_024_000;
const MAX_MEMORY_USAGE_BYTES: u64 = 64 << 40;

const BACKOFF_BASE: Duration = Duration::from_secs(10);
const BACKOFF_CAP: Duration = Duration::from_secs(300);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Run,
    Exit,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Behaviour {
    pub kind: Kind,
    pub exit_code: i32,
    pub run_for: Duration,
    pub crash_after: Option<Duration>,
    pub stop_delay: Duration,
    /// What each running container uses, when the Pod says (`None`: derived
    /// from its requests).
    pub cpu_usage_millis: Option<u64>,
    pub memory_usage_bytes: Option<u64>,
    /// What the Pod's GPUs do, when the Pod says.
    pub gpu_utilization_percent: Option<u32>,
    pub gpu_memory_usage_bytes: Option<u64>,
}

/// A usage annotation: a quantity above 0 (metrics-server drops a Pod
/// whose container reads 0) and at most `max`.
fn usage(
    a: &BTreeMap<String, String>,
    key: &str,
    parse: fn(&str) -> Result<u64, vkd_provider::quantity::QuantityError>,
    max: u64,
) -> Result<Option<u64>, String> {
    let Some(v) = a.get(key) else {
        return Ok(None);
    };
    match parse(v) {
        Ok(0) => Err(format!("annotation {key}={v:?}: usage must be above 0")),
        Ok(n) if n > max => Err(format!("annotation {key}={v:?} is more than a host has")),
        Ok(n) => Ok(Some(n)),
        Err(e) => Err(format!("annotation {key}: {e}")),
    }
}

/// Reads the behaviour annotations; an error names the annotation and what is wrong.
pub fn from_annotations(a: &BTreeMap<String, String>) -> Result<Behaviour, String> {
    // Bounded (365 days), so adding one to a clock cannot overflow it.
    let dur = |key: &str, default: Duration| -> Result<Duration, String> {
        a.get(key).map_or(Ok(default), |v| {
            duration::parse(v).map_err(|e| format!("annotation {key}: {e}"))
        })
    };
    let (kind, default_code) = match a.get(BEHAVIOR).map(String::as_str) {
        None | Some("run") => (Kind::Run, 0),
        Some("exit") => (Kind::Exit, 0),
        Some("crash-loop") => (Kind::Exit, 1),
        Some(other) => {
            return Err(format!(
                "annotation {BEHAVIOR}={other:?} is not one of run, exit, crash-loop"
            ));
        }
    };
    let exit_code = match a.get(EXIT_CODE) {
        None => default_code,
        Some(v) => v.parse::<u8>().map(i32::from).map_err(|_| {
            format!("annotation {EXIT_CODE}={v:?} is not an exit code from 0 to 255")
        })?,
    };
    Ok(Behaviour {
        kind,
        exit_code,
        run_for: dur(RUN_FOR, Duration::from_secs(2))?,
        crash_after: a
            .get(CRASH_AFTER)
            .map(|_| dur(CRASH_AFTER, Duration::ZERO))
            .transpose()?,
        stop_delay: dur(STOP_DELAY, Duration::ZERO)?,
        cpu_usage_millis: usage(
            a,
            CPU_USAGE,
            vkd_provider::quantity::cpu_millis,
            MAX_CPU_USAGE_MILLIS,
        )?,
        memory_usage_bytes: usage(
            a,
            MEMORY_USAGE,
            vkd_provider::quantity::bytes,
            MAX_MEMORY_USAGE_BYTES,
        )?,
        gpu_utilization_percent: a
            .get(GPU_UTILIZATION)
            .map(|v| match v.parse::<u32>() {
                Ok(n) if n <= 100 => Ok(n),
                _ => Err(format!(
                    "annotation {GPU_UTILIZATION}={v:?} is not a percent from 0 to 100"
                )),
            })
            .transpose()?,
        gpu_memory_usage_bytes: usage(
            a,
            GPU_MEMORY_USAGE,
            vkd_provider::quantity::bytes,
            MAX_MEMORY_USAGE_BYTES,
        )?,
    })
}

/// One container's state at a moment, and when it next changes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Observed {
    pub state: ContainerState,
    pub last_termination: Option<Terminated>,
    pub ready: bool,
    pub restart_count: u32,
    pub next_change: Option<SystemTime>,
    /// The container ended and will not restart.
    pub done: bool,
}

fn backoff(restarts: u32) -> Duration {
    BACKOFF_BASE
        .checked_mul(1u32 << restarts.min(16))
        .map_or(BACKOFF_CAP, |d| d.min(BACKOFF_CAP))
}

fn terminated(code: i32, started: SystemTime, finished: SystemTime, crashed: bool) -> Terminated {
    Terminated {
        exit_code: code,
        reason: if code == 0 { "Completed" } else { "Error" }.into(),
        message: crashed.then(|| "simulated instance crash (sim.vkd.io/crash-after)".into()),
        started_at: Some(started),
        finished_at: finished,
    }
}

/// Still waiting to be created, next changing at `next` (`None`: never).
fn creating(next: Option<SystemTime>) -> Observed {
    Observed {
        state: ContainerState::Waiting {
            reason: "ContainerCreating".into(),
            message: None,
        },
        last_termination: None,
        ready: false,
        restart_count: 0,
        next_change: next,
        done: false,
    }
}

/// The state of a container created at `created`, observed at `now`. A moment
/// the clock cannot represent (`checked_add` is `None`) never comes.
pub fn observe(
    b: &Behaviour,
    policy: RestartPolicy,
    latency: &Latency,
    created: SystemTime,
    now: SystemTime,
) -> Observed {
    let Some(mut start) = created.checked_add(latency.start) else {
        return creating(None);
    };
    if now < start {
        return creating(Some(start));
    }
    let mut restarts = 0u32;
    let mut last = None;
    loop {
        let (end, code, crashed) = match (restarts, b.crash_after, b.kind) {
            (0, Some(after), _) if b.kind == Kind::Run || after < b.run_for => {
                (start.checked_add(after), 137, true)
            }
            (_, _, Kind::Run) => (None, 0, false),
            (_, _, Kind::Exit) => (start.checked_add(b.run_for), b.exit_code, false),
        };
        let ready_at = start.checked_add(latency.ready);
        match end {
            Some(end) if now >= end => {
                let t = terminated(code, start, end, crashed);
                let restart = match policy {
                    RestartPolicy::Always => true,
                    RestartPolicy::OnFailure => code != 0,
                    RestartPolicy::Never => false,
                };
                if !restart {
                    return Observed {
                        state: ContainerState::Terminated(t),
                        last_termination: last,
                        ready: false,
                        restart_count: restarts,
                        next_change: None,
                        done: true,
                    };
                }
                let restart_at = end.checked_add(backoff(restarts));
                let Some(restart_at) = restart_at.filter(|r| now >= *r) else {
                    return Observed {
                        state: ContainerState::Waiting {
                            reason: "CrashLoopBackOff".into(),
                            message: Some(format!(
                                "back-off {}s restarting failed container",
                                backoff(restarts).as_secs()
                            )),
                        },
                        last_termination: Some(t),
                        ready: false,
                        restart_count: restarts,
                        next_change: restart_at,
                        done: false,
                    };
                };
                last = Some(t);
                restarts += 1;
                start = restart_at;
            }
            _ => {
                let ready = ready_at.is_some_and(|r| now >= r);
                let next = [ready_at.filter(|_| !ready), end]
                    .into_iter()
                    .flatten()
                    .min();
                return Observed {
                    state: ContainerState::Running { started_at: start },
                    last_termination: last,
                    ready,
                    restart_count: restarts,
                    next_change: next,
                    done: false,
                };
            }
        }
    }
}

/// The instance phase from its containers' states, as the kubelet derives Pod phase.
pub fn phase(containers: &[Observed]) -> InstancePhase {
    if containers.iter().any(|c| {
        matches!(&c.state, ContainerState::Waiting { reason, .. } if reason == "ContainerCreating")
    }) {
        return InstancePhase::Pending;
    }
    if !containers.is_empty() && containers.iter().all(|c| c.done) {
        let ok = containers
            .iter()
            .all(|c| matches!(&c.state, ContainerState::Terminated(t) if t.exit_code == 0));
        return if ok {
            InstancePhase::Succeeded
        } else {
            InstancePhase::Failed
        };
    }
    InstancePhase::Running
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ann(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).into(), (*v).into()))
            .collect()
    }

    const LAT: Latency = Latency {
        admit: Duration::ZERO,
        create: Duration::ZERO,
        start: Duration::from_secs(1),
        ready: Duration::from_secs(1),
    };

    fn at(b: &Behaviour, policy: RestartPolicy, secs: u64) -> Observed {
        let t0 = SystemTime::UNIX_EPOCH;
        observe(b, policy, &LAT, t0, t0 + Duration::from_secs(secs))
    }

    #[test]
    fn run_forever_goes_creating_running_ready() {
        let b = from_annotations(&BTreeMap::new()).unwrap();
        let o = at(&b, RestartPolicy::Always, 0);
        assert!(
            matches!(o.state, ContainerState::Waiting { ref reason, .. } if reason == "ContainerCreating")
        );
        assert_eq!(phase(&[o]), InstancePhase::Pending);
        let o = at(&b, RestartPolicy::Always, 1);
        assert!(matches!(o.state, ContainerState::Running { .. }) && !o.ready);
        let o = at(&b, RestartPolicy::Always, 100);
        assert!(o.ready && o.next_change.is_none());
        assert_eq!(phase(&[o]), InstancePhase::Running);
    }

    #[test]
    fn exit_without_restart_completes() {
        let b = from_annotations(&ann(&[(BEHAVIOR, "exit"), (RUN_FOR, "3s")])).unwrap();
        let o = at(&b, RestartPolicy::Never, 10);
        assert!(
            matches!(&o.state, ContainerState::Terminated(t) if t.exit_code == 0 && t.reason == "Completed")
        );
        assert_eq!(phase(&[o]), InstancePhase::Succeeded);
        let b = from_annotations(&ann(&[(BEHAVIOR, "exit"), (EXIT_CODE, "3")])).unwrap();
        let o = at(&b, RestartPolicy::OnFailure, 4);
        assert_eq!(o.restart_count, 0);
        assert!(
            matches!(&o.state, ContainerState::Waiting { reason, .. } if reason == "CrashLoopBackOff")
        );
        let o = at(&b, RestartPolicy::Never, 4);
        assert_eq!(phase(&[o]), InstancePhase::Failed);
    }

    #[test]
    fn crash_loop_backs_off_like_the_kubelet() {
        let b = from_annotations(&ann(&[(BEHAVIOR, "crash-loop"), (RUN_FOR, "1s")])).unwrap();
        // start 1, exit 2, back-off 10 -> restart 12, exit 13, back-off 20 -> 33, exit 34, 40 -> 74
        let o = at(&b, RestartPolicy::Always, 5);
        assert_eq!(o.restart_count, 0);
        assert_eq!(o.last_termination.as_ref().unwrap().exit_code, 1);
        assert_eq!(
            o.next_change,
            Some(SystemTime::UNIX_EPOCH + Duration::from_secs(12))
        );
        let o = at(&b, RestartPolicy::Always, 12);
        assert!(matches!(o.state, ContainerState::Running { .. }));
        assert_eq!(o.restart_count, 1);
        let o = at(&b, RestartPolicy::Always, 40);
        assert_eq!(o.restart_count, 2);
        assert!(
            matches!(&o.state, ContainerState::Waiting { message: Some(m), .. } if m.contains("40s"))
        );
        assert_eq!(phase(&[o]), InstancePhase::Running);
        assert_eq!(backoff(20), BACKOFF_CAP);
    }

    #[test]
    fn injected_crash_restarts_once() {
        let b = from_annotations(&ann(&[(CRASH_AFTER, "5s")])).unwrap();
        let o = at(&b, RestartPolicy::Always, 7);
        assert_eq!(o.last_termination.as_ref().unwrap().exit_code, 137);
        let o = at(&b, RestartPolicy::Always, 1000);
        assert!(o.ready && o.restart_count == 1);
    }

    #[test]
    fn bad_annotations_are_named() {
        for (k, v) in [
            (BEHAVIOR, "explode"),
            (EXIT_CODE, "300"),
            (RUN_FOR, "forever"),
            (CPU_USAGE, "0"),
            (CPU_USAGE, "lots"),
            (MEMORY_USAGE, "0Mi"),
            (MEMORY_USAGE, "1Ei"),
            (GPU_UTILIZATION, "101"),
            (GPU_UTILIZATION, "-1"),
            (GPU_MEMORY_USAGE, "lots"),
        ] {
            let e = from_annotations(&ann(&[(k, v)])).unwrap_err();
            assert!(e.contains(k), "{e}");
        }
    }

    #[test]
    fn usage_is_what_the_annotations_say() {
        let b = from_annotations(&ann(&[(CPU_USAGE, "1500m"), (MEMORY_USAGE, "64Mi")])).unwrap();
        assert_eq!(b.cpu_usage_millis, Some(1500));
        assert_eq!(b.memory_usage_bytes, Some(64 << 20));
        let b =
            from_annotations(&ann(&[(GPU_UTILIZATION, "73"), (GPU_MEMORY_USAGE, "20Gi")])).unwrap();
        assert_eq!(b.gpu_utilization_percent, Some(73));
        assert_eq!(b.gpu_memory_usage_bytes, Some(20 << 30));
        let b = from_annotations(&BTreeMap::new()).unwrap();
        assert_eq!((b.cpu_usage_millis, b.memory_usage_bytes), (None, None));
    }

    #[test]
    fn durations_that_would_overflow_a_clock_are_refused_by_name() {
        for k in [RUN_FOR, CRASH_AFTER, STOP_DELAY] {
            let e = from_annotations(&ann(&[(k, "18000000000000000000")])).unwrap_err();
            assert!(e.contains(k) && e.contains("longer than"), "{e}");
        }
    }

    #[test]
    fn no_duration_or_time_makes_observe_panic() {
        let end_of_time = SystemTime::UNIX_EPOCH
            .checked_add(Duration::new(i64::MAX as u64, 999_999_999))
            .unwrap();
        let huge = Duration::MAX;
        let lat = Latency {
            start: huge,
            ready: huge,
            ..LAT
        };
        for kind in [Kind::Run, Kind::Exit] {
            for crash_after in [None, Some(huge), Some(Duration::from_secs(1))] {
                let b = Behaviour {
                    kind,
                    exit_code: 1,
                    run_for: huge,
                    crash_after,
                    stop_delay: huge,
                    cpu_usage_millis: None,
                    memory_usage_bytes: None,
                    gpu_utilization_percent: None,
                    gpu_memory_usage_bytes: None,
                };
                for (latency, created) in [
                    (&LAT, end_of_time),
                    (&lat, SystemTime::UNIX_EPOCH),
                    (&LAT, SystemTime::UNIX_EPOCH),
                ] {
                    for now in [created, end_of_time] {
                        let o = observe(&b, RestartPolicy::Always, latency, created, now);
                        assert!(o.next_change.is_none_or(|t| t > now), "{o:?}");
                    }
                }
            }
        }
    }
}
