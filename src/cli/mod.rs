//! The commands a person runs against a cluster, beside the daemon (`vkd
//! explain`). The daemon never imports this module; it reads what the daemon
//! serves (`crate::explain`'s answers) through the kubelet API.

pub mod explain;
