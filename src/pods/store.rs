//! The records of this node's Pods: the one map the watch writes and the
//! steps read and update, under one lock held only for moments.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};

use super::model::{PodRecord, Progress};

#[derive(Default)]
pub(super) struct PodStore {
    /// Boxed: a map's slots stay allocated at its largest size and are only
    /// 60-90% full, so a slot should be a pointer, not a whole record.
    records: Mutex<HashMap<String, Box<PodRecord>>>,
}

impl PodStore {
    pub(super) fn lock(&self) -> MutexGuard<'_, HashMap<String, Box<PodRecord>>> {
        self.records.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A copy of the Pod's record, if it has one.
    pub(super) fn get(&self, uid: &str) -> Option<PodRecord> {
        self.lock().get(uid).map(|r| PodRecord::clone(r))
    }

    /// Updates the stored record, if the Pod still has one.
    pub(super) fn touch(&self, uid: &str, f: impl FnOnce(&mut PodRecord)) {
        if let Some(r) = self.lock().get_mut(uid) {
            f(r);
        }
    }

    /// Updates the stored record if it still is as `when` asks; says whether it was.
    pub(super) fn touch_if(
        &self,
        uid: &str,
        when: impl FnOnce(&PodRecord) -> bool,
        f: impl FnOnce(&mut PodRecord),
    ) -> bool {
        match self.lock().get_mut(uid) {
            Some(r) if when(r) => {
                f(r);
                true
            }
            _ => false,
        }
    }

    /// Updates what the steps learned of a Pod, if it still has a record;
    /// returns what `f` returns.
    pub(super) fn update<R>(&self, uid: &str, f: impl FnOnce(&mut Progress) -> R) -> Option<R> {
        self.lock().get_mut(uid).map(|r| f(&mut r.progress))
    }
}
