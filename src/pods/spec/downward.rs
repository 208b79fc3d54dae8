//! What the downward API and projected volumes write: a Pod's fields and
//! resources as text, and volume files with their modes.

use super::*;
use k8s_openapi::api::core::v1::KeyToPath;
use std::collections::BTreeMap;
use vkd_provider::{VolumeFile, quantity};

pub(super) fn lossy(v: &[u8]) -> String {
    String::from_utf8_lossy(v).into_owned()
}

pub(super) fn field(fields: &BTreeMap<String, String>, path: &str) -> Result<String, ResolveError> {
    if let Some(v) = fields.get(path) {
        return Ok(v.clone());
    }
    if path.starts_with("metadata.labels[") || path.starts_with("metadata.annotations[") {
        return Ok(String::new());
    }
    Err(spec_error("InvalidSpec", format!("unsupported fieldRef {path:?}")).into())
}

/// A container's resource as the downward API reads it. As the kubelet's
/// `defaultPodLimitsForDownwardAPI`: a cpu or memory limit that is not set (or
/// zero) reads as the Pod-level limit, else as the node's allocatable; an unset
/// request reads as 0.
pub(super) fn resource_field(
    p: &Pending,
    container: &str,
    resource: &str,
    divisor: Option<&String>,
    allocatable: Option<Allocatable>,
) -> Result<String, ResolveError> {
    let bad = |e: quantity::QuantityError| {
        ResolveError::from(spec_error(
            "InvalidSpec",
            format!("resourceFieldRef {resource}: {e}"),
        ))
    };
    let is_zero = |v: &str| quantity::bytes(v).is_ok_and(|n| n == 0);
    let set = p
        .resources
        .get(container)
        .and_then(|r| r.get(resource).cloned());
    let defaulted = match resource.strip_prefix("limits.") {
        Some(name @ ("cpu" | "memory")) if set.as_deref().is_none_or(is_zero) => {
            let pod = p.pod_limits.get(name).filter(|v| !is_zero(v)).cloned();
            match (pod, allocatable) {
                (Some(v), _) => Some(v),
                (None, Some(a)) if name == "cpu" => Some(format!("{}m", a.cpu_millis)),
                (None, Some(a)) => Some(a.memory_bytes.to_string()),
                (None, None) => {
                    return Err(ResolveError::Config(format!(
                        "resourceFieldRef {resource}: container {container} sets no limit and \
                         the node's allocatable is not known yet"
                    )));
                }
            }
        }
        _ => None,
    };
    let value = defaulted.or(set).unwrap_or_else(|| "0".into());
    if resource.ends_with(".cpu") {
        let millis = quantity::cpu_millis(&value).map_err(bad)?;
        // The apiserver stores an unset divisor as "0"; like the kubelet, a zero
        // divisor means the default: one core, one byte.
        let div = divisor
            .map(|d| quantity::cpu_millis(d))
            .transpose()
            .map_err(bad)?
            .filter(|d| *d > 0)
            .unwrap_or(1000);
        Ok(millis.div_ceil(div).to_string())
    } else {
        let bytes = quantity::bytes(&value).map_err(bad)?;
        let div = divisor
            .map(|d| quantity::bytes(d))
            .transpose()
            .map_err(bad)?
            .filter(|d| *d > 0)
            .unwrap_or(1);
        Ok(bytes.div_ceil(div).to_string())
    }
}

pub(super) fn downward(
    fields: &BTreeMap<String, String>,
    p: &Pending,
    field_ref: Option<&k8s_openapi::api::core::v1::ObjectFieldSelector>,
    resource_ref: Option<&k8s_openapi::api::core::v1::ResourceFieldSelector>,
    allocatable: Option<Allocatable>,
) -> Result<String, ResolveError> {
    if let Some(f) = field_ref {
        return field(fields, &f.field_path);
    }
    if let Some(r) = resource_ref {
        let container = r.container_name.as_deref().unwrap_or_default();
        return resource_field(
            p,
            container,
            &r.resource,
            r.divisor.as_ref().map(|d| &d.0),
            allocatable,
        );
    }
    Err(spec_error(
        "InvalidSpec",
        "a downwardAPI item with neither fieldRef nor resourceFieldRef",
    )
    .into())
}

/// A relative file path inside a volume; `..` and absolute paths are refused.
pub(super) fn file(path: &str, data: Vec<u8>, mode: i32) -> Result<VolumeFile, ResolveError> {
    let ok = !path.is_empty()
        && !path.starts_with('/')
        && path.split('/').all(|s| !s.is_empty() && s != "..");
    if !ok {
        return Err(spec_error("InvalidSpec", format!("volume file path {path:?}")).into());
    }
    Ok(VolumeFile {
        path: path.to_owned(),
        data,
        mode: mode.max(0).unsigned_abs() & 0o777,
    })
}

/// Writes a ConfigMap's or Secret's keys as files, with the modes the Pod
/// gives (the API server defaults defaultMode to 0644), as the kubelet does: a
/// backend keeps other users out of the volume itself (the process provider's
/// volume directories are the Pod user's alone).
pub(super) fn project(
    files: &mut Vec<VolumeFile>,
    data: Option<BTreeMap<String, Vec<u8>>>,
    items: Option<&[KeyToPath]>,
    mode: i32,
    optional: Option<bool>,
    source: Source,
    name: &str,
) -> Result<(), ResolveError> {
    let Some(mut data) = data else {
        if optional.unwrap_or(false) {
            return Ok(());
        }
        return Err(ResolveError::Config(not_found(source, name)));
    };
    match items {
        None => {
            for (k, v) in data {
                files.push(file(&k, v, mode)?);
            }
        }
        Some(items) => {
            for it in items {
                let Some(v) = data.remove(&it.key) else {
                    if optional.unwrap_or(false) {
                        continue;
                    }
                    // The volume plugins' words.
                    return Err(ResolveError::Config(match source {
                        Source::ConfigMap => {
                            format!("configmap references non-existent config key: {}", it.key)
                        }
                        Source::Secret => {
                            format!("references non-existent secret key: {}", it.key)
                        }
                    }));
                };
                files.push(file(&it.path, v, it.mode.unwrap_or(mode))?);
            }
        }
    }
    Ok(())
}
