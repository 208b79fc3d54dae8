//! How long Pods take through the Slurm provider on a real Slurm cluster:
//! N Pods (default 100) created through the provider protocol as vkd creates
//! them (16 calls in flight), timed from the create call until the plugin
//! lists the instance Running, then deleted (grace 5 s; the containers exit
//! on SIGTERM) and timed until it lists them no more. Prints p50, p99 and
//! the slowest, the wall time of each phase and the CPU the plugin and
//! slurmctld spent. docs/slurm-provider.md has the figures.
//!
//! ```text
//! cargo build -p vkd-slurm --bins --examples
//! target/debug/examples/hundred_pods [PODS]
//! ```

#![allow(clippy::unwrap_used, clippy::expect_used)] // a benchmark: a failure is reported by a panic

use std::collections::HashMap;
use std::time::{Duration, Instant};

use futures::StreamExt;
use vkd_e2e::slurm::SlurmCluster;
use vkd_grpc::{Endpoint, GrpcProvider};
use vkd_provider::conformance::sample_spec;
use vkd_provider::{ContainerSpec, Fence, InstancePhase, Provider};

const NODE: &str = "vk-bench";
const IN_FLIGHT: usize = 16;

fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let after = stat.rsplit(')').next().unwrap_or("");
    let fields: Vec<&str> = after.split_whitespace().collect();
    let ticks: f64 = [11, 12]
        .iter()
        .filter_map(|&i| fields.get(i)?.parse::<f64>().ok())
        .sum();
    ticks / 100.0
}

fn pid_of(pattern: &str) -> Option<u32> {
    let out = std::process::Command::new("pgrep")
        .args(["-f", pattern])
        .output()
        .ok()?;
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .next()?
        .trim()
        .parse()
        .ok()
}

fn summary(mut d: Vec<Duration>) -> String {
    d.sort();
    let p = |q: usize| d[(d.len() * q / 100).min(d.len() - 1)].as_secs_f64();
    format!(
        "p50 {:.2}s, p99 {:.2}s, slowest {:.2}s",
        p(50),
        p(99),
        d.last().map_or(0.0, Duration::as_secs_f64)
    )
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let pods: usize = std::env::args()
        .nth(1)
        .map_or(100, |n| n.parse().expect("PODS is a number"));
    assert!(pods > 0, "PODS must be at least 1");
    let dir = std::env::temp_dir().join(format!("vkd-slurm-bench-{}", std::process::id()));
    let state = dir.join("state");
    let lua = vkd_slurm::SlurmProvider::job_submit_lua(&state);
    // Room for every Pod at once: 1 CPU and 256 MiB each.
    let cluster =
        SlurmCluster::start_sized(&dir.join("slurm"), &[4, 2, 2], (48, 64_000), Some(&lua))
            .unwrap();
    let socket = dir.join("plugin.sock");
    let bin = std::env::current_exe()
        .unwrap()
        .parent()
        .and_then(|examples| examples.parent())
        .unwrap()
        .join("vkd-slurm");
    let mut plugin = std::process::Command::new(&bin)
        .arg("serve")
        .arg(format!("--listen=unix://{}", socket.display()))
        .arg(format!("--state-dir={}", state.display()))
        .arg(format!("--slurm-conf={}", cluster.conf().display()))
        .stderr(std::fs::File::create(dir.join("plugin.log")).unwrap())
        .spawn()
        .expect("vkd-slurm beside this example: cargo build -p vkd-slurm --bins --examples");
    let p = loop {
        match GrpcProvider::connect(Endpoint::unix(socket.clone()), Duration::from_secs(30)).await {
            Ok(p) => break p,
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    };
    let ctld = pid_of(&format!("slurmctld.*{}", dir.display())).unwrap_or(0);
    let cpu = |pid: u32| if pid == 0 { 0.0 } else { cpu_seconds(pid) };
    let (plugin_cpu0, ctld_cpu0) = (cpu(plugin.id()), cpu(ctld));
    let fence = Fence {
        node: NODE.into(),
        epoch: 1,
    };
    let uids: Vec<String> = (0..pods).map(|i| format!("bench-{i:04}")).collect();

    let started = Instant::now();
    let called: HashMap<String, Instant> = futures::stream::iter(&uids)
        .map(|uid| {
            let (p, fence) = (&p, &fence);
            async move {
                let mut spec = sample_spec(NODE, uid);
                spec.containers = vec![ContainerSpec {
                    name: "main".into(),
                    image: "busybox".into(),
                    command: vec!["sleep".into(), "3600".into()],
                    ..Default::default()
                }];
                let at = Instant::now();
                p.create(fence, &spec).await.unwrap();
                (uid.clone(), at)
            }
        })
        .buffer_unordered(IN_FLIGHT)
        .collect()
        .await;
    let submitted = started.elapsed();
    let mut running: HashMap<String, Duration> = HashMap::new();
    while running.len() < pods {
        for i in p.list(NODE).await.unwrap() {
            if i.phase == InstancePhase::Running && !running.contains_key(&i.owner.uid) {
                running.insert(i.owner.uid.clone(), called[&i.owner.uid].elapsed());
            }
        }
        assert!(
            started.elapsed() < Duration::from_secs(600),
            "not all Running"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let all_running = started.elapsed();
    println!(
        "create -> Running, {pods} Pods as Slurm jobs ({IN_FLIGHT} creates in flight): {}; \
         all submitted in {:.1}s, all Running in {:.1}s",
        summary(running.into_values().collect()),
        submitted.as_secs_f64(),
        all_running.as_secs_f64()
    );

    let started = Instant::now();
    let asked: HashMap<String, Instant> = futures::stream::iter(&uids)
        .map(|uid| {
            let (p, fence) = (&p, &fence);
            async move {
                let at = Instant::now();
                p.delete(fence, uid, Duration::from_secs(5)).await.unwrap();
                (uid.clone(), at)
            }
        })
        .buffer_unordered(IN_FLIGHT)
        .collect()
        .await;
    let mut gone: HashMap<String, Duration> = HashMap::new();
    while gone.len() < pods {
        let listed: Vec<String> = p
            .list(NODE)
            .await
            .unwrap()
            .into_iter()
            .map(|i| i.owner.uid)
            .collect();
        for uid in &uids {
            if !listed.contains(uid) && !gone.contains_key(uid) {
                gone.insert(uid.clone(), asked[uid].elapsed());
            }
        }
        assert!(started.elapsed() < Duration::from_secs(600), "not all gone");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    println!(
        "delete -> gone: {}; all gone in {:.1}s",
        summary(gone.into_values().collect()),
        started.elapsed().as_secs_f64()
    );
    println!(
        "cpu: vkd-slurm {:.1}s ({:.0} ms a Pod), slurmctld {:.1}s",
        cpu(plugin.id()) - plugin_cpu0,
        (cpu(plugin.id()) - plugin_cpu0) * 1000.0 / pods as f64,
        cpu(ctld) - ctld_cpu0
    );
    let _ = plugin.kill();
    let _ = plugin.wait();
    drop(cluster);
    let _ = std::fs::remove_dir_all(&dir);
}
