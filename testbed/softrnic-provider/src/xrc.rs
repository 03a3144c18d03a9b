//! XRC domains (`ibv_open_xrcd`, `ibv_close_xrcd`), SRQs of either type
//! (`ibv_create_srq_ex`) and SRQ numbers (`ibv_get_srq_num`). XRC QPs are made by
//! `new_qp` (initiators through `ibv_create_qp` or `ibv_create_qp_ex`, targets through
//! `ibv_create_qp_ex` with a domain); the engine's `xrc` module executes their requests.

use super::*;

const IBV_XRCD_INIT_ATTR_FD: u32 = 1 << 0;
const IBV_XRCD_INIT_ATTR_OFLAGS: u32 = 1 << 1;
const IBV_SRQ_INIT_ATTR_TYPE: u32 = 1 << 0;
const IBV_SRQ_INIT_ATTR_PD: u32 = 1 << 1;
const IBV_SRQ_INIT_ATTR_XRCD: u32 = 1 << 2;
const IBV_SRQ_INIT_ATTR_CQ: u32 = 1 << 3;

/// Open a domain: a private one (`fd` −1) or the one every process of this host shares
/// through the same file (`fd` open on it), created with `O_CREAT`, refused with `O_EXCL`
/// if it exists — the kernel's rules.
pub(super) unsafe extern "C" fn open_xrcd(
    ctx: *mut IbvContext,
    attr: *mut IbvXrcdInitAttr,
) -> *mut VerbsXrcd {
    guard(null_mut(), || {
        // SAFETY: the caller's attributes.
        let a = unsafe { &*attr };
        let both = IBV_XRCD_INIT_ATTR_FD | IBV_XRCD_INIT_ATTR_OFLAGS;
        if a.comp_mask & !both != 0 {
            set_errno(libc::EOPNOTSUPP);
            return null_mut();
        }
        if a.comp_mask != both || a.oflags & !(libc::O_CREAT | libc::O_EXCL) != 0 {
            set_errno(libc::EINVAL);
            return null_mut();
        }
        let file = if a.fd == -1 {
            None
        } else {
            // SAFETY: all-zero is a valid stat buffer; fstat only writes it.
            let mut sb: libc::stat = unsafe { std::mem::zeroed() };
            // SAFETY: as above; a bad fd is reported by fstat.
            if unsafe { libc::fstat(a.fd, &mut sb) } != 0 {
                set_errno(libc::EBADF);
                return null_mut();
            }
            Some((sb.st_dev, sb.st_ino))
        };
        // SAFETY: ctx is ours.
        let st = unsafe { state(ctx) };
        let req = Req::OpenXrcd {
            file,
            oflags: a.oflags,
        };
        match call_for_handle(st, &req) {
            Some(handle) => Box::into_raw(Box::new(VerbsXrcd {
                context: ctx,
                comp_mask: 0,
                handle,
            })),
            None => null_mut(),
        }
    })
}

pub(super) unsafe extern "C" fn close_xrcd(xrcd: *mut VerbsXrcd) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: xrcd was made by open_xrcd.
        let (st, handle) = unsafe { (state((*xrcd).context), (*xrcd).handle) };
        match st.call(&Req::CloseXrcd { xrcd: handle }) {
            Ok(_) => {
                // SAFETY: allocated by open_xrcd; the application no longer uses it.
                drop(unsafe { Box::from_raw(xrcd) });
                0
            }
            Err(e) => e,
        }
    })
}

/// A basic SRQ (as `ibv_create_srq`) or an XRC SRQ (domain, CQ and PD required); tag
/// matching and anything else is `EOPNOTSUPP`.
pub(super) unsafe extern "C" fn create_srq_ex(
    ctx: *mut IbvContext,
    attr: *mut IbvSrqInitAttrEx,
) -> *mut IbvSrq {
    guard(null_mut(), || {
        // SAFETY: the caller's attributes.
        let a = unsafe { &mut *attr };
        let known = IBV_SRQ_INIT_ATTR_TYPE
            | IBV_SRQ_INIT_ATTR_PD
            | IBV_SRQ_INIT_ATTR_XRCD
            | IBV_SRQ_INIT_ATTR_CQ;
        let srq_type = if a.comp_mask & IBV_SRQ_INIT_ATTR_TYPE != 0 {
            a.srq_type
        } else {
            IBV_SRQT_BASIC
        };
        if a.comp_mask & !known != 0 || !matches!(srq_type, IBV_SRQT_BASIC | IBV_SRQT_XRC) {
            set_errno(libc::EOPNOTSUPP);
            return null_mut();
        }
        let has = |bit: u32, p: *const c_void| a.comp_mask & bit != 0 && !p.is_null();
        let xrc = srq_type == IBV_SRQT_XRC;
        let ours = |c: *mut IbvContext| c == ctx;
        // SAFETY: non-null objects named by the caller are objects of a context.
        let valid = unsafe {
            has(IBV_SRQ_INIT_ATTR_PD, a.pd.cast())
                && ours((*a.pd).context)
                && (!xrc
                    || (has(IBV_SRQ_INIT_ATTR_XRCD, a.xrcd.cast())
                        && has(IBV_SRQ_INIT_ATTR_CQ, a.cq.cast())
                        && ours((*a.xrcd).context)
                        && ours((*a.cq).context)))
        };
        if !valid {
            set_errno(libc::EINVAL);
            return null_mut();
        }
        let (xrcd, cq) = if xrc {
            (a.xrcd, a.cq)
        } else {
            (null_mut(), null_mut())
        };
        // SAFETY: checked above: the PD, domain and CQ are this context's.
        unsafe { new_srq(a.pd, a.srq_context, &mut a.attr, xrcd, cq) }
    })
}

pub(super) unsafe extern "C" fn get_srq_num(srq: *mut IbvSrq, srq_num: *mut u32) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: every SRQ of this provider is a VerbsSrq; srq_num is writable.
        unsafe { *srq_num = (*srq.cast::<VerbsSrq>()).srq_num };
        0
    })
}

const IBV_QP_OPEN_ATTR_NUM: u32 = 1 << 0;
const IBV_QP_OPEN_ATTR_XRCD: u32 = 1 << 1;
const IBV_QP_OPEN_ATTR_CONTEXT: u32 = 1 << 2;
const IBV_QP_OPEN_ATTR_TYPE: u32 = 1 << 3;

/// `ibv_open_qp`: another handle of an XRC target QP of an open domain, possibly created by
/// another process of the host. It may be modified, queried and destroyed like the
/// creator's; the QP lives until its last handle goes.
pub(super) unsafe extern "C" fn open_qp(
    ctx: *mut IbvContext,
    attr: *mut IbvQpOpenAttr,
) -> *mut IbvQp {
    guard(null_mut(), || {
        // SAFETY: the caller's attributes.
        let a = unsafe { &*attr };
        let needed = IBV_QP_OPEN_ATTR_NUM | IBV_QP_OPEN_ATTR_XRCD | IBV_QP_OPEN_ATTR_TYPE;
        let known = needed | IBV_QP_OPEN_ATTR_CONTEXT;
        if a.comp_mask & !known != 0 {
            set_errno(libc::EOPNOTSUPP);
            return null_mut();
        }
        if a.comp_mask & needed != needed
            || a.qp_type != IBV_QPT_XRC_RECV
            || a.xrcd.is_null()
            // SAFETY: a non-null domain was made by open_xrcd and is open (the caller's
            // attributes).
            || unsafe { (*a.xrcd).context } != ctx
        {
            set_errno(libc::EINVAL);
            return null_mut();
        }
        // SAFETY: ctx is ours; the domain was checked above.
        let (st, xrcd) = unsafe { (state(ctx), (*a.xrcd).handle) };
        let req = Req::OpenQp {
            xrcd,
            qpn: a.qp_num,
        };
        let Some(qpn) = call_expect(st, &req, |r| match r {
            Resp::Qp { qpn, .. } => Some(qpn),
            _ => None,
        }) else {
            return null_mut();
        };
        let qp_state = match st.call(&Req::QueryQp { qpn }) {
            Ok(Resp::QpAttr { attr, .. }) => attr.qp_state,
            _ => IBV_QPS_RESET,
        };
        let mut q: Box<SrQp> = Box::new(SrQp {
            // SAFETY: verbs_qp is plain C data; all-zero is valid (see create_cq).
            vqp: unsafe { std::mem::zeroed() },
            rings: None,
            batch: Mutex::default(),
        });
        q.vqp.comp_mask |= VERBS_QP_XRCD;
        q.vqp.xrcd = a.xrcd.cast();
        let qp = &mut q.vqp.qp;
        qp.context = ctx;
        if a.comp_mask & IBV_QP_OPEN_ATTR_CONTEXT != 0 {
            qp.qp_context = a.qp_context;
        }
        qp.handle = qpn;
        qp.qp_num = qpn;
        qp.state = qp_state;
        qp.qp_type = IBV_QPT_XRC_RECV;
        let undo = Req::DestroyQp { qpn };
        // SAFETY: allocated just above and not handed out.
        unsafe { hand_out(st, 1, qpn, Box::into_raw(q), &undo) as *mut IbvQp }
    })
}
