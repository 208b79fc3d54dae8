//! Ephemeral containers in the shim (`kubectl debug`).
//!
//! The provider writes a request per container, `ephemeral/<name>.json`; the
//! shim looks for new ones twice a second for as long as the Pod runs, and
//! starts each once, as it starts the Pod's containers: through the launcher,
//! as the run-as user, with the rlimits, in a cgroup of its own inside the
//! Pod's, with its log in `logs/<name>/`. It is never restarted (as the
//! kubelet: "ephemeral containers are never restarted"), has no probes or
//! hooks, counts toward neither the Pod's phase nor its readiness, and is
//! stopped (SIGTERM, the grace period, SIGKILL) when the Pod stops or its
//! containers have ended. Its state goes to `status.json` (`ephemeral`).

use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use rustix::process::Signal;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use vkd_provider::{ContainerState, Terminated};

use super::{Ended, Shim, after, far_future, lock, run_of, waiting};
use crate::ephemeral::{EphemeralRequest, read_request, requested};

/// How often the shim looks for new requests.
const POLL: Duration = Duration::from_millis(500);

/// The ephemeral containers of a running shim.
pub(super) struct Ephemeral {
    /// The Pod's containers have ended: no new ones, and the running ones stop.
    over: watch::Sender<bool>,
    watcher: JoinHandle<()>,
    tasks: Arc<Mutex<Vec<JoinHandle<()>>>>,
}

impl Ephemeral {
    /// Stops taking requests, stops the running ephemeral containers (with
    /// the grace period) and waits until they have ended and are recorded.
    pub(super) async fn finish(self) {
        let _ = self.over.send(true);
        let _ = self.watcher.await;
        let tasks = std::mem::take(&mut *lock(&self.tasks));
        for t in tasks {
            let _ = t.await;
        }
    }
}

impl Shim {
    /// Starts looking for requests.
    pub(super) fn start_ephemeral(self: &Arc<Self>) -> Ephemeral {
        let (over, over_rx) = watch::channel(false);
        let tasks: Arc<Mutex<Vec<JoinHandle<()>>>> = Arc::default();
        let watcher = {
            let this = Arc::clone(self);
            let tasks = Arc::clone(&tasks);
            let mut over_rx = over_rx.clone();
            tokio::spawn(async move {
                loop {
                    if *over_rx.borrow() || this.stopping() {
                        return;
                    }
                    this.take_requests(&tasks, &over_rx);
                    tokio::select! {
                        () = tokio::time::sleep(POLL) => {}
                        _ = over_rx.changed() => {}
                        () = this.stop_wanted(false) => {}
                    }
                }
            })
        };
        Ephemeral {
            over,
            watcher,
            tasks,
        }
    }

    /// Starts a task for each request the shim has not taken yet.
    fn take_requests(
        self: &Arc<Self>,
        tasks: &Arc<Mutex<Vec<JoinHandle<()>>>>,
        over: &watch::Receiver<bool>,
    ) {
        for name in requested(&self.sandbox) {
            let known = lock(&self.status)
                .ephemeral
                .as_ref()
                .is_some_and(|l| l.iter().any(|c| c.status.name == name));
            if known {
                continue;
            }
            let request = match read_request(&self.sandbox, &name) {
                Ok(Some(r)) if r.spec.name == name && r.launch.name == name => r,
                Ok(None) => continue,
                other => {
                    // Never silent: the container is recorded as never started.
                    let why = match other {
                        Err(e) => format!("reading its request: {e}"),
                        _ => "its request names another container".to_owned(),
                    };
                    self.note(&format!("ephemeral container {name}: {why}"));
                    self.push_ephemeral(
                        &name,
                        ContainerState::Terminated(Terminated {
                            exit_code: 128,
                            reason: "StartError".into(),
                            message: Some(why),
                            started_at: None,
                            finished_at: SystemTime::now(),
                        }),
                    );
                    continue;
                }
            };
            self.push_ephemeral(&name, waiting("ContainerCreating", None));
            let task = tokio::spawn(Arc::clone(self).run_ephemeral(request, over.clone()));
            lock(tasks).push(task);
        }
    }

    fn push_ephemeral(&self, name: &str, state: ContainerState) {
        self.update(|s| {
            let mut run = run_of(name, state);
            run.status.started = None;
            s.ephemeral.get_or_insert_with(Vec::new).push(run);
        });
    }

    fn set_ephemeral(&self, name: &str, f: impl FnOnce(&mut crate::sandbox::ContainerRun)) {
        self.update(|s| {
            if let Some(c) = s
                .ephemeral
                .iter_mut()
                .flatten()
                .find(|c| c.status.name == name)
            {
                f(c);
            }
        });
    }

    /// Runs one ephemeral container to its end, once, and records how it ended.
    async fn run_ephemeral(
        self: Arc<Self>,
        request: EphemeralRequest,
        over: watch::Receiver<bool>,
    ) {
        let (spec, launch) = (&request.spec, &request.launch);
        let (ended, oom, started_at) = self.run_ephemeral_once(&request, over).await;
        if let Ended::StartFailed(message) = &ended {
            self.note(&format!(
                "ephemeral container {} did not start: {message}",
                spec.name
            ));
        }
        let term = self.terminated(spec, launch, ended, oom, started_at, SystemTime::now());
        self.set_ephemeral(&spec.name, |c| {
            c.status.state = ContainerState::Terminated(term);
            c.status.ready = false;
            c.process = None;
        });
    }

    /// Resolves when the ephemeral container must stop: the Pod stops, or its
    /// containers have ended.
    async fn ephemeral_stop(&self, mut over: watch::Receiver<bool>) {
        tokio::select! {
            () = self.stop_wanted(false) => {}
            _ = over.wait_for(|o| *o) => {}
        }
    }

    /// Start, log, until the process exits (stopped with the Pod). Returns how
    /// it ended, whether the kernel killed it for memory, and when it started.
    async fn run_ephemeral_once(
        &self,
        request: &EphemeralRequest,
        over: watch::Receiver<bool>,
    ) -> (Ended, bool, Option<SystemTime>) {
        let (spec, launch) = (&request.spec, &request.launch);
        let fail = |why: String| (Ended::StartFailed(why), false, None);
        if self.stopping() || *over.borrow() {
            return fail("the Pod stopped before the container could start".into());
        }
        let (writer, cgroup) = match self.prepare_run(spec, launch, false) {
            Ok(p) => p,
            Err(why) => return fail(why),
        };
        // With namespaces, its own (built from the plan the provider wrote);
        // a request from a vkd that wrote none is refused, never run on the host.
        let plan = self.sandbox.ephemeral_mount_plan(&spec.name);
        if self.spec.isolated && !plan.is_file() {
            if let Some(cg) = &cgroup {
                let _ = std::fs::remove_dir(cg);
            }
            return fail(
                "no mount plan for this ephemeral container (requested through a vkd from \
                 before ephemeral containers had namespaces of their own); add it again"
                    .into(),
            );
        }
        let plan = self.spec.isolated.then_some(plan);
        let (mut child, run) = match self.spawn_run(spec, launch, &writer, cgroup.as_deref(), plan)
        {
            Ok(r) => r,
            Err(why) => {
                if let Some(cg) = &cgroup {
                    let _ = std::fs::remove_dir(cg);
                }
                return fail(why);
            }
        };
        let (process, started_at) = (run.process, run.started_at);
        self.set_ephemeral(&spec.name, |c| {
            c.status.state = ContainerState::Running { started_at };
            c.status.container_id = Some(run.id.clone());
            c.process = process;
            c.cgroup = run.cgroup.clone();
            c.started_at = Some(started_at);
        });
        let exit = child.wait();
        tokio::pin!(exit);
        let stop = self.ephemeral_stop(over);
        tokio::pin!(stop);
        let mut stopping = false;
        let mut kill_at: Option<Instant> = None;
        let status = loop {
            tokio::select! {
                st = &mut exit => break st,
                () = &mut stop, if !stopping => {
                    stopping = true;
                    if let Some(g) = process {
                        g.signal_group(Signal::TERM);
                    }
                    kill_at = Some(after(self.grace()));
                }
                () = tokio::time::sleep_until(kill_at.unwrap_or_else(far_future)), if kill_at.is_some() => {
                    if let Some(g) = process {
                        g.signal_group(Signal::KILL);
                    }
                    kill_at = None;
                }
            }
        };
        self.end_run(run, status).await
    }
}
