//! Shared-memory rings between the provider and its engine: the data path without a socket
//! round trip.
//!
//! * Each CQ has a **completion ring** and each QP a **send ring** and a **receive ring**, in a
//!   memfd the provider creates and maps; the engine maps the same file (it opens
//!   `/proc/PID/fd/N` of the process it already identified by `SO_PEERCRED`, [`crate::proto::Req::AttachRing`]).
//! * A ring is a 256-byte header of free-running 32-bit indices, each on its own cache line —
//!   `prod` (written by the producer), `cons` (consumer) and, for work-request rings, `done`
//!   (work requests the engine has retired: completed or flushed) — followed by fixed-size
//!   slots. Slot `i` of a ring of `n` slots holds entry `i mod n`.
//! * `post_send`/`post_recv` write the slots of all the work requests of the call and publish
//!   `prod` (release) once; `post_send` then rings the doorbell once. The first send slot of
//!   each call is marked ([`SqHeader::doorbell`]), so the engine knows which work requests one
//!   doorbell announced even when several posts are waiting by the time it looks. The
//!   provider refuses a post when `prod - done` reached the queue's size, so a slot is reused
//!   only after its work request left the engine. The engine copies entries out at `cons` and validates them as it
//!   validated socket requests (the ring is application memory: it is never trusted).
//! * The engine writes completions (`struct ibv_wc`) at `prod` and publishes it; `poll_cq`
//!   copies them out and publishes `cons`. `ibv_req_notify_cq` arms the CQ by writing the
//!   ring's arming word; the engine, after publishing a completion, takes the arming (back to
//!   0) when the completion fires it and sends the event. Both sides fence between their
//!   write and their read of the other's word, so a completion published as the CQ is armed
//!   is either seen by the poll after arming or fires the event (never neither). Arming
//!   costs no round trip, so an event for a completion the program already polled is as
//!   rare as on a NIC. The engine publishes `done` of a QP before any
//!   completion of it, so an application that posts again after polling finds the room.
//! * Doorbell: one page per engine (`<host dir>/doorbell`, mapped by every provider of the
//!   host) holding a sequence word and a "sleeping" flag. A post increments the sequence and,
//!   only if the engine's transmitter said it is going to sleep, wakes it with `FUTEX_WAKE` on
//!   the sequence word; the transmitter sleeps with `FUTEX_WAIT` on the value it saw before
//!   its last scan of the rings (sequentially consistent flag/sequence accesses on both sides,
//!   so a post is never missed).

use std::io;
use std::sync::atomic::{AtomicU32, Ordering};

use crate::proto::Sge;
use drum_verbs_abi::IbvWc;
use std::mem::{offset_of, size_of};

pub const HDR: usize = 256;
const PROD: usize = 0;
const CONS: usize = 64;
const DONE: usize = 128;
/// A completion ring's arming word, written by `ibv_req_notify_cq` without a socket round
/// trip: 0 not armed, [`ARM_SOLICITED`] for a solicited completion, anything else for any.
const ARM: usize = 192;
pub const ARM_ANY: u32 = 1;
pub const ARM_SOLICITED: u32 = 2;

/// The header of a send slot, which the provider's `post_send` writes and the engine reads
/// back: then `max_sge` SGEs ([`put_sge`]), then room for inline data.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SqHeader {
    pub wr_id: u64,
    /// `enum ibv_wr_opcode`.
    pub opcode: u32,
    pub send_flags: u32,
    pub imm_data: u32,
    pub num_sge: u32,
    pub remote_addr: u64,
    pub rkey: u32,
    /// Bytes of inline data after the SGEs, or [`NOT_INLINE`].
    pub inline_len: u32,
    /// Atomic operands.
    pub compare_add: u64,
    pub swap: u64,
    /// 1 on the first work request of an `ibv_post_send` call, 0 on the others of its list
    /// (the NIC model fetches one call's list as one batch).
    pub doorbell: u32,
    /// An XRC initiator's work request: the responder's SRQ number.
    pub xrc_srqn: u32,
}

/// The header of a receive slot (then `max_sge` SGEs).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RqHeader {
    pub wr_id: u64,
    pub num_sge: u32,
    pub _pad: u32,
}

/// Where a send slot's SGEs start.
pub const SQ_SGE_OFF: usize = size_of::<SqHeader>();
/// Where a receive slot's SGEs start.
pub const RQ_SGE_OFF: usize = size_of::<RqHeader>();
/// Bytes of one SGE in a slot.
pub const SGE_LEN: usize = size_of::<Sge>();
/// `inline_len` value of a work request that is not inline.
pub const NOT_INLINE: u32 = u32::MAX;

// The slots are copied byte by byte through the mapping (never referenced in place: the
// application may scribble on them), so each type encodes itself at its `repr(C)` offsets.

impl SqHeader {
    #[inline]
    pub fn encode(&self, b: &mut [u8]) {
        put_u64(b, offset_of!(Self, wr_id), self.wr_id);
        put_u32(b, offset_of!(Self, opcode), self.opcode);
        put_u32(b, offset_of!(Self, send_flags), self.send_flags);
        put_u32(b, offset_of!(Self, imm_data), self.imm_data);
        put_u32(b, offset_of!(Self, num_sge), self.num_sge);
        put_u64(b, offset_of!(Self, remote_addr), self.remote_addr);
        put_u32(b, offset_of!(Self, rkey), self.rkey);
        put_u32(b, offset_of!(Self, inline_len), self.inline_len);
        put_u64(b, offset_of!(Self, compare_add), self.compare_add);
        put_u64(b, offset_of!(Self, swap), self.swap);
        put_u32(b, offset_of!(Self, doorbell), self.doorbell);
        put_u32(b, offset_of!(Self, xrc_srqn), self.xrc_srqn);
    }

    #[inline]
    pub fn decode(b: &[u8]) -> Self {
        Self {
            wr_id: get_u64(b, offset_of!(Self, wr_id)),
            opcode: get_u32(b, offset_of!(Self, opcode)),
            send_flags: get_u32(b, offset_of!(Self, send_flags)),
            imm_data: get_u32(b, offset_of!(Self, imm_data)),
            num_sge: get_u32(b, offset_of!(Self, num_sge)),
            remote_addr: get_u64(b, offset_of!(Self, remote_addr)),
            rkey: get_u32(b, offset_of!(Self, rkey)),
            inline_len: get_u32(b, offset_of!(Self, inline_len)),
            compare_add: get_u64(b, offset_of!(Self, compare_add)),
            swap: get_u64(b, offset_of!(Self, swap)),
            doorbell: get_u32(b, offset_of!(Self, doorbell)),
            xrc_srqn: get_u32(b, offset_of!(Self, xrc_srqn)),
        }
    }
}

impl RqHeader {
    #[inline]
    pub fn encode(&self, b: &mut [u8]) {
        put_u64(b, offset_of!(Self, wr_id), self.wr_id);
        put_u32(b, offset_of!(Self, num_sge), self.num_sge);
    }

    #[inline]
    pub fn decode(b: &[u8]) -> Self {
        Self {
            wr_id: get_u64(b, offset_of!(Self, wr_id)),
            num_sge: get_u32(b, offset_of!(Self, num_sge)),
            _pad: 0,
        }
    }
}

/// Writes SGE `i` of a slot whose SGEs start at `first` (`SQ_SGE_OFF` or `RQ_SGE_OFF`).
#[inline]
pub fn put_sge(b: &mut [u8], first: usize, i: usize, s: &Sge) {
    let o = first + SGE_LEN * i;
    put_u64(b, o + offset_of!(Sge, addr), s.addr);
    put_u32(b, o + offset_of!(Sge, length), s.length);
    put_u32(b, o + offset_of!(Sge, lkey), s.lkey);
}

/// Reads SGE `i` of a slot whose SGEs start at `first`.
#[inline]
pub fn get_sge(b: &[u8], first: usize, i: usize) -> Sge {
    let o = first + SGE_LEN * i;
    Sge {
        addr: get_u64(b, o + offset_of!(Sge, addr)),
        length: get_u32(b, o + offset_of!(Sge, length)),
        lkey: get_u32(b, o + offset_of!(Sge, lkey)),
    }
}

fn round64(n: usize) -> usize {
    n.div_ceil(64) * 64
}

#[inline]
pub fn sq_slot(max_sge: u32, max_inline: u32) -> usize {
    round64(SQ_SGE_OFF + SGE_LEN * max_sge as usize + max_inline as usize)
}

#[inline]
pub fn rq_slot(max_sge: u32) -> usize {
    round64(RQ_SGE_OFF + SGE_LEN * max_sge as usize)
}

pub const WC_SIZE: usize = std::mem::size_of::<IbvWc>();

/// Bytes of a CQ's completion ring.
#[inline]
pub fn cq_len(cqe: u32) -> usize {
    HDR + cqe as usize * WC_SIZE
}

/// Layout of a QP's rings in its memfd.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpLayout {
    pub sq_n: u32,
    pub sq_slot: usize,
    pub rq_off: usize,
    pub rq_n: u32,
    pub rq_slot: usize,
    pub len: usize,
}

impl QpLayout {
    /// The send ring and the receive ring of this layout.
    pub fn rings(&self) -> (Ring, Ring) {
        let sq = Ring {
            off: 0,
            n: self.sq_n,
            slot: self.sq_slot,
        };
        let rq = Ring {
            off: self.rq_off,
            n: self.rq_n,
            slot: self.rq_slot,
        };
        (sq, rq)
    }

    pub fn new(cap: &crate::proto::Caps) -> QpLayout {
        let sq_slot = sq_slot(cap.max_send_sge, cap.max_inline_data);
        let rq_slot = rq_slot(cap.max_recv_sge);
        let rq_off = HDR + sq_slot * cap.max_send_wr as usize;
        QpLayout {
            sq_n: cap.max_send_wr,
            sq_slot,
            rq_off,
            rq_n: cap.max_recv_wr,
            rq_slot,
            len: rq_off + HDR + rq_slot * cap.max_recv_wr as usize,
        }
    }
}

/// A shared mapping (of a memfd). Unmapped on drop.
pub struct Map {
    base: *mut u8,
    len: usize,
}

// SAFETY: the mapping is plain shared memory; all accesses go through atomics or byte copies.
unsafe impl Send for Map {}
// SAFETY: as above.
unsafe impl Sync for Map {}

impl Map {
    /// Map `len` bytes of `fd` shared, read-write.
    pub fn new(fd: i32, len: usize) -> io::Result<Map> {
        if len == 0 {
            return Err(io::Error::from_raw_os_error(libc::EINVAL));
        }
        // SAFETY: mmap of a file descriptor the caller owns; the result is checked.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Map {
            base: p as *mut u8,
            len,
        })
    }

    /// A new memfd of `len` bytes, mapped; returns the mapping and the fd (caller closes it).
    pub fn create(name: &str, len: usize) -> io::Result<(Map, i32)> {
        let cname = std::ffi::CString::new(name).unwrap_or_default();
        // SAFETY: memfd_create with a valid C string; result checked.
        let fd = unsafe { libc::memfd_create(cname.as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: fd is ours.
        if unsafe { libc::ftruncate(fd, len as libc::off_t) } != 0 {
            let e = io::Error::last_os_error();
            // SAFETY: fd is ours.
            unsafe { libc::close(fd) };
            return Err(e);
        }
        match Map::new(fd, len) {
            Ok(m) => Ok((m, fd)),
            Err(e) => {
                // SAFETY: fd is ours.
                unsafe { libc::close(fd) };
                Err(e)
            }
        }
    }

    #[inline]
    pub fn len(&self) -> usize {
        self.len
    }

    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The 32-bit word at `off` (4-aligned, in bounds) as an atomic.
    #[inline]
    pub fn word(&self, off: usize) -> &AtomicU32 {
        assert!(off % 4 == 0 && off + 4 <= self.len);
        // SAFETY: in bounds and aligned (the mapping is page-aligned); AtomicU32 has the layout
        // of u32 and the memory lives as long as self.
        unsafe { &*(self.base.add(off) as *const AtomicU32) }
    }

    /// Copy `out.len()` bytes from offset `off`.
    #[inline]
    pub fn read(&self, off: usize, out: &mut [u8]) {
        assert!(off + out.len() <= self.len);
        // SAFETY: in bounds; the other process may write concurrently, so the bytes are only
        // copied, then validated by the caller.
        unsafe { std::ptr::copy_nonoverlapping(self.base.add(off), out.as_mut_ptr(), out.len()) }
    }

    /// Copy `data` to offset `off`.
    #[inline]
    pub fn write(&self, off: usize, data: &[u8]) {
        assert!(off + data.len() <= self.len);
        // SAFETY: in bounds; shared memory that both sides only copy in and out of.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), self.base.add(off), data.len()) }
    }
}

impl Drop for Map {
    fn drop(&mut self) {
        // SAFETY: base/len come from a successful mmap.
        unsafe { libc::munmap(self.base as *mut libc::c_void, self.len) };
    }
}

/// One ring inside a mapping: header at `off`, `n` slots of `slot` bytes after it.
#[derive(Debug, Clone, Copy)]
pub struct Ring {
    pub off: usize,
    pub n: u32,
    pub slot: usize,
}

impl Ring {
    #[inline]
    pub fn prod<'a>(&self, m: &'a Map) -> &'a AtomicU32 {
        m.word(self.off + PROD)
    }
    #[inline]
    pub fn cons<'a>(&self, m: &'a Map) -> &'a AtomicU32 {
        m.word(self.off + CONS)
    }
    #[inline]
    pub fn done<'a>(&self, m: &'a Map) -> &'a AtomicU32 {
        m.word(self.off + DONE)
    }
    #[inline]
    pub fn arm<'a>(&self, m: &'a Map) -> &'a AtomicU32 {
        m.word(self.off + ARM)
    }
    /// Offset of the slot of entry `i`.
    #[inline]
    pub fn slot_off(&self, i: u32) -> usize {
        self.off + HDR + (i % self.n.max(1)) as usize * self.slot
    }
    #[inline]
    pub fn end(&self) -> usize {
        self.off + HDR + self.n as usize * self.slot
    }
}

/// Little-endian field helpers for slots.
fn put_u16(b: &mut [u8], off: usize, v: u16) {
    b[off..off + 2].copy_from_slice(&v.to_le_bytes());
}
fn get_u16(b: &[u8], off: usize) -> u16 {
    u16::from_le_bytes([b[off], b[off + 1]])
}
fn put_u32(b: &mut [u8], off: usize, v: u32) {
    b[off..off + 4].copy_from_slice(&v.to_le_bytes());
}
fn put_u64(b: &mut [u8], off: usize, v: u64) {
    b[off..off + 8].copy_from_slice(&v.to_le_bytes());
}
fn get_u32(b: &[u8], off: usize) -> u32 {
    u32::from_le_bytes(b[off..off + 4].try_into().unwrap())
}
fn get_u64(b: &[u8], off: usize) -> u64 {
    u64::from_le_bytes(b[off..off + 8].try_into().unwrap())
}

/// Encode a completion into its slot image (the C layout of `struct ibv_wc`, padding zero).
#[inline]
pub fn wc_bytes(wc: &IbvWc) -> [u8; WC_SIZE] {
    let mut b = [0u8; WC_SIZE];
    put_u64(&mut b, offset_of!(IbvWc, wr_id), wc.wr_id);
    for (off, v) in [
        (offset_of!(IbvWc, status), wc.status as u32),
        (offset_of!(IbvWc, opcode), wc.opcode as u32),
        (offset_of!(IbvWc, vendor_err), wc.vendor_err),
        (offset_of!(IbvWc, byte_len), wc.byte_len),
        (offset_of!(IbvWc, imm_data), wc.imm_data),
        (offset_of!(IbvWc, qp_num), wc.qp_num),
        (offset_of!(IbvWc, src_qp), wc.src_qp),
        (offset_of!(IbvWc, wc_flags), wc.wc_flags),
    ] {
        put_u32(&mut b, off, v);
    }
    put_u16(&mut b, offset_of!(IbvWc, pkey_index), wc.pkey_index);
    put_u16(&mut b, offset_of!(IbvWc, slid), wc.slid);
    b[offset_of!(IbvWc, sl)] = wc.sl;
    b[offset_of!(IbvWc, dlid_path_bits)] = wc.dlid_path_bits;
    b
}

/// Decode a completion slot image.
#[inline]
pub fn wc_from(b: &[u8; WC_SIZE]) -> IbvWc {
    IbvWc {
        wr_id: get_u64(b, offset_of!(IbvWc, wr_id)),
        status: get_u32(b, offset_of!(IbvWc, status)) as i32,
        opcode: get_u32(b, offset_of!(IbvWc, opcode)) as i32,
        vendor_err: get_u32(b, offset_of!(IbvWc, vendor_err)),
        byte_len: get_u32(b, offset_of!(IbvWc, byte_len)),
        imm_data: get_u32(b, offset_of!(IbvWc, imm_data)),
        qp_num: get_u32(b, offset_of!(IbvWc, qp_num)),
        src_qp: get_u32(b, offset_of!(IbvWc, src_qp)),
        wc_flags: get_u32(b, offset_of!(IbvWc, wc_flags)),
        pkey_index: get_u16(b, offset_of!(IbvWc, pkey_index)),
        slid: get_u16(b, offset_of!(IbvWc, slid)),
        sl: b[offset_of!(IbvWc, sl)],
        dlid_path_bits: b[offset_of!(IbvWc, dlid_path_bits)],
    }
}

// ---------------------------------------------------------------------------------------------
// Doorbell
// ---------------------------------------------------------------------------------------------

pub const DOORBELL_LEN: usize = 4096;
const DB_SEQ: usize = 0;
const DB_SLEEPING: usize = 64;

pub struct Doorbell {
    pub map: Map,
}

fn futex(word: &AtomicU32, op: i32, val: u32, timeout: Option<std::time::Duration>) -> i64 {
    let ts = timeout.map(|d| libc::timespec {
        tv_sec: d.as_secs() as libc::time_t,
        tv_nsec: d.subsec_nanos() as libc::c_long,
    });
    let tsp = ts
        .as_ref()
        .map(|t| t as *const libc::timespec)
        .unwrap_or(std::ptr::null());
    // SAFETY: futex on a live, aligned 32-bit word of a shared mapping; non-private ops because
    // the word is shared between processes.
    unsafe { libc::syscall(libc::SYS_futex, word.as_ptr(), op, val, tsp, 0usize, 0u32) }
}

impl Doorbell {
    /// Open (creating if needed) the doorbell file at `path`.
    pub fn open(path: &std::path::Path, create: bool) -> io::Result<Doorbell> {
        use std::os::fd::AsRawFd;
        use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(create)
            .mode(0o666)
            .custom_flags(libc::O_CLOEXEC)
            .open(path)?;
        if create {
            f.set_len(DOORBELL_LEN as u64)?;
            // Every user's programs ring it, as every user may open a real NIC's uverbs
            // device: the umask must not take that away. Best effort: a file left by another
            // owner stays as it is, and its users are the ones it served before.
            let _ = std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666));
        } else if f.metadata()?.len() < DOORBELL_LEN as u64 {
            return Err(io::Error::from_raw_os_error(libc::EINVAL));
        }
        Ok(Doorbell {
            map: Map::new(f.as_raw_fd(), DOORBELL_LEN)?,
        })
    }

    #[inline]
    pub fn seq(&self) -> u32 {
        self.map.word(DB_SEQ).load(Ordering::SeqCst)
    }

    /// Producer side: something was posted (or happened); wake the engine if it sleeps.
    #[inline]
    pub fn ring(&self) {
        self.map.word(DB_SEQ).fetch_add(1, Ordering::SeqCst);
        if self.map.word(DB_SLEEPING).load(Ordering::SeqCst) != 0 {
            futex(self.map.word(DB_SEQ), libc::FUTEX_WAKE, 1, None);
        }
    }

    /// Engine side: sleep until the sequence differs from `seen` (the value read before the
    /// last scan of the rings) or `timeout` passes.
    pub fn wait(&self, seen: u32, timeout: std::time::Duration) {
        let sleeping = self.map.word(DB_SLEEPING);
        sleeping.store(1, Ordering::SeqCst);
        if self.seq() == seen {
            futex(self.map.word(DB_SEQ), libc::FUTEX_WAIT, seen, Some(timeout));
        }
        sleeping.store(0, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proto::Caps;

    #[test]
    fn layouts() {
        let l = QpLayout::new(&Caps {
            max_send_wr: 4,
            max_recv_wr: 2,
            max_send_sge: 2,
            max_recv_sge: 1,
            max_inline_data: 256,
        });
        assert_eq!(l.sq_slot, 384); // 64 + 32 + 256 rounded to 64
        assert_eq!(l.rq_slot, 64);
        assert_eq!(l.rq_off, 256 + 4 * 384);
        assert_eq!(l.len, l.rq_off + 256 + 2 * 64);
        assert_eq!(WC_SIZE, 48);
        let wc = IbvWc {
            wr_id: 7,
            status: 5,
            byte_len: 99,
            qp_num: 0x11,
            ..Default::default()
        };
        let b = wc_bytes(&wc);
        assert_eq!(wc_from(&b), wc);
    }

    /// The slot headers keep the layout the rings were sized for: a 64-byte send header and
    /// a 16-byte receive header, each field at its `repr(C)` offset.
    #[test]
    fn slot_headers_have_their_sizes() {
        assert_eq!((SQ_SGE_OFF, RQ_SGE_OFF, SGE_LEN), (64, 16, 16));
        assert_eq!(offset_of!(SqHeader, doorbell), 56);
        assert_eq!(offset_of!(SqHeader, xrc_srqn), 60);
    }

    proptest::proptest! {
        /// What the provider encodes into a slot, the engine decodes unchanged.
        #[test]
        fn slots_decode_what_was_encoded(
            w in proptest::array::uniform8(proptest::prelude::any::<u64>()),
            v in proptest::array::uniform8(proptest::prelude::any::<u32>()),
            i in 0usize..4,
        ) {
            let h = SqHeader {
                wr_id: w[0],
                opcode: v[0],
                send_flags: v[1],
                imm_data: v[2],
                num_sge: v[3],
                remote_addr: w[1],
                rkey: v[4],
                inline_len: v[5],
                compare_add: w[2],
                swap: w[3],
                doorbell: v[6],
                xrc_srqn: v[7],
            };
            let sge = Sge { addr: w[4], length: v[0], lkey: v[1] };
            let mut b = vec![0u8; sq_slot(4, 0)];
            h.encode(&mut b);
            put_sge(&mut b, SQ_SGE_OFF, i, &sge);
            proptest::prop_assert_eq!(SqHeader::decode(&b), h);
            proptest::prop_assert_eq!(get_sge(&b, SQ_SGE_OFF, i), sge);
            let r = RqHeader { wr_id: w[5], num_sge: v[2], _pad: 0 };
            let mut b = vec![0u8; rq_slot(4)];
            r.encode(&mut b);
            put_sge(&mut b, RQ_SGE_OFF, i, &sge);
            proptest::prop_assert_eq!(RqHeader::decode(&b), r);
            proptest::prop_assert_eq!(get_sge(&b, RQ_SGE_OFF, i), sge);
        }
    }

    #[test]
    fn shared_mapping_and_doorbell_wake() {
        let (a, fd) = Map::create("t", 4096).unwrap();
        let b = Map::new(fd, 4096).unwrap();
        // SAFETY: our fd.
        unsafe { libc::close(fd) };
        let r = Ring {
            off: 0,
            n: 4,
            slot: 64,
        };
        a.write(r.slot_off(5), b"hello");
        r.prod(&a).store(6, Ordering::Release);
        let mut out = [0u8; 5];
        assert_eq!(r.prod(&b).load(Ordering::Acquire), 6);
        b.read(r.slot_off(1), &mut out);
        assert_eq!(&out, b"hello");
        let dir = std::env::temp_dir().join(format!("srn-db-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("doorbell");
        let eng = Doorbell::open(&p, true).unwrap();
        let app = Doorbell::open(&p, false).unwrap();
        let seen = eng.seq();
        let t = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(50));
            app.ring();
        });
        let t0 = std::time::Instant::now();
        eng.wait(seen, std::time::Duration::from_secs(5));
        assert!(t0.elapsed() < std::time::Duration::from_secs(4));
        assert_ne!(eng.seq(), seen);
        t.join().unwrap();
        // Already rung: no sleep at all.
        let t0 = std::time::Instant::now();
        eng.wait(seen, std::time::Duration::from_secs(5));
        assert!(t0.elapsed() < std::time::Duration::from_secs(1));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
