//! The agent's metrics endpoint (`metrics_listen`, `GET /metrics`, OpenMetrics text of the
//! `prometheus-client` crate): liveness, rounds, reconnections, fail-static transitions and
//! time spent in the host step; with `[shim]` and `[dasr]`, the shim link's and DASR's
//! metrics too. Every series carries the label `host`.

use drum_net::http::{self, Limits, Reply, OPENMETRICS};
use prometheus_client::collector::Collector;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

/// The agent's own metrics, updated where things happen; clones of these handles share their
/// values, so the registry holds the same counters.
#[derive(Debug, Default)]
pub struct AgentMetrics {
    pub live: Gauge,
    pub epoch: Gauge,
    pub iteration: Gauge,
    pub rounds: Counter,
    pub connects: Counter,
    pub connect_failures: Counter,
    pub fail_static: Counter,
    /// Established connections closed because a TLS reload no longer accepts the
    /// coordinator's certificate.
    pub refused_coordinators: Counter,
    /// Selection exchanges applied (the priced restart included).
    pub exchanges: Counter,
    /// This host's apps parked and activated by selection rounds (each swap refills the NIC's
    /// QP cache).
    pub parks: Counter,
    pub activations: Counter,
    /// Time spent handling coordinator messages (almost all of it the x-step), seconds.
    pub step_seconds: Counter<f64, AtomicU64>,
    /// Whether the last write of the rate table succeeded (1) or failed (0), and the failed
    /// writes (each retry counts).
    pub table_ok: Gauge,
    pub table_write_failures: Counter,
}

impl AgentMetrics {
    /// A registry of these metrics labelled `host`, and of `more` (the shim link's and
    /// DASR's collectors, when configured).
    pub fn registry(&self, host: &str, more: Vec<Box<dyn Collector>>) -> Registry {
        let mut r = Registry::with_labels([("host".into(), host.to_string().into())].into_iter());
        // Counter names without `_total`: the encoder appends it.
        let gauges = [
            (
                "drum_agent_live",
                "1 while a member of the coordinator, 0 while fail-static.",
                &self.live,
            ),
            (
                "drum_agent_epoch",
                "Epoch of the last round or welcome.",
                &self.epoch,
            ),
            (
                "drum_agent_iteration",
                "Iteration of the last round stepped.",
                &self.iteration,
            ),
            (
                "drum_agent_rate_table_ok",
                "0 while writing the rate table fails (it is retried), 1 otherwise.",
                &self.table_ok,
            ),
        ];
        for (name, help, g) in gauges {
            r.register(name, help, g.clone());
        }
        let counters = [
            ("drum_agent_rounds", "Rounds stepped.", &self.rounds),
            (
                "drum_agent_connects",
                "Connections established to the coordinator.",
                &self.connects,
            ),
            (
                "drum_agent_connect_failures",
                "Failed connection attempts (refused handshake, unreachable, timeout).",
                &self.connect_failures,
            ),
            (
                "drum_agent_fail_static",
                "Transitions to fail-static.",
                &self.fail_static,
            ),
            (
                "drum_agent_refused_coordinators",
                "Connections closed because a TLS reload no longer accepts the coordinator's certificate.",
                &self.refused_coordinators,
            ),
            (
                "drum_agent_selection_exchanges",
                "Selection exchanges applied to the active set (the priced restart included).",
                &self.exchanges,
            ),
            (
                "drum_agent_selection_parks",
                "This host's apps parked by selection rounds.",
                &self.parks,
            ),
            (
                "drum_agent_selection_activations",
                "This host's apps activated by selection rounds.",
                &self.activations,
            ),
            (
                "drum_agent_rate_table_write_failures",
                "Failed writes of the rate table (each retry counts).",
                &self.table_write_failures,
            ),
        ];
        for (name, help, c) in counters {
            r.register(name, help, c.clone());
        }
        r.register(
            "drum_agent_step_seconds",
            "Time spent handling coordinator messages, mostly the x-step.",
            self.step_seconds.clone(),
        );
        for c in more {
            r.register_collector(c);
        }
        r
    }
}

/// The registry's text.
pub fn render(registry: &Registry) -> String {
    let mut out = String::new();
    // Writing to a String cannot fail.
    let _ = prometheus_client::encoding::text::encode(&mut out, registry);
    out
}

/// Serves `GET /metrics` (the registry's text); anything else is answered 404.
pub async fn serve(listener: tokio::net::TcpListener, registry: Arc<Registry>) {
    http::serve(listener, Limits::default(), move |req, _peer| {
        let registry = registry.clone();
        async move {
            if (req.method.as_str(), req.target.as_str()) == ("GET", "/metrics") {
                Reply {
                    code: 200,
                    content_type: OPENMETRICS,
                    body: render(&registry),
                }
            } else {
                Reply::text(404, "only GET /metrics here\n".into())
            }
        }
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn series_carry_the_host_and_counters_end_in_total() {
        let m = AgentMetrics::default();
        m.live.set(1);
        m.rounds.inc_by(3);
        m.step_seconds.inc_by(0.5);
        let text = render(&m.registry("h\"1", Vec::new()));
        assert!(
            text.contains("drum_agent_live{host=\"h\\\"1\"} 1\n"),
            "{text}"
        );
        assert!(
            text.contains("drum_agent_rounds_total{host=\"h\\\"1\"} 3\n"),
            "{text}"
        );
        assert!(
            text.contains("# TYPE drum_agent_rounds counter\n"),
            "{text}"
        );
        assert!(
            text.contains("drum_agent_step_seconds_total{host=\"h\\\"1\"} 0.5\n"),
            "{text}"
        );
        assert!(text.ends_with("# EOF\n"), "{text}");
    }
}
