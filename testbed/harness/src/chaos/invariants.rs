//! What the chaos soak checks, as pure functions of what the driver observed: a grant as
//! the bytes of a shared-memory table, an application's progress counter over time, and the
//! coordinator's status. The driver feeds them; the unit tests feed them by hand.

use drum_table::layout::{GrantFields, Table, MAGIC, TABLE_BYTES, VERSION};
use serde_json::Value;
use std::collections::BTreeMap;
use std::mem::offset_of;
use std::time::Duration;

/// The grant of one app process as the agent wrote it in its shared-memory table: every
/// byte of the grant except `generation` and `heartbeat_ms`, which an agent that keeps its
/// grants must still move (a republished identical grant bumps the generation; the heartbeat
/// tells the shim the agent lives). `None` for bytes that are not a table of this version.
pub fn grant_bytes(raw: &[u8]) -> Option<Vec<u8>> {
    if raw.len() < TABLE_BYTES {
        return None;
    }
    let word = |at: usize| u64::from_le_bytes(raw[at..at + 8].try_into().expect("8 bytes"));
    if word(offset_of!(Table, magic)) != MAGIC || word(offset_of!(Table, version)) != VERSION {
        return None;
    }
    let grant = offset_of!(Table, grant);
    let from = grant + offset_of!(GrantFields, rate_bytes_per_s);
    let to = grant + std::mem::size_of::<GrantFields>();
    Some(raw[from..to].to_vec())
}

/// A grant from [`grant_bytes`] for a message: its fields by name, and the DASR caps that
/// are set.
pub fn describe(grant: &[u8]) -> String {
    const NAMES: [&str; 7] = [
        "rate_bytes_per_s",
        "burst_bytes",
        "rate_wqe_per_s",
        "max_active_qps",
        "quantum_us",
        "long_msg_bytes",
        "rate_cqe_per_s",
    ];
    let words: Vec<u64> = grant
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
        .collect();
    let mut out: Vec<String> = NAMES
        .iter()
        .zip(&words)
        .map(|(n, v)| format!("{n}={v}"))
        .collect();
    let caps = words[NAMES.len().min(words.len())..]
        .iter()
        .filter(|w| **w != 0)
        .count();
    if caps > 0 {
        out.push(format!("{caps} non-zero DASR cap words"));
    }
    out.join(" ")
}

/// An agent's grants by table name (`drum-table-PID`, which names the app's process).
pub type Grants = BTreeMap<String, Vec<u8>>;

/// The first grant that differs between two readings of one agent's tables, for tables
/// present in both.
pub fn changed_grant<'a>(before: &'a Grants, now: &Grants) -> Option<&'a str> {
    before
        .iter()
        .find(|(name, bytes)| now.get(*name).is_some_and(|b| b != *bytes))
        .map(|(name, _)| name.as_str())
}

/// An application's progress: when its counter last moved.
#[derive(Debug)]
pub struct Progress {
    value: u64,
    moved: Duration,
    /// The longest time the counter stood still so far.
    pub longest_stall: Duration,
}

impl Progress {
    pub fn new(now: Duration) -> Self {
        Progress {
            value: 0,
            moved: now,
            longest_stall: Duration::ZERO,
        }
    }

    /// Records the counter's `value` at `now`.
    pub fn observe(&mut self, now: Duration, value: u64) {
        self.longest_stall = self.longest_stall.max(self.stalled(now));
        if value != self.value {
            self.value = value;
            self.moved = now;
        }
    }

    /// How long the counter has stood still at `now`.
    pub fn stalled(&self, now: Duration) -> Duration {
        now.saturating_sub(self.moved)
    }
}

/// Granted rates by (host, app).
pub type Rates = BTreeMap<(String, String), f64>;

/// Granted rates in a `drum-coordinator status --json`.
pub fn rates(status: &Value) -> Rates {
    let mut out = BTreeMap::new();
    for m in status["members"].as_array().into_iter().flatten() {
        let host = m["host"].as_str().unwrap_or_default();
        for a in m["apps"].as_array().into_iter().flatten() {
            let app = a["app"].as_str().unwrap_or_default();
            let rate = if a["active"].as_bool() == Some(true) {
                a["rate"].as_f64().unwrap_or(0.0)
            } else {
                0.0
            };
            out.insert((host.to_string(), app.to_string()), rate);
        }
    }
    out
}

/// Why `status` is not yet a converged cluster of `hosts` members in which every app of
/// `apps` (host, app) is listed and each of `senders` holds a grant; `None` when it is.
pub fn unsettled(
    status: &Value,
    hosts: usize,
    apps: &[(&str, &str)],
    senders: &[(&str, &str)],
) -> Option<String> {
    let members = status["members"].as_array().map_or(0, Vec::len);
    if members != hosts {
        return Some(format!("{members} of {hosts} hosts are members"));
    }
    let r = rates(status);
    let key = |(h, a): &(&str, &str)| (h.to_string(), a.to_string());
    if let Some(missing) = apps.iter().find(|k| !r.contains_key(&key(k))) {
        return Some(format!("{} on {} is not registered", missing.1, missing.0));
    }
    if let Some(idle) = senders.iter().find(|k| r[&key(k)] <= 0.0) {
        return Some(format!("{} on {} holds no grant", idle.1, idle.0));
    }
    None
}

/// Whether two readings of the grants agree within `tolerance` (relative to the larger of
/// each pair, and absolute for grants near zero): the optimiser keeps iterating, so a settled
/// allocation still moves a little.
pub fn steady(a: &Rates, b: &Rates, tolerance: f64) -> bool {
    a.len() == b.len()
        && a.iter().all(|(k, x)| {
            b.get(k)
                .is_some_and(|y| (x - y).abs() <= tolerance * x.abs().max(y.abs()).max(0.01))
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use drum_table::layout::Grant;
    use serde_json::json;

    /// A table as the agent lays it out, through the layout's own code.
    fn table_with(g: &Grant, heartbeat: u64) -> Vec<u8> {
        let mut buf = vec![0u64; TABLE_BYTES / 8];
        // SAFETY: the buffer is TABLE_BYTES long, 8-aligned and zeroed; Table is all atomics.
        let t = unsafe { &*(buf.as_mut_ptr() as *const Table) };
        t.init();
        t.publish(g, heartbeat);
        buf.iter().flat_map(|w| w.to_le_bytes()).collect()
    }

    #[test]
    fn a_grant_is_its_values_not_its_generation_or_heartbeat() {
        let g = Grant {
            rate_bytes_per_s: 62_500_000,
            max_active_qps: 5,
            ..Grant::default()
        };
        let a = grant_bytes(&table_with(&g, 10)).unwrap();
        // Republished unchanged, later: the same grant.
        let mut later = table_with(&g, 99_999);
        assert_eq!(grant_bytes(&later), Some(a.clone()));
        let h = grant_bytes(&table_with(
            &Grant {
                rate_bytes_per_s: 62_500_001,
                ..g
            },
            10,
        ));
        assert_ne!(h.as_ref(), Some(&a));
        assert_eq!(
            describe(&a),
            "rate_bytes_per_s=62500000 burst_bytes=0 rate_wqe_per_s=0 max_active_qps=5 \
             quantum_us=0 long_msg_bytes=0 rate_cqe_per_s=0"
        );
        later[0] ^= 1;
        assert_eq!(grant_bytes(&later), None, "not a table");
        assert_eq!(grant_bytes(&[0; 64]), None, "too short");
    }

    #[test]
    fn only_tables_read_both_times_are_compared() {
        let m = |v: &[(&str, u8)]| -> Grants {
            v.iter().map(|(k, b)| (k.to_string(), vec![*b])).collect()
        };
        let before = m(&[("drum-table-10", 1), ("drum-table-11", 2)]);
        assert_eq!(changed_grant(&before, &m(&[("drum-table-10", 1)])), None);
        assert_eq!(
            changed_grant(&before, &m(&[("drum-table-10", 1), ("drum-table-11", 3)])),
            Some("drum-table-11")
        );
    }

    #[test]
    fn progress_remembers_its_longest_stall() {
        let s = Duration::from_secs;
        let mut p = Progress::new(s(0));
        p.observe(s(1), 5);
        p.observe(s(4), 5);
        assert_eq!(p.stalled(s(4)), s(3));
        p.observe(s(5), 6);
        assert_eq!(p.stalled(s(5)), s(0));
        assert_eq!(p.longest_stall, s(4));
    }

    /// An app as `status` lists it: name, active, rate.
    type Listed<'a> = (&'a str, bool, f64);

    fn status(members: &[(&str, &[Listed])]) -> Value {
        json!({ "members": members.iter().map(|(h, apps)| json!({
            "host": h,
            "apps": apps.iter().map(|(a, active, rate)| json!({
                "app": a, "active": active, "rate": rate
            })).collect::<Vec<_>>(),
        })).collect::<Vec<_>>() })
    }

    #[test]
    fn a_cluster_is_settled_when_every_host_and_app_is_back_with_grants() {
        let apps = [("h1", "sink"), ("h2", "bulk")];
        let senders = [("h2", "bulk")];
        let ok = status(&[
            ("h1", &[("sink", false, 0.0)]),
            ("h2", &[("bulk", true, 0.5)]),
        ]);
        assert_eq!(unsettled(&ok, 2, &apps, &senders), None);
        let one = status(&[("h1", &[("sink", false, 0.0)])]);
        assert_eq!(
            unsettled(&one, 2, &apps, &senders).unwrap(),
            "1 of 2 hosts are members"
        );
        let parked = status(&[
            ("h1", &[("sink", false, 0.0)]),
            ("h2", &[("bulk", false, 0.5)]),
        ]);
        assert!(unsettled(&parked, 2, &apps, &senders)
            .unwrap()
            .contains("no grant"));
        let gone = status(&[("h1", &[]), ("h2", &[("bulk", true, 0.5)])]);
        assert!(unsettled(&gone, 2, &apps, &senders)
            .unwrap()
            .contains("not registered"));
    }

    #[test]
    fn steady_grants_move_less_than_the_tolerance() {
        let r = |x: f64| BTreeMap::from([(("h2".to_string(), "bulk".to_string()), x)]);
        assert!(steady(&r(0.50), &r(0.51), 0.05));
        assert!(!steady(&r(0.50), &r(0.60), 0.05));
        assert!(steady(&r(0.0), &r(0.0004), 0.05), "near zero: absolute");
        assert!(!steady(&r(0.5), &BTreeMap::new(), 0.05));
    }
}
