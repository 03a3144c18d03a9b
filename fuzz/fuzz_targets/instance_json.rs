//! Instance files (JSON): parse, validate, write back; see `drum_fuzz::instance_json`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    drum_fuzz::instance_json(data);
});
