//! The `serve` config: the example in deploy/ parses with every selection key, and bad
//! selection keys are refused with a clear error.

use drum_coordinator::server::{ServeOptions, ServeSettings};
use std::path::Path;

fn write(dir: &Path, body: &str) -> std::path::PathBuf {
    let p = dir.join("c.toml");
    std::fs::write(
        &p,
        format!(
            "listen = \"127.0.0.1:0\"\ninstance = \"i.json\"\n{body}\n[tls]\nca = \"a\"\ncert = \"b\"\nkey = \"c\"\n"
        ),
    )
    .unwrap();
    p
}

#[test]
fn deploy_example_parses_with_the_selection_defaults() {
    let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/config/coordinator.toml");
    let (s, o) = ServeSettings::load_with_options(&example).unwrap();
    assert_eq!(
        s.instance, None,
        "the deployed coordinator runs the live problem"
    );
    let policy = o.policy.clone().expect("[policy]").policy().unwrap();
    assert_eq!(policy, drum_common::live::LivePolicy::default());
    assert_eq!(
        o.admin_socket.as_deref(),
        Some(Path::new("/run/drum-coordinator/admin.sock")),
        "operator commands on the unit's runtime directory"
    );
    assert_eq!(
        ServeOptions {
            policy: None,
            admin_socket: None,
            ..o.clone()
        },
        ServeOptions::default()
    );
    assert_eq!(s.min_members, 1);
    assert_eq!(o.solve_options().rounds, 10);
    assert_eq!(o.schedule().exchanges(), 11);
    assert_eq!(
        o.schedule().period,
        Some(std::time::Duration::from_millis(100))
    );
}

#[test]
fn selection_keys_are_read_and_checked() {
    let dir = tempfile::tempdir().unwrap();
    let (_, o) = ServeSettings::load_with_options(&write(
        dir.path(),
        "selection_rounds = 3\npriced_start = false\neps_primal = 1e-9\nselection_seed = 7\n\
         selection_period_ms = 0",
    ))
    .unwrap();
    assert_eq!(o.schedule().period, None, "0: no periodic re-selection");
    assert_eq!(o.selection_rounds, 3);
    assert!(!o.priced_start);
    assert_eq!(o.solve_options().eps_primal, 1e-9);
    assert_eq!(o.solve_options().selection.seed, 7);
    for (body, want) in [
        ("iters_per_round = 0", "iters_per_round must be at least 1"),
        (
            "selection_period_ms = 3600001",
            "selection_period_ms must be at most 3600000",
        ),
        ("selection_period_ms = -5", "invalid value"),
        ("eps_dual = -1.0", "eps_dual must be finite"),
        ("selection_round = 3", "unknown field `selection_round`"),
        ("priced_start = 3", "invalid type"),
    ] {
        let e = ServeSettings::load_with_options(&write(dir.path(), body)).unwrap_err();
        let text = format!("{e:#}");
        assert!(text.contains(want), "{body}: {text}");
    }
}

#[test]
fn serve_refuses_a_bad_shard() {
    for bad in ["2/2", "0/0", "x"] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_drum-coordinator"))
            .args(["serve", "--config", "/nonexistent.toml", "--shard", bad])
            .output()
            .unwrap();
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("shard must be I/N"), "{bad}: {err}");
    }
}

/// `[policy]` (the live problem's weights): a weight of 0, NaN or 1e308, a bad default or a bad
/// app name is refused at load with an error naming it; with an instance `[policy]` is refused.
#[test]
fn policy_weights_are_checked_at_load() {
    let dir = tempfile::tempdir().unwrap();
    let live = |policy: &str| {
        let p = dir.path().join("live.toml");
        std::fs::write(
            &p,
            format!(
                "listen = \"127.0.0.1:0\"\n[tls]\nca = \"a\"\ncert = \"b\"\nkey = \"c\"\n[policy]\n{policy}\n"
            ),
        )
        .unwrap();
        ServeSettings::load_with_options(&p)
    };
    let (s, o) = live("default_weight = 2.0\n[policy.weights]\nkv = 4.0").unwrap();
    assert_eq!(s.instance, None);
    let p = o.policy.unwrap().policy().unwrap();
    assert_eq!((p.weight("kv"), p.weight("other")), (4.0, 2.0));
    for (policy, want) in [
        (
            "[policy.weights]\nkv = 0.0",
            "the weight of app \"kv\" must be a finite number in [1e-9, 1e9], got 0",
        ),
        ("[policy.weights]\nkv = nan", "got NaN"),
        ("[policy.weights]\nkv = 1e308", "got 1e308"),
        ("default_weight = -1.0", "default_weight must be"),
        ("[policy.weights]\n\"a b\" = 1.0", "app name \"a b\""),
        ("default_wieght = 1.0", "unknown field `default_wieght`"),
    ] {
        let e = live(policy).unwrap_err();
        assert!(format!("{e:#}").contains(want), "{policy}: {e:#}");
    }
    let e = ServeSettings::load_with_options(&write(dir.path(), "[policy]\ndefault_weight = 1.0"))
        .unwrap_err();
    assert!(format!("{e:#}").contains("[policy] in"), "{e:#}");
}
