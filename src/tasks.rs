//! The daemon's long-lived tasks (pod controllers and their workers, node
//! agents, kubelet APIs). Each is critical: one that ends while the others
//! still run (it returned, failed or panicked) stops them all and is
//! reported by name, and the daemon exits non-zero for its supervisor to
//! restart. A Node must never stay Ready behind a controller that is gone.

use std::collections::HashMap;
use std::future::Future;

use tokio::task::{Id, JoinError, JoinHandle, JoinSet};
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, error, warn};

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

#[derive(Debug, thiserror::Error)]
pub enum TaskError {
    #[error("task {task} panicked: {message}")]
    Panicked { task: String, message: String },
    #[error("task {task} ended while the daemon was running")]
    Ended { task: String },
    #[error("task {task} failed: {source}")]
    Failed {
        task: String,
        #[source]
        source: BoxError,
    },
}

struct Outcome {
    /// It ended before `stop` was cancelled: nobody asked it to.
    early: bool,
    result: Result<(), BoxError>,
}

/// A set of critical tasks that stop together on `stop`.
#[derive(Debug)]
pub struct Critical {
    set: JoinSet<Outcome>,
    names: HashMap<Id, String>,
    stop: CancellationToken,
}

impl std::fmt::Debug for Outcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Outcome")
            .field("early", &self.early)
            .finish_non_exhaustive()
    }
}

impl Critical {
    /// Tasks that stop on `stop`, and cancel it when one of them ends.
    pub fn new(stop: CancellationToken) -> Self {
        Self {
            set: JoinSet::new(),
            names: HashMap::new(),
            stop,
        }
    }

    pub fn spawn<F, E>(&mut self, name: impl Into<String>, task: F)
    where
        F: Future<Output = Result<(), E>> + Send + 'static,
        E: Into<BoxError>,
    {
        let stop = self.stop.clone();
        let handle = self.set.spawn(
            async move {
                // However it ends (returns, fails or unwinds), the rest stop too.
                let _stop_all = stop.clone().drop_guard();
                let result = task.await.map_err(Into::into);
                Outcome {
                    early: !stop.is_cancelled(),
                    result,
                }
            }
            .in_current_span(),
        );
        self.names.insert(handle.id(), name.into());
    }

    /// Supervises a task spawned elsewhere, such as a server's accept loop.
    pub fn adopt(&mut self, name: impl Into<String>, handle: JoinHandle<()>) {
        self.spawn(name, async move {
            handle
                .await
                .map_err(|e| BoxError::from(format!("panicked: {}", panic_message(e))))
        });
    }

    /// Waits for every task; the first failure, if any, is the answer: a
    /// task that panicked, failed, or ended before `stop` was cancelled.
    pub async fn join(mut self) -> Result<(), TaskError> {
        let mut first = None;
        while let Some(joined) = self.set.join_next_with_id().await {
            let id = match &joined {
                Ok((id, _)) => *id,
                Err(e) => e.id(),
            };
            let task = self.names.remove(&id).unwrap_or_else(|| format!("{id}"));
            let failure = match joined.map(|(_, outcome)| outcome) {
                Ok(Outcome {
                    result: Err(source),
                    early: true,
                }) => Some(TaskError::Failed { task, source }),
                // An error while everything stops (a lease that could not be
                // released, a cut connection) is no reason to exit non-zero.
                Ok(Outcome {
                    result: Err(source),
                    early: false,
                }) => {
                    warn!(task, error = %source, "a task failed while stopping");
                    None
                }
                Ok(Outcome { early: true, .. }) => Some(TaskError::Ended { task }),
                Ok(_) => None,
                Err(e) if e.is_panic() => Some(TaskError::Panicked {
                    task,
                    message: panic_message(e),
                }),
                // Aborted: only when the set itself is dropped.
                Err(_) => None,
            };
            if let Some(f) = failure {
                self.stop.cancel();
                error!(error = %f, "a critical task stopped; stopping the rest");
                first.get_or_insert(f);
            }
        }
        first.map_or(Ok(()), Err)
    }
}

fn panic_message(e: JoinError) -> String {
    if !e.is_panic() {
        return e.to_string();
    }
    let payload = e.into_panic();
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a non-string panic".into())
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    async fn until_stopped(stop: CancellationToken) -> Result<(), std::io::Error> {
        stop.cancelled().await;
        Ok(())
    }

    #[tokio::test]
    async fn a_panicking_task_stops_the_rest_and_is_named() {
        let stop = CancellationToken::new();
        let mut tasks = Critical::new(stop.clone());
        tasks.spawn("node agent vk", until_stopped(stop.clone()));
        tasks.spawn("pod worker 3", async {
            tokio::task::yield_now().await;
            if true {
                panic!("index out of bounds");
            }
            Ok::<(), std::io::Error>(())
        });
        let joined = tokio::time::timeout(Duration::from_secs(2), tasks.join()).await;
        let err = joined.expect("the other tasks were stopped").unwrap_err();
        assert!(stop.is_cancelled());
        assert_eq!(
            err.to_string(),
            "task pod worker 3 panicked: index out of bounds"
        );
    }

    #[tokio::test]
    async fn a_task_that_returns_early_is_a_failure() {
        let stop = CancellationToken::new();
        let mut tasks = Critical::new(stop.clone());
        tasks.spawn("pod watch vk", until_stopped(stop.clone()));
        tasks.adopt("kubelet API vk", tokio::spawn(async {}));
        let err = tokio::time::timeout(Duration::from_secs(2), tasks.join())
            .await
            .expect("stopped")
            .unwrap_err();
        assert!(matches!(&err, TaskError::Ended { task } if task == "kubelet API vk"));
    }

    #[tokio::test]
    async fn ending_on_stop_is_no_failure() {
        let stop = CancellationToken::new();
        let mut tasks = Critical::new(stop.clone());
        tasks.spawn("a", until_stopped(stop.clone()));
        tasks.spawn("b", until_stopped(stop.clone()));
        stop.cancel();
        assert!(tasks.join().await.is_ok());
    }

    /// A task that reports an error because everything is stopping (its lease
    /// task cut off, say) does not make a clean shutdown exit non-zero.
    #[tokio::test]
    async fn an_error_while_stopping_is_no_failure() {
        let stop = CancellationToken::new();
        let mut tasks = Critical::new(stop.clone());
        let s = stop.clone();
        tasks.spawn("node agent", async move {
            s.cancelled().await;
            Err::<(), BoxError>("the lease task ended".into())
        });
        stop.cancel();
        assert!(tasks.join().await.is_ok());
    }
}
