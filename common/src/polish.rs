//! Verified local search over active sets, run after the damped swap rounds (docs/model.md,
//! "Selection"). Hosts propose moves — park a member, activate an outsider, or exchange the
//! two — ranked by the surplus their prices predict; the coordinator checks the most promising
//! one by re-solving the allocation with the move applied, warm-started from the current one,
//! and keeps it only if the feasible activation value rises. The first move that passes is
//! applied and every host proposes again at the new prices; when no proposal passes, the sets
//! are a fixed point: a further search on the same instance changes nothing.
//!
//! Surpluses are a first-order estimate taken at prices that the move itself changes, so
//! trusting them (as the swap rounds must, to stay cheap and distributed) swaps apps on a
//! shared facility back and forth and ends several per cent below the best sets on small
//! instances (docs/benchmarks.md). Checking every move against a re-solve makes each applied
//! change an improvement of the objective, which is also what justifies its QP-cache refill.

use crate::model::Problem;
use crate::selection::{propose_moves, Move};
use crate::solver::{activation_value, feasible, Engine, SolveOptions};
use rayon::prelude::*;

/// Residuals a trial re-solve runs to: the compared values must be accurate well below the
/// margin.
const TRIAL_EPS: f64 = 1e-6;
/// Relative rise of the activation value a move must bring: above a trial's remaining error,
/// so that a repeated search does not accept noise and the fixed point holds.
const MARGIN: f64 = 1e-5;

/// What the verified local search did.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PolishReport {
    /// Trial re-solves run.
    pub trials: usize,
    /// Moves applied (each one QP-cache refill at most per host it touches).
    pub moves: usize,
    /// ADMM iterations of all trials together (the applied ones included).
    pub iterations: usize,
    /// The search ended because no proposal improved, not because the trial budget ran out.
    pub settled: bool,
}

/// A trial is given up once its value is this far (relative) below the value it must beat,
/// beyond [`STILL_TO_RISE`] times what its last [`CHECK_EVERY`] iterations moved it: the
/// value rises as a trial settles, by less each check, so such a trial cannot recover in the
/// iterations left, and they are not spent on it (at 1000 × 5000: 50 of 128 trials given up,
/// none that would have been kept; docs/model.md, "Selection").
const HOPELESS: f64 = 10.0 * MARGIN;
const STILL_TO_RISE: f64 = 4.0;
/// Iterations before a trial's value is first compared, and between comparisons.
const FIRST_CHECK: usize = 10;
const CHECK_EVERY: usize = 5;

/// The activation value of the engine's feasible allocation.
fn value(engine: &Engine) -> f64 {
    let problem = engine.problem();
    activation_value(problem, &feasible(problem, &engine.hosts))
}

/// Runs the engine until both residuals and the objective's relative change are within
/// [`TRIAL_EPS`], or `cap` iterations pass, or (with `bar`, the value a trial must beat) the
/// trial is hopeless; returns the activation value of its feasible allocation and the
/// iterations run. The objective's change is part of the test because the residuals alone
/// can vanish right after a move: a facility a pair just entered has `y = s` after one update
/// whatever the rates still have to travel.
fn settle(engine: &mut Engine, cap: usize, bar: Option<f64>) -> (f64, usize) {
    let mut iterations = 0;
    let mut last = engine.objective();
    let mut checked: Option<f64> = None;
    while iterations < cap {
        iterations += 1;
        let r = engine.step();
        let now = engine.objective();
        let still = (now - last).abs() <= TRIAL_EPS * now.abs().max(1.0);
        last = now;
        if still && r.primal <= TRIAL_EPS && r.dual <= TRIAL_EPS {
            break;
        }
        if let Some(bar) = bar.filter(|_| iterations % CHECK_EVERY == 0) {
            let v = value(engine);
            if iterations >= FIRST_CHECK
                && checked.is_some_and(|before| {
                    v + STILL_TO_RISE * (v - before).abs() + HOPELESS * bar.abs() < bar
                })
            {
                return (v, iterations);
            }
            checked = Some(v);
        }
    }
    (value(engine), iterations)
}

/// Whether a move keeps every facility able to carry its members at `x_min`: the same rule
/// the swap rounds apply, so that a feasible allocation always exists.
fn fits(problem: &Problem, floor: &[f64], m: &Move) -> bool {
    let Some((inp, _)) = m.swap.activate else {
        return true;
    };
    let x_min = problem.params.x_min;
    let freed = |f: u32| {
        m.swap.park.map_or(0.0, |out| {
            problem.pairs[out]
                .uses
                .iter()
                .filter(|u| u.0 == f)
                .map(|u| u.1 * x_min)
                .sum()
        })
    };
    problem.pairs[inp].uses.iter().all(|&(f, b)| {
        floor[f as usize] - freed(f) + b * x_min <= problem.facilities[f as usize].capacity
    })
}

/// Every host's proposals at the engine's current prices, best predicted gain first, those
/// that would overload a facility at `x_min` left out.
fn proposals(engine: &Engine, activity: &[f32], opts: &SolveOptions) -> Vec<Move> {
    let problem = engine.problem();
    let prices = engine.prices();
    let table = engine
        .bound_table(opts.selection.prune)
        .map(|t| t.at(&prices));
    let mut moves: Vec<Move> = engine
        .hosts
        .par_iter()
        .flat_map_iter(|h| {
            propose_moves(
                problem,
                h.host,
                &h.active,
                |f| prices[f as usize],
                h.multipliers.mu,
                h.multipliers.nu,
                activity,
                &opts.selection,
                table,
                opts.polish_candidates,
            )
        })
        .collect();
    // Stable: equal estimates keep host order, so the search is deterministic.
    moves.sort_by(|a, b| b.estimate.total_cmp(&a.estimate));
    let floor = engine.floor_usage();
    moves.retain(|m| fits(problem, &floor, m));
    moves
}

/// How many of the best rejected single moves a chain starts from, and how many second
/// moves it tries after each.
const CHAIN_FIRSTS: usize = 4;
const CHAIN_SECONDS: usize = 4;

/// The search's state: the current engine, its value, the trials left.
struct Search<'a, 'p> {
    engine: &'a mut Engine<'p>,
    value: f64,
    report: PolishReport,
    budget: usize,
    cap: usize,
}

impl<'p> Search<'_, 'p> {
    /// Re-solves `from` with `moves` applied; `None` when the budget is spent.
    fn trial(&mut self, from: &Engine<'p>, moves: &[Move]) -> Option<(f64, Engine<'p>)> {
        if self.report.trials >= self.budget {
            return None;
        }
        self.report.trials += 1;
        let mut trial = from.clone();
        trial.apply_swaps(moves.iter().map(|m| (m.host, m.swap)).collect());
        let (v, iterations) = settle(&mut trial, self.cap, Some(self.bar()));
        self.report.iterations += iterations;
        Some((v, trial))
    }

    /// The value a trial must exceed to be kept.
    fn bar(&self) -> f64 {
        self.value + MARGIN * self.value.abs()
    }

    fn improves(&self, v: f64) -> bool {
        v > self.bar()
    }

    fn accept(&mut self, v: f64, trial: Engine<'p>, moves: usize) {
        *self.engine = trial;
        self.value = v;
        self.report.moves += moves;
    }
}

/// The verified local search; `activity` is the swap rounds' memory, which orders near-equal
/// proposals. Leaves the engine at the best sets found, settled to [`TRIAL_EPS`].
///
/// First batches: every host's best move at once, re-solved once, kept if the value rises;
/// a rejected batch is halved, down to single moves (on large instances one re-solve then
/// checks many moves; on small ones the batch is rejected once or twice and costs as much),
/// and an accepted one doubled, so that a search which had to halve down to a few moves
/// grows back once the moves it finds stop crowding each other (with the size kept
/// after halving, 1000 × 5000 spent most of its trials on single moves).
/// Then single moves, best predicted gain first. When none improves, chains of two: from each of the few rejected moves
/// that lost least, the hosts propose again at the prices that move produced, and a second
/// move that together with the first beats the current value is taken. That is what gets two
/// hosts to trade facilities (each alone would crowd the other's), which single moves cannot.
pub fn polish(engine: &mut Engine, activity: &[f32], opts: &SolveOptions) -> PolishReport {
    let (value, iterations) = settle(engine, opts.polish_iters, None);
    let mut search = Search {
        engine,
        value,
        report: PolishReport {
            iterations,
            ..PolishReport::default()
        },
        budget: opts.polish_trials,
        cap: opts.polish_iters,
    };
    // Moves tried together: every host's best at first, halved after each rejected batch and
    // doubled after each accepted one (a single move accepted starts again at two).
    let mut batch = search.engine.hosts.len();
    'search: loop {
        let base = search.engine.clone();
        let moves = proposals(&base, activity, opts);
        while batch > 1 {
            let mut seen = vec![false; base.hosts.len()];
            let firsts: Vec<Move> = moves
                .iter()
                .filter(|m| m.estimate > 0.0 && !std::mem::replace(&mut seen[m.host], true))
                .take(batch)
                .copied()
                .collect();
            if firsts.len() <= 1 {
                break;
            }
            let Some((v, trial)) = search.trial(&base, &firsts) else {
                return search.report;
            };
            if search.improves(v) {
                search.accept(v, trial, firsts.len());
                batch = (batch * 2).min(base.hosts.len());
                continue 'search;
            }
            batch /= 2;
        }
        let mut rejected: Vec<(f64, Engine)> = Vec::new();
        for m in moves {
            let Some((v, trial)) = search.trial(&base, &[m]) else {
                return search.report;
            };
            if search.improves(v) {
                search.accept(v, trial, 1);
                batch = 2;
                continue 'search;
            }
            rejected.push((v, trial));
            rejected.sort_by(|a, b| b.0.total_cmp(&a.0));
            rejected.truncate(CHAIN_FIRSTS);
        }
        for (_, first) in &rejected {
            for m in proposals(first, activity, opts).iter().take(CHAIN_SECONDS) {
                let Some((v, trial)) = search.trial(first, std::slice::from_ref(m)) else {
                    return search.report;
                };
                if search.improves(v) {
                    search.accept(v, trial, 2);
                    continue 'search;
                }
            }
        }
        search.report.settled = true;
        return search.report;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::generator::{generate, GeneratorConfig};
    use crate::selection::initial_active;
    use crate::solver::{default_rho, Algorithm};

    /// A trial far below the value it must beat is given up at the first comparison; one
    /// above it runs exactly as it would with no value to beat.
    #[test]
    fn only_a_hopeless_trial_is_given_up() {
        let p = generate(&GeneratorConfig {
            k: 3,
            seed: 5,
            ..GeneratorConfig::new(20, 40)
        });
        let active = initial_active(&p, &vec![0.0; p.facilities.len()]);
        let cold = Engine::new(&p, Algorithm::Admm, default_rho(&p), active);
        let (settled, iterations) = settle(&mut cold.clone(), 200, None);
        assert!(iterations > FIRST_CHECK, "settled in {iterations}");
        let above = settled + 2.0 * settled.abs() + 1.0;
        let below = settled - 2.0 * settled.abs() - 1.0;
        assert_eq!(settle(&mut cold.clone(), 200, Some(above)).1, FIRST_CHECK);
        assert_eq!(
            settle(&mut cold.clone(), 200, Some(below)),
            (settled, iterations)
        );
    }
}
