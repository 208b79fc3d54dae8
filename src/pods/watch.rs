//! The controller's inputs: the watch of this node's Pods (which builds and
//! updates the records), the watch of the Node (for admission), the
//! provider's instance events and the periodic resync. Each only queues
//! Pods; the workers do the rest.

use k8s_openapi::api::core::v1::Node;

use super::*;

impl PodController {
    pub(super) async fn watch(&self, shutdown: CancellationToken) {
        let pods: Api<Pod> = Api::all(self.watch_client.clone());
        let cfg =
            watcher::Config::default().fields(&format!("spec.nodeName={}", self.settings.node));
        let mut stream = watcher(pods, cfg).default_backoff().boxed();
        let mut seen: Option<HashSet<String>> = None;
        loop {
            let event = tokio::select! {
                _ = shutdown.cancelled() => return,
                e = stream.next() => e,
            };
            match event {
                None => return,
                Some(Err(e)) => warn!(error = %e, "pod watch failed; retrying"),
                Some(Ok(watcher::Event::Init)) => seen = Some(HashSet::new()),
                Some(Ok(watcher::Event::InitApply(pod))) => {
                    if let Some(uid) = self.upsert(&pod)
                        && let Some(seen) = seen.as_mut()
                    {
                        seen.insert(uid);
                    }
                }
                Some(Ok(watcher::Event::Apply(pod))) => {
                    self.upsert(&pod);
                }
                Some(Ok(watcher::Event::Delete(pod))) => {
                    if let Some(uid) = pod.metadata.uid {
                        let mut records = self.records();
                        records.remove(&uid);
                        vkd_provider::release_spare(&mut *records);
                        drop(records);
                        self.queue.add(&uid);
                    }
                }
                Some(Ok(watcher::Event::InitDone)) => {
                    // Pods that vanished while the watch was down count as deleted.
                    if let Some(seen) = seen.take() {
                        let gone: Vec<String> = self
                            .records()
                            .keys()
                            .filter(|uid| !seen.contains(*uid))
                            .cloned()
                            .collect();
                        for uid in gone {
                            self.records().remove(&uid);
                            self.queue.add(&uid);
                        }
                    }
                    if !self.synced.swap(true, Ordering::AcqRel) {
                        info!(
                            pods = self.records().len(),
                            "pod watch synced; collecting orphans"
                        );
                        tokio::select! {
                            _ = shutdown.cancelled() => return,
                            () = self.gc_pass() => {}
                        }
                    }
                }
            }
        }
    }

    /// A watch event: the Pod's record is made, or what the API server holds
    /// of it read again (what the steps learned stays).
    pub(super) fn upsert(&self, pod: &Pod) -> Option<String> {
        let uid = pod.metadata.uid.clone()?;
        let node = &self.settings.node;
        let observed = status::observed_of(pod);
        let mut records = self.records();
        let first_seen = !records.contains_key(&uid);
        let rec = match records.get_mut(&uid) {
            Some(rec) => {
                rec.update(pod, node, observed);
                rec
            }
            None => {
                let rec = PodRecord::new(pod, node, observed, SystemTime::now())?;
                records.entry(uid.clone()).or_insert(Box::new(rec))
            }
        };
        if let Some(pending) = rec.pending.as_deref_mut()
            && pending.spec.pod_spec.is_none()
            && self.provider.capabilities().pod_spec == Support::Supported
        {
            // Only for a backend that asks: most keep no copy of the spec.
            pending.spec.pod_spec = pod
                .spec
                .as_ref()
                .and_then(|s| serde_json::to_string(s).ok());
        }
        let urgent = first_seen && rec.awaits_create();
        drop(records);
        if urgent {
            self.queue.add_first(&uid);
        } else {
            self.queue.add(&uid);
        }
        Some(uid)
    }

    /// A backend event: its Pod is looked at again, if this node holds it
    /// (says whether it does). An instance of a Pod no node holds is an
    /// orphan: the collector's, which the Pod's deletion already woke.
    pub(super) fn on_provider_event(&self, event: &InstanceEvent) -> bool {
        match event {
            InstanceEvent::Changed { uid } => {
                let held = self.records().contains_key(uid);
                if held {
                    self.queue.add(uid);
                }
                held
            }
            InstanceEvent::Resync => {
                self.enqueue_all();
                true
            }
        }
    }

    pub(super) async fn resync(&self, shutdown: CancellationToken) {
        let mut tick = tokio::time::interval(RESYNC);
        tick.tick().await;
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tick.tick() => self.enqueue_all(),
            }
        }
    }

    pub(super) fn enqueue_all(&self) {
        let uids: Vec<String> = self.records().keys().cloned().collect();
        for uid in uids {
            self.queue.add(&uid);
        }
    }

    /// Keeps [`Self::node_view`] current from a watch of this node alone.
    pub(super) async fn node_watch(&self, shutdown: CancellationToken) {
        let nodes: Api<Node> = Api::all(self.watch_client.clone());
        let cfg =
            watcher::Config::default().fields(&format!("metadata.name={}", self.settings.node));
        let mut stream = watcher(nodes, cfg).default_backoff().boxed();
        loop {
            let event = tokio::select! {
                _ = shutdown.cancelled() => return,
                e = stream.next() => e,
            };
            match event {
                None => return,
                Some(Err(e)) => warn!(error = %e, "node watch failed; retrying"),
                Some(Ok(watcher::Event::Apply(n) | watcher::Event::InitApply(n))) => {
                    self.cx().set_node_view(&n);
                }
                Some(Ok(_)) => {}
            }
        }
    }
}

/// Reads the provider's instance events once for all the nodes this vkd
/// serves, and hands each to the node whose Pod it concerns (a resync to
/// every node). In per-host mode one provider serves a node per host: a
/// stream per node would deliver every event to every node.
pub async fn route_backend_events(
    provider: Arc<dyn Provider>,
    nodes: Vec<Arc<PodController>>,
    shutdown: CancellationToken,
) -> Result<(), std::convert::Infallible> {
    let mut events = provider.events();
    loop {
        let event = tokio::select! {
            _ = shutdown.cancelled() => return Ok(()),
            e = events.next() => e,
        };
        match event {
            None => {
                // A provider without (more) events: the periodic resync still
                // visits every Pod, so this is no reason to stop the nodes.
                warn!("the provider's event stream ended; relying on resync");
                shutdown.cancelled().await;
                return Ok(());
            }
            Some(event @ InstanceEvent::Changed { .. }) => {
                // The first node that holds the Pod takes it; the rest are not asked.
                let _ = nodes.iter().any(|n| n.on_provider_event(&event));
            }
            Some(InstanceEvent::Resync) => {
                for n in &nodes {
                    n.on_provider_event(&InstanceEvent::Resync);
                }
            }
        }
    }
}
