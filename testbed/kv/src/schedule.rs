//! Operations at set times (`--period-ms`, `--jitter-us`, `--start-unix-ms`): operation `i`
//! of a connection is due at `start + i·period + jitter_i` on the wall clock, the jitter
//! drawn uniformly from `[0, jitter]`. The wall clock, not the process's own start, so that
//! clients on different emulated hosts of one machine fire together: Dart's incasts (issue
//! 18), every sender's message at the same instant give or take the jitter.

use crate::dist::Rng;

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Schedule {
    /// When operation 0 is due, in ns since the Unix epoch.
    pub start_unix_ns: u64,
    pub period_ns: u64,
    /// The largest jitter added to a due time.
    pub jitter_ns: u64,
}

impl Schedule {
    /// When operation `i` is due, in ns since the Unix epoch; draws its jitter from `rng`.
    pub fn due_unix_ns(&self, i: u64, rng: &mut Rng) -> u64 {
        let jitter = if self.jitter_ns == 0 {
            0
        } else {
            rng.between(0, self.jitter_ns)
        };
        self.start_unix_ns
            .saturating_add(i.saturating_mul(self.period_ns))
            .saturating_add(jitter)
    }

    /// How long from `now_unix_ns` until `due_unix_ns` (zero when it has passed).
    pub fn wait_ns(due_unix_ns: u64, now_unix_ns: u64) -> u64 {
        due_unix_ns.saturating_sub(now_unix_ns)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn operations_fall_on_the_period_within_the_jitter() {
        let s = Schedule {
            start_unix_ns: 1_000,
            period_ns: 100,
            jitter_ns: 10,
        };
        let mut rng = Rng::new(7);
        let mut jitters = std::collections::BTreeSet::new();
        for i in 0..200 {
            let d = s.due_unix_ns(i, &mut rng);
            let base = 1_000 + i * 100;
            assert!((base..=base + 10).contains(&d), "{i}: {d}");
            jitters.insert(d - base);
        }
        // the whole range is used, both ends included
        assert_eq!(jitters.len(), 11);
    }

    #[test]
    fn without_jitter_every_client_fires_at_the_same_instant() {
        let s = Schedule {
            start_unix_ns: 5,
            period_ns: 3,
            jitter_ns: 0,
        };
        assert_eq!(s.due_unix_ns(2, &mut Rng::new(1)), 11);
        assert_eq!(s.due_unix_ns(2, &mut Rng::new(2)), 11);
        assert_eq!(Schedule::wait_ns(11, 4), 7);
        assert_eq!(Schedule::wait_ns(11, 40), 0);
    }
}
