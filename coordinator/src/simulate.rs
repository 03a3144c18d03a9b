//! `drum-coordinator simulate`: generate an instance, solve it with ADMM and selection, then
//! compare ADMM and the baselines (dual decomposition, NUMFabric's xWI) from a cold start on the
//! final active sets; optionally the same with host updates lost (`--drop`).

use drum_common::admm::HostState;
use drum_common::dual::DualStep;
use drum_common::generator::{generate, GeneratorConfig};
use drum_common::lossy::Loss;
use drum_common::model::Problem;
use drum_common::solver::{
    default_rho, feasible, fixed_set_trace, iterations_to_accuracy, lossy_fixed_set_trace,
    objective, price_reference, solve, Algorithm, Solution, SolveOptions, TraceRow,
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
    pub xwi_trace: Vec<TraceRow>,
    /// With `--drop`: the lossy runs' traces (ADMM, dual, xWI).
    pub drop_traces: Option<[Vec<TraceRow>; 3]>,
}

#[derive(Serialize)]
pub struct Comparison {
    /// Objective of the final active sets solved to high accuracy.
    pub reference_objective: f64,
    pub accuracy: f64,
    pub admm_iterations: Option<usize>,
    pub dual_iterations: Option<usize>,
    pub dual_paper_step_iterations: Option<usize>,
    /// NUMFabric's xWI price iteration (docs/model.md, "The xWI baseline").
    pub xwi_iterations: Option<usize>,
    pub cap: usize,
    pub admm_ms_per_iteration: f64,
    pub dual_ms_per_iteration: f64,
    pub xwi_ms_per_iteration: f64,
    /// The same runs with host updates lost (`--drop`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub drop: Option<DropReport>,
}

/// Cold-start runs on the final active sets with each host's update lost with `probability`
/// per iteration, the coordinator reusing the host's last one (Feng, Xu and Li §5.3).
#[derive(Serialize)]
pub struct DropReport {
    pub probability: f64,
    pub seed: u64,
    /// Iterations each run takes (all of them: `cap`).
    pub iterations: usize,
    pub admm: DropRun,
    pub dual: DropRun,
    pub xwi: DropRun,
}

#[derive(Serialize)]
pub struct DropRun {
    /// `|f − f*|/|f*|` of the feasible allocation after the last iteration.
    pub final_error: f64,
    /// Iterations to `accuracy`, as in the comparison (null: not within `cap`).
    pub iterations_to_accuracy: Option<usize>,
    /// Host updates lost over the run.
    pub lost: u64,
}

pub fn run(
    cfg: &GeneratorConfig,
    opts: &SolveOptions,
    cap: usize,
    drop: Option<Loss>,
) -> Simulation {
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
        active.clone(),
        Algorithm::Dual(DualStep::Paper),
        rho,
        cap,
        0.0,
    );
    let t = Instant::now();
    let (xwi_trace, _) = fixed_set_trace(&problem, active.clone(), Algorithm::Xwi, rho, cap, 0.0);
    let xwi_ms = ms(t) / cap.max(1) as f64;
    let (drop, drop_traces) = match drop {
        Some(loss) => {
            let lossy = |algorithm| {
                let (trace, hosts, lost) =
                    lossy_fixed_set_trace(&problem, active.clone(), algorithm, rho, cap, loss);
                let run = DropRun {
                    final_error: final_error(&problem, &hosts, reference_objective),
                    iterations_to_accuracy: iterations_to_accuracy(
                        &trace,
                        reference_objective,
                        ACCURACY,
                    ),
                    lost,
                };
                (run, trace)
            };
            let (admm, admm_trace) = lossy(Algorithm::Admm);
            let (dual, dual_trace) = lossy(Algorithm::Dual(step));
            let (xwi, xwi_trace) = lossy(Algorithm::Xwi);
            let report = DropReport {
                probability: loss.probability,
                seed: loss.seed,
                iterations: cap,
                admm,
                dual,
                xwi,
            };
            (Some(report), Some([admm_trace, dual_trace, xwi_trace]))
        }
        None => (None, None),
    };
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
        xwi_iterations: iterations_to_accuracy(&xwi_trace, reference_objective, ACCURACY),
        cap,
        admm_ms_per_iteration: admm_ms,
        dual_ms_per_iteration: dual_ms,
        xwi_ms_per_iteration: xwi_ms,
        drop,
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
        xwi_trace,
        drop_traces,
    }
}

/// Relative error of the feasible projection of an allocation (what DRUM would apply).
fn final_error(problem: &Problem, hosts: &[HostState], reference: f64) -> f64 {
    let f = objective(problem, &feasible(problem, hosts));
    (f - reference).abs() / reference.abs().max(f64::MIN_POSITIVE)
}

fn ms(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn losing_a_tenth_of_the_updates_ends_within_one_and_a_half_percent() {
        // Feng, Xu and Li's result, the target for `simulate --drop 0.1`.
        let cfg = GeneratorConfig {
            seed: 1,
            ..GeneratorConfig::new(100, 50)
        };
        let opts = SolveOptions {
            polish_trials: 0,
            certificate_iters: 0,
            ..SolveOptions::default()
        };
        let loss = Loss {
            probability: 0.1,
            seed: 1,
        };
        let sim = run(&cfg, &opts, 100, Some(loss));
        let d = sim.comparison.drop.expect("a lossy comparison");
        assert!(
            (800..=1_200).contains(&d.admm.lost),
            "{} of 100 hosts × 100 iterations lost",
            d.admm.lost
        );
        assert!(
            d.admm.final_error <= 0.015,
            "ADMM ends {:.3}% off",
            100.0 * d.admm.final_error
        );
    }
}
