//! What the reconcile loop's tests share: a scripted backend, and a
//! controller against a fake API server whose requests the test reads.

use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use futures::StreamExt;
use futures::stream::BoxStream;
use serde_json::{Value, json};
use vkd_provider::{
    Admission, Capacity, CapacityKind, ContainerSpec, Fence, Health, Instance, InstanceEvent,
    InstanceSpec, Provider, ProviderError, Result,
};

use super::{PodController, Settings};
use crate::testing::{Log, Seen, fake_api, status};

/// A provider whose one instance the test sets; `delete` only records the
/// request (the backend stops the instance later, when the test says so).
/// With `runs_ephemeral`, it takes ephemeral containers (recorded), else it
/// has the trait's default.
#[derive(Debug, Default)]
pub(super) struct Scripted {
    pub runs_ephemeral: bool,
    pub instance: Mutex<Option<Instance>>,
    pub deletes: Mutex<Vec<(String, Duration)>>,
    pub started: Mutex<Vec<ContainerSpec>>,
    /// What `admit` answers; `None`: queued.
    pub admission: Mutex<Option<Admission>>,
    /// What `list` answers (the node's instances, the Pods' own and others).
    pub listed: Mutex<Vec<Instance>>,
    /// `get` never answers (a backend that hangs).
    pub get_hangs: bool,
    /// What the first `events` stream carries (later ones carry nothing).
    pub events: Mutex<Option<futures::channel::mpsc::UnboundedReceiver<InstanceEvent>>>,
    /// How many event streams were asked for.
    pub event_streams: std::sync::atomic::AtomicUsize,
}

#[async_trait]
impl Provider for Scripted {
    fn name(&self) -> &str {
        "scripted"
    }
    async fn health(&self) -> Health {
        Health::Healthy
    }
    async fn capacity(&self) -> Result<Capacity> {
        Ok(Capacity {
            hosts: Vec::new(),
            kind: CapacityKind::Live,
            observed_at: SystemTime::now(),
            refresh_interval: Duration::from_secs(10),
        })
    }
    async fn admit(&self, _spec: &InstanceSpec) -> Result<Admission> {
        Ok(self
            .admission
            .lock()
            .unwrap()
            .clone()
            .unwrap_or(Admission::Queued {
                reason: "scripted".into(),
            }))
    }
    async fn create(&self, _fence: &Fence, _spec: &InstanceSpec) -> Result<Instance> {
        Err(ProviderError::transient("scripted"))
    }
    async fn get(&self, _uid: &str) -> Result<Option<Instance>> {
        if self.get_hangs {
            futures::future::pending::<()>().await;
        }
        Ok(self.instance.lock().unwrap().clone())
    }
    async fn delete(&self, _fence: &Fence, uid: &str, grace: Duration) -> Result<()> {
        self.deletes.lock().unwrap().push((uid.to_owned(), grace));
        Ok(())
    }
    async fn list(&self, _node: &str) -> Result<Vec<Instance>> {
        Ok(self.listed.lock().unwrap().clone())
    }
    fn events(&self) -> BoxStream<'static, InstanceEvent> {
        self.event_streams
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        match self.events.lock().unwrap().take() {
            Some(rx) => rx.boxed(),
            None => futures::stream::pending().boxed(),
        }
    }
    async fn start_ephemeral(
        &self,
        _fence: &Fence,
        _uid: &str,
        container: &ContainerSpec,
    ) -> Result<()> {
        if !self.runs_ephemeral {
            return Err(self.unsupported("ephemeral containers"));
        }
        self.started.lock().unwrap().push(container.clone());
        Ok(())
    }
}

/// A controller of node `vk` on `provider`, against a fake API server that
/// takes every PATCH and POST; the log holds the requests it received.
pub(super) fn controller(provider: Arc<Scripted>) -> (Arc<PodController>, Log) {
    controller_with(provider, |_| {})
}

/// What the fake API server answers by default: patches and creates succeed,
/// Node `vk` is [`node`], anything else is not found.
pub(super) fn answer(req: &Seen) -> (u16, Value) {
    match req.method.as_str() {
        "PATCH" => (
            200,
            json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}}),
        ),
        "POST" => (201, req.body.clone()),
        "GET" if req.path.starts_with("/api/v1/nodes/vk") => (200, node()),
        _ => status(404, "NotFound"),
    }
}

/// [`controller`] with its settings changed by `change`.
pub(super) fn controller_with(
    provider: Arc<Scripted>,
    change: impl FnOnce(&mut Settings),
) -> (Arc<PodController>, Log) {
    controller_answering(provider, change, answer)
}

/// [`controller_with`] against a fake API server that answers with `api`.
pub(super) fn controller_answering(
    provider: Arc<Scripted>,
    change: impl FnOnce(&mut Settings),
    api: impl Fn(&Seen) -> (u16, Value) + Send + Sync + 'static,
) -> (Arc<PodController>, Log) {
    let (client, log) = fake_api(api);
    let mut settings = Settings {
        node: "vk".into(),
        host_ip: "192.0.2.1".into(),
        epoch: 1,
        concurrency: 1,
        create_concurrency: 0,
        qps: 1000,
        burst: 1000,
        policy: super::spec::Policy::default(),
        host: None,
        queue_timeout: Duration::from_secs(600),
        gc_interval: Duration::from_secs(60),
        brake: crate::fencing::Brake::default(),
        partition_fence_after: Duration::from_secs(30),
        lifecycle_events: false,
        status_merge_window: Duration::ZERO,
        event_qps: 1000,
        event_burst: 1000,
        dra: None,
    };
    change(&mut settings);
    let c = PodController::new(
        settings,
        client.clone(),
        client,
        provider,
        crate::testing::shared(Arc::default()),
    );
    (c, log)
}

/// Node `vk` as admission reads it: room for three Pods, one label.
pub(super) fn node() -> Value {
    json!({"apiVersion": "v1", "kind": "Node",
        "metadata": {"name": "vk", "labels": {"kubernetes.io/os": "linux", "zone": "a"}},
        "status": {"allocatable": {"pods": "3"}}})
}

/// The bodies of the status patches, in order.
pub(super) fn patches(log: &Log) -> Vec<Value> {
    log.lock()
        .unwrap()
        .iter()
        .filter(|s| s.method == "PATCH")
        .map(|s| s.body.clone())
        .collect()
}

/// The Events created, in order.
pub(super) fn events(log: &Log) -> Vec<Value> {
    log.lock()
        .unwrap()
        .iter()
        .filter(|s| s.method == "POST" && s.path.ends_with("/events"))
        .map(|s| s.body.clone())
        .collect()
}

/// Events are sent by a task; wait (up to a second) for `n` of them.
pub(super) async fn wait_events(log: &Log, n: usize) -> Vec<Value> {
    for _ in 0..200 {
        let e = events(log);
        if e.len() >= n {
            return e;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    events(log)
}
