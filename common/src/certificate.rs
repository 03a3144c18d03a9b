//! The certificate of a selection: an upper bound of the optimum by weak duality (the
//! Lagrangian relaxation of the facilities' capacities and the hosts' budgets), tightened by
//! subgradient steps on prices and multipliers together and then by coordinate descent: each
//! facility's price, then each host's multipliers, to their least bound with the rest fixed
//! (docs/model.md). Any prices and multipliers give a valid bound, so this only ever
//! improves the gap a solve reports.

use crate::admm::HostState;
use crate::facility_prices::least_prices;
use crate::model::Problem;
use crate::pruning::Pruning;
use crate::selection::{relax_host, Relaxed};
use rayon::prelude::*;

/// The facilities' share of the weak-duality bound at the given prices.
pub(crate) fn facility_bound(problem: &Problem, prices: &[f64]) -> f64 {
    problem
        .facilities
        .iter()
        .zip(prices)
        .map(|(f, &p)| f.conjugate(p))
        .sum()
}

/// Steps without a better bound after which the subgradient's `θ` halves. With 3 it halved
/// too soon: measured on generated instances (seed 1) with 300 steps, 10 took the certified
/// gap from 4.04 % to 3.73 % at 100 × 500 and from 5.88 % to 5.32 % at 1000 × 5000; 30 did
/// no better than 10 at 300 steps (docs/benchmarks.md, "Certified gap at 1000 × 5000").
const STALE_STEPS: usize = 10;

/// Tightens the weak-duality bound by projected subgradient steps on the Lagrangian relaxation,
/// moving facility prices and host multipliers together from the given ones. The step is
/// Polyak's, `θ·(UB − LB)/‖g‖²` with the feasible value `lower_bound` as the target, so it needs
/// no scale; `θ` halves after [`STALE_STEPS`] steps without improvement; then at most
/// `sweeps` sweeps of [`coordinate_descent`] from the best point. Any prices and multipliers
/// give a valid bound, so this only ever improves the certificate. Returns the least bound
/// seen.
pub fn refine_bound(
    problem: &Problem,
    hosts: &[HostState],
    prices: &[f64],
    lower_bound: f64,
    (iterations, sweeps): (usize, usize),
    pruning: Pruning,
) -> f64 {
    let mut prices = prices.to_vec();
    let mut mult: Vec<(f64, f64)> = hosts
        .iter()
        .map(|h| (h.multipliers.mu, h.multipliers.nu))
        .collect();
    let (mut best, mut theta, mut stale) = (f64::INFINITY, 2.0, 0);
    let mut best_point = (prices.clone(), mult.clone());
    for _ in 0..iterations {
        let relaxed = relax_hosts(problem, hosts, &prices, &mult, pruning);
        let mut usage = vec![0.0; problem.facilities.len()];
        for r in &relaxed {
            for &(f, v) in &r.usage {
                usage[f as usize] += v;
            }
        }
        let facility_part = facility_bound(problem, &prices);
        let bound = facility_part + relaxed.iter().map(|r| r.bound).sum::<f64>();
        if bound < best {
            best = bound;
            best_point = (prices.clone(), mult.clone());
            stale = 0;
        } else {
            stale += 1;
            if stale >= STALE_STEPS {
                theta *= 0.5;
                stale = 0;
            }
        }
        // Subgradient (the direction that raises the bound's violated constraints' prices),
        // with components that would push a zero price or multiplier negative dropped.
        let projected = |value: f64, g: f64| if value <= 0.0 && g < 0.0 { 0.0 } else { g };
        let g_fac: Vec<f64> = problem
            .facilities
            .iter()
            .zip(&usage)
            .zip(&prices)
            .map(|((spec, u), &p)| projected(p, u - spec.capacity))
            .collect();
        let g_host: Vec<(f64, f64)> = hosts
            .iter()
            .zip(&relaxed)
            .zip(&mult)
            .map(|((h, r), &(mu, nu))| {
                let host = &problem.hosts[h.host];
                (
                    projected(mu, r.wqe - host.wqe_budget),
                    projected(nu, r.poll - host.poll_budget),
                )
            })
            .collect();
        let norm2: f64 = g_fac.iter().map(|g| g * g).sum::<f64>()
            + g_host.iter().map(|(a, b)| a * a + b * b).sum::<f64>();
        if norm2 <= 0.0 || bound <= lower_bound {
            break;
        }
        let t = theta * (bound - lower_bound) / norm2;
        for (p, g) in prices.iter_mut().zip(&g_fac) {
            *p = (*p + t * g).max(0.0);
        }
        for (m, g) in mult.iter_mut().zip(&g_host) {
            m.0 = (m.0 + t * g.0).max(0.0);
            m.1 = (m.1 + t * g.1).max(0.0);
        }
    }
    if iterations == 0 {
        return best;
    }
    coordinate_descent(problem, hosts, best_point, (best, sweeps), pruning)
}

/// A sweep that lowers the bound by less than this fraction of it ends the descent.
const SWEEP_GAIN: f64 = 1e-5;

/// From the subgradient's best point (`best` its bound), at most `sweeps` sweeps of block
/// coordinate descent: every facility's price to its least bound with the rest fixed (all at
/// once, then halved back toward the old prices until the bound is lower), then each host's
/// multipliers to their least bound at those prices; repeated while a sweep gains. Every point
/// evaluated is a valid bound, so the least is returned. With the defaults it took the
/// certified gap of 100 × 500 from 4.69 % to 3.72 % (docs/benchmarks.md).
fn coordinate_descent(
    problem: &Problem,
    hosts: &[HostState],
    (mut prices, mut mult): (Vec<f64>, Vec<(f64, f64)>),
    (mut best, sweeps): (f64, usize),
    pruning: Pruning,
) -> f64 {
    let ids: Vec<usize> = hosts.iter().map(|h| h.host).collect();
    for _ in 0..sweeps {
        let before = best;
        let target = least_prices(problem, &ids, &prices, &mult, pruning.at(&prices));
        for step in [1.0, 0.5, 0.25, 0.125] {
            let moved: Vec<f64> = (prices.iter().zip(&target))
                .map(|(&p, &t)| p + step * (t - p))
                .collect();
            let bound = bound_at(problem, hosts, &moved, &mult, pruning);
            if bound < best {
                (best, prices) = (bound, moved);
                break;
            }
        }
        let at = pruning.at(&prices);
        let least: Vec<(f64, (f64, f64))> = hosts
            .par_iter()
            .zip(&mult)
            .map(|(h, &m)| least_host_bound(problem, h.host, &prices, m, at))
            .collect();
        // Each host's least point is never above its start, so the sum is at most `best`.
        best = best.min(facility_bound(problem, &prices) + least.iter().map(|l| l.0).sum::<f64>());
        mult = least.into_iter().map(|l| l.1).collect();
        if before - best <= SWEEP_GAIN * best.abs() {
            break;
        }
    }
    best
}

/// The weak-duality bound at `prices` and the hosts' multipliers `mult`.
fn bound_at(
    problem: &Problem,
    hosts: &[HostState],
    prices: &[f64],
    mult: &[(f64, f64)],
    pruning: Pruning,
) -> f64 {
    let hosts_part: f64 = relax_hosts(problem, hosts, prices, mult, pruning)
        .iter()
        .map(|r| r.bound)
        .sum();
    facility_bound(problem, prices) + hosts_part
}

/// Every host's relaxed problem at `prices` and its `(μ, ν)` in `mult`, hosts in parallel.
fn relax_hosts(
    problem: &Problem,
    hosts: &[HostState],
    prices: &[f64],
    mult: &[(f64, f64)],
    pruning: Pruning,
) -> Vec<Relaxed> {
    let at = pruning.at(prices);
    hosts
        .par_iter()
        .zip(mult)
        .map(|(h, &(mu, nu))| relax_host(problem, h.host, |f| prices[f as usize], mu, nu, at))
        .collect()
}

/// Bisection steps per multiplier in [`least_host_bound`].
const MULTIPLIER_BISECTIONS: usize = 16;

/// The least share of the bound of host `host` over its multipliers `(μ, ν) ≥ 0` at fixed
/// prices, starting from `start`. At fixed prices the host's share `TopK⁺ L(μ, ν) + μQ + νC` is
/// convex in `(μ, ν)` and separate from every other host's, with slopes `Q − Σx` and
/// `C − Σa·x` of its relaxed choice, so each multiplier is bisected on its slope's sign, one
/// after the other, twice. The subgradient steps move every price and multiplier by one
/// step length, which suits neither the hosts' few multipliers nor the many prices at once.
/// Every point evaluated gives a valid bound, so the least of them is returned.
fn least_host_bound(
    problem: &Problem,
    host: usize,
    prices: &[f64],
    start: (f64, f64),
    pruning: Pruning,
) -> (f64, (f64, f64)) {
    let h = &problem.hosts[host];
    let relax =
        |mu: f64, nu: f64| relax_host(problem, host, |f| prices[f as usize], mu, nu, pruning);
    let (mut mu, mut nu) = start;
    let mut least = (relax(mu, nu).bound, start);
    for _ in 0..2 {
        for which in [0, 1] {
            // Slope of the host's share along this multiplier at `v`, and the bound there.
            let mut at = |v: f64| {
                let r = if which == 0 {
                    relax(v, nu)
                } else {
                    relax(mu, v)
                };
                if r.bound < least.0 {
                    least = (r.bound, if which == 0 { (v, nu) } else { (mu, v) });
                }
                if which == 0 {
                    h.wqe_budget - r.wqe
                } else {
                    h.poll_budget - r.poll
                }
            };
            let current = if which == 0 { mu } else { nu };
            let v = if at(0.0) >= 0.0 {
                0.0
            } else {
                // The relaxed choice uses less as the multiplier grows (pairs' rates fall, then
                // they leave the top k), so the slope turns non-negative somewhere above.
                let (mut lo, mut hi) = (0.0, current.max(1e-3));
                let mut doublings = 0;
                while at(hi) < 0.0 && doublings < 40 {
                    lo = hi;
                    hi *= 2.0;
                    doublings += 1;
                }
                for _ in 0..MULTIPLIER_BISECTIONS {
                    let mid = 0.5 * (lo + hi);
                    if at(mid) < 0.0 {
                        lo = mid;
                    } else {
                        hi = mid;
                    }
                }
                hi
            };
            if which == 0 {
                mu = v;
            } else {
                nu = v;
            }
        }
    }
    least
}
