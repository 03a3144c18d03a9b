//! The engine's side of DCQCN ([`crate::dcqcn`]): as notification point it answers
//! CE-marked packets for its RC QPs with CNPs; as reaction point it cuts an RC QP's rate on
//! each CNP and paces that QP's packets at min(line, QP rate) — the line through the NIC's
//! pipeline clock as for every packet, the QP rate through a pacer of its own, next to the
//! application's `IBV_QP_RATE_LIMIT` pacer (both must allow a packet).

use super::*;
use crate::auss::dasr_cap_kbps;
use crate::dart_receiver::{answers_with_cnp, classify, Congestion, Policy};
use crate::dcqcn::{np_sends_cnp, DcqcnConfig, Rp};

/// The NIC's DCQCN: its parameters (None: off, or an unlimited line) and counters.
pub(super) struct Dcqcn {
    cfg: Option<DcqcnConfig>,
    /// DCQCN's clock is ns since this instant.
    epoch: Instant,
    pub(super) counters: DcqcnCounters,
}

/// The counters `softrnic stats` prints.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct DcqcnCounters {
    pub cnps_sent: u64,
    pub cnps_received: u64,
    pub rate_decreases: u64,
    /// The lowest rate of this NIC's rate-limited RC QPs now, kb/s (0: none is limited).
    pub min_rate_kbps: u64,
}

impl DcqcnCounters {
    pub fn lines(&self) -> String {
        format!(
            "dcqcn_cnps_sent {}\ndcqcn_cnps_received {}\ndcqcn_rate_decreases {}\n\
             dcqcn_min_rate_kbps {}\n",
            self.cnps_sent, self.cnps_received, self.rate_decreases, self.min_rate_kbps
        )
    }
}

/// One QP's congestion state: when it last sent a CNP (NP), its DCQCN rate with the pacer
/// that holds it to that rate (RP; from its first CNP on), and its DASR cap's pacer (while
/// its destination has stamped a count and `softrnic dasr` is on).
#[derive(Default)]
pub(super) struct QpCc {
    last_cnp_ns: Option<u64>,
    rp: Option<(Rp, nic::Pacer)>,
    dasr: Option<nic::Pacer>,
}

impl Dcqcn {
    pub(super) fn new(cfg: Option<DcqcnConfig>, now: Instant) -> Dcqcn {
        Dcqcn {
            cfg,
            epoch: now,
            counters: DcqcnCounters::default(),
        }
    }

    fn ns(&self, now: Instant) -> u64 {
        now.saturating_duration_since(self.epoch).as_nanos() as u64
    }
}

fn kbps(rp: &Rp) -> u32 {
    (rp.rate_bps() / 1000.0).clamp(1.0, u32::MAX as f64) as u32
}

/// An RC QP of this host whose connected peer is (`from`, `peer_qpn`).
fn rc_qp_of(qps: &mut IdMap<Qp>, qpn: u32, from: SocketAddr, peer_qpn: u32) -> Option<&mut Qp> {
    qps.get_mut(&qpn)
        .filter(|q| q.qpt == IBV_QPT_RC && q.remote == Some(from) && q.attr.dest_qp_num == peer_qpn)
}

impl State {
    /// NP: `p` arrived CE-marked from `from` (`marked_here`: by this host's receive port);
    /// answer with a CNP to the QP that sent it, at most once per CNP interval per QP —
    /// unless the receiver follows Dart and the congestion is its own.
    pub(super) fn on_marked(
        &mut self,
        from: SocketAddr,
        p: &Packet,
        marked_here: bool,
        now: Instant,
    ) {
        let Some(cfg) = self.dcqcn.cfg else { return };
        if p.op == wire::OP_CNP {
            return;
        }
        let t = self.dcqcn.ns(now);
        let window = Duration::from_nanos(cfg.cnp_interval_ns);
        let congestion = classify(marked_here, self.rx_port.busy_for(now), window);
        let Some(q) = rc_qp_of(&mut self.qps, p.dst_qpn, from, p.src_qpn) else {
            return;
        };
        if !answers_with_cnp(self.dart.receiver, congestion) {
            self.dart.cnps_suppressed += 1;
            return;
        }
        if self.dart.receiver == Policy::Dart && congestion == Congestion::NonReceiver {
            self.dart.non_receiver_marks += 1;
        }
        if !np_sends_cnp(&cfg, q.cc.last_cnp_ns, t) {
            return;
        }
        q.cc.last_cnp_ns = Some(t);
        self.dcqcn.counters.cnps_sent += 1;
        let cnp = Packet {
            op: wire::OP_CNP,
            dst_qpn: p.src_qpn,
            src_qpn: p.dst_qpn,
            ..Default::default()
        };
        self.emit(from, cnp, now);
    }

    /// RP: a CNP for one of this host's RC QPs; only its connected peer may send one.
    pub(super) fn on_cnp(&mut self, from: SocketAddr, p: &Packet, now: Instant) {
        let t = self.dcqcn.ns(now);
        let cfg = self.dcqcn.cfg;
        let Some(q) = rc_qp_of(&mut self.qps, p.dst_qpn, from, p.src_qpn) else {
            self.counters.rx_dropped_unknown_qp += 1;
            return;
        };
        self.dcqcn.counters.cnps_received += 1;
        let Some(cfg) = cfg else { return };
        let (rp, pacer) = q.cc.rp.get_or_insert_with(|| {
            let rp = Rp::new(cfg, t);
            let pacer = nic::Pacer::new(kbps(&rp), 0);
            (rp, pacer)
        });
        rp.on_cnp(t);
        pacer.set_kbps(kbps(rp));
        self.dcqcn.counters.rate_decreases += 1;
    }

    /// The DASR cap of RC QP `qpn` in kb/s: `R/N` of its destination's newest stamp, when
    /// `softrnic dasr` is on (None: no cap).
    fn dasr_cap_of(&self, qpn: u32) -> Option<u32> {
        if !self.dart.caps {
            return None;
        }
        let q = self.qps.get(&qpn).filter(|q| q.qpt == IBV_QPT_RC)?;
        let SocketAddr::V4(to) = q.remote? else {
            return None;
        };
        dasr_cap_kbps(self.nic.cfg.line_rate_gbps, self.auss_n_for(*to.ip())?)
    }

    /// When QP `qpn` may send its next packet by its pacers (None: now): the application's
    /// rate limit, DCQCN's rate and the DASR cap. A QP leaving RTS (flushing, say) is not
    /// held back.
    pub(super) fn pace_ready_at(&mut self, qpn: u32, now: Instant) -> Option<Instant> {
        let t = self.dcqcn.ns(now);
        let cap = self.dasr_cap_of(qpn);
        let q = self.qps.get_mut(&qpn).filter(|q| q.state == IBV_QPS_RTS)?;
        let app = q.pacer.and_then(|p| p.ready_at(now));
        let cc = q.cc.rp.as_mut().and_then(|(rp, pacer)| {
            rp.advance(t);
            pacer.set_kbps(kbps(rp));
            rp.limited().then(|| pacer.ready_at(now)).flatten()
        });
        // A stamp changes the cap within the message it arrives in, as Dart's NIC does: the
        // shim's caps act only at the next post, after a message posted whole has left.
        let dasr = match cap {
            Some(k) => {
                let pacer = q.cc.dasr.get_or_insert_with(|| nic::Pacer::new(k, 0));
                pacer.set_kbps(k);
                pacer.ready_at(now)
            }
            None => {
                q.cc.dasr = None;
                None
            }
        };
        app.max(cc).max(dasr)
    }

    /// QP `qpn` started a datagram of `len` bytes at `now`: its pacers are charged and
    /// DCQCN's byte counter advances.
    pub(super) fn pace_charge(&mut self, qpn: u32, now: Instant, len: usize) {
        let t = self.dcqcn.ns(now);
        let Some(q) = self.qps.get_mut(&qpn) else {
            return;
        };
        if let Some(p) = q.pacer.as_mut() {
            p.charge(now, len);
        }
        if let Some(p) = q.cc.dasr.as_mut() {
            p.charge(now, len);
        }
        if let Some((rp, pacer)) = q.cc.rp.as_mut() {
            if rp.limited() {
                pacer.charge(now, len);
            }
            rp.on_sent(len as u64 + nic::L2_L4_OVERHEAD, t);
            pacer.set_kbps(kbps(rp));
        }
    }

    /// The counters with the current lowest QP rate.
    pub(super) fn dcqcn_counters(&self) -> DcqcnCounters {
        let min = self
            .qps
            .values()
            .filter_map(|q| q.cc.rp.as_ref())
            .filter(|(rp, _)| rp.limited())
            .map(|(rp, _)| kbps(rp) as u64)
            .min();
        DcqcnCounters {
            min_rate_kbps: min.unwrap_or(0),
            ..self.dcqcn.counters
        }
    }
}
