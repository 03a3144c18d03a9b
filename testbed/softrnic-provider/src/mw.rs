//! Memory windows (the engine side is softrnic's `mw`).

use super::*;

pub(super) unsafe extern "C" fn alloc_mw(pd: *mut IbvPd, mw_type: c_int) -> *mut IbvMw {
    guard(null_mut(), || {
        // SAFETY: pd is ours.
        let (ctx, pdh) = unsafe { ((*pd).context, (*pd).handle) };
        // SAFETY: ctx is ours.
        let st = unsafe { state(ctx) };
        match call_for_handle(st, &Req::AllocMw { pd: pdh, mw_type }) {
            Some(rkey) => Box::into_raw(Box::new(IbvMw {
                context: ctx,
                pd,
                rkey,
                handle: rkey >> 8,
                type_: mw_type,
            })),
            None => null_mut(),
        }
    })
}

pub(super) unsafe extern "C" fn dealloc_mw(mw: *mut IbvMw) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: mw was made by alloc_mw.
        let (st, rkey) = unsafe { (state((*mw).context), (*mw).rkey) };
        // SAFETY: allocated by alloc_mw as a boxed IbvMw; no longer used by the caller.
        unsafe { destroy_boxed(st, &Req::DeallocMw { rkey }, mw) }
    })
}

/// `ibv_bind_mw` (type 1): a bind work request on the QP's send queue with the window's next
/// rkey (`ibv_inc_rkey`), which the window carries from now on, as mlx5 does.
pub(super) unsafe extern "C" fn bind_mw(
    qp: *mut IbvQp,
    mw: *mut IbvMw,
    bind: *mut IbvMwBind,
) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: mw is ours and bind is the caller's valid bind description.
        let (old, b) = unsafe { ((*mw).rkey, &*bind) };
        let rkey = (old & !0xff) | (old.wrapping_add(1) & 0xff);
        // SAFETY: ibv_send_wr is plain C data; all-zero is a valid empty WR.
        let mut wr: IbvSendWr = unsafe { std::mem::zeroed() };
        wr.wr_id = b.wr_id;
        wr.opcode = IBV_WR_BIND_MW;
        wr.send_flags = b.send_flags;
        wr.bind_mw = IbvSendWrBindMw {
            mw,
            rkey,
            bind_info: b.bind_info,
        };
        let mut bad = null_mut();
        // SAFETY: qp is ours; wr is a one-element list.
        let r = unsafe { post_send(qp, &mut wr, &mut bad) };
        if r == 0 {
            // SAFETY: mw is ours.
            unsafe { (*mw).rkey = rkey };
        }
        r
    })
}
