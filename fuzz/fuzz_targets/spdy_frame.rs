//! Any bytes fed to the SPDY frame decoder give frames or an error, never a
//! panic, and a decoded frame encodes back to what was read.
#![no_main]

use bytes::BytesMut;
use libfuzzer_sys::fuzz_target;
use vkd::streaming::spdy::frame::Frame;

fuzz_target!(|data: &[u8]| {
    let mut buf = BytesMut::from(data);
    while let Ok(Some(frame)) = Frame::decode(&mut buf) {
        let mut out = BytesMut::new();
        frame.encode(&mut out);
        let again = Frame::decode(&mut out);
        if !matches!(frame, Frame::Unknown { .. } | Frame::Settings) {
            assert_eq!(again, Ok(Some(frame)));
        }
    }
});
