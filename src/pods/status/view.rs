//! The status a Pod should have, as a comparable view: from the backend's
//! instance, or from the Pod as the API server holds it.

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::time::SystemTime;

use k8s_openapi::api::core::v1::Pod;
use vkd_provider::{ContainerState, ContainerStatus, Instance, InstancePhase, Terminated};

use super::*;
use crate::pods::model::{ContainerInfo, Observed, Phase, PodRecord};

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum StateView {
    Waiting {
        reason: String,
        message: Option<String>,
    },
    Running,
    Terminated {
        exit_code: i32,
        reason: String,
    },
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ContainerView {
    pub name: String,
    pub state: StateView,
    pub last_exit_code: Option<i32>,
    pub ready: bool,
    /// The kubelet's `started`: running, past postStart and the startupProbe.
    pub started: bool,
    pub restart_count: u32,
    pub container_id: Option<String>,
}

impl ContainerView {
    /// A container that has not run yet, waiting for `reason`.
    fn waiting(name: &str, reason: &str, message: Option<String>) -> Self {
        Self {
            name: name.to_owned(),
            state: StateView::Waiting {
                reason: reason.to_owned(),
                message,
            },
            last_exit_code: None,
            ready: false,
            started: false,
            restart_count: 0,
            container_id: None,
        }
    }

    fn of(s: &ContainerStatus) -> Self {
        Self {
            name: s.name.clone(),
            state: state_view(&s.state),
            last_exit_code: s.last_termination.as_ref().map(|t| t.exit_code),
            ready: s.ready,
            started: s.has_started(),
            restart_count: s.restart_count,
            container_id: s.container_id.clone(),
        }
    }
}

/// The parts of a Pod's status that vkd decides, without times.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct StatusView {
    pub phase: String,
    pub reason: Option<String>,
    pub message: Option<String>,
    /// Status of each of [`CONDITIONS`]; `None` when absent.
    pub conditions: [Option<bool>; 4],
    pub containers: Vec<ContainerView>,
    pub init_containers: Vec<ContainerView>,
    /// `ephemeralContainerStatuses` (see [`super::ephemeral`]).
    pub ephemeral: Vec<ContainerView>,
    pub pod_ip: Option<String>,
    pub instance_id: Option<String>,
    /// `status.observedGeneration`: the Pod's generation the status answers to
    /// (the kubelet writes it, and into each condition, since 1.34).
    pub observed_generation: Option<i64>,
}

impl StatusView {
    pub fn digest(&self) -> u64 {
        let mut h = DefaultHasher::new();
        self.hash(&mut h);
        h.finish()
    }

    /// What a record keeps of this view, once the API server holds it.
    pub fn observed(&self) -> Observed {
        Observed {
            phase: Phase::parse(&self.phase),
            instance_id: self.instance_id.as_deref().map(Into::into),
            digest: self.digest(),
            conditions: self.conditions,
        }
    }
}

/// What a record keeps of the status the API server holds for `pod`.
pub fn observed_of(pod: &Pod) -> Observed {
    view_of_pod(pod).observed()
}

/// The record of a Pod seen for the first time (the watch's first step).
pub fn record_of(pod: &Pod, node: &str, now: SystemTime) -> Option<PodRecord> {
    PodRecord::new(pod, node, observed_of(pod), now)
}

/// The view of what the API server holds.
pub fn view_of_pod(pod: &Pod) -> StatusView {
    let status = pod.status.clone().unwrap_or_default();
    let conditions = CONDITIONS.map(|t| {
        status
            .conditions
            .as_ref()
            .and_then(|cs| cs.iter().find(|c| c.type_ == t))
            .map(|c| c.status == "True")
    });
    let containers = api_views(status.container_statuses);
    let init_containers = api_views(status.init_container_statuses);
    let ephemeral = api_views(status.ephemeral_container_statuses);
    StatusView {
        phase: status.phase.unwrap_or_default(),
        reason: status.reason,
        message: status.message,
        conditions,
        containers,
        init_containers,
        ephemeral,
        pod_ip: status.pod_ip,
        observed_generation: status.observed_generation,
        instance_id: pod
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(INSTANCE_ID).cloned()),
    }
}

pub(super) fn api_views(
    statuses: Option<Vec<k8s_openapi::api::core::v1::ContainerStatus>>,
) -> Vec<ContainerView> {
    statuses
        .unwrap_or_default()
        .into_iter()
        .map(|c| {
            let state = c.state.unwrap_or_default();
            let state = if let Some(w) = state.waiting {
                StateView::Waiting {
                    reason: w.reason.unwrap_or_default(),
                    message: w.message,
                }
            } else if let Some(t) = state.terminated {
                StateView::Terminated {
                    exit_code: t.exit_code,
                    reason: t.reason.unwrap_or_default(),
                }
            } else {
                StateView::Running
            };
            ContainerView {
                name: c.name,
                state,
                last_exit_code: c.last_state.and_then(|s| s.terminated).map(|t| t.exit_code),
                ready: c.ready,
                started: c.started.unwrap_or(false),
                restart_count: u32::try_from(c.restart_count).unwrap_or(0),
                container_id: c.container_id,
            }
        })
        .collect()
}

/// Where a Pod stands before it has an instance.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Waiting {
    /// Admitted, being created.
    Creating,
    /// The backend has no room yet; the reason says what it waits for.
    Queued(String),
    /// Something the spec refers to is missing (a ConfigMap, a key, a ServiceAccount).
    ConfigError(String),
    /// The backend cannot run an image ([`vkd_provider::IMAGE_NOT_RUNNABLE`]);
    /// `backoff` once it failed before and vkd waits to try again.
    ImagePull { message: String, backoff: bool },
}

pub(super) fn state_view(s: &ContainerState) -> StateView {
    match s {
        ContainerState::Waiting { reason, message } => StateView::Waiting {
            reason: reason.clone(),
            message: message.clone(),
        },
        ContainerState::Running { .. } => StateView::Running,
        ContainerState::Terminated(t) => StateView::Terminated {
            exit_code: t.exit_code,
            reason: t.reason.clone(),
        },
    }
}

/// The view vkd wants, from the backend's instance (or where the Pod waits).
///
/// Init containers are reported as the kubelet reports them: a regular one is
/// ready once it exited 0, a sidecar as a container is; the containers wait
/// (`PodInitializing`) until the init containers are done, and `Initialized`
/// holds once each regular init container completed and each sidecar started
/// (or once a container has run, or the Pod succeeded).
pub fn desired_view(rec: &PodRecord, instance: Option<&Instance>, waiting: &Waiting) -> StatusView {
    let has_init = !rec.init_containers.is_empty();
    let Some(inst) = instance else {
        let (reason, message) = match waiting {
            Waiting::Creating => ("ContainerCreating", None),
            Waiting::Queued(why) => ("BackendQueued", Some(why.clone())),
            Waiting::ConfigError(why) => ("CreateContainerConfigError", Some(why.clone())),
            Waiting::ImagePull { message, backoff } => (
                if *backoff {
                    "ImagePullBackOff"
                } else {
                    "ErrImagePull"
                },
                Some(message.clone()),
            ),
        };
        // With init containers the first one says why (`kubectl get` prints
        // Init:<reason>), and the rest wait for it.
        let init_containers = rec
            .init_containers
            .iter()
            .enumerate()
            .map(|(i, c)| match waiting {
                Waiting::Queued(_) | Waiting::ConfigError(_) | Waiting::ImagePull { .. }
                    if i == 0 =>
                {
                    ContainerView::waiting(&c.name, reason, message.clone())
                }
                _ => ContainerView::waiting(&c.name, "PodInitializing", None),
            })
            .collect();
        let containers = rec
            .containers
            .iter()
            .map(|c| {
                if has_init {
                    ContainerView::waiting(&c.name, "PodInitializing", None)
                } else {
                    ContainerView::waiting(&c.name, reason, message.clone())
                }
            })
            .collect();
        return StatusView {
            phase: "Pending".into(),
            conditions: [Some(false), Some(!has_init), Some(false), Some(false)],
            containers,
            init_containers,
            ephemeral: super::ephemeral::views(rec, None),
            ..Default::default()
        };
    };
    let init_containers: Vec<ContainerView> = rec
        .init_containers
        .iter()
        .map(
            |c| match inst.init_containers.iter().find(|s| *s.name == *c.name) {
                Some(s) => {
                    let mut v = ContainerView::of(s);
                    if !c.sidecar {
                        v.ready =
                            matches!(&s.state, ContainerState::Terminated(t) if t.exit_code == 0);
                    }
                    v
                }
                None => ContainerView::waiting(&c.name, "PodInitializing", None),
            },
        )
        .collect();
    let phase = match inst.phase {
        InstancePhase::Pending => "Pending",
        InstancePhase::Running => "Running",
        InstancePhase::Succeeded => "Succeeded",
        InstancePhase::Failed => "Failed",
    };
    let mut containers: Vec<ContainerView> = rec
        .containers
        .iter()
        .map(
            |c| match inst.containers.iter().find(|s| *s.name == *c.name) {
                Some(s) => ContainerView::of(s),
                None if has_init => ContainerView::waiting(&c.name, "PodInitializing", None),
                None => ContainerView::waiting(&c.name, "ContainerCreating", None),
            },
        )
        .collect();
    let initialized = phase == "Succeeded"
        || containers
            .iter()
            .any(|c| !matches!(c.state, StateView::Waiting { .. }))
        || incomplete_init(rec, &init_containers).is_empty();
    if !initialized {
        for c in &mut containers {
            if matches!(&c.state, StateView::Waiting { reason, .. } if reason == "ContainerCreating")
            {
                c.state = StateView::Waiting {
                    reason: "PodInitializing".into(),
                    message: None,
                };
            }
        }
    }
    let all_ready = !containers.is_empty()
        && containers.iter().all(|c| c.ready)
        && sidecars(rec, &init_containers).all(|c| c.ready);
    let unstarted = |c: &ContainerView| {
        matches!(&c.state, StateView::Waiting { reason, .. }
            if reason == "ContainerCreating" || reason == "PodInitializing")
    };
    let sandbox_ready = !matches!(inst.phase, InstancePhase::Pending)
        || !containers.iter().chain(&init_containers).all(unstarted);
    let terminal = matches!(inst.phase, InstancePhase::Succeeded | InstancePhase::Failed);
    StatusView {
        phase: phase.into(),
        reason: None,
        message: inst.message.clone(),
        conditions: [
            Some(sandbox_ready && !terminal),
            Some(initialized),
            Some(all_ready),
            Some(all_ready && rec.readiness_gates_ready),
        ],
        containers,
        init_containers,
        ephemeral: super::ephemeral::views(rec, Some(inst)),
        // The backend's word: an address the API would refuse is left out,
        // or every status write would fail.
        pod_ip: inst
            .ip
            .clone()
            .filter(|ip| ip.parse::<std::net::IpAddr>().is_ok()),
        instance_id: (!inst.id.is_empty()).then(|| inst.id.clone()),
        observed_generation: None,
    }
}

/// The views of the sidecars among `init` (the views of `rec`'s init containers).
pub(super) fn sidecars<'a>(
    rec: &'a PodRecord,
    init: &'a [ContainerView],
) -> impl Iterator<Item = &'a ContainerView> + 'a {
    rec.init_containers
        .iter()
        .zip(init)
        .filter(|(c, _)| c.sidecar)
        .map(|(_, v)| v)
}

/// The init containers that keep the Pod from being initialized: a regular
/// one that has not completed, a sidecar that has not started.
pub(super) fn incomplete_init<'a>(rec: &PodRecord, init: &'a [ContainerView]) -> Vec<&'a str> {
    rec.init_containers
        .iter()
        .zip(init)
        .filter(|(c, v)| if c.sidecar { !v.started } else { !v.ready })
        .map(|(_, v)| v.name.as_str())
        .collect()
}

/// The instance as it stands once it is stopped for good (the Pod is being
/// deleted), for the Pod's final status, as the kubelet's status manager
/// terminates a Pod: a container that did not end is written as one the kubelet
/// could not find (`ContainerStatusUnknown`, exit code 137); the phase is
/// Succeeded when every container exited 0, else Failed, whatever the
/// restartPolicy. `seen` is the instance as last seen (`None`: never seen).
pub fn terminal_instance(rec: &PodRecord, seen: Option<Instance>, now: SystemTime) -> Instance {
    let mut inst = seen.unwrap_or_else(|| Instance {
        id: rec.instance_id.as_deref().unwrap_or_default().to_owned(),
        owner: rec.pod_ref(),
        node: String::new(),
        epoch: 0,
        phase: InstancePhase::Failed,
        containers: Vec::new(),
        ip: None,
        host: None,
        created_at: now,
        started_at: None,
        message: None,
        init_containers: Vec::new(),
        ephemeral_containers: Vec::new(),
        host_ip: None,
        events: Vec::new(),
    });
    let unknown = |started_at: Option<SystemTime>| {
        ContainerState::Terminated(Terminated {
            exit_code: 137,
            reason: "ContainerStatusUnknown".into(),
            message: Some("The container could not be located when the pod was terminated".into()),
            started_at,
            finished_at: now,
        })
    };
    let blank = |c: &ContainerInfo| ContainerStatus {
        name: c.name.to_string(),
        state: unknown(None),
        last_termination: None,
        ready: false,
        restart_count: 0,
        container_id: None,
        started: Some(false),
    };
    let completed = |s: &ContainerStatus| {
        matches!(&s.state, ContainerState::Terminated(t) if t.exit_code == 0)
            || s.last_termination
                .as_ref()
                .is_some_and(|t| t.exit_code == 0)
    };
    // Once the Pod has initialized, a container with no end is a failed one.
    let initialized = rec.init_containers.is_empty()
        || inst.containers.iter().any(|c| {
            !matches!(c.state, ContainerState::Waiting { .. }) || c.last_termination.is_some()
        })
        || inst.init_containers.last().is_some_and(completed);
    if initialized {
        for c in rec.containers.iter() {
            if !inst.containers.iter().any(|s| *s.name == *c.name) {
                inst.containers.push(blank(c));
            }
        }
    }
    // A container waiting to run again has no end either; an init container
    // only once it ever ran (the ones after it never started).
    let containers = inst.containers.iter_mut().map(|c| (c, initialized));
    let init = inst.init_containers.iter_mut().map(|c| {
        let ran = c.container_id.is_some() || c.last_termination.is_some();
        (c, ran)
    });
    for (c, ended_if_waiting) in containers.chain(init) {
        c.ready = false;
        c.started = Some(false);
        match &c.state {
            ContainerState::Running { started_at } => c.state = unknown(Some(*started_at)),
            ContainerState::Waiting { .. } if ended_if_waiting => c.state = unknown(None),
            _ => {}
        }
    }
    let succeeded = rec.containers.iter().all(|c| {
        inst.containers
            .iter()
            .find(|s| *s.name == *c.name)
            .is_some_and(|s| matches!(&s.state, ContainerState::Terminated(t) if t.exit_code == 0))
    });
    inst.phase = if succeeded {
        InstancePhase::Succeeded
    } else {
        InstancePhase::Failed
    };
    inst
}

/// The view of a Pod the backend refused for good.
pub fn failed_view(reason: &str, message: &str) -> StatusView {
    StatusView {
        phase: "Failed".into(),
        reason: Some(reason.to_owned()),
        message: Some(message.to_owned()),
        ..Default::default()
    }
}
