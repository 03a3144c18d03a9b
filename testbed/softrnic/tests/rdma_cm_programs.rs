//! Unmodified librdmacm programs (rdmacm-utils and perftest's `-R`) over softrnic's RDMA
//! connection manager, between two emulated hosts.
//!
//! These tests need root (mount and network namespaces); without it they print why and skip.

#[macro_use]
mod common;

use common::*;
use drum_test_support::{have, perftest, run_timeout, text};
use std::time::Duration;

fn cm_tools_present() -> bool {
    let need = [
        "rping",
        "ucmatose",
        "udaddy",
        "rdma_server",
        "rdma_xserver",
        "riostream",
    ];
    let missing: Vec<&str> = need.into_iter().filter(|p| !have(p)).collect();
    if !missing.is_empty() {
        eprintln!("SKIPPED: needs rdmacm-utils ({missing:?} missing)");
    }
    missing.is_empty()
}

/// Server on h1, client (with `-s`/`-a` and h1's address) on h2: both must succeed.
fn cm_pair(run: &Run, server: &[&str], client: &[&str], want: &str) -> String {
    let (s, c) = pair_with(run, server, client);
    assert!(
        s.status.success() && c.status.success(),
        "{server:?} server: {}\n{client:?} client: {}",
        text(&s),
        text(&c)
    );
    let all = text(&c);
    assert!(all.contains(want), "{client:?}: no {want:?} in:\n{all}");
    all
}

fn pair_with(
    run: &Run,
    server: &[&str],
    client: &[&str],
) -> (std::process::Output, std::process::Output) {
    let ip = run.addr("h1");
    let cargs: Vec<&str> = client
        .iter()
        .map(|a| if *a == "SERVER" { ip.as_str() } else { a })
        .collect();
    let mut attempt = 1;
    loop {
        let mut s = drum_test_support::spawn(&mut run.exec("h1", server));
        let c = client_retrying(run, "h2", &cargs);
        if attempt < 5 && drum_test_support::perftest_cm_listen_race(&c) {
            eprintln!("{client:?}: perftest's listen race (attempt {attempt}); both sides again");
            let _ = s.kill();
            drum_test_support::wait_timeout(s, Duration::from_secs(10));
            attempt += 1;
            continue;
        }
        return (
            drum_test_support::wait_timeout(s, Duration::from_secs(60)),
            c,
        );
    }
}

/// rping (data validated), ucmatose (4 RC connections, 20 messages each), udaddy (UD found
/// through SIDR), rdma_server/rdma_client (synchronous ids, so MIGRATE_ID), rdma_xserver/
/// rdma_xclient (XRC through the CM), riostream and rstream (rsockets), and rcopy (a 3 MB file
/// over rsockets, compared byte for byte).
#[test]
fn rdmacm_utils_connect_transfer_and_disconnect() {
    require_privileges!();
    if !cm_tools_present() {
        return;
    }
    let run = Run::new("cm-utils");
    run.up(&["--hosts", "2"]);
    let ip = run.addr("h1");
    let out = cm_pair(
        &run,
        &["rping", "-s", "-a", &ip, "-C", "10", "-V"],
        &["rping", "-c", "-a", "SERVER", "-C", "10", "-V", "-v"],
        "ping data: rdma-ping-9",
    );
    assert!(!out.contains("rror"), "{out}");
    cm_pair(
        &run,
        &["ucmatose", "-c", "4", "-C", "20"],
        &["ucmatose", "-s", "SERVER", "-c", "4", "-C", "20"],
        "return status 0",
    );
    cm_pair(
        &run,
        &["udaddy", "-c", "4", "-C", "20"],
        &["udaddy", "-s", "SERVER", "-c", "4", "-C", "20"],
        "return status 0",
    );
    cm_pair(
        &run,
        &["rdma_server"],
        &["rdma_client", "-s", "SERVER"],
        "rdma_client: end 0",
    );
    cm_pair(
        &run,
        &["rdma_xserver"],
        &["rdma_xclient", "-s", "SERVER"],
        "rdma_xclient: end 0",
    );
    cm_pair(
        &run,
        &["riostream", "-S", "4096", "-C", "50"],
        &["riostream", "-s", "SERVER", "-S", "4096", "-C", "50"],
        "4k",
    );
    // rsockets' control messages are zero-length WRITE_WITH_IMMs with uninitialised R_Keys:
    // hundreds of them, blocking and non-blocking, data verified.
    for mode in ["b", "n"] {
        cm_pair(
            &run,
            &["rstream", "-S", "1024", "-C", "500", "-T", mode],
            &[
                "rstream", "-s", "SERVER", "-S", "1024", "-C", "500", "-T", mode,
            ],
            "1k",
        );
    }
    cm_pair(
        &run,
        &["rstream", "-S", "65536", "-C", "40", "-T", "v"],
        &[
            "rstream", "-s", "SERVER", "-S", "65536", "-C", "40", "-T", "v",
        ],
        "64k",
    );
    // rcopy's server serves copies until killed; the hosts share the file system.
    if have("rcopy") {
        let (src, dst) = (run.dir.join("rcopy.src"), run.dir.join("rcopy.dst"));
        let data: Vec<u8> = (0..3_000_000u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();
        std::fs::write(&src, &data).unwrap();
        let mut server = drum_test_support::spawn(&mut run.exec("h1", &["rcopy"]));
        let to = format!("{ip}:{}", dst.display());
        let c = client_retrying(&run, "h2", &["rcopy", src.to_str().unwrap(), &to]);
        let _ = server.kill();
        drum_test_support::wait_timeout(server, Duration::from_secs(10));
        assert!(c.status.success(), "rcopy: {}", text(&c));
        assert!(std::fs::read(&dst).unwrap() == data, "rcopy's copy differs");
    }
}

/// perftest connected through the RDMA CM (`-R`): RC write bandwidth, send and read latency,
/// and UD send latency (the UD peer found through SIDR).
#[test]
fn perftest_connects_through_the_rdma_cm() {
    require_privileges!();
    if !have("ib_write_bw") {
        eprintln!("SKIPPED: needs perftest");
        return;
    }
    let run = Run::new("cm-perftest");
    run.up(&["--hosts", "2"]);
    for args in [
        perftest("ib_write_bw", &["-R", "-s", "65536", "-n", "300"]),
        perftest("ib_send_lat", &["-R", "-n", "300"]),
        perftest("ib_read_lat", &["-R", "-n", "200"]),
        perftest("ib_send_lat", &["-R", "-c", "UD", "-n", "200"]),
    ] {
        let mut client = args.to_vec();
        client.push("SERVER");
        cm_pair(&run, &args, &client, "#bytes");
    }
}

/// What a program is told when the other side is missing or an address is taken: as on a
/// NIC, a connect without a listener is rejected (reason 8, invalid service ID), a UD lookup
/// finds nobody, a second listener on a port gets EADDRINUSE, and nothing crashes.
#[test]
fn rdma_cm_refusals_are_reported_as_on_a_nic() {
    require_privileges!();
    if !cm_tools_present() {
        return;
    }
    let run = Run::new("cm-refusals");
    run.up(&["--hosts", "2"]);
    let ip = run.addr("h1");
    let t = Duration::from_secs(30);
    let c = run_timeout(
        &mut run.exec("h2", &["rping", "-c", "-a", &ip, "-C", "1"]),
        t,
    );
    assert!(
        !c.status.success() && c.status.code().is_some(),
        "{}",
        text(&c)
    );
    assert!(
        text(&c).contains("RDMA_CM_EVENT_REJECTED, error 8"),
        "{}",
        text(&c)
    );
    let c = run_timeout(&mut run.exec("h2", &["udaddy", "-s", &ip]), t);
    assert!(
        text(&c).contains("RDMA_CM_EVENT_UNREACHABLE"),
        "{}",
        text(&c)
    );
    assert!(c.status.code().is_some(), "{}", text(&c));

    // A port is the first listener's until it ends.
    let first =
        drum_test_support::spawn(&mut run.exec("h1", &["rping", "-s", "-a", &ip, "-C", "1"]));
    std::thread::sleep(Duration::from_millis(800));
    let second = run_timeout(
        &mut run.exec("h1", &["rping", "-s", "-a", &ip, "-C", "1"]),
        t,
    );
    assert!(!second.status.success(), "{}", text(&second));
    assert!(
        text(&second).contains("Address already in use"),
        "{}",
        text(&second)
    );
    let c = client_retrying(&run, "h2", &["rping", "-c", "-a", &ip, "-C", "1"]);
    assert!(c.status.success(), "{}", text(&c));
    let first = drum_test_support::wait_timeout(first, t);
    assert!(first.status.success(), "{}", text(&first));
}

/// UD multicast: unmodified `mckey` receivers on h1 and h3 join group 239.1.1.1 through the
/// RDMA CM and each gets all 20 datagrams that `mckey -s` on h2 sends to the group (and then
/// at once destroys its QP); a send-only full member (`-o`) sends to a group and receives
/// nothing from it; perftest's `ib_send_lat --mcg` attaches with `ibv_attach_mcast`, to an
/// IPv4-mapped group GID and to its default IB-style MGID.
#[test]
fn mckey_multicast_reaches_every_member() {
    require_privileges!();
    if !have("mckey") {
        eprintln!("SKIPPED: needs rdmacm-utils");
        return;
    }
    let run = Run::new("cm-mcast");
    run.up(&["--hosts", "3"]);
    let t = Duration::from_secs(60);
    let receivers: Vec<_> = ["h1", "h3"]
        .into_iter()
        .map(|h| {
            let ip = run.addr(h);
            let args = ["mckey", "-m", "239.1.1.1", "-b", &ip, "-C", "20"];
            drum_test_support::spawn(&mut run.exec(h, &args))
        })
        .collect();
    // The sender waits 3 s after joining before it sends; the receivers join at once.
    std::thread::sleep(Duration::from_millis(500));
    let ip = run.addr("h2");
    let args = ["mckey", "-m", "239.1.1.1", "-b", &ip, "-s", "-C", "20"];
    let sender = run_timeout(&mut run.exec("h2", &args), t);
    assert!(sender.status.success(), "sender: {}", text(&sender));
    for r in receivers {
        let r = drum_test_support::wait_timeout(r, t);
        assert!(r.status.success(), "receiver: {}", text(&r));
        assert!(text(&r).contains("data transfers complete"), "{}", text(&r));
    }
    // A send-only full member (`mckey -o`) sends without being attached to the group: the
    // full member on h1 gets every datagram, the send-only member on h3 none (librdmacm
    // attaches a QP only for full joins; the engine drops what no attached QP wants).
    let group = ["-m", "239.1.1.2", "-C", "20"];
    let member = |h: &str, extra: &[&str]| {
        let ip = run.addr(h);
        let mut args = vec!["mckey", "-b", &ip];
        args.extend_from_slice(&group);
        args.extend_from_slice(extra);
        drum_test_support::spawn(&mut run.exec(h, &args))
    };
    let full = member("h1", &[]);
    let send_only = member("h3", &["-o"]);
    std::thread::sleep(Duration::from_millis(500));
    let mut args = vec!["mckey", "-b", &ip, "-s", "-o"];
    args.extend_from_slice(&group);
    let sender = run_timeout(&mut run.exec("h2", &args), t);
    assert!(
        sender.status.success(),
        "send-only sender: {}",
        text(&sender)
    );
    let full = drum_test_support::wait_timeout(full, t);
    assert!(
        text(&full).contains("data transfers complete"),
        "{}",
        text(&full)
    );
    std::thread::sleep(Duration::from_secs(1));
    let send_only = drum_test_support::wait_timeout(send_only, Duration::ZERO);
    assert!(
        !send_only.status.success() && !text(&send_only).contains("data transfers complete"),
        "a send-only member received: {}",
        text(&send_only)
    );
    // perftest's multicast mode: a group with an IPv4-mapped GID (RoCE over IPv4), then
    // perftest's default, IB-style MGID.
    let mgid = "--MGID=0:0:0:0:0:0:0:0:0:0:255:255:239:1:1:7";
    for extra in [&[mgid][..], &[]] {
        let mut args = perftest("ib_send_lat", &["-c", "UD", "--mcg", "-n", "100"]);
        args.extend_from_slice(extra);
        let mut client = args.clone();
        client.push("SERVER");
        cm_pair(&run, &args, &client, "#bytes");
    }
}
