//! The admin server: `/livez` and `/readyz` (ready once the Node is registered
//! and the first Pod list has been processed).

use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::pods::PodController;

#[derive(Clone, Debug)]
pub struct Readiness {
    pub registered: watch::Receiver<bool>,
    pub pods: Arc<PodController>,
}

async fn readyz(State(r): State<Readiness>) -> (StatusCode, &'static str) {
    match (*r.registered.borrow(), r.pods.synced()) {
        (true, true) => (StatusCode::OK, "ok\n"),
        (false, _) => (StatusCode::SERVICE_UNAVAILABLE, "node not registered yet\n"),
        (true, false) => (
            StatusCode::SERVICE_UNAVAILABLE,
            "pod watch not synced yet\n",
        ),
    }
}

/// Binds now (so a taken port fails at start) and serves until shutdown.
pub async fn serve(
    addr: SocketAddr,
    readiness: Readiness,
    shutdown: CancellationToken,
) -> std::io::Result<JoinHandle<()>> {
    let app = Router::new()
        .route("/livez", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .with_state(readiness);
    let listener = tokio::net::TcpListener::bind(addr).await?;
    Ok(tokio::spawn(async move {
        let _ = axum::serve(listener, app)
            .with_graceful_shutdown(async move { shutdown.cancelled().await })
            .await;
    }))
}
