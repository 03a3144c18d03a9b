//! An unmodified `ib_write_bw` started without the shim next to a governed app (issue 23,
//! docs/tenants.md): the host's agent reports it within seconds (pid, uid, executable, why,
//! one WARN), measures what it sends from softrnic's per-process counters, and takes that out
//! of the host's budget, so the optimiser grants the governed app less.
//!
//! And a process that registers with the agent but sends without the shim, next to the same
//! governed app: found at the NIC above its grant, reported once, its excess taken out of
//! the host's budget.
//!
//! Needs root, perftest and the workspace built (`cargo build --workspace --release`).

use drum_test_support::{perftest, privileged, spawn, wait_listening};
use serde_json::Value;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

mod support;

use support::{bandwidth_options, bin, Cluster};

/// The hosts' line rate, 1 Gb/s (`--line-rate-gbps 1`), in bytes per second.
const LINE_RATE: f64 = 125e6;

impl Cluster {
    /// `softrnic exec` on `host`, without the shim.
    fn bare(&self, host: &str) -> Command {
        let mut c = Command::new(bin("softrnic"));
        c.env("SOFTRNIC_RUN_DIR", self.dir.join("softrnic"))
            .env_remove("LD_PRELOAD")
            .args(["exec", "--host", host, "--"]);
        c
    }

    /// `ib_write_bw` of 64 KiB messages for `secs`: a server on h1 and a client on h2, as app
    /// `app` under the shim, or bare (`None`: `softrnic exec` alone, no shim).
    fn writer(&self, app: Option<&str>, port: &str, secs: &str) -> (Child, Child) {
        let args = perftest("ib_write_bw", &bandwidth_options(secs, port));
        let ip = self.ok(&["addr", "h1"]).trim().to_string();
        let on = |host: &str, role: &str| -> Command {
            match app {
                Some(app) => {
                    let mut c = self.cmd();
                    c.args([
                        "exec",
                        "--host",
                        host,
                        "--app",
                        &format!("{app}{role}"),
                        "--",
                    ]);
                    c
                }
                None => self.bare(host),
            }
        };
        let mut server = spawn(on("h1", "-sink").args(&args));
        // perftest's client does not retry a connection its server does not take yet.
        wait_listening(&mut server, port.parse().unwrap(), Duration::from_secs(30));
        let client = spawn(on("h2", "").args(&args).arg(ip));
        (server, client)
    }

    /// `ib_write_bw` of 64 KiB messages for `secs` from h2 to h1 whose client registers with
    /// h2's agent as app `app` and then sends without the shim: a process that ignores its
    /// grant. It speaks the shim's `HELLO` itself, keeps the registration socket open across
    /// `exec` (same pid), and runs `ib_write_bw` bare.
    fn grant_ignorer(&self, app: &str, port: &str, secs: &str) -> (Child, Child) {
        const REGISTER_THEN_EXEC: &str = "import os, socket, sys\n\
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)\n\
s.connect(os.environ['DRUM_AGENT_SOCKET'])\n\
s.send(('DRUM1 HELLO pid=%d app=%s exe=/usr/bin/ib_write_bw' % (os.getpid(), os.environ['DRUM_APP'])).encode())\n\
msg = s.recvmsg(512, socket.CMSG_SPACE(4))[0]\n\
assert msg.startswith(b'DRUM1 WELCOME'), msg\n\
os.set_inheritable(s.fileno(), True)\n\
os.execvp(sys.argv[1], sys.argv[1:])\n";
        let mut args = vec!["-x", "0"];
        args.extend(bandwidth_options(secs, port));
        let ip = self.ok(&["addr", "h1"]).trim().to_string();
        let mut server = spawn(self.bare("h1").arg("ib_write_bw").args(&args));
        // perftest's client does not retry a connection its server does not take yet.
        wait_listening(&mut server, port.parse().unwrap(), Duration::from_secs(30));
        let client = spawn(
            self.bare("h2")
                .env("DRUM_AGENT_SOCKET", self.dir.join("h2/shim.sock"))
                .env("DRUM_APP", app)
                .args(["/usr/bin/python3", "-c", REGISTER_THEN_EXEC, "ib_write_bw"])
                .args(&args)
                .arg(ip),
        );
        (server, client)
    }

    /// What process `pid` on `host` has sent so far (softrnic's per-process counter). The
    /// counter goes when the process's last QP does, so a sender that is gone fails here by
    /// name, with the end of the host's engine log (a stalled emulator has made perftest
    /// clients give up), rather than reading as 0.
    fn sent(&self, host: &str, pid: u32) -> f64 {
        let dir = self.dir.join("softrnic/hosts").join(host);
        let stats = std::fs::read_to_string(dir.join("stats")).unwrap_or_default();
        let key = format!("proc_tx_bytes.{pid} ");
        stats
            .lines()
            .find_map(|l| l.strip_prefix(&key)?.trim().parse().ok())
            .unwrap_or_else(|| {
                let log = std::fs::read_to_string(dir.join("engine.log")).unwrap_or_default();
                let tail: Vec<&str> = log.lines().rev().take(5).collect();
                panic!(
                    "process {pid} on {host} has no QP at the NIC any more: it ended before \
                     the measurement; the engine's last lines, newest first: {tail:?}"
                )
            })
    }
}

/// App `app`'s granted rate on `host` (fraction of the line; None: not granted).
fn rate(s: &Value, host: &str, app: &str) -> Option<f64> {
    s["members"]
        .as_array()?
        .iter()
        .filter(|m| m["host"] == host)
        .flat_map(|m| m["apps"].as_array().cloned().unwrap_or_default())
        .find(|a| a["app"] == app && a["active"] == true)
        .and_then(|a| a["rate"].as_f64())
        .filter(|r| *r > 0.0)
}

/// The mean of `app`'s granted rate over `n` status polls, 250 ms apart.
fn mean_rate(c: &Cluster, host: &str, app: &str, n: usize) -> f64 {
    let mut sum = 0.0;
    for _ in 0..n {
        sum += rate(&c.status(), host, app).unwrap_or(0.0);
        std::thread::sleep(Duration::from_millis(250));
    }
    sum / n as f64
}

fn wait_until(limit: Duration, what: &str, mut ok: impl FnMut() -> bool) -> Duration {
    let t = Instant::now();
    while !ok() {
        assert!(t.elapsed() < limit, "{what}: not within {limit:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
    t.elapsed()
}

/// A two-host cluster in its own directory (`name` and this process's id) running app `bulk`
/// (`ib_write_bw` from h2 to h1 on `port` for 60 s under the shim), once its grant has
/// settled; with bulk's server and client and its mean grant alone.
fn cluster_with_bulk_settled(name: &str, port: &str) -> (Cluster, Child, Child, f64) {
    let dir = std::env::temp_dir().join(format!("drum-{name}-test-{}", std::process::id()));
    let c = Cluster { dir };
    c.ok(&["up", "--hosts", "2", "--line-rate-gbps", "1"]);
    let (server, client) = c.writer(Some("bulk"), port, "60");
    wait_until(Duration::from_secs(30), "a grant for bulk", || {
        rate(&c.status(), "h2", "bulk").is_some()
    });
    // Settled: the grant follows the app's measured demand for a few rounds.
    std::thread::sleep(Duration::from_secs(4));
    let alone = mean_rate(&c, "h2", "bulk", 8);
    (c, server, client, alone)
}

/// What became of bulk on h2 once process `other` sends beside it.
struct Beside {
    /// How long until bulk's grant fell below 80 % of `alone`.
    fell: Duration,
    /// Bulk's mean grant after that (fraction of the line).
    beside: f64,
    /// What `other` and bulk's client sent at the NIC over 2 s (fractions of the line).
    other_share: f64,
    bulk_share: f64,
    /// How many times h2's agent logged a budget cut for ungoverned traffic.
    budget_lines: usize,
}

/// Waits for bulk's grant to fall below 80 % of `alone` now that process `other` sends on h2
/// beside bulk's client `bulk`, then measures both at the NIC.
fn beside_bulk(c: &Cluster, other: u32, bulk: u32, alone: f64) -> Beside {
    let fell = wait_until(Duration::from_secs(30), "bulk's grant falls", || {
        rate(&c.status(), "h2", "bulk").is_some_and(|r| r < 0.8 * alone)
    });
    std::thread::sleep(Duration::from_secs(3));
    let beside = mean_rate(c, "h2", "bulk", 8);
    let (o0, b0) = (c.sent("h2", other), c.sent("h2", bulk));
    std::thread::sleep(Duration::from_secs(2));
    let (o1, b1) = (c.sent("h2", other), c.sent("h2", bulk));
    let budget_lines = c
        .agent_log("h2")
        .lines()
        .filter(|l| l.contains("less what ungoverned processes send"))
        .count();
    Beside {
        fell,
        beside,
        other_share: (o1 - o0) / 2.0 / LINE_RATE,
        bulk_share: (b1 - b0) / 2.0 / LINE_RATE,
        budget_lines,
    }
}

#[test]
fn a_bare_ib_write_bw_is_reported_and_its_traffic_comes_off_the_hosts_budget() {
    if let Err(why) = privileged(&["ib_write_bw"]) {
        eprintln!("SKIPPED: {why}");
        return;
    }
    let (c, _gs, mut gc, alone) = cluster_with_bulk_settled("ungoverned", "18951");

    let (_bs, mut bc) = c.writer(None, "18952", "40");
    let bare = bc.id();
    let warned = format!("pid={bare} uid=0");
    let found = wait_until(Duration::from_secs(10), "the bare client reported", || {
        c.agent_log("h2")
            .lines()
            .any(|l| l.contains(&warned) && l.contains("without DRUM's shim"))
    });
    let line = c
        .agent_log("h2")
        .lines()
        .find(|l| l.contains(&warned))
        .unwrap()
        .to_string();
    assert!(line.contains("exe=/usr/bin/ib_write_bw"), "{line}");
    assert!(line.contains("no shim loaded"), "{line}");
    assert!(found < Duration::from_secs(5), "reported after {found:?}");

    // Its traffic comes off h2's budget: bulk's grant falls.
    let Beside {
        fell,
        beside,
        other_share: bare_share,
        bulk_share,
        budget_lines,
    } = beside_bulk(&c, bare, gc.id(), alone);
    eprintln!(
        "bare ib_write_bw reported {:.2} s after its client started; bulk granted {alone:.3} of \
         the line alone, {beside:.3} beside it ({:.1} s later below 80 %); measured at the NIC \
         beside it: bare {bare_share:.3}, bulk {bulk_share:.3}; {budget_lines} budget changes logged",
        found.as_secs_f64(),
        fell.as_secs_f64()
    );
    assert!(beside < 0.8 * alone, "{beside} beside vs {alone} alone");
    assert!(
        bare_share > 0.1,
        "the bare client sends {bare_share} of the line"
    );
    assert!(budget_lines >= 1);
    assert!(
        gc.try_wait().unwrap().is_none(),
        "the governed client still runs"
    );
    let _ = bc.kill();
    let _ = gc.kill();
    let _ = bc.wait();
    let _ = gc.wait();
}

#[test]
fn a_registered_process_that_ignores_its_grant_is_reported_and_its_excess_comes_off_the_budget() {
    if let Err(why) = privileged(&["ib_write_bw", "python3"]) {
        eprintln!("SKIPPED: {why}");
        return;
    }
    let (c, _gs, mut gc, alone) = cluster_with_bulk_settled("overgrant", "18953");

    let (_is, mut ic) = c.grant_ignorer("greedy", "18954", "40");
    let pid = ic.id();
    let started = Instant::now();
    let registered = format!("pid={pid} ");
    wait_until(Duration::from_secs(10), "greedy registered", || {
        c.agent_log("h2")
            .lines()
            .any(|l| l.contains(&registered) && l.contains("greedy"))
    });
    let warned = format!("pid={pid} uid=0 app=greedy");
    wait_until(Duration::from_secs(20), "greedy reported", || {
        // A client that ended (it could not connect, its NIC went away) is never reported.
        if let Ok(Some(status)) = ic.try_wait() {
            panic!("greedy's client ended ({status}) before it was reported");
        }
        c.agent_log("h2")
            .lines()
            .any(|l| l.contains(&warned) && l.contains("above its grant"))
    });
    let found = started.elapsed();
    let log = c.agent_log("h2");
    let line = log.lines().find(|l| l.contains(&warned)).unwrap();
    eprintln!("{line}");
    let field = |k: &str| -> f64 {
        let at = line.find(&format!(" {k}=")).unwrap() + k.len() + 2;
        line[at..].split(' ').next().unwrap().parse().unwrap()
    };
    let (granted, measured) = (field("grant_bytes_per_s"), field("measured_bytes_per_s"));
    assert!(measured > 1.25 * granted, "{line}");
    // A 3 s window, a 1 s scan, and the client's connection set-up.
    assert!(found < Duration::from_secs(8), "reported after {found:?}");
    assert_eq!(
        log.lines()
            .filter(|l| l.contains("above its grant"))
            .count(),
        1,
        "one WARN, and none for the governed bulk"
    );
    // It is registered: not reported as ungoverned.
    assert!(!log
        .lines()
        .any(|l| l.contains(&format!("pid={pid} uid=0 gid")) && l.contains("without DRUM's shim")));

    // Its excess comes off h2's budget: bulk's grant falls.
    let Beside {
        fell,
        beside,
        other_share: greedy_share,
        bulk_share,
        budget_lines,
    } = beside_bulk(&c, pid, gc.id(), alone);
    eprintln!(
        "greedy reported {:.2} s after its client started (grant {:.3}, measured {:.3} of the \
         line over the window); bulk granted {alone:.3} of the line alone, {beside:.3} beside it \
         ({:.1} s later below 80 %); measured at the NIC beside it: greedy {greedy_share:.3}, \
         bulk {bulk_share:.3} ({:.2} of its grant); {budget_lines} budget changes logged",
        found.as_secs_f64(),
        granted / LINE_RATE,
        measured / LINE_RATE,
        fell.as_secs_f64(),
        bulk_share / beside
    );
    assert!(beside < 0.8 * alone, "{beside} beside vs {alone} alone");
    assert!(budget_lines >= 1);
    assert!(
        gc.try_wait().unwrap().is_none(),
        "the governed client still runs"
    );
    let _ = ic.kill();
    let _ = gc.kill();
    let _ = ic.wait();
    let _ = gc.wait();
}
