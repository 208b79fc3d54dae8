//! Hook and probe actions (exec, httpGet, tcpSocket, sleep) as the shim runs
//! them: an exec in the container's cgroup and, with namespaces, in its
//! namespaces.

use std::time::Duration;

use rustix::process::Signal;
use vkd_provider::{ContainerSpec, Handler};

use super::Shim;
use super::probes::http_get;
use crate::sandbox::Launch;

impl Shim {
    /// Runs a hook or probe action; true on success.
    pub(super) async fn handle(
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
