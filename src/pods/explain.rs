//! What the controller knows of a Pod, its node and the backend's instances,
//! for `vkd explain` (see [`crate::explain`]). Read-only: an answer never
//! changes a record, a reservation or the backend.

use crate::explain::{
    Action as Decided, Capacity, Collection, InstanceAnswer, NodeAnswer, Partition, PodAnswer,
    Stage, Unowned, Waiting as Queued,
};

use super::*;

/// How many recent removals, fences and brakes a node's answer lists.
const RECENT: usize = 20;

impl PodController {
    fn seconds_since_lease_renewal(&self) -> Option<f64> {
        self.lease_age().map(|d| d.as_secs_f64())
    }

    fn collection(&self) -> Collection {
        let brake = self.settings.brake;
        Collection {
            interval_seconds: self.settings.gc_interval.as_secs(),
            last_pass: *self.last_gc_pass.lock().unwrap_or_else(|p| p.into_inner()),
            braked: None,
            brake_max_fraction: brake.max_fraction,
            brake_min_count: brake.min_count,
            allow_mass_delete: brake.allow_mass_delete,
        }
    }

    /// What the next collection pass does with an unowned instance.
    fn next_pass(&self, kind: &str, braked: Option<&str>) -> String {
        let when = match *self.last_gc_pass.lock().unwrap_or_else(|p| p.into_inner()) {
            Some(last) => {
                let next = last + self.settings.gc_interval;
                match next.duration_since(SystemTime::now()) {
                    Ok(left) => format!(
                        "at the next collection pass, at the latest in {}s (every {}s, or sooner when a Pod of this node disappears)",
                        left.as_secs(),
                        self.settings.gc_interval.as_secs()
                    ),
                    Err(_) => "at the collection pass that is due now".to_owned(),
                }
            }
            None => "at the first collection pass, once the Pod watch has synced".to_owned(),
        };
        match (kind, braked) {
            ("orphan", Some(why)) => format!(
                "kept: the mass-deletion brake holds ({why}); deleted {when} once the brake opens"
            ),
            ("orphan", None) => format!(
                "deleted {when} (grace 0), with an audit line \"instance removed\" cause \"pod gone from the API\""
            ),
            _ => format!(
                "deleted {when} (grace 0), with an audit line \"instance removed\" cause \"duplicate instance\"; the brake does not hold duplicates"
            ),
        }
    }

    fn partition(&self, uid: &str, fence: bool) -> Partition {
        Partition {
            policy: if fence { "fence" } else { "keep" }.to_owned(),
            fence_after_seconds: self.settings.partition_fence_after.as_secs(),
            lease_renewed_seconds_ago: self.seconds_since_lease_renewal(),
            fenced: self
                .shared
                .partition_fenced
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .contains(uid),
        }
    }

    fn waiting(&self) -> Vec<Queued> {
        let mut out: Vec<Queued> = self
            .records()
            .values()
            .filter_map(|r| {
                Some(Queued {
                    pod_uid: r.uid.to_string(),
                    pod: r.key(),
                    since: r.progress.queued_since?.time(),
                    reason: String::new(),
                })
            })
            .collect();
        out.sort_by_key(|w| w.since);
        // The reason is the latest admission's answer, from the log.
        let mut reasons = self.shared.decisions.latest(Decided::Queued);
        for w in &mut out {
            w.reason = reasons.remove(&w.pod_uid).unwrap_or_else(|| {
                "(the admission's answer is no longer in the log; the Pod's status says it)".into()
            });
        }
        out
    }

    /// `GET /explain/pod/{namespace}/{name}`; `None` when no such Pod is bound here.
    pub(super) async fn explain_pod(&self, namespace: &str, name: &str) -> Option<PodAnswer> {
        let rec = self
            .records()
            .values()
            .find(|r| &*r.namespace == namespace && &*r.name == name)
            .map(|r| PodRecord::clone(r))?;
        let uid = rec.uid.to_string();
        let mut timeline = Vec::new();
        let bound = rec.progress.timeline.bound.map(|b| ("bound", Some(b)));
        for (stage, at) in bound.into_iter().chain(rec.progress.timeline.stages()) {
            if let Some(at) = at {
                timeline.push(Stage {
                    stage: stage.to_owned(),
                    at: at.time(),
                });
            }
        }
        let all_waiting = self.waiting();
        let position = all_waiting
            .iter()
            .position(|w| w.pod_uid == uid)
            .map(|i| (i + 1, all_waiting.len()));
        let waiting = all_waiting.into_iter().find(|w| w.pod_uid == uid);
        let slices = match &waiting {
            Some(_) => self
                .provider
                .capacity()
                .await
                .ok()
                .map(|c| Capacity::of(&c, self.settings.host.as_deref())),
            None => None,
        };
        let instance = self.provider.get(&uid).await.ok().flatten();
        let backend_details = match &instance {
            Some(_) => self.provider.describe(&uid).await.unwrap_or_default(),
            None => Vec::new(),
        };
        Some(PodAnswer {
            node: self.settings.node.clone(),
            backend: self.provider.name().to_owned(),
            leadership: self.shared.leadership.clone(),
            pod: rec.key(),
            phase: rec.phase.as_str().to_owned(),
            timeline,
            reservation: self.admitter.reservation(&uid, &rec.key()),
            waiting,
            queue_position: position,
            slices,
            instance,
            backend_details,
            partition: self.partition(&uid, rec.fence_on_partition),
            decisions: self.shared.decisions.about(&uid, ""),
            pod_uid: uid,
        })
    }

    /// The backend's instances of this node, planned as a collection pass
    /// would plan them (nothing is deleted).
    async fn plan_now(
        &self,
    ) -> Result<(Vec<Instance>, crate::fencing::Plan), vkd_provider::ProviderError> {
        let instances = self.provider.list(&self.settings.node).await?;
        let plan = {
            let records = self.records();
            crate::fencing::plan(
                &self.settings.node,
                instances.clone(),
                |uid| records.contains_key(uid),
                self.settings.brake,
            )
        };
        Ok((instances, plan))
    }

    fn unowned(&self, plan: &crate::fencing::Plan) -> Vec<Unowned> {
        let braked = plan.braked.as_deref();
        let orphans = plan.orphans.iter().map(|i| ("orphan", i));
        let duplicates = plan.duplicates.iter().map(|i| ("duplicate", i));
        orphans
            .chain(duplicates)
            .map(|(kind, i)| Unowned {
                instance: i.clone(),
                kind: kind.to_owned(),
                action: self.next_pass(kind, braked),
            })
            .collect()
    }

    /// `GET /explain/node`.
    pub(super) async fn explain_node(&self) -> NodeAnswer {
        let (capacity, capacity_error) = match self.provider.capacity().await {
            Ok(c) => (Some(Capacity::of(&c, self.settings.host.as_deref())), None),
            Err(e) => (None, Some(e.to_string())),
        };
        let keys: HashMap<String, String> = self
            .records()
            .values()
            .map(|r| (r.uid.to_string(), r.key()))
            .collect();
        let reservations = self.admitter.reservations(|uid| keys.get(uid).cloned());
        let mut collection = self.collection();
        let (instances, unowned, list_error) = match self.plan_now().await {
            Ok((all, plan)) => {
                collection.braked.clone_from(&plan.braked);
                (all.len(), self.unowned(&plan), None)
            }
            Err(e) => (0, Vec::new(), Some(e.to_string())),
        };
        NodeAnswer {
            node: self.settings.node.clone(),
            backend: self.provider.name().to_owned(),
            leadership: self.shared.leadership.clone(),
            host: self.settings.host.clone(),
            capacity,
            capacity_error,
            reservations,
            waiting: self.waiting(),
            pods: keys.len(),
            instances,
            unowned,
            list_error,
            collection,
            recent: self.shared.decisions.recent(
                &self.settings.node,
                &[Decided::Removed, Decided::Fenced, Decided::Braked],
                RECENT,
            ),
            partition_fence_after_seconds: self.settings.partition_fence_after.as_secs(),
            lease_renewed_seconds_ago: self.seconds_since_lease_renewal(),
        }
    }

    /// `GET /explain/instance/{id}`: whose the instance is, or why it is an
    /// orphan or a duplicate, and what happens to it.
    pub(super) async fn explain_instance(
        &self,
        id: &str,
    ) -> Result<InstanceAnswer, vkd_provider::ProviderError> {
        let (all, plan) = self.plan_now().await?;
        let mut collection = self.collection();
        collection.braked.clone_from(&plan.braked);
        let found = all.iter().find(|i| i.id == id).cloned();
        let uid = found.as_ref().map(|i| i.owner.uid.clone());
        let decisions = self.shared.decisions.about("", id);
        let (verdict, why, action) = match &found {
            None => {
                let last = decisions
                    .iter()
                    .rev()
                    .find(|d| matches!(d.action, Decided::Removed | Decided::Fenced));
                let why = match last {
                    Some(d) => format!(
                        "backend {} has no instance {id} for node {}; replica {} (epoch {}) removed it: {}",
                        self.provider.name(),
                        self.settings.node,
                        d.replica,
                        d.epoch,
                        d.detail
                    ),
                    None => format!(
                        "backend {} has no instance {id} for node {}, and this replica's recent decisions do not name it",
                        self.provider.name(),
                        self.settings.node
                    ),
                };
                ("gone", why, "nothing: it is gone".to_owned())
            }
            Some(i) if plan.duplicates.iter().any(|d| d.id == i.id) => {
                let newer = all
                    .iter()
                    .find(|o| {
                        o.owner.uid == i.owner.uid
                            && !plan.duplicates.iter().any(|d| d.id == o.id)
                    })
                    .map(|o| o.id.clone());
                (
                    "duplicate",
                    format!(
                        "Pod {} (uid {}) has another instance{} of a newer epoch or creation; this one was made under epoch {} at {}",
                        i.owner,
                        i.owner.uid,
                        newer.map(|n| format!(" ({n})")).unwrap_or_default(),
                        i.epoch,
                        status::time(i.created_at)
                    ),
                    self.next_pass("duplicate", None),
                )
            }
            Some(i) if plan.orphans.iter().any(|o| o.id == i.id) => (
                "orphan",
                format!(
                    "no Pod with uid {} is bound to node {}: {} was deleted (or force-deleted) while its instance ran, or the instance was made outside vkd; made under epoch {} at {}",
                    i.owner.uid,
                    self.settings.node,
                    i.owner,
                    i.epoch,
                    status::time(i.created_at)
                ),
                self.next_pass("orphan", plan.braked.as_deref()),
            ),
            Some(i) => (
                "owned",
                format!(
                    "the instance of Pod {} (uid {}) on node {}, made under epoch {} at {}",
                    i.owner,
                    i.owner.uid,
                    self.settings.node,
                    i.epoch,
                    status::time(i.created_at)
                ),
                "kept while its Pod exists; removed when the Pod is deleted, before the Pod object goes".to_owned(),
            ),
        };
        let backend_details = match &uid {
            Some(u) => self.provider.describe(u).await.unwrap_or_default(),
            None => Vec::new(),
        };
        let mut decisions = decisions;
        if let Some(u) = &uid {
            for d in self.shared.decisions.about(u, "") {
                if !decisions.contains(&d) {
                    decisions.push(d);
                }
            }
            decisions.sort_by_key(|d| d.at);
        }
        Ok(InstanceAnswer {
            node: self.settings.node.clone(),
            backend: self.provider.name().to_owned(),
            leadership: self.shared.leadership.clone(),
            id: id.to_owned(),
            instance: found,
            backend_details,
            verdict: verdict.to_owned(),
            why,
            action,
            collection,
            decisions,
        })
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use serde_json::json;

    use super::super::test_support::{Scripted, controller};
    use super::*;

    fn instance(uid: &str, id: &str, epoch: u64) -> Instance {
        let t = json!({"secs_since_epoch": 1_767_225_600 + epoch, "nanos_since_epoch": 0});
        serde_json::from_value(json!({
            "id": id,
            "owner": {"uid": uid, "namespace": "ns", "name": format!("p-{uid}")},
            "node": "vk", "epoch": epoch, "phase": "Running", "containers": [],
            "ip": null, "host": "host-a", "created_at": t, "started_at": t, "message": null
        }))
        .unwrap()
    }

    fn pod(uid: &str, name: &str) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": "ns", "uid": uid,
                "annotations": {"vkd.io/partition-policy": "fence"}},
            "spec": {"nodeName": "vk", "containers": [{"name": "main", "image": "x"}]},
            "status": {"phase": "Running"}
        }))
        .unwrap()
    }

    /// The backend holds the Pod's instance, an older duplicate of it, and an
    /// instance whose Pod is gone: each is told apart, with what collection
    /// does, and an id the backend does not hold is "gone" with the removal
    /// that the log recorded.
    #[tokio::test]
    async fn instances_are_owned_duplicates_orphans_or_gone() {
        let provider = Arc::new(Scripted::default());
        *provider.listed.lock().unwrap() = vec![
            instance("u1", "i-own", 2),
            instance("u1", "i-dup", 1),
            instance("u9", "i-orphan", 1),
        ];
        let (c, _log) = controller(Arc::clone(&provider));
        c.upsert(&pod("u1", "p"));

        let own = c.explain_instance("i-own").await.unwrap();
        assert_eq!(own.verdict, "owned", "{own:?}");
        let dup = c.explain_instance("i-dup").await.unwrap();
        assert_eq!(dup.verdict, "duplicate");
        assert!(dup.why.contains("(i-own)"), "{}", dup.why);
        assert!(
            dup.action.contains("brake does not hold duplicates"),
            "{}",
            dup.action
        );
        let orphan = c.explain_instance("i-orphan").await.unwrap();
        assert_eq!(orphan.verdict, "orphan");
        assert!(orphan.why.contains("no Pod with uid u9"), "{}", orphan.why);
        // No pass yet: the Pod watch has not synced in this test.
        assert!(
            orphan.action.contains("first collection pass"),
            "{}",
            orphan.action
        );

        c.cx().audit_removed(
            "u8",
            "ns/old",
            "i-old",
            1,
            Decided::Removed,
            "pod gone from the API",
        );
        let gone = c.explain_instance("i-old").await.unwrap();
        assert_eq!(gone.verdict, "gone");
        assert!(
            gone.why.contains("removed it: pod gone from the API"),
            "{}",
            gone.why
        );
        assert_eq!(gone.decisions.len(), 1);
        let unknown = c.explain_instance("i-never").await.unwrap();
        assert!(unknown.why.contains("do not name it"), "{}", unknown.why);

        let node = c.explain_node().await;
        let kinds: Vec<(&str, &str)> = node
            .unowned
            .iter()
            .map(|u| (u.instance.id.as_str(), u.kind.as_str()))
            .collect();
        assert_eq!(kinds, [("i-orphan", "orphan"), ("i-dup", "duplicate")]);
        assert_eq!((node.pods, node.instances), (1, 3));
        assert_eq!(node.recent.len(), 1, "the removal is recent");
    }

    #[tokio::test]
    async fn a_pod_answer_carries_its_instance_policy_and_decisions() {
        let provider = Arc::new(Scripted::default());
        *provider.instance.lock().unwrap() = Some(instance("u1", "i-own", 1));
        let (c, _log) = controller(Arc::clone(&provider));
        c.upsert(&pod("u1", "p"));
        c.cx()
            .decided("u1", "ns/p", "i-own", Decided::Created, "made");
        c.cx()
            .decided("u2", "ns/q", "", Decided::Queued, "not this one");

        assert!(c.explain_pod("ns", "nope").await.is_none());
        let a = c.explain_pod("ns", "p").await.unwrap();
        assert_eq!(a.pod_uid, "u1");
        assert_eq!(a.instance.as_ref().map(|i| i.id.as_str()), Some("i-own"));
        assert_eq!(a.partition.policy, "fence");
        assert_eq!(a.partition.fence_after_seconds, 30);
        assert!(a.waiting.is_none() && a.slices.is_none());
        let details: Vec<&str> = a.decisions.iter().map(|d| d.detail.as_str()).collect();
        assert_eq!(details, ["made"]);
        let json = serde_json::to_value(&a).unwrap();
        let back: PodAnswer = serde_json::from_value(json).unwrap();
        assert_eq!(back.pod, "ns/p");
    }
}
