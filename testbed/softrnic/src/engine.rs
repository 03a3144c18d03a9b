//! The NIC engine of one emulated host: owns every PD, MR, CQ and QP of the host, serves the
//! providers of the host's applications over a Unix socket, moves data with
//! `process_vm_readv/writev`, and runs the RC transport over UDP with peer engines.
//!
//! Threads: one per provider connection (control verbs), one UDP receiver, one transmitter
//! (round-robin over QPs with work, one packet per QP per turn, work requests fetched one
//! doorbell batch at a time, paced by the NIC model ([`crate::nic`]), retransmission timers). Work requests and completions travel through
//! rings shared with the applications ([`crate::ring`]); the transmitter takes new work
//! requests from them and sleeps on the engine's doorbell. All state sits behind one mutex.
//!
//! This file holds the engine's state and what every part uses (completions); the parts are
//! its modules: `verbs` (the provider's requests), `work_queues` and `rings` (posting),
//! `qp_state`, `transport` (each QP's requester and responder state, pure), `requester` and
//! `responder` (the drivers around it), `xrc`, `host_io` (the engine's start, threads,
//! sockets, GSO/GRO), `async_events`, `process_memory` (the applications' memory) and
//! `diagnostics` (what the log says of slow locks and stalled QPs).

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::io;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, UdpSocket};
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use anyhow::Context as _;

use crate::device;
use crate::events::{EventQueue, Obj};
use crate::faults::{FaultConfig, LinkInjector};
use crate::idmap::IdMap;
use crate::mw::{BindReq, MrView, Mw};
use crate::nic::{self, NicConfig, Pipeline};
use crate::proto::{self, Caps, QpAttrs, RecvWr, Req, Resp, SendWr, Sge};
use crate::ring::{self, Doorbell, Map, QpLayout, Ring};
use crate::wire::{self, psn_add, psn_diff, Packet, Payload};
use drum_verbs_abi::consts::*;
use drum_verbs_abi::{consts::mtu_bytes, IbvWc};

mod async_events;
mod auss;
mod congestion;
mod counters;
mod diagnostics;
mod fabric;
mod host_io;
mod ingress;
mod memory;
mod multicast;
mod placement;
mod process_memory;
mod qp_state;
mod raw;
mod requester;
mod responder;
mod rings;
mod transport;
mod verbs;
mod work_queues;
mod xrc;

pub use counters::Counters;
use diagnostics::*;
pub use host_io::run;
use host_io::*;
use process_memory::*;
use transport::requester::{Requester, SqWqe};
use transport::responder::{CurRecv, Responder};

/// How long a destroyed QP still acknowledges duplicates of what it had received.
const TOMBSTONE: Duration = Duration::from_secs(3);
/// Transmitter tick when idle (bounds timer latency).
const TICK: Duration = Duration::from_millis(1);
/// Most packets the transmitter sends per wakeup before letting other threads in.
const TX_BURST: usize = 64;
/// The stats file is rewritten at most this often (and only when a counter changed).
const STATS_EVERY: Duration = Duration::from_millis(200);
/// How often the engine reads its port's sysfs state (`softrnic link`).
pub const PORT_CHECK_EVERY: Duration = Duration::from_millis(100);

#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub host: String,
    pub ip: Ipv4Addr,
    pub udp_port: u16,
    pub socket: PathBuf,
    /// Fault injection on this engine's egress (see [`crate::faults`]).
    pub faults: FaultConfig,
    /// Where the counters are written (about every 200 ms while they change).
    pub stats: Option<PathBuf>,
    /// The NIC model (see [`crate::nic`]).
    pub nic: NicConfig,
    /// Batch same-size packets into UDP GSO sends and receive with UDP GRO (a host-side
    /// optimisation: every packet stays a packet for the model, faults and peers).
    pub gso: bool,
    /// The host's directory (`<run>/hosts/HOST`): its files are watched for `softrnic link`,
    /// `softrnic receiver` and `softrnic dasr` (None: the port is always up, DCQCN's
    /// notification point, no caps).
    pub host_dir: Option<PathBuf>,
    /// The addresses of every host of the run (multicast goes to all of them).
    pub peers: Vec<Ipv4Addr>,
}

struct Cq {
    conn: u64,
    cap: usize,
    q: VecDeque<IbvWc>,
    /// Completion channel (0: none), the application's `ibv_cq *`, whether armed, and whether
    /// only for solicited (or error) completions.
    channel: u32,
    user: u64,
    armed: bool,
    solicited_only: bool,
    /// Completion ring shared with the application (then `q` stays empty).
    ring: Option<(Map, Ring)>,
    /// A completion was lost to a full CQ (reported once, as `IBV_EVENT_CQ_ERR`).
    overflowed: bool,
}

/// A completion channel, or a context's asynchronous event stream (`events` set): the
/// stream is a second connection of the owning process.
struct Channel {
    conn: u64,
    pid: i32,
    token: u64,
    sink: Option<UnixStream>,
    events: Option<EventQueue>,
}

/// A shared receive queue: receives any of its QPs may consume, resolved against its PD.
struct Srq {
    conn: u64,
    pid: i32,
    pd: u32,
    /// An XRC SRQ: its XRC domain and the CQ its receives complete on (basic SRQs: 0, 0).
    xrcd: u32,
    cq: u32,
    max_wr: u32,
    max_sge: u32,
    q: VecDeque<RecvWr>,
    /// Armed limit (0: disarmed): when fewer receives than this remain queued, the engine
    /// raises `IBV_EVENT_SRQ_LIMIT_REACHED` once and disarms.
    limit: u32,
    /// The application's `struct ibv_srq *` (for asynchronous events).
    user: u64,
}

/// A receive taken from a QP's receive queue or SRQ, with the owner and PD its buffers
/// belong to and the CQ it completes on.
struct Landing {
    wr: RecvWr,
    conn: u64,
    pid: i32,
    pd: u32,
    cq: u32,
}

struct Qp {
    conn: u64,
    pid: i32,
    pd: u32,
    send_cq: u32,
    recv_cq: u32,
    /// Shared receive queue the QP takes its receives from (0: its own `rq`).
    srq: u32,
    /// An XRC target QP's XRC domain (0 for other QPs).
    xrcd: u32,
    /// Transport: `IBV_QPT_RC`, `IBV_QPT_UC`, `IBV_QPT_UD`, `IBV_QPT_XRC_SEND` or
    /// `IBV_QPT_XRC_RECV`.
    qpt: i32,
    sq_sig_all: bool,
    cap: Caps,
    attr: QpAttrs,
    state: i32,
    remote: Option<SocketAddr>,
    mtu: u32,
    /// Its transport: the send queue and what is in flight, the receive side.
    req: Requester,
    resp: Responder,
    /// Work-request rings shared with the application.
    rings: Option<QpRings>,
    /// The application's `struct ibv_qp *` (for asynchronous events).
    user: u64,
    /// `IBV_EVENT_COMM_EST` was raised (the first packet that arrived in RTR).
    comm_est: bool,
    /// Packet pacing (`IBV_QP_RATE_LIMIT`): None, unpaced.
    pacer: Option<nic::Pacer>,
    /// DCQCN (RC QPs): CNPs sent, rate and its pacer.
    cc: congestion::QpCc,
    /// An XRC target's other handles: (connection, the application's `ibv_qp *`) of the
    /// processes that opened it with `ibv_open_qp` (see `xrc::State::release_qp`).
    openers: Vec<(u64, u64)>,
}

/// A QP's send and receive rings, and how far the engine has consumed them.
struct QpRings {
    map: Map,
    sq: Ring,
    rq: Ring,
    sq_cons: u32,
    rq_cons: u32,
}

impl Qp {
    /// The retransmission timeout: 4.096 µs·2^timeout, stretched by the NIC's `time_scale`,
    /// clamped to something useful on a software link. On a NIC dilated 200× the program's
    /// timeout (perftest's 14: 67 ms) is 335 µs of the NIC's time, under one window of
    /// packets of a shared line: ACKs then came "late", go-back-N resent whole windows
    /// (2,122 packets in a 3 s isolation run against 32 alone) and the victim lost 15–25 %
    /// of its share.
    fn timeout(&self, time_scale: f64) -> Duration {
        let t = self.attr.timeout.min(31) as u32;
        let secs = 4.096e-6 * f64::from(1u32 << t) * time_scale;
        Duration::from_secs_f64(secs.min(2.0)).max(Duration::from_millis(5))
    }
}

struct State {
    next_handle: u32,
    next_qpn: u32,
    /// PDs, MRs, memory windows and device memory.
    mem: memory::MemoryTable,
    /// The port, the packets leaving by it and the faults on their way.
    fabric: fabric::Fabric,
    cqs: IdMap<Cq>,
    channels: IdMap<Channel>,
    qps: IdMap<Qp>,
    srqs: IdMap<Srq>,
    xrcds: IdMap<xrc::Xrcd>,
    /// The earliest time a paced QP that `tx_one` passed over may send again.
    pace_wake: Option<Instant>,
    /// Multicast groups (keys of [`device::mcast_group`]) and the local UD QPs attached to each.
    mcast: HashMap<u64, std::collections::BTreeSet<u32>>,
    /// Flow rules of raw-packet QPs, by handle (in creation order).
    flows: std::collections::BTreeMap<u32, raw::RawFlow>,
    rr: VecDeque<u32>,
    counters: Counters,
    /// Work requests and bytes fetched per owning process (`proc_tx_*.PID` in the stats
    /// file): what each process asks of the NIC, whoever it is — a host agent learns from it
    /// what processes it does not govern take (DRUM's issue 23).
    proc_tx: std::collections::BTreeMap<i32, (u64, u64)>,
    /// The NIC model: pipeline clock and QP-context cache.
    nic: Pipeline,
    /// The NIC's receive port (see [`crate::rx_port`]).
    rx_port: crate::rx_port::RxPort,
    /// Arrived packets waiting for the port's queue ahead of them (the packet, and whether
    /// this port marked it).
    rx_waiting: crate::rx_port::DelayLine<(Packet, bool)>,
    dcqcn: congestion::Dcqcn,
    dart: crate::dart_receiver::DartNic,
    /// AUSS in ACKs (off unless the run asks for it).
    auss: auss::NicAuss,
    /// Destroyed QPs that still re-acknowledge their peer's duplicates for a while.
    tombstones: IdMap<Tombstone>,
    /// Message data gathered and not yet placed (see `placement`).
    gathered: placement::Combiner,
    /// Connections whose context other processes may join ([`Req::JoinContext`]), and the
    /// secret they must show.
    context_keys: HashMap<u64, u64>,
}

/// What is left of a destroyed connected QP (see [`TOMBSTONE`]).
struct Tombstone {
    peer: SocketAddr,
    peer_qpn: u32,
    epsn: u32,
    until: Instant,
}

struct Shared {
    st: Mutex<State>,
    /// Wakes the transmitter: rung by providers after posting and by the engine's own threads.
    db: Doorbell,
    /// Hand runs of same-size packets to the kernel as one UDP GSO send (see [`send_batched`]);
    /// the receiver enables UDP GRO and splits what it gets back into packets.
    gso: bool,
    udp: UdpSocket,
    /// This engine's own address: packets to it are looped back (see [`Shared::loop_back`]).
    me: SocketAddr,
    /// The last [`Holder`] to take `st`, named when someone waited long for it.
    holder: AtomicU8,
}

impl State {
    /// Hand the queued packets for this host (`me`) to its own receive path, and the answers
    /// they cause in turn, until none is left (see [`Shared::loop_back`]). They go over as
    /// they are: no encoding, no decoding, their payloads still the requester's staged
    /// message bytes, which the responder's combined write then places directly. Whether
    /// one of them gives the transmitter work.
    fn loop_back(&mut self, me: SocketAddr, now: Instant) -> bool {
        let mut wake = false;
        loop {
            // Data gathered from the packets just handled (see `placement`); placing it may
            // NAK, and the NAK may be local.
            self.place_all(now);
            let Some(local) = self.fabric.take_local(me) else {
                break;
            };
            for p in local {
                self.counters.tx_packets += 1;
                self.counters.rx_packets += 1;
                wake |= wakes_transmitter(p.op);
                self.receive(me, p, now);
            }
        }
        wake
    }

    /// Handle a packet from `from`; a bug that panics in its handler costs the packet, not
    /// the engine (counted in `rx_handler_panics`).
    fn receive(&mut self, from: SocketAddr, p: Packet, now: Instant) {
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            self.on_packet(from, p, now)
        }));
        if r.is_err() {
            self.counters.rx_handler_panics += 1;
            eprintln!("softrnic engine: BUG: panic while handling a packet (dropped)");
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The engine's state
// ---------------------------------------------------------------------------------------------

fn err(errno: i32) -> Resp {
    Resp::Err {
        errno,
        bad_index: 0,
    }
}

fn unit_or_err(r: Result<(), i32>) -> Resp {
    r.map_or_else(err, |()| Resp::Unit)
}

fn handle_or_err(r: Result<u32, i32>) -> Resp {
    r.map_or_else(err, Resp::Handle)
}

/// The next object handle from `next`: never 0, wrapping.
fn take_handle(next: &mut u32) -> u32 {
    let h = *next;
    *next = next.wrapping_add(1).max(1);
    h
}

impl State {
    /// `proc_tx_wqes.PID N` and `proc_tx_bytes.PID N` for every process that owns a QP now
    /// (a process whose QPs are all gone drops out).
    fn proc_tx_lines(&mut self) -> String {
        let owners: std::collections::BTreeSet<i32> = self.qps.values().map(|q| q.pid).collect();
        self.proc_tx.retain(|p, _| owners.contains(p));
        self.proc_tx
            .iter()
            .map(|(pid, (wqes, bytes))| {
                format!("proc_tx_wqes.{pid} {wqes}\nproc_tx_bytes.{pid} {bytes}\n")
            })
            .collect()
    }

    /// A NIC with no verbs objects yet, started at `now`.
    fn with_nic(nic: NicConfig, now: Instant) -> Self {
        State {
            next_handle: 1,
            next_qpn: 0x11,
            mem: memory::MemoryTable::default(),
            pace_wake: None,
            cqs: IdMap::default(),
            channels: IdMap::default(),
            qps: IdMap::default(),
            srqs: IdMap::default(),
            xrcds: IdMap::default(),
            fabric: fabric::Fabric::default(),
            mcast: HashMap::new(),
            flows: std::collections::BTreeMap::new(),
            rr: VecDeque::new(),
            counters: Counters::default(),
            proc_tx: std::collections::BTreeMap::new(),
            nic: Pipeline::new(nic),
            rx_port: crate::rx_port::RxPort::new(nic.rx_port()),
            rx_waiting: Default::default(),
            dcqcn: congestion::Dcqcn::new(nic.dcqcn(), now),
            dart: Default::default(),
            auss: auss::NicAuss::default(),
            tombstones: IdMap::default(),
            gathered: placement::Combiner::default(),
            context_keys: HashMap::new(),
        }
    }

    /// Remove a QP (a UD QP sends what was posted to it first, see
    /// [`State::send_posted_datagrams`]). A connected one leaves a tombstone: when the last ACK to its peer was
    /// lost and the application destroyed the QP right after its last receive (as
    /// `ibv_rc_pingpong` does), the peer's retransmissions are still acknowledged instead of
    /// ending in a retry-exceeded error — the TIME_WAIT of this transport. Nothing is delivered
    /// to anyone; only duplicates of packets already received are answered.
    fn remove_qp(&mut self, qpn: u32, now: Instant) {
        self.send_posted_datagrams(qpn, now);
        self.leave_all_mcast(qpn);
        self.forget_flows(qpn);
        if let Some(q) = self.qps.remove(&qpn) {
            if let (Some(peer), IBV_QPS_RTR | IBV_QPS_RTS, IBV_QPT_RC | IBV_QPT_XRC_RECV) =
                (q.remote, q.state, q.qpt)
            {
                self.tombstones.insert(
                    qpn,
                    Tombstone {
                        peer,
                        peer_qpn: q.attr.dest_qp_num,
                        epsn: q.resp.epsn,
                        until: now + TOMBSTONE,
                    },
                );
            }
        }
        self.rr.retain(|q| *q != qpn);
        self.nic.cache.remove(qpn);
        self.mem.unbind_qp(qpn);
    }

    /// A packet for a QP that no longer exists: re-acknowledge a duplicate from the peer of a
    /// tombstone. Returns whether it was answered.
    fn tombstone_rx(&mut self, from: SocketAddr, p: &Packet, now: Instant) -> bool {
        let Some(t) = self.tombstones.get(&p.dst_qpn) else {
            return false;
        };
        let request = matches!(p.op, wire::OP_SEND | wire::OP_WRITE);
        if now > t.until
            || t.peer != from
            || t.peer_qpn != p.src_qpn
            || !request
            || psn_diff(p.psn, t.epsn) >= 0
        {
            return false;
        }
        let e = psn_add(t.epsn, wire::PSN_MASK);
        self.counters.rx_duplicate += 1;
        self.ack(from, p.dst_qpn, p.src_qpn, e, now);
        true
    }

    /// One packet onto the wire at `now`: charged once to the NIC model (it occupies the line
    /// for its wire time), replicated by the network when it goes to a multicast group. (The
    /// transmitter passes the time it read for its burst: no clock reading per packet.)
    fn emit(&mut self, dst: SocketAddr, p: Packet, now: Instant) {
        let ns = self.nic.cfg.wire_ns(p.wire_len());
        self.nic.charge(now, ns);
        if let (true, SocketAddr::V4(d), wire::OP_SEND | wire::OP_WRITE) =
            (self.auss.is_on(), dst, p.op)
        {
            if *d.ip() != self.fabric.me {
                self.auss.data_sent(*d.ip(), now);
            }
        }
        self.fabric.send(dst, p);
    }

    /// Look a QP's context up in the NIC's cache; a miss costs `qp_miss_ns`.
    fn touch_qp(&mut self, qpn: u32, now: Instant) {
        if self.nic.cache.access(qpn) {
            self.counters.qp_cache_hits += 1;
        } else {
            self.counters.qp_cache_misses += 1;
            let ns = self.nic.cfg.qp_miss_ns;
            self.nic.charge(now, ns);
        }
    }

    /// Transmit arbitration: the next QP in round-robin order that has a packet to send
    /// (retransmission or new data) and whose pacing allows it sends exactly one; it then goes
    /// to the back of the order. Returns the QP that sent, or None when no QP has anything to
    /// send now (`pace_wake`: when a paced QP passed over may send again).
    fn tx_one(&mut self, now: Instant) -> Option<u32> {
        self.pace_wake = None;
        for _ in 0..self.rr.len() {
            let qpn = self.rr.pop_front()?;
            self.rr.push_back(qpn);
            if let Some(t) = self.pace_ready_at(qpn, now) {
                self.pace_wake = Some(self.pace_wake.map_or(t, |w| w.min(t)));
                continue;
            }
            self.pull_sq(qpn);
            if self.qps.get(&qpn).is_some_and(|q| q.state == IBV_QPS_ERR) {
                // Receives posted to a QP in the error state are flushed.
                self.pull_rq(qpn);
            }
            let pkt = self
                .next_read_response(qpn, now)
                .or_else(|| self.next_packet(qpn, now));
            self.sync_done(qpn);
            if let Some(pkt) = pkt {
                self.touch_qp(qpn, now);
                self.pace_charge(qpn, now, pkt.1.wire_len());
                self.emit(pkt.0, pkt.1, now);
                return Some(qpn);
            }
        }
        None
    }

    fn handle(&mut self) -> u32 {
        take_handle(&mut self.next_handle)
    }

    fn push_cqe(&mut self, cq: u32, wc: IbvWc) {
        self.push_cqe_solicited(cq, wc, false);
    }

    /// Add a completion; `solicited`: a receive completion of a message its sender marked
    /// solicited (it alone, or an error completion, fires a CQ armed solicited-only).
    fn push_cqe_solicited(&mut self, cq: u32, wc: IbvWc, solicited: bool) {
        // The QP's retired work requests are published before its completion, so that an
        // application that posts again after polling finds the room.
        self.sync_done(wc.qp_num);
        let Some(c) = self.cqs.get_mut(&cq) else {
            return;
        };
        let stored = if let Some((m, r)) = &c.ring {
            let prod = r.prod(m).load(Ordering::Relaxed);
            let cons = r.cons(m).load(Ordering::Acquire);
            let room = prod.wrapping_sub(cons) < r.n;
            if room {
                m.write(r.slot_off(prod), &ring::wc_bytes(&wc));
                r.prod(m).store(prod.wrapping_add(1), Ordering::Release);
                self.counters.ring_cqes += 1;
            }
            // Pairs with the provider's fence after arming (see `ring`).
            std::sync::atomic::fence(Ordering::SeqCst);
            room
        } else if c.q.len() < c.cap {
            c.q.push_back(wc);
            true
        } else {
            false
        };
        if !stored {
            eprintln!("softrnic engine: CQ {cq} overflow, completion lost");
            if !std::mem::replace(&mut c.overflowed, true) {
                let (conn, user) = (c.conn, c.user);
                self.raise(conn, Obj::Cq(cq), user, IBV_EVENT_CQ_ERR);
            }
            return;
        }
        // Armed through the ring's word (the provider's `ibv_req_notify_cq`) or the socket.
        let word = c.ring.as_ref().map(|(m, r)| r.arm(m));
        let shm = word.map_or(0, |a| a.load(Ordering::SeqCst));
        let (armed, solicited_only) = if shm != 0 {
            (true, shm == ring::ARM_SOLICITED)
        } else {
            (c.armed, c.solicited_only)
        };
        let fires = !solicited_only || solicited || wc.status != IBV_WC_SUCCESS;
        if armed && c.channel != 0 && fires {
            if let Some(a) = word {
                a.store(0, Ordering::SeqCst);
            }
            c.armed = false;
            let sink = self
                .channels
                .get(&c.channel)
                .and_then(|ch| ch.sink.as_ref());
            if !sink.is_some_and(|s| send_nowait(s, &c.user.to_ne_bytes())) {
                eprintln!("softrnic engine: completion event for CQ {cq} lost");
            }
        }
    }

    fn drop_conn(&mut self, conn: u64, now: Instant) {
        let qpns: Vec<u32> = self
            .qps
            .iter()
            .filter(|(_, q)| q.held_by(conn))
            .map(|(k, _)| *k)
            .collect();
        for q in qpns {
            if self.release_qp(conn, q) {
                self.remove_qp(q, now);
            }
        }
        self.srqs.retain(|_, s| s.conn != conn);
        self.flows.retain(|_, f| !f.owned_by(conn));
        self.forget_xrcd_opens(conn);
        self.mem.drop_conn(conn);
        self.cqs.retain(|_, c| c.conn != conn);
        self.channels.retain(|_, c| c.conn != conn);
        self.context_keys.remove(&conn);
    }
}

#[cfg(test)]
mod tests;
