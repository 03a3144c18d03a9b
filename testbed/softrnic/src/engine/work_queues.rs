//! Posting to send and receive queues and SRQs, taking receives, and checking local and remote memory access.

use super::*;

impl State {
    pub(super) fn post_send(&mut self, conn: u64, qpn: u32, wrs: Vec<SendWr>) -> Resp {
        let Some(q) = self.qps.get_mut(&qpn) else {
            return err(libc::EINVAL);
        };
        if q.conn != conn {
            return err(libc::EINVAL);
        }
        let bad = |i: usize, e: i32| Resp::Err {
            errno: e,
            bad_index: i as u32,
        };
        if q.state != IBV_QPS_RTS && q.state != IBV_QPS_ERR {
            return bad(0, libc::EINVAL);
        }
        let mut accepted = Vec::with_capacity(wrs.len());
        // One request is one call: its list is one doorbell.
        for (i, w) in wrs.into_iter().enumerate() {
            if w.sges.len() > q.cap.max_send_sge as usize {
                return self.finish_post(qpn, accepted, Some(bad(i, libc::EINVAL)));
            }
            let len: u64 = match &w.inline {
                Some(b) => b.len() as u64,
                None => w.sges.iter().map(|s| s.length as u64).sum(),
            };
            if let Err(e) = proto::check_send_wr(q.qpt, w.opcode, w.inline.is_some(), len) {
                return self.finish_post(qpn, accepted, Some(bad(i, e)));
            }
            if q.req.sq.len() + accepted.len() >= q.cap.max_send_wr as usize {
                return self.finish_post(qpn, accepted, Some(bad(i, libc::ENOMEM)));
            }
            let signaled = q.sq_sig_all || w.flags & IBV_SEND_SIGNALED != 0;
            accepted.push(SqWqe::new(w, len as u32, signaled, i == 0));
        }
        self.finish_post(qpn, accepted, None)
    }

    pub(super) fn finish_post(&mut self, qpn: u32, wqes: Vec<SqWqe>, result: Option<Resp>) -> Resp {
        let Some(q) = self.qps.get_mut(&qpn) else {
            return err(libc::EINVAL);
        };
        let in_error = q.state == IBV_QPS_ERR;
        q.req.sq.extend(wqes);
        if in_error {
            self.flush_qp(qpn);
        }
        result.unwrap_or(Resp::Unit)
    }

    pub(super) fn post_recv(&mut self, conn: u64, qpn: u32, wrs: Vec<RecvWr>) -> Resp {
        let Some(q) = self.qps.get_mut(&qpn) else {
            return err(libc::EINVAL);
        };
        if q.conn != conn {
            return err(libc::EINVAL);
        }
        // A QP with an SRQ, and an XRC QP, has no receive queue of its own.
        if q.state == IBV_QPS_RESET
            || q.srq != 0
            || matches!(q.qpt, IBV_QPT_XRC_SEND | IBV_QPT_XRC_RECV)
        {
            return Resp::Err {
                errno: libc::EINVAL,
                bad_index: 0,
            };
        }
        let mut result = Resp::Unit;
        for (i, w) in wrs.into_iter().enumerate() {
            if w.sges.len() > q.cap.max_recv_sge as usize {
                result = Resp::Err {
                    errno: libc::EINVAL,
                    bad_index: i as u32,
                };
                break;
            }
            if q.resp.rq.len() >= q.cap.max_recv_wr as usize {
                result = Resp::Err {
                    errno: libc::ENOMEM,
                    bad_index: i as u32,
                };
                break;
            }
            q.resp.rq.push_back(w);
        }
        if q.state == IBV_QPS_ERR {
            self.flush_qp(qpn);
        }
        result
    }

    /// `xrc`: the XRC domain and CQ of an XRC SRQ, (0, 0) for a basic one.
    pub(super) fn create_srq(
        &mut self,
        conn: u64,
        pid: i32,
        pd: u32,
        (max_wr, max_sge): (u32, u32),
        (xrcd, cq): (u32, u32),
    ) -> Resp {
        if !self.mem.pd_held_by(pd, conn) {
            return err(libc::EINVAL);
        }
        if max_wr == 0 || max_wr > device::MAX_SRQ_WR || max_sge > device::MAX_SGE {
            return err(libc::EINVAL);
        }
        if self.srqs.len() >= device::MAX_SRQ as usize {
            return err(libc::ENOMEM);
        }
        let handle = self.next_handle;
        self.next_handle += 1;
        let max_sge = max_sge.max(1);
        self.srqs.insert(
            handle,
            Srq {
                conn,
                pid,
                pd,
                xrcd,
                cq,
                max_wr,
                max_sge,
                q: VecDeque::new(),
                limit: 0,
                user: 0,
            },
        );
        Resp::Srq {
            handle,
            max_wr,
            max_sge,
            srq_limit: 0,
        }
    }

    /// Resize an SRQ (`IBV_SRQ_MAX_WR`; not below what it holds) and/or arm its limit event
    /// (`IBV_SRQ_LIMIT`; 0 disarms; not above `max_wr`). As the verbs specify, the event fires
    /// when a receive taken from the SRQ leaves fewer than the limit queued — not at arming
    /// time, even if fewer are queued already.
    pub(super) fn modify_srq(
        &mut self,
        conn: u64,
        srq: u32,
        mask: i32,
        max_wr: u32,
        limit: u32,
    ) -> Resp {
        const IBV_SRQ_MAX_WR: i32 = 1;
        const IBV_SRQ_LIMIT: i32 = 2;
        let Some(s) = self.srqs.get_mut(&srq).filter(|s| s.conn == conn) else {
            return err(libc::EINVAL);
        };
        if mask & !(IBV_SRQ_MAX_WR | IBV_SRQ_LIMIT) != 0 {
            return err(libc::EINVAL);
        }
        let new_max = if mask & IBV_SRQ_MAX_WR != 0 {
            if max_wr == 0 || max_wr > device::MAX_SRQ_WR || (max_wr as usize) < s.q.len() {
                return err(libc::EINVAL);
            }
            max_wr
        } else {
            s.max_wr
        };
        if mask & IBV_SRQ_LIMIT != 0 && limit > new_max {
            return err(libc::EINVAL);
        }
        s.max_wr = new_max;
        if mask & IBV_SRQ_LIMIT != 0 {
            s.limit = limit;
        }
        Resp::Unit
    }

    pub(super) fn post_srq_recv(&mut self, conn: u64, srq: u32, wrs: Vec<RecvWr>) -> Resp {
        let Some(s) = self.srqs.get_mut(&srq).filter(|s| s.conn == conn) else {
            return err(libc::EINVAL);
        };
        for (i, w) in wrs.into_iter().enumerate() {
            let errno = if w.sges.len() > s.max_sge as usize {
                libc::EINVAL
            } else if s.q.len() >= s.max_wr as usize {
                libc::ENOMEM
            } else {
                s.q.push_back(w);
                continue;
            };
            return Resp::Err {
                errno,
                bad_index: i as u32,
            };
        }
        Resp::Unit
    }

    /// The SRQ request `p` to QP `qpn` takes its receive from: the XRC SRQ the packet names
    /// for an XRC target (checked by [`State::xrc_srq`] before), the QP's SRQ otherwise (0:
    /// the QP's own receive queue).
    pub(super) fn srq_for(&self, qpn: u32, p: &Packet) -> u32 {
        match self.qps.get(&qpn) {
            Some(q) if q.qpt == IBV_QPT_XRC_RECV => p.srqn,
            Some(q) => q.srq,
            None => 0,
        }
    }

    /// Whether a receive is available to request `p` on a QP (from an SRQ or its own queue).
    pub(super) fn has_recv(&mut self, qpn: u32, p: &Packet) -> bool {
        let srq = self.srq_for(qpn, p);
        if srq != 0 {
            return self.srqs.get(&srq).is_some_and(|s| !s.q.is_empty());
        }
        self.pull_rq(qpn);
        self.qps.get(&qpn).is_some_and(|q| !q.resp.rq.is_empty())
    }

    /// Take the next receive for request `p` on a QP: from the SRQ (whose owner, PD and, for
    /// an XRC SRQ, CQ apply) or from the QP's own queue.
    pub(super) fn take_recv(&mut self, qpn: u32, p: &Packet) -> Option<Landing> {
        let srq = self.srq_for(qpn, p);
        let q = self.qps.get(&qpn)?;
        let qp_cq = q.recv_cq;
        if srq != 0 {
            let s = self.srqs.get_mut(&srq)?;
            let l = Landing {
                wr: s.q.pop_front()?,
                conn: s.conn,
                pid: s.pid,
                pd: s.pd,
                cq: if s.cq != 0 { s.cq } else { qp_cq },
            };
            if s.limit != 0 && s.q.len() < s.limit as usize {
                s.limit = 0;
                let (conn, user) = (s.conn, s.user);
                self.raise(conn, Obj::Srq(srq), user, IBV_EVENT_SRQ_LIMIT_REACHED);
            }
            return Some(l);
        }
        self.pull_rq(qpn);
        let q = self.qps.get_mut(&qpn)?;
        Some(Landing {
            wr: q.resp.rq.pop_front()?,
            conn: q.conn,
            pid: q.pid,
            pd: q.pd,
            cq: q.recv_cq,
        })
    }
}
