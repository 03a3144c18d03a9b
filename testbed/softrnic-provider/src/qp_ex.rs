//! `ibv_create_qp_ex` and the `ibv_wr_*` posting interface. A QP created with send ops is
//! an ordinary softrnic QP whose `verbs_qp` says it has an `ibv_qp_ex` (so the real
//! `ibv_qp_to_qp_ex` finds it). Its `wr_*` ops build ordinary work requests in a per-QP
//! batch; `ibv_wr_complete` posts the batch through the same send ring as `ibv_post_send`,
//! with the same checks, and posts all of it or none (as a NIC rings its doorbell once for
//! the batch, or not at all).

use super::*;

/// Send ops a QP may ask for (`IBV_QP_EX_WITH_*`): the opcodes `ibv_post_send` takes,
/// except memory windows and invalidation.
const SUPPORTED_OPS: u64 = 0x7f;
const IBV_QP_INIT_ATTR_PD: u32 = 1 << 0;
const IBV_QP_INIT_ATTR_XRCD: u32 = 1 << 1;
const IBV_QP_INIT_ATTR_CREATE_FLAGS: u32 = 1 << 2;
const IBV_QP_INIT_ATTR_SEND_OPS_FLAGS: u32 = 1 << 6;

/// One request of a batch, with the SGEs (or inline data) it owns until it is posted.
struct Built {
    wr: IbvSendWr,
    sges: Vec<IbvSge>,
    inline: Vec<u8>,
}

/// The batch being built between `wr_start` and `wr_complete`/`wr_abort`.
#[derive(Default)]
pub(super) struct Batch {
    wrs: Vec<Built>,
    /// The first mistake in building (a `wr_set_*` with no request to set), returned by
    /// `wr_complete`.
    err: c_int,
}

impl Batch {
    fn push(&mut self, opcode: c_int, wr_id: u64, flags: u32, imm: u32, wr: [u64; 4]) {
        // SAFETY: all-zero is a valid `ibv_send_wr`.
        let mut w: IbvSendWr = unsafe { std::mem::zeroed() };
        (w.wr_id, w.opcode, w.send_flags, w.imm_data, w.wr) = (wr_id, opcode, flags, imm, wr);
        self.wrs.push(Built {
            wr: w,
            sges: Vec::new(),
            inline: Vec::new(),
        });
    }

    fn last(&mut self) -> Option<&mut Built> {
        let last = self.wrs.last_mut();
        if last.is_none() && self.err == 0 {
            self.err = libc::EINVAL;
        }
        last
    }

    /// Links the requests into a list whose SGEs point at what they own; the list lives as
    /// long as the returned vector.
    fn link(&mut self) -> Vec<Built> {
        let mut v = std::mem::take(&mut self.wrs);
        let n = v.len();
        let base = v.as_mut_ptr();
        for i in 0..n {
            // SAFETY: i < n; the vector is not resized while the pointers are in use.
            let b = unsafe { &mut *base.add(i) };
            if b.wr.send_flags & IBV_SEND_INLINE != 0 {
                b.sges = vec![IbvSge {
                    addr: b.inline.as_ptr() as u64,
                    length: b.inline.len() as u32,
                    lkey: 0,
                }];
            }
            b.wr.sg_list = b.sges.as_mut_ptr();
            b.wr.num_sge = b.sges.len() as c_int;
            b.wr.next = if i + 1 < n {
                // SAFETY: as above.
                unsafe { &mut (*base.add(i + 1)).wr }
            } else {
                null_mut()
            };
        }
        v
    }
}

pub(super) unsafe extern "C" fn create_qp_ex(
    ctx: *mut IbvContext,
    attr: *mut IbvQpInitAttrEx,
) -> *mut IbvQp {
    guard(null_mut(), || {
        // SAFETY: the caller's attributes.
        let a = unsafe { &mut *attr };
        let known = IBV_QP_INIT_ATTR_PD
            | IBV_QP_INIT_ATTR_XRCD
            | IBV_QP_INIT_ATTR_CREATE_FLAGS
            | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS;
        let flags = a.comp_mask & IBV_QP_INIT_ATTR_CREATE_FLAGS != 0 && a.create_flags != 0;
        let ops = if a.comp_mask & IBV_QP_INIT_ATTR_SEND_OPS_FLAGS != 0 {
            a.send_ops_flags
        } else {
            0
        };
        if a.comp_mask & !known != 0 || flags || ops & !SUPPORTED_OPS != 0 {
            // RSS, TSO, creation flags, memory-window or invalidation ops.
            set_errno(libc::EOPNOTSUPP);
            return null_mut();
        }
        // An XRC target belongs to a domain instead of a PD; every other QP to a PD.
        let (pd, xrcd) = if a.qp_type == IBV_QPT_XRC_RECV {
            let x = a.xrcd.cast::<VerbsXrcd>();
            let given = a.comp_mask & IBV_QP_INIT_ATTR_XRCD != 0 && !x.is_null();
            // SAFETY: a non-null domain was made by open_xrcd.
            if !given || unsafe { (*x).context } != ctx || ops != 0 {
                set_errno(libc::EINVAL);
                return null_mut();
            }
            (null_mut(), x)
        } else {
            if a.comp_mask & IBV_QP_INIT_ATTR_PD == 0
                || a.pd.is_null()
                // SAFETY: a non-null PD was made by alloc_pd and is live (the caller's
                // attributes).
                || unsafe { (*a.pd).context } != ctx
            {
                set_errno(libc::EINVAL);
                return null_mut();
            }
            (a.pd, null_mut())
        };
        // SAFETY: the attributes begin as `ibv_qp_init_attr`'s (new_qp reads and writes only
        // its named members, not the padding `comp_mask` occupies here); PD and domain are
        // checked above.
        let qp = unsafe { new_qp(ctx, pd, &mut *attr.cast::<IbvQpInitAttr>(), xrcd) };
        if qp.is_null() || ops == 0 {
            return qp;
        }
        // SAFETY: create_qp made it as an SrQp, not used by anyone yet.
        let q = unsafe { &mut *(qp as *mut SrQp) };
        q.vqp.comp_mask |= VERBS_QP_EX;
        let t = &mut q.vqp.ex;
        t.wr_start = wr_start as *const () as usize;
        t.wr_complete = wr_complete as *const () as usize;
        t.wr_abort = wr_abort as *const () as usize;
        t.wr_send = wr_send as *const () as usize;
        t.wr_send_imm = wr_send_imm as *const () as usize;
        t.wr_rdma_write = wr_rdma_write as *const () as usize;
        t.wr_rdma_write_imm = wr_rdma_write_imm as *const () as usize;
        t.wr_rdma_read = wr_rdma_read as *const () as usize;
        t.wr_atomic_cmp_swp = wr_atomic_cmp_swp as *const () as usize;
        t.wr_atomic_fetch_add = wr_atomic_fetch_add as *const () as usize;
        t.wr_set_sge = wr_set_sge as *const () as usize;
        t.wr_set_sge_list = wr_set_sge_list as *const () as usize;
        t.wr_set_inline_data = wr_set_inline_data as *const () as usize;
        t.wr_set_inline_data_list = wr_set_inline_data_list as *const () as usize;
        t.wr_set_ud_addr = wr_set_ud_addr as *const () as usize;
        t.wr_set_xrc_srqn = wr_set_xrc_srqn as *const () as usize;
        qp
    })
}

/// The QP of an `ibv_qp_ex` (it is the start of the SrQp) and its batch.
///
/// # Safety
/// `qpx` is the `ibv_qp_ex` of a live QP made by `create_qp_ex`.
unsafe fn batch<'a>(qpx: *mut VerbsQp) -> std::sync::MutexGuard<'a, Batch> {
    // SAFETY: per the contract.
    let q = unsafe { &*(qpx as *const SrQp) };
    q.batch.lock().unwrap_or_else(|p| p.into_inner())
}

/// Opens a request with the `wr_id` and `wr_flags` the application set in the QP.
///
/// # Safety
/// As [`batch`].
unsafe fn open(qpx: *mut VerbsQp, opcode: c_int, imm: u32, wr: [u64; 4]) {
    guard((), || {
        // SAFETY: per the contract.
        let (id, flags) = unsafe { ((*qpx).ex.wr_id, (*qpx).ex.wr_flags) };
        // SAFETY: as above.
        unsafe { batch(qpx) }.push(opcode, id, flags, imm, wr);
    })
}

unsafe extern "C" fn wr_start(qpx: *mut VerbsQp) {
    guard((), || {
        // SAFETY: the application's QP.
        *unsafe { batch(qpx) } = Batch::default();
    })
}

unsafe extern "C" fn wr_abort(qpx: *mut VerbsQp) {
    // SAFETY: as in wr_start.
    unsafe { wr_start(qpx) };
}

unsafe extern "C" fn wr_complete(qpx: *mut VerbsQp) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: the application's QP.
        let mut b = unsafe { batch(qpx) };
        let err = std::mem::take(&mut b.err);
        let mut list = b.link();
        drop(b);
        if err != 0 {
            return err;
        }
        let Some(first) = list.first_mut() else {
            return 0;
        };
        let qp = qpx as *mut IbvQp;
        let mut bad = null_mut();
        // SAFETY: qp is ours; the list is linked above and outlives the call.
        unsafe {
            match &(*(qp as *const SrQp)).rings {
                Some(rings) => post_send_ring(qp, rings, &mut first.wr, &mut bad, true),
                None => post_send(qp, &mut first.wr, &mut bad),
            }
        }
    })
}

unsafe extern "C" fn wr_send(qpx: *mut VerbsQp) {
    // SAFETY: the application's QP.
    unsafe { open(qpx, IBV_WR_SEND, 0, [0; 4]) }
}

unsafe extern "C" fn wr_send_imm(qpx: *mut VerbsQp, imm: u32) {
    // SAFETY: the application's QP.
    unsafe { open(qpx, IBV_WR_SEND_WITH_IMM, imm, [0; 4]) }
}

unsafe extern "C" fn wr_rdma_write(qpx: *mut VerbsQp, rkey: u32, addr: u64) {
    // SAFETY: the application's QP.
    unsafe { open(qpx, IBV_WR_RDMA_WRITE, 0, [addr, rkey.into(), 0, 0]) }
}

unsafe extern "C" fn wr_rdma_write_imm(qpx: *mut VerbsQp, rkey: u32, addr: u64, imm: u32) {
    // SAFETY: the application's QP.
    unsafe {
        open(
            qpx,
            IBV_WR_RDMA_WRITE_WITH_IMM,
            imm,
            [addr, rkey.into(), 0, 0],
        )
    }
}

unsafe extern "C" fn wr_rdma_read(qpx: *mut VerbsQp, rkey: u32, addr: u64) {
    // SAFETY: the application's QP.
    unsafe { open(qpx, IBV_WR_RDMA_READ, 0, [addr, rkey.into(), 0, 0]) }
}

unsafe extern "C" fn wr_atomic_cmp_swp(
    qpx: *mut VerbsQp,
    rkey: u32,
    addr: u64,
    compare: u64,
    swap: u64,
) {
    let wr = [addr, compare, swap, rkey.into()];
    // SAFETY: the application's QP.
    unsafe { open(qpx, IBV_WR_ATOMIC_CMP_AND_SWP, 0, wr) }
}

unsafe extern "C" fn wr_atomic_fetch_add(qpx: *mut VerbsQp, rkey: u32, addr: u64, add: u64) {
    let wr = [addr, add, 0, rkey.into()];
    // SAFETY: the application's QP.
    unsafe { open(qpx, IBV_WR_ATOMIC_FETCH_AND_ADD, 0, wr) }
}

unsafe extern "C" fn wr_set_sge(qpx: *mut VerbsQp, lkey: u32, addr: u64, length: u32) {
    guard((), || {
        // SAFETY: the application's QP.
        if let Some(w) = unsafe { batch(qpx) }.last() {
            w.sges = vec![IbvSge { addr, length, lkey }];
        }
    })
}

unsafe extern "C" fn wr_set_sge_list(qpx: *mut VerbsQp, n: usize, list: *const IbvSge) {
    guard((), || {
        // SAFETY: the application's QP.
        let mut b = unsafe { batch(qpx) };
        let Some(w) = b.last() else {
            return;
        };
        w.sges = if n == 0 || list.is_null() {
            Vec::new()
        } else {
            // SAFETY: the caller's list of `n` entries.
            unsafe { std::slice::from_raw_parts(list, n) }
                .iter()
                .map(|s| IbvSge {
                    addr: s.addr,
                    length: s.length,
                    lkey: s.lkey,
                })
                .collect()
        };
    })
}

/// Copies inline data now, as a NIC's provider writes it into the WQE: the application may
/// reuse its buffers as soon as the call returns.
///
/// # Safety
/// As [`batch`]; every buffer is valid for its length.
unsafe fn set_inline(qpx: *mut VerbsQp, bufs: &[IbvDataBuf]) {
    guard((), || {
        // SAFETY: per the contract.
        let mut b = unsafe { batch(qpx) };
        let Some(w) = b.last() else {
            return;
        };
        w.inline.clear();
        for d in bufs.iter().filter(|d| d.length > 0 && !d.addr.is_null()) {
            // SAFETY: per the contract.
            let src = unsafe { std::slice::from_raw_parts(d.addr as *const u8, d.length) };
            w.inline.extend_from_slice(src);
        }
        w.wr.send_flags |= IBV_SEND_INLINE;
    })
}

unsafe extern "C" fn wr_set_inline_data(qpx: *mut VerbsQp, addr: *mut c_void, length: usize) {
    // SAFETY: the application's QP and buffer.
    unsafe { set_inline(qpx, &[IbvDataBuf { addr, length }]) }
}

unsafe extern "C" fn wr_set_inline_data_list(qpx: *mut VerbsQp, n: usize, list: *const IbvDataBuf) {
    let bufs = if n == 0 || list.is_null() {
        &[][..]
    } else {
        // SAFETY: the caller's list of `n` buffers.
        unsafe { std::slice::from_raw_parts(list, n) }
    };
    // SAFETY: the application's QP and buffers.
    unsafe { set_inline(qpx, bufs) }
}

unsafe extern "C" fn wr_set_ud_addr(qpx: *mut VerbsQp, ah: *mut IbvAh, qpn: u32, qkey: u32) {
    guard((), || {
        // SAFETY: the application's QP.
        if let Some(w) = unsafe { batch(qpx) }.last() {
            w.wr.wr[0] = ah as u64;
            w.wr.wr[1] = u64::from(qpn) | u64::from(qkey) << 32;
        }
    })
}

unsafe extern "C" fn wr_set_xrc_srqn(qpx: *mut VerbsQp, srqn: u32) {
    guard((), || {
        // SAFETY: the application's QP.
        if let Some(w) = unsafe { batch(qpx) }.last() {
            w.wr.qp_type_xrc_remote_srqn = srqn;
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A batch links its requests in order, SGEs and inline data owned by it, and a
    /// `wr_set_*` with no request is remembered as EINVAL.
    #[test]
    fn batches_link_requests_with_their_own_sges_and_inline_data() {
        let mut b = Batch::default();
        assert!(b.last().is_none());
        assert_eq!(b.err, libc::EINVAL);
        b = Batch::default();
        b.push(IBV_WR_RDMA_WRITE, 1, 2, 0, [4096, 7, 0, 0]);
        b.last().unwrap().sges = vec![IbvSge {
            addr: 8192,
            length: 100,
            lkey: 3,
        }];
        b.push(IBV_WR_SEND, 2, IBV_SEND_INLINE, 0, [0; 4]);
        b.last().unwrap().inline = b"hello".to_vec();
        let l = b.link();
        assert!(b.wrs.is_empty());
        assert_eq!(l.len(), 2);
        assert_eq!((l[0].wr.wr_id, l[0].wr.num_sge), (1, 1));
        assert_eq!(l[0].wr.next as *const IbvSendWr, &l[1].wr as *const _);
        assert!(l[1].wr.next.is_null());
        // SAFETY: the SGE the link pointed at the owned inline bytes.
        let s = unsafe { &*l[1].wr.sg_list };
        assert_eq!((s.addr, s.length), (l[1].inline.as_ptr() as u64, 5));
    }
}
