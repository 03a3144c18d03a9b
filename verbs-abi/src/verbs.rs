//! Public structures of `<infiniband/verbs.h>` (rdma-core 44), whole: both the shim and
//! softrnic's provider use these declarations, so a structure one side only reads is still
//! declared to its end (the other may allocate it).

use crate::driver::VerbsXrcd;
use crate::extended::QpExTail;
use libc::{c_char, c_int, c_void, pthread_cond_t, pthread_mutex_t};

pub const IBV_SYSFS_NAME_MAX: usize = 64;
pub const IBV_SYSFS_PATH_MAX: usize = 256;

#[repr(C)]
pub struct IbvDevice {
    pub _ops: [*mut c_void; 2],
    pub node_type: c_int,
    pub transport_type: c_int,
    pub name: [c_char; IBV_SYSFS_NAME_MAX],
    pub dev_name: [c_char; IBV_SYSFS_NAME_MAX],
    pub dev_path: [c_char; IBV_SYSFS_PATH_MAX],
    pub ibdev_path: [c_char; IBV_SYSFS_PATH_MAX],
}

pub type PostSendFn =
    unsafe extern "C" fn(qp: *mut IbvQp, wr: *mut IbvSendWr, bad: *mut *mut IbvSendWr) -> c_int;
pub type PostRecvFn =
    unsafe extern "C" fn(qp: *mut IbvQp, wr: *mut IbvRecvWr, bad: *mut *mut IbvRecvWr) -> c_int;
pub type PostSrqRecvFn =
    unsafe extern "C" fn(srq: *mut IbvSrq, wr: *mut IbvRecvWr, bad: *mut *mut IbvRecvWr) -> c_int;
pub type PollCqFn = unsafe extern "C" fn(cq: *mut IbvCq, n: c_int, wc: *mut IbvWc) -> c_int;
pub type ReqNotifyCqFn = unsafe extern "C" fn(cq: *mut IbvCq, solicited_only: c_int) -> c_int;

/// `struct ibv_context_ops`: 32 pointers, filled by libibverbs' `verbs_set_ops`. The inline
/// data-path verbs (`ibv_post_send`, `ibv_post_recv`, `ibv_post_srq_recv`, `ibv_poll_cq`,
/// `ibv_req_notify_cq`) call through the five named ones, which the shim replaces.
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

/// `struct ibv_context`.
#[repr(C)]
pub struct IbvContext {
    pub device: *mut IbvDevice,
    pub ops: IbvContextOps,
    pub cmd_fd: c_int,
    pub async_fd: c_int,
    pub num_comp_vectors: c_int,
    pub mutex: pthread_mutex_t,
    pub abi_compat: *mut c_void,
}

/// `struct verbs_context`: extended ops, then `priv`, then more ops, `sz`, and the
/// `ibv_context` last.
#[repr(C)]
pub struct VerbsContext {
    pub ops_head: [*mut c_void; 26],
    pub priv_: *mut c_void,
    pub ops_tail: [*mut c_void; 11],
    pub _abi_placeholder3: u64,
    pub sz: usize,
    pub context: IbvContext,
}

/// How far before a `struct ibv_context` (the last member of its `verbs_context`) the
/// `create_cq_ex` and `create_qp_ex` ops and `sz` are: the shim reaches them from the
/// context an application holds, and only when `sz` says the provider's context has them.
pub const CREATE_CQ_EX_BACK: usize = 120;
pub const CREATE_QP_EX_BACK: usize = 56;
pub const SZ_BACK: usize = 8;

#[repr(C)]
pub struct IbvPd {
    pub context: *mut IbvContext,
    pub handle: u32,
}

#[repr(C)]
pub struct IbvMr {
    pub context: *mut IbvContext,
    pub pd: *mut IbvPd,
    pub addr: *mut c_void,
    pub length: usize,
    pub handle: u32,
    pub lkey: u32,
    pub rkey: u32,
}

/// `struct ibv_mw`.
#[repr(C)]
pub struct IbvMw {
    pub context: *mut IbvContext,
    pub pd: *mut IbvPd,
    pub rkey: u32,
    pub handle: u32,
    /// `enum ibv_mw_type`.
    pub type_: c_int,
}

/// `struct ibv_mw_bind_info`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct IbvMwBindInfo {
    pub mr: *mut IbvMr,
    pub addr: u64,
    pub length: u64,
    pub mw_access_flags: u32,
}

/// `struct ibv_mw_bind` (what `ibv_bind_mw` takes for a type 1 window).
#[repr(C)]
pub struct IbvMwBind {
    pub wr_id: u64,
    pub send_flags: u32,
    pub bind_info: IbvMwBindInfo,
}

/// `ibv_send_wr.bind_mw`, the first member of the WR's last union.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct IbvSendWrBindMw {
    pub mw: *mut IbvMw,
    pub rkey: u32,
    pub bind_info: IbvMwBindInfo,
}

#[repr(C)]
pub struct IbvCq {
    pub context: *mut IbvContext,
    pub channel: *mut IbvCompChannel,
    pub cq_context: *mut c_void,
    pub handle: u32,
    pub cqe: c_int,
    pub mutex: pthread_mutex_t,
    pub cond: pthread_cond_t,
    pub comp_events_completed: u32,
    pub async_events_completed: u32,
}

/// `struct ibv_comp_channel` (allocated with `malloc`: libibverbs `free`s it).
#[repr(C)]
pub struct IbvCompChannel {
    pub context: *mut IbvContext,
    pub fd: c_int,
    pub refcnt: c_int,
}

#[repr(C)]
pub struct IbvQp {
    pub context: *mut IbvContext,
    pub qp_context: *mut c_void,
    pub pd: *mut IbvPd,
    pub send_cq: *mut IbvCq,
    pub recv_cq: *mut IbvCq,
    pub srq: *mut IbvSrq,
    pub handle: u32,
    pub qp_num: u32,
    pub state: c_int,
    pub qp_type: c_int,
    pub mutex: pthread_mutex_t,
    pub cond: pthread_cond_t,
    pub events_completed: u32,
}

#[repr(C)]
pub struct IbvAh {
    pub context: *mut IbvContext,
    pub pd: *mut IbvPd,
    pub handle: u32,
}

#[repr(C)]
pub struct IbvSrq {
    pub context: *mut IbvContext,
    pub srq_context: *mut c_void,
    pub pd: *mut IbvPd,
    pub handle: u32,
    pub mutex: pthread_mutex_t,
    pub cond: pthread_cond_t,
    pub events_completed: u32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct IbvSrqAttr {
    pub max_wr: u32,
    pub max_sge: u32,
    pub srq_limit: u32,
}

#[repr(C)]
pub struct IbvSrqInitAttr {
    pub srq_context: *mut c_void,
    pub attr: IbvSrqAttr,
}

/// `struct ibv_srq_init_attr_ex` (`ibv_create_srq_ex`).
#[repr(C)]
pub struct IbvSrqInitAttrEx {
    pub srq_context: *mut c_void,
    pub attr: IbvSrqAttr,
    pub comp_mask: u32,
    pub srq_type: c_int,
    pub pd: *mut IbvPd,
    pub xrcd: *mut VerbsXrcd,
    pub cq: *mut IbvCq,
    /// `struct ibv_tm_cap`: tag matching (not offered).
    pub tm_cap: [u32; 2],
}

/// `struct ibv_xrcd_init_attr` (`ibv_open_xrcd`).
#[repr(C)]
pub struct IbvXrcdInitAttr {
    pub comp_mask: u32,
    pub fd: c_int,
    pub oflags: c_int,
}

/// `struct ibv_qp_open_attr` (`ibv_open_qp`).
#[repr(C)]
pub struct IbvQpOpenAttr {
    pub comp_mask: u32,
    pub qp_num: u32,
    pub xrcd: *mut VerbsXrcd,
    pub qp_context: *mut c_void,
    pub qp_type: c_int,
}

/// `struct ibv_qp_ex`: a whole `struct ibv_qp`, then the request being built and the
/// `ibv_wr_*` ops.
#[repr(C)]
pub struct IbvQpEx {
    pub qp_base: IbvQp,
    pub ex: QpExTail,
}

/// `struct ibv_async_event`: `element` is the union of the object pointers (and the port).
#[repr(C)]
pub struct IbvAsyncEvent {
    pub element: *mut c_void,
    /// `enum ibv_event_type`.
    pub event_type: u32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
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
    /// `imm_data` (network order) / `invalidate_rkey`.
    pub imm_data: u32,
    /// union `wr`: rdma {remote_addr, rkey}, atomic {remote_addr, compare_add, swap, rkey},
    /// ud {ah, remote_qpn, remote_qkey}.
    pub wr: [u64; 4],
    pub qp_type_xrc_remote_srqn: u32,
    pub _pad: u32,
    /// union {bind_mw, tso}: `tso` (a header pointer and two u16) is never used, and
    /// `bind_mw` fills the union's size and alignment.
    pub bind_mw: IbvSendWrBindMw,
}

#[repr(C)]
pub struct IbvRecvWr {
    pub wr_id: u64,
    pub next: *mut IbvRecvWr,
    pub sg_list: *mut IbvSge,
    pub num_sge: c_int,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
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

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct IbvQpCap {
    pub max_send_wr: u32,
    pub max_recv_wr: u32,
    pub max_send_sge: u32,
    pub max_recv_sge: u32,
    pub max_inline_data: u32,
}

#[repr(C)]
pub struct IbvQpInitAttr {
    pub qp_context: *mut c_void,
    pub send_cq: *mut IbvCq,
    pub recv_cq: *mut IbvCq,
    pub srq: *mut IbvSrq,
    pub cap: IbvQpCap,
    pub qp_type: c_int,
    pub sq_sig_all: c_int,
}

/// `union ibv_gid` holds two `__be64`, so the route (and everything containing it) is 8-byte
/// aligned.
#[repr(C, align(8))]
#[derive(Debug, Clone, Copy, Default)]
pub struct IbvGlobalRoute {
    pub dgid: [u8; 16],
    pub flow_label: u32,
    pub sgid_index: u8,
    pub hop_limit: u8,
    pub traffic_class: u8,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct IbvAhAttr {
    pub grh: IbvGlobalRoute,
    pub dlid: u16,
    pub sl: u8,
    pub src_path_bits: u8,
    pub static_rate: u8,
    pub is_global: u8,
    pub port_num: u8,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct IbvQpAttr {
    pub qp_state: c_int,
    pub cur_qp_state: c_int,
    pub path_mtu: c_int,
    pub path_mig_state: c_int,
    pub qkey: u32,
    pub rq_psn: u32,
    pub sq_psn: u32,
    pub dest_qp_num: u32,
    pub qp_access_flags: u32,
    pub cap: IbvQpCap,
    pub ah_attr: IbvAhAttr,
    pub alt_ah_attr: IbvAhAttr,
    pub pkey_index: u16,
    pub alt_pkey_index: u16,
    pub en_sqd_async_notify: u8,
    pub sq_draining: u8,
    pub max_rd_atomic: u8,
    pub max_dest_rd_atomic: u8,
    pub min_rnr_timer: u8,
    pub port_num: u8,
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
    pub alt_port_num: u8,
    pub alt_timeout: u8,
    pub rate_limit: u32,
}

#[repr(C)]
pub struct IbvPortAttr {
    pub state: c_int,
    pub max_mtu: c_int,
    pub active_mtu: c_int,
    pub gid_tbl_len: c_int,
    pub port_cap_flags: u32,
    pub max_msg_sz: u32,
    pub bad_pkey_cntr: u32,
    pub qkey_viol_cntr: u32,
    pub pkey_tbl_len: u16,
    pub lid: u16,
    pub sm_lid: u16,
    pub lmc: u8,
    pub max_vl_num: u8,
    pub sm_sl: u8,
    pub subnet_timeout: u8,
    pub init_type_reply: u8,
    pub active_width: u8,
    pub active_speed: u8,
    pub phys_state: u8,
    pub link_layer: u8,
    pub flags: u8,
    pub port_cap_flags2: u16,
}

#[repr(C)]
pub struct IbvDeviceAttr {
    pub fw_ver: [c_char; 64],
    pub node_guid: u64,
    pub sys_image_guid: u64,
    pub max_mr_size: u64,
    pub page_size_cap: u64,
    pub vendor_id: u32,
    pub vendor_part_id: u32,
    pub hw_ver: u32,
    pub max_qp: c_int,
    pub max_qp_wr: c_int,
    pub device_cap_flags: u32,
    pub max_sge: c_int,
    pub max_sge_rd: c_int,
    pub max_cq: c_int,
    pub max_cqe: c_int,
    pub max_mr: c_int,
    pub max_pd: c_int,
    pub max_qp_rd_atom: c_int,
    pub max_ee_rd_atom: c_int,
    pub max_res_rd_atom: c_int,
    pub max_qp_init_rd_atom: c_int,
    pub max_ee_init_rd_atom: c_int,
    pub atomic_cap: c_int,
    pub max_ee: c_int,
    pub max_rdd: c_int,
    pub max_mw: c_int,
    pub max_raw_ipv6_qp: c_int,
    pub max_raw_ethy_qp: c_int,
    pub max_mcast_grp: c_int,
    pub max_mcast_qp_attach: c_int,
    pub max_total_mcast_qp_attach: c_int,
    pub max_ah: c_int,
    pub max_fmr: c_int,
    pub max_map_per_fmr: c_int,
    pub max_srq: c_int,
    pub max_srq_wr: c_int,
    pub max_srq_sge: c_int,
    pub max_pkeys: u16,
    pub local_ca_ack_delay: u8,
    pub phys_port_cnt: u8,
}

/// Offsets in `struct ibv_device_attr_ex` of what the completion timestamps need.
pub const DEVICE_ATTR_EX_TS_MASK: usize = 264;
pub const DEVICE_ATTR_EX_CORE_CLOCK: usize = 272;
/// Offsets in `struct ibv_device_attr_ex` of the on-demand paging capabilities:
/// `odp_caps.general_caps` (u64), the RC, UC and UD transports' (u32 each), and XRC's.
pub const DEVICE_ATTR_EX_ODP_GENERAL: usize = 240;
pub const DEVICE_ATTR_EX_ODP_RC: usize = 248;
pub const DEVICE_ATTR_EX_ODP_UC: usize = 252;
pub const DEVICE_ATTR_EX_ODP_UD: usize = 256;
pub const DEVICE_ATTR_EX_ODP_XRC: usize = 392;
/// Offset in `struct ibv_device_attr_ex` of `packet_pacing_caps` (three u32: the least and
/// the greatest rate in kb/s, a mask of QP types).
pub const DEVICE_ATTR_EX_PACKET_PACING: usize = 332;
/// Offset in `struct ibv_device_attr_ex` of `max_dm_size` (u64).
pub const DEVICE_ATTR_EX_MAX_DM_SIZE: usize = 376;
/// Offsets in `struct ibv_device_attr_ex` of `device_cap_flags_ex` (u64) and
/// `phys_port_cnt_ex` (u32, the struct's last field).
pub const DEVICE_ATTR_EX_CAP_FLAGS_EX: usize = 280;
pub const DEVICE_ATTR_EX_PHYS_PORT_CNT: usize = 396;

/// `struct ibv_dm`.
#[repr(C)]
pub struct IbvDm {
    pub context: *mut IbvContext,
    pub memcpy_to_dm: unsafe extern "C" fn(*mut IbvDm, u64, *const c_void, usize) -> c_int,
    pub memcpy_from_dm: unsafe extern "C" fn(*mut c_void, *mut IbvDm, u64, usize) -> c_int,
    pub comp_mask: u32,
    pub handle: u32,
}

/// `struct ibv_qp_rate_limit_attr`.
#[repr(C)]
pub struct IbvQpRateLimitAttr {
    pub rate_limit: u32,
    pub max_burst_sz: u32,
    pub typical_pkt_sz: u16,
    pub comp_mask: u32,
}

/// `struct ibv_alloc_dm_attr`.
#[repr(C)]
pub struct IbvAllocDmAttr {
    pub length: usize,
    pub log_align_req: u32,
    pub comp_mask: u32,
}

/// `struct ibv_qp_init_attr_ex`: its first members are `struct ibv_qp_init_attr`'s (which,
/// padded to 64 bytes on its own, cannot be embedded: `comp_mask` sits in that padding).
#[repr(C)]
pub struct IbvQpInitAttrEx {
    pub qp_context: *mut c_void,
    pub send_cq: *mut IbvCq,
    pub recv_cq: *mut IbvCq,
    pub srq: *mut IbvSrq,
    pub cap: IbvQpCap,
    pub qp_type: c_int,
    pub sq_sig_all: c_int,
    pub comp_mask: u32,
    pub pd: *mut IbvPd,
    pub xrcd: *mut c_void,
    pub create_flags: u32,
    pub max_tso_header: u16,
    pub rwq_ind_tbl: *mut c_void,
    /// `struct ibv_rx_hash_conf`: function, key length, key, fields mask.
    pub rx_hash_conf: [u64; 3],
    pub source_qpn: u32,
    pub send_ops_flags: u64,
}
