//! How long batches are in flight, measured so that the run's end does not cut it short.
//!
//! The mean over completed batches leaves out the batches still in flight when a run stops,
//! and in a closed loop whose batches wait longer than the run lasts those are the slow
//! ones. Test case 3 at 400 connections under SHARE keeps about 10,500 READs in flight: in
//! an 8-s run the 186 batches that completed took 5.3 s on average, while the rate at which
//! operations completed says a batch takes about 16 s (docs/testbed.md, "tc3's latency per
//! batch").
//!
//! Little's law instead: the mean time a batch is in flight is the mean number in flight
//! over the rate batches complete. The number in flight is measured over the run, a batch
//! given up at the end counting until then. The rate counts each completed operation as the
//! fraction of its batch it completes, so that a batch half done by the end counts half:
//! counting whole batches would again favour the quick ones. With a constant number in
//! flight (a closed loop) and operations completing steadily, this is exact even for a run
//! shorter than one batch (tests below).

use serde::{Deserialize, Serialize};
use std::time::Instant;

/// Batches' time in flight within a measured interval, and how many batches' worth of
/// operations completed in it.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
pub struct InFlightTime {
    ns: u128,
    completed: f64,
}

/// The interval measured: from `from` until `until` (`None` while the run goes on).
#[derive(Debug, Clone, Copy)]
pub struct Interval {
    pub from: Instant,
    pub until: Option<Instant>,
}

impl Interval {
    fn contains(&self, t: Instant) -> bool {
        t >= self.from && self.until.is_none_or(|u| t <= u)
    }
}

impl InFlightTime {
    /// A batch posted at `start` was in flight until `end`: when it completed, or when it
    /// was given up.
    pub fn in_flight(&mut self, start: Instant, end: Instant, within: Interval) {
        let end = within.until.map_or(end, |u| end.min(u));
        self.ns += end
            .saturating_duration_since(start.max(within.from))
            .as_nanos();
    }

    /// One operation of a batch of `ops` completed at `at`.
    pub fn op_completed(&mut self, ops: usize, at: Instant, within: Interval) {
        if within.contains(at) {
            self.completed += 1.0 / ops.max(1) as f64;
        }
    }

    pub fn merge(&mut self, o: &InFlightTime) {
        self.ns += o.ns;
        self.completed += o.completed;
    }

    pub fn summary(&self) -> InFlightSummary {
        InFlightSummary::new(self.ns as f64 / 1e9, self.completed)
    }
}

/// [`InFlightTime`] in a client's summary.
#[derive(Debug, Default, Clone, Copy, Serialize, Deserialize, PartialEq)]
pub struct InFlightSummary {
    /// Seconds batches spent in flight within the measured interval, all batches together.
    pub seconds: f64,
    /// Batches completed within the measured interval, each operation counting as the
    /// fraction of its batch it is.
    pub completed: f64,
    /// `seconds` ÷ `completed` (µs), 0 if nothing completed.
    pub mean_us: f64,
}

impl InFlightSummary {
    pub fn new(seconds: f64, completed: f64) -> Self {
        let mean_us = if completed > 0.0 {
            seconds * 1e6 / completed
        } else {
            0.0
        };
        InFlightSummary {
            seconds,
            completed,
            mean_us,
        }
    }

    /// Clients that ran at the same time: their batches' time and completions add up.
    pub fn merge(all: impl IntoIterator<Item = InFlightSummary>) -> Self {
        let (s, n) = all
            .into_iter()
            .fold((0.0, 0.0), |(s, n), x| (s + x.seconds, n + x.completed));
        InFlightSummary::new(s, n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn at(t0: Instant, ms: u64) -> Instant {
        t0 + Duration::from_millis(ms)
    }

    /// `conns` connections, each posting back to back batches of `ops` operations that
    /// complete one every `step_ms`, the first batches posted at `offset(c)`; measured over
    /// `within`, every batch still in flight at `end_ms` given up.
    fn closed_loop(
        t0: Instant,
        conns: u64,
        ops: u64,
        step_ms: u64,
        offset: impl Fn(u64) -> u64,
        end_ms: u64,
        within: Interval,
    ) -> InFlightSummary {
        let mut f = InFlightTime::default();
        for c in 0..conns {
            let mut start = offset(c);
            while start < end_ms {
                let done = start + ops * step_ms;
                for t in (1..=ops)
                    .map(|i| start + i * step_ms)
                    .filter(|&t| t <= end_ms)
                {
                    f.op_completed(ops as usize, at(t0, t), within);
                }
                f.in_flight(at(t0, start), at(t0, done.min(end_ms)), within);
                start = done;
            }
        }
        f.summary()
    }

    /// One connection whose batches of 10 operations take 10 s, measured for 4 s: no batch
    /// completes (a mean of completed batches has nothing), yet 4 operations are 0.4 of a
    /// batch in 4 s of one batch in flight: 10 s.
    #[test]
    fn a_run_shorter_than_a_batch_measures_it() {
        let t0 = Instant::now();
        let run = Interval {
            from: t0,
            until: Some(at(t0, 4000)),
        };
        let s = closed_loop(t0, 1, 10, 1000, |_| 0, 5000, run);
        assert!((s.completed - 0.4).abs() < 1e-9, "{s:?}");
        assert!((s.seconds - 4.0).abs() < 1e-9, "{s:?}");
        assert!((s.mean_us - 10e6).abs() < 1e-3, "{s:?}");
    }

    /// Ten connections posting at the same moment (as the client does once connected),
    /// batches of 4 operations over 2 s, measured for 3 s: each connection completed one
    /// batch and half of the next: 15 batches in 30 s of ten in flight, 2 s each.
    /// Staggered starts and an interval that cuts batches at both ends give the same.
    #[test]
    fn a_constant_population_gives_the_batches_own_time() {
        let t0 = Instant::now();
        let run = Interval {
            from: t0,
            until: Some(at(t0, 3000)),
        };
        let s = closed_loop(t0, 10, 4, 500, |_| 0, 4000, run);
        assert!((s.completed - 15.0).abs() < 1e-9, "{s:?}");
        assert!((s.seconds - 30.0).abs() < 1e-9, "{s:?}");
        assert!((s.mean_us - 2e6).abs() < 1e-3, "{s:?}");
        let cut = Interval {
            from: at(t0, 2000),
            until: Some(at(t0, 12_000)),
        };
        let s = closed_loop(t0, 10, 4, 500, |c| c * 200 + 50, 14_000, cut);
        assert!((s.seconds - 100.0).abs() < 1e-9, "{s:?}");
        assert!((s.completed - 50.0).abs() < 1e-9, "{s:?}");
        assert!((s.mean_us - 2e6).abs() < 1e-3, "{s:?}");
    }

    /// Before the interval, after it, and a run that is not over: nothing outside counts.
    #[test]
    fn only_the_interval_counts() {
        let t0 = Instant::now();
        let run = Interval {
            from: at(t0, 1000),
            until: Some(at(t0, 2000)),
        };
        let mut f = InFlightTime::default();
        f.in_flight(at(t0, 0), at(t0, 500), run);
        f.op_completed(1, at(t0, 500), run);
        f.in_flight(at(t0, 2500), at(t0, 3000), run);
        f.op_completed(1, at(t0, 3000), run);
        f.in_flight(at(t0, 1500), at(t0, 2500), run);
        f.op_completed(2, at(t0, 1800), run);
        assert_eq!(f.summary(), InFlightSummary::new(0.5, 0.5));
        let open = Interval {
            from: t0,
            until: None,
        };
        f.in_flight(at(t0, 0), at(t0, 5000), open);
        f.op_completed(2, at(t0, 5000), open);
        assert_eq!(f.summary(), InFlightSummary::new(5.5, 1.0));
        assert_eq!(InFlightSummary::new(0.0, 0.0).mean_us, 0.0);
    }

    #[test]
    fn clients_merge_by_adding_time_and_completions() {
        let m = InFlightSummary::merge([
            InFlightSummary::new(4.0, 2.0),
            InFlightSummary::new(2.0, 2.0),
        ]);
        assert_eq!(m, InFlightSummary::new(6.0, 4.0));
        assert!((m.mean_us - 1.5e6).abs() < 1e-6);
    }
}
