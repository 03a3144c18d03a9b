//! Criterion benchmarks of the optimiser's hot parts. Sizes come from `DRUM_BENCH_SIZES`
//! (`NxM,NxM…`, hosts × apps per host; default `1000x500`); docs/benchmarks.md lists the runs.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use drum_common::admm::FacilityTerm;
use drum_common::generator::{generate, GeneratorConfig};
use drum_common::selection::{initial_active, SelectionOptions};
use drum_common::solver::{default_rho, evaluate, Algorithm, Engine};
use std::hint::black_box;

fn sizes() -> Vec<(usize, usize)> {
    let spec = std::env::var("DRUM_BENCH_SIZES").unwrap_or_else(|_| "1000x500".into());
    spec.split(',')
        .map(|s| {
            let (n, m) = s
                .trim()
                .split_once('x')
                .expect("DRUM_BENCH_SIZES entries look like 1000x500");
            (n.parse().expect("hosts"), m.parse().expect("apps"))
        })
        .collect()
}

fn host_step(c: &mut Criterion) {
    // One host with m = 5000 apps present and k = 20 active.
    let p = generate(&GeneratorConfig::new(1, 5000));
    let active = initial_active(&p, &vec![0.0; p.facilities.len()]);
    let rho = default_rho(&p);
    let mut engine = Engine::new(&p, Algorithm::Admm, rho, active);
    // Alternate the coordinator's d so every step has to move the rates (a fixed d lets the
    // warm start land on the answer at once and measures nothing).
    let mut flip = false;
    c.bench_function("host_step/m=5000,k=20", |b| {
        b.iter(|| {
            flip = !flip;
            let d = if flip { 0.02 } else { -0.02 };
            let h = &mut engine.hosts[0];
            black_box(h.admm_step(&p, |facility| FacilityTerm { facility, d, rho }));
        })
    });
}

fn iteration_and_selection(c: &mut Criterion) {
    let mut group = c.benchmark_group("optimiser");
    group.sample_size(10);
    for (n, m) in sizes() {
        let p = generate(&GeneratorConfig::new(n, m));
        let rho = default_rho(&p);
        let mut engine = Engine::new(
            &p,
            Algorithm::Admm,
            rho,
            initial_active(&p, &vec![0.0; p.facilities.len()]),
        );
        for _ in 0..5 {
            engine.step();
        }
        group.bench_function(
            BenchmarkId::new("admm_iteration", format!("n={n},m={m}")),
            |b| b.iter(|| black_box(engine.step())),
        );
        let activity = vec![0.0f32; p.pairs.len()];
        // Pruned (the default) and every pair's exact surplus, with the same result.
        for (name, prune) in [
            ("selection_round", true),
            ("selection_round_exhaustive", false),
        ] {
            let opts = SelectionOptions {
                prune,
                ..SelectionOptions::default()
            };
            group.bench_function(BenchmarkId::new(name, format!("n={n},m={m}")), |b| {
                b.iter(|| black_box(evaluate(&engine, &activity, &opts, 0)))
            });
        }
    }
    group.finish();
}

criterion_group!(benches, host_step, iteration_and_selection);
criterion_main!(benches);
