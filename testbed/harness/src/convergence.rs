//! Dart's convergence experiment (Fig. 9) from sampled byte counters: when the second
//! sender's bursts start and end, the long flow's rate over time, and how long after each
//! edge the long flow's rate settles at its new fair share. Pure: samples in, numbers out.

/// A byte counter sampled over time: `(t_us, bytes)` pairs, in time order.
pub type Samples = [(f64, f64)];

/// What counts as a sender sending data: at least `min_rate` bytes/µs over the `probe_us`
/// after a move of its counter, or before it. A perftest's set-up and report over TCP move the same
/// counter by a few packets, which must not pass for the start or end of its burst.
#[derive(Clone, Copy, Debug)]
pub struct Data {
    pub quiet_us: f64,
    pub min_rate: f64,
    pub probe_us: f64,
}

/// The bursts in a sender's counter: `(start, end)` in µs, where a burst starts at the last
/// sample before its counter moves with data after at least `quiet_us` without, and ends at
/// the first sample after its last data move (then none for `quiet_us`, or to the end of the
/// samples).
pub fn bursts(s: &Samples, d: Data) -> Vec<(f64, f64)> {
    let mut out = Vec::new();
    let mut start: Option<f64> = None;
    let mut last_move: Option<(f64, f64)> = None; // (sample before the move, the move's sample)
    let quiet_us = d.quiet_us;
    for w in s.windows(2) {
        let ((t0, b0), (t1, b1)) = (w[0], w[1]);
        // at a burst's start the data follows the move, at its end it precedes it
        let data = rate(s, t0, t0 + d.probe_us).max(rate(s, t1 - d.probe_us, t1)) >= d.min_rate;
        if b1 > b0 && data {
            match (start, last_move) {
                (Some(_), Some((_, lm))) if t0 - lm >= quiet_us => {
                    out.push((start.expect("in a burst"), lm));
                    start = Some(t0);
                }
                (None, _) => start = Some(t0),
                _ => {}
            }
            last_move = Some((t0, t1));
        }
    }
    if let (Some(s0), Some((_, lm))) = (start, last_move) {
        out.push((s0, lm));
    }
    out
}

/// The counter's value at `t` (linear between samples; clamped at the ends).
pub fn at(s: &Samples, t: f64) -> f64 {
    let i = s.partition_point(|p| p.0 <= t);
    if i == 0 {
        return s.first().map_or(0.0, |p| p.1);
    }
    if i == s.len() {
        return s[i - 1].1;
    }
    let ((t0, b0), (t1, b1)) = (s[i - 1], s[i]);
    b0 + (b1 - b0) * (t - t0) / (t1 - t0)
}

/// The mean rate over `[a, b]`, in bytes per µs.
pub fn rate(s: &Samples, a: f64, b: f64) -> f64 {
    if b <= a {
        return 0.0;
    }
    (at(s, b) - at(s, a)) / (b - a)
}

/// How the long flow's rate is judged settled: within `tolerance` (a fraction) of the
/// target over `windows` consecutive windows of `window_us`, scanned every `step_us`.
#[derive(Clone, Copy, Debug)]
pub struct Settle {
    pub window_us: f64,
    pub windows: usize,
    pub tolerance: f64,
    pub step_us: f64,
}

/// µs from `from` until the start of the first run of `windows` consecutive windows in
/// which the rate is within the tolerance of `target` (bytes/µs), searching up to `until`
/// (the windows must end by then); `None` if it never settles.
pub fn settle_time(s: &Samples, from: f64, until: f64, target: f64, p: Settle) -> Option<f64> {
    let ok = |a: f64| (rate(s, a, a + p.window_us) - target).abs() <= p.tolerance * target;
    let mut t = from;
    while t + p.window_us * p.windows as f64 <= until {
        if (0..p.windows).all(|k| ok(t + k as f64 * p.window_us)) {
            return Some(t - from);
        }
        t += p.step_us;
    }
    None
}

/// The rate in consecutive bins of `bin_us` from `t0`, in bytes/µs (the plot's time series).
pub fn binned(s: &Samples, t0: f64, t1: f64, bin_us: f64) -> Vec<f64> {
    let n = ((t1 - t0) / bin_us).floor().max(0.0) as usize;
    (0..n)
        .map(|i| {
            let a = t0 + i as f64 * bin_us;
            rate(s, a, a + bin_us)
        })
        .collect()
}

/// Convergence after each edge of each burst of the second sender.
#[derive(Clone, Debug, PartialEq)]
pub struct Edges {
    /// µs after each burst's start until the long flow settles at `fair` (`None`: never).
    pub start: Vec<Option<f64>>,
    /// µs after each burst's end until it settles back at its rate alone.
    pub end: Vec<Option<f64>>,
    /// The long flow's rate alone (before the first burst) and its fair share during bursts.
    pub alone: f64,
    pub fair: f64,
}

/// The long flow `long` against the bursts of `short`: its rate alone is measured over the
/// `alone_us` before the first burst; its fair share is half of that (two senders, one
/// receiver: Dart's R/2); a burst's end is searched for settling up to the next burst's
/// start (or the end of the samples), a start up to the burst's end.
pub fn edges(long: &Samples, short: &Samples, d: Data, alone_us: f64, p: Settle) -> Option<Edges> {
    let b = bursts(short, d);
    let first = b.first()?.0;
    let t_begin = long.first()?.0.max(first - alone_us);
    let t_last = long.last()?.0;
    let alone = rate(long, t_begin, first);
    if alone <= 0.0 {
        return None;
    }
    let fair = alone / 2.0;
    let mut e = Edges {
        start: Vec::new(),
        end: Vec::new(),
        alone,
        fair,
    };
    for (i, &(s0, s1)) in b.iter().enumerate() {
        e.start.push(settle_time(long, s0, s1, fair, p));
        let next = b.get(i + 1).map_or(t_last, |n| n.0);
        e.end.push(settle_time(long, s1, next, alone, p));
    }
    Some(e)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A counter sampled every `step` µs whose rate is `rate(t)` bytes/µs.
    fn counter(until: f64, step: f64, rate: impl Fn(f64) -> f64) -> Vec<(f64, f64)> {
        let mut v = vec![(0.0, 0.0)];
        let mut t = 0.0;
        let mut b = 0.0;
        while t < until {
            b += rate(t) * step;
            t += step;
            v.push((t, b));
        }
        v
    }

    fn data(quiet_us: f64) -> Data {
        Data {
            quiet_us,
            min_rate: 2.0,
            probe_us: 1_000.0,
        }
    }

    const P: Settle = Settle {
        window_us: 1000.0,
        windows: 3,
        tolerance: 0.2,
        step_us: 100.0,
    };

    #[test]
    fn bursts_are_found_between_quiet_spells() {
        let on = |t: f64| (10_000.0..20_000.0).contains(&t) || (40_000.0..45_000.0).contains(&t);
        let s = counter(60_000.0, 100.0, |t| if on(t) { 5.0 } else { 0.0 });
        let b = bursts(&s, data(5_000.0));
        assert_eq!(b, [(10_000.0, 20_000.0), (40_000.0, 45_000.0)]);
        // a gap shorter than the quiet spell does not split a burst
        assert_eq!(bursts(&s, data(30_000.0)), [(10_000.0, 45_000.0)]);
        assert!(bursts(&counter(1000.0, 100.0, |_| 0.0), data(10.0)).is_empty());
        // a trickle before and after (a perftest's set-up over TCP) is not the burst
        let trickle = counter(60_000.0, 100.0, |t| match t {
            t if (10_000.0..20_000.0).contains(&t) => 5.0,
            t if (5_000.0..5_200.0).contains(&t) || (25_000.0..25_200.0).contains(&t) => 1.0,
            _ => 0.0,
        });
        assert_eq!(bursts(&trickle, data(1_000.0)), [(10_000.0, 20_000.0)]);
    }

    #[test]
    fn rates_interpolate_between_samples() {
        let s = [(0.0, 0.0), (10.0, 100.0), (20.0, 100.0)];
        assert_eq!(at(&s, 5.0), 50.0);
        assert_eq!(at(&s, -1.0), 0.0);
        assert_eq!(at(&s, 99.0), 100.0);
        assert_eq!(rate(&s, 0.0, 10.0), 10.0);
        assert_eq!(rate(&s, 10.0, 20.0), 0.0);
        assert_eq!(binned(&s, 0.0, 20.0, 10.0), [10.0, 0.0]);
    }

    #[test]
    fn a_long_flow_that_halves_two_ms_into_a_burst_converges_in_two_ms() {
        // alone 10 B/µs; the burst from 10 ms to 30 ms; the long flow drops to 5 at 12 ms
        // and returns to 10 at 33 ms
        let long = counter(50_000.0, 100.0, |t| {
            if (12_000.0..33_000.0).contains(&t) {
                5.0
            } else {
                10.0
            }
        });
        let short = counter(50_000.0, 100.0, |t| {
            if (10_000.0..30_000.0).contains(&t) {
                5.0
            } else {
                0.0
            }
        });
        let e = edges(&long, &short, data(5_000.0), 5_000.0, P).unwrap();
        assert!((e.alone - 10.0).abs() < 1e-9 && (e.fair - 5.0).abs() < 1e-9);
        // the first window within 20 % of 5: [t, t+1 ms] with at most 0.2 ms at 10 before
        // 12 ms, i.e. t ≥ 11.8 ms: 1.8 ms after the start
        let s = e.start[0].unwrap();
        assert!((s - 1_800.0).abs() < 1e-6, "{s}");
        // back within 20 % of 10 from the window with at most 0.4 ms at 5 before 33 ms:
        // t ≥ 32.6 ms, 2.6 ms after the burst's end at 30 ms
        let end = e.end[0].unwrap();
        assert!((end - 2_600.0).abs() < 1e-6, "{end}");
    }

    #[test]
    fn a_long_flow_that_never_yields_never_converges() {
        let long = counter(50_000.0, 100.0, |_| 10.0);
        let short = counter(50_000.0, 100.0, |t| {
            if (10_000.0..30_000.0).contains(&t) {
                5.0
            } else {
                0.0
            }
        });
        let e = edges(&long, &short, data(5_000.0), 5_000.0, P).unwrap();
        assert_eq!(e.start, [None]);
        assert_eq!(e.end, [Some(0.0)]);
        // no burst, or no rate before it: nothing to judge
        assert!(edges(&long, &counter(1000.0, 100.0, |_| 0.0), data(10.0), 1.0, P).is_none());
    }
}
