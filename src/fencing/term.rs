//! A leadership term: the one place that says what this replica acts under
//! (its epoch), what stops its work (one token), and why the term ended.
//!
//! Whoever ends a term records why before the work token is cancelled, and the
//! first reason wins, so every reader sees the same one. The lease holder runs
//! under a drop guard ([`Term::spawn_holder`]): if it panics, the term ends and
//! the work stops, rather than a replica acting on with nobody renewing its lease.

use std::future::Future;
use std::sync::Arc;

use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// Why a term ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Ended {
    /// The daemon is stopping (a clean shutdown, or a task of it failed).
    Shutdown,
    /// Another replica holds the lease now, or a backend refused our epoch.
    Taken(String),
    /// The lease could not be renewed in time: the API server is out of reach.
    Unrenewed(String),
    /// The lease holder stopped without saying why: it panicked.
    Abandoned(String),
}

impl std::fmt::Display for Ended {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Shutdown => f.write_str("shutdown"),
            Self::Taken(why) | Self::Unrenewed(why) | Self::Abandoned(why) => f.write_str(why),
        }
    }
}

/// One term of leadership. Cheap to clone; every clone is the same term.
#[derive(Clone, Debug)]
pub struct Term {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    epoch: u64,
    /// Everything the term does stops on this token.
    work: CancellationToken,
    ended: watch::Sender<Option<Ended>>,
}

impl Term {
    /// A term at `epoch` whose work also stops on `shutdown`.
    pub fn new(epoch: u64, shutdown: &CancellationToken) -> Self {
        Self {
            inner: Arc::new(Inner {
                epoch,
                work: shutdown.child_token(),
                ended: watch::Sender::new(None),
            }),
        }
    }

    pub fn epoch(&self) -> u64 {
        self.inner.epoch
    }

    /// The token all of the term's work stops on.
    pub fn work(&self) -> CancellationToken {
        self.inner.work.clone()
    }

    /// Ends the term for `why` (unless it already ended: the first reason
    /// stays) and stops its work. Returns whether this call ended it.
    pub fn end(&self, why: Ended) -> bool {
        let ended = self.inner.ended.send_if_modified(|now| {
            if now.is_some() {
                return false;
            }
            *now = Some(why);
            true
        });
        self.inner.work.cancel();
        ended
    }

    /// A backend refused our epoch: a newer replica acts for the node.
    pub fn supersede(&self, why: impl Into<String>) {
        self.end(Ended::Taken(why.into()));
    }

    /// Why the term ended, once it has.
    pub fn ended(&self) -> Option<Ended> {
        self.inner.ended.borrow().clone()
    }

    /// The reason, when the term ended because its lease went unrenewed: the
    /// controllers then apply the partition policy before they stop.
    pub fn unrenewed(&self) -> Option<String> {
        match self.ended() {
            Some(Ended::Unrenewed(why)) => Some(why),
            _ => None,
        }
    }

    /// Runs the lease holder on its own task. However the holder stops (it
    /// returns why, panics, or its task is dropped), the term ends with it.
    pub fn spawn_holder<F>(&self, hold: F) -> JoinHandle<()>
    where
        F: Future<Output = Ended> + Send + 'static,
    {
        let term = self.clone();
        tokio::spawn(async move {
            let guard = HolderGuard(term);
            let why = hold.await;
            guard.0.end(why);
        })
    }
}

/// Ends the term when the holder's task unwinds or is dropped before it said why.
struct HolderGuard(Term);

impl Drop for HolderGuard {
    fn drop(&mut self) {
        let why = if std::thread::panicking() {
            "the leader lease holder panicked"
        } else {
            "the leader lease holder was stopped"
        };
        // A no-op after a normal end: the first reason stays.
        self.0.end(Ended::Abandoned(why.into()));
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[tokio::test]
    async fn a_panicking_holder_cancels_the_terms_work() {
        let shutdown = CancellationToken::new();
        let term = Term::new(7, &shutdown);
        let work = term.work();
        let holder = term.spawn_holder(async {
            tokio::task::yield_now().await;
            panic!("renewal bug");
        });
        assert!(holder.await.unwrap_err().is_panic());
        tokio::time::timeout(Duration::from_secs(1), work.cancelled())
            .await
            .expect("the term's work was cancelled");
        assert_eq!(
            term.ended(),
            Some(Ended::Abandoned("the leader lease holder panicked".into()))
        );
        assert!(
            !shutdown.is_cancelled(),
            "only the term ends, not the daemon"
        );
    }

    #[tokio::test]
    async fn the_first_reason_stays() {
        let term = Term::new(3, &CancellationToken::new());
        let holder = term.spawn_holder({
            let work = term.work();
            async move {
                work.cancelled().await;
                Ended::Shutdown
            }
        });
        term.supersede("a backend refused epoch 3");
        holder.await.unwrap();
        assert_eq!(
            term.ended(),
            Some(Ended::Taken("a backend refused epoch 3".into()))
        );
        assert_eq!(term.unrenewed(), None);
        assert!(term.work().is_cancelled());
    }

    #[tokio::test]
    async fn shutdown_stops_the_work_without_a_reason() {
        let shutdown = CancellationToken::new();
        let term = Term::new(1, &shutdown);
        shutdown.cancel();
        assert!(term.work().is_cancelled());
        assert_eq!(term.ended(), None);
        assert!(term.end(Ended::Shutdown));
        assert!(!term.end(Ended::Unrenewed("late".into())));
        assert_eq!(term.ended(), Some(Ended::Shutdown));
    }
}
