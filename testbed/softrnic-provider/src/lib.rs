//! softrnic's side inside every verbs program: the shared object `libsoftrnic_provider.so`,
//! which `softrnic up` links into each host's run directory as `lib/libsoftrnic-rdmav34.so`
//! and `softrnic exec` preloads. It holds the verbs provider, the RDMA connection manager
//! behind `/dev/infiniband/rdma_cm` ([`rdma_cm`]: it runs in the program, as the kernel's
//! does for a real NIC) and what they share with the engine (`softrnic-abi`) — no engine,
//! fabric or namespace code.
//!
//! libibverbs dlopens this library (through `RDMAV_DRIVERS`); its ELF constructor registers a
//! `verbs_device_ops` with `verbs_register_driver_34`. Every verb is forwarded to the host's
//! NIC engine over a Unix socket whose path the generated sysfs tree carries
//! (`<ibdev_path>/softrnic_engine_socket`). No panic unwinds into C: every entry point runs in
//! `catch_unwind` and turns a panic into an error return.
//!
//! The crate root holds the device, the context and its engine connection, PDs and MRs; the other
//! verbs are in its modules: `cq`, `cq_ex`, `qp`, `qp_ex`, `srq`, `xrc`, `mw`, `ah` and `post`
//! (the data path's `ibv_post_send`/`ibv_post_recv`).

use std::collections::HashMap;
use std::ffi::{CStr, CString};
use std::mem::{offset_of, size_of};
use std::os::fd::IntoRawFd;
use std::os::unix::net::UnixStream;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr::{null, null_mut};
use std::sync::{Mutex, OnceLock};

use libc::{c_char, c_int, c_void};

use drum_verbs_abi::consts::*;
use drum_verbs_abi::*;
use softrnic_abi::device;
use softrnic_abi::proto::{self, Caps, QpAttrs, RecvWr, Req, Resp, SendWr, Sge};
use softrnic_abi::ring::{self, Doorbell, Map, QpLayout, Ring};
use std::sync::atomic::Ordering;

mod ah;
mod cq;
mod cq_ex;
mod dm;
mod flow;
mod mcast;
mod mw;
mod pd_mr;
mod post;
mod qp;
mod qp_ex;
pub mod rdma_cm;
mod srq;
mod xrc;

use pd_mr::*;

use ah::*;
use cq::*;
use mw::*;
use post::*;
use qp::*;
use srq::*;

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
            set("attach_mcast", mcast::attach_mcast as *const c_void);
            set("detach_mcast", mcast::detach_mcast as *const c_void);
            set("create_flow", flow::create_flow as *const c_void);
            set("destroy_flow", flow::destroy_flow as *const c_void);
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
            set("open_qp", xrc::open_qp as *const c_void);
            set("alloc_mw", alloc_mw as *const c_void);
            set("dealloc_mw", dealloc_mw as *const c_void);
            set("bind_mw", bind_mw as *const c_void);
            set("free_context", free_context as *const c_void);
            set("advise_mr", advise_mr as *const c_void);
            set("alloc_dm", dm::alloc_dm as *const c_void);
            set("free_dm", dm::free_dm as *const c_void);
            set("reg_dm_mr", dm::reg_dm_mr as *const c_void);
            set(
                "modify_qp_rate_limit",
                qp::modify_qp_rate_limit as *const c_void,
            );
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
        let mut h = unsafe {
            libc::dlopen(
                c"libibverbs.so.1".as_ptr(),
                libc::RTLD_NOW | libc::RTLD_NOLOAD,
            )
        };
        if h.is_null() && is_provider_library() {
            // Preloaded by `softrnic exec` into a program that dlopens libibverbs itself
            // (NCCL does): libibverbs' own dlopen of this library would later find it loaded
            // and not run this constructor again, so the device would have no driver. Load
            // libibverbs now, as a program linked with it has it.
            // SAFETY: as above.
            h = unsafe { libc::dlopen(c"libibverbs.so.1".as_ptr(), libc::RTLD_NOW) };
        }
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

/// Whether this code runs from the provider library (`…-rdmav34.so`), not from a program
/// that links it (the softrnic command).
fn is_provider_library() -> bool {
    // SAFETY: Dl_info is plain data; all zeroes is a valid value.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: dladdr on an address of this object, into a Dl_info of ours.
    let found = unsafe { libc::dladdr(register as *const c_void, &mut info) } != 0;
    // SAFETY: dladdr sets dli_fname to a NUL-terminated path when it succeeds.
    found
        && !info.dli_fname.is_null()
        && unsafe { CStr::from_ptr(info.dli_fname) }
            .to_bytes()
            .ends_with(b"-rdmav34.so")
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
            .and_then(|m| device::mtu_enum(m.trim().parse().ok()?))
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
    conn: Mutex<EngineConn>,
    /// What a process forked from the context's owner shows to join its context on a
    /// connection of its own ([`Req::JoinContext`]): the owner's connection and secret.
    key: (u64, u64),
    guid: u64,
    socket: String,
    /// The engine's doorbell (None: the engine offers none; the socket path is used).
    db: Option<Doorbell>,
}

/// The control connection to the engine, and the process it belongs to. A child of `fork`
/// inherits the socket; requests of parent and children on it would interleave (a frame
/// half written by one, an answer read by another: "message truncated"), and the engine
/// would take the parent's memory for theirs. So each process opens its own on first use.
struct EngineConn {
    stream: UnixStream,
    pid: u32,
}

/// A connection of this process to the engine that joins the context of `key`.
fn join_context(socket: &str, key: (u64, u64)) -> Result<UnixStream, proto::WireError> {
    let mut s = UnixStream::connect(socket)?;
    let req = Req::JoinContext {
        conn: key.0,
        token: key.1,
    };
    proto::write_frame(&mut s, &req.encode())?;
    let body = proto::read_frame(&mut s)?;
    match Resp::decode(&req, &body)? {
        Resp::Unit => Ok(s),
        Resp::Err { errno, .. } => Err(std::io::Error::from_raw_os_error(errno).into()),
        _ => Err(proto::WireError::Truncated),
    }
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
        let Some((id, token)) = call_expect(st, &Req::CreateChannel, |r| match r {
            Resp::Channel { id, token } => Some((id, token)),
            _ => None,
        }) else {
            return null_mut();
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
            fd: c.stream.as_raw_fd(),
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

    /// One request/response exchange with the engine, on this process's own connection.
    fn exchange(&self, req: &Req) -> Result<Resp, proto::WireError> {
        let mut c = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        let me = std::process::id();
        if c.pid != me {
            c.stream = join_context(&self.socket, self.key)?;
            c.pid = me;
        }
        proto::write_frame(&mut c.stream, &req.encode())?;
        let body = proto::read_frame(&mut c.stream)?;
        Resp::decode(req, &body)
    }

    /// One request/response exchange with the engine. Err(errno).
    fn call(&self, req: &Req) -> Result<Resp, c_int> {
        match self.exchange(req) {
            Ok(Resp::Err { errno, .. }) => Err(errno),
            Ok(r) => Ok(r),
            Err(e) => {
                eprintln!("softrnic: lost the NIC engine: {e}");
                Err(libc::EIO)
            }
        }
    }

    fn call_post(&self, req: &Req) -> Result<(), (c_int, usize)> {
        match self.exchange(req) {
            Ok(Resp::Err { errno, bad_index }) => Err((errno, bad_index as usize)),
            Ok(_) => Ok(()),
            Err(_) => Err((libc::EIO, 0)),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Asynchronous events (see softrnic's `events` for the protocol and why one record at a time)
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
        let mut rec = [0u8; softrnic_abi::async_event::RECORD_LEN];
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
/// `ctx` must be a context created by [`alloc_context`], not freed yet (the reference must
/// not outlive it).
unsafe fn state<'a>(ctx: *mut IbvContext) -> &'a CtxState {
    // SAFETY: per the contract, ctx is the `context` field of the VerbsContext that begins an
    // SrContext made by alloc_context, whose `state` points to its live CtxState.
    unsafe {
        let vctx = (ctx as *mut u8).sub(offset_of!(VerbsContext, context)) as *mut SrContext;
        &*(*vctx).state
    }
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
        let mut conn = conn;
        let key = match context_key(&mut conn) {
            Ok(k) => k,
            Err(e) => {
                eprintln!("softrnic: the NIC engine gave no context key: {e}");
                // SAFETY: we own cmd_fd on failure.
                unsafe { libc::close(cmd_fd) };
                set_errno(libc::EIO);
                return null_mut();
            }
        };
        let st = Box::new(CtxState {
            conn: Mutex::new(EngineConn {
                stream: conn,
                pid: std::process::id(),
            }),
            key,
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

/// The key with which processes forked from this one join the context of `conn`.
fn context_key(conn: &mut UnixStream) -> Result<(u64, u64), proto::WireError> {
    let req = Req::ContextKey;
    proto::write_frame(conn, &req.encode())?;
    match Resp::decode(&req, &proto::read_frame(conn)?)? {
        Resp::ContextKey { conn, token } => Ok((conn, token)),
        _ => Err(proto::WireError::Truncated),
    }
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
            if attr_size >= DEVICE_ATTR_EX_PACKET_PACING + 12 {
                let b = (attr as *mut u8).add(DEVICE_ATTR_EX_PACKET_PACING) as *mut u32;
                let qpts = device::PP_QP_TYPES.iter().fold(0u32, |m, t| m | 1 << t);
                b.write_unaligned(device::PP_RATE_MIN_KBPS);
                b.add(1).write_unaligned(device::PP_RATE_MAX_KBPS);
                b.add(2).write_unaligned(qpts);
            }
            if attr_size >= DEVICE_ATTR_EX_CAP_FLAGS_EX + 8 {
                (attr as *mut u8)
                    .add(DEVICE_ATTR_EX_CAP_FLAGS_EX)
                    .cast::<u64>()
                    .write_unaligned(device::DEVICE_CAP_FLAGS);
            }
            if attr_size >= DEVICE_ATTR_EX_PHYS_PORT_CNT + 4 {
                (attr as *mut u8)
                    .add(DEVICE_ATTR_EX_PHYS_PORT_CNT)
                    .cast::<u32>()
                    .write_unaligned(1);
            }
            if attr_size >= DEVICE_ATTR_EX_MAX_DM_SIZE + 8 {
                (attr as *mut u8)
                    .add(DEVICE_ATTR_EX_MAX_DM_SIZE)
                    .cast::<u64>()
                    .write_unaligned(device::MAX_DM_SIZE);
            }
            // On-demand paging: the engine reaches a process's memory page by page as it
            // moves data (it never pins), so every MR is on demand by nature.
            if attr_size >= DEVICE_ATTR_EX_ODP_XRC + 4 {
                let b = attr as *mut u8;
                (b.add(DEVICE_ATTR_EX_ODP_GENERAL) as *mut u64)
                    .write_unaligned(device::ODP_GENERAL_CAPS);
                for (at, caps) in [
                    (DEVICE_ATTR_EX_ODP_RC, device::ODP_RC_CAPS),
                    (DEVICE_ATTR_EX_ODP_UC, device::ODP_UC_CAPS),
                    (DEVICE_ATTR_EX_ODP_UD, device::ODP_UD_CAPS),
                    (DEVICE_ATTR_EX_ODP_XRC, device::ODP_RC_CAPS),
                ] {
                    (b.add(at) as *mut u32).write_unaligned(caps);
                }
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
// PD and MR
// ---------------------------------------------------------------------------------------------

/// An engine call that answers with a handle (alloc_pd, alloc_mw). On failure errno is set —
/// EIO for any other answer — and None returned: allocation verbs report failure as NULL.
fn call_for_handle(st: &CtxState, req: &Req) -> Option<u32> {
    call_expect(st, req, |r| match r {
        Resp::Handle(h) => Some(h),
        _ => None,
    })
}

/// An engine call whose answer `pick` takes apart. On failure errno is set — EIO for an
/// answer of another kind — and None returned: creation verbs report failure as NULL.
fn call_expect<T>(st: &CtxState, req: &Req, pick: impl FnOnce(Resp) -> Option<T>) -> Option<T> {
    match st.call(req) {
        Ok(r) => pick(r).or_else(|| {
            set_errno(libc::EIO);
            None
        }),
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
