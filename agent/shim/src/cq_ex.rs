//! An `ibv_cq_ex` as the provider made it: its polling and reading pointers (the tail after
//! `struct ibv_cq`), called or set here for `vcq`, which polls dedicated `ibv_cq_ex`es and
//! keeps their completions in rings, and for `cq_ex_poll`, the shim's own pointers of a
//! virtual `ibv_cq_ex`.

use crate::ffi::{IbvCq, IbvWc};
use libc::{c_int, c_uint, c_void};

pub use drum_verbs_abi::{CqExTail, CQ_EX_TAIL as TAIL};

/// `IBV_WC_EX_WITH_QP_NUM`: the shim follows completions by QP.
pub const WITH_QP_NUM: u64 = 1 << 2;
/// `IBV_WC_STANDARD_FLAGS`: every field of a plain `struct ibv_wc` (byte length, immediate,
/// QP number, source QP, SLID, SL, DLID path bits). A completion the shim keeps in a ring
/// must carry them all, whatever the application asked for: an `ibv_cq_ex` may be read with
/// plain `ibv_poll_cq` (`ibv_cq_ex_to_cq`; UCX does), which gives every field.
pub const STANDARD_FLAGS: u64 = 0x7f;

/// # Safety
/// `cq` is an `ibv_cq_ex`.
pub unsafe fn tail<'a>(cq: *mut IbvCq) -> &'a mut CqExTail {
    // SAFETY: per the contract.
    unsafe { &mut *(cq.cast::<u8>().add(TAIL).cast::<CqExTail>()) }
}

/// Whether the shim forwards every reader `cq` has.
///
/// # Safety
/// `cq` is a live `ibv_cq_ex`.
pub unsafe fn wrappable(cq: *mut IbvCq) -> bool {
    // SAFETY: per the contract.
    let t = unsafe { tail(cq) };
    t.start_poll != 0
        && t.next_poll != 0
        && t.end_poll != 0
        && t.read_cvlan == 0
        && t.read_flow_tag == 0
        && t.read_tm_info == 0
}

/// # Safety
/// `cq` is a live `ibv_cq_ex`.
pub unsafe fn set_current(cq: *mut IbvCq, wr_id: u64, status: c_int) {
    // SAFETY: per the contract.
    let t = unsafe { tail(cq) };
    (t.wr_id, t.status) = (wr_id, status);
}

/// # Safety
/// Both are live `ibv_cq_ex`.
pub unsafe fn copy_current(from: *mut IbvCq, to: *mut IbvCq) {
    // SAFETY: per the contract.
    let (id, status) = unsafe { (tail(from).wr_id, tail(from).status) };
    // SAFETY: as above.
    unsafe { set_current(to, id, status) };
}

/// The provider's `start_poll` of `cq`.
///
/// # Safety
/// `cq` is a live `ibv_cq_ex` of the provider's; `attr` the application's.
pub unsafe fn start_poll(cq: *mut IbvCq, attr: *mut c_void) -> c_int {
    type F = unsafe extern "C" fn(*mut IbvCq, *mut c_void) -> c_int;
    // SAFETY: per the contract; the provider filled the pointer.
    unsafe { std::mem::transmute::<usize, F>(tail(cq).start_poll)(cq, attr) }
}

/// # Safety
/// As [`start_poll`], with a poll of `cq` open.
pub unsafe fn next_poll(cq: *mut IbvCq) -> c_int {
    type F = unsafe extern "C" fn(*mut IbvCq) -> c_int;
    // SAFETY: per the contract.
    unsafe { std::mem::transmute::<usize, F>(tail(cq).next_poll)(cq) }
}

/// # Safety
/// As [`next_poll`].
pub unsafe fn end_poll(cq: *mut IbvCq) {
    type F = unsafe extern "C" fn(*mut IbvCq);
    // SAFETY: per the contract.
    unsafe { std::mem::transmute::<usize, F>(tail(cq).end_poll)(cq) }
}

/// A completion moved out of a real CQ into a ring.
#[derive(Clone, Copy, Default)]
pub struct Moved {
    pub wc: IbvWc,
    /// The shim has followed it (counted, told the gate): its engine thread moved it (see
    /// `vcq::harvest`).
    pub followed: bool,
    /// What an `ibv_cq_ex`'s readers gave (0 for other CQs and completions of the shim's).
    pub ts: u64,
    pub wallclock_ns: u64,
}

impl Moved {
    pub fn unfollowed(wc: IbvWc) -> Moved {
        Moved {
            wc,
            ..Moved::default()
        }
    }
}

/// The dedicated CQ's current completion with every field it has a reader for, to keep in
/// a ring after its poll has moved on.
///
/// # Safety
/// A poll of `d`, an `ibv_cq_ex` of the provider's, has just returned a completion.
pub unsafe fn read_all(d: *mut IbvCq) -> Moved {
    // SAFETY: per the contract; a reader the CQ lacks reads 0.
    unsafe {
        let t = tail(d);
        Moved {
            wc: IbvWc {
                wr_id: t.wr_id,
                status: t.status,
                opcode: call::<c_int>(d, t.read_opcode),
                vendor_err: call::<u32>(d, t.read_vendor_err),
                byte_len: call::<u32>(d, t.read_byte_len),
                imm_data: call::<u32>(d, t.read_imm_data),
                qp_num: call::<u32>(d, t.read_qp_num),
                src_qp: call::<u32>(d, t.read_src_qp),
                wc_flags: call::<c_uint>(d, t.read_wc_flags),
                pkey_index: 0,
                slid: call::<u32>(d, t.read_slid) as u16,
                sl: call::<u8>(d, t.read_sl),
                dlid_path_bits: call::<u8>(d, t.read_dlid_path_bits),
            },
            followed: false,
            ts: call::<u64>(d, t.read_completion_ts),
            wallclock_ns: call::<u64>(d, t.read_completion_wallclock_ns),
        }
    }
}

/// Calls a reader of `cq` (0 when it has none).
///
/// # Safety
/// `f` is null or a reader of `cq` returning `T`.
pub unsafe fn call<T: Default>(cq: *mut IbvCq, f: usize) -> T {
    if f == 0 {
        return T::default();
    }
    // SAFETY: per the contract.
    unsafe { std::mem::transmute::<usize, unsafe extern "C" fn(*mut IbvCq) -> T>(f)(cq) }
}
