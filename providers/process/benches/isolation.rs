//! What namespaces and a Pod network cost a Pod on the process provider,
//! against host processes:
//! for N Pods (default 100, `VKD_BENCH_PODS`), created one after another, the
//! time from `create` to the container's program running (it writes a file
//! when it starts), p50 and p99, and the memory of each Pod's processes (the
//! shim, the launcher that waits with namespaces, the program) as PSS. The
//! network row adds a network namespace and an IP per Pod through the
//! standard CNI plugins (bridge, host-local, portmap; `e2e/cluster build-cni`).
//!
//! `cargo bench -p vkd-process --bench isolation` (as root: namespaces need
//! it; otherwise only host mode is measured). docs/process-provider.md keeps
//! the figures.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use vkd_process::config::{ImageMap, IsolationMode, NetworkConfig};
use vkd_process::{ProcessConfig, ProcessProvider};
use vkd_provider::conformance::sample_spec;
use vkd_provider::{ContainerSpec, Fence, Mount, Provider, Volume, VolumeSource};

fn config(isolation: IsolationMode, network: Option<NetworkConfig>) -> ProcessConfig {
    ProcessConfig {
        network,
        images: vec![ImageMap {
            pattern: "busybox*".into(),
            path: None,
            entrypoint: vec![],
            args: vec![],
            files: Default::default(),
        }],
        cgroup_parent: "none".into(),
        isolation,
        ..Default::default()
    }
}

/// Proportional set size of process `pid`, in bytes.
fn pss(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup"))
        .ok()
        .and_then(|t| {
            t.lines()
                .find(|l| l.starts_with("Pss:"))?
                .split_whitespace()
                .nth(1)?
                .parse::<u64>()
                .ok()
        })
        .map_or(0, |kb| kb * 1024)
}

/// Every process whose command line mentions `needle`, with its descendants.
fn processes_under(needle: &str) -> Vec<u32> {
    let mut all: Vec<(u32, u32, String)> = Vec::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        let ppid = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse().ok())
            .unwrap_or(0);
        let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        all.push((pid, ppid, String::from_utf8_lossy(&cmd).replace('\0', " ")));
    }
    let mut found: Vec<u32> = all
        .iter()
        .filter(|(_, _, c)| c.contains(needle))
        .map(|(p, _, _)| *p)
        .collect();
    let mut i = 0;
    while i < found.len() {
        let parent = found[i];
        for (p, pp, _) in &all {
            if *pp == parent && !found.contains(p) {
                found.push(*p);
            }
        }
        i += 1;
    }
    found
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted.get(i).copied().unwrap_or_default()
}

struct Figures {
    mode: &'static str,
    p50: Duration,
    p99: Duration,
    pss_per_pod: u64,
    processes_per_pod: f64,
}

/// A network for the bench's Pods: a bridge of its own and a /16.
fn network(dir: &Path) -> Option<(NetworkConfig, String)> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../e2e/cluster");
    let out = std::process::Command::new(script)
        .arg("build-cni")
        .output()
        .ok()?;
    if !out.status.success() {
        eprintln!(
            "no CNI plugins: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
        return None;
    }
    let bin = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    let bridge = format!("vkb{:x}", std::process::id() & 0xfffff);
    std::fs::create_dir_all(dir).ok()?;
    let conf = dir.join("pods.conflist");
    let list = format!(
        r#"{{"cniVersion": "1.0.0", "name": "vkd-bench", "plugins": [
            {{"type": "bridge", "bridge": "{bridge}", "isGateway": true, "isDefaultGateway": true,
              "ipam": {{"type": "host-local", "ranges": [[{{"subnet": "10.177.0.0/16"}}]],
                        "dataDir": "{}"}}}},
            {{"type": "portmap", "capabilities": {{"portMappings": true}}}}]}}"#,
        dir.join("ipam").display()
    );
    std::fs::write(&conf, list).ok()?;
    Some((
        NetworkConfig {
            cni_config: conf,
            cni_bin_dir: bin,
            plugin_timeout_seconds: None,
        },
        bridge,
    ))
}

async fn measure(
    mode: IsolationMode,
    with_network: bool,
    pods: usize,
    shim: &Path,
) -> Option<Figures> {
    let dir = std::env::temp_dir().join(format!("vkd-bench-{}", uuid_like()));
    let (net, bridge) = match with_network {
        true => {
            let (n, b) = network(&dir.join("net"))?;
            (Some(n), Some(b))
        }
        false => (None, None),
    };
    let p = match ProcessProvider::open(config(mode, net), &dir, shim.to_owned()) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("{mode:?}: {e}");
            return None;
        }
    };
    let name = match (p.isolation_mode(), with_network) {
        ("namespaces", true) => "namespaces+cni",
        (m, _) => m,
    };
    let fence = Fence {
        node: "bench".into(),
        epoch: 1,
    };
    let mut took = Vec::with_capacity(pods);
    for n in 0..pods {
        let uid = format!("bench-{n}");
        let mut s = sample_spec("bench", &uid);
        // The marker goes to an emptyDir, which the host sees in the sandbox
        // whatever the isolation (a container never sees the sandbox).
        s.volumes = vec![Volume {
            name: "mark".into(),
            source: VolumeSource::EmptyDir {
                size_limit: None,
                memory: false,
            },
        }];
        s.containers = vec![ContainerSpec {
            name: "main".into(),
            image: "busybox".into(),
            command: vec![
                "sh".into(),
                "-c".into(),
                "touch \"$VKD_POD_ROOT/mark/started\"; exec sleep 3600".into(),
            ],
            mounts: vec![Mount {
                volume: "mark".into(),
                path: "/mark".into(),
                sub_path: None,
                read_only: false,
            }],
            ..Default::default()
        }];
        let marker = dir.join("pods").join(&uid).join("volumes/mark/started");
        let begin = Instant::now();
        if let Err(e) = p.create(&fence, &s).await {
            eprintln!("{name}: create {uid}: {e}");
            return None;
        }
        while !marker.exists() {
            if begin.elapsed() > Duration::from_secs(30) {
                eprintln!("{name}: {uid} did not start in 30 s");
                return None;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        took.push(begin.elapsed());
    }
    let pids = processes_under(&dir.display().to_string());
    let pss: u64 = pids.iter().map(|p| pss(*p)).sum();
    for n in 0..pods {
        let _ = p
            .delete(&fence, &format!("bench-{n}"), Duration::from_secs(1))
            .await;
    }
    for _ in 0..200 {
        if processes_under(&dir.display().to_string()).is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    drop(p);
    if let Some(b) = bridge {
        let _ = std::process::Command::new("ip")
            .args(["link", "del", &b])
            .output();
        let _ = rustix::mount::unmount(dir.join("netns"), rustix::mount::UnmountFlags::DETACH);
    }
    let _ = std::fs::remove_dir_all(&dir);
    took.sort();
    Some(Figures {
        mode: name,
        p50: percentile(&took, 0.5),
        p99: percentile(&took, 0.99),
        pss_per_pod: pss / pods as u64,
        processes_per_pod: pids.len() as f64 / pods as f64,
    })
}

fn uuid_like() -> String {
    format!(
        "{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos())
    )
}

fn main() {
    let pods: usize = std::env::var("VKD_BENCH_PODS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100);
    let shim = PathBuf::from(env!("CARGO_BIN_EXE_vkd-process-shim"));
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("no runtime: {e}");
            std::process::exit(1);
        }
    };
    let mut rows = Vec::new();
    for (mode, with_network) in [
        (IsolationMode::Host, false),
        (IsolationMode::Namespaces, false),
        (IsolationMode::Namespaces, true),
    ] {
        if let Some(f) = runtime.block_on(measure(mode, with_network, pods, &shim)) {
            rows.push(f);
        }
    }
    println!("{pods} Pods, one after another: create → program running, and each Pod's processes");
    println!(
        "{:<15} {:>10} {:>10} {:>14} {:>16}",
        "isolation", "p50", "p99", "PSS per Pod", "processes/Pod"
    );
    for f in rows {
        println!(
            "{:<15} {:>8.1}ms {:>8.1}ms {:>11.2} MiB {:>16.1}",
            f.mode,
            f.p50.as_secs_f64() * 1e3,
            f.p99.as_secs_f64() * 1e3,
            f.pss_per_pod as f64 / (1 << 20) as f64,
            f.processes_per_pod
        );
    }
}
