//! `activeDeadlineSeconds`: when a Pod is looked at again for it, and what
//! happens when it passes.

use super::cx::Failure;
use super::*;

impl Cx<'_> {
    /// What follows a reconcile that leaves the Pod running or waiting: it is
    /// looked at again when its active deadline passes, or after `otherwise`.
    /// Read from the stored record, whose start time a status write may just
    /// have set.
    pub(super) fn deadline_action(&self, uid: &str, otherwise: Option<Duration>) -> Action {
        let left = self.store.lock().get(uid).and_then(|r| {
            if r.terminal() {
                return None;
            }
            r.active_deadline?
                .left(r.start_time?.time(), SystemTime::now())
                .map(|l| l.min(DEADLINE_RECHECK_MAX))
        });
        match (left, otherwise) {
            (Some(l), Some(o)) => Action::After(l.min(o)),
            (Some(d), None) | (None, Some(d)) => Action::After(d),
            (None, None) => Action::Done,
        }
    }
}

/// `activeDeadlineSeconds` passed: as the kubelet, the containers stop with
/// the Pod's grace period and the Pod fails with `DeadlineExceeded`.
pub(super) fn exceeded(deadline: model::ActiveDeadline) -> Failure<'static> {
    Failure {
        reason: DEADLINE_REASON,
        message: DEADLINE_MESSAGE,
        grace: Duration::from_secs(deadline.grace_seconds.into()),
        event_type: EventType::Normal,
    }
}
