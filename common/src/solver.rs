//! The in-process solver: top-k selection rounds around an inner algorithm (sharing ADMM, or the
//! baselines: dual decomposition and NUMFabric's xWI), hosts in parallel with rayon. The same host and coordinator
//! steps run over the network in drum-agent / drum-coordinator.

use crate::admm::{accumulate, Contribution, CoordinatorState, HostState, Residuals};
use crate::certificate::facility_bound;
pub use crate::certificate::refine_bound;
use crate::dual::{DualState, DualStep};
use crate::lossy::{Loss, LossyChannel};
use crate::max_min::weighted_max_min;
use crate::model::Problem;
use crate::polish::polish;
pub use crate::polish::PolishReport;
use crate::pruning::{BoundTable, Pruning};
use crate::rng::SplitMix64;
use crate::selection::{evaluate_host, initial_active, SelectionOptions};
pub use crate::trace::{fixed_set_trace, iterations_to_accuracy, lossy_fixed_set_trace};
use crate::xwi::{least_residuals, HostReport, XwiState};
use rayon::prelude::*;
use std::sync::{Arc, OnceLock};

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Algorithm {
    Admm,
    Dual(DualStep),
    /// NUMFabric's price iteration over weighted max-min rates ([`crate::xwi`]).
    Xwi,
}

impl Algorithm {
    pub fn name(&self) -> &'static str {
        match self {
            Algorithm::Admm => "admm",
            Algorithm::Dual(DualStep::Paper) => "dual-paper-step",
            Algorithm::Dual(DualStep::Normalised { .. }) => "dual",
            Algorithm::Xwi => "xwi",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SolveOptions {
    pub algorithm: Algorithm,
    /// ADMM penalty; `None` applies the default rule ([`default_rho`]).
    pub rho: Option<f64>,
    /// Cap on inner iterations in total.
    pub max_iter: usize,
    /// Cap on inner iterations between two selection rounds.
    pub iters_per_round: usize,
    /// Selection rounds (0: none; with `polish_trials` 0 too the initial active sets stay).
    pub rounds: usize,
    pub eps_primal: f64,
    pub eps_dual: f64,
    pub selection: SelectionOptions,
    /// Choose the initial active sets twice: greedily at zero prices, then again at half the
    /// prices `iters_per_round` iterations on the first sets produced (docs/model.md).
    pub priced_start: bool,
    /// Subgradient steps on the relaxed dual that tighten the final certificate (0: no
    /// refinement at all, sweeps included).
    pub certificate_iters: usize,
    /// Most sweeps of the certificate's coordinate descent after its subgradient steps
    /// (0: none).
    pub certificate_sweeps: usize,
    /// Verified local search after the swap rounds ([`polish`]): at most this many trial
    /// re-solves (0: none).
    pub polish_trials: usize,
    /// Moves each host proposes per step of the local search.
    pub polish_candidates: usize,
    /// Cap on the ADMM iterations of one trial re-solve.
    pub polish_iters: usize,
}

impl Default for SolveOptions {
    fn default() -> Self {
        Self {
            algorithm: Algorithm::Admm,
            rho: None,
            max_iter: 1000,
            iters_per_round: 20,
            rounds: 10,
            eps_primal: 1e-4,
            eps_dual: 1e-4,
            selection: SelectionOptions::default(),
            priced_start: true,
            certificate_iters: 30,
            certificate_sweeps: 10,
            polish_trials: 128,
            polish_candidates: 8,
            polish_iters: 50,
        }
    }
}

/// One inner iteration, for traces and plots.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TraceRow {
    pub iteration: usize,
    pub round: usize,
    pub objective: f64,
    pub primal_residual: f64,
    pub dual_residual: f64,
}

/// The certificate after one selection round.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RoundReport {
    pub round: usize,
    pub iterations: usize,
    /// Activation value of a feasible allocation (the LB).
    pub lower_bound: f64,
    /// Weak-duality upper bound on the activation value over all active sets.
    pub upper_bound: f64,
    pub swaps: usize,
}

impl RoundReport {
    pub fn gap(&self) -> f64 {
        (self.upper_bound - self.lower_bound).max(0.0)
    }

    pub fn relative_gap(&self) -> f64 {
        self.gap() / self.lower_bound.abs().max(f64::MIN_POSITIVE)
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct Solution {
    pub algorithm: Algorithm,
    pub iterations: usize,
    pub converged: bool,
    /// `Σ U(x) − Σ G(y)` of the returned (feasible) allocation.
    pub objective: f64,
    /// The certified gap of the last round (activation value units = objective units).
    pub gap: f64,
    pub relative_gap: f64,
    pub primal_residual: f64,
    pub prices: Vec<f64>,
    /// Per host: active pairs and their feasible rates.
    pub hosts: Vec<HostState>,
    pub rounds: Vec<RoundReport>,
    pub trace: Vec<TraceRow>,
    pub polish: PolishReport,
}

impl Solution {
    pub fn upper_bound(&self) -> f64 {
        self.objective + self.gap
    }
}

/// Multiple of the median curvature that makes the default penalty (docs/model.md).
pub const RHO_FACTOR: f64 = 10.0;

/// The default ADMM penalty: [`RHO_FACTOR`] times the median curvature `|U''|/b²` of the pairs
/// at their fair share `min(x̄, Q/k, Y_f/b)`. One rule for every instance; docs/model.md says how it
/// was chosen.
pub fn default_rho(problem: &Problem) -> f64 {
    let mut curv: Vec<f64> = Vec::new();
    let stride = (problem.pairs.len() / 100_000).max(1);
    for (hi, h) in problem.hosts.iter().enumerate() {
        let fair = h.wqe_budget / problem.slots(hi).max(1) as f64;
        for p in h.pairs.clone().step_by(stride) {
            let pair = &problem.pairs[p];
            let b2 = pair.coeff_norm2();
            if b2 == 0.0 {
                continue;
            }
            let alone = pair.alone_cap(&problem.facilities);
            let x = fair.min(pair.demand).min(alone).max(problem.params.x_min);
            curv.push(-problem.utility(pair).d2(x) / b2);
        }
    }
    if curv.is_empty() {
        return 1.0;
    }
    let mid = curv.len() / 2;
    RHO_FACTOR * *curv.select_nth_unstable_by(mid, f64::total_cmp).1
}

/// A typical marginal utility, the scale of the normalised dual step.
pub fn price_reference(problem: &Problem) -> f64 {
    let rho = default_rho(problem);
    let h = &problem.hosts[0];
    rho / RHO_FACTOR * h.wqe_budget / problem.slots(0).max(1) as f64
}

/// The inner algorithm's state.
#[derive(Clone)]
enum Inner {
    Admm(CoordinatorState),
    Dual(DualState),
    Xwi(XwiState),
}

impl Inner {
    fn new(algorithm: Algorithm, rho: f64, facilities: usize) -> Self {
        match algorithm {
            Algorithm::Admm => Inner::Admm(CoordinatorState::new(rho, facilities)),
            Algorithm::Dual(step) => Inner::Dual(DualState::new(step, facilities)),
            Algorithm::Xwi => Inner::Xwi(XwiState::new(facilities)),
        }
    }

    fn price(&self, f: u32) -> f64 {
        match self {
            Inner::Admm(c) => c.price(f),
            Inner::Dual(d) => d.prices[f as usize],
            Inner::Xwi(x) => x.prices[f as usize],
        }
    }
}

/// What the coordinator holds of each host when updates can be lost ([`crate::lossy`]).
#[derive(Clone)]
enum Held {
    Contributions(LossyChannel<Contribution>),
    /// xWI's hosts report weights and multipliers; the rates follow from all weights.
    Reports(LossyChannel<HostReport>),
}

fn report(h: &HostState) -> HostReport {
    HostReport {
        weights: h.x.clone(),
        multipliers: h.multipliers,
    }
}

/// Inner algorithm plus host states: everything one iteration touches.
#[derive(Clone)]
pub struct Engine<'p> {
    problem: &'p Problem,
    inner: Inner,
    pub hosts: Vec<HostState>,
    sums: Vec<f64>,
    held: Option<Held>,
    /// Built at the first pruned selection round, shared by the engine's clones: the tables
    /// of bounds in the charge-free order (for the search and the certificate, which move
    /// prices far from any one round's) and banded at the first round's prices (for the
    /// rounds; [`Engine::round_table`]).
    bound_table: Arc<OnceLock<BoundTable>>,
    round_table: Arc<OnceLock<BoundTable>>,
}

impl<'p> Engine<'p> {
    /// Starts from the given active sets, every host at its best response to zero prices.
    pub fn new(
        problem: &'p Problem,
        algorithm: Algorithm,
        rho: f64,
        active: Vec<Vec<usize>>,
    ) -> Self {
        let mut hosts: Vec<HostState> = active
            .into_iter()
            .enumerate()
            .map(|(i, a)| HostState::new(problem, i, a))
            .collect();
        let contributions: Vec<Contribution> = hosts
            .par_iter_mut()
            .map(|h| h.priced_step(problem, |_| 0.0))
            .collect();
        let mut sums = vec![0.0; problem.facilities.len()];
        accumulate(&mut sums, &contributions);
        let mut inner = Inner::new(algorithm, rho, problem.facilities.len());
        if let Inner::Admm(c) = &mut inner {
            c.set_counts(&active_counts(problem, &hosts));
            c.update(&problem.facilities, &sums, None);
        }
        Self {
            problem,
            inner,
            hosts,
            sums,
            held: None,
            bound_table: Arc::default(),
            round_table: Arc::default(),
        }
    }

    /// The same engine with each host's update lost with `loss.probability` per iteration, the
    /// coordinator using that host's last delivered one ([`crate::lossy`]).
    pub fn with_loss(mut self, loss: Loss) -> Self {
        self.held = Some(match self.inner {
            Inner::Xwi(_) => Held::Reports(LossyChannel::new(
                loss,
                self.hosts.iter().map(report).collect(),
            )),
            _ => Held::Contributions(LossyChannel::new(
                loss,
                self.hosts
                    .iter()
                    .map(|h| h.contribution(self.problem))
                    .collect(),
            )),
        });
        self
    }

    /// Host updates lost so far (0 without loss).
    pub fn lost(&self) -> u64 {
        match &self.held {
            None => 0,
            Some(Held::Contributions(c)) => c.lost(),
            Some(Held::Reports(c)) => c.lost(),
        }
    }

    /// Starts from a previous allocation and its prices (after an instance's numbers changed, or
    /// to continue a solve): hosts keep their active sets, rates and multipliers, facilities their
    /// prices. At a converged previous solution the first step's `d` is then exactly `π/ρ`.
    pub fn warm(
        problem: &'p Problem,
        algorithm: Algorithm,
        rho: f64,
        hosts: Vec<HostState>,
        prices: &[f64],
    ) -> Self {
        let contributions: Vec<Contribution> =
            hosts.iter().map(|h| h.contribution(problem)).collect();
        let mut sums = vec![0.0; problem.facilities.len()];
        accumulate(&mut sums, &contributions);
        let inner = match Inner::new(algorithm, rho, problem.facilities.len()) {
            Inner::Admm(mut c) => {
                c.set_counts(&active_counts(problem, &hosts));
                for ((st, spec), (&s, &price)) in c
                    .facilities
                    .iter_mut()
                    .zip(&problem.facilities)
                    .zip(sums.iter().zip(prices))
                {
                    st.s = s;
                    st.y = s.clamp(0.0, spec.capacity);
                    if st.n > 0 {
                        st.u = price * st.n as f64 / rho;
                    }
                }
                Inner::Admm(c)
            }
            Inner::Dual(mut d) => {
                d.prices.copy_from_slice(prices);
                Inner::Dual(d)
            }
            Inner::Xwi(mut x) => {
                x.prices.copy_from_slice(prices);
                Inner::Xwi(x)
            }
        };
        Self {
            problem,
            inner,
            hosts,
            sums,
            held: None,
            bound_table: Arc::default(),
            round_table: Arc::default(),
        }
    }

    pub fn price(&self, f: u32) -> f64 {
        self.inner.price(f)
    }

    pub fn prices(&self) -> Vec<f64> {
        (0..self.problem.facilities.len() as u32)
            .map(|f| self.price(f))
            .collect()
    }

    /// One inner iteration: all host steps in parallel, the Allreduce, the coordinator step.
    pub fn step(&mut self) -> Residuals {
        let problem = self.problem;
        let fresh: Vec<Contribution> = match &self.inner {
            Inner::Admm(c) => self
                .hosts
                .par_iter_mut()
                .map(|h| h.admm_step(problem, |f| c.term(f)))
                .collect(),
            Inner::Dual(d) => self
                .hosts
                .par_iter_mut()
                .map(|h| h.priced_step(problem, |f| d.prices[f as usize]))
                .collect(),
            Inner::Xwi(_) => return self.xwi_step(),
        };
        let delivered = match &mut self.held {
            Some(Held::Contributions(channel)) => channel.deliver(fresh),
            _ => &fresh,
        };
        self.sums.iter_mut().for_each(|s| *s = 0.0);
        accumulate(&mut self.sums, delivered);
        match &mut self.inner {
            Inner::Admm(c) => c.update(&problem.facilities, &self.sums, None),
            Inner::Xwi(_) => unreachable!("xWI steps in xwi_step"),
            Inner::Dual(d) => {
                let dual = d.update(&problem.facilities, &self.sums);
                Residuals {
                    primal: excess_norm(problem, &self.sums),
                    dual,
                }
            }
        }
    }

    /// One xWI iteration: best responses are the weights, the rates their weighted max-min
    /// allocation (always feasible), then the price update from the least residuals.
    fn xwi_step(&mut self) -> Residuals {
        let problem = self.problem;
        let Inner::Xwi(state) = &mut self.inner else {
            unreachable!("an xWI engine")
        };
        let prices = &state.prices;
        self.hosts.par_iter_mut().for_each(|h| {
            h.priced_step(problem, |f| prices[f as usize]);
        });
        let fresh: Vec<HostReport> = self.hosts.iter().map(report).collect();
        let reports = match &mut self.held {
            Some(Held::Reports(channel)) => channel.deliver(fresh),
            _ => &fresh,
        };
        let active: Vec<&[usize]> = self.hosts.iter().map(|h| h.active.as_slice()).collect();
        let weights: Vec<&[f64]> = reports.iter().map(|r| r.weights.as_slice()).collect();
        let rates = weighted_max_min(problem, &active, &weights);
        let least = least_residuals(
            problem,
            &active,
            &rates.iter().map(Vec::as_slice).collect::<Vec<_>>(),
            reports,
            prices,
        );
        for (h, x) in self.hosts.iter_mut().zip(rates) {
            h.x = x;
        }
        self.sums.iter_mut().for_each(|s| *s = 0.0);
        accumulate(
            &mut self.sums,
            &self
                .hosts
                .iter()
                .map(|h| h.contribution(problem))
                .collect::<Vec<_>>(),
        );
        let dual = state.update(&problem.facilities, &self.sums, &least);
        Residuals {
            primal: excess_norm(problem, &self.sums),
            dual,
        }
    }

    /// `Σ U(x) − Σ G(s)` of the current (possibly slightly infeasible) iterate.
    pub fn objective(&self) -> f64 {
        objective(self.problem, &self.hosts)
    }

    /// Facility sums of the current iterate.
    pub fn sums(&self) -> &[f64] {
        &self.sums
    }

    pub fn problem(&self) -> &'p Problem {
        self.problem
    }

    /// With `prune`, the table selection bounds this engine's pairs from in the charge-free
    /// order (one band; built the first time).
    pub fn bound_table(&self, prune: bool) -> Option<&BoundTable> {
        prune.then(|| {
            self.bound_table.get_or_init(|| {
                BoundTable::new(self.problem, &vec![0.0; self.problem.facilities.len()])
            })
        })
    }

    /// With `prune`, the table the selection rounds bound this engine's pairs from: banded
    /// at the prices of the first round that needs it. The search and the certificate keep
    /// the charge-free order ([`Engine::bound_table`]): at the prices they move to, bands
    /// drawn at a round's prices cost more than they save (docs/model.md, "Bands of price").
    pub fn round_table(&self, prune: bool) -> Option<&BoundTable> {
        prune.then(|| {
            self.round_table
                .get_or_init(|| BoundTable::new(self.problem, &self.prices()))
        })
    }

    /// Per facility, what its active members use at `x_min`.
    pub fn floor_usage(&self) -> Vec<f64> {
        let problem = self.problem;
        let mut floor = vec![0.0; problem.facilities.len()];
        for h in &self.hosts {
            for &p in &h.active {
                for &(f, b) in &problem.pairs[p].uses {
                    floor[f as usize] += b * problem.params.x_min;
                }
            }
        }
        floor
    }

    /// Applies a selection round's swaps; returns how many were applied.
    pub(crate) fn apply_swaps(&mut self, swaps: Vec<(usize, crate::selection::Swap)>) -> usize {
        let problem = self.problem;
        let x_min = problem.params.x_min;
        // Floor usage per facility: a pair may join only if each of its facilities can still
        // carry every member at x_min, so the feasible projection always exists.
        let mut floor = self.floor_usage();
        let mut applied = 0;
        for (host, swap) in swaps {
            let h = &mut self.hosts[host];
            if let Some(out) = swap.park {
                let pos = h
                    .active
                    .iter()
                    .position(|&p| p == out)
                    .expect("parked pair is active");
                h.active.remove(pos);
                h.x.remove(pos);
                for &(f, b) in &problem.pairs[out].uses {
                    floor[f as usize] -= b * x_min;
                }
            }
            if let Some((inp, x)) = swap.activate {
                let uses = &problem.pairs[inp].uses;
                let fits = uses.iter().all(|&(f, b)| {
                    floor[f as usize] + b * x_min <= problem.facilities[f as usize].capacity
                });
                if fits {
                    for &(f, b) in uses {
                        floor[f as usize] += b * x_min;
                    }
                    let pos = h.active.partition_point(|&p| p < inp);
                    h.active.insert(pos, inp);
                    h.x.insert(pos, x);
                }
            }
            applied += 1;
        }
        let contributions: Vec<Contribution> =
            self.hosts.iter().map(|h| h.contribution(problem)).collect();
        self.sums.iter_mut().for_each(|s| *s = 0.0);
        accumulate(&mut self.sums, &contributions);
        if let Inner::Admm(c) = &mut self.inner {
            c.set_counts(&active_counts(problem, &self.hosts));
            c.set_sums(&self.sums);
        }
        // Every host contributes for its new sets (the sums above are fresh).
        match &mut self.held {
            Some(Held::Contributions(c)) => c.reset(contributions),
            Some(Held::Reports(c)) => c.reset(self.hosts.iter().map(report).collect()),
            None => {}
        }
        applied
    }
}

fn active_counts(problem: &Problem, hosts: &[HostState]) -> Vec<u32> {
    let mut n = vec![0u32; problem.facilities.len()];
    for h in hosts {
        for &p in &h.active {
            for &(f, _) in &problem.pairs[p].uses {
                n[f as usize] += 1;
            }
        }
    }
    n
}

/// `‖(s − Y)⁺‖ / (1 + ‖Y‖)`: how far facility usage exceeds capacity.
fn excess_norm(problem: &Problem, sums: &[f64]) -> f64 {
    let (mut e2, mut y2) = (0.0, 0.0);
    for (f, &s) in problem.facilities.iter().zip(sums) {
        e2 += (s - f.capacity).max(0.0).powi(2);
        y2 += f.capacity * f.capacity;
    }
    e2.sqrt() / (1.0 + y2.sqrt())
}

/// `Σ U(x) − Σ G(s)` of an allocation.
pub fn objective(problem: &Problem, hosts: &[HostState]) -> f64 {
    let mut sums = vec![0.0; problem.facilities.len()];
    let mut total = 0.0;
    for h in hosts {
        for (&p, &x) in h.active.iter().zip(&h.x) {
            let pair = &problem.pairs[p];
            total += problem.utility(pair).value(x);
            for &(f, b) in &pair.uses {
                sums[f as usize] += b * x;
            }
        }
    }
    total
        - problem
            .facilities
            .iter()
            .zip(&sums)
            .map(|(f, &s)| f.cost_of(s))
            .sum::<f64>()
}

/// `Σ V(x)`, the activation value of an allocation (what selection maximises, docs/model.md).
pub fn activation_value(problem: &Problem, hosts: &[HostState]) -> f64 {
    objective(problem, hosts) - activation_offset(problem, hosts)
}

/// `Σ_active U(x) − V(x)`: the constant between objective and activation value.
fn activation_offset(problem: &Problem, hosts: &[HostState]) -> f64 {
    hosts
        .iter()
        .flat_map(|h| h.active.iter())
        .map(|&p| problem.utility(&problem.pairs[p]).activation_offset())
        .sum()
}

/// The allocation made feasible: in each facility whose usage exceeds its capacity, every
/// member's rate above `x_min` shrinks by the same factor (a pair of several facilities by the
/// smallest of theirs, which only lowers the others' usage), so host budgets and boxes still hold.
pub fn feasible(problem: &Problem, hosts: &[HostState]) -> Vec<HostState> {
    let x_min = problem.params.x_min;
    let (mut floor, mut above) = (
        vec![0.0; problem.facilities.len()],
        vec![0.0; problem.facilities.len()],
    );
    for h in hosts {
        for (&p, &x) in h.active.iter().zip(&h.x) {
            for &(f, b) in &problem.pairs[p].uses {
                floor[f as usize] += b * x_min;
                above[f as usize] += b * (x - x_min);
            }
        }
    }
    let theta: Vec<f64> = problem
        .facilities
        .iter()
        .enumerate()
        .map(|(f, spec)| {
            if floor[f] + above[f] <= spec.capacity || above[f] <= 0.0 {
                1.0
            } else {
                ((spec.capacity - floor[f]) / above[f]).clamp(0.0, 1.0)
            }
        })
        .collect();
    hosts
        .iter()
        .map(|h| {
            let mut out = h.clone();
            for (&p, x) in out.active.iter().zip(out.x.iter_mut()) {
                let t = problem.pairs[p]
                    .uses
                    .iter()
                    .map(|&(f, _)| theta[f as usize])
                    .fold(1.0, f64::min);
                *x = x_min + (*x - x_min) * t;
            }
            out
        })
        .collect()
}

/// Runs the inner algorithm until both residuals are small or `budget` iterations pass.
pub(crate) fn run_inner(
    engine: &mut Engine,
    budget: usize,
    opts: &SolveOptions,
    round: usize,
    trace: &mut Vec<TraceRow>,
) -> bool {
    for _ in 0..budget {
        let r = engine.step();
        trace.push(TraceRow {
            iteration: trace.len() + 1,
            round,
            objective: engine.objective(),
            primal_residual: r.primal,
            dual_residual: r.dual,
        });
        if r.primal <= opts.eps_primal && r.dual <= opts.eps_dual {
            return true;
        }
    }
    false
}

/// Evaluates every host at current prices (one selection round's work); returns the
/// weak-duality bound and the proposed swaps.
pub fn evaluate(
    engine: &Engine,
    activity: &[f32],
    opts: &SelectionOptions,
    round: usize,
) -> (f64, Vec<(usize, crate::selection::Swap)>) {
    let problem = engine.problem;
    let prices = engine.prices();
    let table = engine.round_table(opts.prune).map(|t| t.at(&prices));
    let evals: Vec<_> = engine
        .hosts
        .par_iter()
        .map(|h| {
            let mut rng = SplitMix64::fork(opts.seed ^ (round as u64) << 32, h.host as u64);
            let e = evaluate_host(
                problem,
                h.host,
                &h.active,
                |f| prices[f as usize],
                h.multipliers.mu,
                h.multipliers.nu,
                activity,
                opts,
                table,
                &mut rng,
            );
            (h.host, e)
        })
        .collect();
    let facility_part = facility_bound(problem, &prices);
    let bound = facility_part + evals.iter().map(|(_, e)| e.bound).sum::<f64>();
    let swaps = evals
        .into_iter()
        .filter_map(|(h, e)| e.swap.map(|s| (h, s)))
        .collect();
    (bound, swaps)
}

/// Solves with selection rounds (see the module docs of `selection`).
pub fn solve(problem: &Problem, opts: &SolveOptions) -> Solution {
    let mut prices = vec![0.0; problem.facilities.len()];
    let mut active = initial_active(problem, &prices);
    if opts.priced_start {
        let rho = opts.rho.unwrap_or_else(|| default_rho(problem));
        let mut engine = Engine::new(problem, opts.algorithm, rho, active);
        for _ in 0..opts.iters_per_round {
            engine.step();
        }
        // Half the prices: the first sets overload some facilities, and at full prices every
        // host would flee them at once.
        for (p, q) in prices.iter_mut().zip(engine.prices()) {
            *p = 0.5 * q;
        }
        active = initial_active(problem, &prices);
    }
    solve_from(problem, active, opts)
}

/// Solves starting from the given active sets.
pub fn solve_from(problem: &Problem, active: Vec<Vec<usize>>, opts: &SolveOptions) -> Solution {
    let rho = opts.rho.unwrap_or_else(|| default_rho(problem));
    run_rounds(
        problem,
        Engine::new(problem, opts.algorithm, rho, active),
        opts,
    )
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum WarmStartError {
    #[error("the previous solution has {previous} hosts, the instance {now}")]
    Hosts { previous: usize, now: usize },
    #[error("host {host:?}: the previous solution's active pair {pair} is not one of its apps")]
    Pair { host: String, pair: usize },
    #[error("the previous solution has {previous} facility prices, the instance {now} facilities")]
    Prices { previous: usize, now: usize },
}

/// Solves warm-started from `previous`, a solution of an instance with the same hosts, apps and
/// facilities whose numbers (weights, demands, budgets, capacities) may since have changed.
pub fn solve_warm(
    problem: &Problem,
    previous: &Solution,
    opts: &SolveOptions,
) -> Result<Solution, WarmStartError> {
    if previous.hosts.len() != problem.hosts.len() {
        return Err(WarmStartError::Hosts {
            previous: previous.hosts.len(),
            now: problem.hosts.len(),
        });
    }
    if previous.prices.len() != problem.facilities.len() {
        return Err(WarmStartError::Prices {
            previous: previous.prices.len(),
            now: problem.facilities.len(),
        });
    }
    for (i, h) in previous.hosts.iter().enumerate() {
        let host = &problem.hosts[i];
        if let Some(&pair) = h
            .active
            .iter()
            .find(|&&p| h.host != i || !host.pairs.contains(&p))
        {
            return Err(WarmStartError::Pair {
                host: host.id.clone(),
                pair,
            });
        }
    }
    let rho = opts.rho.unwrap_or_else(|| default_rho(problem));
    let mut hosts = previous.hosts.clone();
    for h in &mut hosts {
        // Demands may have shrunk below a previous rate; the x-step expects its guess in the box.
        for (&p, x) in h.active.iter().zip(h.x.iter_mut()) {
            *x = x.clamp(problem.params.x_min, problem.pairs[p].demand);
        }
    }
    let engine = Engine::warm(problem, opts.algorithm, rho, hosts, &previous.prices);
    Ok(run_rounds(problem, engine, opts))
}

/// Selection rounds, each after up to `iters_per_round` inner iterations, then the inner
/// algorithm to convergence; the certificate at the end.
fn run_rounds(problem: &Problem, mut engine: Engine, opts: &SolveOptions) -> Solution {
    let mut activity = vec![0.0f32; problem.pairs.len()];
    let mut trace = Vec::new();
    let mut rounds = Vec::new();
    let mut converged = false;
    for round in 0..=opts.rounds {
        let budget = if round == opts.rounds {
            opts.max_iter.saturating_sub(trace.len())
        } else {
            opts.iters_per_round
                .min(opts.max_iter.saturating_sub(trace.len()))
        };
        converged = run_inner(&mut engine, budget, opts, round, &mut trace);
        let selecting = round < opts.rounds;
        let sel = SelectionOptions {
            swap_prob: if selecting {
                opts.selection.swap_prob
            } else {
                0.0
            },
            ..opts.selection
        };
        let (upper_bound, swaps) = evaluate(&engine, &activity, &sel, round);
        let feasible_hosts = feasible(problem, &engine.hosts);
        let lower_bound =
            objective(problem, &feasible_hosts) - activation_offset(problem, &feasible_hosts);
        let swaps_n = swaps.len();
        if selecting {
            decay_activity(&mut activity, &engine.hosts, opts.selection.discount);
            engine.apply_swaps(swaps);
        }
        rounds.push(RoundReport {
            round,
            iterations: trace.len(),
            lower_bound,
            upper_bound,
            swaps: if selecting { swaps_n } else { 0 },
        });
    }
    let polish_report = if opts.polish_trials > 0 {
        polish(&mut engine, &activity, opts)
    } else {
        PolishReport::default()
    };
    if polish_report.moves > 0 {
        // The schedule's last round certified other sets: certify these. The earlier bound
        // stays valid (any prices give one), so the least of the two is kept.
        let budget = opts.max_iter.saturating_sub(trace.len());
        converged = run_inner(&mut engine, budget, opts, opts.rounds, &mut trace) || converged;
        let settled = SelectionOptions {
            swap_prob: 0.0,
            ..opts.selection
        };
        let (upper_bound, _) = evaluate(&engine, &activity, &settled, opts.rounds);
        let last = rounds.last_mut().expect("at least one round");
        last.lower_bound = activation_value(problem, &feasible(problem, &engine.hosts));
        last.upper_bound = last.upper_bound.min(upper_bound);
        last.iterations = trace.len();
    }
    if opts.certificate_iters > 0 {
        let lower = rounds.last().expect("at least one round").lower_bound;
        let refined = refine_bound(
            problem,
            &engine.hosts,
            &engine.prices(),
            lower,
            (opts.certificate_iters, opts.certificate_sweeps),
            Pruning::new(
                opts.selection.prune,
                engine
                    .bound_table(opts.selection.prune)
                    .map(|t| t.at(&engine.prices())),
            ),
        );
        let last = rounds.last_mut().expect("at least one round");
        last.upper_bound = last.upper_bound.min(refined);
    }
    let last = *rounds.last().expect("at least one round");
    let hosts = feasible(problem, &engine.hosts);
    let primal_residual = trace.last().map_or(0.0, |t| t.primal_residual);
    Solution {
        algorithm: opts.algorithm,
        iterations: trace.len(),
        converged,
        objective: objective(problem, &hosts),
        gap: last.gap(),
        relative_gap: last.relative_gap(),
        primal_residual,
        prices: engine.prices(),
        hosts,
        rounds,
        trace,
        polish: polish_report,
    }
}

fn decay_activity(activity: &mut [f32], hosts: &[HostState], discount: f64) {
    let d = discount as f32;
    activity.par_iter_mut().for_each(|a| *a *= d);
    for h in hosts {
        for &p in &h.active {
            activity[p] += 1.0 - d;
        }
    }
}
