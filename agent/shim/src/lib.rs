//! `libdrum_shim.so`: DRUM's data-plane shim, loaded into unmodified verbs applications with
//! `LD_PRELOAD`.
//!
//! The data-path verbs (`ibv_post_send`, `ibv_post_recv`, `ibv_post_srq_recv`, `ibv_poll_cq`,
//! `ibv_req_notify_cq`) are `static inline` in `<infiniband/verbs.h>` and call through
//! `ctx->ops`, so no symbol of theirs can be interposed. The shim instead exports the
//! (unversioned) `ibv_open_device` and `ibv_close_device`, which bind the application's
//! versioned references; it forwards to the real ones found with
//! `dlvsym(RTLD_NEXT, name, "IBVERBS_1.1")` and swaps the governed op pointers of every
//! context returned. The originals live in a per-context entry that is immutable once
//! published; the data path finds it with atomic loads only (see [`lookup`]).
//!
//! Failure policy: nothing may unwind into C and nothing may crash the application. Every
//! entry point runs its own logic under `catch_unwind`; on trouble the context (or the
//! counting) falls back to pass-through and one line on stderr says so.
//!
//! It counts (WQEs, bytes, completions per context and QP), registers with the host's
//! `drum-agent` and enforces its grant (`govern`, `engine`): byte and WQE rates, top-k QP
//! gating, per-receiver caps. See docs/shim.md.

pub mod counters;
mod cq_ex;
mod cq_verbs;
mod direct;
#[cfg(target_arch = "x86_64")]
mod dl;
mod engine;
pub mod extended;
pub mod ffi;
pub mod gate;
mod govern;
pub mod inflight;
mod link;
pub mod nic_pace;
pub mod pacer;
mod qp_verbs;
mod real;
pub mod sendq;
mod spin;
mod summary;
pub(crate) mod vcq;
mod wr_api;

use counters::{Counters, QpCounters, QpTable, Snapshot};
pub use cq_verbs::*;
use ffi::*;
use libc::{c_int, c_void};
use spin::SpinLock;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr;
use std::sync::atomic::{
    AtomicBool, AtomicPtr, AtomicU32, AtomicU64, AtomicUsize,
    Ordering::{Acquire, Relaxed, Release},
};
pub use summary::summary_line;

/// Contexts governed at once; more are left pass-through (and reported).
const MAX_CONTEXTS: usize = 64;
/// Per-QP counter slots per context; QPs beyond count only in the context totals.
const QPS_PER_CONTEXT: usize = 1024;

/// The original ops of one context, as the provider and libibverbs set them.
#[derive(Clone, Copy)]
struct Orig {
    post_send: Option<PostSendFn>,
    post_recv: Option<PostRecvFn>,
    post_srq_recv: Option<PostSrqRecvFn>,
    poll_cq: Option<PollCqFn>,
    req_notify_cq: Option<ReqNotifyCqFn>,
}

/// Everything the shim keeps per context. Immutable after publication except the atomics
/// (and the QPs' governance state, under their own locks).
struct ContextState {
    /// The context's address (its key in `SLOTS`) and its slot.
    key: usize,
    index: usize,
    orig: Orig,
    ext: extended::ExtOrig,
    counters: Counters,
    qps: QpTable,
}

/// One context slot: the context's address as key, and its state. The key is compared
/// before the state is touched, so a lookup for one context never dereferences the state
/// of another that is being closed concurrently.
struct Slot {
    key: AtomicUsize,
    state: AtomicPtr<ContextState>,
}

static SLOTS: [Slot; MAX_CONTEXTS] = [const {
    Slot {
        key: AtomicUsize::new(0),
        state: AtomicPtr::new(ptr::null_mut()),
    }
}; MAX_CONTEXTS];
/// Slots ever used: bounds the data path's scan.
static HIGH: AtomicUsize = AtomicUsize::new(0);
/// Serialises the cold paths (open, close, the exit summary) and the engine's passes over
/// the contexts; never taken on the application's data path.
static COLD: SpinLock<()> = SpinLock::new(());

/// Every lock a forking thread must hold across `fork`, in the order they are taken.
extern "C" fn fork_prepare() {
    COLD.acquire();
    engine::lock_for_fork();
    govern::lock_for_fork();
    vcq::lock_for_fork();
}

extern "C" fn fork_release() {
    vcq::unlock_after_fork();
    govern::unlock_after_fork();
    engine::unlock_after_fork();
    COLD.release();
}

extern "C" fn at_load() {
    // SAFETY: registers plain functions that only touch atomics; no unwinding possible.
    unsafe { libc::pthread_atfork(Some(fork_prepare), Some(fork_release), Some(fork_release)) };
}

/// Runs when the library is loaded, before the application's `main`.
#[used]
#[link_section = ".init_array"]
static INIT: extern "C" fn() = at_load;

static CLOSED: Counters = Counters::new();
static CLOSED_QPS: AtomicU64 = AtomicU64::new(0);
static GOVERNED: AtomicU64 = AtomicU64::new(0);
static PASS_THROUGH: AtomicU64 = AtomicU64::new(0);
static COUNTING_STOPPED: AtomicBool = AtomicBool::new(false);
pub(crate) static GOVERNING_STOPPED: AtomicBool = AtomicBool::new(false);

/// Kinds of trouble, each reported once per process.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Trouble {
    NoRealSymbol = 1,
    Install = 2,
    TableFull = 4,
    AlreadySwapped = 8,
    Counting = 16,
    CloseFailed = 32,
    Uninstall = 64,
    PacerConfig = 128,
    DeferredPost = 256,
    Engine = 512,
    NoAgent = 1024,
    AgentLost = 2048,
    Governing = 4096,
    Extended = 8192,
    Completions = 16384,
    WrApi = 32768,
    DirectVerbs = 65536,
    NicPacing = 131072,
    NoMlx5 = 262144,
}

static WARNED: AtomicU32 = AtomicU32::new(0);

pub(crate) fn warn_once(kind: Trouble, msg: &str) {
    let bit = kind as u32;
    if WARNED.fetch_or(bit, Relaxed) & bit == 0 {
        write_stderr(&format!("drum-shim: {msg}\n"));
    }
}

/// Writes with `write(2)` directly: usable from the exit-time destructor, takes no Rust lock.
pub(crate) fn write_stderr(s: &str) {
    let mut b = s.as_bytes();
    while !b.is_empty() {
        // SAFETY: `b` is a valid byte slice for the duration of the call.
        let n = unsafe { libc::write(2, b.as_ptr().cast(), b.len()) };
        if n <= 0 {
            return;
        }
        b = &b[n as usize..];
    }
}

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
fn count<F: FnOnce()>(f: F) {
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

pub(crate) fn set_errno(e: c_int) {
    // SAFETY: __errno_location returns this thread's errno slot.
    unsafe { *libc::__errno_location() = e };
}

// ---------------------------------------------------------------------------------------------
// Exported entry points
// ---------------------------------------------------------------------------------------------

/// Interposes libibverbs' `ibv_open_device`: opens through the real one, then governs the
/// returned context (or leaves it pass-through and says why).
///
/// # Safety
/// Called by C code with a device from `ibv_get_device_list`, as the real function is.
#[no_mangle]
pub unsafe extern "C" fn ibv_open_device(device: *mut c_void) -> *mut IbvContext {
    let Some(real) = real::OPEN_DEVICE.optional() else {
        warn_once(
            Trouble::NoRealSymbol,
            "libibverbs' ibv_open_device not found (libibverbs.so.1 cannot be loaded); no device opened",
        );
        set_errno(libc::ENOSYS);
        return ptr::null_mut();
    };
    // SAFETY: forwarding the caller's argument unchanged.
    let ctx = unsafe { real(device) };
    if ctx.is_null() {
        return ctx;
    }
    match catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: `ctx` was just returned by the real ibv_open_device and is not yet visible
        // to any other thread of the application.
        unsafe { install(ctx) }
    })) {
        Ok(Ok(())) => {
            GOVERNED.fetch_add(1, Relaxed);
            // Outside the cold lock: the engine's first pass reads the contexts.
            if catch_unwind(engine::ensure_started).is_err() {
                warn_once(Trouble::Engine, "internal error starting the engine thread");
            }
        }
        Ok(Err((kind, why))) => {
            PASS_THROUGH.fetch_add(1, Relaxed);
            warn_once(kind, &format!("{why}; this context runs ungoverned"));
        }
        Err(_) => {
            PASS_THROUGH.fetch_add(1, Relaxed);
            warn_once(
                Trouble::Install,
                "internal error while governing a context; it runs ungoverned",
            );
        }
    }
    ctx
}

/// Interposes `ibv_close_device`: restores the context's original ops, folds its counters
/// into the process totals, then closes through the real function.
///
/// # Safety
/// Called by C code with a context from `ibv_open_device`, as the real function is.
#[no_mangle]
pub unsafe extern "C" fn ibv_close_device(ctx: *mut IbvContext) -> c_int {
    let Some(real) = real::CLOSE_DEVICE.optional() else {
        warn_once(
            Trouble::NoRealSymbol,
            "libibverbs' ibv_close_device not found; context not closed",
        );
        return libc::ENOSYS;
    };
    if !ctx.is_null()
        && catch_unwind(AssertUnwindSafe(|| {
            // SAFETY: `ctx` is an open context the application is closing; no other thread
            // may use it now.
            unsafe { uninstall(ctx) }
        }))
        .is_err()
    {
        warn_once(
            Trouble::Uninstall,
            "internal error while releasing a context",
        );
    }
    // SAFETY: forwarding the caller's argument unchanged.
    let rc = unsafe { real(ctx) };
    if rc != 0 {
        warn_once(
            Trouble::CloseFailed,
            "ibv_close_device failed; that context stays open but ungoverned",
        );
    }
    rc
}

/// Starts the shim's record of a QP just created from `attr` (by `ibv_create_qp` or
/// `ibv_create_qp_ex`, whose attributes begin the same way).
///
/// # Safety
/// `qp` is null or the QP just created from `attr`, which is null or valid.
pub(crate) unsafe fn new_qp(qp: *mut IbvQp, attr: *const IbvQpInitAttr) {
    if qp.is_null() || attr.is_null() {
        return;
    }
    qp_verbs::qp_bookkeeping(|| {
        // SAFETY: per the contract.
        let (ctx, qpn, sig_all) = unsafe { ((*qp).context, (*qp).qp_num, (*attr).sq_sig_all) };
        if let Some(q) = lookup(ctx).and_then(|st| st.qps.get(qpn)) {
            let mut g = q.gov.lock().unwrap_or_else(|e| e.into_inner());
            *g = govern::QpGov::default();
            g.qp = qp as usize;
            g.sig_all = sig_all != 0;
        }
    });
}

/// Runs the shim's part of a CQ or channel verb; `None` (forward to libibverbs) when it is
/// not the shim's object or the shim failed internally (reported once).
pub(crate) fn completions<T, F: FnOnce() -> Option<T>>(f: F) -> Option<T> {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|_| {
        warn_once(
            Trouble::Completions,
            "internal error in a CQ or completion-channel verb; forwarded unchanged",
        );
        None
    })
}

/// Publishes the context's state, then swaps its ops.
///
/// # Safety
/// `ctx` is a valid open context no other thread uses yet.
unsafe fn install(ctx: *mut IbvContext) -> Result<(), (Trouble, &'static str)> {
    let _g = COLD.lock();
    // SAFETY: valid per the contract; `addr_of_mut!` avoids a reference into C memory.
    let ops = unsafe { &mut *ptr::addr_of_mut!((*ctx).ops) };
    let ours = ops.post_send.map(|f| f as usize) == Some(drum_post_send as *const () as usize)
        || ops.poll_cq.map(|f| f as usize) == Some(drum_poll_cq as *const () as usize);
    if ours {
        // Forwarding to ourselves would recurse forever.
        return Err((
            Trouble::AlreadySwapped,
            "context ops already point into the shim (loaded twice?)",
        ));
    }
    let slot = SLOTS
        .iter()
        .position(|s| s.key.load(Relaxed) == 0 && s.state.load(Relaxed).is_null())
        .ok_or((Trouble::TableFull, "more than 64 open contexts"))?;
    let orig = Orig {
        post_send: ops.post_send,
        post_recv: ops.post_recv,
        post_srq_recv: ops.post_srq_recv,
        poll_cq: ops.poll_cq,
        req_notify_cq: ops.req_notify_cq,
    };
    // SAFETY: `ctx` is valid and not yet visible to other threads.
    let ext = unsafe { extended::install(ctx) };
    let state = Box::into_raw(Box::new(ContextState {
        key: ctx as usize,
        index: slot,
        orig,
        ext,
        counters: Counters::new(),
        qps: QpTable::with_capacity(QPS_PER_CONTEXT),
    }));
    SLOTS[slot].state.store(state, Release);
    SLOTS[slot].key.store(ctx as usize, Release);
    HIGH.fetch_max(slot + 1, Release);
    // Only ops that exist are swapped: a wrapper always has an original to forward to.
    if orig.post_send.is_some() {
        ops.post_send = Some(drum_post_send);
    }
    if orig.post_recv.is_some() {
        ops.post_recv = Some(drum_post_recv);
    }
    if orig.post_srq_recv.is_some() {
        ops.post_srq_recv = Some(drum_post_srq_recv);
    }
    if orig.poll_cq.is_some() {
        ops.poll_cq = Some(drum_poll_cq);
    }
    if orig.req_notify_cq.is_some() {
        ops.req_notify_cq = Some(drum_req_notify_cq);
    }
    Ok(())
}

/// Restores the original ops and releases the context's state.
///
/// # Safety
/// `ctx` is a valid open context that no other thread uses any more.
unsafe fn uninstall(ctx: *mut IbvContext) {
    let _g = COLD.lock();
    let Some(slot) = SLOTS.iter().find(|s| s.key.load(Relaxed) == ctx as usize) else {
        return; // a pass-through context
    };
    let p = slot.state.load(Acquire);
    // SAFETY: published by `install` and freed only here, under the same lock.
    let Some(st) = (unsafe { p.as_ref() }) else {
        return;
    };
    // SAFETY: valid per the contract.
    let ops = unsafe { &mut *ptr::addr_of_mut!((*ctx).ops) };
    ops.post_send = st.orig.post_send;
    ops.post_recv = st.orig.post_recv;
    ops.post_srq_recv = st.orig.post_srq_recv;
    ops.poll_cq = st.orig.poll_cq;
    ops.req_notify_cq = st.orig.req_notify_cq;
    // SAFETY: valid per the contract.
    unsafe { extended::uninstall(ctx, &st.ext) };
    slot.key.store(0, Release);
    slot.state.store(ptr::null_mut(), Release);
    CLOSED.add(&st.counters.snapshot());
    CLOSED_QPS.fetch_add(st.qps.entries().len() as u64, Relaxed);
    // SAFETY: `p` came from Box::into_raw in `install`; its key is cleared, so no lookup can
    // reach it any more (a concurrent use of this context would be the app's own bug).
    drop(unsafe { Box::from_raw(p) });
}

// ---------------------------------------------------------------------------------------------
// Governed ops (reached through ctx->ops from the inline verbs)
// ---------------------------------------------------------------------------------------------

/// Sums the scatter/gather lengths of one work request.
///
/// # Safety
/// `sg` points to `n` valid entries when `n > 0` and it is not null.
unsafe fn sge_bytes(sg: *const IbvSge, n: c_int) -> u64 {
    if sg.is_null() || n <= 0 {
        return 0;
    }
    // SAFETY: per the contract (the provider reads the same entries).
    let s = unsafe { std::slice::from_raw_parts(sg, n as usize) };
    s.iter().map(|e| u64::from(e.length)).sum()
}

/// Whether a post on this QP takes the governed way (see [`drum_post_send`]).
pub(crate) fn governing(q: &QpCounters) -> bool {
    !GOVERNING_STOPPED.load(Relaxed) && govern::governs(q)
}

pub(crate) unsafe extern "C" fn drum_post_send(
    qp: *mut IbvQp,
    wr: *mut IbvSendWr,
    bad: *mut *mut IbvSendWr,
) -> c_int {
    // SAFETY: the inline ibv_post_send reached us through qp->context->ops, so qp is valid.
    let (ctx, qpn) = unsafe { ((*qp).context, (*qp).qp_num) };
    let Some(st) = lookup(ctx) else {
        return libc::EINVAL;
    };
    let Some(f) = st.orig.post_send else {
        return libc::EOPNOTSUPP;
    };
    let q = st.qps.get(qpn);
    if let Some(q) = q.filter(|q| governing(q)) {
        // SAFETY: the application's arguments, its QP's slot and the provider's op.
        let r = catch_unwind(AssertUnwindSafe(|| unsafe {
            govern::post(st, q, qp, wr, bad, f)
        }));
        return match r {
            Ok(p) => {
                count(|| {
                    st.counters.send_wqes.fetch_add(p.direct, Relaxed);
                    st.counters.send_bytes.fetch_add(p.direct_bytes, Relaxed);
                    q.send_wqes.fetch_add(p.direct, Relaxed);
                    q.send_bytes.fetch_add(p.direct_bytes, Relaxed);
                    if p.direct_read_bytes > 0 {
                        q.read_bytes.fetch_add(p.direct_read_bytes, Relaxed);
                    }
                });
                p.rc
            }
            Err(_) => {
                stop_governing();
                libc::EIO
            }
        };
    }
    // SAFETY: forwarding the application's arguments unchanged to the original op.
    let rc = unsafe { f(qp, wr, bad) };
    count(|| {
        // On failure the provider points `bad` at the first WR it did not take.
        let stop = if rc == 0 {
            ptr::null_mut()
        } else if bad.is_null() {
            return;
        } else {
            // SAFETY: `bad` is the caller's out-pointer, just written by the provider.
            let b = unsafe { *bad };
            if b.is_null() {
                return;
            }
            b
        };
        let (mut n, mut bytes, mut read) = (0u64, 0u64, 0u64);
        let mut w = wr;
        while !w.is_null() && w != stop {
            // SAFETY: the application's WR list, which the provider has just walked.
            let r = unsafe { &*w };
            // SAFETY: the WR's own scatter/gather list.
            let b = unsafe { sge_bytes(r.sg_list, r.num_sge) };
            bytes += b;
            if r.opcode == ffi::IBV_WR_RDMA_READ {
                read += b;
            }
            n += 1;
            w = r.next;
        }
        st.counters.send_wqes.fetch_add(n, Relaxed);
        st.counters.send_bytes.fetch_add(bytes, Relaxed);
        if let Some(q) = q {
            q.send_wqes.fetch_add(n, Relaxed);
            q.send_bytes.fetch_add(bytes, Relaxed);
            // Most posts carry no READ: no second atomic on their path.
            if read > 0 {
                q.read_bytes.fetch_add(read, Relaxed);
            }
        }
    });
    rc
}

/// Governance failed internally: lift every limit for good (the engine then posts what is
/// queued) and say so once.
pub(crate) fn stop_governing() {
    GOVERNING_STOPPED.store(true, Relaxed);
    let _ = catch_unwind(|| govern::apply(None));
    warn_once(
        Trouble::Governing,
        "internal error while governing a post; the application runs ungoverned",
    );
}

/// Number of receive WRs the provider accepted.
///
/// # Safety
/// `wr` is the list just posted, `bad` the caller's out-pointer.
unsafe fn accepted_recv(wr: *mut IbvRecvWr, rc: c_int, bad: *mut *mut IbvRecvWr) -> u64 {
    let stop = if rc == 0 {
        ptr::null_mut()
    } else {
        let b = if bad.is_null() {
            ptr::null_mut()
        } else {
            // SAFETY: the caller's out-pointer, just written by the provider on failure.
            unsafe { *bad }
        };
        if b.is_null() {
            return 0;
        }
        b
    };
    let mut n = 0;
    let mut w = wr;
    while !w.is_null() && w != stop {
        n += 1;
        // SAFETY: the application's WR list, which the provider has just walked.
        w = unsafe { (*w).next };
    }
    n
}

unsafe extern "C" fn drum_post_recv(
    qp: *mut IbvQp,
    wr: *mut IbvRecvWr,
    bad: *mut *mut IbvRecvWr,
) -> c_int {
    // SAFETY: reached through qp->context->ops, so qp is valid.
    let ctx = unsafe { (*qp).context };
    let Some(st) = lookup(ctx) else {
        return libc::EINVAL;
    };
    let Some(f) = st.orig.post_recv else {
        return libc::EOPNOTSUPP;
    };
    // SAFETY: forwarding unchanged.
    let rc = unsafe { f(qp, wr, bad) };
    count(|| {
        // SAFETY: the list just posted and the caller's out-pointer.
        let n = unsafe { accepted_recv(wr, rc, bad) };
        st.counters.recv_wqes.fetch_add(n, Relaxed);
        // SAFETY: qp is valid.
        if let Some(q) = st.qps.get(unsafe { (*qp).qp_num }) {
            q.recv_wqes.fetch_add(n, Relaxed);
        }
    });
    rc
}

unsafe extern "C" fn drum_post_srq_recv(
    srq: *mut IbvSrq,
    wr: *mut IbvRecvWr,
    bad: *mut *mut IbvRecvWr,
) -> c_int {
    // SAFETY: reached through srq->context->ops, so srq is valid.
    let ctx = unsafe { (*srq).context };
    let Some(st) = lookup(ctx) else {
        return libc::EINVAL;
    };
    let Some(f) = st.orig.post_srq_recv else {
        return libc::EOPNOTSUPP;
    };
    // SAFETY: forwarding unchanged.
    let rc = unsafe { f(srq, wr, bad) };
    count(|| {
        // SAFETY: the list just posted and the caller's out-pointer.
        let n = unsafe { accepted_recv(wr, rc, bad) };
        st.counters.srq_recv_wqes.fetch_add(n, Relaxed);
    });
    rc
}

unsafe extern "C" fn drum_poll_cq(cq: *mut IbvCq, n: c_int, wc: *mut IbvWc) -> c_int {
    // SAFETY: reached through cq->context->ops, so cq is valid.
    let ctx = unsafe { (*cq).context };
    let Some(st) = lookup(ctx) else {
        return -1;
    };
    let Some(f) = st.orig.poll_cq else {
        return -1;
    };
    // A virtual CQ follows what it hands over itself (some of it the engine thread followed
    // when it moved it).
    let (rc, held, followed) = match vcq::find(cq) {
        // SAFETY: the application's array of `n` entries.
        Some(v) => match catch_unwind(AssertUnwindSafe(|| unsafe { v.poll(Some(st), n, wc) })) {
            Ok(p) => (p.rc, p.held, true),
            Err(_) => {
                warn_once(
                    Trouble::Completions,
                    "internal error polling a virtual CQ; its dedicated CQ is polled directly",
                );
                // SAFETY: the dedicated CQ, as the provider made it, and the caller's array.
                (unsafe { f(v.dedicated as *mut IbvCq, n, wc) }, false, false)
            }
        },
        // SAFETY: forwarding unchanged.
        None => (unsafe { f(cq, n, wc) }, false, false),
    };
    if followed {
        count_poll(st);
    } else {
        let done: &[IbvWc] = if rc > 0 && !wc.is_null() {
            // SAFETY: the provider has just written `rc` completions into the caller's array.
            unsafe { std::slice::from_raw_parts(wc, rc as usize) }
        } else {
            &[]
        };
        polled(st, done);
    }
    if rc == 0 {
        govern::on_empty_poll(held);
    }
    rc
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
    if govern::LIMITS.tracking.load(Relaxed)
        && !GOVERNING_STOPPED.load(Relaxed)
        && catch_unwind(AssertUnwindSafe(|| govern::on_completions(st, done))).is_err()
    {
        stop_governing();
    }
}

unsafe extern "C" fn drum_req_notify_cq(cq: *mut IbvCq, solicited_only: c_int) -> c_int {
    // SAFETY: reached through cq->context->ops, so cq is valid.
    let ctx = unsafe { (*cq).context };
    let Some(st) = lookup(ctx) else {
        return libc::EINVAL;
    };
    let Some(f) = st.orig.req_notify_cq else {
        return libc::EOPNOTSUPP;
    };
    let rc = match vcq::find(cq) {
        Some(v) => catch_unwind(AssertUnwindSafe(|| v.arm(solicited_only))).unwrap_or(libc::EIO),
        // SAFETY: forwarding unchanged.
        None => unsafe { f(cq, solicited_only) },
    };
    if rc == 0 {
        count(|| {
            st.counters.notify_arms.fetch_add(1, Relaxed);
        });
    }
    rc
}

// ---------------------------------------------------------------------------------------------
// Totals and the exit summary
// ---------------------------------------------------------------------------------------------

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
pub fn with_qps(qpns: impl Iterator<Item = u32>, mut f: impl FnMut(&counters::QpCounters)) {
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

/// Paces `qp` on the NIC at `kbps` (0: no pacing) with the real `ibv_modify_qp`, RTS to
/// RTS; 0 or the provider's errno.
///
/// # Safety
/// `qp` is a live QP, not destroyed meanwhile (the caller holds its `gov` lock, which
/// `ibv_destroy_qp`'s interposition takes first).
pub(crate) unsafe fn set_rate_limit(qp: *mut IbvQp, kbps: u32) -> c_int {
    let Some(f) = real::MODIFY_QP.get() else {
        return libc::ENOSYS;
    };
    // SAFETY: the attribute is a whole, zeroed `ibv_qp_attr` (layout checked against the
    // headers) of which only the masked fields are read.
    unsafe {
        let mut a: IbvQpAttrFull = std::mem::zeroed();
        a.qp_state = IBV_QPS_RTS;
        a.rate_limit = kbps;
        f(
            qp,
            (&mut a as *mut IbvQpAttrFull).cast(),
            IBV_QP_STATE | IBV_QP_RATE_LIMIT,
        )
    }
}

#[cfg(test)]
mod tests;
