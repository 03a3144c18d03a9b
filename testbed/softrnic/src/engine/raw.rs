//! Raw-packet QPs (`IBV_QPT_RAW_PACKET`) and flow steering (`ibv_create_flow`), as perftest's
//! `raw_ethernet_*` programs use them: a send is a whole Ethernet frame built by the
//! application; it costs its wire time once and goes to every host of the run (a switch
//! floods a frame whose destination it has not learnt; softrnic learns none), and each
//! engine steers it by its flow rules ([`crate::flow`]) to one local QP — the matching
//! `NORMAL` rule of lowest priority value, the earliest created among equals, else the
//! `ALL_DEFAULT` (any frame) and `MC_DEFAULT` (multicast frames) rules' QPs — plus a copy to
//! every `SNIFFER` rule's QP. Frames nobody wants are dropped (`rx_dropped_no_flow`), as a
//! NIC drops them. No reliability: it is Ethernet.

use std::collections::BTreeSet;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};

use super::*;
use crate::flow::{self, FlowRule};

/// Flow rules an engine keeps at most (real NICs hold thousands).
const MAX_FLOWS: usize = 4096;
/// Largest frame a raw QP sends: the port's MTU, an Ethernet header and a VLAN tag.
const ETH_OVERHEAD: u32 = 14 + 4;
/// Smallest: an Ethernet header.
const ETH_HEADER: u32 = 14;

pub(super) struct RawFlow {
    qpn: u32,
    conn: u64,
    rule: FlowRule,
}

impl RawFlow {
    pub(super) fn owned_by(&self, conn: u64) -> bool {
        self.conn == conn
    }
}

impl State {
    pub(super) fn create_flow(&mut self, conn: u64, qpn: u32, attr: &[u8]) -> Resp {
        let raw = self
            .qps
            .get(&qpn)
            .is_some_and(|q| q.conn == conn && q.qpt == IBV_QPT_RAW_PACKET);
        if !raw {
            return err(libc::EINVAL);
        }
        let rule = match FlowRule::parse(attr) {
            Ok(r) => r,
            Err(e) => return err(e.errno()),
        };
        if self.flows.len() >= MAX_FLOWS {
            return err(libc::ENOMEM);
        }
        let h = self.handle();
        self.flows.insert(h, RawFlow { qpn, conn, rule });
        Resp::Handle(h)
    }

    pub(super) fn destroy_flow(&mut self, conn: u64, handle: u32) -> Resp {
        match self.flows.get(&handle) {
            Some(f) if f.conn == conn => {
                self.flows.remove(&handle);
                Resp::Unit
            }
            _ => err(libc::EINVAL),
        }
    }

    /// A destroyed QP's rules go with it.
    pub(super) fn forget_flows(&mut self, qpn: u32) {
        self.flows.retain(|_, f| f.qpn != qpn);
    }

    /// The next frame of a raw-packet QP: sent as it is, to every host.
    pub(super) fn next_raw_packet(
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
        let max = self.nic.cfg.mtu + ETH_OVERHEAD;
        let q = self.qps.get(&qpn)?;
        let w = &q.req.sq[idx];
        if w.len < ETH_HEADER || w.len > max {
            self.fail_wqe_local(qpn, idx, IBV_WC_LOC_LEN_ERR);
            return None;
        }
        let frame = self.wqe_bytes(qpn, idx)?;
        let q = self.qps.get_mut(&qpn)?;
        let msg_len = q.req.sq[idx].len;
        let psn = q.req.sent_whole(idx);
        let p = Packet {
            op: wire::OP_RAW,
            flags: wire::F_FIRST | wire::F_LAST,
            dst_qpn: wire::MCAST_QPN,
            src_qpn: qpn,
            psn,
            msg_len,
            payload: frame.into(),
            ..Default::default()
        };
        self.complete_sends(qpn, psn);
        // Any multicast address makes `fanout` send it to every host, this one included
        // (a NIC loops frames back to its own matching rules).
        let flood = SocketAddrV4::new(Ipv4Addr::new(239, 255, 255, 255), device::ENGINE_UDP_PORT);
        Some((SocketAddr::V4(flood), p))
    }

    /// A frame arrived: steer it by the flow rules.
    pub(super) fn raw_rx(&mut self, p: &Packet, now: Instant) {
        let whole = p.flags & (wire::F_FIRST | wire::F_LAST) == wire::F_FIRST | wire::F_LAST;
        if !whole || p.payload.len() != p.msg_len as usize || p.msg_len < ETH_HEADER {
            self.counters.rx_dropped_malformed += 1;
            return;
        }
        let frame = &p.payload;
        let ready =
            |q: Option<&Qp>| q.is_some_and(|q| q.state == IBV_QPS_RTR || q.state == IBV_QPS_RTS);
        let mut normal: Option<&flow::FlowRule> = None;
        let mut defaults = BTreeSet::new();
        let mut sniffers = BTreeSet::new();
        let multicast = flow::is_multicast_frame(frame);
        // Handles grow with creation, so the first best match is the earliest rule.
        for f in self.flows.values() {
            if !ready(self.qps.get(&f.qpn)) {
                continue;
            }
            match f.rule.kind {
                flow::FLOW_ATTR_NORMAL
                    if f.rule.matches(frame)
                        && normal.is_none_or(|n| f.rule.priority < n.priority) =>
                {
                    normal = Some(&f.rule);
                }
                flow::FLOW_ATTR_ALL_DEFAULT => {
                    defaults.insert(f.qpn);
                }
                flow::FLOW_ATTR_MC_DEFAULT if multicast => {
                    defaults.insert(f.qpn);
                }
                flow::FLOW_ATTR_SNIFFER => {
                    sniffers.insert(f.qpn);
                }
                _ => {}
            }
        }
        // Equal rules of several QPs are one steering entry with several destinations (as
        // mlx5 merges them): each of those QPs gets the frame (perftest's `-q 2`).
        let mut to: BTreeSet<u32> = match normal {
            Some(rule) => self
                .flows
                .values()
                .filter(|f| f.rule == *rule && ready(self.qps.get(&f.qpn)))
                .map(|f| f.qpn)
                .collect(),
            None => BTreeSet::new(),
        };
        // QPs attached to the frame's multicast MAC (`ibv_attach_mcast`) get it as if by a rule.
        if multicast {
            let mac: [u8; 6] = frame[..6].try_into().expect("an Ethernet header");
            if let Some(members) = self.mcast.get(&device::mac_group_key(&mac)) {
                to.extend(members.iter().filter(|q| ready(self.qps.get(q))).copied());
            }
        }
        if to.is_empty() {
            to = defaults;
        }
        to.extend(sniffers);
        if to.is_empty() {
            self.counters.rx_dropped_no_flow += 1;
            return;
        }
        for qpn in to {
            self.touch_qp(qpn, now);
            self.raw_deliver(qpn, p);
        }
    }

    /// One frame into one of QP `qpn`'s receives: no GRH, the frame as sent.
    fn raw_deliver(&mut self, qpn: u32, p: &Packet) {
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
            byte_len: p.msg_len,
            qp_num: qpn,
            ..Default::default()
        };
        let total: u64 = r.sges.iter().map(|s| s.length as u64).sum();
        match self.mem.resolve_local(conn, pd, &r.sges, true) {
            None => wc.status = IBV_WC_LOC_PROT_ERR,
            Some(_) if total < u64::from(p.msg_len) => wc.status = IBV_WC_LOC_LEN_ERR,
            Some(segs) => {
                if scatter(pid, &segs, 0, &p.payload).is_err() {
                    wc.status = IBV_WC_LOC_PROT_ERR;
                }
            }
        }
        if wc.status != IBV_WC_SUCCESS {
            wc.byte_len = 0;
        }
        self.push_cqe(rcq, wc);
    }
}

/// Required and optional attribute masks of a raw-packet QP's transition (as the kernel's
/// table: a port to join at INIT, nothing else — there is no transport state).
pub(super) fn raw_masks(cur: i32, new: i32) -> Option<(i32, i32)> {
    Some(match (cur, new) {
        (_, IBV_QPS_RESET) | (_, IBV_QPS_ERR) => (0, 0),
        (IBV_QPS_RESET, IBV_QPS_INIT) => (IBV_QP_PORT, 0),
        (IBV_QPS_INIT, IBV_QPS_INIT) => (0, IBV_QP_PORT),
        (IBV_QPS_INIT, IBV_QPS_RTR) | (IBV_QPS_RTR, IBV_QPS_RTS) | (IBV_QPS_RTS, IBV_QPS_RTS) => {
            (0, 0)
        }
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(kind: u32, priority: u16, dst_mac: Option<[u8; 6]>) -> Vec<u8> {
        let mut b = vec![0u8; 20];
        b[4..8].copy_from_slice(&kind.to_le_bytes());
        b[10..12].copy_from_slice(&priority.to_le_bytes());
        b[13] = 1;
        if let Some(mac) = dst_mac {
            let mut eth = vec![0u8; 40];
            eth[0] = 0x20;
            eth[4] = 40;
            eth[6..12].copy_from_slice(&mac);
            eth[22..28].fill(0xff);
            b[12] = 1;
            b.extend_from_slice(&eth);
        }
        let size = b.len() as u16;
        b[8..10].copy_from_slice(&size.to_le_bytes());
        b
    }

    fn frame_to(mac: [u8; 6]) -> Packet {
        let mut f = mac.to_vec();
        f.extend_from_slice(&[2, 0, 0, 0, 0, 9, 0x88, 0xb5]);
        f.extend_from_slice(b"frame");
        Packet {
            op: wire::OP_RAW,
            flags: wire::F_FIRST | wire::F_LAST,
            dst_qpn: wire::MCAST_QPN,
            src_qpn: 0x99,
            msg_len: f.len() as u32,
            payload: f.into(),
            ..Default::default()
        }
    }

    /// Steering: of two NORMAL rules that match, the lower priority value takes the frame;
    /// a SNIFFER rule gets a copy of everything; a frame no NORMAL rule wants goes to the
    /// ALL_DEFAULT rule's QP, and with none, is dropped and counted. Rules belong to their
    /// context and go with their QP; raw QPs need only a port to reach INIT.
    #[test]
    fn frames_are_steered_by_priority_sniffers_and_defaults() {
        let mut st = State::new();
        let pid = std::process::id() as i32;
        let mut buf = vec![0u8; 4096];
        let Resp::Handle(pd) = st.request(1, pid, Req::AllocPd, Instant::now()) else {
            panic!()
        };
        let Resp::Mr { lkey, .. } = st.request(
            1,
            pid,
            Req::RegMr {
                pd,
                addr: buf.as_mut_ptr() as u64,
                len: buf.len() as u64,
                access: IBV_ACCESS_LOCAL_WRITE,
            },
            Instant::now(),
        ) else {
            panic!()
        };
        let Resp::Cq { handle: cq, .. } = st.request(
            1,
            pid,
            Req::CreateCq {
                cqe: 64,
                channel: 0,
                user: 0,
            },
            Instant::now(),
        ) else {
            panic!()
        };
        let mut qp = |slot: u64| {
            let Resp::Qp { qpn, .. } = st.request(
                1,
                pid,
                Req::CreateQp {
                    xrcd: 0,
                    pd,
                    send_cq: cq,
                    recv_cq: cq,
                    srq: 0,
                    qp_type: IBV_QPT_RAW_PACKET,
                    sq_sig_all: true,
                    cap: Caps {
                        max_send_wr: 4,
                        max_recv_wr: 8,
                        max_send_sge: 1,
                        max_recv_sge: 1,
                        max_inline_data: 0,
                    },
                },
                Instant::now(),
            ) else {
                panic!()
            };
            let mut a = QpAttrs {
                qp_state: IBV_QPS_INIT,
                port_num: 1,
                qkey: 7,
                ..Default::default()
            };
            let no_qkey = st.modify_qp(
                qpn,
                IBV_QP_STATE | IBV_QP_PORT | IBV_QP_QKEY,
                &a,
                Instant::now(),
            );
            assert_eq!(no_qkey, Err(libc::EINVAL));
            assert_eq!(
                st.modify_qp(qpn, IBV_QP_STATE, &a, Instant::now()),
                Err(libc::EINVAL),
                "port"
            );
            st.modify_qp(qpn, IBV_QP_STATE | IBV_QP_PORT, &a, Instant::now())
                .unwrap();
            for state in [IBV_QPS_RTR, IBV_QPS_RTS] {
                a.qp_state = state;
                st.modify_qp(qpn, IBV_QP_STATE, &a, Instant::now()).unwrap();
            }
            let wrs = (0..4)
                .map(|i| RecvWr {
                    wr_id: slot * 10 + i,
                    sges: vec![Sge {
                        addr: buf.as_ptr() as u64 + (slot * 4 + i) * 128,
                        length: 128,
                        lkey,
                    }],
                })
                .collect();
            assert_eq!(
                st.request(1, pid, Req::PostRecv { qpn, wrs }, Instant::now()),
                Resp::Unit
            );
            qpn
        };
        let (a, b) = (qp(0), qp(1));
        let flow = |st: &mut State, conn: u64, qpn: u32, attr: Vec<u8>| match st.request(
            conn,
            pid,
            Req::CreateFlow { qpn, attr },
            Instant::now(),
        ) {
            Resp::Handle(h) => h,
            other => panic!("{other:?}"),
        };
        let x = [2, 0, 0, 0, 0, 1];
        flow(&mut st, 1, a, rule(flow::FLOW_ATTR_NORMAL, 5, Some(x)));
        let b_normal = flow(&mut st, 1, b, rule(flow::FLOW_ATTR_NORMAL, 1, Some(x)));
        let sniff = flow(&mut st, 1, a, rule(flow::FLOW_ATTR_SNIFFER, 0, None));
        // Not a raw QP's, not this context's, not a rule.
        assert_eq!(
            st.request(
                2,
                pid,
                Req::CreateFlow {
                    qpn: a,
                    attr: rule(0, 0, None)
                },
                Instant::now()
            ),
            err(libc::EINVAL)
        );
        assert_eq!(
            st.request(
                1,
                pid,
                Req::CreateFlow {
                    qpn: a,
                    attr: vec![0; 10]
                },
                Instant::now()
            ),
            err(libc::EINVAL)
        );
        assert_eq!(
            st.request(2, pid, Req::DestroyFlow { handle: sniff }, Instant::now()),
            err(libc::EINVAL)
        );
        let got = |st: &State| -> Vec<(u32, u64, u32)> {
            st.cqs[&cq]
                .q
                .iter()
                .map(|w| (w.qp_num, w.wr_id, w.byte_len))
                .collect()
        };
        st.on_packet(
            SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 4791)),
            frame_to(x),
            Instant::now(),
        );
        assert_eq!(
            got(&st),
            vec![(a, 0, 19), (b, 10, 19)],
            "b's rule wins, a sniffs"
        );
        assert_eq!(&buf[128 * 4..128 * 4 + 6], &x, "the frame as sent, no GRH");
        // To another MAC: only the sniffer; then, without it, nobody.
        let from = SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 4791));
        st.on_packet(from, frame_to([2, 0, 0, 0, 0, 5]), Instant::now());
        assert_eq!(got(&st).len(), 3);
        assert_eq!(
            st.request(1, pid, Req::DestroyFlow { handle: sniff }, Instant::now()),
            Resp::Unit
        );
        st.on_packet(from, frame_to([2, 0, 0, 0, 0, 5]), Instant::now());
        assert_eq!(st.counters.rx_dropped_no_flow, 1);
        // A default rule takes what no NORMAL rule wants, not what one does.
        flow(&mut st, 1, b, rule(flow::FLOW_ATTR_ALL_DEFAULT, 0, None));
        st.on_packet(from, frame_to([2, 0, 0, 0, 0, 5]), Instant::now());
        st.on_packet(from, frame_to(x), Instant::now());
        let last: Vec<u32> = got(&st)[3..].iter().map(|g| g.0).collect();
        assert_eq!(last, vec![b, b]);
        // An equal rule of a at b's priority: one entry with two destinations.
        flow(&mut st, 1, a, rule(flow::FLOW_ATTR_NORMAL, 1, Some(x)));
        st.on_packet(from, frame_to(x), Instant::now());
        let both: Vec<u32> = got(&st)[5..].iter().map(|g| g.0).collect();
        assert_eq!(both, vec![a, b]);
        // Destroying b takes its rules: a's NORMAL rule is left for x.
        st.remove_qp(b, Instant::now());
        assert!(st.flows.values().all(|f| f.qpn == a));
        assert_eq!(
            st.request(
                1,
                pid,
                Req::DestroyFlow { handle: b_normal },
                Instant::now()
            ),
            err(libc::EINVAL)
        );
        st.on_packet(from, frame_to(x), Instant::now());
        assert_eq!(got(&st).last().unwrap().0, a);
    }
}
