//! Sidecars (restartable init containers): when they start the next
//! container, and the order the kubelet stops them in.

use vkd_provider::ContainerState;

use super::{Shim, lock};
use crate::sandbox::ContainerRun;

impl Shim {
    pub(super) fn stopping(&self) -> bool {
        *self.stop.borrow()
    }

    /// Whether init container `i` (or container `i`) is a sidecar.
    pub(super) fn sidecar(&self, i: usize, init: bool) -> bool {
        init && self.spec.spec.init_containers[i].restart_always
    }

    /// Whether a container must stop: the Pod stops, or for a sidecar, the shim stops the sidecars.
    pub(super) fn stopping_for(&self, sidecar: bool) -> bool {
        self.stopping() || (sidecar && *self.sidecars_stop.borrow())
    }

    /// Resolves once [`Self::stopping_for`] holds.
    pub(super) async fn stop_wanted(&self, sidecar: bool) {
        let mut stop = self.stop.clone();
        let mut sidecars = self.sidecars_stop.clone();
        tokio::select! {
            _ = stop.wait_for(|s| *s) => {}
            _ = sidecars.wait_for(|s| *s), if sidecar => {}
        }
    }

    /// Waits until init container `i` (a sidecar) has started: true, or false
    /// when the Pod stops first.
    pub(super) async fn wait_started(&self, i: usize) -> bool {
        let mut changed = self.changed.subscribe();
        loop {
            if self.stopping() {
                return false;
            }
            if lock(&self.status)
                .init
                .get(i)
                .is_some_and(|c| c.status.has_started())
            {
                return true;
            }
            tokio::select! {
                r = changed.changed() => if r.is_err() { return false; },
                () = self.stop_wanted(false) => {}
            }
        }
    }

    /// Whether sidecar `i` may be signalled, as the kubelet orders termination:
    /// after every container, and after every sidecar that started after it.
    pub(super) fn sidecar_turn(&self, i: usize) -> bool {
        let st = lock(&self.status);
        let running = |c: &ContainerRun| matches!(c.status.state, ContainerState::Running { .. });
        !st.containers.iter().any(running)
            && !st
                .init
                .iter()
                .enumerate()
                .skip(i + 1)
                .any(|(j, c)| self.sidecar(j, true) && running(c))
    }

    /// Stops the sidecars the Pod started (`tasks`) and waits for them.
    pub(super) async fn stop_sidecars(&self, tasks: Vec<tokio::task::JoinHandle<bool>>) {
        let _ = self.sidecars_stop_tx.send(true);
        for t in tasks {
            let _ = t.await;
        }
    }
}
