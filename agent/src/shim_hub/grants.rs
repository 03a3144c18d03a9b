//! What each registered process's table says: the app's grant (the optimiser's rate or an
//! operator's pin, the polling grant, the QP gate), and the process's part of it.

use super::{Conn, Decided, HubState, Shared, MAX_TRACKED_QPS};
use drum_common::demand::poll_grant;
use drum_common::process_share::{self, ProcessUse};
use drum_table::layout::{monotonic_ms, Grant, MAX_RATE_WQE};
use std::collections::BTreeMap;
use std::sync::atomic::Ordering::Relaxed;

impl Conn {
    /// The QPs the process holds. The table's count is the shim's word: bounded by what the
    /// agent would track, so a table of garbage claims no more than a process with that many.
    pub(super) fn qps_held(&self) -> u64 {
        let said = self.map.table().shim.qps.load(Relaxed);
        (self.qps.len() as u64).max(said.min(MAX_TRACKED_QPS as u64))
    }
}

/// Each registered process's part of its app's grant (`drum_common::process_share`), from
/// its QPs and its meter; `grants`: each app's whole payload byte grant (0: unlimited).
fn process_parts(st: &HubState, grants: &BTreeMap<&str, u64>) -> BTreeMap<u64, f64> {
    let mut apps: BTreeMap<&str, Vec<(u64, ProcessUse)>> = BTreeMap::new();
    for (&id, c) in &st.conns {
        let grant = grants.get(c.app.as_str()).copied().unwrap_or(0);
        let used = c
            .meter
            .used_bytes_per_s()
            .filter(|_| grant > 0)
            .map(|u| u / grant as f64);
        apps.entry(&c.app).or_default().push((
            id,
            ProcessUse {
                qps: c.qps_held(),
                part: c.part,
                used,
                held: c.meter.held(),
            },
        ));
    }
    let mut out = BTreeMap::new();
    for procs in apps.values() {
        let uses: Vec<ProcessUse> = procs.iter().map(|p| p.1).collect();
        for (&(id, _), part) in procs.iter().zip(process_share::process_parts(&uses)) {
            out.insert(id, part);
        }
    }
    out
}

/// A process's grant: its `part` of its app's rates. The QP gate is its own already; the
/// burst stays whole (a burst under one WQE's size would hold that WQE back).
fn part_of_grant(app: &Grant, part: f64) -> Grant {
    use process_share::part_of_rate;
    Grant {
        rate_bytes_per_s: part_of_rate(app.rate_bytes_per_s, part),
        rate_wqe_per_s: part_of_rate(app.rate_wqe_per_s, part),
        rate_cqe_per_s: part_of_rate(app.rate_cqe_per_s, part),
        ..*app
    }
}

impl Shared {
    /// Publishes every process's grant (after a decision, a change of who holds QPs, or a
    /// new reading of the processes' use): its part of its app's.
    pub(super) fn publish_all(&self, st: &mut HubState) {
        let gates = self.qp_gates(st);
        let wholes: BTreeMap<u64, Grant> = st
            .conns
            .iter()
            .map(|(&id, c)| (id, self.grant_for(st, &c.app, gates.get(&id).copied())))
            .collect();
        let grants: BTreeMap<&str, u64> = st
            .conns
            .iter()
            .map(|(id, c)| (c.app.as_str(), wholes[id].rate_bytes_per_s))
            .collect();
        let parts = process_parts(st, &grants);
        for (id, c) in st.conns.iter_mut() {
            c.part = parts.get(id).copied().unwrap_or(1.0);
            c.map
                .table()
                .publish(&part_of_grant(&wholes[id], c.part), monotonic_ms());
        }
    }

    /// Each process's share of the host's QP budget (empty without one): the apps' gates by
    /// weight over the QPs they hold, each app's gate split among its processes alike.
    pub(super) fn qp_gates(&self, st: &HubState) -> BTreeMap<u64, u64> {
        use drum_common::qp_share::{qp_gates, QpDemand};
        let budget = self.settings.qp_budget;
        if budget == 0 {
            return BTreeMap::new();
        }
        let mut apps: BTreeMap<&str, Vec<(u64, u64)>> = BTreeMap::new();
        for (&id, c) in &st.conns {
            apps.entry(&c.app).or_default().push((id, c.qps_held()));
        }
        let demands: Vec<QpDemand> = apps
            .iter()
            .map(|(app, procs)| QpDemand {
                weight: st.weight(app),
                qps: procs.iter().map(|p| p.1).sum(),
            })
            .collect();
        let mut out = BTreeMap::new();
        for (procs, gate) in apps.values().zip(qp_gates(budget, &demands)) {
            let alike: Vec<QpDemand> = procs
                .iter()
                .map(|&(_, qps)| QpDemand { weight: 1.0, qps })
                .collect();
            for (&(id, _), g) in procs.iter().zip(qp_gates(gate, &alike)) {
                out.insert(id, g);
            }
        }
        out
    }

    /// `gate`: the process's share of the host's QP budget, if there is one.
    pub(super) fn grant_for(&self, st: &HubState, app: &str, gate: Option<u64>) -> Grant {
        let s = &self.settings;
        let pin = s.apps.get(app).cloned().unwrap_or_default();
        let decided = st.optimiser.get(app).copied();
        // The optimiser's rates are wire bytes, a pin is payload (docs/live-problem.md).
        let wire = |d: &Decided| s.wire_cost().factor(d.bytes_per_wqe);
        let payload = pin.rate.or(decided.map(|d| d.rate / wire(&d)));
        // The optimiser's polling rate `a·x`, unless the operator fixed the app's rate (then
        // only a polling pin meters its completions).
        let polling = || {
            let d = decided.filter(|_| pin.rate.is_none())?;
            let wire_per_wqe = d.bytes_per_wqe.map(|b| b * wire(&d));
            poll_grant(d.rate, d.cqe_per_wqe, s.line_rate_bytes(), wire_per_wqe)
        };
        Grant {
            rate_bytes_per_s: payload.map_or(0, |f| (f * s.line_rate_bytes()).round() as u64),
            rate_wqe_per_s: pin.rate_wqe_per_s.unwrap_or(0),
            rate_cqe_per_s: pin
                .rate_cqe_per_s
                .or_else(polling)
                .map_or(0, |r| r.min(MAX_RATE_WQE)),
            max_active_qps: pin
                .max_active_qps
                .unwrap_or(match (s.max_active_qps, gate) {
                    (0, g) => g.unwrap_or(0),
                    (k, g) => g.map_or(k, |g| g.min(k)),
                }),
            quantum_us: s.quantum_us,
            long_msg_bytes: s.long_msg_bytes,
            ..Grant::default()
        }
    }
}
