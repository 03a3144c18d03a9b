//! The control-plane protocol between `drum-agent` and `drum-coordinator` as pure code: wire
//! messages and their framing ([`wire`]), and the two state machines ([`coordinator`],
//! [`agent`]). No sockets, threads or clocks: time comes in as an explicit `now` (a
//! [`Duration`](std::time::Duration) since an arbitrary origin), so every behaviour — timeouts,
//! round deadlines, bounded staleness, fail-static — is unit-tested deterministically and the
//! same machines run under QUIC in the daemons and in-process in simulations
//! (docs/control-plane.md).

pub mod agent;
pub mod coordinator;
pub mod relay;
pub mod reselect;
pub mod wire;

pub mod shard;

pub use wire::{AgentMsg, CoordMsg, FrameDecoder, Shard, WireError, MAX_FRAME, PROTOCOL_VERSION};

use crate::model::Problem;

/// The active sets the agents start from, where `solve` starts too: the greedy initial
/// selection at zero prices. It is deterministic, so every agent computes the same sets from the
/// shared instance without talking; selection exchanges change them from there
/// (docs/control-plane.md).
pub fn fixed_active_sets(problem: &Problem) -> Vec<Vec<usize>> {
    crate::selection::initial_active(problem, &vec![0.0; problem.facilities.len()])
}

/// A host or app name as configs and logs carry it: 1 to 64 bytes of letters, digits, `.`,
/// `_` and `-` (the rule of the shims' registration, `drum_table::message::valid_app`).
pub fn valid_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 64
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// The shard (of `count`) that owns the facility with this id: FNV-1a of the id, modulo
/// `count`. Every coordinator and agent computes it from the shared facility list alone.
pub fn shard_of(facility_id: &str, count: u32) -> u32 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in facility_id.bytes() {
        h ^= b as u64;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    (h % count.max(1) as u64) as u32
}

/// Identifies the facility numbering both sides index by: FNV-1a over the facility ids in
/// order. Agents and coordinator load their facilities from configuration; a mismatch would
/// silently mix up facilities, so a join with a different digest is refused.
pub fn facility_digest(problem: &Problem) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |b: u8| {
        h ^= b as u64;
        h = h.wrapping_mul(0x0100_0000_01b3);
    };
    for f in &problem.facilities {
        for b in f.id.bytes() {
            eat(b);
        }
        eat(0xff);
    }
    h
}

/// One agent per host with the given active sets and the timing the in-memory tests use.
#[cfg(test)]
pub(crate) fn test_agents(problem: &Problem, active: &[Vec<usize>]) -> Vec<agent::AgentCore> {
    let ms = std::time::Duration::from_millis(1);
    let cfg = agent::AgentConfig {
        heartbeat_interval: 100 * ms,
        coordinator_timeout: 1000 * ms,
        backoff_min: 10 * ms,
        backoff_max: 100 * ms,
    };
    active
        .iter()
        .enumerate()
        .map(|(h, a)| {
            agent::AgentCore::new(
                problem,
                crate::admm::HostState::new(problem, h, a.clone()),
                cfg.clone(),
            )
        })
        .collect()
}
