//! Statistics of the governed path, reported in the exit summary and to the agent.

use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::Relaxed;

/// Statistics of the governed path (reported in the summary and to the agent).
pub struct Stats {
    pub direct_wqes: AtomicU64,
    pub deferred_wqes: AtomicU64,
    pub queue_delay_ns: AtomicU64,
    pub deferred_post_errors: AtomicU64,
    pub dropped_wqes: AtomicU64,
    pub unqueueable_wqes: AtomicU64,
    /// Polls that found completions the polling grant held back: the app wanted them
    /// sooner than its grant lets it have them, which the agent counts as demand.
    pub held_polls: AtomicU64,
    /// Packet-pacing changes the NIC took (`nic_pace`), and the ones it refused.
    pub nic_pacing_sets: AtomicU64,
    pub nic_pacing_refusals: AtomicU64,
    /// WQEs and bytes the process's own rate limits admitted, and the shim's clock (ps) at
    /// the first and the last of them: the rate the pacer let out, on a clock the tests can
    /// trust (perftest's cycle counter is converted at a frequency it may re-estimate on a
    /// loaded machine, silently, by more than 2 %).
    pub paced_wqes: AtomicU64,
    pub paced_bytes: AtomicU64,
    pub paced_first_ps: AtomicU64,
    pub paced_last_ps: AtomicU64,
}

impl Stats {
    /// Counts one WQE of `bytes` admitted at `now` under the process's own rate limits.
    pub fn paced(&self, now: u64, bytes: u64) {
        self.paced_wqes.fetch_add(1, Relaxed);
        self.paced_bytes.fetch_add(bytes, Relaxed);
        // A load first: after the first admission the compare-and-swap would fail on every post.
        if self.paced_first_ps.load(Relaxed) == 0 {
            let _ = self
                .paced_first_ps
                .compare_exchange(0, now.max(1), Relaxed, Relaxed);
        }
        self.paced_last_ps.fetch_max(now, Relaxed);
    }

    /// Microseconds from the first to the last paced admission.
    pub fn paced_span_us(&self) -> u64 {
        let first = self.paced_first_ps.load(Relaxed);
        if first == 0 {
            return 0;
        }
        self.paced_last_ps.load(Relaxed).saturating_sub(first) / 1_000_000
    }
}

pub static STATS: Stats = Stats {
    direct_wqes: AtomicU64::new(0),
    deferred_wqes: AtomicU64::new(0),
    queue_delay_ns: AtomicU64::new(0),
    deferred_post_errors: AtomicU64::new(0),
    dropped_wqes: AtomicU64::new(0),
    unqueueable_wqes: AtomicU64::new(0),
    held_polls: AtomicU64::new(0),
    nic_pacing_sets: AtomicU64::new(0),
    nic_pacing_refusals: AtomicU64::new(0),
    paced_wqes: AtomicU64::new(0),
    paced_bytes: AtomicU64::new(0),
    paced_first_ps: AtomicU64::new(0),
    paced_last_ps: AtomicU64::new(0),
};

/// WRs held back in all software queues of the process.
pub static QUEUED: AtomicU64 = AtomicU64::new(0);
