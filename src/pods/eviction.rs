//! Local ephemeral storage limits, enforced as the kubelet's eviction manager
//! enforces them: a Pod whose emptyDir outgrows its `sizeLimit`, whose usage
//! outgrows the sum of its containers' `ephemeral-storage` limits, or one of
//! whose containers outgrows its own, is evicted: its containers are stopped
//! at once and the Pod fails with reason `Evicted`. The usage figures come from
//! the provider's stats; a provider that does not measure them enforces nothing.

use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tracing::{info_span, warn};
use vkd_provider::Support;

use super::PodController;
use super::model::{Phase, PodRecord, StorageLimits};

/// How often usage is measured: the kubelet's eviction manager's period.
pub const CHECK_EVERY: Duration = Duration::from_secs(10);

/// The status reason and Event reason of an eviction, as the kubelet's.
pub const REASON: &str = "Evicted";

/// The grace period an evicted Pod's containers get, as the kubelet gives
/// for a limit it enforces (`immediateEvictionGracePeriodSeconds`).
pub const GRACE: Duration = Duration::from_secs(1);

/// A Pod the eviction manager looks at: running, and not being deleted.
fn evictable(r: &PodRecord) -> bool {
    r.instance_id.is_some() && r.deletion_grace.is_none() && r.phase == Phase::Running
}

impl PodController {
    /// Measures the storage of each running Pod that has a limit, every
    /// [`CHECK_EVERY`], and queues those that broke one for eviction.
    pub(super) async fn storage_watch(&self, shutdown: CancellationToken) {
        if self.provider.capabilities().stats != Support::Supported {
            // Nothing to measure; a task that ended would stop the node.
            shutdown.cancelled().await;
            return;
        }
        let mut tick = tokio::time::interval(CHECK_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                _ = tick.tick() => {}
            }
            let watched: Vec<(String, String, Box<StorageLimits>)> = self
                .records()
                .values()
                .filter(|r| evictable(r) && r.evicting().is_none())
                .filter_map(|r| Some((r.uid.to_string(), r.key(), r.storage_limits.clone()?)))
                .collect();
            for (uid, key, limits) in watched {
                let stats = tokio::select! {
                    _ = shutdown.cancelled() => return,
                    s = self.provider.stats(&uid) => s,
                };
                let Ok(stats) = stats else { continue };
                let Some(message) = limits.exceeded(&stats) else {
                    continue;
                };
                // Still running as it was when the pass began: not ended,
                // deleted or failed meanwhile.
                let marked = self.store.touch_if(&uid, evictable, |r| {
                    r.progress.failing_mut().evicting = Some(message.as_str().into());
                });
                if !marked {
                    continue;
                }
                info_span!("pod", pod = %key, %uid).in_scope(|| {
                    warn!(reason = REASON, %message, "evicting the pod");
                });
                self.queue.add(&uid);
            }
        }
    }
}
