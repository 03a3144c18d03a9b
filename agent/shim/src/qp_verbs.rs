//! The interposed QP verbs (`ibv_create_qp`, `ibv_modify_qp`, `ibv_destroy_qp`,
//! `ibv_query_qp`): the shim binds each QP to its dedicated CQs and learns its peer, MTU,
//! READ service and pacing here. The cold-path helpers the engine uses on QPs (`with_qps`,
//! `set_rate_limit`) and `new_qp` stay in the crate root: the engine and `extended` call
//! them, and this module calls into `govern` and `vcq`, so having them here would pull it
//! into the shim's import cycle (issue 20).

use crate::ffi::*;
use crate::{completions, govern, lookup, new_qp, real, set_errno, vcq};
use crate::{stop_governing, GOVERNING_STOPPED};
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
                    // SAFETY: with this mask bit the caller passed a whole `ibv_qp_attr`.
                    let limit = unsafe { (*attr.cast::<IbvQpAttrFull>()).rate_limit };
                    g.app_paced = limit != 0;
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
                g.peer = Some(a.ah_attr.dgid);
            }
            govern::event(drum_table::message::ShimMsg::QpUp {
                qpn,
                peer: a.ah_attr.dgid,
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
                    govern::forget(st, q, qpn);
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
