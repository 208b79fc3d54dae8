//! The daemon's own metrics (prometheus-client), served at the admin port's
//! `/metrics`. Object UIDs and instance ids go in logs, never in labels.

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    /// Backend instances found beside a newer one for the same Pod UID.
    pub duplicates_found: Counter,
    /// Instances deleted because their Pod was gone.
    pub orphans_removed: Counter,
    /// Collection passes the brake stopped.
    pub gc_braked: Counter,
    /// Backend calls refused because they carried an old epoch.
    pub fenced_refused: Counter,
    /// Instances stopped by the partition policy.
    pub partition_fenced: Counter,
    /// Pods with a deletionTimestamp whose instance is not yet confirmed gone.
    pub deletions_pending: Gauge,
    /// 1 while this replica holds the leader lease.
    pub leader: Gauge,
    /// The epoch this replica acts under.
    pub epoch: Gauge,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("vkd");
        let m = |r: &mut Registry, name: &str, help: &str, c: Counter| {
            r.register(name, help, c.clone());
            c
        };
        let duplicates_found = m(
            &mut registry,
            "duplicate_instances_found",
            "Backend instances found beside a newer one for the same Pod UID",
            Counter::default(),
        );
        let orphans_removed = m(
            &mut registry,
            "orphans_removed",
            "Instances deleted because their Pod was gone",
            Counter::default(),
        );
        let gc_braked = m(
            &mut registry,
            "gc_braked",
            "Collection passes the mass-deletion brake stopped",
            Counter::default(),
        );
        let fenced_refused = m(
            &mut registry,
            "fenced_operations_refused",
            "Backend calls refused because they carried an old epoch",
            Counter::default(),
        );
        let partition_fenced = m(
            &mut registry,
            "partition_fenced_instances",
            "Instances stopped by the partition policy",
            Counter::default(),
        );
        let deletions_pending = Gauge::default();
        registry.register(
            "deletions_pending",
            "Pods being deleted whose instance is not yet confirmed gone",
            deletions_pending.clone(),
        );
        let leader = Gauge::default();
        registry.register(
            "leader",
            "1 while this replica holds the leader lease",
            leader.clone(),
        );
        let epoch = Gauge::default();
        registry.register("epoch", "The epoch this replica acts under", epoch.clone());
        Self {
            registry,
            duplicates_found,
            orphans_removed,
            gc_braked,
            fenced_refused,
            partition_fenced,
            deletions_pending,
            leader,
            epoch,
        }
    }
}

impl Metrics {
    /// The OpenMetrics text exposition.
    pub fn render(&self) -> String {
        let mut out = String::new();
        if encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }
}
