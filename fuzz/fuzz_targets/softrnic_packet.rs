//! softrnic engine-to-engine UDP datagrams; see `drum_fuzz::softrnic_packet`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    drum_fuzz::softrnic_packet(data);
});
