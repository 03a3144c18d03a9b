//! Coordinator → agent control-plane frames (what an agent decodes); see `drum_fuzz::control_frames`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    drum_fuzz::control_frames::<drum_common::protocol::wire::CoordMsg>(data);
});
