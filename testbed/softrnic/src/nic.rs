//! The NIC model of an engine: line rate, MTU, an LRU QP-context cache with a miss penalty,
//! and a WQE fetch cost paid per doorbell batch, all charged to one pipeline clock.
//!
//! `softrnic up` writes the settings to `<run>/nic`; each engine reads the file at start:
//!
//! ```text
//! line_rate_gbps 25 mtu 4096 qp_cache 20 qp_miss_ns 1000 wqe_fetch_ns 500 wqe_fetch_batch 64
//! ```
//!
//! Every packet the engine sends costs its wire time at the line rate (UDP datagram plus
//! 42 bytes of Ethernet/IPv4/UDP headers). Work requests are fetched as a real NIC's fetch
//! unit does after a doorbell: when the transmitter reaches a work request not fetched yet,
//! it reads it together with the ones posted after it by the same `ibv_post_send` call, up to
//! `wqe_fetch_batch` of them ([`fetch_count`]), and the whole read costs `wqe_fetch_ns` per
//! work request at once, before any other QP's packet; so a co-runner posting long lists
//! delays everybody else's packets by up to a batch of fetches (the DRUM paper's Fig. 2a).
//! Every packet sent or received for a QP whose context is not in the cache costs
//! a miss (the context is then cached, evicting the least recently used one). The costs add up
//! on a clock (`busy_until`); the transmitter starts a new packet only when the clock is less
//! than [`SLACK`] ahead of real time, so the average rate is the modelled one even though a
//! thread cannot sleep for a microsecond. Capacity the transmitter could not use while it had
//! work is banked for at most [`BANK`] (a token bucket of depth `BANK + SLACK`), which absorbs
//! its scheduling delays; idle time is not banked ([`Pipeline::idle`]); when the engine itself
//! is slower than the model, the clock falls behind real time and the rest is lost.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use thiserror::Error;

use crate::idmap::IdMap;

/// How far the pipeline clock may run ahead of real time before the transmitter waits.
pub const SLACK: Duration = Duration::from_micros(100);
/// How far the clock may lag behind real time: capacity left unused by a transmitter that
/// was descheduled (on a busy 2-core machine, for several milliseconds) is made up for within
/// this bound (2 ms lost up to 10 % of the line rate under load; 8 ms kept it within 1 %).
/// `SLACK + BANK` is the largest burst at line rate.
pub const BANK: Duration = Duration::from_millis(8);
/// How far a paced QP's clock may lag behind real time beyond its burst size: the
/// transmitter wakes up for a paced packet tens of µs late, and without this allowance every
/// late wake-up would be lost from the rate (10 MB/s was paced to 8.6).
pub const PACE_BANK: Duration = Duration::from_millis(1);
/// Ethernet (14) + IPv4 (20) + UDP (8) header bytes added to each datagram's wire time.
pub const L2_L4_OVERHEAD: u64 = 42;

#[derive(Debug, Error, PartialEq)]
pub enum NicError {
    #[error("bad NIC setting {0:?}")]
    Setting(String),
    #[error("MTU must be 256, 512, 1024, 2048 or 4096, got {0}")]
    Mtu(u32),
    #[error("line rate must be a positive number of Gb/s (or 0 for unlimited), got {0}")]
    Rate(String),
    #[error("WQE fetch batch must be at least 1")]
    FetchBatch,
    #[error("receive buffer must be at least 1 KiB")]
    RxBuffer,
    #[error("time scale must be a positive number, got {0}")]
    TimeScale(String),
}

/// The model's parameters (see docs/softrnic.md for the defaults and their sources).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct NicConfig {
    /// Line rate in Gb/s; 0 = unlimited.
    pub line_rate_gbps: f64,
    /// Port MTU in bytes (the path MTU of every QP is clamped to it).
    pub mtu: u32,
    /// QP contexts the NIC caches; 0 = unlimited (no misses).
    pub qp_cache: usize,
    /// Cost of a QP-context cache miss.
    pub qp_miss_ns: u64,
    /// Cost of fetching a work request (charged for a whole fetch batch at once).
    pub wqe_fetch_ns: u64,
    /// Most work requests of one doorbell the NIC fetches in one read (1: one at a time).
    pub wqe_fetch_batch: u32,
    /// Receive port (see [`crate::rx_port`]): ingress buffer, ECN marking threshold (0:
    /// never), and whether a full buffer drops (lossy) or pauses the sender (lossless).
    pub rx_buffer_kib: u64,
    pub ecn_threshold_kib: u64,
    pub rx_lossy: bool,
    /// DCQCN for RC QPs (see [`crate::dcqcn`]): CNPs for marked packets, rates cut on CNPs.
    /// Inert while nothing is marked.
    pub dcqcn: bool,
    /// How many times slower than real time the modelled NIC's time runs (1: not dilated);
    /// DCQCN's timers are stretched by it.
    pub time_scale: f64,
    /// AUSS in ACKs ([`crate::auss`]): how long a silent sender stays in a receiver's active
    /// unique senders, in ms; 0 = off (ACKs unstamped, no notifications, no table).
    pub auss_expiry_ms: u64,
    /// AUSS: how long a receiver holds a sender's END (its send queue ran empty) before it
    /// stops counting it, in µs of the NIC's time (stretched by `time_scale`); a START on
    /// the same QP within it cancels the END, so a queue empty for a moment does not move
    /// `N`. 0: ENDs apply at once.
    pub auss_hold_us: u64,
}

impl Default for NicConfig {
    fn default() -> Self {
        NicConfig {
            line_rate_gbps: 25.0,
            mtu: 4096,
            qp_cache: 20,
            qp_miss_ns: 1000,
            wqe_fetch_ns: 500,
            wqe_fetch_batch: 64,
            rx_buffer_kib: 2048,
            // Off: the NIC model's results stay what they were unless marking is asked for
            // (DCQCN, on by default, then reacts to it).
            ecn_threshold_kib: 0,
            rx_lossy: false,
            dcqcn: true,
            time_scale: 1.0,
            // Off: packets and the model stay what they were unless a run asks for it.
            auss_expiry_ms: 0,
            auss_hold_us: 1000,
        }
    }
}

/// A `0`/`1` setting.
fn flag(v: &str) -> Option<bool> {
    match v {
        "0" => Some(false),
        "1" => Some(true),
        _ => None,
    }
}

pub use softrnic_abi::device::mtu_enum;

impl NicConfig {
    pub fn validate(&self) -> Result<(), NicError> {
        if !(self.line_rate_gbps.is_finite() && self.line_rate_gbps >= 0.0) {
            return Err(NicError::Rate(self.line_rate_gbps.to_string()));
        }
        if mtu_enum(self.mtu).is_none() {
            return Err(NicError::Mtu(self.mtu));
        }
        if self.wqe_fetch_batch == 0 {
            return Err(NicError::FetchBatch);
        }
        if self.rx_buffer_kib == 0 {
            return Err(NicError::RxBuffer);
        }
        if !(self.time_scale.is_finite() && self.time_scale > 0.0) {
            return Err(NicError::TimeScale(self.time_scale.to_string()));
        }
        Ok(())
    }

    pub fn encode(&self) -> String {
        format!(
            "line_rate_gbps {} mtu {} qp_cache {} qp_miss_ns {} wqe_fetch_ns {} wqe_fetch_batch {} \
             rx_buffer_kib {} ecn_threshold_kib {} rx_lossy {} dcqcn {} time_scale {}{}\n",
            self.line_rate_gbps,
            self.mtu,
            self.qp_cache,
            self.qp_miss_ns,
            self.wqe_fetch_ns,
            self.wqe_fetch_batch,
            self.rx_buffer_kib,
            self.ecn_threshold_kib,
            u8::from(self.rx_lossy),
            u8::from(self.dcqcn),
            self.time_scale,
            // Only when on, so that the settings of runs without it read as before.
            if self.auss_expiry_ms > 0 {
                format!(
                    " auss_expiry_ms {} auss_hold_us {}",
                    self.auss_expiry_ms, self.auss_hold_us
                )
            } else {
                String::new()
            }
        )
    }

    pub fn decode(s: &str) -> Result<NicConfig, NicError> {
        let f: Vec<&str> = s.split_whitespace().collect();
        if f.len() % 2 != 0 {
            return Err(NicError::Setting(s.trim().to_string()));
        }
        let mut c = NicConfig::default();
        for kv in f.chunks(2) {
            let bad = || NicError::Setting(format!("{} {}", kv[0], kv[1]));
            match kv[0] {
                "line_rate_gbps" => {
                    c.line_rate_gbps = kv[1]
                        .parse()
                        .map_err(|_| NicError::Rate(kv[1].to_string()))?
                }
                "mtu" => c.mtu = kv[1].parse().map_err(|_| bad())?,
                "qp_cache" => c.qp_cache = kv[1].parse().map_err(|_| bad())?,
                "qp_miss_ns" => c.qp_miss_ns = kv[1].parse().map_err(|_| bad())?,
                "wqe_fetch_ns" => c.wqe_fetch_ns = kv[1].parse().map_err(|_| bad())?,
                "wqe_fetch_batch" => c.wqe_fetch_batch = kv[1].parse().map_err(|_| bad())?,
                "rx_buffer_kib" => c.rx_buffer_kib = kv[1].parse().map_err(|_| bad())?,
                "ecn_threshold_kib" => c.ecn_threshold_kib = kv[1].parse().map_err(|_| bad())?,
                "rx_lossy" => c.rx_lossy = flag(kv[1]).ok_or_else(bad)?,
                "dcqcn" => c.dcqcn = flag(kv[1]).ok_or_else(bad)?,
                "auss_expiry_ms" => c.auss_expiry_ms = kv[1].parse().map_err(|_| bad())?,
                "auss_hold_us" => c.auss_hold_us = kv[1].parse().map_err(|_| bad())?,
                "time_scale" => {
                    c.time_scale = kv[1]
                        .parse()
                        .map_err(|_| NicError::TimeScale(kv[1].to_string()))?
                }
                _ => return Err(bad()),
            }
        }
        c.validate()?;
        Ok(c)
    }

    /// DCQCN's parameters for this NIC's line rate and time scale; None when it is off
    /// or the line is unlimited (no rate to cut).
    pub fn dcqcn(&self) -> Option<crate::dcqcn::DcqcnConfig> {
        (self.dcqcn && self.line_rate_gbps > 0.0)
            .then(|| crate::dcqcn::DcqcnConfig::scaled(self.line_rate_gbps, self.time_scale))
    }

    /// AUSS's expiry, None when it is off.
    pub fn auss_expiry(&self) -> Option<std::time::Duration> {
        (self.auss_expiry_ms > 0).then(|| std::time::Duration::from_millis(self.auss_expiry_ms))
    }

    /// How long AUSS holds an END, in real time: `auss_hold_us` stretched by the time scale.
    pub fn auss_hold(&self) -> std::time::Duration {
        std::time::Duration::from_secs_f64(self.auss_hold_us as f64 * 1e-6 * self.time_scale)
    }

    /// What a host receives at line rate, in payload bytes per second of MTU-sized packets
    /// (each with softrnic's header and the L2–L4 overhead; 0: the line is unlimited): the
    /// `R` of the AUSS table's `R/N`.
    pub fn payload_bytes_per_s(&self) -> u64 {
        let mtu = f64::from(self.mtu);
        let per_packet = (crate::wire::HDR_LEN as u64 + L2_L4_OVERHEAD) as f64;
        (self.line_rate_gbps * 1e9 / 8.0 * mtu / (mtu + per_packet)) as u64
    }

    /// The receive port's parameters.
    pub fn rx_port(&self) -> crate::rx_port::RxPortConfig {
        crate::rx_port::RxPortConfig {
            line_rate_gbps: self.line_rate_gbps,
            buffer_bytes: self.rx_buffer_kib * 1024,
            ecn_threshold_bytes: self.ecn_threshold_kib * 1024,
            lossy: self.rx_lossy,
        }
    }

    /// Wire time of a datagram of `len` bytes.
    pub fn wire_ns(&self, len: usize) -> u64 {
        if self.line_rate_gbps <= 0.0 {
            return 0;
        }
        ((len as u64 + L2_L4_OVERHEAD) as f64 * 8.0 / self.line_rate_gbps) as u64
    }
}

/// How many work requests one fetch reads: the one at the head of `starts_doorbell` and the
/// ones after it up to (not including) the next that starts a doorbell of its own, at most
/// `batch`. `starts_doorbell` yields, for the unfetched work requests of a send queue in order,
/// whether each is the first of an `ibv_post_send` call. A fetch never crosses a doorbell: each
/// post is its own DMA read, so posting one by one lets the arbiter serve other QPs in
/// between, as posting a list does not.
pub fn fetch_count(starts_doorbell: impl IntoIterator<Item = bool>, batch: u32) -> u32 {
    let mut it = starts_doorbell.into_iter();
    if it.next().is_none() {
        return 0;
    }
    1 + it
        .take(batch.saturating_sub(1) as usize)
        .take_while(|starts| !starts)
        .count() as u32
}

/// LRU set of QP numbers. Every access stamps the QP with the next tick and queues
/// `(tick, QP)`; an entry whose tick is no longer its QP's is stale, skipped when the least
/// recently used QP is looked for and dropped in bulk now and then. An access (every packet
/// sent or received) thus costs a hash update and a push, where keeping the ages in an
/// ordered map cost a removal and an insertion (with the SipHash map, 4 % of the engine's
/// time on one host).
#[derive(Debug, Default)]
pub struct QpCache {
    cap: usize,
    tick: u64,
    /// Each cached QP and the tick of its last access.
    by_qp: IdMap<u64>,
    /// Accesses, oldest first, stale ones included.
    accesses: VecDeque<(u64, u32)>,
}

impl QpCache {
    pub fn new(cap: usize) -> Self {
        QpCache {
            cap,
            ..Default::default()
        }
    }

    /// Touch `qpn`'s context: true on a hit. With capacity 0 everything hits.
    pub fn access(&mut self, qpn: u32) -> bool {
        if self.cap == 0 {
            return true;
        }
        self.tick += 1;
        let hit = self.by_qp.insert(qpn, self.tick).is_some();
        self.accesses.push_back((self.tick, qpn));
        if !hit && self.by_qp.len() > self.cap {
            self.evict_lru();
        }
        self.drop_stale();
        hit
    }

    fn is_current(&self, (tick, qpn): (u64, u32)) -> bool {
        self.by_qp.get(&qpn) == Some(&tick)
    }

    fn evict_lru(&mut self) {
        while let Some(a) = self.accesses.pop_front() {
            if self.is_current(a) {
                self.by_qp.remove(&a.1);
                return;
            }
        }
    }

    /// Once stale entries outnumber the cached QPs three to one (at least 48 of them), drop
    /// them all: linear work every so many accesses, constant per access on average.
    fn drop_stale(&mut self) {
        if self.accesses.len() > 4 * self.by_qp.len().max(16) {
            let by_qp = &self.by_qp;
            self.accesses.retain(|(t, q)| by_qp.get(q) == Some(t));
        }
    }

    /// Forget a destroyed QP (its queued accesses become stale).
    pub fn remove(&mut self, qpn: u32) {
        self.by_qp.remove(&qpn);
    }

    pub fn len(&self) -> usize {
        self.by_qp.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_qp.is_empty()
    }
}

/// The pipeline clock.
#[derive(Debug)]
pub struct Pipeline {
    pub cfg: NicConfig,
    pub cache: QpCache,
    busy_until: Instant,
    /// The transmitter found nothing to send and no work has been charged since.
    idle: bool,
}

impl Pipeline {
    pub fn new(cfg: NicConfig) -> Self {
        Pipeline {
            cfg,
            cache: QpCache::new(cfg.qp_cache),
            busy_until: Instant::now(),
            idle: false,
        }
    }

    /// Add `ns` of work to the clock.
    pub fn charge(&mut self, now: Instant, ns: u64) {
        if ns == 0 {
            return;
        }
        let bank = if std::mem::take(&mut self.idle) {
            Duration::ZERO
        } else {
            BANK
        };
        let floor = now.checked_sub(bank).unwrap_or(now);
        self.busy_until = self.busy_until.max(floor) + Duration::from_nanos(ns);
    }

    /// The transmitter found nothing to send: the line idles until the next work is
    /// charged, and that time is not banked. The bank makes up only for time the transmitter
    /// lost while it had work (descheduled); banking idle time too let a sender that had been
    /// quiet send [`BANK`] of line time at once, faster than its line, into a receiver's
    /// queue. (A transmitter woken late by a post loses the delay: the NIC cannot tell it from
    /// idle time.)
    pub fn idle(&mut self) {
        self.idle = true;
    }

    /// Start nothing before `now + d` (a pause from a receiver): the clock is moved to where
    /// [`Pipeline::wait`] first lets a packet go at that time; banked credit does not cut the
    /// pause short.
    pub fn hold(&mut self, now: Instant, d: Duration) {
        self.busy_until = self.busy_until.max(now + d + SLACK);
    }

    /// None when a new packet may start now, else how long to wait.
    pub fn wait(&self, now: Instant) -> Option<Duration> {
        let ahead = self.busy_until.saturating_duration_since(now);
        (ahead > SLACK).then(|| ahead - SLACK)
    }
}

/// Packet pacing of one QP (`IBV_QP_RATE_LIMIT`, `ibv_modify_qp_rate_limit`), a token
/// bucket kept as a clock: the QP may start a packet when its clock is not ahead of now; each
/// packet moves the clock on by its time at the QP's rate (counted as the line rate counts
/// it: the datagram and its Ethernet/IP/UDP overhead); idle time is credited up to the burst
/// size plus [`PACE_BANK`], so about that much may go back to back.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Pacer {
    kbps: u32,
    burst_bytes: u32,
    clock: Option<Instant>,
}

impl Pacer {
    pub fn new(kbps: u32, burst_bytes: u32) -> Pacer {
        assert!(kbps > 0, "a pacer needs a rate");
        Pacer {
            kbps,
            burst_bytes,
            clock: None,
        }
    }

    fn ns(&self, bytes: u64) -> u64 {
        bytes * 8_000_000 / self.kbps as u64
    }

    pub fn kbps(&self) -> u32 {
        self.kbps
    }

    /// When the QP may start its next packet; None: now.
    pub fn ready_at(&self, now: Instant) -> Option<Instant> {
        self.clock.filter(|c| *c > now)
    }

    /// A new rate from now on (what is charged stays charged).
    pub fn set_kbps(&mut self, kbps: u32) {
        self.kbps = kbps.max(1);
    }

    /// A datagram of `len` bytes started at `now`.
    pub fn charge(&mut self, now: Instant, len: usize) {
        let credit = Duration::from_nanos(self.ns(self.burst_bytes as u64)) + PACE_BANK;
        let floor = now.checked_sub(credit).unwrap_or(now);
        let start = self.clock.map_or(now, |c| c.max(floor));
        self.clock = Some(start + Duration::from_nanos(self.ns(len as u64 + L2_L4_OVERHEAD)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_packet_adds_the_overhead_drum_testbed_tells_its_agents() {
        // testbed/harness/src/configs.rs: SOFTRNIC_PACKET_OVERHEAD.
        assert_eq!(L2_L4_OVERHEAD + crate::wire::HDR_LEN as u64, 90);
    }

    #[test]
    fn a_pacer_keeps_its_rate_and_bursts_only_what_it_was_given() {
        // (958 + 42) bytes at 8,000 kb/s = 1 ms.
        let t = Instant::now() + Duration::from_secs(1);
        let mut p = Pacer::new(8_000, 0);
        assert_eq!(p.ready_at(t), None);
        p.charge(t, 958);
        assert_eq!(p.ready_at(t), Some(t + Duration::from_millis(1)));
        // Sending whenever allowed: exactly one packet per millisecond.
        let mut now = t;
        for _ in 0..100 {
            now = p.ready_at(now).unwrap_or(now);
            p.charge(now, 958);
        }
        assert_eq!(now, t + Duration::from_millis(100));
        // A transmitter that comes late (within PACE_BANK) loses nothing of the rate.
        let late = now + Duration::from_millis(1) + Duration::from_micros(300);
        p.charge(late, 958);
        assert_eq!(p.ready_at(late), Some(now + Duration::from_millis(2)));
        // Idle without a burst size earns PACE_BANK only: two packets back to back.
        let later = now + Duration::from_secs(5);
        let back_to_back = |p: &mut Pacer, at| {
            let mut sent = 0;
            while p.ready_at(at).is_none() {
                p.charge(at, 958);
                sent += 1;
            }
            sent
        };
        assert_eq!(back_to_back(&mut p, later), 2);
        assert_eq!(p.ready_at(later), Some(later + Duration::from_millis(1)));
        // With a burst of 4,000 bytes, after idling 4 more, then the rate.
        let mut b = Pacer::new(8_000, 4_000);
        b.charge(t, 958);
        let idle = t + Duration::from_secs(1);
        assert_eq!(back_to_back(&mut b, idle), 6);
        assert_eq!(b.ready_at(idle), Some(idle + Duration::from_millis(1)));
    }

    #[test]
    fn config_roundtrip_and_errors() {
        let c = NicConfig {
            line_rate_gbps: 2.5,
            mtu: 1024,
            qp_cache: 4,
            qp_miss_ns: 3000,
            wqe_fetch_ns: 100,
            wqe_fetch_batch: 8,
            rx_buffer_kib: 512,
            ecn_threshold_kib: 0,
            rx_lossy: true,
            dcqcn: false,
            time_scale: 200.0,
            auss_expiry_ms: 0,
            auss_hold_us: 1000,
        };
        assert_eq!(NicConfig::decode(&c.encode()).unwrap(), c);
        assert!(
            !c.encode().contains("auss"),
            "a run without AUSS writes what it wrote"
        );
        let a = NicConfig {
            auss_expiry_ms: 500,
            auss_hold_us: 250,
            ..c
        };
        assert_eq!(NicConfig::decode(&a.encode()).unwrap(), a);
        assert_eq!(a.auss_expiry(), Some(Duration::from_millis(500)));
        // The hold is in the NIC's time: 250 µs at 200× dilation is 50 ms.
        assert_eq!(a.auss_hold(), Duration::from_millis(50));
        assert!(NicConfig::decode("dcqcn 2").is_err());
        assert!(NicConfig::decode("time_scale 0").is_err());
        assert!(NicConfig::decode("time_scale nan").is_err());
        assert!(NicConfig::decode("").unwrap().dcqcn);
        assert_eq!(
            NicConfig::decode("rx_buffer_kib 0"),
            Err(NicError::RxBuffer)
        );
        assert!(NicConfig::decode("rx_lossy yes").is_err());
        assert_eq!(NicConfig::decode("").unwrap(), NicConfig::default());
        assert_eq!(NicConfig::decode("mtu 1000"), Err(NicError::Mtu(1000)));
        assert!(NicConfig::decode("line_rate_gbps -1").is_err());
        assert!(NicConfig::decode("colour blue").is_err());
        assert!(NicConfig::decode("qp_cache").is_err());
        assert_eq!(
            NicConfig::decode("wqe_fetch_batch 0"),
            Err(NicError::FetchBatch)
        );
        // Files written before the setting existed mean the default.
        let old = "line_rate_gbps 25 mtu 4096 qp_cache 20 qp_miss_ns 1000 wqe_fetch_ns 500";
        assert_eq!(NicConfig::decode(old).unwrap().wqe_fetch_batch, 64);
    }

    #[test]
    fn a_fetch_reads_one_doorbell_up_to_the_batch_size() {
        // Two posts: a list of 5, then a single work request.
        let q = [true, false, false, false, false, true];
        assert_eq!(fetch_count(q, 64), 5);
        assert_eq!(fetch_count(q, 3), 3);
        assert_eq!(fetch_count(q, 1), 1);
        // The rest of a list cut by the batch size is the next fetch.
        assert_eq!(fetch_count(q[3..].iter().copied(), 64), 2);
        assert_eq!(fetch_count(q[5..].iter().copied(), 64), 1);
        // Work requests posted one by one are fetched one by one.
        assert_eq!(fetch_count([true; 4], 64), 1);
        assert_eq!(fetch_count([], 64), 0);
    }

    #[test]
    fn lru_cache_thrashes_when_cyclic_set_exceeds_capacity() {
        let mut c = QpCache::new(4);
        // 4 QPs round robin: 4 cold misses, then hits only.
        let misses = (0..400).filter(|i| !c.access(i % 4)).count();
        assert_eq!(misses, 4);
        // 5 QPs round robin through a 4-entry LRU: every access misses.
        let mut c = QpCache::new(4);
        let misses = (0..500).filter(|i| !c.access(i % 5)).count();
        assert_eq!(misses, 500);
        assert_eq!(c.len(), 4);
        // LRU, not FIFO: a re-used entry survives.
        let mut c = QpCache::new(2);
        assert!(!c.access(1));
        assert!(!c.access(2));
        assert!(c.access(1));
        assert!(!c.access(3)); // evicts 2
        assert!(c.access(1));
        assert!(!c.access(2));
        c.remove(1);
        assert!(!c.access(1));
        // Stale accesses are dropped now and then: the queue stays bounded, the order intact.
        let mut c = QpCache::new(4);
        for i in 0..10_000 {
            c.access(i % 3);
        }
        assert!(c.accesses.len() <= 4 * 16 + 1);
        assert!(!c.access(7));
        assert!(!c.access(8), "evicts 1, the least recently used");
        assert!(c.access(2) && c.access(0) && c.access(7));
        assert!(!c.access(1));
        // Unlimited.
        let mut c = QpCache::new(0);
        assert!((0..1000).all(|i| c.access(i)));
    }

    #[test]
    fn pipeline_clock_paces_at_the_line_rate() {
        let cfg = NicConfig {
            line_rate_gbps: 8.0,
            ..Default::default()
        };
        // (958 + 42) bytes at 8 Gb/s = 1000 ns.
        assert_eq!(cfg.wire_ns(958), 1000);
        let t = Instant::now() + BANK * 2;
        let mut p = Pipeline::new(cfg);
        p.busy_until = t;
        for _ in 0..500 {
            p.charge(t, cfg.wire_ns(958));
        }
        assert_eq!(p.busy_until, t + Duration::from_micros(500));
        // 500 µs of work, 100 µs slack: wait 400 µs.
        assert_eq!(p.wait(t), Some(Duration::from_micros(400)));
        assert_eq!(p.wait(t + Duration::from_micros(400)), None);
        // Descheduled for long with work: at most BANK of the lost time is made up.
        let later = t + Duration::from_secs(1);
        p.charge(later, 1_000);
        assert_eq!(p.busy_until, later - BANK + Duration::from_micros(1));
        // Idle (nothing to send) is not banked: the next work starts when it is charged.
        let quiet = later + Duration::from_secs(1);
        p.idle();
        p.charge(quiet, 500_000);
        assert_eq!(p.busy_until, quiet + Duration::from_micros(500));
        assert_eq!(p.wait(quiet), Some(Duration::from_micros(400)));
        // Work after that banks again.
        let again = quiet + Duration::from_secs(1);
        p.charge(again, 1_000);
        assert_eq!(p.busy_until, again - BANK + Duration::from_micros(1));
        let unlimited = NicConfig {
            line_rate_gbps: 0.0,
            ..Default::default()
        };
        assert_eq!(unlimited.wire_ns(4000), 0);
    }
}
