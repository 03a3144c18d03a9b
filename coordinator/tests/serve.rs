//! The real `drum-coordinator` binary as a service: `dev-certs`, `serve`, and the operator
//! commands against it (`status`, `set-capacity`, `drain-host`, `undrain-host`). Agents are
//! covered by drum-agent's tests/cluster.rs.

use std::io::{Read, Write};
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
    assert!(
        metrics.contains("drum_coordinator_rounds_total 0"),
        "{metrics}"
    );
    assert!(metrics.ends_with("# EOF\n"), "{metrics}");

    // The HTTP stack's limits on the real daemon: a browser's change on the socket, a
    // malformed request, an oversized head and body, a connection that sends nothing.
    let idle = {
        let admin = admin.clone();
        std::thread::spawn(move || {
            let (reply, took) = raw(&admin, b"");
            assert!(reply.is_empty(), "{reply}");
            took
        })
    };
    let mut s = std::os::unix::net::UnixStream::connect(&socket).unwrap();
    s.write_all(b"POST /drain?host=h1 HTTP/1.1\r\nHost: x\r\nOrigin: http://example.com\r\nConnection: close\r\n\r\n")
        .unwrap();
    let mut reply = String::new();
    s.read_to_string(&mut reply).unwrap();
    assert!(reply.starts_with("HTTP/1.1 403"), "{reply}");
    assert!(
        !String::from_utf8_lossy(&run(&["status", "--admin", &admin]).stdout)
            .contains("drained: h1")
    );
    let (reply, _) = raw(&admin, b"BREW /pot HTCPCP/1.0\r\n\r\n");
    assert!(reply.is_empty() || reply.contains(" 400 "), "{reply}");
    let head = format!(
        "GET /status HTTP/1.1\r\nHost: x\r\nX: {}\r\n\r\n",
        "a".repeat(16384)
    );
    let (reply, _) = raw(&admin, head.as_bytes());
    assert!(reply.starts_with("HTTP/1.1 431"), "{reply}");
    let body = format!(
        "POST /status HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\nConnection: close\r\n\r\n{}",
        "b".repeat(100000)
    );
    let (reply, _) = raw(&admin, body.as_bytes());
    assert!(reply.starts_with("HTTP/1.1 413"), "{reply}");
    let took = idle.join().unwrap();
    assert!(
        took >= Duration::from_secs(4) && took < Duration::from_secs(8),
        "an idle connection was closed after {took:?}, not the 5 s header timeout"
    );
}

/// Sends `bytes` to the TCP admin endpoint, reads until it closes; the reply and how long.
fn raw(admin: &str, bytes: &[u8]) -> (String, Duration) {
    let mut s = std::net::TcpStream::connect(admin).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let t = Instant::now();
    // The server may refuse (and close) before reading all of an oversized request.
    let _ = s.write_all(bytes);
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    (String::from_utf8_lossy(&out).into_owned(), t.elapsed())
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
