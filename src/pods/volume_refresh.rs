//! Keeping a running Pod's configMap, secret, downwardAPI and projected
//! volumes current, as the kubelet does: their ConfigMaps and Secrets are read
//! again every [`PERIOD`], and the downward API's labels and annotations as
//! soon as the Pod's change. The provider is asked to rewrite a volume only
//! when its content changed.
//!
//! The record keeps three numbers for a Pod that has such volumes, not the
//! volumes: a refresh reads the Pod itself, so the cost is a GET of the Pod
//! and of each object it names per Pod and period, for those Pods only.

use std::hash::{Hash, Hasher};
use std::time::{Duration, SystemTime};

use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use tracing::{debug, info, warn};
use vkd_provider::{ProviderError, Support, Volume, VolumeSource};

use super::cx::Cx;
use super::model::{PodRecord, Stamp, VolumeProgress};
use super::{ReconcileError, spec};

/// How often a running Pod's volume sources are read again: the kubelet's
/// sync period, with which its volumes follow their ConfigMaps and Secrets.
pub const PERIOD: Duration = super::model::VOLUME_PERIOD;

/// The digest of what `volumes` hold.
pub fn content_digest(volumes: &[Volume]) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    for v in volumes {
        if let VolumeSource::Files { files } = &v.source {
            v.name.hash(&mut h);
            for f in files {
                (&f.path, &f.data, f.mode).hash(&mut h);
            }
        }
    }
    h.finish()
}

/// The digest of the refreshable volumes' content in `created`, the spec an
/// instance was made from `pending`: so the first refresh rewrites nothing
/// that did not change.
pub fn created_digest(pending: &spec::Pending, created: &vkd_provider::InstanceSpec) -> u64 {
    let names: Vec<&str> = pending
        .volumes
        .iter()
        .filter(|v| spec::refreshable(v))
        .map(|v| v.name.as_str())
        .collect();
    let volumes: Vec<Volume> = created
        .volumes
        .iter()
        .filter(|v| names.contains(&v.name.as_str()))
        .cloned()
        .collect();
    content_digest(&volumes)
}

/// How long until the volumes are read again: at once when the Pod's labels
/// or annotations (`metadata`, as the watch saw them) changed since the last
/// read, else when due.
fn wait(metadata: std::num::NonZeroU64, refresh: &VolumeProgress, now: SystemTime) -> Duration {
    if refresh.metadata != metadata {
        return Duration::ZERO;
    }
    refresh.due.time().duration_since(now).unwrap_or_default()
}

impl Cx<'_> {
    /// Refreshes the volumes of a running Pod when due; returns how long until
    /// the next refresh (`None`: the Pod has nothing to refresh).
    pub(super) async fn refresh_volumes(
        &self,
        rec: &PodRecord,
    ) -> Result<Option<Duration>, ReconcileError> {
        let (Some(metadata), Some(refresh)) =
            (rec.volume_metadata, rec.progress.volumes.as_deref())
        else {
            return Ok(None);
        };
        if self.provider.capabilities().volumes != Support::Supported {
            return Ok(None);
        }
        let now = SystemTime::now();
        let left = wait(metadata, refresh, now);
        if !left.is_zero() {
            return Ok(Some(left));
        }
        let api: Api<Pod> = Api::namespaced(self.client.clone(), &rec.namespace);
        let Some(pod) = api.get_opt(&rec.name).await? else {
            return Ok(None);
        };
        if pod.metadata.uid.as_deref() != Some(&*rec.uid) {
            return Ok(None);
        }
        // From here on, whatever happens, the next read is a period away:
        // nothing here is retried faster than the kubelet would.
        let next: Stamp = (SystemTime::now() + PERIOD).into();
        let read = super::model::features::volume_metadata(&pod).unwrap_or(metadata);
        let postpone = |written: Option<u64>| {
            self.update(&rec.uid, |p| {
                if let Some(v) = p.volumes.as_deref_mut() {
                    v.due = next;
                    v.metadata = read;
                    v.written = written.or(v.written);
                }
            });
        };
        let volumes = match spec::pending(&pod, &self.settings.node) {
            Ok(pending) => self.resolver(&pending).await?.file_volumes(&pending).await,
            Err(e) => Err(spec::ResolveError::Spec(e)),
        };
        let volumes = match volumes {
            Ok(v) => v,
            Err(spec::ResolveError::Kube(e)) => return Err(e.into()),
            Err(e) => {
                // A source that went missing (not optional) keeps what the
                // volume holds, as on the kubelet.
                warn!(error = %e, "volume sources unreadable; keeping the volumes as they are");
                postpone(None);
                return Ok(Some(PERIOD));
            }
        };
        let digest = content_digest(&volumes);
        debug!(
            changed = refresh.written != Some(digest),
            "volume sources read"
        );
        if refresh.written == Some(digest) {
            postpone(None);
            return Ok(Some(PERIOD));
        }
        match self
            .provider
            .update_volumes(&self.fence(), &rec.uid, &volumes)
            .await
        {
            Ok(()) => {
                info!(volumes = volumes.len(), "volume content refreshed");
                postpone(Some(digest));
            }
            Err(ProviderError::NotFound { .. }) => return Ok(None),
            // Passing: retried with the queue's back-off. A newer replica: stop.
            Err(e @ (ProviderError::Transient { .. } | ProviderError::Fenced { .. })) => {
                return Err(e.into());
            }
            Err(e) => {
                warn!(error = %e, "the provider did not refresh the volumes; they keep their content");
                postpone(None);
            }
        }
        Ok(Some(PERIOD))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(labels: serde_json::Value, volumes: serde_json::Value) -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": "p", "namespace": "ns", "uid": "u", "labels": labels},
            "spec": {"containers": [{"name": "c"}], "volumes": volumes},
        }))
        .unwrap()
    }

    fn record(p: &Pod, now: SystemTime) -> PodRecord {
        crate::pods::status::record_of(p, "vk", now).unwrap()
    }

    #[test]
    fn only_pods_with_volumes_that_change_are_refreshed() {
        let now = SystemTime::now();
        let token_only = pod(
            json!({}),
            json!([{"name": "kube-api-access", "projected": {"sources": [
                {"serviceAccountToken": {"path": "token"}},
                {"configMap": {"name": "kube-root-ca.crt"}},
            ]}}]),
        );
        assert_eq!(record(&token_only, now).progress.volumes, None);
        let scratch = pod(json!({}), json!([{"name": "s", "emptyDir": {}}]));
        assert_eq!(record(&scratch, now).progress.volumes, None);
        let config = pod(
            json!({}),
            json!([{"name": "c", "configMap": {"name": "cm"}}]),
        );
        let r = record(&config, now);
        let v = r.progress.volumes.as_deref().unwrap();
        assert_eq!(
            v.due,
            Stamp::from(now + PERIOD),
            "first read one period after the start"
        );
        let left = wait(r.volume_metadata.unwrap(), v, now);
        assert!(
            left <= PERIOD && left > PERIOD - Duration::from_secs(1),
            "{left:?}"
        );
    }

    #[test]
    fn a_label_change_makes_the_refresh_due_at_once() {
        let start = SystemTime::now();
        let volumes = json!([{"name": "info", "downwardAPI": {"items": [
            {"path": "labels", "fieldRef": {"fieldPath": "metadata.labels"}}]}}]);
        let mut r = record(&pod(json!({"a": "1"}), volumes.clone()), start);
        r.progress.volumes.as_deref_mut().unwrap().written = Some(7);
        let later = start + Duration::from_secs(5);
        let same = pod(json!({"a": "1"}), volumes.clone());
        r.update(&same, "vk", crate::pods::status::observed_of(&same));
        let v = r.progress.volumes.as_deref().unwrap();
        let left = wait(r.volume_metadata.unwrap(), v, later);
        assert!(left > PERIOD - Duration::from_secs(6), "not due: {left:?}");
        let changed = pod(json!({"a": "2"}), volumes);
        r.update(&changed, "vk", crate::pods::status::observed_of(&changed));
        let v = r.progress.volumes.as_deref().unwrap();
        assert_eq!(wait(r.volume_metadata.unwrap(), v, later), Duration::ZERO);
        assert_eq!(v.written, Some(7), "what the volumes hold is still known");
    }

    #[test]
    fn the_content_digest_sees_every_byte() {
        let v = |data: &[u8]| Volume {
            name: "c".into(),
            source: VolumeSource::Files {
                files: vec![vkd_provider::VolumeFile {
                    path: "k".into(),
                    data: data.to_vec(),
                    mode: 0o644,
                }],
            },
        };
        assert_eq!(content_digest(&[v(b"a")]), content_digest(&[v(b"a")]));
        assert_ne!(content_digest(&[v(b"a")]), content_digest(&[v(b"b")]));
    }
}
