//! Stream protocols of the kubelet API: SPDY/3.1 and WebSocket (exec, attach,
//! port-forward from the apiserver) and the remotecommand and port-forward
//! conventions on top of them.

pub mod portforward;
pub mod remotecommand;
pub mod spdy;
pub mod websocket;
