//! The engine's responses to the provider's requests ([`Resp`]), and their encoding.

use super::*;

/// Response payloads (the request determines which one follows the errno).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resp {
    /// errno != 0; for post_send/post_recv the index of the first rejected WR follows.
    Err {
        errno: i32,
        bad_index: u32,
    },
    Unit,
    Handle(u32),
    Mr {
        lkey: u32,
        rkey: u32,
    },
    Cq {
        handle: u32,
        cqe: u32,
    },
    Qp {
        qpn: u32,
        cap: Caps,
    },
    QpAttr {
        attr: QpAttrs,
        cap: Caps,
        qp_type: i32,
        sq_sig_all: bool,
    },
    Wcs(Vec<IbvWc>),
    Channel {
        id: u32,
        token: u64,
    },
    ContextKey {
        conn: u64,
        token: u64,
    },
    /// A shared receive queue's handle and its attributes (create and query).
    Srq {
        handle: u32,
        max_wr: u32,
        max_sge: u32,
        srq_limit: u32,
    },
    /// A destroyed QP, SRQ or CQ: how many of its asynchronous events the application has
    /// read, and whether the record on the event stream is one of its own, not yet reported
    /// read (see softrnic's `events`).
    Destroyed {
        events_reported: u32,
        event_unread: bool,
    },
}

impl Resp {
    pub fn encode(&self) -> Vec<u8> {
        let mut e = Enc::default();
        match self {
            Resp::Err { errno, bad_index } => {
                e.i32(*errno).u32(*bad_index);
            }
            Resp::Unit => {
                e.i32(0);
            }
            Resp::Handle(h) => {
                e.i32(0).u32(*h);
            }
            Resp::Mr { lkey, rkey } => {
                e.i32(0).u32(*lkey).u32(*rkey);
            }
            Resp::Cq { handle, cqe } => {
                e.i32(0).u32(*handle).u32(*cqe);
            }
            Resp::Channel { id, token } => {
                e.i32(0).u32(*id).u64(*token);
            }
            Resp::ContextKey { conn, token } => {
                e.i32(0).u64(*conn).u64(*token);
            }
            Resp::Srq {
                handle,
                max_wr,
                max_sge,
                srq_limit,
            } => {
                e.i32(0)
                    .u32(*handle)
                    .u32(*max_wr)
                    .u32(*max_sge)
                    .u32(*srq_limit);
            }
            Resp::Destroyed {
                events_reported,
                event_unread,
            } => {
                e.i32(0).u32(*events_reported).u8(*event_unread as u8);
            }
            Resp::Qp { qpn, cap } => {
                e.i32(0).u32(*qpn);
                cap.enc(&mut e);
            }
            Resp::QpAttr {
                attr,
                cap,
                qp_type,
                sq_sig_all,
            } => {
                e.i32(0);
                attr.enc(&mut e);
                cap.enc(&mut e);
                e.i32(*qp_type).u8(*sq_sig_all as u8);
            }
            Resp::Wcs(wcs) => {
                e.i32(0).u32(wcs.len() as u32);
                for w in wcs {
                    e.u64(w.wr_id)
                        .i32(w.status)
                        .i32(w.opcode)
                        .u32(w.vendor_err)
                        .u32(w.byte_len)
                        .u32(w.imm_data)
                        .u32(w.qp_num)
                        .u32(w.src_qp)
                        .u32(w.wc_flags);
                }
            }
        }
        e.0
    }

    /// Decode a response to `req`.
    pub fn decode(req: &Req, b: &[u8]) -> Result<Self, WireError> {
        let mut d = Dec(b);
        let errno = d.i32()?;
        if errno != 0 {
            let bad_index = d.u32().unwrap_or(0);
            return Ok(Resp::Err { errno, bad_index });
        }
        Ok(match req {
            Req::AllocPd
            | Req::AllocMw { .. }
            | Req::OpenXrcd { .. }
            | Req::CreateFlow { .. }
            | Req::AllocDm { .. } => Resp::Handle(d.u32()?),
            Req::RegMr { .. } | Req::RegMrIova { .. } => Resp::Mr {
                lkey: d.u32()?,
                rkey: d.u32()?,
            },
            Req::CreateCq { .. } => Resp::Cq {
                handle: d.u32()?,
                cqe: d.u32()?,
            },
            Req::CreateChannel | Req::CreateAsyncChannel => Resp::Channel {
                id: d.u32()?,
                token: d.u64()?,
            },
            Req::ContextKey => Resp::ContextKey {
                conn: d.u64()?,
                token: d.u64()?,
            },
            Req::CreateQp { .. } | Req::OpenQp { .. } => Resp::Qp {
                qpn: d.u32()?,
                cap: Caps::dec(&mut d)?,
            },
            Req::CreateSrq { .. } | Req::QuerySrq { .. } => Resp::Srq {
                handle: d.u32()?,
                max_wr: d.u32()?,
                max_sge: d.u32()?,
                srq_limit: d.u32()?,
            },
            Req::DestroyQp { .. } | Req::DestroySrq { .. } | Req::DestroyCq { .. } => {
                Resp::Destroyed {
                    events_reported: d.u32()?,
                    event_unread: d.u8()? != 0,
                }
            }
            Req::QueryQp { .. } => Resp::QpAttr {
                attr: QpAttrs::dec(&mut d)?,
                cap: Caps::dec(&mut d)?,
                qp_type: d.i32()?,
                sq_sig_all: d.u8()? != 0,
            },
            Req::PollCq { .. } => {
                let n = d.u32()? as usize;
                let mut v = Vec::with_capacity(n.min(4096));
                for _ in 0..n {
                    v.push(IbvWc {
                        wr_id: d.u64()?,
                        status: d.i32()?,
                        opcode: d.i32()?,
                        vendor_err: d.u32()?,
                        byte_len: d.u32()?,
                        imm_data: d.u32()?,
                        qp_num: d.u32()?,
                        src_qp: d.u32()?,
                        wc_flags: d.u32()?,
                        ..Default::default()
                    });
                }
                Resp::Wcs(v)
            }
            _ => Resp::Unit,
        })
    }
}
