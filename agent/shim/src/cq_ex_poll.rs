//! Virtual `ibv_cq_ex`: a CQ from `ibv_create_cq_ex` is made virtual as one from
//! `ibv_create_cq` is (`vcq`), over a dedicated `ibv_cq_ex` created with the same completion
//! fields (and the QP number, which the shim needs to follow gating). Programs read such a
//! CQ with `ibv_start_poll`/`ibv_next_poll`/`ibv_end_poll` and `ibv_wc_read_*`, inline calls
//! through the CQ's own pointers: the shim swaps them for its own, which take completions
//! from the dedicated CQ as the polling grant admits (`Vcq::poll_ex`) and read the current
//! one there. `ibv_poll_cq`, arming and events on the CQ work as for any virtual CQ.
//!
//! A CQ with readers the shim does not forward (CVLAN, flow tag, tag matching) is left an
//! ordinary CQ and reported.

use crate::context::lookup;
use crate::cq_ex::{call, tail};
use crate::drain;
use crate::ffi::{IbvCq, IbvWc};
use crate::govern;
use crate::trouble::{warn_once, Trouble};
use crate::vcq::{self, Vcq};
use libc::{c_int, c_uint, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};

/// Swaps the polling and reading pointers of the application's `ibv_cq_ex` for the shim's
/// (a reader stays absent where the application did not ask for it).
///
/// # Safety
/// `cq` is the application's new virtual `ibv_cq_ex`, not handed out yet.
pub unsafe fn wrap(cq: *mut IbvCq) {
    // SAFETY: per the contract.
    let t = unsafe { tail(cq) };
    let set = |slot: &mut usize, f: usize| {
        if *slot != 0 {
            *slot = f;
        }
    };
    set(&mut t.start_poll, w_start_poll as *const () as usize);
    set(&mut t.next_poll, w_next_poll as *const () as usize);
    set(&mut t.end_poll, w_end_poll as *const () as usize);
    set(&mut t.read_opcode, read_opcode as *const () as usize);
    set(
        &mut t.read_vendor_err,
        read_vendor_err as *const () as usize,
    );
    set(&mut t.read_byte_len, read_byte_len as *const () as usize);
    set(&mut t.read_imm_data, read_imm_data as *const () as usize);
    set(&mut t.read_qp_num, read_qp_num as *const () as usize);
    set(&mut t.read_src_qp, read_src_qp as *const () as usize);
    set(&mut t.read_wc_flags, read_wc_flags as *const () as usize);
    set(&mut t.read_slid, read_slid as *const () as usize);
    set(&mut t.read_sl, read_sl as *const () as usize);
    set(
        &mut t.read_dlid_path_bits,
        read_dlid_path_bits as *const () as usize,
    );
    set(
        &mut t.read_completion_ts,
        read_completion_ts as *const () as usize,
    );
    set(
        &mut t.read_completion_wallclock_ns,
        read_completion_wallclock_ns as *const () as usize,
    );
}

fn lost() -> c_int {
    warn_once(
        Trouble::Completions,
        "an ibv_start_poll on a CQ the shim no longer knows; the poll fails",
    );
    libc::EINVAL
}

/// One poll of a virtual `ibv_cq_ex`, and the account of what it took.
///
/// # Safety
/// `cq` is the application's virtual `ibv_cq_ex`.
unsafe fn poll(cq: *mut IbvCq, start: bool, attr: *mut c_void) -> c_int {
    let Some(v) = vcq::find(cq) else {
        return lost();
    };
    // SAFETY: per the contract.
    let r = catch_unwind(AssertUnwindSafe(|| unsafe { v.poll_ex(start, attr) }));
    let Ok((rc, moved, held)) = r else {
        return lost();
    };
    if rc == 0 {
        // SAFETY: the application's CQ.
        if let Some(st) = lookup(unsafe { (*cq).context }) {
            match moved {
                // The engine thread followed it when it moved it.
                Some(m) if m.followed => govern::count_poll(st),
                Some(m) => govern::polled(st, &[m.wc]),
                // SAFETY: the current completion is the dedicated CQ's.
                None => govern::polled(st, &[unsafe { dedicated_wc(v) }]),
            }
        }
    } else if rc == libc::ENOENT {
        drain::on_empty_poll(held);
    }
    rc
}

/// What the shim follows of the dedicated CQ's current completion.
///
/// # Safety
/// A poll of `v`'s dedicated `ibv_cq_ex` has just returned a completion.
unsafe fn dedicated_wc(v: &Vcq) -> IbvWc {
    let d = v.dedicated as *mut IbvCq;
    // SAFETY: per the contract; the dedicated CQ was made with the opcode and QP number
    // readers.
    unsafe {
        IbvWc {
            wr_id: tail(d).wr_id,
            status: tail(d).status,
            opcode: call::<c_int>(d, tail(d).read_opcode),
            qp_num: call::<u32>(d, tail(d).read_qp_num),
            ..IbvWc::default()
        }
    }
}

unsafe extern "C" fn w_start_poll(cq: *mut IbvCq, attr: *mut c_void) -> c_int {
    // SAFETY: reached through the application's virtual CQ.
    unsafe { poll(cq, true, attr) }
}

unsafe extern "C" fn w_next_poll(cq: *mut IbvCq) -> c_int {
    // SAFETY: as above.
    unsafe { poll(cq, false, std::ptr::null_mut()) }
}

unsafe extern "C" fn w_end_poll(cq: *mut IbvCq) {
    if let Some(v) = vcq::find(cq) {
        let _ = catch_unwind(AssertUnwindSafe(|| v.end_poll_ex()));
    }
}

/// A reader: the field of a completion taken from the ring, else the dedicated CQ's reader.
macro_rules! reader {
    ($name:ident, $t:ty, $field:ident, |$w:ident| $from_ring:expr) => {
        unsafe extern "C" fn $name(cq: *mut IbvCq) -> $t {
            let Some(v) = vcq::find(cq) else {
                return <$t>::default();
            };
            match v.current_ex() {
                Some($w) => $from_ring,
                None => {
                    let d = v.dedicated as *mut IbvCq;
                    // SAFETY: the dedicated CQ has every reader the application's has.
                    unsafe { call::<$t>(d, tail(d).$field) }
                }
            }
        }
    };
}

reader!(read_opcode, c_int, read_opcode, |m| m.wc.opcode);
reader!(read_vendor_err, u32, read_vendor_err, |m| m.wc.vendor_err);
reader!(read_byte_len, u32, read_byte_len, |m| m.wc.byte_len);
reader!(read_imm_data, u32, read_imm_data, |m| m.wc.imm_data);
reader!(read_qp_num, u32, read_qp_num, |m| m.wc.qp_num);
reader!(read_src_qp, u32, read_src_qp, |m| m.wc.src_qp);
reader!(read_wc_flags, c_uint, read_wc_flags, |m| m.wc.wc_flags);
reader!(read_slid, u32, read_slid, |m| u32::from(m.wc.slid));
reader!(read_sl, u8, read_sl, |m| m.wc.sl);
reader!(read_dlid_path_bits, u8, read_dlid_path_bits, |m| m
    .wc
    .dlid_path_bits);
// A completion the shim made itself has no time of the device's (0).
reader!(read_completion_ts, u64, read_completion_ts, |m| m.ts);
reader!(
    read_completion_wallclock_ns,
    u64,
    read_completion_wallclock_ns,
    |m| m.wallclock_ns
);
