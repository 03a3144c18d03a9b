//! `ibv_create_flow` / `ibv_destroy_flow`: steering rules of raw-packet QPs. The provider
//! passes the application's `struct ibv_flow_attr` and its specs to the engine as bytes; the
//! engine parses and checks them ([`crate::flow`]) and answers with the rule's handle.

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

/// `struct ibv_flow_attr`'s `size` (u16 at offset 8): the bytes of the attribute and its specs.
const ATTR_SIZE_OFFSET: usize = 8;

pub(super) unsafe extern "C" fn create_flow(qp: *mut IbvQp, attr: *const c_void) -> *mut IbvFlow {
    guard(null_mut(), || {
        if qp.is_null() || attr.is_null() {
            set_errno(libc::EINVAL);
            return null_mut();
        }
        // SAFETY: the application's attribute: at least its fixed part, whose `size` says
        // how many bytes (with the specs) follow from its start — what the kernel reads.
        let bytes = unsafe {
            let size =
                std::ptr::read_unaligned((attr as *const u8).add(ATTR_SIZE_OFFSET) as *const u16)
                    as usize;
            std::slice::from_raw_parts(attr as *const u8, size.min(crate::flow::MAX_ATTR_BYTES + 1))
        };
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
