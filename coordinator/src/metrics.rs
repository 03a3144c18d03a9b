//! The coordinator's metrics (`GET /metrics`), in the OpenMetrics text format of the
//! `prometheus-client` crate.
//!
//! Two sources: the state machine's own counts ([`Status`], kept by the pure protocol core,
//! which knows nothing of metrics libraries) are read at each scrape into constant metrics;
//! what only the transport sees (refused handshakes and frames, round times) lives here in
//! typed counters and a histogram that the service updates as it happens.

use drum_common::protocol::coordinator::Status;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::Duration;

/// Round-time histogram bucket bounds, seconds.
const BUCKETS: [f64; 10] = [
    0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
];

/// How many recent round times the quantiles are computed over.
const RECENT: usize = 2048;

/// What the transport counts, and round times.
#[derive(Debug)]
pub struct Metrics {
    recent: Mutex<VecDeque<Duration>>,
    pub refused_handshakes: Counter,
    pub refused_frames: Counter,
    pub refused_joins: Counter,
    round_seconds: Histogram,
    stale_rounds: Counter,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            recent: Mutex::default(),
            refused_handshakes: Counter::default(),
            refused_frames: Counter::default(),
            refused_joins: Counter::default(),
            round_seconds: Histogram::new(BUCKETS),
            stale_rounds: Counter::default(),
        }
    }
}

impl Metrics {
    pub fn record_round(&self, took: Duration, stale: usize) {
        self.round_seconds.observe(took.as_secs_f64());
        if stale > 0 {
            self.stale_rounds.inc();
        }
        let mut r = self.recent.lock().unwrap_or_else(|e| e.into_inner());
        if r.len() == RECENT {
            r.pop_front();
        }
        r.push_back(took);
    }

    /// Quantiles `qs` of the last [`RECENT`] round times (empty before the first round).
    pub fn round_quantiles(&self, qs: &[f64]) -> Vec<Duration> {
        let mut v: Vec<Duration> = self
            .recent
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .copied()
            .collect();
        if v.is_empty() {
            return Vec::new();
        }
        v.sort_unstable();
        qs.iter()
            .map(|q| v[((q * (v.len() - 1) as f64).round() as usize).min(v.len() - 1)])
            .collect()
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FacilityLabel {
    facility: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct QuantileLabel {
    quantile: String,
}

/// The state machine's snapshot, encoded at scrape time.
#[derive(Debug)]
struct Snapshot {
    status: Status,
    quantiles: Vec<(f64, Duration)>,
}

impl Collector for Snapshot {
    fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let s = &self.status;
        let gauges: [(&str, &str, i64); 3] = [
            (
                "drum_coordinator_members",
                "Hosts currently members.",
                s.members.len() as i64,
            ),
            (
                "drum_coordinator_epoch",
                "Current membership epoch.",
                s.epoch as i64,
            ),
            (
                "drum_coordinator_iteration",
                "Completed ADMM iterations.",
                s.iteration as i64,
            ),
        ];
        for (name, help, v) in gauges {
            let g = ConstGauge::new(v);
            g.encode(enc.encode_descriptor(name, help, None, g.metric_type())?)?;
        }
        for (name, help, v) in [
            (
                "drum_coordinator_primal_residual",
                "Relative primal residual of the last round.",
                s.primal_residual,
            ),
            (
                "drum_coordinator_dual_residual",
                "Relative dual residual of the last round.",
                s.dual_residual,
            ),
        ] {
            let g = ConstGauge::new(v);
            g.encode(enc.encode_descriptor(name, help, None, g.metric_type())?)?;
        }
        let c = &s.counters;
        // Counter names without `_total`: the encoder appends it.
        for (name, help, v) in [
            ("drum_coordinator_rounds", "Completed rounds.", c.rounds),
            (
                "drum_coordinator_stale_reuses",
                "Straggler contributions reused.",
                c.stale_reuses,
            ),
            ("drum_coordinator_late", "Late contributions.", c.late),
            (
                "drum_coordinator_selection_exchanges",
                "Selection exchanges completed (the priced restart included).",
                c.exchanges,
            ),
            (
                "drum_coordinator_selection_parks",
                "Active pairs parked by selection rounds.",
                c.parks,
            ),
            (
                "drum_coordinator_selection_activations",
                "Pairs activated by selection rounds.",
                c.activations,
            ),
            (
                "drum_coordinator_selection_refused_activations",
                "Activations refused because the facility could not carry one more pair at x_min.",
                c.refused_activations,
            ),
            (
                "drum_coordinator_reselect_requests",
                "Re-selections agents asked for because their apps arrived or left.",
                c.reselect_requests,
            ),
            (
                "drum_coordinator_input_changes",
                "Material changes of agents' inputs (weight, demand cap, a), which allow the next periodic re-selection.",
                c.changes,
            ),
            (
                "drum_coordinator_duplicates",
                "Duplicate contributions.",
                c.duplicates,
            ),
            (
                "drum_coordinator_member_timeouts",
                "Members dropped after the heartbeat timeout.",
                c.timeouts,
            ),
            (
                "drum_coordinator_duplicate_joins",
                "Joins refused because their host was a member on another live connection (two agents with one host id).",
                c.duplicate_joins,
            ),
            (
                "drum_coordinator_refused",
                "Protocol refusals (bad join, violations).",
                c.refused,
            ),
        ] {
            let m = ConstCounter::new(v);
            m.encode(enc.encode_descriptor(name, help, None, m.metric_type())?)?;
        }
        // OpenMetrics has no summary type in this crate: the recent quantiles are gauges
        // labelled `quantile`, as a summary's samples would be.
        let mut q = enc.encode_descriptor(
            "drum_coordinator_round_recent_seconds",
            &format!("Round time quantiles over the last {RECENT} rounds."),
            None,
            prometheus_client::metrics::MetricType::Gauge,
        )?;
        for (quantile, v) in &self.quantiles {
            let label = QuantileLabel {
                quantile: quantile.to_string(),
            };
            ConstGauge::new(v.as_secs_f64()).encode(q.encode_family(&label)?)?;
        }
        let mut p = enc.encode_descriptor(
            "drum_coordinator_facility_price",
            "Price of each facility.",
            None,
            prometheus_client::metrics::MetricType::Gauge,
        )?;
        for f in &s.facilities {
            let label = FacilityLabel {
                facility: f.id.clone(),
            };
            ConstGauge::new(f.price).encode(p.encode_family(&label)?)?;
        }
        Ok(())
    }
}

/// The metrics text: the state machine's `status` and the transport's `metrics`.
pub fn render(status: Status, m: &Metrics) -> String {
    let qs = [0.5, 0.9, 0.99];
    let quantiles = qs.iter().copied().zip(m.round_quantiles(&qs)).collect();
    let mut reg = Registry::default();
    reg.register_collector(Box::new(Snapshot { status, quantiles }));
    reg.register(
        "drum_coordinator_stale_rounds",
        "Rounds completed with a straggler's contribution reused.",
        m.stale_rounds.clone(),
    );
    reg.register(
        "drum_coordinator_refused_handshakes",
        "TLS/QUIC handshakes refused.",
        m.refused_handshakes.clone(),
    );
    reg.register(
        "drum_coordinator_refused_frames",
        "Connections closed for a bad frame.",
        m.refused_frames.clone(),
    );
    reg.register(
        "drum_coordinator_refused_joins",
        "Joins refused because the client certificate does not name the host.",
        m.refused_joins.clone(),
    );
    reg.register(
        "drum_coordinator_round_seconds",
        "Time from a round's start to its update.",
        m.round_seconds.clone(),
    );
    let mut out = String::new();
    // Writing to a String cannot fail.
    let _ = prometheus_client::encoding::text::encode(&mut out, &reg);
    out
}
