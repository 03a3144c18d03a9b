//! Sharing ADMM (Feng/Xu/Li Alg. 3.4, Boyd et al. §7.3) for fixed active sets, split into the
//! host's step and the coordinator's step as pure functions, so the agent and the coordinator
//! can run them across the network and the in-process solver can run them in a loop.
//!
//! Each active (host, app) pair is one agent of the sharing problem; a facility's `n` is its
//! number of active pairs. `u_f` is the scaled dual in units of the facility's sum, so the
//! facility price is `π_f = ρ_f·u_f/n_f` (docs/design.md §3). Every facility has its own penalty
//! `ρ_f`; the live coordinator balances it against the facility's residuals
//! ([`RhoBalance`], docs/model.md), the offline solver keeps every `ρ_f` at one `ρ`.

use crate::host_step::{solve_host, AppTerm, Multipliers};
use crate::model::{Facility, Problem};
use serde::{Deserialize, Serialize};

/// A host's part of the ADMM state: its active pairs and their current rates.
#[derive(Clone, Debug, PartialEq)]
pub struct HostState {
    pub host: usize,
    /// Global pair indices of the active apps, ascending.
    pub active: Vec<usize>,
    /// Current rate of each active pair (same order as `active`).
    pub x: Vec<f64>,
    pub multipliers: Multipliers,
}

/// What a host reports after a step: `Σ b·x` per facility it uses (sparse, facility ascending).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Contribution {
    pub entries: Vec<(u32, f64)>,
}

impl HostState {
    /// A host with the given active pairs, all starting at the floor rate.
    pub fn new(problem: &Problem, host: usize, mut active: Vec<usize>) -> Self {
        active.sort_unstable();
        let x = vec![problem.params.x_min; active.len()];
        Self {
            host,
            active,
            x,
            multipliers: Multipliers::default(),
        }
    }

    pub fn contribution(&self, problem: &Problem) -> Contribution {
        let mut entries: Vec<(u32, f64)> = self
            .active
            .iter()
            .zip(&self.x)
            .flat_map(|(&p, &x)| problem.pairs[p].uses.iter().map(move |&(f, b)| (f, b * x)))
            .collect();
        entries.sort_unstable_by_key(|e| e.0);
        entries.dedup_by(|later, first| {
            if later.0 == first.0 {
                first.1 += later.1;
                true
            } else {
                false
            }
        });
        Contribution { entries }
    }

    /// Solves the host's problem for terms built per active pair by `term`.
    fn solve(&mut self, problem: &Problem, term: impl Fn(usize, f64) -> AppTerm) -> Contribution {
        let terms: Vec<AppTerm> = self
            .active
            .iter()
            .zip(&self.x)
            .map(|(&p, &x)| term(p, x))
            .collect();
        let host = &problem.hosts[self.host];
        self.multipliers = solve_host(
            &terms,
            host.wqe_budget,
            host.poll_budget,
            &mut self.x,
            self.multipliers,
        );
        self.contribution(problem)
    }

    /// ADMM x-step: `term(f)` is the coordinator's `d_f = (u_f + s_f − y_f)/n_f` and `ρ_f` for
    /// facility `f`. A pair of several facilities has one penalty
    /// `(ρ_f/2)(b_f x − b_f x_old + d_f)²` per facility; their sum is the single quadratic
    /// `(q/2)(x − x_old + Σρ_f b_f d_f/q)²` plus a constant, with `q = Σρ_f b_f²`.
    pub fn admm_step(
        &mut self,
        problem: &Problem,
        term: impl Fn(u32) -> FacilityTerm,
    ) -> Contribution {
        self.solve(problem, |p, x_old| {
            let pair = &problem.pairs[p];
            let (mut q, mut pull) = (0.0, 0.0);
            for &(f, b) in &pair.uses {
                let t = term(f);
                q += t.rho * b * b;
                pull += t.rho * b * t.d;
            }
            let t = if q == 0.0 { x_old } else { x_old - pull / q };
            AppTerm {
                u: problem.utility(pair),
                lin: 0.0,
                q,
                t,
                hi: pair.demand,
            }
        })
    }

    /// Dual-decomposition step: each app pays `price(f)·b` per unit of rate.
    pub fn priced_step(&mut self, problem: &Problem, price: impl Fn(u32) -> f64) -> Contribution {
        self.solve(problem, |p, _| {
            let pair = &problem.pairs[p];
            AppTerm {
                u: problem.utility(pair),
                lin: pair.charge(&price),
                q: 0.0,
                t: 0.0,
                hi: pair.demand,
            }
        })
    }
}

/// Adds contributions into dense per-facility sums.
pub fn accumulate<'a>(sums: &mut [f64], contributions: impl IntoIterator<Item = &'a Contribution>) {
    for c in contributions {
        for &(f, v) in &c.entries {
            sums[f as usize] += v;
        }
    }
}

/// What a host's x-step needs of one facility: `d_f = (u_f + s_f − y_f)/n_f` and the
/// facility's penalty `ρ_f`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct FacilityTerm {
    pub facility: u32,
    pub d: f64,
    pub rho: f64,
}

impl FacilityTerm {
    /// The facility's price the term implies at convergence (`s_f = y_f`): `ρ_f·d_f`.
    pub fn price(&self) -> f64 {
        self.rho * self.d
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct FacilityState {
    /// The facility's allowed usage `y_f`, the coordinator's copy of the sum.
    pub y: f64,
    /// Scaled dual, in units of the facility's sum.
    pub u: f64,
    /// Latest sum of host contributions `s_f`.
    pub s: f64,
    /// Active pairs using the facility.
    pub n: u32,
    /// The facility's penalty `ρ_f`.
    pub rho: f64,
    /// Whether this state's dual was ever stepped with members or restored: a restarted
    /// coordinator restores only the facilities it has not priced itself.
    pub priced: bool,
}

/// Residuals after a coordinator step.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Residuals {
    /// `‖s − y‖ / (1 + ‖y‖)`.
    pub primal: f64,
    /// `‖Δπ‖ / (1 + ‖π‖)`.
    pub dual: f64,
}

/// Residual balancing of each facility's penalty (Boyd et al. §3.4.1, per facility): after an
/// update, `ρ_f` grows by `factor` when the facility's primal residual `|s_f − y_f|` exceeds
/// `ratio` times its dual residual, and shrinks by `factor` in the opposite case, within
/// `[min, max]`. The dual residual is `ρ_f·‖Δz_f‖` over the members' copies
/// `z_i = b x_i − (s_f − y_f)/n_f`: it sees the members trading rate under a pinned `y_f` as
/// well as `y_f` moving ([`CoordinatorState::update`]). A fixed `ρ` sized for contended facilities makes an uncontended pair
/// crawl (its x-step is then a proximal step of length `U'(x)/ρ`): a lone app took seconds to
/// reach its demand (docs/model.md).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RhoBalance {
    pub ratio: f64,
    pub factor: f64,
    pub min: f64,
    pub max: f64,
}

impl RhoBalance {
    /// The usual constants (ratio 10, factor 2) within four decades below and two above `rho`.
    pub fn around(rho: f64) -> Self {
        Self {
            ratio: 10.0,
            factor: 2.0,
            min: rho * 1e-4,
            max: rho * 1e2,
        }
    }

    /// The penalty after a step with these residuals; residuals below `floor` are noise.
    fn next(&self, rho: f64, primal: f64, dual: f64) -> f64 {
        const FLOOR: f64 = 1e-9;
        let next = if primal > FLOOR && primal > self.ratio * dual {
            rho * self.factor
        } else if dual > FLOOR && dual > self.ratio * primal {
            rho / self.factor
        } else {
            rho
        };
        next.clamp(self.min, self.max)
    }
}

/// The coordinator's ADMM state over all facilities.
#[derive(Clone, Debug, PartialEq)]
pub struct CoordinatorState {
    /// The penalty every facility starts from.
    pub rho: f64,
    pub facilities: Vec<FacilityState>,
    /// Whether, and how, the facilities' penalties adapt; `None` keeps them at `rho`.
    pub balance: Option<RhoBalance>,
}

impl CoordinatorState {
    pub fn new(rho: f64, facilities: usize) -> Self {
        Self {
            rho,
            facilities: vec![
                FacilityState {
                    rho,
                    ..FacilityState::default()
                };
                facilities
            ],
            balance: None,
        }
    }

    /// The same, with each facility's penalty balanced against its residuals.
    pub fn balanced(rho: f64, facilities: usize, balance: RhoBalance) -> Self {
        Self {
            balance: Some(balance),
            ..Self::new(rho, facilities)
        }
    }

    /// `π_f = ρ_f·u_f/n_f`.
    pub fn price(&self, f: u32) -> f64 {
        let st = &self.facilities[f as usize];
        if st.n == 0 {
            0.0
        } else {
            st.rho * st.u / st.n as f64
        }
    }

    /// What a host's x-step needs of facility `f`.
    pub fn term(&self, f: u32) -> FacilityTerm {
        FacilityTerm {
            facility: f,
            d: self.d(f),
            rho: self.facilities[f as usize].rho,
        }
    }

    /// A new facility (the live problem learns them as hosts join), at the initial penalty.
    pub fn push_facility(&mut self) {
        self.facilities.push(FacilityState {
            rho: self.rho,
            ..FacilityState::default()
        });
    }

    /// Sets facility `f`'s penalty and price, e.g. from the hosts' last terms after a
    /// coordinator restart (`n_f` must be set first).
    pub fn restore(&mut self, f: u32, rho: f64, price: f64) {
        let st = &mut self.facilities[f as usize];
        st.rho = rho;
        st.priced = true;
        st.u = if st.n == 0 {
            0.0
        } else {
            price * st.n as f64 / rho
        };
    }

    /// What the hosts using facility `f` need for their next step.
    pub fn d(&self, f: u32) -> f64 {
        let st = &self.facilities[f as usize];
        if st.n == 0 {
            0.0
        } else {
            (st.u + st.s - st.y) / st.n as f64
        }
    }

    /// Changes the active-pair counts (after a selection round) keeping every price.
    pub fn set_counts(&mut self, counts: &[u32]) {
        for (f, &n) in counts.iter().enumerate() {
            let price = self.price(f as u32);
            let st = &mut self.facilities[f];
            st.n = n;
            st.u = if n == 0 {
                0.0
            } else {
                price * n as f64 / st.rho
            };
        }
    }

    /// Replaces the sums without an update, e.g. after the active sets changed.
    pub fn set_sums(&mut self, sums: &[f64]) {
        for (st, &s) in self.facilities.iter_mut().zip(sums) {
            st.s = s;
        }
    }

    /// The z- and u-updates for new facility sums `s`; afterwards `d` serves the next x-step.
    /// With balancing, `spread[f]` is `Σ_i (Δ(b x_i))²` over the facility's members since the
    /// last update (a host of `c` pairs moving its sum by `Δ` counts `Δ²/c`); without it, the
    /// members are taken to have moved alike.
    pub fn update(
        &mut self,
        facilities: &[Facility],
        sums: &[f64],
        spread: Option<&[f64]>,
    ) -> Residuals {
        let (mut r2, mut y2, mut dp2, mut p2) = (0.0, 0.0, 0.0, 0.0);
        let (balance, initial_rho) = (self.balance, self.rho);
        for (f, (spec, &s)) in facilities.iter().zip(sums).enumerate() {
            let before = self.price(f as u32);
            let st = &mut self.facilities[f];
            let s_old = std::mem::replace(&mut st.s, s);
            if st.n == 0 {
                st.y = 0.0;
                st.u = 0.0;
                // An empty facility has no price to keep, and the penalty its last members
                // balanced to is not the next one's: the testbed's 1 MB flow, the only pair
                // on a link left at ρ·1e-4 by the run before, was activated at 8 % of the
                // line and held there 0.45 s; on a fresh link, at the initial ρ, it ran at the
                // whole line from its activation (docs/testbed.md, "tc2-flow alone").
                st.rho = initial_rho;
            } else {
                st.priced = true;
                let y_old = st.y;
                st.y = spec.prox(s + st.u, st.rho / st.n as f64);
                st.u += s - st.y;
                if let Some(b) = balance {
                    let n = st.n as f64;
                    let (ds, dy) = (s - s_old, st.y - y_old);
                    let moved = spread.map_or(ds * ds / n, |v| v[f]);
                    // ‖Δz‖² = Σ_i (Δ(b x_i) − m)² with m = (Δs − Δy)/n.
                    let m = (ds - dy) / n;
                    let dz = (moved - 2.0 * m * ds + m * m * n).max(0.0).sqrt();
                    let rho = b.next(st.rho, (s - st.y).abs(), st.rho * dz);
                    // The scaled dual follows, so the price survives the change.
                    st.u *= st.rho / rho;
                    st.rho = rho;
                }
            }
            let after = self.price(f as u32);
            let st = &self.facilities[f];
            r2 += (st.s - st.y).powi(2);
            y2 += st.y * st.y;
            dp2 += (after - before).powi(2);
            p2 += after * after;
        }
        Residuals {
            primal: r2.sqrt() / (1.0 + y2.sqrt()),
            dual: dp2.sqrt() / (1.0 + p2.sqrt()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn price_survives_a_change_of_membership() {
        let mut c = CoordinatorState::new(2.0, 1);
        c.set_counts(&[4]);
        c.facilities[0].u = 3.0;
        let p = c.price(0);
        c.set_counts(&[6]);
        assert!((c.price(0) - p).abs() < 1e-12);
        c.set_counts(&[0]);
        assert_eq!(c.price(0), 0.0);
    }

    /// Two hosts each with one app of demand 1 sending into one link of capacity `cap`.
    fn two_senders(cap: f64) -> Problem {
        crate::instance::Instance::from_json(&format!(
            r#"{{"alpha": 1.0, "beta": 0.0001, "k": 4, "x_min": 0.005,
            "facilities": [{{"id": "rx", "capacity": {cap}}}],
            "hosts": [
              {{"id": "h1", "wqe_budget": 1.0, "poll_budget": 16.0, "apps": [{{"id": "a",
                "weight": 1.0, "cqe_per_wqe": 1.0, "demand": 1.0, "facility": "rx", "facility_coeff": 1.0}}]}},
              {{"id": "h2", "wqe_budget": 1.0, "poll_budget": 16.0, "apps": [{{"id": "b",
                "weight": 1.0, "cqe_per_wqe": 1.0, "demand": 1.0, "facility": "rx", "facility_coeff": 1.0}}]}}]}}"#
        ))
        .unwrap()
        .into_problem()
        .unwrap()
    }

    /// The in-process loop of the live coordinator: every host steps, the coordinator
    /// updates with the hosts' spread (one pair per host).
    struct Run {
        hosts: Vec<HostState>,
        c: CoordinatorState,
    }

    impl Run {
        fn new(problem: &Problem, mut c: CoordinatorState) -> Self {
            let hosts: Vec<HostState> = (0..problem.hosts.len())
                .map(|h| HostState::new(problem, h, problem.hosts[h].pairs.clone().collect()))
                .collect();
            c.set_counts(&[hosts.len() as u32]);
            Self { hosts, c }
        }

        fn rates(&self) -> Vec<f64> {
            self.hosts.iter().map(|h| h.x[0]).collect()
        }

        /// Iterations until `done(rates)` (`None`: not within `max`).
        fn until(
            &mut self,
            problem: &Problem,
            max: usize,
            done: impl Fn(&[f64]) -> bool,
        ) -> Option<usize> {
            for it in 1..=max {
                let before = self.rates();
                let c = &self.c;
                let contributions: Vec<Contribution> = self
                    .hosts
                    .iter_mut()
                    .map(|h| h.admm_step(problem, |f| c.term(f)))
                    .collect();
                let mut sums = vec![0.0; problem.facilities.len()];
                accumulate(&mut sums, &contributions);
                let spread: f64 = self
                    .rates()
                    .iter()
                    .zip(&before)
                    .map(|(x, b)| (x - b).powi(2))
                    .sum();
                self.c.update(&problem.facilities, &sums, Some(&[spread]));
                if done(&self.rates()) {
                    return Some(it);
                }
            }
            None
        }
    }

    /// Iterations until every rate is within 1 % of `want` (`None`: not within `max`).
    fn iterations_to(
        problem: &Problem,
        c: CoordinatorState,
        want: f64,
        max: usize,
    ) -> Option<usize> {
        Run::new(problem, c).until(problem, max, |x| {
            x.iter().all(|x| (x - want).abs() <= 0.01 * want)
        })
    }

    #[test]
    fn balanced_penalties_follow_a_new_split_of_a_pinned_link() {
        // Both at half of a full link; then one weighs three times the other. The link's
        // usage stays pinned at capacity while the two trade rate, which only the members'
        // spread shows: ρ must come down for the trade to go fast.
        let mut p = two_senders(1.0);
        let rho = 3000.0;
        let mut run = Run::new(
            &p,
            CoordinatorState::balanced(rho, 1, RhoBalance::around(rho)),
        );
        run.until(&p, 500, |x| x.iter().all(|x| (x - 0.5).abs() < 1e-4))
            .expect("equal split");
        p.pairs[0].weight = 3.0;
        let it = run.until(&p, 500, |x| {
            (x[0] - 0.75).abs() < 0.0075 && (x[1] - 0.25).abs() < 0.0025
        });
        assert!(it.is_some_and(|it| it <= 100), "{it:?} iterations");
    }

    #[test]
    fn balanced_penalties_let_uncontended_pairs_reach_their_demand_at_once() {
        // Room for both at their demand: the optimum is x = 1 each, at price 0. With the
        // penalty sized for contention (the live default is about 2,900) a fixed ρ moves each
        // rate by U'(x)/ρ per iteration; balancing drops ρ while the link is idle.
        let p = two_senders(4.0);
        let rho = 3000.0;
        assert_eq!(
            iterations_to(&p, CoordinatorState::new(rho, 1), 1.0, 200),
            None
        );
        let balanced = CoordinatorState::balanced(rho, 1, RhoBalance::around(rho));
        let it = iterations_to(&p, balanced, 1.0, 200).expect("converges");
        assert!(it <= 30, "{it} iterations");
    }

    #[test]
    fn balanced_penalties_still_converge_on_a_contended_facility() {
        // The link carries half of what both want: each gets half of it.
        let p = two_senders(1.0);
        for rho in [0.3, 3.0, 3000.0] {
            let balanced = CoordinatorState::balanced(rho, 1, RhoBalance::around(rho));
            let it = iterations_to(&p, balanced, 0.5, 500);
            assert!(it.is_some_and(|it| it <= 100), "ρ = {rho}: {it:?}");
        }
    }

    #[test]
    fn balancing_keeps_the_price_when_it_changes_the_penalty() {
        let fac = [Facility {
            id: "f".into(),
            capacity: 1.0,
            cost: 0.0,
        }];
        let mut c = CoordinatorState::balanced(8.0, 1, RhoBalance::around(8.0));
        c.set_counts(&[2]);
        c.update(&fac, &[1.5], None);
        let (before, rho_before) = (c.price(0), c.facilities[0].rho);
        c.update(&fac, &[1.5], None);
        let (p, rho) = (c.price(0), c.facilities[0].rho);
        assert!(
            p > before && rho == 2.0 * rho_before,
            "over capacity, y still: ρ grows"
        );
        // Exactly at capacity with the same y: both residuals vanish, nothing changes.
        c.update(&fac, &[1.0], None);
        assert_eq!(c.facilities[0].rho, rho);
        assert!((c.price(0) - p).abs() <= 1e-12 * p);
    }

    #[test]
    fn an_emptied_facility_starts_its_next_members_at_the_initial_penalty() {
        // A lone pair balanced the link's penalty to its floor, then left; the next lone pair
        // meets the penalty a new link has, and reaches its demand as fast as on one.
        let p = two_senders(4.0);
        let rho = 3000.0;
        let fresh = CoordinatorState::balanced(rho, 1, RhoBalance::around(rho));
        let on_fresh = iterations_to(&p, fresh.clone(), 1.0, 200).expect("converges");
        let mut used = fresh;
        used.facilities[0].rho = rho * 1e-4;
        used.set_counts(&[0]);
        used.update(&p.facilities, &[0.0], None);
        assert_eq!(used.facilities[0].rho, rho);
        assert_eq!(iterations_to(&p, used, 1.0, 200), Some(on_fresh));
    }

    #[test]
    fn overloaded_facility_raises_its_price() {
        let fac = [Facility {
            id: "f".into(),
            capacity: 1.0,
            cost: 0.0,
        }];
        let mut c = CoordinatorState::new(1.0, 1);
        c.set_counts(&[2]);
        let r = c.update(&fac, &[3.0], None);
        assert_eq!(c.facilities[0].y, 1.0);
        assert!(c.price(0) > 0.0 && r.primal > 0.0);
        assert!(c.d(0) > 0.0);
    }
}
