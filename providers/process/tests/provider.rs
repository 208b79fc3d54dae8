//! The process provider against real processes: conformance, logs, restarts, exec, adoption.
#![allow(clippy::unwrap_used)] // a test file: a failed unwrap is a failed test

use std::path::PathBuf;
use std::time::Duration;

use tokio::io::AsyncReadExt;
use vkd_process::{ProcessConfig, ProcessProvider, config};
use vkd_provider::conformance::{Kit, sample_spec};
use vkd_provider::{
    Admission, ContainerSpec, ContainerState, Fence, InstancePhase, InstanceSpec, LogRequest,
    Provider, RestartPolicy, StreamIo,
};

fn shim_exe() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_vkd-process-shim"))
}

fn provider() -> (ProcessProvider, PathBuf) {
    let dir = std::env::temp_dir().join(format!("vkd-process-{}", uuid::Uuid::new_v4().simple()));
    let config = ProcessConfig {
        images: vec![config::ImageMap {
            pattern: "busybox*".into(),
            path: None,
            entrypoint: vec!["sleep".into(), "3600".into()],
        }],
        cgroup_parent: "none".into(),
        ..Default::default()
    };
    let p = ProcessProvider::open(config, &dir, shim_exe()).unwrap();
    (p, dir)
}

fn fence() -> Fence {
    Fence {
        node: "node-p".into(),
        epoch: 1,
    }
}

fn spec(uid: &str, command: &[&str]) -> InstanceSpec {
    let mut s = sample_spec("node-p", uid);
    s.containers = vec![ContainerSpec {
        name: "main".into(),
        image: "busybox".into(),
        command: command.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    }];
    s
}

async fn wait_for<T>(what: &str, mut f: impl AsyncFnMut() -> Option<T>) -> T {
    for _ in 0..200 {
        if let Some(v) = f().await {
            return v;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("timed out waiting for {what}");
}

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
                follow: false,
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
    assert!(out.trim_end().ends_with("u-exec/root/work"), "{out:?}");
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

fn stream_io(stdout: tokio::io::DuplexStream, tty: bool) -> StreamIo {
    StreamIo {
        stdin: None,
        stdout: Some(Box::new(stdout)),
        stderr: None,
        tty,
        resize: None,
    }
}

async fn running(p: &ProcessProvider, uid: &str) -> vkd_provider::Instance {
    wait_for("running", async || {
        let i = p.get(uid).await.unwrap()?;
        (i.phase == InstancePhase::Running).then_some(i)
    })
    .await
}

async fn remove(p: &ProcessProvider, uid: &str) {
    p.delete(&fence(), uid, Duration::from_secs(1))
        .await
        .unwrap();
    wait_for("deletion", async || {
        p.get(uid).await.unwrap().is_none().then_some(())
    })
    .await;
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
        source: vkd_provider::VolumeSource::EmptyDir { size_limit: None },
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
