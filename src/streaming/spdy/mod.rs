//! SPDY/3.1 as the Kubernetes streaming protocols use it. No maintained Rust
//! crate serves it, so vkd carries its own: [`frame`] (the wire format),
//! [`headers`] (zlib-compressed header blocks), [`session`] (a server connection).

pub mod frame;
pub mod headers;
pub mod session;

/// Frames as a client writes them, for the tests of what serves SPDY.
#[cfg(test)]
pub(crate) mod testing {
    use bytes::{Bytes, BytesMut};

    use super::frame::{FLAG_FIN, Frame};
    use super::headers::HeaderEncoder;

    /// A SYN_STREAM that opens stream `id` with `headers`; with `fin`, the
    /// client sends nothing on it.
    pub(crate) fn syn(
        enc: &mut HeaderEncoder,
        id: u32,
        headers: &[(&str, &str)],
        fin: bool,
    ) -> Vec<u8> {
        let block = enc.encode(headers).unwrap();
        let mut b = BytesMut::new();
        Frame::SynStream {
            stream_id: id,
            associated: 0,
            priority: 0,
            flags: if fin { FLAG_FIN } else { 0 },
            block: block.into(),
        }
        .encode(&mut b);
        b.to_vec()
    }

    /// A DATA frame of `bytes` on stream `id`; with `fin`, its last.
    pub(crate) fn data(id: u32, bytes: &[u8], fin: bool) -> Vec<u8> {
        let mut b = BytesMut::new();
        Frame::Data {
            stream_id: id,
            flags: if fin { FLAG_FIN } else { 0 },
            data: Bytes::copy_from_slice(bytes),
        }
        .encode(&mut b);
        b.to_vec()
    }
}
