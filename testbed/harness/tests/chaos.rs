//! `drum-testbed chaos` for real, short: two minutes of seeded faults on a three-host cluster
//! with applications under the shim, then reconvergence; about 130 s of wall time in all.
//! Every invariant must hold (the command exits 0), and nothing is left behind.
//!
//! Needs root, perftest and the workspace built (`cargo build --workspace --release`).

use drum_test_support::{privileged, run_timeout, text, workspace_bin};
use std::process::Command;
use std::time::Duration;

#[test]
fn a_cluster_keeps_its_invariants_through_two_minutes_of_faults() {
    if let Err(why) = privileged(&["ib_write_bw"]) {
        eprintln!("SKIPPED: {why}");
        return;
    }
    let dir = std::env::temp_dir().join(format!("drum-chaos-test-{}", std::process::id()));
    let figures = dir.with_extension("json");
    let out = run_timeout(
        Command::new(workspace_bin("drum-testbed"))
            .arg("--dir")
            .arg(&dir)
            .args(["chaos", "--minutes", "2", "--seed", "7", "--json"])
            .arg(&figures),
        // 120 s of faults, reconvergence (at most 40 s), the key-value client's last 20 s
        // overlap it; the rest is bringing the cluster up and down on a loaded machine.
        Duration::from_secs(300),
    );
    let logs = dir.with_extension("logs");
    assert!(
        out.status.success(),
        "{}\n(daemon logs in {})",
        text(&out),
        logs.display()
    );
    let f: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&figures).unwrap()).unwrap();
    assert!(f["faults"].as_u64().unwrap() >= 40, "{f:#}");
    assert!(f["fail_static_windows"].as_u64().unwrap() >= 1, "{f:#}");
    let _ = std::fs::remove_file(&figures);
    assert!(!dir.exists(), "chaos left {}", dir.display());
    let marker = dir.to_string_lossy().to_string();
    for p in std::fs::read_dir("/proc").unwrap().flatten() {
        if let Ok(cmd) = std::fs::read(p.path().join("cmdline")) {
            let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
            assert!(!cmd.contains(&marker), "left running: {cmd}");
        }
    }
}
