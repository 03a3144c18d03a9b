//! Thin owners of verbs objects (freed on drop) and the data-path calls.
//!
//! `ibv_post_send`, `ibv_post_recv`, `ibv_poll_cq` and `ibv_req_notify_cq` are `static inline`
//! in `<infiniband/verbs.h>`: they call through the context's `ops` table, and that is what a
//! governing shim (DRUM's) replaces. rdma-sys 0.3 writes them in Rust the same way
//! (`(*(*qp).context).ops.post_send`), so calling its versions is calling through the table;
//! `data_path_goes_through_context_ops` checks it.

use rdma_sys::*;
use std::ptr::null_mut;
use std::sync::Arc;

/// The OS error of a verbs call that failed, named.
pub fn os_error(what: &str) -> anyhow::Error {
    anyhow::anyhow!("{what}: {}", std::io::Error::last_os_error())
}

/// A call that returns an errno (or -1 and errno) on failure.
pub fn check(rc: i32, what: &str) -> anyhow::Result<()> {
    if rc == 0 {
        return Ok(());
    }
    let e = if rc > 0 {
        std::io::Error::from_raw_os_error(rc)
    } else {
        std::io::Error::last_os_error()
    };
    Err(anyhow::anyhow!("{what}: {e}"))
}

/// Zeroed, page-aligned memory to register (the NIC moves it, so it never moves).
pub struct Buffer {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the memory is owned; concurrent access is coordinated by its users (each part of a
// buffer has one owner at a time, and the NIC's accesses are ordered by completions).
unsafe impl Send for Buffer {}
// SAFETY: as for `Send`: shared use is ordered by the verbs' own thread safety and, for
// memory, by one owner per range at a time.
unsafe impl Sync for Buffer {}

/// A transparent huge page: buffers of at least this size are aligned to it and asked to be
/// backed by huge pages.
const HUGE_PAGE: usize = 2 << 20;

impl Buffer {
    fn layout(len: usize) -> std::alloc::Layout {
        let align = if len >= HUGE_PAGE { HUGE_PAGE } else { 4096 };
        std::alloc::Layout::from_size_align(len.max(1), align).expect("buffer layout")
    }

    /// Large buffers get transparent huge pages where the kernel offers them (as RDMA
    /// applications use huge pages to keep the NIC's translations few): a NIC that walks the
    /// page tables of the memory it moves — softrnic's engines, by `process_vm_readv/writev`
    /// — walks one entry per 2 MiB instead of per 4 KiB.
    pub fn new(len: usize) -> anyhow::Result<Buffer> {
        let layout = Self::layout(len);
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { std::alloc::alloc(layout) };
        anyhow::ensure!(!ptr.is_null(), "cannot allocate {len} bytes");
        if layout.align() == HUGE_PAGE {
            // SAFETY: advice on our own, untouched allocation; failure (no THP) is harmless.
            unsafe { libc::madvise(ptr.cast(), len, libc::MADV_HUGEPAGE) };
        }
        // SAFETY: `len` bytes are ours; zeroed after the advice so the first touch faults in
        // huge pages.
        unsafe { ptr.write_bytes(0, len) };
        Ok(Buffer { ptr, len })
    }

    pub fn ptr(&self) -> *mut u8 {
        self.ptr
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// `len` bytes at `off`.
    ///
    /// # Safety
    /// Nobody else (thread or NIC) writes the range while the slice lives.
    pub unsafe fn slice(&self, off: usize, len: usize) -> &[u8] {
        assert!(off + len <= self.len);
        // SAFETY: in bounds (asserted) of our allocation; the caller excludes writers.
        unsafe { std::slice::from_raw_parts(self.ptr.add(off), len) }
    }

    /// `len` bytes at `off`, to write.
    ///
    /// # Safety
    /// Nobody else (thread or NIC) accesses the range while the slice lives.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slice_mut(&self, off: usize, len: usize) -> &mut [u8] {
        assert!(off + len <= self.len);
        // SAFETY: in bounds (asserted) of our allocation; the caller excludes other access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(off), len) }
    }
}

impl Drop for Buffer {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with the same layout.
        unsafe { std::alloc::dealloc(self.ptr, Self::layout(self.len)) }
    }
}

pub struct Pd(pub *mut ibv_pd);

// SAFETY: verbs objects may be used from any thread.
unsafe impl Send for Pd {}
// SAFETY: as for `Send`: libibverbs' verbs on one object are thread-safe.
unsafe impl Sync for Pd {}

impl Pd {
    pub fn new(ctx: *mut ibv_context) -> anyhow::Result<Arc<Pd>> {
        // SAFETY: ctx is an open context (from a connected RDMA CM id).
        let pd = unsafe { ibv_alloc_pd(ctx) };
        if pd.is_null() {
            return Err(os_error("ibv_alloc_pd"));
        }
        Ok(Arc::new(Pd(pd)))
    }
}

impl Drop for Pd {
    fn drop(&mut self) {
        // SAFETY: allocated in `new`; every MR and QP of it is gone (they hold an Arc).
        unsafe { ibv_dealloc_pd(self.0) };
    }
}

/// A registered buffer: owned, or (the store) borrowed from an owner that outlives it.
pub struct Mr {
    mr: *mut ibv_mr,
    pub buf: Option<Buffer>,
    _pd: Arc<Pd>,
}

// SAFETY: see Buffer and Pd.
unsafe impl Send for Mr {}
// SAFETY: as for `Send`: libibverbs' verbs on one object are thread-safe.
unsafe impl Sync for Mr {}

impl Mr {
    pub fn new(pd: &Arc<Pd>, buf: Buffer) -> anyhow::Result<Mr> {
        // SAFETY: the buffer is owned by the registration.
        let mut mr = unsafe { Mr::register(pd, &buf, false)? };
        mr.buf = Some(buf);
        Ok(mr)
    }

    /// Registers `buf` for remote READs without owning it.
    ///
    /// # Safety
    /// `buf` outlives the registration.
    pub unsafe fn register(pd: &Arc<Pd>, buf: &Buffer, remote_read: bool) -> anyhow::Result<Mr> {
        let mut access = ibv_access_flags::IBV_ACCESS_LOCAL_WRITE;
        if remote_read {
            access |= ibv_access_flags::IBV_ACCESS_REMOTE_READ;
        }
        // SAFETY: the PD is alive (held by `pd`) and `buf` is valid for its length; the
        // caller keeps it alive as long as the registration.
        let mr = unsafe { ibv_reg_mr(pd.0, buf.ptr().cast(), buf.len(), access.0 as i32) };
        if mr.is_null() {
            return Err(os_error("ibv_reg_mr"));
        }
        Ok(Mr {
            mr,
            buf: None,
            _pd: pd.clone(),
        })
    }

    pub fn lkey(&self) -> u32 {
        // SAFETY: registered until drop.
        unsafe { (*self.mr).lkey }
    }

    pub fn rkey(&self) -> u32 {
        // SAFETY: registered until drop.
        unsafe { (*self.mr).rkey }
    }

    /// The address of byte `off` of the registered memory.
    pub fn addr(&self, off: usize) -> u64 {
        // SAFETY: registered until drop.
        unsafe { (*self.mr).addr as u64 + off as u64 }
    }

    /// The owned buffer.
    pub fn buffer(&self) -> &Buffer {
        self.buf.as_ref().expect("an owned registration")
    }
}

impl Drop for Mr {
    fn drop(&mut self) {
        // SAFETY: registered in `register`; its QPs are destroyed before (owners drop them
        // first). The owned buffer (a field) is freed after.
        unsafe { ibv_dereg_mr(self.mr) };
    }
}

/// A completion queue, with its completion channel when completions are waited for.
pub struct Cq {
    pub cq: *mut ibv_cq,
    pub channel: *mut ibv_comp_channel,
}

// SAFETY: verbs objects may be used from any thread.
unsafe impl Send for Cq {}
// SAFETY: as for `Send`: libibverbs' verbs on one object are thread-safe.
unsafe impl Sync for Cq {}

impl Cq {
    pub fn new(ctx: *mut ibv_context, depth: usize, events: bool) -> anyhow::Result<Cq> {
        let channel = if events {
            // SAFETY: ctx is open.
            let ch = unsafe { ibv_create_comp_channel(ctx) };
            if ch.is_null() {
                return Err(os_error("ibv_create_comp_channel"));
            }
            // Non-blocking, so a thread that finds the event taken by another does not hang.
            // SAFETY: fd belongs to the channel.
            unsafe {
                let fd = (*ch).fd;
                libc::fcntl(
                    fd,
                    libc::F_SETFL,
                    libc::fcntl(fd, libc::F_GETFL) | libc::O_NONBLOCK,
                );
            }
            ch
        } else {
            null_mut()
        };
        // SAFETY: ctx is open; channel is null or ours.
        let cq = unsafe { ibv_create_cq(ctx, depth as i32, null_mut(), channel, 0) };
        if cq.is_null() {
            let e = os_error("ibv_create_cq");
            if !channel.is_null() {
                // SAFETY: created above, no CQ uses it.
                unsafe { ibv_destroy_comp_channel(channel) };
            }
            return Err(e);
        }
        Ok(Cq { cq, channel })
    }

    /// Up to `wcs.len()` completions.
    pub fn poll(&self, wcs: &mut [ibv_wc]) -> anyhow::Result<usize> {
        // SAFETY: the CQ is alive; wcs has room for the count asked.
        let n = unsafe { ibv_poll_cq(self.cq, wcs.len() as i32, wcs.as_mut_ptr()) };
        anyhow::ensure!(n >= 0, "ibv_poll_cq failed ({n})");
        Ok(n as usize)
    }

    /// Asks for an event at the next completion.
    pub fn arm(&self) -> anyhow::Result<()> {
        // SAFETY: the CQ is alive.
        check(
            unsafe { ibv_req_notify_cq(self.cq, 0) },
            "ibv_req_notify_cq",
        )
    }

    /// Takes a pending completion event if there is one (the channel is non-blocking).
    pub fn take_event(&self) -> bool {
        let mut cq = null_mut();
        let mut ctx = null_mut();
        // SAFETY: the channel is ours and non-blocking.
        if unsafe { ibv_get_cq_event(self.channel, &mut cq, &mut ctx) } == 0 {
            // SAFETY: one event taken from this CQ.
            unsafe { ibv_ack_cq_events(cq, 1) };
            true
        } else {
            false
        }
    }

    pub fn fd(&self) -> i32 {
        // SAFETY: only called with a channel.
        unsafe { (*self.channel).fd }
    }
}

impl Drop for Cq {
    fn drop(&mut self) {
        // SAFETY: its QP is destroyed before (owners drop it first); events were acked.
        unsafe {
            ibv_destroy_cq(self.cq);
            if !self.channel.is_null() {
                ibv_destroy_comp_channel(self.channel);
            }
        }
    }
}

/// `n` blank completions to poll into.
pub fn blank_wcs(n: usize) -> Vec<ibv_wc> {
    // SAFETY: ibv_wc is plain data; all zeros is a valid value.
    (0..n).map(|_| unsafe { std::mem::zeroed() }).collect()
}

/// The name of a completion status.
pub fn wc_status(status: u32) -> String {
    // SAFETY: returns a static string for any value.
    unsafe { std::ffi::CStr::from_ptr(ibv_wc_status_str(status)) }
        .to_string_lossy()
        .into_owned()
}

/// One work request of a send-queue batch.
#[derive(Debug, Clone, Copy)]
pub struct SendWr {
    pub wr_id: u64,
    pub addr: u64,
    pub len: u32,
    pub lkey: u32,
    /// `Some((remote address, rkey))`: an RDMA READ into `addr`; `None`: a SEND of it.
    pub read_from: Option<(u64, u32)>,
}

/// Posts `wrs` as one chained list (one `ibv_post_send` call: the paper's batch), every WR
/// signaled; a SEND of at most `max_inline` bytes is inline (its bytes are copied into the
/// work request, so the NIC does not fetch them from memory: for softrnic's engines, a
/// `process_vm_readv` less per message).
pub fn post_send(qp: *mut ibv_qp, max_inline: u32, wrs: &[SendWr]) -> anyhow::Result<()> {
    if wrs.is_empty() {
        return Ok(());
    }
    let mut sges: Vec<ibv_sge> = wrs
        .iter()
        .map(|w| ibv_sge {
            addr: w.addr,
            length: w.len,
            lkey: w.lkey,
        })
        .collect();
    // SAFETY: ibv_send_wr is plain data; zero is a valid start.
    let mut list: Vec<ibv_send_wr> = wrs.iter().map(|_| unsafe { std::mem::zeroed() }).collect();
    let n = list.len();
    let base = list.as_mut_ptr();
    for (i, (wr, w)) in list.iter_mut().zip(wrs).enumerate() {
        wr.wr_id = w.wr_id;
        wr.sg_list = &mut sges[i];
        wr.num_sge = 1;
        wr.send_flags = ibv_send_flags::IBV_SEND_SIGNALED.0;
        wr.next = if i + 1 < n {
            // SAFETY: i + 1 < n: within the list; the last link is null.
            unsafe { base.add(i + 1) }
        } else {
            null_mut()
        };
        match w.read_from {
            Some((remote, rkey)) => {
                wr.opcode = ibv_wr_opcode::IBV_WR_RDMA_READ;
                wr.wr.rdma = rdma_t {
                    remote_addr: remote,
                    rkey,
                };
            }
            None => {
                wr.opcode = ibv_wr_opcode::IBV_WR_SEND;
                if w.len <= max_inline {
                    wr.send_flags |= ibv_send_flags::IBV_SEND_INLINE.0;
                }
            }
        }
    }
    let mut bad = null_mut();
    // SAFETY: the list and its SGEs live until the call returns (the provider copies them).
    check(
        unsafe { ibv_post_send(qp, base, &mut bad) },
        "ibv_post_send",
    )
}

/// Posts receive buffers `(wr_id, addr, len)` as one chained list.
pub fn post_recv(qp: *mut ibv_qp, lkey: u32, bufs: &[(u64, u64, u32)]) -> anyhow::Result<()> {
    if bufs.is_empty() {
        return Ok(());
    }
    let mut sges: Vec<ibv_sge> = bufs
        .iter()
        .map(|&(_, addr, length)| ibv_sge { addr, length, lkey })
        .collect();
    // SAFETY: plain data.
    let mut list: Vec<ibv_recv_wr> = bufs.iter().map(|_| unsafe { std::mem::zeroed() }).collect();
    let n = list.len();
    let base = list.as_mut_ptr();
    for (i, (wr, b)) in list.iter_mut().zip(bufs).enumerate() {
        wr.wr_id = b.0;
        wr.sg_list = &mut sges[i];
        wr.num_sge = 1;
        wr.next = if i + 1 < n {
            // SAFETY: i + 1 < n: within the list; the last link is null.
            unsafe { base.add(i + 1) }
        } else {
            null_mut()
        };
    }
    let mut bad = null_mut();
    // SAFETY: as post_send.
    check(
        unsafe { ibv_post_recv(qp, base, &mut bad) },
        "ibv_post_recv",
    )
}
