//! The kubelet's `--streaming-connection-idle-timeout`: an upgraded stream
//! (exec, attach, port-forward) that moves no byte either way for this long
//! is closed, so a forgotten `kubectl exec` does not hold a connection slot
//! and a process's stdio for ever. The connection's stream keeps a [`Clock`]
//! its reads and writes wind; [`close_when_idle`] watches it once the
//! connection is upgraded, and stops it at the term's end too.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::task::Context;
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};

/// `--streaming-connection-idle-timeout` when unset: the kubelet's.
pub const DEFAULT_STREAM_IDLE_TIMEOUT: Duration = Duration::from_secs(4 * 3600);

#[derive(Debug)]
struct Shared {
    base: Instant,
    /// Milliseconds from `base` to the last byte read or written.
    last_ms: AtomicU64,
    /// Cancelled to close the stream: its next read or write fails.
    stop: CancellationToken,
}

impl Shared {
    fn idle(&self) -> Duration {
        let last = Duration::from_millis(self.last_ms.load(Ordering::Relaxed));
        self.base.elapsed().saturating_sub(last)
    }
}

/// Held by the connection's stream: what moved when, and whether it must stop.
pub(crate) struct Clock {
    shared: Arc<Shared>,
    stopped: Pin<Box<WaitForCancellationFutureOwned>>,
    /// Cancelled when the stream is dropped, so its watcher ends with it.
    gone: CancellationToken,
}

impl std::fmt::Debug for Clock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Clock")
            .field("idle", &self.shared.idle())
            .finish_non_exhaustive()
    }
}

impl Drop for Clock {
    fn drop(&mut self) {
        self.gone.cancel();
    }
}

/// What [`close_when_idle`] watches a [`Clock`] through.
#[derive(Debug)]
pub(crate) struct Watch {
    shared: Weak<Shared>,
    gone: CancellationToken,
}

impl Clock {
    pub(crate) fn new() -> Self {
        let stop = CancellationToken::new();
        Self {
            stopped: Box::pin(stop.clone().cancelled_owned()),
            shared: Arc::new(Shared {
                base: Instant::now(),
                last_ms: AtomicU64::new(0),
                stop,
            }),
            gone: CancellationToken::new(),
        }
    }

    pub(crate) fn watch(&self) -> Watch {
        Watch {
            shared: Arc::downgrade(&self.shared),
            gone: self.gone.clone(),
        }
    }

    /// An error once the stream was stopped; polled before every read and
    /// write, so a stream waiting on either wakes when it is.
    pub(crate) fn poll_stopped(&mut self, cx: &mut Context<'_>) -> Option<io::Error> {
        self.stopped.as_mut().poll(cx).is_ready().then(|| {
            io::Error::new(
                io::ErrorKind::TimedOut,
                "stream closed: idle past --streaming-connection-idle-timeout",
            )
        })
    }

    /// Bytes moved now.
    pub(crate) fn wind(&self) {
        let ms = u64::try_from(self.shared.base.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.shared.last_ms.store(ms, Ordering::Relaxed);
    }
}

/// Closes the stream when nothing moved for `timeout`, or at `shutdown`;
/// returns when it is closed or dropped.
pub(crate) async fn close_when_idle(watch: Watch, timeout: Duration, shutdown: CancellationToken) {
    loop {
        let Some(shared) = watch.shared.upgrade() else {
            return;
        };
        let idle = shared.idle();
        if idle >= timeout {
            shared.stop.cancel();
            return;
        }
        drop(shared);
        tokio::select! {
            () = tokio::time::sleep(timeout - idle) => {}
            () = watch.gone.cancelled() => return,
            () = shutdown.cancelled() => {
                if let Some(shared) = watch.shared.upgrade() {
                    shared.stop.cancel();
                }
                return;
            }
        }
    }
}
