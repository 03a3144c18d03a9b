//! Unmodified perftest programs under the shim, governed by a real `drum-agent --local`
//! over softrnic: the agent's grants are enforced (rates, top-k QP gating), and the shim
//! fails open — and reattaches — when the agent dies or hands it a bad table.
//!
//! Needs `drum-agent`, `softrnic` and `libdrum_shim.so` in the test binary's target
//! directory (`cargo build --workspace --release`), root and perftest; skips otherwise.

mod support;

use drum_test_support::perftest;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::process::Output;
use std::time::{Duration, Instant};
use support::agent::Agent;
use support::*;

/// The tests here measure rates and ratios on a 2-core machine: they take turns, so that one
/// test's traffic is not another's measurement noise.
static MEASURING: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn take_turn() -> std::sync::MutexGuard<'static, ()> {
    MEASURING.lock().unwrap_or_else(|e| e.into_inner())
}

/// How long a perftest server under the shim may take to listen on a loaded 2-core machine.
const LISTEN_LIMIT: Duration = Duration::from_secs(30);

/// How long a perftest client may take from its launch to its first message on a loaded
/// 2-core machine (process start, the shim's registration, the connection): a bound on a
/// wait, never a measurement (5 s was what an idle machine needed with room to spare).
const STARTUP_LIMIT: Duration = Duration::from_secs(15);

fn require_perftest() -> bool {
    if !have("ib_write_bw") {
        eprintln!("SKIPPED: perftest not installed (apt-get install perftest)");
        return false;
    }
    true
}

/// perftest's "BW average" in MiB/s.
fn bw_mib(o: &Output, who: &str) -> f64 {
    let f = result_fields(o, who);
    assert!(f.len() >= 4, "{who}: {f:?}");
    f[3]
}

/// Granted 10 %, 30 % and 60 % of a 1 Gb/s line, an unmodified `ib_write_bw` achieves its
/// grant within ±5 %, measured by perftest itself (never above; see [`assert_holds_grant`]
/// for the floor), with its QP paced on the NIC too (`nic_pace`).
#[test]
fn agent_grants_hold_ib_write_bw_to_10_30_and_60_percent_of_line_rate() {
    require_privileges!();
    let _turn = take_turn();
    if !require_perftest() {
        return;
    }
    let run = Run::new("grants");
    run.up(&["--hosts", "2", "--line-rate-gbps", "1"]);
    let agent = Agent::start(
        &run.dir,
        "agent",
        1.0,
        "[shim.apps.bw10]\nrate = 0.1\n[shim.apps.bw30]\nrate = 0.3\n[shim.apps.bw60]\nrate = 0.6\n",
    );
    let mut report = Vec::new();
    for (app, frac) in [("bw10", 0.1), ("bw30", 0.3), ("bw60", 0.6)] {
        let args = perftest("ib_write_bw", &["-s", "65536", "-n", "500"]);
        let who = app.to_string();
        let want = frac * 1e9 / 8.0 / 1048576.0;
        let got = assert_holds_grant(&format!("{who} (MiB)"), want, 0.05, || {
            let (server, client) = pair_env(&run, &args, true, &agent.env(app));
            assert_pair_ok(&server, &client, &who);
            let s = summary(&client, &who);
            // The limiter keeps picoseconds per byte, so its rate is the grant to 1e-4.
            let limiter = s["rate_bytes_per_s"] as f64;
            assert!(
                (limiter / (frac * 125e6) - 1.0).abs() < 1e-4,
                "{who}: {s:?}"
            );
            assert!(s["deferred_wqes"] > 0, "{who}: {s:?}");
            // 64 KiB messages are 16 packets: their QPs are paced on the NIC as well, and
            // the NIC's limit does not hold them under the grant.
            assert!(s["nic_pacing_sets"] >= 1, "{who}: {s:?}");
            assert_eq!(s["nic_pacing_refusals"], 0, "{who}: {s:?}");
            assert!(
                shim_complaints(&client).is_empty(),
                "{who}: {}",
                text(&client)
            );
            bw_mib(&client, &who)
        });
        report.push(format!("{app}: {got:.2?} MiB/s of {want:.2}"));
    }
    eprintln!("{}", report.join("; "));
}

/// A polling grant (`rate_cqe_per_s` pinned by the agent) meters the completions an
/// application receives: our event-driven probe, and unmodified `ibv_rc_pingpong` polling,
/// in event mode and reading an `ibv_cq_ex` (`-t`; two completions per iteration on each
/// side), all get the granted
/// rate within 5 % (never above; see [`assert_holds_grant`] for the floor).
#[test]
fn polling_grant_meters_completions_for_polling_and_event_driven_programs() {
    require_privileges!();
    let _turn = take_turn();
    let grant = 1000.0;
    let run = Run::new("cqe-grant");
    run.up(&["--hosts", "2"]);
    let agent = Agent::start(
        &run.dir,
        "agent",
        1.0,
        "[shim.apps.poller]\nrate_cqe_per_s = 1000\n[shim.apps.poller-server]\nrate_cqe_per_s = 1000\n",
    );
    let env = agent.env("poller");
    let bin = compile_probe(&run, "vcq_probe");
    let mut report = Vec::new();
    let rates = assert_holds_grant("vcq_probe", grant, 0.05, || {
        let out = run_timeout(
            &mut run.exec("h1", &[&bin, "1000"], true, &env),
            Duration::from_secs(60),
        );
        assert_ok(&out, "vcq_probe");
        let s = summary(&out, "vcq_probe");
        assert_eq!(s["rate_cqe_per_s"], 1000, "{s:?}");
        assert!(s["delayed_cq_events"] > 0, "{}", text(&out));
        assert!(
            s["held_polls"] > 0,
            "the grant held completions back: {s:?}"
        );
        probe_rate(&out, "vcq_probe")
    });
    report.push(format!("vcq_probe: {rates:.0?}/s"));
    for mode in [&[][..], &["-e"][..], &["-t"][..]] {
        let mut args = vec!["ibv_rc_pingpong", "-g", "0", "-c", "-n", "500"];
        args.extend_from_slice(mode);
        let who = format!("{args:?} at {grant} completions/s");
        // Both sides are metered and each waits for the other: the slower side's rate.
        let rates = assert_holds_grant(&who, grant, 0.05, || {
            let (server, client) = pair_env(&run, &args, true, &env);
            assert_pair_ok(&server, &client, &who);
            let rate = |o: &Output| {
                let out = String::from_utf8_lossy(&o.stdout);
                let secs: f64 = out
                    .lines()
                    .find_map(|l| {
                        l.strip_prefix("500 iters in ")?
                            .split(' ')
                            .next()?
                            .parse()
                            .ok()
                    })
                    .unwrap_or_else(|| panic!("{who}: {out}"));
                2.0 * 500.0 / secs
            };
            let (a, b) = (rate(&server), rate(&client));
            assert!(a.max(b) <= grant * 1.05, "{who}: {a:.0}/s and {b:.0}/s");
            a.min(b)
        });
        report.push(format!("{mode:?}: {rates:.0?}/s"));
    }
    // The receives of an XRC SRQ complete on the application's own CQ, not on a dedicated
    // one: metered all the same. One completion per message and one for the last send on
    // each side, each side waiting for the other, so the run takes at least that many
    // completions at the granted rate (less the limiter's 5 ms burst).
    if have("ibv_xsrq_pingpong") {
        let _files = drum_test_support::CreatedFiles::watch(&drum_test_support::XRC_DOMAIN_FILES);
        let n = 300u32;
        let ns = n.to_string();
        for mode in [&[][..], &["-e"][..]] {
            let mut args = vec!["ibv_xsrq_pingpong", "-g", "0", "-n", &ns];
            args.extend_from_slice(mode);
            let who = format!("{args:?} at {grant} completions/s");
            let t = Instant::now();
            let (server, client) = pair_env(&run, &args, true, &env);
            // (pair_env starts the client 200 ms after the server.)
            let secs = t.elapsed().as_secs_f64() - 0.2;
            assert_pair_ok(&server, &client, &who);
            for o in [&server, &client] {
                let s = summary(o, &who);
                assert_eq!(s["completions"], u64::from(n) + 1, "{who}: {s:?}");
            }
            let floor = (f64::from(n) + 1.0 - 5.0) / grant;
            assert!(
                secs >= floor,
                "{who}: {secs:.3} s, metered it takes ≥ {floor:.3} s"
            );
            report.push(format!("{args:?}: {secs:.3} s (≥ {floor:.3})"));
        }
    }
    eprintln!("{}", report.join(", "));
}

/// 64 active QPs on a NIC whose context cache holds 20: with the agent granting 16 active
/// QPs, the same unmodified `ib_write_bw -q 64` moves ≥ 1.5× the data per second.
#[test]
fn top_k_gating_beats_qp_cache_thrashing() {
    require_privileges!();
    let _turn = take_turn();
    if !require_perftest() {
        return;
    }
    let run = Run::new("topk");
    // A scaled-down NIC so that its model, not the emulator's CPU, is the bottleneck
    // (as in softrnic's knee benchmark).
    run.up(&[
        "--hosts",
        "2",
        "--line-rate-gbps",
        "0.1",
        "--mtu",
        "1024",
        "--qp-cache",
        "20",
        "--qp-miss-ns",
        "80000",
    ]);
    let agent = Agent::start(
        &run.dir,
        "agent",
        0.1,
        "[shim.apps.gated]\nmax_active_qps = 16\n",
    );
    let args = perftest("ib_write_bw", &["-q", "64", "-s", "1024", "-n", "62"]);
    let mut bw = Vec::new();
    for app in ["free", "gated"] {
        let (server, client) = pair_env(&run, &args, true, &agent.env(app));
        assert_pair_ok(&server, &client, app);
        assert_eq!(result_row(&client, app), (1024, 64 * 62), "{app}");
        let s = summary(&client, app);
        assert_eq!(
            s["max_active_qps"],
            if app == "gated" { 16 } else { 0 },
            "{app}: {s:?}"
        );
        assert_eq!(s["send_wqes"], 64 * 62, "{app}: {s:?}");
        bw.push(bw_mib(&client, app));
    }
    eprintln!(
        "64 QPs, cache 20: {:.2} MiB/s ungated, {:.2} MiB/s with 16 active ({:.2}x)",
        bw[0],
        bw[1],
        bw[1] / bw[0]
    );
    assert!(
        bw[1] >= 1.5 * bw[0],
        "gated {:.2} vs ungated {:.2} MiB/s",
        bw[1],
        bw[0]
    );
}

/// The agent is killed while an application runs: the application goes on unthrottled,
/// says so once, and is governed again after the agent restarts — the send rate the
/// agent observes falls back to the grant.
#[test]
fn agent_killed_and_restarted_while_an_application_runs() {
    require_privileges!();
    let _turn = take_turn();
    if !require_perftest() {
        return;
    }
    let run = Run::new("restart");
    run.up(&["--hosts", "2", "--line-rate-gbps", "1"]);
    let mut agent = Agent::start(&run.dir, "agent", 1.0, "[shim.apps.paced]\nrate = 0.1\n");
    let env = agent.env("paced");
    let env: Vec<(String, String)> = env
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let args = perftest("ib_write_bw", &["-s", "65536", "-D", "12"]);
    let ip = run.addr("h1");
    let mut server = spawn(&mut run.exec("h1", &args, true, &env));
    // The server must listen before the client connects (perftest does not retry).
    drum_test_support::wait_listening(&mut server, 18515, LISTEN_LIMIT);
    let mut cargs = args.to_vec();
    cargs.push(&ip);
    let client = spawn(&mut run.exec("h2", &cargs, true, &env));
    let client_pid = client.id();

    // The send rate the agent sees over `secs`, from the shims' counters in its status file
    // (the client's: the server's shim sends nothing of this test).
    let rate = |agent: &Agent, secs: f64| -> Option<f64> {
        agent.send_rate("paced", secs, |b| b.iter().copied().max().unwrap_or(0))
    };
    // Measure once the client's shim reports traffic (a loaded machine starts it slowly).
    wait_until(
        "the client's shim reports traffic",
        Duration::from_secs(10),
        || agent.shims().iter().any(|s| s.1 == "paced" && s.2 > 0),
    );
    std::thread::sleep(Duration::from_millis(500));
    let before = rate(&agent, 1.5);
    agent.kill();
    std::thread::sleep(Duration::from_millis(1500));
    agent.restart();
    // Reattach takes at most the shim's retry interval (0.5 s).
    let t = Instant::now();
    while agent.shims().iter().filter(|s| s.3 >= 1).count() < 2 {
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "shims did not reattach: {:?}",
            agent.shims()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // The new table starts at zero until the shim's next report: let the counters settle.
    std::thread::sleep(Duration::from_millis(500));
    let after = rate(&agent, 1.5);
    let client = wait_timeout(client, Duration::from_secs(60));
    let server = wait_timeout(server, Duration::from_secs(60));
    assert_pair_ok(&server, &client, "ib_write_bw -D 12");
    let err = String::from_utf8_lossy(&client.stderr);
    assert_eq!(
        err.matches("the agent closed the connection; the application runs ungoverned")
            .count(),
        1,
        "{err}"
    );
    let grant = 12.5e6;
    let (before, after) = (before.expect("rate before"), after.expect("rate after"));
    eprintln!(
        "pid {client_pid}: {:.1} MB/s before the kill, {:.1} MB/s after the restart (grant {:.1})",
        before / 1e6,
        after / 1e6,
        grant / 1e6
    );
    for (phase, r) in [("before", before), ("after", after)] {
        assert!(
            (r / grant - 1.0).abs() < 0.15,
            "{phase}: {r} B/s against {grant}"
        );
    }
    // Ungoverned in between: the average over the whole run is above the grant.
    let avg = bw_mib(&client, "client") * 1048576.0;
    assert!(
        avg > 1.2 * grant,
        "average {avg} B/s: never ran unthrottled?"
    );
}

/// Our own probe (tests/c/mt_qps.c): 6 threads, each posting lists of SEND_WITH_IMM on 6
/// QP pairs of one context at once, partly inline (the buffer is scribbled over right
/// after the post), mostly unsignalled; the receiver checks every QP's order and bytes.
/// It passes ungoverned, and governed by a grant that makes the shim queue almost
/// everything: few active QPs with a short quantum, and a rate — posting with
/// `ibv_post_send`, and as `ibv_wr_*` batches (whose requests the shim records and
/// queues the same way).
#[test]
fn many_threads_posting_on_many_qps_keep_order_and_data_under_gating_and_pacing() {
    require_privileges!();
    let _turn = take_turn();
    let run = Run::new("mt");
    run.up(&["--hosts", "1"]);
    let bin = compile_probe(&run, "mt_qps");
    let grants: [&[(&str, &str)]; 3] = [
        &[],
        &[
            ("DRUM_SHIM_MAX_ACTIVE_QPS", "3"),
            ("DRUM_SHIM_QUANTUM_US", "200"),
        ],
        &[
            ("DRUM_SHIM_MAX_ACTIVE_QPS", "2"),
            ("DRUM_SHIM_QUANTUM_US", "500"),
            ("DRUM_SHIM_RATE_BYTES_PER_S", "40000000"),
        ],
    ];
    for (env, api) in grants.iter().flat_map(|g| [(*g, "post"), (*g, "wr")]) {
        for size in ["32", "2048"] {
            let who = format!("mt_qps size {size} {api} {env:?}");
            let mut args = vec![bin.as_str(), "6", "6", "200", size];
            if api == "wr" {
                args.push("wr");
            }
            let out = run_timeout(
                &mut run.exec("h1", &args, true, env),
                Duration::from_secs(60),
            );
            assert_ok(&out, &who);
            assert_eq!(String::from_utf8_lossy(&out.stdout), "mt ok\n", "{who}");
            let s = summary(&out, &who);
            assert_eq!(s["send_wqes"], 6 * 6 * 200, "{who}: {s:?}");
            assert_eq!(s["completion_errors"], 0, "{who}: {s:?}");
            assert_eq!(
                (s["dropped_wqes"], s["deferred_post_errors"]),
                (0, 0),
                "{who}: {s:?}"
            );
            if !env.is_empty() {
                assert!(s["deferred_wqes"] > 0, "{who}: nothing was queued: {s:?}");
            }
            let wrapped = if api == "wr" { 6 * 6 } else { 0 };
            assert_eq!(s["wr_api_qps"], wrapped, "{who}: {s:?}");
            assert!(shim_complaints(&out).is_empty(), "{who}: {}", text(&out));
        }
    }
}

/// Our own probe (tests/c/wr_ops.c) posts every kind of request a shim can hold back as
/// `ibv_wr_*` batches — RDMA WRITE (SGE), WRITE_WITH_IMM (inline), SEND (SGE list),
/// FETCH_ADD, CMP_SWP, RDMA READ on an RC QP, and a UD SEND whose address comes from
/// `ibv_wr_set_ud_addr` — and checks bytes, immediates, atomics and per-QP completion
/// order. Under a grant that queues nearly everything (one active QP, 1,000 WQE/s)
/// the shim records the batches and posts them later: the same results and counts.
#[test]
fn every_kind_of_wr_request_held_back_by_the_shim_arrives_intact() {
    require_privileges!();
    let _turn = take_turn();
    let run = Run::new("wr-ops");
    run.up(&["--hosts", "1"]);
    let bin = compile_probe(&run, "wr_ops");
    let grants: [&[(&str, &str)]; 2] = [
        &[],
        &[
            ("DRUM_SHIM_MAX_ACTIVE_QPS", "1"),
            ("DRUM_SHIM_RATE_WQE_PER_S", "1000"),
        ],
    ];
    for env in grants {
        let who = format!("wr_ops {env:?}");
        let out = run_timeout(
            &mut run.exec("h1", &[bin.as_str(), "20"], true, env),
            Duration::from_secs(60),
        );
        assert_ok(&out, &who);
        assert_eq!(String::from_utf8_lossy(&out.stdout), "wr ok\n", "{who}");
        let s = summary(&out, &who);
        // 7 requests per round; 64 + 16 + 64 + 8 + 8 + 64 + 8 bytes.
        assert_eq!(
            (s["send_wqes"], s["send_bytes"]),
            (20 * 7, 20 * 232),
            "{who}: {s:?}"
        );
        assert_eq!(s["wr_api_qps"], 2, "{who}: {s:?}");
        assert_eq!(s["completion_errors"], 0, "{who}: {s:?}");
        if !env.is_empty() {
            assert!(s["deferred_wqes"] > 20, "{who}: nothing was queued: {s:?}");
        }
        assert!(shim_complaints(&out).is_empty(), "{who}: {}", text(&out));
    }
}

/// An "agent" that answers the registration with a table that is not one: the shim
/// refuses it, says why once, and the application runs ungoverned and correct.
#[test]
fn a_bad_table_from_the_agent_is_refused_and_the_application_runs() {
    require_privileges!();
    let _turn = take_turn();
    let run = Run::new("badtable");
    run.up(&["--hosts", "2"]);
    std::fs::create_dir_all(&run.dir).unwrap();
    let sock = run.dir.join("fake-agent.sock");
    let listener = drum_table::socket::listen(&sock, 8).unwrap();
    let served = std::thread::spawn(move || {
        let mut n = 0;
        let end = Instant::now() + Duration::from_secs(30);
        while n < 2 && Instant::now() < end {
            // SAFETY: accepting on our listener.
            let fd = unsafe {
                libc::accept(
                    listener.as_raw_fd(),
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                )
            };
            if fd < 0 {
                continue;
            }
            // SAFETY: a fresh descriptor we own.
            let c = unsafe { OwnedFd::from_raw_fd(fd) };
            let mut buf = [0u8; 600];
            let _hello = drum_table::socket::recv(c.as_raw_fd(), &mut buf);
            let table = garbage_table();
            drum_table::mapping::send_with_fd(
                c.as_raw_fd(),
                b"DRUM1 WELCOME app=x",
                table.as_raw_fd(),
            )
            .unwrap();
            n += 1;
            std::thread::sleep(Duration::from_millis(100));
        }
        n
    });
    let env = [("DRUM_AGENT_SOCKET", sock.to_str().unwrap())];
    let args = ["ibv_rc_pingpong", "-g", "0", "-c", "-n", "50"];
    let (server, client) = pair_env(&run, &args, true, &env);
    assert_pair_ok(&server, &client, "pingpong");
    for o in [&server, &client] {
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains("not a DRUM table"), "{err}");
        assert_eq!(err.matches("drum-shim: no DRUM agent").count(), 1, "{err}");
        assert_eq!(summary(o, "pingpong")["send_wqes"], 50);
    }
    assert!(served.join().unwrap() >= 2);
}

/// A sealed memfd of the right size whose header is not a table's.
fn garbage_table() -> OwnedFd {
    // SAFETY: plain memfd calls on our own descriptor.
    unsafe {
        let fd = libc::memfd_create(c"bad".as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING);
        assert!(fd >= 0);
        let fd = OwnedFd::from_raw_fd(fd);
        let junk = vec![0xA5u8; drum_table::layout::TABLE_BYTES];
        assert_eq!(
            libc::write(fd.as_raw_fd(), junk.as_ptr().cast(), junk.len()),
            junk.len() as isize
        );
        libc::fcntl(
            fd.as_raw_fd(),
            libc::F_ADD_SEALS,
            libc::F_SEAL_SHRINK | libc::F_SEAL_GROW,
        );
        fd
    }
}

/// Waits until `f` holds (polling every 10 ms); returns how long it took.
fn wait_until(what: &str, limit: Duration, mut f: impl FnMut() -> bool) -> Duration {
    let t = Instant::now();
    while !f() {
        assert!(t.elapsed() < limit, "{what}: not within {limit:?}");
        std::thread::sleep(Duration::from_millis(10));
    }
    t.elapsed()
}

/// Incast look-ahead end to end: h2's agent names the incast group of app `bulk` (4 senders),
/// h1's agent has look-ahead on. The first and only sender already gets a quarter of h1's
/// rate, with 4 senders counted — without look-ahead it would get all of it until the other
/// three started. An app of the same host without a group announces its own message, and the
/// host still counts once.
#[test]
fn incast_lookahead_gives_the_first_sender_its_share_at_once() {
    require_privileges!();
    let _turn = take_turn();
    if !require_perftest() {
        return;
    }
    let run = Run::new("lookahead");
    run.up(&["--hosts", "2", "--line-rate-gbps", "1"]);
    let dasr = |h: &str, extra: &str| {
        let ip = run.addr(h);
        format!("[dasr]\nlisten = \"{ip}:7410\"\nexpiry_ms = 500\n{extra}")
    };
    let h1_agent = Agent::start_on(
        Some((&run, "h1")),
        &run.dir,
        "agent-h1",
        1.0,
        "long_msg_bytes = 65536",
        &dasr("h1", "lookahead = true\n"),
    );
    let h2_agent = Agent::start_on(
        Some((&run, "h2")),
        &run.dir,
        "agent-h2",
        1.0,
        "long_msg_bytes = 65536",
        &format!(
            "[shim.apps.bulk]\nincast = {{ group = 7, members = 4 }}\n{}",
            dasr("h2", "")
        ),
    );
    let h1 = run.addr("h1");
    let gid_h1 =
        drum_table::message::gid_hex(&drum_table::message::gid_of_ipv4(h1.parse().unwrap()));
    let cap = || {
        h2_agent
            .caps()
            .into_iter()
            .find(|c| c.0 == gid_h1)
            .map(|c| (c.1, c.2))
    };
    let r = 125_000_000u64;
    let send = |app: &str, port: &str| {
        let args = perftest("ib_write_bw", &["-s", "65536", "-D", "3", "-p", port]);
        let mut server = spawn(&mut run.exec("h1", &args, true, &h1_agent.env("sink")));
        drum_test_support::wait_listening(&mut server, port.parse().unwrap(), LISTEN_LIMIT);
        let mut cargs = args.to_vec();
        cargs.push(&h1);
        let client = spawn(&mut run.exec("h2", &cargs, true, &h2_agent.env(app)));
        (server, client)
    };
    let (s1, c1) = send("bulk", "18611");
    let t = wait_until(
        "the first sender's cap at R/4 with 4 counted",
        // From the client's launch: process start, connection, first message.
        STARTUP_LIMIT,
        || cap() == Some((r / 4, 4)),
    );
    let (s2, c2) = send("other", "18612");
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(cap(), Some((r / 4, 4)), "one host, counted once");
    eprintln!("look-ahead: the first of a 4-sender incast capped at R/4 {t:?} after its launch");
    for (s, c, who) in [(s1, c1, "bulk"), (s2, c2, "other")] {
        let c = wait_timeout(c, Duration::from_secs(30));
        let s = wait_timeout(s, Duration::from_secs(30));
        assert_pair_ok(&s, &c, who);
    }
}

/// DASR end to end: the shims of two senders (h2, h3) announce their long messages to the
/// receiver's (h1) agent; when the second sender starts, the first one's cap towards h1
/// halves, and its shim holds it to that; when the second stops, the cap returns; when the
/// second sender's host dies (its agent SIGKILLed mid-message), h1 expires it and the cap
/// returns after the expiry.
#[test]
fn dasr_caps_halve_with_a_second_sender_and_return_when_it_leaves() {
    require_privileges!();
    let _turn = take_turn();
    if !require_perftest() {
        return;
    }
    let run = Run::new("dasr");
    run.up(&["--hosts", "3", "--line-rate-gbps", "1"]);
    let agents: Vec<Agent> = ["h1", "h2", "h3"]
        .iter()
        .map(|h| {
            let ip = run.addr(h);
            Agent::start_on(
                Some((&run, h)),
                &run.dir,
                &format!("agent-{h}"),
                1.0,
                "long_msg_bytes = 65536",
                &format!("[dasr]\nlisten = \"{ip}:7410\"\nexpiry_ms = 500\n"),
            )
        })
        .collect();
    let h1 = run.addr("h1");
    let gid_h1 =
        drum_table::message::gid_hex(&drum_table::message::gid_of_ipv4(h1.parse().unwrap()));
    let cap_of = |a: &Agent| {
        a.caps()
            .into_iter()
            .find(|c| c.0 == gid_h1)
            .map(|c| (c.1, c.2))
    };
    let r = 125_000_000u64;
    // One bandwidth test per sender, each with its own server port on h1.
    let start = |sender: usize, port: &str, secs: &str| {
        let a = &agents[sender];
        let env = a.env("bulk");
        let args = perftest("ib_write_bw", &["-s", "65536", "-D", secs, "-p", port]);
        let mut server = spawn(&mut run.exec("h1", &args, true, &agents[0].env("sink")));
        drum_test_support::wait_listening(&mut server, port.parse().unwrap(), LISTEN_LIMIT);
        let mut cargs = args.to_vec();
        cargs.push(&h1);
        let client = spawn(&mut run.exec(&format!("h{}", sender + 1), &cargs, true, &env));
        (server, client)
    };
    // The first sender must outlast every phase below: about 7 s on an idle machine, so its
    // 8 s ended before h3's kill on a loaded one, and h2 then had no cap to get back.
    let (sa, ca) = start(1, "18601", "25");
    wait_until("h2's cap towards h1 at R", STARTUP_LIMIT, || {
        cap_of(&agents[1]) == Some((r, 1))
    });
    let (sb, cb) = start(2, "18602", "2");
    let t_half = wait_until("h2's cap halved by h3's traffic", STARTUP_LIMIT, || {
        cap_of(&agents[1]) == Some((r / 2, 2))
    });
    wait_until("h3's cap halved too", Duration::from_secs(2), || {
        cap_of(&agents[2]) == Some((r / 2, 2))
    });
    let t_back = wait_until(
        "h2's cap back at R after h3 ended",
        // h3's `-D 2` run with perftest's own warm-up and teardown, slower under load.
        Duration::from_secs(30),
        || cap_of(&agents[1]) == Some((r, 1)),
    );
    for (o, who) in [
        (wait_timeout(cb, Duration::from_secs(30)), "h3 client"),
        (wait_timeout(sb, Duration::from_secs(30)), "h3 server"),
    ] {
        assert_ok(&o, who);
    }
    // h3 sends again, then its host "dies": the agent is killed, so nobody says goodbye.
    // The sender outlives the kill, so that only the kill can end h3's announcements.
    let (sb, cb) = start(2, "18603", "10");
    wait_until("h2's cap halved again", STARTUP_LIMIT, || {
        cap_of(&agents[1]) == Some((r / 2, 2))
    });
    // h2's shim holds its sender to the cap: what h2's agent sees it send over one second.
    let capped_rate = agents[1]
        .send_rate("bulk", 1.0, |b| b.iter().sum())
        .expect("h2's sender listed by its agent") as u64;
    // The cap comes back only because h3's agent dies: it is still halved now. How soon
    // after the kill it returns depends on when h3's agent last refreshed its announcement
    // (every 125 ms when scheduled; CI saw 112 and 284 ms on a loaded machine, where the
    // agent's refreshes came late), so the expiry's own timing is asserted where the test
    // controls both peers (agent/tests/dasr.rs, sender_killed_mid_message_expires_…).
    assert_eq!(
        cap_of(&agents[1]),
        Some((r / 2, 2)),
        "h2's cap was back before h3's agent was killed"
    );
    let mut agents = agents;
    agents[2].kill();
    let t_expire = wait_until("h3 expired at h1", Duration::from_secs(5), || {
        cap_of(&agents[1]) == Some((r, 1))
    });
    eprintln!(
        "DASR through the shims: halved {t_half:?} after the second sender's launch (process \
         start and connection included), back {t_back:?} after that (it sent for 2 s), back \
         {t_expire:?} after its agent was killed (expiry 500 ms); the first sender sent \
         {:.1} MB/s under a cap of {:.1} MB/s",
        capped_rate as f64 / 1e6,
        r as f64 / 2e6
    );
    assert!(
        capped_rate as f64 <= 1.1 * (r / 2) as f64,
        "{capped_rate} B/s under a cap of {} B/s",
        r / 2
    );
    let _ = wait_timeout(cb, Duration::from_secs(30));
    let _ = wait_timeout(sb, Duration::from_secs(30));
    let ca = wait_timeout(ca, Duration::from_secs(60));
    let sa = wait_timeout(sa, Duration::from_secs(60));
    assert_pair_ok(&sa, &ca, "h2 -> h1");
}

/// Bytes the NIC of `host` fetched for its processes so far (`proc_tx_bytes.PID`, summed).
fn host_tx_bytes(run: &Run, host: &str) -> u64 {
    drum_test_support::softrnic_stats(run.cmd().args(["stats", host]))
        .iter()
        .filter(|(k, _)| k.starts_with("proc_tx_bytes."))
        .map(|(_, v)| v)
        .sum()
}

/// Dart's AUSS in the NIC's ACKs, with no agent anywhere: two unmodified `ib_write_bw` into
/// h1 under the shim. h1's NIC counts both senders and stamps `N` = 2 into its ACKs; each
/// sender's shim reads it from its NIC's table (`softrnic_auss`) and caps its QP at R/2 (its
/// counters say so), and the first sender's rate falls; and a control run with `DRUM_SHIM_NIC_AUSS=0` shows the
/// shim leaves the table alone when told to.
#[test]
fn nic_auss_caps_each_sender_at_half_with_no_agent() {
    require_privileges!();
    let _turn = take_turn();
    if !require_perftest() {
        return;
    }
    let run = Run::new("nic-auss");
    run.up(&[
        "--hosts",
        "3",
        "--line-rate-gbps",
        "1",
        "--auss-expiry-ms",
        "500",
    ]);
    let h1 = run.addr("h1");
    // R: what h1 receives at line rate, in payload bytes/s (the table's header).
    let r = 125_000_000f64 * 4096.0 / (4096.0 + 48.0 + 42.0);
    let start = |host: &str, port: &str, secs: &str, env: &[(&str, &str)]| {
        let args = perftest("ib_write_bw", &["-s", "65536", "-D", secs, "-p", port]);
        let mut server = spawn(&mut run.exec("h1", &args, false, &[]));
        drum_test_support::wait_listening(&mut server, port.parse().unwrap(), LISTEN_LIMIT);
        let mut cargs = args.to_vec();
        cargs.push(&h1);
        let client = spawn(&mut run.exec(host, &cargs, true, env));
        (server, client)
    };
    let rate_of = |host: &str| {
        let b0 = host_tx_bytes(&run, host);
        std::thread::sleep(Duration::from_secs(1));
        (host_tx_bytes(&run, host) - b0) as f64
    };
    let (sa, ca) = start("h2", "18611", "8", &[]);
    wait_until("h2 sending", STARTUP_LIMIT, || {
        host_tx_bytes(&run, "h2") > 0
    });
    let alone = rate_of("h2");
    let (sb, cb) = start("h3", "18612", "4", &[]);
    wait_until("h3 sending", STARTUP_LIMIT, || {
        host_tx_bytes(&run, "h3") > 0
    });
    let shared = rate_of("h2");
    let table = run_timeout(run.cmd().args(["auss", "h2"]), Duration::from_secs(10));
    let h1_epochs = run.settled_stats("h1").get("auss_epoch").copied();
    for (o, who) in [
        (wait_timeout(cb, Duration::from_secs(30)), "h3 client"),
        (wait_timeout(sb, Duration::from_secs(30)), "h3 server"),
    ] {
        assert_ok(&o, who);
    }
    let ca = wait_timeout(ca, Duration::from_secs(30));
    let sa = wait_timeout(sa, Duration::from_secs(30));
    assert_pair_ok(&sa, &ca, "h2 -> h1");
    let s = summary(&ca, "h2 client");
    eprintln!(
        "NIC AUSS through the shim: h2 sent {:.1} MB/s alone, {:.1} MB/s beside h3 (cap R/2 = \
         {:.1} MB/s); h1's epoch {h1_epochs:?}; h2's table: {}; h2's shim: {s:?}",
        alone / 1e6,
        shared / 1e6,
        r / 2e6,
        String::from_utf8_lossy(&table.stdout).trim()
    );
    assert!(
        String::from_utf8_lossy(&ca.stderr).contains("nic_auss_table=yes"),
        "h2's shim found no table: {}",
        text(&ca)
    );
    assert!(s["nic_cap_changes"] >= 1, "{s:?}");
    assert!(s["deferred_wqes"] > 0, "the cap held nothing back: {s:?}");
    // Not `shared ≤ R/2`: on a loaded machine h3's send queue runs dry for longer than the
    // NIC's END hold now and then, h1 counts it out, and h2 rightly has the whole line until
    // h3 is back (50 epochs in 8 s at load 11, 73 MB/s beside h3). The shim's counters above
    // show the cap acting; the rate only that h2 shared.
    assert!(
        shared <= 0.8 * alone,
        "alone {alone} B/s, beside h3 {shared} B/s"
    );
    // Told not to: the shim leaves the table unread.
    let (so, co) = start("h2", "18613", "1", &[("DRUM_SHIM_NIC_AUSS", "0")]);
    let co = wait_timeout(co, Duration::from_secs(30));
    let so = wait_timeout(so, Duration::from_secs(30));
    assert_pair_ok(&so, &co, "h2 -> h1 without the NIC's caps");
    assert!(
        String::from_utf8_lossy(&co.stderr).contains("nic_auss_table=no"),
        "{}",
        text(&co)
    );
}
