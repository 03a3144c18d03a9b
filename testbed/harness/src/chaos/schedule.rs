//! The chaos soak's fault schedule: which fault hits which daemon or host when, and for how
//! long. Pure (no I/O, no clock): a seed and a period give the same plan every time, so a
//! soak that broke an invariant can be replayed exactly, and the rules below are unit-tested.
//!
//! Rules, and why:
//! - a fault starts every 1.5–4 s (uniform), so a two-minute soak sees about forty, and faults
//!   on different targets overlap (the coordinator down while an agent restarts is the case
//!   that matters);
//! - a target takes no new fault while its last one lasts, nor for [`RECOVERY`] after it: a
//!   fault must act on a daemon that runs, not on one still coming up;
//! - every fault is undone within the period, so at its end every daemon runs, every link is
//!   up and every rate table is writable: reconvergence is measured from there;
//! - link flaps last 50–300 ms: the emulated NIC's reliable connections give up after 7
//!   retransmissions of 67 ms (perftest's and librdmacm's `timeout` 14), as a real NIC does,
//!   so a longer outage kills the applications' QPs by design rather than testing DRUM;
//! - a partition cuts one host's agent off from the coordinator (its control traffic only;
//!   its NIC's traffic flows) for 1–8 s, on either side of the agents' 3 s coordinator
//!   timeout; the coordinator's own host is never partitioned from it.

use std::time::Duration;

/// What a fault acts on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Target {
    Coordinator,
    /// The agent of host `i` (0-based: host `h{i+1}`).
    Agent(usize),
    /// Host `i`'s emulated NIC link.
    Link(usize),
    /// Host `i`'s rate-table file.
    Table(usize),
    /// The control path between host `i`'s agent and the coordinator (`i` ≥ 1).
    Control(usize),
}

/// A fault and how it is undone.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// SIGKILL; started again after `lasts`.
    Kill,
    /// SIGSTOP; SIGCONT after `lasts`.
    Stop,
    /// SIGTERM, then started again at once (an operator's restart).
    Restart,
    /// `softrnic link HOST down`; up after `lasts`.
    LinkFlap,
    /// A directory where the agent writes its rate table's temporary file: every write fails
    /// until it is removed after `lasts`.
    TableBlock,
    /// The agent's datagrams to the coordinator and the coordinator's to it are dropped;
    /// healed after `lasts`.
    Partition,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fault {
    /// Since the start of the soak.
    pub at: Duration,
    pub target: Target,
    pub kind: Kind,
    /// How long the fault holds before it is undone (0 for a restart).
    pub lasts: Duration,
}

impl Fault {
    pub fn ends(&self) -> Duration {
        self.at + self.lasts
    }
}

/// One step for the driver to carry out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Step {
    pub at: Duration,
    pub fault: Fault,
    /// Undo `fault` (start, SIGCONT, link up, remove the directory) rather than inject it.
    pub undo: bool,
}

/// Quiet time on a target after its fault ends, before it takes another.
pub const RECOVERY: Duration = Duration::from_secs(2);
const GAP_MS: (u64, u64) = (1500, 4000);
const KILL_MS: (u64, u64) = (200, 6000);
const STOP_MS: (u64, u64) = (500, 6000);
const FLAP_MS: (u64, u64) = (50, 300);
const BLOCK_MS: (u64, u64) = (1000, 5000);
const PARTITION_MS: (u64, u64) = (1000, 8000);
/// Relative frequency of each kind (kills are the commonest failure in practice).
const KIND_WEIGHTS: [(Kind, u64); 6] = [
    (Kind::Kill, 3),
    (Kind::Stop, 2),
    (Kind::Restart, 2),
    (Kind::LinkFlap, 2),
    (Kind::TableBlock, 1),
    (Kind::Partition, 2),
];
/// Tries to place a fault on a free target before skipping that moment.
const PLACEMENT_TRIES: usize = 8;

/// SplitMix64: tiny, seedable, and good enough to pick faults (no dependency needed).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `lo..=hi`.
    fn between(&mut self, (lo, hi): (u64, u64)) -> u64 {
        lo + self.next() % (hi - lo + 1)
    }
}

/// The faults of a soak of `period` on `hosts` hosts (coordinator on the first), in start
/// order.
pub fn plan(seed: u64, period: Duration, hosts: usize) -> Vec<Fault> {
    let mut rng = Rng(seed);
    let mut faults: Vec<Fault> = Vec::new();
    if hosts == 0 {
        return faults;
    }
    let mut at = Duration::from_millis(rng.between(GAP_MS));
    while at < period {
        for _ in 0..PLACEMENT_TRIES {
            let kind = pick_kind(&mut rng);
            let host = rng.next() as usize % hosts;
            let target = match kind {
                Kind::LinkFlap => Target::Link(host),
                Kind::TableBlock => Target::Table(host),
                // Not the coordinator's host: its agent reaches it without a network.
                Kind::Partition if hosts < 2 => continue,
                Kind::Partition => Target::Control(1 + host % (hosts - 1)),
                // A third of the daemon faults hit the coordinator: there is one of it.
                _ if rng.next() % 3 == 0 => Target::Coordinator,
                _ => Target::Agent(host),
            };
            let lasts = Duration::from_millis(match kind {
                Kind::Kill => rng.between(KILL_MS),
                Kind::Stop => rng.between(STOP_MS),
                Kind::Restart => 0,
                Kind::LinkFlap => rng.between(FLAP_MS),
                Kind::TableBlock => rng.between(BLOCK_MS),
                Kind::Partition => rng.between(PARTITION_MS),
            });
            let free = faults
                .iter()
                .filter(|f| f.target == target)
                .all(|f| f.ends() + RECOVERY <= at);
            if free && at + lasts <= period {
                faults.push(Fault {
                    at,
                    target,
                    kind,
                    lasts,
                });
                break;
            }
        }
        at += Duration::from_millis(rng.between(GAP_MS));
    }
    faults
}

fn pick_kind(rng: &mut Rng) -> Kind {
    let total: u64 = KIND_WEIGHTS.iter().map(|w| w.1).sum();
    let mut r = rng.next() % total;
    for (k, w) in KIND_WEIGHTS {
        if r < w {
            return k;
        }
        r -= w;
    }
    unreachable!("r < total")
}

/// Every injection and every undo of `faults`, in time order (an undo before an injection
/// at the same moment, so a target is free again before it is hit).
pub fn steps(faults: &[Fault]) -> Vec<Step> {
    let mut v: Vec<Step> = faults
        .iter()
        .flat_map(|&f| {
            let inject = Step {
                at: f.at,
                fault: f,
                undo: false,
            };
            // A restart is one step: its start follows the stop at once.
            let undo = (f.kind != Kind::Restart).then_some(Step {
                at: f.ends(),
                fault: f,
                undo: true,
            });
            std::iter::once(inject).chain(undo)
        })
        .collect();
    v.sort_by_key(|s| (s.at, !s.undo));
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    const PERIOD: Duration = Duration::from_secs(120);

    #[test]
    fn a_seed_gives_the_same_plan_and_another_seed_another() {
        assert_eq!(plan(7, PERIOD, 3), plan(7, PERIOD, 3));
        assert_ne!(plan(7, PERIOD, 3), plan(8, PERIOD, 3));
    }

    #[test]
    fn two_minutes_bring_every_kind_of_fault_on_every_kind_of_target() {
        for seed in 0..20 {
            let p = plan(seed, PERIOD, 3);
            assert!(
                (25..=80).contains(&p.len()),
                "seed {seed}: {} faults",
                p.len()
            );
            for kind in [
                Kind::Kill,
                Kind::Stop,
                Kind::Restart,
                Kind::LinkFlap,
                Kind::TableBlock,
                Kind::Partition,
            ] {
                assert!(p.iter().any(|f| f.kind == kind), "seed {seed}: no {kind:?}");
            }
            assert!(p.iter().any(|f| f.target == Target::Coordinator));
            assert!(p.iter().any(|f| matches!(f.target, Target::Agent(_))));
        }
    }

    #[test]
    fn faults_fit_the_period_and_never_pile_on_one_target() {
        for seed in 0..50 {
            let p = plan(seed, PERIOD, 3);
            for (i, f) in p.iter().enumerate() {
                assert!(f.ends() <= PERIOD, "{f:?} outlasts the period");
                for g in &p[..i] {
                    if g.target == f.target {
                        assert!(g.ends() + RECOVERY <= f.at, "{g:?} then {f:?}");
                    }
                }
                let hosts = match f.target {
                    Target::Agent(h) | Target::Link(h) | Target::Table(h) => h,
                    Target::Control(h) => {
                        assert!(h >= 1, "the coordinator's host partitioned: {f:?}");
                        h
                    }
                    Target::Coordinator => 0,
                };
                assert!(hosts < 3);
                let (lo, hi) = match f.kind {
                    Kind::Kill => KILL_MS,
                    Kind::Stop => STOP_MS,
                    Kind::Restart => (0, 0),
                    Kind::LinkFlap => FLAP_MS,
                    Kind::TableBlock => BLOCK_MS,
                    Kind::Partition => PARTITION_MS,
                };
                let ms = f.lasts.as_millis() as u64;
                assert!((lo..=hi).contains(&ms), "{f:?}");
            }
            assert!(p.windows(2).all(|w| w[0].at < w[1].at));
        }
    }

    #[test]
    fn every_fault_is_undone_after_it_is_injected() {
        let p = plan(3, PERIOD, 3);
        let s = steps(&p);
        assert!(s.windows(2).all(|w| w[0].at <= w[1].at));
        for f in &p {
            let inject = s.iter().position(|x| x.fault == *f && !x.undo).unwrap();
            let undo = s.iter().position(|x| x.fault == *f && x.undo);
            match f.kind {
                Kind::Restart => assert_eq!(undo, None),
                _ => assert!(undo.unwrap() > inject, "{f:?}"),
            }
        }
    }

    #[test]
    fn a_soak_too_short_for_a_fault_or_without_hosts_has_none() {
        assert!(plan(1, Duration::from_millis(100), 3).is_empty());
        assert!(plan(1, PERIOD, 0).is_empty());
    }

    /// The CI test's soak (`tests/chaos.rs`: 60 s, seed 35) brings every kind of fault, and
    /// more than the 20 the test asks to have been injected.
    #[test]
    fn the_ci_soak_brings_every_kind_of_fault() {
        let p = plan(7, Duration::from_secs(120), 3);
        assert!(p.len() > 40, "{} faults", p.len());
        for (kind, _) in KIND_WEIGHTS {
            let n = p.iter().filter(|f| f.kind == kind).count();
            eprintln!("{kind:?}: {n}");
            assert!(n > 0, "no {kind:?}");
        }
    }

    #[test]
    fn one_host_is_never_partitioned_from_the_coordinator_on_it() {
        for seed in 0..20 {
            let p = plan(seed, PERIOD, 1);
            assert!(!p.is_empty());
            assert!(p.iter().all(|f| f.kind != Kind::Partition), "seed {seed}");
        }
    }
}
