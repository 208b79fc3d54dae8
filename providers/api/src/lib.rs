//! The contract between vkd and a backend.
//!
//! A provider runs one *instance* per Pod, keyed by the Pod UID: `create` is
//! idempotent on that key, so a retried or repeated create never starts a second
//! copy. Every mutating call carries a [`Fence`]; a backend remembers the highest
//! epoch it has seen for a node and refuses lower ones, which is what stops an old
//! daemon from acting after a new one took over. Capacity is reported as host
//! slices, admission is explicit, and optional capabilities default to
//! [`ProviderError::Unsupported`].
//!
//! Providers depend on this crate only, never on vkd itself. The [`conformance`]
//! module is a kit every provider runs in its own tests.
//!
//! Laid out as: the data exchanged (`types`), the log and stream requests
//! (`streams`), the errors (`error`), helpers any provider may use (`kit`,
//! [`duration`], [`quantity`], [`topology`], [`fence`]), and the [`Provider`]
//! trait here. Enums a provider matches on ([`VolumeSource`], [`Handler`])
//! are `#[non_exhaustive]`: a provider built against this version keeps
//! compiling when vkd learns a new kind, and refuses what it does not know.

use std::fmt;
use std::time::Duration;

use async_trait::async_trait;
use futures::stream::BoxStream;

pub mod conformance;
pub mod duration;
mod error;
pub mod fence;
mod kit;
pub mod quantity;
mod streams;
pub mod topology;
mod types;

pub use error::*;
pub use kit::*;
pub use streams::*;
pub use types::*;

/// A backend that runs Pods as instances. Object-safe: vkd holds an `Arc<dyn Provider>`.
#[async_trait]
pub trait Provider: Send + Sync + fmt::Debug {
    /// A short name, used in taints, messages and metrics ("sim", "process").
    fn name(&self) -> &str;

    fn capabilities(&self) -> Capabilities {
        Capabilities::default()
    }

    /// Which backend the Node stands for, as annotations under `vkd.io/`
    /// (a downstream cluster's name and server, for example). Fixed for the
    /// provider's life.
    fn identity(&self) -> Vec<(String, String)> {
        Vec::new()
    }

    async fn health(&self) -> Health;

    async fn capacity(&self) -> Result<Capacity>;

    /// Could the backend run this Pod? Nothing is created or reserved by this call.
    async fn admit(&self, spec: &InstanceSpec) -> Result<Admission>;

    /// Creates the instance for `spec.pod.uid`, or returns the existing one.
    async fn create(&self, fence: &Fence, spec: &InstanceSpec) -> Result<Instance>;

    /// The instance of a Pod UID, `None` when there is none (or it is fully gone).
    async fn get(&self, uid: &str) -> Result<Option<Instance>>;

    /// Stops and removes the instance, giving its containers `grace` to exit.
    /// Deleting what does not exist succeeds; a later `get` confirms it is gone.
    async fn delete(&self, fence: &Fence, uid: &str, grace: Duration) -> Result<()>;

    /// This daemon now acts for `fence.node` at `fence.epoch` (it took the
    /// leader lease): forget anything cached, another replica may have acted
    /// meanwhile. Providers that read their state fresh need not override it.
    async fn takeover(&self, _fence: &Fence) -> Result<()> {
        Ok(())
    }

    /// Removes one instance by its backend id: for a duplicate (more than one
    /// instance for a Pod UID) in backends where that can happen. Optional.
    async fn delete_instance(&self, _fence: &Fence, _id: &str, _grace: Duration) -> Result<()> {
        Err(self.unsupported("delete-instance"))
    }

    /// Every instance the backend holds for `node`.
    async fn list(&self, node: &str) -> Result<Vec<Instance>>;

    /// Change notifications. Each call returns a new subscription.
    fn events(&self) -> BoxStream<'static, InstanceEvent>;

    /// A container's log. Optional.
    async fn logs(&self, _uid: &str, _container: &str, _request: LogRequest) -> Result<Logs> {
        Err(self.unsupported("logs"))
    }

    /// Runs `command` in a container; resolves to its exit code. Optional.
    async fn exec(
        &self,
        _uid: &str,
        _container: &str,
        _command: Vec<String>,
        _io: StreamIo,
    ) -> Result<i32> {
        Err(self.unsupported("exec"))
    }

    /// Attaches to a container's main process until it ends or the client leaves. Optional.
    async fn attach(&self, _uid: &str, _container: &str, _io: StreamIo) -> Result<()> {
        Err(self.unsupported("attach"))
    }

    /// Carries one port-forward connection to `port` of the Pod. Optional.
    async fn port_forward(&self, _uid: &str, _port: u16, _stream: Box<dyn Duplex>) -> Result<()> {
        Err(self.unsupported("port-forward"))
    }

    /// Starts an ephemeral container (`kubectl debug`, the Pod's
    /// `spec.ephemeralContainers`) in the running instance of `uid`, where
    /// the Pod's other containers run. It is started once and never
    /// restarted: it runs until it exits or the instance ends, and its state
    /// is reported in [`Instance::ephemeral_containers`] under its name.
    /// Idempotent on the name: a container the instance already has is not
    /// started again (`Ok`). `container` is resolved like any other (env,
    /// mounts of the Pod's volumes); it has no probes, hooks, ports or
    /// resources. Optional (capability `ephemeral_containers`).
    async fn start_ephemeral(
        &self,
        _fence: &Fence,
        _uid: &str,
        _container: &ContainerSpec,
    ) -> Result<()> {
        Err(self.unsupported("ephemeral containers"))
    }

    /// The content of the Pod's file volumes (configMap, secret, downwardAPI,
    /// projected; only [`VolumeSource::Files`]) changed: make each volume hold
    /// exactly `volumes`' files now, as the kubelet refreshes them while the
    /// Pod runs. Each file is replaced whole (a reader sees the old bytes or
    /// the new, never a mix), and files no longer listed are removed. Volumes
    /// not named are left as they are. Optional, for providers with the
    /// `volumes` capability; without it a running Pod keeps its first content.
    async fn update_volumes(&self, _fence: &Fence, _uid: &str, _volumes: &[Volume]) -> Result<()> {
        Err(self.unsupported("volume updates"))
    }

    /// Resource usage of a Pod's containers. Optional.
    async fn stats(&self, _uid: &str) -> Result<PodStats> {
        Err(self.unsupported("stats"))
    }

    /// The backend's own account of a Pod's instance, as `(what, value)`
    /// pairs for a person (`vkd explain`): its GPUs, the names of a
    /// downstream object, what the backend saw happen. Optional; empty by
    /// default. Never mutates anything.
    async fn describe(&self, _uid: &str) -> Result<Vec<(String, String)>> {
        Ok(Vec::new())
    }

    /// The error for an optional capability this provider lacks.
    fn unsupported(&self, capability: &'static str) -> ProviderError {
        ProviderError::Unsupported {
            provider: self.name().to_owned(),
            capability,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("500ms"), Some(Duration::from_millis(500)));
        assert_eq!(parse_duration("250us"), Some(Duration::from_micros(250)));
        assert_eq!(parse_duration("3s"), Some(Duration::from_secs(3)));
        assert_eq!(parse_duration("2"), Some(Duration::from_secs(2)));
        assert_eq!(parse_duration("1.5m"), Some(Duration::from_secs(90)));
        assert_eq!(parse_duration("-1s"), None);
        assert_eq!(parse_duration("3 days"), None);
        assert_eq!(parse_duration(""), None);
    }

    #[test]
    fn durations_are_bounded() {
        // Past the bound a duration would overflow the clock it is added to.
        assert_eq!(parse_duration("18000000000000000000"), None);
        assert_eq!(parse_duration("9000000000000000h"), None);
        assert_eq!(parse_duration("8761h"), None);
        assert_eq!(
            parse_duration("8760h"),
            Some(Duration::from_secs(365 * 86_400))
        );
        assert_eq!(parse_duration("0.000001s"), Some(Duration::from_micros(1)));
        assert_eq!(parse_duration("1.2.3s"), None);
    }

    #[test]
    fn capabilities_default_to_unsupported() {
        assert!(Capabilities::default().supported().is_empty());
        let c = Capabilities {
            logs: Support::Supported,
            ..Default::default()
        };
        assert_eq!(c.supported(), ["logs"]);
    }
}
