//! The shim's children: the processes it starts and waits for, the orphans
//! re-parented to it (it is a child subreaper), the pause process of a shared
//! PID namespace, and how a container is asked to stop.

use std::path::Path;
use std::time::Duration;

use rustix::process::Signal;

use super::{Shim, lock};
use crate::procfs::ProcessId;

impl Shim {
    /// Starts a process of the Pod and remembers it as the shim's own.
    pub(super) fn spawn(
        &self,
        cmd: &mut tokio::process::Command,
    ) -> std::io::Result<tokio::process::Child> {
        // The runtime is single-threaded: no reap runs between the spawn and the insert.
        let child = cmd.spawn()?;
        if let Some(pid) = child.id().and_then(|p| i32::try_from(p).ok()) {
            lock(&self.own).insert(pid);
        }
        Ok(child)
    }

    pub(super) fn forget(&self, child: Option<u32>) {
        if let Some(pid) = child.and_then(|p| i32::try_from(p).ok()) {
            lock(&self.own).remove(&pid);
        }
    }

    /// Reaps orphans that exited; with `kill` (the Pod is over, nothing of its
    /// own is waited for any more), kills every child first. Returns how many
    /// children remain.
    pub(super) fn reap_orphans(&self, kill: bool) -> usize {
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
    pub(super) fn start_pause(&self) -> std::io::Result<()> {
        let args = crate::launch::LaunchArgs {
            cgroup: None,
            data_limit: None,
            nproc_limit: None,
            user: self.spec.run_as,
            env_file: Path::new("/dev/null"),
            cwd: Path::new("/"),
            isolation: Some(crate::launch::Isolation::Pause),
            privileges: crate::hardening::Privileges::default(),
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
            if crate::procfs::program_of(id.pid) != id.pid {
                self.update(|s| s.pause = Some(id));
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        Err(std::io::Error::other("the pause process did not start"))
    }

    /// The Pod is over: every process it left, wherever it went, is killed.
    pub(super) async fn end_all(&self) {
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
    pub(super) fn ask_to_stop(&self, g: ProcessId) {
        let signal = stop_signal(g);
        if !self.spec.isolated || signal == Signal::KILL {
            g.signal_group(signal);
            return;
        }
        if g.alive()
            && let Some(pid) = rustix::process::Pid::from_raw(crate::procfs::program_of(g.pid))
        {
            let _ = rustix::process::kill_process(pid, signal);
        }
    }

    /// The running process of container (or init container) `name`.
    pub(super) fn process_of(&self, name: &str) -> Option<ProcessId> {
        let st = lock(&self.status);
        st.init
            .iter()
            .chain(&st.containers)
            .find(|c| c.status.name == name)
            .and_then(|c| c.process)
            .filter(ProcessId::alive)
    }
}

/// How a container is asked to stop: SIGTERM, or SIGKILL while its launcher has
/// not yet become the program, or the program is in its first moments without
/// a SIGTERM handler. A SIGTERM then would end it with 143, as if the program
/// had run and been terminated; there is nothing to be graceful to, and the
/// kubelet's runtime reports such a container as killed (137): there the
/// program is its PID namespace's init, which ignores a signal it has no
/// handler for.
pub(super) fn stop_signal(group: ProcessId) -> Signal {
    if group.still_launching() || group.starting_without_sigterm_handler() {
        Signal::KILL
    } else {
        Signal::TERM
    }
}
