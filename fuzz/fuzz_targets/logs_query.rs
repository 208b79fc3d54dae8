//! The /containerLogs query parser accepts or rejects any string without panicking.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(q) = std::str::from_utf8(data) {
        let _ = vkd::kubelet_api::logs::parse_query(q);
        let _ = vkd::kubelet_api::logs::query_pairs(q);
    }
});
