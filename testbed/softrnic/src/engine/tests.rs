use super::transport::requester::{atomic_operands, rnr_delay};
use super::transport::responder::ATOMIC_CACHE;
use super::*;

impl State {
    /// A NIC of the default model, started now.
    pub(super) fn new() -> Self {
        Self::with_nic(NicConfig::default(), Instant::now())
    }
}

mod auss;

/// A link change raises one port event on every context with an event stream (element:
/// port 1), none for a repeated state, none for a context without a stream.
#[test]
fn link_changes_raise_port_events_on_every_context() {
    let mut st = State::new();
    for conn in [1, 2] {
        assert!(matches!(
            st.request(conn, 0, Req::CreateAsyncChannel, Instant::now()),
            Resp::Channel { .. }
        ));
    }
    st.request(3, 0, Req::AllocPd, Instant::now());
    let next = |st: &mut State, conn: u64| st.event_queue(conn)?.1.next_record();
    st.set_port(true);
    st.set_port(false);
    st.set_port(false);
    for conn in [1, 2] {
        let r = next(&mut st, conn);
        assert_eq!(r, Some(crate::events::record(1, IBV_EVENT_PORT_ERR)));
        st.event_queue(conn).unwrap().1.consumed(false);
        assert_eq!(next(&mut st, conn), None);
    }
    assert!(st.event_queue(3).is_none());
    st.set_port(true);
    for conn in [1, 2] {
        let r = next(&mut st, conn);
        assert_eq!(r, Some(crate::events::record(1, IBV_EVENT_PORT_ACTIVE)));
    }
}

/// An armed CQ with a channel sends exactly one event (its `ibv_cq *`) per arming.
#[test]
fn completion_events_are_one_shot_per_arming() {
    use std::io::Read;
    let mut st = State::new();
    let pid = std::process::id() as i32;
    let Resp::Channel { id, token } = st.request(1, pid, Req::CreateChannel, Instant::now()) else {
        panic!()
    };
    let (app, engine_end) = UnixStream::pair().unwrap();
    // A CQ cannot use a channel before it is attached, nor another connection's.
    let cq_req = Req::CreateCq {
        cqe: 8,
        channel: id,
        user: 0xabcd,
    };
    assert!(matches!(
        st.request(1, pid, cq_req.clone(), Instant::now()),
        Resp::Err { .. }
    ));
    assert!(matches!(
        st.attach_channel(pid, id, token ^ 1, engine_end.try_clone().unwrap()),
        Resp::Err { .. }
    ));
    assert_eq!(st.attach_channel(pid, id, token, engine_end), Resp::Unit);
    assert!(matches!(
        st.request(2, pid, cq_req.clone(), Instant::now()),
        Resp::Err { .. }
    ));
    let Resp::Cq { handle: cq, .. } = st.request(1, pid, cq_req, Instant::now()) else {
        panic!()
    };
    app.set_nonblocking(true).unwrap();
    let mut b = [0u8; 16];
    let wc = IbvWc::default();
    st.push_cqe(cq, wc); // not armed: no event
    assert!((&app).read(&mut b).is_err());
    let arm = Req::ReqNotifyCq {
        cq,
        solicited_only: false,
    };
    assert_eq!(st.request(1, pid, arm.clone(), Instant::now()), Resp::Unit);
    st.push_cqe(cq, wc);
    st.push_cqe(cq, wc); // one event per arming
    assert_eq!((&app).read(&mut b).unwrap(), 8);
    assert_eq!(u64::from_ne_bytes(b[..8].try_into().unwrap()), 0xabcd);
    assert!((&app).read(&mut b).is_err());
    // Solicited-only: a plain completion does not fire, a solicited or an error one does.
    let arm_solicited = Req::ReqNotifyCq {
        cq,
        solicited_only: true,
    };
    assert_eq!(
        st.request(1, pid, arm_solicited.clone(), Instant::now()),
        Resp::Unit
    );
    st.push_cqe(cq, wc);
    assert!((&app).read(&mut b).is_err());
    st.push_cqe_solicited(cq, wc, true);
    assert_eq!((&app).read(&mut b).unwrap(), 8);
    assert_eq!(
        st.request(1, pid, arm_solicited.clone(), Instant::now()),
        Resp::Unit
    );
    let failed = IbvWc {
        status: IBV_WC_LOC_LEN_ERR,
        ..wc
    };
    st.push_cqe(cq, failed);
    assert_eq!((&app).read(&mut b).unwrap(), 8);
    // Arming for any completion on top of a solicited-only arming widens it (not back).
    assert_eq!(
        st.request(1, pid, arm_solicited.clone(), Instant::now()),
        Resp::Unit
    );
    assert_eq!(st.request(1, pid, arm.clone(), Instant::now()), Resp::Unit);
    assert_eq!(
        st.request(1, pid, arm_solicited, Instant::now()),
        Resp::Unit
    );
    st.push_cqe(cq, wc);
    assert_eq!((&app).read(&mut b).unwrap(), 8);
    // Another connection cannot arm it; the owner's connection closing removes the channel.
    assert!(matches!(
        st.request(2, pid, arm, Instant::now()),
        Resp::Err { .. }
    ));
    st.drop_conn(1, Instant::now());
    assert!(st.channels.is_empty());
}

#[test]
fn rnr_table() {
    assert_eq!(rnr_delay(0), Duration::from_micros(655_360));
    assert_eq!(rnr_delay(12), Duration::from_micros(640));
}

#[test]
fn scatter_gather_own_memory() {
    let pid = std::process::id() as i32;
    let mut a = vec![0u8; 8];
    let mut b = vec![0u8; 8];
    let segs = vec![(a.as_mut_ptr() as u64, 8u64), (b.as_mut_ptr() as u64, 8u64)];
    let data: Vec<u8> = (0..12).collect();
    scatter(pid, &segs, 2, &data).unwrap();
    assert_eq!(a, [0, 0, 0, 1, 2, 3, 4, 5]);
    assert_eq!(b, [6, 7, 8, 9, 10, 11, 0, 0]);
    assert_eq!(gather(pid, &segs, 2, 12).unwrap(), data);
    assert!(scatter(pid, &segs, 10, &data).is_err());
}

#[test]
fn qp_state_machine_checks() {
    let mut st = State::new();
    let pid = std::process::id() as i32;
    let Resp::Handle(pd) = st.request(1, pid, Req::AllocPd, Instant::now()) else {
        panic!()
    };
    let Resp::Cq { handle: cq, .. } = st.request(
        1,
        pid,
        Req::CreateCq {
            cqe: 16,
            channel: 0,
            user: 0,
        },
        Instant::now(),
    ) else {
        panic!()
    };
    let Resp::Qp { qpn, .. } = st.request(
        1,
        pid,
        Req::CreateQp {
            xrcd: 0,
            pd,
            send_cq: cq,
            recv_cq: cq,
            srq: 0,
            qp_type: IBV_QPT_RC,
            sq_sig_all: false,
            cap: Caps {
                max_send_wr: 4,
                max_recv_wr: 4,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: 0,
            },
        },
        Instant::now(),
    ) else {
        panic!()
    };
    // RESET -> RTR is illegal.
    let a = QpAttrs {
        qp_state: IBV_QPS_RTR,
        ..Default::default()
    };
    assert!(st.modify_qp(qpn, IBV_QP_STATE, &a, Instant::now()).is_err());
    // RESET -> INIT needs pkey, port, access.
    let mut a = QpAttrs {
        qp_state: IBV_QPS_INIT,
        port_num: 1,
        ..Default::default()
    };
    assert!(st
        .modify_qp(qpn, IBV_QP_STATE | IBV_QP_PORT, &a, Instant::now())
        .is_err());
    let m = IBV_QP_STATE | IBV_QP_PORT | IBV_QP_PKEY_INDEX | IBV_QP_ACCESS_FLAGS;
    st.modify_qp(qpn, m, &a, Instant::now()).unwrap();
    // post_send before RTS is refused.
    let wr = SendWr {
        xrc_srqn: 0,
        wr_id: 1,
        opcode: IBV_WR_SEND,
        flags: 0,
        imm: 0,
        remote_addr: 0,
        rkey: 0,
        compare_add: 0,
        swap: 0,
        sges: vec![],
        inline: None,
    };
    assert!(matches!(
        st.post_send(1, qpn, vec![wr]),
        Resp::Err { errno, .. } if errno == libc::EINVAL
    ));
    // INIT -> RTR requires an AV with an IPv4-mapped GID.
    a.qp_state = IBV_QPS_RTR;
    a.path_mtu = 3;
    a.is_global = 1;
    let rtr = IBV_QP_STATE
        | IBV_QP_AV
        | IBV_QP_PATH_MTU
        | IBV_QP_DEST_QPN
        | IBV_QP_RQ_PSN
        | IBV_QP_MAX_DEST_RD_ATOMIC
        | IBV_QP_MIN_RNR_TIMER;
    assert!(st.modify_qp(qpn, rtr, &a, Instant::now()).is_err());
    a.dgid = device::gid_for(Ipv4Addr::LOCALHOST);
    st.modify_qp(qpn, rtr, &a, Instant::now()).unwrap();
    // A receive posted, then ERR flushes it.
    let r = RecvWr {
        wr_id: 9,
        sges: vec![],
    };
    assert_eq!(st.post_recv(1, qpn, vec![r]), Resp::Unit);
    a.qp_state = IBV_QPS_ERR;
    st.modify_qp(qpn, IBV_QP_STATE, &a, Instant::now()).unwrap();
    let Resp::Wcs(w) = st.request(1, pid, Req::PollCq { cq, max: 4 }, Instant::now()) else {
        panic!()
    };
    assert_eq!(w.len(), 1);
    assert_eq!(w[0].wr_id, 9);
    assert_eq!(w[0].status, IBV_WC_WR_FLUSH_ERR);
    // Another connection cannot touch this QP.
    assert!(matches!(
        st.request(2, pid, Req::DestroyQp { qpn }, Instant::now()),
        Resp::Err { .. }
    ));
}

#[test]
fn mr_access_rules() {
    let mut st = State::new();
    let pid = std::process::id() as i32;
    let buf = vec![0u8; 4096];
    let Resp::Handle(pd) = st.request(1, pid, Req::AllocPd, Instant::now()) else {
        panic!()
    };
    // Remote write without local write is refused.
    let r = st.request(
        1,
        pid,
        Req::RegMr {
            pd,
            addr: buf.as_ptr() as u64,
            len: 4096,
            access: IBV_ACCESS_REMOTE_WRITE,
        },
        Instant::now(),
    );
    assert!(matches!(r, Resp::Err { errno, .. } if errno == libc::EINVAL));
    let Resp::Mr { rkey, .. } = st.request(
        1,
        pid,
        Req::RegMr {
            pd,
            addr: buf.as_ptr() as u64,
            len: 4096,
            access: IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ,
        },
        Instant::now(),
    ) else {
        panic!()
    };
    let a = buf.as_ptr() as u64;
    assert!(st
        .mem
        .check_remote(0, pd, rkey, a, 4096, IBV_ACCESS_REMOTE_READ)
        .is_some());
    assert!(st
        .mem
        .check_remote(0, pd, rkey, a + 1, 4096, IBV_ACCESS_REMOTE_READ)
        .is_none());
    assert!(st
        .mem
        .check_remote(0, pd, rkey, a, 16, IBV_ACCESS_REMOTE_WRITE)
        .is_none());
    assert!(st
        .mem
        .check_remote(0, pd, rkey ^ 0x100, a, 16, IBV_ACCESS_REMOTE_READ)
        .is_none());
    assert!(st
        .mem
        .check_remote(0, pd + 1, rkey, a, 16, IBV_ACCESS_REMOTE_READ)
        .is_none());
    // Memory that does not exist: refused, unless on demand (ODP), whose pages need not
    // exist yet — an implicit MR covers the whole address space.
    let mr = |st: &mut State, addr: u64, len: u64, odp: bool| {
        let access = IBV_ACCESS_LOCAL_WRITE | if odp { IBV_ACCESS_ON_DEMAND } else { 0 };
        st.request(
            1,
            pid,
            Req::RegMr {
                pd,
                addr,
                len,
                access,
            },
            Instant::now(),
        )
    };
    let nowhere = 0x10_0000_0000;
    assert_eq!(mr(&mut st, nowhere, 4096, false), err(libc::EFAULT));
    assert!(matches!(mr(&mut st, nowhere, 4096, true), Resp::Mr { .. }));
    assert!(matches!(mr(&mut st, 0, u64::MAX, true), Resp::Mr { .. }));
    assert_eq!(mr(&mut st, 1, u64::MAX, true), err(libc::EINVAL));
    // An MR named by an IOVA of its own (zero-based here): work requests and peers use
    // offsets, which land in the registered memory and nowhere else.
    let Resp::Mr { lkey, rkey } = st.request(
        1,
        pid,
        Req::RegMrIova {
            pd,
            addr: a + 1024,
            len: 1024,
            iova: 0,
            access: IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ,
        },
        Instant::now(),
    ) else {
        panic!()
    };
    let read = IBV_ACCESS_REMOTE_READ;
    assert_eq!(
        st.mem.check_remote(0, pd, rkey, 8, 16, read),
        Some((pid, a + 1032))
    );
    assert_eq!(
        st.mem.check_remote(0, pd, rkey, 1016, 8, read),
        Some((pid, a + 2040))
    );
    assert_eq!(st.mem.check_remote(0, pd, rkey, 1016, 9, read), None);
    assert_eq!(
        st.mem.check_remote(0, pd, rkey, a + 1032, 8, read),
        None,
        "not by address"
    );
    let sge = |addr, length| Sge { addr, length, lkey };
    assert_eq!(
        st.mem
            .resolve_local(1, pd, &[sge(0, 4), sge(1000, 24)], true),
        Some(vec![(a + 1024, 4), (a + 2024, 24)])
    );
    assert_eq!(st.mem.resolve_local(1, pd, &[sge(1000, 25)], true), None);
    let wraps = st.request(
        1,
        pid,
        Req::RegMrIova {
            pd,
            addr: a,
            len: 4096,
            iova: u64::MAX - 10,
            access: 0,
        },
        Instant::now(),
    );
    assert_eq!(wraps, err(libc::EINVAL));
}

/// Hostile packets against a live QP: arbitrary headers and payloads aimed at a QP that
/// has receives posted and sends, writes and reads in flight. The handler must never panic
/// and never write outside the registered MR (guard pages around it stay untouched).
/// `n` RC QPs in RTS on one PD/CQ/MR, each with `wrs` signalled 3-packet WRITEs queued
/// (256-byte path MTU unless `path_mtu` says otherwise); the MR lives in `buf`.
fn nic_rig(cfg: NicConfig, n: usize, wrs: usize) -> (State, Vec<u32>, Vec<u8>) {
    nic_rig_mtu(cfg, n, wrs, 1)
}

fn nic_rig_mtu(cfg: NicConfig, n: usize, wrs: usize, path_mtu: i32) -> (State, Vec<u32>, Vec<u8>) {
    let mut buf = vec![7u8; 4096];
    let mut st = State::with_nic(cfg, Instant::now());
    let pid = std::process::id() as i32;
    let Resp::Handle(pd) = st.request(1, pid, Req::AllocPd, Instant::now()) else {
        panic!()
    };
    let addr = buf.as_mut_ptr() as u64;
    let Resp::Mr { lkey, .. } = st.request(
        1,
        pid,
        Req::RegMr {
            pd,
            addr,
            len: 4096,
            access: IBV_ACCESS_LOCAL_WRITE,
        },
        Instant::now(),
    ) else {
        panic!()
    };
    let Resp::Cq { handle: cq, .. } = st.request(
        1,
        pid,
        Req::CreateCq {
            cqe: 4096,
            channel: 0,
            user: 0,
        },
        Instant::now(),
    ) else {
        panic!()
    };
    let mut qpns = Vec::new();
    for i in 0..n {
        let Resp::Qp { qpn, .. } = st.request(
            1,
            pid,
            Req::CreateQp {
                xrcd: 0,
                pd,
                send_cq: cq,
                recv_cq: cq,
                srq: 0,
                qp_type: IBV_QPT_RC,
                sq_sig_all: true,
                cap: Caps {
                    max_send_wr: 64,
                    max_recv_wr: 1,
                    max_send_sge: 1,
                    max_recv_sge: 1,
                    max_inline_data: 0,
                },
            },
            Instant::now(),
        ) else {
            panic!()
        };
        let a = QpAttrs {
            path_mtu,
            dest_qp_num: 0x100 + i as u32,
            ..Default::default()
        };
        to_rts(&mut st, qpn, a);
        let list = (0..wrs)
            .map(|k| SendWr {
                xrc_srqn: 0,
                wr_id: k as u64,
                opcode: IBV_WR_RDMA_WRITE,
                flags: IBV_SEND_SIGNALED,
                imm: 0,
                remote_addr: 0x10_0000,
                rkey: 9,
                compare_add: 0,
                swap: 0,
                sges: vec![Sge {
                    addr,
                    length: 700,
                    lkey,
                }],
                inline: None,
            })
            .collect();
        assert_eq!(st.post_send(1, qpn, list), Resp::Unit);
        qpns.push(qpn);
    }
    (st, qpns, buf)
}

/// Arbitration is round robin at packet granularity: QPs with multi-packet messages
/// queued take turns packet by packet, not message by message.
#[test]
fn tx_arbitration_is_round_robin_per_packet() {
    let (mut st, qpns, _buf) = nic_rig(NicConfig::default(), 3, 2);
    let now = Instant::now();
    let order: Vec<u32> = std::iter::from_fn(|| st.tx_one(now)).collect();
    // 3 QPs x 2 WRITEs x 3 packets (700 bytes at 256-byte MTU).
    assert_eq!(order.len(), 18);
    for (i, q) in order.iter().enumerate() {
        assert_eq!(*q, qpns[i % 3], "packet {i}: {order:?}");
    }
    // Packet sizes: every QP's packets alternate 256, 256, 188 payload bytes.
    assert_eq!(st.fabric.out.len(), 18);
    assert_eq!(st.counters.wqe_fetches, 6);
    // Every WQE is charged to the process that owns its QP (this one): 6 × 700 bytes.
    let pid = std::process::id();
    assert_eq!(
        st.proc_tx_lines(),
        format!("proc_tx_wqes.{pid} 6\nproc_tx_bytes.{pid} 4200\n")
    );
    // One QP drained: the others keep alternating.
    let (mut st, qpns, _buf) = nic_rig(NicConfig::default(), 2, 1);
    st.qps.get_mut(&qpns[0]).unwrap().req.sq.clear();
    let order: Vec<u32> = std::iter::from_fn(|| st.tx_one(now)).collect();
    assert_eq!(order, vec![qpns[1]; 3]);
}

/// A 700-byte RDMA WRITE from the start of a rig's buffer (3 packets at 256-byte MTU).
fn rig_write(st: &State, buf: &[u8], wr_id: u64) -> SendWr {
    SendWr {
        wr_id,
        opcode: IBV_WR_RDMA_WRITE,
        flags: IBV_SEND_SIGNALED,
        remote_addr: 0x10_0000,
        rkey: 9,
        sges: vec![Sge {
            addr: buf.as_ptr() as u64,
            length: 700,
            lkey: *st.mem.mrs.keys().next().unwrap(),
        }],
        ..Default::default()
    }
}

/// The transmitter in virtual time from `t0`, as `tx_loop` runs it: wait for the
/// pipeline clock, send one packet, again. Each packet's QP and start time after `t0`.
fn tx_virtual(st: &mut State, t0: Instant) -> Vec<(u32, Duration)> {
    let mut t = t0;
    let mut sent = Vec::new();
    loop {
        if let Some(w) = st.nic.wait(t) {
            t += w;
        }
        match st.tx_one(t) {
            Some(q) => sent.push((q, t - t0)),
            None => return sent,
        }
    }
}

/// The start of `qpn`'s first packet.
fn first_of(sent: &[(u32, Duration)], qpn: u32) -> Duration {
    sent.iter().find(|(q, _)| *q == qpn).unwrap().1
}

/// Doorbell-batch fetching (the DRUM paper's Fig. 2a): a co-runner's list of 32 work
/// requests posted with one call is fetched in one read whose 32 fetch costs all come
/// before the foreground's packet; posted one by one, they are fetched one by one and the
/// foreground waits for one fetch. `wqe_fetch_batch` caps the read; fetched work requests
/// are not charged again, and packets still alternate round robin.
#[test]
fn a_doorbell_list_is_fetched_at_once_before_other_qps_packets() {
    use crate::nic::{BANK, SLACK};
    let cfg = NicConfig {
        line_rate_gbps: 0.0,
        qp_cache: 0,
        wqe_fetch_ns: 10_000_000,
        ..Default::default()
    };
    assert_eq!(cfg.wqe_fetch_batch, 64);
    // Starting BANK after now makes the clock start exactly at t0 - BANK (banked credit),
    // so every time below is exact.
    let run = |cfg: NicConfig, lists: &[usize]| {
        let (mut st, q, buf) = nic_rig(cfg, 2, 0);
        let (co, fg) = (q[0], q[1]);
        let mut id = 0;
        for &n in lists {
            let list = (0..n).map(|_| {
                id += 1;
                rig_write(&st, &buf, id)
            });
            let list = list.collect();
            assert_eq!(st.post_send(1, co, list), Resp::Unit);
        }
        assert_eq!(
            st.post_send(1, fg, vec![rig_write(&st, &buf, 0)]),
            Resp::Unit
        );
        let t0 = Instant::now() + BANK;
        let sent = tx_virtual(&mut st, t0);
        let fetches = (st.counters.wqe_fetches, st.counters.wqe_fetch_reads);
        (sent, fetches, co, fg)
    };
    let ms = Duration::from_millis;
    // One list of 32: the foreground's packet waits for 32 fetches (less the bank).
    let (sent, fetches, co, fg) = run(cfg, &[32]);
    assert_eq!(first_of(&sent, fg), ms(320) - BANK - SLACK);
    assert_eq!(fetches, (33, 2));
    let order: Vec<u32> = sent.iter().map(|p| p.0).collect();
    assert_eq!(order[..6], [co, fg, co, fg, co, fg], "{order:?}");
    assert!(order[6..].iter().all(|q| *q == co));
    assert_eq!(order.len(), 32 * 3 + 3);
    // Nothing is fetched twice: the clock ends after 33 fetches.
    assert_eq!(sent.last().unwrap().1, ms(330) - BANK - SLACK);
    // The same 32 posted one per call: one fetch, then the foreground.
    let (sent, fetches, _, fg) = run(cfg, &[1; 32]);
    assert_eq!(first_of(&sent, fg), ms(10) - BANK - SLACK);
    assert_eq!(fetches, (33, 33));
    // A read holds at most wqe_fetch_batch work requests; 1 is per-WQE fetching.
    let small = NicConfig {
        wqe_fetch_batch: 8,
        ..cfg
    };
    let (sent, fetches, _, fg) = run(small, &[32]);
    assert_eq!(first_of(&sent, fg), ms(80) - BANK - SLACK);
    assert_eq!(fetches, (33, 5));
    let one = NicConfig {
        wqe_fetch_batch: 1,
        ..cfg
    };
    let (sent, fetches, _, fg) = run(one, &[32]);
    assert_eq!(first_of(&sent, fg), ms(10) - BANK - SLACK);
    assert_eq!(fetches, (33, 33));
    // Two lists waiting together are still two doorbells: two reads.
    let (sent, fetches, _, fg) = run(cfg, &[4, 3]);
    assert_eq!(first_of(&sent, fg), ms(40) - BANK - SLACK);
    assert_eq!(fetches, (8, 3));
}

/// The QP-context cache: as many active QPs as entries hit after the cold misses; one more
/// and round-robin arbitration makes every packet miss (the knee of the DRUM paper's
/// Fig. 2c), and each miss costs `qp_miss_ns` on the pipeline clock.
#[test]
fn qp_cache_thrashes_beyond_its_size_and_misses_cost_time() {
    let cfg = NicConfig {
        line_rate_gbps: 0.0,
        qp_cache: 4,
        qp_miss_ns: 1_000_000,
        wqe_fetch_ns: 0,
        ..Default::default()
    };
    let now = Instant::now();
    let (mut st, _q, _buf) = nic_rig(cfg, 4, 4);
    while st.tx_one(now).is_some() {}
    assert_eq!(st.counters.qp_cache_misses, 4);
    assert_eq!(st.counters.qp_cache_hits, 4 * 4 * 3 - 4);
    // 4 ms of misses on the clock.
    let w = st.nic.wait(now).unwrap();
    assert!(w > Duration::from_millis(3), "{w:?}");
    let (mut st, _q, _buf) = nic_rig(cfg, 5, 4);
    while st.tx_one(now).is_some() {}
    assert_eq!(st.counters.qp_cache_misses, 5 * 4 * 3);
    assert_eq!(st.counters.qp_cache_hits, 0);
    // Unlimited cache: no misses at all.
    let (mut st, _q, _buf) = nic_rig(NicConfig { qp_cache: 0, ..cfg }, 50, 1);
    while st.tx_one(now).is_some() {}
    assert_eq!(st.counters.qp_cache_misses, 0);
}

/// Path MTUs are clamped to the NIC model's MTU.
#[test]
fn path_mtu_is_clamped_to_the_port_mtu() {
    let cfg = NicConfig {
        mtu: 256,
        ..Default::default()
    };
    // The application asks for 4096 (IBV_MTU_4096); the port has 256.
    let (mut st, qpns, _buf) = nic_rig_mtu(cfg, 1, 1, IBV_MTU_4096);
    assert_eq!(st.qps[&qpns[0]].mtu, 256);
    let (st2, qpns2, _b) = nic_rig_mtu(NicConfig::default(), 1, 1, IBV_MTU_4096);
    assert_eq!(st2.qps[&qpns2[0]].mtu, 4096);
    let now = Instant::now();
    while st.tx_one(now).is_some() {}
    assert_eq!(st.fabric.out.len(), 3);
}

/// The shared rings: work requests written by "the application" (this process, through
/// its own memfds, as the provider does) are taken by the engine, completions land in the
/// CQ ring, `done` is published before the completion, and malformed entries complete
/// with an error and move the QP to the error state instead of being trusted.
#[test]
fn shared_rings_carry_work_requests_and_completions() {
    let (mut st, qpns, mut buf) = nic_rig(NicConfig::default(), 1, 0);
    let qpn = qpns[0];
    let pid = std::process::id() as i32;
    let cap = st.qps[&qpn].cap;
    let lkey = *st.mem.mrs.keys().next().unwrap();
    // A ring can only be attached to a fresh QP (RESET) of the same connection.
    let l = QpLayout::new(&cap);
    let (qmap, qfd) = Map::create("t", l.len).unwrap();
    assert_eq!(
        st.attach_ring(1, pid, 1, qpn, qfd, l.len as u64),
        Err(libc::EINVAL)
    );
    let Resp::Cq { handle: cq2, .. } = st.request(
        1,
        pid,
        Req::CreateCq {
            cqe: 8,
            channel: 0,
            user: 0,
        },
        Instant::now(),
    ) else {
        panic!()
    };
    let (cmap, cfd) = Map::create("t", ring::cq_len(8)).unwrap();
    assert_eq!(
        st.attach_ring(2, pid, 0, cq2, cfd, ring::cq_len(8) as u64),
        Err(libc::EINVAL),
        "another connection's CQ"
    );
    assert_eq!(
        st.attach_ring(1, pid, 0, cq2, cfd, 100),
        Err(libc::EINVAL),
        "wrong length"
    );
    assert_eq!(
        st.attach_ring(1, pid, 0, cq2, cfd, ring::cq_len(8) as u64),
        Ok(())
    );
    // Reset the rig's QP so that its rings can be attached, then bring it back to RTS.
    let Resp::Qp { qpn: q2, cap } = st.request(
        1,
        pid,
        Req::CreateQp {
            xrcd: 0,
            pd: st.qps[&qpn].pd,
            send_cq: cq2,
            recv_cq: cq2,
            srq: 0,
            qp_type: IBV_QPT_RC,
            sq_sig_all: false,
            cap,
        },
        Instant::now(),
    ) else {
        panic!()
    };
    let l = QpLayout::new(&cap);
    drop(qmap);
    // SAFETY: our own fd.
    unsafe { libc::close(qfd) };
    let (qmap, qfd) = Map::create("t", l.len).unwrap();
    assert_eq!(st.attach_ring(1, pid, 1, q2, qfd, l.len as u64), Ok(()));
    // SAFETY: our own fds; the engine has its own mappings.
    unsafe {
        libc::close(qfd);
        libc::close(cfd);
    }
    let sq = Ring {
        off: 0,
        n: l.sq_n,
        slot: l.sq_slot,
    };
    let cqr = Ring {
        off: 0,
        n: 8,
        slot: ring::WC_SIZE,
    };
    // Post a signalled WRITE of 300 bytes in RESET->...->RTS: move q2 to RTS first.
    {
        let a = st.qps[&qpn].attr;
        let mut b = QpAttrs {
            qp_state: IBV_QPS_INIT,
            port_num: 1,
            ..Default::default()
        };
        st.modify_qp(
            q2,
            IBV_QP_STATE | IBV_QP_PORT | IBV_QP_PKEY_INDEX | IBV_QP_ACCESS_FLAGS,
            &b,
            Instant::now(),
        )
        .unwrap();
        b = a;
        b.qp_state = IBV_QPS_RTR;
        st.modify_qp(
            q2,
            IBV_QP_STATE
                | IBV_QP_AV
                | IBV_QP_PATH_MTU
                | IBV_QP_DEST_QPN
                | IBV_QP_RQ_PSN
                | IBV_QP_MAX_DEST_RD_ATOMIC
                | IBV_QP_MIN_RNR_TIMER,
            &b,
            Instant::now(),
        )
        .unwrap();
        b.qp_state = IBV_QPS_RTS;
        st.modify_qp(
            q2,
            IBV_QP_STATE
                | IBV_QP_TIMEOUT
                | IBV_QP_RETRY_CNT
                | IBV_QP_RNR_RETRY
                | IBV_QP_SQ_PSN
                | IBV_QP_MAX_QP_RD_ATOMIC,
            &b,
            Instant::now(),
        )
        .unwrap();
    }
    let buf_addr = buf.as_mut_ptr() as u64;
    let write_slot = |i: u32, wr_id: u64, opcode: i32, nsge: u32| {
        let mut b = vec![0u8; sq.slot];
        ring::SqHeader {
            wr_id,
            opcode: opcode as u32,
            send_flags: IBV_SEND_SIGNALED,
            num_sge: nsge,
            inline_len: ring::NOT_INLINE,
            ..Default::default()
        }
        .encode(&mut b);
        let sge = Sge {
            addr: buf_addr,
            length: 300,
            lkey,
        };
        ring::put_sge(&mut b, ring::SQ_SGE_OFF, 0, &sge);
        qmap.write(sq.slot_off(i), &b);
    };
    write_slot(0, 41, IBV_WR_RDMA_WRITE, 1);
    sq.prod(&qmap).store(1, Ordering::Release);
    let now = Instant::now();
    while st.tx_one(now).is_some() {}
    assert_eq!(st.counters.ring_send_wqes, 1);
    assert_eq!(st.fabric.out.len(), 2, "300 bytes at 256-byte MTU");
    assert_eq!(
        sq.done(&qmap).load(Ordering::Acquire),
        0,
        "not acknowledged yet"
    );
    // The peer acknowledges both packets: done is published, then the completion.
    let last = st.qps[&q2].req.next_psn;
    st.on_ack(q2, psn_add(last, wire::PSN_MASK), now);
    st.sync_done(q2);
    assert_eq!(sq.done(&qmap).load(Ordering::Acquire), 1);
    assert_eq!(cqr.prod(&cmap).load(Ordering::Acquire), 1);
    let mut b = [0u8; ring::WC_SIZE];
    cmap.read(cqr.slot_off(0), &mut b);
    let wc = ring::wc_from(&b);
    assert_eq!((wc.wr_id, wc.status, wc.opcode), (41, 0, IBV_WC_RDMA_WRITE));
    assert_eq!(st.counters.ring_cqes, 1);
    // A malformed entry (too many SGEs): error completion, QP in error, and what follows
    // is flushed.
    write_slot(1, 42, IBV_WR_RDMA_WRITE, 99);
    write_slot(2, 43, IBV_WR_SEND, 1);
    sq.prod(&qmap).store(3, Ordering::Release);
    st.pull_sq(q2);
    assert_eq!(st.qps[&q2].state, IBV_QPS_ERR);
    assert_eq!(sq.done(&qmap).load(Ordering::Acquire), 2);
    cmap.read(cqr.slot_off(1), &mut b);
    let wc = ring::wc_from(&b);
    assert_eq!((wc.wr_id, wc.status), (42, IBV_WC_LOC_QP_OP_ERR));
    // The entry after the bad one was not consumed yet; the next scan flushes it.
    st.pull_sq(q2);
    assert_eq!(sq.done(&qmap).load(Ordering::Acquire), 3);
    cmap.read(cqr.slot_off(2), &mut b);
    let wc = ring::wc_from(&b);
    assert_eq!((wc.wr_id, wc.status), (43, IBV_WC_WR_FLUSH_ERR));
    // A lying producer index (far beyond the ring) is bounded by the ring size.
    sq.prod(&qmap).store(1_000_000, Ordering::Release);
    st.pull_sq(q2);
    assert!(st.counters.ring_send_wqes < 100);
}

/// Through the shared send ring, a doorbell is what one `ibv_post_send` call published:
/// the provider marks the first slot of each call, and two calls waiting in the ring when
/// the engine looks are still two fetch reads.
#[test]
fn ring_doorbell_marks_delimit_fetch_batches() {
    use crate::nic::{BANK, SLACK};
    let cfg = NicConfig {
        line_rate_gbps: 0.0,
        qp_cache: 0,
        wqe_fetch_ns: 10_000_000,
        ..Default::default()
    };
    let (mut st, qpns, buf) = nic_rig(cfg, 2, 0);
    let (co, fg) = (qpns[0], qpns[1]);
    let pid = std::process::id() as i32;
    // Give the co-runner's QP a send ring: back to RESET, attach, up to RTS again.
    let attr = st.qps[&co].attr;
    let mut a = QpAttrs {
        qp_state: IBV_QPS_RESET,
        ..Default::default()
    };
    st.modify_qp(co, IBV_QP_STATE, &a, Instant::now()).unwrap();
    let l = QpLayout::new(&st.qps[&co].cap);
    let (qmap, qfd) = Map::create("t", l.len).unwrap();
    assert_eq!(st.attach_ring(1, pid, 1, co, qfd, l.len as u64), Ok(()));
    // SAFETY: our own fd; the engine has its own mapping.
    unsafe { libc::close(qfd) };
    a.qp_state = IBV_QPS_INIT;
    a.port_num = 1;
    let m = IBV_QP_STATE | IBV_QP_PORT | IBV_QP_PKEY_INDEX | IBV_QP_ACCESS_FLAGS;
    st.modify_qp(co, m, &a, Instant::now()).unwrap();
    a = attr;
    a.qp_state = IBV_QPS_RTR;
    let rtr = IBV_QP_STATE
        | IBV_QP_AV
        | IBV_QP_PATH_MTU
        | IBV_QP_DEST_QPN
        | IBV_QP_RQ_PSN
        | IBV_QP_MAX_DEST_RD_ATOMIC
        | IBV_QP_MIN_RNR_TIMER;
    st.modify_qp(co, rtr, &a, Instant::now()).unwrap();
    a.qp_state = IBV_QPS_RTS;
    let rts = IBV_QP_STATE
        | IBV_QP_TIMEOUT
        | IBV_QP_RETRY_CNT
        | IBV_QP_RNR_RETRY
        | IBV_QP_SQ_PSN
        | IBV_QP_MAX_QP_RD_ATOMIC;
    st.modify_qp(co, rts, &a, Instant::now()).unwrap();
    let sq = Ring {
        off: 0,
        n: l.sq_n,
        slot: l.sq_slot,
    };
    let lkey = *st.mem.mrs.keys().next().unwrap();
    // Two calls, a list of 4 and a single work request, as post_send_ring writes them.
    for (i, first) in [true, false, false, false, true].into_iter().enumerate() {
        let mut b = vec![0u8; sq.slot];
        ring::SqHeader {
            wr_id: i as u64,
            opcode: IBV_WR_RDMA_WRITE as u32,
            num_sge: 1,
            inline_len: ring::NOT_INLINE,
            doorbell: u32::from(first),
            ..Default::default()
        }
        .encode(&mut b);
        let sge = Sge {
            addr: buf.as_ptr() as u64,
            length: 700,
            lkey,
        };
        ring::put_sge(&mut b, ring::SQ_SGE_OFF, 0, &sge);
        qmap.write(sq.slot_off(i as u32), &b);
    }
    sq.prod(&qmap).store(5, Ordering::Release);
    assert_eq!(
        st.post_send(1, fg, vec![rig_write(&st, &buf, 9)]),
        Resp::Unit
    );
    let t0 = Instant::now() + BANK;
    let sent = tx_virtual(&mut st, t0);
    assert_eq!(st.counters.ring_send_wqes, 5);
    // The list's 4 fetches come before the foreground's packet; the single is read alone.
    let ms = Duration::from_millis;
    assert_eq!(first_of(&sent, fg), ms(40) - BANK - SLACK);
    assert_eq!(sent.len(), 6 * 3);
    assert_eq!(
        (st.counters.wqe_fetches, st.counters.wqe_fetch_reads),
        (6, 3)
    );
}

/// A destroyed connected QP re-acknowledges its peer's duplicates for a while (so a lost
/// final ACK does not fail the peer), and nothing else: strangers, new data and READ
/// requests are dropped as for an unknown QP.
#[test]
fn destroyed_qp_tombstone_only_reacknowledges_duplicates() {
    let (mut st, qpns, _buf) = nic_rig(NicConfig::default(), 1, 0);
    let qpn = qpns[0];
    let peer = st.qps[&qpn].remote.unwrap();
    let peer_qpn = st.qps[&qpn].attr.dest_qp_num;
    let epsn = st.qps[&qpn].resp.epsn;
    assert!(matches!(
        st.request(1, 1, Req::DestroyQp { qpn }, Instant::now()),
        Resp::Destroyed { .. }
    ));
    let now = Instant::now();
    let pkt = |op: u8, psn: u32, src: u32| Packet {
        op,
        flags: wire::F_FIRST | wire::F_LAST | wire::F_ACKREQ,
        dst_qpn: qpn,
        src_qpn: src,
        psn,
        ..Default::default()
    };
    let dup = psn_add(epsn, wire::PSN_MASK);
    st.on_packet(peer, pkt(wire::OP_SEND, dup, peer_qpn), now);
    assert_eq!(st.counters.rx_duplicate, 1);
    assert_eq!(st.fabric.out.len(), 1);
    let ack = st.fabric.out[0].1.clone();
    assert_eq!(
        (ack.op, ack.psn, ack.dst_qpn),
        (wire::OP_ACK, dup, peer_qpn)
    );
    st.fabric.out.clear();
    for (from, p) in [
        (peer, pkt(wire::OP_SEND, epsn, peer_qpn)),    // new data
        (peer, pkt(wire::OP_READ_REQ, dup, peer_qpn)), // a read needs the memory
        (peer, pkt(wire::OP_SEND, dup, peer_qpn + 1)), // another QP of the peer
    ] {
        st.on_packet(from, p, now);
    }
    let stranger = SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::new(127, 9, 9, 9), 4791));
    st.on_packet(stranger, pkt(wire::OP_SEND, dup, peer_qpn), now);
    assert!(st.fabric.out.is_empty());
    assert_eq!(st.counters.rx_dropped_unknown_qp, 4);
    // Expired: dropped too.
    let later = now + TOMBSTONE + Duration::from_secs(1);
    st.timers(later);
    st.on_packet(peer, pkt(wire::OP_SEND, dup, peer_qpn), later);
    assert_eq!(st.counters.rx_dropped_unknown_qp, 5);
}

mod fuzz {
    use super::*;
    use proptest::prelude::*;

    const GUARD: usize = 4096;
    const MR_LEN: usize = 8192;
    const PEER_QPN: u32 = 0x77;
    const UD_QKEY: u32 = 0x1111_1111;

    struct Rig {
        st: State,
        qpn: u32,
        cq: u32,
        lkey: u32,
        rkey: u32,
        mr_addr: u64,
        buf: Vec<u8>,
        peer: SocketAddr,
    }

    fn rig() -> Rig {
        rig_with(true)
    }

    /// An RTS QP connected to PEER_QPN with receives posted and, if `busy`, a SEND, a
    /// WRITE and a READ in flight.
    fn rig_with(busy: bool) -> Rig {
        rig_typed(busy, IBV_QPT_RC)
    }

    /// The rig with a QP of transport `qpt`, brought to RTS with that transport's masks
    /// (UD: Q_Key 0x11111111, no peer).
    fn rig_typed(busy: bool, qpt: i32) -> Rig {
        let mut buf = vec![0xa5u8; GUARD + MR_LEN + GUARD];
        let mut st = State::new();
        let pid = std::process::id() as i32;
        let Resp::Handle(pd) = st.request(1, pid, Req::AllocPd, Instant::now()) else {
            panic!()
        };
        let mr_addr = buf.as_mut_ptr() as u64 + GUARD as u64;
        let Resp::Mr { lkey, rkey, .. } = st.request(
            1,
            pid,
            Req::RegMr {
                pd,
                addr: mr_addr,
                len: MR_LEN as u64,
                access: IBV_ACCESS_LOCAL_WRITE
                    | IBV_ACCESS_REMOTE_WRITE
                    | IBV_ACCESS_REMOTE_READ
                    | IBV_ACCESS_REMOTE_ATOMIC,
            },
            Instant::now(),
        ) else {
            panic!()
        };
        let Resp::Cq { handle: cq, .. } = st.request(
            1,
            pid,
            Req::CreateCq {
                cqe: 256,
                channel: 0,
                user: 0,
            },
            Instant::now(),
        ) else {
            panic!()
        };
        let Resp::Qp { qpn, .. } = st.request(
            1,
            pid,
            Req::CreateQp {
                xrcd: 0,
                pd,
                send_cq: cq,
                recv_cq: cq,
                srq: 0,
                qp_type: qpt,
                sq_sig_all: true,
                cap: Caps {
                    max_send_wr: 16,
                    max_recv_wr: 16,
                    max_send_sge: 1,
                    max_recv_sge: 1,
                    max_inline_data: 0,
                },
            },
            Instant::now(),
        ) else {
            panic!()
        };
        let mut a = QpAttrs {
            qp_state: IBV_QPS_INIT,
            port_num: 1,
            access_flags: IBV_ACCESS_REMOTE_WRITE
                | IBV_ACCESS_REMOTE_READ
                | IBV_ACCESS_REMOTE_ATOMIC,
            ..Default::default()
        };
        if qpt == IBV_QPT_UD {
            a.qkey = UD_QKEY;
            let m = IBV_QP_STATE | IBV_QP_PORT | IBV_QP_PKEY_INDEX | IBV_QP_QKEY;
            st.modify_qp(qpn, m, &a, Instant::now()).unwrap();
            a.qp_state = IBV_QPS_RTR;
            st.modify_qp(qpn, IBV_QP_STATE, &a, Instant::now()).unwrap();
            a.qp_state = IBV_QPS_RTS;
            a.sq_psn = 5000;
            st.modify_qp(qpn, IBV_QP_STATE | IBV_QP_SQ_PSN, &a, Instant::now())
                .unwrap();
        }
        let m = IBV_QP_STATE | IBV_QP_PORT | IBV_QP_PKEY_INDEX | IBV_QP_ACCESS_FLAGS;
        if qpt != IBV_QPT_UD {
            st.modify_qp(qpn, m, &a, Instant::now()).unwrap();
        }
        a.qp_state = IBV_QPS_RTR;
        a.path_mtu = 1; // 256-byte packets: multi-packet messages
        a.is_global = 1;
        a.dgid = device::gid_for(Ipv4Addr::LOCALHOST);
        a.dest_qp_num = PEER_QPN;
        a.rq_psn = 1000;
        a.min_rnr_timer = 1;
        let uc_rtr = IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN;
        let rtr = uc_rtr | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER;
        match qpt {
            IBV_QPT_RC => st.modify_qp(qpn, rtr, &a, Instant::now()).unwrap(),
            IBV_QPT_UC => {
                assert_eq!(
                    st.modify_qp(qpn, rtr, &a, Instant::now()),
                    Err(libc::EINVAL),
                    "RC-only mask"
                );
                st.modify_qp(qpn, uc_rtr, &a, Instant::now()).unwrap();
            }
            _ => {}
        }
        a.qp_state = IBV_QPS_RTS;
        a.sq_psn = 5000;
        a.timeout = 14;
        a.retry_cnt = 7;
        a.rnr_retry = 7;
        let rts = IBV_QP_STATE
            | IBV_QP_TIMEOUT
            | IBV_QP_RETRY_CNT
            | IBV_QP_RNR_RETRY
            | IBV_QP_SQ_PSN
            | IBV_QP_MAX_QP_RD_ATOMIC;
        match qpt {
            IBV_QPT_RC => st.modify_qp(qpn, rts, &a, Instant::now()).unwrap(),
            IBV_QPT_UC => st
                .modify_qp(qpn, IBV_QP_STATE | IBV_QP_SQ_PSN, &a, Instant::now())
                .unwrap(),
            _ => {}
        }
        let sge = |off: u64, len: u32| Sge {
            addr: mr_addr + off,
            length: len,
            lkey,
        };
        let recvs = (0..4)
            .map(|i| RecvWr {
                wr_id: 100 + i,
                sges: vec![sge(i * 1024, 1024)],
            })
            .collect();
        assert_eq!(st.post_recv(1, qpn, recvs), Resp::Unit);
        let wr = |id: u64, opcode: i32, off: u64, len: u32| SendWr {
            xrc_srqn: 0,
            wr_id: id,
            opcode,
            flags: IBV_SEND_SIGNALED,
            imm: 0,
            remote_addr: 0x10_0000,
            rkey: 9,
            compare_add: 0,
            swap: 0,
            sges: vec![sge(off, len)],
            inline: None,
        };
        let wrs = vec![
            wr(1, IBV_WR_SEND, 4096, 600),
            wr(2, IBV_WR_RDMA_WRITE, 5000, 300),
            wr(3, IBV_WR_RDMA_READ, 6000, 700),
        ];
        // In flight: what the transport allows of a SEND, a WRITE and a READ.
        let q = st.qps[&qpn].qpt;
        let wrs: Vec<SendWr> = wrs
            .into_iter()
            .filter(|w| proto::check_send_wr(q, w.opcode, false, 8).is_ok())
            .collect();
        if busy {
            assert!(matches!(st.post_send(1, qpn, wrs), Resp::Unit));
        }
        let now = Instant::now();
        while st.next_packet(qpn, now).is_some() {}
        st.fabric.out.clear();
        let peer = SocketAddr::V4(SocketAddrV4::new(
            Ipv4Addr::LOCALHOST,
            device::ENGINE_UDP_PORT,
        ));
        Rig {
            st,
            qpn,
            cq,
            lkey,
            rkey,
            mr_addr,
            buf,
            peer,
        }
    }

    /// A header biased towards what the QP accepts (right QPNs, PSNs near the windows,
    /// addresses near the MR), with arbitrary values mixed in.
    fn hostile() -> impl Strategy<Value = (u8, Packet)> {
        (
            (1u8..=wire::OP_MAX, any::<u8>(), 0u8..8, 0u8..10),
            (any::<u32>(), -140i32..140, any::<bool>(), any::<u32>()),
            (0u32..3000, 0u32..3000, any::<u32>(), any::<bool>()),
            (-5000i64..13000, any::<u64>(), 0u8..10, any::<u32>()),
            proptest::collection::vec(any::<u8>(), 0..600),
        )
            .prop_map(
                |(
                    (op, flags, syndrome, who),
                    (qpn_any, dpsn, near_rq, psn_any),
                    (msg_len, offset, len_any, small),
                    (daddr, addr_any, key_pick, key_any),
                    payload,
                )| {
                    let base = if near_rq { 1000 } else { 5000 };
                    let p = Packet {
                        srqn: 0,
                        op,
                        flags,
                        syndrome,
                        ecn: syndrome & 3,
                        dst_qpn: qpn_any,
                        src_qpn: PEER_QPN,
                        psn: if dpsn == 139 {
                            psn_any & wire::PSN_MASK
                        } else {
                            psn_add(base, dpsn as u32)
                        },
                        msg_len: if small { msg_len } else { len_any },
                        offset,
                        imm: 0,
                        remote_addr: if key_pick == 0 {
                            addr_any
                        } else {
                            daddr as u64
                        },
                        rkey: if key_pick == 1 { key_any } else { 0 },
                        payload: payload.into(),
                    };
                    (who, p)
                },
            )
    }

    fn atomic_req(r: &Rig, op: u8, psn: u32, off: u64, operand: u64, swap: u64) -> Packet {
        Packet {
            op,
            flags: wire::F_FIRST | wire::F_LAST | wire::F_ACKREQ,
            dst_qpn: r.qpn,
            src_qpn: PEER_QPN,
            psn,
            msg_len: 8,
            remote_addr: r.mr_addr + off,
            rkey: r.rkey,
            payload: atomic_operands(operand, swap).into(),
            ..Default::default()
        }
    }

    fn word(r: &Rig, off: usize) -> u64 {
        u64::from_ne_bytes(r.buf[GUARD + off..GUARD + off + 8].try_into().unwrap())
    }

    /// The only packet the engine queued: an atomic response (PSN, original value).
    fn take_atomic_resp(st: &mut State) -> (u32, u64) {
        assert_eq!(st.fabric.out.len(), 1, "one response");
        let p = st.fabric.out.remove(0).1;
        assert_eq!(p.op, wire::OP_ATOMIC_RESP);
        (p.psn, u64::from_le_bytes(p.payload[..].try_into().unwrap()))
    }

    /// Responder: FETCH_ADD and CMP_SWAP act on the target word and return its original
    /// value; a retransmitted request is answered from the result cache without being
    /// executed again (even with different operands, as a replay would carry); a failed
    /// compare leaves the word alone; a misaligned target is an invalid request.
    #[test]
    fn atomics_execute_once_and_duplicates_are_answered_from_the_cache() {
        let mut r = rig_with(false);
        r.buf[GUARD + 64..GUARD + 72].copy_from_slice(&5u64.to_ne_bytes());
        let now = Instant::now();
        let fa = atomic_req(&r, wire::OP_FETCH_ADD, 1000, 64, 3, 0);
        r.st.on_packet(r.peer, fa.clone(), now);
        assert_eq!(take_atomic_resp(&mut r.st), (1000, 5));
        assert_eq!(word(&r, 64), 8);
        let mut replay = fa;
        replay.payload = atomic_operands(1000, 0).into();
        r.st.on_packet(r.peer, replay, now);
        assert_eq!(take_atomic_resp(&mut r.st), (1000, 5), "cached result");
        assert_eq!(word(&r, 64), 8, "not executed twice");
        assert_eq!(r.st.counters.rx_duplicate, 1);
        let cas = atomic_req(&r, wire::OP_CMP_SWAP, 1001, 64, 8, u64::MAX - 1);
        r.st.on_packet(r.peer, cas, now);
        assert_eq!(take_atomic_resp(&mut r.st), (1001, 8));
        assert_eq!(word(&r, 64), u64::MAX - 1);
        let miss = atomic_req(&r, wire::OP_CMP_SWAP, 1002, 64, 8, 1);
        r.st.on_packet(r.peer, miss, now);
        assert_eq!(take_atomic_resp(&mut r.st), (1002, u64::MAX - 1));
        assert_eq!(word(&r, 64), u64::MAX - 1, "compare failed: unchanged");
        let wrap = atomic_req(&r, wire::OP_FETCH_ADD, 1003, 64, 3, 0);
        r.st.on_packet(r.peer, wrap, now);
        assert_eq!(take_atomic_resp(&mut r.st), (1003, u64::MAX - 1));
        assert_eq!(word(&r, 64), 1, "64-bit wrap-around");
        // Older results stay answerable while newer ones push into the cache.
        for i in 0..(ATOMIC_CACHE as u32 - 1) {
            let p = atomic_req(&r, wire::OP_FETCH_ADD, 1004 + i, 128, 1, 0);
            r.st.on_packet(r.peer, p, now);
            r.st.fabric.out.clear();
        }
        let old = atomic_req(&r, wire::OP_FETCH_ADD, 1003, 64, 3, 0);
        r.st.on_packet(r.peer, old.clone(), now);
        assert_eq!(take_atomic_resp(&mut r.st), (1003, u64::MAX - 1));
        // One more pushes PSN 1003 out: a copy that late is dropped, never re-executed.
        let p = atomic_req(
            &r,
            wire::OP_FETCH_ADD,
            1003 + ATOMIC_CACHE as u32,
            128,
            1,
            0,
        );
        r.st.on_packet(r.peer, p, now);
        r.st.fabric.out.clear();
        r.st.on_packet(r.peer, old, now);
        assert!(r.st.fabric.out.is_empty());
        assert_eq!(word(&r, 64), 1);
        let epsn = 1004 + ATOMIC_CACHE as u32;
        let misaligned = atomic_req(&r, wire::OP_FETCH_ADD, epsn, 68, 1, 0);
        r.st.on_packet(r.peer, misaligned, now);
        let nak = r.st.fabric.out.remove(0).1;
        assert_eq!(
            (nak.op, nak.syndrome),
            (wire::OP_NAK, wire::NAK_REM_INVALID)
        );
        assert_eq!(word(&r, 64), 1);
    }

    /// Responder: atomics need REMOTE_ATOMIC on the QP and on the MR.
    #[test]
    fn atomics_need_remote_atomic_access() {
        let mut r = rig_with(false);
        r.st.qps.get_mut(&r.qpn).unwrap().attr.access_flags = IBV_ACCESS_REMOTE_WRITE;
        let p = atomic_req(&r, wire::OP_FETCH_ADD, 1000, 0, 1, 0);
        r.st.on_packet(r.peer, p, Instant::now());
        let nak = r.st.fabric.out.remove(0).1;
        assert_eq!((nak.op, nak.syndrome), (wire::OP_NAK, wire::NAK_REM_ACCESS));
        // An access violation sends the responder's QP to error too (IBTA class C).
        assert_eq!(r.st.qps[&r.qpn].state, IBV_QPS_ERR);
        let mut r = rig_with(false);
        r.st.mem.mrs.get_mut(&r.rkey).unwrap().access =
            IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;
        let p = atomic_req(&r, wire::OP_FETCH_ADD, 1000, 0, 1, 0);
        r.st.on_packet(r.peer, p, Instant::now());
        let nak = r.st.fabric.out.remove(0).1;
        assert_eq!((nak.op, nak.syndrome), (wire::OP_NAK, wire::NAK_REM_ACCESS));
        assert_eq!(word(&r, 0), 0xa5a5_a5a5_a5a5_a5a5);
    }

    /// A zero-length RDMA WRITE (rsockets' control messages are zero-length WRITE_WITH_IMMs
    /// with whatever R_Key and address were on the stack) is not checked against any MR: the
    /// immediate completes a receive and the request is acknowledged. With a payload, the same
    /// R_Key is refused.
    #[test]
    fn zero_length_writes_skip_the_rkey_check() {
        let mut r = rig_with(false);
        let write = |psn: u32, payload: Vec<u8>| Packet {
            op: wire::OP_WRITE,
            flags: wire::F_FIRST | wire::F_LAST | wire::F_IMM | wire::F_ACKREQ,
            dst_qpn: r.qpn,
            src_qpn: PEER_QPN,
            psn,
            msg_len: payload.len() as u32,
            remote_addr: 0xdead_beef_0000,
            rkey: r.rkey ^ 0x5a5a,
            imm: 0x1234,
            payload: payload.into(),
            ..Default::default()
        };
        let (empty, full) = (write(1000, vec![]), write(1001, vec![7; 8]));
        r.st.on_packet(r.peer, empty, Instant::now());
        let ack = r.st.fabric.out.remove(0).1;
        assert_eq!(ack.op, wire::OP_ACK);
        let wc = cqes(&r)[0];
        assert_eq!(
            (wc.status, wc.opcode, wc.byte_len, wc.imm_data),
            (IBV_WC_SUCCESS, IBV_WC_RECV_RDMA_WITH_IMM, 0, 0x1234)
        );
        r.st.on_packet(r.peer, full, Instant::now());
        let nak = r.st.fabric.out.remove(0).1;
        assert_eq!((nak.op, nak.syndrome), (wire::OP_NAK, wire::NAK_REM_ACCESS));
    }

    /// Requester: malformed atomic work requests are refused at post time; a posted
    /// FETCH_ADD becomes one request packet, at most max_rd_atomic (here 1) wait for
    /// responses, and the response puts the original value into the local buffer and
    /// completes the WQE (FETCH_ADD, byte_len 8); a duplicate response is stale.
    #[test]
    fn atomic_requests_and_responses_on_the_requester() {
        let mut r = rig_with(false);
        let mr = (r.mr_addr, r.lkey);
        let wr = |id: u64, opcode: i32, off: u64, len: u32| SendWr {
            compare_add: 7,
            ..rig_wr(mr, id, opcode, off, len)
        };
        let short = wr(1, IBV_WR_ATOMIC_FETCH_AND_ADD, 0, 4);
        assert!(matches!(
            r.st.post_send(1, r.qpn, vec![short]),
            Resp::Err {
                errno: libc::EINVAL,
                ..
            }
        ));
        let mut inline = wr(1, IBV_WR_ATOMIC_CMP_AND_SWP, 0, 8);
        inline.inline = Some(vec![0; 8]);
        inline.sges.clear();
        assert!(matches!(
            r.st.post_send(1, r.qpn, vec![inline]),
            Resp::Err {
                errno: libc::EINVAL,
                ..
            }
        ));
        let wrs = vec![
            wr(10, IBV_WR_ATOMIC_FETCH_AND_ADD, 256, 8),
            wr(11, IBV_WR_ATOMIC_FETCH_AND_ADD, 264, 8),
        ];
        assert_eq!(r.st.post_send(1, r.qpn, wrs), Resp::Unit);
        let now = Instant::now();
        let (_, req) = r.st.next_packet(r.qpn, now).expect("request");
        assert_eq!(
            (req.op, req.psn, req.msg_len),
            (wire::OP_FETCH_ADD, 5000, 8)
        );
        assert_eq!(req.payload[..], atomic_operands(7, 0));
        assert!(r.st.next_packet(r.qpn, now).is_none(), "max_rd_atomic 1");
        let resp = Packet {
            op: wire::OP_ATOMIC_RESP,
            flags: wire::F_FIRST | wire::F_LAST,
            dst_qpn: r.qpn,
            src_qpn: PEER_QPN,
            psn: 5000,
            msg_len: 8,
            payload: 0x1122_3344_5566_7788u64.to_le_bytes().to_vec().into(),
            ..Default::default()
        };
        r.st.on_packet(r.peer, resp.clone(), now);
        assert_eq!(word(&r, 256), 0x1122_3344_5566_7788);
        let wc = r.st.cqs[&r.cq].q.back().copied().expect("completion");
        assert_eq!(
            (wc.wr_id, wc.status, wc.opcode, wc.byte_len),
            (10, IBV_WC_SUCCESS, IBV_WC_FETCH_ADD, 8)
        );
        assert!(r.st.next_packet(r.qpn, now).is_some(), "second atomic sent");
        let stale = r.st.counters.rx_stale;
        r.st.on_packet(r.peer, resp, now);
        assert_eq!(r.st.counters.rx_stale, stale + 1);
        assert_eq!(r.st.cqs[&r.cq].q.len(), 1);
    }

    /// Requester: no more RDMA READs and atomics than `max_rd_atomic` (here 2) wait for
    /// responses at once — the responder has resources for no more, and a READ beyond them
    /// came back only after a retransmission timeout (`ib_read_bw` with its default queue
    /// depth ran at a sixth of its speed). A READ stops counting once its last response
    /// arrived.
    #[test]
    fn reads_and_atomics_outstanding_are_held_to_max_rd_atomic() {
        let mut r = rig_with(false);
        r.st.qps.get_mut(&r.qpn).unwrap().attr.max_rd_atomic = 2;
        let mr = (r.mr_addr, r.lkey);
        let wrs = vec![
            rig_wr(mr, 1, IBV_WR_RDMA_READ, 0, 8),
            rig_wr(mr, 2, IBV_WR_RDMA_READ, 8, 8),
            rig_wr(mr, 3, IBV_WR_ATOMIC_FETCH_AND_ADD, 16, 8),
        ];
        assert_eq!(r.st.post_send(1, r.qpn, wrs), Resp::Unit);
        let now = Instant::now();
        let mut sent = Vec::new();
        while let Some((_, p)) = r.st.next_packet(r.qpn, now) {
            sent.push((p.op, p.psn));
        }
        assert_eq!(
            sent,
            [(wire::OP_READ_REQ, 5000), (wire::OP_READ_REQ, 5001)],
            "the atomic waits"
        );
        // The first READ's response: it completes, and the atomic may go.
        let only = wire::F_FIRST | wire::F_LAST;
        let resp = Packet {
            msg_len: 8,
            payload: vec![4; 8].into(),
            ..from_peer(&r, wire::OP_READ_RESP, only, 5000)
        };
        r.st.on_packet(r.peer, resp, now);
        assert_eq!(r.st.cqs[&r.cq].q.len(), 1, "first READ complete");
        let (_, p) = r.st.next_packet(r.qpn, now).expect("the atomic");
        assert_eq!(p.op, wire::OP_FETCH_ADD);
    }

    /// SRQ control verbs: sizes granted and queried, posting beyond max_wr refused with
    /// the index of the first rejected WR, resize not below the queued count, the limit
    /// event refused (no asynchronous events), destroy refused while a QP uses it; a QP
    /// with an SRQ refuses post_recv and takes a SEND's receive from the SRQ, completing
    /// it with its own QP number.
    #[test]
    fn srq_receives_are_shared_and_its_verbs_check_their_arguments() {
        let mut r = rig_with(false);
        let pd = r.st.qps[&r.qpn].pd;
        let Resp::Srq { handle: srq, .. } = r.st.request(
            1,
            r.st.qps[&r.qpn].pid,
            Req::CreateSrq {
                xrcd: 0,
                cq: 0,
                pd,
                max_wr: 2,
                max_sge: 1,
            },
            Instant::now(),
        ) else {
            panic!()
        };
        assert!(matches!(
            r.st.request(2, 0, Req::QuerySrq { srq }, Instant::now()),
            Resp::Err { .. }
        ));
        assert_eq!(
            r.st.request(1, 0, Req::QuerySrq { srq }, Instant::now()),
            Resp::Srq {
                handle: srq,
                max_wr: 2,
                max_sge: 1,
                srq_limit: 0
            }
        );
        let recv = |id: u64, off: u64| RecvWr {
            wr_id: id,
            sges: vec![Sge {
                addr: r.mr_addr + off,
                length: 1024,
                lkey: r.lkey,
            }],
        };
        let wrs = vec![recv(7, 2048), recv(8, 3072), recv(9, 0)];
        assert_eq!(
            r.st.request(1, 0, Req::PostSrqRecv { srq, wrs }, Instant::now()),
            Resp::Err {
                errno: libc::ENOMEM,
                bad_index: 2
            }
        );
        let modify = |max_wr: u32, srq_limit: u32, mask: i32| Req::ModifySrq {
            srq,
            mask,
            max_wr,
            srq_limit,
        };
        assert_eq!(
            r.st.request(1, 0, modify(1, 0, 1), Instant::now()),
            err(libc::EINVAL)
        );
        // A limit above max_wr is refused (also against a max_wr set in the same call).
        assert_eq!(
            r.st.request(1, 0, modify(0, 5, 2), Instant::now()),
            err(libc::EINVAL)
        );
        assert_eq!(
            r.st.request(1, 0, modify(4, 5, 3), Instant::now()),
            err(libc::EINVAL)
        );
        assert_eq!(
            r.st.request(1, 0, modify(0, 0, 2), Instant::now()),
            Resp::Unit
        );
        assert_eq!(
            r.st.request(1, 0, modify(8, 0, 1), Instant::now()),
            Resp::Unit
        );
        // The rig's QP becomes one of the SRQ's (its own receives are discarded).
        let q = r.st.qps.get_mut(&r.qpn).unwrap();
        q.srq = srq;
        q.resp.rq.clear();
        let wrs = vec![recv(1, 0)];
        assert!(matches!(
            r.st.post_recv(1, r.qpn, wrs),
            Resp::Err {
                errno: libc::EINVAL,
                ..
            }
        ));
        assert_eq!(
            r.st.request(1, 0, Req::DestroySrq { srq }, Instant::now()),
            err(libc::EBUSY)
        );
        let send = Packet {
            op: wire::OP_SEND,
            flags: wire::F_FIRST | wire::F_LAST | wire::F_ACKREQ,
            dst_qpn: r.qpn,
            src_qpn: PEER_QPN,
            psn: 1000,
            msg_len: 3,
            payload: vec![4, 5, 6].into(),
            ..Default::default()
        };
        r.st.on_packet(r.peer, send, Instant::now());
        assert_eq!(&r.buf[GUARD + 2048..GUARD + 2051], &[4, 5, 6]);
        let wc = r.st.cqs[&r.cq].q.back().copied().expect("completion");
        assert_eq!(
            (wc.wr_id, wc.status, wc.opcode, wc.qp_num, wc.byte_len),
            (7, IBV_WC_SUCCESS, IBV_WC_RECV, r.qpn, 3)
        );
        assert_eq!(r.st.srqs[&srq].q.len(), 1);
        r.st.remove_qp(r.qpn, Instant::now());
        assert_eq!(
            r.st.request(1, 0, Req::DestroySrq { srq }, Instant::now()),
            Resp::Destroyed {
                events_reported: 0,
                event_unread: false
            }
        );
    }

    #[test]
    fn async_events_srq_limit_last_wqe_and_what_a_destroy_waits_for() {
        use std::io::Read;
        let mut r = rig_with(false);
        let Resp::Channel { id, token } =
            r.st.request(1, 0, Req::CreateAsyncChannel, Instant::now())
        else {
            panic!()
        };
        let (app, engine_end) = UnixStream::pair().unwrap();
        assert_eq!(r.st.attach_channel(0, id, token, engine_end), Resp::Unit);
        app.set_nonblocking(true).unwrap();
        // One stream per context; it is no completion channel.
        assert_eq!(
            r.st.request(1, 0, Req::CreateAsyncChannel, Instant::now()),
            err(libc::EBUSY)
        );
        let cq_req = Req::CreateCq {
            cqe: 4,
            channel: id,
            user: 1,
        };
        assert_eq!(
            r.st.request(1, 0, cq_req, Instant::now()),
            err(libc::EINVAL)
        );
        let pd = r.st.qps[&r.qpn].pd;
        let Resp::Srq { handle: srq, .. } = r.st.request(
            1,
            r.st.qps[&r.qpn].pid,
            Req::CreateSrq {
                xrcd: 0,
                cq: 0,
                pd,
                max_wr: 4,
                max_sge: 1,
            },
            Instant::now(),
        ) else {
            panic!()
        };
        let user = |kind, handle, user| Req::UserHandle { kind, handle, user };
        assert_eq!(
            r.st.request(1, 0, user(2, srq, 0x5150), Instant::now()),
            Resp::Unit
        );
        assert_eq!(
            r.st.request(1, 0, user(1, r.qpn, 0x9090), Instant::now()),
            Resp::Unit
        );
        assert_eq!(
            r.st.request(2, 0, user(1, r.qpn, 1), Instant::now()),
            err(libc::EINVAL)
        );
        assert_eq!(
            r.st.request(1, 0, user(3, srq, 1), Instant::now()),
            err(libc::EINVAL)
        );
        let wrs = (0..4)
            .map(|i| RecvWr {
                wr_id: i,
                sges: vec![Sge {
                    addr: r.mr_addr + i * 1024,
                    length: 1024,
                    lkey: r.lkey,
                }],
            })
            .collect();
        assert_eq!(
            r.st.request(1, 0, Req::PostSrqRecv { srq, wrs }, Instant::now()),
            Resp::Unit
        );
        let arm = |limit| Req::ModifySrq {
            srq,
            mask: 2,
            max_wr: 0,
            srq_limit: limit,
        };
        assert_eq!(r.st.request(1, 0, arm(3), Instant::now()), Resp::Unit);
        let query = |st: &mut State| match st.request(1, 0, Req::QuerySrq { srq }, Instant::now()) {
            Resp::Srq { srq_limit, .. } => srq_limit,
            other => panic!("{other:?}"),
        };
        assert_eq!(query(&mut r.st), 3);
        let q = r.st.qps.get_mut(&r.qpn).unwrap();
        q.srq = srq;
        q.resp.rq.clear();
        let mut psn = 1000;
        let mut send = |st: &mut State| {
            let p = Packet {
                op: wire::OP_SEND,
                flags: wire::F_FIRST | wire::F_LAST | wire::F_ACKREQ,
                dst_qpn: r.qpn,
                src_qpn: PEER_QPN,
                psn,
                msg_len: 1,
                payload: vec![1].into(),
                ..Default::default()
            };
            psn += 1;
            st.on_packet(r.peer, p, Instant::now());
        };
        let mut b = [0u8; 32];
        // 3 left: not below the limit.
        send(&mut r.st);
        assert!((&app).read(&mut b).is_err());
        // 2 left: the event, once; the limit is disarmed.
        send(&mut r.st);
        assert_eq!((&app).read(&mut b).unwrap(), 16);
        assert_eq!(
            b[..16],
            crate::events::record(0x5150, IBV_EVENT_SRQ_LIMIT_REACHED)
        );
        assert_eq!(query(&mut r.st), 0);
        let read = Req::AsyncEventRead { taken_back: false };
        assert_eq!(r.st.request(1, 0, read.clone(), Instant::now()), Resp::Unit);
        send(&mut r.st);
        assert!((&app).read(&mut b).is_err());
        // Re-armed with 2 while 1 is queued: nothing until a receive is taken.
        assert_eq!(r.st.request(1, 0, arm(2), Instant::now()), Resp::Unit);
        assert!((&app).read(&mut b).is_err());
        // The QP with an SRQ goes to error: Last WQE Reached, for the application's QP.
        let a = QpAttrs {
            qp_state: IBV_QPS_ERR,
            ..Default::default()
        };
        r.st.modify_qp(r.qpn, IBV_QP_STATE, &a, Instant::now())
            .unwrap();
        assert_eq!((&app).read(&mut b).unwrap(), 16);
        assert_eq!(
            b[..16],
            crate::events::record(0x9090, IBV_EVENT_QP_LAST_WQE_REACHED)
        );
        // Destroying the QP while its event is unread: the provider takes it back.
        assert_eq!(
            r.st.request(1, 0, Req::DestroyQp { qpn: r.qpn }, Instant::now()),
            Resp::Destroyed {
                events_reported: 0,
                event_unread: true
            }
        );
        assert_eq!(r.st.request(1, 0, read, Instant::now()), Resp::Unit);
        // The SRQ's one event was read: its destroy waits for one acknowledgement.
        assert_eq!(
            r.st.request(1, 0, Req::DestroySrq { srq }, Instant::now()),
            Resp::Destroyed {
                events_reported: 1,
                event_unread: false
            }
        );
        assert!((&app).read(&mut b).is_err());
    }

    fn cqes(r: &Rig) -> Vec<IbvWc> {
        r.st.cqs[&r.cq].q.iter().copied().collect()
    }

    /// Memory windows: a bind is a send-queue WQE executed when the transmitter reaches
    /// it and completed in order (after the SEND before it is acknowledged); the window's
    /// rkey then grants its range and rights only; its MR cannot be deregistered while it
    /// is bound; a failed bind completes with MW_BIND_ERR and the QP goes to error.
    #[test]
    fn memory_window_binds_complete_in_order_and_gate_remote_access() {
        let mut r = rig_with(false);
        let pd = r.st.qps[&r.qpn].pd;
        let access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_MW_BIND;
        let Resp::Mr { lkey, .. } = r.st.request(
            1,
            std::process::id() as i32,
            Req::RegMr {
                pd,
                addr: r.mr_addr,
                len: 4096,
                access,
            },
            Instant::now(),
        ) else {
            panic!()
        };
        let Resp::Handle(mw) =
            r.st.request(1, 0, Req::AllocMw { pd, mw_type: 1 }, Instant::now())
        else {
            panic!()
        };
        assert_eq!(
            r.st.request(1, 0, Req::AllocMw { pd, mw_type: 3 }, Instant::now()),
            err(libc::EINVAL)
        );
        let new_rkey = (mw & !0xff) | ((mw + 1) & 0xff);
        let send = SendWr {
            wr_id: 1,
            opcode: IBV_WR_SEND,
            flags: IBV_SEND_SIGNALED,
            sges: vec![Sge {
                addr: r.mr_addr,
                length: 16,
                lkey: r.lkey,
            }],
            ..Default::default()
        };
        let bind = |wr_id, rkey, len| SendWr {
            wr_id,
            opcode: IBV_WR_BIND_MW,
            flags: IBV_SEND_SIGNALED,
            rkey,
            remote_addr: r.mr_addr + 256,
            compare_add: len,
            swap: proto::bind_fields(lkey, IBV_ACCESS_REMOTE_READ),
            ..Default::default()
        };
        let wrs = vec![send, bind(2, new_rkey, 256)];
        assert_eq!(r.st.post_send(1, r.qpn, wrs), Resp::Unit);
        let now = Instant::now();
        assert!(r.st.next_packet(r.qpn, now).is_some()); // the SEND
        assert!(r.st.next_packet(r.qpn, now).is_none()); // the bind, executed
        let q = r.st.qps[&r.qpn].pd;
        let grant = |st: &State, rkey, off, len| {
            st.mem
                .check_remote(r.qpn, q, rkey, r.mr_addr + off, len, IBV_ACCESS_REMOTE_READ)
        };
        assert!(grant(&r.st, new_rkey, 256, 256).is_some());
        assert!(grant(&r.st, new_rkey, 255, 8).is_none());
        assert!(grant(&r.st, new_rkey, 500, 16).is_none());
        assert!(grant(&r.st, mw, 256, 8).is_none());
        let wrong_right = r.st.mem.check_remote(
            r.qpn,
            q,
            new_rkey,
            r.mr_addr + 256,
            8,
            IBV_ACCESS_REMOTE_WRITE,
        );
        assert!(wrong_right.is_none());
        assert_eq!(
            r.st.request(1, 0, Req::DeregMr { lkey }, now),
            err(libc::EBUSY)
        );
        // Neither completes before the SEND is acknowledged; then both, in order.
        assert!(cqes(&r).is_empty());
        let ack = Packet {
            op: wire::OP_ACK,
            dst_qpn: r.qpn,
            src_qpn: PEER_QPN,
            psn: 5000,
            ..Default::default()
        };
        r.st.on_packet(r.peer, ack, now);
        let c: Vec<(u64, i32, i32)> = cqes(&r)
            .iter()
            .map(|w| (w.wr_id, w.status, w.opcode))
            .collect();
        assert_eq!(
            c,
            vec![
                (1, IBV_WC_SUCCESS, IBV_WC_SEND),
                (2, IBV_WC_SUCCESS, IBV_WC_BIND_MW)
            ]
        );
        // A bind beyond the MR fails the WQE and the QP.
        let wrs = vec![bind(3, new_rkey + 1, 8192)];
        assert_eq!(r.st.post_send(1, r.qpn, wrs), Resp::Unit);
        assert!(r.st.next_packet(r.qpn, now).is_none());
        let failed = cqes(&r).into_iter().find(|w| w.wr_id == 3).unwrap();
        assert_eq!(
            (failed.status, failed.opcode),
            (IBV_WC_MW_BIND_ERR, IBV_WC_BIND_MW)
        );
        assert_eq!(r.st.qps[&r.qpn].state, IBV_QPS_ERR);
        assert!(grant(&r.st, new_rkey, 256, 8).is_some());
        assert_eq!(
            r.st.request(1, 0, Req::DeallocMw { rkey: mw }, now),
            Resp::Unit
        );
        assert!(grant(&r.st, new_rkey, 256, 8).is_none());
        assert_eq!(r.st.request(1, 0, Req::DeregMr { lkey }, now), Resp::Unit);
    }

    /// UD responder: datagrams from any address; a wrong Q_Key is dropped and counted;
    /// the payload lands after a 40-byte GRH whose second half is the IPv4 header (source
    /// = the sender's address), byte_len counts the GRH; a receive too small for GRH +
    /// payload completes with LOC_LEN_ERR; with no receive posted the datagram is lost
    /// and counted; RC packets are not for UD QPs.
    /// UD multicast: only UD QPs join, and only multicast groups; a datagram to a group
    /// reaches each attached QP (the GRH names the group), none after it left; a packet to a
    /// group goes to every host of the run, charged once.
    #[test]
    fn multicast_datagrams_reach_attached_qps_and_fan_out_to_every_host() {
        let mut r = rig_typed(false, IBV_QPT_UD);
        let pid = std::process::id() as i32;
        let group = u64::from(u32::from(Ipv4Addr::new(239, 1, 1, 1)));
        let member = |r: &mut Rig, attach: bool, group: u64| {
            let req = if attach {
                Req::AttachMcast { qpn: r.qpn, group }
            } else {
                Req::DetachMcast { qpn: r.qpn, group }
            };
            r.st.request(1, pid, req, Instant::now())
        };
        assert_eq!(member(&mut r, true, 0x0a00_0001), err(libc::EINVAL));
        assert_eq!(member(&mut r, false, group), err(libc::EINVAL));
        assert_eq!(member(&mut r, true, group), Resp::Unit);
        assert_eq!(member(&mut r, true, group), Resp::Unit);
        let stranger = SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::new(10, 9, 9, 9), 4791));
        let dgram = Packet {
            op: wire::OP_UD_SEND,
            flags: wire::F_FIRST | wire::F_LAST,
            dst_qpn: wire::MCAST_QPN,
            src_qpn: PEER_QPN,
            psn: 1,
            msg_len: 3,
            rkey: UD_QKEY,
            remote_addr: group,
            payload: vec![4, 5, 6].into(),
            ..Default::default()
        };
        r.st.on_packet(stranger, dgram.clone(), Instant::now());
        let wc = cqes(&r)[0];
        assert_eq!(
            (wc.status, wc.byte_len, wc.src_qp),
            (IBV_WC_SUCCESS, 43, PEER_QPN)
        );
        assert_eq!(&r.buf[GUARD + 40..GUARD + 43], &[4, 5, 6]);
        assert_eq!(
            &r.buf[GUARD + 36..GUARD + 40],
            &[239, 1, 1, 1],
            "GRH destination"
        );
        // A group field that is no multicast address is malformed.
        let mut bad = dgram.clone();
        bad.remote_addr = 0x0a00_0001;
        r.st.on_packet(stranger, bad, Instant::now());
        assert_eq!(r.st.counters.rx_dropped_malformed, 1);
        assert_eq!(member(&mut r, false, group), Resp::Unit);
        r.st.on_packet(stranger, dgram.clone(), Instant::now());
        assert_eq!(cqes(&r).len(), 1, "nobody attached any more");
        assert_eq!(r.st.counters.rx_dropped_unknown_qp, 0);

        r.st.fabric.me = Ipv4Addr::new(10, 0, 0, 2);
        r.st.fabric.peers = vec![Ipv4Addr::new(10, 0, 0, 1), Ipv4Addr::new(10, 0, 0, 2)];
        let to = |ip: [u8; 4]| SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::from(ip), 4791));
        assert_eq!(
            r.st.fabric.fanout(to([239, 1, 1, 1])),
            vec![to([10, 0, 0, 1]), to([10, 0, 0, 2])]
        );
        assert_eq!(
            r.st.fabric.fanout(to([10, 0, 0, 1])),
            vec![to([10, 0, 0, 1])]
        );
        // An IB-style MGID's group: same delivery, no IPv4 destination in the GRH.
        let ib = device::mcast_group(&[0xff, 1, 0, 0, 0, 2, 0xc9, 0x85, 0, 0, 0, 0, 0, 0, 0, 0])
            .unwrap();
        assert_eq!(member(&mut r, true, ib), Resp::Unit);
        let mut to_ib = dgram.clone();
        to_ib.remote_addr = ib;
        r.st.on_packet(stranger, to_ib, Instant::now());
        assert_eq!(cqes(&r).len(), 2);
        assert_eq!(&r.buf[GUARD + 1024 + 36..GUARD + 1024 + 40], &[0; 4]);
        // Destroying a QP takes it out of its groups.
        assert_eq!(member(&mut r, true, group), Resp::Unit);
        r.st.remove_qp(r.qpn, Instant::now());
        assert!(r.st.mcast.is_empty());
    }

    #[test]
    fn ud_datagrams_check_the_qkey_place_a_grh_and_need_a_receive() {
        let mut r = rig_typed(false, IBV_QPT_UD);
        let stranger = SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::new(10, 9, 9, 9), 4791));
        let dgram = |qkey: u32, payload: Vec<u8>| Packet {
            op: wire::OP_UD_SEND,
            flags: wire::F_FIRST | wire::F_LAST | wire::F_IMM,
            dst_qpn: r.qpn,
            src_qpn: PEER_QPN,
            psn: 77,
            msg_len: payload.len() as u32,
            imm: 9,
            rkey: qkey,
            payload: payload.into(),
            ..Default::default()
        };
        let now = Instant::now();
        r.st.on_packet(stranger, dgram(UD_QKEY + 1, vec![1, 2, 3]), now);
        assert_eq!(r.st.counters.rx_dropped_qkey, 1);
        assert!(cqes(&r).is_empty());
        r.st.on_packet(stranger, dgram(UD_QKEY, vec![1, 2, 3]), now);
        assert_eq!(&r.buf[GUARD + 40..GUARD + 43], &[1, 2, 3]);
        assert_eq!(
            r.buf[GUARD + 20],
            0x45,
            "IPv4 header in the GRH's second half"
        );
        assert_eq!(&r.buf[GUARD + 32..GUARD + 36], &[10, 9, 9, 9]);
        let wc = cqes(&r)[0];
        assert_eq!(
            (wc.wr_id, wc.status, wc.byte_len, wc.src_qp, wc.imm_data),
            (100, IBV_WC_SUCCESS, 43, PEER_QPN, 9)
        );
        assert_eq!(wc.wc_flags, IBV_WC_GRH | IBV_WC_WITH_IMM);
        assert_eq!(
            wc.sl & 7,
            2,
            "the packet type of an IPv4 datagram, where UCX looks for its GID"
        );
        // 1024-byte receives: 985 bytes + GRH do not fit.
        r.st.on_packet(stranger, dgram(UD_QKEY, vec![7; 985]), now);
        assert_eq!(
            (cqes(&r)[1].wr_id, cqes(&r)[1].status),
            (101, IBV_WC_LOC_LEN_ERR)
        );
        r.st.on_packet(stranger, dgram(UD_QKEY, vec![7; 984]), now);
        r.st.on_packet(stranger, dgram(UD_QKEY, vec![8; 1]), now);
        assert_eq!(cqes(&r).len(), 4);
        r.st.on_packet(stranger, dgram(UD_QKEY, vec![9; 1]), now);
        assert_eq!(r.st.counters.rx_dropped_no_recv, 1);
        let mut rc = dgram(UD_QKEY, vec![1]);
        rc.op = wire::OP_SEND;
        let before = r.st.counters.rx_dropped_unknown_qp;
        r.st.on_packet(stranger, rc, now);
        assert_eq!(r.st.counters.rx_dropped_unknown_qp, before + 1);
        assert!(r.st.fabric.out.is_empty(), "UD never answers");
    }

    /// UD requester: each SEND is one datagram to the address from its address handle
    /// (QPN and Q_Key from the WR; a Q_Key with the high bit set means the QP's own),
    /// completed once sent; a message above the port MTU completes with LOC_LEN_ERR;
    /// RDMA operations are refused on UD at post time.
    #[test]
    fn ud_sends_are_single_datagrams_completed_when_sent() {
        let mut r = rig_typed(false, IBV_QPT_UD);
        let wr = |id: u64, opcode: i32, len: u32| SendWr {
            wr_id: id,
            opcode,
            flags: IBV_SEND_SIGNALED,
            remote_addr: u32::from(Ipv4Addr::new(10, 77, 0, 2)) as u64,
            rkey: 0x99,
            compare_add: 0x8000_0000,
            sges: vec![Sge {
                addr: r.mr_addr,
                length: len,
                lkey: r.lkey,
            }],
            ..Default::default()
        };
        let read = wr(1, IBV_WR_RDMA_READ, 8);
        assert!(matches!(
            r.st.post_send(1, r.qpn, vec![read]),
            Resp::Err {
                errno: libc::EINVAL,
                ..
            }
        ));
        let wrs = vec![wr(2, IBV_WR_SEND, 100), wr(3, IBV_WR_SEND, 8000)];
        assert_eq!(r.st.post_send(1, r.qpn, wrs), Resp::Unit);
        let now = Instant::now();
        let (dst, p) = r.st.next_packet(r.qpn, now).expect("datagram");
        assert_eq!(dst.to_string(), "10.77.0.2:4791");
        assert_eq!(
            (p.op, p.dst_qpn, p.src_qpn, p.rkey, p.payload.len()),
            (wire::OP_UD_SEND, 0x99, r.qpn, UD_QKEY, 100)
        );
        assert_eq!(
            (cqes(&r)[0].wr_id, cqes(&r)[0].status, cqes(&r)[0].opcode),
            (2, IBV_WC_SUCCESS, IBV_WC_SEND)
        );
        assert!(r.st.next_packet(r.qpn, now).is_none());
        assert_eq!(
            (cqes(&r)[1].wr_id, cqes(&r)[1].status),
            (3, IBV_WC_LOC_LEN_ERR)
        );
    }

    /// A UD QP destroyed right after posting (before the transmitter ran) still sends its
    /// datagrams, to a multicast group to every host, as a NIC would long have.
    #[test]
    fn a_destroyed_ud_qp_sends_what_was_posted_first() {
        let mut r = rig_typed(false, IBV_QPT_UD);
        r.st.fabric.peers = vec![Ipv4Addr::new(10, 0, 0, 1), Ipv4Addr::new(10, 0, 0, 2)];
        r.st.fabric.me = Ipv4Addr::new(10, 0, 0, 1);
        let group = u32::from(Ipv4Addr::new(239, 1, 1, 1));
        let wrs = (0..3)
            .map(|i| SendWr {
                wr_id: i,
                opcode: IBV_WR_SEND,
                remote_addr: u64::from(group),
                rkey: wire::MCAST_QPN,
                compare_add: 0x8000_0000,
                sges: vec![Sge {
                    addr: r.mr_addr,
                    length: 16,
                    lkey: r.lkey,
                }],
                ..Default::default()
            })
            .collect();
        assert_eq!(r.st.post_send(1, r.qpn, wrs), Resp::Unit);
        assert!(r.st.fabric.out.is_empty());
        r.st.remove_qp(r.qpn, Instant::now());
        assert_eq!(r.st.fabric.out.len(), 6, "3 datagrams to 2 hosts");
        for (_, p) in &r.st.fabric.out {
            assert_eq!(
                (p.dst_qpn, p.remote_addr),
                (wire::MCAST_QPN, u64::from(group))
            );
        }
    }

    /// UC responder: no acknowledgements at all; a lost packet (a PSN gap) drops the rest
    /// of its message without a completion; the next message's first packet resynchronises
    /// and gets the receive the broken one had taken; a duplicate is not applied twice.
    /// UC requester: a message completes when its last packet is sent, nothing stays in
    /// flight, RDMA READ is refused.
    #[test]
    fn uc_loss_drops_the_message_and_the_next_one_resynchronises() {
        let mut r = rig_typed(false, IBV_QPT_UC);
        let pkt = |op: u8, flags: u8, psn: u32, len: u32, off: u32, payload: Vec<u8>| Packet {
            op,
            flags,
            dst_qpn: r.qpn,
            src_qpn: PEER_QPN,
            psn,
            msg_len: len,
            offset: off,
            remote_addr: r.mr_addr + 6000,
            rkey: r.rkey,
            payload: payload.into(),
            ..Default::default()
        };
        let now = Instant::now();
        let (f, l) = (wire::F_FIRST, wire::F_LAST);
        r.st.on_packet(
            r.peer,
            pkt(wire::OP_SEND, f, 1000, 600, 0, vec![1; 256]),
            now,
        );
        // PSN 1001 is lost.
        r.st.on_packet(
            r.peer,
            pkt(wire::OP_SEND, l, 1002, 600, 512, vec![3; 88]),
            now,
        );
        assert_eq!(r.st.counters.rx_uc_broken, 1);
        assert!(cqes(&r).is_empty());
        let next = pkt(wire::OP_SEND, f | l, 1003, 5, 0, vec![5; 5]);
        r.st.on_packet(r.peer, next.clone(), now);
        let wc = cqes(&r)[0];
        assert_eq!((wc.wr_id, wc.status, wc.byte_len), (100, IBV_WC_SUCCESS, 5));
        assert_eq!(&r.buf[GUARD..GUARD + 6], &[5, 5, 5, 5, 5, 1]);
        r.st.on_packet(r.peer, next, now);
        assert_eq!(r.st.counters.rx_duplicate, 1);
        assert_eq!(cqes(&r).len(), 1);
        r.st.on_packet(
            r.peer,
            pkt(wire::OP_WRITE, f | l, 1004, 2, 0, vec![6, 6]),
            now,
        );
        assert_eq!(&r.buf[GUARD + 6000..GUARD + 6002], &[6, 6]);
        assert!(r.st.fabric.out.is_empty(), "UC never acknowledges");

        let mr = (r.mr_addr, r.lkey);
        let wr = |id: u64, opcode: i32, len: u32| rig_wr(mr, id, opcode, 0, len);
        let read = wr(1, IBV_WR_RDMA_READ, 8);
        assert!(matches!(
            r.st.post_send(1, r.qpn, vec![read]),
            Resp::Err {
                errno: libc::EINVAL,
                ..
            }
        ));
        let write = wr(2, IBV_WR_RDMA_WRITE, 600);
        assert_eq!(r.st.post_send(1, r.qpn, vec![write]), Resp::Unit);
        for _ in 0..3 {
            assert!(r.st.next_packet(r.qpn, now).is_some());
        }
        assert!(r.st.next_packet(r.qpn, now).is_none());
        assert!(r.st.qps[&r.qpn].req.inflight.is_empty());
        let wc = cqes(&r)[1];
        assert_eq!(
            (wc.wr_id, wc.status, wc.opcode),
            (2, IBV_WC_SUCCESS, IBV_WC_RDMA_WRITE)
        );
    }

    /// Requester: the retransmission timeout is the QP's (4.096 µs·2^timeout, at least
    /// 5 ms), stretched by the NIC's time scale and at most 2 s. Undilated on a NIC dilated
    /// 200×, perftest's 67 ms fired while ACKs were still queued behind a shared line.
    #[test]
    fn the_retransmission_timeout_is_dilated_with_the_nic() {
        let resent_after = |time_scale: f64, wait_ms: u64| {
            let mut r = rig_with(false);
            r.st.nic.cfg.time_scale = time_scale;
            r.st.qps.get_mut(&r.qpn).unwrap().attr.timeout = 14;
            let write = rig_wr((r.mr_addr, r.lkey), 1, IBV_WR_RDMA_WRITE, 0, 8);
            assert_eq!(r.st.post_send(1, r.qpn, vec![write]), Resp::Unit);
            let now = Instant::now();
            assert!(r.st.next_packet(r.qpn, now).is_some());
            let later = now + Duration::from_millis(wait_ms);
            r.st.timers(later);
            r.st.next_packet(r.qpn, later).is_some()
        };
        assert!(!resent_after(1.0, 60), "within 67 ms");
        assert!(resent_after(1.0, 70), "past 67 ms");
        // Dilated 200×: 13.4 s, held to 2 s.
        assert!(!resent_after(200.0, 1_900));
        assert!(resent_after(200.0, 2_100));
        // Dilated 2×: 134 ms.
        assert!(!resent_after(2.0, 120));
        assert!(resent_after(2.0, 140));
    }

    /// The retransmission timer starts with the first packet sent after an idle spell, not
    /// at the last acknowledgement before it: a QP idle for longer than its timeout does not
    /// resend what it has just sent.
    #[test]
    fn a_qp_idle_past_its_timeout_does_not_resend_its_next_packet() {
        let mut r = rig_with(false);
        r.st.qps.get_mut(&r.qpn).unwrap().attr.timeout = 14; // 67 ms
        let idle_since = Instant::now();
        r.st.qps.get_mut(&r.qpn).unwrap().req.last_progress = idle_since;
        let write = rig_wr((r.mr_addr, r.lkey), 1, IBV_WR_RDMA_WRITE, 0, 8);
        assert_eq!(r.st.post_send(1, r.qpn, vec![write]), Resp::Unit);
        let sent = idle_since + Duration::from_secs(5);
        assert!(r.st.next_packet(r.qpn, sent).is_some());
        let soon = sent + Duration::from_millis(1);
        r.st.timers(soon);
        assert!(
            r.st.next_packet(r.qpn, soon).is_none(),
            "resent 1 ms after it was sent"
        );
        assert_eq!(r.st.counters.retransmits, 0);
        let late = sent + Duration::from_millis(70);
        r.st.timers(late);
        assert!(
            r.st.next_packet(r.qpn, late).is_some(),
            "unacknowledged past 67 ms"
        );
    }

    /// Requester: when the response to an atomic is lost and later ones are answered, no
    /// further atomics are issued past `max_rd_atomic` (the early-answered ones count until
    /// they complete in order), so the retransmission of the lost one still finds its
    /// result in the responder's cache; the resent request's response completes all of
    /// them in order with their own values.
    #[test]
    fn an_early_response_does_not_let_atomics_run_past_a_lost_one() {
        let mut r = rig_with(false);
        r.st.qps.get_mut(&r.qpn).unwrap().attr.max_rd_atomic = 2;
        let mr = (r.mr_addr, r.lkey);
        let wr = |id: u64| SendWr {
            compare_add: 1,
            ..rig_wr(mr, id, IBV_WR_ATOMIC_FETCH_AND_ADD, 8 * id, 8)
        };
        assert_eq!(
            r.st.post_send(1, r.qpn, (0..4).map(wr).collect()),
            Resp::Unit
        );
        let now = Instant::now();
        assert!(r.st.next_packet(r.qpn, now).is_some());
        assert!(r.st.next_packet(r.qpn, now).is_some());
        assert!(r.st.next_packet(r.qpn, now).is_none(), "limit 2");
        let resp = |psn: u32, v: u64| Packet {
            op: wire::OP_ATOMIC_RESP,
            flags: wire::F_FIRST | wire::F_LAST,
            dst_qpn: r.qpn,
            src_qpn: PEER_QPN,
            psn,
            msg_len: 8,
            payload: v.to_le_bytes().to_vec().into(),
            ..Default::default()
        };
        // The response to PSN 5000 is lost; 5001's arrives.
        r.st.on_packet(r.peer, resp(5001, 41), now);
        assert!(cqes(&r).is_empty(), "completions stay in order");
        assert!(
            r.st.next_packet(r.qpn, now).is_none(),
            "no atomic past the lost one"
        );
        // Timeout: the lost one is resent and answered (from the responder's cache).
        let later = now + Duration::from_secs(3);
        r.st.timers(later);
        let (_, p) = r.st.next_packet(r.qpn, later).expect("retransmission");
        assert_eq!(p.psn, 5000);
        r.st.on_packet(r.peer, resp(5000, 40), later);
        let done: Vec<(u64, u64)> = cqes(&r)
            .iter()
            .map(|c| (c.wr_id, word(&r, 8 * c.wr_id as usize)))
            .collect();
        assert_eq!(done, vec![(0, 40), (1, 41)]);
        assert!(
            r.st.next_packet(r.qpn, later).is_some(),
            "the next atomics go"
        );
    }

    /// The rig is live: an in-order WRITE from the peer lands in the MR and is ACKed, a
    /// replay of it is only re-ACKed, and the same WRITE from a stranger is dropped.
    #[test]
    fn rig_accepts_valid_packets_and_counts_replays_and_strangers() {
        let mut r = rig();
        let w = Packet {
            op: wire::OP_WRITE,
            flags: wire::F_FIRST | wire::F_LAST | wire::F_ACKREQ,
            dst_qpn: r.qpn,
            src_qpn: PEER_QPN,
            psn: 1000,
            msg_len: 3,
            remote_addr: r.mr_addr + 10,
            rkey: r.rkey,
            payload: vec![1, 2, 3].into(),
            ..Default::default()
        };
        let now = Instant::now();
        r.st.on_packet(r.peer, w.clone(), now);
        assert_eq!(&r.buf[GUARD + 10..GUARD + 13], &[1, 2, 3]);
        assert_eq!(r.st.fabric.out.len(), 1, "ACKed");
        let mut replay = w.clone();
        replay.payload = vec![9, 9, 9].into();
        r.st.on_packet(r.peer, replay, now);
        assert_eq!(
            &r.buf[GUARD + 10..GUARD + 13],
            &[1, 2, 3],
            "replay not applied"
        );
        assert_eq!(r.st.counters.rx_duplicate, 1);
        let stranger = SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::new(10, 9, 9, 9), 4791));
        let mut next = w;
        next.psn = 1001;
        next.payload = vec![7, 7, 7].into();
        r.st.on_packet(stranger, next, now);
        assert_eq!(&r.buf[GUARD + 10..GUARD + 13], &[1, 2, 3]);
        assert_eq!(r.st.counters.rx_dropped_unknown_qp, 1);
    }

    /// A signalled work request towards the peer's 0x10_0000 (R_Key 9), from `len` bytes at
    /// `off` in the MR `(address, L_Key)` (the rig's: `(r.mr_addr, r.lkey)`).
    fn rig_wr(mr: (u64, u32), id: u64, opcode: i32, off: u64, len: u32) -> SendWr {
        SendWr {
            wr_id: id,
            opcode,
            flags: IBV_SEND_SIGNALED,
            remote_addr: 0x10_0000,
            rkey: 9,
            sges: vec![Sge {
                addr: mr.0 + off,
                length: len,
                lkey: mr.1,
            }],
            ..Default::default()
        }
    }

    /// A request from the rig's peer to its QP, with the rig's R_Key.
    fn from_peer(r: &Rig, op: u8, flags: u8, psn: u32) -> Packet {
        Packet {
            op,
            flags,
            dst_qpn: r.qpn,
            src_qpn: PEER_QPN,
            psn,
            rkey: r.rkey,
            ..Default::default()
        }
    }

    /// Packet `i` (0, 1, 2) of a 3-packet message of `op` from the peer starting at `psn`,
    /// 4 bytes each (bytes `i + 1`), to `addr` for a WRITE.
    fn part(r: &Rig, op: u8, psn: u32, i: u32, addr: u64) -> Packet {
        let flags = match i {
            0 => wire::F_FIRST,
            2 => wire::F_LAST | wire::F_ACKREQ,
            _ => 0,
        };
        Packet {
            msg_len: 12,
            offset: 4 * i,
            remote_addr: addr,
            payload: vec![i as u8 + 1; 4].into(),
            ..from_peer(r, op, flags, psn + i)
        }
    }

    /// One packet of a 3-packet WRITE at PSN 1000.
    fn write_part(r: &Rig, i: u32, addr: u64) -> Packet {
        part(r, wire::OP_WRITE, 1000, i, addr)
    }

    /// The packets of a WRITE are placed with one cross-process write, at the last packet
    /// and before its ACK leaves; a packet of another kind places what was gathered before
    /// it is handled.
    #[test]
    fn write_packets_are_placed_together_before_anything_can_see_them() {
        let mut r = rig();
        let now = Instant::now();
        let at = r.mr_addr + 100;
        r.st.on_packet(r.peer, write_part(&r, 0, at), now);
        r.st.on_packet(r.peer, write_part(&r, 1, at), now);
        assert_eq!(
            &r.buf[GUARD + 100..GUARD + 108],
            &[0xa5; 8],
            "gathered, not placed"
        );
        assert!(r.st.fabric.out.is_empty());
        r.st.on_packet(r.peer, write_part(&r, 2, at), now);
        assert_eq!(
            &r.buf[GUARD + 100..GUARD + 112],
            &[1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3]
        );
        assert_eq!(r.st.counters.rx_placements, 1);
        let ack = r.st.fabric.out[0].1.clone();
        assert_eq!((ack.op, ack.psn), (wire::OP_ACK, 1002));

        // A WRITE's first packet, then a READ of its bytes: the READ is answered with them.
        let mut w = write_part(&r, 0, r.mr_addr + 200);
        w.psn = 1003;
        r.st.on_packet(r.peer, w, now);
        let only = wire::F_FIRST | wire::F_LAST | wire::F_ACKREQ;
        let read = Packet {
            msg_len: 4,
            remote_addr: r.mr_addr + 200,
            ..from_peer(&r, wire::OP_READ_REQ, only, 1004)
        };
        r.st.on_packet(r.peer, read, now);
        assert_eq!(&r.buf[GUARD + 200..GUARD + 204], &[1; 4]);
        assert_eq!(r.st.counters.rx_placements, 2);
    }

    /// The packets of a SEND are placed into its receive with one cross-process write, at
    /// the last packet, before the receive completes.
    #[test]
    fn send_packets_are_placed_together_before_the_receive_completes() {
        let mut r = rig();
        let now = Instant::now();
        for i in 0..3u32 {
            let p = part(&r, wire::OP_SEND, 1000, i, 0);
            r.st.on_packet(r.peer, p, now);
            if i < 2 {
                assert_eq!(&r.buf[GUARD..GUARD + 8], &[0xa5; 8], "gathered, not placed");
                assert!(cqes(&r).is_empty());
            }
        }
        assert_eq!(
            &r.buf[GUARD..GUARD + 13],
            &[1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 0xa5]
        );
        assert_eq!(r.st.counters.rx_placements, 1);
        let wc = cqes(&r)[0];
        assert_eq!(
            (wc.wr_id, wc.status, wc.opcode, wc.byte_len),
            (100, IBV_WC_SUCCESS, IBV_WC_RECV, 12)
        );
    }

    /// The responses to a READ are placed into its buffer with one cross-process write, at
    /// the last response, before the READ completes.
    #[test]
    fn read_responses_are_placed_together_before_the_read_completes() {
        let mut r = rig_with(false);
        let mr = (r.mr_addr, r.lkey);
        let read = rig_wr(mr, 1, IBV_WR_RDMA_READ, 300, 12);
        assert_eq!(r.st.post_send(1, r.qpn, vec![read]), Resp::Unit);
        r.st.qps.get_mut(&r.qpn).unwrap().mtu = 4;
        let now = Instant::now();
        let (_, p) = r.st.next_packet(r.qpn, now).expect("the READ request");
        assert_eq!(p.op, wire::OP_READ_REQ);
        for i in 0..3u32 {
            let resp = part(&r, wire::OP_READ_RESP, 5000, i, 0);
            r.st.on_packet(r.peer, resp, now);
            if i < 2 {
                assert_eq!(
                    &r.buf[GUARD + 300..GUARD + 308],
                    &[0xa5; 8],
                    "not placed yet"
                );
                assert!(r.st.cqs[&r.cq].q.is_empty());
            }
        }
        assert_eq!(
            &r.buf[GUARD + 300..GUARD + 312],
            &[1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3]
        );
        assert_eq!(r.st.counters.rx_placements, 1);
        let wc = r.st.cqs[&r.cq].q.back().copied().expect("completion");
        assert_eq!(
            (wc.wr_id, wc.status, wc.opcode, wc.byte_len),
            (1, IBV_WC_SUCCESS, IBV_WC_RDMA_READ, 12)
        );
    }

    /// A READ response lost on the way: the next one asks for the rest of the READ at once
    /// (PSN, remote address and length advanced), and the rest is placed where its PSN
    /// says, whatever offset the responder's packets carry.
    #[test]
    fn a_lost_read_response_asks_for_the_rest_at_once() {
        let mut r = rig_with(false);
        let mr = (r.mr_addr, r.lkey);
        let mut read = rig_wr(mr, 1, IBV_WR_RDMA_READ, 300, 12);
        read.remote_addr = 0x7000;
        assert_eq!(r.st.post_send(1, r.qpn, vec![read]), Resp::Unit);
        r.st.qps.get_mut(&r.qpn).unwrap().mtu = 4;
        let now = Instant::now();
        r.st.next_packet(r.qpn, now).expect("the READ request");
        r.st.on_packet(r.peer, part(&r, wire::OP_READ_RESP, 5000, 0, 0), now);
        r.st.fabric.out.clear();
        // The second response is lost; the third shows it.
        r.st.on_packet(r.peer, part(&r, wire::OP_READ_RESP, 5000, 2, 0), now);
        assert_eq!(r.st.fabric.out.len(), 1, "one request for the rest");
        let again = r.st.fabric.out.remove(0).1;
        assert_eq!(
            (again.op, again.psn, again.remote_addr, again.msg_len),
            (wire::OP_READ_REQ, 5001, 0x7004, 8)
        );
        assert_eq!(r.st.counters.read_requests_again, 1);
        // The responder answers the rest as a READ of its own: offsets from 0.
        for i in 1..3u32 {
            let resp = Packet {
                offset: 4 * (i - 1),
                msg_len: 8,
                ..part(&r, wire::OP_READ_RESP, 5000, i, 0)
            };
            r.st.on_packet(r.peer, resp, now);
        }
        assert_eq!(
            &r.buf[GUARD + 300..GUARD + 312],
            &[1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3]
        );
        let wc = r.st.cqs[&r.cq].q.back().copied().expect("completion");
        assert_eq!((wc.wr_id, wc.status, wc.byte_len), (1, IBV_WC_SUCCESS, 12));
    }

    /// Gathered data whose target turns out to be unmapped (the application unmapped
    /// registered memory) fails its message as a per-packet write did: the responder NAKs
    /// the first packet gathered with a remote access error and its QP goes to error.
    #[test]
    fn a_gathered_write_to_unmapped_memory_naks_its_message() {
        let mut r = rig();
        let page = 4096usize;
        // SAFETY: a fresh anonymous mapping of two pages, unmapped in halves below.
        let m = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                2 * page,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(m, libc::MAP_FAILED);
        let pid = std::process::id() as i32;
        let pd = r.st.qps[&r.qpn].pd;
        let Resp::Mr { rkey, .. } = r.st.request(
            1,
            pid,
            Req::RegMr {
                pd,
                addr: m as u64,
                len: 2 * page as u64,
                access: IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE,
            },
            Instant::now(),
        ) else {
            panic!("registering the mapping")
        };
        assert_eq!(
            // SAFETY: the second page of the mapping made above; nothing refers to it.
            unsafe { libc::munmap(m.cast::<u8>().add(page).cast(), page) },
            0
        );
        r.rkey = rkey;
        let now = Instant::now();
        let mut first = write_part(&r, 0, m as u64 + page as u64);
        first.rkey = rkey;
        r.st.on_packet(r.peer, first, now);
        // Any other packet places what was gathered: here a duplicate SEND.
        let dup = Packet {
            msg_len: 1,
            payload: vec![0].into(),
            ..from_peer(&r, wire::OP_SEND, wire::F_FIRST | wire::F_LAST, 999)
        };
        r.st.on_packet(r.peer, dup, now);
        let nak = r.st.fabric.out[0].1.clone();
        assert_eq!(
            (nak.op, nak.syndrome, nak.psn),
            (wire::OP_NAK, wire::NAK_REM_ACCESS, 1000)
        );
        assert_eq!(r.st.qps[&r.qpn].state, IBV_QPS_ERR);
        // SAFETY: the first page, still mapped.
        unsafe { libc::munmap(m, page) };
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 300, ..ProptestConfig::default() })]

        #[test]
        fn hostile_packets_never_panic_or_escape_the_mr(
            pkts in proptest::collection::vec(hostile(), 1..40),
            qpt in prop_oneof![Just(IBV_QPT_RC), Just(IBV_QPT_UC), Just(IBV_QPT_UD)],
        ) {
            let mut r = rig_typed(true, qpt);
            let t0 = Instant::now();
            for (i, (who, mut p)) in pkts.into_iter().enumerate() {
                // Mostly the QP from its peer; sometimes a stranger or another QPN.
                if who != 0 {
                    p.dst_qpn = r.qpn;
                }
                if p.remote_addr < 13000 {
                    p.remote_addr = r.mr_addr.wrapping_add(p.remote_addr).wrapping_sub(5000);
                }
                if p.rkey == 0 {
                    p.rkey = r.rkey;
                }
                // On UD, every other datagram is well formed with the right Q_Key, so
                // that placement (GRH, receive sizes) is exercised too.
                if qpt == IBV_QPT_UD && i % 2 == 0 {
                    p.op = wire::OP_UD_SEND;
                    p.flags |= wire::F_FIRST | wire::F_LAST;
                    p.msg_len = p.payload.len() as u32;
                    p.rkey = UD_QKEY;
                }
                let from = if who == 1 {
                    SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::new(10, 9, 9, 9), 4791))
                } else {
                    r.peer
                };
                // Through the wire format, as the receive thread sees it.
                let b = p.encode();
                let p = Packet::decode(&b).expect("valid encoding");
                let now = t0 + Duration::from_millis(i as u64 * 30);
                r.st.on_packet(from, p, now);
                r.st.timers(now);
                for _ in 0..4 {
                    let _ = r.st.next_packet(r.qpn, now);
                }
                r.st.fabric.out.clear();
            }
            prop_assert!(r.buf[..GUARD].iter().all(|&b| b == 0xa5), "front guard written");
            prop_assert!(
                r.buf[GUARD + MR_LEN..].iter().all(|&b| b == 0xa5),
                "back guard written"
            );
        }
    }
}

/// Device memory is the host's, shared by its processes: reservations beyond what is left
/// fail with ENOMEM, only the owner frees one, and a process that goes returns its share.
#[test]
fn device_memory_is_reserved_from_the_hosts_capacity() {
    let mut st = State::new();
    let pid = std::process::id() as i32;
    let dm =
        |st: &mut State, conn, len| st.request(conn, pid, Req::AllocDm { len }, Instant::now());
    let Resp::Handle(a) = dm(&mut st, 1, device::MAX_DM_SIZE - 4096) else {
        panic!()
    };
    assert_eq!(dm(&mut st, 2, 8192), err(libc::ENOMEM));
    assert_eq!(dm(&mut st, 2, 0), err(libc::EINVAL));
    assert!(matches!(dm(&mut st, 2, 4096), Resp::Handle(_)));
    assert_eq!(dm(&mut st, 2, 1), err(libc::ENOMEM));
    assert_eq!(
        st.request(2, pid, Req::FreeDm { handle: a }, Instant::now()),
        err(libc::EINVAL),
        "not its own"
    );
    st.drop_conn(1, Instant::now());
    assert!(matches!(dm(&mut st, 3, 8192), Resp::Handle(_)));
    assert_eq!(
        st.request(1, pid, Req::FreeDm { handle: a }, Instant::now()),
        err(libc::EINVAL)
    );
}

/// Packet pacing: a QP given a rate (`IBV_QP_RATE_LIMIT` in RTS) is passed over until its
/// pacer allows its next packet, while an unpaced QP takes the line; `pace_wake` says when
/// the paced one is due. Out-of-range rates, and `ibv_modify_qp_rate_limit` outside RTS, on
/// another process's QP or with a burst but no rate, are refused.
#[test]
fn a_paced_qp_sends_at_its_rate_and_others_are_not_held_up() {
    let (mut st, qpns, _buf) = nic_rig(NicConfig::default(), 2, 2);
    let (paced, free) = (qpns[0], qpns[1]);
    let rate = |kbps| QpAttrs {
        qp_state: IBV_QPS_RTS,
        rate_limit: kbps,
        ..Default::default()
    };
    let m = IBV_QP_STATE | IBV_QP_RATE_LIMIT;
    assert_eq!(
        st.modify_qp(
            paced,
            m,
            &rate(device::PP_RATE_MAX_KBPS + 1),
            Instant::now()
        ),
        Err(libc::EINVAL)
    );
    // 1,000 kb/s: a 256-byte packet (+ 48 header + 42 overhead bytes) takes 2.768 ms.
    st.modify_qp(paced, m, &rate(1_000), Instant::now())
        .unwrap();
    let t0 = Instant::now();
    let order: Vec<u32> = std::iter::from_fn(|| st.tx_one(t0)).collect();
    assert_eq!(
        order.iter().filter(|q| **q == paced).count(),
        1,
        "{order:?}"
    );
    assert_eq!(order.iter().filter(|q| **q == free).count(), 6, "{order:?}");
    let due = st.pace_wake.expect("the paced QP is due later");
    assert_eq!(
        due - t0,
        Duration::from_nanos((256 + 48 + 42) * 8_000_000 / 1_000)
    );
    assert_eq!(st.tx_one(due - Duration::from_micros(1)), None);
    assert_eq!(st.tx_one(due), Some(paced));
    // Rate 0 lifts the limit: the rest goes at once.
    st.modify_qp(paced, m, &rate(0), Instant::now()).unwrap();
    let rest: Vec<u32> = std::iter::from_fn(|| st.tx_one(due)).collect();
    assert_eq!(rest, vec![paced; 4]);
    // ibv_modify_qp_rate_limit: the QP's owner, in RTS, a burst only with a rate.
    let pid = std::process::id() as i32;
    let rl = |kbps, max_burst| Req::RateLimit {
        qpn: paced,
        kbps,
        max_burst,
    };
    assert_eq!(
        st.request(1, pid, rl(8_000, 4_096), Instant::now()),
        Resp::Unit
    );
    assert!(st.qps[&paced].pacer.is_some());
    assert_eq!(
        st.request(2, pid, rl(8_000, 0), Instant::now()),
        err(libc::EINVAL)
    );
    assert_eq!(
        st.request(1, pid, rl(0, 4_096), Instant::now()),
        err(libc::EINVAL)
    );
    assert_eq!(st.request(1, pid, rl(0, 0), Instant::now()), Resp::Unit);
    assert!(st.qps[&paced].pacer.is_none());
    let to_err = QpAttrs {
        qp_state: IBV_QPS_ERR,
        ..Default::default()
    };
    st.modify_qp(paced, IBV_QP_STATE, &to_err, Instant::now())
        .unwrap();
    assert_eq!(
        st.request(1, pid, rl(8_000, 0), Instant::now()),
        err(libc::EINVAL),
        "not in RTS"
    );
}

/// Takes `qpn` through INIT and RTR (to a peer on this host) to RTS, with `a`'s access
/// flags, path MTU, destination QP and read/atomic depths.
fn to_rts(st: &mut State, qpn: u32, mut a: QpAttrs) {
    a.qp_state = IBV_QPS_INIT;
    a.port_num = 1;
    let init = IBV_QP_STATE | IBV_QP_PORT | IBV_QP_PKEY_INDEX | IBV_QP_ACCESS_FLAGS;
    st.modify_qp(qpn, init, &a, Instant::now()).unwrap();
    a.qp_state = IBV_QPS_RTR;
    a.is_global = 1;
    a.dgid = device::gid_for(Ipv4Addr::LOCALHOST);
    let rtr = IBV_QP_STATE
        | IBV_QP_AV
        | IBV_QP_PATH_MTU
        | IBV_QP_DEST_QPN
        | IBV_QP_RQ_PSN
        | IBV_QP_MAX_DEST_RD_ATOMIC
        | IBV_QP_MIN_RNR_TIMER;
    st.modify_qp(qpn, rtr, &a, Instant::now()).unwrap();
    a.qp_state = IBV_QPS_RTS;
    a.timeout = 14;
    let rts = IBV_QP_STATE
        | IBV_QP_TIMEOUT
        | IBV_QP_RETRY_CNT
        | IBV_QP_RNR_RETRY
        | IBV_QP_SQ_PSN
        | IBV_QP_MAX_QP_RD_ATOMIC;
    st.modify_qp(qpn, rts, &a, Instant::now()).unwrap();
}

/// Two RC QPs of one engine connected to each other (256-byte path MTU), on one PD, CQ and
/// a 64 KiB MR in `buf` (remote access allowed), the second with a 1 KiB receive posted at
/// 16 KiB. Returns the state, the QPs and the MR's keys; packets between the QPs go to
/// the engine's own address ([`loopback_addr`]).
fn loopback_pair(buf: &mut [u8]) -> (State, [u32; 2], (u32, u32)) {
    let mut st = State::new();
    let pid = std::process::id() as i32;
    let Resp::Handle(pd) = st.request(1, pid, Req::AllocPd, Instant::now()) else {
        panic!()
    };
    let addr = buf.as_mut_ptr() as u64;
    let access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
    let mr = Req::RegMr {
        pd,
        addr,
        len: buf.len() as u64,
        access,
    };
    let Resp::Mr { lkey, rkey, .. } = st.request(1, pid, mr, Instant::now()) else {
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
    let mut qpns = [0; 2];
    for q in &mut qpns {
        let Resp::Qp { qpn, .. } = st.request(1, pid, create.clone(), Instant::now()) else {
            panic!()
        };
        *q = qpn;
    }
    for (me, peer) in [(qpns[0], qpns[1]), (qpns[1], qpns[0])] {
        let a = QpAttrs {
            access_flags: IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ,
            path_mtu: 1,
            dest_qp_num: peer,
            max_dest_rd_atomic: 4,
            max_rd_atomic: 4,
            ..Default::default()
        };
        to_rts(&mut st, me, a);
    }
    let recv = RecvWr {
        wr_id: 77,
        sges: vec![Sge {
            addr: addr + (16 << 10),
            length: 1024,
            lkey,
        }],
    };
    assert_eq!(st.post_recv(1, qpns[1], vec![recv]), Resp::Unit);
    (st, qpns, (lkey, rkey))
}

/// The address of the engine the QPs of [`loopback_pair`] talk to: its own.
fn loopback_addr() -> SocketAddr {
    SocketAddr::V4(SocketAddrV4::new(
        Ipv4Addr::LOCALHOST,
        device::ENGINE_UDP_PORT,
    ))
}

/// NIC loopback hands packets over as they are: a WRITE, a SEND and a READ between two QPs
/// of one engine land where they should and complete; every packet (data, READ request and
/// responses, ACKs) is counted as sent and received once, looked up in the QP-context
/// cache, and none reaches the socket; each message is placed with one cross-process write
/// whose bytes are the requester's staged message bytes themselves, never copied.
#[test]
fn looped_back_packets_place_the_staged_bytes_and_count_as_before() {
    let mut buf: Vec<u8> = (0..64u32 << 10).map(|i| (i % 251) as u8).collect();
    let (mut st, [a, b], (lkey, rkey)) = loopback_pair(&mut buf);
    let base = buf.as_ptr() as u64;
    let wr = |id: u64, opcode: i32, from: u64, to: u64, len: u32| SendWr {
        wr_id: id,
        opcode,
        flags: IBV_SEND_SIGNALED,
        remote_addr: base + to,
        rkey,
        sges: vec![Sge {
            addr: base + from,
            length: len,
            lkey,
        }],
        ..Default::default()
    };
    let wrs = vec![
        wr(1, IBV_WR_RDMA_WRITE, 0, 8 << 10, 700),
        wr(2, IBV_WR_SEND, 1024, 0, 600),
        wr(3, IBV_WR_RDMA_READ, 32 << 10, 24 << 10, 700),
    ];
    assert_eq!(st.post_send(1, a, wrs), Resp::Unit);
    let now = Instant::now();
    // The WRITE's first packet carries a slice of the staged message bytes.
    assert_eq!(st.tx_one(now), Some(a));
    let staged = st.qps[&a].req.sq[0].staged.as_ptr();
    assert_eq!(st.fabric.out[0].1.payload.as_ptr(), staged, "not a copy");
    // As the transmitter runs: a burst of packets, then the loopback takes what is local.
    let me = loopback_addr();
    loop {
        while st.tx_one(now).is_some() {}
        if st.fabric.out.is_empty() {
            break;
        }
        st.loop_back(me, now);
    }
    assert!(st.fabric.out.is_empty(), "nothing for the socket");
    let at = |off: usize, len: usize| buf[off..off + len].to_vec();
    assert_eq!(at(8 << 10, 700), at(0, 700), "WRITE");
    assert_eq!(at(16 << 10, 600), at(1024, 600), "SEND");
    assert_eq!(at(32 << 10, 700), at(24 << 10, 700), "READ");
    let wcs: Vec<_> = st.cqs.values().flat_map(|c| c.q.iter().copied()).collect();
    let got: Vec<_> = wcs.iter().map(|w| (w.qp_num, w.wr_id, w.status)).collect();
    let ok = IBV_WC_SUCCESS;
    // The receive completes as the SEND arrives; the sends as their ACKs come back.
    assert_eq!(got, [(b, 77, ok), (a, 1, ok), (a, 2, ok), (a, 3, ok)]);
    // 3 WRITE + 3 SEND packets with an ACK each message, a READ request, 3 responses.
    let c = st.counters;
    assert_eq!((c.tx_packets, c.rx_packets), (12, 12));
    assert_eq!(c.rx_dropped_malformed + c.rx_duplicate + c.rx_stale, 0);
    assert_eq!(c.rx_placements, 3, "one write per message");
    // Looked up for each packet the transmitter sends (ACKs are the responder's answers)
    // and for each packet received.
    assert_eq!(c.qp_cache_hits + c.qp_cache_misses, 10 + 12);
}

/// A SEND behind a READ in the send queue, acknowledged before the READ's responses arrive
/// (the responder acknowledges the SEND at once while the READ's responses wait for the
/// transmitter): the SEND completes right after the READ. The requester used to forget that
/// ACK (completions are in order, and the READ was not done yet) and wait for another that
/// never came: drum-kv's READ/PUT mix stalled on its last PUT.
#[test]
fn a_send_acknowledged_while_a_read_ahead_of_it_waits_completes_after_the_read() {
    let mut buf: Vec<u8> = (0..64u32 << 10).map(|i| (i % 251) as u8).collect();
    let (mut st, [a, b], (lkey, rkey)) = loopback_pair(&mut buf);
    let base = buf.as_ptr() as u64;
    let wr = |id: u64, opcode: i32, from: u64, to: u64, len: u32| SendWr {
        wr_id: id,
        opcode,
        flags: IBV_SEND_SIGNALED,
        remote_addr: base + to,
        rkey,
        sges: vec![Sge {
            addr: base + from,
            length: len,
            lkey,
        }],
        ..Default::default()
    };
    let wrs = vec![
        wr(1, IBV_WR_RDMA_READ, 32 << 10, 24 << 10, 700),
        wr(2, IBV_WR_SEND, 1024, 0, 600),
    ];
    assert_eq!(st.post_send(1, a, wrs), Resp::Unit);
    let now = Instant::now();
    let me = loopback_addr();
    // The READ request and the SEND's packets reach the responder, which acknowledges the
    // SEND; the requester gets that ACK before any READ response.
    while st.tx_one(now).is_some() {}
    let deliver = |st: &mut State, pkts: Vec<(SocketAddr, wire::Packet)>| {
        for (_, p) in pkts {
            st.receive(me, p, now);
        }
        st.place_all(now);
    };
    let requests = std::mem::take(&mut st.fabric.out);
    deliver(&mut st, requests);
    while st.tx_one(now).is_some() {}
    let (acks, rest): (Vec<_>, Vec<_>) = std::mem::take(&mut st.fabric.out)
        .into_iter()
        .partition(|(_, p)| p.op == wire::OP_ACK);
    assert!(!acks.is_empty(), "the SEND is acknowledged");
    assert!(
        rest.iter().any(|(_, p)| p.op == wire::OP_READ_RESP),
        "a READ response waits"
    );
    deliver(&mut st, acks);
    st.fabric.out.extend(rest);
    // Then the READ's responses.
    loop {
        while st.tx_one(now).is_some() {}
        if st.fabric.out.is_empty() {
            break;
        }
        st.loop_back(me, now);
    }
    let got: Vec<_> = st
        .cqs
        .values()
        .flat_map(|c| c.q.iter().map(|w| (w.qp_num, w.wr_id, w.status)))
        .collect();
    let ok = IBV_WC_SUCCESS;
    assert_eq!(got, [(b, 77, ok), (a, 1, ok), (a, 2, ok)]);
}

/// DCQCN in the engine: a CE-marked packet for an RC QP from its peer is answered with a
/// CNP to the sending QP, at most once per 50 µs, and not at all with DCQCN off or from
/// anyone but the peer; a CNP from the peer halves the QP's rate (alpha starts at 1), after
/// which its packets are paced at that rate while another QP keeps the line.
#[test]
fn marked_packets_draw_cnps_and_a_cnp_paces_its_qp() {
    let cfg = NicConfig {
        line_rate_gbps: 1.0,
        ..Default::default()
    };
    let (mut st, qpns, _buf) = nic_rig(cfg, 2, 4);
    let (slowed, free) = (qpns[0], qpns[1]);
    let peer = st.qps[&slowed].remote.unwrap();
    let peer_qpn = st.qps[&slowed].attr.dest_qp_num;
    let marked = Packet {
        op: wire::OP_WRITE,
        ecn: wire::ECN_CE,
        dst_qpn: slowed,
        src_qpn: peer_qpn,
        ..Default::default()
    };
    let t0 = Instant::now();
    let cnps = take_cnps;
    st.on_marked(peer, &marked, true, t0);
    assert_eq!(st.fabric.out.len(), 1);
    let (to, cnp) = &st.fabric.out[0];
    assert_eq!((*to, cnp.dst_qpn, cnp.src_qpn), (peer, peer_qpn, slowed));
    assert_eq!(cnps(&mut st), 1);
    st.on_marked(peer, &marked, true, t0 + Duration::from_micros(49));
    assert_eq!(cnps(&mut st), 0, "within the CNP interval");
    st.on_marked(peer, &marked, true, t0 + Duration::from_micros(50));
    assert_eq!(cnps(&mut st), 1);
    let stranger = SocketAddr::from(([10, 9, 9, 9], 4791));
    st.on_marked(stranger, &marked, true, t0 + Duration::from_millis(1));
    assert_eq!(cnps(&mut st), 0, "not the QP's peer");
    assert_eq!(st.dcqcn_counters().cnps_sent, 2);

    // A CNP from a stranger changes nothing; one from the peer halves the rate.
    let cnp = Packet {
        op: wire::OP_CNP,
        dst_qpn: slowed,
        src_qpn: peer_qpn,
        ..Default::default()
    };
    st.receive(stranger, cnp.clone(), t0);
    assert_eq!(st.dcqcn_counters().rate_decreases, 0);
    assert_eq!(st.counters.rx_dropped_unknown_qp, 1);
    st.receive(peer, cnp.clone(), t0);
    let c = st.dcqcn_counters();
    assert_eq!((c.cnps_received, c.rate_decreases), (1, 1));
    assert_eq!(c.min_rate_kbps, 500_000);
    // The slowed QP sends once, then waits its pacer while the free one sends everything.
    let order: Vec<u32> = std::iter::from_fn(|| st.tx_one(t0)).collect();
    assert_eq!(
        order.iter().filter(|q| **q == slowed).count(),
        1,
        "{order:?}"
    );
    assert_eq!(
        order.iter().filter(|q| **q == free).count(),
        12,
        "{order:?}"
    );
    // 256 + 48 + 42 bytes at 500 Mb/s.
    let due = st.pace_wake.expect("the slowed QP is due later");
    assert_eq!(due - t0, Duration::from_nanos((256 + 48 + 42) * 8 * 2));

    // With DCQCN off: no CNPs, and CNPs received are counted but cut nothing.
    let off = NicConfig {
        dcqcn: false,
        ..cfg
    };
    let (mut st, qpns, _buf) = nic_rig(off, 1, 1);
    let peer = st.qps[&qpns[0]].remote.unwrap();
    let marked = Packet {
        dst_qpn: qpns[0],
        src_qpn: st.qps[&qpns[0]].attr.dest_qp_num,
        ..marked
    };
    st.on_marked(peer, &marked, true, t0);
    assert_eq!(cnps(&mut st), 0);
    let cnp = Packet {
        dst_qpn: marked.dst_qpn,
        src_qpn: marked.src_qpn,
        ..cnp
    };
    st.receive(peer, cnp, t0);
    let c = st.dcqcn_counters();
    assert_eq!(
        (c.cnps_received, c.rate_decreases, c.min_rate_kbps),
        (1, 0, 0)
    );
}

#[test]
fn a_dart_receiver_answers_only_marks_that_are_not_its_own_congestion() {
    let cfg = NicConfig {
        line_rate_gbps: 1.0,
        ..Default::default()
    };
    let (mut st, qpns, _buf) = nic_rig(cfg, 1, 1);
    let peer = st.qps[&qpns[0]].remote.unwrap();
    let marked = Packet {
        op: wire::OP_WRITE,
        ecn: wire::ECN_CE,
        dst_qpn: qpns[0],
        src_qpn: st.qps[&qpns[0]].attr.dest_qp_num,
        ..Default::default()
    };
    let cnps = take_cnps;
    let t0 = Instant::now();
    st.dart.receiver = crate::dart_receiver::Policy::Dart;
    // Marked by this port: the receiver's own congestion, which DASR's N handles.
    st.on_marked(peer, &marked, true, t0);
    assert_eq!(cnps(&mut st), 0);
    assert_eq!(st.dart.cnps_suppressed, 1);
    // Marked upstream while this port is idle: not the receiver's congestion, DCQCN's.
    st.on_marked(peer, &marked, false, t0);
    assert_eq!(cnps(&mut st), 1);
    assert_eq!(st.dart.non_receiver_marks, 1);
    // Marked upstream while this port has run at line rate for a whole CNP interval (50 µs
    // at time scale 1): 125 back-to-back packets of 1,000 bytes at 1 Gb/s take 1 ms.
    let t1 = t0 + Duration::from_millis(1);
    for _ in 0..125 {
        st.rx_port.arrive(t1, peer, 1000);
    }
    let t2 = t1 + Duration::from_micros(60);
    assert!(st.rx_port.busy_for(t2) >= Duration::from_micros(50));
    st.on_marked(peer, &marked, false, t2);
    assert_eq!(cnps(&mut st), 0);
    assert_eq!(st.dart.cnps_suppressed, 2);
    // DCQCN's policy answers the same mark.
    st.dart.receiver = crate::dart_receiver::Policy::Dcqcn;
    st.on_marked(peer, &marked, true, t2 + Duration::from_millis(1));
    assert_eq!(cnps(&mut st), 1);
    assert_eq!(st.dart.cnps_suppressed, 2);
}

#[test]
fn a_packet_behind_another_senders_queue_is_handled_only_when_the_port_has_put_that_through() {
    // 8 Gb/s: a 1,000-byte packet on the wire (958 bytes of datagram) takes 1 µs.
    let cfg = NicConfig {
        line_rate_gbps: 8.0,
        ..Default::default()
    };
    let mut st = State::with_nic(cfg, Instant::now());
    let (a, b) = (
        SocketAddr::from(([10, 77, 0, 2], 4791)),
        SocketAddr::from(([10, 77, 0, 3], 4791)),
    );
    let to_nobody = Packet {
        op: wire::OP_WRITE,
        dst_qpn: 0xdead,
        ..Default::default()
    };
    let len = 1000 - nic::L2_L4_OVERHEAD as usize;
    let handled = |st: &State| st.counters.rx_dropped_unknown_qp;
    let t0 = Instant::now();
    let us = |n| t0 + Duration::from_micros(n);
    // Both at line rate for 3 µs: a's packets wait 0, 1, 2 µs and b's 1, 2, 3 µs, so they
    // are due at 0, 2, 4 and 1, 3, 5 µs.
    for i in 0..3 {
        st.arrive(a, to_nobody.clone(), len, us(i));
        st.arrive(b, to_nobody.clone(), len, us(i));
    }
    assert_eq!(handled(&st), 1);
    assert_eq!(st.release_waiting(us(2)), (2, Some(us(3))));
    assert_eq!(handled(&st), 3);
    assert_eq!(st.release_waiting(us(5)), (3, None));
    assert_eq!(handled(&st), 6);
    assert_eq!(st.rx_port.counters.waited, 5);
}

/// The CNPs the state queued since the last call (the queue emptied).
fn take_cnps(st: &mut State) -> usize {
    let n = st
        .fabric
        .out
        .iter()
        .filter(|(_, p)| p.op == wire::OP_CNP)
        .count();
    st.fabric.out.clear();
    n
}
