//! Stdin for `kubectl attach -i`. A container with `stdin: true` gets a pipe
//! the shim holds, fed from a Unix socket per container
//! ([`Sandbox::attach_socket`](crate::sandbox::Sandbox::attach_socket)) that the
//! provider connects to. The shim owns both, so an attach works the same after
//! vkd restarts. Each run of the container gets a new pipe; with `stdinOnce`
//! the pipe closes when the first session ends, as the kubelet's runtimes do.

use std::os::unix::fs::PermissionsExt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::AsyncWriteExt;
use tokio::process::ChildStdin;

use super::{Shim, lock};

/// The pipe to one run's stdin; a session holds its lock while it writes, so
/// two clients never interleave.
type Pipe = Arc<tokio::sync::Mutex<ChildStdin>>;

/// Per launch (init containers, then containers): the current run's pipe.
pub(super) type Slots = Vec<Mutex<Option<Pipe>>>;

impl Shim {
    /// The launch index of container `i` (an init container with `init`).
    pub(super) fn launch_index(&self, i: usize, init: bool) -> usize {
        if init {
            i
        } else {
            self.spec.spec.init_containers.len() + i
        }
    }

    /// Keeps `stdin` as launch `index`'s pipe; the previous run's closes once
    /// no session holds it.
    pub(super) fn set_stdin(&self, index: usize, stdin: Option<ChildStdin>) {
        if let Some(slot) = self.stdin.get(index) {
            *lock(slot) = stdin.map(|s| Arc::new(tokio::sync::Mutex::new(s)));
        }
    }

    /// Listens on the socket of every container with `stdin: true`.
    pub(super) fn listen_stdin(self: &Arc<Self>) -> Vec<tokio::task::JoinHandle<()>> {
        let specs = self
            .spec
            .spec
            .init_containers
            .iter()
            .chain(&self.spec.spec.containers);
        let wanted: Vec<(usize, bool)> = specs
            .enumerate()
            .filter(|(_, c)| c.stdin)
            .map(|(i, c)| (i, c.stdin_once))
            .collect();
        if wanted.is_empty() {
            return Vec::new();
        }
        // Only root (vkd) may feed a Pod's stdin: the sockets live in a 0700 directory.
        let dir = self.sandbox.attach_dir();
        let made = std::fs::create_dir_all(&dir)
            .and_then(|()| std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)));
        if let Err(e) = made {
            self.note(&format!("no attach: {}: {e}", dir.display()));
            return Vec::new();
        }
        let mut tasks = Vec::new();
        for (index, once) in wanted {
            let path = self.sandbox.attach_socket(index);
            let _ = std::fs::remove_file(&path);
            match tokio::net::UnixListener::bind(&path) {
                Ok(listener) => {
                    let this = Arc::clone(self);
                    tasks.push(tokio::spawn(this.serve_stdin(index, once, listener)));
                }
                Err(e) => self.note(&format!("no attach: {}: {e}", path.display())),
            }
        }
        tasks
    }

    async fn serve_stdin(
        self: Arc<Self>,
        index: usize,
        once: bool,
        listener: tokio::net::UnixListener,
    ) {
        loop {
            let mut conn = match listener.accept().await {
                Ok((c, _)) => c,
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            let this = Arc::clone(&self);
            tokio::spawn(async move {
                // Not running (or stdinOnce already used): the connection closes.
                let Some(pipe) = this.stdin.get(index).and_then(|s| lock(s).clone()) else {
                    return;
                };
                {
                    let mut w = pipe.lock().await;
                    let _ = tokio::io::copy(&mut conn, &mut *w).await;
                    let _ = w.flush().await;
                }
                if once && let Some(slot) = this.stdin.get(index) {
                    let mut slot = lock(slot);
                    if slot.as_ref().is_some_and(|p| Arc::ptr_eq(p, &pipe)) {
                        // The last reference goes with `pipe`: the program reads EOF.
                        *slot = None;
                    }
                }
            });
        }
    }
}
