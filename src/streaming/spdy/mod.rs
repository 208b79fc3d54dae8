//! SPDY/3.1 as the Kubernetes streaming protocols use it. No maintained Rust
//! crate serves it, so vkd carries its own: [`frame`] (the wire format),
//! [`headers`] (zlib-compressed header blocks), [`session`] (a server connection).

pub mod frame;
pub mod headers;
pub mod session;
