//! softrnic provider → engine request frames; see `drum_fuzz::softrnic_request`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    drum_fuzz::softrnic_request(data);
});
