//! DASR datagrams between agents (v1, and v2 through a keyed guard); see `drum_fuzz::dasr_datagram`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    drum_fuzz::dasr_datagram(data);
});
