//! Sharing ADMM (Feng/Xu/Li Alg. 3.4, Boyd et al. §7.3) for fixed active sets, split into the
//! host's step and the coordinator's step as pure functions, so the agent and the coordinator
//! can run them across the network and the in-process solver can run them in a loop.
//!
//! Each active (host, app) pair is one agent of the sharing problem; a facility's `n` is its
//! number of active pairs. `u_f` is the scaled dual in units of the facility's sum, so the
//! facility price is `π_f = ρ·u_f/n_f` (DESIGN.md §3).

use crate::host_step::{solve_host, AppTerm, Multipliers};
use crate::model::{Facility, Problem};

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

    /// ADMM x-step: `d(f)` is the coordinator's `(u_f + s_f − y_f)/n_f` for facility `f`. A pair
    /// of several facilities has one penalty `(ρ/2)(b_f x − b_f x_old + d_f)²` per facility; their
    /// sum is the single quadratic `(ρΣb²/2)(x − x_old + Σb_f d_f/Σb²)²` plus a constant.
    pub fn admm_step(
        &mut self,
        problem: &Problem,
        rho: f64,
        d: impl Fn(u32) -> f64,
    ) -> Contribution {
        self.solve(problem, |p, x_old| {
            let pair = &problem.pairs[p];
            let b2 = pair.coeff_norm2();
            let t = if b2 == 0.0 {
                x_old
            } else {
                x_old - pair.charge(&d) / b2
            };
            AppTerm {
                u: problem.utility(pair),
                lin: 0.0,
                q: rho * b2,
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
}

/// Residuals after a coordinator step.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Residuals {
    /// `‖s − y‖ / (1 + ‖y‖)`.
    pub primal: f64,
    /// `‖Δπ‖ / (1 + ‖π‖)`.
    pub dual: f64,
}

/// The coordinator's ADMM state over all facilities.
#[derive(Clone, Debug, PartialEq)]
pub struct CoordinatorState {
    pub rho: f64,
    pub facilities: Vec<FacilityState>,
}

impl CoordinatorState {
    pub fn new(rho: f64, facilities: usize) -> Self {
        Self {
            rho,
            facilities: vec![FacilityState::default(); facilities],
        }
    }

    /// `π_f = ρ·u_f/n_f`.
    pub fn price(&self, f: u32) -> f64 {
        let st = &self.facilities[f as usize];
        if st.n == 0 {
            0.0
        } else {
            self.rho * st.u / st.n as f64
        }
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
                price * n as f64 / self.rho
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
    pub fn update(&mut self, facilities: &[Facility], sums: &[f64]) -> Residuals {
        let (mut r2, mut y2, mut dp2, mut p2) = (0.0, 0.0, 0.0, 0.0);
        for (f, (spec, &s)) in facilities.iter().zip(sums).enumerate() {
            let before = self.price(f as u32);
            let rho = self.rho;
            let st = &mut self.facilities[f];
            st.s = s;
            if st.n == 0 {
                st.y = 0.0;
                st.u = 0.0;
            } else {
                let kappa = rho / st.n as f64;
                st.y = spec.prox(s + st.u, kappa);
                st.u += s - st.y;
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

    #[test]
    fn overloaded_facility_raises_its_price() {
        let fac = [Facility {
            id: "f".into(),
            capacity: 1.0,
            cost: 0.0,
        }];
        let mut c = CoordinatorState::new(1.0, 1);
        c.set_counts(&[2]);
        let r = c.update(&fac, &[3.0]);
        assert_eq!(c.facilities[0].y, 1.0);
        assert!(c.price(0) > 0.0 && r.primal > 0.0);
        assert!(c.d(0) > 0.0);
    }
}
