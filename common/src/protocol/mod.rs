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

/// The instance the selection tests run through the control plane (6 hosts × 8 apps, k = 2,
/// with swaps in its schedule), `solve`'s options for it (tight; the swap rounds only, as
/// the control plane runs them, not the verified search: docs/model.md) and its solution.
#[cfg(test)]
pub(crate) fn selection_case() -> (
    Problem,
    crate::solver::SolveOptions,
    crate::solver::Solution,
) {
    use crate::generator::{generate, GeneratorConfig};
    let problem = generate(&GeneratorConfig {
        k: 2,
        seed: 9,
        ..GeneratorConfig::new(6, 8)
    });
    let opts = crate::solver::SolveOptions {
        eps_primal: 1e-11,
        eps_dual: 1e-11,
        max_iter: 5000,
        certificate_iters: 0,
        polish_trials: 0,
        ..Default::default()
    };
    let solution = crate::solver::solve(&problem, &opts);
    assert!(solution.converged);
    let swaps: usize = solution.rounds.iter().map(|r| r.swaps).sum();
    assert!(swaps > 0, "the instance must exercise selection");
    (problem, opts, solution)
}

/// Every agent ended at `solution`'s active set and rates (to 1e-9).
#[cfg(test)]
pub(crate) fn assert_agents_match(agents: &[agent::AgentCore], solution: &crate::solver::Solution) {
    for (a, r) in agents.iter().zip(&solution.hosts) {
        assert_eq!(a.state().active, r.active, "host {}", r.host);
        for (x, y) in a.state().x.iter().zip(&r.x) {
            assert!((x - y).abs() < 1e-9, "host {}: {x} vs {y}", r.host);
        }
    }
}
