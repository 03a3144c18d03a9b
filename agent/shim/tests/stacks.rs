//! RDMA stacks nobody here wrote — qperf, UCX (`ucx_perftest`) and Open MPI over UCX — run
//! unmodified over softrnic between emulated hosts three ways: on the bare device, through
//! the shim with no agent (fail-open), and governed by a real `drum-agent --local` whose pin
//! throttles them (a WQE rate and an active-QP limit). No UCX workaround variable is set.
//!
//! Needs root, the workspace built (`cargo build --workspace --release`) and Debian's
//! `qperf`, `ucx-utils`, `openmpi-bin` and `libopenmpi-dev` (`scripts/setup.sh` installs
//! them); each test skips with a message where its part is missing.

mod support;

use std::process::Output;
use std::time::Duration;
use support::agent::Agent;
use support::*;

/// The stacks busy-poll both cores: the tests take turns, so that one's load does not stall
/// another's (a qperf server under UCX's and Open MPI's load once missed its deadline).
static TURN: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn take_turn() -> std::sync::MutexGuard<'static, ()> {
    TURN.lock().unwrap_or_else(|e| e.into_inner())
}

/// The pin that governs every stack here: a WQE rate well below what each reaches
/// unthrottled, and fewer active QPs than UCX and Open MPI open.
const WQE_RATE: u64 = 2000;
const PIN: &str = "rate_wqe_per_s = 2000\nmax_active_qps = 2\n";

#[derive(Clone, Copy, Debug, PartialEq)]
enum Mode {
    Bare,
    FailOpen,
    Governed,
}

const MODES: [Mode; 3] = [Mode::Bare, Mode::FailOpen, Mode::Governed];

/// Where a stack runs in one mode: the run, and the agent of the governed mode.
struct Stage<'a> {
    run: &'a Run,
    mode: Mode,
    agent: Option<Agent>,
    app: &'static str,
}

impl<'a> Stage<'a> {
    fn new(run: &'a Run, mode: Mode, app: &'static str) -> Stage<'a> {
        let agent = (mode == Mode::Governed).then(|| {
            let pins = format!("[shim.apps.{app}]\n{PIN}");
            Agent::start(&run.dir, &format!("agent-{app}"), 1.0, &pins)
        });
        Stage {
            run,
            mode,
            agent,
            app,
        }
    }

    fn exec(&self, host: &str, prog: &[&str], env: &[(&str, &str)]) -> std::process::Command {
        let mut vars: Vec<(&str, &str)> = env.to_vec();
        if let Some(a) = &self.agent {
            vars.extend(a.env(self.app));
        }
        let mut c = self.run.exec(host, prog, self.mode != Mode::Bare, &[]);
        c.envs(vars);
        c
    }

    /// Checks the shim's account of a run: none on the bare device; through the shim, the
    /// processes that opened a device were governed by the pin exactly when an agent ran.
    /// The pin is the app's: the processes of the app under the one agent (both hosts' here,
    /// both ranks on one host for Open MPI) each hold a part of its WQE rate, never more than
    /// the whole (docs/tenants.md, "An app's grant is split among its processes").
    fn check_shim(&self, outputs: &[&Output], who: &str) {
        let lines: Vec<String> = outputs
            .iter()
            .flat_map(|o| {
                String::from_utf8_lossy(&o.stderr)
                    .lines()
                    .filter(|l| l.starts_with("drum-shim: pid="))
                    .map(str::to_string)
                    .collect::<Vec<_>>()
            })
            .collect();
        let with_device: Vec<&String> = lines
            .iter()
            .filter(|l| !l.contains(" governed_contexts=0 "))
            .collect();
        match self.mode {
            Mode::Bare => assert!(lines.is_empty(), "{who}: {lines:?}"),
            Mode::FailOpen => {
                assert!(!with_device.is_empty(), "{who}: no shim summary: {lines:?}");
                for l in &with_device {
                    assert!(l.contains(" governed=no "), "{who}: {l}");
                }
            }
            Mode::Governed => {
                assert!(!with_device.is_empty(), "{who}: no shim summary: {lines:?}");
                for l in &with_device {
                    assert!(l.contains(" governed=yes "), "{who}: {l}");
                    let rate: u64 = l
                        .split_whitespace()
                        .find_map(|f| f.strip_prefix("rate_wqe_per_s=")?.parse().ok())
                        .unwrap_or_else(|| panic!("{who}: no rate_wqe_per_s: {l}"));
                    assert!((1..=WQE_RATE).contains(&rate), "{who}: {l}");
                    assert!(l.contains(" max_active_qps=2 "), "{who}: {l}");
                }
            }
        }
    }
}

fn require(programs: &[&str]) -> bool {
    if let Some(p) = programs.iter().find(|p| !have(p)) {
        eprintln!("SKIPPED: {p} not installed (scripts/setup.sh installs it)");
        return false;
    }
    true
}

/// The value of qperf's first `NAME = VALUE UNIT` line after `test:`, in its base unit.
fn qperf_value(out: &str, test: &str) -> f64 {
    let after = out
        .split_once(&format!("{test}:\n"))
        .unwrap_or_else(|| panic!("no {test} in {out}"))
        .1;
    let line = after.lines().next().unwrap();
    let mut f = line.split('=').nth(1).unwrap().split_whitespace();
    let v: f64 = f.next().unwrap().parse().unwrap();
    let scale = match f.next().unwrap() {
        u if u.starts_with('K') => 1e3,
        u if u.starts_with('M') => 1e6,
        u if u.starts_with('G') => 1e9,
        "ns" => 1e-3,
        "ms" => 1e3,
        _ => 1.0,
    };
    v * scale
}

/// qperf's RC tests over the RDMA connection manager (its UC and UD tests exchange no GID and
/// cannot run on a RoCE port): each reports a figure in every mode, and the governed
/// `rc_bw` stays within the pinned WQE rate (qperf sends 64 KiB messages).
#[test]
fn qperf_rc_tests_bare_fail_open_and_governed() {
    let _turn = take_turn();
    require_privileges!();
    if !require(&["qperf"]) {
        return;
    }
    let run = Run::new("qperf");
    run.up(&["--hosts", "2"]);
    let ip = run.addr("h1");
    let tests = [
        "rc_bw",
        "rc_lat",
        "rc_rdma_write_bw",
        "rc_rdma_read_lat",
        "rc_compare_swap_mr",
    ];
    let mut bw = Vec::new();
    for mode in MODES {
        let who = format!("qperf, {mode:?}");
        let stage = Stage::new(&run, mode, "qperf");
        let mut args = vec!["qperf", "-cm1", "-t", "1", ip.as_str()];
        args.extend(tests);
        args.push("quit");
        let mut attempt = 1;
        let (server, client) = loop {
            let mut server = spawn(&mut stage.exec("h1", &["qperf"], &[]));
            // qperf's client does not retry a connection its server does not take yet;
            // 19765 is qperf's listening port.
            drum_test_support::wait_listening(&mut server, 19765, Duration::from_secs(30));
            let client = run_timeout(&mut stage.exec("h2", &args, &[]), Duration::from_secs(90));
            // Between two tests qperf's server listens on RDMA CM only after telling the
            // client the next test over TCP, and the client connects at once: a client that
            // wins that race is rejected for want of a listener, as on a NIC (seen under
            // load). Both sides run again then.
            let rejected = !client.status.success()
                && String::from_utf8_lossy(&client.stdout)
                    .contains("unexpected event from RDMA CM: Event rejected");
            if rejected && attempt < 4 {
                eprintln!(
                    "{who}: qperf's RDMA CM listen race (attempt {attempt}); both sides again"
                );
                let _ = server.kill();
                wait_timeout(server, Duration::from_secs(10));
                attempt += 1;
                continue;
            }
            break (wait_timeout(server, Duration::from_secs(60)), client);
        };
        assert_pair_ok(&server, &client, &who);
        let out = String::from_utf8_lossy(&client.stdout);
        for t in tests {
            assert!(qperf_value(&out, t) > 0.0, "{who}: {t}: {out}");
        }
        bw.push(qperf_value(&out, "rc_bw"));
        stage.check_shim(&[&server, &client], &who);
    }
    let ceiling = WQE_RATE as f64 * 65536.0 * 1.1;
    assert!(bw[2] <= ceiling, "governed rc_bw {} B/s > {ceiling}", bw[2]);
    eprintln!(
        "qperf rc_bw B/s: bare {} fail-open {} governed {}",
        bw[0], bw[1], bw[2]
    );
}

/// `ucx_perftest` between two hosts over UCX's RC and UD verbs transports and over UD
/// alone: tag-matching latency and bandwidth and a put bandwidth test complete in every
/// mode, with no UCX warning about the data it received.
#[test]
fn ucx_perftest_bare_fail_open_and_governed() {
    let _turn = take_turn();
    require_privileges!();
    if !require(&["ucx_perftest"]) {
        return;
    }
    let run = Run::new("ucx");
    run.up(&["--hosts", "2"]);
    let ip = run.addr("h1");
    for tls in ["rc_verbs,ud_verbs", "ud_verbs"] {
        let env = [
            ("UCX_TLS", tls),
            ("UCX_NET_DEVICES", "softrnic0:1"),
            ("UCX_WARN_UNUSED_ENV_VARS", "n"),
        ];
        for (test, size) in [
            ("tag_lat", "8"),
            ("tag_bw", "4096"),
            ("ucp_put_bw", "65536"),
        ] {
            if tls == "ud_verbs" && test == "ucp_put_bw" {
                // UD has no RDMA write: UCX emulates puts with active messages, tested above.
                continue;
            }
            for mode in MODES {
                let who = format!("ucx_perftest -t {test} over {tls}, {mode:?}");
                let stage = Stage::new(&run, mode, "ucx");
                let args = ["ucx_perftest", "-t", test, "-s", size, "-n", "2000"];
                let server = spawn(&mut stage.exec("h1", &args, &env));
                std::thread::sleep(Duration::from_millis(500));
                let mut cargs = args.to_vec();
                cargs.push(&ip);
                let client =
                    run_timeout(&mut stage.exec("h2", &cargs, &env), Duration::from_secs(90));
                let server = wait_timeout(server, Duration::from_secs(30));
                assert_pair_ok(&server, &client, &who);
                let out = String::from_utf8_lossy(&client.stdout);
                let fin = out.lines().find(|l| l.starts_with("Final:"));
                let fin = fin.unwrap_or_else(|| panic!("{who}: {}", text(&client)));
                eprintln!(
                    "{who}: {}",
                    fin.split_whitespace().collect::<Vec<_>>().join(" ")
                );
                for o in [&server, &client] {
                    let err = String::from_utf8_lossy(&o.stderr);
                    assert!(
                        !err.contains("UCX  WARN") && !err.contains("UCX  ERROR"),
                        "{who}: {err}"
                    );
                }
                stage.check_shim(&[&server, &client], &who);
            }
        }
    }
}

/// Open MPI over UCX (`--mca pml ucx`) running a ping-pong that checks every byte, with both
/// ranks on one host and with one rank on each of two hosts (mpirun starts the remote
/// daemons through `softrnic exec`).
#[test]
fn open_mpi_over_ucx_bare_fail_open_and_governed() {
    let _turn = take_turn();
    require_privileges!();
    if !require(&["mpirun", "mpicc"]) {
        return;
    }
    let run = Run::new("mpi");
    run.up(&["--hosts", "2"]);
    let bin = run.dir.join("mpi_pingpong");
    let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/c/mpi_pingpong.c");
    let out = run_timeout(
        std::process::Command::new("mpicc")
            .args(["-O2", "-Wall", "-Werror", "-o"])
            .arg(&bin)
            .arg(&src),
        Duration::from_secs(60),
    );
    assert_ok(&out, "mpicc");
    // mpirun's remote shell: "HOST COMMAND…" runs COMMAND on emulated host HOST. The
    // emulated hosts share the machine's host name and /tmp, where Open MPI's daemons make
    // their session directories: each host gets a TMPDIR of its own, or two daemons race
    // for one directory ("mkdir … File exists").
    let rsh = run.dir.join("rsh");
    std::fs::write(
        &rsh,
        format!(
            "#!/bin/sh\nhost=$1; shift\nexport TMPDIR='{dir}'/tmp-$host\nmkdir -p \"$TMPDIR\"\n\
             SOFTRNIC_RUN_DIR='{dir}' exec '{softrnic}' exec --host \"$host\" -- sh -c \"$*\"\n",
            dir = run.dir.display(),
            softrnic = built("softrnic").display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&rsh, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let bin = bin.to_str().unwrap();
    let rsh = rsh.to_str().unwrap();
    for (placement, hosts) in [("one host", "h1:2"), ("two hosts", "h1,h2")] {
        for mode in MODES {
            let who = format!("Open MPI, {placement}, {mode:?}");
            let stage = Stage::new(&run, mode, "mpi");
            let mut args = vec![
                "mpirun",
                "--allow-run-as-root",
                "-np",
                "2",
                "--host",
                hosts,
                "--mca",
                "plm_rsh_agent",
                rsh,
                "--mca",
                "pml",
                "ucx",
                "--mca",
                "btl",
                "self",
                "--mca",
                "osc",
                "^ucx",
                "-x",
                "UCX_NET_DEVICES=softrnic0:1",
                "-x",
                "UCX_TLS=rc_verbs,ud_verbs,self",
            ];
            // The ranks get the shim's variables from mpirun (which passes on only these).
            let shim_vars: &[&str] = match mode {
                Mode::Bare => &[],
                Mode::FailOpen => &["DRUM_SHIM_LOG"],
                Mode::Governed => &["DRUM_SHIM_LOG", "DRUM_APP"],
            };
            for v in ["LD_PRELOAD", "DRUM_AGENT_SOCKET"].iter().chain(shim_vars) {
                args.extend(["-x", v]);
            }
            args.push(bin);
            let out = run_timeout(&mut stage.exec("h1", &args, &[]), Duration::from_secs(120));
            assert_ok(&out, &who);
            let stdout = String::from_utf8_lossy(&out.stdout);
            assert!(stdout.ends_with("mpi ok\n"), "{who}: {}", text(&out));
            eprintln!("{who}: {}", stdout.lines().collect::<Vec<_>>().join("; "));
            stage.check_shim(&[&out], &who);
        }
    }
}
