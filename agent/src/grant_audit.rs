//! Registered processes that ignore their grant (issue 23): the shim is cooperative, so a
//! process can register and then send as it likes (write its own grant fields, call the
//! provider directly, drop the shim after registering). Where the NIC counts per process
//! (softrnic's stats file), the agent compares what each registered process sent with what
//! its grant allowed over a window, and reports and accounts for the ones well above it.
//!
//! Pure: the caller reads the counters and the grants and passes its clock.

use crate::warned_once::WarnedOnce;
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::Duration;

/// Bytes a governed process may legitimately be ahead of its grant at a window's edges,
/// whatever the rate: its limiter's burst (5 ms at the rate, at least one 64 KiB message) and
/// the work requests the NIC fetched before the counter's reading.
pub const SLACK_BYTES: f64 = (1 << 20) as f64;

/// A registered process as the agent knows it now.
#[derive(Clone, Debug, PartialEq)]
pub struct Registered {
    pub pid: u32,
    pub uid: u32,
    pub app: String,
    /// The byte rate its table grants now (payload bytes per second; 0: unlimited).
    pub grant_bytes_per_s: u64,
}

/// A registered process that sent more than its grant allowed over the last window.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct OverGrant {
    pub pid: u32,
    pub uid: u32,
    pub app: String,
    /// What its grants allowed over the window, as a mean rate (payload bytes per second).
    pub grant_bytes_per_s: f64,
    /// What the NIC fetched from its QPs over the window (bytes per second).
    pub measured_bytes_per_s: f64,
    /// The difference: what the host's budget loses to it.
    pub excess_bytes_per_s: f64,
    /// Seconds the judgement covers.
    pub window_s: f64,
    /// First time this process is found over its grant (the caller warns once).
    #[serde(skip)]
    pub first: bool,
}

/// One reading: when, the NIC's cumulative bytes, and the bytes its grants allowed up to then.
#[derive(Clone, Copy, Debug)]
struct Sample {
    at: Duration,
    sent: u64,
    allowed: f64,
}

struct Track {
    app: String,
    samples: VecDeque<Sample>,
    /// The grant in force since the last sample.
    grant: u64,
}

/// The auditor's memory between scans.
pub struct GrantAudit {
    window: Duration,
    tolerance: f64,
    tracks: BTreeMap<u32, Track>,
    warned: WarnedOnce<(u32, String)>,
}

impl GrantAudit {
    /// `window`: how long a process is judged over (long next to the pacers' bursts and the
    /// counters' refresh); `tolerance`: the fraction above the allowance that is not reported.
    pub fn new(window: Duration, tolerance: f64) -> Self {
        GrantAudit {
            window,
            tolerance,
            tracks: BTreeMap::new(),
            warned: WarnedOnce::default(),
        }
    }

    /// Records the NIC's per-process byte `counters` and the registered processes' grants read
    /// at `now`; returns the processes whose sending over the last window exceeded what their
    /// grants allowed by more than the tolerance and [`SLACK_BYTES`]. A process is judged only
    /// over a window its grant limited throughout (an unlimited grant allows anything).
    pub fn observe(
        &mut self,
        now: Duration,
        procs: &[Registered],
        counters: &BTreeMap<u32, u64>,
    ) -> Vec<OverGrant> {
        let mut out = Vec::new();
        for p in procs {
            let Some(&sent) = counters.get(&p.pid) else {
                self.tracks.remove(&p.pid);
                continue;
            };
            let t = self.tracks.entry(p.pid).or_insert_with(|| Track {
                app: p.app.clone(),
                samples: VecDeque::new(),
                grant: p.grant_bytes_per_s,
            });
            let last = t.samples.back().copied();
            // Another registration with this pid, a counter that went back (a new process),
            // or a stretch without a limit: what came before says nothing about now.
            let fresh =
                t.app != p.app || t.grant == 0 || last.is_none_or(|l| sent < l.sent || now < l.at);
            let allowed = match last {
                Some(l) if !fresh => {
                    l.allowed + t.grant as f64 * now.saturating_sub(l.at).as_secs_f64()
                }
                _ => {
                    t.samples.clear();
                    0.0
                }
            };
            t.app = p.app.clone();
            t.grant = p.grant_bytes_per_s;
            t.samples.push_back(Sample {
                at: now,
                sent,
                allowed,
            });
            // Keep the newest sample at least a window old: the judgement spans the window.
            while t.samples.len() > 1 && now.saturating_sub(t.samples[1].at) >= self.window {
                t.samples.pop_front();
            }
            let first = t.samples[0];
            let span = now.saturating_sub(first.at);
            if span < self.window || span.is_zero() {
                continue;
            }
            let sent = (sent - first.sent) as f64;
            let allowed = allowed - first.allowed;
            if sent <= allowed * (1.0 + self.tolerance) + SLACK_BYTES {
                continue;
            }
            let s = span.as_secs_f64();
            out.push(OverGrant {
                pid: p.pid,
                uid: p.uid,
                app: p.app.clone(),
                grant_bytes_per_s: allowed / s,
                measured_bytes_per_s: sent / s,
                excess_bytes_per_s: (sent - allowed) / s,
                window_s: s,
                first: self.warned.first((p.pid, p.app.clone())),
            });
        }
        let present: BTreeSet<u32> = procs.iter().map(|p| p.pid).collect();
        self.tracks.retain(|pid, _| present.contains(pid));
        self.warned.forget_absent(|(pid, _)| present.contains(pid));
        out
    }
}

/// One WARN for each process found over its grant for the first time (the audit's only
/// side effect, kept out of [`GrantAudit`]).
pub fn warn_first(found: &[OverGrant]) {
    for o in found.iter().filter(|o| o.first) {
        tracing::warn!(
            pid = o.pid,
            uid = o.uid,
            app = %o.app,
            grant_bytes_per_s = o.grant_bytes_per_s.round(),
            measured_bytes_per_s = o.measured_bytes_per_s.round(),
            window_s = o.window_s,
            "a registered process sends above its grant: the shim is bypassed or its grant ignored; the excess comes off the host's budget"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MB: u64 = 1_000_000;

    fn proc(pid: u32, app: &str, grant: u64) -> Registered {
        Registered {
            pid,
            uid: 1000 + pid,
            app: app.into(),
            grant_bytes_per_s: grant,
        }
    }

    /// Feeds one reading a second: process 1 sends `rate1` against a grant of 10 MB/s.
    fn run(a: &mut GrantAudit, secs: std::ops::Range<u64>, rate1: u64) -> Vec<Vec<OverGrant>> {
        secs.map(|s| {
            let counters = BTreeMap::from([(1, rate1 * s)]);
            a.observe(Duration::from_secs(s), &[proc(1, "a", 10 * MB)], &counters)
        })
        .collect()
    }

    #[test]
    fn a_process_within_its_grant_and_tolerance_is_never_reported() {
        let mut a = GrantAudit::new(Duration::from_secs(3), 0.25);
        // 20 % above its grant: inside the tolerance.
        assert!(run(&mut a, 0..20, 12 * MB).iter().all(|v| v.is_empty()));
    }

    #[test]
    fn a_process_above_its_grant_is_reported_after_a_window_and_warned_once() {
        let mut a = GrantAudit::new(Duration::from_secs(3), 0.25);
        let seen = run(&mut a, 0..10, 40 * MB);
        // Nothing before a whole window is covered.
        assert!(seen[..3].iter().all(|v| v.is_empty()));
        assert!(seen[3..].iter().all(|v| v.len() == 1));
        let v = &seen[3][0];
        assert_eq!((v.pid, v.uid, v.app.as_str()), (1, 1001, "a"));
        assert!((v.grant_bytes_per_s - 10e6).abs() < 1.0);
        assert!((v.measured_bytes_per_s - 40e6).abs() < 1.0);
        assert!((v.excess_bytes_per_s - 30e6).abs() < 1.0);
        assert!(v.first);
        assert!(seen[4..].iter().all(|v| !v[0].first), "warned once");
    }

    #[test]
    fn the_allowance_follows_the_grant_as_it_changes() {
        let mut a = GrantAudit::new(Duration::from_secs(4), 0.1);
        let mut sent = 0;
        let mut last = Vec::new();
        for s in 0..=8u64 {
            // Granted 10 MB/s, then 40 MB/s from second 4; it sends 38 MB/s throughout.
            let grant = if s < 4 { 10 * MB } else { 40 * MB };
            last = a.observe(
                Duration::from_secs(s),
                &[proc(1, "a", grant)],
                &BTreeMap::from([(1, sent)]),
            );
            if s == 4 {
                assert_eq!(last.len(), 1, "over 10 MB/s");
            }
            sent += 38 * MB;
        }
        assert!(last.is_empty(), "within 40 MB/s: {last:?}");
    }

    #[test]
    fn unlimited_stretches_restarted_counters_and_new_registrations_start_afresh() {
        let mut a = GrantAudit::new(Duration::from_secs(3), 0.25);
        let obs = |a: &mut GrantAudit, s: u64, app: &str, grant: u64, sent: u64| {
            a.observe(
                Duration::from_secs(s),
                &[proc(1, app, grant)],
                &BTreeMap::from([(1, sent)]),
            )
        };
        // Unlimited for 3 s at 100 MB/s, then limited to 10 MB/s and sending 5 MB/s.
        for s in 0..=3 {
            assert!(obs(&mut a, s, "a", 0, s * 100 * MB).is_empty());
        }
        for s in 4..=8 {
            let sent = 300 * MB + (s - 3) * 5 * MB;
            assert!(obs(&mut a, s, "a", 10 * MB, sent).is_empty(), "at {s}");
        }
        // The pid registers as another app with a counter that restarted.
        assert!(obs(&mut a, 9, "b", 10 * MB, 0).is_empty());
        assert!(obs(&mut a, 11, "b", 10 * MB, 200 * MB).is_empty());
        let v = obs(&mut a, 12, "b", 10 * MB, 300 * MB);
        assert_eq!(v.len(), 1);
        assert!(v[0].first, "a new registration is warned anew");
    }

    #[test]
    fn gone_processes_are_forgotten_and_a_small_grant_keeps_its_slack() {
        let mut a = GrantAudit::new(Duration::from_secs(2), 0.25);
        // 100 B/s granted, 300 KB sent in 3 s: less than the slack.
        for s in 0..=3u64 {
            let v = a.observe(
                Duration::from_secs(s),
                &[proc(7, "x", 100)],
                &BTreeMap::from([(7, s * 100_000)]),
            );
            assert!(v.is_empty());
        }
        a.observe(Duration::from_secs(4), &[], &BTreeMap::new());
        assert!(a.tracks.is_empty() && a.warned.is_empty());
        // Registered but not on the NIC: nothing to judge.
        let v = a.observe(Duration::from_secs(5), &[proc(8, "y", 1)], &BTreeMap::new());
        assert!(v.is_empty() && a.tracks.is_empty());
    }
}
