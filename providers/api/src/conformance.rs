//! A conformance kit that every provider runs in its own tests.
//!
//! ```ignore
//! #[tokio::test]
//! async fn conforms() {
//!     let provider = MyProvider::new(..);
//!     vkd_provider::conformance::Kit::new(&provider, "node-a", sample_spec).run().await.unwrap();
//! }
//! ```
//!
//! Each check uses Pod UIDs of its own, so a provider may be shared between checks.

use std::time::Duration;

use futures::StreamExt;

use crate::{
    ContainerSpec, Fence, InstanceEvent, InstanceSpec, LogRequest, PodRef, Provider, ProviderError,
    Resources, RestartPolicy, StreamIo, Support,
};

/// Which check failed, and why.
#[derive(Debug, thiserror::Error)]
#[error("conformance check '{check}' failed: {message}")]
pub struct Failure {
    pub check: &'static str,
    pub message: String,
}

/// A Pod a provider can run with no special setup: one container, no resources.
pub fn sample_spec(node: &str, uid: &str) -> InstanceSpec {
    InstanceSpec {
        pod: PodRef {
            uid: uid.to_owned(),
            namespace: "conformance".into(),
            name: format!("pod-{uid}"),
        },
        node: node.to_owned(),
        containers: vec![ContainerSpec {
            name: "main".into(),
            image: "busybox".into(),
            command: vec!["sleep".into(), "3600".into()],
            ..Default::default()
        }],
        resources: Resources::default(),
        restart_policy: RestartPolicy::Always,
        annotations: Default::default(),
        placement: None,
        init_containers: Vec::new(),
        volumes: Vec::new(),
        termination_grace: Duration::from_secs(5),
        pod_spec: None,
        host_network: false,
        share_process_namespace: false,
        host_ports: Vec::new(),
        fs_group: None,
        user_namespace: false,
    }
}

const IDEMPOTENT_CREATE: &str = "idempotent create";
const DELETE_CONFIRMED: &str = "delete confirmed by a later get";
const LIST_SHOWS_OWNERS: &str = "list shows owners";
const STALE_EPOCH_REFUSED: &str = "stale epoch refused";
const EVENTS_DELIVERED: &str = "events delivered";
const UNSUPPORTED_DECLARED: &str = "unsupported capabilities declared";

type SpecFn<'a> = dyn Fn(&str, &str) -> InstanceSpec + Send + Sync + 'a;

/// Runs the checks against one provider. Run it once per provider instance: the
/// stale-epoch check moves the node's epoch forward.
pub struct Kit<'a> {
    provider: &'a dyn crate::Provider,
    node: String,
    spec: Box<SpecFn<'a>>,
    /// How long a deletion may take to be confirmed.
    pub patience: Duration,
}

impl std::fmt::Debug for Kit<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Kit").field("node", &self.node).finish()
    }
}

fn fail(check: &'static str, message: impl Into<String>) -> Failure {
    Failure {
        check,
        message: message.into(),
    }
}

impl<'a> Kit<'a> {
    /// `spec(node, uid)` builds the Pod each check creates.
    pub fn new(
        provider: &'a dyn Provider,
        node: &str,
        spec: impl Fn(&str, &str) -> InstanceSpec + Send + Sync + 'a,
    ) -> Self {
        Self {
            provider,
            node: node.to_owned(),
            spec: Box::new(spec),
            patience: Duration::from_secs(10),
        }
    }

    /// Runs every check in turn; stops at the first failure.
    pub async fn run(&self) -> Result<(), Failure> {
        self.idempotent_create().await?;
        self.delete_confirmed_by_get().await?;
        self.list_shows_owners().await?;
        self.stale_epoch_refused().await?;
        self.events_delivered().await?;
        self.unsupported_capabilities_declared().await?;
        Ok(())
    }

    /// Runs every check in turn, each whatever the others gave: a report a
    /// plugin's author reads whole (`vkd provider-conformance`).
    pub async fn report(&self) -> Vec<(&'static str, Result<(), Failure>)> {
        vec![
            (IDEMPOTENT_CREATE, self.idempotent_create().await),
            (DELETE_CONFIRMED, self.delete_confirmed_by_get().await),
            (LIST_SHOWS_OWNERS, self.list_shows_owners().await),
            (STALE_EPOCH_REFUSED, self.stale_epoch_refused().await),
            (EVENTS_DELIVERED, self.events_delivered().await),
            (
                UNSUPPORTED_DECLARED,
                self.unsupported_capabilities_declared().await,
            ),
        ]
    }

    fn fence(&self, epoch: u64) -> Fence {
        Fence {
            node: self.node.clone(),
            epoch,
        }
    }

    /// The epoch most checks act under; the stale-epoch check moves the node to one above.
    const EPOCH: u64 = 10;

    async fn idempotent_create(&self) -> Result<(), Failure> {
        const C: &str = IDEMPOTENT_CREATE;
        let spec = (self.spec)(&self.node, "conf-idem");
        let fence = self.fence(Self::EPOCH);
        let a = self
            .provider
            .create(&fence, &spec)
            .await
            .map_err(|e| fail(C, e.to_string()))?;
        let b = self
            .provider
            .create(&fence, &spec)
            .await
            .map_err(|e| fail(C, e.to_string()))?;
        if a.id != b.id {
            return Err(fail(
                C,
                format!("second create gave instance {} after {}", b.id, a.id),
            ));
        }
        let list = self
            .provider
            .list(&self.node)
            .await
            .map_err(|e| fail(C, e.to_string()))?;
        let n = list.iter().filter(|i| i.owner.uid == spec.pod.uid).count();
        if n != 1 {
            return Err(fail(C, format!("{n} instances listed for one Pod UID")));
        }
        self.remove(C, &spec.pod.uid).await
    }

    async fn remove(&self, check: &'static str, uid: &str) -> Result<(), Failure> {
        self.provider
            .delete(&self.fence(Self::EPOCH), uid, Duration::from_secs(1))
            .await
            .map_err(|e| fail(check, format!("delete: {e}")))?;
        let deadline = tokio::time::Instant::now() + self.patience;
        loop {
            match self.provider.get(uid).await {
                Ok(None) => return Ok(()),
                Ok(Some(_)) if tokio::time::Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Ok(Some(i)) => {
                    return Err(fail(
                        check,
                        format!("instance {} still there after delete", i.id),
                    ));
                }
                Err(e) => return Err(fail(check, format!("get after delete: {e}"))),
            }
        }
    }

    async fn delete_confirmed_by_get(&self) -> Result<(), Failure> {
        const C: &str = DELETE_CONFIRMED;
        let spec = (self.spec)(&self.node, "conf-delete");
        self.provider
            .create(&self.fence(Self::EPOCH), &spec)
            .await
            .map_err(|e| fail(C, e.to_string()))?;
        match self.provider.get(&spec.pod.uid).await {
            Ok(Some(_)) => {}
            other => return Err(fail(C, format!("get after create gave {other:?}"))),
        }
        self.remove(C, &spec.pod.uid).await?;
        // Deleting again is not an error.
        self.provider
            .delete(&self.fence(Self::EPOCH), &spec.pod.uid, Duration::ZERO)
            .await
            .map_err(|e| fail(C, format!("second delete: {e}")))
    }

    async fn list_shows_owners(&self) -> Result<(), Failure> {
        const C: &str = LIST_SHOWS_OWNERS;
        let specs: Vec<_> = ["conf-list-a", "conf-list-b"]
            .iter()
            .map(|uid| (self.spec)(&self.node, uid))
            .collect();
        for spec in &specs {
            self.provider
                .create(&self.fence(Self::EPOCH), spec)
                .await
                .map_err(|e| fail(C, e.to_string()))?;
        }
        let list = self
            .provider
            .list(&self.node)
            .await
            .map_err(|e| fail(C, e.to_string()))?;
        for spec in &specs {
            let Some(found) = list.iter().find(|i| i.owner.uid == spec.pod.uid) else {
                return Err(fail(C, format!("{} missing from list", spec.pod.uid)));
            };
            if found.owner != spec.pod || found.node != self.node {
                return Err(fail(
                    C,
                    format!(
                        "listed owner {:?} on {}, want {:?}",
                        found.owner, found.node, spec.pod
                    ),
                ));
            }
        }
        for spec in &specs {
            self.remove(C, &spec.pod.uid).await?;
        }
        Ok(())
    }

    async fn stale_epoch_refused(&self) -> Result<(), Failure> {
        const C: &str = STALE_EPOCH_REFUSED;
        let spec = (self.spec)(&self.node, "conf-fence");
        let newer = self.fence(Self::EPOCH + 1);
        self.provider
            .create(&newer, &spec)
            .await
            .map_err(|e| fail(C, e.to_string()))?;
        let stale = self.fence(Self::EPOCH);
        let other = (self.spec)(&self.node, "conf-fence-stale");
        match self.provider.create(&stale, &other).await {
            Err(ProviderError::Fenced { .. }) => {}
            other => return Err(fail(C, format!("create at a stale epoch gave {other:?}"))),
        }
        match self
            .provider
            .delete(&stale, &spec.pod.uid, Duration::ZERO)
            .await
        {
            Err(ProviderError::Fenced { .. }) => {}
            other => return Err(fail(C, format!("delete at a stale epoch gave {other:?}"))),
        }
        if self
            .provider
            .get(&other.pod.uid)
            .await
            .ok()
            .flatten()
            .is_some()
        {
            return Err(fail(C, "a fenced create still made an instance"));
        }
        self.provider
            .delete(&newer, &spec.pod.uid, Duration::ZERO)
            .await
            .map_err(|e| fail(C, e.to_string()))
    }

    async fn events_delivered(&self) -> Result<(), Failure> {
        const C: &str = EVENTS_DELIVERED;
        let mut events = self.provider.events();
        let spec = (self.spec)(&self.node, "conf-events");
        let fence = self.fence(Self::EPOCH + 1);
        self.provider
            .create(&fence, &spec)
            .await
            .map_err(|e| fail(C, e.to_string()))?;
        let wanted = async {
            while let Some(ev) = events.next().await {
                if matches!(&ev, InstanceEvent::Changed { uid } if *uid == spec.pod.uid) {
                    return true;
                }
            }
            false
        };
        let got = tokio::time::timeout(self.patience, wanted)
            .await
            .unwrap_or(false);
        self.provider
            .delete(&fence, &spec.pod.uid, Duration::ZERO)
            .await
            .map_err(|e| fail(C, e.to_string()))?;
        if got {
            Ok(())
        } else {
            Err(fail(C, "no Changed event for a created instance"))
        }
    }

    async fn unsupported_capabilities_declared(&self) -> Result<(), Failure> {
        const C: &str = UNSUPPORTED_DECLARED;
        let caps = self.provider.capabilities();
        let unsupported = |r: &Result<(), ProviderError>| matches!(r, Err(ProviderError::Unsupported { provider, .. }) if provider == self.provider.name());
        let io = || StreamIo {
            stdin: None,
            stdout: None,
            stderr: None,
            tty: false,
            resize: None,
        };
        let debug = ContainerSpec {
            name: "debugger".into(),
            image: "busybox".into(),
            command: vec!["true".into()],
            ..Default::default()
        };
        let checks: [(&str, Support, Result<(), ProviderError>); 6] = [
            (
                "logs",
                caps.logs,
                self.provider
                    .logs("conf-none", "main", LogRequest::default())
                    .await
                    .map(drop),
            ),
            (
                "exec",
                caps.exec,
                self.provider
                    .exec("conf-none", "main", vec!["true".into()], io())
                    .await
                    .map(drop),
            ),
            (
                "attach",
                caps.attach,
                self.provider.attach("conf-none", "main", io()).await,
            ),
            (
                "port-forward",
                caps.port_forward,
                self.provider
                    .port_forward("conf-none", 1, Box::new(tokio::io::duplex(64).0))
                    .await,
            ),
            (
                "stats",
                caps.stats,
                self.provider.stats("conf-none").await.map(drop),
            ),
            (
                "ephemeral containers",
                caps.ephemeral_containers,
                self.provider
                    .start_ephemeral(&self.fence(Self::EPOCH + 1), "conf-none", &debug)
                    .await,
            ),
        ];
        for (name, support, result) in checks {
            match support {
                Support::Unsupported if !unsupported(&result) => {
                    return Err(fail(
                        C,
                        format!("{name} declared unsupported but gave {result:?}"),
                    ));
                }
                Support::Supported if unsupported(&result) => {
                    return Err(fail(
                        C,
                        format!("{name} declared supported but answered Unsupported"),
                    ));
                }
                _ => {}
            }
        }
        Ok(())
    }
}
