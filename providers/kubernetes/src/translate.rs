//! The downstream Pod for an upstream one.
//!
//! The upstream spec goes down as the user wrote it (ports, probes, hooks,
//! securityContext, resources, command), with what only the upstream cluster
//! can resolve replaced by what vkd resolved there: env values (ConfigMap,
//! Secret, fieldRef lookups) become literal values, and configMap, secret,
//! downwardAPI and projected volumes become one downstream Secret each, owned
//! by the downstream Pod. What names upstream objects the downstream cluster
//! does not have (its ServiceAccount, image pull Secrets, priority class,
//! node selection) is left out; the Pod is pinned by `nodeName` to the host
//! vkd admitted it on.

use std::collections::BTreeMap;

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::{
    Container, EnvVar, KeyToPath, Pod, PodSpec, Secret, SecretVolumeSource, Volume as KubeVolume,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use vkd_provider::{ContainerSpec, Fence, InstanceSpec, ProviderError, Volume, VolumeSource};

use crate::naming;

/// A downstream Pod and the Secrets that carry its volumes' files.
#[derive(Debug)]
pub struct Translated {
    pub pod: Pod,
    /// Created after the Pod, owned by it (the downstream kubelet waits for them).
    pub secrets: Vec<VolumeSecret>,
}

/// The Secret that carries one volume's files.
#[derive(Debug)]
pub struct VolumeSecret {
    /// The volume's name in the Pod, for errors a person reads.
    pub volume: String,
    pub secret: Secret,
}

/// The most a Secret's data may hold (the API server's limit, the sum of
/// its values): a volume past it cannot go down, and would leave the Pod
/// waiting for its Secret forever.
pub const MAX_SECRET_BYTES: usize = 1024 * 1024;

/// Refuses a volume whose files a Secret cannot hold, naming it and the sizes.
fn fits_a_secret(volume: &str, sizes: impl Iterator<Item = usize>) -> Result<(), ProviderError> {
    let (mut files, mut total) = (0usize, 0usize);
    for size in sizes {
        files += 1;
        total = total.saturating_add(size);
    }
    if total <= MAX_SECRET_BYTES {
        return Ok(());
    }
    Err(ProviderError::invalid(
        "VolumeTooLarge",
        format!(
            "volume {volume:?} holds {total} bytes in {files} files; the downstream cluster \
             carries it as a Secret, which holds at most {MAX_SECRET_BYTES} bytes (1 MiB)"
        ),
    ))
}

fn invalid(message: impl Into<String>) -> ProviderError {
    ProviderError::invalid("UnsupportedSpec", message)
}

/// Variables the downstream kubelet sets for its own cluster: the upstream
/// cluster's values would point a client at the wrong API server.
fn downstream_owns(name: &str) -> bool {
    name.starts_with("KUBERNETES_SERVICE_") || name.starts_with("KUBERNETES_PORT")
}

fn resolved_env(resolved: &ContainerSpec) -> Option<Vec<EnvVar>> {
    let env: Vec<EnvVar> = resolved
        .env
        .iter()
        .filter(|(k, _)| !downstream_owns(k))
        .map(|(k, v)| EnvVar {
            name: k.clone(),
            value: Some(v.clone()),
            value_from: None,
        })
        .collect();
    (!env.is_empty()).then_some(env)
}

fn with_resolved_env(
    containers: Vec<Container>,
    resolved: &[ContainerSpec],
) -> Result<Vec<Container>, ProviderError> {
    containers
        .into_iter()
        .map(|mut c| {
            let r = resolved
                .iter()
                .find(|r| r.name == c.name)
                .ok_or_else(|| invalid(format!("container {:?} was not resolved", c.name)))?;
            c.env = resolved_env(r);
            c.env_from = None;
            Ok(c)
        })
        .collect()
}

/// A volume Secret's labels: its Pod's owner, and the node and epoch that
/// wrote it, which the downstream fence policy checks on every write.
pub fn secret_labels(uid: &str, fence: &Fence) -> BTreeMap<String, String> {
    BTreeMap::from([
        (naming::OWNER_UID.into(), uid.to_owned()),
        (naming::OWNER_NODE.into(), fence.node.clone()),
        (naming::EPOCH.into(), fence.epoch.to_string()),
    ])
}

/// The volumes, with file volumes turned into downstream Secrets.
fn volumes(
    spec: &InstanceSpec,
    fence: &Fence,
    original: Vec<KubeVolume>,
) -> Result<(Vec<KubeVolume>, Vec<VolumeSecret>), ProviderError> {
    let uid = &spec.pod.uid;
    let mut secrets = Vec::new();
    let mut out = Vec::with_capacity(original.len());
    for v in original {
        let resolved = spec.volumes.iter().find(|r| r.name == v.name);
        match resolved.map(|r| &r.source) {
            Some(VolumeSource::Files { files }) => {
                fits_a_secret(&v.name, files.iter().map(|f| f.data.len()))?;
                let name = naming::volume_secret_name(uid, secrets.len());
                let mut data = BTreeMap::new();
                let mut items = Vec::with_capacity(files.len());
                for (i, f) in files.iter().enumerate() {
                    let key = format!("f{i}");
                    data.insert(key.clone(), ByteString(f.data.clone()));
                    items.push(KeyToPath {
                        key,
                        path: f.path.clone(),
                        mode: i32::try_from(f.mode & 0o777).ok(),
                        ..KeyToPath::default()
                    });
                }
                secrets.push(VolumeSecret {
                    volume: v.name.clone(),
                    secret: Secret {
                        metadata: ObjectMeta {
                            name: Some(name.clone()),
                            labels: Some(secret_labels(uid, fence)),
                            ..ObjectMeta::default()
                        },
                        data: Some(data),
                        type_: Some("Opaque".into()),
                        ..Secret::default()
                    },
                });
                out.push(KubeVolume {
                    name: v.name,
                    secret: Some(SecretVolumeSource {
                        secret_name: Some(name),
                        items: Some(items),
                        default_mode: Some(0o644),
                        optional: Some(false),
                        ..SecretVolumeSource::default()
                    }),
                    ..KubeVolume::default()
                });
            }
            Some(VolumeSource::EmptyDir { .. }) | Some(VolumeSource::HostPath { .. }) => {
                out.push(v)
            }
            None if v.empty_dir.is_some() => out.push(v),
            None => {
                return Err(invalid(format!(
                    "volume {:?} has no content resolved for the downstream cluster",
                    v.name
                )));
            }
            Some(other) => {
                return Err(invalid(format!(
                    "volume {:?}: this provider does not know the kind {other:?}",
                    v.name
                )));
            }
        }
    }
    Ok((out, secrets))
}

/// A volume Secret's name and its new data.
pub type Refreshed = (String, BTreeMap<String, ByteString>);

/// The new content of each volume Secret of `pod` (a downstream Pod vkd
/// made) from `volumes`, the resolved volumes upstream: per Secret name, its
/// data. A Pod's volumes cannot change once it exists, so each Secret keeps
/// the keys its items name, and only their content follows: a file added
/// upstream later is not carried down, and one removed keeps its last content.
/// Content grown past what a Secret holds is refused (`VolumeTooLarge`).
pub fn refreshed_secrets(pod: &Pod, volumes: &[Volume]) -> Result<Vec<Refreshed>, ProviderError> {
    let own = pod.spec.iter().flat_map(|s| s.volumes.iter().flatten());
    let mut out = Vec::new();
    for v in own {
        let Some(src) = &v.secret else { continue };
        let (Some(name), Some(items)) = (&src.secret_name, &src.items) else {
            continue;
        };
        let Some(files) = volumes
            .iter()
            .find(|r| r.name == v.name)
            .and_then(|r| match &r.source {
                VolumeSource::Files { files } => Some(files),
                _ => None,
            })
        else {
            continue;
        };
        let data: BTreeMap<String, ByteString> = items
            .iter()
            .filter_map(|item| {
                let file = files.iter().find(|f| f.path == item.path)?;
                Some((item.key.clone(), ByteString(file.data.clone())))
            })
            .collect();
        fits_a_secret(&v.name, data.values().map(|d| d.0.len()))?;
        if !data.is_empty() {
            out.push((name.clone(), data));
        }
    }
    Ok(out)
}

/// Builds the downstream Pod for `spec` in namespace `namespace`.
pub fn downstream_pod(
    spec: &InstanceSpec,
    fence: &Fence,
    namespace: &str,
) -> Result<Translated, ProviderError> {
    let text = spec.pod_spec.as_deref().ok_or_else(|| {
        invalid("the kubernetes provider needs the Pod's spec; this vkd did not pass it")
    })?;
    let mut s: PodSpec = serde_json::from_str(text)
        .map_err(|e| invalid(format!("the Pod's spec does not parse: {e}")))?;
    s.containers = with_resolved_env(std::mem::take(&mut s.containers), &spec.containers)?;
    if let Some(init) = s.init_containers.take() {
        s.init_containers = Some(with_resolved_env(init, &spec.init_containers)?);
    }
    let (vols, secrets) = volumes(spec, fence, s.volumes.take().unwrap_or_default())?;
    s.volumes = (!vols.is_empty()).then_some(vols);
    // What names upstream objects, or selects upstream nodes.
    s.node_selector = None;
    s.affinity = None;
    s.scheduler_name = None;
    s.scheduling_gates = None;
    s.topology_spread_constraints = None;
    s.priority = None;
    s.priority_class_name = None;
    s.preemption_policy = None;
    s.runtime_class_name = None;
    s.overhead = None;
    s.image_pull_secrets = None;
    s.readiness_gates = None;
    s.resource_claims = None;
    s.ephemeral_containers = None;
    // vkd enforces the deadline upstream, from the upstream start time.
    s.active_deadline_seconds = None;
    // The upstream ServiceAccount's token stays upstream; a token vkd was
    // allowed to hand down arrives as a file volume above.
    s.service_account_name = None;
    s.service_account = None;
    s.automount_service_account_token = Some(false);
    s.enable_service_links = Some(false);
    if s.hostname.is_none() && spec.pod.name.len() <= 63 && !spec.pod.name.contains('.') {
        s.hostname = Some(spec.pod.name.clone());
    }
    s.node_name = spec.placement.as_ref().map(|p| p.host.clone());
    let uid = &spec.pod.uid;
    let pod = Pod {
        metadata: ObjectMeta {
            name: Some(naming::pod_name(uid)),
            namespace: Some(namespace.to_owned()),
            labels: Some(BTreeMap::from([
                (naming::OWNER_UID.into(), uid.clone()),
                (naming::OWNER_NODE.into(), fence.node.clone()),
                (naming::EPOCH.into(), fence.epoch.to_string()),
            ])),
            annotations: Some(BTreeMap::from([
                (naming::OWNER_NAMESPACE.into(), spec.pod.namespace.clone()),
                (naming::OWNER_NAME.into(), spec.pod.name.clone()),
            ])),
            ..ObjectMeta::default()
        },
        spec: Some(s),
        status: None,
    };
    Ok(Translated { pod, secrets })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // a failed unwrap is a failed test
    use super::*;
    use serde_json::json;
    use vkd_provider::{Placement, VolumeFile};

    fn spec(pod_spec: serde_json::Value) -> InstanceSpec {
        let mut s = vkd_provider::conformance::sample_spec("vk", "u1");
        s.pod_spec = Some(pod_spec.to_string());
        s.placement = Some(Placement {
            host: "host-a".into(),
            gpu_ids: vec![],
        });
        s
    }

    #[test]
    fn keeps_the_users_spec_and_replaces_what_is_upstream() {
        let mut s = spec(json!({
            "containers": [{
                "name": "main", "image": "busybox", "command": ["sleep", "1"],
                "ports": [{"containerPort": 8080}],
                "readinessProbe": {"tcpSocket": {"port": 8080}},
                "securityContext": {"runAsUser": 1000},
                "resources": {"limits": {"nvidia.com/gpu": "4"}},
                "env": [{"name": "A", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}],
                "volumeMounts": [{"name": "cfg", "mountPath": "/etc/cfg"}]
            }],
            "volumes": [{"name": "cfg", "configMap": {"name": "upstream-cm"}}, {"name": "scratch", "emptyDir": {}}],
            "nodeSelector": {"type": "virtual"},
            "serviceAccountName": "builder",
            "imagePullSecrets": [{"name": "regcred"}],
            "priorityClassName": "high"
        }));
        s.containers[0].name = "main".into();
        s.containers[0].env = vec![
            ("A".into(), "resolved".into()),
            ("KUBERNETES_SERVICE_HOST".into(), "10.0.0.1".into()),
        ];
        s.volumes = vec![Volume {
            name: "cfg".into(),
            source: VolumeSource::Files {
                files: vec![VolumeFile {
                    path: "dir/app.conf".into(),
                    data: b"x=1".to_vec(),
                    mode: 0o640,
                }],
            },
        }];
        let fence = Fence {
            node: "vk".into(),
            epoch: 7,
        };
        let t = downstream_pod(&s, &fence, "vkd-team").unwrap();
        let p = serde_json::to_value(&t.pod).unwrap();
        assert_eq!(p["metadata"]["name"], "vkd-u1");
        assert_eq!(p["metadata"]["labels"]["vkd.io/epoch"], "7");
        assert_eq!(p["spec"]["nodeName"], "host-a");
        let c = &p["spec"]["containers"][0];
        assert_eq!(c["ports"][0]["containerPort"], 8080);
        assert_eq!(c["readinessProbe"]["tcpSocket"]["port"], 8080);
        assert_eq!(c["securityContext"]["runAsUser"], 1000);
        assert_eq!(c["resources"]["limits"]["nvidia.com/gpu"], "4");
        assert_eq!(c["env"], json!([{"name": "A", "value": "resolved"}]));
        for gone in [
            "nodeSelector",
            "serviceAccountName",
            "imagePullSecrets",
            "priorityClassName",
        ] {
            assert!(p["spec"].get(gone).is_none(), "{gone}: {p}");
        }
        assert_eq!(p["spec"]["automountServiceAccountToken"], false);
        assert_eq!(p["spec"]["volumes"][0]["secret"]["secretName"], "vkd-u1-v0");
        assert_eq!(
            p["spec"]["volumes"][0]["secret"]["items"][0]["path"],
            "dir/app.conf"
        );
        assert_eq!(p["spec"]["volumes"][0]["secret"]["items"][0]["mode"], 0o640);
        assert!(p["spec"]["volumes"][1]["emptyDir"].is_object());
        assert_eq!(t.secrets.len(), 1);
        assert_eq!(t.secrets[0].volume, "cfg");
        let data = t.secrets[0].secret.data.as_ref().unwrap();
        assert_eq!(data["f0"].0, b"x=1");
        // Refreshed: the file's new content under the same key; a file that
        // appeared later has no item in the Pod, so it is not carried.
        let file = |path: &str, data: &[u8]| VolumeFile {
            path: path.into(),
            data: data.to_vec(),
            mode: 0o644,
        };
        let later = [Volume {
            name: "cfg".into(),
            source: VolumeSource::Files {
                files: vec![file("new.conf", b"n"), file("dir/app.conf", b"x=2")],
            },
        }];
        let refreshed = refreshed_secrets(&t.pod, &later).unwrap();
        assert_eq!(refreshed.len(), 1);
        assert_eq!(refreshed[0].0, "vkd-u1-v0");
        assert_eq!(
            refreshed[0].1,
            BTreeMap::from([("f0".to_owned(), ByteString(b"x=2".to_vec()))])
        );
        // A volume not named, or no longer files, is left alone.
        assert!(refreshed_secrets(&t.pod, &[]).unwrap().is_empty());
    }

    #[test]
    fn a_volume_past_what_a_secret_holds_fails_the_pod_saying_so() {
        let mut s = spec(json!({
            "containers": [{"name": "main", "image": "x"}],
            "volumes": [{"name": "models", "projected": {"sources": []}}]
        }));
        s.containers[0].name = "main".into();
        let file = |path: &str, len: usize| VolumeFile {
            path: path.into(),
            data: vec![b'x'; len],
            mode: 0o644,
        };
        let volume = |files| Volume {
            name: "models".into(),
            source: VolumeSource::Files { files },
        };
        let fence = Fence {
            node: "vk".into(),
            epoch: 1,
        };
        // Exactly 1 MiB fits.
        s.volumes = vec![volume(vec![
            file("a", MAX_SECRET_BYTES / 2),
            file("b", MAX_SECRET_BYTES / 2),
        ])];
        let t = downstream_pod(&s, &fence, "ns").unwrap();
        // One byte more does not, before anything is made.
        s.volumes = vec![volume(vec![
            file("a", MAX_SECRET_BYTES / 2),
            file("b", MAX_SECRET_BYTES / 2 + 1),
        ])];
        let Err(ProviderError::Invalid { reason, message }) = downstream_pod(&s, &fence, "ns")
        else {
            panic!("a 1 MiB + 1 volume went down");
        };
        assert_eq!(reason, "VolumeTooLarge");
        assert!(
            message.contains("\"models\"")
                && message.contains("1048577 bytes in 2 files")
                && message.contains("1048576"),
            "{message}"
        );
        // Content that grows past it later is refused too, not sent.
        let grown = [volume(vec![file("a", MAX_SECRET_BYTES), file("b", 1)])];
        assert!(matches!(
            refreshed_secrets(&t.pod, &grown),
            Err(ProviderError::Invalid { reason, .. }) if reason == "VolumeTooLarge"
        ));
    }

    #[test]
    fn refuses_what_it_cannot_carry() {
        let s = vkd_provider::conformance::sample_spec("vk", "u1");
        let fence = Fence {
            node: "vk".into(),
            epoch: 1,
        };
        assert!(matches!(
            downstream_pod(&s, &fence, "ns"),
            Err(ProviderError::Invalid { .. })
        ));
        let s = spec(json!({"containers": [{"name": "nope", "image": "x"}]}));
        assert!(
            downstream_pod(&s, &fence, "ns").is_err(),
            "an unresolved container"
        );
        let mut s =
            spec(json!({"containers": [], "volumes": [{"name": "c", "configMap": {"name": "x"}}]}));
        s.containers.clear();
        assert!(
            downstream_pod(&s, &fence, "ns").is_err(),
            "an unresolved volume"
        );
    }
}
