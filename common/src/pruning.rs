//! Pruned evaluation of a host's pairs for selection (docs/model.md, "Selection at scale").
//!
//! A selection round needs, per host, only a few exact surpluses — its members, the `k` best
//! pairs (the weak-duality bound) and the best outsiders — but an exact surplus is a
//! safeguarded Newton solve (β > 0), about 90 ns. Dropping β's term where it is largest gives
//! a closed-form upper bound of the surplus at a fraction of that, so a host scans its pairs
//! once, keeping the best exact values found so far, and computes a pair's exact surplus only
//! when its bound reaches them. A pair left out has a bound below the values of enough computed
//! pairs that it cannot be among the ones sought, so the result is the one an exhaustive
//! evaluation gives (`tests::pruning_changes_nothing`).

use crate::model::Problem;

/// Intervals of the mantissa in [`ln_upper`]: 32 tangents keep it within `1.3·10⁻⁴` of `ln`.
const LN_SEGMENTS: usize = 32;

/// `ln` in a `const fn`: `2·atanh(z)` with `z = (m − 1)/(m + 1)`, by its series; for
/// `m ∈ [1, 2]`, `z ≤ 1/3` and 40 terms are exact to the last bit.
const fn ln_series(m: f64) -> f64 {
    let z = (m - 1.0) / (m + 1.0);
    let z2 = z * z;
    let (mut term, mut sum, mut k) = (z, 0.0, 0);
    while k < 40 {
        sum += term / (2 * k + 1) as f64;
        term *= z2;
        k += 1;
    }
    2.0 * sum
}

/// `(ln m₀, 1/m₀)` at the midpoint `m₀` of each mantissa interval.
const LN_TANGENTS: [(f64, f64); LN_SEGMENTS] = {
    let mut t = [(0.0, 0.0); LN_SEGMENTS];
    let mut i = 0;
    while i < LN_SEGMENTS {
        let m0 = 1.0 + (i as f64 + 0.5) / LN_SEGMENTS as f64;
        t[i] = (ln_series(m0), 1.0 / m0);
        i += 1;
    }
    t
};

/// An upper bound of `ln y` for normal `y > 0`, within `1.3·10⁻⁴` of it, without calling
/// `ln`: with `y = 2^e·m`, `m ∈ [1, 2)`, `ln m` lies below its tangent at the midpoint of the
/// mantissa's 32nd (ln is concave), so `e·ln 2 + ln m₀ + (m − m₀)/m₀ ≥ ln y`. The bound's
/// logarithm was about 40 % of a round's time (a libm call per pair); this is a few
/// instructions and a table read.
pub(crate) fn ln_upper(y: f64) -> f64 {
    const MANTISSA: u64 = (1 << 52) - 1;
    let bits = y.to_bits();
    let e = ((bits >> 52) & 0x7ff) as i64 - 1023;
    let m = f64::from_bits((bits & MANTISSA) | (1023 << 52));
    let i = ((bits & MANTISSA) >> (52 - 5)) as usize;
    let (ln_m0, inv_m0) = LN_TANGENTS[i];
    let m0 = 1.0 + (i as f64 + 0.5) / LN_SEGMENTS as f64;
    e as f64 * std::f64::consts::LN_2 + ln_m0 + (m - m0) * inv_m0
}

/// An upper bound of [`crate::selection::surplus`]`(problem, host, pair, charge)`, in closed form
/// ([`Bounds::bound`]).
pub fn surplus_upper_bound(problem: &Problem, host: usize, pair: usize, charge: f64) -> f64 {
    Bounds::new(problem, host).bound(pair, charge)
}

/// The bound's constants of one host, read once rather than per pair: a round computes the
/// bound of every pair, so its cost per pair is the round's cost.
pub(crate) struct Bounds<'a> {
    problem: &'a Problem,
    wqe_budget: f64,
    poll_budget: f64,
    x_min: f64,
    inv_x_min: f64,
    beta: f64,
    log: bool,
}

impl<'a> Bounds<'a> {
    pub fn new(problem: &'a Problem, host: usize) -> Self {
        let h = &problem.hosts[host];
        Self {
            problem,
            wqe_budget: h.wqe_budget,
            poll_budget: h.poll_budget,
            x_min: problem.params.x_min,
            inv_x_min: 1.0 / problem.params.x_min,
            beta: problem.params.beta,
            log: problem.params.alpha == 1.0,
        }
    }

    /// With `r` the rate term of the utility, the surplus is `max_{x_min ≤ x ≤ hi} r(x) − β/x² −
    /// c·x − r(x_min)`. Since `−β/x² ≤ −β/hi²` on the box, it is at most `max (r(x) − c·x) −
    /// β/hi² − r(x_min)`, and the concave `r(x) − c·x` peaks at the box's clamp of
    /// `r'⁻¹(c) = (w/c)^(1/α)`; for α = 1, `r(x) − r(x_min) = w·ln(x/x_min)` is bounded above
    /// by [`ln_upper`]. `hi` is [`crate::selection::pair_cap`], with a division only where a
    /// cap binds; rounding either way only widens the box. The bound is padded by far more
    /// than the rounding of either computation, so it holds for the computed surplus too.
    #[inline]
    pub fn bound(&self, pair: usize, charge: f64) -> f64 {
        let p = &self.problem.pairs[pair];
        let (lo, beta) = (self.x_min, self.beta);
        let mut hi = p.demand.min(self.wqe_budget);
        if self.poll_budget < p.cqe_per_wqe * hi {
            hi = self.poll_budget / p.cqe_per_wqe;
        }
        for &(f, b) in &p.uses {
            let capacity = self.problem.facilities[f as usize].capacity;
            if capacity < b * hi {
                hi = capacity / b;
            }
        }
        let hi = hi.max(lo);
        let rise_and_x = |x: f64| {
            if self.log {
                (p.weight * ln_upper(x * self.inv_x_min), x)
            } else {
                let u = self.problem.utility(p);
                (u.activation_value(x) + beta / (x * x), x)
            }
        };
        let (rise, x) = if charge <= 0.0 {
            rise_and_x(hi)
        } else if self.log {
            // `w/c` clamped, without a division where the clamp decides.
            rise_and_x(if p.weight >= charge * hi {
                hi
            } else if p.weight <= charge * lo {
                lo
            } else {
                p.weight / charge
            })
        } else {
            rise_and_x(
                self.problem
                    .utility(p)
                    .inverse_marginal_guess(charge)
                    .clamp(lo, hi),
            )
        };
        let bound = rise - charge * x - beta / (hi * hi);
        bound + 1e-9 * (rise.abs() + charge * x + 1.0)
    }
}

/// One pair's exact surplus `l` and the rate `x` that achieves it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Exact {
    pub pair: usize,
    pub l: f64,
    pub x: f64,
}

/// The `n` best values offered so far, best first, each with a tag.
struct Best {
    n: usize,
    values: Vec<(f64, usize)>,
}

impl Best {
    fn new(n: usize) -> Self {
        Self {
            n,
            values: Vec::with_capacity(n + 1),
        }
    }

    /// What a value must reach to be among the `n` best: the `n`-th best so far (−∞ while
    /// fewer were offered; +∞ when nothing is sought).
    fn threshold(&self) -> f64 {
        match self.n {
            0 => f64::INFINITY,
            n if self.values.len() < n => f64::NEG_INFINITY,
            n => self.values[n - 1].0,
        }
    }

    #[inline]
    fn offer(&mut self, v: f64, tag: usize) {
        if self.n == 0 || (self.values.len() == self.n && v <= self.values[self.n - 1].0) {
            return;
        }
        let at = self.values.partition_point(|&(b, _)| b >= v);
        self.values.insert(at, (v, tag));
        self.values.truncate(self.n);
    }
}

/// A host's pairs, offered with upper bounds of their surpluses, for two queries at once: the
/// `by_value` best surpluses (`others`, e.g. a host's members, counting as competitors) and
/// the `by_key` best ranking keys. `exact(pair)` computes `(l, x)`; `key(pair, l)` must not
/// decrease as `l` grows, and must be at most `l` for every pair offered with a finite bound
/// (so most pairs are tested against the key's threshold without computing their key).
///
/// While pairs are offered, the `n` best bounds of each query are kept aside; [`Scan::finish`]
/// computes those pairs exactly, which sets each query's threshold (the `n`-th best exact
/// value, or key), and then every other pair whose bound reaches a threshold, raising the
/// thresholds as it goes. A pair left out has a bound below `n` computed values whatever its
/// exact one, so the result does not depend on which pairs were computed. Keeping the best
/// bounds while offering costs a comparison per pair; an earlier version selected them from
/// all bounds afterwards, an eighth of a round.
pub(crate) struct Scan<E, K> {
    pub known: Vec<Exact>,
    exact: E,
    key: K,
    /// `(bound, pair)` of every pair offered and not yet computed.
    pending: Vec<(f64, usize)>,
    /// Indices into `pending` of the best bounds, per query.
    first_by_value: Best,
    first_by_key: Best,
    by_value: Best,
    by_key: Best,
}

impl<E: Fn(usize) -> (f64, f64), K: Fn(usize, f64) -> f64> Scan<E, K> {
    pub fn new(
        exact: E,
        key: K,
        by_value: usize,
        others: &[f64],
        by_key: usize,
        capacity: usize,
    ) -> Self {
        let mut best = Best::new(by_value);
        for &o in others {
            best.offer(o, usize::MAX);
        }
        Self {
            known: Vec::new(),
            exact,
            key,
            pending: Vec::with_capacity(capacity),
            first_by_value: Best::new(by_value),
            first_by_key: Best::new(by_key),
            by_value: best,
            by_key: Best::new(by_key),
        }
    }

    /// Offers `pair` with `bound ≥` its exact surplus (`f64::INFINITY`: no bound, so it is
    /// always computed).
    #[inline]
    pub fn offer(&mut self, pair: usize, bound: f64) {
        let at = self.pending.len();
        self.first_by_value.offer(bound, at);
        // `key ≤ l`: a bound that does not reach the threshold cannot give a key that does.
        if self.by_key.n > 0 && bound > self.first_by_key.threshold() {
            self.first_by_key.offer((self.key)(pair, bound), at);
        }
        self.pending.push((bound, pair));
    }

    fn compute(&mut self, pair: usize) {
        let (l, x) = (self.exact)(pair);
        self.by_value.offer(l, pair);
        self.by_key.offer((self.key)(pair, l), pair);
        self.known.push(Exact { pair, l, x });
    }

    /// Computes every pair that can be among either query's best.
    pub fn finish(&mut self) {
        let firsts: Vec<usize> = (self.first_by_value.values.iter())
            .chain(&self.first_by_key.values)
            .map(|&(_, at)| at)
            .collect();
        for at in firsts {
            let (bound, pair) = self.pending[at];
            if bound != f64::NEG_INFINITY {
                self.pending[at].0 = f64::NEG_INFINITY;
                self.compute(pair);
            }
        }
        let pending = std::mem::take(&mut self.pending);
        for &(bound, pair) in &pending {
            if bound == f64::NEG_INFINITY {
                continue;
            }
            let key_threshold = self.by_key.threshold();
            if bound >= self.by_value.threshold()
                || (bound >= key_threshold && (self.key)(pair, bound) >= key_threshold)
            {
                self.compute(pair);
            }
        }
    }

    /// The `n` best known pairs by `key` (ties: the lower pair index first), best first. Complete
    /// for the scan's two queries: `n` at most `by_value` with `key` the surplus, or at most
    /// `by_key` with the scan's key.
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

    /// `ln_upper` is above `ln` and within the tangents' error of it, over many binades and
    /// at the segments' edges.
    #[test]
    fn ln_upper_is_a_tight_upper_bound() {
        let mut rng = SplitMix64::new(4);
        let edges = (0..=2 * LN_SEGMENTS).map(|i| 1.0 + i as f64 / (2 * LN_SEGMENTS) as f64);
        let random = (0..20_000).map(|_| rng.range(0.0, 12.0).exp());
        for y in edges.chain(random) {
            let (up, ln) = (ln_upper(y), y.ln());
            assert!(up >= ln - 1e-15 * ln.abs().max(1.0), "{y}: {up} < {ln}");
            assert!(up - ln <= 1.3e-4, "{y}: {up} − {ln}");
        }
    }

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
