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
//!
//! An engine's rounds go further with a [`BoundTable`] built once: each host's pairs in order
//! of their bound at charge 0, which a charge only lowers, so a scan stops where that bound
//! falls below what it still looks for, and never looks at most pairs.

use crate::model::Problem;
use crate::selection::pair_cap;
use crate::utility::{Shape, Utility};
use rayon::prelude::*;

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

/// The closed-form bound of a pair's surplus in its box `[x_min, hi]` ([`Curve::bound`]),
/// shared by the per-pair bounds and the table.
#[derive(Clone, Copy)]
struct Curve {
    shape: Shape,
    inv_x_min: f64,
    log: bool,
}

impl Curve {
    fn new(problem: &Problem) -> Self {
        Self {
            shape: problem.params.shape(),
            inv_x_min: 1.0 / problem.params.x_min,
            log: problem.params.alpha == 1.0,
        }
    }

    /// With `r` the rate term of the utility, the surplus is `max_{x_min ≤ x ≤ hi} r(x) − β/x² −
    /// c·x − r(x_min)`. Since `−β/x² ≤ −β/hi²` on the box, it is at most `max (r(x) − c·x) −
    /// β/hi² − r(x_min)`, and the concave `r(x) − c·x` peaks at the box's clamp of
    /// `r'⁻¹(c) = (w/c)^(1/α)`; for α = 1, `r(x) − r(x_min) = w·ln(x/x_min)` is bounded above
    /// by [`ln_upper`]. The bound is padded by far more than the rounding of either
    /// computation, so it holds for the computed surplus too. `w`: the weight; `c`: the
    /// charge; `beta_over_hi2`: `β/hi²`.
    #[inline(always)]
    fn bound(&self, w: f64, c: f64, hi: f64, beta_over_hi2: f64) -> f64 {
        let lo = self.shape.x_min;
        let (rise, x) = if self.log {
            // `w/c` clamped, without a division where the clamp decides.
            let x = if c <= 0.0 || w >= c * hi {
                hi
            } else if w <= c * lo {
                lo
            } else {
                w / c
            };
            (w * ln_upper(x * self.inv_x_min), x)
        } else {
            // `a` plays no part in the rate term.
            let u = Utility {
                w,
                a: 0.0,
                shape: self.shape,
            };
            let x = if c <= 0.0 {
                hi
            } else {
                u.inverse_marginal_guess(c).clamp(lo, hi)
            };
            (u.activation_value(x) + self.shape.beta / (x * x), x)
        };
        let bound = rise - c * x - beta_over_hi2;
        bound + 1e-9 * (rise.abs() + c * x + 1.0)
    }
}

/// The bound's constants of one host, read once rather than per pair: a round computes the
/// bound of every pair, so its cost per pair is the round's cost.
pub(crate) struct Bounds<'a> {
    problem: &'a Problem,
    wqe_budget: f64,
    poll_budget: f64,
    curve: Curve,
}

impl<'a> Bounds<'a> {
    pub fn new(problem: &'a Problem, host: usize) -> Self {
        let h = &problem.hosts[host];
        Self {
            problem,
            wqe_budget: h.wqe_budget,
            poll_budget: h.poll_budget,
            curve: Curve::new(problem),
        }
    }

    /// [`Curve::bound`] with `hi` [`crate::selection::pair_cap`], computed with a division
    /// only where a cap binds; rounding either way only widens the box.
    #[inline]
    pub fn bound(&self, pair: usize, charge: f64) -> f64 {
        let p = &self.problem.pairs[pair];
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
        let hi = hi.max(self.curve.shape.x_min);
        let beta_over_hi2 = self.curve.shape.beta / (hi * hi);
        self.curve.bound(p.weight, charge, hi, beta_over_hi2)
    }
}

/// How a scan bounds the pairs it may leave out.
#[derive(Clone, Copy)]
pub enum Pruning<'a> {
    /// Every pair is computed exactly.
    Off,
    /// Bounds read from the pairs themselves ([`Bounds`]): one host's evaluation, as an agent
    /// runs it.
    Pairs,
    /// Bounds from a table built once for the problem: the coordinator's rounds.
    Table(TableAt<'a>),
}

/// A [`BoundTable`] at a round's prices: what a scan needs of them beyond each pair's.
#[derive(Clone, Copy)]
pub struct TableAt<'a> {
    pub table: &'a BoundTable,
    /// The least facility price (0 if none is lower).
    pub lowest_price: f64,
}

impl<'a> Pruning<'a> {
    /// `prune` as [`crate::selection::SelectionOptions::prune`], with the table if there is one.
    pub fn new(prune: bool, table: Option<TableAt<'a>>) -> Self {
        match (prune, table) {
            (false, _) => Pruning::Off,
            (true, None) => Pruning::Pairs,
            (true, Some(t)) => Pruning::Table(t),
        }
    }

    /// The same pruning at other prices.
    pub fn at(self, prices: &[f64]) -> Self {
        match self {
            Pruning::Table(t) => Pruning::Table(t.table.at(prices)),
            other => other,
        }
    }
}

/// A pair's facility in [`BoundTable`]: none, or several (the charge is then the pair's own).
const NO_FACILITY: u32 = u32::MAX;
const SEVERAL_FACILITIES: u32 = u32::MAX - 1;

/// Every pair's price-independent part of its bound, per host, in columns ordered by the
/// pair's bound at charge 0 (`top`), highest first. A pair's bound only falls as its charge
/// grows, so a host's scan ([`BoundTable::scan_host`]) can stop at the first pair whose `top`
/// is below what the scan still looks for: on generated instances only about a third of a
/// host's pairs have a `top` above its `k`-th best surplus. It also reads contiguous columns
/// instead of a `Pair` (56 bytes, its `uses` behind a pointer) per pair, and no longer works
/// out each pair's cap. Built once per engine, in parallel; the pairs must not change while it
/// is used (an engine borrows its problem). Figures in docs/benchmarks.md ("Selection at
/// scale").
pub struct BoundTable {
    hosts: Vec<HostColumns>,
    curve: Curve,
    /// The largest `Σ b_f`, `a` and cap of any pair: how far a negative charge (prices and
    /// multipliers a rounding below zero) can lift a bound above its `top`.
    max_coeff: f64,
    max_cqe_per_wqe: f64,
    max_hi: f64,
}

/// One host's pairs, in descending order of `top`.
struct HostColumns {
    pair: Vec<u32>,
    top: Vec<f64>,
    weight: Vec<f64>,
    cqe_per_wqe: Vec<f64>,
    /// The pair's one facility and its `b_f` (several: their `Σ b_f`).
    facility: Vec<u32>,
    coeff: Vec<f64>,
    /// [`pair_cap`], and `β/hi²`.
    hi: Vec<f64>,
    beta_over_hi2: Vec<f64>,
}

impl BoundTable {
    pub fn new(problem: &Problem) -> Self {
        let mut table = Self {
            hosts: Vec::new(),
            curve: Curve::new(problem),
            max_coeff: 0.0,
            max_cqe_per_wqe: 0.0,
            max_hi: 0.0,
        };
        table.hosts = (0..problem.hosts.len())
            .into_par_iter()
            .map(|h| table.host_columns(problem, h))
            .collect();
        for c in &table.hosts {
            let max = |v: &[f64]| v.iter().copied().fold(0.0, f64::max);
            table.max_coeff = table.max_coeff.max(max(&c.coeff));
            table.max_cqe_per_wqe = table.max_cqe_per_wqe.max(max(&c.cqe_per_wqe));
            table.max_hi = table.max_hi.max(max(&c.hi));
        }
        table
    }

    /// The table at facility prices `prices`.
    pub fn at(&self, prices: &[f64]) -> TableAt<'_> {
        TableAt {
            table: self,
            lowest_price: prices.iter().copied().fold(0.0, f64::min),
        }
    }

    fn host_columns(&self, problem: &Problem, host: usize) -> HostColumns {
        let beta = problem.params.beta;
        let mut rows: Vec<(f64, usize, f64)> = (problem.hosts[host].pairs.clone())
            .map(|q| {
                let hi = pair_cap(problem, host, q);
                let top = self
                    .curve
                    .bound(problem.pairs[q].weight, 0.0, hi, beta / (hi * hi));
                (top, q, hi)
            })
            .collect();
        rows.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        let n = rows.len();
        let mut c = HostColumns {
            pair: Vec::with_capacity(n),
            top: Vec::with_capacity(n),
            weight: Vec::with_capacity(n),
            cqe_per_wqe: Vec::with_capacity(n),
            facility: Vec::with_capacity(n),
            coeff: Vec::with_capacity(n),
            hi: Vec::with_capacity(n),
            beta_over_hi2: Vec::with_capacity(n),
        };
        for (top, q, hi) in rows {
            let pair = &problem.pairs[q];
            let (facility, coeff) = match pair.uses[..] {
                [] => (NO_FACILITY, 0.0),
                [(f, b)] if f < SEVERAL_FACILITIES => (f, b),
                // Their `Σ b_f`: what a negative price can take off the charge, per unit.
                _ => (SEVERAL_FACILITIES, pair.uses.iter().map(|u| u.1).sum()),
            };
            // A problem of 2³² pairs would not fit in memory.
            c.pair.push(u32::try_from(q).expect("fewer than 2³² pairs"));
            c.top.push(top);
            c.weight.push(pair.weight);
            c.cqe_per_wqe.push(pair.cqe_per_wqe);
            c.facility.push(facility);
            c.coeff.push(coeff);
            c.hi.push(hi);
            c.beta_over_hi2.push(beta / (hi * hi));
        }
        c
    }

    /// Offers host `host`'s pairs for which `offered(pair)` holds to `scan`, at prices
    /// `price` (`lowest_price`: the least of them) and multipliers `(μ, ν)`, in descending
    /// order of `top`, stopping once `top` is below what the scan still looks for. A negative
    /// charge lifts a bound above `top` by at most `−c·hi`, which the stop allows for. With
    /// `all_prunable` false (some pair's key may exceed its surplus) every pair is offered.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn scan_host<E: Fn(usize) -> (f64, f64), K: Fn(usize, f64) -> f64>(
        &self,
        problem: &Problem,
        host: usize,
        scan: &mut Scan<E, K>,
        (price, lowest_price): (impl Fn(u32) -> f64, f64),
        (mu, nu): (f64, f64),
        offered: impl Fn(usize) -> bool,
        all_prunable: bool,
    ) {
        let c = &self.hosts[host];
        let lowest_charge = lowest_price.min(0.0) * self.max_coeff
            + mu.min(0.0)
            + nu.min(0.0) * self.max_cqe_per_wqe;
        let lift = -lowest_charge * self.max_hi;
        // As `Scan::run` (the best bounds computed first, then every pair whose bound reaches
        // the thresholds they set), over the pairs up to where `top` drops below the best
        // bounds seen — none after can be among them — and then the thresholds.
        let mut seen: Vec<(f64, usize)> = Vec::with_capacity(c.pair.len());
        let mut first_by_value = Best::new(scan.by_value.n);
        let mut first_by_key = Best::new(scan.by_key.n);
        let mut settled = false;
        for i in 0..c.pair.len() {
            let top = c.top[i] + lift + 1e-12 * c.top[i].abs();
            if all_prunable {
                if !settled && top < first_by_value.threshold().min(first_by_key.threshold()) {
                    settled = true;
                    scan.compute_firsts(&first_by_value, &first_by_key, &mut seen);
                }
                if settled && top < scan.threshold() {
                    break;
                }
            }
            let q = c.pair[i] as usize;
            if !offered(q) {
                continue;
            }
            let bound = if all_prunable {
                let facilities = match c.facility[i] {
                    NO_FACILITY => 0.0,
                    SEVERAL_FACILITIES => problem.pairs[q].charge(&price),
                    f => price(f) * c.coeff[i],
                };
                let charge = facilities + mu + nu * c.cqe_per_wqe[i];
                self.curve
                    .bound(c.weight[i], charge, c.hi[i], c.beta_over_hi2[i])
            } else {
                f64::INFINITY
            };
            if settled {
                scan.offer_now(q, bound);
                continue;
            }
            first_by_value.offer(bound, seen.len());
            if first_by_key.n > 0 && bound > first_by_key.threshold() {
                first_by_key.offer((scan.key)(q, bound), seen.len());
            }
            seen.push((bound, q));
        }
        if !settled {
            scan.compute_firsts(&first_by_value, &first_by_key, &mut seen);
        }
        for &(bound, q) in &seen {
            if bound != NOT_OFFERED {
                scan.offer_now(q, bound);
            }
        }
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
/// [`Scan::run`] first finds the `n` best bounds of each query and computes those pairs
/// exactly, which sets each query's threshold (the `n`-th best exact value, or key), and then
/// every other pair whose bound reaches a threshold, raising the thresholds as it goes. A pair
/// left out has a bound below `n` computed values whatever its exact one, so the result does
/// not depend on which pairs were computed.
pub(crate) struct Scan<E, K> {
    pub known: Vec<Exact>,
    exact: E,
    key: K,
    by_value: Best,
    by_key: Best,
}

/// In [`Scan::run`]'s bounds: a pair not offered (or already computed).
pub(crate) const NOT_OFFERED: f64 = f64::NEG_INFINITY;

impl<E: Fn(usize) -> (f64, f64), K: Fn(usize, f64) -> f64> Scan<E, K> {
    pub fn new(exact: E, key: K, by_value: usize, others: &[f64], by_key: usize) -> Self {
        let mut best = Best::new(by_value);
        for &o in others {
            best.offer(o, usize::MAX);
        }
        Self {
            known: Vec::new(),
            exact,
            key,
            by_value: best,
            by_key: Best::new(by_key),
        }
    }

    /// What a bound must reach for its pair to be among either query's best so far
    /// (`key ≤ l ≤ bound`).
    fn threshold(&self) -> f64 {
        self.by_value.threshold().min(self.by_key.threshold())
    }

    /// Computes `pair` if its `bound` can be among either query's best so far.
    #[inline]
    fn offer_now(&mut self, pair: usize, bound: f64) {
        let key_threshold = self.by_key.threshold();
        if bound >= self.by_value.threshold()
            || (bound >= key_threshold && (self.key)(pair, bound) >= key_threshold)
        {
            self.compute(pair);
        }
    }

    /// Computes the pairs of `seen` (`(bound, pair)`) that `firsts` hold the best bounds of,
    /// marking them [`NOT_OFFERED`] there.
    fn compute_firsts(&mut self, by_value: &Best, by_key: &Best, seen: &mut [(f64, usize)]) {
        for &(_, at) in by_value.values.iter().chain(&by_key.values) {
            if seen[at].0 != NOT_OFFERED {
                seen[at].0 = NOT_OFFERED;
                self.compute(seen[at].1);
            }
        }
    }

    fn compute(&mut self, pair: usize) {
        let (l, x) = (self.exact)(pair);
        self.by_value.offer(l, pair);
        self.by_key.offer((self.key)(pair, l), pair);
        self.known.push(Exact { pair, l, x });
    }

    /// Offers pair `start + i` with `bounds[i] ≥` its exact surplus, for every `i`
    /// ([`NOT_OFFERED`]: not offered; `f64::INFINITY`: no bound, so it is always computed), and
    /// computes every pair that can be among either query's best. The bounds are a host's,
    /// in pair order, so the scan reads one contiguous array rather than a list of pairs.
    pub fn run(&mut self, start: usize, bounds: &mut [f64]) {
        let mut first_by_value = Best::new(self.by_value.n);
        let mut first_by_key = Best::new(self.by_key.n);
        for (i, &bound) in bounds.iter().enumerate() {
            if bound == NOT_OFFERED {
                continue;
            }
            first_by_value.offer(bound, i);
            // `key ≤ l`: a bound that does not reach the threshold cannot give a key that does.
            if first_by_key.n > 0 && bound > first_by_key.threshold() {
                first_by_key.offer((self.key)(start + i, bound), i);
            }
        }
        for &(_, i) in first_by_value.values.iter().chain(&first_by_key.values) {
            if bounds[i] != NOT_OFFERED {
                bounds[i] = NOT_OFFERED;
                self.compute(start + i);
            }
        }
        for (i, &bound) in bounds.iter().enumerate() {
            if bound == NOT_OFFERED {
                continue;
            }
            let key_threshold = self.by_key.threshold();
            if bound >= self.by_value.threshold()
                || (bound >= key_threshold && (self.key)(start + i, bound) >= key_threshold)
            {
                self.compute(start + i);
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

    /// The table's bound of host `host`'s pair `pair` at `charge`.
    fn table_bound(table: &BoundTable, host: usize, pair: usize, charge: f64) -> f64 {
        let c = &table.hosts[host];
        let i = c.pair.iter().position(|&q| q as usize == pair).unwrap();
        assert!(
            c.top[i]
                >= table
                    .curve
                    .bound(c.weight[i], charge.max(0.0), c.hi[i], c.beta_over_hi2[i])
        );
        table
            .curve
            .bound(c.weight[i], charge, c.hi[i], c.beta_over_hi2[i])
    }

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
            let table = BoundTable::new(&p);
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
                    let from_table = table_bound(&table, host, pair, charge);
                    assert!(
                        from_table >= l,
                        "α {alpha}, pair {pair}: table {from_table} < {l}"
                    );
                    assert!(
                        from_table <= ub + 1e-6 * ub.abs().max(1.0),
                        "{from_table} > {ub}"
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
            let mut p = generate(&GeneratorConfig {
                k,
                seed,
                ..GeneratorConfig::new(hosts, apps)
            });
            // A pair on no facility, one on two, and hosts whose ranges come in reverse.
            p.pairs[1].uses.clear();
            let f = p.pairs[2].uses[0].0;
            p.pairs[2].uses.push((f + 1, 0.75));
            p.hosts.reverse();
            let p = p;
            let active = initial_active(&p, &vec![0.0; p.facilities.len()]);
            let mut engine = Engine::new(&p, Algorithm::Admm, default_rho(&p), active);
            for _ in 0..8 {
                engine.step();
            }
            let table = BoundTable::new(&p);
            let mut rng = SplitMix64::new(seed);
            let activity: Vec<f32> = (0..p.pairs.len()).map(|_| rng.unit() as f32).collect();
            // The engine's prices, and all below zero (a rounding leaves some a little below).
            let lowered: Vec<f64> = engine.prices().iter().map(|p| -0.5 * p - 0.01).collect();
            for prices in [engine.prices(), lowered] {
                for h in &engine.hosts {
                    let multipliers =
                        [(0.0, 0.0), (h.multipliers.mu, h.multipliers.nu), (3.0, 0.5)];
                    // 1.5: some keys exceed their surplus, and those pairs are always computed.
                    for ((mu, nu), fairness) in multipliers.into_iter().zip([0.02, 1.5, 0.02]) {
                        let with = |pruning: Pruning| {
                            let (prune, table) = match pruning {
                                Pruning::Off => (false, None),
                                Pruning::Pairs => (true, None),
                                Pruning::Table(t) => (true, Some(t)),
                            };
                            let opts = SelectionOptions {
                                prune,
                                fairness,
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
                                    table,
                                    &mut SplitMix64::new(7),
                                ),
                                propose_moves(
                                    &p, h.host, &h.active, price, mu, nu, &activity, &opts, table,
                                    8,
                                ),
                                relax_host(&p, h.host, price, mu, nu, pruning),
                            )
                        };
                        let exhaustive = with(Pruning::Off);
                        for pruning in [Pruning::Pairs, Pruning::Table(table.at(&prices))] {
                            let got = with(pruning);
                            assert_eq!(got, exhaustive, "{hosts}×{apps}, host {}", h.host);
                        }
                    }
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
