//! What the provider keeps of vkd's own downstream Pods, from the Pod watch.
//!
//! The API's Pod object costs about 13 KB of memory a Pod: k8s-openapi's
//! structs hold every optional field inline (a Container is 2.3 KB, a Volume
//! 3.3 KB, before any content). Stored whole, it was most of the upstream
//! vkd's heap at 5,000 Pods (docs/scale.md). What vkd reads back of its own
//! Pods is kept instead: the ownership marks, the status, the node, the
//! container names and the Secret volumes it refreshes. Other tenants' Pods
//! are only counted for capacity (`capacity::Usage`), never kept.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, PoisonError, RwLock};

use k8s_openapi::api::core::v1::{
    Container, ContainerState, ContainerStatus, KeyToPath, Pod, PodSpec, PodStatus,
    SecretVolumeSource, Volume,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::ObjectMeta;

/// The labels and annotations vkd reads back are its own (`vkd.io/`).
const OWN_PREFIX: &str = "vkd.io/";

type Text = Box<str>;

/// One downstream Pod as the provider keeps it: each part as a plain
/// field, in the order `pod` puts them back.
#[derive(Clone, Debug, PartialEq)]
pub struct KeptPod {
    name: Text,
    namespace: Text,
    uid: Text,
    created: Option<Time>,
    deleting: Option<Time>,
    /// vkd's own labels and annotations (`vkd.io/`).
    labels: Box<[(Text, Text)]>,
    annotations: Box<[(Text, Text)]>,
    node_name: Option<Text>,
    containers: Box<[Text]>,
    init_containers: Box<[Text]>,
    /// The Secret volumes (what `update_volumes` rewrites).
    secret_volumes: Box<[KeptSecretVolume]>,
    status: Option<Box<KeptStatus>>,
}

#[derive(Clone, Debug, PartialEq)]
struct KeptSecretVolume {
    volume: Text,
    secret: Option<Text>,
    default_mode: Option<i32>,
    optional: Option<bool>,
    items: Option<Box<[Item]>>,
}

/// A Secret volume's item: its key, path and mode.
type Item = (Text, Text, Option<i32>);

#[derive(Clone, Debug, PartialEq)]
struct KeptStatus {
    phase: Option<Text>,
    reason: Option<Text>,
    message: Option<Text>,
    pod_ip: Option<Text>,
    host_ip: Option<Text>,
    start_time: Option<Time>,
    containers: Option<Box<[KeptContainer]>>,
    init_containers: Option<Box<[KeptContainer]>>,
}

/// What `status::instance` reads of a container's status.
#[derive(Clone, Debug, PartialEq)]
struct KeptContainer {
    name: Text,
    ready: bool,
    started: Option<bool>,
    restart_count: i32,
    container_id: Option<Text>,
    state: Option<Box<ContainerState>>,
    last_state: Option<Box<ContainerState>>,
}

fn text(s: Option<&String>) -> Option<Text> {
    s.map(|s| s.as_str().into())
}

fn string(t: Option<&Text>) -> Option<String> {
    t.map(|t| t.to_string())
}

fn own(map: Option<&BTreeMap<String, String>>) -> Box<[(Text, Text)]> {
    map.into_iter()
        .flatten()
        .filter(|(k, _)| k.starts_with(OWN_PREFIX))
        .map(|(k, v)| (k.as_str().into(), v.as_str().into()))
        .collect()
}

fn map_of(pairs: &[(Text, Text)]) -> Option<BTreeMap<String, String>> {
    (!pairs.is_empty()).then(|| {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    })
}

impl KeptContainer {
    fn of(c: &ContainerStatus) -> Self {
        Self {
            name: c.name.as_str().into(),
            ready: c.ready,
            started: c.started,
            restart_count: c.restart_count,
            container_id: text(c.container_id.as_ref()),
            state: c.state.clone().map(Box::new),
            last_state: c.last_state.clone().map(Box::new),
        }
    }

    fn status(&self) -> ContainerStatus {
        ContainerStatus {
            name: self.name.to_string(),
            ready: self.ready,
            started: self.started,
            restart_count: self.restart_count,
            container_id: string(self.container_id.as_ref()),
            state: self.state.as_deref().cloned(),
            last_state: self.last_state.as_deref().cloned(),
            ..ContainerStatus::default()
        }
    }
}

impl KeptSecretVolume {
    fn of(volume: &Volume) -> Option<Self> {
        let s = volume.secret.as_ref()?;
        Some(Self {
            volume: volume.name.as_str().into(),
            secret: text(s.secret_name.as_ref()),
            default_mode: s.default_mode,
            optional: s.optional,
            items: s.items.as_ref().map(|items| {
                items
                    .iter()
                    .map(|i| (i.key.as_str().into(), i.path.as_str().into(), i.mode))
                    .collect()
            }),
        })
    }

    fn volume(&self) -> Volume {
        Volume {
            name: self.volume.to_string(),
            secret: Some(SecretVolumeSource {
                secret_name: string(self.secret.as_ref()),
                default_mode: self.default_mode,
                optional: self.optional,
                items: self.items.as_ref().map(|items| {
                    items
                        .iter()
                        .map(|(key, path, mode)| KeyToPath {
                            key: key.to_string(),
                            path: path.to_string(),
                            mode: *mode,
                            ..KeyToPath::default()
                        })
                        .collect()
                }),
                ..SecretVolumeSource::default()
            }),
            ..Volume::default()
        }
    }
}

impl KeptStatus {
    fn of(s: &PodStatus) -> Self {
        let containers = |list: Option<&Vec<ContainerStatus>>| {
            list.map(|l| l.iter().map(KeptContainer::of).collect())
        };
        Self {
            phase: text(s.phase.as_ref()),
            reason: text(s.reason.as_ref()),
            message: text(s.message.as_ref()),
            pod_ip: text(s.pod_ip.as_ref()),
            host_ip: text(s.host_ip.as_ref()),
            start_time: s.start_time.clone(),
            containers: containers(s.container_statuses.as_ref()),
            init_containers: containers(s.init_container_statuses.as_ref()),
        }
    }

    fn status(&self) -> PodStatus {
        let containers = |list: Option<&Box<[KeptContainer]>>| {
            list.map(|l| l.iter().map(KeptContainer::status).collect())
        };
        PodStatus {
            phase: string(self.phase.as_ref()),
            reason: string(self.reason.as_ref()),
            message: string(self.message.as_ref()),
            pod_ip: string(self.pod_ip.as_ref()),
            host_ip: string(self.host_ip.as_ref()),
            start_time: self.start_time.clone(),
            container_statuses: containers(self.containers.as_ref()),
            init_container_statuses: containers(self.init_containers.as_ref()),
            ..PodStatus::default()
        }
    }
}

impl KeptPod {
    /// What is kept of `pod`.
    pub fn of(pod: &Pod) -> Self {
        let m = &pod.metadata;
        let spec = pod.spec.as_ref();
        let names = |list: Option<&Vec<Container>>| -> Box<[Text]> {
            list.into_iter()
                .flatten()
                .map(|c| c.name.as_str().into())
                .collect()
        };
        Self {
            name: m.name.as_deref().unwrap_or_default().into(),
            namespace: m.namespace.as_deref().unwrap_or_default().into(),
            uid: m.uid.as_deref().unwrap_or_default().into(),
            created: m.creation_timestamp.clone(),
            deleting: m.deletion_timestamp.clone(),
            labels: own(m.labels.as_ref()),
            annotations: own(m.annotations.as_ref()),
            node_name: text(spec.and_then(|s| s.node_name.as_ref())),
            containers: names(spec.map(|s| &s.containers)),
            init_containers: names(spec.and_then(|s| s.init_containers.as_ref())),
            secret_volumes: spec
                .and_then(|s| s.volumes.as_ref())
                .into_iter()
                .flatten()
                .filter_map(KeptSecretVolume::of)
                .collect(),
            status: pod.status.as_ref().map(|s| Box::new(KeptStatus::of(s))),
        }
    }

    /// A Pod carrying what was kept, for code that reads the API's Pod.
    pub fn pod(&self) -> Pod {
        let container = |name: &Text| Container {
            name: name.to_string(),
            ..Container::default()
        };
        let filled = |t: &Text| (!t.is_empty()).then(|| t.to_string());
        Pod {
            metadata: ObjectMeta {
                name: filled(&self.name),
                namespace: filled(&self.namespace),
                uid: filled(&self.uid),
                creation_timestamp: self.created.clone(),
                deletion_timestamp: self.deleting.clone(),
                labels: map_of(&self.labels),
                annotations: map_of(&self.annotations),
                ..ObjectMeta::default()
            },
            spec: Some(PodSpec {
                node_name: string(self.node_name.as_ref()),
                containers: self.containers.iter().map(container).collect(),
                init_containers: (!self.init_containers.is_empty())
                    .then(|| self.init_containers.iter().map(container).collect()),
                volumes: (!self.secret_volumes.is_empty()).then(|| {
                    self.secret_volumes
                        .iter()
                        .map(KeptSecretVolume::volume)
                        .collect()
                }),
                ..PodSpec::default()
            }),
            status: self.status.as_deref().map(KeptStatus::status),
        }
    }
}

/// Where a downstream Pod is: its namespace and name.
type Key = (Text, Text);

fn key_of(pod: &Pod) -> Key {
    (
        pod.metadata.namespace.as_deref().unwrap_or_default().into(),
        pod.metadata.name.as_deref().unwrap_or_default().into(),
    )
}

/// vkd's downstream Pods as the Pod watch last showed them (those with
/// vkd's owner label; whether each really is vkd's is judged on reading).
#[derive(Clone, Default)]
pub(crate) struct KeptPods {
    pods: Arc<RwLock<HashMap<Key, Arc<KeptPod>>>>,
}

impl KeptPods {
    pub(crate) fn get(&self, namespace: &str, name: &str) -> Option<Arc<KeptPod>> {
        let pods = self.pods.read().unwrap_or_else(PoisonError::into_inner);
        pods.get(&(namespace.into(), name.into())).cloned()
    }

    pub(crate) fn all(&self) -> Vec<Arc<KeptPod>> {
        let pods = self.pods.read().unwrap_or_else(PoisonError::into_inner);
        pods.values().cloned().collect()
    }

    pub(crate) fn apply(&self, pod: &Pod) {
        let kept = Arc::new(KeptPod::of(pod));
        let mut pods = self.pods.write().unwrap_or_else(PoisonError::into_inner);
        pods.insert(key_of(pod), kept);
    }

    pub(crate) fn delete(&self, pod: &Pod) {
        let mut pods = self.pods.write().unwrap_or_else(PoisonError::into_inner);
        pods.remove(&key_of(pod));
    }

    /// A whole listing replaces what was kept (a relist reports no deletions).
    pub(crate) fn replace(&self, listed: Relisted) {
        let mut pods = self.pods.write().unwrap_or_else(PoisonError::into_inner);
        *pods = listed.0;
    }
}

/// The Pods of a listing under way, kept aside until it is whole.
#[derive(Default)]
pub(crate) struct Relisted(HashMap<Key, Arc<KeptPod>>);

impl Relisted {
    pub(crate) fn apply(&mut self, pod: &Pod) {
        self.0.insert(key_of(pod), Arc::new(KeptPod::of(pod)));
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // a failed unwrap is a failed test
    use super::*;
    use serde_json::json;

    /// A downstream Pod as the watch shows it once Running: everything vkd
    /// reads back survives the keeping, and `status::instance`, the
    /// ownership check and the Secret refresh read the same from both.
    fn running() -> Pod {
        serde_json::from_value(json!({
            "metadata": {
                "name": "vkd-u1", "namespace": "vkd-team", "uid": "d1", "resourceVersion": "9",
                "creationTimestamp": "2026-01-01T00:00:00Z",
                "deletionTimestamp": "2026-01-01T00:01:00Z",
                "labels": {"vkd.io/owner-uid": "u1", "vkd.io/owner-node": "vk", "vkd.io/epoch": "3", "app": "web"},
                "annotations": {"vkd.io/owner-namespace": "team", "vkd.io/owner-name": "web",
                                "kubectl.kubernetes.io/last-applied-configuration": "{}"},
                "managedFields": [{"manager": "vkd", "operation": "Update"}]
            },
            "spec": {
                "nodeName": "host-a",
                "initContainers": [{"name": "setup", "image": "x"}],
                "containers": [{"name": "main", "image": "x", "env": [{"name": "A", "value": "b"}]},
                               {"name": "side", "image": "x"}],
                "volumes": [
                    {"name": "cfg", "secret": {"secretName": "vkd-u1-v0", "items": [{"key": "k", "path": "p", "mode": 420}]}},
                    {"name": "scratch", "emptyDir": {}}
                ],
                "tolerations": [{"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute"}]
            },
            "status": {
                "phase": "Running", "reason": "Evicted", "message": "low on memory",
                "podIP": "10.1.0.7", "hostIP": "10.0.0.1", "startTime": "2026-01-01T00:00:01Z",
                "conditions": [{"type": "Ready", "status": "True"}],
                "initContainerStatuses": [{"name": "setup", "image": "x", "imageID": "", "ready": true, "restartCount": 0,
                    "state": {"terminated": {"exitCode": 0, "reason": "Completed",
                        "startedAt": "2026-01-01T00:00:01Z", "finishedAt": "2026-01-01T00:00:02Z"}}}],
                "containerStatuses": [{"name": "main", "image": "x", "imageID": "sha", "ready": true, "restartCount": 2,
                    "started": true, "containerID": "process://abc",
                    "state": {"running": {"startedAt": "2026-01-01T00:00:03Z"}},
                    "lastState": {"terminated": {"exitCode": 137, "reason": "OOMKilled",
                        "finishedAt": "2026-01-01T00:00:02Z"}}}]
            }
        }))
        .unwrap()
    }

    #[test]
    fn what_vkd_reads_back_survives_the_keeping() {
        let pod = running();
        let back = KeptPod::of(&pod).pod();
        assert_eq!(
            crate::status::instance("down", &back),
            crate::status::instance("down", &pod)
        );
        assert!(crate::status::instance("down", &back).is_some());
        let m = &back.metadata;
        assert_eq!(m.name.as_deref(), Some("vkd-u1"));
        assert_eq!(m.namespace.as_deref(), Some("vkd-team"));
        assert_eq!(m.uid.as_deref(), Some("d1"));
        assert!(m.deletion_timestamp.is_some());
        assert_eq!(crate::owner_uid(&back), Some("u1"));
        // What the ownership check reads: vkd's own marks, nothing else.
        assert_eq!(m.labels.as_ref().unwrap().len(), 3);
        assert_eq!(
            m.annotations.as_ref().unwrap().keys().collect::<Vec<_>>(),
            ["vkd.io/owner-name", "vkd.io/owner-namespace"]
        );
        assert!(m.managed_fields.is_none());
        let volumes = [vkd_provider::Volume {
            name: "cfg".into(),
            source: vkd_provider::VolumeSource::Files {
                files: vec![vkd_provider::VolumeFile {
                    path: "p".into(),
                    data: b"new".to_vec(),
                    mode: 0o644,
                }],
            },
        }];
        assert_eq!(
            crate::translate::refreshed_secrets(&back, &volumes).unwrap(),
            crate::translate::refreshed_secrets(&pod, &volumes).unwrap()
        );
        assert_eq!(
            crate::translate::refreshed_secrets(&back, &volumes)
                .unwrap()
                .len(),
            1
        );
    }

    #[test]
    fn a_listing_replaces_what_was_kept() {
        let store = KeptPods::default();
        let pod = running();
        store.apply(&pod);
        assert!(store.get("vkd-team", "vkd-u1").is_some());
        let mut relisted = Relisted::default();
        let mut other = running();
        other.metadata.name = Some("vkd-u2".into());
        relisted.apply(&other);
        store.replace(relisted);
        assert!(store.get("vkd-team", "vkd-u1").is_none());
        assert_eq!(store.all().len(), 1);
        store.delete(&other);
        assert!(store.all().is_empty());
    }
}
