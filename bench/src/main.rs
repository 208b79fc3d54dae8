//! `vkd-bench`: how vkd holds up with thousands of Pods on one virtual node.
//!
//! It starts a real control plane with the limits given on the command line,
//! runs the release vkd on the sim provider (zero latency, `testdata/fleets/many.yaml`)
//! with the manifests' ServiceAccount, and then, with a concurrent client:
//!
//! 1. creates N Pods as fast as the API server accepts them and waits until all
//!    are Running and Ready (from its own watch);
//! 2. reads the daemon's heap and RSS with N Pods;
//! 3. SIGKILLs vkd, starts it again and times how long until the node is Ready
//!    and every instance is adopted (none may be created);
//! 4. deletes all N and waits until they are gone;
//! 0. (first, on a quiet cluster) creates M Pods at a steady rate (200/s by
//!    default) to time bound-to-create, and deletes them;
//!
//! and prints one line of figures per target, with the limits in force and the
//! CPU time each process spent (the profile: where the time went).
//!
//! `--plugin` runs the same phases with the sim as a provider plugin (`vkd
//! provider-serve`, vkd on `--provider grpc`): the provider protocol's cost.
//! `--chain` measures instead the kubernetes provider against the sim directly
//! (`chain.rs`); `--dra-writes` the API writes of a GPU Pod with and without
//! DRA (`dra.rs`).

mod apiserver;
mod chain;
mod dra;
mod peers;
mod setup;

use std::collections::HashMap;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::Child;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Result, bail};
use clap::Parser;
use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{DeleteParams, PostParams};
use kube::runtime::watcher;
use kube::{Api, Client};
use serde_json::json;
use vkd_e2e::{Cluster, free_port};

use apiserver::{ApiScrape, apiserver_profile};
use setup::{Role, bench_namespace, cluster_up, vkd_binary};

const NAMESPACE: &str = "bench";
const NODE: &str = "vk-bench";

#[derive(Debug, Parser)]
#[command(about = "Scale benchmark for vkd: N Pods on one virtual node, figures printed")]
struct Args {
    /// Pods created at once in the burst phase.
    #[arg(long, default_value_t = 1000)]
    pods: usize,
    /// Pods created at a steady rate in the latency phase (0 skips it).
    #[arg(long, default_value_t = 1000)]
    steady_pods: usize,
    /// Pods per second in the latency phase.
    #[arg(long, default_value_t = 200)]
    rate: u32,
    /// Requests the benchmark's client keeps in flight.
    #[arg(long, default_value_t = 32)]
    client_concurrency: usize,
    /// The apiserver's --max-requests-inflight.
    #[arg(long, default_value_t = 800)]
    max_requests_inflight: u32,
    /// The apiserver's --max-mutating-requests-inflight.
    #[arg(long, default_value_t = 400)]
    max_mutating_requests_inflight: u32,
    /// Client QPS of kube-scheduler and kube-controller-manager (burst is twice).
    #[arg(long, default_value_t = 500)]
    component_qps: u32,
    /// vkd's --kube-qps (Pod writes); the daemon's default unless given.
    #[arg(long, default_value_t = 1000)]
    vkd_qps: u32,
    /// vkd's --kube-burst.
    #[arg(long, default_value_t = 2000)]
    vkd_burst: u32,
    /// vkd's --reconcile-concurrency.
    #[arg(long, default_value_t = 64)]
    reconcile_concurrency: usize,
    /// Extra arguments for `vkd run` (repeatable), e.g. `--vkd-arg=--lifecycle-events=false`.
    #[arg(long = "vkd-arg", allow_hyphen_values = true)]
    vkd_args: Vec<String>,
    /// How long each wait may take before the phase is reported as not done.
    #[arg(long, default_value = "300")]
    wait_seconds: u64,
    /// Instead: N Pods on the sim directly, then offloaded through a second
    /// cluster (the kubernetes provider), figures side by side.
    #[arg(long)]
    chain: bool,
    /// With --chain: the Pods mount no ServiceAccount token (the bench
    /// namespace's ServiceAccount says `automountServiceAccountToken:
    /// false`), so none needs a volume Secret downstream.
    #[arg(long, requires = "chain")]
    no_token: bool,
    /// Instead: the same pod storm (Pods created with spec.nodeName) against
    /// vkd, KWOK and the Go Virtual Kubelet, each on a fresh cluster, and a
    /// table side by side (`peers.rs`, docs/scale.md).
    #[arg(long, conflicts_with = "chain")]
    peers: bool,
    /// With --peers: the storm sizes, one table each.
    #[arg(long, value_delimiter = ',', default_value = "5000,10000")]
    sizes: Vec<usize>,
    /// With --peers: the agents, in this order on the first round [default: all].
    #[arg(long, value_delimiter = ',')]
    agents: Vec<peers::Agent>,
    /// With --peers: rounds per size; the agents' order rotates each round.
    #[arg(long, default_value_t = 1)]
    repeat: usize,
    /// With --peers: where kwok and virtual-kubelet are [default: built by
    /// `e2e/cluster build-peers`].
    #[arg(long)]
    peers_bin: Option<PathBuf>,
    /// With --peers: seconds of the API server's CPU profiles taken from the
    /// first create and the first delete of each storm.
    #[arg(long, default_value_t = 20)]
    profile_seconds: u32,
    /// Instead: API writes per GPU Pod lifecycle without DRA, with DRA
    /// through the extended resource, and with a claim (`dra.rs`,
    /// docs/dra.md); `--pods` up to 64.
    #[arg(long, conflicts_with_all = ["chain", "peers"])]
    dra_writes: bool,
    /// The vkd to run [default: `vkd` beside this binary, target/release/vkd
    /// under scripts/bench.sh].
    #[arg(long)]
    vkd_binary: Option<PathBuf>,
    /// The sim in a process of its own (`vkd provider-serve`) and vkd on
    /// `--provider grpc`: the same phases through the provider protocol, to
    /// set against a run without it (docs/provider-protocol.md).
    #[arg(long, conflicts_with_all = ["chain", "peers", "dra_writes"])]
    plugin: bool,
}

/// The daemon's resident memory in KiB (`/proc/PID/status`): the file-backed
/// part is the binary's own pages.
#[derive(Debug, Default)]
struct Rss {
    now: u64,
    peak: u64,
    anonymous: u64,
    file: u64,
    threads: u64,
}

impl Rss {
    /// A process's figures from `/proc/PID/status` (zero when it is gone).
    fn of(pid: Option<u32>) -> Self {
        let Some(pid) = pid else {
            return Self::default();
        };
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
        let field = |key: &str| {
            status
                .lines()
                .find(|l| l.starts_with(key))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
                .unwrap_or(0)
        };
        Rss {
            now: field("VmRSS:"),
            peak: field("VmHWM:"),
            anonymous: field("RssAnon:"),
            file: field("RssFile:"),
            threads: field("Threads:"),
        }
    }
}

/// Heap per Pod over the idle heap, and RSS, each against its target.
fn memory_figures(heap: usize, idle_heap: usize, pods: usize, rss: &Rss) -> String {
    let per_pod = heap.saturating_sub(idle_heap) as f64 / pods.max(1) as f64;
    format!(
        "heap {:.1} MiB, {:.0} B/Pod [target < 2048 B/Pod: {}]; RSS {:.1} MiB (anonymous {:.1}, file-backed {:.1}; {} threads) [target < 40 MiB: {}]",
        mib(heap),
        per_pod,
        verdict(per_pod < 2048.0),
        rss.now as f64 / 1024.0,
        rss.anonymous as f64 / 1024.0,
        rss.file as f64 / 1024.0,
        rss.threads,
        verdict(rss.now < 40 * 1024),
    )
}

/// When the benchmark saw each step of one Pod.
#[derive(Clone, Debug, Default)]
struct Seen {
    created: Option<SystemTime>,
    bound: Option<SystemTime>,
    ready: Option<SystemTime>,
    deleted: Option<SystemTime>,
    /// vkd's own clock: when its watch saw the Pod, and when the instance was
    /// created, from the Pod's `vkd.io/timeline` annotation.
    vkd_observed: Option<SystemTime>,
    vkd_accepted: Option<SystemTime>,
}

/// The absolute `observed` and `accepted` times in a `vkd.io/timeline`
/// annotation (`bound=<RFC 3339> observed=+12ms ... accepted=+14ms`): the
/// offsets count from the binding as written, to the second.
fn timeline_stamps(timeline: &str) -> Option<(SystemTime, SystemTime)> {
    let mut base = None;
    let (mut observed, mut accepted) = (None, None);
    for part in timeline.split_whitespace() {
        let (key, value) = part.split_once('=')?;
        if key == "bound" {
            base = Some(SystemTime::from(value.parse::<jiff::Timestamp>().ok()?));
            continue;
        }
        let offset = value
            .strip_prefix('+')?
            .strip_suffix("ms")?
            .parse::<u64>()
            .ok()?;
        match key {
            "observed" => observed = Some(Duration::from_millis(offset)),
            "accepted" => accepted = Some(Duration::from_millis(offset)),
            _ => {}
        }
    }
    let base = base?;
    Some((base + observed?, base + accepted?))
}

type Book = Arc<Mutex<HashMap<String, Seen>>>;

fn book(b: &Book) -> std::sync::MutexGuard<'_, HashMap<String, Seen>> {
    b.lock().unwrap_or_else(|p| p.into_inner())
}

fn main() -> Result<()> {
    let args = Args::parse();
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?
        .block_on(async {
            if args.dra_writes {
                dra::run(args).await
            } else if args.chain {
                chain::run(args).await
            } else if args.peers {
                peers::run(args).await
            } else {
                run(args).await
            }
        })
}

async fn run(args: Args) -> Result<()> {
    let vkd_bin = vkd_binary(&args)?;
    let cluster = cluster_up("bench", &args, &["--profiling"])?;
    let sa_kubeconfig = cluster.service_account_kubeconfig()?;
    let client = bench_namespace(&cluster).await?;

    println!(
        "limits: apiserver max-requests-inflight={} max-mutating-requests-inflight={} (APF on, manifests' FlowSchema); \
         kube-scheduler and kube-controller-manager qps={} burst={}; vkd kube-qps={} kube-burst={} reconcile-concurrency={} {}; \
         client concurrency={}; {} cores",
        cluster.env("VKD_E2E_MAX_REQUESTS_INFLIGHT")?,
        cluster.env("VKD_E2E_MAX_MUTATING_REQUESTS_INFLIGHT")?,
        cluster.env("VKD_E2E_COMPONENT_QPS")?,
        args.component_qps * 2,
        args.vkd_qps,
        args.vkd_burst,
        args.reconcile_concurrency,
        args.vkd_args.join(" "),
        args.client_concurrency,
        std::thread::available_parallelism().map_or(0, usize::from),
    );

    let plugin = if args.plugin {
        Some(setup::Plugin::start(&cluster, &vkd_bin)?)
    } else {
        None
    };
    let mut vkd = match &plugin {
        Some(p) => {
            let endpoint = p.endpoint();
            let extra = [
                "--node-label",
                "vkd.io/bench=true",
                "--provider-endpoint",
                &endpoint,
            ];
            let role = Role {
                provider: "grpc",
                extra: &extra,
                ..Role::sim()
            };
            println!("provider: the sim as a plugin over the provider protocol ({endpoint})");
            Daemon::start_as(&cluster, &vkd_bin, &sa_kubeconfig, &args, &role)?
        }
        None => Daemon::start(&cluster, &vkd_bin, &sa_kubeconfig, &args)?,
    };
    let plugin_pid = plugin.as_ref().map(setup::Plugin::pid);
    let nodes: Api<Node> = Api::all(client.clone());
    wait_until("the virtual node to be Ready", 60, || vkd.ready()).await?;
    let idle_heap = vkd.heap_bytes().unwrap_or(0);
    let cpu_before = cpu_seconds(&cluster, &vkd, plugin_pid);

    let seen: Book = Arc::default();
    let pods: Api<Pod> = Api::namespaced(client.clone(), NAMESPACE);
    let watch = tokio::spawn(record(pods.clone(), Arc::clone(&seen)));
    let wait = Duration::from_secs(args.wait_seconds);
    let bench_started = SystemTime::now();

    // Steady rate first, on a quiet cluster: a phase after 10,000 deletions
    // would measure the control plane's backlog, not vkd.
    if args.steady_pods > 0 {
        let before = vkd.writes();
        let steady: Vec<String> = (0..args.steady_pods)
            .map(|i| format!("steady-{i:05}"))
            .collect();
        let started = SystemTime::now();
        let last = create_all(
            &pods,
            &steady,
            &seen,
            args.client_concurrency,
            Some(args.rate),
            None,
        )
        .await?;
        let achieved = steady.len() as f64 / secs(last, started).max(0.001);
        wait_all(&seen, &steady, wait, |s| s.ready.is_some()).await;
        let l = latency(&seen, &steady, &vkd.journal_created()?);
        println!(
            "steady: {} Pods at {}/s (achieved {:.0}/s): bound-to-create p50 {} p99 {} [target p99 < 50ms: {}]; create-to-Ready p50 {} p99 {}",
            steady.len(),
            args.rate,
            achieved,
            ms(l.bound_create.p(50)),
            ms(l.bound_create.p(99)),
            verdict(l.bound_create.p(99).is_some_and(|d| d < 0.050)),
            ms(l.create_ready.p(50)),
            ms(l.create_ready.p(99)),
        );
        println!(
            "steady split: binding seen by the benchmark to seen by vkd p50 {} p99 {}; vkd seen to instance created p50 {} p99 {} (vkd's own share)",
            ms(l.bound_observed.p(50)),
            ms(l.bound_observed.p(99)),
            ms(l.observed_accepted.p(50)),
            ms(l.observed_accepted.p(99)),
        );
        delete_all(&pods, &steady, args.client_concurrency).await?;
        wait_all(&seen, &steady, wait, |s| s.deleted.is_some()).await;
        tokio::time::sleep(Duration::from_secs(2)).await;
        let w = vkd.writes().minus(&before);
        println!(
            "writes (steady): {:.2} per Pod (status {:.2}, delete {:.2}, event {:.2}) [target <= 3: {}]",
            w.total() / steady.len() as f64,
            w.status / steady.len() as f64,
            w.delete / steady.len() as f64,
            w.event / steady.len() as f64,
            verdict(w.total() / steady.len() as f64 <= 3.0),
        );
    }

    // 1. Burst.
    let writes_start = vkd.writes();
    let api_before = ApiScrape::read(&client).await?.requests;
    let names: Vec<String> = (0..args.pods).map(|i| format!("burst-{i:05}")).collect();
    let (stop_sampling, heap_sampler) = vkd.sample_heap_peak();
    let started = SystemTime::now();
    let last_create = create_all(&pods, &names, &seen, args.client_concurrency, None, None).await?;
    let took = secs(last_create, started);
    println!(
        "create: {} Pods accepted in {:.1}s ({:.0} Pods/s)",
        names.len(),
        took,
        names.len() as f64 / took.max(0.001)
    );
    let all_ready = wait_all(&seen, &names, wait, |s| s.ready.is_some()).await;
    report_ready(&seen, &names, last_create, started, all_ready);
    let burst_latency = latency(&seen, &names, &vkd.journal_created()?);
    println!(
        "latency (burst): create-to-Ready p50 {} p99 {}; bound-to-create p50 {} p99 {} \
         (binding to seen by vkd p50 {} p99 {}; vkd seen to created p50 {} p99 {})",
        ms(burst_latency.create_ready.p(50)),
        ms(burst_latency.create_ready.p(99)),
        ms(burst_latency.bound_create.p(50)),
        ms(burst_latency.bound_create.p(99)),
        ms(burst_latency.bound_observed.p(50)),
        ms(burst_latency.bound_observed.p(99)),
        ms(burst_latency.observed_accepted.p(50)),
        ms(burst_latency.observed_accepted.p(99)),
    );

    // 2. Memory with N Pods, once vkd's Events and status writes for them
    // have been sent (a backlog of Events is not what the Pods hold).
    let settled = wait_until("vkd's writes for the burst", 60, || {
        let now = vkd.scrape();
        let w = now.writes().minus(&writes_start);
        let dropped = now.value("vkd_events_dropped_total", &[]);
        w.event + dropped >= names.len() as f64 && w.status >= names.len() as f64
    })
    .await;
    if let Err(e) = settled {
        println!("memory: measured with writes still due: {e:#}");
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let heap = vkd.heap_bytes().unwrap_or(0);
    let rss = vkd.rss_kib();
    stop_sampling.store(true, Ordering::Relaxed);
    let heap_peak = heap_sampler.join().unwrap_or(0);
    println!(
        "memory: with {} Pods ({:.1} MiB heap idle): {}; during the burst: peak RSS {:.1} MiB, peak heap {:.1} MiB",
        names.len(),
        mib(idle_heap),
        memory_figures(heap, idle_heap, names.len(), &rss),
        rss.peak as f64 / 1024.0,
        mib(heap_peak),
    );
    // Steady state: vkd closes API connections idle for 10 s (its
    // --kube-idle-timeout default), so the burst's extra ones are gone by now.
    tokio::time::sleep(Duration::from_secs(25)).await;
    println!(
        "memory (25s later, idle API connections closed): {}",
        memory_figures(
            vkd.heap_bytes().unwrap_or(0),
            idle_heap,
            names.len(),
            &vkd.rss_kib()
        ),
    );

    // 3. SIGKILL and restart with N Pods running.
    // The first process's counters: the restarted one starts from zero.
    let first = vkd.scrape();
    let writes_first = first.writes();
    let created_before = vkd.journal_created()?.len();
    vkd.kill()?;
    let restarted = SystemTime::now();
    vkd.spawn()?;
    let ready_after = wait_until("vkd to be ready after the restart", 120, || vkd.ready())
        .await
        .map(|()| secs(SystemTime::now(), restarted));
    let node_ready = wait_node_heartbeat(&nodes, restarted, wait).await;
    let adopted = wait_until("every instance adopted", 120, || {
        vkd.metric("vkd_pods", &[("phase", "Running")]) >= names.len() as f64
    })
    .await
    .map(|()| secs(SystemTime::now(), restarted));
    tokio::time::sleep(Duration::from_secs(2)).await;
    let created_after = vkd.journal_created()?.len() - created_before;
    let creates_called = vkd.metric_count("vkd_provider_call_duration_seconds", "create");
    let restart_writes = vkd.writes();
    println!(
        "restart: SIGKILL with {} Pods Running; vkd ready (leader, node registered, pods synced) {} after the restart, \
         node Ready heartbeat {}, all adopted {}; instances created {created_after} (create calls {creates_called:.0}), \
         status writes {} [target node Ready <= 5s and none created: {}]",
        names.len(),
        fmt_secs(ready_after.as_ref().ok().copied()),
        node_ready.map_or("not seen".into(), |s| format!("{s:.1}s")),
        adopted
            .as_ref()
            .map_or("not seen".into(), |s| format!("{s:.1}s")),
        restart_writes.status,
        verdict(
            node_ready.is_some_and(|s| s <= 5.0) && created_after == 0 && creates_called == 0.0
        ),
    );

    // 4. Delete all N.
    let profile = tokio::spawn(apiserver_profile(
        client.clone(),
        PROFILE_SECONDS,
        "apiserver-delete.pprof".into(),
    ));
    let delete_started = SystemTime::now();
    let last_delete = delete_all(&pods, &names, args.client_concurrency).await?;
    let all_deleted = wait_all(&seen, &names, wait, |s| s.deleted.is_some()).await;
    let deleted_at = last_seen(&seen, &names, |s| s.deleted);
    println!(
        "delete: {} of {} deleted {} after the first delete ({:.1}s to send them all) [target <= 30s: {}]",
        count(&seen, &names, |s| s.deleted.is_some()),
        names.len(),
        deleted_at.map_or("never".into(), |t| format!(
            "{:.1}s",
            secs(t, delete_started)
        )),
        secs(last_delete, delete_started),
        verdict(all_deleted && deleted_at.is_some_and(|t| secs(t, delete_started) <= 30.0)),
    );
    match profile.await? {
        Ok(path) => print_profile(&path),
        Err(e) => println!("apiserver profile: not taken: {e:#}"),
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let heap_after = vkd.heap_bytes().unwrap_or(0);
    println!(
        "memory after deletion: heap {:.1} MiB ({:.1} MiB idle before the first Pod); what the {} Pods held: {:.0} B/Pod",
        mib(heap_after),
        mib(idle_heap),
        names.len(),
        heap.saturating_sub(heap_after) as f64 / names.len().max(1) as f64,
    );
    let last = vkd.scrape();
    let writes = writes_first.minus(&writes_start).plus(&last.writes());
    let both = |name| first.value(name, &[]) + last.value(name, &[]);
    println!(
        "vkd: Pod writes waited {:.1}s in all for vkd's own rate limiter; failed reconciles {:.0}; Events dropped {:.0}; \
         connections opened to the API server {:.0}",
        both("vkd_api_throttled_seconds_total"),
        both("vkd_reconcile_errors_total"),
        both("vkd_events_dropped_total"),
        both("vkd_api_connections_opened_total"),
    );
    let api_after = ApiScrape::read(&client).await?.requests;
    print_writes("burst", names.len(), &writes, &api_before, &api_after);

    // Where the time went.
    let cpu_after = cpu_seconds(&cluster, &vkd, plugin_pid);
    let wall = secs(SystemTime::now(), bench_started);
    let mut parts: Vec<String> = cpu_after
        .iter()
        .map(|(name, after)| {
            let spent = after - cpu_before.get(name).copied().unwrap_or(0.0);
            format!("{name} {spent:.1}s")
        })
        .collect();
    parts.sort();
    println!(
        "cpu: {} (over {:.0}s of wall time on {} cores)",
        parts.join(", "),
        wall,
        std::thread::available_parallelism().map_or(0, usize::from),
    );
    watch.abort();
    vkd.kill()?;
    Ok(())
}

/// A binary beside this one (`target/release/vkd`).
fn sibling(name: &str) -> Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let path = exe.with_file_name(name);
    if !path.exists() {
        bail!(
            "{} not found: build it first (scripts/bench.sh does)",
            path.display()
        );
    }
    Ok(path)
}

async fn admin_client(cluster: &Cluster) -> Result<Client> {
    let kubeconfig = kube::config::Kubeconfig::read_from(cluster.kubeconfig())?;
    let config = kube::Config::from_custom_kubeconfig(
        kubeconfig,
        &kube::config::KubeConfigOptions::default(),
    )
    .await?;
    Ok(Client::try_from(config)?)
}

/// A benchmark Pod, for the scheduler to bind, or bound to `node` already
/// (then tolerating every taint, so each agent's Node takes it as it is).
fn pod(name: &str, node: Option<&str>) -> Result<Pod> {
    let mut pod = json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": NAMESPACE, "labels": {"app": "bench"}},
        "spec": {
            "nodeSelector": {"vkd.io/bench": "true"},
            "tolerations": [{"key": "virtual-kubelet.io/provider", "operator": "Exists"}],
            "terminationGracePeriodSeconds": 5,
            "containers": [{
                "name": "main",
                "image": "example/steady:1",
                "resources": {"requests": {"cpu": "10m", "memory": "16Mi"}}
            }]
        }
    });
    if let Some(node) = node {
        pod["spec"]["nodeName"] = json!(node);
        pod["spec"]["tolerations"] = json!([{"operator": "Exists"}]);
    }
    Ok(serde_json::from_value(pod)?)
}

/// Creates the Pods with `concurrency` requests in flight, at most `rate` per
/// second when given; returns when the last create was accepted.
async fn create_all(
    pods: &Api<Pod>,
    names: &[String],
    seen: &Book,
    concurrency: usize,
    rate: Option<u32>,
    node: Option<&str>,
) -> Result<SystemTime> {
    let start = Instant::now();
    futures::stream::iter(names.iter().enumerate())
        .map(|(i, name)| async move {
            if let Some(rate) = rate {
                let due = start + Duration::from_secs_f64(i as f64 / f64::from(rate.max(1)));
                tokio::time::sleep_until(due.into()).await;
            }
            let body = pod(name, node)?;
            let mut tries = 0;
            loop {
                match pods.create(&PostParams::default(), &body).await {
                    Ok(_) => break,
                    Err(kube::Error::Api(s)) if s.code == 429 && tries < 20 => {
                        tries += 1;
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                    Err(e) => {
                        return Err(anyhow::Error::from(e).context(format!("creating {name}")));
                    }
                }
            }
            book(seen).entry(name.clone()).or_default().created = Some(SystemTime::now());
            Ok::<_, anyhow::Error>(())
        })
        .buffer_unordered(concurrency)
        .try_collect::<Vec<()>>()
        .await?;
    Ok(SystemTime::now())
}

async fn delete_all(pods: &Api<Pod>, names: &[String], concurrency: usize) -> Result<SystemTime> {
    futures::stream::iter(names)
        .map(|name| async move {
            match pods.delete(name, &DeleteParams::default()).await {
                Ok(_) => Ok(()),
                Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
                Err(e) => Err(anyhow::Error::from(e).context(format!("deleting {name}"))),
            }
        })
        .buffer_unordered(concurrency)
        .try_collect::<Vec<()>>()
        .await?;
    Ok(SystemTime::now())
}

/// Watches the namespace's Pods and notes when each was first seen bound,
/// Ready, and gone.
async fn record(pods: Api<Pod>, seen: Book) {
    let mut stream = watcher(pods, watcher::Config::default()).boxed();
    while let Some(event) = stream.next().await {
        let now = SystemTime::now();
        match event {
            Ok(watcher::Event::Apply(p) | watcher::Event::InitApply(p)) => {
                let Some(name) = p.metadata.name.clone() else {
                    continue;
                };
                let mut b = book(&seen);
                let s = b.entry(name).or_default();
                if s.bound.is_none() && p.spec.as_ref().is_some_and(|s| s.node_name.is_some()) {
                    s.bound = Some(now);
                }
                let ready = p
                    .status
                    .as_ref()
                    .and_then(|st| st.conditions.as_ref())
                    .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
                if s.ready.is_none() && ready {
                    s.ready = Some(now);
                }
                if s.vkd_accepted.is_none()
                    && let Some((observed, accepted)) = p
                        .metadata
                        .annotations
                        .as_ref()
                        .and_then(|a| a.get("vkd.io/timeline"))
                        .and_then(|t| timeline_stamps(t))
                {
                    s.vkd_observed = Some(observed);
                    s.vkd_accepted = Some(accepted);
                }
            }
            Ok(watcher::Event::Delete(p)) => {
                if let Some(name) = p.metadata.name {
                    book(&seen).entry(name).or_default().deleted = Some(now);
                }
            }
            Ok(_) => {}
            Err(e) => eprintln!("bench: pod watch: {e}"),
        }
    }
}

/// Waits until `done` holds for every name; false when `limit` passed first.
async fn wait_all(
    seen: &Book,
    names: &[String],
    limit: Duration,
    done: impl Fn(&Seen) -> bool,
) -> bool {
    let deadline = Instant::now() + limit;
    loop {
        if count(seen, names, &done) == names.len() {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn count(seen: &Book, names: &[String], done: impl Fn(&Seen) -> bool) -> usize {
    let b = book(seen);
    names
        .iter()
        .filter(|n| b.get(*n).is_some_and(&done))
        .count()
}

fn last_seen(
    seen: &Book,
    names: &[String],
    at: impl Fn(&Seen) -> Option<SystemTime>,
) -> Option<SystemTime> {
    let b = book(seen);
    names
        .iter()
        .map(|n| b.get(n).and_then(&at))
        .collect::<Option<Vec<_>>>()?
        .into_iter()
        .max()
}

fn report_ready(
    seen: &Book,
    names: &[String],
    last_create: SystemTime,
    started: SystemTime,
    all: bool,
) {
    let ready_at = last_seen(seen, names, |s| s.ready);
    let after_last = ready_at.map(|t| secs(t, last_create));
    println!(
        "ready: {} of {} Running and Ready, the last {} after the last create was accepted [target <= 30s: {}]; \
         first create to all Ready {} ({} Pods/s)",
        count(seen, names, |s| s.ready.is_some()),
        names.len(),
        fmt_secs(after_last),
        verdict(all && after_last.is_some_and(|s| s <= 30.0)),
        fmt_secs(ready_at.map(|t| secs(t, started))),
        ready_at.map_or("-".into(), |t| format!(
            "{:.0}",
            names.len() as f64 / secs(t, started).max(0.001)
        )),
    );
}

/// Seconds from `from` to `to` (0 when `to` is earlier).
fn secs(to: SystemTime, from: SystemTime) -> f64 {
    to.duration_since(from).map_or(0.0, |d| d.as_secs_f64())
}

fn fmt_secs(s: Option<f64>) -> String {
    s.map_or("never".into(), |s| format!("{s:.1}s"))
}

fn ms(s: Option<f64>) -> String {
    s.map_or("-".into(), |s| format!("{:.0}ms", s * 1000.0))
}

fn mib(bytes: usize) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

fn verdict(met: bool) -> &'static str {
    if met { "met" } else { "NOT met" }
}

/// Durations in seconds, for percentiles.
#[derive(Debug, Default)]
struct Samples(Vec<f64>);

impl Samples {
    fn p(&self, pct: usize) -> Option<f64> {
        if self.0.is_empty() {
            return None;
        }
        let mut v = self.0.clone();
        v.sort_by(f64::total_cmp);
        let i = ((v.len() * pct).div_ceil(100)).clamp(1, v.len()) - 1;
        Some(v[i])
    }
}

#[derive(Debug, Default)]
struct Latency {
    create_ready: Samples,
    bound_create: Samples,
    /// The benchmark's watch saw the binding; vkd's watch saw the Pod.
    bound_observed: Samples,
    /// vkd saw the Pod; vkd's create call returned (vkd's own share).
    observed_accepted: Samples,
}

/// Create-to-Ready from the watch; bound (seen by the watch) to instance
/// created (the sim's journal, same clock).
fn latency(seen: &Book, names: &[String], created: &HashMap<String, SystemTime>) -> Latency {
    let b = book(seen);
    let mut l = Latency::default();
    for n in names {
        let Some(s) = b.get(n) else { continue };
        if let (Some(c), Some(r)) = (s.created, s.ready) {
            l.create_ready.0.push(secs(r, c));
        }
        if let (Some(bound), Some(made)) = (s.bound, created.get(n)) {
            l.bound_create.0.push(secs(*made, bound));
        }
        if let (Some(bound), Some(observed)) = (s.bound, s.vkd_observed) {
            l.bound_observed.0.push(secs(observed, bound));
        }
        if let (Some(observed), Some(accepted)) = (s.vkd_observed, s.vkd_accepted) {
            l.observed_accepted.0.push(secs(accepted, observed));
        }
    }
    l
}

async fn wait_until(what: &str, seconds: u64, mut ok: impl FnMut() -> bool) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(seconds);
    while !ok() {
        if Instant::now() > deadline {
            bail!("timed out after {seconds}s waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(())
}

/// Seconds from `since` until the node's Ready condition is True with a
/// heartbeat written after `since` (the heartbeat has one-second precision).
async fn wait_node_heartbeat(nodes: &Api<Node>, since: SystemTime, limit: Duration) -> Option<f64> {
    let floor = since.duration_since(SystemTime::UNIX_EPOCH).ok()?.as_secs();
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if let Ok(node) = nodes.get(NODE).await {
            let fresh = node
                .status
                .and_then(|s| s.conditions)
                .into_iter()
                .flatten()
                .find(|c| c.type_ == "Ready")
                .filter(|c| c.status == "True")
                .and_then(|c| c.last_heartbeat_time)
                .is_some_and(|t| t.0.as_second() >= i64::try_from(floor).unwrap_or(i64::MAX));
            if fresh {
                return Some(secs(SystemTime::now(), since));
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    None
}

/// vkd's Pod writes, from its `vkd_api_writes_total`.
#[derive(Debug, Default, Clone, Copy)]
struct Writes {
    status: f64,
    delete: f64,
    event: f64,
}

impl Writes {
    fn total(&self) -> f64 {
        self.status + self.delete + self.event
    }
    fn plus(&self, o: &Self) -> Self {
        Self {
            status: self.status + o.status,
            delete: self.delete + o.delete,
            event: self.event + o.event,
        }
    }
    fn minus(&self, o: &Self) -> Self {
        Self {
            status: self.status - o.status,
            delete: self.delete - o.delete,
            event: self.event - o.event,
        }
    }
}

fn print_writes(
    phase: &str,
    pods: usize,
    w: &Writes,
    before: &HashMap<String, f64>,
    after: &HashMap<String, f64>,
) {
    let n = pods.max(1) as f64;
    let delta =
        |k: &str| after.get(k).copied().unwrap_or(0.0) - before.get(k).copied().unwrap_or(0.0);
    println!(
        "writes ({phase}): {:.2} per Pod lifecycle (status {:.2}, delete {:.2}, event {:.2}; lease renewals excluded) [target <= 3: {}]; \
         the apiserver counted PATCH pods/status {:.0}, DELETE pods {:.0} ({pods} of them the client's), POST events {:.0}, \
         POST pods/binding {:.0}, PATCH nodes/status {:.0}",
        w.total() / n,
        w.status / n,
        w.delete / n,
        w.event / n,
        verdict(w.total() / n <= 3.0),
        delta("PATCH pods/status"),
        delta("DELETE pods/"),
        delta("POST events/") + delta("CREATE events/"),
        delta("POST pods/binding") + delta("CREATE pods/binding"),
        delta("PATCH nodes/status"),
    );
}

/// Seconds of the API server's CPU profile taken as the deletion starts.
const PROFILE_SECONDS: u32 = 20;

/// The profile's top functions by their own CPU time, from `go tool pprof`.
fn print_profile(path: &Path) {
    let out = std::process::Command::new("go")
        .args(["tool", "pprof", "-top", "-nodecount=15"])
        .arg(path)
        .output();
    match out {
        Ok(o) if o.status.success() => {
            println!(
                "apiserver profile ({PROFILE_SECONDS}s from the first delete, {}; `go tool pprof -top -cum` for more):",
                path.display()
            );
            for line in String::from_utf8_lossy(&o.stdout).lines() {
                println!("  {line}");
            }
        }
        Ok(o) => println!(
            "apiserver profile: saved at {}; go tool pprof failed: {}",
            path.display(),
            String::from_utf8_lossy(&o.stderr).trim()
        ),
        Err(e) => println!(
            "apiserver profile: saved at {}; go tool pprof not run: {e}",
            path.display()
        ),
    }
}

/// CPU seconds (user + system) of each control-plane process and of vkd.
fn cpu_seconds(cluster: &Cluster, vkd: &Daemon, plugin: Option<u32>) -> HashMap<String, f64> {
    let mut out = HashMap::new();
    for c in [
        "etcd",
        "kube-apiserver",
        "kube-controller-manager",
        "kube-scheduler",
    ] {
        if let Some(s) = component_pid(cluster, c).and_then(proc_cpu) {
            out.insert(c.to_owned(), s);
        }
    }
    if let Some(s) = vkd.pid().and_then(proc_cpu) {
        out.insert("vkd".to_owned(), vkd.earlier_cpu + s);
    }
    if let Some(s) = plugin.and_then(proc_cpu) {
        out.insert("plugin".to_owned(), s);
    }
    if let Some(s) = proc_cpu(std::process::id()) {
        out.insert("bench client".to_owned(), s);
    }
    out
}

/// The PID `e2e/cluster up` recorded for a control-plane component.
fn component_pid(cluster: &Cluster, name: &str) -> Option<u32> {
    std::fs::read_to_string(cluster.dir().join("pids").join(format!("{name}.pid")))
        .ok()?
        .trim()
        .parse()
        .ok()
}

fn proc_cpu(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name (which may hold spaces) start at field 3.
    let rest = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = fields.get(11)?.parse::<f64>().ok()? + fields.get(12)?.parse::<f64>().ok()?;
    Some(ticks / rustix::param::clock_ticks_per_second() as f64)
}

/// The vkd under test.
struct Daemon {
    args: Vec<String>,
    bin: PathBuf,
    log: PathBuf,
    state_dir: PathBuf,
    admin_port: u16,
    child: Option<Child>,
    /// CPU seconds of the processes killed before this one.
    earlier_cpu: f64,
}

/// The samples of one `/metrics` read.
#[derive(Debug, Default)]
struct Metrics(Vec<prometheus_parse::Sample>);

impl Metrics {
    fn read(admin_port: u16) -> Self {
        let Some((200, body)) = admin_get(admin_port, "/metrics") else {
            return Self::default();
        };
        Self(
            prometheus_parse::Scrape::parse(body.lines().map(|l| Ok(l.to_owned())))
                .map(|s| s.samples)
                .unwrap_or_default(),
        )
    }

    /// A gauge or counter with these labels, summed (0 when absent).
    fn value(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.0
            .iter()
            .filter(|s| s.metric == name && labels.iter().all(|(k, v)| s.labels.get(k) == Some(*v)))
            .map(|s| match s.value {
                prometheus_parse::Value::Counter(v)
                | prometheus_parse::Value::Gauge(v)
                | prometheus_parse::Value::Untyped(v) => v,
                _ => 0.0,
            })
            .fold(0.0, |a, b| a + b)
    }

    fn writes(&self) -> Writes {
        let w = |kind| self.value("vkd_api_writes_total", &[("kind", kind)]);
        Writes {
            status: w("status"),
            delete: w("delete"),
            event: w("event"),
        }
    }
}

/// One plain HTTP GET to vkd's admin port: the status code and body.
fn admin_get(port: u16, path: &str) -> Option<(u16, String)> {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").ok()?;
    let mut text = String::new();
    s.read_to_string(&mut text).ok()?;
    let code = text.split_whitespace().nth(1)?.parse().ok()?;
    let body = text.split_once("\r\n\r\n").map(|(_, b)| b.to_owned())?;
    Some((code, body))
}

impl Daemon {
    fn start(cluster: &Cluster, bin: &Path, kubeconfig: &Path, a: &Args) -> Result<Self> {
        Self::start_as(cluster, bin, kubeconfig, a, &Role::sim())
    }

    fn start_as(
        cluster: &Cluster,
        bin: &Path,
        kubeconfig: &Path,
        a: &Args,
        role: &Role<'_>,
    ) -> Result<Self> {
        let state_dir = cluster.dir().join("vkd-state");
        std::fs::create_dir_all(&state_dir)?;
        let admin_port = free_port()?;
        let mut args: Vec<String> = [
            "run",
            "--kubeconfig",
            &kubeconfig.display().to_string(),
            "--leader-election-namespace",
            "vkd-system",
            "--replica-id",
            "bench-0",
            "--node-name",
            role.node,
            "--provider",
            role.provider,
            "--provider-config",
            &role.config.display().to_string(),
            "--state-dir",
            &state_dir.display().to_string(),
            "--admin-port",
            &admin_port.to_string(),
            "--kubelet-port",
            &free_port()?.to_string(),
            "--kube-qps",
            &a.vkd_qps.to_string(),
            "--kube-burst",
            &a.vkd_burst.to_string(),
            "--reconcile-concurrency",
            &a.reconcile_concurrency.to_string(),
        ]
        .into_iter()
        .map(str::to_owned)
        .collect();
        args.extend(role.extra.iter().map(|s| (*s).to_owned()));
        args.extend(a.vkd_args.iter().cloned());
        let mut d = Self {
            args,
            bin: bin.to_owned(),
            log: cluster.log_path("vkd"),
            state_dir,
            admin_port,
            child: None,
            earlier_cpu: 0.0,
        };
        d.spawn()?;
        Ok(d)
    }

    fn spawn(&mut self) -> Result<()> {
        let child = vkd_e2e::spawn_logged(&self.bin, &self.args, &self.log, "warn,vkd=info")?;
        self.child = Some(child);
        Ok(())
    }

    fn kill(&mut self) -> Result<()> {
        if let Some(mut c) = self.child.take() {
            self.earlier_cpu += proc_cpu(c.id()).unwrap_or(0.0);
            c.kill()?;
            c.wait()?;
        }
        Ok(())
    }

    fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    fn get(&self, path: &str) -> Option<(u16, String)> {
        admin_get(self.admin_port, path)
    }

    /// Samples `vkd_heap_bytes` every 200 ms on a thread until the returned
    /// flag is set; the thread returns the highest value seen.
    fn sample_heap_peak(&self) -> (Arc<AtomicBool>, std::thread::JoinHandle<usize>) {
        let stop = Arc::new(AtomicBool::new(false));
        let port = self.admin_port;
        let flag = Arc::clone(&stop);
        let sampler = std::thread::spawn(move || {
            let mut peak = 0;
            while !flag.load(Ordering::Relaxed) {
                let heap = Metrics::read(port).value("vkd_heap_bytes", &[]);
                peak = peak.max(heap as usize);
                std::thread::sleep(Duration::from_millis(200));
            }
            peak
        });
        (stop, sampler)
    }

    fn ready(&self) -> bool {
        self.get("/readyz").is_some_and(|(code, _)| code == 200)
    }

    /// One read of vkd's `/metrics` (empty when it does not answer).
    fn scrape(&self) -> Metrics {
        Metrics::read(self.admin_port)
    }

    /// A gauge or counter with these labels (0 when absent).
    fn metric(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.scrape().value(name, labels)
    }

    /// How many observations a histogram holds for one provider operation.
    fn metric_count(&self, name: &str, operation: &str) -> f64 {
        self.scrape()
            .0
            .into_iter()
            .filter(|s| s.metric == name && s.labels.get("operation") == Some(operation))
            .map(|s| match s.value {
                prometheus_parse::Value::Histogram(h) => h.last().map_or(0.0, |b| b.count),
                _ => 0.0,
            })
            .fold(0.0, |a, b| a + b)
    }

    fn heap_bytes(&self) -> Option<usize> {
        let v = self.metric("vkd_heap_bytes", &[]);
        (v > 0.0).then_some(v as usize)
    }

    fn writes(&self) -> Writes {
        self.scrape().writes()
    }

    fn rss_kib(&self) -> Rss {
        Rss::of(self.pid())
    }

    /// When the sim created each Pod's instance, by Pod name (its journal).
    fn journal_created(&self) -> Result<HashMap<String, SystemTime>> {
        let text = match std::fs::read_to_string(self.state_dir.join("sim/journal.jsonl")) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
            Err(e) => return Err(e.into()),
        };
        let mut out = HashMap::new();
        for line in text.lines() {
            let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
                continue;
            };
            if v["event"] != "created" {
                continue;
            }
            let (Some(pod), Some(at)) = (v["pod"].as_str(), v["atMs"].as_u64()) else {
                continue;
            };
            let name = pod.rsplit('/').next().unwrap_or(pod).to_owned();
            out.insert(name, SystemTime::UNIX_EPOCH + Duration::from_millis(at));
        }
        Ok(out)
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.kill();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeline_offsets_count_from_the_binding() {
        let base = SystemTime::from("2026-12-02T20:00:01Z".parse::<jiff::Timestamp>().unwrap());
        let (observed, accepted) = timeline_stamps(
            "bound=2026-12-02T20:00:01Z observed=+12ms admitted=+13ms accepted=+40ms ready=+900ms",
        )
        .unwrap();
        assert_eq!(observed, base + Duration::from_millis(12));
        assert_eq!(accepted, base + Duration::from_millis(40));
        assert!(
            timeline_stamps("observed=+12ms accepted=+40ms").is_none(),
            "no base"
        );
        assert!(timeline_stamps("bound=2026-12-02T20:00:01Z observed=+12ms").is_none());
        assert!(timeline_stamps("bound=junk observed=+1ms accepted=+2ms").is_none());
    }
}
