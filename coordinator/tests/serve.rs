//! The real `drum-coordinator` binary as a service: `dev-certs`, `serve`, and the operator
//! commands against it (`status`, `set-capacity`, `drain-host`, `undrain-host`). Agents are
//! covered by drum-agent's tests/cluster.rs.

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

#[test]
fn serve_answers_operator_commands() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let out = run(&[
        "dev-certs",
        "--out",
        d.join("certs").to_str().unwrap(),
        "--agents",
        "h0,h1",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for f in [
        "ca.pem",
        "coordinator.pem",
        "coordinator.key",
        "agent-h0.pem",
        "agent-h1.key",
    ] {
        assert!(d.join("certs").join(f).exists(), "{f}");
    }
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(d.join("certs/coordinator.key"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o077, 0, "private keys are not readable by others");
    let out = run(&[
        "dev-certs",
        "--out",
        d.join("x").to_str().unwrap(),
        "--agents",
        "../evil",
    ]);
    assert!(!out.status.success());

    let out = run(&[
        "simulate",
        "--hosts",
        "3",
        "--apps",
        "4",
        "--k",
        "2",
        "--write-instance",
        d.join("instance.json").to_str().unwrap(),
    ]);
    assert!(out.status.success());
    let admin = format!("127.0.0.1:{}", free_port());
    let config = d.join("coordinator.toml");
    std::fs::write(
        &config,
        format!(
            "listen = \"127.0.0.1:0\"\ninstance = \"instance.json\"\nadmin_listen = \"{admin}\"\nadmin_socket = \"admin.sock\"\n\
             [tls]\nca = \"certs/ca.pem\"\ncert = \"certs/coordinator.pem\"\nkey = \"certs/coordinator.key\"\n"
        ),
    )
    .unwrap();
    let _serve = Guard(
        bin()
            .args(["serve", "--config", config.to_str().unwrap()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let t = Instant::now();
    let status = loop {
        let out = run(&["status", "--json", "--admin", &admin]);
        if out.status.success() {
            break out;
        }
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "serve never answered"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let socket = d.join("admin.sock").to_str().unwrap().to_string();
    // Issue 19, item 6: the admin socket takes operator commands, mode 0660; the TCP
    // endpoint (unauthenticated) refuses them, cross-origin or not, and still serves reads.
    {
        use std::os::unix::fs::{FileTypeExt, PermissionsExt};
        let m = std::fs::metadata(&socket).unwrap();
        assert!(m.file_type().is_socket());
        assert_eq!(m.permissions().mode() & 0o777, 0o660);
    }
    for target in [
        "/drain?host=h1",
        "/undrain?host=h1",
        "/set-weight?app=x&value=2",
        "/set-capacity?facility=x&value=2",
    ] {
        let (code, body) =
            drum_coordinator::admin::request(admin.parse().unwrap(), "POST", target).unwrap();
        assert_eq!(code, 403, "{target}: {body}");
        assert!(body.contains("admin socket"), "{body}");
    }
    let v: serde_json::Value = serde_json::from_slice(&status.stdout).unwrap();
    assert_eq!(v["members"].as_array().unwrap().len(), 0);
    assert_eq!(v["facilities"].as_array().unwrap().len(), 4);
    let f0 = v["facilities"][0]["id"].as_str().unwrap().to_string();

    let out = run(&["set-capacity", &f0, "0.25", "--socket", &socket]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = run(&["set-capacity", "no-such-facility", "1", "--socket", &socket]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("no facility"));
    let out = run(&["drain-host", "h1", "--socket", &socket]);
    assert!(out.status.success());
    let out = run(&["status", "--admin", &admin]);
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(table.contains("drained: h1"), "{table}");
    assert!(table.contains("0.2500"), "{table}");
    let out = run(&["undrain-host", "h1", "--socket", &socket]);
    assert!(out.status.success());
    let metrics = drum_coordinator::admin::request(admin.parse().unwrap(), "GET", "/metrics")
        .unwrap()
        .1;
    assert!(metrics.contains("drum_coordinator_members 0"), "{metrics}");
}

#[test]
fn serve_refuses_a_bad_config() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("c.toml");
    std::fs::write(&config, "listen = \"127.0.0.1:0\"\ninstanse = \"x\"\n").unwrap();
    let out = run(&["serve", "--config", config.to_str().unwrap()]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("unknown field") && err.contains("instanse"),
        "{err}"
    );
    // A missing TLS file is named, and its error said once (issue 19, item 9).
    std::fs::write(
        &config,
        "listen = \"127.0.0.1:0\"\n[tls]\nca = \"ca.pem\"\ncert = \"c.pem\"\nkey = \"missing.key\"\n",
    )
    .unwrap();
    let out = run(&["serve", "--config", config.to_str().unwrap()]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("ca.pem") || err.contains("c.pem") || err.contains("missing.key"),
        "{err}"
    );
    assert_eq!(err.matches("No such file").count(), 1, "{err}");
}
