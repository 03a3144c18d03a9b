//! The shims' counters as the optimiser's demand (issue "the shim": "the agent turns the
//! counters into demand"): each round, the bytes every registered process of an app has sent
//! become that app's measured rate, and the pure rule of `drum_common::demand` turns it
//! into the demand cap `x̄` of this host's pair for the app. Apps without a registered shim
//! keep the instance's cap.

use crate::shim_hub::ShimHub;
use drum_common::demand::{demand_cap, UsageMeter};
use drum_common::model::Problem;
use drum_common::protocol::agent::AgentCore;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Rates are measured over at least this long, and smoothed.
const MIN_INTERVAL: Duration = Duration::from_millis(200);
const SMOOTHING: f64 = 0.5;

pub struct DemandFeed {
    hub: Arc<ShimHub>,
    meter: UsageMeter,
    /// This host's pairs and their demand caps in the instance.
    instance_caps: Vec<(usize, f64)>,
    origin: Instant,
}

impl DemandFeed {
    pub fn new(hub: Arc<ShimHub>, problem: &Problem, host: usize, line_gbps: f64) -> DemandFeed {
        let instance_caps = problem.hosts[host]
            .pairs
            .clone()
            .map(|p| (p, problem.pairs[p].demand))
            .collect();
        DemandFeed {
            hub,
            meter: UsageMeter::new(line_gbps * 1e9 / 8.0, MIN_INTERVAL, SMOOTHING),
            instance_caps,
            origin: Instant::now(),
        }
    }

    /// Reads the shims' counters and sets this host's demand caps in `problem`.
    pub fn update(&mut self, problem: &mut Problem, core: &AgentCore) {
        let mut sent: BTreeMap<String, u64> = BTreeMap::new();
        for u in self.hub.usage() {
            *sent.entry(u.app).or_default() += u.send_bytes;
        }
        let now = self.origin.elapsed();
        for (app, bytes) in &sent {
            self.meter.observe(app, *bytes, now);
        }
        self.meter.retain(|a| sent.contains_key(a));
        let hs = core.state();
        let x_min = problem.params.x_min;
        for &(p, cap) in &self.instance_caps {
            let app = &problem.app_names[problem.pairs[p].app as usize];
            let granted = hs.active.binary_search(&p).map_or(0.0, |i| hs.x[i]);
            problem.pairs[p].demand = demand_cap(cap, granted, self.meter.rate(app), x_min);
        }
    }
}
