//! Posting: `ibv_post_send` and `ibv_post_recv` through the QP's shared rings (or the engine's socket), with the checks a NIC's provider makes.

use super::*;

pub(super) unsafe extern "C" fn post_send(
    qp: *mut IbvQp,
    wr: *mut IbvSendWr,
    bad: *mut *mut IbvSendWr,
) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: qp was made by create_qp (an SrQp); wr is the caller's list of valid WRs.
        if let Some(rings) = unsafe { &(*(qp as *const SrQp)).rings } {
            // SAFETY: qp is an SrQp with these rings; wr is the caller's NULL-terminated list of
            // valid WRs and bad is writable (ibv_post_send's contract).
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

pub(super) unsafe extern "C" fn post_recv(
    qp: *mut IbvQp,
    wr: *mut IbvRecvWr,
    bad: *mut *mut IbvRecvWr,
) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: qp was made by create_qp; bad is writable.
        let xrc = unsafe { matches!((*qp).qp_type, IBV_QPT_XRC_SEND | IBV_QPT_XRC_RECV) };
        // SAFETY: qp was made by create_qp and is live (ibv_post_recv's contract).
        if xrc || unsafe { !(*qp).srq.is_null() } {
            // Its receives come from an SRQ (ibv_post_srq_recv).
            // SAFETY: bad is writable (ibv_post_recv's contract).
            unsafe { *bad = wr };
            return libc::EINVAL;
        }
        // SAFETY: qp was made by create_qp (an SrQp); wr is the caller's list of valid WRs.
        if let Some(rings) = unsafe { &(*(qp as *const SrQp)).rings } {
            // SAFETY: qp is an SrQp with these rings; wr is the caller's NULL-terminated list of
            // valid WRs and bad is writable (ibv_post_recv's contract).
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
/// `qp` is a live SrQp made by create_qp with `rings`; `wr` is the caller's NULL-terminated
/// list of valid work requests (as [`remote_of`] requires, and with an inline request's buffers
/// readable); `bad` is writable.
pub(super) unsafe fn post_send_ring(
    qp: *mut IbvQp,
    rings: &ProvQpRings,
    wr: *mut IbvSendWr,
    bad: *mut *mut IbvSendWr,
    whole: bool,
) -> c_int {
    // SAFETY: per the contract, qp is a live QP of this provider.
    let (qstate, qp_type) = unsafe { ((*qp).state, (*qp).qp_type) };
    if qstate != IBV_QPS_RTS && qstate != IBV_QPS_ERR {
        // SAFETY: per the contract, bad is writable.
        unsafe { *bad = wr };
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
        // SAFETY: w is non-null and, per the contract, one of the caller's valid WRs.
        let x = unsafe { &*w };
        let inline = x.send_flags & IBV_SEND_INLINE != 0;
        if x.num_sge < 0 || x.num_sge as u32 > cap.max_send_sge || !has_destination(x, qp_type) {
            ret = libc::EINVAL;
            break;
        }
        if prod.wrapping_sub(r.done(m).load(Ordering::Acquire)) >= r.n {
            ret = libc::ENOMEM;
            break;
        }
        // SAFETY: x is a valid WR, so its sg_list holds num_sge valid SGEs.
        let g = unsafe { sges(x.sg_list, x.num_sge) };
        let total: u64 = g.iter().map(|s| s.length as u64).sum();
        if let Err(e) = proto::check_send_wr(qp_type, x.opcode, inline, total) {
            ret = e;
            break;
        }
        if inline && total > cap.max_inline_data as u64 {
            ret = libc::EINVAL;
            break;
        }
        slot.fill(0);
        // SAFETY: x is a valid WR of this QP, as remote_of requires (the contract).
        let (remote_addr, rkey, compare_add, swap) = unsafe { remote_of(x, qp_type) };
        ring::SqHeader {
            wr_id: x.wr_id,
            opcode: x.opcode as u32,
            send_flags: x.send_flags,
            imm_data: x.imm_data,
            num_sge: g.len() as u32,
            remote_addr,
            rkey,
            inline_len: if inline {
                total as u32
            } else {
                ring::NOT_INLINE
            },
            compare_add,
            swap,
            doorbell: u32::from(prod == start),
            xrc_srqn: x.qp_type_xrc_remote_srqn,
        }
        .encode(&mut slot);
        if inline {
            // Inline data is read from the caller's buffers at post time, as the verbs API
            // specifies; the caller guarantees they are valid.
            let mut o = ring::SQ_SGE_OFF + ring::SGE_LEN * cap.max_send_sge as usize;
            for s in &g {
                // SAFETY: per the contract, an inline request's buffers are readable.
                let src =
                    unsafe { std::slice::from_raw_parts(s.addr as *const u8, s.length as usize) };
                slot[o..o + src.len()].copy_from_slice(src);
                o += src.len();
            }
        } else {
            for (i, s) in g.iter().enumerate() {
                ring::put_sge(&mut slot, ring::SQ_SGE_OFF, i, s);
            }
        }
        m.write(r.slot_off(prod), &slot);
        prod = prod.wrapping_add(1);
        w = x.next;
    }
    // Slots written beyond `prod` are invisible to the engine until it is published.
    if prod != start && !(whole && ret != 0) {
        r.prod(m).store(prod, Ordering::Release);
        // SAFETY: qp is a live QP of this provider, so its context was made by alloc_context.
        let st = unsafe { state((*qp).context) };
        if let Some(db) = &st.db {
            db.ring();
        }
    }
    if ret != 0 {
        // SAFETY: per the contract, bad is writable.
        unsafe { *bad = w };
    }
    ret
}

/// `post_recv` through the QP's receive ring (the engine takes receives when a message
/// arrives, so no doorbell unless the QP is in the error state and they must be flushed).
///
/// # Safety
/// `qp` is a live SrQp made by create_qp with `rings`; `wr` is the caller's NULL-terminated
/// list of valid receive work requests; `bad` is writable.
pub(super) unsafe fn post_recv_ring(
    qp: *mut IbvQp,
    rings: &ProvQpRings,
    wr: *mut IbvRecvWr,
    bad: *mut *mut IbvRecvWr,
) -> c_int {
    // SAFETY: per the contract, qp is a live QP of this provider.
    let qstate = unsafe { (*qp).state };
    if qstate == IBV_QPS_RESET {
        // SAFETY: per the contract, bad is writable.
        unsafe { *bad = wr };
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
        // SAFETY: w is non-null and, per the contract, one of the caller's valid WRs.
        let x = unsafe { &*w };
        if x.num_sge < 0 || x.num_sge as u32 > cap.max_recv_sge {
            ret = libc::EINVAL;
            break;
        }
        if prod.wrapping_sub(r.done(m).load(Ordering::Acquire)) >= r.n {
            ret = libc::ENOMEM;
            break;
        }
        // SAFETY: x is a valid WR, so its sg_list holds num_sge valid SGEs.
        let g = unsafe { sges(x.sg_list, x.num_sge) };
        slot.fill(0);
        ring::RqHeader {
            wr_id: x.wr_id,
            num_sge: g.len() as u32,
            _pad: 0,
        }
        .encode(&mut slot);
        for (i, s) in g.iter().enumerate() {
            ring::put_sge(&mut slot, ring::RQ_SGE_OFF, i, s);
        }
        m.write(r.slot_off(prod), &slot);
        prod = prod.wrapping_add(1);
        w = x.next;
    }
    if prod != start {
        r.prod(m).store(prod, Ordering::Release);
        if qstate == IBV_QPS_ERR {
            // SAFETY: qp is a live QP of this provider, so its context was made by
            // alloc_context.
            let st = unsafe { state((*qp).context) };
            if let Some(db) = &st.db {
                db.ring();
            }
        }
    }
    if ret != 0 {
        // SAFETY: per the contract, bad is writable.
        unsafe { *bad = w };
    }
    ret
}

/// Copy a NULL-terminated list of receive WRs, with the pointer of each (for `bad_wr`).
///
/// # Safety
/// `wr` is a NULL-terminated list of valid receive work requests.
pub(super) unsafe fn recv_list(wr: *mut IbvRecvWr) -> (Vec<RecvWr>, Vec<*mut IbvRecvWr>) {
    let mut list = Vec::new();
    let mut ptrs = Vec::new();
    let mut w = wr;
    while !w.is_null() {
        // SAFETY: w is non-null and, per the contract, one of the list's valid WRs.
        let r = unsafe { &*w };
        list.push(RecvWr {
            wr_id: r.wr_id,
            // SAFETY: r is a valid WR, so its sg_list holds num_sge valid SGEs.
            sges: unsafe { sges(r.sg_list, r.num_sge) },
        });
        ptrs.push(w);
        w = r.next;
    }
    (list, ptrs)
}

/// # Safety
/// `sg` must point to `n` valid SGEs (or be unused when `n == 0`).
pub(super) unsafe fn sges(sg: *const IbvSge, n: c_int) -> Vec<Sge> {
    if n <= 0 || sg.is_null() {
        return Vec::new();
    }
    // SAFETY: per the contract, sg (non-null here) points to n (positive here) valid SGEs.
    unsafe { std::slice::from_raw_parts(sg, n as usize) }
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
/// remote_qkey}, carried as (destination IPv4 address or multicast group key, QPN, Q_Key)
/// (see [`SendWr`]).
///
/// # Safety
/// On a UD QP, `wr.ud.ah` must be null or an address handle made by [`create_ah`]; in a
/// memory-window bind, `bind_info.mr` must be null or a live `ibv_mr` (as the verbs API
/// requires of the application).
pub(super) unsafe fn remote_of(w: &IbvSendWr, qp_type: c_int) -> (u64, u32, u64, u64) {
    if qp_type == IBV_QPT_UD {
        let ah = w.wr[0] as *const SrAh;
        let dest = if ah.is_null() {
            0
        } else {
            // SAFETY: per the contract, a non-null ah was made by create_ah (an SrAh).
            unsafe { (*ah).dest }
        };
        let (qpn, qkey) = (w.wr[1] as u32, (w.wr[1] >> 32) as u32);
        (dest, qpn, u64::from(qkey), 0)
    } else if proto::is_atomic_wr(w.opcode) {
        (w.wr[0], w.wr[3] as u32, w.wr[1], w.wr[2])
    } else if w.opcode == IBV_WR_BIND_MW {
        let b = w.bind_mw;
        let i = b.bind_info;
        let lkey = if i.mr.is_null() {
            0
        } else {
            // SAFETY: per the contract, a non-null mr is a live ibv_mr.
            unsafe { (*i.mr).lkey }
        };
        let fields = proto::bind_fields(lkey, i.mw_access_flags);
        (i.addr, b.rkey, i.length, fields)
    } else {
        (w.wr[0], w.wr[1] as u32, 0, 0)
    }
}

/// A UD send must name an address handle (nothing else is addressed per work request).
pub(super) fn has_destination(w: &IbvSendWr, qp_type: c_int) -> bool {
    qp_type != IBV_QPT_UD || w.wr[0] != 0
}
