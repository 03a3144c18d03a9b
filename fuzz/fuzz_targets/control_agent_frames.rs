//! Agent → coordinator control-plane frames (what the coordinator decodes); see `drum_fuzz::control_frames`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    drum_fuzz::control_frames::<drum_common::protocol::wire::AgentMsg>(data);
});
