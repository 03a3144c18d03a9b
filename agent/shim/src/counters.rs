//! In-memory counters of what an application does through the governed verbs, per context
//! (and for all closed contexts together); each QP's are in its record (`qp`). Lock-free
//! (relaxed atomics), because they are updated on the data path by whichever threads post
//! and poll.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// Counters of one context (or of all closed contexts together).
#[derive(Default)]
pub struct Counters {
    pub send_wqes: AtomicU64,
    pub send_bytes: AtomicU64,
    pub recv_wqes: AtomicU64,
    pub srq_recv_wqes: AtomicU64,
    pub completions: AtomicU64,
    pub completion_errors: AtomicU64,
    pub poll_calls: AtomicU64,
    pub notify_arms: AtomicU64,
}

impl Counters {
    pub const fn new() -> Counters {
        Counters {
            send_wqes: AtomicU64::new(0),
            send_bytes: AtomicU64::new(0),
            recv_wqes: AtomicU64::new(0),
            srq_recv_wqes: AtomicU64::new(0),
            completions: AtomicU64::new(0),
            completion_errors: AtomicU64::new(0),
            poll_calls: AtomicU64::new(0),
            notify_arms: AtomicU64::new(0),
        }
    }

    pub fn snapshot(&self) -> Snapshot {
        Snapshot {
            send_wqes: self.send_wqes.load(Relaxed),
            send_bytes: self.send_bytes.load(Relaxed),
            recv_wqes: self.recv_wqes.load(Relaxed),
            srq_recv_wqes: self.srq_recv_wqes.load(Relaxed),
            completions: self.completions.load(Relaxed),
            completion_errors: self.completion_errors.load(Relaxed),
            poll_calls: self.poll_calls.load(Relaxed),
            notify_arms: self.notify_arms.load(Relaxed),
        }
    }

    /// Folds `s` in (a context being closed adds its counts to the closed totals).
    pub fn add(&self, s: &Snapshot) {
        self.send_wqes.fetch_add(s.send_wqes, Relaxed);
        self.send_bytes.fetch_add(s.send_bytes, Relaxed);
        self.recv_wqes.fetch_add(s.recv_wqes, Relaxed);
        self.srq_recv_wqes.fetch_add(s.srq_recv_wqes, Relaxed);
        self.completions.fetch_add(s.completions, Relaxed);
        self.completion_errors
            .fetch_add(s.completion_errors, Relaxed);
        self.poll_calls.fetch_add(s.poll_calls, Relaxed);
        self.notify_arms.fetch_add(s.notify_arms, Relaxed);
    }
}

/// A plain copy of [`Counters`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Snapshot {
    pub send_wqes: u64,
    pub send_bytes: u64,
    pub recv_wqes: u64,
    pub srq_recv_wqes: u64,
    pub completions: u64,
    pub completion_errors: u64,
    pub poll_calls: u64,
    pub notify_arms: u64,
}

impl Snapshot {
    pub fn merge(&mut self, o: &Snapshot) {
        self.send_wqes += o.send_wqes;
        self.send_bytes += o.send_bytes;
        self.recv_wqes += o.recv_wqes;
        self.srq_recv_wqes += o.srq_recv_wqes;
        self.completions += o.completions;
        self.completion_errors += o.completion_errors;
        self.poll_calls += o.poll_calls;
        self.notify_arms += o.notify_arms;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_fold_into_totals() {
        let a = Counters::new();
        a.send_wqes.fetch_add(3, Relaxed);
        a.completions.fetch_add(2, Relaxed);
        let total = Counters::new();
        total.add(&a.snapshot());
        total.add(&a.snapshot());
        let mut s = total.snapshot();
        assert_eq!((s.send_wqes, s.completions), (6, 4));
        s.merge(&a.snapshot());
        assert_eq!(s.send_wqes, 9);
    }
}
