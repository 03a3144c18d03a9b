//! The `ibv_wr_*` posting interface: an application that gets a QP's `struct ibv_qp_ex`
//! from `ibv_qp_to_qp_ex` builds work requests with `ibv_wr_start`, one `ibv_wr_<opcode>`
//! and `ibv_wr_set_*` per request, and posts the batch with `ibv_wr_complete` — all inline
//! calls through the QP's own function pointers, around `ctx->ops`. The shim swaps those
//! pointers (the originals are kept in the QP's slot of the context's table). At
//! `ibv_wr_start` it makes the choice `ibv_post_send` makes per call:
//!
//! * nothing in force (and nothing of the QP held back): every call goes to the provider as
//!   it comes, and `ibv_wr_complete` counts the batch's requests and bytes (waiting for the
//!   limiters first, should a grant have arrived while the batch was being built);
//! * a grant in force: the calls are recorded — each request as the `ibv_send_wr` it
//!   amounts to, inline data copied at once (the application may reuse its buffer when the
//!   call returns) — and `ibv_wr_complete` hands the list to the governed `ibv_post_send`:
//!   gated, paced, one doorbell per request while paced, the rest queued behind the QP's
//!   earlier work and drained by the engine. The provider never sees the batch as such.
//!
//! `ibv_wr_atomic_write` and `ibv_wr_send_tso` have no `ibv_send_wr` form: under a grant a
//! batch using them is refused (`EOPNOTSUPP`, said once) rather than posted ungoverned.

use crate::context::lookup;
use crate::ffi::{IbvDataBuf, IbvMwBindInfo, IbvQpEx, IbvSendWr, IbvSge, IBV_SEND_INLINE};
use crate::limits::{admit, now_ps, LIMITS};
use crate::qp::QpRecord;
use crate::trouble::{warn_once, Trouble};
use crate::wr_batch::{Batch, Passed, Recorded, EX_OPS};
use libc::{c_int, c_void};
use std::mem::offset_of;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering::Acquire, Ordering::Relaxed};
use std::time::Duration;

/// QPs whose `ibv_wr_*` the shim wraps.
pub static WRAPPED_QPS: AtomicU64 = AtomicU64::new(0);

/// Wrapped pointers, in the order of `QpRecord::ex`: (offset in `ibv_qp_ex`, wrapper).
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
        (
            offset_of!(IbvQpEx, ex.wr_set_ud_addr),
            set_ud_addr as *const () as usize,
        ),
        (
            offset_of!(IbvQpEx, ex.wr_set_xrc_srqn),
            set_xrc_srqn as *const () as usize,
        ),
    ]
}

/// The index of `ibv_wr_rdma_read` among the request ops (its `request_op!`).
const RDMA_READ_OP: usize = 4;
const SET_INLINE_DATA: usize = 12;
const SET_INLINE_DATA_LIST: usize = 13;
const SET_SGE: usize = 14;
const SET_SGE_LIST: usize = 15;
const START: usize = 16;
const COMPLETE: usize = 17;
const ABORT: usize = 18;
const SET_UD_ADDR: usize = 19;
const SET_XRC_SRQN: usize = 20;

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
unsafe fn original(qpx: *mut IbvQpEx, i: usize) -> Option<(&'static QpRecord, usize)> {
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

fn with_batch(q: &QpRecord, f: impl FnOnce(&mut Batch)) {
    let _ = catch_unwind(AssertUnwindSafe(|| {
        f(&mut q.gov.lock().unwrap_or_else(|e| e.into_inner()).ex_batch)
    }));
}

/// The request being recorded, if the batch is recording one.
fn with_recorded(q: &QpRecord, f: impl FnOnce(&mut Recorded)) -> bool {
    let mut recording = false;
    with_batch(q, |b| {
        if let Batch::Recording(v) = b {
            recording = true;
            if let Some(r) = v.last_mut() {
                f(r);
            }
        }
    });
    recording
}

/// `ibv_send_wr` opcodes (`enum ibv_wr_opcode`).
const WR_RDMA_WRITE: i32 = 0;
const WR_RDMA_WRITE_WITH_IMM: i32 = 1;
const WR_SEND: i32 = 2;
const WR_SEND_WITH_IMM: i32 = 3;
use crate::ffi::IBV_WR_RDMA_READ as WR_RDMA_READ;
const WR_ATOMIC_CMP_AND_SWP: i32 = 5;
const WR_ATOMIC_FETCH_AND_ADD: i32 = 6;
const WR_LOCAL_INV: i32 = 7;
const WR_BIND_MW: i32 = 8;
const WR_SEND_WITH_INV: i32 = 9;

/// A request-building op, which opens a request of `bytes` (its data follows with the
/// `wr_set_*` calls; an atomic's 8 bytes are its SGE's, as `ibv_post_send` counts them). Recording, it fills an `ibv_send_wr` with `$fill` (None: no WR can
/// express it); otherwise it forwards.
macro_rules! request_op {
    ($name:ident, $idx:expr, $bytes:expr, ($($a:ident: $t:ty),*), |$w:ident| $fill:expr) => {
        unsafe extern "C" fn $name(qpx: *mut IbvQpEx $(, $a: $t)*) {
            // SAFETY: reached through the pointer `wrap` installed on this QP.
            let Some((q, f)) = (unsafe { original(qpx, $idx) }) else {
                return lost();
            };
            let mut passing = true;
            with_batch(q, |b| match b {
                Batch::Recording(v) => {
                    passing = false;
                    // SAFETY: all-zero is a valid `ibv_send_wr`.
                    let mut $w: IbvSendWr = unsafe { std::mem::zeroed() };
                    // SAFETY: the application's QP; it set these before this call.
                    unsafe {
                        $w.wr_id = (*qpx).ex.wr_id;
                        $w.send_flags = (*qpx).ex.wr_flags;
                    }
                    let opcode: Option<i32> = $fill;
                    match opcode {
                        Some(op) => {
                            $w.opcode = op;
                            v.push(Recorded { wr: $w, sges: Vec::new(), inline: None });
                        }
                        None => *b = Batch::Refused(stringify!($name)),
                    }
                }
                Batch::Refused(_) => passing = false,
                _ => {}
            });
            if !passing {
                return;
            }
            // SAFETY: the provider's op of this signature, with the caller's arguments.
            unsafe {
                std::mem::transmute::<usize, unsafe extern "C" fn(*mut IbvQpEx $(, $t)*)>(f)(
                    qpx $(, $a)*,
                )
            };
            with_batch(q, |b| {
                if let Batch::Passing(v) = b {
                    v.push(Passed { bytes: $bytes, read: $idx == RDMA_READ_OP })
                }
            });
        }
    };
}

request_op!(cmp_swp, 0, 0, (rkey: u32, addr: u64, compare: u64, swap: u64), |w| {
    w.wr = [addr, compare, swap, u64::from(rkey)];
    Some(WR_ATOMIC_CMP_AND_SWP)
});
request_op!(fetch_add, 1, 0, (rkey: u32, addr: u64, add: u64), |w| {
    w.wr = [addr, add, 0, u64::from(rkey)];
    Some(WR_ATOMIC_FETCH_AND_ADD)
});
request_op!(bind_mw, 2, 0, (mw: *mut c_void, rkey: u32, info: *const c_void), |w| {
    (w.bind_mw.mw, w.bind_mw.rkey) = (mw.cast(), rkey);
    if !info.is_null() {
        // SAFETY: the application's `struct ibv_mw_bind_info`.
        w.bind_mw.bind_info = unsafe { *info.cast::<IbvMwBindInfo>() };
    }
    Some(WR_BIND_MW)
});
request_op!(local_inv, 3, 0, (rkey: u32), |w| {
    w.imm_data = rkey;
    Some(WR_LOCAL_INV)
});
request_op!(rdma_read, RDMA_READ_OP, 0, (rkey: u32, addr: u64), |w| {
    w.wr[..2].copy_from_slice(&[addr, u64::from(rkey)]);
    Some(WR_RDMA_READ)
});
request_op!(rdma_write, 5, 0, (rkey: u32, addr: u64), |w| {
    w.wr[..2].copy_from_slice(&[addr, u64::from(rkey)]);
    Some(WR_RDMA_WRITE)
});
request_op!(rdma_write_imm, 6, 0, (rkey: u32, addr: u64, imm: u32), |w| {
    w.wr[..2].copy_from_slice(&[addr, u64::from(rkey)]);
    w.imm_data = imm;
    Some(WR_RDMA_WRITE_WITH_IMM)
});
request_op!(send, 7, 0, (), |w| Some(WR_SEND));
request_op!(send_imm, 8, 0, (imm: u32), |w| {
    w.imm_data = imm;
    Some(WR_SEND_WITH_IMM)
});
request_op!(send_inv, 9, 0, (rkey: u32), |w| {
    w.imm_data = rkey;
    Some(WR_SEND_WITH_INV)
});
request_op!(send_tso, 10, 0, (hdr: *mut c_void, hdr_sz: u16, mss: u16), |w| None);
request_op!(atomic_write, 11, 8, (rkey: u32, addr: u64, data: *const c_void), |w| None);

/// Adds `bytes` to the request being passed on.
fn add_bytes(q: &QpRecord, bytes: u64) {
    with_batch(q, |b| {
        if let Batch::Passing(v) = b {
            if let Some(last) = v.last_mut() {
                last.bytes += bytes;
            }
        }
    });
}

unsafe extern "C" fn set_inline_data(qpx: *mut IbvQpEx, addr: *mut c_void, length: usize) {
    // SAFETY: as in `request_op`.
    let Some((q, f)) = (unsafe { original(qpx, SET_INLINE_DATA) }) else {
        return lost();
    };
    let data = |addr: *const c_void, length: usize| {
        if addr.is_null() || length == 0 {
            return &[][..];
        }
        // SAFETY: the application's data, which the provider would copy now.
        unsafe { std::slice::from_raw_parts(addr as *const u8, length) }
    };
    if with_recorded(q, |r| r.inline = Some(data(addr, length).to_vec())) {
        return;
    }
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
    let list = || {
        if bufs.is_null() {
            return &[][..];
        }
        // SAFETY: the caller's list of `n` buffers, which the provider reads now.
        unsafe { std::slice::from_raw_parts(bufs, n) }
    };
    let recorded = with_recorded(q, |r| {
        let mut v = Vec::new();
        for b in list() {
            if !b.addr.is_null() && b.length > 0 {
                // SAFETY: as above.
                v.extend_from_slice(unsafe {
                    std::slice::from_raw_parts(b.addr as *const u8, b.length)
                });
            }
        }
        r.inline = Some(v);
    });
    if recorded {
        return;
    }
    type F = unsafe extern "C" fn(*mut IbvQpEx, usize, *const IbvDataBuf);
    // SAFETY: as in `request_op`.
    unsafe { std::mem::transmute::<usize, F>(f)(qpx, n, bufs) };
    add_bytes(q, list().iter().map(|b| b.length as u64).sum());
}

unsafe extern "C" fn set_sge(qpx: *mut IbvQpEx, lkey: u32, addr: u64, length: u32) {
    // SAFETY: as in `request_op`.
    let Some((q, f)) = (unsafe { original(qpx, SET_SGE) }) else {
        return lost();
    };
    if with_recorded(q, |r| r.sges = vec![IbvSge { addr, length, lkey }]) {
        return;
    }
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
    let list = || {
        if sges.is_null() {
            return &[][..];
        }
        // SAFETY: the caller's list of `n` entries, which the provider reads now.
        unsafe { std::slice::from_raw_parts(sges, n) }
    };
    if with_recorded(q, |r| r.sges = list().to_vec()) {
        return;
    }
    type F = unsafe extern "C" fn(*mut IbvQpEx, usize, *const IbvSge);
    // SAFETY: as in `request_op`.
    unsafe { std::mem::transmute::<usize, F>(f)(qpx, n, sges) };
    add_bytes(q, list().iter().map(|s| u64::from(s.length)).sum());
}

unsafe extern "C" fn set_ud_addr(qpx: *mut IbvQpEx, ah: *mut c_void, qpn: u32, qkey: u32) {
    // SAFETY: as in `request_op`.
    let Some((q, f)) = (unsafe { original(qpx, SET_UD_ADDR) }) else {
        return lost();
    };
    if with_recorded(q, |r| {
        r.wr.wr[..2].copy_from_slice(&[ah as u64, u64::from(qpn) | u64::from(qkey) << 32])
    }) {
        return;
    }
    type F = unsafe extern "C" fn(*mut IbvQpEx, *mut c_void, u32, u32);
    // SAFETY: as in `request_op`.
    unsafe { std::mem::transmute::<usize, F>(f)(qpx, ah, qpn, qkey) };
}

unsafe extern "C" fn set_xrc_srqn(qpx: *mut IbvQpEx, srqn: u32) {
    // SAFETY: as in `request_op`.
    let Some((q, f)) = (unsafe { original(qpx, SET_XRC_SRQN) }) else {
        return lost();
    };
    if with_recorded(q, |r| r.wr.qp_type_xrc_remote_srqn = srqn) {
        return;
    }
    type F = unsafe extern "C" fn(*mut IbvQpEx, u32);
    // SAFETY: as in `request_op`.
    unsafe { std::mem::transmute::<usize, F>(f)(qpx, srqn) };
}

unsafe extern "C" fn start(qpx: *mut IbvQpEx) {
    // SAFETY: as in `request_op`.
    let Some((q, f)) = (unsafe { original(qpx, START) }) else {
        return lost();
    };
    // The same choice `ibv_post_send` makes per call: governed while anything is in force
    // (or this QP still has work held back, which the batch must queue behind).
    if crate::govern::governing(q) {
        with_batch(q, |b| *b = Batch::Recording(Vec::new()));
        return;
    }
    with_batch(q, |b| *b = Batch::Passing(Vec::new()));
    // SAFETY: as in `request_op`.
    unsafe { std::mem::transmute::<usize, unsafe extern "C" fn(*mut IbvQpEx)>(f)(qpx) };
}

unsafe extern "C" fn abort(qpx: *mut IbvQpEx) {
    // SAFETY: as in `request_op`.
    let Some((q, f)) = (unsafe { original(qpx, ABORT) }) else {
        return lost();
    };
    let mut passing = false;
    with_batch(q, |b| {
        passing = matches!(b, Batch::Passing(_));
        *b = Batch::Idle;
    });
    if passing {
        // SAFETY: as in `request_op`.
        unsafe { std::mem::transmute::<usize, unsafe extern "C" fn(*mut IbvQpEx)>(f)(qpx) };
    }
}

unsafe extern "C" fn complete(qpx: *mut IbvQpEx) -> c_int {
    // SAFETY: as in `request_op`.
    let Some((q, f)) = (unsafe { original(qpx, COMPLETE) }) else {
        lost();
        return libc::EINVAL;
    };
    let mut batch = Batch::Idle;
    with_batch(q, |b| std::mem::swap(b, &mut batch));
    let bytes = match batch {
        Batch::Passing(v) => v,
        // SAFETY: the application's live QP.
        Batch::Recording(v) => return unsafe { post_recorded(qpx, v) },
        Batch::Refused(op) => {
            warn_once(
                Trouble::WrApi,
                &format!(
                    "ibv_wr_{op} under a DRUM grant: no ibv_send_wr expresses it, so the \
                     shim cannot hold it back; the batch is refused (EOPNOTSUPP)"
                ),
            );
            return libc::EOPNOTSUPP;
        }
        // `wr_complete` without `wr_start`: the provider says what it thinks of that.
        Batch::Idle => Vec::new(),
    };
    let _ = catch_unwind(AssertUnwindSafe(|| pace(q, bytes.iter().map(|p| p.bytes))));
    // SAFETY: as in `request_op`.
    let rc = unsafe {
        std::mem::transmute::<usize, unsafe extern "C" fn(*mut IbvQpEx) -> c_int>(f)(qpx)
    };
    if rc == 0 {
        let total: u64 = bytes.iter().map(|p| p.bytes).sum();
        let read: u64 = bytes.iter().filter(|p| p.read).map(|p| p.bytes).sum();
        let n = bytes.len() as u64;
        q.send_wqes.fetch_add(n, Relaxed);
        q.send_bytes.fetch_add(total, Relaxed);
        q.read_bytes.fetch_add(read, Relaxed);
        // SAFETY: as above.
        let ctx = unsafe { (*qpx).qp_base.context };
        if let Some(st) = lookup(ctx) {
            st.counters.send_wqes.fetch_add(n, Relaxed);
            st.counters.send_bytes.fetch_add(total, Relaxed);
        }
    }
    rc
}

/// Posts a recorded batch as one `ibv_send_wr` list through the governed `ibv_post_send`:
/// what the gate and the limiters admit goes to the provider now, the rest is queued
/// (deep-copied, inline data included) behind the QP's earlier work.
///
/// # Safety
/// `qpx` is the application's live QP.
unsafe fn post_recorded(qpx: *mut IbvQpEx, mut v: Vec<Recorded>) -> c_int {
    if v.is_empty() {
        return 0;
    }
    let n = v.len();
    for i in 0..n {
        let next: *mut IbvSendWr = if i + 1 < n {
            &mut v[i + 1].wr
        } else {
            std::ptr::null_mut()
        };
        let r = &mut v[i];
        if let Some(data) = &r.inline {
            // The provider copies inline data at post time, from where the list points.
            r.sges = vec![IbvSge {
                addr: data.as_ptr() as u64,
                length: data.len() as u32,
                lkey: 0,
            }];
            r.wr.send_flags |= IBV_SEND_INLINE;
        }
        r.wr.num_sge = r.sges.len() as c_int;
        r.wr.sg_list = if r.sges.is_empty() {
            std::ptr::null_mut()
        } else {
            r.sges.as_mut_ptr()
        };
        r.wr.next = next;
    }
    let mut bad = std::ptr::null_mut();
    // SAFETY: the application's QP (`ibv_qp_ex` begins with its `ibv_qp`) and a list of
    // our own WRs, alive for the call; queued ones are copied.
    unsafe { crate::ops::drum_post_send(&mut (*qpx).qp_base, &mut v[0].wr, &mut bad) }
}

/// The longest single sleep while waiting for the limiters: a grant that changes meanwhile
/// (lifted by a lost agent, or raised) is seen this soon.
const MAX_SLEEP: Duration = Duration::from_millis(10);

/// Waits until the limiters admit each request of the batch, charging them as it goes.
fn pace(q: &QpRecord, batch: impl Iterator<Item = u64>) {
    if !LIMITS.active.load(Acquire) {
        return;
    }
    for bytes in batch {
        loop {
            // The QP's lock for each try only: its route to the peer's cap is under it, and
            // the sleep must not hold it.
            let admitted = {
                let mut g = q.gov.lock().unwrap_or_else(|e| e.into_inner());
                admit(now_ps(), bytes, g.dest())
            };
            let Err(wait_ps) = admitted else { break };
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
