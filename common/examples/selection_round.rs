//! Times one selection round (`solver::evaluate`: every host's surpluses, bound and swap
//! proposal) with pruning and without, alternately in one process, so both see the same load:
//! `cargo run --release -p drum-common --example selection_round -- 10000 5000 [rounds]
//! [later]`, `later` ADMM steps taken after the table of bounds is built (banded at the
//! prices then), so the rounds see prices the table's bands no longer match.
//! Prints wall and CPU time (this process's threads', from /proc/self/task/*/schedstat) per round and checks that
//! both give the same bound and swaps. docs/benchmarks.md ("Selection at scale") has the runs.

use drum_common::generator::{generate, GeneratorConfig};
use drum_common::selection::{initial_active, SelectionOptions};
use drum_common::solver::{default_rho, evaluate, Algorithm, Engine};
use std::time::Instant;

/// CPU seconds of this process's threads so far, to the nanosecond (`/proc/self/task/*/schedstat`;
/// `/proc/self/stat` counts in 10 ms ticks, coarse beside a round of 1000 × 5000).
fn cpu_seconds() -> f64 {
    let tasks = std::fs::read_dir("/proc/self/task").expect("/proc/self/task");
    let ns: u64 = tasks
        .map(|t| {
            let stat = std::fs::read_to_string(t.expect("task").path().join("schedstat"));
            // A thread that ended between listing and reading counts nothing.
            stat.ok()
                .and_then(|s| s.split(' ').next().and_then(|n| n.parse().ok()))
                .unwrap_or(0)
        })
        .sum();
    ns as f64 * 1e-9
}

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("numbers: hosts apps [rounds] [later]"))
        .collect();
    let (n, m) = (args[0], args[1]);
    let rounds = args.get(2).copied().unwrap_or(3);
    let later = args.get(3).copied().unwrap_or(0);
    let start = Instant::now();
    let p = generate(&GeneratorConfig::new(n, m));
    let mut engine = Engine::new(
        &p,
        Algorithm::Admm,
        default_rho(&p),
        initial_active(&p, &vec![0.0; p.facilities.len()]),
    );
    // Prices as the schedule's first round sees them, as in the criterion bench.
    for _ in 0..5 {
        engine.step();
    }
    eprintln!(
        "{n} × {m}: {} pairs, set up in {:.1} s",
        p.pairs.len(),
        start.elapsed().as_secs_f64()
    );
    let built = Instant::now();
    engine.round_table(true);
    eprintln!(
        "table of bounds built in {:.2} s",
        built.elapsed().as_secs_f64()
    );
    for _ in 0..later {
        engine.step();
    }
    let activity = vec![0.0f32; p.pairs.len()];
    let mut results = Vec::new();
    for round in 0..rounds {
        for prune in [false, true] {
            let opts = SelectionOptions {
                prune,
                ..SelectionOptions::default()
            };
            let (wall, cpu) = (Instant::now(), cpu_seconds());
            let result = evaluate(&engine, &activity, &opts, round);
            println!(
                "round {round} prune {prune:5}: wall {:.3} s, cpu {:.3} s, bound {}, {} swaps",
                wall.elapsed().as_secs_f64(),
                cpu_seconds() - cpu,
                result.0,
                result.1.len()
            );
            results.push(result);
        }
        let (exhaustive, pruned) = (&results[results.len() - 2], &results[results.len() - 1]);
        assert_eq!(exhaustive, pruned, "pruning changed the round's result");
    }
}
