//! A Pod's life in the provider: create (its sandbox, network and shim), read,
//! delete (stop the shim, kill what is left, release the network), and what a
//! restart of vkd finds and recovers.

use std::path::Path;
use std::time::{Duration, SystemTime};

use rustix::process::Signal;
use vkd_provider::{
    Fence, Instance, InstanceEvent, InstancePhase, InstanceSpec, ProviderError, Result,
};

use crate::sandbox::{InstanceRecord, Sandbox, ShimSpec};
use crate::{ProcessProvider, cgroup, io_err, isolation, network, procfs, sandbox};

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
            // A removal or a create that died half way.
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

    /// Removes a sandbox nothing runs in (a create that failed or died half
    /// way), giving back its network first.
    pub(super) fn discard(&self, dir: &Path) -> Result<()> {
        network::release(dir).map_err(|e| {
            ProviderError::transient(format!("releasing the network of {}: {e}", dir.display()))
        })?;
        isolation::unmount_under(dir).map_err(|e| {
            ProviderError::transient(format!("unmounting under {}: {e}", dir.display()))
        })?;
        match std::fs::remove_dir_all(dir) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(io_err(dir)(e)),
        }
    }

    /// With `network`, and unless the Pod uses the host's: makes the Pod's
    /// network namespace and runs CNI ADD, recorded first so that DEL can
    /// follow whatever happens next; returns the Pod's IP.
    pub(super) fn attach_network(
        &self,
        sb: &Sandbox,
        spec: &InstanceSpec,
    ) -> Result<Option<String>> {
        let Some(net) = self.inner.network.as_ref().filter(|_| !spec.host_network) else {
            return Ok(None);
        };
        let mut a = net.attachment(&spec.pod, &spec.host_ports);
        let path = network::record_path(&sb.dir);
        network::record(&sb.dir, &a).map_err(io_err(&path))?;
        let ip = a.add().map_err(|e| {
            ProviderError::transient(format!("setting up the network of {}: {e}", spec.pod))
        })?;
        a.ip = Some(ip.clone());
        network::record(&sb.dir, &a).map_err(io_err(&path))?;
        Ok(Some(ip))
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

    /// Kills what a dead shim left behind (checked by identity) and removes the sandbox.
    pub(super) fn remove(&self, sb: &Sandbox) -> Result<()> {
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
        let _fenced = self.check_fence(fence)?;
        let uid = &spec.pod.uid;
        if let Some((sb, rec, st)) = self.read(uid)? {
            return Ok(self.instance_of(&sb, rec, st));
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
        // A directory without instance.json is a create that died half way: start over.
        if sb.dir.exists() {
            self.discard(&sb.dir)?;
        }
        std::fs::create_dir(&sb.dir).map_err(io_err(&sb.dir))?;
        let built = (|| -> Result<InstanceRecord> {
            let pod_ip = self.attach_network(&sb, spec)?;
            let spec: &InstanceSpec = &with_pod_ip(spec, pod_ip.as_deref());
            let launches = self.launches(spec, &sb.root(), self.inner.isolated)?;
            self.materialize(&sb, spec, &launches, pod_ip.as_deref())?;
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
            };
            // Written last: its presence is what makes the sandbox an instance.
            sandbox::write_json(&sb.instance(), &rec, 0o644).map_err(io_err(&sb.instance()))?;
            Ok(rec)
        })();
        let rec = match built {
            Ok(r) => r,
            Err(e) => {
                let _ = self.discard(&sb.dir);
                return Err(e);
            }
        };
        if let Err(e) = self.spawn_shim(&sb) {
            // Nothing runs yet: gone, so a retried create starts afresh.
            let _ = self.discard(&sb.dir);
            return Err(ProviderError::transient(format!(
                "starting the shim for {}: {e}",
                spec.pod
            )));
        }
        let _ = self
            .inner
            .events
            .send(InstanceEvent::Changed { uid: uid.clone() });
        Ok(self.instance_of(&sb, rec, None))
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
        let _fenced = self.check_fence(fence)?;
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
        match sb.shim_process() {
            Some(p) if p.alive() => {
                p.signal(Signal::TERM);
                Ok(())
            }
            _ => self.remove(&sb),
        }
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
