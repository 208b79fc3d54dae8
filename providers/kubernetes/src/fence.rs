//! Fencing enforced by the downstream API server, not only by vkd.
//!
//! The downstream cluster's admin applies `manifests/downstream/fence.yaml`:
//! one ValidatingAdmissionPolicy and its binding, whose parameters are the
//! fences, one ConfigMap per virtual node (label `vkd.io/fence=true`, data
//! `node` and `epoch`) in the fence namespace. The replica that takes a node
//! over raises its fence to its epoch; from then on a Pod create for that
//! node (or an update that changes its `vkd.io/epoch` label) with an older
//! epoch is denied by the API server itself: a stale replica that wakes up
//! after a failover is refused whatever it believes. vkd needs no right to
//! change admission policy, only to read that it (and the policy reserving
//! vkd's labels, `ownership`) is in place.

use std::collections::BTreeMap;

use k8s_openapi::api::admissionregistration::v1::{
    ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
};
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::PostParams;
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Api, Client};
use vkd_provider::{Fence, ProviderError};

/// The policy and its binding (both named so), from `manifests/downstream`.
pub const POLICY: &str = "vkd-epoch-fence";
/// The policy (and binding) that keeps vkd's labels vkd's
/// (`manifests/downstream/owner-labels.yaml`, see `ownership`).
pub const OWNER_LABELS_POLICY: &str = "vkd-owner-labels";
/// The label that makes a ConfigMap a fence.
pub const FENCE_LABEL: &str = "vkd.io/fence";
/// Marks a denial by the fence, so it is told from other refusals.
pub const DENIAL_MARK: &str = "vkd-fence:";

/// The epoch `node`'s fence holds in `fences` (the watched copy), if any.
pub fn held(fences: &Store<ConfigMap>, namespace: &str, node: &str) -> Option<u64> {
    let cm = fences.get(&ObjectRef::new(&fence_name(node)).within(namespace))?;
    let data = cm.data.as_ref()?;
    if data.get("node").map(String::as_str) != Some(node) {
        return None;
    }
    data.get("epoch")?.parse().ok()
}

/// Refuses a write for `fence` when the watched fence of its node is later:
/// another replica took the node over, and this one's term is over. Checked
/// before every downstream write, deletes included, which the API server's
/// policy cannot tell apart (a DELETE carries no epoch).
pub fn check(
    fences: &Store<ConfigMap>,
    namespace: &str,
    fence: &Fence,
) -> Result<(), ProviderError> {
    match held(fences, namespace, &fence.node) {
        Some(current) if current > fence.epoch => Err(ProviderError::Fenced {
            node: fence.node.clone(),
            current,
            got: fence.epoch,
        }),
        _ => Ok(()),
    }
}

/// The fence object of `node`.
pub fn fence_name(node: &str) -> String {
    format!("vkd-fence-{node}")
}

fn api_error(what: &str, e: &kube::Error) -> ProviderError {
    ProviderError::transient(format!("downstream: {what}: {e}"))
}

/// Checks that vkd's admission policies and bindings are in place
/// downstream: without the fence a stale replica's creates would not be
/// refused there, and without the owner-labels policy anyone could give a
/// Pod vkd's labels.
pub async fn check_installed(client: &Client) -> Result<(), ProviderError> {
    let missing = |what: &str, name: &str, e: &kube::Error| {
        ProviderError::transient(format!(
            "downstream: the admission {what} {name} is not readable ({e}); apply \
             manifests/downstream to the downstream cluster"
        ))
    };
    let policies: Api<ValidatingAdmissionPolicy> = Api::all(client.clone());
    let bindings: Api<ValidatingAdmissionPolicyBinding> = Api::all(client.clone());
    for name in [POLICY, OWNER_LABELS_POLICY] {
        policies
            .get(name)
            .await
            .map_err(|e| missing("policy", name, &e))?;
        bindings
            .get(name)
            .await
            .map_err(|e| missing("binding", name, &e))?;
    }
    Ok(())
}

fn fence_object(namespace: &str, node: &str, epoch: u64) -> ConfigMap {
    ConfigMap {
        metadata: ObjectMeta {
            name: Some(fence_name(node)),
            namespace: Some(namespace.to_owned()),
            labels: Some(BTreeMap::from([(FENCE_LABEL.into(), "true".into())])),
            ..ObjectMeta::default()
        },
        data: Some(BTreeMap::from([
            ("node".into(), node.to_owned()),
            ("epoch".into(), epoch.to_string()),
        ])),
        ..ConfigMap::default()
    }
}

/// Raises `node`'s fence to `epoch`. Refused (`Fenced`) when a later epoch
/// already holds it: another replica took over since.
pub async fn raise(
    client: &Client,
    namespace: &str,
    node: &str,
    epoch: u64,
) -> Result<(), ProviderError> {
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), namespace);
    let name = fence_name(node);
    for _ in 0..8 {
        let current = api
            .get_opt(&name)
            .await
            .map_err(|e| api_error("reading the fence", &e))?;
        let Some(mut cm) = current else {
            let cm = fence_object(namespace, node, epoch);
            match api.create(&PostParams::default(), &cm).await {
                Ok(_) => return Ok(()),
                Err(kube::Error::Api(s)) if s.code == 409 => continue,
                Err(e) => return Err(api_error("creating the fence", &e)),
            }
        };
        let held: u64 = cm
            .data
            .as_ref()
            .and_then(|d| d.get("epoch"))
            .and_then(|e| e.parse().ok())
            .unwrap_or(0);
        if held > epoch {
            return Err(ProviderError::Fenced {
                node: node.to_owned(),
                current: held,
                got: epoch,
            });
        }
        if held == epoch {
            return Ok(());
        }
        let fresh = fence_object(namespace, node, epoch);
        cm.data = fresh.data;
        cm.metadata.labels = fresh.metadata.labels;
        // The resourceVersion read above makes this a compare-and-swap.
        match api.replace(&name, &PostParams::default(), &cm).await {
            Ok(_) => return Ok(()),
            Err(kube::Error::Api(s)) if s.code == 409 => continue,
            Err(e) => return Err(api_error("raising the fence", &e)),
        }
    }
    Err(ProviderError::transient(format!(
        "downstream: the fence of {node} kept changing while vkd raised it"
    )))
}

/// A create the downstream API server refused because of the fence, as the
/// provider error vkd acts on (its term ends); other errors pass as `None`.
pub fn denial(node: &str, got: u64, e: &kube::Error) -> Option<ProviderError> {
    let kube::Error::Api(s) = e else { return None };
    let at = s.message.find(DENIAL_MARK)?;
    let current = s.message[at..]
        .split(" is at epoch ")
        .nth(1)
        .and_then(|rest| rest.split(';').next())
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(got.saturating_add(1));
    Some(ProviderError::Fenced {
        node: node.to_owned(),
        current,
        got,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A replica whose node's fence was raised past its epoch is refused
    /// every write; its own epoch and later ones pass, and another node's
    /// fence, or one that names another node, says nothing.
    #[test]
    fn the_watched_fence_refuses_an_older_epoch() {
        let (store, mut writer) = kube::runtime::reflector::store();
        let mut other = fence_object("vkd-system", "vk-2", 50);
        other.metadata.name = Some(fence_name("vk-3"));
        for cm in [fence_object("vkd-system", "vk", 7), other] {
            writer.apply_watcher_event(&kube::runtime::watcher::Event::Apply(cm));
        }
        let at = |node: &str, epoch| Fence {
            node: node.into(),
            epoch,
        };
        assert_eq!(held(&store, "vkd-system", "vk"), Some(7));
        assert!(matches!(
            check(&store, "vkd-system", &at("vk", 6)),
            Err(ProviderError::Fenced {
                current: 7,
                got: 6,
                ..
            })
        ));
        assert!(check(&store, "vkd-system", &at("vk", 7)).is_ok());
        assert!(check(&store, "vkd-system", &at("vk", 8)).is_ok());
        assert!(check(&store, "vkd-system", &at("vk-2", 1)).is_ok());
        assert!(check(&store, "vkd-system", &at("vk-3", 1)).is_ok());
        assert!(check(&store, "elsewhere", &at("vk", 1)).is_ok());
    }

    #[test]
    fn a_denial_carries_the_fences_epoch() {
        let status = kube::core::Status::failure(
            "admission webhook denied: pods \"vkd-u1\" is forbidden: ValidatingAdmissionPolicy 'vkd-epoch-fence' with binding 'vkd-fence-vk' denied request: vkd-fence: node vk is at epoch 9; this write carries epoch 4",
            "Forbidden",
        )
        .with_code(403);
        let e = kube::Error::Api(Box::new(status));
        assert!(matches!(
            denial("vk", 4, &e),
            Some(ProviderError::Fenced {
                current: 9,
                got: 4,
                ..
            })
        ));
        let other = kube::Error::Api(Box::new(kube::core::Status::failure("quota", "Forbidden")));
        assert!(denial("vk", 4, &other).is_none());
    }
}
