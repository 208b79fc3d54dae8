//! What the provider measures: the resources its Pods ask for, the Node's
//! totals, and each Pod's usage (`/stats/summary`).

use std::time::{Duration, SystemTime};

use vkd_provider::{ContainerStats, PodStats, ProviderError, Result};

use crate::sandbox::Sandbox;
use crate::{ProcessProvider, procfs};

impl ProcessProvider {
    /// What the Pods that have not ended ask for: CPU, memory, how many, and
    /// the GPUs they hold (each with its holder's Pod UID).
    pub(super) fn usage(&self) -> (u64, u64, u32, Vec<(String, String)>) {
        let mut cpu = 0;
        let mut mem = 0;
        let mut n = 0;
        let mut gpus = Vec::new();
        if let Ok(entries) = std::fs::read_dir(self.pods_dir()) {
            for e in entries.flatten() {
                let sb = Sandbox::new(e.path());
                let Ok(Some(rec)) = sb.read_instance() else {
                    continue;
                };
                let done = sb.read_status().ok().flatten().is_some_and(|s| s.done);
                if !done {
                    cpu += rec.cpu_millis;
                    mem += rec.memory_bytes;
                    n += 1;
                    gpus.extend(rec.gpus.iter().map(|g| (g.clone(), rec.owner.uid.clone())));
                }
            }
        }
        (cpu, mem, n, gpus)
    }

    /// The host as a slice, with what the Pods use of it.
    pub(super) fn host_slice(
        &self,
        cpu: u64,
        mem: u64,
        pods: u32,
        held: &[(String, String)],
    ) -> vkd_provider::HostSlice {
        let (cpu_total, mem_total) = self.totals();
        let mut gpus = self.inner.config.host_gpus();
        for g in &mut gpus {
            g.free = !held.iter().any(|(id, _)| *id == g.id);
        }
        vkd_provider::HostSlice {
            name: self.inner.host.clone(),
            cpu_millis_total: cpu_total,
            cpu_millis_free: cpu_total.saturating_sub(cpu),
            memory_bytes_total: mem_total,
            memory_bytes_free: mem_total.saturating_sub(mem),
            gpus,
            ephemeral_storage_bytes: self.disk_total(),
            max_pods: self.inner.config.max_pods,
            pods_running: pods,
            ..Default::default()
        }
    }

    /// The size of the filesystem the Pods' sandboxes are on: the Node's
    /// ephemeral-storage, as the kubelet reports its root directory's.
    pub(super) fn disk_total(&self) -> u64 {
        rustix::fs::statvfs(self.pods_dir()).map_or(0, |v| v.f_blocks.saturating_mul(v.f_frsize))
    }

    pub(super) fn totals(&self) -> (u64, u64) {
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get()) as u64;
        (cpus * 1000, procfs::mem_total().unwrap_or(0))
    }

    /// Per-container usage from /proc (a scan per container): off the runtime.
    pub(super) fn stats_blocking(&self, uid: &str) -> Result<PodStats> {
        let not_found = || ProviderError::NotFound {
            uid: uid.to_owned(),
        };
        let (sb, rec, st) = self.read(uid)?.ok_or_else(not_found)?;
        let usage = self.inner.disk.get(uid, &sb.dir);
        let now = SystemTime::now();
        let page = procfs::page_size();
        let mut containers = Vec::new();
        for c in st
            .iter()
            .flat_map(|s| s.containers.iter().chain(s.ephemeral.iter().flatten()))
        {
            let Some(p) = c.process.filter(|p| p.alive()) else {
                continue;
            };
            let (mut measured, mut rss) = (0u64, 0);
            for pid in procfs::group_members(p.pid) {
                if let Some(s) = procfs::stat(pid) {
                    measured = measured.saturating_add(procfs::cpu_time_ns(pid, &s));
                    rss += s.rss_pages * page;
                }
            }
            let key = (uid.to_owned(), c.status.name.clone());
            let (usage, rate) = {
                let mut samples = self
                    .inner
                    .cpu_samples
                    .lock()
                    .map_err(|_| ProviderError::transient("cpu samples poisoned"))?;
                let last = samples.get(&key).copied();
                // A counter never goes back: a process that leaves the group
                // unreaped takes its time with it, so the last figure stands.
                let usage = last.map_or(measured, |(_, u)| measured.max(u));
                let rate = last.and_then(|(t, u)| {
                    let dt = now.duration_since(t).ok()?.as_nanos() as u64;
                    (dt > 0).then(|| usage.saturating_sub(u).saturating_mul(1_000_000_000) / dt)
                });
                // A Pod not asked for 10 minutes is gone (a scrape asks every
                // Pod every few seconds); forgetting one costs a single rate.
                samples.retain(|_, (t, _)| {
                    now.duration_since(*t)
                        .map_or(true, |d| d < Duration::from_secs(600))
                });
                samples.insert(key, (now, usage));
                (usage, rate.unwrap_or(0))
            };
            containers.push(ContainerStats {
                name: c.status.name.clone(),
                start_time: c.started_at.unwrap_or(rec.created_at),
                cpu_usage_core_nanoseconds: usage,
                cpu_usage_nano_cores: rate,
                memory_working_set_bytes: rss,
                memory_rss_bytes: rss,
                // The containers share the Pod's writable directory: only the
                // Pod's total is known.
                ephemeral_storage_bytes: None,
                gpus: Vec::new(),
            });
        }
        Ok(PodStats {
            pod: rec.owner,
            start_time: st.and_then(|s| s.started_at).unwrap_or(rec.created_at),
            time: now,
            containers,
            // Past the walk's bounds: more than any limit can allow.
            ephemeral_storage_bytes: Some(usage.as_ref().map_or(u64::MAX, |u| u.total)),
            volumes: usage
                .map(|u| u.volumes)
                .unwrap_or_default()
                .into_iter()
                .map(|(name, used_bytes)| vkd_provider::VolumeStats { name, used_bytes })
                .collect(),
        })
    }
}
