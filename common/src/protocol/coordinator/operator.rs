//! The operator's commands (`set-weight`, `set-capacity`, `drain-host`, `undrain-host`),
//! each checked before it changes anything, and the state a coordinator persists of them.

use super::*;

/// The operator's changes, which a coordinator persists across restarts (`state_file`): the
/// capacities set by `set-capacity`, the weights set by `set-weight` and the drained hosts.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OperatorState {
    pub capacities: BTreeMap<String, f64>,
    pub weights: BTreeMap<String, f64>,
    pub drained: Vec<String>,
}

impl Coordinator {
    /// The instance's app ids, which `set-weight` may name.
    pub fn set_apps(&mut self, apps: Vec<String>) {
        self.apps = apps;
    }

    /// Operator change of an app's weight on every host: checked (finite, positive, a known
    /// app), then sent to every member and to every host that joins later.
    pub fn set_weight(&mut self, app: &str, weight: f64) -> Result<Vec<Action>, String> {
        if !crate::live::valid_weight(weight) {
            return Err(crate::live::weight_error("weight", weight));
        }
        if let Some(policy) = &mut self.live {
            // Any app may run, so any well-formed name may be given a weight.
            if !crate::protocol::valid_name(app) {
                return Err(format!(
                    "app name {app:?} is not 1 to 64 letters, digits, '.', '_' or '-'"
                ));
            }
            policy.set_weight(app, Some(weight));
            let msg = CoordMsg::Policy(policy.clone());
            self.weights.insert(app.to_string(), weight);
            self.reselect.changed();
            let mut out = Vec::new();
            self.send_all(msg, &mut out);
            return Ok(out);
        }
        if !self.apps.iter().any(|a| a == app) {
            return Err(format!("no app {app:?}"));
        }
        self.weights.insert(app.to_string(), weight);
        self.reselect.changed();
        Ok(self
            .members
            .keys()
            .map(|&id| {
                Action::Send(
                    id,
                    CoordMsg::SetWeight {
                        app: app.to_string(),
                        weight,
                    },
                )
            })
            .collect())
    }

    /// The operator's changes so far, for the state file.
    pub fn operator_state(&self) -> OperatorState {
        OperatorState {
            capacities: self.capacities.clone(),
            weights: self.weights.clone(),
            drained: self.drained.iter().cloned().collect(),
        }
    }

    /// Applies persisted operator changes at start, each checked as if the operator made it
    /// now. Those that fit are applied; the others are returned, each with why it was
    /// refused, so that the caller reports them and sets the file aside: no state file may
    /// keep the coordinator from starting.
    pub fn restore(&mut self, st: &OperatorState) -> Vec<String> {
        let mut refused = Vec::new();
        for (f, &y) in &st.capacities {
            if let Err(e) = self.set_capacity(f, y) {
                refused.push(format!("capacity of {f:?}: {e}"));
            }
        }
        for (a, &w) in &st.weights {
            if let Err(e) = self.set_weight(a, w) {
                refused.push(format!("weight of {a:?}: {e}"));
            }
        }
        for h in &st.drained {
            match self.check_host(h) {
                Ok(()) => {
                    self.drained.insert(h.clone());
                }
                Err(e) => refused.push(format!("drained host: {e}")),
            }
        }
        refused
    }

    /// The instance's host ids ([`Self::set_hosts`]), which `drain` may name; empty in the
    /// live problem, where any well-formed name may be drained before its host joins.
    pub fn set_hosts(&mut self, hosts: Vec<String>) {
        self.host_ids = hosts;
    }

    /// Whether `host` may be named by `drain`: a well-formed name and, with an instance, one
    /// of its hosts.
    pub(super) fn check_host(&self, host: &str) -> Result<(), String> {
        if !crate::protocol::valid_name(host) {
            return Err(format!(
                "host id {host:?} is not 1 to 64 letters, digits, '.', '_' or '-'"
            ));
        }
        if !self.host_ids.is_empty() && !self.host_ids.iter().any(|h| h == host) {
            return Err(format!("no host {host:?} in the instance"));
        }
        Ok(())
    }

    /// Operator change of a facility's capacity; takes effect at the next update.
    pub fn set_capacity(&mut self, facility: &str, capacity: f64) -> Result<(), String> {
        // The range instance validation accepts: far outside it is a unit mistake, and
        // 1e308 or 5e-324 make the prices overflow or vanish.
        if !crate::live::valid_weight(capacity) {
            return Err(crate::live::weight_error("capacity", capacity));
        }
        let Some(i) = self.facilities.iter().position(|f| f.id == facility) else {
            // A live link may be set before its host joins: it takes the capacity then.
            let link = facility
                .strip_prefix("rx:")
                .is_some_and(crate::protocol::valid_name);
            if self.live.is_some() && link {
                self.capacities.insert(facility.to_string(), capacity);
                return Ok(());
            }
            return Err(format!("no facility {facility:?}"));
        };
        if !self.owned[i] {
            return Err(format!(
                "facility {facility:?} belongs to shard {}/{}, not to this one ({})",
                crate::protocol::shard_of(facility, self.cfg.shard.count),
                self.cfg.shard.count,
                self.cfg.shard
            ));
        }
        self.facilities[i].capacity = capacity;
        if let Some(link) = self.links.get_mut(i) {
            link.capacity = capacity;
        }
        self.capacities.insert(facility.to_string(), capacity);
        self.reselect.changed();
        Ok(())
    }

    /// Takes `host` out of the optimisation: its contribution is removed at once (new epoch),
    /// its connection closed, and its joins refused until [`Self::undrain`]. Its agent keeps
    /// its last rates (fail-static). A malformed id, or with an instance one that names none
    /// of its hosts, is refused: persisted, it would name no host the coordinator can have.
    pub fn drain(&mut self, now: Duration, host: &str) -> Result<Vec<Action>, String> {
        self.check_host(host)?;
        let mut out = Vec::new();
        self.drained.insert(host.to_string());
        if let Some(&id) = self.hosts.get(host) {
            let reason = format!("host {host} drained by the operator");
            out.push(Action::Send(
                id,
                CoordMsg::Refused {
                    reason: reason.clone(),
                },
            ));
            out.push(Action::Close(id, reason));
            self.remove(id, LeaveReason::Drained, &mut out);
        }
        self.advance(now, &mut out);
        Ok(out)
    }

    /// Whether `host` is a member now (for the operator's replies).
    pub fn is_member(&self, host: &str) -> bool {
        self.hosts.contains_key(host)
    }

    /// Lets a drained host join again; whether it was drained.
    pub fn undrain(&mut self, host: &str) -> bool {
        self.drained.remove(host)
    }
}
