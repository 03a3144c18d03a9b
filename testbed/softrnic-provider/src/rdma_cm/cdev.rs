//! `/dev/infiniband/rdma_cm` inside the program: the preloaded provider interposes `open`,
//! `fstat`, `write` and `close`. Opening the device node (`softrnic exec` makes one) gives the
//! program an eventfd in its place, readable while events wait, as the kernel's file is; every
//! command librdmacm writes to it is carried out here; and connections between ids are TCP
//! connections between the programs (as iWARP's connection manager uses TCP), carrying the
//! messages of `msg.rs`. Only these four calls on descriptors of this device take a lock; any
//! other call goes straight to libc after one bit test.

use std::collections::HashMap;
use std::ffi::CStr;
use std::io::{Read, Write};
use std::net::{Ipv4Addr, Shutdown, SocketAddrV4, TcpListener, TcpStream, UdpSocket};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

use libc::{c_char, c_int, c_uint, c_void};

use super::abi::{self, Pod};
use super::msg::{Msg, MAX_BODY};
use super::state::{self, Channel, Cm, Device, Handle, Out, State};
use softrnic_abi::device as dev;

/// The node librdmacm opens (`RDMA_CDEV_DIR "/rdma_cm"`).
pub const CDEV_PATH: &[u8] = b"/dev/infiniband/rdma_cm";
const MAX_FDS: usize = 1 << 16;
/// How long a new connection may take to send its first message, and a closed one to be
/// closed by its peer, before the thread reading it gives up.
const IDLE_READ: Duration = Duration::from_secs(10);
/// The kernel's default `net.rdma_ucm.max_backlog`.
const MAX_BACKLOG: u32 = 1024;

static CM_FDS: [AtomicU64; MAX_FDS / 64] = [const { AtomicU64::new(0) }; MAX_FDS / 64];
static DRIVER: Mutex<Option<Driver>> = Mutex::new(None);
static EVENTS: Condvar = Condvar::new();

fn is_cm_fd(fd: c_int) -> bool {
    (0..MAX_FDS as c_int).contains(&fd)
        && CM_FDS[fd as usize / 64].load(Ordering::Acquire) & (1 << (fd % 64)) != 0
}

fn mark(fd: c_int, on: bool) {
    let (w, b) = (&CM_FDS[fd as usize / 64], 1u64 << (fd % 64));
    if on {
        w.fetch_or(b, Ordering::AcqRel);
    } else {
        w.fetch_and(!b, Ordering::AcqRel);
    }
}

// -- the interposed libc calls ------------------------------------------------------------

/// libc's own definition of `name`, found once.
fn next_fn(slot: &AtomicUsize, name: &CStr) -> usize {
    let f = slot.load(Ordering::Acquire);
    if f != 0 {
        return f;
    }
    // SAFETY: RTLD_NEXT lookup of a NUL-terminated name.
    let f = unsafe { libc::dlsym(libc::RTLD_NEXT, name.as_ptr()) } as usize;
    slot.store(f, Ordering::Release);
    f
}

macro_rules! real {
    ($name:literal, $ty:ty) => {{
        static SLOT: AtomicUsize = AtomicUsize::new(0);
        match next_fn(&SLOT, $name) {
            0 => None,
            // SAFETY: the symbol is libc's function of this signature.
            f => Some(unsafe { std::mem::transmute::<usize, $ty>(f) }),
        }
    }};
}

type OpenFn = unsafe extern "C" fn(*const c_char, c_int, c_uint) -> c_int;
type FstatFn = unsafe extern "C" fn(c_int, *mut libc::stat) -> c_int;
type WriteFn = unsafe extern "C" fn(c_int, *const c_void, usize) -> isize;
type CloseFn = unsafe extern "C" fn(c_int) -> c_int;

fn set_errno(e: i32) {
    // SAFETY: errno is this thread's.
    unsafe { *libc::__errno_location() = e };
}

/// `open(2)`. The mode argument is variadic in C; on x86-64 and AArch64 Linux a variadic
/// integer travels where a third fixed one does, so it is read as one.
///
/// # Safety
/// As `open(2)`.
#[no_mangle]
pub unsafe extern "C" fn open(path: *const c_char, flags: c_int, mode: c_uint) -> c_int {
    let Some(real) = real!(c"open", OpenFn) else {
        set_errno(libc::ENOSYS);
        return -1;
    };
    // SAFETY: forwarded unchanged.
    let fd = unsafe { real(path, flags, mode) };
    // SAFETY: open succeeded, so path is a valid C string.
    if fd >= 0 && unsafe { CStr::from_ptr(path) }.to_bytes() == CDEV_PATH {
        return std::panic::catch_unwind(|| adopt(fd, flags)).unwrap_or(fd);
    }
    fd
}

/// `fstat(2)`: a channel reports the device node it was opened as.
///
/// # Safety
/// As `fstat(2)`.
#[no_mangle]
pub unsafe extern "C" fn fstat(fd: c_int, buf: *mut libc::stat) -> c_int {
    if is_cm_fd(fd) {
        if let Some(st) = lock()
            .as_ref()
            .and_then(|d| d.files.get(&fd))
            .map(|f| f.stat)
        {
            // SAFETY: the caller passes a writable struct stat.
            unsafe { buf.write(st) };
            return 0;
        }
    }
    match real!(c"fstat", FstatFn) {
        // SAFETY: forwarded unchanged.
        Some(real) => unsafe { real(fd, buf) },
        None => {
            set_errno(libc::ENOSYS);
            -1
        }
    }
}

/// `write(2)`: on a channel, one RDMA CM command.
///
/// # Safety
/// As `write(2)`.
#[no_mangle]
pub unsafe extern "C" fn write(fd: c_int, buf: *const c_void, count: usize) -> isize {
    if is_cm_fd(fd) {
        return match std::panic::catch_unwind(|| command(fd, buf as usize, count)) {
            Ok(Ok(())) => count as isize,
            Ok(Err(e)) => {
                set_errno(e);
                -1
            }
            Err(_) => {
                set_errno(libc::EIO);
                -1
            }
        };
    }
    match real!(c"write", WriteFn) {
        // SAFETY: forwarded unchanged.
        Some(real) => unsafe { real(fd, buf, count) },
        None => {
            set_errno(libc::ENOSYS);
            -1
        }
    }
}

/// `close(2)`: closing a channel destroys its ids, as releasing the kernel's file does.
///
/// # Safety
/// As `close(2)`.
#[no_mangle]
pub unsafe extern "C" fn close(fd: c_int) -> c_int {
    if is_cm_fd(fd) {
        mark(fd, false);
        let _ = std::panic::catch_unwind(|| {
            let mut g = lock();
            if let Some(d) = g.as_mut() {
                d.cm.close_channel(fd);
                d.files.remove(&fd);
                d.flush();
            }
            EVENTS.notify_all();
        });
    }
    match real!(c"close", CloseFn) {
        // SAFETY: forwarded unchanged.
        Some(real) => unsafe { real(fd) },
        None => {
            set_errno(libc::ENOSYS);
            -1
        }
    }
}

// -- channels -------------------------------------------------------------------------------

struct ChannelFile {
    stat: libc::stat,
    /// The eventfd's counter: kept equal to the events waiting.
    signalled: usize,
}

fn lock() -> MutexGuard<'static, Option<Driver>> {
    DRIVER.lock().unwrap_or_else(|p| p.into_inner())
}

fn warn_once(flag: &AtomicBool, msg: &str) {
    if !flag.swap(true, Ordering::Relaxed) {
        eprintln!("softrnic rdma_cm: {msg}");
    }
}

/// Put an eventfd where the freshly opened device node is, and make it a channel.
fn adopt(fd: c_int, flags: c_int) -> c_int {
    static REFUSED: AtomicBool = AtomicBool::new(false);
    // SAFETY: fd is open; st is a plain C struct.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: libc's fstat, given a valid, writable stat buffer.
    let ok = real!(c"fstat", FstatFn).is_some_and(|f| unsafe { f(fd, &mut st) } == 0);
    if !ok || st.st_mode & libc::S_IFMT != libc::S_IFCHR || fd as usize >= MAX_FDS {
        warn_once(
            &REFUSED,
            "the device node cannot become a channel; commands will fail",
        );
        return fd;
    }
    let mut ef = libc::EFD_SEMAPHORE | libc::EFD_CLOEXEC;
    if flags & libc::O_NONBLOCK != 0 {
        ef |= libc::EFD_NONBLOCK;
    }
    // SAFETY: plain system calls on descriptors we own.
    unsafe {
        let e = libc::eventfd(0, ef);
        if e < 0 {
            return fd;
        }
        let cloexec = if flags & libc::O_CLOEXEC != 0 {
            libc::O_CLOEXEC
        } else {
            0
        };
        let r = libc::dup3(e, fd, cloexec);
        libc::close(e);
        if r < 0 {
            return fd;
        }
    }
    let mut g = lock();
    let d = g.get_or_insert_with(Driver::new);
    d.cm.open_channel(fd);
    d.files.insert(
        fd,
        ChannelFile {
            stat: st,
            signalled: 0,
        },
    );
    mark(fd, true);
    fd
}

fn nonblocking(fd: c_int) -> bool {
    // SAFETY: F_GETFL on an open descriptor.
    unsafe { libc::fcntl(fd, libc::F_GETFL) & libc::O_NONBLOCK != 0 }
}

/// Add `delta` to (or take it from) an eventfd's counter; the counter never blocks a take,
/// because it only holds what was added.
fn adjust_eventfd(fd: c_int, add: bool, n: usize) {
    let one: u64 = 1;
    for _ in 0..n {
        // SAFETY: 8-byte eventfd transfers on a descriptor that is ours while the lock is held;
        // raw system calls, so they do not come back through the interposed write.
        unsafe {
            if add {
                libc::syscall(libc::SYS_write, fd, &one as *const u64, 8);
            } else {
                let mut v: u64 = 0;
                libc::syscall(libc::SYS_read, fd, &mut v as *mut u64, 8);
            }
        }
    }
}

// -- the program's memory -------------------------------------------------------------------

/// Copy from this process's memory at `addr`; EFAULT where the kernel would say so.
fn read_user(addr: usize, len: usize) -> Result<Vec<u8>, i32> {
    let mut v = vec![0u8; len];
    if len == 0 {
        return Ok(v);
    }
    let local = libc::iovec {
        iov_base: v.as_mut_ptr() as *mut c_void,
        iov_len: len,
    };
    let remote = libc::iovec {
        iov_base: addr as *mut c_void,
        iov_len: len,
    };
    // SAFETY: process_vm_readv checks the remote range; the local one is our buffer.
    let n = unsafe { libc::process_vm_readv(libc::getpid(), &local, 1, &remote, 1, 0) };
    if n != len as isize {
        return Err(libc::EFAULT);
    }
    Ok(v)
}

fn write_user(addr: u64, bytes: &[u8]) -> Result<(), i32> {
    let local = libc::iovec {
        iov_base: bytes.as_ptr() as *mut c_void,
        iov_len: bytes.len(),
    };
    let remote = libc::iovec {
        iov_base: addr as usize as *mut c_void,
        iov_len: bytes.len(),
    };
    // SAFETY: process_vm_writev checks the remote range; the local one is our buffer.
    let n = unsafe { libc::process_vm_writev(libc::getpid(), &local, 1, &remote, 1, 0) };
    if n != bytes.len() as isize {
        return Err(libc::EFAULT);
    }
    Ok(())
}

/// Write an answer of which the program accepts `out` bytes (ENOSPC if too few for it).
fn respond<T: Pod>(addr: u64, out: u16, v: &T) -> Result<(), i32> {
    let b = v.as_bytes();
    if (out as usize) < b.len() {
        return Err(libc::ENOSPC);
    }
    write_user(addr, b)
}

fn random_psn() -> u32 {
    let mut v: u32 = 0;
    // SAFETY: 4 writable bytes.
    unsafe { libc::getrandom(&mut v as *mut u32 as *mut c_void, 4, 0) };
    v & 0xff_ffff
}

// -- commands -------------------------------------------------------------------------------

fn command(fd: c_int, buf: usize, len: usize) -> Result<(), i32> {
    let hb = read_user(buf, len.min(size_of::<abi::CmdHdr>()))?;
    if hb.len() < size_of::<abi::CmdHdr>() {
        return Err(libc::EINVAL);
    }
    let hdr = abi::CmdHdr::from_prefix(&hb);
    if hdr.in_ as usize + size_of::<abi::CmdHdr>() > len {
        return Err(libc::EINVAL);
    }
    let input = read_user(buf + size_of::<abi::CmdHdr>(), hdr.in_ as usize)?;
    if hdr.cmd == abi::CMD_GET_EVENT {
        return get_event(fd, abi::GetEvent::from_prefix(&input), hdr.out);
    }
    let mut g = lock();
    let d = g.as_mut().ok_or(libc::EBADF)?;
    let r = d.command(fd, hdr, &input);
    d.flush();
    drop(g);
    EVENTS.notify_all();
    r
}

fn get_event(fd: c_int, c: abi::GetEvent, out: u16) -> Result<(), i32> {
    let size = size_of::<abi::EventResp>();
    if (out as usize) < size {
        return Err(libc::ENOSPC);
    }
    // The answer must be writable before an event is taken, or the event would be lost.
    write_user(c.response, &vec![0u8; size])?;
    let mut g = lock();
    let mut waited = false;
    loop {
        let d = g.as_mut().ok_or(libc::EBADF)?;
        match d.cm.get_event(fd) {
            Ok(Some(ev)) => {
                d.sync_readiness();
                return write_user(c.response, ev.to_abi().as_bytes());
            }
            Ok(None) if nonblocking(fd) => return Err(libc::EAGAIN),
            Ok(None) => {}
            // Closed by another thread while this one waited: in the kernel this call would
            // hold the file open, and wait on.
            Err(_) if waited => {}
            Err(e) => return Err(e),
        }
        waited = true;
        g = EVENTS.wait(g).unwrap_or_else(|p| p.into_inner());
    }
}

struct Driver {
    cm: Cm,
    files: HashMap<Channel, ChannelFile>,
    /// Sockets bound for ids that neither connect nor listen yet (the port is theirs).
    bound: HashMap<Handle, OwnedFd>,
    /// The sending side of each id's connection.
    conns: HashMap<Handle, TcpStream>,
    listeners: HashMap<Handle, Arc<TcpListener>>,
    host_ip: Option<Ipv4Addr>,
}

impl Driver {
    fn new() -> Driver {
        Driver {
            cm: Cm::new(device_from_sysfs()),
            files: HashMap::new(),
            bound: HashMap::new(),
            conns: HashMap::new(),
            listeners: HashMap::new(),
            host_ip: std::env::var("SOFTRNIC_HOST_IP")
                .ok()
                .and_then(|s| s.parse().ok()),
        }
    }

    fn command(&mut self, fd: c_int, hdr: abi::CmdHdr, input: &[u8]) -> Result<(), i32> {
        use abi::*;
        match hdr.cmd {
            CMD_CREATE_ID => {
                let c = CreateId::from_prefix(input);
                if (hdr.out as usize) < size_of::<CreateIdResp>() {
                    return Err(libc::ENOSPC);
                }
                let h = self
                    .cm
                    .create_id(fd, c.uid, c.ps, c.qp_type, random_psn())?;
                respond(c.response, hdr.out, &CreateIdResp { id: h }).inspect_err(|_| {
                    let _ = self.cm.destroy_id(fd, h);
                })
            }
            CMD_DESTROY_ID => {
                let c = DestroyId::from_prefix(input);
                if (hdr.out as usize) < size_of::<EventsReportedResp>() {
                    return Err(libc::ENOSPC);
                }
                let n = self.cm.destroy_id(fd, c.id)?;
                respond(
                    c.response,
                    hdr.out,
                    &EventsReportedResp { events_reported: n },
                )
            }
            CMD_BIND_IP => {
                let c = BindIp::from_prefix(input);
                let a = state::parse_sockaddr(&c.addr)?.ok_or(libc::EINVAL)?;
                self.bind(fd, c.id, a)
            }
            CMD_BIND => {
                let c = Bind::from_prefix(input);
                let n = (c.addr_size as usize).min(c.addr.len());
                let a = state::parse_sockaddr(&c.addr[..n])?.ok_or(libc::EINVAL)?;
                self.bind(fd, c.id, a)
            }
            CMD_RESOLVE_IP => {
                let c = ResolveIp::from_prefix(input);
                let src = state::parse_sockaddr(&c.src_addr)?;
                let dst = state::parse_sockaddr(&c.dst_addr)?.ok_or(libc::EINVAL)?;
                self.resolve(fd, c.id, src, dst)
            }
            CMD_RESOLVE_ADDR => {
                let c = ResolveAddr::from_prefix(input);
                let src = if c.src_size == 0 {
                    None
                } else {
                    state::parse_sockaddr(&c.src_addr)?
                };
                let dst = state::parse_sockaddr(&c.dst_addr)?.ok_or(libc::EINVAL)?;
                self.resolve(fd, c.id, src, dst)
            }
            CMD_RESOLVE_ROUTE => {
                let c = ResolveRoute::from_prefix(input);
                self.cm.resolve_route(fd, c.id)
            }
            CMD_QUERY_ROUTE => {
                let c = Query::from_prefix(input);
                let r = self.cm.query_route(fd, c.id)?;
                respond(c.response, hdr.out, &r)
            }
            CMD_CONNECT => {
                let c = Connect::from_prefix(input);
                self.cm
                    .connect(fd, c.id, state::ConnParam::from_abi(&c.conn_param))
            }
            CMD_LISTEN => {
                let c = Listen::from_prefix(input);
                self.listen(fd, c.id, c.backlog)
            }
            CMD_ACCEPT => {
                let c = Accept::from_prefix(input);
                let p =
                    (c.conn_param.valid != 0).then(|| state::ConnParam::from_abi(&c.conn_param));
                self.cm.accept(fd, c.id, c.uid, p)
            }
            CMD_REJECT => {
                let c = Reject::from_prefix(input);
                let n = (c.private_data_len as usize).min(MAX_PRIVATE_DATA);
                self.cm
                    .reject(fd, c.id, c.reason, c.private_data[..n].to_vec())
            }
            CMD_DISCONNECT => self.cm.disconnect(fd, IdOnly::from_prefix(input).id),
            CMD_INIT_QP_ATTR => {
                let c = InitQpAttr::from_prefix(input);
                if (hdr.out as usize) < size_of::<UverbsQpAttr>() {
                    return Err(libc::ENOSPC);
                }
                let a = self.cm.init_qp_attr(fd, c.id, c.qp_state)?;
                respond(c.response, hdr.out, &a)
            }
            CMD_SET_OPTION => {
                let c = SetOption::from_prefix(input);
                if c.optlen > 4096 {
                    return Err(libc::EINVAL);
                }
                let val = read_user(c.optval as usize, c.optlen as usize)?;
                self.cm.set_option(fd, c.id, c.level, c.optname, &val)
            }
            CMD_NOTIFY => self.cm.notify(fd, Notify::from_prefix(input).id),
            CMD_MIGRATE_ID => {
                let c = MigrateId::from_prefix(input);
                if (hdr.out as usize) < size_of::<EventsReportedResp>() {
                    return Err(libc::ENOSPC);
                }
                let from = c.fd as c_int;
                if !is_cm_fd(from) {
                    return Err(libc::EINVAL);
                }
                let n = self.cm.migrate(fd, from, c.id)?;
                respond(
                    c.response,
                    hdr.out,
                    &EventsReportedResp { events_reported: n },
                )
            }
            CMD_JOIN_IP_MCAST => {
                let c = JoinIpMcast::from_prefix(input);
                let a = state::parse_sockaddr(&c.addr)?.ok_or(libc::EINVAL)?;
                self.join(fd, hdr.out, c.response, (c.id, c.uid), a)
            }
            CMD_JOIN_MCAST => {
                let c = JoinMcast::from_prefix(input);
                let n = (c.addr_size as usize).min(c.addr.len());
                let a = state::parse_sockaddr(&c.addr[..n])?.ok_or(libc::EINVAL)?;
                self.join(fd, hdr.out, c.response, (c.id, c.uid), a)
            }
            CMD_LEAVE_MCAST => {
                let c = DestroyId::from_prefix(input);
                if (hdr.out as usize) < size_of::<EventsReportedResp>() {
                    return Err(libc::ENOSPC);
                }
                let n = self.cm.leave_mcast(fd, c.id)?;
                respond(
                    c.response,
                    hdr.out,
                    &EventsReportedResp { events_reported: n },
                )
            }
            // The kernel has no GET_OPTION; QUERY (AF_IB queries) is never sent once BIND
            // refused AF_IB.
            CMD_GET_OPTION | CMD_QUERY => Err(libc::ENOSYS),
            _ => Err(libc::EINVAL),
        }
    }

    /// JOIN_IP_MCAST / JOIN_MCAST of id `h` with the program's `uid` for the membership.
    fn join(
        &mut self,
        fd: c_int,
        out: u16,
        response: u64,
        (h, uid): (Handle, u64),
        group: SocketAddrV4,
    ) -> Result<(), i32> {
        if (out as usize) < size_of::<abi::CreateIdResp>() {
            return Err(libc::ENOSPC);
        }
        let m = self.cm.join_mcast(fd, h, uid, *group.ip())?;
        respond(response, out, &abi::CreateIdResp { id: m }).inspect_err(|_| {
            let _ = self.cm.leave_mcast(fd, m);
        })
    }

    fn bind(&mut self, fd: c_int, h: Handle, a: SocketAddrV4) -> Result<(), i32> {
        self.cm.check(fd, h, &[State::Idle])?;
        let (sock, actual) = bind_socket(a)?;
        self.cm.bind(fd, h, actual)?;
        self.bound.insert(h, sock);
        Ok(())
    }

    fn resolve(
        &mut self,
        fd: c_int,
        h: Handle,
        src: Option<SocketAddrV4>,
        dst: SocketAddrV4,
    ) -> Result<(), i32> {
        let st = self
            .cm
            .check(fd, h, &[State::Idle, State::Bound, State::AddrResolved])?;
        // A multicast group needs no route: the port reaches it (see the engine's
        // multicast.rs).
        let route = if dst.ip().is_multicast() {
            Some(self.host_ip.unwrap_or(Ipv4Addr::UNSPECIFIED))
        } else {
            route_source(dst)
        };
        let Some(route_ip) = route else {
            return self.cm.resolve_ip_failed(fd, h, libc::ENETUNREACH);
        };
        let bound = self.cm.src(h);
        let ip = [src.map(|s| *s.ip()), bound.map(|b| *b.ip()), self.host_ip]
            .into_iter()
            .flatten()
            .find(|ip| !ip.is_unspecified())
            .unwrap_or(route_ip);
        let port = match (st, bound) {
            (State::Idle, _) => {
                let want = SocketAddrV4::new(ip, src.map_or(0, |s| s.port()));
                let (sock, actual) = bind_socket(want)?;
                self.bound.insert(h, sock);
                actual.port()
            }
            (_, Some(b)) => b.port(),
            (_, None) => 0,
        };
        self.cm.resolve_ip(fd, h, SocketAddrV4::new(ip, port), dst)
    }

    fn listen(&mut self, fd: c_int, h: Handle, backlog: u32) -> Result<(), i32> {
        if self.cm.check(fd, h, &[State::Idle, State::Bound])? == State::Idle {
            self.bind(fd, h, SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 0))?;
        }
        let sock = self.bound.remove(&h).ok_or(libc::EINVAL)?;
        // The kernel reads 0 or anything above its limit (net.rdma_ucm.max_backlog) as the
        // limit, 1024; the accepting thread takes connections at once, so TCP's queue only
        // absorbs bursts.
        let backlog = if backlog == 0 {
            MAX_BACKLOG
        } else {
            backlog.min(MAX_BACKLOG)
        };
        // SAFETY: listen on a bound socket we own.
        if unsafe { libc::listen(sock.as_raw_fd(), backlog as c_int) } != 0 {
            let e = std::io::Error::last_os_error()
                .raw_os_error()
                .unwrap_or(libc::EIO);
            self.bound.insert(h, sock);
            return Err(e);
        }
        self.cm.listen(fd, h)?;
        let l = Arc::new(TcpListener::from(sock));
        self.listeners.insert(h, l.clone());
        spawn(move || accept_loop(h, l));
        Ok(())
    }

    /// Carry out what the state asked for, then bring each channel's readiness up to date.
    fn flush(&mut self) {
        for o in self.cm.take_out() {
            match o {
                Out::Connect {
                    handle,
                    from,
                    to,
                    first,
                } => {
                    let sock = self.bound.remove(&handle);
                    spawn(move || active_connection(handle, sock, from, to, first));
                }
                Out::Send(h, m) => {
                    if let (Some(s), Ok(b)) = (self.conns.get_mut(&h), m.encode()) {
                        let _ = s.write_all(&b);
                    }
                }
                Out::Close(h) => {
                    self.bound.remove(&h);
                    if let Some(s) = self.conns.remove(&h) {
                        let _ = s.shutdown(Shutdown::Write);
                        let _ = s.set_read_timeout(Some(IDLE_READ));
                    }
                    if let Some(l) = self.listeners.remove(&h) {
                        // SAFETY: the listener is open (we hold it); shutdown wakes its accept.
                        unsafe { libc::shutdown(l.as_raw_fd(), libc::SHUT_RDWR) };
                    }
                }
            }
        }
        self.sync_readiness();
    }

    fn sync_readiness(&mut self) {
        let queued: Vec<(Channel, usize)> = self.cm.queued().collect();
        for (ch, n) in queued {
            if let Some(f) = self.files.get_mut(&ch) {
                if n != f.signalled {
                    adjust_eventfd(ch, n > f.signalled, n.abs_diff(f.signalled));
                    f.signalled = n;
                }
            }
        }
    }
}

fn spawn(f: impl FnOnce() + Send + 'static) {
    static FAILED: AtomicBool = AtomicBool::new(false);
    if std::thread::Builder::new()
        .name("softrnic-rdmacm".into())
        .spawn(f)
        .is_err()
    {
        warn_once(&FAILED, "cannot start a thread; a connection is dropped");
    }
}

/// The device the ids bind to: the host's softrnic device, as its sysfs tree describes it.
fn device_from_sysfs() -> Option<Device> {
    let root = std::env::var("SYSFS_PATH").ok()?;
    let ib = format!("{root}/class/infiniband/{}", dev::IBDEV_NAME);
    let guid = std::fs::read_to_string(format!("{ib}/node_guid")).ok()?;
    let guid = u64::from_str_radix(&guid.trim().replace(':', ""), 16).ok()?;
    let gid = std::fs::read_to_string(format!("{ib}/ports/1/gids/0")).ok()?;
    let mtu = std::fs::read_to_string(format!("{ib}/softrnic_mtu"))
        .ok()
        .and_then(|m| dev::mtu_enum(m.trim().parse().ok()?))
        .unwrap_or(drum_verbs_abi::consts::IBV_MTU_4096);
    Some(Device {
        node_guid_be: guid.to_be(),
        gid: dev::parse_gid_sysfs(gid.trim())?,
        mtu: mtu as u32,
    })
}

/// The source address the host's routes choose for `dst`; None if there is no route.
fn route_source(dst: SocketAddrV4) -> Option<Ipv4Addr> {
    let s = UdpSocket::bind("0.0.0.0:0").ok()?;
    s.connect(SocketAddrV4::new(*dst.ip(), dst.port().max(1)))
        .ok()?;
    match s.local_addr().ok()? {
        std::net::SocketAddr::V4(a) => Some(*a.ip()),
        std::net::SocketAddr::V6(_) => None,
    }
}

fn os_err() -> i32 {
    std::io::Error::last_os_error()
        .raw_os_error()
        .unwrap_or(libc::EIO)
}

/// A TCP socket bound to `a`, and the address it got (the port filled in).
fn bind_socket(a: SocketAddrV4) -> Result<(OwnedFd, SocketAddrV4), i32> {
    // SAFETY: plain socket calls on a descriptor we own from creation.
    unsafe {
        let s = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
        if s < 0 {
            return Err(os_err());
        }
        let s = OwnedFd::from_raw_fd(s);
        // Ports come back at once when a program ends, as the kernel's rdma_cm ports do, not
        // after TCP's TIME_WAIT.
        let one: c_int = 1;
        libc::setsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_REUSEADDR,
            &one as *const c_int as *const c_void,
            4,
        );
        let sa = libc::sockaddr_in {
            sin_family: libc::AF_INET as u16,
            sin_port: a.port().to_be(),
            sin_addr: libc::in_addr {
                s_addr: u32::from(*a.ip()).to_be(),
            },
            sin_zero: [0; 8],
        };
        let len = size_of::<libc::sockaddr_in>() as libc::socklen_t;
        if libc::bind(s.as_raw_fd(), &sa as *const _ as *const libc::sockaddr, len) != 0 {
            return Err(os_err());
        }
        let mut got: libc::sockaddr_in = std::mem::zeroed();
        let mut gl = len;
        libc::getsockname(
            s.as_raw_fd(),
            &mut got as *mut _ as *mut libc::sockaddr,
            &mut gl,
        );
        let actual = SocketAddrV4::new(*a.ip(), u16::from_be(got.sin_port));
        Ok((s, actual))
    }
}

fn connect_socket(s: &OwnedFd, to: SocketAddrV4) -> Result<(), i32> {
    let sa = libc::sockaddr_in {
        sin_family: libc::AF_INET as u16,
        sin_port: to.port().to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from(*to.ip()).to_be(),
        },
        sin_zero: [0; 8],
    };
    // Give up on an address nobody answers after about 7 s, as CM REQ retries would.
    let syncnt: c_int = 2;
    // SAFETY: socket calls on a descriptor we own; sa outlives the call.
    unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_SYNCNT,
            &syncnt as *const c_int as *const c_void,
            4,
        );
        if libc::connect(
            s.as_raw_fd(),
            &sa as *const _ as *const libc::sockaddr,
            size_of::<libc::sockaddr_in>() as libc::socklen_t,
        ) != 0
        {
            return Err(os_err());
        }
    }
    Ok(())
}

// -- connection threads ---------------------------------------------------------------------

fn read_msg(s: &mut TcpStream) -> std::io::Result<Msg> {
    let mut len = [0u8; 2];
    s.read_exact(&mut len)?;
    let n = u16::from_be_bytes(len) as usize;
    if n > MAX_BODY {
        return Err(std::io::Error::other(format!("message of {n} bytes")));
    }
    let mut body = vec![0u8; n];
    s.read_exact(&mut body)?;
    Msg::decode(&body).map_err(std::io::Error::other)
}

fn log_bad_peer(e: &std::io::Error) {
    static SAID: AtomicBool = AtomicBool::new(false);
    if e.get_ref().is_some() {
        warn_once(
            &SAID,
            &format!("dropped a connection that broke the protocol: {e}"),
        );
    }
}

/// Read the peer's messages of id `h` until the connection ends.
fn reader(h: Handle, mut s: TcpStream) {
    loop {
        match read_msg(&mut s) {
            Ok(m) => {
                let mut g = lock();
                if let Some(d) = g.as_mut() {
                    d.cm.on_msg(h, m);
                    d.flush();
                }
            }
            Err(e) => {
                log_bad_peer(&e);
                let mut g = lock();
                if let Some(d) = g.as_mut() {
                    d.cm.on_lost(h);
                    d.flush();
                }
                drop(g);
                EVENTS.notify_all();
                return;
            }
        }
        EVENTS.notify_all();
    }
}

fn active_connection(
    h: Handle,
    sock: Option<OwnedFd>,
    from: SocketAddrV4,
    to: SocketAddrV4,
    first: Msg,
) {
    let r = sock
        .map_or_else(|| bind_socket(from).map(|(s, _)| s), Ok)
        .and_then(|s| connect_socket(&s, to).map(|()| s));
    let mut g = lock();
    let Some(d) = g.as_mut() else { return };
    let s = match r {
        Ok(s) => TcpStream::from(s),
        Err(e) => {
            d.cm.connect_failed(h, e == libc::ECONNREFUSED);
            d.flush();
            drop(g);
            EVENTS.notify_all();
            return;
        }
    };
    if d.cm.state(h) != Some(State::ReqSent) {
        return;
    }
    let _ = s.set_nodelay(true);
    let (Ok(mut w), Ok(b)) = (s.try_clone(), first.encode()) else {
        d.cm.connect_failed(h, false);
        d.flush();
        return;
    };
    let _ = w.write_all(&b);
    d.conns.insert(h, w);
    drop(g);
    reader(h, s);
}

fn accept_loop(l: Handle, listener: Arc<TcpListener>) {
    loop {
        match listener.accept() {
            Ok((s, _)) => spawn(move || passive_connection(l, s)),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => return,
        }
        // A listener that was closed stops taking connections.
        let gone = lock()
            .as_ref()
            .is_none_or(|d| !d.listeners.contains_key(&l));
        if gone {
            return;
        }
    }
}

fn passive_connection(l: Handle, mut s: TcpStream) {
    let _ = s.set_nodelay(true);
    let _ = s.set_read_timeout(Some(IDLE_READ));
    let first = match read_msg(&mut s) {
        Ok(m) => m,
        Err(e) => return log_bad_peer(&e),
    };
    let (Ok(std::net::SocketAddr::V4(peer)), Ok(std::net::SocketAddr::V4(local))) =
        (s.peer_addr(), s.local_addr())
    else {
        return;
    };
    let Ok(w) = s.try_clone() else { return };
    let mut g = lock();
    let Some(d) = g.as_mut() else { return };
    let Some(h) = d.cm.conn_request(l, peer, local, random_psn(), first) else {
        return;
    };
    d.conns.insert(h, w);
    d.flush();
    drop(g);
    EVENTS.notify_all();
    let _ = s.set_read_timeout(None);
    reader(h, s);
}
