//! The requester's driver: fetching and building packets from a QP's send queue (its
//! buffers resolved and read from the process, the NIC charged), completing work requests
//! on acknowledgements and responses, and the retransmission and RNR timers. The state and
//! the rules are the QP's [`Requester`] (`transport::requester`).

use super::placement::Run;
use super::transport::requester::{rnr_delay, Built, Next, Route, Timer};
use super::*;

impl State {
    /// The NIC's fetch unit reads work request `idx` of a QP's send queue unless it already
    /// did ([`Requester::fetch`]), costing `wqe_fetch_ns` each, charged at once so that no
    /// other QP's packet starts before the whole read is done.
    pub(super) fn fetch_wqes(&mut self, qpn: u32, idx: usize, now: Instant) {
        let Some(q) = self.qps.get_mut(&qpn) else {
            return;
        };
        let Some((n, bytes)) = q.req.fetch(idx, self.nic.cfg.wqe_fetch_batch) else {
            return;
        };
        let p = self.proc_tx.entry(q.pid).or_default();
        (p.0, p.1) = (p.0 + u64::from(n), p.1 + bytes);
        self.counters.wqe_fetches += u64::from(n);
        self.counters.wqe_fetch_reads += 1;
        let ns = self.nic.cfg.wqe_fetch_ns.saturating_mul(u64::from(n));
        self.nic.charge(now, ns);
    }

    /// Next packet of a QP (retransmission first, then new data), or None.
    pub(super) fn next_packet(&mut self, qpn: u32, now: Instant) -> Option<(SocketAddr, Packet)> {
        let q = self.qps.get_mut(&qpn)?;
        if q.state != IBV_QPS_RTS {
            return None;
        }
        if q.qpt == IBV_QPT_UD {
            return self.next_ud_packet(qpn, now);
        }
        if q.qpt == IBV_QPT_RAW_PACKET {
            return self.next_raw_packet(qpn, now);
        }
        let dst = q.remote?;
        let idx = match q.req.next(now) {
            Next::Nothing => return None,
            Next::Resend(p) => {
                self.counters.retransmits += 1;
                return Some((dst, p));
            }
            Next::New(idx) => idx,
        };
        // Binds and invalidations are work requests the NIC reads like any other.
        self.fetch_wqes(qpn, idx, now);
        let q = self.qps.get_mut(&qpn)?;
        if proto::is_local_wr(q.req.sq[idx].wr.opcode) {
            self.execute_local(qpn, idx);
            return None;
        }
        if q.req.request_must_wait(idx, q.attr.max_rd_atomic) {
            return None;
        }
        if let Some((sges, need_write)) = q.req.unresolved(idx) {
            match self.mem.resolve_local(q.conn, q.pd, sges, need_write) {
                Some(segs) => q.req.resolved(idx, segs),
                None => {
                    self.fail_wqe_local(qpn, idx, IBV_WC_LOC_PROT_ERR);
                    return None;
                }
            }
        }
        let route = Route {
            qpn,
            dest_qpn: q.attr.dest_qp_num,
            mtu: q.mtu,
            xrc: q.qpt == IBV_QPT_XRC_SEND,
            uc: q.qpt == IBV_QPT_UC,
        };
        if q.req.is_request(idx) {
            return Some((dst, q.req.request_packet(idx, &route, now)));
        }
        if let Some((at, n)) = q.req.to_stage(idx, route.mtu) {
            let Ok(bytes) = gather(q.pid, &q.req.sq[idx].segs, u64::from(at), n) else {
                self.fail_wqe_local(qpn, idx, IBV_WC_LOC_PROT_ERR);
                return None;
            };
            q.req.staged(idx, at, bytes);
        }
        let Built { packet, uc_done } = q.req.data_packet(idx, &route, self.auss.is_on(), now);
        if let Some(psn) = uc_done {
            self.complete_sends(qpn, psn);
        }
        Some((dst, packet))
    }

    /// Next datagram of a UD QP: one work request is one packet to the destination its
    /// address handle named, complete once sent (UD has no acknowledgement). A message longer
    /// than the port MTU is a local length error, as on hardware.
    pub(super) fn next_ud_packet(
        &mut self,
        qpn: u32,
        now: Instant,
    ) -> Option<(SocketAddr, Packet)> {
        let q = self.qps.get(&qpn)?;
        if !q.req.has_unsent() {
            return None;
        }
        let idx = q.req.sq_next;
        self.fetch_wqes(qpn, idx, now);
        let mtu = self.nic.cfg.mtu;
        let q = self.qps.get(&qpn)?;
        let w = &q.req.sq[idx];
        if w.len > mtu {
            self.fail_wqe_local(qpn, idx, IBV_WC_LOC_LEN_ERR);
            return None;
        }
        // The provider always puts an address handle's IPv4 address or multicast group key
        // here; the ring is application memory, so anything else is refused rather than sent
        // somewhere.
        let dest = w.wr.remote_addr;
        if dest == 0 || (dest > u64::from(u32::MAX) && !device::is_group(dest)) {
            self.fail_wqe_local(qpn, idx, IBV_WC_LOC_QP_OP_ERR);
            return None;
        }
        let payload = self.wqe_bytes(qpn, idx)?;
        let q = self.qps.get_mut(&qpn)?;
        let w = &q.req.sq[idx];
        // A Q_Key with the high bit set means "use the QP's own" (IBTA 10.2.5).
        let wr_qkey = w.wr.compare_add as u32;
        let qkey = if wr_qkey & 0x8000_0000 != 0 {
            q.attr.qkey
        } else {
            wr_qkey
        };
        let mut flags = wire::F_FIRST | wire::F_LAST;
        if w.wr.opcode == IBV_WR_SEND_WITH_IMM {
            flags |= wire::F_IMM;
        }
        if w.wr.flags & IBV_SEND_SOLICITED != 0 {
            flags |= wire::F_SOLICITED;
        }
        let group = device::is_group(dest);
        // An IB-style group has no IPv4 address: any multicast address makes the packet go
        // to every host (`fanout`), which finds the group by the key it carries.
        let ip = u32::try_from(dest).map_or(Ipv4Addr::BROADCAST, Ipv4Addr::from);
        let ip = if group && !ip.is_multicast() {
            Ipv4Addr::new(239, 255, 255, 255)
        } else {
            ip
        };
        let mut p = Packet {
            op: wire::OP_UD_SEND,
            flags,
            dst_qpn: w.wr.rkey & wire::PSN_MASK,
            src_qpn: qpn,
            msg_len: w.len,
            imm: w.wr.imm,
            rkey: qkey,
            // The group, for the receiving engines (the datagram goes to each host).
            remote_addr: if group { dest } else { 0 },
            payload: payload.into(),
            ..Default::default()
        };
        p.psn = q.req.sent_whole(idx);
        self.complete_sends(qpn, p.psn);
        let dst = SocketAddr::V4(SocketAddrV4::new(ip, device::ENGINE_UDP_PORT));
        Some((dst, p))
    }

    /// A UD (or raw-packet) QP being destroyed first sends the datagrams already posted to it: a NIC has long
    /// sent them by the time a destroy reaches it, and a program may destroy right after
    /// posting unsignalled sends (`mckey -s` does), while softrnic's transmitter may not have
    /// run yet. Nobody waits for a datagram, so this ends with the send queue.
    pub(super) fn send_posted_datagrams(&mut self, qpn: u32, now: Instant) {
        let ud_rts = self.qps.get(&qpn).is_some_and(|q| {
            matches!(q.qpt, IBV_QPT_UD | IBV_QPT_RAW_PACKET) && q.state == IBV_QPS_RTS
        });
        if !ud_rts {
            return;
        }
        self.pull_sq(qpn);
        let posted = self.qps.get(&qpn).map_or(0, |q| q.req.sq.len());
        for _ in 0..posted {
            let Some((dst, bytes)) = self.next_packet(qpn, now) else {
                break;
            };
            self.emit(dst, bytes, now);
        }
    }

    /// The bytes of a one-packet work request (UD, raw Ethernet): its inline data, or what
    /// its SGEs hold in the process; one whose SGEs do not resolve completes with a local
    /// protection error, and gives `None`.
    pub(super) fn wqe_bytes(&mut self, qpn: u32, idx: usize) -> Option<Vec<u8>> {
        let q = self.qps.get(&qpn)?;
        let w = &q.req.sq[idx];
        if let Some(b) = &w.wr.inline {
            return Some(b.clone());
        }
        let len = w.len as usize;
        let bytes = self
            .mem
            .resolve_local(q.conn, q.pd, &w.wr.sges, false)
            .and_then(|segs| gather(q.pid, &segs, 0, len).ok());
        if bytes.is_none() {
            self.fail_wqe_local(qpn, idx, IBV_WC_LOC_PROT_ERR);
        }
        bytes
    }

    /// A local error while building a WQE: complete it with `status`, QP to error.
    pub(super) fn fail_wqe_local(&mut self, qpn: u32, idx: usize, status: i32) {
        let Some(q) = self.qps.get_mut(&qpn) else {
            return;
        };
        let scq = q.send_cq;
        if let Some(wc) = q.req.fail_at(idx, qpn, status) {
            self.push_cqe(scq, wc);
        }
        self.flush_qp(qpn);
    }

    /// Execute the window bind or invalidation at `idx` (the transmitter's next WQE): it takes
    /// effect now, in send-queue order, and completes once everything before it has; a
    /// failure completes it with an error and moves the QP to the error state.
    pub(super) fn execute_local(&mut self, qpn: u32, idx: usize) {
        let Some(q) = self.qps.get_mut(&qpn) else {
            return;
        };
        let (conn, pd, wr) = (q.conn, q.pd, &q.req.sq[idx].wr);
        let result = if wr.opcode == IBV_WR_BIND_MW {
            let b = BindReq {
                rkey: wr.rkey,
                mr: (wr.swap >> 32) as u32,
                addr: wr.remote_addr,
                len: wr.compare_add,
                access: wr.swap as u32,
            };
            self.mem.bind_mw(conn, pd, qpn, &b)
        } else if self.mem.invalidate_mw(conn, pd, qpn, wr.imm) {
            Ok(())
        } else {
            Err(IBV_WC_LOC_PROT_ERR)
        };
        match result {
            Ok(()) => {
                if q.req.executed_local(idx) {
                    self.complete_sends(qpn, 0);
                }
            }
            Err(status) => self.fail_wqe_local(qpn, idx, status),
        }
    }

    /// Post the completions of the work requests done at the head of the send queue.
    pub(super) fn complete_sends(&mut self, qpn: u32, acked: u32) {
        let Some(q) = self.qps.get_mut(&qpn) else {
            return;
        };
        let scq = q.send_cq;
        for wc in q.req.completions(qpn, acked) {
            self.push_cqe(scq, wc);
        }
    }

    /// Cumulative acknowledgement up to `psn` (inclusive).
    pub(super) fn on_ack(&mut self, qpn: u32, psn: u32, now: Instant) {
        let Some(q) = self.qps.get_mut(&qpn) else {
            return;
        };
        q.req.acknowledge(psn, now);
        self.complete_sends(qpn, psn);
    }

    /// Timers: retransmission on timeout, retry exhaustion.
    pub(super) fn timers(&mut self, now: Instant) {
        self.auss_tick(now);
        if !self.tombstones.is_empty() {
            self.tombstones.retain(|_, t| t.until > now);
        }
        let qpns: Vec<u32> = self.qps.keys().copied().collect();
        let time_scale = self.nic.cfg.time_scale;
        for qpn in qpns {
            let Some(q) = self.qps.get_mut(&qpn) else {
                continue;
            };
            if q.state != IBV_QPS_RTS {
                continue;
            }
            let timeout = q.timeout(time_scale);
            if q.req.timer(now, timeout, q.attr.retry_cnt) == Timer::Exhausted {
                self.fail_head(qpn, IBV_WC_RETRY_EXC_ERR);
            }
        }
    }

    pub(super) fn requester_rx(&mut self, p: Packet, now: Instant) {
        let qpn = p.dst_qpn;
        let Some(q) = self.qps.get_mut(&qpn) else {
            return;
        };
        if q.state != IBV_QPS_RTS {
            return;
        }
        if !q.req.expects(p.psn) {
            self.counters.rx_stale += 1;
            return;
        }
        match p.op {
            wire::OP_ACK => self.on_ack(qpn, p.psn, now),
            wire::OP_ATOMIC_RESP => self.on_atomic_resp(qpn, &p, now),
            wire::OP_READ_RESP => self.on_read_resp(qpn, &p, now),
            wire::OP_NAK => {
                let acked = psn_add(p.psn, wire::PSN_MASK);
                self.on_ack(qpn, acked, now);
                let Some(q) = self.qps.get_mut(&qpn) else {
                    return;
                };
                match p.syndrome {
                    wire::NAK_SEQ => q.req.resend_all(),
                    wire::NAK_RNR => {
                        let delay = rnr_delay(p.imm as u8);
                        if !q.req.rnr_nak(now, delay, q.attr.rnr_retry) {
                            self.fail_head(qpn, IBV_WC_RNR_RETRY_EXC_ERR);
                        }
                    }
                    syn => {
                        let status = match syn {
                            wire::NAK_REM_ACCESS => IBV_WC_REM_ACCESS_ERR,
                            wire::NAK_REM_INVALID => IBV_WC_REM_INV_REQ_ERR,
                            _ => IBV_WC_REM_OP_ERR,
                        };
                        self.fail_head(qpn, status);
                    }
                }
            }
            _ => {}
        }
    }

    /// A response to one of our READs: gathered with the READ's other responses and placed
    /// at its last one (see `placement`); one that shows a response missing asks for the
    /// rest of its READ again.
    fn on_read_resp(&mut self, qpn: u32, p: &Packet, now: Instant) {
        let Some(q) = self.qps.get_mut(&qpn) else {
            return;
        };
        let Some(r) = q.req.read_response_for(p.psn) else {
            return;
        };
        if let (Some(idx), Some(dst)) = (r.ask_again, q.remote) {
            if let Some(again) = q.req.ask_again(idx) {
                self.counters.read_requests_again += 1;
                self.counters.retransmits += 1;
                self.emit(dst, again, now);
            }
        }
        let Some(idx) = r.place else {
            self.counters.rx_stale += 1;
            return; // a duplicate, or beyond a missing response
        };
        let Some(q) = self.qps.get(&qpn) else {
            return;
        };
        let pid = q.pid;
        let t = q.req.read_target(idx, p.psn);
        if p.payload.len() != t.len as usize {
            self.counters.rx_stale += 1;
            return; // not the response this PSN carries: the timer recovers
        }
        let done = t.last;
        let at: Vec<_> = pieces(t.segs, u64::from(t.offset), p.payload.len()).collect();
        let (run, nak) = (Run::read(qpn), (p.psn, 0));
        let placed = self
            .stage_pieces(run, nak, pid, &at, &p.payload, now)
            .is_ok()
            && (!done || self.place_gathered(run).is_ok());
        if !placed {
            self.fail_head(qpn, IBV_WC_LOC_PROT_ERR);
            return;
        }
        let Some(q) = self.qps.get_mut(&qpn) else {
            return;
        };
        let acked = q.req.read_response_placed(idx, p.psn, now);
        self.on_ack(qpn, acked, now);
    }

    /// The response to one of our atomics: write the original value into the WQE's local
    /// buffer; the WQE is complete, and so is everything before it (implicit ACK).
    pub(super) fn on_atomic_resp(&mut self, qpn: u32, p: &Packet, now: Instant) {
        let Some(q) = self.qps.get_mut(&qpn) else {
            return;
        };
        let Ok(idx) = q.req.atomic_for(p.psn, p.payload.len()) else {
            self.counters.rx_stale += 1;
            return; // a duplicate response (or a malformed one: the timer recovers)
        };
        let orig = u64::from_le_bytes(p.payload[..].try_into().unwrap());
        if scatter(q.pid, q.req.segments(idx), 0, &orig.to_ne_bytes()).is_err() {
            self.fail_head(qpn, IBV_WC_LOC_PROT_ERR);
            return;
        }
        q.req.atomic_response_placed(idx, p.psn, now);
        self.on_ack(qpn, p.psn, now);
    }
}
