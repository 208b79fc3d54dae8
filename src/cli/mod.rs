//! The commands a person runs beside the daemon: `vkd explain` against a
//! cluster, and `vkd provider-serve` / `vkd provider-conformance` for the
//! provider protocol. The daemon never imports this module; `vkd explain`
//! reads what the daemon serves (`crate::explain`'s answers) through the
//! kubelet API.

pub mod explain;
pub mod provider;
