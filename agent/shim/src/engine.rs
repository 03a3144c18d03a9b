//! The shim's engine thread, one per process, started with the first governed context:
//! it attaches to the host's agent (and re-attaches after the agent restarts), applies the
//! agent's grant, reports the app's counters into the shared table, sends the app's events,
//! rotates the gate's slots, collects the completions the application leaves in the
//! dedicated CQs, and drains the software send queues at the granted rate.
//!
//! Fail-open: without an agent (none running, connection lost, heartbeat stopped, table
//! invalid) the grant is the environment's static one, normally none, so the application
//! runs unthrottled; the first such loss is reported once on stderr. If the thread itself
//! fails, every limit is lifted and what is queued is posted, so nothing stalls.

use crate::context::{lookup, totals, COLD, SLOTS};
use crate::drain::drain;
use crate::ffi::{IbvQp, IBV_QPS_RTS};
use crate::govern;
use crate::limits::{self, LIMITS};
use crate::link::{Link, DEFAULT_SOCKET};
use crate::nic_pace;
use crate::pacer::{parse_count, parse_rate};
use crate::stats::STATS;
use crate::trouble::{warn_once, Trouble};
use crate::wake;
use drum_table::layout::{monotonic_ms, Grant, Table};
use drum_table::message::{app_identity, ShimMsg};
use drum_table::profile::mean_wqe_bytes;
use std::collections::BTreeMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering::Acquire, Ordering::Relaxed, Ordering::Release};
use std::time::{Duration, Instant};

/// The first attach attempt is over (so the first posts are already governed).
static FIRST_ATTEMPT: AtomicBool = AtomicBool::new(false);

/// How often the link to the agent is checked and counters are reported.
const LINK_TICK: Duration = Duration::from_millis(20);
/// How often the connected QPs' byte counts are reported (`BYTES`, for the ones that
/// changed): the agent measures rates over 200 ms, so more often would only cost messages.
const BYTES_PERIOD: Duration = Duration::from_millis(250);
/// Retry interval while no agent is reachable.
const RETRY: Duration = Duration::from_millis(500);
/// A table whose heartbeat is older than this belongs to a hung agent.
const HEARTBEAT_TIMEOUT_MS: u64 = 2000;
/// Longest sleep while work is queued (the limiters say exactly when; this bounds a
/// missed wake-up).
const MAX_WAIT: Duration = Duration::from_millis(1);
/// Longest sleep while QPs wait for a gate slot: a holder hands its slot on once the shim
/// has seen its work complete, which must not wait for the application to poll.
const GATED_COLLECT: Duration = Duration::from_micros(200);

/// Starts this process's engine if it has none; waits (briefly) for its first attempt to
/// reach the agent.
pub fn ensure_started() {
    let pid = std::process::id();
    {
        let mut e = wake::ENGINE.lock();
        if matches!(&*e, Some((p, _)) if *p == pid) {
            return;
        }
        FIRST_ATTEMPT.store(false, Relaxed);
        match std::thread::Builder::new()
            .name("drum-shim".into())
            .spawn(run)
        {
            Ok(h) => *e = Some((pid, h.thread().clone())),
            Err(err) => {
                warn_once(
                    Trouble::Engine,
                    &format!("cannot start the engine thread ({err}); running ungoverned"),
                );
                return;
            }
        }
    }
    let deadline = Instant::now() + Duration::from_millis(1500);
    while !FIRST_ATTEMPT.load(Acquire) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_micros(200));
    }
}

/// The grant from the environment, used while no agent is attached (normally none).
pub fn env_grant() -> Result<Option<Grant>, String> {
    let v = |n: &str| std::env::var(n).ok();
    let bytes = parse_rate(
        "DRUM_SHIM_RATE_BYTES_PER_S",
        v("DRUM_SHIM_RATE_BYTES_PER_S").as_deref(),
    )?;
    let wqes = parse_rate(
        "DRUM_SHIM_RATE_WQE_PER_S",
        v("DRUM_SHIM_RATE_WQE_PER_S").as_deref(),
    )?;
    let cqes = parse_rate(
        "DRUM_SHIM_RATE_CQE_PER_S",
        v("DRUM_SHIM_RATE_CQE_PER_S").as_deref(),
    )?;
    let burst = parse_count(
        "DRUM_SHIM_BURST_BYTES",
        v("DRUM_SHIM_BURST_BYTES").as_deref(),
        1,
    )?;
    let k = parse_count(
        "DRUM_SHIM_MAX_ACTIVE_QPS",
        v("DRUM_SHIM_MAX_ACTIVE_QPS").as_deref(),
        1,
    )?;
    let quantum = parse_count(
        "DRUM_SHIM_QUANTUM_US",
        v("DRUM_SHIM_QUANTUM_US").as_deref(),
        1,
    )?;
    if bytes.is_none() && wqes.is_none() && cqes.is_none() && k.is_none() {
        return Ok(None);
    }
    let g = Grant {
        rate_bytes_per_s: bytes.map_or(0, |r| r.round() as u64),
        burst_bytes: burst.unwrap_or(0),
        rate_wqe_per_s: wqes.map_or(0, |r| r.round() as u64),
        rate_cqe_per_s: cqes.map_or(0, |r| r.round() as u64),
        max_active_qps: k.unwrap_or(0),
        quantum_us: quantum.unwrap_or(0),
        ..Grant::default()
    };
    g.validate().map_err(|e| e.to_string())?;
    Ok(Some(g))
}

fn log_enabled() -> bool {
    std::env::var_os("DRUM_SHIM_LOG").is_some_and(|v| v == "1")
}

/// Per-receiver caps: (receiver GID, bytes/s).
type Caps = Vec<([u8; 16], u64)>;

struct Engine {
    socket: PathBuf,
    hello: ShimMsg,
    static_grant: Option<Grant>,
    link: Option<Link>,
    next_attempt: Instant,
    next_tick: Instant,
    next_rotate: Instant,
    applied: Option<(u64, Caps)>,
    /// Every connected QP, replayed to an agent that (re)attaches.
    qps: BTreeMap<u32, ShimMsg>,
    next_bytes: Instant,
    /// The byte counts last reported per connected QP (cleared for an agent that attaches).
    bytes_sent: BTreeMap<u32, (u64, u64)>,
    /// The grant in force as the NIC's pacing needs it: bytes per second and QP gate.
    paced_grant: (u64, u64),
    /// `DRUM_SHIM_NIC_PACING=0` turns packet pacing on the NIC off.
    nic_pacing: bool,
    /// Whether some QP was left paced on the NIC by the last pass: without a grant, only
    /// such a QP needs `pace_nic`, which otherwise takes the process's cold lock for nothing.
    nic_paced_left: bool,
}

/// Set once a NIC refused to pace a QP for a reason other than its state: no more tries.
static NIC_PACING_REFUSED: AtomicBool = AtomicBool::new(false);

/// What of a grant the NIC's pacing follows: its byte rate and QP gate.
fn pacing_terms(g: Option<&Grant>) -> (u64, u64) {
    g.map_or((0, 0), |g| (g.rate_bytes_per_s, g.max_active_qps))
}

fn q_num(qp: *mut IbvQp) -> u32 {
    // SAFETY: called with a live QP under its `gov` lock.
    unsafe { (*qp).qp_num }
}

fn run() {
    // The engine sleeps for limiter intervals of microseconds: ask for precise wake-ups.
    // SAFETY: prctl on the calling thread only.
    unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1u64, 0, 0, 0) };
    let r = catch_unwind(AssertUnwindSafe(|| {
        let mut e = Engine::new();
        e.link_tick(Instant::now());
        FIRST_ATTEMPT.store(true, Release);
        e.run()
    }));
    if r.is_err() {
        FIRST_ATTEMPT.store(true, Release);
        warn_once(
            Trouble::Engine,
            "internal error in the engine thread; limits lifted, the application runs ungoverned",
        );
        let _ = catch_unwind(|| {
            govern::apply(None);
            limits::set_caps(&[]);
            limits::set_nic_table(None);
            LIMITS.active.store(false, Release);
            // Post what is still held back, so no work request is lost or stalls.
            while drain().is_some() {}
        });
    }
}

impl Engine {
    fn new() -> Engine {
        let socket = std::env::var_os("DRUM_AGENT_SOCKET")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(DEFAULT_SOCKET));
        let exe = std::fs::read_link("/proc/self/exe")
            .map(|p| p.to_string_lossy().into_owned())
            .unwrap_or_default();
        let app = app_identity(std::env::var("DRUM_APP").ok().as_deref(), &exe);
        let static_grant = match env_grant() {
            Ok(g) => g,
            Err(why) => {
                warn_once(
                    Trouble::PacerConfig,
                    &format!("{why}; ignoring the static grant"),
                );
                None
            }
        };
        govern::apply(static_grant.as_ref());
        let now = Instant::now();
        Engine {
            socket,
            hello: ShimMsg::Hello {
                pid: std::process::id(),
                app,
                exe,
            },
            static_grant,
            link: None,
            next_attempt: now,
            next_tick: now,
            next_rotate: now,
            applied: None,
            qps: BTreeMap::new(),
            next_bytes: now,
            bytes_sent: BTreeMap::new(),
            paced_grant: pacing_terms(static_grant.as_ref()),
            nic_pacing: std::env::var_os("DRUM_SHIM_NIC_PACING").is_none_or(|v| v != "0"),
            nic_paced_left: false,
        }
    }

    fn run(&mut self) -> ! {
        loop {
            let now = Instant::now();
            if now >= self.next_tick {
                self.link_tick(now);
                self.next_tick = now + LINK_TICK;
            } else if limits::CAPS_CHANGED.swap(false, Relaxed) {
                self.pace_nic();
            }
            self.send_events();
            self.rotate(now);
            collect();
            let gated = gate_has_waiters();
            let sleep = match drain() {
                Some(ps) => Duration::from_nanos(ps / 1000).min(MAX_WAIT),
                None => self
                    .next_tick
                    .saturating_duration_since(Instant::now())
                    .max(Duration::from_micros(100)),
            };
            let sleep = if gated {
                sleep.min(GATED_COLLECT)
            } else {
                sleep
            };
            if !sleep.is_zero() {
                std::thread::park_timeout(sleep);
            }
        }
    }

    /// Checks the agent link, (re)attaches, applies a new grant, reports counters, and
    /// keeps the NIC's pacing of the connected QPs in line with the grant.
    fn link_tick(&mut self, now: Instant) {
        self.check_link(now);
        self.pace_nic();
        crate::nic_table::recheck();
    }

    /// Paces each connected QP on the NIC at its share of the byte grant (`nic_pace`), or at
    /// its receiver's cap if lower (run again at once when a cap changes); a QP the
    /// application paces itself is left alone, and a NIC that refuses is said once.
    fn pace_nic(&mut self) {
        if NIC_PACING_REFUSED.load(Relaxed) || !self.nic_pacing {
            return;
        }
        let (rate, gate) = self.paced_grant;
        let capped = limits::CAP_IN_FORCE.load(Relaxed);
        if self.qps.is_empty() || (rate == 0 && !capped && !self.nic_paced_left) {
            return;
        }
        let bytes_per_wqe = if rate == 0 && !capped {
            None
        } else {
            let t = totals();
            mean_wqe_bytes(t.counts.send_bytes, t.counts.send_wqes)
        };
        let sending = nic_pace::sending_qps(self.qps.len(), gate);
        let mut paced_left = false;
        crate::context::with_qps(self.qps.keys().copied(), |q| {
            let mut g = q.gov.lock().unwrap_or_else(|e| e.into_inner());
            let qp = g.qp as *mut IbvQp;
            if qp.is_null() || g.app_paced {
                return;
            }
            // Pacing a READ's requester paces its requests, not the data they bring back; and
            // a QP others read through would hold their READ responses to this app's grant.
            let reads = q.read_bytes.load(Relaxed) > 0;
            let target = if reads || g.serves_reads {
                None
            } else {
                let grant = nic_pace::qp_kbps(rate, sending, bytes_per_wqe, g.path_mtu);
                let cap = g
                    .peer
                    .and_then(limits::cap_rate_of)
                    .and_then(|c| nic_pace::cap_kbps(c, bytes_per_wqe, g.path_mtu));
                match (grant, cap) {
                    (Some(a), Some(b)) => Some(a.min(b)),
                    (a, b) => a.or(b),
                }
            };
            // Errs towards one more pass: a QP cleared below is counted until the next one.
            paced_left |= g.nic_kbps.is_some() || target.is_some();
            let current = if g.nic_paced { g.nic_kbps } else { None };
            if g.nic_kbps == target || !nic_pace::worth_changing(current, target) {
                return;
            }
            // SAFETY: a live QP (its record names it) whose `gov` lock is held, which
            // `ibv_destroy_qp`'s interposition must take before the QP is freed.
            if unsafe { (*qp).state } != IBV_QPS_RTS {
                return;
            }
            // SAFETY: as above.
            let rc = unsafe { crate::qp_verbs::set_rate_limit(qp, target.unwrap_or(0)) };
            g.nic_kbps = target;
            g.nic_paced = rc == 0 && target.is_some();
            let counter = if rc == 0 {
                &STATS.nic_pacing_sets
            } else {
                &STATS.nic_pacing_refusals
            };
            counter.fetch_add(1, Relaxed);
            if matches!(rc, libc::EOPNOTSUPP | libc::ENOSYS) {
                NIC_PACING_REFUSED.store(true, Relaxed);
            }
            if rc != 0 && target.is_some() {
                warn_once(
                    Trouble::NicPacing,
                    &format!(
                        "the NIC refused packet pacing for QP {} (errno {rc}); its bursts are paced per work request only",
                        q_num(qp)
                    ),
                );
            }
        });
        self.nic_paced_left = paced_left;
    }

    fn check_link(&mut self, now: Instant) {
        if let Some(l) = &self.link {
            let why = if l.closed() {
                Some("the agent closed the connection".to_string())
            } else if monotonic_ms().saturating_sub(l.table().heartbeat_ms()) > HEARTBEAT_TIMEOUT_MS
            {
                Some("the agent's heartbeat stopped".to_string())
            } else {
                None
            };
            match why.map_or_else(|| self.apply_table(), Err) {
                Ok(()) => {
                    report(self.link.as_ref().expect("attached").table());
                    if now >= self.next_bytes {
                        self.next_bytes = now + BYTES_PERIOD;
                        self.report_bytes();
                    }
                    return;
                }
                Err(why) => self.detach(&why),
            }
        }
        if now < self.next_attempt {
            return;
        }
        self.next_attempt = now + RETRY;
        match Link::attach(&self.socket, &self.hello) {
            Ok(l) => {
                if log_enabled() {
                    crate::trouble::write_stderr(&format!(
                        "drum-shim: attached to the agent at {} as app {}\n",
                        self.socket.display(),
                        l.app
                    ));
                }
                for m in self.qps.values() {
                    l.send(m);
                }
                self.bytes_sent.clear();
                self.link = Some(l);
                self.applied = None;
                if let Err(why) = self.apply_table() {
                    self.detach(&why);
                }
            }
            Err(why) => {
                warn_once(
                    Trouble::NoAgent,
                    &format!("no DRUM agent ({why}); the application runs ungoverned until one is reachable"),
                );
            }
        }
    }

    /// Sends the byte counts of the connected QPs whose counts changed since last sent.
    fn report_bytes(&mut self) {
        let Some(l) = &self.link else {
            return;
        };
        for (qpn, out, back) in crate::context::qp_bytes(self.qps.keys().copied()) {
            if self.bytes_sent.insert(qpn, (out, back)) != Some((out, back)) {
                l.send(&ShimMsg::Bytes { qpn, out, back });
            }
        }
    }

    /// Reads and applies the table's grant and caps when they changed.
    fn apply_table(&mut self) -> Result<(), String> {
        let t = self.link.as_ref().expect("attached").table();
        let g = t.read_grant().map_err(|e| format!("invalid table: {e}"))?;
        let caps = t.peer_caps().map_err(|e| format!("invalid table: {e}"))?;
        let key = (g.generation, caps.clone());
        if self.applied.as_ref() != Some(&key) {
            limits::set_caps(&caps);
            govern::apply(Some(&g));
            self.paced_grant = pacing_terms(Some(&g));
            t.shim.applied_generation.store(g.generation, Relaxed);
            self.applied = Some(key);
        }
        Ok(())
    }

    fn detach(&mut self, why: &str) {
        self.link = None;
        self.applied = None;
        limits::set_caps(&[]);
        govern::apply(self.static_grant.as_ref());
        self.paced_grant = pacing_terms(self.static_grant.as_ref());
        warn_once(
            Trouble::AgentLost,
            &format!("{why}; the application runs ungoverned until the agent returns"),
        );
        self.next_attempt = Instant::now() + RETRY;
    }

    fn send_events(&mut self) {
        let events = std::mem::take(&mut *govern::EVENTS.lock());
        for m in events {
            match &m {
                ShimMsg::QpUp { qpn, .. } => {
                    self.qps.insert(*qpn, m.clone());
                }
                ShimMsg::QpGone { qpn } => {
                    self.qps.remove(qpn);
                    self.bytes_sent.remove(qpn);
                }
                _ => {}
            }
            if let Some(l) = &self.link {
                l.send(&m);
            }
        }
    }

    /// Asks long holders to hand their gate slots on, and releases drained ones that are
    /// already idle.
    fn rotate(&mut self, now: Instant) {
        let k = LIMITS.k.load(Relaxed) as usize;
        if k == 0 || now < self.next_rotate {
            return;
        }
        let quantum = LIMITS.quantum_ns.load(Relaxed).max(1000);
        self.next_rotate = now + Duration::from_nanos(quantum / 4);
        let told = govern::GATE
            .lock()
            .rotate(limits::now_ps() / 1000, quantum, k);
        let _g = COLD.lock();
        for id in told {
            let (idx, qpn) = ((id >> 32) as usize, id as u32);
            let Some(slot) = SLOTS.get(idx) else {
                continue;
            };
            if let Some(st) = lookup(slot.key.load(Acquire) as *mut _) {
                if let Some(q) = st.qps.get(qpn) {
                    govern::settle(st, q, qpn);
                }
            }
        }
    }
}

/// Moves completions from the dedicated CQs their applications leave alone into the
/// virtual ones and follows them, so the gate hands slots on (and the agent sees them)
/// while the application does not poll.
fn collect() {
    let _g = COLD.lock();
    crate::vcq::harvest();
}

fn gate_has_waiters() -> bool {
    LIMITS.k.load(Relaxed) > 0 && govern::GATE.lock().waiting() > 0
}

/// Writes the app's counters into the agent's table.
fn report(t: &Table) {
    let tot = totals();
    let s = &t.shim;
    s.send_wqes.store(tot.counts.send_wqes, Relaxed);
    s.send_bytes.store(tot.counts.send_bytes, Relaxed);
    s.completions.store(tot.counts.completions, Relaxed);
    s.deferred_wqes
        .store(STATS.deferred_wqes.load(Relaxed), Relaxed);
    s.queue_delay_ns
        .store(STATS.queue_delay_ns.load(Relaxed), Relaxed);
    s.queued_wqes.store(tot.queued_wqes, Relaxed);
    s.nic_outstanding_wqes.store(tot.outstanding_wqes, Relaxed);
    s.held_polls.store(STATS.held_polls.load(Relaxed), Relaxed);
    s.direct_verbs_queues
        .store(crate::direct::QUEUES_TAKEN.load(Relaxed), Relaxed);
    s.deferred_post_errors
        .store(STATS.deferred_post_errors.load(Relaxed), Relaxed);
    s.qps.store(tot.qps, Relaxed);
    s.active_qps
        .store(govern::GATE.lock().holders() as u64, Relaxed);
}
