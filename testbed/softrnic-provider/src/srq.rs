//! SRQs (control and posting go through the engine's socket: no shared ring for SRQs).

use super::*;

pub(super) unsafe extern "C" fn create_srq(
    pd: *mut IbvPd,
    attr: *mut IbvSrqInitAttr,
) -> *mut IbvSrq {
    guard(null_mut(), || {
        // SAFETY: pd is ours; attr is a valid init attr from the caller.
        unsafe {
            let a = &mut *attr;
            new_srq(pd, a.srq_context, &mut a.attr, null_mut(), null_mut())
        }
    })
}

/// Create an SRQ in PD `pd`: a basic one, or with `xrcd` and `cq` an XRC SRQ of that domain
/// whose receives complete on `cq`. `attr` gets the granted sizes.
///
/// # Safety
/// `pd` is a live PD made by alloc_pd; `xrcd` is null or an open XRC domain of the PD's
/// context, and then `cq` is a live CQ of that context.
pub(super) unsafe fn new_srq(
    pd: *mut IbvPd,
    srq_context: *mut c_void,
    attr: &mut IbvSrqAttr,
    xrcd: *mut VerbsXrcd,
    cq: *mut IbvCq,
) -> *mut IbvSrq {
    // SAFETY: per the contract, pd is a live PD of this provider.
    let (ctx, pdh) = unsafe { ((*pd).context, (*pd).handle) };
    // SAFETY: a PD's context was made by alloc_context and outlives the PD.
    let st = unsafe { state(ctx) };
    let xrc = !xrcd.is_null();
    let req = Req::CreateSrq {
        pd: pdh,
        max_wr: attr.max_wr,
        max_sge: attr.max_sge,
        // SAFETY: per the contract, a non-null xrcd is an open XRC domain.
        xrcd: if xrc { unsafe { (*xrcd).handle } } else { 0 },
        // SAFETY: per the contract, with a domain cq is a live CQ.
        cq: if xrc { unsafe { (*cq).handle } } else { 0 },
    };
    let Some((handle, max_wr, max_sge)) = call_expect(st, &req, |r| match r {
        Resp::Srq {
            handle,
            max_wr,
            max_sge,
            ..
        } => Some((handle, max_wr, max_sge)),
        _ => None,
    }) else {
        return null_mut();
    };
    attr.max_wr = max_wr;
    attr.max_sge = max_sge;
    // SAFETY: verbs_srq is plain C data; all-zero is valid (an initialised pthread
    // mutex and condition variable in glibc).
    let mut b: Box<VerbsSrq> = Box::new(unsafe { std::mem::zeroed() });
    b.srq.context = ctx;
    b.srq.srq_context = srq_context;
    b.srq.pd = pd;
    b.srq.handle = handle;
    b.srq_num = handle;
    if xrc {
        (b.srq_type, b.xrcd, b.cq) = (IBV_SRQT_XRC, xrcd, cq);
    }
    let undo = Req::DestroySrq { srq: handle };
    // SAFETY: allocated just above and not handed out.
    unsafe { hand_out(st, 2, handle, Box::into_raw(b), &undo) }.cast()
}

pub(super) unsafe extern "C" fn modify_srq(
    srq: *mut IbvSrq,
    attr: *mut IbvSrqAttr,
    mask: c_int,
) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: srq is ours; attr is valid.
        let (st, handle, a) = unsafe { (state((*srq).context), (*srq).handle, *attr) };
        let req = Req::ModifySrq {
            srq: handle,
            mask,
            max_wr: a.max_wr,
            srq_limit: a.srq_limit,
        };
        match st.call(&req) {
            Ok(_) => 0,
            Err(e) => e,
        }
    })
}

pub(super) unsafe extern "C" fn query_srq(srq: *mut IbvSrq, attr: *mut IbvSrqAttr) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: srq is ours.
        let (st, handle) = unsafe { (state((*srq).context), (*srq).handle) };
        match st.call(&Req::QuerySrq { srq: handle }) {
            Ok(Resp::Srq {
                max_wr,
                max_sge,
                srq_limit,
                ..
            }) => {
                // SAFETY: attr is a valid out-parameter.
                unsafe {
                    *attr = IbvSrqAttr {
                        max_wr,
                        max_sge,
                        srq_limit,
                    }
                };
                0
            }
            Ok(_) => libc::EIO,
            Err(e) => e,
        }
    })
}

pub(super) unsafe extern "C" fn destroy_srq(srq: *mut IbvSrq) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: srq is ours.
        let (st, handle) = unsafe { (state((*srq).context), (*srq).handle) };
        match st.call(&Req::DestroySrq { srq: handle }) {
            Ok(r) => {
                // SAFETY: srq is live until freed below; its fields are libibverbs'.
                unsafe {
                    let s = &mut *srq;
                    settle_events(s.context, r, &mut s.mutex, &mut s.cond, &s.events_completed);
                }
                // SAFETY: allocated by new_srq as a boxed VerbsSrq (which begins with it).
                drop(unsafe { Box::from_raw(srq.cast::<VerbsSrq>()) });
                0
            }
            Err(e) => e,
        }
    })
}

pub(super) unsafe extern "C" fn post_srq_recv(
    srq: *mut IbvSrq,
    wr: *mut IbvRecvWr,
    bad: *mut *mut IbvRecvWr,
) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: srq is ours; wr is the caller's NULL-terminated list of valid WRs.
        unsafe {
            let st = state((*srq).context);
            let (list, ptrs) = recv_list(wr);
            match st.call_post(&Req::PostSrqRecv {
                srq: (*srq).handle,
                wrs: list,
            }) {
                Ok(()) => 0,
                Err((e, i)) => {
                    *bad = ptrs.get(i).copied().unwrap_or(wr);
                    e
                }
            }
        }
    })
}
