//! SPDY/3.1 frames: decoding from a byte buffer and encoding into one.
//!
//! The decoder is incremental (it returns `Ok(None)` until a whole frame is
//! buffered) and bounded: a frame longer than [`MAX_FRAME_LEN`] or of another
//! version is an error, never an allocation of what the peer claims.

use bytes::{BufMut, Bytes, BytesMut};

pub const FLAG_FIN: u8 = 0x01;

/// The largest frame payload accepted. Real peers send frames of at most 32 KiB
/// of data; this leaves room and bounds memory.
pub const MAX_FRAME_LEN: usize = 1 << 20;

pub const TYPE_SYN_STREAM: u16 = 1;
pub const TYPE_SYN_REPLY: u16 = 2;
pub const TYPE_RST_STREAM: u16 = 3;
pub const TYPE_SETTINGS: u16 = 4;
pub const TYPE_PING: u16 = 6;
pub const TYPE_GOAWAY: u16 = 7;
pub const TYPE_HEADERS: u16 = 8;
pub const TYPE_WINDOW_UPDATE: u16 = 9;

/// RST_STREAM status codes used here.
pub const RST_PROTOCOL_ERROR: u32 = 1;
pub const RST_CANCEL: u32 = 5;
/// GOAWAY status codes.
pub const GOAWAY_OK: u32 = 0;
pub const GOAWAY_PROTOCOL_ERROR: u32 = 1;

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Frame {
    Data {
        stream_id: u32,
        flags: u8,
        data: Bytes,
    },
    SynStream {
        stream_id: u32,
        associated: u32,
        priority: u8,
        flags: u8,
        block: Bytes,
    },
    SynReply {
        stream_id: u32,
        flags: u8,
        block: Bytes,
    },
    RstStream {
        stream_id: u32,
        status: u32,
    },
    Settings,
    Ping {
        id: u32,
    },
    GoAway {
        last_good: u32,
        status: u32,
    },
    Headers {
        stream_id: u32,
        flags: u8,
        block: Bytes,
    },
    WindowUpdate {
        stream_id: u32,
        delta: u32,
    },
    /// A control frame type this implementation ignores.
    Unknown {
        kind: u16,
    },
}

#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    #[error("SPDY version {0} is not 3")]
    Version(u16),
    #[error("frame of {0} bytes exceeds the {MAX_FRAME_LEN} byte limit")]
    TooLarge(usize),
    #[error("control frame type {kind} is {len} bytes, too short")]
    Short { kind: u16, len: usize },
}

fn u31(b: &[u8]) -> u32 {
    u32::from_be_bytes([b[0] & 0x7f, b[1], b[2], b[3]])
}

fn u32be(b: &[u8]) -> u32 {
    u32::from_be_bytes([b[0], b[1], b[2], b[3]])
}

impl Frame {
    /// Decodes one frame from the front of `buf`, consuming it; `Ok(None)` if
    /// more bytes are needed.
    pub fn decode(buf: &mut BytesMut) -> Result<Option<Frame>, FrameError> {
        if buf.len() < 8 {
            return Ok(None);
        }
        let len = (usize::from(buf[5]) << 16) | (usize::from(buf[6]) << 8) | usize::from(buf[7]);
        if len > MAX_FRAME_LEN {
            return Err(FrameError::TooLarge(len));
        }
        let control = buf[0] & 0x80 != 0;
        if control {
            let version = u16::from_be_bytes([buf[0] & 0x7f, buf[1]]);
            if version != 3 {
                return Err(FrameError::Version(version));
            }
        }
        if buf.len() < 8 + len {
            return Ok(None);
        }
        let head = buf.split_to(8);
        let payload = buf.split_to(len).freeze();
        let flags = head[4];
        if !control {
            return Ok(Some(Frame::Data {
                stream_id: u31(&head[0..4]),
                flags,
                data: payload,
            }));
        }
        let kind = u16::from_be_bytes([head[2], head[3]]);
        let need = match kind {
            TYPE_SYN_STREAM => 10,
            TYPE_SYN_REPLY | TYPE_HEADERS | TYPE_PING => 4,
            TYPE_RST_STREAM | TYPE_GOAWAY | TYPE_WINDOW_UPDATE => 8,
            TYPE_SETTINGS => 4,
            _ => 0,
        };
        if len < need {
            return Err(FrameError::Short { kind, len });
        }
        let p = &payload[..];
        Ok(Some(match kind {
            TYPE_SYN_STREAM => Frame::SynStream {
                stream_id: u31(&p[0..4]),
                associated: u31(&p[4..8]),
                priority: p[8] >> 5,
                flags,
                block: payload.slice(10..),
            },
            TYPE_SYN_REPLY => Frame::SynReply {
                stream_id: u31(&p[0..4]),
                flags,
                block: payload.slice(4..),
            },
            TYPE_HEADERS => Frame::Headers {
                stream_id: u31(&p[0..4]),
                flags,
                block: payload.slice(4..),
            },
            TYPE_RST_STREAM => Frame::RstStream {
                stream_id: u31(&p[0..4]),
                status: u32be(&p[4..8]),
            },
            TYPE_SETTINGS => Frame::Settings,
            TYPE_PING => Frame::Ping {
                id: u32be(&p[0..4]),
            },
            TYPE_GOAWAY => Frame::GoAway {
                last_good: u31(&p[0..4]),
                status: u32be(&p[4..8]),
            },
            TYPE_WINDOW_UPDATE => Frame::WindowUpdate {
                stream_id: u31(&p[0..4]),
                delta: u31(&p[4..8]),
            },
            other => Frame::Unknown { kind: other },
        }))
    }

    /// Appends the wire form of the frame to `out`. Payloads must fit [`MAX_FRAME_LEN`].
    pub fn encode(&self, out: &mut BytesMut) {
        let control = |out: &mut BytesMut, kind: u16, flags: u8, len: usize| {
            out.put_u16(0x8003);
            out.put_u16(kind);
            out.put_u8(flags);
            put_u24(out, len);
        };
        match self {
            Frame::Data {
                stream_id,
                flags,
                data,
            } => {
                out.put_u32(stream_id & 0x7fff_ffff);
                out.put_u8(*flags);
                put_u24(out, data.len());
                out.put_slice(data);
            }
            Frame::SynStream {
                stream_id,
                associated,
                priority,
                flags,
                block,
            } => {
                control(out, TYPE_SYN_STREAM, *flags, 10 + block.len());
                out.put_u32(stream_id & 0x7fff_ffff);
                out.put_u32(associated & 0x7fff_ffff);
                out.put_u8(priority << 5);
                out.put_u8(0);
                out.put_slice(block);
            }
            Frame::SynReply {
                stream_id,
                flags,
                block,
            } => {
                control(out, TYPE_SYN_REPLY, *flags, 4 + block.len());
                out.put_u32(stream_id & 0x7fff_ffff);
                out.put_slice(block);
            }
            Frame::Headers {
                stream_id,
                flags,
                block,
            } => {
                control(out, TYPE_HEADERS, *flags, 4 + block.len());
                out.put_u32(stream_id & 0x7fff_ffff);
                out.put_slice(block);
            }
            Frame::RstStream { stream_id, status } => {
                control(out, TYPE_RST_STREAM, 0, 8);
                out.put_u32(stream_id & 0x7fff_ffff);
                out.put_u32(*status);
            }
            Frame::Settings => {
                control(out, TYPE_SETTINGS, 0, 4);
                out.put_u32(0);
            }
            Frame::Ping { id } => {
                control(out, TYPE_PING, 0, 4);
                out.put_u32(*id);
            }
            Frame::GoAway { last_good, status } => {
                control(out, TYPE_GOAWAY, 0, 8);
                out.put_u32(last_good & 0x7fff_ffff);
                out.put_u32(*status);
            }
            Frame::WindowUpdate { stream_id, delta } => {
                control(out, TYPE_WINDOW_UPDATE, 0, 8);
                out.put_u32(stream_id & 0x7fff_ffff);
                out.put_u32(delta & 0x7fff_ffff);
            }
            Frame::Unknown { .. } => {}
        }
    }
}

fn put_u24(out: &mut BytesMut, len: usize) {
    let len = u32::try_from(len).unwrap_or(u32::MAX).min(0x00ff_ffff);
    out.put_u8((len >> 16) as u8);
    out.put_u16((len & 0xffff) as u16);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn roundtrip(f: Frame) {
        let mut buf = BytesMut::new();
        f.encode(&mut buf);
        let mut half = buf.split_to(buf.len() / 2);
        assert_eq!(
            Frame::decode(&mut half.clone()),
            Ok(None),
            "partial frame must wait"
        );
        half.unsplit(buf);
        assert_eq!(Frame::decode(&mut half), Ok(Some(f)));
        assert!(half.is_empty());
    }

    #[test]
    fn frames_roundtrip() {
        roundtrip(Frame::Data {
            stream_id: 5,
            flags: FLAG_FIN,
            data: Bytes::from_static(b"hello"),
        });
        roundtrip(Frame::SynStream {
            stream_id: 1,
            associated: 0,
            priority: 3,
            flags: 0,
            block: Bytes::from_static(b"abc"),
        });
        roundtrip(Frame::SynReply {
            stream_id: 1,
            flags: 0,
            block: Bytes::from_static(b"x"),
        });
        roundtrip(Frame::RstStream {
            stream_id: 3,
            status: RST_CANCEL,
        });
        roundtrip(Frame::Ping { id: 7 });
        roundtrip(Frame::GoAway {
            last_good: 9,
            status: GOAWAY_OK,
        });
        roundtrip(Frame::WindowUpdate {
            stream_id: 1,
            delta: 1000,
        });
    }

    #[test]
    fn hostile_frames_are_errors() {
        let mut huge = BytesMut::from(&[0x80, 3, 0, 1, 0, 0xff, 0xff, 0xff][..]);
        assert_eq!(
            Frame::decode(&mut huge),
            Err(FrameError::TooLarge(0xff_ffff))
        );
        let mut v2 = BytesMut::from(&[0x80, 2, 0, 1, 0, 0, 0, 0][..]);
        assert_eq!(Frame::decode(&mut v2), Err(FrameError::Version(2)));
        let mut short = BytesMut::from(&[0x80, 3, 0, 1, 0, 0, 0, 2, 0, 0][..]);
        assert!(matches!(
            Frame::decode(&mut short),
            Err(FrameError::Short { .. })
        ));
    }
}
