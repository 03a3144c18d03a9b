//! Unmodified Debian verbs programs (`ibv_rc_pingpong`, perftest) run through
//! `libdrum_shim.so` over softrnic between two emulated hosts, and give the same results as
//! without it, while the shim's exit summary (`DRUM_SHIM_LOG=1`) shows what it counted.
//!
//! `cargo test` does not build cdylibs or other packages' binaries: these tests use
//! `libdrum_shim.so`, `softrnic` and its provider from the same target directory as the test
//! binary, built by `cargo build --release -p softrnic -p softrnic-provider -p drum-shim` (the
//! project's test script builds the whole workspace first). They need root (softrnic's namespaces); without it they print why
//! and skip. Each test uses its own run directory, and a guard runs `softrnic down` even on
//! failure.

mod support;

use drum_test_support::perftest;
use std::process::{Command, Output};
use std::time::Duration;
use support::*;

/// `ibv_rc_pingpong -c` (data checked) with and without the shim at three sizes; with the
/// shim every send, byte and completion is counted exactly on both sides.
fn pingpong_both_ways(run: &Run, mode: &[&str]) {
    for (size, iters) in [("1", 100u64), ("4096", 50), ("65536", 20)] {
        let n = iters.to_string();
        let mut args = vec!["ibv_rc_pingpong", "-g", "0", "-c", "-s", size, "-n", &n];
        args.extend_from_slice(mode);
        for with_shim in [false, true] {
            let who = format!("{args:?} shim={with_shim}");
            let (server, client) = pair(run, &args, with_shim);
            assert_pair_ok(&server, &client, &who);
            for o in [&server, &client] {
                let out = String::from_utf8_lossy(&o.stdout);
                assert!(out.contains(&format!("{iters} iters in")), "{who}: {out}");
                let err = String::from_utf8_lossy(&o.stderr);
                if !with_shim {
                    assert!(!err.contains("drum-shim"), "{who}: {err}");
                    continue;
                }
                let s = summary(o, &who);
                let size: u64 = size.parse().unwrap();
                assert_eq!(s["governed_contexts"], 1, "{who}: {s:?}");
                assert_eq!(s["pass_through_contexts"], 0, "{who}: {s:?}");
                assert_eq!(s["qps"], 1, "{who}: {s:?}");
                assert_eq!(s["send_wqes"], iters, "{who}: {s:?}");
                assert_eq!(s["send_bytes"], iters * size, "{who}: {s:?}");
                assert!(s["recv_wqes"] >= iters, "{who}: {s:?}");
                // Every send is signalled: one send and one receive completion per iteration.
                assert_eq!(s["completions"], 2 * iters, "{who}: {s:?}");
                assert_eq!(s["completion_errors"], 0, "{who}: {s:?}");
                // Its CQ is virtual: every completion came through the shim.
                assert_eq!(s["virtual_cqs"], 1, "{who}: {s:?}");
                if mode.contains(&"-e") {
                    assert!(s["notify_arms"] > 0, "{who}: {s:?}");
                    assert!(s["cq_events"] > 0, "{who}: {s:?}");
                }
                let complaints = shim_complaints(o);
                if mode.contains(&"-N") {
                    // Posted with ibv_wr_*: the QP is wrapped, and governed like the others.
                    assert_eq!(s["wr_api_qps"], 1, "{who}: {s:?}");
                    assert_eq!(s["extended_verbs"], 0, "{who}: {s:?}");
                }
                assert!(complaints.is_empty(), "{who}: {err}");
            }
        }
    }
}

/// `ibv_rc_pingpong -N` posts with the `ibv_wr_*` interface (`ibv_qp_to_qp_ex`): through
/// the shim it gets the same results, its sends are counted as posted ones are, polling and
/// in event mode.
#[test]
fn rc_pingpong_new_send_api_same_results_through_the_shim_and_counted() {
    require_privileges!();
    let run = Run::new("pingpong-wr");
    run.up(&["--hosts", "2"]);
    pingpong_both_ways(&run, &["-N"]);
    pingpong_both_ways(&run, &["-N", "-e"]);
}

/// `ibv_rc_pingpong -t` reads completions through an `ibv_create_cq_ex` CQ with
/// timestamps (`ibv_start_poll`/`ibv_next_poll`, `ibv_wc_read_*`), also with the new
/// post-send API: through the shim the CQ is virtual, the results the same, and every
/// completion counted.
#[test]
fn rc_pingpong_extended_cq_same_results_through_the_shim_as_a_virtual_cq() {
    require_privileges!();
    let run = Run::new("pingpong-cq-ex");
    run.up(&["--hosts", "2"]);
    for mode in [&["-t"][..], &["-t", "-N"][..]] {
        let mut args = vec!["ibv_rc_pingpong", "-g", "0", "-c", "-s", "4096", "-n", "50"];
        args.extend_from_slice(mode);
        let who = format!("{args:?}");
        let (server, client) = pair(&run, &args, true);
        assert_pair_ok(&server, &client, &who);
        for o in [&server, &client] {
            let out = String::from_utf8_lossy(&o.stdout);
            assert!(out.contains("50 iters in"), "{who}: {out}");
            assert!(
                out.contains("receive completion clock cycles"),
                "{who}: {out}"
            );
            let s = summary(o, &who);
            assert_eq!(s["send_wqes"], 50, "{who}: {s:?}");
            assert_eq!(s["completions"], 100, "{who}: {s:?}");
            assert_eq!(s["virtual_cqs"], 1, "{who}: {s:?}");
            assert_eq!(s["extended_verbs"], 0, "{who}: {s:?}");
        }
    }
}

/// The `ibv_wr_*` interface is paced: `ibv_rc_pingpong -N` granted 200 WQEs per second
/// sends at that rate (never above; see [`assert_holds_grant`] for the floor), where it is
/// far faster ungoverned.
#[test]
fn pacer_holds_the_new_send_api_to_the_granted_wqe_rate() {
    require_privileges!();
    let run = Run::new("pacer-wr");
    run.up(&["--hosts", "2"]);
    let args = ["ibv_rc_pingpong", "-g", "0", "-N", "-n", "300"];
    let rate = |env: &[(&str, &str)]| {
        let who = format!("{args:?} {env:?}");
        let (server, client) = pair_env(&run, &args, true, env);
        assert_pair_ok(&server, &client, &who);
        let out = String::from_utf8_lossy(&client.stdout);
        let secs: f64 = out
            .lines()
            .find_map(|l| {
                l.strip_prefix("300 iters in ")?
                    .split(' ')
                    .next()?
                    .parse()
                    .ok()
            })
            .unwrap_or_else(|| panic!("{who}: {out}"));
        300.0 / secs
    };
    let free = rate(&[]);
    let paced = assert_holds_grant("rc_pingpong -N at 200 WQE/s", 200.0, 0.05, || {
        rate(&[("DRUM_SHIM_RATE_WQE_PER_S", "200")])
    });
    eprintln!("ibv_rc_pingpong -N: {free:.0} sends/s ungoverned, {paced:.0?} granted 200");
    assert!(free > 1000.0, "ungoverned only {free} sends/s");
}

#[test]
fn rc_pingpong_polling_same_results_through_the_shim_and_counted() {
    require_privileges!();
    let run = Run::new("pingpong");
    run.up(&["--hosts", "2"]);
    pingpong_both_ways(&run, &[]);
}

#[test]
fn rc_pingpong_event_mode_same_results_through_the_shim_and_counted() {
    require_privileges!();
    let run = Run::new("pingpong-events");
    run.up(&["--hosts", "2"]);
    pingpong_both_ways(&run, &["-e"]);
}

#[test]
fn perftest_write_bw_send_lat_read_lat_same_results_through_the_shim_and_counted() {
    require_privileges!();
    if !have("ib_write_bw") {
        eprintln!("SKIPPED: perftest not installed (apt-get install perftest)");
        return;
    }
    let run = Run::new("perftest");
    run.up(&["--hosts", "2"]);

    let bw = perftest("ib_write_bw", &["-s", "65536", "-n", "200"]);
    let lat = perftest("ib_send_lat", &["-n", "200"]);
    let read = perftest("ib_read_lat", &["-n", "200"]);
    for args in [&bw[..], &lat[..], &read[..]] {
        let mut rows = Vec::new();
        for with_shim in [false, true] {
            let who = format!("{args:?} shim={with_shim}");
            let (server, client) = pair(&run, args, with_shim);
            assert_pair_ok(&server, &client, &who);
            rows.push(result_row(&client, &who));
            if !with_shim {
                continue;
            }
            let (ss, cs) = (summary(&server, &who), summary(&client, &who));
            for s in [&ss, &cs] {
                assert_eq!(s["governed_contexts"], 1, "{who}: {s:?}");
                assert_eq!(s["completion_errors"], 0, "{who}: {s:?}");
            }
            if args[0] == "ib_write_bw" {
                // The client writes; the server only waits.
                assert!(cs["send_wqes"] >= 200, "{who}: {cs:?}");
                assert_eq!(cs["send_bytes"], cs["send_wqes"] * 65536, "{who}: {cs:?}");
                assert!(cs["completions"] > 0, "{who}: {cs:?}");
            } else if args[0] == "ib_read_lat" {
                // The client reads one 2-byte message at a time; the server only waits.
                assert!(cs["send_wqes"] >= 200, "{who}: {cs:?}");
                assert!(cs["completions"] >= 200, "{who}: {cs:?}");
            } else {
                for s in [&ss, &cs] {
                    assert!(s["send_wqes"] >= 200, "{who}: {s:?}");
                    assert!(s["recv_wqes"] >= 200, "{who}: {s:?}");
                    assert!(s["completions"] >= 200, "{who}: {s:?}");
                }
            }
        }
        assert_eq!(rows[0], rows[1], "{args:?}: results differ with the shim");
        let expect_bytes = if args[0] == "ib_write_bw" { 65536 } else { 2 };
        assert_eq!(rows[0], (expect_bytes, 200), "{args:?}");
    }
}

/// XRC through the shim: unmodified `ibv_xsrq_pingpong` (polling and `-e`) gives the same
/// result. Its initiator QP (made by `ibv_create_qp`) is governed like any other; its target
/// QP has no CQ, and the receives of its XRC SRQ complete on the application's own CQ,
/// which the virtual CQ drains. Every send, SRQ receive and completion is counted.
#[test]
fn xsrq_pingpong_same_results_through_the_shim_and_counted() {
    require_privileges!();
    if !have("ibv_xsrq_pingpong") {
        eprintln!("SKIPPED: ibverbs-utils without ibv_xsrq_pingpong");
        return;
    }
    let _files = drum_test_support::CreatedFiles::watch(&drum_test_support::XRC_DOMAIN_FILES);
    let run = Run::new("xsrq");
    run.up(&["--hosts", "2"]);
    let n = 20u64;
    for mode in [&[][..], &["-e"][..]] {
        let ns = n.to_string();
        let mut args = vec!["ibv_xsrq_pingpong", "-g", "0", "-n", &ns];
        args.extend_from_slice(mode);
        for with_shim in [false, true] {
            let who = format!("{args:?} shim={with_shim}");
            let (server, client) = pair(&run, &args, with_shim);
            assert_pair_ok(&server, &client, &who);
            for o in [&server, &client] {
                let out = String::from_utf8_lossy(&o.stdout);
                assert!(out.contains("success"), "{who}: {out}");
                if !with_shim {
                    continue;
                }
                let s = summary(o, &who);
                assert_eq!(s["governed_contexts"], 1, "{who}: {s:?}");
                assert_eq!(s["qps"], 2, "{who}: {s:?}");
                assert_eq!(s["send_wqes"], n, "{who}: {s:?}");
                // One receive posted per client up front, one more per message.
                assert_eq!(s["srq_recv_wqes"], n + 1, "{who}: {s:?}");
                // Every message received, and the last send (the only signalled one).
                assert_eq!(s["completions"], n + 1, "{who}: {s:?}");
                assert_eq!(s["completion_errors"], 0, "{who}: {s:?}");
                assert!(shim_complaints(o).is_empty(), "{who}");
            }
        }
    }
}

/// A program that never touches libibverbs runs unchanged under the shim, which reports
/// that it governed nothing. Needs neither root nor softrnic. (`true`: dash leaves with
/// `_exit`, which runs no destructors, and coreutils' `echo` closes stderr at exit, so neither
/// could show a summary.)
/// Programs that connect through the RDMA CM — librdmacm opens the device, creates their
/// CQs, completion channels and QPs, and takes the QPs to RTS itself — give the same results
/// through the shim, which governs and counts them: `rping -V` (data validated) and perftest
/// `ib_write_bw -R` and `ib_send_lat -R`.
#[test]
fn rdma_cm_programs_same_results_through_the_shim_and_counted() {
    require_privileges!();
    if !have("rping") || !have("ib_write_bw") {
        eprintln!("SKIPPED: needs rdmacm-utils and perftest");
        return;
    }
    let run = Run::new("rdma-cm");
    run.up(&["--hosts", "2"]);
    let ip = run.addr("h1");
    for with_shim in [false, true] {
        let who = format!("rping shim={with_shim}");
        let server = spawn(&mut run.exec("h1", &["rping", "-s", "-C", "20", "-V"], with_shim, &[]));
        let t = std::time::Instant::now();
        let client = loop {
            std::thread::sleep(Duration::from_millis(200));
            let c = run_timeout(
                &mut run.exec(
                    "h2",
                    &["rping", "-c", "-C", "20", "-V", "-v", "-a", &ip],
                    with_shim,
                    &[],
                ),
                Duration::from_secs(60),
            );
            let not_listening = drum_test_support::server_not_listening_yet(&c);
            if !not_listening || t.elapsed() > Duration::from_secs(10) {
                break c;
            }
        };
        let server = wait_timeout(server, Duration::from_secs(60));
        assert_pair_ok(&server, &client, &who);
        let out = String::from_utf8_lossy(&client.stdout);
        assert!(out.contains("ping data: rdma-ping-19"), "{who}: {out}");
        if with_shim {
            for o in [&server, &client] {
                let s = summary(o, &who);
                assert_eq!(s["governed_contexts"], 1, "{who}: {s:?}");
                assert_eq!(s["qps"], 1, "{who}: {s:?}");
                assert!(s["send_wqes"] >= 20, "{who}: {s:?}");
                assert!(s["completions"] >= 20, "{who}: {s:?}");
                assert!(shim_complaints(o).is_empty(), "{who}: {}", text(o));
            }
        }
    }
    for args in [
        perftest("ib_write_bw", &["-R", "-s", "65536", "-n", "200"]),
        perftest("ib_send_lat", &["-R", "-n", "200"]),
    ] {
        for with_shim in [false, true] {
            let who = format!("{args:?} shim={with_shim}");
            let (server, client) = pair(&run, &args, with_shim);
            assert_pair_ok(&server, &client, &who);
            assert_eq!(result_row(&client, &who).1, 200, "{who}");
            if with_shim {
                for o in [&server, &client] {
                    let s = summary(o, &who);
                    assert!(s["governed_contexts"] >= 1, "{who}: {s:?}");
                    assert_eq!(s["pass_through_contexts"], 0, "{who}: {s:?}");
                    assert_eq!(s["completion_errors"], 0, "{who}: {s:?}");
                }
                // The client posts every measured operation (the write_bw server none).
                let s = summary(&client, &who);
                assert!(s["send_wqes"] >= 200, "{who}: {s:?}");
            }
        }
    }
}

#[test]
fn program_without_verbs_is_unaffected() {
    let out = run_timeout(
        Command::new("true")
            .env("LD_PRELOAD", shim())
            .env("DRUM_SHIM_LOG", "1"),
        Duration::from_secs(10),
    );
    assert_ok(&out, "true");
    assert!(out.stdout.is_empty(), "{}", text(&out));
    let s = summary(&out, "true");
    assert_eq!(s["governed_contexts"], 0, "{s:?}");
    assert_eq!(s["send_wqes"], 0, "{s:?}");
    // Without DRUM_SHIM_LOG the shim is silent.
    let out = run_timeout(
        Command::new("true")
            .env("LD_PRELOAD", shim())
            .env_remove("DRUM_SHIM_LOG"),
        Duration::from_secs(10),
    );
    assert_ok(&out, "true");
    assert!(out.stderr.is_empty(), "{}", text(&out));
}

/// Direct verbs bypass the shim and are reported, not hidden: our program
/// `tests/c/direct_verbs.c` calls `mlx5dv_init_obj` of a stand-in library
/// (`tests/c/fake_mlx5dv.c`) for a QP (linked), a CQ (through `dlopen` and `dlsym`) and a PD.
/// Through the shim every call reaches the library with its answer unchanged, the shim says
/// once that direct verbs are not governed, and counts the two that hand out queues (the
/// queues, one each, are what its table tells the agent: `tenants.rs`).
#[test]
fn direct_verbs_are_forwarded_and_reported() {
    let run = Run::new("direct-verbs");
    let lib = compile_c_with(&run, "tests/c/fake_mlx5dv.c", &["-shared", "-fPIC"]);
    let bin = compile_c_with(&run, "tests/c/direct_verbs.c", &[lib.as_str()]);
    let go = |preload: bool| {
        let mut c = Command::new(&bin);
        c.arg(&lib).env_remove("LD_PRELOAD");
        if preload {
            c.env("LD_PRELOAD", shim()).env("DRUM_SHIM_LOG", "1");
        }
        run_timeout(&mut c, Duration::from_secs(10))
    };
    let (bare, shimmed) = (go(false), go(true));
    for (who, out) in [("bare", &bare), ("through the shim", &shimmed)] {
        assert_ok(out, who);
        assert_eq!(
            String::from_utf8_lossy(&out.stdout),
            "direct 41 42 104\n",
            "{who}"
        );
    }
    let err = String::from_utf8_lossy(&shimmed.stderr);
    assert_eq!(
        err.matches("mlx5dv_init_obj (direct verbs)").count(),
        1,
        "{err}"
    );
    let s = summary(&shimmed, "direct_verbs");
    assert_eq!(s["extended_verbs"], 2, "{err}");
    assert_eq!(s["direct_verbs_queues"], 2, "a QP and a CQ: {err}");
}

/// The pacer (`DRUM_SHIM_RATE_WQE_PER_S`) holds an unmodified `ib_write_bw` to the granted
/// WQE rate: perftest's own message rate is within 5 % of it (never above; see
/// [`assert_holds_grant`] for the floor), while the same run without a rate is far faster.
/// The same over XRC (`-c XRC`: an initiator QP writing through the server's target QP).
#[test]
fn pacer_holds_ib_write_bw_to_the_granted_wqe_rate() {
    require_privileges!();
    if !have("ib_write_bw") {
        eprintln!("SKIPPED: perftest not installed (apt-get install perftest)");
        return;
    }
    let _files = drum_test_support::CreatedFiles::watch(&drum_test_support::XRC_DOMAIN_FILES);
    let run = Run::new("pacer");
    run.up(&["--hosts", "2"]);
    let unpaced = write_bw_msg_rate(&run, None, &[]);
    assert!(unpaced > 1000.0, "unpaced only {unpaced} msg/s");
    let paced = assert_holds_grant("ib_write_bw paced at 500 WQE/s", 500.0, 0.05, || {
        write_bw_msg_rate(&run, Some("500"), &[])
    });
    eprintln!("ib_write_bw 4 KiB: {unpaced:.0} msg/s unpaced, {paced:.0?} msg/s granted 500");
    let xrc = assert_holds_grant("ib_write_bw -c XRC paced at 500 WQE/s", 500.0, 0.05, || {
        write_bw_msg_rate(&run, Some("500"), &["-c", "XRC"])
    });
    eprintln!("ib_write_bw -c XRC 4 KiB: {xrc:.0?} msg/s granted 500");
}

/// A paced application's lists reach the NIC one doorbell per work request: unmodified
/// `ib_write_bw` posting lists of 32 is fetched 32 at a time through the shim without a
/// grant, and one at a time under a WQE grant, so a paced app's burst cannot hold other
/// QPs behind one long fetch (softrnic models doorbell-batch fetching, the paper's Fig. 2a).
#[test]
fn paced_lists_reach_the_nic_one_doorbell_per_work_request() {
    require_privileges!();
    if !have("ib_write_bw") {
        eprintln!("SKIPPED: perftest not installed (apt-get install perftest)");
        return;
    }
    let run = Run::new("doorbells");
    run.up(&["--hosts", "2"]);
    let args = perftest(
        "ib_write_bw",
        &["-s", "64", "-n", "1920", "-t", "128", "-l", "32"],
    );
    let per_read = |env: &[(&str, &str)]| {
        let before = run.settled_stats("h2");
        let who = format!("{args:?} {env:?}");
        let (server, client) = pair_env(&run, &args, true, env);
        assert_pair_ok(&server, &client, &who);
        let after = run.settled_stats("h2");
        let d = |k: &str| after[k] - before[k];
        let (wqes, reads) = (d("wqe_fetches"), d("wqe_fetch_reads"));
        assert!(wqes >= 1920, "{who}: {wqes} WQEs fetched");
        wqes as f64 / reads as f64
    };
    let free = per_read(&[]);
    let paced = per_read(&[("DRUM_SHIM_RATE_WQE_PER_S", "20000")]);
    eprintln!("WQEs per fetch read: {free:.1} unpaced, {paced:.2} paced");
    assert!(free >= 8.0, "unpaced lists: {free} WQEs per read");
    assert_eq!(paced, 1.0, "paced: one WQE per read");
}

/// The message rate of 300 writes of 4 KiB: without a grant, as perftest reports it; under a
/// static WQE grant (`rate`), the rate the shim's limit let them out at ([`paced_wqe_rate`]),
/// printed beside perftest's.
fn write_bw_msg_rate(run: &Run, rate: Option<&str>, extra: &[&str]) -> f64 {
    let mut args = perftest("ib_write_bw", &["-s", "4096", "-n", "300"]);
    args.extend_from_slice(extra);
    let env: Vec<(&str, &str)> = rate
        .map(|r| vec![("DRUM_SHIM_RATE_WQE_PER_S", r)])
        .unwrap_or_default();
    let who = format!("{args:?} rate={rate:?}");
    let (server, client) = pair_env(run, &args, true, &env);
    assert_pair_ok(&server, &client, &who);
    let f = result_fields(&client, &who);
    assert!(f.len() >= 5, "{who}: {f:?}");
    assert_eq!((f[0], f[1]), (4096.0, 300.0), "{who}");
    let reported = f[4] * 1e6; // MsgRate[Mpps]
    let s = summary(&client, &who);
    let Some(grant) = rate.map(|r| r.parse::<f64>().expect("a rate")) else {
        assert_eq!(s["rate_wqe_per_s"], 0, "{who}: {s:?}");
        assert_eq!(s["deferred_wqes"], 0, "{who}: {s:?}");
        return reported;
    };
    assert_eq!(s["rate_wqe_per_s"], grant as u64, "{who}: {s:?}");
    assert!(s["deferred_wqes"] >= 250, "{who}: {s:?}");
    assert_eq!(s["paced_wqes"], 300, "{who}: {s:?}");
    let paced = paced_wqe_rate(&s, default_wqe_burst(grant), &who);
    eprintln!("{who}: {paced:.1}/s let out by the shim, {reported:.0}/s by perftest's clock");
    paced
}

/// A rate the pacer cannot use is reported once and the program runs unpaced, unharmed.
#[test]
fn invalid_pacer_rate_is_reported_and_ignored() {
    require_privileges!();
    let run = Run::new("pacer-bad");
    run.up(&["--hosts", "2"]);
    let env = [("DRUM_SHIM_RATE_WQE_PER_S", "fast")];
    let args = ["ibv_rc_pingpong", "-g", "0", "-c", "-n", "20"];
    let (server, client) = pair_env(&run, &args, true, &env);
    for (o, who) in [(&server, "server"), (&client, "client")] {
        assert_ok(o, who);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(
            err.matches(
                "DRUM_SHIM_RATE_WQE_PER_S=\"fast\" is not a number; ignoring the static grant"
            )
            .count(),
            1,
            "{who}: {err}"
        );
        let s = summary(o, who);
        assert_eq!(
            (s["send_wqes"], s["rate_wqe_per_s"], s["deferred_wqes"]),
            (20, 0, 0),
            "{who}: {s:?}"
        );
    }
}

/// Forks while another thread keeps opening and closing contexts, completion channels and
/// (virtual) CQs (the shim's cold paths): every child does the same once and exits
/// normally. A child that
/// inherited the shim's lock held by the other thread would hang here (the deadline fails
/// the test).
const FORK_PROBE: &str = r#"
#include <infiniband/verbs.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>
static struct ibv_device *dev;
static volatile int stop;
static void *churn(void *a) {
    (void)a;
    while (!stop) {
        struct ibv_context *c = ibv_open_device(dev);
        if (!c) { perror("open in thread"); exit(2); }
        struct ibv_comp_channel *ch = ibv_create_comp_channel(c);
        struct ibv_cq *cq = ch ? ibv_create_cq(c, 16, 0, ch, 0) : 0;
        if (!cq) { perror("channel/cq in thread"); exit(2); }
        if (ibv_destroy_cq(cq) || ibv_destroy_comp_channel(ch)) { perror("destroy in thread"); exit(2); }
        ibv_close_device(c);
    }
    return 0;
}
int main(void) {
    int n = 0;
    struct ibv_device **l = ibv_get_device_list(&n);
    if (!l || n < 1) { fprintf(stderr, "no device\n"); return 2; }
    dev = l[0];
    struct ibv_context *c = ibv_open_device(dev);
    if (!c) { perror("open"); return 2; }
    pthread_t t;
    pthread_create(&t, 0, churn, 0);
    for (int i = 0; i < 20; i++) {
        pid_t p = fork();
        if (p == 0) {
            struct ibv_context *cc = ibv_open_device(dev);
            if (!cc) _exit(3);
            struct ibv_comp_channel *ch = ibv_create_comp_channel(cc);
            struct ibv_cq *cq = ch ? ibv_create_cq(cc, 16, 0, ch, 0) : 0;
            if (!cq || ibv_destroy_cq(cq) || ibv_destroy_comp_channel(ch)) _exit(4);
            ibv_close_device(cc);
            exit(0);
        }
        int st;
        waitpid(p, &st, 0);
        if (!WIFEXITED(st) || WEXITSTATUS(st)) { fprintf(stderr, "child %d: %d\n", i, st); return 1; }
    }
    stop = 1;
    pthread_join(t, 0);
    ibv_close_device(c);
    ibv_free_device_list(l);
    printf("forks ok\n");
    return 0;
}
"#;

#[test]
fn fork_while_another_thread_opens_and_closes_contexts() {
    require_privileges!();
    let run = Run::new("fork");
    run.up(&["--hosts", "1"]);
    let src = run.dir.join("fork_probe.c");
    let bin = run.dir.join("fork_probe");
    std::fs::write(&src, FORK_PROBE).unwrap();
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let out = run_timeout(
        Command::new(&cc)
            .arg("-o")
            .arg(&bin)
            .arg(&src)
            .args(["-libverbs", "-lpthread"]),
        Duration::from_secs(60),
    );
    assert_ok(&out, "cc fork_probe.c (needs libibverbs-dev)");
    let out = run_timeout(
        &mut run.exec("h1", &[bin.to_str().unwrap()], true, &[]),
        Duration::from_secs(30),
    );
    assert_ok(&out, "fork_probe");
    assert_eq!(String::from_utf8_lossy(&out.stdout), "forks ok\n");
    let err = String::from_utf8_lossy(&out.stderr);
    // One summary per child and one for the parent, which governed every context it opened.
    assert_eq!(err.matches("drum-shim: pid=").count(), 21, "{err}");
    let s = summary(&out, "fork_probe");
    let last = err
        .lines()
        .rfind(|l| l.starts_with("drum-shim: pid="))
        .unwrap();
    assert!(last.contains(" pass_through_contexts=0 "), "{last}");
    assert!(s["governed_contexts"] >= 1, "{s:?}");
}

/// `exit` called from a signal handler that interrupted `fork` while the shim's fork
/// handlers held its locks (qperf's server exits from its SIGQUIT handler; in CI the signal
/// once arrived then and the server spun for ever in the exit summary): the process exits,
/// and the summary says why it is missing rather than waiting. `tests/c/exit_in_fork.c`
/// times the signal into fork; runs until that happened a few times.
#[test]
fn exit_from_a_signal_handler_that_interrupted_fork_does_not_hang() {
    let run = Run::new("exit-in-fork");
    let bin = compile_c_with(&run, "tests/c/exit_in_fork.c", &[]);
    let (mut runs, mut interrupted) = (0, 0);
    while runs < 400 && interrupted < 3 {
        // Timers from 1 to 4 ms, so that the signal meets every part of the fork loop.
        let usec = (1000 + runs * 37 % 3000).to_string();
        let out = run_timeout(
            Command::new(&bin)
                .arg(&usec)
                .env("LD_PRELOAD", shim())
                .env("DRUM_SHIM_LOG", "1"),
            Duration::from_secs(10),
        );
        assert_ok(&out, &format!("exit_in_fork {usec} (run {runs})"));
        let err = String::from_utf8_lossy(&out.stderr);
        if err.contains("drum-shim: no exit summary for pid ") {
            interrupted += 1;
        } else {
            summary(&out, "exit_in_fork");
        }
        runs += 1;
    }
    assert!(
        interrupted > 0,
        "the signal never met the fork handlers in {runs} runs: the test did not test"
    );
    eprintln!("exit in fork: {interrupted} of {runs} runs interrupted the fork handlers");
}

/// `tests/c/vcq_probe.c` checks what an application may rely on from CQs and completion
/// channels (query_qp's CQs, a pollable and non-blocking channel fd, one channel serving two
/// CQs, events only, destroy order, a CQ overrun's asynchronous event naming the CQ): it
/// passes on the bare device, through the shim's virtual CQs, and with them turned off.
#[test]
fn virtual_cqs_keep_what_applications_rely_on() {
    require_privileges!();
    let run = Run::new("vcq");
    run.up(&["--hosts", "1"]);
    let bin = compile_probe(&run, "vcq_probe");
    type Env<'a> = &'a [(&'a str, &'a str)];
    let cases: [(&str, bool, Env); 3] = [
        ("bare device", false, &[]),
        ("virtual CQs", true, &[]),
        ("virtual CQs off", true, &[("DRUM_SHIM_VIRTUAL_CQ", "0")]),
    ];
    for (who, with_shim, env) in cases {
        let out = run_timeout(
            &mut run.exec("h1", &[&bin, "2000"], with_shim, env),
            Duration::from_secs(60),
        );
        assert_ok(&out, who);
        probe_rate(&out, who);
        if with_shim {
            let s = summary(&out, who);
            let virtual_cqs = if env.is_empty() { 3 } else { 0 };
            assert_eq!(s["virtual_cqs"], virtual_cqs, "{who}: {s:?}");
            // The probe never polls the 4-entry CQ it overruns; the engine thread may have
            // moved up to 4 of its completions into its ring (and counted them) first.
            let c = s["completions"];
            assert!((2 * 2000..=2 * 2000 + 4).contains(&c), "{who}: {s:?}");
            assert!(shim_complaints(&out).is_empty(), "{who}: {}", text(&out));
        }
    }
}

/// Our probe `tests/c/idle_sender.c` posts one SEND on each of 8 QPs and then waits for the
/// receives without polling its send CQ. Under top-k gating with 1 and 3 slots the later QPs
/// get a slot only when the shim sees the earlier ones complete: its engine thread collects
/// the dedicated CQs itself, so every message arrives (before, 1 of 8 did and the program
/// waited for ever), and each completion is counted once, whoever moved it. Also with
/// `ibv_cq_ex` CQs read by `ibv_start_poll`, whose completions keep their timestamps when
/// the engine thread moves them.
#[test]
fn gate_slots_move_on_while_the_application_does_not_poll() {
    require_privileges!();
    let run = Run::new("idle-sender");
    run.up(&["--hosts", "1"]);
    let bin = compile_probe(&run, "idle_sender");
    for (k, cqs) in [
        ("1", None),
        ("3", None),
        ("1", Some("ex")),
        ("3", Some("ex")),
    ] {
        let who = format!("idle_sender 8 {cqs:?}, {k} active QPs");
        let mut args = vec![bin.as_str(), "8"];
        args.extend(cqs);
        let out = run_timeout(
            &mut run.exec("h1", &args, true, &[("DRUM_SHIM_MAX_ACTIVE_QPS", k)]),
            Duration::from_secs(30),
        );
        assert_ok(&out, &who);
        assert!(
            String::from_utf8_lossy(&out.stdout).starts_with("idle ok "),
            "{who}: {}",
            text(&out)
        );
        let s = summary(&out, &who);
        assert_eq!((s["send_wqes"], s["recv_wqes"]), (8, 8), "{who}: {s:?}");
        assert_eq!(s["completions"], 16, "{who}: {s:?}");
        assert!(s["deferred_wqes"] > 0, "{who}: nothing was gated: {s:?}");
        assert!(shim_complaints(&out).is_empty(), "{who}: {}", text(&out));
    }
}

/// UD receives on CQs from `ibv_create_cq_ex` with no optional field asked for, read with
/// plain `ibv_poll_cq`, as UCX's `ud_verbs` transport reads them: every field of every
/// receive is what arrived, also when the engine thread moved the completions because the
/// probe left its CQs alone. (Before, the dedicated CQ had the application's reader set, so a
/// moved completion lost its byte length, source QP and flags: UCX saw `byte_len` 0, read an
/// empty buffer as a message of 4294967248 bytes and aborted.)
#[test]
fn moved_completions_of_an_extended_cq_keep_every_field_plain_polls_read() {
    require_privileges!();
    let run = Run::new("ud-cq-ex");
    run.up(&["--hosts", "1"]);
    let bin = compile_probe(&run, "ud_cq_ex");
    let grant = [("DRUM_SHIM_MAX_ACTIVE_QPS", "1")];
    for (who, with_shim, env) in [
        ("bare device", false, &[][..]),
        ("through the shim", true, &[][..]),
        ("under a grant of one active QP", true, &grant[..]),
    ] {
        let out = run_timeout(
            &mut run.exec("h1", &[&bin, "160"], with_shim, env),
            Duration::from_secs(60),
        );
        assert_ok(&out, who);
        assert_eq!(String::from_utf8_lossy(&out.stdout), "ud ok\n", "{who}");
        if with_shim {
            let s = summary(&out, who);
            let got = (s["virtual_cqs"], s["send_wqes"], s["completions"]);
            assert_eq!(got, (2, 160, 320), "{who}: {s:?}");
        }
    }
}

/// Our probe `tests/c/dl_verbs.c` does not link libibverbs: it dlopens it with `RTLD_LOCAL`
/// and takes every function it calls from the handle with `dlsym`, as NCCL does. It runs on
/// the bare device, and through the shim — whose `dlsym` hands it the shim's functions —
/// its context is governed like any other: the same result, every send and completion
/// counted, virtual CQs, and a grant of 2 active QPs queues its work. (Before, the shim
/// never saw its context: `governed_contexts=0`.)
#[test]
fn programs_that_dlopen_libibverbs_are_governed() {
    require_privileges!();
    let run = Run::new("dl-verbs");
    run.up(&["--hosts", "1"]);
    let bin = compile_c_with(&run, "tests/c/dl_verbs.c", &[]);
    same_output_bare_and_governed(&run, &[&bin, "4", "100"], "dl ok\n", "2", (1, 2, 400, 800));
}

/// The same probe built as a plugin that links libibverbs, loaded by `plugin_host` with
/// `RTLD_LOCAL` as Python loads pyverbs and UCX its transports: libibverbs is then outside
/// the global scope, so `RTLD_NEXT` cannot find it. Before, the shim's `ibv_open_device`
/// failed with ENOSYS ("libibverbs' ibv_open_device not found"); now such a program runs
/// and is governed like any other.
#[test]
fn plugins_that_link_libibverbs_privately_are_governed() {
    require_privileges!();
    let run = Run::new("plugin-verbs");
    run.up(&["--hosts", "1"]);
    let plugin = compile_c_as(
        &run,
        "tests/c/dl_verbs.c",
        "dl_plugin.so",
        &["-DPLUGIN", "-shared", "-fPIC", "-libverbs"],
    );
    let host = compile_c_with(&run, "tests/c/plugin_host.c", &[]);
    let args = [host.as_str(), plugin.as_str(), "4", "100"];
    same_output_bare_and_governed(&run, &args, "dl ok\n", "2", (1, 2, 400, 800));
}

/// `args` on h1 on the bare device, through the shim, and through the shim under a grant of
/// `k` active QPs: the same output each time; through the shim the summary shows the
/// governed contexts, virtual CQs, sends and completions `want`s, and work queued only under
/// the grant.
fn same_output_bare_and_governed(
    run: &Run,
    args: &[&str],
    output: &str,
    k: &str,
    want: (u64, u64, u64, u64),
) {
    let grant = [("DRUM_SHIM_MAX_ACTIVE_QPS", k)];
    type Env<'a> = &'a [(&'a str, &'a str)];
    let cases: [(&str, bool, Env); 3] = [
        ("bare device", false, &[]),
        ("through the shim", true, &[]),
        ("under a grant of active QPs", true, &grant),
    ];
    for (who, with_shim, env) in cases {
        let out = run_timeout(
            &mut run.exec("h1", args, with_shim, env),
            Duration::from_secs(60),
        );
        assert_ok(&out, who);
        assert_eq!(String::from_utf8_lossy(&out.stdout), output, "{who}");
        if !with_shim {
            continue;
        }
        let s = summary(&out, who);
        let got = (
            s["governed_contexts"],
            s["virtual_cqs"],
            s["send_wqes"],
            s["completions"],
        );
        assert_eq!(got, want, "{who}: {s:?}");
        assert_eq!(s["deferred_wqes"] > 0, !env.is_empty(), "{who}: {s:?}");
        assert!(shim_complaints(&out).is_empty(), "{who}: {}", text(&out));
    }
}

/// Several devices: our probe `tests/c/two_devices.c` opens both devices of a host
/// (`softrnic up --devices 2`) and sends between them both ways, payloads and order
/// checked. Through the shim each context is governed (2 governed contexts, 4 virtual CQs,
/// every send and completion counted), and one grant of 1 active QP covers the app's QPs on
/// both devices.
#[test]
fn contexts_of_two_devices_are_governed_together() {
    require_privileges!();
    let run = Run::new("two-devices");
    run.up(&["--hosts", "1", "--devices", "2"]);
    let bin = compile_probe(&run, "two_devices");
    same_output_bare_and_governed(&run, &[&bin, "200"], "devices ok\n", "1", (2, 4, 400, 800));
}

/// One of softrnic's checkers (`testbed/softrnic/tests/verify`) through the shim: its
/// server on h1, its client on h2, both succeeding; the server's output.
fn checker_through_shim(
    run: &Run,
    bin: &str,
    port: &str,
    env: &[(&str, &str)],
    who: &str,
) -> Output {
    let ip = run.addr("h1");
    let mut server = spawn(&mut run.exec("h1", &[bin, "server", port], true, env));
    // The checker's client does not retry a connection its server does not take yet.
    drum_test_support::wait_listening(&mut server, port.parse().unwrap(), Duration::from_secs(30));
    let client = run_timeout(
        &mut run.exec("h2", &[bin, "client", &ip, port], true, env),
        Duration::from_secs(60),
    );
    let server = wait_timeout(server, Duration::from_secs(30));
    assert_pair_ok(&server, &client, who);
    server
}

/// softrnic's own asynchronous-event checker (`testbed/softrnic/tests/verify/srn_async.c`)
/// through the shim on both hosts: SRQ limit events, COMM_EST, LAST_WQE_REACHED, destroys
/// waiting for acknowledgements, and a CQ armed solicited-only — now a virtual CQ whose
/// dedicated CQ carries the arming — behave as on the bare device.
#[test]
fn async_events_and_solicited_arming_through_virtual_cqs() {
    require_privileges!();
    let run = Run::new("async-shim");
    run.up(&["--hosts", "2"]);
    let bin = compile_c(&run, "../../testbed/softrnic/tests/verify/srn_async.c");
    let server = checker_through_shim(&run, &bin, "7474", &[], "srn_async");
    let out = String::from_utf8_lossy(&server.stdout);
    assert!(out.contains("OK async events"), "{}", text(&server));
    let s = summary(&server, "srn_async server");
    assert!(s["virtual_cqs"] >= 1 && s["cq_events"] >= 1, "{s:?}");
    assert!(shim_complaints(&server).is_empty(), "{}", text(&server));
}

/// softrnic's XRC checker (`testbed/softrnic/tests/verify/srn_xrc.c`) through the shim on
/// both hosts, with plain CQs and with `ibv_cq_ex` CQs read by `ibv_start_poll`: the
/// receives of an XRC SRQ complete on the application's own CQ, not on a dedicated one, and
/// reach it through `ibv_poll_cq` and through `ibv_start_poll` alike (before, a virtual
/// `ibv_cq_ex` never delivered them and the server waited for ever).
#[test]
fn xrc_srq_receives_reach_plain_and_extended_virtual_cqs() {
    require_privileges!();
    let run = Run::new("xrc-shim");
    run.up(&["--hosts", "2"]);
    let bin = compile_c(&run, "../../testbed/softrnic/tests/verify/srn_xrc.c");
    for (who, env, port) in [
        ("plain CQs", &[][..], "7478"),
        ("ibv_cq_ex", &[("SRN_CQ_EX", "1")][..], "7479"),
    ] {
        let server = checker_through_shim(&run, &bin, port, env, who);
        assert!(
            String::from_utf8_lossy(&server.stdout).contains("OK server"),
            "{who}: {}",
            text(&server)
        );
        // The server's and its sibling's summaries: every SRQ receive completed and counted.
        let srq_completions: u64 = String::from_utf8_lossy(&server.stderr)
            .lines()
            .filter(|l| l.starts_with("drum-shim: pid="))
            .filter_map(|l| {
                l.split_whitespace()
                    .find_map(|f| f.strip_prefix("completions="))
                    .and_then(|v| v.parse::<u64>().ok())
            })
            .sum();
        assert_eq!(srq_completions, 4, "{who}: {}", text(&server));
        assert!(
            shim_complaints(&server).is_empty(),
            "{who}: {}",
            text(&server)
        );
    }
}

/// Unmodified perftest `raw_ethernet_bw` (a raw-packet QP whose frames softrnic steers by
/// flow rules) under the shim: every frame is counted, and a WQE grant of 2,000 frames/s holds
/// its message rate, where it runs several times faster ungoverned. A raw Ethernet server has
/// no handshake: its client starts a second after it (a pair that loses that race is run
/// again).
#[test]
fn raw_ethernet_frames_are_counted_and_paced_by_the_shim() {
    require_privileges!();
    if !drum_test_support::have("raw_ethernet_bw") {
        eprintln!("SKIPPED: needs perftest");
        return;
    }
    let run = Run::new("raw");
    run.up(&["--hosts", "2"]);
    let (h1, h2) = (run.addr("h1"), run.addr("h2"));
    let args = |me: &'static str, peer: &'static str, role: &'static str| {
        let mut a = vec!["raw_ethernet_bw", role, "-B", me, "-E", peer];
        a.extend([
            "-J", &h1, "-j", &h2, "-K", "5000", "-k", "5001", "-n", "1000",
        ]);
        a
    };
    let (m1, m2) = ("02:00:00:00:00:01", "02:00:00:00:00:02");
    let (sargs, cargs) = (args(m1, m2, "--server"), args(m2, m1, "--client"));
    let frames_per_s = |env: &[(&str, &str)]| {
        let who = format!("raw_ethernet_bw {env:?}");
        for attempt in 1..=3 {
            let server = spawn(&mut run.exec("h1", &sargs, true, env));
            std::thread::sleep(Duration::from_secs(1));
            let client = run_timeout(
                &mut run.exec("h2", &cargs, true, env),
                Duration::from_secs(30),
            );
            let server = drum_test_support::wait_timeout(server, Duration::from_secs(10));
            if !(server.status.success() && client.status.success()) && attempt < 3 {
                continue;
            }
            assert_pair_ok(&server, &client, &who);
            let s = summary(&client, &who);
            assert_eq!(s["send_wqes"], 1000, "{who}: {s:?}");
            assert_eq!(s["send_bytes"], 1000 * 1514, "{who}: {s:?}");
            assert_eq!(summary(&server, &who)["recv_wqes"], 1000, "{who}");
            let out = String::from_utf8_lossy(&client.stdout);
            let mpps: f64 = out
                .lines()
                .find_map(|l| {
                    let f: Vec<&str> = l.split_whitespace().collect();
                    (f.len() == 5 && f[0] == "1518").then(|| f[4].parse().ok())?
                })
                .unwrap_or_else(|| panic!("{who}: {out}"));
            let Some(grant) = env
                .iter()
                .find(|(k, _)| *k == "DRUM_SHIM_RATE_WQE_PER_S")
                .map(|(_, v)| v.parse::<f64>().expect("a rate"))
            else {
                return mpps * 1e6;
            };
            let paced = paced_wqe_rate(&s, default_wqe_burst(grant), &who);
            eprintln!(
                "{who}: {paced:.1}/s let out by the shim, {:.0}/s by perftest's clock",
                mpps * 1e6
            );
            return paced;
        }
        unreachable!()
    };
    let free = frames_per_s(&[]);
    let paced = assert_holds_grant("raw_ethernet_bw at 2000 WQE/s", 2000.0, 0.05, || {
        frames_per_s(&[("DRUM_SHIM_RATE_WQE_PER_S", "2000")])
    });
    eprintln!("raw_ethernet_bw: {free:.0} frames/s ungoverned, {paced:.0?} granted 2000");
    assert!(free > 4000.0, "ungoverned only {free} frames/s");
}
