//! The ADMM optimum for fixed active sets against an independent interior-point solution
//! (clarabel, exponential and power cones).

use clarabel::algebra::CscMatrix;
use clarabel::solver::{DefaultSettings, DefaultSolver, IPSolver, SolverStatus, SupportedConeT};
use drum_common::generator::{generate, GeneratorConfig};
use drum_common::model::Problem;
use drum_common::solver::{default_rho, feasible, fixed_set_trace, objective, Algorithm};

/// Maximises `Σ U(x)` over all pairs active, as a conic program; returns (objective, x).
fn clarabel_optimum(p: &Problem) -> (f64, Vec<f64>) {
    let np = p.pairs.len();
    let beta = p.params.beta;
    // Variables: x (np), t (np, rate-utility epigraph), r (np, polling-term epigraph).
    let (xi, ti, ri) = (|j: usize| j, |j: usize| np + j, |j: usize| 2 * np + j);
    let nvar = 3 * np;
    let mut q = vec![0.0; nvar];
    let (mut rows, mut cols, mut vals, mut b) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut row = 0;
    let mut push = |rows: &mut Vec<usize>, b: &mut Vec<f64>, entries: &[(usize, f64)], rhs: f64| {
        for &(c, v) in entries {
            rows.push(row);
            cols.push(c);
            vals.push(v);
        }
        b.push(rhs);
        row += 1;
    };
    // Linear rows A·v ≤ b.
    for h in &p.hosts {
        let e: Vec<_> = h.pairs.clone().map(|j| (xi(j), 1.0)).collect();
        push(&mut rows, &mut b, &e, h.wqe_budget);
        let e: Vec<_> = h
            .pairs
            .clone()
            .map(|j| (xi(j), p.pairs[j].cqe_per_wqe))
            .collect();
        push(&mut rows, &mut b, &e, h.poll_budget);
    }
    for (f, fac) in p.facilities.iter().enumerate() {
        let e: Vec<_> = (0..np)
            .filter_map(|j| coeff(&p.pairs[j], f).map(|b| (xi(j), b)))
            .collect();
        push(&mut rows, &mut b, &e, fac.capacity);
    }
    for j in 0..np {
        push(&mut rows, &mut b, &[(xi(j), -1.0)], -p.params.x_min);
        push(&mut rows, &mut b, &[(xi(j), 1.0)], p.pairs[j].demand);
    }
    let linear = b.len();
    let mut cones = vec![SupportedConeT::NonnegativeConeT(linear)];
    for j in 0..np {
        let pair = &p.pairs[j];
        let alpha = p.params.alpha;
        if alpha == 1.0 {
            // (t, 1, x) ∈ K_exp: t ≤ ln x; maximise w·t.
            q[ti(j)] = -pair.weight;
            push(&mut rows, &mut b, &[(ti(j), -1.0)], 0.0);
            push(&mut rows, &mut b, &[], 1.0);
            push(&mut rows, &mut b, &[(xi(j), -1.0)], 0.0);
            cones.push(SupportedConeT::ExponentialConeT());
        } else {
            // α > 1: t ≥ x^(1−α), i.e. t^(1/α)·x^((α−1)/α) ≥ 1; minimise w/(α−1)·t.
            assert!(alpha > 1.0);
            q[ti(j)] = pair.weight / (alpha - 1.0);
            push(&mut rows, &mut b, &[(ti(j), -1.0)], 0.0);
            push(&mut rows, &mut b, &[(xi(j), -1.0)], 0.0);
            push(&mut rows, &mut b, &[], 1.0);
            cones.push(SupportedConeT::PowerConeT(1.0 / alpha));
        }
        // r ≥ 1/x², i.e. r^(1/3)·x^(2/3) ≥ 1; minimise β·r.
        q[ri(j)] = beta;
        push(&mut rows, &mut b, &[(ri(j), -1.0)], 0.0);
        push(&mut rows, &mut b, &[(xi(j), -1.0)], 0.0);
        push(&mut rows, &mut b, &[], 1.0);
        cones.push(SupportedConeT::PowerConeT(1.0 / 3.0));
    }
    let a = CscMatrix::new_from_triplets(b.len(), nvar, rows, cols, vals);
    let pm = CscMatrix::zeros((nvar, nvar));
    let settings = DefaultSettings {
        verbose: false,
        tol_gap_abs: 1e-10,
        tol_gap_rel: 1e-10,
        tol_feas: 1e-10,
        max_iter: 500,
        ..DefaultSettings::default()
    };
    let mut solver =
        DefaultSolver::new(&pm, &q, &a, &b, &cones, settings).expect("valid conic problem");
    solver.solve();
    assert!(
        matches!(
            solver.solution.status,
            SolverStatus::Solved | SolverStatus::AlmostSolved
        ),
        "clarabel: {:?}",
        solver.solution.status
    );
    let x = solver.solution.x[..np].to_vec();
    let obj: f64 = (0..np).map(|j| p.utility(&p.pairs[j]).value(x[j])).sum();
    (obj, x)
}

fn check(cfg: GeneratorConfig) {
    check_problem(&generate(&cfg), &format!("{cfg:?}"));
}

fn check_problem(p: &Problem, cfg: &str) {
    let p = p.clone();
    let all: Vec<Vec<usize>> = p.hosts.iter().map(|h| h.pairs.clone().collect()).collect();
    let (ref_obj, ref_x) = clarabel_optimum(&p);
    let (trace, hosts) = fixed_set_trace(&p, all, Algorithm::Admm, default_rho(&p), 5000, 1e-11);
    let hosts = feasible(&p, &hosts);
    let obj = objective(&p, &hosts);
    let rel = (obj - ref_obj).abs() / ref_obj.abs();
    assert!(
        rel <= 1e-4,
        "{cfg}: ADMM {obj} vs clarabel {ref_obj} (relative {rel:e}); residual {}",
        trace.last().unwrap().primal_residual
    );
    let binding = p.facilities.iter().enumerate().any(|(f, fac)| {
        let used: f64 = (0..p.pairs.len())
            .filter_map(|j| coeff(&p.pairs[j], f).map(|b| b * ref_x[j]))
            .sum();
        used >= fac.capacity * (1.0 - 1e-6)
    });
    assert!(
        binding,
        "{cfg}: no facility binds, the test would not exercise the prices"
    );
    let scale = ref_x.iter().fold(0.0f64, |m, v| m.max(v.abs()));
    for h in &hosts {
        for (&j, &x) in h.active.iter().zip(&h.x) {
            assert!(
                (x - ref_x[j]).abs() <= 1e-3 * scale,
                "{cfg}: pair {j}: {x} vs {}",
                ref_x[j]
            );
        }
    }
}

#[test]
fn admm_matches_interior_point_log_utility() {
    for seed in 1..=3 {
        check(GeneratorConfig {
            k: 6,
            seed,
            ..GeneratorConfig::new(5, 6)
        });
    }
}

#[test]
fn admm_matches_interior_point_alpha_two_with_polling_term() {
    check(GeneratorConfig {
        k: 5,
        seed: 11,
        alpha: 2.0,
        beta: 1e-3,
        ..GeneratorConfig::new(6, 5)
    });
}

/// Pairs that use several facilities, as the live problem's do: every host gets a receive link
/// (capacity 0.4), each pair sends 70 % of its bytes to the next host and 30 % to the one after,
/// on top of its generated facility; every third pair loads no facility at all.
#[test]
fn admm_matches_interior_point_with_several_facilities_per_pair() {
    let mut p = generate(&GeneratorConfig {
        k: 6,
        seed: 5,
        ..GeneratorConfig::new(4, 6)
    });
    let hosts = p.hosts.len();
    let first_link = p.facilities.len() as u32;
    for h in &p.hosts {
        p.facilities.push(drum_common::model::Facility {
            id: format!("rx:{}", h.id),
            capacity: 0.4,
            cost: 0.0,
        });
    }
    for (hi, h) in p.hosts.clone().iter().enumerate() {
        for (j, pair) in p.pairs[h.pairs.clone()].iter_mut().enumerate() {
            if j % 3 == 2 {
                pair.uses.clear();
                continue;
            }
            let to = |d: usize| first_link + ((hi + d) % hosts) as u32;
            pair.uses.extend([(to(1), 0.7), (to(2), 0.3)]);
            pair.uses.sort_unstable_by_key(|u| u.0);
        }
    }
    // The file format carries the lists: what `solve` reads is this problem.
    let p = drum_common::instance::Instance::from_problem(&p)
        .into_problem()
        .expect("a valid instance");
    check_problem(&p, "several facilities per pair");
}

/// `b` of facility `f` in the pair's sparse list, if it uses `f`.
fn coeff(pair: &drum_common::model::Pair, f: usize) -> Option<f64> {
    pair.uses.iter().find(|u| u.0 as usize == f).map(|u| u.1)
}
