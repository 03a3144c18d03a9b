//! `drum-coordinator simulate`: generate an instance, solve it with ADMM and selection, then
//! compare ADMM and the dual-decomposition baseline from a cold start on the final active sets.

use drum_common::dual::DualStep;
use drum_common::generator::{generate, GeneratorConfig};
use drum_common::model::Problem;
use drum_common::solver::{
    default_rho, fixed_set_trace, iterations_to_accuracy, price_reference, solve, Algorithm,
    Solution, SolveOptions, TraceRow,
};
use serde::Serialize;
use std::time::Instant;

/// Relative accuracy the comparison asks of both algorithms (the paper's 0.5%).
pub const ACCURACY: f64 = 0.005;
/// Step of the normalised dual baseline, the best of a sweep (docs/benchmarks.md).
pub const DUAL_ETA: f64 = 0.3;
/// Cap on the ADMM run that yields the reference optimum (it stops at residuals of 1e-9).
const REFERENCE_ITERS: usize = 3000;

pub struct Simulation {
    pub problem: Problem,
    pub generate_ms: f64,
    pub solution: Solution,
    pub solve_ms: f64,
    pub rho: f64,
    pub comparison: Comparison,
    pub admm_trace: Vec<TraceRow>,
    pub dual_trace: Vec<TraceRow>,
    pub paper_trace: Vec<TraceRow>,
}

#[derive(Serialize)]
pub struct Comparison {
    /// Objective of the final active sets solved to high accuracy.
    pub reference_objective: f64,
    pub accuracy: f64,
    pub admm_iterations: Option<usize>,
    pub dual_iterations: Option<usize>,
    pub dual_paper_step_iterations: Option<usize>,
    pub cap: usize,
    pub admm_ms_per_iteration: f64,
    pub dual_ms_per_iteration: f64,
}

pub fn run(cfg: &GeneratorConfig, opts: &SolveOptions, cap: usize) -> Simulation {
    let t = Instant::now();
    let problem = generate(cfg);
    let generate_ms = ms(t);
    let rho = opts.rho.unwrap_or_else(|| default_rho(&problem));
    let t = Instant::now();
    let solution = solve(
        &problem,
        &SolveOptions {
            rho: Some(rho),
            ..*opts
        },
    );
    let solve_ms = ms(t);

    let active: Vec<Vec<usize>> = solution.hosts.iter().map(|h| h.active.clone()).collect();
    let (reference_trace, _) = fixed_set_trace(
        &problem,
        active.clone(),
        Algorithm::Admm,
        rho,
        REFERENCE_ITERS,
        1e-9,
    );
    let reference_objective = reference_trace.last().map_or(0.0, |t| t.objective);

    let t = Instant::now();
    let (admm_trace, _) = fixed_set_trace(&problem, active.clone(), Algorithm::Admm, rho, cap, 0.0);
    let admm_ms = ms(t) / cap.max(1) as f64;
    let step = DualStep::Normalised {
        eta: DUAL_ETA,
        price_ref: price_reference(&problem),
    };
    let t = Instant::now();
    let (dual_trace, _) = fixed_set_trace(
        &problem,
        active.clone(),
        Algorithm::Dual(step),
        rho,
        cap,
        0.0,
    );
    let dual_ms = ms(t) / cap.max(1) as f64;
    let (paper_trace, _) = fixed_set_trace(
        &problem,
        active,
        Algorithm::Dual(DualStep::Paper),
        rho,
        cap,
        0.0,
    );
    let comparison = Comparison {
        reference_objective,
        accuracy: ACCURACY,
        admm_iterations: iterations_to_accuracy(&admm_trace, reference_objective, ACCURACY),
        dual_iterations: iterations_to_accuracy(&dual_trace, reference_objective, ACCURACY),
        dual_paper_step_iterations: iterations_to_accuracy(
            &paper_trace,
            reference_objective,
            ACCURACY,
        ),
        cap,
        admm_ms_per_iteration: admm_ms,
        dual_ms_per_iteration: dual_ms,
    };
    Simulation {
        problem,
        generate_ms,
        solution,
        solve_ms,
        rho,
        comparison,
        admm_trace,
        dual_trace,
        paper_trace,
    }
}

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}
