//! What the shim's integration tests share: softrnic run directories torn down on drop,
//! children with deadlines, client/server pairs, and parsers of perftest's and the shim's
//! output. Each test binary uses part of it.
#![allow(dead_code)]

pub mod agent;

pub use drum_test_support::{have, run_timeout, spawn, text, wait_timeout};

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

/// `<target>/release`: the test binary lives in `<target>/release/deps/`.
pub fn target_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    exe.parent()
        .and_then(Path::parent)
        .expect("test binary is in <target>/<profile>/deps")
        .to_path_buf()
}

pub fn built(name: &str) -> PathBuf {
    let p = target_dir().join(name);
    assert!(
        p.is_file(),
        "{} is missing: cargo test does not build it; run `cargo build --release -p softrnic \
         -p softrnic-provider -p drum-shim` (or `cargo build --workspace --release`) with the same CARGO_TARGET_DIR \
         first",
        p.display()
    );
    p
}

pub fn shim() -> PathBuf {
    built("libdrum_shim.so")
}

/// Can these tests run here (root, namespaces, `ibv_rc_pingpong`, `ip`)?
pub fn privileged() -> Result<(), String> {
    drum_test_support::privileged(&["ibv_rc_pingpong", "ip"])
}

#[macro_export]
macro_rules! require_privileges {
    () => {
        if let Err(why) = $crate::support::privileged() {
            eprintln!("SKIPPED: {why}");
            return;
        }
    };
}

/// A softrnic run directory that is torn down (`softrnic down`) when dropped.
pub struct Run {
    pub dir: PathBuf,
    bin: PathBuf,
}

impl Run {
    pub fn new(name: &str) -> Run {
        let bin = built("softrnic");
        // The ".run" suffix keeps every run directory from being a prefix of another:
        // `softrnic down` recognises its engines by a substring match of the run directory
        // in their command line, so `down` of `…-pingpong` would kill the engines of
        // `…-pingpong-events`.
        let name = format!("drum-shim-test-{}-{name}.run", std::process::id());
        let dir = std::env::temp_dir().join(name);
        Run { dir, bin }
    }

    pub fn cmd(&self) -> Command {
        let mut c = Command::new(&self.bin);
        c.env("SOFTRNIC_RUN_DIR", &self.dir);
        c
    }

    pub fn up(&self, args: &[&str]) {
        let out = run_timeout(self.cmd().arg("up").args(args), Duration::from_secs(60));
        assert!(out.status.success(), "up failed: {}", text(&out));
    }

    pub fn addr(&self, host: &str) -> String {
        let out = run_timeout(self.cmd().args(["addr", host]), Duration::from_secs(10));
        assert!(out.status.success(), "addr failed: {}", text(&out));
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }

    /// The engine counters of `host` (`softrnic stats`), after the engine has had time to
    /// publish the last ones.
    pub fn settled_stats(&self, host: &str) -> HashMap<String, u64> {
        std::thread::sleep(Duration::from_millis(450));
        drum_test_support::softrnic_stats(self.cmd().args(["stats", host]))
    }

    /// `prog` on `host`, through the shim when `with_shim`. `LD_PRELOAD` is given to
    /// `softrnic exec`, which puts its provider after the shim (an
    /// `env LD_PRELOAD=…` inside the exec would drop the provider).
    /// `shim_env` are extra variables for the shim (e.g. its pacer).
    pub fn exec(
        &self,
        host: &str,
        prog: &[&str],
        with_shim: bool,
        shim_env: &[(&str, &str)],
    ) -> Command {
        let mut c = self.cmd();
        for v in [
            "LD_PRELOAD",
            "DRUM_SHIM_LOG",
            "DRUM_APP",
            "DRUM_SHIM_RATE_WQE_PER_S",
            "DRUM_SHIM_RATE_BYTES_PER_S",
            "DRUM_SHIM_BURST_BYTES",
            "DRUM_SHIM_MAX_ACTIVE_QPS",
            "DRUM_SHIM_QUANTUM_US",
            "DRUM_SHIM_RATE_CQE_PER_S",
            "DRUM_SHIM_VIRTUAL_CQ",
        ] {
            c.env_remove(v);
        }
        // Never the machine's own agent: tests that want one pass its socket.
        c.env("DRUM_AGENT_SOCKET", self.dir.join("no-agent.sock"));
        if with_shim {
            c.env("LD_PRELOAD", shim()).env("DRUM_SHIM_LOG", "1");
            c.envs(shim_env.iter().copied());
        }
        c.args(["exec", "--host", host, "--"]).args(prog);
        c
    }
}

impl Drop for Run {
    fn drop(&mut self) {
        if std::thread::panicking() {
            // The engines' own account of a failure, before `down` removes it.
            for h in ["h1", "h2"] {
                let log = self.dir.join("hosts").join(h).join("engine.log");
                if let Ok(l) = std::fs::read_to_string(&log) {
                    let tail: Vec<&str> = l.lines().rev().take(15).collect();
                    let tail: Vec<&str> = tail.into_iter().rev().collect();
                    eprintln!("--- {}:\n{}", log.display(), tail.join("\n"));
                }
            }
        }
        let out = run_timeout(self.cmd().arg("down"), Duration::from_secs(30));
        if !out.status.success() {
            eprintln!("softrnic down failed: {}", text(&out));
        }
    }
}

/// Run `args` as a server on h1 and as a client (`args` + h1's address) on h2; retries the
/// client while the server is not listening yet.
pub fn pair(run: &Run, sargs: &[&str], with_shim: bool) -> (Output, Output) {
    pair_env(run, sargs, with_shim, &[])
}

/// [`pair`] with `shim_env` for both sides, except that a server given `DRUM_APP=APP`
/// registers as `APP-server`: one test agent stands for both hosts' agents, and two processes
/// of one app under one agent share the app's grant (docs/tenants.md), where on two hosts
/// each would hold its host's whole grant. A test that wants the server governed too pins
/// `APP-server` as well.
pub fn pair_env(
    run: &Run,
    sargs: &[&str],
    with_shim: bool,
    shim_env: &[(&str, &str)],
) -> (Output, Output) {
    let server_app: Vec<(String, String)> = shim_env
        .iter()
        .map(|&(k, v)| {
            let v = if k == "DRUM_APP" {
                format!("{v}-server")
            } else {
                v.to_string()
            };
            (k.to_string(), v)
        })
        .collect();
    let server_env: Vec<(&str, &str)> = server_app
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    let server_ip = run.addr("h1");
    let mut cargs = sargs.to_vec();
    cargs.push(&server_ip);
    let mut attempt = 1;
    loop {
        let mut server = spawn(&mut run.exec("h1", sargs, with_shim, &server_env));
        let mut client;
        let t = Instant::now();
        loop {
            std::thread::sleep(Duration::from_millis(200));
            client = run_timeout(
                &mut run.exec("h2", &cargs, with_shim, shim_env),
                Duration::from_secs(60),
            );
            let refused = drum_test_support::server_not_listening_yet(&client);
            if !refused || t.elapsed() > Duration::from_secs(10) {
                break;
            }
        }
        if attempt < 5 && drum_test_support::perftest_cm_listen_race(&client) {
            eprintln!("{sargs:?}: perftest's listen race (attempt {attempt}); both sides again");
            let _ = server.kill();
            wait_timeout(server, Duration::from_secs(10));
            attempt += 1;
            continue;
        }
        return (wait_timeout(server, Duration::from_secs(60)), client);
    }
}

/// The shim's exit summary (`drum-shim: pid=… key=value …`) as numbers; panics if absent.
pub fn summary(o: &Output, who: &str) -> HashMap<String, u64> {
    let err = String::from_utf8_lossy(&o.stderr);
    let line = err
        .lines()
        .find(|l| l.starts_with("drum-shim: pid="))
        .unwrap_or_else(|| panic!("{who}: no shim summary:\n{}", text(o)));
    line["drum-shim: ".len()..]
        .split_whitespace()
        .filter_map(|kv| {
            let (k, v) = kv.split_once('=')?;
            Some((k.to_string(), v.parse().ok()?))
        })
        .collect()
}

pub fn assert_ok(o: &Output, who: &str) {
    assert!(o.status.success(), "{who}: {}", text(o));
}

/// Both sides succeeded; on failure shows both (a hung server is often explained by its
/// client).
pub fn assert_pair_ok(server: &Output, client: &Output, who: &str) {
    assert!(
        server.status.success() && client.status.success(),
        "{who}\n--- server: {}\n--- client: {}",
        text(server),
        text(client)
    );
}

/// perftest's result row as numbers: #bytes, #iterations, then the measurements.
pub fn result_fields(o: &Output, who: &str) -> Vec<f64> {
    let out = String::from_utf8_lossy(&o.stdout);
    let mut lines = out
        .lines()
        .skip_while(|l| !l.trim_start().starts_with("#bytes"));
    lines.next();
    let row = lines
        .next()
        .unwrap_or_else(|| panic!("{who}: no result row:\n{}", text(o)));
    row.split_whitespace()
        .filter_map(|x| x.parse().ok())
        .collect()
}

/// perftest's result row: (#bytes, #iterations).
pub fn result_row(o: &Output, who: &str) -> (u64, u64) {
    let f = result_fields(o, who);
    assert!(f.len() >= 2, "{who}: bad result row {f:?}");
    (f[0] as u64, f[1] as u64)
}

/// The shim's stderr lines other than its exit summary, its attach log and the expected
/// "no DRUM agent" notice of a test run without an agent.
pub fn shim_complaints(o: &Output) -> Vec<String> {
    String::from_utf8_lossy(&o.stderr)
        .lines()
        .filter(|l| l.starts_with("drum-shim:"))
        .filter(|l| {
            ![
                "drum-shim: pid=",
                "drum-shim: no DRUM agent",
                "drum-shim: attached",
            ]
            .iter()
            .any(|p| l.starts_with(p))
        })
        .map(str::to_string)
        .collect()
}

/// Compiles `tests/c/NAME.c` against the installed libibverbs into the run directory.
pub fn compile_probe(run: &Run, name: &str) -> String {
    compile_c(run, &format!("tests/c/{name}.c"))
}

/// Compiles the C program at `src` (relative to this crate) into the run directory.
pub fn compile_c(run: &Run, src: &str) -> String {
    compile_c_with(run, src, &["-libverbs", "-lpthread"])
}

/// [`compile_c`], linking `libs`.
pub fn compile_c_with(run: &Run, src: &str, libs: &[&str]) -> String {
    let name = Path::new(src).file_stem().unwrap().to_str().unwrap();
    compile_c_as(run, src, name, libs)
}

/// Compiles `src` into `name` in the run's directory with `args` (flags and libraries).
pub fn compile_c_as(run: &Run, src: &str, name: &str, args: &[&str]) -> String {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join(src);
    let bin = run.dir.join(name);
    std::fs::create_dir_all(&run.dir).unwrap();
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let out = run_timeout(
        Command::new(&cc)
            .args(["-O2", "-Wall", "-Werror", "-o"])
            .arg(&bin)
            .arg(&src)
            .args(args),
        Duration::from_secs(60),
    );
    assert_ok(
        &out,
        &format!("cc {} (needs libibverbs-dev)", src.display()),
    );
    bin.to_str().unwrap().to_string()
}

/// The completion rate `vcq_probe` printed.
pub fn probe_rate(o: &Output, who: &str) -> f64 {
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.ends_with("vcq ok\n"), "{who}: {}", text(o));
    out.lines()
        .find_map(|l| l.strip_prefix("rate ")?.parse().ok())
        .unwrap_or_else(|| panic!("{who}: no rate: {out}"))
}

/// Checks a rate the shim enforces against its `grant`: `measure` runs the program once and
/// returns the rate it achieved. Every run must stay under `grant × (1 + tolerance)` —
/// exceeding a grant is a bug. Falling short is lateness: the thread that releases held-back
/// work was not scheduled in time (a shared 2-core CI machine once lost 15–19 % of a
/// one-second run to that), so the floor `grant × (1 − tolerance)` is checked on the best of
/// up to three runs. Returns the rates measured.
pub fn assert_holds_grant(
    what: &str,
    grant: f64,
    tolerance: f64,
    mut measure: impl FnMut() -> f64,
) -> Vec<f64> {
    let mut rates = Vec::new();
    for _ in 0..3 {
        let r = measure();
        rates.push(r);
        assert!(
            r <= grant * (1.0 + tolerance),
            "{what}: {rates:.0?}/s under a grant of {grant}/s"
        );
        if r >= grant * (1.0 - tolerance) {
            return rates;
        }
    }
    panic!("{what}: {rates:.0?}/s under a grant of {grant}/s, short in three runs");
}

/// The rate at which the shim's own WQE limit let the WQEs of a run out, from its exit
/// summary: those admitted past the limiter's burst of `burst`, over the shim's monotonic
/// time from the first admission to the last (the GCRA bound: n admissions in a span s
/// satisfy n − burst ≤ s · rate). perftest's own rates are no measure of a pacer under load:
/// it converts its cycle counter at a frequency it re-estimates against `gettimeofday` and
/// uses instead of `/proc/cpuinfo`'s, silently, when the two differ by more than 2 % — a
/// preempted estimate (a CI run reported 552 WQE/s under a 500 WQE/s grant that held at
/// 504–505 in every run here).
pub fn paced_wqe_rate(s: &HashMap<String, u64>, burst: u64, who: &str) -> f64 {
    let (n, span_us) = (s["paced_wqes"], s["paced_span_us"]);
    assert!(n > burst && span_us > 0, "{who}: nothing paced: {s:?}");
    (n - burst) as f64 / (span_us as f64 / 1e6)
}

/// The burst of the shim's WQE limiter at `rate` (`Gcra::default_burst`: 5 ms of it, at
/// least two).
pub fn default_wqe_burst(rate: f64) -> u64 {
    (rate * 0.005).round().max(2.0) as u64
}
