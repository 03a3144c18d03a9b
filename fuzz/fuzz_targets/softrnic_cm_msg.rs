//! softrnic RDMA CM messages between programs; see `drum_fuzz::softrnic_cm_msg`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    drum_fuzz::softrnic_cm_msg(data);
});
