//! The live problem at the coordinator: hosts report their rows (`Host`) and their new
//! active sets (`Update`); the reports become the facility table every member hears of, and
//! the snapshot `solve` reads.

use super::*;
use crate::protocol::wire::RackHostMsg;

/// A host's latest report as its member sent it.
#[derive(Clone, Debug)]
pub(super) struct Reported {
    pub report: HostReport,
    /// The GIDs of its reports that other hosts' links own, as last logged: reports come
    /// every 250 ms, the refusal is said once per change.
    pub ignored_gids: Vec<Gid>,
}

/// A GID as 32 hex digits, as logs print them.
fn gid_text(g: &Gid) -> String {
    g.iter().map(|b| format!("{b:02x}")).collect()
}

impl Coordinator {
    /// A coordinator of the live problem: no facility until hosts join with their links, apps
    /// named by whoever runs them, weights from `policy` (checked by the caller).
    /// The live problem: no instance; each facility's penalty is balanced against its
    /// residuals, since a live facility swings between idle and contended as apps come and go
    /// ([`RhoBalance`]).
    pub fn new_live(cfg: CoordinatorConfig, policy: LivePolicy) -> Self {
        let mut c = Coordinator::new(cfg, Vec::new());
        c.live = Some(policy);
        c.admm = c.fresh_admm();
        c
    }

    /// The live policy in force, if this coordinator runs the live problem.
    pub fn policy(&self) -> Option<&LivePolicy> {
        self.live.as_ref()
    }

    /// Live problem: the problem as an instance file (what `snapshot` writes): the facilities
    /// with their capacities, every member's last report. `None` with an instance file.
    pub fn snapshot(&self) -> Option<Instance> {
        let policy = self.live.as_ref()?;
        let hosts: Vec<(String, HostReport)> = self
            .members
            .values()
            .flat_map(|m| m.reports.iter().map(|(h, r)| (h.clone(), r.report.clone())))
            .collect();
        Some(crate::live::snapshot(policy, &self.facilities, &hosts))
    }

    /// A relay's report of one of its agents' hosts (or of its departure). A host that
    /// another member is, or speaks for, keeps its link: the report is refused and logged,
    /// not a violation (a host moving between relays, or to a direct connection, is reported
    /// by both for a moment).
    pub(super) fn rack_host(&mut self, from: MemberId, r: RackHostMsg, out: &mut Vec<Action>) {
        if !self.members.contains_key(&from) {
            self.violation(from, "host report before join".into(), out);
            return;
        }
        if !crate::protocol::valid_name(&r.host) {
            self.violation(
                from,
                format!("bad host id {:?} in a rack's report", r.host),
                out,
            );
            return;
        }
        let Some(report) = r.report else {
            self.members
                .get_mut(&from)
                .expect("checked")
                .reports
                .remove(&r.host);
            return;
        };
        let taken = self
            .members
            .iter()
            .any(|(&id, m)| id != from && (m.host == r.host || m.reports.contains_key(&r.host)));
        if taken {
            out.push(Action::Event(Event::Refused {
                member: from,
                reason: format!(
                    "a report of host {} through a relay, which another member is or reports; ignored",
                    r.host
                ),
            }));
            return;
        }
        self.host_report(from, r.host, report, out);
    }

    /// A host's report: kept for `status` and the snapshot; the first one creates the host's
    /// receive link, and a link whose line rate or GIDs changed is updated. Every member hears
    /// of a changed facility table.
    pub(super) fn host_report(
        &mut self,
        from: MemberId,
        host: String,
        mut r: HostReport,
        out: &mut Vec<Action>,
    ) {
        let Some(m) = self.members.get(&from) else {
            self.violation(from, "host report before join".into(), out);
            return;
        };
        if self.live.is_none() {
            self.violation(
                from,
                "host report to a coordinator with an instance file".into(),
                out,
            );
            return;
        }
        if let Err(e) = r.check(self.facilities.len()) {
            self.violation(from, format!("bad host report: {e}"), out);
            return;
        }
        // A GID of another host's link stays that host's: two links owning one GID would make
        // the agents' mapping of peers depend on table order.
        let owned_elsewhere: Vec<Gid> = r
            .gids
            .iter()
            .copied()
            .filter(|g| {
                self.links
                    .iter()
                    .any(|l| l.host != host && l.gids.contains(g))
            })
            .collect();
        let said = m
            .reports
            .get(&host)
            .is_some_and(|p| p.ignored_gids == owned_elsewhere);
        if !owned_elsewhere.is_empty() && !said {
            out.push(Action::Event(Event::Refused {
                member: from,
                reason: format!(
                    "host {host} reports GIDs {} that another host's link owns; ignoring them",
                    owned_elsewhere
                        .iter()
                        .map(gid_text)
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            }));
        }
        r.gids.retain(|g| !owned_elsewhere.contains(g));
        let id = crate::live::link_id(&host);
        let capacity = self.capacities.get(&id).copied().unwrap_or(1.0);
        let changed = match self.facilities.iter().position(|f| f.id == id) {
            Some(f) => {
                let link = &mut self.links[f];
                let changed = link.line_rate_gbps != r.line_rate_gbps || link.gids != r.gids;
                link.gids = r.gids.clone();
                link.line_rate_gbps = r.line_rate_gbps;
                changed
            }
            None if self.facilities.len() < crate::live::MAX_HOSTS => {
                self.facilities.push(Facility {
                    id: id.clone(),
                    capacity,
                    cost: 0.0,
                });
                self.owned.push(true);
                self.admm.push_facility();
                self.links.push(LiveFacility {
                    id,
                    host: host.clone(),
                    line_rate_gbps: r.line_rate_gbps,
                    capacity,
                    gids: r.gids.clone(),
                });
                true
            }
            None => false,
        };
        self.members
            .get_mut(&from)
            .expect("checked")
            .reports
            .insert(
                host,
                Reported {
                    report: r,
                    ignored_gids: owned_elsewhere,
                },
            );
        if changed {
            self.send_all(CoordMsg::Facilities(self.links.clone()), out);
        }
    }

    /// A live host's problem changed: its new active set and usage replace the old ones, as a
    /// join would, in a new epoch.
    pub(super) fn update(&mut self, from: MemberId, u: UpdateMsg, out: &mut Vec<Action>) {
        // With an instance file, a relay sends its rack's new sums this way when one of its
        // agents joins or leaves (`super::super::relay`).
        if !self.members.contains_key(&from) {
            self.violation(from, "update before join".into(), out);
            return;
        }
        let nf = self.facilities.len() as u32;
        let checked = u
            .check_shape(nf)
            .and_then(|()| self.check_active(&u.pairs, &u.floor))
            .and_then(|()| self.check_entries(&u.entries));
        if let Err(e) = checked {
            self.violation(from, e, out);
            return;
        }
        let m = self.members.get_mut(&from).expect("checked");
        m.pairs = u.pairs;
        m.entries = u.entries;
        m.interest = u.interest;
        m.floor = u.floor;
        m.last_d = u.last_d;
        self.membership_changed = true;
    }
}
