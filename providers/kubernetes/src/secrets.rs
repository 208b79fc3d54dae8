//! The Secrets that carry a downstream Pod's volumes, made with the Pod and
//! owned by it.

use std::time::Duration;

use k8s_openapi::api::core::v1::{Pod, Secret};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference;
use kube::Api;
use kube::api::PostParams;
use tracing::warn;
use vkd_provider::{Fence, ProviderError, Result};

use crate::watch::Downstream;
use crate::{KubernetesProvider, conflict, lock, owner_uid, transient, translate};

/// An answer that says the request itself is refused, and will be again:
/// not a passing state (a conflict, too many requests, a gone namespace).
fn refused(code: u16) -> bool {
    (400..500).contains(&code) && !matches!(code, 404 | 408 | 409 | 429)
}

impl KubernetesProvider {
    /// Creates the Secrets of `pod`'s volumes, owned by it (so the downstream
    /// garbage collector removes them with it). Existing ones are kept. A
    /// Secret the API server refuses fails the Pod with the API server's
    /// words, and its downstream Pod is removed: it would otherwise wait,
    /// Pending, for a Secret that never comes.
    pub(crate) async fn create_secrets(
        &self,
        d: &Downstream,
        fence: &Fence,
        pod: &Pod,
        secrets: Vec<translate::VolumeSecret>,
    ) -> Result<()> {
        let (Some(ns), Some(name), Some(uid)) = (
            pod.metadata.namespace.as_deref(),
            pod.metadata.name.as_deref(),
            pod.metadata.uid.as_deref(),
        ) else {
            return Err(ProviderError::transient(
                "downstream: the Pod came back without its identity",
            ));
        };
        let api: Api<Secret> = Api::namespaced(d.client.clone(), ns);
        for translate::VolumeSecret { volume, mut secret } in secrets {
            secret.metadata.owner_references = Some(vec![OwnerReference {
                api_version: "v1".into(),
                kind: "Pod".into(),
                name: name.to_owned(),
                uid: uid.to_owned(),
                controller: Some(true),
                block_owner_deletion: None,
            }]);
            let secret_name = secret.metadata.name.clone().unwrap_or_default();
            let created = api.create(&PostParams::default(), &secret).await;
            if let Err(e) = &created
                && let Some(fenced) = crate::fence::denial(&fence.node, fence.epoch, e)
            {
                // A later replica holds the node: not this Pod's fault.
                return Err(fenced);
            }
            match created {
                Ok(_) => {}
                Err(e) if conflict(&e) => {}
                Err(kube::Error::Api(s)) if refused(s.code) => {
                    if let Some(owner) = owner_uid(pod) {
                        lock(&self.deleting).insert(owner.to_owned());
                    }
                    if let Err(e) = self.delete_pod(d, pod, Duration::ZERO).await {
                        warn!(error = %e, pod = %format!("{ns}/{name}"), "removing a Pod whose volume was refused");
                    }
                    return Err(ProviderError::invalid(
                        "VolumeRefused",
                        format!(
                            "the downstream API server refused Secret {secret_name}, which carries volume {volume:?}: {} ({})",
                            s.message, s.code
                        ),
                    ));
                }
                Err(e) => return Err(transient("creating a volume Secret", e)),
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_lasting_refusal_fails_a_volume() {
        for code in [400, 403, 413, 422] {
            assert!(refused(code), "{code}");
        }
        for code in [404, 409, 429, 500, 503] {
            assert!(!refused(code), "{code}");
        }
    }
}
