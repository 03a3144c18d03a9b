//! RDMA users DRUM does not govern (issue 23): processes on the host that hold a verbs
//! device open without a registered shim. The hub's scanner thread finds them in `/proc`
//! every `scan_ms`, says why each may be ungoverned, and measures what they send where the
//! NIC counts per process (softrnic's stats file; `rdma statistic`-style counters on real
//! NICs are future work, docs/tenants.md "Real NICs"), so that the agent can
//! take it out of the host's budget.
//! Registered processes whose shim says they drive queues directly are in [`direct_verbs`].

pub mod direct_verbs;

use crate::warned_once::WarnedOnce;
use serde::Deserialize;
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::time::{Duration, Instant};
use tracing::warn;

/// `[shim.ungoverned]`.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct UngovernedSettings {
    /// Whether to look at all.
    #[serde(default = "d_true")]
    pub enabled: bool,
    /// How often `/proc` is scanned.
    #[serde(default = "d_scan_ms")]
    pub scan_ms: u64,
    /// Path prefixes of verbs devices (as the processes' own mount namespaces name them).
    #[serde(default = "d_devices")]
    pub devices: Vec<String>,
    /// Only processes in the agent's network namespace: emulated hosts (softrnic) share one
    /// kernel and tell their processes apart by namespace.
    #[serde(default)]
    pub same_netns: bool,
    /// The NIC's per-process counters: a file of `proc_tx_bytes.PID N` lines (softrnic's
    /// stats file, `<run>/hosts/<host>/stats`). None: usage unknown, reported only.
    #[serde(default)]
    pub nic_counters: Option<PathBuf>,
    /// How long a registered process's sending is compared with its grant
    /// (`grant_audit`; needs `nic_counters`).
    #[serde(default = "d_audit_window_ms")]
    pub audit_window_ms: u64,
    /// How far above its grant a registered process may send before it is reported.
    #[serde(default = "d_audit_tolerance")]
    pub audit_tolerance: f64,
}

impl Default for UngovernedSettings {
    fn default() -> Self {
        UngovernedSettings {
            enabled: true,
            scan_ms: d_scan_ms(),
            devices: d_devices(),
            same_netns: false,
            nic_counters: None,
            audit_window_ms: d_audit_window_ms(),
            audit_tolerance: d_audit_tolerance(),
        }
    }
}

fn d_true() -> bool {
    true
}
fn d_scan_ms() -> u64 {
    1000
}
/// Three scans at the default period, and 15 of softrnic's 200 ms counter refreshes: one
/// stale refresh is at most 7 % of it.
fn d_audit_window_ms() -> u64 {
    3000
}
/// The shim holds a grant within ±5 % on average, but its NIC pacing lets a QP that fell
/// behind catch up at twice its share for a while, and each end of the window reads counters
/// up to 200 ms old (softrnic's refresh; 7 % of 3 s): 25 % keeps governed
/// processes clear, while a process that ignores its grant sends what the NIC gives it,
/// typically several times its grant.
fn d_audit_tolerance() -> f64 {
    0.25
}
fn d_devices() -> Vec<String> {
    vec!["/dev/infiniband/uverbs".into()]
}

impl UngovernedSettings {
    pub fn validate(&self) -> Result<(), String> {
        if !(50..=600_000).contains(&self.scan_ms) {
            return Err(format!(
                "shim.ungoverned.scan_ms = {} must be in [50, 600000]",
                self.scan_ms
            ));
        }
        if !(500..=3_600_000).contains(&self.audit_window_ms) || self.audit_window_ms < self.scan_ms
        {
            return Err(format!(
                "shim.ungoverned.audit_window_ms = {} must be in [500, 3600000] and at least scan_ms",
                self.audit_window_ms
            ));
        }
        if !(0.0..=10.0).contains(&self.audit_tolerance) {
            return Err(format!(
                "shim.ungoverned.audit_tolerance = {} must be in [0, 10]",
                self.audit_tolerance
            ));
        }
        if self.devices.is_empty() || self.devices.iter().any(|d| !d.starts_with('/')) {
            return Err("shim.ungoverned.devices must be absolute path prefixes".into());
        }
        Ok(())
    }
}

/// A process using the NIC that no shim governs.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Ungoverned {
    pub pid: u32,
    pub uid: u32,
    pub gid: u32,
    pub cgroup: String,
    pub exe: String,
    pub reason: &'static str,
    /// What it sends, bytes per second over the last scan (0 where the NIC does not say).
    pub tx_bytes_per_s: f64,
}

/// Why a process holding a device has no registered shim, from what it has mapped.
pub fn reason(shim_mapped: bool, verbs_mapped: bool) -> &'static str {
    match (shim_mapped, verbs_mapped) {
        (true, _) => "the shim is loaded but not registered with this agent (refused, agent unreachable, or a child after fork)",
        (false, true) => "no shim loaded (LD_PRELOAD absent or cleared)",
        (false, false) => "no libibverbs.so mapped: verbs linked statically or the device driven directly",
    }
}

/// `proc_tx_bytes.PID N` lines of a counters file: bytes each process's QPs have sent.
/// Other lines, and malformed ones, are not ours and are skipped.
pub fn parse_proc_counters(text: &str) -> BTreeMap<u32, u64> {
    text.lines()
        .filter_map(|l| {
            let (k, v) = l.split_once(' ')?;
            let pid = k.strip_prefix("proc_tx_bytes.")?.parse().ok()?;
            Some((pid, v.trim().parse().ok()?))
        })
        .collect()
}

/// The NIC's per-process byte counters now (empty without `nic_counters`, or while its file
/// cannot be read).
pub fn read_counters(cfg: &UngovernedSettings) -> BTreeMap<u32, u64> {
    cfg.nic_counters
        .as_ref()
        .and_then(|p| std::fs::read_to_string(p).ok())
        .map_or_else(BTreeMap::new, |t| parse_proc_counters(&t))
}

/// Byte rates from successive readings of per-process counters.
#[derive(Default)]
pub struct Rates {
    last: BTreeMap<u32, (u64, Instant)>,
}

impl Rates {
    /// Records the counters read at `now`; returns each process's bytes per second since its
    /// previous reading (none at its first; a counter that went back counts as a restart).
    pub fn observe(&mut self, counters: &BTreeMap<u32, u64>, now: Instant) -> BTreeMap<u32, f64> {
        let mut out = BTreeMap::new();
        for (&pid, &bytes) in counters {
            if let Some(&(before, t)) = self.last.get(&pid) {
                let dt = now.saturating_duration_since(t).as_secs_f64();
                if dt > 0.0 {
                    out.insert(pid, bytes.saturating_sub(before) as f64 / dt);
                }
            }
            self.last.insert(pid, (bytes, now));
        }
        self.last.retain(|p, _| counters.contains_key(p));
        out
    }
}

/// The smallest change of the host's budget that rebuilds its problem: the measured share
/// moves a little every scan, and a rebuild is not free (the host's row is rebuilt and
/// re-reported, and the optimiser moves to the new budget over some rounds).
pub const BUDGET_STEP: f64 = 0.05;

/// The host's WQE budget for its governed apps: the configured one less what ungoverned
/// processes send (fractions of the line rate), never below `floor` (every active app's
/// minimum rate, which the model must be able to give).
pub fn host_budget(configured: f64, ungoverned: f64, floor: f64) -> f64 {
    let u = if ungoverned.is_finite() {
        ungoverned.max(0.0)
    } else {
        0.0
    };
    (configured - u).max(floor.min(configured))
}

/// A process must hold a device without a shim this long before it is reported: a shimmed
/// program opens the device a moment before its shim registers.
pub const GRACE: Duration = Duration::from_millis(800);

/// The scanner's memory between scans.
#[derive(Default)]
pub struct Scanner {
    first_seen: BTreeMap<u32, Instant>,
    warned: WarnedOnce<(u32, String)>,
    rates: Rates,
}

impl Scanner {
    /// One scan: every process holding a device that is not in `registered` and has held it
    /// for [`GRACE`]; each is logged once (WARN) when first reported.
    pub fn scan(
        &mut self,
        cfg: &UngovernedSettings,
        registered: &BTreeSet<u32>,
        counters: &BTreeMap<u32, u64>,
    ) -> Vec<Ungoverned> {
        use crate::procfs;
        let now = Instant::now();
        let me = std::process::id();
        let my_ns = procfs::netns("self");
        let mut holders = BTreeSet::new();
        for pid in procfs::pids() {
            if pid == me || registered.contains(&pid) {
                continue;
            }
            if cfg.same_netns && procfs::netns(&pid.to_string()) != my_ns {
                continue;
            }
            if procfs::holds_device(pid, &cfg.devices) {
                holders.insert(pid);
            }
        }
        self.first_seen.retain(|p, _| holders.contains(p));
        let rates = self.rates.observe(counters, now);
        let mut out = Vec::new();
        for pid in holders {
            let since = *self.first_seen.entry(pid).or_insert(now);
            if now.duration_since(since) < GRACE {
                continue;
            }
            let Some((uid, gid)) = procfs::owner(pid) else {
                continue;
            };
            let maps = procfs::mapped(pid, &["libdrum_shim", "libibverbs.so"]);
            let u = Ungoverned {
                pid,
                uid,
                gid,
                cgroup: procfs::cgroup(pid),
                exe: procfs::exe(pid),
                reason: reason(maps[0], maps[1]),
                tx_bytes_per_s: rates.get(&pid).copied().unwrap_or(0.0),
            };
            if self.warned.first((pid, u.exe.clone())) {
                warn!(
                    pid,
                    uid,
                    gid,
                    cgroup = %u.cgroup,
                    exe = %u.exe,
                    reason = u.reason,
                    "a process uses the RDMA device without DRUM's shim: its traffic is not governed"
                );
            }
            out.push(u);
        }
        let alive: BTreeSet<u32> = self.first_seen.keys().copied().collect();
        self.warned.forget_absent(|(p, _)| alive.contains(p));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn per_process_counters_are_read_and_others_skipped() {
        let text = "tx_packets 9\nproc_tx_bytes.42 1000\nproc_tx_bytes.x 5\nproc_tx_bytes.7 nan\nproc_tx_wqes.42 3\n";
        assert_eq!(parse_proc_counters(text), BTreeMap::from([(42, 1000)]));
    }

    #[test]
    fn rates_are_deltas_over_time_and_forget_gone_processes() {
        let mut r = Rates::default();
        let t = Instant::now();
        assert!(r.observe(&BTreeMap::from([(1, 100)]), t).is_empty());
        let out = r.observe(
            &BTreeMap::from([(1, 1100), (2, 5)]),
            t + Duration::from_millis(500),
        );
        assert_eq!(out, BTreeMap::from([(1, 2000.0)]));
        // A counter that went back (a new process with the pid) is no negative rate.
        let out = r.observe(&BTreeMap::from([(1, 0)]), t + Duration::from_secs(1));
        assert_eq!(out[&1], 0.0);
        assert!(!r.last.contains_key(&2));
    }

    #[test]
    fn the_budget_loses_what_ungoverned_processes_send_down_to_the_floor() {
        assert_eq!(host_budget(1.0, 0.4, 0.16), 0.6);
        assert_eq!(host_budget(1.0, 0.95, 0.16), 0.16);
        assert_eq!(host_budget(1.0, f64::NAN, 0.16), 1.0);
        assert_eq!(host_budget(0.1, 0.0, 0.16), 0.1);
    }

    #[test]
    fn reasons_name_what_is_missing() {
        assert!(reason(true, true).contains("not registered"));
        assert!(reason(false, true).contains("no shim"));
        assert!(reason(false, false).contains("statically"));
    }

    #[test]
    fn settings_out_of_range_are_refused() {
        let mut s = UngovernedSettings::default();
        s.validate().unwrap();
        s.scan_ms = 0;
        assert!(s.validate().unwrap_err().contains("scan_ms"));
        s.scan_ms = 1000;
        s.audit_window_ms = 200;
        assert!(s.validate().unwrap_err().contains("audit_window_ms"));
        s.audit_window_ms = 3000;
        s.audit_tolerance = -1.0;
        assert!(s.validate().unwrap_err().contains("audit_tolerance"));
        s.audit_tolerance = 0.25;
        s.devices = vec!["dev".into()];
        assert!(s.validate().unwrap_err().contains("absolute"));
    }
}
