//! The process provider: runs each Pod's containers as host processes.
//!
//! There is no image pull and no filesystem isolation. The config maps image
//! names to something runnable here ([`config::ImageMap`]); a Pod whose image or
//! command has no such mapping is rejected at admission with the reason.
//!
//! Each Pod gets a sandbox directory ([`sandbox`]) and a supervisor process, the
//! shim ([`shim`]), started detached so it outlives vkd. The provider only
//! writes the sandbox, starts or signals the shim, and reads what the shim
//! records; after a restart it finds every running Pod again in the state
//! directory and checks each shim's identity (PID plus start time) before
//! trusting or signalling it. `create` is idempotent on the Pod UID: a sandbox
//! that exists is never started twice.

mod attach;
pub mod cgroup;
mod claim;
pub mod config;
mod disk;
mod ephemeral;
mod exec;
pub mod hardening;
pub mod hostport;
pub mod isolation;
pub mod launch;
mod lifecycle;
mod listing;
pub mod logs;
pub mod network;
mod open;
mod prepare;
pub mod procfs;
pub mod sandbox;
pub mod shim;
mod stats;
mod stream;
mod volumes;
mod watch;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use futures::StreamExt;
use futures::stream::BoxStream;
use tokio::sync::broadcast;
use vkd_provider::{
    Admission, Capabilities, Capacity, CapacityKind, Duplex, Fence, Health, Instance,
    InstanceEvent, InstancePhase, InstanceSpec, LogRequest, Logs, Placement, PodStats, Provider,
    ProviderError, Result, StreamIo, Support, Volume,
};

pub use config::ProcessConfig;
pub use listing::{Listing, read_listings};
pub use open::OpenError;
use sandbox::{InstanceRecord, Sandbox, StatusFile};

/// Runs the shim or launcher part when `args` (the whole argv) asks for one;
/// `None` when it is a normal invocation.
pub fn dispatch(args: &[String]) -> Option<i32> {
    match args.get(1).map(String::as_str) {
        Some("process-shim") => Some(shim::main(Path::new(args.get(2)?))),
        Some("process-launch") => Some(launch::main(&args[2..])),
        _ => None,
    }
}

#[derive(Debug)]
struct Inner {
    dir: PathBuf,
    config: ProcessConfig,
    shim_exe: PathBuf,
    host: String,
    run_as: (u32, u32),
    cgroup: Option<cgroup::CgroupParent>,
    events: broadcast::Sender<InstanceEvent>,
    fences: vkd_provider::fence::FenceBook,
    /// The last CPU sample per container, for the usage rate.
    cpu_samples: Mutex<HashMap<(String, String), (SystemTime, u64)>>,
    /// Recent disk measurements of the sandboxes.
    disk: disk::Measurements,
    /// Containers get namespaces of their own (`isolation`).
    isolated: bool,
    /// With namespaces, the kernel allows user namespaces: a Pod with
    /// `hostUsers: false` gets one per container that maps only the run-as
    /// ids; elsewhere such a Pod is refused.
    user_namespaces: bool,
    /// Pods get network namespaces of their own (`network`).
    network: Option<network::Network>,
}

#[derive(Clone, Debug)]
pub struct ProcessProvider {
    inner: Arc<Inner>,
}

fn io_err(path: &Path) -> impl Fn(std::io::Error) -> ProviderError + '_ {
    move |e| ProviderError::transient(format!("{}: {e}", path.display()))
}

fn hostname() -> String {
    rustix::system::uname()
        .nodename()
        .to_string_lossy()
        .into_owned()
}

impl ProcessProvider {
    fn pods_dir(&self) -> PathBuf {
        self.inner.dir.join("pods")
    }

    fn sandbox(&self, uid: &str) -> Sandbox {
        Sandbox::new(self.pods_dir().join(uid))
    }

    /// Refuses a stale epoch, also one another process recorded; the guard holds
    /// the fence lock until the caller's mutation is done.
    fn check_fence(&self, fence: &Fence) -> Result<vkd_provider::fence::FenceGuard> {
        self.inner.fences.check(fence)
    }

    fn instance_of(&self, sb: &Sandbox, rec: InstanceRecord, st: Option<StatusFile>) -> Instance {
        let ephemeral_containers = ephemeral::statuses(sb, st.as_ref());
        // The shim writes the kubelet's waiting reasons itself: PodInitializing
        // for a container while the init containers run.
        let (phase, containers, init_containers, started_at, message, events) = match st {
            Some(s) => (
                s.phase,
                s.containers.into_iter().map(|c| c.status).collect(),
                s.init.into_iter().map(|c| c.status).collect(),
                s.started_at,
                s.message,
                s.events,
            ),
            None => (
                InstancePhase::Pending,
                Vec::new(),
                Vec::new(),
                None,
                None,
                Vec::new(),
            ),
        };
        let _ = sb;
        Instance {
            id: rec.id,
            owner: rec.owner,
            node: rec.node,
            epoch: rec.epoch,
            phase,
            containers,
            ip: rec.ip,
            host: Some(rec.host),
            created_at: rec.created_at,
            started_at,
            message,
            init_containers,
            ephemeral_containers,
            host_ip: None,
            events,
        }
    }

    fn read(&self, uid: &str) -> Result<Option<(Sandbox, InstanceRecord, Option<StatusFile>)>> {
        if uid.is_empty() || uid.contains('/') || uid.starts_with('.') {
            return Ok(None);
        }
        let sb = self.sandbox(uid);
        let Some(rec) = sb.read_instance().map_err(io_err(&sb.instance()))? else {
            return Ok(None);
        };
        let st = sb.read_status().map_err(io_err(&sb.status()))?;
        Ok(Some((sb, rec, st)))
    }
}

impl ProcessProvider {
    /// Runs filesystem and process work off the async runtime's threads.
    async fn blocking<T: Send + 'static>(
        &self,
        work: impl FnOnce(&Self) -> Result<T> + Send + 'static,
    ) -> Result<T> {
        let this = self.clone();
        tokio::task::spawn_blocking(move || work(&this))
            .await
            .map_err(|e| ProviderError::transient(format!("process provider task failed: {e}")))?
    }
}

#[async_trait]
impl Provider for ProcessProvider {
    fn name(&self) -> &str {
        "process"
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            logs: Support::Supported,
            exec: Support::Supported,
            attach: Support::Supported,
            port_forward: Support::Supported,
            stats: Support::Supported,
            volumes: Support::Supported,
            limits: Support::Supported,
            ephemeral_containers: Support::Supported,
            pod_spec: Support::Unsupported,
            pod_network: if self.inner.network.is_some() {
                Support::Supported
            } else {
                Support::Unsupported
            },
            // It hands GPUs out (CUDA_VISIBLE_DEVICES) but does not read NVML.
            gpu_usage: Support::Unsupported,
            backend_queue: Support::Unsupported,
        }
    }

    fn identity(&self) -> Vec<(String, String)> {
        vec![
            (
                "vkd.io/isolation".to_owned(),
                self.isolation_mode().to_owned(),
            ),
            (
                "vkd.io/pod-network".to_owned(),
                self.inner
                    .network
                    .as_ref()
                    .map_or("host".to_owned(), |n| format!("cni:{}", n.name())),
            ),
        ]
    }

    async fn health(&self) -> Health {
        match std::fs::metadata(self.pods_dir()) {
            Ok(m) if m.is_dir() => Health::Healthy,
            _ => Health::Unhealthy {
                reason: "StateDirMissing".into(),
                message: format!("{} is not a directory", self.pods_dir().display()),
            },
        }
    }

    async fn capacity(&self) -> Result<Capacity> {
        let (cpu, mem, n, held) = self.blocking(|p| Ok(p.usage())).await?;
        Ok(Capacity {
            hosts: vec![self.host_slice(cpu, mem, n, &held)],
            kind: CapacityKind::Live,
            observed_at: SystemTime::now(),
            refresh_interval: Duration::from_secs(10),
        })
    }

    async fn admit(&self, spec: &InstanceSpec) -> Result<Admission> {
        if spec.resources.gpus > 0 && self.inner.config.gpus.is_empty() {
            return Ok(Admission::Rejected {
                reason: "TopologyUnsatisfiable".into(),
                message: format!(
                    "needs {} nvidia.com/gpu; host {} has none",
                    spec.resources.gpus, self.inner.host
                ),
            });
        }
        if let Err(ProviderError::Invalid { reason, message }) = self.launches(
            spec,
            &self.sandbox(&spec.pod.uid).root(),
            self.inner.isolated,
        ) {
            return Ok(Admission::Rejected { reason, message });
        }
        // Checked again at create, which is what holds the port.
        let wanted = spec.clone();
        if let Err(ProviderError::Invalid { reason, message }) = self
            .blocking(move |p| p.check_host_ports(&wanted).map(drop))
            .await
        {
            return Ok(Admission::Rejected { reason, message });
        }
        let (cpu_total, mem_total) = self.totals();
        let r = spec.resources;
        if r.cpu_millis > cpu_total || r.memory_bytes > mem_total {
            return Ok(Admission::Rejected {
                reason: "OutOfResources".into(),
                message: format!(
                    "requests {}m cpu and {} bytes memory; host {} has {}m and {} bytes in all",
                    r.cpu_millis, r.memory_bytes, self.inner.host, cpu_total, mem_total
                ),
            });
        }
        let (cpu, mem, n, held) = self.blocking(|p| Ok(p.usage())).await?;
        let mut gpu_ids = Vec::new();
        if spec.resources.gpus > 0 {
            // Which GPUs, by the same rule as every host slice (the spec's
            // own placement, a DRA allocation, is checked, not replaced).
            let free = self.host_slice(cpu, mem, n, &held);
            match vkd_provider::topology::decide(&[free.whole()], &[free], spec) {
                Admission::Fits(p) => gpu_ids = p.gpu_ids,
                other => return Ok(other),
            }
        }
        if n >= self.inner.config.max_pods {
            return Ok(Admission::Queued {
                reason: format!("host {} runs its maximum of {n} Pods", self.inner.host),
            });
        }
        if r.cpu_millis > cpu_total.saturating_sub(cpu)
            || r.memory_bytes > mem_total.saturating_sub(mem)
        {
            return Ok(Admission::Queued {
                reason: format!(
                    "waiting for {}m cpu and {} bytes memory on host {} ({}m and {} bytes free)",
                    r.cpu_millis,
                    r.memory_bytes,
                    self.inner.host,
                    cpu_total.saturating_sub(cpu),
                    mem_total.saturating_sub(mem)
                ),
            });
        }
        Ok(Admission::Fits(Placement {
            host: self.inner.host.clone(),
            gpu_ids,
        }))
    }

    async fn create(&self, fence: &Fence, spec: &InstanceSpec) -> Result<Instance> {
        let (fence, spec) = (fence.clone(), spec.clone());
        self.blocking(move |p| p.create_blocking(&fence, &spec))
            .await
    }

    async fn get(&self, uid: &str) -> Result<Option<Instance>> {
        let uid = uid.to_owned();
        self.blocking(move |p| p.get_blocking(&uid)).await
    }

    async fn delete(&self, fence: &Fence, uid: &str, grace: Duration) -> Result<()> {
        let (fence, uid) = (fence.clone(), uid.to_owned());
        self.blocking(move |p| p.delete_blocking(&fence, &uid, grace))
            .await
    }

    async fn list(&self, node: &str) -> Result<Vec<Instance>> {
        let node = node.to_owned();
        self.blocking(move |p| p.list_blocking(&node)).await
    }

    fn events(&self) -> BoxStream<'static, InstanceEvent> {
        let rx = self.inner.events.subscribe();
        futures::stream::unfold(rx, |mut rx| async move {
            match rx.recv().await {
                Ok(ev) => Some((ev, rx)),
                Err(broadcast::error::RecvError::Lagged(_)) => Some((InstanceEvent::Resync, rx)),
                Err(broadcast::error::RecvError::Closed) => None,
            }
        })
        .boxed()
    }

    async fn logs(&self, uid: &str, container: &str, request: LogRequest) -> Result<Logs> {
        // File reads, off the async workers.
        let (this, uid, container) = (self.clone(), uid.to_owned(), container.to_owned());
        tokio::task::spawn_blocking(move || this.read_logs(&uid, &container, request))
            .await
            .map_err(|e| ProviderError::transient(format!("reading the log: {e}")))?
    }

    async fn exec(
        &self,
        uid: &str,
        container: &str,
        command: Vec<String>,
        io: StreamIo,
    ) -> Result<i32> {
        self.exec_in(uid, container, command, io).await
    }

    async fn attach(&self, uid: &str, container: &str, io: StreamIo) -> Result<()> {
        self.attach_container(uid, container, io).await
    }

    async fn port_forward(&self, uid: &str, port: u16, stream: Box<dyn Duplex>) -> Result<()> {
        self.forward_port(uid, port, stream).await
    }

    async fn update_volumes(&self, fence: &Fence, uid: &str, volumes: &[Volume]) -> Result<()> {
        let (fence, uid, volumes) = (fence.clone(), uid.to_owned(), volumes.to_vec());
        self.blocking(move |p| p.update_volumes_blocking(&fence, &uid, &volumes))
            .await
    }

    async fn stats(&self, uid: &str) -> Result<PodStats> {
        let uid = uid.to_owned();
        self.blocking(move |p| p.stats_blocking(&uid)).await
    }

    async fn start_ephemeral(
        &self,
        fence: &Fence,
        uid: &str,
        container: &vkd_provider::ContainerSpec,
    ) -> Result<()> {
        let (fence, uid, container) = (fence.clone(), uid.to_owned(), container.clone());
        self.blocking(move |p| p.start_ephemeral_blocking(&fence, &uid, &container))
            .await
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // a failed unwrap is a failed test
    use super::*;
    use vkd_provider::ContainerState;

    /// A directory above the state that the Pods' user could write (and so rename
    /// and replace) is refused; the state directory itself is made root's alone.
    #[test]
    fn the_state_tree_must_be_roots_alone() {
        use std::os::unix::fs::PermissionsExt;
        let base = std::env::temp_dir().join(format!("vkd-tree-{}", uuid::Uuid::new_v4().simple()));
        let open = |dir: &Path| {
            let config = ProcessConfig {
                cgroup_parent: "none".into(),
                ..Default::default()
            };
            ProcessProvider::open_unwatched(config, dir, std::env::current_exe().unwrap())
        };
        std::fs::create_dir_all(base.join("shared")).unwrap();
        std::fs::set_permissions(base.join("shared"), std::fs::Permissions::from_mode(0o777))
            .unwrap();
        let err = open(&base.join("shared/state/process")).unwrap_err();
        assert!(
            matches!(&err, OpenError::Insecure { path, .. } if path.ends_with("shared")),
            "{err}"
        );
        // An emptyDir-like state directory (0777, ours) is tightened, not refused.
        std::fs::create_dir_all(base.join("own/state")).unwrap();
        std::fs::set_permissions(
            base.join("own/state"),
            std::fs::Permissions::from_mode(0o777),
        )
        .unwrap();
        open(&base.join("own/state/process")).unwrap();
        let mode = std::fs::metadata(base.join("own/state"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o755);
        let _ = std::fs::remove_dir_all(base);
    }

    /// Reads have no side effects: a stopped sandbox whose shim is gone is still
    /// there after `get` and `list`, and the process it records is not signalled.
    #[test]
    fn reads_never_kill_or_remove() {
        use std::os::unix::process::CommandExt;
        let dir = std::env::temp_dir().join(format!("vkd-reads-{}", uuid::Uuid::new_v4().simple()));
        let config = ProcessConfig {
            cgroup_parent: "none".into(),
            ..Default::default()
        };
        let exe = std::env::current_exe().unwrap();
        let p = ProcessProvider::open_unwatched(config, &dir, exe).unwrap();
        let sb = p.sandbox("u-read");
        std::fs::create_dir_all(&sb.dir).unwrap();
        let rec = InstanceRecord {
            id: "proc-1".into(),
            owner: vkd_provider::PodRef {
                namespace: "ns".into(),
                name: "pod".into(),
                uid: "u-read".into(),
            },
            node: "node-p".into(),
            epoch: 1,
            host: "h".into(),
            created_at: SystemTime::now(),
            cpu_millis: 0,
            memory_bytes: 0,
            ip: None,
            gpus: Vec::new(),
        };
        sandbox::write_json(&sb.instance(), &rec, 0o644).unwrap();
        let mut own = std::process::Command::new("sleep")
            .arg("30")
            .process_group(0)
            .spawn()
            .unwrap();
        let id = procfs::ProcessId::of(own.id() as i32).unwrap();
        let mut run = shim::run_of(
            "main",
            ContainerState::Running {
                started_at: SystemTime::now(),
            },
        );
        run.process = Some(id);
        let status = StatusFile {
            phase: InstancePhase::Running,
            init: Vec::new(),
            containers: vec![run],
            started_at: None,
            message: None,
            done: false,
            ephemeral: None,
            pause: None,
            events: Vec::new(),
        };
        sandbox::write_json(&sb.status(), &status, 0o644).unwrap();
        // A shim identity that is no longer alive, and a stop that was asked for.
        let dead = procfs::ProcessId {
            pid: id.pid,
            start_ticks: id.start_ticks + 1,
        };
        sandbox::write_atomic(&sb.shim_pid(), dead.render().as_bytes(), 0o644).unwrap();
        sandbox::write_atomic(&sb.stop(), b"0", 0o644).unwrap();
        let inst = p.get_blocking("u-read").unwrap().unwrap();
        assert_eq!(inst.phase, InstancePhase::Failed);
        assert_eq!(p.list_blocking("node-p").unwrap().len(), 1);
        std::thread::sleep(Duration::from_millis(200));
        assert!(
            own.try_wait().unwrap().is_none(),
            "a read killed a recorded process"
        );
        assert!(sb.dir.exists(), "a read removed the sandbox");
        p.delete_blocking(
            &Fence {
                node: "node-p".into(),
                epoch: 1,
            },
            "u-read",
            Duration::ZERO,
        )
        .unwrap();
        assert!(own.wait().unwrap().code().is_none(), "the delete kills it");
        assert!(!sb.dir.exists());
        let _ = std::fs::remove_dir_all(dir);
    }
}
