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
//! An engine's rounds go further with a [`BoundTable`] built once: each host's pairs in bands
//! of their facility's price when it was built, each band in order of the pair's bound at the
//! band's reference price, which a higher charge only lowers, so a scan stops where those
//! bounds fall below what it still looks for, and never looks at most pairs.

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

    /// A bound of [`Curve::bound`] at every charge from `c` up: the bound at `c` itself, and
    /// for `c > 0` with α = 1 padded by [`LN_UPPER_ERROR`] (at `c = 0` the box's top, `hi`,
    /// is the argmax at every charge that clamps to it, and any other lies a full `w` below).
    fn key(&self, w: f64, c: f64, hi: f64, beta_over_hi2: f64) -> f64 {
        let bound = self.bound(w, c, hi, beta_over_hi2);
        if c > 0.0 && self.log {
            bound + LN_UPPER_ERROR * w.abs()
        } else {
            bound
        }
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
    /// Per band, how far its facilities' prices lie below its reference at most (≤ 0: none).
    pub band_drop: [f64; BANDS],
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

/// Price bands of a [`BoundTable`]: band 0 has reference price 0 (and every pair on no
/// facility or on several); band `j ≥ 1` holds the facilities priced in
/// `[2^(j−BANDS)·p_max, 2^(j+1−BANDS)·p_max)` when the table was built, `p_max` the highest
/// price then, with reference price half its lower edge, so a price may fall by half before
/// the band's bounds need lifting. Eight bands span prices down to `p_max/128`; below that a
/// pair's charge is too small to matter and it stays in band 0.
const BANDS: usize = 9;

/// How far [`ln_upper`] may exceed `ln`: a key at a reference charge above 0 is padded by this
/// much of `w`, since `ln_upper`, made of tangents, is not monotone at their joints and the
/// bound at a higher charge could otherwise come out a hair above the key.
const LN_UPPER_ERROR: f64 = 1.3e-4;

/// Every pair's price-independent part of its bound, per host, in columns grouped by price
/// band ([`BANDS`]) and, within a band, ordered by the pair's bound at the band's reference
/// price (`key`), highest first. A pair's bound only falls as its charge grows, and rises
/// above its key by at most its cap times what its charge lies below the reference, so a
/// host's scan ([`BoundTable::scan_host`]) merges its bands by key plus that lift and stops at
/// the first pair below what the scan still looks for. Ordered by the bound at charge 0
/// instead, a scan read a third of a host's pairs on generated instances, because the apps
/// whose weights give the highest such bound are the ones whose facilities are priced
/// highest. It also reads contiguous columns instead of a `Pair` (56 bytes, its `uses` behind
/// a pointer) per pair, and no longer works out each pair's cap. Built once per engine, at the
/// prices of the round that first needs it, in parallel; the pairs must not change while it
/// is used (an engine borrows its problem), while prices may (a band whose prices fell below
/// its reference is lifted). Figures in docs/benchmarks.md ("Selection at scale").
pub struct BoundTable {
    hosts: Vec<HostColumns>,
    curve: Curve,
    /// Each facility's band, and each band's reference price.
    band_of: Vec<u8>,
    reference: [f64; BANDS],
    /// The largest `Σ b_f`, `a` and cap of any pair: how far a negative charge (prices and
    /// multipliers a rounding below zero) can lift a bound above its `top`.
    max_coeff: f64,
    max_cqe_per_wqe: f64,
    max_hi: f64,
}

/// One host's pairs, band after band, each band in descending order of `key`.
struct HostColumns {
    /// Where each band's rows start, and the end of the last.
    band_start: [u32; BANDS + 1],
    /// Per band, the largest `hi · coeff`: how much a fall of its prices below the reference
    /// can lift a bound, per unit of price.
    band_lift: [f64; BANDS],
    pair: Vec<u32>,
    key: Vec<f64>,
    /// The largest bound at charge 0 from this row to its band's end: what no later pair of
    /// the band can exceed at any charge ≥ 0, however far its prices fell below the
    /// reference (then the banded order is no better than that bound's, and no worse).
    top_after: Vec<f64>,
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
    /// The table for `problem`, banded at facility prices `prices`.
    pub fn new(problem: &Problem, prices: &[f64]) -> Self {
        let p_max = prices.iter().copied().fold(0.0, f64::max);
        let mut reference = [0.0; BANDS];
        for (j, r) in reference.iter_mut().enumerate().skip(1) {
            *r = 0.5 * p_max * 2f64.powi(j as i32 - BANDS as i32);
        }
        let band_of = (prices.iter())
            .map(|&p| {
                if p_max > 0.0 && p > 0.0 {
                    let j = (p / p_max).log2().floor() + BANDS as f64;
                    j.clamp(0.0, (BANDS - 1) as f64) as u8
                } else {
                    0
                }
            })
            .collect();
        let mut table = Self {
            hosts: Vec::new(),
            curve: Curve::new(problem),
            band_of,
            reference,
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
        let mut band_drop = [0.0; BANDS];
        for (&j, &p) in self.band_of.iter().zip(prices) {
            let j = j as usize;
            if j > 0 {
                band_drop[j] = f64::max(band_drop[j], self.reference[j] - p);
            }
        }
        TableAt {
            table: self,
            lowest_price: prices.iter().copied().fold(0.0, f64::min),
            band_drop,
        }
    }

    /// A pair's band: its one facility's, else 0.
    fn band(&self, pair: &crate::model::Pair) -> usize {
        match pair.uses[..] {
            [(f, _)] => self.band_of.get(f as usize).map_or(0, |&j| j as usize),
            _ => 0,
        }
    }

    fn host_columns(&self, problem: &Problem, host: usize) -> HostColumns {
        let beta = problem.params.beta;
        let mut rows: Vec<(usize, f64, usize, f64, f64)> = (problem.hosts[host].pairs.clone())
            .map(|q| {
                let pair = &problem.pairs[q];
                let hi = pair_cap(problem, host, q);
                let band = self.band(pair);
                let charge = self.reference[band] * pair.uses.first().map_or(0.0, |u| u.1);
                let key = self.curve.key(pair.weight, charge, hi, beta / (hi * hi));
                let top = self.curve.bound(pair.weight, 0.0, hi, beta / (hi * hi));
                (band, key, q, hi, top)
            })
            .collect();
        rows.sort_by(|a, b| {
            (a.0.cmp(&b.0))
                .then(b.1.total_cmp(&a.1))
                .then(a.2.cmp(&b.2))
        });
        let n = rows.len();
        let mut c = HostColumns {
            band_start: [n as u32; BANDS + 1],
            band_lift: [0.0; BANDS],
            pair: Vec::with_capacity(n),
            key: Vec::with_capacity(n),
            top_after: vec![f64::NEG_INFINITY; n],
            weight: Vec::with_capacity(n),
            cqe_per_wqe: Vec::with_capacity(n),
            facility: Vec::with_capacity(n),
            coeff: Vec::with_capacity(n),
            hi: Vec::with_capacity(n),
            beta_over_hi2: Vec::with_capacity(n),
        };
        for (j, start) in c.band_start.iter_mut().enumerate().take(BANDS) {
            *start = rows.partition_point(|r| r.0 < j) as u32;
        }
        for i in (0..n).rev() {
            let band_end = c.band_start[rows[i].0 + 1] as usize;
            let after = if i + 1 < band_end {
                c.top_after[i + 1]
            } else {
                f64::NEG_INFINITY
            };
            c.top_after[i] = rows[i].4.max(after);
        }
        for (band, key, q, hi, _) in rows {
            let pair = &problem.pairs[q];
            let (facility, coeff) = match pair.uses[..] {
                [] => (NO_FACILITY, 0.0),
                [(f, b)] if f < SEVERAL_FACILITIES => (f, b),
                // Their `Σ b_f`: what a negative price can take off the charge, per unit.
                _ => (SEVERAL_FACILITIES, pair.uses.iter().map(|u| u.1).sum()),
            };
            // A problem of 2³² pairs would not fit in memory.
            c.pair.push(u32::try_from(q).expect("fewer than 2³² pairs"));
            c.key.push(key);
            c.band_lift[band] = c.band_lift[band].max(hi * coeff);
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
    /// `price` (`lowest_price`: the least of them; `band_drop`: how far each band's prices
    /// lie below its reference at most) and multipliers `(μ, ν)`, in descending order of
    /// their band's `key` plus its lift, stopping once that is below what the scan still
    /// looks for. A charge below the one a key was computed at lifts the bound above it by
    /// at most `hi` per unit: a band's prices below its reference, a negative price in band
    /// 0, a negative multiplier; the stop allows for each. With `all_prunable` false (some
    /// pair's key may exceed its surplus) every pair is offered.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn scan_host<E: Fn(usize) -> (f64, f64), K: Fn(usize, f64) -> f64>(
        &self,
        problem: &Problem,
        host: usize,
        scan: &mut Scan<E, K>,
        (price, lowest_price, band_drop): (impl Fn(u32) -> f64, f64, &[f64; BANDS]),
        (mu, nu): (f64, f64),
        offered: impl Fn(usize) -> bool,
        all_prunable: bool,
    ) {
        let c = &self.hosts[host];
        let lowest_charge = lowest_price.min(0.0) * self.max_coeff
            + mu.min(0.0)
            + nu.min(0.0) * self.max_cqe_per_wqe;
        let lift = -lowest_charge * self.max_hi;
        let band_lift: [f64; BANDS] =
            std::array::from_fn(|j| band_drop[j].max(0.0) * c.band_lift[j]);
        // What no pair from row `i` of band `j` on can exceed: its key lifted, or the bound at
        // charge 0 of the band's rest, whichever is less, and the allowance for negative
        // charges; it never rises along a band, so merging the bands by it visits the rows in
        // an order in which it never rises either.
        let reach = |j: usize, i: usize| {
            let r = f64::min(c.key[i] + band_lift[j], c.top_after[i]);
            r + lift + 1e-12 * r.abs()
        };
        // A band's head: the reach of its row `i`, −∞ past its end.
        let head_at = |j: usize, i: usize| {
            if i < c.band_start[j + 1] as usize {
                reach(j, i)
            } else {
                f64::NEG_INFINITY
            }
        };
        let mut next: [usize; BANDS] = std::array::from_fn(|j| c.band_start[j] as usize);
        let mut head: [f64; BANDS] = std::array::from_fn(|j| head_at(j, next[j]));
        let mut take_next = || {
            let (j, &v) = (head.iter().enumerate()).max_by(|a, b| a.1.total_cmp(b.1))?;
            if v == f64::NEG_INFINITY {
                return None;
            }
            let i = next[j];
            next[j] += 1;
            head[j] = head_at(j, next[j]);
            Some((i, v))
        };
        // As `Scan::run` (the best bounds computed first, then every pair whose bound reaches
        // the thresholds they set), over the pairs up to where `reach` (no pair after can
        // have a higher bound) drops below the best bounds seen — none after can be among
        // them — and then the thresholds.
        let mut seen: Vec<(f64, usize)> = Vec::new();
        let mut first_by_value = Best::new(scan.by_value.n);
        let mut first_by_key = Best::new(scan.by_key.n);
        let mut settled = false;
        while let Some((i, reach)) = take_next() {
            if all_prunable {
                if !settled && reach < first_by_value.threshold().min(first_by_key.threshold()) {
                    settled = true;
                    scan.compute_firsts(&first_by_value, &first_by_key, &mut seen);
                }
                if settled && reach < scan.threshold() {
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

    /// The band of row `i` of a host's columns.
    fn band_of_row(c: &HostColumns, i: usize) -> usize {
        (0..BANDS)
            .find(|&j| i < c.band_start[j + 1] as usize)
            .unwrap()
    }

    /// The table's bound of host `host`'s pair `pair` at `charge`, checked against what a
    /// scan assumes of it: at most the pair's key, lifted by its cap for each unit of charge
    /// below the key's reference charge.
    fn table_bound(table: &BoundTable, host: usize, pair: usize, charge: f64) -> f64 {
        let c = &table.hosts[host];
        let i = c.pair.iter().position(|&q| q as usize == pair).unwrap();
        let band = band_of_row(c, i);
        let reference = table.reference[band] * c.coeff[i];
        let bound = table
            .curve
            .bound(c.weight[i], charge, c.hi[i], c.beta_over_hi2[i]);
        let reach = c.key[i] + c.hi[i] * (reference - charge).max(0.0) + 1e-12 * c.key[i].abs();
        assert!(
            reach >= bound,
            "pair {pair}, band {band}, reference {reference}, charge {charge}: {reach} < {bound}"
        );
        if band > 0 {
            assert!(c.hi[i] * c.coeff[i] <= c.band_lift[band]);
        }
        bound
    }

    /// `ln_upper`'s tangents meet with a fall (up to about 5·10⁻⁶ at some joints), so the
    /// bound at a charge whose rate `w/c` lies just below a joint can exceed the bound at a
    /// lower charge whose rate lies just above it; a key is padded for that.
    #[test]
    fn a_key_covers_the_falls_of_ln_upper_at_its_joints() {
        let p = generate(&GeneratorConfig::new(2, 4));
        let curve = Curve::new(&p);
        let lo = p.params.x_min;
        let (w, hi) = (1.0, 1e6 * lo);
        let mut largest_fall: f64 = 0.0;
        for e in -2..6 {
            for k in 1..LN_SEGMENTS {
                let joint = lo * 2f64.powi(e) * (1.0 + k as f64 / LN_SEGMENTS as f64);
                let (below, above) = (w / (joint * (1.0 - 1e-12)), w / (joint * (1.0 + 1e-12)));
                let at_higher_charge = curve.bound(w, below, hi, 0.0);
                largest_fall = largest_fall.max(at_higher_charge - curve.bound(w, above, hi, 0.0));
                assert!(
                    curve.key(w, above, hi, 0.0) >= at_higher_charge,
                    "joint {joint}"
                );
            }
        }
        assert!(largest_fall > 1e-6, "{largest_fall}");
    }

    /// Prices for a table's bands: a third of the facilities at 0, the rest spread over the
    /// bands.
    fn some_prices(p: &Problem, rng: &mut SplitMix64) -> Vec<f64> {
        (0..p.facilities.len())
            .map(|f| [0.0, rng.range(0.0, 5.0), rng.range(0.0, 500.0)][f % 3])
            .collect()
    }

    /// Every pair's key bounds its bound at charges just above and below its reference
    /// (where the tangents of `ln_upper` meet, the bound at a higher charge can come out a
    /// hair above the bound at the reference), and far from it, at several α.
    #[test]
    fn a_key_bounds_the_pair_at_every_charge() {
        for alpha in [0.5, 1.0, 2.0] {
            let p = generate(&GeneratorConfig {
                alpha,
                seed: 5,
                ..GeneratorConfig::new(3, 400)
            });
            let mut rng = SplitMix64::new(2);
            let table = BoundTable::new(&p, &some_prices(&p, &mut rng));
            let mut banded = 0;
            for (host, c) in table.hosts.iter().enumerate() {
                banded += c.pair.len() - c.band_start[1] as usize;
                for i in 0..c.pair.len() {
                    let pair = c.pair[i] as usize;
                    let j = band_of_row(c, i);
                    let reference = table.reference[j] * c.coeff[i];
                    for factor in [
                        0.0,
                        0.5,
                        0.999,
                        1.0,
                        1.0 + 1e-12,
                        1.0 + 1e-7,
                        1.001,
                        1.1,
                        3.0,
                    ] {
                        table_bound(&table, host, pair, reference * factor);
                    }
                    for _ in 0..20 {
                        let charge = reference * rng.range(0.9, 1.5) + rng.range(0.0, 1e-3);
                        table_bound(&table, host, pair, charge);
                    }
                }
            }
            // Most pairs are on priced facilities, so most keys are at a reference above 0.
            assert!(banded > p.pairs.len() / 2, "α {alpha}: {banded} banded");
        }
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
            let mut rng = SplitMix64::new(9);
            let table = BoundTable::new(&p, &some_prices(&p, &mut rng));
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
            // Tables banded at the engine's prices, at prices well above them (every band's
            // prices then lie below its reference, and its bounds are lifted), and at none.
            let higher: Vec<f64> = engine.prices().iter().map(|p| 3.0 * p + 1.0).collect();
            let tables = [
                BoundTable::new(&p, &engine.prices()),
                BoundTable::new(&p, &higher),
                BoundTable::new(&p, &vec![0.0; p.facilities.len()]),
            ];
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
                        let banded = tables.iter().map(|t| Pruning::Table(t.at(&prices)));
                        for pruning in std::iter::once(Pruning::Pairs).chain(banded) {
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
