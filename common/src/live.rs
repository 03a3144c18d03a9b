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
mod tests {
    use super::*;

    fn nic() -> NicParams {
        NicParams {
            line_rate_gbps: 10.0,
            max_active: 4,
            wqe_budget: 1.0,
            poll_budget: 16.0,
        }
    }

    fn links() -> Vec<LiveFacility> {
        ["h1", "h2"]
            .iter()
            .enumerate()
            .map(|(i, h)| LiveFacility {
                id: link_id(h),
                host: h.to_string(),
                line_rate_gbps: 40.0,
                capacity: 1.0,
                gids: vec![[i as u8 + 1; 16]],
            })
            .collect()
    }

    #[test]
    fn coefficients_are_shares_of_connections_times_the_line_rate() {
        let mut policy = LivePolicy::default();
        policy.set_weight("b", Some(3.0));
        let apps = [
            LiveApp {
                name: "b".into(),
                peers: vec![([1; 16], 3.0), ([2; 16], 1.0), ([9; 16], 4.0)],
                own: 0.0,
            },
            LiveApp {
                name: "a".into(),
                peers: vec![],
                own: 0.0,
            },
        ];
        let (p, unknown) = host_problem("h0", &nic(), &policy, &links(), &apps);
        assert_eq!(p.app_names, ["a", "b"]);
        assert!(p.pairs[0].uses.is_empty(), "no connections: no facility");
        assert_eq!(p.pairs[0].weight, 1.0, "the default weight");
        assert_eq!(p.pairs[1].weight, 3.0);
        // 8 QPs: 3 to h1, 1 to h2, 4 to a GID no agent owns; 10 Gb/s into 40 Gb/s links.
        assert_eq!(p.pairs[1].uses, vec![(0, 0.09375), (1, 0.03125)]);
        assert_eq!(
            unknown,
            vec![UnknownPeer {
                app: "b".into(),
                gid: [9; 16]
            }]
        );
    }

    #[test]
    fn byte_shares_weigh_the_links_and_read_data_loads_the_own_link() {
        let policy = LivePolicy::default();
        // On h1: 3 parts written to h2 for 1 part read from it (READ data comes back to h1).
        let apps = [LiveApp {
            name: "r".into(),
            peers: vec![([2; 16], 0.75)],
            own: 0.25,
        }];
        let (p, unknown) = host_problem("h1", &nic(), &policy, &links(), &apps);
        assert!(unknown.is_empty());
        assert_eq!(p.pairs[0].uses, vec![(0, 0.0625), (1, 0.1875)]);
        // A pure reader loads only its own link; a host not yet in the table, nothing.
        let reader = [LiveApp {
            name: "r".into(),
            peers: vec![([2; 16], 0.0)],
            own: 1.0,
        }];
        let (p, _) = host_problem("h1", &nic(), &policy, &links(), &reader);
        assert_eq!(p.pairs[0].uses, vec![(0, 0.25)]);
        let (p, _) = host_problem("h9", &nic(), &policy, &links(), &reader);
        assert!(p.pairs[0].uses.is_empty());
    }

    #[test]
    fn policy_refuses_weights_out_of_range() {
        for w in [0.0, f64::NAN, 1e308, -1.0, f64::INFINITY] {
            let mut p = LivePolicy::default();
            p.set_weight("x", Some(w));
            let e = p.check().unwrap_err();
            assert!(e.contains("app \"x\""), "{e}");
            let p = LivePolicy {
                default_weight: w,
                ..LivePolicy::default()
            };
            assert!(p.check().unwrap_err().contains("default_weight"));
        }
        assert_eq!(LivePolicy::default().check(), Ok(()));
    }

    #[test]
    fn a_snapshot_is_a_valid_instance_of_the_reported_rows() {
        let policy = LivePolicy::default();
        let apps = [LiveApp {
            name: "a".into(),
            peers: vec![([2; 16], 1.0)],
            own: 0.0,
        }];
        let (p, _) = host_problem("h1", &nic(), &policy, &links(), &apps);
        let report = HostReport::of(&p, 10.0, &[[1; 16]], &|_| Some(0.5), &BTreeMap::new());
        assert_eq!(report.check(2), Ok(()));
        // Who runs the app is carried, bounded; a report beyond the bounds is refused.
        let id = |uid| AppIdentity {
            uid,
            gid: uid,
            cgroup: "/".into(),
            processes: 1,
        };
        let ids = BTreeMap::from([("a".to_string(), (0..20).map(id).collect())]);
        let mut with_ids = HostReport::of(&p, 10.0, &[[1; 16]], &|_| Some(0.5), &ids);
        let a = &with_ids.apps[0];
        assert_eq!((a.identities.len(), a.more_identities), (8, 12));
        assert_eq!(with_ids.check(2), Ok(()));
        with_ids.apps[0].identities = (0..20).map(id).collect();
        assert!(with_ids.check(2).unwrap_err().contains("identities"));
        let facilities: Vec<Facility> = p.facilities.clone();
        let inst = snapshot(&policy, &facilities, &[("h1".into(), report)]);
        let q = inst.into_problem().expect("valid");
        assert_eq!(q.pairs[0].uses, vec![(1, 0.25)]);
        assert_eq!(q.hosts[0].id, "h1");
    }

    /// An app that arrives while the coordinator has not yet heard the host's `Update` (the
    /// exchange carries no price for the app's link) keeps asking for exchanges until one
    /// decides. Settled on that empty answer, it stayed parked until some unrelated change:
    /// 35 s in CI after an agent restart.
    #[test]
    fn an_arrival_answered_before_its_prices_asks_again() {
        use crate::admm::HostState;
        use crate::protocol::agent::AgentConfig;
        use crate::protocol::wire::SelectionParams;
        use crate::protocol::{CoordMsg, Shard};
        use std::time::Duration;
        let ms = Duration::from_millis(1);
        let mut host = LiveHost::new("h1", nic(), vec![[1; 16]]);
        host.facilities = links();
        let mut problem = host.problem().0;
        let cfg = AgentConfig {
            heartbeat_interval: 100 * ms,
            coordinator_timeout: 1000 * ms,
            backoff_min: 10 * ms,
            backoff_max: 100 * ms,
        };
        let mut core = AgentCore::new(&problem, HostState::new(&problem, 0, Vec::new()), cfg);
        core.set_live("h1");
        core.on_connected(Duration::ZERO, &problem);
        let welcome = CoordMsg::Welcome {
            epoch: 1,
            iteration: 0,
            heartbeat_ms: 100,
            shard: Shard::WHOLE,
        };
        core.on_message(ms, &problem, welcome);
        let asks = |out: &[AgentAction]| {
            out.iter()
                .any(|a| matches!(a, AgentAction::Send(AgentMsg::Reselect { .. })))
        };
        // A writer into h2 (facility 1) arrives.
        host.apps = vec![LiveApp {
            name: "w".into(),
            peers: vec![([2; 16], 1.0)],
            own: 0.0,
        }];
        assert!(asks(&host.rebuild(&mut core, &mut problem).actions));
        let select = |exchange: u32, prices: Vec<(u32, f64)>| CoordMsg::Select {
            exchange,
            round: exchange - 1,
            prices,
            options: SelectionParams {
                swap_prob: 1.0,
                hysteresis: 0.0,
                fairness: 0.0,
                discount: 0.5,
                seed: 1,
            },
        };
        let proposal = |out: &[AgentAction]| {
            out.iter().find_map(|a| match a {
                AgentAction::Send(AgentMsg::Proposal(p)) => Some(p.clone()),
                _ => None,
            })
        };
        // Exchange 1 comes before the coordinator priced the link: an empty answer, and the
        // host asks again.
        let out = core.on_message(2 * ms, &problem, select(1, Vec::new()));
        assert_eq!(proposal(&out).expect("an answer").activate, None);
        let out = core.on_message(
            3 * ms,
            &problem,
            CoordMsg::Verdict {
                exchange: 1,
                activate: false,
            },
        );
        assert!(asks(&out), "settled with the arrival parked: {out:?}");
        // Exchange 2 has the price: the writer takes the free slot, and the host is settled.
        let out = core.on_message(4 * ms, &problem, select(2, vec![(1, 0.0)]));
        assert!(proposal(&out).expect("an answer").activate.is_some());
        let out = core.on_message(
            5 * ms,
            &problem,
            CoordMsg::Verdict {
                exchange: 2,
                activate: true,
            },
        );
        assert_eq!(core.state().active, [0]);
        assert!(!asks(&out), "{out:?}");
    }

    /// Three live hosts (h2 the busy receiver: three writers on h0 and h1 send into it, an idle
    /// app on h1, a server on h2 answering both) with their problems and agents' cores.
    fn three_live_hosts() -> (
        Vec<LiveHost>,
        Vec<Problem>,
        Vec<crate::protocol::agent::AgentCore>,
    ) {
        use crate::admm::HostState;
        use crate::protocol::agent::{AgentConfig, AgentCore};
        let ms = std::time::Duration::from_millis(1);
        let gid = |h: u8| [h + 1; 16];
        let app = |name: &str, peers: &[(u8, f64)]| LiveApp {
            name: name.into(),
            peers: peers.iter().map(|&(h, n)| (gid(h), n)).collect(),
            own: 0.0,
        };
        let apps = [
            vec![app("w1", &[(2, 2.0)]), app("w2", &[(2, 1.0), (1, 1.0)])],
            vec![app("w3", &[(2, 1.0)]), app("idle", &[])],
            vec![app("srv", &[(0, 3.0), (1, 1.0)])],
        ];
        let hosts: Vec<LiveHost> = (0..3u8)
            .map(|h| {
                let mut l = LiveHost::new(&format!("h{h}"), nic(), vec![gid(h)]);
                l.apps = apps[h as usize].clone();
                l
            })
            .collect();
        let problems: Vec<Problem> = hosts.iter().map(|h| h.problem().0).collect();
        let acfg = AgentConfig {
            heartbeat_interval: 100 * ms,
            coordinator_timeout: 1000 * ms,
            backoff_min: 10 * ms,
            backoff_max: 100 * ms,
        };
        let agents = problems
            .iter()
            .zip(&hosts)
            .map(|(p, h)| {
                let mut a = AgentCore::new(p, HostState::new(p, 0, Vec::new()), acfg.clone());
                a.set_live(&h.host);
                a
            })
            .collect();
        (hosts, problems, agents)
    }

    /// `solve`'s options the live cluster is compared with: tight, the swap rounds only (the
    /// control plane runs them, not the verified search; docs/model.md).
    fn tight_solve_options() -> crate::solver::SolveOptions {
        crate::solver::SolveOptions {
            eps_primal: 1e-12,
            eps_dual: 1e-12,
            max_iter: 20_000,
            certificate_iters: 0,
            polish_trials: 0,
            ..Default::default()
        }
    }

    /// Host `i`'s agent actions as its driver handles them: the policy and the table rebuild
    /// the host (whose own actions are handled in turn); the messages to send are returned.
    fn drive_live(
        i: usize,
        mut acts: Vec<AgentAction>,
        hosts: &mut [LiveHost],
        agents: &mut [crate::protocol::agent::AgentCore],
        problems: &mut [Problem],
    ) -> Vec<crate::protocol::AgentMsg> {
        let mut sends = Vec::new();
        while let Some(act) = (!acts.is_empty()).then(|| acts.remove(0)) {
            match act {
                AgentAction::Send(m) => sends.push(m),
                AgentAction::Policy(p) => {
                    hosts[i].policy = p;
                    acts.extend(hosts[i].rebuild(&mut agents[i], &mut problems[i]).actions);
                }
                AgentAction::Facilities(f) => {
                    hosts[i].facilities = f;
                    acts.extend(hosts[i].rebuild(&mut agents[i], &mut problems[i]).actions);
                }
                _ => {}
            }
        }
        sends
    }

    /// The live cluster against `solve` on its snapshot: the same active sets, rates within
    /// 1e-6, host by host.
    fn assert_snapshot_solves_to(
        snapshot: &Problem,
        agents: &[crate::protocol::agent::AgentCore],
        opts: &crate::solver::SolveOptions,
    ) {
        let solution = crate::solver::solve(snapshot, opts);
        assert!(solution.converged);
        for (h, agent) in agents.iter().enumerate() {
            let live = agent.state();
            let off = &solution.hosts[h];
            assert_eq!(snapshot.hosts[h].id, format!("h{h}"));
            let first = snapshot.hosts[h].pairs.start;
            let offline: Vec<usize> = off.active.iter().map(|p| p - first).collect();
            assert_eq!(live.active, offline, "host h{h}");
            for (x, y) in live.x.iter().zip(&off.x) {
                assert!((x - y).abs() <= 1e-6, "host h{h}: live {x} vs solve {y}");
            }
        }
    }

    /// Three live agents and a live coordinator, back to back in memory: the hosts join with
    /// nothing but their NICs and apps, learn the facility table, report their rows, and the
    /// cluster converges; `solve` on the snapshot reaches the same allocation.
    #[test]
    fn a_live_cluster_converges_to_the_allocation_solve_gives_on_its_snapshot() {
        use crate::protocol::coordinator::{
            Action, Coordinator, CoordinatorConfig, MemberId, SelectionSchedule,
        };
        use crate::protocol::{CoordMsg, Shard};
        use std::time::Duration;
        let ms = Duration::from_millis(1);
        let (mut hosts, mut problems, mut agents) = three_live_hosts();
        let opts = tight_solve_options();
        let coordinator = |max_iterations| {
            Coordinator::new_live(
                CoordinatorConfig {
                    rho: 10.0,
                    facility_digest: 0,
                    heartbeat_interval: 100 * ms,
                    member_timeout: 1000 * ms,
                    round_deadline: 50 * ms,
                    max_staleness: 0,
                    round_interval: Duration::ZERO,
                    min_members: 3,
                    max_iterations: Some(max_iterations),
                    selection: SelectionSchedule::from_solve(&opts),
                    shard: Shard::WHOLE,
                },
                LivePolicy::default(),
            )
        };
        let mut coord = coordinator(3000);
        let now = Duration::ZERO;
        let run = |coord: &mut Coordinator,
                   agents: &mut Vec<AgentCore>,
                   hosts: &mut Vec<LiveHost>,
                   problems: &mut Vec<Problem>,
                   mut inbox: Vec<(MemberId, CoordMsg)>| {
            let sends = |out: Vec<Action>| -> Vec<(MemberId, CoordMsg)> {
                out.into_iter()
                    .filter_map(|a| match a {
                        Action::Send(id, m) => Some((id, m)),
                        _ => None,
                    })
                    .collect()
            };
            while !inbox.is_empty() {
                for (id, msg) in std::mem::take(&mut inbox) {
                    let i = id as usize;
                    let acts = agents[i].on_message(now, &problems[i], msg);
                    for m in drive_live(i, acts, hosts, agents, problems) {
                        inbox.extend(sends(coord.on_message(now, id, m)));
                    }
                }
            }
        };
        // The agents connect in `order`; what the coordinator answers their joins.
        let connect = |coord: &mut Coordinator,
                       agents: &mut Vec<AgentCore>,
                       problems: &[Problem],
                       order: &[usize]| {
            let mut inbox = Vec::new();
            for &i in order {
                for act in agents[i].on_connected(now, &problems[i]) {
                    if let AgentAction::Send(m) = act {
                        inbox.extend(
                            coord
                                .on_message(now, i as MemberId, m)
                                .into_iter()
                                .filter_map(|a| match a {
                                    Action::Send(id, m) => Some((id, m)),
                                    _ => None,
                                }),
                        );
                    }
                }
            }
            inbox
        };
        let inbox = connect(&mut coord, &mut agents, &problems, &[0, 1, 2]);
        run(&mut coord, &mut agents, &mut hosts, &mut problems, inbox);
        assert_eq!(coord.iteration(), 3000);
        let status = coord.status();
        let ids: Vec<&str> = status.facilities.iter().map(|f| f.id.as_str()).collect();
        assert_eq!(ids, ["rx:h0", "rx:h1", "rx:h2"]);
        let rx2 = &status.facilities[2];
        assert!(
            rx2.usage > 0.999 && rx2.price > 0.0,
            "the busy link binds: {rx2:?}"
        );
        let active: Vec<usize> = agents.iter().map(|a| a.state().active.len()).collect();
        assert_eq!(active, [2, 2, 1], "every app active (k = 4)");
        let snapshot = coord
            .snapshot()
            .expect("live")
            .into_problem()
            .expect("valid");
        assert_eq!(snapshot.pairs.len(), 5);
        assert_snapshot_solves_to(&snapshot, &agents, &opts);

        // The coordinator restarts; the hosts come back in the reverse order, so the new
        // table numbers the links differently. Their `Update`s carry the terms they last
        // stepped with, by link id: after one round the busy link's price is where it was.
        let price = |c: &Coordinator, id: &str| {
            let s = c.status();
            s.facilities.iter().find(|f| f.id == id).expect(id).price
        };
        let before = price(&coord, "rx:h2");
        let mut coord = coordinator(1);
        for h in &mut hosts {
            // The new coordinator's table replaces the old before the agent rebuilds (its
            // driver handles `Welcome`, `Policy` and `Facilities` as one batch).
            h.facilities.clear();
        }
        let inbox = connect(&mut coord, &mut agents, &problems, &[2, 1, 0]);
        run(&mut coord, &mut agents, &mut hosts, &mut problems, inbox);
        let ids: Vec<String> = coord
            .status()
            .facilities
            .into_iter()
            .map(|f| f.id)
            .collect();
        assert_eq!(ids, ["rx:h2", "rx:h1", "rx:h0"]);
        let after = price(&coord, "rx:h2");
        assert!(
            (after / before - 1.0).abs() < 0.05,
            "the busy link's price {before} before the restart, {after} after one round"
        );
    }

    /// The live problem through a relay: h0 and h1 behind one relay, h2 connected directly.
    /// The relay passes the coordinator's policy and table down and each agent's report up
    /// named, so every host gets its own link, and the cluster reaches the allocation `solve`
    /// gives on the snapshot, as the direct wiring does (the test above).
    #[test]
    fn a_live_cluster_behind_a_relay_converges_to_the_allocation_solve_gives() {
        use crate::protocol::coordinator::{
            Action, Coordinator, CoordinatorConfig, MemberId, SelectionSchedule,
        };
        use crate::protocol::relay::{Relay, RelayAction, RelayConfig};
        use crate::protocol::{AgentMsg, CoordMsg, Shard};
        use std::time::Duration;
        let ms = Duration::from_millis(1);
        let (mut hosts, mut problems, mut agents) = three_live_hosts();
        let opts = tight_solve_options();
        let mut coord = Coordinator::new_live(
            CoordinatorConfig {
                rho: 10.0,
                facility_digest: 0,
                heartbeat_interval: 100 * ms,
                member_timeout: 1000 * ms,
                round_deadline: 50 * ms,
                max_staleness: 0,
                round_interval: Duration::ZERO,
                min_members: 2,
                max_iterations: Some(3000),
                selection: SelectionSchedule::from_solve(&opts),
                shard: Shard::WHOLE,
            },
            LivePolicy::default(),
        );
        let mut relay = Relay::new(RelayConfig {
            host: "rack".into(),
            facility_digest: 0,
            facilities: 0,
            live: true,
            heartbeat_interval: 100 * ms,
            member_timeout: 1000 * ms,
            upstream_timeout: 1000 * ms,
            round_deadline: 40 * ms,
            max_staleness: 0,
            min_agents: 2,
            backoff_min: 10 * ms,
            backoff_max: 100 * ms,
        });
        // Coordinator members: 0 is the relay (hosts 0 and 1), 2 is h2.
        enum Msg {
            Coord(MemberId, AgentMsg),
            Relay(MemberId, AgentMsg),
            Agent(usize, CoordMsg),
        }
        let now = Duration::ZERO;
        let mut inbox: Vec<Msg> = Vec::new();
        assert!(relay.on_upstream_connected(now).is_empty());
        let from_agent = |h: usize, m: AgentMsg| {
            if h == 2 {
                Msg::Coord(2, m)
            } else {
                Msg::Relay(h as MemberId, m)
            }
        };
        for h in [1, 2, 0] {
            for act in agents[h].on_connected(now, &problems[h]) {
                if let AgentAction::Send(m) = act {
                    inbox.push(from_agent(h, m));
                }
            }
        }
        while !inbox.is_empty() {
            for msg in std::mem::take(&mut inbox) {
                match msg {
                    Msg::Coord(id, m) => {
                        for a in coord.on_message(now, id, m) {
                            match a {
                                Action::Send(0, m) => {
                                    for r in relay.on_upstream(now, m) {
                                        match r {
                                            RelayAction::Up(m) => inbox.push(Msg::Coord(0, m)),
                                            RelayAction::Down(h, m) => {
                                                inbox.push(Msg::Agent(h as usize, m))
                                            }
                                            RelayAction::Event(_) => {}
                                            r => panic!("{r:?}"),
                                        }
                                    }
                                }
                                Action::Send(to, m) => inbox.push(Msg::Agent(to as usize, m)),
                                _ => {}
                            }
                        }
                    }
                    Msg::Relay(h, m) => {
                        for r in relay.on_agent(now, h, m) {
                            match r {
                                RelayAction::Up(m) => inbox.push(Msg::Coord(0, m)),
                                RelayAction::Down(h, m) => inbox.push(Msg::Agent(h as usize, m)),
                                RelayAction::Event(_) => {}
                                r => panic!("{r:?}"),
                            }
                        }
                    }
                    Msg::Agent(i, m) => {
                        let acts = agents[i].on_message(now, &problems[i], m);
                        for m in drive_live(i, acts, &mut hosts, &mut agents, &mut problems) {
                            inbox.push(from_agent(i, m));
                        }
                    }
                }
            }
        }
        assert_eq!(coord.iteration(), 3000);
        let status = coord.status();
        let mut ids: Vec<&str> = status.facilities.iter().map(|f| f.id.as_str()).collect();
        ids.sort_unstable();
        assert_eq!(
            ids,
            ["rx:h0", "rx:h1", "rx:h2"],
            "a link per host, not per relay"
        );
        let members: Vec<(&str, Vec<&str>)> = status
            .members
            .iter()
            .map(|m| {
                (
                    m.host.as_str(),
                    m.rack.iter().map(|r| r.host.as_str()).collect(),
                )
            })
            .collect();
        assert_eq!(members, [("rack", vec!["h0", "h1"]), ("h2", vec![])]);
        let active: Vec<usize> = agents.iter().map(|a| a.state().active.len()).collect();
        assert_eq!(active, [2, 2, 1], "every app active (k = 4)");
        let snapshot = coord
            .snapshot()
            .expect("live")
            .into_problem()
            .expect("valid");
        assert_eq!(snapshot.pairs.len(), 5);
        assert_snapshot_solves_to(&snapshot, &agents, &opts);
        // An agent leaving the relay takes its report with it.
        for r in relay.on_agent_gone(now, 1, false) {
            if let RelayAction::Up(m) = r {
                coord.on_message(now, 0, m);
            }
        }
        assert_eq!(coord.status().members[0].rack.len(), 1);
        // A relay reporting a host that is a member of its own keeps nothing of it: refused,
        // logged, and the relay stays.
        let out = coord.on_message(
            now,
            0,
            AgentMsg::RackHost(crate::protocol::wire::RackHostMsg {
                host: "h2".into(),
                report: match hosts[2].report(&agents[2], &problems[2]) {
                    AgentMsg::Host(r) => Some(r),
                    m => panic!("{m:?}"),
                },
            }),
        );
        assert!(
            out.iter().any(|a| matches!(a, Action::Event(_)))
                && !out.iter().any(|a| matches!(a, Action::Close(..))),
            "{out:?}"
        );
        assert_eq!(coord.status().members[0].rack.len(), 1);
    }
}
