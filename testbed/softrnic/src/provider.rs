//! The libibverbs provider (`libsoftrnic-rdmav34.so`).
//!
//! libibverbs dlopens this library (through `RDMAV_DRIVERS`); its ELF constructor registers a
//! `verbs_device_ops` with `verbs_register_driver_34`. Every verb is forwarded to the host's
//! NIC engine over a Unix socket whose path the generated sysfs tree carries
//! (`<ibdev_path>/softrnic_engine_socket`). No panic unwinds into C: every entry point runs in
//! `catch_unwind` and turns a panic into an error return.

use std::collections::HashMap;
use std::ffi::{CStr, CString};
use std::mem::{offset_of, size_of};
use std::os::fd::IntoRawFd;
use std::os::unix::net::UnixStream;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr::{null, null_mut};
use std::sync::{Mutex, OnceLock};

use libc::{c_char, c_int, c_void};

use crate::device;
use crate::ffi::consts::*;
use crate::ffi::*;
use crate::proto::{self, Caps, QpAttrs, RecvWr, Req, Resp, SendWr, Sge};
use crate::ring::{self, Doorbell, Map, QpLayout, Ring};
use std::sync::atomic::Ordering;

mod cq_ex;
mod qp_ex;
mod xrc;

/// rdma-core's provider ABI version this provider is written for.
pub const PABI_VERSION: &CStr = c"IBVERBS_PRIVATE_34";

type InitAndAllocFn =
    unsafe extern "C" fn(*mut IbvDevice, c_int, usize, *mut VerbsContext, u32) -> *mut c_void;
type UninitFn = unsafe extern "C" fn(*mut VerbsContext);
type SetOpsFn = unsafe extern "C" fn(*mut VerbsContext, *const VerbsContextOps);
type RegisterFn = unsafe extern "C" fn(*const VerbsDeviceOps);

struct LibFns {
    init_and_alloc: InitAndAllocFn,
    uninit: UninitFn,
    set_ops: SetOpsFn,
}

static LIB: OnceLock<LibFns> = OnceLock::new();

struct SyncOps(VerbsDeviceOps);
// SAFETY: the ops table is immutable after construction and only holds pointers to static data
// and functions, so sharing it between threads is sound.
unsafe impl Sync for SyncOps {}

static DEVICE_OPS: SyncOps = SyncOps(VerbsDeviceOps {
    name: c"softrnic".as_ptr(),
    match_min_abi_version: device::UVERBS_ABI,
    match_max_abi_version: device::UVERBS_ABI,
    match_table: null(),
    static_providers: null(),
    match_device: Some(match_device),
    alloc_context: Some(alloc_context),
    import_context: null(),
    alloc_device: Some(alloc_device),
    uninit_device: Some(uninit_device),
});

struct SyncCtxOps(VerbsContextOps);
// SAFETY: immutable table of function pointers.
unsafe impl Sync for SyncCtxOps {}
// SAFETY: see above; the table is only read.
unsafe impl Send for SyncCtxOps {}

static CTX_OPS: OnceLock<SyncCtxOps> = OnceLock::new();

fn ctx_ops() -> &'static VerbsContextOps {
    &CTX_OPS
        .get_or_init(|| {
            let mut t = VerbsContextOps { ops: [null(); 76] };
            let mut set = |name: &str, f: *const c_void| t.ops[VerbsContextOps::index(name)] = f;
            set("query_device_ex", query_device_ex as *const c_void);
            set("query_port", query_port as *const c_void);
            set("alloc_pd", alloc_pd as *const c_void);
            set("dealloc_pd", dealloc_pd as *const c_void);
            set("reg_mr", reg_mr as *const c_void);
            set("dereg_mr", dereg_mr as *const c_void);
            set("create_cq", create_cq as *const c_void);
            set("destroy_cq", destroy_cq as *const c_void);
            set("poll_cq", poll_cq as *const c_void);
            set("req_notify_cq", req_notify_cq as *const c_void);
            set("create_qp", create_qp as *const c_void);
            set("create_qp_ex", qp_ex::create_qp_ex as *const c_void);
            set("create_cq_ex", cq_ex::create_cq_ex as *const c_void);
            set("modify_qp", modify_qp as *const c_void);
            set("query_qp", query_qp as *const c_void);
            set("destroy_qp", destroy_qp as *const c_void);
            set("post_send", post_send as *const c_void);
            set("post_recv", post_recv as *const c_void);
            set("create_ah", create_ah as *const c_void);
            set("destroy_ah", destroy_ah as *const c_void);
            set("create_srq", create_srq as *const c_void);
            set("modify_srq", modify_srq as *const c_void);
            set("query_srq", query_srq as *const c_void);
            set("destroy_srq", destroy_srq as *const c_void);
            set("post_srq_recv", post_srq_recv as *const c_void);
            set("open_xrcd", xrc::open_xrcd as *const c_void);
            set("close_xrcd", xrc::close_xrcd as *const c_void);
            set("create_srq_ex", xrc::create_srq_ex as *const c_void);
            set("get_srq_num", xrc::get_srq_num as *const c_void);
            set("alloc_mw", alloc_mw as *const c_void);
            set("dealloc_mw", dealloc_mw as *const c_void);
            set("bind_mw", bind_mw as *const c_void);
            set("free_context", free_context as *const c_void);
            set("async_event", async_event as *const c_void);
            SyncCtxOps(t)
        })
        .0
}

/// ELF constructor: runs when libibverbs dlopens the provider.
#[used]
#[link_section = ".init_array"]
static REGISTER: extern "C" fn() = register;

extern "C" fn register() {
    let _ = catch_unwind(|| {
        // SAFETY: dlopen with RTLD_NOLOAD only returns a handle if libibverbs is already loaded
        // in this process (it is, when it is the one loading us); the names are NUL-terminated.
        let h = unsafe {
            libc::dlopen(
                c"libibverbs.so.1".as_ptr(),
                libc::RTLD_NOW | libc::RTLD_NOLOAD,
            )
        };
        if h.is_null() {
            return; // not loaded by libibverbs (e.g. linked into the softrnic command)
        }
        let sym = |name: &CStr| {
            // SAFETY: h is a valid handle; name and version are NUL-terminated strings.
            unsafe { libc::dlvsym(h, name.as_ptr(), PABI_VERSION.as_ptr()) }
        };
        let reg = sym(c"verbs_register_driver_34");
        let init = sym(c"_verbs_init_and_alloc_context");
        let uninit = sym(c"verbs_uninit_context");
        let set_ops = sym(c"verbs_set_ops");
        if reg.is_null() || init.is_null() || uninit.is_null() || set_ops.is_null() {
            eprintln!(
                "softrnic: this libibverbs does not export the {} provider ABI; device disabled",
                PABI_VERSION.to_string_lossy()
            );
            return;
        }
        // SAFETY: the symbols were found with the exact private ABI version whose prototypes
        // the type aliases above declare (rdma-core 44's driver.h).
        unsafe {
            let _ = LIB.set(LibFns {
                init_and_alloc: std::mem::transmute::<*mut c_void, InitAndAllocFn>(init),
                uninit: std::mem::transmute::<*mut c_void, UninitFn>(uninit),
                set_ops: std::mem::transmute::<*mut c_void, SetOpsFn>(set_ops),
            });
            let reg = std::mem::transmute::<*mut c_void, RegisterFn>(reg);
            reg(&DEVICE_OPS.0);
        }
    });
}

fn set_errno(e: c_int) {
    // SAFETY: __errno_location always returns the valid thread-local errno slot.
    unsafe { *libc::__errno_location() = e };
}

/// Run `f`, turning a panic into `on_panic` (never unwind into C).
fn guard<R>(on_panic: R, f: impl FnOnce() -> R) -> R {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or(on_panic)
}

// ---------------------------------------------------------------------------------------------
// Device
// ---------------------------------------------------------------------------------------------

#[repr(C)]
struct SrDevice {
    vdev: VerbsDevice,
    engine_socket: CString,
    guid: u64,
    /// Active MTU of the port (`IBV_MTU_*`), from the NIC model's settings.
    active_mtu: i32,
    /// The port's sysfs `state` file (`softrnic link` changes it).
    port_state: std::path::PathBuf,
}

fn cstr_field(b: &[c_char]) -> String {
    let bytes: Vec<u8> = b
        .iter()
        .take_while(|c| **c != 0)
        .map(|c| *c as u8)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

unsafe extern "C" fn match_device(sysfs: *mut VerbsSysfsDev) -> bool {
    guard(false, || {
        // SAFETY: libibverbs passes a valid, initialised sysfs device.
        let s = unsafe { &*sysfs };
        cstr_field(&s.ibdev_name).starts_with("softrnic")
    })
}

unsafe extern "C" fn alloc_device(sysfs: *mut VerbsSysfsDev) -> *mut VerbsDevice {
    guard(null_mut(), || {
        // SAFETY: libibverbs passes a valid, initialised sysfs device.
        let s = unsafe { &*sysfs };
        let path = cstr_field(&s.ibdev_path);
        let sock = match std::fs::read_to_string(format!("{path}/softrnic_engine_socket")) {
            Ok(v) => v.trim().to_string(),
            Err(e) => {
                eprintln!("softrnic: {path}: no engine socket: {e}");
                return null_mut();
            }
        };
        let guid = std::fs::read_to_string(format!("{path}/node_guid"))
            .ok()
            .and_then(|g| u64::from_str_radix(&g.trim().replace(':', ""), 16).ok())
            .unwrap_or(0);
        let active_mtu = std::fs::read_to_string(format!("{path}/softrnic_mtu"))
            .ok()
            .and_then(|m| crate::nic::mtu_enum(m.trim().parse().ok()?))
            .unwrap_or(IBV_MTU_4096);
        let Ok(engine_socket) = CString::new(sock) else {
            return null_mut();
        };
        let dev = Box::new(SrDevice {
            // SAFETY: VerbsDevice is plain C data (integers, arrays, raw pointers) for which
            // all-zero is the state libibverbs expects from a fresh allocation.
            vdev: unsafe { std::mem::zeroed() },
            engine_socket,
            guid,
            active_mtu,
            port_state: format!("{path}/ports/1/state").into(),
        });
        Box::into_raw(dev) as *mut VerbsDevice
    })
}

unsafe extern "C" fn uninit_device(vdev: *mut VerbsDevice) {
    guard((), || {
        // SAFETY: vdev was created by alloc_device as the first field of a boxed SrDevice.
        drop(unsafe { Box::from_raw(vdev as *mut SrDevice) });
    })
}

// ---------------------------------------------------------------------------------------------
// Context
// ---------------------------------------------------------------------------------------------

struct CtxState {
    conn: Mutex<UnixStream>,
    guid: u64,
    socket: String,
    /// The engine's doorbell (None: the engine offers none; the socket path is used).
    db: Option<Doorbell>,
}

/// A CQ: libibverbs' `ibv_cq` first, then the completion ring (if the engine mapped it).
#[repr(C)]
struct SrCq {
    cq: IbvCq,
    /// The `ibv_cq_ex` part (filled for CQs from `create_cq_ex`).
    ex: CqExTail,
    /// The completion `ibv_start_poll`/`ibv_next_poll` took last, and its timestamp.
    cur: Mutex<(IbvWc, u64)>,
    ring: Option<(Map, Ring)>,
    poll: Mutex<()>,
    /// Empty polls in a row, and when (coarse monotonic ms) the engine was last checked.
    empty: std::sync::atomic::AtomicU32,
    checked_ms: std::sync::atomic::AtomicU64,
}

/// CLOCK_MONOTONIC_COARSE in milliseconds (a vDSO read, no system call).
fn coarse_ms() -> u64 {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: t is a valid out-parameter.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC_COARSE, &mut t) };
    t.tv_sec as u64 * 1000 + t.tv_nsec as u64 / 1_000_000
}

/// A QP: libibverbs' `verbs_qp` first, then its rings (if the engine mapped them).
#[repr(C)]
struct SrQp {
    vqp: VerbsQp,
    rings: Option<ProvQpRings>,
    /// The `ibv_wr_*` batch being built (QPs from `create_qp_ex` with send ops).
    batch: Mutex<qp_ex::Batch>,
}

struct ProvQpRings {
    map: Map,
    sq: Ring,
    rq: Ring,
    cap: Caps,
    post_send: Mutex<()>,
    post_recv: Mutex<()>,
}

/// Create a memfd of `len` bytes, have the engine map it as ring(s) of object `handle`.
fn share_ring(st: &CtxState, kind: u8, handle: u32, len: usize) -> Option<Map> {
    st.db.as_ref()?;
    let (map, fd) = Map::create("softrnic-ring", len).ok()?;
    let r = st.call(&Req::AttachRing {
        kind,
        handle,
        fd,
        len: len as u64,
    });
    // SAFETY: fd is ours; the engine has its own mapping now (or refused).
    unsafe { libc::close(fd) };
    r.ok().map(|_| map)
}

/// Contexts made by this provider (`ibv_context *`), so that the interposed
/// `ibv_create_comp_channel` knows which ones are softrnic's.
static CONTEXTS: Mutex<Vec<usize>> = Mutex::new(Vec::new());
/// Completion channels made by `ibv_create_comp_channel` below: `ibv_comp_channel *` → id.
static CHANNELS: Mutex<Option<HashMap<usize, u32>>> = Mutex::new(None);

fn is_our_context(ctx: *mut IbvContext) -> bool {
    CONTEXTS
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .contains(&(ctx as usize))
}

fn channel_id(ch: *mut c_void) -> Option<u32> {
    CHANNELS
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .as_ref()?
        .get(&(ch as usize))
        .copied()
}

type CreateCompChannelFn = unsafe extern "C" fn(*mut IbvContext) -> *mut IbvCompChannel;

/// libibverbs' own `ibv_create_comp_channel` (a kernel command), for other devices.
fn real_create_comp_channel() -> Option<CreateCompChannelFn> {
    // SAFETY: RTLD_NOLOAD only finds an already loaded libibverbs; names are NUL-terminated.
    unsafe {
        let h = libc::dlopen(
            c"libibverbs.so.1".as_ptr(),
            libc::RTLD_NOW | libc::RTLD_NOLOAD,
        );
        if h.is_null() {
            return None;
        }
        let f = libc::dlvsym(
            h,
            c"ibv_create_comp_channel".as_ptr(),
            c"IBVERBS_1.0".as_ptr(),
        );
        (!f.is_null()).then(|| std::mem::transmute::<*mut c_void, CreateCompChannelFn>(f))
    }
}

/// Interposes libibverbs' `ibv_create_comp_channel` (`softrnic exec` preloads this library).
///
/// The kernel's version sends CREATE_COMP_CHANNEL on the uverbs fd and gets back a file
/// descriptor that yields 8-byte `cq_handle` records; libibverbs' `ibv_get_cq_event` reads
/// them, `ibv_destroy_comp_channel` closes the fd. For a softrnic context the fd is instead a
/// second connection to the host's engine, which writes the same records (the CQ's
/// `ibv_cq *`) when an armed CQ gets a completion. Other contexts go to libibverbs.
///
/// # Safety
/// `context` must be a context returned by `ibv_open_device`.
#[no_mangle]
pub unsafe extern "C" fn ibv_create_comp_channel(context: *mut IbvContext) -> *mut IbvCompChannel {
    guard(null_mut(), || {
        if !is_our_context(context) {
            return match real_create_comp_channel() {
                // SAFETY: libibverbs' own function, called with the caller's argument.
                Some(f) => unsafe { f(context) },
                None => {
                    set_errno(libc::ENOSYS);
                    null_mut()
                }
            };
        }
        // SAFETY: context is ours (checked above).
        let st = unsafe { state(context) };
        let (id, token) = match st.call(&Req::CreateChannel) {
            Ok(Resp::Channel { id, token }) => (id, token),
            Ok(_) => {
                set_errno(libc::EIO);
                return null_mut();
            }
            Err(e) => {
                set_errno(e);
                return null_mut();
            }
        };
        let s = match attach_stream(&st.socket, id, token) {
            Ok(s) => s,
            Err(e) => {
                set_errno(e);
                return null_mut();
            }
        };
        // SAFETY: malloc'ed because ibv_destroy_comp_channel free()s it.
        let ch = unsafe { libc::malloc(size_of::<IbvCompChannel>()) } as *mut IbvCompChannel;
        if ch.is_null() {
            set_errno(libc::ENOMEM);
            return null_mut();
        }
        // SAFETY: ch points to enough writable memory for an IbvCompChannel.
        unsafe {
            ch.write(IbvCompChannel {
                context,
                fd: s.into_raw_fd(),
                refcnt: 0,
            })
        };
        CHANNELS
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_or_insert_with(HashMap::new)
            .insert(ch as usize, id);
        ch
    })
}

/// Open the event stream of channel `id` (a completion channel or the async event stream): a
/// second connection to the engine whose first and only request is `AttachChannel`.
fn attach_stream(socket: &str, id: u32, token: u64) -> Result<UnixStream, c_int> {
    let mut s = UnixStream::connect(socket).map_err(|_| libc::ENODEV)?;
    let req = Req::AttachChannel { id, token };
    proto::write_frame(&mut s, &req.encode()).map_err(|_| libc::EIO)?;
    let body = proto::read_frame(&mut s).map_err(|_| libc::EIO)?;
    match Resp::decode(&req, &body) {
        Ok(Resp::Unit) => Ok(s),
        Ok(Resp::Err { errno, .. }) => Err(errno),
        _ => Err(libc::EIO),
    }
}

impl CtxState {
    /// Whether the engine's end of the context's socket is still open (a vanished engine
    /// would otherwise leave a program polling an empty ring forever).
    fn engine_alive(&self) -> bool {
        use std::os::fd::AsRawFd;
        let c = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        let mut p = libc::pollfd {
            fd: c.as_raw_fd(),
            events: libc::POLLRDHUP,
            revents: 0,
        };
        // SAFETY: one valid pollfd, no timeout.
        let n = unsafe { libc::poll(&mut p, 1, 0) };
        let dead = n > 0 && p.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0;
        if dead {
            eprintln!("softrnic: lost the NIC engine (poll_cq fails)");
        }
        !dead
    }

    /// One request/response exchange with the engine. Err(errno).
    fn call(&self, req: &Req) -> Result<Resp, c_int> {
        let mut c = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        let res: Result<Resp, proto::WireError> = (|| {
            proto::write_frame(&mut *c, &req.encode())?;
            let body = proto::read_frame(&mut *c)?;
            Resp::decode(req, &body)
        })();
        match res {
            Ok(Resp::Err { errno, .. }) => Err(errno),
            Ok(r) => Ok(r),
            Err(e) => {
                eprintln!("softrnic: lost the NIC engine: {e}");
                Err(libc::EIO)
            }
        }
    }

    fn call_post(&self, req: &Req) -> Result<(), (c_int, usize)> {
        let mut c = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        let res: Result<Resp, proto::WireError> = (|| {
            proto::write_frame(&mut *c, &req.encode())?;
            let body = proto::read_frame(&mut *c)?;
            Resp::decode(req, &body)
        })();
        match res {
            Ok(Resp::Err { errno, bad_index }) => Err((errno, bad_index as usize)),
            Ok(_) => Ok(()),
            Err(_) => Err((libc::EIO, 0)),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Asynchronous events (see crate::events for the protocol and why one record at a time)
// ---------------------------------------------------------------------------------------------

/// The context's asynchronous event stream, which becomes its `async_fd`.
fn open_async_stream(st: &CtxState) -> Result<UnixStream, c_int> {
    match st.call(&Req::CreateAsyncChannel)? {
        Resp::Channel { id, token } => attach_stream(&st.socket, id, token),
        _ => Err(libc::EIO),
    }
}

/// libibverbs calls this after `ibv_get_async_event` has read a record: the engine may write
/// the next one, and counts this one as read for its object.
unsafe extern "C" fn async_event(ctx: *mut IbvContext, _event: *mut c_void) {
    guard((), || {
        // SAFETY: ctx is ours (libibverbs passes the context the record was read from).
        let st = unsafe { state(ctx) };
        if let Err(e) = st.call(&Req::AsyncEventRead { taken_back: false }) {
            eprintln!("softrnic: async event not reported read (errno {e})");
        }
    })
}

/// Tell the engine the application's pointer for a QP (`kind` 1) or SRQ (2), which its
/// asynchronous events carry.
fn set_user(st: &CtxState, kind: u8, handle: u32, user: *mut c_void) -> Result<(), c_int> {
    st.call(&Req::UserHandle {
        kind,
        handle,
        user: user as u64,
    })
    .map(|_| ())
}

/// Hands a new object to the application once the engine knows its address ([`set_user`]);
/// if it cannot, undoes the creation (`undo` on the engine side, then the allocation) and
/// returns NULL with errno set.
///
/// # Safety
/// `obj` came from `Box::<T>::into_raw` and is not handed out yet.
unsafe fn hand_out<T>(st: &CtxState, kind: u8, handle: u32, obj: *mut T, undo: &Req) -> *mut T {
    match set_user(st, kind, handle, obj as *mut c_void) {
        Ok(()) => obj,
        Err(e) => {
            let _ = st.call(undo);
            // SAFETY: per this function's contract.
            drop(unsafe { Box::from_raw(obj) });
            set_errno(e);
            null_mut()
        }
    }
}

/// After a destroy (`resp` is the engine's answer), wait as the kernel's destroy commands make
/// libibverbs wait: until the application has acknowledged every event of the object it has
/// read (`*completed`, counted by `ibv_ack_async_event` under `mutex`, signalled on `cond`).
/// An event of the object still unread in the socket is taken back so that nobody can read
/// it after the object is freed; if the application read it first, it is waited for too.
///
/// # Safety
/// `ctx` is ours; `mutex`, `cond` and `completed` belong to the live object being destroyed.
unsafe fn settle_events(
    ctx: *mut IbvContext,
    resp: Resp,
    mutex: *mut libc::pthread_mutex_t,
    cond: *mut libc::pthread_cond_t,
    completed: *const u32,
) {
    let Resp::Destroyed {
        events_reported,
        event_unread,
    } = resp
    else {
        return;
    };
    let mut expected = events_reported;
    if event_unread {
        let mut rec = [0u8; crate::events::RECORD_LEN];
        // SAFETY: reads at most rec.len() bytes into rec from the context's async fd.
        let n = unsafe {
            libc::recv(
                (*ctx).async_fd,
                rec.as_mut_ptr() as *mut c_void,
                rec.len(),
                libc::MSG_DONTWAIT,
            )
        };
        if n == rec.len() as isize {
            // SAFETY: ctx is ours.
            let st = unsafe { state(ctx) };
            let _ = st.call(&Req::AsyncEventRead { taken_back: true });
        } else {
            // The engine wrote the record before answering, so it is no longer in the socket
            // only because the application has read it (its hook will report it).
            expected += 1;
        }
    }
    // SAFETY: the caller's object is live; libibverbs initialised its mutex and cond.
    unsafe {
        libc::pthread_mutex_lock(mutex);
        while std::ptr::read_volatile(completed) < expected {
            libc::pthread_cond_wait(cond, mutex);
        }
        libc::pthread_mutex_unlock(mutex);
    }
}

/// Layout of the allocation made by `_verbs_init_and_alloc_context`.
#[repr(C)]
struct SrContext {
    vctx: VerbsContext,
    state: *mut CtxState,
}

/// # Safety
/// `ctx` must be a context created by [`alloc_context`].
unsafe fn state<'a>(ctx: *mut IbvContext) -> &'a CtxState {
    let vctx = (ctx as *mut u8).sub(offset_of!(VerbsContext, context)) as *mut SrContext;
    &*(*vctx).state
}

unsafe extern "C" fn alloc_context(
    ibdev: *mut IbvDevice,
    cmd_fd: c_int,
    _private: *mut c_void,
) -> *mut VerbsContext {
    guard(null_mut(), || {
        let Some(lib) = LIB.get() else {
            // SAFETY: we own cmd_fd on failure (provider contract).
            unsafe { libc::close(cmd_fd) };
            set_errno(libc::ENOSYS);
            return null_mut();
        };
        // SAFETY: ibdev is the device allocated by alloc_device (first field of SrDevice).
        let dev = unsafe { &*(ibdev as *const SrDevice) };
        let conn = match UnixStream::connect(dev.engine_socket.to_string_lossy().as_ref()) {
            Ok(c) => c,
            Err(e) => {
                eprintln!(
                    "softrnic: cannot reach the NIC engine at {}: {e}",
                    dev.engine_socket.to_string_lossy()
                );
                // SAFETY: we own cmd_fd on failure.
                unsafe { libc::close(cmd_fd) };
                set_errno(libc::ENODEV);
                return null_mut();
            }
        };
        let st = Box::new(CtxState {
            conn: Mutex::new(conn),
            guid: dev.guid,
            socket: dev.engine_socket.to_string_lossy().into_owned(),
            db: std::path::Path::new(dev.engine_socket.to_string_lossy().as_ref())
                .parent()
                .and_then(|d| Doorbell::open(&d.join("doorbell"), false).ok()),
        });
        let events = match open_async_stream(&st) {
            Ok(s) => s,
            Err(e) => {
                eprintln!("softrnic: cannot open the asynchronous event stream (errno {e})");
                // SAFETY: we own cmd_fd on failure.
                unsafe { libc::close(cmd_fd) };
                set_errno(e);
                return null_mut();
            }
        };
        // SAFETY: libibverbs callocs size_of::<SrContext>() bytes, puts the verbs_context at
        // offset 0 (offset of `vctx`) and initialises it; on failure it closes cmd_fd.
        let p =
            unsafe { (lib.init_and_alloc)(ibdev, cmd_fd, size_of::<SrContext>(), null_mut(), 0) }
                as *mut SrContext;
        if p.is_null() {
            return null_mut();
        }
        // SAFETY: p points to a zeroed, initialised SrContext owned by us until free_context.
        unsafe {
            (*p).state = Box::into_raw(st);
            // The async fd is the engine's event stream (libibverbs reads it in
            // ibv_get_async_event and closes it in verbs_uninit_context).
            (*p).vctx.context.async_fd = events.into_raw_fd();
            (*p).vctx.context.num_comp_vectors = 1;
            (lib.set_ops)(&mut (*p).vctx, ctx_ops());
            CONTEXTS
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(&mut (*p).vctx.context as *mut IbvContext as usize);
            &mut (*p).vctx
        }
    })
}

unsafe extern "C" fn free_context(ctx: *mut IbvContext) {
    guard((), || {
        let Some(lib) = LIB.get() else { return };
        CONTEXTS
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|c| *c != ctx as usize);
        // SAFETY: ctx is the ibv_context inside an SrContext made by alloc_context.
        unsafe {
            let p = (ctx as *mut u8).sub(offset_of!(VerbsContext, context)) as *mut SrContext;
            drop(Box::from_raw((*p).state));
            (lib.uninit)(&mut (*p).vctx);
            libc::free(p as *mut c_void);
        }
    })
}

unsafe extern "C" fn query_device_ex(
    ctx: *mut IbvContext,
    _input: *const c_void,
    attr: *mut IbvDeviceAttr,
    attr_size: usize,
) -> c_int {
    guard(libc::EIO, || {
        if attr_size < size_of::<IbvDeviceAttr>() {
            return libc::EINVAL;
        }
        // SAFETY: the caller provides attr_size writable bytes at attr; ctx is ours.
        unsafe {
            std::ptr::write_bytes(attr as *mut u8, 0, attr_size);
            device::fill_device_attr(&mut *attr, state(ctx).guid);
            // Completion timestamps (`ibv_create_cq_ex`): a 1 GHz clock over 64 bits.
            if attr_size >= DEVICE_ATTR_EX_CORE_CLOCK + 8 {
                let b = attr as *mut u8;
                (b.add(DEVICE_ATTR_EX_TS_MASK) as *mut u64).write_unaligned(u64::MAX);
                (b.add(DEVICE_ATTR_EX_CORE_CLOCK) as *mut u64)
                    .write_unaligned(cq_ex::CORE_CLOCK_KHZ);
            }
        }
        0
    })
}

unsafe extern "C" fn query_port(ctx: *mut IbvContext, port: u8, attr: *mut IbvPortAttr) -> c_int {
    guard(libc::EIO, || {
        if port != 1 {
            return libc::EINVAL;
        }
        // SAFETY: ctx is ours, so its device is the SrDevice made by alloc_device;
        // libibverbs passes a full-size ibv_port_attr.
        unsafe {
            let dev = &*((*ctx).device as *const SrDevice);
            let up =
                std::fs::read_to_string(&dev.port_state).map_or(true, |s| device::port_is_up(&s));
            std::ptr::write_bytes(attr, 0, 1);
            device::fill_port_attr(&mut *attr, dev.active_mtu, up);
        }
        0
    })
}

// ---------------------------------------------------------------------------------------------
// PD, MR, CQ
// ---------------------------------------------------------------------------------------------

/// An engine call that answers with a handle (alloc_pd, alloc_mw). On failure errno is set —
/// EIO for any other answer — and None returned: allocation verbs report failure as NULL.
fn call_for_handle(st: &CtxState, req: &Req) -> Option<u32> {
    match st.call(req) {
        Ok(Resp::Handle(h)) => Some(h),
        Ok(_) => {
            set_errno(libc::EIO);
            None
        }
        Err(e) => {
            set_errno(e);
            None
        }
    }
}

/// Ask the engine to destroy an object's engine side with `req`, then free `obj`; on an
/// error `obj` stays allocated (the caller still owns a valid object) and the errno is returned.
///
/// # Safety
/// `obj` came from `Box::<T>::into_raw` and the caller does not use it after a 0 return.
unsafe fn destroy_boxed<T>(st: &CtxState, req: &Req, obj: *mut T) -> c_int {
    match st.call(req) {
        Ok(_) => {
            // SAFETY: per this function's contract.
            drop(unsafe { Box::from_raw(obj) });
            0
        }
        Err(e) => e,
    }
}

unsafe extern "C" fn alloc_pd(ctx: *mut IbvContext) -> *mut IbvPd {
    guard(null_mut(), || {
        // SAFETY: ctx is ours.
        let st = unsafe { state(ctx) };
        match call_for_handle(st, &Req::AllocPd) {
            Some(h) => Box::into_raw(Box::new(IbvPd {
                context: ctx,
                handle: h,
            })),
            None => null_mut(),
        }
    })
}

unsafe extern "C" fn dealloc_pd(pd: *mut IbvPd) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: pd was made by alloc_pd.
        let (st, h) = unsafe { (state((*pd).context), (*pd).handle) };
        // SAFETY: allocated by alloc_pd with Box; no longer used by the caller.
        unsafe { destroy_boxed(st, &Req::DeallocPd { pd: h }, pd) }
    })
}

unsafe extern "C" fn reg_mr(
    pd: *mut IbvPd,
    addr: *mut c_void,
    length: usize,
    hca_va: u64,
    access: c_int,
) -> *mut IbvMr {
    guard(null_mut(), || {
        if hca_va != addr as u64 {
            // MRs whose IO virtual address differs from the process address: not yet.
            set_errno(libc::EOPNOTSUPP);
            return null_mut();
        }
        // SAFETY: pd was made by alloc_pd.
        let (st, h, ctx) = unsafe { (state((*pd).context), (*pd).handle, (*pd).context) };
        let req = Req::RegMr {
            pd: h,
            addr: addr as u64,
            len: length as u64,
            access: access as u32,
        };
        match st.call(&req) {
            Ok(Resp::Mr { lkey, rkey }) => {
                let mr = Box::new(VerbsMr {
                    ibv_mr: IbvMr {
                        context: ctx,
                        pd,
                        addr,
                        length,
                        handle: lkey,
                        lkey,
                        rkey,
                    },
                    mr_type: 0, // IBV_MR_TYPE_MR
                    access,
                });
                Box::into_raw(mr) as *mut IbvMr
            }
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

unsafe extern "C" fn dereg_mr(vmr: *mut VerbsMr) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: vmr was made by reg_mr.
        let (st, lkey) = unsafe { (state((*vmr).ibv_mr.context), (*vmr).ibv_mr.lkey) };
        // SAFETY: allocated by reg_mr with Box; no longer used by the caller.
        unsafe { destroy_boxed(st, &Req::DeregMr { lkey }, vmr) }
    })
}

unsafe extern "C" fn create_cq(
    ctx: *mut IbvContext,
    cqe: c_int,
    channel: *mut c_void,
    _comp_vector: c_int,
) -> *mut IbvCq {
    guard(null_mut(), || {
        let channel_id = if channel.is_null() {
            0
        } else {
            match channel_id(channel) {
                Some(id) => id,
                None => {
                    // Not made by our ibv_create_comp_channel (is the library preloaded?).
                    set_errno(libc::EINVAL);
                    return null_mut();
                }
            }
        };
        if cqe < 1 {
            set_errno(libc::EINVAL);
            return null_mut();
        }
        // SAFETY: ctx is ours.
        let st = unsafe { state(ctx) };
        // SAFETY: ibv_cq is plain C data; all-zero is a valid initial state for its pointers,
        // counters, and glibc's pthread mutex/cond (static initialisers are all-zero).
        // libibverbs' verbs_init_cq fills the rest.
        let cq = Box::into_raw(Box::new(SrCq {
            cq: unsafe { std::mem::zeroed::<IbvCq>() },
            // SAFETY: all-zero is valid: no ops, no current completion.
            ex: unsafe { std::mem::zeroed::<CqExTail>() },
            cur: Mutex::default(),
            ring: None,
            poll: Mutex::new(()),
            empty: std::sync::atomic::AtomicU32::new(0),
            checked_ms: std::sync::atomic::AtomicU64::new(coarse_ms()),
        })) as *mut IbvCq;
        let req = Req::CreateCq {
            cqe: cqe as u32,
            channel: channel_id,
            user: cq as u64,
        };
        let fail = |e| {
            // SAFETY: allocated just above and not handed out.
            drop(unsafe { Box::from_raw(cq as *mut SrCq) });
            set_errno(e);
            null_mut()
        };
        match st.call(&req) {
            Ok(Resp::Cq { handle, cqe }) => {
                // SAFETY: cq is a valid, exclusively owned allocation.
                unsafe {
                    (*cq).context = ctx;
                    (*cq).handle = handle;
                    (*cq).cqe = cqe as c_int;
                    if let Some(m) = share_ring(st, 0, handle, ring::cq_len(cqe)) {
                        (*(cq as *mut SrCq)).ring = Some((
                            m,
                            Ring {
                                off: 0,
                                n: cqe,
                                slot: ring::WC_SIZE,
                            },
                        ));
                    }
                }
                cq
            }
            Ok(_) => fail(libc::EIO),
            Err(e) => fail(e),
        }
    })
}

unsafe extern "C" fn destroy_cq(cq: *mut IbvCq) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: cq was made by create_cq.
        let (st, h) = unsafe { (state((*cq).context), (*cq).handle) };
        match st.call(&Req::DestroyCq { cq: h }) {
            Ok(r) => {
                // SAFETY: cq is live until freed below; its fields are libibverbs'.
                unsafe {
                    let c = &mut *cq;
                    settle_events(
                        c.context,
                        r,
                        &mut c.mutex,
                        &mut c.cond,
                        &c.async_events_completed,
                    );
                }
                // SAFETY: allocated by create_cq as a boxed SrCq.
                drop(unsafe { Box::from_raw(cq as *mut SrCq) });
                0
            }
            Err(e) => e,
        }
    })
}

unsafe extern "C" fn poll_cq(cq: *mut IbvCq, n: c_int, wc: *mut IbvWc) -> c_int {
    guard(-1, || {
        if n <= 0 {
            return 0;
        }
        // SAFETY: cq was made by create_cq, as an SrCq.
        let sr = unsafe { &*(cq as *const SrCq) };
        if let Some((m, r)) = &sr.ring {
            // Local memory only: copy what the engine published, then release the slots.
            let _g = sr.poll.lock().unwrap_or_else(|p| p.into_inner());
            let cons = r.cons(m).load(Ordering::Relaxed);
            let prod = r.prod(m).load(Ordering::Acquire);
            let k = prod.wrapping_sub(cons).min(r.n).min(n as u32);
            let mut b = [0u8; ring::WC_SIZE];
            for i in 0..k {
                m.read(r.slot_off(cons.wrapping_add(i)), &mut b);
                // SAFETY: the caller provides n >= k writable ibv_wc entries at wc.
                unsafe { wc.add(i as usize).write(ring::wc_from(&b)) };
            }
            r.cons(m).store(cons.wrapping_add(k), Ordering::Release);
            if k == 0 {
                // The "NIC" is threads of the engine process sharing these CPUs: a program
                // spinning on an empty CQ gives them the CPU (a real NIC needs none).
                // SAFETY: sched_yield has no preconditions.
                unsafe { libc::sched_yield() };
                // Every 64 empty polls, and at most every 200 ms, check that the engine is
                // still there.
                let e = sr.empty.fetch_add(1, Ordering::Relaxed);
                if e % 64 == 63 {
                    let now = coarse_ms();
                    if now.saturating_sub(sr.checked_ms.load(Ordering::Relaxed)) >= 200 {
                        sr.checked_ms.store(now, Ordering::Relaxed);
                        // SAFETY: cq was made by create_cq; its context is ours.
                        if !unsafe { state((*cq).context) }.engine_alive() {
                            return -1;
                        }
                    }
                }
            } else {
                sr.empty.store(0, Ordering::Relaxed);
            }
            return k as c_int;
        }
        // SAFETY: cq was made by create_cq.
        let (st, h) = unsafe { (state((*cq).context), (*cq).handle) };
        match st.call(&Req::PollCq {
            cq: h,
            max: n as u32,
        }) {
            Ok(Resp::Wcs(v)) => {
                let k = v.len().min(n as usize);
                // SAFETY: the caller provides n writable ibv_wc entries at wc.
                unsafe { std::ptr::copy_nonoverlapping(v.as_ptr(), wc, k) };
                k as c_int
            }
            _ => -1,
        }
    })
}

unsafe extern "C" fn req_notify_cq(cq: *mut IbvCq, solicited_only: c_int) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: cq was made by create_cq.
        if unsafe { (*cq).channel.is_null() } {
            // Arming a CQ without a completion channel has no observable effect.
            return 0;
        }
        // SAFETY: cq was made by create_cq, as an SrCq.
        if let Some((m, r)) = &unsafe { &*(cq as *const SrCq) }.ring {
            // Widening a solicited-only arming to any completion, never narrowing it.
            let arm = r.arm(m);
            if solicited_only == 0 {
                arm.store(ring::ARM_ANY, Ordering::SeqCst);
            } else {
                let _ = arm.compare_exchange(
                    0,
                    ring::ARM_SOLICITED,
                    Ordering::SeqCst,
                    Ordering::SeqCst,
                );
            }
            // Pairs with the engine's fence after publishing a completion (see `ring`).
            std::sync::atomic::fence(Ordering::SeqCst);
            return 0;
        }
        // SAFETY: cq was made by create_cq.
        let (st, h) = unsafe { (state((*cq).context), (*cq).handle) };
        match st.call(&Req::ReqNotifyCq {
            cq: h,
            solicited_only: solicited_only != 0,
        }) {
            Ok(_) => 0,
            Err(e) => e,
        }
    })
}

// ---------------------------------------------------------------------------------------------
// QP
// ---------------------------------------------------------------------------------------------

unsafe extern "C" fn create_qp(pd: *mut IbvPd, attr: *mut IbvQpInitAttr) -> *mut IbvQp {
    guard(null_mut(), || {
        // SAFETY: pd is ours.
        let ctx = unsafe { (*pd).context };
        // SAFETY: pd is ours; attr is a valid init attr from the caller.
        unsafe { new_qp(ctx, pd, &mut *attr, null_mut()) }
    })
}

/// Create a QP of `ctx`: RC, UC, UD and XRC initiator QPs in PD `pd`, XRC target QPs
/// (without PD, CQs or queues) in XRC domain `xrcd`.
///
/// # Safety
/// `pd` is null or a PD of `ctx`; `xrcd` is null or an open XRC domain of `ctx`; the CQs and
/// SRQ `a` names are null or objects of `ctx`.
unsafe fn new_qp(
    ctx: *mut IbvContext,
    pd: *mut IbvPd,
    a: &mut IbvQpInitAttr,
    xrcd: *mut VerbsXrcd,
) -> *mut IbvQp {
    let target = a.qp_type == IBV_QPT_XRC_RECV;
    let known = matches!(
        a.qp_type,
        IBV_QPT_RC | IBV_QPT_UC | IBV_QPT_UD | IBV_QPT_XRC_SEND | IBV_QPT_XRC_RECV
    );
    if !known {
        // No raw packet or driver QPs.
        set_errno(libc::EOPNOTSUPP);
        return null_mut();
    }
    // Initiators send only (no receive CQ needed); targets have neither CQ nor PD.
    let needs_recv_cq = !matches!(a.qp_type, IBV_QPT_XRC_SEND | IBV_QPT_XRC_RECV);
    let bad = if target {
        xrcd.is_null()
    } else {
        pd.is_null()
            || a.send_cq.is_null()
            || (needs_recv_cq && a.recv_cq.is_null())
            || (!needs_recv_cq && !a.srq.is_null())
    };
    if bad {
        set_errno(libc::EINVAL);
        return null_mut();
    }
    let handle_of = |cq: *mut IbvCq| {
        if cq.is_null() || target {
            0
        } else {
            (*cq).handle
        }
    };
    // SAFETY: ctx is ours; CQs were made by create_cq.
    let (st, scq, rcq) = (state(ctx), handle_of(a.send_cq), handle_of(a.recv_cq));
    // SAFETY: a non-null srq was made by create_srq.
    let srq = if a.srq.is_null() || target {
        0
    } else {
        (*(a.srq as *const IbvSrq)).handle
    };
    let req = Req::CreateQp {
        pd: if pd.is_null() { 0 } else { (*pd).handle },
        send_cq: scq,
        recv_cq: rcq,
        srq,
        xrcd: if target { (*xrcd).handle } else { 0 },
        qp_type: a.qp_type,
        sq_sig_all: a.sq_sig_all != 0,
        cap: Caps {
            max_send_wr: a.cap.max_send_wr,
            max_recv_wr: a.cap.max_recv_wr,
            max_send_sge: a.cap.max_send_sge,
            max_recv_sge: a.cap.max_recv_sge,
            max_inline_data: a.cap.max_inline_data,
        },
    };
    match st.call(&req) {
        Ok(Resp::Qp { qpn, cap }) => {
            a.cap = IbvQpCap {
                max_send_wr: cap.max_send_wr,
                max_recv_wr: cap.max_recv_wr,
                max_send_sge: cap.max_send_sge,
                max_recv_sge: cap.max_recv_sge,
                max_inline_data: cap.max_inline_data,
            };
            // SAFETY: verbs_qp is plain C data; all-zero is valid (see create_cq).
            let mut q: Box<SrQp> = Box::new(SrQp {
                vqp: std::mem::zeroed(),
                rings: None,
                batch: Mutex::default(),
            });
            if target {
                q.vqp.comp_mask |= VERBS_QP_XRCD;
                q.vqp.xrcd = xrcd.cast();
            }
            let l = QpLayout::new(&cap);
            // A target has no queues to share.
            let shared = if target {
                None
            } else {
                share_ring(st, 1, qpn, l.len)
            };
            q.rings = shared.map(|map| ProvQpRings {
                map,
                sq: Ring {
                    off: 0,
                    n: l.sq_n,
                    slot: l.sq_slot,
                },
                rq: Ring {
                    off: l.rq_off,
                    n: l.rq_n,
                    slot: l.rq_slot,
                },
                cap,
                post_send: Mutex::new(()),
                post_recv: Mutex::new(()),
            });
            let qp = &mut q.vqp.qp;
            qp.context = ctx;
            qp.qp_context = a.qp_context;
            qp.pd = pd;
            qp.send_cq = a.send_cq;
            qp.recv_cq = a.recv_cq;
            qp.srq = a.srq;
            qp.handle = qpn;
            qp.qp_num = qpn;
            qp.state = IBV_QPS_RESET;
            qp.qp_type = a.qp_type;
            let undo = Req::DestroyQp { qpn };
            // SAFETY: allocated just above and not handed out.
            let qp = hand_out(st, 1, qpn, Box::into_raw(q), &undo);
            qp as *mut IbvQp
        }
        Ok(_) => {
            set_errno(libc::EIO);
            null_mut()
        }
        Err(e) => {
            set_errno(e);
            null_mut()
        }
    }
}

unsafe extern "C" fn modify_qp(qp: *mut IbvQp, attr: *mut IbvQpAttr, mask: c_int) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: qp is ours; attr is valid for the fields named in mask (we copy all).
        let (st, qpn, a) = unsafe { (state((*qp).context), (*qp).qp_num, &*attr) };
        let w = QpAttrs {
            qp_state: a.qp_state,
            cur_qp_state: a.cur_qp_state,
            path_mtu: a.path_mtu,
            qkey: a.qkey,
            rq_psn: a.rq_psn,
            sq_psn: a.sq_psn,
            dest_qp_num: a.dest_qp_num,
            access_flags: a.qp_access_flags,
            pkey_index: a.pkey_index,
            port_num: a.port_num,
            max_rd_atomic: a.max_rd_atomic,
            max_dest_rd_atomic: a.max_dest_rd_atomic,
            min_rnr_timer: a.min_rnr_timer,
            timeout: a.timeout,
            retry_cnt: a.retry_cnt,
            rnr_retry: a.rnr_retry,
            dgid: a.ah_attr.grh.dgid,
            sgid_index: a.ah_attr.grh.sgid_index,
            hop_limit: a.ah_attr.grh.hop_limit,
            is_global: a.ah_attr.is_global,
            dlid: a.ah_attr.dlid,
            sl: a.ah_attr.sl,
            ah_port_num: a.ah_attr.port_num,
        };
        match st.call(&Req::ModifyQp { qpn, mask, attr: w }) {
            Ok(_) => 0,
            Err(e) => e,
        }
    })
}

unsafe extern "C" fn query_qp(
    qp: *mut IbvQp,
    attr: *mut IbvQpAttr,
    _mask: c_int,
    init: *mut IbvQpInitAttr,
) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: qp is ours.
        let (st, qpn) = unsafe { (state((*qp).context), (*qp).qp_num) };
        match st.call(&Req::QueryQp { qpn }) {
            Ok(Resp::QpAttr {
                attr: w,
                cap,
                qp_type,
                sq_sig_all,
            }) => {
                let c = IbvQpCap {
                    max_send_wr: cap.max_send_wr,
                    max_recv_wr: cap.max_recv_wr,
                    max_send_sge: cap.max_send_sge,
                    max_recv_sge: cap.max_recv_sge,
                    max_inline_data: cap.max_inline_data,
                };
                // SAFETY: attr and init are valid out-parameters from the caller; qp is ours.
                unsafe {
                    let a = &mut *attr;
                    *a = IbvQpAttr::default();
                    a.qp_state = w.qp_state;
                    a.cur_qp_state = w.qp_state;
                    a.path_mtu = w.path_mtu;
                    a.qkey = w.qkey;
                    a.rq_psn = w.rq_psn;
                    a.sq_psn = w.sq_psn;
                    a.dest_qp_num = w.dest_qp_num;
                    a.qp_access_flags = w.access_flags;
                    a.cap = c;
                    a.ah_attr.grh.dgid = w.dgid;
                    a.ah_attr.grh.sgid_index = w.sgid_index;
                    a.ah_attr.grh.hop_limit = w.hop_limit;
                    a.ah_attr.is_global = w.is_global;
                    a.ah_attr.dlid = w.dlid;
                    a.ah_attr.sl = w.sl;
                    a.ah_attr.port_num = w.ah_port_num;
                    a.pkey_index = w.pkey_index;
                    a.port_num = w.port_num;
                    a.max_rd_atomic = w.max_rd_atomic;
                    a.max_dest_rd_atomic = w.max_dest_rd_atomic;
                    a.min_rnr_timer = w.min_rnr_timer;
                    a.timeout = w.timeout;
                    a.retry_cnt = w.retry_cnt;
                    a.rnr_retry = w.rnr_retry;
                    let i = &mut *init;
                    i.qp_context = (*qp).qp_context;
                    i.send_cq = (*qp).send_cq;
                    i.recv_cq = (*qp).recv_cq;
                    i.srq = (*qp).srq;
                    i.cap = c;
                    i.qp_type = qp_type;
                    i.sq_sig_all = sq_sig_all as c_int;
                }
                0
            }
            Ok(_) => libc::EIO,
            Err(e) => e,
        }
    })
}

unsafe extern "C" fn destroy_qp(qp: *mut IbvQp) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: qp is ours.
        let (st, qpn) = unsafe { (state((*qp).context), (*qp).qp_num) };
        match st.call(&Req::DestroyQp { qpn }) {
            Ok(r) => {
                // SAFETY: qp is live until freed below; its fields are libibverbs'.
                unsafe {
                    let q = &mut *qp;
                    settle_events(q.context, r, &mut q.mutex, &mut q.cond, &q.events_completed);
                }
                // SAFETY: allocated by create_qp as a boxed SrQp.
                drop(unsafe { Box::from_raw(qp as *mut SrQp) });
                0
            }
            Err(e) => e,
        }
    })
}

// ---------------------------------------------------------------------------------------------
// SRQ (control and posting go through the engine's socket: no shared ring for SRQs)
// ---------------------------------------------------------------------------------------------

unsafe extern "C" fn create_srq(pd: *mut IbvPd, attr: *mut IbvSrqInitAttr) -> *mut IbvSrq {
    guard(null_mut(), || {
        // SAFETY: pd is ours; attr is a valid init attr from the caller.
        unsafe {
            let a = &mut *attr;
            new_srq(pd, a.srq_context, &mut a.attr, null_mut(), null_mut())
        }
    })
}

/// Create an SRQ in PD `pd`: a basic one, or with `xrcd` and `cq` an XRC SRQ of that domain
/// whose receives complete on `cq`. `attr` gets the granted sizes.
///
/// # Safety
/// `pd` is ours; `xrcd` and `cq` are null or objects of the PD's context.
unsafe fn new_srq(
    pd: *mut IbvPd,
    srq_context: *mut c_void,
    attr: &mut IbvSrqAttr,
    xrcd: *mut VerbsXrcd,
    cq: *mut IbvCq,
) -> *mut IbvSrq {
    let (ctx, pdh) = ((*pd).context, (*pd).handle);
    let st = state(ctx);
    let xrc = !xrcd.is_null();
    let req = Req::CreateSrq {
        pd: pdh,
        max_wr: attr.max_wr,
        max_sge: attr.max_sge,
        xrcd: if xrc { (*xrcd).handle } else { 0 },
        cq: if xrc { (*cq).handle } else { 0 },
    };
    match st.call(&req) {
        Ok(Resp::Srq {
            handle,
            max_wr,
            max_sge,
            ..
        }) => {
            attr.max_wr = max_wr;
            attr.max_sge = max_sge;
            // SAFETY: verbs_srq is plain C data; all-zero is valid (an initialised pthread
            // mutex and condition variable in glibc).
            let mut b: Box<VerbsSrq> = Box::new(std::mem::zeroed());
            b.srq.context = ctx;
            b.srq.srq_context = srq_context;
            b.srq.pd = pd;
            b.srq.handle = handle;
            b.srq_num = handle;
            if xrc {
                (b.srq_type, b.xrcd, b.cq) = (IBV_SRQT_XRC, xrcd, cq);
            }
            let undo = Req::DestroySrq { srq: handle };
            // SAFETY: allocated just above and not handed out.
            hand_out(st, 2, handle, Box::into_raw(b), &undo).cast()
        }
        Ok(_) => {
            set_errno(libc::EIO);
            null_mut()
        }
        Err(e) => {
            set_errno(e);
            null_mut()
        }
    }
}

unsafe extern "C" fn modify_srq(srq: *mut IbvSrq, attr: *mut IbvSrqAttr, mask: c_int) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: srq is ours; attr is valid.
        let (st, handle, a) = unsafe { (state((*srq).context), (*srq).handle, *attr) };
        let req = Req::ModifySrq {
            srq: handle,
            mask,
            max_wr: a.max_wr,
            srq_limit: a.srq_limit,
        };
        match st.call(&req) {
            Ok(_) => 0,
            Err(e) => e,
        }
    })
}

unsafe extern "C" fn query_srq(srq: *mut IbvSrq, attr: *mut IbvSrqAttr) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: srq is ours.
        let (st, handle) = unsafe { (state((*srq).context), (*srq).handle) };
        match st.call(&Req::QuerySrq { srq: handle }) {
            Ok(Resp::Srq {
                max_wr,
                max_sge,
                srq_limit,
                ..
            }) => {
                // SAFETY: attr is a valid out-parameter.
                unsafe {
                    *attr = IbvSrqAttr {
                        max_wr,
                        max_sge,
                        srq_limit,
                    }
                };
                0
            }
            Ok(_) => libc::EIO,
            Err(e) => e,
        }
    })
}

unsafe extern "C" fn destroy_srq(srq: *mut IbvSrq) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: srq is ours.
        let (st, handle) = unsafe { (state((*srq).context), (*srq).handle) };
        match st.call(&Req::DestroySrq { srq: handle }) {
            Ok(r) => {
                // SAFETY: srq is live until freed below; its fields are libibverbs'.
                unsafe {
                    let s = &mut *srq;
                    settle_events(s.context, r, &mut s.mutex, &mut s.cond, &s.events_completed);
                }
                // SAFETY: allocated by new_srq as a boxed VerbsSrq (which begins with it).
                drop(unsafe { Box::from_raw(srq.cast::<VerbsSrq>()) });
                0
            }
            Err(e) => e,
        }
    })
}

unsafe extern "C" fn post_srq_recv(
    srq: *mut IbvSrq,
    wr: *mut IbvRecvWr,
    bad: *mut *mut IbvRecvWr,
) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: srq is ours; wr is the caller's NULL-terminated list of valid WRs.
        unsafe {
            let st = state((*srq).context);
            let (list, ptrs) = recv_list(wr);
            match st.call_post(&Req::PostSrqRecv {
                srq: (*srq).handle,
                wrs: list,
            }) {
                Ok(()) => 0,
                Err((e, i)) => {
                    *bad = ptrs.get(i).copied().unwrap_or(wr);
                    e
                }
            }
        }
    })
}

// ---------------------------------------------------------------------------------------------
// Memory windows (see crate::mw)
// ---------------------------------------------------------------------------------------------

unsafe extern "C" fn alloc_mw(pd: *mut IbvPd, mw_type: c_int) -> *mut IbvMw {
    guard(null_mut(), || {
        // SAFETY: pd is ours.
        let (ctx, pdh) = unsafe { ((*pd).context, (*pd).handle) };
        // SAFETY: ctx is ours.
        let st = unsafe { state(ctx) };
        match call_for_handle(st, &Req::AllocMw { pd: pdh, mw_type }) {
            Some(rkey) => Box::into_raw(Box::new(IbvMw {
                context: ctx,
                pd,
                rkey,
                handle: rkey >> 8,
                type_: mw_type,
            })),
            None => null_mut(),
        }
    })
}

unsafe extern "C" fn dealloc_mw(mw: *mut IbvMw) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: mw was made by alloc_mw.
        let (st, rkey) = unsafe { (state((*mw).context), (*mw).rkey) };
        // SAFETY: allocated by alloc_mw as a boxed IbvMw; no longer used by the caller.
        unsafe { destroy_boxed(st, &Req::DeallocMw { rkey }, mw) }
    })
}

/// `ibv_bind_mw` (type 1): a bind work request on the QP's send queue with the window's next
/// rkey (`ibv_inc_rkey`), which the window carries from now on, as mlx5 does.
unsafe extern "C" fn bind_mw(qp: *mut IbvQp, mw: *mut IbvMw, bind: *mut IbvMwBind) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: mw is ours and bind is the caller's valid bind description.
        let (old, b) = unsafe { ((*mw).rkey, &*bind) };
        let rkey = (old & !0xff) | (old.wrapping_add(1) & 0xff);
        // SAFETY: ibv_send_wr is plain C data; all-zero is a valid empty WR.
        let mut wr: IbvSendWr = unsafe { std::mem::zeroed() };
        wr.wr_id = b.wr_id;
        wr.opcode = IBV_WR_BIND_MW;
        wr.send_flags = b.send_flags;
        wr.set_bind_mw(IbvSendWrBindMw {
            mw,
            rkey,
            bind_info: b.bind_info,
        });
        let mut bad = null_mut();
        // SAFETY: qp is ours; wr is a one-element list.
        let r = unsafe { post_send(qp, &mut wr, &mut bad) };
        if r == 0 {
            // SAFETY: mw is ours.
            unsafe { (*mw).rkey = rkey };
        }
        r
    })
}

/// Copy a NULL-terminated list of receive WRs, with the pointer of each (for `bad_wr`).
///
/// # Safety
/// `wr` is a NULL-terminated list of valid receive work requests.
unsafe fn recv_list(wr: *mut IbvRecvWr) -> (Vec<RecvWr>, Vec<*mut IbvRecvWr>) {
    let mut list = Vec::new();
    let mut ptrs = Vec::new();
    let mut w = wr;
    while !w.is_null() {
        let r = &*w;
        list.push(RecvWr {
            wr_id: r.wr_id,
            sges: sges(r.sg_list, r.num_sge),
        });
        ptrs.push(w);
        w = r.next;
    }
    (list, ptrs)
}

/// # Safety
/// `sg` must point to `n` valid SGEs (or be unused when `n == 0`).
unsafe fn sges(sg: *const IbvSge, n: c_int) -> Vec<Sge> {
    if n <= 0 || sg.is_null() {
        return Vec::new();
    }
    std::slice::from_raw_parts(sg, n as usize)
        .iter()
        .map(|s| Sge {
            addr: s.addr,
            length: s.length,
            lkey: s.lkey,
        })
        .collect()
}

/// The remote side of a send WR from the `wr` union: (remote address, rkey, compare/add,
/// swap). `wr.rdma` is {remote_addr, rkey}; `wr.atomic` is {remote_addr, compare_add, swap,
/// rkey}, so an atomic's rkey sits in the fourth word; `wr.ud` is {ah, remote_qpn,
/// remote_qkey}, carried as (destination IPv4 address, QPN, Q_Key) (see [`SendWr`]).
///
/// # Safety
/// On a UD QP, `wr.ud.ah` must be an address handle made by [`create_ah`] (as the verbs API
/// requires of the application).
unsafe fn remote_of(w: &IbvSendWr, qp_type: c_int) -> (u64, u32, u64, u64) {
    if qp_type == IBV_QPT_UD {
        let ah = w.wr[0] as *const SrAh;
        let ip = if ah.is_null() { 0 } else { (*ah).ip };
        let (qpn, qkey) = (w.wr[1] as u32, (w.wr[1] >> 32) as u32);
        (u64::from(ip), qpn, u64::from(qkey), 0)
    } else if proto::is_atomic_wr(w.opcode) {
        (w.wr[0], w.wr[3] as u32, w.wr[1], w.wr[2])
    } else if w.opcode == IBV_WR_BIND_MW {
        let b = w.bind_mw();
        let i = b.bind_info;
        let lkey = if i.mr.is_null() { 0 } else { (*i.mr).lkey };
        let fields = proto::bind_fields(lkey, i.mw_access_flags);
        (i.addr, b.rkey, i.length, fields)
    } else {
        (w.wr[0], w.wr[1] as u32, 0, 0)
    }
}

/// A UD send must name an address handle (nothing else is addressed per work request).
fn has_destination(w: &IbvSendWr, qp_type: c_int) -> bool {
    qp_type != IBV_QPT_UD || w.wr[0] != 0
}

// ---------------------------------------------------------------------------------------------
// Address handles (provider-side only: an AH is just the destination's address)
// ---------------------------------------------------------------------------------------------

/// An address handle: libibverbs' `ibv_ah` followed by the destination IPv4 address.
#[repr(C)]
struct SrAh {
    ah: IbvAh,
    ip: u32,
}

/// Address handles alive in this process (bounded by `max_ah`).
static AH_COUNT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

unsafe extern "C" fn create_ah(pd: *mut IbvPd, attr: *mut IbvAhAttr) -> *mut IbvAh {
    guard(null_mut(), || {
        // SAFETY: pd is ours; attr is valid.
        let (ctx, a) = unsafe { ((*pd).context, &*attr) };
        // The port is RoCE-like: the destination is a GRH with an IPv4-mapped GID.
        let ip = match device::ip_of_gid(&a.grh.dgid) {
            Some(ip) if a.is_global == 1 && a.port_num == 1 && a.grh.sgid_index == 0 => ip,
            _ => {
                set_errno(libc::EINVAL);
                return null_mut();
            }
        };
        let n = AH_COUNT.fetch_add(1, Ordering::Relaxed);
        if n >= device::MAX_AH {
            AH_COUNT.fetch_sub(1, Ordering::Relaxed);
            set_errno(libc::ENOMEM);
            return null_mut();
        }
        let b = Box::new(SrAh {
            ah: IbvAh {
                context: ctx,
                pd,
                handle: n,
            },
            ip: u32::from(ip),
        });
        Box::into_raw(b) as *mut IbvAh
    })
}

unsafe extern "C" fn destroy_ah(ah: *mut IbvAh) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: allocated by create_ah as a boxed SrAh.
        drop(unsafe { Box::from_raw(ah as *mut SrAh) });
        AH_COUNT.fetch_sub(1, Ordering::Relaxed);
        0
    })
}

unsafe extern "C" fn post_send(
    qp: *mut IbvQp,
    wr: *mut IbvSendWr,
    bad: *mut *mut IbvSendWr,
) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: qp was made by create_qp (an SrQp); wr is the caller's list of valid WRs.
        if let Some(rings) = unsafe { &(*(qp as *const SrQp)).rings } {
            return unsafe { post_send_ring(qp, rings, wr, bad, false) };
        }
        // SAFETY: qp is ours; wr is the caller's NULL-terminated list of valid WRs.
        unsafe {
            let st = state((*qp).context);
            let mut list = Vec::new();
            let mut ptrs = Vec::new();
            let mut w = wr;
            while !w.is_null() {
                let r = &*w;
                let g = sges(r.sg_list, r.num_sge);
                let inline = if r.send_flags & IBV_SEND_INLINE != 0 {
                    let total: u64 = g.iter().map(|s| s.length as u64).sum();
                    if total > device::MAX_INLINE as u64 {
                        *bad = w;
                        return libc::EINVAL;
                    }
                    let mut data = Vec::with_capacity(total as usize);
                    for s in &g {
                        // SAFETY: inline data is read from the caller's buffers at post time,
                        // as the verbs API specifies; the caller guarantees they are valid.
                        data.extend_from_slice(std::slice::from_raw_parts(
                            s.addr as *const u8,
                            s.length as usize,
                        ));
                    }
                    Some(data)
                } else {
                    None
                };
                if !has_destination(r, (*qp).qp_type) {
                    *bad = w;
                    return libc::EINVAL;
                }
                let (remote_addr, rkey, compare_add, swap) = remote_of(r, (*qp).qp_type);
                list.push(SendWr {
                    wr_id: r.wr_id,
                    opcode: r.opcode,
                    flags: r.send_flags,
                    imm: r.imm_data,
                    remote_addr,
                    rkey,
                    compare_add,
                    swap,
                    sges: if inline.is_some() { Vec::new() } else { g },
                    inline,
                    xrc_srqn: r.qp_type_xrc_remote_srqn,
                });
                ptrs.push(w);
                w = r.next;
            }
            match st.call_post(&Req::PostSend {
                qpn: (*qp).qp_num,
                wrs: list,
            }) {
                Ok(()) => 0,
                Err((e, i)) => {
                    *bad = ptrs.get(i).copied().unwrap_or(wr);
                    e
                }
            }
        }
    })
}

unsafe extern "C" fn post_recv(
    qp: *mut IbvQp,
    wr: *mut IbvRecvWr,
    bad: *mut *mut IbvRecvWr,
) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: qp was made by create_qp; bad is writable.
        let xrc = unsafe { matches!((*qp).qp_type, IBV_QPT_XRC_SEND | IBV_QPT_XRC_RECV) };
        if xrc || unsafe { !(*qp).srq.is_null() } {
            // Its receives come from an SRQ (ibv_post_srq_recv).
            unsafe { *bad = wr };
            return libc::EINVAL;
        }
        // SAFETY: qp was made by create_qp (an SrQp); wr is the caller's list of valid WRs.
        if let Some(rings) = unsafe { &(*(qp as *const SrQp)).rings } {
            return unsafe { post_recv_ring(qp, rings, wr, bad) };
        }
        // SAFETY: qp is ours; wr is the caller's NULL-terminated list of valid WRs.
        unsafe {
            let st = state((*qp).context);
            let (list, ptrs) = recv_list(wr);
            match st.call_post(&Req::PostRecv {
                qpn: (*qp).qp_num,
                wrs: list,
            }) {
                Ok(()) => 0,
                Err((e, i)) => {
                    *bad = ptrs.get(i).copied().unwrap_or(wr);
                    e
                }
            }
        }
    })
}

/// `post_send` through the QP's send ring: validate, write the slots, publish, ring the
/// doorbell. No request to the engine. With `whole`, a list with a bad request posts none
/// of it (`ibv_wr_complete`); otherwise the requests before the bad one are posted
/// (`ibv_post_send`).
///
/// # Safety
/// `qp` is an SrQp made by create_qp with `rings`; `wr` is the caller's NULL-terminated list of
/// valid work requests; `bad` is writable.
unsafe fn post_send_ring(
    qp: *mut IbvQp,
    rings: &ProvQpRings,
    wr: *mut IbvSendWr,
    bad: *mut *mut IbvSendWr,
    whole: bool,
) -> c_int {
    let qstate = (*qp).state;
    if qstate != IBV_QPS_RTS && qstate != IBV_QPS_ERR {
        *bad = wr;
        return libc::EINVAL;
    }
    let (m, r, cap) = (&rings.map, &rings.sq, &rings.cap);
    let _g = rings.post_send.lock().unwrap_or_else(|p| p.into_inner());
    let start = r.prod(m).load(Ordering::Relaxed);
    let mut prod = start;
    let mut slot = vec![0u8; r.slot];
    let mut ret = 0;
    let mut w = wr;
    while !w.is_null() {
        let x = &*w;
        let inline = x.send_flags & IBV_SEND_INLINE != 0;
        if x.num_sge < 0
            || x.num_sge as u32 > cap.max_send_sge
            || !has_destination(x, (*qp).qp_type)
        {
            ret = libc::EINVAL;
            break;
        }
        if prod.wrapping_sub(r.done(m).load(Ordering::Acquire)) >= r.n {
            ret = libc::ENOMEM;
            break;
        }
        let g = sges(x.sg_list, x.num_sge);
        let total: u64 = g.iter().map(|s| s.length as u64).sum();
        if let Err(e) = proto::check_send_wr((*qp).qp_type, x.opcode, inline, total) {
            ret = e;
            break;
        }
        if inline && total > cap.max_inline_data as u64 {
            ret = libc::EINVAL;
            break;
        }
        slot.fill(0);
        ring::put_u64(&mut slot, 0, x.wr_id);
        ring::put_u32(&mut slot, 8, x.opcode as u32);
        ring::put_u32(&mut slot, 12, x.send_flags);
        ring::put_u32(&mut slot, 16, x.imm_data);
        ring::put_u32(&mut slot, 20, g.len() as u32);
        let (remote_addr, rkey, compare_add, swap) = remote_of(x, (*qp).qp_type);
        ring::put_u64(&mut slot, 24, remote_addr);
        ring::put_u32(&mut slot, 32, rkey);
        ring::put_u64(&mut slot, ring::SQ_COMPARE_ADD_OFF, compare_add);
        ring::put_u64(&mut slot, ring::SQ_SWAP_OFF, swap);
        ring::put_u32(&mut slot, ring::SQ_DOORBELL_OFF, u32::from(prod == start));
        ring::put_u32(&mut slot, ring::SQ_XRC_SRQN_OFF, x.qp_type_xrc_remote_srqn);
        if inline {
            // Inline data is read from the caller's buffers at post time, as the verbs API
            // specifies; the caller guarantees they are valid.
            ring::put_u32(&mut slot, 36, total as u32);
            let mut o = ring::SQ_SGE_OFF + 16 * cap.max_send_sge as usize;
            for s in &g {
                let src = std::slice::from_raw_parts(s.addr as *const u8, s.length as usize);
                slot[o..o + src.len()].copy_from_slice(src);
                o += src.len();
            }
        } else {
            ring::put_u32(&mut slot, 36, ring::NOT_INLINE);
            for (i, s) in g.iter().enumerate() {
                let o = ring::SQ_SGE_OFF + 16 * i;
                ring::put_u64(&mut slot, o, s.addr);
                ring::put_u32(&mut slot, o + 8, s.length);
                ring::put_u32(&mut slot, o + 12, s.lkey);
            }
        }
        m.write(r.slot_off(prod), &slot);
        prod = prod.wrapping_add(1);
        w = x.next;
    }
    // Slots written beyond `prod` are invisible to the engine until it is published.
    if prod != start && !(whole && ret != 0) {
        r.prod(m).store(prod, Ordering::Release);
        if let Some(db) = &state((*qp).context).db {
            db.ring();
        }
    }
    if ret != 0 {
        *bad = w;
    }
    ret
}

/// `post_recv` through the QP's receive ring (the engine takes receives when a message
/// arrives, so no doorbell unless the QP is in the error state and they must be flushed).
///
/// # Safety
/// As [`post_send_ring`].
unsafe fn post_recv_ring(
    qp: *mut IbvQp,
    rings: &ProvQpRings,
    wr: *mut IbvRecvWr,
    bad: *mut *mut IbvRecvWr,
) -> c_int {
    let qstate = (*qp).state;
    if qstate == IBV_QPS_RESET {
        *bad = wr;
        return libc::EINVAL;
    }
    let (m, r, cap) = (&rings.map, &rings.rq, &rings.cap);
    let _g = rings.post_recv.lock().unwrap_or_else(|p| p.into_inner());
    let start = r.prod(m).load(Ordering::Relaxed);
    let mut prod = start;
    let mut slot = vec![0u8; r.slot];
    let mut ret = 0;
    let mut w = wr;
    while !w.is_null() {
        let x = &*w;
        if x.num_sge < 0 || x.num_sge as u32 > cap.max_recv_sge {
            ret = libc::EINVAL;
            break;
        }
        if prod.wrapping_sub(r.done(m).load(Ordering::Acquire)) >= r.n {
            ret = libc::ENOMEM;
            break;
        }
        let g = sges(x.sg_list, x.num_sge);
        slot.fill(0);
        ring::put_u64(&mut slot, 0, x.wr_id);
        ring::put_u32(&mut slot, 8, g.len() as u32);
        for (i, s) in g.iter().enumerate() {
            let o = 16 + 16 * i;
            ring::put_u64(&mut slot, o, s.addr);
            ring::put_u32(&mut slot, o + 8, s.length);
            ring::put_u32(&mut slot, o + 12, s.lkey);
        }
        m.write(r.slot_off(prod), &slot);
        prod = prod.wrapping_add(1);
        w = x.next;
    }
    if prod != start {
        r.prod(m).store(prod, Ordering::Release);
        if qstate == IBV_QPS_ERR {
            if let Some(db) = &state((*qp).context).db {
                db.ring();
            }
        }
    }
    if ret != 0 {
        *bad = w;
    }
    ret
}
