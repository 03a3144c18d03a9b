//! C structures shared with libibverbs (rdma-core 44, provider ABI `IBVERBS_PRIVATE_34`).
//!
//! The public structures mirror `<infiniband/verbs.h>`; their layout is checked by the test
//! `layout_matches_public_headers`, which compiles a C probe against the installed headers.
//! The private structures (`driver.h`, not shipped by Debian) are declared here from the
//! rdma-core 44 sources; their layout is checked against numbers obtained by compiling
//! rdma-core 44's own definitions (see docs/softrnic.md, "Private ABI").
//!
//! Only the fields the provider reads or writes are named; the rest are opaque padding of the
//! exact size.

use libc::{c_char, c_int, c_void, pthread_cond_t, pthread_mutex_t};

pub const IBV_SYSFS_NAME_MAX: usize = 64;
pub const IBV_SYSFS_PATH_MAX: usize = 256;

// ---------------------------------------------------------------------------------------------
// Public structures (verbs.h)
// ---------------------------------------------------------------------------------------------

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

/// `struct ibv_context`; its 32 legacy op pointers are filled by libibverbs' `verbs_set_ops`.
#[repr(C)]
pub struct IbvContext {
    pub device: *mut IbvDevice,
    pub ops: [*mut c_void; 32],
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
    pub channel: *mut c_void,
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
    pub srq: *mut c_void,
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

/// `struct verbs_xrcd` (driver.h): `struct ibv_xrcd` (its context) and the handle.
#[repr(C)]
pub struct VerbsXrcd {
    pub context: *mut IbvContext,
    pub comp_mask: u32,
    pub handle: u32,
}

/// `struct verbs_srq` (driver.h): every SRQ this provider makes is one, so that
/// `ibv_get_srq_num` and the XRC fields have a place.
#[repr(C)]
pub struct VerbsSrq {
    pub srq: IbvSrq,
    pub srq_type: c_int,
    pub xrcd: *mut VerbsXrcd,
    pub cq: *mut IbvCq,
    pub srq_num: u32,
}

/// Size of `struct ibv_qp_ex` (it starts with `struct ibv_qp qp_base`).
pub const IBV_QP_EX_SIZE: usize = 352;

#[repr(C)]
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
    /// union {bind_mw, tso}: see [`IbvSendWr::bind_mw`].
    pub _bind_mw_tso: [u64; 6],
}

impl IbvSendWr {
    /// The `bind_mw` member of the WR's last union (`IBV_WR_BIND_MW`).
    pub fn bind_mw(&self) -> IbvSendWrBindMw {
        // SAFETY: both are 48 bytes of plain old data (pointers read back as written).
        unsafe { std::mem::transmute::<[u64; 6], IbvSendWrBindMw>(self._bind_mw_tso) }
    }

    pub fn set_bind_mw(&mut self, b: IbvSendWrBindMw) {
        // SAFETY: both are 48 bytes of plain old data.
        self._bind_mw_tso = unsafe { std::mem::transmute::<IbvSendWrBindMw, [u64; 6]>(b) };
    }
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
    pub srq: *mut c_void,
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

// ---------------------------------------------------------------------------------------------
// Private structures (driver.h of rdma-core 44, PABI 34)
// ---------------------------------------------------------------------------------------------

#[repr(C)]
pub struct ListNode {
    pub next: *mut ListNode,
    pub prev: *mut ListNode,
}

#[repr(C)]
pub struct VerbsMatchEnt {
    pub driver_data: *mut c_void,
    /// union { const char *modalias; uint64_t driver_id; }
    pub u: u64,
    pub vendor: u16,
    pub device: u16,
    pub kind: u8,
}

#[repr(C)]
pub struct VerbsSysfsDev {
    pub entry: ListNode,
    pub provider_data: *mut c_void,
    pub match_: *const VerbsMatchEnt,
    pub flags: u32,
    pub sysfs_name: [c_char; IBV_SYSFS_NAME_MAX],
    pub sysfs_cdev: libc::dev_t,
    pub ibdev_name: [c_char; IBV_SYSFS_NAME_MAX],
    pub ibdev_path: [c_char; IBV_SYSFS_PATH_MAX],
    pub modalias: [c_char; 512],
    pub node_guid: u64,
    pub driver_id: u32,
    pub node_type: c_int,
    pub ibdev_idx: c_int,
    pub num_ports: u32,
    pub abi_ver: u32,
    pub time_created: libc::timespec,
}

pub type AllocContextFn =
    unsafe extern "C" fn(*mut IbvDevice, c_int, *mut c_void) -> *mut VerbsContext;
pub type AllocDeviceFn = unsafe extern "C" fn(*mut VerbsSysfsDev) -> *mut VerbsDevice;
pub type UninitDeviceFn = unsafe extern "C" fn(*mut VerbsDevice);
pub type MatchDeviceFn = unsafe extern "C" fn(*mut VerbsSysfsDev) -> bool;

#[repr(C)]
pub struct VerbsDeviceOps {
    pub name: *const c_char,
    pub match_min_abi_version: u32,
    pub match_max_abi_version: u32,
    pub match_table: *const VerbsMatchEnt,
    pub static_providers: *const *const VerbsDeviceOps,
    pub match_device: Option<MatchDeviceFn>,
    pub alloc_context: Option<AllocContextFn>,
    pub import_context: *const c_void,
    pub alloc_device: Option<AllocDeviceFn>,
    pub uninit_device: Option<UninitDeviceFn>,
}

#[repr(C)]
pub struct VerbsDevice {
    pub device: IbvDevice,
    pub ops: *const VerbsDeviceOps,
    pub refcount: c_int,
    pub entry: ListNode,
    pub sysfs: *mut VerbsSysfsDev,
    pub core_support: u64,
}

/// `struct verbs_mr`: what `reg_mr` must return (libibverbs' `ibv_dereg_mr` reads past the
/// `ibv_mr`).
#[repr(C)]
pub struct VerbsMr {
    pub ibv_mr: IbvMr,
    pub mr_type: c_int,
    pub access: c_int,
}

/// `struct verbs_qp`: `ibv_qp_to_qp_ex` reads `comp_mask` behind the `ibv_qp_ex` union.
#[repr(C)]
pub struct VerbsQp {
    pub qp: IbvQp,
    pub ex: QpExTail,
    pub comp_mask: u32,
    pub xrcd: *mut c_void,
}

/// `verbs_qp.comp_mask` bits: the QP belongs to an XRC domain (`xrcd` is set); it has an
/// `ibv_qp_ex` (found by `ibv_qp_to_qp_ex`).
pub const VERBS_QP_XRCD: u32 = 1 << 0;
pub const VERBS_QP_EX: u32 = 1 << 1;

pub use drum_verbs_abi::{CqExTail, IbvCqInitAttrEx, IbvDataBuf, QpExTail};

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
    pub srq: *mut c_void,
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

/// Names of the 76 entries of `struct verbs_context_ops`, in declaration order.
pub const VERBS_CONTEXT_OPS: [&str; 76] = [
    "advise_mr",
    "alloc_dm",
    "alloc_mw",
    "alloc_null_mr",
    "alloc_parent_domain",
    "alloc_pd",
    "alloc_td",
    "async_event",
    "attach_counters_point_flow",
    "attach_mcast",
    "bind_mw",
    "close_xrcd",
    "cq_event",
    "create_ah",
    "create_counters",
    "create_cq",
    "create_cq_ex",
    "create_flow",
    "create_flow_action_esp",
    "create_qp",
    "create_qp_ex",
    "create_rwq_ind_table",
    "create_srq",
    "create_srq_ex",
    "create_wq",
    "dealloc_mw",
    "dealloc_pd",
    "dealloc_td",
    "dereg_mr",
    "destroy_ah",
    "destroy_counters",
    "destroy_cq",
    "destroy_flow",
    "destroy_flow_action",
    "destroy_qp",
    "destroy_rwq_ind_table",
    "destroy_srq",
    "destroy_wq",
    "detach_mcast",
    "free_context",
    "free_dm",
    "get_srq_num",
    "import_dm",
    "import_mr",
    "import_pd",
    "modify_cq",
    "modify_flow_action_esp",
    "modify_qp",
    "modify_qp_rate_limit",
    "modify_srq",
    "modify_wq",
    "open_qp",
    "open_xrcd",
    "poll_cq",
    "post_recv",
    "post_send",
    "post_srq_ops",
    "post_srq_recv",
    "query_device_ex",
    "query_ece",
    "query_port",
    "query_qp",
    "query_qp_data_in_order",
    "query_rt_values",
    "query_srq",
    "read_counters",
    "reg_dm_mr",
    "reg_dmabuf_mr",
    "reg_mr",
    "req_notify_cq",
    "rereg_mr",
    "resize_cq",
    "set_ece",
    "unimport_dm",
    "unimport_mr",
    "unimport_pd",
];

/// `struct verbs_context_ops`: 76 function pointers in the order of [`VERBS_CONTEXT_OPS`].
#[repr(C)]
pub struct VerbsContextOps {
    pub ops: [*const c_void; 76],
}

impl VerbsContextOps {
    /// Index of an op by its rdma-core name.
    pub fn index(name: &str) -> usize {
        VERBS_CONTEXT_OPS
            .iter()
            .position(|n| *n == name)
            .unwrap_or_else(|| panic!("unknown verbs_context_ops entry {name}"))
    }
}

// ---------------------------------------------------------------------------------------------
// Constants of the verbs API used by provider and engine
// ---------------------------------------------------------------------------------------------

pub mod consts {
    pub const IBV_QPS_RESET: i32 = 0;
    pub const IBV_QPS_INIT: i32 = 1;
    pub const IBV_QPS_RTR: i32 = 2;
    pub const IBV_QPS_RTS: i32 = 3;
    pub const IBV_QPS_SQD: i32 = 4;
    pub const IBV_QPS_SQE: i32 = 5;
    pub const IBV_QPS_ERR: i32 = 6;

    pub const IBV_QPT_RC: i32 = 2;
    pub const IBV_QPT_UC: i32 = 3;
    pub const IBV_QPT_UD: i32 = 4;
    /// Whole Ethernet frames, steered to it by flow rules (`ibv_create_flow`).
    pub const IBV_QPT_RAW_PACKET: i32 = 8;
    /// XRC initiator (sends into another host's XRC SRQs) and target (receives into this
    /// host's XRC SRQs; no CQ, no queues of its own).
    pub const IBV_QPT_XRC_SEND: i32 = 9;
    pub const IBV_QPT_XRC_RECV: i32 = 10;
    pub const IBV_SRQT_BASIC: i32 = 0;
    pub const IBV_SRQT_XRC: i32 = 1;

    pub const IBV_QP_STATE: i32 = 1;
    pub const IBV_QP_CUR_STATE: i32 = 1 << 1;
    pub const IBV_QP_ACCESS_FLAGS: i32 = 1 << 3;
    pub const IBV_QP_PKEY_INDEX: i32 = 1 << 4;
    pub const IBV_QP_PORT: i32 = 1 << 5;
    pub const IBV_QP_QKEY: i32 = 1 << 6;
    pub const IBV_QP_AV: i32 = 1 << 7;
    pub const IBV_QP_PATH_MTU: i32 = 1 << 8;
    pub const IBV_QP_TIMEOUT: i32 = 1 << 9;
    pub const IBV_QP_RETRY_CNT: i32 = 1 << 10;
    pub const IBV_QP_RNR_RETRY: i32 = 1 << 11;
    pub const IBV_QP_RQ_PSN: i32 = 1 << 12;
    pub const IBV_QP_MAX_QP_RD_ATOMIC: i32 = 1 << 13;
    pub const IBV_QP_MIN_RNR_TIMER: i32 = 1 << 15;
    pub const IBV_QP_SQ_PSN: i32 = 1 << 16;
    pub const IBV_QP_MAX_DEST_RD_ATOMIC: i32 = 1 << 17;
    pub const IBV_QP_CAP: i32 = 1 << 19;
    pub const IBV_QP_DEST_QPN: i32 = 1 << 20;
    pub const IBV_QP_RATE_LIMIT: i32 = 1 << 25;

    pub const IBV_ACCESS_LOCAL_WRITE: u32 = 1;
    pub const IBV_ACCESS_REMOTE_WRITE: u32 = 2;
    pub const IBV_ACCESS_REMOTE_READ: u32 = 4;
    pub const IBV_ACCESS_REMOTE_ATOMIC: u32 = 8;
    pub const IBV_ACCESS_MW_BIND: u32 = 16;
    pub const IBV_ACCESS_ZERO_BASED: u32 = 32;
    /// On-demand paging: the pages need not exist (be pinned) at registration.
    pub const IBV_ACCESS_ON_DEMAND: u32 = 64;

    pub const IBV_MW_TYPE_1: i32 = 1;
    pub const IBV_MW_TYPE_2: i32 = 2;

    pub const IBV_WR_RDMA_WRITE: i32 = 0;
    pub const IBV_WR_RDMA_WRITE_WITH_IMM: i32 = 1;
    pub const IBV_WR_SEND: i32 = 2;
    pub const IBV_WR_SEND_WITH_IMM: i32 = 3;
    pub const IBV_WR_RDMA_READ: i32 = 4;
    pub const IBV_WR_ATOMIC_CMP_AND_SWP: i32 = 5;
    pub const IBV_WR_ATOMIC_FETCH_AND_ADD: i32 = 6;
    pub const IBV_WR_LOCAL_INV: i32 = 7;
    pub const IBV_WR_BIND_MW: i32 = 8;
    pub const IBV_WR_SEND_WITH_INV: i32 = 9;

    pub const IBV_SEND_SIGNALED: u32 = 2;
    pub const IBV_SEND_SOLICITED: u32 = 4;
    pub const IBV_SEND_INLINE: u32 = 8;

    pub const IBV_WC_SUCCESS: i32 = 0;
    pub const IBV_WC_LOC_LEN_ERR: i32 = 1;
    pub const IBV_WC_LOC_QP_OP_ERR: i32 = 2;
    pub const IBV_WC_LOC_PROT_ERR: i32 = 4;
    pub const IBV_WC_WR_FLUSH_ERR: i32 = 5;
    pub const IBV_WC_MW_BIND_ERR: i32 = 6;
    pub const IBV_WC_REM_INV_REQ_ERR: i32 = 9;
    pub const IBV_WC_REM_ACCESS_ERR: i32 = 10;
    pub const IBV_WC_REM_OP_ERR: i32 = 11;
    pub const IBV_WC_RETRY_EXC_ERR: i32 = 12;
    pub const IBV_WC_RNR_RETRY_EXC_ERR: i32 = 13;

    pub const IBV_WC_SEND: i32 = 0;
    pub const IBV_WC_RDMA_WRITE: i32 = 1;
    pub const IBV_WC_RDMA_READ: i32 = 2;
    pub const IBV_WC_COMP_SWAP: i32 = 3;
    pub const IBV_WC_FETCH_ADD: i32 = 4;
    pub const IBV_WC_BIND_MW: i32 = 5;
    pub const IBV_WC_LOCAL_INV: i32 = 6;
    pub const IBV_WC_RECV: i32 = 128;
    pub const IBV_WC_RECV_RDMA_WITH_IMM: i32 = 129;

    pub const IBV_WC_GRH: u32 = 1;
    pub const IBV_WC_WITH_IMM: u32 = 2;
    pub const IBV_WC_WITH_INV: u32 = 8;

    // enum ibv_event_type (the asynchronous events softrnic raises).
    pub const IBV_EVENT_CQ_ERR: u32 = 0;
    pub const IBV_EVENT_QP_FATAL: u32 = 1;
    pub const IBV_EVENT_QP_REQ_ERR: u32 = 2;
    pub const IBV_EVENT_QP_ACCESS_ERR: u32 = 3;
    pub const IBV_EVENT_COMM_EST: u32 = 4;
    pub const IBV_EVENT_PORT_ACTIVE: u32 = 9;
    pub const IBV_EVENT_PORT_ERR: u32 = 10;
    pub const IBV_EVENT_SRQ_LIMIT_REACHED: u32 = 15;
    pub const IBV_EVENT_QP_LAST_WQE_REACHED: u32 = 16;

    pub const IBV_PORT_DOWN: i32 = 1;
    pub const IBV_PORT_ACTIVE: i32 = 4;
    pub const IBV_LINK_LAYER_ETHERNET: u8 = 2;
    pub const IBV_MTU_4096: i32 = 5;
}

/// Bytes of an `ibv_mtu` enum value (1 = 256 … 5 = 4096).
pub fn mtu_bytes(mtu: i32) -> Option<u32> {
    match mtu {
        1..=5 => Some(128u32 << mtu),
        _ => None,
    }
}

#[cfg(test)]
mod tests;
