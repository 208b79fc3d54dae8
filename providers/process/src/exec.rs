//! `kubectl exec` and `kubectl port-forward` into a running Pod: an exec runs
//! through the launcher as the container's own processes do (its user, cgroup,
//! limits and namespaces); a port-forward connects in the Pod's network.

use std::path::PathBuf;
use std::time::Duration;

use tokio::io::AsyncWriteExt;
use vkd_provider::{ContainerState, Duplex, ProviderError, Result, StreamIo};

use crate::sandbox::Launch;
use crate::stream::{copy_out, exec_tty};
use crate::{ProcessProvider, cgroup, ephemeral, io_err, launch, network};

#[derive(Debug)]
struct RunningContainer {
    launch: Launch,
    cgroup: Option<PathBuf>,
    memory: Option<u64>,
    pids_limit: Option<u64>,
    /// The cgroup hierarchy the shim used, from spec.json.
    controllers: Option<cgroup::CgroupParent>,
    env_file: PathBuf,
    /// With namespaces: the container's launcher, whose namespaces (held
    /// in `held`) exec enters.
    process: Option<i32>,
    held: PathBuf,
    privileges: crate::hardening::Privileges,
}

impl ProcessProvider {
    /// What `kubectl exec` into `container` runs as: its launch, its cgroup, its
    /// memory limit (as an rlimit where there is no cgroup) and its environment file.
    fn running_process(&self, uid: &str, container: &str) -> Result<RunningContainer> {
        let not_found = || ProviderError::NotFound {
            uid: uid.to_owned(),
        };
        let (sb, _, st) = self.read(uid)?.ok_or_else(not_found)?;
        let spec = sb
            .read_spec()
            .map_err(io_err(&sb.spec()))?
            .ok_or_else(not_found)?;
        let launch = spec
            .containers
            .iter()
            .rev()
            .find(|l| l.name == container)
            .cloned()
            .or_else(|| ephemeral::launch(&sb, container))
            .ok_or_else(|| {
                ProviderError::invalid(
                    "NotFound",
                    format!("no container {container:?} in this Pod"),
                )
            })?;
        let run = st
            .iter()
            .flat_map(|s| {
                s.containers
                    .iter()
                    .chain(&s.init)
                    .chain(s.ephemeral.iter().flatten())
            })
            .find(|c| {
                c.status.name == container
                    && matches!(c.status.state, ContainerState::Running { .. })
            })
            .ok_or_else(|| {
                ProviderError::invalid(
                    "ContainerNotRunning",
                    format!("container {container:?} is not running"),
                )
            })?;
        let env_file = sb
            .ensure_env_file(&launch)
            .map_err(io_err(&sb.env_file(&launch.name)))?;
        let container_spec = spec
            .spec
            .init_containers
            .iter()
            .chain(&spec.spec.containers)
            .find(|c| c.name == container)
            .cloned()
            .or_else(|| {
                ephemeral::read_request(&sb, container)
                    .ok()
                    .flatten()
                    .map(|r| r.spec)
            })
            .unwrap_or_default();
        let memory = container_spec.limits.memory_bytes;
        Ok(RunningContainer {
            launch,
            cgroup: run.cgroup.clone(),
            memory,
            pids_limit: spec.pids_rlimit,
            controllers: spec.cgroup,
            env_file,
            process: run.process.filter(|_| spec.isolated).map(|p| p.pid),
            held: sb.held_namespaces(container),
            privileges: crate::hardening::Privileges::of(container_spec.security.as_deref()),
        })
    }

    fn exec_command(&self, run: &RunningContainer, command: &[String]) -> std::process::Command {
        // The hierarchy the shim made the Pod's cgroup in, as spec.json records it.
        let (data_limit, nproc_limit) = launch::rlimits(
            run.controllers.as_ref().filter(|_| run.cgroup.is_some()),
            run.memory,
            run.pids_limit,
        );
        launch::LaunchArgs {
            cgroup: run.cgroup.as_deref(),
            data_limit,
            nproc_limit,
            user: Some(self.inner.run_as),
            env_file: &run.env_file,
            cwd: &run.launch.cwd,
            isolation: run.process.map(|launcher| launch::Isolation::Enter {
                launcher,
                held: &run.held,
            }),
            privileges: run.privileges,
            argv: command,
        }
        .command(&self.inner.shim_exe)
    }

    pub(super) async fn exec_in(
        &self,
        uid: &str,
        container: &str,
        command: Vec<String>,
        io: StreamIo,
    ) -> Result<i32> {
        if command.is_empty() {
            return Err(ProviderError::invalid(
                "InvalidRequest",
                "exec needs a command",
            ));
        }
        let run = {
            let (uid, container) = (uid.to_owned(), container.to_owned());
            self.blocking(move |p| p.running_process(&uid, &container))
                .await?
        };
        let std_cmd = self.exec_command(&run, &command);
        if io.tty {
            return exec_tty(std_cmd, io).await;
        }
        let mut cmd = tokio::process::Command::from(std_cmd);
        cmd.stdin(if io.stdin.is_some() {
            std::process::Stdio::piped()
        } else {
            std::process::Stdio::null()
        })
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .process_group(0)
        .kill_on_drop(true);
        let mut child = cmd
            .spawn()
            .map_err(|e| ProviderError::transient(format!("starting exec: {e}")))?;
        let StreamIo {
            stdin,
            stdout,
            stderr,
            ..
        } = io;
        let feed = match (stdin, child.stdin.take()) {
            (Some(mut from), Some(mut to)) => Some(tokio::spawn(async move {
                let _ = tokio::io::copy(&mut from, &mut to).await;
                let _ = to.shutdown().await;
            })),
            _ => None,
        };
        let out = copy_out(child.stdout.take(), stdout);
        let err = copy_out(child.stderr.take(), stderr);
        let (_, _, status) = tokio::join!(out, err, child.wait());
        if let Some(f) = feed {
            f.abort();
        }
        let status =
            status.map_err(|e| ProviderError::transient(format!("waiting for exec: {e}")))?;
        Ok(crate::procfs::exit_code(status))
    }

    pub(super) async fn forward_port(
        &self,
        uid: &str,
        port: u16,
        mut stream: Box<dyn Duplex>,
    ) -> Result<()> {
        let Some((sb, rec, _)) = self.read(uid)? else {
            return Err(ProviderError::NotFound {
                uid: uid.to_owned(),
            });
        };
        let attachment = network::attachment_of(&sb.dir).map_err(io_err(&sb.dir))?;
        if rec.ip.is_some() && attachment.is_none() {
            // Never the host's loopback in place of a Pod's own.
            return Err(ProviderError::invalid(
                "NotRunning",
                format!("Pod {uid} has ended: its network is gone"),
            ));
        }
        let refused =
            |e: std::io::Error| ProviderError::transient(format!("connecting to port {port}: {e}"));
        // In the Pod's own network, its loopback, as a runtime's port-forward.
        let mut upstream = match attachment {
            Some(a) => {
                let loopback = std::net::SocketAddr::from(([127, 0, 0, 1], port));
                let std = tokio::task::spawn_blocking(move || {
                    network::connect_in(&a.netns, &[loopback], Duration::from_secs(10))
                })
                .await
                .map_err(|e| ProviderError::transient(format!("connecting to port {port}: {e}")))?
                .and_then(|connected| connected)
                .map_err(refused)?;
                std.set_nonblocking(true).map_err(refused)?;
                tokio::net::TcpStream::from_std(std).map_err(refused)?
            }
            None => tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .map_err(refused)?,
        };
        let _ = tokio::io::copy_bidirectional(&mut stream, &mut upstream).await;
        Ok(())
    }
}
