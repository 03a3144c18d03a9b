//! Statistics of the governed path, reported in the exit summary and to the agent.

use std::sync::atomic::AtomicU64;

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
};

/// WRs held back in all software queues of the process.
pub static QUEUED: AtomicU64 = AtomicU64::new(0);
