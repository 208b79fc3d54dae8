//! What runs inside a Slurm job: `vkd-slurm run-job <dir>` is the batch
//! script; it starts each container as a job step (`srun --overlap ...
//! vkd-slurm run-container <dir> <name>`), init containers first and one at a
//! time, restarts them as the Pod's restartPolicy says (with the kubelet's
//! back-off, 10 s doubling to 5 min), and writes what it sees into the Pod's
//! directory for the provider to read. `run-container` is the step: it runs
//! the container's command with the Pod's environment and writes its output
//! as CRI log lines. `enter` is what `kubectl exec` runs in a step, and
//! `connect` carries a port-forward.
//!
//! A deletion marks the Pod's directory, then Slurm signals the steps
//! (`scancel --signal=TERM`): the containers get SIGTERM, nothing is
//! restarted, the runner waits for its steps and the job ends. A cancel
//! (`scancel`) also signals the runner itself, with the same effect.

use std::path::Path;
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::sync::Mutex;
use tokio_util::sync::CancellationToken;
use vkd_provider::{ContainerSpec, InstanceSpec, RestartPolicy};

use crate::pod_dir::{Exit, PodDir, checked_container};
use crate::streams::status_code;

/// The first restart waits this long, each next one twice as long, at most [`BACKOFF_MAX`].
const BACKOFF_START: Duration = Duration::from_secs(10);
const BACKOFF_MAX: Duration = Duration::from_secs(300);
/// A container that ran this long without exiting starts its back-off afresh.
const BACKOFF_RESET: Duration = Duration::from_secs(600);

/// The most content a log line holds, as the kubelet's CRI log lines.
const LOG_LINE_MAX: u64 = 16 << 10;
/// The PATH a container gets when its env does not set one.
const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

#[derive(Debug, thiserror::Error)]
pub enum JobError {
    #[error("{0}")]
    Provider(#[from] vkd_provider::ProviderError),
    #[error("container {0} is not in the Pod's spec")]
    NoContainer(String),
    #[error("{what}: {source}")]
    Io {
        what: String,
        source: std::io::Error,
    },
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> JobError {
    let what = what.into();
    move |source| JobError::Io { what, source }
}

fn find<'a>(spec: &'a InstanceSpec, name: &str) -> Result<&'a ContainerSpec, JobError> {
    spec.init_containers
        .iter()
        .chain(&spec.containers)
        .find(|c| c.name == name)
        .ok_or_else(|| JobError::NoContainer(name.to_owned()))
}

/// `run-job`: the batch script. Exits 0 when the Pod's containers are done
/// as its restartPolicy wants, 1 when an init container failed for good.
pub async fn run_job(dir: &Path) -> Result<i32, JobError> {
    let pod = PodDir {
        path: dir.to_owned(),
    };
    let spec = Arc::new(pod.read_spec()?);
    let runner = std::env::current_exe().map_err(io("the runner's own path"))?;
    let stop = CancellationToken::new();
    tokio::spawn(stop_on_sigterm(stop.clone()));
    let step = Step {
        pod: pod.clone(),
        runner,
        stop: stop.clone(),
        policy: spec.restart_policy,
        sidecar: false,
    };
    let sidecars = CancellationToken::new();
    let mut sidecar_tasks = Vec::new();
    for init in &spec.init_containers {
        if init.restart_always {
            // A sidecar: it starts in its place and keeps running.
            let step = Step {
                stop: sidecars.clone(),
                policy: RestartPolicy::Always,
                sidecar: true,
                ..step.clone()
            };
            let name = init.name.clone();
            sidecar_tasks.push(tokio::spawn(async move { step.keep(&name).await }));
            continue;
        }
        let init_step = Step {
            policy: match spec.restart_policy {
                RestartPolicy::Never => RestartPolicy::Never,
                _ => RestartPolicy::OnFailure,
            },
            ..step.clone()
        };
        if init_step.keep(&init.name).await != 0 {
            sidecars.cancel();
            return Ok(1);
        }
    }
    let tasks: Vec<_> = spec
        .containers
        .iter()
        .map(|c| {
            let (step, name) = (step.clone(), c.name.clone());
            tokio::spawn(async move { step.keep(&name).await })
        })
        .collect();
    for t in tasks {
        let _ = t.await;
    }
    sidecars.cancel();
    for t in sidecar_tasks {
        let _ = t.await;
    }
    Ok(0)
}

async fn stop_on_sigterm(stop: CancellationToken) {
    use tokio::signal::unix::{SignalKind, signal};
    if let Ok(mut term) = signal(SignalKind::terminate()) {
        term.recv().await;
        stop.cancel();
    }
}

#[derive(Clone, Debug)]
struct Step {
    pod: PodDir,
    runner: std::path::PathBuf,
    stop: CancellationToken,
    policy: RestartPolicy,
    sidecar: bool,
}

impl Step {
    /// Runs a container as steps, again as the policy says; its last exit code.
    async fn keep(&self, name: &str) -> i32 {
        let mut backoff = BACKOFF_START;
        loop {
            let started = SystemTime::now();
            let code = self.once(name, started).await;
            let restart = match self.policy {
                RestartPolicy::Always => true,
                RestartPolicy::OnFailure => code != 0,
                RestartPolicy::Never => false,
            };
            // A deleted Pod's containers are not restarted (the provider
            // marks the deletion before it signals the steps).
            if !restart || self.stop.is_cancelled() || self.pod.deleted().is_some() {
                return code;
            }
            if started.elapsed().unwrap_or_default() > BACKOFF_RESET {
                backoff = BACKOFF_START;
            }
            tokio::select! {
                () = tokio::time::sleep(backoff) => {}
                () = self.stop.cancelled() => return code,
            }
            backoff = (backoff * 2).min(BACKOFF_MAX);
            let mut r = self.pod.record(name);
            r.restarts = r.restarts.saturating_add(1);
            let _ = self.pod.set_record(name, &r);
            let _ = std::fs::rename(self.pod.log(name), self.pod.previous_log(name));
        }
    }

    /// One run of a container as a job step; its exit code.
    async fn once(&self, name: &str, started: SystemTime) -> i32 {
        let mut record = self.pod.record(name);
        record.running_since = Some(started);
        let _ = self.pod.set_record(name, &record);
        let mut srun = tokio::process::Command::new("srun");
        srun.args([
            "--overlap",
            "--nodes=1",
            "--ntasks=1",
            "--quiet",
            "--input=none",
            "--output=none",
            "--error=none",
            "--kill-on-bad-exit=0",
            &format!("--job-name={name}"),
        ])
        .arg(&self.runner)
        .arg("run-container")
        .arg(&self.pod.path)
        .arg(name)
        .stdin(Stdio::null());
        // Slurm signals the step itself (a deletion's `scancel --signal=TERM`
        // reaches every step); srun is only waited for: a SIGTERM to srun
        // would make it kill the step at once.
        let code = match srun.spawn() {
            Ok(mut child) => {
                let status = tokio::select! {
                    s = child.wait() => s,
                    // A sidecar is stopped once the containers are done.
                    () = self.stop.cancelled(), if self.sidecar => {
                        if let Some(pid) = child.id().and_then(|p| rustix::process::Pid::from_raw(p as i32)) {
                            let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
                        }
                        child.wait().await
                    }
                };
                status.map_or(128, status_code)
            }
            Err(e) => {
                eprintln!("vkd-slurm: starting the step of container {name}: {e}");
                127
            }
        };
        let mut record = self.pod.record(name);
        record.running_since = None;
        record.last = record.exit.take();
        record.exit = Some(Exit {
            code,
            started_at: started,
            finished_at: SystemTime::now(),
        });
        let _ = self.pod.set_record(name, &record);
        code
    }
}

/// The container's command line and environment as a process.
fn container_command(pod: &PodDir, c: &ContainerSpec, extra: &[String]) -> tokio::process::Command {
    let (program, args): (&String, Vec<&String>) = if extra.is_empty() {
        let mut all = c.command.iter().chain(&c.args);
        // Checked at admission: a container has a command (its name, never
        // found on PATH, would fail with 127 if one came without).
        match all.next() {
            Some(p) => (p, all.collect()),
            None => (&c.name, Vec::new()),
        }
    } else {
        (&extra[0], extra[1..].iter().collect())
    };
    let mut cmd = tokio::process::Command::new(program);
    cmd.args(args).env_clear();
    if !c.env.iter().any(|(k, _)| k == "PATH") {
        cmd.env("PATH", DEFAULT_PATH);
    }
    if !c.env.iter().any(|(k, _)| k == "HOME") {
        cmd.env("HOME", pod.work());
    }
    // The Slurm job's own variables first, so a Pod may see where it runs.
    for (k, v) in std::env::vars_os() {
        if k.to_string_lossy().starts_with("SLURM_") || k == "CUDA_VISIBLE_DEVICES" {
            cmd.env(k, v);
        }
    }
    cmd.envs(c.env.iter().map(|(k, v)| (k, v)));
    let dir = match &c.working_dir {
        Some(d) if !d.is_empty() => std::path::PathBuf::from(d),
        _ => pod.work(),
    };
    cmd.current_dir(dir);
    cmd
}

/// `run-container`: one run of a container, its output as CRI log lines.
pub async fn run_container(dir: &Path, name: &str) -> Result<i32, JobError> {
    let pod = PodDir {
        path: dir.to_owned(),
    };
    let spec = pod.read_spec()?;
    let c = find(&spec, checked_container(name)?)?;
    let log_path = pod.log(name);
    let log = tokio::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&log_path)
        .await
        .map_err(io(log_path.display().to_string()))?;
    let log = Arc::new(Mutex::new(log));
    let mut child = match container_command(&pod, c, &[])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
    {
        Ok(child) => child,
        Err(e) => {
            let line = format!("vkd-slurm: cannot run {:?}: {e}", c.command);
            write_line(&log, "stderr", "F", line.as_bytes()).await;
            return Ok(if e.kind() == std::io::ErrorKind::NotFound {
                127
            } else {
                126
            });
        }
    };
    let copies = [
        child
            .stdout
            .take()
            .map(|o| copy_lines(o, "stdout", Arc::clone(&log))),
        child
            .stderr
            .take()
            .map(|e| copy_lines(e, "stderr", Arc::clone(&log))),
    ];
    let stop = CancellationToken::new();
    tokio::spawn(stop_on_sigterm(stop.clone()));
    let status = tokio::select! {
        s = child.wait() => s,
        () = stop.cancelled() => {
            if let Some(pid) = child.id().and_then(|p| rustix::process::Pid::from_raw(p as i32)) {
                let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
            }
            child.wait().await
        }
    };
    for c in copies.into_iter().flatten() {
        let _ = c.await;
    }
    Ok(status.map_or(128, status_code))
}

fn copy_lines(
    from: impl tokio::io::AsyncRead + Unpin + Send + 'static,
    stream: &'static str,
    log: Arc<Mutex<tokio::fs::File>>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut lines = BufReader::new(from);
        let mut line = Vec::new();
        loop {
            line.clear();
            // At most LOG_LINE_MAX of content a line; a longer one is written
            // as partial lines, as the kubelet's CRI logs are.
            match (&mut lines)
                .take(LOG_LINE_MAX)
                .read_until(b'\n', &mut line)
                .await
            {
                Ok(0) | Err(_) => return,
                Ok(n) => {
                    let (text, tag) = match line.strip_suffix(b"\n") {
                        Some(text) => (text, "F"),
                        None if n as u64 >= LOG_LINE_MAX => (&line[..], "P"),
                        None => (&line[..], "F"),
                    };
                    write_line(&log, stream, tag, text).await;
                }
            }
        }
    })
}

async fn write_line(log: &Mutex<tokio::fs::File>, stream: &str, tag: &str, text: &[u8]) {
    let mut out = format!("{} {stream} {tag} ", jiff::Timestamp::now()).into_bytes();
    out.extend_from_slice(text);
    out.push(b'\n');
    let _ = log.lock().await.write_all(&out).await;
}

/// `enter`: runs `command` as the container would (its env, its working
/// directory), in place of this process: what `kubectl exec` reaches.
pub fn enter(dir: &Path, name: &str, command: &[String]) -> JobError {
    use std::os::unix::process::CommandExt;
    let pod = PodDir {
        path: dir.to_owned(),
    };
    let spec = match pod.read_spec() {
        Ok(s) => s,
        Err(e) => return e.into(),
    };
    let c = match checked_container(name)
        .map_err(JobError::from)
        .and_then(|n| find(&spec, n))
    {
        Ok(c) => c,
        Err(e) => return e,
    };
    if command.is_empty() {
        return JobError::NoContainer("(no command given)".into());
    }
    let cmd = container_command(&pod, c, command);
    let mut cmd = cmd.into_std();
    io(format!("running {:?}", command[0]))(cmd.exec())
}

/// `connect`: carries stdin to `127.0.0.1:port` on this node and what it
/// answers to stdout (one port-forward connection).
pub async fn connect(port: u16) -> Result<(), JobError> {
    let stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .map_err(io(format!("connecting to port {port}")))?;
    let (mut read, mut write) = stream.into_split();
    let up = tokio::spawn(async move {
        let _ = tokio::io::copy(&mut tokio::io::stdin(), &mut write).await;
        let _ = write.shutdown().await;
    });
    // Done when the port's side closes; the caller's side may stay open.
    let mut out = tokio::io::stdout();
    let _ = tokio::io::copy(&mut read, &mut out).await;
    let _ = out.flush().await;
    up.abort();
    Ok(())
}
