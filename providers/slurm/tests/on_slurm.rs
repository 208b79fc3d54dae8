//! `vkd-slurm serve` on a real Slurm cluster (Debian's slurm-wlm 22.05, three
//! slurmd with 4, 2 and 2 GPUs), used over the provider protocol as vkd uses
//! it: the conformance kit passes; logs and exec reach the job; a Pod no node
//! can hold is refused in Slurm's words; a Pod that must wait is a pending
//! job with Slurm's reason and runs once a job ends; deletion gives the grace
//! period; a stale epoch is refused by the plugin and by slurmctld itself.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a failed unwrap is a failed test

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tokio::io::AsyncReadExt;
use vkd_e2e::slurm::SlurmCluster;
use vkd_grpc::{Endpoint, GrpcProvider};
use vkd_provider::conformance::{Kit, sample_spec};
use vkd_provider::{
    Admission, ContainerSpec, ContainerState, Fence, InstancePhase, InstanceSpec, LogRequest,
    Provider, ProviderError, StreamIo,
};

const NODE: &str = "vk-slurm";

fn tempdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("vkd-slurm-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

struct Plugin(Child);

impl Drop for Plugin {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn serve(cluster: &SlurmCluster, state: &Path, socket: &Path) -> Plugin {
    let log = std::fs::File::create(state.with_extension("log")).unwrap();
    let child = Command::new(env!("CARGO_BIN_EXE_vkd-slurm"))
        .arg("serve")
        .arg(format!("--listen=unix://{}", socket.display()))
        .arg(format!("--state-dir={}", state.display()))
        .arg(format!("--slurm-conf={}", cluster.conf().display()))
        .arg("--poll=500ms")
        // The test cluster runs its jobs as the test's user, root here.
        .arg("--jobs-as-root")
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .unwrap();
    Plugin(child)
}

async fn connect(socket: &Path) -> GrpcProvider {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match GrpcProvider::connect(Endpoint::unix(socket.to_owned()), Duration::from_secs(30))
            .await
        {
            Ok(p) => return p,
            Err(e) if Instant::now() > deadline => panic!("the plugin never answered: {e}"),
            Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
}

fn fence(epoch: u64) -> Fence {
    Fence {
        node: NODE.into(),
        epoch,
    }
}

fn pod(uid: &str, gpus: u32, script: &str) -> InstanceSpec {
    let mut spec = sample_spec(NODE, uid);
    spec.resources.gpus = gpus;
    spec.containers = vec![ContainerSpec {
        name: "main".into(),
        image: "busybox".into(),
        command: vec!["sh".into(), "-c".into(), script.into()],
        env: vec![("GREETING".into(), "hello from slurm".into())],
        ..Default::default()
    }];
    spec
}

async fn until<T>(what: &str, secs: u64, mut f: impl AsyncFnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn phase(p: &GrpcProvider, uid: &str) -> Option<InstancePhase> {
    p.get(uid).await.unwrap().map(|i| i.phase)
}

async fn gone(p: &GrpcProvider, uid: &str, secs: u64) {
    until(&format!("{uid} gone"), secs, async || {
        p.get(uid).await.unwrap().is_none().then_some(())
    })
    .await;
}

/// Waits for the container `main` to have written its first log line: its
/// script has begun, and any `trap` before that line is set.
async fn logging(p: &GrpcProvider, uid: &str) {
    until(&format!("{uid} logging"), 30, async || {
        let logs = p.logs(uid, "main", LogRequest::default()).await.ok()?;
        (!logs.history.is_empty()).then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pods_as_slurm_jobs_on_a_real_cluster() {
    let t0 = Instant::now();
    let mark = |what: &str| eprintln!("[{:>6.1}s] {what}", t0.elapsed().as_secs_f64());
    let dir = tempdir("provider");
    let state = dir.join("state");
    let lua = vkd_slurm::SlurmProvider::job_submit_lua(&state);
    let cluster = SlurmCluster::start(&dir.join("slurm"), &[4, 2, 2], Some(&lua)).unwrap();
    let socket = dir.join("plugin.sock");
    let _plugin = serve(&cluster, &state, &socket);
    let p = connect(&socket).await;

    mark("Capacity:");
    // Capacity: one host slice a node, its GRES as GPUs, never summed.
    let cap = p.capacity().await.unwrap();
    let mut gpus: Vec<(String, usize)> = cap
        .hosts
        .iter()
        .map(|h| (h.name.clone(), h.gpus.len()))
        .collect();
    gpus.sort();
    assert_eq!(
        gpus,
        [("n1".into(), 4), ("n2".into(), 2), ("n3".into(), 2)],
        "{cap:?}"
    );
    assert!(p.capabilities().supported().contains(&"backend-queue"));
    // The Pods' specs (their env) are the jobs' account's alone.
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(state.join("pods"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o700, "the Pods' directory is {mode:o}");

    mark("The conformance kit");
    // The conformance kit, over the wire.
    let mut kit = Kit::new(&p, NODE, sample_spec);
    kit.patience = Duration::from_secs(30);
    for (check, result) in kit.report().await {
        assert!(result.is_ok(), "conformance check {check}: {result:?}");
    }
    drop(kit);
    // The kit's last epoch was 11; what follows acts at 20.
    let f = fence(20);

    mark("Logs and exec.");
    // Logs and exec.
    let hello = pod(
        "hello",
        0,
        "echo \"$GREETING\"; echo to-stderr >&2; sleep 600",
    );
    p.create(&f, &hello).await.unwrap();
    until("hello running", 30, async || {
        (phase(&p, "hello").await == Some(InstancePhase::Running)).then_some(())
    })
    .await;
    let text = until("hello's log", 20, async || {
        let logs = p
            .logs("hello", "main", LogRequest::default())
            .await
            .unwrap();
        let text: String = logs
            .history
            .iter()
            .map(|l| String::from_utf8_lossy(&l.bytes).into_owned())
            .collect();
        text.contains("to-stderr").then_some(text)
    })
    .await;
    assert!(text.contains("hello from slurm\n"), "{text:?}");
    let (out_w, mut out_r) = tokio::io::duplex(4096);
    let (stdin_r, stdin_w) = tokio::io::duplex(64);
    drop(stdin_w);
    let code = p
        .exec(
            "hello",
            "main",
            vec![
                "sh".into(),
                "-c".into(),
                "echo \"$GREETING on $SLURM_JOB_ID\"; exit 3".into(),
            ],
            StreamIo {
                stdin: Some(Box::new(stdin_r)),
                stdout: Some(Box::new(out_w)),
                stderr: None,
                tty: false,
                resize: None,
            },
        )
        .await
        .unwrap();
    let mut out = String::new();
    out_r.read_to_string(&mut out).await.unwrap();
    let job = p.get("hello").await.unwrap().unwrap().id;
    assert_eq!(code, 3);
    assert_eq!(
        out.trim(),
        format!("hello from slurm on {}", job.trim_start_matches("slurm-"))
    );

    mark("Eight GPUs");
    // With a terminal: the command sees one, and what it prints comes back.
    let (out_w, mut out_r) = tokio::io::duplex(4096);
    let (stdin_r, mut stdin_w) = tokio::io::duplex(64);
    let (resize_tx, resize_rx) = tokio::sync::mpsc::channel(4);
    resize_tx
        .send(vkd_provider::TermSize {
            width: 100,
            height: 30,
        })
        .await
        .unwrap();
    let session = p.exec(
        "hello",
        "main",
        vec![
            "sh".into(),
            "-c".into(),
            "tty; stty size; read line; echo \"read $line\"".into(),
        ],
        StreamIo {
            stdin: Some(Box::new(stdin_r)),
            stdout: Some(Box::new(out_w)),
            stderr: None,
            tty: true,
            resize: Some(resize_rx),
        },
    );
    let typing = async {
        tokio::time::sleep(Duration::from_secs(1)).await;
        use tokio::io::AsyncWriteExt;
        stdin_w.write_all(b"typed\n").await.unwrap();
    };
    let (code, ()) = tokio::join!(session, typing);
    assert_eq!(code.unwrap(), 0);
    let mut out = String::new();
    out_r.read_to_string(&mut out).await.unwrap();
    assert!(out.starts_with("/dev/pts/"), "tty said {out:?}");
    assert!(out.contains("30 100"), "{out:?}");
    assert!(out.contains("read typed"), "{out:?}");

    // Eight GPUs: no node has them; Slurm's own words say so.
    match p.admit(&pod("eight", 8, "true")).await.unwrap() {
        Admission::Rejected { reason, message } => {
            assert_eq!(reason, "SlurmRejected");
            assert!(
                message.contains("Requested node configuration is not available"),
                "{message}"
            );
        }
        other => panic!("an 8-GPU Pod was {other:?}"),
    }

    mark("Four GPUs twice");
    // Four GPUs twice: the second waits in Slurm's queue, then runs.
    let a = pod("four-a", 4, "sleep 600");
    let b = pod("four-b", 4, "echo ran; sleep 600");
    assert!(matches!(p.admit(&b).await.unwrap(), Admission::Fits(_)));
    p.create(&f, &a).await.unwrap();
    until("four-a running", 30, async || {
        (phase(&p, "four-a").await == Some(InstancePhase::Running)).then_some(())
    })
    .await;
    p.create(&f, &b).await.unwrap();
    let waiting = until("four-b queued with Slurm's reason", 30, async || {
        let i = p.get("four-b").await.unwrap()?;
        match &i.containers[0].state {
            ContainerState::Waiting { reason, message } if reason == "BackendQueued" => {
                Some((i.phase, message.clone().unwrap_or_default()))
            }
            _ => None,
        }
    })
    .await;
    assert_eq!(waiting.0, InstancePhase::Pending);
    assert!(waiting.1.ends_with("is pending: Resources"), "{waiting:?}");
    p.delete(&f, "four-a", Duration::ZERO).await.unwrap();
    until("four-b running once four-a ended", 60, async || {
        (phase(&p, "four-b").await == Some(InstancePhase::Running)).then_some(())
    })
    .await;
    gone(&p, "four-a", 30).await;

    mark("Deletion with grace");
    // Deletion with grace: the container's TERM handler runs and is heard.
    let graceful = pod(
        "graceful",
        0,
        "trap 'echo got TERM; exit 0' TERM; echo up; while :; do sleep 0.2; done",
    );
    p.create(&f, &graceful).await.unwrap();
    logging(&p, "graceful").await;
    let logs = p
        .logs(
            "graceful",
            "main",
            LogRequest {
                follow: true,
                ..Default::default()
            },
        )
        .await
        .unwrap();
    p.delete(&f, "graceful", Duration::from_secs(20))
        .await
        .unwrap();
    let mut followed = String::new();
    use futures::StreamExt;
    let mut follow = logs.follow.unwrap();
    let heard = tokio::time::timeout(Duration::from_secs(15), async {
        while let Some(l) = follow.next().await {
            followed.push_str(&String::from_utf8_lossy(&l.bytes));
            if followed.contains("got TERM") {
                return true;
            }
        }
        false
    })
    .await;
    assert_eq!(heard, Ok(true), "followed: {followed:?}");
    gone(&p, "graceful", 20).await;

    mark("A container that ignores TERM");
    // A container that ignores TERM is killed once the grace period is over.
    let stubborn = pod(
        "stubborn",
        0,
        "trap '' TERM; echo up; while :; do sleep 0.2; done",
    );
    p.create(&f, &stubborn).await.unwrap();
    // Deleted only once its shell has said "up": a TERM that came before the
    // `trap` ran would end it at once, as it would on a kubelet.
    logging(&p, "stubborn").await;
    // (squeue's answer is kept for a second: the job may still read Pending.)
    until("stubborn running", 30, async || {
        (phase(&p, "stubborn").await == Some(InstancePhase::Running)).then_some(())
    })
    .await;
    let asked = Instant::now();
    p.delete(&f, "stubborn", Duration::from_secs(3))
        .await
        .unwrap();
    gone(&p, "stubborn", 30).await;
    let took = asked.elapsed();
    assert!(
        took >= Duration::from_secs(3),
        "gone after {took:?}, before its grace"
    );

    mark("What a job can write");
    // A job can write the state dir (it runs as the plugin's account): a
    // directory that copies hello's spec and job id is not a second
    // instance of hello, and a job that is not a Pod's is never cancelled.
    let forged = state.join("pods/0f3c9a2e-forged");
    std::fs::create_dir_all(&forged).unwrap();
    let hello_dir = state.join("pods/hello");
    std::fs::copy(hello_dir.join("spec.json"), forged.join("spec.json")).unwrap();
    std::fs::copy(hello_dir.join("job-id"), forged.join("job-id")).unwrap();
    let listed = p.list(NODE).await.unwrap();
    let owners: Vec<&str> = listed.iter().map(|i| i.owner.uid.as_str()).collect();
    assert_eq!(
        owners.iter().filter(|u| **u == "hello").count(),
        1,
        "{owners:?}"
    );
    std::fs::remove_dir_all(&forged).unwrap();
    let other: u64 = cluster
        .command(
            "sbatch",
            &["--parsable", "--job-name=not-a-pod", "--wrap=sleep 120"],
        )
        .unwrap()
        .trim()
        .split(';')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    p.delete_instance(&f, &format!("slurm-{other}"), Duration::ZERO)
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let jobs = cluster.jobs().unwrap();
    assert!(
        jobs.iter()
            .any(|(id, _, state, _)| *id == other && state != "CANCELLED"),
        "a job that is no Pod's was cancelled: {jobs:?}"
    );
    cluster
        .command("scancel", &[other.to_string().as_str()])
        .unwrap();

    mark("A deposed leader");
    // A deposed leader: the plugin refuses it, and so does slurmctld.
    p.takeover(&fence(21)).await.unwrap();
    match p.create(&fence(20), &pod("stale", 0, "true")).await {
        Err(ProviderError::Fenced { current, got, .. }) => assert_eq!((current, got), (21, 20)),
        other => panic!("a stale create gave {other:?}"),
    }
    let refused = cluster
        .command(
            "sbatch",
            &[
                "--comment=vkd:node=vk-slurm;epoch=20;pod=ns/stale",
                "--wrap=true",
            ],
        )
        .unwrap_err()
        .to_string();
    assert!(
        refused.contains("vkd fence: node vk-slurm is at epoch 21, this job carries epoch 20"),
        "{refused}"
    );
    assert!(
        !cluster
            .jobs()
            .unwrap()
            .iter()
            .any(|(_, name, _, _)| name == "vkd-stale" || name == "wrap"),
        "a stale job was queued"
    );

    mark("cleanup");
    for uid in ["hello", "four-b"] {
        p.delete(&fence(21), uid, Duration::ZERO).await.unwrap();
    }
    for uid in ["hello", "four-b"] {
        gone(&p, uid, 30).await;
    }
    assert!(p.list(NODE).await.unwrap().is_empty());
    mark("all gone");
    drop(p);
    drop(_plugin);
    mark("plugin stopped");
    drop(cluster);
    mark("cluster stopped");
    let _ = std::fs::remove_dir_all(&dir);
}
