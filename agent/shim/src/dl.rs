//! Applications that `dlopen` libibverbs and take its functions from the handle with
//! `dlsym` (NCCL does, often with `RTLD_LOCAL`) bypass every symbol the shim exports: the
//! handle gives them libibverbs' own `ibv_open_device`, so their contexts are never governed.
//! The shim therefore exports `dlsym` too. A lookup through a handle of one of the functions
//! the shim interposes (`mlx5dv_init_obj` included, which programs that load libmlx5
//! themselves look up so), which finds the library's own, gets the shim's instead — and the shim
//! learns from that handle where libibverbs' functions are, since `RTLD_NEXT` cannot see a
//! library loaded with `RTLD_LOCAL`.
//!
//! `RTLD_DEFAULT` and `RTLD_NEXT` lookups must not pass through any code of the shim's:
//! glibc finds the caller of `dlsym` from its return address, and `RTLD_NEXT` searches the
//! objects after the caller (another preloaded library, softrnic's provider among them,
//! would otherwise be handed its own function back and recurse for ever). So the exported
//! `dlsym` is a few instructions that jump to the real one with the caller's return address
//! untouched, and only a lookup through a real handle jumps to Rust. x86-64 only; elsewhere
//! such applications stay ungoverned.

use crate::real::{self, DlsymFn, RealFn};
use crate::{extended, qp_verbs};
use libc::{c_char, c_void};
use std::ffi::CStr;
use std::panic::catch_unwind;
use std::sync::atomic::{AtomicUsize, Ordering::Acquire, Ordering::Release};

/// `dlsym`: special handles straight to libc (a jump, so the caller's return address is
/// the one libc sees); real handles through [`lookup`]. libc's own `dlsym` is found in
/// `real` (`real::resolve_dlsym`), which the rest of the shim uses too.
///
/// # Safety
/// As libc's `dlsym`.
#[cfg(target_arch = "x86_64")]
#[no_mangle]
#[unsafe(naked)]
pub unsafe extern "C" fn dlsym(handle: *mut c_void, name: *const c_char) -> *mut c_void {
    core::arch::naked_asm!(
        // RTLD_DEFAULT (0) and RTLD_NEXT (-1) go to libc as they came.
        "test rdi, rdi",
        "jz 2f",
        "cmp rdi, -1",
        "je 2f",
        "jmp {lookup}",
        "2:",
        "mov rax, qword ptr [rip + {real}]",
        "test rax, rax",
        "jz 3f",
        "jmp rax",
        // Not resolved yet: resolve, keeping the arguments and the stack's alignment.
        "3:",
        "push rdi",
        "push rsi",
        "sub rsp, 8",
        "call {resolve}",
        "add rsp, 8",
        "pop rsi",
        "pop rdi",
        "jmp rax",
        lookup = sym lookup,
        real = sym real::REAL_DLSYM,
        resolve = sym real::resolve_dlsym,
    )
}

/// A lookup through a real handle: libc's answer, or the shim's own function where libc
/// found libibverbs' version of one the shim interposes.
///
/// # Safety
/// As libc's `dlsym`.
unsafe extern "C" fn lookup(handle: *mut c_void, name: *const c_char) -> *mut c_void {
    let real = real::libc_dlsym();
    // SAFETY: the caller's arguments.
    let found = unsafe { real(handle, name) };
    if found.is_null() || name.is_null() {
        return found;
    }
    // SAFETY: a NUL-terminated name (libc has just read it).
    let name = unsafe { CStr::from_ptr(name) };
    catch_unwind(|| substitute(real, handle, name, found as usize))
        .ok()
        .flatten()
        .map_or(found, |ours| ours as *mut c_void)
}

/// The shim's function for `name` when `found` is libibverbs' version of it.
fn substitute(real: DlsymFn, handle: *mut c_void, name: &CStr, found: usize) -> Option<usize> {
    if !name.to_bytes().starts_with(b"ibv_") && name != c"mlx5dv_init_obj" {
        return None;
    }
    let table = interposed();
    let (_, ours, cache) = table.iter().find(|(n, ..)| *n == name)?;
    if found == *ours {
        return None;
    }
    if cache.load(Acquire) == 0 {
        learn(real, handle, &table);
    }
    (cache.load(Acquire) == found).then_some(*ours)
}

/// Records where `handle` has libibverbs' functions, for those the shim has not found yet
/// (in the version the shim's own resolution prefers).
fn learn(real: DlsymFn, handle: *mut c_void, table: &[Interposed]) {
    for (name, _, cache) in table {
        // SAFETY: a handle the application just used, and libc's dlsym (ours would come
        // back here).
        let p = unsafe { crate::real::versioned(handle, name, real) };
        let _ = cache.compare_exchange(0, p, Release, Acquire);
    }
}

/// A function of libibverbs (or of libmlx5, for direct verbs) that the shim exports: its
/// name, the shim's own, where the shim keeps the library's version.
type Interposed = (&'static CStr, usize, &'static AtomicUsize);

fn interposed() -> [Interposed; 17] {
    use crate as s;
    fn entry<F: Copy>(real: &'static RealFn<F>, ours: *const ()) -> Interposed {
        (real.name(), ours as usize, real.cache())
    }
    [
        entry(&real::OPEN_DEVICE, s::ibv_open_device as *const ()),
        entry(&real::CLOSE_DEVICE, s::ibv_close_device as *const ()),
        entry(&real::CREATE_QP, qp_verbs::ibv_create_qp as *const ()),
        entry(&real::MODIFY_QP, qp_verbs::ibv_modify_qp as *const ()),
        entry(&real::DESTROY_QP, qp_verbs::ibv_destroy_qp as *const ()),
        entry(&real::QUERY_QP, qp_verbs::ibv_query_qp as *const ()),
        entry(&real::QP_TO_QP_EX, extended::ibv_qp_to_qp_ex as *const ()),
        entry(&real::CREATE_CQ, s::ibv_create_cq as *const ()),
        entry(&real::DESTROY_CQ, s::ibv_destroy_cq as *const ()),
        entry(&real::RESIZE_CQ, s::ibv_resize_cq as *const ()),
        entry(
            &real::CREATE_CHANNEL,
            s::ibv_create_comp_channel as *const (),
        ),
        entry(
            &real::DESTROY_CHANNEL,
            s::ibv_destroy_comp_channel as *const (),
        ),
        entry(&real::GET_CQ_EVENT, s::ibv_get_cq_event as *const ()),
        entry(&real::ACK_CQ_EVENTS, s::ibv_ack_cq_events as *const ()),
        entry(&real::GET_ASYNC_EVENT, s::ibv_get_async_event as *const ()),
        entry(&real::ACK_ASYNC_EVENT, s::ibv_ack_async_event as *const ()),
        entry(
            &real::MLX5DV_INIT_OBJ,
            crate::direct::mlx5dv_init_obj as *const (),
        ),
    ]
}
