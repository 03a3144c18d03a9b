//! Identities after registration (issue 23): the policy decided a process's app from the
//! uid, gid and cgroup it had when it registered, but a process can change them afterwards
//! (`setresuid` when a daemon drops privileges, `exec` of a set-user-ID program, which
//! keeps the pid, a move to another cgroup), and a registration can outlive its process (a
//! child that inherited the socket). The hub reads each registered process's identity again
//! every `recheck_ms`; this decides what follows:
//!
//! * the same identity: nothing;
//! * another identity the policy gives the same app: **keep** (the new identity recorded);
//! * another identity the policy gives another app: **re-map** the registration to it, in
//!   place (the new app's grant in the same table: the process is never ungoverned);
//! * the pid no longer is the registered process (gone, or another process with a new start
//!   time) for [`LOST_GRACE`]: **refuse** — deregister: there is no identity left to apply
//!   the policy to, and whoever holds the socket is not who registered.
//!
//! Pure: the caller reads `/proc` and passes its clock.

use super::{Decision, Identity, TenantSettings};
use crate::procfs::Seen;
use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

/// How long a registration's process must stay lost before it is refused: a process that
/// exits closes its socket at once, and the hub's reader removes it on its own; only a
/// registration whose socket lives on elsewhere is still here after this.
pub const LOST_GRACE: Duration = Duration::from_secs(1);

/// A registration as the hub holds it.
#[derive(Clone, Debug, PartialEq)]
pub struct Registration {
    /// The hub's key for it.
    pub key: u64,
    pub pid: u32,
    /// The identity the current app was decided for.
    pub identity: Identity,
    /// The process's start time when it registered (None: it could not be read).
    pub started: Option<u64>,
    /// The name it asked for at registration.
    pub asked: String,
    pub app: String,
}

/// What to do with a registration.
#[derive(Clone, Debug, PartialEq)]
pub enum Verdict {
    /// Its identity changed; the policy gives the new one the same app.
    Keep {
        identity: Identity,
        decision: Decision,
    },
    /// Its identity changed; the policy gives the new one `decision.app`.
    Remap {
        identity: Identity,
        decision: Decision,
    },
    /// Its process is gone or the pid is another process's: deregister.
    Refuse {
        why: &'static str,
        /// The identity of the process that has the pid now, if one does.
        now: Option<Identity>,
    },
}

/// A decision about one registration.
#[derive(Clone, Debug, PartialEq)]
pub struct Change {
    pub key: u64,
    pub pid: u32,
    /// Its identity and app before.
    pub was: Identity,
    pub app: String,
    pub verdict: Verdict,
}

/// Since when each registration's process has been missing.
#[derive(Default)]
pub struct Recheck {
    lost_since: BTreeMap<u64, Duration>,
}

impl Recheck {
    /// `seen[i]` is what `/proc` showed of `regs[i]`'s pid at `now`. Registrations are
    /// decided in order, each against the others as already decided (so two processes that
    /// change together cannot both claim a name the policy gives one user).
    pub fn check(
        &mut self,
        now: Duration,
        policy: &TenantSettings,
        regs: &[Registration],
        seen: &[Seen],
    ) -> Vec<Change> {
        let mut holders: Vec<(u64, String, u32)> = regs
            .iter()
            .map(|r| (r.key, r.app.clone(), r.identity.uid))
            .collect();
        let mut out = Vec::new();
        for (i, (r, s)) in regs.iter().zip(seen).enumerate() {
            let observed = match s {
                Seen::Alive {
                    started,
                    uid,
                    gid,
                    cgroup,
                    threads,
                } => {
                    let (uid, gid) = acting_ids((*uid, *gid), threads);
                    Some((
                        *started,
                        Identity {
                            uid,
                            gid,
                            cgroup: cgroup.clone(),
                        },
                    ))
                }
                Seen::Gone => None,
                // Nothing to conclude, nor to hold against it.
                Seen::Hidden => {
                    self.lost_since.remove(&r.key);
                    continue;
                }
            };
            let lost = match &observed {
                None => Some((
                    "its process is gone; another process holds its socket",
                    None,
                )),
                Some((started, id)) if r.started.is_some_and(|s| s != *started) => Some((
                    "its pid is another process's now; another process holds its socket",
                    Some(id.clone()),
                )),
                Some(_) => None,
            };
            if let Some((why, now_id)) = lost {
                let since = *self.lost_since.entry(r.key).or_insert(now);
                if now.saturating_sub(since) >= LOST_GRACE {
                    self.lost_since.remove(&r.key);
                    out.push(change(r, Verdict::Refuse { why, now: now_id }));
                }
                continue;
            }
            self.lost_since.remove(&r.key);
            let Some((_, id)) = observed else { continue };
            if id == r.identity {
                continue;
            }
            let others = |name: &str| -> BTreeSet<u32> {
                holders
                    .iter()
                    .filter(|(k, app, _)| *k != r.key && app == name)
                    .map(|h| h.2)
                    .collect()
            };
            let decision = policy.decide(&id, &r.asked, &others);
            holders[i] = (r.key, decision.app.clone(), id.uid);
            let verdict = if decision.app == r.app {
                Verdict::Keep {
                    identity: id,
                    decision,
                }
            } else {
                Verdict::Remap {
                    identity: id,
                    decision,
                }
            };
            out.push(change(r, verdict));
        }
        let present: BTreeSet<u64> = regs.iter().map(|r| r.key).collect();
        self.lost_since.retain(|k, _| present.contains(k));
        out
    }
}

/// The effective ids a process acts as when its threads' differ (`threads`: those that
/// differ from its leader's, in thread id order): trusted as root only while every thread is
/// root. So its leader's unless the leader is root and a thread is not (a raw `setresuid` in
/// one thread), then that thread's; a thread that changed only its group counts when no
/// thread changed its user. The choice depends on what `/proc` shows alone, not on the
/// registration, so a process whose threads stay mixed is re-mapped once, not back and forth.
fn acting_ids(leader: (u32, u32), threads: &[(u32, u32)]) -> (u32, u32) {
    if leader.0 != 0 {
        return leader;
    }
    threads
        .iter()
        .find(|t| t.0 != 0)
        .or(threads.first())
        .copied()
        .unwrap_or(leader)
}

fn change(r: &Registration, verdict: Verdict) -> Change {
    Change {
        key: r.key,
        pid: r.pid,
        was: r.identity.clone(),
        app: r.app.clone(),
        verdict,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tenants::TenantRule;

    fn id(uid: u32) -> Identity {
        Identity {
            uid,
            gid: uid,
            cgroup: "/".into(),
        }
    }

    fn alive(started: u64, uid: u32, cgroup: &str) -> Seen {
        Seen::Alive {
            started,
            uid,
            gid: uid,
            cgroup: cgroup.into(),
            threads: Vec::new(),
        }
    }

    fn reg(key: u64, uid: u32, asked: &str, app: &str) -> Registration {
        Registration {
            key,
            pid: 100 + key as u32,
            identity: id(uid),
            started: Some(7),
            asked: asked.into(),
            app: app.into(),
        }
    }

    /// Root trusted; uid 1001 may run `kv`; the batch cgroup any name.
    fn policy() -> TenantSettings {
        TenantSettings {
            rules: vec![
                TenantRule {
                    uid: Some(1001),
                    apps: vec!["kv".into()],
                    ..TenantRule::default()
                },
                TenantRule {
                    cgroup: Some("/batch".into()),
                    apps: vec!["*".into()],
                    ..TenantRule::default()
                },
            ],
            ..TenantSettings::default()
        }
    }

    const T0: Duration = Duration::from_secs(10);

    #[test]
    fn an_unchanged_or_hidden_process_is_left_alone() {
        let mut r = Recheck::default();
        let regs = [reg(1, 0, "svc", "svc"), reg(2, 1001, "kv", "kv")];
        let seen = [alive(7, 0, "/"), Seen::Hidden];
        assert!(r.check(T0, &policy(), &regs, &seen).is_empty());
    }

    #[test]
    fn a_dropped_privilege_is_re_mapped_to_what_the_policy_gives_the_new_uid() {
        let mut r = Recheck::default();
        // Root ran as `svc` (trusted) and drops to 1002: one app per untrusted uid.
        let regs = [reg(1, 0, "svc", "svc")];
        let v = r.check(T0, &policy(), &regs, &[alive(7, 1002, "/")]);
        assert_eq!(v.len(), 1);
        assert_eq!(
            (v[0].pid, &v[0].was, v[0].app.as_str()),
            (101, &id(0), "svc")
        );
        let Verdict::Remap { identity, decision } = &v[0].verdict else {
            panic!("{v:?}");
        };
        assert_eq!((identity, decision.app.as_str()), (&id(1002), "uid-1002"));
        assert!(decision.mapped.is_some());
        // Root asked for `kv` (the rule's, so root ran as uid-0) and becomes 1001: `kv` now.
        let regs = [reg(1, 0, "kv", "uid-0")];
        let v = r.check(T0, &policy(), &regs, &[alive(7, 1001, "/")]);
        let Verdict::Remap { decision, .. } = &v[0].verdict else {
            panic!("{v:?}");
        };
        assert_eq!((decision.app.as_str(), &decision.mapped), ("kv", &None));
    }

    #[test]
    fn a_thread_that_changed_only_its_own_ids_changes_the_process() {
        let mut r = Recheck::default();
        let regs = [reg(1, 0, "svc", "svc")];
        let threads = |t: &[(u32, u32)]| Seen::Alive {
            started: 7,
            uid: 0,
            gid: 0,
            cgroup: "/".into(),
            threads: t.to_vec(),
        };
        // Its leader is still root; one thread dropped to 1002 with a raw setresuid.
        let v = r.check(T0, &policy(), &regs, &[threads(&[(1002, 1002)])]);
        let Verdict::Remap { identity, decision } = &v[0].verdict else {
            panic!("{v:?}");
        };
        assert_eq!((identity, decision.app.as_str()), (&id(1002), "uid-1002"));
        // Re-mapped: registered as 1002 now; the threads stay mixed, nothing changes again.
        let regs = [Registration {
            identity: id(1002),
            ..reg(1, 1002, "svc", "uid-1002")
        }];
        assert!(r
            .check(T0, &policy(), &regs, &[threads(&[(1002, 1002)])])
            .is_empty());
        // Every thread kept the registered ids: nothing changed.
        let regs = [reg(1, 0, "svc", "svc")];
        assert!(r.check(T0, &policy(), &regs, &[threads(&[])]).is_empty());
    }

    #[test]
    fn a_process_is_trusted_as_root_only_while_every_thread_is_root() {
        assert_eq!(acting_ids((0, 0), &[]), (0, 0));
        assert_eq!(acting_ids((0, 0), &[(0, 5), (1002, 1002)]), (1002, 1002));
        assert_eq!(acting_ids((0, 0), &[(0, 5)]), (0, 5));
        // A non-root leader decides, whatever its threads are.
        assert_eq!(
            acting_ids((1001, 1001), &[(0, 0), (1002, 1002)]),
            (1001, 1001)
        );
    }

    #[test]
    fn a_new_identity_the_policy_gives_the_same_app_is_kept() {
        let mut r = Recheck::default();
        // Root's `bulk` moves into the batch cgroup as 1003: the cgroup rule allows `bulk`.
        let regs = [reg(1, 0, "bulk", "bulk")];
        let v = r.check(T0, &policy(), &regs, &[alive(7, 1003, "/batch/x")]);
        let Verdict::Keep { identity, decision } = &v[0].verdict else {
            panic!("{v:?}");
        };
        assert_eq!((identity.uid, identity.cgroup.as_str()), (1003, "/batch/x"));
        assert_eq!(decision.app, "bulk");
    }

    #[test]
    fn two_users_never_end_up_in_one_app_by_changing_together() {
        let mut r = Recheck::default();
        // Two root processes of `bulk` move into the batch cgroup as two different uids:
        // the first finds root's other process in `bulk` and goes to its own default; the
        // second, deciding after it, finds `bulk` free of other users and keeps it.
        let regs = [reg(1, 0, "bulk", "bulk"), reg(2, 0, "bulk", "bulk")];
        let seen = [alive(7, 1003, "/batch"), alive(7, 1004, "/batch")];
        let v = r.check(T0, &policy(), &regs, &seen);
        let Verdict::Remap { decision, .. } = &v[0].verdict else {
            panic!("{v:?}");
        };
        assert_eq!(decision.app, "uid-1003");
        assert!(decision.mapped.as_deref().unwrap().contains("another user"));
        let Verdict::Keep { identity, decision } = &v[1].verdict else {
            panic!("{v:?}");
        };
        assert_eq!((identity.uid, decision.app.as_str()), (1004, "bulk"));
    }

    #[test]
    fn a_lost_process_is_refused_after_the_grace_and_only_then() {
        let mut r = Recheck::default();
        let regs = [reg(1, 0, "a", "a"), reg(2, 0, "b", "b")];
        // Gone, and a new process (another start time) with the other pid.
        let seen = [Seen::Gone, alive(99, 1005, "/")];
        assert!(r.check(T0, &policy(), &regs, &seen).is_empty());
        let half = T0 + LOST_GRACE / 2;
        assert!(r.check(half, &policy(), &regs, &seen).is_empty());
        let v = r.check(T0 + LOST_GRACE, &policy(), &regs, &seen);
        assert_eq!(v.len(), 2, "{v:?}");
        assert_eq!(
            v[0].verdict,
            Verdict::Refuse {
                why: "its process is gone; another process holds its socket",
                now: None
            }
        );
        let Verdict::Refuse { why, now } = &v[1].verdict else {
            panic!("{v:?}");
        };
        assert!(why.contains("another process's"));
        assert_eq!(now.as_ref().map(|i| i.uid), Some(1005));
    }

    #[test]
    fn a_process_seen_again_or_deregistered_starts_its_grace_afresh() {
        let mut r = Recheck::default();
        let regs = [reg(1, 0, "a", "a")];
        assert!(r.check(T0, &policy(), &regs, &[Seen::Gone]).is_empty());
        // Hidden in between (a race with /proc): the grace starts again.
        let t = T0 + LOST_GRACE / 2;
        assert!(r.check(t, &policy(), &regs, &[Seen::Hidden]).is_empty());
        assert!(r.check(t, &policy(), &regs, &[Seen::Gone]).is_empty());
        assert!(r
            .check(T0 + LOST_GRACE, &policy(), &regs, &[Seen::Gone])
            .is_empty());
        // Deregistered (its socket closed): forgotten.
        r.check(T0 + LOST_GRACE, &policy(), &[], &[]);
        assert!(r.lost_since.is_empty());
        // A start time unknown at registration cannot tell a reused pid: judged by identity.
        let regs = [Registration {
            started: None,
            ..reg(1, 0, "a", "a")
        }];
        assert!(r
            .check(T0, &policy(), &regs, &[alive(5, 0, "/")])
            .is_empty());
    }
}
