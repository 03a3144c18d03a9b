//! An app's grant on a host split among its processes. The optimiser grants a rate to a
//! (host, app) pair, and each registered process's shim enforces what its own table says, so
//! tables holding the app's whole grant let an app of N processes send N times it (the grant
//! audit found two `ib_write_bw` of one app at 0.201 of the line against a 0.1 grant).
//!
//! The split follows demand, as the optimiser's own caps do (`demand`): a process that sends
//! clearly less than its part and was not held back gets what it uses plus headroom, and the
//! rest of the grant goes to the others, weighted by the connected QPs each holds (where it
//! can spend the rate). So a busy process beside idle ones keeps (nearly) the whole grant,
//! and processes that all want more share it by their QPs. Every process keeps a floor, a
//! tenth of an equal share ([`FLOOR`]): one that wakes up is not starved until the next
//! reading shows it held back. A process with no QPs yet counts as holding one.

use crate::demand::{RateSpec, RateTrack, HEADROOM, SATURATED};
use std::time::Duration;

/// Every process's least part, as a share of an equal split: a busy process beside an idle
/// one keeps 95 % of the app's grant. (A quarter, first, left it 87.5 %: two governed
/// `ib_write_bw`s of one app, one of them a server that sends nothing, ran 12.5 % under the
/// app's grant.) What it costs: a process that wakes from idle sends at that floor for up to
/// two readings (about 0.5 s) before its part grows.
pub const FLOOR: f64 = 0.1;

/// What one process of an app did since the last reading.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ProcessUse {
    /// Connected QPs it holds.
    pub qps: u64,
    /// Its part of the app's grant until now.
    pub part: f64,
    /// What it sent, as a fraction of the app's whole grant (None: not measured yet).
    pub used: Option<f64>,
    /// Whether its shim held work back (queued or deferred WQEs) or completions (its polling
    /// grant, which follows its part, delivered fewer than were there): it wants more. The
    /// latter is how a latency-bound process, which sends little and never queues, shows it.
    pub held: bool,
}

/// Each process's fraction of its app's grant, in the order given; they sum to 1.
pub fn process_parts(procs: &[ProcessUse]) -> Vec<f64> {
    let n = procs.len();
    if n == 0 {
        return Vec::new();
    }
    let floor = FLOOR / n as f64;
    let weight: Vec<f64> = procs.iter().map(|p| p.qps.max(1) as f64).collect();
    // A satisfied process wants its use with headroom; the others want without bound.
    let wants: Vec<f64> = procs
        .iter()
        .map(|p| match p.used {
            Some(u) if !p.held && u.is_finite() && u >= 0.0 && u < SATURATED * p.part => {
                (u * HEADROOM).max(floor)
            }
            _ => f64::INFINITY,
        })
        .collect();
    let mut part = vec![0.0; n];
    let mut open: Vec<usize> = (0..n).collect();
    let mut left = 1.0;
    // Water-filling: whoever wants less than its weighted share of what is left gets what it
    // wants; the share of the rest rises.
    loop {
        let total: f64 = open.iter().map(|&i| weight[i]).sum();
        let (done, rest): (Vec<usize>, Vec<usize>) = open
            .iter()
            .partition(|&&i| wants[i] <= left * weight[i] / total);
        if done.is_empty() || rest.is_empty() {
            if done.is_empty() {
                for &i in &open {
                    part[i] = left * weight[i] / total;
                }
            } else {
                // Everyone is satisfied: what is left goes to all, by weight.
                let spare = left - done.iter().map(|&i| wants[i]).sum::<f64>();
                for &i in &done {
                    part[i] = wants[i] + spare * weight[i] / total;
                }
            }
            break;
        }
        for &i in &done {
            part[i] = wants[i];
            left -= wants[i];
        }
        open = rest;
    }
    part
}

/// What a process's shim counts, read from its table.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ShimCounters {
    /// Bytes posted, cumulative.
    pub sent: u64,
    /// WQEs deferred by the pacer or gate, cumulative.
    pub deferred: u64,
    /// Polls that found completions the polling grant held back, cumulative.
    pub held_polls: u64,
    /// WQEs queued now.
    pub queued: u64,
}

/// One process's send rate and whether its shim held it back, from its table's cumulative
/// counters read now and then.
#[derive(Clone, Debug, Default)]
pub struct ProcessMeter {
    sent: RateTrack,
    /// WQEs deferred and polls held back at the last interval's end.
    held_base: Option<(u64, u64)>,
    held: bool,
}

/// Readings closer together than this are skipped: too few bytes to be a rate.
pub const METER_INTERVAL: Duration = Duration::from_millis(200);
/// Bytes per second, the newest interval weighing half.
const SPEC: RateSpec = RateSpec {
    unit: 1.0,
    min_interval: METER_INTERVAL,
    smoothing: 0.5,
};

impl ProcessMeter {
    /// A reading at `now` of the shim's counters: cumulative bytes sent, WQEs deferred and
    /// polls that found completions held back; WQEs queued now. A counter that went back (the
    /// table is the shim's word) starts a new baseline.
    pub fn observe(&mut self, c: ShimCounters, now: Duration) {
        let ended = self.sent.observe(&SPEC, c.sent, now);
        match self.held_base {
            Some((d0, p0)) if c.deferred >= d0 && c.held_polls >= p0 => {
                if ended {
                    self.held = c.queued > 0 || c.deferred > d0 || c.held_polls > p0;
                    self.held_base = Some((c.deferred, c.held_polls));
                }
            }
            _ => self.held_base = Some((c.deferred, c.held_polls)),
        }
    }

    /// The smoothed send rate, bytes per second, once measured.
    pub fn used_bytes_per_s(&self) -> Option<f64> {
        self.sent.rate()
    }

    /// Whether work was held back over the last interval.
    pub fn held(&self) -> bool {
        self.held
    }
}

/// A process's part of a rate that the grant carries as an integer, where 0 means "no
/// limit": a limited app's part is never rounded down to unlimited.
pub fn part_of_rate(rate: u64, part: f64) -> u64 {
    if rate == 0 {
        return 0;
    }
    ((rate as f64 * part).round() as u64).clamp(1, rate)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wanting(qps: u64) -> ProcessUse {
        ProcessUse {
            qps,
            part: 0.5,
            used: None,
            held: false,
        }
    }

    fn close(a: &[f64], b: &[f64]) -> bool {
        a.len() == b.len() && a.iter().zip(b).all(|(x, y)| (x - y).abs() < 1e-9)
    }

    #[test]
    fn processes_that_all_want_more_share_by_the_qps_they_hold() {
        assert!(close(&process_parts(&[wanting(4)]), &[1.0]));
        assert!(close(
            &process_parts(&[wanting(1), wanting(1)]),
            &[0.5, 0.5]
        ));
        assert!(close(
            &process_parts(&[wanting(3), wanting(1)]),
            &[0.75, 0.25]
        ));
        // one without connections yet still gets a part
        assert!(close(
            &process_parts(&[wanting(0), wanting(1)]),
            &[0.5, 0.5]
        ));
        assert!(process_parts(&[]).is_empty());
    }

    #[test]
    fn a_busy_process_beside_idle_ones_keeps_nearly_the_whole_grant() {
        let idle = ProcessUse {
            used: Some(0.0),
            ..wanting(1)
        };
        let busy = ProcessUse {
            used: Some(0.5),
            held: true,
            ..wanting(1)
        };
        let p = process_parts(&[busy, idle, idle]);
        // the idle ones keep their floor, a tenth of an equal share
        let floor = FLOOR / 3.0;
        assert!(close(&p, &[1.0 - 2.0 * floor, floor, floor]), "{p:?}");
        // one sending a little gets its use with headroom
        let light = ProcessUse {
            used: Some(0.2),
            ..wanting(1)
        };
        let p = process_parts(&[busy, light]);
        assert!(close(&p, &[0.75, 0.25]), "{p:?}");
        // a process at (nearly) its whole part wants more, held back or not
        let full = ProcessUse {
            used: Some(0.48),
            ..wanting(1)
        };
        assert!(close(&process_parts(&[full, busy]), &[0.5, 0.5]));
    }

    #[test]
    fn when_every_process_is_satisfied_the_spare_is_shared_by_weight() {
        let light = |u, qps| ProcessUse {
            used: Some(u),
            ..wanting(qps)
        };
        let p = process_parts(&[light(0.1, 1), light(0.2, 3)]);
        // wants 0.125 and 0.25; the spare 0.625 by weight 1:3
        assert!(
            close(&p, &[0.125 + 0.625 / 4.0, 0.25 + 0.625 * 0.75]),
            "{p:?}"
        );
        assert!((p.iter().sum::<f64>() - 1.0).abs() < 1e-12);
        // garbage readings count as wanting more
        let p = process_parts(&[light(f64::NAN, 1), light(-1.0, 1)]);
        assert!(close(&p, &[0.5, 0.5]), "{p:?}");
    }

    #[test]
    fn a_meter_measures_intervals_and_sees_work_or_completions_held_back() {
        let ms = Duration::from_millis;
        let at = |sent, deferred, held_polls, queued| ShimCounters {
            sent,
            deferred,
            held_polls,
            queued,
        };
        let mut m = ProcessMeter::default();
        m.observe(at(1_000, 0, 0, 0), ms(0));
        assert_eq!(m.used_bytes_per_s(), None, "a baseline only");
        m.observe(at(2_000, 0, 0, 0), ms(100));
        assert_eq!(m.used_bytes_per_s(), None, "too soon");
        m.observe(at(101_000, 0, 0, 0), ms(250));
        assert_eq!(m.used_bytes_per_s(), Some(400_000.0));
        assert!(!m.held());
        m.observe(at(101_000, 5, 0, 0), ms(500));
        assert_eq!(m.used_bytes_per_s(), Some(200_000.0), "smoothed");
        assert!(m.held(), "deferred some");
        m.observe(at(101_000, 5, 0, 3), ms(750));
        assert!(m.held(), "queues some now");
        m.observe(at(101_000, 5, 0, 0), ms(1000));
        assert!(!m.held());
        m.observe(at(101_000, 5, 2, 0), ms(1250));
        assert!(m.held(), "its polling grant held completions back");
        m.observe(at(10, 0, 0, 0), ms(1500));
        m.observe(at(250_010, 0, 0, 0), ms(1750));
        assert!(
            m.used_bytes_per_s().unwrap() > 500_000.0,
            "new baseline after going back"
        );
    }

    #[test]
    fn a_limited_rate_is_never_split_into_unlimited() {
        assert_eq!(part_of_rate(0, 0.5), 0, "unlimited stays unlimited");
        assert_eq!(part_of_rate(1000, 0.25), 250);
        assert_eq!(part_of_rate(1, 0.001), 1);
        assert_eq!(part_of_rate(1000, 1.0), 1000);
    }
}
