//! `kubectl attach` on the process provider: stdin through the shim, output
//! from the log, across a restart of the provider, and `stdinOnce`.
#![allow(clippy::unwrap_used)] // a test file: a failed unwrap is a failed test

mod common;

use std::time::Duration;

use common::{fence, provider, remove, running, spec};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use vkd_process::ProcessProvider;
use vkd_provider::{Provider, StreamIo};

/// A session's streams without a tty: the client's ends of stdin and
/// stdout, and what the provider gets.
fn session_io() -> (tokio::io::DuplexStream, tokio::io::DuplexStream, StreamIo) {
    let (stdin_w, stdin_r) = tokio::io::duplex(1024);
    let (stdout_w, stdout_r) = tokio::io::duplex(64 * 1024);
    let io = StreamIo {
        stdin: Some(Box::new(stdin_r)),
        stdout: Some(Box::new(stdout_w)),
        stderr: None,
        tty: false,
        resize: None,
    };
    (stdin_w, stdout_r, io)
}

/// Attaches to `main`, sends `input`, and returns what came out until `until`
/// appeared (or 20 s passed); the session is then dropped, as a client that
/// goes away.
async fn attach_and_send(p: &ProcessProvider, uid: &str, input: &str, until: &str) -> String {
    let (mut stdin_w, mut stdout_r, io) = session_io();
    let session = p.attach(uid, "main", io);
    let client = async {
        // Give the attach a moment to follow the log from its end.
        tokio::time::sleep(Duration::from_millis(300)).await;
        stdin_w.write_all(input.as_bytes()).await.unwrap();
        let mut seen = String::new();
        let mut buf = [0u8; 4096];
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        while !seen.contains(until) {
            match tokio::time::timeout_at(deadline, stdout_r.read(&mut buf)).await {
                Ok(Ok(n)) if n > 0 => seen.push_str(&String::from_utf8_lossy(&buf[..n])),
                _ => break,
            }
        }
        seen
    };
    tokio::select! {
        seen = client => seen,
        r = session => panic!("the attach ended first: {r:?}"),
    }
}

fn echo_spec(uid: &str, once: bool) -> vkd_provider::InstanceSpec {
    let mut s = spec(
        uid,
        &[
            "sh",
            "-c",
            "while read line; do echo \"echo:$line\"; done; echo stdin-closed; sleep 3600",
        ],
    );
    s.containers[0].stdin = true;
    s.containers[0].stdin_once = once;
    s
}

#[tokio::test(flavor = "multi_thread")]
async fn attach_feeds_stdin_and_survives_a_new_provider() {
    let (p, dir) = provider();
    p.create(&fence(), &echo_spec("u-attach", false))
        .await
        .unwrap();
    running(&p, "u-attach").await;
    let seen = attach_and_send(&p, "u-attach", "hello\n", "echo:hello").await;
    assert!(seen.contains("echo:hello"), "{seen:?}");
    // A second session, then the same through a provider opened afresh (vkd
    // restarted): the shim kept the pipe, the program still reads it.
    let seen = attach_and_send(&p, "u-attach", "second\n", "echo:second").await;
    assert!(seen.contains("echo:second"), "{seen:?}");
    drop(p);
    let again = ProcessProvider::open(common::config(), &dir, common::shim_exe()).unwrap();
    let seen = attach_and_send(&again, "u-attach", "after\n", "echo:after").await;
    assert!(seen.contains("echo:after"), "{seen:?}");
    let i = again.get("u-attach").await.unwrap().unwrap();
    assert_eq!(i.containers[0].restart_count, 0, "the same run throughout");
    remove(&again, "u-attach").await;
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread")]
async fn stdin_once_closes_when_the_first_session_ends() {
    let (p, dir) = provider();
    p.create(&fence(), &echo_spec("u-once", true))
        .await
        .unwrap();
    running(&p, "u-once").await;
    let seen = attach_and_send(&p, "u-once", "only\n", "echo:only").await;
    assert!(seen.contains("echo:only"), "{seen:?}");
    // The session is gone: the program reads end-of-file.
    common::wait_for("stdin closed", async || {
        common::log_text(&p, "u-once", "main")
            .await
            .contains("stdin-closed")
            .then_some(())
    })
    .await;
    remove(&p, "u-once").await;
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_container_without_stdin_reads_end_of_file() {
    let (p, dir) = provider();
    let mut s = echo_spec("u-nostdin", false);
    s.containers[0].stdin = false;
    p.create(&fence(), &s).await.unwrap();
    running(&p, "u-nostdin").await;
    common::wait_for("stdin closed at once", async || {
        common::log_text(&p, "u-nostdin", "main")
            .await
            .contains("stdin-closed")
            .then_some(())
    })
    .await;
    remove(&p, "u-nostdin").await;
    let _ = std::fs::remove_dir_all(dir);
}

/// Attaches to `main`, sends `input` and ends stdin at once, as
/// `kubectl attach -i < file` or `kubectl run -i`; returns what came out and
/// whether the session ended within `within`.
async fn attach_and_hang_up(
    p: &ProcessProvider,
    uid: &str,
    input: &str,
    within: Duration,
) -> (String, bool) {
    let (mut stdin_w, mut stdout_r, io) = session_io();
    stdin_w.write_all(input.as_bytes()).await.unwrap();
    drop(stdin_w);
    let ended = tokio::time::timeout(within, p.attach(uid, "main", io))
        .await
        .is_ok_and(|r| r.is_ok());
    let mut seen = String::new();
    let _ = tokio::time::timeout(
        Duration::from_millis(500),
        stdout_r.read_to_string(&mut seen),
    )
    .await;
    (seen, ended)
}

/// Without `stdinOnce`, the end of the client's stdin ends the session, as
/// containerd's attach detaches: `kubectl run -i --leave-stdin-open` returns,
/// and the container keeps running with its stdin open for the next session.
#[tokio::test(flavor = "multi_thread")]
async fn the_end_of_the_clients_stdin_detaches_a_session_without_stdin_once() {
    let (p, dir) = provider();
    p.create(&fence(), &echo_spec("u-detach", false))
        .await
        .unwrap();
    running(&p, "u-detach").await;
    let (_, ended) = attach_and_hang_up(&p, "u-detach", "first\n", Duration::from_secs(10)).await;
    assert!(ended, "the session outlived the client's stdin");
    common::wait_for("the line fed before the end", async || {
        common::log_text(&p, "u-detach", "main")
            .await
            .contains("echo:first")
            .then_some(())
    })
    .await;
    let seen = attach_and_send(&p, "u-detach", "again\n", "echo:again").await;
    assert!(seen.contains("echo:again"), "{seen:?}");
    let log = common::log_text(&p, "u-detach", "main").await;
    assert!(!log.contains("stdin-closed"), "{log}");
    remove(&p, "u-detach").await;
    let _ = std::fs::remove_dir_all(dir);
}

/// With `stdinOnce`, the end of the client's stdin closes the container's, and
/// the session shows what the container writes after it, to its end: what
/// `kubectl run -i` prints.
#[tokio::test(flavor = "multi_thread")]
async fn with_stdin_once_the_session_lasts_until_the_container_ends() {
    let (p, dir) = provider();
    let mut s = spec(
        "u-once-end",
        &[
            "sh",
            "-c",
            "while read line; do echo \"echo:$line\"; done; sleep 1; echo stdin-closed",
        ],
    );
    s.containers[0].stdin = true;
    s.containers[0].stdin_once = true;
    s.restart_policy = vkd_provider::RestartPolicy::Never;
    p.create(&fence(), &s).await.unwrap();
    running(&p, "u-once-end").await;
    let (seen, ended) =
        attach_and_hang_up(&p, "u-once-end", "last\n", Duration::from_secs(20)).await;
    assert!(ended, "the session outlived the container");
    assert!(seen.contains("stdin-closed"), "{seen:?}");
    remove(&p, "u-once-end").await;
    let _ = std::fs::remove_dir_all(dir);
}
