//! `ibv_attach_mcast` / `ibv_detach_mcast`: UD QPs join multicast groups, named by their
//! IPv4-mapped GIDs or IB-style MGIDs (see [`device::mcast_group`] and the engine's
//! `multicast.rs`); raw-packet QPs join Ethernet multicast MACs ([`device::mac_group`]).

use libc::c_int;

use super::*;

/// Attach `qp` to, or detach it from, the group `gid` names.
///
/// # Safety
/// `qp` is a live QP made by this provider; `gid` points at a `union ibv_gid` (16 bytes).
unsafe fn membership(qp: *mut IbvQp, gid: *const [u8; 16], attach: bool) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: qp is ours; gid points at a union ibv_gid (16 bytes).
        let (ctx, qpn, qpt, gid) = unsafe { ((*qp).context, (*qp).qp_num, (*qp).qp_type, *gid) };
        let group = if qpt == IBV_QPT_RAW_PACKET {
            device::mac_group(&gid)
        } else {
            device::mcast_group(&gid)
        };
        let Some(group) = group else {
            return libc::EINVAL;
        };
        let req = if attach {
            Req::AttachMcast { qpn, group }
        } else {
            Req::DetachMcast { qpn, group }
        };
        // SAFETY: ctx is a softrnic context (the QP is ours).
        match unsafe { state(ctx) }.call(&req) {
            Ok(_) => 0,
            Err(e) => e,
        }
    })
}

pub(super) unsafe extern "C" fn attach_mcast(
    qp: *mut IbvQp,
    gid: *const [u8; 16],
    _lid: u16,
) -> c_int {
    // SAFETY: forwarded from libibverbs' ibv_attach_mcast.
    unsafe { membership(qp, gid, true) }
}

pub(super) unsafe extern "C" fn detach_mcast(
    qp: *mut IbvQp,
    gid: *const [u8; 16],
    _lid: u16,
) -> c_int {
    // SAFETY: forwarded from libibverbs' ibv_detach_mcast.
    unsafe { membership(qp, gid, false) }
}
