//! The coordinator's state machine: membership, epochs, rounds, bounded staleness and the
//! sharing-ADMM price update (docs/design.md §3, §7).
//!
//! * **Membership.** A connection becomes a member by a valid `Join`; any message refreshes its
//!   liveness; `Leave`, a closed connection or silence longer than `member_timeout` removes it.
//!   Every change of membership starts a new **epoch**: the per-facility pair counts change, so
//!   the round in progress is abandoned (its contributions are kept as each member's latest) and
//!   prices are carried over by rescaling the scaled duals ([`CoordinatorState::set_counts`]).
//! * **Rounds.** Round `iteration + 1` of the current epoch sends each member `d_f` for the
//!   facilities it uses. A contribution counts for the round only with the round's epoch and
//!   number; an older number is *late* (kept if newer than what the member had), a repeat is a
//!   *duplicate* (ignored), a number from the future is a protocol violation.
//! * **Bounded staleness** (Feng/Xu/Li §4.4): at the round deadline, stragglers' last
//!   contributions are reused if none of them has been reused `max_staleness` times in a row;
//!   otherwise the round waits for them (or for their timeout).
//! * **Cold start.** The first epoch that reaches `min_members` performs a full update on the
//!   joins' contributions, exactly as the in-process solver's [`crate::solver::Engine::new`]; so
//!   the networked iterates equal the in-process ones when nothing straggles.

use super::reselect::Reselection;
use super::wire;
use super::wire::{
    AgentMsg, ContributionMsg, CoordMsg, Join, ProposalMsg, SelectedMsg, SelectionParams, Shard,
    UpdateMsg,
};
use crate::admm::{CoordinatorState, FacilityTerm, Residuals, RhoBalance};
use crate::instance::Instance;
use crate::live::{AppReport, Gid, HostReport, LiveFacility, LivePolicy};
use crate::model::Facility;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Duration;

mod exchange;
mod live_hosts;
mod operator;
mod status;
#[cfg(test)]
mod tests;

pub use operator::OperatorState;
pub use status::{Counters, FacilityStatus, MemberStatus, SelectionStatus, Status};

/// The transport's name for one connection.
pub type MemberId = u64;

#[derive(Clone, Debug, PartialEq)]
pub struct CoordinatorConfig {
    pub rho: f64,
    pub facility_digest: u64,
    /// How often agents are told to send heartbeats.
    pub heartbeat_interval: Duration,
    /// Silence after which a member is dropped.
    pub member_timeout: Duration,
    /// How long a round waits for every member before reusing stragglers' contributions.
    pub round_deadline: Duration,
    /// How many rounds in a row a member's contribution may be reused (0: always wait).
    pub max_staleness: u32,
    /// Minimum spacing between round starts (0: back to back).
    pub round_interval: Duration,
    /// The first round starts only once this many hosts are members.
    pub min_members: usize,
    /// Stop starting rounds after this many completed iterations (tests, experiments).
    pub max_iterations: Option<u64>,
    /// When the agents re-select their active sets, as the in-process solver does.
    pub selection: SelectionSchedule,
    /// The facilities this coordinator owns ([`Shard::WHOLE`]: all). A message naming a
    /// facility of another shard is a protocol violation.
    pub shard: Shard,
}

/// The selection schedule of `drum_common::solver::solve`, run across the network: an
/// optional priced restart after `iters_per_round` iterations (exchange 0), then `rounds`
/// selection rounds (exchanges 1..=rounds), each after `iters_per_round` iterations or as soon
/// as both residuals are within their tolerance, whichever comes first. Afterwards selection
/// rounds go on every `period` (`T_sel`) and when an agent's apps change
/// ([`super::reselect`]); without a period the active sets stay until an app arrives or leaves.
#[derive(Clone, Debug, PartialEq)]
pub struct SelectionSchedule {
    pub priced_start: bool,
    pub rounds: u32,
    pub iters_per_round: u32,
    pub eps_primal: f64,
    pub eps_dual: f64,
    pub options: SelectionParams,
    /// `T_sel`: re-selection after the schedule at most this often; `None`: only when an
    /// agent's apps change.
    pub period: Option<Duration>,
}

impl SelectionSchedule {
    /// No selection at all: the active sets the agents join with stay.
    pub fn fixed() -> Self {
        Self {
            priced_start: false,
            rounds: 0,
            ..Self::from_solve(&crate::solver::SolveOptions::default())
        }
    }

    /// The schedule `solve` runs with these options.
    pub fn from_solve(o: &crate::solver::SolveOptions) -> Self {
        Self {
            priced_start: o.priced_start,
            rounds: o.rounds as u32,
            iters_per_round: o.iters_per_round.max(1) as u32,
            eps_primal: o.eps_primal,
            eps_dual: o.eps_dual,
            options: o.selection.into(),
            period: None,
        }
    }

    /// Exchanges in the whole schedule (the priced restart included).
    pub fn exchanges(&self) -> u32 {
        self.rounds + 1
    }
}

/// What the driver must do.
#[derive(Clone, Debug, PartialEq)]
pub enum Action {
    Send(MemberId, CoordMsg),
    /// Close the connection; the reason is for the log and the peer.
    Close(MemberId, String),
    /// Close the connection of a member that fell silent past its heartbeat timeout: not a
    /// violation, and closed as such (a partition that heals before QUIC's idle timeout
    /// delivers the close to the agent).
    Expire(MemberId),
    Event(Event),
}

/// Things worth a log line or a metric.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    Joined {
        member: MemberId,
        host: String,
        epoch: u64,
    },
    Left {
        member: MemberId,
        host: String,
        why: LeaveReason,
    },
    Refused {
        member: MemberId,
        reason: String,
    },
    RoundDone {
        epoch: u64,
        iteration: u64,
        residuals: Residuals,
        stale: usize,
        took: Duration,
    },
    Late {
        member: MemberId,
        iteration: u64,
    },
    Duplicate {
        member: MemberId,
        iteration: u64,
    },
    /// A selection exchange was sent out (`round` is `None` for the priced restart).
    SelectionStarted {
        exchange: u32,
        round: Option<u32>,
        iteration: u64,
    },
    /// An agent's apps changed and it asked for a re-selection at `iteration`; `taken` is
    /// false on a sharded coordinator, which re-selects only periodically.
    ReselectRequested {
        member: MemberId,
        host: String,
        iteration: u64,
        taken: bool,
    },
    /// A selection exchange finished: the new active sets are in force.
    SelectionDone {
        exchange: u32,
        parks: u32,
        activations: u32,
        refused: u32,
    },
    /// A join named a host that is a member on another connection which is still alive
    /// (heard from `quiet` ago): two agents run with one host id. The newcomer was refused.
    DuplicateHost {
        member: MemberId,
        incumbent: MemberId,
        host: String,
        quiet: Duration,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum LeaveReason {
    Leave,
    Disconnected,
    TimedOut,
    Replaced,
    ProtocolViolation,
    Drained,
}

#[derive(Clone, Debug)]
struct Member {
    host: String,
    pairs: Vec<(u32, u32)>,
    last_seen: Duration,
    entries: Vec<(u32, f64)>,
    /// Iteration of `entries` (0: from the join).
    entries_iteration: u64,
    /// `entries` when the last round completed: how far the host moved is the balancing's
    /// dual residual.
    entries_at_update: Vec<(u32, f64)>,
    /// `d` the host last stepped with, as reported in its join (for a warm restart).
    last_d: Vec<FacilityTerm>,
    /// Rounds in a row completed with this member's contribution reused.
    stale: u32,
    /// The host's position in the instance (order of selection verdicts).
    rank: u32,
    /// Every facility of the host's apps (prices in `Select`).
    interest: Vec<u32>,
    /// `Σ b·x_min` per facility over the host's active pairs.
    floor: Vec<(u32, f64)>,
    /// Selection exchanges the host has completed (from its join).
    exchanges: u32,
    /// Live problem: the latest report of each host the member speaks for (its NIC, its row
    /// and grants): its own, or a relay's agents'.
    reports: BTreeMap<String, live_hosts::Reported>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ExchangePhase {
    /// `Select` sent; collecting proposals.
    Propose,
    /// `Verdict` (or `Restart`) sent; collecting the new active sets.
    Apply,
}

/// A selection exchange in progress; no round runs meanwhile.
#[derive(Clone, Debug)]
struct Exchange {
    index: u32,
    phase: ExchangePhase,
    started: Duration,
    waiting: BTreeSet<MemberId>,
    proposals: BTreeMap<MemberId, exchange::Proposed>,
    parks: u32,
    activations: u32,
    refused: u32,
}

#[derive(Clone, Debug)]
struct Round {
    iteration: u64,
    started: Duration,
    waiting: BTreeSet<MemberId>,
}

pub struct Coordinator {
    cfg: CoordinatorConfig,
    facilities: Vec<Facility>,
    /// Whether this shard owns each facility.
    owned: Vec<bool>,
    admm: CoordinatorState,
    epoch: u64,
    /// Completed ADMM iterations (coordinator updates).
    iteration: u64,
    started: bool,
    members: BTreeMap<MemberId, Member>,
    hosts: HashMap<String, MemberId>,
    /// Hosts an operator took out of the optimisation; their joins are refused.
    drained: BTreeSet<String>,
    round: Option<Round>,
    membership_changed: bool,
    last_round_start: Option<Duration>,
    /// When `tick` last scanned for timed-out members.
    last_scan: Duration,
    /// The highest round number sent; a contribution beyond it is a protocol violation.
    sent_iteration: u64,
    residuals: Residuals,
    counters: Counters,
    /// Index of the next selection exchange (0: the priced restart).
    exchange_next: u32,
    /// Iterations completed since the last exchange (or the start).
    iters_since: u32,
    exchange: Option<Exchange>,
    /// When to select again once the schedule is done.
    reselect: Reselection,
    /// The instance's app ids ([`Self::set_apps`]), to check `set-weight`.
    apps: Vec<String>,
    /// The instance's host ids ([`Self::set_hosts`]), to check `drain`.
    host_ids: Vec<String>,
    /// Operator changes: weights by app, capacities by facility.
    weights: BTreeMap<String, f64>,
    capacities: BTreeMap<String, f64>,
    /// Live problem (docs/live-problem.md): the policy; `None` with an instance file.
    live: Option<LivePolicy>,
    /// Live problem: each facility's host and GIDs (index as `facilities`).
    links: Vec<LiveFacility>,
}

impl Coordinator {
    /// ADMM state from scratch for the current facilities.
    fn fresh_admm(&self) -> CoordinatorState {
        let n = self.facilities.len();
        if self.live.is_some() {
            CoordinatorState::balanced(self.cfg.rho, n, RhoBalance::around(self.cfg.rho))
        } else {
            CoordinatorState::new(self.cfg.rho, n)
        }
    }

    fn send_all(&self, msg: CoordMsg, out: &mut Vec<Action>) {
        out.extend(self.members.keys().map(|&id| Action::Send(id, msg.clone())));
    }

    pub fn new(cfg: CoordinatorConfig, facilities: Vec<Facility>) -> Self {
        let admm = CoordinatorState::new(cfg.rho, facilities.len());
        let owned = facilities.iter().map(|f| cfg.shard.owns(&f.id)).collect();
        let reselect = Reselection::new(
            cfg.selection.period,
            cfg.selection.iters_per_round,
            (cfg.shard.count > 1).then_some(cfg.round_interval),
        );
        Self {
            cfg,
            facilities,
            owned,
            admm,
            epoch: 0,
            iteration: 0,
            started: false,
            members: BTreeMap::new(),
            hosts: HashMap::new(),
            drained: BTreeSet::new(),
            round: None,
            membership_changed: false,
            last_round_start: None,
            last_scan: Duration::ZERO,
            sent_iteration: 0,
            residuals: Residuals::default(),
            counters: Counters::default(),
            exchange_next: 0,
            iters_since: 0,
            exchange: None,
            reselect,
            apps: Vec::new(),
            host_ids: Vec::new(),
            weights: BTreeMap::new(),
            capacities: BTreeMap::new(),
            live: None,
            links: Vec::new(),
        }
    }

    /// A message from connection `from`.
    pub fn on_message(&mut self, now: Duration, from: MemberId, msg: AgentMsg) -> Vec<Action> {
        let mut out = Vec::new();
        if let Some(m) = self.members.get_mut(&from) {
            m.last_seen = now;
        }
        match msg {
            AgentMsg::Join(join) => self.join(now, from, join, &mut out),
            AgentMsg::Heartbeat { seq } => {
                if self.members.contains_key(&from) {
                    out.push(Action::Send(from, CoordMsg::HeartbeatAck { seq }));
                } else {
                    self.violation(from, "heartbeat before join".into(), &mut out);
                }
            }
            AgentMsg::Leave => self.remove(from, LeaveReason::Leave, &mut out),
            AgentMsg::Contribution(c) => self.contribution(from, c, &mut out),
            AgentMsg::Proposal(p) => {
                let exchange = p.exchange;
                self.proposal(from, exchange, exchange::Proposed::Host(p), &mut out)
            }
            AgentMsg::RackProposals(p) => self.proposal(
                from,
                p.exchange,
                exchange::Proposed::Rack(p.hosts),
                &mut out,
            ),
            AgentMsg::Selected(sel) => self.selected(from, sel, &mut out),
            AgentMsg::Reselect { iteration } => self.reselect_request(from, iteration, &mut out),
            AgentMsg::Changed => {
                if self.members.contains_key(&from) {
                    self.counters.changes += 1;
                    self.reselect.changed();
                } else {
                    self.violation(from, "change before join".into(), &mut out);
                }
            }
            AgentMsg::Host(r) => match self.members.get(&from) {
                Some(m) => {
                    let host = m.host.clone();
                    self.host_report(from, host, r, &mut out)
                }
                None => self.violation(from, "host report before join".into(), &mut out),
            },
            AgentMsg::RackHost(r) => self.rack_host(from, r, &mut out),
            AgentMsg::Update(u) => self.update(from, u, &mut out),
        }
        self.advance(now, &mut out);
        out
    }

    /// The transport lost connection `from`.
    pub fn on_disconnect(&mut self, now: Duration, from: MemberId) -> Vec<Action> {
        let mut out = Vec::new();
        if self.members.contains_key(&from) {
            self.remove(from, LeaveReason::Disconnected, &mut out);
            self.advance(now, &mut out);
        }
        out
    }

    /// The transport's idle timeout ended connection `from`: the member went silent (its
    /// agent crashed, was killed or cut off), which is a member timeout like the one
    /// [`Self::tick`] finds, whichever notices first, and is counted as one.
    pub fn on_silence(&mut self, now: Duration, from: MemberId) -> Vec<Action> {
        let mut out = Vec::new();
        if self.members.contains_key(&from) {
            self.counters.timeouts += 1;
            self.remove(from, LeaveReason::TimedOut, &mut out);
            self.advance(now, &mut out);
        }
        out
    }

    /// Timeouts, round deadlines and round starts; call at [`Self::next_wakeup`] or sooner.
    pub fn tick(&mut self, now: Duration) -> Vec<Action> {
        let mut out = Vec::new();
        self.last_scan = now;
        let dead: Vec<MemberId> = self
            .members
            .iter()
            .filter(|(_, m)| now.saturating_sub(m.last_seen) > self.cfg.member_timeout)
            .map(|(&id, _)| id)
            .collect();
        for id in dead {
            self.counters.timeouts += 1;
            self.remove(id, LeaveReason::TimedOut, &mut out);
        }
        // A member that does not answer a selection exchange within the member timeout is
        // dropped (it rejoins with its true active sets); the exchange goes on without it.
        if let Some(x) = &self.exchange {
            if now >= x.started + self.cfg.member_timeout {
                let slow: Vec<MemberId> = x.waiting.iter().copied().collect();
                let index = x.index;
                for id in slow {
                    self.counters.timeouts += 1;
                    out.push(Action::Close(
                        id,
                        format!("no answer to selection exchange {index}"),
                    ));
                    self.remove(id, LeaveReason::TimedOut, &mut out);
                }
            }
        }
        // A departure abandons the round (it may wait on the departed): new epoch first.
        if self.membership_changed {
            self.advance(now, &mut out);
            return out;
        }
        if let Some(r) = &self.round {
            if now >= r.started + self.cfg.round_deadline {
                let can_reuse = r
                    .waiting
                    .iter()
                    .all(|id| self.members[id].stale < self.cfg.max_staleness);
                if can_reuse {
                    let stragglers: Vec<MemberId> = r.waiting.iter().copied().collect();
                    for id in &stragglers {
                        self.members.get_mut(id).expect("waiting member").stale += 1;
                    }
                    self.counters.stale_reuses += stragglers.len() as u64;
                    self.complete_round(now, stragglers.len(), &mut out);
                }
            }
        }
        self.advance(now, &mut out);
        out
    }

    /// The earliest time at which [`Self::tick`] has something to do.
    /// Member timeouts are checked by a scan every quarter timeout rather than per member, so
    /// this stays O(1) per message (it is called after every one); a silent member is thus
    /// dropped between 1 and 1.25 timeouts after its last message.
    pub fn next_wakeup(&self) -> Option<Duration> {
        let timeout =
            (!self.members.is_empty()).then(|| self.last_scan + self.cfg.member_timeout / 4);
        let deadline = self
            .round
            .as_ref()
            .map(|r| r.started + self.cfg.round_deadline);
        let start = match (&self.round, self.last_round_start) {
            (None, Some(t)) if self.can_run() && self.exchange.is_none() => {
                Some(t + self.cfg.round_interval)
            }
            _ => None,
        };
        let exchange = self
            .exchange
            .as_ref()
            .map(|x| x.started + self.cfg.member_timeout);
        [timeout, deadline, start, exchange]
            .into_iter()
            .flatten()
            .min()
    }

    fn join(&mut self, now: Duration, from: MemberId, j: Join, out: &mut Vec<Action>) {
        if let Err(reason) = self.check_join(&j) {
            self.counters.refused += 1;
            out.push(Action::Event(Event::Refused {
                member: from,
                reason: reason.clone(),
            }));
            out.push(Action::Send(
                from,
                CoordMsg::Refused {
                    reason: reason.clone(),
                },
            ));
            out.push(Action::Close(from, reason));
            if self.members.contains_key(&from) {
                self.remove(from, LeaveReason::ProtocolViolation, out);
            }
            return;
        }
        if self.members.contains_key(&from) {
            self.violation(from, "second join on one connection".into(), out);
            return;
        }
        if let Some(&old) = self.hosts.get(&j.host) {
            // Every member heartbeats each `heartbeat_interval`. One heard from within two of
            // them is alive: the join comes from a second agent with the same host id, and
            // letting each replace the other would flap for ever, disturbing every host's
            // rounds. The incumbent keeps its place.
            let quiet = now.saturating_sub(self.members[&old].last_seen);
            if quiet <= 2 * self.cfg.heartbeat_interval {
                self.counters.refused += 1;
                self.counters.duplicate_joins += 1;
                out.push(Action::Event(Event::DuplicateHost {
                    member: from,
                    incumbent: old,
                    host: j.host.clone(),
                    quiet,
                }));
                let reason = format!(
                    "host {} is already a member on another connection, heard from {} ms ago: \
                     is a second agent running with this host id?",
                    j.host,
                    quiet.as_millis()
                );
                out.push(Action::Send(
                    from,
                    CoordMsg::Refused {
                        reason: reason.clone(),
                    },
                ));
                out.push(Action::Close(from, reason));
                return;
            }
            // A host reconnecting before its old, silent connection timed out replaces it.
            self.remove(old, LeaveReason::Replaced, out);
            out.push(Action::Close(old, format!("host {} rejoined", j.host)));
        }
        if !self.started {
            self.iteration = self.iteration.max(j.last_iteration);
        } else if self.cfg.shard.count > 1 && j.last_iteration > self.iteration {
            // Shards align their numbering at joins: an agent joins every shard it talks to
            // with the highest round number any of them sent it, so a shard restarted alone
            // (which took that number) and the shards that ran on agree again, and their
            // periodic exchanges, at multiples of the period, fall on the same rounds. The
            // jump is not a round: no exchange is due on it.
            self.iteration = j.last_iteration;
            self.iters_since = 0;
        }
        self.hosts.insert(j.host.clone(), from);
        self.members.insert(
            from,
            Member {
                host: j.host.clone(),
                pairs: j.pairs,
                last_seen: now,
                entries_at_update: j.entries.clone(),
                entries: j.entries,
                entries_iteration: j.last_iteration,
                last_d: j.last_d,
                stale: 0,
                rank: j.rank,
                interest: j.interest,
                floor: j.floor,
                exchanges: j.exchanges,
                reports: BTreeMap::new(),
            },
        );
        self.membership_changed = true;
        out.push(Action::Event(Event::Joined {
            member: from,
            host: j.host,
            epoch: self.epoch + 1,
        }));
        out.push(Action::Send(
            from,
            CoordMsg::Welcome {
                epoch: self.epoch + 1,
                iteration: self.iteration,
                heartbeat_ms: self.cfg.heartbeat_interval.as_millis() as u64,
                shard: self.cfg.shard,
            },
        ));
        if let Some(policy) = &self.live {
            // The shape and the weights first: the host builds its problem from them and the
            // facility table, then reports its row and its active set.
            out.push(Action::Send(from, CoordMsg::Policy(policy.clone())));
            out.push(Action::Send(from, CoordMsg::Facilities(self.links.clone())));
            return;
        }
        // The operator's weights, so that a host joining late steps with them too.
        for (app, &weight) in &self.weights {
            out.push(Action::Send(
                from,
                CoordMsg::SetWeight {
                    app: app.clone(),
                    weight,
                },
            ));
        }
    }

    fn check_join(&self, j: &Join) -> Result<(), String> {
        if self.live.is_none() && j.facility_digest != self.cfg.facility_digest {
            return Err(format!(
                "facility list differs from the coordinator's (digest {:016x}, expected {:016x})",
                j.facility_digest, self.cfg.facility_digest
            ));
        }
        j.check_shape(self.facilities.len() as u32)?;
        if self.drained.contains(&j.host) {
            return Err(format!("host {} is drained", j.host));
        }
        let foreign = j
            .interest
            .iter()
            .chain(j.last_d.iter().map(|e| &e.facility))
            .chain(j.entries.iter().map(|e| &e.0))
            .find(|&&f| !self.owned[f as usize]);
        if let Some(f) = foreign {
            return Err(self.foreign(*f));
        }
        self.check_active(&j.pairs, &j.floor)
    }

    fn check_active(&self, pairs: &[(u32, u32)], floor: &[(u32, f64)]) -> Result<(), String> {
        let nf = self.facilities.len() as u32;
        if !wire::ascending(pairs, nf) {
            return Err("pair counts must name known facilities in ascending order".into());
        }
        if let Some(p) = pairs.iter().find(|p| !self.owned[p.0 as usize]) {
            return Err(self.foreign(p.0));
        }
        wire::check_usage("floor", floor, nf)
    }

    fn check_entries(&self, entries: &[(u32, f64)]) -> Result<(), String> {
        wire::check_usage(
            "contribution entries",
            entries,
            self.facilities.len() as u32,
        )?;
        if let Some(e) = entries.iter().find(|e| !self.owned[e.0 as usize]) {
            return Err(self.foreign(e.0));
        }
        Ok(())
    }

    fn foreign(&self, f: u32) -> String {
        format!(
            "facility {} belongs to another shard than this one ({})",
            self.facilities[f as usize].id, self.cfg.shard
        )
    }

    fn contribution(&mut self, from: MemberId, c: ContributionMsg, out: &mut Vec<Action>) {
        let Some(member) = self.members.get(&from) else {
            self.violation(from, "contribution before join".into(), out);
            return;
        };
        if let Err(e) = self.check_entries(&c.entries) {
            self.violation(from, e, out);
            return;
        }
        let current = self.round.as_ref().map(|r| r.iteration);
        // Not `current`: a round abandoned at a change of epoch was sent all the same.
        if c.epoch > self.epoch || c.iteration > self.sent_iteration {
            self.violation(
                from,
                format!(
                    "contribution for epoch {} iteration {} from the future",
                    c.epoch, c.iteration
                ),
                out,
            );
            return;
        }
        let for_this_round = c.epoch == self.epoch
            && current == Some(c.iteration)
            && self
                .round
                .as_ref()
                .is_some_and(|r| r.waiting.contains(&from));
        if for_this_round {
            let m = self.members.get_mut(&from).expect("checked");
            m.entries = c.entries;
            m.entries_iteration = c.iteration;
            m.stale = 0;
            self.round.as_mut().expect("checked").waiting.remove(&from);
        } else if c.iteration <= member.entries_iteration || current == Some(c.iteration) {
            self.counters.duplicates += 1;
            out.push(Action::Event(Event::Duplicate {
                member: from,
                iteration: c.iteration,
            }));
        } else {
            // Late but newer than what we hold: the freshest information about this host.
            self.counters.late += 1;
            out.push(Action::Event(Event::Late {
                member: from,
                iteration: c.iteration,
            }));
            let m = self.members.get_mut(&from).expect("checked");
            m.entries = c.entries;
            m.entries_iteration = c.iteration;
        }
    }

    fn violation(&mut self, from: MemberId, reason: String, out: &mut Vec<Action>) {
        self.counters.refused += 1;
        out.push(Action::Event(Event::Refused {
            member: from,
            reason: reason.clone(),
        }));
        out.push(Action::Close(from, reason));
        if self.members.contains_key(&from) {
            self.remove(from, LeaveReason::ProtocolViolation, out);
        }
    }

    fn remove(&mut self, id: MemberId, why: LeaveReason, out: &mut Vec<Action>) {
        if let Some(x) = &mut self.exchange {
            x.waiting.remove(&id);
            x.proposals.remove(&id);
        }
        if let Some(m) = self.members.remove(&id) {
            if self.hosts.get(&m.host) == Some(&id) {
                self.hosts.remove(&m.host);
            }
            self.membership_changed = true;
            if why == LeaveReason::TimedOut {
                out.push(Action::Expire(id));
            }
            out.push(Action::Event(Event::Left {
                member: id,
                host: m.host,
                why,
            }));
        }
    }

    /// Enough members to iterate: `min_members` gates only the cold start; afterwards the
    /// survivors of a departure keep optimising among themselves.
    fn quorum(&self) -> bool {
        !self.members.is_empty() && (self.started || self.members.len() >= self.cfg.min_members)
    }

    fn can_run(&self) -> bool {
        self.quorum()
            && self
                .cfg
                .max_iterations
                .is_none_or(|max| self.iteration < max)
    }

    fn sums(&self) -> Vec<f64> {
        let mut sums = vec![0.0; self.facilities.len()];
        for m in self.members.values() {
            for &(f, v) in &m.entries {
                sums[f as usize] += v;
            }
        }
        sums
    }

    /// Per facility, `Σ_hosts Δ²/c` since the last update: `Δ` the host's change of `Σ b·x`,
    /// `c` its active pairs there (each taken to move alike); remembers the new sums.
    fn spread(&mut self) -> Vec<f64> {
        let mut spread = vec![0.0; self.facilities.len()];
        for m in self.members.values_mut() {
            let old = std::mem::replace(&mut m.entries_at_update, m.entries.clone());
            let pairs = |f: u32| {
                m.pairs
                    .binary_search_by_key(&f, |e| e.0)
                    .map_or(1, |i| m.pairs[i].1.max(1)) as f64
            };
            let value = |v: &[(u32, f64)], f: u32| {
                v.binary_search_by_key(&f, |e| e.0).map_or(0.0, |i| v[i].1)
            };
            for &(f, v) in &m.entries {
                spread[f as usize] += (v - value(&old, f)).powi(2) / pairs(f);
            }
            // A facility the host left moved by all it had.
            for &(f, v) in &old {
                if m.entries.binary_search_by_key(&f, |e| e.0).is_err() {
                    spread[f as usize] += v * v / pairs(f);
                }
            }
        }
        spread
    }

    fn counts(&self) -> Vec<u32> {
        let mut n = vec![0u32; self.facilities.len()];
        for m in self.members.values() {
            for &(f, c) in &m.pairs {
                n[f as usize] += c;
            }
        }
        n
    }

    fn advance(&mut self, now: Duration, out: &mut Vec<Action>) {
        if self.membership_changed {
            self.membership_changed = false;
            self.reselect.changed();
            self.epoch += 1;
            self.round = None;
            if self.quorum() {
                let counts = self.counts();
                let sums = self.sums();
                self.admm.set_counts(&counts);
                if self.started {
                    // A live host's `Update` may bring the terms it stepped with under a
                    // previous coordinator, for facilities this one has not priced yet.
                    self.restore_duals();
                    self.admm.set_sums(&sums);
                } else {
                    // Cold start, as the in-process engine: a full update on the first sums;
                    // if the agents report the d they last stepped with, the duals resume.
                    self.restore_duals();
                    self.residuals = self.admm.update(&self.facilities, &sums, None);
                    self.started = true;
                    // Resume the selection schedule where the agents left it (a restarted
                    // coordinator); a fresh cluster starts at the priced restart, if any.
                    let done = self.members.values().map(|m| m.exchanges).max();
                    self.exchange_next = done.unwrap_or(0);
                    if self.exchange_next == 0 && !self.cfg.selection.priced_start {
                        self.exchange_next = 1;
                    }
                }
            }
        }
        if let Some(r) = &self.round {
            if r.waiting.is_empty() {
                self.complete_round(now, 0, out);
            }
        }
        if self.exchange.as_ref().is_some_and(|x| x.waiting.is_empty()) {
            self.exchange_step(now, out);
        }
        if self.round.is_none()
            && self.exchange.is_none()
            && self.can_run()
            && self.exchange_due(now)
        {
            self.start_exchange(now, out);
        }
        if self.round.is_none() && self.exchange.is_none() && self.can_run() {
            let due = self
                .last_round_start
                .is_none_or(|t| now >= t + self.cfg.round_interval);
            if due {
                self.start_round(now, out);
            }
        }
    }

    /// After a coordinator restart: the price `ρ_f·d_f` from the freshest report per
    /// facility, exact at convergence (`d_f = (u_f + s_f − y_f)/n_f` with `s_f = y_f`), and
    /// its penalty where penalties adapt. Prices thus survive the restart instead of climbing
    /// again from zero. Only facilities this coordinator has not priced yet take a report:
    /// once it steps a facility, its own dual is fresher than any member's memory.
    fn restore_duals(&mut self) {
        let mut best: Vec<Option<(u64, FacilityTerm)>> = vec![None; self.facilities.len()];
        for m in self.members.values() {
            for t in m.last_d.iter().filter(|t| {
                let st = &self.admm.facilities[t.facility as usize];
                st.n > 0 && !st.priced
            }) {
                let b = &mut best[t.facility as usize];
                if b.is_none_or(|(it, _)| m.entries_iteration > it) {
                    *b = Some((m.entries_iteration, *t));
                }
            }
        }
        for (_, t) in best.into_iter().flatten() {
            let rho = match self.admm.balance {
                Some(b) => t.rho.clamp(b.min, b.max),
                None => self.admm.rho,
            };
            self.admm.restore(t.facility, rho, t.price());
        }
    }

    fn start_round(&mut self, now: Duration, out: &mut Vec<Action>) {
        let iteration = self.iteration + 1;
        for (&id, m) in &self.members {
            let d = m.pairs.iter().map(|&(f, _)| self.admm.term(f)).collect();
            out.push(Action::Send(
                id,
                CoordMsg::Round {
                    epoch: self.epoch,
                    iteration,
                    d,
                },
            ));
        }
        self.sent_iteration = self.sent_iteration.max(iteration);
        self.round = Some(Round {
            iteration,
            started: now,
            waiting: self.members.keys().copied().collect(),
        });
        self.last_round_start = Some(now);
    }

    fn complete_round(&mut self, now: Duration, stale: usize, out: &mut Vec<Action>) {
        let r = self.round.take().expect("a round in progress");
        let sums = self.sums();
        let spread = self.spread();
        self.residuals = self.admm.update(&self.facilities, &sums, Some(&spread));
        self.iteration = r.iteration;
        self.iters_since = self.iters_since.saturating_add(1);
        self.counters.rounds += 1;
        out.push(Action::Event(Event::RoundDone {
            epoch: self.epoch,
            iteration: r.iteration,
            residuals: self.residuals,
            stale,
            took: now.saturating_sub(r.started),
        }));
    }
}
