//! Device memory (`ibv_alloc_dm`). The bytes live in the process, in an anonymous mapping the
//! program never sees (as a NIC's memory is reached only through the verbs); the engine counts
//! them against the host's device memory, which its processes share. Programs copy in and
//! out with `ibv_memcpy_to_dm`/`ibv_memcpy_from_dm` and register ranges with `ibv_reg_dm_mr`,
//! zero-based as the kernel requires, which work requests and peers then use like any MR.

use super::*;
use std::sync::atomic::AtomicU32;

/// Access flags `ibv_reg_dm_mr` takes (mlx5's set): local and remote read/write, atomics,
/// zero-based.
const DM_MR_ACCESS: u32 = IBV_ACCESS_LOCAL_WRITE
    | IBV_ACCESS_REMOTE_WRITE
    | IBV_ACCESS_REMOTE_READ
    | IBV_ACCESS_REMOTE_ATOMIC
    | IBV_ACCESS_ZERO_BASED;
/// The mapping is page-aligned: alignment requests up to a page are met.
const MAX_LOG_ALIGN: u32 = 12;

/// `struct ibv_dm` first (all that libibverbs and the program see), then the mapping.
#[repr(C)]
pub(super) struct SrDm {
    dm: IbvDm,
    mem: *mut u8,
    len: usize,
    /// MRs registered on it: it cannot be freed before them (`EBUSY`, as the kernel's
    /// reference from the MR).
    mrs: AtomicU32,
}

pub(super) unsafe extern "C" fn alloc_dm(
    ctx: *mut IbvContext,
    attr: *mut IbvAllocDmAttr,
) -> *mut IbvDm {
    guard(null_mut(), || {
        // SAFETY: the caller passes a valid attribute struct; ctx is ours.
        let (a, st) = unsafe { (&*attr, state(ctx)) };
        if a.comp_mask != 0 || a.log_align_req > MAX_LOG_ALIGN {
            set_errno(libc::EINVAL);
            return null_mut();
        }
        let Some(handle) = call_for_handle(
            st,
            &Req::AllocDm {
                len: a.length as u64,
            },
        ) else {
            return null_mut();
        };
        // SAFETY: a fresh anonymous mapping; nothing else refers to it.
        let mem = unsafe {
            libc::mmap(
                null_mut(),
                a.length,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if mem == libc::MAP_FAILED {
            let _ = st.call(&Req::FreeDm { handle });
            set_errno(libc::ENOMEM);
            return null_mut();
        }
        let dm = Box::new(SrDm {
            dm: IbvDm {
                context: ctx,
                memcpy_to_dm,
                memcpy_from_dm,
                comp_mask: 0,
                handle,
            },
            mem: mem as *mut u8,
            len: a.length,
            mrs: AtomicU32::new(0),
        });
        Box::into_raw(dm) as *mut IbvDm
    })
}

pub(super) unsafe extern "C" fn free_dm(dm: *mut IbvDm) -> c_int {
    guard(libc::EIO, || {
        let d = dm as *mut SrDm;
        // SAFETY: dm was made by alloc_dm; its context is ours.
        let (st, handle, busy) = unsafe {
            (
                state((*dm).context),
                (*dm).handle,
                (*d).mrs.load(Ordering::Acquire) != 0,
            )
        };
        if busy {
            return libc::EBUSY;
        }
        if let Err(e) = st.call(&Req::FreeDm { handle }) {
            return e;
        }
        // SAFETY: made by alloc_dm (a Box and a mapping of len bytes); the caller is done
        // with it, and no MR refers to it.
        unsafe {
            libc::munmap((*d).mem as *mut c_void, (*d).len);
            drop(Box::from_raw(d));
        }
        0
    })
}

/// The mapping's `[offset, offset + len)`, if the DM holds it all.
///
/// # Safety
/// `dm` was made by alloc_dm and is not freed yet.
unsafe fn range(dm: *mut IbvDm, offset: u64, len: usize) -> Option<*mut u8> {
    let d = dm as *const SrDm;
    let end = offset.checked_add(len as u64)?;
    // SAFETY: dm was made by alloc_dm.
    unsafe { (end <= (*d).len as u64).then(|| (*d).mem.add(offset as usize)) }
}

/// Where a copy to or from the DM goes: `EFAULT` past its end, then `EINVAL` unless offset
/// and length are multiples of 4 — mlx5's order; its device memory is reached in 4-byte words.
///
/// # Safety
/// As [`range`].
unsafe fn copy_range(dm: *mut IbvDm, offset: u64, len: usize) -> Result<*mut u8, c_int> {
    // SAFETY: dm is ours.
    let p = unsafe { range(dm, offset, len) }.ok_or(libc::EFAULT)?;
    if offset % 4 != 0 || len % 4 != 0 {
        return Err(libc::EINVAL);
    }
    Ok(p)
}

unsafe extern "C" fn memcpy_to_dm(
    dm: *mut IbvDm,
    offset: u64,
    host: *const c_void,
    len: usize,
) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: dm is ours; the caller provides len readable bytes at host.
        match unsafe { copy_range(dm, offset, len) } {
            Ok(p) => {
                // SAFETY: p starts len bytes inside the DM's mapping (checked by copy_range);
                // host has len readable bytes (ibv_memcpy_to_dm's contract).
                unsafe { std::ptr::copy(host as *const u8, p, len) };
                0
            }
            Err(e) => e,
        }
    })
}

unsafe extern "C" fn memcpy_from_dm(
    host: *mut c_void,
    dm: *mut IbvDm,
    offset: u64,
    len: usize,
) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: dm is ours; the caller provides len writable bytes at host.
        match unsafe { copy_range(dm, offset, len) } {
            Ok(p) => {
                // SAFETY: p starts len bytes inside the DM's mapping (checked by copy_range);
                // host has len writable bytes (ibv_memcpy_from_dm's contract).
                unsafe { std::ptr::copy(p, host as *mut u8, len) };
                0
            }
            Err(e) => e,
        }
    })
}

/// `ibv_reg_dm_mr`: `[offset, offset + len)` of the DM as an MR whose work requests and peers
/// address it from 0.
pub(super) unsafe extern "C" fn reg_dm_mr(
    pd: *mut IbvPd,
    dm: *mut IbvDm,
    offset: u64,
    len: usize,
    access: u32,
) -> *mut IbvMr {
    guard(null_mut(), || {
        // SAFETY: dm is ours.
        let start = unsafe { range(dm, offset, len) };
        let Some(start) =
            start.filter(|_| access & IBV_ACCESS_ZERO_BASED != 0 && access & !DM_MR_ACCESS == 0)
        else {
            set_errno(libc::EINVAL);
            return null_mut();
        };
        let mr = new_mr(
            pd,
            Req::RegMrIova {
                // SAFETY: pd is ours.
                pd: unsafe { (*pd).handle },
                addr: start as u64,
                len: len as u64,
                iova: 0,
                access: access & !IBV_ACCESS_ZERO_BASED,
            },
            null_mut(),
            len,
            access as c_int,
            dm as *mut SrDm,
        );
        if !mr.is_null() {
            // SAFETY: dm is ours.
            unsafe { (*(dm as *mut SrDm)).mrs.fetch_add(1, Ordering::AcqRel) };
        }
        mr
    })
}

/// An MR on a DM is deregistered: the DM may go once its last MR has.
///
/// # Safety
/// `dm` is null or the DM (made by alloc_dm) of the MR being deregistered.
pub(super) unsafe fn mr_gone(dm: *mut SrDm) {
    if !dm.is_null() {
        // SAFETY: the DM outlives its MRs (free_dm refuses while any is registered).
        unsafe { (*dm).mrs.fetch_sub(1, Ordering::AcqRel) };
    }
}
