//! The WebSocket channel-protocol decoder on any message.
#![no_main]

use bytes::Bytes;
use libfuzzer_sys::fuzz_target;
use vkd::streaming::websocket::{ChannelMessage, decode};

fuzz_target!(|data: &[u8]| {
    if let Ok(ChannelMessage::Data { payload, .. }) = decode(&Bytes::copy_from_slice(data)) {
        assert_eq!(payload.len() + 1, data.len());
    }
});
