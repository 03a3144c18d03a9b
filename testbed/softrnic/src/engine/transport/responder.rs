//! A QP's responder: the PSN it expects, its receive queue and the receive a multi-packet
//! SEND is landing in, the RDMA READs it is answering, the atomics it remembers, and UC's
//! broken messages. It decides what an arriving request's sequence means and builds READ
//! responses from bytes the engine read; the engine (`engine::responder`) checks keys,
//! places data and posts completions.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::time::Instant;

use drum_verbs_abi::consts::*;
use drum_verbs_abi::IbvWc;

use crate::device;
use crate::proto::RecvWr;
use crate::wire::{self, psn_add, psn_diff, Packet};

/// Atomic results a responder QP remembers by PSN, so that a retransmitted atomic request is
/// answered from here instead of being executed twice (IBTA's responder resources). Twice the
/// most any requester may have outstanding (`max_rd_atomic` ≤ [`device::MAX_RD_ATOM`]): every
/// request a requester can still retransmit is among the last this many executed.
pub(in crate::engine) const ATOMIC_CACHE: usize = 2 * device::MAX_RD_ATOM as usize;
/// Most READs a QP answers at once (a requester keeps at most `max_rd_atomic` of them
/// outstanding; a device allows 16): beyond, requests wait for the requester's retry.
const MAX_READ_JOBS: usize = 64;

/// The receive a multi-packet SEND is being written into: where its buffers are (the
/// process of its queue's owner — for an XRC SRQ not the target QP's) and its CQ.
pub(in crate::engine) struct CurRecv {
    pub(in crate::engine) wr_id: u64,
    pub(in crate::engine) segs: Vec<(u64, u64)>,
    pub(in crate::engine) pid: i32,
    pub(in crate::engine) cq: u32,
}

/// An RDMA READ being answered: packet `next` of `n` goes out next.
pub(in crate::engine) struct ReadJob {
    pub(in crate::engine) to: SocketAddr,
    pub(in crate::engine) peer_qpn: u32,
    pub(in crate::engine) psn: u32,
    pub(in crate::engine) msg_len: u32,
    pub(in crate::engine) mtu: u32,
    /// Where the READ's bytes are: the process and its address.
    pub(in crate::engine) pid: i32,
    pub(in crate::engine) base: u64,
    pub(in crate::engine) next: u32,
    pub(in crate::engine) n: u32,
}

impl ReadJob {
    /// A READ request `p` from `to` of `mtu`-sized responses, its bytes at `base` in `pid`.
    pub(in crate::engine) fn new(
        to: SocketAddr,
        p: &Packet,
        mtu: u32,
        (pid, base): (i32, u64),
    ) -> Self {
        ReadJob {
            to,
            peer_qpn: p.src_qpn,
            psn: p.psn,
            msg_len: p.msg_len,
            mtu,
            pid,
            base,
            next: 0,
            n: p.msg_len.div_ceil(mtu).max(1),
        }
    }
}

/// What an arriving request's PSN means to an RC responder.
#[derive(Debug, PartialEq, Eq)]
pub(in crate::engine) enum Arrival {
    /// Before the expected PSN: already executed.
    Duplicate,
    /// After it: a packet was lost. `Some(epsn)`: send a sequence NAK for it (once until
    /// the QP makes progress).
    Ahead(Option<u32>),
    InOrder,
}

/// What an arriving UC packet means (UC never acknowledges).
#[derive(Debug, PartialEq, Eq)]
pub(in crate::engine) enum UcArrival {
    Duplicate,
    /// A packet of a message one of whose packets was lost: dropped.
    Broken,
    Apply,
}

pub(in crate::engine) struct Responder {
    pub(in crate::engine) rq: VecDeque<RecvWr>,
    pub(in crate::engine) epsn: u32,
    pub(in crate::engine) cur_recv: Option<CurRecv>,
    nak_sent: bool,
    /// RDMA READs being answered, oldest first: their response packets go out one at a time
    /// through the transmitter's arbitration, at the line rate, as a NIC's responder sends
    /// them (all at once, a 1 MiB read's 256 packets overflowed the requester's socket and
    /// every retransmission did it again).
    pub(in crate::engine) read_jobs: VecDeque<ReadJob>,
    /// When its READ responses last moved (a response left, or a job arrived at an empty
    /// queue): a responder with jobs and no movement is stalled.
    pub(in crate::engine) responded_at: Instant,
    /// (PSN, original value) of the last [`ATOMIC_CACHE`] atomics executed, oldest first.
    atomic_cache: VecDeque<(u32, u64)>,
    /// UC: discarding the rest of a message one of whose packets was lost.
    uc_broken: bool,
}

impl Responder {
    pub(in crate::engine) fn new(now: Instant) -> Self {
        Responder {
            rq: VecDeque::new(),
            epsn: 0,
            cur_recv: None,
            nak_sent: false,
            read_jobs: VecDeque::new(),
            responded_at: now,
            atomic_cache: VecDeque::new(),
            uc_broken: false,
        }
    }

    /// Drop the receives and the atomics remembered (a reset: nothing completes).
    pub(in crate::engine) fn clear(&mut self) {
        self.rq.clear();
        self.cur_recv = None;
        self.atomic_cache.clear();
    }

    /// Empty the receive queue into flush-error completions, in order, each with its CQ:
    /// the receive a SEND was landing in first, then the queue's, which complete on `rcq`.
    pub(in crate::engine) fn flush(&mut self, qpn: u32, rcq: u32) -> Vec<(u32, IbvWc)> {
        let flushed = |wr_id| IbvWc {
            wr_id,
            status: IBV_WC_WR_FLUSH_ERR,
            opcode: IBV_WC_RECV,
            qp_num: qpn,
            ..Default::default()
        };
        let landing = self.cur_recv.take().map(|c| (c.cq, flushed(c.wr_id)));
        let queued = self.rq.drain(..).map(|r| (rcq, flushed(r.wr_id)));
        landing.into_iter().chain(queued).collect()
    }

    /// An RC request with `psn` arrived.
    pub(in crate::engine) fn arrival(&mut self, psn: u32) -> Arrival {
        let d = psn_diff(psn, self.epsn);
        if d < 0 {
            Arrival::Duplicate
        } else if d > 0 {
            Arrival::Ahead((!std::mem::replace(&mut self.nak_sent, true)).then_some(self.epsn))
        } else {
            Arrival::InOrder
        }
    }

    /// The PSN before the expected one: what a duplicate is acknowledged with.
    pub(in crate::engine) fn last_received(&self) -> u32 {
        psn_add(self.epsn, wire::PSN_MASK)
    }

    /// The in-order request took `n` PSNs; returns the PSN to acknowledge.
    pub(in crate::engine) fn accepted(&mut self, n: u32) -> u32 {
        self.epsn = psn_add(self.epsn, n);
        self.nak_sent = false;
        self.last_received()
    }

    /// Whether a NAK with `syndrome` goes out: an RNR NAK once until the QP makes progress,
    /// the others always.
    pub(in crate::engine) fn nak(&mut self, syndrome: u8) -> bool {
        let send = !self.nak_sent || syndrome != wire::NAK_RNR;
        self.nak_sent |= send;
        send
    }

    /// A UC packet with `psn` arrived (`first`: of its message). A gap (a lost packet) drops
    /// the rest of its message: packets are discarded until the first packet of a later
    /// message, where the PSN is resynchronised.
    pub(in crate::engine) fn uc_arrival(&mut self, psn: u32, first: bool) -> UcArrival {
        let d = psn_diff(psn, self.epsn);
        if d < 0 {
            return UcArrival::Duplicate;
        }
        if d > 0 || self.uc_broken {
            if !first {
                self.uc_broken = true;
                return UcArrival::Broken;
            }
            self.uc_broken = false;
            self.epsn = psn;
        }
        UcArrival::Apply
    }

    /// UC packet `psn` was applied (or failed: see [`Self::uc_failed`]).
    pub(in crate::engine) fn uc_applied(&mut self, psn: u32) {
        self.epsn = psn_add(psn, 1);
    }

    /// A UC packet failed without failing its QP (no receive, access): the rest of its
    /// message, unless it was the `last` packet, is dropped.
    pub(in crate::engine) fn uc_failed(&mut self, last: bool) {
        self.uc_broken = !last;
    }

    /// A UC message's data could not be placed: its remaining packets are dropped.
    pub(in crate::engine) fn uc_break(&mut self) {
        self.uc_broken = true;
    }

    /// Remember atomic `psn`'s original value for its retransmissions.
    pub(in crate::engine) fn executed_atomic(&mut self, psn: u32, orig: u64) {
        if self.atomic_cache.len() >= ATOMIC_CACHE {
            self.atomic_cache.pop_front();
        }
        self.atomic_cache.push_back((psn, orig));
    }

    /// The original value atomic `psn` returned, while it is remembered.
    pub(in crate::engine) fn executed_value(&self, psn: u32) -> Option<u64> {
        self.atomic_cache
            .iter()
            .find(|(p, _)| *p == psn)
            .map(|&(_, orig)| orig)
    }

    /// Queue READ `job`, in PSN order. A request for a READ being answered (the same last
    /// PSN) is the requester asking again for what it is missing, from the request's PSN
    /// on: it replaces that READ's job (never answered twice) and the other READs' jobs
    /// stay, as the requester asks again only for the READ it misses (or, after a timeout,
    /// for each of them, each replacing its own).
    pub(in crate::engine) fn queue_read(&mut self, job: ReadJob, now: Instant) {
        let end = |j: &ReadJob| psn_add(j.psn, j.n);
        if let Some(i) = self.read_jobs.iter().position(|j| end(j) == end(&job)) {
            if i == 0 {
                self.responded_at = now;
            }
            self.read_jobs[i] = job;
            return;
        }
        if self.read_jobs.len() >= MAX_READ_JOBS {
            return;
        }
        if self.read_jobs.is_empty() {
            self.responded_at = now;
        }
        let at = self
            .read_jobs
            .iter()
            .position(|j| psn_diff(j.psn, job.psn) > 0)
            .unwrap_or(self.read_jobs.len());
        self.read_jobs.insert(at, job);
    }

    /// What the oldest READ's next response carries: (process, address, bytes).
    pub(in crate::engine) fn next_read(&self) -> Option<(i32, u64, u32)> {
        let j = self.read_jobs.front()?;
        let off = j.next * j.mtu;
        Some((j.pid, j.base + u64::from(off), (j.msg_len - off).min(j.mtu)))
    }

    /// The oldest READ's next response from `qpn`, carrying `payload` (read as
    /// [`Self::next_read`] said); None for the payload: the memory is gone (deregistered, the
    /// process ended), and the READ ends with a remote access NAK.
    pub(in crate::engine) fn read_response(
        &mut self,
        qpn: u32,
        payload: Option<Vec<u8>>,
        now: Instant,
    ) -> Option<(SocketAddr, Packet)> {
        let j = self.read_jobs.front_mut()?;
        let to = j.to;
        let (r, done) = match payload {
            Some(payload) => {
                let r = Packet {
                    op: wire::OP_READ_RESP,
                    flags: if j.next + 1 == j.n { wire::F_LAST } else { 0 },
                    dst_qpn: j.peer_qpn,
                    src_qpn: qpn,
                    psn: psn_add(j.psn, j.next),
                    msg_len: j.msg_len,
                    offset: j.next * j.mtu,
                    payload: payload.into(),
                    ..Default::default()
                };
                j.next += 1;
                (r, j.next == j.n)
            }
            None => {
                let nak = Packet {
                    op: wire::OP_NAK,
                    syndrome: wire::NAK_REM_ACCESS,
                    dst_qpn: j.peer_qpn,
                    src_qpn: qpn,
                    psn: j.psn,
                    ..Default::default()
                };
                (nak, true)
            }
        };
        if done {
            self.read_jobs.pop_front();
        }
        self.responded_at = now;
        Some((to, r))
    }
}
