//! The real `drum-coordinator serve` with a `state_file`: `set-weight` (checked), and the
//! operator's changes (capacity, weight, drained host) written atomically and restored by a
//! restarted coordinator; operator commands that a restart would refuse are refused, and a
//! state file that does not fit is reported and set aside, never fatal (issue 19, item 1).

use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_drum-coordinator"))
}

fn run(args: &[&str]) -> Output {
    bin().args(args).output().expect("run drum-coordinator")
}

struct Guard(Child);

impl Drop for Guard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn serve(config: &Path) -> Guard {
    Guard(
        bin()
            .args(["serve", "--config", config.to_str().unwrap()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    )
}

/// `serve` with its log in `log`.
fn serve_logged(config: &Path, log: &Path) -> Guard {
    Guard(
        bin()
            .args(["serve", "--config", config.to_str().unwrap()])
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(log).unwrap())
            .spawn()
            .unwrap(),
    )
}

fn status(admin: &str) -> serde_json::Value {
    let t = Instant::now();
    loop {
        let out = run(&["status", "--json", "--admin", admin]);
        if out.status.success() {
            return serde_json::from_slice(&out.stdout).unwrap();
        }
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "serve never answered"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn ok(out: &Output) {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn operator_changes_persist_across_a_restart_and_set_weight_is_checked() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    ok(&run(&[
        "dev-certs",
        "--out",
        d.join("certs").to_str().unwrap(),
    ]));
    ok(&run(&[
        "simulate",
        "--hosts",
        "3",
        "--apps",
        "4",
        "--k",
        "2",
        "--write-instance",
        d.join("instance.json").to_str().unwrap(),
    ]));
    let instance: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(d.join("instance.json")).unwrap()).unwrap();
    let app = instance["hosts"][0]["apps"][0]["id"]
        .as_str()
        .map(str::to_string);
    let admin = format!("127.0.0.1:{}", free_port());
    let config = d.join("coordinator.toml");
    std::fs::write(
        &config,
        format!(
            "listen = \"127.0.0.1:0\"\ninstance = \"instance.json\"\nadmin_listen = \"{admin}\"\nadmin_socket = \"admin.sock\"\n\
             state_file = \"state.json\"\n\
             [tls]\nca = \"certs/ca.pem\"\ncert = \"certs/coordinator.pem\"\nkey = \"certs/coordinator.key\"\n"
        ),
    )
    .unwrap();
    let state = d.join("state.json");
    let socket = d.join("admin.sock").to_str().unwrap().to_string();
    let ops_log = d.join("ops.log");
    let s = serve_logged(&config, &ops_log);
    let v = status(&admin);
    assert!(!state.exists(), "nothing written before a change");
    let f0 = v["facilities"][0]["id"].as_str().unwrap().to_string();
    let app = app.unwrap_or_else(|| panic!("no app id in {instance:#}"));

    ok(&run(&["set-capacity", &f0, "0.25", "--socket", &socket]));
    ok(&run(&["set-weight", &app, "3.5", "--socket", &socket]));
    ok(&run(&["drain-host", "h1", "--socket", &socket]));
    for (args, want) in [
        (vec!["set-weight", "no-such-app", "1"], "no app"),
        (
            vec!["set-weight", &app, "0"],
            "must be a finite number in [1e-9, 1e9], got 0",
        ),
        (vec!["set-weight", &app, "NaN"], "got NaN"),
        (vec!["set-weight", &app, "inf"], "got inf"),
        (vec!["set-weight", &app, "1e308"], "got 1e308"),
    ] {
        let mut a = args.clone();
        a.extend(["--socket", &socket]);
        let out = run(&a);
        assert!(!out.status.success(), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(want), "{args:?}: {err}");
    }
    let v = status(&admin);
    assert_eq!(v["weights"][&app], 3.5);
    let saved: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&state).unwrap()).unwrap();
    assert_eq!(saved["format"], "drum-coordinator-state/1");
    assert_eq!(saved["capacities"][&f0], 0.25);
    assert_eq!(saved["weights"][&app], 3.5);
    assert_eq!(saved["drained"][0], "h1");
    assert!(!d.join("state.json.tmp").exists(), "renamed into place");

    // The audit trail: every operator change, made or refused, in the coordinator's log.
    drop(s);
    let ops = std::fs::read_to_string(&ops_log).unwrap();
    for want in [
        "operator change: capacity of",
        "operator change: weight of",
        "operator change: host h1 drained",
        "operator change refused: no app",
    ] {
        assert!(ops.contains(want), "{want}: {ops}");
    }

    // A new coordinator process restores all three.
    let _s = serve(&config);
    let v = status(&admin);
    let cap = v["facilities"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["id"] == f0.as_str())
        .unwrap()["capacity"]
        .as_f64()
        .unwrap();
    assert_eq!(cap, 0.25);
    assert_eq!(v["weights"][&app], 3.5);
    assert_eq!(v["drained"][0], "h1");
    ok(&run(&["undrain-host", "h1", "--socket", &socket]));
    let saved: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&state).unwrap()).unwrap();
    assert_eq!(saved["drained"].as_array().unwrap().len(), 0);

    // Operator commands whose result a restart would refuse are refused now, with the
    // reason; nothing is written. An unknown host is refused by drain and undrain alike.
    for (args, want) in [
        (vec!["drain-host", ""], "host id \"\""),
        (
            vec!["drain-host", "no-such-host"],
            "no host \"no-such-host\"",
        ),
        (vec!["undrain-host", "no-such-host"], "is not drained"),
        (
            vec!["set-capacity", &f0, "1e308"],
            "must be a finite number in [1e-9, 1e9], got 1e308",
        ),
        (vec!["set-capacity", &f0, "5e-324"], "got 5e-324"),
        (vec!["set-capacity", &f0, "1e-300"], "got 1e-300"),
    ] {
        let mut a = args.clone();
        a.extend(["--socket", &socket]);
        let out = run(&a);
        assert!(!out.status.success(), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(want), "{args:?}: {err}");
    }
    let saved: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&state).unwrap()).unwrap();
    assert_eq!(saved["drained"].as_array().unwrap().len(), 0);
    drop(_s);

    // A state file that does not fit (corrupt, another format, changes the checks refuse,
    // such as the empty host id an older coordinator accepted): the coordinator starts,
    // logs an error naming the file and why, sets it aside with its content, and keeps the
    // changes that fit.
    let log = d.join("serve.log");
    for (body, want, kept) in [
        ("{ not json", "is corrupt", 0),
        (r#"{"format": "other/9"}"#, "has format", 0),
        (
            r#"{"format": "drum-coordinator-state/1", "weights": {"no-such-app": 2.0}, "drained": ["h1"]}"#,
            "no app",
            1,
        ),
        (
            r#"{"format": "drum-coordinator-state/1", "capacities": {"x": 1.0}}"#,
            "no facility",
            0,
        ),
        (
            r#"{"format": "drum-coordinator-state/1", "drained": ["", "h2"]}"#,
            "host id \"\"",
            1,
        ),
    ] {
        for e in std::fs::read_dir(d).unwrap() {
            let p = e.unwrap().path();
            if p.to_string_lossy().contains(".rejected-") {
                std::fs::remove_file(p).unwrap();
            }
        }
        std::fs::write(&state, body).unwrap();
        let s = serve_logged(&config, &log);
        let v = status(&admin);
        assert_eq!(
            v["drained"].as_array().unwrap().len(),
            kept,
            "{body}: {v:#}"
        );
        drop(s);
        let err = std::fs::read_to_string(&log).unwrap();
        assert!(
            err.contains(want) && err.contains("state.json") && err.contains("set aside"),
            "{body}: {err}"
        );
        let aside: Vec<_> = std::fs::read_dir(d)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.to_string_lossy().contains("state.json.rejected-"))
            .collect();
        assert_eq!(aside.len(), 1, "{body}: {aside:?}");
        assert_eq!(std::fs::read_to_string(&aside[0]).unwrap(), body);
        let now: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&state).unwrap()).unwrap();
        assert_eq!(now["drained"].as_array().unwrap().len(), kept, "{body}");
    }
}
