//! The governed ops the shim writes into each context's `ctx->ops`, reached from the inline
//! `ibv_post_send`, `ibv_post_recv`, `ibv_post_srq_recv`, `ibv_poll_cq` and
//! `ibv_req_notify_cq`: a post goes to `govern` when a grant is in force and straight to the
//! provider otherwise; a poll of a virtual CQ goes to `vcq`. Each counts what it did.

use crate::context::{count, lookup};
use crate::ffi::*;
use crate::trouble::{warn_once, Trouble};
use crate::{drain, govern, vcq};
use libc::c_int;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr;
use std::sync::atomic::Ordering::Relaxed;

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
    if let Some(q) = q.filter(|q| govern::governing(q)) {
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
                govern::stop_governing();
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
            if r.opcode == IBV_WR_RDMA_READ {
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

pub(crate) unsafe extern "C" fn drum_post_recv(
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

pub(crate) unsafe extern "C" fn drum_post_srq_recv(
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

pub(crate) unsafe extern "C" fn drum_poll_cq(cq: *mut IbvCq, n: c_int, wc: *mut IbvWc) -> c_int {
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
        govern::count_poll(st);
    } else {
        let done: &[IbvWc] = if rc > 0 && !wc.is_null() {
            // SAFETY: the provider has just written `rc` completions into the caller's array.
            unsafe { std::slice::from_raw_parts(wc, rc as usize) }
        } else {
            &[]
        };
        govern::polled(st, done);
    }
    if rc == 0 {
        drain::on_empty_poll(held);
    }
    rc
}

pub(crate) unsafe extern "C" fn drum_req_notify_cq(cq: *mut IbvCq, solicited_only: c_int) -> c_int {
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
