//! Whether `solve`'s answer is a fixed point of the swap rounds the control plane runs: solves
//! generated instances with the default options, then runs further swap rounds from the answer
//! (`solve_warm`, no verified search) and reports how many swaps they make and what happens to
//! the objective. docs/model.md ("Selection, verified") has the figures:
//! `cargo run --release -p drum-common --example selection_churn -- [rounds] [hysteresis]`.

use drum_common::generator::{generate, GeneratorConfig};
use drum_common::solver::{solve, solve_warm, SolveOptions};

fn main() {
    let args: Vec<f64> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("numbers: [rounds] [hysteresis]"))
        .collect();
    let rounds = args.first().map_or(20, |&r| r as usize);
    let mut opts = SolveOptions::default();
    if let Some(&h) = args.get(1) {
        opts.selection.hysteresis = h;
    }
    for (hosts, apps, k, seed) in [(10, 12, 3, 2), (30, 40, 5, 3), (100, 50, 20, 1)] {
        let p = generate(&GeneratorConfig {
            k,
            seed,
            ..GeneratorConfig::new(hosts, apps)
        });
        let first = solve(&p, &opts);
        let again = solve_warm(
            &p,
            &first,
            &SolveOptions {
                rounds,
                polish_trials: 0,
                ..opts
            },
        )
        .expect("same instance");
        let changed = first
            .hosts
            .iter()
            .zip(&again.hosts)
            .filter(|(a, b)| a.active != b.active)
            .count();
        let swaps: usize = again.rounds.iter().map(|r| r.swaps).sum();
        println!(
            "{hosts} × {apps}, k = {k}, hysteresis {}: search {} moves in {} trials (settled: {}); \
             {rounds} more rounds: {swaps} swaps, {changed} of {hosts} hosts' sets changed, \
             objective {:.2} -> {:.2}",
            opts.selection.hysteresis,
            first.polish.moves,
            first.polish.trials,
            first.polish.settled,
            first.objective,
            again.objective
        );
    }
}
