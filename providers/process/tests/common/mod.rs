//! What the process provider's integration tests share: a provider on a
//! directory of its own, a Pod spec, and waiting for what the shim does.
// Each test file is a crate of its own, and uses only part of this.
#![allow(dead_code)]

use std::path::PathBuf;
use std::time::Duration;

use vkd_process::{ProcessConfig, ProcessProvider, config};
use vkd_provider::conformance::sample_spec;
use vkd_provider::{
    ContainerSpec, Fence, Instance, InstancePhase, InstanceSpec, LogRequest, Provider, StreamIo,
};

pub(crate) fn shim_exe() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_vkd-process-shim"))
}

/// busybox images run as `sleep 3600` (or their command), without cgroups.
pub(crate) fn config() -> ProcessConfig {
    ProcessConfig {
        images: vec![config::ImageMap {
            pattern: "busybox*".into(),
            path: None,
            entrypoint: vec!["sleep".into(), "3600".into()],
            args: vec![],
            files: Default::default(),
        }],
        cgroup_parent: "none".into(),
        ..Default::default()
    }
}

/// A provider with `config()` on a new directory, which the test removes.
pub(crate) fn provider() -> (ProcessProvider, PathBuf) {
    let dir = std::env::temp_dir().join(format!("vkd-process-{}", uuid::Uuid::new_v4().simple()));
    let p = ProcessProvider::open(config(), &dir, shim_exe()).unwrap();
    (p, dir)
}

/// The provider, when this host gives containers namespaces; else `None`
/// (the test says so and passes: there is nothing to isolate with).
pub(crate) fn isolated() -> Option<(ProcessProvider, PathBuf)> {
    let (p, dir) = provider();
    if p.isolation_mode() == "namespaces" {
        Some((p, dir))
    } else {
        eprintln!("no namespaces here (not root?): nothing to check");
        let _ = std::fs::remove_dir_all(dir);
        None
    }
}

pub(crate) fn fence() -> Fence {
    Fence {
        node: "node-p".into(),
        epoch: 1,
    }
}

/// A Pod of one container, `main`, a busybox running `command`.
pub(crate) fn spec(uid: &str, command: &[&str]) -> InstanceSpec {
    let mut s = sample_spec("node-p", uid);
    s.containers = vec![ContainerSpec {
        name: "main".into(),
        image: "busybox".into(),
        command: command.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    }];
    s
}

/// Asks `f` every 100 ms, for 20 s at the most, until it answers.
pub(crate) async fn wait_for<T>(what: &str, mut f: impl AsyncFnMut() -> Option<T>) -> T {
    for _ in 0..200 {
        if let Some(v) = f().await {
            return v;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("timed out waiting for {what}");
}

/// Waits until the Pod runs.
pub(crate) async fn running(p: &ProcessProvider, uid: &str) -> Instance {
    wait_for("running", async || {
        let i = p.get(uid).await.unwrap()?;
        (i.phase == InstancePhase::Running).then_some(i)
    })
    .await
}

/// Deletes the Pod (a 1 s grace period) and waits until it is gone.
pub(crate) async fn remove(p: &ProcessProvider, uid: &str) {
    p.delete(&fence(), uid, Duration::from_secs(1))
        .await
        .unwrap();
    wait_for("deletion", async || {
        p.get(uid).await.unwrap().is_none().then_some(())
    })
    .await;
}

/// An exec's streams: its output to `stdout`, no input.
pub(crate) fn stream_io(stdout: tokio::io::DuplexStream, tty: bool) -> StreamIo {
    StreamIo {
        stdin: None,
        stdout: Some(Box::new(stdout)),
        stderr: None,
        tty,
        resize: None,
    }
}

/// The container's log of its current run, as text.
pub(crate) async fn log_text(p: &ProcessProvider, uid: &str, name: &str) -> String {
    let logs = p.logs(uid, name, LogRequest::default()).await.unwrap();
    let bytes: Vec<u8> = logs.history.iter().flat_map(|l| l.bytes.to_vec()).collect();
    String::from_utf8(bytes).unwrap()
}
