//! NUMFabric's xWI price iteration (Nagaraj et al., SIGCOMM 2016, §4.2), the second baseline
//! of `simulate`, on DRUM's model (docs/model.md, "The xWI baseline").
//!
//! Each iteration: every host best-responds to the facility prices as in dual decomposition —
//! those rates are the *weights* (the paper's eq. 7, `w = U'⁻¹(path price)`, with the host's
//! budgets solved exactly as in every other algorithm here); the weighted max-min allocation of
//! those weights ([`crate::max_min`], what the paper's WFQ transport delivers) gives the rates,
//! which are always feasible; then each facility moves its price by the least *normalised
//! residual* of its members (eq. 9), minus a pull towards zero in proportion to its
//! underutilisation (eq. 10), averaged with the old price (eq. 11).

use crate::host_step::Multipliers;
use crate::model::{Facility, Pair, Problem};

/// The paper's underutilisation multiplier `η` (§6, "xWI parameters": 5).
pub const ETA: f64 = 5.0;
/// The paper's averaging parameter `β` (0.5).
pub const AVERAGING: f64 = 0.5;

/// What a host reports in an xWI iteration: its best response at the current prices (the
/// weights of its active pairs, in their order) and the multipliers of its budgets there.
#[derive(Clone, Debug, PartialEq)]
pub struct HostReport {
    pub weights: Vec<f64>,
    pub multipliers: Multipliers,
}

#[derive(Clone, Debug, PartialEq)]
pub struct XwiState {
    pub prices: Vec<f64>,
    pub eta: f64,
    pub averaging: f64,
}

impl XwiState {
    /// Zero prices, the paper's parameters.
    pub fn new(facilities: usize) -> Self {
        Self {
            prices: vec![0.0; facilities],
            eta: ETA,
            averaging: AVERAGING,
        }
    }

    /// Eqs. (9)–(11): `p_res = p + least_f`, `p_new = [p_res − η(1 − s/Y)(p − G'(s))]⁺`,
    /// `p ← βp + (1 − β)p_new`, with `least_f` the least normalised residual of the facility's
    /// members (0 without members, so an unused facility's price decays to its cost's slope).
    /// The paper pulls towards zero; with a cost `G` the price of an unsaturated facility
    /// belongs at `G'(s)` (design.md §3), which is zero for the generated instances.
    /// Returns the relative price change `‖Δp‖/(1 + ‖p‖)`.
    pub fn update(&mut self, facilities: &[Facility], sums: &[f64], least: &[f64]) -> f64 {
        let (mut dp2, mut p2) = (0.0, 0.0);
        for (((price, spec), &s), &res) in
            self.prices.iter_mut().zip(facilities).zip(sums).zip(least)
        {
            let idle = 1.0 - s / spec.capacity;
            let fresh = (*price + res - self.eta * idle * (*price - spec.cost * s)).max(0.0);
            let next = self.averaging * *price + (1.0 - self.averaging) * fresh;
            dp2 += (next - *price).powi(2);
            p2 += next * next;
            *price = next;
        }
        dp2.sqrt() / (1.0 + p2.sqrt())
    }
}

/// The residual of a pair's optimality condition (the paper's eq. 5 with DRUM's host budgets
/// and box): `U'(x) − Σ_f b_f p_f − μ − a·ν`, where at the demand cap only a shortfall and at
/// the floor only an excess violate it; divided by `Σ_f b_f`, so that if each of the pair's
/// facilities adds it to its price the pair's condition holds (a facility's price counts `b_f`
/// times in the pair's). `None` for a pair that uses no facility.
pub fn normalised_residual(
    problem: &Problem,
    pair: &Pair,
    x: f64,
    prices: &[f64],
    host: Multipliers,
) -> Option<f64> {
    let coef: f64 = pair.uses.iter().map(|&(_, b)| b).sum();
    if coef <= 0.0 {
        return None;
    }
    let path = pair.charge(|f| prices[f as usize]) + host.mu + pair.cqe_per_wqe * host.nu;
    let mut residual = problem.utility(pair).d1(x) - path;
    if x >= pair.demand * (1.0 - 1e-12) {
        residual = residual.min(0.0);
    }
    if x <= problem.params.x_min * (1.0 + 1e-12) {
        residual = residual.max(0.0);
    }
    Some(residual / coef)
}

/// Per facility, the least normalised residual of its members at rates `rates[h]` of the active
/// pairs `active[h]`, with the host multipliers of `reports[h]` (0 where it has no member).
pub fn least_residuals(
    problem: &Problem,
    active: &[&[usize]],
    rates: &[&[f64]],
    reports: &[HostReport],
    prices: &[f64],
) -> Vec<f64> {
    let mut least = vec![f64::INFINITY; problem.facilities.len()];
    for ((ids, xs), report) in active.iter().zip(rates).zip(reports) {
        for (&p, &x) in ids.iter().zip(xs.iter()) {
            let pair = &problem.pairs[p];
            if let Some(r) = normalised_residual(problem, pair, x, prices, report.multipliers) {
                for &(f, _) in &pair.uses {
                    least[f as usize] = least[f as usize].min(r);
                }
            }
        }
    }
    for l in &mut least {
        if l.is_infinite() {
            *l = 0.0;
        }
    }
    least
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Host, Params};

    fn one_link(capacity: f64, demand: f64) -> Problem {
        Problem {
            params: Params {
                alpha: 1.0,
                beta: 0.0,
                k: 2,
                x_min: 0.01,
            },
            facilities: vec![Facility {
                id: "f".into(),
                capacity,
                cost: 0.0,
            }],
            app_names: vec!["a".into()],
            hosts: vec![Host {
                id: "h".into(),
                wqe_budget: 10.0,
                poll_budget: 100.0,
                k: None,
                pairs: 0..2,
            }],
            pairs: [1.0, 3.0]
                .iter()
                .map(|&weight| Pair {
                    app: 0,
                    weight,
                    cqe_per_wqe: 1.0,
                    demand,
                    uses: vec![(0, 2.0)],
                })
                .collect(),
        }
    }

    #[test]
    fn the_least_residual_is_normalised_by_the_coefficients() {
        // w = 1 and 3 at x = 0.5 and 0.5: U' = 2 and 6; price 1 with b = 2 costs 2 per unit.
        let p = one_link(2.0, 1.0);
        let report = HostReport {
            weights: vec![0.5, 0.5],
            multipliers: Multipliers::default(),
        };
        let least = least_residuals(
            &p,
            &[&[0, 1]],
            &[&[0.5, 0.5]],
            std::slice::from_ref(&report),
            &[1.0],
        );
        assert_eq!(least, vec![0.0]); // (2 − 2)/2, not (6 − 2)/2
                                      // Host multipliers count in the path price: μ = 1 makes the first residual −1/2.
        let report = HostReport {
            multipliers: Multipliers { mu: 1.0, nu: 0.0 },
            ..report
        };
        let least = least_residuals(&p, &[&[0, 1]], &[&[0.5, 0.5]], &[report], &[1.0]);
        assert_eq!(least, vec![-0.5]);
    }

    #[test]
    fn the_box_forgives_what_it_allows() {
        // At its demand cap a pair may want more (U' > price): no residual. At the floor it may
        // want less: no residual.
        let p = one_link(2.0, 0.5);
        let m = Multipliers::default();
        assert_eq!(
            normalised_residual(&p, &p.pairs[1], 0.5, &[1.0], m),
            Some(0.0)
        );
        assert_eq!(
            normalised_residual(&p, &p.pairs[1], 0.5, &[4.0], m),
            Some((6.0 - 8.0) / 2.0)
        );
        assert_eq!(
            normalised_residual(&p, &p.pairs[0], 0.01, &[100.0], m),
            Some(0.0)
        );
    }

    #[test]
    fn prices_follow_the_papers_update() {
        let fac = [
            Facility {
                id: "busy".into(),
                capacity: 1.0,
                cost: 0.0,
            },
            Facility {
                id: "idle".into(),
                capacity: 1.0,
                cost: 0.0,
            },
        ];
        let mut x = XwiState::new(2);
        x.prices = vec![2.0, 2.0];
        // Saturated: p_new = 2 + 1 = 3, averaged 2.5. Half used: p_new = [2 + 0 − 5·0.5·2]⁺ = 0,
        // averaged 1.
        x.update(&fac, &[1.0, 0.5], &[1.0, 0.0]);
        assert_eq!(x.prices, vec![2.5, 1.0]);
        // A negative residual lowers a saturated facility's price, never below zero.
        x.update(&fac, &[1.0, 0.0], &[-10.0, 0.0]);
        assert_eq!(x.prices, vec![1.25, 0.5]);
    }
}
