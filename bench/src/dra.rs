//! `--dra-writes`: API writes per GPU Pod lifecycle with and without DRA
//! (docs/dra.md). On one cluster, one after another, each with a vkd of its
//! own on a 2 x 32-GPU sim fleet, N Pods of one GPU each are created, run
//! Ready, are deleted and gone:
//! - `plain`: no `--dra`; the Pods ask for `nvidia.com/gpu: 1` from the
//!   Node's capacity;
//! - `extended`: `--dra`; the same Pods, served through the DeviceClass's
//!   extended resource name (the scheduler makes a claim for each);
//! - `claim`: `--dra`; each Pod has a claim from a ResourceClaimTemplate;
//! - `no-binding`: as `extended`, with `--dra-binding-conditions false` (no
//!   answer before binding).
//!
//! Each mode's writes are the API server's `apiserver_request_total` for the
//! write verbs over the mode, by `VERB resource/subresource`, per Pod: every
//! component's writes, not only vkd's. Node status and Lease writes (time,
//! not Pods) are shown apart and left out of the total.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use vkd_e2e::{Cluster, repo_root};

use super::apiserver::ApiScrape;
use super::chain::WRITE_VERBS;
use super::setup::{Role, bench_namespace, cluster_up, vkd_binary};
use super::{Args, Daemon, NAMESPACE};

#[derive(Clone, Copy, Debug)]
enum Mode {
    Plain,
    Extended,
    Claim,
    NoBinding,
}

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Self::Plain => "plain",
            Self::Extended => "extended",
            Self::Claim => "claim",
            Self::NoBinding => "no-binding",
        }
    }
}

fn pod(mode: Mode, i: usize) -> String {
    let resources = match mode {
        Mode::Plain | Mode::Extended | Mode::NoBinding => {
            "{limits: {nvidia.com/gpu: 1}}".to_owned()
        }
        Mode::Claim => "{claims: [{name: gpu}]}".to_owned(),
    };
    let claims = match mode {
        Mode::Claim => "\n  resourceClaims: [{name: gpu, resourceClaimTemplateName: one-gpu}]",
        _ => "",
    };
    let m = mode.name();
    format!(
        "apiVersion: v1\nkind: Pod\nmetadata: {{name: {m}-{i:03}, namespace: {NAMESPACE}, labels: {{bench-dra: {m}}}}}\n\
         spec:\n  nodeSelector: {{vkd.io/bench-dra: {m}}}\n  tolerations: [{{key: virtual-kubelet.io/provider, operator: Exists}}]{claims}\n  \
         containers:\n  - {{name: c, image: example/gpu:1, resources: {resources}}}\n---\n"
    )
}

const TEMPLATE: &str = r#"
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {name: one-gpu, namespace: bench}
spec:
  spec:
    devices:
      requests:
      - {name: gpu, exactly: {deviceClassName: gpu.vkd.io, count: 1}}
"#;

fn count(cluster: &Cluster, what: &[&str]) -> Result<(usize, usize)> {
    let out = cluster.kubectl(what)?;
    let v: serde_json::Value = serde_json::from_str(&out)?;
    let items = v["items"].as_array().cloned().unwrap_or_default();
    let ready = items
        .iter()
        .filter(|p| {
            p["status"]["conditions"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|c| c["type"] == "Ready" && c["status"] == "True")
        })
        .count();
    Ok((items.len(), ready))
}

/// Asks `done` (a kubectl read) every 500 ms until it says yes: slower than
/// the bench's in-memory `wait_until`, so the polls do not load the 2 cores
/// the figures are taken on.
async fn wait(what: &str, limit: Duration, mut done: impl FnMut() -> Result<bool>) -> Result<()> {
    let start = Instant::now();
    while start.elapsed() < limit {
        if done()? {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    bail!("{what}: not done in {}s", limit.as_secs())
}

pub(super) async fn run(args: Args) -> Result<()> {
    let bin = vkd_binary(&args)?;
    let n = args.pods;
    if n == 0 || n > 64 {
        bail!("--dra-writes takes --pods 1 to 64 (the fleet has 64 GPUs)");
    }
    let cluster = cluster_up("bench-dra", &args, &[])?;
    let kubeconfig = cluster.service_account_kubeconfig()?;
    let client = bench_namespace(&cluster).await?;
    cluster.kubectl(&[
        "apply",
        "-k",
        &repo_root().join("manifests/dra").display().to_string(),
    ])?;
    cluster.apply(TEMPLATE)?;
    let fleet = repo_root().join("testdata/fleets/dra-writes.yaml");
    let limit = Duration::from_secs(args.wait_seconds);
    println!(
        "dra-writes: {n} one-GPU Pods per mode, created, Ready, deleted and gone; API writes per Pod from apiserver_request_total (every component), node status and Leases apart; vkd {}",
        bin.display()
    );
    let mut table: BTreeMap<String, [f64; 4]> = BTreeMap::new();
    let mut apart: BTreeMap<String, [f64; 4]> = BTreeMap::new();
    let mut took = [0.0; 4];
    let modes = [Mode::Plain, Mode::Extended, Mode::Claim, Mode::NoBinding];
    for (col, mode) in modes.into_iter().enumerate() {
        let m = mode.name();
        let node = format!("vk-dra-{m}");
        let label = format!("vkd.io/bench-dra={m}");
        let dra = if matches!(mode, Mode::Plain) {
            "false"
        } else {
            "true"
        };
        let binding = if matches!(mode, Mode::NoBinding) {
            "false"
        } else {
            "true"
        };
        let extra = [
            "--node-label",
            &label,
            "--dra",
            dra,
            "--dra-binding-conditions",
            binding,
        ];
        let role = Role {
            node: &node,
            provider: "sim",
            config: fleet.clone(),
            extra: &extra,
        };
        let vkd = Daemon::start_as(&cluster, &bin, &kubeconfig, &args, &role)?;
        wait(&format!("node {node} Ready"), limit, || {
            Ok(cluster
                .kubectl(&[
                    "get",
                    "node",
                    &node,
                    "-o",
                    "jsonpath={.status.conditions[?(@.type=='Ready')].status}",
                ])
                .is_ok_and(|s| s.trim() == "True"))
        })
        .await?;
        if !matches!(mode, Mode::Plain) {
            wait(&format!("{node}'s ResourceSlices"), limit, || {
                let s = cluster.kubectl(&[
                    "get",
                    "resourceslices",
                    "--field-selector",
                    &format!("spec.nodeName={node}"),
                    "-o",
                    "name",
                ])?;
                Ok(s.lines().count() == 2)
            })
            .await?;
        }
        // Let the start's own writes (node status, slices, leases) pass.
        tokio::time::sleep(Duration::from_secs(5)).await;
        let before = ApiScrape::read(&client).await?;
        let started = Instant::now();
        let pods: String = (0..n).map(|i| pod(mode, i)).collect();
        cluster.apply(&pods)?;
        let selector = format!("bench-dra={m}");
        let list = [
            "get", "pods", "-n", NAMESPACE, "-l", &selector, "-o", "json",
        ];
        wait(&format!("{n} {m} Pods Ready"), limit, || {
            Ok(count(&cluster, &list)?.1 == n)
        })
        .await?;
        cluster.kubectl(&[
            "delete",
            "pods",
            "-n",
            NAMESPACE,
            "-l",
            &selector,
            "--wait=false",
        ])?;
        wait(&format!("the {m} Pods gone"), limit, || {
            Ok(count(&cluster, &list)?.0 == 0)
        })
        .await?;
        wait(&format!("the {m} Pods' claims gone"), limit, || {
            Ok(count(
                &cluster,
                &["get", "resourceclaims", "-n", NAMESPACE, "-o", "json"],
            )?
            .0 == 0)
        })
        .await?;
        // The last writes (claim cleanup, vkd's Events) settle.
        tokio::time::sleep(Duration::from_secs(3)).await;
        let after = ApiScrape::read(&client).await?;
        took[col] = started.elapsed().as_secs_f64();
        drop(vkd);
        for (key, v) in &after.requests {
            let verb = key.split(' ').next().unwrap_or_default();
            if !WRITE_VERBS.contains(&verb) {
                continue;
            }
            let delta = v - before.requests.get(key).copied().unwrap_or(0.0);
            if delta <= 0.0 {
                continue;
            }
            let resource = key.split(' ').nth(1).unwrap_or_default();
            let to = if resource.starts_with("leases/") || resource.starts_with("nodes/") {
                &mut apart
            } else {
                &mut table
            };
            to.entry(key.trim_end_matches('/').to_owned()).or_default()[col] = delta / n as f64;
        }
    }
    let row = |name: &str, v: &[f64; 4]| {
        println!(
            "{name:<40} {:>9.2} {:>9.2} {:>9.2} {:>10.2}",
            v[0], v[1], v[2], v[3]
        );
    };
    println!(
        "{:<40} {:>9} {:>9} {:>9} {:>10}",
        "write per Pod (VERB resource)", "plain", "extended", "claim", "no-binding"
    );
    let mut total = [0.0; 4];
    for (key, v) in &table {
        row(key, v);
        for (t, x) in total.iter_mut().zip(v) {
            *t += x;
        }
    }
    row("total", &total);
    for (key, v) in &apart {
        row(&format!("({key}, time-driven)"), v);
    }
    println!(
        "{:<40} {:>8.1}s {:>8.1}s {:>8.1}s {:>9.1}s",
        "mode took (create -> gone)", took[0], took[1], took[2], took[3]
    );
    Ok(())
}
