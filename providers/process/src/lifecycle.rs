//! A Pod's life in the provider: create (its sandbox, network and shim), read,
//! delete (stop the shim, kill what is left, release the network), and what a
//! restart of vkd finds and recovers.
//!
//! The node's fence lock is held only for the quick steps that decide and
//! record; CNI ADD and DEL run outside it, each Pod's under a [`Claim`] on its
//! sandbox, so a plugin that hangs stalls its own Pod, never the node's other
//! creates and deletions. A create records the network (`network.json`) and
//! claims the sandbox under the lock, runs ADD without it, and makes the
//! instance under the lock again, unless the Pod was deleted meanwhile (its
//! stop file), in which case it gives the network back itself.

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use rustix::process::Signal;
use vkd_provider::{
    Fence, Instance, InstanceEvent, InstancePhase, InstanceSpec, ProviderError, Result,
};

use crate::claim::{self, Claim};
use crate::sandbox::{InstanceRecord, Sandbox, ShimSpec};
use crate::{ProcessProvider, cgroup, hostport, io_err, isolation, network, procfs, sandbox};

/// What the first fenced step of a create found.
enum Begun {
    /// The Pod's instance, made by an earlier create.
    Exists(Box<Instance>),
    Claimed(Box<Claimed>),
}

/// A create between its two fenced steps: the sandbox it claimed, a
/// leftover of an earlier attempt moved aside (to discard before ADD), and
/// the network recorded for it.
struct Claimed {
    sb: Sandbox,
    _claim: Claim,
    grave: Option<(PathBuf, Claim)>,
    network: Option<network::Attachment>,
}

impl ProcessProvider {
    /// Leftovers of a create that died half way: sandboxes still being built are
    /// removed; a sandbox whose shim was never started gets it now.
    pub(super) fn recover(&self) {
        let Ok(entries) = std::fs::read_dir(self.pods_dir()) else {
            return;
        };
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let sb = Sandbox::new(e.path());
            // A removal or a create that died half way (unless another vkd on
            // this state is at it: `discard` leaves what is claimed).
            if name.starts_with('.') || !sb.instance().exists() {
                if let Err(e) = self.discard(&sb.dir) {
                    eprintln!("process provider: {name}: {e}");
                }
                continue;
            }
            if sb.shim_process().is_none()
                && !sb.status().exists()
                && let Err(e) = self.spawn_shim(&sb)
            {
                eprintln!("process provider: starting the shim of {name}: {e}");
            }
        }
    }

    /// Claims `name` (a Pod UID or a sandbox's directory name); `None` when a
    /// create or removal holds it.
    fn claim(&self, name: &str) -> Result<Option<Claim>> {
        let dir = self.inner.dir.join(claim::DIR);
        Claim::try_take(&dir, name).map_err(io_err(&dir))
    }

    /// Removes a sandbox nothing runs in (a create that failed or died half
    /// way), giving back its network first; leaves one that a create or
    /// removal in progress holds to that.
    pub(super) fn discard(&self, dir: &Path) -> Result<()> {
        let name = dir.file_name().unwrap_or_default().to_string_lossy();
        match self.claim(&name)? {
            Some(_claim) => self.discard_claimed(dir),
            None => Ok(()),
        }
    }

    /// [`Self::discard`] of a sandbox the caller has claimed.
    fn discard_claimed(&self, dir: &Path) -> Result<()> {
        network::release(dir).map_err(|e| {
            ProviderError::transient(format!("releasing the network of {}: {e}", dir.display()))
        })?;
        isolation::unmount_under(dir).map_err(|e| {
            ProviderError::transient(format!("unmounting under {}: {e}", dir.display()))
        })?;
        let held = crate::sandbox::Sandbox::new(dir.to_owned()).held_root();
        isolation::release_held(&held)
            .map_err(|e| ProviderError::transient(format!("releasing {}: {e}", held.display())))?;
        match std::fs::remove_dir_all(dir) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(io_err(dir)(e)),
        }
    }

    /// Refuses a Pod's `hostPort`s that the node may not give out
    /// ([`hostport`]): one the node policy does not name (on every node),
    /// and, with a Pod network, where a `hostPort` is a DNAT that would take
    /// that traffic, one a vkd on the host reserved, one a host service
    /// listens on, or one a Pod of any node on the host holds. Returns the
    /// host-wide lock (with a Pod network),
    /// which the caller holds until it has recorded the Pod's ports (or
    /// given up), so that no other node gives one of them out meanwhile.
    pub(super) fn check_host_ports(
        &self,
        spec: &InstanceSpec,
    ) -> Result<Option<hostport::HostLock>> {
        if spec.host_network || spec.host_ports.is_empty() {
            return Ok(None);
        }
        let refuse = |e: hostport::HostPortError| match e.reason() {
            Some(reason) => ProviderError::invalid(reason, e.to_string()),
            None => ProviderError::transient(e.to_string()),
        };
        let config = &self.inner.config.host_ports;
        // The node policy first, with or without a Pod network, as Pod
        // Security's baseline holds it: it needs nothing from the host.
        hostport::check_allowed(&spec.host_ports, &config.allowed, &spec.node).map_err(refuse)?;
        // Without one a hostPort maps nothing: the Pod binds the host's
        // ports itself, as any host process.
        if self.inner.network.is_none() {
            return Ok(None);
        }
        let reservations = hostport::Reservations::new(&config.reservations);
        let lock = reservations.lock().map_err(refuse)?;
        let reserved = reservations.reserved().map_err(refuse)?;
        hostport::check_reserved(&spec.host_ports, &reserved).map_err(refuse)?;
        let listeners = hostport::host_listeners().map_err(refuse)?;
        let mut dirs = vec![self.pods_dir()];
        dirs.extend(reservations.pods_dirs().map_err(refuse)?);
        let pods = hostport::held_by_pods(&dirs, &self.sandbox(&spec.pod.uid).dir);
        hostport::check(&spec.host_ports, &listeners, &pods).map_err(refuse)?;
        Ok(Some(lock))
    }

    /// With `network`, and unless the Pod uses the host's: records what the
    /// Pod's network will be, before any of it exists, so that DEL can follow
    /// whatever happens next.
    fn record_network(
        &self,
        sb: &Sandbox,
        spec: &InstanceSpec,
    ) -> Result<Option<network::Attachment>> {
        let Some(net) = self.inner.network.as_ref().filter(|_| !spec.host_network) else {
            return Ok(None);
        };
        let a = net.attachment(&spec.pod, &spec.host_ports);
        network::record(&sb.dir, &a).map_err(io_err(&network::record_path(&sb.dir)))?;
        Ok(Some(a))
    }

    /// Makes the Pod's network namespace and runs CNI ADD; returns the Pod's
    /// IP. A failure is the Pod's (`FailedCreatePodSandBox`, naming the plugin
    /// and what it said), as the kubelet reports a sandbox it could not create.
    /// Its `hostPort`s are checked again first, when they are given out (a
    /// vkd may have reserved one since the create began); the lock is not
    /// held while the plugins run, which may take their whole bound: the
    /// Pod's record already keeps its ports from every other node.
    fn add_network(
        &self,
        sb: &Sandbox,
        spec: &InstanceSpec,
        mut a: network::Attachment,
    ) -> Result<String> {
        drop(self.check_host_ports(spec)?);
        let ip = a.add().map_err(|e| {
            ProviderError::invalid(
                network::NETWORK_SETUP_FAILED,
                format!("setting up the Pod's network: {e}"),
            )
        })?;
        a.ip = Some(ip.clone());
        network::record(&sb.dir, &a).map_err(io_err(&network::record_path(&sb.dir)))?;
        Ok(ip)
    }

    pub(super) fn spawn_shim(&self, sb: &Sandbox) -> std::io::Result<()> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(sb.dir.join("shim.log"))?;
        let err = log.try_clone()?;
        let mut cmd = std::process::Command::new(&self.inner.shim_exe);
        {
            use std::os::unix::process::CommandExt;
            cmd.arg("process-shim")
                .arg(&sb.dir)
                .stdin(std::process::Stdio::null())
                .stdout(log)
                .stderr(err)
                .process_group(0);
        }
        let pid = spawn_reaped(cmd)?;
        if let Some(id) = i32::try_from(pid).ok().and_then(procfs::ProcessId::of) {
            // Written here as well as by the shim, so nothing sees a sandbox without one.
            if sb.shim_process().is_none() {
                sandbox::write_atomic(&sb.shim_pid(), id.render().as_bytes(), 0o644)?;
            }
        }
        Ok(())
    }

    /// Kills what a dead shim left behind (checked by identity) and removes the
    /// sandbox. Called without the fence lock (DEL may take its plugins' whole
    /// bound), under the sandbox's claim: one a create holds is left to it (it
    /// finds the stop request and gives the network back itself), one another
    /// removal holds to that removal.
    pub(super) fn remove(&self, sb: &Sandbox) -> Result<()> {
        let name = sb.dir.file_name().unwrap_or_default().to_string_lossy();
        let Some(_claim) = self.claim(&name)? else {
            return Ok(());
        };
        if !sb.dir.exists() {
            return Ok(());
        }
        self.kill_leftovers(sb);
        // Whatever the Pod started, however it detached, ends with it: in the
        // cgroup the shim made (recorded in spec.json), else where the config says.
        let pod_uid = sb.dir.file_name().unwrap_or_default().to_string_lossy();
        let parent = match sb.read_spec() {
            Ok(Some(spec)) => spec.cgroup.map(|c| c.dir),
            _ => self.inner.cgroup.as_ref().map(|c| c.dir.clone()),
        };
        if let Some(parent) = parent
            && !cgroup::remove(&cgroup::pod_dir(&parent, &pod_uid), Duration::from_secs(5))
        {
            return Err(ProviderError::transient(format!(
                "the cgroup of Pod {pod_uid} still holds processes after SIGKILL"
            )));
        }
        // The IP goes back to the pool before the record of it goes.
        network::release(&sb.dir).map_err(|e| {
            ProviderError::transient(format!("releasing the network of Pod {pod_uid}: {e}"))
        })?;
        // tmpfs volumes, which a removal would otherwise empty and then fail on.
        isolation::unmount_under(&sb.dir).map_err(|e| {
            ProviderError::transient(format!("unmounting the volumes of Pod {pod_uid}: {e}"))
        })?;
        // The containers' namespaces, which nothing runs in any more.
        isolation::release_held(&sb.held_root()).map_err(|e| {
            ProviderError::transient(format!("releasing the namespaces of Pod {pod_uid}: {e}"))
        })?;
        // Rename first, so a half-removed sandbox is never taken for a live one.
        let uid = sb
            .dir
            .file_name()
            .unwrap_or_default()
            .to_string_lossy()
            .into_owned();
        let grave = self
            .pods_dir()
            .join(format!(".gone-{uid}-{}", uuid::Uuid::new_v4().simple()));
        match std::fs::rename(&sb.dir, &grave) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(io_err(&sb.dir)(e)),
        }
        std::fs::remove_dir_all(&grave).map_err(io_err(&grave))?;
        let _ = self.inner.events.send(InstanceEvent::Changed { uid });
        Ok(())
    }

    /// Kills what a dead shim left: the recorded process groups (checked by
    /// identity) and the Pod's cgroup.
    pub(super) fn kill_leftovers(&self, sb: &Sandbox) {
        if let Ok(Some(st)) = sb.read_status() {
            for c in st
                .init
                .iter()
                .chain(&st.containers)
                .chain(st.ephemeral.iter().flatten())
            {
                if let Some(p) = c.process {
                    p.signal_group(Signal::KILL);
                }
            }
            if let Some(p) = st.pause {
                p.signal_group(Signal::KILL);
            }
        }
        let pod_uid = sb.dir.file_name().unwrap_or_default().to_string_lossy();
        if let Ok(Some(spec)) = sb.read_spec()
            && let Some(cg) = spec.cgroup
        {
            cgroup::kill(&cgroup::pod_dir(&cg.dir, &pod_uid));
        }
    }

    pub(super) fn create_blocking(&self, fence: &Fence, spec: &InstanceSpec) -> Result<Instance> {
        let c = match self.begin_create(fence, spec)? {
            Begun::Exists(instance) => return Ok(*instance),
            Begun::Claimed(claimed) => claimed,
        };
        // Outside the fence lock: a leftover's DEL, then ADD.
        let networked = (|| -> Result<Option<String>> {
            if let Some((grave, _)) = &c.grave {
                self.discard_claimed(grave)?;
                // Held under the Pod's UID, not under the grave's name.
                isolation::release_held(&c.sb.held_root()).map_err(|e| {
                    ProviderError::transient(format!(
                        "releasing the namespaces of {}: {e}",
                        spec.pod
                    ))
                })?;
            }
            c.network
                .clone()
                .map(|a| self.add_network(&c.sb, spec, a))
                .transpose()
        })();
        let made = networked.and_then(|ip| self.finish_create(fence, &c.sb, spec, ip));
        if made.is_err() {
            // Nothing runs yet: gone (its network given back), so a retried
            // create starts afresh.
            let _ = self.discard_claimed(&c.sb.dir);
        }
        made
    }

    /// The first fenced step of a create: the instance when there is one
    /// already, else the claimed sandbox, checked and with its network
    /// recorded.
    fn begin_create(&self, fence: &Fence, spec: &InstanceSpec) -> Result<Begun> {
        let _fenced = self.check_fence(fence)?;
        let uid = &spec.pod.uid;
        if let Some((sb, rec, st)) = self.read(uid)? {
            return Ok(Begun::Exists(Box::new(self.instance_of(&sb, rec, st))));
        }
        if uid.is_empty() || uid.contains('/') || uid.starts_with('.') {
            return Err(ProviderError::invalid(
                "InvalidSpec",
                format!("Pod UID {uid:?}"),
            ));
        }
        let sb = self.sandbox(uid);
        // Checked before anything is made: a spec that cannot run leaves nothing.
        self.launches(spec, &sb.root(), self.inner.isolated)?;
        // Held until the Pod's ports are recorded below, which is what
        // every node's check then sees.
        let _given = self.check_host_ports(spec)?;
        let Some(claim) = self.claim(uid)? else {
            return Err(ProviderError::transient(format!(
                "Pod {} is being created or removed already",
                spec.pod
            )));
        };
        // A directory without instance.json is a create that died half way:
        // moved aside, to be discarded before ADD, and the Pod starts over.
        let grave = if sb.dir.exists() {
            let name = format!(".gone-{uid}-{}", uuid::Uuid::new_v4().simple());
            let grave = self.pods_dir().join(&name);
            let Some(held) = self.claim(&name)? else {
                return Err(ProviderError::transient(format!("{name} is claimed")));
            };
            std::fs::rename(&sb.dir, &grave).map_err(io_err(&sb.dir))?;
            Some((grave, held))
        } else {
            None
        };
        // With namespaces nothing but root enters a sandbox (a container
        // sees only what is bound into it): no host user, and no Pod of a
        // node without namespaces, can race vkd while it builds this one.
        let sandbox_mode = if self.inner.isolated { 0o700 } else { 0o755 };
        let made = std::fs::create_dir(&sb.dir)
            .and_then(|()| {
                use std::os::unix::fs::PermissionsExt;
                std::fs::set_permissions(&sb.dir, std::fs::Permissions::from_mode(sandbox_mode))
            })
            .map_err(io_err(&sb.dir))
            .and_then(|()| self.record_network(&sb, spec));
        let network = match made {
            Ok(n) => n,
            Err(e) => {
                // Nothing was set up for this attempt: as it was.
                let _ = std::fs::remove_dir_all(&sb.dir);
                if let Some((grave, _)) = &grave {
                    let _ = std::fs::rename(grave, &sb.dir);
                }
                return Err(e);
            }
        };
        Ok(Begun::Claimed(Box::new(Claimed {
            sb,
            _claim: claim,
            grave,
            network,
        })))
    }

    /// The GPUs vkd placed the Pod on: as many as it asks for, each one of
    /// the config's and held by no other Pod (vkd's admission places one Pod
    /// at a time; this is the backend's own check of what it is told).
    fn placed_gpus(&self, spec: &InstanceSpec) -> Result<Vec<String>> {
        let ids = spec
            .placement
            .as_ref()
            .map(|p| p.gpu_ids.clone())
            .unwrap_or_default();
        if ids.is_empty() && spec.resources.gpus == 0 {
            return Ok(ids);
        }
        if ids.len() != spec.resources.gpus as usize {
            return Err(ProviderError::invalid(
                "GpuPlacement",
                format!(
                    "the Pod asks for {} nvidia.com/gpu and was placed on {} ({})",
                    spec.resources.gpus,
                    ids.len(),
                    ids.join(",")
                ),
            ));
        }
        if let Some(unknown) = ids
            .iter()
            .find(|id| !self.inner.config.gpus.iter().any(|g| g.id == **id))
        {
            return Err(ProviderError::invalid(
                "GpuPlacement",
                format!("host {} has no GPU {unknown}", self.inner.host),
            ));
        }
        let (_, _, _, held) = self.usage();
        if let Some((id, owner)) = held
            .iter()
            .find(|(id, owner)| ids.contains(id) && *owner != spec.pod.uid)
        {
            return Err(ProviderError::Rejected {
                message: format!("GPU {id} is held by Pod UID {owner}"),
            });
        }
        Ok(ids)
    }

    /// The last fenced step of a create: the sandbox becomes the instance and
    /// its shim starts, unless the Pod was deleted (or the node fenced) while
    /// its network was set up.
    fn finish_create(
        &self,
        fence: &Fence,
        sb: &Sandbox,
        spec: &InstanceSpec,
        pod_ip: Option<String>,
    ) -> Result<Instance> {
        let _fenced = self.check_fence(fence)?;
        if sb.stop_requested().is_some() {
            return Err(ProviderError::transient(format!(
                "Pod {} was deleted while its network was set up",
                spec.pod
            )));
        }
        let spec: &InstanceSpec = &with_pod_ip(spec, pod_ip.as_deref());
        let gpus = self.placed_gpus(spec)?;
        let launches = self.launches(spec, &sb.root(), self.inner.isolated)?;
        self.materialize(sb, spec, &launches, pod_ip.as_deref())?;
        for l in &launches {
            sb.ensure_env_file(l)
                .map_err(io_err(&sb.env_file(&l.name)))?;
        }
        let shim_spec = ShimSpec {
            spec: spec.clone(),
            containers: launches.clone(),
            run_as: Some(self.inner.run_as),
            log_max_bytes: self.inner.config.log_max_bytes,
            cgroup: self.inner.cgroup.clone(),
            pids_limit: self.inner.config.pids_limit(),
            pids_rlimit: self.inner.config.pids_rlimit(),
            isolated: self.inner.isolated,
            pod_ip: pod_ip.clone(),
        };
        sandbox::write_json(&sb.spec(), &shim_spec, 0o600).map_err(io_err(&sb.spec()))?;
        let rec = InstanceRecord {
            id: format!("proc-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]),
            owner: spec.pod.clone(),
            node: spec.node.clone(),
            epoch: fence.epoch,
            host: self.inner.host.clone(),
            created_at: SystemTime::now(),
            cpu_millis: spec.resources.cpu_millis,
            memory_bytes: spec.resources.memory_bytes,
            ip: pod_ip,
            gpus,
        };
        // Written last: its presence is what makes the sandbox an instance.
        sandbox::write_json(&sb.instance(), &rec, 0o644).map_err(io_err(&sb.instance()))?;
        self.spawn_shim(sb).map_err(|e| {
            ProviderError::transient(format!("starting the shim for {}: {e}", spec.pod))
        })?;
        let _ = self.inner.events.send(InstanceEvent::Changed {
            uid: spec.pod.uid.clone(),
        });
        Ok(self.instance_of(sb, rec, None))
    }

    /// Reads the instance, with no side effect: a dead shim's leftovers are
    /// removed only by a fenced delete.
    pub(super) fn get_blocking(&self, uid: &str) -> Result<Option<Instance>> {
        let Some((sb, rec, st)) = self.read(uid)? else {
            return Ok(None);
        };
        let shim = sb.shim_process();
        let shim_alive = shim.is_some_and(|p| p.alive());
        let done = st.as_ref().is_some_and(|s| s.done);
        let mut inst = self.instance_of(&sb, rec, st);
        if !shim_alive && shim.is_some() && !done {
            // The supervisor is gone but never said it finished: nothing runs the Pod any more.
            inst.phase = InstancePhase::Failed;
            inst.message = Some("the process supervisor (shim) of this Pod exited unexpectedly; see shim.log in its sandbox".into());
        }
        Ok(Some(inst))
    }

    pub(super) fn delete_blocking(&self, fence: &Fence, uid: &str, grace: Duration) -> Result<()> {
        let fenced = self.check_fence(fence)?;
        if uid.is_empty() || uid.contains('/') || uid.starts_with('.') {
            return Ok(());
        }
        // Only the directory, the stop file and the shim's identity are needed:
        // a torn record must not keep its Pod from being deleted.
        let sb = self.sandbox(uid);
        if !sb.dir.exists() {
            return Ok(());
        }
        if sb.stop_requested().is_none() {
            sandbox::write_atomic(&sb.stop(), grace.as_secs().to_string().as_bytes(), 0o644)
                .map_err(io_err(&sb.stop()))?;
        }
        if let Some(p) = sb.shim_process().filter(|p| p.alive()) {
            p.signal(Signal::TERM);
            return Ok(());
        }
        // Removed outside the fence lock: DEL may take its plugins' whole bound.
        drop(fenced);
        self.remove(&sb)
    }

    /// Every instance of `node`. A sandbox whose records cannot be read is left
    /// out, named on stderr: it affects only its own Pod, whose `get` fails naming
    /// the file, never the listing (and so orphan collection) of the whole node.
    pub(super) fn list_blocking(&self, node: &str) -> Result<Vec<Instance>> {
        let mut out = Vec::new();
        let dir = self.pods_dir();
        for e in std::fs::read_dir(&dir).map_err(io_err(&dir))?.flatten() {
            let uid = e.file_name().to_string_lossy().into_owned();
            if uid.starts_with('.') {
                continue;
            }
            match self.get_blocking(&uid) {
                Ok(Some(inst)) if inst.node == node => out.push(inst),
                Ok(_) => {}
                Err(e) => eprintln!("process provider: sandbox {uid} left out of the list: {e}"),
            }
        }
        Ok(out)
    }
}

/// Starts `cmd` and leaves its reaping to the runtime's SIGCHLD handling (a
/// dropped tokio child is reaped in the background), so no thread waits per Pod.
/// Without a runtime (a provider opened outside one) a waiter thread does it.
/// After a restart of vkd, init reaps the shims it started earlier.
pub(super) fn spawn_reaped(cmd: std::process::Command) -> std::io::Result<u32> {
    if tokio::runtime::Handle::try_current().is_ok() {
        let child = tokio::process::Command::from(cmd)
            .kill_on_drop(false)
            .spawn()?;
        return child
            .id()
            .ok_or_else(|| std::io::Error::other("the shim exited before it was seen"));
    }
    let mut cmd = cmd;
    let mut child = cmd.spawn()?;
    let pid = child.id();
    std::thread::spawn(move || {
        let _ = child.wait();
    });
    Ok(pid)
}

/// `spec` with the Pod's own IP in the variables that name it
/// ([`vkd_provider::ContainerSpec::pod_ip_env`]).
pub(super) fn with_pod_ip<'a>(
    spec: &'a InstanceSpec,
    ip: Option<&str>,
) -> std::borrow::Cow<'a, InstanceSpec> {
    let Some(ip) = ip else {
        return std::borrow::Cow::Borrowed(spec);
    };
    let mut spec = spec.clone();
    for c in spec.init_containers.iter_mut().chain(&mut spec.containers) {
        for (k, v) in &mut c.env {
            if c.pod_ip_env.contains(k) {
                ip.clone_into(v);
            }
        }
    }
    std::borrow::Cow::Owned(spec)
}
