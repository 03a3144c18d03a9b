//! Certificate revocation and rotation with the real binary: `dev-certs` keeps its CA key and
//! an empty CRL, `--revoke` and `--reissue`; `serve` refuses a bad CRL file at start with the
//! reason, reloads its TLS files on SIGHUP, and keeps going when a reload fails.

use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_drum-coordinator"))
}

fn run(args: &[&str]) -> Output {
    bin().args(args).output().expect("run drum-coordinator")
}

fn ok(out: &Output) -> String {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn err(out: &Output) -> String {
    assert!(!out.status.success());
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// The serials `path` revokes.
fn revoked(path: &Path) -> usize {
    use rustls_pki_types::pem::PemObject;
    let der = rustls_pki_types::CertificateRevocationListDer::from_pem_file(path).unwrap();
    let crl = webpki::BorrowedCertRevocationList::from_der(der.as_ref()).unwrap();
    (&crl).into_iter().count()
}

/// A `serve` child that is killed (and reaped) when the test ends, passed or failed.
struct Guard(Child);

impl Drop for Guard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `serve` with a config it must refuse; a serve that starts anyway is killed and fails the
/// test instead of hanging it.
fn refused_serve(config: &Path) -> Output {
    let mut child = bin()
        .arg("serve")
        .arg("--config")
        .arg(config)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if t.elapsed() > Duration::from_secs(10) {
            let _ = child.kill();
            let _ = child.wait();
            panic!("serve started with {config:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

#[test]
fn dev_certs_revokes_and_reissues_with_its_kept_ca_key() {
    let dir = tempfile::tempdir().unwrap();
    let certs = dir.path().join("certs");
    let c = certs.to_str().unwrap();
    let out = ok(&run(&["dev-certs", "--out", c, "--agents", "h0,h1"]));
    assert!(out.contains("crl.pem"), "{out}");
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(certs.join("ca.key"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o077, 0, "the CA key is private");
    // The agents' DASR key: 32 random bytes, private too.
    assert!(out.contains("dasr.key"), "{out}");
    let key = certs.join("dasr.key");
    assert_eq!(std::fs::read(&key).unwrap().len(), 32);
    assert_eq!(
        std::fs::metadata(&key).unwrap().permissions().mode() & 0o077,
        0
    );
    assert_eq!(revoked(&certs.join("crl.pem")), 0);
    for host in ["h1", "h0", "h1"] {
        ok(&run(&["dev-certs", "--out", c, "--revoke", host]));
    }
    assert_eq!(revoked(&certs.join("crl.pem")), 2, "h1 once, h0 kept");
    let before = std::fs::read(certs.join("agent-h1.pem")).unwrap();
    ok(&run(&["dev-certs", "--out", c, "--reissue", "h1"]));
    assert_ne!(std::fs::read(certs.join("agent-h1.pem")).unwrap(), before);
    // Revoking the new certificate adds its serial; the old ones stay.
    ok(&run(&["dev-certs", "--out", c, "--revoke", "h1"]));
    assert_eq!(revoked(&certs.join("crl.pem")), 3);
    let out = ok(&run(&["dev-certs", "--out", c, "--revoke-coordinator"]));
    assert!(
        out.contains("revoked the coordinator's certificate"),
        "{out}"
    );
    assert_eq!(revoked(&certs.join("crl.pem")), 4);
    // Issue 19, item 9: the coordinator gets a new certificate after its revocation, and
    // `dev-certs` into a directory that holds a CA refuses rather than replace the CA and
    // wipe its CRL.
    let before = std::fs::read(certs.join("coordinator.pem")).unwrap();
    let ca = std::fs::read(certs.join("ca.pem")).unwrap();
    let out = ok(&run(&["dev-certs", "--out", c, "--reissue-coordinator"]));
    assert!(out.contains("coordinator.pem"), "{out}");
    assert_ne!(
        std::fs::read(certs.join("coordinator.pem")).unwrap(),
        before
    );
    let e = err(&run(&["dev-certs", "--out", c, "--agents", "h2"]));
    assert!(e.contains("already holds a dev CA"), "{e}");
    assert_eq!(std::fs::read(certs.join("ca.pem")).unwrap(), ca);
    assert_eq!(revoked(&certs.join("crl.pem")), 4, "the CRL is kept");
    let e = err(&run(&["dev-certs", "--out", c, "--crl-days", "3"]));
    assert!(e.contains("--crl-days applies to"), "{e}");
    let e = err(&run(&["dev-certs", "--out", c, "--revoke", "nohost"]));
    assert!(e.contains("agent-nohost.pem"), "{e}");
    let e = err(&run(&["dev-certs", "--out", c, "--revoke", "../h0"]));
    assert!(e.contains("may only hold"), "{e}");
    let other = dir.path().join("other");
    std::fs::create_dir_all(&other).unwrap();
    let e = err(&run(&[
        "dev-certs",
        "--out",
        other.to_str().unwrap(),
        "--reissue",
        "h0",
    ]));
    assert!(e.contains("ca.key") && e.contains("dev-certs --out"), "{e}");
}

/// A coordinator config in `dir` with `crl` as its CRL file.
fn config(dir: &Path, crl: &str) -> std::path::PathBuf {
    let p = dir.join("coordinator.toml");
    std::fs::write(
        &p,
        format!(
            "listen = \"127.0.0.1:0\"\ninstance = \"instance.json\"\n\
             [tls]\nca = \"certs/ca.pem\"\ncert = \"certs/coordinator.pem\"\n\
             key = \"certs/coordinator.key\"\ncrl = \"{crl}\"\n"
        ),
    )
    .unwrap();
    p
}

/// `serve` with the CRL `certs/crl.pem` in `d` (set up as below), logging to `d/serve.log`.
fn serving(d: &Path) -> (Guard, std::path::PathBuf) {
    let log = d.join("serve.log");
    let serve = Guard(
        bin()
            .args(["serve", "--config"])
            .arg(config(d, "certs/crl.pem"))
            .env("DRUM_LOG", "info")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap(),
    );
    (serve, log)
}

/// Waits (at most 10 s) until `what` stands `n` times in the log.
fn wait_in_log(log: &Path, what: &str, n: usize) {
    let t = Instant::now();
    while std::fs::read_to_string(log).unwrap().matches(what).count() < n {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "no {what:?} in the log"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `dev-certs --revoke agent` (and `extra`) on the certificates `tls_setup` made in `d`.
fn revoke_agent(d: &Path, extra: &[&str]) {
    let out = d.join("certs");
    let mut args = vec![
        "dev-certs",
        "--out",
        out.to_str().unwrap(),
        "--revoke",
        "agent",
    ];
    args.extend_from_slice(extra);
    ok(&run(&args));
}

/// Certificates, a CRL and an instance in `d`.
fn tls_setup(d: &Path) {
    ok(&run(&[
        "dev-certs",
        "--out",
        d.join("certs").to_str().unwrap(),
    ]));
    ok(&run(&[
        "simulate",
        "--hosts",
        "2",
        "--apps",
        "2",
        "--write-instance",
        d.join("instance.json").to_str().unwrap(),
    ]));
}

/// A CRL (or certificate) rewritten on disk is read again without SIGHUP: the daemon watches
/// its TLS files ([`drum_net::pki::TLS_WATCH_PERIOD`]).
#[test]
fn serve_reloads_its_tls_files_when_they_change_on_disk() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    tls_setup(d);
    let (mut serve, log) = serving(d);
    wait_in_log(&log, "coordinator serving", 1);
    revoke_agent(d, &[]);
    wait_in_log(&log, "a TLS file changed on disk", 1);
    wait_in_log(&log, "reloaded the TLS files", 1);
    assert!(serve.0.try_wait().unwrap().is_none(), "still serving");
}

/// A CRL past its next update vouches for nobody: a running `serve` keeps its previous TLS
/// files when the one on disk is expired, and refuses to start with it.
#[test]
fn an_expired_crl_is_refused_at_reload_and_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    tls_setup(d);
    let (mut serve, log) = serving(d);
    wait_in_log(&log, "coordinator serving", 1);
    revoke_agent(d, &["--crl-days", "0"]);
    wait_in_log(
        &log,
        "TLS reload failed, keeping the previous certificates",
        1,
    );
    assert!(std::fs::read_to_string(&log).unwrap().contains("expired"));
    assert!(serve.0.try_wait().unwrap().is_none(), "still serving");
    drop(serve);
    let e = err(&refused_serve(&config(d, "certs/crl.pem")));
    assert!(
        e.contains("certificate revocation list") && e.contains("expired"),
        "{e}"
    );
}

#[test]
fn serve_checks_its_crl_and_reloads_on_sighup() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    tls_setup(d);
    ok(&run(&[
        "dev-certs",
        "--out",
        d.join("other").to_str().unwrap(),
    ]));
    std::fs::write(d.join("garbage.pem"), "no CRL in here\n").unwrap();
    for (crl, want) in [
        ("garbage.pem", "holds no CRL"),
        ("missing.pem", "missing.pem"),
        ("other/crl.pem", "is not a valid CRL of the configured CA"),
        ("certs/ca.pem", "holds no CRL"),
    ] {
        let e = err(&refused_serve(&config(d, crl)));
        assert!(
            e.contains("certificate revocation list") && e.contains(want),
            "{crl}: {e}"
        );
    }
    let (serve, log) = serving(d);
    let wait_log = |what: &str, n: usize| wait_in_log(&log, what, n);
    wait_log("coordinator serving", 1);
    let hup = || {
        let s = Command::new("kill")
            .args(["-HUP", &serve.0.id().to_string()])
            .status()
            .unwrap();
        assert!(s.success());
    };
    revoke_agent(d, &[]);
    hup();
    wait_log("reloaded the TLS files", 1);
    // A reload that fails keeps the service and its previous files.
    std::fs::write(d.join("certs/crl.pem"), "broken").unwrap();
    hup();
    wait_log("TLS reload failed, keeping the previous certificates", 1);
    std::thread::sleep(Duration::from_millis(100));
    let mut serve = serve;
    assert!(serve.0.try_wait().unwrap().is_none(), "still serving");
}

/// Issue 19, item 7: `dev-certs` run as root writes every key 0600; `install.sh certs` makes
/// the daemons' keys readable by the units' group (here the test's own group, as `DRUM_GROUP`),
/// and keeps the CA's key private.
#[test]
fn install_certs_makes_the_daemon_keys_readable_by_the_service_group() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let dir = tempfile::tempdir().unwrap();
    let certs = dir.path().join("certs");
    ok(&run(&[
        "dev-certs",
        "--out",
        certs.to_str().unwrap(),
        "--agents",
        "h0",
    ]));
    let gid = std::fs::metadata(dir.path()).unwrap().gid();
    let group = Command::new("id").arg("-gn").output().unwrap();
    let group = String::from_utf8_lossy(&group.stdout).trim().to_string();
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/install.sh");
    let out = Command::new("sh")
        .arg(script)
        .arg("certs")
        .arg(&certs)
        .env("DRUM_GROUP", &group)
        .output()
        .unwrap();
    ok(&out);
    let meta = |f: &str| std::fs::metadata(certs.join(f)).unwrap();
    for key in ["coordinator.key", "agent-h0.key"] {
        assert_eq!(meta(key).permissions().mode() & 0o777, 0o640, "{key}");
        assert_eq!(meta(key).gid(), gid, "{key}");
    }
    assert_eq!(meta("ca.key").permissions().mode() & 0o777, 0o600);
    assert_eq!(meta("coordinator.pem").permissions().mode() & 0o777, 0o644);
    assert_eq!(meta(".").permissions().mode() & 0o777, 0o750);
    // A reissued key keeps the group's access (the file is rewritten in place).
    ok(&run(&[
        "dev-certs",
        "--out",
        certs.to_str().unwrap(),
        "--reissue-coordinator",
    ]));
    assert_eq!(meta("coordinator.key").permissions().mode() & 0o777, 0o640);
}
