//! Dart's experiments (`dart-conv`, `dart-incast`) in the smoke profile, for real on emulated
//! hosts, in the DCQCN baseline and with DASR through the agents and through the NIC: every run recorded and not
//! failed, every measure the report and the criteria read present and finite (`dasr-nic`'s
//! count arrival, timed from the NICs' timelines, too), the plots and
//! the report written, `check` printing every criterion, and nothing left behind. No timing
//! is asserted: the smoke profile's runs are too short to mean anything.
//!
//! Needs root, the workspace built (`cargo build --workspace --release`) and perftest; skips
//! with a message without them.

use drum_test_support::{privileged, run_timeout, text, workspace_bin, Scratch};
use std::process::Command;
use std::time::{Duration, Instant};

#[test]
fn darts_experiments_run_in_the_smoke_profile_and_report_every_measure() {
    if let Err(why) = privileged(&["ib_write_bw", "ib_write_lat"]) {
        eprintln!("SKIPPED: {why}");
        return;
    }
    let scratch = Scratch::new("drum-dart");
    let out_dir = scratch.0.join("out");
    let t = Instant::now();
    let out = run_timeout(
        Command::new(workspace_bin("drum-testbed"))
            .args([
                "run",
                "dart-conv",
                "dart-incast",
                "--modes",
                "dcqcn,dasr-agent,dasr-nic",
                "--profile",
                "smoke",
                "--out",
            ])
            .arg(&out_dir),
        Duration::from_secs(300),
    );
    eprintln!("run took {:?}", t.elapsed());
    assert!(out.status.success(), "{}", text(&out));
    for f in [
        "runs.csv",
        "summary.csv",
        "report.html",
        "dart-conv.svg",
        "dart-conv-2.svg",
        "dart-incast.svg",
        "dart-incast-2.png",
    ] {
        let p = out_dir.join(f);
        assert!(p.metadata().is_ok_and(|m| m.len() > 500), "{p:?}");
    }
    let runs = std::fs::read_to_string(out_dir.join("runs.csv")).unwrap();
    let header: Vec<&str> = runs.lines().next().unwrap().split(',').collect();
    let want = [
        ("dart-conv", "conv_start_rtts"),
        ("dart-conv", "conv_end_us"),
        ("dart-conv", "rtt_us"),
        ("dart-incast", "p50_fct_us"),
        ("dart-incast", "p99_fct_us"),
        ("dart-incast", "bg_mib_per_s"),
    ];
    // dasr-nic's count arrival, from the NICs' timelines
    let nic_only = [
        ("dart-conv", "arrival_start_us"),
        ("dart-conv", "arrival_rx_start_us"),
        ("dart-conv", "hold_us"),
    ];
    for mode in ["dcqcn", "dasr-agent", "dasr-nic"] {
        let want: Vec<_> = want
            .iter()
            .chain(nic_only.iter().filter(|_| mode == "dasr-nic"))
            .collect();
        for scenario in ["dart-conv", "dart-incast"] {
            let row = runs
                .lines()
                .find(|l| l.starts_with(&format!("{scenario},{mode},")))
                .unwrap_or_else(|| panic!("no {scenario} run in {mode}:\n{runs}"));
            assert!(!row.contains("failed:"), "{row}");
            let cells: Vec<&str> = row.split(',').collect();
            for (s, m) in want.iter().filter(|(s, _)| *s == scenario) {
                let i = header
                    .iter()
                    .position(|h| h == m)
                    .unwrap_or_else(|| panic!("no run measured {m}:\n{runs}"));
                let v: f64 = cells[i].parse().unwrap_or(f64::NAN);
                assert!(v.is_finite() && v >= 0.0, "{s} {mode} {m} = {:?}", cells[i]);
            }
        }
    }
    let check = run_timeout(
        Command::new(workspace_bin("drum-testbed"))
            .arg("check")
            .arg(&out_dir),
        Duration::from_secs(60),
    );
    let verdicts = String::from_utf8_lossy(&check.stdout);
    for s in ["dart-conv", "dart-incast"] {
        assert!(verdicts.contains(&format!(" {s}: ")), "{}", text(&check));
    }
    assert!(
        !out_dir.join("cluster").exists(),
        "the hosts were not torn down"
    );
}
