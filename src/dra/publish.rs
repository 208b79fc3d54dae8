//! Writes one Node's pools as ResourceSlices and keeps them following capacity.
//!
//! Only the leader runs it (it lives in the node agent, which runs only in a
//! term). Every write is conditional: a slice vkd has seen is replaced at the
//! resourceVersion it saw, a new one is created. So a deposed leader's write
//! still in flight fails rather than overwrite its successor's, and a new
//! leader, which lists the slices first, continues each pool at a generation
//! above the highest it finds. Any failed write makes the next sync list again.
//! Slices carry an owner reference to their Node, so the garbage collector
//! removes them with it.

use std::collections::BTreeMap;

use k8s_openapi::api::resource::v1::{ResourceSlice, ResourceSliceSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::api::{DeleteParams, ListParams, PostParams};
use kube::{Api, Client};
use tokio::sync::Mutex;
use tracing::{info, warn};
use vkd_provider::HostSlice;

use super::devices::{Layout, PoolSpec, pools, slice_name};
use super::{DraError, Settings};

/// What this publisher last wrote of one slice.
#[derive(Clone, Debug)]
struct Written {
    pool: String,
    generation: i64,
    resource_version: Option<String>,
    spec: ResourceSliceSpec,
}

#[derive(Debug, Default)]
struct State {
    /// The slices of this Node as last listed or written, by name.
    slices: BTreeMap<String, Written>,
    /// Whether `slices` may be behind the API server (first sync, a failed write).
    stale: bool,
    listed: bool,
}

/// What one sync found and did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Synced {
    /// Pools written at a new generation: (pool, generation).
    pub written: Vec<(String, i64)>,
    /// Slices deleted (a host gone, a pool that shrank).
    pub deleted: usize,
    /// Devices published in all pools.
    pub devices: usize,
    pub pools: usize,
}

pub struct Publisher {
    client: Client,
    metrics: Option<std::sync::Arc<crate::metrics::Metrics>>,
    settings: Settings,
    node: String,
    per_host: bool,
    state: Mutex<State>,
}

impl std::fmt::Debug for Publisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Publisher")
            .field("node", &self.node)
            .field("driver", &self.settings.driver)
            .finish_non_exhaustive()
    }
}

impl Publisher {
    pub fn new(client: Client, settings: Settings, node: String, per_host: bool) -> Self {
        Self {
            client,
            metrics: None,
            settings,
            node,
            per_host,
            state: Mutex::new(State::default()),
        }
    }

    /// Counts the published devices by pool on these metrics.
    pub fn with_metrics(mut self, metrics: std::sync::Arc<crate::metrics::Metrics>) -> Self {
        self.metrics = Some(metrics);
        self
    }

    fn layout(&self) -> Layout<'_> {
        Layout {
            node: &self.node,
            per_host: self.per_host,
            driver: &self.settings.driver,
        }
    }

    async fn list(&self, state: &mut State) -> Result<(), DraError> {
        let api: Api<ResourceSlice> = Api::all(self.client.clone());
        let fields = format!(
            "spec.nodeName={},spec.driver={}",
            self.node, self.settings.driver
        );
        let list = api
            .list(&ListParams::default().fields(&fields))
            .await
            .map_err(|source| DraError::Api {
                what: format!("listing the ResourceSlices of node {}", self.node),
                source,
            })?;
        state.slices = list
            .items
            .into_iter()
            .filter_map(|s| {
                let name = s.metadata.name.clone()?;
                Some((
                    name,
                    Written {
                        pool: s.spec.pool.name.clone(),
                        generation: s.spec.pool.generation,
                        resource_version: s.metadata.resource_version.clone(),
                        spec: s.spec,
                    },
                ))
            })
            .collect();
        state.stale = false;
        state.listed = true;
        Ok(())
    }

    fn object(&self, name: &str, node_uid: &str, spec: ResourceSliceSpec) -> ResourceSlice {
        ResourceSlice {
            metadata: ObjectMeta {
                name: Some(name.to_owned()),
                labels: Some(BTreeMap::from([(
                    "app.kubernetes.io/managed-by".to_owned(),
                    "vkd".to_owned(),
                )])),
                owner_references: Some(vec![OwnerReference {
                    api_version: "v1".into(),
                    kind: "Node".into(),
                    name: self.node.clone(),
                    uid: node_uid.to_owned(),
                    controller: Some(true),
                    block_owner_deletion: None,
                }]),
                ..Default::default()
            },
            spec,
        }
    }

    /// Brings the Node's slices to what `hosts` (its own hosts) say: each pool
    /// whose devices changed is written at its next generation, slices of
    /// hosts that are gone are deleted.
    pub async fn sync(&self, hosts: &[HostSlice], node_uid: &str) -> Result<Synced, DraError> {
        let mut state = self.state.lock().await;
        if state.stale || !state.listed {
            self.list(&mut state).await?;
        }
        let wanted = pools(&self.layout(), hosts, self.settings.binding_conditions);
        let result = self.apply(&mut state, &wanted, node_uid).await;
        if result.is_err() {
            state.stale = true;
        }
        result
    }

    async fn apply(
        &self,
        state: &mut State,
        wanted: &[PoolSpec],
        node_uid: &str,
    ) -> Result<Synced, DraError> {
        let api: Api<ResourceSlice> = Api::all(self.client.clone());
        let driver = &self.settings.driver;
        let mut synced = Synced {
            pools: wanted.len(),
            devices: wanted.iter().map(PoolSpec::devices).sum(),
            ..Default::default()
        };
        let mut keep = std::collections::BTreeSet::new();
        for pool in wanted {
            if let Some(m) = &self.metrics {
                m.dra_devices(&pool.pool, pool.devices());
            }
            let names: Vec<String> = (0..pool.slices.len())
                .map(|i| slice_name(driver, &pool.pool, i))
                .collect();
            keep.extend(names.iter().cloned());
            let current = state
                .slices
                .values()
                .filter(|w| w.pool == pool.pool)
                .map(|w| w.generation)
                .max();
            // Unchanged: every slice of the pool holds what is wanted, at one generation.
            let unchanged = current.is_some_and(|generation| {
                names.iter().zip(&pool.slices).all(|(name, spec)| {
                    state
                        .slices
                        .get(name)
                        .is_some_and(|w| w.generation == generation && same_content(&w.spec, spec))
                }) && state
                    .slices
                    .iter()
                    .filter(|(_, w)| w.pool == pool.pool)
                    .all(|(n, _)| names.contains(n))
            });
            if unchanged {
                continue;
            }
            let generation = current.unwrap_or(0).saturating_add(1);
            for (name, spec) in names.iter().zip(&pool.slices) {
                let mut spec = spec.clone();
                spec.pool.generation = generation;
                let mut object = self.object(name, node_uid, spec.clone());
                let written = match state.slices.get(name) {
                    Some(w) => {
                        object.metadata.resource_version = w.resource_version.clone();
                        api.replace(name, &PostParams::default(), &object).await
                    }
                    None => api.create(&PostParams::default(), &object).await,
                }
                .map_err(|source| DraError::Api {
                    what: format!("writing ResourceSlice {name} (pool {})", pool.pool),
                    source,
                })?;
                state.slices.insert(
                    name.clone(),
                    Written {
                        pool: pool.pool.clone(),
                        generation,
                        resource_version: written.metadata.resource_version,
                        spec,
                    },
                );
            }
            info!(pool = %pool.pool, host = %pool.host, generation, devices = pool.devices(), "ResourceSlices published");
            synced.written.push((pool.pool.clone(), generation));
        }
        // After the new generations are written: what no pool wants any more.
        let gone: Vec<String> = state
            .slices
            .keys()
            .filter(|n| !keep.contains(*n))
            .cloned()
            .collect();
        for name in gone {
            match api.delete(&name, &DeleteParams::default()).await {
                Ok(_) => {}
                Err(kube::Error::Api(e)) if e.code == 404 => {}
                Err(source) => {
                    return Err(DraError::Api {
                        what: format!("deleting ResourceSlice {name}"),
                        source,
                    });
                }
            }
            if let Some(m) = &self.metrics
                && let Some(w) = state.slices.get(&name)
                && !wanted.iter().any(|p| p.pool == w.pool)
            {
                m.dra_devices(&w.pool, 0);
            }
            if let Some(w) = state.slices.remove(&name) {
                warn!(slice = %name, pool = %w.pool, "ResourceSlice deleted: its host or devices are gone");
            }
            synced.deleted += 1;
        }
        Ok(synced)
    }
}

/// Whether two slice specs publish the same devices (generations aside).
fn same_content(a: &ResourceSliceSpec, b: &ResourceSliceSpec) -> bool {
    let strip = |s: &ResourceSliceSpec| {
        let mut s = s.clone();
        s.pool.generation = 0;
        s
    };
    strip(a) == strip(b)
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex as StdMutex};

    use serde_json::{Value, json};

    use super::*;
    use crate::testing::{Log, fake_api, status};
    use vkd_provider::Gpu;

    fn host(name: &str, n: usize) -> HostSlice {
        HostSlice {
            name: name.into(),
            gpus: (0..n)
                .map(|i| Gpu {
                    id: format!("{name}-gpu{i}"),
                    model: "H100".into(),
                    memory_mib: 81920,
                    free: true,
                    ..Default::default()
                })
                .collect(),
            max_pods: 110,
            ..Default::default()
        }
    }

    /// A tiny ResourceSlice store behind the fake API: list, create, replace
    /// (with resourceVersion checks) and delete.
    fn store(initial: Vec<Value>) -> (Client, Log, Arc<StdMutex<BTreeMap<String, Value>>>) {
        let objects: Arc<StdMutex<BTreeMap<String, Value>>> = Arc::new(StdMutex::new(
            initial
                .into_iter()
                .map(|o| (o["metadata"]["name"].as_str().unwrap().to_owned(), o))
                .collect(),
        ));
        let rv = Arc::new(std::sync::atomic::AtomicU64::new(100));
        let held = Arc::clone(&objects);
        let (client, log) = fake_api(move |req| {
            let mut objects = held.lock().unwrap();
            let name = req.path.rsplit('/').next().unwrap_or_default().to_owned();
            let next = || {
                rv.fetch_add(1, std::sync::atomic::Ordering::SeqCst)
                    .to_string()
            };
            match req.method.as_str() {
                "GET" => (
                    200,
                    json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSliceList",
                           "metadata": {}, "items": objects.values().cloned().collect::<Vec<_>>()}),
                ),
                "POST" => {
                    let mut o = req.body.clone();
                    let n = o["metadata"]["name"].as_str().unwrap().to_owned();
                    if objects.contains_key(&n) {
                        return status(409, "AlreadyExists");
                    }
                    o["metadata"]["resourceVersion"] = json!(next());
                    objects.insert(n, o.clone());
                    (201, o)
                }
                "PUT" => {
                    let mut o = req.body.clone();
                    let held_rv = objects
                        .get(&name)
                        .map(|h| h["metadata"]["resourceVersion"].clone());
                    if held_rv != Some(o["metadata"]["resourceVersion"].clone()) {
                        return status(409, "Conflict");
                    }
                    o["metadata"]["resourceVersion"] = json!(next());
                    objects.insert(name, o.clone());
                    (200, o)
                }
                "DELETE" => match objects.remove(&name) {
                    Some(o) => (200, o),
                    None => status(404, "NotFound"),
                },
                _ => status(405, "MethodNotAllowed"),
            }
        });
        (client, log, objects)
    }

    fn publisher(client: Client) -> Publisher {
        Publisher::new(
            client,
            Settings {
                driver: "gpu.vkd.io".into(),
                binding_conditions: false,
            },
            "vk".into(),
            false,
        )
    }

    fn generations(objects: &StdMutex<BTreeMap<String, Value>>) -> Vec<(String, i64)> {
        objects
            .lock()
            .unwrap()
            .iter()
            .map(|(n, o)| (n.clone(), o["spec"]["pool"]["generation"].as_i64().unwrap()))
            .collect()
    }

    #[tokio::test]
    async fn pools_follow_capacity_with_generation_bumps() {
        let (client, log, objects) = store(Vec::new());
        let p = publisher(client);
        let both = [host("host-a", 4), host("host-b", 4)];
        let s = p.sync(&both, "node-uid").await.unwrap();
        assert_eq!(s.devices, 8);
        assert_eq!(
            generations(&objects),
            [
                ("vk-host-a-gpu-vkd-io-0".to_owned(), 1),
                ("vk-host-b-gpu-vkd-io-0".to_owned(), 1)
            ]
        );
        let owner =
            objects.lock().unwrap()["vk-host-a-gpu-vkd-io-0"]["metadata"]["ownerReferences"][0]
                .clone();
        assert_eq!(owner["kind"], "Node");
        assert_eq!(owner["uid"], "node-uid");
        // Nothing changed: nothing written.
        let writes = log.lock().unwrap().len();
        assert_eq!(p.sync(&both, "node-uid").await.unwrap().written, []);
        assert_eq!(log.lock().unwrap().len(), writes);
        // A GPU goes: host-a's pool moves on; host-b's stays.
        let fewer = [host("host-a", 3), host("host-b", 4)];
        let s = p.sync(&fewer, "node-uid").await.unwrap();
        assert_eq!(s.written, [("vk-host-a".to_owned(), 2)]);
        // host-b goes: its slice is deleted.
        let s = p.sync(&fewer[..1], "node-uid").await.unwrap();
        assert_eq!(s.deleted, 1);
        assert_eq!(
            generations(&objects),
            [("vk-host-a-gpu-vkd-io-0".to_owned(), 2)]
        );
    }

    #[tokio::test]
    async fn a_new_leader_continues_above_the_highest_generation_and_a_stale_write_fails() {
        let (client, _log, objects) = store(Vec::new());
        let old = publisher(client.clone());
        old.sync(&[host("host-a", 4)], "node-uid").await.unwrap();
        old.sync(&[host("host-a", 3)], "node-uid").await.unwrap();
        // A new leader takes over: it lists, and writes the pool at generation 3.
        let new = publisher(client);
        let s = new.sync(&[host("host-a", 3)], "node-uid").await.unwrap();
        assert_eq!(s.written, [], "unchanged content is kept");
        let s = new.sync(&[host("host-a", 4)], "node-uid").await.unwrap();
        assert_eq!(s.written, [("vk-host-a".to_owned(), 3)]);
        // The deposed leader's late write is refused, and leaves the pool as it is.
        let err = old.sync(&[host("host-a", 1)], "node-uid").await;
        assert!(err.is_err(), "{err:?}");
        assert_eq!(
            generations(&objects),
            [("vk-host-a-gpu-vkd-io-0".to_owned(), 3)]
        );
        let devices = objects.lock().unwrap()["vk-host-a-gpu-vkd-io-0"]["spec"]["devices"]
            .as_array()
            .unwrap()
            .len();
        assert_eq!(devices, 4);
    }
}
