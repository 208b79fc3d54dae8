//! `vkd explain` as text for a person: sections in the order a question is
//! asked (who owns it, where it went, what vkd decided, what runs, what
//! happens next), and the sources to check each against.

use std::fmt::Write;
use std::time::SystemTime;

use super::gather::{InstanceExplanation, NodeExplanation, PodExplanation};
use crate::explain::{Decision, Slice, time_text};

fn ago(t: SystemTime) -> String {
    match SystemTime::now().duration_since(t) {
        Ok(d) => format!("{} ago", secs(d.as_secs_f64())),
        Err(e) => format!("in {}", secs(e.duration().as_secs_f64())),
    }
}

fn secs(s: f64) -> String {
    if s < 10.0 {
        format!("{s:.1}s")
    } else {
        format!("{s:.0}s")
    }
}

fn decisions(out: &mut String, list: &[Decision]) {
    if list.is_empty() {
        let _ = writeln!(
            out,
            "  (none kept: vkd keeps its last {} decisions, since it started)",
            crate::explain::DECISIONS_KEPT
        );
    }
    for d in list {
        let instance = if d.instance.is_empty() {
            String::new()
        } else {
            format!(" instance {}", d.instance)
        };
        let _ = writeln!(
            out,
            "  {}  {:<8} by {} (epoch {}) on {}{instance}: {}",
            time_text(d.at),
            serde_json::to_value(d.action)
                .ok()
                .and_then(|v| v.as_str().map(str::to_owned))
                .unwrap_or_default(),
            d.replica,
            d.epoch,
            d.node,
            d.detail
        );
    }
}

fn slices(out: &mut String, list: &[Slice]) {
    for s in list {
        let _ = writeln!(
            out,
            "  {:<12} {}/{} GPU free{}{}, {}m CPU free, {} Pods",
            s.host,
            s.gpus_free,
            s.gpus_total,
            if s.gpu_model.is_empty() {
                String::new()
            } else {
                format!(" ({})", s.gpu_model)
            },
            if s.nvlink_free.is_empty() {
                String::new()
            } else {
                format!(", NVLink {}", s.nvlink_free.join(" "))
            },
            s.cpu_millis_free,
            s.pods_running
        );
    }
}

fn sources(out: &mut String, list: &[String]) {
    let _ = writeln!(out, "\nSources:");
    for s in list {
        let _ = writeln!(out, "  {s}");
    }
}

pub(super) fn pod(e: &PodExplanation) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "Pod {} (uid {}), phase {}", e.pod, e.uid, e.phase);
    let _ = writeln!(out, "\nOwners:");
    if e.owners.is_empty() {
        let _ = writeln!(out, "  none: the Pod was created directly");
    }
    for o in &e.owners {
        let _ = writeln!(
            out,
            "  {} {} (uid {}){}",
            o.kind,
            o.name,
            o.uid,
            o.note
                .as_ref()
                .map(|n| format!(": {n}"))
                .unwrap_or_default()
        );
    }
    let _ = writeln!(out, "\nBinding:");
    match &e.binding {
        Some(b) => {
            let _ = writeln!(
                out,
                "  to node {} at {}, by {}",
                b.node,
                b.at.as_deref().unwrap_or("(time unknown)"),
                b.by
            );
        }
        None => {
            let _ = writeln!(out, "  not bound to a node yet");
        }
    }
    if let Some(r) = &e.node_ready {
        let _ = writeln!(out, "  node: {r}");
    }
    if !e.movement.is_empty() {
        let _ = writeln!(out, "\nWhy it is (not) moving:");
        for l in &e.movement {
            let _ = writeln!(out, "  {l}");
        }
    }
    super::dra::render_claims(&mut out, &e.claims);
    match (&e.vkd, &e.vkd_error) {
        (Some(a), _) => {
            let _ = writeln!(
                out,
                "\nvkd ({} backend, node {}, replica {} epoch {} since {}):",
                a.backend,
                a.node,
                a.leadership.replica,
                a.leadership.epoch,
                time_text(a.leadership.since)
            );
            if let Some(w) = &a.waiting {
                let (pos, of) = a.queue_position.unwrap_or((0, 0));
                let _ = writeln!(
                    out,
                    "  waiting in the backend queue (BackendQueued) since {} ({}), {pos} of {of} waiting on this node",
                    time_text(w.since),
                    ago(w.since)
                );
                let _ = writeln!(out, "  admission said: {}", w.reason);
            }
            if let Some(s) = &a.slices {
                let _ = writeln!(
                    out,
                    "  host slices now ({} capacity, observed {}):",
                    s.kind,
                    time_text(s.observed_at)
                );
                slices(&mut out, &s.hosts);
            }
            match &a.reservation {
                Some(r) => {
                    let _ = writeln!(
                        out,
                        "  reservation: host {}{}, {}m CPU{}",
                        r.host,
                        if r.gpu_ids.is_empty() {
                            String::new()
                        } else {
                            format!(", GPUs {}", r.gpu_ids.join(","))
                        },
                        r.cpu_millis,
                        if r.created {
                            " (instance created)"
                        } else {
                            " (not created yet)"
                        }
                    );
                }
                None if a.instance.is_some() => {
                    let _ = writeln!(
                        out,
                        "  reservation: none held (the instance runs; the backend counts it)"
                    );
                }
                None => {}
            }
            match &a.instance {
                Some(i) => {
                    let _ = writeln!(
                        out,
                        "  instance {} ({:?}) on host {}, made under epoch {} at {}{}",
                        i.id,
                        i.phase,
                        i.host.as_deref().unwrap_or("-"),
                        i.epoch,
                        time_text(i.created_at),
                        i.ip.as_ref()
                            .map(|ip| format!(", IP {ip}"))
                            .unwrap_or_default()
                    );
                    for (k, v) in &a.backend_details {
                        let _ = writeln!(out, "    {k}: {v}");
                    }
                }
                None if a.waiting.is_none() => {
                    let _ = writeln!(out, "  instance: none in the backend now");
                }
                None => {}
            }
            if !a.timeline.is_empty() {
                let base = a.timeline[0].at;
                let line: Vec<String> = a
                    .timeline
                    .iter()
                    .map(|s| {
                        let ms = s.at.duration_since(base).map_or(0, |d| d.as_millis());
                        format!("{} +{ms}ms", s.stage)
                    })
                    .collect();
                let _ = writeln!(
                    out,
                    "  timeline: {} (from {})",
                    line.join(", "),
                    time_text(base)
                );
            }
            let p = &a.partition;
            let _ = writeln!(
                out,
                "  partition: policy {}, fence after {}s without a lease renewal, lease renewed {}{}",
                p.policy,
                p.fence_after_seconds,
                p.lease_renewed_seconds_ago
                    .map_or_else(|| "never yet".to_owned(), |s| format!("{} ago", secs(s))),
                if p.fenced {
                    "; instance stopped by the policy"
                } else {
                    ""
                }
            );
            let _ = writeln!(out, "\nDecisions that name it:");
            decisions(&mut out, &a.decisions);
        }
        (None, Some(err)) => {
            let _ = writeln!(out, "\nvkd: not asked or did not answer: {err}");
        }
        (None, None) => {}
    }
    if !e.containers.is_empty() {
        let _ = writeln!(out, "\nContainers:");
        for c in &e.containers {
            let _ = writeln!(
                out,
                "  {}: {}, {} restarts{}",
                c.name,
                c.state,
                c.restarts,
                c.last_exit
                    .as_ref()
                    .map(|l| format!(", last ended with {l}"))
                    .unwrap_or_default()
            );
        }
    }
    if !e.events.is_empty() {
        let _ = writeln!(out, "\nEvents:");
        for ev in &e.events {
            let _ = writeln!(
                out,
                "  {}  {:<7} {:<16} {}: {}",
                ev.at, ev.kind, ev.reason, ev.from, ev.message
            );
        }
    }
    sources(&mut out, &e.sources);
    out
}

pub(super) fn node(e: &NodeExplanation) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "Node {}: {}",
        e.node,
        e.ready.as_deref().unwrap_or("no Ready condition")
    );
    let _ = writeln!(out, "\nAdvertises (capacity / allocatable):");
    for (k, v) in &e.advertised {
        let _ = writeln!(out, "  {k}: {v}");
    }
    if !e.taints.is_empty() {
        let _ = writeln!(out, "  taints: {}", e.taints.join(", "));
    }
    for (k, v) in &e.published {
        let _ = writeln!(out, "  {k}: {v}");
    }
    super::dra::render_pools(&mut out, &e.pools, e.pools_error.as_deref());
    match (&e.vkd, &e.vkd_error) {
        (Some(a), _) => {
            let _ = writeln!(
                out,
                "\nLeader: replica {}, epoch {}, since {}{}",
                a.leadership.replica,
                a.leadership.epoch,
                time_text(a.leadership.since),
                if a.leadership.elected {
                    ""
                } else {
                    " (leader election off)"
                }
            );
            match (&a.capacity, &a.capacity_error) {
                (Some(c), _) => {
                    let free: usize = c.hosts.iter().map(|h| h.gpus_free).sum();
                    let largest = c.hosts.iter().map(|h| h.gpus_free).max().unwrap_or(0);
                    let _ = writeln!(
                        out,
                        "\nWhy: {} {} slices, {} capacity observed {} (refreshed every {}s):",
                        c.hosts.len(),
                        a.host
                            .as_deref()
                            .map_or("host".to_owned(), |h| format!("{h}'s")),
                        c.kind,
                        time_text(c.observed_at),
                        c.refresh_seconds
                    );
                    slices(&mut out, &c.hosts);
                    let sum = |f: fn(&Slice) -> u64, unit: fn(u64) -> String| {
                        let parts: Vec<String> = c
                            .hosts
                            .iter()
                            .map(|h| format!("{} {}", h.host, unit(f(h))))
                            .collect();
                        format!(
                            "{} = {}",
                            unit(c.hosts.iter().map(f).sum()),
                            parts.join(" + ")
                        )
                    };
                    let _ = writeln!(
                        out,
                        "  nvidia.com/gpu {}; {free} free, but one Pod gets at most {largest} (the largest free slice)",
                        sum(|h| h.gpus_total as u64, |n| n.to_string())
                    );
                    let _ = writeln!(
                        out,
                        "  cpu {}",
                        sum(|h| h.cpu_millis_total, |m| format!("{}", m / 1000))
                    );
                    let _ = writeln!(
                        out,
                        "  memory {}",
                        sum(|h| h.memory_bytes_total, |b| format!("{}Gi", b >> 30))
                    );
                }
                (None, Some(err)) => {
                    let _ = writeln!(
                        out,
                        "\nWhy: the backend's capacity could not be read: {err}"
                    );
                }
                (None, None) => {}
            }
            let _ = writeln!(out, "\nReserved by admission:");
            if a.reservations.is_empty() {
                let _ = writeln!(out, "  nothing");
            }
            for r in &a.reservations {
                let _ = writeln!(
                    out,
                    "  {} (uid {}): host {}{}{}",
                    r.pod,
                    r.pod_uid,
                    r.host,
                    if r.gpu_ids.is_empty() {
                        String::new()
                    } else {
                        format!(", GPUs {}", r.gpu_ids.join(","))
                    },
                    if r.created {
                        ", instance created"
                    } else {
                        ", not created yet"
                    }
                );
            }
            let _ = writeln!(out, "\nWaiting (BackendQueued):");
            if a.waiting.is_empty() {
                let _ = writeln!(out, "  nobody");
            }
            for w in &a.waiting {
                let _ = writeln!(
                    out,
                    "  {} since {} ({}): {}",
                    w.pod,
                    time_text(w.since),
                    ago(w.since),
                    w.reason
                );
            }
            let _ = writeln!(
                out,
                "\nBackend: {} instances for {} Pods{}",
                a.instances,
                a.pods,
                a.list_error
                    .as_ref()
                    .map(|e| format!(" (could not list: {e})"))
                    .unwrap_or_default()
            );
            for u in &a.unowned {
                let _ = writeln!(
                    out,
                    "  {} {} of Pod {} (uid {}), epoch {}: {}",
                    u.kind,
                    u.instance.id,
                    u.instance.owner,
                    u.instance.owner.uid,
                    u.instance.epoch,
                    u.action
                );
            }
            let c = &a.collection;
            let _ = writeln!(
                out,
                "  collection: every {}s, last pass {}; brake {} (holds when at least {} orphans are over {:.0}% of the instances{})",
                c.interval_seconds,
                c.last_pass.map_or_else(|| "none yet".to_owned(), ago),
                match &c.braked {
                    Some(why) => format!("HOLDS: {why}"),
                    None => "open".to_owned(),
                },
                c.brake_min_count,
                c.brake_max_fraction * 100.0,
                if c.allow_mass_delete {
                    "; overridden by --gc-allow-mass-delete"
                } else {
                    ""
                }
            );
            let _ = writeln!(
                out,
                "  partition: fence-policy instances stop after {}s without a lease renewal; lease renewed {}",
                a.partition_fence_after_seconds,
                a.lease_renewed_seconds_ago
                    .map_or_else(|| "never yet".to_owned(), |s| format!("{} ago", secs(s)))
            );
            let _ = writeln!(out, "\nRecent removals, fences and brakes:");
            decisions(&mut out, &a.recent);
        }
        (None, Some(err)) => {
            let _ = writeln!(out, "\nvkd did not answer: {err}");
        }
        (None, None) => {}
    }
    sources(&mut out, &e.sources);
    out
}

pub(super) fn instance(e: &InstanceExplanation) -> String {
    let a = &e.vkd;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "Instance {} on node {} ({} backend): {}",
        a.id, a.node, a.backend, a.verdict
    );
    let _ = writeln!(out, "  why: {}", a.why);
    let _ = writeln!(out, "  next: {}", a.action);
    if let Some(i) = &a.instance {
        let _ = writeln!(
            out,
            "  owner: Pod {} (uid {}), phase {:?}, host {}, made under epoch {} at {}",
            i.owner,
            i.owner.uid,
            i.phase,
            i.host.as_deref().unwrap_or("-"),
            i.epoch,
            time_text(i.created_at)
        );
    }
    for (k, v) in &a.backend_details {
        let _ = writeln!(out, "    {k}: {v}");
    }
    let c = &a.collection;
    let _ = writeln!(
        out,
        "  collection: every {}s, last pass {}; brake {}",
        c.interval_seconds,
        c.last_pass.map_or_else(|| "none yet".to_owned(), ago),
        c.braked
            .as_deref()
            .map_or_else(|| "open".to_owned(), |w| format!("HOLDS: {w}"))
    );
    let _ = writeln!(
        out,
        "  asked: replica {}, epoch {}",
        a.leadership.replica, a.leadership.epoch
    );
    let _ = writeln!(out, "\nDecisions that name it or its Pod:");
    decisions(&mut out, &a.decisions);
    sources(&mut out, &e.sources);
    out
}
