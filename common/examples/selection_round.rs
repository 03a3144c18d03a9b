//! Times one selection round (`solver::evaluate`: every host's surpluses, bound and swap
//! proposal) with pruning and without, alternately in one process, so both see the same load:
//! `cargo run --release -p drum-common --example selection_round -- 10000 5000 [rounds]`.
//! Prints wall and CPU time (this process's, from /proc/self/stat) per round and checks that
//! both give the same bound and swaps. docs/benchmarks.md ("Selection at scale") has the runs.

use drum_common::generator::{generate, GeneratorConfig};
use drum_common::selection::{initial_active, SelectionOptions};
use drum_common::solver::{default_rho, evaluate, Algorithm, Engine};
use std::time::Instant;

/// User + system CPU seconds of this process so far.
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").expect("/proc/self/stat");
    // Fields after the command name, which is in parentheses and may contain spaces.
    let rest = &stat[stat.rfind(')').expect("stat format") + 2..];
    let fields: Vec<&str> = rest.split(' ').collect();
    let ticks: f64 = fields[11].parse::<f64>().unwrap() + fields[12].parse::<f64>().unwrap();
    ticks / 100.0
}

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("numbers: hosts apps [rounds]"))
        .collect();
    let (n, m) = (args[0], args[1]);
    let rounds = args.get(2).copied().unwrap_or(3);
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
                "round {round} prune {prune:5}: wall {:.3} s, cpu {:.2} s, bound {}, {} swaps",
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
