//! Ephemeral containers (`kubectl debug`) in the process provider, with real
//! processes: started in a running Pod's sandbox as its containers are, logged,
//! exec'd into, recorded when they exit, seen by a provider opened afresh (as
//! after a restart of vkd), and ended with the Pod.
#![allow(clippy::unwrap_used)] // a test file: a failed unwrap is a failed test

mod common;

use std::time::Duration;

use common::{
    config, fence, log_text, provider, remove, running, shim_exe, spec, stream_io, wait_for,
};
use tokio::io::AsyncReadExt;
use vkd_process::ProcessProvider;
use vkd_provider::{
    ContainerSpec, ContainerState, ContainerStatus, InstancePhase, InstanceSpec, Provider,
    ProviderError, RestartPolicy, Support,
};

/// `main` with `WHO=main` in its environment, and a short grace period.
fn pod(uid: &str, command: &[&str]) -> InstanceSpec {
    let mut s = spec(uid, command);
    s.containers[0].env = vec![("WHO".into(), "main".into())];
    s.termination_grace = Duration::from_secs(2);
    s
}

fn debugger(name: &str, script: &str) -> ContainerSpec {
    ContainerSpec {
        name: name.into(),
        image: "busybox".into(),
        command: vec!["sh".into(), "-c".into(), script.into()],
        env: vec![("WHO".into(), name.into())],
        ..Default::default()
    }
}

async fn ephemeral(p: &ProcessProvider, uid: &str, name: &str) -> Option<ContainerStatus> {
    let i = p.get(uid).await.unwrap()?;
    i.ephemeral_containers.into_iter().find(|c| c.name == name)
}

/// Live processes whose command line is exactly `cmdline` (NUL-separated).
fn processes(cmdline: &str) -> usize {
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter(|e| {
            let cmd = std::fs::read(e.path().join("cmdline")).unwrap_or_default();
            let zombie = std::fs::read_to_string(e.path().join("stat")).is_ok_and(|s| {
                s.rsplit(')')
                    .next()
                    .is_some_and(|r| r.trim_start().starts_with('Z'))
            });
            String::from_utf8_lossy(&cmd).replace('\0', " ").trim_end() == cmdline && !zombie
        })
        .count()
}

#[tokio::test(flavor = "multi_thread")]
async fn an_ephemeral_container_runs_in_the_pods_sandbox_and_ends_with_it() {
    let (p, dir) = provider();
    assert_eq!(p.capabilities().ephemeral_containers, Support::Supported);
    let uid = "u-eph";
    p.create(&fence(), &pod(uid, &["sleep", "60"]))
        .await
        .unwrap();
    running(&p, uid).await;

    // One that keeps running (as the e2e spec's "while true; do echo polo"),
    // and one that exits on its own.
    let polo = debugger(
        "debugger",
        "echo polo from $WHO as $(id -u) in $PWD; exec sleep 3017",
    );
    p.start_ephemeral(&fence(), uid, &polo).await.unwrap();
    let c = wait_for("the debugger running", async || {
        let c = ephemeral(&p, uid, "debugger").await?;
        matches!(c.state, ContainerState::Running { .. }).then_some(c)
    })
    .await;
    assert!(
        c.container_id
            .as_deref()
            .is_some_and(|id| id.starts_with("process://")),
        "{c:?}"
    );
    // Started once: asking again (a retried reconcile, a restarted vkd) is a no-op.
    p.start_ephemeral(&fence(), uid, &polo).await.unwrap();
    let text = wait_for("its log", async || {
        let t = log_text(&p, uid, "debugger").await;
        t.contains("polo").then_some(t)
    })
    .await;
    assert!(
        text.starts_with("polo from debugger as 65534 in "),
        "{text:?}"
    );
    // With namespaces its own root, as the Pod's containers have: its
    // working directory is the path the spec names ("/" when none).
    if p.isolation_mode() == "namespaces" {
        assert!(text.trim_end().ends_with(" in /"), "{text:?}");
    } else {
        assert!(
            text.trim_end().ends_with(&format!("{uid}/root")),
            "{text:?}"
        );
    }
    assert_eq!(processes("sleep 3017"), 1);

    // kubectl exec into it: its own environment, the Pod's user.
    let (w, mut r) = tokio::io::duplex(4096);
    let code = p
        .exec(
            uid,
            "debugger",
            vec!["sh".into(), "-c".into(), "echo marco $WHO; exit 3".into()],
            stream_io(w, false),
        )
        .await
        .unwrap();
    assert_eq!(code, 3);
    let mut out = String::new();
    r.read_to_string(&mut out).await.unwrap();
    assert_eq!(out, "marco debugger\n");

    let quick = debugger("quick", "echo bye; echo oops >&2; exit 7");
    p.start_ephemeral(&fence(), uid, &quick).await.unwrap();
    let t = wait_for("quick to exit", async || {
        match ephemeral(&p, uid, "quick").await?.state {
            ContainerState::Terminated(t) => Some(t),
            _ => None,
        }
    })
    .await;
    assert_eq!((t.exit_code, t.reason.as_str()), (7, "Error"), "{t:?}");
    assert!(t.started_at.is_some());
    let text = log_text(&p, uid, "quick").await;
    assert!(
        text.contains("bye\n") && text.contains("oops\n"),
        "{text:?}"
    );
    // Never restarted, and the Pod's own container goes on.
    tokio::time::sleep(Duration::from_millis(700)).await;
    let i = p.get(uid).await.unwrap().unwrap();
    assert_eq!(i.phase, InstancePhase::Running);
    let q = i
        .ephemeral_containers
        .iter()
        .find(|c| c.name == "quick")
        .unwrap();
    assert_eq!(q.restart_count, 0);
    assert!(matches!(q.state, ContainerState::Terminated(_)));

    // What cannot run is refused, naming why.
    let mut unmapped = debugger("other", "true");
    unmapped.image = "nginx".into();
    match p.start_ephemeral(&fence(), uid, &unmapped).await {
        Err(ProviderError::Invalid { reason, .. }) => assert_eq!(reason, "ImageNotRunnable"),
        other => panic!("{other:?}"),
    }
    match p
        .start_ephemeral(&fence(), uid, &debugger("main", "true"))
        .await
    {
        Err(ProviderError::Invalid { reason, .. }) => assert_eq!(reason, "InvalidSpec"),
        other => panic!("{other:?}"),
    }
    match p
        .start_ephemeral(&fence(), "u-none", &debugger("x", "true"))
        .await
    {
        Err(ProviderError::NotFound { .. }) => {}
        other => panic!("{other:?}"),
    }

    // A provider opened afresh (vkd restarted) sees what the shim recorded.
    let again = ProcessProvider::open(config(), &dir, shim_exe()).unwrap();
    let i = again.get(uid).await.unwrap().unwrap();
    let names: Vec<&str> = i
        .ephemeral_containers
        .iter()
        .map(|c| c.name.as_str())
        .collect();
    assert_eq!(names, ["debugger", "quick"]);
    assert!(matches!(
        i.ephemeral_containers[0].state,
        ContainerState::Running { .. }
    ));
    drop(again);

    // The Pod ends: its ephemeral container ends with it, recorded.
    remove(&p, uid).await;
    assert_eq!(
        processes("sleep 3017"),
        0,
        "the ephemeral container outlived its Pod"
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread")]
async fn an_ephemeral_container_stops_when_the_pods_containers_end() {
    let (p, dir) = provider();
    let uid = "u-eph-end";
    let mut s = pod(uid, &["sh", "-c", "sleep 2"]);
    s.restart_policy = RestartPolicy::Never;
    p.create(&fence(), &s).await.unwrap();
    running(&p, uid).await;
    p.start_ephemeral(&fence(), uid, &debugger("dbg", "exec sleep 3018"))
        .await
        .unwrap();
    let i = wait_for("the Pod to end", async || {
        let i = p.get(uid).await.unwrap()?;
        let ended = matches!(i.phase, InstancePhase::Succeeded | InstancePhase::Failed);
        let recorded = i
            .ephemeral_containers
            .iter()
            .any(|c| matches!(c.state, ContainerState::Terminated(_)));
        (ended && recorded).then_some(i)
    })
    .await;
    // Ephemeral containers do not count toward the phase.
    assert_eq!(i.phase, InstancePhase::Succeeded);
    let ContainerState::Terminated(t) = &i.ephemeral_containers[0].state else {
        unreachable!()
    };
    // With namespaces the program is its PID namespace's init, which ignores
    // a SIGTERM it has no handler for: the grace period ends in SIGKILL.
    let signal = if p.isolation_mode() == "namespaces" {
        9
    } else {
        15
    };
    assert_eq!(t.exit_code, 128 + signal, "{t:?}");
    assert_eq!(processes("sleep 3018"), 0);
    // Nothing starts in a Pod that has ended.
    match p
        .start_ephemeral(&fence(), uid, &debugger("late", "true"))
        .await
    {
        Err(ProviderError::Invalid { reason, .. }) => assert_eq!(reason, "PodNotRunning"),
        other => panic!("{other:?}"),
    }
    p.delete(&fence(), uid, Duration::ZERO).await.unwrap();
    let _ = std::fs::remove_dir_all(dir);
}
