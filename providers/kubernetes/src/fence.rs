//! Fencing enforced by the downstream API server, not only by vkd.
//!
//! vkd installs one ValidatingAdmissionPolicy (cluster-wide) and one binding
//! per virtual node. The binding's parameter is a ConfigMap, the node's fence,
//! that holds the epoch of the replica that last took the node over. A Pod
//! create (or an update that changes its epoch label) for that node is denied
//! unless its `vkd.io/epoch` label is at least the fence's epoch: a stale
//! replica that wakes up after a failover is refused by the API server itself,
//! whatever it believes.

use k8s_openapi::api::admissionregistration::v1::{
    ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
};
use k8s_openapi::api::core::v1::{ConfigMap, Namespace};
use kube::api::{Patch, PatchParams, PostParams};
use kube::{Api, Client};
use serde_json::json;
use vkd_provider::ProviderError;

use crate::naming;

const POLICY: &str = "vkd-epoch-fence";
const MANAGER: &str = "vkd-kubernetes-provider";
/// Marks a denial by the fence, so it is told from other refusals.
pub const DENIAL_MARK: &str = "vkd-fence:";

/// The fence object and binding of `node`.
pub fn fence_name(node: &str) -> String {
    format!("vkd-fence-{node}")
}

fn api_error(what: &str, e: &kube::Error) -> ProviderError {
    ProviderError::transient(format!("downstream: {what}: {e}"))
}

/// The CEL rule: an unchanged epoch label passes an update; anything else
/// needs an epoch at least the fence's.
fn rule() -> String {
    let e = format!("'{}'", naming::EPOCH);
    format!(
        "(request.operation == 'UPDATE' && {e} in oldObject.metadata.labels && {e} in object.metadata.labels \
         && oldObject.metadata.labels[{e}] == object.metadata.labels[{e}]) \
         || ({e} in object.metadata.labels && int(object.metadata.labels[{e}]) >= int(params.data.epoch))"
    )
}

fn message() -> String {
    let e = format!("'{}'", naming::EPOCH);
    let n = format!("'{}'", naming::OWNER_NODE);
    format!(
        "'{DENIAL_MARK} node ' + object.metadata.labels[{n}] + ' is at epoch ' + params.data.epoch \
         + '; this write carries epoch ' + ({e} in object.metadata.labels ? object.metadata.labels[{e}] : 'none')"
    )
}

/// Installs the policy and `node`'s binding (idempotent: server-side apply).
pub async fn install(client: &Client, namespace: &str, node: &str) -> Result<(), ProviderError> {
    let params = PatchParams::apply(MANAGER).force();
    let ns: Api<Namespace> = Api::all(client.clone());
    let ns_doc = json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}});
    ns.patch(namespace, &params, &Patch::Apply(&ns_doc))
        .await
        .map_err(|e| api_error("applying the fence namespace", &e))?;
    let policy = json!({
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": POLICY},
        "spec": {
            "failurePolicy": "Fail",
            "paramKind": {"apiVersion": "v1", "kind": "ConfigMap"},
            "matchConstraints": {"resourceRules": [{
                "apiGroups": [""], "apiVersions": ["v1"],
                "operations": ["CREATE", "UPDATE"], "resources": ["pods"]
            }]},
            "validations": [{"expression": rule(), "messageExpression": message(), "reason": "Forbidden"}]
        }
    });
    let policies: Api<ValidatingAdmissionPolicy> = Api::all(client.clone());
    policies
        .patch(POLICY, &params, &Patch::Apply(&policy))
        .await
        .map_err(|e| api_error("applying the fence policy", &e))?;
    let name = fence_name(node);
    let binding = json!({
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": name},
        "spec": {
            "policyName": POLICY,
            "validationActions": ["Deny"],
            "paramRef": {"name": name, "namespace": namespace, "parameterNotFoundAction": "Deny"},
            "matchResources": {"objectSelector": {"matchLabels": {naming::OWNER_NODE: node}}}
        }
    });
    let bindings: Api<ValidatingAdmissionPolicyBinding> = Api::all(client.clone());
    bindings
        .patch(&name, &params, &Patch::Apply(&binding))
        .await
        .map_err(|e| api_error("applying the fence binding", &e))?;
    Ok(())
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
            let cm: ConfigMap = serde_json::from_value(json!({
                "metadata": {"name": name, "namespace": namespace},
                "data": {"epoch": epoch.to_string()}
            }))
            .map_err(|e| ProviderError::transient(e.to_string()))?;
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
        cm.data
            .get_or_insert_default()
            .insert("epoch".into(), epoch.to_string());
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
