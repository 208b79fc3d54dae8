//! The process provider against real processes: conformance, logs, restarts, exec, adoption.
#![allow(clippy::unwrap_used)] // a test file: a failed unwrap is a failed test

mod common;

use std::time::Duration;

use common::{fence, provider, remove, running, shim_exe, spec, stream_io, wait_for};
use tokio::io::AsyncReadExt;
use vkd_process::{ProcessConfig, ProcessProvider, config};
use vkd_provider::conformance::{Kit, sample_spec};
use vkd_provider::{
    Admission, ContainerSpec, ContainerState, InstancePhase, InstanceSpec, LogRequest, Provider,
    RestartPolicy, StreamIo,
};

#[tokio::test(flavor = "multi_thread")]
async fn conforms() {
    let (p, dir) = provider();
    Kit::new(&p, "node-c", |node, uid| {
        let mut s = sample_spec(node, uid);
        s.termination_grace = Duration::from_secs(2);
        s
    })
    .run()
    .await
    .unwrap();
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread")]
async fn runs_logs_restarts_and_stops() {
    let (p, dir) = provider();
    let s = spec(
        "u-logs",
        &["sh", "-c", "echo out-$HOSTNAME; echo err >&2; exit 3"],
    );
    let s = InstanceSpec {
        restart_policy: RestartPolicy::OnFailure,
        ..s
    };
    p.create(&fence(), &s).await.unwrap();
    // Exits 3, restarts at once, then backs off: CrashLoopBackOff with restartCount >= 1.
    let c = wait_for("CrashLoopBackOff", async || {
        let i = p.get("u-logs").await.unwrap()?;
        let c = i.containers.first()?.clone();
        matches!(&c.state, ContainerState::Waiting { reason, .. } if reason == "CrashLoopBackOff")
            .then_some(c)
    })
    .await;
    assert!(c.restart_count >= 1, "{c:?}");
    let last = c.last_termination.unwrap();
    assert_eq!((last.exit_code, last.reason.as_str()), (3, "Error"));
    let logs = p
        .logs("u-logs", "main", LogRequest::default())
        .await
        .unwrap();
    let text: Vec<u8> = logs.history.iter().flat_map(|l| l.bytes.to_vec()).collect();
    let text = String::from_utf8(text).unwrap();
    assert!(
        text.contains("out-pod-u-logs\n") && text.contains("err\n"),
        "{text:?}"
    );
    let prev = p
        .logs(
            "u-logs",
            "main",
            LogRequest {
                previous: true,
                ..LogRequest::default()
            },
        )
        .await
        .unwrap();
    assert!(!prev.history.is_empty());
    p.delete(&fence(), "u-logs", Duration::from_secs(1))
        .await
        .unwrap();
    wait_for("deletion", async || {
        p.get("u-logs").await.unwrap().is_none().then_some(())
    })
    .await;
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread")]
async fn exec_runs_in_the_container_environment() {
    let (p, dir) = provider();
    let mut s = spec("u-exec", &["sleep", "60"]);
    s.containers[0].env = vec![("GREETING".into(), "hi".into())];
    s.containers[0].working_dir = Some("/work".into());
    p.create(&fence(), &s).await.unwrap();
    wait_for("running", async || {
        let i = p.get("u-exec").await.unwrap()?;
        (i.phase == InstancePhase::Running).then_some(())
    })
    .await;
    let (w, mut r) = tokio::io::duplex(4096);
    let code = p
        .exec(
            "u-exec",
            "main",
            vec![
                "sh".into(),
                "-c".into(),
                "echo $GREETING; pwd; exit 7".into(),
            ],
            StreamIo {
                stdin: None,
                stdout: Some(Box::new(w)),
                stderr: None,
                tty: false,
                resize: None,
            },
        )
        .await
        .unwrap();
    assert_eq!(code, 7);
    let mut out = String::new();
    r.read_to_string(&mut out).await.unwrap();
    assert!(out.starts_with("hi\n"), "{out:?}");
    // The workingDir: the path the spec names in the container's own tree
    // with namespaces; without, that path under the Pod's root.
    let wd = if p.isolation_mode() == "namespaces" {
        "/work"
    } else {
        "u-exec/root/work"
    };
    assert!(out.trim_end().ends_with(wd), "{out:?}");
    p.delete(&fence(), "u-exec", Duration::from_secs(1))
        .await
        .unwrap();
    wait_for("deletion", async || {
        p.get("u-exec").await.unwrap().is_none().then_some(())
    })
    .await;
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread")]
async fn unrunnable_containers_are_rejected_at_admission() {
    let (p, dir) = provider();
    let a = p
        .admit(&spec("u-bad", &["no-such-program-vkd"]))
        .await
        .unwrap();
    assert!(
        matches!(&a, Admission::Rejected { reason, message } if reason == "ExecutableNotFound" && message.contains("no-such-program-vkd")),
        "{a:?}"
    );
    let mut s = spec("u-img", &["sleep", "1"]);
    s.containers[0].image = "nginx".into();
    let a = p.admit(&s).await.unwrap();
    assert!(
        matches!(&a, Admission::Rejected { reason, .. } if reason == "ImageNotRunnable"),
        "{a:?}"
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_new_provider_adopts_running_pods() {
    let (p, dir) = provider();
    p.create(&fence(), &spec("u-adopt", &["sleep", "60"]))
        .await
        .unwrap();
    let first = wait_for("running", async || {
        let i = p.get("u-adopt").await.unwrap()?;
        (i.phase == InstancePhase::Running).then_some(i)
    })
    .await;
    drop(p);
    let again = ProcessProvider::open(
        ProcessConfig {
            images: vec![config::ImageMap {
                pattern: "busybox*".into(),
                path: None,
                entrypoint: vec![],
                args: vec![],
                files: Default::default(),
            }],
            cgroup_parent: "none".into(),
            ..Default::default()
        },
        &dir,
        shim_exe(),
    )
    .unwrap();
    let i = again.get("u-adopt").await.unwrap().unwrap();
    assert_eq!(i.id, first.id);
    assert_eq!(i.phase, InstancePhase::Running);
    let again_created = again
        .create(&fence(), &spec("u-adopt", &["sleep", "60"]))
        .await
        .unwrap();
    assert_eq!(
        again_created.id, first.id,
        "a second create returns the same instance"
    );
    assert_eq!(again.list("node-p").await.unwrap().len(), 1);
    again
        .delete(&fence(), "u-adopt", Duration::from_secs(1))
        .await
        .unwrap();
    wait_for("deletion", async || {
        again.get("u-adopt").await.unwrap().is_none().then_some(())
    })
    .await;
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread")]
async fn init_containers_run_in_order_before_the_containers() {
    let (p, dir) = provider();
    let mut s = spec("u-init", &["sh", "-c", "cat data/order; sleep 60"]);
    let mount = vkd_provider::Mount {
        volume: "scratch".into(),
        path: "/data".into(),
        ..Default::default()
    };
    s.volumes = vec![vkd_provider::Volume {
        name: "scratch".into(),
        source: vkd_provider::VolumeSource::EmptyDir {
            size_limit: None,
            memory: false,
        },
    }];
    s.containers[0].mounts = vec![mount.clone()];
    s.containers[0].post_start = Some(Box::new(vkd_provider::Handler::Exec {
        command: vec![
            "sh".into(),
            "-c".into(),
            "echo started > data/post-start".into(),
        ],
    }));
    s.init_containers = ["one", "two"]
        .iter()
        .map(|n| ContainerSpec {
            name: format!("init-{n}"),
            image: "busybox".into(),
            command: vec![
                "sh".into(),
                "-c".into(),
                format!("sleep 0.2; echo {n} >> data/order"),
            ],
            mounts: vec![mount.clone()],
            ..Default::default()
        })
        .collect();
    p.create(&fence(), &s).await.unwrap();
    running(&p, "u-init").await;
    let text = wait_for("main's log", async || {
        let logs = p.logs("u-init", "main", LogRequest::default()).await.ok()?;
        let t: Vec<u8> = logs.history.iter().flat_map(|l| l.bytes.to_vec()).collect();
        let t = String::from_utf8(t).ok()?;
        (!t.is_empty()).then_some(t)
    })
    .await;
    assert_eq!(text, "one\ntwo\n");
    let (w, mut r) = tokio::io::duplex(4096);
    let code = p
        .exec(
            "u-init",
            "main",
            vec!["cat".into(), "data/post-start".into()],
            stream_io(w, false),
        )
        .await
        .unwrap();
    let mut out = String::new();
    r.read_to_string(&mut out).await.unwrap();
    assert_eq!((code, out.as_str()), (0, "started\n"), "postStart ran");
    remove(&p, "u-init").await;
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_failing_init_container_fails_a_never_restart_pod() {
    let (p, dir) = provider();
    let mut s = spec("u-initfail", &["sleep", "60"]);
    s.restart_policy = RestartPolicy::Never;
    s.init_containers = vec![ContainerSpec {
        name: "setup".into(),
        image: "busybox".into(),
        command: vec!["sh".into(), "-c".into(), "exit 4".into()],
        ..Default::default()
    }];
    p.create(&fence(), &s).await.unwrap();
    let i = wait_for("failed", async || {
        let i = p.get("u-initfail").await.unwrap()?;
        (i.phase == InstancePhase::Failed).then_some(i)
    })
    .await;
    assert!(
        i.message
            .unwrap_or_default()
            .contains("init container setup failed")
    );
    assert!(
        matches!(&i.containers[0].state, ContainerState::Waiting { .. }),
        "the container never started: {:?}",
        i.containers[0]
    );
    remove(&p, "u-initfail").await;
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread")]
async fn tty_exec_gets_the_terminal_size_and_resizes() {
    let (p, dir) = provider();
    p.create(&fence(), &spec("u-tty", &["sleep", "60"]))
        .await
        .unwrap();
    running(&p, "u-tty").await;
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    tx.send(vkd_provider::TermSize {
        width: 100,
        height: 40,
    })
    .await
    .unwrap();
    let (w, mut r) = tokio::io::duplex(4096);
    let mut io = stream_io(w, true);
    io.resize = Some(rx);
    let code = p
        .exec(
            "u-tty",
            "main",
            vec![
                "sh".into(),
                "-c".into(),
                "stty size; test -t 0 && echo tty".into(),
            ],
            io,
        )
        .await
        .unwrap();
    drop(tx);
    let mut out = String::new();
    r.read_to_string(&mut out).await.unwrap();
    assert_eq!(code, 0, "{out:?}");
    assert!(out.contains("40 100") && out.contains("tty"), "{out:?}");
    remove(&p, "u-tty").await;
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread")]
async fn port_forward_reaches_the_process_and_stats_read_proc() {
    let (p, dir) = provider();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut s = spec(
        "u-pf",
        &[
            "python3",
            "-m",
            "http.server",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
        ],
    );
    s.containers[0].image = "busybox".into();
    p.create(&fence(), &s).await.unwrap();
    running(&p, "u-pf").await;
    // The server takes a moment to listen.
    let reply = wait_for("an HTTP answer through port-forward", async || {
        let (mut near, far) = tokio::io::duplex(64 * 1024);
        let pf = p.port_forward("u-pf", port, Box::new(far));
        let talk = async move {
            use tokio::io::AsyncWriteExt;
            near.write_all(b"GET / HTTP/1.0\r\n\r\n").await.ok()?;
            let mut buf = vec![0u8; 64];
            let n = near.read(&mut buf).await.ok()?;
            // Dropping our end closes the forwarded connection.
            String::from_utf8(buf[..n].to_vec()).ok()
        };
        let (r, reply) = tokio::join!(pf, talk);
        r.ok()?;
        reply.filter(|t| t.starts_with("HTTP/1.0 200"))
    })
    .await;
    assert!(reply.starts_with("HTTP/1.0 200"), "{reply:?}");
    let stats = p.stats("u-pf").await.unwrap();
    let c = &stats.containers[0];
    assert!(c.memory_rss_bytes > 1 << 20, "python's RSS: {c:?}");
    assert!(c.cpu_usage_core_nanoseconds > 0, "{c:?}");
    remove(&p, "u-pf").await;
    let _ = std::fs::remove_dir_all(dir);
}

/// PIDs of live processes whose command line starts with `marker`.
fn processes_with(marker: &str) -> Vec<i32> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let cmd = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
        let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
        let zombie = std::fs::read_to_string(e.path().join("stat")).is_ok_and(|s| {
            s.rsplit(')')
                .next()
                .is_some_and(|r| r.trim_start().starts_with('Z'))
        });
        if cmd.starts_with(marker) && !zombie {
            out.push(pid);
        }
    }
    out
}

fn owner_uid(path: &std::path::Path) -> u32 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).unwrap().uid()
}

/// The Pod's environment reaches only its own program, as its own user: glibc's
/// LD_DEBUG_OUTPUT in the Pod's env must not make a root process write a file.
#[tokio::test(flavor = "multi_thread")]
async fn the_pods_environment_never_reaches_a_root_process() {
    if !rustix::process::geteuid().is_root() {
        eprintln!("skipped: needs root to tell the launcher from the Pod's user");
        return;
    }
    let (p, dir) = provider();
    let out = dir.join("ld-debug");
    std::fs::create_dir_all(&out).unwrap();
    let mut s = spec("u-ldenv", &["sh", "-c", "echo env=$GREETING; sleep 60"]);
    s.containers[0].env = vec![
        ("GREETING".into(), "hi".into()),
        ("LD_DEBUG".into(), "libs".into()),
        (
            "LD_DEBUG_OUTPUT".into(),
            out.join("dbg").display().to_string(),
        ),
    ];
    p.create(&fence(), &s).await.unwrap();
    running(&p, "u-ldenv").await;
    let (w, _r) = tokio::io::duplex(1 << 16);
    p.exec("u-ldenv", "main", vec!["true".into()], stream_io(w, false))
        .await
        .unwrap();
    let logs = wait_for("the greeting", async || {
        let l = p
            .logs("u-ldenv", "main", LogRequest::default())
            .await
            .unwrap();
        let text: String = l
            .history
            .iter()
            .map(|l| String::from_utf8_lossy(&l.bytes).into_owned())
            .collect();
        text.contains("env=hi").then_some(text)
    })
    .await;
    assert!(logs.contains("env=hi"), "{logs}");
    let by_root: Vec<_> = std::fs::read_dir(&out)
        .unwrap()
        .flatten()
        .filter(|e| owner_uid(&e.path()) == 0)
        .map(|e| e.path())
        .collect();
    assert!(
        by_root.is_empty(),
        "a root process honoured the Pod's LD_DEBUG_OUTPUT: {by_root:?}"
    );
    remove(&p, "u-ldenv").await;
    let _ = std::fs::remove_dir_all(dir);
}

/// What a container detaches (setsid, then the shell that started it exits)
/// ends with the Pod, and `vkd process list` shows it while it runs.
#[tokio::test(flavor = "multi_thread")]
async fn detached_processes_end_with_the_pod() {
    let (p, dir) = provider();
    let s = spec(
        "u-setsid",
        &["sh", "-c", "setsid sh -c 'exec sleep 7777.25' & sleep 3600"],
    );
    p.create(&fence(), &s).await.unwrap();
    running(&p, "u-setsid").await;
    let pids = wait_for("the detached sleep", async || {
        let pids = processes_with("sleep 7777.25");
        (!pids.is_empty()).then_some(pids)
    })
    .await;
    let listed = vkd_process::read_listings(&dir).unwrap();
    let row = listed.iter().find(|l| l.pod_uid == "u-setsid").unwrap();
    assert!(
        row.processes.iter().any(|(_, pid)| pids.contains(pid)),
        "vkd process list misses the detached process {pids:?}: {:?}",
        row.processes
    );
    remove(&p, "u-setsid").await;
    wait_for("the detached sleep to end", async || {
        processes_with("sleep 7777.25").is_empty().then_some(())
    })
    .await;
    let _ = std::fs::remove_dir_all(dir);
}

/// podPidsLimit bounds how many processes a Pod can start.
#[tokio::test(flavor = "multi_thread")]
async fn a_pod_cannot_start_more_processes_than_its_limit() {
    if !rustix::process::geteuid().is_root() {
        eprintln!("skipped: RLIMIT_NPROC does not bind root, and only root runs Pods");
        return;
    }
    let dir = std::env::temp_dir().join(format!("vkd-process-{}", uuid::Uuid::new_v4().simple()));
    let config = ProcessConfig {
        images: vec![config::ImageMap {
            pattern: "busybox*".into(),
            path: None,
            entrypoint: vec![],
            args: vec![],
            files: Default::default(),
        }],
        cgroup_parent: "none".into(),
        // Also counts what other tests run as the same user at the same moment.
        pod_pids_limit: Some(40),
        // A user of its own, so other tests' processes do not count.
        run_as_user: Some(64_001),
        ..Default::default()
    };
    let p = ProcessProvider::open(config, &dir, shim_exe()).unwrap();
    let s = spec(
        "u-pids",
        &[
            "sh",
            "-c",
            "i=0; while [ $i -lt 100 ]; do sleep 6001.5 & echo started $i; i=$((i+1)); done; sleep 3600",
        ],
    );
    // One run only: a restart would log afresh.
    let mut s = s;
    s.restart_policy = RestartPolicy::Never;
    p.create(&fence(), &s).await.unwrap();
    // The shell stops at the first fork the limit refuses; without a limit it starts all 100.
    let text = wait_for("the shell to stop or finish forking", async || {
        let l = p.logs("u-pids", "main", LogRequest::default()).await.ok()?;
        let text: String = l
            .history
            .iter()
            .map(|l| String::from_utf8_lossy(&l.bytes).into_owned())
            .collect();
        (text.contains("fork") || text.contains("started 99")).then_some(text)
    })
    .await;
    let started = text.lines().filter(|l| l.contains("started ")).count();
    assert!(
        (1..40).contains(&started),
        "{started} processes started under a limit of 40:\n{text}"
    );
    remove(&p, "u-pids").await;
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_working_dir_outside_the_pod_is_refused() {
    let (p, dir) = provider();
    let mut s = spec("u-wd", &["sleep", "1"]);
    s.containers[0].working_dir = Some("/../../../../etc".into());
    let a = p.admit(&s).await.unwrap();
    assert!(
        matches!(&a, Admission::Rejected { reason, message } if reason == "InvalidSpec" && message.contains("workingDir")),
        "{a:?}"
    );
    assert!(p.create(&fence(), &s).await.is_err());
    let _ = std::fs::remove_dir_all(dir);
}

/// terminationGracePeriodSeconds of i64::MAX with a failing liveness probe: the
/// shim restarts the container (after SIGKILL at the clamped deadline it never
/// reaches, the process ends on its own here) and never panics.
#[tokio::test(flavor = "multi_thread")]
async fn a_huge_grace_period_does_not_panic_the_shim() {
    let (p, dir) = provider();
    let mut s = spec(
        "u-grace",
        &["sh", "-c", "trap 'exit 0' TERM; sleep 3600 & wait"],
    );
    s.termination_grace = Duration::from_secs(i64::MAX as u64);
    s.containers[0].liveness_probe = Some(Box::new(failing_liveness(None)));
    p.create(&fence(), &s).await.unwrap();
    wait_for("a restart after the liveness failure", async || {
        let i = p.get("u-grace").await.unwrap()?;
        assert_ne!(i.phase, InstancePhase::Failed, "{:?}", i.message);
        (i.containers.first()?.restart_count >= 1).then_some(())
    })
    .await;
    remove(&p, "u-grace").await;
    let _ = std::fs::remove_dir_all(dir);
}

/// A liveness probe that fails at once, every second, with `grace` as its own
/// terminationGracePeriodSeconds.
fn failing_liveness(grace: Option<Duration>) -> vkd_provider::Probe {
    vkd_provider::Probe {
        handler: vkd_provider::Handler::Exec {
            command: vec!["false".into()],
        },
        initial_delay: Duration::ZERO,
        period: Duration::from_secs(1),
        timeout: Duration::from_secs(1),
        success_threshold: 1,
        failure_threshold: 1,
        termination_grace: grace,
    }
}

/// A liveness probe's own terminationGracePeriodSeconds bounds the restart it
/// causes, not the Pod's (here 600 s, which the program would use up: it
/// ignores SIGTERM).
#[tokio::test(flavor = "multi_thread")]
async fn a_probes_own_grace_period_bounds_its_restart() {
    let (p, dir) = provider();
    let mut s = spec("u-probe-grace", &["sh", "-c", "trap '' TERM; sleep 1000"]);
    s.termination_grace = Duration::from_secs(600);
    s.containers[0].liveness_probe = Some(Box::new(failing_liveness(Some(Duration::from_secs(2)))));
    p.create(&fence(), &s).await.unwrap();
    // Within the probe's 2 s grace (and a period or two), not the Pod's 600 s.
    wait_for("a restart after the probe's grace", async || {
        let i = p.get("u-probe-grace").await.unwrap()?;
        (i.containers.first()?.restart_count >= 1).then_some(())
    })
    .await;
    p.delete(&fence(), "u-probe-grace", Duration::from_secs(1))
        .await
        .unwrap();
    wait_for("deletion", async || {
        p.get("u-probe-grace")
            .await
            .unwrap()
            .is_none()
            .then_some(())
    })
    .await;
    let _ = std::fs::remove_dir_all(dir);
}

/// One unreadable record affects its own Pod only, with the file named.
#[tokio::test(flavor = "multi_thread")]
async fn a_truncated_record_affects_only_its_own_pod() {
    let (p, dir) = provider();
    p.create(&fence(), &spec("u-ok", &["sleep", "60"]))
        .await
        .unwrap();
    p.create(&fence(), &spec("u-torn", &["sleep", "60"]))
        .await
        .unwrap();
    running(&p, "u-ok").await;
    running(&p, "u-torn").await;
    let record = dir.join("pods/u-torn/instance.json");
    let text = std::fs::read(&record).unwrap();
    std::fs::write(&record, &text[..text.len() / 2]).unwrap();
    let listed = p.list("node-p").await.unwrap();
    assert_eq!(
        listed
            .iter()
            .map(|i| i.owner.uid.as_str())
            .collect::<Vec<_>>(),
        ["u-ok"]
    );
    let err = p.get("u-torn").await.unwrap_err().to_string();
    assert!(err.contains("instance.json"), "{err}");
    let rows = vkd_process::read_listings(&dir).unwrap();
    let torn = rows.iter().find(|r| r.pod_uid == "u-torn").unwrap();
    assert!(
        torn.error
            .as_deref()
            .is_some_and(|e| e.contains("instance.json")),
        "{torn:?}"
    );
    remove(&p, "u-ok").await;
    // Its Pod can still be deleted: delete needs no record.
    p.delete(&fence(), "u-torn", Duration::from_secs(1))
        .await
        .unwrap();
    wait_for("the torn sandbox to go", async || {
        (!dir.join("pods/u-torn").exists()).then_some(())
    })
    .await;
    assert!(p.get("u-torn").await.unwrap().is_none());
    let _ = std::fs::remove_dir_all(dir);
}

/// A shim that dies without ending its Pod: the Pod reports Failed, nothing
/// keeps running for it, and its sandbox stays until a delete removes it.
#[tokio::test(flavor = "multi_thread")]
async fn a_dead_shims_processes_end_and_its_sandbox_waits_for_delete() {
    use std::os::unix::process::CommandExt;
    let (p, dir) = provider();
    p.create(&fence(), &spec("u-read", &["sleep", "60"]))
        .await
        .unwrap();
    running(&p, "u-read").await;
    let rows = vkd_process::read_listings(&dir).unwrap();
    let row = rows.iter().find(|r| r.pod_uid == "u-read").unwrap();
    let shim = rustix::process::Pid::from_raw(row.shim_pid.unwrap()).unwrap();
    let container = rustix::process::Pid::from_raw(row.processes[0].1).unwrap();
    // The recorded process becomes one of this test's own (its real container is
    // the test's to end), so its end is seen here.
    let mut own = std::process::Command::new("sleep")
        .arg("30")
        .process_group(0)
        .spawn()
        .unwrap();
    let id = vkd_process::procfs::ProcessId::of(own.id() as i32).unwrap();
    let status_path = dir.join("pods/u-read/status.json");
    let mut status: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&status_path).unwrap()).unwrap();
    status["containers"][0]["process"] = serde_json::to_value(id).unwrap();
    rustix::process::kill_process(shim, rustix::process::Signal::KILL).unwrap();
    std::fs::write(&status_path, serde_json::to_vec(&status).unwrap()).unwrap();
    let _ = rustix::process::kill_process(container, rustix::process::Signal::KILL);
    let i = wait_for("the Pod failed", async || {
        let i = p.get("u-read").await.unwrap()?;
        (i.phase == InstancePhase::Failed).then_some(i)
    })
    .await;
    assert!(i.message.unwrap().contains("shim"));
    wait_for("the dead shim's process to be killed", async || {
        own.try_wait()
            .unwrap()
            .map(|st| assert!(st.code().is_none(), "{st:?}"))
    })
    .await;
    assert!(dir.join("pods/u-read").exists(), "removed before a delete");
    remove(&p, "u-read").await;
    assert!(!dir.join("pods/u-read").exists());
    let _ = std::fs::remove_dir_all(dir);
}

fn sh(script: &str) -> Vec<String> {
    vec!["sh".into(), "-c".into(), script.into()]
}

fn scratch(s: &mut InstanceSpec) -> vkd_provider::Mount {
    s.volumes = vec![vkd_provider::Volume {
        name: "scratch".into(),
        source: vkd_provider::VolumeSource::EmptyDir {
            size_limit: None,
            memory: false,
        },
    }];
    vkd_provider::Mount {
        volume: "scratch".into(),
        path: "/data".into(),
        ..Default::default()
    }
}

/// A failing init container of a restartPolicy=Always Pod is restarted with
/// back-off and reported (CrashLoopBackOff, its last exit), and the container
/// waits in PodInitializing: what `kubectl get` shows as Init:CrashLoopBackOff.
#[tokio::test(flavor = "multi_thread")]
async fn a_failing_init_container_backs_off_and_is_reported() {
    let (p, dir) = provider();
    let mut s = spec("u-initloop", &["sleep", "60"]);
    s.init_containers = vec![ContainerSpec {
        name: "setup".into(),
        image: "busybox".into(),
        command: sh("echo setting up; exit 3"),
        ..Default::default()
    }];
    p.create(&fence(), &s).await.unwrap();
    let i = wait_for("the init container's back-off", async || {
        let i = p.get("u-initloop").await.unwrap()?;
        let c = i.init_containers.first()?;
        matches!(&c.state, ContainerState::Waiting { reason, .. } if reason == "CrashLoopBackOff")
            .then_some(i)
    })
    .await;
    let c = &i.init_containers[0];
    assert!(c.restart_count >= 1, "{c:?}");
    assert_eq!(c.last_termination.as_ref().unwrap().exit_code, 3);
    assert_eq!(i.phase, InstancePhase::Pending);
    assert!(
        matches!(&i.containers[0].state, ContainerState::Waiting { reason, .. } if reason == "PodInitializing"),
        "{:?}",
        i.containers[0]
    );
    let logs = p
        .logs("u-initloop", "setup", LogRequest::default())
        .await
        .unwrap();
    assert!(
        !logs.history.is_empty(),
        "the init container's log is served"
    );
    remove(&p, "u-initloop").await;
    let _ = std::fs::remove_dir_all(dir);
}

/// Sidecars (restartable init containers): the next init container starts
/// once the sidecar started (its postStart done); a sidecar that exits is
/// restarted although the Pod's restartPolicy is Never; once the container
/// completed, the sidecars are stopped (SIGTERM) and the Pod succeeds.
#[tokio::test(flavor = "multi_thread")]
async fn sidecars_start_in_order_restart_and_stop_after_the_containers() {
    let (p, dir) = provider();
    let mut s = spec("u-sidecar", &[]);
    let mount = scratch(&mut s);
    s.restart_policy = RestartPolicy::Never;
    s.containers[0].command = sh("cat data/order; sleep 1.5");
    s.containers[0].mounts = vec![mount.clone()];
    s.init_containers = vec![
        ContainerSpec {
            name: "proxy".into(),
            image: "busybox".into(),
            restart_always: true,
            command: sh(
                "trap 'echo proxy-stopped >> data/order; exit 0' TERM; while :; do sleep 0.1; done",
            ),
            post_start: Some(Box::new(vkd_provider::Handler::Exec {
                command: sh("sleep 0.3; echo proxy >> data/order"),
            })),
            mounts: vec![mount.clone()],
            ..Default::default()
        },
        ContainerSpec {
            name: "setup".into(),
            image: "busybox".into(),
            command: sh("echo setup >> data/order"),
            mounts: vec![mount.clone()],
            ..Default::default()
        },
        ContainerSpec {
            name: "flaky".into(),
            image: "busybox".into(),
            restart_always: true,
            command: sh("sleep 0.2; exit 1"),
            ..Default::default()
        },
    ];
    p.create(&fence(), &s).await.unwrap();
    let i = running(&p, "u-sidecar").await;
    let proxy = &i.init_containers[0];
    assert!(proxy.has_started() && proxy.ready, "{proxy:?}");
    assert!(
        matches!(&i.init_containers[1].state, ContainerState::Terminated(t) if t.exit_code == 0)
    );
    let i = wait_for("the Pod to complete", async || {
        let i = p.get("u-sidecar").await.unwrap()?;
        (i.phase == InstancePhase::Succeeded).then_some(i)
    })
    .await;
    let logs = p
        .logs("u-sidecar", "main", LogRequest::default())
        .await
        .unwrap();
    let text: Vec<u8> = logs.history.iter().flat_map(|l| l.bytes.to_vec()).collect();
    assert_eq!(String::from_utf8(text).unwrap(), "proxy\nsetup\n");
    let ContainerState::Terminated(t) = &i.init_containers[0].state else {
        panic!("the sidecar is stopped: {:?}", i.init_containers[0]);
    };
    assert_eq!((t.exit_code, t.reason.as_str()), (0, "Completed"));
    let ContainerState::Terminated(main) = &i.containers[0].state else {
        panic!("{:?}", i.containers[0]);
    };
    assert!(
        t.finished_at >= main.finished_at,
        "stopped after the container"
    );
    assert!(
        i.init_containers[2].restart_count >= 1,
        "a sidecar restarts whatever the Pod's restartPolicy: {:?}",
        i.init_containers[2]
    );
    let order = std::fs::read_to_string(dir.join("pods/u-sidecar/volumes/scratch/order")).unwrap();
    assert_eq!(order, "proxy\nsetup\nproxy-stopped\n");
    remove(&p, "u-sidecar").await;
    let _ = std::fs::remove_dir_all(dir);
}

/// An init container after a sidecar fails a restartPolicy=Never Pod: the
/// Pod fails and its sidecar is stopped, not left running.
#[tokio::test(flavor = "multi_thread")]
async fn a_failed_init_container_stops_the_sidecars() {
    let (p, dir) = provider();
    let mut s = spec("u-sidefail", &["sleep", "60"]);
    s.restart_policy = RestartPolicy::Never;
    s.init_containers = vec![
        ContainerSpec {
            name: "proxy".into(),
            image: "busybox".into(),
            restart_always: true,
            command: vec!["sleep".into(), "60".into()],
            ..Default::default()
        },
        ContainerSpec {
            name: "check".into(),
            image: "busybox".into(),
            command: sh("sleep 0.2; exit 7"),
            ..Default::default()
        },
    ];
    p.create(&fence(), &s).await.unwrap();
    let i = wait_for("failed", async || {
        let i = p.get("u-sidefail").await.unwrap()?;
        (i.phase == InstancePhase::Failed).then_some(i)
    })
    .await;
    assert_eq!(i.message.as_deref(), Some("init container check failed"));
    assert!(
        matches!(&i.init_containers[0].state, ContainerState::Terminated(_)),
        "{:?}",
        i.init_containers[0]
    );
    assert!(
        matches!(&i.init_containers[1].state, ContainerState::Terminated(t) if t.exit_code == 7)
    );
    assert!(processes_with("u-sidefail").is_empty());
    remove(&p, "u-sidefail").await;
    let _ = std::fs::remove_dir_all(dir);
}

/// terminationMessagePath (mapped into the Pod's root, as mountPaths are) and
/// FallbackToLogsOnError become the end's message, as the kubelet reads them:
/// the file's last 4096 bytes; the log's tail only for a failure with no file.
/// A file the container turned into a link is not followed.
#[tokio::test(flavor = "multi_thread")]
async fn termination_messages_come_from_the_file_or_the_log() {
    use vkd_provider::TerminationMessagePolicy::FallbackToLogsOnError;
    let (p, dir) = provider();
    let mut s = spec("u-msg", &[]);
    s.restart_policy = RestartPolicy::Never;
    let c = |name: &str, path: Option<&str>, fallback: bool, script: &str| ContainerSpec {
        name: name.into(),
        image: "busybox".into(),
        command: sh(script),
        termination_message_path: path.map(Into::into),
        termination_message_policy: if fallback {
            FallbackToLogsOnError
        } else {
            Default::default()
        },
        ..Default::default()
    };
    s.containers = vec![
        c("file", None, false, "printf bye > dev/termination-log"),
        c(
            "custom",
            Some("/tmp/custom-log"),
            true,
            "echo noise; printf custom > tmp/custom-log; exit 1",
        ),
        c(
            "logs",
            Some("/l/log"),
            true,
            "echo one; echo two >&2; exit 2",
        ),
        c("quiet", Some("/q/log"), true, "echo out; exit 0"),
        c(
            "big",
            Some("/big/log"),
            false,
            "head -c 10000 /dev/zero | tr '\\0' x > big/log; printf END >> big/log",
        ),
        c(
            "sneaky",
            Some("/s/log"),
            false,
            "printf leaked > s/target; rm s/log; ln -s target s/log; exit 1",
        ),
    ];
    p.create(&fence(), &s).await.unwrap();
    let i = wait_for("every container to end", async || {
        let i = p.get("u-msg").await.unwrap()?;
        (i.phase == InstancePhase::Failed).then_some(i)
    })
    .await;
    let message = |name: &str| {
        let c = i.containers.iter().find(|c| c.name == name).unwrap();
        let ContainerState::Terminated(t) = &c.state else {
            panic!("{c:?}");
        };
        t.message.clone()
    };
    assert_eq!(message("file").as_deref(), Some("bye"));
    assert_eq!(message("custom").as_deref(), Some("custom"));
    assert_eq!(message("logs").as_deref(), Some("one\ntwo\n"));
    assert_eq!(message("quiet"), None, "no fallback when it succeeded");
    let big = message("big").unwrap();
    assert_eq!(big.len(), vkd_provider::MAX_TERMINATION_MESSAGE);
    assert!(big.ends_with("xxEND"));
    assert_eq!(message("sneaky"), None, "a link is not followed");
    remove(&p, "u-msg").await;
    let _ = std::fs::remove_dir_all(dir);
}

/// A deleted instance shows how each container ended (the Pod's final status
/// is written from it) before it is gone: the container first, the sidecar
/// after it; the phase follows the containers alone.
#[tokio::test(flavor = "multi_thread")]
async fn a_deleted_instance_shows_how_its_containers_ended() {
    let (p, dir) = provider();
    let mut s = spec("u-ends", &[]);
    s.containers[0].command = sh("trap 'exit 0' TERM; sleep 3600 & wait");
    s.init_containers = vec![ContainerSpec {
        name: "proxy".into(),
        image: "busybox".into(),
        restart_always: true,
        command: vec!["sleep".into(), "3600".into()],
        ..Default::default()
    }];
    p.create(&fence(), &s).await.unwrap();
    running(&p, "u-ends").await;
    // Past its first moments, where a program without a SIGTERM handler would
    // be killed (137) rather than ended by the SIGTERM (143).
    tokio::time::sleep(Duration::from_millis(400)).await;
    p.delete(&fence(), "u-ends", Duration::from_secs(5))
        .await
        .unwrap();
    let i = wait_for("the stopped instance", async || {
        let i = p.get("u-ends").await.unwrap()?;
        (i.phase == InstancePhase::Succeeded).then_some(i)
    })
    .await;
    let (ContainerState::Terminated(main), ContainerState::Terminated(proxy)) =
        (&i.containers[0].state, &i.init_containers[0].state)
    else {
        panic!("{i:?}");
    };
    // The sidecar's sleep, its PID namespace's init with namespaces, ignores
    // SIGTERM as under a runtime and is killed when the grace ends.
    let stopped_by = if p.isolation_mode() == "namespaces" {
        137
    } else {
        143
    };
    assert_eq!((main.exit_code, proxy.exit_code), (0, stopped_by));
    assert!(proxy.finished_at >= main.finished_at);
    wait_for("deletion", async || {
        p.get("u-ends").await.unwrap().is_none().then_some(())
    })
    .await;
    let _ = std::fs::remove_dir_all(dir);
}

/// The log text of a Pod's `main` container.
async fn main_log(p: &ProcessProvider, uid: &str) -> String {
    let Ok(logs) = p.logs(uid, "main", LogRequest::default()).await else {
        return String::new(); // not started yet
    };
    String::from_utf8(logs.history.iter().flat_map(|l| l.bytes.to_vec()).collect()).unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_gpu_pod_sees_exactly_the_gpus_it_was_placed_on() {
    let dir = std::env::temp_dir().join(format!("vkd-process-{}", uuid::Uuid::new_v4().simple()));
    let mut cfg = common::config();
    cfg.gpus = ["GPU-aaaa", "GPU-bbbb"]
        .iter()
        .map(|id| config::GpuConfig {
            id: (*id).into(),
            model: "H100-SXM5-80GB".into(),
            memory: "80Gi".into(),
            nvlink_domain: Some("nvl-0".into()),
            numa_node: None,
            pcie_root: None,
        })
        .collect();
    let p = ProcessProvider::open(cfg, &dir, common::shim_exe()).unwrap();
    let cap = p.capacity().await.unwrap();
    assert_eq!(cap.hosts[0].gpus.len(), 2);
    assert_eq!(cap.hosts[0].gpus_free(), 2);
    // The Pod's own env names every GPU; what it sees is its placement.
    let show = [
        "sh",
        "-c",
        "echo cuda=$CUDA_VISIBLE_DEVICES nvidia=$NVIDIA_VISIBLE_DEVICES; sleep 60",
    ];
    let mut s = spec("u-gpu", &show);
    s.resources.gpus = 1;
    s.containers[0].env = vec![("CUDA_VISIBLE_DEVICES".into(), "0,1".into())];
    let placed = match p.admit(&s).await.unwrap() {
        Admission::Fits(placed) => placed,
        other => panic!("{other:?}"),
    };
    assert_eq!(placed.gpu_ids.len(), 1);
    let gpu = placed.gpu_ids[0].clone();
    s.placement = Some(placed);
    p.create(&fence(), &s).await.unwrap();
    running(&p, "u-gpu").await;
    let out = wait_for("the env in the log", async || {
        let text = main_log(&p, "u-gpu").await;
        text.contains("cuda=").then_some(text)
    })
    .await;
    assert_eq!(out.trim(), format!("cuda={gpu} nvidia={gpu}"));
    let cap = p.capacity().await.unwrap();
    assert_eq!(cap.hosts[0].gpus_free(), 1, "the GPU is held while it runs");
    // Another Pod placed on the same GPU is refused; a Pod without GPUs sees none.
    let mut twin = spec("u-twin", &["sleep", "60"]);
    twin.resources.gpus = 1;
    twin.placement = s.placement.clone();
    assert!(matches!(
        p.create(&fence(), &twin).await,
        Err(vkd_provider::ProviderError::Rejected { .. })
    ));
    let mut none = spec("u-none", &show);
    none.containers[0].env = vec![("NVIDIA_VISIBLE_DEVICES".into(), "all".into())];
    p.create(&fence(), &none).await.unwrap();
    let out = wait_for("the env in the log", async || {
        let text = main_log(&p, "u-none").await;
        text.contains("cuda=").then_some(text)
    })
    .await;
    assert_eq!(out.trim(), "cuda= nvidia=void");
    // Two GPUs: one is held, so the Pod waits.
    let mut two = spec("u-two", &["true"]);
    two.resources.gpus = 2;
    assert!(matches!(
        p.admit(&two).await.unwrap(),
        Admission::Queued { .. }
    ));
    remove(&p, "u-gpu").await;
    remove(&p, "u-none").await;
    assert!(matches!(p.admit(&two).await.unwrap(), Admission::Fits(_)));
    let _ = std::fs::remove_dir_all(dir);
}

/// A `hostPort` is given out by the node policy, as Pod Security's baseline
/// asks, also on a node without a Pod network (where the Pod would bind the
/// host's port itself): none by default, with the reason and the config
/// field that allows it.
#[tokio::test(flavor = "multi_thread")]
async fn a_host_port_is_refused_unless_the_node_allows_it() {
    let (p, dir) = provider();
    let mut s = spec("u-host-port", &["sleep", "3715"]);
    s.host_ports = vec![vkd_provider::HostPort {
        container_port: 8080,
        host_port: 18080,
        protocol: "TCP".into(),
        host_ip: None,
    }];
    let e = p.create(&fence(), &s).await.unwrap_err();
    let text = e.to_string();
    assert!(
        text.contains("HostPortNotAllowed") && text.contains("hostPorts.allowed"),
        "{text}"
    );
    assert!(p.get("u-host-port").await.unwrap().is_none());
    let _ = std::fs::remove_dir_all(dir);
}
