//! Selection against the exact optimum: on random small instances (`exact::random_small`),
//! the shortfall of `solve`'s activation value below the best over every choice of active
//! sets, as a distribution (docs/benchmarks.md).
//!
//! `cargo run --release -p drum-common --example selection_shortfall -- [instances] [first seed]
//! [polish trials]` (defaults: 300, 0, `SolveOptions`'s; 0 trials: the swap rounds alone).

use drum_common::exact::{choices, optimum, random_small};
use drum_common::solver::{activation_value, solve, SolveOptions};

/// Enumerations above this many choices of active sets are redrawn (keeps a run in minutes).
const MAX_CHOICES: usize = 12_000;

fn main() {
    let mut args = std::env::args().skip(1);
    let count: u64 = args.next().map_or(300, |a| a.parse().expect("instances"));
    let first: u64 = args.next().map_or(0, |a| a.parse().expect("first seed"));
    let opts = SolveOptions {
        polish_trials: args
            .next()
            .map_or(SolveOptions::default().polish_trials, |a| {
                a.parse().expect("polish trials")
            }),
        ..SolveOptions::default()
    };
    let mut shortfalls = Vec::new();
    let (mut moves, mut trials, mut unsettled) = (0, 0, 0);
    for seed in first..first + count {
        let p = random_small(seed, MAX_CHOICES);
        let (best, _) = optimum(&p);
        let s = solve(&p, &opts);
        let got = activation_value(&p, &s.hosts);
        let shortfall = ((best - got) / best.abs().max(f64::MIN_POSITIVE)).max(0.0);
        println!(
            "seed {seed}: n={} m={} k={} choices={} optimum={best:.5} solve={got:.5} shortfall={:.3}% \
             polish: {} moves in {} trials{}",
            p.hosts.len(),
            p.hosts[0].pairs.len(),
            p.params.k,
            choices(&p),
            100.0 * shortfall,
            s.polish.moves,
            s.polish.trials,
            if s.polish.settled { "" } else { ", budget spent" }
        );
        moves += s.polish.moves;
        trials += s.polish.trials;
        unsettled += usize::from(opts.polish_trials > 0 && !s.polish.settled);
        shortfalls.push(shortfall);
    }
    shortfalls.sort_by(f64::total_cmp);
    let q = |f: f64| shortfalls[((shortfalls.len() - 1) as f64 * f).round() as usize] * 100.0;
    let exact = shortfalls.iter().filter(|s| **s <= 1e-4).count();
    println!(
        "polish: {moves} moves applied, {trials} trials, {unsettled} searches cut by the budget"
    );
    println!(
        "{} instances: median {:.3}%  p90 {:.3}%  worst {:.3}%  mean {:.3}%  within 0.01%: {exact}",
        shortfalls.len(),
        q(0.5),
        q(0.9),
        q(1.0),
        100.0 * shortfalls.iter().sum::<f64>() / shortfalls.len() as f64
    );
}
