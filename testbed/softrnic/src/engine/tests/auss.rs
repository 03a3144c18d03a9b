//! AUSS in ACKs between engines ([`crate::auss`], `engine/auss.rs`): a receiver engine fed
//! the packets two sender hosts' engines send, and a sender engine fed what a receiver
//! sends back.

use super::*;
use crate::auss::{Stamp, STAMP_LEN};
use crate::engine::auss::NicAuss;
use crate::engine::host_io::{clock_pair, incarnation};

const EXPIRY: Duration = Duration::from_millis(500);
const R: [u8; 4] = [10, 77, 0, 1];
const S1: [u8; 4] = [10, 77, 0, 2];
const S2: [u8; 4] = [10, 77, 0, 3];

fn engine_addr(ip: [u8; 4]) -> SocketAddr {
    SocketAddr::from((ip, device::ENGINE_UDP_PORT))
}

/// An engine of host `me` in a run of hosts R, S1, S2, AUSS on (its table in `dir`), with
/// one PD, CQ and a 64 KiB MR in `buf` peers may write and read, and an RC QP to each of `peers`
/// (host, peer QPN). Returns the state, the QPs and the MR's rkey.
fn engine(
    me: [u8; 4],
    peers: &[([u8; 4], u32)],
    buf: &mut [u8],
    dir: &std::path::Path,
) -> (State, Vec<u32>, u32) {
    let cfg = NicConfig {
        auss_expiry_ms: EXPIRY.as_millis() as u64,
        ..Default::default()
    };
    let mut st = State::with_nic(cfg, Instant::now());
    st.fabric.me = me.into();
    st.fabric.peers = vec![R.into(), S1.into(), S2.into()];
    st.auss = NicAuss::on(&cfg, &dir.join("auss"), clock_pair(), incarnation()).unwrap();
    let pid = std::process::id() as i32;
    let Resp::Handle(pd) = st.request(1, pid, Req::AllocPd, Instant::now()) else {
        panic!()
    };
    let mr = Req::RegMr {
        pd,
        addr: buf.as_mut_ptr() as u64,
        len: buf.len() as u64,
        access: IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ,
    };
    let Resp::Mr { rkey, .. } = st.request(1, pid, mr, Instant::now()) else {
        panic!()
    };
    let cq = Req::CreateCq {
        cqe: 64,
        channel: 0,
        user: 0,
    };
    let Resp::Cq { handle: cq, .. } = st.request(1, pid, cq, Instant::now()) else {
        panic!()
    };
    let mut qpns = Vec::new();
    for (host, peer_qpn) in peers {
        let create = Req::CreateQp {
            xrcd: 0,
            pd,
            send_cq: cq,
            recv_cq: cq,
            srq: 0,
            qp_type: IBV_QPT_RC,
            sq_sig_all: true,
            cap: Caps {
                max_send_wr: 16,
                max_recv_wr: 16,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: 0,
            },
        };
        let Resp::Qp { qpn, .. } = st.request(1, pid, create, Instant::now()) else {
            panic!()
        };
        let a = QpAttrs {
            access_flags: IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ,
            max_dest_rd_atomic: 4,
            path_mtu: 1,
            dest_qp_num: *peer_qpn,
            ..Default::default()
        };
        to_rts(&mut st, qpn, a);
        // Connected to the peer host's engine rather than to this one's.
        st.qps.get_mut(&qpn).unwrap().remote = Some(engine_addr(*host));
        qpns.push(qpn);
    }
    (st, qpns, rkey)
}

fn tmpdir(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("srn-auss-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Packet `k` (256 bytes at offset 256·k) of a 64 KiB WRITE from `src_qpn` to `dst_qpn`;
/// the last one with `flags` added.
fn write(dst_qpn: u32, src_qpn: u32, k: u32, rkey: u32, base: u64, flags: u8) -> Packet {
    Packet {
        op: wire::OP_WRITE,
        flags: if k == 0 { wire::F_FIRST } else { 0 } | wire::F_ACKREQ | flags,
        dst_qpn,
        src_qpn,
        psn: k,
        msg_len: 64 << 10,
        offset: 256 * k,
        remote_addr: base,
        rkey,
        payload: vec![k as u8; 256].into(),
        ..Default::default()
    }
}

/// The stamps `st` sent since the last call: (to, op, stamp).
fn sent(st: &mut State) -> Vec<(SocketAddr, u8, Stamp)> {
    let out = std::mem::take(&mut st.fabric.out);
    out.iter()
        .filter(|(_, p)| !p.payload.is_empty())
        .map(|(to, p)| (*to, p.op, Stamp::decode(&p.payload, 2).unwrap()))
        .collect()
}

fn ns(st: &[(SocketAddr, u8, Stamp)]) -> Vec<(SocketAddr, u8, u32)> {
    st.iter().map(|(to, op, s)| (*to, *op, s.n)).collect()
}

/// The receiver's side. A second sender's first packet makes N = 2 and tells both senders
/// at once — the first in a notification that leaves while that packet is handled, one
/// one-way trip before it has it (and its next ACK says so too), well within the two round
/// trips of the data path the issue allows. A second QP of the same sender (its part in a
/// second, overlapping incast) is not a second sender. A sender that falls silent (SIGKILL)
/// leaves after the expiry and the other is told. Same-host traffic is not counted.
#[test]
fn the_receiver_counts_unique_senders_stamps_its_acks_and_notifies_on_change() {
    let dir = tmpdir("rx");
    let mut buf = vec![0u8; 64 << 10];
    let base = buf.as_ptr() as u64;
    let (mut r, q, rkey) = engine(R, &[(S1, 0x100), (S2, 0x100), (S1, 0x101)], &mut buf, &dir);
    let (s1, s2) = (engine_addr(S1), engine_addr(S2));
    let t0 = Instant::now();

    r.receive(s1, write(q[0], 0x100, 0, rkey, base, 0), t0);
    assert_eq!(
        ns(&sent(&mut r)),
        [(s1, wire::OP_AUSS, 1), (s1, wire::OP_ACK, 1)]
    );

    r.receive(s2, write(q[1], 0x100, 0, rkey, base, 0), t0);
    let out = sent(&mut r);
    assert_eq!(
        ns(&out),
        [
            (s1, wire::OP_AUSS, 2),
            (s2, wire::OP_AUSS, 2),
            (s2, wire::OP_ACK, 2)
        ]
    );
    assert_eq!(out[0].2.epoch, 2);
    r.receive(s1, write(q[0], 0x100, 1, rkey, base, 0), t0);
    assert_eq!(ns(&sent(&mut r)), [(s1, wire::OP_ACK, 2)]);

    // S1's second QP: S1 is counted already.
    r.receive(s1, write(q[2], 0x101, 0, rkey, base, 0), t0);
    assert_eq!(ns(&sent(&mut r)), [(s1, wire::OP_ACK, 2)]);
    // That QP's send queue runs empty: S1 still has its first QP busy here.
    r.receive(
        s1,
        write(q[2], 0x101, 1, rkey, base, wire::F_IDLE | wire::F_LAST),
        t0,
    );
    assert_eq!(ns(&sent(&mut r)), [(s1, wire::OP_ACK, 2)]);

    // S2 falls silent (SIGKILLed); S1 keeps sending, and its packets refresh it every
    // expiry/4 (125 ms). The set's clock is the engine's: 100 ms of slack either way.
    let slack = Duration::from_millis(100);
    r.timers(Instant::now() + EXPIRY - slack);
    assert_eq!(r.auss.snapshot().unwrap().n, 2, "S2 is within its expiry");
    std::thread::sleep(EXPIRY / 4 + Duration::from_millis(25));
    r.receive(s1, write(q[0], 0x100, 2, rkey, base, 0), Instant::now());
    sent(&mut r);
    r.timers(Instant::now() + EXPIRY - slack);
    let out = sent(&mut r);
    assert!(
        ns(&out).contains(&(s1, wire::OP_AUSS, 1)),
        "S2 expired, S1 told: {out:?}"
    );
    let c = r.auss.snapshot().unwrap();
    assert_eq!((c.n, c.epoch), (1, 3));
    assert!(c.notifications_sent >= 4 && c.stamped_acks >= 6, "{c:?}");
    // The stats' timeline: N went 1, 2, 1, in order of time.
    let log = crate::auss::timeline::parse(&r.auss.report(Instant::now()));
    let counts: Vec<u32> = log.iter().map(|e| e.n).collect();
    assert_eq!(counts, [1, 2, 1], "{log:?}");
    assert!(log.windows(2).all(|w| w[0].t_ns <= w[1].t_ns), "{log:?}");

    // A READ request of S2's: the data flows to S2, which does not become a sender here.
    let read = Packet {
        op: wire::OP_READ_REQ,
        flags: wire::F_FIRST | wire::F_LAST,
        payload: Payload::default(),
        ..write(q[1], 0x100, 1, rkey, base, 0)
    };
    r.receive(s2, read, Instant::now());
    assert_eq!(r.qps[&q[1]].resp.read_jobs.len(), 1, "the READ was taken");
    assert_eq!(r.auss.snapshot().unwrap().n, 1);

    // Same-host traffic: unstamped, uncounted.
    let local = SocketAddr::from((R, device::ENGINE_UDP_PORT));
    let (mut lo, lq, lkey) = engine(R, &[(R, 0x100)], &mut buf, &tmpdir("lo"));
    lo.receive(local, write(lq[0], 0x100, 0, lkey, base, 0), t0);
    assert!(sent(&mut lo).is_empty());
    assert_eq!(lo.auss.snapshot().unwrap().n, 0);
    std::fs::remove_dir_all(&dir).unwrap();
    std::fs::remove_dir_all(tmpdir("lo")).unwrap();
}

/// An ACK of the receiver's QP with `payload`.
fn ack(dst_qpn: u32, payload: Vec<u8>) -> Packet {
    Packet {
        op: wire::OP_ACK,
        dst_qpn,
        src_qpn: 0x100,
        psn: 0,
        payload: payload.into(),
        ..Default::default()
    }
}

fn notification(payload: Vec<u8>) -> Packet {
    Packet {
        op: wire::OP_AUSS,
        payload: payload.into(),
        ..Default::default()
    }
}

/// The sender's side: the newest stamp per destination reaches the table programs read;
/// stale (delayed or replayed) stamps, forged ones (a notification from a host it has no QP
/// to, an N beyond the other hosts, another N for an epoch it has) and truncated ones are
/// refused and counted, never applied.
#[test]
fn the_sender_keeps_the_newest_stamp_per_destination_and_refuses_bad_ones() {
    let dir = tmpdir("tx");
    let mut buf = vec![0u8; 4096];
    let (mut s, q, _) = engine(S1, &[(R, 0x100)], &mut buf, &dir);
    let table = drum_table::nic_auss::Reader::open(&dir.join("auss")).unwrap();
    let r = engine_addr(R);
    let t0 = Instant::now();
    let st = |n, epoch| Stamp {
        n,
        epoch,
        incarnation: 77,
    };
    let n_of_r = |s: &State| s.auss_latest(R.into()).map(|x| (x.n, x.epoch));
    let entry_of_r = |t: &drum_table::nic_auss::Reader| {
        let (_, e) = t.find(R.into()).unwrap();
        (e.n, e.epoch, e.incarnation)
    };

    s.receive(r, ack(q[0], st(1, 1).encode()), t0);
    assert_eq!(n_of_r(&s), Some((1, 1)));
    s.receive(r, notification(st(2, 2).encode()), t0);
    assert_eq!(n_of_r(&s), Some((2, 2)));
    assert_eq!(entry_of_r(&table), (2, 2, 77));
    // A delayed ACK of epoch 1, and a replay of it.
    s.receive(r, ack(q[0], st(1, 1).encode()), t0);
    s.receive(r, notification(st(1, 1).encode()), t0);
    // The current epoch again: nothing changes.
    s.receive(r, ack(q[0], st(2, 2).encode()), t0);
    // Forged: from a host without a QP to it, with a QP number, N beyond the two other
    // hosts, another N for epoch 2; truncated; an ACK not from the QP's peer.
    let stranger = engine_addr(S2);
    s.receive(stranger, notification(st(1, 9).encode()), t0);
    let mut with_qpn = notification(st(1, 9).encode());
    with_qpn.dst_qpn = q[0];
    s.receive(r, with_qpn, t0);
    s.receive(r, notification(st(3, 9).encode()), t0);
    s.receive(r, notification(st(1, 2).encode()), t0);
    for len in [0, 1, STAMP_LEN - 1] {
        s.receive(r, notification(st(1, 9).encode()[..len].to_vec()), t0);
    }
    s.receive(
        r,
        ack(q[0], st(1, 9).encode()[..STAMP_LEN - 8].to_vec()),
        t0,
    );
    s.receive(stranger, ack(q[0], st(1, 9).encode()), t0);
    assert_eq!(n_of_r(&s), Some((2, 2)), "nothing bad was applied");
    assert_eq!(entry_of_r(&table), (2, 2, 77));
    // The stats' timeline: R's N became 1, then 2, and nothing refused shows.
    let log = crate::auss::timeline::parse(&s.auss.report(Instant::now()));
    let caps: Vec<_> = log.iter().map(|e| (e.kind, e.peer, e.n)).collect();
    use crate::auss::timeline::Kind;
    assert_eq!(
        caps,
        [
            (Kind::Cap, Some(R.into()), 1),
            (Kind::Cap, Some(R.into()), 2)
        ]
    );
    let c = s.auss.snapshot().unwrap();
    assert_eq!(
        (c.stamps_newer, c.stamps_same, c.stamps_stale),
        (2, 1, 2),
        "{c:?}"
    );
    assert_eq!((c.refused_forged, c.refused_malformed), (2, 6), "{c:?}");
    assert_eq!(s.counters.rx_dropped_unknown_qp, 1, "the stranger's ACK");
    // The receiver's engine restarted: its new life's epochs start again.
    s.receive(
        r,
        notification(
            Stamp {
                n: 1,
                epoch: 1,
                incarnation: 78,
            }
            .encode(),
        ),
        t0,
    );
    assert_eq!(n_of_r(&s), Some((1, 1)));
    // A truncated stamp in a datagram: the packet does not decode at all.
    let mut d = notification(st(1, 9).encode()).encode();
    d.pop();
    assert!(Packet::decode(&d).is_none());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The requester marks a message's last packet F_IDLE when its send queue holds nothing
/// after it, and only with AUSS on.
#[test]
fn the_last_packet_before_an_empty_send_queue_is_marked_idle() {
    let on = NicConfig {
        auss_expiry_ms: 500,
        ..Default::default()
    };
    for (cfg, marked) in [(on, true), (NicConfig::default(), false)] {
        let (mut st, qpns, _buf) = nic_rig(cfg, 1, 2);
        if marked {
            let no_hold = NicConfig {
                auss_hold_us: 0,
                ..cfg
            };
            st.auss = NicAuss::on(
                &no_hold,
                &tmpdir("idle").join("auss"),
                clock_pair(),
                incarnation(),
            )
            .unwrap();
        }
        let t0 = Instant::now();
        let flags: Vec<u8> = std::iter::from_fn(|| st.next_packet(qpns[0], t0))
            .map(|(_, p)| p.flags & (wire::F_LAST | wire::F_IDLE))
            .collect();
        let idle_last = if marked {
            wire::F_LAST | wire::F_IDLE
        } else {
            wire::F_LAST
        };
        // Two 700-byte WRITEs of three 256-byte packets each.
        assert_eq!(
            flags,
            [0, 0, wire::F_LAST, 0, 0, idle_last],
            "AUSS {marked}"
        );
    }
    std::fs::remove_dir_all(tmpdir("idle")).unwrap();
}

/// A sender's queue runs empty between two messages (`ib_write_bw` waiting for completions):
/// its END is held, the next message's first packet cancels it and nobody is told anything;
/// an END followed by silence takes effect on the timers after the hold, and the other sender
/// is told `N` = 1.
#[test]
fn an_end_is_held_and_a_next_message_cancels_it() {
    let dir = tmpdir("hold");
    let mut buf = vec![0u8; 64 << 10];
    let base = buf.as_ptr() as u64;
    let (mut r, q, rkey) = engine(R, &[(S1, 0x100), (S2, 0x100)], &mut buf, &dir);
    let (s1, s2) = (engine_addr(S1), engine_addr(S2));
    let hold = NicConfig::default().auss_hold();
    let t0 = Instant::now();
    r.receive(s1, write(q[0], 0x100, 0, rkey, base, 0), t0);
    r.receive(s2, write(q[1], 0x100, 0, rkey, base, 0), t0);
    sent(&mut r);
    let at_two = r.auss.snapshot().unwrap();
    assert_eq!((at_two.n, at_two.epoch), (2, 2));
    let idle = wire::F_IDLE | wire::F_LAST;
    r.receive(s2, write(q[1], 0x100, 1, rkey, base, idle), t0);
    assert_eq!(
        ns(&sent(&mut r)),
        [(s2, wire::OP_ACK, 2)],
        "the END is held"
    );
    // The next message, its first packet.
    let next = Packet {
        psn: 2,
        ..write(q[1], 0x100, 0, rkey, base, 0)
    };
    r.receive(s2, next, t0);
    assert_eq!(ns(&sent(&mut r)), [(s2, wire::OP_ACK, 2)]);
    r.timers(Instant::now() + hold * 5);
    assert!(sent(&mut r).is_empty(), "the END was cancelled");
    let c = r.auss.snapshot().unwrap();
    assert_eq!((c.n, c.epoch), (2, 2));
    // That message ends with an empty queue too, and S2 stays silent.
    let last = Packet {
        psn: 3,
        ..write(q[1], 0x100, 1, rkey, base, idle)
    };
    r.receive(s2, last, Instant::now());
    assert_eq!(ns(&sent(&mut r)), [(s2, wire::OP_ACK, 2)]);
    r.timers(Instant::now() + hold * 5);
    assert_eq!(ns(&sent(&mut r)), [(s1, wire::OP_AUSS, 1)]);
    let c = r.auss.snapshot().unwrap();
    assert_eq!((c.n, c.epoch), (1, 3));
    std::fs::remove_dir_all(dir).unwrap();
}

/// Dart's rate limiter in the NIC (`softrnic dasr on`): once a QP's destination stamps
/// N = 2, the QP is paced at 97 % of half the line from its next packet — within the message
/// in flight, which the shim's caps cannot reach — while with the caps off it keeps the line.
#[test]
fn with_dasr_caps_a_stamp_paces_the_qps_towards_its_receiver_at_r_over_n() {
    let cfg = NicConfig {
        line_rate_gbps: 1.0,
        auss_expiry_ms: EXPIRY.as_millis() as u64,
        ..Default::default()
    };
    let dir = tmpdir("caps");
    for caps in [true, false] {
        let (mut st, qpns, _buf) = nic_rig(cfg, 1, 4);
        st.auss = NicAuss::on(
            &cfg,
            &dir.join(format!("auss-{caps}")),
            clock_pair(),
            incarnation(),
        )
        .unwrap();
        st.fabric.peers = vec![R.into(), S1.into(), S2.into()];
        st.dart.caps = caps;
        let to = st.qps[&qpns[0]].remote.unwrap();
        let t0 = Instant::now();
        let two = Stamp {
            n: 2,
            epoch: 1,
            incarnation: 7,
        };
        st.receive(to, notification(two.encode()), t0);
        let SocketAddr::V4(to_v4) = to else {
            panic!("{to}")
        };
        assert_eq!(st.auss_latest(*to_v4.ip()).map(|s| s.n), Some(2));
        let sent = std::iter::from_fn(|| st.tx_one(t0)).count();
        if caps {
            assert_eq!(sent, 1);
            // 256 + 48 + 42 bytes at 485 Mb/s (97 % of 1 Gb/s, halved).
            let due = st.pace_wake.expect("the capped QP is due later");
            assert_eq!(due - t0, Duration::from_nanos(346 * 8_000_000 / 485_000));
        } else {
            // Four 700-byte WRITEs of three 256-byte packets each, all at the line.
            assert_eq!(sent, 12);
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
