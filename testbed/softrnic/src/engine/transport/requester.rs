//! A QP's requester: its send queue, the packets it has in flight, the retransmission pass
//! and the RNR wait. It builds packets from work requests whose buffers the engine has
//! resolved and staged, takes acknowledgements and responses, and hands back the completions
//! they make; the engine (`engine::requester`) reads the application's memory, charges the
//! NIC model and posts the completions.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use drum_verbs_abi::consts::*;
use drum_verbs_abi::IbvWc;

use crate::proto::{self, SendWr};
use crate::wire::{self, psn_add, psn_diff, Packet, Payload};

/// Most packets a QP keeps unacknowledged.
pub(super) const WINDOW: usize = 512;
/// A requester asks for an ACK at least every this many packets (and at every message's
/// last packet). Counted from the last request rather than by PSN, so that messages of up to
/// this many packets are acknowledged once each, at their end: the responder then places a
/// message with one cross-process write (an ACK mid-message makes it place what it has).
pub(super) const ACKREQ_EVERY: u32 = 16;
/// How much of a message the requester reads from the process at once: one
/// `process_vm_readv` per 64 KiB instead of one per packet (each call looks the process up
/// again: 5 % of the engine's time at one call per 4 KiB packet).
const STAGE_BYTES: u32 = 64 << 10;

pub(in crate::engine) struct SqWqe {
    pub(in crate::engine) wr: SendWr,
    pub(in crate::engine) len: u32,
    pub(in crate::engine) signaled: bool,
    /// Set once all the WQE's packets have been built.
    pub(in crate::engine) packetized: bool,
    /// The first work request of its `ibv_post_send` call (its doorbell).
    pub(in crate::engine) doorbell: bool,
    /// Read by the NIC's fetch unit (its fetch cost is paid).
    pub(in crate::engine) fetched: bool,
    pub(in crate::engine) first_psn: u32,
    pub(in crate::engine) last_psn: u32,
    /// READ: next response PSN expected; READ and atomics: whether the response arrived.
    pub(in crate::engine) resp_next: u32,
    pub(in crate::engine) resp_done: bool,
    /// READ: the bytes each response carries (the path MTU when it was requested), and the
    /// response PSN from which it was last asked for again (see [`Requester::ask_again`]).
    resp_mtu: u32,
    asked_from: Option<u32>,
    /// Local segments (process address, length), resolved at packetization.
    pub(in crate::engine) segs: Vec<(u64, u64)>,
    /// Message bytes from offset `staged_at` on, read ahead of the packets that carry them
    /// (see [`STAGE_BYTES`]); the message's packets share them. Empty once the message is
    /// packetized.
    pub(in crate::engine) staged: Payload,
    pub(in crate::engine) staged_at: u32,
}

impl SqWqe {
    /// A work request as posted: nothing fetched, built or sent yet.
    pub(in crate::engine) fn new(wr: SendWr, len: u32, signaled: bool, doorbell: bool) -> Self {
        SqWqe {
            wr,
            len,
            signaled,
            packetized: false,
            doorbell,
            fetched: false,
            first_psn: 0,
            last_psn: 0,
            resp_next: 0,
            resp_done: false,
            resp_mtu: 0,
            asked_from: None,
            segs: Vec::new(),
            staged: Payload::default(),
            staged_at: 0,
        }
    }

    /// READs and atomics: requests answered by response packets.
    fn is_request(&self) -> bool {
        self.wr.opcode == IBV_WR_RDMA_READ || proto::is_atomic_wr(self.wr.opcode)
    }
}

pub(in crate::engine) struct Inflight {
    pub(in crate::engine) psn: u32,
    pub(in crate::engine) last_psn: u32,
    pub(in crate::engine) needs_resp: bool,
    /// The packet as first sent (its payload shares the staged message bytes).
    pub(in crate::engine) packet: Packet,
}

/// What a connected requester does next.
pub(in crate::engine) enum Next {
    /// Nothing now: waiting out an RNR NAK, the window is full, or nothing is queued.
    Nothing,
    /// Send this packet again (a retransmission pass is under way).
    Resend(Packet),
    /// Send work request `idx`'s next packet.
    New(usize),
}

/// What a READ response packet means to the requester ([`Requester::read_response_for`]).
#[derive(Debug, PartialEq, Eq)]
pub(in crate::engine) struct ReadResponse {
    /// The READ it is the next expected response of: place it.
    pub(in crate::engine) place: Option<usize>,
    /// A READ one of whose responses went missing: ask it again now from there.
    pub(in crate::engine) ask_again: Option<usize>,
}

/// What the retransmission timer decided.
#[derive(Debug, PartialEq, Eq)]
pub(in crate::engine) enum Timer {
    Quiet,
    /// Resend everything unacknowledged.
    Resend,
    /// The retry count is used up: the head work request fails.
    Exhausted,
}

/// Where the QP's packets go and how they are cut: what the requester needs of its QP.
pub(in crate::engine) struct Route {
    pub(in crate::engine) qpn: u32,
    pub(in crate::engine) dest_qpn: u32,
    pub(in crate::engine) mtu: u32,
    pub(in crate::engine) xrc: bool,
    /// UC: nothing is acknowledged or resent; a message is complete once sent.
    pub(in crate::engine) uc: bool,
}

/// A data packet built ([`Requester::data_packet`]).
pub(in crate::engine) struct Built {
    pub(in crate::engine) packet: Packet,
    /// A UC message's last packet: its work request is complete (up to this PSN).
    pub(in crate::engine) uc_done: Option<u32>,
}

pub(in crate::engine) struct Requester {
    pub(in crate::engine) sq: VecDeque<SqWqe>,
    /// The next work request to build packets of, and how far into it.
    pub(in crate::engine) sq_next: usize,
    pub(in crate::engine) sq_off: u32,
    pub(in crate::engine) next_psn: u32,
    /// Packets sent since the last one that asked for an ACK.
    since_ackreq: u32,
    pub(in crate::engine) inflight: VecDeque<Inflight>,
    /// A retransmission pass: the index into `inflight` it resends next.
    pub(in crate::engine) resend: Option<usize>,
    pub(in crate::engine) last_progress: Instant,
    pub(in crate::engine) retries: u32,
    rnr_retries: u32,
    rnr_until: Option<Instant>,
}

/// The completion of a work request that did not succeed.
fn failed(w: &SqWqe, qpn: u32, status: i32) -> IbvWc {
    IbvWc {
        wr_id: w.wr.wr_id,
        status,
        opcode: send_wc_opcode(w.wr.opcode),
        qp_num: qpn,
        ..Default::default()
    }
}

fn send_wc_opcode(wr_opcode: i32) -> i32 {
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

/// Payload of an atomic request: the compare/add operand and the swap value, little endian.
pub(in crate::engine) fn atomic_operands(compare_add: u64, swap: u64) -> Vec<u8> {
    let mut v = Vec::with_capacity(16);
    v.extend_from_slice(&compare_add.to_le_bytes());
    v.extend_from_slice(&swap.to_le_bytes());
    v
}

/// RNR NAK timer values (IBTA table, in ms; 0 means 655.36 ms).
pub(in crate::engine) fn rnr_delay(code: u8) -> Duration {
    const US: [u64; 32] = [
        655_360, 10, 20, 30, 40, 60, 80, 120, 160, 240, 320, 480, 640, 960, 1_280, 1_920, 2_560,
        3_840, 5_120, 7_680, 10_240, 15_360, 20_480, 30_720, 40_960, 61_440, 81_920, 122_880,
        163_840, 245_760, 327_680, 491_520,
    ];
    Duration::from_micros(US[(code & 31) as usize])
}

/// Where a READ response goes ([`Requester::read_target`]).
pub(in crate::engine) struct ReadTarget<'a> {
    pub(in crate::engine) segs: &'a [(u64, u64)],
    pub(in crate::engine) offset: u32,
    pub(in crate::engine) len: u32,
    pub(in crate::engine) last: bool,
}

/// READ `w`'s `request` rewritten to ask from its next expected response on.
fn rest_of_read(w: &SqWqe, request: &Packet) -> Packet {
    let done = psn_diff(w.resp_next, w.first_psn) as u32 * w.resp_mtu;
    Packet {
        psn: w.resp_next,
        remote_addr: w.wr.remote_addr + u64::from(done),
        msg_len: w.len - done,
        ..request.clone()
    }
}

/// How many READs and atomics may wait for responses at once: the QP's `max_rd_atomic`, at
/// least one (so a QP configured with 0 still makes progress).
pub(in crate::engine) fn rd_atomic_limit(max_rd_atomic: u8) -> usize {
    usize::from(max_rd_atomic).max(1)
}

impl Requester {
    pub(in crate::engine) fn new(now: Instant) -> Self {
        Requester {
            sq: VecDeque::new(),
            sq_next: 0,
            sq_off: 0,
            next_psn: 0,
            since_ackreq: 0,
            inflight: VecDeque::new(),
            resend: None,
            last_progress: now,
            retries: 0,
            rnr_retries: 0,
            rnr_until: None,
        }
    }

    /// Work requests queued that have not been sent whole yet.
    pub(in crate::engine) fn has_unsent(&self) -> bool {
        self.sq_next < self.sq.len()
    }

    /// Drop the send queue and everything in flight (a reset: nothing completes).
    pub(in crate::engine) fn clear(&mut self) {
        self.sq.clear();
        self.inflight.clear();
        self.sq_next = 0;
        self.sq_off = 0;
        self.resend = None;
    }

    /// Empty the send queue into flush-error completions, in order (the QP entered the error
    /// state).
    pub(in crate::engine) fn flush(&mut self, qpn: u32) -> Vec<IbvWc> {
        let wcs = self
            .sq
            .iter()
            .map(|w| failed(w, qpn, IBV_WC_WR_FLUSH_ERR))
            .collect();
        self.clear();
        wcs
    }

    /// Take work request `idx` out with an error completion: the head (0) when a response or
    /// the timer failed it, or one whose building failed locally. Either way the engine then
    /// flushes the QP (what is before a failed build completes only once acknowledged, which
    /// will not come), as hardware moves it to the error state.
    pub(in crate::engine) fn fail_at(
        &mut self,
        idx: usize,
        qpn: u32,
        status: i32,
    ) -> Option<IbvWc> {
        self.sq.remove(idx).map(|w| failed(&w, qpn, status))
    }

    /// The NIC's fetch unit reads work request `idx` unless it already did: it and the rest
    /// of its `ibv_post_send` list, up to `batch` work requests (see `nic::fetch_count`).
    /// Returns how many it read and their bytes (None: nothing to read).
    pub(in crate::engine) fn fetch(&mut self, idx: usize, batch: u32) -> Option<(u32, u64)> {
        if self.sq.get(idx).is_none_or(|w| w.fetched) {
            return None;
        }
        let n = crate::nic::fetch_count(self.sq.iter().skip(idx).map(|w| w.doorbell), batch);
        let mut bytes = 0u64;
        for w in self.sq.iter_mut().skip(idx).take(n as usize) {
            w.fetched = true;
            bytes += u64::from(w.len);
        }
        Some((n, bytes))
    }

    /// Keep a sent packet until it is acknowledged. The retransmission timer runs only
    /// while something is unacknowledged, so the first packet after an idle spell starts
    /// it: timed from the last acknowledgement instead, a QP idle for longer than its
    /// timeout resent its first packets at once (a gated QP of the shim, idle for seconds
    /// between its turns, resent every turn).
    fn track(&mut self, sent: Inflight, now: Instant) {
        if self.inflight.is_empty() {
            self.last_progress = now;
        }
        self.inflight.push_back(sent);
    }

    /// Drop the in-flight copy of a request whose response arrived, keeping a retransmission
    /// pass that is under way on the entries after it.
    fn remove_inflight(&mut self, psn: u32) {
        if let Some(i) = self.inflight.iter().position(|f| f.psn == psn) {
            self.inflight.remove(i);
            if let Some(r) = self.resend.as_mut() {
                if i < *r {
                    *r -= 1;
                }
            }
        }
    }

    /// What a connected QP sends next: the rest of an RNR wait, a retransmission, or a new
    /// work request's packet (within the window).
    pub(in crate::engine) fn next(&mut self, now: Instant) -> Next {
        if let Some(t) = self.rnr_until {
            if now < t {
                return Next::Nothing;
            }
            self.rnr_until = None;
            self.resend = Some(0);
        }
        if let Some(i) = self.resend {
            if let Some(f) = self.inflight.get(i) {
                self.resend = Some(i + 1);
                return Next::Resend(f.packet.clone());
            }
            self.resend = None;
        }
        if self.inflight.len() >= WINDOW || !self.has_unsent() {
            return Next::Nothing;
        }
        Next::New(self.sq_next)
    }

    /// RDMA READs and atomics sent that still hold the responder's resources (IBTA's
    /// outstanding read/atomic depth): a READ until its last response arrived, an atomic
    /// until it completes. An atomic whose response came early (the response to an earlier
    /// atomic was lost) still counts until it completes in order: otherwise the QP would go
    /// on issuing atomics behind the lost one, and by the time that one is resent the
    /// responder's result cache would no longer hold it.
    pub(in crate::engine) fn reads_atomics_outstanding(&self) -> usize {
        self.sq
            .iter()
            .take(self.sq_next)
            .filter(|w| {
                proto::is_atomic_wr(w.wr.opcode)
                    || (w.wr.opcode == IBV_WR_RDMA_READ && !w.resp_done)
            })
            .count()
    }

    /// Whether work request `idx` is a READ or atomic that must wait: as on hardware, at
    /// most `max_rd_atomic` (at least one) READs and atomics wait for their responses, no
    /// more than the responder has resources for (a READ beyond them was dropped there and
    /// came back only after a retransmission timeout), and every atomic stays within the
    /// responder's result cache.
    pub(in crate::engine) fn request_must_wait(&self, idx: usize, max_rd_atomic: u8) -> bool {
        self.sq[idx].is_request()
            && self.reads_atomics_outstanding() >= rd_atomic_limit(max_rd_atomic)
    }

    /// The local buffers work request `idx` needs resolved before its first packet, and
    /// whether they are written (READ and atomics write the data, the original value).
    pub(in crate::engine) fn unresolved(&self, idx: usize) -> Option<(&[proto::Sge], bool)> {
        let w = &self.sq[idx];
        (self.sq_off == 0 && !w.packetized && w.wr.inline.is_none())
            .then(|| (&w.wr.sges[..], w.is_request()))
    }

    pub(in crate::engine) fn resolved(&mut self, idx: usize, segs: Vec<(u64, u64)>) {
        self.sq[idx].segs = segs;
    }

    /// The header every packet of work request `idx` starts from.
    fn header(&self, idx: usize, route: &Route) -> Packet {
        let w = &self.sq[idx];
        let mut p = Packet {
            dst_qpn: route.dest_qpn,
            src_qpn: route.qpn,
            psn: self.next_psn,
            msg_len: w.len,
            offset: self.sq_off,
            imm: w.wr.imm,
            remote_addr: w.wr.remote_addr,
            rkey: w.wr.rkey,
            ..Default::default()
        };
        if route.xrc {
            p.flags |= wire::F_XRC;
            p.srqn = w.wr.xrc_srqn;
        }
        p
    }

    /// Whether work request `idx` is a READ or an atomic: one request packet answered by
    /// response packets ([`Self::request_packet`]) rather than data packets.
    pub(in crate::engine) fn is_request(&self, idx: usize) -> bool {
        self.sq[idx].is_request()
    }

    /// The request packet of READ or atomic `idx` (READ: one PSN per response packet;
    /// atomic: one PSN, one 8-byte response), kept until its response arrives.
    pub(in crate::engine) fn request_packet(
        &mut self,
        idx: usize,
        route: &Route,
        now: Instant,
    ) -> Packet {
        let mut p = self.header(idx, route);
        let psn = p.psn;
        let w = &mut self.sq[idx];
        let n = if w.wr.opcode == IBV_WR_RDMA_READ {
            p.op = wire::OP_READ_REQ;
            w.resp_mtu = route.mtu;
            w.len.div_ceil(route.mtu).max(1)
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
        let last_psn = w.last_psn;
        self.next_psn = psn_add(psn, n);
        self.sq_next += 1;
        let sent = Inflight {
            psn,
            last_psn,
            needs_resp: true,
            packet: p.clone(),
        };
        self.track(sent, now);
        p
    }

    /// The range of work request `idx`'s message its next packet needs read from the process
    /// (offset, bytes), when the bytes staged so far do not hold it: the next
    /// [`STAGE_BYTES`], at least the packet. None: inline data, or already staged.
    pub(in crate::engine) fn to_stage(&self, idx: usize, mtu: u32) -> Option<(u32, usize)> {
        let w = &self.sq[idx];
        let off = self.sq_off;
        let chunk = (w.len - off).min(mtu);
        let staged_end = w.staged_at + w.staged.len() as u32;
        let covered = off >= w.staged_at && off + chunk <= staged_end;
        (w.wr.inline.is_none() && !covered)
            .then(|| (off, (w.len - off).min(STAGE_BYTES).max(chunk) as usize))
    }

    /// Bytes of work request `idx`'s message from offset `at`: a new buffer (the packets
    /// sent so far still share the old one).
    pub(in crate::engine) fn staged(&mut self, idx: usize, at: u32, bytes: Vec<u8>) {
        let w = &mut self.sq[idx];
        w.staged = bytes.into();
        w.staged_at = at;
    }

    /// The next data packet of SEND or WRITE `idx` (its bytes staged, see
    /// [`Self::to_stage`]); `auss`: mark the message's last packet when the queue then runs
    /// dry (Dart's idle hint).
    pub(in crate::engine) fn data_packet(
        &mut self,
        idx: usize,
        route: &Route,
        auss: bool,
        now: Instant,
    ) -> Built {
        let mut p = self.header(idx, route);
        let psn = p.psn;
        let off = self.sq_off;
        let w = &mut self.sq[idx];
        let chunk = (w.len - off).min(route.mtu);
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
        self.since_ackreq += 1;
        if last || self.since_ackreq >= ACKREQ_EVERY {
            p.flags |= wire::F_ACKREQ;
            self.since_ackreq = 0;
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
            self.sq_next += 1;
            self.sq_off = 0;
            if auss && !self.has_unsent() {
                p.flags |= wire::F_IDLE;
            }
        } else {
            self.sq_off = off + chunk;
        }
        self.next_psn = psn_add(psn, 1);
        if route.uc {
            let uc_done = last.then_some(psn);
            return Built { packet: p, uc_done };
        }
        let sent = Inflight {
            psn,
            last_psn: psn,
            needs_resp: false,
            packet: p.clone(),
        };
        self.track(sent, now);
        Built {
            packet: p,
            uc_done: None,
        }
    }

    /// Work request `idx` went out as one packet (a datagram, a raw frame): complete once
    /// sent. Returns its PSN.
    pub(in crate::engine) fn sent_whole(&mut self, idx: usize) -> u32 {
        let psn = self.next_psn;
        let w = &mut self.sq[idx];
        w.packetized = true;
        w.first_psn = psn;
        w.last_psn = psn;
        self.sq_next += 1;
        self.next_psn = psn_add(psn, 1);
        psn
    }

    /// Window bind or invalidation `idx` took effect: it completes once everything before it
    /// has. Returns whether nothing is before it (no acknowledgement will come to complete it).
    pub(in crate::engine) fn executed_local(&mut self, idx: usize) -> bool {
        self.sq[idx].packetized = true;
        self.sq_next += 1;
        idx == 0
    }

    /// Pop the completed work requests from the head of the send queue, in order: the
    /// signalled ones' completions. `acked`: the latest PSN acknowledged.
    pub(in crate::engine) fn completions(&mut self, qpn: u32, acked: u32) -> Vec<IbvWc> {
        let mut wcs = Vec::new();
        while let Some(w) = self.sq.front() {
            if !w.packetized {
                break;
            }
            let done = if proto::is_local_wr(w.wr.opcode) {
                // Executed when the transmitter reached it; done once all before it are.
                true
            } else if w.is_request() {
                w.resp_done
            } else {
                // Acknowledged by this ACK, or by an earlier one: an ACK that covered the WQE
                // while a READ ahead of it still waited for its response took its packets
                // out of `inflight` but could not complete it (completions are in order),
                // and no later ACK need ever come.
                psn_diff(acked, w.last_psn) >= 0
                    || !self.inflight.iter().any(|f| {
                        psn_diff(f.last_psn, w.first_psn) >= 0 && psn_diff(f.psn, w.last_psn) <= 0
                    })
            };
            if !done {
                break;
            }
            let w = self.sq.pop_front().expect("the front was just seen");
            self.sq_next -= 1;
            if w.signaled {
                wcs.push(IbvWc {
                    wr_id: w.wr.wr_id,
                    status: IBV_WC_SUCCESS,
                    opcode: send_wc_opcode(w.wr.opcode),
                    // READ: the bytes read; atomics: the 8 bytes of the original value.
                    byte_len: if w.is_request() { w.len } else { 0 },
                    qp_num: qpn,
                    ..Default::default()
                });
            }
        }
        wcs
    }

    /// A cumulative acknowledgement up to `psn` (inclusive): the packets it covers leave the
    /// window (requests stay until their responses), and progress resets the retry counts.
    pub(in crate::engine) fn acknowledge(&mut self, psn: u32, now: Instant) {
        let before = self.inflight.len();
        self.inflight
            .retain(|f| f.needs_resp || psn_diff(psn, f.last_psn) < 0);
        let gone = before - self.inflight.len();
        if gone != 0 {
            self.progress(now);
            self.rnr_retries = 0;
            if let Some(r) = self.resend {
                self.resend = Some(r.saturating_sub(gone));
            }
        }
    }

    fn progress(&mut self, now: Instant) {
        self.last_progress = now;
        self.retries = 0;
    }

    /// The retransmission timer of an RTS QP: `timeout` without progress while something is
    /// unacknowledged (and no RNR wait) resends it, up to `retry_cnt` times.
    pub(in crate::engine) fn timer(
        &mut self,
        now: Instant,
        timeout: Duration,
        retry_cnt: u8,
    ) -> Timer {
        if self.inflight.is_empty()
            || self.rnr_until.is_some()
            || now.duration_since(self.last_progress) < timeout
        {
            return Timer::Quiet;
        }
        self.retries += 1;
        self.last_progress = now;
        if self.retries > u32::from(retry_cnt) {
            Timer::Exhausted
        } else {
            self.refresh_read_requests();
            self.resend = Some(0);
            Timer::Resend
        }
    }

    /// The kept copy of every READ under way asks only for what has not arrived: a timeout
    /// after its last responses were lost resends the rest, not the whole READ.
    fn refresh_read_requests(&mut self) {
        for w in self.sq.iter() {
            if w.wr.opcode != IBV_WR_RDMA_READ || !w.packetized || w.resp_done {
                continue;
            }
            if let Some(kept) = self.inflight.iter_mut().find(|f| f.psn == w.first_psn) {
                kept.packet = rest_of_read(w, &kept.packet);
            }
        }
    }

    /// Whether a response or acknowledgement for `psn` can be meant for this requester:
    /// within [oldest unacknowledged, next PSN).
    pub(in crate::engine) fn expects(&self, psn: u32) -> bool {
        self.inflight
            .front()
            .is_some_and(|f| psn_diff(psn, f.psn) >= 0 && psn_diff(psn, self.next_psn) < 0)
    }

    /// What a READ response with `psn` means. A response is placed only if it is the next
    /// its READ expects. One beyond the next expected response of the oldest READ still
    /// waiting (in that READ, or of a later READ: the responder answers in order) shows that
    /// response was lost or overtaken: that READ is asked again from there at once, as an RC
    /// requester does on a sequence error in READ responses, once per PSN it waits for
    /// (the timer covers a lost repeat). Waiting for the timer instead cost a whole timeout
    /// per lost response (a 1 MiB READ is 225 packets: two or three under 1 % loss), and
    /// drum-kv clients gave up. None: no READ has `psn`.
    pub(in crate::engine) fn read_response_for(&self, psn: u32) -> Option<ReadResponse> {
        // One pass: the oldest READ still waiting comes at or before the one with `psn`.
        let (mut oldest, mut found) = (None, None);
        for (i, w) in self.sq.iter().enumerate() {
            if !w.packetized || w.wr.opcode != IBV_WR_RDMA_READ {
                continue;
            }
            if oldest.is_none() && !w.resp_done {
                oldest = Some(i);
            }
            if psn_diff(psn, w.first_psn) >= 0 && psn_diff(psn, w.last_psn) <= 0 {
                found = Some(i);
                break;
            }
        }
        let idx = found?;
        let w = &self.sq[idx];
        let place = (!w.resp_done && psn == w.resp_next).then_some(idx);
        let ask_again = oldest.filter(|&o| {
            let oldest = &self.sq[o];
            let beyond = o < idx || psn_diff(psn, oldest.resp_next) > 0;
            beyond && oldest.asked_from != Some(oldest.resp_next)
        });
        Some(ReadResponse { place, ask_again })
    }

    /// The request for the rest of READ `idx`, from its next expected response: its PSN,
    /// the remote address and length advanced by what arrived. It also replaces the
    /// READ's copy kept for retransmission.
    pub(in crate::engine) fn ask_again(&mut self, idx: usize) -> Option<Packet> {
        let w = &mut self.sq[idx];
        w.asked_from = Some(w.resp_next);
        let w = &self.sq[idx];
        let kept = self.inflight.iter_mut().find(|f| f.psn == w.first_psn)?;
        kept.packet = rest_of_read(w, &kept.packet);
        Some(kept.packet.clone())
    }

    /// Where READ `idx`'s response `psn` goes: its local segments, the offset in them
    /// (from the PSN, never from the packet), the payload length it must have, and whether
    /// it is the READ's last response.
    pub(in crate::engine) fn read_target(&self, idx: usize, psn: u32) -> ReadTarget<'_> {
        let w = &self.sq[idx];
        let offset = psn_diff(psn, w.first_psn) as u32 * w.resp_mtu;
        ReadTarget {
            segs: &w.segs,
            offset,
            len: (w.len - offset).min(w.resp_mtu),
            last: psn == w.last_psn,
        }
    }

    /// READ `idx`'s response `psn` is placed. A response implicitly acknowledges everything
    /// before the READ; the last one completes the READ itself. Returns the PSN acknowledged
    /// (see [`Self::acknowledge`]).
    pub(in crate::engine) fn read_response_placed(
        &mut self,
        idx: usize,
        psn: u32,
        now: Instant,
    ) -> u32 {
        let w = &mut self.sq[idx];
        w.resp_next = psn_add(psn, 1);
        let first = w.first_psn;
        let done = psn == w.last_psn;
        if done {
            w.resp_done = true;
            self.remove_inflight(first);
        }
        self.progress(now);
        if done {
            psn
        } else {
            psn_add(first, wire::PSN_MASK)
        }
    }

    /// The atomic a response with `psn` answers (Err: a duplicate or malformed response,
    /// which the timer recovers; None: no such atomic).
    pub(in crate::engine) fn atomic_for(&self, psn: u32, payload_len: usize) -> Result<usize, ()> {
        let idx = self
            .sq
            .iter()
            .position(|w| w.packetized && proto::is_atomic_wr(w.wr.opcode) && w.first_psn == psn)
            .ok_or(())?;
        let w = &self.sq[idx];
        if w.resp_done || payload_len != 8 {
            return Err(());
        }
        Ok(idx)
    }

    /// Atomic `idx`'s local buffer (where the original value goes).
    pub(in crate::engine) fn segments(&self, idx: usize) -> &[(u64, u64)] {
        &self.sq[idx].segs
    }

    /// Atomic `idx`'s response `psn` is written: it is complete, and so is everything before
    /// it (the engine then acknowledges up to `psn`).
    pub(in crate::engine) fn atomic_response_placed(&mut self, idx: usize, psn: u32, now: Instant) {
        self.sq[idx].resp_done = true;
        self.remove_inflight(psn);
        self.progress(now);
    }

    /// A sequence NAK: resend from the oldest unacknowledged packet.
    pub(in crate::engine) fn resend_all(&mut self) {
        self.resend = Some(0);
    }

    /// An RNR NAK: wait `delay`, then resend; false when `rnr_retry` (7: forever) is used up.
    pub(in crate::engine) fn rnr_nak(
        &mut self,
        now: Instant,
        delay: Duration,
        rnr_retry: u8,
    ) -> bool {
        self.rnr_retries += 1;
        if rnr_retry != 7 && self.rnr_retries > u32::from(rnr_retry) {
            return false;
        }
        self.rnr_until = Some(now + delay);
        self.last_progress = now;
        true
    }
}
