//! Demand from measured usage (docs/design.md §2): what an app actually sends, as its shims count
//! it, turned into the demand cap `x̄` the optimiser uses. Pure: readings and times come in
//! as arguments.
//!
//! An app that uses (nearly) all it is granted may want more, so its cap stays the one the
//! instance gives; an app that clearly uses less gets its usage plus headroom as its cap, so
//! the optimiser hands the rest of the facility to others. When it wants more again it
//! saturates its smaller grant, and its cap returns — one round of feedback later.

use std::collections::BTreeMap;
use std::time::Duration;

/// Usage at or above this share of the grant counts as "wants more".
pub const SATURATED: f64 = 0.9;
/// The cap of an app below its grant: its usage times this.
pub const HEADROOM: f64 = 1.25;

/// What held an app back since the last reading, if anything.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HeldBack {
    /// Nothing: its usage is what it wants.
    No,
    /// Its work: the shim's pacer or gate made WQEs wait, or the NIC holds a backlog of
    /// them. It wants more than its grant, by an unknown amount.
    Work,
    /// Only its completions: its polling grant, which follows its rate grant, delivered
    /// fewer than were there. An app with one request in flight never queues work, so this
    /// is how it shows that it wants more.
    Completions,
}

/// The growth of the cap, per reading, of an app held back only by its polling grant: its
/// rate grant doubles until the polling grant that follows it no longer binds. Not the
/// instance's cap at once: such an app (a latency-bound one) uses little of its rate grant,
/// and a grant it does not use is taken from the others.
pub const POLL_GROWTH: f64 = 2.0;

/// The demand cap for one app: `instance_cap` while its measured rate reaches
/// [`SATURATED`] of its grant, while its work was held back ([`HeldBack::Work`]), or while
/// nothing is measured; else the measured rate with [`HEADROOM`] — at least
/// [`POLL_GROWTH`] times its grant if its polling grant held completions back — kept within
/// `[x_min, instance_cap]`. Rates are fractions of line rate.
///
/// Without the held-back rule, an app paced below what it asks for (one that posts a batch
/// and waits for a completion reaches well under its grant) measured under 90 % of its grant,
/// got a cap of its rate × 1.25, was paced lower, and so on down to `x_min`: drum-kv's
/// background clients ended at 1 % of the line with the link otherwise idle.
pub fn demand_cap(
    instance_cap: f64,
    granted: f64,
    measured: Option<f64>,
    x_min: f64,
    held: HeldBack,
) -> f64 {
    match measured {
        Some(m)
            if held != HeldBack::Work && m.is_finite() && m >= 0.0 && m < SATURATED * granted =>
        {
            let grow = if held == HeldBack::Completions {
                granted * POLL_GROWTH
            } else {
                0.0
            };
            (m * HEADROOM).max(grow).max(x_min).min(instance_cap)
        }
        _ => instance_cap,
    }
}

/// How long an app whose work was held back counts as held back after the last reading that
/// showed it. Whether the NIC holds 8 of a closed-loop app's WRs is a coin toss from one
/// reading to the next (drum-kv with 16 operations in flight: its cap flipped between its
/// rate × 1.25 and the whole line every second or so, and the bulk writer sharing its
/// receiver's link moved between 0.68 and 0.94 of the line with it). Remembered, an app held
/// back now and then keeps the cap of one that wants more; one that stopped wanting more
/// gives its share back this much later, on the optimiser's timescale, not a round trip's.
pub const HELD_MEMORY: Duration = Duration::from_secs(2);

/// When each app's work was last seen held back ([`HeldBack::Work`]).
#[derive(Debug, Clone, Default)]
pub struct HeldMemory {
    last_work: BTreeMap<String, Duration>,
}

impl HeldMemory {
    /// The verdict to act on for `app` at `now`, given what this reading saw: [`HeldBack::Work`]
    /// while its work was held back within [`HELD_MEMORY`], else what was seen.
    pub fn verdict(&mut self, app: &str, seen: HeldBack, now: Duration) -> HeldBack {
        if seen == HeldBack::Work {
            self.last_work.insert(app.to_string(), now);
            return seen;
        }
        match self.last_work.get(app) {
            Some(&t) if now.saturating_sub(t) < HELD_MEMORY => HeldBack::Work,
            _ => seen,
        }
    }

    /// Forgets apps not in `present` (their shims are gone).
    pub fn retain(&mut self, present: impl Fn(&str) -> bool) {
        self.last_work.retain(|a, _| present(a));
    }
}

/// How long an app that has not sent yet keeps the cap of a new app, counted from when the
/// agent first saw it. Measured against nothing but connection setup, "nothing sent, nothing
/// held back" read as "wants nothing": a new `ib_write_bw` was granted the floor (0.5 % of the
/// line) from its selection until its shim's deferrals showed, about 1 s later, and the
/// testbed's 1 MB transfer unloaded took 518 ms under DRUM against 177 ms raw. Two seconds
/// cover perftest's and drum-kv's connection setup.
pub const NEW_APP_GRACE: Duration = Duration::from_secs(2);

/// How long an app that has posted nothing stays new after its connected QPs last changed.
/// A sender posts right after connecting (perftest after one TCP handshake, drum-kv after
/// each connection), while an app that stays silent on connected QPs is a responder (a
/// server of one-sided READs, the passive side of `ib_write_bw`): with the new-app demand on
/// the link its connections point at — the very link its peer's READ responses fill — it
/// took half of that link from the reader for 1.1 s of a 2 s transfer (the testbed's
/// tc2-flow at 400×, docs/testbed.md). Half a second is ample for the first and much less
/// than the grace.
pub const SILENT_AFTER_CONNECT: Duration = Duration::from_millis(500);

/// What the agent sees of an app at one reading, to tell a new app from a silent one.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Activity {
    /// Send WQEs its shims have counted, cumulative.
    pub posted: u64,
    /// Its QPs that reached RTR, over all its processes.
    pub connected_qps: u32,
}

/// One app's standing as a new app.
#[derive(Clone, Copy, Debug)]
struct Newcomer {
    first_seen: Duration,
    /// Its connected QPs at the last reading, and when that number last changed.
    connected: (u32, Duration),
    /// It posted, or its grace ended: its measurements count from now on.
    settled: bool,
}

/// Which apps are still new: seen within [`NEW_APP_GRACE`], nothing posted, and not silent on
/// connected QPs for [`SILENT_AFTER_CONNECT`]. Once an app is settled it stays so while present.
#[derive(Debug, Clone, Default)]
pub struct NewApps {
    apps: BTreeMap<String, Newcomer>,
}

impl NewApps {
    /// The measured rate of `app` to act on at `now`: none while the app is new (so its cap
    /// stays the new app's), else `measured`.
    pub fn measured(
        &mut self,
        app: &str,
        seen: Activity,
        measured: Option<f64>,
        now: Duration,
    ) -> Option<f64> {
        let n = self.apps.entry(app.to_string()).or_insert(Newcomer {
            first_seen: now,
            connected: (seen.connected_qps, now),
            settled: false,
        });
        if seen.connected_qps != n.connected.0 {
            n.connected = (seen.connected_qps, now);
        }
        let silent = n.connected.0 > 0 && now.saturating_sub(n.connected.1) >= SILENT_AFTER_CONNECT;
        n.settled |= seen.posted > 0
            || measured.is_some_and(|m| m > 0.0)
            || silent
            || now.saturating_sub(n.first_seen) >= NEW_APP_GRACE;
        if n.settled {
            measured
        } else {
            None
        }
    }

    /// Forgets apps not in `present` (their shims are gone): one that comes back is new again.
    pub fn retain(&mut self, present: impl Fn(&str) -> bool) {
        self.apps.retain(|a, _| present(a));
    }
}

/// How a cumulative counter becomes a rate: per second, divided by `unit`, measured over at
/// least `min_interval` and smoothed (`smoothing`: the newest interval's weight).
#[derive(Debug, Clone, Copy)]
pub struct RateSpec {
    pub unit: f64,
    pub min_interval: Duration,
    pub smoothing: f64,
}

/// One cumulative counter's smoothed rate (per app in [`UsageMeter`], per process in
/// `process_share::ProcessMeter`).
#[derive(Debug, Clone, Default)]
pub struct RateTrack {
    /// The counter at the last interval's end, and when.
    last: Option<(u64, Duration)>,
    rate: Option<f64>,
}

impl RateTrack {
    /// One reading of the counter at `now`; whether it ended an interval (the rate moved). A
    /// counter that went down (a process exited, or a table the shim rewrote) starts a new
    /// baseline.
    pub fn observe(&mut self, spec: &RateSpec, count: u64, now: Duration) -> bool {
        let Some((c0, t0)) = self.last else {
            self.last = Some((count, now));
            return false;
        };
        if count < c0 {
            self.last = Some((count, now));
            return false;
        }
        let dt = now.saturating_sub(t0);
        if dt < spec.min_interval {
            return false;
        }
        let r = (count - c0) as f64 / dt.as_secs_f64() / spec.unit;
        self.rate = Some(match self.rate {
            Some(old) => old + spec.smoothing * (r - old),
            None => r,
        });
        self.last = Some((count, now));
        true
    }

    /// The smoothed rate, once an interval was measured.
    pub fn rate(&self) -> Option<f64> {
        self.rate
    }
}

/// Send rates per app from cumulative byte counters, smoothed.
#[derive(Debug, Clone)]
pub struct UsageMeter {
    spec: RateSpec,
    apps: BTreeMap<String, RateTrack>,
}

impl UsageMeter {
    /// `line_bytes_per_s` turns bytes/s into fractions of line rate; a rate is measured
    /// over at least `min_interval`.
    pub fn new(line_bytes_per_s: f64, min_interval: Duration, smoothing: f64) -> UsageMeter {
        UsageMeter {
            spec: RateSpec {
                unit: line_bytes_per_s,
                min_interval,
                smoothing: smoothing.clamp(0.0, 1.0),
            },
            apps: BTreeMap::new(),
        }
    }

    /// One reading of `app`'s cumulative sent bytes (summed over its processes) at `now`.
    /// A counter that went down (a process of the app exited) starts a new baseline.
    pub fn observe(&mut self, app: &str, bytes: u64, now: Duration) {
        let spec = self.spec;
        match self.apps.get_mut(app) {
            Some(t) => {
                t.observe(&spec, bytes, now);
            }
            None => {
                let mut t = RateTrack::default();
                t.observe(&spec, bytes, now);
                self.apps.insert(app.to_string(), t);
            }
        }
    }

    /// Forgets apps not in `present` (their shims are gone).
    pub fn retain(&mut self, present: impl Fn(&str) -> bool) {
        self.apps.retain(|a, _| present(a));
    }

    /// The smoothed send rate of `app` as a fraction of line rate, once measured.
    pub fn rate(&self, app: &str) -> Option<f64> {
        self.apps.get(app).and_then(RateTrack::rate)
    }
}

/// The model's `a` is kept within this range: a ratio outside it (no completions polled in an
/// interval, or thousands per WQE) says more about the interval than about the app.
pub const CQE_PER_WQE_RANGE: (f64, f64) = (1e-3, 1e3);
pub use drum_table::profile::MIN_PROFILE_WQES;
/// The polling grant's margin over the completions the granted WQE rate implies, so that an
/// app using its grant fully is not throttled by jitter, and an app whose `a` grew is
/// measured at up to this much more next time (the grant then follows).
pub const POLL_HEADROOM: f64 = 1.25;

/// Cumulative counters of an app (summed over its processes).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WqeCounts {
    pub wqes: u64,
    pub completions: u64,
}

/// Completions per WQE (the model's `a_ij`, docs/design.md §3) per app, from cumulative counters,
/// over intervals of at least [`MIN_PROFILE_WQES`] WQEs, smoothed.
#[derive(Debug, Clone)]
pub struct CqeMeter {
    smoothing: f64,
    apps: BTreeMap<String, (WqeCounts, Option<f64>)>,
}

impl CqeMeter {
    pub fn new(smoothing: f64) -> CqeMeter {
        CqeMeter {
            smoothing: smoothing.clamp(0.0, 1.0),
            apps: BTreeMap::new(),
        }
    }

    /// One reading of `app`'s counters. A counter that went down (a process of the app
    /// exited) starts a new baseline.
    pub fn observe(&mut self, app: &str, now: WqeCounts) {
        let (base, a) = self.apps.entry(app.to_string()).or_insert((now, None));
        if now.wqes < base.wqes || now.completions < base.completions {
            *base = now;
            return;
        }
        let wqes = now.wqes - base.wqes;
        if wqes < MIN_PROFILE_WQES {
            return;
        }
        let r = ((now.completions - base.completions) as f64 / wqes as f64)
            .clamp(CQE_PER_WQE_RANGE.0, CQE_PER_WQE_RANGE.1);
        *a = Some(match *a {
            Some(old) => old + self.smoothing * (r - old),
            None => r,
        });
        *base = now;
    }

    /// Forgets apps not in `present` (their shims are gone).
    pub fn retain(&mut self, present: impl Fn(&str) -> bool) {
        self.apps.retain(|a, _| present(a));
    }

    /// The measured completions per WQE of `app`, once measured.
    pub fn cqe_per_wqe(&self, app: &str) -> Option<f64> {
        self.apps.get(app).and_then(|t| t.1)
    }
}

/// The `a` of an app whose completions per WQE measured `measured` (`default` before any
/// measurement) while it polled `polled` completions per second under a polling grant of
/// `grant` per second. At [`SATURATED`] of the grant or more, the grant, not the app, set how
/// many completions it took, and the measurement only bounds `a` from below: `a` is then at
/// least `default`, as the demand cap returns to the instance's when an app saturates its
/// rate grant ([`demand_cap`]). Without that rule the polling grant and the measured `a`
/// chase each other down: a grant that holds completions back lowers the measured `a`, which
/// lowers the next grant (drum-kv's clients, which post a batch and poll once, starved).
pub fn cqe_per_wqe(
    measured: Option<f64>,
    polled: Option<f64>,
    grant: Option<f64>,
    default: f64,
) -> f64 {
    let a = measured.unwrap_or(default);
    match (polled, grant) {
        (Some(p), Some(g)) if g > 0.0 && p >= SATURATED * g => a.max(default),
        _ => a,
    }
}

/// The completion-polling grant, in completions per second, of an app granted `rate` (a
/// fraction of line rate in bytes) whose WQEs carry `bytes_per_wqe` bytes on average and
/// produce `cqe_per_wqe` completions each: the polling rate `z = a·x` of the model in
/// absolute terms, with [`POLL_HEADROOM`]. `None` (no limit) while the WQE size is unknown.
pub fn poll_grant(
    rate: f64,
    cqe_per_wqe: f64,
    line_bytes_per_s: f64,
    bytes_per_wqe: Option<f64>,
) -> Option<u64> {
    let b = bytes_per_wqe.filter(|b| b.is_finite() && *b >= 1.0)?;
    let v = rate * line_bytes_per_s / b * cqe_per_wqe * POLL_HEADROOM;
    (v.is_finite() && v > 0.0).then(|| v.ceil() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_new_app_keeps_its_cap_until_it_sends_or_its_grace_ends() {
        let ms = Duration::from_millis;
        let quiet = Activity::default();
        let mut n = NewApps::default();
        // Connecting: nothing measured, then a rate of zero, which is not read as demand.
        assert_eq!(n.measured("fg", quiet, None, ms(0)), None);
        assert_eq!(n.measured("fg", quiet, Some(0.0), ms(400)), None);
        // Its first traffic ends the grace: from then on its measurements count, zero too.
        assert_eq!(n.measured("fg", quiet, Some(0.3), ms(800)), Some(0.3));
        assert_eq!(n.measured("fg", quiet, Some(0.0), ms(900)), Some(0.0));
        // An app that never connects is measured at zero once the grace is over.
        assert_eq!(n.measured("sink", quiet, Some(0.0), ms(1000)), None);
        let end = ms(1000) + NEW_APP_GRACE;
        assert_eq!(n.measured("sink", quiet, Some(0.0), end - ms(1)), None);
        assert_eq!(n.measured("sink", quiet, Some(0.0), end), Some(0.0));
        // An app whose shims went away and came back is new again.
        n.retain(|a| a != "fg");
        assert_eq!(n.measured("fg", quiet, Some(0.0), ms(5000)), None);
        // Its cap, by the rule that uses it: the new app's, not the floor.
        let cap = |m| demand_cap(1.0, 0.005, m, 0.005, HeldBack::No);
        assert_eq!(cap(n.measured("fg", quiet, Some(0.0), ms(5100))), 1.0);
        assert_eq!(cap(n.measured("sink", quiet, Some(0.0), ms(5100))), 0.005);
    }

    #[test]
    fn a_new_app_that_posts_is_measured_before_its_rate_is() {
        let ms = Duration::from_millis;
        let mut n = NewApps::default();
        assert_eq!(n.measured("bw", Activity::default(), None, ms(0)), None);
        let posted = Activity {
            posted: 3,
            connected_qps: 1,
        };
        // No interval measured yet: the cap rule sees no rate and keeps the instance's.
        assert_eq!(n.measured("bw", posted, None, ms(50)), None);
        assert_eq!(n.measured("bw", posted, Some(0.0), ms(300)), Some(0.0));
    }

    #[test]
    fn a_new_app_silent_on_its_connections_gives_its_share_back_within_half_a_second() {
        let ms = Duration::from_millis;
        let conns = |connected_qps| Activity {
            posted: 0,
            connected_qps,
        };
        let mut n = NewApps::default();
        // A READ server: registered at 0, a client connects at 500 ms, then nothing is posted.
        assert_eq!(n.measured("server", conns(0), Some(0.0), ms(0)), None);
        assert_eq!(n.measured("server", conns(0), Some(0.0), ms(499)), None);
        assert_eq!(n.measured("server", conns(1), Some(0.0), ms(500)), None);
        let silent = ms(500) + SILENT_AFTER_CONNECT;
        assert_eq!(
            n.measured("server", conns(1), Some(0.0), silent - ms(1)),
            None
        );
        assert_eq!(n.measured("server", conns(1), Some(0.0), silent), Some(0.0));
        // Settled for good: more clients connecting do not make it new again.
        assert_eq!(
            n.measured("server", conns(2), Some(0.0), silent + ms(10)),
            Some(0.0)
        );
        // A client opening its connections one after another is not silent while they come.
        for (i, t) in (0..1800).step_by(300).enumerate() {
            assert_eq!(
                n.measured("client", conns(i as u32), None, ms(t)),
                None,
                "at {t} ms"
            );
        }
    }

    #[test]
    fn an_app_held_back_now_and_then_stays_held_back_until_it_has_not_been_for_a_while() {
        use HeldBack::{Completions, No, Work};
        let ms = Duration::from_millis;
        let mut m = HeldMemory::default();
        assert_eq!(m.verdict("kv", No, ms(0)), No, "never held back");
        assert_eq!(m.verdict("kv", Work, ms(100)), Work);
        // a flickering backlog: every reading in between counts as held back
        for t in (150..2100).step_by(50) {
            assert_eq!(m.verdict("kv", No, ms(t)), Work, "at {t} ms");
        }
        assert_eq!(
            m.verdict("kv", No, ms(2100)),
            No,
            "not held back for HELD_MEMORY"
        );
        assert_eq!(m.verdict("kv", Completions, ms(2150)), Completions);
        // per app, and forgotten with the app
        assert_eq!(m.verdict("bulk", Work, ms(3000)), Work);
        assert_eq!(m.verdict("kv", No, ms(3000)), No);
        m.retain(|a| a != "bulk");
        assert_eq!(m.verdict("bulk", No, ms(3001)), No);
    }

    #[test]
    fn caps_follow_usage_below_the_grant_and_release_when_saturated() {
        use HeldBack::{Completions, No, Work};
        let cap = |g, m, held| demand_cap(0.8, g, m, 0.01, held);
        assert_eq!(cap(0.4, None, No), 0.8, "nothing measured");
        assert_eq!(cap(0.4, Some(0.39), No), 0.8, "saturated");
        assert!((cap(0.4, Some(0.1), No) - 0.125).abs() < 1e-12);
        assert_eq!(cap(0.4, Some(0.1), Work), 0.8, "held back by the shim");
        assert_eq!(cap(0.4, Some(0.0), No), 0.01, "floor");
        assert_eq!(
            demand_cap(0.1, 0.9, Some(0.5), 0.01, No),
            0.1,
            "never above the instance"
        );
        assert_eq!(cap(0.4, Some(f64::NAN), No), 0.8);
        // Held back by its polling grant only: the cap doubles from the grant, not to the
        // instance's cap (a latency-bound app at the floor uses 72 % of it).
        assert_eq!(cap(0.01, Some(0.0072), Completions), 0.02);
        assert!((cap(0.4, Some(0.1), Completions) - 0.8).abs() < 1e-12);
        assert!((cap(0.05, Some(0.01), Completions) - 0.1).abs() < 1e-12);
    }

    #[test]
    fn meter_measures_smooths_and_survives_resets() {
        let s = Duration::from_secs;
        let mut m = UsageMeter::new(1000.0, Duration::from_millis(100), 0.5);
        m.observe("a", 0, s(0));
        assert_eq!(m.rate("a"), None);
        m.observe("a", 500, s(1));
        assert_eq!(m.rate("a"), Some(0.5));
        m.observe("a", 600, s(1) + Duration::from_millis(10));
        assert_eq!(m.rate("a"), Some(0.5), "too short an interval");
        m.observe("a", 1500, s(2));
        assert!(
            (m.rate("a").unwrap() - 0.75).abs() < 1e-12,
            "0.5 → 1.0 half-way"
        );
        m.observe("a", 100, s(3)); // a process exited: new baseline
        assert!((m.rate("a").unwrap() - 0.75).abs() < 1e-12);
        m.observe("a", 1100, s(4));
        assert!((m.rate("a").unwrap() - 0.875).abs() < 1e-12);
        m.retain(|a| a != "a");
        assert_eq!(m.rate("a"), None);
    }

    #[test]
    fn cqe_meter_measures_completions_per_wqe_over_enough_wqes() {
        let c = |wqes, completions| WqeCounts { wqes, completions };
        let mut m = CqeMeter::new(0.5);
        m.observe("a", c(0, 0));
        m.observe("a", c(100, 100));
        assert_eq!(m.cqe_per_wqe("a"), None, "too few WQEs yet");
        m.observe("a", c(1000, 250));
        assert_eq!(m.cqe_per_wqe("a"), Some(0.25), "1 signalled in 4");
        m.observe("a", c(2000, 2250));
        assert!(
            (m.cqe_per_wqe("a").unwrap() - 1.125).abs() < 1e-12,
            "0.25 → 2 half-way"
        );
        m.observe("a", c(10, 10)); // a process exited: new baseline
        assert!((m.cqe_per_wqe("a").unwrap() - 1.125).abs() < 1e-12);
        m.observe("a", c(5000, 10));
        assert!(
            (m.cqe_per_wqe("a").unwrap() - (1.125 + 1e-3) / 2.0).abs() < 1e-12,
            "no completions polled: the range's floor, never 0"
        );
        m.retain(|a| a != "a");
        assert_eq!(m.cqe_per_wqe("a"), None);
    }

    #[test]
    fn a_polling_grant_that_binds_does_not_drive_a_down() {
        assert_eq!(cqe_per_wqe(None, None, None, 1.0), 1.0, "new app");
        assert_eq!(cqe_per_wqe(Some(0.2), Some(50.0), Some(1000.0), 1.0), 0.2);
        assert_eq!(cqe_per_wqe(Some(0.2), None, Some(1000.0), 1.0), 0.2);
        assert_eq!(cqe_per_wqe(Some(0.2), Some(950.0), Some(1000.0), 1.0), 1.0);
        assert_eq!(cqe_per_wqe(Some(2.0), Some(950.0), Some(1000.0), 1.0), 2.0);
        assert_eq!(
            cqe_per_wqe(Some(0.2), Some(950.0), Some(0.0), 1.0),
            0.2,
            "no grant"
        );
    }

    #[test]
    fn poll_grant_is_the_granted_wqe_rate_times_a_with_headroom() {
        // Half of 1 GB/s in 64 KiB WQEs, every one signalled: 7 630 WQE/s, 9 537 CQE/s.
        let g = poll_grant(0.5, 1.0, 1e9, Some(65536.0)).unwrap();
        assert_eq!(g, 9537);
        assert_eq!(poll_grant(0.5, 2.0, 1e9, Some(65536.0)), Some(19074));
        assert_eq!(poll_grant(0.5, 1.0, 1e9, None), None, "size unknown");
        assert_eq!(poll_grant(0.5, 1.0, 1e9, Some(0.0)), None);
        assert_eq!(poll_grant(0.0, 1.0, 1e9, Some(4096.0)), None);
        assert_eq!(poll_grant(f64::NAN, 1.0, 1e9, Some(4096.0)), None);
    }
}
