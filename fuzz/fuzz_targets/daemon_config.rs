//! The daemons' TOML configs through their real loaders (`AgentSettings::load`,
//! `ServeSettings::load`: read, parse, resolve paths, validate). Built only with the `configs`
//! feature (FUZZ_CONFIGS=1 scripts/fuzz.sh), since it links the QUIC/TLS daemons.
#![no_main]

use std::path::PathBuf;
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;

/// One file per fuzzing process, rewritten for each input (the loaders take a path).
fn path() -> &'static PathBuf {
    static P: OnceLock<PathBuf> = OnceLock::new();
    P.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("drum-fuzz-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temporary directory");
        dir.join("config.toml")
    })
}

fuzz_target!(|data: &[u8]| {
    std::fs::write(path(), data).expect("writing the config");
    if let Ok(s) = drum_agent::AgentSettings::load(path()) {
        assert!(s.heartbeat_ms > 0 && s.coordinator_timeout_ms > s.heartbeat_ms);
        assert!(s.backoff_min_ms > 0 && s.backoff_max_ms >= s.backoff_min_ms);
    }
    if let Ok(s) = drum_coordinator::server::ServeSettings::load(path()) {
        assert!(s.heartbeat_ms > 0 && s.member_timeout_ms > s.heartbeat_ms);
        assert!(s.round_deadline_ms > 0);
    }
});
