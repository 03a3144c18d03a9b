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
    /// Live problem: the host's latest report (its NIC, its row and grants).
    report: Option<HostReport>,
    /// Live problem: the GIDs of its reports that other hosts' links own, as last logged:
    /// reports come every 250 ms, the refusal is said once per change.
    ignored_gids: Vec<Gid>,
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
    proposals: BTreeMap<MemberId, ProposalMsg>,
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

/// Counters for metrics and `status`.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Counters {
    pub rounds: u64,
    pub stale_reuses: u64,
    pub late: u64,
    pub duplicates: u64,
    pub refused: u64,
    pub timeouts: u64,
    /// Selection exchanges completed (the priced restart included).
    pub exchanges: u64,
    /// Members parked and activated by selection rounds, and activations refused because the
    /// facility could not carry one more pair at `x_min`.
    pub parks: u64,
    pub activations: u64,
    pub refused_activations: u64,
    /// Re-selections agents asked for because their apps changed.
    pub reselect_requests: u64,
    /// Material changes of agents' inputs (weights, demand caps, `a`) reported.
    pub changes: u64,
    /// Joins refused because their host was a member on another live connection.
    pub duplicate_joins: u64,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct MemberStatus {
    pub member: MemberId,
    pub host: String,
    pub facilities: usize,
    pub last_iteration: u64,
    pub stale: u32,
    /// Live problem: the host's apps as its agent last reported them (empty otherwise).
    pub apps: Vec<AppReport>,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct FacilityStatus {
    pub id: String,
    pub capacity: f64,
    pub pairs: u32,
    pub usage: f64,
    pub price: f64,
    /// The facility's ADMM penalty `ρ_f`.
    pub rho: f64,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Status {
    /// `I/N`: this coordinator's shard.
    pub shard: String,
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
    pub selection: SelectionStatus,
    /// Weights set by the operator (`set-weight`), by app.
    pub weights: BTreeMap<String, f64>,
    /// Live problem: the shape and the weights in force (`default_weight` for every app
    /// the list does not name); none with an instance file.
    pub policy: Option<LivePolicy>,
}

/// The operator's changes, which a coordinator persists across restarts (`state_file`): the
/// capacities set by `set-capacity`, the weights set by `set-weight` and the drained hosts.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OperatorState {
    pub capacities: BTreeMap<String, f64>,
    pub weights: BTreeMap<String, f64>,
    pub drained: Vec<String>,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SelectionStatus {
    /// Exchanges completed so far (the priced restart is exchange 0).
    pub exchanges_done: u32,
    /// Exchanges in the schedule; afterwards exchanges go on every `period_ms` and when an
    /// agent's apps change.
    pub exchanges_planned: u32,
    /// Whether an exchange is in progress (rounds pause meanwhile).
    pub in_progress: bool,
    pub priced_start: bool,
    pub rounds: u32,
    pub iters_per_round: u32,
    /// `T_sel` in milliseconds (none: no periodic re-selection).
    pub period_ms: Option<u64>,
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
    /// A coordinator of the live problem: no facility until hosts join with their links, apps
    /// named by whoever runs them, weights from `policy` (checked by the caller).
    /// The live problem: no instance; each facility's penalty is balanced against its
    /// residuals, since a live facility swings between idle and contended as apps come and go
    /// ([`RhoBalance`]).
    pub fn new_live(cfg: CoordinatorConfig, policy: LivePolicy) -> Self {
        let mut c = Coordinator::new(cfg, Vec::new());
        c.live = Some(policy);
        c.admm = c.fresh_admm();
        c
    }

    /// ADMM state from scratch for the current facilities.
    fn fresh_admm(&self) -> CoordinatorState {
        let n = self.facilities.len();
        if self.live.is_some() {
            CoordinatorState::balanced(self.cfg.rho, n, RhoBalance::around(self.cfg.rho))
        } else {
            CoordinatorState::new(self.cfg.rho, n)
        }
    }

    /// The live policy in force, if this coordinator runs the live problem.
    pub fn policy(&self) -> Option<&LivePolicy> {
        self.live.as_ref()
    }

    /// Live problem: the problem as an instance file (what `snapshot` writes): the facilities
    /// with their capacities, every member's last report. `None` with an instance file.
    pub fn snapshot(&self) -> Option<Instance> {
        let policy = self.live.as_ref()?;
        let hosts: Vec<(String, HostReport)> = self
            .members
            .values()
            .filter_map(|m| Some((m.host.clone(), m.report.clone()?)))
            .collect();
        Some(crate::live::snapshot(policy, &self.facilities, &hosts))
    }

    fn send_all(&self, msg: CoordMsg, out: &mut Vec<Action>) {
        out.extend(self.members.keys().map(|&id| Action::Send(id, msg.clone())));
    }

    /// A host's report: kept for `status` and the snapshot; the first one creates the host's
    /// receive link, and a link whose line rate or GIDs changed is updated. Every member hears
    /// of a changed facility table.
    fn host_report(&mut self, from: MemberId, mut r: HostReport, out: &mut Vec<Action>) {
        let Some(m) = self.members.get(&from) else {
            self.violation(from, "host report before join".into(), out);
            return;
        };
        if self.live.is_none() {
            self.violation(
                from,
                "host report to a coordinator with an instance file".into(),
                out,
            );
            return;
        }
        if let Err(e) = r.check(self.facilities.len()) {
            self.violation(from, format!("bad host report: {e}"), out);
            return;
        }
        let host = m.host.clone();
        // A GID of another host's link stays that host's: two links owning one GID would make
        // the agents' mapping of peers depend on table order.
        let owned_elsewhere: Vec<Gid> = r
            .gids
            .iter()
            .copied()
            .filter(|g| {
                self.links
                    .iter()
                    .any(|l| l.host != host && l.gids.contains(g))
            })
            .collect();
        let said = m.ignored_gids == owned_elsewhere;
        if !said {
            self.members
                .get_mut(&from)
                .expect("a member")
                .ignored_gids
                .clone_from(&owned_elsewhere);
        }
        if !owned_elsewhere.is_empty() && !said {
            out.push(Action::Event(Event::Refused {
                member: from,
                reason: format!(
                    "host {host} reports GIDs {} that another host's link owns; ignoring them",
                    owned_elsewhere
                        .iter()
                        .map(gid_text)
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            }));
        }
        r.gids.retain(|g| !owned_elsewhere.contains(g));
        let id = crate::live::link_id(&host);
        let capacity = self.capacities.get(&id).copied().unwrap_or(1.0);
        let changed = match self.facilities.iter().position(|f| f.id == id) {
            Some(f) => {
                let link = &mut self.links[f];
                let changed = link.line_rate_gbps != r.line_rate_gbps || link.gids != r.gids;
                link.gids = r.gids.clone();
                link.line_rate_gbps = r.line_rate_gbps;
                changed
            }
            None if self.facilities.len() < crate::live::MAX_HOSTS => {
                self.facilities.push(Facility {
                    id: id.clone(),
                    capacity,
                    cost: 0.0,
                });
                self.owned.push(true);
                self.admm.push_facility();
                self.links.push(LiveFacility {
                    id,
                    host,
                    line_rate_gbps: r.line_rate_gbps,
                    capacity,
                    gids: r.gids.clone(),
                });
                true
            }
            None => false,
        };
        self.members.get_mut(&from).expect("checked").report = Some(r);
        if changed {
            self.send_all(CoordMsg::Facilities(self.links.clone()), out);
        }
    }

    /// A live host's problem changed: its new active set and usage replace the old ones, as a
    /// join would, in a new epoch.
    fn update(&mut self, from: MemberId, u: UpdateMsg, out: &mut Vec<Action>) {
        if !self.members.contains_key(&from) || self.live.is_none() {
            self.violation(
                from,
                "update before join, or without the live problem".into(),
                out,
            );
            return;
        }
        let nf = self.facilities.len() as u32;
        let checked = self
            .check_active(&u.pairs, &u.floor)
            .and_then(|()| self.check_entries(&u.entries))
            .and_then(|()| Self::check_last_d(&u.last_d, nf))
            .and_then(|()| {
                if u.interest.windows(2).all(|w| w[0] < w[1]) && u.interest.iter().all(|&f| f < nf)
                {
                    Ok(())
                } else {
                    Err("interest must name known facilities in ascending order".into())
                }
            });
        if let Err(e) = checked {
            self.violation(from, e, out);
            return;
        }
        let m = self.members.get_mut(&from).expect("checked");
        m.pairs = u.pairs;
        m.entries = u.entries;
        m.interest = u.interest;
        m.floor = u.floor;
        m.last_d = u.last_d;
        self.membership_changed = true;
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

    /// The instance's app ids, which `set-weight` may name.
    pub fn set_apps(&mut self, apps: Vec<String>) {
        self.apps = apps;
    }

    /// Operator change of an app's weight on every host: checked (finite, positive, a known
    /// app), then sent to every member and to every host that joins later.
    pub fn set_weight(&mut self, app: &str, weight: f64) -> Result<Vec<Action>, String> {
        if !crate::live::valid_weight(weight) {
            return Err(crate::live::weight_error("weight", weight));
        }
        if let Some(policy) = &mut self.live {
            // Any app may run, so any well-formed name may be given a weight.
            if !crate::protocol::valid_name(app) {
                return Err(format!(
                    "app name {app:?} is not 1 to 64 letters, digits, '.', '_' or '-'"
                ));
            }
            policy.set_weight(app, Some(weight));
            let msg = CoordMsg::Policy(policy.clone());
            self.weights.insert(app.to_string(), weight);
            self.reselect.changed();
            let mut out = Vec::new();
            self.send_all(msg, &mut out);
            return Ok(out);
        }
        if !self.apps.iter().any(|a| a == app) {
            return Err(format!("no app {app:?}"));
        }
        self.weights.insert(app.to_string(), weight);
        self.reselect.changed();
        Ok(self
            .members
            .keys()
            .map(|&id| {
                Action::Send(
                    id,
                    CoordMsg::SetWeight {
                        app: app.to_string(),
                        weight,
                    },
                )
            })
            .collect())
    }

    /// The operator's changes so far, for the state file.
    pub fn operator_state(&self) -> OperatorState {
        OperatorState {
            capacities: self.capacities.clone(),
            weights: self.weights.clone(),
            drained: self.drained.iter().cloned().collect(),
        }
    }

    /// Applies persisted operator changes at start, each checked as if the operator made it
    /// now. Those that fit are applied; the others are returned, each with why it was
    /// refused, so that the caller reports them and sets the file aside: no state file may
    /// keep the coordinator from starting.
    pub fn restore(&mut self, st: &OperatorState) -> Vec<String> {
        let mut refused = Vec::new();
        for (f, &y) in &st.capacities {
            if let Err(e) = self.set_capacity(f, y) {
                refused.push(format!("capacity of {f:?}: {e}"));
            }
        }
        for (a, &w) in &st.weights {
            if let Err(e) = self.set_weight(a, w) {
                refused.push(format!("weight of {a:?}: {e}"));
            }
        }
        for h in &st.drained {
            match self.check_host(h) {
                Ok(()) => {
                    self.drained.insert(h.clone());
                }
                Err(e) => refused.push(format!("drained host: {e}")),
            }
        }
        refused
    }

    /// The instance's host ids ([`Self::set_hosts`]), which `drain` may name; empty in the
    /// live problem, where any well-formed name may be drained before its host joins.
    pub fn set_hosts(&mut self, hosts: Vec<String>) {
        self.host_ids = hosts;
    }

    /// Whether `host` may be named by `drain`: a well-formed name and, with an instance, one
    /// of its hosts.
    fn check_host(&self, host: &str) -> Result<(), String> {
        if !crate::protocol::valid_name(host) {
            return Err(format!(
                "host id {host:?} is not 1 to 64 letters, digits, '.', '_' or '-'"
            ));
        }
        if !self.host_ids.is_empty() && !self.host_ids.iter().any(|h| h == host) {
            return Err(format!("no host {host:?} in the instance"));
        }
        Ok(())
    }

    /// Selection exchanges completed (the priced restart counts as one when configured).
    pub fn exchanges_done(&self) -> u32 {
        self.exchange_next
    }

    /// Whether a selection exchange is in progress.
    pub fn selecting(&self) -> bool {
        self.exchange.is_some()
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
        // The range instance validation accepts: far outside it is a unit mistake, and
        // 1e308 or 5e-324 make the prices overflow or vanish.
        if !crate::live::valid_weight(capacity) {
            return Err(crate::live::weight_error("capacity", capacity));
        }
        let Some(i) = self.facilities.iter().position(|f| f.id == facility) else {
            // A live link may be set before its host joins: it takes the capacity then.
            let link = facility
                .strip_prefix("rx:")
                .is_some_and(crate::protocol::valid_name);
            if self.live.is_some() && link {
                self.capacities.insert(facility.to_string(), capacity);
                return Ok(());
            }
            return Err(format!("no facility {facility:?}"));
        };
        if !self.owned[i] {
            return Err(format!(
                "facility {facility:?} belongs to shard {}/{}, not to this one ({})",
                crate::protocol::shard_of(facility, self.cfg.shard.count),
                self.cfg.shard.count,
                self.cfg.shard
            ));
        }
        self.facilities[i].capacity = capacity;
        if let Some(link) = self.links.get_mut(i) {
            link.capacity = capacity;
        }
        self.capacities.insert(facility.to_string(), capacity);
        self.reselect.changed();
        Ok(())
    }

    /// The shard this coordinator serves.
    pub fn shard(&self) -> Shard {
        self.cfg.shard
    }

    pub fn config(&self) -> &CoordinatorConfig {
        &self.cfg
    }

    /// Takes `host` out of the optimisation: its contribution is removed at once (new epoch),
    /// its connection closed, and its joins refused until [`Self::undrain`]. Its agent keeps
    /// its last rates (fail-static). A malformed id, or with an instance one that names none
    /// of its hosts, is refused: persisted, it would name no host the coordinator can have.
    pub fn drain(&mut self, now: Duration, host: &str) -> Result<Vec<Action>, String> {
        self.check_host(host)?;
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
        Ok(out)
    }

    /// Whether `host` is a member now (for the operator's replies).
    pub fn is_member(&self, host: &str) -> bool {
        self.hosts.contains_key(host)
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
            shard: self.cfg.shard.to_string(),
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
                    apps: m
                        .report
                        .as_ref()
                        .map(|r| r.apps.clone())
                        .unwrap_or_default(),
                })
                .collect(),
            facilities: self
                .facilities
                .iter()
                .enumerate()
                .filter(|&(f, _)| self.owned[f])
                .map(|(f, spec)| FacilityStatus {
                    id: spec.id.clone(),
                    capacity: spec.capacity,
                    pairs: pairs[f],
                    usage: self.admm.facilities[f].s,
                    price: self.admm.price(f as u32),
                    rho: self.admm.facilities[f].rho,
                })
                .collect(),
            counters: self.counters.clone(),
            drained: self.drained.iter().cloned().collect(),
            selection: SelectionStatus {
                exchanges_done: self.exchange_next,
                exchanges_planned: self.cfg.selection.exchanges(),
                in_progress: self.exchange.is_some(),
                priced_start: self.cfg.selection.priced_start,
                rounds: self.cfg.selection.rounds,
                iters_per_round: self.cfg.selection.iters_per_round,
                period_ms: self.reselect.period().map(|p| p.as_millis() as u64),
            },
            weights: self.weights.clone(),
            policy: self.live.clone(),
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
            AgentMsg::Proposal(p) => self.proposal(from, p, &mut out),
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
            AgentMsg::Host(r) => self.host_report(from, r, &mut out),
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
                report: None,
                ignored_gids: Vec::new(),
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
        if j.host.is_empty() || j.host.len() > 256 {
            return Err("host id must have 1 to 256 bytes".into());
        }
        if self.drained.contains(&j.host) {
            return Err(format!("host {} is drained", j.host));
        }
        self.check_entries(&j.entries)?;
        let nf = self.facilities.len() as u32;
        Self::check_last_d(&j.last_d, nf)?;
        if !j.interest.windows(2).all(|w| w[0] < w[1]) || j.interest.iter().any(|&f| f >= nf) {
            return Err("interest must name known facilities in ascending order".into());
        }
        let foreign = j
            .interest
            .iter()
            .chain(j.last_d.iter().map(|e| &e.facility))
            .find(|&&f| !self.owned[f as usize]);
        if let Some(f) = foreign {
            return Err(self.foreign(*f));
        }
        self.check_active(&j.pairs, &j.floor)
    }

    fn check_active(&self, pairs: &[(u32, u32)], floor: &[(u32, f64)]) -> Result<(), String> {
        let nf = self.facilities.len() as u32;
        if !pairs.windows(2).all(|w| w[0].0 < w[1].0) || pairs.iter().any(|p| p.0 >= nf) {
            return Err("pair counts must name known facilities in ascending order".into());
        }
        if let Some(p) = pairs.iter().find(|p| !self.owned[p.0 as usize]) {
            return Err(self.foreign(p.0));
        }
        if !floor.windows(2).all(|w| w[0].0 < w[1].0)
            || floor
                .iter()
                .any(|e| e.0 >= nf || !e.1.is_finite() || e.1 < 0.0)
        {
            return Err(
                "floor must name known facilities in ascending order with finite, non-negative values"
                    .into(),
            );
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

    fn check_last_d(last_d: &[FacilityTerm], nf: u32) -> Result<(), String> {
        if last_d
            .iter()
            .any(|e| e.facility >= nf || !e.d.is_finite() || !(e.rho.is_finite() && e.rho > 0.0))
        {
            return Err(
                "last_d must name known facilities with finite values and positive penalties"
                    .into(),
            );
        }
        Ok(())
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

    /// Whether the schedule, or re-selection after it, calls for a selection exchange now
    /// (between two rounds).
    fn exchange_due(&self, now: Duration) -> bool {
        let sel = &self.cfg.selection;
        let next = self.exchange_next;
        // Shards see only their own residuals and must select at the same iteration, so
        // a sharded coordinator selects every `iters_per_round` iterations, without the
        // early stop on convergence.
        let converged = self.cfg.shard.count == 1
            && self.residuals.primal <= sel.eps_primal
            && self.residuals.dual <= sel.eps_dual;
        if next == 0 {
            sel.priced_start && self.iters_since >= sel.iters_per_round
        } else if next <= sel.rounds {
            self.iters_since >= sel.iters_per_round || (self.iters_since >= 1 && converged)
        } else {
            self.reselect
                .due(now, self.iteration, self.iters_since, converged)
        }
    }

    /// An agent's apps changed: it asks for an exchange at `iteration` (its last + 1). A
    /// number beyond the next round (an agent that stepped with a coordinator that counted
    /// further before a restart) is served at the next round rather than waited for.
    fn reselect_request(&mut self, from: MemberId, iteration: u64, out: &mut Vec<Action>) {
        let Some(m) = self.members.get(&from) else {
            self.violation(from, "re-selection request before join".into(), out);
            return;
        };
        let iteration = iteration.min(self.iteration.max(self.sent_iteration) + 1);
        let host = m.host.clone();
        let taken = self.reselect.request(iteration);
        self.counters.reselect_requests += 1;
        out.push(Action::Event(Event::ReselectRequested {
            member: from,
            host,
            iteration,
            taken,
        }));
    }

    fn start_exchange(&mut self, now: Duration, out: &mut Vec<Action>) {
        let sel = &self.cfg.selection;
        if self.exchange_next > sel.rounds {
            // With shards, periodic exchanges are numbered by their iteration (see
            // `Reselection::sharded_index`); never below the next number, never reused.
            if let Some(i) = self.reselect.sharded_index(sel.exchanges(), self.iteration) {
                self.exchange_next = self.exchange_next.max(i);
            }
        }
        let index = self.exchange_next;
        let phase = if index == 0 {
            let prices: Vec<(u32, f64)> = (0..self.facilities.len() as u32)
                .filter(|&f| self.owned[f as usize])
                .map(|f| (f, self.admm.price(f)))
                .collect();
            for &id in self.members.keys() {
                out.push(Action::Send(
                    id,
                    CoordMsg::Restart {
                        exchange: index,
                        prices: prices.clone(),
                    },
                ));
            }
            ExchangePhase::Apply
        } else {
            for (&id, m) in &self.members {
                let prices = m
                    .interest
                    .iter()
                    .map(|&f| (f, self.admm.price(f)))
                    .collect();
                out.push(Action::Send(
                    id,
                    CoordMsg::Select {
                        exchange: index,
                        round: index - 1,
                        prices,
                        options: self.cfg.selection.options,
                    },
                ));
            }
            ExchangePhase::Propose
        };
        self.reselect.started(self.iteration);
        out.push(Action::Event(Event::SelectionStarted {
            exchange: index,
            round: index.checked_sub(1),
            iteration: self.iteration,
        }));
        self.exchange = Some(Exchange {
            index,
            phase,
            started: now,
            waiting: self.members.keys().copied().collect(),
            proposals: BTreeMap::new(),
            parks: 0,
            activations: 0,
            refused: 0,
        });
    }

    /// Every member answered the exchange's current phase: decide the verdicts, or put the new
    /// active sets in force.
    fn exchange_step(&mut self, now: Duration, out: &mut Vec<Action>) {
        let mut x = self.exchange.take().expect("an exchange in progress");
        match x.phase {
            ExchangePhase::Propose => {
                // The floor check of the in-process solver's `apply_swaps`: hosts in instance
                // order, a park frees its floor at once, an activation is accepted only if its
                // facility still carries every member at x_min. Facilities are independent,
                // so a shard owning some of them decides exactly as one process would.
                let mut floor = vec![0.0; self.facilities.len()];
                let mut order: Vec<(u32, MemberId)> =
                    self.members.iter().map(|(&id, m)| (m.rank, id)).collect();
                order.sort_unstable();
                for &(_, id) in &order {
                    for &(f, v) in &self.members[&id].floor {
                        floor[f as usize] += v;
                    }
                }
                for &(_, id) in &order {
                    let Some(p) = x.proposals.get(&id) else {
                        continue;
                    };
                    if let Some(park) = &p.park {
                        for &(f, need) in park {
                            floor[f as usize] -= need;
                        }
                        x.parks += 1;
                    }
                    let mut accepted = false;
                    if let Some(activate) = &p.activate {
                        let fits = activate.iter().all(|&(f, need)| {
                            floor[f as usize] + need <= self.facilities[f as usize].capacity
                        });
                        if fits {
                            for &(f, need) in activate {
                                floor[f as usize] += need;
                            }
                            accepted = true;
                            x.activations += 1;
                        } else {
                            x.refused += 1;
                        }
                    }
                    out.push(Action::Send(
                        id,
                        CoordMsg::Verdict {
                            exchange: x.index,
                            activate: accepted,
                        },
                    ));
                }
                x.waiting = x.proposals.keys().copied().collect();
                x.phase = ExchangePhase::Apply;
                self.exchange = Some(x);
                if self.exchange.as_ref().is_some_and(|x| x.waiting.is_empty()) {
                    self.exchange_step(now, out);
                }
            }
            ExchangePhase::Apply => {
                let counts = self.counts();
                let sums = self.sums();
                if x.index == 0 {
                    // The priced restart re-runs the cold start on the new sets, as `solve`
                    // builds a new engine for them.
                    self.admm = self.fresh_admm();
                    self.admm.set_counts(&counts);
                    self.residuals = self.admm.update(&self.facilities, &sums, None);
                } else {
                    self.admm.set_counts(&counts);
                    self.admm.set_sums(&sums);
                }
                self.exchange_next = x.index + 1;
                self.iters_since = 0;
                self.reselect.finished(now);
                self.counters.exchanges += 1;
                self.counters.parks += x.parks as u64;
                self.counters.activations += x.activations as u64;
                self.counters.refused_activations += x.refused as u64;
                out.push(Action::Event(Event::SelectionDone {
                    exchange: x.index,
                    parks: x.parks,
                    activations: x.activations,
                    refused: x.refused,
                }));
            }
        }
    }

    /// Sorts out an exchange message's number: `Ok(true)` if it belongs to the exchange phase
    /// in progress and the member owes it, `Ok(false)` if it is stale (ignored).
    fn exchange_message(
        &self,
        from: MemberId,
        exchange: u32,
        phase: ExchangePhase,
    ) -> Result<bool, String> {
        match &self.exchange {
            Some(x) if x.index == exchange => Ok(x.phase == phase && x.waiting.contains(&from)),
            Some(x) if exchange > x.index => Err(format!(
                "answer to selection exchange {exchange} from the future"
            )),
            None if exchange >= self.exchange_next => Err(format!(
                "answer to selection exchange {exchange} from the future"
            )),
            _ => Ok(false),
        }
    }

    fn proposal(&mut self, from: MemberId, p: ProposalMsg, out: &mut Vec<Action>) {
        if !self.members.contains_key(&from) {
            self.violation(from, "proposal before join".into(), out);
            return;
        }
        let nf = self.facilities.len() as u32;
        let owned = &self.owned;
        let bad = |e: &Option<Vec<(u32, f64)>>| {
            e.as_ref().is_some_and(|list| {
                !list.windows(2).all(|w| w[0].0 < w[1].0)
                    || list
                        .iter()
                        .any(|&(f, v)| f >= nf || !owned[f as usize] || !v.is_finite() || v < 0.0)
            })
        };
        if bad(&p.park) || bad(&p.activate) {
            self.violation(from, format!("bad proposal {p:?}"), out);
            return;
        }
        match self.exchange_message(from, p.exchange, ExchangePhase::Propose) {
            Err(e) => self.violation(from, e, out),
            Ok(false) => {}
            Ok(true) => {
                let x = self.exchange.as_mut().expect("checked");
                x.waiting.remove(&from);
                x.proposals.insert(from, p);
            }
        }
    }

    fn selected(&mut self, from: MemberId, sel: SelectedMsg, out: &mut Vec<Action>) {
        if !self.members.contains_key(&from) {
            self.violation(from, "selection before join".into(), out);
            return;
        }
        if let Err(e) = self
            .check_active(&sel.pairs, &sel.floor)
            .and_then(|()| self.check_entries(&sel.entries))
        {
            self.violation(from, e, out);
            return;
        }
        match self.exchange_message(from, sel.exchange, ExchangePhase::Apply) {
            Err(e) => self.violation(from, e, out),
            Ok(false) => {}
            Ok(true) => {
                let iteration = self.iteration;
                let m = self.members.get_mut(&from).expect("checked");
                m.pairs = sel.pairs;
                m.floor = sel.floor;
                m.entries = sel.entries;
                // Older contributions still in flight are now duplicates, not news.
                m.entries_iteration = m.entries_iteration.max(iteration);
                m.exchanges = sel.exchange + 1;
                m.stale = 0;
                self.exchange
                    .as_mut()
                    .expect("checked")
                    .waiting
                    .remove(&from);
            }
        }
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

/// A GID as 32 hex digits, as logs print them.
fn gid_text(g: &Gid) -> String {
    g.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::generator::{generate, GeneratorConfig};
    use crate::model::Problem;
    use crate::protocol::agent::{AgentAction, AgentCore};
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
            selection: SelectionSchedule::fixed(),
            shard: Shard::WHOLE,
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
            rank: 0,
            interest: vec![f],
            floor: vec![(f, 0.0)],
            exchanges: 0,
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
            assert_eq!(d[0].facility, (id - 1) as u32);
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

    /// Issue 19, item 9 (log volume): a live host whose reports (every 250 ms) carry a GID
    /// another host's link owns is told so once per change, not at every report.
    #[test]
    fn a_gid_owned_elsewhere_is_reported_once_per_change() {
        let mut c = Coordinator::new_live(cfg(0, 1.0, 1), LivePolicy::default());
        let live_join = |host: &str| {
            AgentMsg::Join(Join {
                host: host.into(),
                facility_digest: 0,
                pairs: Vec::new(),
                entries: Vec::new(),
                last_iteration: 0,
                last_d: Vec::new(),
                rank: 0,
                interest: Vec::new(),
                floor: Vec::new(),
                exchanges: 0,
            })
        };
        let report = |gids: Vec<Gid>| {
            AgentMsg::Host(HostReport {
                line_rate_gbps: 10.0,
                gids,
                max_active: 4,
                wqe_budget: 1.0,
                poll_budget: 16.0,
                apps: Vec::new(),
            })
        };
        let (lo, a, b) = ([1u8; 16], [2u8; 16], [3u8; 16]);
        c.on_message(Duration::ZERO, 1, live_join("h1"));
        c.on_message(Duration::ZERO, 2, live_join("h2"));
        c.on_message(MS, 1, report(vec![lo, a]));
        let refusals = |out: &[Action]| {
            out.iter()
                .filter(|x| matches!(x, Action::Event(Event::Refused { member: 2, .. })))
                .count()
        };
        let counts: Vec<usize> = [vec![lo, b], vec![lo, b], vec![lo, b], vec![b], vec![lo, b]]
            .into_iter()
            .enumerate()
            .map(|(i, g)| refusals(&c.on_message((2 + i as u32) * MS, 2, report(g))))
            .collect();
        assert_eq!(counts, vec![1, 0, 0, 0, 1]);
    }

    /// Issue 19, item 9: a member whose connection the transport's idle timeout ended is
    /// counted as a member timeout, as one the scan finds; a closed connection is not.
    #[test]
    fn a_member_lost_to_the_idle_timeout_counts_as_a_timeout() {
        let mut c = Coordinator::new(cfg(7, 1.0, 1), vec![facility("a")]);
        c.on_message(Duration::ZERO, 1, join("h1", 7, 0, 0.2));
        c.on_message(Duration::ZERO, 2, join("h2", 7, 0, 0.2));
        c.on_disconnect(MS, 2);
        assert_eq!(c.counters().timeouts, 0);
        c.on_silence(1000 * MS, 1);
        assert_eq!(c.counters().timeouts, 1);
        assert_eq!(c.members(), 0);
        c.on_silence(1001 * MS, 1);
        assert_eq!(c.counters().timeouts, 1, "once");
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
        // Silent for more than two heartbeat intervals (100 ms): a reconnection.
        let out = c.on_message(201 * MS, 2, join("h1", 7, 0, 0.2));
        assert!(out.iter().any(|a| matches!(a, Action::Close(1, _))));
        assert_eq!(c.members(), 1);
        assert_eq!(c.status().members[0].member, 2);
    }

    /// Issue 19, item 3: a running shard takes a joining agent's higher round number (the
    /// highest any shard sent it), so that a shard restarted alone and the others number
    /// their rounds alike again; an unsharded coordinator keeps its own numbering.
    #[test]
    fn a_running_shard_aligns_its_rounds_with_a_join() {
        for (count, want) in [(2, 500), (1, 3)] {
            let shard = Shard {
                index: crate::protocol::shard_of("a", count),
                count,
            };
            let mut c = Coordinator::new(
                CoordinatorConfig {
                    shard,
                    ..cfg(7, 1.0, 1)
                },
                vec![facility("a")],
            );
            c.on_message(Duration::ZERO, 1, join("h1", 7, 0, 0.2));
            for it in 1..=3 {
                c.on_message(it * MS, 1, contrib(c.epoch(), it as u64, 0, 0.2));
            }
            assert_eq!(c.iteration(), 3);
            let AgentMsg::Join(mut j) = join("h2", 7, 0, 0.2) else {
                unreachable!()
            };
            j.last_iteration = 500;
            c.on_message(10 * MS, 2, AgentMsg::Join(j));
            assert_eq!(c.iteration(), want, "{count} shards");
        }
    }

    /// Issue 19, item 4: a second agent with a host id whose member is alive is refused, with
    /// an event naming both connections; the incumbent stays and the epoch does not move.
    #[test]
    fn a_second_agent_with_a_live_host_id_is_refused() {
        let mut c = Coordinator::new(cfg(7, 1.0, 1), vec![facility("a")]);
        c.on_message(Duration::ZERO, 1, join("h1", 7, 0, 0.2));
        c.on_message(150 * MS, 1, AgentMsg::Heartbeat { seq: 1 });
        let epoch = c.epoch();
        for (id, at) in [(2, 200), (3, 350)] {
            let out = c.on_message(at * MS, id, join("h1", 7, 0, 0.2));
            assert!(out.iter().any(|a| matches!(
                a,
                Action::Event(Event::DuplicateHost { member, incumbent: 1, host, .. })
                    if *member == id && host == "h1"
            )));
            assert!(sends(&out).iter().any(|(to, m)| *to == id
                && matches!(m, CoordMsg::Refused { reason } if reason.contains("second agent"))));
            assert!(out
                .iter()
                .any(|a| matches!(a, Action::Close(i, _) if *i == id)));
            assert!(!out.iter().any(|a| matches!(a, Action::Close(1, _))));
            assert_eq!(c.status().members[0].member, 1);
            assert_eq!(c.epoch(), epoch);
        }
        assert_eq!(c.counters().duplicate_joins, 2);
    }

    #[test]
    fn drained_host_is_removed_and_refused_until_undrained() {
        let mut c = Coordinator::new(cfg(7, 1.0, 1), vec![facility("a")]);
        c.on_message(Duration::ZERO, 1, join("h1", 7, 0, 0.2));
        c.on_message(Duration::ZERO, 2, join("h2", 7, 0, 0.5));
        let e = c.epoch();
        let out = c.drain(MS, "h2").unwrap();
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
        let d = c.admm.term(0);
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
                    last_d: vec![d],
                    rank: id as u32,
                    interest: vec![0],
                    floor: vec![(0, 0.0)],
                    exchanges: 0,
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

    /// Runs coordinator and agents back to back, delivering every message at once, until no
    /// message is left (the coordinator stops at its `max_iterations`).
    fn run_in_memory(problem: &Problem, coord: &mut Coordinator) -> Vec<AgentCore> {
        let active = crate::protocol::fixed_active_sets(problem);
        let mut agents = crate::protocol::test_agents(problem, &active);
        let now = Duration::ZERO;
        let mut inbox: Vec<(MemberId, CoordMsg)> = Vec::new();
        // Join in reverse order: verdicts must follow the hosts' ranks, not member ids.
        for (i, a) in agents.iter_mut().enumerate().rev() {
            for act in a.on_connected(now, problem) {
                if let AgentAction::Send(m) = act {
                    inbox.extend(sends(&coord.on_message(now, i as MemberId, m)));
                }
            }
        }
        while !inbox.is_empty() {
            let batch = std::mem::take(&mut inbox);
            for (id, msg) in batch {
                for act in agents[id as usize].on_message(now, problem, msg) {
                    if let AgentAction::Send(m) = act {
                        inbox.extend(sends(&coord.on_message(now, id, m)));
                    }
                }
            }
        }
        agents
    }

    /// With selection, the pure machines wired back to back reproduce `solver::solve` (the
    /// priced restart and every damped swap round) and end at its allocation.
    #[test]
    fn in_memory_cluster_with_selection_matches_solve() {
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
            // The control plane runs the swap rounds, not the verified search (docs/model.md).
            polish_trials: 0,
            ..Default::default()
        };
        let solution = crate::solver::solve(&problem, &opts);
        assert!(solution.converged);
        let swaps: usize = solution.rounds.iter().map(|r| r.swaps).sum();
        assert!(swaps > 0, "the instance must exercise selection");
        let rho = default_rho(&problem);
        let total = (opts.iters_per_round + solution.iterations) as u64;
        let mut coord = Coordinator::new(
            CoordinatorConfig {
                max_iterations: Some(total),
                selection: SelectionSchedule::from_solve(&opts),
                ..cfg(facility_digest(&problem), rho, problem.hosts.len())
            },
            problem.facilities.clone(),
        );
        let agents = run_in_memory(&problem, &mut coord);
        assert_eq!(coord.iteration(), total);
        assert_eq!(coord.exchanges_done(), opts.rounds as u32 + 1);
        assert!(coord.counters().parks + coord.counters().activations > 0);
        for (a, r) in agents.iter().zip(&solution.hosts) {
            assert_eq!(a.state().active, r.active, "host {}", r.host);
            for (x, y) in a.state().x.iter().zip(&r.x) {
                assert!((x - y).abs() < 1e-9, "host {}: {x} vs {y}", r.host);
            }
        }
    }

    /// After the schedule (and without a period) the sets stay, until an agent's apps change:
    /// its request starts an exchange at the next round boundary, where an arrived app takes
    /// a free slot and a departed one is parked.
    #[test]
    fn apps_arriving_and_leaving_after_the_schedule_start_an_exchange() {
        let problem = generate(&GeneratorConfig {
            k: 2,
            seed: 9,
            ..GeneratorConfig::new(3, 6)
        });
        let mut coord = Coordinator::new(
            CoordinatorConfig {
                selection: SelectionSchedule {
                    priced_start: false,
                    rounds: 2,
                    iters_per_round: 5,
                    options: crate::selection::SelectionOptions {
                        swap_prob: 1.0,
                        ..Default::default()
                    }
                    .into(),
                    ..SelectionSchedule::from_solve(&Default::default())
                },
                ..cfg(facility_digest(&problem), default_rho(&problem), 3)
            },
            problem.facilities.clone(),
        );
        let mut active = crate::protocol::fixed_active_sets(&problem);
        // Host 0 runs none of its apps yet.
        active[0].clear();
        let mut agents = crate::protocol::test_agents(&problem, &active);
        let n0 = problem.hosts[0].pairs.len();
        agents[0].set_present(&problem, vec![false; n0]);
        let now = Duration::ZERO;
        let mut inbox: Vec<(MemberId, CoordMsg)> = Vec::new();
        let deliver = |coord: &mut Coordinator,
                       id: usize,
                       acts: Vec<AgentAction>,
                       inbox: &mut Vec<(MemberId, CoordMsg)>| {
            for act in acts {
                if let AgentAction::Send(m) = act {
                    inbox.extend(sends(&coord.on_message(now, id as MemberId, m)));
                }
            }
        };
        for (i, a) in agents.iter_mut().enumerate() {
            let acts = a.on_connected(now, &problem);
            deliver(&mut coord, i, acts, &mut inbox);
        }
        let pump = |coord: &mut Coordinator,
                    agents: &mut Vec<AgentCore>,
                    inbox: &mut Vec<(MemberId, CoordMsg)>,
                    until: u64| {
            while coord.iteration() < until {
                let batch = std::mem::take(inbox);
                assert!(!batch.is_empty(), "the cluster stalled");
                for (id, msg) in batch {
                    let acts = agents[id as usize].on_message(now, &problem, msg);
                    deliver(coord, id as usize, acts, inbox);
                }
            }
        };
        pump(&mut coord, &mut agents, &mut inbox, 60);
        assert_eq!(coord.exchanges_done(), 3, "the schedule: exchanges 1 and 2");
        assert!(agents[0].state().active.is_empty());
        // An app arrives on host 0: one exchange, and it takes a free slot.
        let app = problem.hosts[0].pairs.start + 1;
        let mut present = vec![false; n0];
        present[1] = true;
        let acts = agents[0].set_present(&problem, present);
        assert!(acts
            .iter()
            .any(|a| matches!(a, AgentAction::Send(AgentMsg::Reselect { iteration: 61 }))));
        deliver(&mut coord, 0, acts, &mut inbox);
        pump(&mut coord, &mut agents, &mut inbox, 90);
        assert_eq!(coord.exchanges_done(), 4);
        assert_eq!(agents[0].state().active, vec![app]);
        assert!(agents[0].state().x[0] >= problem.params.x_min);
        // It leaves again: parked at the next exchange, without waiting for a period.
        let acts = agents[0].set_present(&problem, vec![false; n0]);
        deliver(&mut coord, 0, acts, &mut inbox);
        pump(&mut coord, &mut agents, &mut inbox, 120);
        assert_eq!(coord.exchanges_done(), 5);
        assert!(agents[0].state().active.is_empty());
        // Three requests: the join of host 0 (its apps changed before it joined), the arrival
        // and the departure.
        assert_eq!(coord.counters().reselect_requests, 3);
        assert_eq!(
            coord
                .status()
                .members
                .iter()
                .find(|m| m.host == problem.hosts[0].id)
                .unwrap()
                .facilities,
            0
        );
    }

    /// A proposal for an exchange that has not been sent is a violation; a stale one is not.
    #[test]
    fn exchange_answers_are_told_apart_by_number() {
        let mut c = Coordinator::new(
            CoordinatorConfig {
                selection: SelectionSchedule {
                    iters_per_round: 1,
                    ..SelectionSchedule::from_solve(&Default::default())
                },
                ..cfg(7, 1.0, 1)
            },
            vec![facility("a"), facility("b")],
        );
        c.on_message(Duration::ZERO, 1, join("h1", 7, 0, 0.2));
        let e = c.epoch();
        // One round, then the priced restart (exchange 0) goes out and rounds pause.
        let out = c.on_message(MS, 1, contrib(e, 1, 0, 0.3));
        assert!(sends(&out)
            .iter()
            .any(|(_, m)| matches!(m, CoordMsg::Restart { exchange: 0, .. })));
        assert!(c.selecting());
        let out = c.on_message(MS, 1, contrib(e, 2, 0, 0.3));
        // A contribution to a round not sent (rounds pause) is a violation; h1 is gone and the
        // restart completes without it.
        assert!(
            out.iter().any(|a| matches!(a, Action::Close(1, _))),
            "{out:?}"
        );
        assert!(!c.selecting());
        // An answer to an exchange not yet sent is a violation too.
        c.on_message(2 * MS, 2, join("h2", 7, 0, 0.2));
        let out = c.on_message(
            3 * MS,
            2,
            AgentMsg::Proposal(ProposalMsg {
                exchange: 3,
                park: None,
                activate: None,
            }),
        );
        assert!(out.iter().any(|a| matches!(a, Action::Close(2, _))));
        c.on_message(4 * MS, 3, join("h3", 7, 0, 0.2));
        // A stale answer (exchange 0 is over) is ignored, not a violation.
        assert!(!c.selecting());
        assert_eq!(c.exchanges_done(), 1);
        let out = c.on_message(
            5 * MS,
            3,
            AgentMsg::Selected(SelectedMsg {
                exchange: 0,
                pairs: vec![(1, 1)],
                floor: vec![(1, 0.0)],
                entries: vec![(1, 0.1)],
            }),
        );
        assert!(
            !out.iter().any(|a| matches!(a, Action::Close(..))),
            "stale: {out:?}"
        );
        assert_eq!(c.status().facilities[1].pairs, 0);
    }

    /// `set_weight` is checked, reaches every member at once and every later joiner after
    /// its welcome; the operator state round-trips, and a bad one is refused whole.
    #[test]
    fn weights_reach_members_and_joiners_and_operator_state_round_trips() {
        let mut c = Coordinator::new(cfg(7, 1.0, 1), vec![facility("a"), facility("b")]);
        c.set_apps(vec!["x".into(), "y".into()]);
        c.on_message(Duration::ZERO, 1, join("h1", 7, 0, 0.2));
        assert!(c.set_weight("z", 1.0).unwrap_err().contains("no app"));
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            assert!(c.set_weight("x", bad).is_err(), "{bad}");
        }
        let out = c.set_weight("y", 2.5).unwrap();
        assert_eq!(
            sends(&out),
            vec![(
                1,
                CoordMsg::SetWeight {
                    app: "y".into(),
                    weight: 2.5
                }
            )]
        );
        let out = c.on_message(MS, 2, join("h2", 7, 1, 0.2));
        let to2: Vec<CoordMsg> = sends(&out)
            .into_iter()
            .filter(|(id, _)| *id == 2)
            .map(|(_, m)| m)
            .collect();
        assert!(matches!(to2[0], CoordMsg::Welcome { .. }));
        assert!(to2.contains(&CoordMsg::SetWeight {
            app: "y".into(),
            weight: 2.5
        }));
        c.set_capacity("b", 0.5).unwrap();
        c.drain(2 * MS, "h2").unwrap();
        let st = c.operator_state();
        assert_eq!(st.capacities, BTreeMap::from([("b".to_string(), 0.5)]));
        assert_eq!(st.weights, BTreeMap::from([("y".to_string(), 2.5)]));
        assert_eq!(st.drained, vec!["h2".to_string()]);
        let mut r = Coordinator::new(cfg(7, 1.0, 1), vec![facility("a"), facility("b")]);
        r.set_apps(vec!["x".into(), "y".into()]);
        assert!(r.restore(&st).is_empty());
        assert_eq!(r.operator_state(), st);
        assert_eq!(r.status().facilities[1].capacity, 0.5);
        // A state with changes that do not fit: those that fit are applied, the others
        // reported (the caller sets the file aside), never an error that stops the start.
        let mut bad = st.clone();
        bad.weights.insert("nope".into(), 1.0);
        bad.capacities.insert("a".into(), 1e308);
        bad.drained.push(String::new());
        let mut q = Coordinator::new(cfg(7, 1.0, 1), vec![facility("a"), facility("b")]);
        q.set_apps(vec!["x".into(), "y".into()]);
        let refused = q.restore(&bad);
        assert_eq!(refused.len(), 3, "{refused:?}");
        assert!(
            refused.iter().any(|r| r.contains("\"nope\"")),
            "{refused:?}"
        );
        assert!(refused.iter().any(|r| r.contains("1e308")), "{refused:?}");
        assert!(
            refused.iter().any(|r| r.contains("host id \"\"")),
            "{refused:?}"
        );
        assert_eq!(q.operator_state(), st);
    }

    /// Issue 19, items 1 and 5: an operator command may not store what a restart would
    /// refuse, nor values the instance validation refuses.
    #[test]
    fn operator_commands_refuse_what_a_restart_or_the_instance_would() {
        let mut c = Coordinator::new(cfg(7, 1.0, 1), vec![facility("a")]);
        c.set_hosts(vec!["h1".into(), "h2".into()]);
        c.on_message(Duration::ZERO, 1, join("h1", 7, 0, 0.2));
        for bad in ["", "h 1", "../h1", &"h".repeat(65)] {
            assert!(c.drain(MS, bad).unwrap_err().contains("host id"), "{bad:?}");
        }
        assert!(c.drain(MS, "h9").unwrap_err().contains("no host \"h9\""));
        assert_eq!(c.members(), 1);
        assert!(c.operator_state().drained.is_empty());
        assert!(
            c.drain(MS, "h2").is_ok(),
            "a host of the instance, not a member"
        );
        for bad in [1e308, 5e-324, 1e-300, 0.0, -1.0, f64::NAN, f64::INFINITY] {
            let e = c.set_capacity("a", bad).unwrap_err();
            assert!(e.contains("[1e-9, 1e9]"), "{bad}: {e}");
        }
        c.set_capacity("a", 1e-9).unwrap();
        c.set_capacity("a", 1e9).unwrap();
        // The live problem knows no host list: any well-formed name may be drained.
        let mut l = Coordinator::new_live(cfg(0, 1.0, 1), LivePolicy::default());
        assert!(l.drain(MS, "later").is_ok());
        assert!(l.drain(MS, "").is_err());
    }

    /// Verdicts follow the hosts' ranks: with room for one more pair at x_min, the
    /// lower-ranked host's activation wins, the other is refused; parks always hold.
    #[test]
    fn activations_are_decided_in_rank_order_against_the_floor() {
        let fac = vec![
            Facility {
                id: "a".into(),
                capacity: 1.0,
                cost: 0.0,
            },
            Facility {
                id: "b".into(),
                capacity: 0.75,
                cost: 0.0,
            },
        ];
        let mut c = Coordinator::new(
            CoordinatorConfig {
                selection: SelectionSchedule {
                    priced_start: false,
                    iters_per_round: 1,
                    ..SelectionSchedule::from_solve(&Default::default())
                },
                ..cfg(7, 1.0, 2)
            },
            fac,
        );
        let j = |rank: u32| {
            AgentMsg::Join(Join {
                host: format!("h{rank}"),
                facility_digest: 7,
                pairs: vec![(0, 1), (1, 1)],
                entries: vec![(0, 0.2), (1, 0.1)],
                last_iteration: 0,
                last_d: Vec::new(),
                rank,
                interest: vec![0, 1],
                floor: vec![(0, 0.25), (1, 0.25)],
                exchanges: 0,
            })
        };
        // Member 1 has rank 5, member 2 rank 3: member 2 decides first.
        c.on_message(Duration::ZERO, 1, j(5));
        c.on_message(Duration::ZERO, 2, j(3));
        let e = c.epoch();
        c.on_message(MS, 1, contrib(e, 1, 0, 0.2));
        let out = c.on_message(MS, 2, contrib(e, 1, 0, 0.2));
        let selects: Vec<_> = sends(&out)
            .into_iter()
            .filter(|(_, m)| matches!(m, CoordMsg::Select { exchange: 1, .. }))
            .collect();
        assert_eq!(selects.len(), 2);
        let CoordMsg::Select { prices, .. } = &selects[0].1 else {
            unreachable!()
        };
        assert_eq!(prices.len(), 2);
        // Facility b holds 0.5 of 0.75 at the floor: room for one more 0.25, not two.
        let propose = |park| {
            AgentMsg::Proposal(ProposalMsg {
                exchange: 1,
                park,
                activate: Some(vec![(1, 0.25)]),
            })
        };
        c.on_message(2 * MS, 1, propose(Some(vec![(0, 0.25)])));
        let out = c.on_message(2 * MS, 2, propose(None));
        let verdicts: BTreeMap<MemberId, bool> = sends(&out)
            .into_iter()
            .filter_map(|(id, m)| match m {
                CoordMsg::Verdict { activate, .. } => Some((id, activate)),
                _ => None,
            })
            .collect();
        assert_eq!(verdicts, BTreeMap::from([(1, false), (2, true)]));
        let s = c.status();
        assert_eq!(s.counters.parks, 0, "counted when the exchange completes");
        for (id, pairs) in [(1u64, vec![(1, 1)]), (2, vec![(0, 1), (1, 2)])] {
            c.on_message(
                3 * MS,
                id,
                AgentMsg::Selected(SelectedMsg {
                    exchange: 1,
                    floor: pairs.iter().map(|&(f, n)| (f, 0.25 * n as f64)).collect(),
                    entries: pairs.iter().map(|&(f, _)| (f, 0.1)).collect(),
                    pairs,
                }),
            );
        }
        let s = c.status();
        assert!(!s.selection.in_progress);
        assert_eq!(s.selection.exchanges_done, 2);
        assert_eq!(
            (
                s.counters.parks,
                s.counters.activations,
                s.counters.refused_activations
            ),
            (1, 1, 1)
        );
        assert_eq!(s.facilities[1].pairs, 3);
        assert_eq!(s.facilities[0].pairs, 1);
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
        let mut agents = crate::protocol::test_agents(&problem, &active);
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
