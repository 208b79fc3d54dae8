//! A real Slurm cluster on loopback: Debian's slurm-wlm 22.05 and munge,
//! installed by `e2e/cluster build-slurm`. One slurmctld and one slurmd per
//! node on this machine (Slurm's multiple-slurmd mode: `slurmd -N <node>`,
//! each on its own port, every path per node with `%n`), each node with GPU
//! GRES backed by empty files standing in for `/dev/nvidiaN` (Slurm counts
//! and allocates them and sets `CUDA_VISIBLE_DEVICES` as on a GPU node). No
//! cgroups (`proctrack/linuxproc`, `task/none`): the tests' jobs are plain
//! processes. Stopped on drop: every job cancelled, then the daemons.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result, bail};

use crate::{free_port, wait_for};

/// A running Slurm cluster.
#[derive(Debug)]
pub struct SlurmCluster {
    dir: PathBuf,
    nodes: Vec<String>,
    daemons: Vec<(String, Child)>,
}

fn hostname() -> Result<String> {
    let out = Command::new("hostname").arg("-s").output()?;
    let name = String::from_utf8(out.stdout)?.trim().to_owned();
    if name.is_empty() {
        bail!("hostname -s printed nothing");
    }
    Ok(name)
}

impl SlurmCluster {
    /// Starts a cluster in `dir` with one node per entry of `gpus` (`n1`,
    /// `n2`, ...; that many GPUs each, 8 CPUs and 8000 MiB), one partition
    /// `gpu`. `job_submit_lua`, when given, is installed as the job submit
    /// plugin (`JobSubmitPlugins=lua`).
    pub fn start(dir: &Path, gpus: &[u32], job_submit_lua: Option<&str>) -> Result<Self> {
        Self::start_sized(dir, gpus, (8, 8000), job_submit_lua)
    }

    /// [`Self::start`] with `(cpus, memory_mib)` on every node.
    pub fn start_sized(
        dir: &Path,
        gpus: &[u32],
        (cpus, memory_mib): (u32, u64),
        job_submit_lua: Option<&str>,
    ) -> Result<Self> {
        crate::built("build-slurm")?;
        std::fs::create_dir_all(dir)?;
        let dir = dir.canonicalize()?;
        for sub in ["state", "spool", "log", "munge", "dev"] {
            std::fs::create_dir_all(dir.join(sub))?;
        }
        let mut cluster = Self {
            dir: dir.clone(),
            nodes: Vec::new(),
            daemons: Vec::new(),
        };
        cluster.start_munge()?;
        let host = hostname()?;
        let ctld_port = free_port()?;
        let mut nodes = String::new();
        let mut gres = String::new();
        for (i, count) in gpus.iter().enumerate() {
            let name = format!("n{}", i + 1);
            let port = free_port()?;
            nodes.push_str(&format!(
                "NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} \
                 CPUs={cpus} RealMemory={memory_mib}{}\n",
                if *count > 0 {
                    format!(" Gres=gpu:h100:{count}")
                } else {
                    String::new()
                }
            ));
            if *count > 0 {
                let devs = dir.join("dev").join(&name);
                std::fs::create_dir_all(&devs)?;
                for g in 0..*count {
                    std::fs::write(devs.join(format!("nvidia{g}")), b"")?;
                }
                gres.push_str(&format!(
                    "NodeName={name} Name=gpu Type=h100 File={}/nvidia[0-{}]\n",
                    devs.display(),
                    count - 1
                ));
            }
            std::fs::create_dir_all(dir.join("spool").join(&name))?;
            cluster.nodes.push(name);
        }
        let d = dir.display();
        let mut conf = format!(
            "ClusterName=vkde2e\n\
             SlurmctldHost={host}(127.0.0.1)\n\
             SlurmctldPort={ctld_port}\n\
             SlurmUser=root\n\
             SlurmdUser=root\n\
             AuthType=auth/munge\n\
             CredType=cred/munge\n\
             AuthInfo=socket={d}/munge/socket\n\
             StateSaveLocation={d}/state\n\
             SlurmdSpoolDir={d}/spool/%n\n\
             SlurmctldPidFile={d}/slurmctld.pid\n\
             SlurmdPidFile={d}/slurmd-%n.pid\n\
             SlurmctldLogFile={d}/log/slurmctld.log\n\
             SlurmdLogFile={d}/log/slurmd-%n.log\n\
             ProctrackType=proctrack/linuxproc\n\
             TaskPlugin=task/none\n\
             JobAcctGatherType=jobacct_gather/none\n\
             AccountingStorageType=accounting_storage/none\n\
             SelectType=select/cons_tres\n\
             SelectTypeParameters=CR_Core_Memory\n\
             SchedulerType=sched/backfill\n\
             SchedulerParameters=sched_interval=2\n\
             GresTypes=gpu\n\
             MpiDefault=none\n\
             ReturnToService=2\n\
             SlurmdParameters=config_overrides\n\
             KillWait=5\n\
             MinJobAge=60\n\
             {nodes}\
             PartitionName=gpu Nodes=ALL Default=YES MaxTime=INFINITE State=UP\n"
        );
        if let Some(lua) = job_submit_lua {
            std::fs::write(dir.join("job_submit.lua"), lua)?;
            conf.push_str("JobSubmitPlugins=lua\n");
        }
        std::fs::write(dir.join("slurm.conf"), conf)?;
        std::fs::write(dir.join("gres.conf"), gres)?;
        std::fs::write(dir.join("cgroup.conf"), "CgroupPlugin=cgroup/v1\n")?;
        let conf = cluster.conf();
        let conf_arg = conf.display().to_string();
        cluster.spawn("slurmctld", &["-D", "-c", "-i", "-f", &conf_arg])?;
        for name in cluster.nodes.clone() {
            cluster.spawn(
                &format!("slurmd-{name}"),
                &["-D", "-N", &name, "-f", &conf_arg],
            )?;
        }
        let want = cluster.nodes.len();
        wait_for(
            "every slurmd to register idle",
            Duration::from_secs(60),
            || {
                cluster.check_daemons()?;
                let out = cluster.command("sinfo", &["--noheader", "--Node", "--format=%N %T"])?;
                let idle = out.lines().filter(|l| l.ends_with(" idle")).count();
                Ok((idle == want).then_some(()))
            },
        )?;
        Ok(cluster)
    }

    fn start_munge(&mut self) -> Result<()> {
        let m = self.dir.join("munge");
        let key = m.join("munge.key");
        let status = Command::new("mungekey")
            .args(["--create", "--force", "--keyfile"])
            .arg(&key)
            .status()
            .context("mungekey")?;
        if !status.success() {
            bail!("mungekey failed ({status})");
        }
        let arg = |flag: &str, file: &str| format!("--{flag}={}", m.join(file).display());
        self.spawn(
            "munged",
            &[
                "--foreground",
                // /tmp is world-writable; munged refuses such a tree unless forced.
                "--force",
                &arg("socket", "socket"),
                &arg("key-file", "munge.key"),
                &arg("pid-file", "munged.pid"),
                &arg("log-file", "munged.log"),
                &arg("seed-file", "munged.seed"),
            ],
        )?;
        let socket = m.join("socket");
        wait_for("munged's socket", Duration::from_secs(10), || {
            Ok(socket.exists().then_some(()))
        })
    }

    fn spawn(&mut self, name: &str, args: &[&str]) -> Result<()> {
        let program = name.split('-').next().unwrap_or(name);
        let log = std::fs::File::create(self.dir.join("log").join(format!("{name}.out")))?;
        let child = Command::new(program)
            .args(args)
            .env("SLURM_CONF", self.conf())
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {program}"))?;
        self.daemons.push((name.to_owned(), child));
        Ok(())
    }

    fn check_daemons(&mut self) -> Result<()> {
        for (name, child) in &mut self.daemons {
            if let Some(status) = child.try_wait()? {
                bail!(
                    "{name} exited ({status}); see {}",
                    self.dir.join("log").display()
                );
            }
        }
        Ok(())
    }

    /// The cluster's slurm.conf (SLURM_CONF for its commands).
    pub fn conf(&self) -> PathBuf {
        self.dir.join("slurm.conf")
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The nodes' names, `n1` first.
    pub fn nodes(&self) -> &[String] {
        &self.nodes
    }

    /// Runs a Slurm client command against this cluster; its stdout, or an
    /// error with its stderr.
    pub fn command(&self, program: &str, args: &[&str]) -> Result<String> {
        let out = Command::new(program)
            .args(args)
            .env("SLURM_CONF", self.conf())
            .stdin(Stdio::null())
            .output()
            .with_context(|| format!("running {program}"))?;
        if !out.status.success() {
            bail!(
                "{program} {}: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(String::from_utf8(out.stdout)?)
    }

    /// `squeue`'s jobs: `(id, name, state, reason)`.
    pub fn jobs(&self) -> Result<Vec<(u64, String, String, String)>> {
        let out = self.command("squeue", &["--noheader", "--format=%i|%j|%T|%r"])?;
        Ok(out
            .lines()
            .filter_map(|l| {
                let mut f = l.split('|');
                Some((
                    f.next()?.trim().parse().ok()?,
                    f.next()?.to_owned(),
                    f.next()?.to_owned(),
                    f.next()?.to_owned(),
                ))
            })
            .collect())
    }

    /// What the daemons logged, for a failing test's diagnostics.
    pub fn diagnostics(&self) -> String {
        let mut out = String::new();
        for name in ["slurmctld.log", "slurmd-n1.log"] {
            let text = std::fs::read_to_string(self.dir.join("log").join(name)).unwrap_or_default();
            let tail: Vec<&str> = text.lines().rev().take(30).collect();
            out.push_str(&format!("\n--- {name} (last 30 lines)\n"));
            for l in tail.into_iter().rev() {
                out.push_str(l);
                out.push('\n');
            }
        }
        out
    }
}

impl Drop for SlurmCluster {
    fn drop(&mut self) {
        // Jobs first, while slurmd can still end their steps.
        let _ = self.command("scancel", &["--user=root"]);
        let _ = wait_for("the jobs to end", Duration::from_secs(15), || {
            Ok(self.jobs().map_or(true, |j| j.is_empty()).then_some(()))
        });
        for (_, child) in self.daemons.iter_mut().rev() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}
