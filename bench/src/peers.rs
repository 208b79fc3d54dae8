//! `vkd-bench --peers`: one pod storm against vkd and its peers, each on a
//! fresh control plane with the same limits, one after another in one run.
//!
//! The agents: vkd on the zero-latency sim, KWOK (the fake kubelet that only
//! writes a status) and the Go Virtual Kubelet with its mock provider, built
//! by `e2e/cluster build-peers` from Go modules, with its client raised to
//! vkd's rate (`--vkd-qps`, `--vkd-burst`). vkd runs as it is deployed (its
//! ServiceAccount and the manifests' FlowSchema); the peers with the admin
//! kubeconfig their own docs use.
//!
//! The storm, for each size in `--sizes`: N Pods created with `spec.nodeName`
//! set (no scheduler in the path) by a client with `--client-concurrency`
//! requests in flight; its watch waits until all are Running and Ready; all
//! deleted; the watch waits until all are gone. Measured per agent: the
//! create rate the API server accepted, first create → all Ready, last create
//! → all Ready, accepted → Ready p50/p99, delete → all gone, CPU of
//! kube-apiserver and etcd in each phase, the API writes per Pod by verb and
//! resource (less the client's own creates and deletes), the bytes those
//! writes carried and the bytes of watch events the API server sent, and the
//! agent's CPU and RSS. CPU profiles of the API server over the first
//! `--profile-seconds` of each create and each delete phase are saved under
//! `target/bench/` (`go tool pprof -top -cum FILE`).
//!
//! With `--repeat R`, the agents' order rotates on each round, so no agent
//! always runs first on a cold machine.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, SystemTime};

use anyhow::{Context, Result, bail};
use k8s_openapi::api::core::v1::Node;
use kube::{Api, Client};
use serde_json::json;
use vkd_e2e::{Cluster, free_port, repo_root};

use super::apiserver::{ApiScrape, apiserver_profile};
use super::chain::{Tally, tally};
use super::setup::{bench_namespace, cluster_up, vkd_binary};
use super::{
    Args, Book, Daemon, NAMESPACE, NODE, Rss, Samples, create_all, delete_all, last_seen, proc_cpu,
    record, secs, wait_all,
};

/// A node agent the storm runs against.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, clap::ValueEnum)]
pub(crate) enum Agent {
    Vkd,
    Kwok,
    #[value(name = "govk")]
    GoVk,
}

impl Agent {
    fn label(self) -> &'static str {
        match self {
            Self::Vkd => "vkd (sim)",
            Self::Kwok => "KWOK v0.8.0",
            Self::GoVk => "Go VK v1.14.1",
        }
    }

    /// The Node the agent serves, which the storm's Pods name.
    fn node(self) -> &'static str {
        match self {
            Self::Vkd => NODE,
            Self::Kwok => "kwok-bench",
            Self::GoVk => "govk-bench",
        }
    }
}

/// The running agent: vkd (with its admin port) or a peer's process.
enum Running {
    Vkd(Box<Daemon>),
    Peer(Child),
}

impl Running {
    fn pid(&self) -> Option<u32> {
        match self {
            Self::Vkd(d) => d.pid(),
            Self::Peer(c) => Some(c.id()),
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Self::Peer(c) = self {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// CPU seconds of the API server, etcd, the agent and the whole machine at
/// one moment.
#[derive(Clone, Copy, Debug, Default)]
struct Cpu {
    apiserver: f64,
    etcd: f64,
    agent: f64,
    machine: f64,
}

/// CPU seconds every core of the machine spent busy since boot (`/proc/stat`).
fn machine_cpu() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let cpu = stat.lines().next()?.strip_prefix("cpu ")?;
    let ticks: Vec<f64> = cpu
        .split_whitespace()
        .map(|t| t.parse().unwrap_or(0.0))
        .collect();
    // user nice system idle iowait irq softirq steal: all but idle and iowait.
    let busy: f64 = [0, 1, 2, 5, 6, 7]
        .iter()
        .filter_map(|&i| ticks.get(i))
        .sum();
    Some(busy / rustix::param::clock_ticks_per_second() as f64)
}

impl Cpu {
    fn read(cluster: &Cluster, agent: &Running) -> Self {
        let component = |name| {
            super::component_pid(cluster, name)
                .and_then(proc_cpu)
                .unwrap_or(0.0)
        };
        Self {
            apiserver: component("kube-apiserver"),
            etcd: component("etcd"),
            agent: agent.pid().and_then(proc_cpu).unwrap_or(0.0),
            machine: machine_cpu().unwrap_or(0.0),
        }
    }

    fn minus(self, o: Self) -> Self {
        Self {
            apiserver: self.apiserver - o.apiserver,
            etcd: self.etcd - o.etcd,
            agent: self.agent - o.agent,
            machine: self.machine - o.machine,
        }
    }
}

/// What one storm measured for one agent.
#[derive(Debug)]
struct Figures {
    agent: Agent,
    pods: usize,
    ready: usize,
    gone: usize,
    /// Creates accepted per second (first sent to last accepted).
    create_rate: f64,
    first_create_to_ready: Option<f64>,
    last_create_to_ready: Option<f64>,
    accepted_to_ready: Samples,
    delete_to_gone: Option<f64>,
    /// First create to all Ready, and first delete to all gone.
    create_phase: Cpu,
    delete_phase: Cpu,
    /// Write requests per Pod by "VERB resource", less the client's own: in
    /// the create phase, and in both.
    create_writes: Tally,
    writes: Tally,
    /// Request body bytes per Pod of the writes above (Pod creates and
    /// deletes left out: the client's, and the agents' small delete bodies).
    body_bytes_per_pod: f64,
    watch_bytes_per_pod: f64,
    /// KiB: with all N Ready, and the highest since the agent started.
    rss_ready: u64,
    rss_peak: u64,
    /// The API server's CPU profiles from the first create and the first delete.
    profiles: Vec<PathBuf>,
}

pub(super) async fn run(args: Args) -> Result<()> {
    let vkd_bin = vkd_binary(&args)?;
    let peers_bin = peers_bin(&args)?;
    let agents = if args.agents.is_empty() {
        vec![Agent::Vkd, Agent::Kwok, Agent::GoVk]
    } else {
        args.agents.clone()
    };
    println!(
        "peers: storms of {:?} Pods with spec.nodeName against {}; apiserver max-requests-inflight={} \
         max-mutating-requests-inflight={} (APF on); component qps={}; client concurrency={}; \
         agent client qps={} burst={} (vkd's --kube-qps/--kube-burst, the Go VK's VK_KUBE_QPS/VK_KUBE_BURST); \
         {} round(s), order rotating; {} cores",
        args.sizes,
        agents
            .iter()
            .map(|a| a.label())
            .collect::<Vec<_>>()
            .join(", "),
        args.max_requests_inflight,
        args.max_mutating_requests_inflight,
        args.component_qps,
        args.client_concurrency,
        args.vkd_qps,
        args.vkd_burst,
        args.repeat,
        std::thread::available_parallelism().map_or(0, usize::from),
    );
    let mut all = Vec::new();
    for &n in &args.sizes {
        for round in 0..args.repeat.max(1) {
            let mut order = agents.clone();
            order.rotate_left(round % agents.len().max(1));
            for &agent in &order {
                eprintln!(
                    "bench: {} with {n} Pods (round {})",
                    agent.label(),
                    round + 1
                );
                let figures = storm(&args, agent, n, &vkd_bin, &peers_bin).await;
                match figures {
                    Ok(f) => {
                        print_one(&f);
                        all.push(f);
                    }
                    Err(e) => println!("{} with {n} Pods: not measured: {e:#}", agent.label()),
                }
            }
        }
    }
    for &n in &args.sizes {
        let of_size: Vec<&Figures> = all.iter().filter(|f| f.pods == n).collect();
        print_table(n, &agents, &of_size);
    }
    Ok(())
}

/// `--peers-bin`, or the cache `e2e/cluster build-peers` fills.
fn peers_bin(args: &Args) -> Result<PathBuf> {
    if let Some(dir) = &args.peers_bin {
        return Ok(dir.clone());
    }
    let out = Command::new(repo_root().join("e2e/cluster"))
        .arg("build-peers")
        .stderr(Stdio::inherit())
        .output()
        .context("running e2e/cluster build-peers")?;
    if !out.status.success() {
        bail!("e2e/cluster build-peers failed ({})", out.status);
    }
    Ok(PathBuf::from(String::from_utf8(out.stdout)?.trim()))
}

/// One storm of `n` Pods against `agent` on a fresh cluster.
async fn storm(
    args: &Args,
    agent: Agent,
    n: usize,
    vkd_bin: &Path,
    peers_bin: &Path,
) -> Result<Figures> {
    let cluster = cluster_up(&format!("peers-{}", agent.node()), args, &["--profiling"])?;
    let client = bench_namespace(&cluster).await?;
    let running = start(&cluster, args, agent, vkd_bin, peers_bin)?;
    let figures = measure(&cluster, &client, args, agent, n, &running).await;
    if figures.is_err() {
        cluster.keep_dir();
    }
    drop(running);
    figures
}

fn start(
    cluster: &Cluster,
    args: &Args,
    agent: Agent,
    vkd_bin: &Path,
    peers_bin: &Path,
) -> Result<Running> {
    let kubeconfig = cluster.kubeconfig().display().to_string();
    let spawn = |bin: &str, argv: &[String], env: &[(&str, String)]| -> Result<Child> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(cluster.log_path(bin))?;
        Command::new(peers_bin.join(bin))
            .args(argv)
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {bin}"))
    };
    match agent {
        Agent::Vkd => {
            let sa = cluster.service_account_kubeconfig()?;
            Ok(Running::Vkd(Box::new(Daemon::start(
                cluster, vkd_bin, &sa, args,
            )?)))
        }
        Agent::Kwok => {
            // KWOK serves Nodes someone else created; this one says it is fake.
            cluster.apply(&format!(
                "apiVersion: v1\nkind: Node\nmetadata:\n  name: {}\n  annotations:\n    kwok.x-k8s.io/node: fake\n  \
                 labels:\n    type: kwok\nspec:\n  taints:\n  - key: kwok.x-k8s.io/node\n    value: fake\n    effect: NoSchedule\n",
                agent.node()
            ))?;
            let port = free_port()?;
            let argv: Vec<String> = [
                "--kubeconfig",
                &kubeconfig,
                "--manage-single-node",
                agent.node(),
                // Room for every Pod's IP (the default /24 has 254).
                "--cidr",
                "10.0.0.0/16",
                "--node-ip",
                "127.0.0.1",
                "--server-address",
                &format!("127.0.0.1:{port}"),
                // Its "fast" stages, which `e2e/cluster build-peers` put beside it.
                "--config",
                &peers_bin.join("kwok-stages.yaml").display().to_string(),
            ]
            .map(str::to_owned)
            .to_vec();
            Ok(Running::Peer(spawn("kwok", &argv, &[])?))
        }
        Agent::GoVk => {
            let config = cluster.dir().join("mock.json");
            std::fs::write(
                &config,
                json!({ agent.node(): { "cpu": "1000", "memory": "4Ti", "pods": "100000" } })
                    .to_string(),
            )?;
            let pki = cluster.dir().join("pki");
            let argv: Vec<String> = [
                "--kubeconfig",
                &kubeconfig,
                "--provider",
                "mock",
                "--provider-config",
                &config.display().to_string(),
                "--nodename",
                agent.node(),
                "--metrics-addr",
                &format!("127.0.0.1:{}", free_port()?),
                "--log-level",
                "warn",
            ]
            .map(str::to_owned)
            .to_vec();
            let env = [
                ("KUBELET_PORT", free_port()?.to_string()),
                (
                    "APISERVER_CERT_LOCATION",
                    pki.join("kube-scheduler-serving.crt").display().to_string(),
                ),
                (
                    "APISERVER_KEY_LOCATION",
                    pki.join("kube-scheduler-serving.key").display().to_string(),
                ),
                ("VK_KUBE_QPS", args.vkd_qps.to_string()),
                ("VK_KUBE_BURST", args.vkd_burst.to_string()),
            ];
            Ok(Running::Peer(spawn("virtual-kubelet", &argv, &env)?))
        }
    }
}

async fn measure(
    cluster: &Cluster,
    client: &Client,
    args: &Args,
    agent: Agent,
    n: usize,
    running: &Running,
) -> Result<Figures> {
    let nodes: Api<Node> = Api::all(client.clone());
    wait_node_ready(&nodes, agent.node(), 120).await?;
    let pods = Api::namespaced(client.clone(), NAMESPACE);
    let seen: Book = std::sync::Arc::default();
    let watch = tokio::spawn(record(pods.clone(), std::sync::Arc::clone(&seen)));
    let wait = Duration::from_secs(args.wait_seconds);
    let names: Vec<String> = (0..n).map(|i| format!("storm-{i:05}")).collect();
    // Let the agent settle after its start (its first list, node status).
    tokio::time::sleep(Duration::from_secs(2)).await;

    let api_before = ApiScrape::read(client).await?;
    let cpu_before = Cpu::read(cluster, running);
    let profile = tokio::spawn(apiserver_profile(
        client.clone(),
        args.profile_seconds,
        format!("apiserver-create-{}-{n}.pprof", agent.node()),
    ));
    let started = SystemTime::now();
    let last_create = create_all(
        &pods,
        &names,
        &seen,
        args.client_concurrency,
        None,
        Some(agent.node()),
    )
    .await?;
    let all_ready = wait_all(&seen, &names, wait, |s| s.ready.is_some()).await;
    let cpu_ready = Cpu::read(cluster, running);
    let api_ready = ApiScrape::read(client).await?;
    // The delete phase's CPU is counted from here: the scrape is neither's.
    let cpu_delete_base = Cpu::read(cluster, running);
    let rss_ready = Rss::of(running.pid()).now;
    let ready_at = all_ready
        .then(|| last_seen(&seen, &names, |s| s.ready))
        .flatten();
    let accepted_to_ready = {
        let b = super::book(&seen);
        Samples(
            names
                .iter()
                .filter_map(|n| b.get(n))
                .filter_map(|s| Some(secs(s.ready?, s.created?)))
                .collect(),
        )
    };
    let ready = super::count(&seen, &names, |s| s.ready.is_some());

    // The API server takes one CPU profile at a time.
    let create_profile = profile.await?;
    let delete_profile = tokio::spawn(apiserver_profile(
        client.clone(),
        args.profile_seconds,
        format!("apiserver-delete-{}-{n}.pprof", agent.node()),
    ));
    let delete_started = SystemTime::now();
    delete_all(&pods, &names, args.client_concurrency).await?;
    let all_gone = wait_all(&seen, &names, wait, |s| s.deleted.is_some()).await;
    let cpu_gone = Cpu::read(cluster, running);
    let gone_at = all_gone
        .then(|| last_seen(&seen, &names, |s| s.deleted))
        .flatten();
    let gone = super::count(&seen, &names, |s| s.deleted.is_some());
    let api_after = ApiScrape::read(client).await?;
    watch.abort();

    let client_writes = [("POST pods", n as f64), ("DELETE pods", n as f64)];
    let writes = tally(&api_before.requests, &api_after.requests, &client_writes, n);
    let create_writes = tally(
        &api_before.requests,
        &api_ready.requests,
        &[("POST pods", n as f64)],
        n,
    );
    let body_bytes: f64 = api_after
        .body_bytes
        .iter()
        // This metric names verbs as RBAC does and has no subresource label.
        .filter(|(k, _)| *k != "create pods/" && *k != "delete pods/")
        .map(|(k, v)| v - api_before.body_bytes.get(k).copied().unwrap_or(0.0))
        .sum();
    let mut profiles = Vec::new();
    for p in [create_profile, delete_profile.await?] {
        match p {
            Ok(path) => profiles.push(path),
            Err(e) => eprintln!("bench: apiserver profile not taken: {e:#}"),
        }
    }
    Ok(Figures {
        agent,
        pods: n,
        ready,
        gone,
        create_rate: n as f64 / secs(last_create, started).max(0.001),
        first_create_to_ready: ready_at.map(|t| secs(t, started)),
        last_create_to_ready: ready_at.map(|t| secs(t, last_create)),
        accepted_to_ready,
        delete_to_gone: gone_at.map(|t| secs(t, delete_started)),
        create_phase: cpu_ready.minus(cpu_before),
        delete_phase: cpu_gone.minus(cpu_delete_base),
        create_writes,
        writes,
        body_bytes_per_pod: body_bytes / n.max(1) as f64,
        watch_bytes_per_pod: (api_after.watch_bytes - api_before.watch_bytes) / n.max(1) as f64,
        rss_ready,
        rss_peak: Rss::of(running.pid()).peak,
        profiles,
    })
}

async fn wait_node_ready(nodes: &Api<Node>, name: &str, seconds: u64) -> Result<()> {
    let deadline = std::time::Instant::now() + Duration::from_secs(seconds);
    loop {
        let ready = nodes.get_opt(name).await.ok().flatten().is_some_and(|n| {
            n.status
                .and_then(|s| s.conditions)
                .into_iter()
                .flatten()
                .any(|c| c.type_ == "Ready" && c.status == "True")
        });
        if ready {
            return Ok(());
        }
        if std::time::Instant::now() > deadline {
            bail!("node {name} not Ready after {seconds}s");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Writes per Pod by verb and resource, as `PATCH pods/status 1.00, ...`
/// (those that round to nothing left out).
fn by_verb(t: &Tally) -> String {
    t.iter()
        .filter(|(_, v)| v.abs() >= 0.005)
        .map(|(k, v)| format!("{k} {v:.2}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// One agent's figures as a line, printed as soon as its storm ends.
fn print_one(f: &Figures) {
    println!(
        "{} with {} Pods: {} Ready, {} gone; creates accepted {:.0}/s; first create to all Ready {}; \
         last create to all Ready {}; accepted to Ready p50 {} p99 {}; delete to all gone {}; \
         kube-apiserver CPU {:.1}s + {:.1}s, etcd {:.1}s + {:.1}s, agent {:.1}s + {:.1}s (create + delete phase); \
         writes per Pod: {}; {:.0} B written and {:.0} B of watch events per Pod; agent RSS {:.1} MiB (peak {:.1}); apiserver profiles {}",
        f.agent.label(),
        f.pods,
        f.ready,
        f.gone,
        f.create_rate,
        opt_secs(f.first_create_to_ready),
        opt_secs(f.last_create_to_ready),
        opt_secs(f.accepted_to_ready.p(50)),
        opt_secs(f.accepted_to_ready.p(99)),
        opt_secs(f.delete_to_gone),
        f.create_phase.apiserver,
        f.delete_phase.apiserver,
        f.create_phase.etcd,
        f.delete_phase.etcd,
        f.create_phase.agent,
        f.delete_phase.agent,
        by_verb(&f.writes),
        f.body_bytes_per_pod,
        f.watch_bytes_per_pod,
        f.rss_ready as f64 / 1024.0,
        f.rss_peak as f64 / 1024.0,
        if f.profiles.is_empty() {
            "not taken".into()
        } else {
            f.profiles
                .iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(" ")
        },
    );
}

fn opt_secs(s: Option<f64>) -> String {
    s.map_or("never".into(), |s| {
        if s < 10.0 {
            format!("{s:.2} s")
        } else {
            format!("{s:.1} s")
        }
    })
}

/// A figure of one agent in the table: its text and, where it has one, the
/// number the ratio column divides.
type Cell = (String, Option<f64>);

/// The table of one size: a row per figure, a column per agent (each
/// round's figure, separated by `;`), then vkd's figure over each peer's
/// (the means of their rounds).
fn print_table(n: usize, agents: &[Agent], figures: &[&Figures]) {
    let columns: Vec<(Agent, Vec<&Figures>)> = agents
        .iter()
        .map(|&a| {
            (
                a,
                figures.iter().copied().filter(|f| f.agent == a).collect(),
            )
        })
        .collect();
    let peers: Vec<Agent> = agents
        .iter()
        .copied()
        .filter(|&a| a != Agent::Vkd)
        .collect();
    let mut header = format!("| {n} Pods |");
    for (a, _) in &columns {
        header.push_str(&format!(" {} |", a.label()));
    }
    for p in &peers {
        header.push_str(&format!(" vkd / {} |", p.label()));
    }
    println!();
    println!("{header}");
    println!("|{}", "---|".repeat(1 + columns.len() + peers.len()));
    let row = |label: &str, cell: &dyn Fn(&Figures) -> Cell| {
        let mut line = format!("| {label} |");
        let mut means: HashMap<Agent, f64> = HashMap::new();
        for (a, fs) in &columns {
            let cells: Vec<Cell> = fs.iter().map(|f| cell(f)).collect();
            let text: Vec<String> = cells.iter().map(|(t, _)| t.clone()).collect();
            line.push_str(&format!(
                " {} |",
                if text.is_empty() {
                    "—".into()
                } else {
                    text.join("; ")
                }
            ));
            let values: Option<Vec<f64>> = cells.iter().map(|(_, v)| *v).collect();
            if let Some(v) = values.filter(|v| !v.is_empty()) {
                means.insert(*a, v.iter().sum::<f64>() / v.len() as f64);
            }
        }
        for p in &peers {
            let ratio = match (means.get(&Agent::Vkd), means.get(p)) {
                (Some(v), Some(o)) if *o > 0.0 => format!("{:.2}", v / o),
                _ => "—".into(),
            };
            line.push_str(&format!(" {ratio} |"));
        }
        println!("{line}");
    };
    let secs_cell = |s: Option<f64>| (opt_secs(s), s);
    row("Pods Ready / gone", &|f| {
        (format!("{} / {}", f.ready, f.gone), None)
    });
    row("client creates accepted per second", &|f| {
        (format!("{:.0}", f.create_rate), Some(f.create_rate))
    });
    row("first create → all Ready", &|f| {
        secs_cell(f.first_create_to_ready)
    });
    row("last create accepted → all Ready", &|f| {
        secs_cell(f.last_create_to_ready)
    });
    row("accepted → Ready p50", &|f| {
        secs_cell(f.accepted_to_ready.p(50))
    });
    row("accepted → Ready p99", &|f| {
        secs_cell(f.accepted_to_ready.p(99))
    });
    row("first delete → all gone", &|f| {
        secs_cell(f.delete_to_gone)
    });
    let per_pod_ms = |s: f64, f: &Figures| s * 1000.0 / f.pods.max(1) as f64;
    row("kube-apiserver CPU, create phase (ms per Pod)", &|f| {
        let v = per_pod_ms(f.create_phase.apiserver, f);
        (
            format!("{:.1}s ({v:.2})", f.create_phase.apiserver),
            Some(v),
        )
    });
    // What the API server alone needs: its CPU of the create phase with every
    // core to itself. Nothing finishes sooner on this machine.
    let cores = std::thread::available_parallelism().map_or(1, usize::from) as f64;
    row("API-server bound: its create-phase CPU / cores", &|f| {
        secs_cell(Some(f.create_phase.apiserver / cores))
    });
    row("first create → all Ready, over that bound", &|f| {
        let v = f
            .first_create_to_ready
            .map(|t| t / (f.create_phase.apiserver / cores).max(0.001));
        (v.map_or("—".into(), |v| format!("{v:.2}")), v)
    });
    row(
        "machine CPU busy, create phase (of the cores' time)",
        &|f| {
            let share = f
                .first_create_to_ready
                .map(|t| f.create_phase.machine / (t * cores).max(0.001));
            (
                format!(
                    "{:.1}s{}",
                    f.create_phase.machine,
                    share.map_or(String::new(), |s| format!(" ({:.0}%)", s * 100.0))
                ),
                Some(f.create_phase.machine),
            )
        },
    );
    row("kube-apiserver CPU, delete phase (ms per Pod)", &|f| {
        let v = per_pod_ms(f.delete_phase.apiserver, f);
        (
            format!("{:.1}s ({v:.2})", f.delete_phase.apiserver),
            Some(v),
        )
    });
    row("etcd CPU, create + delete (ms per Pod)", &|f| {
        let s = f.create_phase.etcd + f.delete_phase.etcd;
        let v = per_pod_ms(s, f);
        (format!("{s:.1}s ({v:.2})"), Some(v))
    });
    row("agent CPU, create + delete (ms per Pod)", &|f| {
        let s = f.create_phase.agent + f.delete_phase.agent;
        let v = per_pod_ms(s, f);
        (format!("{s:.1}s ({v:.2})"), Some(v))
    });
    row("API writes per Pod (less the client's)", &|f| {
        let total: f64 = f
            .writes
            .iter()
            .filter(|(k, _)| !k.ends_with(" leases"))
            .map(|(_, v)| v)
            .sum();
        (format!("{total:.2}"), Some(total))
    });
    row("  in the create phase, by verb and resource", &|f| {
        (by_verb(&f.create_writes), None)
    });
    row("  both phases, by verb and resource", &|f| {
        (by_verb(&f.writes), None)
    });
    row("bytes written per Pod", &|f| {
        (
            format!("{:.0}", f.body_bytes_per_pod),
            Some(f.body_bytes_per_pod),
        )
    });
    row("watch bytes sent per Pod", &|f| {
        (
            format!("{:.0}", f.watch_bytes_per_pod),
            Some(f.watch_bytes_per_pod),
        )
    });
    row("agent RSS with all Ready / peak (MiB)", &|f| {
        let peak = f.rss_peak as f64 / 1024.0;
        (
            format!("{:.1} / {peak:.1}", f.rss_ready as f64 / 1024.0),
            Some(peak),
        )
    });
}
