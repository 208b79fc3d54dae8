//! End-to-end: DRA on the real control plane and scheduler. vkd publishes a
//! 4+4 fleet's GPUs as ResourceSlices; the scheduler allocates claims on them
//! (and refuses the ones no host can hold, before binding); vkd runs each Pod
//! on exactly the allocated GPUs and says so on the claim.

use std::collections::{BTreeMap, BTreeSet};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use serde_json::Value;
use vkd_e2e::{Cluster, Suite, at, condition, repo_root, wait_for};

mod common;
use common::{Vkd, admin_get, items, metric, running_and_ready, str_at, users_client_ca};

fn main() -> ExitCode {
    Suite::new("dra", &[]).run(&[
        (
            "aggregate_node_runs_claims_on_exactly_the_allocated_gpus",
            aggregate,
        ),
        (
            "per_host_nodes_serve_plain_gpu_pods_and_follow_capacity_across_a_restart",
            per_host,
        ),
        (
            "a_backend_refusal_before_binding_sends_the_pod_to_another_node",
            refusal,
        ),
        (
            "partitions_and_their_gpu_are_never_both_allocated_and_an_unhealthy_gpu_leaves_the_pool",
            partitions,
        ),
    ])
}

/// The manifests' DeviceClasses (the tests apply them side by side: a lost
/// race to create one is tried again).
fn device_classes(c: &Cluster) -> Result<()> {
    let dir = repo_root().join("manifests/dra").display().to_string();
    wait_for("the DeviceClasses applied", Duration::from_secs(30), || {
        Ok(c.kubectl(&["apply", "-k", &dir]).ok().map(|_| ()))
    })
}

/// A ResourceClaimTemplate for `count` GPUs; `constraints` are matchAttribute names.
fn template(ns: &str, name: &str, count: u32, constraints: &[&str], cel: Option<&str>) -> String {
    class_template(ns, name, "gpu.vkd.io", count, constraints, cel)
}

/// [`template`] for devices of `class`.
fn class_template(
    ns: &str,
    name: &str,
    class: &str,
    count: u32,
    constraints: &[&str],
    cel: Option<&str>,
) -> String {
    let constraints: String = constraints
        .iter()
        .map(|a| format!("\n      - {{requests: [gpus], matchAttribute: {a}}}"))
        .collect();
    let selectors = cel
        .map(|e| format!("\n          selectors: [{{cel: {{expression: {e:?}}}}}]"))
        .unwrap_or_default();
    format!(
        r#"
apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {{name: {name}, namespace: {ns}}}
spec:
  spec:
    devices:
      requests:
      - name: gpus
        exactly:
          deviceClassName: {class}
          count: {count}{selectors}
      constraints: {}{constraints}
"#,
        if constraints.is_empty() { "[]" } else { "" }
    )
}

fn claim_pod(ns: &str, name: &str, selector: &str, template: &str) -> String {
    claim_pod_with(ns, name, selector, template, "{}", "{}")
}

/// [`claim_pod`] with annotations and CPU/memory requests (YAML flow maps).
fn claim_pod_with(
    ns: &str,
    name: &str,
    selector: &str,
    template: &str,
    annotations: &str,
    requests: &str,
) -> String {
    format!(
        r#"
apiVersion: v1
kind: Pod
metadata: {{name: {name}, namespace: {ns}, annotations: {annotations}}}
spec:
  nodeSelector: {{vkd.io/e2e: {selector}}}
  tolerations: [{{key: virtual-kubelet.io/provider, operator: Exists}}]
  resourceClaims: [{{name: gpus, resourceClaimTemplateName: {template}}}]
  containers:
  - name: train
    image: example/train:1
    resources: {{claims: [{{name: gpus}}], requests: {requests}}}
"#
    )
}

fn plain_gpu_pod(ns: &str, name: &str, selector: &str, gpus: u32) -> String {
    format!(
        r#"
apiVersion: v1
kind: Pod
metadata: {{name: {name}, namespace: {ns}}}
spec:
  nodeSelector: {{vkd.io/e2e: {selector}}}
  tolerations: [{{key: virtual-kubelet.io/provider, operator: Exists}}]
  containers:
  - name: train
    image: example/train:1
    resources: {{limits: {{nvidia.com/gpu: {gpus}}}}}
"#
    )
}

fn slices(c: &Cluster, node: &str) -> Result<Vec<Value>> {
    let list = c.kubectl_json(&[
        "get",
        "resourceslices",
        "--field-selector",
        &format!("spec.nodeName={node}"),
    ])?;
    Ok(items(&list))
}

fn wait_ready(c: &Cluster, ns: &str, name: &str) -> Result<Value> {
    wait_for(&format!("{name} Ready"), Duration::from_secs(90), || {
        let p = c.kubectl_json(&["get", "pod", name, "-n", ns])?;
        Ok(running_and_ready(&p).then_some(p))
    })
}

/// Each instance's host and GPU ids, by Pod UID.
type Instances = BTreeMap<String, (String, BTreeSet<String>)>;

fn instances(vkd: &Vkd, node: &str) -> Result<Instances> {
    Ok(vkd
        .instances_on(node)?
        .iter()
        .map(|i| {
            let gpus = i["gpus"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|g| g.as_str().map(str::to_owned))
                .collect();
            (
                str_at(i, "podUID").to_owned(),
                (str_at(i, "host").to_owned(), gpus),
            )
        })
        .collect())
}

/// The devices each claim of a namespace was allocated, by claim name.
fn allocations(c: &Cluster, ns: &str) -> Result<BTreeMap<String, BTreeSet<String>>> {
    let claims = c.kubectl_json(&["get", "resourceclaims", "-n", ns])?;
    Ok(items(&claims)
        .iter()
        .map(|cl| {
            let devices = at(cl, "status.allocation.devices.results")
                .as_array()
                .into_iter()
                .flatten()
                .map(|r| str_at(r, "device").to_owned())
                .collect();
            (str_at(cl, "metadata.name").to_owned(), devices)
        })
        .collect())
}

/// The names of a Pod's claims, its own and the scheduler's for extended resources.
fn claim_names(pod: &Value) -> Vec<String> {
    let mut names: Vec<String> = at(pod, "status.resourceClaimStatuses")
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|s| s["resourceClaimName"].as_str().map(str::to_owned))
        .collect();
    if let Some(n) = at(pod, "status.extendedResourceClaimStatus.resourceClaimName").as_str() {
        names.push(n.to_owned());
    }
    names
}

/// Checks a running Pod's instance holds exactly its allocated devices (the
/// sim's GPU ids are the device names), all on the instance's host.
fn holds_allocation(
    pod: &Value,
    claims: &BTreeMap<String, BTreeSet<String>>,
    instances: &Instances,
) -> Result<BTreeSet<String>> {
    let name = str_at(pod, "metadata.name");
    let want: BTreeSet<String> = claim_names(pod)
        .iter()
        .flat_map(|n| claims.get(n).cloned().unwrap_or_default())
        .collect();
    let (host, gpus) = instances
        .get(str_at(pod, "metadata.uid"))
        .with_context(|| format!("no instance for {name}"))?;
    ensure!(
        *gpus == want,
        "{name}: instance on {host} has GPUs {gpus:?}, its claims hold {want:?}"
    );
    ensure!(
        !want.is_empty() && want.iter().all(|d| d.starts_with(host.as_str())),
        "{name}: devices {want:?} are not all on {host}"
    );
    Ok(want)
}

fn runs_on_allocation(c: &Cluster, vkd: &Vkd, ns: &str, pod: &Value) -> Result<BTreeSet<String>> {
    let node = str_at(pod, "spec.nodeName");
    holds_allocation(pod, &allocations(c, ns)?, &instances(vkd, node)?)
}

fn aggregate(c: &Cluster) -> Result<()> {
    device_classes(c)?;
    let fleet = repo_root().join("testdata/fleets/dra.yaml");
    let vkd = Vkd::start_provider(
        c,
        "vk-dra",
        "sim",
        &fleet,
        &["--node-label", "vkd.io/e2e=dra", "--dra", "true"],
    )?;
    let ns = c.namespace("dra-agg")?;
    let published = wait_for("two pools of 4 devices", Duration::from_secs(60), || {
        let s = slices(c, "vk-dra")?;
        let devices: usize = s
            .iter()
            .map(|s| at(s, "spec.devices").as_array().map_or(0, Vec::len))
            .sum();
        Ok((s.len() == 2 && devices == 8).then_some(s))
    })?;
    let pools: BTreeSet<&str> = published
        .iter()
        .map(|s| str_at(s, "spec.pool.name"))
        .collect();
    ensure!(
        pools == BTreeSet::from(["vk-dra-host-a", "vk-dra-host-b"]),
        "{pools:?}"
    );
    let owner = &at(&published[0], "metadata.ownerReferences")[0];
    ensure!(
        owner["kind"] == "Node" && owner["name"] == "vk-dra",
        "{owner}"
    );
    let node = c.kubectl_json(&["get", "node", "vk-dra"])?;
    ensure!(
        at(&node, "status.capacity").get("nvidia.com/gpu").is_none(),
        "the GPUs are counted twice: {}",
        at(&node, "status.capacity")
    );

    // A Pod bound here past the scheduler asks for `nvidia.com/gpu`, which
    // this node lists none of: refused at admission, as a kubelet refuses a
    // resource it has none of, never queued for GPUs it cannot be given.
    c.apply(&format!(
        r#"
apiVersion: v1
kind: Pod
metadata: {{name: pinned, namespace: {ns}}}
spec:
  nodeName: vk-dra
  tolerations: [{{key: virtual-kubelet.io/provider, operator: Exists}}]
  containers:
  - name: train
    image: example/train:1
    resources: {{limits: {{nvidia.com/gpu: 1}}}}
"#
    ))?;
    let pinned = wait_for(
        "the pinned GPU Pod to be rejected",
        Duration::from_secs(60),
        || {
            let p = c.kubectl_json(&["get", "pod", "pinned", "-n", &ns])?;
            Ok((str_at(&p, "status.phase") == "Failed").then_some(p))
        },
    )?;
    ensure!(
        str_at(&pinned, "status.reason") == "OutOfnvidia.com/gpu"
            && str_at(&pinned, "status.message").contains(
                "Node didn't have enough resource: nvidia.com/gpu, requested: 1, used: 0, capacity: 0"
            ),
        "{}",
        at(&pinned, "status")
    );
    c.kubectl(&["delete", "pod", "pinned", "-n", &ns, "--wait=true"])?;

    // 8 GPUs on one host: the scheduler refuses; nothing is bound or created.
    c.apply(&template(&ns, "eight", 8, &["gpu.vkd.io/host"], None))?;
    c.apply(&claim_pod(&ns, "eight", "dra", "eight"))?;
    let eight = wait_for(
        "the 8-GPU Pod to be Unschedulable",
        Duration::from_secs(60),
        || {
            let p = c.kubectl_json(&["get", "pod", "eight", "-n", &ns])?;
            let refused = condition(&p, "PodScheduled")
                .is_some_and(|c| c["status"] == "False" && c["reason"] == "Unschedulable");
            Ok(refused.then_some(p))
        },
    )?;
    ensure!(str_at(&eight, "spec.nodeName").is_empty());
    let why = str_at(
        condition(&eight, "PodScheduled").unwrap_or(&Value::Null),
        "message",
    )
    .to_owned();
    ensure!(why.contains("cannot allocate all claims"), "{why}");

    // 4 on one host, in one NVLink domain: it runs on exactly those GPUs.
    c.apply(&template(
        &ns,
        "four",
        4,
        &["gpu.vkd.io/host", "gpu.vkd.io/nvlinkDomain"],
        Some("device.attributes['gpu.vkd.io'].productName == 'H100-SXM5-80GB'"),
    ))?;
    c.apply(&claim_pod(&ns, "four", "dra", "four"))?;
    let four = wait_ready(c, &ns, "four")?;
    let held = runs_on_allocation(c, &vkd, &ns, &four)?;
    ensure!(held.len() == 4, "{held:?}");
    let claim_name = str_at(
        &at(&four, "status.resourceClaimStatuses")[0],
        "resourceClaimName",
    );
    let claim = wait_for("the claim's device status", Duration::from_secs(30), || {
        let cl = c.kubectl_json(&["get", "resourceclaim", claim_name, "-n", &ns])?;
        let n = at(&cl, "status.devices").as_array().map_or(0, Vec::len);
        Ok((n == 4).then_some(cl))
    })?;
    let device = &at(&claim, "status.devices")[0];
    ensure!(
        held.contains(device["data"]["uuid"].as_str().unwrap_or_default())
            && device["conditions"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|c| c["type"] == "Ready" && c["status"] == "True"),
        "{device}"
    );
    ensure!(
        vkd.instances()?
            .iter()
            .all(|i| str_at(i, "name") != "eight"),
        "the refused Pod reached the backend"
    );

    // A plain `nvidia.com/gpu: 1` Pod, through the DeviceClass's extended resource.
    c.apply(&plain_gpu_pod(&ns, "plain", "dra", 1))?;
    let plain = wait_ready(c, &ns, "plain")?;
    ensure!(
        !str_at(
            &plain,
            "status.extendedResourceClaimStatus.resourceClaimName"
        )
        .is_empty(),
        "{}",
        at(&plain, "status")
    );
    let plain_gpus = runs_on_allocation(c, &vkd, &ns, &plain)?;
    ensure!(
        plain_gpus.len() == 1 && plain_gpus.is_disjoint(&held),
        "{plain_gpus:?} {held:?}"
    );

    // A Pod bound by name, past the scheduler: its claim is never allocated,
    // and it never runs; it waits with the kubelet's Event.
    c.apply(
        &claim_pod(&ns, "unallocated", "dra", "four")
            .replace("  containers:", "  nodeName: vk-dra\n  containers:"),
    )?;
    let event = wait_for(
        "a FailedPrepareDynamicResources Event",
        Duration::from_secs(60),
        || {
            let ev = c.kubectl_json(&[
                "get",
                "events",
                "-n",
                &ns,
                "--field-selector",
                "involvedObject.name=unallocated,reason=FailedPrepareDynamicResources",
            ])?;
            Ok(items(&ev).first().map(|e| str_at(e, "message").to_owned()))
        },
    )?;
    ensure!(
        event.starts_with("Failed to prepare dynamic resources: ")
            && (event.contains("ResourceClaim") || event.contains("no claim made")),
        "{event}"
    );
    let unallocated = c.kubectl_json(&["get", "pod", "unallocated", "-n", &ns])?;
    ensure!(
        at(&unallocated, "status.phase") == "Pending"
            && vkd
                .instances()?
                .iter()
                .all(|i| str_at(i, "name") != "unallocated"),
        "a Pod whose claim is not allocated ran: {}",
        at(&unallocated, "status")
    );

    // The metrics count the pools' devices and the answers before binding.
    let (_, text) = admin_get(&vkd, "/metrics")?;
    ensure!(
        metric(&text, "vkd_dra_devices{pool=\"vk-dra-host-a\"}") == Some(4.0),
        "{}",
        text.lines()
            .filter(|l| l.contains("dra"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    ensure!(
        metric(
            &text,
            "vkd_dra_admissions_before_binding_total{pool=\"vk-dra-host-a\",answer=\"reserved\"}"
        )
        .is_some_and(|n| n >= 1.0),
        "{}",
        text.lines()
            .filter(|l| l.contains("dra"))
            .collect::<Vec<_>>()
            .join("\n")
    );

    // Random claims: every allocation the scheduler makes is one vkd runs on
    // exactly those devices, and no device is ever held twice.
    c.kubectl(&[
        "delete",
        "pod",
        "four",
        "plain",
        "eight",
        "unallocated",
        "-n",
        &ns,
        "--wait=true",
    ])?;
    let queued = queue_before_binding(c, &ns)?;
    let rounds = random_claims(c, &vkd, &ns)?;
    eprintln!(
        "aggregate: 8-GPU claim Unschedulable ({why}); 4-GPU claim ran on {held:?}; plain nvidia.com/gpu: 1 on {plain_gpus:?}; random claims: {rounds}; {queued}"
    );
    c.kubectl(&["delete", "namespace", &ns, "--wait=true", "--timeout=90s"])?;
    Ok(())
}

/// Rounds of random claims against the fleet: each round creates a batch of
/// Pods with random counts (1-8), constraints (host always, and at random the
/// NVLink domain or the PCIe root) and CEL selectors, waits until each runs or
/// is refused by the scheduler, checks every running one, and deletes them.
fn random_claims(c: &Cluster, vkd: &Vkd, ns: &str) -> Result<String> {
    const ROUNDS: usize = 17;
    const PER_ROUND: usize = 12;
    let mut rng = fastrand::Rng::with_seed(36);
    let (mut ran, mut refused) = (0, 0);
    for round in 0..ROUNDS {
        let mut yaml = String::new();
        for i in 0..PER_ROUND {
            let count = rng.u32(1..=8);
            let mut constraints = vec!["gpu.vkd.io/host"];
            match rng.u8(0..3) {
                0 => constraints.push("gpu.vkd.io/nvlinkDomain"),
                1 => constraints.push("gpu.vkd.io/pcieRoot"),
                _ => {}
            }
            let cel = match rng.u8(0..3) {
                0 => Some("device.attributes['gpu.vkd.io'].productName == 'H100-SXM5-80GB'"),
                1 => Some("device.capacity['gpu.vkd.io'].memory.compareTo(quantity('40Gi')) >= 0"),
                _ => None,
            };
            let name = format!("r{round}-{i}");
            yaml.push_str(&template(ns, &name, count, &constraints, cel));
            yaml.push_str("---");
            yaml.push_str(&claim_pod(ns, &name, "dra", &name));
            yaml.push_str("---");
        }
        c.apply(&yaml)?;
        let settled = wait_for(
            "every random Pod to run or wait unscheduled",
            Duration::from_secs(120),
            || {
                let pods = c.kubectl_json(&["get", "pods", "-n", ns])?;
                let pods = items(&pods);
                let done = pods.iter().all(|p| {
                    running_and_ready(p)
                        || condition(p, "PodScheduled").is_some_and(|c| c["status"] == "False")
                });
                Ok((done && pods.len() == PER_ROUND).then_some(pods))
            },
        )?;
        let claims = allocations(c, ns)?;
        let instances = instances(vkd, "vk-dra")?;
        let mut held: BTreeMap<String, String> = BTreeMap::new();
        for p in &settled {
            let name = str_at(p, "metadata.name").to_owned();
            if !running_and_ready(p) {
                ensure!(str_at(p, "spec.nodeName").is_empty(), "{name} waits bound");
                refused += 1;
                continue;
            }
            for gpu in holds_allocation(p, &claims, &instances)? {
                if let Some(other) = held.insert(gpu.clone(), name.clone()) {
                    anyhow::bail!("{gpu} is held by {other} and {name}");
                }
            }
            ran += 1;
        }
        c.kubectl(&["delete", "pods", "--all", "-n", ns, "--wait=true"])?;
        c.kubectl(&["delete", "resourceclaimtemplates", "--all", "-n", ns])?;
    }
    // The last round's claims are deallocated and deleted after their Pods:
    // what comes next starts on a fleet the scheduler sees free.
    wait_for("the random claims gone", Duration::from_secs(60), || {
        let claims = c.kubectl_json(&["get", "resourceclaims", "-n", ns])?;
        Ok(items(&claims).is_empty().then_some(()))
    })?;
    Ok(format!(
        "{} claims in {ROUNDS} rounds: {ran} ran on exactly their devices, {refused} waited unbound, no device held twice",
        ROUNDS * PER_ROUND
    ))
}

/// A backend that must queue says so before binding: a GPU the scheduler
/// sees free, on a host whose CPU the backend has given away. The Pod stays
/// unbound with `BackendReserved=False`, then binds and runs when the CPU frees.
fn queue_before_binding(c: &Cluster, ns: &str) -> Result<String> {
    let on_a = Some("device.attributes['gpu.vkd.io'].host == 'host-a'");
    c.apply(&template(ns, "one-on-a", 1, &[], on_a))?;
    c.apply(&claim_pod_with(
        ns,
        "hog",
        "dra",
        "one-on-a",
        "{}",
        "{cpu: \"24\"}",
    ))?;
    wait_ready(c, ns, "hog")?;
    c.apply(&claim_pod_with(
        ns,
        "waiter",
        "dra",
        "one-on-a",
        "{}",
        "{cpu: \"24\"}",
    ))?;
    let claim = wait_for(
        "the waiter's claim to say BackendReserved=False",
        Duration::from_secs(60),
        || {
            let p = c.kubectl_json(&["get", "pod", "waiter", "-n", ns])?;
            let Some(name) = claim_names(&p).into_iter().next() else {
                return Ok(None);
            };
            let cl = c.kubectl_json(&["get", "resourceclaim", &name, "-n", ns])?;
            let reserved = at(&cl, "status.devices")[0]["conditions"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|c| c["type"] == "vkd.io/BackendReserved")
                .cloned();
            Ok(reserved
                .filter(|r| r["status"] == "False" && r["reason"] == "BackendQueued")
                .map(|r| (p, r)))
        },
    )?;
    let (waiter, reserved) = claim;
    ensure!(
        str_at(&waiter, "spec.nodeName").is_empty(),
        "a queued Pod was bound to {}",
        str_at(&waiter, "spec.nodeName")
    );
    let message = str_at(&reserved, "message").to_owned();
    ensure!(message.contains("cpu"), "{message}");
    let freed = Instant::now();
    c.kubectl(&["delete", "pod", "hog", "-n", ns, "--wait=true"])?;
    let waiter = wait_ready(c, ns, "waiter")?;
    ensure!(str_at(&waiter, "spec.nodeName") == "vk-dra");
    c.kubectl(&["delete", "pod", "waiter", "-n", ns, "--wait=true"])?;
    Ok(format!(
        "queue before binding: waiter unbound with BackendReserved=False ({message}), Ready {:.1}s after the CPU freed",
        freed.elapsed().as_secs_f64()
    ))
}

/// A backend that refuses sends the Pod back to the scheduler: on a per-host
/// fleet, a Pod that wants its 3 GPUs in one NVLink domain (vkd's own
/// annotation, which the scheduler does not read) is allocated on host-b,
/// whose domains hold 2; vkd rejects it before binding, and once host-a has
/// room the scheduler places it there.
fn refusal(c: &Cluster) -> Result<()> {
    device_classes(c)?;
    let fleet = repo_root().join("testdata/fleets/dra.yaml");
    let vkd = Vkd::start_provider(
        c,
        "vk-drr",
        "sim",
        &fleet,
        &[
            "--node-label",
            "vkd.io/e2e=drr",
            "--node-mode",
            "per-host",
            "--dra",
            "true",
            "--client-ca-file",
            c.env("VKD_E2E_KUBELET_CLIENT_CA")?,
        ],
    )?;
    let ns = c.namespace("dra-refuse")?;
    for node in ["vk-drr-host-a", "vk-drr-host-b"] {
        wait_for(&format!("{node}'s pool"), Duration::from_secs(60), || {
            Ok((slices(c, node)?.len() == 1).then_some(()))
        })?;
    }
    let on = |h: &str| format!("device.attributes['gpu.vkd.io'].host == '{h}'");
    c.apply(&template(&ns, "two-on-a", 2, &[], Some(&on("host-a"))))?;
    c.apply(&claim_pod(&ns, "hog-a", "drr", "two-on-a"))?;
    wait_ready(c, &ns, "hog-a")?;
    // Only host-b has 3 free GPUs: the scheduler allocates there, vkd refuses.
    c.apply(&template(&ns, "three", 3, &["gpu.vkd.io/host"], None))?;
    c.apply(&claim_pod_with(
        &ns,
        "picky",
        "drr",
        "three",
        "{vkd.io/gpu-topology: nvlink}",
        "{}",
    ))?;
    let refused = wait_for("a BackendRejected Event", Duration::from_secs(60), || {
        let ev = c.kubectl_json(&[
            "get",
            "events",
            "-n",
            &ns,
            "--field-selector",
            "involvedObject.name=picky,reason=BackendRejected",
        ])?;
        Ok(items(&ev).first().map(|e| str_at(e, "message").to_owned()))
    })?;
    ensure!(refused.contains("TopologyUnsatisfiable"), "{refused}");
    let picky = c.kubectl_json(&["get", "pod", "picky", "-n", &ns])?;
    ensure!(
        str_at(&picky, "spec.nodeName").is_empty(),
        "a refused Pod was bound to {}",
        str_at(&picky, "spec.nodeName")
    );
    ensure!(
        instances(&vkd, "vk-drr-host-b")?.is_empty(),
        "the refused Pod reached host-b's backend"
    );
    // host-b fills up, host-a frees: the scheduler tries again, on host-a.
    c.apply(&template(&ns, "two-on-b", 2, &[], Some(&on("host-b"))))?;
    c.apply(&claim_pod(&ns, "hog-b", "drr", "two-on-b"))?;
    wait_ready(c, &ns, "hog-b")?;
    c.kubectl(&["delete", "pod", "hog-a", "-n", &ns, "--wait=true"])?;
    let picky = wait_for("picky Ready", Duration::from_secs(120), || {
        let p = c.kubectl_json(&["get", "pod", "picky", "-n", &ns])?;
        Ok(running_and_ready(&p).then_some(p))
    })?;
    ensure!(str_at(&picky, "spec.nodeName") == "vk-drr-host-a");
    let held = runs_on_allocation(c, &vkd, &ns, &picky)?;
    eprintln!(
        "refusal: picky refused before binding on host-b ({refused}), then ran on vk-drr-host-a with {held:?}"
    );
    c.kubectl(&["delete", "namespace", &ns, "--wait=true", "--timeout=90s"])?;
    Ok(())
}

fn per_host(c: &Cluster) -> Result<()> {
    device_classes(c)?;
    let fleet = c.dir().join("dra-per-host.yaml");
    let original = std::fs::read_to_string(repo_root().join("testdata/fleets/two-by-four.yaml"))?;
    std::fs::write(&fleet, &original)?;
    let args = [
        "--node-label",
        "vkd.io/e2e=drp",
        "--node-mode",
        "per-host",
        "--dra",
        "true",
        "--client-ca-file",
        c.env("VKD_E2E_KUBELET_CLIENT_CA")?,
    ];
    let mut vkd = Vkd::start_provider(c, "vk-drp", "sim", &fleet, &args)?;
    let ns = c.namespace("dra-ph")?;
    for node in ["vk-drp-host-a", "vk-drp-host-b"] {
        let s = wait_for(&format!("{node}'s pool"), Duration::from_secs(60), || {
            let s = slices(c, node)?;
            Ok((s.len() == 1).then_some(s))
        })?;
        ensure!(str_at(&s[0], "spec.pool.name") == node);
        let attrs = &at(&s[0], "spec.devices")[0]["attributes"];
        ensure!(
            attrs.get("resource.kubernetes.io/numaNode").is_some(),
            "per-host devices carry the standard attributes: {attrs}"
        );
    }

    // An unchanged `nvidia.com/gpu: 2` Pod is served from the slices.
    c.apply(&plain_gpu_pod(&ns, "plain", "drp", 2))?;
    let plain = wait_ready(c, &ns, "plain")?;
    let held = runs_on_allocation(c, &vkd, &ns, &plain)?;
    ensure!(held.len() == 2, "{held:?}");
    let plain_node = str_at(&plain, "spec.nodeName").to_owned();

    // 6 on one host: no host has 6, until host-b grows to 8 (the plain Pod
    // may hold 2 of them). The time from the
    // backend's change to the Pod bound is the DRA path's whole delay.
    c.apply(&template(&ns, "six", 6, &[], None))?;
    c.apply(&claim_pod(&ns, "six", "drp", "six"))?;
    wait_for("six Unschedulable", Duration::from_secs(60), || {
        let p = c.kubectl_json(&["get", "pod", "six", "-n", &ns])?;
        Ok(condition(&p, "PodScheduled")
            .is_some_and(|c| c["status"] == "False")
            .then_some(()))
    })?;
    let before = generation(c, "vk-drp-host-b")?;
    let changed = Instant::now();
    std::fs::write(
        &fleet,
        original.replacen(
            "- {count: 4, model: H100-SXM5-80GB, memory: 80Gi, nvlink_domain: nvl-b",
            "- {count: 8, model: H100-SXM5-80GB, memory: 80Gi, nvlink_domain: nvl-b",
            1,
        ),
    )?;
    let republished = wait_for("host-b's 8 devices", Duration::from_secs(60), || {
        let s = slices(c, "vk-drp-host-b")?;
        let n = at(&s[0], "spec.devices").as_array().map_or(0, Vec::len);
        Ok((n == 8).then(Instant::now))
    })?;
    let after = generation(c, "vk-drp-host-b")?;
    ensure!(after > before, "generation {before} -> {after}");
    let six = wait_ready(c, &ns, "six")?;
    let bound = changed.elapsed();
    ensure!(str_at(&six, "spec.nodeName") == "vk-drp-host-b");
    runs_on_allocation(c, &vkd, &ns, &six)?;

    // SIGKILL of the leader, and a new one: the pools continue at a higher
    // generation, no device is in two slices, the running Pods are adopted and
    // no allocated device is handed out again.
    let gens: Vec<i64> = ["vk-drp-host-a", "vk-drp-host-b"]
        .iter()
        .map(|n| generation(c, n))
        .collect::<Result<_>>()?;
    vkd.kill()?;
    std::fs::write(
        &fleet,
        original
            .replacen(
                "- {count: 4, model: H100-SXM5-80GB, memory: 80Gi, nvlink_domain: nvl-a",
                "- {count: 5, model: H100-SXM5-80GB, memory: 80Gi, nvlink_domain: nvl-a",
                1,
            )
            .replacen(
                "- {count: 4, model: H100-SXM5-80GB, memory: 80Gi, nvlink_domain: nvl-b",
                "- {count: 8, model: H100-SXM5-80GB, memory: 80Gi, nvlink_domain: nvl-b",
                1,
            ),
    )?;
    vkd.spawn()?;
    wait_for(
        "host-a's pool at a higher generation",
        Duration::from_secs(60),
        || Ok((generation(c, "vk-drp-host-a")? > gens[0]).then_some(())),
    )?;
    ensure!(generation(c, "vk-drp-host-b")? >= gens[1]);
    let mut seen = BTreeSet::new();
    for node in ["vk-drp-host-a", "vk-drp-host-b"] {
        for s in slices(c, node)? {
            for d in at(&s, "spec.devices").as_array().into_iter().flatten() {
                let name = format!("{}/{}", str_at(&s, "spec.pool.name"), str_at(d, "name"));
                ensure!(seen.insert(name.clone()), "{name} is in two slices");
            }
        }
    }
    ensure!(seen.len() == 13, "{seen:?}");
    c.apply(&plain_gpu_pod(&ns, "after", "drp", 1))?;
    let after_pod = wait_ready(c, &ns, "after")?;
    let after_gpus = runs_on_allocation(c, &vkd, &ns, &after_pod)?;
    ensure!(
        after_gpus.is_disjoint(&held),
        "{after_gpus:?} was {plain_node}'s {held:?}"
    );
    for (name, p) in [("plain", &plain), ("six", &six)] {
        let now = c.kubectl_json(&["get", "pod", name, "-n", &ns])?;
        ensure!(
            running_and_ready(&now) && str_at(&now, "metadata.uid") == str_at(p, "metadata.uid"),
            "{name} did not survive the restart"
        );
    }
    eprintln!(
        "per-host: plain nvidia.com/gpu: 2 on {plain_node} {held:?}; host-b 4 -> 8 GPUs: slices republished in {:.1}s, the 6-GPU Pod Ready {:.1}s after the change; after SIGKILL the pools went {gens:?} -> higher, 13 devices, none twice",
        (republished - changed).as_secs_f64(),
        bound.as_secs_f64()
    );
    c.kubectl(&["delete", "namespace", &ns, "--wait=true", "--timeout=90s"])?;
    Ok(())
}

/// A claim for `count` partitions of `profile`.
fn partitions_template(ns: &str, name: &str, count: u32, profile: &str) -> String {
    let cel = format!("device.attributes['gpu.vkd.io'].profile == '{profile}'");
    class_template(ns, name, "mig.gpu.vkd.io", count, &[], Some(&cel))
}

/// `vkd explain ARGS` as a user with the cluster's client certificate, asking
/// vkd directly.
fn explain(c: &Cluster, args: &[&str]) -> Result<Vec<u8>> {
    let out = std::process::Command::new(common::VKD)
        .arg("explain")
        .args(args)
        .args(["--direct", "--insecure-skip-tls-verify-kubelet"])
        .env("KUBECONFIG", c.kubeconfig())
        .output()?;
    ensure!(
        out.status.success(),
        "vkd explain {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(out.stdout)
}

fn explain_json(c: &Cluster, args: &[&str]) -> Result<Value> {
    let mut all = args.to_vec();
    all.extend(["-o", "json"]);
    serde_json::from_slice(&explain(c, &all)?).context("vkd explain -o json")
}

fn devices_of(c: &Cluster, node: &str) -> Result<BTreeSet<String>> {
    Ok(slices(c, node)?
        .iter()
        .flat_map(|s| {
            at(s, "spec.devices")
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .map(|d| str_at(&d, "name").to_owned())
        .collect())
}

fn unschedulable(c: &Cluster, ns: &str, name: &str) -> Result<String> {
    wait_for(
        &format!("{name} Unschedulable"),
        Duration::from_secs(60),
        || {
            let p = c.kubectl_json(&["get", "pod", name, "-n", ns])?;
            Ok(condition(&p, "PodScheduled")
                .filter(|c| c["status"] == "False")
                .map(|c| str_at(c, "message").to_owned()))
        },
    )
}

/// MIG-style partitions on the real scheduler: a GPU and its partitions share
/// one counter set, so two 3g.40gb partitions in use leave neither the whole
/// GPU nor a 1g.10gb allocatable (the scheduler says so, nothing is bound or
/// created); the whole GPU runs once they are gone. A GPU the backend marks
/// unhealthy leaves the pool at a higher generation first.
fn partitions(c: &Cluster) -> Result<()> {
    device_classes(c)?;
    let fleet = c.dir().join("dra-mig.yaml");
    let original = std::fs::read_to_string(repo_root().join("testdata/fleets/dra-mig.yaml"))?;
    std::fs::write(&fleet, &original)?;
    let vkd = Vkd::start_provider(
        c,
        "vk-drm",
        "sim",
        &fleet,
        &[
            "--node-label",
            "vkd.io/e2e=drm",
            "--dra",
            "true",
            "--client-ca-file",
            &users_client_ca(c)?,
        ],
    )?;
    let ns = c.namespace("dra-mig")?;
    let all = [
        "host-m-gpu0",
        "host-m-gpu0-1g10gb-0",
        "host-m-gpu0-3g40gb-0",
        "host-m-gpu0-3g40gb-1",
        "host-m-gpu1",
    ];
    wait_for("host-m's 5 devices", Duration::from_secs(60), || {
        Ok(
            (devices_of(c, "vk-drm")? == all.iter().map(|d| (*d).to_owned()).collect())
                .then_some(()),
        )
    })?;
    let counters: Vec<Value> = slices(c, "vk-drm")?
        .iter()
        .flat_map(|s| {
            at(s, "spec.sharedCounters")
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .collect();
    ensure!(
        counters.len() == 1 && str_at(&counters[0], "name") == "host-m-gpu0",
        "one counter set, the partitionable GPU's: {counters:?}"
    );

    // The plain GPU goes unhealthy: it leaves the pool.
    let before = generation(c, "vk-drm")?;
    std::fs::write(
        &fleet,
        original.replacen(
            "  memory: 256Gi\n",
            "  memory: 256Gi\n  unhealthy_gpus: [host-m-gpu1]\n",
            1,
        ),
    )?;
    wait_for(
        "host-m-gpu1 gone from the pool",
        Duration::from_secs(60),
        || Ok((!devices_of(c, "vk-drm")?.contains("host-m-gpu1")).then_some(())),
    )?;
    let after = generation(c, "vk-drm")?;
    ensure!(after > before, "generation {before} -> {after}");

    // Two 3g.40gb partitions run on exactly those partitions.
    c.apply(&partitions_template(&ns, "halves", 2, "3g.40gb"))?;
    c.apply(&claim_pod(&ns, "halves", "drm", "halves"))?;
    let halves = wait_ready(c, &ns, "halves")?;
    let held = runs_on_allocation(c, &vkd, &ns, &halves)?;
    ensure!(
        held == BTreeSet::from([
            "host-m-gpu0-3g40gb-0".to_owned(),
            "host-m-gpu0-3g40gb-1".to_owned()
        ]),
        "{held:?}"
    );
    // Neither the whole GPU nor the 1g.10gb fits beside them.
    c.apply(&template(&ns, "whole", 1, &[], None))?;
    c.apply(&claim_pod(&ns, "whole", "drm", "whole"))?;
    c.apply(&partitions_template(&ns, "small", 1, "1g.10gb"))?;
    c.apply(&claim_pod(&ns, "small", "drm", "small"))?;
    let why = unschedulable(c, &ns, "whole")?;
    unschedulable(c, &ns, "small")?;
    ensure!(
        instances(&vkd, "vk-drm")?.len() == 1,
        "only the partitions' Pod reached the backend"
    );
    // Once they are gone, the whole GPU runs; the 1g.10gb still cannot join it.
    c.kubectl(&[
        "delete",
        "pod",
        "halves",
        "-n",
        &ns,
        "--wait=true",
        "--timeout=60s",
    ])?;
    let whole = wait_ready(c, &ns, "whole")?;
    let held = runs_on_allocation(c, &vkd, &ns, &whole)?;
    ensure!(
        held == BTreeSet::from(["host-m-gpu0".to_owned()]),
        "{held:?}"
    );
    // `vkd explain` shows the claim, its device and binding conditions, the
    // answers before binding, and the pool with what is allocated of it.
    let pod = explain_json(c, &["pod", &format!("{ns}/whole")])?;
    let device = &at(&pod, "claims")[0]["devices"][0];
    ensure!(device["device"] == "host-m-gpu0", "{pod}");
    ensure!(
        device["conditions"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|k| k["type"] == "vkd.io/BackendReserved" && k["status"] == "True"),
        "{device}"
    );
    ensure!(
        at(&pod, "vkd.decisions")
            .as_array()
            .into_iter()
            .flatten()
            .any(|d| d["action"] == "admitted" && str_at(d, "detail").starts_with("before binding")),
        "no answer before binding in vkd's decisions: {}",
        at(&pod, "vkd.decisions")
    );
    let node = explain_json(c, &["node", "vk-drm"])?;
    let pool = &at(&node, "pools")[0];
    ensure!(
        pool["pool"] == "vk-drm-host-m"
            && pool["devices"] == 4
            && pool["counter_sets"] == 1
            && str_at(&pool["allocated"], "host-m-gpu0").starts_with(&format!("{ns}/")),
        "{pool}"
    );
    for what in [format!("{ns}/whole"), format!("{ns}/small")] {
        let text = explain(c, &["pod", &what])?;
        eprintln!(
            "$ vkd explain pod {what}\n{}",
            String::from_utf8_lossy(&text)
        );
    }
    let text = explain(c, &["node", "vk-drm"])?;
    eprintln!(
        "$ vkd explain node vk-drm\n{}",
        String::from_utf8_lossy(&text)
    );
    let small = c.kubectl_json(&["get", "pod", "small", "-n", &ns])?;
    ensure!(
        str_at(&small, "spec.nodeName").is_empty(),
        "a 1g.10gb was bound beside its whole GPU"
    );
    // Published 4 (the unhealthy GPU gone), 1 allocated (the whole GPU's;
    // the partitions' claims went with their Pod).
    wait_for("vkd_dra metrics", Duration::from_secs(60), || {
        let (_, text) = admin_get(&vkd, "/metrics")?;
        let pool = "{pool=\"vk-drm-host-m\"}";
        Ok(
            (metric(&text, &format!("vkd_dra_devices{pool}")) == Some(4.0)
                && metric(&text, &format!("vkd_dra_allocated_devices{pool}")) == Some(1.0))
            .then_some(()),
        )
    })?;
    eprintln!(
        "partitions: host-m-gpu1 unhealthy: pool generation {before} -> {after}; 2x 3g.40gb ran on {:?}; the whole GPU and a 1g.10gb waited ({why}); the whole GPU ran after",
        ["host-m-gpu0-3g40gb-0", "host-m-gpu0-3g40gb-1"]
    );
    c.kubectl(&["delete", "namespace", &ns, "--wait=true", "--timeout=90s"])?;
    Ok(())
}

fn generation(c: &Cluster, node: &str) -> Result<i64> {
    let s = slices(c, node)?;
    s.iter()
        .map(|s| at(s, "spec.pool.generation").as_i64().unwrap_or(0))
        .max()
        .context("no slice")
}
