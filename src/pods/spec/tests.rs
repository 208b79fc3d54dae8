use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use vkd_provider::{Handler, Resources, RestartPolicy};

use super::*;
use serde_json::json;

fn pod(v: serde_json::Value) -> Pod {
    serde_json::from_value(v).unwrap()
}

#[test]
fn resources_are_summed_like_the_scheduler() {
    let p = pod(json!({
        "metadata": {"name": "p", "namespace": "ns", "uid": "u1"},
        "spec": {
            "containers": [
                {"name": "a", "image": "x", "resources": {"requests": {"cpu": "500m", "memory": "1Gi"}, "limits": {"nvidia.com/gpu": "2"}}},
                {"name": "b", "image": "y", "resources": {"requests": {"cpu": "1"}}}
            ],
            "initContainers": [{"name": "i", "image": "z", "resources": {"requests": {"cpu": "4"}}}]
        }
    }));
    let s = pending(&p, "vk").unwrap().spec;
    assert_eq!(
        s.resources,
        Resources {
            cpu_millis: 4000,
            memory_bytes: 1 << 30,
            gpus: 2
        }
    );
    assert_eq!(s.pod.uid, "u1");
    assert_eq!(s.restart_policy, RestartPolicy::Always);
    assert_eq!(s.init_containers.len(), 1);
    assert_eq!(s.containers.len(), 2);
    assert_eq!(s.termination_grace, Duration::from_secs(30));
}

/// What a backend with Pod networks needs: hostNetwork, the hostPorts
/// (checked, since network plugins run as root), and which variables
/// name the Pod's IP (the last declaration of a name wins).
#[test]
fn host_ports_host_network_and_pod_ip_variables_reach_the_spec() {
    let p = pod(json!({
        "metadata": {"name": "p", "namespace": "ns", "uid": "u1"},
        "spec": {
            "hostNetwork": true,
            "containers": [{"name": "a", "image": "x",
                "ports": [{"containerPort": 8080, "hostPort": 30080},
                          {"containerPort": 53, "hostPort": 5353, "protocol": "UDP", "hostIP": "127.0.0.1"},
                          {"containerPort": 9090}],
                "env": [
                    {"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                    {"name": "IPS", "valueFrom": {"fieldRef": {"fieldPath": "status.podIPs"}}},
                    {"name": "HOST", "valueFrom": {"fieldRef": {"fieldPath": "status.hostIP"}}},
                    {"name": "IPS", "value": "overridden"}
                ]}]
        }
    }));
    let s = pending(&p, "vk").unwrap().spec;
    assert!(s.host_network);
    assert_eq!(
        s.host_ports,
        vec![
            vkd_provider::HostPort {
                container_port: 8080,
                host_port: 30080,
                protocol: "TCP".into(),
                host_ip: None
            },
            vkd_provider::HostPort {
                container_port: 53,
                host_port: 5353,
                protocol: "UDP".into(),
                host_ip: Some("127.0.0.1".into())
            }
        ]
    );
    assert_eq!(s.containers[0].pod_ip_env, vec!["IP".to_owned()]);
    for (port, why) in [
        (
            json!({"containerPort": 80, "hostPort": 70000}),
            "hostPort 70000",
        ),
        (
            json!({"containerPort": 80, "hostPort": 80, "protocol": "ICMP"}),
            "protocol",
        ),
        (
            json!({"containerPort": 80, "hostPort": 80, "hostIP": "a;b"}),
            "hostIP",
        ),
    ] {
        let bad = pod(json!({
            "metadata": {"name": "p", "namespace": "ns", "uid": "u1"},
            "spec": {"containers": [{"name": "a", "image": "x", "ports": [port]}]}
        }));
        let e = pending(&bad, "vk").err().unwrap().to_string();
        assert!(e.contains(why), "{e}");
    }
}

/// A sidecar is an init container with `restartPolicy: Always`; the
/// termination message settings travel with each container.
#[test]
fn sidecars_and_termination_messages_reach_the_spec() {
    let p = pod(json!({
        "metadata": {"name": "p", "namespace": "ns", "uid": "u1"},
        "spec": {
            "initContainers": [
                {"name": "setup", "image": "x"},
                {"name": "proxy", "image": "x", "restartPolicy": "Always"}
            ],
            "containers": [
                {"name": "a", "image": "x", "terminationMessagePath": "/dev/termination-log",
                 "terminationMessagePolicy": "File"},
                {"name": "b", "image": "x", "terminationMessagePath": "/tmp/why",
                 "terminationMessagePolicy": "FallbackToLogsOnError"}
            ]
        }
    }));
    let s = pending(&p, "vk").unwrap().spec;
    let sidecars: Vec<bool> = s.init_containers.iter().map(|c| c.restart_always).collect();
    assert_eq!(sidecars, [false, true]);
    assert!(s.containers.iter().all(|c| !c.restart_always));
    let (a, b) = (&s.containers[0], &s.containers[1]);
    assert_eq!(
        a.termination_message_path, None,
        "the default is not kept per Pod"
    );
    assert_eq!(a.termination_message_path(), "/dev/termination-log");
    assert_eq!(
        a.termination_message_policy,
        vkd_provider::TerminationMessagePolicy::File
    );
    assert_eq!(b.termination_message_path(), "/tmp/why");
    assert_eq!(
        b.termination_message_policy,
        vkd_provider::TerminationMessagePolicy::FallbackToLogsOnError
    );
}

#[test]
fn bad_quantities_name_the_container() {
    let p = pod(json!({
        "metadata": {"name": "p", "namespace": "ns", "uid": "u1"},
        "spec": {"containers": [{"name": "a", "image": "x", "resources": {"requests": {"nvidia.com/gpu": "1.5"}}}]}
    }));
    let e = pending(&p, "vk").unwrap_err();
    assert_eq!(e.reason, "InvalidResources");
    assert!(e.message.contains("container a"), "{e}");
}

/// `securityContext.fsGroup` reaches the spec; a number that is no group
/// ID is refused by name, never wrapped.
#[test]
fn fs_group_is_a_group_id_or_a_clear_error() {
    let with = |fs_group: serde_json::Value| {
        pending(
            &pod(json!({
                "metadata": {"name": "p", "namespace": "ns", "uid": "u1"},
                "spec": {"securityContext": {"fsGroup": fs_group},
                         "containers": [{"name": "a", "image": "x"}]}
            })),
            "vk",
        )
    };
    assert_eq!(with(json!(123)).unwrap().spec.fs_group, Some(123));
    assert_eq!(with(json!(0)).unwrap().spec.fs_group, Some(0));
    for bad in [json!(-1), json!(4_294_967_295_i64), json!(i64::MAX)] {
        let e = with(bad.clone()).unwrap_err();
        assert_eq!(e.reason, "InvalidSpec", "{bad}");
        assert!(e.message.contains("fsGroup"), "{e}");
    }
}

/// Every quantity form the apiserver admits is read; what no process could
/// run in (a memory limit of half a byte) and sums past u64 are refused by name.
#[test]
fn quantities_read_as_the_apiserver_does() {
    let with = |resources: serde_json::Value| {
        pending(
            &pod(json!({
                "metadata": {"name": "p", "namespace": "ns", "uid": "u1"},
                "spec": {"containers": [{"name": "a", "image": "x", "resources": resources}]}
            })),
            "vk",
        )
    };
    let s = with(json!({"requests": {"cpu": "1e0", "memory": "1Ei"}, "limits": {"memory": "2Ei"}}))
        .unwrap()
        .spec;
    assert_eq!(s.resources.cpu_millis, 1000);
    assert_eq!(s.resources.memory_bytes, 1 << 60);
    assert_eq!(s.containers[0].limits.memory_bytes, Some(2 << 60));
    let e = with(json!({"limits": {"memory": "500m"}})).unwrap_err();
    assert_eq!(e.reason, "InvalidResources");
    assert!(
        e.message.contains("limits.memory") && e.message.contains("500m"),
        "{e}"
    );
    let huge = pending(
        &pod(json!({
            "metadata": {"name": "p", "namespace": "ns", "uid": "u1"},
            "spec": {"containers": [
                {"name": "a", "image": "x", "resources": {"requests": {"memory": "10E"}}},
                {"name": "b", "image": "x", "resources": {"requests": {"memory": "10E"}}}
            ]}
        })),
        "vk",
    )
    .unwrap_err();
    assert_eq!(huge.reason, "InvalidResources");
}

#[test]
fn probes_get_kubelet_defaults_and_named_ports() {
    let p = pod(json!({
        "metadata": {"name": "p", "namespace": "ns", "uid": "u1"},
        "spec": {"containers": [{"name": "web", "image": "x",
            "ports": [{"name": "http", "containerPort": 8080}],
            "readinessProbe": {"httpGet": {"port": "http", "path": "/ready"}},
            "livenessProbe": {"tcpSocket": {"port": 8080}, "periodSeconds": 2, "failureThreshold": 1},
            "lifecycle": {"preStop": {"exec": {"command": ["sh", "-c", "echo bye"]}}}}]}
    }));
    let c = &pending(&p, "vk").unwrap().spec.containers[0];
    let r = c.readiness_probe.as_ref().unwrap();
    assert_eq!(r.period, Duration::from_secs(10));
    assert_eq!(r.failure_threshold, 3);
    assert!(matches!(&r.handler, Handler::HttpGet { port: 8080, path, .. } if path == "/ready"));
    let l = c.liveness_probe.as_ref().unwrap();
    assert_eq!((l.period, l.failure_threshold), (Duration::from_secs(2), 1));
    assert!(matches!(c.pre_stop.as_deref(), Some(Handler::Exec { command }) if command.len() == 3));
}

#[test]
fn grpc_probes_carry_their_port_service_and_mode() {
    let p = pod(json!({
        "metadata": {"name": "p", "namespace": "ns", "uid": "u1"},
        "spec": {"containers": [{"name": "web", "image": "x",
            "livenessProbe": {"grpc": {"port": 5000}, "timeoutSeconds": 5},
            "readinessProbe": {"grpc": {"port": 5001, "service": "db", "mode": "TLS"}},
            "startupProbe": {"grpc": {"port": 5002, "mode": "Plaintext"}}}]}
    }));
    let c = &pending(&p, "vk").unwrap().spec.containers[0];
    let l = c.liveness_probe.as_ref().unwrap();
    assert_eq!(l.timeout, Duration::from_secs(5));
    assert_eq!(
        l.handler,
        Handler::Grpc {
            port: 5000,
            service: String::new(),
            tls: false
        }
    );
    assert_eq!(
        c.readiness_probe.as_ref().unwrap().handler,
        Handler::Grpc {
            port: 5001,
            service: "db".into(),
            tls: true
        }
    );
    assert_eq!(
        c.startup_probe.as_ref().unwrap().handler,
        Handler::Grpc {
            port: 5002,
            service: String::new(),
            tls: false
        }
    );
    for (grpc, says) in [
        (json!({"port": 0}), "grpc port 0 is not a port number"),
        (json!({"port": 70000}), "port 70000 is not a port number"),
        (json!({"port": -1}), "port -1 is not a port number"),
        (json!({"port": 5000, "mode": "QUIC"}), "grpc mode \"QUIC\""),
    ] {
        let p = pod(json!({
            "metadata": {"name": "p", "namespace": "ns", "uid": "u1"},
            "spec": {"containers": [{"name": "web", "image": "x",
                "livenessProbe": {"grpc": grpc}}]}
        }));
        let e = pending(&p, "vk").unwrap_err();
        assert_eq!(e.reason, "InvalidProbe", "{e}");
        assert!(e.message.contains(says), "{e}");
    }
}

#[test]
fn malformed_probes_and_volumes_fail_clearly() {
    let p = pod(json!({
        "metadata": {"name": "p", "namespace": "ns", "uid": "u1"},
        "spec": {"containers": [{"name": "web", "image": "x",
            "readinessProbe": {"httpGet": {"port": "nosuch"}}}]}
    }));
    let e = pending(&p, "vk").unwrap_err();
    assert_eq!(e.reason, "InvalidProbe");
    assert!(
        e.message.contains("\"nosuch\" names no containerPort"),
        "{e}"
    );

    let p = pod(json!({
        "metadata": {"name": "p", "namespace": "ns", "uid": "u1"},
        "spec": {"containers": [{"name": "web", "image": "x"}],
            "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "c"}}]}
    }));
    let e = pending(&p, "vk").unwrap_err();
    assert_eq!(e.reason, "UnsupportedVolume");
    assert!(e.message.contains("persistentVolumeClaim"), "{e}");
}

#[test]
fn secret_files_have_the_pods_modes() {
    let data: BTreeMap<String, Vec<u8>> = [("k".to_owned(), b"v".to_vec())].into();
    let mut files = Vec::new();
    project(
        &mut files,
        Some(data.clone()),
        None,
        0o644,
        None,
        Source::Secret,
        "s",
    )
    .unwrap();
    project(
        &mut files,
        Some(data),
        None,
        0o644,
        None,
        Source::ConfigMap,
        "c",
    )
    .unwrap();
    assert_eq!((files[0].mode, files[1].mode), (0o644, 0o644));
    let missing = project(&mut files, None, None, 0o644, None, Source::Secret, "gone");
    assert!(matches!(missing, Err(ResolveError::Config(m)) if m == "secret \"gone\" not found"));
    assert!(
        project(
            &mut files,
            None,
            None,
            0o644,
            Some(true),
            Source::Secret,
            "gone"
        )
        .is_ok()
    );
}

#[test]
fn expansion_follows_the_kubelet() {
    let env = vec![
        ("A".to_owned(), "1".to_owned()),
        ("B".to_owned(), "x y".to_owned()),
    ];
    assert_eq!(expand("$(A)-$(B)", &env), "1-x y");
    assert_eq!(expand("$$(A) $(C) $A $", &env), "$(A) $(C) $A $");
    assert_eq!(expand("$(unterminated", &env), "$(unterminated");
}

#[test]
fn downward_fields_and_resources() {
    let p = pod(json!({
        "metadata": {"name": "p", "namespace": "ns", "uid": "u1", "labels": {"app": "web"}},
        "spec": {"containers": [{"name": "web", "image": "x",
            "resources": {"limits": {"memory": "64Mi", "cpu": "250m"}}}]}
    }));
    let pend = pending(&p, "vk").unwrap();
    assert_eq!(
        field(&pend.fields, "metadata.labels['app']").unwrap(),
        "web"
    );
    assert_eq!(
        field(&pend.fields, "metadata.labels").unwrap(),
        "app=\"web\""
    );
    assert_eq!(
        resource_field(&pend, "web", "limits.memory", None, None).unwrap(),
        "67108864"
    );
    assert_eq!(
        resource_field(&pend, "web", "limits.cpu", None, None).unwrap(),
        "1"
    );
    let mi = "1Mi".to_owned();
    assert_eq!(
        resource_field(&pend, "web", "limits.memory", Some(&mi), None).unwrap(),
        "64"
    );
    // The divisor the apiserver stores when none is given: cores, rounded up.
    let zero = "0".to_owned();
    assert_eq!(
        resource_field(&pend, "web", "limits.cpu", Some(&zero), None).unwrap(),
        "1"
    );
    assert_eq!(
        resource_field(&pend, "web", "limits.memory", Some(&zero), None).unwrap(),
        "67108864"
    );
    assert!(file("../etc/passwd", vec![], 0o644).is_err());
    assert!(file("/abs", vec![], 0o644).is_err());
    assert_eq!(file("a/b", vec![], 0o4755).unwrap().mode, 0o755);
}

/// The kubelet's subpath expansion: every reference must have a value, and
/// the result must stay inside the volume.
#[test]
fn sub_path_expr_follows_the_kubelet() {
    let env = vec![
        ("POD_NAME".to_owned(), "foo".to_owned()),
        ("ANNOTATION".to_owned(), "mypath".to_owned()),
        ("EMPTY".to_owned(), String::new()),
        ("UP".to_owned(), "..".to_owned()),
        ("ABS".to_owned(), "/tmp".to_owned()),
    ];
    assert_eq!(
        expand_sub_path("$(ANNOTATION)/$(POD_NAME)", &env).unwrap(),
        "mypath/foo"
    );
    assert_eq!(
        expand_sub_path("a$$(POD_NAME)", &env).unwrap(),
        "a$(POD_NAME)"
    );
    assert_eq!(
        expand_sub_path("$(NOPE)/$(EMPTY)/$(POD_NAME)", &env).unwrap_err(),
        "missing value for EMPTY, NOPE"
    );
    assert_eq!(
        expand_sub_path("$(UP)", &env).unwrap_err(),
        "unable to provision SubPath `..`: must not contain '..'"
    );
    assert!(expand_sub_path("a/$(UP)/b", &env).is_err());
    assert!(expand_sub_path("a..b", &env).is_ok());
    assert_eq!(
        expand_sub_path("$(ABS)", &env).unwrap_err(),
        "error SubPath `/tmp` must not be an absolute path"
    );
}

/// As the kubelet's defaultPodLimitsForDownwardAPI: an unset (or zero)
/// limit reads as the Pod-level limit, else the node's allocatable; an
/// unset request reads as 0, never as something else.
#[test]
fn unset_limits_read_as_node_allocatable() {
    let p = pod(json!({
        "metadata": {"name": "p", "namespace": "ns", "uid": "u1"},
        "spec": {"containers": [
            {"name": "bare", "image": "x",
                "env": [{"name": "CPU", "valueFrom": {"resourceFieldRef": {"resource": "limits.cpu"}}}]},
            {"name": "set", "image": "x",
                "resources": {"limits": {"cpu": "0", "memory": "64Mi"}, "requests": {"cpu": "250m"}}}
        ]}
    }));
    let pend = pending(&p, "vk").unwrap();
    assert!(pend.reads_allocatable);
    let node = Some(Allocatable {
        cpu_millis: 7500,
        memory_bytes: 16 << 30,
    });
    let read = |c: &str, r: &str, d: Option<&str>| {
        let d = d.map(str::to_owned);
        resource_field(&pend, c, r, d.as_ref(), node)
            .map_err(|e| e.to_string())
            .unwrap()
    };
    assert_eq!(read("bare", "limits.cpu", None), "8");
    assert_eq!(read("bare", "limits.cpu", Some("1m")), "7500");
    assert_eq!(read("bare", "limits.memory", Some("1Gi")), "16");
    assert_eq!(read("bare", "requests.cpu", None), "0");
    assert_eq!(read("bare", "requests.memory", None), "0");
    // A zero limit is no limit.
    assert_eq!(read("set", "limits.cpu", Some("1m")), "7500");
    assert_eq!(read("set", "limits.memory", Some("1Mi")), "64");
    assert_eq!(read("set", "requests.cpu", Some("1m")), "250");
    // Unknown allocatable: retried, never a made-up figure.
    assert!(matches!(
        resource_field(&pend, "bare", "limits.cpu", None, None),
        Err(ResolveError::Config(_))
    ));
    // Pod-level limits come before the node's.
    let p = pod(json!({
        "metadata": {"name": "p", "namespace": "ns", "uid": "u1"},
        "spec": {"resources": {"limits": {"cpu": "2", "memory": "1Gi"}},
            "containers": [{"name": "c", "image": "x"}],
            "volumes": [{"name": "d", "downwardAPI": {"items": [
                {"path": "mem", "resourceFieldRef": {"containerName": "c", "resource": "limits.memory"}}]}}]}
    }));
    let pend = pending(&p, "vk").unwrap();
    assert!(pend.reads_allocatable);
    assert_eq!(
        resource_field(&pend, "c", "limits.cpu", None, node).unwrap(),
        "2"
    );
    // Nothing reads a limit: the provider is not asked for capacity.
    let p = pod(json!({
        "metadata": {"name": "p", "namespace": "ns", "uid": "u1"},
        "spec": {"containers": [{"name": "c", "image": "x",
            "env": [{"name": "R", "valueFrom": {"resourceFieldRef": {"resource": "requests.cpu"}}}]}]}
    }));
    assert!(!pending(&p, "vk").unwrap().reads_allocatable);
}

/// A Pod `spec` in namespace `app`, pending on node `vk`.
fn pending_spec(spec: serde_json::Value) -> Pending {
    pending(
        &pod(json!({"metadata": {"name": "p", "namespace": "app", "uid": "u1"}, "spec": spec})),
        "vk",
    )
    .unwrap()
}

#[test]
fn host_namespaces_privileged_and_capabilities_need_the_policy() {
    let policy = Policy::default();
    assert!(!policy.allow_privileged, "off by default");
    let c = json!({"name": "c", "image": "x"});
    let refused = |spec: serde_json::Value| check_host_access(&policy, &pending_spec(spec));
    // Nothing asked: nothing refused.
    assert_eq!(refused(json!({"containers": [c]})), Ok(()));
    for field in ["hostNetwork", "hostPID", "hostIPC"] {
        let e = refused(json!({field: true, "containers": [c]})).unwrap_err();
        assert_eq!(e.reason, "HostNamespacesNotAllowed", "{field}");
        assert!(e.message.contains(&format!("spec.{field} is true")), "{e}");
        assert!(e.message.contains("privileged=refused"), "{e}");
        // false is what the default says.
        assert_eq!(refused(json!({field: false, "containers": [c]})), Ok(()));
    }
    let privileged =
        |name: &str| json!({"name": name, "image": "x", "securityContext": {"privileged": true}});
    for (spec, who) in [
        (json!({"containers": [c, privileged("p")]}), "container p"),
        (
            json!({"initContainers": [privileged("i")], "containers": [c]}),
            "init container i",
        ),
        (
            json!({"initContainers": [{"name": "s", "image": "x", "restartPolicy": "Always",
                "securityContext": {"privileged": true}}], "containers": [c]}),
            "init container s",
        ),
    ] {
        let e = refused(spec).unwrap_err();
        assert_eq!(e.reason, "PrivilegedNotAllowed");
        assert!(
            e.message
                .starts_with(&format!("{who}: securityContext.privileged is true")),
            "{e}"
        );
    }
    let caps = |add: serde_json::Value| {
        json!({"containers": [{"name": "c", "image": "x",
            "securityContext": {"capabilities": {"add": add, "drop": ["ALL"]}}}]})
    };
    // The runtime's default set, as runtimes read names: any case, CAP_ or not.
    assert_eq!(
        refused(caps(json!([
            "NET_BIND_SERVICE",
            "cap_chown",
            "Kill",
            "CAP_SYS_CHROOT"
        ]))),
        Ok(())
    );
    for (add, named) in [
        (json!(["SYS_ADMIN"]), "SYS_ADMIN"),
        (
            json!(["chown", "cap_net_admin", "SYS_PTRACE"]),
            "cap_net_admin, SYS_PTRACE",
        ),
        (json!(["ALL"]), "ALL"),
        (json!(["CAP_"]), "CAP_"),
    ] {
        let e = refused(caps(add)).unwrap_err();
        assert_eq!(e.reason, "CapabilitiesNotAllowed");
        assert!(
            e.message.starts_with(&format!(
                "container c: securityContext.capabilities.add has {named}:"
            )),
            "{e}"
        );
    }
    // With the policy, all of it runs.
    let allowed = Policy {
        allow_privileged: true,
        ..Policy::default()
    };
    let spec = json!({"hostNetwork": true, "hostPID": true, "hostIPC": true,
        "initContainers": [privileged("i")],
        "containers": [{"name": "c", "image": "x", "securityContext":
            {"privileged": true, "capabilities": {"add": ["SYS_ADMIN"]}}}]});
    assert_eq!(check_host_access(&allowed, &pending_spec(spec)), Ok(()));
}

#[test]
fn the_nodes_own_ports_are_never_a_pods_host_port() {
    let policy = Policy {
        // Not even with every other door open.
        allow_privileged: true,
        node_ports: BTreeMap::from([
            (10250, "vkd's kubelet API (--kubelet-port)".to_owned()),
            (10256, "vkd's admin server (--admin-port)".to_owned()),
        ]),
        ..Policy::default()
    };
    let with_port = |port: u16, protocol: &str| {
        pending_spec(
            json!({"containers": [{"name": "web", "image": "x", "ports": [
            {"containerPort": 8080, "hostPort": 8080},
            {"containerPort": 9000, "hostPort": port, "protocol": protocol}]}]}),
        )
    };
    assert_eq!(check_host_access(&policy, &with_port(9000, "TCP")), Ok(()));
    for (port, user) in [(10250, "--kubelet-port"), (10256, "--admin-port")] {
        for protocol in ["TCP", "UDP"] {
            let e = check_host_access(&policy, &with_port(port, protocol)).unwrap_err();
            assert_eq!(e.reason, "HostPortNotAllowed");
            assert!(
                e.message
                    .starts_with(&format!("container web: hostPort {port} is ")),
                "{e}"
            );
            assert!(
                e.message.contains(user) && e.message.contains("node vk"),
                "{e}"
            );
        }
    }
    // hostNetwork: the API server sets hostPort to containerPort.
    let e = check_host_access(
        &policy,
        &pending_spec(
            json!({"hostNetwork": true, "initContainers": [{"name": "i", "image": "x",
            "ports": [{"containerPort": 10250, "hostPort": 10250}]}],
            "containers": [{"name": "c", "image": "x"}]}),
        ),
    )
    .unwrap_err();
    assert_eq!(e.reason, "HostPortNotAllowed");
    assert!(
        e.message.starts_with("init container i: hostPort 10250"),
        "{e}"
    );
}

#[test]
fn the_node_shows_the_privileged_policy() {
    assert_eq!(
        Policy::default().to_string(),
        "namespaces=all secrets=allowed configmaps=allowed hostpath=refused privileged=refused"
    );
    let p = Policy {
        allow_privileged: true,
        ..Policy::default()
    };
    assert!(p.to_string().ends_with(" privileged=allowed"), "{p}");
}

/// The refusals end a resolve as the other policy refusals do: the Pod fails.
#[tokio::test]
async fn resolve_refuses_what_the_policy_does_not_give() {
    let (client, _log) = crate::testing::fake_api(|_| crate::testing::status(404, "NotFound"));
    let policy = Policy {
        node_ports: BTreeMap::from([(10250, "vkd's kubelet API (--kubelet-port)".into())]),
        ..Policy::default()
    };
    let resolver = |policy| Resolver {
        client: &client,
        policy,
        host_ip: "192.0.2.1",
        volumes: false,
        services: None,
        allocatable: None,
    };
    for (spec, reason) in [
        (
            json!({"hostPID": true, "containers": [{"name": "c", "image": "x"}]}),
            "HostNamespacesNotAllowed",
        ),
        (
            json!({"containers": [{"name": "c", "image": "x",
                "ports": [{"containerPort": 80, "hostPort": 10250}]}]}),
            "HostPortNotAllowed",
        ),
    ] {
        match resolver(&policy).resolve(&pending_spec(spec)).await {
            Err(ResolveError::Spec(e)) => assert_eq!(e.reason, reason),
            other => panic!("{other:?}"),
        }
    }
    let allowed = Policy {
        allow_privileged: true,
        ..Policy::default()
    };
    let spec = json!({"hostPID": true, "containers": [{"name": "c", "image": "x"}]});
    assert!(
        resolver(&allowed)
            .resolve(&pending_spec(spec))
            .await
            .is_ok()
    );
}

/// A whole resolve against a fake API server: service variables, the
/// kubelet's wording for what is missing, subPathExpr and allocatable.
#[tokio::test]
async fn resolve_builds_the_kubelets_environment() {
    use crate::testing::{Seen, fake_api, status};
    let (client, _log) = fake_api(|req: &Seen| match req.path.as_str() {
        "/api/v1/namespaces/app/configmaps/cfg" => (
            200,
            json!({"apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": "cfg", "namespace": "app"}, "data": {"k": "v"}}),
        ),
        "/api/v1/namespaces/app/secrets/sec" => (
            200,
            json!({"apiVersion": "v1", "kind": "Secret",
                "metadata": {"name": "sec", "namespace": "app"}, "data": {"k": "dg=="}}),
        ),
        _ => status(404, "NotFound"),
    });
    let svc = |ns: &str, name: &str, ip: &str, port: i32| -> k8s_openapi::api::core::v1::Service {
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": ns},
            "spec": {"clusterIP": ip, "ports": [{"port": port}]}
        }))
        .unwrap()
    };
    let services = super::super::services::Services::fixed(vec![
        svc("default", "kubernetes", "10.96.0.1", 443),
        svc("app", "fooservice", "10.96.0.7", 8765),
    ]);
    let policy = Policy::default();
    let resolver = Resolver {
        client: &client,
        policy: &policy,
        host_ip: "192.0.2.1",
        volumes: true,
        services: Some(&services),
        allocatable: Some(Allocatable {
            cpu_millis: 4000,
            memory_bytes: 8 << 30,
        }),
    };
    let with = |env: serde_json::Value, mounts: serde_json::Value, links: bool| {
        pending(
            &pod(json!({
                "metadata": {"name": "p", "namespace": "app", "uid": "u1",
                    "annotations": {"sub": "mypath"}},
                "spec": {
                    "enableServiceLinks": links,
                    "containers": [{"name": "c", "image": "x", "command": ["$(FOOSERVICE_SERVICE_HOST)"],
                        "env": env, "volumeMounts": mounts}],
                    "volumes": [{"name": "w", "emptyDir": {}}]
                }
            })),
            "vk",
        )
        .unwrap()
    };
    let p = with(
        json!([
            {"name": "FOOSERVICE_SERVICE_PORT", "value": "override"},
            {"name": "URL", "value": "https://$(KUBERNETES_SERVICE_HOST):$(KUBERNETES_SERVICE_PORT)"},
            {"name": "ANNOTATION", "valueFrom": {"fieldRef": {"fieldPath": "metadata.annotations['sub']"}}},
            {"name": "CPU", "valueFrom": {"resourceFieldRef": {"resource": "limits.cpu"}}},
            {"name": "MEM", "valueFrom": {"resourceFieldRef": {"resource": "limits.memory", "divisor": "1Mi"}}}
        ]),
        json!([{"name": "w", "mountPath": "/sub", "subPathExpr": "$(ANNOTATION)/$(CPU)"},
               {"name": "w", "mountPath": "/all"}]),
        true,
    );
    let spec = resolver.resolve(&p).await.unwrap();
    let c = &spec.containers[0];
    let get = |k: &str| c.env.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
    assert_eq!(get("KUBERNETES_SERVICE_HOST"), Some("10.96.0.1"));
    assert_eq!(get("KUBERNETES_SERVICE_PORT"), Some("443"));
    assert_eq!(get("KUBERNETES_PORT_443_TCP"), Some("tcp://10.96.0.1:443"));
    assert_eq!(get("FOOSERVICE_SERVICE_HOST"), Some("10.96.0.7"));
    assert_eq!(get("FOOSERVICE_PORT_8765_TCP_PORT"), Some("8765"));
    // The Pod's own value wins, once, before the service variables.
    assert_eq!(get("FOOSERVICE_SERVICE_PORT"), Some("override"));
    assert_eq!(
        c.env
            .iter()
            .filter(|(n, _)| n == "FOOSERVICE_SERVICE_PORT")
            .count(),
        1
    );
    assert_eq!(c.env[0].0, "FOOSERVICE_SERVICE_PORT");
    assert_eq!(get("URL"), Some("https://10.96.0.1:443"));
    assert_eq!(get("CPU"), Some("4"));
    assert_eq!(get("MEM"), Some("8192"));
    assert_eq!(c.command, vec!["10.96.0.7".to_owned()]);
    assert_eq!(c.mounts[0].sub_path.as_deref(), Some("mypath/4"));
    assert_eq!(c.mounts[1].sub_path, None);

    // enableServiceLinks: false keeps only the master service's variables.
    let p = with(json!([]), json!([]), false);
    let spec = resolver.resolve(&p).await.unwrap();
    let names: Vec<&str> = spec.containers[0]
        .env
        .iter()
        .map(|(n, _)| n.as_str())
        .collect();
    assert!(names.contains(&"KUBERNETES_SERVICE_HOST"), "{names:?}");
    assert!(
        !names.iter().any(|n| n.starts_with("FOOSERVICE")),
        "{names:?}"
    );

    // What the kubelet says when something is missing.
    let config_error = |p: Pending| {
        let resolver = &resolver;
        async move {
            match resolver.resolve(&p).await {
                Err(ResolveError::Config(m)) => m,
                other => panic!("{other:?}"),
            }
        }
    };
    let key = |kind: &str, name: &str, key: &str| json!([{"name": "X", "valueFrom": {kind: {"name": name, "key": key}}}]);
    for (env, want) in [
        (
            key("secretKeyRef", "gone", "k"),
            "secret \"gone\" not found",
        ),
        (
            key("configMapKeyRef", "gone", "k"),
            "configmap \"gone\" not found",
        ),
        (
            key("secretKeyRef", "sec", "nokey"),
            "couldn't find key nokey in Secret app/sec",
        ),
        (
            key("configMapKeyRef", "cfg", "nokey"),
            "couldn't find key nokey in ConfigMap app/cfg",
        ),
        (json!([{"name": "A", "value": ".."}]), "$(A)"),
    ] {
        let mounts = if want == "$(A)" {
            json!([{"name": "w", "mountPath": "/s", "subPathExpr": "$(A)"}])
        } else {
            json!([])
        };
        let got = config_error(with(env, mounts, true)).await;
        let want = if want == "$(A)" {
            "unable to provision SubPath `..`: must not contain '..'"
        } else {
            want
        };
        assert_eq!(got, want);
    }
    // An optional reference to what is missing is skipped.
    let optional = json!([{"name": "X", "valueFrom": {"secretKeyRef": {"name": "gone", "key": "k", "optional": true}}},
        {"name": "Y", "valueFrom": {"secretKeyRef": {"name": "sec", "key": "k"}}}]);
    let spec = resolver
        .resolve(&with(optional, json!([]), true))
        .await
        .unwrap();
    assert!(
        spec.containers[0]
            .env
            .iter()
            .any(|(n, v)| n == "Y" && v == "v")
    );
    assert!(!spec.containers[0].env.iter().any(|(n, _)| n == "X"));
}
