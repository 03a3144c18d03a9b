//! The hub with real sockets and tables in a temporary directory.

use super::*;
use crate::shim_metrics::ShimMetrics;
use crate::shim_settings::tests::settings;
use drum_table::layout::{Grant, TABLE_BYTES};
use drum_table::mapping::recv_with_fd;
use drum_table::message::{ShimMsg, MAX_LEN};
use drum_table::socket;

/// The hub's metrics as the agent's endpoint serves them.
fn metrics_text(hub: &Arc<ShimHub>) -> String {
    let mut registry = prometheus_client::registry::Registry::default();
    registry.register_collector(Box::new(ShimMetrics(hub.clone())));
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
    text
}

fn decided(app: &str, active: bool, rate: f64) -> AppDecision {
    AppDecision {
        app: app.into(),
        active,
        rate,
        cqe_per_wqe: 1.0,
        weight: 1.0,
    }
}

fn connect(path: &Path) -> OwnedFd {
    socket::connect(path).unwrap()
}

fn hello(fd: &OwnedFd, pid: u32, app: &str) -> (String, Option<OwnedFd>) {
    let m = ShimMsg::Hello {
        pid,
        app: app.into(),
        exe: "/bin/test".into(),
    }
    .encode();
    socket::send(fd.as_raw_fd(), m.as_bytes()).unwrap();
    let mut buf = [0u8; MAX_LEN];
    let (n, f) = recv_with_fd(fd.as_raw_fd(), &mut buf).unwrap();
    (String::from_utf8_lossy(&buf[..n]).into_owned(), f)
}

fn wait_for(mut f: impl FnMut() -> bool) {
    let end = std::time::Instant::now() + Duration::from_secs(5);
    while !f() {
        assert!(
            std::time::Instant::now() < end,
            "condition not reached in 5 s"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn registration_grants_pins_and_optimiser_rates_and_refuses_liars() {
    let dir = tempfile::tempdir().unwrap();
    let hub = ShimHub::start(settings(dir.path()), None).unwrap();
    let me = std::process::id();

    let a = connect(hub.socket());
    let (m, fd) = hello(&a, me, "pinned");
    assert_eq!(m, "DRUM1 WELCOME app=pinned");
    let ta = Mapping::open(fd.unwrap().as_raw_fd()).unwrap();
    let g = ta.table().read_grant().unwrap();
    assert_eq!((g.rate_bytes_per_s, g.rate_cqe_per_s), (250_000_000, 1500));

    let b = connect(hub.socket());
    let (_, fd) = hello(&b, me, "free");
    let tb = Mapping::open(fd.unwrap().as_raw_fd()).unwrap();
    assert_eq!(
        tb.table().read_grant().unwrap().rate_bytes_per_s,
        0,
        "unlimited until the optimiser decides"
    );
    hub.set_rates(&[decided("free", true, 0.5), decided("pinned", true, 0.9)]);
    assert_eq!(
        tb.table().read_grant().unwrap().rate_bytes_per_s,
        500_000_000
    );
    assert_eq!(
        ta.table().read_grant().unwrap().rate_bytes_per_s,
        250_000_000,
        "the pin wins"
    );
    hub.set_rates(&[decided("free", false, 0.0)]);
    assert_eq!(
        tb.table().read_grant().unwrap().rate_bytes_per_s,
        10_000_000,
        "parked: a trickle"
    );

    let c = connect(hub.socket());
    let (m, fd) = hello(&c, me, "third");
    assert!(m.contains("REFUSED") && m.contains("max_shims"), "{m}");
    assert!(fd.is_none());

    let d = connect(hub.socket());
    drop(a);
    wait_for(|| hub.usage().len() == 1);
    let (m, _) = hello(&d, me + 1, "liar");
    assert!(m.contains("REFUSED") && m.contains("pid"), "{m}");

    // The heartbeat advances.
    let h0 = tb.table().heartbeat_ms();
    wait_for(|| tb.table().heartbeat_ms() > h0);
    drop(b);
    wait_for(|| hub.usage().is_empty());
    let path = hub.socket().to_path_buf();
    drop(hub);
    assert!(!path.exists(), "socket removed on stop");
}

/// An app's grant is split among its processes: equally while neither is measured, by
/// use once they are (an idle one keeps a floor, a busy one the rest), and whole again
/// when one leaves.
#[test]
fn an_apps_processes_share_its_grant_by_their_use() {
    let dir = tempfile::tempdir().unwrap();
    let hub = ShimHub::start(settings(dir.path()), None).unwrap();
    let me = std::process::id();
    let (a, b) = (connect(hub.socket()), connect(hub.socket()));
    let ta = Mapping::open(hello(&a, me, "split").1.unwrap().as_raw_fd()).unwrap();
    let tb = Mapping::open(hello(&b, me, "split").1.unwrap().as_raw_fd()).unwrap();
    hub.set_rates(&[decided("split", true, 0.5)]);
    let bytes = |t: &Mapping| t.table().read_grant().unwrap().rate_bytes_per_s;
    assert_eq!((bytes(&ta), bytes(&tb)), (250_000_000, 250_000_000));
    // a sends nothing; b sends and its shim defers work: b wants more
    let sent = std::sync::atomic::AtomicU64::new(0);
    wait_for(|| {
        let n = sent.fetch_add(20_000_000, Relaxed);
        tb.table().shim.send_bytes.store(n, Relaxed);
        tb.table().shim.deferred_wqes.store(n / 1000, Relaxed);
        std::thread::sleep(Duration::from_millis(50));
        bytes(&tb) > 400_000_000
    });
    // a keeps a tenth of an equal share
    assert_eq!((bytes(&ta), bytes(&tb)), (25_000_000, 475_000_000));
    drop(b);
    wait_for(|| hub.usage().len() == 1);
    wait_for(|| bytes(&ta) == 500_000_000);
}

/// The polling grant turns the WQE rate into completions with the app's mean send size
/// as measured when the rate was decided: the same decision published again (a shim
/// registering, an agent holding its grants while the coordinator is away) gives the same
/// grant however the app's sends changed since; the next decision uses the new size.
#[test]
fn a_republished_decision_keeps_its_polling_grant() {
    let dir = tempfile::tempdir().unwrap();
    let hub = ShimHub::start(settings(dir.path()), None).unwrap();
    let a = connect(hub.socket());
    let (_, fd) = hello(&a, std::process::id(), "free");
    let t = Mapping::open(fd.unwrap().as_raw_fd()).unwrap();
    let sends = |wqes: u64, bytes: u64| {
        t.table().shim.send_wqes.store(wqes, Relaxed);
        t.table().shim.send_bytes.store(bytes, Relaxed);
    };
    let cqe = || t.table().read_grant().unwrap().rate_cqe_per_s;
    sends(1000, 1000 * 65536);
    hub.set_rates(&[decided("free", true, 0.5)]);
    let large = cqe();
    assert!(large > 0);
    sends(2000, 1000 * 65536 + 1000 * 512);
    hub.set_rates(&[decided("free", true, 0.5)]);
    assert_eq!(cqe(), large, "the same decision, the same grant");
    hub.set_rates(&[decided("free", true, 0.4)]);
    assert!(
        cqe() > large,
        "a new decision uses the smaller sends: {}",
        cqe()
    );
}

/// An app's traffic shares come from its QPs' byte reports: before it sends, its
/// connections; then 3 parts written to one receiver for 1 to the other (0.75 / 0.25),
/// and the bytes it reads land on this host's own link. A QP's first report is a baseline.
#[test]
fn byte_reports_become_the_apps_traffic_shares() {
    let dir = tempfile::tempdir().unwrap();
    let hub = ShimHub::start(settings(dir.path()), None).unwrap();
    let s = connect(hub.socket());
    let (m, _fd) = hello(&s, std::process::id(), "w");
    assert_eq!(m, "DRUM1 WELCOME app=w");
    let send = |m: ShimMsg| socket::send(s.as_raw_fd(), m.encode().as_bytes()).unwrap();
    for (qpn, peer) in [(1, [1; 16]), (2, [2; 16]), (3, [2; 16])] {
        send(ShimMsg::QpUp {
            qpn,
            peer,
            peer_qpn: 9,
        });
    }
    let bytes = |qpn, out, back| ShimMsg::Bytes { qpn, out, back };
    // Baselines (a reused slot's old counts must not count), and one for an unknown QP.
    for m in [
        bytes(1, 100, 0),
        bytes(2, 100, 0),
        bytes(3, 0, 0),
        bytes(77, 5, 5),
    ] {
        send(m);
    }
    wait_for(|| {
        hub.shared
            .lock()
            .conns
            .values()
            .all(|c| c.qp_bytes.len() == 3)
    });
    let secs = Duration::from_secs;
    let apps = hub.live_apps(secs(0));
    assert_eq!(apps.len(), 1);
    assert_eq!(apps[0].peers, vec![([1; 16], 1.0), ([2; 16], 2.0)]);
    assert_eq!(apps[0].own, 0.0, "connections until it has sent");
    for m in [bytes(1, 3100, 0), bytes(2, 600, 0), bytes(3, 500, 0)] {
        send(m);
    }
    wait_for(|| {
        hub.shared
            .lock()
            .app_bytes
            .get("w")
            .is_some_and(|b| b.len() == 2)
    });
    wait_for(|| {
        let b = &hub.shared.lock().app_bytes["w"];
        b[&[1; 16]].out == 3000 && b[&[2; 16]].out == 1000
    });
    let apps = hub.live_apps(secs(1));
    assert_eq!(apps[0].peers, vec![([1; 16], 0.75), ([2; 16], 0.25)]);
    // Now it only reads from host 2: the shares move to its own link.
    send(bytes(3, 500, 1_000_000));
    wait_for(|| hub.shared.lock().app_bytes["w"][&[2; 16]].back == 1_000_000);
    let apps = hub.live_apps(secs(2));
    assert!(apps[0].own > 0.9, "{apps:?}");
}

/// Absurd app names (empty, 10 KB, control characters) are refused with the reason (the
/// same text the agent logs, `shim registration refused: …`, spaces as `_` on the wire),
/// and a process that reports
/// 10,000 connected QPs is tracked up to the limit; a well-behaved app registered beside
/// them is not disturbed.
#[test]
fn absurd_names_are_refused_and_a_flood_of_qps_is_clamped() {
    let dir = tempfile::tempdir().unwrap();
    let hub = ShimHub::start(settings(dir.path()), None).unwrap();
    let me = std::process::id();
    let good = connect(hub.socket());
    let (m, fd) = hello(&good, me, "good");
    assert_eq!(m, "DRUM1 WELCOME app=good");
    let table = Mapping::open(fd.unwrap().as_raw_fd()).unwrap();
    let long = "x".repeat(10 * 1024);
    for (name, want) in [
        ("", "empty_value_for_app"),
        ("a\u{1}b", "\"a\\u{1}b\"_is_not_a_valid_app_name"),
        ("tab\there", "REFUSED"),
        (long.as_str(), "bytes_(limit_512)"),
    ] {
        let c = connect(hub.socket());
        let raw = format!("DRUM1 HELLO pid={me} app={name} exe=/x");
        socket::send(c.as_raw_fd(), raw.as_bytes()).unwrap();
        let mut buf = [0u8; MAX_LEN];
        let (n, fd) = recv_with_fd(c.as_raw_fd(), &mut buf).unwrap();
        let reply = String::from_utf8_lossy(&buf[..n]);
        assert!(
            reply.contains("REFUSED") && reply.contains(want),
            "{name:.20?}: {reply}"
        );
        assert!(fd.is_none());
    }
    for qpn in 0..10_000u32 {
        let up = ShimMsg::QpUp {
            qpn,
            peer: [7; 16],
            peer_qpn: 1,
        }
        .encode();
        // The shim's socket does not block: wait for the agent to drain it.
        while let Err(e) = socket::send(good.as_raw_fd(), up.as_bytes()) {
            assert_eq!(e.kind(), std::io::ErrorKind::WouldBlock, "{e}");
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    wait_for(|| {
        hub.app_peers()
            .get("good")
            .is_some_and(|p| p[&[7; 16]] as usize == MAX_TRACKED_QPS)
    });
    assert_eq!(hub.usage().len(), 1, "still registered");
    hub.set_rates(&[decided("good", true, 0.5)]);
    assert_eq!(
        table.table().read_grant().unwrap().rate_bytes_per_s,
        500_000_000
    );
}

/// A hub with a host QP budget of 20 and two registered apps of this process, `victim`
/// and `attacker`: their sockets and tables.
struct TwoApps {
    hub: Arc<ShimHub>,
    victim: OwnedFd,
    attacker: OwnedFd,
    v: Mapping,
    a: Mapping,
}

fn two_apps(dir: &Path) -> TwoApps {
    let hub = ShimHub::start(
        ShimSettings {
            qp_budget: 20,
            ..settings(dir)
        },
        None,
    )
    .map(Arc::new)
    .unwrap();
    let me = std::process::id();
    let (victim, attacker) = (connect(hub.socket()), connect(hub.socket()));
    let (_, fd) = hello(&victim, me, "victim");
    let v = Mapping::open(fd.unwrap().as_raw_fd()).unwrap();
    let (_, fd) = hello(&attacker, me, "attacker");
    let a = Mapping::open(fd.unwrap().as_raw_fd()).unwrap();
    TwoApps {
        hub,
        victim,
        attacker,
        v,
        a,
    }
}

/// The shim on `fd` reports its QP `qpn` connected.
fn up(fd: &OwnedFd, qpn: u32) {
    let m = ShimMsg::QpUp {
        qpn,
        peer: [7; 16],
        peer_qpn: 1,
    }
    .encode();
    socket::send(fd.as_raw_fd(), m.as_bytes()).unwrap();
}

/// With a host QP budget, an app with one QP keeps it and one with 64 gets the rest of
/// the budget as its gate; an app leaving gives its share back; an operator's per-app
/// limit still caps the share.
#[test]
fn the_hosts_qp_budget_becomes_the_apps_gates() {
    let dir = tempfile::tempdir().unwrap();
    let TwoApps {
        hub,
        victim,
        attacker,
        v,
        a,
    } = two_apps(dir.path());
    let gate = |t: &Mapping| t.table().read_grant().unwrap().max_active_qps;
    up(&victim, 1);
    for qpn in 0..64 {
        up(&attacker, qpn);
    }
    wait_for(|| gate(&v) == 1 && gate(&a) == 19);
    // Weights from the optimiser's decisions count: 1 and 3 share what is beyond one slot.
    up(&victim, 2);
    for qpn in 3..40 {
        up(&victim, qpn);
    }
    hub.set_rates(&[
        decided("victim", true, 0.5),
        AppDecision {
            weight: 3.0,
            ..decided("attacker", true, 0.5)
        },
    ]);
    wait_for(|| gate(&v) == 5 && gate(&a) == 15);
    drop(victim);
    wait_for(|| gate(&a) == 20);
}

/// A shim that writes garbage over its whole table (4 KiB of pseudo-random words,
/// extremes among them) changes no other app's grant, and the agent neither crashes nor
/// stops serving: the other app's rate, polling grant and QP gate stay what they were
/// (the victim holds fewer QPs than its share of the host's budget, which any claim of
/// the attacker's, bounded by what the agent tracks, leaves it), and status and metrics
/// still render.
#[test]
fn garbage_in_one_table_changes_no_other_apps_grant() {
    let dir = tempfile::tempdir().unwrap();
    let TwoApps {
        hub,
        victim,
        attacker,
        v,
        a,
    } = two_apps(dir.path());
    for qpn in 0..3 {
        up(&victim, qpn);
    }
    up(&attacker, 1);
    let decide = || {
        hub.set_rates(&[
            AppDecision {
                cqe_per_wqe: 2.0,
                ..decided("victim", true, 0.4)
            },
            decided("attacker", true, 0.4),
        ])
    };
    v.table().shim.send_wqes.store(1000, Relaxed);
    v.table().shim.send_bytes.store(1000 * 4096, Relaxed);
    decide();
    wait_for(|| v.table().read_grant().unwrap().max_active_qps == 3);
    let before = v.table().read_grant().unwrap();
    assert!(before.rate_cqe_per_s > 0 && before.rate_bytes_per_s > 0);
    // SAFETY: the mapping is TABLE_BYTES long and every word of it is an atomic the
    // shim may store to (a hostile shim stores anything).
    let words = unsafe {
        &*(a.table() as *const drum_table::layout::Table
            as *const [std::sync::atomic::AtomicU64; TABLE_BYTES / 8])
    };
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    for (i, w) in words.iter().enumerate() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        w.store([x, u64::MAX, 0, 1 << 63][i % 4], Relaxed);
    }
    // The agent goes on: new decisions, connections, caps, status and metrics.
    decide();
    up(&attacker, 2);
    up(&victim, 2);
    hub.set_peer_cap([9; 16], 1_000_000, 2);
    hub.set_peer_cap([9; 16], 0, 0);
    decide();
    std::thread::sleep(Duration::from_millis(100));
    let after = v.table().read_grant().unwrap();
    assert_eq!(
        Grant {
            generation: 0,
            ..after
        },
        Grant {
            generation: 0,
            ..before
        }
    );
    assert_eq!(hub.usage().len(), 2);
    assert!(metrics_text(&hub).contains("app=\"victim\""));
    let live = hub.live_apps(Duration::from_secs(1));
    assert_eq!(live.len(), 2);
}

/// A process whose table says it took hardware queues (direct verbs) is listed with its
/// pid, uid, app, count and reason, and in the metrics; one that says nothing is not.
#[test]
fn a_process_whose_shim_reports_direct_verbs_is_listed_and_counted() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = settings(dir.path());
    cfg.ungoverned.scan_ms = 50;
    let hub = Arc::new(ShimHub::start(cfg, None).unwrap());
    let me = std::process::id();
    let (direct, plain) = (connect(hub.socket()), connect(hub.socket()));
    let (_, fd) = hello(&direct, me, "dv");
    let t = Mapping::open(fd.unwrap().as_raw_fd()).unwrap();
    let (_, _plain_table) = hello(&plain, me, "plain");
    t.table().shim.direct_verbs_queues.store(2, Relaxed);
    wait_for(|| !hub.direct_verbs().is_empty());
    let listed = hub.direct_verbs();
    assert_eq!(listed.len(), 1, "{listed:?}");
    let d = &listed[0];
    assert_eq!((d.pid, d.app.as_str(), d.queues), (me, "dv", 2));
    // SAFETY: getuid cannot fail.
    assert_eq!(d.uid, unsafe { libc::getuid() });
    assert!(d.reason.contains("mlx5dv_init_obj on 2 queues"), "{d:?}");
    let text = metrics_text(&hub);
    assert!(
        text.contains("drum_agent_direct_verbs_processes 1"),
        "{text}"
    );
    assert!(
        text.contains(&format!(
            "drum_agent_direct_verbs_queues{{pid=\"{me}\",uid=\"{}\",app=\"dv\"}} 2",
            d.uid
        )),
        "{text}"
    );
    drop(direct);
    wait_for(|| hub.direct_verbs().is_empty());
}

/// The polling grant follows the optimiser: `a·x` in completions per second, for the
/// WQE size the app's shims have measured, with headroom; nothing before that size is
/// known, and a parked app's trickle is metered the same way.
#[test]
fn polling_grant_is_the_optimisers_a_times_x_at_the_measured_wqe_size() {
    let dir = tempfile::tempdir().unwrap();
    let hub = ShimHub::start(settings(dir.path()), None).unwrap();
    let s = connect(hub.socket());
    let (_, fd) = hello(&s, std::process::id(), "free");
    let t = Mapping::open(fd.unwrap().as_raw_fd()).unwrap();
    let cqe = || t.table().read_grant().unwrap().rate_cqe_per_s;
    let two = AppDecision {
        cqe_per_wqe: 2.0,
        ..decided("free", true, 0.5)
    };
    hub.set_rates(std::slice::from_ref(&two));
    assert_eq!(cqe(), 0, "WQE size not known yet: unmetered");
    t.table().shim.send_wqes.store(1000, Relaxed);
    t.table().shim.send_bytes.store(1000 * 65536, Relaxed);
    hub.set_rates(std::slice::from_ref(&two));
    // 0.5 × 1 GB/s in 64 KiB WQEs, two completions each, 25 % headroom.
    assert_eq!(cqe(), 19074);
    hub.set_rates(&[AppDecision {
        active: false,
        ..two
    }]);
    assert_eq!(cqe(), 382, "parked: 1 % of the line");
}

#[test]
fn traffic_hook_hears_first_and_last_busy_qp_per_receiver() {
    let dir = tempfile::tempdir().unwrap();
    let heard = Arc::new(Mutex::new(Vec::new()));
    let h = heard.clone();
    let hub = ShimHub::start(
        settings(dir.path()),
        Some(Box::new(move |f: &Flow, busy| {
            h.lock().unwrap().push((f.peer[15], busy))
        })),
    )
    .unwrap();
    let a = connect(hub.socket());
    let (_, _fd) = hello(&a, std::process::id(), "x");
    let mut peer = [0u8; 16];
    peer[15] = 9;
    for m in [
        ShimMsg::QpUp {
            qpn: 1,
            peer,
            peer_qpn: 5,
        },
        ShimMsg::QpUp {
            qpn: 2,
            peer,
            peer_qpn: 6,
        },
        ShimMsg::Traffic { qpn: 1, busy: true },
        ShimMsg::Traffic { qpn: 2, busy: true },
        ShimMsg::Traffic {
            qpn: 1,
            busy: false,
        },
    ] {
        socket::send(a.as_raw_fd(), m.encode().as_bytes()).unwrap();
    }
    wait_for(|| heard.lock().unwrap().len() == 1);
    assert_eq!(heard.lock().unwrap()[0], (9, true));
    drop(a); // QP 2 still busy: leaving ends its traffic
    wait_for(|| heard.lock().unwrap().len() == 2);
    assert_eq!(heard.lock().unwrap()[1], (9, false));
}

/// Each app's traffic towards a receiver is its own DASR message, with a message id
/// stable across hosts; an app with an incast pin carries its group, others none; a
/// group of 0 members is refused.
#[test]
fn flows_are_per_app_and_carry_the_apps_incast_group() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = settings(dir.path());
    s.apps.get_mut("pinned").unwrap().incast = Some(IncastPin {
        group: 7,
        members: 0,
    });
    let e = s.validate().unwrap_err().to_string();
    assert!(e.contains("incast.members"), "{e}");
    s.apps.get_mut("pinned").unwrap().incast = Some(IncastPin {
        group: 7,
        members: 4,
    });
    let heard = Arc::new(Mutex::new(Vec::new()));
    let h = heard.clone();
    let hub = ShimHub::start(
        s,
        Some(Box::new(move |f: &Flow, busy| {
            h.lock().unwrap().push((f.clone(), busy))
        })),
    )
    .unwrap();
    let mut peer = [0u8; 16];
    peer[15] = 9;
    let socks: Vec<_> = ["pinned", "x"]
        .iter()
        .map(|app| {
            let c = connect(hub.socket());
            let (_, fd) = hello(&c, std::process::id(), app);
            for m in [
                ShimMsg::QpUp {
                    qpn: 1,
                    peer,
                    peer_qpn: 5,
                },
                ShimMsg::Traffic { qpn: 1, busy: true },
            ] {
                socket::send(c.as_raw_fd(), m.encode().as_bytes()).unwrap();
            }
            wait_for(|| {
                heard
                    .lock()
                    .unwrap()
                    .iter()
                    .any(|h| h.0.msg_id == name_hash(app))
            });
            (c, fd)
        })
        .collect();
    let got = heard.lock().unwrap().clone();
    assert_eq!(got.len(), 2, "{got:?}");
    assert_eq!(
        got[0],
        (
            Flow {
                peer,
                msg_id: name_hash("pinned"),
                lookahead: Some(Lookahead {
                    tenant: name_hash("pinned") as u32,
                    group: 7,
                    members: 4,
                }),
            },
            true
        )
    );
    assert_eq!(got[1].0.lookahead, None);
    assert_ne!(got[0].0.msg_id, got[1].0.msg_id);
    // FNV-1a's published value for "a": the same ids on every host and build.
    assert_eq!(name_hash("a"), 0xaf63_dc4c_8601_ec8c);
    drop(socks);
}

#[test]
fn a_live_socket_is_not_stolen_and_bad_settings_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let hub = ShimHub::start(settings(dir.path()), None).unwrap();
    let e = ShimHub::start(settings(dir.path()), None).err().unwrap();
    assert!(e.to_string().contains("another agent"), "{e}");
    drop(hub);
    let mut s = settings(dir.path());
    s.line_rate_gbps = f64::NAN;
    assert!(ShimHub::start(s, None).is_err());
    let mut s = settings(dir.path());
    s.apps.get_mut("pinned").unwrap().rate = Some(1.5);
    assert!(ShimHub::start(s, None)
        .err()
        .unwrap()
        .to_string()
        .contains("(0, 1]"));
}
