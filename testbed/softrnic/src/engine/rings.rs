//! The shared work-request rings: mapping a QP's rings and taking what the application posted.

use super::*;

impl State {
    /// Map the application's memfd `fd` as the completion ring of a CQ or the work-request
    /// rings of a QP.
    pub(super) fn attach_ring(
        &mut self,
        conn: u64,
        pid: i32,
        kind: u8,
        handle: u32,
        fd: i32,
        len: u64,
    ) -> Result<(), i32> {
        let need = match kind {
            0 => match self.cqs.get(&handle) {
                Some(c) if c.conn == conn && c.ring.is_none() && c.q.is_empty() => {
                    ring::cq_len(c.cap as u32)
                }
                _ => return Err(libc::EINVAL),
            },
            1 => match self.qps.get(&handle) {
                Some(q) if q.conn == conn && q.rings.is_none() && q.state == IBV_QPS_RESET => {
                    QpLayout::new(&q.cap).len
                }
                _ => return Err(libc::EINVAL),
            },
            _ => return Err(libc::EINVAL),
        };
        if len != need as u64 || fd < 0 {
            return Err(libc::EINVAL);
        }
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(format!("/proc/{pid}/fd/{fd}"))
            .map_err(|e| e.raw_os_error().unwrap_or(libc::EBADF))?;
        let size = f.metadata().map_err(|_| libc::EBADF)?.len();
        if size < need as u64 {
            return Err(libc::EINVAL);
        }
        let map =
            Map::new(f.as_raw_fd(), need).map_err(|e| e.raw_os_error().unwrap_or(libc::ENOMEM))?;
        match kind {
            0 => {
                let c = self.cqs.get_mut(&handle).ok_or(libc::EINVAL)?;
                let r = Ring {
                    off: 0,
                    n: c.cap as u32,
                    slot: ring::WC_SIZE,
                };
                c.ring = Some((map, r));
            }
            _ => {
                let q = self.qps.get_mut(&handle).ok_or(libc::EINVAL)?;
                let (sq, rq) = QpLayout::new(&q.cap).rings();
                q.rings = Some(QpRings {
                    map,
                    sq,
                    rq,
                    sq_cons: 0,
                    rq_cons: 0,
                });
            }
        }
        Ok(())
    }

    /// Publish how many work requests of a QP have left the engine (completed or flushed).
    pub(super) fn sync_done(&mut self, qpn: u32) {
        let Some(q) = self.qps.get(&qpn) else { return };
        let Some(r) = &q.rings else { return };
        let sq_done = r.sq_cons.wrapping_sub(q.req.sq.len() as u32);
        let in_rq = q.resp.rq.len() as u32 + q.resp.cur_recv.is_some() as u32;
        let rq_done = r.rq_cons.wrapping_sub(in_rq);
        r.sq.done(&r.map).store(sq_done, Ordering::Release);
        r.rq.done(&r.map).store(rq_done, Ordering::Release);
    }

    /// Take the work requests the application wrote into a QP's send ring. An entry that does
    /// not validate completes with `IBV_WC_LOC_QP_OP_ERR` and moves the QP to the error state.
    pub(super) fn pull_sq(&mut self, qpn: u32) {
        let Some(q) = self.qps.get_mut(&qpn) else {
            return;
        };
        let Some(r) = q.rings.as_mut() else { return };
        let prod = r.sq.prod(&r.map).load(Ordering::Acquire);
        if prod == r.sq_cons {
            return;
        }
        let avail = prod.wrapping_sub(r.sq_cons);
        let max_sge = q.cap.max_send_sge as usize;
        let mut slot = vec![0u8; r.sq.slot];
        let mut accepted = Vec::new();
        let mut bad: Option<u64> = None;
        for _ in 0..avail.min(r.sq.n) {
            r.map.read(r.sq.slot_off(r.sq_cons), &mut slot);
            r.sq_cons = r.sq_cons.wrapping_add(1);
            let h = ring::SqHeader::decode(&slot);
            let (wr_id, opcode, nsge) = (h.wr_id, h.opcode as i32, h.num_sge as usize);
            let inline_cap = r.sq.slot - ring::SQ_SGE_OFF - ring::SGE_LEN * max_sge;
            let inline_ok = h.inline_len == ring::NOT_INLINE || h.inline_len as usize <= inline_cap;
            if nsge > max_sge || !inline_ok {
                bad = Some(wr_id);
                break;
            }
            let sges: Vec<Sge> = (0..nsge)
                .map(|i| ring::get_sge(&slot, ring::SQ_SGE_OFF, i))
                .collect();
            let inline = (h.inline_len != ring::NOT_INLINE).then(|| {
                let o = ring::SQ_SGE_OFF + ring::SGE_LEN * max_sge;
                slot[o..o + h.inline_len as usize].to_vec()
            });
            let len: u64 = match &inline {
                Some(b) => b.len() as u64,
                None => sges.iter().map(|s| s.length as u64).sum(),
            };
            if proto::check_send_wr(q.qpt, opcode, inline.is_some(), len).is_err() {
                bad = Some(wr_id);
                break;
            }
            let flags = h.send_flags;
            let wr = SendWr {
                wr_id,
                opcode,
                flags,
                imm: h.imm_data,
                remote_addr: h.remote_addr,
                rkey: h.rkey,
                compare_add: h.compare_add,
                swap: h.swap,
                sges: if inline.is_some() { Vec::new() } else { sges },
                inline,
                xrc_srqn: h.xrc_srqn,
            };
            accepted.push(SqWqe::new(
                wr,
                len as u32,
                q.sq_sig_all || flags & IBV_SEND_SIGNALED != 0,
                h.doorbell != 0,
            ));
        }
        let in_error = q.state == IBV_QPS_ERR || q.state == IBV_QPS_RESET;
        self.counters.ring_send_wqes += accepted.len() as u64;
        q.req.sq.extend(accepted);
        if let Some(wr_id) = bad {
            let scq = q.send_cq;
            self.push_cqe(
                scq,
                IbvWc {
                    wr_id,
                    status: IBV_WC_LOC_QP_OP_ERR,
                    opcode: IBV_WC_SEND,
                    qp_num: qpn,
                    ..Default::default()
                },
            );
            self.qp_error(qpn, IBV_EVENT_QP_FATAL);
        } else if in_error {
            self.flush_qp(qpn);
        }
        self.sync_done(qpn);
    }

    /// Take the receive requests the application wrote into a QP's receive ring.
    pub(super) fn pull_rq(&mut self, qpn: u32) {
        let Some(q) = self.qps.get_mut(&qpn) else {
            return;
        };
        let Some(r) = q.rings.as_mut() else { return };
        let prod = r.rq.prod(&r.map).load(Ordering::Acquire);
        if prod == r.rq_cons {
            return;
        }
        let avail = prod.wrapping_sub(r.rq_cons);
        let max_sge = q.cap.max_recv_sge as usize;
        let mut slot = vec![0u8; r.rq.slot];
        let mut bad = None;
        for _ in 0..avail.min(r.rq.n) {
            r.map.read(r.rq.slot_off(r.rq_cons), &mut slot);
            r.rq_cons = r.rq_cons.wrapping_add(1);
            let h = ring::RqHeader::decode(&slot);
            let (wr_id, nsge) = (h.wr_id, h.num_sge as usize);
            if nsge > max_sge {
                bad = Some(wr_id);
                break;
            }
            let sges = (0..nsge)
                .map(|i| ring::get_sge(&slot, ring::RQ_SGE_OFF, i))
                .collect();
            q.resp.rq.push_back(RecvWr { wr_id, sges });
            self.counters.ring_recv_wqes += 1;
        }
        let in_error = q.state == IBV_QPS_ERR;
        if let Some(wr_id) = bad {
            let rcq = q.recv_cq;
            self.push_cqe(
                rcq,
                IbvWc {
                    wr_id,
                    status: IBV_WC_LOC_QP_OP_ERR,
                    opcode: IBV_WC_RECV,
                    qp_num: qpn,
                    ..Default::default()
                },
            );
            self.qp_error(qpn, IBV_EVENT_QP_FATAL);
        } else if in_error {
            self.flush_qp(qpn);
        }
        self.sync_done(qpn);
    }
}
