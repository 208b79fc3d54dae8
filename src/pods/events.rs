//! Events about Pods and the Node, as the kubelet's, within a budget.

use super::*;

/// The reporting controller of vkd's Pod Events: the kubelet's own name, as
/// the node's kubelet is what vkd is. Users and tools find a node's Pod
/// Events by it (`kubectl get events --field-selector source=kubelet`, which
/// the API server answers from reportingController for events.k8s.io Events).
/// The reporting instance is the node name, so which vkd reported it stays plain.
pub(super) const EVENT_REPORTER: &str = "kubelet";

/// Pod Events being sent at once, beside the reconciles.
pub(super) const EVENTS_IN_FLIGHT: usize = 32;

/// Pod Events waiting to be sent (about a kilobyte each). Beyond this many an
/// Event is dropped and counted (`vkd_events_dropped_total`), as the kubelet's
/// event broadcaster drops them: a busy API server must not slow creates, and
/// the Pod's status and the audit log still carry what the Event said.
pub(super) const EVENTS_PENDING: usize = 1024;

/// How a one-off Pod Event ([`EventSink::event`], sent by a task beside
/// the workers) meets vkd's Event rate (`--event-qps`, `--event-burst`, the
/// kubelet's limits and defaults: 50 a second, 100 at once). The repeating
/// and container Events are published by the workers themselves, which must
/// not wait for an Event's turn; they keep their per-Pod spam budget.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Pace {
    /// Waits for its turn: queueing, failures, anything a person must see.
    Wait,
    /// The per-Pod `InstanceCreated`: over the rate it is dropped and counted
    /// at once. In a storm of thousands of Pods an Event each would cost the
    /// API server about half as much again as the Pod's status write (the
    /// benchmark in docs/scale.md), and sent late it would compete with the
    /// next Pods' writes;
    /// the Pod's `vkd.io/instance-id` and `vkd.io/host` annotations and the
    /// log's `instance created` line carry what it says.
    ShedOverRate,
}

/// The kubelet's spam filter on a Pod's Events (client-go's
/// `EventSourceObjectSpamFilter`): 25 at once, then one per 5 minutes, so a
/// probe failing every second costs the API server a burst, not a write a
/// second for as long as it fails.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct EventBudget {
    tokens: u8,
    /// When the last token was taken or given back.
    since: Option<Stamp>,
}

impl EventBudget {
    const BURST: u8 = 25;
    const REFILL: Duration = Duration::from_secs(300);

    /// Takes one Event from the budget at `now`: false when none is left.
    pub(super) fn take(&mut self, now: SystemTime) -> bool {
        if let Some(since) = self.since {
            let elapsed = now.duration_since(since.time()).unwrap_or_default();
            let earned = elapsed.as_secs() / Self::REFILL.as_secs();
            if earned > 0 {
                let earned = u8::try_from(earned).unwrap_or(u8::MAX);
                self.tokens = self.tokens.saturating_add(earned).min(Self::BURST);
                self.since = Some(Stamp::from(now));
            }
        } else {
            self.since = Some(Stamp::from(now));
        }
        if self.tokens == 0 {
            return false;
        }
        self.tokens -= 1;
        true
    }
}

/// What was published of a Pod's container events.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct ContainerEvents {
    /// The last one handled ([`vkd_provider::ContainerEvent::seq`]).
    seen: u64,
    budget: EventBudget,
}

impl Default for EventBudget {
    fn default() -> Self {
        Self {
            tokens: Self::BURST,
            since: None,
        }
    }
}

/// Where Pod and Node Events go: the kubelet's rate (`--event-qps`,
/// `--event-burst`) and spam filter, a bounded backlog, and what was
/// published of each Pod's container events.
pub(super) struct EventSink {
    node: String,
    client: Client,
    recorder: Recorder,
    /// Every Pod write waits here (Events too); the node lease never does.
    writes: Arc<DefaultDirectRateLimiter>,
    /// Pod Events per second, as the kubelet's --event-qps (see [`Pace`]).
    rate: Arc<DefaultDirectRateLimiter>,
    /// Events being sent: a worker hands its Event to a task and goes on; the
    /// task waits for one of these slots.
    slots: Arc<tokio::sync::Semaphore>,
    /// Events handed to tasks and not yet sent ([`EVENTS_PENDING`]).
    backlog: Arc<tokio::sync::Semaphore>,
    metrics: Arc<crate::metrics::Metrics>,
    term: crate::fencing::term::Term,
    /// When this controller started: container events from before it were
    /// published by the vkd before (or lost with it), never twice.
    started: SystemTime,
    /// What was published of each Pod's container events, for the Pods that
    /// have had any: beside the records, which stay small for the many
    /// Pods whose probes never fail.
    container: Mutex<HashMap<String, ContainerEvents>>,
}

impl EventSink {
    pub(super) fn new(
        settings: &Settings,
        client: &Client,
        writes: Arc<DefaultDirectRateLimiter>,
        shared: &Shared,
    ) -> Self {
        let recorder = Recorder::new(
            client.clone(),
            Reporter {
                controller: EVENT_REPORTER.into(),
                instance: Some(settings.node.clone()),
            },
        );
        Self {
            node: settings.node.clone(),
            client: client.clone(),
            recorder,
            writes,
            rate: Arc::new(RateLimiter::direct(
                Quota::per_second(nz(settings.event_qps)).allow_burst(nz(settings.event_burst)),
            )),
            slots: Arc::new(tokio::sync::Semaphore::new(EVENTS_IN_FLIGHT)),
            backlog: Arc::new(tokio::sync::Semaphore::new(EVENTS_PENDING)),
            metrics: Arc::clone(&shared.metrics),
            term: shared.term.clone(),
            started: SystemTime::now(),
            container: Mutex::default(),
        }
    }

    /// The Pod is gone: what was published of its container events goes too.
    pub(super) fn forget(&self, uid: &str) {
        self.container
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(uid);
    }

    async fn throttle(&self) {
        throttle(&self.writes, &self.metrics, "event").await;
    }

    pub(super) async fn node_event(&self, reason: &str, note: &str) {
        let reference = ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Node".into()),
            name: Some(self.node.clone()),
            ..ObjectReference::default()
        };
        let ev = KubeEvent {
            type_: EventType::Warning,
            reason: reason.to_owned(),
            note: Some(note.chars().take(1000).collect()),
            action: "Collect".into(),
            secondary: None,
        };
        if let Err(e) = self.recorder.publish(&ev, &reference).await {
            warn!(error = %e, reason, "publishing event failed");
        }
    }

    /// Publishes a one-off Event about a Pod. It is created directly, not through
    /// kube's `Recorder`: the Recorder keeps every Event it sent for six minutes
    /// (to count repeats as a series), which at thousands of Pods is kilobytes per
    /// Pod for Events that never repeat.
    pub(super) fn event(
        &self,
        rec: &PodRecord,
        type_: EventType,
        reason: &str,
        note: &str,
        action: &str,
    ) {
        self.paced_event(rec, type_, reason, note, action, Pace::Wait);
    }

    /// [`Self::event`], at the given [`Pace`].
    pub(super) fn paced_event(
        &self,
        rec: &PodRecord,
        type_: EventType,
        reason: &str,
        note: &str,
        action: &str,
        pace: Pace,
    ) {
        use k8s_openapi::api::events::v1::Event;
        use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
        if pace == Pace::ShedOverRate && self.rate.check().is_err() {
            self.metrics.event_dropped();
            debug!(reason, "event dropped: over --event-qps");
            return;
        }
        let waiting = match Arc::clone(&self.backlog).try_acquire_owned() {
            Ok(w) => w,
            Err(tokio::sync::TryAcquireError::NoPermits) => {
                self.metrics.event_dropped();
                debug!(
                    reason,
                    "event dropped: {EVENTS_PENDING} are waiting to be sent"
                );
                return;
            }
            Err(tokio::sync::TryAcquireError::Closed) => return,
        };
        let event = Event {
            metadata: ObjectMeta {
                // A generateName must itself be a valid name but for a trailing dash.
                generate_name: Some(format!("{}-", rec.name)),
                namespace: Some(rec.namespace.to_string()),
                ..ObjectMeta::default()
            },
            event_time: Some(MicroTime(jiff::Timestamp::now())),
            type_: Some(
                match type_ {
                    EventType::Normal => "Normal",
                    EventType::Warning => "Warning",
                }
                .to_owned(),
            ),
            reason: Some(reason.to_owned()),
            note: Some(note.chars().take(1000).collect()),
            action: Some(action.to_owned()),
            reporting_controller: Some(EVENT_REPORTER.to_owned()),
            reporting_instance: Some(self.node.clone()),
            regarding: Some(Self::pod_reference(rec)),
            ..Event::default()
        };
        let api: Api<Event> = Api::namespaced(self.client.clone(), &rec.namespace);
        let slots = Arc::clone(&self.slots);
        let limiter = Arc::clone(&self.writes);
        // A shed-over-rate Event took its turn above.
        let event_limiter = (pace == Pace::Wait).then(|| Arc::clone(&self.rate));
        let metrics = Arc::clone(&self.metrics);
        let reason = reason.to_owned();
        // The term's work: an Event still waiting when the term ends is
        // dropped with it, not sent by a replica that no longer acts.
        let work = self.term.work();
        tokio::spawn(
            async move {
                let send = async {
                    if let Some(l) = event_limiter {
                        l.until_ready().await;
                    }
                    let Ok(slot) = slots.acquire_owned().await else {
                        return;
                    };
                    throttle(&limiter, &metrics, "event").await;
                    if let Err(e) = api.create(&PostParams::default(), &event).await {
                        warn!(error = %e, reason, "publishing event failed");
                    }
                    drop(slot);
                };
                tokio::select! {
                    () = send => {}
                    () = work.cancelled() => debug!(reason, "event dropped: the term ended"),
                }
                drop(waiting);
            }
            .in_current_span(),
        );
    }

    pub(super) fn pod_reference(rec: &PodRecord) -> ObjectReference {
        ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Pod".into()),
            name: Some(rec.name.to_string()),
            namespace: Some(rec.namespace.to_string()),
            uid: Some(rec.uid.to_string()),
            ..ObjectReference::default()
        }
    }

    /// An Event that may repeat (a deletion the backend keeps refusing): kube's
    /// `Recorder` turns the repeats into one Event with a count.
    pub(super) async fn repeating_event(
        &self,
        rec: &PodRecord,
        reason: &str,
        note: &str,
        action: &str,
    ) {
        self.throttle().await;
        let ev = KubeEvent {
            type_: EventType::Warning,
            reason: reason.to_owned(),
            note: Some(note.chars().take(1000).collect()),
            action: action.to_owned(),
            secondary: None,
        };
        if let Err(e) = self.recorder.publish(&ev, &Self::pod_reference(rec)).await {
            warn!(error = %e, reason, "publishing event failed");
        }
    }

    /// Publishes the events the backend recorded for the Pod's containers
    /// since those handled before, as the kubelet's: about the container
    /// (`spec.containers{name}`), repeats counted as one series. Those from
    /// before this vkd started are not published: the vkd before did, or
    /// they went with it.
    pub(super) async fn container_events(&self, rec: &PodRecord, instance: &Instance) {
        let Some(last) = instance.events.last().map(|e| e.seq) else {
            return;
        };
        let before = self
            .container
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&*rec.uid)
            .copied()
            .unwrap_or_default();
        if last <= before.seen {
            return;
        }
        let mut budget = before.budget;
        for e in instance.events.iter().filter(|e| e.seq > before.seen) {
            if e.time < self.started {
                continue;
            }
            if !budget.take(SystemTime::now()) {
                self.metrics.event_dropped();
                debug!(
                    reason = e.reason,
                    "event dropped: the Pod's budget is spent"
                );
                continue;
            }
            let mut reference = Self::pod_reference(rec);
            let list = if rec.init_containers.iter().any(|c| *c.name == *e.container) {
                "initContainers"
            } else {
                "containers"
            };
            reference.field_path = Some(format!("spec.{list}{{{}}}", e.container));
            let action = if e.action.is_empty() {
                "Probe"
            } else {
                &e.action
            };
            let ev = KubeEvent {
                type_: if e.warning {
                    EventType::Warning
                } else {
                    EventType::Normal
                },
                reason: e.reason.clone(),
                note: Some(e.message.chars().take(1000).collect()),
                action: action.to_owned(),
                secondary: None,
            };
            self.throttle().await;
            if let Err(err) = self.recorder.publish(&ev, &reference).await {
                warn!(error = %err, reason = e.reason, "publishing event failed");
            }
        }
        self.container
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(rec.uid.to_string(), ContainerEvents { seen: last, budget });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pods_event_budget_is_a_burst_then_one_per_five_minutes() {
        let start = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        let mut b = EventBudget::default();
        for _ in 0..25 {
            assert!(b.take(start));
        }
        assert!(!b.take(start));
        assert!(!b.take(start + Duration::from_secs(299)));
        assert!(b.take(start + Duration::from_secs(300)));
        assert!(!b.take(start + Duration::from_secs(301)));
        // An hour later, twelve more; never past the burst.
        let later = start + Duration::from_secs(300 + 3600);
        for _ in 0..12 {
            assert!(b.take(later));
        }
        assert!(!b.take(later));
        let much_later = later + Duration::from_secs(86_400);
        for _ in 0..25 {
            assert!(b.take(much_later));
        }
        assert!(!b.take(much_later));
        // A clock that went back earns nothing and breaks nothing.
        assert!(!b.take(start));
    }
}
