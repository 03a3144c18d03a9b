//! `drum-coordinator solve` is `solver::solve` with the same options: the control-plane
//! convergence test (agent/tests/cluster.rs) compares the agents with `solve` in-process; this
//! closes the chain to the command line, `--eps` included.

use drum_common::generator::{generate, GeneratorConfig};
use drum_common::instance::Instance;
use drum_common::solver::{solve, SolveOptions};
use std::process::Command;

#[test]
fn solve_command_equals_the_in_process_solve() {
    let problem = generate(&GeneratorConfig {
        k: 2,
        seed: 11,
        ..GeneratorConfig::new(4, 6)
    });
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("instance.json");
    std::fs::write(&path, Instance::from_problem(&problem).to_json()).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_drum-coordinator"))
        .args(["solve", "--json", "--eps", "1e-11", "--max-iter", "5000"])
        .arg("--instance")
        .arg(&path)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let opts = SolveOptions {
        eps_primal: 1e-11,
        eps_dual: 1e-11,
        max_iter: 5000,
        ..SolveOptions::default()
    };
    let reference = solve(&problem, &opts);
    assert_eq!(v["iterations"], reference.iterations);
    assert_eq!(v["converged"], true);
    for (h, r) in reference.hosts.iter().enumerate() {
        let apps = v["hosts"][h]["apps"].as_array().unwrap();
        for (app, p) in apps.iter().zip(problem.hosts[h].pairs.clone()) {
            let want = r.active.binary_search(&p).map_or(0.0, |i| r.x[i]);
            let got = app["rate"].as_f64().unwrap();
            assert!((got - want).abs() <= 1e-12, "host {h}: {got} vs {want}");
            assert_eq!(app["active"], r.active.contains(&p));
        }
    }
    // A bad tolerance is refused.
    let out = Command::new(env!("CARGO_BIN_EXE_drum-coordinator"))
        .args(["solve", "--eps=-1"])
        .arg("--instance")
        .arg(&path)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--eps"));
}
