//! The real functions the shim wraps, as one typed table: each entry names its symbol once,
//! with its C type, and is resolved once (the version applications link, see
//! [`resolve`]). A caller gets a typed function pointer or `None`, never an address to
//! convert; the exported `dlsym` (`dl.rs`) fills the same entries from a program's handle.
//! Also here: how a symbol is found ([`resolve`]).

use crate::ffi::*;
use crate::trouble::{warn_once, Trouble};
use libc::c_void;
use std::ffi::CStr;
use std::marker::PhantomData;
use std::panic::catch_unwind;
use std::sync::atomic::{AtomicUsize, Ordering::Acquire, Ordering::Release};

/// The real function `name` of C type `F`, resolved on first use.
pub(crate) struct RealFn<F> {
    name: &'static CStr,
    addr: AtomicUsize,
    _type: PhantomData<F>,
}

impl<F: Copy> RealFn<F> {
    /// `F` is the C type of `name`, a function pointer (its size is checked when the table
    /// is compiled).
    const fn new(name: &'static CStr) -> Self {
        assert!(
            std::mem::size_of::<F>() == std::mem::size_of::<usize>(),
            "a real function's type must be a function pointer"
        );
        RealFn {
            name,
            addr: AtomicUsize::new(0),
            _type: PhantomData,
        }
    }

    pub(crate) fn name(&self) -> &'static CStr {
        self.name
    }

    /// Where its address is kept once known (0 until then).
    pub(crate) fn cache(&self) -> &AtomicUsize {
        &self.addr
    }

    /// The real function, or `None`, reported once per process.
    pub(crate) fn get(&self) -> Option<F> {
        let f = self.optional();
        if f.is_none() {
            warn_once(
                Trouble::NoRealSymbol,
                &format!("libibverbs' {} not found", self.name.to_string_lossy()),
            );
        }
        f
    }

    /// The real function, or `None` without a word: for a caller that explains the absence
    /// itself, or a library the program may not load at all (libmlx5).
    pub(crate) fn optional(&self) -> Option<F> {
        let (name, addr) = (self.name, &self.addr);
        let p = catch_unwind(|| resolve(name, addr)).unwrap_or(0);
        // SAFETY: `F` is pointer-sized (checked in `new`) and the C type of the symbol the
        // entry names (the table below), whose address `p` is.
        (p != 0).then(|| unsafe { std::mem::transmute_copy::<usize, F>(&p) })
    }
}

/// Resolves the real libibverbs function `name` once and caches its address.
fn resolve(name: &CStr, cache: &AtomicUsize) -> usize {
    let c = cache.load(Acquire);
    if c != 0 {
        return c;
    }
    // SAFETY: RTLD_NEXT searches the objects loaded after this one (libibverbs), so it
    // never returns our own export.
    let mut p = unsafe { versioned(libc::RTLD_NEXT, name, libc::dlsym) };
    if p == 0 {
        p = libibverbs_handle().map_or(0, |h| {
            // SAFETY: a live handle of libibverbs (never closed), and libc's dlsym: the
            // shim's own would hand back the shim's function for this very name.
            unsafe { versioned(h as *mut c_void, name, libc_dlsym()) }
        });
    }
    if p != 0 {
        cache.store(p, Release);
    }
    p
}

/// libibverbs, wherever it was loaded. `RTLD_NEXT` sees only the global scope, and a library
/// loaded with `RTLD_LOCAL` (a Python extension such as pyverbs, a UCX transport, an MPI
/// component) brings libibverbs outside it, while its calls still reach the shim's exports.
/// Such a program runs as any other, governed: the library already loaded is found by name;
/// failing that (the program calls a verb of a libibverbs the shim cannot see), the shim
/// loads it itself, privately, rather than fail the verb. The handle is kept for the
/// process's life, so the functions resolved from it stay valid.
fn libibverbs_handle() -> Option<usize> {
    static HANDLE: AtomicUsize = AtomicUsize::new(0);
    let h = HANDLE.load(Acquire);
    if h != 0 {
        return Some(h);
    }
    let soname = c"libibverbs.so.1";
    // SAFETY: dlopen with a NUL-terminated name; RTLD_NOLOAD only looks.
    let mut h = unsafe { libc::dlopen(soname.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD) };
    if h.is_null() {
        // SAFETY: as above; loads it privately (its scope is its own).
        h = unsafe { libc::dlopen(soname.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    }
    if h.is_null() {
        return None;
    }
    // A second thread's handle is the same object; its extra reference is harmless.
    HANDLE.store(h as usize, Release);
    Some(h as usize)
}

/// The real `dlsym` (libc's), found on first use (the exported `dlsym`, `dl.rs`, jumps to it).
#[cfg(target_arch = "x86_64")]
pub(crate) static REAL_DLSYM: AtomicUsize = AtomicUsize::new(0);

/// Finds libc's `dlsym` (the versions of glibc ≥ 2.34, then older ones).
#[cfg(target_arch = "x86_64")]
pub(crate) extern "C" fn resolve_dlsym() -> usize {
    let p = REAL_DLSYM.load(Acquire);
    if p != 0 {
        return p;
    }
    let p = [c"GLIBC_2.34", c"GLIBC_2.2.5"]
        .iter()
        // SAFETY: dlvsym with NUL-terminated strings; RTLD_NEXT from the shim is libc.
        .map(|v| unsafe { libc::dlvsym(libc::RTLD_NEXT, c"dlsym".as_ptr(), v.as_ptr()) })
        .find(|p| !p.is_null())
        .map_or(0, |p| p as usize);
    if p == 0 {
        crate::trouble::write_stderr("drum-shim: libc's dlsym not found; cannot continue\n");
        std::process::abort();
    }
    REAL_DLSYM.store(p, Release);
    p
}

/// libc's `dlsym`, never the shim's export (which substitutes the shim's functions).
pub(crate) fn libc_dlsym() -> DlsymFn {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the address of libc's dlsym, which has this signature.
    return unsafe { std::mem::transmute::<usize, DlsymFn>(resolve_dlsym()) };
    #[cfg(not(target_arch = "x86_64"))]
    return libc::dlsym;
}

pub(crate) type DlsymFn = unsafe extern "C" fn(*mut c_void, *const libc::c_char) -> *mut c_void;

/// `name` in `handle`: the version applications link (`IBVERBS_1.1`), else the default one
/// (the completion-channel functions exist only as `IBVERBS_1.0`) found with `dlsym`.
///
/// # Safety
/// `handle` is `RTLD_NEXT`, `RTLD_DEFAULT` or a live handle; `dlsym` is libc's or ours.
pub(crate) unsafe fn versioned(handle: *mut c_void, name: &CStr, dlsym: DlsymFn) -> usize {
    // SAFETY: per the contract; NUL-terminated names, thread-safe calls.
    unsafe {
        let p = libc::dlvsym(handle, name.as_ptr(), c"IBVERBS_1.1".as_ptr());
        if p.is_null() {
            dlsym(handle, name.as_ptr()) as usize
        } else {
            p as usize
        }
    }
}

pub(crate) static OPEN_DEVICE: RealFn<OpenFn> = RealFn::new(c"ibv_open_device");
pub(crate) static CLOSE_DEVICE: RealFn<CloseFn> = RealFn::new(c"ibv_close_device");
pub(crate) static CREATE_QP: RealFn<CreateQpFn> = RealFn::new(c"ibv_create_qp");
pub(crate) static MODIFY_QP: RealFn<ModifyQpFn> = RealFn::new(c"ibv_modify_qp");
pub(crate) static DESTROY_QP: RealFn<DestroyQpFn> = RealFn::new(c"ibv_destroy_qp");
pub(crate) static QUERY_QP: RealFn<QueryQpFn> = RealFn::new(c"ibv_query_qp");
pub(crate) static QP_TO_QP_EX: RealFn<QpToQpExFn> = RealFn::new(c"ibv_qp_to_qp_ex");
pub(crate) static CREATE_CQ: RealFn<CreateCqFn> = RealFn::new(c"ibv_create_cq");
pub(crate) static DESTROY_CQ: RealFn<DestroyCqFn> = RealFn::new(c"ibv_destroy_cq");
pub(crate) static RESIZE_CQ: RealFn<ResizeCqFn> = RealFn::new(c"ibv_resize_cq");
pub(crate) static CREATE_CHANNEL: RealFn<CreateChannelFn> = RealFn::new(c"ibv_create_comp_channel");
pub(crate) static DESTROY_CHANNEL: RealFn<DestroyChannelFn> =
    RealFn::new(c"ibv_destroy_comp_channel");
pub(crate) static GET_CQ_EVENT: RealFn<GetCqEventFn> = RealFn::new(c"ibv_get_cq_event");
pub(crate) static ACK_CQ_EVENTS: RealFn<AckCqEventsFn> = RealFn::new(c"ibv_ack_cq_events");
pub(crate) static GET_ASYNC_EVENT: RealFn<GetAsyncEventFn> = RealFn::new(c"ibv_get_async_event");
pub(crate) static ACK_ASYNC_EVENT: RealFn<AckAsyncEventFn> = RealFn::new(c"ibv_ack_async_event");
/// libmlx5's, for direct verbs (`direct.rs`).
pub(crate) static MLX5DV_INIT_OBJ: RealFn<InitObjFn> = RealFn::new(c"mlx5dv_init_obj");
