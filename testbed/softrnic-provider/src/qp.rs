//! QPs: creation (RC, UC, UD and XRC, with their rings), the state machine's modify, query and destroy.

use super::*;

pub(super) unsafe extern "C" fn create_qp(pd: *mut IbvPd, attr: *mut IbvQpInitAttr) -> *mut IbvQp {
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
/// `ctx` is a live context made by alloc_context; `pd` is null or a PD of `ctx`; `xrcd` is null
/// or an open XRC domain of `ctx`; the CQs and SRQ `a` names are null or objects of `ctx`.
pub(super) unsafe fn new_qp(
    ctx: *mut IbvContext,
    pd: *mut IbvPd,
    a: &mut IbvQpInitAttr,
    xrcd: *mut VerbsXrcd,
) -> *mut IbvQp {
    let target = a.qp_type == IBV_QPT_XRC_RECV;
    let known = matches!(
        a.qp_type,
        IBV_QPT_RC
            | IBV_QPT_UC
            | IBV_QPT_UD
            | IBV_QPT_XRC_SEND
            | IBV_QPT_XRC_RECV
            | IBV_QPT_RAW_PACKET
    );
    if !known {
        // No driver QPs.
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
            // SAFETY: per the contract, a non-null CQ is a live CQ of ctx (made by create_cq).
            unsafe { (*cq).handle }
        }
    };
    // SAFETY: per the contract, ctx was made by alloc_context and is live.
    let st = unsafe { state(ctx) };
    let (scq, rcq) = (handle_of(a.send_cq), handle_of(a.recv_cq));
    let srq = if a.srq.is_null() || target {
        0
    } else {
        // SAFETY: per the contract, a non-null srq is a live SRQ of ctx (made by create_srq).
        unsafe { (*(a.srq as *const IbvSrq)).handle }
    };
    let req = Req::CreateQp {
        pd: if pd.is_null() {
            0
        } else {
            // SAFETY: per the contract, a non-null pd is a live PD of ctx.
            unsafe { (*pd).handle }
        },
        send_cq: scq,
        recv_cq: rcq,
        srq,
        // SAFETY: a target has a non-null xrcd (checked above), an open domain per the
        // contract.
        xrcd: if target { unsafe { (*xrcd).handle } } else { 0 },
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
    let Some((qpn, cap)) = call_expect(st, &req, |r| match r {
        Resp::Qp { qpn, cap } => Some((qpn, cap)),
        _ => None,
    }) else {
        return null_mut();
    };
    a.cap = IbvQpCap {
        max_send_wr: cap.max_send_wr,
        max_recv_wr: cap.max_recv_wr,
        max_send_sge: cap.max_send_sge,
        max_recv_sge: cap.max_recv_sge,
        max_inline_data: cap.max_inline_data,
    };
    let mut q: Box<SrQp> = Box::new(SrQp {
        // SAFETY: verbs_qp is plain C data; all-zero is valid (see create_cq).
        vqp: unsafe { std::mem::zeroed() },
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
    let (sq, rq) = l.rings();
    q.rings = shared.map(|map| ProvQpRings {
        map,
        sq,
        rq,
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
    let qp = unsafe { hand_out(st, 1, qpn, Box::into_raw(q), &undo) };
    qp as *mut IbvQp
}

pub(super) unsafe extern "C" fn modify_qp(
    qp: *mut IbvQp,
    attr: *mut IbvQpAttr,
    mask: c_int,
) -> c_int {
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
            rate_limit: a.rate_limit,
        };
        match st.call(&Req::ModifyQp { qpn, mask, attr: w }) {
            Ok(_) => 0,
            Err(e) => e,
        }
    })
}

/// `ibv_modify_qp_rate_limit`: packet pacing of a QP in RTS, with a burst size
/// (`typical_pkt_sz` is a hint for a NIC's rate tables; the engine paces every packet).
pub(super) unsafe extern "C" fn modify_qp_rate_limit(
    qp: *mut IbvQp,
    attr: *mut IbvQpRateLimitAttr,
) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: qp is ours; the caller passes a valid attribute struct.
        let (st, qpn, a) = unsafe { (state((*qp).context), (*qp).qp_num, &*attr) };
        if a.comp_mask != 0 {
            return libc::EINVAL;
        }
        let req = Req::RateLimit {
            qpn,
            kbps: a.rate_limit,
            max_burst: a.max_burst_sz,
        };
        match st.call(&req) {
            Ok(_) => 0,
            Err(e) => e,
        }
    })
}

pub(super) unsafe extern "C" fn query_qp(
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

pub(super) unsafe extern "C" fn destroy_qp(qp: *mut IbvQp) -> c_int {
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
