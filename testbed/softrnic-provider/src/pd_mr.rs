//! Protection domains and memory regions: what the engine registers, and the `ibv_mr` the
//! program gets back.

use super::*;

pub(super) unsafe extern "C" fn alloc_pd(ctx: *mut IbvContext) -> *mut IbvPd {
    guard(null_mut(), || {
        // SAFETY: ctx is ours.
        let st = unsafe { state(ctx) };
        match call_for_handle(st, &Req::AllocPd) {
            Some(h) => Box::into_raw(Box::new(IbvPd {
                context: ctx,
                handle: h,
            })),
            None => null_mut(),
        }
    })
}

pub(super) unsafe extern "C" fn dealloc_pd(pd: *mut IbvPd) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: pd was made by alloc_pd.
        let (st, h) = unsafe { (state((*pd).context), (*pd).handle) };
        // SAFETY: allocated by alloc_pd with Box; no longer used by the caller.
        unsafe { destroy_boxed(st, &Req::DeallocPd { pd: h }, pd) }
    })
}

/// `ibv_advise_mr`: prefetching an on-demand MR's pages. softrnic's engine reads and writes
/// the process's memory directly as it moves data, faulting pages in as the process itself
/// would, so there is nothing to prefetch: the advice and flags are checked, nothing else.
pub(super) unsafe extern "C" fn advise_mr(
    _pd: *mut IbvPd,
    advice: c_int,
    flags: u32,
    sg_list: *const IbvSge,
    num_sge: u32,
) -> c_int {
    // IBV_ADVISE_MR_ADVICE_PREFETCH, _PREFETCH_WRITE, _PREFETCH_NO_FAULT; IBV_ADVISE_MR_FLAG_FLUSH.
    if !(0..=2).contains(&advice) || flags & !1 != 0 || sg_list.is_null() || num_sge == 0 {
        return libc::EINVAL;
    }
    0
}

pub(super) unsafe extern "C" fn reg_mr(
    pd: *mut IbvPd,
    addr: *mut c_void,
    length: usize,
    hca_va: u64,
    access: c_int,
) -> *mut IbvMr {
    guard(null_mut(), || {
        // The kernel cannot pin zero bytes; only device memory MRs may be empty.
        if length == 0 {
            set_errno(libc::EINVAL);
            return null_mut();
        }
        // SAFETY: pd was made by alloc_pd.
        let h = unsafe { (*pd).handle };
        // An MR whose IO virtual address differs from its address (`ibv_reg_mr_iova`):
        // work requests and peers name it by `hca_va`.
        let req = if hca_va == addr as u64 {
            Req::RegMr {
                pd: h,
                addr: addr as u64,
                len: length as u64,
                access: access as u32,
            }
        } else {
            Req::RegMrIova {
                pd: h,
                addr: addr as u64,
                len: length as u64,
                iova: hca_va,
                access: access as u32,
            }
        };
        new_mr(pd, req, addr, length, access, null_mut())
    })
}

/// An MR: libibverbs' `verbs_mr`, then the device memory it lies in (null if none).
#[repr(C)]
pub(super) struct SrMr {
    vmr: VerbsMr,
    dm: *mut dm::SrDm,
}

/// Registers an MR with the engine (`req`) and makes its `ibv_mr`, which shows `addr` and
/// `length`; null with errno set on failure.
pub(super) fn new_mr(
    pd: *mut IbvPd,
    req: Req,
    addr: *mut c_void,
    length: usize,
    access: c_int,
    dm: *mut dm::SrDm,
) -> *mut IbvMr {
    // SAFETY: pd was made by alloc_pd.
    let ctx = unsafe { (*pd).context };
    // SAFETY: ctx is ours.
    let st = unsafe { state(ctx) };
    let Some((lkey, rkey)) = call_expect(st, &req, |r| match r {
        Resp::Mr { lkey, rkey } => Some((lkey, rkey)),
        _ => None,
    }) else {
        return null_mut();
    };
    let mr = Box::new(SrMr {
        vmr: VerbsMr {
            ibv_mr: IbvMr {
                context: ctx,
                pd,
                addr,
                length,
                handle: lkey,
                lkey,
                rkey,
            },
            mr_type: 0, // IBV_MR_TYPE_MR
            access,
        },
        dm,
    });
    Box::into_raw(mr) as *mut IbvMr
}

pub(super) unsafe extern "C" fn dereg_mr(mr: *mut SrMr) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: mr was made by new_mr.
        let (st, lkey, dm) = unsafe {
            (
                state((*mr).vmr.ibv_mr.context),
                (*mr).vmr.ibv_mr.lkey,
                (*mr).dm,
            )
        };
        // SAFETY: allocated by new_mr with Box; no longer used by the caller.
        let r = unsafe { destroy_boxed(st, &Req::DeregMr { lkey }, mr) };
        if r == 0 {
            // SAFETY: the MR held the DM.
            unsafe { dm::mr_gone(dm) };
        }
        r
    })
}
