//! Private structures of libibverbs' `driver.h` (rdma-core 44, provider ABI
//! `IBVERBS_PRIVATE_34`), which Debian does not ship: declared from the rdma-core 44 sources
//! and checked against numbers obtained by compiling its own definitions (docs/softrnic.md,
//! "Private ABI"). Only a provider uses them.

use crate::extended::QpExTail;
use crate::verbs::{
    IbvContext, IbvCq, IbvDevice, IbvMr, IbvQp, IbvSrq, VerbsContext, IBV_SYSFS_NAME_MAX,
    IBV_SYSFS_PATH_MAX,
};
use libc::{c_char, c_int, c_void};

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
