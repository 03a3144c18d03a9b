//! Enforcement of the app's grant on each QP (docs/design.md §5): the per-QP software send
//! queues, top-k gating and the tracking of work in flight, on the limits that `limits`
//! admits against. The engine thread drains the queues (`drain`); this module holds what
//! it and the application's posting and polling threads share: the gate, the list of QPs
//! with queued work, the events for the agent, and what happens when a post arrives
//! (`post`), when completions leave a real CQ (`follow`) and when a QP's work settles.
//!
//! A post goes straight to the provider when nothing is in force; otherwise, under the QP's
//! lock, the longest prefix of the WR list that the limiters and the gate admit now goes
//! to the provider in one call and the rest is copied into the QP's queue, behind anything
//! already queued, so the QP's order is kept.

use crate::context::{count, lookup, ContextState, SLOTS};
use crate::ffi::*;
use crate::gate::{Gate, QpId, Slot};
use crate::inflight::InFlight;
use crate::limits::{self, admit, now_ps, paced, LIMITS, TRACKING_EPOCH};
use crate::qp::{QpGov, QpRecord};
use crate::sendq::OwnedWr;
use crate::spin::SpinLock;
use crate::stats::{QUEUED, STATS};
use crate::trouble::{warn_once, Trouble};
use crate::wake::wake;
use drum_table::layout::Grant;
use drum_table::message::ShimMsg;
use libc::c_int;
use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr;
use std::sync::atomic::{
    AtomicBool,
    Ordering::{Acquire, Relaxed},
};

/// The app's gate: one per process (one app per process).
pub static GATE: SpinLock<Gate> = SpinLock::new(Gate::new());
/// QPs with queued work for the engine: (context key, QP number).
pub static PENDING: SpinLock<VecDeque<(usize, u32)>> = SpinLock::new(VecDeque::new());
/// Messages for the agent, sent by the engine.
pub static EVENTS: SpinLock<Vec<ShimMsg>> = SpinLock::new(Vec::new());

/// The gate's name for a QP: its context slot and QP number.
pub fn qp_id(ctx_index: usize, qpn: u32) -> QpId {
    ((ctx_index as u64) << 32) | u64::from(qpn)
}

/// A QP's work in flight in the current tracking period.
pub fn tracked(g: &mut QpGov) -> &mut InFlight {
    g.inflight.in_epoch(TRACKING_EPOCH.load(Relaxed))
}

/// Is `qp` allowed to put work on the NIC now (top-k)?
pub fn gate_allows(id: QpId, now_ns: u64) -> bool {
    let k = LIMITS.k.load(Relaxed) as usize;
    k == 0 || GATE.lock().request(id, now_ns, k)
}

/// Lists a QP for the engine (once) and wakes it.
pub fn make_pending(ctx: usize, qpn: u32, q: &QpRecord) {
    if !q.pending.swap(true, Relaxed) {
        PENDING.lock().push_back((ctx, qpn));
    }
    wake();
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
    q: &QpRecord,
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
        let go = !may_queue || (open && admit(now, bytes, g.dest()).is_ok());
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
pub fn settle(st: &ContextState, q: &QpRecord, qpn: u32) {
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
        grant(&granted);
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

/// The QP is being destroyed: what it still holds back is dropped (a device flushes it),
/// and it leaves the gate. `held_cqs` describes the completions the virtual CQs hold, for
/// the report of the first such drop (the CQs are the caller's to know).
pub fn forget(st: &ContextState, q: &QpRecord, qpn: u32, held_cqs: impl FnOnce() -> String) {
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
                state_report(st, &held_cqs())
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
                grant(&granted);
            }
        }
    }
}

static DROP_REPORTED: AtomicBool = AtomicBool::new(false);

/// The shim's view of a context, for diagnostics: each QP with work held back or in
/// flight (its gate slot, whether the engine lists it), the gate, how far the polling grant
/// is spent ahead, and `held_cqs` (the virtual CQs holding completions). Only `try_lock`s:
/// it may run with any lock of the shim held.
pub fn state_report(st: &ContextState, held_cqs: &str) -> String {
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
    let cqe_ahead_us = limits::cqe_ahead_ps(now_ps()) / 1_000_000;
    format!(
        "gate k={} holders={holders} waiting={waiting}; polling grant spent {cqe_ahead_us} µs ahead; QPs [{}]; {}",
        LIMITS.k.load(Relaxed),
        qps.join("; "),
        held_cqs
    )
}

/// Queues a message for the agent (sent by the engine).
pub fn event(m: ShimMsg) {
    EVENTS.lock().push(m);
    wake();
}

/// Puts a grant in force (`None`: no limits — no agent, fail-open): its limits, then the
/// gate's size.
pub fn apply(grant: Option<&Grant>) {
    let g = grant.copied().unwrap_or_default();
    let now = limits::apply(&g);
    if g.max_active_qps > 0 {
        // A larger gate has room for QPs waiting now: nothing else would hand it to them
        // until a holder released its slot.
        let granted = GATE.lock().fill(now / 1000, g.max_active_qps as usize);
        if !granted.is_empty() {
            self::grant(&granted);
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
            self::grant(&waiting);
        }
    }
}

/// QPs that got a gate slot: list them for the engine.
pub fn grant(ids: &[QpId]) {
    for &id in ids {
        let (idx, qpn) = ((id >> 32) as usize, id as u32);
        let Some(slot) = SLOTS.get(idx) else {
            continue;
        };
        let key = slot.key.load(Acquire);
        if let Some(st) = lookup(key as *mut _) {
            if let Some(q) = st.qps.get(qpn) {
                make_pending(key, qpn, q);
            }
        }
    }
}

/// Whether the data path must take the governed way for this QP.
pub fn governs(q: &QpRecord) -> bool {
    LIMITS.active.load(Acquire) || q.queued.load(Relaxed) > 0
}

pub fn lock_for_fork() {
    GATE.acquire();
    PENDING.acquire();
    EVENTS.acquire();
    limits::CAPS.acquire();
}

pub fn unlock_after_fork() {
    limits::CAPS.release();
    EVENTS.release();
    PENDING.release();
    GATE.release();
}

/// Governance failed internally once: the data path only forwards from then on.
pub static GOVERNING_STOPPED: AtomicBool = AtomicBool::new(false);

/// Whether a post on this QP takes the governed way (see `ops::drum_post_send`).
pub(crate) fn governing(q: &QpRecord) -> bool {
    !GOVERNING_STOPPED.load(Relaxed) && governs(q)
}

/// Governance failed internally: lift every limit for good (the engine then posts what is
/// queued) and say so once.
pub(crate) fn stop_governing() {
    GOVERNING_STOPPED.store(true, Relaxed);
    let _ = catch_unwind(|| apply(None));
    warn_once(
        Trouble::Governing,
        "internal error while governing a post; the application runs ungoverned",
    );
}

/// Completions the application just polled from a CQ that is not virtual, or from an
/// `ibv_cq_ex`: the poll counted, and the completions followed.
pub(crate) fn polled(st: &ContextState, done: &[IbvWc]) {
    count_poll(st);
    follow(st, done);
}

pub(crate) fn count_poll(st: &ContextState) {
    count(|| {
        st.counters.poll_calls.fetch_add(1, Relaxed);
    });
}

/// Completions that left a real CQ, once each whoever moved them (the application's poll
/// or the engine thread): counted, and followed for gating.
pub(crate) fn follow(st: &ContextState, done: &[IbvWc]) {
    if done.is_empty() {
        return;
    }
    count(|| {
        let errors = done.iter().filter(|w| w.status != 0).count() as u64;
        st.counters
            .completions
            .fetch_add(done.len() as u64, Relaxed);
        st.counters.completion_errors.fetch_add(errors, Relaxed);
        for w in done {
            if let Some(q) = st.qps.get(w.qp_num) {
                q.completions.fetch_add(1, Relaxed);
            }
        }
    });
    if LIMITS.tracking.load(Relaxed)
        && !GOVERNING_STOPPED.load(Relaxed)
        && catch_unwind(AssertUnwindSafe(|| on_completions(st, done))).is_err()
    {
        stop_governing();
    }
}
