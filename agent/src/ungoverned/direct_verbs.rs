//! Registered processes that drive hardware queues directly (issue 23): a shim that sees its
//! program take queues with `mlx5dv_init_obj` counts them into its table
//! (`direct_verbs_queues`). Such a process is governed only in part: what it posts and polls
//! on those queues never passes the shim. The agent lists it beside the ungoverned ones and
//! warns once; what it sends beyond its grant is the grant audit's to find (`grant_audit`,
//! where the NIC counts per process).
//!
//! Pure: the caller reads the tables and logs.

use crate::warned_once::WarnedOnce;
use std::collections::BTreeSet;

/// A registered process as its table describes it now.
#[derive(Clone, Debug, PartialEq)]
pub struct Seen {
    pub pid: u32,
    pub uid: u32,
    pub app: String,
    /// The table's `direct_verbs_queues` (the shim's word: it can only hurt itself by it).
    pub queues: u64,
}

/// A registered process that took hardware queues with direct verbs.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct DirectVerbs {
    pub pid: u32,
    pub uid: u32,
    pub app: String,
    pub queues: u64,
    pub reason: String,
    /// First time this process (as this app) is found (the caller warns once).
    #[serde(skip)]
    pub first: bool,
}

/// Why such a process is partly ungoverned.
pub fn reason(queues: u64) -> String {
    format!(
        "direct verbs (mlx5dv_init_obj on {queues} queues): its posts and polls bypass the shim"
    )
}

/// Which processes were reported already.
#[derive(Default)]
pub struct DirectWatch {
    warned: WarnedOnce<(u32, String)>,
}

impl DirectWatch {
    /// The processes among `procs` that took queues; a process is `first` once per pid and
    /// app (a pid registered anew as another app is a new process to the operator).
    pub fn observe(&mut self, procs: &[Seen]) -> Vec<DirectVerbs> {
        let out: Vec<DirectVerbs> = procs
            .iter()
            .filter(|p| p.queues > 0)
            .map(|p| DirectVerbs {
                pid: p.pid,
                uid: p.uid,
                app: p.app.clone(),
                queues: p.queues,
                reason: reason(p.queues),
                first: self.warned.first((p.pid, p.app.clone())),
            })
            .collect();
        let present: BTreeSet<(u32, &str)> = procs.iter().map(|p| (p.pid, &*p.app)).collect();
        self.warned
            .forget_absent(|(pid, app)| present.contains(&(*pid, app.as_str())));
        out
    }
}

/// One WARN for each process found for the first time.
pub fn warn_first(found: &[DirectVerbs]) {
    for d in found.iter().filter(|d| d.first) {
        tracing::warn!(
            pid = d.pid,
            uid = d.uid,
            app = %d.app,
            reason = d.reason.as_str(),
            "a registered process drives hardware queues directly: it is governed only in part"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seen(pid: u32, app: &str, queues: u64) -> Seen {
        Seen {
            pid,
            uid: 1000 + pid,
            app: app.into(),
            queues,
        }
    }

    #[test]
    fn only_processes_with_queues_are_reported_each_first_once() {
        let mut w = DirectWatch::default();
        let procs = [seen(1, "a", 0), seen(2, "b", 2)];
        let v = w.observe(&procs);
        assert_eq!(v.len(), 1);
        let d = &v[0];
        assert_eq!((d.pid, d.uid, d.app.as_str(), d.queues), (2, 1002, "b", 2));
        assert_eq!(
            d.reason,
            "direct verbs (mlx5dv_init_obj on 2 queues): its posts and polls bypass the shim"
        );
        assert!(d.first);
        // More queues later: listed with the new count, not warned again.
        let v = w.observe(&[seen(1, "a", 0), seen(2, "b", 3)]);
        assert_eq!((v[0].queues, v[0].first), (3, false));
        assert!(v[0].reason.contains("on 3 queues"));
        // Process 1 takes queues too: its own first report.
        let v = w.observe(&[seen(1, "a", 1), seen(2, "b", 3)]);
        assert_eq!(v.iter().filter(|d| d.first).count(), 1);
        assert!(v.iter().any(|d| d.pid == 1 && d.first));
    }

    #[test]
    fn gone_processes_are_forgotten_and_a_new_registration_is_warned_anew() {
        let mut w = DirectWatch::default();
        assert!(w.observe(&[seen(7, "x", 1)])[0].first);
        // Registered anew as another app: reported as a new one.
        assert!(w.observe(&[seen(7, "y", 1)])[0].first);
        assert!(w.observe(&[]).is_empty());
        assert!(w.warned.is_empty());
        // The pid reused after it left: a new process.
        assert!(w.observe(&[seen(7, "y", 4)])[0].first);
    }
}
