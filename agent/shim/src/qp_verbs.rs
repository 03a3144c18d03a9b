//! The interposed QP verbs (`ibv_create_qp`, `ibv_modify_qp`, `ibv_destroy_qp`,
//! `ibv_query_qp`): the shim binds each QP to its dedicated CQs and learns its peer, MTU,
//! READ service and pacing here. Also the QP helpers that `extended` (`new_qp`, for
//! `ibv_create_qp_ex`) and the engine (`set_rate_limit`, NIC pacing) call.

use crate::context::lookup;
use crate::ffi::*;
use crate::govern::{self, stop_governing, GOVERNING_STOPPED};
use crate::qp::QpGov;
use crate::trouble::{completions, set_errno};
use crate::{real, vcq};
use libc::{c_int, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr;
use std::sync::atomic::Ordering::Relaxed;

/// Runs shim bookkeeping for a QP verb; a panic stops governing instead of unwinding.
pub(crate) fn qp_bookkeeping<F: FnOnce()>(f: F) {
    if !GOVERNING_STOPPED.load(Relaxed) && catch_unwind(AssertUnwindSafe(f)).is_err() {
        stop_governing();
    }
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
    qp_bookkeeping(|| {
        // SAFETY: per the contract.
        let (ctx, qpn, sig_all) = unsafe { ((*qp).context, (*qp).qp_num, (*attr).sq_sig_all) };
        if let Some(q) = lookup(ctx).and_then(|st| st.qps.get(qpn)) {
            let mut g = q.gov.lock().unwrap_or_else(|e| e.into_inner());
            *g = QpGov::default();
            g.qp = qp as usize;
            g.sig_all = sig_all != 0;
        }
    });
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
        let mut a: IbvQpAttr = std::mem::zeroed();
        a.qp_state = IBV_QPS_RTS;
        a.rate_limit = kbps;
        f(
            qp,
            (&mut a as *mut IbvQpAttr).cast(),
            IBV_QP_STATE | IBV_QP_RATE_LIMIT,
        )
    }
}

/// Interposes `ibv_create_qp` to learn whether every WR of the QP is signalled
/// (`sq_sig_all`), which the tracking of work in flight needs.
///
/// # Safety
/// Called by C code with the real function's arguments.
#[no_mangle]
pub unsafe extern "C" fn ibv_create_qp(pd: *mut c_void, attr: *mut IbvQpInitAttr) -> *mut IbvQp {
    let Some(f) = real::CREATE_QP.get() else {
        set_errno(libc::ENOSYS);
        return ptr::null_mut();
    };
    // The QP is bound to the dedicated CQs of the application's (virtual) CQs; the
    // application's attributes are given back as they were.
    // SAFETY: the caller's attributes.
    let app_cqs = unsafe { vcq::bind_dedicated(attr) };
    // SAFETY: the caller's arguments, CQs possibly replaced by their dedicated ones.
    let qp = unsafe { f(pd, attr) };
    // SAFETY: as above.
    unsafe { vcq::unbind(attr, app_cqs) };
    // SAFETY: as above.
    unsafe { new_qp(qp, attr) };
    qp
}

/// Interposes `ibv_modify_qp` to learn each connected QP's peer (for the agent and DASR).
///
/// # Safety
/// Called by C code with the real function's arguments.
#[no_mangle]
pub unsafe extern "C" fn ibv_modify_qp(qp: *mut IbvQp, attr: *mut IbvQpAttr, mask: c_int) -> c_int {
    let Some(f) = real::MODIFY_QP.get() else {
        return libc::ENOSYS;
    };
    // SAFETY: forwarding unchanged.
    let rc = unsafe { f(qp, attr, mask) };
    let connects = IBV_QP_STATE | IBV_QP_AV | IBV_QP_DEST_QPN;
    let noted = connects | IBV_QP_PATH_MTU | IBV_QP_RATE_LIMIT | IBV_QP_ACCESS_FLAGS;
    if rc == 0 && !qp.is_null() && !attr.is_null() && mask & noted != 0 {
        qp_bookkeeping(|| {
            // SAFETY: the caller's valid QP and attributes.
            let (a, ctx, qpn) = unsafe { (&*attr, (*qp).context, (*qp).qp_num) };
            let Some(q) = lookup(ctx).and_then(|st| st.qps.get(qpn)) else {
                return;
            };
            {
                let mut g = q.gov.lock().unwrap_or_else(|e| e.into_inner());
                if mask & IBV_QP_PATH_MTU != 0 && (1..=5).contains(&a.path_mtu) {
                    g.path_mtu = 128 << a.path_mtu;
                }
                if mask & IBV_QP_ACCESS_FLAGS != 0 {
                    g.serves_reads = a.qp_access_flags & IBV_ACCESS_REMOTE_READ_ATOMIC != 0;
                }
                if mask & IBV_QP_RATE_LIMIT != 0 {
                    g.app_paced = a.rate_limit != 0;
                }
                if mask & IBV_QP_STATE != 0 && a.qp_state != IBV_QPS_RTS {
                    // A QP leaving RTS loses its pacing; it is set again in RTS.
                    (g.nic_kbps, g.nic_paced) = (None, false);
                }
                if mask & connects != connects
                    || a.qp_state != IBV_QPS_RTR
                    || a.ah_attr.is_global == 0
                {
                    return;
                }
                g.peer = Some(a.ah_attr.grh.dgid);
            }
            govern::event(drum_table::message::ShimMsg::QpUp {
                qpn,
                peer: a.ah_attr.grh.dgid,
                peer_qpn: a.dest_qp_num,
            });
        });
    }
    rc
}

/// Interposes `ibv_destroy_qp`: what the shim still holds back for the QP is dropped (a
/// device flushes it) and the QP leaves the gate before the provider frees it.
///
/// # Safety
/// Called by C code with the real function's arguments.
#[no_mangle]
pub unsafe extern "C" fn ibv_destroy_qp(qp: *mut IbvQp) -> c_int {
    let Some(f) = real::DESTROY_QP.get() else {
        return libc::ENOSYS;
    };
    if !qp.is_null() {
        qp_bookkeeping(|| {
            // SAFETY: the caller's valid QP.
            let (ctx, qpn) = unsafe { ((*qp).context, (*qp).qp_num) };
            if let Some(st) = lookup(ctx) {
                if let Some(q) = st.qps.get(qpn) {
                    govern::forget(st, q, qpn, vcq::held_report);
                    govern::event(drum_table::message::ShimMsg::QpGone { qpn });
                }
            }
        });
    }
    // SAFETY: forwarding unchanged.
    unsafe { f(qp) }
}

/// Interposes `ibv_query_qp`: a QP's CQs are reported as the application created them,
/// not as the dedicated CQs the shim bound it to.
///
/// # Safety
/// Called by C code with the real function's arguments.
#[no_mangle]
pub unsafe extern "C" fn ibv_query_qp(
    qp: *mut IbvQp,
    attr: *mut IbvQpAttr,
    mask: c_int,
    init_attr: *mut IbvQpInitAttr,
) -> c_int {
    let Some(f) = real::QUERY_QP.get() else {
        return libc::ENOSYS;
    };
    // SAFETY: forwarding unchanged.
    let rc = unsafe { f(qp, attr, mask, init_attr) };
    if rc == 0 && !init_attr.is_null() {
        completions(|| {
            // SAFETY: the caller's attributes, just filled in.
            let a = unsafe { &mut *init_attr };
            a.send_cq = vcq::app_cq_of(a.send_cq);
            a.recv_cq = vcq::app_cq_of(a.recv_cq);
            Some(())
        });
    }
    rc
}
