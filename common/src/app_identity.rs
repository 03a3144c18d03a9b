//! The kernel identities behind a live app (issue 23): what the host's agent learnt of its
//! registered processes (uid, gid and cgroup from `SO_PEERCRED` and `/proc`), carried in the
//! host's report so that the coordinator's `status` shows who runs each app.
//!
//! A host decides how many processes and cgroups it has, so the report is bounded here, on
//! both sides: the agent sends at most [`MAX_PER_APP`] identities per app and
//! [`MAX_PER_HOST`] per report, cgroup paths cut to [`MAX_CGROUP_LEN`] bytes, and counts what
//! it left out; the coordinator refuses a report beyond those bounds like any malformed one.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Identities per app in one report: the ones with the most processes.
pub const MAX_PER_APP: usize = 8;
/// Identities in one report, over all its apps (at most ~40 KB on the wire).
pub const MAX_PER_HOST: usize = 256;
/// Bytes of a cgroup path in a report; a longer one is cut and ends in [`CUT`].
pub const MAX_CGROUP_LEN: usize = 128;
/// The end of a cut cgroup path.
pub const CUT: &str = "…";

/// One identity running an app on a host, with how many of its processes do.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct AppIdentity {
    pub uid: u32,
    pub gid: u32,
    pub cgroup: String,
    pub processes: u32,
}

/// What a report carries of an app's identities: the bounded list and how many it left out.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AppIdentities {
    pub identities: Vec<AppIdentity>,
    /// Identities not listed (beyond [`MAX_PER_APP`] or [`MAX_PER_HOST`]).
    pub more: u32,
}

/// `(uid, gid, cgroup)` of each registered process, grouped per app into identities with
/// their process counts.
pub fn group<'a>(
    procs: impl IntoIterator<Item = (&'a str, u32, u32, &'a str)>,
) -> BTreeMap<String, Vec<AppIdentity>> {
    let mut counts: BTreeMap<(&str, u32, u32, &str), u32> = BTreeMap::new();
    for p in procs {
        *counts.entry(p).or_default() += 1;
    }
    let mut out: BTreeMap<String, Vec<AppIdentity>> = BTreeMap::new();
    for ((app, uid, gid, cgroup), processes) in counts {
        out.entry(app.to_string()).or_default().push(AppIdentity {
            uid,
            gid,
            cgroup: cgroup.to_string(),
            processes,
        });
    }
    out
}

/// `cgroup` cut to [`MAX_CGROUP_LEN`] bytes at a character boundary, marked with [`CUT`].
fn cut(cgroup: &str) -> String {
    if cgroup.len() <= MAX_CGROUP_LEN {
        return cgroup.to_string();
    }
    let mut end = MAX_CGROUP_LEN - CUT.len();
    while !cgroup.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}{CUT}", &cgroup[..end])
}

/// The bounded identities of each app, in the order of `apps` (the report's): each app's
/// identities with the most processes first, at most [`MAX_PER_APP`] each and
/// [`MAX_PER_HOST`] in all.
pub fn bounded(apps: &[&str], all: &BTreeMap<String, Vec<AppIdentity>>) -> Vec<AppIdentities> {
    let mut room = MAX_PER_HOST;
    apps.iter()
        .map(|app| {
            let Some(ids) = all.get(*app) else {
                return AppIdentities::default();
            };
            let mut ids = ids.clone();
            ids.sort_by(|a, b| b.processes.cmp(&a.processes).then_with(|| a.cmp(b)));
            let keep = ids.len().min(MAX_PER_APP).min(room);
            room -= keep;
            let more = (ids.len() - keep) as u32;
            ids.truncate(keep);
            for i in &mut ids {
                i.cgroup = cut(&i.cgroup);
            }
            AppIdentities {
                identities: ids,
                more,
            }
        })
        .collect()
}

/// Whether a report's identities keep the bounds; the error names the first that does not.
pub fn check<'a>(
    apps: impl IntoIterator<Item = (&'a str, &'a [AppIdentity])>,
) -> Result<(), String> {
    let mut total = 0;
    for (app, ids) in apps {
        total += ids.len();
        if ids.len() > MAX_PER_APP || total > MAX_PER_HOST {
            return Err(format!(
                "{app}: {} identities, at most {MAX_PER_APP} per app and {MAX_PER_HOST} per host",
                ids.len()
            ));
        }
        if let Some(i) = ids
            .iter()
            .find(|i| i.cgroup.len() > MAX_CGROUP_LEN || i.processes == 0)
        {
            return Err(format!(
                "{app}: an identity with a cgroup of {} bytes (at most {MAX_CGROUP_LEN}) or no process",
                i.cgroup.len()
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn processes_are_grouped_per_app_and_identity() {
        let g = group([
            ("kv", 1001, 1001, "/a"),
            ("kv", 1001, 1001, "/a"),
            ("kv", 1002, 1002, "/"),
            ("bulk", 0, 0, "/"),
        ]);
        assert_eq!(g["kv"].len(), 2);
        assert_eq!(g["kv"][0].processes, 2);
        assert_eq!(g["bulk"][0].uid, 0);
    }

    #[test]
    fn a_hostile_number_of_identities_is_bounded_and_counted() {
        // 1000 uids in one app, then 100 apps of 8 identities each; cgroups of 10 KB.
        let long = "/é".repeat(5000);
        let mut procs: Vec<(String, u32, String)> = (0..1000)
            .map(|u| ("many".to_string(), u, long.clone()))
            .collect();
        for a in 0..100 {
            for u in 0..8 {
                procs.push((format!("z{a:03}"), u, "/".into()));
            }
        }
        // One identity of "many" runs 3 processes: it is listed first.
        procs.push(("many".into(), 7, long.clone()));
        procs.push(("many".into(), 7, long.clone()));
        let all = group(
            procs
                .iter()
                .map(|(a, u, c)| (a.as_str(), *u, *u, c.as_str())),
        );
        let names: Vec<&str> = all.keys().map(|s| s.as_str()).collect();
        let b = bounded(&names, &all);
        let total: usize = b.iter().map(|a| a.identities.len()).sum();
        assert_eq!(total, MAX_PER_HOST);
        let many = &b[names.iter().position(|n| *n == "many").unwrap()];
        assert_eq!(many.identities.len(), MAX_PER_APP);
        assert_eq!(many.more, 1000 - MAX_PER_APP as u32);
        assert_eq!(
            (many.identities[0].uid, many.identities[0].processes),
            (7, 3)
        );
        assert!(many.identities[0].cgroup.len() <= MAX_CGROUP_LEN);
        assert!(many.identities[0].cgroup.ends_with(CUT));
        let left_out: u32 = b.iter().map(|a| a.more).sum();
        assert_eq!(left_out as usize, 1000 + 800 - MAX_PER_HOST);
        check(
            names
                .iter()
                .copied()
                .zip(b.iter().map(|a| &a.identities[..])),
        )
        .unwrap();
        let as_sent = crate::protocol::wire::encode(&b).unwrap();
        assert!(as_sent.len() < 64 << 10, "{} bytes", as_sent.len());
    }

    #[test]
    fn reports_beyond_the_bounds_are_refused() {
        let id = |cgroup: &str| AppIdentity {
            uid: 1,
            gid: 1,
            cgroup: cgroup.into(),
            processes: 1,
        };
        let too_many = vec![id("/"); MAX_PER_APP + 1];
        assert!(check([("a", &too_many[..])])
            .unwrap_err()
            .contains("identities"));
        let too_long = [id(&"x".repeat(MAX_CGROUP_LEN + 1))];
        assert!(check([("a", &too_long[..])])
            .unwrap_err()
            .contains("cgroup"));
        let full = vec![id("/"); MAX_PER_APP];
        let many: Vec<String> = (0..MAX_PER_HOST / MAX_PER_APP + 1)
            .map(|i| format!("a{i}"))
            .collect();
        assert!(check(many.iter().map(|n| (n.as_str(), &full[..]))).is_err());
        assert!(check(many[1..].iter().map(|n| (n.as_str(), &full[..]))).is_ok());
    }
}
