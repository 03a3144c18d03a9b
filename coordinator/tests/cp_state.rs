//! The real `drum-coordinator serve` with a `state_file`: `set-weight` (checked), and the
//! operator's changes (capacity, weight, drained host) written atomically and restored by a
//! restarted coordinator; a corrupt state file stops the start with a clear error.

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
            "listen = \"127.0.0.1:0\"\ninstance = \"instance.json\"\nadmin_listen = \"{admin}\"\n\
             state_file = \"state.json\"\n\
             [tls]\nca = \"certs/ca.pem\"\ncert = \"certs/coordinator.pem\"\nkey = \"certs/coordinator.key\"\n"
        ),
    )
    .unwrap();
    let state = d.join("state.json");
    let s = serve(&config);
    let v = status(&admin);
    assert!(!state.exists(), "nothing written before a change");
    let f0 = v["facilities"][0]["id"].as_str().unwrap().to_string();
    let app = app.unwrap_or_else(|| panic!("no app id in {instance:#}"));

    ok(&run(&["set-capacity", &f0, "0.25", "--admin", &admin]));
    ok(&run(&["set-weight", &app, "3.5", "--admin", &admin]));
    ok(&run(&["drain-host", "h1", "--admin", &admin]));
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
        a.extend(["--admin", &admin]);
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

    // A new coordinator process restores all three.
    drop(s);
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
    ok(&run(&["undrain-host", "h1", "--admin", &admin]));
    let saved: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&state).unwrap()).unwrap();
    assert_eq!(saved["drained"].as_array().unwrap().len(), 0);
    drop(_s);

    // A corrupt or ill-fitting state file: a clear error naming the file, exit status 1.
    for (body, want) in [
        ("{ not json", "is corrupt"),
        (r#"{"format": "other/9"}"#, "has format"),
        (
            r#"{"format": "drum-coordinator-state/1", "weights": {"no-such-app": 2.0}}"#,
            "does not fit the instance",
        ),
        (
            r#"{"format": "drum-coordinator-state/1", "capacities": {"x": 1.0}}"#,
            "no facility",
        ),
    ] {
        std::fs::write(&state, body).unwrap();
        let mut child = bin()
            .args(["serve", "--config", config.to_str().unwrap()])
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let t = Instant::now();
        let code = loop {
            if let Some(c) = child.try_wait().unwrap() {
                break c;
            }
            if t.elapsed() > Duration::from_secs(10) {
                let _ = child.kill();
                let _ = child.wait();
                panic!("serve kept running with state file {body}");
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let mut err = String::new();
        std::io::Read::read_to_string(child.stderr.as_mut().unwrap(), &mut err).unwrap();
        assert_eq!(code.code(), Some(1), "{body}: {err}");
        assert!(
            err.contains(want) && err.contains("state.json"),
            "{body}: {err}"
        );
    }
}
