//! The header-block decoder on hostile input: bounded output, no panic, and the
//! connection-long zlib context survives a bad block with an error.
#![no_main]

use libfuzzer_sys::fuzz_target;
use vkd::streaming::spdy::headers::{HeaderDecoder, HeaderEncoder};

fuzz_target!(|data: &[u8]| {
    let mut dec = HeaderDecoder::default();
    let (a, b) = data.split_at(data.len() / 2);
    let _ = dec.decode(a);
    let _ = dec.decode(b);
    // Valid blocks built from the input round-trip.
    if let Ok(text) = std::str::from_utf8(data) {
        let pairs: Vec<(&str, &str)> = text
            .split('\n')
            .filter_map(|l| l.split_once(':'))
            .filter(|(k, _)| !k.is_empty())
            .take(32)
            .collect();
        let mut enc = HeaderEncoder::default();
        let mut dec = HeaderDecoder::default();
        let block = enc.encode(&pairs).expect("encoding");
        let got = dec.decode(&block).expect("decoding what we encoded");
        assert_eq!(got.len(), pairs.len());
    }
});
