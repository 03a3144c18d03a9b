//! The limits of the app's grant as the data path reads them (lock-free atomics), and the
//! admission decisions made against them: the byte, WQE and completion limiters (GCRA, their
//! theoretical arrival times), the per-receiver caps (DASR, from the agent or the NIC:
//! [`crate::peer_caps`], reached through each QP's [`Route`]) and the shim's clock. No queues,
//! no QPs, no threads: `govern` decides with these what goes to the NIC now.

use crate::cap_route::{Caps, Route};
use crate::pacer::Gcra;
use crate::peer_caps::NicCapCounts;
use crate::spin::SpinLock;
use drum_table::layout::Grant;
use std::sync::atomic::{
    AtomicBool, AtomicU64,
    Ordering::{Acquire, Relaxed, Release},
};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// The limits in force, as plain atomics the data path reads without a lock. A limiter is
/// `(interval_ps, tolerance_ps)`, interval 0 meaning "no limit".
pub struct Limits {
    byte: [AtomicU64; 2],
    wqe: [AtomicU64; 2],
    /// Completions delivered to the app's virtual CQs (its polling rate).
    cqe: [AtomicU64; 2],
    pub k: AtomicU64,
    pub quantum_ns: AtomicU64,
    pub long_msg: AtomicU64,
    /// Any limiter or gate in force.
    pub active: AtomicBool,
    /// Completions must be followed (gating or long-message announcements).
    pub tracking: AtomicBool,
    pub generation: AtomicU64,
}

pub static LIMITS: Limits = Limits {
    byte: [AtomicU64::new(0), AtomicU64::new(0)],
    wqe: [AtomicU64::new(0), AtomicU64::new(0)],
    cqe: [AtomicU64::new(0), AtomicU64::new(0)],
    k: AtomicU64::new(0),
    quantum_ns: AtomicU64::new(0),
    long_msg: AtomicU64::new(0),
    active: AtomicBool::new(false),
    tracking: AtomicBool::new(false),
    generation: AtomicU64::new(0),
};

/// The limiters' theoretical arrival times (ps since [`now_ps`]'s origin).
static BYTE_TAT: AtomicU64 = AtomicU64::new(0);
static WQE_TAT: AtomicU64 = AtomicU64::new(0);
static CQE_TAT: AtomicU64 = AtomicU64::new(0);

/// Default quantum of a gate slot when the grant names none.
const DEFAULT_QUANTUM_US: u64 = 1000;

/// The shortest pause: short next to a granted inter-message gap at any rate that throttles
/// (64 KiB at 10 Gb/s take 52 µs).
const MIN_PAUSE: Duration = Duration::from_micros(20);
/// The longest: what a WR posted before the throttling may wait for its completion to be
/// seen.
const MAX_PAUSE: Duration = Duration::from_millis(1);

/// How long an empty poll of a throttled app pauses at `now`.
pub fn empty_poll_pause(now: u64) -> Duration {
    let wait = |cell: &[AtomicU64; 2], tat: &AtomicU64| {
        limiter(cell).map_or(0, |g| g.wait(tat.load(Relaxed), now))
    };
    let ps = wait(&LIMITS.byte, &BYTE_TAT)
        .max(wait(&LIMITS.wqe, &WQE_TAT))
        .max(wait(&LIMITS.cqe, &CQE_TAT));
    Duration::from_nanos(ps / 1000).clamp(MIN_PAUSE, MAX_PAUSE)
}

/// Per-receiver caps (DASR), from the agent's table or the NIC's ([`Caps`]). A post takes
/// this lock only to settle its QP's [`Route`] again.
pub static CAPS: SpinLock<Caps> = SpinLock::new(Caps::new());
/// [`Caps::generation`], for the routes to compare without the lock.
static CAPS_GENERATION: AtomicU64 = AtomicU64::new(1);
/// Admissions must consult [`CAPS`]: the agent gave caps, or the NIC's table is read.
pub static CAPS_CONSULTED: AtomicBool = AtomicBool::new(false);
/// Some destination is capped now (then posts go one by one, as under any rate limit).
pub static CAP_IN_FORCE: AtomicBool = AtomicBool::new(false);
/// A cap changed at an admission: the engine puts it on the QPs' NIC pacing at once.
pub static CAPS_CHANGED: AtomicBool = AtomicBool::new(false);

static ORIGIN: OnceLock<Instant> = OnceLock::new();

/// The shim's clock, in picoseconds.
pub fn now_ps() -> u64 {
    ORIGIN.get_or_init(Instant::now).elapsed().as_nanos() as u64 * 1000
}

fn limiter(cell: &[AtomicU64; 2]) -> Option<Gcra> {
    Gcra::from_parts(cell[0].load(Relaxed), cell[1].load(Relaxed))
}

fn set_limiter(cell: &[AtomicU64; 2], g: Option<Gcra>) {
    let (i, t) = g.map_or((0, 0), |g| g.parts());
    cell[1].store(t, Relaxed);
    cell[0].store(i, Relaxed);
}

/// The byte burst when the grant names none: the limiter's default (5 ms at the rate), and
/// at least one 64 KiB message (measured: with a 0.9 ms burst at 75 MB/s on a loaded 2-core
/// machine, `ib_write_bw` got 76 % of its grant; with 2 ms, 95 %; with 3.5 ms, 100 %).
pub fn default_byte_burst(rate: f64) -> u64 {
    Gcra::default_burst(rate).max(64 * 1024)
}

/// Puts the limits of grant `g` in force (all 0: none); returns the instant it took as now
/// (the gate's changes that follow, in `govern::apply`, happen at the same instant).
pub fn apply(g: &Grant) -> u64 {
    let byte = (g.rate_bytes_per_s > 0).then(|| {
        let rate = g.rate_bytes_per_s as f64;
        let burst = if g.burst_bytes > 0 {
            g.burst_bytes
        } else {
            default_byte_burst(rate)
        };
        Gcra::new(rate, burst)
    });
    let wqe = (g.rate_wqe_per_s > 0).then(|| {
        let rate = g.rate_wqe_per_s as f64;
        Gcra::new(rate, Gcra::default_burst(rate))
    });
    let cqe = (g.rate_cqe_per_s > 0).then(|| {
        let rate = g.rate_cqe_per_s as f64;
        Gcra::new(rate, Gcra::default_burst(rate))
    });
    let now = now_ps();
    for (cell, tat, new) in [
        (&LIMITS.byte, &BYTE_TAT, byte.flatten()),
        (&LIMITS.wqe, &WQE_TAT, wqe.flatten()),
        (&LIMITS.cqe, &CQE_TAT, cqe.flatten()),
    ] {
        if let Some(n) = new {
            let old = limiter(cell);
            let _ = tat.fetch_update(Relaxed, Relaxed, |t| Some(n.carry_over(old, t, now)));
        }
        set_limiter(cell, new);
    }
    LIMITS.k.store(g.max_active_qps, Relaxed);
    let q = if g.quantum_us > 0 {
        g.quantum_us
    } else {
        DEFAULT_QUANTUM_US
    };
    LIMITS.quantum_ns.store(q * 1000, Relaxed);
    LIMITS.long_msg.store(g.long_msg_bytes, Relaxed);
    let tracking = g.max_active_qps > 0 || g.long_msg_bytes > 0;
    if tracking && !LIMITS.tracking.load(Relaxed) {
        // A new tracking period: what was posted before may have completed unseen.
        TRACKING_EPOCH.fetch_add(1, Relaxed);
    }
    LIMITS.tracking.store(tracking, Relaxed);
    LIMITS.active.store(
        byte.is_some() || wqe.is_some() || tracking || CAPS_CONSULTED.load(Relaxed),
        Release,
    );
    LIMITS.generation.store(g.generation, Relaxed);
    now
}

/// Replaces the per-receiver caps from the agent's table.
pub fn set_caps(caps: &[([u8; 16], u64)]) {
    let mut c = CAPS.lock();
    c.set_agent(caps);
    publish_caps(&c);
}

/// Reads the NIC's AUSS table from now on (None: no more).
pub fn set_nic_table(table: Option<drum_table::nic_auss::Reader>) {
    let mut c = CAPS.lock();
    c.set_nic(table);
    publish_caps(&c);
}

/// The rate (bytes/s) of the cap in force towards `peer`, if any.
pub fn cap_rate_of(peer: [u8; 16]) -> Option<u64> {
    CAP_IN_FORCE
        .load(Relaxed)
        .then(|| CAPS.lock().peers.rate_of(peer))
        .flatten()
}

/// The inode of the NIC's AUSS table read now.
pub fn nic_table_inode() -> Option<u64> {
    CAPS.lock().peers.nic_inode()
}

/// The NIC caps' counters and whether the NIC's table was found (for the exit summary),
/// or `None` if the caps' lock is not free by `deadline`.
pub fn nic_caps_until(deadline: Instant) -> Option<(NicCapCounts, bool)> {
    let c = CAPS.lock_until(deadline)?;
    Some((c.peers.counts, c.peers.nic_inode().is_some()))
}

fn publish_caps(c: &Caps) {
    CAPS_GENERATION.store(c.generation, Release);
    CAP_IN_FORCE.store(c.peers.any_in_force(), Relaxed);
    CAPS_CONSULTED.store(c.peers.consulted(), Relaxed);
    if c.peers.consulted() {
        LIMITS.active.store(true, Release);
    }
}

/// May `bytes` more go now, towards `dest` (its GID and the QP's route to its cap)?
/// Consumes from every limiter if so; otherwise returns how long to wait (ps) and consumes
/// nothing.
pub fn admit(now: u64, bytes: u64, dest: Option<([u8; 16], &mut Route)>) -> Result<(), u64> {
    let byte = limiter(&LIMITS.byte);
    let wqe = limiter(&LIMITS.wqe);
    let mut wait = 0;
    if let Some(b) = byte {
        wait = wait.max(b.wait(BYTE_TAT.load(Relaxed), now));
    }
    if let Some(w) = wqe {
        wait = wait.max(w.wait(WQE_TAT.load(Relaxed), now));
    }
    let mut changed = false;
    let route = dest
        .filter(|_| CAPS_CONSULTED.load(Relaxed))
        .map(|(gid, route)| {
            if !route.holds(gid, CAPS_GENERATION.load(Acquire), now) {
                let mut c = CAPS.lock();
                let (fresh, ch) = c.route(gid, now);
                if ch {
                    CAP_IN_FORCE.store(c.peers.any_in_force(), Relaxed);
                    CAPS_CHANGED.store(true, Relaxed);
                }
                drop(c);
                changed = ch;
                *route = fresh;
            }
            route
        });
    if let Some(cap) = route.as_ref().and_then(|r| r.cap()) {
        // Taken only when the app's own limiters let it go: a refused post consumes nothing.
        wait = if wait == 0 {
            cap.take(now, bytes).err().unwrap_or(0)
        } else {
            wait.max(cap.wait(now))
        };
    }
    // The engine's lock is taken after the caps' is released (the fork handlers take them
    // in the other order). Only the post that changed a cap wakes it: the engine clears
    // CAPS_CHANGED on its next pass, and posts until then need not take its lock.
    if changed {
        crate::wake::wake();
    }
    if wait > 0 {
        return Err(wait);
    }
    if let Some(b) = byte {
        let _ = BYTE_TAT.fetch_update(Relaxed, Relaxed, |t| Some(b.advance(t, now, bytes)));
    }
    if let Some(w) = wqe {
        let _ = WQE_TAT.fetch_update(Relaxed, Relaxed, |t| Some(w.advance(t, now, 1)));
    }
    if byte.is_some() || wqe.is_some() {
        crate::stats::STATS.paced(now, bytes);
    }
    Ok(())
}

/// Whether completions are metered (then [`completion_allowance`] decides).
pub fn completions_metered() -> bool {
    LIMITS.cqe[0].load(Relaxed) != 0
}

/// How many of `max` completions the polling grant lets the app have now (all of them
/// without one); `Err(wait_ps)` when none yet. Consumes nothing: the caller takes what is
/// there and pays with [`consume_completions`].
pub fn completion_allowance(now: u64, max: u64) -> Result<u64, u64> {
    let Some(g) = limiter(&LIMITS.cqe) else {
        return Ok(max);
    };
    if max == 0 {
        return Ok(0);
    }
    let t = CQE_TAT.load(Relaxed);
    match g.admit_up_to(t, now, max) {
        (0, _) => Err(g.wait(t, now).max(1)),
        (n, _) => Ok(n),
    }
}

/// Charges `n` delivered completions to the polling grant.
pub fn consume_completions(now: u64, n: u64) {
    if let Some(g) = limiter(&LIMITS.cqe).filter(|_| n > 0) {
        let _ = CQE_TAT.fetch_update(Relaxed, Relaxed, |t| Some(g.advance(t, now, n)));
    }
}

/// The tracking period of work in flight, bumped whenever tracking starts (see
/// [`InFlight::in_epoch`]).
pub static TRACKING_EPOCH: AtomicU64 = AtomicU64::new(0);

/// A rate limit is in force: the app's own, or a receiver's cap.
pub fn paced() -> bool {
    limiter(&LIMITS.byte).is_some() || limiter(&LIMITS.wqe).is_some() || CAP_IN_FORCE.load(Relaxed)
}

/// How far ahead of `now` the polling grant is spent, in ps (a diagnostic).
pub fn cqe_ahead_ps(now: u64) -> u64 {
    CQE_TAT.load(Relaxed).saturating_sub(now)
}

/// The byte, WQE and completion rates in force, per second (0: none).
pub fn rates() -> [u64; 3] {
    [&LIMITS.byte, &LIMITS.wqe, &LIMITS.cqe]
        .map(|c| limiter(c).map_or(0, |g| (1e12 / g.interval_ps() as f64).round() as u64))
}
