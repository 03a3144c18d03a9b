//! The parts of `<infiniband/verbs.h>` (rdma-core 44) the shim reads or writes, declared by
//! hand so the shim does not link libibverbs (it finds it at run time, see `lib.rs`).
//!
//! Only the fields the shim touches are named; the rest are opaque padding of the exact size.
//! `layout_matches_public_headers` compiles a C probe against the installed headers and
//! compares every size and offset used here.

use libc::{c_int, c_void, pthread_mutex_t};

pub type PostSendFn =
    unsafe extern "C" fn(qp: *mut IbvQp, wr: *mut IbvSendWr, bad: *mut *mut IbvSendWr) -> c_int;
pub type PostRecvFn =
    unsafe extern "C" fn(qp: *mut IbvQp, wr: *mut IbvRecvWr, bad: *mut *mut IbvRecvWr) -> c_int;
pub type PostSrqRecvFn =
    unsafe extern "C" fn(srq: *mut IbvSrq, wr: *mut IbvRecvWr, bad: *mut *mut IbvRecvWr) -> c_int;
pub type PollCqFn = unsafe extern "C" fn(cq: *mut IbvCq, n: c_int, wc: *mut IbvWc) -> c_int;
pub type ReqNotifyCqFn = unsafe extern "C" fn(cq: *mut IbvCq, solicited_only: c_int) -> c_int;

/// `struct ibv_context_ops`: 32 pointers; the inline data-path verbs (`ibv_post_send`,
/// `ibv_post_recv`, `ibv_post_srq_recv`, `ibv_poll_cq`, `ibv_req_notify_cq`) call through
/// the five named ones.
#[repr(C)]
pub struct IbvContextOps {
    pub _head: [*mut c_void; 11],
    pub poll_cq: Option<PollCqFn>,
    pub req_notify_cq: Option<ReqNotifyCqFn>,
    pub _mid1: [*mut c_void; 7],
    pub post_srq_recv: Option<PostSrqRecvFn>,
    pub _mid2: [*mut c_void; 4],
    pub post_send: Option<PostSendFn>,
    pub post_recv: Option<PostRecvFn>,
    pub _tail: [*mut c_void; 5],
}

/// `struct ibv_device` (libibverbs' public ABI): the shim reads its sysfs directory.
#[repr(C)]
pub struct IbvDevice {
    pub _ops: [*mut c_void; 2],
    pub node_type: c_int,
    pub transport_type: c_int,
    pub name: [std::ffi::c_char; 64],
    pub dev_name: [std::ffi::c_char; 64],
    pub dev_path: [std::ffi::c_char; 256],
    pub ibdev_path: [std::ffi::c_char; 256],
}

#[repr(C)]
pub struct IbvContext {
    pub device: *mut c_void,
    pub ops: IbvContextOps,
    pub cmd_fd: c_int,
    pub async_fd: c_int,
    pub num_comp_vectors: c_int,
    pub mutex: pthread_mutex_t,
    pub abi_compat: *mut c_void,
}

/// Prefix of `struct ibv_qp` (the shim never allocates one).
#[repr(C)]
pub struct IbvQp {
    pub context: *mut IbvContext,
    pub qp_context: *mut c_void,
    pub pd: *mut c_void,
    pub send_cq: *mut IbvCq,
    pub recv_cq: *mut IbvCq,
    pub srq: *mut IbvSrq,
    pub handle: u32,
    pub qp_num: u32,
    /// Kept current by libibverbs' `ibv_modify_qp`.
    pub state: u32,
    pub qp_type: u32,
}

pub const IBV_QPS_RTR: u32 = 2;
pub const IBV_QPS_RTS: u32 = 3;
pub const IBV_QP_STATE: c_int = 1;
pub const IBV_QP_AV: c_int = 1 << 7;
pub const IBV_QP_ACCESS_FLAGS: c_int = 1 << 3;
pub const IBV_QP_PATH_MTU: c_int = 1 << 8;
/// `IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC`: the peer may read through the QP.
pub const IBV_ACCESS_REMOTE_READ_ATOMIC: u32 = (1 << 2) | (1 << 3);
pub const IBV_QP_DEST_QPN: c_int = 1 << 20;
pub const IBV_QP_RATE_LIMIT: c_int = 1 << 25;
pub const IBV_SEND_SIGNALED: u32 = 2;
pub const IBV_SEND_INLINE: u32 = 8;
/// `IBV_WC_LOC_QP_OP_ERR`: what the shim reports for a held-back WR the provider refused.
pub const IBV_WC_LOC_QP_OP_ERR: c_int = 2;
/// `IBV_WR_RDMA_READ` (`enum ibv_wr_opcode`): its data flows from the peer back to us.
pub const IBV_WR_RDMA_READ: c_int = 4;
/// Work-completion opcodes from this value on are receive-side.
pub const IBV_WC_RECV: c_int = 128;

/// Prefix of `struct ibv_qp_init_attr` up to `sq_sig_all`.
#[repr(C)]
pub struct IbvQpInitAttr {
    pub qp_context: *mut c_void,
    pub send_cq: *mut IbvCq,
    pub recv_cq: *mut IbvCq,
    /// `srq` and `cap`.
    pub _mid: [u8; 28],
    pub qp_type: u32,
    pub sq_sig_all: c_int,
}

/// `struct ibv_ah_attr` (its `grh` first, `dgid` first in the `grh`).
#[repr(C)]
pub struct IbvAhAttr {
    pub dgid: [u8; 16],
    pub _grh_rest: [u8; 8],
    pub dlid: u16,
    pub _sl_bits: [u8; 3],
    pub is_global: u8,
    pub _tail: [u8; 2],
}

/// Prefix of `struct ibv_qp_attr` up to `ah_attr`.
#[repr(C)]
pub struct IbvQpAttr {
    pub qp_state: u32,
    pub _a: [u8; 4],
    /// `enum ibv_mtu`: 1 (256 bytes) to 5 (4096).
    pub path_mtu: u32,
    pub _b0: [u8; 16],
    pub dest_qp_num: u32,
    pub qp_access_flags: u32,
    pub _b: [u8; 20],
    pub ah_attr: IbvAhAttr,
}

/// The whole `struct ibv_qp_attr`, for the shim's own RTS-to-RTS `ibv_modify_qp` that
/// sets a QP's packet pacing (`nic_pace`).
#[repr(C, align(8))]
pub struct IbvQpAttrFull {
    pub qp_state: u32,
    pub _a: [u8; 132],
    /// kb/s; 0: none.
    pub rate_limit: u32,
    pub _tail: [u8; 4],
}

pub type CreateQpFn = unsafe extern "C" fn(*mut c_void, *mut IbvQpInitAttr) -> *mut IbvQp;
pub type ModifyQpFn = unsafe extern "C" fn(*mut IbvQp, *mut IbvQpAttr, c_int) -> c_int;
pub type DestroyQpFn = unsafe extern "C" fn(*mut IbvQp) -> c_int;
pub type QueryQpFn =
    unsafe extern "C" fn(*mut IbvQp, *mut IbvQpAttr, c_int, *mut IbvQpInitAttr) -> c_int;
pub type CreateCqFn = unsafe extern "C" fn(
    *mut IbvContext,
    c_int,
    *mut c_void,
    *mut IbvCompChannel,
    c_int,
) -> *mut IbvCq;
pub type DestroyCqFn = unsafe extern "C" fn(*mut IbvCq) -> c_int;
pub type ResizeCqFn = unsafe extern "C" fn(*mut IbvCq, c_int) -> c_int;
pub type CreateChannelFn = unsafe extern "C" fn(*mut IbvContext) -> *mut IbvCompChannel;
pub type DestroyChannelFn = unsafe extern "C" fn(*mut IbvCompChannel) -> c_int;
pub type GetCqEventFn =
    unsafe extern "C" fn(*mut IbvCompChannel, *mut *mut IbvCq, *mut *mut c_void) -> c_int;
pub type AckCqEventsFn = unsafe extern "C" fn(*mut IbvCq, libc::c_uint);

/// Prefix of `struct ibv_cq`.
#[repr(C)]
pub struct IbvCq {
    pub context: *mut IbvContext,
    pub channel: *mut IbvCompChannel,
    pub cq_context: *mut c_void,
    pub handle: u32,
    pub cqe: c_int,
}

/// `struct ibv_async_event`: `element` is the union of the object pointers (and the port).
#[repr(C)]
pub struct IbvAsyncEvent {
    pub element: *mut c_void,
    pub event_type: c_int,
}

/// `IBV_EVENT_CQ_ERR`, the one asynchronous event about a CQ.
pub const IBV_EVENT_CQ_ERR: c_int = 0;

pub type GetAsyncEventFn = unsafe extern "C" fn(*mut IbvContext, *mut IbvAsyncEvent) -> c_int;
pub type AckAsyncEventFn = unsafe extern "C" fn(*mut IbvAsyncEvent);
pub type OpenFn = unsafe extern "C" fn(*mut c_void) -> *mut IbvContext;
pub type CloseFn = unsafe extern "C" fn(*mut IbvContext) -> c_int;
pub type QpToQpExFn = unsafe extern "C" fn(*mut IbvQp) -> *mut c_void;
/// libmlx5's `mlx5dv_init_obj`.
pub type InitObjFn = unsafe extern "C" fn(*mut c_void, u64) -> c_int;

/// `struct ibv_comp_channel`.
#[repr(C)]
pub struct IbvCompChannel {
    pub context: *mut IbvContext,
    pub fd: c_int,
    pub refcnt: c_int,
}

/// Prefix of `struct ibv_srq`.
#[repr(C)]
pub struct IbvSrq {
    pub context: *mut IbvContext,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct IbvSge {
    pub addr: u64,
    pub length: u32,
    pub lkey: u32,
}

#[repr(C)]
pub struct IbvSendWr {
    pub wr_id: u64,
    pub next: *mut IbvSendWr,
    pub sg_list: *mut IbvSge,
    pub num_sge: c_int,
    pub opcode: c_int,
    pub send_flags: u32,
    pub imm_data: u32,
    /// union `wr` (rdma / atomic / ud)
    pub wr: [u64; 4],
    pub qp_type_xrc_remote_srqn: u32,
    pub _pad: u32,
    /// union {bind_mw, tso}
    pub _bind_mw_tso: [u64; 6],
}

#[repr(C)]
pub struct IbvRecvWr {
    pub wr_id: u64,
    pub next: *mut IbvRecvWr,
    pub sg_list: *mut IbvSge,
    pub num_sge: c_int,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct IbvWc {
    pub wr_id: u64,
    pub status: c_int,
    pub opcode: c_int,
    pub vendor_err: u32,
    pub byte_len: u32,
    pub imm_data: u32,
    pub qp_num: u32,
    pub src_qp: u32,
    pub wc_flags: u32,
    pub pkey_index: u16,
    pub slid: u16,
    pub sl: u8,
    pub dlid_path_bits: u8,
}

pub use drum_verbs_abi::IbvCqInitAttrEx;

/// `verbs_context.create_cq_ex` and `create_qp_ex` (the extended creation ops, `extended`).
pub type CreateCqExFn = unsafe extern "C" fn(*mut IbvContext, *mut c_void) -> *mut c_void;
pub type CreateQpExFn = unsafe extern "C" fn(*mut IbvContext, *mut c_void) -> *mut IbvQp;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wr_api::IbvQpEx;
    use std::mem::{offset_of, size_of};

    #[test]
    fn layout_matches_public_headers() {
        let checks: Vec<(&str, usize)> = vec![
            ("sizeof ibv_context_ops", size_of::<IbvContextOps>()),
            (
                "ibv_context_ops.poll_cq",
                offset_of!(IbvContextOps, poll_cq),
            ),
            (
                "ibv_context_ops.req_notify_cq",
                offset_of!(IbvContextOps, req_notify_cq),
            ),
            (
                "ibv_context_ops.post_srq_recv",
                offset_of!(IbvContextOps, post_srq_recv),
            ),
            (
                "ibv_context_ops.post_send",
                offset_of!(IbvContextOps, post_send),
            ),
            (
                "ibv_context_ops.post_recv",
                offset_of!(IbvContextOps, post_recv),
            ),
            ("sizeof ibv_context", size_of::<IbvContext>()),
            ("ibv_context.ops", offset_of!(IbvContext, ops)),
            ("ibv_context.cmd_fd", offset_of!(IbvContext, cmd_fd)),
            ("ibv_context.mutex", offset_of!(IbvContext, mutex)),
            ("ibv_context.abi_compat", offset_of!(IbvContext, abi_compat)),
            ("ibv_qp.context", offset_of!(IbvQp, context)),
            ("ibv_qp.srq", offset_of!(IbvQp, srq)),
            ("ibv_qp.qp_num", offset_of!(IbvQp, qp_num)),
            ("ibv_qp.state", offset_of!(IbvQp, state)),
            ("ibv_qp.qp_type", offset_of!(IbvQp, qp_type)),
            (
                "ibv_qp_init_attr.qp_type",
                offset_of!(IbvQpInitAttr, qp_type),
            ),
            (
                "ibv_qp_init_attr.sq_sig_all",
                offset_of!(IbvQpInitAttr, sq_sig_all),
            ),
            ("ibv_qp_attr.path_mtu", offset_of!(IbvQpAttr, path_mtu)),
            (
                "ibv_qp_attr.qp_access_flags",
                offset_of!(IbvQpAttr, qp_access_flags),
            ),
            ("sizeof ibv_qp_attr", size_of::<IbvQpAttrFull>()),
            (
                "ibv_qp_attr.rate_limit",
                offset_of!(IbvQpAttrFull, rate_limit),
            ),
            (
                "ibv_qp_attr.dest_qp_num",
                offset_of!(IbvQpAttr, dest_qp_num),
            ),
            ("ibv_qp_attr.ah_attr", offset_of!(IbvQpAttr, ah_attr)),
            ("sizeof ibv_ah_attr", size_of::<IbvAhAttr>()),
            ("ibv_ah_attr.dlid", offset_of!(IbvAhAttr, dlid)),
            ("ibv_ah_attr.is_global", offset_of!(IbvAhAttr, is_global)),
            (
                "back verbs_context.create_cq_ex",
                crate::extended::CREATE_CQ_EX_BACK,
            ),
            (
                "back verbs_context.create_qp_ex",
                crate::extended::CREATE_QP_EX_BACK,
            ),
            ("back verbs_context.sz", crate::extended::SZ_BACK),
            ("ibv_cq.context", offset_of!(IbvCq, context)),
            ("ibv_cq.channel", offset_of!(IbvCq, channel)),
            ("ibv_cq.cq_context", offset_of!(IbvCq, cq_context)),
            ("ibv_cq.cqe", offset_of!(IbvCq, cqe)),
            ("sizeof ibv_comp_channel", size_of::<IbvCompChannel>()),
            ("sizeof ibv_async_event", size_of::<IbvAsyncEvent>()),
            (
                "ibv_async_event.event_type",
                offset_of!(IbvAsyncEvent, event_type),
            ),
            ("ibv_comp_channel.fd", offset_of!(IbvCompChannel, fd)),
            (
                "ibv_comp_channel.refcnt",
                offset_of!(IbvCompChannel, refcnt),
            ),
            (
                "ibv_qp_init_attr.send_cq",
                offset_of!(IbvQpInitAttr, send_cq),
            ),
            (
                "ibv_qp_init_attr.recv_cq",
                offset_of!(IbvQpInitAttr, recv_cq),
            ),
            ("ibv_srq.context", offset_of!(IbvSrq, context)),
            ("sizeof ibv_sge", size_of::<IbvSge>()),
            ("ibv_sge.length", offset_of!(IbvSge, length)),
            ("sizeof ibv_send_wr", size_of::<IbvSendWr>()),
            ("ibv_send_wr.next", offset_of!(IbvSendWr, next)),
            ("ibv_send_wr.sg_list", offset_of!(IbvSendWr, sg_list)),
            ("ibv_send_wr.num_sge", offset_of!(IbvSendWr, num_sge)),
            ("ibv_send_wr.opcode", offset_of!(IbvSendWr, opcode)),
            ("ibv_send_wr.wr", offset_of!(IbvSendWr, wr)),
            ("sizeof ibv_recv_wr", size_of::<IbvRecvWr>()),
            ("ibv_recv_wr.next", offset_of!(IbvRecvWr, next)),
            ("ibv_recv_wr.sg_list", offset_of!(IbvRecvWr, sg_list)),
            ("ibv_recv_wr.num_sge", offset_of!(IbvRecvWr, num_sge)),
            ("sizeof ibv_wc", size_of::<IbvWc>()),
            ("ibv_wc.status", offset_of!(IbvWc, status)),
            ("ibv_wc.opcode", offset_of!(IbvWc, opcode)),
            ("ibv_wc.byte_len", offset_of!(IbvWc, byte_len)),
            ("ibv_wc.qp_num", offset_of!(IbvWc, qp_num)),
            ("sizeof ibv_qp_ex", size_of::<IbvQpEx>()),
            // The shim's `ibv_qp_ex`: its own `ibv_qp` view, then the shared tail.
            ("ibv_qp_ex.comp_mask", offset_of!(IbvQpEx, ex)),
        ];
        drum_test_support::assert_c_layout(&checks);
    }
}
