//! The agent's side of coordinator shards (docs/design.md §7): facilities are sharded by hash
//! ([`super::shard_of`]) across coordinator processes that share nothing, and an agent talks
//! to every shard that owns one of its facilities. [`ShardMux`] makes those shards look like
//! one coordinator to the unchanged [`super::agent::AgentCore`]:
//!
//! * **incoming**: a `Welcome`, `Round`, `Select`, `Verdict` or `Restart` is held until every
//!   shard has sent its own, then handed on merged (the union of the `d`s or prices; an
//!   activation is accepted when the shard owning its facility accepts it). The host thus steps
//!   only once it has every shard's round, and evaluates selection at every facility's price;
//! * **outgoing**: a message is split by facility owner, so each shard hears only about its
//!   facilities, and a contribution carries the number of the round *that shard* sent.
//!
//! With one shard the mux is the identity. Pure and deterministic, like the state machines.

use super::wire::{AgentMsg, ContributionMsg, CoordMsg, Join, ProposalMsg, SelectedMsg, Shard};
use crate::admm::FacilityTerm;
use crate::model::Problem;

/// How far apart (in iterations) the rounds of two shards may be when the mux merges them.
/// Shards in step differ by a few (one reused a straggler's contribution, the other waited);
/// a shard that restarted or ran on alone for a while may differ by more, which the next
/// exchange absorbs (the shard behind gets the host's last contribution for its rounds until
/// it reaches the exchange, see [`ShardMux::incoming`]) if it takes well under the member
/// timeout: 128 rounds are 1.3 s at the default 10 ms. Beyond it the agent rejoins every
/// shard with the highest round number it saw, on which they align
/// (`coordinator::Coordinator`'s joins).
pub const MAX_SKEW: u64 = 128;

/// A `Restart` held: its exchange and prices.
type Held = (u32, Vec<(u32, f64)>);

/// A round as one shard sent it.
#[derive(Clone, Debug, PartialEq)]
struct RoundIn {
    epoch: u64,
    iteration: u64,
    d: Vec<FacilityTerm>,
}

#[derive(Clone, Debug)]
pub struct ShardMux {
    count: u32,
    /// Owning shard of every facility.
    owner: Vec<u32>,
    /// The shards this host talks to, ascending; link `i` is shard `links[i]`.
    links: Vec<u32>,
    welcome: Vec<Option<(u64, u64)>>,
    rounds: Vec<Option<RoundIn>>,
    selects: Vec<Option<CoordMsg>>,
    verdicts: Vec<Option<(u32, bool)>>,
    restarts: Vec<Option<Held>>,
    /// `(epoch, iteration)` of the round each shard is being answered for.
    answering: Vec<(u64, u64)>,
    /// Key of the last merged round handed on: strictly increasing within a session.
    merged: (u64, u64),
    /// The highest round number any shard sent, across sessions: a join carries it, so that
    /// every shard can align its numbering with the one that counted furthest.
    seen: u64,
    /// Each link's last contribution (its facilities' entries), and the answers the mux
    /// gives on its own ([`Self::take_replies`]).
    last_entries: Vec<Option<Vec<(u32, f64)>>>,
    replies: Vec<(usize, AgentMsg)>,
}

impl ShardMux {
    /// The mux of host `host` among `count` shards.
    pub fn new(problem: &Problem, host: usize, count: u32) -> Self {
        let count = count.max(1);
        let owner: Vec<u32> = problem
            .facilities
            .iter()
            .map(|f| super::shard_of(&f.id, count))
            .collect();
        let mut links: Vec<u32> = problem.hosts[host]
            .pairs
            .clone()
            .flat_map(|p| problem.pairs[p].uses.iter().map(|u| owner[u.0 as usize]))
            .collect();
        links.sort_unstable();
        links.dedup();
        if links.is_empty() {
            links.push(0);
        }
        let n = links.len();
        Self {
            count,
            owner,
            links,
            welcome: vec![None; n],
            rounds: vec![None; n],
            selects: vec![None; n],
            verdicts: vec![None; n],
            restarts: vec![None; n],
            answering: vec![(0, 0); n],
            merged: (0, 0),
            seen: 0,
            last_entries: vec![None; n],
            replies: Vec::new(),
        }
    }

    /// Messages the mux answered on its own, to send on their links: a shard that is behind
    /// while another waits in an exchange gets the host's last contribution for each of its
    /// rounds, without a step (see [`Self::incoming`]).
    pub fn take_replies(&mut self) -> Vec<(usize, AgentMsg)> {
        std::mem::take(&mut self.replies)
    }

    /// The shard indices this host connects to, one link each.
    pub fn links(&self) -> &[u32] {
        &self.links
    }

    pub fn count(&self) -> u32 {
        self.count
    }

    /// A new session (all links reconnected): forget everything held.
    pub fn reset(&mut self) {
        let n = self.links.len();
        self.welcome = vec![None; n];
        self.rounds = vec![None; n];
        self.selects = vec![None; n];
        self.verdicts = vec![None; n];
        self.restarts = vec![None; n];
        self.answering = vec![(0, 0); n];
        self.merged = (0, 0);
        self.last_entries = vec![None; n];
        self.replies.clear();
    }

    fn mine(&self, link: usize, f: u32) -> bool {
        self.owner.get(f as usize) == Some(&self.links[link])
    }

    /// A message from link `link`: what the agent core should see now, if anything. An error
    /// is a shard mix-up (a coordinator serving another shard than configured).
    pub fn incoming(&mut self, link: usize, msg: CoordMsg) -> Result<Option<CoordMsg>, String> {
        if self.count == 1 {
            if let CoordMsg::Welcome { shard, .. } = &msg {
                if *shard != Shard::WHOLE {
                    return Err(format!(
                        "the coordinator serves shard {shard}, but no shards are configured"
                    ));
                }
            }
            return Ok(Some(msg));
        }
        Ok(match msg {
            CoordMsg::Refused { .. }
            | CoordMsg::HeartbeatAck { .. }
            | CoordMsg::SetWeight { .. }
            // The live problem has no shards (both daemons refuse the combination).
            | CoordMsg::Policy(_)
            | CoordMsg::Facilities(_)
            // Meant for relays, which have one upstream; the core refuses it.
            | CoordMsg::RackVerdicts { .. } => Some(msg),
            CoordMsg::Welcome {
                epoch: _,
                iteration,
                heartbeat_ms,
                shard,
            } => {
                let want = Shard {
                    index: self.links[link],
                    count: self.count,
                };
                if shard != want {
                    return Err(format!(
                        "the coordinator at link {link} serves shard {shard}, expected {want}"
                    ));
                }
                self.welcome[link] = Some((iteration, heartbeat_ms));
                if !self.welcome.iter().all(Option::is_some) {
                    return Ok(None);
                }
                let iteration = self.welcome.iter().flatten().map(|w| w.0).max();
                let heartbeat_ms = self.welcome.iter().flatten().map(|w| w.1).min();
                self.merged = (1, 0);
                Some(CoordMsg::Welcome {
                    epoch: 1,
                    iteration: iteration.unwrap_or(0),
                    heartbeat_ms: heartbeat_ms.unwrap_or(0),
                    shard: Shard::WHOLE,
                })
            }
            CoordMsg::Round { epoch, iteration, d } => {
                if d.iter().any(|e| !self.mine(link, e.facility)) {
                    return Err(format!(
                        "shard {} sent d for a foreign facility",
                        self.links[link]
                    ));
                }
                self.seen = self.seen.max(iteration);
                // Another shard waits in a selection exchange (its `Select` is held) while
                // this one sends rounds: this one is behind (their exchanges fall on the same
                // iteration numbers, see `reselect`). It gets the host's last contribution for
                // each round, as a straggler's would be reused, until it reaches the exchange
                // too; holding its round instead would stall both until the exchange's
                // timeout drops the host.
                let other_selecting = self
                    .selects
                    .iter()
                    .enumerate()
                    .any(|(j, s)| j != link && s.is_some());
                if let (true, Some(entries)) = (other_selecting, &self.last_entries[link]) {
                    self.replies.push((
                        link,
                        AgentMsg::Contribution(ContributionMsg {
                            epoch,
                            iteration,
                            entries: entries.clone(),
                        }),
                    ));
                    return Ok(None);
                }
                // A newer round of the same shard replaces one not yet stepped.
                self.rounds[link] = Some(RoundIn { epoch, iteration, d });
                if !self.rounds.iter().all(Option::is_some) {
                    return Ok(None);
                }
                let rounds: Vec<RoundIn> = self
                    .rounds
                    .iter_mut()
                    .map(|r| r.take().expect("all"))
                    .collect();
                let lo = rounds.iter().map(|r| r.iteration).min().unwrap_or(0);
                let hi = rounds.iter().map(|r| r.iteration).max().unwrap_or(0);
                if hi - lo > MAX_SKEW {
                    return Err(format!(
                        "the shards are out of step (rounds {lo} and {hi}): rejoining every shard at round {hi}"
                    ));
                }
                let mut merged_d: Vec<FacilityTerm> = Vec::new();
                for (i, r) in rounds.iter().enumerate() {
                    self.answering[i] = (r.epoch, r.iteration);
                    merged_d.extend_from_slice(&r.d);
                }
                merged_d.sort_unstable_by_key(|e| e.facility);
                let it = rounds.iter().map(|r| r.iteration).max().unwrap_or(0);
                // Strictly increasing keys, so the core steps every merged round once.
                let (mut ep, last) = self.merged;
                if it <= last {
                    ep += 1;
                }
                self.merged = (ep.max(1), it);
                Some(CoordMsg::Round {
                    epoch: self.merged.0,
                    iteration: it,
                    d: merged_d,
                })
            }
            CoordMsg::Select { exchange, .. } => {
                self.selects[link] = Some(msg);
                let same = self.selects.iter().all(
                    |s| matches!(s, Some(CoordMsg::Select { exchange: e, .. }) if *e == exchange),
                );
                if !same {
                    return Ok(None);
                }
                let mut prices: Vec<(u32, f64)> = Vec::new();
                let mut first = None;
                for s in self.selects.iter_mut() {
                    if let Some(CoordMsg::Select {
                        round,
                        prices: p,
                        options,
                        ..
                    }) = s.take()
                    {
                        prices.extend(p);
                        first.get_or_insert((round, options));
                    }
                }
                prices.sort_unstable_by_key(|e| e.0);
                let (round, options) = first.expect("at least one link");
                Some(CoordMsg::Select {
                    exchange,
                    round,
                    prices,
                    options,
                })
            }
            CoordMsg::Verdict { exchange, activate } => {
                self.verdicts[link] = Some((exchange, activate));
                if !self
                    .verdicts
                    .iter()
                    .all(|v| v.is_some_and(|v| v.0 == exchange))
                {
                    return Ok(None);
                }
                // Every shard checked the activation against its own facilities (see
                // `outgoing`), so it holds only if all of them accepted it.
                let activate = self
                    .verdicts
                    .iter_mut()
                    .all(|v| v.take().is_some_and(|v| v.1));
                Some(CoordMsg::Verdict { exchange, activate })
            }
            CoordMsg::Restart { exchange, prices } => {
                self.restarts[link] = Some((exchange, prices));
                if !self
                    .restarts
                    .iter()
                    .all(|r| r.as_ref().is_some_and(|r| r.0 == exchange))
                {
                    return Ok(None);
                }
                let mut prices: Vec<(u32, f64)> = self
                    .restarts
                    .iter_mut()
                    .flat_map(|r| r.take().expect("all").1)
                    .collect();
                prices.sort_unstable_by_key(|e| e.0);
                Some(CoordMsg::Restart { exchange, prices })
            }
        })
    }

    /// What each link must carry of a message of the agent core.
    pub fn outgoing(&mut self, msg: &AgentMsg) -> Vec<(usize, AgentMsg)> {
        if self.count == 1 {
            return vec![(0, msg.clone())];
        }
        let entries = match msg {
            AgentMsg::Join(j) => Some(&j.entries),
            AgentMsg::Contribution(c) => Some(&c.entries),
            AgentMsg::Selected(s) => Some(&s.entries),
            _ => None,
        };
        if let Some(e) = entries {
            for i in 0..self.links.len() {
                let mine = e.iter().copied().filter(|x| self.mine(i, x.0)).collect();
                self.last_entries[i] = Some(mine);
            }
        }
        let keep = |link: usize, v: &[(u32, f64)]| -> Vec<(u32, f64)> {
            v.iter().copied().filter(|e| self.mine(link, e.0)).collect()
        };
        (0..self.links.len())
            .map(|i| {
                let m = match msg {
                    AgentMsg::Join(j) => AgentMsg::Join(Join {
                        host: j.host.clone(),
                        facility_digest: j.facility_digest,
                        pairs: j
                            .pairs
                            .iter()
                            .copied()
                            .filter(|e| self.mine(i, e.0))
                            .collect(),
                        entries: keep(i, &j.entries),
                        last_iteration: j.last_iteration.max(self.seen),
                        last_d: j
                            .last_d
                            .iter()
                            .copied()
                            .filter(|t| self.mine(i, t.facility))
                            .collect(),
                        rank: j.rank,
                        interest: j
                            .interest
                            .iter()
                            .copied()
                            .filter(|&f| self.mine(i, f))
                            .collect(),
                        floor: keep(i, &j.floor),
                        exchanges: j.exchanges,
                    }),
                    AgentMsg::Contribution(c) => AgentMsg::Contribution(ContributionMsg {
                        epoch: self.answering[i].0,
                        iteration: self.answering[i].1,
                        entries: keep(i, &c.entries),
                    }),
                    AgentMsg::Proposal(p) => AgentMsg::Proposal(ProposalMsg {
                        exchange: p.exchange,
                        // Each shard hears of the swap with its own facilities of the pair
                        // (possibly none), so each can decide and count its part.
                        park: p.park.as_deref().map(|v| keep(i, v)),
                        activate: p.activate.as_deref().map(|v| keep(i, v)),
                    }),
                    AgentMsg::Selected(s) => AgentMsg::Selected(SelectedMsg {
                        exchange: s.exchange,
                        pairs: s
                            .pairs
                            .iter()
                            .copied()
                            .filter(|e| self.mine(i, e.0))
                            .collect(),
                        floor: keep(i, &s.floor),
                        entries: keep(i, &s.entries),
                    }),
                    AgentMsg::Heartbeat { .. }
                    | AgentMsg::Leave
                    | AgentMsg::Reselect { .. }
                    | AgentMsg::Changed
                    | AgentMsg::Host(_)
                    | AgentMsg::Update(_)
                    | AgentMsg::RackProposals(_)
                    | AgentMsg::RackHost(_) => msg.clone(),
                };
                (i, m)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::generator::{generate, GeneratorConfig};
    use crate::protocol::wire::SelectionParams;

    fn problem() -> Problem {
        generate(&GeneratorConfig {
            k: 3,
            seed: 4,
            ..GeneratorConfig::new(2, 8)
        })
    }

    fn welcome(shard: Shard) -> CoordMsg {
        CoordMsg::Welcome {
            epoch: 3,
            iteration: 10,
            heartbeat_ms: 100,
            shard,
        }
    }

    #[test]
    fn shard_names_parse_and_own_by_hash() {
        assert_eq!("1/2".parse::<Shard>(), Ok(Shard { index: 1, count: 2 }));
        for bad in ["2/2", "0/0", "1", "a/b", "-1/2"] {
            assert!(bad.parse::<Shard>().is_err(), "{bad}");
        }
        assert_eq!(Shard { index: 1, count: 3 }.to_string(), "1/3");
        let ids: Vec<String> = (0..64).map(|i| format!("app{i}")).collect();
        for count in 1..5u32 {
            for id in &ids {
                let owners = (0..count)
                    .filter(|&index| Shard { index, count }.owns(id))
                    .count();
                assert_eq!(owners, 1, "{id} has exactly one owner among {count}");
            }
        }
        // The hash spreads: with 64 ids and 2 shards, both own plenty.
        let zero = ids
            .iter()
            .filter(|id| crate::protocol::shard_of(id, 2) == 0)
            .count();
        assert!((16..=48).contains(&zero), "{zero}");
    }

    #[test]
    fn a_shard_refuses_foreign_facilities_and_their_capacity_changes() {
        use crate::protocol::coordinator::{
            Action, Coordinator, CoordinatorConfig, SelectionSchedule,
        };
        use std::time::Duration;
        let p = problem();
        let shard = Shard { index: 0, count: 2 };
        let foreign = (0..p.facilities.len() as u32)
            .find(|&f| !shard.owns(&p.facilities[f as usize].id))
            .unwrap();
        let mine = (0..p.facilities.len() as u32)
            .find(|&f| shard.owns(&p.facilities[f as usize].id))
            .unwrap();
        let ms = Duration::from_millis(1);
        let mut c = Coordinator::new(
            CoordinatorConfig {
                rho: 1.0,
                facility_digest: 7,
                heartbeat_interval: 100 * ms,
                member_timeout: 1000 * ms,
                round_deadline: 50 * ms,
                max_staleness: 0,
                round_interval: Duration::ZERO,
                min_members: 1,
                max_iterations: None,
                selection: SelectionSchedule::fixed(),
                shard,
            },
            p.facilities.clone(),
        );
        let join = |f: u32| {
            AgentMsg::Join(Join {
                host: "h".into(),
                facility_digest: 7,
                pairs: vec![(f, 1)],
                entries: vec![(f, 0.1)],
                last_iteration: 0,
                last_d: Vec::new(),
                rank: 0,
                interest: vec![f],
                floor: vec![(f, 0.0)],
                exchanges: 0,
            })
        };
        let out = c.on_message(Duration::ZERO, 1, join(foreign));
        assert!(out
            .iter()
            .any(|a| matches!(a, Action::Close(1, r) if r.contains("another shard"))));
        assert_eq!(c.members(), 0);
        c.on_message(Duration::ZERO, 2, join(mine));
        assert_eq!(c.members(), 1);
        let e = c
            .set_capacity(&p.facilities[foreign as usize].id, 1.0)
            .unwrap_err();
        assert!(e.contains("belongs to shard 1/2"), "{e}");
        c.set_capacity(&p.facilities[mine as usize].id, 1.0)
            .unwrap();
        assert_eq!(c.status().shard, "0/2");
    }

    #[test]
    fn one_shard_is_the_identity() {
        let p = problem();
        let mut m = ShardMux::new(&p, 0, 1);
        assert_eq!(m.links(), &[0]);
        let w = welcome(Shard::WHOLE);
        assert_eq!(m.incoming(0, w.clone()), Ok(Some(w)));
        assert!(m
            .incoming(0, welcome(Shard { index: 0, count: 2 }))
            .is_err());
        let h = AgentMsg::Heartbeat { seq: 1 };
        assert_eq!(m.outgoing(&h), vec![(0, h)]);
    }

    #[test]
    fn rounds_wait_for_every_shard_and_contributions_split_by_owner() {
        let p = problem();
        let mut m = ShardMux::new(&p, 0, 2);
        assert_eq!(m.links(), &[0, 1], "8 apps spread over both shards");
        let owner = |f: u32| crate::protocol::shard_of(&p.facilities[f as usize].id, 2);
        // A coordinator of the wrong shard is refused.
        assert!(m
            .incoming(0, welcome(Shard { index: 1, count: 2 }))
            .is_err());
        assert_eq!(
            m.incoming(0, welcome(Shard { index: 0, count: 2 })),
            Ok(None)
        );
        let Ok(Some(CoordMsg::Welcome {
            epoch: 1,
            iteration: 10,
            ..
        })) = m.incoming(1, welcome(Shard { index: 1, count: 2 }))
        else {
            panic!()
        };
        let fs: Vec<u32> = (0..p.facilities.len() as u32).collect();
        let d_of = |s: u32| -> Vec<FacilityTerm> {
            fs.iter()
                .filter(|&&f| owner(f) == s)
                .map(|&f| FacilityTerm {
                    facility: f,
                    d: f as f64,
                    rho: 2.0,
                })
                .collect()
        };
        let round = |s: u32, epoch, iteration| CoordMsg::Round {
            epoch,
            iteration,
            d: d_of(s),
        };
        // Shard 1's round 5 is replaced by its round 6 before shard 0's round 4 arrives.
        assert_eq!(m.incoming(1, round(1, 2, 5)), Ok(None));
        assert_eq!(m.incoming(1, round(1, 2, 6)), Ok(None));
        let Ok(Some(CoordMsg::Round { d, iteration, .. })) = m.incoming(0, round(0, 7, 4)) else {
            panic!()
        };
        assert_eq!(iteration, 6);
        assert_eq!(d.len(), p.facilities.len());
        assert!(d.windows(2).all(|w| w[0].facility < w[1].facility));
        // A round naming another shard's facility is a mix-up.
        assert!(m.incoming(0, round(1, 7, 5)).is_err());
        let c = AgentMsg::Contribution(ContributionMsg {
            epoch: 1,
            iteration: 6,
            entries: fs.iter().map(|&f| (f, 1.0)).collect(),
        });
        let out = m.outgoing(&c);
        assert_eq!(out.len(), 2);
        for (i, msg) in out {
            let AgentMsg::Contribution(c) = msg else {
                panic!()
            };
            assert_eq!((c.epoch, c.iteration), if i == 0 { (7, 4) } else { (2, 6) });
            assert!(c.entries.iter().all(|e| owner(e.0) == i as u32));
        }
        // Shards far out of step (one restarted alone and counted from the agents' last
        // round, the other ran on): an error, and the next join carries the highest round,
        // on which the shards align.
        assert_eq!(m.incoming(1, round(1, 3, 100)), Ok(None));
        let e = m.incoming(0, round(0, 7, 100 + MAX_SKEW + 1)).unwrap_err();
        assert!(e.contains("out of step"), "{e}");
        m.reset();
        let join = AgentMsg::Join(Join {
            host: "h0".into(),
            facility_digest: 0,
            pairs: Vec::new(),
            entries: Vec::new(),
            last_iteration: 6,
            last_d: Vec::new(),
            rank: 0,
            interest: Vec::new(),
            floor: Vec::new(),
            exchanges: 0,
        });
        for (_, j) in m.outgoing(&join) {
            let AgentMsg::Join(j) = j else { panic!() };
            assert_eq!(j.last_iteration, 100 + MAX_SKEW + 1);
        }
    }

    /// Issue 19, item 3: while one shard waits in an exchange, the other's rounds are
    /// answered by the mux with the host's last contribution to that shard (no step), so it
    /// reaches the exchange too instead of both stalling; then the exchange merges.
    #[test]
    fn a_shard_behind_an_exchange_gets_the_last_contribution() {
        let p = problem();
        let mut m = ShardMux::new(&p, 0, 2);
        let owner = |f: u32| crate::protocol::shard_of(&p.facilities[f as usize].id, 2);
        let fs: Vec<u32> = (0..p.facilities.len() as u32).collect();
        let opts: SelectionParams = crate::selection::SelectionOptions::default().into();
        let select = |s: u32, exchange| CoordMsg::Select {
            exchange,
            round: exchange - 1,
            prices: fs
                .iter()
                .filter(|&&f| owner(f) == s)
                .map(|&f| (f, 0.5))
                .collect(),
            options: opts,
        };
        let round = |s: u32, iteration| CoordMsg::Round {
            epoch: 1,
            iteration,
            d: fs
                .iter()
                .filter(|&&f| owner(f) == s)
                .map(|&f| FacilityTerm {
                    facility: f,
                    d: 0.0,
                    rho: 2.0,
                })
                .collect(),
        };
        m.outgoing(&AgentMsg::Contribution(ContributionMsg {
            epoch: 1,
            iteration: 98,
            entries: fs.iter().map(|&f| (f, f as f64)).collect(),
        }));
        assert_eq!(m.incoming(0, select(0, 7)), Ok(None));
        for it in [99, 100] {
            assert_eq!(m.incoming(1, round(1, it)), Ok(None));
            let replies = m.take_replies();
            assert_eq!(replies.len(), 1);
            let (1, AgentMsg::Contribution(c)) = &replies[0] else {
                panic!("{replies:?}")
            };
            assert_eq!((c.epoch, c.iteration), (1, it));
            assert!(!c.entries.is_empty() && c.entries.iter().all(|e| owner(e.0) == 1));
            assert!(
                c.entries.iter().all(|e| e.1 == e.0 as f64),
                "the last entries"
            );
        }
        assert!(matches!(
            m.incoming(1, select(1, 7)),
            Ok(Some(CoordMsg::Select { exchange: 7, .. }))
        ));
        // Without an exchange held, rounds wait for each other as before.
        assert_eq!(m.incoming(1, round(1, 101)), Ok(None));
        assert!(m.take_replies().is_empty());
    }

    #[test]
    fn exchanges_merge_prices_and_the_owners_verdict() {
        let p = problem();
        let mut m = ShardMux::new(&p, 0, 2);
        let owner = |f: u32| crate::protocol::shard_of(&p.facilities[f as usize].id, 2);
        let fs: Vec<u32> = (0..p.facilities.len() as u32).collect();
        let opts: SelectionParams = crate::selection::SelectionOptions::default().into();
        let select = |s: u32, exchange| CoordMsg::Select {
            exchange,
            round: exchange - 1,
            prices: fs
                .iter()
                .filter(|&&f| owner(f) == s)
                .map(|&f| (f, 0.5))
                .collect(),
            options: opts,
        };
        assert_eq!(m.incoming(0, select(0, 2)), Ok(None));
        // Shards out of step: nothing is handed on until both sent the same exchange.
        assert_eq!(m.incoming(1, select(1, 1)), Ok(None));
        let Ok(Some(CoordMsg::Select {
            prices, round: 1, ..
        })) = m.incoming(1, select(1, 2))
        else {
            panic!()
        };
        assert_eq!(prices.len(), p.facilities.len());
        let (f0, f1) = (
            *fs.iter().find(|&&f| owner(f) == 0).unwrap(),
            *fs.iter().find(|&&f| owner(f) == 1).unwrap(),
        );
        let prop = AgentMsg::Proposal(ProposalMsg {
            exchange: 2,
            park: Some(vec![(f0, 0.1)]),
            activate: Some(vec![(f0, 0.2), (f1, 0.1)]),
        });
        let out = m.outgoing(&prop);
        let AgentMsg::Proposal(p0) = &out[0].1 else {
            panic!()
        };
        let AgentMsg::Proposal(p1) = &out[1].1 else {
            panic!()
        };
        assert_eq!(
            (&p0.park, &p0.activate),
            (&Some(vec![(f0, 0.1)]), &Some(vec![(f0, 0.2)]))
        );
        assert_eq!(
            (&p1.park, &p1.activate),
            (&Some(vec![]), &Some(vec![(f1, 0.1)]))
        );
        // The activation uses facilities of both shards: one refusal refuses it.
        let verdict = |activate| CoordMsg::Verdict {
            exchange: 2,
            activate,
        };
        assert_eq!(m.incoming(0, verdict(true)), Ok(None));
        assert_eq!(m.incoming(1, verdict(false)), Ok(Some(verdict(false))));
    }

    /// Two shard coordinators and agents behind their muxes, wired back to back, end at
    /// `solver::solve`'s allocation (selection included).
    #[test]
    fn two_shards_in_memory_match_solve() {
        use crate::protocol::agent::AgentAction;
        use crate::protocol::coordinator::{
            Action, Coordinator, CoordinatorConfig, MemberId, SelectionSchedule,
        };
        use std::time::Duration;
        let problem = generate(&GeneratorConfig {
            k: 2,
            seed: 11,
            ..GeneratorConfig::new(4, 6)
        });
        let opts = crate::solver::SolveOptions {
            eps_primal: 1e-11,
            eps_dual: 1e-11,
            max_iter: 5000,
            certificate_iters: 0,
            // The control plane runs the swap rounds, not the verified search (docs/model.md).
            polish_trials: 0,
            ..Default::default()
        };
        let solution = crate::solver::solve(&problem, &opts);
        assert!(solution.converged);
        let total = (opts.iters_per_round + solution.iterations) as u64;
        let ms = Duration::from_millis(1);
        // Each shard waits for the hosts that talk to it.
        let mut muxes: Vec<ShardMux> = (0..problem.hosts.len())
            .map(|h| ShardMux::new(&problem, h, 2))
            .collect();
        let mut coords: Vec<Coordinator> = (0..2)
            .map(|index| {
                Coordinator::new(
                    CoordinatorConfig {
                        rho: crate::solver::default_rho(&problem),
                        facility_digest: crate::protocol::facility_digest(&problem),
                        heartbeat_interval: 100 * ms,
                        member_timeout: 1000 * ms,
                        round_deadline: 50 * ms,
                        max_staleness: 0,
                        round_interval: Duration::ZERO,
                        min_members: muxes.iter().filter(|m| m.links().contains(&index)).count(),
                        max_iterations: Some(total),
                        selection: SelectionSchedule::from_solve(&opts),
                        shard: Shard { index, count: 2 },
                    },
                    problem.facilities.clone(),
                )
            })
            .collect();
        assert!(coords.iter().all(|c| c.config().min_members > 0));
        let active = crate::protocol::fixed_active_sets(&problem);
        let mut agents = crate::protocol::test_agents(&problem, &active);
        let now = Duration::ZERO;
        // Messages to agents: (host, link, msg).
        let mut inbox: Vec<(usize, usize, CoordMsg)> = Vec::new();
        let member = |h: usize, shard: u32| (h * 2 + shard as usize) as MemberId;
        let deliver = |coords: &mut Vec<Coordinator>,
                       muxes: &mut Vec<ShardMux>,
                       h: usize,
                       acts: Vec<AgentAction>,
                       inbox: &mut Vec<(usize, usize, CoordMsg)>| {
            for act in acts {
                if let AgentAction::Send(m) = act {
                    for (link, part) in muxes[h].outgoing(&m) {
                        let shard = muxes[h].links()[link];
                        for a in coords[shard as usize].on_message(now, member(h, shard), part) {
                            if let Action::Send(id, msg) = a {
                                let host = id as usize / 2;
                                let s = (id % 2) as u32;
                                let l = muxes[host].links().iter().position(|&x| x == s).unwrap();
                                inbox.push((host, l, msg));
                            }
                        }
                    }
                }
            }
        };
        for (h, agent) in agents.iter_mut().enumerate() {
            let acts = agent.on_connected(now, &problem);
            deliver(&mut coords, &mut muxes, h, acts, &mut inbox);
        }
        while !inbox.is_empty() {
            for (h, link, msg) in std::mem::take(&mut inbox) {
                if let Some(m) = muxes[h].incoming(link, msg).unwrap() {
                    let acts = agents[h].on_message(now, &problem, m);
                    deliver(&mut coords, &mut muxes, h, acts, &mut inbox);
                }
            }
        }
        for c in &coords {
            assert_eq!(c.iteration(), total);
            assert_eq!(c.exchanges_done(), opts.rounds as u32 + 1);
        }
        for (a, r) in agents.iter().zip(&solution.hosts) {
            assert_eq!(a.state().active, r.active, "host {}", r.host);
            for (x, y) in a.state().x.iter().zip(&r.x) {
                assert!((x - y).abs() < 1e-9, "host {}: {x} vs {y}", r.host);
            }
        }
    }
}
