//! Weighted max-min rates: what NUMFabric's Swift transport (weighted fair queueing in the
//! switches, window control at the hosts) delivers for given flow weights, reduced to the rate
//! allocation itself — the xWI baseline needs the rates, not the packets (docs/model.md,
//! "The xWI baseline").
//!
//! Every active pair starts at the floor `x_min` (what selection guarantees it) and grows above
//! it in proportion to its weight's excess over the floor, `x = x_min + θ·(w − x_min)`, all
//! growing pairs with one common `θ`, until a constraint it is in saturates: a facility
//! (`Σ b·x ≤ Y`), its host's WQE or polling budget (`Σ x ≤ Q`, `Σ a·x ≤ C`) or its own demand
//! cap (`x ≤ x̄`). Then it stops and the others keep growing (progressive filling). While a
//! constraint's growing members stay the same its load is affine in `θ`, so the next saturation
//! is an event in a priority queue, and one allocation costs `O(E log E)` in the number `E` of
//! (pair, constraint) incidences.

use crate::model::Problem;
use std::cmp::{Ordering, Reverse};
use std::collections::BinaryHeap;

/// A shared constraint while the pairs fill: `fixed + θ·slope ≤ capacity`, where `fixed` holds
/// the floors and the stopped members' rates and `slope` the growing members' `coef·(w − x_min)`.
struct Constraint {
    capacity: f64,
    fixed: f64,
    slope: f64,
    growing: u32,
    /// Bumped whenever `fixed` or `slope` change, so older queue entries are recognised as stale.
    version: u32,
}

impl Constraint {
    /// The `θ` at which the constraint saturates, not before `now`; `None` if nothing grows.
    fn saturation(&self, now: f64) -> Option<f64> {
        (self.growing > 0 && self.slope > 0.0)
            .then(|| ((self.capacity - self.fixed) / self.slope).max(now))
    }
}

#[derive(Clone, Copy, PartialEq)]
enum Event {
    /// A constraint saturates (index, version).
    Saturates(u32, u32),
    /// A pair reaches its demand cap (flat pair index).
    Capped(u32),
}

#[derive(PartialEq)]
struct Queued(f64, Event);

impl Eq for Queued {}

impl PartialOrd for Queued {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Queued {
    fn cmp(&self, other: &Self) -> Ordering {
        self.0.total_cmp(&other.0)
    }
}

/// The weighted max-min rates of the active pairs `active[h]` of each host `h` for weights
/// `weights[h]` (same order; clamped into `[x_min, x̄]`). Feasible whenever the floors are, which
/// selection guarantees.
pub fn weighted_max_min(
    problem: &Problem,
    active: &[&[usize]],
    weights: &[&[f64]],
) -> Vec<Vec<f64>> {
    let x_min = problem.params.x_min;
    let facilities = problem.facilities.len();
    // Constraints: facilities first, then each host's WQE and polling budget.
    let mut constraints: Vec<Constraint> = problem
        .facilities
        .iter()
        .map(|f| f.capacity)
        .chain(
            problem
                .hosts
                .iter()
                .flat_map(|h| [h.wqe_budget, h.poll_budget]),
        )
        .map(|capacity| Constraint {
            capacity,
            fixed: 0.0,
            slope: 0.0,
            growing: 0,
            version: 0,
        })
        .collect();
    // Flat pairs: (global pair, its host, its growth `w − x_min`).
    let mut flat: Vec<(usize, usize, f64)> = Vec::new();
    for (h, (ids, w)) in active.iter().zip(weights).enumerate() {
        assert_eq!(ids.len(), w.len(), "one weight per active pair");
        for (&p, &wp) in ids.iter().zip(w.iter()) {
            let g = (wp.min(problem.pairs[p].demand) - x_min).max(0.0);
            flat.push((p, h, g));
        }
    }
    let incidences = |j: usize| {
        let (p, h, _) = flat[j];
        let pair = &problem.pairs[p];
        let budgets = facilities + 2 * h;
        pair.uses
            .iter()
            .map(|&(f, b)| (f as usize, b))
            .chain([(budgets, 1.0), (budgets + 1, pair.cqe_per_wqe)])
    };
    let mut members: Vec<Vec<u32>> = vec![Vec::new(); constraints.len()];
    for (j, &(_, _, g)) in flat.iter().enumerate() {
        for (c, coef) in incidences(j) {
            let con = &mut constraints[c];
            con.fixed += coef * x_min;
            if g > 0.0 {
                con.slope += coef * g;
                con.growing += 1;
                members[c].push(j as u32);
            }
        }
    }

    let mut queue = BinaryHeap::new();
    for (c, con) in constraints.iter().enumerate() {
        if let Some(theta) = con.saturation(0.0) {
            queue.push(Reverse(Queued(theta, Event::Saturates(c as u32, 0))));
        }
    }
    let mut rate: Vec<f64> = vec![x_min; flat.len()];
    let mut stopped: Vec<bool> = flat.iter().map(|&(_, _, g)| g <= 0.0).collect();
    for (j, &(p, _, g)) in flat.iter().enumerate() {
        if g > 0.0 {
            let theta = (problem.pairs[p].demand - x_min) / g;
            queue.push(Reverse(Queued(theta, Event::Capped(j as u32))));
        }
    }

    let mut now = 0.0f64;
    let mut to_stop: Vec<u32> = Vec::new();
    let mut touched: Vec<usize> = Vec::new();
    while let Some(Reverse(Queued(theta, event))) = queue.pop() {
        now = now.max(theta);
        to_stop.clear();
        match event {
            Event::Capped(j) => {
                if !stopped[j as usize] {
                    to_stop.push(j);
                }
            }
            Event::Saturates(c, version) => {
                if constraints[c as usize].version != version {
                    continue;
                }
                to_stop.extend(
                    members[c as usize]
                        .iter()
                        .filter(|&&j| !stopped[j as usize]),
                );
            }
        }
        touched.clear();
        for &j in &to_stop {
            let j = j as usize;
            let (p, _, g) = flat[j];
            stopped[j] = true;
            rate[j] = (x_min + now * g).min(problem.pairs[p].demand);
            for (c, coef) in incidences(j) {
                let con = &mut constraints[c];
                con.fixed += coef * now * g;
                con.slope -= coef * g;
                con.growing -= 1;
                con.version += 1;
                touched.push(c);
            }
        }
        touched.sort_unstable();
        touched.dedup();
        for &c in &touched {
            let con = &constraints[c];
            if let Some(theta) = con.saturation(now) {
                queue.push(Reverse(Queued(
                    theta,
                    Event::Saturates(c as u32, con.version),
                )));
            }
        }
    }

    let mut out: Vec<Vec<f64>> = active.iter().map(|a| Vec::with_capacity(a.len())).collect();
    for (&(_, h, _), &x) in flat.iter().zip(&rate) {
        out[h].push(x);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Facility, Host, Pair, Params};

    /// Two hosts with budgets `q` (WQE) and 100 (polling); `pairs[h]` lists `(facility, b, x̄)`.
    fn problem(capacities: &[f64], q: f64, pairs: &[&[(u32, f64, f64)]]) -> Problem {
        let mut all = Vec::new();
        let mut hosts = Vec::new();
        for (h, ps) in pairs.iter().enumerate() {
            let start = all.len();
            for &(f, b, demand) in ps.iter() {
                all.push(Pair {
                    app: 0,
                    weight: 1.0,
                    cqe_per_wqe: 1.0,
                    demand,
                    uses: vec![(f, b)],
                });
            }
            hosts.push(Host {
                id: format!("h{h}"),
                wqe_budget: q,
                poll_budget: 100.0,
                k: None,
                pairs: start..all.len(),
            });
        }
        Problem {
            params: Params {
                alpha: 1.0,
                beta: 0.0,
                k: 4,
                x_min: 0.0,
            },
            facilities: capacities
                .iter()
                .enumerate()
                .map(|(i, &capacity)| Facility {
                    id: format!("f{i}"),
                    capacity,
                    cost: 0.0,
                })
                .collect(),
            app_names: vec!["a".into()],
            hosts,
            pairs: all,
        }
    }

    fn close(a: &[Vec<f64>], b: &[&[f64]]) {
        for (x, y) in a.iter().zip(b) {
            for (u, v) in x.iter().zip(y.iter()) {
                assert!((u - v).abs() < 1e-12, "{a:?} != {b:?}");
            }
        }
    }

    #[test]
    fn one_link_is_shared_in_proportion_to_the_weights() {
        // Weights 1 and 3 on a link of 2: rates 0.5 and 1.5, whatever the weights' scale.
        let p = problem(&[2.0], 10.0, &[&[(0, 1.0, 10.0)], &[(0, 1.0, 10.0)]]);
        let r = weighted_max_min(&p, &[&[0], &[1]], &[&[0.1], &[0.3]]);
        close(&r, &[&[0.5], &[1.5]]);
    }

    #[test]
    fn capacity_a_pair_cannot_use_goes_to_the_others() {
        // Link 0 (capacity 1) carries pair A (host 0) and pair B (host 1), B stopped by its
        // host's WQE budget of 0.2: A takes the rest of the link (0.8) although both weigh the
        // same.
        let mut p = problem(&[1.0], 10.0, &[&[(0, 1.0, 10.0)], &[(0, 1.0, 10.0)]]);
        p.hosts[1].wqe_budget = 0.2;
        let r = weighted_max_min(&p, &[&[0], &[1]], &[&[0.5], &[0.5]]);
        close(&r, &[&[0.8], &[0.2]]);
        // A demand cap stops a pair the same way.
        let p = problem(&[1.0], 10.0, &[&[(0, 1.0, 10.0)], &[(0, 1.0, 0.3)]]);
        let r = weighted_max_min(&p, &[&[0], &[1]], &[&[0.3], &[0.3]]);
        close(&r, &[&[0.7], &[0.3]]);
        // A host budget stops its pairs like a link does: host 0 (budget 0.3) has pairs on two
        // links of capacity 1 shared with host 1's pairs.
        let p = problem(
            &[1.0, 1.0],
            0.3,
            &[&[(0, 1.0, 10.0), (1, 1.0, 10.0)], &[(0, 1.0, 10.0)]],
        );
        let p = Problem {
            hosts: vec![
                p.hosts[0].clone(),
                Host {
                    wqe_budget: 10.0,
                    ..p.hosts[1].clone()
                },
            ],
            ..p
        };
        let r = weighted_max_min(&p, &[&[0, 1], &[2]], &[&[1.0, 1.0], &[1.0]]);
        close(&r, &[&[0.15, 0.15], &[0.85]]);
    }

    #[test]
    fn coefficients_and_floors_count() {
        // b = 2 for pair A: it uses twice the link per unit of rate; floors 0.1 each are given
        // first, the 1 − 3·0.1 = 0.7 left is shared as θ·(w − x_min) with θ = 0.7/(2·0.2 + 0.3).
        let mut p = problem(&[1.0], 10.0, &[&[(0, 2.0, 10.0)], &[(0, 1.0, 10.0)]]);
        p.params.x_min = 0.1;
        let r = weighted_max_min(&p, &[&[0], &[1]], &[&[0.3], &[0.4]]);
        let theta = 0.7 / (2.0 * 0.2 + 0.3);
        close(&r, &[&[0.1 + 0.2 * theta], &[0.1 + 0.3 * theta]]);
        let used = 2.0 * r[0][0] + r[1][0];
        assert!((used - 1.0).abs() < 1e-12);
        // A weight at the floor stays there.
        let r = weighted_max_min(&p, &[&[0], &[1]], &[&[0.1], &[0.4]]);
        close(&r, &[&[0.1], &[0.8]]);
    }
}
