//! Enforcement of the app's grant on the data path (docs/design.md §5): the rate limiters, the
//! per-QP software send queues, top-k gating and the tracking of work in flight. The
//! engine thread (`engine`) drains the queues; this module holds what both it and the
//! application's posting and polling threads share.
//!
//! A post goes straight to the provider when nothing is in force; otherwise, under the QP's
//! lock, the longest prefix of the WR list that the limiters and the gate admit now goes
//! to the provider in one call and the rest is copied into the QP's queue, behind anything
//! already queued, so the QP's order is kept.

use crate::ffi::*;
use crate::gate::{Gate, QpId, Slot};
use crate::inflight::InFlight;
use crate::pacer::Gcra;
use crate::sendq::OwnedWr;
use crate::spin::SpinLock;
use crate::{ContextState, QpCounters};
use drum_table::layout::Grant;
use drum_table::message::ShimMsg;
use libc::c_int;
use std::collections::VecDeque;
use std::ptr;
use std::sync::atomic::{
    AtomicBool, AtomicU64,
    Ordering::{Acquire, Relaxed, Release},
};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// Governance state of one QP (in its counter slot, under its mutex).
#[derive(Default)]
pub struct QpGov {
    /// The application's `struct ibv_qp *` (0 until it posts or after it is destroyed).
    pub qp: usize,
    pub queue: VecDeque<OwnedWr>,
    pub inflight: InFlight,
    /// Created with `sq_sig_all`: every WR completes.
    pub sig_all: bool,
    /// Its peer's GID, once connected (RTR).
    pub peer: Option<[u8; 16]>,
    /// Long messages under way (announced to the receiver's agent).
    pub busy: bool,
    /// The `ibv_wr_*` batch being built (`wr_api`).
    pub ex_batch: crate::wr_api::Batch,
    /// Its path MTU in bytes (0: not set yet).
    pub path_mtu: u32,
    /// Packet pacing on the NIC (`nic_pace`): the application set its own, which the shim
    /// leaves alone; the rate the shim last asked for, and whether the NIC took it.
    pub app_paced: bool,
    /// The peer may read (or do atomics) through it: READ responses leave the NIC through
    /// this QP and belong to the reader's grant, so the shim does not pace it on the NIC.
    pub serves_reads: bool,
    pub nic_kbps: Option<u32>,
    pub nic_paced: bool,
}

/// The limits in force, as plain atomics the data path reads without a lock. A limiter is
/// `(interval_ps, tolerance_ps)`, interval 0 meaning "no limit".
pub struct Limits {
    byte: [AtomicU64; 2],
    wqe: [AtomicU64; 2],
    /// Completions delivered to the app's virtual CQs (its polling rate).
    cqe: [AtomicU64; 2],
    pub k: AtomicU64,
    pub quantum_ns: AtomicU64,
    pub long_msg: AtomicU64,
    /// Any limiter or gate in force.
    pub active: AtomicBool,
    /// Completions must be followed (gating or long-message announcements).
    pub tracking: AtomicBool,
    pub generation: AtomicU64,
}

pub static LIMITS: Limits = Limits {
    byte: [AtomicU64::new(0), AtomicU64::new(0)],
    wqe: [AtomicU64::new(0), AtomicU64::new(0)],
    cqe: [AtomicU64::new(0), AtomicU64::new(0)],
    k: AtomicU64::new(0),
    quantum_ns: AtomicU64::new(0),
    long_msg: AtomicU64::new(0),
    active: AtomicBool::new(false),
    tracking: AtomicBool::new(false),
    generation: AtomicU64::new(0),
};

/// The limiters' theoretical arrival times (ps since [`now_ps`]'s origin).
static BYTE_TAT: AtomicU64 = AtomicU64::new(0);
static WQE_TAT: AtomicU64 = AtomicU64::new(0);
static CQE_TAT: AtomicU64 = AtomicU64::new(0);

/// Default quantum of a gate slot when the grant names none.
const DEFAULT_QUANTUM_US: u64 = 1000;

/// Statistics of the governed path (reported in the summary and to the agent).
pub struct Stats {
    pub direct_wqes: AtomicU64,
    pub deferred_wqes: AtomicU64,
    pub queue_delay_ns: AtomicU64,
    pub deferred_post_errors: AtomicU64,
    pub dropped_wqes: AtomicU64,
    pub unqueueable_wqes: AtomicU64,
    /// Polls that found completions the polling grant held back: the app wanted them
    /// sooner than its grant lets it have them, which the agent counts as demand.
    pub held_polls: AtomicU64,
    /// Packet-pacing changes the NIC took (`nic_pace`), and the ones it refused.
    pub nic_pacing_sets: AtomicU64,
    pub nic_pacing_refusals: AtomicU64,
}

pub static STATS: Stats = Stats {
    direct_wqes: AtomicU64::new(0),
    deferred_wqes: AtomicU64::new(0),
    queue_delay_ns: AtomicU64::new(0),
    deferred_post_errors: AtomicU64::new(0),
    dropped_wqes: AtomicU64::new(0),
    unqueueable_wqes: AtomicU64::new(0),
    held_polls: AtomicU64::new(0),
    nic_pacing_sets: AtomicU64::new(0),
    nic_pacing_refusals: AtomicU64::new(0),
};

/// WRs held back in all software queues of the process.
pub static QUEUED: AtomicU64 = AtomicU64::new(0);

/// The app found its CQ empty. While the shim holds some of its work back (WRs, or
/// completions beyond its polling grant), spinning on the CQ gains nothing — what it waits
/// for comes only at the granted rate — so the poller sleeps: until the limiters' next slot
/// (nothing the shim holds can complete before it), at least [`MIN_PAUSE`] and at most
/// [`MAX_PAUSE`]. A throttled busy-poller thus stops crowding out its neighbours and the
/// shim's own engine on a small host (`sched_yield` alone did not: the scheduler hands the
/// CPU straight back).
pub fn on_empty_poll(completions_held: bool) {
    if completions_held || QUEUED.load(Relaxed) > 0 {
        std::thread::sleep(empty_poll_pause(now_ps()));
        if QUEUED.load(Relaxed) > 0 {
            crate::engine::help_drain();
        }
    }
}

/// The shortest pause: short next to a granted inter-message gap at any rate that throttles
/// (64 KiB at 10 Gb/s take 52 µs).
const MIN_PAUSE: Duration = Duration::from_micros(20);
/// The longest: what a WR posted before the throttling may wait for its completion to be
/// seen.
const MAX_PAUSE: Duration = Duration::from_millis(1);

/// How long an empty poll of a throttled app pauses at `now`.
fn empty_poll_pause(now: u64) -> Duration {
    let wait = |cell: &[AtomicU64; 2], tat: &AtomicU64| {
        limiter(cell).map_or(0, |g| g.wait(tat.load(Relaxed), now))
    };
    let ps = wait(&LIMITS.byte, &BYTE_TAT)
        .max(wait(&LIMITS.wqe, &WQE_TAT))
        .max(wait(&LIMITS.cqe, &CQE_TAT));
    Duration::from_nanos(ps / 1000).clamp(MIN_PAUSE, MAX_PAUSE)
}

/// The app's gate: one per process (one app per process).
pub static GATE: SpinLock<Gate> = SpinLock::new(Gate::new());
/// QPs with queued work for the engine: (context key, QP number).
pub static PENDING: SpinLock<VecDeque<(usize, u32)>> = SpinLock::new(VecDeque::new());
/// Messages for the agent, sent by the engine.
pub static EVENTS: SpinLock<Vec<ShimMsg>> = SpinLock::new(Vec::new());
/// Per-receiver caps (DASR): (peer GID, limiter, its TAT).
pub static CAPS: SpinLock<Vec<PeerCap>> = SpinLock::new(Vec::new());
pub static CAPS_PRESENT: AtomicBool = AtomicBool::new(false);

pub struct PeerCap {
    pub gid: [u8; 16],
    pub gcra: Gcra,
    pub tat: u64,
}

static ORIGIN: OnceLock<Instant> = OnceLock::new();

/// The shim's clock, in picoseconds.
pub fn now_ps() -> u64 {
    ORIGIN.get_or_init(Instant::now).elapsed().as_nanos() as u64 * 1000
}

fn limiter(cell: &[AtomicU64; 2]) -> Option<Gcra> {
    Gcra::from_parts(cell[0].load(Relaxed), cell[1].load(Relaxed))
}

fn set_limiter(cell: &[AtomicU64; 2], g: Option<Gcra>) {
    let (i, t) = g.map_or((0, 0), |g| g.parts());
    cell[1].store(t, Relaxed);
    cell[0].store(i, Relaxed);
}

/// The byte burst when the grant names none: the limiter's default (5 ms at the rate), and
/// at least one 64 KiB message (measured: with a 0.9 ms burst at 75 MB/s on a loaded 2-core
/// machine, `ib_write_bw` got 76 % of its grant; with 2 ms, 95 %; with 3.5 ms, 100 %).
pub fn default_byte_burst(rate: f64) -> u64 {
    Gcra::default_burst(rate).max(64 * 1024)
}

/// Puts a grant in force (`None`: no limits — no agent, fail-open).
pub fn apply(grant: Option<&Grant>) {
    let g = grant.copied().unwrap_or_default();
    let byte = (g.rate_bytes_per_s > 0).then(|| {
        let rate = g.rate_bytes_per_s as f64;
        let burst = if g.burst_bytes > 0 {
            g.burst_bytes
        } else {
            default_byte_burst(rate)
        };
        Gcra::new(rate, burst)
    });
    let wqe = (g.rate_wqe_per_s > 0).then(|| {
        let rate = g.rate_wqe_per_s as f64;
        Gcra::new(rate, Gcra::default_burst(rate))
    });
    let cqe = (g.rate_cqe_per_s > 0).then(|| {
        let rate = g.rate_cqe_per_s as f64;
        Gcra::new(rate, Gcra::default_burst(rate))
    });
    let now = now_ps();
    for (cell, tat, new) in [
        (&LIMITS.byte, &BYTE_TAT, byte.flatten()),
        (&LIMITS.wqe, &WQE_TAT, wqe.flatten()),
        (&LIMITS.cqe, &CQE_TAT, cqe.flatten()),
    ] {
        if let Some(n) = new {
            let old = limiter(cell);
            let _ = tat.fetch_update(Relaxed, Relaxed, |t| Some(n.carry_over(old, t, now)));
        }
        set_limiter(cell, new);
    }
    LIMITS.k.store(g.max_active_qps, Relaxed);
    let q = if g.quantum_us > 0 {
        g.quantum_us
    } else {
        DEFAULT_QUANTUM_US
    };
    LIMITS.quantum_ns.store(q * 1000, Relaxed);
    LIMITS.long_msg.store(g.long_msg_bytes, Relaxed);
    let tracking = g.max_active_qps > 0 || g.long_msg_bytes > 0;
    if tracking && !LIMITS.tracking.load(Relaxed) {
        // A new tracking period: what was posted before may have completed unseen.
        TRACKING_EPOCH.fetch_add(1, Relaxed);
    }
    LIMITS.tracking.store(tracking, Relaxed);
    LIMITS.active.store(
        byte.is_some() || wqe.is_some() || tracking || CAPS_PRESENT.load(Relaxed),
        Release,
    );
    LIMITS.generation.store(g.generation, Relaxed);
    if g.max_active_qps > 0 {
        // A larger gate has room for QPs waiting now: nothing else would hand it to them
        // until a holder released its slot.
        let granted = GATE.lock().fill(now / 1000, g.max_active_qps as usize);
        if !granted.is_empty() {
            crate::engine::grant(&granted);
        }
    }
    if g.max_active_qps == 0 {
        // No gate any more: everyone waiting for a slot may go.
        let waiting = {
            let mut gate = GATE.lock();
            let w = gate.waiting_qps();
            *gate = Gate::new();
            w
        };
        if !waiting.is_empty() {
            crate::engine::grant(&waiting);
        }
    }
}

/// Replaces the per-receiver caps (from the agent's table).
pub fn set_caps(caps: &[([u8; 16], u64)]) {
    let mut c = CAPS.lock();
    c.retain(|p| caps.iter().any(|(g, _)| *g == p.gid));
    for &(gid, rate) in caps {
        let Some(gcra) = Gcra::new(rate as f64, Gcra::default_burst(rate as f64)) else {
            continue;
        };
        match c.iter_mut().find(|p| p.gid == gid) {
            Some(p) => p.gcra = gcra,
            None => c.push(PeerCap { gid, gcra, tat: 0 }),
        }
    }
    CAPS_PRESENT.store(!c.is_empty(), Relaxed);
    if !c.is_empty() {
        LIMITS.active.store(true, Release);
    }
}

/// The gate's name for a QP: its context slot and QP number.
pub fn qp_id(ctx_index: usize, qpn: u32) -> QpId {
    ((ctx_index as u64) << 32) | u64::from(qpn)
}

/// May `bytes` more go now? Consumes from every limiter if so; otherwise returns how long
/// to wait (ps) and consumes nothing.
pub fn admit(now: u64, bytes: u64, peer: Option<[u8; 16]>) -> Result<(), u64> {
    let byte = limiter(&LIMITS.byte);
    let wqe = limiter(&LIMITS.wqe);
    let mut wait = 0;
    if let Some(b) = byte {
        wait = wait.max(b.wait(BYTE_TAT.load(Relaxed), now));
    }
    if let Some(w) = wqe {
        wait = wait.max(w.wait(WQE_TAT.load(Relaxed), now));
    }
    let mut caps = peer
        .filter(|_| CAPS_PRESENT.load(Relaxed))
        .map(|_| CAPS.lock());
    let cap = match (&mut caps, peer) {
        (Some(c), Some(g)) => c.iter_mut().find(|p| p.gid == g),
        _ => None,
    };
    if let Some(c) = &cap {
        wait = wait.max(c.gcra.wait(c.tat, now));
    }
    if wait > 0 {
        return Err(wait);
    }
    if let Some(c) = cap {
        c.tat = c.gcra.advance(c.tat, now, bytes);
    }
    if let Some(b) = byte {
        let _ = BYTE_TAT.fetch_update(Relaxed, Relaxed, |t| Some(b.advance(t, now, bytes)));
    }
    if let Some(w) = wqe {
        let _ = WQE_TAT.fetch_update(Relaxed, Relaxed, |t| Some(w.advance(t, now, 1)));
    }
    Ok(())
}

/// Whether completions are metered (then [`completion_allowance`] decides).
pub fn completions_metered() -> bool {
    LIMITS.cqe[0].load(Relaxed) != 0
}

/// How many of `max` completions the polling grant lets the app have now (all of them
/// without one); `Err(wait_ps)` when none yet. Consumes nothing: the caller takes what is
/// there and pays with [`consume_completions`].
pub fn completion_allowance(now: u64, max: u64) -> Result<u64, u64> {
    let Some(g) = limiter(&LIMITS.cqe) else {
        return Ok(max);
    };
    if max == 0 {
        return Ok(0);
    }
    let t = CQE_TAT.load(Relaxed);
    match g.admit_up_to(t, now, max) {
        (0, _) => Err(g.wait(t, now).max(1)),
        (n, _) => Ok(n),
    }
}

/// Charges `n` delivered completions to the polling grant.
pub fn consume_completions(now: u64, n: u64) {
    if let Some(g) = limiter(&LIMITS.cqe).filter(|_| n > 0) {
        let _ = CQE_TAT.fetch_update(Relaxed, Relaxed, |t| Some(g.advance(t, now, n)));
    }
}

/// The tracking period of work in flight, bumped whenever tracking starts (see
/// [`InFlight::in_epoch`]).
pub static TRACKING_EPOCH: AtomicU64 = AtomicU64::new(0);

/// A QP's work in flight in the current tracking period.
fn tracked(g: &mut QpGov) -> &mut InFlight {
    g.inflight.in_epoch(TRACKING_EPOCH.load(Relaxed))
}

/// Is `qp` allowed to put work on the NIC now (top-k)?
fn gate_allows(id: QpId, now_ns: u64) -> bool {
    let k = LIMITS.k.load(Relaxed) as usize;
    k == 0 || GATE.lock().request(id, now_ns, k)
}

/// Lists a QP for the engine (once) and wakes it.
pub fn make_pending(ctx: usize, qpn: u32, q: &QpCounters) {
    if !q.pending.swap(true, Relaxed) {
        PENDING.lock().push_back((ctx, qpn));
    }
    crate::engine::wake();
}

/// What a governed post did.
pub struct Posted {
    pub rc: c_int,
    /// WRs the provider took now, and their bytes (queued ones count when the engine posts).
    pub direct: u64,
    pub direct_bytes: u64,
    /// Of `direct_bytes`, those of RDMA READs.
    pub direct_read_bytes: u64,
}

fn sge_sum(w: &IbvSendWr) -> u64 {
    if w.sg_list.is_null() || w.num_sge <= 0 {
        return 0;
    }
    // SAFETY: the application's WR, whose list the provider reads the same way.
    let s = unsafe { std::slice::from_raw_parts(w.sg_list, w.num_sge as usize) };
    s.iter().map(|e| u64::from(e.length)).sum()
}

/// A rate limit is in force: the app's own, or a receiver's cap.
fn paced() -> bool {
    limiter(&LIMITS.byte).is_some() || limiter(&LIMITS.wqe).is_some() || CAPS_PRESENT.load(Relaxed)
}

/// Posts the first `n` WRs of the list one provider call each. A NIC fetches the WRs of one
/// doorbell as one batch, ahead of other QPs' work (docs/design.md §6, the DRUM paper's Fig. 2a);
/// a paced app's burst handed over as one list would hold other apps' work for the whole
/// batch, however well its rate is kept. One doorbell per WR lets the NIC's arbitration
/// interleave them. Returns the first failure (the provider set `*bad` to that WR).
///
/// # Safety
/// `wr` is the application's list with at least `n` WRs; the other arguments as for
/// [`post`].
unsafe fn post_one_by_one(
    qp: *mut IbvQp,
    wr: *mut IbvSendWr,
    n: u64,
    bad: *mut *mut IbvSendWr,
    orig: PostSendFn,
) -> c_int {
    let mut p = wr;
    for _ in 0..n {
        // SAFETY: within the application's list; its link is restored right after.
        let rest = unsafe { std::mem::replace(&mut (*p).next, ptr::null_mut()) };
        // SAFETY: forwarding one of the application's own WRs.
        let rc = unsafe { orig(qp, p, bad) };
        // SAFETY: as above.
        unsafe { (*p).next = rest };
        if rc != 0 {
            return rc;
        }
        p = rest;
    }
    0
}

/// The governed `ibv_post_send`.
///
/// # Safety
/// `qp`, `wr` and `bad` are the application's arguments to `ibv_post_send`; `orig` is the
/// provider's `post_send`; `q` is `qp`'s slot in the context `st`.
pub unsafe fn post(
    st: &ContextState,
    q: &QpCounters,
    qp: *mut IbvQp,
    wr: *mut IbvSendWr,
    bad: *mut *mut IbvSendWr,
    orig: PostSendFn,
) -> Posted {
    // SAFETY: the QP the application posts to.
    let (qpn, state) = unsafe { ((*qp).qp_num, (*qp).state) };
    let mut g = q.gov.lock().unwrap_or_else(|e| e.into_inner());
    g.qp = qp as usize;
    let id = qp_id(st.index, qpn);
    let now = now_ps();
    let long = LIMITS.long_msg.load(Relaxed);
    // Walk the list: how many WRs may go now (only while nothing is queued before them).
    let mut n_direct = 0u64;
    let mut direct_bytes = 0u64;
    let mut direct_read_bytes = 0u64;
    let mut last_direct: *mut IbvSendWr = ptr::null_mut();
    let mut w = wr;
    let mut any_long = false;
    // A QP that is not ready to send is left to the provider, which refuses as it would.
    let may_queue = state == IBV_QPS_RTS;
    // Nothing may overtake what is queued, and a QP without a gate slot posts nothing: both
    // hold for the whole list, so they are asked once.
    let open = !may_queue || (g.queue.is_empty() && gate_allows(id, now / 1000));
    while !w.is_null() {
        // SAFETY: the application's WR list.
        let r = unsafe { &*w };
        let bytes = sge_sum(r);
        any_long |= long > 0 && bytes >= long;
        let go = !may_queue || (open && admit(now, bytes, g.peer).is_ok());
        if !go {
            break;
        }
        n_direct += 1;
        direct_bytes += bytes;
        last_direct = w;
        w = r.next;
    }
    let mut rc = 0;
    if !last_direct.is_null() {
        rc = if paced() {
            // SAFETY: the admitted prefix of the application's list.
            unsafe { post_one_by_one(qp, wr, n_direct, bad, orig) }
        } else {
            // Hand the admitted prefix over in one call, cutting the list there for the call.
            // SAFETY: `last_direct` is in the application's list; restored right after.
            let rest = unsafe { std::mem::replace(&mut (*last_direct).next, ptr::null_mut()) };
            // SAFETY: forwarding the application's own WRs.
            let rc = unsafe { orig(qp, wr, bad) };
            // SAFETY: as above.
            unsafe { (*last_direct).next = rest };
            rc
        };
        let fail_at = if rc != 0 && !bad.is_null() {
            // SAFETY: the provider set `*bad` on failure.
            unsafe { *bad }
        } else {
            ptr::null_mut()
        };
        let tracking = LIMITS.tracking.load(Relaxed);
        let (mut posted, mut posted_bytes, mut posted_read) = (0, 0, 0);
        let mut p = wr;
        for _ in 0..n_direct {
            if p.is_null() || p == fail_at {
                break;
            }
            // SAFETY: the application's WR list (its link restored above).
            let r = unsafe { &*p };
            if tracking {
                let signalled = g.sig_all || r.send_flags & IBV_SEND_SIGNALED != 0;
                tracked(&mut g).on_post(signalled);
            }
            posted += 1;
            let b = sge_sum(r);
            posted_bytes += b;
            if r.opcode == crate::ffi::IBV_WR_RDMA_READ {
                posted_read += b;
            }
            p = r.next;
        }
        n_direct = posted;
        direct_bytes = posted_bytes;
        direct_read_bytes = posted_read;
        STATS.direct_wqes.fetch_add(posted, Relaxed);
        if rc != 0 {
            // The provider refused part of what we handed over: report exactly that, and
            // queue nothing after it (the application believes none of the rest posted).
            return Posted {
                rc,
                direct: n_direct,
                direct_bytes,
                direct_read_bytes,
            };
        }
    }
    // Queue the rest.
    let mut queued = 0;
    while !w.is_null() {
        // SAFETY: the application's WR, valid for the duration of the call.
        let r = unsafe { &*w };
        // SAFETY: the provider would read the same entries and inline data now.
        match unsafe { OwnedWr::copy(r, g.sig_all, now / 1000) } {
            Ok(o) => {
                any_long |= long > 0 && o.bytes >= long;
                g.queue.push_back(o);
                queued += 1;
                w = r.next;
            }
            Err(_) => {
                // Nothing sensible to defer: report it as the provider would, at this WR.
                STATS.unqueueable_wqes.fetch_add(1, Relaxed);
                if !bad.is_null() {
                    // SAFETY: the caller's out-pointer.
                    unsafe { *bad = w };
                }
                rc = libc::EINVAL;
                break;
            }
        }
    }
    if queued > 0 {
        q.queued.fetch_add(queued, Relaxed);
        QUEUED.fetch_add(queued, Relaxed);
    }
    if any_long && !g.busy {
        g.busy = true;
        EVENTS.lock().push(ShimMsg::Traffic { qpn, busy: true });
    }
    drop(g);
    if queued > 0 {
        make_pending(st.key, qpn, q);
    }
    settle(st, q, qpn);
    Posted {
        rc,
        direct: n_direct,
        direct_bytes,
        direct_read_bytes,
    }
}

/// Settles a QP after its queue or its work in flight changed: when nothing it posted is
/// still visible in flight, its long-message traffic has ended (if nothing is queued
/// either) and its gate slot goes to the next QP — kept only by a holder that still has
/// work queued and was not asked to drain; a drained QP with work queued waits again.
pub fn settle(st: &ContextState, q: &QpCounters, qpn: u32) {
    let queue_empty = {
        let mut g = q.gov.lock().unwrap_or_else(|e| e.into_inner());
        if !tracked(&mut g).idle() {
            return;
        }
        let empty = g.queue.is_empty();
        if empty && g.busy {
            g.busy = false;
            EVENTS.lock().push(ShimMsg::Traffic { qpn, busy: false });
        }
        empty
    };
    let k = LIMITS.k.load(Relaxed) as usize;
    let id = qp_id(st.index, qpn);
    let now = now_ps() / 1000;
    let granted = {
        let mut gate = GATE.lock();
        match gate.slot(id) {
            Slot::Holding if queue_empty => gate.release(id, now, k.max(1)),
            Slot::Draining => {
                let mut g = gate.release(id, now, k.max(1));
                // With work left it queues again — or, with a slot free at once, goes on.
                if !queue_empty && gate.request(id, now, k.max(1)) {
                    g.push(id);
                }
                g
            }
            _ => return,
        }
    };
    if !granted.is_empty() {
        crate::engine::grant(&granted);
    }
}

/// Completions the application polled: follow work in flight and release idle QPs.
pub fn on_completions(st: &ContextState, done: &[IbvWc]) {
    for w in done {
        let Some(q) = st.qps.get(w.qp_num) else {
            continue;
        };
        {
            let mut g = q.gov.lock().unwrap_or_else(|e| e.into_inner());
            if w.status != 0 {
                tracked(&mut g).on_error();
            } else if w.opcode < IBV_WC_RECV {
                tracked(&mut g).on_completion();
            } else {
                continue;
            }
        }
        settle(st, q, w.qp_num);
    }
}

/// Serves one QP's queue from the engine: posts what the gate and limiters admit now.
/// Returns `Some(wait_ps)` when its head must wait for the limiters, `None` when the queue
/// is empty or the QP waits for a gate slot (it is listed again when it gets one).
pub fn serve(st: &ContextState, q: &QpCounters, qpn: u32) -> Option<u64> {
    let orig = st.orig.post_send?;
    let mut g = q.gov.lock().unwrap_or_else(|e| e.into_inner());
    let id = qp_id(st.index, qpn);
    let mut wait = None;
    // A holder keeps its slot until `settle` releases it, which needs this QP's lock: asked
    // once for the whole pass.
    let gate_open = g.queue.is_empty() || gate_allows(id, now_ps() / 1000);
    loop {
        let now = now_ps();
        let peer = g.peer;
        let qp = g.qp as *mut IbvQp;
        let Some(head) = g.queue.front_mut() else {
            break;
        };
        if qp.is_null() {
            break;
        }
        if !gate_open {
            break;
        }
        if let Err(w) = admit(now, head.bytes, peer) {
            wait = Some(w);
            break;
        }
        let mut bad = ptr::null_mut();
        // SAFETY: the QP is alive (destroying it takes this lock and clears `qp`), and the
        // WR is our own copy.
        let rc = unsafe { orig(qp, head.as_wr(), &mut bad) };
        let o = g.queue.pop_front().expect("head exists");
        q.queued.fetch_sub(1, Relaxed);
        QUEUED.fetch_sub(1, Relaxed);
        STATS
            .queue_delay_ns
            .fetch_add((now / 1000).saturating_sub(o.queued_at), Relaxed);
        STATS.deferred_wqes.fetch_add(1, Relaxed);
        if rc == 0 {
            q.send_wqes.fetch_add(1, Relaxed);
            q.send_bytes.fetch_add(o.bytes, Relaxed);
            if o.is_read() {
                q.read_bytes.fetch_add(o.bytes, Relaxed);
            }
            st.counters.send_wqes.fetch_add(1, Relaxed);
            st.counters.send_bytes.fetch_add(o.bytes, Relaxed);
            if LIMITS.tracking.load(Relaxed) {
                tracked(&mut g).on_post(o.signalled);
            }
        } else {
            STATS.deferred_post_errors.fetch_add(1, Relaxed);
            let failed = IbvWc {
                wr_id: o.wr_id(),
                status: IBV_WC_LOC_QP_OP_ERR,
                qp_num: qpn,
                ..IbvWc::default()
            };
            // SAFETY: the QP is alive (as above).
            let told = unsafe { crate::vcq::fail_send(qp, failed) };
            crate::warn_once(
                crate::Trouble::DeferredPost,
                &format!(
                    "the provider refused a held-back work request (wr_id {}, error {rc}); {}",
                    o.wr_id(),
                    if told {
                        "the application gets an error completion for it"
                    } else {
                        "it is dropped, as a device would flush it"
                    }
                ),
            );
        }
    }
    drop(g);
    settle(st, q, qpn);
    wait
}

/// The QP is being destroyed: what it still holds back is dropped (a device flushes it),
/// and it leaves the gate.
pub fn forget(st: &ContextState, q: &QpCounters, qpn: u32) {
    let dropped = {
        let mut g = q.gov.lock().unwrap_or_else(|e| e.into_inner());
        let n = g.queue.len() as u64;
        let was_busy = g.busy;
        *g = QpGov::default();
        QUEUED.fetch_sub(q.queued.swap(0, Relaxed), Relaxed);
        if was_busy {
            EVENTS.lock().push(ShimMsg::Traffic { qpn, busy: false });
        }
        n
    };
    if dropped > 0 {
        STATS.dropped_wqes.fetch_add(dropped, Relaxed);
        // Work held back until its QP is destroyed is what an application stalled on the
        // shim leaves behind: the state that held it is worth seeing, once.
        if !DROP_REPORTED.swap(true, Relaxed) {
            eprintln!(
                "drum-shim: QP {qpn} destroyed with {dropped} work requests still held back; {}",
                state_report(st)
            );
        }
    }
    {
        let mut gate = GATE.lock();
        if !gate.is_empty() {
            let k = LIMITS.k.load(Relaxed) as usize;
            let granted = gate.release(qp_id(st.index, qpn), now_ps() / 1000, k.max(1));
            drop(gate);
            if !granted.is_empty() {
                crate::engine::grant(&granted);
            }
        }
    }
}

static DROP_REPORTED: AtomicBool = AtomicBool::new(false);

/// The shim's view of a context, for diagnostics: each QP with work held back or in
/// flight (its gate slot, whether the engine lists it), the gate, how far the polling grant
/// is spent ahead, and the virtual CQs holding completions. Only `try_lock`s: it may run
/// with any lock of the shim held.
pub fn state_report(st: &ContextState) -> String {
    let epoch = TRACKING_EPOCH.load(Relaxed);
    let gate = GATE.try_lock();
    let mut qps = Vec::new();
    for (qpn, q) in st.qps.live() {
        let Ok(g) = q.gov.try_lock() else {
            qps.push(format!("{qpn}: busy"));
            continue;
        };
        let (queued, in_flight) = (g.queue.len(), g.inflight.outstanding_in(epoch));
        if queued == 0 && in_flight == 0 {
            continue;
        }
        let slot = gate.as_ref().map_or_else(
            || "?".to_string(),
            |gt| format!("{:?}", gt.slot(qp_id(st.index, qpn))),
        );
        qps.push(format!(
            "{qpn}: slot={slot} queued={queued} in_flight={in_flight} listed={} posted={} completions={}",
            q.pending.load(Relaxed),
            q.send_wqes.load(Relaxed),
            q.completions.load(Relaxed),
        ));
    }
    let (holders, waiting) = gate.as_ref().map_or((0, 0), |g| (g.holders(), g.waiting()));
    drop(gate);
    let cqe_ahead_us = CQE_TAT.load(Relaxed).saturating_sub(now_ps()) / 1_000_000;
    format!(
        "gate k={} holders={holders} waiting={waiting}; polling grant spent {cqe_ahead_us} µs ahead; QPs [{}]; {}",
        LIMITS.k.load(Relaxed),
        qps.join("; "),
        crate::vcq::held_report()
    )
}

/// Queues a message for the agent (sent by the engine).
pub fn event(m: ShimMsg) {
    EVENTS.lock().push(m);
    crate::engine::wake();
}

/// Whether the data path must take the governed way for this QP.
pub fn governs(q: &QpCounters) -> bool {
    LIMITS.active.load(Acquire) || q.queued.load(Relaxed) > 0
}

pub fn lock_for_fork() {
    GATE.acquire();
    PENDING.acquire();
    EVENTS.acquire();
    CAPS.acquire();
}

pub fn unlock_after_fork() {
    CAPS.release();
    EVENTS.release();
    PENDING.release();
    GATE.release();
}

/// The governance part of the exit summary.
pub fn summary(queued: u64) -> String {
    let rate = |c: &[AtomicU64; 2]| {
        limiter(c).map_or(0, |g| (1e12 / g.interval_ps() as f64).round() as u64)
    };
    format!(
        "extended_verbs={} direct_verbs_queues={} wr_api_qps={} governed={} grant_generation={} rate_bytes_per_s={} rate_wqe_per_s={} rate_cqe_per_s={} max_active_qps={} \
         direct_wqes={} deferred_wqes={} queue_delay_us={} queued_wqes={} deferred_post_errors={} \
         dropped_wqes={} held_polls={} nic_pacing_sets={} nic_pacing_refusals={}",
        crate::extended::USES.load(Relaxed),
        crate::direct::QUEUES_TAKEN.load(Relaxed),
        crate::wr_api::WRAPPED_QPS.load(Relaxed),
        if LIMITS.active.load(Relaxed) {
            "yes"
        } else {
            "no"
        },
        LIMITS.generation.load(Relaxed),
        rate(&LIMITS.byte),
        rate(&LIMITS.wqe),
        rate(&LIMITS.cqe),
        LIMITS.k.load(Relaxed),
        STATS.direct_wqes.load(Relaxed),
        STATS.deferred_wqes.load(Relaxed),
        STATS.queue_delay_ns.load(Relaxed) / 1000,
        queued,
        STATS.deferred_post_errors.load(Relaxed),
        STATS.dropped_wqes.load(Relaxed),
        STATS.held_polls.load(Relaxed),
        STATS.nic_pacing_sets.load(Relaxed),
        STATS.nic_pacing_refusals.load(Relaxed),
    )
}
