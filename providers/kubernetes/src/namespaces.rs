//! vkd's downstream namespaces: one made by vkd for each upstream namespace,
//! with vkd's labels and Pod Security enforced; vkd places no Pod in one it
//! did not make, nor in one made for another upstream namespace.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Namespace;
use kube::Api;
use kube::api::{Patch, PatchParams, PostParams};
use vkd_provider::{ProviderError, Result};

use crate::watch::Downstream;
use crate::{KubernetesProvider, conflict, lock, naming, ownership, transient};

fn namespace_conflict(namespace: &str, held: &str, upstream: &str) -> ProviderError {
    ProviderError::invalid(
        "NamespaceConflict",
        format!(
            "the downstream namespace {namespace} holds upstream namespace {held}'s Pods; \
             vkd does not put upstream namespace {upstream}'s there"
        ),
    )
}

impl KubernetesProvider {
    /// Makes sure `namespace` is a downstream namespace vkd made for upstream
    /// namespace `upstream`: creates it (vkd's labels, Pod Security enforced
    /// at the configured level), or checks the one there. vkd places no Pod in
    /// a namespace it did not make, nor in one made for another upstream
    /// namespace.
    pub(crate) async fn ensure_namespace(
        &self,
        d: &Downstream,
        namespace: &str,
        upstream: &str,
    ) -> Result<()> {
        let known = || -> Option<Result<()>> {
            let verified = lock(&self.verified);
            let held = verified.get(namespace)?;
            Some(if held == upstream {
                Ok(())
            } else {
                Err(namespace_conflict(namespace, held, upstream))
            })
        };
        if let Some(r) = known() {
            return r;
        }
        // One create at a time: a burst of Pods in a new namespace makes it once.
        let _one = self.namespace_create.lock().await;
        if let Some(r) = known() {
            return r;
        }
        let api: Api<Namespace> = Api::all(d.client.clone());
        let level = self.config.pod_security.clone();
        let ns = Namespace {
            metadata: kube::api::ObjectMeta {
                name: Some(namespace.to_owned()),
                labels: Some(BTreeMap::from([
                    (naming::MANAGED.to_owned(), "true".to_owned()),
                    (naming::UPSTREAM_NAMESPACE.to_owned(), upstream.to_owned()),
                    (naming::POD_SECURITY.to_owned(), level.clone()),
                ])),
                ..Default::default()
            },
            ..Namespace::default()
        };
        match api.create(&PostParams::default(), &ns).await {
            Ok(_) => {}
            Err(e) if conflict(&e) => {
                let existing = api
                    .get(namespace)
                    .await
                    .map_err(|e| transient("reading the namespace", e))?;
                match ownership::namespace_upstream(&existing, &self.config.mapping()) {
                    Ok(Some(held)) if held != upstream => {
                        return Err(namespace_conflict(namespace, held, upstream));
                    }
                    Ok(_) => {}
                    Err(why) => {
                        return Err(ProviderError::invalid(
                            "NamespaceNotManaged",
                            format!(
                                "the downstream namespace {namespace} exists and vkd did not make it ({why}); \
                                 vkd places Pods only in namespaces it made: remove it downstream, or give vkd \
                                 another namespacePrefix"
                            ),
                        ));
                    }
                }
                // Made by a vkd that did not record the upstream namespace,
                // or stripped of its Pod Security label: both put back.
                let labels = existing.metadata.labels.unwrap_or_default();
                let mut missing = serde_json::Map::new();
                if labels.get(naming::UPSTREAM_NAMESPACE).map(String::as_str) != Some(upstream) {
                    missing.insert(naming::UPSTREAM_NAMESPACE.into(), upstream.into());
                }
                if !labels.contains_key(naming::POD_SECURITY) {
                    missing.insert(naming::POD_SECURITY.into(), level.into());
                }
                if !missing.is_empty() {
                    let patch = serde_json::json!({ "metadata": { "labels": missing } });
                    api.patch(namespace, &PatchParams::default(), &Patch::Merge(&patch))
                        .await
                        .map_err(|e| transient("labelling the namespace", e))?;
                }
            }
            Err(e) => return Err(transient("creating the namespace", e)),
        }
        lock(&self.verified).insert(namespace.to_owned(), upstream.to_owned());
        Ok(())
    }
}
