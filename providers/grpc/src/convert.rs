//! Between vkd-provider's types and the protocol's messages: errors as gRPC
//! statuses with an `Error` in their details, capabilities by name, the
//! typed answers, and the JSON documents. Everything from the wire is checked:
//! a bad document is an error naming what it should have been, never a panic.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use prost::Message;
use serde::Serialize;
use serde::de::DeserializeOwned;
use tonic::{Code, Status};
use vkd_provider::{
    Admission, Capabilities, Fence, Health, InstanceEvent, LogLine, Placement, ProviderError,
    Support,
};

use crate::pb;

/// The longest grace a call may carry: what the Pod API allows and more.
pub const MAX_GRACE: Duration = Duration::from_secs(366 * 24 * 3600);

/// Capability names, as the Node's `vkd.io/capabilities` annotation writes
/// them, with their field: the one list both ends read.
type Field = fn(&mut Capabilities) -> &mut Support;

const CAPABILITIES: [(&str, Field); 12] = [
    ("logs", |c| &mut c.logs),
    ("exec", |c| &mut c.exec),
    ("attach", |c| &mut c.attach),
    ("port-forward", |c| &mut c.port_forward),
    ("stats", |c| &mut c.stats),
    ("volumes", |c| &mut c.volumes),
    ("limits", |c| &mut c.limits),
    ("ephemeral-containers", |c| &mut c.ephemeral_containers),
    ("pod-spec", |c| &mut c.pod_spec),
    ("pod-network", |c| &mut c.pod_network),
    ("gpu-usage", |c| &mut c.gpu_usage),
    ("backend-queue", |c| &mut c.backend_queue),
];

/// The capabilities a plugin names; a name vkd does not know is left out.
pub fn capabilities_of(names: &[String]) -> Capabilities {
    let mut caps = Capabilities::default();
    for name in names {
        if let Some((_, field)) = CAPABILITIES.iter().find(|(n, _)| n == name) {
            *field(&mut caps) = Support::Supported;
        }
    }
    caps
}

/// The names of what `caps` supports.
pub fn capability_names(caps: &Capabilities) -> Vec<String> {
    caps.supported().into_iter().map(str::to_owned).collect()
}

/// A capability name as the `'static` text an Unsupported error holds.
fn static_capability(name: &str) -> &'static str {
    CAPABILITIES
        .iter()
        .map(|(n, _)| *n)
        .chain([
            "delete-instance",
            "ephemeral containers",
            "volume updates",
            "port-forward",
        ])
        .find(|n| *n == name)
        .unwrap_or("a capability the plugin named")
}

pub fn status_of(e: &ProviderError) -> Status {
    let mut err = pb::Error {
        message: e.to_string(),
        ..pb::Error::default()
    };
    let code = match e {
        ProviderError::NotFound { uid } => {
            err.set_kind(pb::error::Kind::NotFound);
            err.uid.clone_from(uid);
            Code::NotFound
        }
        ProviderError::Unsupported {
            provider,
            capability,
        } => {
            err.set_kind(pb::error::Kind::Unsupported);
            err.provider.clone_from(provider);
            err.capability = (*capability).to_owned();
            Code::Unimplemented
        }
        ProviderError::Fenced { node, current, got } => {
            err.set_kind(pb::error::Kind::Fenced);
            err.node.clone_from(node);
            err.current = *current;
            err.got = *got;
            Code::FailedPrecondition
        }
        ProviderError::Invalid { reason, message } => {
            err.set_kind(pb::error::Kind::Invalid);
            err.reason.clone_from(reason);
            err.message.clone_from(message);
            Code::InvalidArgument
        }
        ProviderError::Rejected { message } => {
            err.set_kind(pb::error::Kind::Rejected);
            err.message.clone_from(message);
            Code::ResourceExhausted
        }
        ProviderError::Transient { message } => {
            err.set_kind(pb::error::Kind::Transient);
            err.message.clone_from(message);
            Code::Unavailable
        }
    };
    Status::with_details(code, e.to_string(), err.encode_to_vec().into())
}

/// The provider error a status stands for. Only an `Error` in the details
/// that says FENCED is a fence: any other failure (a plugin that is gone,
/// a deadline, a status some proxy made) is transient.
pub fn error_of(status: &Status) -> ProviderError {
    let detail = pb::Error::decode(status.details()).ok();
    let Some(err) = detail.filter(|e| e.kind() != pb::error::Kind::Unspecified) else {
        return ProviderError::transient(format!(
            "provider plugin: {:?}: {}",
            status.code(),
            status.message()
        ));
    };
    match err.kind() {
        pb::error::Kind::NotFound => ProviderError::NotFound { uid: err.uid },
        pb::error::Kind::Unsupported => ProviderError::Unsupported {
            provider: err.provider,
            capability: static_capability(&err.capability),
        },
        pb::error::Kind::Fenced => ProviderError::Fenced {
            node: err.node,
            current: err.current,
            got: err.got,
        },
        pb::error::Kind::Invalid => ProviderError::Invalid {
            reason: err.reason,
            message: err.message,
        },
        pb::error::Kind::Rejected => ProviderError::Rejected {
            message: err.message,
        },
        pb::error::Kind::Transient | pb::error::Kind::Unspecified => {
            ProviderError::transient(err.message)
        }
    }
}

pub fn fence_msg(f: &Fence) -> pb::Fence {
    pb::Fence {
        node: f.node.clone(),
        epoch: f.epoch,
    }
}

/// A fence from the wire: a node name, an epoch.
pub fn fence_of(f: Option<pb::Fence>) -> Result<Fence, Status> {
    let f = f.ok_or_else(|| Status::invalid_argument("the call carries no fence"))?;
    if f.node.is_empty() {
        return Err(Status::invalid_argument("the fence names no node"));
    }
    Ok(Fence {
        node: f.node,
        epoch: f.epoch,
    })
}

pub fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// A grace period from the wire, at most [`MAX_GRACE`].
pub fn grace_of(millis: u64) -> Duration {
    Duration::from_millis(millis).min(MAX_GRACE)
}

pub fn document<T: Serialize>(value: &T) -> Result<pb::Document, ProviderError> {
    serde_json::to_vec(value)
        .map(|json| pb::Document { json })
        .map_err(|e| ProviderError::transient(format!("encoding a document: {e}")))
}

/// A document of type `what`, read as the plugin wrote it.
pub fn read_document<T: DeserializeOwned>(
    doc: Option<&pb::Document>,
    what: &str,
) -> Result<T, String> {
    let doc = doc.ok_or_else(|| format!("no {what} document"))?;
    serde_json::from_slice(&doc.json)
        .map_err(|e| format!("a {what} document that does not read: {e}"))
}

pub fn admission_msg(a: &Admission) -> pb::AdmitReply {
    let answer = match a {
        Admission::Fits(p) => pb::admit_reply::Answer::Fits(pb::Placement {
            host: p.host.clone(),
            gpu_ids: p.gpu_ids.clone(),
        }),
        Admission::Queued { reason } => pb::admit_reply::Answer::Queued(reason.clone()),
        Admission::Rejected { reason, message } => {
            pb::admit_reply::Answer::Rejected(pb::Rejection {
                reason: reason.clone(),
                message: message.clone(),
            })
        }
    };
    pb::AdmitReply {
        answer: Some(answer),
    }
}

pub fn admission_of(reply: pb::AdmitReply) -> Result<Admission, ProviderError> {
    match reply.answer {
        Some(pb::admit_reply::Answer::Fits(p)) => Ok(Admission::Fits(Placement {
            host: p.host,
            gpu_ids: p.gpu_ids,
        })),
        Some(pb::admit_reply::Answer::Queued(reason)) => Ok(Admission::Queued { reason }),
        Some(pb::admit_reply::Answer::Rejected(r)) => Ok(Admission::Rejected {
            reason: r.reason,
            message: r.message,
        }),
        None => Err(ProviderError::transient(
            "provider plugin: an admission answer that is neither fits, queued nor rejected",
        )),
    }
}

pub fn health_msg(h: &Health) -> pb::HealthReply {
    use pb::health_reply::State;
    let mut reply = pb::HealthReply::default();
    match h {
        Health::Healthy => reply.set_state(State::Healthy),
        Health::Unhealthy { reason, message } => {
            reply.set_state(State::Unhealthy);
            reply.reason.clone_from(reason);
            reply.message.clone_from(message);
        }
        Health::Unreachable {
            reason,
            message,
            past_grace,
        } => {
            reply.set_state(State::Unreachable);
            reply.reason.clone_from(reason);
            reply.message.clone_from(message);
            reply.past_grace = *past_grace;
        }
    }
    reply
}

pub fn health_of(reply: pb::HealthReply) -> Health {
    use pb::health_reply::State;
    let state = reply.state();
    let reason = if reply.reason.is_empty() {
        "ProviderUnhealthy".to_owned()
    } else {
        reply.reason
    };
    match state {
        State::Healthy => Health::Healthy,
        State::Unreachable => Health::Unreachable {
            reason,
            message: reply.message,
            past_grace: reply.past_grace,
        },
        State::Unhealthy | State::Unspecified => Health::Unhealthy {
            reason,
            message: reply.message,
        },
    }
}

pub fn event_msg(e: &InstanceEvent) -> pb::Event {
    let kind = match e {
        InstanceEvent::Changed { uid } => pb::event::Kind::Changed(uid.clone()),
        InstanceEvent::Resync => pb::event::Kind::Resync(true),
    };
    pb::Event { kind: Some(kind) }
}

/// A notice from the wire; one that says nothing asks for a resync.
pub fn event_of(e: pb::Event) -> InstanceEvent {
    match e.kind {
        Some(pb::event::Kind::Changed(uid)) if !uid.is_empty() => InstanceEvent::Changed { uid },
        _ => InstanceEvent::Resync,
    }
}

pub fn unix_nanos(t: SystemTime) -> i64 {
    match t.duration_since(UNIX_EPOCH) {
        Ok(d) => i64::try_from(d.as_nanos()).unwrap_or(i64::MAX),
        Err(before) => i64::try_from(before.duration().as_nanos()).map_or(i64::MIN, |n| -n),
    }
}

/// A time from the wire; one out of `SystemTime`'s range is the epoch.
pub fn time_of(nanos: i64) -> SystemTime {
    let magnitude = Duration::from_nanos(nanos.unsigned_abs());
    if nanos >= 0 {
        UNIX_EPOCH.checked_add(magnitude)
    } else {
        UNIX_EPOCH.checked_sub(magnitude)
    }
    .unwrap_or(UNIX_EPOCH)
}

pub fn log_line_msg(l: &LogLine) -> pb::LogLine {
    pb::LogLine {
        time_unix_nanos: unix_nanos(l.time),
        bytes: l.bytes.to_vec(),
    }
}

pub fn log_line_of(l: pb::LogLine) -> LogLine {
    LogLine {
        time: time_of(l.time_unix_nanos),
        bytes: l.bytes.into(),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // a failed unwrap is a failed test
    use super::*;

    #[test]
    fn every_error_comes_back_as_it_left() {
        for e in [
            ProviderError::NotFound { uid: "u1".into() },
            ProviderError::Unsupported {
                provider: "slurm".into(),
                capability: "port-forward",
            },
            ProviderError::Fenced {
                node: "vk".into(),
                current: 7,
                got: 5,
            },
            ProviderError::invalid("ImageNotRunnable", "no such image"),
            ProviderError::Rejected {
                message: "no room".into(),
            },
            ProviderError::transient("busy"),
        ] {
            let back = error_of(&status_of(&e));
            assert_eq!(back.to_string(), e.to_string());
            assert_eq!(back.kind(), e.kind());
        }
    }

    #[test]
    fn a_status_without_vkds_error_is_transient_never_a_fence() {
        for code in [
            Code::FailedPrecondition,
            Code::Unavailable,
            Code::DeadlineExceeded,
        ] {
            let e = error_of(&Status::new(code, "from a proxy"));
            assert_eq!(e.kind(), "transient", "{code:?}");
        }
        let garbage = Status::with_details(Code::FailedPrecondition, "x", vec![0xff, 0x01].into());
        assert_eq!(error_of(&garbage).kind(), "transient");
    }

    #[test]
    fn capabilities_travel_by_name_and_unknown_names_are_left_out() {
        let caps = Capabilities {
            logs: Support::Supported,
            gpu_usage: Support::Supported,
            ..Capabilities::default()
        };
        let mut names = capability_names(&caps);
        assert_eq!(names, ["logs", "gpu-usage"]);
        names.push("teleport".into());
        assert_eq!(capabilities_of(&names), caps);
    }

    #[test]
    fn times_and_graces_from_the_wire_are_bounded() {
        let t = UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        assert_eq!(time_of(unix_nanos(t)), t);
        assert_eq!(
            time_of(i64::MIN),
            UNIX_EPOCH - Duration::from_nanos(i64::MIN.unsigned_abs())
        );
        assert_eq!(grace_of(u64::MAX), MAX_GRACE);
        assert!(fence_of(None).is_err());
        assert!(fence_of(Some(pb::Fence::default())).is_err());
    }

    #[test]
    fn answers_round_trip() {
        for a in [
            Admission::Fits(Placement {
                host: "h".into(),
                gpu_ids: vec!["g0".into()],
            }),
            Admission::Queued {
                reason: "Resources".into(),
            },
            Admission::Rejected {
                reason: "TopologyUnsatisfiable".into(),
                message: "8 on one host".into(),
            },
        ] {
            assert_eq!(admission_of(admission_msg(&a)).unwrap(), a);
        }
        assert!(admission_of(pb::AdmitReply::default()).is_err());
        for h in [
            Health::Healthy,
            Health::Unreachable {
                reason: "R".into(),
                message: "m".into(),
                past_grace: true,
            },
        ] {
            assert_eq!(health_of(health_msg(&h)), h);
        }
        assert_eq!(event_of(pb::Event::default()), InstanceEvent::Resync);
    }
}
