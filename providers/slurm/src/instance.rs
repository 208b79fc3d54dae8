//! A Pod's instance as vkd sees it, from what Slurm says of its job and what
//! the job's runner wrote: a pending job is a Pending instance whose
//! containers wait with reason `BackendQueued` and Slurm's own pending reason;
//! a running job's containers are as their records say; a job that ended is
//! Succeeded when every container exited 0.

use std::time::SystemTime;

use vkd_provider::{
    ContainerSpec, ContainerState, ContainerStatus, Fence, Instance, InstancePhase, InstanceSpec,
    PodRef, Terminated,
};

use crate::pod_dir::{ContainerRecord, Exit, PodDir};
use crate::slurm::JobRow;

/// The job name of a Pod's job: what finds the job again after a restart.
pub fn job_name(uid: &str) -> String {
    format!("vkd-{uid}")
}

/// The Pod UID of a job the provider submitted.
pub fn uid_of(job_name: &str) -> Option<&str> {
    job_name.strip_prefix("vkd-")
}

/// The job's comment: the node and epoch it was submitted under (what
/// `job_submit.lua` checks), and whose Pod it is.
pub fn comment(fence: &Fence, pod: &PodRef) -> String {
    format!(
        "vkd:node={};epoch={};pod={}/{}",
        fence.node, fence.epoch, pod.namespace, pod.name
    )
}

/// What a comment says: `(node, epoch, namespace, name)`.
pub fn read_comment(comment: &str) -> Option<(String, u64, String, String)> {
    let rest = comment.strip_prefix("vkd:")?;
    let field = |key: &str| {
        rest.split(';')
            .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
    };
    let (ns, name) = field("pod")?.split_once('/')?;
    Some((
        field("node")?.to_owned(),
        field("epoch")?.parse().ok()?,
        ns.to_owned(),
        name.to_owned(),
    ))
}

/// The instance id of a job.
pub fn instance_id(job: u64) -> String {
    format!("slurm-{job}")
}

pub fn job_of_instance(id: &str) -> Option<u64> {
    id.strip_prefix("slurm-")?.parse().ok()
}

fn terminated(e: &Exit) -> Terminated {
    Terminated {
        exit_code: e.code,
        reason: if e.code == 0 { "Completed" } else { "Error" }.into(),
        message: None,
        started_at: Some(e.started_at),
        finished_at: e.finished_at,
    }
}

fn status(
    c: &ContainerSpec,
    r: &ContainerRecord,
    job: u64,
    waiting: &ContainerState,
) -> ContainerStatus {
    let state = match (&r.running_since, &r.exit) {
        (Some(since), _) => ContainerState::Running { started_at: *since },
        (None, Some(e)) => ContainerState::Terminated(terminated(e)),
        (None, None) => waiting.clone(),
    };
    let running = matches!(state, ContainerState::Running { .. });
    ContainerStatus {
        name: c.name.clone(),
        ready: running,
        started: Some(running),
        last_termination: r.last.as_ref().map(terminated),
        restart_count: r.restarts,
        container_id: (r.running_since.is_some() || r.exit.is_some())
            .then(|| format!("slurm://{job}/{}", c.name)),
        state,
    }
}

/// The instance of `spec`'s Pod, its job as `row` says (`None`: Slurm no
/// longer lists it) and its containers as their records say.
pub fn instance(
    spec: &InstanceSpec,
    pod: &PodDir,
    job: u64,
    row: Option<&JobRow>,
    host_ip: Option<&str>,
) -> Instance {
    let epoch = row
        .and_then(|r| read_comment(&r.comment))
        .map_or(0, |(_, e, _, _)| e);
    let pending = row.is_some_and(JobRow::pending);
    let waiting = match row {
        Some(r) if pending && !matches!(r.reason.as_str(), "None" | "") => {
            ContainerState::Waiting {
                reason: "BackendQueued".into(),
                message: Some(format!("Slurm job {job} is pending: {}", r.reason)),
            }
        }
        _ => ContainerState::Waiting {
            reason: "ContainerCreating".into(),
            message: None,
        },
    };
    let records = |cs: &[ContainerSpec]| -> Vec<ContainerStatus> {
        cs.iter()
            .map(|c| status(c, &pod.record(&c.name), job, &waiting))
            .collect()
    };
    let init_containers = records(&spec.init_containers);
    let mut containers = records(&spec.containers);
    let ended = row.is_none_or(|r| !r.active());
    let mut message = None;
    let phase = if pending {
        InstancePhase::Pending
    } else if !ended {
        if containers.iter().any(|c| c.started == Some(true)) {
            InstancePhase::Running
        } else {
            InstancePhase::Pending
        }
    } else {
        // The job is over: what did not run never will.
        for c in &mut containers {
            if matches!(c.state, ContainerState::Waiting { .. }) {
                c.state = ContainerState::Terminated(Terminated {
                    exit_code: 137,
                    reason: "ContainerStatusUnknown".into(),
                    message: Some(format!(
                        "Slurm job {job} ended ({}) before the container ran",
                        row.map_or("gone", |r| r.state.as_str())
                    )),
                    started_at: None,
                    finished_at: SystemTime::now(),
                });
            }
        }
        let ok = containers
            .iter()
            .all(|c| matches!(&c.state, ContainerState::Terminated(t) if t.exit_code == 0));
        if let Some(r) = row.filter(|r| r.state != "COMPLETED") {
            message = Some(format!("Slurm job {job} ended {}", r.state));
        }
        if ok {
            InstancePhase::Succeeded
        } else {
            InstancePhase::Failed
        }
    };
    let host = row.map(|r| r.nodes.clone()).filter(|n| !n.is_empty());
    Instance {
        id: instance_id(job),
        owner: spec.pod.clone(),
        node: spec.node.clone(),
        epoch,
        phase,
        containers,
        init_containers,
        ephemeral_containers: Vec::new(),
        ip: host.as_ref().and(host_ip.map(str::to_owned)),
        host_ip: host.as_ref().and(host_ip.map(str::to_owned)),
        host,
        created_at: row
            .and_then(|r| r.submitted)
            .unwrap_or_else(SystemTime::now),
        started_at: row.and_then(|r| r.started),
        message,
        events: Vec::new(),
    }
}

/// A job of this provider's that has no Pod directory (the state dir was
/// lost, or the create that submitted it died before writing): listed so
/// that vkd sees it and deletes it, never left running unseen.
pub fn orphan(row: &JobRow, uid: &str) -> Option<Instance> {
    let (node, epoch, namespace, name) = read_comment(&row.comment)?;
    Some(Instance {
        id: instance_id(row.id),
        owner: PodRef {
            uid: uid.to_owned(),
            namespace,
            name,
        },
        node,
        epoch,
        phase: if row.pending() {
            InstancePhase::Pending
        } else if row.active() {
            InstancePhase::Running
        } else {
            InstancePhase::Failed
        },
        containers: Vec::new(),
        init_containers: Vec::new(),
        ephemeral_containers: Vec::new(),
        ip: None,
        host_ip: None,
        host: Some(row.nodes.clone()).filter(|n| !n.is_empty()),
        created_at: row.submitted.unwrap_or_else(SystemTime::now),
        started_at: row.started,
        message: Some(format!(
            "Slurm job {} has no Pod directory in the state dir",
            row.id
        )),
        events: Vec::new(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_comment_round_trips() {
        let fence = Fence {
            node: "vk-slurm".into(),
            epoch: 42,
        };
        let pod = PodRef {
            uid: "u".into(),
            namespace: "ns".into(),
            name: "p".into(),
        };
        assert_eq!(
            read_comment(&comment(&fence, &pod)),
            Some(("vk-slurm".into(), 42, "ns".into(), "p".into()))
        );
        assert_eq!(read_comment("someone else's job"), None);
        assert_eq!(uid_of(&job_name("abc")), Some("abc"));
        assert_eq!(job_of_instance(&instance_id(7)), Some(7));
    }
}
