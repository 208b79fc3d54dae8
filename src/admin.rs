//! The admin server: `/livez`; `/readyz` (ready once this replica leads, its
//! Nodes are registered and the first Pod lists have been processed; a standby
//! answers 503); `/slices` (the backend's host slices and their use, as a
//! table); `/metrics` (the daemon's own metrics).

use std::net::SocketAddr;
use std::sync::{Arc, RwLock};

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use vkd_provider::Provider;

use crate::metrics::Metrics;
use crate::pods::PodIndex;

#[derive(Debug, Default)]
struct Active {
    registered: Vec<watch::Receiver<bool>>,
    pods: Vec<PodIndex>,
}

/// What the admin server reports on; filled in once this replica leads.
#[derive(Clone, Debug)]
pub struct AdminState {
    provider: Arc<dyn Provider>,
    metrics: Arc<Metrics>,
    active: Arc<RwLock<Option<Active>>>,
}

impl AdminState {
    pub fn new(provider: Arc<dyn Provider>, metrics: Arc<Metrics>) -> Self {
        Self {
            provider,
            metrics,
            active: Arc::default(),
        }
    }

    /// This replica does not lead (any more).
    pub fn set_standby(&self) {
        *self.active.write().unwrap_or_else(|p| p.into_inner()) = None;
    }

    /// This replica leads now, with these Nodes and Pod controllers.
    pub fn set_active(&self, registered: Vec<watch::Receiver<bool>>, pods: Vec<PodIndex>) {
        *self.active.write().unwrap_or_else(|p| p.into_inner()) = Some(Active { registered, pods });
    }
}

async fn readyz(State(s): State<AdminState>) -> (StatusCode, &'static str) {
    let active = s.active.read().unwrap_or_else(|p| p.into_inner());
    let Some(a) = active.as_ref() else {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            "standby: another replica holds the leader lease\n",
        );
    };
    let registered = a.registered.iter().all(|rx| *rx.borrow());
    let synced = a.pods.iter().all(|p| p.synced());
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
async fn slices(State(s): State<AdminState>) -> (StatusCode, String) {
    match s.provider.capacity().await {
        Ok(cap) => (StatusCode::OK, crate::topology::slices_table(&cap)),
        Err(e) => (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("provider capacity: {e}\n"),
        ),
    }
}

async fn metrics(State(s): State<AdminState>) -> impl IntoResponse {
    let pods: Vec<PodIndex> = s
        .active
        .read()
        .unwrap_or_else(|p| p.into_inner())
        .as_ref()
        .map(|a| a.pods.clone())
        .unwrap_or_default();
    let pending: usize = pods.iter().map(|p| p.deletions_pending()).sum();
    s.metrics
        .deletions_pending
        .set(i64::try_from(pending).unwrap_or(i64::MAX));
    let mut phases: std::collections::BTreeMap<String, i64> = Default::default();
    let mut instances: std::collections::BTreeMap<String, i64> = Default::default();
    let mut queue = 0;
    let mut lease_age = None;
    for p in &pods {
        queue += p.queue_depth();
        // The stalest Node's: in per-host mode one stalled lease among many
        // is the one to see.
        lease_age = lease_age.max(p.lease_age());
        for (phase, n) in p.phases() {
            *phases.entry(phase).or_default() += n;
        }
        // The backend's side of "Ready" Pods, from what the controller already
        // knows: a scrape never calls the backend.
        for (phase, n) in p.backend_phases() {
            *instances.entry(phase).or_default() += n;
        }
    }
    let phases: Vec<(String, i64)> = phases.into_iter().collect();
    let instances: Vec<(String, i64)> = instances.into_iter().collect();
    s.metrics
        .set_snapshot(queue, lease_age, &phases, &instances);
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        s.metrics.render(),
    )
}

/// Binds now (so a taken port fails at start) and serves until shutdown.
pub async fn serve(
    addr: SocketAddr,
    state: AdminState,
    shutdown: CancellationToken,
) -> std::io::Result<JoinHandle<()>> {
    let app = Router::new()
        .route("/livez", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route("/slices", get(slices))
        .route("/metrics", get(metrics))
        .with_state(state);
    let listener = tokio::net::TcpListener::bind(addr).await?;
    Ok(tokio::spawn(async move {
        let _ = axum::serve(listener, app)
            .with_graceful_shutdown(async move { shutdown.cancelled().await })
            .await;
    }))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use axum::response::IntoResponse;

    use super::*;
    use crate::testing::{FakeProvider, fake_api, status};

    fn controller(provider: Arc<dyn Provider>, metrics: Arc<Metrics>) -> PodIndex {
        let (client, _) = fake_api(|_| status(404, "NotFound"));
        crate::pods::PodController::new(
            crate::pods::Settings {
                node: "vk".into(),
                host_ip: "10.0.0.1".into(),
                epoch: 1,
                concurrency: 1,
                create_concurrency: 1,
                qps: 10,
                burst: 10,
                policy: crate::pods::spec::Policy::default(),
                host: None,
                queue_timeout: Duration::from_secs(600),
                gc_interval: Duration::from_secs(60),
                brake: crate::fencing::Brake::default(),
                partition_fence_after: Duration::from_secs(30),
                lifecycle_events: false,
                status_merge_window: Duration::ZERO,
                event_qps: 50,
                event_burst: 100,
                dra: None,
            },
            client.clone(),
            client,
            provider,
            crate::testing::shared(metrics),
        )
        .index()
    }

    #[tokio::test]
    async fn a_scrape_makes_no_provider_call() {
        let fake = FakeProvider::new(usize::MAX);
        let provider: Arc<dyn Provider> = fake.clone();
        let metrics = Arc::new(Metrics::default());
        let state = AdminState::new(Arc::clone(&provider), Arc::clone(&metrics));
        let nodes = vec![
            controller(Arc::clone(&provider), Arc::clone(&metrics)),
            controller(Arc::clone(&provider), Arc::clone(&metrics)),
        ];
        state.set_active(Vec::new(), nodes);
        for _ in 0..3 {
            let response = super::metrics(State(state.clone())).await.into_response();
            assert_eq!(response.status(), StatusCode::OK);
        }
        assert_eq!(fake.calls(None), 0, "a scrape called the provider");
        let text = metrics.render();
        assert!(
            text.contains("vkd_backend_instances{phase=\"Running\"} 0"),
            "{text}"
        );
    }
}
