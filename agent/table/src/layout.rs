//! The per-app table: one page of 64-bit atomics shared by the agent and the shim of one
//! application process.
//!
//! Every field is an `AtomicU64` with a single writer (the agent for grants, the shim for
//! counters), so a reader never sees a torn value and needs no lock; fields are independent,
//! and a reader that needs a consistent grant re-reads until `generation` is unchanged
//! around its reads (the agent bumps it after each update). The shim validates everything
//! it reads ([`Grant::validate`]): a table that is not ours, of another version, or with
//! values out of range is treated as "no agent" (fail-open), never trusted.

use crate::seqlock;
use std::sync::atomic::{AtomicU64, Ordering::Acquire, Ordering::Relaxed, Ordering::Release};

pub const MAGIC: u64 = u64::from_le_bytes(*b"DRUMTBL1");
pub const VERSION: u64 = 2;
/// Bytes the agent maps per app; the layout below must fit in it.
pub const TABLE_BYTES: usize = 4096;
/// Destinations with a DASR cap at once.
pub const MAX_PEERS: usize = 32;

/// A DASR cap towards one receiver host, identified by its GID (IPv4-mapped on RoCEv2 and
/// softrnic). `gid_hi == gid_lo == 0` marks a free entry.
#[repr(C)]
pub struct PeerCap {
    pub gid_hi: AtomicU64,
    pub gid_lo: AtomicU64,
    /// Bytes per second this app may send to that receiver (0 = no cap).
    pub cap_bytes_per_s: AtomicU64,
    /// Active unique senders the receiver counted (for reporting).
    pub senders: AtomicU64,
}

/// What the agent grants; all rates 0 = unlimited.
#[repr(C)]
pub struct GrantFields {
    /// The grant's sequence (`seqlock`): odd while the agent writes, +2 per write; the
    /// generation is half of it.
    pub generation: AtomicU64,
    /// Agent's CLOCK_MONOTONIC in ms at its last write: the shim detaches from a table
    /// whose heartbeat stops (an agent that hangs without closing its socket).
    pub heartbeat_ms: AtomicU64,
    pub rate_bytes_per_s: AtomicU64,
    pub burst_bytes: AtomicU64,
    pub rate_wqe_per_s: AtomicU64,
    /// Most QPs of the app that may have work on the NIC at once (0 = no limit).
    pub max_active_qps: AtomicU64,
    /// How long a QP keeps its slot while others wait.
    pub quantum_us: AtomicU64,
    /// Sends at least this long are announced to the receiver's agent (0 = off).
    pub long_msg_bytes: AtomicU64,
    /// Completions per second delivered to the app's CQs (its polling rate).
    pub rate_cqe_per_s: AtomicU64,
    pub peers: [PeerCap; MAX_PEERS],
}

/// What the shim reports: cumulative counters (the agent differentiates them into demand)
/// and current levels.
#[repr(C)]
pub struct ShimFields {
    pub send_wqes: AtomicU64,
    pub send_bytes: AtomicU64,
    pub completions: AtomicU64,
    /// WQEs that waited in the shim's software queues, and their total wait.
    pub deferred_wqes: AtomicU64,
    pub queue_delay_ns: AtomicU64,
    /// WQEs in the software queues now.
    pub queued_wqes: AtomicU64,
    /// Deferred posts the provider refused (each also reported on stderr once).
    pub deferred_post_errors: AtomicU64,
    pub qps: AtomicU64,
    pub active_qps: AtomicU64,
    /// The generation of the grant the shim applies.
    pub applied_generation: AtomicU64,
    /// WRs posted to the NIC and not known to be complete, over the QPs the shim tracks
    /// (those it governs): a deep backlog means the NIC, not the app, limits its rate. Added
    /// at the end of table version 2; a shim that predates it leaves it 0.
    pub nic_outstanding_wqes: AtomicU64,
    /// Polls that found completions the polling grant held back (cumulative): the app
    /// wants more than its grant even when it queues nothing. Added at the end of table
    /// version 2, like the field above.
    pub held_polls: AtomicU64,
    /// Hardware queues (QPs, CQs, SRQs, RWQs) the application asked for with
    /// `mlx5dv_init_obj` (cumulative): it can post and poll them past the shim (direct
    /// verbs). Added at the end of table version 2, like the fields above.
    pub direct_verbs_queues: AtomicU64,
}

#[repr(C)]
pub struct Table {
    pub magic: AtomicU64,
    pub version: AtomicU64,
    pub grant: GrantFields,
    pub shim: ShimFields,
}

const _: () = assert!(std::mem::size_of::<Table>() <= TABLE_BYTES);

/// The heartbeat's clock (CLOCK_MONOTONIC, ms): the agent writes it, the shim compares
/// with it, so both must read the same clock.
pub fn monotonic_ms() -> u64 {
    // SAFETY: clock_gettime into a zeroed timespec.
    let mut ts: libc::timespec = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1000 + ts.tv_nsec as u64 / 1_000_000
}

/// A grant as plain values, read consistently from a table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Grant {
    pub generation: u64,
    pub rate_bytes_per_s: u64,
    pub burst_bytes: u64,
    pub rate_wqe_per_s: u64,
    pub max_active_qps: u64,
    pub quantum_us: u64,
    pub long_msg_bytes: u64,
    pub rate_cqe_per_s: u64,
}

/// Why a table is not used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TableError {
    Magic(u64),
    Version(u64),
    Field(&'static str, u64),
    Torn,
}

impl std::fmt::Display for TableError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TableError::Magic(m) => write!(f, "not a DRUM table (magic {m:#x})"),
            TableError::Version(v) => write!(f, "table version {v}, this shim knows {VERSION}"),
            TableError::Field(n, v) => write!(f, "table field {n} = {v} is out of range"),
            TableError::Torn => write!(f, "table kept changing while being read"),
        }
    }
}

/// Upper bounds that no real grant reaches (1 Tb/s, 1e9 WQE or CQE/s, 1 M QPs, 1 h): anything
/// above is corruption, not a decision.
const MAX_RATE_BYTES: u64 = 125_000_000_000;
pub const MAX_RATE_WQE: u64 = 1_000_000_000;
const MAX_QPS: u64 = 1 << 20;
const MAX_QUANTUM_US: u64 = 3_600_000_000;

impl Grant {
    pub fn validate(&self) -> Result<(), TableError> {
        let checks = [
            ("rate_bytes_per_s", self.rate_bytes_per_s, MAX_RATE_BYTES),
            ("burst_bytes", self.burst_bytes, MAX_RATE_BYTES),
            ("rate_wqe_per_s", self.rate_wqe_per_s, MAX_RATE_WQE),
            ("max_active_qps", self.max_active_qps, MAX_QPS),
            ("quantum_us", self.quantum_us, MAX_QUANTUM_US),
            ("long_msg_bytes", self.long_msg_bytes, u64::from(u32::MAX)),
            ("rate_cqe_per_s", self.rate_cqe_per_s, MAX_RATE_WQE),
        ];
        for (name, v, max) in checks {
            if v > max {
                return Err(TableError::Field(name, v));
            }
        }
        Ok(())
    }
}

impl Table {
    /// Writes the header and zeroes everything else (agent side, before sharing).
    pub fn init(&self) {
        self.version.store(VERSION, Relaxed);
        self.magic.store(MAGIC, Release);
    }

    pub fn check_header(&self) -> Result<(), TableError> {
        let m = self.magic.load(Acquire);
        if m != MAGIC {
            return Err(TableError::Magic(m));
        }
        let v = self.version.load(Relaxed);
        if v != VERSION {
            return Err(TableError::Version(v));
        }
        Ok(())
    }

    /// Agent side: publishes a grant, all its fields as one (`seqlock`).
    pub fn publish(&self, g: &Grant, heartbeat_ms: u64) {
        let f = &self.grant;
        let w = seqlock::write_begin(&f.generation);
        f.rate_bytes_per_s.store(g.rate_bytes_per_s, Relaxed);
        f.burst_bytes.store(g.burst_bytes, Relaxed);
        f.rate_wqe_per_s.store(g.rate_wqe_per_s, Relaxed);
        f.max_active_qps.store(g.max_active_qps, Relaxed);
        f.quantum_us.store(g.quantum_us, Relaxed);
        f.long_msg_bytes.store(g.long_msg_bytes, Relaxed);
        f.rate_cqe_per_s.store(g.rate_cqe_per_s, Relaxed);
        f.heartbeat_ms.store(heartbeat_ms, Relaxed);
        seqlock::write_end(&f.generation, w);
    }

    /// The generation of the grant: how many writes completed.
    pub fn generation(&self) -> u64 {
        seqlock::generation(&self.grant.generation)
    }

    /// Agent side: proves it is alive without changing the grant.
    pub fn beat(&self, heartbeat_ms: u64) {
        self.grant.heartbeat_ms.store(heartbeat_ms, Release);
    }

    /// Shim side: a consistent, validated grant.
    pub fn read_grant(&self) -> Result<Grant, TableError> {
        self.check_header()?;
        let f = &self.grant;
        let (generation, g) = seqlock::read(&f.generation, 16, || Grant {
            generation: 0,
            rate_bytes_per_s: f.rate_bytes_per_s.load(Relaxed),
            burst_bytes: f.burst_bytes.load(Relaxed),
            rate_wqe_per_s: f.rate_wqe_per_s.load(Relaxed),
            max_active_qps: f.max_active_qps.load(Relaxed),
            quantum_us: f.quantum_us.load(Relaxed),
            long_msg_bytes: f.long_msg_bytes.load(Relaxed),
            rate_cqe_per_s: f.rate_cqe_per_s.load(Relaxed),
        })
        .ok_or(TableError::Torn)?;
        let g = Grant { generation, ..g };
        g.validate()?;
        Ok(g)
    }

    pub fn heartbeat_ms(&self) -> u64 {
        self.grant.heartbeat_ms.load(Acquire)
    }

    /// Agent side: sets (or with `cap == 0` clears) the cap towards `gid`. `false` when all
    /// entries are taken.
    pub fn set_peer_cap(&self, gid: [u8; 16], cap_bytes_per_s: u64, senders: u64) -> bool {
        let (hi, lo) = split_gid(gid);
        let mut free = None;
        for p in &self.grant.peers {
            let (h, l) = (p.gid_hi.load(Relaxed), p.gid_lo.load(Relaxed));
            if (h, l) == (hi, lo) {
                let w = seqlock::write_begin(&self.grant.generation);
                p.cap_bytes_per_s.store(cap_bytes_per_s, Relaxed);
                p.senders.store(senders, Relaxed);
                if cap_bytes_per_s == 0 {
                    p.gid_hi.store(0, Relaxed);
                    p.gid_lo.store(0, Relaxed);
                }
                seqlock::write_end(&self.grant.generation, w);
                return true;
            }
            if (h, l) == (0, 0) && free.is_none() {
                free = Some(p);
            }
        }
        if cap_bytes_per_s == 0 {
            return true;
        }
        let Some(p) = free else {
            return false;
        };
        let w = seqlock::write_begin(&self.grant.generation);
        p.cap_bytes_per_s.store(cap_bytes_per_s, Relaxed);
        p.senders.store(senders, Relaxed);
        p.gid_lo.store(lo, Relaxed);
        p.gid_hi.store(hi, Relaxed);
        seqlock::write_end(&self.grant.generation, w);
        true
    }

    /// Shim side: every current cap, (gid, bytes/s), bounded and validated.
    pub fn peer_caps(&self) -> Result<Vec<([u8; 16], u64)>, TableError> {
        let (_, entries) = seqlock::read(&self.grant.generation, 16, || {
            self.grant
                .peers
                .iter()
                .map(|p| {
                    let (hi, lo) = (p.gid_hi.load(Relaxed), p.gid_lo.load(Relaxed));
                    (hi, lo, p.cap_bytes_per_s.load(Relaxed))
                })
                .collect::<Vec<_>>()
        })
        .ok_or(TableError::Torn)?;
        let mut out = Vec::new();
        for (hi, lo, cap) in entries {
            if (hi, lo) == (0, 0) {
                continue;
            }
            if cap > MAX_RATE_BYTES {
                return Err(TableError::Field("peer cap_bytes_per_s", cap));
            }
            if cap > 0 {
                out.push((join_gid(hi, lo), cap));
            }
        }
        Ok(out)
    }
}

pub fn split_gid(g: [u8; 16]) -> (u64, u64) {
    let hi = u64::from_be_bytes(g[..8].try_into().expect("8 bytes"));
    let lo = u64::from_be_bytes(g[8..].try_into().expect("8 bytes"));
    (hi, lo)
}

pub fn join_gid(hi: u64, lo: u64) -> [u8; 16] {
    let mut g = [0u8; 16];
    g[..8].copy_from_slice(&hi.to_be_bytes());
    g[8..].copy_from_slice(&lo.to_be_bytes());
    g
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table() -> Box<Table> {
        // SAFETY: a table is plain atomics, for which all-zero is a valid value.
        Box::new(unsafe { std::mem::zeroed() })
    }

    #[test]
    fn grant_round_trips_and_generation_advances() {
        let t = table();
        assert_eq!(t.read_grant(), Err(TableError::Magic(0)));
        t.init();
        let g = Grant {
            rate_bytes_per_s: 12_500_000,
            burst_bytes: 65536,
            max_active_qps: 4,
            quantum_us: 1000,
            ..Grant::default()
        };
        t.publish(&g, 7);
        let r = t.read_grant().unwrap();
        assert_eq!(r, Grant { generation: 1, ..g });
        assert_eq!(t.heartbeat_ms(), 7);
        t.publish(&g, 8);
        assert_eq!(t.read_grant().unwrap().generation, 2);
    }

    #[test]
    fn corrupt_tables_are_refused() {
        let t = table();
        t.init();
        t.version.store(9, Relaxed);
        assert_eq!(t.read_grant(), Err(TableError::Version(9)));
        t.version.store(VERSION, Relaxed);
        t.grant.max_active_qps.store(u64::MAX, Relaxed);
        assert!(matches!(
            t.read_grant(),
            Err(TableError::Field("max_active_qps", _))
        ));
    }

    #[test]
    fn peer_caps_are_set_replaced_and_cleared() {
        let t = table();
        t.init();
        let a = [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 0, 0, 1];
        let b = [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 10, 0, 0, 2];
        assert!(t.set_peer_cap(a, 100, 2));
        assert!(t.set_peer_cap(b, 50, 4));
        assert!(t.set_peer_cap(a, 200, 1));
        let mut caps = t.peer_caps().unwrap();
        caps.sort();
        assert_eq!(caps, vec![(a, 200), (b, 50)]);
        assert!(t.set_peer_cap(a, 0, 0));
        assert_eq!(t.peer_caps().unwrap(), vec![(b, 50)]);
        for i in 0..MAX_PEERS as u8 {
            let mut g = a;
            g[15] = 100 + i;
            let ok = t.set_peer_cap(g, 1, 1);
            assert_eq!(ok, (i as usize) < MAX_PEERS - 1, "entry {i}");
        }
    }
}
