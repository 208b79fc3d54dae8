//! Container events on the process provider: what the kubelet's prober and
//! hooks report as Events, recorded by the shim for vkd to publish.
#![allow(clippy::unwrap_used)] // a test file: a failed unwrap is a failed test

mod common;

use std::time::Duration;

use common::{fence, provider, remove, spec, wait_for};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use vkd_provider::{ContainerEvent, Handler, Probe, Provider};

fn probe(handler: Handler) -> Probe {
    Probe {
        handler,
        initial_delay: Duration::ZERO,
        period: Duration::from_secs(1),
        timeout: Duration::from_secs(2),
        success_threshold: 1,
        failure_threshold: 1,
        termination_grace: None,
    }
}

async fn events(p: &vkd_process::ProcessProvider, uid: &str) -> Vec<ContainerEvent> {
    p.get(uid)
        .await
        .unwrap()
        .map(|i| i.events)
        .unwrap_or_default()
}

/// A failing exec liveness probe: an `Unhealthy` Warning with what the
/// command wrote, then `Killing`, as the kubelet's Events say it.
#[tokio::test(flavor = "multi_thread")]
async fn a_failing_liveness_probe_records_unhealthy_with_its_output_then_killing() {
    let (p, dir) = provider();
    let mut s = spec("u-ev-live", &["sleep", "3609"]);
    s.containers[0].liveness_probe = Some(Box::new(probe(Handler::Exec {
        command: vec![
            "sh".into(),
            "-c".into(),
            "echo not-alive >&2; exit 3".into(),
        ],
    })));
    p.create(&fence(), &s).await.unwrap();
    let seen = wait_for("Unhealthy and Killing", async || {
        let e = events(&p, "u-ev-live").await;
        e.iter().any(|e| e.reason == "Killing").then_some(e)
    })
    .await;
    let unhealthy = seen.iter().find(|e| e.reason == "Unhealthy").unwrap();
    assert!(unhealthy.warning);
    assert_eq!(unhealthy.container, "main");
    assert_eq!(unhealthy.message, "Liveness probe failed: not-alive\n");
    let killing = seen.iter().find(|e| e.reason == "Killing").unwrap();
    assert!(!killing.warning);
    assert_eq!(
        killing.message,
        "Container main failed liveness probe, will be restarted"
    );
    assert!(
        seen.windows(2).all(|w| w[1].seq == w[0].seq + 1),
        "{seen:?}"
    );
    remove(&p, "u-ev-live").await;
    let _ = std::fs::remove_dir_all(dir);
}

/// An httpGet probe redirected to another host is not followed and passes,
/// with a `ProbeWarning` that carries the redirect's body, as the kubelet's.
#[tokio::test(flavor = "multi_thread")]
async fn a_redirect_elsewhere_passes_with_a_probe_warning() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        loop {
            let Ok((mut c, _)) = listener.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let mut buf = [0u8; 2048];
                let _ = c.read(&mut buf).await;
                let body = "<a href=\"http://0.0.0.0/\">Found</a>.\n\n";
                let reply = format!(
                    "HTTP/1.1 302 Found\r\nLocation: http://0.0.0.0/\r\nContent-Length: {}\r\n\r\n{body}",
                    body.len()
                );
                let _ = c.write_all(reply.as_bytes()).await;
            });
        }
    });
    let (p, dir) = provider();
    let mut s = spec("u-ev-redirect", &["sleep", "3609"]);
    s.containers[0].readiness_probe = Some(Box::new(probe(Handler::HttpGet {
        host: Some("127.0.0.1".into()),
        port,
        path: "/redirect".into(),
        https: false,
        headers: Vec::new(),
    })));
    p.create(&fence(), &s).await.unwrap();
    wait_for("Ready through the redirect", async || {
        let i = p.get("u-ev-redirect").await.unwrap()?;
        i.containers.first()?.ready.then_some(())
    })
    .await;
    let seen = events(&p, "u-ev-redirect").await;
    let warning = seen.iter().find(|e| e.reason == "ProbeWarning").unwrap();
    assert!(warning.warning);
    assert_eq!(
        warning.message,
        "Readiness probe warning: Probe terminated redirects, Response body: \
         <a href=\"http://0.0.0.0/\">Found</a>.\n\n"
    );
    assert!(!seen.iter().any(|e| e.reason == "Unhealthy"), "{seen:?}");
    remove(&p, "u-ev-redirect").await;
    let _ = std::fs::remove_dir_all(dir);
}

/// Issue 51, finding 2: an httpGet probe whose path holds CR LF wrote a
/// second request of the tenant's to a loopback service. It is refused with
/// the kubelet's words (an `Unhealthy` that says the probe errored) and
/// nothing reaches the server; a postStart hook's the same, which fails it.
#[tokio::test(flavor = "multi_thread")]
async fn a_crlf_in_an_http_path_is_refused_and_never_sent() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let port = listener.local_addr().unwrap().port();
    let path = "/x HTTP/1.1\r\nHost: a\r\n\r\nPOST /apis HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}";
    let smuggling = || Handler::HttpGet {
        host: Some("127.0.0.1".into()),
        port,
        path: path.into(),
        https: false,
        headers: Vec::new(),
    };
    let (p, dir) = provider();
    let mut s = spec("u-ev-crlf", &["sleep", "3609"]);
    s.containers[0].readiness_probe = Some(Box::new(probe(smuggling())));
    p.create(&fence(), &s).await.unwrap();
    let mut s = spec("u-ev-crlf-hook", &["sleep", "3609"]);
    s.containers[0].post_start = Some(Box::new(smuggling()));
    p.create(&fence(), &s).await.unwrap();
    let refused = format!("parse {path:?}: net/url: invalid control character in URL");
    let unhealthy = wait_for("an Unhealthy for the path", async || {
        let e = events(&p, "u-ev-crlf").await;
        e.into_iter().find(|e| e.reason == "Unhealthy")
    })
    .await;
    assert_eq!(
        unhealthy.message,
        format!("Readiness probe errored and resulted in unknown state: {refused}")
    );
    let hook = wait_for("a FailedPostStartHook", async || {
        let e = events(&p, "u-ev-crlf-hook").await;
        e.into_iter().find(|e| e.reason == "FailedPostStartHook")
    })
    .await;
    assert_eq!(hook.message, format!("PostStartHook failed: {refused}"));
    assert!(listener.accept().is_err(), "a request reached the server");
    let i = p.get("u-ev-crlf").await.unwrap().unwrap();
    assert!(!i.containers[0].ready);
    remove(&p, "u-ev-crlf").await;
    remove(&p, "u-ev-crlf-hook").await;
    let _ = std::fs::remove_dir_all(dir);
}

/// The shim keeps the latest events only: a probe failing every second for
/// long leaves a bounded status file, and the numbering goes on.
#[tokio::test(flavor = "multi_thread")]
async fn events_are_bounded_and_numbered_on() {
    let (p, dir) = provider();
    let mut s = spec("u-ev-bound", &["sleep", "3609"]);
    let mut failing = probe(Handler::Exec {
        command: vec!["false".into()],
    });
    failing.period = Duration::from_millis(50);
    failing.failure_threshold = u32::MAX;
    s.containers[0].readiness_probe = Some(Box::new(failing));
    p.create(&fence(), &s).await.unwrap();
    let seen = wait_for("more events than are kept", async || {
        let e = events(&p, "u-ev-bound").await;
        e.last().is_some_and(|l| l.seq > 40).then_some(e)
    })
    .await;
    assert_eq!(seen.len(), vkd_process::sandbox::EVENTS_KEPT, "{seen:?}");
    assert!(seen.iter().all(|e| e.message == "Readiness probe failed: "));
    remove(&p, "u-ev-bound").await;
    let _ = std::fs::remove_dir_all(dir);
}

/// A TLS server on loopback with a self-signed certificate (no node would
/// trust it) that answers every request with `200 OK`.
async fn self_signed_https_server() -> u16 {
    use rustls_pki_types::{PrivateKeyDer, PrivatePkcs8KeyDer};
    let ck = rcgen::generate_simple_self_signed(vec!["pod.example".to_owned()]).unwrap();
    let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(ck.signing_key.serialize_der()));
    let config = rustls::ServerConfig::builder_with_provider(std::sync::Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_no_client_auth()
    .with_single_cert(vec![ck.cert.der().clone()], key)
    .unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(std::sync::Arc::new(config));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        loop {
            let Ok((c, _)) = listener.accept().await else {
                return;
            };
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let Ok(mut tls) = acceptor.accept(c).await else {
                    return;
                };
                let mut buf = [0u8; 2048];
                let _ = tls.read(&mut buf).await;
                let _ = tls
                    .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                    .await;
                let _ = tls.shutdown().await;
            });
        }
    });
    port
}

/// `scheme: HTTPS`, as the kubelet's: the server's certificate is not
/// verified, so a Pod's self-signed one passes; a server that does not speak
/// TLS fails the probe with an `Unhealthy` that says so.
#[tokio::test(flavor = "multi_thread")]
async fn an_https_probe_skips_verifying_the_certificate_and_needs_tls() {
    let tls_port = self_signed_https_server().await;
    let plain = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let plain_port = plain.local_addr().unwrap().port();
    tokio::spawn(async move {
        loop {
            let Ok((mut c, _)) = plain.accept().await else {
                return;
            };
            let _ = c
                .write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
                .await;
        }
    });
    let (p, dir) = provider();
    for (uid, port) in [("u-ev-https", tls_port), ("u-ev-not-tls", plain_port)] {
        let mut s = spec(uid, &["sleep", "3609"]);
        s.containers[0].readiness_probe = Some(Box::new(probe(Handler::HttpGet {
            host: Some("127.0.0.1".into()),
            port,
            path: "/ready".into(),
            https: true,
            headers: Vec::new(),
        })));
        p.create(&fence(), &s).await.unwrap();
    }
    wait_for("Ready over TLS", async || {
        let i = p.get("u-ev-https").await.unwrap()?;
        i.containers.first()?.ready.then_some(())
    })
    .await;
    let failed = wait_for("an Unhealthy without TLS", async || {
        let e = events(&p, "u-ev-not-tls").await;
        e.into_iter().find(|e| e.reason == "Unhealthy")
    })
    .await;
    assert!(
        failed.message.starts_with(&format!(
            "Readiness probe failed: Get \"https://127.0.0.1:{plain_port}/ready\": "
        )),
        "{failed:?}"
    );
    let i = p.get("u-ev-not-tls").await.unwrap().unwrap();
    assert!(!i.containers[0].ready);
    remove(&p, "u-ev-https").await;
    remove(&p, "u-ev-not-tls").await;
    let _ = std::fs::remove_dir_all(dir);
}

/// As the kubelet's hook runner: an httpGet hook says `kube-lifecycle/1.37`,
/// and any answer, a 500 too, is the hook done (only a request that fails
/// fails it); a probe says `kube-probe/1.37`.
#[tokio::test(flavor = "multi_thread")]
async fn an_http_hook_is_the_kubelets_lifecycle_request_and_reads_no_status() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<String>();
    tokio::spawn(async move {
        loop {
            let Ok((mut c, _)) = listener.accept().await else {
                return;
            };
            let tx = tx.clone();
            tokio::spawn(async move {
                let mut buf = [0u8; 4096];
                let n = c.read(&mut buf).await.unwrap_or(0);
                let _ = tx.send(String::from_utf8_lossy(&buf[..n]).into_owned());
                let _ = c
                    .write_all(b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 0\r\n\r\n")
                    .await;
            });
        }
    });
    let (p, dir) = provider();
    let mut s = spec("u-ev-hook-ua", &["sleep", "3609"]);
    s.containers[0].post_start = Some(Box::new(Handler::HttpGet {
        host: Some("127.0.0.1".into()),
        port,
        path: "/started".into(),
        https: false,
        headers: Vec::new(),
    }));
    p.create(&fence(), &s).await.unwrap();
    let request = tokio::time::timeout(std::time::Duration::from_secs(30), rx.recv())
        .await
        .unwrap()
        .unwrap();
    assert!(
        request.starts_with("GET /started HTTP/1.1\r\n"),
        "{request:?}"
    );
    assert!(
        request.contains("\r\nuser-agent: kube-lifecycle/1.37\r\n")
            || request.contains("\r\nUser-Agent: kube-lifecycle/1.37\r\n"),
        "{request:?}"
    );
    wait_for("Running after the hook", async || {
        let i = p.get("u-ev-hook-ua").await.unwrap()?;
        matches!(
            i.containers.first()?.state,
            vkd_provider::ContainerState::Running { .. }
        )
        .then_some(())
    })
    .await;
    let seen = events(&p, "u-ev-hook-ua").await;
    assert!(
        !seen.iter().any(|e| e.reason == "FailedPostStartHook"),
        "{seen:?}"
    );
    remove(&p, "u-ev-hook-ua").await;
    let _ = std::fs::remove_dir_all(dir);
}
