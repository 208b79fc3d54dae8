//! From a Pod to what a provider is told: the instance spec.
//!
//! Two steps. [`pending`] runs when the record is built, with no API calls: it
//! checks what can be checked from the Pod alone (resources, probes, volume
//! types) and keeps the little it needs to finish later. [`resolve`] runs just
//! before admission: it applies the node policy and reads the ConfigMaps,
//! Secrets and ServiceAccount tokens that env and volumes refer to, so a
//! provider never talks to the API server itself.//!
//! Split on its seams: [`policy`] (the node policy), [`pending`] (from the
//! Pod alone) and its [`container`]s, [`expand`] (`$(VAR)`), [`resolve`]
//! (the API's objects) and the [`downward`] API's files and fields.

/// Why a Pod spec cannot be turned into an instance spec.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{reason}: {message}")]
pub struct SpecError {
    pub reason: &'static str,
    pub message: String,
}

fn spec_error(reason: &'static str, message: impl Into<String>) -> SpecError {
    SpecError {
        reason,
        message: message.into(),
    }
}

mod container;
mod downward;
mod expand;
mod pending;
mod policy;
mod resolve;

use container::*;
use downward::*;
pub use expand::*;
pub use pending::*;
pub use policy::*;
pub use resolve::*;

#[cfg(test)]
mod tests;
