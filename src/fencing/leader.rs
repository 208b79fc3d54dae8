//! Active/passive replicas: one coordination.k8s.io Lease per virtual node set,
//! in the daemon's namespace. Only the holder acts. Taking the lease raises the
//! epoch (kept in the Lease's `vkd.io/epoch` annotation), and every backend
//! mutation carries it, so a backend refuses whatever an older holder still
//! sends.
//!
//! Timing, as client-go's leader election: a holder that has not renewed for
//! `renew_deadline` stops acting; a candidate takes the lease only after seeing
//! the same renewTime for `lease_duration` by its own clock. With
//! `renew_deadline < lease_duration` the old holder has stopped before anyone
//! else can start.
//!
//! A renewal is one strategic PATCH of `renewTime` carrying the resourceVersion
//! of our last write (as kubert's lease does): it only applies if nobody wrote
//! the lease since, so it needs no GET first and leaves no window between a
//! read and a write.

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::api::{Patch, PatchParams, PostParams};
use kube::{Api, Client};
use serde_json::json;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use super::term::{Ended, Term};

pub const EPOCH_ANNOTATION: &str = "vkd.io/epoch";

#[derive(Clone, Debug)]
pub struct LeaderSettings {
    pub namespace: String,
    pub name: String,
    pub identity: String,
    pub lease_duration: Duration,
    pub renew_deadline: Duration,
    pub retry_period: Duration,
}

#[derive(Debug, thiserror::Error)]
pub enum LeaderError {
    #[error("stopped before the leader lease {0} was acquired")]
    Cancelled(String),
}

/// One elector per daemon, shared by its terms.
#[derive(Debug)]
pub struct LeaderElector {
    api: Api<Lease>,
    s: LeaderSettings,
}

/// A term this replica leads, and the task that holds its lease.
#[derive(Debug)]
pub struct Leadership {
    pub term: Term,
    holder: Option<(Arc<LeaderElector>, JoinHandle<()>)>,
}

impl Leadership {
    /// A term with no lease (leader election off): it ends on shutdown, or
    /// when a backend refuses its epoch.
    pub fn fixed(epoch: u64, shutdown: &CancellationToken) -> Self {
        Self {
            term: Term::new(epoch, shutdown),
            holder: None,
        }
    }

    /// Ends the term (if nothing ended it yet, the daemon is stopping), waits
    /// for the holder, and on a stop hands the lease over at once. Returns why
    /// the term ended.
    pub async fn finish(self) -> Ended {
        self.term.end(Ended::Shutdown);
        if let Some((elector, holder)) = self.holder {
            if let Err(e) = holder.await {
                // The holder's guard already ended the term for it.
                error!(error = %e, epoch = self.term.epoch(), "the leader lease holder failed");
            }
            if self.term.ended() == Some(Ended::Shutdown) {
                elector.release(self.term.epoch()).await;
            }
        }
        self.term.ended().unwrap_or(Ended::Shutdown)
    }
}

fn now() -> MicroTime {
    MicroTime(jiff::Timestamp::now())
}

fn version_of(l: &Lease) -> String {
    l.metadata.resource_version.clone().unwrap_or_default()
}

fn epoch_of(l: &Lease) -> Option<u64> {
    l.metadata
        .annotations
        .as_ref()?
        .get(EPOCH_ANNOTATION)?
        .parse()
        .ok()
}

impl LeaderElector {
    pub fn new(client: Client, s: LeaderSettings) -> Self {
        Self {
            api: Api::namespaced(client, &s.namespace),
            s,
        }
    }

    pub fn settings(&self) -> &LeaderSettings {
        &self.s
    }

    /// Waits until this replica holds the lease, then holds it on its own task
    /// for the term this starts.
    pub async fn lead(
        self: &Arc<Self>,
        shutdown: &CancellationToken,
    ) -> Result<Leadership, LeaderError> {
        let (epoch, version) = self.acquire(shutdown).await?;
        let term = Term::new(epoch, shutdown);
        let holder = term.spawn_holder({
            let (this, term) = (Arc::clone(self), term.clone());
            async move { this.hold(&term, version).await }
        });
        Ok(Leadership {
            term,
            holder: Some((Arc::clone(self), holder)),
        })
    }

    /// Waits until this replica holds the lease; returns the epoch it took and
    /// the lease's resourceVersion after our write.
    async fn acquire(&self, shutdown: &CancellationToken) -> Result<(u64, String), LeaderError> {
        // (holder, renewTime) as last seen, and when we first saw it.
        let mut seen: Option<(Option<String>, Option<MicroTime>, Instant)> = None;
        let mut waiting_logged = false;
        loop {
            match self.try_acquire(&mut seen).await {
                Ok(Some((epoch, version))) => {
                    info!(lease = %self.s.name, identity = %self.s.identity, epoch, "leader lease acquired");
                    return Ok((epoch, version));
                }
                Ok(None) => {
                    if !waiting_logged {
                        let holder = seen.as_ref().and_then(|s| s.0.clone()).unwrap_or_default();
                        info!(lease = %self.s.name, %holder, "standby: another replica holds the leader lease");
                        waiting_logged = true;
                    }
                }
                Err(e) => warn!(error = %e, lease = %self.s.name, "leader lease: retrying"),
            }
            tokio::select! {
                () = shutdown.cancelled() => return Err(LeaderError::Cancelled(self.s.name.clone())),
                () = tokio::time::sleep(self.s.retry_period) => {}
            }
        }
    }

    async fn try_acquire(
        &self,
        seen: &mut Option<(Option<String>, Option<MicroTime>, Instant)>,
    ) -> Result<Option<(u64, String)>, kube::Error> {
        let me = &self.s.identity;
        let Some(mut lease) = self.api.get_opt(&self.s.name).await? else {
            // A new lease starts at the wall clock in seconds, so a lease that was
            // deleted and made again still moves the epoch forward.
            let epoch = jiff::Timestamp::now().as_second().max(1).unsigned_abs();
            let lease = Lease {
                metadata: ObjectMeta {
                    name: Some(self.s.name.clone()),
                    annotations: Some([(EPOCH_ANNOTATION.to_owned(), epoch.to_string())].into()),
                    ..Default::default()
                },
                spec: Some(self.spec(now(), 0)),
            };
            return match self.api.create(&PostParams::default(), &lease).await {
                Ok(l) => Ok(Some((epoch, version_of(&l)))),
                Err(kube::Error::Api(s)) if s.code == 409 => Ok(None),
                Err(e) => Err(e),
            };
        };
        let spec = lease.spec.clone().unwrap_or_default();
        let holder = spec.holder_identity.clone().filter(|h| !h.is_empty());
        let free = match &holder {
            None => true,
            // Our own earlier incarnation (same identity): it is gone, take over now.
            Some(h) if h == me => true,
            Some(_) => {
                let current = (holder.clone(), spec.renew_time.clone());
                match seen {
                    Some((h, r, at)) if (h.clone(), r.clone()) == current => {
                        let duration = spec
                            .lease_duration_seconds
                            .map_or(self.s.lease_duration, |d| {
                                Duration::from_secs(d.max(1).unsigned_abs().into())
                            });
                        at.elapsed() >= duration
                    }
                    _ => {
                        *seen = Some((current.0, current.1, Instant::now()));
                        false
                    }
                }
            }
        };
        if !free {
            return Ok(None);
        }
        let epoch = epoch_of(&lease).unwrap_or(0) + 1;
        lease
            .metadata
            .annotations
            .get_or_insert_with(Default::default)
            .insert(EPOCH_ANNOTATION.to_owned(), epoch.to_string());
        let transitions =
            spec.lease_transitions.unwrap_or(0) + i32::from(holder.as_ref() != Some(me));
        lease.spec = Some(self.spec(now(), transitions));
        // resourceVersion is kept: a concurrent taker makes this a 409, and we look again.
        match self
            .api
            .replace(&self.s.name, &PostParams::default(), &lease)
            .await
        {
            Ok(l) => Ok(Some((epoch, version_of(&l)))),
            Err(kube::Error::Api(s)) if s.code == 409 => Ok(None),
            Err(e) => Err(e),
        }
    }

    fn spec(&self, at: MicroTime, transitions: i32) -> LeaseSpec {
        LeaseSpec {
            holder_identity: Some(self.s.identity.clone()),
            lease_duration_seconds: Some(
                i32::try_from(self.s.lease_duration.as_secs()).unwrap_or(i32::MAX),
            ),
            acquire_time: Some(at.clone()),
            renew_time: Some(at),
            lease_transitions: Some(transitions),
            ..Default::default()
        }
    }

    /// Renews until the term's work stops, or until the lease is lost: taken by
    /// another replica, or not renewed for `renew_deadline`. `version` is the
    /// lease's resourceVersion after our last write.
    async fn hold(&self, term: &Term, mut version: String) -> Ended {
        let work = term.work();
        let mut last_ok = Instant::now();
        loop {
            tokio::select! {
                () = work.cancelled() => return Ended::Shutdown,
                () = tokio::time::sleep(self.s.retry_period) => {}
            }
            let attempt = tokio::time::timeout(
                self.s.renew_deadline.saturating_sub(last_ok.elapsed()),
                self.renew(term.epoch(), &mut version),
            )
            .await;
            match attempt {
                Ok(Ok(())) => last_ok = Instant::now(),
                Ok(Err(Renew::Taken(by))) => return Ended::Taken(format!("taken by {by:?}")),
                Ok(Err(Renew::Failed(e))) => warn!(error = %e, "renewing the leader lease failed"),
                Err(_) => {}
            }
            if last_ok.elapsed() >= self.s.renew_deadline {
                return Ended::Unrenewed(format!(
                    "leader lease not renewed for {}s (renew deadline)",
                    self.s.renew_deadline.as_secs()
                ));
            }
        }
    }

    /// One PATCH of renewTime, applied only if the lease is still at `version`.
    /// If someone else wrote it since, one GET says whether it is still ours
    /// (an annotation added by hand, or our own write whose answer was lost) or
    /// taken; if ours, the PATCH is sent once more at the new version.
    async fn renew(&self, epoch: u64, version: &mut String) -> Result<(), Renew> {
        for _ in 0..2 {
            let patch = json!({
                "metadata": { "resourceVersion": *version },
                "spec": { "renewTime": now() },
            });
            match self
                .api
                .patch(
                    &self.s.name,
                    &PatchParams::default(),
                    &Patch::Strategic(patch),
                )
                .await
            {
                Ok(lease) => {
                    *version = version_of(&lease);
                    return self.ours(&lease, epoch);
                }
                Err(kube::Error::Api(s)) if s.code == 409 => {}
                // Deleted: a standby may create it at once, so our term is over now,
                // not at the renew deadline.
                Err(kube::Error::Api(s)) if s.code == 404 => {
                    return Err(Renew::Taken("nobody (the lease was deleted)".into()));
                }
                Err(e) => return Err(Renew::Failed(e.to_string())),
            }
            let lease = self
                .api
                .get(&self.s.name)
                .await
                .map_err(|e| Renew::Failed(e.to_string()))?;
            self.ours(&lease, epoch)?;
            *version = version_of(&lease);
        }
        Err(Renew::Failed(
            "the leader lease keeps changing under its renewals".into(),
        ))
    }

    /// Whether `lease` is still held by this replica at `epoch`.
    fn ours(&self, lease: &Lease, epoch: u64) -> Result<(), Renew> {
        let holder = lease
            .spec
            .as_ref()
            .and_then(|s| s.holder_identity.clone())
            .unwrap_or_default();
        if holder == self.s.identity && epoch_of(lease) == Some(epoch) {
            Ok(())
        } else {
            Err(Renew::Taken(holder))
        }
    }

    /// Gives the lease up on a clean shutdown, so a standby takes over at once.
    async fn release(&self, epoch: u64) {
        let Ok(mut lease) = self.api.get(&self.s.name).await else {
            return;
        };
        let ours = epoch_of(&lease) == Some(epoch);
        let spec = lease.spec.get_or_insert_with(Default::default);
        if spec.holder_identity.as_deref() != Some(&self.s.identity) || !ours {
            return;
        }
        spec.holder_identity = None;
        spec.renew_time = Some(now());
        if let Err(e) = self
            .api
            .replace(&self.s.name, &PostParams::default(), &lease)
            .await
        {
            warn!(error = %e, "releasing the leader lease failed");
        } else {
            info!(lease = %self.s.name, "leader lease released");
        }
    }
}

enum Renew {
    Taken(String),
    Failed(String),
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use serde_json::Value;

    use super::*;
    use crate::testing::{Seen, fake_api, status};

    const PATH: &str = "/apis/coordination.k8s.io/v1/namespaces/ns/leases/vkd-vk";

    fn elector(client: Client) -> LeaderElector {
        LeaderElector::new(
            client,
            LeaderSettings {
                namespace: "ns".into(),
                name: "vkd-vk".into(),
                identity: "replica-a".into(),
                lease_duration: Duration::from_secs(15),
                renew_deadline: Duration::from_secs(10),
                retry_period: Duration::from_secs(2),
            },
        )
    }

    fn lease(holder: &str, epoch: u64, version: &str) -> Value {
        json!({
            "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": "vkd-vk", "resourceVersion": version,
                         "annotations": {EPOCH_ANNOTATION: epoch.to_string()}},
            "spec": {"holderIdentity": holder},
        })
    }

    fn requests(log: &crate::testing::Log) -> Vec<(String, Value)> {
        log.lock()
            .unwrap()
            .iter()
            .map(|s| {
                (
                    s.method.clone(),
                    s.body["metadata"]["resourceVersion"].clone(),
                )
            })
            .collect()
    }

    #[tokio::test]
    async fn a_renewal_is_one_patch_at_the_last_version() {
        let (client, log) = fake_api(|req: &Seen| match req.method.as_str() {
            "PATCH" if req.path == PATH => (200, lease("replica-a", 7, "6")),
            _ => status(404, "NotFound"),
        });
        let e = elector(client);
        let mut version = "5".to_owned();
        assert!(e.renew(7, &mut version).await.is_ok());
        assert_eq!(version, "6", "the next renewal carries the new version");
        assert_eq!(requests(&log), [("PATCH".to_owned(), json!("5"))]);
        let body = &log.lock().unwrap()[0].body;
        assert!(body["spec"]["renewTime"].is_string());
        assert!(body["spec"].get("holderIdentity").is_none(), "{body}");
    }

    /// A deleted Lease ends the term at once: a standby may already hold a new one.
    #[tokio::test]
    async fn a_deleted_lease_ends_the_term_at_once() {
        let (client, log) = fake_api(|_: &Seen| status(404, "NotFound"));
        let e = elector(client);
        let mut version = "5".to_owned();
        let ended = e.renew(7, &mut version).await;
        assert!(matches!(ended, Err(Renew::Taken(_))));
        assert_eq!(requests(&log).len(), 1, "no retry of a deleted lease");
    }

    #[tokio::test]
    async fn a_conflict_looks_once_and_finds_the_lease_taken() {
        let (client, log) = fake_api(|req: &Seen| match req.method.as_str() {
            "PATCH" => status(409, "Conflict"),
            "GET" if req.path == PATH => (200, lease("replica-b", 8, "9")),
            _ => status(404, "NotFound"),
        });
        let e = elector(client);
        let mut version = "5".to_owned();
        let taken = e.renew(7, &mut version).await;
        assert!(matches!(taken, Err(Renew::Taken(by)) if by == "replica-b"));
        assert_eq!(
            requests(&log),
            [
                ("PATCH".to_owned(), json!("5")),
                ("GET".to_owned(), Value::Null)
            ]
        );
    }

    #[tokio::test]
    async fn a_conflict_on_our_own_lease_renews_at_its_new_version() {
        let patches = AtomicUsize::new(0);
        let (client, log) = fake_api(move |req: &Seen| match req.method.as_str() {
            // Our last write went through but its answer was lost.
            "PATCH" if patches.fetch_add(1, Ordering::SeqCst) == 0 => status(409, "Conflict"),
            "PATCH" => (200, lease("replica-a", 7, "10")),
            "GET" => (200, lease("replica-a", 7, "9")),
            _ => status(404, "NotFound"),
        });
        let e = elector(client);
        let mut version = "5".to_owned();
        assert!(e.renew(7, &mut version).await.is_ok());
        assert_eq!(version, "10");
        assert_eq!(
            requests(&log),
            [
                ("PATCH".to_owned(), json!("5")),
                ("GET".to_owned(), Value::Null),
                ("PATCH".to_owned(), json!("9")),
            ]
        );
    }

    #[tokio::test(start_paused = true)]
    async fn losing_the_lease_ends_the_term_and_keeps_the_lease() {
        let created = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (client, log) = fake_api(move |req: &Seen| match req.method.as_str() {
            // The first look finds no lease; after ours is made, another
            // replica takes it: our renewals conflict and the lease is theirs.
            "GET" if !created.load(Ordering::SeqCst) => status(404, "NotFound"),
            "GET" => (200, lease("replica-b", u64::MAX, "3")),
            "POST" => {
                created.store(true, Ordering::SeqCst);
                let mut lease = req.body.clone();
                lease["metadata"]["resourceVersion"] = json!("1");
                (201, lease)
            }
            "PATCH" => status(409, "Conflict"),
            _ => status(404, "NotFound"),
        });
        let e = Arc::new(elector(client));
        let shutdown = CancellationToken::new();
        let leadership = e.lead(&shutdown).await.unwrap();
        let work = leadership.term.work();
        tokio::time::timeout(Duration::from_secs(60), work.cancelled())
            .await
            .expect("the term's work stopped");
        let ended = leadership.finish().await;
        assert_eq!(ended, Ended::Taken("taken by \"replica-b\"".into()));
        assert!(!shutdown.is_cancelled());
        // A lost lease is not released: it is not ours to give.
        assert!(!log.lock().unwrap().iter().any(|s| s.method == "PUT"));
    }
}
