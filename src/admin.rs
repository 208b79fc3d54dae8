//! The admin server: `/livez`, `/readyz` (ready once the Nodes are registered
//! and the first Pod lists have been processed) and `/slices` (the backend's
//! host slices and their use, as a table).

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

/// Ready when every virtual node is registered and every Pod watch has synced.
#[derive(Clone, Debug)]
pub struct Readiness {
    pub registered: Vec<watch::Receiver<bool>>,
    pub pods: Vec<Arc<PodController>>,
}

async fn readyz(State(r): State<Readiness>) -> (StatusCode, &'static str) {
    let registered = r.registered.iter().all(|rx| *rx.borrow());
    let synced = r.pods.iter().all(|p| p.synced());
    match (registered, synced) {
        (true, true) => (StatusCode::OK, "ok\n"),
        (false, _) => (StatusCode::SERVICE_UNAVAILABLE, "node not registered yet\n"),
        (true, false) => (
            StatusCode::SERVICE_UNAVAILABLE,
            "pod watch not synced yet\n",
        ),
    }
}

/// The host slices as a table, for people: `curl http://127.0.0.1:10256/slices`.
async fn slices(State(r): State<Readiness>) -> (StatusCode, String) {
    let Some(p) = r.pods.first() else {
        return (StatusCode::SERVICE_UNAVAILABLE, "no nodes\n".into());
    };
    match p.provider().capacity().await {
        Ok(cap) => (StatusCode::OK, crate::topology::slices_table(&cap)),
        Err(e) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("provider capacity: {e}\n"),
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
        .route("/slices", get(slices))
        .with_state(readiness);
    let listener = tokio::net::TcpListener::bind(addr).await?;
    Ok(tokio::spawn(async move {
        let _ = axum::serve(listener, app)
            .with_graceful_shutdown(async move { shutdown.cancelled().await })
            .await;
    }))
}
