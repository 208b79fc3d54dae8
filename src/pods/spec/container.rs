//! One container of the Pod as a provider is told it: command, env names,
//! mounts, ports, probes and hooks, its privileges.

use super::*;
use k8s_openapi::api::core::v1::Container;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use std::collections::BTreeMap;
use std::time::Duration;
use vkd_provider::{ContainerSpec, Handler, Limits, Mount, Probe, quantity};

pub(super) fn container(c: &Container, volumes: &[&str]) -> Result<ContainerSpec, SpecError> {
    let ports: BTreeMap<&str, u16> = c
        .ports
        .iter()
        .flatten()
        .filter_map(|p| {
            let n = p.name.as_deref()?;
            Some((n, u16::try_from(p.container_port).ok()?))
        })
        .collect();
    let probe = |what: &str, p: Option<&k8s_openapi::api::core::v1::Probe>| {
        p.map(|p| probe(&c.name, what, p, &ports)).transpose()
    };
    let hook = |what: &str, h: Option<&k8s_openapi::api::core::v1::LifecycleHandler>| {
        h.map(|h| {
            handler(
                &c.name,
                what,
                h.exec.as_ref().and_then(|e| e.command.clone()),
                h.http_get.as_ref(),
                h.tcp_socket.as_ref(),
                h.sleep.as_ref().map(|s| s.seconds),
                &ports,
            )
        })
        .transpose()
    };
    let limits = c.resources.as_ref().and_then(|r| r.limits.as_ref());
    let invalid = |what: &str, e: quantity::QuantityError| {
        spec_error(
            "InvalidResources",
            format!("container {}: {what}: {e}", c.name),
        )
    };
    let mut mounts = Vec::new();
    for m in c.volume_mounts.iter().flatten() {
        if !volumes.contains(&m.name.as_str()) {
            return Err(spec_error(
                "InvalidSpec",
                format!(
                    "container {}: volumeMount of unknown volume {:?}",
                    c.name, m.name
                ),
            ));
        }
        mounts.push(Mount {
            volume: m.name.clone(),
            path: m.mount_path.clone(),
            sub_path: m.sub_path.clone().filter(|s| !s.is_empty()),
            read_only: m.read_only.unwrap_or(false),
        });
    }
    let lifecycle = c.lifecycle.as_ref();
    Ok(ContainerSpec {
        name: c.name.clone(),
        image: c.image.clone().unwrap_or_default(),
        command: c.command.clone().unwrap_or_default(),
        args: c.args.clone().unwrap_or_default(),
        env: Vec::new(),
        working_dir: c.working_dir.clone().filter(|w| !w.is_empty()),
        mounts,
        limits: Limits {
            cpu_millis: limits
                .and_then(|l| l.get("cpu"))
                .map(|q| quantity::cpu_millis(&q.0))
                .transpose()
                .map_err(|e| invalid("limits.cpu", e))?,
            memory_bytes: limits
                .and_then(|l| l.get("memory"))
                .map(|q| quantity::memory_limit(&q.0))
                .transpose()
                .map(Option::flatten)
                .map_err(|e| invalid("limits.memory", e))?,
        },
        startup_probe: probe("startupProbe", c.startup_probe.as_ref())?.map(Box::new),
        liveness_probe: probe("livenessProbe", c.liveness_probe.as_ref())?.map(Box::new),
        readiness_probe: probe("readinessProbe", c.readiness_probe.as_ref())?.map(Box::new),
        post_start: hook("postStart", lifecycle.and_then(|l| l.post_start.as_ref()))?.map(Box::new),
        pre_stop: hook("preStop", lifecycle.and_then(|l| l.pre_stop.as_ref()))?.map(Box::new),
        // Only an init container can be restartable (a sidecar); `pending` clears it for the others.
        restart_always: c.restart_policy.as_deref() == Some("Always"),
        // `None` stands for the API server's default (no copy kept per Pod).
        termination_message_path: c
            .termination_message_path
            .clone()
            .filter(|p| !p.is_empty() && p != vkd_provider::DEFAULT_TERMINATION_MESSAGE_PATH),
        termination_message_policy: match c.termination_message_policy.as_deref() {
            Some("FallbackToLogsOnError") => {
                vkd_provider::TerminationMessagePolicy::FallbackToLogsOnError
            }
            _ => vkd_provider::TerminationMessagePolicy::File,
        },
        pod_ip_env: pod_ip_env(c),
        stdin: c.stdin.unwrap_or(false),
        stdin_once: c.stdin_once.unwrap_or(false),
        tty: c.tty.unwrap_or(false),
        security: security_context(c.security_context.as_ref()),
        target_container: None,
    })
}

/// The privilege fields of a container's securityContext; `None` when it
/// sets none of them.
pub(super) fn security_context(
    sc: Option<&k8s_openapi::api::core::v1::SecurityContext>,
) -> Option<Box<vkd_provider::SecurityContext>> {
    let caps = sc.and_then(|s| s.capabilities.as_ref());
    let asked = vkd_provider::SecurityContext {
        allow_privilege_escalation: sc.and_then(|s| s.allow_privilege_escalation),
        drop_capabilities: caps.and_then(|c| c.drop.clone()).unwrap_or_default(),
        add_capabilities: caps.and_then(|c| c.add.clone()).unwrap_or_default(),
        privileged: sc.and_then(|s| s.privileged).unwrap_or(false),
    };
    (asked != vkd_provider::SecurityContext::default()).then(|| Box::new(asked))
}

pub(super) fn port_of(
    container: &str,
    what: &str,
    port: &IntOrString,
    ports: &BTreeMap<&str, u16>,
) -> Result<u16, SpecError> {
    match port {
        IntOrString::Int(n) => u16::try_from(*n).ok().filter(|p| *p > 0).ok_or_else(|| {
            spec_error(
                "InvalidProbe",
                format!("container {container}: {what} port {n} is not a port number"),
            )
        }),
        IntOrString::String(name) => ports.get(name.as_str()).copied().ok_or_else(|| {
            spec_error(
                "InvalidProbe",
                format!("container {container}: {what} port {name:?} names no containerPort"),
            )
        }),
    }
}

pub(super) fn handler(
    container: &str,
    what: &str,
    exec: Option<Vec<String>>,
    http: Option<&k8s_openapi::api::core::v1::HTTPGetAction>,
    tcp: Option<&k8s_openapi::api::core::v1::TCPSocketAction>,
    sleep: Option<i64>,
    ports: &BTreeMap<&str, u16>,
) -> Result<Handler, SpecError> {
    if let Some(command) = exec {
        if command.is_empty() {
            return Err(spec_error(
                "InvalidProbe",
                format!("container {container}: {what} exec has an empty command"),
            ));
        }
        return Ok(Handler::Exec { command });
    }
    if let Some(h) = http {
        let https = match h.scheme.as_deref() {
            None | Some("HTTP") => false,
            Some("HTTPS") => true,
            Some(other) => {
                return Err(spec_error(
                    "InvalidProbe",
                    format!("container {container}: {what} scheme {other:?}"),
                ));
            }
        };
        return Ok(Handler::HttpGet {
            host: h.host.clone().filter(|s| !s.is_empty()),
            port: port_of(container, what, &h.port, ports)?,
            path: h.path.clone().unwrap_or_else(|| "/".into()),
            https,
            headers: h
                .http_headers
                .iter()
                .flatten()
                .map(|x| (x.name.clone(), x.value.clone()))
                .collect(),
        });
    }
    if let Some(t) = tcp {
        return Ok(Handler::TcpSocket {
            host: t.host.clone().filter(|s| !s.is_empty()),
            port: port_of(container, what, &t.port, ports)?,
        });
    }
    if let Some(seconds) = sleep {
        return Ok(Handler::Sleep {
            seconds: seconds.max(0).unsigned_abs(),
        });
    }
    Err(spec_error(
        "InvalidProbe",
        format!(
            "container {container}: {what} has no handler this node supports (exec, httpGet, tcpSocket, sleep)"
        ),
    ))
}

pub(super) fn probe(
    container: &str,
    what: &str,
    p: &k8s_openapi::api::core::v1::Probe,
    ports: &BTreeMap<&str, u16>,
) -> Result<Probe, SpecError> {
    let secs = |v: Option<i32>, default: u64| {
        Duration::from_secs(v.map_or(default, |v| u64::from(v.max(0).unsigned_abs())))
    };
    let count = |v: Option<i32>, default: u32| v.map_or(default, |v| v.max(1).unsigned_abs());
    let handler = match &p.grpc {
        Some(g) => grpc(container, what, g)?,
        None => handler(
            container,
            what,
            p.exec.as_ref().and_then(|e| e.command.clone()),
            p.http_get.as_ref(),
            p.tcp_socket.as_ref(),
            None,
            ports,
        )?,
    };
    Ok(Probe {
        handler,
        initial_delay: secs(p.initial_delay_seconds, 0),
        period: secs(p.period_seconds, 10).max(Duration::from_secs(1)),
        timeout: secs(p.timeout_seconds, 1).max(Duration::from_secs(1)),
        success_threshold: count(p.success_threshold, 1),
        failure_threshold: count(p.failure_threshold, 3),
        termination_grace: p
            .termination_grace_period_seconds
            .map(|g| Duration::from_secs(g.max(0).unsigned_abs())),
    })
}

/// A gRPC probe's check: a port number (never a name, as the API has it),
/// the service, and `mode` (plaintext unless `TLS`).
fn grpc(
    container: &str,
    what: &str,
    g: &k8s_openapi::api::core::v1::GRPCAction,
) -> Result<Handler, SpecError> {
    let tls = match g.mode.as_deref() {
        None | Some("Plaintext") => false,
        Some("TLS") => true,
        Some(other) => {
            return Err(spec_error(
                "InvalidProbe",
                format!("container {container}: {what} grpc mode {other:?}"),
            ));
        }
    };
    Ok(Handler::Grpc {
        port: port_of(
            container,
            &format!("{what} grpc"),
            &IntOrString::Int(g.port),
            &BTreeMap::new(),
        )?,
        service: g.service.clone().unwrap_or_default(),
        tls,
    })
}
