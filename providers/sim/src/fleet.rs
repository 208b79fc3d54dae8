//! The fleet file: the simulated backend's hosts, latencies and faults.
//!
//! ```yaml
//! capacity: live            # or quota
//! refresh_interval: 10s
//! latency: {admit: 0ms, create: 20ms, start: 300ms, ready: 200ms}
//! faults: {create_error_rate: 0.0, delete_error_rate: 0.0}
//! hosts:
//! - name: host-a
//!   cpu: "64"
//!   memory: 512Gi
//!   max_pods: 110
//!   rdma_domain: rdma-0
//!   gpus:
//!   - {count: 4, model: H100-SXM5-80GB, memory: 80Gi, nvlink_domain: nvl-a, numa_node: 0}
//!   - {count: 1, model: A100-SXM4-80GB, memory: 80Gi, mig: {3g.40gb: 2, 1g.10gb: 7}}
//!   unhealthy_gpus: [host-a-gpu3]   # leaves the host's capacity
//! ```
//! A GPU with `mig` profiles is given whole or as partitions (ids
//! `<gpu id>-<profile without the dot>-<k>`), never both; partitions in use
//! never sum past its compute slices (7 unless `compute_slices` says) or memory.
//! Unknown fields are errors, so a typo never silently changes the fleet.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::Duration;

use serde::Deserialize;
use vkd_provider::{CapacityKind, Gpu, GpuPartition, HostSlice, duration, quantity};

#[derive(Debug, thiserror::Error)]
pub enum FleetError {
    #[error("reading fleet file {path}: {source}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("fleet file {path}: {message}")]
    Parse { path: String, message: String },
    #[error("fleet file {path}: {field}: {message}")]
    Invalid {
        path: String,
        field: String,
        message: String,
    },
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFleet {
    #[serde(default)]
    capacity: Option<String>,
    #[serde(default)]
    refresh_interval: Option<String>,
    #[serde(default)]
    latency: RawLatency,
    #[serde(default)]
    faults: RawFaults,
    hosts: Vec<RawHost>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawLatency {
    admit: Option<String>,
    create: Option<String>,
    start: Option<String>,
    ready: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFaults {
    #[serde(default)]
    create_error_rate: f64,
    #[serde(default)]
    delete_error_rate: f64,
    #[serde(default)]
    unhealthy: bool,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawHost {
    name: String,
    cpu: String,
    memory: String,
    /// Local disk for Pods (the Node's ephemeral-storage), as a quantity.
    #[serde(default)]
    ephemeral_storage: Option<String>,
    #[serde(default)]
    max_pods: Option<u32>,
    #[serde(default)]
    rdma_domain: Option<String>,
    #[serde(default)]
    labels: BTreeMap<String, String>,
    #[serde(default)]
    cached_models: Vec<String>,
    #[serde(default)]
    gpus: Vec<RawGpuGroup>,
    /// GPUs (by id, `<host>-gpu<i>`) the host reports unhealthy: they leave
    /// its capacity, as a device plugin's unhealthy devices leave allocatable.
    #[serde(default)]
    unhealthy_gpus: Vec<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawGpuGroup {
    #[serde(default = "one")]
    count: u32,
    model: String,
    memory: String,
    #[serde(default)]
    nvlink_domain: Option<String>,
    #[serde(default)]
    numa_node: Option<u32>,
    #[serde(default)]
    pcie_root: Option<String>,
    /// MIG-style partitions each GPU of the group offers: profile
    /// (`<compute slices>g.<memory>gb`) -> how many.
    #[serde(default)]
    mig: BTreeMap<String, u32>,
    /// Compute slices a GPU divides into; 7 (as on an A100 or H100) when `mig` is set.
    #[serde(default)]
    compute_slices: Option<u32>,
}

/// `3g.40gb` -> (3 compute slices, 40 GiB).
fn mig_profile(profile: &str) -> Option<(u32, u64)> {
    let (c, m) = profile.split_once("g.")?;
    let m = m.strip_suffix("gb")?;
    let digits = |t: &str| !t.is_empty() && t.len() <= 4 && t.bytes().all(|b| b.is_ascii_digit());
    if !digits(c) || !digits(m) {
        return None;
    }
    Some((c.parse().ok()?, m.parse().ok()?))
}

fn one() -> u32 {
    1
}

/// Delays of each step of an instance's life.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Latency {
    /// Time the admission call takes.
    pub admit: Duration,
    /// Time the create call takes.
    pub create: Duration,
    /// From create until containers run.
    pub start: Duration,
    /// From running until ready.
    pub ready: Duration,
}

#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Faults {
    /// Share of create calls that fail with a transient error.
    pub create_error_rate: f64,
    /// Share of delete calls that fail with a transient error.
    pub delete_error_rate: f64,
    /// The backend reports itself unhealthy.
    pub unhealthy: bool,
}

/// A validated fleet.
#[derive(Clone, Debug)]
pub struct Fleet {
    /// Hosts with everything free.
    pub hosts: Vec<HostSlice>,
    pub kind: CapacityKind,
    pub refresh_interval: Duration,
    pub latency: Latency,
    pub faults: Faults,
    /// The file it was loaded from; the sim reads its hosts again when it changes.
    pub source: Option<std::path::PathBuf>,
}

/// A simulated host's local disk for Pods when the fleet does not say.
const DEFAULT_EPHEMERAL_STORAGE: u64 = 100 << 30;

impl Fleet {
    pub fn load(path: &Path) -> Result<Self, FleetError> {
        let text = std::fs::read_to_string(path).map_err(|source| FleetError::Read {
            path: path.display().to_string(),
            source,
        })?;
        let mut fleet = Self::parse(&text, &path.display().to_string())?;
        fleet.source = Some(path.to_owned());
        Ok(fleet)
    }

    /// Parses and validates fleet YAML; `origin` names it in errors.
    pub fn parse(text: &str, origin: &str) -> Result<Self, FleetError> {
        let raw: RawFleet = serde_yaml_ng::from_str(text).map_err(|e| FleetError::Parse {
            path: origin.to_owned(),
            message: e.to_string(),
        })?;
        let invalid = |field: String, message: String| FleetError::Invalid {
            path: origin.to_owned(),
            field,
            message,
        };
        let dur = |field: &str, v: &Option<String>| -> Result<Duration, FleetError> {
            match v {
                None => Ok(Duration::ZERO),
                Some(t) => duration::parse(t).map_err(|e| invalid(field.to_owned(), e.to_string())),
            }
        };
        let kind = match raw.capacity.as_deref() {
            None | Some("live") => CapacityKind::Live,
            Some("quota") => CapacityKind::Quota,
            Some(other) => {
                return Err(invalid(
                    "capacity".into(),
                    format!("{other:?} is neither live nor quota"),
                ));
            }
        };
        let refresh_interval = match &raw.refresh_interval {
            None => Duration::from_secs(10),
            v => dur("refresh_interval", v)?,
        };
        let latency = Latency {
            admit: dur("latency.admit", &raw.latency.admit)?,
            create: dur("latency.create", &raw.latency.create)?,
            start: dur("latency.start", &raw.latency.start)?,
            ready: dur("latency.ready", &raw.latency.ready)?,
        };
        for (field, rate) in [
            ("faults.create_error_rate", raw.faults.create_error_rate),
            ("faults.delete_error_rate", raw.faults.delete_error_rate),
        ] {
            if !(0.0..=1.0).contains(&rate) {
                return Err(invalid(
                    field.into(),
                    format!("{rate} is not between 0 and 1"),
                ));
            }
        }
        if raw.hosts.is_empty() {
            return Err(invalid("hosts".into(), "the fleet has no hosts".into()));
        }
        let mut names = BTreeSet::new();
        let mut hosts = Vec::with_capacity(raw.hosts.len());
        for (i, h) in raw.hosts.into_iter().enumerate() {
            let at = |f: &str| format!("hosts[{i}].{f}");
            if h.name.is_empty() || !names.insert(h.name.clone()) {
                return Err(invalid(
                    at("name"),
                    format!("{:?} is empty or repeated", h.name),
                ));
            }
            let cpu =
                quantity::cpu_millis(&h.cpu).map_err(|e| invalid(at("cpu"), e.to_string()))?;
            let memory =
                quantity::bytes(&h.memory).map_err(|e| invalid(at("memory"), e.to_string()))?;
            let ephemeral_storage = match &h.ephemeral_storage {
                None => DEFAULT_EPHEMERAL_STORAGE,
                Some(q) => quantity::bytes(q)
                    .map_err(|e| invalid(at("ephemeral_storage"), e.to_string()))?,
            };
            let mut gpus = Vec::new();
            for (g, group) in h.gpus.iter().enumerate() {
                let memory = quantity::bytes(&group.memory)
                    .map_err(|e| invalid(at(&format!("gpus[{g}].memory")), e.to_string()))?;
                if group.count == 0 || group.count > 64 {
                    return Err(invalid(
                        at(&format!("gpus[{g}].count")),
                        "must be 1 to 64".into(),
                    ));
                }
                let compute_slices = match (group.compute_slices, group.mig.is_empty()) {
                    (Some(n @ 1..=16), _) => n,
                    (Some(_), _) => {
                        return Err(invalid(
                            at(&format!("gpus[{g}].compute_slices")),
                            "must be 1 to 16".into(),
                        ));
                    }
                    (None, false) => 7,
                    (None, true) => 0,
                };
                let mut profiles = Vec::new();
                for (profile, &n) in &group.mig {
                    let field = || at(&format!("gpus[{g}].mig.{profile}"));
                    let Some((c, m)) = mig_profile(profile) else {
                        return Err(invalid(field(), "is no MIG profile like 3g.40gb".into()));
                    };
                    if c == 0 || c > compute_slices || m == 0 || (m << 30) > memory {
                        return Err(invalid(
                            field(),
                            format!(
                                "does not fit in a GPU of {compute_slices} compute slices and {} GiB",
                                memory >> 30
                            ),
                        ));
                    }
                    if n == 0 || n > compute_slices {
                        return Err(invalid(
                            field(),
                            format!("count must be 1 to {compute_slices}"),
                        ));
                    }
                    profiles.push((profile.clone(), c, m, n));
                }
                for _ in 0..group.count {
                    let id = format!("{}-gpu{}", h.name, gpus.len());
                    let partitions = profiles
                        .iter()
                        .flat_map(|(profile, c, m, n)| {
                            let label = profile.replace('.', "");
                            let id = &id;
                            (0..*n).map(move |k| GpuPartition {
                                id: format!("{id}-{label}-{k}"),
                                profile: profile.clone(),
                                compute_slices: *c,
                                memory_mib: m << 10,
                                in_use: false,
                            })
                        })
                        .collect();
                    gpus.push(Gpu {
                        id,
                        model: group.model.clone(),
                        memory_mib: memory >> 20,
                        nvlink_domain: group.nvlink_domain.clone(),
                        numa_node: group.numa_node,
                        pcie_root: group.pcie_root.clone(),
                        free: true,
                        compute_slices,
                        partitions,
                    });
                }
            }
            for id in &h.unhealthy_gpus {
                let Some(i) = gpus.iter().position(|g| g.id == *id) else {
                    return Err(invalid(
                        at("unhealthy_gpus"),
                        format!("{id:?} is no GPU of this host"),
                    ));
                };
                gpus.remove(i);
            }
            hosts.push(HostSlice {
                name: h.name,
                cpu_millis_total: cpu,
                cpu_millis_free: cpu,
                memory_bytes_total: memory,
                memory_bytes_free: memory,
                gpus,
                rdma_domain: h.rdma_domain,
                labels: h.labels,
                cached_models: h.cached_models,
                ephemeral_storage_bytes: ephemeral_storage,
                max_pods: h.max_pods.unwrap_or(110),
                pods_running: 0,
                gpus_by_count: false,
            });
        }
        Ok(Self {
            hosts,
            kind,
            refresh_interval,
            latency,
            faults: Faults {
                create_error_rate: raw.faults.create_error_rate,
                delete_error_rate: raw.faults.delete_error_rate,
                unhealthy: raw.faults.unhealthy,
            },
            source: None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
latency: {start: 200ms, ready: 1s}
hosts:
- name: host-a
  cpu: "64"
  memory: 512Gi
  gpus:
  - {count: 4, model: H100, memory: 80Gi, nvlink_domain: nvl-a, numa_node: 0}
- name: host-b
  cpu: 32000m
  memory: 256Gi
"#;

    #[test]
    fn parses_a_fleet() {
        let f = Fleet::parse(GOOD, "good.yaml").unwrap();
        assert_eq!(f.hosts.len(), 2);
        assert_eq!(f.hosts[0].gpus.len(), 4);
        assert_eq!(f.hosts[0].gpus[3].id, "host-a-gpu3");
        assert_eq!(f.hosts[0].gpus[0].memory_mib, 80 * 1024);
        assert_eq!(f.hosts[1].cpu_millis_total, 32_000);
        assert_eq!(f.latency.ready, Duration::from_secs(1));
        assert_eq!(f.kind, CapacityKind::Live);
    }

    #[test]
    fn mig_partitions_and_unhealthy_gpus() {
        let f = Fleet::parse(
            "hosts:\n- name: m\n  cpu: '8'\n  memory: 64Gi\n  unhealthy_gpus: [m-gpu0]\n  gpus:\n  - {count: 2, model: A100, memory: 80Gi, mig: {3g.40gb: 2, 1g.10gb: 7}}",
            "mig.yaml",
        )
        .unwrap();
        let gpus = &f.hosts[0].gpus;
        assert_eq!(gpus.len(), 1, "the unhealthy GPU left the host");
        assert_eq!(gpus[0].id, "m-gpu1");
        assert_eq!(gpus[0].compute_slices, 7);
        assert_eq!(gpus[0].partitions.len(), 9);
        let p = &gpus[0].partitions[7];
        assert_eq!(
            (
                p.id.as_str(),
                p.profile.as_str(),
                p.compute_slices,
                p.memory_mib
            ),
            ("m-gpu1-3g40gb-0", "3g.40gb", 3, 40 << 10)
        );
        for (mig, why) in [
            ("{3g: 1}", "no MIG profile"),
            ("{8g.10gb: 1}", "does not fit"),
            ("{1g.90gb: 1}", "does not fit"),
            ("{1g.10gb: 8}", "count must be 1 to 7"),
        ] {
            let text = format!(
                "hosts:\n- name: m\n  cpu: '8'\n  memory: 64Gi\n  gpus:\n  - {{model: A100, memory: 80Gi, mig: {mig}}}"
            );
            let e = Fleet::parse(&text, "x").unwrap_err().to_string();
            assert!(e.contains("gpus[0].mig.") && e.contains(why), "{mig}: {e}");
        }
        let e = Fleet::parse(
            "hosts:\n- {name: m, cpu: '8', memory: 64Gi, unhealthy_gpus: [m-gpu9]}",
            "x",
        )
        .unwrap_err();
        assert!(e.to_string().contains("unhealthy_gpus"), "{e}");
    }

    #[test]
    fn errors_name_the_field() {
        let cases = [
            ("hosts: []", "hosts"),
            (
                "hosts:\n- {name: a, cpu: lots, memory: 1Gi}",
                "hosts[0].cpu",
            ),
            (
                "hosts:\n- {name: a, cpu: '1', memory: 1Gi}\n- {name: a, cpu: '1', memory: 1Gi}",
                "hosts[1].name",
            ),
            (
                "latency: {start: soon}\nhosts:\n- {name: a, cpu: '1', memory: 1Gi}",
                "latency.start",
            ),
            (
                "hosts:\n- {name: a, cpu: '1', memory: 1Gi, gpus: [{count: 0, model: x, memory: 1Gi}]}",
                "gpus[0].count",
            ),
            (
                "faults: {create_error_rate: 2}\nhosts:\n- {name: a, cpu: '1', memory: 1Gi}",
                "create_error_rate",
            ),
            (
                "capacity: maybe\nhosts:\n- {name: a, cpu: '1', memory: 1Gi}",
                "capacity",
            ),
            (
                "latency: {ready: 9000h}\nhosts:\n- {name: a, cpu: '1', memory: 1Gi}",
                "latency.ready",
            ),
        ];
        for (text, field) in cases {
            let e = Fleet::parse(text, "bad.yaml").unwrap_err().to_string();
            assert!(e.contains(field), "{text:?}: {e}");
        }
        let e =
            Fleet::parse("hosts:\n- {name: a, cpu: '1', memory: 1Gi, gpu: 3}", "x").unwrap_err();
        assert!(e.to_string().contains("unknown field `gpu`"), "{e}");
        assert!(Fleet::parse("{{{", "x").is_err());
    }
}
