//! The NIC engine of one emulated host: owns every PD, MR, CQ and QP of the host, serves the
//! providers of the host's applications over a Unix socket, moves data with
//! `process_vm_readv/writev`, and runs the RC transport over UDP with peer engines.
//!
//! Threads: one per provider connection (control verbs), one UDP receiver, one transmitter
//! (round-robin over QPs with work, one packet per QP per turn, work requests fetched one
//! doorbell batch at a time, paced by the NIC model ([`crate::nic`]), retransmission timers). Work requests and completions travel through
//! rings shared with the applications ([`crate::ring`]); the transmitter takes new work
//! requests from them and sleeps on the engine's doorbell. All state sits behind one mutex.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::io;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, UdpSocket};
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use anyhow::Context as _;

use crate::device;
use crate::events::{EventQueue, Obj};
use crate::faults::{FaultConfig, LinkInjector};
use crate::ffi::consts::*;
use crate::ffi::{mtu_bytes, IbvWc};
use crate::mw::{BindReq, MrView, Mw};
use crate::nic::{self, NicConfig, Pipeline};
use crate::proto::{self, Caps, QpAttrs, RecvWr, Req, Resp, SendWr, Sge};
use crate::ring::{self, Doorbell, Map, QpLayout, Ring};
use crate::wire::{self, psn_add, psn_diff, Packet};

mod xrc;

/// How long a destroyed QP still acknowledges duplicates of what it had received.
const TOMBSTONE: Duration = Duration::from_secs(3);
/// Most packets a QP keeps unacknowledged.
const WINDOW: usize = 512;
/// A requester asks for an ACK at least every this many packets.
const ACKREQ_EVERY: u32 = 16;
/// Transmitter tick when idle (bounds timer latency).
const TICK: Duration = Duration::from_millis(1);
/// Most packets the transmitter sends per wakeup before letting other threads in.
const TX_BURST: usize = 64;
/// The stats file is rewritten at most this often (and only when a counter changed).
const STATS_EVERY: Duration = Duration::from_millis(200);
/// How often the engine reads its port's sysfs state (`softrnic link`).
pub const PORT_CHECK_EVERY: Duration = Duration::from_millis(100);
/// Atomic results a responder QP remembers by PSN, so that a retransmitted atomic request is
/// answered from here instead of being executed twice (IBTA's responder resources). Twice the
/// most any requester may have outstanding (`max_rd_atomic` ≤ [`device::MAX_RD_ATOM`]): every
/// request a requester can still retransmit is among the last this many executed.
const ATOMIC_CACHE: usize = 2 * device::MAX_RD_ATOM as usize;

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
    /// The port's sysfs `state` file, watched for `softrnic link` (None: always up).
    pub port_state: Option<PathBuf>,
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Counters {
    pub rx_packets: u64,
    pub rx_dropped_malformed: u64,
    pub rx_dropped_unknown_qp: u64,
    /// Valid packets for a known QP that were stale or outside the window (duplicates,
    /// replays): re-acknowledged or ignored, never applied twice.
    pub rx_duplicate: u64,
    pub rx_stale: u64,
    pub rx_handler_panics: u64,
    pub tx_packets: u64,
    pub retransmits: u64,
    pub fault_dropped: u64,
    pub fault_duplicated: u64,
    pub fault_reordered: u64,
    pub fault_delayed: u64,
    /// QP-context cache of the NIC model: lookups that hit and that missed.
    pub qp_cache_hits: u64,
    pub qp_cache_misses: u64,
    /// Work requests fetched by the transmitter (each costs `wqe_fetch_ns`), and the reads
    /// that fetched them (one per doorbell batch, see [`crate::nic::fetch_count`]).
    pub wqe_fetches: u64,
    pub wqe_fetch_reads: u64,
    /// Work requests taken from shared rings (send, receive), completions written to rings,
    /// and posts/polls that came over the socket instead (programs whose rings could not be
    /// set up, and tests).
    pub ring_send_wqes: u64,
    pub ring_recv_wqes: u64,
    pub ring_cqes: u64,
    pub socket_posts_polls: u64,
    /// UD datagrams dropped for a wrong Q_Key, and UD/UC messages dropped because no
    /// receive was posted (those transports have no RNR: the message is lost).
    pub rx_dropped_qkey: u64,
    pub rx_dropped_no_recv: u64,
    /// UC packets dropped because an earlier packet of their message was lost.
    pub rx_uc_broken: u64,
    /// Packets not sent or not taken because the port's link was down.
    pub port_down_dropped: u64,
}

impl Counters {
    /// `name value` lines (the stats file, `softrnic stats`).
    pub fn encode(&self) -> String {
        let mut s = String::new();
        for (k, v) in [
            ("rx_packets", self.rx_packets),
            ("rx_dropped_malformed", self.rx_dropped_malformed),
            ("rx_dropped_unknown_qp", self.rx_dropped_unknown_qp),
            ("rx_duplicate", self.rx_duplicate),
            ("rx_stale", self.rx_stale),
            ("rx_handler_panics", self.rx_handler_panics),
            ("tx_packets", self.tx_packets),
            ("retransmits", self.retransmits),
            ("fault_dropped", self.fault_dropped),
            ("fault_duplicated", self.fault_duplicated),
            ("fault_reordered", self.fault_reordered),
            ("fault_delayed", self.fault_delayed),
            ("qp_cache_hits", self.qp_cache_hits),
            ("qp_cache_misses", self.qp_cache_misses),
            ("wqe_fetches", self.wqe_fetches),
            ("wqe_fetch_reads", self.wqe_fetch_reads),
            ("ring_send_wqes", self.ring_send_wqes),
            ("ring_recv_wqes", self.ring_recv_wqes),
            ("ring_cqes", self.ring_cqes),
            ("socket_posts_polls", self.socket_posts_polls),
            ("rx_dropped_qkey", self.rx_dropped_qkey),
            ("rx_dropped_no_recv", self.rx_dropped_no_recv),
            ("rx_uc_broken", self.rx_uc_broken),
            ("port_down_dropped", self.port_down_dropped),
        ] {
            s.push_str(&format!("{k} {v}\n"));
        }
        s
    }
}

/// A packet held back by fault injection until `at`.
struct Held {
    at: Instant,
    seq: u64,
    dst: SocketAddr,
    bytes: Vec<u8>,
}

impl PartialEq for Held {
    fn eq(&self, o: &Self) -> bool {
        (self.at, self.seq) == (o.at, o.seq)
    }
}
impl Eq for Held {}
impl PartialOrd for Held {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Held {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        (self.at, self.seq).cmp(&(o.at, o.seq))
    }
}

/// Egress fault injection: one injector per destination, and the held packets.
struct Injection {
    cfg: FaultConfig,
    host: String,
    links: HashMap<SocketAddr, LinkInjector>,
    held: BinaryHeap<Reverse<Held>>,
    seq: u64,
}

struct Mr {
    conn: u64,
    pid: i32,
    pd: u32,
    addr: u64,
    len: u64,
    access: u32,
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

struct SqWqe {
    wr: SendWr,
    len: u32,
    signaled: bool,
    /// Set once all the WQE's packets have been built.
    packetized: bool,
    /// The first work request of its `ibv_post_send` call (its doorbell).
    doorbell: bool,
    /// Read by the NIC's fetch unit (its fetch cost is paid).
    fetched: bool,
    first_psn: u32,
    last_psn: u32,
    /// READ: next response PSN expected; READ and atomics: whether the response arrived.
    resp_next: u32,
    resp_done: bool,
    /// Local segments (process address, length), resolved at packetization.
    segs: Vec<(u64, u64)>,
}

struct Inflight {
    psn: u32,
    last_psn: u32,
    needs_resp: bool,
    bytes: Vec<u8>,
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

/// The receive a multi-packet SEND is being written into: where its buffers are (the
/// process of its queue's owner — for an XRC SRQ not the target QP's) and its CQ.
struct CurRecv {
    wr_id: u64,
    segs: Vec<(u64, u64)>,
    pid: i32,
    cq: u32,
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
    /// UC responder: discarding the rest of a message one of whose packets was lost.
    uc_broken: bool,
    sq_sig_all: bool,
    cap: Caps,
    attr: QpAttrs,
    state: i32,
    remote: Option<SocketAddr>,
    mtu: u32,
    // requester
    sq: VecDeque<SqWqe>,
    sq_next: usize,
    sq_off: u32,
    next_psn: u32,
    inflight: VecDeque<Inflight>,
    resend: Option<usize>,
    last_progress: Instant,
    retries: u32,
    rnr_retries: u32,
    rnr_until: Option<Instant>,
    // responder
    rq: VecDeque<RecvWr>,
    epsn: u32,
    cur_recv: Option<CurRecv>,
    nak_sent: bool,
    /// (PSN, original value) of the last [`ATOMIC_CACHE`] atomics executed, oldest first.
    atomic_cache: VecDeque<(u32, u64)>,
    /// Work-request rings shared with the application.
    rings: Option<QpRings>,
    /// The application's `struct ibv_qp *` (for asynchronous events).
    user: u64,
    /// `IBV_EVENT_COMM_EST` was raised (the first packet that arrived in RTR).
    comm_est: bool,
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
    /// Atomics sent and not yet completed. One whose response came early (the response to an
    /// earlier atomic was lost) still counts until it completes in order: otherwise the QP
    /// would go on issuing atomics behind the lost one, and by the time that one is resent
    /// the responder's result cache would no longer hold it.
    fn atomics_outstanding(&self) -> usize {
        self.sq
            .iter()
            .take(self.sq_next)
            .filter(|w| proto::is_atomic_wr(w.wr.opcode))
            .count()
    }

    /// Drop the in-flight copy of a request whose response arrived, keeping a retransmission
    /// pass that is under way on the entries after it.
    fn remove_inflight(&mut self, psn: u32) {
        if let Some(i) = self.inflight.iter().position(|f| f.psn == psn) {
            self.inflight.remove(i);
            if let Some(r) = self.resend.as_mut() {
                if i < *r {
                    *r -= 1;
                }
            }
        }
    }

    /// How many atomics may wait for responses at once: the QP's `max_rd_atomic` (at least
    /// one, so a QP configured with 0 still makes progress).
    fn atomic_limit(&self) -> usize {
        (self.attr.max_rd_atomic as usize).max(1)
    }

    fn timeout(&self) -> Duration {
        // 4.096 µs * 2^timeout, clamped to something useful on a software link.
        let t = self.attr.timeout.min(31) as u32;
        let us = 4.096f64 * f64::from(1u32 << t.min(31));
        Duration::from_micros(us as u64).clamp(Duration::from_millis(5), Duration::from_secs(2))
    }
}

struct State {
    next_handle: u32,
    next_qpn: u32,
    next_key: u32,
    pds: HashMap<u32, u64>,
    mrs: HashMap<u32, Mr>,
    cqs: HashMap<u32, Cq>,
    channels: HashMap<u32, Channel>,
    qps: HashMap<u32, Qp>,
    srqs: HashMap<u32, Srq>,
    xrcds: HashMap<u32, xrc::Xrcd>,
    /// The port's link (`softrnic link`): while down, nothing is sent or received.
    port_up: bool,
    /// Memory windows by index (rkey >> 8).
    mws: HashMap<u32, Mw>,
    /// This host's address (the destination in the GRH of received UD datagrams).
    my_ip: Ipv4Addr,
    rr: VecDeque<u32>,
    counters: Counters,
    /// Packets waiting to be sent (built under the lock, sent by whoever holds it).
    out: Vec<(SocketAddr, Vec<u8>)>,
    /// Fault injection, when configured.
    inject: Option<Injection>,
    /// The NIC model: pipeline clock and QP-context cache.
    nic: Pipeline,
    /// Destroyed QPs that still re-acknowledge their peer's duplicates for a while.
    tombstones: HashMap<u32, Tombstone>,
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
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.st.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn kick(&self) {
        self.db.ring();
    }

    fn flush_out(&self, st: &mut State) {
        let st = &mut *st;
        if !st.port_up {
            // No link: what the NIC sends goes nowhere.
            st.counters.port_down_dropped += st.out.len() as u64;
            st.out.clear();
            return;
        }
        let Some(inj) = st.inject.as_mut() else {
            if self.gso {
                st.counters.tx_packets += send_batched(&self.udp, &mut st.out);
                return;
            }
            for (dst, b) in st.out.drain(..) {
                if self.udp.send_to(&b, dst).is_ok() {
                    st.counters.tx_packets += 1;
                }
            }
            return;
        };
        let now = Instant::now();
        let c = &mut st.counters;
        for (dst, b) in st.out.drain(..) {
            let link = inj.links.entry(dst).or_insert_with(|| {
                let ip = match dst {
                    SocketAddr::V4(a) => *a.ip(),
                    SocketAddr::V6(_) => Ipv4Addr::UNSPECIFIED,
                };
                LinkInjector::new(&inj.cfg, &inj.host, ip)
            });
            let fate = link.fate();
            c.fault_dropped += fate.dropped as u64;
            c.fault_duplicated += fate.duplicated as u64;
            c.fault_reordered += fate.reordered as u64;
            for d in fate.sends {
                if d.is_zero() {
                    if self.udp.send_to(&b, dst).is_ok() {
                        c.tx_packets += 1;
                    }
                } else {
                    c.fault_delayed += 1;
                    inj.seq += 1;
                    inj.held.push(Reverse(Held {
                        at: now + d,
                        seq: inj.seq,
                        dst,
                        bytes: b.clone(),
                    }));
                }
            }
        }
        self.flush_held(st, now);
    }

    /// Send the held packets that are due; returns when the next one is due.
    fn flush_held(&self, st: &mut State, now: Instant) -> Option<Instant> {
        let inj = st.inject.as_mut()?;
        while let Some(Reverse(h)) = inj.held.peek() {
            if h.at > now {
                return Some(h.at);
            }
            let Reverse(h) = inj.held.pop().unwrap();
            if !st.port_up {
                st.counters.port_down_dropped += 1;
            } else if self.udp.send_to(&h.bytes, h.dst).is_ok() {
                st.counters.tx_packets += 1;
            }
        }
        None
    }
}

// ---------------------------------------------------------------------------------------------
// Memory access of other processes
// ---------------------------------------------------------------------------------------------

type CrossMemoryFn = unsafe extern "C" fn(
    libc::pid_t,
    *const libc::iovec,
    libc::c_ulong,
    *const libc::iovec,
    libc::c_ulong,
    libc::c_ulong,
) -> libc::ssize_t;

/// Moves `len` bytes between `local` in this process and `addr` in `pid` with `op`
/// (`process_vm_readv` or `process_vm_writev`), looping over partial transfers.
///
/// # Safety
/// `local` must be valid for `len` bytes in the direction `op` uses it (written by readv, read by
/// writev); the kernel checks the remote range against the target's address space.
unsafe fn cross_memory(
    op: CrossMemoryFn,
    pid: i32,
    addr: u64,
    local: *mut u8,
    len: usize,
) -> io::Result<()> {
    let mut done = 0usize;
    while done < len {
        let local = libc::iovec {
            // SAFETY: done < len, so the offset stays inside the caller's buffer.
            iov_base: unsafe { local.add(done) } as *mut libc::c_void,
            iov_len: len - done,
        };
        let remote = libc::iovec {
            iov_base: (addr as usize + done) as *mut libc::c_void,
            iov_len: len - done,
        };
        // SAFETY: the local iovec lies inside the caller's buffer (see the function's contract).
        let n = unsafe { op(pid, &local, 1, &remote, 1, 0) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        if n == 0 {
            return Err(io::Error::from_raw_os_error(libc::EFAULT));
        }
        done += n as usize;
    }
    Ok(())
}

fn read_mem(pid: i32, addr: u64, buf: &mut [u8]) -> io::Result<()> {
    // SAFETY: `buf` is valid and writable for its whole length.
    unsafe {
        cross_memory(
            libc::process_vm_readv,
            pid,
            addr,
            buf.as_mut_ptr(),
            buf.len(),
        )
    }
}

fn write_mem(pid: i32, addr: u64, data: &[u8]) -> io::Result<()> {
    // SAFETY: `data` is valid for reads for its whole length, and writev only reads it.
    unsafe {
        cross_memory(
            libc::process_vm_writev,
            pid,
            addr,
            data.as_ptr() as *mut u8,
            data.len(),
        )
    }
}

/// Copy `data` into the segment list at byte `offset`.
fn scatter(pid: i32, segs: &[(u64, u64)], mut offset: u64, mut data: &[u8]) -> io::Result<()> {
    for &(addr, len) in segs {
        if data.is_empty() {
            break;
        }
        if offset >= len {
            offset -= len;
            continue;
        }
        let n = ((len - offset) as usize).min(data.len());
        write_mem(pid, addr + offset, &data[..n])?;
        data = &data[n..];
        offset = 0;
    }
    if data.is_empty() {
        Ok(())
    } else {
        Err(io::Error::from_raw_os_error(libc::EMSGSIZE))
    }
}

/// Read `buf.len()` bytes from the segment list starting at byte `offset`.
fn gather(pid: i32, segs: &[(u64, u64)], mut offset: u64, buf: &mut [u8]) -> io::Result<()> {
    let mut pos = 0usize;
    for &(addr, len) in segs {
        if pos == buf.len() {
            break;
        }
        if offset >= len {
            offset -= len;
            continue;
        }
        let n = ((len - offset) as usize).min(buf.len() - pos);
        read_mem(pid, addr + offset, &mut buf[pos..pos + n])?;
        pos += n;
        offset = 0;
    }
    if pos == buf.len() {
        Ok(())
    } else {
        Err(io::Error::from_raw_os_error(libc::EFAULT))
    }
}

// ---------------------------------------------------------------------------------------------
// Verbs (requests from providers)
// ---------------------------------------------------------------------------------------------

fn err(errno: i32) -> Resp {
    Resp::Err {
        errno,
        bad_index: 0,
    }
}

impl State {
    #[cfg(test)]
    fn new() -> Self {
        Self::with_nic(NicConfig::default())
    }

    fn with_nic(nic: NicConfig) -> Self {
        State {
            next_handle: 1,
            next_qpn: 0x11,
            next_key: 0x100,
            pds: HashMap::new(),
            mrs: HashMap::new(),
            cqs: HashMap::new(),
            channels: HashMap::new(),
            qps: HashMap::new(),
            srqs: HashMap::new(),
            xrcds: HashMap::new(),
            port_up: true,
            mws: HashMap::new(),
            my_ip: Ipv4Addr::LOCALHOST,
            rr: VecDeque::new(),
            counters: Counters::default(),
            out: Vec::new(),
            inject: None,
            nic: Pipeline::new(nic),
            tombstones: HashMap::new(),
        }
    }

    /// Remove a QP. A connected one leaves a tombstone: when the last ACK to its peer was
    /// lost and the application destroyed the QP right after its last receive (as
    /// `ibv_rc_pingpong` does), the peer's retransmissions are still acknowledged instead of
    /// ending in a retry-exceeded error — the TIME_WAIT of this transport. Nothing is delivered
    /// to anyone; only duplicates of packets already received are answered.
    fn remove_qp(&mut self, qpn: u32) {
        if let Some(q) = self.qps.remove(&qpn) {
            if let (Some(peer), IBV_QPS_RTR | IBV_QPS_RTS, IBV_QPT_RC | IBV_QPT_XRC_RECV) =
                (q.remote, q.state, q.qpt)
            {
                self.tombstones.insert(
                    qpn,
                    Tombstone {
                        peer,
                        peer_qpn: q.attr.dest_qp_num,
                        epsn: q.epsn,
                        until: Instant::now() + TOMBSTONE,
                    },
                );
            }
        }
        self.rr.retain(|q| *q != qpn);
        self.nic.cache.remove(qpn);
        // Type 2 windows bound to it lose their binding with it.
        for w in self.mws.values_mut() {
            if w.kind == IBV_MW_TYPE_2 && w.bound.is_some_and(|b| b.qpn == qpn) {
                w.bound = None;
            }
        }
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
        self.reply(from, p.dst_qpn, p.src_qpn, wire::OP_ACK, 0, e);
        true
    }

    /// Queue a packet for sending; it occupies the line for its wire time.
    fn emit(&mut self, dst: SocketAddr, bytes: Vec<u8>) {
        let ns = self.nic.cfg.wire_ns(bytes.len());
        self.nic.charge(Instant::now(), ns);
        self.out.push((dst, bytes));
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
    /// (retransmission or new data) sends exactly one; it then goes to the back of the order.
    /// Returns the QP that sent, or None when no QP has anything to send.
    fn tx_one(&mut self, now: Instant) -> Option<u32> {
        for _ in 0..self.rr.len() {
            let qpn = self.rr.pop_front()?;
            self.rr.push_back(qpn);
            self.pull_sq(qpn);
            if self.qps.get(&qpn).is_some_and(|q| q.state == IBV_QPS_ERR) {
                // Receives posted to a QP in the error state are flushed.
                self.pull_rq(qpn);
            }
            let pkt = self.next_packet(qpn, now);
            self.sync_done(qpn);
            if let Some(pkt) = pkt {
                self.touch_qp(qpn, now);
                self.emit(pkt.0, pkt.1);
                return Some(qpn);
            }
        }
        None
    }

    fn handle(&mut self) -> u32 {
        let h = self.next_handle;
        self.next_handle = self.next_handle.wrapping_add(1).max(1);
        h
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

    /// Raise an asynchronous event on connection `conn`'s event stream (dropped if the context
    /// has none, e.g. a provider that did not open one).
    fn raise(&mut self, conn: u64, obj: Obj, element: u64, event_type: u32) {
        let Some((id, q)) = self.event_queue(conn) else {
            return;
        };
        if !q.push(obj, element, event_type) {
            eprintln!("softrnic engine: async event {event_type} dropped (queue full)");
        }
        self.pump_events(id);
    }

    /// The link went down or came up: every context of the host learns it from an
    /// asynchronous event (`IBV_EVENT_PORT_ERR`, `IBV_EVENT_PORT_ACTIVE`; element: port 1).
    /// QPs are left alone, as on hardware: their retransmissions fail while the link is down
    /// and run out after their retry count, or succeed once it is back.
    fn set_port(&mut self, up: bool) {
        if up == self.port_up {
            return;
        }
        self.port_up = up;
        let event = if up {
            IBV_EVENT_PORT_ACTIVE
        } else {
            IBV_EVENT_PORT_ERR
        };
        let conns: Vec<u64> = self
            .channels
            .values()
            .filter(|c| c.events.is_some())
            .map(|c| c.conn)
            .collect();
        for conn in conns {
            self.raise(conn, Obj::Port, 1, event);
        }
    }

    /// The channel id and event queue of connection `conn`'s asynchronous event stream.
    fn event_queue(&mut self, conn: u64) -> Option<(u32, &mut EventQueue)> {
        self.channels
            .iter_mut()
            .filter(|(_, c)| c.conn == conn)
            .find_map(|(&id, c)| Some((id, c.events.as_mut()?)))
    }

    /// An asynchronous event of a QP, for the application's `ibv_qp *`.
    fn raise_qp(&mut self, qpn: u32, event_type: u32) {
        if let Some(q) = self.qps.get(&qpn) {
            let (conn, user) = (q.conn, q.user);
            self.raise(conn, Obj::Qp(qpn), user, event_type);
        }
    }

    /// Write the next record of event stream `id` if the application has read the last one.
    fn pump_events(&mut self, id: u32) {
        let Some(ch) = self.channels.get_mut(&id) else {
            return;
        };
        let (Some(sink), Some(q)) = (ch.sink.as_ref(), ch.events.as_mut()) else {
            return;
        };
        if let Some(r) = q.next_record() {
            if !send_nowait(sink, &r) {
                // Only a closed or broken stream refuses 16 bytes into an empty socket.
                eprintln!("softrnic engine: async event lost");
                q.consumed(true);
            }
        }
    }

    /// The connection's event stream: the record on it is gone (read or taken back).
    fn async_event_read(&mut self, conn: u64, taken_back: bool) -> Resp {
        let Some((id, q)) = self.event_queue(conn) else {
            return err(libc::EINVAL);
        };
        q.consumed(taken_back);
        self.pump_events(id);
        Resp::Unit
    }

    /// An object of connection `conn` is destroyed: its unread events go with it; the answer
    /// tells the provider what to wait for (see [`crate::events`]).
    fn forget_events(&mut self, conn: u64, obj: Obj) -> Resp {
        let (events_reported, event_unread) = self
            .event_queue(conn)
            .map_or((0, false), |(_, q)| q.forget(obj));
        Resp::Destroyed {
            events_reported,
            event_unread,
        }
    }

    /// Make `s` the event stream of channel `id` (owned by process `pid`, proven by `token`).
    fn attach_channel(&mut self, pid: i32, id: u32, token: u64, s: UnixStream) -> Resp {
        match self.channels.get_mut(&id) {
            Some(ch) if ch.pid == pid && ch.token == token && ch.sink.is_none() => {
                ch.sink = Some(s);
                // An event stream may have events waiting already.
                self.pump_events(id);
                Resp::Unit
            }
            _ => err(libc::EINVAL),
        }
    }

    fn request(&mut self, conn: u64, pid: i32, req: Req) -> Resp {
        if matches!(
            req,
            Req::PostSend { .. } | Req::PostRecv { .. } | Req::PollCq { .. }
        ) {
            self.counters.socket_posts_polls += 1;
        }
        match req {
            Req::AllocPd => {
                if self.pds.len() >= device::MAX_PD as usize {
                    return err(libc::ENOMEM);
                }
                let h = self.handle();
                self.pds.insert(h, conn);
                Resp::Handle(h)
            }
            Req::DeallocPd { pd } => {
                if self.pds.get(&pd) != Some(&conn) {
                    return err(libc::EINVAL);
                }
                let busy = self.mrs.values().any(|m| m.pd == pd)
                    || self.qps.values().any(|q| q.pd == pd)
                    || self.srqs.values().any(|q| q.pd == pd)
                    || self.mws.values().any(|w| w.pd == pd);
                if busy {
                    return err(libc::EBUSY);
                }
                self.pds.remove(&pd);
                Resp::Unit
            }
            Req::RegMr {
                pd,
                addr,
                len,
                access,
            } => {
                if self.pds.get(&pd) != Some(&conn) {
                    return err(libc::EINVAL);
                }
                // Remote write/atomic access requires local write (as the kernel enforces).
                if access & (IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_ATOMIC) != 0
                    && access & IBV_ACCESS_LOCAL_WRITE == 0
                {
                    return err(libc::EINVAL);
                }
                if len == 0 || addr.checked_add(len).is_none() {
                    return err(libc::EINVAL);
                }
                if self.mrs.len() >= device::MAX_MR as usize {
                    return err(libc::ENOMEM);
                }
                // The pages must exist in the registering process (as pinning would require).
                let mut probe = [0u8; 1];
                if read_mem(pid, addr, &mut probe).is_err()
                    || read_mem(pid, addr + len - 1, &mut probe).is_err()
                {
                    return err(libc::EFAULT);
                }
                // key = index << 8 | 8-bit key; keys are never reused within an engine run.
                let key = self.next_key;
                self.next_key = self.next_key.wrapping_add(0x101);
                self.mrs.insert(
                    key,
                    Mr {
                        conn,
                        pid,
                        pd,
                        addr,
                        len,
                        access,
                    },
                );
                Resp::Mr {
                    lkey: key,
                    rkey: key,
                }
            }
            Req::DeregMr { lkey } => match self.mrs.get(&lkey) {
                Some(m) if m.conn == conn => {
                    // Windows bound over it keep it (as the kernel refuses with EBUSY).
                    if self
                        .mws
                        .values()
                        .any(|w| w.bound.is_some_and(|b| b.mr == lkey))
                    {
                        return err(libc::EBUSY);
                    }
                    self.mrs.remove(&lkey);
                    Resp::Unit
                }
                _ => err(libc::EINVAL),
            },
            Req::AllocMw { pd, mw_type } => {
                if self.pds.get(&pd) != Some(&conn) {
                    return err(libc::EINVAL);
                }
                if !matches!(mw_type, IBV_MW_TYPE_1 | IBV_MW_TYPE_2) {
                    return err(libc::EINVAL);
                }
                if self.mws.len() >= device::MAX_MW as usize {
                    return err(libc::ENOMEM);
                }
                // Keys come from the MRs' allocator, so window and MR keys never collide.
                let rkey = self.next_key;
                self.next_key = self.next_key.wrapping_add(0x101);
                self.mws.insert(
                    rkey >> 8,
                    Mw {
                        conn,
                        pd,
                        kind: mw_type,
                        rkey,
                        bound: None,
                    },
                );
                Resp::Handle(rkey)
            }
            Req::DeallocMw { rkey } => match self.mws.get(&(rkey >> 8)) {
                Some(w) if w.conn == conn => {
                    self.mws.remove(&(rkey >> 8));
                    Resp::Unit
                }
                _ => err(libc::EINVAL),
            },
            Req::CreateCq { cqe, channel, user } => {
                if cqe == 0 || cqe > device::MAX_CQE {
                    return err(libc::EINVAL);
                }
                if channel != 0
                    && self
                        .channels
                        .get(&channel)
                        .is_none_or(|c| c.conn != conn || c.sink.is_none() || c.events.is_some())
                {
                    return err(libc::EINVAL);
                }
                if self.cqs.len() >= device::MAX_CQ as usize {
                    return err(libc::ENOMEM);
                }
                let h = self.handle();
                self.cqs.insert(
                    h,
                    Cq {
                        conn,
                        cap: cqe as usize,
                        q: VecDeque::new(),
                        channel,
                        user,
                        armed: false,
                        solicited_only: false,
                        ring: None,
                        overflowed: false,
                    },
                );
                Resp::Cq { handle: h, cqe }
            }
            Req::CreateChannel | Req::CreateAsyncChannel => {
                let events = matches!(req, Req::CreateAsyncChannel).then(EventQueue::default);
                if events.is_some() && self.event_queue(conn).is_some() {
                    // One asynchronous event stream per context.
                    return err(libc::EBUSY);
                }
                let id = self.handle();
                self.channels.insert(
                    id,
                    Channel {
                        conn,
                        pid,
                        token: random_u64(),
                        sink: None,
                        events,
                    },
                );
                Resp::Channel {
                    id,
                    token: self.channels[&id].token,
                }
            }
            Req::UserHandle { kind, handle, user } => {
                let slot = match kind {
                    1 => self
                        .qps
                        .get_mut(&handle)
                        .filter(|q| q.conn == conn)
                        .map(|q| &mut q.user),
                    2 => self
                        .srqs
                        .get_mut(&handle)
                        .filter(|s| s.conn == conn)
                        .map(|s| &mut s.user),
                    _ => None,
                };
                match slot {
                    Some(u) => {
                        *u = user;
                        Resp::Unit
                    }
                    None => err(libc::EINVAL),
                }
            }
            Req::AsyncEventRead { taken_back } => self.async_event_read(conn, taken_back),
            // Only valid as the first request of its own connection (see serve_conn).
            Req::AttachChannel { .. } => err(libc::EINVAL),
            // Arming for any completion while armed solicited-only widens the arming (the
            // verbs: the request for the next completion takes precedence).
            Req::ReqNotifyCq { cq, solicited_only } => match self.cqs.get_mut(&cq) {
                Some(c) if c.conn == conn && c.channel != 0 => {
                    c.solicited_only = solicited_only && (!c.armed || c.solicited_only);
                    c.armed = true;
                    Resp::Unit
                }
                _ => err(libc::EINVAL),
            },
            Req::DestroyCq { cq } => {
                if self.cqs.get(&cq).map(|c| c.conn) != Some(conn) {
                    return err(libc::EINVAL);
                }
                if self
                    .qps
                    .values()
                    .any(|q| q.send_cq == cq || q.recv_cq == cq)
                    || self.srqs.values().any(|s| s.cq == cq)
                {
                    return err(libc::EBUSY);
                }
                self.cqs.remove(&cq);
                self.forget_events(conn, Obj::Cq(cq))
            }
            Req::PollCq { cq, max } => match self.cqs.get_mut(&cq) {
                Some(c) if c.conn == conn => {
                    let n = (max as usize).min(c.q.len());
                    Resp::Wcs(c.q.drain(..n).collect())
                }
                _ => err(libc::EINVAL),
            },
            Req::CreateQp {
                pd,
                send_cq,
                recv_cq,
                srq,
                xrcd,
                qp_type,
                sq_sig_all,
                cap,
            } => {
                let own_cq = |cq: u32| self.cqs.get(&cq).map(|c| c.conn) == Some(conn);
                let valid = match qp_type {
                    IBV_QPT_RC | IBV_QPT_UC | IBV_QPT_UD => {
                        own_cq(send_cq)
                            && own_cq(recv_cq)
                            && (srq == 0 || self.srqs.get(&srq).map(|s| s.conn) == Some(conn))
                    }
                    // Sends only: no receive queue, CQ or SRQ of its own.
                    IBV_QPT_XRC_SEND => own_cq(send_cq) && srq == 0,
                    // Receives into its domain's SRQs: no PD, CQs or queues of its own.
                    IBV_QPT_XRC_RECV => self.xrcd_opened_by(xrcd, conn),
                    _ => return err(libc::EOPNOTSUPP),
                };
                let pd_ok = qp_type == IBV_QPT_XRC_RECV || self.pds.get(&pd) == Some(&conn);
                if !valid || !pd_ok || (xrcd != 0) != (qp_type == IBV_QPT_XRC_RECV) {
                    return err(libc::EINVAL);
                }
                if cap.max_send_wr > device::MAX_QP_WR
                    || cap.max_recv_wr > device::MAX_QP_WR
                    || cap.max_send_sge > device::MAX_SGE
                    || cap.max_recv_sge > device::MAX_SGE
                    || cap.max_inline_data > device::MAX_INLINE
                {
                    return err(libc::EINVAL);
                }
                if self.qps.len() >= device::MAX_QP as usize {
                    return err(libc::ENOMEM);
                }
                let xrc = matches!(qp_type, IBV_QPT_XRC_SEND | IBV_QPT_XRC_RECV);
                let cap = Caps {
                    max_send_wr: cap.max_send_wr.max(1),
                    // XRC QPs have no receive queue (XRC SRQs hold their receives).
                    max_recv_wr: if xrc { 0 } else { cap.max_recv_wr.max(1) },
                    max_send_sge: cap.max_send_sge.max(1),
                    max_recv_sge: cap.max_recv_sge.max(1),
                    max_inline_data: device::MAX_INLINE,
                };
                let qpn = self.next_qpn;
                self.next_qpn = psn_add(self.next_qpn, 1).max(0x11);
                self.qps.insert(
                    qpn,
                    Qp {
                        conn,
                        pid,
                        pd,
                        send_cq,
                        recv_cq,
                        srq,
                        xrcd,
                        qpt: qp_type,
                        uc_broken: false,
                        sq_sig_all,
                        cap,
                        attr: QpAttrs::default(),
                        state: IBV_QPS_RESET,
                        remote: None,
                        mtu: 1024,
                        sq: VecDeque::new(),
                        sq_next: 0,
                        sq_off: 0,
                        next_psn: 0,
                        inflight: VecDeque::new(),
                        resend: None,
                        last_progress: Instant::now(),
                        retries: 0,
                        rnr_retries: 0,
                        rnr_until: None,
                        rq: VecDeque::new(),
                        epsn: 0,
                        cur_recv: None,
                        nak_sent: false,
                        atomic_cache: VecDeque::new(),
                        rings: None,
                        user: 0,
                        comm_est: false,
                    },
                );
                self.rr.push_back(qpn);
                self.tombstones.remove(&qpn);
                Resp::Qp { qpn, cap }
            }
            Req::ModifyQp { qpn, mask, attr } => {
                if self.qps.get(&qpn).map(|q| q.conn) != Some(conn) {
                    return err(libc::EINVAL);
                }
                let r = match self.modify_qp(qpn, mask, &attr) {
                    Ok(()) => Resp::Unit,
                    Err(e) => err(e),
                };
                self.sync_done(qpn);
                r
            }
            Req::QueryQp { qpn } => match self.qps.get(&qpn) {
                Some(q) if q.conn == conn => {
                    let mut a = q.attr;
                    a.qp_state = q.state;
                    a.cur_qp_state = q.state;
                    Resp::QpAttr {
                        attr: a,
                        cap: q.cap,
                        qp_type: q.qpt,
                        sq_sig_all: q.sq_sig_all,
                    }
                }
                _ => err(libc::EINVAL),
            },
            Req::DestroyQp { qpn } => {
                if self.qps.get(&qpn).map(|q| q.conn) != Some(conn) {
                    return err(libc::EINVAL);
                }
                self.remove_qp(qpn);
                self.forget_events(conn, Obj::Qp(qpn))
            }
            Req::PostSend { qpn, wrs } => self.post_send(conn, qpn, wrs),
            Req::PostRecv { qpn, wrs } => self.post_recv(conn, qpn, wrs),
            Req::CreateSrq {
                pd,
                max_wr,
                max_sge,
                xrcd,
                cq,
            } => {
                if (xrcd != 0 || cq != 0)
                    && (!self.xrcd_opened_by(xrcd, conn)
                        || self.cqs.get(&cq).map(|c| c.conn) != Some(conn))
                {
                    return err(libc::EINVAL);
                }
                self.create_srq(conn, pid, pd, (max_wr, max_sge), (xrcd, cq))
            }
            Req::ModifySrq {
                srq,
                mask,
                max_wr,
                srq_limit,
            } => self.modify_srq(conn, srq, mask, max_wr, srq_limit),
            Req::QuerySrq { srq } => match self.srqs.get(&srq) {
                Some(s) if s.conn == conn => Resp::Srq {
                    handle: srq,
                    max_wr: s.max_wr,
                    max_sge: s.max_sge,
                    srq_limit: s.limit,
                },
                _ => err(libc::EINVAL),
            },
            Req::DestroySrq { srq } => {
                if self.srqs.get(&srq).map(|s| s.conn) != Some(conn) {
                    return err(libc::EINVAL);
                }
                if self.qps.values().any(|q| q.srq == srq) {
                    return err(libc::EBUSY);
                }
                // Receives still queued are dropped with it, as destroying an SRQ does.
                self.srqs.remove(&srq);
                self.forget_events(conn, Obj::Srq(srq))
            }
            Req::PostSrqRecv { srq, wrs } => self.post_srq_recv(conn, srq, wrs),
            Req::OpenXrcd { file, oflags } => self.open_xrcd(conn, file, oflags),
            Req::CloseXrcd { xrcd } => self.close_xrcd(conn, xrcd),
            Req::AttachRing {
                kind,
                handle,
                fd,
                len,
            } => match self.attach_ring(conn, pid, kind, handle, fd, len) {
                Ok(()) => Resp::Unit,
                Err(e) => err(e),
            },
        }
    }

    /// Map the application's memfd `fd` as the completion ring of a CQ or the work-request
    /// rings of a QP.
    fn attach_ring(
        &mut self,
        conn: u64,
        pid: i32,
        kind: u8,
        handle: u32,
        fd: i32,
        len: u64,
    ) -> Result<(), i32> {
        let need = match kind {
            0 => match self.cqs.get(&handle) {
                Some(c) if c.conn == conn && c.ring.is_none() && c.q.is_empty() => {
                    ring::cq_len(c.cap as u32)
                }
                _ => return Err(libc::EINVAL),
            },
            1 => match self.qps.get(&handle) {
                Some(q) if q.conn == conn && q.rings.is_none() && q.state == IBV_QPS_RESET => {
                    QpLayout::new(&q.cap).len
                }
                _ => return Err(libc::EINVAL),
            },
            _ => return Err(libc::EINVAL),
        };
        if len != need as u64 || fd < 0 {
            return Err(libc::EINVAL);
        }
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(format!("/proc/{pid}/fd/{fd}"))
            .map_err(|e| e.raw_os_error().unwrap_or(libc::EBADF))?;
        let size = f.metadata().map_err(|_| libc::EBADF)?.len();
        if size < need as u64 {
            return Err(libc::EINVAL);
        }
        let map =
            Map::new(f.as_raw_fd(), need).map_err(|e| e.raw_os_error().unwrap_or(libc::ENOMEM))?;
        match kind {
            0 => {
                let c = self.cqs.get_mut(&handle).ok_or(libc::EINVAL)?;
                let r = Ring {
                    off: 0,
                    n: c.cap as u32,
                    slot: ring::WC_SIZE,
                };
                c.ring = Some((map, r));
            }
            _ => {
                let q = self.qps.get_mut(&handle).ok_or(libc::EINVAL)?;
                let l = QpLayout::new(&q.cap);
                q.rings = Some(QpRings {
                    map,
                    sq: Ring {
                        off: 0,
                        n: l.sq_n,
                        slot: l.sq_slot,
                    },
                    rq: Ring {
                        off: l.rq_off,
                        n: l.rq_n,
                        slot: l.rq_slot,
                    },
                    sq_cons: 0,
                    rq_cons: 0,
                });
            }
        }
        Ok(())
    }

    /// Publish how many work requests of a QP have left the engine (completed or flushed).
    fn sync_done(&mut self, qpn: u32) {
        let Some(q) = self.qps.get(&qpn) else { return };
        let Some(r) = &q.rings else { return };
        let sq_done = r.sq_cons.wrapping_sub(q.sq.len() as u32);
        let in_rq = q.rq.len() as u32 + q.cur_recv.is_some() as u32;
        let rq_done = r.rq_cons.wrapping_sub(in_rq);
        r.sq.done(&r.map).store(sq_done, Ordering::Release);
        r.rq.done(&r.map).store(rq_done, Ordering::Release);
    }

    /// Take the work requests the application wrote into a QP's send ring. An entry that does
    /// not validate completes with `IBV_WC_LOC_QP_OP_ERR` and moves the QP to the error state.
    fn pull_sq(&mut self, qpn: u32) {
        let Some(q) = self.qps.get_mut(&qpn) else {
            return;
        };
        let Some(r) = q.rings.as_mut() else { return };
        let prod = r.sq.prod(&r.map).load(Ordering::Acquire);
        if prod == r.sq_cons {
            return;
        }
        let avail = prod.wrapping_sub(r.sq_cons);
        let max_sge = q.cap.max_send_sge as usize;
        let mut slot = vec![0u8; r.sq.slot];
        let mut accepted = Vec::new();
        let mut bad: Option<u64> = None;
        for _ in 0..avail.min(r.sq.n) {
            r.map.read(r.sq.slot_off(r.sq_cons), &mut slot);
            r.sq_cons = r.sq_cons.wrapping_add(1);
            let wr_id = ring::get_u64(&slot, 0);
            let opcode = ring::get_u32(&slot, 8) as i32;
            let nsge = ring::get_u32(&slot, 20) as usize;
            let inline_len = ring::get_u32(&slot, 36);
            let inline_cap = r.sq.slot - ring::SQ_SGE_OFF - 16 * max_sge;
            let inline_ok = inline_len == ring::NOT_INLINE || inline_len as usize <= inline_cap;
            if nsge > max_sge || !inline_ok {
                bad = Some(wr_id);
                break;
            }
            let sges: Vec<Sge> = (0..nsge)
                .map(|i| {
                    let o = ring::SQ_SGE_OFF + 16 * i;
                    Sge {
                        addr: ring::get_u64(&slot, o),
                        length: ring::get_u32(&slot, o + 8),
                        lkey: ring::get_u32(&slot, o + 12),
                    }
                })
                .collect();
            let inline = (inline_len != ring::NOT_INLINE).then(|| {
                let o = ring::SQ_SGE_OFF + 16 * max_sge;
                slot[o..o + inline_len as usize].to_vec()
            });
            let len: u64 = match &inline {
                Some(b) => b.len() as u64,
                None => sges.iter().map(|s| s.length as u64).sum(),
            };
            if proto::check_send_wr(q.qpt, opcode, inline.is_some(), len).is_err() {
                bad = Some(wr_id);
                break;
            }
            let flags = ring::get_u32(&slot, 12);
            let wr = SendWr {
                wr_id,
                opcode,
                flags,
                imm: ring::get_u32(&slot, 16),
                remote_addr: ring::get_u64(&slot, 24),
                rkey: ring::get_u32(&slot, 32),
                compare_add: ring::get_u64(&slot, ring::SQ_COMPARE_ADD_OFF),
                swap: ring::get_u64(&slot, ring::SQ_SWAP_OFF),
                sges: if inline.is_some() { Vec::new() } else { sges },
                inline,
                xrc_srqn: ring::get_u32(&slot, ring::SQ_XRC_SRQN_OFF),
            };
            accepted.push(SqWqe {
                signaled: q.sq_sig_all || flags & IBV_SEND_SIGNALED != 0,
                wr,
                len: len as u32,
                packetized: false,
                doorbell: ring::get_u32(&slot, ring::SQ_DOORBELL_OFF) != 0,
                fetched: false,
                first_psn: 0,
                last_psn: 0,
                resp_next: 0,
                resp_done: false,
                segs: Vec::new(),
            });
        }
        let in_error = q.state == IBV_QPS_ERR || q.state == IBV_QPS_RESET;
        self.counters.ring_send_wqes += accepted.len() as u64;
        q.sq.extend(accepted);
        if let Some(wr_id) = bad {
            let scq = q.send_cq;
            self.push_cqe(
                scq,
                IbvWc {
                    wr_id,
                    status: IBV_WC_LOC_QP_OP_ERR,
                    opcode: IBV_WC_SEND,
                    qp_num: qpn,
                    ..Default::default()
                },
            );
            self.qp_error(qpn, IBV_EVENT_QP_FATAL);
        } else if in_error {
            self.flush_qp(qpn);
        }
        self.sync_done(qpn);
    }

    /// Take the receive requests the application wrote into a QP's receive ring.
    fn pull_rq(&mut self, qpn: u32) {
        let Some(q) = self.qps.get_mut(&qpn) else {
            return;
        };
        let Some(r) = q.rings.as_mut() else { return };
        let prod = r.rq.prod(&r.map).load(Ordering::Acquire);
        if prod == r.rq_cons {
            return;
        }
        let avail = prod.wrapping_sub(r.rq_cons);
        let max_sge = q.cap.max_recv_sge as usize;
        let mut slot = vec![0u8; r.rq.slot];
        let mut bad = None;
        for _ in 0..avail.min(r.rq.n) {
            r.map.read(r.rq.slot_off(r.rq_cons), &mut slot);
            r.rq_cons = r.rq_cons.wrapping_add(1);
            let wr_id = ring::get_u64(&slot, 0);
            let nsge = ring::get_u32(&slot, 8) as usize;
            if nsge > max_sge {
                bad = Some(wr_id);
                break;
            }
            let sges = (0..nsge)
                .map(|i| {
                    let o = 16 + 16 * i;
                    Sge {
                        addr: ring::get_u64(&slot, o),
                        length: ring::get_u32(&slot, o + 8),
                        lkey: ring::get_u32(&slot, o + 12),
                    }
                })
                .collect();
            q.rq.push_back(RecvWr { wr_id, sges });
            self.counters.ring_recv_wqes += 1;
        }
        let in_error = q.state == IBV_QPS_ERR;
        if let Some(wr_id) = bad {
            let rcq = q.recv_cq;
            self.push_cqe(
                rcq,
                IbvWc {
                    wr_id,
                    status: IBV_WC_LOC_QP_OP_ERR,
                    opcode: IBV_WC_RECV,
                    qp_num: qpn,
                    ..Default::default()
                },
            );
            self.qp_error(qpn, IBV_EVENT_QP_FATAL);
        } else if in_error {
            self.flush_qp(qpn);
        }
        self.sync_done(qpn);
    }

    fn modify_qp(&mut self, qpn: u32, mask: i32, a: &QpAttrs) -> Result<(), i32> {
        let nic_mtu = self.nic.cfg.mtu;
        let q = self.qps.get_mut(&qpn).ok_or(libc::EINVAL)?;
        let cur = q.state;
        if mask & IBV_QP_CUR_STATE != 0 && a.cur_qp_state != cur {
            return Err(libc::EINVAL);
        }
        let new = if mask & IBV_QP_STATE != 0 {
            a.qp_state
        } else {
            cur
        };
        let has = |m: i32| mask & m == m;
        let (required, optional) = match q.qpt {
            IBV_QPT_RC => rc_masks(cur, new),
            IBV_QPT_XRC_SEND | IBV_QPT_XRC_RECV => xrc::masks(q.qpt, cur, new),
            IBV_QPT_UC => uc_masks(cur, new),
            _ => ud_masks(cur, new),
        }
        .ok_or(libc::EINVAL)?;
        if !has(required) {
            return Err(libc::EINVAL);
        }
        let allowed = required | optional | IBV_QP_STATE | IBV_QP_CUR_STATE;
        if new != IBV_QPS_RESET && new != IBV_QPS_ERR && mask & !allowed != 0 {
            return Err(libc::EINVAL);
        }
        // Validate before applying anything.
        if has(IBV_QP_PORT) && a.port_num != 1 {
            return Err(libc::EINVAL);
        }
        if has(IBV_QP_PKEY_INDEX) && a.pkey_index != 0 {
            return Err(libc::EINVAL);
        }
        let mut mtu = q.mtu;
        if has(IBV_QP_PATH_MTU) {
            mtu = match mtu_bytes(a.path_mtu) {
                // The path MTU is bounded by the port's (the NIC model's) MTU.
                Some(m) => m.min(nic_mtu),
                None => return Err(libc::EINVAL),
            };
        }
        let mut remote = q.remote;
        if has(IBV_QP_AV) {
            // RoCE-style port: a GRH with an IPv4-mapped destination GID is required.
            if a.is_global == 0 || a.sgid_index != 0 {
                return Err(libc::EINVAL);
            }
            let ip = device::ip_of_gid(&a.dgid).ok_or(libc::EINVAL)?;
            remote = Some(SocketAddr::V4(SocketAddrV4::new(
                ip,
                device::ENGINE_UDP_PORT,
            )));
        }
        if has(IBV_QP_MAX_QP_RD_ATOMIC) && a.max_rd_atomic as u32 > device::MAX_RD_ATOM {
            return Err(libc::EINVAL);
        }
        if has(IBV_QP_MAX_DEST_RD_ATOMIC) && a.max_dest_rd_atomic as u32 > device::MAX_RD_ATOM {
            return Err(libc::EINVAL);
        }
        // Apply.
        q.mtu = mtu;
        q.remote = remote;
        let t = &mut q.attr;
        if has(IBV_QP_ACCESS_FLAGS) {
            t.access_flags = a.access_flags;
        }
        if has(IBV_QP_PKEY_INDEX) {
            t.pkey_index = a.pkey_index;
        }
        if has(IBV_QP_QKEY) {
            t.qkey = a.qkey;
        }
        if has(IBV_QP_PORT) {
            t.port_num = a.port_num;
        }
        if has(IBV_QP_PATH_MTU) {
            t.path_mtu = a.path_mtu;
        }
        if has(IBV_QP_AV) {
            t.dgid = a.dgid;
            t.sgid_index = a.sgid_index;
            t.hop_limit = a.hop_limit;
            t.is_global = a.is_global;
            t.dlid = a.dlid;
            t.sl = a.sl;
            t.ah_port_num = a.ah_port_num;
        }
        if has(IBV_QP_DEST_QPN) {
            t.dest_qp_num = a.dest_qp_num & wire::PSN_MASK;
        }
        if has(IBV_QP_RQ_PSN) {
            t.rq_psn = a.rq_psn & wire::PSN_MASK;
            q.epsn = t.rq_psn;
        }
        if has(IBV_QP_SQ_PSN) {
            t.sq_psn = a.sq_psn & wire::PSN_MASK;
            q.next_psn = t.sq_psn;
        }
        if has(IBV_QP_MAX_DEST_RD_ATOMIC) {
            t.max_dest_rd_atomic = a.max_dest_rd_atomic;
        }
        if has(IBV_QP_MAX_QP_RD_ATOMIC) {
            t.max_rd_atomic = a.max_rd_atomic;
        }
        if has(IBV_QP_MIN_RNR_TIMER) {
            t.min_rnr_timer = a.min_rnr_timer;
        }
        if has(IBV_QP_TIMEOUT) {
            t.timeout = a.timeout;
        }
        if has(IBV_QP_RETRY_CNT) {
            t.retry_cnt = a.retry_cnt;
        }
        if has(IBV_QP_RNR_RETRY) {
            t.rnr_retry = a.rnr_retry;
        }
        q.state = new;
        match new {
            IBV_QPS_RESET => {
                q.sq.clear();
                q.rq.clear();
                q.inflight.clear();
                q.sq_next = 0;
                q.sq_off = 0;
                q.resend = None;
                q.cur_recv = None;
                q.atomic_cache.clear();
                q.comm_est = false;
                q.remote = None;
                q.attr = QpAttrs::default();
                // Work requests still in the rings are discarded too (as a reset does).
                if let Some(r) = q.rings.as_mut() {
                    r.sq_cons = r.sq.prod(&r.map).load(Ordering::Acquire);
                    r.rq_cons = r.rq.prod(&r.map).load(Ordering::Acquire);
                }
            }
            IBV_QPS_ERR => {
                self.flush_qp(qpn);
                // Whatever the application had posted is flushed too.
                self.pull_sq(qpn);
                self.pull_rq(qpn);
                // flush_qp saw the state already set: the transition's event is raised here.
                if cur != IBV_QPS_ERR {
                    self.last_wqe_reached(qpn);
                }
            }
            IBV_QPS_RTS if cur == IBV_QPS_RTR => q.last_progress = Instant::now(),
            _ => {}
        }
        Ok(())
    }

    /// Move a QP to the error state and complete everything outstanding with WR_FLUSH_ERR.
    fn flush_qp(&mut self, qpn: u32) {
        let Some(q) = self.qps.get_mut(&qpn) else {
            return;
        };
        let entering = q.state != IBV_QPS_ERR;
        q.state = IBV_QPS_ERR;
        let (scq, rcq) = (q.send_cq, q.recv_cq);
        let sq: Vec<SqWqe> = q.sq.drain(..).collect();
        let mut rq: Vec<(u64, u32)> = q.rq.drain(..).map(|r| (r.wr_id, rcq)).collect();
        if let Some(c) = q.cur_recv.take() {
            rq.insert(0, (c.wr_id, c.cq));
        }
        q.inflight.clear();
        q.sq_next = 0;
        q.sq_off = 0;
        q.resend = None;
        for w in sq {
            let wc = IbvWc {
                wr_id: w.wr.wr_id,
                status: IBV_WC_WR_FLUSH_ERR,
                opcode: send_wc_opcode(w.wr.opcode),
                qp_num: qpn,
                ..Default::default()
            };
            self.push_cqe(scq, wc);
        }
        for (id, cq) in rq {
            let wc = IbvWc {
                wr_id: id,
                status: IBV_WC_WR_FLUSH_ERR,
                opcode: IBV_WC_RECV,
                qp_num: qpn,
                ..Default::default()
            };
            self.push_cqe(cq, wc);
        }
        if entering {
            self.last_wqe_reached(qpn);
        }
    }

    /// A QP with an SRQ entered the error state: it will take no more receives from the SRQ
    /// (IBTA's Last WQE Reached; the application may now destroy it safely).
    fn last_wqe_reached(&mut self, qpn: u32) {
        if self.qps.get(&qpn).is_some_and(|q| q.srq != 0) {
            self.raise_qp(qpn, IBV_EVENT_QP_LAST_WQE_REACHED);
        }
    }

    /// The engine moves a QP to the error state on its own (not a completion error of one
    /// request): tell the application with an asynchronous event, as a NIC does.
    fn qp_error(&mut self, qpn: u32, event_type: u32) {
        self.raise_qp(qpn, event_type);
        self.flush_qp(qpn);
    }

    /// Complete the head send WQE with an error and move the QP to the error state.
    fn fail_head(&mut self, qpn: u32, status: i32) {
        let Some(q) = self.qps.get_mut(&qpn) else {
            return;
        };
        if let Some(w) = q.sq.pop_front() {
            let wc = IbvWc {
                wr_id: w.wr.wr_id,
                status,
                opcode: send_wc_opcode(w.wr.opcode),
                qp_num: qpn,
                ..Default::default()
            };
            let scq = q.send_cq;
            self.push_cqe(scq, wc);
        }
        self.flush_qp(qpn);
    }

    fn post_send(&mut self, conn: u64, qpn: u32, wrs: Vec<SendWr>) -> Resp {
        let Some(q) = self.qps.get_mut(&qpn) else {
            return err(libc::EINVAL);
        };
        if q.conn != conn {
            return err(libc::EINVAL);
        }
        let bad = |i: usize, e: i32| Resp::Err {
            errno: e,
            bad_index: i as u32,
        };
        if q.state != IBV_QPS_RTS && q.state != IBV_QPS_ERR {
            return bad(0, libc::EINVAL);
        }
        let mut accepted = Vec::with_capacity(wrs.len());
        // One request is one call: its list is one doorbell.
        for (i, w) in wrs.into_iter().enumerate() {
            if w.sges.len() > q.cap.max_send_sge as usize {
                return self.finish_post(qpn, accepted, Some(bad(i, libc::EINVAL)));
            }
            let len: u64 = match &w.inline {
                Some(b) => b.len() as u64,
                None => w.sges.iter().map(|s| s.length as u64).sum(),
            };
            if let Err(e) = proto::check_send_wr(q.qpt, w.opcode, w.inline.is_some(), len) {
                return self.finish_post(qpn, accepted, Some(bad(i, e)));
            }
            if q.sq.len() + accepted.len() >= q.cap.max_send_wr as usize {
                return self.finish_post(qpn, accepted, Some(bad(i, libc::ENOMEM)));
            }
            let signaled = q.sq_sig_all || w.flags & IBV_SEND_SIGNALED != 0;
            accepted.push(SqWqe {
                wr: w,
                len: len as u32,
                signaled,
                packetized: false,
                doorbell: i == 0,
                fetched: false,
                first_psn: 0,
                last_psn: 0,
                resp_next: 0,
                resp_done: false,
                segs: Vec::new(),
            });
        }
        self.finish_post(qpn, accepted, None)
    }

    fn finish_post(&mut self, qpn: u32, wqes: Vec<SqWqe>, result: Option<Resp>) -> Resp {
        let Some(q) = self.qps.get_mut(&qpn) else {
            return err(libc::EINVAL);
        };
        let in_error = q.state == IBV_QPS_ERR;
        q.sq.extend(wqes);
        if in_error {
            self.flush_qp(qpn);
        }
        result.unwrap_or(Resp::Unit)
    }

    fn post_recv(&mut self, conn: u64, qpn: u32, wrs: Vec<RecvWr>) -> Resp {
        let Some(q) = self.qps.get_mut(&qpn) else {
            return err(libc::EINVAL);
        };
        if q.conn != conn {
            return err(libc::EINVAL);
        }
        // A QP with an SRQ, and an XRC QP, has no receive queue of its own.
        if q.state == IBV_QPS_RESET
            || q.srq != 0
            || matches!(q.qpt, IBV_QPT_XRC_SEND | IBV_QPT_XRC_RECV)
        {
            return Resp::Err {
                errno: libc::EINVAL,
                bad_index: 0,
            };
        }
        let mut result = Resp::Unit;
        for (i, w) in wrs.into_iter().enumerate() {
            if w.sges.len() > q.cap.max_recv_sge as usize {
                result = Resp::Err {
                    errno: libc::EINVAL,
                    bad_index: i as u32,
                };
                break;
            }
            if q.rq.len() >= q.cap.max_recv_wr as usize {
                result = Resp::Err {
                    errno: libc::ENOMEM,
                    bad_index: i as u32,
                };
                break;
            }
            q.rq.push_back(w);
        }
        if q.state == IBV_QPS_ERR {
            self.flush_qp(qpn);
        }
        result
    }

    /// `xrc`: the XRC domain and CQ of an XRC SRQ, (0, 0) for a basic one.
    fn create_srq(
        &mut self,
        conn: u64,
        pid: i32,
        pd: u32,
        (max_wr, max_sge): (u32, u32),
        (xrcd, cq): (u32, u32),
    ) -> Resp {
        if self.pds.get(&pd) != Some(&conn) {
            return err(libc::EINVAL);
        }
        if max_wr == 0 || max_wr > device::MAX_SRQ_WR || max_sge > device::MAX_SGE {
            return err(libc::EINVAL);
        }
        if self.srqs.len() >= device::MAX_SRQ as usize {
            return err(libc::ENOMEM);
        }
        let handle = self.next_handle;
        self.next_handle += 1;
        let max_sge = max_sge.max(1);
        self.srqs.insert(
            handle,
            Srq {
                conn,
                pid,
                pd,
                xrcd,
                cq,
                max_wr,
                max_sge,
                q: VecDeque::new(),
                limit: 0,
                user: 0,
            },
        );
        Resp::Srq {
            handle,
            max_wr,
            max_sge,
            srq_limit: 0,
        }
    }

    /// Resize an SRQ (`IBV_SRQ_MAX_WR`; not below what it holds) and/or arm its limit event
    /// (`IBV_SRQ_LIMIT`; 0 disarms; not above `max_wr`). As the verbs specify, the event fires
    /// when a receive taken from the SRQ leaves fewer than the limit queued — not at arming
    /// time, even if fewer are queued already.
    fn modify_srq(&mut self, conn: u64, srq: u32, mask: i32, max_wr: u32, limit: u32) -> Resp {
        const IBV_SRQ_MAX_WR: i32 = 1;
        const IBV_SRQ_LIMIT: i32 = 2;
        let Some(s) = self.srqs.get_mut(&srq).filter(|s| s.conn == conn) else {
            return err(libc::EINVAL);
        };
        if mask & !(IBV_SRQ_MAX_WR | IBV_SRQ_LIMIT) != 0 {
            return err(libc::EINVAL);
        }
        let new_max = if mask & IBV_SRQ_MAX_WR != 0 {
            if max_wr == 0 || max_wr > device::MAX_SRQ_WR || (max_wr as usize) < s.q.len() {
                return err(libc::EINVAL);
            }
            max_wr
        } else {
            s.max_wr
        };
        if mask & IBV_SRQ_LIMIT != 0 && limit > new_max {
            return err(libc::EINVAL);
        }
        s.max_wr = new_max;
        if mask & IBV_SRQ_LIMIT != 0 {
            s.limit = limit;
        }
        Resp::Unit
    }

    fn post_srq_recv(&mut self, conn: u64, srq: u32, wrs: Vec<RecvWr>) -> Resp {
        let Some(s) = self.srqs.get_mut(&srq).filter(|s| s.conn == conn) else {
            return err(libc::EINVAL);
        };
        for (i, w) in wrs.into_iter().enumerate() {
            let errno = if w.sges.len() > s.max_sge as usize {
                libc::EINVAL
            } else if s.q.len() >= s.max_wr as usize {
                libc::ENOMEM
            } else {
                s.q.push_back(w);
                continue;
            };
            return Resp::Err {
                errno,
                bad_index: i as u32,
            };
        }
        Resp::Unit
    }

    /// The SRQ request `p` to QP `qpn` takes its receive from: the XRC SRQ the packet names
    /// for an XRC target (checked by [`State::xrc_srq`] before), the QP's SRQ otherwise (0:
    /// the QP's own receive queue).
    fn srq_for(&self, qpn: u32, p: &Packet) -> u32 {
        match self.qps.get(&qpn) {
            Some(q) if q.qpt == IBV_QPT_XRC_RECV => p.srqn,
            Some(q) => q.srq,
            None => 0,
        }
    }

    /// Whether a receive is available to request `p` on a QP (from an SRQ or its own queue).
    fn has_recv(&mut self, qpn: u32, p: &Packet) -> bool {
        let srq = self.srq_for(qpn, p);
        if srq != 0 {
            return self.srqs.get(&srq).is_some_and(|s| !s.q.is_empty());
        }
        self.pull_rq(qpn);
        self.qps.get(&qpn).is_some_and(|q| !q.rq.is_empty())
    }

    /// Take the next receive for request `p` on a QP: from the SRQ (whose owner, PD and, for
    /// an XRC SRQ, CQ apply) or from the QP's own queue.
    fn take_recv(&mut self, qpn: u32, p: &Packet) -> Option<Landing> {
        let srq = self.srq_for(qpn, p);
        let q = self.qps.get(&qpn)?;
        let qp_cq = q.recv_cq;
        if srq != 0 {
            let s = self.srqs.get_mut(&srq)?;
            let l = Landing {
                wr: s.q.pop_front()?,
                conn: s.conn,
                pid: s.pid,
                pd: s.pd,
                cq: if s.cq != 0 { s.cq } else { qp_cq },
            };
            if s.limit != 0 && s.q.len() < s.limit as usize {
                s.limit = 0;
                let (conn, user) = (s.conn, s.user);
                self.raise(conn, Obj::Srq(srq), user, IBV_EVENT_SRQ_LIMIT_REACHED);
            }
            return Some(l);
        }
        self.pull_rq(qpn);
        let q = self.qps.get_mut(&qpn)?;
        Some(Landing {
            wr: q.rq.pop_front()?,
            conn: q.conn,
            pid: q.pid,
            pd: q.pd,
            cq: q.recv_cq,
        })
    }

    /// Resolve local SGEs against MRs: same process, same PD, in bounds, access.
    fn resolve_local(
        &self,
        conn: u64,
        pd: u32,
        sges: &[Sge],
        need_write: bool,
    ) -> Option<Vec<(u64, u64)>> {
        let mut v = Vec::with_capacity(sges.len());
        for s in sges {
            if s.length == 0 {
                continue;
            }
            let m = self.mrs.get(&s.lkey)?;
            if m.conn != conn || m.pd != pd {
                return None;
            }
            if need_write && m.access & IBV_ACCESS_LOCAL_WRITE == 0 {
                return None;
            }
            let end = s.addr.checked_add(s.length as u64)?;
            if s.addr < m.addr || end > m.addr + m.len {
                return None;
            }
            v.push((s.addr, s.length as u64));
        }
        Some(v)
    }

    /// Check a remote access against an MR: rkey, PD of the target QP, bounds, access bit.
    /// Remote access through `rkey` arriving on QP `qpn` of PD `pd`: the process to access
    /// if an MR, or a memory window bound over one, grants it for the whole range.
    fn check_remote(
        &self,
        qpn: u32,
        pd: u32,
        rkey: u32,
        addr: u64,
        len: u64,
        access: u32,
    ) -> Option<i32> {
        let m = match self.mrs.get(&rkey) {
            Some(m) => m,
            None => {
                let w = self.mws.get(&(rkey >> 8))?;
                let mr = w.grant(rkey, pd, qpn, addr, len, access)?;
                // The window lies inside its MR, which cannot go while it is bound.
                return self.mrs.get(&mr).map(|m| m.pid);
            }
        };
        if m.pd != pd || m.access & access == 0 {
            return None;
        }
        let end = addr.checked_add(len)?;
        if addr < m.addr || end > m.addr + m.len {
            return None;
        }
        Some(m.pid)
    }

    // -----------------------------------------------------------------------------------------
    // Requester: building packets
    // -----------------------------------------------------------------------------------------

    /// The NIC's fetch unit reads work request `idx` of a QP's send queue unless it already
    /// did: one DMA read of it and the rest of its `ibv_post_send` list, up to
    /// `wqe_fetch_batch` work requests ([`nic::fetch_count`]), costing `wqe_fetch_ns` each,
    /// charged at once so that no other QP's packet starts before the whole read is done.
    fn fetch_wqes(&mut self, qpn: u32, idx: usize, now: Instant) {
        let batch = self.nic.cfg.wqe_fetch_batch;
        let Some(q) = self.qps.get_mut(&qpn) else {
            return;
        };
        if q.sq.get(idx).is_none_or(|w| w.fetched) {
            return;
        }
        let n = nic::fetch_count(q.sq.iter().skip(idx).map(|w| w.doorbell), batch);
        for w in q.sq.iter_mut().skip(idx).take(n as usize) {
            w.fetched = true;
        }
        self.counters.wqe_fetches += u64::from(n);
        self.counters.wqe_fetch_reads += 1;
        let ns = self.nic.cfg.wqe_fetch_ns.saturating_mul(u64::from(n));
        self.nic.charge(now, ns);
    }

    /// Next packet of a QP (retransmission first, then new data), or None.
    fn next_packet(&mut self, qpn: u32, now: Instant) -> Option<(SocketAddr, Vec<u8>)> {
        let q = self.qps.get_mut(&qpn)?;
        if q.state != IBV_QPS_RTS {
            return None;
        }
        if q.qpt == IBV_QPT_UD {
            return self.next_ud_packet(qpn, now);
        }
        let dst = q.remote?;
        if let Some(t) = q.rnr_until {
            if now < t {
                return None;
            }
            q.rnr_until = None;
            q.resend = Some(0);
        }
        if let Some(i) = q.resend {
            if i < q.inflight.len() {
                q.resend = Some(i + 1);
                self.counters.retransmits += 1;
                return Some((dst, q.inflight[i].bytes.clone()));
            }
            q.resend = None;
        }
        if q.inflight.len() >= WINDOW || q.sq_next >= q.sq.len() {
            return None;
        }
        let idx = q.sq_next;
        // Binds and invalidations are work requests the NIC reads like any other.
        self.fetch_wqes(qpn, idx, now);
        let q = self.qps.get_mut(&qpn)?;
        if proto::is_local_wr(q.sq[idx].wr.opcode) {
            self.execute_local(qpn, idx);
            return None;
        }
        if proto::is_atomic_wr(q.sq[idx].wr.opcode) && q.atomics_outstanding() >= q.atomic_limit() {
            // As on hardware, at most max_rd_atomic atomics wait for their responses; this
            // also keeps each of them within the responder's result cache.
            return None;
        }
        // Resolve the local buffers of a WQE when its first packet is built.
        if q.sq_off == 0 && !q.sq[idx].packetized && q.sq[idx].wr.inline.is_none() {
            let (conn, pd) = (q.conn, q.pd);
            // READ and atomics write the local buffer (the data, the original value).
            let op = q.sq[idx].wr.opcode;
            let need_write = op == IBV_WR_RDMA_READ || proto::is_atomic_wr(op);
            let sges = q.sq[idx].wr.sges.clone();
            match self.resolve_local(conn, pd, &sges, need_write) {
                Some(segs) => {
                    let q = self.qps.get_mut(&qpn)?;
                    q.sq[idx].segs = segs;
                }
                None => {
                    self.fail_wqe_local(qpn, idx, IBV_WC_LOC_PROT_ERR);
                    return None;
                }
            }
        }
        let q = self.qps.get_mut(&qpn)?;
        let mtu = q.mtu;
        let psn = q.next_psn;
        let dest_qpn = q.attr.dest_qp_num;
        let pid = q.pid;
        let xrc = q.qpt == IBV_QPT_XRC_SEND;
        let w = &mut q.sq[idx];
        let mut p = Packet {
            dst_qpn: dest_qpn,
            src_qpn: qpn,
            psn,
            msg_len: w.len,
            offset: q.sq_off,
            imm: w.wr.imm,
            remote_addr: w.wr.remote_addr,
            rkey: w.wr.rkey,
            ..Default::default()
        };
        if xrc {
            p.flags |= wire::F_XRC;
            p.srqn = w.wr.xrc_srqn;
        }
        if w.wr.opcode == IBV_WR_RDMA_READ || proto::is_atomic_wr(w.wr.opcode) {
            // One request packet answered by response packets (READ: one PSN per response
            // packet; atomic: one PSN, one 8-byte response).
            let n = if w.wr.opcode == IBV_WR_RDMA_READ {
                p.op = wire::OP_READ_REQ;
                w.len.div_ceil(mtu).max(1)
            } else {
                p.op = if w.wr.opcode == IBV_WR_ATOMIC_CMP_AND_SWP {
                    wire::OP_CMP_SWAP
                } else {
                    wire::OP_FETCH_ADD
                };
                p.payload = atomic_operands(w.wr.compare_add, w.wr.swap);
                1
            };
            p.flags |= wire::F_FIRST | wire::F_LAST | wire::F_ACKREQ;
            w.first_psn = psn;
            w.last_psn = psn_add(psn, n - 1);
            w.resp_next = psn;
            w.packetized = true;
            q.next_psn = psn_add(psn, n);
            q.sq_next += 1;
            let bytes = p.encode();
            let last = w.last_psn;
            q.inflight.push_back(Inflight {
                psn,
                last_psn: last,
                needs_resp: true,
                bytes: bytes.clone(),
            });
            return Some((dst, bytes));
        }
        let off = q.sq_off;
        let chunk = (w.len - off).min(mtu);
        let mut payload = vec![0u8; chunk as usize];
        if let Some(b) = &w.wr.inline {
            payload.copy_from_slice(&b[off as usize..(off + chunk) as usize]);
        } else if gather(pid, &w.segs, off as u64, &mut payload).is_err() {
            self.fail_wqe_local(qpn, idx, IBV_WC_LOC_PROT_ERR);
            return None;
        }
        let q = self.qps.get_mut(&qpn)?;
        let w = &mut q.sq[idx];
        p.op = match w.wr.opcode {
            IBV_WR_SEND | IBV_WR_SEND_WITH_IMM | IBV_WR_SEND_WITH_INV => wire::OP_SEND,
            _ => wire::OP_WRITE,
        };
        if w.wr.opcode == IBV_WR_SEND_WITH_INV {
            p.flags |= wire::F_INV;
        }
        if matches!(
            w.wr.opcode,
            IBV_WR_SEND_WITH_IMM | IBV_WR_RDMA_WRITE_WITH_IMM
        ) {
            p.flags |= wire::F_IMM;
        }
        if off == 0 {
            p.flags |= wire::F_FIRST;
            w.first_psn = psn;
        }
        let last = off + chunk >= w.len;
        if last || psn % ACKREQ_EVERY == 0 {
            p.flags |= wire::F_ACKREQ;
        }
        if last {
            p.flags |= wire::F_LAST;
            if w.wr.flags & IBV_SEND_SOLICITED != 0 {
                p.flags |= wire::F_SOLICITED;
            }
            w.last_psn = psn;
            w.packetized = true;
            q.sq_next += 1;
            q.sq_off = 0;
        } else {
            q.sq_off = off + chunk;
        }
        p.payload = payload;
        q.next_psn = psn_add(psn, 1);
        let bytes = p.encode();
        if q.qpt == IBV_QPT_UC {
            // UC: nothing is acknowledged or resent; a message is complete once sent.
            if last {
                self.complete_sends(qpn, psn);
            }
            return Some((dst, bytes));
        }
        q.inflight.push_back(Inflight {
            psn,
            last_psn: psn,
            needs_resp: false,
            bytes: bytes.clone(),
        });
        Some((dst, bytes))
    }

    /// Next datagram of a UD QP: one work request is one packet to the destination its
    /// address handle named, complete once sent (UD has no acknowledgement). A message longer
    /// than the port MTU is a local length error, as on hardware.
    fn next_ud_packet(&mut self, qpn: u32, now: Instant) -> Option<(SocketAddr, Vec<u8>)> {
        let q = self.qps.get(&qpn)?;
        if q.sq_next >= q.sq.len() {
            return None;
        }
        let idx = q.sq_next;
        self.fetch_wqes(qpn, idx, now);
        let mtu = self.nic.cfg.mtu;
        let q = self.qps.get(&qpn)?;
        let w = &q.sq[idx];
        if w.len > mtu {
            self.fail_wqe_local(qpn, idx, IBV_WC_LOC_LEN_ERR);
            return None;
        }
        // The provider always puts an address handle's IPv4 address here; the ring is
        // application memory, so anything else is refused rather than sent somewhere.
        if w.wr.remote_addr == 0 || w.wr.remote_addr > u64::from(u32::MAX) {
            self.fail_wqe_local(qpn, idx, IBV_WC_LOC_QP_OP_ERR);
            return None;
        }
        let mut payload = vec![0u8; w.len as usize];
        if let Some(b) = &w.wr.inline {
            payload.copy_from_slice(b);
        } else {
            let gathered = self
                .resolve_local(q.conn, q.pd, &w.wr.sges, false)
                .and_then(|segs| gather(q.pid, &segs, 0, &mut payload).ok());
            if gathered.is_none() {
                self.fail_wqe_local(qpn, idx, IBV_WC_LOC_PROT_ERR);
                return None;
            }
        }
        let q = self.qps.get_mut(&qpn)?;
        let w = &mut q.sq[idx];
        // A Q_Key with the high bit set means "use the QP's own" (IBTA 10.2.5).
        let wr_qkey = w.wr.compare_add as u32;
        let qkey = if wr_qkey & 0x8000_0000 != 0 {
            q.attr.qkey
        } else {
            wr_qkey
        };
        let psn = q.next_psn;
        let mut flags = wire::F_FIRST | wire::F_LAST;
        if w.wr.opcode == IBV_WR_SEND_WITH_IMM {
            flags |= wire::F_IMM;
        }
        if w.wr.flags & IBV_SEND_SOLICITED != 0 {
            flags |= wire::F_SOLICITED;
        }
        let p = Packet {
            op: wire::OP_UD_SEND,
            flags,
            dst_qpn: w.wr.rkey & wire::PSN_MASK,
            src_qpn: qpn,
            psn,
            msg_len: w.len,
            imm: w.wr.imm,
            rkey: qkey,
            payload,
            ..Default::default()
        };
        let ip = Ipv4Addr::from(w.wr.remote_addr as u32);
        w.packetized = true;
        w.first_psn = psn;
        w.last_psn = psn;
        q.sq_next += 1;
        q.next_psn = psn_add(psn, 1);
        self.complete_sends(qpn, psn);
        let dst = SocketAddr::V4(SocketAddrV4::new(ip, device::ENGINE_UDP_PORT));
        Some((dst, p.encode()))
    }

    /// A local error while building a WQE: complete it with `status`, QP to error.
    fn fail_wqe_local(&mut self, qpn: u32, idx: usize, status: i32) {
        let Some(q) = self.qps.get_mut(&qpn) else {
            return;
        };
        // Everything before idx completes normally only once acknowledged; a local error
        // moves the QP to the error state, which flushes them (as hardware does).
        let w = q.sq.remove(idx);
        let scq = q.send_cq;
        if let Some(w) = w {
            let wc = IbvWc {
                wr_id: w.wr.wr_id,
                status,
                opcode: send_wc_opcode(w.wr.opcode),
                qp_num: qpn,
                ..Default::default()
            };
            self.push_cqe(scq, wc);
        }
        self.flush_qp(qpn);
    }

    /// Execute the window bind or invalidation at `idx` (the transmitter's next WQE): it takes
    /// effect now, in send-queue order, and completes once everything before it has; a
    /// failure completes it with an error and moves the QP to the error state.
    fn execute_local(&mut self, qpn: u32, idx: usize) {
        let Some(q) = self.qps.get(&qpn) else { return };
        let (conn, pd, wr) = (q.conn, q.pd, q.sq[idx].wr.clone());
        let result = if wr.opcode == IBV_WR_BIND_MW {
            let b = BindReq {
                rkey: wr.rkey,
                mr: (wr.swap >> 32) as u32,
                addr: wr.remote_addr,
                len: wr.compare_add,
                access: wr.swap as u32,
            };
            let mr = self.mrs.get(&b.mr).map(|m| MrView {
                conn: m.conn,
                pd: m.pd,
                addr: m.addr,
                len: m.len,
                access: m.access,
            });
            match self.mws.get_mut(&(b.rkey >> 8)) {
                Some(w) => w.bind(conn, pd, qpn, &b, mr),
                None => Err(IBV_WC_MW_BIND_ERR),
            }
        } else if self.invalidate_mw(conn, pd, qpn, wr.imm) {
            Ok(())
        } else {
            Err(IBV_WC_LOC_PROT_ERR)
        };
        match result {
            Ok(()) => {
                let Some(q) = self.qps.get_mut(&qpn) else {
                    return;
                };
                q.sq[idx].packetized = true;
                q.sq_next += 1;
                if idx == 0 {
                    // Nothing before it: no acknowledgement will come to complete it.
                    self.complete_sends(qpn, 0);
                }
            }
            Err(status) => self.fail_wqe_local(qpn, idx, status),
        }
    }

    /// Invalidate type 2 window `rkey` bound to QP `qpn` (of connection `conn`, PD `pd`).
    fn invalidate_mw(&mut self, conn: u64, pd: u32, qpn: u32, rkey: u32) -> bool {
        self.mws
            .get_mut(&(rkey >> 8))
            .is_some_and(|w| w.invalidate(conn, pd, qpn, rkey))
    }

    /// Pop completed WQEs from the head of the send queue, in order.
    fn complete_sends(&mut self, qpn: u32, acked: u32) {
        let mut cqes = Vec::new();
        let Some(q) = self.qps.get_mut(&qpn) else {
            return;
        };
        while let Some(w) = q.sq.front() {
            if !w.packetized {
                break;
            }
            let done = if proto::is_local_wr(w.wr.opcode) {
                // Executed when the transmitter reached it; done once all before it are.
                true
            } else if w.wr.opcode == IBV_WR_RDMA_READ || proto::is_atomic_wr(w.wr.opcode) {
                w.resp_done
            } else {
                psn_diff(acked, w.last_psn) >= 0
            };
            if !done {
                break;
            }
            let w = q.sq.pop_front().unwrap();
            q.sq_next -= 1;
            if w.signaled {
                cqes.push(IbvWc {
                    wr_id: w.wr.wr_id,
                    status: IBV_WC_SUCCESS,
                    opcode: send_wc_opcode(w.wr.opcode),
                    // READ: the bytes read; atomics: the 8 bytes of the original value.
                    byte_len: if w.wr.opcode == IBV_WR_RDMA_READ || proto::is_atomic_wr(w.wr.opcode)
                    {
                        w.len
                    } else {
                        0
                    },
                    qp_num: qpn,
                    ..Default::default()
                });
            }
        }
        let scq = q.send_cq;
        for c in cqes {
            self.push_cqe(scq, c);
        }
    }

    /// Cumulative acknowledgement up to `psn` (inclusive).
    fn on_ack(&mut self, qpn: u32, psn: u32, now: Instant) {
        let Some(q) = self.qps.get_mut(&qpn) else {
            return;
        };
        let before = q.inflight.len();
        q.inflight
            .retain(|f| f.needs_resp || psn_diff(psn, f.last_psn) < 0);
        if q.inflight.len() != before {
            q.last_progress = now;
            q.retries = 0;
            q.rnr_retries = 0;
            if let Some(r) = q.resend {
                q.resend = Some(r.saturating_sub(before - q.inflight.len()));
            }
        }
        self.complete_sends(qpn, psn);
    }

    /// Timers: retransmission on timeout, retry exhaustion.
    fn timers(&mut self, now: Instant) {
        if !self.tombstones.is_empty() {
            self.tombstones.retain(|_, t| t.until > now);
        }
        let qpns: Vec<u32> = self.qps.keys().copied().collect();
        for qpn in qpns {
            let Some(q) = self.qps.get_mut(&qpn) else {
                continue;
            };
            if q.state != IBV_QPS_RTS || q.inflight.is_empty() || q.rnr_until.is_some() {
                continue;
            }
            if now.duration_since(q.last_progress) < q.timeout() {
                continue;
            }
            q.retries += 1;
            q.last_progress = now;
            if q.retries > q.attr.retry_cnt as u32 {
                self.fail_head(qpn, IBV_WC_RETRY_EXC_ERR);
            } else {
                q.resend = Some(0);
            }
        }
    }

    // -----------------------------------------------------------------------------------------
    // Packets from the wire
    // -----------------------------------------------------------------------------------------

    fn on_packet(&mut self, from: SocketAddr, p: Packet, now: Instant) {
        let Some(q) = self.qps.get(&p.dst_qpn) else {
            if !self.tombstone_rx(from, &p, now) {
                self.counters.rx_dropped_unknown_qp += 1;
            }
            return;
        };
        // UD QPs take datagrams from anyone (the Q_Key decides), and nothing else.
        if q.qpt == IBV_QPT_UD || p.op == wire::OP_UD_SEND {
            if q.qpt == IBV_QPT_UD && p.op == wire::OP_UD_SEND {
                self.touch_qp(p.dst_qpn, now);
                self.ud_rx(from, &p);
            } else {
                self.counters.rx_dropped_unknown_qp += 1;
            }
            return;
        }
        // Only the connected peer may talk to an RC, UC or XRC QP.
        if q.remote != Some(from) || q.attr.dest_qp_num != p.src_qpn {
            self.counters.rx_dropped_unknown_qp += 1;
            return;
        }
        // Requests to an XRC target, and only those, carry the XRC extension; an XRC
        // initiator takes no requests, a target no responses.
        let request = !matches!(
            p.op,
            wire::OP_ACK | wire::OP_NAK | wire::OP_READ_RESP | wire::OP_ATOMIC_RESP
        );
        let misdirected = match q.qpt {
            IBV_QPT_XRC_SEND => request,
            IBV_QPT_XRC_RECV => !request,
            _ => false,
        };
        if misdirected || (p.flags & wire::F_XRC != 0) != (request && q.qpt == IBV_QPT_XRC_RECV) {
            self.counters.rx_dropped_malformed += 1;
            return;
        }
        self.touch_qp(p.dst_qpn, now);
        let qpn = p.dst_qpn;
        if let Some(q) = self
            .qps
            .get_mut(&qpn)
            .filter(|q| q.state == IBV_QPS_RTR && !q.comm_est)
        {
            // IBTA's Communication Established: the first packet from the peer arrived while
            // the QP is still in RTR.
            q.comm_est = true;
            self.raise_qp(qpn, IBV_EVENT_COMM_EST);
        }
        let uc = self.qps[&qpn].qpt == IBV_QPT_UC;
        match p.op {
            // UC has no acknowledgements or responses: such packets are stale by definition.
            wire::OP_ACK | wire::OP_NAK | wire::OP_READ_RESP | wire::OP_ATOMIC_RESP if uc => {
                self.counters.rx_stale += 1
            }
            wire::OP_ACK | wire::OP_NAK | wire::OP_READ_RESP | wire::OP_ATOMIC_RESP => {
                self.requester_rx(p, now)
            }
            wire::OP_SEND | wire::OP_WRITE if uc => self.uc_rx(p),
            _ if uc => self.counters.rx_dropped_malformed += 1,
            _ => self.responder_rx(from, p),
        }
        self.sync_done(qpn);
    }

    fn reply(&mut self, to: SocketAddr, qpn: u32, dst: u32, op: u8, syndrome: u8, psn: u32) {
        let p = Packet {
            op,
            syndrome,
            dst_qpn: dst,
            src_qpn: qpn,
            psn,
            ..Default::default()
        };
        self.emit(to, p.encode());
    }

    fn responder_rx(&mut self, from: SocketAddr, p: Packet) {
        let qpn = p.dst_qpn;
        let Some(q) = self.qps.get_mut(&qpn) else {
            return;
        };
        if q.state != IBV_QPS_RTR && q.state != IBV_QPS_RTS {
            return;
        }
        let peer = p.src_qpn;
        let d = psn_diff(p.psn, q.epsn);
        if p.op == wire::OP_READ_REQ && d < 0 {
            // Duplicate read request: execute it again (reads are idempotent).
            self.counters.rx_duplicate += 1;
            self.do_read(from, &p);
            return;
        }
        if is_atomic_op(p.op) && d < 0 {
            // Duplicate atomic: answer from the result cache, never execute it again.
            self.counters.rx_duplicate += 1;
            self.replay_atomic(from, &p);
            return;
        }
        if d < 0 {
            self.counters.rx_duplicate += 1;
            let e = psn_add(q.epsn, wire::PSN_MASK); // epsn - 1
            self.reply(from, qpn, peer, wire::OP_ACK, 0, e);
            return;
        }
        if d > 0 {
            if !q.nak_sent {
                q.nak_sent = true;
                let e = q.epsn;
                self.reply(from, qpn, peer, wire::OP_NAK, wire::NAK_SEQ, e);
            }
            return;
        }
        // In order. A request to an XRC target must name an SRQ of the target's domain.
        let status = match p.op {
            _ if !self.xrc_srq_ok(qpn, &p) => Err(wire::NAK_REM_INVALID),
            wire::OP_SEND => self.rx_send(qpn, &p),
            wire::OP_WRITE => self.rx_write(qpn, &p),
            wire::OP_CMP_SWAP | wire::OP_FETCH_ADD => self.rx_atomic(from, &p),
            wire::OP_READ_REQ => {
                if self.do_read(from, &p) {
                    let n = p.msg_len.div_ceil(self.qps[&qpn].mtu).max(1);
                    Ok(n)
                } else {
                    Err(wire::NAK_REM_ACCESS)
                }
            }
            _ => return,
        };
        let Some(q) = self.qps.get_mut(&qpn) else {
            return;
        };
        match status {
            Ok(n) => {
                q.epsn = psn_add(q.epsn, n);
                q.nak_sent = false;
                // READ and atomic requests are acknowledged by their responses.
                let answered = p.op == wire::OP_READ_REQ || is_atomic_op(p.op);
                if !answered && p.flags & wire::F_ACKREQ != 0 {
                    let e = psn_add(q.epsn, wire::PSN_MASK);
                    self.reply(from, qpn, peer, wire::OP_ACK, 0, e);
                }
            }
            Err(syn) => {
                if !q.nak_sent || syn != wire::NAK_RNR {
                    q.nak_sent = true;
                    let mut n = Packet {
                        op: wire::OP_NAK,
                        syndrome: syn,
                        dst_qpn: peer,
                        src_qpn: qpn,
                        psn: p.psn,
                        ..Default::default()
                    };
                    n.imm = q.attr.min_rnr_timer as u32;
                    self.emit(from, n.encode());
                }
                if let Some(ev) = responder_error_event(syn) {
                    // Responder errors of class C: the responder QP goes to error as well.
                    self.qp_error(qpn, ev);
                }
            }
        }
    }

    /// A packet for a UC QP. In order: applied like RC, but never acknowledged. A gap (a lost
    /// packet) drops the rest of its message: packets are discarded until the first packet of
    /// a later message, where the PSN is resynchronised (the receive the broken SEND had taken
    /// serves that next message). Packets from before the expected PSN (duplicates) are
    /// dropped, never applied twice. Errors (no receive, access) drop the message silently,
    /// as UC cannot tell the requester.
    fn uc_rx(&mut self, p: Packet) {
        let qpn = p.dst_qpn;
        let Some(q) = self.qps.get_mut(&qpn) else {
            return;
        };
        if q.state != IBV_QPS_RTR && q.state != IBV_QPS_RTS {
            return;
        }
        let first = p.flags & wire::F_FIRST != 0;
        let d = psn_diff(p.psn, q.epsn);
        if d < 0 {
            self.counters.rx_duplicate += 1;
            return;
        }
        if d > 0 || q.uc_broken {
            if !first {
                q.uc_broken = true;
                self.counters.rx_uc_broken += 1;
                return;
            }
            q.uc_broken = false;
            q.epsn = p.psn;
        }
        let status = match p.op {
            wire::OP_SEND => self.rx_send(qpn, &p),
            _ => self.rx_write(qpn, &p),
        };
        let last = p.flags & wire::F_LAST != 0;
        let Some(q) = self.qps.get_mut(&qpn) else {
            return;
        };
        q.epsn = psn_add(p.psn, 1);
        match status {
            Ok(_) => {}
            Err(wire::NAK_RNR) => {
                self.counters.rx_dropped_no_recv += 1;
                q.uc_broken = !last;
            }
            // UC cannot tell the requester: only errors of the QP itself stop it.
            Err(syn @ (wire::NAK_REM_INVALID | wire::NAK_REM_OP)) => {
                if let Some(ev) = responder_error_event(syn) {
                    self.qp_error(qpn, ev);
                }
            }
            Err(_) => q.uc_broken = !last,
        }
    }

    /// A UD datagram for one of our UD QPs: Q_Key checked, then placed after a 40-byte GRH in
    /// the next receive (byte_len counts the GRH, as on hardware). Without a receive posted
    /// the datagram is lost (UD has no RNR).
    fn ud_rx(&mut self, from: SocketAddr, p: &Packet) {
        let qpn = p.dst_qpn;
        let Some(q) = self.qps.get(&qpn) else {
            return;
        };
        if q.state != IBV_QPS_RTR && q.state != IBV_QPS_RTS {
            self.counters.rx_dropped_unknown_qp += 1;
            return;
        }
        let whole = p.flags & (wire::F_FIRST | wire::F_LAST) == wire::F_FIRST | wire::F_LAST;
        if !whole || p.payload.len() != p.msg_len as usize {
            self.counters.rx_dropped_malformed += 1;
            return;
        }
        if p.rkey != q.attr.qkey {
            self.counters.rx_dropped_qkey += 1;
            return;
        }
        let Some(Landing {
            wr: r,
            conn,
            pid,
            pd,
            cq: rcq,
        }) = self.take_recv(qpn, p)
        else {
            self.counters.rx_dropped_no_recv += 1;
            return;
        };
        let mut wc = IbvWc {
            wr_id: r.wr_id,
            status: IBV_WC_SUCCESS,
            opcode: IBV_WC_RECV,
            byte_len: GRH_LEN as u32 + p.msg_len,
            qp_num: qpn,
            src_qp: p.src_qpn,
            wc_flags: IBV_WC_GRH,
            ..Default::default()
        };
        if p.flags & wire::F_IMM != 0 {
            wc.wc_flags |= IBV_WC_WITH_IMM;
            wc.imm_data = p.imm;
        }
        let total: u64 = r.sges.iter().map(|s| s.length as u64).sum();
        match self.resolve_local(conn, pd, &r.sges, true) {
            None => wc.status = IBV_WC_LOC_PROT_ERR,
            Some(_) if total < GRH_LEN as u64 + p.msg_len as u64 => wc.status = IBV_WC_LOC_LEN_ERR,
            Some(segs) => {
                let src = match from {
                    SocketAddr::V4(a) => *a.ip(),
                    SocketAddr::V6(_) => Ipv4Addr::UNSPECIFIED,
                };
                let grh = grh_ipv4(src, self.my_ip, p.msg_len);
                if scatter(pid, &segs, 0, &grh).is_err()
                    || scatter(pid, &segs, GRH_LEN as u64, &p.payload).is_err()
                {
                    wc.status = IBV_WC_LOC_PROT_ERR;
                }
            }
        }
        if wc.status != IBV_WC_SUCCESS {
            wc.byte_len = 0;
            wc.wc_flags = 0;
        }
        self.push_cqe_solicited(rcq, wc, p.flags & wire::F_SOLICITED != 0);
    }

    /// SEND packet in order. Ok(psns consumed) or Err(NAK syndrome).
    fn rx_send(&mut self, qpn: u32, p: &Packet) -> Result<u32, u8> {
        let first = p.flags & wire::F_FIRST != 0;
        let unfinished = first && self.qps.get(&qpn).is_some_and(|q| q.cur_recv.is_some());
        if unfinished {
            // The previous message never finished (UC: its rest was lost): its receive
            // serves this one, as the receive queue's head on hardware would.
            let q = self.qps.get_mut(&qpn).ok_or(wire::NAK_REM_OP)?;
            let total: u64 = q.cur_recv.iter().flat_map(|c| &c.segs).map(|s| s.1).sum();
            if p.msg_len as u64 > total {
                let (wr_id, rcq) = q.cur_recv.take().map_or((0, 0), |c| (c.wr_id, c.cq));
                let wc = IbvWc {
                    wr_id,
                    status: IBV_WC_LOC_LEN_ERR,
                    opcode: IBV_WC_RECV,
                    qp_num: qpn,
                    ..Default::default()
                };
                self.push_cqe(rcq, wc);
                return Err(wire::NAK_REM_INVALID);
            }
        } else if p.flags & wire::F_FIRST != 0 {
            let Some(Landing {
                wr: r,
                conn,
                pid,
                pd,
                cq: rcq,
            }) = self.take_recv(qpn, p)
            else {
                return Err(wire::NAK_RNR);
            };
            let total: u64 = r.sges.iter().map(|s| s.length as u64).sum();
            let segs = self.resolve_local(conn, pd, &r.sges, true);
            let bad = match segs {
                None => Some((IBV_WC_LOC_PROT_ERR, wire::NAK_REM_OP)),
                Some(_) if (p.msg_len as u64) > total => {
                    Some((IBV_WC_LOC_LEN_ERR, wire::NAK_REM_INVALID))
                }
                _ => None,
            };
            if let Some((st, syn)) = bad {
                self.push_cqe(
                    rcq,
                    IbvWc {
                        wr_id: r.wr_id,
                        status: st,
                        opcode: IBV_WC_RECV,
                        qp_num: qpn,
                        ..Default::default()
                    },
                );
                return Err(syn);
            }
            let q = self.qps.get_mut(&qpn).ok_or(wire::NAK_REM_OP)?;
            q.cur_recv = Some(CurRecv {
                wr_id: r.wr_id,
                segs: segs.unwrap_or_default(),
                pid,
                cq: rcq,
            });
        }
        let q = self.qps.get_mut(&qpn).ok_or(wire::NAK_REM_OP)?;
        let Some(cur) = q.cur_recv.as_ref() else {
            return Err(wire::NAK_REM_INVALID);
        };
        if scatter(cur.pid, &cur.segs, p.offset as u64, &p.payload).is_err() {
            return Err(wire::NAK_REM_OP);
        }
        if p.flags & wire::F_LAST != 0 {
            let cur = q.cur_recv.take().unwrap();
            let (rcq, conn, pd) = (cur.cq, q.conn, q.pd);
            let mut wc = IbvWc {
                wr_id: cur.wr_id,
                status: IBV_WC_SUCCESS,
                opcode: IBV_WC_RECV,
                byte_len: p.msg_len,
                qp_num: qpn,
                src_qp: p.src_qpn,
                ..Default::default()
            };
            if p.flags & wire::F_IMM != 0 {
                wc.wc_flags |= IBV_WC_WITH_IMM;
                wc.imm_data = p.imm;
            } else if p.flags & wire::F_INV != 0 {
                // SEND with invalidate: a type 2 window bound to this QP, else an invalid
                // request (the receive completes in error, both QPs go to error).
                if !self.invalidate_mw(conn, pd, qpn, p.imm) {
                    wc.status = IBV_WC_REM_INV_REQ_ERR;
                    wc.byte_len = 0;
                    self.push_cqe(rcq, wc);
                    return Err(wire::NAK_REM_INVALID);
                }
                wc.wc_flags |= IBV_WC_WITH_INV;
                // `invalidated_rkey` shares the union with `imm_data`.
                wc.imm_data = p.imm;
            }
            self.push_cqe_solicited(rcq, wc, p.flags & wire::F_SOLICITED != 0);
        }
        Ok(1)
    }

    fn rx_write(&mut self, qpn: u32, p: &Packet) -> Result<u32, u8> {
        let q = self.qps.get(&qpn).ok_or(wire::NAK_REM_OP)?;
        if q.attr.access_flags & IBV_ACCESS_REMOTE_WRITE == 0 {
            return Err(wire::NAK_REM_ACCESS);
        }
        let pd = self.responder_pd(qpn, p).ok_or(wire::NAK_REM_INVALID)?;
        if p.flags & wire::F_FIRST != 0
            && self
                .check_remote(
                    qpn,
                    pd,
                    p.rkey,
                    p.remote_addr,
                    p.msg_len as u64,
                    IBV_ACCESS_REMOTE_WRITE,
                )
                .is_none()
        {
            return Err(wire::NAK_REM_ACCESS);
        }
        let addr = p
            .remote_addr
            .checked_add(p.offset as u64)
            .ok_or(wire::NAK_REM_ACCESS)?;
        let pid = self
            .check_remote(
                qpn,
                pd,
                p.rkey,
                addr,
                p.payload.len() as u64,
                IBV_ACCESS_REMOTE_WRITE,
            )
            .ok_or(wire::NAK_REM_ACCESS)?;
        let imm_last = p.flags & wire::F_IMM != 0 && p.flags & wire::F_LAST != 0;
        if imm_last && !self.has_recv(qpn, p) {
            return Err(wire::NAK_RNR);
        }
        if !p.payload.is_empty() && write_mem(pid, addr, &p.payload).is_err() {
            return Err(wire::NAK_REM_ACCESS);
        }
        if imm_last {
            let l = self.take_recv(qpn, p).ok_or(wire::NAK_RNR)?;
            self.push_cqe_solicited(
                l.cq,
                IbvWc {
                    wr_id: l.wr.wr_id,
                    status: IBV_WC_SUCCESS,
                    opcode: IBV_WC_RECV_RDMA_WITH_IMM,
                    byte_len: p.msg_len,
                    imm_data: p.imm,
                    wc_flags: IBV_WC_WITH_IMM,
                    qp_num: qpn,
                    src_qp: p.src_qpn,
                    ..Default::default()
                },
                p.flags & wire::F_SOLICITED != 0,
            );
        }
        Ok(1)
    }

    /// Execute an in-order atomic request and answer it with the original value. Every atomic
    /// of this host's NICs runs under the engine's one state lock, so atomics from any number
    /// of requesters on one target are serialised (atomicity `IBV_ATOMIC_HCA`: against other
    /// atomics through this NIC, not against the target process's own CPU stores).
    fn rx_atomic(&mut self, from: SocketAddr, p: &Packet) -> Result<u32, u8> {
        let qpn = p.dst_qpn;
        let q = self.qps.get(&qpn).ok_or(wire::NAK_REM_OP)?;
        if q.attr.access_flags & IBV_ACCESS_REMOTE_ATOMIC == 0 {
            return Err(wire::NAK_REM_ACCESS);
        }
        // The target must be a naturally aligned 8-byte word (IBTA o9-19: otherwise an
        // invalid request).
        if p.payload.len() != 16 || p.remote_addr % 8 != 0 {
            return Err(wire::NAK_REM_INVALID);
        }
        let pd = self.responder_pd(qpn, p).ok_or(wire::NAK_REM_INVALID)?;
        let pid = self
            .check_remote(qpn, pd, p.rkey, p.remote_addr, 8, IBV_ACCESS_REMOTE_ATOMIC)
            .ok_or(wire::NAK_REM_ACCESS)?;
        let operand = u64::from_le_bytes(p.payload[..8].try_into().unwrap());
        let swap = u64::from_le_bytes(p.payload[8..].try_into().unwrap());
        let mut word = [0u8; 8];
        read_mem(pid, p.remote_addr, &mut word).map_err(|_| wire::NAK_REM_ACCESS)?;
        // The target word is in the target host's byte order (as rxe and siw do).
        let orig = u64::from_ne_bytes(word);
        let new = match p.op {
            wire::OP_CMP_SWAP => (orig == operand).then_some(swap),
            _ => Some(orig.wrapping_add(operand)),
        };
        if let Some(v) = new {
            write_mem(pid, p.remote_addr, &v.to_ne_bytes()).map_err(|_| wire::NAK_REM_ACCESS)?;
        }
        let q = self.qps.get_mut(&qpn).ok_or(wire::NAK_REM_OP)?;
        if q.atomic_cache.len() >= ATOMIC_CACHE {
            q.atomic_cache.pop_front();
        }
        q.atomic_cache.push_back((p.psn, orig));
        self.atomic_resp(from, qpn, p.src_qpn, p.psn, orig);
        Ok(1)
    }

    /// A duplicate atomic request: resend the cached response. One no longer cached is
    /// dropped: its requester cannot still be waiting for it (see [`ATOMIC_CACHE`]), so this
    /// is a late copy or a replay.
    fn replay_atomic(&mut self, from: SocketAddr, p: &Packet) {
        let Some(q) = self.qps.get(&p.dst_qpn) else {
            return;
        };
        let cached = q.atomic_cache.iter().find(|(psn, _)| *psn == p.psn);
        if let Some(&(_, orig)) = cached {
            self.atomic_resp(from, p.dst_qpn, p.src_qpn, p.psn, orig);
        }
    }

    fn atomic_resp(&mut self, to: SocketAddr, qpn: u32, dst: u32, psn: u32, orig: u64) {
        let r = Packet {
            op: wire::OP_ATOMIC_RESP,
            flags: wire::F_FIRST | wire::F_LAST,
            dst_qpn: dst,
            src_qpn: qpn,
            psn,
            msg_len: 8,
            payload: orig.to_le_bytes().to_vec(),
            ..Default::default()
        };
        self.emit(to, r.encode());
    }

    /// Execute a read request: send the response packets. false if access is refused.
    fn do_read(&mut self, to: SocketAddr, p: &Packet) -> bool {
        let qpn = p.dst_qpn;
        let Some(q) = self.qps.get(&qpn) else {
            return false;
        };
        if q.attr.access_flags & IBV_ACCESS_REMOTE_READ == 0 {
            return false;
        }
        let mtu = q.mtu;
        let Some(pd) = self.responder_pd(qpn, p) else {
            return false;
        };
        let len = p.msg_len as u64;
        let pid = if len == 0 {
            0
        } else {
            match self.check_remote(
                p.dst_qpn,
                pd,
                p.rkey,
                p.remote_addr,
                len,
                IBV_ACCESS_REMOTE_READ,
            ) {
                Some(pid) => pid,
                None => return false,
            }
        };
        let n = p.msg_len.div_ceil(mtu).max(1);
        for i in 0..n {
            let off = i * mtu;
            let chunk = (p.msg_len - off).min(mtu);
            let mut payload = vec![0u8; chunk as usize];
            if chunk > 0 && read_mem(pid, p.remote_addr + off as u64, &mut payload).is_err() {
                return false;
            }
            let r = Packet {
                op: wire::OP_READ_RESP,
                flags: if i + 1 == n { wire::F_LAST } else { 0 },
                dst_qpn: p.src_qpn,
                src_qpn: qpn,
                psn: psn_add(p.psn, i),
                msg_len: p.msg_len,
                offset: off,
                payload,
                ..Default::default()
            };
            self.emit(to, r.encode());
        }
        true
    }

    fn requester_rx(&mut self, p: Packet, now: Instant) {
        let qpn = p.dst_qpn;
        let Some(q) = self.qps.get_mut(&qpn) else {
            return;
        };
        if q.state != IBV_QPS_RTS {
            return;
        }
        // Ignore anything outside [oldest unacked, next_psn).
        let Some(oldest) = q.inflight.front().map(|f| f.psn) else {
            self.counters.rx_stale += 1;
            return;
        };
        if psn_diff(p.psn, oldest) < 0 || psn_diff(p.psn, q.next_psn) >= 0 {
            self.counters.rx_stale += 1;
            return;
        }
        match p.op {
            wire::OP_ACK => self.on_ack(qpn, p.psn, now),
            wire::OP_ATOMIC_RESP => self.on_atomic_resp(qpn, &p, now),
            wire::OP_READ_RESP => {
                // Find the read WQE this response belongs to.
                let Some(idx) = q.sq.iter().position(|w| {
                    w.packetized
                        && w.wr.opcode == IBV_WR_RDMA_READ
                        && psn_diff(p.psn, w.first_psn) >= 0
                        && psn_diff(p.psn, w.last_psn) <= 0
                }) else {
                    return;
                };
                let pid = q.pid;
                let w = &mut q.sq[idx];
                if p.psn != w.resp_next || w.resp_done {
                    self.counters.rx_stale += 1;
                    return; // duplicate or out of order: the timer recovers
                }
                if scatter(pid, &w.segs, p.offset as u64, &p.payload).is_err() {
                    self.fail_head(qpn, IBV_WC_LOC_PROT_ERR);
                    return;
                }
                w.resp_next = psn_add(p.psn, 1);
                let first = w.first_psn;
                let done = p.psn == w.last_psn;
                if done {
                    w.resp_done = true;
                    q.remove_inflight(first);
                }
                q.last_progress = now;
                q.retries = 0;
                // A response implicitly acknowledges everything before the read; the last
                // one completes the read itself.
                let acked = if done {
                    p.psn
                } else {
                    psn_add(first, wire::PSN_MASK)
                };
                self.on_ack(qpn, acked, now);
            }
            wire::OP_NAK => {
                let acked = psn_add(p.psn, wire::PSN_MASK);
                match p.syndrome {
                    wire::NAK_SEQ => {
                        self.on_ack(qpn, acked, now);
                        if let Some(q) = self.qps.get_mut(&qpn) {
                            q.resend = Some(0);
                        }
                    }
                    wire::NAK_RNR => {
                        self.on_ack(qpn, acked, now);
                        let Some(q) = self.qps.get_mut(&qpn) else {
                            return;
                        };
                        q.rnr_retries += 1;
                        if q.attr.rnr_retry != 7 && q.rnr_retries > q.attr.rnr_retry as u32 {
                            self.fail_head(qpn, IBV_WC_RNR_RETRY_EXC_ERR);
                            return;
                        }
                        q.rnr_until = Some(now + rnr_delay(p.imm as u8));
                        q.last_progress = now;
                    }
                    syn => {
                        self.on_ack(qpn, acked, now);
                        let status = match syn {
                            wire::NAK_REM_ACCESS => IBV_WC_REM_ACCESS_ERR,
                            wire::NAK_REM_INVALID => IBV_WC_REM_INV_REQ_ERR,
                            _ => IBV_WC_REM_OP_ERR,
                        };
                        self.fail_head(qpn, status);
                    }
                }
            }
            _ => {}
        }
    }

    /// The response to one of our atomics: write the original value into the WQE's local
    /// buffer; the WQE is complete, and so is everything before it (implicit ACK).
    fn on_atomic_resp(&mut self, qpn: u32, p: &Packet, now: Instant) {
        let Some(q) = self.qps.get_mut(&qpn) else {
            return;
        };
        let pid = q.pid;
        let found = q
            .sq
            .iter()
            .position(|w| w.packetized && proto::is_atomic_wr(w.wr.opcode) && w.first_psn == p.psn);
        let Some(idx) = found else {
            self.counters.rx_stale += 1;
            return;
        };
        let w = &mut q.sq[idx];
        if w.resp_done || p.payload.len() != 8 {
            self.counters.rx_stale += 1;
            return; // a duplicate response (or a malformed one: the timer recovers)
        }
        let orig = u64::from_le_bytes(p.payload[..].try_into().unwrap());
        if scatter(pid, &w.segs, 0, &orig.to_ne_bytes()).is_err() {
            self.fail_head(qpn, IBV_WC_LOC_PROT_ERR);
            return;
        }
        w.resp_done = true;
        q.remove_inflight(p.psn);
        q.last_progress = now;
        q.retries = 0;
        self.on_ack(qpn, p.psn, now);
    }

    fn drop_conn(&mut self, conn: u64) {
        let qpns: Vec<u32> = self
            .qps
            .iter()
            .filter(|(_, q)| q.conn == conn)
            .map(|(k, _)| *k)
            .collect();
        for q in &qpns {
            self.remove_qp(*q);
        }
        self.srqs.retain(|_, s| s.conn != conn);
        self.forget_xrcd_opens(conn);
        self.mws.retain(|_, w| w.conn != conn);
        self.mrs.retain(|_, m| m.conn != conn);
        self.cqs.retain(|_, c| c.conn != conn);
        self.channels.retain(|_, c| c.conn != conn);
        self.pds.retain(|_, c| *c != conn);
    }
}

/// Required and optional attribute masks of an RC QP's transition (IBTA).
fn rc_masks(cur: i32, new: i32) -> Option<(i32, i32)> {
    Some(match (cur, new) {
        (_, IBV_QPS_RESET) | (_, IBV_QPS_ERR) => (0, 0),
        (IBV_QPS_RESET, IBV_QPS_INIT) => (IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS, 0),
        (IBV_QPS_INIT, IBV_QPS_INIT) => (0, IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS),
        (IBV_QPS_INIT, IBV_QPS_RTR) => (
            IBV_QP_AV
                | IBV_QP_PATH_MTU
                | IBV_QP_DEST_QPN
                | IBV_QP_RQ_PSN
                | IBV_QP_MAX_DEST_RD_ATOMIC
                | IBV_QP_MIN_RNR_TIMER,
            IBV_QP_PKEY_INDEX | IBV_QP_ACCESS_FLAGS,
        ),
        (IBV_QPS_RTR, IBV_QPS_RTS) => (
            IBV_QP_SQ_PSN
                | IBV_QP_TIMEOUT
                | IBV_QP_RETRY_CNT
                | IBV_QP_RNR_RETRY
                | IBV_QP_MAX_QP_RD_ATOMIC,
            IBV_QP_ACCESS_FLAGS | IBV_QP_MIN_RNR_TIMER,
        ),
        (IBV_QPS_RTS, IBV_QPS_RTS) => (0, IBV_QP_ACCESS_FLAGS | IBV_QP_MIN_RNR_TIMER),
        _ => return None,
    })
}
/// Required and optional attribute masks of a UC QP's transition (IBTA: no acknowledgement,
/// hence no timeout, retry, RNR or RDMA READ/atomic attributes).
fn uc_masks(cur: i32, new: i32) -> Option<(i32, i32)> {
    Some(match (cur, new) {
        (_, IBV_QPS_RESET) | (_, IBV_QPS_ERR) => (0, 0),
        (IBV_QPS_RESET, IBV_QPS_INIT) => (IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS, 0),
        (IBV_QPS_INIT, IBV_QPS_INIT) => (0, IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS),
        (IBV_QPS_INIT, IBV_QPS_RTR) => (
            IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN,
            IBV_QP_PKEY_INDEX | IBV_QP_ACCESS_FLAGS,
        ),
        (IBV_QPS_RTR, IBV_QPS_RTS) => (IBV_QP_SQ_PSN, IBV_QP_ACCESS_FLAGS),
        (IBV_QPS_RTS, IBV_QPS_RTS) => (0, IBV_QP_ACCESS_FLAGS),
        _ => return None,
    })
}

/// Required and optional attribute masks of a UD QP's transition (IBTA: a Q_Key instead of
/// access flags; no address, MTU or remote QPN — every send names its destination).
fn ud_masks(cur: i32, new: i32) -> Option<(i32, i32)> {
    Some(match (cur, new) {
        (_, IBV_QPS_RESET) | (_, IBV_QPS_ERR) => (0, 0),
        (IBV_QPS_RESET, IBV_QPS_INIT) => (IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_QKEY, 0),
        (IBV_QPS_INIT, IBV_QPS_INIT) => (0, IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_QKEY),
        (IBV_QPS_INIT, IBV_QPS_RTR) => (0, IBV_QP_PKEY_INDEX | IBV_QP_QKEY),
        (IBV_QPS_RTR, IBV_QPS_RTS) => (IBV_QP_SQ_PSN, IBV_QP_QKEY),
        (IBV_QPS_RTS, IBV_QPS_RTS) => (0, IBV_QP_QKEY),
        _ => return None,
    })
}

/// RNR NAK timer values (IBTA table, in ms; 0 means 655.36 ms).
fn rnr_delay(code: u8) -> Duration {
    const US: [u64; 32] = [
        655_360, 10, 20, 30, 40, 60, 80, 120, 160, 240, 320, 480, 640, 960, 1_280, 1_920, 2_560,
        3_840, 5_120, 7_680, 10_240, 15_360, 20_480, 30_720, 40_960, 61_440, 81_920, 122_880,
        163_840, 245_760, 327_680, 491_520,
    ];
    Duration::from_micros(US[(code & 31) as usize])
}

/// Bytes of the GRH in front of every UD receive.
const GRH_LEN: usize = 40;

/// The 40-byte GRH area of a UD receive for RoCE v2 over IPv4: as on hardware, the first 20
/// bytes are unused and the last 20 hold the IPv4 header of the datagram (version 4, TTL 64,
/// protocol UDP, source and destination, header checksum), which is what
/// `ibv_init_ah_from_wc` parses.
fn grh_ipv4(src: Ipv4Addr, dst: Ipv4Addr, payload_len: u32) -> [u8; GRH_LEN] {
    let mut g = [0u8; GRH_LEN];
    let h = &mut g[20..];
    // IPv4 + UDP + BTH + DETH + payload + ICRC, as the datagram would be on the wire.
    let total = (20 + 8 + 12 + 8 + 4 + payload_len).min(u16::MAX as u32) as u16;
    h[0] = 0x45;
    h[2..4].copy_from_slice(&total.to_be_bytes());
    h[6] = 0x40; // don't fragment
    h[8] = 64;
    h[9] = 17;
    h[12..16].copy_from_slice(&src.octets());
    h[16..20].copy_from_slice(&dst.octets());
    let mut sum: u32 = h
        .chunks(2)
        .map(|c| u32::from(u16::from_be_bytes([c[0], c[1]])))
        .sum();
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    h[10..12].copy_from_slice(&(!(sum as u16)).to_be_bytes());
    g
}

/// Whether a wire op is an atomic request.
fn is_atomic_op(op: u8) -> bool {
    matches!(op, wire::OP_CMP_SWAP | wire::OP_FETCH_ADD)
}

/// Payload of an atomic request: the compare/add operand and the swap value, little endian.
fn atomic_operands(compare_add: u64, swap: u64) -> Vec<u8> {
    let mut v = Vec::with_capacity(16);
    v.extend_from_slice(&compare_add.to_le_bytes());
    v.extend_from_slice(&swap.to_le_bytes());
    v
}

fn send_wc_opcode(wr_opcode: i32) -> i32 {
    match wr_opcode {
        IBV_WR_RDMA_WRITE | IBV_WR_RDMA_WRITE_WITH_IMM => IBV_WC_RDMA_WRITE,
        IBV_WR_RDMA_READ => IBV_WC_RDMA_READ,
        IBV_WR_ATOMIC_CMP_AND_SWP => IBV_WC_COMP_SWAP,
        IBV_WR_ATOMIC_FETCH_AND_ADD => IBV_WC_FETCH_ADD,
        IBV_WR_BIND_MW => IBV_WC_BIND_MW,
        IBV_WR_LOCAL_INV => IBV_WC_LOCAL_INV,
        _ => IBV_WC_SEND,
    }
}

// ---------------------------------------------------------------------------------------------
// Threads
// ---------------------------------------------------------------------------------------------

/// The asynchronous event of an RC responder error that moves the responder's QP to the error
/// state (IBTA class C): an invalid request (e.g. a misaligned atomic, a message larger than
/// the receive) is `IBV_EVENT_QP_REQ_ERR`, an access violation (rkey, bounds, rights)
/// `QP_ACCESS_ERR`, a local failure while executing it `QP_FATAL`.
fn responder_error_event(syndrome: u8) -> Option<u32> {
    match syndrome {
        wire::NAK_REM_INVALID => Some(IBV_EVENT_QP_REQ_ERR),
        wire::NAK_REM_ACCESS => Some(IBV_EVENT_QP_ACCESS_ERR),
        wire::NAK_REM_OP => Some(IBV_EVENT_QP_FATAL),
        _ => None,
    }
}

/// Send `bytes` on an event stream without blocking (a process that does not read its events
/// cannot stall the engine). Whether all of it was sent.
fn send_nowait(sink: &UnixStream, bytes: &[u8]) -> bool {
    // SAFETY: sends from a live buffer of the given length on a socket we own.
    let n = unsafe {
        libc::send(
            sink.as_raw_fd(),
            bytes.as_ptr() as *const libc::c_void,
            bytes.len(),
            libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
        )
    };
    n == bytes.len() as isize
}

fn peer_pid(s: &UnixStream) -> io::Result<i32> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: cred and len are valid out-parameters of the sizes passed.
    let r = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            &mut cred as *mut _ as *mut libc::c_void,
            &mut len,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(cred.pid)
}

fn serve_conn(sh: Arc<Shared>, mut s: UnixStream, conn: u64) {
    let pid = match peer_pid(&s) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("softrnic engine: SO_PEERCRED: {e}");
            return;
        }
    };
    let mut first = true;
    while let Ok(body) = proto::read_frame(&mut s) {
        if std::mem::take(&mut first) {
            if let Ok(Req::AttachChannel { id, token }) = Req::decode(&body) {
                serve_channel(&sh, s, pid, id, token);
                return;
            }
        }
        let resp = match Req::decode(&body) {
            Ok(req) => {
                let mut st = sh.lock();
                let r = st.request(conn, pid, req);
                sh.flush_out(&mut st);
                drop(st);
                sh.kick();
                r
            }
            Err(_) => err(libc::EINVAL),
        };
        if proto::write_frame(&mut s, &resp.encode()).is_err() {
            break;
        }
    }
    sh.lock().drop_conn(conn);
}

/// A channel's event connection: attach it, then wait for the process to close it.
fn serve_channel(sh: &Shared, mut s: UnixStream, pid: i32, id: u32, token: u64) {
    let resp = match s.try_clone() {
        Ok(sink) => sh.lock().attach_channel(pid, id, token, sink),
        Err(_) => err(libc::ENOMEM),
    };
    let ok = resp == Resp::Unit;
    if proto::write_frame(&mut s, &resp.encode()).is_err() || !ok {
        return;
    }
    // Nothing more is sent on this connection; EOF means the channel was destroyed.
    while proto::read_frame(&mut s).is_ok() {}
    let mut st = sh.lock();
    st.channels.remove(&id);
    for c in st.cqs.values_mut().filter(|c| c.channel == id) {
        c.channel = 0;
        c.armed = false;
    }
}

/// A secret that only the process that created a channel learns.
fn random_u64() -> u64 {
    let mut b = [0u8; 8];
    // SAFETY: getrandom writes at most b.len() bytes into b.
    let n = unsafe { libc::getrandom(b.as_mut_ptr() as *mut libc::c_void, b.len(), 0) };
    if n == 8 {
        return u64::from_ne_bytes(b);
    }
    // No getrandom: the clock's nanoseconds, mixed (the socket is root-only anyway).
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    crate::faults::Rng::new(t ^ u64::from(std::process::id())).next_u64()
}

fn rx_loop(sh: Arc<Shared>) {
    let mut buf = vec![0u8; 65536];
    loop {
        let got = if sh.gso {
            recv_gro(&sh.udp, &mut buf)
        } else {
            sh.udp.recv_from(&mut buf).map(|(n, f)| (n, f, None))
        };
        let (n, from, seg) = match got {
            Ok(v) => v,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => {
                eprintln!("softrnic engine: udp receive: {e}");
                std::thread::sleep(TICK);
                continue;
            }
        };
        let mut st = sh.lock();
        if !st.port_up {
            st.counters.port_down_dropped += 1;
            continue;
        }
        // Only requester-side packets (ACK, NAK, READ response) can give the transmitter
        // something to do (a window opens, a resend is due); a responder answers by itself.
        let mut wake = false;
        // With GRO the kernel may have coalesced datagrams of one size (the last may be
        // shorter): each is one packet.
        let seg = seg.unwrap_or(n).max(1);
        let mut off = 0;
        // (A zero-length datagram is one packet too: malformed.)
        while off < n || (n == 0 && off == 0) {
            let d = &buf[off..(off + seg).min(n)];
            off += seg;
            st.counters.rx_packets += 1;
            match Packet::decode(d) {
                Some(p) => {
                    wake |= matches!(
                        p.op,
                        wire::OP_ACK | wire::OP_NAK | wire::OP_READ_RESP | wire::OP_ATOMIC_RESP
                    );
                    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        st.on_packet(from, p, Instant::now())
                    }));
                    if r.is_err() {
                        st.counters.rx_handler_panics += 1;
                        eprintln!("softrnic engine: BUG: panic while handling a packet (dropped)");
                    }
                }
                None => st.counters.rx_dropped_malformed += 1,
            }
        }
        sh.flush_out(&mut st);
        drop(st);
        if wake {
            sh.kick();
        }
    }
}

fn tx_loop(sh: Arc<Shared>, stats: Option<PathBuf>, port_state: Option<PathBuf>) {
    let mut st = sh.lock();
    let mut written = Counters::default();
    let mut last_write = Instant::now();
    let mut port_checked = Instant::now();
    loop {
        // Read before scanning the rings: a post after this makes the wait below return.
        let seen = sh.db.seq();
        let now = Instant::now();
        if let Some(p) = port_state.as_ref() {
            if now.duration_since(port_checked) >= PORT_CHECK_EVERY {
                port_checked = now;
                if let Ok(s) = std::fs::read_to_string(p) {
                    st.set_port(device::port_is_up(&s));
                }
            }
        }
        st.timers(now);
        let next_held = sh.flush_held(&mut st, now);
        if let Some(path) = &stats {
            if now.duration_since(last_write) >= STATS_EVERY && st.counters != written {
                written = st.counters;
                last_write = now;
                write_stats(path, &written);
            }
        }
        let mut sent = 0usize;
        let mut paced = None;
        // One packet at a time, round robin over the QPs with work, while the NIC model's
        // pipeline clock allows; a bounded burst per wakeup.
        for _ in 0..TX_BURST {
            let now = Instant::now();
            if let Some(w) = st.nic.wait(now) {
                paced = Some(w);
                break;
            }
            if st.tx_one(now).is_none() {
                break;
            }
            sent += 1;
        }
        sh.flush_out(&mut st);
        if sent == 0 {
            let wait = next_held
                .map(|t| t.saturating_duration_since(now).min(TICK))
                .unwrap_or(TICK);
            drop(st);
            match paced {
                // Work is waiting for the NIC model's clock: nothing can go out before then.
                Some(p) => std::thread::sleep(wait.min(p.max(Duration::from_micros(10)))),
                None => sh.db.wait(seen, wait),
            }
            st = sh.lock();
        } else {
            // Let receivers and verbs in between bursts.
            drop(st);
            std::thread::yield_now();
            st = sh.lock();
        }
    }
}

const SOL_UDP: libc::c_int = 17;
const UDP_SEGMENT: libc::c_int = 103;
const UDP_GRO: libc::c_int = 104;
/// Most bytes and segments in one GSO send.
const GSO_MAX_BYTES: usize = 60_000;
const GSO_MAX_SEGS: usize = 64;

/// Send `out` (drained), handing each run of consecutive packets to the same destination
/// whose sizes are equal (the last may be shorter) to the kernel as one `sendmsg` with
/// `UDP_SEGMENT`: the kernel cuts it back into exactly these datagrams (or passes it whole to
/// a receiver with UDP GRO, which splits it at the same boundaries). Returns packets sent.
fn send_batched(udp: &UdpSocket, out: &mut Vec<(SocketAddr, Vec<u8>)>) -> u64 {
    let mut sent = 0u64;
    let mut i = 0;
    while i < out.len() {
        let (dst, seg) = (out[i].0, out[i].1.len());
        let mut j = i + 1;
        let mut bytes = seg;
        while j < out.len()
            && j - i < GSO_MAX_SEGS
            && out[j].0 == dst
            && out[j].1.len() <= seg
            && bytes + out[j].1.len() <= GSO_MAX_BYTES
            && out[j - 1].1.len() == seg
        {
            bytes += out[j].1.len();
            j += 1;
        }
        if j - i == 1 || !send_gso(udp, dst, seg, &out[i..j]) {
            for (d, b) in &out[i..j] {
                if udp.send_to(b, *d).is_ok() {
                    sent += 1;
                }
            }
        } else {
            sent += (j - i) as u64;
        }
        i = j;
    }
    out.clear();
    sent
}

/// One `sendmsg` of `pkts` (all to `dst`) with `UDP_SEGMENT = seg`. false if it failed.
fn send_gso(udp: &UdpSocket, dst: SocketAddr, seg: usize, pkts: &[(SocketAddr, Vec<u8>)]) -> bool {
    let SocketAddr::V4(d) = dst else { return false };
    let mut iov: Vec<libc::iovec> = pkts
        .iter()
        .map(|(_, b)| libc::iovec {
            iov_base: b.as_ptr() as *mut libc::c_void,
            iov_len: b.len(),
        })
        .collect();
    // SAFETY: sockaddr_in and msghdr are plain C data for which all-zero is valid.
    let mut sa: libc::sockaddr_in = unsafe { std::mem::zeroed() };
    sa.sin_family = libc::AF_INET as libc::sa_family_t;
    sa.sin_port = d.port().to_be();
    sa.sin_addr.s_addr = u32::from_ne_bytes(d.ip().octets());
    // SAFETY: CMSG_SPACE is a pure computation.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<u16>() as u32) } as usize;
    let mut cbuf = vec![0u64; space.div_ceil(8)];
    // SAFETY: as above.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_name = &mut sa as *mut _ as *mut libc::c_void;
    msg.msg_namelen = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    msg.msg_iov = iov.as_mut_ptr();
    msg.msg_iovlen = iov.len();
    msg.msg_control = cbuf.as_mut_ptr() as *mut libc::c_void;
    msg.msg_controllen = space;
    // SAFETY: msg points to live buffers (address, iovecs into `pkts`, control buffer of
    // `space` bytes); the cmsg macros stay within the control buffer.
    unsafe {
        let c = libc::CMSG_FIRSTHDR(&msg);
        (*c).cmsg_level = SOL_UDP;
        (*c).cmsg_type = UDP_SEGMENT;
        (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<u16>() as u32) as usize;
        std::ptr::write_unaligned(libc::CMSG_DATA(c) as *mut u16, seg as u16);
        libc::sendmsg(udp.as_raw_fd(), &msg, 0) >= 0
    }
}

/// Turn UDP GRO on (the kernel may then deliver several same-size datagrams of a flow as one
/// buffer with their size in a control message). false if the kernel refuses.
fn enable_gro(udp: &UdpSocket) -> bool {
    let one: libc::c_int = 1;
    // SAFETY: setsockopt reads sizeof(c_int) bytes from a valid c_int.
    unsafe {
        libc::setsockopt(
            udp.as_raw_fd(),
            SOL_UDP,
            UDP_GRO,
            &one as *const libc::c_int as *const libc::c_void,
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        ) == 0
    }
}

/// Receive one buffer: (bytes, sender, GRO segment size if the kernel coalesced datagrams).
fn recv_gro(udp: &UdpSocket, buf: &mut [u8]) -> io::Result<(usize, SocketAddr, Option<usize>)> {
    // SAFETY: sockaddr_in and msghdr are plain C data for which all-zero is valid.
    let mut sa: libc::sockaddr_in = unsafe { std::mem::zeroed() };
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr() as *mut libc::c_void,
        iov_len: buf.len(),
    };
    let mut cbuf = [0u64; 8];
    // SAFETY: as above.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_name = &mut sa as *mut _ as *mut libc::c_void;
    msg.msg_namelen = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr() as *mut libc::c_void;
    msg.msg_controllen = std::mem::size_of_val(&cbuf);
    // SAFETY: msg points to live buffers of the sizes given.
    let n = unsafe { libc::recvmsg(udp.as_raw_fd(), &mut msg, 0) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let from = SocketAddr::V4(SocketAddrV4::new(
        Ipv4Addr::from(u32::from_be(sa.sin_addr.s_addr)),
        u16::from_be(sa.sin_port),
    ));
    let mut seg = None;
    // SAFETY: walking the control messages the kernel wrote into cbuf.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == SOL_UDP && (*c).cmsg_type == UDP_GRO {
                let v = std::ptr::read_unaligned(libc::CMSG_DATA(c) as *const libc::c_int);
                if v > 0 {
                    seg = Some(v as usize);
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    Ok((n as usize, from, seg))
}

/// Write the counters atomically (temporary file, then rename).
fn write_stats(path: &std::path::Path, c: &Counters) {
    let tmp = path.with_extension("tmp");
    if std::fs::write(&tmp, c.encode()).is_ok() {
        let _ = std::fs::rename(&tmp, path);
    }
}

/// Large socket buffers: a window of full-MTU packets from several QPs must fit.
fn set_buffers(udp: &UdpSocket, bytes: libc::c_int) {
    for (force, plain) in [
        (libc::SO_RCVBUFFORCE, libc::SO_RCVBUF),
        (libc::SO_SNDBUFFORCE, libc::SO_SNDBUF),
    ] {
        for opt in [force, plain] {
            // SAFETY: setsockopt reads sizeof(c_int) bytes from a valid c_int.
            let r = unsafe {
                libc::setsockopt(
                    udp.as_raw_fd(),
                    libc::SOL_SOCKET,
                    opt,
                    &bytes as *const libc::c_int as *const libc::c_void,
                    std::mem::size_of::<libc::c_int>() as libc::socklen_t,
                )
            };
            if r == 0 {
                break;
            }
        }
    }
}

/// Run the engine until killed.
pub fn run(cfg: EngineConfig) -> anyhow::Result<()> {
    // The transmitter sleeps for the NIC model's clock (a packet's wire time, tens of µs):
    // Linux's default 50 µs timer slack would add up to that to every such wait, and a
    // waiting packet of another QP would pay it — no NIC pipeline has it. Inherited by the
    // engine's threads.
    // SAFETY: prctl with integer arguments only.
    unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1u64, 0, 0, 0) };
    let udp = UdpSocket::bind((cfg.ip, cfg.udp_port))
        .with_context(|| format!("binding UDP {}:{}", cfg.ip, cfg.udp_port))?;
    set_buffers(&udp, 16 << 20);
    let mut state = State::with_nic(cfg.nic);
    state.my_ip = cfg.ip;
    if !cfg.faults.is_none() {
        state.inject = Some(Injection {
            cfg: cfg.faults.clone(),
            host: cfg.host.clone(),
            links: HashMap::new(),
            held: BinaryHeap::new(),
            seq: 0,
        });
    }
    if let Some(p) = &cfg.stats {
        write_stats(p, &state.counters);
    }
    let db_path = cfg.socket.with_file_name("doorbell");
    let db = Doorbell::open(&db_path, true)
        .with_context(|| format!("creating the doorbell {}", db_path.display()))?;
    let gso = cfg.gso && enable_gro(&udp);
    let sh = Arc::new(Shared {
        st: Mutex::new(state),
        db,
        gso,
        udp,
    });
    {
        let sh = sh.clone();
        std::thread::Builder::new()
            .name("rx".into())
            .spawn(move || rx_loop(sh))?;
    }
    {
        let sh = sh.clone();
        let stats = cfg.stats.clone();
        let port_state = cfg.port_state.clone();
        std::thread::Builder::new()
            .name("tx".into())
            .spawn(move || tx_loop(sh, stats, port_state))?;
    }
    eprintln!(
        "softrnic engine for {} on {}:{} ({})",
        cfg.host,
        cfg.ip,
        cfg.udp_port,
        cfg.socket.display()
    );
    eprint!("NIC model: {}", cfg.nic.encode());
    eprintln!(
        "host transport: UDP GSO/GRO {}",
        if gso { "on" } else { "off" }
    );
    if !cfg.faults.is_none() {
        eprint!("fault injection (egress):\n{}", cfg.faults.encode());
    }
    // The socket appears last: `up` takes it as the sign that the engine is ready, so the
    // doorbell and the log's settings lines must exist by then (a test read an empty log).
    let _ = std::fs::remove_file(&cfg.socket);
    let listener = UnixListener::bind(&cfg.socket)
        .with_context(|| format!("binding {}", cfg.socket.display()))?;
    let mut next_conn = 1u64;
    for s in listener.incoming() {
        match s {
            Ok(s) => {
                let sh = sh.clone();
                let conn = next_conn;
                next_conn += 1;
                std::thread::Builder::new()
                    .name(format!("conn{conn}"))
                    .spawn(move || serve_conn(sh, s, conn))?;
            }
            Err(e) => eprintln!("softrnic engine: accept: {e}"),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A link change raises one port event on every context with an event stream (element:
    /// port 1), none for a repeated state, none for a context without a stream.
    #[test]
    fn link_changes_raise_port_events_on_every_context() {
        let mut st = State::new();
        for conn in [1, 2] {
            assert!(matches!(
                st.request(conn, 0, Req::CreateAsyncChannel),
                Resp::Channel { .. }
            ));
        }
        st.request(3, 0, Req::AllocPd);
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
        let Resp::Channel { id, token } = st.request(1, pid, Req::CreateChannel) else {
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
            st.request(1, pid, cq_req.clone()),
            Resp::Err { .. }
        ));
        assert!(matches!(
            st.attach_channel(pid, id, token ^ 1, engine_end.try_clone().unwrap()),
            Resp::Err { .. }
        ));
        assert_eq!(st.attach_channel(pid, id, token, engine_end), Resp::Unit);
        assert!(matches!(
            st.request(2, pid, cq_req.clone()),
            Resp::Err { .. }
        ));
        let Resp::Cq { handle: cq, .. } = st.request(1, pid, cq_req) else {
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
        assert_eq!(st.request(1, pid, arm.clone()), Resp::Unit);
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
        assert_eq!(st.request(1, pid, arm_solicited.clone()), Resp::Unit);
        st.push_cqe(cq, wc);
        assert!((&app).read(&mut b).is_err());
        st.push_cqe_solicited(cq, wc, true);
        assert_eq!((&app).read(&mut b).unwrap(), 8);
        assert_eq!(st.request(1, pid, arm_solicited.clone()), Resp::Unit);
        let failed = IbvWc {
            status: IBV_WC_LOC_LEN_ERR,
            ..wc
        };
        st.push_cqe(cq, failed);
        assert_eq!((&app).read(&mut b).unwrap(), 8);
        // Arming for any completion on top of a solicited-only arming widens it (not back).
        assert_eq!(st.request(1, pid, arm_solicited.clone()), Resp::Unit);
        assert_eq!(st.request(1, pid, arm.clone()), Resp::Unit);
        assert_eq!(st.request(1, pid, arm_solicited), Resp::Unit);
        st.push_cqe(cq, wc);
        assert_eq!((&app).read(&mut b).unwrap(), 8);
        // Another connection cannot arm it; the owner's connection closing removes the channel.
        assert!(matches!(st.request(2, pid, arm), Resp::Err { .. }));
        st.drop_conn(1);
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
        let mut back = vec![0u8; 12];
        gather(pid, &segs, 2, &mut back).unwrap();
        assert_eq!(back, data);
        assert!(scatter(pid, &segs, 10, &data).is_err());
    }

    #[test]
    fn qp_state_machine_checks() {
        let mut st = State::new();
        let pid = std::process::id() as i32;
        let Resp::Handle(pd) = st.request(1, pid, Req::AllocPd) else {
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
        ) else {
            panic!()
        };
        // RESET -> RTR is illegal.
        let a = QpAttrs {
            qp_state: IBV_QPS_RTR,
            ..Default::default()
        };
        assert!(st.modify_qp(qpn, IBV_QP_STATE, &a).is_err());
        // RESET -> INIT needs pkey, port, access.
        let mut a = QpAttrs {
            qp_state: IBV_QPS_INIT,
            port_num: 1,
            ..Default::default()
        };
        assert!(st.modify_qp(qpn, IBV_QP_STATE | IBV_QP_PORT, &a).is_err());
        let m = IBV_QP_STATE | IBV_QP_PORT | IBV_QP_PKEY_INDEX | IBV_QP_ACCESS_FLAGS;
        st.modify_qp(qpn, m, &a).unwrap();
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
        assert!(st.modify_qp(qpn, rtr, &a).is_err());
        a.dgid = device::gid_for(Ipv4Addr::LOCALHOST);
        st.modify_qp(qpn, rtr, &a).unwrap();
        // A receive posted, then ERR flushes it.
        let r = RecvWr {
            wr_id: 9,
            sges: vec![],
        };
        assert_eq!(st.post_recv(1, qpn, vec![r]), Resp::Unit);
        a.qp_state = IBV_QPS_ERR;
        st.modify_qp(qpn, IBV_QP_STATE, &a).unwrap();
        let Resp::Wcs(w) = st.request(1, pid, Req::PollCq { cq, max: 4 }) else {
            panic!()
        };
        assert_eq!(w.len(), 1);
        assert_eq!(w[0].wr_id, 9);
        assert_eq!(w[0].status, IBV_WC_WR_FLUSH_ERR);
        // Another connection cannot touch this QP.
        assert!(matches!(
            st.request(2, pid, Req::DestroyQp { qpn }),
            Resp::Err { .. }
        ));
    }

    #[test]
    fn mr_access_rules() {
        let mut st = State::new();
        let pid = std::process::id() as i32;
        let buf = vec![0u8; 4096];
        let Resp::Handle(pd) = st.request(1, pid, Req::AllocPd) else {
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
        ) else {
            panic!()
        };
        let a = buf.as_ptr() as u64;
        assert!(st
            .check_remote(0, pd, rkey, a, 4096, IBV_ACCESS_REMOTE_READ)
            .is_some());
        assert!(st
            .check_remote(0, pd, rkey, a + 1, 4096, IBV_ACCESS_REMOTE_READ)
            .is_none());
        assert!(st
            .check_remote(0, pd, rkey, a, 16, IBV_ACCESS_REMOTE_WRITE)
            .is_none());
        assert!(st
            .check_remote(0, pd, rkey ^ 0x100, a, 16, IBV_ACCESS_REMOTE_READ)
            .is_none());
        assert!(st
            .check_remote(0, pd + 1, rkey, a, 16, IBV_ACCESS_REMOTE_READ)
            .is_none());
    }

    /// Hostile packets against a live QP: arbitrary headers and payloads aimed at a QP that
    /// has receives posted and sends, writes and reads in flight. The handler must never panic
    /// and never write outside the registered MR (guard pages around it stay untouched).
    /// `n` RC QPs in RTS on one PD/CQ/MR, each with `wrs` signalled 3-packet WRITEs queued
    /// (256-byte path MTU unless `path_mtu` says otherwise); the MR lives in `buf`.
    fn nic_rig(cfg: NicConfig, n: usize, wrs: usize) -> (State, Vec<u32>, Vec<u8>) {
        nic_rig_mtu(cfg, n, wrs, 1)
    }

    fn nic_rig_mtu(
        cfg: NicConfig,
        n: usize,
        wrs: usize,
        path_mtu: i32,
    ) -> (State, Vec<u32>, Vec<u8>) {
        let mut buf = vec![7u8; 4096];
        let mut st = State::with_nic(cfg);
        let pid = std::process::id() as i32;
        let Resp::Handle(pd) = st.request(1, pid, Req::AllocPd) else {
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
            ) else {
                panic!()
            };
            let mut a = QpAttrs {
                qp_state: IBV_QPS_INIT,
                port_num: 1,
                ..Default::default()
            };
            let m = IBV_QP_STATE | IBV_QP_PORT | IBV_QP_PKEY_INDEX | IBV_QP_ACCESS_FLAGS;
            st.modify_qp(qpn, m, &a).unwrap();
            a.qp_state = IBV_QPS_RTR;
            a.path_mtu = path_mtu;
            a.is_global = 1;
            a.dgid = device::gid_for(Ipv4Addr::LOCALHOST);
            a.dest_qp_num = 0x100 + i as u32;
            let rtr = IBV_QP_STATE
                | IBV_QP_AV
                | IBV_QP_PATH_MTU
                | IBV_QP_DEST_QPN
                | IBV_QP_RQ_PSN
                | IBV_QP_MAX_DEST_RD_ATOMIC
                | IBV_QP_MIN_RNR_TIMER;
            st.modify_qp(qpn, rtr, &a).unwrap();
            a.qp_state = IBV_QPS_RTS;
            a.timeout = 14;
            let rts = IBV_QP_STATE
                | IBV_QP_TIMEOUT
                | IBV_QP_RETRY_CNT
                | IBV_QP_RNR_RETRY
                | IBV_QP_SQ_PSN
                | IBV_QP_MAX_QP_RD_ATOMIC;
            st.modify_qp(qpn, rts, &a).unwrap();
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
        assert_eq!(st.out.len(), 18);
        assert_eq!(st.counters.wqe_fetches, 6);
        // One QP drained: the others keep alternating.
        let (mut st, qpns, _buf) = nic_rig(NicConfig::default(), 2, 1);
        st.qps.get_mut(&qpns[0]).unwrap().sq.clear();
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
                lkey: *st.mrs.keys().next().unwrap(),
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
        assert_eq!(st.out.len(), 3);
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
        let lkey = *st.mrs.keys().next().unwrap();
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
            )
            .unwrap();
        }
        let buf_addr = buf.as_mut_ptr() as u64;
        let write_slot = |i: u32, wr_id: u64, opcode: i32, nsge: u32| {
            let mut b = vec![0u8; sq.slot];
            ring::put_u64(&mut b, 0, wr_id);
            ring::put_u32(&mut b, 8, opcode as u32);
            ring::put_u32(&mut b, 12, IBV_SEND_SIGNALED);
            ring::put_u32(&mut b, 20, nsge);
            ring::put_u32(&mut b, 36, ring::NOT_INLINE);
            ring::put_u64(&mut b, 64, buf_addr);
            ring::put_u32(&mut b, 72, 300);
            ring::put_u32(&mut b, 76, lkey);
            qmap.write(sq.slot_off(i), &b);
        };
        write_slot(0, 41, IBV_WR_RDMA_WRITE, 1);
        sq.prod(&qmap).store(1, Ordering::Release);
        let now = Instant::now();
        while st.tx_one(now).is_some() {}
        assert_eq!(st.counters.ring_send_wqes, 1);
        assert_eq!(st.out.len(), 2, "300 bytes at 256-byte MTU");
        assert_eq!(
            sq.done(&qmap).load(Ordering::Acquire),
            0,
            "not acknowledged yet"
        );
        // The peer acknowledges both packets: done is published, then the completion.
        let last = st.qps[&q2].next_psn;
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
        st.modify_qp(co, IBV_QP_STATE, &a).unwrap();
        let l = QpLayout::new(&st.qps[&co].cap);
        let (qmap, qfd) = Map::create("t", l.len).unwrap();
        assert_eq!(st.attach_ring(1, pid, 1, co, qfd, l.len as u64), Ok(()));
        // SAFETY: our own fd; the engine has its own mapping.
        unsafe { libc::close(qfd) };
        a.qp_state = IBV_QPS_INIT;
        a.port_num = 1;
        let m = IBV_QP_STATE | IBV_QP_PORT | IBV_QP_PKEY_INDEX | IBV_QP_ACCESS_FLAGS;
        st.modify_qp(co, m, &a).unwrap();
        a = attr;
        a.qp_state = IBV_QPS_RTR;
        let rtr = IBV_QP_STATE
            | IBV_QP_AV
            | IBV_QP_PATH_MTU
            | IBV_QP_DEST_QPN
            | IBV_QP_RQ_PSN
            | IBV_QP_MAX_DEST_RD_ATOMIC
            | IBV_QP_MIN_RNR_TIMER;
        st.modify_qp(co, rtr, &a).unwrap();
        a.qp_state = IBV_QPS_RTS;
        let rts = IBV_QP_STATE
            | IBV_QP_TIMEOUT
            | IBV_QP_RETRY_CNT
            | IBV_QP_RNR_RETRY
            | IBV_QP_SQ_PSN
            | IBV_QP_MAX_QP_RD_ATOMIC;
        st.modify_qp(co, rts, &a).unwrap();
        let sq = Ring {
            off: 0,
            n: l.sq_n,
            slot: l.sq_slot,
        };
        let lkey = *st.mrs.keys().next().unwrap();
        // Two calls, a list of 4 and a single work request, as post_send_ring writes them.
        for (i, first) in [true, false, false, false, true].into_iter().enumerate() {
            let mut b = vec![0u8; sq.slot];
            ring::put_u64(&mut b, 0, i as u64);
            ring::put_u32(&mut b, 8, IBV_WR_RDMA_WRITE as u32);
            ring::put_u32(&mut b, 20, 1);
            ring::put_u32(&mut b, 36, ring::NOT_INLINE);
            ring::put_u32(&mut b, ring::SQ_DOORBELL_OFF, u32::from(first));
            ring::put_u64(&mut b, 64, buf.as_ptr() as u64);
            ring::put_u32(&mut b, 72, 700);
            ring::put_u32(&mut b, 76, lkey);
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
        let epsn = st.qps[&qpn].epsn;
        assert!(matches!(
            st.request(1, 1, Req::DestroyQp { qpn }),
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
        assert_eq!(st.out.len(), 1);
        let ack = Packet::decode(&st.out[0].1).unwrap();
        assert_eq!(
            (ack.op, ack.psn, ack.dst_qpn),
            (wire::OP_ACK, dup, peer_qpn)
        );
        st.out.clear();
        for (from, p) in [
            (peer, pkt(wire::OP_SEND, epsn, peer_qpn)),    // new data
            (peer, pkt(wire::OP_READ_REQ, dup, peer_qpn)), // a read needs the memory
            (peer, pkt(wire::OP_SEND, dup, peer_qpn + 1)), // another QP of the peer
        ] {
            st.on_packet(from, p, now);
        }
        let stranger = SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::new(127, 9, 9, 9), 4791));
        st.on_packet(stranger, pkt(wire::OP_SEND, dup, peer_qpn), now);
        assert!(st.out.is_empty());
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
            let Resp::Handle(pd) = st.request(1, pid, Req::AllocPd) else {
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
                st.modify_qp(qpn, m, &a).unwrap();
                a.qp_state = IBV_QPS_RTR;
                st.modify_qp(qpn, IBV_QP_STATE, &a).unwrap();
                a.qp_state = IBV_QPS_RTS;
                a.sq_psn = 5000;
                st.modify_qp(qpn, IBV_QP_STATE | IBV_QP_SQ_PSN, &a).unwrap();
            }
            let m = IBV_QP_STATE | IBV_QP_PORT | IBV_QP_PKEY_INDEX | IBV_QP_ACCESS_FLAGS;
            if qpt != IBV_QPT_UD {
                st.modify_qp(qpn, m, &a).unwrap();
            }
            a.qp_state = IBV_QPS_RTR;
            a.path_mtu = 1; // 256-byte packets: multi-packet messages
            a.is_global = 1;
            a.dgid = device::gid_for(Ipv4Addr::LOCALHOST);
            a.dest_qp_num = PEER_QPN;
            a.rq_psn = 1000;
            a.min_rnr_timer = 1;
            let uc_rtr =
                IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN;
            let rtr = uc_rtr | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER;
            match qpt {
                IBV_QPT_RC => st.modify_qp(qpn, rtr, &a).unwrap(),
                IBV_QPT_UC => {
                    assert_eq!(
                        st.modify_qp(qpn, rtr, &a),
                        Err(libc::EINVAL),
                        "RC-only mask"
                    );
                    st.modify_qp(qpn, uc_rtr, &a).unwrap();
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
                IBV_QPT_RC => st.modify_qp(qpn, rts, &a).unwrap(),
                IBV_QPT_UC => st.modify_qp(qpn, IBV_QP_STATE | IBV_QP_SQ_PSN, &a).unwrap(),
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
            st.out.clear();
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
                            payload,
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
                payload: atomic_operands(operand, swap),
                ..Default::default()
            }
        }

        fn word(r: &Rig, off: usize) -> u64 {
            u64::from_ne_bytes(r.buf[GUARD + off..GUARD + off + 8].try_into().unwrap())
        }

        /// The only packet the engine queued: an atomic response (PSN, original value).
        fn take_atomic_resp(st: &mut State) -> (u32, u64) {
            assert_eq!(st.out.len(), 1, "one response");
            let p = Packet::decode(&st.out.remove(0).1).unwrap();
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
            replay.payload = atomic_operands(1000, 0);
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
                r.st.out.clear();
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
            r.st.out.clear();
            r.st.on_packet(r.peer, old, now);
            assert!(r.st.out.is_empty());
            assert_eq!(word(&r, 64), 1);
            let epsn = 1004 + ATOMIC_CACHE as u32;
            let misaligned = atomic_req(&r, wire::OP_FETCH_ADD, epsn, 68, 1, 0);
            r.st.on_packet(r.peer, misaligned, now);
            let nak = Packet::decode(&r.st.out.remove(0).1).unwrap();
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
            let nak = Packet::decode(&r.st.out.remove(0).1).unwrap();
            assert_eq!((nak.op, nak.syndrome), (wire::OP_NAK, wire::NAK_REM_ACCESS));
            // An access violation sends the responder's QP to error too (IBTA class C).
            assert_eq!(r.st.qps[&r.qpn].state, IBV_QPS_ERR);
            let mut r = rig_with(false);
            r.st.mrs.get_mut(&r.rkey).unwrap().access =
                IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;
            let p = atomic_req(&r, wire::OP_FETCH_ADD, 1000, 0, 1, 0);
            r.st.on_packet(r.peer, p, Instant::now());
            let nak = Packet::decode(&r.st.out.remove(0).1).unwrap();
            assert_eq!((nak.op, nak.syndrome), (wire::OP_NAK, wire::NAK_REM_ACCESS));
            assert_eq!(word(&r, 0), 0xa5a5_a5a5_a5a5_a5a5);
        }

        /// Requester: malformed atomic work requests are refused at post time; a posted
        /// FETCH_ADD becomes one request packet, at most max_rd_atomic (here 1) wait for
        /// responses, and the response puts the original value into the local buffer and
        /// completes the WQE (FETCH_ADD, byte_len 8); a duplicate response is stale.
        #[test]
        fn atomic_requests_and_responses_on_the_requester() {
            let mut r = rig_with(false);
            let wr = |id: u64, opcode: i32, off: u64, len: u32| SendWr {
                wr_id: id,
                opcode,
                flags: IBV_SEND_SIGNALED,
                remote_addr: 0x10_0000,
                rkey: 9,
                compare_add: 7,
                swap: 0,
                sges: vec![Sge {
                    addr: r.mr_addr + off,
                    length: len,
                    lkey: r.lkey,
                }],
                ..Default::default()
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
            let (_, b) = r.st.next_packet(r.qpn, now).expect("request");
            let req = Packet::decode(&b).unwrap();
            assert_eq!(
                (req.op, req.psn, req.msg_len),
                (wire::OP_FETCH_ADD, 5000, 8)
            );
            assert_eq!(req.payload, atomic_operands(7, 0));
            assert!(r.st.next_packet(r.qpn, now).is_none(), "max_rd_atomic 1");
            let resp = Packet {
                op: wire::OP_ATOMIC_RESP,
                flags: wire::F_FIRST | wire::F_LAST,
                dst_qpn: r.qpn,
                src_qpn: PEER_QPN,
                psn: 5000,
                msg_len: 8,
                payload: 0x1122_3344_5566_7788u64.to_le_bytes().to_vec(),
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
            ) else {
                panic!()
            };
            assert!(matches!(
                r.st.request(2, 0, Req::QuerySrq { srq }),
                Resp::Err { .. }
            ));
            assert_eq!(
                r.st.request(1, 0, Req::QuerySrq { srq }),
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
                r.st.request(1, 0, Req::PostSrqRecv { srq, wrs }),
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
            assert_eq!(r.st.request(1, 0, modify(1, 0, 1)), err(libc::EINVAL));
            // A limit above max_wr is refused (also against a max_wr set in the same call).
            assert_eq!(r.st.request(1, 0, modify(0, 5, 2)), err(libc::EINVAL));
            assert_eq!(r.st.request(1, 0, modify(4, 5, 3)), err(libc::EINVAL));
            assert_eq!(r.st.request(1, 0, modify(0, 0, 2)), Resp::Unit);
            assert_eq!(r.st.request(1, 0, modify(8, 0, 1)), Resp::Unit);
            // The rig's QP becomes one of the SRQ's (its own receives are discarded).
            let q = r.st.qps.get_mut(&r.qpn).unwrap();
            q.srq = srq;
            q.rq.clear();
            let wrs = vec![recv(1, 0)];
            assert!(matches!(
                r.st.post_recv(1, r.qpn, wrs),
                Resp::Err {
                    errno: libc::EINVAL,
                    ..
                }
            ));
            assert_eq!(
                r.st.request(1, 0, Req::DestroySrq { srq }),
                err(libc::EBUSY)
            );
            let send = Packet {
                op: wire::OP_SEND,
                flags: wire::F_FIRST | wire::F_LAST | wire::F_ACKREQ,
                dst_qpn: r.qpn,
                src_qpn: PEER_QPN,
                psn: 1000,
                msg_len: 3,
                payload: vec![4, 5, 6],
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
            r.st.remove_qp(r.qpn);
            assert_eq!(
                r.st.request(1, 0, Req::DestroySrq { srq }),
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
            let Resp::Channel { id, token } = r.st.request(1, 0, Req::CreateAsyncChannel) else {
                panic!()
            };
            let (app, engine_end) = UnixStream::pair().unwrap();
            assert_eq!(r.st.attach_channel(0, id, token, engine_end), Resp::Unit);
            app.set_nonblocking(true).unwrap();
            // One stream per context; it is no completion channel.
            assert_eq!(
                r.st.request(1, 0, Req::CreateAsyncChannel),
                err(libc::EBUSY)
            );
            let cq_req = Req::CreateCq {
                cqe: 4,
                channel: id,
                user: 1,
            };
            assert_eq!(r.st.request(1, 0, cq_req), err(libc::EINVAL));
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
            ) else {
                panic!()
            };
            let user = |kind, handle, user| Req::UserHandle { kind, handle, user };
            assert_eq!(r.st.request(1, 0, user(2, srq, 0x5150)), Resp::Unit);
            assert_eq!(r.st.request(1, 0, user(1, r.qpn, 0x9090)), Resp::Unit);
            assert_eq!(r.st.request(2, 0, user(1, r.qpn, 1)), err(libc::EINVAL));
            assert_eq!(r.st.request(1, 0, user(3, srq, 1)), err(libc::EINVAL));
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
                r.st.request(1, 0, Req::PostSrqRecv { srq, wrs }),
                Resp::Unit
            );
            let arm = |limit| Req::ModifySrq {
                srq,
                mask: 2,
                max_wr: 0,
                srq_limit: limit,
            };
            assert_eq!(r.st.request(1, 0, arm(3)), Resp::Unit);
            let query = |st: &mut State| match st.request(1, 0, Req::QuerySrq { srq }) {
                Resp::Srq { srq_limit, .. } => srq_limit,
                other => panic!("{other:?}"),
            };
            assert_eq!(query(&mut r.st), 3);
            let q = r.st.qps.get_mut(&r.qpn).unwrap();
            q.srq = srq;
            q.rq.clear();
            let mut psn = 1000;
            let mut send = |st: &mut State| {
                let p = Packet {
                    op: wire::OP_SEND,
                    flags: wire::F_FIRST | wire::F_LAST | wire::F_ACKREQ,
                    dst_qpn: r.qpn,
                    src_qpn: PEER_QPN,
                    psn,
                    msg_len: 1,
                    payload: vec![1],
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
            assert_eq!(r.st.request(1, 0, read.clone()), Resp::Unit);
            send(&mut r.st);
            assert!((&app).read(&mut b).is_err());
            // Re-armed with 2 while 1 is queued: nothing until a receive is taken.
            assert_eq!(r.st.request(1, 0, arm(2)), Resp::Unit);
            assert!((&app).read(&mut b).is_err());
            // The QP with an SRQ goes to error: Last WQE Reached, for the application's QP.
            let a = QpAttrs {
                qp_state: IBV_QPS_ERR,
                ..Default::default()
            };
            r.st.modify_qp(r.qpn, IBV_QP_STATE, &a).unwrap();
            assert_eq!((&app).read(&mut b).unwrap(), 16);
            assert_eq!(
                b[..16],
                crate::events::record(0x9090, IBV_EVENT_QP_LAST_WQE_REACHED)
            );
            // Destroying the QP while its event is unread: the provider takes it back.
            assert_eq!(
                r.st.request(1, 0, Req::DestroyQp { qpn: r.qpn }),
                Resp::Destroyed {
                    events_reported: 0,
                    event_unread: true
                }
            );
            assert_eq!(r.st.request(1, 0, read), Resp::Unit);
            // The SRQ's one event was read: its destroy waits for one acknowledgement.
            assert_eq!(
                r.st.request(1, 0, Req::DestroySrq { srq }),
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
            ) else {
                panic!()
            };
            let Resp::Handle(mw) = r.st.request(1, 0, Req::AllocMw { pd, mw_type: 1 }) else {
                panic!()
            };
            assert_eq!(
                r.st.request(1, 0, Req::AllocMw { pd, mw_type: 3 }),
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
                st.check_remote(r.qpn, q, rkey, r.mr_addr + off, len, IBV_ACCESS_REMOTE_READ)
            };
            assert!(grant(&r.st, new_rkey, 256, 256).is_some());
            assert!(grant(&r.st, new_rkey, 255, 8).is_none());
            assert!(grant(&r.st, new_rkey, 500, 16).is_none());
            assert!(grant(&r.st, mw, 256, 8).is_none());
            let wrong_right = r.st.check_remote(
                r.qpn,
                q,
                new_rkey,
                r.mr_addr + 256,
                8,
                IBV_ACCESS_REMOTE_WRITE,
            );
            assert!(wrong_right.is_none());
            assert_eq!(r.st.request(1, 0, Req::DeregMr { lkey }), err(libc::EBUSY));
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
            assert_eq!(r.st.request(1, 0, Req::DeallocMw { rkey: mw }), Resp::Unit);
            assert!(grant(&r.st, new_rkey, 256, 8).is_none());
            assert_eq!(r.st.request(1, 0, Req::DeregMr { lkey }), Resp::Unit);
        }

        /// UD responder: datagrams from any address; a wrong Q_Key is dropped and counted;
        /// the payload lands after a 40-byte GRH whose second half is the IPv4 header (source
        /// = the sender's address), byte_len counts the GRH; a receive too small for GRH +
        /// payload completes with LOC_LEN_ERR; with no receive posted the datagram is lost
        /// and counted; RC packets are not for UD QPs.
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
                payload,
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
            assert!(r.st.out.is_empty(), "UD never answers");
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
            let (dst, b) = r.st.next_packet(r.qpn, now).expect("datagram");
            assert_eq!(dst.to_string(), "10.77.0.2:4791");
            let p = Packet::decode(&b).unwrap();
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
                payload,
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
            assert!(r.st.out.is_empty(), "UC never acknowledges");

            let wr = |id: u64, opcode: i32, len: u32| SendWr {
                wr_id: id,
                opcode,
                flags: IBV_SEND_SIGNALED,
                remote_addr: 0x10_0000,
                rkey: 9,
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
            let write = wr(2, IBV_WR_RDMA_WRITE, 600);
            assert_eq!(r.st.post_send(1, r.qpn, vec![write]), Resp::Unit);
            for _ in 0..3 {
                assert!(r.st.next_packet(r.qpn, now).is_some());
            }
            assert!(r.st.next_packet(r.qpn, now).is_none());
            assert!(r.st.qps[&r.qpn].inflight.is_empty());
            let wc = cqes(&r)[1];
            assert_eq!(
                (wc.wr_id, wc.status, wc.opcode),
                (2, IBV_WC_SUCCESS, IBV_WC_RDMA_WRITE)
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
            let wr = |id: u64| SendWr {
                wr_id: id,
                opcode: IBV_WR_ATOMIC_FETCH_AND_ADD,
                flags: IBV_SEND_SIGNALED,
                remote_addr: 0x10_0000,
                rkey: 9,
                compare_add: 1,
                sges: vec![Sge {
                    addr: r.mr_addr + 8 * id,
                    length: 8,
                    lkey: r.lkey,
                }],
                ..Default::default()
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
                payload: v.to_le_bytes().to_vec(),
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
            let (_, b) = r.st.next_packet(r.qpn, later).expect("retransmission");
            assert_eq!(Packet::decode(&b).unwrap().psn, 5000);
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
                payload: vec![1, 2, 3],
                ..Default::default()
            };
            let now = Instant::now();
            r.st.on_packet(r.peer, w.clone(), now);
            assert_eq!(&r.buf[GUARD + 10..GUARD + 13], &[1, 2, 3]);
            assert_eq!(r.st.out.len(), 1, "ACKed");
            let mut replay = w.clone();
            replay.payload = vec![9, 9, 9];
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
            next.payload = vec![7, 7, 7];
            r.st.on_packet(stranger, next, now);
            assert_eq!(&r.buf[GUARD + 10..GUARD + 13], &[1, 2, 3]);
            assert_eq!(r.st.counters.rx_dropped_unknown_qp, 1);
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
                    r.st.out.clear();
                }
                prop_assert!(r.buf[..GUARD].iter().all(|&b| b == 0xa5), "front guard written");
                prop_assert!(
                    r.buf[GUARD + MR_LEN..].iter().all(|&b| b == 0xa5),
                    "back guard written"
                );
            }
        }
    }
}
