//! The shim's view of libibverbs: the ABI's structures and values (one declaration each, in
//! drum-verbs-abi, shared with softrnic's provider) and the signatures of the libibverbs
//! functions the shim resolves at run time (it does not link libibverbs, see `real.rs`).

use libc::{c_int, c_void};

pub use drum_verbs_abi::consts::*;
pub use drum_verbs_abi::*;

/// `IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC`: the peer may read through the QP.
pub const IBV_ACCESS_REMOTE_READ_ATOMIC: u32 = IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC;

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

pub type GetAsyncEventFn = unsafe extern "C" fn(*mut IbvContext, *mut IbvAsyncEvent) -> c_int;
pub type AckAsyncEventFn = unsafe extern "C" fn(*mut IbvAsyncEvent);
pub type OpenFn = unsafe extern "C" fn(*mut c_void) -> *mut IbvContext;
pub type CloseFn = unsafe extern "C" fn(*mut IbvContext) -> c_int;
pub type QpToQpExFn = unsafe extern "C" fn(*mut IbvQp) -> *mut c_void;
/// libmlx5's `mlx5dv_init_obj`.
pub type InitObjFn = unsafe extern "C" fn(*mut c_void, u64) -> c_int;

/// `verbs_context.create_cq_ex` and `create_qp_ex` (the extended creation ops, `extended`).
pub type CreateCqExFn = unsafe extern "C" fn(*mut IbvContext, *mut c_void) -> *mut c_void;
pub type CreateQpExFn = unsafe extern "C" fn(*mut IbvContext, *mut c_void) -> *mut IbvQp;
