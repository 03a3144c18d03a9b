//! The process's governed contexts: a fixed table of slots that the data path searches with
//! atomic loads only (`lookup`), each context's state (its original ops, counters and QP
//! records), the cold lock that open, close, the exit summary and the engine's passes take,
//! and the process-wide totals.

use crate::counters::{Counters, Snapshot};
use crate::ffi::*;
use crate::qp::{QpRecord, QpTable};
use crate::spin::SpinLock;
use crate::trouble::{warn_once, Trouble};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr;
use std::sync::atomic::{
    AtomicBool, AtomicPtr, AtomicU64, AtomicUsize,
    Ordering::{Acquire, Relaxed},
};
use std::time::Instant;

/// Contexts governed at once; more are left pass-through (and reported).
const MAX_CONTEXTS: usize = 64;
/// Per-QP counter slots per context; QPs beyond count only in the context totals.
pub(crate) const QPS_PER_CONTEXT: usize = 1024;

/// The original ops of one context, as the provider and libibverbs set them.
#[derive(Clone, Copy)]
pub(crate) struct Orig {
    pub(crate) post_send: Option<PostSendFn>,
    pub(crate) post_recv: Option<PostRecvFn>,
    pub(crate) post_srq_recv: Option<PostSrqRecvFn>,
    pub(crate) poll_cq: Option<PollCqFn>,
    pub(crate) req_notify_cq: Option<ReqNotifyCqFn>,
}

/// The original creation ops of an extended context's `verbs_context` (`extended`).
#[derive(Clone, Copy, Default)]
pub struct ExtOrig {
    pub create_cq_ex: Option<CreateCqExFn>,
    pub create_qp_ex: Option<CreateQpExFn>,
}

/// Everything the shim keeps per context. Immutable after publication except the atomics
/// (and the QPs' governance state, under their own locks).
pub struct ContextState {
    /// The context's address (its key in `SLOTS`) and its slot.
    pub(crate) key: usize,
    pub(crate) index: usize,
    pub(crate) orig: Orig,
    pub(crate) ext: ExtOrig,
    pub(crate) counters: Counters,
    pub(crate) qps: QpTable,
}

/// One context slot: the context's address as key, and its state. The key is compared
/// before the state is touched, so a lookup for one context never dereferences the state
/// of another that is being closed concurrently.
pub(crate) struct Slot {
    pub(crate) key: AtomicUsize,
    pub(crate) state: AtomicPtr<ContextState>,
}

pub(crate) static SLOTS: [Slot; MAX_CONTEXTS] = [const {
    Slot {
        key: AtomicUsize::new(0),
        state: AtomicPtr::new(ptr::null_mut()),
    }
}; MAX_CONTEXTS];
/// Slots ever used: bounds the data path's scan.
pub(crate) static HIGH: AtomicUsize = AtomicUsize::new(0);
/// Serialises the cold paths (open, close, the exit summary) and the engine's passes over
/// the contexts; never taken on the application's data path.
pub(crate) static COLD: SpinLock<()> = SpinLock::new(());

pub(crate) static CLOSED: Counters = Counters::new();
pub(crate) static CLOSED_QPS: AtomicU64 = AtomicU64::new(0);
pub(crate) static GOVERNED: AtomicU64 = AtomicU64::new(0);
pub(crate) static PASS_THROUGH: AtomicU64 = AtomicU64::new(0);
static COUNTING_STOPPED: AtomicBool = AtomicBool::new(false);

/// The governed state of `ctx`, found without locks.
///
/// The returned reference is valid until `ibv_close_device(ctx)`; using a context after or
/// during its close is already undefined behaviour for the application.
pub(crate) fn lookup(ctx: *mut IbvContext) -> Option<&'static ContextState> {
    let key = ctx as usize;
    let n = HIGH.load(Acquire);
    for slot in SLOTS.iter().take(n) {
        if slot.key.load(Acquire) == key {
            let p = slot.state.load(Acquire);
            // SAFETY: a state is published (Release) before its key and freed only after the
            // key is cleared, under the cold lock, by `ibv_close_device` of this very context.
            return unsafe { p.as_ref() };
        }
    }
    None
}

/// Runs counting code; a panic stops all counting for the process (the data path then only
/// forwards) instead of unwinding into C.
#[inline]
pub(crate) fn count<F: FnOnce()>(f: F) {
    if COUNTING_STOPPED.load(Relaxed) {
        return;
    }
    if catch_unwind(AssertUnwindSafe(f)).is_err() {
        COUNTING_STOPPED.store(true, Relaxed);
        warn_once(
            Trouble::Counting,
            "internal error while counting; counting stopped, the application runs unchanged",
        );
    }
}

/// Process-wide totals: every live context plus everything closed so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Totals {
    pub governed_contexts: u64,
    pub pass_through_contexts: u64,
    pub live_contexts: u64,
    pub qps: u64,
    pub qp_table_overflow: u64,
    pub counts: Snapshot,
    pub counting_stopped: bool,
    /// WRs in the software queues now.
    pub queued_wqes: u64,
    /// WRs on the NIC not known to be complete, over the tracked QPs.
    pub outstanding_wqes: u64,
}

/// Reads the totals (a cold path: takes the lock that open and close take).
pub fn totals() -> Totals {
    let _g = COLD.lock();
    totals_held()
}

/// The totals, or `None` if the cold lock is not free by `deadline`.
pub fn totals_until(deadline: Instant) -> Option<Totals> {
    let _g = COLD.lock_until(deadline)?;
    Some(totals_held())
}

/// The totals, with the cold lock held by the caller.
fn totals_held() -> Totals {
    let mut t = Totals {
        governed_contexts: GOVERNED.load(Relaxed),
        pass_through_contexts: PASS_THROUGH.load(Relaxed),
        qps: CLOSED_QPS.load(Relaxed),
        counts: CLOSED.snapshot(),
        counting_stopped: COUNTING_STOPPED.load(Relaxed),
        ..Totals::default()
    };
    for slot in SLOTS.iter().take(HIGH.load(Acquire)) {
        // SAFETY: states are freed only under the lock held here.
        if let Some(st) = unsafe { slot.state.load(Acquire).as_ref() } {
            t.live_contexts += 1;
            t.qps += st.qps.entries().len() as u64;
            t.qp_table_overflow += st.qps.overflow();
            t.queued_wqes += st.qps.queued();
            t.outstanding_wqes += st.qps.outstanding();
            t.counts.merge(&st.counters.snapshot());
        }
    }
    t
}

/// Bytes posted so far on each of `qpns` that has a slot: `(qpn, towards the peer, read
/// from it)` (a cold path: takes the lock that open and close take). QP numbers are per
/// device, so with several devices open the first context that knows the number answers.
pub fn qp_bytes(qpns: impl Iterator<Item = u32>) -> Vec<(u32, u64, u64)> {
    let _g = COLD.lock();
    let n = HIGH.load(Acquire);
    qpns.filter_map(|qpn| {
        SLOTS.iter().take(n).find_map(|slot| {
            // SAFETY: states are freed only under the lock held here.
            let st = unsafe { slot.state.load(Acquire).as_ref() }?;
            st.qps.bytes(qpn).map(|(out, back)| (qpn, out, back))
        })
    })
    .collect()
}

/// Runs `f` on the slot of each of `qpns` that has one (a cold path: takes the lock that
/// open and close take, so no slot is freed meanwhile).
pub fn with_qps(qpns: impl Iterator<Item = u32>, mut f: impl FnMut(&QpRecord)) {
    let _g = COLD.lock();
    let n = HIGH.load(Acquire);
    for qpn in qpns {
        let q = SLOTS.iter().take(n).find_map(|slot| {
            // SAFETY: states are freed only under the lock held here.
            let st = unsafe { slot.state.load(Acquire).as_ref() }?;
            st.qps.get(qpn)
        });
        if let Some(q) = q {
            f(q);
        }
    }
}
