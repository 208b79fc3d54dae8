//! What of this daemon's pools the scheduler has allocated, counted by pool
//! from the claims the binder watches (`vkd_dra_allocated_devices`). Pure
//! state: the binder feeds it claim events and publishes what changed.

use std::collections::{HashMap, HashSet};

/// The devices each claim holds (one pool entry per device), by claim UID,
/// and their count by pool.
#[derive(Debug, Default)]
pub(super) struct Allocated {
    by_claim: HashMap<String, Vec<String>>,
    by_pool: HashMap<String, usize>,
    /// During a relist: the claims it has shown so far.
    relisted: Option<HashSet<String>>,
}

impl Allocated {
    /// `claim` now holds devices of `pools` (empty: none, or it is gone);
    /// gives the pools whose count changed.
    pub(super) fn claim(&mut self, claim: String, pools: Vec<String>) -> Vec<String> {
        if let Some(seen) = &mut self.relisted {
            seen.insert(claim.clone());
        }
        self.set(claim, pools)
    }

    pub(super) fn relist_started(&mut self) {
        self.relisted = Some(HashSet::new());
    }

    /// The relist is over: the claims it did not show are gone. Gives the
    /// pools whose count changed.
    pub(super) fn relist_done(&mut self) -> Vec<String> {
        let Some(seen) = self.relisted.take() else {
            return Vec::new();
        };
        let gone: Vec<String> = self
            .by_claim
            .keys()
            .filter(|uid| !seen.contains(*uid))
            .cloned()
            .collect();
        let mut touched: Vec<String> = gone
            .into_iter()
            .flat_map(|uid| self.set(uid, Vec::new()))
            .collect();
        touched.sort();
        touched.dedup();
        touched
    }

    /// Devices of `pool` allocated now.
    pub(super) fn count(&self, pool: &str) -> usize {
        self.by_pool.get(pool).copied().unwrap_or(0)
    }

    fn set(&mut self, claim: String, pools: Vec<String>) -> Vec<String> {
        let before = if pools.is_empty() {
            self.by_claim.remove(&claim)
        } else {
            self.by_claim.insert(claim, pools.clone())
        }
        .unwrap_or_default();
        if before == pools {
            return Vec::new();
        }
        for p in &before {
            if let Some(n) = self.by_pool.get_mut(p) {
                *n = n.saturating_sub(1);
            }
        }
        for p in &pools {
            *self.by_pool.entry(p.clone()).or_default() += 1;
        }
        let mut touched: Vec<String> = before.into_iter().chain(pools).collect();
        touched.sort();
        touched.dedup();
        touched
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pools(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| (*s).to_owned()).collect()
    }

    #[test]
    fn allocations_are_counted_by_pool_as_claims_change_and_go() {
        let mut a = Allocated::default();
        assert_eq!(a.claim("c1".into(), pools(&["p1", "p1"])), pools(&["p1"]));
        assert_eq!(
            a.claim("c2".into(), pools(&["p1", "p2"])),
            pools(&["p1", "p2"])
        );
        assert_eq!((a.count("p1"), a.count("p2")), (3, 1));
        // The same allocation seen again changes nothing.
        assert!(a.claim("c2".into(), pools(&["p1", "p2"])).is_empty());
        // Deallocated, then deleted.
        assert_eq!(a.claim("c1".into(), Vec::new()), pools(&["p1"]));
        assert_eq!(a.claim("c2".into(), Vec::new()), pools(&["p1", "p2"]));
        assert_eq!((a.count("p1"), a.count("p2")), (0, 0));
    }

    #[test]
    fn a_relist_drops_the_claims_it_did_not_show() {
        let mut a = Allocated::default();
        a.claim("kept".into(), pools(&["p1"]));
        a.claim("deleted-unseen".into(), pools(&["p1", "p2"]));
        a.relist_started();
        assert!(a.claim("kept".into(), pools(&["p1"])).is_empty());
        assert_eq!(a.relist_done(), pools(&["p1", "p2"]));
        assert_eq!((a.count("p1"), a.count("p2")), (1, 0));
        assert!(a.relist_done().is_empty(), "no relist under way");
    }
}
