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
//!
//! Delayed adds wait in one `DelayQueue` driven by one task (as kube-runtime's
//! scheduler and kubert's requeue channel do), not in a task per key; the task
//! ends with the queue. Retries are jittered, so the keys of one outage do not
//! all come back in the same instant.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, Weak};
use std::time::Duration;

use futures::StreamExt;
use tokio::sync::{Notify, mpsc};
use tokio::time::Instant;
use tokio_util::time::{DelayQueue, delay_queue};

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
    /// The delayed adds' timer task, started by the first of them.
    timers: OnceLock<mpsc::UnboundedSender<(String, Instant)>>,
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
            timers: OnceLock::new(),
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
        let timers = self.timers.get_or_init(|| {
            let (tx, rx) = mpsc::unbounded_channel();
            tokio::spawn(run_timers(Arc::downgrade(self), rx));
            tx
        });
        // The task ends only when the queue is gone, and then nothing is owed.
        let _ = timers.send((key.to_owned(), at));
    }

    /// A delayed add of `key` for `at` is due: added, unless an earlier one
    /// replaced it.
    fn due(&self, key: &str, at: Instant) {
        let due = {
            let mut q = self.lock();
            let due = q.delayed.get(key) == Some(&at);
            if due {
                q.delayed.remove(key);
                vkd_provider::release_spare(&mut q.delayed);
            }
            due
        };
        if due {
            self.add(key);
        }
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
            jittered(d)
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

/// `delay` less up to a tenth of it, at random: never longer than asked (the
/// cap holds), and keys that failed together spread out.
fn jittered(delay: Duration) -> Duration {
    delay.saturating_sub(delay.mul_f64(fastrand::f64() / 10.0))
}

/// The delayed adds: one timer per key, the earliest (the queue sends only an
/// add earlier than the one pending), until the queue is dropped.
async fn run_timers(queue: Weak<WorkQueue>, mut adds: mpsc::UnboundedReceiver<(String, Instant)>) {
    // The item keeps the instant asked for: the timer's own deadline is
    // rounded to its millisecond wheel, and `due` matches the instant exactly.
    let mut timers: DelayQueue<(String, Instant)> = DelayQueue::new();
    let mut pending: HashMap<String, delay_queue::Key> = HashMap::new();
    loop {
        tokio::select! {
            add = adds.recv() => {
                let Some((key, at)) = add else { return };
                if let Some(earlier) = pending.remove(&key) {
                    timers.remove(&earlier);
                }
                let timer = timers.insert_at((key.clone(), at), at);
                pending.insert(key, timer);
            }
            Some(expired) = timers.next(), if !timers.is_empty() => {
                let (key, at) = expired.into_inner();
                pending.remove(&key);
                vkd_provider::release_spare(&mut pending);
                let Some(queue) = queue.upgrade() else { return };
                queue.due(&key, at);
            }
        }
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
    async fn backoff_doubles_and_is_capped_with_jitter() {
        let q = WorkQueue::new(Duration::from_millis(100), Duration::from_millis(500));
        let delays: Vec<_> = (0..5).map(|_| q.retry("a")).collect();
        for (got, want) in delays.iter().zip([100, 200, 400, 500, 500]) {
            let want = Duration::from_millis(want);
            assert!(
                *got <= want && *got >= want.mul_f64(0.9),
                "{delays:?}: {got:?} for {want:?}"
            );
        }
        q.forget("a");
        assert!(q.retry("a") <= Duration::from_millis(100));
        // Keys that fail together come back spread out, not all at once.
        let mut firsts: Vec<_> = (0..50).map(|i| q.retry(&format!("k{i}"))).collect();
        firsts.sort();
        firsts.dedup();
        assert!(firsts.len() > 10, "{firsts:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn delayed_adds_share_one_timer_task_that_ends_with_the_queue() {
        let tasks = || {
            tokio::runtime::Handle::current()
                .metrics()
                .num_alive_tasks()
        };
        let before = tasks();
        let q = WorkQueue::new(Duration::from_millis(100), Duration::from_secs(1));
        for i in 0..1000 {
            q.add_after(&format!("k{i}"), Duration::from_secs(3600));
        }
        tokio::task::yield_now().await;
        assert_eq!(tasks(), before + 1, "one timer task for 1000 delayed keys");
        q.add_after("soon", Duration::from_millis(10));
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(
            q.next().await,
            "soon",
            "an earlier key is not held behind later ones"
        );
        drop(q);
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert_eq!(tasks(), before, "the timer task ended with the queue");
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

    /// On the real clock too: the timer wheel rounds to milliseconds, and a
    /// delayed add still arrives.
    #[tokio::test]
    async fn delayed_adds_arrive_on_the_real_clock() {
        let q = WorkQueue::new(Duration::from_millis(10), Duration::from_secs(1));
        for i in 0..20 {
            q.add_after(&format!("k{i}"), Duration::from_micros(1_500 + 37 * i));
        }
        q.add_after("k0", Duration::from_micros(700));
        let got = tokio::time::timeout(Duration::from_secs(2), async {
            let mut got = Vec::new();
            while got.len() < 20 {
                got.push(q.next().await);
            }
            got
        })
        .await;
        let mut got = got.expect("every delayed key arrives");
        got.sort();
        got.dedup();
        assert_eq!(got.len(), 20);
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
