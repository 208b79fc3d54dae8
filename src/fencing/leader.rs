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

use std::time::Duration;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::api::PostParams;
use kube::{Api, Client};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

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

/// Why holding the lease ended.
#[derive(Debug, PartialEq, Eq)]
pub enum Held {
    Shutdown,
    /// Another replica holds it now.
    Taken(String),
    /// It could not be renewed in time: the API server is out of reach.
    Unrenewed(String),
}

#[derive(Debug)]
pub struct LeaderElector {
    api: Api<Lease>,
    s: LeaderSettings,
}

fn now() -> MicroTime {
    MicroTime(jiff::Timestamp::now())
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

    /// Waits until this replica holds the lease; returns the epoch it took.
    pub async fn acquire(&self, shutdown: &CancellationToken) -> Result<u64, LeaderError> {
        // (holder, renewTime) as last seen, and when we first saw it.
        let mut seen: Option<(Option<String>, Option<MicroTime>, Instant)> = None;
        let mut waiting_logged = false;
        loop {
            match self.try_acquire(&mut seen).await {
                Ok(Some(epoch)) => {
                    info!(lease = %self.s.name, identity = %self.s.identity, epoch, "leader lease acquired");
                    return Ok(epoch);
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
    ) -> Result<Option<u64>, kube::Error> {
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
                Ok(_) => Ok(Some(epoch)),
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
            Ok(_) => Ok(Some(epoch)),
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

    /// Renews until shutdown, or until the lease is lost: taken by another
    /// replica, or not renewed for `renew_deadline`.
    pub async fn hold(&self, epoch: u64, shutdown: &CancellationToken) -> Held {
        let mut last_ok = Instant::now();
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return Held::Shutdown,
                () = tokio::time::sleep(self.s.retry_period) => {}
            }
            let attempt = tokio::time::timeout(
                self.s.renew_deadline.saturating_sub(last_ok.elapsed()),
                self.renew(epoch),
            )
            .await;
            match attempt {
                Ok(Ok(())) => last_ok = Instant::now(),
                Ok(Err(Renew::Taken(by))) => return Held::Taken(format!("taken by {by:?}")),
                Ok(Err(Renew::Failed(e))) => warn!(error = %e, "renewing the leader lease failed"),
                Err(_) => {}
            }
            if last_ok.elapsed() >= self.s.renew_deadline {
                return Held::Unrenewed(format!(
                    "leader lease not renewed for {}s (renew deadline)",
                    self.s.renew_deadline.as_secs()
                ));
            }
        }
    }

    async fn renew(&self, epoch: u64) -> Result<(), Renew> {
        let mut lease = self
            .api
            .get(&self.s.name)
            .await
            .map_err(|e| Renew::Failed(e.to_string()))?;
        let ours = epoch_of(&lease) == Some(epoch);
        let spec = lease.spec.get_or_insert_with(Default::default);
        let holder = spec.holder_identity.clone().unwrap_or_default();
        if holder != self.s.identity || !ours {
            return Err(Renew::Taken(holder));
        }
        spec.renew_time = Some(now());
        self.api
            .replace(&self.s.name, &PostParams::default(), &lease)
            .await
            .map(drop)
            .map_err(|e| Renew::Failed(e.to_string()))
    }

    /// Gives the lease up on a clean shutdown, so a standby takes over at once.
    pub async fn release(&self, epoch: u64) {
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
