//! What the coordinator shows: `status` and its counters, and the accessors the server
//! and the tests read.

use super::*;

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
    /// Live problem through a relay: the hosts of its rack with their apps (empty otherwise).
    pub rack: Vec<RackHostStatus>,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RackHostStatus {
    pub host: String,
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

impl Coordinator {
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

    /// The shard this coordinator serves.
    pub fn shard(&self) -> Shard {
        self.cfg.shard
    }

    pub fn config(&self) -> &CoordinatorConfig {
        &self.cfg
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
                        .reports
                        .get(&m.host)
                        .map(|r| r.report.apps.clone())
                        .unwrap_or_default(),
                    rack: m
                        .reports
                        .iter()
                        .filter(|(h, _)| **h != m.host)
                        .map(|(h, r)| RackHostStatus {
                            host: h.clone(),
                            apps: r.report.apps.clone(),
                        })
                        .collect(),
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
}
