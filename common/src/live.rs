//! The live problem (docs/live-problem.md): what the optimiser works on when no instance file
//! describes the cluster. Hosts join with their NIC, an app is a pair on a host while one of its
//! shims is registered there, each host's receive link is a facility, and a pair's coefficient
//! on a link is the share of its connections that end at that link's host. The coordinator owns
//! the shape and the weights ([`LivePolicy`]) and the facility table ([`LiveFacility`]); each
//! agent builds its own host's row from them ([`host_problem`]) and reports it
//! ([`HostReport`]), from which the coordinator writes a snapshot instance ([`snapshot`]).
//! Pure: no I/O, no clocks.

use crate::app_identity::{AppIdentities, AppIdentity};
use crate::instance::{AppSpec, FacilitySpec, HostSpec, Instance, UseSpec};
use crate::model::{Facility, Host, Pair, Params, Problem};
use crate::protocol::agent::{AgentAction, AgentCore};
use crate::protocol::AgentMsg;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// A GID (IPv4-mapped on RoCE v2 and softrnic).
pub type Gid = [u8; 16];

/// Weights, like every value of an instance, must lie in this range: far outside it is a unit
/// mistake, and 1e308 or 0 would make the optimiser's numbers overflow or vanish.
pub const WEIGHT_RANGE: (f64, f64) = (1e-9, 1e9);

/// Most facilities (hosts) and apps per host a report may carry: far beyond any real host, low
/// enough that a confused agent cannot make the coordinator allocate without bound.
pub const MAX_HOSTS: usize = 100_000;
pub const MAX_APPS_PER_HOST: usize = 4096;

/// Whether `w` is a weight the optimiser can take.
pub fn valid_weight(w: f64) -> bool {
    w.is_finite() && (WEIGHT_RANGE.0..=WEIGHT_RANGE.1).contains(&w)
}

/// The problem's shape and the weights: the coordinator's, pushed to every agent, so that every
/// host steps with the same values and `status` shows the ones in force.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LivePolicy {
    pub alpha: f64,
    pub beta: f64,
    pub x_min: f64,
    /// The weight of every app the policy does not name.
    pub default_weight: f64,
    /// `(app, weight)`, sorted by app, each app once.
    pub weights: Vec<(String, f64)>,
}

impl Default for LivePolicy {
    fn default() -> Self {
        Self {
            alpha: 1.0,
            beta: 1e-4,
            x_min: 0.005,
            default_weight: 1.0,
            weights: Vec::new(),
        }
    }
}

impl LivePolicy {
    pub fn weight(&self, app: &str) -> f64 {
        self.weights
            .binary_search_by(|e| e.0.as_str().cmp(app))
            .map_or(self.default_weight, |i| self.weights[i].1)
    }

    /// Sets one app's weight (`None`: back to the default).
    pub fn set_weight(&mut self, app: &str, weight: Option<f64>) {
        match (
            self.weights.binary_search_by(|e| e.0.as_str().cmp(app)),
            weight,
        ) {
            (Ok(i), Some(w)) => self.weights[i].1 = w,
            (Ok(i), None) => {
                self.weights.remove(i);
            }
            (Err(i), Some(w)) => self.weights.insert(i, (app.to_string(), w)),
            (Err(_), None) => {}
        }
    }

    /// Every value in range, the weights sorted and unique; errors name the value.
    pub fn check(&self) -> Result<(), String> {
        let mag = |name: &str, v: f64| {
            if v.is_finite() && (1e-9..=1e9).contains(&v) {
                Ok(())
            } else {
                Err(format!(
                    "{name} must be a finite number in [1e-9, 1e9], got {v}"
                ))
            }
        };
        mag("alpha", self.alpha)?;
        mag("x_min", self.x_min)?;
        if self.x_min > 0.1 {
            return Err(format!("x_min must be at most 0.1, got {}", self.x_min));
        }
        if !(self.beta.is_finite() && (0.0..=1e9).contains(&self.beta)) {
            return Err(format!("beta must be finite and ≥ 0, got {}", self.beta));
        }
        if !valid_weight(self.default_weight) {
            return Err(weight_error("default_weight", self.default_weight));
        }
        if !self.weights.windows(2).all(|w| w[0].0 < w[1].0) {
            return Err("weights must be sorted by app, each app once".into());
        }
        for (app, w) in &self.weights {
            if !valid_weight(*w) {
                return Err(weight_error(&format!("the weight of app {app:?}"), *w));
            }
        }
        Ok(())
    }
}

/// The error for a weight out of range, naming it.
pub fn weight_error(what: &str, w: f64) -> String {
    // 1e308 in full would be a line of 300 zeros.
    let got = if w.is_finite() && w != 0.0 && !(1e-6..1e9).contains(&w.abs()) {
        format!("{w:e}")
    } else {
        format!("{w}")
    };
    format!(
        "{what} must be a finite number in [{:e}, {:e}], got {got}",
        WEIGHT_RANGE.0, WEIGHT_RANGE.1
    )
}

/// One facility of the live problem: a host's receive link.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LiveFacility {
    /// `rx:HOST`.
    pub id: String,
    pub host: String,
    /// The link's line rate in Gb/s.
    pub line_rate_gbps: f64,
    /// The share of the line rate the optimiser may fill: 1, or the operator's `set-capacity`.
    pub capacity: f64,
    /// The host's GIDs: traffic to any of them lands on this link.
    pub gids: Vec<Gid>,
}

/// The facility id of a host's receive link.
pub fn link_id(host: &str) -> String {
    format!("rx:{host}")
}

/// What an agent knows of its NIC (agent config `[nic]`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NicParams {
    pub line_rate_gbps: f64,
    /// `k`: apps active at once at most.
    pub max_active: u32,
    /// `Q`, the WQE budget, in fractions of line rate.
    pub wqe_budget: f64,
    /// `C`, the polling budget.
    pub poll_budget: f64,
}

/// A running app as the agent sees it through its shims.
#[derive(Clone, Debug, PartialEq)]
pub struct LiveApp {
    pub name: String,
    /// How much of its traffic goes to each peer GID, over all the app's registered
    /// processes: its measured byte rates once it has sent anything
    /// ([`crate::traffic_shares`]), before that its connected QPs.
    pub peers: Vec<(Gid, f64)>,
    /// How much lands on this host's own receive link on the same scale: the data of its
    /// RDMA READs, which flows from the responder back to the requester.
    pub own: f64,
}

/// A new app's values until its shims have said otherwise (docs/live-problem.md): it may use
/// the whole line, with one completion per WQE.
pub const NEW_APP_DEMAND: f64 = 1.0;
pub const NEW_APP_CQE_PER_WQE: f64 = 1.0;

/// A peer GID no facility owns, and the app whose connection ends there.
#[derive(Clone, Debug, PartialEq)]
pub struct UnknownPeer {
    pub app: String,
    pub gid: Gid,
}

/// This host's row of the live problem, as a one-host [`Problem`] over every facility of the
/// table: apps in name order at the new-app values, each with `b_f = share_f × L / L_f`, where
/// `share_f` is the share of the app's traffic ([`LiveApp`]) that lands on `f`'s host (its READ
/// data on this host's own link), `L` this host's line rate and `L_f` the receiver's: rates are
/// fractions of the sender's line, capacities of the receiver's, so `b_f·x` is the app's load
/// on `f` in `f`'s units. Traffic to a GID no facility owns loads no facility; those peers are
/// returned so the caller can say so.
pub fn host_problem(
    host: &str,
    nic: &NicParams,
    policy: &LivePolicy,
    facilities: &[LiveFacility],
    apps: &[LiveApp],
) -> (Problem, Vec<UnknownPeer>) {
    let mut unknown = Vec::new();
    let mut names: Vec<&LiveApp> = apps.iter().collect();
    names.sort_by(|a, b| a.name.cmp(&b.name));
    names.dedup_by(|a, b| a.name == b.name);
    names.truncate(MAX_APPS_PER_HOST);
    let pairs: Vec<Pair> = names
        .iter()
        .enumerate()
        .map(|(i, app)| {
            let total: f64 = app.own + app.peers.iter().map(|p| p.1).sum::<f64>();
            let mut uses: Vec<(u32, f64)> = Vec::new();
            let mut load = |f: usize, n: f64| match uses.iter_mut().find(|u| u.0 == f as u32) {
                Some(u) => u.1 += n,
                None => uses.push((f as u32, n)),
            };
            if app.own > 0.0 {
                // This host's link appears in the table once the host has reported.
                let own = link_id(host);
                if let Some(f) = facilities.iter().position(|f| f.id == own) {
                    load(f, app.own);
                }
            }
            for &(gid, n) in &app.peers {
                match facilities.iter().position(|f| f.gids.contains(&gid)) {
                    Some(f) => load(f, n),
                    None => unknown.push(UnknownPeer {
                        app: app.name.clone(),
                        gid,
                    }),
                }
            }
            uses.retain(|u| u.1 > 0.0);
            for u in &mut uses {
                u.1 *= nic.line_rate_gbps / (total * facilities[u.0 as usize].line_rate_gbps);
            }
            uses.sort_unstable_by_key(|u| u.0);
            Pair {
                app: i as u32,
                weight: policy.weight(&app.name),
                cqe_per_wqe: NEW_APP_CQE_PER_WQE,
                demand: NEW_APP_DEMAND,
                uses,
            }
        })
        .collect();
    let problem = Problem {
        params: Params {
            alpha: policy.alpha,
            beta: policy.beta,
            k: nic.max_active as usize,
            x_min: policy.x_min,
        },
        facilities: facilities
            .iter()
            .map(|f| Facility {
                id: f.id.clone(),
                capacity: f.capacity,
                cost: 0.0,
            })
            .collect(),
        app_names: names.iter().map(|a| a.name.clone()).collect(),
        hosts: vec![Host {
            id: host.to_string(),
            wqe_budget: nic.wqe_budget,
            poll_budget: nic.poll_budget,
            k: None,
            pairs: 0..pairs.len(),
        }],
        pairs,
    };
    (problem, unknown)
}

/// The largest `a` a pair of this host may have: with `k` apps at `x_min` each, the polling
/// budget must still hold (the model's floor feasibility), whatever the shims measure.
pub fn max_cqe_per_wqe(nic: &NicParams, x_min: f64) -> f64 {
    nic.poll_budget / (nic.max_active.max(1) as f64 * x_min)
}

/// What an agent tells the coordinator of its host: its NIC and its row of the problem with
/// the current grants. The coordinator keeps it for `status` and [`snapshot`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct HostReport {
    pub line_rate_gbps: f64,
    pub gids: Vec<Gid>,
    pub max_active: u32,
    pub wqe_budget: f64,
    pub poll_budget: f64,
    pub apps: Vec<AppReport>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AppReport {
    pub app: String,
    pub weight: f64,
    pub cqe_per_wqe: f64,
    pub demand: f64,
    /// `(facility, b)` as in [`Pair::uses`], indices of the coordinator's facility table.
    pub uses: Vec<(u32, f64)>,
    pub active: bool,
    /// The granted rate `x` (0 when parked).
    pub rate: f64,
    /// Who runs it on the host, as the agent learnt from the kernel (bounded:
    /// [`crate::app_identity`]).
    pub identities: Vec<AppIdentity>,
    /// Identities the bounds left out.
    pub more_identities: u32,
}

impl HostReport {
    /// The report of a host's one-host problem and its current rates.
    /// `identities`: who runs each app ([`crate::app_identity::group`]), bounded here.
    pub fn of(
        problem: &Problem,
        line_rate_gbps: f64,
        gids: &[Gid],
        rate: &dyn Fn(usize) -> Option<f64>,
        identities: &BTreeMap<String, Vec<AppIdentity>>,
    ) -> Self {
        let h = &problem.hosts[0];
        let names: Vec<&str> = problem.pairs[h.pairs.clone()]
            .iter()
            .map(|p| problem.app_names[p.app as usize].as_str())
            .collect();
        let mut ids = crate::app_identity::bounded(&names, identities).into_iter();
        HostReport {
            line_rate_gbps,
            gids: gids.to_vec(),
            max_active: problem.params.k as u32,
            wqe_budget: h.wqe_budget,
            poll_budget: h.poll_budget,
            apps: problem.pairs[h.pairs.clone()]
                .iter()
                .enumerate()
                .map(|(i, p)| {
                    let x = rate(h.pairs.start + i);
                    let AppIdentities { identities, more } = ids.next().unwrap_or_default();
                    AppReport {
                        app: problem.app_names[p.app as usize].clone(),
                        weight: p.weight,
                        cqe_per_wqe: p.cqe_per_wqe,
                        demand: p.demand,
                        uses: p.uses.clone(),
                        active: x.is_some(),
                        rate: x.unwrap_or(0.0),
                        identities,
                        more_identities: more,
                    }
                })
                .collect(),
        }
    }

    /// Every value finite and in range, every facility index below `facilities`; errors name
    /// the first bad value.
    pub fn check(&self, facilities: usize) -> Result<(), String> {
        let pos = |name: &str, v: f64| {
            if v.is_finite() && (1e-9..=1e9).contains(&v) {
                Ok(())
            } else {
                Err(format!(
                    "{name} must be a finite number in [1e-9, 1e9], got {v}"
                ))
            }
        };
        pos("line_rate_gbps", self.line_rate_gbps)?;
        pos("wqe_budget", self.wqe_budget)?;
        pos("poll_budget", self.poll_budget)?;
        if self.max_active == 0 || self.gids.len() > 64 || self.apps.len() > MAX_APPS_PER_HOST {
            return Err(format!(
                "max_active must be positive ({}), at most 64 GIDs ({}) and {MAX_APPS_PER_HOST} apps ({})",
                self.max_active,
                self.gids.len(),
                self.apps.len()
            ));
        }
        crate::app_identity::check(
            self.apps
                .iter()
                .map(|a| (a.app.as_str(), &a.identities[..])),
        )?;
        for a in &self.apps {
            if !crate::protocol::valid_name(&a.app) {
                return Err(format!("app name {:?} is not a valid name", a.app));
            }
            pos(&format!("{}.weight", a.app), a.weight)?;
            pos(&format!("{}.cqe_per_wqe", a.app), a.cqe_per_wqe)?;
            pos(&format!("{}.demand", a.app), a.demand)?;
            if !(a.rate.is_finite() && a.rate >= 0.0) {
                return Err(format!(
                    "{}.rate must be finite and ≥ 0, got {}",
                    a.app, a.rate
                ));
            }
            if !a.uses.windows(2).all(|w| w[0].0 < w[1].0)
                || a.uses
                    .iter()
                    .any(|&(f, b)| f as usize >= facilities || pos("b", b).is_err())
            {
                return Err(format!(
                    "{}.uses must name known facilities in order with b in [1e-9, 1e9]",
                    a.app
                ));
            }
        }
        Ok(())
    }
}

/// The live problem as an instance file: every facility with its capacity, every reporting host
/// with its apps' current values. Hosts' `k` go to `hosts[].k` where they differ from the
/// largest, which becomes the instance's `k`.
pub fn snapshot(
    policy: &LivePolicy,
    facilities: &[Facility],
    hosts: &[(String, HostReport)],
) -> Instance {
    let k = hosts
        .iter()
        .map(|h| h.1.max_active as usize)
        .max()
        .unwrap_or(1);
    Instance {
        alpha: policy.alpha,
        beta: policy.beta,
        k,
        x_min: policy.x_min,
        facilities: facilities
            .iter()
            .map(|f| FacilitySpec {
                id: f.id.clone(),
                capacity: f.capacity,
                cost: f.cost,
            })
            .collect(),
        hosts: hosts
            .iter()
            .map(|(id, r)| HostSpec {
                id: id.clone(),
                wqe_budget: r.wqe_budget,
                poll_budget: r.poll_budget,
                k: (r.max_active as usize != k).then_some(r.max_active as usize),
                apps: r
                    .apps
                    .iter()
                    .map(|a| AppSpec {
                        id: a.app.clone(),
                        weight: a.weight,
                        cqe_per_wqe: a.cqe_per_wqe,
                        demand: a.demand,
                        facility: None,
                        facility_coeff: None,
                        facilities: Some(
                            a.uses
                                .iter()
                                .map(|&(f, coeff)| UseSpec {
                                    id: facilities[f as usize].id.clone(),
                                    coeff,
                                })
                                .collect(),
                        ),
                    })
                    .collect(),
            })
            .collect(),
    }
}

/// What [`LiveHost::rebuild`] did: the core's actions (send them), the peers no facility
/// owns, and the apps that arrived and left (by name).
#[derive(Clone, Debug, PartialEq)]
pub struct Rebuilt {
    pub actions: Vec<AgentAction>,
    pub unknown: Vec<UnknownPeer>,
    pub arrived: Vec<String>,
    pub left: Vec<String>,
}

/// An agent's view of the live problem: its NIC and GIDs, what the coordinator said (policy,
/// facility table) and the apps its shims run. [`LiveHost::step`] turns a change of any of
/// them into the agent core's rebuild and a report.
#[derive(Clone, Debug, PartialEq)]
pub struct LiveHost {
    pub host: String,
    pub nic: NicParams,
    pub gids: Vec<Gid>,
    pub policy: LivePolicy,
    pub facilities: Vec<LiveFacility>,
    pub apps: Vec<LiveApp>,
    /// Who runs each app (reported, not part of the problem).
    pub identities: BTreeMap<String, Vec<AppIdentity>>,
}

impl LiveHost {
    pub fn new(host: &str, nic: NicParams, gids: Vec<Gid>) -> Self {
        LiveHost {
            host: host.to_string(),
            nic,
            gids,
            policy: LivePolicy::default(),
            facilities: Vec::new(),
            apps: Vec::new(),
            identities: BTreeMap::new(),
        }
    }

    /// The host's problem now ([`host_problem`]).
    pub fn problem(&self) -> (Problem, Vec<UnknownPeer>) {
        host_problem(
            &self.host,
            &self.nic,
            &self.policy,
            &self.facilities,
            &self.apps,
        )
    }

    /// Rebuilds `problem` from this view: each app that stays keeps the `a` and demand cap
    /// measured for it (within the new bounds), the core maps its state over, and the host's
    /// report follows the core's `Update`.
    pub fn rebuild(&self, core: &mut AgentCore, problem: &mut Problem) -> Rebuilt {
        let (mut new, unknown) = self.problem();
        let a_max = max_cqe_per_wqe(&self.nic, new.params.x_min);
        for pair in &mut new.pairs {
            let name = &new.app_names[pair.app as usize];
            if let Some(old) = problem
                .pairs
                .iter()
                .find(|p| problem.app_names[p.app as usize] == *name)
            {
                pair.cqe_per_wqe = old.cqe_per_wqe.min(a_max);
                pair.demand = old.demand.max(new.params.x_min);
            }
        }
        let names = |p: &Problem| -> Vec<String> { p.app_names.clone() };
        let (before, after) = (names(problem), names(&new));
        let mut actions = core.rebuild(problem, &new);
        *problem = new;
        if core.is_member() {
            actions.push(AgentAction::Send(self.report(core, problem)));
        }
        Rebuilt {
            actions,
            unknown,
            arrived: after
                .iter()
                .filter(|a| !before.contains(a))
                .cloned()
                .collect(),
            left: before.into_iter().filter(|a| !after.contains(a)).collect(),
        }
    }

    /// The host's report of `problem` with the core's current rates.
    pub fn report(&self, core: &AgentCore, problem: &Problem) -> AgentMsg {
        let st = core.state();
        let rate = |p: usize| st.active.binary_search(&p).ok().map(|i| st.x[i]);
        AgentMsg::Host(HostReport::of(
            problem,
            self.nic.line_rate_gbps,
            &self.gids,
            &rate,
            &self.identities,
        ))
    }
}

#[cfg(test)]
mod tests;
