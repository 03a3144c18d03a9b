//! Cold-start runs of an inner algorithm on fixed active sets, the comparisons `simulate`
//! reports (docs/benchmarks.md): iterations to an accuracy, and the same under lost updates.

use crate::admm::HostState;
use crate::lossy::Loss;
use crate::model::Problem;
use crate::solver::{run_inner, Algorithm, Engine, SolveOptions, TraceRow};

/// Runs the inner algorithm on fixed active sets from a cold start for `iterations`
/// iterations, or until both residuals are below `eps`.
pub fn fixed_set_trace(
    problem: &Problem,
    active: Vec<Vec<usize>>,
    algorithm: Algorithm,
    rho: f64,
    iterations: usize,
    eps: f64,
) -> (Vec<TraceRow>, Vec<HostState>) {
    let mut engine = Engine::new(problem, algorithm, rho, active);
    let trace = trace_engine(&mut engine, iterations, eps);
    (trace, engine.hosts)
}

/// [`fixed_set_trace`] for all `iterations` with host updates lost as `loss` says; also returns
/// how many were lost.
pub fn lossy_fixed_set_trace(
    problem: &Problem,
    active: Vec<Vec<usize>>,
    algorithm: Algorithm,
    rho: f64,
    iterations: usize,
    loss: Loss,
) -> (Vec<TraceRow>, Vec<HostState>, u64) {
    let mut engine = Engine::new(problem, algorithm, rho, active).with_loss(loss);
    let trace = trace_engine(&mut engine, iterations, 0.0);
    let lost = engine.lost();
    (trace, engine.hosts, lost)
}

fn trace_engine(engine: &mut Engine, iterations: usize, eps: f64) -> Vec<TraceRow> {
    let opts = SolveOptions {
        eps_primal: eps,
        eps_dual: eps,
        ..SolveOptions::default()
    };
    let mut trace = Vec::with_capacity(iterations);
    run_inner(engine, iterations, &opts, 0, &mut trace);
    trace
}

/// The first iteration from which on every iterate is within `tol` of `reference` (relative
/// objective error) with a primal residual at most `tol`; `None` if the trace never settles.
pub fn iterations_to_accuracy(trace: &[TraceRow], reference: f64, tol: f64) -> Option<usize> {
    let ok = |t: &TraceRow| {
        (t.objective - reference).abs() <= tol * reference.abs() && t.primal_residual <= tol
    };
    let last_bad = trace.iter().rposition(|t| !ok(t));
    match last_bad {
        None if !trace.is_empty() => Some(1),
        None => None,
        Some(i) if i + 1 < trace.len() => Some(trace[i + 1].iteration),
        Some(_) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dual::DualStep;
    use crate::generator::{generate, GeneratorConfig};
    use crate::selection::initial_active;
    use crate::solver::{default_rho, price_reference};

    fn instance() -> (Problem, Vec<Vec<usize>>, f64) {
        let p = generate(&GeneratorConfig {
            k: 4,
            seed: 5,
            ..GeneratorConfig::new(12, 10)
        });
        let active = initial_active(&p, &vec![0.0; p.facilities.len()]);
        let rho = default_rho(&p);
        (p, active, rho)
    }

    fn algorithms(p: &Problem) -> [Algorithm; 3] {
        [
            Algorithm::Admm,
            Algorithm::Dual(DualStep::Normalised {
                eta: 0.3,
                price_ref: price_reference(p),
            }),
            Algorithm::Xwi,
        ]
    }

    #[test]
    fn xwi_reaches_the_optimum_of_the_sets_with_feasible_rates() {
        let (p, active, rho) = instance();
        let (reference, _) = fixed_set_trace(&p, active.clone(), Algorithm::Admm, rho, 3000, 1e-9);
        let optimum = reference.last().unwrap().objective;
        let (trace, _) = fixed_set_trace(&p, active, Algorithm::Xwi, rho, 300, 0.0);
        let worst = trace.iter().map(|t| t.primal_residual).fold(0.0, f64::max);
        assert!(worst < 1e-12, "over capacity by {worst}");
        let last = trace.last().unwrap().objective;
        assert!(
            (last - optimum).abs() <= 1e-4 * optimum.abs(),
            "{last} vs {optimum}"
        );
        assert!(iterations_to_accuracy(&trace, optimum, 0.005).is_some_and(|n| n < 100));
    }

    #[test]
    fn losing_nothing_changes_nothing() {
        let (p, active, rho) = instance();
        for alg in algorithms(&p) {
            let (want, want_hosts) = fixed_set_trace(&p, active.clone(), alg, rho, 60, 0.0);
            let loss = Loss {
                probability: 0.0,
                seed: 9,
            };
            let (got, hosts, lost) = lossy_fixed_set_trace(&p, active.clone(), alg, rho, 60, loss);
            assert_eq!((got, hosts, lost), (want, want_hosts, 0), "{}", alg.name());
        }
    }

    #[test]
    fn losing_everything_leaves_the_coordinator_at_the_joins() {
        let (p, active, rho) = instance();
        for alg in algorithms(&p) {
            let loss = Loss {
                probability: 1.0,
                seed: 9,
            };
            let mut engine = Engine::new(&p, alg, rho, active.clone()).with_loss(loss);
            engine.step();
            let first = engine.sums().to_vec();
            for _ in 0..20 {
                engine.step();
            }
            assert_eq!(engine.sums(), first.as_slice(), "{}", alg.name());
            assert_eq!(engine.lost(), 21 * p.hosts.len() as u64);
            // Without loss the sums move.
            let mut engine = Engine::new(&p, alg, rho, active.clone());
            engine.step();
            let first = engine.sums().to_vec();
            engine.step();
            assert_ne!(engine.sums(), first.as_slice(), "{}", alg.name());
        }
    }

    #[test]
    fn a_seeded_lossy_run_repeats_and_another_seed_differs() {
        let (p, active, rho) = instance();
        for alg in algorithms(&p) {
            let run = |seed| {
                let loss = Loss {
                    probability: 0.2,
                    seed,
                };
                lossy_fixed_set_trace(&p, active.clone(), alg, rho, 40, loss)
            };
            let a = run(1);
            assert!(a.2 > 0);
            assert_eq!(a, run(1), "{}", alg.name());
            assert_ne!(a.0, run(2).0, "{}", alg.name());
        }
    }
}
