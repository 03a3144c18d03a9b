//! The `ibv_wr_*` posting interface: an application that gets a QP's `struct ibv_qp_ex`
//! from `ibv_qp_to_qp_ex` builds work requests with `ibv_wr_start`, one `ibv_wr_<opcode>`
//! and `ibv_wr_set_*` per request, and posts the batch with `ibv_wr_complete` — all inline
//! calls through the QP's own function pointers, around `ctx->ops`. The shim swaps those
//! pointers (the originals are kept in the QP's slot of the context's table) so that:
//!
//! * every request and its bytes are counted, as `ibv_post_send` counts them;
//! * `ibv_wr_complete` waits until the app's limiters (and a receiver's DASR cap) admit
//!   each request of the batch, then posts it. The batch lives in the provider between
//!   `wr_start` and `wr_complete`, so it cannot be queued and drained later as posted lists
//!   are; the posting thread is held back instead, for exactly the limiters' wait.
//!
//! Not done for these QPs: top-k gating. A `wr_start` held until the QP gets a gate slot
//! could wait forever in a single-threaded application, whose other QPs give their slots up
//! only when it polls their completions.

use crate::counters::QpCounters;
use crate::ffi::{IbvQp, IbvSge};
use crate::govern::{admit, now_ps, LIMITS};
use crate::{lookup, warn_once, Trouble};
use libc::{c_int, c_void};
use std::mem::offset_of;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering::Acquire, Ordering::Relaxed};
use std::time::Duration;

/// `struct ibv_qp_ex` of rdma-core 44 (checked against the headers by `ffi::tests`).
#[repr(C)]
pub struct IbvQpEx {
    pub qp_base: IbvQp,
    /// The rest of `struct ibv_qp`: mutex, cond, events_completed.
    pub qp_rest: [u64; 12],
    pub ex: QpExTail,
}

pub use drum_verbs_abi::{IbvDataBuf, QpExTail};

/// QPs whose `ibv_wr_*` the shim wraps.
pub static WRAPPED_QPS: AtomicU64 = AtomicU64::new(0);

/// Wrapped pointers, in the order of `QpCounters::ex`: (offset in `ibv_qp_ex`, wrapper).
fn wrappers() -> [(usize, usize); EX_OPS] {
    [
        (
            offset_of!(IbvQpEx, ex.wr_atomic_cmp_swp),
            cmp_swp as *const () as usize,
        ),
        (
            offset_of!(IbvQpEx, ex.wr_atomic_fetch_add),
            fetch_add as *const () as usize,
        ),
        (
            offset_of!(IbvQpEx, ex.wr_bind_mw),
            bind_mw as *const () as usize,
        ),
        (
            offset_of!(IbvQpEx, ex.wr_local_inv),
            local_inv as *const () as usize,
        ),
        (
            offset_of!(IbvQpEx, ex.wr_rdma_read),
            rdma_read as *const () as usize,
        ),
        (
            offset_of!(IbvQpEx, ex.wr_rdma_write),
            rdma_write as *const () as usize,
        ),
        (
            offset_of!(IbvQpEx, ex.wr_rdma_write_imm),
            rdma_write_imm as *const () as usize,
        ),
        (offset_of!(IbvQpEx, ex.wr_send), send as *const () as usize),
        (
            offset_of!(IbvQpEx, ex.wr_send_imm),
            send_imm as *const () as usize,
        ),
        (
            offset_of!(IbvQpEx, ex.wr_send_inv),
            send_inv as *const () as usize,
        ),
        (
            offset_of!(IbvQpEx, ex.wr_send_tso),
            send_tso as *const () as usize,
        ),
        (
            offset_of!(IbvQpEx, ex.wr_atomic_write),
            atomic_write as *const () as usize,
        ),
        (
            offset_of!(IbvQpEx, ex.wr_set_inline_data),
            set_inline_data as *const () as usize,
        ),
        (
            offset_of!(IbvQpEx, ex.wr_set_inline_data_list),
            set_inline_data_list as *const () as usize,
        ),
        (
            offset_of!(IbvQpEx, ex.wr_set_sge),
            set_sge as *const () as usize,
        ),
        (
            offset_of!(IbvQpEx, ex.wr_set_sge_list),
            set_sge_list as *const () as usize,
        ),
        (
            offset_of!(IbvQpEx, ex.wr_start),
            start as *const () as usize,
        ),
        (
            offset_of!(IbvQpEx, ex.wr_complete),
            complete as *const () as usize,
        ),
        (
            offset_of!(IbvQpEx, ex.wr_abort),
            abort as *const () as usize,
        ),
    ]
}

pub const EX_OPS: usize = 19;
const SET_INLINE_DATA: usize = 12;
const SET_INLINE_DATA_LIST: usize = 13;
const SET_SGE: usize = 14;
const SET_SGE_LIST: usize = 15;
const START: usize = 16;
const COMPLETE: usize = 17;
const ABORT: usize = 18;

/// Swaps the `ibv_wr_*` pointers of `qpx` (just returned by the real `ibv_qp_to_qp_ex`)
/// for the shim's, keeping the provider's in the QP's slot. Nothing is swapped for a QP of
/// an ungoverned context or without a slot, or when an op the shim must see for correct
/// accounting (`wr_start`, `wr_complete`) is missing; pointers already swapped stay.
/// Returns whether the QP is wrapped.
///
/// # Safety
/// `qpx` is the `ibv_qp_ex` of a live QP.
pub unsafe fn wrap(qpx: *mut IbvQpEx) -> bool {
    // SAFETY: per the contract.
    let (ctx, qpn) = unsafe { ((*qpx).qp_base.context, (*qpx).qp_base.qp_num) };
    let Some(q) = lookup(ctx).and_then(|st| st.qps.get(qpn)) else {
        return false;
    };
    let base = qpx as *mut u8;
    let slot = |off: usize| base.wrapping_add(off) as *mut usize;
    let table = wrappers();
    // SAFETY: offsets within `ibv_qp_ex`.
    let (s, c) = unsafe { (*slot(table[START].0), *slot(table[COMPLETE].0)) };
    if s == 0 || c == 0 {
        return false;
    }
    let mut fresh = false;
    for (i, (off, ours)) in table.iter().enumerate() {
        // SAFETY: as above.
        let cur = unsafe { *slot(*off) };
        if cur == 0 || cur == *ours {
            continue;
        }
        // The original is stored before the QP points at the wrapper that reads it.
        q.ex[i].store(cur, Relaxed);
        std::sync::atomic::fence(std::sync::atomic::Ordering::Release);
        // SAFETY: as above; the application has not started posting on this QP yet, or
        // does so only after this call returns (it needs the pointer we return).
        unsafe { *slot(*off) = *ours };
        fresh = true;
    }
    if fresh {
        WRAPPED_QPS.fetch_add(1, Relaxed);
    }
    true
}

/// The QP's slot and the provider's op `i`.
///
/// # Safety
/// `qpx` is a wrapped, live QP.
unsafe fn original(qpx: *mut IbvQpEx, i: usize) -> Option<(&'static QpCounters, usize)> {
    // SAFETY: per the contract.
    let (ctx, qpn) = unsafe { ((*qpx).qp_base.context, (*qpx).qp_base.qp_num) };
    let q = lookup(ctx)?.qps.get(qpn)?;
    std::sync::atomic::fence(Acquire);
    let f = q.ex[i].load(Relaxed);
    (f != 0).then_some((q, f))
}

/// The provider's op cannot be found (the context's state is gone): nothing can be
/// forwarded. Said once; `wr_complete` then fails, so the application sees an error rather
/// than silently lost work.
fn lost() {
    warn_once(
        Trouble::Extended,
        "an ibv_wr_* call on a QP whose context the shim no longer knows; the batch fails",
    );
}

fn with_batch(q: &QpCounters, f: impl FnOnce(&mut Vec<u64>)) {
    let _ = catch_unwind(AssertUnwindSafe(|| {
        f(&mut q.gov.lock().unwrap_or_else(|e| e.into_inner()).ex_batch)
    }));
}

/// A request-building op: forwards, then opens a request of `bytes` (its data follows
/// with the `wr_set_*` calls).
macro_rules! request_op {
    ($name:ident, $idx:expr, $bytes:expr, ($($a:ident: $t:ty),*)) => {
        unsafe extern "C" fn $name(qpx: *mut IbvQpEx $(, $a: $t)*) {
            // SAFETY: reached through the pointer `wrap` installed on this QP.
            let Some((q, f)) = (unsafe { original(qpx, $idx) }) else {
                return lost();
            };
            // SAFETY: the provider's op of this signature, with the caller's arguments.
            unsafe {
                std::mem::transmute::<usize, unsafe extern "C" fn(*mut IbvQpEx $(, $t)*)>(f)(
                    qpx $(, $a)*,
                )
            };
            with_batch(q, |b| b.push($bytes));
        }
    };
}

request_op!(cmp_swp, 0, 8, (rkey: u32, addr: u64, compare: u64, swap: u64));
request_op!(fetch_add, 1, 8, (rkey: u32, addr: u64, add: u64));
request_op!(bind_mw, 2, 0, (mw: *mut c_void, rkey: u32, info: *const c_void));
request_op!(local_inv, 3, 0, (rkey: u32));
request_op!(rdma_read, 4, 0, (rkey: u32, addr: u64));
request_op!(rdma_write, 5, 0, (rkey: u32, addr: u64));
request_op!(rdma_write_imm, 6, 0, (rkey: u32, addr: u64, imm: u32));
request_op!(send, 7, 0, ());
request_op!(send_imm, 8, 0, (imm: u32));
request_op!(send_inv, 9, 0, (rkey: u32));
request_op!(send_tso, 10, 0, (hdr: *mut c_void, hdr_sz: u16, mss: u16));
request_op!(atomic_write, 11, 8, (rkey: u32, addr: u64, data: *const c_void));

/// Adds `bytes` to the request being built.
fn add_bytes(q: &QpCounters, bytes: u64) {
    with_batch(q, |b| {
        if let Some(last) = b.last_mut() {
            *last += bytes;
        }
    });
}

unsafe extern "C" fn set_inline_data(qpx: *mut IbvQpEx, addr: *mut c_void, length: usize) {
    // SAFETY: as in `request_op`.
    let Some((q, f)) = (unsafe { original(qpx, SET_INLINE_DATA) }) else {
        return lost();
    };
    type F = unsafe extern "C" fn(*mut IbvQpEx, *mut c_void, usize);
    // SAFETY: as in `request_op`.
    unsafe { std::mem::transmute::<usize, F>(f)(qpx, addr, length) };
    add_bytes(q, length as u64);
}

unsafe extern "C" fn set_inline_data_list(qpx: *mut IbvQpEx, n: usize, bufs: *const IbvDataBuf) {
    // SAFETY: as in `request_op`.
    let Some((q, f)) = (unsafe { original(qpx, SET_INLINE_DATA_LIST) }) else {
        return lost();
    };
    type F = unsafe extern "C" fn(*mut IbvQpEx, usize, *const IbvDataBuf);
    // SAFETY: as in `request_op`.
    unsafe { std::mem::transmute::<usize, F>(f)(qpx, n, bufs) };
    if !bufs.is_null() {
        // SAFETY: the caller's list of `n` buffers, which the provider has just read.
        let l = unsafe { std::slice::from_raw_parts(bufs, n) };
        add_bytes(q, l.iter().map(|b| b.length as u64).sum());
    }
}

unsafe extern "C" fn set_sge(qpx: *mut IbvQpEx, lkey: u32, addr: u64, length: u32) {
    // SAFETY: as in `request_op`.
    let Some((q, f)) = (unsafe { original(qpx, SET_SGE) }) else {
        return lost();
    };
    type F = unsafe extern "C" fn(*mut IbvQpEx, u32, u64, u32);
    // SAFETY: as in `request_op`.
    unsafe { std::mem::transmute::<usize, F>(f)(qpx, lkey, addr, length) };
    add_bytes(q, u64::from(length));
}

unsafe extern "C" fn set_sge_list(qpx: *mut IbvQpEx, n: usize, sges: *const IbvSge) {
    // SAFETY: as in `request_op`.
    let Some((q, f)) = (unsafe { original(qpx, SET_SGE_LIST) }) else {
        return lost();
    };
    type F = unsafe extern "C" fn(*mut IbvQpEx, usize, *const IbvSge);
    // SAFETY: as in `request_op`.
    unsafe { std::mem::transmute::<usize, F>(f)(qpx, n, sges) };
    if !sges.is_null() {
        // SAFETY: the caller's list of `n` entries, which the provider has just read.
        let l = unsafe { std::slice::from_raw_parts(sges, n) };
        add_bytes(q, l.iter().map(|s| u64::from(s.length)).sum());
    }
}

unsafe extern "C" fn start(qpx: *mut IbvQpEx) {
    // SAFETY: as in `request_op`.
    let Some((q, f)) = (unsafe { original(qpx, START) }) else {
        return lost();
    };
    with_batch(q, Vec::clear);
    // SAFETY: as in `request_op`.
    unsafe { std::mem::transmute::<usize, unsafe extern "C" fn(*mut IbvQpEx)>(f)(qpx) };
}

unsafe extern "C" fn abort(qpx: *mut IbvQpEx) {
    // SAFETY: as in `request_op`.
    let Some((q, f)) = (unsafe { original(qpx, ABORT) }) else {
        return lost();
    };
    // SAFETY: as in `request_op`.
    unsafe { std::mem::transmute::<usize, unsafe extern "C" fn(*mut IbvQpEx)>(f)(qpx) };
    with_batch(q, Vec::clear);
}

unsafe extern "C" fn complete(qpx: *mut IbvQpEx) -> c_int {
    // SAFETY: as in `request_op`.
    let Some((q, f)) = (unsafe { original(qpx, COMPLETE) }) else {
        lost();
        return libc::EINVAL;
    };
    let mut batch = Vec::new();
    with_batch(q, |b| std::mem::swap(b, &mut batch));
    let _ = catch_unwind(AssertUnwindSafe(|| pace(q, &batch)));
    // SAFETY: as in `request_op`.
    let rc = unsafe {
        std::mem::transmute::<usize, unsafe extern "C" fn(*mut IbvQpEx) -> c_int>(f)(qpx)
    };
    if rc == 0 {
        let bytes: u64 = batch.iter().sum();
        let n = batch.len() as u64;
        q.send_wqes.fetch_add(n, Relaxed);
        q.send_bytes.fetch_add(bytes, Relaxed);
        // SAFETY: as above.
        let ctx = unsafe { (*qpx).qp_base.context };
        if let Some(st) = lookup(ctx) {
            st.counters.send_wqes.fetch_add(n, Relaxed);
            st.counters.send_bytes.fetch_add(bytes, Relaxed);
        }
    }
    rc
}

/// The longest single sleep while waiting for the limiters: a grant that changes meanwhile
/// (lifted by a lost agent, or raised) is seen this soon.
const MAX_SLEEP: Duration = Duration::from_millis(10);

/// Waits until the limiters admit each request of the batch, charging them as it goes.
fn pace(q: &QpCounters, batch: &[u64]) {
    if !LIMITS.active.load(Acquire) {
        return;
    }
    let peer = q.gov.lock().unwrap_or_else(|e| e.into_inner()).peer;
    for &bytes in batch {
        while let Err(wait_ps) = admit(now_ps(), bytes, peer) {
            std::thread::sleep(Duration::from_nanos(wait_ps / 1000).min(MAX_SLEEP));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ffi::{IbvContext, IBV_QPS_RTS};
    use std::cell::RefCell;

    thread_local! {
        static CALLS: RefCell<Vec<String>> = const { RefCell::new(Vec::new()) };
    }

    fn log(s: String) {
        CALLS.with(|c| c.borrow_mut().push(s));
    }

    unsafe extern "C" fn p_start(_: *mut IbvQpEx) {
        log("start".into());
    }
    unsafe extern "C" fn p_send(_: *mut IbvQpEx) {
        log("send".into());
    }
    unsafe extern "C" fn p_write(_: *mut IbvQpEx, rkey: u32, addr: u64) {
        log(format!("write {rkey} {addr}"));
    }
    unsafe extern "C" fn p_sge(_: *mut IbvQpEx, lkey: u32, addr: u64, len: u32) {
        log(format!("sge {lkey} {addr} {len}"));
    }
    unsafe extern "C" fn p_inline(_: *mut IbvQpEx, _: *mut c_void, len: usize) {
        log(format!("inline {len}"));
    }
    /// Fails a batch whose `wr_id` is 99, as a provider fails a full queue.
    unsafe extern "C" fn p_complete(qpx: *mut IbvQpEx) -> c_int {
        log("complete".into());
        // SAFETY: the test's QP.
        if unsafe { (*qpx).ex.wr_id } == 99 {
            libc::ENOMEM
        } else {
            0
        }
    }
    unsafe extern "C" fn p_abort(_: *mut IbvQpEx) {
        log("abort".into());
    }

    fn call<F: Copy>(addr: usize) -> F {
        assert_eq!(std::mem::size_of::<F>(), std::mem::size_of::<usize>());
        // SAFETY: the caller names the signature the pointer was installed with.
        unsafe { std::mem::transmute_copy(&addr) }
    }

    /// The `ibv_wr_*` pointers of a governed context's QP are wrapped once: every call
    /// reaches the provider's op with its arguments, in order; a completed batch counts its
    /// requests and bytes (SGEs and inline data), an aborted or failed one counts nothing;
    /// an op the provider lacks stays absent.
    #[test]
    fn wr_calls_are_forwarded_in_order_and_completed_batches_counted() {
        // SAFETY: an all-zero ibv_context is a valid value for these plain C fields.
        let mut ctx: Box<IbvContext> = Box::new(unsafe { std::mem::zeroed() });
        let cp: *mut IbvContext = &mut *ctx;
        // SAFETY: cp is valid and used by this thread only.
        unsafe { crate::install(cp) }.unwrap();
        // SAFETY: all-zero is valid for this plain C struct.
        let mut q: Box<IbvQpEx> = Box::new(unsafe { std::mem::zeroed() });
        q.qp_base.context = cp;
        q.qp_base.qp_num = 0x77;
        q.qp_base.state = IBV_QPS_RTS;
        q.ex.wr_start = p_start as *const () as usize;
        q.ex.wr_send = p_send as *const () as usize;
        q.ex.wr_rdma_write = p_write as *const () as usize;
        q.ex.wr_set_sge = p_sge as *const () as usize;
        q.ex.wr_set_inline_data = p_inline as *const () as usize;
        q.ex.wr_complete = p_complete as *const () as usize;
        q.ex.wr_abort = p_abort as *const () as usize;
        let qx: *mut IbvQpEx = &mut *q;
        // SAFETY: the test's live QP.
        assert!(unsafe { wrap(qx) });
        assert_ne!(q.ex.wr_send, p_send as *const () as usize, "wrapped");
        assert_eq!(q.ex.wr_rdma_read, 0, "an absent op stays absent");
        let (send_ptr, before) = (q.ex.wr_send, WRAPPED_QPS.load(Relaxed));
        // SAFETY: as above.
        assert!(unsafe { wrap(qx) }, "asked again");
        assert_eq!(q.ex.wr_send, send_ptr, "not wrapped twice");
        assert_eq!(WRAPPED_QPS.load(Relaxed), before);

        type Op = unsafe extern "C" fn(*mut IbvQpEx);
        type Write = unsafe extern "C" fn(*mut IbvQpEx, u32, u64);
        type Sge = unsafe extern "C" fn(*mut IbvQpEx, u32, u64, u32);
        type Inline = unsafe extern "C" fn(*mut IbvQpEx, *mut c_void, usize);
        type Complete = unsafe extern "C" fn(*mut IbvQpEx) -> c_int;
        let batch = |fail: bool| {
            q_wr_id(qx, if fail { 99 } else { 1 });
            // SAFETY: the wrapped ops with their signatures, on the test's QP.
            unsafe {
                call::<Op>((*qx).ex.wr_start)(qx);
                call::<Write>((*qx).ex.wr_rdma_write)(qx, 5, 4096);
                call::<Sge>((*qx).ex.wr_set_sge)(qx, 7, 8192, 1000);
                call::<Op>((*qx).ex.wr_send)(qx);
                call::<Inline>((*qx).ex.wr_set_inline_data)(qx, std::ptr::null_mut(), 24);
                call::<Complete>((*qx).ex.wr_complete)(qx)
            }
        };
        let st = lookup(cp).unwrap();
        assert_eq!(batch(false), 0);
        let counted = |st: &crate::ContextState| {
            let s = st.counters.snapshot();
            (s.send_wqes, s.send_bytes)
        };
        assert_eq!(counted(st), (2, 1024));
        assert_eq!(
            batch(true),
            libc::ENOMEM,
            "the provider's failure is returned"
        );
        assert_eq!(counted(st), (2, 1024), "a failed batch counts nothing");
        // SAFETY: as above.
        unsafe {
            call::<Op>((*qx).ex.wr_start)(qx);
            call::<Op>((*qx).ex.wr_send)(qx);
            call::<Op>((*qx).ex.wr_abort)(qx);
        }
        q_wr_id(qx, 1);
        // SAFETY: as above: an empty batch.
        unsafe {
            call::<Op>((*qx).ex.wr_start)(qx);
            assert_eq!(call::<Complete>((*qx).ex.wr_complete)(qx), 0);
        }
        assert_eq!(
            counted(st),
            (2, 1024),
            "aborted and empty batches count nothing"
        );
        let calls = CALLS.with(|c| c.borrow().clone());
        let one = [
            "start",
            "write 5 4096",
            "sge 7 8192 1000",
            "send",
            "inline 24",
            "complete",
        ];
        let mut want: Vec<&str> = one.iter().chain(one.iter()).copied().collect();
        want.extend(["start", "send", "abort", "start", "complete"]);
        assert_eq!(calls, want);
        // SAFETY: as above.
        unsafe { crate::uninstall(cp) };
    }

    fn q_wr_id(qx: *mut IbvQpEx, id: u64) {
        // SAFETY: the test's QP.
        unsafe { (*qx).ex.wr_id = id };
    }
}
