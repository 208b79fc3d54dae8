//! Dynamic Resource Allocation: vkd publishes its hosts' GPUs as
//! ResourceSlices ([`publish`]), so the real scheduler places GPU Pods by
//! topology, and is the kubelet side of an allocation (the create step reads
//! a Pod's claims and runs it on exactly the devices they hold). The mapping
//! both use is [`devices`]; docs/dra.md says it for a person.

mod allocated;
mod answer;
pub mod binding;
pub mod devices;
pub mod publish;

/// DRA as configured (`--dra`, `--dra-driver`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Settings {
    /// The driver name the slices and allocations carry (`gpu.vkd.io`).
    pub driver: String,
    /// Devices carry binding conditions: the scheduler binds a Pod only once
    /// the backend holds its placement ([`binding`]).
    pub binding_conditions: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum DraError {
    #[error("{what}: {source}")]
    Api {
        what: String,
        #[source]
        source: kube::Error,
    },
    #[error("the Pod's spec: {0}")]
    Spec(String),
    #[error("the provider: {0}")]
    Provider(String),
}
