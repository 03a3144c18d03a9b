//! Registered apps that send above their grant (issue 23): the shim is cooperative, so a
//! process can register and then send as it likes (write its own grant fields, call the
//! provider directly, drop the shim after registering). Where the NIC counts per process
//! (softrnic's stats file), the agent compares what each app's registered processes on this
//! host sent together with what the app's grant allowed over a window, and reports and
//! accounts for the apps well above it, naming each of their processes with its part.
//!
//! The app, not the process, is judged: the optimiser grants a rate to a (host, app) pair.
//! Each process's part of it (`drum_common::process_share`) moves with its use, so a process
//! whose part just shrank is not over anything its app was given (docs/tenants.md, "The app
//! is judged, on the sum of its processes").
//!
//! Pure: the caller reads the counters and the grants and passes its clock.

use crate::warned_once::WarnedOnce;
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::Duration;

/// Bytes one governed process may legitimately be ahead of its grant at a window's edges,
/// whatever the rate: its limiter's burst (5 ms at the rate, at least one 64 KiB message) and
/// the work requests the NIC fetched before the counter's reading. An app gets it per
/// process: each has its own limiter.
pub const SLACK_BYTES: f64 = (1 << 20) as f64;

/// A registered process as the agent knows it now.
#[derive(Clone, Debug, PartialEq)]
pub struct Registered {
    pub pid: u32,
    pub uid: u32,
    pub app: String,
}

/// An app whose registered processes on this host sent more than its grant allowed over the
/// last window.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct OverGrant {
    pub app: String,
    /// What its grants allowed over the window, as a mean rate (payload bytes per second).
    pub grant_bytes_per_s: f64,
    /// What the NIC fetched from its processes' QPs over the window (bytes per second).
    pub measured_bytes_per_s: f64,
    /// The difference: what the host's budget loses to it.
    pub excess_bytes_per_s: f64,
    /// Seconds the judgement covers.
    pub window_s: f64,
    /// Its processes on the NIC, the biggest sender first.
    pub processes: Vec<Part>,
}

/// One process of an app found above its grant.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Part {
    pub pid: u32,
    pub uid: u32,
    /// What it sent over the window (bytes per second).
    pub measured_bytes_per_s: f64,
    /// First time this process is part of an app found over its grant (the caller warns
    /// once).
    #[serde(skip)]
    pub first: bool,
}

/// One reading of an app: when, its bytes at the NIC since it was first seen (and each
/// process's), and the bytes its grants allowed up to then.
#[derive(Clone, Debug)]
struct Sample {
    at: Duration,
    sent: u64,
    parts: BTreeMap<u32, u64>,
    allowed: f64,
}

#[derive(Default)]
struct Track {
    samples: VecDeque<Sample>,
    /// The grant in force since the last sample.
    grant: u64,
    /// Bytes its processes sent since the app was first seen, in total and per process:
    /// summed from each process's increments, so that a process joining with a counter
    /// already high, or leaving, moves neither.
    sent: u64,
    parts: BTreeMap<u32, u64>,
}

/// The auditor's memory between scans.
pub struct GrantAudit {
    window: Duration,
    tolerance: f64,
    /// Each registered process's app and NIC counter at the last reading.
    last: BTreeMap<u32, (String, u64)>,
    tracks: BTreeMap<String, Track>,
    warned: WarnedOnce<(u32, String)>,
}

impl GrantAudit {
    /// `window`: how long an app is judged over (long next to the pacers' bursts and the
    /// counters' refresh); `tolerance`: the fraction above the allowance that is not reported.
    pub fn new(window: Duration, tolerance: f64) -> Self {
        GrantAudit {
            window,
            tolerance,
            last: BTreeMap::new(),
            tracks: BTreeMap::new(),
            warned: WarnedOnce::default(),
        }
    }

    /// Records the NIC's per-process byte `counters`, the registered processes and each
    /// app's byte grant (`grants`, payload bytes per second; absent or 0: unlimited) read at
    /// `now`; returns the apps whose processes together sent more over the last window than
    /// the app's grants allowed, by more than the tolerance and [`SLACK_BYTES`] per process.
    /// An app is judged only over a window its grant limited throughout (an unlimited grant
    /// allows anything).
    pub fn observe(
        &mut self,
        now: Duration,
        procs: &[Registered],
        grants: &BTreeMap<String, u64>,
        counters: &BTreeMap<u32, u64>,
    ) -> Vec<OverGrant> {
        let mut on_nic: BTreeMap<&str, Vec<&Registered>> = BTreeMap::new();
        for p in procs {
            let Some(&counter) = counters.get(&p.pid) else {
                self.last.remove(&p.pid);
                continue;
            };
            // A process's first reading, a pid registered anew (another app), or a counter
            // that went back (a new process with the pid) only sets where it counts from.
            let sent = match self.last.get(&p.pid) {
                Some((app, before)) if *app == p.app && counter >= *before => counter - before,
                _ => 0,
            };
            self.last.insert(p.pid, (p.app.clone(), counter));
            let t = self.tracks.entry(p.app.clone()).or_default();
            t.sent = t.sent.saturating_add(sent);
            let part = t.parts.entry(p.pid).or_default();
            *part = part.saturating_add(sent);
            on_nic.entry(&p.app).or_default().push(p);
        }
        let mut out = Vec::new();
        for (&app, members) in &on_nic {
            let grant = grants.get(app).copied().unwrap_or(0);
            let t = self.tracks.get_mut(app).expect("tracked above");
            t.parts
                .retain(|pid, _| members.iter().any(|m| m.pid == *pid));
            let last = t.samples.back();
            // A stretch without a limit says nothing about now.
            let allowed = match last {
                Some(l) if t.grant != 0 && now >= l.at => {
                    l.allowed + t.grant as f64 * (now - l.at).as_secs_f64()
                }
                _ => {
                    t.samples.clear();
                    0.0
                }
            };
            t.grant = grant;
            t.samples.push_back(Sample {
                at: now,
                sent: t.sent,
                parts: t.parts.clone(),
                allowed,
            });
            // Keep the newest sample at least a window old: the judgement spans the window.
            while t.samples.len() > 1 && now.saturating_sub(t.samples[1].at) >= self.window {
                t.samples.pop_front();
            }
            let first = &t.samples[0];
            let span = now.saturating_sub(first.at);
            if span < self.window || span.is_zero() {
                continue;
            }
            let sent = (t.sent - first.sent) as f64;
            let allowed = allowed - first.allowed;
            let slack = SLACK_BYTES * members.len() as f64;
            if sent <= allowed * (1.0 + self.tolerance) + slack {
                continue;
            }
            let s = span.as_secs_f64();
            let mut processes: Vec<Part> = members
                .iter()
                .map(|m| {
                    let before = first.parts.get(&m.pid).copied().unwrap_or(0);
                    Part {
                        pid: m.pid,
                        uid: m.uid,
                        measured_bytes_per_s: t.parts[&m.pid].saturating_sub(before) as f64 / s,
                        first: self.warned.first((m.pid, app.to_string())),
                    }
                })
                .collect();
            processes.sort_by(|a, b| b.measured_bytes_per_s.total_cmp(&a.measured_bytes_per_s));
            out.push(OverGrant {
                app: app.to_string(),
                grant_bytes_per_s: allowed / s,
                measured_bytes_per_s: sent / s,
                excess_bytes_per_s: (sent - allowed) / s,
                window_s: s,
                processes,
            });
        }
        // An app none of whose processes is on the NIC is not judged, and starts afresh.
        self.tracks
            .retain(|app, _| on_nic.contains_key(app.as_str()));
        let present: BTreeSet<(u32, &str)> = procs.iter().map(|p| (p.pid, &*p.app)).collect();
        self.last
            .retain(|pid, (app, _)| present.contains(&(*pid, app.as_str())));
        self.warned
            .forget_absent(|(pid, app)| present.contains(&(*pid, app.as_str())));
        out
    }
}

/// One WARN for each process found, for the first time, among the processes of an app
/// above its grant (the audit's only side effect, kept out of [`GrantAudit`]).
pub fn warn_first(found: &[OverGrant]) {
    for o in found {
        for p in o.processes.iter().filter(|p| p.first) {
            tracing::warn!(
                pid = p.pid,
                uid = p.uid,
                app = %o.app,
                grant_bytes_per_s = o.grant_bytes_per_s.round(),
                measured_bytes_per_s = o.measured_bytes_per_s.round(),
                processes = o.processes.len(),
                process_bytes_per_s = p.measured_bytes_per_s.round(),
                window_s = o.window_s,
                "a registered app sends above its grant: a process of it bypasses the shim or ignores its grant; the excess comes off the host's budget"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MB: u64 = 1_000_000;

    fn proc(pid: u32, app: &str) -> Registered {
        Registered {
            pid,
            uid: 1000 + pid,
            app: app.into(),
        }
    }

    fn grant(app: &str, bytes_per_s: u64) -> BTreeMap<String, u64> {
        BTreeMap::from([(app.to_string(), bytes_per_s)])
    }

    /// Feeds one reading a second: process 1 of app `a` sends `rate1` against a grant of
    /// 10 MB/s.
    fn run(a: &mut GrantAudit, secs: std::ops::Range<u64>, rate1: u64) -> Vec<Vec<OverGrant>> {
        secs.map(|s| {
            let counters = BTreeMap::from([(1, rate1 * s)]);
            a.observe(
                Duration::from_secs(s),
                &[proc(1, "a")],
                &grant("a", 10 * MB),
                &counters,
            )
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
        assert_eq!(v.app, "a");
        assert!((v.grant_bytes_per_s - 10e6).abs() < 1.0);
        assert!((v.measured_bytes_per_s - 40e6).abs() < 1.0);
        assert!((v.excess_bytes_per_s - 30e6).abs() < 1.0);
        let p = &v.processes[0];
        assert_eq!((v.processes.len(), p.pid, p.uid), (1, 1, 1001));
        assert!((p.measured_bytes_per_s - 40e6).abs() < 1.0);
        assert!(p.first);
        assert!(
            seen[4..].iter().all(|v| !v[0].processes[0].first),
            "warned once"
        );
    }

    /// Four processes of one app, `counters(s)` their NIC counters at second `s`, against
    /// the app's grant of 10 MB/s; the reports of seconds 0–9.
    fn four(counters: impl Fn(u64) -> [u64; 4]) -> Vec<Vec<OverGrant>> {
        let mut a = GrantAudit::new(Duration::from_secs(3), 0.25);
        let procs: Vec<Registered> = (1..=4).map(|p| proc(p, "kv")).collect();
        (0..10)
            .map(|s| {
                let c = counters(s);
                let counters = (1..=4).zip(c).collect();
                a.observe(
                    Duration::from_secs(s),
                    &procs,
                    &grant("kv", 10 * MB),
                    &counters,
                )
            })
            .collect()
    }

    #[test]
    fn an_app_is_judged_on_its_processes_sum_not_on_any_share() {
        // The grant split unevenly: one process takes 7 MB/s, three 1 MB/s each. Each is
        // within the whole grant, the first far above an equal share (2.5 MB/s): fine, as
        // the sum (10 MB/s) is.
        let uneven = four(|s| [7 * MB * s, MB * s, MB * s, MB * s]);
        assert!(uneven.iter().all(|v| v.is_empty()), "{uneven:?}");
        // Each process keeps within the whole grant (9 MB/s), together 36 MB/s: the app is
        // reported, each process named with its part.
        let each = four(|s| [9 * MB * s; 4]);
        assert!(each[..3].iter().all(|v| v.is_empty()));
        let v = &each[3][0];
        assert_eq!(v.app, "kv");
        assert!((v.measured_bytes_per_s - 36e6).abs() < 1.0, "{v:?}");
        assert!((v.excess_bytes_per_s - 26e6).abs() < 1.0, "{v:?}");
        assert_eq!(v.processes.len(), 4);
        assert!(v
            .processes
            .iter()
            .all(|p| p.first && (p.measured_bytes_per_s - 9e6).abs() < 1.0));
        // The slack is per process: four at 1.25 × 2.5 MB/s + 0.3 MB/s are clear.
        let edge = four(|s| [3_400_000 * s; 4]);
        assert!(edge.iter().all(|v| v.is_empty()), "{edge:?}");
    }

    #[test]
    fn a_process_joining_or_leaving_moves_nothing_but_its_own_increments() {
        let mut a = GrantAudit::new(Duration::from_secs(3), 0.25);
        let g = grant("kv", 10 * MB);
        for s in 0..12u64 {
            // Process 1 sends 8 MB/s throughout; process 2 joins at second 4 with a counter
            // of 10 GB (sent before it registered) and 1 MB/s, and leaves at second 8.
            let mut procs = vec![proc(1, "kv")];
            let mut counters = BTreeMap::from([(1, 8 * MB * s)]);
            if (4..8).contains(&s) {
                procs.push(proc(2, "kv"));
                counters.insert(2, 10_000 * MB + MB * (s - 4));
            }
            let v = a.observe(Duration::from_secs(s), &procs, &g, &counters);
            assert!(v.is_empty(), "at {s}: {v:?}");
        }
    }

    #[test]
    fn the_allowance_follows_the_grant_as_it_changes() {
        let mut a = GrantAudit::new(Duration::from_secs(4), 0.1);
        let mut sent = 0;
        let mut last = Vec::new();
        for s in 0..=8u64 {
            // Granted 10 MB/s, then 40 MB/s from second 4; it sends 38 MB/s throughout.
            let g = if s < 4 { 10 * MB } else { 40 * MB };
            last = a.observe(
                Duration::from_secs(s),
                &[proc(1, "a")],
                &grant("a", g),
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
        let obs = |a: &mut GrantAudit, s: u64, app: &str, g: u64, sent: u64| {
            a.observe(
                Duration::from_secs(s),
                &[proc(1, app)],
                &grant(app, g),
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
        assert!(v[0].processes[0].first, "a new registration is warned anew");
        // An app without a grant is unlimited.
        let none = a.observe(
            Duration::from_secs(20),
            &[proc(1, "c")],
            &BTreeMap::new(),
            &BTreeMap::from([(1, 900 * MB)]),
        );
        assert!(none.is_empty());
    }

    #[test]
    fn gone_processes_are_forgotten_and_a_small_grant_keeps_its_slack() {
        let mut a = GrantAudit::new(Duration::from_secs(2), 0.25);
        // 100 B/s granted, 300 KB sent in 3 s: less than the slack.
        for s in 0..=3u64 {
            let v = a.observe(
                Duration::from_secs(s),
                &[proc(7, "x")],
                &grant("x", 100),
                &BTreeMap::from([(7, s * 100_000)]),
            );
            assert!(v.is_empty());
        }
        a.observe(
            Duration::from_secs(4),
            &[],
            &BTreeMap::new(),
            &BTreeMap::new(),
        );
        assert!(a.tracks.is_empty() && a.warned.is_empty() && a.last.is_empty());
        // Registered but not on the NIC: nothing to judge.
        let v = a.observe(
            Duration::from_secs(5),
            &[proc(8, "y")],
            &grant("y", 1),
            &BTreeMap::new(),
        );
        assert!(v.is_empty() && a.tracks.is_empty());
    }
}
