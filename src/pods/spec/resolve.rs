//! The second step, just before admission: the node policy applied and the
//! ConfigMaps, Secrets and tokens that env and volumes name read.

use std::collections::BTreeMap;

use super::*;
use k8s_openapi::api::authentication::v1::{BoundObjectReference, TokenRequest, TokenRequestSpec};
use k8s_openapi::api::core::v1::{ConfigMap, Secret, ServiceAccount, Volume as KubeVolume};
use kube::api::PostParams;
use kube::{Api, Client};
use vkd_provider::{ContainerSpec, InstanceSpec, Volume, VolumeSource, quantity};

/// A volume whose files vkd writes from the API's objects and the Pod's own
/// fields, which can change while the Pod runs: configMap, secret,
/// downwardAPI, and projected ones of those. A projected ServiceAccount token
/// is not refreshed with them (each read would request a new token), so a
/// volume that holds one keeps its first content.
pub fn refreshable(v: &KubeVolume) -> bool {
    let token = v
        .projected
        .iter()
        .flat_map(|p| p.sources.iter().flatten())
        .any(|s| s.service_account_token.is_some());
    !token
        && (v.config_map.is_some()
            || v.secret.is_some()
            || v.downward_api.is_some()
            || v.projected.is_some())
}

/// Reads what a pending spec refers to and returns the spec a provider gets.
/// `volumes` is whether the provider materializes volume content.
#[allow(missing_debug_implementations)]
pub struct Resolver<'a> {
    pub client: &'a Client,
    pub policy: &'a Policy,
    pub host_ip: &'a str,
    pub volumes: bool,
    /// The cluster's Services, for the service environment variables; `None`
    /// gives none (as a kubelet without an API server).
    pub services: Option<&'a crate::pods::services::Services>,
    /// The node's allocatable, for `resourceFieldRef`s of unset limits; needed
    /// only when [`Pending::reads_allocatable`].
    pub allocatable: Option<Allocatable>,
}

/// Where key/value content comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Source {
    ConfigMap,
    Secret,
}

/// The kubelet's words for a missing ConfigMap or Secret (the API's NotFound):
/// `configmap "name" not found`.
pub(super) fn not_found(source: Source, name: &str) -> String {
    let kind = match source {
        Source::ConfigMap => "configmap",
        Source::Secret => "secret",
    };
    format!("{kind} {name:?} not found")
}

/// A ConfigMap's or Secret's keys and bytes; `None` when it does not exist.
pub(super) type Data = Option<BTreeMap<String, Vec<u8>>>;

/// What one resolve already read, so each object is fetched once.
#[derive(Default)]
pub(super) struct Fetched(BTreeMap<(Source, String), Data>);

impl Resolver<'_> {
    pub async fn resolve(&self, p: &Pending) -> Result<InstanceSpec, ResolveError> {
        let ns = &p.spec.pod.namespace;
        let policy = self.policy;
        if !policy.allowed_namespaces.is_empty() && !policy.allowed_namespaces.contains(ns) {
            return Err(spec_error(
                "NamespaceNotAllowed",
                format!(
                    "node {} runs Pods only from namespaces {}",
                    p.spec.node,
                    policy.allowed_namespaces.join(", ")
                ),
            )
            .into());
        }
        check_host_access(policy, p)?;
        let mut fetched = Fetched::default();
        let mut spec = p.spec.clone();
        let fields = self.fields(p);
        let services = match self.services {
            Some(s) => s
                .env(ns, p.service_links)
                .await
                .map_err(|e| ResolveError::Config(e.to_string()))?,
            None => Vec::new(),
        };
        let mut all: Vec<&mut ContainerSpec> = spec
            .init_containers
            .iter_mut()
            .chain(spec.containers.iter_mut())
            .collect();
        for (c, declared) in all.iter_mut().zip(&p.env) {
            let env = self
                .env(ns, &c.name, declared, &fields, p, &services, &mut fetched)
                .await?;
            c.command = c.command.iter().map(|s| expand(s, &env)).collect();
            c.args = c.args.iter().map(|s| expand(s, &env)).collect();
            for (i, expr) in &declared.sub_path_exprs {
                let sub = expand_sub_path(expr, &env).map_err(ResolveError::Config)?;
                if let Some(m) = c.mounts.get_mut(*i) {
                    m.sub_path = Some(sub).filter(|s| !s.is_empty());
                }
            }
            c.env = env;
        }
        for v in &p.volumes {
            if self.volumes {
                let source = self.volume(ns, v, &fields, p, &mut fetched).await?;
                spec.volumes.push(Volume {
                    name: v.name.clone(),
                    source,
                });
            } else {
                // Nothing is read for a backend that does not use volume content,
                // but the policy still says what may be asked for.
                self.check_policy(v)?;
            }
        }
        Ok(spec)
    }

    /// The downward-API values of `p`, with the ones the node knows.
    fn fields(&self, p: &Pending) -> BTreeMap<String, String> {
        let mut fields = p.fields.clone();
        for f in [
            "status.hostIP",
            "status.hostIPs",
            "status.podIP",
            "status.podIPs",
        ] {
            fields.insert(f.into(), self.host_ip.to_owned());
        }
        fields
    }

    /// The [`refreshable`] volumes of `p` as they read now: what a running
    /// Pod's volumes are refreshed to.
    pub async fn file_volumes(&self, p: &Pending) -> Result<Vec<Volume>, ResolveError> {
        let fields = self.fields(p);
        let mut fetched = Fetched::default();
        let mut out = Vec::new();
        for v in p.volumes.iter().filter(|v| refreshable(v)) {
            let source = self
                .volume(&p.spec.pod.namespace, v, &fields, p, &mut fetched)
                .await?;
            out.push(Volume {
                name: v.name.clone(),
                source,
            });
        }
        Ok(out)
    }

    fn check_policy(&self, v: &KubeVolume) -> Result<(), SpecError> {
        let projected = v.projected.iter().flat_map(|p| p.sources.iter().flatten());
        let secret = v.secret.is_some()
            || projected
                .clone()
                .any(|s| s.secret.is_some() || s.service_account_token.is_some());
        let config_map =
            v.config_map.is_some() || projected.clone().any(|s| s.config_map.is_some());
        let refuse = |reason: &'static str, what: &str| {
            Err(spec_error(
                reason,
                format!(
                    "volume {}: the node policy hands no {what} to this backend",
                    v.name
                ),
            ))
        };
        if secret && !self.policy.allow_secrets {
            return refuse("SecretsNotAllowed", "Secrets or ServiceAccount tokens");
        }
        if config_map && !self.policy.allow_config_maps {
            return refuse("ConfigMapsNotAllowed", "ConfigMaps");
        }
        if v.host_path.is_some() && !self.policy.allow_host_path {
            return refuse("HostPathNotAllowed", "hostPath volumes");
        }
        Ok(())
    }

    /// The kubelet's `makeEnvironmentVariables`: envFrom, then env (which
    /// overrides it, and whose `$(VAR)`s read what came before and the service
    /// variables), then the service variables the Pod did not set itself.
    #[allow(clippy::too_many_arguments)]
    async fn env(
        &self,
        ns: &str,
        container: &str,
        declared: &ContainerEnv,
        fields: &BTreeMap<String, String>,
        p: &Pending,
        services: &[(String, String)],
        fetched: &mut Fetched,
    ) -> Result<Vec<(String, String)>, ResolveError> {
        let mut env: Vec<(String, String)> = Vec::new();
        let set = |env: &mut Vec<(String, String)>, k: String, v: String| {
            env.retain(|(n, _)| *n != k);
            env.push((k, v));
        };
        for from in &declared.env_from {
            let prefix = from.prefix.clone().unwrap_or_default();
            let (data, name, optional, what) = if let Some(r) = &from.config_map_ref {
                (
                    self.source(ns, &r.name, Source::ConfigMap, fetched).await?,
                    &r.name,
                    r.optional.unwrap_or(false),
                    Source::ConfigMap,
                )
            } else if let Some(r) = &from.secret_ref {
                (
                    self.source(ns, &r.name, Source::Secret, fetched).await?,
                    &r.name,
                    r.optional.unwrap_or(false),
                    Source::Secret,
                )
            } else {
                continue;
            };
            match data {
                Some(d) => {
                    for (k, v) in d {
                        set(&mut env, format!("{prefix}{k}"), lossy(&v));
                    }
                }
                None if optional => {}
                None => return Err(ResolveError::Config(not_found(what, name))),
            }
        }
        for e in &declared.env {
            let value = match &e.value_from {
                None => expand_with(e.value.as_deref().unwrap_or(""), |name| {
                    env.iter()
                        .rev()
                        .chain(services)
                        .find(|(k, _)| k == name)
                        .map(|(_, v)| v.as_str())
                }),
                Some(src) => {
                    let key_ref = src
                        .config_map_key_ref
                        .as_ref()
                        .map(|r| (Source::ConfigMap, &r.name, &r.key, r.optional))
                        .or_else(|| {
                            src.secret_key_ref
                                .as_ref()
                                .map(|r| (Source::Secret, &r.name, &r.key, r.optional))
                        });
                    if let Some((source, name, key, optional)) = key_ref {
                        let optional = optional.unwrap_or(false);
                        match self.source(ns, name, source, fetched).await? {
                            None if optional => continue,
                            None => return Err(ResolveError::Config(not_found(source, name))),
                            Some(mut data) => match data.remove(key.as_str()) {
                                Some(v) => lossy(&v),
                                None if optional => continue,
                                None => {
                                    return Err(ResolveError::Config(format!(
                                        "couldn't find key {key} in {source:?} {ns}/{name}"
                                    )));
                                }
                            },
                        }
                    } else if let Some(f) = &src.field_ref {
                        field(fields, &f.field_path)?
                    } else if let Some(r) = &src.resource_field_ref {
                        let of = r.container_name.as_deref().unwrap_or(container);
                        resource_field(
                            p,
                            of,
                            &r.resource,
                            r.divisor.as_ref().map(|d| &d.0),
                            self.allocatable,
                        )?
                    } else {
                        return Err(spec_error(
                            "InvalidSpec",
                            format!("env {} has a valueFrom this node does not support", e.name),
                        )
                        .into());
                    }
                }
            };
            set(&mut env, e.name.clone(), value);
        }
        let own: std::collections::HashSet<String> = env.iter().map(|(n, _)| n.clone()).collect();
        env.extend(services.iter().filter(|(k, _)| !own.contains(k)).cloned());
        Ok(env)
    }

    /// A ConfigMap's or Secret's content, if the node policy lets it reach the backend.
    async fn source(
        &self,
        ns: &str,
        name: &str,
        source: Source,
        fetched: &mut Fetched,
    ) -> Result<Data, ResolveError> {
        let (allowed, reason, what) = match source {
            Source::ConfigMap => (
                self.policy.allow_config_maps,
                "ConfigMapsNotAllowed",
                "ConfigMaps",
            ),
            Source::Secret => (self.policy.allow_secrets, "SecretsNotAllowed", "Secrets"),
        };
        if !allowed {
            return Err(spec_error(
                reason,
                format!("the node policy hands no {what} to this backend (wanted {name:?})"),
            )
            .into());
        }
        let cache_key = (source, name.to_owned());
        if let Some(d) = fetched.0.get(&cache_key) {
            return Ok(d.clone());
        }
        // Text and binary keys, as bytes.
        let merge = |text: Option<BTreeMap<String, String>>,
                     bytes: Option<BTreeMap<String, k8s_openapi::ByteString>>| {
            let mut out: BTreeMap<String, Vec<u8>> = text
                .unwrap_or_default()
                .into_iter()
                .map(|(k, v)| (k, v.into_bytes()))
                .collect();
            for (k, v) in bytes.unwrap_or_default() {
                out.insert(k, v.0);
            }
            out
        };
        let data = match source {
            Source::ConfigMap => Api::<ConfigMap>::namespaced(self.client.clone(), ns)
                .get_opt(name)
                .await?
                .map(|cm| merge(cm.data, cm.binary_data)),
            Source::Secret => Api::<Secret>::namespaced(self.client.clone(), ns)
                .get_opt(name)
                .await?
                // stringData is write-only in the API; data holds everything.
                .map(|s| merge(s.string_data, s.data)),
        };
        fetched.0.insert(cache_key, data.clone());
        Ok(data)
    }

    async fn token(
        &self,
        p: &Pending,
        audience: Option<&str>,
        expiration: Option<i64>,
    ) -> Result<Vec<u8>, ResolveError> {
        if !self.policy.allow_secrets {
            return Err(spec_error(
                "SecretsNotAllowed",
                "the node policy hands no credentials to this backend, and the Pod mounts a \
                 ServiceAccount token (set automountServiceAccountToken: false)",
            )
            .into());
        }
        let api: Api<ServiceAccount> = Api::namespaced(self.client.clone(), &p.spec.pod.namespace);
        let request = TokenRequest {
            spec: Some(TokenRequestSpec {
                audiences: audience.map(|a| vec![a.to_owned()]),
                expiration_seconds: Some(expiration.unwrap_or(3607)),
                bound_object_ref: Some(BoundObjectReference {
                    api_version: Some("v1".into()),
                    kind: Some("Pod".into()),
                    name: Some(p.spec.pod.name.clone()),
                    uid: Some(p.spec.pod.uid.clone()),
                }),
                ..Default::default()
            }),
            ..Default::default()
        };
        let made = api
            .create_token_request(&p.service_account, &PostParams::default(), &request)
            .await
            .map_err(|e| match e {
                kube::Error::Api(s) if s.code == 404 => ResolveError::Config(format!(
                    "serviceaccount {:?} not found",
                    p.service_account
                )),
                e => e.into(),
            })?;
        Ok(made
            .status
            .and_then(|s| s.token)
            .unwrap_or_default()
            .into_bytes())
    }

    async fn volume(
        &self,
        ns: &str,
        v: &KubeVolume,
        fields: &BTreeMap<String, String>,
        p: &Pending,
        fetched: &mut Fetched,
    ) -> Result<VolumeSource, ResolveError> {
        if let Some(e) = &v.empty_dir {
            let size_limit = e
                .size_limit
                .as_ref()
                .map(|q| quantity::bytes(&q.0))
                .transpose()
                .map_err(|e| spec_error("InvalidSpec", format!("volume {}: {e}", v.name)))?;
            return Ok(VolumeSource::EmptyDir {
                size_limit,
                memory: e.medium.as_deref() == Some("Memory"),
            });
        }
        if let Some(h) = &v.host_path {
            if !self.policy.allow_host_path {
                return Err(spec_error(
                    "HostPathNotAllowed",
                    format!("volume {}: the node policy does not allow hostPath", v.name),
                )
                .into());
            }
            return Ok(VolumeSource::HostPath {
                path: h.path.clone(),
            });
        }
        let mut files = Vec::new();
        if let Some(c) = &v.config_map {
            let data = self.source(ns, &c.name, Source::ConfigMap, fetched).await?;
            let mode = c.default_mode.unwrap_or(0o644);
            project(
                &mut files,
                data,
                c.items.as_deref(),
                mode,
                c.optional,
                Source::ConfigMap,
                &c.name,
            )?;
        } else if let Some(s) = &v.secret {
            let name = s.secret_name.clone().unwrap_or_default();
            let data = self.source(ns, &name, Source::Secret, fetched).await?;
            let mode = s.default_mode.unwrap_or(0o644);
            project(
                &mut files,
                data,
                s.items.as_deref(),
                mode,
                s.optional,
                Source::Secret,
                &name,
            )?;
        } else if let Some(d) = &v.downward_api {
            let mode = d.default_mode.unwrap_or(0o644);
            for item in d.items.iter().flatten() {
                let data = downward(
                    fields,
                    p,
                    item.field_ref.as_ref(),
                    item.resource_field_ref.as_ref(),
                    self.allocatable,
                )?;
                files.push(file(
                    &item.path,
                    data.into_bytes(),
                    item.mode.unwrap_or(mode),
                )?);
            }
        } else if let Some(pr) = &v.projected {
            let mode = pr.default_mode.unwrap_or(0o644);
            for src in pr.sources.iter().flatten() {
                if let Some(c) = &src.config_map {
                    let data = self.source(ns, &c.name, Source::ConfigMap, fetched).await?;
                    project(
                        &mut files,
                        data,
                        c.items.as_deref(),
                        mode,
                        c.optional,
                        Source::ConfigMap,
                        &c.name,
                    )?;
                } else if let Some(s) = &src.secret {
                    let data = self.source(ns, &s.name, Source::Secret, fetched).await?;
                    project(
                        &mut files,
                        data,
                        s.items.as_deref(),
                        mode,
                        s.optional,
                        Source::Secret,
                        &s.name,
                    )?;
                } else if let Some(d) = &src.downward_api {
                    for item in d.items.iter().flatten() {
                        let data = downward(
                            fields,
                            p,
                            item.field_ref.as_ref(),
                            item.resource_field_ref.as_ref(),
                            self.allocatable,
                        )?;
                        files.push(file(
                            &item.path,
                            data.into_bytes(),
                            item.mode.unwrap_or(mode),
                        )?);
                    }
                } else if let Some(t) = &src.service_account_token {
                    let token = self
                        .token(p, t.audience.as_deref(), t.expiration_seconds)
                        .await?;
                    files.push(file(&t.path, token, 0o600)?);
                } else {
                    return Err(spec_error(
                        "UnsupportedVolume",
                        format!(
                            "volume {}: a projected source this node does not support",
                            v.name
                        ),
                    )
                    .into());
                }
            }
        }
        Ok(VolumeSource::Files { files })
    }
}
