//! Instance files (JSON, docs/instance-format.md) and their validation into a [`Problem`].

use crate::model::{Facility, Host, Pair, Params, Problem};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;

/// Bounds that keep every computation finite: rates are fractions of line rate, so anything far
/// outside these is a unit mistake, not a configuration.
const MAX_MAGNITUDE: f64 = 1e9;
const MIN_MAGNITUDE: f64 = 1e-9;

#[derive(Debug, thiserror::Error)]
pub enum InstanceError {
    #[error("instance is not valid JSON of the documented format: {0}")]
    Json(#[from] serde_json::Error),
    #[error("{at}: {what}")]
    Invalid { at: String, what: String },
    #[error("host {host:?} is infeasible: {why}")]
    Infeasible { host: String, why: String },
}

fn invalid(at: impl Into<String>, what: impl Into<String>) -> InstanceError {
    InstanceError::Invalid {
        at: at.into(),
        what: what.into(),
    }
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Instance {
    pub alpha: f64,
    pub beta: f64,
    pub k: usize,
    pub x_min: f64,
    pub facilities: Vec<FacilitySpec>,
    pub hosts: Vec<HostSpec>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct FacilitySpec {
    pub id: String,
    pub capacity: f64,
    /// Optional coefficient `c` of a convex cost `c·y²/2` on the facility's usage.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub cost: f64,
}

fn is_zero(v: &f64) -> bool {
    *v == 0.0
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct HostSpec {
    pub id: String,
    pub wqe_budget: f64,
    pub poll_budget: f64,
    /// This host's `k`, where it differs from the instance's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub k: Option<usize>,
    pub apps: Vec<AppSpec>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct AppSpec {
    pub id: String,
    pub weight: f64,
    pub cqe_per_wqe: f64,
    pub demand: f64,
    /// The single-facility form: the one facility the app uses, with `facility_coeff`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub facility: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub facility_coeff: Option<f64>,
    /// The general form: every facility the app uses with its coefficient (possibly none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub facilities: Option<Vec<UseSpec>>,
}

/// One facility an app uses: `b`, its usage per unit of the app's rate.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct UseSpec {
    pub id: String,
    pub coeff: f64,
}

impl AppSpec {
    /// The facilities the app uses, `(id, b)`, from either form; both or neither is an error.
    fn uses(&self, at: &str) -> Result<Vec<(String, f64)>, InstanceError> {
        match (&self.facility, self.facility_coeff, &self.facilities) {
            (Some(f), Some(b), None) => Ok(vec![(f.clone(), b)]),
            (None, None, Some(list)) => Ok(list.iter().map(|u| (u.id.clone(), u.coeff)).collect()),
            (None, None, None) => Err(invalid(
                at,
                "needs facility and facility_coeff, or facilities (a list, possibly empty)",
            )),
            _ => Err(invalid(
                at,
                "give either facility with facility_coeff, or facilities, not both or a part",
            )),
        }
    }
}

/// A positive, finite value within the sane magnitude range.
fn positive(at: &str, field: &str, v: f64) -> Result<f64, InstanceError> {
    if v.is_finite() && (MIN_MAGNITUDE..=MAX_MAGNITUDE).contains(&v) {
        Ok(v)
    } else {
        Err(invalid(
            format!("{at}.{field}"),
            format!("must be a finite number in [{MIN_MAGNITUDE:e}, {MAX_MAGNITUDE:e}], got {v}"),
        ))
    }
}

impl Instance {
    pub fn from_json(text: &str) -> Result<Self, InstanceError> {
        Ok(serde_json::from_str(text)?)
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("an instance always serialises")
    }

    /// Validates every field and builds the compact problem; errors name the offending place.
    pub fn into_problem(self) -> Result<Problem, InstanceError> {
        let alpha = positive("instance", "alpha", self.alpha)?;
        if !(self.beta.is_finite() && (0.0..=MAX_MAGNITUDE).contains(&self.beta)) {
            return Err(invalid(
                "instance.beta",
                format!("must be finite and ≥ 0, got {}", self.beta),
            ));
        }
        if self.k == 0 || self.k > 1_000_000 {
            return Err(invalid(
                "instance.k",
                format!("must be in 1..=1000000, got {}", self.k),
            ));
        }
        let x_min = positive("instance", "x_min", self.x_min)?;
        let params = Params {
            alpha,
            beta: self.beta,
            k: self.k,
            x_min,
        };

        let mut facility_index = HashMap::new();
        let mut facilities = Vec::with_capacity(self.facilities.len());
        for (i, f) in self.facilities.into_iter().enumerate() {
            let at = format!("facilities[{i}] (id {:?})", f.id);
            if f.id.is_empty() {
                return Err(invalid(at, "id must not be empty"));
            }
            let capacity = positive(&at, "capacity", f.capacity)?;
            if !(f.cost.is_finite() && (0.0..=MAX_MAGNITUDE).contains(&f.cost)) {
                return Err(invalid(
                    format!("{at}.cost"),
                    format!("must be finite and ≥ 0, got {}", f.cost),
                ));
            }
            if facility_index
                .insert(f.id.clone(), facilities.len() as u32)
                .is_some()
            {
                return Err(invalid(at, "duplicate facility id"));
            }
            facilities.push(Facility {
                id: f.id,
                capacity,
                cost: f.cost,
            });
        }

        let mut app_index: HashMap<String, u32> = HashMap::new();
        let mut app_names = Vec::new();
        let mut hosts = Vec::with_capacity(self.hosts.len());
        let mut pairs = Vec::with_capacity(self.hosts.iter().map(|h| h.apps.len()).sum());
        let mut host_ids = HashMap::new();
        for (hi, h) in self.hosts.into_iter().enumerate() {
            let at = format!("hosts[{hi}] (id {:?})", h.id);
            if h.id.is_empty() {
                return Err(invalid(at, "id must not be empty"));
            }
            if host_ids.insert(h.id.clone(), hi).is_some() {
                return Err(invalid(at, "duplicate host id"));
            }
            let wqe_budget = positive(&at, "wqe_budget", h.wqe_budget)?;
            let poll_budget = positive(&at, "poll_budget", h.poll_budget)?;
            let start = pairs.len();
            let mut seen = HashMap::new();
            for (ai, app) in h.apps.into_iter().enumerate() {
                let at = format!("{at}.apps[{ai}] (id {:?})", app.id);
                if app.id.is_empty() {
                    return Err(invalid(at, "id must not be empty"));
                }
                if seen.insert(app.id.clone(), ai).is_some() {
                    return Err(invalid(at, "app listed twice on this host"));
                }
                let weight = positive(&at, "weight", app.weight)?;
                let cqe_per_wqe = positive(&at, "cqe_per_wqe", app.cqe_per_wqe)?;
                let demand = positive(&at, "demand", app.demand)?;
                if demand < x_min {
                    return Err(invalid(
                        format!("{at}.demand"),
                        format!("{demand} is below x_min = {x_min}: the app could never be active"),
                    ));
                }
                let single = app.facility.is_some();
                let mut uses = Vec::new();
                for (ui, (id, coeff)) in app.uses(&at)?.into_iter().enumerate() {
                    let (id_at, coeff_at) = if single {
                        (format!("{at}.facility"), "facility_coeff".to_string())
                    } else {
                        (
                            format!("{at}.facilities[{ui}].id"),
                            format!("facilities[{ui}].coeff"),
                        )
                    };
                    let coeff = positive(&at, &coeff_at, coeff)?;
                    let facility = *facility_index
                        .get(&id)
                        .ok_or_else(|| invalid(&id_at, format!("no facility with id {id:?}")))?;
                    let cap = facilities[facility as usize].capacity;
                    if coeff * x_min > cap {
                        return Err(invalid(
                            format!("{at}.{coeff_at}"),
                            format!(
                                "at x_min the app alone needs {} of facility {id:?}, whose capacity is {cap}",
                                coeff * x_min
                            ),
                        ));
                    }
                    uses.push((facility, coeff));
                }
                uses.sort_unstable_by_key(|u| u.0);
                if uses.windows(2).any(|w| w[0].0 == w[1].0) {
                    return Err(invalid(
                        format!("{at}.facilities"),
                        "lists a facility twice",
                    ));
                }
                let next = app_names.len() as u32;
                let app_id = *app_index.entry(app.id.clone()).or_insert_with(|| {
                    app_names.push(app.id);
                    next
                });
                pairs.push(Pair {
                    app: app_id,
                    weight,
                    cqe_per_wqe,
                    demand,
                    uses,
                });
            }
            if h.k.is_some_and(|k| k == 0 || k > 1_000_000) {
                return Err(invalid(
                    format!("{at}.k"),
                    format!("must be in 1..=1000000, got {}", h.k.unwrap_or(0)),
                ));
            }
            hosts.push(Host {
                id: h.id,
                wqe_budget,
                poll_budget,
                k: h.k,
                pairs: start..pairs.len(),
            });
        }
        let problem = Problem {
            params,
            facilities,
            app_names,
            hosts,
            pairs,
        };
        check_floor_feasibility(&problem)?;
        Ok(problem)
    }

    /// The instance a problem was built from (names and values; used to write generated ones).
    pub fn from_problem(p: &Problem) -> Self {
        Instance {
            alpha: p.params.alpha,
            beta: p.params.beta,
            k: p.params.k,
            x_min: p.params.x_min,
            facilities: p
                .facilities
                .iter()
                .map(|f| FacilitySpec {
                    id: f.id.clone(),
                    capacity: f.capacity,
                    cost: f.cost,
                })
                .collect(),
            hosts: p
                .hosts
                .iter()
                .map(|h| HostSpec {
                    id: h.id.clone(),
                    wqe_budget: h.wqe_budget,
                    poll_budget: h.poll_budget,
                    k: h.k,
                    apps: p.pairs[h.pairs.clone()]
                        .iter()
                        .map(|pair| {
                            let id = |f: u32| p.facilities[f as usize].id.clone();
                            let mut app = AppSpec {
                                id: p.app_names[pair.app as usize].clone(),
                                weight: pair.weight,
                                cqe_per_wqe: pair.cqe_per_wqe,
                                demand: pair.demand,
                                facility: None,
                                facility_coeff: None,
                                facilities: None,
                            };
                            // One facility is written in the single-facility form every
                            // reader of older files knows.
                            if let [(f, b)] = pair.uses[..] {
                                app.facility = Some(id(f));
                                app.facility_coeff = Some(b);
                            } else {
                                app.facilities = Some(
                                    pair.uses
                                        .iter()
                                        .map(|&(f, coeff)| UseSpec { id: id(f), coeff })
                                        .collect(),
                                );
                            }
                            app
                        })
                        .collect(),
                })
                .collect(),
        }
    }
}

/// Every host must be able to run its full quota of active apps at the floor rate `x_min`
/// within both budgets, whichever apps are chosen.
fn check_floor_feasibility(p: &Problem) -> Result<(), InstanceError> {
    let x_min = p.params.x_min;
    for (hi, host) in p.hosts.iter().enumerate() {
        let slots = p.slots(hi);
        let need = slots as f64 * x_min;
        if need > host.wqe_budget {
            return Err(InstanceError::Infeasible {
                host: host.id.clone(),
                why: format!(
                    "{slots} active apps at x_min = {x_min} need a WQE budget of {need}, but wqe_budget = {}",
                    host.wqe_budget
                ),
            });
        }
        let mut a: Vec<f64> = p.host_pairs(hi).iter().map(|q| q.cqe_per_wqe).collect();
        a.sort_by(|l, r| r.total_cmp(l));
        let poll_need: f64 = a.iter().take(slots).sum::<f64>() * x_min;
        if poll_need > host.poll_budget {
            return Err(InstanceError::Infeasible {
                host: host.id.clone(),
                why: format!(
                    "the {slots} apps with most completions per WQE need a polling budget of {poll_need} at x_min = {x_min}, but poll_budget = {}",
                    host.poll_budget
                ),
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Instance {
        Instance::from_json(
            r#"{"alpha": 1, "beta": 0.001, "k": 2, "x_min": 0.01,
                "facilities": [{"id": "kv", "capacity": 1.0}],
                "hosts": [{"id": "h1", "wqe_budget": 1, "poll_budget": 4,
                           "apps": [{"id": "a", "weight": 1, "cqe_per_wqe": 2, "demand": 0.5,
                                     "facility": "kv", "facility_coeff": 1}]}]}"#,
        )
        .unwrap()
    }

    #[test]
    fn round_trips_through_problem() {
        let inst = sample();
        let p = inst.clone().into_problem().unwrap();
        assert_eq!(Instance::from_problem(&p), inst);
    }

    #[test]
    fn apps_may_list_several_facilities_or_none() {
        let inst = Instance::from_json(
            r#"{"alpha": 1, "beta": 0, "k": 2, "x_min": 0.01,
                "facilities": [{"id": "rx:h1", "capacity": 1}, {"id": "rx:h2", "capacity": 1}],
                "hosts": [{"id": "h1", "wqe_budget": 1, "poll_budget": 4,
                           "apps": [{"id": "a", "weight": 1, "cqe_per_wqe": 1, "demand": 0.5,
                                     "facilities": [{"id": "rx:h2", "coeff": 0.25},
                                                    {"id": "rx:h1", "coeff": 0.75}]},
                                    {"id": "b", "weight": 1, "cqe_per_wqe": 1, "demand": 0.5,
                                     "facilities": []}]}]}"#,
        )
        .unwrap();
        let p = inst.clone().into_problem().unwrap();
        assert_eq!(
            p.pairs[0].uses,
            vec![(0, 0.75), (1, 0.25)],
            "sorted by facility"
        );
        assert!(p.pairs[1].uses.is_empty());
        let again = Instance::from_problem(&p);
        assert_eq!(again.clone().into_problem().unwrap(), p);

        let mut both = inst.clone();
        both.hosts[0].apps[1].facility = Some("rx:h1".into());
        let e = both.into_problem().unwrap_err().to_string();
        assert!(
            e.contains("apps[1] (id \"b\"): give either facility"),
            "{e}"
        );
        let mut neither = inst.clone();
        neither.hosts[0].apps[1].facilities = None;
        let e = neither.into_problem().unwrap_err().to_string();
        assert!(e.contains("needs facility and facility_coeff"), "{e}");
        let mut twice = inst.clone();
        twice.hosts[0].apps[0].facilities.as_mut().unwrap()[0].id = "rx:h1".into();
        let e = twice.into_problem().unwrap_err().to_string();
        assert!(e.contains("lists a facility twice"), "{e}");
        let mut bad = inst;
        bad.hosts[0].apps[0].facilities.as_mut().unwrap()[1].coeff = f64::NAN;
        let e = bad.into_problem().unwrap_err().to_string();
        assert!(e.contains("apps[0] (id \"a\").facilities[1].coeff"), "{e}");
    }

    #[test]
    fn errors_name_the_place() {
        let mut inst = sample();
        inst.hosts[0].apps[0].weight = -1.0;
        let e = inst.into_problem().unwrap_err().to_string();
        assert!(
            e.contains("hosts[0] (id \"h1\").apps[0] (id \"a\").weight"),
            "{e}"
        );

        let mut inst = sample();
        inst.hosts[0].apps[0].facility = Some("nope".into());
        assert!(inst
            .into_problem()
            .unwrap_err()
            .to_string()
            .contains("no facility"));

        let mut inst = sample();
        inst.hosts[0].wqe_budget = 0.001;
        let e = inst.into_problem().unwrap_err().to_string();
        assert!(
            e.contains("host \"h1\" is infeasible") && e.contains("wqe_budget"),
            "{e}"
        );

        let e = Instance::from_json(r#"{"alpha": 1}"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("missing field"), "{e}");
        let e = Instance::from_json(r#"{"alpha": 1, "betta": 2}"#)
            .unwrap_err()
            .to_string();
        assert!(e.contains("unknown field"), "{e}");
    }
}
