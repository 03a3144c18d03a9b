//! When the coordinator re-selects once the selection schedule is done (docs/design.md §2: every
//! `T_sel`, and when an app arrives or leaves). Pure: the time and the iteration numbers come
//! in as arguments.
//!
//! * **Periodic.** An exchange is due `T_sel` after the previous one ended, but only once
//!   `min_iters` ADMM iterations have run since (or fewer if both residuals are within
//!   tolerance): the swap decisions need prices that have caught up with the last swap —
//!   and only if something changed since the previous exchange started ([`Reselection::changed`]:
//!   membership, an operator change, an agent's inputs). A cluster whose apps and demands do
//!   not change therefore settles: after the schedule no app is parked or activated again,
//!   instead of the damped coin re-deciding near-ties (and the fairness memory rotating them)
//!   every `T_sel` for ever, each swap costing the NIC a QP-cache refill.
//! * **On request.** An agent whose set of running apps changed asks for an exchange at
//!   iteration `at` (its last iteration + 1). The exchange runs at the first round boundary
//!   with `iteration ≥ at`, after at least one round since the previous exchange.
//! * **Shards** share no clock, and a shard never hears a request sent to another shard by a
//!   host that does not talk to it; yet every shard must start the same exchange at the same
//!   iteration, or agents that talk to several shards hold one shard's `Select` while another
//!   sends rounds. So a sharded coordinator counts the period in iterations — `T_sel` divided
//!   by `round_interval`, at least `min_iters`, the same number `P` on every shard since they
//!   share the config — and ignores requests; an arrival then waits for the next periodic
//!   exchange. The exchanges fall on the absolute multiples of `P`, not `P` after each
//!   shard's previous one: a shard restarted alone has no previous one, and the numbering
//!   of iterations is what shards can agree on (they align it at joins, see
//!   `coordinator::Coordinator`), so every shard selects at the same round and gives the
//!   exchange the same number ([`Reselection::sharded_index`]).

use std::time::Duration;

#[derive(Clone, Debug, PartialEq)]
pub struct Reselection {
    /// `T_sel`; `None`: no periodic re-selection.
    period: Option<Duration>,
    min_iters: u32,
    /// Whether this coordinator is one shard of several (see the module doc).
    sharded: bool,
    /// With shards: the period in iterations.
    period_iters: Option<u32>,
    /// The lowest iteration at which some agent asked for an exchange.
    requested: Option<u64>,
    /// Something changed since the last exchange started (see the module doc).
    dirty: bool,
    /// When the last exchange ended.
    last: Duration,
}

impl Reselection {
    /// `round_interval` is `Some` only for a sharded coordinator (see the module doc).
    pub fn new(period: Option<Duration>, min_iters: u32, round_interval: Option<Duration>) -> Self {
        let min_iters = min_iters.max(1);
        let period_iters = round_interval.and_then(|ri| {
            let p = period?;
            let n = if ri.is_zero() {
                0
            } else {
                p.as_nanos().div_ceil(ri.as_nanos())
            };
            Some(u32::try_from(n).unwrap_or(u32::MAX).max(min_iters))
        });
        Self {
            period,
            min_iters,
            sharded: round_interval.is_some(),
            period_iters,
            requested: None,
            dirty: false,
            last: Duration::ZERO,
        }
    }

    /// `T_sel`, if periodic re-selection is on.
    pub fn period(&self) -> Option<Duration> {
        self.period
    }

    /// An agent asks for an exchange at iteration `at`; whether the request is taken (a
    /// sharded coordinator ignores requests).
    pub fn request(&mut self, at: u64) -> bool {
        if self.sharded {
            return false;
        }
        self.requested = Some(self.requested.map_or(at, |r| r.min(at)));
        true
    }

    /// Whether an exchange is due at a round boundary: `iteration` completed, `iters_since`
    /// iterations since the last exchange, `converged` when both residuals are within their
    /// tolerance.
    pub fn due(&self, now: Duration, iteration: u64, iters_since: u32, converged: bool) -> bool {
        if iters_since == 0 {
            return false;
        }
        if self.sharded {
            return self
                .period_iters
                .is_some_and(|n| iteration.is_multiple_of(u64::from(n)));
        }
        let asked = self.requested.is_some_and(|at| iteration >= at);
        let periodic = self.dirty
            && self.period.is_some_and(|p| now >= self.last + p)
            && (iters_since >= self.min_iters || converged);
        asked || periodic
    }

    /// With shards: the number of the periodic exchange at iteration `iteration` (a multiple
    /// of the period), `first` being the number of the first exchange after the schedule.
    /// A function of the iteration alone, so shards that never talked agree on it; numbers
    /// grow with the iteration, and skip those of exchanges no shard ran.
    pub fn sharded_index(&self, first: u32, iteration: u64) -> Option<u32> {
        let n = u64::from(self.period_iters?);
        Some(first.saturating_add(u32::try_from(iteration / n).unwrap_or(u32::MAX)))
    }

    /// An exchange starts after iteration `iteration`: the requests it answers are done, and
    /// it sees every change so far.
    pub fn started(&mut self, iteration: u64) {
        self.requested = self.requested.filter(|&at| at > iteration);
        self.dirty = false;
    }

    /// Something the selection depends on changed: the next period may re-select.
    pub fn changed(&mut self) {
        self.dirty = true;
    }

    /// An exchange ended at `now`: the period counts from here.
    pub fn finished(&mut self, now: Duration) {
        self.last = now;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn periodic_needs_the_period_and_enough_iterations() {
        let mut r = Reselection::new(Some(100 * MS), 20, None);
        r.finished(1000 * MS);
        assert!(!r.due(1100 * MS, 500, 20, false), "nothing changed");
        r.changed();
        assert!(!r.due(1050 * MS, 500, 40, false), "period not elapsed");
        assert!(!r.due(1100 * MS, 500, 19, false), "too few iterations");
        assert!(r.due(1100 * MS, 500, 19, true), "converged early");
        assert!(r.due(1100 * MS, 500, 20, false));
        assert!(!r.due(5000 * MS, 500, 0, true), "never back to back");
        r.started(500);
        assert!(
            !r.due(5000 * MS, 600, 100, true),
            "the exchange saw the change"
        );
        let off = Reselection::new(None, 20, None);
        assert!(!off.due(Duration::from_secs(3600), 500, 1000, true));
    }

    #[test]
    fn a_request_is_served_at_the_first_boundary_reaching_its_iteration() {
        let mut r = Reselection::new(None, 20, None);
        assert!(r.request(12));
        assert!(r.request(15), "the earliest request counts");
        assert!(!r.due(MS, 11, 5, false));
        assert!(r.due(MS, 12, 1, false), "no need to wait for the period");
        r.started(12);
        assert!(!r.due(MS, 13, 1, false), "served");
        // A request arriving during the exchange, for after it, is kept.
        assert!(r.request(13));
        r.finished(2 * MS);
        assert!(r.due(2 * MS, 13, 1, false));
    }

    #[test]
    fn shards_count_the_period_in_iterations_and_ignore_requests() {
        // 100 ms at one round per 2 ms: every 50 iterations, whatever the clock says, at
        // the multiples of 50 however long ago the shard's last exchange was (a restarted
        // shard and a running one agree), and numbered by the iteration alone.
        let mut r = Reselection::new(Some(100 * MS), 20, Some(2 * MS));
        assert!(!r.request(3));
        assert!(!r.due(Duration::from_secs(60), 149, 49, true));
        assert!(r.due(Duration::ZERO, 150, 50, false));
        assert!(
            r.due(Duration::ZERO, 150, 7, false),
            "a restarted shard too"
        );
        assert!(!r.due(Duration::ZERO, 150, 0, false), "never back to back");
        assert!(!r.due(Duration::ZERO, 170, 70, false));
        assert_eq!(r.sharded_index(3, 150), Some(6));
        assert_eq!(r.sharded_index(3, 200), Some(7));
        // Never fewer than `min_iters`, also when rounds run back to back.
        for interval in [Duration::ZERO, 50 * MS] {
            let r = Reselection::new(Some(100 * MS), 20, Some(interval));
            assert!(!r.due(MS, 19, 19, true) && r.due(MS, 20, 20, false));
        }
        let off = Reselection::new(None, 20, Some(2 * MS));
        assert!(!off.due(MS, 0, u32::MAX, true));
    }
}
