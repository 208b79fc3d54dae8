//! Service environment variables, as the kubelet gives every container:
//! `FOO_SERVICE_HOST`, `FOO_SERVICE_PORT`, `FOO_PORT_80_TCP` and the other
//! Docker-link variables for the Services of the Pod's namespace (unless
//! `enableServiceLinks: false`), and always those of the `kubernetes` Service
//! in `default`, which client-go's in-cluster config reads.
//!
//! Services come from one cached watch per daemon (a reflector, as the
//! kubelet's service lister), never a list per Pod.

use std::collections::BTreeMap;
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Service, ServicePort, ServiceSpec};
use kube::runtime::reflector::{self, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client};
use tokio_util::sync::CancellationToken;
use tracing::warn;

/// The namespace and names whose Services every Pod gets, as the kubelet's
/// `masterServices`.
const MASTER_NAMESPACE: &str = "default";
const MASTER_SERVICES: &[&str] = &["kubernetes"];

/// How long a resolve waits for the first list of Services before it reports
/// the container as not configurable (and is retried).
const FIRST_LIST_WAIT: Duration = Duration::from_secs(2);

/// The cached Services of the cluster; cheap to clone.
#[derive(Clone)]
pub struct Services {
    store: Store<Service>,
    /// True once the watch has listed. Not `Store::wait_until_ready`, which
    /// wakes only the last of the Pods that wait at once (kube-runtime 5:
    /// one oneshot receiver, one waker); the others slept out
    /// [`FIRST_LIST_WAIT`] and were retried.
    listed: tokio::sync::watch::Receiver<bool>,
}

impl std::fmt::Debug for Services {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Services")
            .field("cached", &self.store.len())
            .finish()
    }
}

/// Why no service environment could be built yet.
#[derive(Debug, thiserror::Error)]
#[error("services have not yet been read at least once, cannot construct envvars")]
pub struct NotSynced;

impl Services {
    /// Starts the watch; it runs until `shutdown`. The returned future is the
    /// watch itself, for the caller to supervise.
    pub fn watch(
        client: Client,
        shutdown: CancellationToken,
    ) -> (
        Self,
        impl Future<Output = Result<(), std::convert::Infallible>> + Send + 'static,
    ) {
        let api: Api<Service> = Api::all(client);
        Self::follow(
            watcher(api, watcher::Config::default()).default_backoff(),
            shutdown,
        )
    }

    /// The cache kept from `events` (a Service watch), and the future that
    /// keeps it.
    fn follow(
        events: impl futures::Stream<Item = watcher::Result<watcher::Event<Service>>> + Send + 'static,
        shutdown: CancellationToken,
    ) -> (
        Self,
        impl Future<Output = Result<(), std::convert::Infallible>> + Send + 'static,
    ) {
        let (store, writer) = reflector::store::<Service>();
        let (listed_tx, listed) = tokio::sync::watch::channel(false);
        let task = async move {
            // Only what the variables need is kept: a cluster's Services
            // stay in memory for as long as vkd runs.
            let stream = events.modify(slim).reflect(writer);
            let mut stream = std::pin::pin!(stream);
            loop {
                tokio::select! {
                    () = shutdown.cancelled() => return Ok(()),
                    e = stream.next() => match e {
                        None => {
                            shutdown.cancelled().await;
                            return Ok(());
                        }
                        Some(Err(e)) => warn!(error = %e, "service watch failed; retrying"),
                        Some(Ok(watcher::Event::InitDone)) => {
                            listed_tx.send_replace(true);
                        }
                        Some(Ok(_)) => {}
                    },
                }
            }
        };
        (Self { store, listed }, task)
    }

    /// A cache that already holds `services`, for tests.
    pub fn fixed(services: Vec<Service>) -> Self {
        let (store, mut writer) = reflector::store::<Service>();
        writer.apply_watcher_event(&watcher::Event::Init);
        for s in services {
            writer.apply_watcher_event(&watcher::Event::InitApply(s));
        }
        writer.apply_watcher_event(&watcher::Event::InitDone);
        // The store stays readable (and listed) once its writer is gone.
        drop(writer);
        let (_, listed) = tokio::sync::watch::channel(true);
        Self { store, listed }
    }

    /// The service variables of a Pod in `namespace`, sorted by name.
    pub async fn env(
        &self,
        namespace: &str,
        enable_service_links: bool,
    ) -> Result<Vec<(String, String)>, NotSynced> {
        let mut listed = self.listed.clone();
        if tokio::time::timeout(FIRST_LIST_WAIT, listed.wait_for(|l| *l))
            .await
            .map_or(true, |r| r.is_err())
        {
            return Err(NotSynced);
        }
        let state = self.store.state();
        Ok(service_env(
            state.iter().map(|s| &**s),
            namespace,
            enable_service_links,
        ))
    }
}

/// Drops what the variables do not need.
fn slim(s: &mut Service) {
    let m = &mut s.metadata;
    m.managed_fields = None;
    m.annotations = None;
    m.labels = None;
    m.owner_references = None;
    m.finalizers = None;
    let spec = s.spec.take().unwrap_or_default();
    s.spec = Some(ServiceSpec {
        cluster_ip: spec.cluster_ip,
        ports: spec.ports.map(|ports| {
            ports
                .into_iter()
                .map(|p| ServicePort {
                    name: p.name,
                    port: p.port,
                    protocol: p.protocol,
                    ..ServicePort::default()
                })
                .collect()
        }),
        ..ServiceSpec::default()
    });
    s.status = None;
}

/// The kubelet's `getServiceEnvVarMap` and `envvars.FromServices`: the
/// `kubernetes` Service of `default` always, the Services of `namespace` when
/// links are enabled (one of the same name there wins), none without a
/// cluster IP. Sorted by variable name.
pub fn service_env<'a>(
    services: impl IntoIterator<Item = &'a Service>,
    namespace: &str,
    enable_service_links: bool,
) -> Vec<(String, String)> {
    let mut chosen: BTreeMap<&str, &ServiceSpec> = BTreeMap::new();
    for s in services {
        let Some(spec) = s.spec.as_ref() else {
            continue;
        };
        let Some(ip) = spec.cluster_ip.as_deref() else {
            continue;
        };
        if ip.is_empty() || ip == "None" {
            continue;
        }
        let name = s.metadata.name.as_deref().unwrap_or_default();
        let ns = s.metadata.namespace.as_deref().unwrap_or_default();
        if ns == MASTER_NAMESPACE && MASTER_SERVICES.contains(&name) {
            chosen.entry(name).or_insert(spec);
        } else if ns == namespace && enable_service_links {
            chosen.insert(name, spec);
        }
    }
    let mut env = BTreeMap::new();
    for (name, spec) in chosen {
        let ip = spec.cluster_ip.as_deref().unwrap_or_default();
        let ports = spec.ports.as_deref().unwrap_or_default();
        let Some(first) = ports.first() else {
            continue;
        };
        let prefix = variable_name(name);
        env.insert(format!("{prefix}_SERVICE_HOST"), ip.to_owned());
        let port_var = format!("{prefix}_SERVICE_PORT");
        env.insert(port_var.clone(), first.port.to_string());
        for p in ports {
            if let Some(n) = p.name.as_deref().filter(|n| !n.is_empty()) {
                env.insert(
                    format!("{port_var}_{}", variable_name(n)),
                    p.port.to_string(),
                );
            }
        }
        // Docker link variables.
        for (i, p) in ports.iter().enumerate() {
            let protocol = p
                .protocol
                .as_deref()
                .filter(|p| !p.is_empty())
                .unwrap_or("TCP");
            let lower = protocol.to_lowercase();
            let host_port = if ip.contains(':') {
                format!("[{ip}]:{}", p.port)
            } else {
                format!("{ip}:{}", p.port)
            };
            let url = format!("{lower}://{host_port}");
            if i == 0 {
                env.insert(format!("{prefix}_PORT"), url.clone());
            }
            let port_prefix = format!("{prefix}_PORT_{}_{}", p.port, protocol.to_uppercase());
            env.insert(format!("{port_prefix}_PROTO"), lower);
            env.insert(format!("{port_prefix}_PORT"), p.port.to_string());
            env.insert(format!("{port_prefix}_ADDR"), ip.to_owned());
            env.insert(port_prefix, url);
        }
    }
    env.into_iter().collect()
}

/// `my-svc` → `MY_SVC`.
fn variable_name(name: &str) -> String {
    name.replace('-', "_").to_uppercase()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn svc(ns: &str, name: &str, ip: &str, ports: serde_json::Value) -> Service {
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": ns},
            "spec": {"clusterIP": ip, "ports": ports}
        }))
        .unwrap()
    }

    fn get<'a>(env: &'a [(String, String)], k: &str) -> Option<&'a str> {
        env.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str())
    }

    #[test]
    fn variables_follow_the_kubelet() {
        let all = [
            svc(
                "default",
                "kubernetes",
                "10.0.0.1",
                json!([{"name": "https", "port": 443}]),
            ),
            svc(
                "app",
                "foo-service",
                "10.0.0.7",
                json!([{"port": 8765}, {"name": "metrics", "port": 9090, "protocol": "UDP"}]),
            ),
            svc("app", "headless", "None", json!([{"port": 80}])),
            svc("app", "pending", "", json!([{"port": 80}])),
            svc("other", "elsewhere", "10.0.0.9", json!([{"port": 80}])),
            svc("app", "v6", "fd00::5", json!([{"port": 80}])),
        ];
        let env = service_env(&all, "app", true);
        let expect = [
            ("KUBERNETES_SERVICE_HOST", "10.0.0.1"),
            ("KUBERNETES_SERVICE_PORT", "443"),
            ("KUBERNETES_SERVICE_PORT_HTTPS", "443"),
            ("KUBERNETES_PORT", "tcp://10.0.0.1:443"),
            ("KUBERNETES_PORT_443_TCP", "tcp://10.0.0.1:443"),
            ("KUBERNETES_PORT_443_TCP_PROTO", "tcp"),
            ("KUBERNETES_PORT_443_TCP_PORT", "443"),
            ("KUBERNETES_PORT_443_TCP_ADDR", "10.0.0.1"),
            ("FOO_SERVICE_SERVICE_HOST", "10.0.0.7"),
            ("FOO_SERVICE_SERVICE_PORT", "8765"),
            ("FOO_SERVICE_SERVICE_PORT_METRICS", "9090"),
            ("FOO_SERVICE_PORT", "tcp://10.0.0.7:8765"),
            ("FOO_SERVICE_PORT_8765_TCP", "tcp://10.0.0.7:8765"),
            ("FOO_SERVICE_PORT_9090_UDP", "udp://10.0.0.7:9090"),
            ("FOO_SERVICE_PORT_9090_UDP_PROTO", "udp"),
            ("FOO_SERVICE_PORT_9090_UDP_ADDR", "10.0.0.7"),
            ("V6_PORT_80_TCP", "tcp://[fd00::5]:80"),
        ];
        for (k, v) in expect {
            assert_eq!(get(&env, k), Some(v), "{k} in {env:?}");
        }
        for absent in [
            "HEADLESS_SERVICE_HOST",
            "PENDING_SERVICE_HOST",
            "ELSEWHERE_SERVICE_HOST",
        ] {
            assert_eq!(get(&env, absent), None, "{absent}");
        }
        let mut sorted = env.clone();
        sorted.sort();
        assert_eq!(env, sorted);
    }

    #[test]
    fn without_links_only_the_master_service_remains() {
        let all = [
            svc(
                "default",
                "kubernetes",
                "10.0.0.1",
                json!([{"name": "https", "port": 443}]),
            ),
            svc("default", "other", "10.0.0.2", json!([{"port": 80}])),
            svc("app", "foo", "10.0.0.7", json!([{"port": 80}])),
        ];
        let env = service_env(&all, "app", false);
        assert_eq!(get(&env, "KUBERNETES_SERVICE_HOST"), Some("10.0.0.1"));
        assert_eq!(get(&env, "FOO_SERVICE_HOST"), None);
        // A Pod in `default` without links still gets only the master service.
        let env = service_env(&all, "default", false);
        assert_eq!(get(&env, "OTHER_SERVICE_HOST"), None);
        assert_eq!(get(&env, "KUBERNETES_SERVICE_PORT"), Some("443"));
        // A Service named `kubernetes` in the Pod's namespace wins over the master's.
        let mine = svc("app", "kubernetes", "10.0.0.99", json!([{"port": 80}]));
        let env = service_env(all.iter().chain([&mine]), "app", true);
        assert_eq!(get(&env, "KUBERNETES_SERVICE_HOST"), Some("10.0.0.99"));
        let env = service_env([&mine].into_iter().chain(&all), "app", true);
        assert_eq!(get(&env, "KUBERNETES_SERVICE_HOST"), Some("10.0.0.99"));
    }

    /// Pods that wait for the first listing together all get their
    /// variables when it ends, not after `FIRST_LIST_WAIT` (kube's
    /// `wait_until_ready` woke only the last of them).
    #[tokio::test]
    async fn every_pod_waiting_for_the_first_listing_gets_it() {
        let (tx, events) = futures::channel::mpsc::unbounded();
        let (cache, task) = Services::follow(events, CancellationToken::new());
        tokio::spawn(task);
        let waiting: Vec<_> = (0..3)
            .map(|_| {
                let cache = cache.clone();
                tokio::spawn(async move { cache.env("x", true).await })
            })
            .collect();
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        let master = svc("default", "kubernetes", "10.0.0.1", json!([{"port": 443}]));
        for ev in [
            watcher::Event::Init,
            watcher::Event::InitApply(master),
            watcher::Event::InitDone,
        ] {
            tx.unbounded_send(Ok(ev)).unwrap();
        }
        for w in waiting {
            let env = tokio::time::timeout(FIRST_LIST_WAIT / 2, w)
                .await
                .expect("a Pod waited out FIRST_LIST_WAIT though the listing had ended")
                .unwrap()
                .unwrap();
            assert_eq!(get(&env, "KUBERNETES_SERVICE_HOST"), Some("10.0.0.1"));
        }
    }

    #[tokio::test]
    async fn the_cache_answers_once_listed() {
        let cache = Services::fixed(vec![svc(
            "default",
            "kubernetes",
            "10.0.0.1",
            json!([{"port": 443}]),
        )]);
        let env = cache.env("x", true).await.unwrap();
        assert_eq!(get(&env, "KUBERNETES_SERVICE_PORT"), Some("443"));
        let mut s = svc(
            "a",
            "b",
            "10.0.0.3",
            json!([{"port": 1, "targetPort": 8080}]),
        );
        s.metadata.annotations = Some([("k".into(), "v".into())].into());
        slim(&mut s);
        assert!(s.metadata.annotations.is_none());
        assert_eq!(s.spec.unwrap().ports.unwrap()[0].target_port, None);
    }
}
