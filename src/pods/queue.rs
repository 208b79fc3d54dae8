//! The reconcile queue: per-key dedupe, one worker per key at a time, delayed
//! requeues and capped exponential backoff.
//!
//! A key added while queued is not queued twice; a key added while a worker holds
//! it is marked dirty and queued again when that worker finishes, so no change is
//! lost and no key is reconciled by two workers at once.
//!
//! Keys added with [`WorkQueue::add_first`] (Pods waiting for their instance)
//! have workers of their own ([`WorkQueue::next_in`]), so a new Pod never waits
//! behind status writes that a busy API server is slow to accept.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

#[derive(Debug, Default)]
struct Inner {
    ready: VecDeque<String>,
    /// Served before `ready`. A key may sit in both; `queued` says whether it
    /// is still waiting, so the second copy is skipped.
    urgent: VecDeque<String>,
    queued: HashSet<String>,
    active: HashSet<String>,
    dirty: HashSet<String>,
    /// The earliest pending delayed add per key.
    delayed: HashMap<String, Instant>,
    failures: HashMap<String, u32>,
}

#[derive(Debug)]
pub struct WorkQueue {
    inner: Mutex<Inner>,
    notify: Notify,
    /// Wakes the workers that take only keys added first.
    notify_first: Notify,
    base: Duration,
    cap: Duration,
}

impl WorkQueue {
    /// `base` is the first retry delay after a failure; it doubles up to `cap`.
    pub fn new(base: Duration, cap: Duration) -> Arc<Self> {
        Arc::new(Self {
            inner: Mutex::default(),
            notify: Notify::new(),
            notify_first: Notify::new(),
            base,
            cap,
        })
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Keys waiting to be worked on now.
    pub fn len(&self) -> usize {
        self.lock().queued.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn add(&self, key: &str) {
        let mut q = self.lock();
        if q.active.contains(key) {
            q.dirty.insert(key.to_owned());
            return;
        }
        if q.queued.insert(key.to_owned()) {
            q.ready.push_back(key.to_owned());
            drop(q);
            self.notify.notify_one();
        }
    }

    /// Adds `key` for the create workers ([`WorkQueue::next_in`]); one that is
    /// already waiting becomes theirs too.
    pub fn add_first(&self, key: &str) {
        let mut q = self.lock();
        if q.active.contains(key) {
            q.dirty.insert(key.to_owned());
            return;
        }
        q.queued.insert(key.to_owned());
        q.urgent.push_back(key.to_owned());
        drop(q);
        self.notify_first.notify_one();
        self.notify.notify_one();
    }

    /// Adds `key` after `delay`, unless an earlier delayed add is already pending.
    pub fn add_after(self: &Arc<Self>, key: &str, delay: Duration) {
        if delay.is_zero() {
            return self.add(key);
        }
        let at = Instant::now() + delay;
        {
            let mut q = self.lock();
            match q.delayed.get(key) {
                Some(existing) if *existing <= at => return,
                _ => {
                    q.delayed.insert(key.to_owned(), at);
                }
            }
        }
        let this = Arc::clone(self);
        let key = key.to_owned();
        tokio::spawn(async move {
            tokio::time::sleep_until(at).await;
            let current = {
                let mut q = this.lock();
                let due = q.delayed.get(&key) == Some(&at);
                if due {
                    q.delayed.remove(&key);
                    vkd_provider::release_spare(&mut q.delayed);
                }
                due
            };
            if current {
                this.add(&key);
            }
        });
    }

    /// Requeues `key` after its next backoff delay; returns that delay.
    pub fn retry(self: &Arc<Self>, key: &str) -> Duration {
        let delay = {
            let mut q = self.lock();
            let n = q.failures.entry(key.to_owned()).or_insert(0);
            let d = self
                .base
                .checked_mul(1u32 << (*n).min(20))
                .map_or(self.cap, |d| d.min(self.cap));
            *n = n.saturating_add(1);
            d
        };
        self.add_after(key, delay);
        delay
    }

    /// Clears the failure count of `key` (after a success).
    pub fn forget(&self, key: &str) {
        let mut q = self.lock();
        if q.failures.remove(key).is_some() {
            vkd_provider::release_spare(&mut q.failures);
        }
    }

    /// Waits for the next key, those added first only when no other waits,
    /// and marks it active.
    pub async fn next(&self) -> String {
        self.next_in(false).await
    }

    /// Waits for the next key (only one added with [`WorkQueue::add_first`]
    /// when `first_only`) and marks it active.
    pub async fn next_in(&self, first_only: bool) -> String {
        let notify = if first_only {
            &self.notify_first
        } else {
            &self.notify
        };
        loop {
            let notified = notify.notified();
            {
                let mut q = self.lock();
                loop {
                    // Create workers take only first keys; the others take the
                    // rest in order and first keys when nothing else waits, so
                    // status writes are not starved by a burst of new Pods.
                    let key = if first_only {
                        q.urgent.pop_front()
                    } else {
                        q.ready.pop_front().or_else(|| q.urgent.pop_front())
                    };
                    let Some(key) = key else { break };
                    if !q.queued.remove(&key) {
                        continue; // its other copy was handed out already
                    }
                    // A burst of 10,000 Pods would otherwise keep its room here.
                    let inner = &mut *q;
                    vkd_provider::release_spare(&mut inner.queued);
                    vkd_provider::release_spare(&mut inner.ready);
                    vkd_provider::release_spare(&mut inner.urgent);
                    q.active.insert(key.clone());
                    let more = !q.queued.is_empty();
                    let more_first = !q.urgent.is_empty();
                    drop(q);
                    if more {
                        self.notify.notify_one();
                    }
                    if more_first {
                        self.notify_first.notify_one();
                    }
                    return key;
                }
            }
            notified.await;
        }
    }

    /// The worker is finished with `key`; requeues it if it changed meanwhile.
    pub fn done(&self, key: &str) {
        let requeue = {
            let mut q = self.lock();
            q.active.remove(key);
            q.dirty.remove(key)
        };
        if requeue {
            self.add(key);
        }
    }

    /// Keys waiting to be worked on now.
    pub fn depth(&self) -> usize {
        self.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn dedupes_queued_keys() {
        let q = WorkQueue::new(Duration::from_millis(10), Duration::from_secs(1));
        q.add("a");
        q.add("a");
        q.add("b");
        assert_eq!(q.depth(), 2);
        assert_eq!(q.next().await, "a");
        assert_eq!(q.next().await, "b");
        assert_eq!(q.depth(), 0);
    }

    #[tokio::test]
    async fn a_key_is_never_worked_twice_at_once() {
        let q = WorkQueue::new(Duration::from_millis(10), Duration::from_secs(1));
        q.add("a");
        let key = q.next().await;
        q.add("a"); // changed while active: not handed out yet
        assert_eq!(q.depth(), 0);
        q.done(&key);
        assert_eq!(q.depth(), 1, "the change made while active is not lost");
        assert_eq!(q.next().await, "a");
        q.done("a");
        assert_eq!(q.depth(), 0);
    }

    #[tokio::test]
    async fn first_keys_are_handed_out_once() {
        let q = WorkQueue::new(Duration::from_millis(10), Duration::from_secs(1));
        q.add("status-a");
        q.add("status-b");
        q.add_first("new-pod");
        q.add_first("status-b"); // already waiting: a create worker may take it, once
        assert_eq!(q.depth(), 3);
        assert_eq!(q.next_in(true).await, "new-pod");
        assert_eq!(q.next_in(true).await, "status-b");
        assert_eq!(q.next().await, "status-a");
        assert_eq!(q.depth(), 0);
        q.add("status-a"); // active: marked dirty, not handed out twice
        q.add_first("status-a");
        assert_eq!(q.depth(), 0);
        q.done("status-a");
        assert_eq!(q.next().await, "status-a");
        q.done("status-a");
        q.done("status-b");
        q.done("new-pod");
        assert_eq!(
            q.depth(),
            0,
            "the skipped copy of status-b is not handed out"
        );
    }

    #[tokio::test]
    async fn create_workers_take_only_first_keys() {
        let q = WorkQueue::new(Duration::from_millis(10), Duration::from_secs(1));
        q.add("status");
        let q2 = Arc::clone(&q);
        let create_worker = tokio::spawn(async move { q2.next_in(true).await });
        tokio::task::yield_now().await;
        assert!(
            !create_worker.is_finished(),
            "a plain key is not for a create worker"
        );
        q.add_first("new-pod");
        let got = tokio::time::timeout(Duration::from_secs(1), create_worker)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(got, "new-pod");
        assert_eq!(q.next().await, "status");
        q.add_first("another-pod");
        q.add("status-2");
        assert_eq!(
            q.next().await,
            "status-2",
            "other workers serve plain keys first"
        );
        assert_eq!(q.next().await, "another-pod", "and first keys when idle");
    }

    #[tokio::test]
    async fn a_drained_burst_gives_its_room_back() {
        let q = WorkQueue::new(Duration::from_millis(10), Duration::from_secs(1));
        for i in 0..10_000 {
            q.add(&format!("pod-{i}"));
        }
        assert!(q.lock().queued.capacity() >= 10_000);
        for _ in 0..10_000 {
            let key = q.next().await;
            q.done(&key);
        }
        let inner = q.lock();
        assert!(
            inner.queued.capacity() <= 1024,
            "{}",
            inner.queued.capacity()
        );
        assert!(inner.ready.capacity() <= 1024, "{}", inner.ready.capacity());
    }

    #[tokio::test(start_paused = true)]
    async fn backoff_doubles_and_is_capped() {
        let q = WorkQueue::new(Duration::from_millis(100), Duration::from_millis(500));
        let delays: Vec<_> = (0..5).map(|_| q.retry("a")).collect();
        assert_eq!(delays, [100, 200, 400, 500, 500].map(Duration::from_millis));
        q.forget("a");
        assert_eq!(q.retry("a"), Duration::from_millis(100));
    }

    #[tokio::test(start_paused = true)]
    async fn delayed_adds_arrive_once() {
        let q = WorkQueue::new(Duration::from_millis(100), Duration::from_secs(1));
        q.add_after("a", Duration::from_millis(300));
        q.add_after("a", Duration::from_millis(100));
        tokio::time::sleep(Duration::from_millis(150)).await;
        assert_eq!(q.depth(), 1);
        assert_eq!(q.next().await, "a");
        q.done("a");
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert_eq!(q.depth(), 0, "the superseded later add does not fire");
    }

    #[tokio::test]
    async fn waiting_workers_wake() {
        let q = WorkQueue::new(Duration::from_millis(10), Duration::from_secs(1));
        let q2 = Arc::clone(&q);
        let worker = tokio::spawn(async move { q2.next().await });
        tokio::task::yield_now().await;
        q.add("late");
        let got = tokio::time::timeout(Duration::from_secs(1), worker)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(got, "late");
    }
}
