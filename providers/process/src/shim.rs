//! `process-shim`: the supervisor of one Pod, a kubelet for a single Pod.
//!
//! The provider starts it detached (its own process group, no pipes back), so it
//! and the containers it runs keep going when vkd dies. It runs init containers
//! in order, then the containers, restarts them by restartPolicy with the
//! kubelet's back-off, runs probes and hooks, writes each container's log, and
//! records everything in `status.json`. SIGTERM asks it to stop the Pod with the
//! grace period written in `stop`; it exits once every process it started is gone.
//!
//! Every process a Pod starts ends with it: the shim is a child subreaper, so a
//! process that detaches (setsid, a double fork) is re-parented to the shim and
//! not to init; the shim reaps those orphans as they exit and kills the rest when
//! the Pod ends. Where there is cgroup v2 the Pod's cgroup ends them all, `kubectl
//! exec` sessions included.

use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use tokio::sync::watch;
use tokio::time::Instant;
use vkd_provider::{ContainerSpec, ContainerState, ContainerStatus, InstancePhase};

use crate::procfs::ProcessId;
use crate::sandbox::{ContainerRun, Launch, Sandbox, ShimSpec, StatusFile, write_json};

mod children;
mod container;
mod dial;
mod ephemeral;
mod grpc;
mod handler;
mod http;
mod probes;
mod sidecars;
mod start;
mod stdin;
mod terminate;
mod termination;
mod tls;

/// Runs the shim for the sandbox at `dir`; returns the process exit code.
pub fn main(dir: &Path) -> i32 {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("process-shim: runtime: {e}");
            return 1;
        }
    };
    runtime.block_on(async {
        match Shim::open(dir) {
            Ok(shim) => {
                Arc::new(shim).run().await;
                0
            }
            Err(e) => {
                eprintln!("process-shim: {}: {e}", dir.display());
                1
            }
        }
    })
}

struct Shim {
    sandbox: Sandbox,
    spec: ShimSpec,
    status: Mutex<StatusFile>,
    stop: watch::Receiver<bool>,
    stop_tx: watch::Sender<bool>,
    /// The shim itself stops the sidecars (restartable init containers): the
    /// containers have ended, or an init container failed for good.
    sidecars_stop: watch::Receiver<bool>,
    sidecars_stop_tx: watch::Sender<bool>,
    /// Bumped on every status change, for whoever waits on one.
    changed: watch::Sender<u64>,
    /// The Pod's cgroup, when there is a cgroup v2 hierarchy.
    pod_cgroup: Option<std::path::PathBuf>,
    /// The Pod's network namespace, where it has one: where probes and hooks
    /// connect from, so `127.0.0.1` is the Pod's own loopback.
    netns: Option<std::path::PathBuf>,
    /// PIDs the shim started itself and waits for; any other child is an orphan
    /// re-parented here, which the shim reaps.
    own: Mutex<std::collections::HashSet<i32>>,
    /// The stdin pipe of each launch with `stdin: true` (see `stdin`).
    stdin: stdin::Slots,
}

/// The longest wait the shim schedules: a Pod's own number (a grace period of
/// i64::MAX seconds) must not overflow the clock.
const LONGEST_WAIT: Duration = Duration::from_secs(10 * 365 * 86_400);

/// `Instant::now() + d`, never overflowing.
fn after(d: Duration) -> Instant {
    Instant::now() + d.min(LONGEST_WAIT)
}

fn waiting(reason: &str, message: Option<String>) -> ContainerState {
    ContainerState::Waiting {
        reason: reason.into(),
        message,
    }
}

pub(crate) fn run_of(name: &str, state: ContainerState) -> ContainerRun {
    ContainerRun {
        status: ContainerStatus {
            name: name.into(),
            state,
            last_termination: None,
            ready: false,
            restart_count: 0,
            container_id: None,
            started: Some(false),
        },
        process: None,
        cgroup: None,
        started_at: None,
    }
}

/// What ended a run of a container.
enum Ended {
    Exited(ExitStatus),
    /// The process could not be started at all.
    StartFailed(String),
}

/// A container's started process, and what its end cleans up.
struct Run {
    child_pid: Option<u32>,
    /// Its process group.
    process: Option<ProcessId>,
    /// The container's ID in its status (`process://…`).
    id: String,
    started_at: SystemTime,
    cgroup: Option<PathBuf>,
    /// The cgroup's OOM kills before the start.
    oom_before: u64,
    /// The tasks that copy its stdout and stderr into its log.
    pumps: Vec<tokio::task::JoinHandle<()>>,
}

impl Shim {
    fn open(dir: &Path) -> std::io::Result<Self> {
        let sandbox = Sandbox::new(dir.to_owned());
        let spec = sandbox.read_spec()?.ok_or_else(|| {
            std::io::Error::new(std::io::ErrorKind::NotFound, "spec.json is missing")
        })?;
        // A Pod with an IP of its own has a network namespace, which its
        // network record names: probes and hooks connect from there. With
        // no record, the probes fail (this path is never there), and never
        // dial from the host's network.
        let netns = match spec.pod_ip {
            Some(_) => Some(
                crate::network::attachment_of(dir)?
                    .map_or_else(|| dir.join("no-network-record"), |a| a.netns),
            ),
            None => None,
        };
        let wanted = spec.spec.init_containers.len() + spec.spec.containers.len();
        if spec.containers.len() != wanted {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!(
                    "spec.json names {} launches for {wanted} containers",
                    spec.containers.len()
                ),
            ));
        }
        // Root runs what spec.json says: it must name a user that is not root.
        if !spec.run_as.is_some_and(|(u, g)| u != 0 && g != 0) {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                "spec.json names no run-as user other than root",
            ));
        }
        let me = ProcessId::of(std::process::id() as i32)
            .ok_or_else(|| std::io::Error::other("cannot read own /proc entry"))?;
        crate::sandbox::write_atomic(&sandbox.shim_pid(), me.render().as_bytes(), 0o644)?;
        let init_state = if spec.spec.init_containers.is_empty() {
            "ContainerCreating"
        } else {
            "PodInitializing"
        };
        let status = StatusFile {
            phase: InstancePhase::Pending,
            init: spec
                .spec
                .init_containers
                .iter()
                .map(|c| run_of(&c.name, waiting("PodInitializing", None)))
                .collect(),
            containers: spec
                .spec
                .containers
                .iter()
                .map(|c| run_of(&c.name, waiting(init_state, None)))
                .collect(),
            started_at: None,
            message: None,
            done: false,
            // This shim starts ephemeral containers (see `ephemeral`).
            ephemeral: Some(Vec::new()),
            pause: None,
            events: Vec::new(),
        };
        write_json(&sandbox.status(), &status, 0o644)?;
        let (stop_tx, stop) = watch::channel(false);
        let (sidecars_stop_tx, sidecars_stop) = watch::channel(false);
        // Orphans of the Pod come to the shim, not to init, so none outlives it.
        rustix::process::set_child_subreaper(rustix::process::Pid::from_raw(me.pid))
            .map_err(|e| std::io::Error::other(format!("becoming a child subreaper: {e}")))?;
        let pod_cgroup = match &spec.cgroup {
            Some(parent) => Some(
                crate::cgroup::create_pod(parent, &spec.spec.pod.uid, spec.pids_limit)
                    .map_err(|e| std::io::Error::other(format!("the Pod's cgroup: {e}")))?,
            ),
            None => None,
        };
        Ok(Self {
            sandbox,
            spec,
            status: Mutex::new(status),
            stop,
            stop_tx,
            sidecars_stop,
            sidecars_stop_tx,
            changed: watch::channel(0).0,
            pod_cgroup,
            netns,
            own: Mutex::default(),
            stdin: (0..wanted).map(|_| Mutex::default()).collect(),
        })
    }

    fn update(&self, f: impl FnOnce(&mut StatusFile)) {
        let mut st = match self.status.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        f(&mut st);
        if let Err(e) = write_json(&self.sandbox.status(), &*st, 0o644) {
            eprintln!("process-shim: writing status: {e}");
        }
        drop(st);
        self.changed.send_modify(|n| *n = n.wrapping_add(1));
    }

    fn grace(&self) -> Duration {
        self.sandbox
            .stop_requested()
            .map_or(self.spec.spec.termination_grace, Duration::from_secs)
            .min(LONGEST_WAIT)
    }

    async fn run(self: Arc<Self>) {
        // Registered before any container starts: a SIGTERM from here on is a stop
        // request, never the default action that would orphan a started container.
        let tx = self.stop_tx.clone();
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::spawn(async move {
                    term.recv().await;
                    let _ = tx.send(true);
                });
            }
            Err(e) => {
                self.note(&format!(
                    "cannot handle SIGTERM ({e}); not starting the Pod"
                ));
                self.update(|s| {
                    s.phase = InstancePhase::Failed;
                    s.message = Some(format!("the shim cannot handle SIGTERM: {e}"));
                    s.done = true;
                });
                return;
            }
        }
        // A stop asked for before the shim was up is honoured too.
        if self.sandbox.stop_requested().is_some() {
            let _ = self.stop_tx.send(true);
        }
        let reaper = {
            let this = Arc::clone(&self);
            tokio::spawn(async move {
                let mut tick = tokio::time::interval(Duration::from_secs(1));
                loop {
                    tick.tick().await;
                    this.reap_orphans(false);
                }
            })
        };
        // Ephemeral containers (`kubectl debug`) start whenever asked while the
        // Pod runs, and stop once its containers have ended.
        let ephemeral = self.start_ephemeral();
        let attach = self.listen_stdin();
        // The pause process is killed with every other child at the end (`end_all`).
        let paused = match self.spec.isolated && self.spec.spec.share_process_namespace {
            true => self.start_pause(),
            false => Ok(()),
        };
        match paused {
            Ok(()) => Arc::clone(&self).run_pod().await,
            Err(e) => {
                self.note(&format!("shareProcessNamespace: {e}"));
                self.update(|s| {
                    s.phase = InstancePhase::Failed;
                    s.message = Some(format!("the Pod's shared PID namespace: {e}"));
                });
            }
        }
        for task in attach {
            task.abort();
        }
        ephemeral.finish().await;
        reaper.abort();
        self.end_all().await;
        // As the kubelet stops a finished Pod's sandbox: its IP goes back to
        // the pool now, not when the Pod object is deleted.
        if self.spec.pod_ip.is_some() {
            let dir = self.sandbox.dir.clone();
            match tokio::task::spawn_blocking(move || crate::network::release(&dir)).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => self.note(&format!("releasing the Pod's network: {e}")),
                Err(e) => self.note(&format!("releasing the Pod's network: {e}")),
            }
        }
        self.update(|s| s.done = true);
    }

    /// Init containers, then the containers, until the Pod is over.
    ///
    /// A sidecar (an init container with `restartPolicy: Always`) starts in its
    /// place and keeps running; the next init container starts once it has
    /// started. Sidecars are stopped once the containers have ended (or an init
    /// container failed for good), and the Pod's phase then follows its
    /// containers alone, as the kubelet's does.
    async fn run_pod(self: Arc<Self>) {
        let n_init = self.spec.spec.init_containers.len();
        let mut sidecars = Vec::new();
        let mut initialized = true;
        for i in 0..n_init {
            if self.sidecar(i, true) {
                sidecars.push(tokio::spawn(Arc::clone(&self).run_container(i, true)));
                if self.wait_started(i).await {
                    continue;
                }
            } else if Arc::clone(&self).run_container(i, true).await {
                continue;
            }
            initialized = false;
            break;
        }
        if !initialized {
            let failed = (!self.stopping()).then(|| {
                let st = lock(&self.status);
                st.init
                    .iter()
                    .find(|c| matches!(&c.status.state, ContainerState::Terminated(t) if t.exit_code != 0))
                    .map(|c| c.status.name.clone())
            });
            self.stop_sidecars(sidecars).await;
            self.update(|s| {
                s.phase = InstancePhase::Failed;
                if let Some(Some(name)) = failed {
                    s.message = Some(format!("init container {name} failed"));
                }
            });
            return;
        }
        self.update(|s| {
            for c in &mut s.containers {
                c.status.state = waiting("ContainerCreating", None);
            }
        });
        let tasks: Vec<_> = (0..self.spec.spec.containers.len())
            .map(|i| tokio::spawn(Arc::clone(&self).run_container(i, false)))
            .collect();
        for t in tasks {
            let _ = t.await;
        }
        self.stop_sidecars(sidecars).await;
        self.update(|s| {
            let all_ok = s.containers.iter().all(
                |c| matches!(&c.status.state, ContainerState::Terminated(t) if t.exit_code == 0),
            );
            s.phase = if all_ok {
                InstancePhase::Succeeded
            } else {
                InstancePhase::Failed
            };
        });
    }

    fn container(&self, i: usize, init: bool) -> (&ContainerSpec, &Launch) {
        let n_init = self.spec.spec.init_containers.len();
        if init {
            (&self.spec.spec.init_containers[i], &self.spec.containers[i])
        } else {
            (
                &self.spec.spec.containers[i],
                &self.spec.containers[n_init + i],
            )
        }
    }

    fn set(&self, i: usize, init: bool, f: impl FnOnce(&mut ContainerRun)) {
        self.update(|s| {
            let list = if init { &mut s.init } else { &mut s.containers };
            if let Some(c) = list.get_mut(i) {
                f(c);
            }
            if !init
                && s.phase == InstancePhase::Pending
                && s.containers.iter().any(|c| c.started_at.is_some())
            {
                s.phase = InstancePhase::Running;
                s.started_at.get_or_insert_with(SystemTime::now);
            }
        });
    }

    /// Records an event of `container` in `status.json`, which vkd publishes
    /// as the kubelet's Event about the Pod; the oldest go beyond
    /// [`EVENTS_KEPT`](crate::sandbox::EVENTS_KEPT).
    fn record_event(
        &self,
        container: &str,
        warning: bool,
        (reason, action): (&str, &str),
        message: String,
    ) {
        // An Event's message is bounded (the kubelet's are cut at 1 KiB here too).
        let mut message = message;
        if message.len() > 1024 {
            let mut cut = 1024;
            while !message.is_char_boundary(cut) {
                cut -= 1;
            }
            message.truncate(cut);
        }
        self.update(|st| {
            let seq = st.events.last().map_or(1, |e| e.seq.saturating_add(1));
            st.events.push(vkd_provider::ContainerEvent {
                seq,
                time: SystemTime::now(),
                container: container.to_owned(),
                warning,
                reason: reason.to_owned(),
                message,
                action: action.to_owned(),
            });
            let over = st.events.len().saturating_sub(crate::sandbox::EVENTS_KEPT);
            st.events.drain(..over);
        });
    }

    /// A probe's Event, as the kubelet's prober records one for each attempt
    /// that fails or warns.
    fn probe_event(&self, spec: &ContainerSpec, kind: &str, verdict: &handler::Verdict) {
        match verdict {
            handler::Verdict::Success => {}
            handler::Verdict::Warning(m) => self.record_event(
                &spec.name,
                true,
                ("ProbeWarning", kind),
                format!("{kind} probe warning: {m}"),
            ),
            handler::Verdict::Failure(m) => self.record_event(
                &spec.name,
                true,
                ("Unhealthy", kind),
                format!("{kind} probe failed: {m}"),
            ),
            handler::Verdict::Errored { result, why } => self.record_event(
                &spec.name,
                true,
                ("Unhealthy", kind),
                format!("{kind} probe errored and resulted in {result} state: {why}"),
            ),
        }
    }

    /// What the kubelet would send as an Event goes to the shim's own log (`shim.log`).
    fn note(&self, text: &str) {
        eprintln!(
            "process-shim: {}/{}: {text}",
            self.spec.spec.pod.namespace, self.spec.spec.pod.name
        );
    }
}

fn far_future() -> Instant {
    Instant::now() + Duration::from_secs(86_400)
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // a failed unwrap is a failed test
    use super::*;
    use vkd_provider::RestartPolicy;

    /// A working directory that is not there ends the container `StartError`
    /// with a message that names the directory, not the program.
    #[tokio::test]
    async fn a_missing_working_dir_is_named() {
        let dir = std::env::temp_dir().join(format!("vkd-shim-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut spec = vkd_provider::conformance::sample_spec("node-s", "u-wd");
        spec.restart_policy = RestartPolicy::Never;
        spec.containers = vec![ContainerSpec {
            name: "main".into(),
            image: "busybox".into(),
            ..Default::default()
        }];
        let launch = Launch {
            name: "main".into(),
            argv: vec!["/bin/true".into()],
            env: Vec::new(),
            cwd: dir.join("root/no-such-dir"),
            termination_log: None,
        };
        let shim_spec = ShimSpec {
            spec,
            containers: vec![launch],
            run_as: Some((65534, 65534)),
            log_max_bytes: 1 << 20,
            cgroup: None,
            pids_limit: None,
            pids_rlimit: None,
            isolated: false,
            pod_ip: None,
        };
        write_json(&dir.join("spec.json"), &shim_spec, 0o600).unwrap();
        let shim = Arc::new(Shim::open(&dir).unwrap());
        // One container's run, not the whole Pod: the Pod's end kills every child
        // of this process, and this process is the test runner.
        assert!(!Arc::clone(&shim).run_container(0, false).await);
        let st = Sandbox::new(dir.clone()).read_status().unwrap().unwrap();
        let ContainerState::Terminated(t) = &st.containers[0].status.state else {
            panic!("{:?}", st.containers[0].status.state);
        };
        assert_eq!(t.reason, "StartError");
        let message = t.message.clone().unwrap_or_default();
        assert!(
            message.contains("workingDir") && message.contains("no-such-dir"),
            "{message}"
        );
        let _ = std::fs::remove_dir_all(dir);
    }
}
