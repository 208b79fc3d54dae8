//! Pod status the way the kubelet writes it, from a backend instance.
//!
//! Two sides are reduced to one comparable [`StatusView`]: what the API server
//! holds (from the watch) and what the backend says now. A status patch is sent
//! only when the two views differ, so an unchanged Pod costs no write, also right
//! after a restart. Times are left out of the view: they ride along with a real
//! change, never cause one.

/// The annotation that names the backend instance of a Pod.
pub const INSTANCE_ID: &str = "vkd.io/instance-id";
/// The host slice the instance runs on (a downstream cluster's Node).
pub const HOST: &str = "vkd.io/host";
/// The annotation with the startup timeline.
pub const TIMELINE: &str = "vkd.io/timeline";

/// The conditions vkd owns (PodScheduled belongs to the scheduler).
pub use super::model::CONDITIONS;

pub mod ephemeral;
mod patch;
mod view;

pub use patch::*;
pub use view::*;

#[cfg(test)]
mod tests;
