//! A WQE-rate pacer as pure logic: the token bucket in its GCRA form (generic cell rate
//! algorithm), whose whole state is one number — the theoretical arrival time (TAT) — so the
//! data path can keep it in a single atomic and update it with compare-and-swap, without a
//! lock. No clock is read here: callers pass `now`, so the decision is deterministic and
//! testable.
//!
//! Equivalence with a token bucket of `burst` tokens refilled at `rate` per second: a request
//! for `n` tokens at `now` may go at once iff `TAT - tolerance <= now`, where
//! `tolerance = (burst - 1) · interval`; it then advances `TAT = max(TAT, now) + n · interval`.
//! Here requests are never refused: a non-conforming one is told how long to wait.

/// Pacer settings. `interval_ns` is the time one WQE occupies at the granted rate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gcra {
    interval_ns: u64,
    tolerance_ns: u64,
}

/// The decision for one post: the new TAT to store, and how long to wait before posting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Admit {
    pub tat: u64,
    pub wait_ns: u64,
}

impl Gcra {
    /// `rate` WQEs per second, of which `burst` (≥ 1) may go back to back after idling.
    /// `None` for a rate that is not finite and positive, or faster than one WQE per
    /// nanosecond (the resolution of the state).
    pub fn new(rate_per_s: f64, burst: u64) -> Option<Gcra> {
        if !(rate_per_s.is_finite() && rate_per_s > 0.0 && rate_per_s <= 1e9) {
            return None;
        }
        let interval_ns = (1e9 / rate_per_s).round().max(1.0) as u64;
        let tolerance_ns = burst.max(1).saturating_sub(1).saturating_mul(interval_ns);
        Some(Gcra {
            interval_ns,
            tolerance_ns,
        })
    }

    /// The default burst for a rate: one millisecond's worth of WQEs, at least one.
    pub fn default_burst(rate_per_s: f64) -> u64 {
        (rate_per_s / 1000.0).round().max(1.0) as u64
    }

    pub fn interval_ns(&self) -> u64 {
        self.interval_ns
    }

    /// Decides a post of `n` WQEs at `now` (ns on any monotonic clock) given the stored `tat`.
    pub fn admit(&self, tat: u64, now: u64, n: u64) -> Admit {
        let wait_ns = tat.saturating_sub(self.tolerance_ns).saturating_sub(now);
        let tat = tat
            .max(now)
            .saturating_add(n.saturating_mul(self.interval_ns));
        Admit { tat, wait_ns }
    }
}

/// Parses `DRUM_SHIM_RATE_WQE_PER_S` (and the optional `DRUM_SHIM_BURST_WQE`): `Ok(None)`
/// when pacing is off (unset, empty or 0), `Err` with the reason for a value that is not a
/// usable rate.
pub fn from_env_values(rate: Option<&str>, burst: Option<&str>) -> Result<Option<Gcra>, String> {
    let rate = match rate.map(str::trim) {
        None | Some("") => return Ok(None),
        Some(r) => r,
    };
    let r: f64 = rate
        .parse()
        .map_err(|_| format!("DRUM_SHIM_RATE_WQE_PER_S={rate:?} is not a number"))?;
    if r == 0.0 {
        return Ok(None);
    }
    let b = match burst.map(str::trim) {
        None | Some("") => Gcra::default_burst(r),
        Some(b) => b
            .parse::<u64>()
            .ok()
            .filter(|&b| b >= 1)
            .ok_or_else(|| format!("DRUM_SHIM_BURST_WQE={b:?} is not an integer >= 1"))?,
    };
    Gcra::new(r, b)
        .map(Some)
        .ok_or_else(|| format!("DRUM_SHIM_RATE_WQE_PER_S={rate:?} must be in (0, 1e9]"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Posts `n` WQEs at a time as fast as allowed (each post happens at `now + wait`) and
    /// returns the time the last post went out.
    fn run(g: &Gcra, posts: u64, n: u64, start: u64) -> u64 {
        let (mut tat, mut now) = (0, start);
        for _ in 0..posts {
            let a = g.admit(tat, now, n);
            now += a.wait_ns;
            tat = a.tat;
        }
        now
    }

    #[test]
    fn greedy_sender_gets_the_rate_after_the_burst() {
        let g = Gcra::new(1000.0, 1).unwrap();
        assert_eq!(g.interval_ns(), 1_000_000);
        // 1001 single-WQE posts: the first is free, the others 1 ms apart.
        assert_eq!(
            run(&g, 1001, 1, 5_000_000_000),
            5_000_000_000 + 1_000_000_000
        );
        // A burst of 10 goes back to back, then the rate applies.
        let g = Gcra::new(1000.0, 10).unwrap();
        assert_eq!(run(&g, 10, 1, 1_000_000_000), 1_000_000_000);
        assert_eq!(run(&g, 11, 1, 1_000_000_000), 1_001_000_000);
    }

    #[test]
    fn achieved_rate_matches_for_many_rates_and_batch_sizes() {
        for rate in [10.0, 1e3, 3e5, 2.5e6] {
            for n in [1, 4, 32] {
                let g = Gcra::new(rate, 1).unwrap();
                let posts = 2000;
                let t = run(&g, posts, n, 1 << 40) - (1 << 40);
                // The first post is free; the others span (posts - 1) · n WQEs.
                let achieved = ((posts - 1) * n) as f64 / (t as f64 / 1e9);
                let err = (achieved - rate).abs() / rate;
                assert!(err < 0.002, "rate {rate} n {n}: {achieved}");
            }
        }
    }

    #[test]
    fn idle_time_earns_at_most_the_burst() {
        let g = Gcra::new(1000.0, 5).unwrap();
        let mut tat = 0;
        let mut now = 1_000_000_000;
        for _ in 0..100 {
            let a = g.admit(tat, now, 1);
            now += a.wait_ns;
            tat = a.tat;
        }
        now += 10_000_000_000; // 10 s idle
        let mut free = 0;
        loop {
            let a = g.admit(tat, now, 1);
            if a.wait_ns > 0 {
                break;
            }
            free += 1;
            tat = a.tat;
        }
        assert_eq!(free, 5);
    }

    #[test]
    fn concurrent_posters_share_one_rate() {
        // Two posters interleave on the same state; the total is still paced.
        let g = Gcra::new(1e6, 1).unwrap();
        let mut tat = 0;
        let mut clocks = [1_000_000u64, 1_000_000];
        for i in 0..2000 {
            let c = &mut clocks[i % 2];
            let a = g.admit(tat, *c, 1);
            *c += a.wait_ns;
            tat = a.tat;
        }
        let end = clocks.iter().max().unwrap() - 1_000_000;
        assert!((1_997_000..=1_999_000).contains(&end), "{end}");
    }

    #[test]
    fn env_values_are_parsed_or_refused_with_a_reason() {
        assert_eq!(from_env_values(None, None), Ok(None));
        assert_eq!(from_env_values(Some("0"), None), Ok(None));
        assert_eq!(from_env_values(Some(" "), None), Ok(None));
        let g = from_env_values(Some("2000"), None).unwrap().unwrap();
        assert_eq!(g, Gcra::new(2000.0, 2).unwrap());
        let g = from_env_values(Some("2000"), Some("7")).unwrap().unwrap();
        assert_eq!(g, Gcra::new(2000.0, 7).unwrap());
        assert!(from_env_values(Some("fast"), None)
            .unwrap_err()
            .contains("not a number"));
        assert!(from_env_values(Some("-5"), None)
            .unwrap_err()
            .contains("(0, 1e9]"));
        assert!(from_env_values(Some("1e12"), None).is_err());
        assert!(from_env_values(Some("NaN"), None).is_err());
        assert!(from_env_values(Some("100"), Some("0")).is_err());
        assert!(from_env_values(Some("100"), Some("x")).is_err());
    }
}
