//! The status of ephemeral containers (`kubectl debug`): as the instance
//! reports them, else why they wait.

use serde_json::Value;
use vkd_provider::{ContainerState, ContainerStatus, Instance, InstancePhase};

use super::{ContainerView, StateView, StatusView};
use crate::pods::model::PodRecord;

/// The waiting reason of an ephemeral container the provider cannot run.
pub const UNSUPPORTED_REASON: &str = "EphemeralContainersUnsupported";

/// The view of each ephemeral container, for [`StatusView`]: as the instance
/// reports it, else why it waits.
pub fn views(rec: &PodRecord, instance: Option<&Instance>) -> Vec<ContainerView> {
    let Some(e) = rec.ephemeral.as_deref() else {
        return Vec::new();
    };
    let default_reason = if rec.init_containers.is_empty() {
        "ContainerCreating"
    } else {
        "PodInitializing"
    };
    e.containers
        .iter()
        .map(|c| {
            let reported = instance.and_then(|i| {
                let s = i.ephemeral_containers.iter().find(|s| *s.name == *c.name)?;
                Some((s, ended(i)))
            });
            let (state, container_id) = match reported {
                Some((s, over)) => (state_view(&s.state, over), s.container_id.clone()),
                None => {
                    let (reason, message) = match rec.ephemeral_refusal(&c.name) {
                        Some(r) => (r.reason.to_string(), Some(r.message.to_string())),
                        None => (default_reason.to_owned(), None),
                    };
                    (StateView::Waiting { reason, message }, None)
                }
            };
            ContainerView {
                name: c.name.to_string(),
                state,
                last_exit_code: None,
                ready: false,
                started: false,
                restart_count: 0,
                container_id,
            }
        })
        .collect()
}

fn ended(i: &Instance) -> bool {
    matches!(i.phase, InstancePhase::Succeeded | InstancePhase::Failed)
}

/// Exit code and reason of a container the instance ended without reporting
/// its end, as the kubelet writes one it cannot find when the Pod is terminated.
const UNKNOWN: (i32, &str) = (137, "ContainerStatusUnknown");

fn state_view(s: &ContainerState, over: bool) -> StateView {
    match s {
        ContainerState::Waiting { reason, message } => StateView::Waiting {
            reason: reason.clone(),
            message: message.clone(),
        },
        ContainerState::Running { .. } if over => StateView::Terminated {
            exit_code: UNKNOWN.0,
            reason: UNKNOWN.1.into(),
        },
        ContainerState::Running { .. } => StateView::Running,
        ContainerState::Terminated(t) => StateView::Terminated {
            exit_code: t.exit_code,
            reason: t.reason.clone(),
        },
    }
}

/// `status.ephemeralContainerStatuses` for `view`: as `containerStatuses`,
/// but never ready and without `started` (the kubelet's prober, which sets
/// it, knows only the Pod's own containers).
pub fn statuses_json(rec: &PodRecord, view: &StatusView, instance: Option<&Instance>) -> Value {
    let specs = rec
        .ephemeral
        .as_deref()
        .map_or(&[][..], |e| &e.containers[..]);
    let statuses = view
        .ephemeral
        .iter()
        .map(|c| {
            let backend: Option<&ContainerStatus> = instance
                .filter(|i| !ended(i))
                .and_then(|i| i.ephemeral_containers.iter().find(|s| s.name == c.name))
                .or_else(|| {
                    // An ended instance: only recorded ends are taken as they are.
                    instance
                        .and_then(|i| i.ephemeral_containers.iter().find(|s| s.name == c.name))
                        .filter(|s| !matches!(s.state, ContainerState::Running { .. }))
                });
            let mut v = super::container_json(specs, c, backend);
            if let Value::Object(m) = &mut v {
                m.remove("started");
            }
            v
        })
        .collect();
    Value::Array(statuses)
}

#[cfg(test)]
pub(crate) mod tests {
    use std::time::SystemTime;

    use serde_json::json;
    use vkd_provider::{PodRef, Terminated};

    use super::*;
    use crate::pods::model::features::ephemeral_pending as pending;
    use crate::pods::model::{EphemeralProgress, EphemeralSpec, Refusal};
    use crate::pods::spec;
    use k8s_openapi::api::core::v1::Pod;

    pub(crate) fn pod(ephemeral: Value) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": "p", "namespace": "ns", "uid": "u1",
                "labels": {"app": "web"},
                "annotations": {"vkd.io/instance-id": "proc-1"}},
            "spec": {
                "containers": [{"name": "main", "image": "busybox",
                    "resources": {"limits": {"memory": "64Mi"}},
                    "volumeMounts": [{"name": "data", "mountPath": "/data"}]}],
                "volumes": [{"name": "data", "emptyDir": {}}],
                "ephemeralContainers": ephemeral,
            },
            "status": {"phase": "Running"}
        }))
        .unwrap()
    }

    pub(crate) fn debugger() -> Value {
        json!({"name": "debugger", "image": "busybox:1.36",
            "command": ["sh", "-c", "echo $(WHO)"], "targetContainerName": "main",
            "stdin": true, "tty": true,
            "env": [{"name": "WHO", "value": "dbg"},
                {"name": "APP", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['app']"}}}],
            "volumeMounts": [{"name": "data", "mountPath": "/data"}]})
    }

    pub(crate) fn instance(ephemeral: Vec<ContainerStatus>, phase: InstancePhase) -> Instance {
        Instance {
            id: "proc-1".into(),
            owner: PodRef {
                uid: "u1".into(),
                namespace: "ns".into(),
                name: "p".into(),
            },
            node: "vk".into(),
            epoch: 1,
            phase,
            containers: Vec::new(),
            ip: None,
            host: None,
            created_at: SystemTime::UNIX_EPOCH,
            started_at: None,
            message: None,
            init_containers: Vec::new(),
            ephemeral_containers: ephemeral,
            host_ip: None,
            events: Vec::new(),
        }
    }

    pub(crate) fn status(name: &str, state: ContainerState) -> ContainerStatus {
        ContainerStatus {
            name: name.into(),
            state,
            last_termination: None,
            ready: false,
            restart_count: 0,
            container_id: Some(format!("process://u1-{name}-7")),
            started: None,
        }
    }

    #[test]
    fn a_pod_without_ephemeral_containers_keeps_nothing() {
        assert!(EphemeralSpec::of(&pod(json!([])), "vk", None).is_none());
        let r = super::super::record_of(&pod(json!([])), "vk", SystemTime::now()).unwrap();
        assert!(r.ephemeral.is_none());
        assert!(views(&r, None).is_empty());
    }

    /// `kubectl debug --profile=sysadmin` asks for a privileged container: the
    /// node policy refuses it as it would a container of the Pod's own, and
    /// only the ephemeral container being handed over is checked.
    #[test]
    fn privileged_ephemeral_containers_need_the_policy() {
        let mut dbg = debugger();
        dbg["securityContext"] = json!({"privileged": true});
        let p = pending(
            &pod(json!([dbg, {"name": "plain", "image": "busybox"}])),
            "vk",
            &["debugger"],
        )
        .unwrap();
        let e = spec::check_host_access(&spec::Policy::default(), &p).unwrap_err();
        assert_eq!(e.reason, "PrivilegedNotAllowed");
        assert!(
            e.message
                .starts_with("ephemeral container debugger: securityContext.privileged"),
            "{e}"
        );
        let allowed = spec::Policy {
            allow_privileged: true,
            ..spec::Policy::default()
        };
        assert_eq!(spec::check_host_access(&allowed, &p), Ok(()));
        let p = pending(
            &pod(json!([dbg, {"name": "plain", "image": "busybox"}])),
            "vk",
            &["plain"],
        )
        .unwrap();
        assert_eq!(
            spec::check_host_access(&spec::Policy::default(), &p),
            Ok(())
        );
    }

    /// A new entry gets a spec of its own, built as the Pod's containers are
    /// (its env declared, to be resolved), without volumes (the instance has them).
    #[test]
    fn new_entries_get_a_pending_spec_of_their_own() {
        let e = EphemeralSpec::of(&pod(json!([debugger()])), "vk", None).unwrap();
        assert_eq!(&*e.containers[0].name, "debugger");
        assert_eq!(&*e.containers[0].image, "busybox:1.36");
        let p = e.pending.as_deref().unwrap();
        assert_eq!(p.spec.containers.len(), 1);
        assert!(p.spec.init_containers.is_empty());
        let c = &p.spec.containers[0];
        assert_eq!(c.name, "debugger");
        assert_eq!(c.command, ["sh", "-c", "echo $(WHO)"]);
        assert_eq!(c.mounts[0].path, "/data");
        assert_eq!(p.env.len(), 1);
        assert_eq!(p.env[0].env.len(), 2);
        assert!(p.volumes.is_empty());
        // Another container's resources stay readable (resourceFieldRef).
        assert!(p.resources.contains_key("main"));
        assert_eq!(p.fields.get("metadata.labels['app']").unwrap(), "web");

        // Handed over: the next record keeps no spec for it; a second entry gets one.
        let mut handed = EphemeralProgress::default();
        handed.hand("debugger");
        let two = json!([debugger(), {"name": "two", "image": "busybox"}]);
        let e2 = EphemeralSpec::of(&pod(two), "vk", Some(&handed)).unwrap();
        let names: Vec<&str> = e2
            .pending
            .as_deref()
            .unwrap()
            .spec
            .containers
            .iter()
            .map(|c| c.name.as_str())
            .collect();
        assert_eq!(names, ["two"]);
        let mut done = handed;
        done.hand("two");
        let two = json!([debugger(), {"name": "two", "image": "busybox"}]);
        assert!(
            EphemeralSpec::of(&pod(two), "vk", Some(&done))
                .unwrap()
                .pending
                .is_none()
        );
    }

    #[test]
    fn statuses_follow_the_instance_or_say_why_they_wait() {
        let mut r =
            super::super::record_of(&pod(json!([debugger()])), "vk", SystemTime::now()).unwrap();
        // Not reported yet: the kubelet's default.
        let v = views(&r, Some(&instance(Vec::new(), InstancePhase::Running)));
        assert_eq!(
            v[0].state,
            StateView::Waiting {
                reason: "ContainerCreating".into(),
                message: None
            }
        );
        // Refused: the reason and message, not silence.
        r.progress
            .ephemeral
            .get_or_insert_with(Box::default)
            .refuse(Refusal {
                name: "debugger".into(),
                reason: UNSUPPORTED_REASON.into(),
                message: "backend sim does not run ephemeral containers".into(),
                retry: false,
            });
        let v = views(&r, None);
        assert!(
            matches!(&v[0].state, StateView::Waiting { reason, message: Some(m) }
                if reason == UNSUPPORTED_REASON && m.contains("sim")),
            "{v:?}"
        );
        // Reported: as the backend says.
        let t = Terminated {
            exit_code: 0,
            reason: "Completed".into(),
            message: None,
            started_at: Some(SystemTime::UNIX_EPOCH),
            finished_at: SystemTime::UNIX_EPOCH,
        };
        let inst = instance(
            vec![status("debugger", ContainerState::Terminated(t))],
            InstancePhase::Running,
        );
        let mut view = StatusView {
            ephemeral: views(&r, Some(&inst)),
            ..Default::default()
        };
        assert_eq!(
            view.ephemeral[0].state,
            StateView::Terminated {
                exit_code: 0,
                reason: "Completed".into()
            }
        );
        let json = statuses_json(&r, &view, Some(&inst));
        let s = &json[0];
        assert_eq!(s["name"], "debugger");
        assert_eq!(s["image"], "busybox:1.36");
        assert_eq!(s["ready"], false);
        assert!(s.get("started").is_none(), "{s}");
        assert_eq!(s["state"]["terminated"]["exitCode"], 0);
        assert_eq!(s["state"]["terminated"]["reason"], "Completed");
        assert_eq!(s["containerID"], "process://u1-debugger-7");
        // Running in an instance that ended without recording its end: unknown, as the kubelet.
        let ended = instance(
            vec![status(
                "debugger",
                ContainerState::Running {
                    started_at: SystemTime::UNIX_EPOCH,
                },
            )],
            InstancePhase::Succeeded,
        );
        view.ephemeral = views(&r, Some(&ended));
        assert_eq!(
            view.ephemeral[0].state,
            StateView::Terminated {
                exit_code: 137,
                reason: "ContainerStatusUnknown".into()
            }
        );
        let json = statuses_json(&r, &view, Some(&ended));
        assert_eq!(json[0]["state"]["terminated"]["exitCode"], 137);
    }

    /// What the API server holds after our patch reads back as the view we
    /// wrote: no second patch for the same state.
    #[test]
    fn the_written_status_reads_back_as_the_same_view() {
        let r =
            super::super::record_of(&pod(json!([debugger()])), "vk", SystemTime::now()).unwrap();
        let inst = instance(
            vec![status(
                "debugger",
                ContainerState::Running {
                    started_at: SystemTime::UNIX_EPOCH,
                },
            )],
            InstancePhase::Running,
        );
        let view = StatusView {
            ephemeral: views(&r, Some(&inst)),
            ..Default::default()
        };
        let mut p = pod(json!([debugger()]));
        p.status = Some(
            serde_json::from_value(json!({
                "ephemeralContainerStatuses": statuses_json(&r, &view, Some(&inst))
            }))
            .unwrap(),
        );
        assert_eq!(super::super::view_of_pod(&p).ephemeral, view.ephemeral);
    }
}
