//! Each facility's price to the least weak-duality bound with every other price, the hosts'
//! multipliers and the hosts' other pairs fixed: one block of the certificate's coordinate
//! descent (docs/model.md, "Feasible allocations and the certificate").
//!
//! With everything but `π_f` fixed, host `i`'s `TopK⁺` changes with `π_f` only through its
//! pair on `f`, whose surplus `L(c)` falls as its charge `c = rest + π_f·b` grows. With `t` the
//! `k`-th best positive surplus among the host's *other* pairs (0 if it has fewer), the host's
//! share is a constant plus `max(0, L − t)`. So the bound along `π_f` is
//! `G*_f(π_f) + Σ_members max(0, L(rest + π_f·b) − t)`: convex, with slope
//! `y_f(π_f) − Σ_{L > t} b·x`, and minimised by bisecting on the slope's sign. The subgradient
//! moves every price by one step length; a facility carrying a handful of its thousand
//! candidate pairs needs its own.

use crate::model::{Facility, Problem};
use crate::pruning::{Bounds, Pruning};
use crate::selection::{host_thresholds, surplus};
use rayon::prelude::*;

/// Bisection steps on a facility's price (relative precision about 1e-9 of the bracket).
const PRICE_BISECTIONS: usize = 30;

/// One pair's part of its facility's problem.
#[derive(Clone, Copy, Debug)]
struct Member {
    host: usize,
    pair: usize,
    b: f64,
    /// The pair's charge without this facility's part: `Σ_{g≠f} π_g b_g + μ + ν·a`.
    rest: f64,
    /// The `k`-th best positive surplus among the host's other pairs.
    threshold: f64,
    /// The pair's rate with this facility free (its price 0), where every member is above
    /// its threshold.
    x_free: f64,
}

/// Every facility's least-bound price with the others (and `mult`, one `(μ, ν)` per entry of
/// `hosts`) fixed at `prices`. All facilities are solved from the same point, so the
/// caller checks the bound where they land together (their hosts' thresholds move with them).
pub fn least_prices(
    problem: &Problem,
    hosts: &[usize],
    prices: &[f64],
    mult: &[(f64, f64)],
    pruning: Pruning,
) -> Vec<f64> {
    let per_host: Vec<Vec<(u32, Member)>> = hosts
        .par_iter()
        .zip(mult)
        .map(|(&host, &(mu, nu))| members_of_host(problem, host, prices, (mu, nu), pruning))
        .collect();
    let mut by_facility: Vec<Vec<Member>> = vec![Vec::new(); problem.facilities.len()];
    for (f, m) in per_host.into_iter().flatten() {
        by_facility[f as usize].push(m);
    }
    by_facility
        .par_iter()
        .zip(&problem.facilities)
        .zip(prices)
        .map(|((members, facility), &price)| least_price(problem, facility, members, price))
        .collect()
}

/// Host `host`'s pairs that could raise the bound along one of their facilities' prices: those
/// whose surplus with that facility free exceeds their threshold (the rest add nothing at any
/// price of it, since a surplus only falls as the price grows).
fn members_of_host(
    problem: &Problem,
    host: usize,
    prices: &[f64],
    (mu, nu): (f64, f64),
    pruning: Pruning,
) -> Vec<(u32, Member)> {
    let price = |f: u32| prices[f as usize];
    let thresholds = host_thresholds(problem, host, price, mu, nu, pruning);
    let bounds = Bounds::new(problem, host);
    let mut out = Vec::new();
    for p in problem.hosts[host].pairs.clone() {
        let pair = &problem.pairs[p];
        let charge = pair.charge(price) + mu + nu * pair.cqe_per_wqe;
        let threshold = thresholds.excluding(p);
        for &(f, b) in &pair.uses {
            let rest = charge - price(f) * b;
            if bounds.bound(p, rest) <= threshold {
                continue;
            }
            let (l_free, x_free) = surplus(problem, host, p, rest);
            if l_free <= threshold {
                continue;
            }
            let member = Member {
                host,
                pair: p,
                b,
                rest,
                threshold,
                x_free,
            };
            out.push((f, member));
        }
    }
    out
}

/// The price of `facility` that minimises `G*(π) + Σ max(0, L(rest + π·b) − t)` over `π ≥ 0`;
/// `current` sets the bracket's first guess.
fn least_price(problem: &Problem, facility: &Facility, members: &[Member], current: f64) -> f64 {
    // The slope at `pi`, and the members still above their threshold there: a surplus only
    // falls as the price grows, so once the bracket's low end passes a member's exit it
    // stays out, and the bisection reads fewer members at every step.
    let slope = |pi: f64, members: &[Member]| {
        let mut used = 0.0;
        let mut above = Vec::with_capacity(members.len());
        for m in members {
            let (l, x) = surplus(problem, m.host, m.pair, m.rest + pi * m.b);
            if l > m.threshold {
                used += m.b * x;
                above.push(*m);
            }
        }
        (conjugate_slope(facility, pi) - used, above)
    };
    // At price 0 every member is above its threshold, at the rate `members_of_host` found.
    let used_free: f64 = members.iter().map(|m| m.b * m.x_free).sum();
    if conjugate_slope(facility, 0.0) - used_free >= 0.0 {
        return 0.0;
    }
    let mut live = members.to_vec();
    let (mut lo, mut hi) = (0.0, current.max(1e-6));
    // The members' use falls to 0 at a finite price, where the slope is the facility's
    // y ≥ 0; doublings to reach it from 1e-6 are bounded by the float range.
    loop {
        let (s, above) = slope(hi, &live);
        if s >= 0.0 || hi >= f64::MAX / 4.0 {
            break;
        }
        (lo, hi, live) = (hi, 2.0 * hi, above);
    }
    for _ in 0..PRICE_BISECTIONS {
        let mid = 0.5 * (lo + hi);
        let (s, above) = slope(mid, &live);
        if s < 0.0 {
            (lo, live) = (mid, above);
        } else {
            hi = mid;
        }
    }
    hi
}

/// The right derivative of `G*(π) = sup_{0≤y≤Y} π·y − G(y)`: the maximising `y`.
fn conjugate_slope(facility: &Facility, price: f64) -> f64 {
    if facility.cost > 0.0 {
        (price.max(0.0) / facility.cost).min(facility.capacity)
    } else {
        facility.capacity
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::generator::{generate, GeneratorConfig};
    use crate::rng::SplitMix64;
    use crate::selection::relax_host;

    /// The whole weak-duality bound, computed the way the certificate does.
    fn bound(p: &Problem, prices: &[f64], mult: &[(f64, f64)]) -> f64 {
        let facilities: f64 = (p.facilities.iter().zip(prices))
            .map(|(f, &pi)| f.conjugate(pi))
            .sum();
        let hosts: f64 = (0..p.hosts.len())
            .map(|h| {
                let (mu, nu) = mult[h];
                relax_host(p, h, |f| prices[f as usize], mu, nu, Pruning::Off).bound
            })
            .sum();
        facilities + hosts
    }

    /// Along each facility's price, with everything else fixed, the price found gives the
    /// least bound a fine grid finds (the whole bound recomputed from scratch, so the
    /// thresholds' reasoning is checked, not repeated), on instances with several
    /// facilities per pair, a facility with a cost, and no slot on one host.
    #[test]
    fn each_price_is_the_least_bound_along_its_axis() {
        for (seed, pruning) in [(1, Pruning::Off), (2, Pruning::Pairs), (3, Pruning::Pairs)] {
            let mut p = generate(&GeneratorConfig {
                k: 2,
                seed,
                ..GeneratorConfig::new(5, 6)
            });
            let mut rng = SplitMix64::new(seed);
            for (j, pair) in p.pairs.iter_mut().enumerate() {
                if j % 3 == 0 {
                    let other = (pair.uses[0].0 + 1) % 6;
                    pair.uses.push((other, rng.range(0.5, 1.5)));
                    pair.uses.sort_by_key(|u| u.0);
                }
            }
            p.facilities[2].cost = 3.0;
            p.hosts[4].k = Some(0);
            let prices: Vec<f64> = (0..6).map(|_| rng.range(0.0, 3.0)).collect();
            let mult: Vec<(f64, f64)> = (0..5)
                .map(|_| (rng.range(0.0, 1.0), rng.range(0.0, 0.3)))
                .collect();
            let hosts: Vec<usize> = (0..5).collect();
            let least = least_prices(&p, &hosts, &prices, &mult, pruning);
            for f in 0..6 {
                let along = |v: f64| {
                    let mut at = prices.clone();
                    at[f] = v;
                    bound(&p, &at, &mult)
                };
                let found = along(least[f]);
                let top = 4.0 * (least[f] + prices[f] + 1.0);
                let grid = (0..=4000).map(|i| along(top * i as f64 / 4000.0));
                let best = grid.fold(f64::INFINITY, f64::min);
                assert!(
                    found <= best + 1e-9 * best.abs(),
                    "seed {seed} facility {f}: {found} at {} above {best}",
                    least[f]
                );
            }
        }
    }
}
