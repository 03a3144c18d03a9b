//! A rate limiter as pure logic: the token bucket in its GCRA form (generic cell rate
//! algorithm), whose whole state is one number — the theoretical arrival time (TAT) — so the
//! data path keeps it in a single atomic and updates it with compare-and-swap, without a
//! lock. The same limiter meters WQEs (cost 1 each) and bytes (cost = message length). No
//! clock is read here: callers pass `now`, so decisions are deterministic and testable.
//!
//! Equivalence with a token bucket of `burst` units refilled at `rate` per second: a request
//! for `n` units at `now` conforms iff `TAT - tolerance <= now`, where
//! `tolerance = (burst - 1) · interval`; it then advances `TAT = max(TAT, now) + n · interval`.
//! Times are picoseconds so that one byte at 100 Gb/s (80 ps) is still representable.

/// Limiter settings. `interval_ps` is the time one unit occupies at the granted rate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gcra {
    interval_ps: u64,
    tolerance_ps: u64,
}

/// The fastest rate a limiter takes: one unit per picosecond.
pub const MAX_RATE: f64 = 1e12;

impl Gcra {
    /// `rate` units per second, of which `burst` (≥ 1) may go back to back after idling.
    /// `None` for a rate that is not finite and positive, or above [`MAX_RATE`].
    pub fn new(rate_per_s: f64, burst: u64) -> Option<Gcra> {
        if !(rate_per_s.is_finite() && rate_per_s > 0.0 && rate_per_s <= MAX_RATE) {
            return None;
        }
        let interval_ps = (1e12 / rate_per_s).round().max(1.0) as u64;
        let tolerance_ps = burst.max(1).saturating_sub(1).saturating_mul(interval_ps);
        Some(Gcra {
            interval_ps,
            tolerance_ps,
        })
    }

    /// The default burst for a rate: 5 ms worth, at least two units. The thread that
    /// releases held-back work can wake late on a loaded machine; the burst is the lateness
    /// it can make up, so the long-run rate holds (a 1 ms burst lost 4–5 % of a 500 WQE/s
    /// grant while the test suite ran alongside; a burst of one unit, which is what 5 ms of
    /// 200 WQE/s rounded to, makes up nothing and lost 5–14 %).
    pub fn default_burst(rate_per_s: f64) -> u64 {
        (rate_per_s * 0.005).round().max(2.0) as u64
    }

    /// `(interval_ps, tolerance_ps)`, for keeping a limiter in two atomics.
    pub fn parts(&self) -> (u64, u64) {
        (self.interval_ps, self.tolerance_ps)
    }

    /// The inverse of [`Gcra::parts`]; `None` for interval 0 ("no limiter").
    pub fn from_parts(interval_ps: u64, tolerance_ps: u64) -> Option<Gcra> {
        (interval_ps > 0).then_some(Gcra {
            interval_ps,
            tolerance_ps,
        })
    }

    pub fn interval_ps(&self) -> u64 {
        self.interval_ps
    }

    /// How long a request made at `now` must wait to conform, given the stored `tat`.
    pub fn wait(&self, tat: u64, now: u64) -> u64 {
        tat.saturating_sub(self.tolerance_ps).saturating_sub(now)
    }

    /// The TAT after `n` units go at `now` (which must conform, or be the time they go).
    pub fn advance(&self, tat: u64, now: u64, n: u64) -> u64 {
        tat.max(now)
            .saturating_add(n.saturating_mul(self.interval_ps))
    }

    /// The new TAT if `n` units may go at `now`, `None` if they must wait.
    pub fn try_admit(&self, tat: u64, now: u64, n: u64) -> Option<u64> {
        (self.wait(tat, now) == 0).then(|| self.advance(tat, now, n))
    }

    /// The TAT to keep when this limiter replaces `old`: units already admitted but not
    /// yet paid for (the TAT beyond `now`) are paid at the new rate. Without it, one 1 MB
    /// READ admitted at a new app's floor grant kept the next WQE waiting 4 s, however high
    /// the grant rose a round later.
    pub fn carry_over(&self, old: Option<Gcra>, tat: u64, now: u64) -> u64 {
        match old {
            Some(o) if tat > now && o.interval_ps != self.interval_ps => {
                let owed = (tat - now) as f64 / o.interval_ps as f64;
                now.saturating_add((owed * self.interval_ps as f64).min(u64::MAX as f64) as u64)
            }
            _ => tat,
        }
    }

    /// How many of `max` units conform at `now` one after another, each judged as if the
    /// ones before it had gone (for metering completions, which come in batches), and the
    /// TAT after they go.
    pub fn admit_up_to(&self, tat: u64, now: u64, max: u64) -> (u64, u64) {
        if max == 0 || self.wait(tat, now) > 0 {
            return (0, tat);
        }
        let start = tat.max(now);
        // Unit i conforms iff start + i·interval - tolerance <= now.
        let slack = now.saturating_add(self.tolerance_ps) - start;
        let n = (slack / self.interval_ps).saturating_add(1).min(max);
        (n, self.advance(tat, now, n))
    }
}

/// Parses a rate from the environment (e.g. `DRUM_SHIM_RATE_BYTES_PER_S`): `Ok(None)` when
/// unset, empty or 0; `Err` with the reason for a value that is not a usable rate.
pub fn parse_rate(name: &str, value: Option<&str>) -> Result<Option<f64>, String> {
    let v = match value.map(str::trim) {
        None | Some("") => return Ok(None),
        Some(v) => v,
    };
    let r: f64 = v
        .parse()
        .map_err(|_| format!("{name}={v:?} is not a number"))?;
    if r == 0.0 {
        return Ok(None);
    }
    if !(r.is_finite() && r > 0.0 && r <= MAX_RATE) {
        return Err(format!("{name}={v:?} must be in (0, 1e12]"));
    }
    Ok(Some(r))
}

/// Parses a count from the environment (`Ok(None)` when unset or empty).
pub fn parse_count(name: &str, value: Option<&str>, min: u64) -> Result<Option<u64>, String> {
    match value.map(str::trim) {
        None | Some("") => Ok(None),
        Some(v) => v
            .parse::<u64>()
            .ok()
            .filter(|&n| n >= min && n <= 1 << 40)
            .map(Some)
            .ok_or_else(|| format!("{name}={v:?} is not an integer in [{min}, 2^40]")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_new_rate_pays_what_is_owed_at_the_new_rate() {
        let slow = Gcra::new(1e3, 1).unwrap();
        let fast = Gcra::new(1e6, 1).unwrap();
        // 1,000 units at 1,000/s: owed for a second.
        let tat = slow.advance(0, 0, 1000);
        assert_eq!(tat, 1_000_000_000_000);
        // Raised to 1e6/s after 0.1 s: the 0.9 s still owed at the old rate is 900 units,
        // 0.9 ms at the new one.
        let now = 100_000_000_000;
        assert_eq!(fast.carry_over(Some(slow), tat, now), now + 900_000_000);
        // Nothing owed, or no old limiter: the TAT stays.
        assert_eq!(fast.carry_over(Some(slow), now - 1, now), now - 1);
        assert_eq!(fast.carry_over(None, tat, now), tat);
        // Lowered: what is owed takes longer.
        assert_eq!(
            slow.carry_over(Some(fast), now + 1_000_000, now),
            now + 1_000_000_000
        );
    }

    /// A batch admission equals admitting unit by unit until one must wait.
    #[test]
    fn admit_up_to_matches_one_by_one() {
        let g = Gcra::new(1000.0, 5).unwrap();
        for (tat, now, max) in [
            (0, 0, 10),
            (0, 1_000_000_000_000, 3),
            (4_000_000_000, 1_000_000_000, 10),
            (5_000_000_000, 1_000_000_000, 10),
            (9_000_000_000, 1_000_000_000, 10),
            (0, 0, 0),
        ] {
            let (mut t, mut one_by_one) = (tat, 0);
            while one_by_one < max {
                match g.try_admit(t, now, 1) {
                    Some(next) => (t, one_by_one) = (next, one_by_one + 1),
                    None => break,
                }
            }
            assert_eq!(
                g.admit_up_to(tat, now, max),
                (one_by_one, t),
                "{tat} {now} {max}"
            );
        }
        // A burst of 5 after idling, then one per millisecond.
        assert_eq!(g.admit_up_to(0, 10_000_000_000, 100).0, 5);
    }

    /// Requests `n` units at a time as fast as allowed (each goes at `now + wait`) and
    /// returns the time the last one went.
    fn run(g: &Gcra, posts: u64, n: u64, start: u64) -> u64 {
        let (mut tat, mut now) = (0, start);
        for _ in 0..posts {
            now += g.wait(tat, now);
            tat = g.try_admit(tat, now, n).expect("conforms after its wait");
        }
        now
    }

    const S: u64 = 1_000_000_000_000; // one second in ps

    #[test]
    fn greedy_sender_gets_the_rate_after_the_burst() {
        let g = Gcra::new(1000.0, 1).unwrap();
        assert_eq!(g.interval_ps(), 1_000_000_000);
        // 1001 single-unit requests: the first is free, the others 1 ms apart.
        assert_eq!(run(&g, 1001, 1, 5 * S), 6 * S);
        // A burst of 10 goes back to back, then the rate applies.
        let g = Gcra::new(1000.0, 10).unwrap();
        assert_eq!(run(&g, 10, 1, S), S);
        assert_eq!(run(&g, 11, 1, S), S + 1_000_000_000);
    }

    #[test]
    fn achieved_rate_matches_for_many_rates_and_sizes() {
        // WQE rates and byte rates (64 KiB messages at 100 Mb/s … 100 Gb/s).
        for rate in [10.0, 1e3, 3e5, 2.5e6, 1.25e7, 1.25e10] {
            for n in [1, 4, 32, 65536] {
                let g = Gcra::new(rate, 1).unwrap();
                let posts = 2000;
                let t = run(&g, posts, n, 1 << 50) - (1 << 50);
                // The first request is free; the others span (posts - 1) · n units.
                let achieved = ((posts - 1) * n) as f64 / (t as f64 / 1e12);
                let err = (achieved - rate).abs() / rate;
                assert!(err < 0.002, "rate {rate} n {n}: {achieved}");
            }
        }
    }

    #[test]
    fn idle_time_earns_at_most_the_burst() {
        let g = Gcra::new(1000.0, 5).unwrap();
        let mut tat = 0;
        let mut now = S;
        for _ in 0..100 {
            now += g.wait(tat, now);
            tat = g.advance(tat, now, 1);
        }
        now += 10 * S; // 10 s idle
        let mut free = 0;
        while let Some(t) = g.try_admit(tat, now, 1) {
            free += 1;
            tat = t;
        }
        assert_eq!(free, 5);
    }

    #[test]
    fn concurrent_requesters_share_one_rate() {
        let g = Gcra::new(1e6, 1).unwrap();
        let mut tat = 0;
        let mut clocks = [1_000_000_000u64, 1_000_000_000];
        for i in 0..2000 {
            let c = &mut clocks[i % 2];
            *c += g.wait(tat, *c);
            tat = g.advance(tat, *c, 1);
        }
        let end = clocks.iter().max().unwrap() - 1_000_000_000;
        assert!((1_997_000_000..=1_999_000_000).contains(&end), "{end}");
    }

    #[test]
    fn env_values_are_parsed_or_refused_with_a_reason() {
        let p = |v| parse_rate("R", v);
        assert_eq!(p(None), Ok(None));
        assert_eq!(p(Some("0")), Ok(None));
        assert_eq!(p(Some(" ")), Ok(None));
        assert_eq!(p(Some("2000")), Ok(Some(2000.0)));
        assert!(p(Some("fast")).unwrap_err().contains("not a number"));
        assert!(p(Some("-5")).unwrap_err().contains("(0, 1e12]"));
        assert!(p(Some("1e13")).is_err());
        assert!(p(Some("NaN")).is_err());
        assert_eq!(parse_count("B", Some("7"), 1), Ok(Some(7)));
        assert_eq!(parse_count("B", None, 1), Ok(None));
        assert!(parse_count("B", Some("0"), 1).is_err());
        assert!(parse_count("B", Some("x"), 0).is_err());
        assert_eq!(
            Gcra::new(2000.0, Gcra::default_burst(2000.0)),
            Gcra::new(2000.0, 10)
        );
    }
}
