//! `ibv_create_flow` / `ibv_destroy_flow`: steering rules of raw-packet QPs. The provider
//! passes the application's `struct ibv_flow_attr` and its specs to the engine as bytes; the
//! engine parses and checks them (softrnic's `flow`) and answers with the rule's handle.

use std::ptr::null_mut;

use libc::{c_int, c_void};

use super::*;

/// `struct ibv_flow` (rdma-core 44): comp_mask u32, context pointer, handle u32.
#[repr(C)]
pub struct IbvFlow {
    pub comp_mask: u32,
    pub context: *mut IbvContext,
    pub handle: u32,
}

/// `struct ibv_flow_attr`: 20 bytes, `num_of_specs` (u8) at offset 12.
const ATTR_LEN: usize = 20;
const NUM_OF_SPECS_OFFSET: usize = 12;
/// Read no more of one spec than this (the largest spec type is far smaller): a garbage size
/// then makes a rule the engine refuses, not a read beyond the application's memory.
const MAX_SPEC_READ: usize = 128;

/// The attribute and its specs, as libibverbs reads them for the kernel: the fixed part, then
/// `num_of_specs` specs, each as long as its own header says (the attribute's `size` is not
/// read; perftest leaves it 0 in its sniffer and promiscuous rules).
///
/// # Safety
/// `attr` points to a `struct ibv_flow_attr` followed by its specs.
unsafe fn attr_bytes<'a>(attr: *const u8) -> &'a [u8] {
    // SAFETY: per this function's contract.
    unsafe {
        let mut len = ATTR_LEN;
        for _ in 0..*attr.add(NUM_OF_SPECS_OFFSET) {
            if len + 6 > softrnic_abi::proto::MAX_FLOW_ATTR_BYTES {
                break;
            }
            let size = std::ptr::read_unaligned(attr.add(len + 4) as *const u16) as usize;
            if !(6..=MAX_SPEC_READ).contains(&size) {
                len += 6;
                break;
            }
            len += size;
        }
        std::slice::from_raw_parts(attr, len.min(softrnic_abi::proto::MAX_FLOW_ATTR_BYTES))
    }
}

pub(super) unsafe extern "C" fn create_flow(qp: *mut IbvQp, attr: *const c_void) -> *mut IbvFlow {
    guard(null_mut(), || {
        if qp.is_null() || attr.is_null() {
            set_errno(libc::EINVAL);
            return null_mut();
        }
        // SAFETY: the application's attribute with its specs.
        let bytes = unsafe { attr_bytes(attr as *const u8) };
        // SAFETY: qp is ours.
        let (ctx, qpn) = unsafe { ((*qp).context, (*qp).qp_num) };
        let req = Req::CreateFlow {
            qpn,
            attr: bytes.to_vec(),
        };
        // SAFETY: ctx is a softrnic context (the QP is ours).
        match unsafe { state(ctx) }.call(&req) {
            Ok(Resp::Handle(handle)) => Box::into_raw(Box::new(IbvFlow {
                comp_mask: 0,
                context: ctx,
                handle,
            })),
            Ok(_) => {
                set_errno(libc::EIO);
                null_mut()
            }
            Err(e) => {
                set_errno(e);
                null_mut()
            }
        }
    })
}

pub(super) unsafe extern "C" fn destroy_flow(flow: *mut IbvFlow) -> c_int {
    guard(libc::EIO, || {
        if flow.is_null() {
            return libc::EINVAL;
        }
        // SAFETY: made by create_flow.
        let (ctx, handle) = unsafe { ((*flow).context, (*flow).handle) };
        // SAFETY: ctx is a softrnic context.
        match unsafe { state(ctx) }.call(&Req::DestroyFlow { handle }) {
            Ok(_) => {
                // SAFETY: allocated by create_flow as a Box.
                drop(unsafe { Box::from_raw(flow) });
                0
            }
            Err(e) => e,
        }
    })
}
