//! The Slurm commands the provider runs (`sbatch`, `squeue`, `scontrol`,
//! `scancel`), and parsers for what they print. The provider talks to Slurm
//! only through its own client commands, as a site's users do: no library
//! linked, no version pinned beyond the output formats asked for here.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, SystemTime};

/// What a Slurm command failed with.
#[derive(Debug, thiserror::Error)]
pub enum SlurmError {
    #[error("{command}: could not start it: {source}")]
    Spawn {
        command: &'static str,
        source: std::io::Error,
    },
    #[error("{command}: no answer in {after:?}")]
    Timeout {
        command: &'static str,
        after: Duration,
    },
    #[error("{command}: {message}")]
    Failed {
        command: &'static str,
        message: String,
    },
}

/// Why Slurm refused a submission, read from `sbatch`'s words.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// The job submit plugin (`job_submit.lua`) refused a stale epoch.
    Fenced { node: String, current: u64 },
    /// The job can never run as asked (no node has what it needs).
    Unrunnable(String),
    /// The controller did not answer, or something else that may pass.
    Transient(String),
}

/// What `sbatch` says when no node could ever hold the job, among others
/// that mean the same for a Pod (Slurm's own words, kept as they are).
const UNRUNNABLE: [&str; 6] = [
    "Requested node configuration is not available",
    "Invalid generic resource",
    "Memory required by task is not available",
    "More processors requested than permitted",
    "Invalid partition",
    "Node count specification invalid",
];

impl Refusal {
    /// Reads `sbatch`'s error output.
    pub fn of(stderr: &str) -> Self {
        let text = slurm_message(stderr);
        if let Some(rest) = stderr.split("vkd fence: node ").nth(1) {
            let mut words = rest.split_whitespace();
            let node = words.next().unwrap_or_default().to_owned();
            let current = words
                .skip_while(|w| *w != "epoch")
                .nth(1)
                .and_then(|n| n.trim_end_matches(',').parse().ok())
                .unwrap_or(u64::MAX);
            return Self::Fenced { node, current };
        }
        if UNRUNNABLE.iter().any(|u| stderr.contains(u)) {
            Self::Unrunnable(text)
        } else {
            Self::Transient(text)
        }
    }
}

/// The last `error:` line of a Slurm command's output, without the program's
/// prefix: "Requested node configuration is not available".
pub fn slurm_message(stderr: &str) -> String {
    let line = stderr
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("")
        .trim();
    let line = line.rsplit("error: ").next().unwrap_or(line);
    let line = line
        .strip_prefix("Batch job submission failed: ")
        .unwrap_or(line);
    let line = line.strip_prefix("allocation failure: ").unwrap_or(line);
    line.chars().take(512).collect()
}

/// One job as `squeue` lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JobRow {
    pub id: u64,
    pub name: String,
    /// `PENDING`, `RUNNING`, `COMPLETING`, `COMPLETED`, `CANCELLED`, ...
    pub state: String,
    /// Why a pending job waits (`Resources`, `Priority`), or `None`.
    pub reason: String,
    pub nodes: String,
    pub comment: String,
    pub submitted: Option<SystemTime>,
    pub started: Option<SystemTime>,
}

impl JobRow {
    /// Neither finished nor gone: it holds or will hold resources.
    pub fn active(&self) -> bool {
        matches!(
            self.state.as_str(),
            "PENDING"
                | "RUNNING"
                | "CONFIGURING"
                | "COMPLETING"
                | "SUSPENDED"
                | "REQUEUED"
                | "RESIZING"
                | "SIGNALING"
                | "STAGE_OUT"
                | "STOPPED"
                | "RESV_DEL_HOLD"
                | "REQUEUE_HOLD"
                | "REQUEUE_FED"
        )
    }

    /// Waiting in the queue: nothing of it runs yet (a `CONFIGURING` job has
    /// its nodes and is starting).
    pub fn pending(&self) -> bool {
        matches!(self.state.as_str(), "PENDING" | "REQUEUED" | "REQUEUE_HOLD")
    }
}

/// The `squeue` format the provider reads: `|` never occurs in what it
/// names (job names and comments are the provider's own).
const SQUEUE_FORMAT: &str = "%i|%j|%T|%r|%N|%V|%S|%k";

/// Parses `squeue -h -o SQUEUE_FORMAT`; a line that is not one is skipped.
pub fn parse_jobs(text: &str) -> Vec<JobRow> {
    text.lines()
        .filter_map(|line| {
            let mut f = line.splitn(8, '|');
            let id = f.next()?.trim().parse().ok()?;
            let name = f.next()?.to_owned();
            let state = f.next()?.to_owned();
            let reason = f.next()?.to_owned();
            let nodes = f.next()?.to_owned();
            let submitted = slurm_time(f.next()?);
            let started = slurm_time(f.next()?);
            let comment = f.next()?.to_owned();
            Some(JobRow {
                id,
                name,
                state,
                reason,
                nodes,
                comment,
                submitted,
                started,
            })
        })
        .collect()
}

/// A Slurm timestamp (`2026-12-07T03:11:06`, the controller's local time);
/// `None` for `N/A`, `Unknown` or anything else.
pub fn slurm_time(text: &str) -> Option<SystemTime> {
    let civil: jiff::civil::DateTime = text.trim().parse().ok()?;
    let zoned = civil.to_zoned(jiff::tz::TimeZone::system()).ok()?;
    Some(SystemTime::from(zoned.timestamp()))
}

/// One node as `scontrol show nodes -o` describes it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeRow {
    pub name: String,
    pub addr: String,
    pub cpus: u32,
    pub cpus_allocated: u32,
    pub memory_mib: u64,
    pub memory_allocated_mib: u64,
    /// GPUs by type (`h100`; empty when untyped), as configured.
    pub gpus: Vec<(String, u32)>,
    pub gpus_allocated: u32,
    /// `IDLE`, `MIXED`, `ALLOCATED`, `DOWN+DRAIN`, ...
    pub state: String,
    pub partitions: Vec<String>,
}

impl NodeRow {
    /// Takes jobs: neither down, drained, draining nor failing.
    pub fn usable(&self) -> bool {
        ![
            "DOWN",
            "DRAIN",
            "FAIL",
            "INVAL",
            "NOT_RESPONDING",
            "UNKNOWN",
        ]
        .iter()
        .any(|bad| {
            self.state
                .split('+')
                .any(|s| s.trim_end_matches('*') == *bad)
        }) && !self.state.ends_with('*')
    }

    pub fn gpu_count(&self) -> u32 {
        self.gpus.iter().map(|(_, n)| n).sum()
    }
}

/// Parses `scontrol show nodes -o` (one node a line, `Key=Value` words; a
/// value may hold spaces, so a word without `=` belongs to the one before).
pub fn parse_nodes(text: &str) -> Vec<NodeRow> {
    text.lines()
        .filter_map(|line| {
            let mut fields: Vec<(&str, String)> = Vec::new();
            for word in line.split_whitespace() {
                match word.split_once('=') {
                    Some((k, v))
                        if !k.is_empty() && k.chars().all(|c| c.is_ascii_alphanumeric()) =>
                    {
                        fields.push((k, v.to_owned()));
                    }
                    _ => {
                        if let Some((_, v)) = fields.last_mut() {
                            v.push(' ');
                            v.push_str(word);
                        }
                    }
                }
            }
            let get = |key: &str| {
                fields
                    .iter()
                    .find(|(k, _)| *k == key)
                    .map_or("", |(_, v)| v.as_str())
            };
            let name = get("NodeName");
            if name.is_empty() {
                return None;
            }
            let number = |key: &str| get(key).parse::<u64>().unwrap_or(0);
            Some(NodeRow {
                name: name.to_owned(),
                addr: get("NodeAddr").to_owned(),
                cpus: u32::try_from(number("CPUTot")).unwrap_or(u32::MAX),
                cpus_allocated: u32::try_from(number("CPUAlloc")).unwrap_or(u32::MAX),
                memory_mib: number("RealMemory"),
                memory_allocated_mib: number("AllocMem"),
                gpus: parse_gres(get("Gres")),
                gpus_allocated: tres_count(get("AllocTRES"), "gres/gpu"),
                state: get("State").to_owned(),
                partitions: get("Partitions")
                    .split(',')
                    .filter(|p| !p.is_empty())
                    .map(str::to_owned)
                    .collect(),
            })
        })
        .collect()
}

/// The GPUs of a node's `Gres=` (`gpu:h100:4(S:0),gpu:2`), by type.
pub fn parse_gres(gres: &str) -> Vec<(String, u32)> {
    // Commas also separate socket lists inside parentheses: drop those first.
    let mut plain = String::with_capacity(gres.len());
    let mut depth = 0u32;
    for c in gres.chars() {
        match c {
            '(' => depth += 1,
            ')' => depth = depth.saturating_sub(1),
            _ if depth == 0 => plain.push(c),
            _ => {}
        }
    }
    plain
        .split(',')
        .filter_map(|item| {
            let parts: Vec<&str> = item.split(':').collect();
            match parts.as_slice() {
                ["gpu", count] => Some((String::new(), count.parse().ok()?)),
                ["gpu", kind, count] => Some(((*kind).to_owned(), count.parse().ok()?)),
                _ => None,
            }
        })
        .filter(|(_, n)| *n > 0)
        .collect()
}

/// The count of one TRES in a list like `cpu=2,mem=1G,gres/gpu=2`.
pub fn tres_count(tres: &str, name: &str) -> u32 {
    tres.split(',')
        .filter_map(|t| t.split_once('='))
        .find(|(k, _)| *k == name)
        .and_then(|(_, v)| v.parse().ok())
        .unwrap_or(0)
}

/// A batch job to submit.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Submit {
    pub name: String,
    pub comment: String,
    pub script: PathBuf,
    pub output: PathBuf,
    pub workdir: PathBuf,
    pub cpus: u32,
    pub memory_mib: u64,
    pub gpus: u32,
    pub nodelist: Option<String>,
    /// `--export`: the variables the job's runner starts with.
    pub export: String,
}

impl Submit {
    fn args(&self, partition: Option<&str>) -> Vec<String> {
        let mut args = vec![
            "--parsable".to_owned(),
            format!("--job-name={}", self.name),
            format!("--comment={}", self.comment),
            format!("--output={}", self.output.display()),
            format!("--chdir={}", self.workdir.display()),
            "--nodes=1".to_owned(),
            "--ntasks=1".to_owned(),
            format!("--cpus-per-task={}", self.cpus.max(1)),
            format!("--mem={}M", self.memory_mib.max(1)),
            format!("--export={}", self.export),
            // Kubernetes restarts a Pod by making a new one: Slurm must not
            // run this job a second time after a node failure.
            "--no-requeue".to_owned(),
        ];
        if self.gpus > 0 {
            args.push(format!("--gres=gpu:{}", self.gpus));
        }
        if let Some(nodes) = &self.nodelist {
            args.push(format!("--nodelist={nodes}"));
        }
        if let Some(p) = partition {
            args.push(format!("--partition={p}"));
        }
        args
    }
}

/// The Slurm client commands, with the site's `slurm.conf`.
#[derive(Clone, Debug)]
pub struct Slurm {
    /// `SLURM_CONF` for every command (`None`: Slurm's default).
    pub conf: Option<PathBuf>,
    pub partition: Option<String>,
    /// How long one command may take.
    pub timeout: Duration,
}

impl Slurm {
    async fn output(
        &self,
        command: &'static str,
        args: &[String],
    ) -> Result<std::process::Output, SlurmError> {
        let mut cmd = tokio::process::Command::new(command);
        cmd.args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        if let Some(conf) = &self.conf {
            cmd.env("SLURM_CONF", conf);
        }
        let child = cmd
            .spawn()
            .map_err(|source| SlurmError::Spawn { command, source })?;
        tokio::time::timeout(self.timeout, child.wait_with_output())
            .await
            .map_err(|_| SlurmError::Timeout {
                command,
                after: self.timeout,
            })?
            .map_err(|source| SlurmError::Spawn { command, source })
    }

    /// Runs a command; its standard output, or its error output as the failure.
    async fn run(&self, command: &'static str, args: &[String]) -> Result<String, SlurmError> {
        let out = self.output(command, args).await?;
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).into_owned())
        } else {
            Err(SlurmError::Failed {
                command,
                message: slurm_message(&String::from_utf8_lossy(&out.stderr)),
            })
        }
    }

    /// Every job the controller still knows (finished ones for `MinJobAge`).
    pub async fn jobs(&self) -> Result<Vec<JobRow>, SlurmError> {
        let args = [
            "--noheader",
            "--all",
            // This account's jobs only: another user's job named vkd-<uid> is
            // never taken for a Pod's.
            "--me",
            "--states=all",
            "--format",
            SQUEUE_FORMAT,
        ]
        .map(str::to_owned);
        Ok(parse_jobs(&self.run("squeue", &args).await?))
    }

    pub async fn nodes(&self) -> Result<Vec<NodeRow>, SlurmError> {
        let args = ["show", "nodes", "--oneliner"].map(str::to_owned);
        let nodes = parse_nodes(&self.run("scontrol", &args).await?);
        Ok(match &self.partition {
            Some(p) => nodes
                .into_iter()
                .filter(|n| n.partitions.iter().any(|q| q == p))
                .collect(),
            None => nodes,
        })
    }

    /// Submits the job; its id, or Slurm's refusal.
    pub async fn submit(&self, job: &Submit) -> Result<Result<u64, Refusal>, SlurmError> {
        let mut args = job.args(self.partition.as_deref());
        args.push(job.script.display().to_string());
        let out = self.output("sbatch", &args).await?;
        if !out.status.success() {
            return Ok(Err(Refusal::of(&String::from_utf8_lossy(&out.stderr))));
        }
        let text = String::from_utf8_lossy(&out.stdout);
        let id = text
            .trim()
            .split(';')
            .next()
            .unwrap_or("")
            .parse()
            .map_err(|_| SlurmError::Failed {
                command: "sbatch",
                message: format!("--parsable printed {:?}, not a job id", text.trim()),
            })?;
        Ok(Ok(id))
    }

    /// `sbatch --test-only`: could the job ever run? Nothing is submitted.
    pub async fn test(&self, job: &Submit) -> Result<Result<(), Refusal>, SlurmError> {
        let mut args = job.args(self.partition.as_deref());
        args.retain(|a| a != "--parsable" && !a.starts_with("--comment="));
        args.push("--test-only".to_owned());
        args.push("--wrap=true".to_owned());
        let out = self.output("sbatch", &args).await?;
        Ok(if out.status.success() {
            Ok(())
        } else {
            Err(Refusal::of(&String::from_utf8_lossy(&out.stderr)))
        })
    }

    /// Signals a job: `Some("TERM")` sends SIGTERM to every step but the
    /// batch script (srun in it would kill its step at once on a SIGTERM);
    /// `None` cancels it (Slurm sends SIGTERM, then SIGKILL after its `KillWait`).
    pub async fn cancel(&self, job: u64, signal: Option<&str>) -> Result<(), SlurmError> {
        let mut args = Vec::new();
        if let Some(s) = signal {
            args.push(format!("--signal={s}"));
        }
        args.push(job.to_string());
        match self.run("scancel", &args).await {
            // Already gone is what a cancel wants.
            Err(SlurmError::Failed { message, .. })
                if message.contains("Invalid job id")
                    || message.contains("already completing or completed") =>
            {
                Ok(())
            }
            other => other.map(drop),
        }
    }

    /// `scontrol ping`: the controller's own word that it answers.
    pub async fn ping(&self) -> Result<String, SlurmError> {
        let out = self.run("scontrol", &["ping".to_owned()]).await?;
        let text = out.trim().to_owned();
        if text.contains("is UP") {
            Ok(text)
        } else {
            Err(SlurmError::Failed {
                command: "scontrol",
                message: text,
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn squeue_rows_are_read_field_by_field() {
        let rows = parse_jobs(
            "12|vkd-abc|PENDING|Resources||2026-12-07T03:11:06|N/A|vkd:node=vk;epoch=3;pod=ns/p\n\
             13|vkd-def|RUNNING|None|n1|2026-12-07T03:11:06|2026-12-07T03:11:07|\n\
             garbage line\n",
        );
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[0].id, 12);
        assert_eq!(rows[0].reason, "Resources");
        assert!(rows[0].pending() && rows[0].active());
        assert_eq!(rows[0].comment, "vkd:node=vk;epoch=3;pod=ns/p");
        assert!(rows[0].started.is_none() && rows[0].submitted.is_some());
        assert_eq!(rows[1].nodes, "n1");
        assert!(rows[1].active() && !rows[1].pending());
    }

    #[test]
    fn scontrol_nodes_with_spaces_in_values() {
        let nodes = parse_nodes(
            "NodeName=n1 Arch=x86_64 CoresPerSocket=1 CPUAlloc=2 CPUEfctv=8 CPUTot=8 \
             Gres=gpu:h100:4(S:0-1) NodeAddr=127.0.0.1 OS=Linux 6.1.0 #1 SMP RealMemory=8000 \
             AllocMem=512 State=MIXED Partitions=gpu,cpu AllocTRES=cpu=2,mem=512M,gres/gpu=3 \
             Reason=maintenance by admin [root@2026]\n\
             NodeName=n2 CPUTot=8 Gres=(null) State=DOWN+DRAIN RealMemory=100\n",
        );
        assert_eq!(nodes.len(), 2);
        let n1 = &nodes[0];
        assert_eq!((n1.cpus, n1.cpus_allocated), (8, 2));
        assert_eq!((n1.memory_mib, n1.memory_allocated_mib), (8000, 512));
        assert_eq!(n1.gpus, vec![("h100".to_owned(), 4)]);
        assert_eq!(n1.gpus_allocated, 3);
        assert_eq!(n1.partitions, ["gpu", "cpu"]);
        assert!(n1.usable());
        assert_eq!(nodes[1].gpu_count(), 0);
        assert!(!nodes[1].usable());
    }

    #[test]
    fn gres_lists() {
        assert_eq!(
            parse_gres("gpu:a100:2(S:0),gpu:h100:2(S:1),shard:8"),
            vec![("a100".to_owned(), 2), ("h100".to_owned(), 2)]
        );
        assert_eq!(parse_gres("gpu:2"), vec![(String::new(), 2)]);
        assert!(parse_gres("(null)").is_empty());
        assert!(parse_gres("gpu:h100:99999999999").is_empty());
    }

    #[test]
    fn refusals_keep_slurms_words() {
        assert_eq!(
            Refusal::of(
                "sbatch: error: Batch job submission failed: Requested node configuration is not available\n"
            ),
            Refusal::Unrunnable("Requested node configuration is not available".into())
        );
        assert_eq!(
            Refusal::of(
                "sbatch: error: vkd fence: node vk-slurm is at epoch 7, this job carries epoch 6\n\
                 sbatch: error: Batch job submission failed: Access/permission denied\n"
            ),
            Refusal::Fenced {
                node: "vk-slurm".into(),
                current: 7
            }
        );
        assert!(matches!(
            Refusal::of("sbatch: error: Batch job submission failed: Unable to contact slurm controller (connect failure)"),
            Refusal::Transient(m) if m == "Unable to contact slurm controller (connect failure)"
        ));
    }

    #[test]
    fn submissions_ask_for_one_node_and_never_requeue() {
        let args = Submit {
            name: "vkd-u".into(),
            gpus: 2,
            cpus: 0,
            memory_mib: 64,
            export: "PATH=/usr/bin".into(),
            nodelist: Some("n1".into()),
            ..Default::default()
        }
        .args(Some("gpu"));
        for want in [
            "--nodes=1",
            "--cpus-per-task=1",
            "--mem=64M",
            "--gres=gpu:2",
            "--nodelist=n1",
            "--partition=gpu",
            "--no-requeue",
        ] {
            assert!(
                args.iter().any(|a| a == want),
                "{want} missing from {args:?}"
            );
        }
    }
}
