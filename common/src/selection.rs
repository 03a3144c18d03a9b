//! Top-k selection, the slow outer step of docs/design.md §3, and the weak-duality certificate.
//!
//! At current facility prices `π` and host multipliers `μ`, `ν` each pair has a surplus
//! `L = max_x V(x) − (π·b + μ + ν·a)·x` (V: activation value, see `utility`). A host swaps at most
//! its worst member for its best outsider per round, only when the outsider's ranking key beats
//! the member's by a hysteresis margin, and only with probability `p`: undamped re-selection
//! moves every host onto the same apps at once. Ranking keys discount a pair's surplus by its
//! recent activity (SDRF-style commitment), so among near-equal apps the long-parked one wins.

use crate::host_step::AppTerm;
use crate::model::Problem;
use crate::pruning::{Bounds, Exact, Pruning, Scan, TableAt, NOT_OFFERED};
use crate::rng::SplitMix64;

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SelectionOptions {
    /// Probability that a host performs a swap it finds worthwhile.
    pub swap_prob: f64,
    /// Relative margin an outsider's key must beat a member's by.
    pub hysteresis: f64,
    /// How strongly recent activity discounts a pair's key (0: pure optimisation).
    pub fairness: f64,
    /// Discount per round of the activity memory.
    pub discount: f64,
    pub seed: u64,
    /// Compute exact surpluses only for pairs whose closed-form bound can matter
    /// (`pruning`); `false` computes every pair's, with the same result.
    pub prune: bool,
}

impl Default for SelectionOptions {
    fn default() -> Self {
        Self {
            swap_prob: 0.5,
            hysteresis: 0.01,
            fairness: 0.02,
            discount: 0.9,
            seed: 1,
            prune: true,
        }
    }
}

/// Surplus and maximiser of one pair of host `host` at a per-unit charge `c = π·b + μ + ν·a`.
///
/// The rate is capped by everything a single pair can use on its own — its demand, its
/// facility's capacity, its host's budgets — since every feasible allocation respects those
/// caps; keeping them in the relaxation tightens the bound and stops a host from valuing an idle
/// facility at more than it could ever carry.
pub fn surplus(problem: &Problem, host: usize, pair: usize, charge: f64) -> (f64, f64) {
    let term = AppTerm {
        u: problem.utility(&problem.pairs[pair]),
        lin: charge,
        q: 0.0,
        t: 0.0,
        hi: pair_cap(problem, host, pair),
    };
    let x = term.best_response(0.0, 0.0);
    (term.u.activation_value(x) - charge * x, x)
}

/// The largest rate pair `pair` could use alone on host `host`: its demand, its facilities'
/// capacities and the host's budgets (at least `x_min`).
pub(crate) fn pair_cap(problem: &Problem, host: usize, pair: usize) -> f64 {
    let p = &problem.pairs[pair];
    let h = &problem.hosts[host];
    p.demand
        .min(p.alone_cap(&problem.facilities))
        .min(h.wqe_budget)
        .min(h.poll_budget / p.cqe_per_wqe)
        .max(problem.params.x_min)
}

/// A pair's ranking key: its surplus discounted by its recent activity (SDRF-style), so among
/// near-equal pairs the long-parked one ranks first.
fn ranking_key(opts: &SelectionOptions, activity: f32, l: f64) -> f64 {
    l * (1.0 - opts.fairness * activity as f64 * l.signum())
}

/// Whether [`key_below_surplus`] holds for every one of `activity` (a loop that vectorises;
/// a host's pairs are many).
fn keys_below_surplus(opts: &SelectionOptions, activity: &[f32]) -> bool {
    (activity.iter()).fold(true, |all, &a| all & key_below_surplus(opts, a))
}

/// Whether a pair's ranking key grows with its surplus and is at most the surplus, which
/// pruning relies on: `0 ≤ fairness·activity < 1` (always, with the defaults, since activity
/// is a discounted share in `[0, 1]`). A pair for which it fails is always computed.
fn key_below_surplus(opts: &SelectionOptions, activity: f32) -> bool {
    (0.0..1.0).contains(&(opts.fairness * activity as f64))
}

/// Scans the pairs of `host` for which `offered` holds for the `by_value` best surpluses (with
/// `others` as competitors) and the `by_key` best keys ([`Scan`]), at a per-unit charge
/// `charge(pair)` (from `price` and `(μ, ν)`); with pruning each pair for which `prunable`
/// holds is offered with its closed-form bound (`all_prunable`: whether it holds for every
/// pair of the host, which lets a table's scan stop early).
#[allow(clippy::too_many_arguments)]
fn scan<'a, K: Fn(usize, f64) -> f64>(
    problem: &'a Problem,
    host: usize,
    (charge, price, multipliers): (
        impl Fn(usize) -> f64 + Copy + 'a,
        impl Fn(u32) -> f64,
        (f64, f64),
    ),
    (pruning, prunable, all_prunable): (Pruning, impl Fn(usize) -> bool, bool),
    offered: impl Fn(usize) -> bool,
    key: K,
    (by_value, others): (usize, &[f64]),
    by_key: usize,
) -> Scan<impl Fn(usize) -> (f64, f64) + 'a, K> {
    let mut s = Scan::new(
        move |p| surplus(problem, host, p, charge(p)),
        key,
        by_value,
        others,
        by_key,
    );
    if let Pruning::Table(t) = pruning {
        let priced = (price, t.lowest_price, &t.band_drop);
        t.table.scan_host(
            problem,
            host,
            &mut s,
            priced,
            multipliers,
            offered,
            all_prunable,
        );
        return s;
    }
    let range = problem.hosts[host].pairs.clone();
    let bounds = Bounds::new(problem, host);
    let mut bound_of = |p: usize| match pruning {
        _ if !offered(p) => NOT_OFFERED,
        Pruning::Pairs if prunable(p) => bounds.bound(p, charge(p)),
        _ => f64::INFINITY,
    };
    let mut all: Vec<f64> = range.clone().map(&mut bound_of).collect();
    s.run(range.start, &mut all);
    s
}

/// What one host's evaluation at current prices yields.
#[derive(Clone, Debug, PartialEq)]
pub struct HostEvaluation {
    /// The host's share of the weak-duality upper bound: `TopK⁺ L + μQ + νC`.
    pub bound: f64,
    /// Proposed swap: (member to park or none, outsider to activate with its starting rate or none).
    pub swap: Option<Swap>,
    /// A free slot would have been filled but the coin said no: the host is not settled.
    pub declined_fill: bool,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Swap {
    pub park: Option<usize>,
    pub activate: Option<(usize, f64)>,
}

/// Evaluates host `host` whose active pairs are `active` (ascending global indices), at
/// facility prices `price`, multipliers `mu`, `nu`, with `activity` the per-pair memory.
#[allow(clippy::too_many_arguments)]
pub fn evaluate_host(
    problem: &Problem,
    host: usize,
    active: &[usize],
    price: impl Fn(u32) -> f64,
    mu: f64,
    nu: f64,
    activity: &[f32],
    opts: &SelectionOptions,
    table: Option<TableAt>,
    rng: &mut SplitMix64,
) -> HostEvaluation {
    evaluate_present(
        problem,
        host,
        active,
        price,
        mu,
        nu,
        activity,
        |_| true,
        opts,
        table,
        rng,
    )
}

/// [`evaluate_host`] when only some of the host's apps are running (`present(pair)`; the
/// agent learns it from its shims). An absent pair is never proposed for activation and does
/// not count in the bound. An absent member is parked first, without the coin: the coin damps
/// hosts that all react to the same prices, while an app that left is a local fact and its
/// slot is simply wasted; the best present outsider may take the slot in the same swap.
#[allow(clippy::too_many_arguments)]
pub fn evaluate_present(
    problem: &Problem,
    host: usize,
    active: &[usize],
    price: impl Fn(u32) -> f64,
    mu: f64,
    nu: f64,
    activity: &[f32],
    present: impl Fn(usize) -> bool,
    opts: &SelectionOptions,
    table: Option<TableAt>,
    rng: &mut SplitMix64,
) -> HostEvaluation {
    let h = &problem.hosts[host];
    let slots = problem.slots(host);
    let pruning = Pruning::new(opts.prune, table);
    let charge = |p: usize| {
        let pair = &problem.pairs[p];
        pair.charge(&price) + mu + nu * pair.cqe_per_wqe
    };
    let key = |p: usize, l: f64| ranking_key(opts, activity[p], l);
    // Members are few and all needed; outsiders are computed as the queries below need them.
    let mut members: Vec<Exact> = Vec::with_capacity(active.len());
    let mut gone: Option<usize> = None;
    for &p in active {
        if present(p) {
            let (l, x) = surplus(problem, host, p, charge(p));
            members.push(Exact { pair: p, l, x });
        } else if gone.is_none() {
            gone = Some(p);
        }
    }
    let offered = |p: usize| active.binary_search(&p).is_err() && present(p);
    let prunable = |p: usize| key_below_surplus(opts, activity[p]);
    let all_prunable = matches!(pruning, Pruning::Table(_))
        && keys_below_surplus(opts, &activity[problem.hosts[host].pairs.clone()]);
    let member_values: Vec<f64> = members.iter().map(|m| m.l).collect();
    let outsiders = scan(
        problem,
        host,
        (charge, &price, (mu, nu)),
        (pruning, prunable, all_prunable),
        offered,
        key,
        (slots, &member_values),
        1,
    );
    let best_outsider = outsiders
        .best(1, key)
        .first()
        .map(|e| (key(e.pair, e.l), e.pair, e.x));
    // The first member with the lowest key, as members come in pair order.
    let worst_member = members.iter().fold(None, |worst: Option<(f64, usize)>, m| {
        let k = key(m.pair, m.l);
        match worst {
            Some((wk, _)) if wk <= k => worst,
            _ => Some((k, m.pair)),
        }
    });
    let mut values: Vec<f64> = member_values;
    values.extend(outsiders.known.iter().map(|e| e.l));
    let bound = top_k_positive_sum(&mut values, slots) + mu * h.wqe_budget + nu * h.poll_budget;
    if let Some(out) = gone {
        let swap = Swap {
            park: Some(out),
            activate: best_outsider
                .filter(|o| o.0 > 0.0 && active.len() <= slots)
                .map(|(_, p, x)| (p, x)),
        };
        return HostEvaluation {
            bound,
            swap: Some(swap),
            declined_fill: false,
        };
    }

    let swap = if active.len() < slots {
        best_outsider.filter(|o| o.0 > 0.0).map(|(_, p, x)| Swap {
            park: None,
            activate: Some((p, x)),
        })
    } else {
        match (worst_member, best_outsider) {
            // A member worth less than nothing is parked only when an outsider waits for a
            // slot: alone on its host (the slots are min(k, apps)) it loses nothing to anyone
            // by staying, while parked it would wait for an exchange that, once the schedule
            // is over, only a change of inputs brings (a lone writer parked after a second
            // exchange stayed parked for good).
            (Some((wk, _)), Some(_)) if wk < 0.0 => Some(Swap {
                park: worst_member.map(|w| w.1),
                activate: None,
            }),
            (Some((wk, w)), Some((ok, o, x)))
                if ok > wk + opts.hysteresis * wk.abs().max(f64::MIN_POSITIVE) =>
            {
                Some(Swap {
                    park: Some(w),
                    activate: Some((o, x)),
                })
            }
            _ => None,
        }
    };
    let fill = active.len() < slots && swap.is_some();
    let swap = swap.filter(|_| rng.unit() < opts.swap_prob);
    HostEvaluation {
        bound,
        declined_fill: fill && swap.is_none(),
        swap,
    }
}

/// One host's proposal to the verified local search (`solver::polish`): park a member,
/// activate an outsider (at `x`, its best response at current prices), or both. `estimate` is
/// the first-order gain the surpluses predict; the coordinator re-solves before it believes it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Move {
    pub host: usize,
    pub swap: Swap,
    pub estimate: f64,
}

/// Host `host`'s `limit` most promising moves at the given prices and multipliers: every
/// exchange of a member for an outsider, every activation into a free slot and every plain
/// park, ranked by predicted gain — surplus gained minus surplus lost, each discounted by
/// recent activity as the swap rounds' keys are (so among near-equal moves the one that
/// activates a long-parked app is tried first). Unlike [`evaluate_host`] there is no coin and
/// no margin: nothing here is applied before the coordinator has checked it.
#[allow(clippy::too_many_arguments)]
pub fn propose_moves(
    problem: &Problem,
    host: usize,
    active: &[usize],
    price: impl Fn(u32) -> f64,
    mu: f64,
    nu: f64,
    activity: &[f32],
    opts: &SelectionOptions,
    table: Option<TableAt>,
    limit: usize,
) -> Vec<Move> {
    let pruning = Pruning::new(opts.prune, table);
    let charge = |p: usize| {
        let pair = &problem.pairs[p];
        pair.charge(&price) + mu + nu * pair.cqe_per_wqe
    };
    let key = |p: usize, l: f64| ranking_key(opts, activity[p], l);
    let mut members: Vec<(f64, usize)> = active
        .iter()
        .map(|&p| (key(p, surplus(problem, host, p, charge(p)).0), p))
        .collect();
    let prunable = |p: usize| key_below_surplus(opts, activity[p]);
    let all_prunable = matches!(pruning, Pruning::Table(_))
        && keys_below_surplus(opts, &activity[problem.hosts[host].pairs.clone()]);
    let candidates = scan(
        problem,
        host,
        (charge, &price, (mu, nu)),
        (pruning, prunable, all_prunable),
        |p| active.binary_search(&p).is_err(),
        key,
        (0, &[]),
        limit,
    );
    // The best moves pair low members with high outsiders: only `limit` of each can matter.
    members.sort_by(|a, b| a.0.total_cmp(&b.0));
    members.truncate(limit);
    let outsiders: Vec<(f64, usize, f64)> = candidates
        .best(limit, key)
        .into_iter()
        .map(|e| (key(e.pair, e.l), e.pair, e.x))
        .collect();
    let mut moves = Vec::new();
    let mut push = |park: Option<usize>, activate: Option<(usize, f64)>, estimate: f64| {
        moves.push(Move {
            host,
            swap: Swap { park, activate },
            estimate,
        })
    };
    if active.len() < problem.slots(host) {
        for &(key, p, x) in &outsiders {
            push(None, Some((p, x)), key);
        }
    }
    for &(member_key, m) in &members {
        push(Some(m), None, -member_key);
        for &(key, p, x) in &outsiders {
            push(Some(m), Some((p, x)), key - member_key);
        }
    }
    moves.sort_by(|a, b| b.estimate.total_cmp(&a.estimate));
    moves.truncate(limit);
    moves
}

/// A host's Lagrangian relaxation at given prices and multipliers: its `k` best pairs by surplus
/// (positive ones only), what they would use, and the host's share of the weak-duality bound.
#[derive(Clone, Debug, PartialEq)]
pub struct Relaxed {
    pub bound: f64,
    pub wqe: f64,
    pub poll: f64,
    /// `(facility, b·x)` of the chosen pairs.
    pub usage: Vec<(u32, f64)>,
}

pub fn relax_host(
    problem: &Problem,
    host: usize,
    price: impl Fn(u32) -> f64,
    mu: f64,
    nu: f64,
    pruning: Pruning,
) -> Relaxed {
    let h = &problem.hosts[host];
    let k = problem.slots(host);
    let mut out = Relaxed {
        bound: mu * h.wqe_budget + nu * h.poll_budget,
        wqe: 0.0,
        poll: 0.0,
        usage: Vec::with_capacity(k),
    };
    for e in best_surpluses(problem, host, price, (mu, nu), pruning, k)
        .iter()
        .filter(|e| e.l > 0.0)
    {
        let pair = &problem.pairs[e.pair];
        out.bound += e.l;
        out.wqe += e.x;
        out.poll += pair.cqe_per_wqe * e.x;
        out.usage
            .extend(pair.uses.iter().map(|&(f, b)| (f, b * e.x)));
    }
    out
}

/// Host `host`'s `n` best pairs by surplus at the charges `price` and `(μ, ν)` give, best
/// first.
fn best_surpluses(
    problem: &Problem,
    host: usize,
    price: impl Fn(u32) -> f64,
    (mu, nu): (f64, f64),
    pruning: Pruning,
    n: usize,
) -> Vec<Exact> {
    let charge = |p: usize| {
        let pair = &problem.pairs[p];
        pair.charge(&price) + mu + nu * pair.cqe_per_wqe
    };
    scan(
        problem,
        host,
        (charge, &price, (mu, nu)),
        (pruning, |_| true, true),
        |_| true,
        |_, l| l,
        (n, &[]),
        0,
    )
    .best(n, |_, l| l)
}

/// What each pair of a host competes with in its `TopK⁺`: the `k`-th best positive surplus
/// among the host's other pairs ([`crate::facility_prices`]).
pub(crate) struct Thresholds {
    top: Vec<usize>,
    kth: f64,
    next: f64,
}

impl Thresholds {
    /// The `k`-th best positive surplus of the host's pairs other than `pair` (0 if fewer).
    pub fn excluding(&self, pair: usize) -> f64 {
        if self.top.contains(&pair) {
            self.next
        } else {
            self.kth
        }
    }
}

/// Host `host`'s [`Thresholds`] at the charges `relax_host` uses.
pub(crate) fn host_thresholds(
    problem: &Problem,
    host: usize,
    price: impl Fn(u32) -> f64,
    mu: f64,
    nu: f64,
    pruning: Pruning,
) -> Thresholds {
    let k = problem.slots(host);
    if k == 0 {
        // With no slot, no pair ever enters.
        return Thresholds {
            top: Vec::new(),
            kth: f64::INFINITY,
            next: f64::INFINITY,
        };
    }
    let best = best_surpluses(problem, host, price, (mu, nu), pruning, k + 1);
    let positive = |n: usize| best.get(n).map_or(0.0, |e| e.l.max(0.0));
    Thresholds {
        top: best.iter().take(k).map(|e| e.pair).collect(),
        kth: positive(k - 1),
        next: positive(k),
    }
}

/// Sum of the `k` largest positive values (reorders `values`), added largest first so that
/// the sum does not depend on the order the values came in (a pruned evaluation holds fewer).
fn top_k_positive_sum(values: &mut [f64], k: usize) -> f64 {
    if k == 0 || values.is_empty() {
        return 0.0;
    }
    let k = k.min(values.len());
    values.select_nth_unstable_by(k - 1, |a, b| b.total_cmp(a));
    let top = &mut values[..k];
    top.sort_unstable_by(|a, b| b.total_cmp(a));
    top.iter().filter(|v| **v > 0.0).sum()
}

/// Initial active sets, chosen greedily host by host so they do not herd: every host would
/// otherwise pick the same heavy apps at zero prices. Each pair is scored by its surplus at the
/// given facility prices and at the rate it could expect, `min(x̄, Q/k, min_f Y_f/(b_f·(members_f + 1)))`,
/// so a facility looks less attractive as members join; a pair joins only while each of its
/// facilities can still carry every member at `x_min` (so a feasible allocation always exists).
pub fn initial_active(problem: &Problem, prices: &[f64]) -> Vec<Vec<usize>> {
    let x_min = problem.params.x_min;
    let mut members = vec![0u32; problem.facilities.len()];
    let mut floor = vec![0.0; problem.facilities.len()];
    let mut scored: Vec<(f64, usize)> = Vec::new();
    let mut out = Vec::with_capacity(problem.hosts.len());
    let fits = |floor: &[f64], pair: &crate::model::Pair| {
        pair.uses
            .iter()
            .all(|&(f, b)| floor[f as usize] + b * x_min <= problem.facilities[f as usize].capacity)
    };
    for (hi, h) in problem.hosts.iter().enumerate() {
        let fair = h.wqe_budget / problem.slots(hi).max(1) as f64;
        scored.clear();
        for p in h.pairs.clone() {
            let pair = &problem.pairs[p];
            if !fits(&floor, pair) {
                continue;
            }
            let share = pair
                .uses
                .iter()
                .map(|&(f, b)| {
                    problem.facilities[f as usize].capacity / (b * (members[f as usize] + 1) as f64)
                })
                .fold(f64::INFINITY, f64::min);
            let x = pair.demand.min(fair).min(share).max(x_min);
            let v =
                problem.utility(pair).activation_value(x) - pair.charge(|f| prices[f as usize]) * x;
            if v > 0.0 {
                scored.push((v, p));
            }
        }
        let slots = problem.slots(hi).min(scored.len());
        let mut chosen: Vec<usize> = if slots == 0 {
            Vec::new()
        } else {
            scored.select_nth_unstable_by(slots - 1, |a, b| b.0.total_cmp(&a.0));
            scored[..slots].iter().map(|s| s.1).collect()
        };
        chosen.retain(|&p| {
            let pair = &problem.pairs[p];
            if !fits(&floor, pair) {
                return false;
            }
            for &(f, b) in &pair.uses {
                floor[f as usize] += b * x_min;
                members[f as usize] += 1;
            }
            true
        });
        chosen.sort_unstable();
        out.push(chosen);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::generator::{generate, GeneratorConfig};

    fn problem() -> Problem {
        generate(&GeneratorConfig {
            k: 2,
            seed: 5,
            ..GeneratorConfig::new(2, 6)
        })
    }

    fn evaluate(
        problem: &Problem,
        active: &[usize],
        present: impl Fn(usize) -> bool,
        swap_prob: f64,
    ) -> HostEvaluation {
        let opts = SelectionOptions {
            swap_prob,
            ..SelectionOptions::default()
        };
        let activity = vec![0.0; problem.pairs.len()];
        evaluate_present(
            problem,
            0,
            active,
            |_| 0.0,
            0.0,
            0.0,
            &activity,
            present,
            &opts,
            None,
            &mut SplitMix64::new(1),
        )
    }

    #[test]
    fn an_absent_member_is_parked_without_the_coin_and_a_present_app_takes_its_slot() {
        let problem = problem();
        let pairs: Vec<usize> = problem.hosts[0].pairs.clone().collect();
        let active = vec![pairs[0], pairs[1]];
        // swap_prob 0: no voluntary swap ever happens, yet the absent member goes.
        let e = evaluate(&problem, &active, |p| p != pairs[1], 0.0);
        let swap = e.swap.expect("the absent member is parked");
        assert_eq!(swap.park, Some(pairs[1]));
        let (inp, x) = swap.activate.expect("a present outsider takes the slot");
        assert!(inp != pairs[1] && !active.contains(&inp));
        assert!(x >= problem.params.x_min);
        // With every app present and no coin, nothing moves.
        assert_eq!(evaluate(&problem, &active, |_| true, 0.0).swap, None);
    }

    #[test]
    fn absent_apps_are_never_activated_nor_counted_in_the_bound() {
        let problem = problem();
        let pairs: Vec<usize> = problem.hosts[0].pairs.clone().collect();
        // Nothing active and nothing present: no proposal, no value.
        let e = evaluate(&problem, &[], |_| false, 1.0);
        assert_eq!(e.swap, None);
        assert_eq!(e.bound, 0.0);
        // Only one app present: that is the one proposed for the free slot.
        let e = evaluate(&problem, &[], |p| p == pairs[3], 1.0);
        assert_eq!(e.swap.and_then(|s| s.activate).map(|a| a.0), Some(pairs[3]));
        let all = evaluate(&problem, &[], |_| true, 1.0);
        assert!(all.bound >= e.bound && e.bound > 0.0);
    }

    #[test]
    fn top_k_positive_ignores_negatives() {
        let mut v = vec![3.0, -1.0, 5.0, 0.5, -2.0];
        assert_eq!(top_k_positive_sum(&mut v, 2), 8.0);
        let mut v = vec![-3.0, 1.0];
        assert_eq!(top_k_positive_sum(&mut v, 2), 1.0);
    }
}
