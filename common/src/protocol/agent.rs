//! The agent's state machine: join, one host x-step per round, heartbeats, fail-static.
//!
//! Phases: `Disconnected` (waiting for the next connection attempt, exponential backoff with
//! jitter) → `Joining` (connected, `Join` sent) → `Member` (rounds flow). Losing the
//! coordinator — the transport reports it, or nothing is heard for `coordinator_timeout` —
//! returns to `Disconnected` and the host **keeps its last rates** (fail-static): the rates are
//! a feasible point of the host's own budgets, and freezing them is safer than either dropping
//! to the floor or running unthrottled. A rejoin reports the current rates, so the coordinator
//! resumes warm.

use super::facility_digest;
use super::wire::{
    AgentMsg, ContributionMsg, CoordMsg, Join, ProposalMsg, SelectedMsg, SelectionParams, UpdateMsg,
};
use crate::admm::{Contribution, FacilityTerm, HostState};
use crate::live::{LiveFacility, LivePolicy};
use crate::model::Problem;
use crate::rng::SplitMix64;
use crate::selection::{evaluate_present, initial_active, SelectionOptions, Swap};
use std::time::Duration;

#[derive(Clone, Debug, PartialEq)]
pub struct AgentConfig {
    pub heartbeat_interval: Duration,
    /// Silence from the coordinator after which the agent goes fail-static and reconnects.
    pub coordinator_timeout: Duration,
    pub backoff_min: Duration,
    pub backoff_max: Duration,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Phase {
    Disconnected { retry_at: Duration, attempts: u32 },
    Joining { since: Duration },
    Member { epoch: u64 },
}

#[derive(Clone, Debug, PartialEq)]
pub enum AgentAction {
    Send(AgentMsg),
    /// Drop the connection (the phase is already `Disconnected`).
    Disconnect(String),
    /// Rates or liveness changed: rewrite the rate table.
    Publish,
    /// Operator change: set the weight of every pair of app `app` (index in the instance) to
    /// `weight` in the problem the driver passes in. Every host applies it to every host's
    /// pairs, so the instance stays identical cluster-wide (the priced restart computes the
    /// greedy over all hosts).
    SetWeight {
        app: u32,
        weight: f64,
    },
    /// Live problem: the coordinator's shape and weights; rebuild the host's problem.
    Policy(LivePolicy),
    /// Live problem: the coordinator's facility table; rebuild the host's problem.
    Facilities(Vec<LiveFacility>),
    Event(AgentEvent),
}

#[derive(Clone, Debug, PartialEq)]
pub enum AgentEvent {
    Welcomed {
        epoch: u64,
        iteration: u64,
    },
    Refused(String),
    /// The coordinator is gone; rates are frozen until a rejoin.
    FailStatic(String),
    IgnoredRound {
        epoch: u64,
        iteration: u64,
    },
    /// A selection exchange was applied: the active set is now `active` (global pair indices).
    Selected {
        exchange: u32,
        parked: Option<usize>,
        activated: Option<usize>,
    },
    /// The priced restart chose a new active set.
    Restarted {
        exchange: u32,
    },
    /// Apps arrived on or left the host (global pair indices); a re-selection follows.
    AppsChanged {
        arrived: Vec<usize>,
        left: Vec<usize>,
    },
    /// An operator's weight change was taken.
    WeightSet {
        app: String,
        weight: f64,
    },
    /// A weight change for an app this instance does not know, or with a bad value.
    IgnoredWeight {
        app: String,
        weight: f64,
    },
    /// The coordinator's heartbeat interval (`offered`) leaves too little of the agent's
    /// `coordinator_timeout` (at least three heartbeats must fit in it): the agent
    /// heartbeats every `used` instead.
    HeartbeatShortened {
        offered: Duration,
        used: Duration,
        timeout: Duration,
    },
}

/// `(facility, value)` pairs, facility ascending.
type FacilityValues = Vec<(u32, f64)>;

/// A proposal sent, waiting for its verdict.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Pending {
    exchange: u32,
    swap: Option<Swap>,
    discount: f64,
    /// A wanted app may still wait for a free slot: the coin kept it out, or the prices to
    /// decide with were missing. Ask again (see [`AgentCore::settle`]).
    fill_undecided: bool,
}

pub struct AgentCore {
    cfg: AgentConfig,
    state: HostState,
    digest: u64,
    phase: Phase,
    epoch: u64,
    iteration: u64,
    /// `(epoch, iteration)` of the last round stepped: rounds are taken in that order only.
    last_step: (u64, u64),
    last_heard: Duration,
    next_heartbeat: Duration,
    heartbeat_seq: u64,
    /// Connection failures and refusals since the last `Welcome`; sets the backoff.
    failures: u32,
    /// The facility terms of the last round stepped, reported on rejoin.
    last_d: Vec<FacilityTerm>,
    /// Live problem: the last term stepped with of every facility this host has used, by
    /// facility id, so it survives tables that number the facilities afresh or lack some
    /// of them for a while (a restarted coordinator's).
    terms_by_id: std::collections::BTreeMap<String, FacilityTerm>,
    jitter: SplitMix64,
    /// Discounted share of recent selection rounds each of the host's pairs was active
    /// (indexed from the host's first pair), the SDRF-style memory of `selection`.
    activity: Vec<f32>,
    /// Selection exchanges completed.
    exchanges: u32,
    pending: Option<Pending>,
    /// Which of the host's apps run (indexed from the host's first pair; all, unless the
    /// driver says otherwise with [`AgentCore::set_present`]).
    present: Vec<bool>,
    /// The apps changed since the last exchange: ask for one when (re)joining.
    unsettled: bool,
    /// Live problem (docs/live-problem.md): the host's problem is its own row, rebuilt as apps
    /// and facilities come and go, over facility indices that only the coordinator of this
    /// connection assigns; so a join carries no facility data and an `Update` follows.
    live: bool,
    /// Forks the selection coin per host: the host's index in an instance, a hash of its name
    /// in the live problem (where every agent's problem has one host, index 0).
    coin: u64,
    /// `(weight, demand, a)` of the host's pairs when the last exchange evaluated them.
    settled: Vec<(f64, f64, f64)>,
    /// Whether `Changed` went out since that exchange.
    change_reported: bool,
}

/// A relative change of a pair's weight, demand cap or `a` at least this large makes the host
/// report `Changed`: smaller ones are measurement noise, which must not re-select anything.
pub const MATERIAL_CHANGE: f64 = 0.1;

/// `(weight, demand, a)` of host `host`'s pairs.
fn inputs(problem: &Problem, host: usize) -> Vec<(f64, f64, f64)> {
    problem.pairs[problem.hosts[host].pairs.clone()]
        .iter()
        .map(|p| (p.weight, p.demand, p.cqe_per_wqe))
        .collect()
}

impl AgentCore {
    /// A fresh agent: its host starts at its best response to zero prices, as the in-process
    /// engine's cold start does.
    pub fn new(problem: &Problem, mut state: HostState, cfg: AgentConfig) -> Self {
        state.priced_step(problem, |_| 0.0);
        let jitter = SplitMix64::fork(0x5eed, state.host as u64);
        let coin = state.host as u64;
        let state_host = state.host;
        let activity = vec![0.0; problem.hosts[state.host].pairs.len()];
        let present = vec![true; activity.len()];
        Self {
            cfg,
            state,
            digest: facility_digest(problem),
            phase: Phase::Disconnected {
                retry_at: Duration::ZERO,
                attempts: 0,
            },
            epoch: 0,
            iteration: 0,
            last_step: (0, 0),
            last_heard: Duration::ZERO,
            next_heartbeat: Duration::ZERO,
            heartbeat_seq: 0,
            failures: 0,
            last_d: Vec::new(),
            terms_by_id: Default::default(),
            jitter,
            activity,
            exchanges: 0,
            pending: None,
            present,
            unsettled: false,
            live: false,
            coin,
            settled: inputs(problem, state_host),
            change_reported: false,
        }
    }

    /// Whether the host's inputs moved materially since the last exchange evaluated them.
    fn inputs_moved(&self, problem: &Problem) -> bool {
        let now = inputs(problem, self.state.host);
        let far = |a: f64, b: f64| (a - b).abs() > MATERIAL_CHANGE * a.abs().max(b.abs());
        now.len() != self.settled.len()
            || now
                .iter()
                .zip(&self.settled)
                .any(|(n, s)| far(n.0, s.0) || far(n.1, s.1) || far(n.2, s.2))
    }

    /// An exchange has evaluated and applied the host: later changes are measured from here.
    fn settle_inputs(&mut self, problem: &Problem) {
        self.settled = inputs(problem, self.state.host);
        self.change_reported = false;
    }

    /// Makes this a live agent ([`AgentCore::live`]'s doc), its coin forked by `host`'s name.
    pub fn set_live(&mut self, host: &str) {
        self.live = true;
        self.coin = host.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        });
        self.jitter = SplitMix64::fork(0x5eed, self.coin);
    }

    /// Whether the host's problem may be replaced now: not while a proposal waits for its
    /// verdict (the proposal names pairs of the current problem).
    pub fn can_rebuild(&self) -> bool {
        self.pending.is_none()
    }

    /// Live problem: the host's problem changed from `old` to `new` (both one host, index 0 of
    /// this agent). Pairs are matched by app name: an active app that is still there keeps its
    /// rate (within its new box) and its activity memory; one that left is dropped from the
    /// active set at once (a departure is a local fact); one that arrived starts parked and
    /// asks for a selection exchange. A member tells the coordinator with `Update`.
    pub fn rebuild(&mut self, old: &Problem, new: &Problem) -> Vec<AgentAction> {
        debug_assert!(self.can_rebuild());
        let name = |p: &Problem, i: usize| p.app_names[p.pairs[i].app as usize].clone();
        let index: std::collections::HashMap<String, usize> =
            (0..new.pairs.len()).map(|i| (name(new, i), i)).collect();
        let x_min = new.params.x_min;
        let mut kept: Vec<(usize, f64)> = self
            .state
            .active
            .iter()
            .zip(&self.state.x)
            .filter_map(|(&p, &x)| {
                let q = *index.get(&name(old, p))?;
                Some((q, x.clamp(x_min, new.pairs[q].demand.max(x_min))))
            })
            .collect();
        kept.sort_unstable_by_key(|e| e.0);
        let mut activity = vec![0.0f32; new.pairs.len()];
        let old_first = old.hosts[self.state.host].pairs.start;
        for p in old.hosts[self.state.host].pairs.clone() {
            if let Some(&q) = index.get(&name(old, p)) {
                activity[q] = self.activity[p - old_first];
            }
        }
        let arrived = index.keys().any(|a| !old.app_names.contains(a));
        self.state.active = kept.iter().map(|e| e.0).collect();
        self.state.x = kept.iter().map(|e| e.1).collect();
        self.activity = activity;
        self.present = vec![true; new.pairs.len()];
        self.digest = facility_digest(new);
        self.unsettled |= arrived;
        // The terms last stepped with, renumbered into the new table by facility id (a new
        // coordinator numbers its facilities afresh, and learns them one host at a time).
        for t in &self.last_d {
            if let Some(f) = old.facilities.get(t.facility as usize) {
                self.terms_by_id.insert(f.id.clone(), *t);
            }
        }
        self.last_d = (new.facilities.iter().enumerate())
            .filter_map(|(i, f)| {
                let t = self.terms_by_id.get(&f.id)?;
                Some(FacilityTerm {
                    facility: i as u32,
                    ..*t
                })
            })
            .collect();
        let mut out = Vec::new();
        if self.is_member() {
            let (pairs, floor) = self.active_summary(new);
            out.push(AgentAction::Send(AgentMsg::Update(UpdateMsg {
                pairs,
                entries: self.state.contribution(new).entries,
                interest: interest(new, self.state.host),
                floor,
                last_d: self.last_d.clone(),
            })));
            out.extend(self.reselect_request());
        }
        out.push(AgentAction::Publish);
        out
    }

    /// Which of the host's apps run: `present[i]` for the host's `i`-th pair. The driver
    /// calls it whenever it learns that an app arrived or left. A change asks the coordinator
    /// for a selection exchange at the next round boundary, where an arrived app may take a
    /// slot and a departed one is parked (or at the next join, if not a member now).
    pub fn set_present(&mut self, problem: &Problem, present: Vec<bool>) -> Vec<AgentAction> {
        if present.len() != self.present.len() || present == self.present {
            return Vec::new();
        }
        let first = problem.hosts[self.state.host].pairs.start;
        let (mut arrived, mut left) = (Vec::new(), Vec::new());
        for (i, (&now, &was)) in present.iter().zip(&self.present).enumerate() {
            match (was, now) {
                (false, true) => arrived.push(first + i),
                (true, false) => left.push(first + i),
                _ => {}
            }
        }
        self.present = present;
        self.unsettled = true;
        let mut out = vec![AgentAction::Event(AgentEvent::AppsChanged {
            arrived,
            left,
        })];
        out.extend(self.reselect_request());
        out
    }

    /// Whether pair `p` (a global index of this host's) runs.
    pub fn is_present(&self, problem: &Problem, p: usize) -> bool {
        self.present[p - problem.hosts[self.state.host].pairs.start]
    }

    /// Asks for an exchange after the next round, while the apps are unsettled.
    fn reselect_request(&self) -> Option<AgentAction> {
        (self.unsettled && self.is_member()).then(|| {
            AgentAction::Send(AgentMsg::Reselect {
                iteration: self.iteration + 1,
            })
        })
    }

    /// After an exchange: settled unless a departed app is still active (one park per
    /// exchange), or the apps changed and a wanted one may still wait for a free slot (the
    /// coin kept it out, or the exchange came before the prices: `fill_undecided`); then
    /// another exchange is asked for. Without such requests an
    /// arrival would wait for a change elsewhere, since a settled cluster re-selects no more.
    fn settle(&mut self, problem: &Problem, fill_undecided: bool) -> Option<AgentAction> {
        let departed = self
            .state
            .active
            .iter()
            .any(|&p| !self.is_present(problem, p));
        self.unsettled = departed || (self.unsettled && fill_undecided);
        self.reselect_request()
    }

    /// Selection exchanges this host has completed.
    pub fn exchanges(&self) -> u32 {
        self.exchanges
    }

    /// `(facility, active pairs)` and `(facility, Σ b·x_min)` of the current active set.
    fn active_summary(&self, problem: &Problem) -> (Vec<(u32, u32)>, FacilityValues) {
        let x_min = problem.params.x_min;
        let mut pairs: Vec<(u32, u32)> = Vec::new();
        let mut floor: Vec<(u32, f64)> = Vec::new();
        for &p in &self.state.active {
            for &(f, b) in &problem.pairs[p].uses {
                match pairs.binary_search_by_key(&f, |e| e.0) {
                    Ok(i) => {
                        pairs[i].1 += 1;
                        floor[i].1 += b * x_min;
                    }
                    Err(i) => {
                        pairs.insert(i, (f, 1));
                        floor.insert(i, (f, b * x_min));
                    }
                }
            }
        }
        (pairs, floor)
    }

    fn selected_msg(&self, problem: &Problem, exchange: u32) -> AgentMsg {
        let (pairs, floor) = self.active_summary(problem);
        AgentMsg::Selected(SelectedMsg {
            exchange,
            pairs,
            floor,
            entries: self.state.contribution(problem).entries,
        })
    }

    pub fn state(&self) -> &HostState {
        &self.state
    }

    pub fn phase(&self) -> Phase {
        self.phase
    }

    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    pub fn iteration(&self) -> u64 {
        self.iteration
    }

    pub fn is_member(&self) -> bool {
        matches!(self.phase, Phase::Member { .. })
    }

    /// Whether the driver should try to connect now.
    pub fn connect_due(&self, now: Duration) -> bool {
        matches!(self.phase, Phase::Disconnected { retry_at, .. } if now >= retry_at)
    }

    pub fn join_msg(&self, problem: &Problem) -> AgentMsg {
        if self.live {
            // Facility indices are the coordinator's of this connection: they come with its
            // table, and the host's `Update` follows it.
            return AgentMsg::Join(Join {
                host: problem.hosts[self.state.host].id.clone(),
                facility_digest: 0,
                pairs: Vec::new(),
                entries: Vec::new(),
                last_iteration: self.iteration,
                last_d: Vec::new(),
                rank: 0,
                interest: Vec::new(),
                floor: Vec::new(),
                exchanges: self.exchanges,
            });
        }
        let (pairs, floor) = self.active_summary(problem);
        let interest = interest(problem, self.state.host);
        AgentMsg::Join(Join {
            host: problem.hosts[self.state.host].id.clone(),
            facility_digest: self.digest,
            pairs,
            entries: self.state.contribution(problem).entries,
            last_iteration: self.iteration,
            last_d: self.last_d.clone(),
            rank: self.state.host as u32,
            interest,
            floor,
            exchanges: self.exchanges,
        })
    }

    pub fn on_connected(&mut self, now: Duration, problem: &Problem) -> Vec<AgentAction> {
        // A proposal of the previous session is void: its coordinator never answered it.
        self.pending = None;
        self.phase = Phase::Joining { since: now };
        self.last_heard = now;
        vec![AgentAction::Send(self.join_msg(problem))]
    }

    /// A connection attempt failed: wait longer before the next one.
    pub fn on_connect_failed(&mut self, now: Duration) {
        self.failures += 1;
        let attempts = self.failures;
        self.phase = Phase::Disconnected {
            retry_at: now + self.backoff(attempts),
            attempts,
        };
    }

    /// The transport lost the coordinator.
    pub fn on_disconnected(&mut self, now: Duration, reason: &str) -> Vec<AgentAction> {
        if matches!(self.phase, Phase::Disconnected { .. }) {
            return Vec::new();
        }
        self.go_fail_static(now, reason.to_string(), false)
    }

    fn go_fail_static(&mut self, now: Duration, reason: String, drop: bool) -> Vec<AgentAction> {
        // Failures since the last welcome: a coordinator that keeps refusing us (e.g. a drained
        // host) is asked ever less often, like an unreachable one.
        let attempts = self.failures;
        self.failures += 1;
        self.phase = Phase::Disconnected {
            retry_at: now + self.backoff(attempts),
            attempts,
        };
        let mut out = vec![
            AgentAction::Event(AgentEvent::FailStatic(reason.clone())),
            AgentAction::Publish,
        ];
        if drop {
            out.push(AgentAction::Disconnect(reason));
        }
        out
    }

    /// `backoff_min · 2^attempts`, capped, times a jitter in [1, 1.5) so a fleet that lost its
    /// coordinator together does not reconnect in lock step.
    fn backoff(&mut self, attempts: u32) -> Duration {
        let base = self
            .cfg
            .backoff_min
            .saturating_mul(1u32 << attempts.min(20))
            .min(self.cfg.backoff_max);
        base.mul_f64(1.0 + 0.5 * self.jitter.unit())
    }

    /// Heartbeats and the coordinator-silence timeout.
    pub fn tick(&mut self, now: Duration) -> Vec<AgentAction> {
        match self.phase {
            Phase::Joining { since } if now >= since + self.cfg.coordinator_timeout => {
                self.go_fail_static(now, "no answer to join".into(), true)
            }
            Phase::Member { .. } if now >= self.last_heard + self.cfg.coordinator_timeout => {
                let silent = now - self.last_heard;
                self.go_fail_static(now, format!("coordinator silent for {silent:?}"), true)
            }
            Phase::Member { .. } if now >= self.next_heartbeat => {
                self.next_heartbeat = now + self.cfg.heartbeat_interval;
                self.heartbeat_seq += 1;
                vec![AgentAction::Send(AgentMsg::Heartbeat {
                    seq: self.heartbeat_seq,
                })]
            }
            _ => Vec::new(),
        }
    }

    /// When [`Self::tick`] (or a connection attempt) is next due.
    pub fn next_wakeup(&self) -> Duration {
        match self.phase {
            Phase::Disconnected { retry_at, .. } => retry_at,
            Phase::Joining { since } => since + self.cfg.coordinator_timeout,
            Phase::Member { .. } => self
                .next_heartbeat
                .min(self.last_heard + self.cfg.coordinator_timeout),
        }
    }

    pub fn on_message(
        &mut self,
        now: Duration,
        problem: &Problem,
        msg: CoordMsg,
    ) -> Vec<AgentAction> {
        self.last_heard = now;
        match msg {
            CoordMsg::Welcome {
                epoch,
                iteration,
                heartbeat_ms,
                shard: _,
            } => {
                self.phase = Phase::Member { epoch };
                self.failures = 0;
                // A new session: its rounds are new whatever their numbers, even when a
                // restarted coordinator counts epochs from 1 again.
                self.last_step = (0, 0);
                self.epoch = epoch;
                self.iteration = self.iteration.max(iteration);
                let mut out = vec![
                    AgentAction::Event(AgentEvent::Welcomed { epoch, iteration }),
                    AgentAction::Publish,
                ];
                if heartbeat_ms > 0 {
                    // While no round runs the agent hears only the answers to its heartbeats;
                    // with the coordinator's interval longer than the silence it tolerates it
                    // would go fail-static and rejoin for ever. So it heartbeats at least
                    // three times per `coordinator_timeout`, and says so.
                    let offered = Duration::from_millis(heartbeat_ms);
                    let most = self.cfg.coordinator_timeout / 3;
                    if offered > most {
                        out.push(AgentAction::Event(AgentEvent::HeartbeatShortened {
                            offered,
                            used: most,
                            timeout: self.cfg.coordinator_timeout,
                        }));
                    }
                    self.cfg.heartbeat_interval = offered.min(most);
                }
                self.next_heartbeat = now + self.cfg.heartbeat_interval;
                out.extend(self.reselect_request());
                out
            }
            CoordMsg::Refused { reason } => {
                let mut out = vec![AgentAction::Event(AgentEvent::Refused(reason.clone()))];
                out.extend(self.go_fail_static(now, format!("refused: {reason}"), true));
                out
            }
            CoordMsg::HeartbeatAck { .. } => Vec::new(),
            CoordMsg::Round {
                epoch,
                iteration,
                d,
            } => self.round(now, problem, epoch, iteration, d),
            CoordMsg::Select {
                exchange,
                round,
                prices,
                options,
            } => self.select(now, problem, exchange, round, prices, options),
            CoordMsg::Verdict { exchange, activate } => self.verdict(problem, exchange, activate),
            // Only a relay is sent these, and only after its `RackProposals`.
            CoordMsg::RackVerdicts { exchange, .. } => self.go_fail_static(
                now,
                format!("selection exchange {exchange}: a relay's verdicts sent to an agent"),
                true,
            ),
            CoordMsg::Restart { exchange, prices } => self.restart(now, problem, exchange, prices),
            CoordMsg::Policy(p) => vec![AgentAction::Policy(p)],
            CoordMsg::Facilities(f) => vec![AgentAction::Facilities(f)],
            CoordMsg::SetWeight { app, weight } => {
                match problem.app_names.iter().position(|a| *a == app) {
                    Some(i) if weight.is_finite() && weight > 0.0 => vec![
                        AgentAction::SetWeight {
                            app: i as u32,
                            weight,
                        },
                        AgentAction::Event(AgentEvent::WeightSet { app, weight }),
                    ],
                    _ => vec![AgentAction::Event(AgentEvent::IgnoredWeight {
                        app,
                        weight,
                    })],
                }
            }
        }
    }

    /// Applies a [`AgentAction::SetWeight`] to `problem` (every pair of the app).
    pub fn apply_weight(problem: &mut Problem, app: u32, weight: f64) {
        for pair in problem.pairs.iter_mut().filter(|p| p.app == app) {
            pair.weight = weight;
        }
    }

    /// Selection round `round`: the in-process solver's `evaluate` for this host, at the
    /// coordinator's prices and this host's own multipliers and activity.
    fn select(
        &mut self,
        now: Duration,
        problem: &Problem,
        exchange: u32,
        round: u32,
        prices: Vec<(u32, f64)>,
        options: SelectionParams,
    ) -> Vec<AgentAction> {
        if !self.is_member() {
            return Vec::new();
        }
        let host = &problem.hosts[self.state.host];
        let sane = options.swap_prob.is_finite()
            && options.hysteresis.is_finite()
            && options.fairness.is_finite()
            && (0.0..=1.0).contains(&options.discount);
        if !sane || prices.iter().any(|e| !e.1.is_finite()) {
            return self.go_fail_static(
                now,
                format!("selection exchange {exchange} carries bad values"),
                true,
            );
        }
        if let Some(f) = problem.pairs[host.pairs.clone()]
            .iter()
            .flat_map(|pair| pair.uses.iter().map(|u| u.0))
            .find(|&f| prices.binary_search_by_key(&f, |e| e.0).is_err())
        {
            if self.live {
                // The coordinator has not yet heard this host's `Update` naming `f`: no swap
                // this time, but an answer, so the exchange goes on. Nothing was decided, so
                // an arrival still waiting stays unsettled and asks for the next exchange:
                // settled here, it would wait for some unrelated change (a restarted agent's
                // app stayed parked for 35 s in CI).
                self.pending = Some(Pending {
                    exchange,
                    swap: None,
                    discount: options.discount,
                    fill_undecided: true,
                });
                return vec![AgentAction::Send(AgentMsg::Proposal(ProposalMsg {
                    exchange,
                    park: None,
                    activate: None,
                }))];
            }
            return self.go_fail_static(
                now,
                format!("selection exchange {exchange} lacks the price of facility {f}"),
                true,
            );
        }
        let opts: SelectionOptions = options.into();
        let mut activity = vec![0.0f32; host.pairs.end];
        activity[host.pairs.clone()].copy_from_slice(&self.activity);
        let mut rng = SplitMix64::fork(opts.seed ^ (round as u64) << 32, self.coin);
        let eval = evaluate_present(
            problem,
            self.state.host,
            &self.state.active,
            |f| prices[prices.binary_search_by_key(&f, |e| e.0).expect("checked")].1,
            self.state.multipliers.mu,
            self.state.multipliers.nu,
            &activity,
            |p| self.is_present(problem, p),
            &opts,
            None,
            &mut rng,
        );
        let floor_of = |p: usize| -> FacilityValues {
            let x_min = problem.params.x_min;
            problem.pairs[p]
                .uses
                .iter()
                .map(|&(f, b)| (f, b * x_min))
                .collect()
        };
        let swap = eval.swap;
        self.pending = Some(Pending {
            exchange,
            swap,
            discount: opts.discount,
            fill_undecided: eval.declined_fill,
        });
        vec![AgentAction::Send(AgentMsg::Proposal(ProposalMsg {
            exchange,
            park: swap.and_then(|s| s.park).map(floor_of),
            activate: swap.and_then(|s| s.activate).map(|(p, _)| floor_of(p)),
        }))]
    }

    /// The coordinator's verdict on the proposal: update the activity memory (on the sets
    /// before the swap, as `solve` does), apply the park, and the activation if accepted.
    fn verdict(&mut self, problem: &Problem, exchange: u32, activate: bool) -> Vec<AgentAction> {
        let Some(pending) = self.pending.filter(|p| p.exchange == exchange) else {
            return Vec::new();
        };
        self.pending = None;
        let first = problem.hosts[self.state.host].pairs.start;
        let d = pending.discount as f32;
        self.activity.iter_mut().for_each(|a| *a *= d);
        for &p in &self.state.active {
            self.activity[p - first] += 1.0 - d;
        }
        let (mut parked, mut activated) = (None, None);
        if let Some(swap) = pending.swap {
            if let Some(out) = swap.park {
                if let Some(pos) = self.state.active.iter().position(|&p| p == out) {
                    self.state.active.remove(pos);
                    self.state.x.remove(pos);
                    parked = Some(out);
                }
            }
            if let Some((inp, x)) = swap.activate.filter(|_| activate) {
                if let Err(pos) = self.state.active.binary_search(&inp) {
                    self.state.active.insert(pos, inp);
                    self.state.x.insert(pos, x);
                    activated = Some(inp);
                }
            }
        }
        self.exchanges = exchange + 1;
        let mut out = vec![
            AgentAction::Send(self.selected_msg(problem, exchange)),
            AgentAction::Event(AgentEvent::Selected {
                exchange,
                parked,
                activated,
            }),
            AgentAction::Publish,
        ];
        self.settle_inputs(problem);
        out.extend(self.settle(problem, pending.fill_undecided));
        out
    }

    /// The priced restart: the greedy initial selection again, at half the given prices, then
    /// the best response to zero prices (the in-process `solve` builds a new engine the same way).
    fn restart(
        &mut self,
        now: Duration,
        problem: &Problem,
        exchange: u32,
        prices: Vec<(u32, f64)>,
    ) -> Vec<AgentAction> {
        if !self.is_member() {
            return Vec::new();
        }
        let nf = problem.facilities.len();
        let mut dense = vec![0.0; nf];
        for &(f, p) in &prices {
            if self.live && f as usize >= nf && p.is_finite() {
                // A facility whose table has not reached this host's problem yet.
                continue;
            }
            if f as usize >= nf || !p.is_finite() {
                return self.go_fail_static(
                    now,
                    format!("restart {exchange} carries a bad price ({f}, {p})"),
                    true,
                );
            }
            dense[f as usize] = 0.5 * p;
        }
        // The greedy runs over every host's apps, present or not: the other hosts' presence is
        // not known here, and every agent must compute the same rows. Only this host's own
        // absent apps are left out of its row.
        let mut active = initial_active(problem, &dense).swap_remove(self.state.host);
        active.retain(|&p| self.is_present(problem, p));
        self.state = HostState::new(problem, self.state.host, active);
        self.state.priced_step(problem, |_| 0.0);
        self.pending = None;
        self.exchanges = exchange + 1;
        let mut out = vec![
            AgentAction::Send(self.selected_msg(problem, exchange)),
            AgentAction::Event(AgentEvent::Restarted { exchange }),
            AgentAction::Publish,
        ];
        self.settle_inputs(problem);
        out.extend(self.settle(problem, false));
        out
    }

    fn round(
        &mut self,
        now: Duration,
        problem: &Problem,
        epoch: u64,
        iteration: u64,
        d: Vec<FacilityTerm>,
    ) -> Vec<AgentAction> {
        if !self.is_member() || epoch < self.epoch || (epoch, iteration) <= self.last_step {
            return vec![AgentAction::Event(AgentEvent::IgnoredRound {
                epoch,
                iteration,
            })];
        }
        if d.iter()
            .any(|e| !(e.d.is_finite() && e.rho.is_finite() && e.rho > 0.0))
        {
            return self.go_fail_static(
                now,
                format!("round {iteration} carries non-finite values"),
                true,
            );
        }
        let facilities: Vec<u32> = self
            .state
            .active
            .iter()
            .flat_map(|&p| problem.pairs[p].uses.iter().map(|u| u.0))
            .collect();
        if let Some(f) = facilities
            .iter()
            .find(|&&f| d.binary_search_by_key(&f, |e| e.facility).is_err())
        {
            if self.live {
                // Sent before the coordinator heard this host's `Update`; the update starts a
                // new epoch, whose rounds carry every facility.
                return vec![AgentAction::Event(AgentEvent::IgnoredRound {
                    epoch,
                    iteration,
                })];
            }
            return self.go_fail_static(
                now,
                format!("round {iteration} lacks d for facility {f}"),
                true,
            );
        }
        self.epoch = epoch;
        self.phase = Phase::Member { epoch };
        let Contribution { entries } = self.state.admm_step(problem, |f| {
            d[d.binary_search_by_key(&f, |e| e.facility).expect("checked")]
        });
        self.iteration = iteration;
        self.last_step = (epoch, iteration);
        self.last_d = d;
        let mut out = vec![
            AgentAction::Send(AgentMsg::Contribution(ContributionMsg {
                epoch,
                iteration,
                entries,
            })),
            AgentAction::Publish,
        ];
        if !self.change_reported && self.inputs_moved(problem) {
            self.change_reported = true;
            out.push(AgentAction::Send(AgentMsg::Changed));
        }
        out
    }
}

/// Every facility one of the host's apps uses, active or parked, ascending.
fn interest(problem: &Problem, host: usize) -> Vec<u32> {
    let mut interest: Vec<u32> = problem.hosts[host]
        .pairs
        .clone()
        .flat_map(|p| problem.pairs[p].uses.iter().map(|u| u.0))
        .collect();
    interest.sort_unstable();
    interest.dedup();
    interest
}

#[cfg(test)]
mod tests;
