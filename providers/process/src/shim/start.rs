//! Starting a run of a container: its command through the launcher (run-as
//! user, rlimits, namespaces), its cgroup, and the pumps that copy its output
//! into its log.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use tokio::io::AsyncBufReadExt;
use vkd_provider::ContainerSpec;

use super::terminate::oom_kills;
use super::{Run, Shim, lock};
use crate::logs::LogWriter;
use crate::procfs::ProcessId;
use crate::sandbox::Launch;

impl Shim {
    /// The container's group inside the Pod's, made with the limits the
    /// controllers enforce.
    /// Fails when the Pod has a cgroup but the container's cannot be made: the
    /// container would run outside its Pod's tracking and limits.
    pub(super) fn cgroup(
        &self,
        spec: &ContainerSpec,
    ) -> Result<Option<std::path::PathBuf>, String> {
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
    pub(super) fn command(
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
            privileges: crate::hardening::Privileges::of(spec.security.as_deref()),
            argv,
        };
        // The launcher is this very program, never a path a file names.
        let mut cmd = tokio::process::Command::from(args.command(Path::new("/proc/self/exe")));
        cmd.process_group(0)
            .stdin(std::process::Stdio::null())
            .kill_on_drop(false);
        Ok(cmd)
    }

    /// Before a container's process starts: its log (a new run, or the next
    /// one after a restart), its working directory checked, its cgroup made,
    /// its termination message file emptied. Fails with why it cannot start.
    pub(super) fn prepare_run(
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
    /// With namespaces, `plan` names its mount plan (an ephemeral container's
    /// too, which joins its target's PID namespace where it names one).
    pub(super) fn spawn_run(
        &self,
        spec: &ContainerSpec,
        launch: &Launch,
        writer: &Arc<Mutex<LogWriter>>,
        cgroup: Option<&Path>,
        plan: Option<PathBuf>,
    ) -> Result<(tokio::process::Child, Run), String> {
        let oom_before = cgroup.map_or(0, oom_kills);
        let program = launch.argv.first().map_or("", String::as_str);
        let pause = lock(&self.status).pause.map(|p| p.pid);
        let held = self.sandbox.held_namespaces(&spec.name);
        let target = spec
            .target_container
            .as_deref()
            .map(|t| self.sandbox.held_namespaces(t));
        let isolation =
            plan.as_deref()
                .filter(|_| self.spec.isolated)
                .map(|plan| match (&target, pause) {
                    (Some(target), _) => crate::launch::Isolation::Target {
                        plan,
                        held: &held,
                        target,
                    },
                    (None, Some(pause)) => crate::launch::Isolation::Shared {
                        plan,
                        held: &held,
                        pause,
                    },
                    (None, None) => crate::launch::Isolation::New { plan, held: &held },
                });
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
}

/// With namespaces, waits until the container's program runs in them
/// (`procfs::program_started`), or its launcher has ended, before the
/// container counts as running: its postStart hook, probes and exec then
/// enter what the program sees. Bounded: a launcher stuck before its exec is
/// left to its own end, and an exec meanwhile is refused by the launcher.
pub(super) async fn await_program(child: &mut tokio::process::Child, launcher: Option<ProcessId>) {
    let Some(launcher) = launcher else {
        return;
    };
    for _ in 0..2000 {
        if crate::procfs::program_started(launcher.pid) || !matches!(child.try_wait(), Ok(None)) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

pub(super) async fn pump(
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
