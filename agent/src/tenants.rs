//! Who an application is (issue 23): the operator's policy that maps a process's identity —
//! the uid, gid and cgroup the kernel reports for it, never what it says — to the app it is
//! governed as, and that app's weight. Pure: no I/O; the hub reads the credentials
//! (`SO_PEERCRED`, `/proc/PID/cgroup`) and passes them in with what the agent knows of the
//! apps registered now.
//!
//! The rules (docs/tenants.md):
//! * the first `[[tenants.rules]]` entry whose every selector matches the identity decides:
//!   the requested name (`DRUM_APP`, else the executable's) is granted when the rule's `apps`
//!   allow it, otherwise the process runs as the rule's `app` (or the identity's default);
//! * an identity no rule matches gets its requested name if its uid is trusted
//!   (`trusted_uids`, default root: the operator's own services, as before this policy), and
//!   otherwise the default, one app per uid, `uid-<uid>`: a user cannot spread over many
//!   apps to multiply its weight;
//! * a name a rule names exactly belongs to the identities of the rules that name it, and
//!   `uid-<n>` to uid `n` alone; an app that runs now belongs to its uid unless the policy
//!   names it for both: two users never share an app unless the policy says so.

pub mod recheck;

use serde::Deserialize;
use std::collections::BTreeSet;

/// A process as the kernel knows it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Identity {
    pub uid: u32,
    pub gid: u32,
    /// Its cgroup (the unified hierarchy's path, `/` when unknown).
    pub cgroup: String,
}

/// `[tenants]` in the agent's configuration.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct TenantSettings {
    /// Users whose processes keep the name they ask for when no rule matches them.
    #[serde(default = "d_trusted")]
    pub trusted_uids: Vec<u32>,
    #[serde(default)]
    pub rules: Vec<TenantRule>,
    /// How often registered processes' identities are read again (`recheck`): a process
    /// can change its uid or cgroup after it registered.
    #[serde(default = "d_recheck_ms")]
    pub recheck_ms: u64,
}

impl Default for TenantSettings {
    fn default() -> Self {
        TenantSettings {
            trusted_uids: d_trusted(),
            rules: Vec::new(),
            recheck_ms: d_recheck_ms(),
        }
    }
}

fn d_trusted() -> Vec<u32> {
    vec![0]
}
/// Three small `/proc` reads per registered process a second: nothing next to the shims'
/// own work, and a changed identity governs at most about a second under its old app.
fn d_recheck_ms() -> u64 {
    1000
}

/// One `[[tenants.rules]]` entry: which identities (every selector given must match; at least
/// one is required), which names they may ask for, what they run as otherwise, and the weight
/// of the apps it grants.
#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct TenantRule {
    pub uid: Option<u32>,
    pub gid: Option<u32>,
    /// A cgroup path prefix, compared by whole components (`/system.slice/kv.service`
    /// matches itself and what lies below it, not `/system.slice/kv.service2`).
    pub cgroup: Option<String>,
    /// Names the identity may ask for: exact names, or a prefix ending in `*` (`"*"`: any
    /// name no other identity owns).
    #[serde(default)]
    pub apps: Vec<String>,
    /// What the identity runs as when it asks for a name `apps` does not allow; default
    /// `uid-<uid>`.
    pub app: Option<String>,
    /// The weight of the apps this rule grants (overrides the coordinator's policy).
    pub weight: Option<f64>,
}

/// What the policy makes of a registration.
#[derive(Clone, Debug, PartialEq)]
pub struct Decision {
    /// The app the process is governed as.
    pub app: String,
    /// Why it is not the requested one (None: granted as asked).
    pub mapped: Option<String>,
    /// The weight the matching rule gives (None: the coordinator's).
    pub weight: Option<f64>,
}

/// The default app of a uid.
pub fn uid_app(uid: u32) -> String {
    format!("uid-{uid}")
}

/// The uid whose default app `name` is.
fn uid_of_default(name: &str) -> Option<u32> {
    let n = name.strip_prefix("uid-")?;
    // Only the canonical spelling ("uid-7", not "uid-07") is anyone's.
    n.parse::<u32>().ok().filter(|u| u.to_string() == n)
}

fn cgroup_within(path: &str, prefix: &str) -> bool {
    let prefix = prefix.trim_end_matches('/');
    prefix.is_empty()
        || path == prefix
        || path
            .strip_prefix(prefix)
            .is_some_and(|rest| rest.starts_with('/'))
}

fn pattern_allows(pattern: &str, name: &str) -> bool {
    match pattern.strip_suffix('*') {
        Some(prefix) => name.starts_with(prefix),
        None => pattern == name,
    }
}

impl TenantRule {
    fn matches(&self, id: &Identity) -> bool {
        let any = self.uid.is_some() || self.gid.is_some() || self.cgroup.is_some();
        any && self.uid.is_none_or(|u| u == id.uid)
            && self.gid.is_none_or(|g| g == id.gid)
            && self
                .cgroup
                .as_deref()
                .is_none_or(|c| cgroup_within(&id.cgroup, c))
    }

    /// The names this rule gives its identities by name (not by pattern).
    fn names(&self) -> impl Iterator<Item = &str> {
        self.apps
            .iter()
            .filter(|a| !a.ends_with('*'))
            .chain(self.app.iter())
            .map(String::as_str)
    }
}

impl TenantSettings {
    /// Every value usable; errors name the rule and the value.
    pub fn validate(&self) -> Result<(), String> {
        if !(50..=600_000).contains(&self.recheck_ms) {
            return Err(format!(
                "tenants.recheck_ms = {} must be in [50, 600000]",
                self.recheck_ms
            ));
        }
        for (i, r) in self.rules.iter().enumerate() {
            let at = format!("tenants.rules[{i}]");
            if r.uid.is_none() && r.gid.is_none() && r.cgroup.is_none() {
                return Err(format!("{at}: needs uid, gid or cgroup"));
            }
            if r.cgroup.as_deref().is_some_and(|c| !c.starts_with('/')) {
                return Err(format!("{at}.cgroup must be an absolute path"));
            }
            for name in r.names() {
                if !drum_table::message::valid_app(name) {
                    return Err(format!(
                        "{at}: {name:?} is not a valid app name ([A-Za-z0-9._-], ≤ 64)"
                    ));
                }
            }
            for p in &r.apps {
                let stem = p.trim_end_matches('*');
                if p.matches('*').count() > 1
                    || (!stem.is_empty() && !drum_table::message::valid_app(stem))
                {
                    return Err(format!(
                        "{at}.apps: {p:?} must be a name or a name prefix ending in one '*'"
                    ));
                }
            }
            if let Some(w) = r.weight {
                if !drum_common::live::valid_weight(w) {
                    return Err(drum_common::live::weight_error(&format!("{at}.weight"), w));
                }
            }
        }
        Ok(())
    }

    /// Whether some identity other than those of `rule` owns `name` by the policy: a rule
    /// that does not match names it, or it is another uid's default.
    fn owned_by_others(&self, id: &Identity, rule: Option<&TenantRule>, name: &str) -> bool {
        if uid_of_default(name).is_some_and(|u| u != id.uid) {
            return true;
        }
        let ours = rule.is_some_and(|r| r.names().any(|n| n == name));
        !ours
            && self
                .rules
                .iter()
                .any(|r| !r.matches(id) && r.names().any(|n| n == name))
    }

    /// The app for a process of identity `id` that asks for `requested`; `holders(name)`
    /// gives the uids of the processes registered as `name` now.
    pub fn decide(
        &self,
        id: &Identity,
        requested: &str,
        holders: &dyn Fn(&str) -> BTreeSet<u32>,
    ) -> Decision {
        let rule = self.rules.iter().find(|r| r.matches(id));
        let fallback = rule
            .and_then(|r| r.app.clone())
            .unwrap_or_else(|| uid_app(id.uid));
        let weight = rule.and_then(|r| r.weight);
        let asked_ok = match rule {
            Some(r) => r.apps.iter().any(|p| pattern_allows(p, requested)),
            None => self.trusted_uids.contains(&id.uid),
        };
        let why = if !asked_ok {
            Some(match rule {
                Some(_) => "the rule for this identity does not allow the name",
                None => "default policy: one app per untrusted uid",
            })
        } else if self.owned_by_others(id, rule, requested) {
            Some("the name belongs to another identity")
        } else if !self.shared_by_policy(rule, requested)
            && holders(requested).iter().any(|&u| u != id.uid)
        {
            Some("another user's processes run as this app")
        } else {
            None
        };
        match why {
            None => Decision {
                app: requested.to_string(),
                mapped: None,
                weight,
            },
            Some(why) => Decision {
                mapped: (fallback != requested).then(|| why.to_string()),
                app: fallback,
                weight,
            },
        }
    }

    /// Names the matching rule gives by name may hold processes of several users (every
    /// rule naming them said so).
    fn shared_by_policy(&self, rule: Option<&TenantRule>, name: &str) -> bool {
        rule.is_some_and(|r| r.names().any(|n| n == name))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn id(uid: u32, cgroup: &str) -> Identity {
        Identity {
            uid,
            gid: uid,
            cgroup: cgroup.into(),
        }
    }

    fn nobody(_: &str) -> BTreeSet<u32> {
        BTreeSet::new()
    }

    fn policy() -> TenantSettings {
        TenantSettings {
            trusted_uids: vec![0],
            recheck_ms: 1000,
            rules: vec![
                TenantRule {
                    uid: Some(1001),
                    apps: vec!["kv".into(), "kv-*".into()],
                    app: Some("kv".into()),
                    weight: Some(3.0),
                    ..TenantRule::default()
                },
                TenantRule {
                    cgroup: Some("/system.slice/batch.service".into()),
                    apps: vec!["*".into()],
                    ..TenantRule::default()
                },
                TenantRule {
                    gid: Some(2000),
                    app: Some("shared".into()),
                    ..TenantRule::default()
                },
            ],
        }
    }

    #[test]
    fn a_rule_grants_its_names_and_maps_the_rest_to_its_app() {
        let p = policy();
        let a = id(1001, "/user.slice");
        let d = p.decide(&a, "kv-7", &nobody);
        assert_eq!(
            (d.app.as_str(), d.mapped, d.weight),
            ("kv-7", None, Some(3.0))
        );
        let d = p.decide(&a, "bulk", &nobody);
        assert_eq!(d.app, "kv");
        assert!(d.mapped.unwrap().contains("does not allow"));
    }

    #[test]
    fn another_user_asking_for_a_tenants_name_gets_its_own_default() {
        let p = policy();
        let d = p.decide(&id(1002, "/"), "kv", &nobody);
        assert_eq!(d.app, "uid-1002");
        assert!(d.mapped.is_some());
        // Root is trusted, yet "kv" is the rule's: root runs as its own default.
        let d = p.decide(&id(0, "/"), "kv", &nobody);
        assert_eq!(d.app, "uid-0");
        assert!(d.mapped.unwrap().contains("another identity"));
        // Nor can anyone take another uid's default.
        let d = p.decide(&id(0, "/"), "uid-1002", &nobody);
        assert_eq!(d.app, "uid-0");
        let d = p.decide(&id(0, "/"), "uid-0", &nobody);
        assert_eq!((d.app.as_str(), d.mapped), ("uid-0", None));
    }

    #[test]
    fn trusted_users_keep_their_names_unless_another_user_holds_them() {
        let p = policy();
        let d = p.decide(&id(0, "/"), "bulk", &nobody);
        assert_eq!((d.app.as_str(), d.mapped, d.weight), ("bulk", None, None));
        // The batch service (cgroup rule, any name) asks for what root runs now.
        let batch = id(0, "/system.slice/batch.service/sub");
        let root_holds = |n: &str| -> BTreeSet<u32> {
            if n == "bulk" {
                [0].into()
            } else {
                BTreeSet::new()
            }
        };
        let d = p.decide(&batch, "bulk", &root_holds);
        assert_eq!(d.app, "bulk", "the same uid may share");
        let d = p.decide(
            &id(1003, "/system.slice/batch.service"),
            "bulk",
            &root_holds,
        );
        assert_eq!(d.app, "uid-1003");
        assert!(d.mapped.unwrap().contains("another user"));
        // Not a component prefix: no match, untrusted default.
        let d = p.decide(&id(1003, "/system.slice/batch.service2"), "x", &nobody);
        assert_eq!(d.app, "uid-1003");
    }

    #[test]
    fn a_name_the_policy_gives_several_users_is_shared() {
        let p = policy();
        let holds = |_: &str| -> BTreeSet<u32> { [5001].into() };
        let d = p.decide(
            &Identity {
                uid: 5002,
                gid: 2000,
                cgroup: "/".into(),
            },
            "anything",
            &holds,
        );
        assert_eq!(d.app, "shared");
    }

    #[test]
    fn bad_rules_are_refused_with_their_place() {
        for (rule, want) in [
            (TenantRule::default(), "needs uid"),
            (
                TenantRule {
                    uid: Some(1),
                    app: Some("bad name".into()),
                    ..TenantRule::default()
                },
                "not a valid app name",
            ),
            (
                TenantRule {
                    uid: Some(1),
                    apps: vec!["a*b*".into()],
                    ..TenantRule::default()
                },
                "prefix",
            ),
            (
                TenantRule {
                    uid: Some(1),
                    weight: Some(f64::NAN),
                    ..TenantRule::default()
                },
                "weight",
            ),
            (
                TenantRule {
                    cgroup: Some("relative".into()),
                    ..TenantRule::default()
                },
                "absolute",
            ),
        ] {
            let p = TenantSettings {
                trusted_uids: vec![],
                rules: vec![rule],
                ..TenantSettings::default()
            };
            let e = p.validate().unwrap_err();
            assert!(e.contains("tenants.rules[0]") && e.contains(want), "{e}");
        }
        policy().validate().unwrap();
        let e = TenantSettings {
            recheck_ms: 10,
            ..policy()
        }
        .validate()
        .unwrap_err();
        assert!(e.contains("recheck_ms"), "{e}");
    }

    proptest! {
        /// Whatever is asked, by whomever, with any processes registered: the app is a valid
        /// name, and it never holds another uid's processes unless the matching rule names
        /// it; an untrusted uid no rule matches lands in its own default.
        #[test]
        fn two_users_never_share_an_app_the_policy_does_not_name(
            uid in prop_oneof![Just(0u32), Just(1001), Just(1002), Just(5002), any::<u32>()],
            gid in prop_oneof![Just(2000u32), any::<u32>()],
            cgroup in prop_oneof![Just("/".to_string()), Just("/system.slice/batch.service".to_string()), "/[a-z/.]{0,20}"],
            requested in prop_oneof![Just("kv".to_string()), Just("shared".to_string()), Just("uid-1001".to_string()), "[A-Za-z0-9._-]{1,64}"],
            holder in prop_oneof![Just(0u32), Just(1001), any::<u32>()],
        ) {
            let p = policy();
            let me = Identity { uid, gid, cgroup };
            let holds = |_: &str| -> BTreeSet<u32> { [holder].into() };
            let d = p.decide(&me, &requested, &holds);
            prop_assert!(drum_table::message::valid_app(&d.app));
            let rule = p.rules.iter().find(|r| r.matches(&me));
            if d.app == requested && holder != uid {
                prop_assert!(p.shared_by_policy(rule, &d.app), "{d:?}");
            }
            if rule.is_none() && uid != 0 {
                prop_assert_eq!(&d.app, &uid_app(uid));
            }
            if let Some(u) = uid_of_default(&requested) {
                if d.app == requested { prop_assert_eq!(u, uid); }
            }
        }
    }
}
