//! What rdma-core 44's extended verbs structures add after the basic ones they begin with:
//! the shim wraps an application's `ibv_qp_ex` and `ibv_cq_ex`, softrnic's provider fills
//! them. Function pointers are kept as addresses: each is called through its own signature.

use std::ffi::c_void;

/// `sizeof(struct ibv_qp)`: where `struct ibv_qp_ex` continues after its `qp_base`.
pub const QP_EX_TAIL: usize = 160;
/// Where `struct ibv_cq_ex` continues after the members it shares with `struct ibv_cq`.
pub const CQ_EX_TAIL: usize = 128;

/// What `struct ibv_qp_ex` adds after its `struct ibv_qp`: the request being built and the
/// `ibv_wr_*` ops.
#[repr(C)]
pub struct QpExTail {
    pub comp_mask: u64,
    pub wr_id: u64,
    pub wr_flags: u32,
    pub wr_atomic_cmp_swp: usize,
    pub wr_atomic_fetch_add: usize,
    pub wr_bind_mw: usize,
    pub wr_local_inv: usize,
    pub wr_rdma_read: usize,
    pub wr_rdma_write: usize,
    pub wr_rdma_write_imm: usize,
    pub wr_send: usize,
    pub wr_send_imm: usize,
    pub wr_send_inv: usize,
    pub wr_send_tso: usize,
    pub wr_set_ud_addr: usize,
    pub wr_set_xrc_srqn: usize,
    pub wr_set_inline_data: usize,
    pub wr_set_inline_data_list: usize,
    pub wr_set_sge: usize,
    pub wr_set_sge_list: usize,
    pub wr_start: usize,
    pub wr_complete: usize,
    pub wr_abort: usize,
    pub wr_atomic_write: usize,
}

/// What `struct ibv_cq_ex` adds after the members it shares with `struct ibv_cq`: the
/// completion being read and the polling and reading ops.
#[repr(C)]
pub struct CqExTail {
    pub comp_mask: u32,
    pub status: i32,
    pub wr_id: u64,
    pub start_poll: usize,
    pub next_poll: usize,
    pub end_poll: usize,
    pub read_opcode: usize,
    pub read_vendor_err: usize,
    pub read_byte_len: usize,
    pub read_imm_data: usize,
    pub read_qp_num: usize,
    pub read_src_qp: usize,
    pub read_wc_flags: usize,
    pub read_slid: usize,
    pub read_sl: usize,
    pub read_dlid_path_bits: usize,
    pub read_completion_ts: usize,
    pub read_cvlan: usize,
    pub read_flow_tag: usize,
    pub read_tm_info: usize,
    pub read_completion_wallclock_ns: usize,
}

/// `struct ibv_data_buf`.
#[repr(C)]
pub struct IbvDataBuf {
    pub addr: *mut c_void,
    pub length: usize,
}

/// `struct ibv_cq_init_attr_ex`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct IbvCqInitAttrEx {
    pub cqe: u32,
    pub cq_context: *mut c_void,
    pub channel: *mut c_void,
    pub comp_vector: u32,
    pub wc_flags: u64,
    pub comp_mask: u32,
    pub flags: u32,
    pub parent_domain: *mut c_void,
}
