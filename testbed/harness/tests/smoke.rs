//! `drum-testbed run all --profile smoke`, for real on emulated hosts: every scenario and mode
//! once, every output written and well-formed, the report rendered by headless Chromium with
//! every figure and table in it, and nothing left behind. No timing is asserted: the smoke
//! profile's runs are too short to mean anything.
//!
//! Needs root (softrnic's namespaces), the workspace built (`cargo build --workspace
//! --release`), perftest, and Debian's chromium for the rendering; skips with a message
//! without them.

use drum_test_support::{have, privileged, run_timeout, text, workspace_bin, Scratch};
use std::path::Path;
use std::process::Command;
use std::time::Duration;

/// The scenarios `run all` runs in its default modes (RAW, SHARE, DRUM): Dart's have other
/// modes and their own test (`tests/dart.rs`).
fn scenario_names() -> Vec<String> {
    let out = run_timeout(
        Command::new(workspace_bin("drum-testbed")).arg("list"),
        Duration::from_secs(10),
    );
    assert!(out.status.success(), "{}", text(&out));
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next().map(str::to_string))
        .filter(|n| !n.starts_with("dart-"))
        .collect()
}

/// What Chromium made of the page: its DOM after rendering.
fn rendered_dom(page: &Path, scratch: &Path) -> String {
    let profile = scratch.join("chromium-profile");
    let out = run_timeout(
        Command::new("chromium")
            .args([
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
            ])
            .arg(format!("--user-data-dir={}", profile.display()))
            .arg(format!(
                "--screenshot={}",
                scratch.join("report.png").display()
            ))
            .arg("--window-size=1100,4000")
            .arg("--dump-dom")
            .arg(format!("file://{}", page.display())),
        Duration::from_secs(120),
    );
    assert!(out.status.success(), "chromium: {}", text(&out));
    String::from_utf8_lossy(&out.stdout).to_string()
}

#[test]
fn smoke_profile_runs_every_scenario_and_writes_a_report_chromium_renders() {
    if let Err(why) = privileged(&["ib_write_bw", "ib_write_lat"]) {
        eprintln!("SKIPPED: {why}");
        return;
    }
    let scratch = Scratch::new("drum-smoke");
    let out_dir = scratch.0.join("out");
    let out = run_timeout(
        Command::new(workspace_bin("drum-testbed"))
            .args(["run", "all", "--profile", "smoke", "--out"])
            .arg(&out_dir),
        Duration::from_secs(600),
    );
    assert!(out.status.success(), "{}", text(&out));
    let names = scenario_names();
    for f in ["meta.json", "runs.csv", "summary.csv", "report.html"] {
        assert!(out_dir.join(f).is_file(), "{f} missing");
    }
    let runs = std::fs::read_to_string(out_dir.join("runs.csv")).unwrap();
    for name in &names {
        for ext in ["svg", "png"] {
            let p = out_dir.join(format!("{name}.{ext}"));
            assert!(p.metadata().is_ok_and(|m| m.len() > 1000), "{p:?}");
        }
        assert!(
            runs.lines().any(|l| l.starts_with(&format!("{name},"))),
            "no run of {name} in runs.csv"
        );
    }
    for l in runs.lines().skip(1) {
        assert!(!l.contains("failed:"), "a failed run: {l}");
    }
    // The report can be rebuilt from the raw runs alone, and `check` judges it.
    let again = run_timeout(
        Command::new(workspace_bin("drum-testbed"))
            .arg("report")
            .arg(&out_dir),
        Duration::from_secs(60),
    );
    assert!(again.status.success(), "{}", text(&again));
    let check = run_timeout(
        Command::new(workspace_bin("drum-testbed"))
            .arg("check")
            .arg(&out_dir),
        Duration::from_secs(60),
    );
    let verdicts = String::from_utf8_lossy(&check.stdout);
    assert!(verdicts.lines().count() >= names.len(), "{}", text(&check));
    // A second run with the same --out resumes: everything is already there.
    let resumed = run_timeout(
        Command::new(workspace_bin("drum-testbed"))
            .args(["run", "all", "--profile", "smoke", "--out"])
            .arg(&out_dir),
        Duration::from_secs(120),
    );
    assert!(resumed.status.success(), "{}", text(&resumed));
    assert!(
        !String::from_utf8_lossy(&resumed.stdout).contains("] "),
        "resumed runs: {}",
        text(&resumed)
    );
    if !have("chromium") {
        eprintln!(
            "SKIPPED (rendering only): chromium not installed (scripts/setup.sh installs it)"
        );
        return;
    }
    let dom = rendered_dom(&out_dir.join("report.html"), &scratch.0);
    assert!(
        dom.contains("id=\"stamp\""),
        "no stamp in the rendered report"
    );
    for name in &names {
        let at = dom
            .find(&format!("<section id=\"{name}\""))
            .unwrap_or_else(|| panic!("no section for {name}"));
        let section = &dom[at..];
        let section = &section[..section.find("</section>").unwrap()];
        assert!(section.contains("<svg"), "{name}: no figure");
        assert!(section.matches("<table").count() >= 2, "{name}: tables");
    }
}
