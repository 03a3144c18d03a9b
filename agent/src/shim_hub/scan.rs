//! The hub's scanner thread: every `scan_ms`, the processes that use the NIC without a
//! registered shim (`ungoverned`), the registered ones whose shims say they drive queues
//! directly (`direct_verbs`), and the apps whose processes send above their grant
//! (`grant_audit`), each into the hub's state for status, metrics and the host's budget.

use super::Shared;
use crate::grant_audit::{GrantAudit, Registered};
use crate::ungoverned::direct_verbs::{self, DirectWatch};
use crate::ungoverned::{Scanner, UngovernedSettings};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;
use tracing::warn;

/// Scans until the hub stops.
pub(super) fn scan_loop(sh: Arc<Shared>, cfg: UngovernedSettings) {
    if std::fs::read_dir("/proc/1/fd").is_err() {
        warn!("cannot read other processes' descriptors in /proc (the agent needs root or CAP_SYS_PTRACE): RDMA users outside the agent's own uid are not looked for");
    }
    let mut scanner = Scanner::default();
    let mut direct_watch = DirectWatch::default();
    let mut audit = GrantAudit::new(
        Duration::from_millis(cfg.audit_window_ms),
        cfg.audit_tolerance,
    );
    let clock = std::time::Instant::now();
    let period = Duration::from_millis(cfg.scan_ms);
    while !sh.stop.load(Relaxed) {
        let st = sh.lock();
        let (procs, tables): (Vec<Registered>, Vec<direct_verbs::Seen>) = st
            .conns
            .values()
            .map(|c| {
                let (pid, uid, app) = (c.pid, c.identity.uid, c.app.clone());
                let queues = c.map.table().shim.direct_verbs_queues.load(Relaxed);
                (
                    Registered {
                        pid,
                        uid,
                        app: app.clone(),
                    },
                    direct_verbs::Seen {
                        pid,
                        uid,
                        app,
                        queues,
                    },
                )
            })
            .unzip();
        // The agent's own idea of each app's byte grant, not the tables' copies: a process
        // can write its table's grant fields.
        let grants: BTreeMap<String, u64> = procs
            .iter()
            .map(|p| {
                let g = sh.grant_for(&st, &p.app, None).rate_bytes_per_s;
                (p.app.clone(), g)
            })
            .collect();
        drop(st);
        let direct = direct_watch.observe(&tables);
        direct_verbs::warn_first(&direct);
        let registered: BTreeSet<u32> = procs.iter().map(|p| p.pid).collect();
        // The scan reads /proc without the lock: registrations go on meanwhile.
        let counters = crate::ungoverned::read_counters(&cfg);
        let found = scanner.scan(&cfg, &registered, &counters);
        let over = audit.observe(clock.elapsed(), &procs, &grants, &counters);
        crate::grant_audit::warn_first(&over);
        let mut st = sh.lock();
        st.ungoverned = found;
        st.over_grant = over;
        st.direct_verbs = direct;
        drop(st);
        sleep_unless_stopped(&sh, period);
    }
}

/// Sleeps `period`, waking early when the hub stops.
pub(super) fn sleep_unless_stopped(sh: &Shared, period: Duration) {
    let until = std::time::Instant::now() + period;
    while !sh.stop.load(Relaxed) && std::time::Instant::now() < until {
        std::thread::sleep(Duration::from_millis(50).min(period));
    }
}
