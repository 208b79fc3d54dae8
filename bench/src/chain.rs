//! `vkd-bench --chain`: N Pods on the sim directly, then the same N offloaded
//! through a second cluster by the kubernetes provider (issue 18), figures side
//! by side.
//!
//! 1. Sim directly: a fresh cluster, vkd on the sim (`many.yaml`, zero
//!    latency); N Pods created, all Running and Ready, heap read, all deleted
//!    and gone.
//! 2. The chain: two fresh clusters. Downstream, vkd on the same sim fleet in
//!    per-host mode (one Node, `vk-bench-down-big-1`, labelled
//!    `vkd.io/bench-down=true`); upstream, vkd on the kubernetes provider with
//!    that label as its `hostSelector` and only `manifests/downstream`'s RBAC
//!    downstream. The same N Pods created upstream; all Ready upstream, the
//!    upstream vkd's heap read; all deleted upstream and gone on both sides
//!    (downstream: the Pods labelled `vkd.io/owner-uid` in `vkd-bench`).
//!
//! For each: the time from the last create accepted to all Ready upstream; the
//! API writes per Pod lifecycle on each cluster, by verb and resource, from each
//! kube-apiserver's `apiserver_request_total` over create to gone, less the
//! benchmark client's own N creates and N deletes; the vkd heap per Pod (with N
//! Pods, less idle).

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Result, anyhow};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::ListParams;
use kube::{Api, Client};
use vkd_e2e::{Cluster, repo_root};

use super::apiserver::ApiScrape;
use super::setup::{Role, bench_namespace, cluster_up, vkd_binary};
use super::{
    Args, Book, Daemon, NAMESPACE, NODE, create_all, delete_all, last_seen, record, secs, wait_all,
};

/// The downstream sim vkd's node (per-host mode names its one Node
/// `vk-bench-down-big-1`) and the label the upstream `hostSelector` matches.
const DOWN_NODE: &str = "vk-bench-down";
const DOWN_LABEL: &str = "vkd.io/bench-down=true";

/// The verbs of `apiserver_request_total` that write.
pub(super) const WRITE_VERBS: [&str; 6] = [
    "POST",
    "PUT",
    "PATCH",
    "APPLY",
    "DELETE",
    "DELETECOLLECTION",
];

/// One cluster of a run: its admin client and its vkd.
struct Side<'a> {
    client: Client,
    vkd: &'a Daemon,
}

/// vkd's heap: idle, once the N Pods are Ready and its writes are done, and
/// 12 s later (its idle API connections closed).
#[derive(Debug, Default, Clone, Copy)]
struct Heap {
    idle: usize,
    loaded: usize,
    steady: usize,
}

impl Heap {
    fn per_pod(at: usize, idle: usize, pods: usize) -> f64 {
        (at as f64 - idle as f64) / pods.max(1) as f64
    }
}

/// API writes per Pod by `VERB resource[/subresource]`.
pub(super) type Tally = BTreeMap<String, f64>;

/// What one mode measured.
#[derive(Debug, Default)]
struct Figures {
    pods: usize,
    ready: usize,
    /// First create sent to last create accepted.
    created_in: f64,
    /// Last create accepted to all Ready upstream.
    ready_after_last: Option<f64>,
    /// First delete sent to all gone (upstream and downstream).
    gone_after_delete: Option<f64>,
    up_writes: Tally,
    down_writes: Option<Tally>,
    up_heap: Heap,
    down_heap: Option<Heap>,
}

pub(super) async fn run(args: Args) -> Result<()> {
    let bin = vkd_binary(&args)?;
    let n = args.pods;
    println!(
        "chain: {n} Pods, sim directly and then through the kubernetes provider; vkd {}; \
         apiserver max-requests-inflight={} max-mutating-requests-inflight={}; component qps={}; \
         vkd kube-qps={} kube-burst={} reconcile-concurrency={}{}; client concurrency={}; {} cores",
        bin.display(),
        args.max_requests_inflight,
        args.max_mutating_requests_inflight,
        args.component_qps,
        args.vkd_qps,
        args.vkd_burst,
        args.reconcile_concurrency,
        args.vkd_args
            .iter()
            .map(|a| format!(" {a}"))
            .collect::<String>(),
        args.client_concurrency,
        std::thread::available_parallelism().map_or(0, usize::from),
    );

    let sim = {
        let cluster = cluster_up("bench-sim", &args, &[])?;
        let kubeconfig = cluster.service_account_kubeconfig()?;
        let client = bench_namespace(&cluster).await?;
        without_token(&cluster, &args)?;
        let vkd = Daemon::start(&cluster, &bin, &kubeconfig, &args)?;
        let side = Side { client, vkd: &vkd };
        let figures = measure("sim directly", &args, &side, None).await;
        if figures.is_err() {
            cluster.keep_dir();
        }
        figures?
    };

    let chain = {
        let (down, up) = std::thread::scope(|s| {
            let down = s.spawn(|| cluster_up("bench-down", &args, &[]));
            let up = cluster_up("bench-up", &args, &[]);
            (down.join(), up)
        });
        let down = down.map_err(|_| anyhow!("starting the downstream cluster panicked"))??;
        let up = up?;
        let down_client = super::admin_client(&down).await?;
        let down_vkd = Daemon::start_as(
            &down,
            &bin,
            &down.service_account_kubeconfig()?,
            &args,
            &Role {
                node: DOWN_NODE,
                provider: "sim",
                config: repo_root().join("testdata/fleets/many.yaml"),
                extra: &["--node-mode", "per-host", "--node-label", DOWN_LABEL],
            },
        )?;
        super::wait_until("the downstream vkd to be ready", 60, || down_vkd.ready()).await?;
        let config = up.dir().join("kubernetes-provider.yaml");
        std::fs::write(
            &config,
            format!(
                "kubeconfig: {}\nclusterName: down\nhostSelector: {DOWN_LABEL}\n",
                down.token_kubeconfig("manifests/downstream", "vkd-downstream")?
                    .display()
            ),
        )?;
        let up_client = bench_namespace(&up).await?;
        without_token(&up, &args)?;
        let up_vkd = Daemon::start_as(
            &up,
            &bin,
            &up.service_account_kubeconfig()?,
            &args,
            &Role {
                node: NODE,
                provider: "kubernetes",
                config,
                extra: &["--node-label", "vkd.io/bench=true"],
            },
        )?;
        let figures = measure(
            "chain",
            &args,
            &Side {
                client: up_client,
                vkd: &up_vkd,
            },
            Some(&Side {
                client: down_client,
                vkd: &down_vkd,
            }),
        )
        .await;
        if figures.is_err() {
            up.keep_dir();
            down.keep_dir();
        }
        // The daemons stop before the clusters: the upstream one first.
        drop(up_vkd);
        drop(down_vkd);
        figures?
    };

    print_table(n, &sim, &chain);
    Ok(())
}

/// One mode: N Pods created on `up`, Ready, deleted, gone (on `down` too).
/// `--no-token`: the bench Pods do not mount their ServiceAccount's token,
/// set on the namespace's ServiceAccount as a user would.
fn without_token(cluster: &Cluster, args: &Args) -> Result<()> {
    if args.no_token {
        cluster.kubectl(&[
            "patch",
            "serviceaccount",
            "default",
            "-n",
            NAMESPACE,
            "-p",
            r#"{"automountServiceAccountToken":false}"#,
        ])?;
    }
    Ok(())
}

async fn measure(
    mode: &str,
    args: &Args,
    up: &Side<'_>,
    down: Option<&Side<'_>>,
) -> Result<Figures> {
    let n = args.pods;
    let wait = Duration::from_secs(args.wait_seconds);
    super::wait_until(&format!("{mode}: vkd to be ready"), 120, || up.vkd.ready()).await?;
    wait_node(&up.client, n, Duration::from_secs(120)).await?;
    // Let the start's own writes (node status, leases, fences) pass.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let mut up_heap = Heap {
        idle: up.vkd.heap_bytes().unwrap_or(0),
        ..Heap::default()
    };
    let mut down_heap = down.map(|d| Heap {
        idle: d.vkd.heap_bytes().unwrap_or(0),
        ..Heap::default()
    });

    let seen: Book = Default::default();
    let pods: Api<Pod> = Api::namespaced(up.client.clone(), NAMESPACE);
    let watch = tokio::spawn(record(pods.clone(), seen.clone()));
    let up_before = ApiScrape::read(&up.client).await?.requests;
    let down_before = match down {
        Some(d) => Some(ApiScrape::read(&d.client).await?.requests),
        None => None,
    };

    let names: Vec<String> = (0..n).map(|i| format!("pod-{i:05}")).collect();
    let started = SystemTime::now();
    let last_create = create_all(&pods, &names, &seen, args.client_concurrency, None, None).await?;
    let created_in = secs(last_create, started);
    wait_all(&seen, &names, wait, |s| s.ready.is_some()).await;
    let ready = super::count(&seen, &names, |s| s.ready.is_some());
    let ready_after_last = last_seen(&seen, &names, |s| s.ready).map(|t| secs(t, last_create));
    println!(
        "{mode}: {n} Pods accepted in {created_in:.1}s; {ready} Ready upstream, the last {} after the last create",
        super::fmt_secs(ready_after_last),
    );

    // Heap with N Pods, once the daemons' writes for them are done.
    wait_quiet(up.vkd).await;
    if let Some(d) = down {
        wait_quiet(d.vkd).await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    up_heap.loaded = up.vkd.heap_bytes().unwrap_or(0);
    if let (Some(h), Some(d)) = (down_heap.as_mut(), down) {
        h.loaded = d.vkd.heap_bytes().unwrap_or(0);
    }
    tokio::time::sleep(Duration::from_secs(12)).await;
    up_heap.steady = up.vkd.heap_bytes().unwrap_or(0);
    if let (Some(h), Some(d)) = (down_heap.as_mut(), down) {
        h.steady = d.vkd.heap_bytes().unwrap_or(0);
    }

    let delete_started = SystemTime::now();
    delete_all(&pods, &names, args.client_concurrency).await?;
    let deadline = Instant::now() + wait;
    let up_gone = wait_all(&seen, &names, wait, |s| s.deleted.is_some()).await;
    let mut gone_at = last_seen(&seen, &names, |s| s.deleted).filter(|_| up_gone);
    if let Some(d) = down {
        let (left, at) = wait_downstream_gone(&d.client, deadline).await;
        gone_at = gone_at.filter(|_| left == 0).map(|t| t.max(at));
        if left > 0 {
            println!("{mode}: {left} downstream Pods still there");
        }
    }
    let gone_after_delete = gone_at.map(|t| secs(t, delete_started));
    println!(
        "{mode}: all gone {} after the first delete",
        super::fmt_secs(gone_after_delete)
    );
    watch.abort();

    // The last writes (vkd's final deletes, Events) settle.
    wait_quiet(up.vkd).await;
    if let Some(d) = down {
        wait_quiet(d.vkd).await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let up_after = ApiScrape::read(&up.client).await?.requests;
    let client_writes = [("POST pods", n as f64), ("DELETE pods", n as f64)];
    let up_writes = tally(&up_before, &up_after, &client_writes, n);
    let down_writes = match (down, down_before) {
        (Some(d), Some(before)) => Some(tally(
            &before,
            &ApiScrape::read(&d.client).await?.requests,
            &[],
            n,
        )),
        _ => None,
    };
    Ok(Figures {
        pods: n,
        ready,
        created_in,
        ready_after_last,
        gone_after_delete,
        up_writes,
        down_writes,
        up_heap,
        down_heap,
    })
}

/// Waits until the virtual node is Ready with room for `pods` (the kubernetes
/// provider's capacity comes from its downstream watch).
async fn wait_node(client: &Client, pods: usize, limit: Duration) -> Result<()> {
    let nodes: Api<Node> = Api::all(client.clone());
    let deadline = Instant::now() + limit;
    loop {
        let node = nodes.get_opt(NODE).await?;
        let status = node.as_ref().and_then(|n| n.status.as_ref());
        let ready = status
            .and_then(|s| s.conditions.as_ref())
            .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"));
        let room = status
            .and_then(|s| s.allocatable.as_ref())
            .and_then(|a| a.get("pods"))
            .and_then(|q| count_quantity(&q.0))
            .unwrap_or(0);
        if ready && room >= pods {
            return Ok(());
        }
        if Instant::now() > deadline {
            anyhow::bail!("node {NODE}: Ready {ready}, room for {room} Pods; {pods} wanted");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A count as the API server writes it (`20k` for 20000).
fn count_quantity(q: &str) -> Option<usize> {
    let (digits, scale) = match q.char_indices().last()? {
        (i, 'k') => (&q[..i], 1_000),
        (i, 'M') => (&q[..i], 1_000_000),
        (i, 'G') => (&q[..i], 1_000_000_000),
        _ => (q, 1),
    };
    digits.parse::<usize>().ok()?.checked_mul(scale)
}

/// Waits (at most 60 s) until vkd's API writes have not moved for 2 s.
async fn wait_quiet(vkd: &Daemon) {
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut last = vkd.writes().total();
    let mut still = 0;
    while still < 4 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let now = vkd.writes().total();
        still = if now == last { still + 1 } else { 0 };
        last = now;
    }
}

/// Waits until no Pod vkd made is left downstream: how many are left, and when.
async fn wait_downstream_gone(client: &Client, deadline: Instant) -> (usize, SystemTime) {
    let pods: Api<Pod> = Api::namespaced(client.clone(), &format!("vkd-{NAMESPACE}"));
    let params = ListParams::default().labels("vkd.io/owner-uid");
    loop {
        let left = match pods.list_metadata(&params).await {
            Ok(list) => list.items.len(),
            Err(e) => {
                eprintln!("bench: listing the downstream Pods: {e}");
                usize::MAX
            }
        };
        if left == 0 || Instant::now() > deadline {
            return (left, SystemTime::now());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The writes between two reads of `apiserver_request_total`, less `client`'s
/// own, per Pod.
pub(super) fn tally(
    before: &HashMap<String, f64>,
    after: &HashMap<String, f64>,
    client: &[(&str, f64)],
    pods: usize,
) -> Tally {
    let mut out = Tally::new();
    for (key, a) in after {
        let Some((verb, _)) = key.split_once(' ') else {
            continue;
        };
        if !WRITE_VERBS.contains(&verb) {
            continue;
        }
        let name = key.trim_end_matches('/').to_owned();
        let mine: f64 = client
            .iter()
            .filter(|(k, _)| *k == name)
            .map(|(_, v)| v)
            .sum();
        let delta = a - before.get(key).copied().unwrap_or(0.0) - mine;
        if delta.abs() > f64::EPSILON {
            *out.entry(name).or_default() += delta / pods.max(1) as f64;
        }
    }
    out
}

/// Lease renewals go with time, not with Pods: listed, not in the total.
fn is_lease(key: &str) -> bool {
    key.ends_with(" leases")
}

fn total(t: &Tally) -> f64 {
    t.iter().filter(|(k, _)| !is_lease(k)).map(|(_, v)| v).sum()
}

fn print_table(n: usize, sim: &Figures, chain: &Figures) {
    const NONE: &str = "—";
    let row = |label: &str, a: String, b: String| println!("{label:<44}{a:<18}{b}");
    let secs = |s: Option<f64>| s.map_or("never".to_owned(), |s| format!("{s:.1} s"));
    let ready = |f: &Figures| {
        let t = secs(f.ready_after_last);
        if f.ready == f.pods {
            t
        } else {
            format!("{t} ({} of {} Ready)", f.ready, f.pods)
        }
    };
    let bytes = |b: f64| format!("{b:.0} B");
    let writes = |t: &Tally| format!("{:.2}", total(t));
    println!();
    row(
        &format!("{n} Pods"),
        "sim directly".into(),
        "chain (kubernetes → sim)".into(),
    );
    row(
        "first create → last create accepted",
        format!("{:.1} s", sim.created_in),
        format!("{:.1} s", chain.created_in),
    );
    row("last create → all Ready upstream", ready(sim), ready(chain));
    row(
        "first delete → all gone",
        secs(sim.gone_after_delete),
        secs(chain.gone_after_delete),
    );
    row(
        "upstream API writes / Pod",
        writes(&sim.up_writes),
        writes(&chain.up_writes),
    );
    row(
        "downstream API writes / Pod",
        NONE.into(),
        chain.down_writes.as_ref().map_or(NONE.into(), writes),
    );
    let loaded: fn(&Heap) -> usize = |h| h.loaded;
    let steady: fn(&Heap) -> usize = |h| h.steady;
    for (label, at) in [
        ("upstream vkd heap / Pod", loaded),
        ("  12 s later (idle connections closed)", steady),
    ] {
        row(
            label,
            bytes(Heap::per_pod(at(&sim.up_heap), sim.up_heap.idle, n)),
            bytes(Heap::per_pod(at(&chain.up_heap), chain.up_heap.idle, n)),
        );
    }
    row(
        "downstream vkd heap / Pod",
        NONE.into(),
        chain
            .down_heap
            .map_or(NONE.into(), |h| bytes(Heap::per_pod(h.loaded, h.idle, n))),
    );
    row(
        "vkd heap idle (upstream; downstream)",
        format!("{:.1} MiB", super::mib(sim.up_heap.idle)),
        format!(
            "{:.1} MiB; {}",
            super::mib(chain.up_heap.idle),
            chain
                .down_heap
                .map_or(NONE.into(), |h| format!("{:.1} MiB", super::mib(h.idle)))
        ),
    );

    println!();
    println!(
        "API writes per Pod lifecycle by verb and resource (create → Ready → delete → gone; the benchmark's own \
         {n} creates and {n} deletes upstream not counted; leases go with time and are not in the totals):"
    );
    let per = |t: Option<&Tally>, k: &str| {
        t.map_or(NONE.to_owned(), |t| {
            t.get(k).map_or("0".to_owned(), |v| format!("{v:.2}"))
        })
    };
    let mut keys: Vec<&String> = sim.up_writes.keys().chain(chain.up_writes.keys()).collect();
    keys.sort();
    keys.dedup();
    let mark = |k: &str| if is_lease(k) { " (not in total)" } else { "" };
    for k in keys {
        row(
            &format!("  upstream {k}{}", mark(k)),
            per(Some(&sim.up_writes), k),
            per(Some(&chain.up_writes), k),
        );
    }
    if let Some(down) = &chain.down_writes {
        for k in down.keys() {
            row(
                &format!("  downstream {k}{}", mark(k)),
                NONE.into(),
                per(Some(down), k),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_read_as_the_api_server_writes_them() {
        assert_eq!(count_quantity("20k"), Some(20_000));
        assert_eq!(count_quantity("110"), Some(110));
        assert_eq!(count_quantity("2M"), Some(2_000_000));
        assert_eq!(count_quantity("1.5k"), None);
        assert_eq!(count_quantity(""), None);
    }

    #[test]
    fn the_tally_counts_writes_less_the_clients_per_pod() {
        let before: HashMap<String, f64> = [
            ("POST pods/".to_owned(), 10.0),
            ("PATCH pods/status".to_owned(), 4.0),
            ("GET pods/".to_owned(), 1.0),
        ]
        .into();
        let after: HashMap<String, f64> = [
            ("POST pods/".to_owned(), 14.0),
            ("PATCH pods/status".to_owned(), 12.0),
            ("GET pods/".to_owned(), 100.0),
            ("PUT leases/".to_owned(), 6.0),
            ("DELETE pods/".to_owned(), 8.0),
        ]
        .into();
        let t = tally(
            &before,
            &after,
            &[("POST pods", 4.0), ("DELETE pods", 4.0)],
            4,
        );
        assert_eq!(
            t,
            Tally::from([
                ("PATCH pods/status".to_owned(), 2.0),
                ("PUT leases".to_owned(), 1.5),
                ("DELETE pods".to_owned(), 1.0),
            ])
        );
        assert!((total(&t) - 3.0).abs() < 1e-9, "leases not in the total");
    }
}
