//! softrnic flow-steering rules of raw-packet QPs; see `drum_fuzz::softrnic_flow_attr`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    drum_fuzz::softrnic_flow_attr(data);
});
