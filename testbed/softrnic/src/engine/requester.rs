//! The requester: building packets from send queues (fetch, MTU, window), completing them on acknowledgements and responses, retransmission and RNR timers.

use super::placement::Run;
use super::*;

/// Payload of an atomic request: the compare/add operand and the swap value, little endian.
pub(super) fn atomic_operands(compare_add: u64, swap: u64) -> Vec<u8> {
    let mut v = Vec::with_capacity(16);
    v.extend_from_slice(&compare_add.to_le_bytes());
    v.extend_from_slice(&swap.to_le_bytes());
    v
}

pub(super) fn send_wc_opcode(wr_opcode: i32) -> i32 {
    match wr_opcode {
        IBV_WR_RDMA_WRITE | IBV_WR_RDMA_WRITE_WITH_IMM => IBV_WC_RDMA_WRITE,
        IBV_WR_RDMA_READ => IBV_WC_RDMA_READ,
        IBV_WR_ATOMIC_CMP_AND_SWP => IBV_WC_COMP_SWAP,
        IBV_WR_ATOMIC_FETCH_AND_ADD => IBV_WC_FETCH_ADD,
        IBV_WR_BIND_MW => IBV_WC_BIND_MW,
        IBV_WR_LOCAL_INV => IBV_WC_LOCAL_INV,
        _ => IBV_WC_SEND,
    }
}

/// RNR NAK timer values (IBTA table, in ms; 0 means 655.36 ms).
pub(super) fn rnr_delay(code: u8) -> Duration {
    const US: [u64; 32] = [
        655_360, 10, 20, 30, 40, 60, 80, 120, 160, 240, 320, 480, 640, 960, 1_280, 1_920, 2_560,
        3_840, 5_120, 7_680, 10_240, 15_360, 20_480, 30_720, 40_960, 61_440, 81_920, 122_880,
        163_840, 245_760, 327_680, 491_520,
    ];
    Duration::from_micros(US[(code & 31) as usize])
}

impl State {
    /// The NIC's fetch unit reads work request `idx` of a QP's send queue unless it already
    /// did: one DMA read of it and the rest of its `ibv_post_send` list, up to
    /// `wqe_fetch_batch` work requests ([`nic::fetch_count`]), costing `wqe_fetch_ns` each,
    /// charged at once so that no other QP's packet starts before the whole read is done.
    pub(super) fn fetch_wqes(&mut self, qpn: u32, idx: usize, now: Instant) {
        let batch = self.nic.cfg.wqe_fetch_batch;
        let Some(q) = self.qps.get_mut(&qpn) else {
            return;
        };
        if q.sq.get(idx).is_none_or(|w| w.fetched) {
            return;
        }
        let n = nic::fetch_count(q.sq.iter().skip(idx).map(|w| w.doorbell), batch);
        let mut bytes = 0u64;
        for w in q.sq.iter_mut().skip(idx).take(n as usize) {
            w.fetched = true;
            bytes += u64::from(w.len);
        }
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
        let auss = self.auss.is_on();
        if let Some(t) = q.rnr_until {
            if now < t {
                return None;
            }
            q.rnr_until = None;
            q.resend = Some(0);
        }
        if let Some(i) = q.resend {
            if i < q.inflight.len() {
                q.resend = Some(i + 1);
                self.counters.retransmits += 1;
                return Some((dst, q.inflight[i].packet.clone()));
            }
            q.resend = None;
        }
        if q.inflight.len() >= WINDOW || q.sq_next >= q.sq.len() {
            return None;
        }
        let idx = q.sq_next;
        // Binds and invalidations are work requests the NIC reads like any other.
        self.fetch_wqes(qpn, idx, now);
        let q = self.qps.get_mut(&qpn)?;
        if proto::is_local_wr(q.sq[idx].wr.opcode) {
            self.execute_local(qpn, idx);
            return None;
        }
        let op = q.sq[idx].wr.opcode;
        if (op == IBV_WR_RDMA_READ || proto::is_atomic_wr(op))
            && q.reads_atomics_outstanding() >= q.reads_atomics_limit()
        {
            // As on hardware, at most max_rd_atomic READs and atomics wait for their
            // responses: no more than the responder has resources for (a READ beyond them
            // was dropped there and came back only after a retransmission timeout), and
            // every atomic stays within the responder's result cache.
            return None;
        }
        // Resolve the local buffers of a WQE when its first packet is built.
        if q.sq_off == 0 && !q.sq[idx].packetized && q.sq[idx].wr.inline.is_none() {
            let (conn, pd) = (q.conn, q.pd);
            // READ and atomics write the local buffer (the data, the original value).
            let op = q.sq[idx].wr.opcode;
            let need_write = op == IBV_WR_RDMA_READ || proto::is_atomic_wr(op);
            let sges = q.sq[idx].wr.sges.clone();
            match self.mem.resolve_local(conn, pd, &sges, need_write) {
                Some(segs) => {
                    let q = self.qps.get_mut(&qpn)?;
                    q.sq[idx].segs = segs;
                }
                None => {
                    self.fail_wqe_local(qpn, idx, IBV_WC_LOC_PROT_ERR);
                    return None;
                }
            }
        }
        let q = self.qps.get_mut(&qpn)?;
        let mtu = q.mtu;
        let psn = q.next_psn;
        let dest_qpn = q.attr.dest_qp_num;
        let pid = q.pid;
        let xrc = q.qpt == IBV_QPT_XRC_SEND;
        let w = &mut q.sq[idx];
        let mut p = Packet {
            dst_qpn: dest_qpn,
            src_qpn: qpn,
            psn,
            msg_len: w.len,
            offset: q.sq_off,
            imm: w.wr.imm,
            remote_addr: w.wr.remote_addr,
            rkey: w.wr.rkey,
            ..Default::default()
        };
        if xrc {
            p.flags |= wire::F_XRC;
            p.srqn = w.wr.xrc_srqn;
        }
        if w.wr.opcode == IBV_WR_RDMA_READ || proto::is_atomic_wr(w.wr.opcode) {
            // One request packet answered by response packets (READ: one PSN per response
            // packet; atomic: one PSN, one 8-byte response).
            let n = if w.wr.opcode == IBV_WR_RDMA_READ {
                p.op = wire::OP_READ_REQ;
                w.len.div_ceil(mtu).max(1)
            } else {
                p.op = if w.wr.opcode == IBV_WR_ATOMIC_CMP_AND_SWP {
                    wire::OP_CMP_SWAP
                } else {
                    wire::OP_FETCH_ADD
                };
                p.payload = atomic_operands(w.wr.compare_add, w.wr.swap).into();
                1
            };
            p.flags |= wire::F_FIRST | wire::F_LAST | wire::F_ACKREQ;
            w.first_psn = psn;
            w.last_psn = psn_add(psn, n - 1);
            w.resp_next = psn;
            w.packetized = true;
            q.next_psn = psn_add(psn, n);
            q.sq_next += 1;
            let last = w.last_psn;
            q.track(
                Inflight {
                    psn,
                    last_psn: last,
                    needs_resp: true,
                    packet: p.clone(),
                },
                now,
            );
            return Some((dst, p));
        }
        let off = q.sq_off;
        let chunk = (w.len - off).min(mtu);
        if w.wr.inline.is_none() {
            let staged_end = w.staged_at + w.staged.len() as u32;
            if off < w.staged_at || off + chunk > staged_end {
                // A new buffer: the packets sent so far still share the old one.
                let n = (w.len - off).min(STAGE_BYTES).max(chunk) as usize;
                let Ok(b) = gather(pid, &w.segs, off as u64, n) else {
                    self.fail_wqe_local(qpn, idx, IBV_WC_LOC_PROT_ERR);
                    return None;
                };
                w.staged = b.into();
                w.staged_at = off;
            }
        }
        let q = self.qps.get_mut(&qpn)?;
        let w = &mut q.sq[idx];
        p.op = match w.wr.opcode {
            IBV_WR_SEND | IBV_WR_SEND_WITH_IMM | IBV_WR_SEND_WITH_INV => wire::OP_SEND,
            _ => wire::OP_WRITE,
        };
        if w.wr.opcode == IBV_WR_SEND_WITH_INV {
            p.flags |= wire::F_INV;
        }
        if matches!(
            w.wr.opcode,
            IBV_WR_SEND_WITH_IMM | IBV_WR_RDMA_WRITE_WITH_IMM
        ) {
            p.flags |= wire::F_IMM;
        }
        if off == 0 {
            p.flags |= wire::F_FIRST;
            w.first_psn = psn;
        }
        let last = off + chunk >= w.len;
        q.since_ackreq += 1;
        if last || q.since_ackreq >= ACKREQ_EVERY {
            p.flags |= wire::F_ACKREQ;
            q.since_ackreq = 0;
        }
        if last {
            p.flags |= wire::F_LAST;
            if w.wr.flags & IBV_SEND_SOLICITED != 0 {
                p.flags |= wire::F_SOLICITED;
            }
        }
        // A slice of the staged bytes of the message (not copied), or of the inline data.
        p.payload = match &w.wr.inline {
            Some(b) => b[off as usize..(off + chunk) as usize].to_vec().into(),
            None => {
                let at = (off - w.staged_at) as usize;
                w.staged.slice(at..at + chunk as usize)
            }
        };
        if last {
            w.last_psn = psn;
            w.packetized = true;
            w.staged = Payload::default();
            q.sq_next += 1;
            q.sq_off = 0;
            if auss && q.sq_next >= q.sq.len() {
                p.flags |= wire::F_IDLE;
            }
        } else {
            q.sq_off = off + chunk;
        }
        q.next_psn = psn_add(psn, 1);
        if q.qpt == IBV_QPT_UC {
            // UC: nothing is acknowledged or resent; a message is complete once sent.
            if last {
                self.complete_sends(qpn, psn);
            }
            return Some((dst, p));
        }
        q.track(
            Inflight {
                psn,
                last_psn: psn,
                needs_resp: false,
                packet: p.clone(),
            },
            now,
        );
        Some((dst, p))
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
        if q.sq_next >= q.sq.len() {
            return None;
        }
        let idx = q.sq_next;
        self.fetch_wqes(qpn, idx, now);
        let mtu = self.nic.cfg.mtu;
        let q = self.qps.get(&qpn)?;
        let w = &q.sq[idx];
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
        let w = &mut q.sq[idx];
        // A Q_Key with the high bit set means "use the QP's own" (IBTA 10.2.5).
        let wr_qkey = w.wr.compare_add as u32;
        let qkey = if wr_qkey & 0x8000_0000 != 0 {
            q.attr.qkey
        } else {
            wr_qkey
        };
        let psn = q.next_psn;
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
        let p = Packet {
            op: wire::OP_UD_SEND,
            flags,
            dst_qpn: w.wr.rkey & wire::PSN_MASK,
            src_qpn: qpn,
            psn,
            msg_len: w.len,
            imm: w.wr.imm,
            rkey: qkey,
            // The group, for the receiving engines (the datagram goes to each host).
            remote_addr: if group { dest } else { 0 },
            payload: payload.into(),
            ..Default::default()
        };
        w.packetized = true;
        w.first_psn = psn;
        w.last_psn = psn;
        q.sq_next += 1;
        q.next_psn = psn_add(psn, 1);
        self.complete_sends(qpn, psn);
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
        let posted = self.qps.get(&qpn).map_or(0, |q| q.sq.len());
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
        let w = &q.sq[idx];
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
        // Everything before idx completes normally only once acknowledged; a local error
        // moves the QP to the error state, which flushes them (as hardware does).
        let w = q.sq.remove(idx);
        let scq = q.send_cq;
        if let Some(w) = w {
            let wc = IbvWc {
                wr_id: w.wr.wr_id,
                status,
                opcode: send_wc_opcode(w.wr.opcode),
                qp_num: qpn,
                ..Default::default()
            };
            self.push_cqe(scq, wc);
        }
        self.flush_qp(qpn);
    }

    /// Execute the window bind or invalidation at `idx` (the transmitter's next WQE): it takes
    /// effect now, in send-queue order, and completes once everything before it has; a
    /// failure completes it with an error and moves the QP to the error state.
    pub(super) fn execute_local(&mut self, qpn: u32, idx: usize) {
        let Some(q) = self.qps.get(&qpn) else { return };
        let (conn, pd, wr) = (q.conn, q.pd, q.sq[idx].wr.clone());
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
                let Some(q) = self.qps.get_mut(&qpn) else {
                    return;
                };
                q.sq[idx].packetized = true;
                q.sq_next += 1;
                if idx == 0 {
                    // Nothing before it: no acknowledgement will come to complete it.
                    self.complete_sends(qpn, 0);
                }
            }
            Err(status) => self.fail_wqe_local(qpn, idx, status),
        }
    }

    /// Pop completed WQEs from the head of the send queue, in order.
    pub(super) fn complete_sends(&mut self, qpn: u32, acked: u32) {
        let mut cqes = Vec::new();
        let Some(q) = self.qps.get_mut(&qpn) else {
            return;
        };
        while let Some(w) = q.sq.front() {
            if !w.packetized {
                break;
            }
            let done = if proto::is_local_wr(w.wr.opcode) {
                // Executed when the transmitter reached it; done once all before it are.
                true
            } else if w.wr.opcode == IBV_WR_RDMA_READ || proto::is_atomic_wr(w.wr.opcode) {
                w.resp_done
            } else {
                // Acknowledged by this ACK, or by an earlier one: an ACK that covered the WQE
                // while a READ ahead of it still waited for its response took its packets
                // out of `inflight` but could not complete it (completions are in order),
                // and no later ACK need ever come.
                psn_diff(acked, w.last_psn) >= 0
                    || !q.inflight.iter().any(|f| {
                        psn_diff(f.last_psn, w.first_psn) >= 0 && psn_diff(f.psn, w.last_psn) <= 0
                    })
            };
            if !done {
                break;
            }
            let w = q.sq.pop_front().unwrap();
            q.sq_next -= 1;
            if w.signaled {
                cqes.push(IbvWc {
                    wr_id: w.wr.wr_id,
                    status: IBV_WC_SUCCESS,
                    opcode: send_wc_opcode(w.wr.opcode),
                    // READ: the bytes read; atomics: the 8 bytes of the original value.
                    byte_len: if w.wr.opcode == IBV_WR_RDMA_READ || proto::is_atomic_wr(w.wr.opcode)
                    {
                        w.len
                    } else {
                        0
                    },
                    qp_num: qpn,
                    ..Default::default()
                });
            }
        }
        let scq = q.send_cq;
        for c in cqes {
            self.push_cqe(scq, c);
        }
    }

    /// Cumulative acknowledgement up to `psn` (inclusive).
    pub(super) fn on_ack(&mut self, qpn: u32, psn: u32, now: Instant) {
        let Some(q) = self.qps.get_mut(&qpn) else {
            return;
        };
        let before = q.inflight.len();
        q.inflight
            .retain(|f| f.needs_resp || psn_diff(psn, f.last_psn) < 0);
        if q.inflight.len() != before {
            q.last_progress = now;
            q.retries = 0;
            q.rnr_retries = 0;
            if let Some(r) = q.resend {
                q.resend = Some(r.saturating_sub(before - q.inflight.len()));
            }
        }
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
            if q.state != IBV_QPS_RTS || q.inflight.is_empty() || q.rnr_until.is_some() {
                continue;
            }
            if now.duration_since(q.last_progress) < q.timeout(time_scale) {
                continue;
            }
            q.retries += 1;
            q.last_progress = now;
            if q.retries > q.attr.retry_cnt as u32 {
                self.fail_head(qpn, IBV_WC_RETRY_EXC_ERR);
            } else {
                q.resend = Some(0);
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
        // Ignore anything outside [oldest unacked, next_psn).
        let Some(oldest) = q.inflight.front().map(|f| f.psn) else {
            self.counters.rx_stale += 1;
            return;
        };
        if psn_diff(p.psn, oldest) < 0 || psn_diff(p.psn, q.next_psn) >= 0 {
            self.counters.rx_stale += 1;
            return;
        }
        match p.op {
            wire::OP_ACK => self.on_ack(qpn, p.psn, now),
            wire::OP_ATOMIC_RESP => self.on_atomic_resp(qpn, &p, now),
            wire::OP_READ_RESP => {
                // Find the read WQE this response belongs to.
                let Some(idx) = q.sq.iter().position(|w| {
                    w.packetized
                        && w.wr.opcode == IBV_WR_RDMA_READ
                        && psn_diff(p.psn, w.first_psn) >= 0
                        && psn_diff(p.psn, w.last_psn) <= 0
                }) else {
                    return;
                };
                let pid = q.pid;
                let w = &q.sq[idx];
                if p.psn != w.resp_next || w.resp_done {
                    self.counters.rx_stale += 1;
                    return; // duplicate or out of order: the timer recovers
                }
                let done = p.psn == w.last_psn;
                // Gathered with the READ's other responses and placed at its last one
                // (see `placement`).
                let at: Vec<_> = pieces(&w.segs, p.offset as u64, p.payload.len()).collect();
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
                let w = &mut q.sq[idx];
                w.resp_next = psn_add(p.psn, 1);
                let first = w.first_psn;
                if done {
                    w.resp_done = true;
                    q.remove_inflight(first);
                }
                q.last_progress = now;
                q.retries = 0;
                // A response implicitly acknowledges everything before the read; the last
                // one completes the read itself.
                let acked = if done {
                    p.psn
                } else {
                    psn_add(first, wire::PSN_MASK)
                };
                self.on_ack(qpn, acked, now);
            }
            wire::OP_NAK => {
                let acked = psn_add(p.psn, wire::PSN_MASK);
                match p.syndrome {
                    wire::NAK_SEQ => {
                        self.on_ack(qpn, acked, now);
                        if let Some(q) = self.qps.get_mut(&qpn) {
                            q.resend = Some(0);
                        }
                    }
                    wire::NAK_RNR => {
                        self.on_ack(qpn, acked, now);
                        let Some(q) = self.qps.get_mut(&qpn) else {
                            return;
                        };
                        q.rnr_retries += 1;
                        if q.attr.rnr_retry != 7 && q.rnr_retries > q.attr.rnr_retry as u32 {
                            self.fail_head(qpn, IBV_WC_RNR_RETRY_EXC_ERR);
                            return;
                        }
                        q.rnr_until = Some(now + rnr_delay(p.imm as u8));
                        q.last_progress = now;
                    }
                    syn => {
                        self.on_ack(qpn, acked, now);
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

    /// The response to one of our atomics: write the original value into the WQE's local
    /// buffer; the WQE is complete, and so is everything before it (implicit ACK).
    pub(super) fn on_atomic_resp(&mut self, qpn: u32, p: &Packet, now: Instant) {
        let Some(q) = self.qps.get_mut(&qpn) else {
            return;
        };
        let pid = q.pid;
        let found = q
            .sq
            .iter()
            .position(|w| w.packetized && proto::is_atomic_wr(w.wr.opcode) && w.first_psn == p.psn);
        let Some(idx) = found else {
            self.counters.rx_stale += 1;
            return;
        };
        let w = &mut q.sq[idx];
        if w.resp_done || p.payload.len() != 8 {
            self.counters.rx_stale += 1;
            return; // a duplicate response (or a malformed one: the timer recovers)
        }
        let orig = u64::from_le_bytes(p.payload[..].try_into().unwrap());
        if scatter(pid, &w.segs, 0, &orig.to_ne_bytes()).is_err() {
            self.fail_head(qpn, IBV_WC_LOC_PROT_ERR);
            return;
        }
        w.resp_done = true;
        q.remove_inflight(p.psn);
        q.last_progress = now;
        q.retries = 0;
        self.on_ack(qpn, p.psn, now);
    }
}
