//! `ibv_create_cq_ex`: a softrnic CQ whose `ibv_cq_ex` part is filled, so programs read
//! completions with `ibv_start_poll`/`ibv_next_poll`/`ibv_end_poll` and the
//! `ibv_wc_read_*` functions. Each poll takes one completion through the same ring as
//! `ibv_poll_cq` (which keeps working on the CQ), and keeps it for the reads that follow.
//!
//! Completion timestamps: the device reports a 1 GHz clock (`hca_core_clock`, in kHz) over
//! all 64 bits; a completion's timestamp is `CLOCK_MONOTONIC` in ns when the provider takes
//! it from the ring — the moment the program polls it, not the moment the engine wrote it
//! (the ring's entries carry no time).

use super::*;

const IBV_WC_EX_WITH_BYTE_LEN: u64 = 1 << 0;
const IBV_WC_EX_WITH_COMPLETION_TIMESTAMP: u64 = 1 << 7;
/// Byte length, immediate, QP number, source QP, SLID, SL, DLID path bits, timestamp.
const SUPPORTED_WC_FLAGS: u64 = 0xff;
const IBV_CQ_INIT_ATTR_MASK_FLAGS: u32 = 1 << 0;
/// `IBV_CREATE_CQ_ATTR_SINGLE_THREADED`: a hint the CQ's lock makes moot.
const SINGLE_THREADED: u32 = 1 << 0;
/// The timestamp clock: 1 GHz, so a timestamp is in ns.
pub(super) const CORE_CLOCK_KHZ: u64 = 1_000_000;

pub(super) unsafe extern "C" fn create_cq_ex(
    ctx: *mut IbvContext,
    attr: *mut IbvCqInitAttrEx,
) -> *mut IbvCq {
    guard(null_mut(), || {
        // SAFETY: the caller's attributes.
        let a = unsafe { &*attr };
        let flags_ok =
            a.comp_mask & IBV_CQ_INIT_ATTR_MASK_FLAGS == 0 || a.flags & !SINGLE_THREADED == 0;
        if a.comp_mask & !IBV_CQ_INIT_ATTR_MASK_FLAGS != 0
            || !flags_ok
            || a.wc_flags & !SUPPORTED_WC_FLAGS != 0
        {
            // Parent domains, creation flags other than the hint, CVLAN, flow tags, tag
            // matching and wall-clock timestamps.
            set_errno(libc::EOPNOTSUPP);
            return null_mut();
        }
        let Ok(cqe) = c_int::try_from(a.cqe) else {
            set_errno(libc::EINVAL);
            return null_mut();
        };
        // SAFETY: the caller's context and channel, as for ibv_create_cq.
        let cq = unsafe { create_cq(ctx, cqe, a.channel, a.comp_vector as c_int) };
        if cq.is_null() {
            return cq;
        }
        // libibverbs' ibv_create_cq_ex then runs verbs_init_cq, which sets the channel and
        // context and takes the channel's reference (ibv_destroy_cq drops it): taking one
        // here too kept ibv_destroy_comp_channel at EBUSY for ever.
        // SAFETY: create_cq made it as an SrCq.
        let t = &mut unsafe { &mut *(cq as *mut SrCq) }.ex;
        t.start_poll = start_poll as *const () as usize;
        t.next_poll = next_poll as *const () as usize;
        t.end_poll = end_poll as *const () as usize;
        t.read_opcode = read_opcode as *const () as usize;
        t.read_vendor_err = read_vendor_err as *const () as usize;
        t.read_wc_flags = read_wc_flags as *const () as usize;
        let want = |bit: u64, f: usize| if a.wc_flags & bit != 0 { f } else { 0 };
        t.read_byte_len = want(IBV_WC_EX_WITH_BYTE_LEN, read_byte_len as *const () as usize);
        t.read_imm_data = want(1 << 1, read_imm_data as *const () as usize);
        t.read_qp_num = want(1 << 2, read_qp_num as *const () as usize);
        t.read_src_qp = want(1 << 3, read_src_qp as *const () as usize);
        t.read_slid = want(1 << 4, read_slid as *const () as usize);
        t.read_sl = want(1 << 5, read_sl as *const () as usize);
        t.read_dlid_path_bits = want(1 << 6, read_dlid_path_bits as *const () as usize);
        t.read_completion_ts = want(
            IBV_WC_EX_WITH_COMPLETION_TIMESTAMP,
            read_completion_ts as *const () as usize,
        );
        cq
    })
}

fn now_ns() -> u64 {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: t is a valid out-parameter.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut t) };
    t.tv_sec as u64 * 1_000_000_000 + t.tv_nsec as u64
}

/// Takes the next completion into the CQ's current one: 0, `ENOENT` when there is none.
///
/// # Safety
/// `cq` is a live CQ made by `create_cq_ex`.
unsafe fn take(cq: *mut IbvCq) -> c_int {
    guard(libc::EIO, || {
        let mut wc = IbvWc::default();
        // SAFETY: per the contract; one entry.
        match unsafe { poll_cq(cq, 1, &mut wc) } {
            1 => {
                // SAFETY: as above.
                let sr = unsafe { &mut *(cq as *mut SrCq) };
                sr.ex.wr_id = wc.wr_id;
                sr.ex.status = wc.status;
                *sr.cur.lock().unwrap_or_else(|p| p.into_inner()) = (wc, now_ns());
                0
            }
            0 => libc::ENOENT,
            _ => libc::EIO,
        }
    })
}

unsafe extern "C" fn start_poll(cq: *mut IbvCq, attr: *const u32) -> c_int {
    // `ibv_poll_cq_attr.comp_mask` must be 0: no attributes are defined.
    // SAFETY: the caller's attributes, when given.
    if !attr.is_null() && unsafe { *attr } != 0 {
        return libc::EINVAL;
    }
    // SAFETY: the application's CQ.
    unsafe { take(cq) }
}

unsafe extern "C" fn next_poll(cq: *mut IbvCq) -> c_int {
    // SAFETY: the application's CQ.
    unsafe { take(cq) }
}

unsafe extern "C" fn end_poll(_cq: *mut IbvCq) {}

/// The current completion of `cq`.
///
/// # Safety
/// As [`take`].
unsafe fn current(cq: *mut IbvCq) -> (IbvWc, u64) {
    // SAFETY: per the contract.
    let sr = unsafe { &*(cq as *const SrCq) };
    *sr.cur.lock().unwrap_or_else(|p| p.into_inner())
}

macro_rules! reader {
    ($name:ident, $t:ty, $f:expr) => {
        unsafe extern "C" fn $name(cq: *mut IbvCq) -> $t {
            // SAFETY: the application's CQ, after a successful start_poll/next_poll.
            let (w, ts): (IbvWc, u64) = unsafe { current(cq) };
            $f(w, ts)
        }
    };
}

reader!(read_opcode, c_int, |w: IbvWc, _| w.opcode);
reader!(read_vendor_err, u32, |w: IbvWc, _| w.vendor_err);
reader!(read_byte_len, u32, |w: IbvWc, _| w.byte_len);
reader!(read_imm_data, u32, |w: IbvWc, _| w.imm_data);
reader!(read_qp_num, u32, |w: IbvWc, _| w.qp_num);
reader!(read_src_qp, u32, |w: IbvWc, _| w.src_qp);
reader!(read_wc_flags, u32, |w: IbvWc, _| w.wc_flags);
reader!(read_slid, u32, |w: IbvWc, _| u32::from(w.slid));
reader!(read_sl, u8, |w: IbvWc, _| w.sl);
reader!(read_dlid_path_bits, u8, |w: IbvWc, _| w.dlid_path_bits);
reader!(read_completion_ts, u64, |_, ts| ts);
