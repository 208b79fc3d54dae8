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

use rustix::process::Signal;
use tokio::io::AsyncBufReadExt;
use tokio::sync::watch;
use tokio::time::Instant;
use vkd_provider::{
    ContainerSpec, ContainerState, ContainerStatus, Handler, InstancePhase, RestartPolicy,
    Terminated,
};

use crate::logs::LogWriter;
use crate::procfs::ProcessId;
use crate::sandbox::{ContainerRun, Launch, Sandbox, ShimSpec, StatusFile, write_json};

mod ephemeral;
mod probes;
mod stdin;

use probes::{ProbeOutcome, Probes, http_get};

const BACKOFF_START: Duration = Duration::from_secs(10);
const BACKOFF_MAX: Duration = Duration::from_secs(300);
/// A container that ran this long without failing starts its back-off afresh.
const BACKOFF_RESET: Duration = Duration::from_secs(600);

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
            own: Mutex::default(),
            stdin: (0..wanted).map(|_| Mutex::default()).collect(),
        })
    }

    /// Starts a process of the Pod and remembers it as the shim's own.
    fn spawn(&self, cmd: &mut tokio::process::Command) -> std::io::Result<tokio::process::Child> {
        // The runtime is single-threaded: no reap runs between the spawn and the insert.
        let child = cmd.spawn()?;
        if let Some(pid) = child.id().and_then(|p| i32::try_from(p).ok()) {
            lock(&self.own).insert(pid);
        }
        Ok(child)
    }

    fn forget(&self, child: Option<u32>) {
        if let Some(pid) = child.and_then(|p| i32::try_from(p).ok()) {
            lock(&self.own).remove(&pid);
        }
    }

    /// Reaps orphans that exited; with `kill` (the Pod is over, nothing of its
    /// own is waited for any more), kills every child first. Returns how many
    /// children remain.
    fn reap_orphans(&self, kill: bool) -> usize {
        let own = lock(&self.own).clone();
        let mut left = 0;
        for pid in crate::procfs::children(std::process::id() as i32) {
            if own.contains(&pid) && !kill {
                continue;
            }
            let Some(p) = rustix::process::Pid::from_raw(pid) else {
                continue;
            };
            // A child's PID is not reused until it is reaped, so signalling it is safe.
            if kill {
                let _ = rustix::process::kill_process(p, Signal::KILL);
            }
            match rustix::process::waitpid(Some(p), rustix::process::WaitOptions::NOHANG) {
                Ok(Some(_)) => {}
                _ => left += 1,
            }
        }
        left
    }

    /// Starts the pause launcher that holds the Pod's shared PID namespace,
    /// and records it, before any container starts.
    fn start_pause(&self) -> std::io::Result<()> {
        let args = crate::launch::LaunchArgs {
            cgroup: None,
            data_limit: None,
            nproc_limit: None,
            user: self.spec.run_as,
            env_file: Path::new("/dev/null"),
            cwd: Path::new("/"),
            isolation: Some(crate::launch::Isolation::Pause),
            argv: &["pause".to_owned()],
        };
        let mut cmd = tokio::process::Command::from(args.command(Path::new("/proc/self/exe")));
        cmd.process_group(0)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null());
        let child = self.spawn(&mut cmd)?;
        let id = child
            .id()
            .and_then(|p| i32::try_from(p).ok())
            .and_then(ProcessId::of)
            .ok_or_else(|| std::io::Error::other("the pause process ended at once"))?;
        // Reaped with the other children at the end; the handle is not kept.
        drop(child);
        // Its PID namespace exists once its child, the namespace's init, does.
        for _ in 0..500 {
            if crate::isolation::program_of(id.pid) != id.pid {
                self.update(|s| s.pause = Some(id));
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        Err(std::io::Error::other("the pause process did not start"))
    }

    /// The Pod is over: every process it left, wherever it went, is killed.
    async fn end_all(&self) {
        if let Some(cg) = &self.pod_cgroup {
            crate::cgroup::kill(cg);
        }
        // Killing a process re-parents its children here; repeat until none is left.
        for _ in 0..250 {
            if self.reap_orphans(true) == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        if let Some(cg) = self.pod_cgroup.clone() {
            let removed = tokio::task::spawn_blocking(move || {
                crate::cgroup::remove(&cg, Duration::from_secs(5))
            })
            .await;
            if !matches!(removed, Ok(true)) {
                self.note("the Pod's cgroup could not be removed");
            }
        }
    }

    /// Asks container process `g` to stop. Without namespaces, its whole
    /// process group. With them, as a runtime does, the program alone (its
    /// PID namespace's init, which ignores a SIGTERM it has no handler for);
    /// a SIGKILL still goes to the group, and the namespace ends with it.
    fn ask_to_stop(&self, g: ProcessId) {
        let signal = stop_signal(g);
        if !self.spec.isolated || signal == Signal::KILL {
            g.signal_group(signal);
            return;
        }
        if g.alive()
            && let Some(pid) = rustix::process::Pid::from_raw(crate::isolation::program_of(g.pid))
        {
            let _ = rustix::process::kill_process(pid, signal);
        }
    }

    /// The running process of container (or init container) `name`.
    fn process_of(&self, name: &str) -> Option<ProcessId> {
        let st = lock(&self.status);
        st.init
            .iter()
            .chain(&st.containers)
            .find(|c| c.status.name == name)
            .and_then(|c| c.process)
            .filter(ProcessId::alive)
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

    fn stopping(&self) -> bool {
        *self.stop.borrow()
    }

    /// Whether init container `i` (or container `i`) is a sidecar.
    fn sidecar(&self, i: usize, init: bool) -> bool {
        init && self.spec.spec.init_containers[i].restart_always
    }

    /// Whether a container must stop: the Pod stops, or for a sidecar, the shim stops the sidecars.
    fn stopping_for(&self, sidecar: bool) -> bool {
        self.stopping() || (sidecar && *self.sidecars_stop.borrow())
    }

    /// Resolves once [`Self::stopping_for`] holds.
    async fn stop_wanted(&self, sidecar: bool) {
        let mut stop = self.stop.clone();
        let mut sidecars = self.sidecars_stop.clone();
        tokio::select! {
            _ = stop.wait_for(|s| *s) => {}
            _ = sidecars.wait_for(|s| *s), if sidecar => {}
        }
    }

    /// Waits until init container `i` (a sidecar) has started: true, or false
    /// when the Pod stops first.
    async fn wait_started(&self, i: usize) -> bool {
        let mut changed = self.changed.subscribe();
        loop {
            if self.stopping() {
                return false;
            }
            if lock(&self.status)
                .init
                .get(i)
                .is_some_and(|c| c.status.has_started())
            {
                return true;
            }
            tokio::select! {
                r = changed.changed() => if r.is_err() { return false; },
                () = self.stop_wanted(false) => {}
            }
        }
    }

    /// Whether sidecar `i` may be signalled, as the kubelet orders termination:
    /// after every container, and after every sidecar that started after it.
    fn sidecar_turn(&self, i: usize) -> bool {
        let st = lock(&self.status);
        let running = |c: &ContainerRun| matches!(c.status.state, ContainerState::Running { .. });
        !st.containers.iter().any(running)
            && !st
                .init
                .iter()
                .enumerate()
                .skip(i + 1)
                .any(|(j, c)| self.sidecar(j, true) && running(c))
    }

    /// Stops the sidecars the Pod started (`tasks`) and waits for them.
    async fn stop_sidecars(&self, tasks: Vec<tokio::task::JoinHandle<bool>>) {
        let _ = self.sidecars_stop_tx.send(true);
        for t in tasks {
            let _ = t.await;
        }
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

    /// Runs one container until it ends for good; true when it ended well
    /// (for an init container: exited 0).
    async fn run_container(self: Arc<Self>, i: usize, init: bool) -> bool {
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
    fn terminated(
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

    /// The container's group inside the Pod's, made with the limits the
    /// controllers enforce.
    /// Fails when the Pod has a cgroup but the container's cannot be made: the
    /// container would run outside its Pod's tracking and limits.
    fn cgroup(&self, spec: &ContainerSpec) -> Result<Option<std::path::PathBuf>, String> {
        let Some(pod) = self.pod_cgroup.as_ref() else {
            return Ok(None);
        };
        let dir = pod.join(&spec.name);
        if let Err(e) = std::fs::create_dir_all(&dir) {
            return Err(format!("creating the cgroup {}: {e}", dir.display()));
        }
        let on = self.spec.cgroup.as_ref();
        let write = |file: &str, value: String| {
            std::fs::write(dir.join(file), value)
                .map_err(|e| format!("setting {file} of {}: {e}", dir.display()))
        };
        if let (Some(true), Some(m)) = (on.map(|c| c.memory), spec.limits.memory_bytes) {
            write("memory.max", m.to_string())?;
            let _ = std::fs::write(dir.join("memory.swap.max"), "0");
        }
        if let (Some(true), Some(c)) = (on.map(|c| c.cpu), spec.limits.cpu_millis) {
            let quota = c.max(1).saturating_mul(100);
            write("cpu.max", format!("{quota} 100000"))?;
        }
        Ok(Some(dir))
    }

    /// The launcher for `argv` in `launch`'s container: as the run-as user, in the
    /// container's cgroup, with the limits the cgroup does not enforce as rlimits.
    fn command(
        &self,
        launch: &Launch,
        argv: &[String],
        spec: &ContainerSpec,
        cgroup: Option<&Path>,
        isolation: Option<crate::launch::Isolation<'_>>,
    ) -> std::io::Result<tokio::process::Command> {
        let env_file = self.sandbox.ensure_env_file(launch)?;
        let (data_limit, nproc_limit) = crate::launch::rlimits(
            self.spec.cgroup.as_ref().filter(|_| cgroup.is_some()),
            spec.limits.memory_bytes,
            self.spec.pids_rlimit,
        );
        let args = crate::launch::LaunchArgs {
            cgroup,
            data_limit,
            nproc_limit,
            user: self.spec.run_as,
            env_file: &env_file,
            cwd: &launch.cwd,
            isolation,
            argv,
        };
        // The launcher is this very program, never a path a file names.
        let mut cmd = tokio::process::Command::from(args.command(Path::new("/proc/self/exe")));
        cmd.process_group(0)
            .stdin(std::process::Stdio::null())
            .kill_on_drop(false);
        Ok(cmd)
    }

    /// One run: start, log, hooks, probes, until the process exits.
    /// Returns how it ended, whether the kernel killed it for memory, and when it started.
    async fn run_once(
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
        let (mut child, run) =
            match self.spawn_run(spec, launch, &writer, cgroup.as_deref(), Some(index)) {
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
            if !self.handle(h, launch, spec, grace).await {
                self.note(&format!(
                    "postStart hook failed for container {}",
                    spec.name
                ));
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

    /// Before a container's process starts: its log (a new run, or the next
    /// one after a restart), its working directory checked, its cgroup made,
    /// its termination message file emptied. Fails with why it cannot start.
    fn prepare_run(
        &self,
        spec: &ContainerSpec,
        launch: &Launch,
        restarted: bool,
    ) -> Result<(Arc<Mutex<LogWriter>>, Option<PathBuf>), String> {
        let writer = LogWriter::start_run(
            &self.sandbox.logs(&spec.name),
            self.spec.log_max_bytes,
            restarted,
        )
        .map_err(|e| format!("opening the log: {e}"))?;
        // With namespaces the launcher makes it in the container's own tree.
        if !self.spec.isolated && !launch.cwd.is_dir() {
            return Err(format!(
                "workingDir {} is not a directory in the Pod's root",
                launch.cwd.display()
            ));
        }
        let cgroup = self.cgroup(spec)?;
        self.fresh_termination_log(launch);
        Ok((Arc::new(Mutex::new(writer)), cgroup))
    }

    /// Starts the container's process, in `cgroup`, its output pumped into
    /// `writer`. Fails with why it did not start.
    /// With namespaces, `index` (the launch's) names its mount plan; an
    /// ephemeral container (no index) runs as a host process, as it does
    /// without namespaces (docs/process-provider.md).
    fn spawn_run(
        &self,
        spec: &ContainerSpec,
        launch: &Launch,
        writer: &Arc<Mutex<LogWriter>>,
        cgroup: Option<&Path>,
        index: Option<usize>,
    ) -> Result<(tokio::process::Child, Run), String> {
        let oom_before = cgroup.map_or(0, oom_kills);
        let program = launch.argv.first().map_or("", String::as_str);
        let plan = index.map(|i| self.sandbox.mount_plan(i));
        let pause = lock(&self.status).pause.map(|p| p.pid);
        // An ephemeral container (no plan) still shares the Pod's network.
        let netns = match (&plan, &self.spec.pod_ip) {
            (None, Some(_)) => crate::network::attachment_of(&self.sandbox.dir)
                .ok()
                .flatten()
                .map(|a| a.netns),
            _ => None,
        };
        let isolation = match (plan.as_deref().filter(|_| self.spec.isolated), &netns) {
            (Some(plan), _) => Some(match pause {
                Some(pause) => crate::launch::Isolation::Shared { plan, pause },
                None => crate::launch::Isolation::New(plan),
            }),
            (None, Some(netns)) => Some(crate::launch::Isolation::Network(netns)),
            (None, None) => None,
        };
        let mut child = self
            .command(launch, &launch.argv, spec, cgroup, isolation)
            .and_then(|mut cmd| {
                cmd.stdout(std::process::Stdio::piped())
                    .stderr(std::process::Stdio::piped());
                if spec.stdin {
                    // Held by the shim for `kubectl attach -i` (see `stdin`).
                    cmd.stdin(std::process::Stdio::piped());
                }
                self.spawn(&mut cmd)
            })
            .map_err(|e| format!("starting {program}: {e}"))?;
        let child_pid = child.id();
        let pid = child_pid.and_then(|p| i32::try_from(p).ok()).unwrap_or(0);
        let started_at = SystemTime::now();
        let mut pumps = Vec::new();
        if let Some(out) = child.stdout.take() {
            pumps.push(tokio::spawn(pump(out, "stdout", Arc::clone(writer))));
        }
        if let Some(err) = child.stderr.take() {
            pumps.push(tokio::spawn(pump(err, "stderr", Arc::clone(writer))));
        }
        let uid = &self.spec.spec.pod.uid;
        let run = Run {
            child_pid,
            process: ProcessId::of(pid),
            // By characters: a byte slice could split one and panic.
            id: format!(
                "process://{}-{}-{pid}",
                uid.chars().take(8).collect::<String>(),
                spec.name
            ),
            started_at,
            cgroup: cgroup.map(Path::to_path_buf),
            oom_before,
            pumps,
        };
        Ok((child, run))
    }

    /// After a container's process exited (`status`): what it left in its
    /// process group and its cgroup is killed, orphans reaped, its log
    /// flushed, its cgroup removed. Returns how it ended, whether the kernel
    /// killed it for memory, and when it started.
    async fn end_run(
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
    async fn pre_stop(
        &self,
        pre_stop: Option<&Handler>,
        launch: &Launch,
        spec: &ContainerSpec,
    ) -> Instant {
        self.pre_stop_within(self.grace(), pre_stop, launch, spec)
            .await
    }

    async fn pre_stop_within(
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
            let _ = self.handle(h, launch, spec, grace).await;
        }
        deadline
    }

    /// Runs preStop (within the grace period), sends SIGTERM, and returns when to send SIGKILL.
    async fn terminate(
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
    async fn terminate_within(
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

    /// Before a run: the container's termination message file, empty, as the
    /// kubelet makes a new one for each container it starts. Left as it is while
    /// another container of the Pod that writes the same file runs.
    fn fresh_termination_log(&self, launch: &Launch) {
        use rustix::fs::{Mode, OFlags};
        let Some((root, rel)) = self.termination_file(launch) else {
            return;
        };
        let rel = rel.as_path();
        let shared = !self.spec.isolated && {
            let st = lock(&self.status);
            st.init.iter().chain(&st.containers).any(|c| {
                c.status.name != launch.name
                    && matches!(c.status.state, ContainerState::Running { .. })
                    && self.spec.containers.iter().any(|l| {
                        l.name == c.status.name && l.termination_log.as_deref() == Some(rel)
                    })
            })
        };
        if shared {
            return;
        }
        let made = match crate::sandbox::open_beneath(
            &root,
            rel,
            OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL,
            Mode::from_raw_mode(0o666),
        ) {
            Ok(f) => {
                // Root made it: it becomes the Pod's, writable by the container.
                let owner = self
                    .spec
                    .run_as
                    .map(|(u, g)| (rustix::fs::Uid::from_raw(u), rustix::fs::Gid::from_raw(g)));
                let done = owner.map_or(Ok(()), |(u, g)| rustix::fs::fchown(&f, Some(u), Some(g)));
                done.and_then(|()| rustix::fs::fchmod(&f, Mode::from_raw_mode(0o666)))
                    .map_err(std::io::Error::from)
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                crate::sandbox::open_beneath(&root, rel, OFlags::WRONLY, Mode::empty()).and_then(
                    |f| {
                        if self.owned_by_pod(&f) {
                            f.set_len(0)
                        } else {
                            Ok(())
                        }
                    },
                )
            }
            Err(e) => Err(e),
        };
        if let Err(e) = made {
            self.note(&format!(
                "container {}: no termination message file at /{}: {e}",
                launch.name,
                rel.display()
            ));
        }
    }

    /// Where `launch`'s termination message file is, as a directory of the
    /// host and a path beneath it: with namespaces, a file of the
    /// container's own (bound at its terminationMessagePath), else the path
    /// under the Pod's root.
    fn termination_file(&self, launch: &Launch) -> Option<(PathBuf, PathBuf)> {
        let rel = launch.termination_log.as_deref()?;
        let spec = self
            .spec
            .spec
            .init_containers
            .iter()
            .chain(&self.spec.spec.containers)
            .find(|c| c.name == launch.name);
        match spec {
            Some(c) if self.spec.isolated && crate::sandbox::own_termination_file(c, rel) => {
                Some((self.sandbox.termination_dir(), PathBuf::from(&launch.name)))
            }
            _ => Some((self.sandbox.root(), rel.to_owned())),
        }
    }

    /// A regular file the Pod's user owns (what root may read or truncate for it).
    fn owned_by_pod(&self, f: &std::fs::File) -> bool {
        use std::os::unix::fs::MetadataExt;
        f.metadata()
            .is_ok_and(|m| m.is_file() && self.spec.run_as.is_none_or(|(u, _)| m.uid() == u))
    }

    /// The termination message of a run that exited with `code`, as the kubelet
    /// reads it: the end of the container's termination message file, or with
    /// `FallbackToLogsOnError` and a failure, the end of its log when the file
    /// says nothing.
    fn termination_message(
        &self,
        spec: &ContainerSpec,
        launch: &Launch,
        code: i32,
    ) -> Option<String> {
        use std::io::{Read, Seek};
        let from_file = self.termination_file(launch).and_then(|(root, rel)| {
            let rel = rel.as_path();
            let f = crate::sandbox::open_beneath(
                &root,
                rel,
                rustix::fs::OFlags::RDONLY,
                rustix::fs::Mode::empty(),
            );
            let mut f = match f {
                Ok(f) => f,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
                Err(e) => {
                    self.note(&format!(
                        "container {}: reading the termination message /{}: {e}",
                        spec.name,
                        rel.display()
                    ));
                    return None;
                }
            };
            if !self.owned_by_pod(&f) {
                return None;
            }
            let max = vkd_provider::MAX_TERMINATION_MESSAGE as u64;
            let len = f.metadata().map_or(0, |m| m.len());
            let mut buf = Vec::new();
            f.seek(std::io::SeekFrom::Start(len.saturating_sub(max)))
                .and_then(|_| f.take(max).read_to_end(&mut buf))
                .ok()?;
            Some(String::from_utf8_lossy(&buf).into_owned())
        });
        let fallback = spec.termination_message_policy
            == vkd_provider::TerminationMessagePolicy::FallbackToLogsOnError
            && code != 0;
        match from_file {
            Some(m) if !m.is_empty() => Some(m),
            _ if fallback => {
                let tail = crate::logs::tail(
                    &self.sandbox.logs(&spec.name),
                    vkd_provider::TERMINATION_MESSAGE_LOG_LINES,
                    vkd_provider::TERMINATION_MESSAGE_LOG_BYTES,
                );
                (!tail.is_empty()).then(|| String::from_utf8_lossy(&tail).into_owned())
            }
            _ => None,
        }
    }

    /// What the kubelet would send as an Event goes to the shim's own log (`shim.log`).
    fn note(&self, text: &str) {
        eprintln!(
            "process-shim: {}/{}: {text}",
            self.spec.spec.pod.namespace, self.spec.spec.pod.name
        );
    }

    /// Runs a hook or probe action; true on success.
    async fn handle(
        &self,
        h: &Handler,
        launch: &Launch,
        spec: &ContainerSpec,
        timeout: Duration,
    ) -> bool {
        match h {
            Handler::Exec { command } => {
                // Hooks and probes run in the container's cgroup, as its processes do.
                let cgroup = self
                    .pod_cgroup
                    .as_ref()
                    .map(|p| p.join(&spec.name))
                    .filter(|d| d.is_dir());
                // With namespaces, in the container's own.
                let isolation = if self.spec.isolated {
                    match self.process_of(&spec.name) {
                        Some(p) => Some(crate::launch::Isolation::Enter(p.pid)),
                        None => return false,
                    }
                } else {
                    None
                };
                let Ok(mut cmd) = self.command(launch, command, spec, cgroup.as_deref(), isolation)
                else {
                    return false;
                };
                cmd.stdout(std::process::Stdio::null())
                    .stderr(std::process::Stdio::null())
                    .kill_on_drop(true);
                let Ok(mut child) = self.spawn(&mut cmd) else {
                    return false;
                };
                let own = child.id();
                let pid = own.and_then(|p| i32::try_from(p).ok());
                let ok = match tokio::time::timeout(timeout, child.wait()).await {
                    Ok(Ok(st)) => st.success(),
                    _ => {
                        if let Some(p) = pid.and_then(rustix::process::Pid::from_raw) {
                            let _ = rustix::process::kill_process_group(p, Signal::KILL);
                        }
                        // Reaped here, so its PID is never left for another to wait on.
                        let _ = child.wait().await;
                        false
                    }
                };
                self.forget(own);
                ok
            }
            Handler::HttpGet {
                host,
                port,
                path,
                headers,
                ..
            } => {
                let host = host
                    .as_deref()
                    .or(self.spec.pod_ip.as_deref())
                    .unwrap_or("127.0.0.1");
                matches!(tokio::time::timeout(timeout, http_get(host, *port, path, headers)).await, Ok(Ok(code)) if (200..400).contains(&code))
            }
            Handler::TcpSocket { host, port } => {
                let host = host
                    .as_deref()
                    .or(self.spec.pod_ip.as_deref())
                    .unwrap_or("127.0.0.1");
                matches!(
                    tokio::time::timeout(timeout, tokio::net::TcpStream::connect((host, *port)))
                        .await,
                    Ok(Ok(_))
                )
            }
            Handler::Sleep { seconds } => {
                tokio::time::sleep(Duration::from_secs(*seconds).min(timeout)).await;
                true
            }
        }
    }
}

/// With namespaces, waits until the container's program runs in them
/// (`isolation::program_started`), or its launcher has ended, before the
/// container counts as running: its postStart hook, probes and exec then
/// enter what the program sees. Bounded: a launcher stuck before its exec is
/// left to its own end, and an exec meanwhile is refused by the launcher.
async fn await_program(child: &mut tokio::process::Child, launcher: Option<ProcessId>) {
    let Some(launcher) = launcher else {
        return;
    };
    for _ in 0..2000 {
        if crate::isolation::program_started(launcher.pid) || !matches!(child.try_wait(), Ok(None))
        {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn far_future() -> Instant {
    Instant::now() + Duration::from_secs(86_400)
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// How a container is asked to stop: SIGTERM, or SIGKILL while its launcher has
/// not yet become the program, or the program is in its first moments without
/// a SIGTERM handler. A SIGTERM then would end it with 143, as if the program
/// had run and been terminated; there is nothing to be graceful to, and the
/// kubelet's runtime reports such a container as killed (137): there the
/// program is its PID namespace's init, which ignores a signal it has no
/// handler for.
fn stop_signal(group: ProcessId) -> Signal {
    if group.still_launching() || group.starting_without_sigterm_handler() {
        Signal::KILL
    } else {
        Signal::TERM
    }
}

/// The exit code the kubelet reports: the program's, or 128 + the signal that killed it.
pub(crate) fn exit_code(st: ExitStatus) -> i32 {
    use std::os::unix::process::ExitStatusExt;
    st.code().unwrap_or_else(|| 128 + st.signal().unwrap_or(0))
}

fn oom_kills(cgroup: &Path) -> u64 {
    std::fs::read_to_string(cgroup.join("memory.events"))
        .ok()
        .and_then(|t| {
            t.lines()
                .find_map(|l| l.strip_prefix("oom_kill ")?.trim().parse().ok())
        })
        .unwrap_or(0)
}

async fn pump(
    stream: impl tokio::io::AsyncRead + Unpin,
    name: &'static str,
    writer: Arc<Mutex<LogWriter>>,
) {
    let mut reader = tokio::io::BufReader::new(stream);
    let mut buf = Vec::new();
    loop {
        buf.clear();
        match reader.read_until(b'\n', &mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(_) => {
                let complete = buf.last() == Some(&b'\n');
                let content = buf.strip_suffix(b"\n").unwrap_or(&buf);
                let mut w = match writer.lock() {
                    Ok(g) => g,
                    Err(p) => p.into_inner(),
                };
                if let Err(e) = w.line(name, content, complete) {
                    eprintln!("process-shim: writing the log: {e}");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // a failed unwrap is a failed test
    use super::*;

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
