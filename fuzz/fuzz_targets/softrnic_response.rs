//! softrnic engine → provider response bodies; see `drum_fuzz::softrnic_response`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    drum_fuzz::softrnic_response(data);
});
