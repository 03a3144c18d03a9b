//! The shim's record of each QP, kept per context in a fixed table so that the data path never
//! takes a lock or allocates to find it: its counters (lock-free, updated by whichever
//! threads post and poll), its governance state under its own lock (software send queue,
//! work in flight, peer, the `ibv_wr_*` batch being built, NIC pacing), and the provider's
//! `ibv_wr_*` ops when the shim wraps them (`wr_api`).

use crate::cap_route::Route;
use crate::inflight::InFlight;
use crate::limits::TRACKING_EPOCH;
use crate::sendq::OwnedWr;
use crate::wr_batch::{Batch, EX_OPS};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::Mutex;

/// Governance state of one QP (in its record, under its mutex).
#[derive(Default)]
pub struct QpGov {
    /// The application's `struct ibv_qp *` (0 until it posts or after it is destroyed).
    pub qp: usize,
    pub queue: VecDeque<OwnedWr>,
    pub inflight: InFlight,
    /// Created with `sq_sig_all`: every WR completes.
    pub sig_all: bool,
    /// Its peer's GID, once connected (RTR).
    pub peer: Option<[u8; 16]>,
    /// What it keeps of its peer's cap (`cap_route`).
    pub route: Route,
    /// Long messages under way (announced to the receiver's agent).
    pub busy: bool,
    /// The `ibv_wr_*` batch being built (`wr_api`).
    pub ex_batch: Batch,
    /// Its path MTU in bytes (0: not set yet).
    pub path_mtu: u32,
    /// Packet pacing on the NIC (`nic_pace`): the application set its own, which the shim
    /// leaves alone; the rate the shim last asked for, and whether the NIC took it.
    pub app_paced: bool,
    /// The peer may read (or do atomics) through it: READ responses leave the NIC through
    /// this QP and belong to the reader's grant, so the shim does not pace it on the NIC.
    pub serves_reads: bool,
    pub nic_kbps: Option<u32>,
    pub nic_paced: bool,
}

impl QpGov {
    /// Its peer and its route to the peer's cap, for `limits::admit`.
    pub fn dest(&mut self) -> Option<([u8; 16], &mut Route)> {
        self.peer.map(|p| (p, &mut self.route))
    }
}

/// The record of one QP, keyed by its QP number: its counters, governance state and wrapped
/// `ibv_wr_*` ops.
#[derive(Default)]
pub struct QpRecord {
    /// QP number + 1; 0 = free slot (QP number 0 exists in IB, so it cannot be the marker).
    key: AtomicU64,
    pub send_wqes: AtomicU64,
    pub send_bytes: AtomicU64,
    /// Of `send_bytes`, those of RDMA READs: their data comes back from the peer, so it loads
    /// this host's receive link rather than the peer's (reported to the agent, `BYTES`).
    pub read_bytes: AtomicU64,
    pub recv_wqes: AtomicU64,
    pub completions: AtomicU64,
    /// Taken only when the QP is governed (limits or tracking in force, or work queued).
    pub gov: Mutex<QpGov>,
    /// WRs in the software queue: lets the ungoverned fast path see, without the lock, that
    /// it must not overtake them.
    pub queued: AtomicU64,
    /// Listed for the engine thread.
    pub pending: AtomicBool,
    /// The provider's `ibv_wr_*` ops of this QP, when the shim wraps them (`wr_api`).
    pub ex: [AtomicUsize; EX_OPS],
}

/// Per-QP records in a fixed open-addressing table, so that the data path never takes a
/// lock or allocates. QPs beyond its capacity are counted only in the context's totals
/// (`overflow()` says how often that happened). QP numbers reused after `ibv_destroy_qp`
/// share a slot (their governance state is reset when the old QP is destroyed).
pub struct QpTable {
    slots: Box<[QpRecord]>,
    overflow: AtomicU64,
}

impl QpTable {
    pub fn with_capacity(n: usize) -> QpTable {
        let n = n.max(1).next_power_of_two();
        QpTable {
            slots: (0..n).map(|_| QpRecord::default()).collect(),
            overflow: AtomicU64::new(0),
        }
    }

    /// The counters of QP `qpn`, claiming a slot on first use; `None` when the table is full.
    pub fn get(&self, qpn: u32) -> Option<&QpRecord> {
        let key = u64::from(qpn) + 1;
        let mask = self.slots.len() - 1;
        let start = Self::home(qpn) & mask;
        for i in 0..self.slots.len() {
            let slot = &self.slots[(start + i) & mask];
            let k = slot.key.load(Relaxed);
            if k == key {
                return Some(slot);
            }
            if k == 0 {
                match slot.key.compare_exchange(0, key, Relaxed, Relaxed) {
                    Ok(_) => return Some(slot),
                    Err(other) if other == key => return Some(slot),
                    Err(_) => continue,
                }
            }
        }
        self.overflow.fetch_add(1, Relaxed);
        None
    }

    /// Every QP seen so far: (QP number, send WQEs, send bytes, recv WQEs, completions).
    pub fn entries(&self) -> Vec<(u32, u64, u64, u64, u64)> {
        self.live()
            .map(|(qpn, s)| {
                (
                    qpn,
                    s.send_wqes.load(Relaxed),
                    s.send_bytes.load(Relaxed),
                    s.recv_wqes.load(Relaxed),
                    s.completions.load(Relaxed),
                )
            })
            .collect()
    }

    /// Every QP seen so far with its counters.
    pub fn live(&self) -> impl Iterator<Item = (u32, &QpRecord)> {
        self.slots.iter().filter_map(|s| {
            let k = s.key.load(Relaxed);
            (k != 0).then(|| ((k - 1) as u32, s))
        })
    }

    /// The counters of QP `qpn` if it has a slot; unlike [`get`](Self::get), never claims
    /// one.
    fn find(&self, qpn: u32) -> Option<&QpRecord> {
        let key = u64::from(qpn) + 1;
        let mask = self.slots.len() - 1;
        let start = Self::home(qpn) & mask;
        // Slots are never given back, so the probe that `get` would make ends at the QP's
        // slot or at a free one.
        (0..self.slots.len())
            .map(|i| &self.slots[(start + i) & mask])
            .take_while(|s| s.key.load(Relaxed) != 0)
            .find(|s| s.key.load(Relaxed) == key)
    }

    /// Bytes posted on QP `qpn` so far, `(towards the peer, read from it)`; `None` for a QP
    /// without a slot.
    pub fn bytes(&self, qpn: u32) -> Option<(u64, u64)> {
        self.find(qpn).map(|s| {
            let (all, read) = (s.send_bytes.load(Relaxed), s.read_bytes.load(Relaxed));
            (all.saturating_sub(read), read)
        })
    }

    /// Where QP `qpn`'s probe starts (before masking): Fibonacci hashing spreads the (often
    /// consecutive) QP numbers.
    fn home(qpn: u32) -> usize {
        (u64::from(qpn).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32) as usize
    }

    /// WRs held in the software queues of all QPs.
    pub fn queued(&self) -> u64 {
        self.slots.iter().map(|s| s.queued.load(Relaxed)).sum()
    }

    /// WRs in flight on the NIC over the QPs whose governance state tracks them; a QP whose
    /// lock is busy this instant is skipped (the reading is a gauge, never worth a wait).
    pub fn outstanding(&self) -> u64 {
        self.slots
            .iter()
            .filter(|s| s.key.load(Relaxed) != 0)
            .filter_map(|s| {
                s.gov
                    .try_lock()
                    .ok()
                    .map(|g| g.inflight.outstanding_in(TRACKING_EPOCH.load(Relaxed)))
            })
            .sum()
    }

    pub fn overflow(&self) -> u64 {
        self.overflow.load(Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn qp_table_finds_claims_and_overflows() {
        let t = QpTable::with_capacity(4);
        for q in [0u32, 7, 0xFF_FFFF, 42] {
            t.get(q)
                .unwrap()
                .send_wqes
                .fetch_add(u64::from(q) + 1, Relaxed);
        }
        assert!(t.get(5).is_none(), "fifth QP in a 4-slot table");
        assert_eq!(t.overflow(), 1);
        let mut e = t.entries();
        e.sort();
        let got: Vec<(u32, u64)> = e.iter().map(|e| (e.0, e.1)).collect();
        assert_eq!(got, vec![(0, 1), (7, 8), (42, 43), (0xFF_FFFF, 0x100_0000)]);
        // An existing QP is still found when the table is full.
        assert_eq!(t.get(7).unwrap().send_wqes.load(Relaxed), 8);
        // Byte counts: READ bytes come back, the rest goes out; no slot is claimed.
        let q = t.get(42).unwrap();
        q.send_bytes.fetch_add(1000, Relaxed);
        q.read_bytes.fetch_add(250, Relaxed);
        assert_eq!(t.bytes(42), Some((750, 250)));
        assert_eq!(t.bytes(0), Some((0, 0)));
        let fresh = QpTable::with_capacity(4);
        assert_eq!(fresh.bytes(7), None);
        assert!(fresh.entries().is_empty());
    }

    #[test]
    fn qp_table_is_consistent_under_concurrent_first_use() {
        let t = Arc::new(QpTable::with_capacity(64));
        let hs: Vec<_> = (0..4)
            .map(|_| {
                let t = t.clone();
                std::thread::spawn(move || {
                    for i in 0..10_000u32 {
                        t.get(i % 32).unwrap().send_wqes.fetch_add(1, Relaxed);
                    }
                })
            })
            .collect();
        for h in hs {
            h.join().unwrap();
        }
        let e = t.entries();
        assert_eq!(e.len(), 32, "each QP claimed exactly one slot");
        assert_eq!(e.iter().map(|e| e.1).sum::<u64>(), 40_000);
    }
}
