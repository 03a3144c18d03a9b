//! The QP state machine: transitions with their attribute checks, and the error state.

use super::*;

/// Required and optional attribute masks of an RC QP's transition (IBTA).
pub(super) fn rc_masks(cur: i32, new: i32) -> Option<(i32, i32)> {
    Some(match (cur, new) {
        (_, IBV_QPS_RESET) | (_, IBV_QPS_ERR) => (0, 0),
        (IBV_QPS_RESET, IBV_QPS_INIT) => (IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS, 0),
        (IBV_QPS_INIT, IBV_QPS_INIT) => (0, IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS),
        (IBV_QPS_INIT, IBV_QPS_RTR) => (
            IBV_QP_AV
                | IBV_QP_PATH_MTU
                | IBV_QP_DEST_QPN
                | IBV_QP_RQ_PSN
                | IBV_QP_MAX_DEST_RD_ATOMIC
                | IBV_QP_MIN_RNR_TIMER,
            IBV_QP_PKEY_INDEX | IBV_QP_ACCESS_FLAGS,
        ),
        (IBV_QPS_RTR, IBV_QPS_RTS) => (
            IBV_QP_SQ_PSN
                | IBV_QP_TIMEOUT
                | IBV_QP_RETRY_CNT
                | IBV_QP_RNR_RETRY
                | IBV_QP_MAX_QP_RD_ATOMIC,
            IBV_QP_ACCESS_FLAGS | IBV_QP_MIN_RNR_TIMER,
        ),
        (IBV_QPS_RTS, IBV_QPS_RTS) => (0, IBV_QP_ACCESS_FLAGS | IBV_QP_MIN_RNR_TIMER),
        _ => return None,
    })
}

/// Required and optional attribute masks of a UC QP's transition (IBTA: no acknowledgement,
/// hence no timeout, retry, RNR or RDMA READ/atomic attributes).
pub(super) fn uc_masks(cur: i32, new: i32) -> Option<(i32, i32)> {
    Some(match (cur, new) {
        (_, IBV_QPS_RESET) | (_, IBV_QPS_ERR) => (0, 0),
        (IBV_QPS_RESET, IBV_QPS_INIT) => (IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS, 0),
        (IBV_QPS_INIT, IBV_QPS_INIT) => (0, IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS),
        (IBV_QPS_INIT, IBV_QPS_RTR) => (
            IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN,
            IBV_QP_PKEY_INDEX | IBV_QP_ACCESS_FLAGS,
        ),
        (IBV_QPS_RTR, IBV_QPS_RTS) => (IBV_QP_SQ_PSN, IBV_QP_ACCESS_FLAGS),
        (IBV_QPS_RTS, IBV_QPS_RTS) => (0, IBV_QP_ACCESS_FLAGS),
        _ => return None,
    })
}

/// Required and optional attribute masks of a UD QP's transition (IBTA: a Q_Key instead of
/// access flags; no address, MTU or remote QPN — every send names its destination).
pub(super) fn ud_masks(cur: i32, new: i32) -> Option<(i32, i32)> {
    Some(match (cur, new) {
        (_, IBV_QPS_RESET) | (_, IBV_QPS_ERR) => (0, 0),
        (IBV_QPS_RESET, IBV_QPS_INIT) => (IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_QKEY, 0),
        (IBV_QPS_INIT, IBV_QPS_INIT) => (0, IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_QKEY),
        (IBV_QPS_INIT, IBV_QPS_RTR) => (0, IBV_QP_PKEY_INDEX | IBV_QP_QKEY),
        (IBV_QPS_RTR, IBV_QPS_RTS) => (IBV_QP_SQ_PSN, IBV_QP_QKEY),
        (IBV_QPS_RTS, IBV_QPS_RTS) => (0, IBV_QP_QKEY),
        _ => return None,
    })
}

impl State {
    pub(super) fn modify_qp(
        &mut self,
        qpn: u32,
        mask: i32,
        a: &QpAttrs,
        now: Instant,
    ) -> Result<(), i32> {
        let nic_mtu = self.nic.cfg.mtu;
        let q = self.qps.get_mut(&qpn).ok_or(libc::EINVAL)?;
        let cur = q.state;
        if mask & IBV_QP_CUR_STATE != 0 && a.cur_qp_state != cur {
            return Err(libc::EINVAL);
        }
        let new = if mask & IBV_QP_STATE != 0 {
            a.qp_state
        } else {
            cur
        };
        let has = |m: i32| mask & m == m;
        let (required, optional) = match q.qpt {
            IBV_QPT_RC => rc_masks(cur, new),
            IBV_QPT_XRC_SEND | IBV_QPT_XRC_RECV => xrc::masks(q.qpt, cur, new),
            IBV_QPT_UC => uc_masks(cur, new),
            IBV_QPT_RAW_PACKET => raw::raw_masks(cur, new),
            _ => ud_masks(cur, new),
        }
        .ok_or(libc::EINVAL)?;
        if !has(required) {
            return Err(libc::EINVAL);
        }
        // Packet pacing is set on the way to RTS and in RTS, as mlx5 takes it.
        let pacing = if new == IBV_QPS_RTS && matches!(cur, IBV_QPS_RTR | IBV_QPS_RTS) {
            IBV_QP_RATE_LIMIT
        } else {
            0
        };
        let allowed = required | optional | pacing | IBV_QP_STATE | IBV_QP_CUR_STATE;
        if new != IBV_QPS_RESET && new != IBV_QPS_ERR && mask & !allowed != 0 {
            return Err(libc::EINVAL);
        }
        // Validate before applying anything.
        if has(IBV_QP_PORT) && a.port_num != 1 {
            return Err(libc::EINVAL);
        }
        if has(IBV_QP_PKEY_INDEX) && a.pkey_index != 0 {
            return Err(libc::EINVAL);
        }
        if has(IBV_QP_RATE_LIMIT) && !device::pacing_allowed(q.qpt, a.rate_limit) {
            return Err(libc::EINVAL);
        }
        let mut mtu = q.mtu;
        if has(IBV_QP_PATH_MTU) {
            mtu = match mtu_bytes(a.path_mtu) {
                // The path MTU is bounded by the port's (the NIC model's) MTU.
                Some(m) => m.min(nic_mtu),
                None => return Err(libc::EINVAL),
            };
        }
        let mut remote = q.remote;
        if has(IBV_QP_AV) {
            // RoCE-style port: a GRH with an IPv4-mapped destination GID is required.
            if a.is_global == 0 || a.sgid_index != 0 {
                return Err(libc::EINVAL);
            }
            let ip = device::ip_of_gid(&a.dgid).ok_or(libc::EINVAL)?;
            remote = Some(SocketAddr::V4(SocketAddrV4::new(
                ip,
                device::ENGINE_UDP_PORT,
            )));
        }
        if has(IBV_QP_MAX_QP_RD_ATOMIC) && a.max_rd_atomic as u32 > device::MAX_RD_ATOM {
            return Err(libc::EINVAL);
        }
        if has(IBV_QP_MAX_DEST_RD_ATOMIC) && a.max_dest_rd_atomic as u32 > device::MAX_RD_ATOM {
            return Err(libc::EINVAL);
        }
        // Apply.
        q.mtu = mtu;
        q.remote = remote;
        let t = &mut q.attr;
        if has(IBV_QP_ACCESS_FLAGS) {
            t.access_flags = a.access_flags;
        }
        if has(IBV_QP_PKEY_INDEX) {
            t.pkey_index = a.pkey_index;
        }
        if has(IBV_QP_QKEY) {
            t.qkey = a.qkey;
        }
        if has(IBV_QP_PORT) {
            t.port_num = a.port_num;
        }
        if has(IBV_QP_PATH_MTU) {
            t.path_mtu = a.path_mtu;
        }
        if has(IBV_QP_AV) {
            t.dgid = a.dgid;
            t.sgid_index = a.sgid_index;
            t.hop_limit = a.hop_limit;
            t.is_global = a.is_global;
            t.dlid = a.dlid;
            t.sl = a.sl;
            t.ah_port_num = a.ah_port_num;
        }
        if has(IBV_QP_DEST_QPN) {
            t.dest_qp_num = a.dest_qp_num & wire::PSN_MASK;
        }
        if has(IBV_QP_RQ_PSN) {
            t.rq_psn = a.rq_psn & wire::PSN_MASK;
            q.resp.epsn = t.rq_psn;
        }
        if has(IBV_QP_SQ_PSN) {
            t.sq_psn = a.sq_psn & wire::PSN_MASK;
            q.req.next_psn = t.sq_psn;
        }
        if has(IBV_QP_MAX_DEST_RD_ATOMIC) {
            t.max_dest_rd_atomic = a.max_dest_rd_atomic;
        }
        if has(IBV_QP_MAX_QP_RD_ATOMIC) {
            t.max_rd_atomic = a.max_rd_atomic;
        }
        if has(IBV_QP_MIN_RNR_TIMER) {
            t.min_rnr_timer = a.min_rnr_timer;
        }
        if has(IBV_QP_TIMEOUT) {
            t.timeout = a.timeout;
        }
        if has(IBV_QP_RETRY_CNT) {
            t.retry_cnt = a.retry_cnt;
        }
        if has(IBV_QP_RNR_RETRY) {
            t.rnr_retry = a.rnr_retry;
        }
        if has(IBV_QP_RATE_LIMIT) {
            t.rate_limit = a.rate_limit;
            q.pacer = (a.rate_limit != 0).then(|| nic::Pacer::new(a.rate_limit, 0));
        }
        q.state = new;
        match new {
            IBV_QPS_RESET => {
                q.req.clear();
                q.resp.clear();
                q.comm_est = false;
                q.remote = None;
                q.attr = QpAttrs::default();
                q.pacer = None;
                // Work requests still in the rings are discarded too (as a reset does).
                if let Some(r) = q.rings.as_mut() {
                    r.sq_cons = r.sq.prod(&r.map).load(Ordering::Acquire);
                    r.rq_cons = r.rq.prod(&r.map).load(Ordering::Acquire);
                }
            }
            IBV_QPS_ERR => {
                self.flush_qp(qpn);
                // Whatever the application had posted is flushed too.
                self.pull_sq(qpn);
                self.pull_rq(qpn);
                // flush_qp saw the state already set: the transition's event is raised here.
                if cur != IBV_QPS_ERR {
                    self.last_wqe_reached(qpn);
                }
            }
            IBV_QPS_RTS if cur == IBV_QPS_RTR => q.req.last_progress = now,
            _ => {}
        }
        Ok(())
    }

    /// Move a QP to the error state and complete everything outstanding with WR_FLUSH_ERR.
    pub(super) fn flush_qp(&mut self, qpn: u32) {
        let Some(q) = self.qps.get_mut(&qpn) else {
            return;
        };
        let entering = q.state != IBV_QPS_ERR;
        q.state = IBV_QPS_ERR;
        let (scq, rcq) = (q.send_cq, q.recv_cq);
        let sent = q.req.flush(qpn);
        let received = q.resp.flush(qpn, rcq);
        for wc in sent {
            self.push_cqe(scq, wc);
        }
        for (cq, wc) in received {
            self.push_cqe(cq, wc);
        }
        if entering {
            self.last_wqe_reached(qpn);
        }
    }

    /// A QP with an SRQ entered the error state: it will take no more receives from the SRQ
    /// (IBTA's Last WQE Reached; the application may now destroy it safely).
    pub(super) fn last_wqe_reached(&mut self, qpn: u32) {
        if self.qps.get(&qpn).is_some_and(|q| q.srq != 0) {
            self.raise_qp(qpn, IBV_EVENT_QP_LAST_WQE_REACHED);
        }
    }

    /// The engine moves a QP to the error state on its own (not a completion error of one
    /// request): tell the application with an asynchronous event, as a NIC does.
    pub(super) fn qp_error(&mut self, qpn: u32, event_type: u32) {
        self.raise_qp(qpn, event_type);
        self.flush_qp(qpn);
    }

    /// Complete the head send WQE with an error and move the QP to the error state.
    pub(super) fn fail_head(&mut self, qpn: u32, status: i32) {
        let Some(q) = self.qps.get_mut(&qpn) else {
            return;
        };
        let scq = q.send_cq;
        if let Some(wc) = q.req.fail_at(0, qpn, status) {
            self.push_cqe(scq, wc);
        }
        self.flush_qp(qpn);
    }
}
