//! A static instance reaches a fixed point of selection: once `solve`'s verified local search
//! has settled, searching again from its answer on the unchanged instance moves nothing.

use drum_common::generator::{generate, GeneratorConfig};
use drum_common::solver::{solve, solve_warm, SolveOptions};

#[test]
fn a_settled_search_changes_nothing_when_run_again() {
    for (hosts, apps, k, seed) in [(3, 6, 2, 1), (10, 12, 3, 2), (30, 40, 5, 3)] {
        let p = generate(&GeneratorConfig {
            k,
            seed,
            ..GeneratorConfig::new(hosts, apps)
        });
        // A budget the search does not reach, so it ends at its fixed point.
        let opts = SolveOptions {
            polish_trials: 5000,
            ..SolveOptions::default()
        };
        let first = solve(&p, &opts);
        assert!(first.polish.settled, "{hosts}×{apps}: {:?}", first.polish);
        assert!(first.polish.moves > 0, "{hosts}×{apps}: nothing to search");
        let again = solve_warm(&p, &first, &SolveOptions { rounds: 0, ..opts }).unwrap();
        eprintln!(
            "{hosts}×{apps}, k = {k}: {} moves in {} trials, then {} trials and no move",
            first.polish.moves, first.polish.trials, again.polish.trials
        );
        assert!(again.polish.settled);
        assert_eq!(again.polish.moves, 0, "{hosts}×{apps}");
        for (a, b) in first.hosts.iter().zip(&again.hosts) {
            assert_eq!(a.active, b.active, "{hosts}×{apps}, host {}", a.host);
        }
        assert!((again.objective - first.objective).abs() <= 1e-4 * first.objective.abs());
    }
}
