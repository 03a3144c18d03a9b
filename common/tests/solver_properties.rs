//! Properties of whole solves: every returned allocation is feasible, the certificate is
//! consistent, and ADMM and dual decomposition agree on the optimum of the same active sets.

use drum_common::dual::DualStep;
use drum_common::generator::{generate, GeneratorConfig};
use drum_common::model::Problem;
use drum_common::solver::{
    default_rho, feasible, fixed_set_trace, objective, price_reference, solve, Algorithm, Solution,
    SolveOptions,
};
use proptest::prelude::*;

fn assert_feasible(p: &Problem, s: &Solution) {
    let mut usage = vec![0.0; p.facilities.len()];
    for h in &s.hosts {
        let host = &p.hosts[h.host];
        assert!(
            h.active.len() <= p.params.k,
            "host {} has {} active > k",
            host.id,
            h.active.len()
        );
        let (mut sum, mut poll) = (0.0, 0.0);
        for (&j, &x) in h.active.iter().zip(&h.x) {
            assert!(
                host.pairs.contains(&j),
                "pair {j} is not on host {}",
                host.id
            );
            let pair = &p.pairs[j];
            assert!(
                x >= p.params.x_min * (1.0 - 1e-12) && x <= pair.demand * (1.0 + 1e-12),
                "rate {x} outside its box"
            );
            sum += x;
            poll += pair.cqe_per_wqe * x;
            for &(f, b) in &pair.uses {
                usage[f as usize] += b * x;
            }
        }
        assert!(
            sum <= host.wqe_budget * (1.0 + 1e-9),
            "host {}: WQE {sum} > {}",
            host.id,
            host.wqe_budget
        );
        assert!(
            poll <= host.poll_budget * (1.0 + 1e-9),
            "host {}: poll {poll} > {}",
            host.id,
            host.poll_budget
        );
    }
    for (f, fac) in p.facilities.iter().enumerate() {
        assert!(
            usage[f] <= fac.capacity * (1.0 + 1e-9),
            "facility {}: {} > {}",
            fac.id,
            usage[f],
            fac.capacity
        );
    }
    assert!(s.gap >= 0.0 && s.upper_bound() >= s.objective);
    for r in &s.rounds {
        assert!(
            r.upper_bound >= r.lower_bound - 1e-9 * r.lower_bound.abs(),
            "round {}: UB < LB",
            r.round
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]
    #[test]
    fn every_returned_allocation_is_feasible(
        hosts in 1usize..12,
        apps in 1usize..15,
        k in 1usize..8,
        seed in 0u64..1000,
        alpha in prop::sample::select(vec![0.5, 1.0, 2.0]),
        rounds in 0usize..4,
        dual in any::<bool>(),
    ) {
        let p = generate(&GeneratorConfig { k, seed, alpha, ..GeneratorConfig::new(hosts, apps) });
        let algorithm = if dual {
            Algorithm::Dual(DualStep::Normalised { eta: 0.3, price_ref: price_reference(&p) })
        } else {
            Algorithm::Admm
        };
        let s = solve(&p, &SolveOptions { algorithm, rounds, max_iter: 200, ..SolveOptions::default() });
        assert_feasible(&p, &s);
    }
}

#[test]
fn dual_decomposition_reaches_the_admm_optimum() {
    let p = generate(&GeneratorConfig::new(40, 30));
    let s = solve(&p, &SolveOptions::default());
    assert_feasible(&p, &s);
    let active: Vec<Vec<usize>> = s.hosts.iter().map(|h| h.active.clone()).collect();
    let rho = default_rho(&p);
    let (admm_trace, admm_hosts) =
        fixed_set_trace(&p, active.clone(), Algorithm::Admm, rho, 3000, 1e-10);
    let step = DualStep::Normalised {
        eta: 0.3,
        price_ref: price_reference(&p),
    };
    let (dual_trace, dual_hosts) =
        fixed_set_trace(&p, active, Algorithm::Dual(step), rho, 3000, 0.0);
    let admm = objective(&p, &feasible(&p, &admm_hosts));
    let dual = objective(&p, &feasible(&p, &dual_hosts));
    assert!(
        (admm - dual).abs() <= 1e-3 * admm.abs(),
        "ADMM {admm} vs dual {dual}"
    );
    // ...and ADMM gets there much sooner.
    let within = |t: &[drum_common::solver::TraceRow]| {
        drum_common::solver::iterations_to_accuracy(t, admm, 0.005).unwrap_or(usize::MAX)
    };
    assert!(
        within(&admm_trace) < within(&dual_trace),
        "ADMM {} vs dual {}",
        within(&admm_trace),
        within(&dual_trace)
    );
}

#[test]
fn selection_improves_on_the_initial_sets() {
    let p = generate(&GeneratorConfig::new(60, 80));
    let s = solve(&p, &SolveOptions::default());
    let first = s.rounds.first().unwrap();
    let last = s.rounds.last().unwrap();
    assert!(
        last.lower_bound > first.lower_bound,
        "{} → {}",
        first.lower_bound,
        last.lower_bound
    );
    assert!(last.relative_gap() < first.relative_gap());
}

/// Brute force over every choice of active sets on a tiny instance: the certificate's bounds
/// must bracket the true optimum of the activation value.
#[test]
fn certificate_brackets_the_brute_force_optimum() {
    let p = generate(&GeneratorConfig {
        k: 2,
        seed: 5,
        ..GeneratorConfig::new(2, 4)
    });
    let subsets = |host: usize| -> Vec<Vec<usize>> {
        let pairs: Vec<usize> = p.hosts[host].pairs.clone().collect();
        let mut out = vec![vec![]];
        for (i, &a) in pairs.iter().enumerate() {
            out.push(vec![a]);
            for &b in &pairs[i + 1..] {
                out.push(vec![a, b]);
            }
        }
        out
    };
    let rho = default_rho(&p);
    let offset = |hosts: &[drum_common::admm::HostState]| -> f64 {
        hosts
            .iter()
            .flat_map(|h| h.active.iter())
            .map(|&j| p.utility(&p.pairs[j]).activation_offset())
            .sum()
    };
    let mut best = f64::NEG_INFINITY;
    for s0 in subsets(0) {
        for s1 in subsets(1) {
            let (_, hosts) =
                fixed_set_trace(&p, vec![s0.clone(), s1], Algorithm::Admm, rho, 4000, 1e-11);
            let hosts = feasible(&p, &hosts);
            best = best.max(objective(&p, &hosts) - offset(&hosts));
        }
    }
    let s = solve(&p, &SolveOptions::default());
    let tol = 1e-6 * best.abs();
    for r in &s.rounds {
        assert!(
            r.lower_bound <= best + tol,
            "round {}: LB {} above the optimum {best}",
            r.round,
            r.lower_bound
        );
        assert!(
            r.upper_bound >= best - tol,
            "round {}: UB {} below the optimum {best}",
            r.round,
            r.upper_bound
        );
    }
}

#[test]
fn warm_start_reconverges_faster_after_a_change() {
    use drum_common::solver::{iterations_to_accuracy, solve_from, solve_warm, WarmStartError};
    let p = generate(&GeneratorConfig::new(60, 40));
    let opts = SolveOptions {
        eps_primal: 1e-6,
        eps_dual: 1e-6,
        max_iter: 3000,
        ..SolveOptions::default()
    };
    let first = solve(&p, &opts);
    let mut changed = p.clone();
    for (i, f) in changed.facilities.iter_mut().enumerate() {
        f.capacity *= if i % 2 == 0 { 1.1 } else { 0.9 };
    }
    // Fixed active sets: no swap rounds and no verified search.
    let fixed = SolveOptions {
        rounds: 0,
        polish_trials: 0,
        ..opts
    };
    let active = first.hosts.iter().map(|h| h.active.clone()).collect();
    let cold = solve_from(&changed, active, &fixed);
    let warm = solve_warm(&changed, &first, &fixed).unwrap();
    assert!(cold.converged && warm.converged);
    // The tail to 1e-6 takes as long either way; what a warm start saves is the transient.
    let settle = |s: &Solution| iterations_to_accuracy(&s.trace, cold.objective, 1e-3).unwrap();
    assert!(
        settle(&warm) < settle(&cold),
        "to 0.1%: warm {} vs cold {} iterations",
        settle(&warm),
        settle(&cold)
    );
    // Restarting on the unchanged instance is already converged.
    let again = solve_warm(&p, &first, &fixed).unwrap();
    assert!(again.iterations <= 2, "{} iterations", again.iterations);
    assert!((warm.objective - cold.objective).abs() <= 1e-4 * cold.objective.abs());
    assert_feasible(&changed, &warm);

    let other = generate(&GeneratorConfig::new(61, 40));
    assert!(matches!(
        solve_warm(&other, &first, &fixed),
        Err(WarmStartError::Hosts {
            previous: 60,
            now: 61
        })
    ));
}
