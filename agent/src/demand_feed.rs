//! The shims' counters as the optimiser's demand (issue "the shim": "the agent turns the
//! counters into demand"): each round, the bytes every registered process of an app has sent
//! become that app's measured rate, and the pure rule of `drum_common::demand` turns it
//! into the demand cap `x̄` of this host's pair for the app; their completions per send WQE
//! become the pair's `a` (docs/design.md §3: "measured by the shim"), which sets the app's share
//! of the host's polling budget and its polling grant. Apps without a registered shim keep
//! the instance's values. The shims count payload; the measured rate is turned into wire
//! bytes with the app's mean WQE size (`drum_common::wire_cost`), as the rates are.

use crate::shim_hub::ShimHub;
use drum_common::demand::{
    cqe_per_wqe, demand_cap, Activity, CqeMeter, HeldBack, HeldMemory, NewApps, UsageMeter,
    WqeCounts,
};
use drum_common::live::{NEW_APP_CQE_PER_WQE, NEW_APP_DEMAND};
use drum_common::model::Problem;
use drum_common::protocol::agent::AgentCore;
use drum_table::profile::mean_wqe_bytes;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Rates are measured over at least this long, and smoothed.
const MIN_INTERVAL: Duration = Duration::from_millis(200);
const SMOOTHING: f64 = 0.5;

/// WQEs an app's shims deferred so far (cumulative), hold now, and have on the NIC now; and
/// its polls that found completions the polling grant held back (cumulative).
#[derive(Clone, Copy, Debug, Default)]
struct Held {
    deferred: u64,
    queued: u64,
    on_nic: u64,
    polls: u64,
}

impl Held {
    /// What held the app back since the `before` reading: its work, if its shims queue work
    /// now, deferred some since or it has a backlog on the NIC; else its completions, if its
    /// polling grant held some back since. The last one matters for an app that keeps one
    /// request in flight: it never queues, but at the floor rate its polling grant limits how
    /// many requests it completes; counted as satisfied, it stayed at the floor for good.
    /// `bytes_per_wqe`: the app's mean WQE size, where known.
    fn holds_back(&self, before: Option<Held>, bytes_per_wqe: Option<f64>) -> HeldBack {
        let bytes_on_nic = bytes_per_wqe.map_or(0.0, |b| self.on_nic as f64 * b);
        if self.queued > 0
            || self.on_nic >= NIC_BACKLOG
            || bytes_on_nic >= NIC_BACKLOG_BYTES
            || before.is_some_and(|b| self.deferred > b.deferred)
        {
            HeldBack::Work
        } else if before.is_some_and(|b| self.polls > b.polls) {
            HeldBack::Completions
        } else {
            HeldBack::No
        }
    }
}

/// WRs on the NIC from which an app counts as held back by the NIC rather than by its own
/// demand. A victim whose 64 KiB writes sat 127 deep in a NIC thrashed by another app's QPs
/// measured a rate far under its grant, so its demand cap fell to the floor and the optimiser
/// handed its share to the attacker (the testbed's isolation scenario). A latency-bound app
/// keeps one or two WRs in flight and stays below this.
const NIC_BACKLOG: u64 = 8;

/// Bytes on the NIC from which an app counts as held back by the NIC, however few its WRs:
/// a transfer of 1 MB READs two at a time (the testbed's tc2-flow) never had 8 WRs out, so
/// the rate the background left it was taken for its demand and the optimiser gave the
/// background 80 % of the link. 256 KiB is more than a latency-bound app keeps in flight and
/// about two bandwidth-delay products of a 100 Gb/s datacenter path (10 µs).
const NIC_BACKLOG_BYTES: f64 = 256.0 * 1024.0;

pub struct DemandFeed {
    hub: Arc<ShimHub>,
    meter: UsageMeter,
    cqes: CqeMeter,
    /// Completions polled per second, by app.
    polled: UsageMeter,
    /// The work each app's shims held back at the last reading.
    held: BTreeMap<String, Held>,
    /// When each app was last held back by its work.
    held_memory: HeldMemory,
    /// Apps that have not sent yet, connecting: their caps stay the new app's.
    new_apps: NewApps,
    /// This host's pairs with their demand caps and completions per WQE in the instance.
    instance: Vec<(usize, f64, f64)>,
    /// The largest `a` the host's problem admits (the live problem's floor feasibility).
    a_max: f64,
    /// A parked app's grant: its demand is measured against this trickle, so an app that
    /// wants little is worth as little parked as active (no park, re-select, park again),
    /// and one that fills its trickle shows that it wants more.
    parked_rate: f64,
    origin: Instant,
}

impl DemandFeed {
    /// `parked_rate` is what a parked app is granted (`[shim] parked_rate`).
    pub fn new(
        hub: Arc<ShimHub>,
        problem: &Problem,
        host: usize,
        line_gbps: f64,
        parked_rate: f64,
    ) -> DemandFeed {
        let instance = problem.hosts[host]
            .pairs
            .clone()
            .map(|p| (p, problem.pairs[p].demand, problem.pairs[p].cqe_per_wqe))
            .collect();
        DemandFeed {
            hub,
            meter: UsageMeter::new(line_gbps * 1e9 / 8.0, MIN_INTERVAL, SMOOTHING),
            cqes: CqeMeter::new(SMOOTHING),
            polled: UsageMeter::new(1.0, MIN_INTERVAL, SMOOTHING),
            held: BTreeMap::new(),
            held_memory: HeldMemory::default(),
            new_apps: NewApps::default(),
            instance,
            a_max: f64::INFINITY,
            parked_rate,
            origin: Instant::now(),
        }
    }

    /// Live problem: the host's problem was rebuilt. Every pair's cap is the new-app demand
    /// and its default `a` the new-app one (docs/live-problem.md); the meters, kept by app
    /// name, go on.
    pub fn rebase(&mut self, problem: &Problem, host: usize, a_max: f64) {
        self.instance = problem.hosts[host]
            .pairs
            .clone()
            .map(|p| (p, NEW_APP_DEMAND, NEW_APP_CQE_PER_WQE))
            .collect();
        self.a_max = a_max;
    }

    /// Reads the shims' counters and sets this host's demand caps in `problem`.
    pub fn update(&mut self, problem: &mut Problem, core: &AgentCore) {
        // Per app: bytes sent, WQEs and completions, the polling grant in force (the same
        // for every process of the app), and the work its shims hold back.
        let mut sent: BTreeMap<String, (u64, WqeCounts, u64, Held)> = BTreeMap::new();
        for u in self.hub.usage() {
            let (bytes, c, grant, held) = sent.entry(u.app).or_default();
            // Saturating: the counters are the shim's word, and a table full of garbage
            // must not overflow the sums of the app's other processes.
            *bytes = bytes.saturating_add(u.send_bytes);
            c.wqes = c.wqes.saturating_add(u.send_wqes);
            c.completions = c.completions.saturating_add(u.completions);
            *grant = (*grant).max(u.rate_cqe_per_s);
            held.deferred = held.deferred.saturating_add(u.deferred_wqes);
            held.queued = held.queued.saturating_add(u.queued_wqes);
            held.on_nic = held.on_nic.saturating_add(u.nic_outstanding_wqes);
            held.polls = held.polls.saturating_add(u.held_polls);
        }
        let now = self.origin.elapsed();
        let mut held_back = BTreeMap::new();
        let mut bytes_per_wqe = BTreeMap::new();
        for (app, (bytes, counts, _, held)) in &sent {
            let before = self.held.insert(app.clone(), *held);
            let per_wqe = mean_wqe_bytes(*bytes, counts.wqes);
            let seen = held.holds_back(before, per_wqe);
            held_back.insert(app.clone(), self.held_memory.verdict(app, seen, now));
            bytes_per_wqe.insert(app.as_str(), per_wqe);
        }
        self.held.retain(|a, _| sent.contains_key(a));
        self.held_memory.retain(|a| sent.contains_key(a));
        let wire = self.hub.wire_cost();
        let mut wire_factor = BTreeMap::new();
        for (app, (bytes, counts, ..)) in &sent {
            wire_factor.insert(app.as_str(), wire.factor(bytes_per_wqe[app.as_str()]));
            self.meter.observe(app, *bytes, now);
            self.cqes.observe(app, *counts);
            self.polled.observe(app, counts.completions, now);
        }
        self.meter.retain(|a| sent.contains_key(a));
        self.cqes.retain(|a| sent.contains_key(a));
        self.polled.retain(|a| sent.contains_key(a));
        self.new_apps.retain(|a| sent.contains_key(a));
        let connected: BTreeMap<String, u32> = self
            .hub
            .app_peers()
            .into_iter()
            .map(|(app, peers)| (app, peers.values().sum()))
            .collect();
        let hs = core.state();
        let x_min = problem.params.x_min;
        for &(p, cap, a) in &self.instance {
            let app = &problem.app_names[problem.pairs[p].app as usize];
            let granted = hs
                .active
                .binary_search(&p)
                .map_or(self.parked_rate, |i| hs.x[i]);
            let held = held_back.get(app).copied().unwrap_or(HeldBack::No);
            // The meter counts payload; the rates it is compared with are wire bytes.
            let factor = wire_factor.get(app.as_str()).copied().unwrap_or(1.0);
            let used = self.meter.rate(app).map(|r| r * factor);
            // Only apps with shims are measured, and can be new.
            let used = match sent.get(app) {
                Some((_, counts, ..)) => {
                    let seen = Activity {
                        posted: counts.wqes,
                        connected_qps: connected.get(app).copied().unwrap_or(0),
                    };
                    self.new_apps.measured(app, seen, used, now)
                }
                None => used,
            };
            let demand = demand_cap(cap, granted, used, x_min, held);
            let grant = sent.get(app).map(|s| s.2 as f64);
            let a = cqe_per_wqe(self.cqes.cqe_per_wqe(app), self.polled.rate(app), grant, a)
                .min(self.a_max);
            let pair = &mut problem.pairs[p];
            (pair.demand, pair.cqe_per_wqe) = (demand, a);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_app_is_held_back_by_its_shim_or_by_a_backlog_on_the_nic() {
        use HeldBack::{Completions, No, Work};
        let idle = Held::default();
        assert_eq!(idle.holds_back(Some(idle), None), No);
        let queued = Held { queued: 1, ..idle };
        assert_eq!(queued.holds_back(None, None), Work);
        let deferred = Held {
            deferred: 5,
            ..idle
        };
        assert_eq!(deferred.holds_back(Some(idle), None), Work);
        assert_eq!(
            deferred.holds_back(Some(deferred), None),
            No,
            "nothing deferred since"
        );
        // One or two WRs in flight: a latency-bound app, not held back.
        assert_eq!(Held { on_nic: 2, ..idle }.holds_back(Some(idle), None), No);
        // A send queue full on the NIC (perftest's 128): the NIC limits it, not its demand.
        let full = Held {
            on_nic: 127,
            ..idle
        };
        assert_eq!(full.holds_back(Some(idle), None), Work);
        // Two 1 MiB READs out: few WRs, but a backlog the NIC holds; two 4 KiB ones: none.
        let two = Held { on_nic: 2, ..idle };
        assert_eq!(two.holds_back(Some(idle), Some(1048576.0)), Work);
        assert_eq!(two.holds_back(Some(idle), Some(4096.0)), No);
        // Completions the polling grant held back since the last reading; work wins.
        let polls = Held { polls: 3, ..idle };
        assert_eq!(polls.holds_back(Some(idle), None), Completions);
        assert_eq!(polls.holds_back(Some(polls), None), No, "none held since");
        assert_eq!(Held { polls: 3, ..full }.holds_back(Some(idle), None), Work);
    }
}
