//! The Kubernetes API client, built layer by layer so its connection pool
//! can be bounded.
//!
//! kube's default client keeps idle HTTP/1.1 connections: its 90 s timeout
//! has no timer, so an expired one is only dropped when a later request
//! passes over it, and those a quiet node no longer needs stay open. A burst
//! of thousands of Pods opens one per busy worker and Event task, about 100,
//! and each idle TLS connection holds its buffers, about 70 KB: 5 to 7 MiB
//! that stayed after the burst. Here an idle connection closes after
//! `--kube-idle-timeout` (10 s). Capping the idle count instead (client-go's
//! 25) was measured: under a 10,000-Pod burst it closed and reopened 8,096
//! connections, and the TLS handshakes cost the API server more CPU.
//!
//! HTTP/2 (`--kube-http2`) puts all of a client's requests on one connection.
//! It is opt-in: the API server allows 100 requests at once on a connection,
//! and at 10,000 Pods that held vkd's writes back (Ready 17 s after the last
//! create, against 1 to 2 s).
//!
//! Otherwise the stack is kube's own: TLS from the kubeconfig (client
//! certificates, also from exec plugins), connect/read/write timeouts, the
//! base URI, kube's retry of throttled requests, auth (tokens refreshed as
//! kube does) and extra headers. A kubeconfig with a proxy keeps kube's
//! default client, which handles the proxy.

use std::time::Duration;

use hyper_timeout::TimeoutConnector;
use hyper_util::{
    client::legacy::{Client as HyperClient, connect::HttpConnector},
    rt::{TokioExecutor, TokioTimer},
};
use kube::client::{Body, ConfigExt, RustlsTlsError, retry::RetryPolicy};
use prometheus_client::metrics::counter::Counter;
use tower::{BoxError, ServiceBuilder, ServiceExt, retry::RetryLayer};

/// Builds a client whose idle connections close after `idle_timeout`,
/// offering HTTP/2 when `http2`, and counting each connection it opens in
/// `opened`.
pub fn build(
    config: kube::Config,
    idle_timeout: Duration,
    http2: bool,
    opened: Counter,
) -> Result<kube::Client, kube::Error> {
    if config.proxy_url.is_some() {
        tracing::info!("kubeconfig names a proxy: using kube's own client");
        return kube::Client::try_from(config);
    }
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    let mut tls = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(config.rustls_client_config()?)
        .https_or_http();
    if let Some(name) = &config.tls_server_name {
        let name = rustls_pki_types::ServerName::try_from(name.clone())
            .map_err(|e| kube::Error::RustlsTls(RustlsTlsError::InvalidServerName(e)))?;
        tls = tls.with_server_name_resolver(hyper_rustls::FixedServerNameResolver::new(name));
    }
    let https = if http2 {
        tls.enable_all_versions().wrap_connector(http)
    } else {
        tls.enable_http1().wrap_connector(http)
    };
    let mut connector = TimeoutConnector::new(https);
    connector.set_connect_timeout(config.connect_timeout);
    connector.set_read_timeout(config.read_timeout);
    connector.set_write_timeout(config.write_timeout);
    connector.set_reset_reader_on_write(config.reset_reader_on_write);
    let connector = connector.map_response(move |connection| {
        opened.inc();
        connection
    });
    let pool: HyperClient<_, Body> = HyperClient::builder(TokioExecutor::new())
        .pool_idle_timeout(idle_timeout)
        // Without a timer the pool only notices an expired connection when
        // it next checks one out, so nothing idle would ever close.
        .pool_timer(TokioTimer::new())
        .build(connector);
    let service = ServiceBuilder::new()
        .layer(config.base_uri_layer())
        .option_layer(
            config
                .default_retry
                .then_some(RetryLayer::new(RetryPolicy::server_retry())),
        )
        .option_layer(config.auth_layer()?)
        .layer(config.extra_headers_layer()?)
        .map_err(BoxError::from)
        .service(pool);
    Ok(kube::Client::new(service, config.default_namespace))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use http_body_util::Full;
    use hyper::{Request, Response, body::Bytes, server::conn::http1, service::service_fn};
    use hyper_util::rt::TokioIo;
    use tokio::net::TcpListener;

    /// A plain-HTTP API server that answers every request with a Namespace
    /// after a short pause, counting the connections it accepts and the ones
    /// still open.
    async fn api_server() -> (String, Arc<AtomicUsize>, Arc<AtomicUsize>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let (accepted, open) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let (a, o) = (accepted.clone(), open.clone());
        tokio::spawn(async move {
            loop {
                let (stream, _) = listener.accept().await.unwrap();
                a.fetch_add(1, Ordering::SeqCst);
                o.fetch_add(1, Ordering::SeqCst);
                let o = o.clone();
                tokio::spawn(async move {
                    let answer = service_fn(|_req: Request<hyper::body::Incoming>| async {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        let body = r#"{"apiVersion":"v1","kind":"Namespace","metadata":{"name":"default"}}"#;
                        Ok::<_, std::convert::Infallible>(
                            Response::builder()
                                .header("content-type", "application/json")
                                .body(Full::new(Bytes::from(body)))
                                .unwrap(),
                        )
                    });
                    let _ = http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), answer)
                        .await;
                    o.fetch_sub(1, Ordering::SeqCst);
                });
            }
        });
        (url, accepted, open)
    }

    #[tokio::test]
    async fn idle_connections_close_after_the_timeout() {
        let (url, accepted, open) = api_server().await;
        let config = kube::Config::new(url.parse().unwrap());
        let opened = Counter::default();
        let idle = Duration::from_millis(500);
        let client = build(config, idle, false, opened.clone()).unwrap();
        let namespaces: kube::Api<k8s_openapi::api::core::v1::Namespace> = kube::Api::all(client);
        let burst = (0..20).map(|_| namespaces.get("default"));
        for got in futures::future::join_all(burst).await {
            assert_eq!(got.unwrap().metadata.name.as_deref(), Some("default"));
        }
        let after_burst = accepted.load(Ordering::SeqCst);
        assert!(after_burst > 1, "the burst ran in parallel");
        assert_eq!(opened.get(), after_burst as u64);
        // Within the timeout a connection is reused: nothing new is opened.
        namespaces.get("default").await.unwrap();
        assert_eq!(accepted.load(Ordering::SeqCst), after_burst);
        assert!(
            open.load(Ordering::SeqCst) > 1,
            "idle connections kept for reuse"
        );
        // Past it, the server sees every one of them closed.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while open.load(Ordering::SeqCst) > 0 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(open.load(Ordering::SeqCst), 0, "idle connections left open");
    }
}
