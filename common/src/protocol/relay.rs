//! The relay's state machine: one relay per rack terminates its agents' connections, speaks
//! to them as a coordinator would, and is **one member** of the coordinator, whose `Join`,
//! `Update` and `Contribution` carry the rack's per-facility sums (docs/control-plane.md,
//! "Relays").
//!
//! The coordinator uses a member's messages only through per-facility sums — `n_f` is the
//! sum of the members' pair counts, `Σ b·x` the sum of their entries — so a rack summed at its
//! relay gives the coordinator the same `n_f` and sums as its hosts would, with one `Round`
//! and one `Contribution` per rack instead of one per host.
//!
//! * **Upstream.** The relay joins the coordinator once `min_agents` agents have joined it,
//!   with the rack's sums; every later change of the rack (a join, a departure) is an `Update`
//!   with the new sums, which starts a new epoch at the coordinator, as a host's join or
//!   departure does. Agents get the coordinator's epoch and round numbers unchanged.
//! * **Rounds.** A `Round` goes to every agent with the `d` of its own facilities; when all
//!   have answered, one `Contribution` with the sum goes up. At `round_deadline` the
//!   stragglers' last contributions are reused, at most `max_staleness` times in a row (as
//!   the coordinator does); otherwise the round waits for them or their timeout.
//! * **Failure.** A relay that loses the coordinator closes every agent's connection and
//!   refuses joins until it is back, so its agents fail static exactly as they would on
//!   losing the coordinator. A dead relay is a dead coordinator to its agents, and one silent
//!   member to the coordinator.
//! * **Selection.** A `Select` goes to every agent with the prices of its own interest; their
//!   proposals go up as one `RackProposals`, each with its agent's rank, and the coordinator
//!   decides each at that rank against the global floors, as it would a host of its own, and
//!   answers with `RackVerdicts`. The agents' verdicts go down, their `Selected` come back and
//!   go up as one, the rack's sums. A `Restart` goes to every agent and its `Selected` up the
//!   same way. An agent that does not answer a phase within a third of the member timeout is
//!   dropped (it rejoins with its true sets), and the exchange goes on without it, as at the
//!   coordinator. `Reselect` and `Changed` go up as they came.
//! * **The live problem** (a relay without an instance file, `live`): the coordinator's
//!   `Policy` and facility table go to every agent (and to later ones after their `Welcome`),
//!   the agents' `Update`s change the rack's sums (one `Update` up), and each agent's `Host`
//!   report goes up named, as `RackHost` (and its departure as a `RackHost` without one), so
//!   the coordinator creates every host's own receive link. A relay with an instance file
//!   leaves a live coordinator with an error, and a live relay's join is refused by a
//!   coordinator with an instance file (its facility digest is 0).

use super::coordinator::MemberId;
use super::wire::{
    check_usage, floor_use_ok, AgentMsg, ContributionMsg, CoordMsg, HostProposal, Join,
    ProposalMsg, RackHostMsg, RackProposalsMsg, SelectedMsg, Shard, UpdateMsg,
};
use crate::admm::FacilityTerm;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Duration;

mod exchange;
mod rounds;
#[cfg(test)]
mod tests;

#[derive(Clone, Debug, PartialEq)]
pub struct RelayConfig {
    /// The relay's host id upstream (its upstream certificate names it).
    pub host: String,
    /// [`super::facility_digest`] of the instance: agents with another are refused.
    pub facility_digest: u64,
    /// Facilities in the instance (entries must name one); 0 for the live problem, whose
    /// table comes from the coordinator.
    pub facilities: u32,
    /// The live problem: no instance file; the coordinator's table and policy are passed on.
    pub live: bool,
    /// Heartbeat interval offered to the agents.
    pub heartbeat_interval: Duration,
    /// Silence after which an agent is dropped.
    pub member_timeout: Duration,
    /// Silence after which the coordinator is taken as lost.
    pub upstream_timeout: Duration,
    /// How long a round waits for every agent before reusing stragglers' contributions;
    /// shorter than the coordinator's, so that the rack's sum goes up before it gives up.
    pub round_deadline: Duration,
    pub max_staleness: u32,
    /// The relay joins the coordinator once this many agents have joined it.
    pub min_agents: usize,
    /// Reconnection backoff to the coordinator: `backoff_min · 2^failures`, at most
    /// `backoff_max`.
    pub backoff_min: Duration,
    pub backoff_max: Duration,
}

/// What the driver must do.
#[derive(Clone, Debug, PartialEq)]
pub enum RelayAction {
    /// To agent connection `id`.
    Down(MemberId, CoordMsg),
    /// Close an agent's connection (after any message queued before).
    CloseDown(MemberId, String),
    /// Close the connection of an agent that fell silent past its heartbeat timeout: not a
    /// violation, and closed as such, as the coordinator's [`Action::Expire`] does.
    ///
    /// [`Action::Expire`]: super::coordinator::Action::Expire
    ExpireDown(MemberId),
    /// To the coordinator.
    Up(AgentMsg),
    /// Close the coordinator connection; the driver reconnects at [`Relay::connect_due`].
    CloseUp(String),
    Event(RelayEvent),
}

#[derive(Clone, Debug, PartialEq)]
pub enum RelayEvent {
    AgentJoined {
        member: MemberId,
        host: String,
    },
    AgentLeft {
        member: MemberId,
        host: String,
        why: &'static str,
    },
    AgentRefused {
        member: MemberId,
        reason: String,
    },
    Welcomed {
        epoch: u64,
        iteration: u64,
    },
    /// `agents` closed (they fail static), `waiting` kept (not yet welcomed); `joined`:
    /// whether the relay had sent its rack's `Join` on that connection (a relay that had not
    /// lost nothing: the coordinator closes a connection that does not join in time, and
    /// a slowly assembling rack sees that once per join timeout).
    UpstreamLost {
        reason: String,
        agents: usize,
        waiting: usize,
        joined: bool,
    },
    /// The coordinator asked for something a relay does not do (the live problem), or sent a
    /// selection message out of turn.
    Unsupported(String),
    /// A selection exchange's answers went up: the rack's proposals, or its new sums.
    ExchangeUp {
        exchange: u32,
        proposals: Option<usize>,
    },
    /// A rack round went up; `stale` agents' contributions were reused.
    RoundUp {
        iteration: u64,
        stale: usize,
        took: Duration,
    },
}

#[derive(Clone, Debug)]
struct Agent {
    host: String,
    pairs: Vec<(u32, u32)>,
    entries: Vec<(u32, f64)>,
    entries_iteration: u64,
    last_d: Vec<FacilityTerm>,
    rank: u32,
    interest: Vec<u32>,
    floor: Vec<(u32, f64)>,
    exchanges: u32,
    last_seen: Duration,
    stale: u32,
    /// `Welcome` sent (the relay had the coordinator's).
    welcomed: bool,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Upstream {
    /// No connection; the next attempt at `retry_at`.
    Down { retry_at: Duration, failures: u32 },
    /// Connected, no `Join` sent yet (too few agents).
    Connected,
    /// `Join` sent, no `Welcome` yet.
    Joining,
    Member {
        epoch: u64,
        iteration: u64,
        heartbeat: Duration,
        shard: Shard,
    },
}

/// A selection exchange passing the relay.
#[derive(Clone, Debug)]
struct RackExchange {
    index: u32,
    phase: RackPhase,
    /// When the current phase began (its deadline for the agents runs from here).
    started: Duration,
    waiting: BTreeSet<MemberId>,
    proposals: BTreeMap<MemberId, ProposalMsg>,
    /// The agents of the `RackProposals` sent, in its order.
    order: Vec<MemberId>,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum RackPhase {
    /// `Select` sent down; collecting proposals.
    Propose,
    /// `RackProposals` sent up; waiting for the coordinator's verdicts.
    Verdicts,
    /// Verdicts or `Restart` sent down; collecting the agents' new sets.
    Apply,
}

#[derive(Clone, Debug)]
struct Round {
    epoch: u64,
    iteration: u64,
    started: Duration,
    waiting: BTreeSet<MemberId>,
}

pub struct Relay {
    cfg: RelayConfig,
    up: Upstream,
    up_heard: Duration,
    next_heartbeat: Duration,
    heartbeat_seq: u64,
    agents: BTreeMap<MemberId, Agent>,
    hosts: HashMap<String, MemberId>,
    round: Option<Round>,
    /// The highest round number sent down; a contribution beyond it is a violation.
    sent: (u64, u64),
    exchange: Option<RackExchange>,
    /// The highest exchange sent down; an answer beyond it is a violation.
    sent_exchange: Option<u32>,
    /// Facilities known: the instance's, or the live coordinator's table's.
    nf: u32,
    /// The live coordinator's policy and facility table, for agents that join later.
    policy: Option<CoordMsg>,
    table: Option<CoordMsg>,
    /// The operator's weights, for agents that join later.
    weights: BTreeMap<String, f64>,
    /// The rack changed since the coordinator last heard its sums.
    changed: bool,
    /// Refusals by the coordinator since its last `Welcome`; sets the backoff.
    refusals: u32,
    last_scan: Duration,
}

/// The sum over agents of per-facility lists, facility ascending.
fn sum<T: Copy + std::ops::AddAssign + Default>(
    lists: impl Iterator<Item = impl IntoIterator<Item = (u32, T)>>,
) -> Vec<(u32, T)> {
    let mut acc: BTreeMap<u32, T> = BTreeMap::new();
    for l in lists {
        for (f, v) in l {
            *acc.entry(f).or_default() += v;
        }
    }
    acc.into_iter().collect()
}

impl Relay {
    pub fn new(cfg: RelayConfig) -> Self {
        let nf = cfg.facilities;
        Self {
            cfg,
            up: Upstream::Down {
                retry_at: Duration::ZERO,
                failures: 0,
            },
            up_heard: Duration::ZERO,
            next_heartbeat: Duration::ZERO,
            heartbeat_seq: 0,
            agents: BTreeMap::new(),
            hosts: HashMap::new(),
            round: None,
            sent: (0, 0),
            exchange: None,
            sent_exchange: None,
            nf,
            policy: None,
            table: None,
            weights: BTreeMap::new(),
            changed: false,
            refusals: 0,
            last_scan: Duration::ZERO,
        }
    }

    /// Agents that are members (welcomed or waiting for the relay's own welcome).
    pub fn agents(&self) -> usize {
        self.agents.len()
    }

    /// Whether the relay is a member of the coordinator.
    pub fn is_member(&self) -> bool {
        matches!(self.up, Upstream::Member { .. })
    }

    /// Whether the driver should try to connect to the coordinator now.
    pub fn connect_due(&self, now: Duration) -> bool {
        matches!(self.up, Upstream::Down { retry_at, .. } if now >= retry_at)
    }

    /// The coordinator connection is up.
    pub fn on_upstream_connected(&mut self, now: Duration) -> Vec<RelayAction> {
        self.up = Upstream::Connected;
        self.up_heard = now;
        let mut out = Vec::new();
        self.maybe_join(&mut out);
        out
    }

    /// A connection attempt failed: back off.
    pub fn on_connect_failed(&mut self, now: Duration) {
        let failures = match self.up {
            Upstream::Down { failures, .. } => failures + 1,
            _ => 1,
        };
        self.up = Upstream::Down {
            retry_at: now + self.backoff(failures),
            failures,
        };
    }

    fn backoff(&self, failures: u32) -> Duration {
        let exp = self
            .cfg
            .backoff_min
            .saturating_mul(1u32 << failures.min(16));
        exp.min(self.cfg.backoff_max)
    }

    /// The coordinator is lost (transport error, close, refusal or silence): every agent's
    /// connection is closed, so that each fails static as it would without a relay.
    pub fn on_upstream_lost(&mut self, now: Duration, reason: &str) -> Vec<RelayAction> {
        self.lose_upstream(now, reason, false)
    }

    /// As [`Self::on_upstream_lost`]; `refused`: the coordinator refused the relay (drained,
    /// or a configuration it does not serve), which the agents waiting for their first
    /// welcome are told as well.
    fn lose_upstream(&mut self, now: Duration, reason: &str, refused: bool) -> Vec<RelayAction> {
        let mut out = Vec::new();
        if matches!(self.up, Upstream::Down { .. }) {
            return out;
        }
        // Welcomed agents had the coordinator through the relay and fail static as they would
        // on losing it. Agents still waiting for their first welcome had nothing to lose: they
        // go on waiting, so that a rack that assembles more slowly than the coordinator's join
        // timeout (which closes a relay that has not joined) still assembles.
        let welcomed: Vec<MemberId> = self
            .agents
            .iter()
            .filter(|(_, a)| a.welcomed || refused)
            .map(|(&id, _)| id)
            .collect();
        out.push(RelayAction::Event(RelayEvent::UpstreamLost {
            reason: reason.to_string(),
            agents: welcomed.len(),
            waiting: self.agents.len() - welcomed.len(),
            joined: self.up != Upstream::Connected,
        }));
        let why = format!("the relay lost the coordinator: {reason}");
        for id in welcomed {
            out.push(RelayAction::CloseDown(id, why.clone()));
            if let Some(a) = self.agents.remove(&id) {
                self.hosts.remove(&a.host);
            }
        }
        self.round = None;
        self.exchange = None;
        // A new coordinator numbers its own facilities.
        self.policy = None;
        self.table = None;
        if self.cfg.live {
            self.nf = 0;
        }
        self.changed = false;
        self.up = Upstream::Down {
            retry_at: now + self.backoff(0),
            failures: 0,
        };
        out
    }

    /// A message from the coordinator.
    pub fn on_upstream(&mut self, now: Duration, msg: CoordMsg) -> Vec<RelayAction> {
        self.up_heard = now;
        let mut out = Vec::new();
        match msg {
            CoordMsg::Welcome {
                epoch,
                iteration,
                heartbeat_ms,
                shard,
            } => {
                let heartbeat =
                    Duration::from_millis(heartbeat_ms.max(1)).min(self.cfg.upstream_timeout / 3);
                self.up = Upstream::Member {
                    epoch,
                    iteration,
                    heartbeat,
                    shard,
                };
                self.next_heartbeat = now + heartbeat;
                self.refusals = 0;
                out.push(RelayAction::Event(RelayEvent::Welcomed {
                    epoch,
                    iteration,
                }));
                for (&id, a) in self.agents.iter_mut().filter(|(_, a)| !a.welcomed) {
                    a.welcomed = true;
                    out.push(RelayAction::Down(
                        id,
                        self_welcome(&self.cfg, epoch, iteration, shard),
                    ));
                    out.extend(after_welcome(id, &self.weights, &self.policy, &self.table));
                }
                // Agents that joined while the join was on its way.
                self.flush_update(&mut out);
            }
            CoordMsg::Refused { reason } => {
                out.extend(self.lose_upstream(now, &format!("refused: {reason}"), true));
                out.push(RelayAction::CloseUp(format!("refused: {reason}")));
                // A drained relay asks ever less often, as a refused agent does.
                self.refusals += 1;
                self.up = Upstream::Down {
                    retry_at: now + self.backoff(self.refusals),
                    failures: self.refusals,
                };
            }
            CoordMsg::HeartbeatAck { .. } => {}
            CoordMsg::Round {
                epoch,
                iteration,
                d,
            } => self.round_down(now, epoch, iteration, d, &mut out),
            CoordMsg::SetWeight { app, weight } => {
                self.weights.insert(app.clone(), weight);
                for (&id, _) in self.agents.iter().filter(|(_, a)| a.welcomed) {
                    out.push(RelayAction::Down(
                        id,
                        CoordMsg::SetWeight {
                            app: app.clone(),
                            weight,
                        },
                    ));
                }
            }
            CoordMsg::Select {
                exchange,
                round,
                prices,
                options,
            } => self.select_down(
                now,
                exchange,
                RackPhase::Propose,
                |a| CoordMsg::Select {
                    exchange,
                    round,
                    prices: prices
                        .iter()
                        .filter(|e| a.interest.binary_search(&e.0).is_ok())
                        .copied()
                        .collect(),
                    options,
                },
                &mut out,
            ),
            CoordMsg::Restart { exchange, prices } => self.select_down(
                now,
                exchange,
                RackPhase::Apply,
                |_| CoordMsg::Restart {
                    exchange,
                    prices: prices.clone(),
                },
                &mut out,
            ),
            CoordMsg::RackVerdicts { exchange, activate } => {
                self.verdicts_down(now, exchange, activate, &mut out)
            }
            CoordMsg::Verdict { exchange, .. } => out.push(self.unsupported(format!(
                "selection exchange {exchange}: a host's verdict sent to a relay; ignored"
            ))),
            CoordMsg::Policy(_) | CoordMsg::Facilities(_) if !self.cfg.live => {
                let reason = "the coordinator runs the live problem, and this relay has an \
                     instance file"
                    .to_string();
                out.push(self.unsupported(reason.clone()));
                out.extend(self.lose_upstream(now, &reason, true));
                out.push(RelayAction::CloseUp(reason));
            }
            CoordMsg::Policy(_) | CoordMsg::Facilities(_) => {
                if let CoordMsg::Facilities(t) = &msg {
                    self.nf = t.len() as u32;
                }
                for (&id, _) in self.agents.iter().filter(|(_, a)| a.welcomed) {
                    out.push(RelayAction::Down(id, msg.clone()));
                }
                if matches!(msg, CoordMsg::Policy(_)) {
                    self.policy = Some(msg);
                } else {
                    self.table = Some(msg);
                }
            }
        }
        out
    }

    fn unsupported(&self, what: String) -> RelayAction {
        RelayAction::Event(RelayEvent::Unsupported(what))
    }

    /// Live: an agent's report goes up named, for the coordinator to make its host's link.
    fn host_up(&mut self, from: MemberId, r: crate::live::HostReport, out: &mut Vec<RelayAction>) {
        if let Err(e) = r.check(self.nf as usize) {
            self.violation(from, format!("bad host report: {e}"), out);
            return;
        }
        if self.is_member() {
            let host = self.agents[&from].host.clone();
            out.push(RelayAction::Up(AgentMsg::RackHost(RackHostMsg {
                host,
                report: Some(r),
            })));
        }
    }

    /// Live: an agent's problem changed; the rack's new sums go up (a new epoch there).
    fn agent_update(&mut self, from: MemberId, u: UpdateMsg, out: &mut Vec<RelayAction>) {
        let checked = u.check_shape(self.nf);
        if let Err(e) = checked {
            self.violation(from, e, out);
            return;
        }
        let a = self.agents.get_mut(&from).expect("a member");
        a.pairs = u.pairs;
        a.entries = u.entries;
        a.interest = u.interest;
        a.floor = u.floor;
        a.last_d = u.last_d;
        self.changed = true;
    }

    /// A message from agent connection `from`.
    pub fn on_agent(&mut self, now: Duration, from: MemberId, msg: AgentMsg) -> Vec<RelayAction> {
        let mut out = Vec::new();
        if let Some(a) = self.agents.get_mut(&from) {
            a.last_seen = now;
        }
        let member = self.agents.contains_key(&from);
        match msg {
            AgentMsg::Join(j) => self.join(now, from, j, &mut out),
            _ if !member => self.violation(from, "message before join".into(), &mut out),
            AgentMsg::Heartbeat { seq } => {
                out.push(RelayAction::Down(from, CoordMsg::HeartbeatAck { seq }))
            }
            AgentMsg::Leave => self.remove(from, "left", &mut out),
            AgentMsg::Contribution(c) => self.contribution(now, from, c, &mut out),
            AgentMsg::Reselect { .. } | AgentMsg::Changed => {
                if self.is_member() {
                    out.push(RelayAction::Up(msg));
                }
            }
            AgentMsg::Proposal(p) => self.proposal(from, p, &mut out),
            AgentMsg::Selected(sel) => self.selected(from, sel, &mut out),
            AgentMsg::RackProposals(_) => {
                self.violation(from, "a relay's proposals from an agent".into(), &mut out)
            }
            AgentMsg::Host(_) | AgentMsg::Update(_) if !self.cfg.live => self.violation(
                from,
                "the live problem does not pass a relay with an instance file".into(),
                &mut out,
            ),
            AgentMsg::Host(r) => self.host_up(from, r, &mut out),
            AgentMsg::Update(u) => self.agent_update(from, u, &mut out),
            AgentMsg::RackHost(_) => {
                self.violation(from, "a relay's host report from an agent".into(), &mut out)
            }
        }
        self.exchange_progress(&mut out);
        self.flush_update(&mut out);
        out
    }

    /// Agent connection `from` ended (`timed_out`: its idle timeout ended it).
    pub fn on_agent_gone(
        &mut self,
        now: Duration,
        from: MemberId,
        timed_out: bool,
    ) -> Vec<RelayAction> {
        let mut out = Vec::new();
        self.remove(
            from,
            if timed_out {
                "timed out"
            } else {
                "disconnected"
            },
            &mut out,
        );
        self.exchange_progress(&mut out);
        self.flush_update(&mut out);
        self.maybe_complete(now, 0, &mut out);
        out
    }

    fn check_join(&self, j: &Join) -> Result<(), String> {
        let nf = self.nf;
        if !self.cfg.live && j.facility_digest != self.cfg.facility_digest {
            return Err(format!(
                "facility list differs from the relay's (digest {:016x}, expected {:016x})",
                j.facility_digest, self.cfg.facility_digest
            ));
        }
        j.check_shape(nf)
    }

    fn refuse(&mut self, from: MemberId, reason: String, out: &mut Vec<RelayAction>) {
        out.push(RelayAction::Event(RelayEvent::AgentRefused {
            member: from,
            reason: reason.clone(),
        }));
        out.push(RelayAction::Down(
            from,
            CoordMsg::Refused {
                reason: reason.clone(),
            },
        ));
        out.push(RelayAction::CloseDown(from, reason));
    }

    fn join(&mut self, now: Duration, from: MemberId, j: Join, out: &mut Vec<RelayAction>) {
        if self.agents.contains_key(&from) {
            self.violation(from, "second join on one connection".into(), out);
            return;
        }
        if matches!(self.up, Upstream::Down { .. }) {
            // Without a coordinator the agent must stay fail-static, as it would if it
            // reached no coordinator at all; it retries with its backoff.
            self.refuse(from, "the relay has no coordinator".into(), out);
            return;
        }
        if let Err(reason) = self.check_join(&j) {
            self.refuse(from, reason, out);
            return;
        }
        if let Some(&old) = self.hosts.get(&j.host) {
            // The coordinator's rule: a live incumbent keeps its place.
            let quiet = now.saturating_sub(self.agents[&old].last_seen);
            if quiet <= 2 * self.cfg.heartbeat_interval {
                let reason = format!(
                    "host {} is already a member on another connection, heard from {} ms ago: \
                     is a second agent running with this host id?",
                    j.host,
                    quiet.as_millis()
                );
                self.refuse(from, reason, out);
                return;
            }
            self.remove(old, "replaced", out);
            out.push(RelayAction::CloseDown(
                old,
                format!("host {} rejoined", j.host),
            ));
        }
        let welcome = match self.up {
            Upstream::Member {
                epoch,
                iteration,
                shard,
                ..
            } => Some(self_welcome(&self.cfg, epoch, iteration, shard)),
            _ => None,
        };
        self.hosts.insert(j.host.clone(), from);
        self.agents.insert(
            from,
            Agent {
                host: j.host.clone(),
                pairs: j.pairs,
                entries: j.entries,
                entries_iteration: j.last_iteration,
                last_d: j.last_d,
                rank: j.rank,
                interest: j.interest,
                floor: j.floor,
                exchanges: j.exchanges,
                last_seen: now,
                stale: 0,
                welcomed: welcome.is_some(),
            },
        );
        out.push(RelayAction::Event(RelayEvent::AgentJoined {
            member: from,
            host: j.host,
        }));
        if let Some(w) = welcome {
            out.push(RelayAction::Down(from, w));
            out.extend(after_welcome(
                from,
                &self.weights,
                &self.policy,
                &self.table,
            ));
        }
        self.changed = true;
        self.maybe_join(out);
    }

    /// Joins the coordinator with the rack's sums once enough agents are in.
    fn maybe_join(&mut self, out: &mut Vec<RelayAction>) {
        if self.up == Upstream::Connected && self.agents.len() >= self.cfg.min_agents.max(1) {
            out.push(RelayAction::Up(AgentMsg::Join(self.aggregate())));
            self.up = Upstream::Joining;
            self.changed = false;
        }
    }

    /// The rack as one member: sums of pairs, entries and floors, the union of interests,
    /// the freshest `last_d` per facility.
    fn aggregate(&self) -> Join {
        let agents = || self.agents.values();
        let mut last_d: BTreeMap<u32, (u64, FacilityTerm)> = BTreeMap::new();
        for a in agents() {
            for t in &a.last_d {
                let e = last_d
                    .entry(t.facility)
                    .or_insert((a.entries_iteration, *t));
                if a.entries_iteration > e.0 {
                    *e = (a.entries_iteration, *t);
                }
            }
        }
        let interest: BTreeSet<u32> = agents().flat_map(|a| a.interest.iter().copied()).collect();
        Join {
            host: self.cfg.host.clone(),
            facility_digest: self.cfg.facility_digest,
            pairs: sum(agents().map(|a| a.pairs.iter().copied())),
            entries: sum(agents().map(|a| a.entries.iter().copied())),
            last_iteration: agents().map(|a| a.entries_iteration).max().unwrap_or(0),
            last_d: last_d.into_values().map(|(_, t)| t).collect(),
            rank: agents().map(|a| a.rank).min().unwrap_or(0),
            interest: interest.into_iter().collect(),
            floor: sum(agents().map(|a| a.floor.iter().copied())),
            exchanges: agents().map(|a| a.exchanges).max().unwrap_or(0),
        }
    }

    /// Tells the coordinator the rack's new sums, if it changed; the coordinator starts a new
    /// epoch, so the round in progress is abandoned here too.
    fn flush_update(&mut self, out: &mut Vec<RelayAction>) {
        if self.changed && self.is_member() {
            self.changed = false;
            self.round = None;
            let j = self.aggregate();
            out.push(RelayAction::Up(AgentMsg::Update(UpdateMsg {
                pairs: j.pairs,
                entries: j.entries,
                interest: j.interest,
                floor: j.floor,
                last_d: j.last_d,
            })));
        }
    }

    fn violation(&mut self, from: MemberId, reason: String, out: &mut Vec<RelayAction>) {
        out.push(RelayAction::Event(RelayEvent::AgentRefused {
            member: from,
            reason: reason.clone(),
        }));
        out.push(RelayAction::CloseDown(from, reason));
        self.remove(from, "protocol violation", out);
    }

    fn remove(&mut self, id: MemberId, why: &'static str, out: &mut Vec<RelayAction>) {
        if let Some(a) = self.agents.remove(&id) {
            if self.hosts.get(&a.host) == Some(&id) {
                self.hosts.remove(&a.host);
            }
            if let Some(r) = &mut self.round {
                r.waiting.remove(&id);
            }
            if let Some(x) = &mut self.exchange {
                x.waiting.remove(&id);
                x.proposals.remove(&id);
            }
            if self.cfg.live && self.is_member() {
                out.push(RelayAction::Up(AgentMsg::RackHost(RackHostMsg {
                    host: a.host.clone(),
                    report: None,
                })));
            }
            self.changed = true;
            out.push(RelayAction::Event(RelayEvent::AgentLeft {
                member: id,
                host: a.host,
                why,
            }));
        }
    }

    /// Timeouts, the round deadline and heartbeats; call at [`Self::next_wakeup`] or sooner.
    pub fn tick(&mut self, now: Duration) -> Vec<RelayAction> {
        let mut out = Vec::new();
        // Before its `Join` the relay has asked nothing, so the coordinator's silence means
        // nothing: a relay waiting for its rack stays connected (QUIC keep-alives hold it).
        if matches!(self.up, Upstream::Joining | Upstream::Member { .. })
            && now.saturating_sub(self.up_heard) > self.cfg.upstream_timeout
        {
            out.extend(self.on_upstream_lost(now, "coordinator silent"));
            out.push(RelayAction::CloseUp("coordinator silent".into()));
            return out;
        }
        if now >= self.last_scan + self.cfg.member_timeout / 4 {
            self.last_scan = now;
            let dead: Vec<MemberId> = self
                .agents
                .iter()
                .filter(|(_, a)| now.saturating_sub(a.last_seen) > self.cfg.member_timeout)
                .map(|(&id, _)| id)
                .collect();
            for id in dead {
                out.push(RelayAction::ExpireDown(id));
                self.remove(id, "timed out", &mut out);
            }
        }
        if let Some(x) = self
            .exchange
            .as_ref()
            .filter(|x| now >= x.started + self.exchange_deadline())
        {
            let (index, slow): (u32, Vec<MemberId>) =
                (x.index, x.waiting.iter().copied().collect());
            for id in slow {
                out.push(RelayAction::CloseDown(
                    id,
                    format!("no answer to selection exchange {index}"),
                ));
                self.remove(id, "timed out", &mut out);
            }
            self.exchange_progress(&mut out);
        }
        self.flush_update(&mut out);
        if let Some(r) = &self.round {
            if now >= r.started + self.cfg.round_deadline
                && r.waiting
                    .iter()
                    .all(|id| self.agents[id].stale < self.cfg.max_staleness)
            {
                let stragglers: Vec<MemberId> = r.waiting.iter().copied().collect();
                for id in &stragglers {
                    self.agents.get_mut(id).expect("waiting agent").stale += 1;
                }
                self.round.as_mut().expect("checked").waiting.clear();
                self.maybe_complete(now, stragglers.len(), &mut out);
            }
        }
        if let Upstream::Member { heartbeat, .. } = self.up {
            if now >= self.next_heartbeat {
                self.heartbeat_seq += 1;
                out.push(RelayAction::Up(AgentMsg::Heartbeat {
                    seq: self.heartbeat_seq,
                }));
                self.next_heartbeat = now + heartbeat;
            }
        }
        out
    }

    /// The earliest time at which [`Self::tick`] has something to do.
    pub fn next_wakeup(&self) -> Option<Duration> {
        let up = match self.up {
            Upstream::Down { retry_at, .. } => Some(retry_at),
            Upstream::Member { .. } => Some(
                self.next_heartbeat
                    .min(self.up_heard + self.cfg.upstream_timeout),
            ),
            Upstream::Joining => Some(self.up_heard + self.cfg.upstream_timeout),
            Upstream::Connected => None,
        };
        let scan = (!self.agents.is_empty()).then(|| self.last_scan + self.cfg.member_timeout / 4);
        let deadline = self
            .round
            .as_ref()
            .map(|r| r.started + self.cfg.round_deadline);
        let exchange = self
            .exchange
            .as_ref()
            .filter(|x| !x.waiting.is_empty())
            .map(|x| x.started + self.exchange_deadline());
        [up, scan, deadline, exchange].into_iter().flatten().min()
    }
}

/// What follows an agent's `Welcome`, as the coordinator sends it: the operator's weights
/// (with an instance), or the live policy and facility table.
fn after_welcome(
    id: MemberId,
    weights: &BTreeMap<String, f64>,
    policy: &Option<CoordMsg>,
    table: &Option<CoordMsg>,
) -> Vec<RelayAction> {
    let weights = weights.iter().map(|(app, &weight)| CoordMsg::SetWeight {
        app: app.clone(),
        weight,
    });
    weights
        .chain(policy.iter().cloned())
        .chain(table.iter().cloned())
        .map(|m| RelayAction::Down(id, m))
        .collect()
}

/// The relay's `Welcome` to an agent: the coordinator's epoch, numbering and shard, the
/// relay's heartbeat interval.
fn self_welcome(cfg: &RelayConfig, epoch: u64, iteration: u64, shard: Shard) -> CoordMsg {
    CoordMsg::Welcome {
        epoch,
        iteration,
        heartbeat_ms: cfg.heartbeat_interval.as_millis() as u64,
        shard,
    }
}
