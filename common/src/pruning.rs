//! Pruned evaluation of a host's pairs for selection (docs/model.md, "Selection at scale").
//!
//! A selection round needs, per host, only a few exact surpluses — its members, the `k` best
//! pairs (the weak-duality bound) and the best outsiders — but an exact surplus is a
//! safeguarded Newton solve (β > 0), about 90 ns. Dropping β's term where it is largest gives
//! a closed-form upper bound of the surplus at a fraction of that, so a host computes the bound
//! of every pair, the exact surplus of the most promising ones, and then the exact surplus only
//! of the pairs whose bound still reaches what those achieved. A pair left out has a bound below
//! the values of enough computed pairs that it cannot be among the ones sought, so the result
//! is the one an exhaustive evaluation gives (`tests::pruning_changes_nothing`).

use crate::model::Problem;

/// An upper bound of [`crate::selection::surplus`]`(problem, host, pair, charge)`, in closed form.
///
/// With `r` the rate term of the utility, the surplus is `max_{x_min ≤ x ≤ hi} r(x) − β/x² −
/// c·x − r(x_min)`. Since `−β/x² ≤ −β/hi²` on the box, it is at most `max (r(x) − c·x) −
/// β/hi² − r(x_min)`, and the concave `r(x) − c·x` peaks at the box's clamp of
/// `r'⁻¹(c) = (w/c)^(1/α)`. The bound is padded by far more than the rounding of either
/// computation, so it holds for the computed surplus too.
pub fn surplus_upper_bound(problem: &Problem, host: usize, pair: usize, charge: f64) -> f64 {
    let p = &problem.pairs[pair];
    let hi = crate::selection::pair_cap(problem, host, pair);
    let u = problem.utility(p);
    let lo = problem.params.x_min;
    let x = if charge > 0.0 {
        u.inverse_marginal_guess(charge).clamp(lo, hi)
    } else {
        hi
    };
    let beta = problem.params.beta;
    // `r(x) − r(x_min)`; for α = 1 one logarithm instead of the two of `activation_value`.
    let rise = if problem.params.alpha == 1.0 {
        p.weight * (x / lo).ln()
    } else {
        u.activation_value(x) + beta / (x * x)
    };
    let bound = rise - charge * x - beta / (hi * hi);
    bound + 1e-9 * (rise.abs() + charge * x + 1.0)
}

/// One pair's exact surplus `l` and the rate `x` that achieves it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Exact {
    pub pair: usize,
    pub l: f64,
    pub x: f64,
}

/// A host's pairs whose exact surplus has not been needed yet, with their upper bounds, and
/// those whose exact surplus is known. `exact(pair)` computes `(l, x)`.
pub(crate) struct Candidates<E: Fn(usize) -> (f64, f64)> {
    pending: Vec<(f64, usize)>,
    pub known: Vec<Exact>,
    exact: E,
}

impl<E: Fn(usize) -> (f64, f64)> Candidates<E> {
    pub fn new(capacity: usize, exact: E) -> Self {
        Self {
            pending: Vec::with_capacity(capacity),
            known: Vec::new(),
            exact,
        }
    }

    /// Adds a pair with an upper bound of its surplus (`f64::INFINITY`: no bound, always
    /// computed when a query reaches it).
    pub fn push(&mut self, bound: f64, pair: usize) {
        self.pending.push((bound, pair));
    }

    fn compute(&mut self, pair: usize) {
        let (l, x) = (self.exact)(pair);
        self.known.push(Exact { pair, l, x });
    }

    /// Makes sure every pair that can be among the `n` best by `key` is known. `key(pair, l)`
    /// must not decrease as `l` grows; `others` are keys of items outside this set that count
    /// as competitors (a host's members, when the `n` best of all its pairs are sought).
    ///
    /// The `n` best bounds are computed first; their keys together with the known ones and
    /// `others` give a threshold — the `n`-th best key — that a left-out pair's bound is below,
    /// so `n` items beat it whatever its exact value.
    pub fn settle_top(&mut self, n: usize, key: impl Fn(usize, f64) -> f64, others: &[f64]) {
        if n == 0 || self.pending.is_empty() {
            return;
        }
        // The threshold needs `n` exact keys; the best bounds are the likeliest to give a
        // high one. A later query on the same host finds them known already.
        if self.known.len() < n {
            let by_bound =
                |a: &(f64, usize), b: &(f64, usize)| key(b.1, b.0).total_cmp(&key(a.1, a.0));
            let first = n.min(self.pending.len());
            if first < self.pending.len() {
                self.pending.select_nth_unstable_by(first - 1, by_bound);
            }
            for (_, pair) in self.pending.drain(..first).collect::<Vec<_>>() {
                self.compute(pair);
            }
        }
        let mut keys: Vec<f64> = self
            .known
            .iter()
            .map(|e| key(e.pair, e.l))
            .chain(others.iter().copied())
            .collect();
        let threshold = if keys.len() < n {
            f64::NEG_INFINITY
        } else {
            *keys.select_nth_unstable_by(n - 1, |a, b| b.total_cmp(a)).1
        };
        let mut rest = std::mem::take(&mut self.pending);
        rest.retain(|&(bound, pair)| {
            if key(pair, bound) >= threshold {
                self.compute(pair);
                false
            } else {
                true
            }
        });
        self.pending = rest;
    }

    /// The `n` best known pairs by `key` (ties: the lower pair index first), best first. Only
    /// complete after [`Candidates::settle_top`] with the same `n` and `key`.
    pub fn best(&self, n: usize, key: impl Fn(usize, f64) -> f64) -> Vec<Exact> {
        let order = |a: &Exact, b: &Exact| {
            key(b.pair, b.l)
                .total_cmp(&key(a.pair, a.l))
                .then(a.pair.cmp(&b.pair))
        };
        let mut all = self.known.clone();
        if n == 0 {
            return Vec::new();
        }
        if all.len() > n {
            all.select_nth_unstable_by(n - 1, order);
            all.truncate(n);
        }
        all.sort_by(order);
        all
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::generator::{generate, GeneratorConfig};
    use crate::rng::SplitMix64;
    use crate::selection::surplus;

    /// The bound holds for every pair of a generated instance at charges from zero to far
    /// above any pair's marginal utility, and at other α.
    #[test]
    fn the_bound_is_above_the_exact_surplus() {
        for alpha in [0.5, 1.0, 2.0] {
            let p = generate(&GeneratorConfig {
                alpha,
                seed: 3,
                ..GeneratorConfig::new(4, 300)
            });
            let mut rng = SplitMix64::new(9);
            let mut tight = 0;
            for host in 0..p.hosts.len() {
                for pair in p.hosts[host].pairs.clone() {
                    let charge = [0.0, rng.range(0.0, 5.0), rng.range(0.0, 500.0)][pair % 3];
                    let (l, _) = surplus(&p, host, pair, charge);
                    let ub = surplus_upper_bound(&p, host, pair, charge);
                    assert!(
                        ub >= l,
                        "α {alpha}, pair {pair}, charge {charge}: {ub} < {l}"
                    );
                    if ub - l <= 0.05 * l.abs().max(1e-3) {
                        tight += 1;
                    }
                }
            }
            // A bound that holds by being loose would prune nothing.
            assert!(tight > p.pairs.len() / 2, "α {alpha}: tight on {tight}");
        }
    }

    /// Everything selection computes from surpluses is the same with pruning and without: the
    /// swap rounds' bound and proposals, the verified search's moves, the relaxation the
    /// certificate refines, and so a whole `solve`. Prices come from a few ADMM iterations on
    /// the initial sets; the activity memory and the multipliers are varied so that keys,
    /// budgets and ties of the fairness discount all play a part.
    #[test]
    fn pruning_changes_nothing() {
        use crate::selection::{
            evaluate_present, initial_active, propose_moves, relax_host, SelectionOptions,
        };
        use crate::solver::{default_rho, solve, Algorithm, Engine, SolveOptions};
        for (hosts, apps, k, seed) in [(6, 400, 5, 1), (4, 60, 20, 2), (5, 8, 3, 3)] {
            let p = generate(&GeneratorConfig {
                k,
                seed,
                ..GeneratorConfig::new(hosts, apps)
            });
            let active = initial_active(&p, &vec![0.0; p.facilities.len()]);
            let mut engine = Engine::new(&p, Algorithm::Admm, default_rho(&p), active);
            for _ in 0..8 {
                engine.step();
            }
            let prices = engine.prices();
            let mut rng = SplitMix64::new(seed);
            let activity: Vec<f32> = (0..p.pairs.len()).map(|_| rng.unit() as f32).collect();
            for h in &engine.hosts {
                for (mu, nu) in [(0.0, 0.0), (h.multipliers.mu, h.multipliers.nu), (3.0, 0.5)] {
                    let with = |prune: bool| {
                        let opts = SelectionOptions {
                            prune,
                            swap_prob: 1.0,
                            ..SelectionOptions::default()
                        };
                        let price = |f: u32| prices[f as usize];
                        let present = |q: usize| q % 7 != 3;
                        (
                            evaluate_present(
                                &p,
                                h.host,
                                &h.active,
                                price,
                                mu,
                                nu,
                                &activity,
                                present,
                                &opts,
                                &mut SplitMix64::new(7),
                            ),
                            propose_moves(
                                &p, h.host, &h.active, price, mu, nu, &activity, &opts, 8,
                            ),
                            relax_host(&p, h.host, price, mu, nu, prune),
                        )
                    };
                    assert_eq!(with(true), with(false), "{hosts}×{apps}, host {}", h.host);
                }
            }
            let solved = |prune: bool| {
                let mut opts = SolveOptions {
                    polish_trials: 16,
                    ..SolveOptions::default()
                };
                opts.selection.prune = prune;
                solve(&p, &opts)
            };
            assert_eq!(solved(true), solved(false), "{hosts}×{apps}");
        }
    }
}
