//! The interposed CQ, completion-channel and asynchronous-event verbs: on a governed
//! context the application's CQs and channels are the shim's virtual ones (`vcq`); what is
//! not the shim's is forwarded to libibverbs unchanged.

use crate::ffi::*;
use crate::trouble::{completions, set_errno};
use crate::vcq;
use libc::{c_int, c_void};
use std::ptr;

/// Interposes `ibv_create_cq`: on a governed context the CQ becomes virtual (`vcq`).
///
/// # Safety
/// Called by C code with the real function's arguments.
#[no_mangle]
pub unsafe extern "C" fn ibv_create_cq(
    ctx: *mut IbvContext,
    cqe: c_int,
    cq_context: *mut c_void,
    channel: *mut IbvCompChannel,
    comp_vector: c_int,
) -> *mut IbvCq {
    if let Some(cq) = completions(|| {
        // SAFETY: the caller's arguments, passed on unchanged.
        Some(unsafe { vcq::create_cq(ctx, cqe, cq_context, channel, comp_vector) })
    }) {
        return cq;
    }
    match crate::real::CREATE_CQ.get() {
        // SAFETY: forwarding unchanged.
        Some(f) => unsafe { f(ctx, cqe, cq_context, channel, comp_vector) },
        None => {
            set_errno(libc::ENOSYS);
            ptr::null_mut()
        }
    }
}

/// Interposes `ibv_destroy_cq`: a virtual CQ goes with its dedicated CQ.
///
/// # Safety
/// Called by C code with the real function's arguments.
#[no_mangle]
pub unsafe extern "C" fn ibv_destroy_cq(cq: *mut IbvCq) -> c_int {
    // SAFETY: the caller's CQ.
    if let Some(rc) = completions(|| unsafe { vcq::destroy_cq(cq) }) {
        return rc;
    }
    match crate::real::DESTROY_CQ.get() {
        // SAFETY: forwarding unchanged.
        Some(f) => unsafe { f(cq) },
        None => libc::ENOSYS,
    }
}

/// Interposes `ibv_resize_cq`: a virtual CQ's dedicated CQ is resized with it.
///
/// # Safety
/// Called by C code with the real function's arguments.
#[no_mangle]
pub unsafe extern "C" fn ibv_resize_cq(cq: *mut IbvCq, cqe: c_int) -> c_int {
    // SAFETY: the caller's arguments.
    if let Some(rc) = completions(|| unsafe { vcq::resize_cq(cq, cqe) }) {
        return rc;
    }
    match crate::real::RESIZE_CQ.get() {
        // SAFETY: forwarding unchanged.
        Some(f) => unsafe { f(cq, cqe) },
        None => libc::ENOSYS,
    }
}

/// Interposes `ibv_create_comp_channel`: on a governed context the application gets the
/// shim's channel (`vcq`).
///
/// # Safety
/// Called by C code with the real function's arguments.
#[no_mangle]
pub unsafe extern "C" fn ibv_create_comp_channel(ctx: *mut IbvContext) -> *mut IbvCompChannel {
    // SAFETY: the caller's context.
    completions(|| Some(unsafe { vcq::create_channel(ctx) })).unwrap_or_else(|| {
        set_errno(libc::EIO);
        ptr::null_mut()
    })
}

/// Interposes `ibv_destroy_comp_channel`.
///
/// # Safety
/// Called by C code with the real function's arguments.
#[no_mangle]
pub unsafe extern "C" fn ibv_destroy_comp_channel(ch: *mut IbvCompChannel) -> c_int {
    // SAFETY: the caller's channel.
    if let Some(rc) = completions(|| unsafe { vcq::destroy_channel(ch) }) {
        return rc;
    }
    match crate::real::DESTROY_CHANNEL.get() {
        // SAFETY: forwarding unchanged.
        Some(f) => unsafe { f(ch) },
        None => libc::ENOSYS,
    }
}

/// Interposes `ibv_get_cq_event`: a shim channel yields the application's CQ.
///
/// # Safety
/// Called by C code with the real function's arguments.
#[no_mangle]
pub unsafe extern "C" fn ibv_get_cq_event(
    ch: *mut IbvCompChannel,
    cq: *mut *mut IbvCq,
    cq_context: *mut *mut c_void,
) -> c_int {
    // SAFETY: the caller's arguments.
    if let Some(rc) = completions(|| unsafe { vcq::get_event(ch, cq, cq_context) }) {
        return rc;
    }
    match crate::real::GET_CQ_EVENT.get() {
        // SAFETY: forwarding unchanged.
        Some(f) => unsafe { f(ch, cq, cq_context) },
        None => -1,
    }
}

/// Interposes `ibv_ack_cq_events`: a virtual CQ's real events were acknowledged by the
/// shim when it took them.
///
/// # Safety
/// Called by C code with the real function's arguments.
#[no_mangle]
pub unsafe extern "C" fn ibv_ack_cq_events(cq: *mut IbvCq, nevents: libc::c_uint) {
    if completions(|| vcq::ack(cq).then_some(())).is_some() {
        return;
    }
    if let Some(f) = crate::real::ACK_CQ_EVENTS.get() {
        // SAFETY: forwarding unchanged.
        unsafe { f(cq, nevents) }
    }
}

/// Interposes `ibv_get_async_event`: an event about a dedicated CQ (`IBV_EVENT_CQ_ERR`, an
/// overrun) names the application's CQ.
///
/// # Safety
/// Called by C code with the real function's arguments.
#[no_mangle]
pub unsafe extern "C" fn ibv_get_async_event(
    ctx: *mut IbvContext,
    event: *mut IbvAsyncEvent,
) -> c_int {
    let Some(f) = crate::real::GET_ASYNC_EVENT.get() else {
        return -1;
    };
    // SAFETY: forwarding unchanged.
    let rc = unsafe { f(ctx, event) };
    if rc == 0 && !event.is_null() {
        completions(|| {
            // SAFETY: the caller's event, just filled in.
            let e = unsafe { &mut *event };
            if e.event_type == IBV_EVENT_CQ_ERR {
                e.element = vcq::app_cq_of(e.element.cast()).cast();
            }
            Some(())
        });
    }
    rc
}

/// Interposes `ibv_ack_async_event`: an event about a virtual CQ is acknowledged on its
/// dedicated CQ, the one the provider counts (and whose destroy waits for it).
///
/// # Safety
/// Called by C code with the real function's argument.
#[no_mangle]
pub unsafe extern "C" fn ibv_ack_async_event(event: *mut IbvAsyncEvent) {
    let Some(f) = crate::real::ACK_ASYNC_EVENT.get() else {
        return;
    };
    if !event.is_null() {
        // SAFETY: the caller's event, as ibv_get_async_event filled it.
        let (element, event_type) = unsafe { ((*event).element, (*event).event_type) };
        if event_type == IBV_EVENT_CQ_ERR {
            let dedicated =
                completions(|| Some(vcq::dedicated_of(element.cast()))).unwrap_or(element.cast());
            let mut own = IbvAsyncEvent {
                element: dedicated.cast(),
                event_type,
            };
            // SAFETY: a copy naming the provider's CQ.
            unsafe { f(&mut own) };
            return;
        }
    }
    // SAFETY: forwarding unchanged.
    unsafe { f(event) }
}
