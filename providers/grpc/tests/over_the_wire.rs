//! The sim provider served over the protocol on a Unix socket, and used
//! through [`GrpcProvider`] as vkd uses any provider: the conformance kit
//! passes, errors keep their kind, exec and logs carry their bytes, and a
//! plugin that goes away and comes back loses nothing.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a failed unwrap is a failed test

use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;
use vkd_grpc::{Endpoint, GrpcProvider, pb, server};
use vkd_provider::conformance::{Kit, sample_spec};
use vkd_provider::{
    Fence, Health, InstanceEvent, InstancePhase, LogRequest, Provider, ProviderError, StreamIo,
};
use vkd_sim::{Fleet, SimProvider};

const FLEET: &str = r#"
latency: {start: 20ms, ready: 20ms}
hosts:
- name: host-a
  cpu: "16"
  memory: 64Gi
  gpus: [{count: 4, model: H100, memory: 80Gi, nvlink_domain: nvl-a}]
"#;

const TIMEOUT: Duration = Duration::from_secs(5);

fn tempdir() -> PathBuf {
    let d = std::env::temp_dir().join(format!(
        "vkd-grpc-test-{}-{}",
        std::process::id(),
        fastrand_suffix()
    ));
    std::fs::create_dir_all(&d).unwrap();
    // Whatever the umask: a socket's directory must not be writable by
    // others (searchable, so that the tests' other users can try the socket).
    std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o755)).unwrap();
    d
}

fn fastrand_suffix() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos()
}

/// The sim on a socket in `dir`, its state in `dir`, until the token ends it.
async fn plugin(dir: &Path) -> (Endpoint, CancellationToken, tokio::task::JoinHandle<()>) {
    let sim = SimProvider::open(Fleet::parse(FLEET, "test").unwrap(), &dir.join("state")).unwrap();
    let endpoint = Endpoint::unix(dir.join("plugin.sock"));
    let stop = CancellationToken::new();
    let served = server::serve(Arc::new(sim), &endpoint, stop.clone())
        .await
        .unwrap();
    let handle = tokio::spawn(async move {
        served.await.unwrap().unwrap();
    });
    (endpoint, stop, handle)
}

fn fence(epoch: u64) -> Fence {
    Fence {
        node: "n".into(),
        epoch,
    }
}

async fn running(p: &GrpcProvider, uid: &str) {
    for _ in 0..200 {
        if let Some(i) = p.get(uid).await.unwrap()
            && i.phase == InstancePhase::Running
        {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("{uid} never ran");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_conformance_kit_passes_over_the_wire() {
    let dir = tempdir();
    let (endpoint, stop, handle) = plugin(&dir).await;
    let p = GrpcProvider::connect(endpoint, TIMEOUT).await.unwrap();
    assert_eq!(p.name(), "sim");
    assert!(p.capabilities().supported().contains(&"exec"));
    Kit::new(&p, "n", sample_spec).run().await.unwrap();
    stop.cancel();
    handle.await.unwrap();
    std::fs::remove_dir_all(dir).ok();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_streams_and_logs_keep_what_they_carry() {
    let dir = tempdir();
    let (endpoint, stop, handle) = plugin(&dir).await;
    let p = Arc::new(GrpcProvider::connect(endpoint, TIMEOUT).await.unwrap());
    let spec = sample_spec("n", "pod-1");
    p.create(&fence(5), &spec).await.unwrap();
    // A stale epoch is the backend's fence, with its numbers.
    match p.delete(&fence(4), "pod-1", Duration::ZERO).await {
        Err(ProviderError::Fenced { node, current, got }) => {
            assert_eq!((node.as_str(), current, got), ("n", 5, 4));
        }
        other => panic!("a stale delete gave {other:?}"),
    }
    running(&p, "pod-1").await;
    // Exec with stdin: what goes in comes out, and the exit code comes back.
    let (mut stdin_w, stdin_r) = tokio::io::duplex(1024);
    let (stdout_w, mut stdout_r) = tokio::io::duplex(1024);
    let io = StreamIo {
        stdin: Some(Box::new(stdin_r)),
        stdout: Some(Box::new(stdout_w)),
        stderr: None,
        tty: false,
        resize: None,
    };
    stdin_w.write_all(b"through the wire\n").await.unwrap();
    stdin_w.shutdown().await.unwrap();
    let code = p
        .exec("pod-1", "main", vec!["cat".into()], io)
        .await
        .unwrap();
    let mut out = String::new();
    stdout_r.read_to_string(&mut out).await.unwrap();
    assert_eq!((code, out.as_str()), (0, "through the wire\n"));
    let (stdout_w, _) = tokio::io::duplex(64);
    let io = StreamIo {
        stdin: None,
        stdout: Some(Box::new(stdout_w)),
        stderr: None,
        tty: false,
        resize: None,
    };
    let code = p
        .exec("pod-1", "main", vec!["exit".into(), "3".into()], io)
        .await
        .unwrap();
    assert_eq!(code, 3);
    // Logs: the history the sim has written so far.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let logs = p
        .logs("pod-1", "main", LogRequest::default())
        .await
        .unwrap();
    assert!(!logs.history.is_empty() && logs.follow.is_none());
    // A followed log goes on past its history.
    let follow = LogRequest {
        follow: true,
        ..LogRequest::default()
    };
    let mut logs = p.logs("pod-1", "main", follow).await.unwrap();
    let next = tokio::time::timeout(Duration::from_secs(5), logs.follow.as_mut().unwrap().next())
        .await
        .unwrap()
        .unwrap();
    assert!(!next.bytes.is_empty());
    // Port-forward: the sim echoes what it is sent, both ways over the wire.
    let (ours, mut theirs) = tokio::io::duplex(1024);
    let forward = {
        let p = Arc::clone(&p);
        tokio::spawn(async move { p.port_forward("pod-1", 8080, Box::new(ours)).await })
    };
    theirs.write_all(b"ping over grpc").await.unwrap();
    theirs.shutdown().await.unwrap();
    let mut echoed = Vec::new();
    theirs.read_to_end(&mut echoed).await.unwrap();
    assert_eq!(echoed, b"ping over grpc");
    forward.await.unwrap().unwrap();
    // An unknown Pod is NotFound, as in process.
    let missing = p.logs("nobody", "main", LogRequest::default()).await;
    assert!(
        matches!(missing, Err(ProviderError::NotFound { .. })),
        "{missing:?}"
    );
    stop.cancel();
    handle.await.unwrap();
    std::fs::remove_dir_all(dir).ok();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plugin_that_goes_away_is_unhealthy_fences_nothing_and_is_adopted_back() {
    let dir = tempdir();
    let (endpoint, stop, handle) = plugin(&dir).await;
    let p = GrpcProvider::connect(endpoint.clone(), TIMEOUT)
        .await
        .unwrap();
    let mut events = p.events();
    let created = p
        .create(&fence(1), &sample_spec("n", "kept"))
        .await
        .unwrap();
    let first = tokio::time::timeout(Duration::from_secs(5), events.next()).await;
    assert!(
        matches!(first, Ok(Some(InstanceEvent::Changed { ref uid })) if uid == "kept"),
        "{first:?}"
    );
    stop.cancel();
    handle.await.unwrap();
    match p.health().await {
        Health::Unhealthy { reason, message } => {
            assert_eq!(reason, vkd_grpc::client::UNREACHABLE);
            assert!(message.contains("plugin.sock"), "{message}");
        }
        other => panic!("health with the plugin gone: {other:?}"),
    }
    let refused = p.create(&fence(1), &sample_spec("n", "other")).await;
    assert!(
        matches!(refused, Err(ProviderError::Transient { .. })),
        "{refused:?}"
    );
    // Back, from the same state: healthy, and what it ran is still there.
    let (_, stop, handle) = plugin(&dir).await;
    assert_eq!(p.health().await, Health::Healthy);
    // Its notices resume with a resync: what changed meanwhile is unknown.
    let resumed = loop {
        let e = tokio::time::timeout(Duration::from_secs(10), events.next())
            .await
            .unwrap()
            .unwrap();
        if e == InstanceEvent::Resync {
            break e;
        }
    };
    assert_eq!(resumed, InstanceEvent::Resync);
    let listed = p.list("n").await.unwrap();
    assert_eq!(
        listed.iter().map(|i| i.id.as_str()).collect::<Vec<_>>(),
        [created.id.as_str()]
    );
    stop.cancel();
    handle.await.unwrap();
    std::fs::remove_dir_all(dir).ok();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_version_or_no_plugin_is_refused_at_connect_naming_the_endpoint() {
    let dir = tempdir();
    let nothing = Endpoint::unix(dir.join("none.sock"));
    let e = GrpcProvider::connect(nothing, Duration::from_secs(1))
        .await
        .unwrap_err();
    assert!(e.to_string().contains("none.sock"), "{e}");
    let (endpoint, stop, handle) = plugin(&dir).await;
    let Endpoint::Unix { path, .. } = &endpoint else {
        unreachable!()
    };
    let path = path.clone();
    let channel = tonic::transport::Endpoint::from_static("http://plugin.invalid")
        .connect_with_connector(tower::service_fn(move |_: http::Uri| {
            let path = path.clone();
            async move {
                let s = tokio::net::UnixStream::connect(path).await?;
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(s))
            }
        }))
        .await
        .unwrap();
    let refused = pb::provider_client::ProviderClient::new(channel)
        .hello(pb::HelloRequest { versions: vec![2] })
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::FailedPrecondition);
    assert!(
        refused.message().contains("version 1"),
        "{}",
        refused.message()
    );
    stop.cancel();
    handle.await.unwrap();
    std::fs::remove_dir_all(dir).ok();
}

#[tokio::test]
async fn a_file_that_is_not_a_socket_is_never_replaced_by_one() {
    let dir = tempdir();
    let kept = dir.join("config.yaml");
    std::fs::write(&kept, "precious").unwrap();
    let e = server::serve(
        Arc::new(
            SimProvider::open(Fleet::parse(FLEET, "test").unwrap(), &dir.join("state")).unwrap(),
        ),
        &Endpoint::unix(kept.clone()),
        CancellationToken::new(),
    )
    .await
    .unwrap_err();
    assert!(e.to_string().contains("not a socket"), "{e}");
    assert_eq!(std::fs::read_to_string(&kept).unwrap(), "precious");
    // A socket an earlier run left is replaced.
    let (endpoint, stop, handle) = plugin(&dir).await;
    stop.cancel();
    handle.await.unwrap();
    let (_, stop, handle) = plugin(&dir).await;
    stop.cancel();
    handle.await.unwrap();
    drop(endpoint);
    std::fs::remove_dir_all(dir).ok();
}

/// A CA and, signed by it, one certificate for `name`: `(ca.pem, cert.pem, key.pem)` in `dir`.
fn issue(dir: &Path, ca_name: &str, name: &str) -> (PathBuf, PathBuf, PathBuf) {
    use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name
        .push(rcgen::DnType::CommonName, ca_name);
    let ca = CertifiedIssuer::self_signed(ca, KeyPair::generate().unwrap()).unwrap();
    let key = KeyPair::generate().unwrap();
    let cert = CertificateParams::new(vec![name.to_owned()])
        .unwrap()
        .signed_by(&key, &ca)
        .unwrap();
    let paths = (
        dir.join(format!("{ca_name}.pem")),
        dir.join(format!("{name}-{ca_name}.pem")),
        dir.join(format!("{name}-{ca_name}.key")),
    );
    std::fs::write(&paths.0, ca.pem()).unwrap();
    std::fs::write(&paths.1, cert.pem()).unwrap();
    std::fs::write(&paths.2, key.serialize_pem()).unwrap();
    paths
}

fn tls(host: &str, port: u16, cert: &Path, key: &Path, ca: &Path) -> Endpoint {
    format!(
        "tls://{host}:{port}?cert={}&key={}&ca={}",
        cert.display(),
        key.display(),
        ca.display()
    )
    .parse()
    .unwrap()
}

#[tokio::test]
async fn across_machines_only_mutual_tls_gets_in() {
    let dir = tempdir();
    let (server_ca, server_cert, server_key) = issue(&dir, "plugin-ca", "localhost");
    let (client_ca, client_cert, client_key) = issue(&dir, "vkd-ca", "vkd");
    let (rogue_ca, rogue_cert, rogue_key) = issue(&dir, "rogue-ca", "vkd");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let sim = SimProvider::open(Fleet::parse(FLEET, "test").unwrap(), &dir.join("state")).unwrap();
    let stop = CancellationToken::new();
    // The plugin: its certificate, and only clients of vkd's CA.
    let listen = tls("127.0.0.1", port, &server_cert, &server_key, &client_ca);
    let served = server::serve(Arc::new(sim), &listen, stop.clone())
        .await
        .unwrap();

    let vkd = GrpcProvider::connect(
        tls("localhost", port, &client_cert, &client_key, &server_ca),
        TIMEOUT,
    )
    .await
    .unwrap();
    vkd.create(&fence(1), &sample_spec("n", "over-tls"))
        .await
        .unwrap();
    assert!(vkd.get("over-tls").await.unwrap().is_some());

    // A client whose certificate another CA signed is refused in the handshake.
    let rogue = GrpcProvider::connect(
        tls("localhost", port, &rogue_cert, &rogue_key, &server_ca),
        TIMEOUT,
    )
    .await;
    assert!(rogue.is_err(), "a client of another CA got in");
    // vkd refuses a plugin whose certificate its CA did not sign.
    let impostor = GrpcProvider::connect(
        tls("localhost", port, &client_cert, &client_key, &rogue_ca),
        TIMEOUT,
    )
    .await;
    assert!(impostor.is_err(), "vkd trusted a plugin of another CA");
    // Nor one that is not the host it dialled.
    let elsewhere = GrpcProvider::connect(
        tls("127.0.0.1", port, &client_cert, &client_key, &server_ca),
        TIMEOUT,
    )
    .await;
    assert!(
        elsewhere.is_err(),
        "a certificate for localhost passed for 127.0.0.1"
    );
    drop(vkd);
    stop.cancel();
    served.await.unwrap().unwrap();
}

fn sim(dir: &Path) -> Arc<SimProvider> {
    Arc::new(SimProvider::open(Fleet::parse(FLEET, "test").unwrap(), &dir.join("state")).unwrap())
}

/// Runs `f` on a thread of its own whose uids are all `uid` (Linux keeps
/// them per thread): what it binds, listens on or connects is that user's.
fn as_user<T: Send + 'static>(uid: u32, f: impl FnOnce() -> T + Send + 'static) -> T {
    std::thread::spawn(move || {
        rustix::thread::set_thread_uid(rustix::process::Uid::from_raw(uid)).unwrap();
        f()
    })
    .join()
    .unwrap()
}

fn root() -> bool {
    rustix::process::geteuid().is_root()
}

#[tokio::test]
async fn a_plugins_socket_is_0600_and_its_own_in_a_directory_no_one_else_can_write() {
    let dir = tempdir();
    let (endpoint, stop, handle) = plugin(&dir).await;
    let socket = std::fs::symlink_metadata(dir.join("plugin.sock")).unwrap();
    assert!(socket.file_type().is_socket());
    assert_eq!(socket.mode() & 0o7777, 0o600, "{:o}", socket.mode());
    assert_eq!(socket.uid(), rustix::process::geteuid().as_raw());
    let parent = std::fs::metadata(&dir).unwrap();
    assert_eq!(parent.mode() & 0o022, 0, "{:o}", parent.mode());
    // Bound in a private directory beside it and renamed: none is left.
    let mut left: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    left.sort();
    assert_eq!(left, ["plugin.sock", "state"]);
    // And it serves.
    GrpcProvider::connect(endpoint, TIMEOUT).await.unwrap();
    stop.cancel();
    handle.await.unwrap();
    std::fs::remove_dir_all(dir).ok();
}

#[tokio::test]
async fn listening_in_a_directory_others_can_write_is_refused_naming_it() {
    let dir = tempdir();
    let open = dir.join("open");
    std::fs::create_dir(&open).unwrap();
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
    let e = server::serve(
        sim(&dir),
        &Endpoint::unix(open.join("p.sock")),
        CancellationToken::new(),
    )
    .await
    .unwrap_err()
    .to_string();
    assert!(e.starts_with("refusing to listen on unix://"), "{e}");
    assert!(
        e.contains(&format!("its directory {} ", open.display())),
        "{e}"
    );
    assert!(
        e.contains("writable by everyone (mode 0777) and not sticky"),
        "{e}"
    );
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o775)).unwrap();
    let e = server::serve(
        sim(&dir),
        &Endpoint::unix(open.join("p.sock")),
        CancellationToken::new(),
    )
    .await
    .unwrap_err()
    .to_string();
    assert!(e.contains("writable by its group"), "{e}");
    assert_eq!(std::fs::read_dir(&open).unwrap().count(), 0);
    // A peer-uid is for the side that dials.
    let e = server::serve(
        sim(&dir),
        &format!("unix://{}/p.sock?peer-uid=7", dir.display())
            .parse()
            .unwrap(),
        CancellationToken::new(),
    )
    .await
    .unwrap_err()
    .to_string();
    assert!(e.contains("peer-uid is for the side that dials"), "{e}");
    if root() {
        // Another user's directory, however tight.
        rustix::fs::chown(&open, Some(rustix::process::Uid::from_raw(65534)), None).unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o700)).unwrap();
        let e = server::serve(
            sim(&dir),
            &Endpoint::unix(open.join("p.sock")),
            CancellationToken::new(),
        )
        .await
        .unwrap_err()
        .to_string();
        assert!(e.contains("belongs to uid 65534"), "{e}");
    }
    std::fs::remove_dir_all(dir).ok();
}

#[tokio::test]
async fn a_plugin_run_by_another_user_is_refused_by_vkd() {
    if !root() {
        eprintln!("skipped: making a socket of another user needs root");
        return;
    }
    let dir = tempdir();
    let theirs = dir.join("theirs");
    std::fs::create_dir(&theirs).unwrap();
    rustix::fs::chown(&theirs, Some(rustix::process::Uid::from_raw(65534)), None).unwrap();
    let path = theirs.join("p.sock");
    // What a tenant's process would leave where vkd expects its plugin.
    let listener = as_user(65534, {
        let path = path.clone();
        move || std::os::unix::net::UnixListener::bind(path).unwrap()
    });
    let e = GrpcProvider::connect(Endpoint::unix(&path), TIMEOUT)
        .await
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with(&format!(
            "refusing the provider plugin at unix://{}: the process listening there runs as uid 65534",
            path.display()
        )),
        "{e}"
    );
    assert!(e.contains("and only root may serve it"), "{e}");
    assert!(
        e.ends_with(&format!("{}?peer-uid=65534", path.display())),
        "{e}"
    );
    let other: Endpoint = format!("unix://{}?peer-uid=990", path.display())
        .parse()
        .unwrap();
    let e = GrpcProvider::connect(other, TIMEOUT)
        .await
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("only root or the named uid 990 may serve it"),
        "{e}"
    );
    assert!(
        e.ends_with(&format!("{}?peer-uid=65534", path.display())),
        "{e}"
    );
    // A plugin vkd spoke to, replaced by that process's socket: the Node's
    // health says who listens now, and nothing is fenced.
    let (endpoint, stop, handle) = plugin(&dir).await;
    let p = GrpcProvider::connect(endpoint, TIMEOUT).await.unwrap();
    stop.cancel();
    handle.await.unwrap();
    std::fs::rename(&path, dir.join("plugin.sock")).unwrap();
    let health = p.health().await;
    let Health::Unhealthy { reason, message } = &health else {
        panic!("{health:?}")
    };
    assert_eq!(reason, vkd_grpc::client::UNREACHABLE);
    assert!(
        message.contains("runs as uid 65534, and only root may serve it"),
        "{message}"
    );
    assert!(
        p.create(&fence(1), &sample_spec("n", "after"))
            .await
            .is_err(),
        "a create reached the impostor"
    );
    std::fs::rename(dir.join("plugin.sock"), &path).unwrap();
    // Named by the operator, it is dialled (and here answers nothing).
    let named: Endpoint = format!("unix://{}?peer-uid=65534", path.display())
        .parse()
        .unwrap();
    let e = GrpcProvider::connect(named, Duration::from_secs(1))
        .await
        .unwrap_err()
        .to_string();
    assert!(!e.contains("refusing"), "{e}");
    drop(listener);
    std::fs::remove_dir_all(dir).ok();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_of_another_user_is_closed_even_if_the_socket_is_loosened() {
    if !root() {
        eprintln!("skipped: connecting as another user needs root");
        return;
    }
    let dir = tempdir();
    let (_endpoint, stop, handle) = plugin(&dir).await;
    let path = dir.join("plugin.sock");
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o666)).unwrap();
    // The HTTP/2 preface and an empty SETTINGS frame; a server answers
    // with its own SETTINGS. How many bytes came back: none when the
    // connection was closed (before the write, or after).
    let hello = |path: PathBuf| {
        move || {
            use std::io::{Read, Write};
            let mut s = std::os::unix::net::UnixStream::connect(path).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            if s.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\x04\0\0\0\0\0")
                .is_err()
            {
                return 0;
            }
            let mut buf = [0u8; 64];
            match s.read(&mut buf) {
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => 0,
                // Neither answered nor closed within 5s.
                Err(e) => panic!("{e}"),
            }
        }
    };
    let theirs = tokio::task::spawn_blocking({
        let hello = hello(path.clone());
        move || as_user(65534, hello)
    })
    .await
    .unwrap();
    assert_eq!(theirs, 0, "a client of uid 65534 was answered");
    let ours = tokio::task::spawn_blocking(hello(path)).await.unwrap();
    assert!(ours > 0, "root was not answered");
    stop.cancel();
    handle.await.unwrap();
    std::fs::remove_dir_all(dir).ok();
}
