//! The verbs the provider asks for: one request of its socket, one answer.

use super::memory::Mr;
use super::*;

impl State {
    /// Registers MR `m` (its pages checked in its process) under a new key.
    fn reg_mr(&mut self, m: Mr) -> Resp {
        if let Err(e) = self.mem.admit_mr(&m) {
            return err(e);
        }
        // The pages must exist in the registering process (as pinning would require),
        // unless the MR is on demand (ODP; the whole address space for an implicit one:
        // address 0, length SIZE_MAX).
        let mut probe = [0u8; 1];
        if m.access & IBV_ACCESS_ON_DEMAND == 0
            && m.len > 0
            && (read_mem(m.pid, m.addr, &mut probe).is_err()
                || read_mem(m.pid, m.addr + m.len - 1, &mut probe).is_err())
        {
            return err(libc::EFAULT);
        }
        let key = self.mem.insert_mr(m);
        Resp::Mr {
            lkey: key,
            rkey: key,
        }
    }

    pub(super) fn request(&mut self, conn: u64, pid: i32, req: Req, now: Instant) -> Resp {
        if matches!(
            req,
            Req::PostSend { .. } | Req::PostRecv { .. } | Req::PollCq { .. }
        ) {
            self.counters.socket_posts_polls += 1;
        }
        match req {
            Req::AllocPd => {
                let next = &mut self.next_handle;
                handle_or_err(self.mem.alloc_pd(conn, || take_handle(next)))
            }
            Req::DeallocPd { pd } => {
                if !self.mem.pd_held_by(pd, conn) {
                    return err(libc::EINVAL);
                }
                let busy = self.mem.pd_in_use(pd)
                    || self.qps.values().any(|q| q.pd == pd)
                    || self.srqs.values().any(|q| q.pd == pd);
                if busy {
                    return err(libc::EBUSY);
                }
                self.mem.remove_pd(pd);
                Resp::Unit
            }
            Req::RegMr {
                pd,
                addr,
                len,
                access,
            } => {
                if len == 0 {
                    return err(libc::EINVAL);
                }
                let iova = addr;
                self.request(
                    conn,
                    pid,
                    Req::RegMrIova {
                        pd,
                        addr,
                        len,
                        iova,
                        access,
                    },
                    now,
                )
            }
            Req::RegMrIova {
                pd,
                addr,
                len,
                iova,
                access,
            } => self.reg_mr(Mr {
                conn,
                pid,
                pd,
                addr,
                len,
                iova,
                access,
            }),
            Req::DeregMr { lkey } => unit_or_err(self.mem.dereg_mr(conn, lkey)),
            Req::AllocMw { pd, mw_type } => handle_or_err(self.mem.alloc_mw(conn, pd, mw_type)),
            Req::DeallocMw { rkey } => unit_or_err(self.mem.dealloc_mw(conn, rkey)),
            Req::CreateCq { cqe, channel, user } => {
                if cqe == 0 || cqe > device::MAX_CQE {
                    return err(libc::EINVAL);
                }
                if channel != 0
                    && self
                        .channels
                        .get(&channel)
                        .is_none_or(|c| c.conn != conn || c.sink.is_none() || c.events.is_some())
                {
                    return err(libc::EINVAL);
                }
                if self.cqs.len() >= device::MAX_CQ as usize {
                    return err(libc::ENOMEM);
                }
                let h = self.handle();
                self.cqs.insert(
                    h,
                    Cq {
                        conn,
                        cap: cqe as usize,
                        q: VecDeque::new(),
                        channel,
                        user,
                        armed: false,
                        solicited_only: false,
                        ring: None,
                        overflowed: false,
                    },
                );
                Resp::Cq { handle: h, cqe }
            }
            Req::ContextKey => Resp::ContextKey {
                conn,
                token: *self.context_keys.entry(conn).or_insert_with(random_u64),
            },
            // Only as a connection's first request (`host_io::serve_conn`).
            Req::JoinContext { .. } => err(libc::EINVAL),
            Req::CreateChannel | Req::CreateAsyncChannel => {
                let events = matches!(req, Req::CreateAsyncChannel).then(EventQueue::default);
                if events.is_some() && self.event_queue(conn).is_some() {
                    // One asynchronous event stream per context.
                    return err(libc::EBUSY);
                }
                let id = self.handle();
                self.channels.insert(
                    id,
                    Channel {
                        conn,
                        pid,
                        token: random_u64(),
                        sink: None,
                        events,
                    },
                );
                Resp::Channel {
                    id,
                    token: self.channels[&id].token,
                }
            }
            Req::UserHandle { kind, handle, user } => {
                let slot = match kind {
                    1 => self.qps.get_mut(&handle).and_then(|q| {
                        if q.conn == conn {
                            Some(&mut q.user)
                        } else {
                            q.openers.iter_mut().find(|o| o.0 == conn).map(|o| &mut o.1)
                        }
                    }),
                    2 => self
                        .srqs
                        .get_mut(&handle)
                        .filter(|s| s.conn == conn)
                        .map(|s| &mut s.user),
                    _ => None,
                };
                match slot {
                    Some(u) => {
                        *u = user;
                        Resp::Unit
                    }
                    None => err(libc::EINVAL),
                }
            }
            Req::AsyncEventRead { taken_back } => self.async_event_read(conn, taken_back),
            // Only valid as the first request of its own connection (see serve_conn).
            Req::AttachChannel { .. } => err(libc::EINVAL),
            // Arming for any completion while armed solicited-only widens the arming (the
            // verbs: the request for the next completion takes precedence).
            Req::ReqNotifyCq { cq, solicited_only } => match self.cqs.get_mut(&cq) {
                Some(c) if c.conn == conn && c.channel != 0 => {
                    c.solicited_only = solicited_only && (!c.armed || c.solicited_only);
                    c.armed = true;
                    Resp::Unit
                }
                _ => err(libc::EINVAL),
            },
            Req::DestroyCq { cq } => {
                if self.cqs.get(&cq).map(|c| c.conn) != Some(conn) {
                    return err(libc::EINVAL);
                }
                if self
                    .qps
                    .values()
                    .any(|q| q.send_cq == cq || q.recv_cq == cq)
                    || self.srqs.values().any(|s| s.cq == cq)
                {
                    return err(libc::EBUSY);
                }
                self.cqs.remove(&cq);
                self.forget_events(conn, Obj::Cq(cq))
            }
            Req::PollCq { cq, max } => match self.cqs.get_mut(&cq) {
                Some(c) if c.conn == conn => {
                    let n = (max as usize).min(c.q.len());
                    Resp::Wcs(c.q.drain(..n).collect())
                }
                _ => err(libc::EINVAL),
            },
            Req::CreateQp {
                pd,
                send_cq,
                recv_cq,
                srq,
                xrcd,
                qp_type,
                sq_sig_all,
                cap,
            } => {
                let own_cq = |cq: u32| self.cqs.get(&cq).map(|c| c.conn) == Some(conn);
                let valid = match qp_type {
                    IBV_QPT_RC | IBV_QPT_UC | IBV_QPT_UD | IBV_QPT_RAW_PACKET => {
                        own_cq(send_cq)
                            && own_cq(recv_cq)
                            && (srq == 0 || self.srqs.get(&srq).map(|s| s.conn) == Some(conn))
                    }
                    // Sends only: no receive queue, CQ or SRQ of its own.
                    IBV_QPT_XRC_SEND => own_cq(send_cq) && srq == 0,
                    // Receives into its domain's SRQs: no PD, CQs or queues of its own.
                    IBV_QPT_XRC_RECV => self.xrcd_opened_by(xrcd, conn),
                    _ => return err(libc::EOPNOTSUPP),
                };
                let pd_ok = qp_type == IBV_QPT_XRC_RECV || self.mem.pd_held_by(pd, conn);
                if !valid || !pd_ok || (xrcd != 0) != (qp_type == IBV_QPT_XRC_RECV) {
                    return err(libc::EINVAL);
                }
                if cap.max_send_wr > device::MAX_QP_WR
                    || cap.max_recv_wr > device::MAX_QP_WR
                    || cap.max_send_sge > device::MAX_SGE
                    || cap.max_recv_sge > device::MAX_SGE
                    || cap.max_inline_data > device::MAX_INLINE
                {
                    return err(libc::EINVAL);
                }
                if self.qps.len() >= device::MAX_QP as usize {
                    return err(libc::ENOMEM);
                }
                let xrc = matches!(qp_type, IBV_QPT_XRC_SEND | IBV_QPT_XRC_RECV);
                let cap = Caps {
                    max_send_wr: cap.max_send_wr.max(1),
                    // XRC QPs have no receive queue (XRC SRQs hold their receives).
                    max_recv_wr: if xrc { 0 } else { cap.max_recv_wr.max(1) },
                    max_send_sge: cap.max_send_sge.max(1),
                    max_recv_sge: cap.max_recv_sge.max(1),
                    max_inline_data: device::MAX_INLINE,
                };
                let qpn = self.next_qpn;
                self.next_qpn = psn_add(self.next_qpn, 1).max(0x11);
                self.qps.insert(
                    qpn,
                    Qp {
                        conn,
                        pid,
                        pd,
                        send_cq,
                        recv_cq,
                        srq,
                        xrcd,
                        qpt: qp_type,
                        sq_sig_all,
                        cap,
                        attr: QpAttrs::default(),
                        state: IBV_QPS_RESET,
                        remote: None,
                        mtu: 1024,
                        req: Requester::new(now),
                        resp: Responder::new(now),
                        rings: None,
                        user: 0,
                        comm_est: false,
                        pacer: None,
                        cc: Default::default(),
                        openers: Vec::new(),
                    },
                );
                self.rr.push_back(qpn);
                self.tombstones.remove(&qpn);
                Resp::Qp { qpn, cap }
            }
            Req::ModifyQp { qpn, mask, attr } => {
                if !self.qps.get(&qpn).is_some_and(|q| q.held_by(conn)) {
                    return err(libc::EINVAL);
                }
                let r = match self.modify_qp(qpn, mask, &attr, now) {
                    Ok(()) => Resp::Unit,
                    Err(e) => err(e),
                };
                self.sync_done(qpn);
                r
            }
            Req::QueryQp { qpn } => match self.qps.get(&qpn) {
                Some(q) if q.held_by(conn) => {
                    let mut a = q.attr;
                    a.qp_state = q.state;
                    a.cur_qp_state = q.state;
                    Resp::QpAttr {
                        attr: a,
                        cap: q.cap,
                        qp_type: q.qpt,
                        sq_sig_all: q.sq_sig_all,
                    }
                }
                _ => err(libc::EINVAL),
            },
            Req::DestroyQp { qpn } => {
                if !self.qps.get(&qpn).is_some_and(|q| q.held_by(conn)) {
                    return err(libc::EINVAL);
                }
                if self.release_qp(conn, qpn) {
                    self.remove_qp(qpn, now);
                }
                self.forget_events(conn, Obj::Qp(qpn))
            }
            Req::PostSend { qpn, wrs } => self.post_send(conn, qpn, wrs),
            Req::PostRecv { qpn, wrs } => self.post_recv(conn, qpn, wrs),
            Req::CreateSrq {
                pd,
                max_wr,
                max_sge,
                xrcd,
                cq,
            } => {
                if (xrcd != 0 || cq != 0)
                    && (!self.xrcd_opened_by(xrcd, conn)
                        || self.cqs.get(&cq).map(|c| c.conn) != Some(conn))
                {
                    return err(libc::EINVAL);
                }
                self.create_srq(conn, pid, pd, (max_wr, max_sge), (xrcd, cq))
            }
            Req::ModifySrq {
                srq,
                mask,
                max_wr,
                srq_limit,
            } => self.modify_srq(conn, srq, mask, max_wr, srq_limit),
            Req::QuerySrq { srq } => match self.srqs.get(&srq) {
                Some(s) if s.conn == conn => Resp::Srq {
                    handle: srq,
                    max_wr: s.max_wr,
                    max_sge: s.max_sge,
                    srq_limit: s.limit,
                },
                _ => err(libc::EINVAL),
            },
            Req::DestroySrq { srq } => {
                if self.srqs.get(&srq).map(|s| s.conn) != Some(conn) {
                    return err(libc::EINVAL);
                }
                if self.qps.values().any(|q| q.srq == srq) {
                    return err(libc::EBUSY);
                }
                // Receives still queued are dropped with it, as destroying an SRQ does.
                self.srqs.remove(&srq);
                self.forget_events(conn, Obj::Srq(srq))
            }
            Req::PostSrqRecv { srq, wrs } => self.post_srq_recv(conn, srq, wrs),
            Req::OpenXrcd { file, oflags } => self.open_xrcd(conn, file, oflags),
            Req::OpenQp { xrcd, qpn } => self.open_qp(conn, xrcd, qpn),
            Req::AttachMcast { qpn, group } => self.attach_mcast(conn, qpn, group, true),
            Req::CreateFlow { qpn, attr } => self.create_flow(conn, qpn, &attr),
            Req::DestroyFlow { handle } => self.destroy_flow(conn, handle),
            Req::AllocDm { len } => {
                let next = &mut self.next_handle;
                handle_or_err(self.mem.alloc_dm(conn, len, || take_handle(next)))
            }
            Req::RateLimit {
                qpn,
                kbps,
                max_burst,
            } => match self.qps.get_mut(&qpn) {
                Some(q)
                    if q.held_by(conn)
                        && q.state == IBV_QPS_RTS
                        && device::pacing_allowed(q.qpt, kbps)
                        && (kbps != 0 || max_burst == 0) =>
                {
                    q.pacer = (kbps != 0).then(|| nic::Pacer::new(kbps, max_burst));
                    Resp::Unit
                }
                _ => err(libc::EINVAL),
            },
            Req::FreeDm { handle } => unit_or_err(self.mem.free_dm(conn, handle)),
            Req::DetachMcast { qpn, group } => self.attach_mcast(conn, qpn, group, false),
            Req::CloseXrcd { xrcd } => self.close_xrcd(conn, xrcd),
            Req::AttachRing {
                kind,
                handle,
                fd,
                len,
            } => match self.attach_ring(conn, pid, kind, handle, fd, len) {
                Ok(()) => Resp::Unit,
                Err(e) => err(e),
            },
        }
    }
}
