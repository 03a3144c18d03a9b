//! Packets from the wire: dispatch to the requester or the responder, and the responder's execution of SEND, WRITE, READ and atomics for RC, UC and UD.

use super::placement::{PlacementFault, Run};
use super::transport::responder::{Arrival, ReadJob, UcArrival};
use super::*;

/// The 40-byte GRH area of a UD receive for RoCE v2 over IPv4: as on hardware, the first 20
/// bytes are unused and the last 20 hold the IPv4 header of the datagram (version 4, TTL 64,
/// protocol UDP, source and destination, header checksum), which is what
/// `ibv_init_ah_from_wc` parses.
pub(super) fn grh_ipv4(src: Ipv4Addr, dst: Ipv4Addr, payload_len: u32) -> [u8; GRH_LEN] {
    let mut g = [0u8; GRH_LEN];
    let h = &mut g[20..];
    // IPv4 + UDP + BTH + DETH + payload + ICRC, as the datagram would be on the wire.
    let total = (20 + 8 + 12 + 8 + 4 + payload_len).min(u16::MAX as u32) as u16;
    h[0] = 0x45;
    h[2..4].copy_from_slice(&total.to_be_bytes());
    h[6] = 0x40; // don't fragment
    h[8] = 64;
    h[9] = 17;
    h[12..16].copy_from_slice(&src.octets());
    h[16..20].copy_from_slice(&dst.octets());
    let mut sum: u32 = h
        .chunks(2)
        .map(|c| u32::from(u16::from_be_bytes([c[0], c[1]])))
        .sum();
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    h[10..12].copy_from_slice(&(!(sum as u16)).to_be_bytes());
    g
}

/// Whether a wire op is an atomic request.
pub(super) fn is_atomic_op(op: u8) -> bool {
    matches!(op, wire::OP_CMP_SWAP | wire::OP_FETCH_ADD)
}

/// The asynchronous event of an RC responder error that moves the responder's QP to the error
/// state (IBTA class C): an invalid request (e.g. a misaligned atomic, a message larger than
/// the receive) is `IBV_EVENT_QP_REQ_ERR`, an access violation (rkey, bounds, rights)
/// `QP_ACCESS_ERR`, a local failure while executing it `QP_FATAL`.
pub(super) fn responder_error_event(syndrome: u8) -> Option<u32> {
    match syndrome {
        wire::NAK_REM_INVALID => Some(IBV_EVENT_QP_REQ_ERR),
        wire::NAK_REM_ACCESS => Some(IBV_EVENT_QP_ACCESS_ERR),
        wire::NAK_REM_OP => Some(IBV_EVENT_QP_FATAL),
        _ => None,
    }
}

/// Bytes of the GRH in front of every UD receive.
pub(super) const GRH_LEN: usize = 40;

/// A UD receive's `wc.sl` on RoCE, as mlx5 reports it: the CQE's packet type (`flags_rqpn`
/// bits 27:24; PRM: bit 3 the frame had a UDP header, bits 2:0 its L3 header, 0 GRH (RoCE
/// v1), 1 IPv6, 2 IPv4). Every packet here is RoCE v2 over IPv4. UCX reads `sl & 7` to know
/// where in the 40 reserved bytes the destination address is (the last 4 for IPv4, the last
/// 16 for IPv6) and drops datagrams whose address is not its own.
pub(super) const ROCE_V2_IPV4_SL: u8 = 0x8 | 0x2;

impl State {
    pub(super) fn on_packet(&mut self, from: SocketAddr, p: Packet, now: Instant) {
        // Only WRITE, SEND and READ response packets may find data gathered (see
        // `placement`).
        if !matches!(p.op, wire::OP_WRITE | wire::OP_SEND | wire::OP_READ_RESP) {
            self.place_all(now);
        }
        if p.op == wire::OP_UD_SEND && p.dst_qpn == wire::MCAST_QPN {
            return self.mcast_rx(from, &p, now);
        }
        if p.op == wire::OP_RAW {
            return self.raw_rx(&p, now);
        }
        if p.op == wire::OP_PAUSE {
            return self.on_pause(&p, now);
        }
        if p.op == wire::OP_CNP {
            return self.on_cnp(from, &p, now);
        }
        if p.op == wire::OP_AUSS {
            return self.auss_notified(from, &p, now);
        }
        let Some(q) = self.qps.get(&p.dst_qpn) else {
            if !self.tombstone_rx(from, &p, now) {
                self.counters.rx_dropped_unknown_qp += 1;
            }
            return;
        };
        // Raw-packet QPs take frames only through their flow rules (above).
        if q.qpt == IBV_QPT_RAW_PACKET {
            self.counters.rx_dropped_unknown_qp += 1;
            return;
        }
        // UD QPs take datagrams from anyone (the Q_Key decides), and nothing else.
        if q.qpt == IBV_QPT_UD || p.op == wire::OP_UD_SEND {
            if q.qpt == IBV_QPT_UD && p.op == wire::OP_UD_SEND {
                self.touch_qp(p.dst_qpn, now);
                self.ud_rx(from, &p);
            } else {
                self.counters.rx_dropped_unknown_qp += 1;
            }
            return;
        }
        // Only the connected peer may talk to an RC, UC or XRC QP.
        if q.remote != Some(from) || q.attr.dest_qp_num != p.src_qpn {
            self.counters.rx_dropped_unknown_qp += 1;
            return;
        }
        // Requests to an XRC target, and only those, carry the XRC extension; an XRC
        // initiator takes no requests, a target no responses.
        let request = !matches!(
            p.op,
            wire::OP_ACK | wire::OP_NAK | wire::OP_READ_RESP | wire::OP_ATOMIC_RESP
        );
        let misdirected = match q.qpt {
            IBV_QPT_XRC_SEND => request,
            IBV_QPT_XRC_RECV => !request,
            _ => false,
        };
        if misdirected || (p.flags & wire::F_XRC != 0) != (request && q.qpt == IBV_QPT_XRC_RECV) {
            self.counters.rx_dropped_malformed += 1;
            return;
        }
        self.touch_qp(p.dst_qpn, now);
        if p.op == wire::OP_ACK && !p.payload.is_empty() {
            self.auss_stamp_in(from, &p.payload, now);
        }
        let qpn = p.dst_qpn;
        if let Some(q) = self
            .qps
            .get_mut(&qpn)
            .filter(|q| q.state == IBV_QPS_RTR && !q.comm_est)
        {
            // IBTA's Communication Established: the first packet from the peer arrived while
            // the QP is still in RTR.
            q.comm_est = true;
            self.raise_qp(qpn, IBV_EVENT_COMM_EST);
        }
        let uc = self.qps[&qpn].qpt == IBV_QPT_UC;
        match p.op {
            // UC has no acknowledgements or responses: such packets are stale by definition.
            wire::OP_ACK | wire::OP_NAK | wire::OP_READ_RESP | wire::OP_ATOMIC_RESP if uc => {
                self.counters.rx_stale += 1
            }
            wire::OP_ACK | wire::OP_NAK | wire::OP_READ_RESP | wire::OP_ATOMIC_RESP => {
                self.requester_rx(p, now)
            }
            wire::OP_SEND | wire::OP_WRITE if uc => self.uc_rx(p, now),
            _ if uc => self.counters.rx_dropped_malformed += 1,
            _ => self.responder_rx(from, p, now),
        }
        self.sync_done(qpn);
    }

    /// Acknowledge everything up to `psn` of `qpn`'s peer QP `dst` at `to`.
    pub(super) fn ack(&mut self, to: SocketAddr, qpn: u32, dst: u32, psn: u32, now: Instant) {
        self.reply(to, wire::OP_ACK, 0, (qpn, dst, psn), now);
    }

    /// A sequence NAK: `qpn` expects `psn` next from its peer QP `dst` at `to`.
    fn nak_seq(&mut self, to: SocketAddr, qpn: u32, dst: u32, psn: u32, now: Instant) {
        self.reply(to, wire::OP_NAK, wire::NAK_SEQ, (qpn, dst, psn), now);
    }

    /// An ACK or NAK of `qpn` to its peer QP `dst` at `to`, about `psn`.
    fn reply(
        &mut self,
        to: SocketAddr,
        op: u8,
        syndrome: u8,
        (qpn, dst, psn): (u32, u32, u32),
        now: Instant,
    ) {
        // An ACK or NAK tells the peer how far the QP got: its data is in place first.
        self.place_responder_run(qpn, now);
        let stamp = if op == wire::OP_ACK {
            self.auss_stamp_for(to)
        } else {
            None
        };
        let p = Packet {
            op,
            syndrome,
            dst_qpn: dst,
            src_qpn: qpn,
            psn,
            payload: stamp.unwrap_or_default(),
            ..Default::default()
        };
        self.emit(to, p, now);
    }

    pub(super) fn responder_rx(&mut self, from: SocketAddr, p: Packet, now: Instant) {
        let qpn = p.dst_qpn;
        let Some(q) = self.qps.get_mut(&qpn) else {
            return;
        };
        if q.state != IBV_QPS_RTR && q.state != IBV_QPS_RTS {
            return;
        }
        let peer = p.src_qpn;
        match q.resp.arrival(p.psn) {
            Arrival::Duplicate => {
                self.counters.rx_duplicate += 1;
                if p.op == wire::OP_READ_REQ {
                    // Execute it again (reads are idempotent).
                    self.do_read(from, &p, now);
                } else if is_atomic_op(p.op) {
                    // Answer from the result cache, never execute it again.
                    self.replay_atomic(from, &p, now);
                } else {
                    let e = q.resp.last_received();
                    self.ack(from, qpn, peer, e, now);
                }
                return;
            }
            Arrival::Ahead(nak) => {
                if let Some(e) = nak {
                    self.nak_seq(from, qpn, peer, e, now);
                }
                return;
            }
            Arrival::InOrder => {}
        }
        // In order. A request to an XRC target must name an SRQ of the target's domain.
        let status = match p.op {
            _ if !self.xrc_srq_ok(qpn, &p) => Err(wire::NAK_REM_INVALID),
            wire::OP_SEND => self.rx_send(qpn, &p, now),
            wire::OP_WRITE => self.rx_write(qpn, &p, now),
            wire::OP_CMP_SWAP | wire::OP_FETCH_ADD => self.rx_atomic(from, &p, now),
            wire::OP_READ_REQ => {
                if self.do_read(from, &p, now) {
                    let n = p.msg_len.div_ceil(self.qps[&qpn].mtu).max(1);
                    Ok(n)
                } else {
                    Err(wire::NAK_REM_ACCESS)
                }
            }
            _ => return,
        };
        let Some(q) = self.qps.get_mut(&qpn) else {
            return;
        };
        match status {
            Ok(n) => {
                let acked = q.resp.accepted(n);
                // Before its ACK, so that the ACK carries the `N` this packet made.
                self.auss_request(from, &p, now);
                // READ and atomic requests are acknowledged by their responses.
                let answered = p.op == wire::OP_READ_REQ || is_atomic_op(p.op);
                if !answered && p.flags & wire::F_ACKREQ != 0 {
                    self.ack(from, qpn, peer, acked, now);
                }
            }
            Err(syn) => self.responder_nak(from, qpn, p.psn, syn, now),
        }
    }

    /// NAK the request at `psn` with `syn` (an RNR NAK once until the QP makes progress);
    /// after a responder error of class C the responder QP goes to error as well.
    fn responder_nak(&mut self, to: SocketAddr, qpn: u32, psn: u32, syn: u8, now: Instant) {
        self.place_responder_run(qpn, now);
        let Some(q) = self.qps.get_mut(&qpn) else {
            return;
        };
        if q.resp.nak(syn) {
            let n = Packet {
                op: wire::OP_NAK,
                syndrome: syn,
                dst_qpn: q.attr.dest_qp_num,
                src_qpn: qpn,
                psn,
                imm: q.attr.min_rnr_timer as u32,
                ..Default::default()
            };
            self.emit(to, n, now);
        }
        if let Some(ev) = responder_error_event(syn) {
            self.qp_error(qpn, ev);
        }
    }

    /// Place what `run` gathered, counted.
    pub(super) fn place_gathered(&mut self, run: Run) -> Result<(), PlacementFault> {
        if !self.gathered.holds(run) {
            return Ok(());
        }
        self.counters.rx_placements += 1;
        self.gathered.place(run)
    }

    /// Gather `data` for `addr` in `pid` as `run`'s ([`super::placement`]); `nak`: the
    /// packet's PSN and how to NAK its message if placing fails. Err when placing what this
    /// run gathered before (a message that never finished) failed: that fails this packet,
    /// as its own write would have.
    fn stage(
        &mut self,
        run: Run,
        nak: (u32, u8),
        pid: i32,
        addr: u64,
        data: Payload,
        now: Instant,
    ) -> Result<(), PlacementFault> {
        if !self.gathered.continues(run, pid, addr, data.len()) {
            self.place_gathered(run)?;
            if self.gathered.is_full() {
                self.place_oldest_run(now);
            }
        }
        self.gathered.gather(run, nak, pid, addr, data);
        Ok(())
    }

    /// `scatter` through the combiner: `data` to the places `at` ([`pieces`] of a segment
    /// list). Err: the places hold less than `data`, or placing failed.
    pub(super) fn stage_pieces(
        &mut self,
        run: Run,
        nak: (u32, u8),
        pid: i32,
        at: &[(u64, std::ops::Range<usize>)],
        data: &Payload,
        now: Instant,
    ) -> Result<(), ()> {
        if at.last().map_or(0, |(_, r)| r.end) != data.len() {
            return Err(());
        }
        for (addr, r) in at {
            self.stage(run, nak, pid, *addr, data.slice(r.clone()), now)
                .map_err(|_| ())?;
        }
        Ok(())
    }

    /// A SEND packet's payload for the receive its message lands in; at the message's last
    /// packet it is placed. Err: a payload beyond the receive, or placing failed.
    fn stage_send(&mut self, qpn: u32, p: &Packet, now: Instant) -> Result<(), ()> {
        let cur = self.qps[&qpn].resp.cur_recv.as_ref().ok_or(())?;
        let (pid, run) = (cur.pid, Run::responder(qpn));
        let at: Vec<_> = pieces(&cur.segs, p.offset as u64, p.payload.len()).collect();
        let nak = (p.psn, wire::NAK_REM_OP);
        self.stage_pieces(run, nak, pid, &at, &p.payload, now)?;
        if p.flags & wire::F_LAST != 0 {
            self.place_gathered(run).map_err(|_| ())?;
        }
        Ok(())
    }

    /// Place all data gathered so far ([`super::placement`]).
    pub(super) fn place_all(&mut self, now: Instant) {
        while !self.gathered.is_empty() {
            self.place_oldest_run(now);
        }
    }

    fn place_oldest_run(&mut self, now: Instant) {
        self.counters.rx_placements += 1;
        if let Err(f) = self.gathered.place_oldest() {
            self.placement_failed(f, now);
        }
    }

    /// Place what `qpn` gathered as a responder, before anything tells its peer how far the
    /// QP got.
    pub(super) fn place_responder_run(&mut self, qpn: u32, now: Instant) {
        if let Err(f) = self.place_gathered(Run::responder(qpn)) {
            self.placement_failed(f, now);
        }
    }

    /// Gathered data the target refused. Its message is not complete yet, so an RC
    /// responder NAKs the message (and goes to error) as if its packet's own write had
    /// failed, a UC responder drops the rest of the message, and a READ fails with a local
    /// protection error as if its response's own write had failed.
    fn placement_failed(&mut self, f: PlacementFault, now: Instant) {
        let qpn = f.run.qpn;
        if f.run.reading {
            if self.qps.contains_key(&qpn) {
                self.fail_head(qpn, IBV_WC_LOC_PROT_ERR);
            }
            return;
        }
        let Some(q) = self.qps.get_mut(&qpn) else {
            return;
        };
        if q.state != IBV_QPS_RTR && q.state != IBV_QPS_RTS {
            return;
        }
        if q.qpt == IBV_QPT_UC {
            q.resp.uc_break();
            return;
        }
        if let Some(to) = q.remote {
            self.responder_nak(to, qpn, f.psn, f.syndrome, now);
        }
    }

    /// A packet for a UC QP. In order: applied like RC, but never acknowledged. A gap (a lost
    /// packet) drops the rest of its message: packets are discarded until the first packet of
    /// a later message, where the PSN is resynchronised (the receive the broken SEND had taken
    /// serves that next message). Packets from before the expected PSN (duplicates) are
    /// dropped, never applied twice. Errors (no receive, access) drop the message silently,
    /// as UC cannot tell the requester.
    pub(super) fn uc_rx(&mut self, p: Packet, now: Instant) {
        let qpn = p.dst_qpn;
        let Some(q) = self.qps.get_mut(&qpn) else {
            return;
        };
        if q.state != IBV_QPS_RTR && q.state != IBV_QPS_RTS {
            return;
        }
        match q.resp.uc_arrival(p.psn, p.flags & wire::F_FIRST != 0) {
            UcArrival::Duplicate => return self.counters.rx_duplicate += 1,
            UcArrival::Broken => return self.counters.rx_uc_broken += 1,
            UcArrival::Apply => {}
        }
        let status = match p.op {
            wire::OP_SEND => self.rx_send(qpn, &p, now),
            _ => self.rx_write(qpn, &p, now),
        };
        let last = p.flags & wire::F_LAST != 0;
        let Some(q) = self.qps.get_mut(&qpn) else {
            return;
        };
        // UC cannot tell the requester: only errors of the QP itself stop it; other errors
        // drop the rest of the message.
        let qp_error = match status {
            Err(syn @ (wire::NAK_REM_INVALID | wire::NAK_REM_OP)) => responder_error_event(syn),
            _ => None,
        };
        q.resp.uc_applied(p.psn);
        if status.is_err() && qp_error.is_none() {
            q.resp.uc_failed(last);
        }
        if status == Err(wire::NAK_RNR) {
            self.counters.rx_dropped_no_recv += 1;
        }
        if let Some(ev) = qp_error {
            self.qp_error(qpn, ev);
        }
    }

    /// A UD datagram for one of our UD QPs: Q_Key checked, then placed after a 40-byte GRH in
    /// the next receive (byte_len counts the GRH, as on hardware). Without a receive posted
    /// the datagram is lost (UD has no RNR).
    pub(super) fn ud_rx(&mut self, from: SocketAddr, p: &Packet) {
        let my_ip = self.fabric.me;
        self.ud_deliver(p.dst_qpn, from, p, my_ip);
    }

    /// Deliver UD datagram `p` to QP `qpn`; `dst` is the GRH's destination (this host, or the
    /// multicast group).
    pub(super) fn ud_deliver(&mut self, qpn: u32, from: SocketAddr, p: &Packet, dst: Ipv4Addr) {
        let Some(q) = self.qps.get(&qpn) else {
            return;
        };
        if q.state != IBV_QPS_RTR && q.state != IBV_QPS_RTS {
            self.counters.rx_dropped_unknown_qp += 1;
            return;
        }
        let whole = p.flags & (wire::F_FIRST | wire::F_LAST) == wire::F_FIRST | wire::F_LAST;
        if !whole || p.payload.len() != p.msg_len as usize {
            self.counters.rx_dropped_malformed += 1;
            return;
        }
        if p.rkey != q.attr.qkey {
            self.counters.rx_dropped_qkey += 1;
            return;
        }
        let Some(Landing {
            wr: r,
            conn,
            pid,
            pd,
            cq: rcq,
        }) = self.take_recv(qpn, p)
        else {
            self.counters.rx_dropped_no_recv += 1;
            return;
        };
        let mut wc = IbvWc {
            wr_id: r.wr_id,
            status: IBV_WC_SUCCESS,
            opcode: IBV_WC_RECV,
            byte_len: GRH_LEN as u32 + p.msg_len,
            qp_num: qpn,
            src_qp: p.src_qpn,
            wc_flags: IBV_WC_GRH,
            sl: ROCE_V2_IPV4_SL,
            ..Default::default()
        };
        if p.flags & wire::F_IMM != 0 {
            wc.wc_flags |= IBV_WC_WITH_IMM;
            wc.imm_data = p.imm;
        }
        let total: u64 = r.sges.iter().map(|s| s.length as u64).sum();
        match self.mem.resolve_local(conn, pd, &r.sges, true) {
            None => wc.status = IBV_WC_LOC_PROT_ERR,
            Some(_) if total < GRH_LEN as u64 + p.msg_len as u64 => wc.status = IBV_WC_LOC_LEN_ERR,
            Some(segs) => {
                let src = match from {
                    SocketAddr::V4(a) => *a.ip(),
                    SocketAddr::V6(_) => Ipv4Addr::UNSPECIFIED,
                };
                let grh = grh_ipv4(src, dst, p.msg_len);
                if scatter(pid, &segs, 0, &grh).is_err()
                    || scatter(pid, &segs, GRH_LEN as u64, &p.payload).is_err()
                {
                    wc.status = IBV_WC_LOC_PROT_ERR;
                }
            }
        }
        if wc.status != IBV_WC_SUCCESS {
            wc.byte_len = 0;
            wc.wc_flags = 0;
            wc.sl = 0;
        }
        self.push_cqe_solicited(rcq, wc, p.flags & wire::F_SOLICITED != 0);
    }

    /// SEND packet in order. Ok(psns consumed) or Err(NAK syndrome).
    pub(super) fn rx_send(&mut self, qpn: u32, p: &Packet, now: Instant) -> Result<u32, u8> {
        let first = p.flags & wire::F_FIRST != 0;
        let unfinished = first
            && self
                .qps
                .get(&qpn)
                .is_some_and(|q| q.resp.cur_recv.is_some());
        if unfinished {
            // The previous message never finished (UC: its rest was lost): its receive
            // serves this one, as the receive queue's head on hardware would.
            let q = self.qps.get_mut(&qpn).ok_or(wire::NAK_REM_OP)?;
            let total: u64 = q
                .resp
                .cur_recv
                .iter()
                .flat_map(|c| &c.segs)
                .map(|s| s.1)
                .sum();
            if p.msg_len as u64 > total {
                let (wr_id, rcq) = q.resp.cur_recv.take().map_or((0, 0), |c| (c.wr_id, c.cq));
                let wc = IbvWc {
                    wr_id,
                    status: IBV_WC_LOC_LEN_ERR,
                    opcode: IBV_WC_RECV,
                    qp_num: qpn,
                    ..Default::default()
                };
                self.push_cqe(rcq, wc);
                return Err(wire::NAK_REM_INVALID);
            }
        } else if p.flags & wire::F_FIRST != 0 {
            let Some(Landing {
                wr: r,
                conn,
                pid,
                pd,
                cq: rcq,
            }) = self.take_recv(qpn, p)
            else {
                return Err(wire::NAK_RNR);
            };
            let total: u64 = r.sges.iter().map(|s| s.length as u64).sum();
            let segs = self.mem.resolve_local(conn, pd, &r.sges, true);
            let bad = match segs {
                None => Some((IBV_WC_LOC_PROT_ERR, wire::NAK_REM_OP)),
                Some(_) if (p.msg_len as u64) > total => {
                    Some((IBV_WC_LOC_LEN_ERR, wire::NAK_REM_INVALID))
                }
                _ => None,
            };
            if let Some((st, syn)) = bad {
                self.push_cqe(
                    rcq,
                    IbvWc {
                        wr_id: r.wr_id,
                        status: st,
                        opcode: IBV_WC_RECV,
                        qp_num: qpn,
                        ..Default::default()
                    },
                );
                return Err(syn);
            }
            let q = self.qps.get_mut(&qpn).ok_or(wire::NAK_REM_OP)?;
            q.resp.cur_recv = Some(CurRecv {
                wr_id: r.wr_id,
                segs: segs.unwrap_or_default(),
                pid,
                cq: rcq,
            });
        }
        if self.qps.get(&qpn).is_none_or(|q| q.resp.cur_recv.is_none()) {
            return Err(wire::NAK_REM_INVALID);
        }
        if self.stage_send(qpn, p, now).is_err() {
            return Err(wire::NAK_REM_OP);
        }
        let q = self.qps.get_mut(&qpn).ok_or(wire::NAK_REM_OP)?;
        if p.flags & wire::F_LAST != 0 {
            let cur = q.resp.cur_recv.take().unwrap();
            let (rcq, conn, pd) = (cur.cq, q.conn, q.pd);
            let mut wc = IbvWc {
                wr_id: cur.wr_id,
                status: IBV_WC_SUCCESS,
                opcode: IBV_WC_RECV,
                byte_len: p.msg_len,
                qp_num: qpn,
                src_qp: p.src_qpn,
                ..Default::default()
            };
            if p.flags & wire::F_IMM != 0 {
                wc.wc_flags |= IBV_WC_WITH_IMM;
                wc.imm_data = p.imm;
            } else if p.flags & wire::F_INV != 0 {
                // SEND with invalidate: a type 2 window bound to this QP, else an invalid
                // request (the receive completes in error, both QPs go to error).
                if !self.mem.invalidate_mw(conn, pd, qpn, p.imm) {
                    wc.status = IBV_WC_REM_INV_REQ_ERR;
                    wc.byte_len = 0;
                    self.push_cqe(rcq, wc);
                    return Err(wire::NAK_REM_INVALID);
                }
                wc.wc_flags |= IBV_WC_WITH_INV;
                // `invalidated_rkey` shares the union with `imm_data`.
                wc.imm_data = p.imm;
            }
            self.push_cqe_solicited(rcq, wc, p.flags & wire::F_SOLICITED != 0);
        }
        Ok(1)
    }

    pub(super) fn rx_write(&mut self, qpn: u32, p: &Packet, now: Instant) -> Result<u32, u8> {
        let q = self.qps.get(&qpn).ok_or(wire::NAK_REM_OP)?;
        if q.attr.access_flags & IBV_ACCESS_REMOTE_WRITE == 0 {
            return Err(wire::NAK_REM_ACCESS);
        }
        let pd = self.responder_pd(qpn, p).ok_or(wire::NAK_REM_INVALID)?;
        // A zero-length RDMA WRITE touches no memory: the InfiniBand spec has the responder
        // skip its R_Key and address checks, and rsockets sends its control messages as
        // zero-length WRITE_WITH_IMMs whose R_Key and address are left uninitialised.
        if p.msg_len != 0
            && p.flags & wire::F_FIRST != 0
            && self
                .mem
                .check_remote(
                    qpn,
                    pd,
                    p.rkey,
                    p.remote_addr,
                    p.msg_len as u64,
                    IBV_ACCESS_REMOTE_WRITE,
                )
                .is_none()
        {
            return Err(wire::NAK_REM_ACCESS);
        }
        let target = if p.payload.is_empty() {
            None
        } else {
            let addr = p
                .remote_addr
                .checked_add(p.offset as u64)
                .ok_or(wire::NAK_REM_ACCESS)?;
            let t = self.mem.check_remote(
                qpn,
                pd,
                p.rkey,
                addr,
                p.payload.len() as u64,
                IBV_ACCESS_REMOTE_WRITE,
            );
            Some(t.ok_or(wire::NAK_REM_ACCESS)?)
        };
        let imm_last = p.flags & wire::F_IMM != 0 && p.flags & wire::F_LAST != 0;
        if imm_last && !self.has_recv(qpn, p) {
            return Err(wire::NAK_RNR);
        }
        if let Some((pid, addr)) = target {
            let (run, nak) = (Run::responder(qpn), (p.psn, wire::NAK_REM_ACCESS));
            if self
                .stage(run, nak, pid, addr, p.payload.clone(), now)
                .is_err()
            {
                return Err(wire::NAK_REM_ACCESS);
            }
            // A message is placed whole before its completion and ACK (and a failure is
            // this message's).
            if p.flags & wire::F_LAST != 0 && self.place_gathered(run).is_err() {
                return Err(wire::NAK_REM_ACCESS);
            }
        }
        if imm_last {
            let l = self.take_recv(qpn, p).ok_or(wire::NAK_RNR)?;
            self.push_cqe_solicited(
                l.cq,
                IbvWc {
                    wr_id: l.wr.wr_id,
                    status: IBV_WC_SUCCESS,
                    opcode: IBV_WC_RECV_RDMA_WITH_IMM,
                    byte_len: p.msg_len,
                    imm_data: p.imm,
                    wc_flags: IBV_WC_WITH_IMM,
                    qp_num: qpn,
                    src_qp: p.src_qpn,
                    ..Default::default()
                },
                p.flags & wire::F_SOLICITED != 0,
            );
        }
        Ok(1)
    }

    /// Execute an in-order atomic request and answer it with the original value. Every atomic
    /// of this host's NICs runs under the engine's one state lock, so atomics from any number
    /// of requesters on one target are serialised (atomicity `IBV_ATOMIC_HCA`: against other
    /// atomics through this NIC, not against the target process's own CPU stores).
    pub(super) fn rx_atomic(
        &mut self,
        from: SocketAddr,
        p: &Packet,
        now: Instant,
    ) -> Result<u32, u8> {
        let qpn = p.dst_qpn;
        let q = self.qps.get(&qpn).ok_or(wire::NAK_REM_OP)?;
        if q.attr.access_flags & IBV_ACCESS_REMOTE_ATOMIC == 0 {
            return Err(wire::NAK_REM_ACCESS);
        }
        // The target must be a naturally aligned 8-byte word (IBTA o9-19: otherwise an
        // invalid request).
        if p.payload.len() != 16 || p.remote_addr % 8 != 0 {
            return Err(wire::NAK_REM_INVALID);
        }
        let pd = self.responder_pd(qpn, p).ok_or(wire::NAK_REM_INVALID)?;
        let (pid, target) = self
            .mem
            .check_remote(qpn, pd, p.rkey, p.remote_addr, 8, IBV_ACCESS_REMOTE_ATOMIC)
            .ok_or(wire::NAK_REM_ACCESS)?;
        let operand = u64::from_le_bytes(p.payload[..8].try_into().unwrap());
        let swap = u64::from_le_bytes(p.payload[8..].try_into().unwrap());
        let mut word = [0u8; 8];
        read_mem(pid, target, &mut word).map_err(|_| wire::NAK_REM_ACCESS)?;
        // The target word is in the target host's byte order (as rxe and siw do).
        let orig = u64::from_ne_bytes(word);
        let new = match p.op {
            wire::OP_CMP_SWAP => (orig == operand).then_some(swap),
            _ => Some(orig.wrapping_add(operand)),
        };
        if let Some(v) = new {
            write_mem(pid, target, &v.to_ne_bytes()).map_err(|_| wire::NAK_REM_ACCESS)?;
        }
        let q = self.qps.get_mut(&qpn).ok_or(wire::NAK_REM_OP)?;
        q.resp.executed_atomic(p.psn, orig);
        self.atomic_resp(from, qpn, p.src_qpn, p.psn, orig, now);
        Ok(1)
    }

    /// A duplicate atomic request: resend the cached response. One no longer cached is
    /// dropped: its requester cannot still be waiting for it (see [`ATOMIC_CACHE`]), so this
    /// is a late copy or a replay.
    pub(super) fn replay_atomic(&mut self, from: SocketAddr, p: &Packet, now: Instant) {
        let Some(q) = self.qps.get(&p.dst_qpn) else {
            return;
        };
        if let Some(orig) = q.resp.executed_value(p.psn) {
            self.atomic_resp(from, p.dst_qpn, p.src_qpn, p.psn, orig, now);
        }
    }

    pub(super) fn atomic_resp(
        &mut self,
        to: SocketAddr,
        qpn: u32,
        dst: u32,
        psn: u32,
        orig: u64,
        now: Instant,
    ) {
        self.place_responder_run(qpn, now);
        let r = Packet {
            op: wire::OP_ATOMIC_RESP,
            flags: wire::F_FIRST | wire::F_LAST,
            dst_qpn: dst,
            src_qpn: qpn,
            psn,
            msg_len: 8,
            payload: orig.to_le_bytes().to_vec().into(),
            ..Default::default()
        };
        self.emit(to, r, now);
    }

    /// Execute a read request: send the response packets. false if access is refused.
    pub(super) fn do_read(&mut self, to: SocketAddr, p: &Packet, now: Instant) -> bool {
        let qpn = p.dst_qpn;
        let Some(q) = self.qps.get(&qpn) else {
            return false;
        };
        if q.attr.access_flags & IBV_ACCESS_REMOTE_READ == 0 {
            return false;
        }
        let mtu = q.mtu;
        let Some(pd) = self.responder_pd(qpn, p) else {
            return false;
        };
        let len = p.msg_len as u64;
        let (pid, base) = if len == 0 {
            (0, 0)
        } else {
            match self.mem.check_remote(
                p.dst_qpn,
                pd,
                p.rkey,
                p.remote_addr,
                len,
                IBV_ACCESS_REMOTE_READ,
            ) {
                Some(target) => target,
                None => return false,
            }
        };
        let Some(q) = self.qps.get_mut(&qpn) else {
            return false;
        };
        q.resp
            .queue_read(ReadJob::new(to, p, mtu, (pid, base)), now);
        true
    }

    /// The next response packet of the oldest READ QP `qpn` answers. Memory is read as
    /// the packet goes out; memory gone meanwhile (deregistered, the process ended) ends
    /// the READ with a remote access NAK.
    pub(super) fn next_read_response(
        &mut self,
        qpn: u32,
        now: Instant,
    ) -> Option<(SocketAddr, Packet)> {
        let q = self.qps.get_mut(&qpn)?;
        if q.state != IBV_QPS_RTR && q.state != IBV_QPS_RTS {
            q.resp.read_jobs.clear();
            return None;
        }
        let (pid, addr, len) = q.resp.next_read()?;
        let mut payload = vec![0u8; len as usize];
        let readable = len == 0 || read_mem(pid, addr, &mut payload).is_ok();
        q.resp.read_response(qpn, readable.then_some(payload), now)
    }
}
