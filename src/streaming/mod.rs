//! Stream protocols of the kubelet API: SPDY/3.1 (exec, attach, port-forward
//! from the apiserver) and the remotecommand conventions on top of it.

pub mod remotecommand;
pub mod spdy;
pub mod websocket;
