//! A vkd provider whose backend is a Slurm cluster, served over the provider
//! protocol by the `vkd-slurm` binary (docs/slurm-provider.md).
//!
//! Each Pod is one Slurm batch job, named `vkd-<pod uid>`, its comment
//! `vkd:node=<node>;epoch=<epoch>;pod=<ns>/<name>`. The batch script is this
//! binary's runner ([`job`]), which starts each container as a job step.
//! Capacity is what `scontrol show nodes` says of each node (its CPUs,
//! memory and GPU GRES, one host slice a node, never summed); Slurm places
//! and queues the jobs itself (capability `backend-queue`), so a Pod that
//! must wait is a pending job whose reason is Slurm's. A stale epoch is
//! refused here and, where the site installs the `job_submit.lua` this binary
//! prints, by `slurmctld` too. Delete is `scancel --signal=TERM` (the steps), then
//! `scancel` once the Pod's grace period is over.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use futures::StreamExt;
use futures::stream::BoxStream;
use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;
use vkd_provider::fence::FenceBook;
use vkd_provider::{
    Admission, Capabilities, Capacity, CapacityKind, Duplex, Fence, Health, Instance,
    InstanceEvent, InstanceSpec, LogRequest, Logs, Placement, Provider, ProviderError, Result,
    StreamIo, Support,
};

mod capacity;
pub mod instance;
pub mod job;
pub mod pod_dir;
pub mod slurm;
mod streams;
mod watch;

use instance::{comment, instance, job_name, job_of_instance, orphan};
use pod_dir::{PodDir, checked_container, checked_uid, pods_root};
use slurm::{JobRow, Refusal, Slurm, SlurmError, Submit};
use watch::Jobs;

/// Slurm's `--cpus-per-task` is a 16-bit field.
const MAX_CPUS_PER_TASK: u64 = 65_535;

/// The provider's settings.
#[derive(Clone, Debug)]
pub struct Config {
    /// On a filesystem every compute node shares (see [`pod_dir`]).
    pub state_dir: PathBuf,
    pub slurm: Slurm,
    /// This binary, as the compute nodes reach it.
    pub runner: PathBuf,
    /// How often Slurm is asked what changed.
    pub poll: Duration,
    /// Memory a Pod that asks none is given (`--mem`), in MiB.
    pub default_memory_mib: u64,
}

#[derive(Debug)]
struct Inner {
    config: Config,
    book: FenceBook,
    jobs: Mutex<Jobs>,
    /// One `squeue` at a time: callers that wait share its answer.
    refreshing: tokio::sync::Mutex<()>,
    /// One submission at a time: a retried create finds the job the first made.
    submitting: tokio::sync::Mutex<()>,
    /// Node name → its address (a Pod's IP is its node's).
    addresses: Mutex<HashMap<String, String>>,
    /// `sbatch --export`: what the job's runner starts with (this PATH, the slurm.conf).
    export: String,
    events: broadcast::Sender<InstanceEvent>,
}

/// The Slurm provider.
#[derive(Clone, Debug)]
pub struct SlurmProvider {
    inner: Arc<Inner>,
}

fn slurm_error(e: SlurmError) -> ProviderError {
    ProviderError::transient(e.to_string())
}

/// `sbatch --export`'s list (commas separate its entries: a value with
/// one is left out); `NONE` when empty.
fn job_export(path: Option<String>, conf: Option<&Path>) -> String {
    let entries: Vec<String> = [
        path.map(|p| format!("PATH={p}")),
        conf.and_then(Path::to_str)
            .map(|c| format!("SLURM_CONF={c}")),
    ]
    .into_iter()
    .flatten()
    .filter(|e| !e.contains(','))
    .collect();
    if entries.is_empty() {
        "NONE".into()
    } else {
        entries.join(",")
    }
}

/// Removes the directory of a Pod whose job is over; when that fails (a
/// file the job left that cannot be removed), the next pass tries again.
fn forget(pod: &PodDir) {
    if let Err(e) = pod.remove() {
        tracing::warn!(path = %pod.path.display(), error = %e, "a deleted Pod's directory stays");
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl SlurmProvider {
    /// Starts watching Slurm (in the current runtime) until `shutdown`.
    pub fn new(config: Config, shutdown: CancellationToken) -> std::io::Result<Self> {
        // The Pods' specs hold their env (Secrets' values among them): only
        // the account the jobs run as may read them. The epochs stay
        // readable: slurmctld's job submit plugin reads them.
        let pods = pods_root(&config.state_dir);
        std::fs::create_dir_all(&pods)?;
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&pods, std::fs::Permissions::from_mode(0o700))?;
        }
        let book = FenceBook::new(&config.state_dir.join("epochs"))?;
        let (events, _) = broadcast::channel(4096);
        let export = job_export(std::env::var("PATH").ok(), config.slurm.conf.as_deref());
        let provider = Self {
            inner: Arc::new(Inner {
                config,
                book,
                jobs: Mutex::default(),
                refreshing: tokio::sync::Mutex::new(()),
                submitting: tokio::sync::Mutex::new(()),
                addresses: Mutex::default(),
                export,
                events,
            }),
        };
        tokio::spawn(provider.clone().watch(shutdown));
        Ok(provider)
    }

    fn state(&self) -> &Path {
        &self.inner.config.state_dir
    }

    fn pod(&self, uid: &str) -> Result<PodDir> {
        PodDir::new(self.state(), uid)
    }

    /// The instance of a Pod, or `None`; a deleted Pod whose job is over is
    /// forgotten here (its directory removed).
    fn instance_of(
        &self,
        uid: &str,
        rows: &HashMap<String, JobRow>,
        spec: Option<InstanceSpec>,
    ) -> Result<Option<Instance>> {
        let pod = self.pod(uid)?;
        let row = rows.get(uid);
        if !pod.exists() {
            return Ok(row.filter(|r| r.active()).and_then(|r| orphan(r, uid)));
        }
        let over = row.is_none_or(|r| !r.active());
        // Slurm's own job of this name first: the directory's files are
        // written where the job runs too, so its job-id alone is not proof.
        let Some(job) = row.map(|r| r.id).or_else(|| pod.job_id()) else {
            if pod.deleted().is_some() {
                forget(&pod);
            }
            return Ok(None);
        };
        if over && pod.deleted().is_some() {
            forget(&pod);
            return Ok(None);
        }
        let spec = match spec {
            Some(s) => s,
            None => pod.read_spec()?,
        };
        let address = row.and_then(|r| lock(&self.inner.addresses).get(&r.nodes).cloned());
        Ok(Some(instance(&spec, &pod, job, row, address.as_deref())))
    }

    /// What a submission asks of Slurm for `spec`.
    fn submission(&self, spec: &InstanceSpec, pod: &PodDir, fence: Option<&Fence>) -> Submit {
        let r = &spec.resources;
        let mib = r.memory_bytes.div_ceil(1024 * 1024);
        Submit {
            name: job_name(&spec.pod.uid),
            comment: fence.map(|f| comment(f, &spec.pod)).unwrap_or_default(),
            script: pod.script(),
            output: pod.output(),
            workdir: pod.work(),
            cpus: u32::try_from(r.cpu_millis.div_ceil(1000)).unwrap_or(u32::MAX),
            memory_mib: if mib == 0 {
                self.inner.config.default_memory_mib
            } else {
                mib
            },
            gpus: r.gpus,
            nodelist: spec
                .placement
                .as_ref()
                .map(|p| p.host.clone())
                .filter(|h| !h.is_empty()),
            export: self.inner.export.clone(),
        }
    }

    /// What the provider cannot run whatever Slurm has: a container without a command.
    fn check_spec(spec: &InstanceSpec) -> Result<()> {
        checked_uid(&spec.pod.uid)?;
        if spec.user_namespace {
            return Err(ProviderError::invalid(
                "UserNamespacesUnsupported",
                "the Pod asks for a user namespace (hostUsers: false): a Slurm job runs \
                 as the provider's account on the node, with no user namespace of its own",
            ));
        }
        let cpus = spec.resources.cpu_millis.div_ceil(1000);
        if cpus > MAX_CPUS_PER_TASK {
            return Err(ProviderError::invalid(
                "Unrunnable",
                format!(
                    "the Pod asks for {cpus} CPUs; a Slurm task has at most {MAX_CPUS_PER_TASK}"
                ),
            ));
        }
        for c in spec.init_containers.iter().chain(&spec.containers) {
            checked_container(&c.name)?;
            if c.command.is_empty() {
                return Err(ProviderError::invalid(
                    "CommandRequired",
                    format!(
                        "container {} has no command: a Slurm job runs commands on the node, \
                         it has no image to take an entrypoint from (args alone are the \
                         entrypoint's arguments)",
                        c.name
                    ),
                ));
            }
        }
        Ok(())
    }

    async fn running_job(&self, uid: &str, container: &str) -> Result<(PodDir, u64)> {
        let pod = self.pod(uid)?;
        checked_container(container)?;
        let rows = self.jobs(Duration::from_secs(1)).await?;
        match (pod.exists(), rows.get(uid)) {
            (true, Some(row)) if row.state == "RUNNING" => Ok((pod, row.id)),
            (true, Some(row)) => Err(ProviderError::invalid(
                "ContainerNotRunning",
                format!("Slurm job {} is {}", row.id, row.state),
            )),
            _ => Err(ProviderError::NotFound {
                uid: uid.to_owned(),
            }),
        }
    }

    /// `scancel` after the grace period, unless the job ended by then.
    fn kill_after(&self, job: u64, uid: String, wait: Duration) {
        let this = self.clone();
        tokio::spawn(async move {
            tokio::time::sleep(wait).await;
            if let Ok(rows) = this.jobs(Duration::ZERO).await
                && rows.get(&uid).is_some_and(|r| r.id == job && r.active())
            {
                let _ = this.inner.config.slurm.cancel(job, None).await;
                this.changed(&uid);
            }
        });
    }

    /// The Lua job submit plugin that makes `slurmctld` refuse a stale epoch,
    /// reading the epochs this provider records.
    pub fn job_submit_lua(state_dir: &Path) -> String {
        let dir = state_dir.join("epochs").display().to_string();
        let quoted = dir.replace('\\', "\\\\").replace('"', "\\\"");
        include_str!("job_submit.lua").replace("@EPOCHS@", &format!("{quoted}/"))
    }
}

#[async_trait]
impl Provider for SlurmProvider {
    fn name(&self) -> &str {
        "slurm"
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            logs: Support::Supported,
            exec: Support::Supported,
            port_forward: Support::Supported,
            backend_queue: Support::Supported,
            ..Capabilities::default()
        }
    }

    async fn health(&self) -> Health {
        match self.inner.config.slurm.ping().await {
            Ok(_) => Health::Healthy,
            Err(e) => Health::Unhealthy {
                reason: "SlurmControllerUnreachable".into(),
                message: e.to_string(),
            },
        }
    }

    async fn capacity(&self) -> Result<Capacity> {
        let nodes = self.inner.config.slurm.nodes().await.map_err(slurm_error)?;
        *lock(&self.inner.addresses) = nodes
            .iter()
            .map(|n| (n.name.clone(), n.addr.clone()))
            .collect();
        let hosts = capacity::host_slices(&nodes);
        Ok(Capacity {
            hosts,
            kind: CapacityKind::Live,
            observed_at: SystemTime::now(),
            refresh_interval: Duration::from_secs(10),
        })
    }

    async fn admit(&self, spec: &InstanceSpec) -> Result<Admission> {
        Self::check_spec(spec)?;
        let pod = self.pod(&spec.pod.uid)?;
        let job = self.submission(spec, &pod, None);
        match self
            .inner
            .config
            .slurm
            .test(&job)
            .await
            .map_err(slurm_error)?
        {
            Ok(()) => Ok(Admission::Fits(Placement {
                host: job.nodelist.unwrap_or_default(),
                gpu_ids: Vec::new(),
            })),
            Err(Refusal::Unrunnable(words)) => {
                let nodes = self
                    .inner
                    .config
                    .slurm
                    .nodes()
                    .await
                    .map(|ns| {
                        ns.iter()
                            .map(|n| format!("{} {} cpu, {} gpu", n.name, n.cpus, n.gpu_count()))
                            .collect::<Vec<_>>()
                            .join("; ")
                    })
                    .unwrap_or_default();
                Ok(Admission::Rejected {
                    reason: "SlurmRejected".into(),
                    message: format!(
                        "Slurm: {words} (asked {} cpu, {} MiB, {} gpu on one node; nodes: {nodes})",
                        job.cpus.max(1),
                        job.memory_mib,
                        job.gpus
                    ),
                })
            }
            Err(Refusal::Fenced { .. } | Refusal::Transient(_)) => Err(ProviderError::transient(
                "sbatch --test-only did not answer whether the job could run",
            )),
        }
    }

    async fn create(&self, fence: &Fence, spec: &InstanceSpec) -> Result<Instance> {
        Self::check_spec(spec)?;
        let uid = spec.pod.uid.as_str();
        let _fence = self.inner.book.check_async(fence).await?;
        let _turn = self.inner.submitting.lock().await;
        let pod = self.pod(uid)?;
        if pod.exists() {
            // Made before: the job the first create submitted, found by its
            // id or, when that create died after sbatch, by its name.
            let rows = self.jobs(Duration::ZERO).await?;
            if pod.job_id().is_none()
                && let Some(row) = rows.get(uid)
            {
                pod.set_job_id(row.id)?;
            }
            if let Some(found) = self.instance_of(uid, &rows, None)? {
                return Ok(found);
            }
        } else {
            pod.prepare(spec, &self.inner.config.runner)?;
        }
        let job = self.submission(spec, &pod, Some(fence));
        let submitted = self.inner.config.slurm.submit(&job).await;
        let id = match submitted {
            Ok(Ok(id)) => id,
            Ok(Err(refusal)) => {
                pod.remove()?;
                return Err(match refusal {
                    Refusal::Fenced { node, current } => ProviderError::Fenced {
                        node,
                        current,
                        got: fence.epoch,
                    },
                    Refusal::Unrunnable(words) => {
                        ProviderError::invalid("SlurmRejected", format!("Slurm: {words}"))
                    }
                    Refusal::Transient(words) => {
                        ProviderError::transient(format!("sbatch: {words}"))
                    }
                });
            }
            // No answer: the job may exist; the next create looks for it by name.
            Err(e) => return Err(slurm_error(e)),
        };
        pod.set_job_id(id)?;
        let row = JobRow {
            id,
            name: job.name,
            state: "PENDING".into(),
            reason: "None".into(),
            nodes: String::new(),
            comment: job.comment,
            submitted: Some(SystemTime::now()),
            started: None,
        };
        self.remember(uid, row.clone());
        self.changed(uid);
        Ok(instance(spec, &pod, id, Some(&row), None))
    }

    async fn get(&self, uid: &str) -> Result<Option<Instance>> {
        let rows = self.jobs(Duration::from_secs(1)).await?;
        self.instance_of(uid, &rows, None)
    }

    async fn delete(&self, fence: &Fence, uid: &str, grace: Duration) -> Result<()> {
        let _fence = self.inner.book.check_async(fence).await?;
        let pod = self.pod(uid)?;
        let rows = self.jobs(Duration::ZERO).await?;
        let row = rows.get(uid).filter(|r| r.active());
        if pod.exists() && pod.deleted().is_none() {
            pod.set_deleted(SystemTime::now() + grace)?;
            if let Some(row) = row.filter(|r| !r.pending() && !grace.is_zero()) {
                let slurm = &self.inner.config.slurm;
                slurm
                    .cancel(row.id, Some("TERM"))
                    .await
                    .map_err(slurm_error)?;
                self.kill_after(row.id, uid.to_owned(), grace);
                self.changed(uid);
                return Ok(());
            }
        }
        let past = pod.deleted().is_none_or(|d| SystemTime::now() >= d);
        if let Some(row) = row.filter(|r| r.pending() || past || !pod.exists()) {
            self.inner
                .config
                .slurm
                .cancel(row.id, None)
                .await
                .map_err(slurm_error)?;
        }
        self.changed(uid);
        Ok(())
    }

    async fn takeover(&self, fence: &Fence) -> Result<()> {
        drop(self.inner.book.check_async(fence).await?);
        self.jobs(Duration::ZERO).await.map(drop)
    }

    async fn delete_instance(&self, fence: &Fence, id: &str, _grace: Duration) -> Result<()> {
        let _fence = self.inner.book.check_async(fence).await?;
        let job = job_of_instance(id).ok_or_else(|| {
            ProviderError::invalid("InvalidInstance", format!("{id:?} is not a Slurm job"))
        })?;
        // Only a live job of this provider's, for a Pod of this node: an id
        // Slurm no longer shows is gone already, and any other job is not
        // an instance to delete.
        let rows = self.jobs(Duration::ZERO).await?;
        let Some(row) = rows.values().find(|r| r.id == job && r.active()) else {
            return Ok(());
        };
        if instance::read_comment(&row.comment).is_some_and(|(node, ..)| node != fence.node) {
            return Err(ProviderError::invalid(
                "InvalidInstance",
                format!("Slurm job {job} belongs to another node"),
            ));
        }
        self.inner
            .config
            .slurm
            .cancel(job, None)
            .await
            .map_err(slurm_error)
    }

    async fn list(&self, node: &str) -> Result<Vec<Instance>> {
        let rows = self.jobs(Duration::from_secs(1)).await?;
        let mut out = Vec::new();
        let mut seen = std::collections::HashSet::new();
        let dirs = std::fs::read_dir(pods_root(self.state()))
            .map_err(|e| ProviderError::transient(format!("{}: {e}", self.state().display())))?;
        for entry in dirs.flatten() {
            let uid = entry.file_name().to_string_lossy().into_owned();
            let Ok(pod) = self.pod(&uid) else { continue };
            // A spec that names another Pod than its directory is not one
            // this provider wrote.
            let Some(spec) = pod
                .read_spec()
                .ok()
                .filter(|s| s.node == node && s.pod.uid == uid)
            else {
                continue;
            };
            seen.insert(uid.clone());
            match self.instance_of(&uid, &rows, Some(spec)) {
                Ok(Some(i)) => out.push(i),
                Ok(None) => {}
                // Left out of this list (never taken as gone: a list only
                // finds orphans); the next pass tries it again.
                Err(e) => {
                    tracing::warn!(pod_uid = %uid, error = %e, "a Pod's instance could not be read")
                }
            }
        }
        for (uid, row) in rows.iter() {
            if !seen.contains(uid)
                && row.active()
                && let Some(i) = orphan(row, uid).filter(|i| i.node == node)
            {
                out.push(i);
            }
        }
        Ok(out)
    }

    fn events(&self) -> BoxStream<'static, InstanceEvent> {
        tokio_stream::wrappers::BroadcastStream::new(self.inner.events.subscribe())
            .map(|e| e.unwrap_or(InstanceEvent::Resync))
            .boxed()
    }

    async fn logs(&self, uid: &str, container: &str, request: LogRequest) -> Result<Logs> {
        let pod = self.pod(uid)?;
        checked_container(container)?;
        if !pod.exists() {
            return Err(ProviderError::NotFound {
                uid: uid.to_owned(),
            });
        }
        streams::logs(&pod, container, request)
    }

    async fn exec(
        &self,
        uid: &str,
        container: &str,
        command: Vec<String>,
        io: StreamIo,
    ) -> Result<i32> {
        let (pod, job) = self.running_job(uid, container).await?;
        if command.is_empty() {
            return Err(ProviderError::invalid("NoCommand", "exec needs a command"));
        }
        let mut srun = streams::step(job, io.tty, &self.inner.config.runner, &self.inner.export);
        srun.arg("enter")
            .arg(&pod.path)
            .arg(container)
            .args(&command);
        if let Some(conf) = &self.inner.config.slurm.conf {
            srun.env("SLURM_CONF", conf);
        }
        if io.tty {
            streams::run_step_on_a_tty(srun, io).await
        } else {
            streams::run_step(srun, io.stdin, io.stdout, io.stderr).await
        }
    }

    async fn port_forward(&self, uid: &str, port: u16, stream: Box<dyn Duplex>) -> Result<()> {
        let pod = self.pod(uid)?;
        let spec = pod.read_spec().map_err(|_| ProviderError::NotFound {
            uid: uid.to_owned(),
        })?;
        let first = spec.containers.first().map_or("main", |c| c.name.as_str());
        let (_, job) = self.running_job(uid, first).await?;
        let mut srun = streams::step(job, false, &self.inner.config.runner, &self.inner.export);
        srun.arg("connect").arg(port.to_string());
        if let Some(conf) = &self.inner.config.slurm.conf {
            srun.env("SLURM_CONF", conf);
        }
        streams::forward(srun, stream).await
    }

    async fn describe(&self, uid: &str) -> Result<Vec<(String, String)>> {
        let pod = self.pod(uid)?;
        let rows = self.jobs(Duration::from_secs(1)).await?;
        let mut out = Vec::new();
        if let Some(row) = rows.get(uid) {
            out.push(("slurm job".into(), row.id.to_string()));
            out.push(("slurm state".into(), row.state.clone()));
            if row.pending() {
                out.push(("slurm pending reason".into(), row.reason.clone()));
            }
            if !row.nodes.is_empty() {
                out.push(("slurm nodes".into(), row.nodes.clone()));
            }
        }
        if pod.exists() {
            out.push(("job output".into(), pod.output().display().to_string()));
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_jobs_export_leaves_out_what_a_comma_would_split() {
        assert_eq!(
            job_export(
                Some("/usr/bin:/bin".into()),
                Some(Path::new("/etc/slurm/slurm.conf"))
            ),
            "PATH=/usr/bin:/bin,SLURM_CONF=/etc/slurm/slurm.conf"
        );
        assert_eq!(
            job_export(Some("/a,b:/bin".into()), Some(Path::new("/x.conf"))),
            "SLURM_CONF=/x.conf"
        );
        assert_eq!(job_export(None, None), "NONE");
    }
}
