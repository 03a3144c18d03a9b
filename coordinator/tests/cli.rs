//! The real `drum-coordinator` binary: solve, simulate, plots, and refusals of bad input.

use std::path::Path;
use std::process::{Command, Output};

fn run(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_drum-coordinator"))
        .args(args)
        .output()
        .expect("run drum-coordinator")
}

fn json(out: &Output) -> serde_json::Value {
    assert!(
        out.status.success(),
        "failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("stdout is JSON")
}

#[test]
fn simulate_writes_instance_trace_and_plot_then_solve_reads_it() {
    let dir = tempfile::tempdir().unwrap();
    let inst = dir.path().join("inst.json");
    let plot = dir.path().join("conv.png");
    let trace = dir.path().join("trace.csv");
    let p = |x: &Path| x.to_str().unwrap().to_string();
    let out = run(&[
        "simulate",
        "--hosts",
        "30",
        "--apps",
        "20",
        "--k",
        "5",
        "--json",
        "--compare-iters",
        "80",
        "--write-instance",
        &p(&inst),
        "--plot",
        &p(&plot),
        "--trace",
        &p(&trace),
    ]);
    let v = json(&out);
    assert_eq!(v["pairs"], 600);
    assert!(
        v["comparison"]["admm_iterations"].as_u64().is_some(),
        "{}",
        v["comparison"]
    );
    assert_eq!(&std::fs::read(&plot).unwrap()[..4], b"\x89PNG");
    let csv = std::fs::read_to_string(&trace).unwrap();
    assert!(csv.starts_with("algorithm,iteration,objective,primal_residual,dual_residual\n"));
    assert!(csv.lines().filter(|l| l.starts_with("admm,")).count() == 80);

    for algorithm in ["admm", "dual"] {
        let v = json(&run(&[
            "solve",
            "--instance",
            &p(&inst),
            "--algorithm",
            algorithm,
            "--json",
        ]));
        for field in [
            "algorithm",
            "iterations",
            "converged",
            "objective",
            "upper_bound",
            "gap",
            "primal_residual",
            "wall_ms",
            "prices",
            "hosts",
        ] {
            assert!(!v[field].is_null(), "{algorithm}: missing {field}");
        }
        let hosts = v["hosts"].as_array().unwrap();
        assert_eq!(hosts.len(), 30);
        for h in hosts {
            let apps = h["apps"].as_array().unwrap();
            assert_eq!(apps.len(), 20);
            let active = apps.iter().filter(|a| a["active"] == true).count();
            assert!(active <= 5);
            for a in apps {
                let rate = a["rate"].as_f64().unwrap();
                assert_eq!(a["active"] == true, rate > 0.0);
                assert!(a["poll_rate"].as_f64().unwrap() >= rate);
            }
        }
        assert!(v["upper_bound"].as_f64().unwrap() >= v["objective"].as_f64().unwrap());
    }
    let human = run(&["solve", "--instance", &p(&inst)]);
    assert!(human.status.success());
    assert!(String::from_utf8_lossy(&human.stdout).contains("admm:"));
}

#[test]
fn bad_input_is_refused_with_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let bad = dir.path().join("bad.json");
    std::fs::write(
        &bad,
        r#"{"alpha": 1, "beta": 0, "k": 2, "x_min": 0.01, "facilities": [{"id": "f", "capacity": 1}],
            "hosts": [{"id": "h1", "wqe_budget": 1, "poll_budget": 5,
                       "apps": [{"id": "a", "weight": 1, "cqe_per_wqe": 1, "demand": 0.5, "facility": "g", "facility_coeff": 1}]}]}"#,
    )
    .unwrap();
    let out = run(&["solve", "--instance", bad.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("hosts[0] (id \"h1\").apps[0] (id \"a\").facility")
            && err.contains("no facility"),
        "{err}"
    );

    std::fs::write(&bad, "{\"alpha\": 1, \"beta\"").unwrap();
    let out = run(&["solve", "--instance", bad.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not valid JSON"));

    let out = run(&["solve", "--instance", "/nonexistent/instance.json"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("reading /nonexistent/instance.json"));

    let out = run(&["simulate", "--hosts", "2", "--apps", "2", "--rho=-1"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--rho"));

    let out = run(&["simulate", "--hosts", "100000", "--apps", "100000"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("200 million"));
}
