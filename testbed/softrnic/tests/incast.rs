//! The receive port (docs/softrnic-congestion.md) with real processes: stock `ib_write_bw`
//! senders on several emulated hosts into one.

#[macro_use]
mod common;

use common::*;
use drum_test_support::{perftest, run_timeout, spawn, text, wait_timeout};
use std::collections::HashMap;
use std::sync::{PoisonError, RwLock};
use std::time::Duration;

/// The incast and DCQCN tests run side by side (shared), as they did before the AUSS test;
/// that one runs alone (exclusive), so that its engines and senders do not load the shared
/// 2-core machine under the others' queue and rate measurements.
static MACHINE: RwLock<()> = RwLock::new(());

/// How many times slower than real time the DCQCN test's NIC runs.
const DILATION: f64 = 4.0;

/// Payload rate of a 1 Gb/s line with 4,096-byte packets and 90 bytes of headers, MiB/s.
const LINE_MIB_S: f64 = 1e9 / 8.0 * 4096.0 / 4186.0 / 1_048_576.0;

fn have_perftest() -> bool {
    std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).any(|d| d.join("ib_write_bw").is_file()))
        .unwrap_or(false)
}

/// [`incast_once`] until every sender has a rate, at most three times. With `-F` a perftest
/// that cannot fit its CPU clock on a loaded machine reports 0 MB/s rather than exiting
/// (CI, 2026-11-27: a sender "got" 0.0 MiB/s while h1 received the whole line): that is a
/// failed measurement, measured again, not a rate. h1's counters cover every attempt.
fn incast(run: &Run, senders: usize, args: &[&str]) -> (Vec<Option<f64>>, HashMap<String, u64>) {
    let mut attempt = 1;
    loop {
        let (rates, s) = incast_once(run, senders, args);
        if attempt == 3 || rates.iter().all(Option::is_some) {
            return (rates, s);
        }
        eprintln!("attempt {attempt}: a sender has no rate ({rates:?}); measuring again");
        attempt += 1;
    }
}

/// `senders` clients on h2, h3, … each into its own server on h1; returns each client's
/// MiB/s (None for one that failed, or whose perftest could not time its run) and h1's
/// counters once they have been written.
fn incast_once(
    run: &Run,
    senders: usize,
    args: &[&str],
) -> (Vec<Option<f64>>, HashMap<String, u64>) {
    let ip = run.addr("h1");
    let mut servers: Vec<_> = (1..=senders)
        .map(|i| {
            let port = (18600 + i).to_string();
            let mut a = args.to_vec();
            a.extend(["-p", &port]);
            spawn(&mut run.exec("h1", &a))
        })
        .collect();
    // perftest's clients do not retry a connection their server does not take yet.
    for (i, server) in (1..=senders).zip(&mut servers) {
        drum_test_support::wait_listening(server, 18600 + i as u16, Duration::from_secs(30));
    }
    let clients: Vec<_> = (1..=senders)
        .map(|i| {
            let port = (18600 + i).to_string();
            let mut a = args.to_vec();
            a.extend(["-p", &port, &ip]);
            spawn(&mut run.exec(&format!("h{}", i + 1), &a))
        })
        .collect();
    let rates = clients
        .into_iter()
        .map(|c| {
            let out = wait_timeout(c, Duration::from_secs(90));
            if !out.status.success() {
                eprintln!("sender failed: {}", text(&out));
                return None;
            }
            let rate: Option<f64> = String::from_utf8_lossy(&out.stdout).lines().find_map(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                (f.len() >= 4 && f[0].parse::<u64>().is_ok()).then(|| f[3].parse().ok())?
            });
            rate.filter(|r| *r > 0.0)
        })
        .collect();
    for s in servers {
        wait_timeout(s, Duration::from_secs(30));
    }
    // The stats file is rewritten about every 200 ms.
    std::thread::sleep(Duration::from_millis(600));
    (rates, run.stats("h1"))
}

#[test]
fn incast_queues_at_the_receivers_line_rate_and_one_sender_does_not() {
    require_privileges!();
    let _shared = MACHINE.read().unwrap_or_else(PoisonError::into_inner);
    if !have_perftest() {
        eprintln!("SKIPPED: perftest not installed (apt-get install perftest)");
        return;
    }
    let bw = perftest("ib_write_bw", &["-s", "65536", "-D", "3"]);

    // The port without congestion control: marks counted, nobody reacts.
    let run = Run::new("incast");
    let marking = ["--ecn-threshold-kib", "200"];
    run.up(&[
        &["--hosts", "4", "--line-rate-gbps", "1", "--dcqcn", "off"],
        &marking[..],
    ]
    .concat());
    let (rates, s) = incast(&run, 3, &bw);
    eprintln!("lossless, 3 senders: {rates:?} MiB/s, h1: {s:?}");
    let total: f64 = rates.iter().map(|r| r.expect("a sender failed")).sum();
    // Before the receive port the three delivered 270 MiB/s into this 117 MiB/s line.
    assert!(
        total > 0.8 * LINE_MIB_S && total < 1.05 * LINE_MIB_S,
        "aggregate {total:.1} MiB/s, line {LINE_MIB_S:.1}"
    );
    assert!(s["rx_queue_max_bytes"] > 200 * 1024, "{s:?}");
    assert!(s["rx_queue_mean_bytes"] > 0, "{s:?}");
    assert!(s["rx_ecn_marked"] > 0 && s["rx_pause_ns"] > 0, "{s:?}");
    assert_eq!(s["rx_port_dropped"], 0, "{s:?}");
    drop(run);

    let run = Run::new("incast-lossy");
    run.up(&["--hosts", "4", "--line-rate-gbps", "1", "--rx-lossy"]);
    let (rates, s) = incast(&run, 3, &bw);
    eprintln!("lossy, 3 senders: {rates:?} MiB/s, h1: {s:?}");
    assert!(s["rx_port_dropped"] > 0 && s["rx_pauses"] == 0, "{s:?}");
    let retransmits: u64 = ["h2", "h3", "h4"]
        .iter()
        .map(|h| run.stats(h)["retransmits"])
        .sum();
    assert!(retransmits > 0);
    drop(run);

    let run = Run::new("incast-one");
    run.up(&[&["--hosts", "2", "--line-rate-gbps", "1"], &marking[..]].concat());
    let (rates, s) = incast(&run, 1, &bw);
    eprintln!("one sender: {rates:?} MiB/s, h1: {s:?}");
    assert!(rates[0].expect("the sender failed") > 0.9 * LINE_MIB_S);
    assert!(s["rx_port_arrivals"] > 0, "{s:?}");
    for k in [
        "rx_queue_max_bytes",
        "rx_ecn_marked",
        "rx_pauses",
        "rx_port_dropped",
    ] {
        assert_eq!(s[k], 0, "{k}: {s:?}");
    }
}

/// DCQCN (docs/softrnic-congestion.md): four senders into one host with ECN marking on. With
/// DCQCN the receiver answers marks with CNPs, the senders' QPs slow down, and the queue
/// stays near the marking threshold instead of at the buffer, so the port pauses senders
/// far less; with `--dcqcn off` the same incast is held back by pauses alone. The 1 Gb/s NIC
/// runs [`DILATION`] times slower than real time, so that the engines' wake-ups in DCQCN's
/// loop are a quarter as long in the NIC's time and the queue is the model's, not the
/// machine's load: undilated, the mean queue with DCQCN ranged 88–632 KB from run to run
/// on this machine; dilated, 77–107 KB, busy loops beside it or not.
#[test]
fn dcqcn_keeps_the_incast_queue_near_the_ecn_threshold_and_pauses_rare() {
    require_privileges!();
    let _shared = MACHINE.read().unwrap_or_else(PoisonError::into_inner);
    if !have_perftest() {
        eprintln!("SKIPPED: perftest not installed (apt-get install perftest)");
        return;
    }
    let bw = perftest("ib_write_bw", &["-s", "65536", "-D", "3"]);
    let senders = ["h2", "h3", "h4", "h5"];
    let mut runs = Vec::new();
    for dcqcn in ["on", "off"] {
        let run = Run::new(&format!("incast-dcqcn-{dcqcn}"));
        run.up(&[
            "--hosts",
            "5",
            "--line-rate-gbps",
            &(1.0 / DILATION).to_string(),
            "--time-scale",
            &DILATION.to_string(),
            "--ecn-threshold-kib",
            "200",
            "--dcqcn",
            dcqcn,
        ]);
        let (rates, s) = incast(&run, 4, &bw);
        let decreases: u64 = senders
            .iter()
            .map(|h| run.stats(h)["dcqcn_rate_decreases"])
            .sum();
        let cnps_received: u64 = senders
            .iter()
            .map(|h| run.stats(h)["dcqcn_cnps_received"])
            .sum();
        eprintln!(
            "dcqcn {dcqcn}, 4 senders: {rates:?} MiB/s, senders' rate decreases {decreases}, \
             CNPs received {cnps_received}, h1: {s:?}"
        );
        let total: f64 = rates.iter().map(|r| r.expect("a sender failed")).sum();
        // DCQCN's own price at this threshold: about 60 % of the line (dcqcn.rs,
        // `a_threshold_long_in_line_time_costs_utilisation`).
        let floor = if dcqcn == "on" { 0.5 } else { 0.6 };
        assert!(
            total > floor * LINE_MIB_S / DILATION,
            "dcqcn {dcqcn}: aggregate {total:.1} MiB/s"
        );
        assert_eq!(s["rx_port_dropped"], 0, "{s:?}");
        runs.push((s, decreases, cnps_received));
    }
    let (on, on_decreases, on_cnps) = &runs[0];
    let (off, off_decreases, off_cnps) = &runs[1];
    assert!(
        on["dcqcn_cnps_sent"] > 0 && *on_cnps > 0 && *on_decreases > 0,
        "{on:?}"
    );
    assert!(
        off["dcqcn_cnps_sent"] == 0 && *off_cnps == 0 && *off_decreases == 0,
        "{off:?}"
    );
    assert!(
        off["rx_ecn_marked"] > 0 && off["rx_pause_ns"] > 0,
        "{off:?}"
    );
    // Pause time much lower, and the queue as packets find it near the threshold (200 KiB,
    // below twice it) rather than near the 2 MiB buffer.
    assert!(
        on["rx_pause_ns"] * 4 < off["rx_pause_ns"],
        "pause time: on {} ns, off {} ns",
        on["rx_pause_ns"],
        off["rx_pause_ns"]
    );
    assert!(
        on["rx_queue_mean_bytes"] < 400 * 1024
            && on["rx_queue_mean_bytes"] * 2 < off["rx_queue_mean_bytes"],
        "mean queue: on {}, off {}",
        on["rx_queue_mean_bytes"],
        off["rx_queue_mean_bytes"]
    );
}

/// h1's N as host `host`'s table shows it (`softrnic auss`, which finds the table as a
/// program does, through the device's `softrnic_auss` file); None before h1 stamped any.
fn n_seen_by(run: &Run, host: &str, h1: &str) -> Option<u64> {
    let out = run_timeout(run.cmd().args(["auss", host]), Duration::from_secs(10));
    assert!(out.status.success(), "auss failed: {}", text(&out));
    let table = String::from_utf8_lossy(&out.stdout).into_owned();
    table.lines().find_map(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        (f.first() == Some(&h1)).then(|| f[1].parse().unwrap())
    })
}

/// Polls [`n_seen_by`] until it is `want`, for at most `limit`; returns how long it took.
fn until_n(run: &Run, host: &str, h1: &str, want: u64, limit: Duration) -> Duration {
    let t = std::time::Instant::now();
    loop {
        let n = n_seen_by(run, host, h1);
        if n == Some(want) {
            return t.elapsed();
        }
        assert!(
            t.elapsed() < limit,
            "{host} sees N = {n:?} for h1 after {limit:?}, not {want}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// AUSS in the NIC's ACKs (docs/softrnic-congestion.md) with real processes: `ib_write_bw`
/// from h2 into h1, then from h3 too: both senders' devices show h1's N go 1 → 2; the h2
/// sender is SIGKILLed, and after the expiry h3's device shows 1.
#[test]
fn auss_n_follows_senders_joining_and_a_sigkilled_one_leaving() {
    require_privileges!();
    let _alone = MACHINE.write().unwrap_or_else(PoisonError::into_inner);
    if !have_perftest() {
        eprintln!("SKIPPED: perftest not installed (apt-get install perftest)");
        return;
    }
    let run = Run::new("auss");
    let expiry = Duration::from_millis(500);
    let ms = expiry.as_millis().to_string();
    run.up(&[
        "--hosts",
        "3",
        "--line-rate-gbps",
        "1",
        "--auss-expiry-ms",
        &ms,
    ]);
    let h1 = run.addr("h1");
    let bw = |port: &str| -> Vec<String> {
        perftest("ib_write_bw", &["-s", "65536", "-D", "20", "-p", port])
            .into_iter()
            .map(String::from)
            .collect()
    };
    let start = |host: &str, port: &str, server: bool| {
        let mut a = bw(port);
        if !server {
            a.push(h1.clone());
        }
        let a: Vec<&str> = a.iter().map(String::as_str).collect();
        spawn(&mut run.exec(host, &a))
    };
    let mut servers = vec![start("h1", "18621", true), start("h1", "18622", true)];
    drum_test_support::wait_listening(&mut servers[0], 18621, Duration::from_secs(30));
    drum_test_support::wait_listening(&mut servers[1], 18622, Duration::from_secs(30));
    let limit = Duration::from_secs(20);

    let mut first = start("h2", "18621", false);
    let t = until_n(&run, "h2", &h1, 1, limit);
    eprintln!(
        "h2 sends: N = 1 on h2's device {} ms after its start",
        t.as_millis()
    );
    let second = start("h3", "18622", false);
    let t3 = until_n(&run, "h3", &h1, 2, limit);
    let t2 = until_n(&run, "h2", &h1, 2, limit);
    eprintln!(
        "h3 sends too: N = 2 on h3's device after {} ms, then on h2's",
        t3.as_millis()
    );
    assert!(t2 < Duration::from_secs(1), "h2 was told within {t2:?}");

    first.kill().unwrap(); // SIGKILL: the sender announces nothing more
    let killed = std::time::Instant::now();
    until_n(&run, "h3", &h1, 1, limit);
    let left = killed.elapsed();
    eprintln!(
        "h2's sender SIGKILLed: N = 1 on h3's device {} ms later",
        left.as_millis()
    );
    // Its last refresh was at most expiry/4 before the kill.
    assert!(left >= expiry / 2, "left after {left:?}, before the expiry");
    // The stats files are rewritten about every 200 ms.
    std::thread::sleep(Duration::from_millis(600));
    let h1s = run.stats("h1");
    eprintln!("h1: {h1s:?}");
    assert!(
        h1s["auss_stamped_acks"] > 0 && h1s["auss_notifications_sent"] >= 4,
        "{h1s:?}"
    );
    assert_eq!(h1s["auss_n"], 1, "{h1s:?}");
    let h3s = run.stats("h3");
    assert!(h3s["auss_stamps_newer"] >= 2, "{h3s:?}");
    assert_eq!(
        h3s["auss_refused_malformed"] + h3s["auss_refused_forged"],
        0,
        "{h3s:?}"
    );
    for mut c in [second].into_iter().chain(servers) {
        c.kill().unwrap();
        c.wait().unwrap();
    }
    first.wait().unwrap();
}
