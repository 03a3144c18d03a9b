//! The coordinator's state machine: membership, epochs, rounds, bounded staleness and the
//! sharing-ADMM price update (DESIGN.md §3, §7).
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

use super::wire::{AgentMsg, ContributionMsg, CoordMsg, Join};
use crate::admm::{CoordinatorState, Residuals};
use crate::model::Facility;
use serde::Serialize;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Duration;

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
}

/// What the driver must do.
#[derive(Clone, Debug, PartialEq)]
pub enum Action {
    Send(MemberId, CoordMsg),
    /// Close the connection; the reason is for the log and the peer.
    Close(MemberId, String),
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
    /// `d` the host last stepped with, as reported in its join (for a warm restart).
    last_d: Vec<(u32, f64)>,
    /// Rounds in a row completed with this member's contribution reused.
    stale: u32,
}

#[derive(Clone, Debug)]
struct Round {
    iteration: u64,
    started: Duration,
    waiting: BTreeSet<MemberId>,
}

/// Counters for metrics and `status`.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Counters {
    pub rounds: u64,
    pub stale_reuses: u64,
    pub late: u64,
    pub duplicates: u64,
    pub refused: u64,
    pub timeouts: u64,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct MemberStatus {
    pub member: MemberId,
    pub host: String,
    pub facilities: usize,
    pub last_iteration: u64,
    pub stale: u32,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct FacilityStatus {
    pub id: String,
    pub capacity: f64,
    pub pairs: u32,
    pub usage: f64,
    pub price: f64,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Status {
    pub epoch: u64,
    pub iteration: u64,
    pub rho: f64,
    pub running: bool,
    pub primal_residual: f64,
    pub dual_residual: f64,
    pub members: Vec<MemberStatus>,
    pub facilities: Vec<FacilityStatus>,
    pub counters: Counters,
    pub drained: Vec<String>,
}

pub struct Coordinator {
    cfg: CoordinatorConfig,
    facilities: Vec<Facility>,
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
}

impl Coordinator {
    pub fn new(cfg: CoordinatorConfig, facilities: Vec<Facility>) -> Self {
        let admm = CoordinatorState::new(cfg.rho, facilities.len());
        Self {
            cfg,
            facilities,
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
        }
    }

    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    pub fn iteration(&self) -> u64 {
        self.iteration
    }

    pub fn members(&self) -> usize {
        self.members.len()
    }

    pub fn residuals(&self) -> Residuals {
        self.residuals
    }

    pub fn counters(&self) -> &Counters {
        &self.counters
    }

    pub fn price(&self, f: u32) -> f64 {
        self.admm.price(f)
    }

    /// Operator change of a facility's capacity; takes effect at the next update.
    pub fn set_capacity(&mut self, facility: &str, capacity: f64) -> Result<(), String> {
        if !(capacity.is_finite() && capacity > 0.0) {
            return Err(format!(
                "capacity must be positive and finite, got {capacity}"
            ));
        }
        let f = self
            .facilities
            .iter_mut()
            .find(|f| f.id == facility)
            .ok_or_else(|| format!("no facility {facility:?}"))?;
        f.capacity = capacity;
        Ok(())
    }

    /// Takes `host` out of the optimisation: its contribution is removed at once (new epoch),
    /// its connection closed, and its joins refused until [`Self::undrain`]. Its agent keeps
    /// its last rates (fail-static).
    pub fn drain(&mut self, now: Duration, host: &str) -> Vec<Action> {
        let mut out = Vec::new();
        self.drained.insert(host.to_string());
        if let Some(&id) = self.hosts.get(host) {
            let reason = format!("host {host} drained by the operator");
            out.push(Action::Send(
                id,
                CoordMsg::Refused {
                    reason: reason.clone(),
                },
            ));
            out.push(Action::Close(id, reason));
            self.remove(id, LeaveReason::Drained, &mut out);
        }
        self.advance(now, &mut out);
        out
    }

    /// Lets a drained host join again; whether it was drained.
    pub fn undrain(&mut self, host: &str) -> bool {
        self.drained.remove(host)
    }

    pub fn status(&self) -> Status {
        let mut pairs = vec![0u32; self.facilities.len()];
        for m in self.members.values() {
            for &(f, n) in &m.pairs {
                pairs[f as usize] += n;
            }
        }
        Status {
            epoch: self.epoch,
            iteration: self.iteration,
            rho: self.cfg.rho,
            running: self.round.is_some(),
            primal_residual: self.residuals.primal,
            dual_residual: self.residuals.dual,
            members: self
                .members
                .iter()
                .map(|(&id, m)| MemberStatus {
                    member: id,
                    host: m.host.clone(),
                    facilities: m.pairs.len(),
                    last_iteration: m.entries_iteration,
                    stale: m.stale,
                })
                .collect(),
            facilities: self
                .facilities
                .iter()
                .enumerate()
                .map(|(f, spec)| FacilityStatus {
                    id: spec.id.clone(),
                    capacity: spec.capacity,
                    pairs: pairs[f],
                    usage: self.admm.facilities[f].s,
                    price: self.admm.price(f as u32),
                })
                .collect(),
            counters: self.counters.clone(),
            drained: self.drained.iter().cloned().collect(),
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
            (None, Some(t)) if self.can_run() => Some(t + self.cfg.round_interval),
            _ => None,
        };
        [timeout, deadline, start].into_iter().flatten().min()
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
        // A host reconnecting before its old connection timed out replaces it.
        if let Some(&old) = self.hosts.get(&j.host) {
            self.remove(old, LeaveReason::Replaced, out);
            out.push(Action::Close(old, format!("host {} rejoined", j.host)));
        }
        if !self.started {
            self.iteration = self.iteration.max(j.last_iteration);
        }
        self.hosts.insert(j.host.clone(), from);
        self.members.insert(
            from,
            Member {
                host: j.host.clone(),
                pairs: j.pairs,
                last_seen: now,
                entries: j.entries,
                entries_iteration: j.last_iteration,
                last_d: j.last_d,
                stale: 0,
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
            },
        ));
    }

    fn check_join(&self, j: &Join) -> Result<(), String> {
        if j.facility_digest != self.cfg.facility_digest {
            return Err(format!(
                "facility list differs from the coordinator's (digest {:016x}, expected {:016x})",
                j.facility_digest, self.cfg.facility_digest
            ));
        }
        if j.host.is_empty() || j.host.len() > 256 {
            return Err("host id must have 1 to 256 bytes".into());
        }
        if self.drained.contains(&j.host) {
            return Err(format!("host {} is drained", j.host));
        }
        self.check_entries(&j.entries)?;
        let nf = self.facilities.len() as u32;
        if j.last_d.iter().any(|e| e.0 >= nf || !e.1.is_finite()) {
            return Err("last_d must name known facilities with finite values".into());
        }
        if !j.pairs.windows(2).all(|w| w[0].0 < w[1].0) || j.pairs.iter().any(|p| p.0 >= nf) {
            return Err("pair counts must name known facilities in ascending order".into());
        }
        Ok(())
    }

    fn check_entries(&self, entries: &[(u32, f64)]) -> Result<(), String> {
        let nf = self.facilities.len() as u32;
        if !entries.windows(2).all(|w| w[0].0 < w[1].0) {
            return Err("contribution entries must be in ascending facility order".into());
        }
        if let Some(e) = entries
            .iter()
            .find(|e| e.0 >= nf || !e.1.is_finite() || e.1 < 0.0)
        {
            return Err(format!("bad contribution entry {e:?}"));
        }
        Ok(())
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
        if let Some(m) = self.members.remove(&id) {
            if self.hosts.get(&m.host) == Some(&id) {
                self.hosts.remove(&m.host);
            }
            self.membership_changed = true;
            if why == LeaveReason::TimedOut {
                out.push(Action::Close(id, "heartbeat timeout".into()));
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
            self.epoch += 1;
            self.round = None;
            if self.quorum() {
                let counts = self.counts();
                let sums = self.sums();
                self.admm.set_counts(&counts);
                if self.started {
                    self.admm.set_sums(&sums);
                } else {
                    // Cold start, as the in-process engine: a full update on the first sums;
                    // if the agents report the d they last stepped with, the duals resume.
                    self.restore_duals(&counts);
                    self.residuals = self.admm.update(&self.facilities, &sums);
                    self.started = true;
                }
            }
        }
        if let Some(r) = &self.round {
            if r.waiting.is_empty() {
                self.complete_round(now, 0, out);
            }
        }
        if self.round.is_none() && self.can_run() {
            let due = self
                .last_round_start
                .is_none_or(|t| now >= t + self.cfg.round_interval);
            if due {
                self.start_round(now, out);
            }
        }
    }

    /// After a coordinator restart: `u_f = n_f·d_f` from the freshest report per facility,
    /// exact at convergence (`d_f = (u_f + s_f − y_f)/n_f` with `s_f = y_f`). Prices thus
    /// survive the restart instead of climbing again from zero.
    fn restore_duals(&mut self, counts: &[u32]) {
        let mut best: Vec<Option<(u64, f64)>> = vec![None; self.facilities.len()];
        for m in self.members.values() {
            for &(f, d) in &m.last_d {
                let b = &mut best[f as usize];
                if b.is_none_or(|(it, _)| m.entries_iteration > it) {
                    *b = Some((m.entries_iteration, d));
                }
            }
        }
        for (f, b) in best.into_iter().enumerate() {
            if let Some((_, d)) = b {
                if counts[f] > 0 {
                    self.admm.facilities[f].u = counts[f] as f64 * d;
                }
            }
        }
    }

    fn start_round(&mut self, now: Duration, out: &mut Vec<Action>) {
        let iteration = self.iteration + 1;
        for (&id, m) in &self.members {
            let d = m.pairs.iter().map(|&(f, _)| (f, self.admm.d(f))).collect();
            out.push(Action::Send(
                id,
                CoordMsg::Round {
                    epoch: self.epoch,
                    iteration,
                    rho: self.cfg.rho,
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
        self.residuals = self.admm.update(&self.facilities, &sums);
        self.iteration = r.iteration;
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::admm::HostState;
    use crate::generator::{generate, GeneratorConfig};
    use crate::protocol::agent::{AgentAction, AgentConfig, AgentCore};
    use crate::protocol::facility_digest;
    use crate::solver::{default_rho, fixed_set_trace, Algorithm};

    const MS: Duration = Duration::from_millis(1);

    fn cfg(digest: u64, rho: f64, min_members: usize) -> CoordinatorConfig {
        CoordinatorConfig {
            rho,
            facility_digest: digest,
            heartbeat_interval: 100 * MS,
            member_timeout: 1000 * MS,
            round_deadline: 50 * MS,
            max_staleness: 2,
            round_interval: Duration::ZERO,
            min_members,
            max_iterations: None,
        }
    }

    fn sends(out: &[Action]) -> Vec<(MemberId, CoordMsg)> {
        out.iter()
            .filter_map(|a| match a {
                Action::Send(id, m) => Some((*id, m.clone())),
                _ => None,
            })
            .collect()
    }

    fn facility(id: &str) -> Facility {
        Facility {
            id: id.into(),
            capacity: 1.0,
            cost: 0.0,
        }
    }

    fn join(host: &str, digest: u64, f: u32, v: f64) -> AgentMsg {
        AgentMsg::Join(Join {
            host: host.into(),
            facility_digest: digest,
            pairs: vec![(f, 1)],
            entries: vec![(f, v)],
            last_iteration: 0,
            last_d: Vec::new(),
        })
    }

    fn contrib(epoch: u64, iteration: u64, f: u32, v: f64) -> AgentMsg {
        AgentMsg::Contribution(ContributionMsg {
            epoch,
            iteration,
            entries: vec![(f, v)],
        })
    }

    /// Two hosts on facilities 0 and 1: the coordinator waits for both, then rounds go out with
    /// only each host's own facility.
    #[test]
    fn rounds_start_at_min_members_and_carry_only_own_facilities() {
        let mut c = Coordinator::new(cfg(7, 1.0, 2), vec![facility("a"), facility("b")]);
        let out = c.on_message(Duration::ZERO, 1, join("h1", 7, 0, 0.5));
        assert!(sends(&out)
            .iter()
            .all(|(_, m)| matches!(m, CoordMsg::Welcome { .. })));
        let out = c.on_message(MS, 2, join("h2", 7, 1, 2.0));
        let rounds: Vec<_> = sends(&out)
            .into_iter()
            .filter(|(_, m)| matches!(m, CoordMsg::Round { .. }))
            .collect();
        assert_eq!(rounds.len(), 2);
        for (id, m) in rounds {
            let CoordMsg::Round { d, iteration, .. } = m else {
                unreachable!()
            };
            assert_eq!(iteration, 1);
            assert_eq!(d.len(), 1);
            assert_eq!(d[0].0, (id - 1) as u32);
        }
        // Facility b is over capacity (2 > 1): its price is positive.
        assert!(c.price(1) > 0.0 && c.price(0) == 0.0);
    }

    #[test]
    fn wrong_digest_and_bad_entries_are_refused() {
        let mut c = Coordinator::new(cfg(7, 1.0, 1), vec![facility("a")]);
        let out = c.on_message(Duration::ZERO, 1, join("h1", 8, 0, 0.5));
        assert!(out.iter().any(|a| matches!(a, Action::Close(1, _))));
        assert_eq!(c.members(), 0);
        let out = c.on_message(Duration::ZERO, 2, join("h2", 7, 5, 0.5));
        assert!(out.iter().any(|a| matches!(a, Action::Close(2, _))));
        let out = c.on_message(Duration::ZERO, 3, join("h3", 7, 0, f64::NAN));
        assert!(out.iter().any(|a| matches!(a, Action::Close(3, _))));
        let out = c.on_message(Duration::ZERO, 4, AgentMsg::Heartbeat { seq: 1 });
        assert!(out.iter().any(|a| matches!(a, Action::Close(4, _))));
        assert_eq!(c.counters().refused, 4);
    }

    #[test]
    fn late_duplicate_and_future_contributions_are_told_apart_by_number() {
        let mut c = Coordinator::new(cfg(7, 1.0, 2), vec![facility("a")]);
        c.on_message(Duration::ZERO, 1, join("h1", 7, 0, 0.2));
        c.on_message(Duration::ZERO, 2, join("h2", 7, 0, 0.2));
        let e = c.epoch();
        c.on_message(MS, 1, contrib(e, 1, 0, 0.3));
        // A repeat of the same round is a duplicate and changes nothing.
        c.on_message(MS, 1, contrib(e, 1, 0, 9.0));
        assert_eq!(c.counters().duplicates, 1);
        assert_eq!(c.iteration(), 0);
        c.on_message(MS, 2, contrib(e, 1, 0, 0.3));
        assert_eq!(c.iteration(), 1);
        assert!((c.status().facilities[0].usage - 0.6).abs() < 1e-12);
        // Round 1 again, now that round 2 runs: a duplicate of a number already held.
        c.on_message(2 * MS, 2, contrib(e, 1, 0, 0.3));
        assert_eq!(c.counters().duplicates, 2);
        // Round 5 does not exist yet: a protocol violation closes the connection.
        assert_eq!(c.iteration(), 1);
        let out = c.on_message(2 * MS, 2, contrib(e, 5, 0, 0.3));
        assert!(out.iter().any(|a| matches!(a, Action::Close(2, _))));
        assert_eq!(c.members(), 1);
    }

    #[test]
    fn stragglers_are_reused_up_to_the_bound_then_waited_for() {
        let mut c = Coordinator::new(cfg(7, 1.0, 2), vec![facility("a")]);
        c.on_message(Duration::ZERO, 1, join("h1", 7, 0, 0.2));
        c.on_message(Duration::ZERO, 2, join("h2", 7, 0, 0.2));
        let e = c.epoch();
        let mut now = Duration::ZERO;
        // h2 never answers; h1 answers every round (and heartbeats keep h2 alive).
        for it in 1..=2 {
            c.on_message(now, 1, contrib(e, it, 0, 0.3));
            c.on_message(now, 2, AgentMsg::Heartbeat { seq: it });
            now += 60 * MS;
            let out = c.tick(now);
            assert!(out
                .iter()
                .any(|a| matches!(a, Action::Event(Event::RoundDone { stale: 1, .. }))));
            assert_eq!(c.iteration(), it);
        }
        // Third round: h2 has been reused twice (the bound), so the round waits.
        c.on_message(now, 1, contrib(e, 3, 0, 0.3));
        c.on_message(now, 2, AgentMsg::Heartbeat { seq: 3 });
        now += 60 * MS;
        c.tick(now);
        assert_eq!(c.iteration(), 2);
        assert_eq!(c.counters().stale_reuses, 2);
        // h2's answer to round 1 is late: kept as its latest, not counted for round 3.
        c.on_message(now, 2, contrib(e, 1, 0, 0.25));
        assert_eq!(c.counters().late, 1);
        assert_eq!(c.iteration(), 2);
        c.on_message(now, 2, contrib(e, 3, 0, 0.25));
        assert_eq!(c.iteration(), 3);
    }

    #[test]
    fn silent_member_is_dropped_after_the_timeout_and_its_contribution_removed() {
        let mut c = Coordinator::new(cfg(7, 1.0, 1), vec![facility("a")]);
        c.on_message(Duration::ZERO, 1, join("h1", 7, 0, 0.2));
        c.on_message(Duration::ZERO, 2, join("h2", 7, 0, 0.7));
        let e = c.epoch();
        c.on_message(MS, 1, contrib(e, 1, 0, 0.3));
        c.on_message(MS, 2, contrib(e, 1, 0, 0.7));
        assert!((c.status().facilities[0].usage - 1.0).abs() < 1e-12);
        // Only h1 keeps talking.
        let mut now = MS;
        while now < 1500 * MS {
            now += 100 * MS;
            c.on_message(now, 1, AgentMsg::Heartbeat { seq: 0 });
            c.tick(now);
        }
        assert_eq!(c.members(), 1);
        assert_eq!(c.counters().timeouts, 1);
        assert!(c.epoch() > e);
        let s = c.status();
        assert_eq!(s.facilities[0].pairs, 1);
        assert_eq!(s.members[0].host, "h1");
        // The next completed round sums h1 alone.
        let it = c.iteration();
        c.on_message(now, 1, contrib(c.epoch(), it + 1, 0, 0.4));
        assert!((c.status().facilities[0].usage - 0.4).abs() < 1e-12);
    }

    #[test]
    fn timeout_of_a_member_the_round_waits_for_starts_a_new_epoch() {
        let mut c = Coordinator::new(cfg(7, 1.0, 2), vec![facility("a")]);
        c.on_message(Duration::ZERO, 1, join("h1", 7, 0, 0.2));
        c.on_message(Duration::ZERO, 2, join("h2", 7, 0, 0.2));
        let e = c.epoch();
        c.on_message(MS, 1, contrib(e, 1, 0, 0.3));
        // h2 never answers (h1 stays alive); one late tick passes h2's timeout and the deadline.
        c.on_message(1500 * MS, 1, AgentMsg::Heartbeat { seq: 1 });
        let out = c.tick(2000 * MS);
        assert!(out.iter().any(|a| matches!(a, Action::Close(2, _))));
        assert_eq!(c.members(), 1);
        assert!(c.epoch() > e);
        // The round restarts for h1 alone under the new epoch.
        let rounds: Vec<_> = sends(&out)
            .into_iter()
            .filter(|(_, m)| matches!(m, CoordMsg::Round { .. }))
            .collect();
        assert_eq!(rounds.len(), 1);
        assert_eq!(rounds[0].0, 1);
    }

    #[test]
    fn answer_to_a_round_abandoned_at_an_epoch_change_is_not_a_violation() {
        let mut c = Coordinator::new(
            CoordinatorConfig {
                round_interval: 10 * MS,
                ..cfg(7, 1.0, 1)
            },
            vec![facility("a")],
        );
        c.on_message(Duration::ZERO, 1, join("h1", 7, 0, 0.2));
        let e = c.epoch();
        // Round 1 runs; h2 joins, which abandons it, and the next round waits for the interval.
        c.on_message(MS, 2, join("h2", 7, 0, 0.2));
        assert_eq!(c.iteration(), 0);
        let out = c.on_message(2 * MS, 1, contrib(e, 1, 0, 0.3));
        assert!(
            !out.iter().any(|a| matches!(a, Action::Close(..))),
            "{out:?}"
        );
        assert_eq!(c.members(), 2);
    }

    #[test]
    fn rejoin_of_a_host_replaces_its_old_connection() {
        let mut c = Coordinator::new(cfg(7, 1.0, 1), vec![facility("a")]);
        c.on_message(Duration::ZERO, 1, join("h1", 7, 0, 0.2));
        let out = c.on_message(MS, 2, join("h1", 7, 0, 0.2));
        assert!(out.iter().any(|a| matches!(a, Action::Close(1, _))));
        assert_eq!(c.members(), 1);
        assert_eq!(c.status().members[0].member, 2);
    }

    #[test]
    fn drained_host_is_removed_and_refused_until_undrained() {
        let mut c = Coordinator::new(cfg(7, 1.0, 1), vec![facility("a")]);
        c.on_message(Duration::ZERO, 1, join("h1", 7, 0, 0.2));
        c.on_message(Duration::ZERO, 2, join("h2", 7, 0, 0.5));
        let e = c.epoch();
        let out = c.drain(MS, "h2");
        assert!(out.iter().any(|a| matches!(a, Action::Close(2, _))));
        assert_eq!(c.members(), 1);
        assert!(c.epoch() > e);
        assert_eq!(c.status().facilities[0].pairs, 1);
        let out = c.on_message(2 * MS, 3, join("h2", 7, 0, 0.5));
        assert!(out.iter().any(|a| matches!(a, Action::Close(3, _))));
        assert_eq!(c.members(), 1);
        assert!(c.undrain("h2"));
        c.on_message(3 * MS, 4, join("h2", 7, 0, 0.5));
        assert_eq!(c.members(), 2);
    }

    #[test]
    fn restarted_coordinator_rebuilds_prices_from_the_agents_last_d() {
        let fac = vec![facility("a")];
        let mut c = Coordinator::new(cfg(7, 2.0, 2), fac.clone());
        c.on_message(Duration::ZERO, 1, join("h1", 7, 0, 0.8));
        c.on_message(Duration::ZERO, 2, join("h2", 7, 0, 0.8));
        // Over capacity: iterate with constant usage until the price settles.
        for it in 1..=50 {
            let e = c.epoch();
            c.on_message(MS, 1, contrib(e, it, 0, 0.5));
            c.on_message(MS, 2, contrib(e, it, 0, 0.5));
        }
        let price = c.price(0);
        assert!(price > 0.0);
        let d = c.admm.d(0);
        // A new coordinator; both agents rejoin with their last d and current usage.
        let mut r = Coordinator::new(cfg(7, 2.0, 2), fac);
        for (id, host) in [(1, "h1"), (2, "h2")] {
            r.on_message(
                Duration::ZERO,
                id,
                AgentMsg::Join(Join {
                    host: host.into(),
                    facility_digest: 7,
                    pairs: vec![(0, 1)],
                    entries: vec![(0, 0.5)],
                    last_iteration: 50,
                    last_d: vec![(0, d)],
                }),
            );
        }
        assert_eq!(r.iteration(), 50);
        assert!(
            (r.price(0) - price).abs() <= 1e-9 * price.max(1.0),
            "{} vs {price}",
            r.price(0)
        );
    }

    /// The pure machines wired back to back equal the in-process solver on fixed active sets.
    #[test]
    fn in_memory_cluster_matches_the_in_process_solver() {
        let problem = generate(&GeneratorConfig {
            k: 3,
            seed: 5,
            ..GeneratorConfig::new(6, 5)
        });
        let active = crate::protocol::fixed_active_sets(&problem);
        let rho = default_rho(&problem);
        let iters = 60;
        let (_, reference) =
            fixed_set_trace(&problem, active.clone(), Algorithm::Admm, rho, iters, 0.0);
        let digest = facility_digest(&problem);
        let mut coord = Coordinator::new(
            CoordinatorConfig {
                max_iterations: Some(iters as u64),
                ..cfg(digest, rho, problem.hosts.len())
            },
            problem.facilities.clone(),
        );
        let acfg = AgentConfig {
            heartbeat_interval: 100 * MS,
            coordinator_timeout: 1000 * MS,
            backoff_min: 10 * MS,
            backoff_max: 100 * MS,
        };
        let mut agents: Vec<AgentCore> = active
            .iter()
            .enumerate()
            .map(|(h, a)| {
                AgentCore::new(
                    &problem,
                    HostState::new(&problem, h, a.clone()),
                    acfg.clone(),
                )
            })
            .collect();
        let now = Duration::ZERO;
        let mut inbox: Vec<(MemberId, CoordMsg)> = Vec::new();
        for (i, a) in agents.iter_mut().enumerate() {
            for act in a.on_connected(now, &problem) {
                if let AgentAction::Send(m) = act {
                    inbox.extend(sends(&coord.on_message(now, i as MemberId, m)));
                }
            }
        }
        while !inbox.is_empty() {
            let batch = std::mem::take(&mut inbox);
            for (id, msg) in batch {
                for act in agents[id as usize].on_message(now, &problem, msg) {
                    if let AgentAction::Send(m) = act {
                        inbox.extend(sends(&coord.on_message(now, id, m)));
                    }
                }
            }
        }
        assert_eq!(coord.iteration(), iters as u64);
        for (a, r) in agents.iter().zip(&reference) {
            assert_eq!(a.state().active, r.active);
            for (x, y) in a.state().x.iter().zip(&r.x) {
                assert!((x - y).abs() < 1e-9, "{x} vs {y}");
            }
        }
    }
}
