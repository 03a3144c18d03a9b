//! The hub's identity re-check thread: every `[shim.tenants] recheck_ms`, what `/proc` says
//! of each registered process now, the policy's verdict on it (`tenants::recheck`, pure),
//! and the verdict carried out on the registration — its identity recorded, its app
//! changed in place, or the registration dropped.

use super::{Conn, HubState, Shared};
use crate::procfs;
use crate::tenants::recheck::{Change, Recheck, Registration, Verdict};
use crate::tenants::Identity;
use std::os::fd::AsRawFd;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;
use tracing::{info, warn};

/// Re-checks until the hub stops.
pub(super) fn recheck_loop(sh: Arc<Shared>) {
    let mut recheck = Recheck::default();
    let clock = std::time::Instant::now();
    let period = Duration::from_millis(sh.settings.tenants.recheck_ms);
    while !sh.stop.load(Relaxed) {
        let regs: Vec<Registration> = sh
            .lock()
            .conns
            .iter()
            .map(|(&key, c)| Registration {
                key,
                pid: c.pid,
                identity: c.identity.clone(),
                started: c.started,
                asked: asked(c).to_string(),
                app: c.app.clone(),
            })
            .collect();
        // /proc is read without the lock; a registration that changes meanwhile is caught
        // below (its app or identity no longer what was judged) and judged next time.
        let seen: Vec<procfs::Seen> = regs.iter().map(|r| procfs::seen(r.pid)).collect();
        let changes = recheck.check(clock.elapsed(), &sh.settings.tenants, &regs, &seen);
        if !changes.is_empty() {
            let mut st = sh.lock();
            for c in changes {
                apply(&sh, &mut st, c);
            }
            sh.publish_all(&mut st);
        }
        super::scan::sleep_unless_stopped(&sh, period);
    }
}

/// The name the process asked for at registration (kept through re-maps).
pub(super) fn asked(c: &Conn) -> &str {
    c.requested.as_deref().unwrap_or(&c.app)
}

fn show(id: &Identity) -> String {
    format!("uid {} gid {} cgroup {}", id.uid, id.gid, id.cgroup)
}

fn apply(sh: &Shared, st: &mut HubState, ch: Change) {
    let Some(c) = st.conns.get(&ch.key) else {
        return;
    };
    if c.app != ch.app || c.identity != ch.was {
        return;
    }
    let (pid, was) = (ch.pid, show(&ch.was));
    match ch.verdict {
        Verdict::Keep { identity, decision } => {
            info!(pid, app = %ch.app, was = %was, now = %show(&identity),
                "tenant policy: a registered process changed identity; the policy keeps its app");
            let c = st.conns.get_mut(&ch.key).expect("looked up above");
            c.identity = identity;
            c.weight = decision.weight;
        }
        Verdict::Remap { identity, decision } => {
            warn!(pid, was = %was, now = %show(&identity), app = %ch.app, granted = %decision.app,
                why = decision.mapped.as_deref().unwrap_or("the policy gives the new identity the name it asked for"),
                "tenant policy: a registered process changed identity; governed as the app the policy gives the new one");
            let c = st.conns.get_mut(&ch.key).expect("looked up above");
            let asked = asked(c).to_string();
            c.requested = (decision.app != asked).then_some(asked);
            c.identity = identity;
            c.weight = decision.weight;
            c.app = decision.app.clone();
            let (busy, qps) = (c.busy.clone(), c.qps.clone());
            // Its long messages in flight move to the new app's flows.
            for qpn in busy {
                let peer = qps.get(&qpn).copied();
                super::registration::traffic(sh, st, peer, &ch.app, false);
                super::registration::traffic(sh, st, peer, &decision.app, true);
            }
            super::registration::forget_app_if_unused(st, &ch.app);
        }
        Verdict::Refuse { why, now } => {
            let now = now.as_ref().map_or("no process".into(), show);
            warn!(pid, was = %was, now = %now, app = %ch.app, why,
                "tenant policy: a registration's process is not who registered; registration refused");
            if let Some(c) = super::registration::leave(sh, st, ch.key) {
                // The reader thread sees the end of its connection and finds it gone.
                // SAFETY: shutting down a socket `c` still owns.
                unsafe { libc::shutdown(c.sock.as_raw_fd(), libc::SHUT_RDWR) };
            }
        }
    }
}
