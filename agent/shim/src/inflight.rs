//! Work in flight on one QP's send queue, as the shim can know it: every WR it posted, and
//! the completions the application polls. A completion of a signalled WR means every
//! earlier WR of that send queue has completed too (in-order completion on RC), so
//! unsignalled WRs are accounted for by the next signalled one. An error completion ends
//! everything in flight (the QP is in error; the rest is flushed). Pure logic.

use std::collections::VecDeque;

#[derive(Debug, Clone, Default)]
pub struct InFlight {
    posted: u64,
    done: u64,
    /// Sequence numbers (1-based) of signalled WRs not yet completed.
    signalled: VecDeque<u64>,
    /// The tracking period these counts belong to (see [`InFlight::in_epoch`]).
    epoch: u64,
}

impl InFlight {
    /// These counts if they belong to tracking period `epoch`, else fresh ones. The shim
    /// follows completions only while it tracks work in flight: WRs posted in an earlier
    /// period may have completed unseen (the agent was away, the shim ran ungoverned), and
    /// counting them still in flight would keep the QP from ever being idle, so that it
    /// held its gate slot for ever and the app's other QPs starved (found by the chaos
    /// soak: a drum-kv client stalled after its agent was killed and came back).
    pub fn in_epoch(&mut self, epoch: u64) -> &mut InFlight {
        if self.epoch != epoch {
            *self = InFlight {
                epoch,
                ..InFlight::default()
            };
        }
        self
    }

    /// [`outstanding`](Self::outstanding) as of tracking period `epoch`.
    pub fn outstanding_in(&self, epoch: u64) -> u64 {
        if self.epoch == epoch {
            self.outstanding()
        } else {
            0
        }
    }

    pub fn on_post(&mut self, signalled: bool) {
        self.posted += 1;
        if signalled {
            self.signalled.push_back(self.posted);
        }
    }

    /// A successful send-side completion of this QP.
    pub fn on_completion(&mut self) {
        if let Some(s) = self.signalled.pop_front() {
            self.done = s;
        }
    }

    pub fn on_error(&mut self) {
        self.done = self.posted;
        self.signalled.clear();
    }

    /// WRs posted and not known to be complete.
    pub fn outstanding(&self) -> u64 {
        self.posted - self.done
    }

    /// Nothing the shim could still learn about: no signalled WR outstanding. Trailing
    /// unsignalled WRs are invisible until a later signalled one completes, so a QP in
    /// this state counts as idle.
    pub fn idle(&self) -> bool {
        self.signalled.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn work_of_an_earlier_tracking_period_is_forgotten() {
        let mut f = InFlight::default();
        f.in_epoch(1).on_post(true);
        f.in_epoch(1).on_post(true);
        assert!(!f.in_epoch(1).idle());
        assert_eq!(f.outstanding_in(1), 2);
        // Tracking stopped and started again: those completions went by unseen.
        assert_eq!(f.outstanding_in(2), 0);
        assert!(f.in_epoch(2).idle());
        f.in_epoch(2).on_post(true);
        f.in_epoch(2).on_completion();
        assert!(f.in_epoch(2).idle());
    }

    #[test]
    fn unsignalled_wrs_complete_with_the_next_signalled_one() {
        let mut f = InFlight::default();
        for i in 0..10 {
            f.on_post(i % 5 == 4);
        }
        assert_eq!((f.outstanding(), f.idle()), (10, false));
        f.on_completion();
        assert_eq!(f.outstanding(), 5);
        f.on_completion();
        assert_eq!((f.outstanding(), f.idle()), (0, true));
        f.on_completion(); // a stray one (e.g. sq_sig_all) changes nothing
        assert_eq!(f.outstanding(), 0);
    }

    #[test]
    fn an_error_ends_everything_in_flight() {
        let mut f = InFlight::default();
        for _ in 0..3 {
            f.on_post(true);
        }
        f.on_error();
        assert_eq!((f.outstanding(), f.idle()), (0, true));
    }
}
