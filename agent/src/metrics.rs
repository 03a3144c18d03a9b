//! The agent's Prometheus endpoint (`metrics_listen`): liveness, rounds, reconnections,
//! fail-static transitions and time spent in the host step; with `[shim]` and `[dasr]`, the
//! shim link's and DASR's metrics too.

use drum_coordinator::admin::{self, AdminRequest, Reply};
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

#[derive(Debug, Default)]
pub struct AgentMetrics {
    pub live: AtomicU64,
    pub epoch: AtomicU64,
    pub iteration: AtomicU64,
    pub rounds: AtomicU64,
    pub connects: AtomicU64,
    pub connect_failures: AtomicU64,
    pub fail_static: AtomicU64,
    /// Established connections closed because a TLS reload no longer accepts the
    /// coordinator's certificate.
    pub refused_coordinators: AtomicU64,
    /// Selection exchanges applied (the priced restart included).
    pub exchanges: AtomicU64,
    /// This host's apps parked and activated by selection rounds (each swap refills the NIC's
    /// QP cache).
    pub parks: AtomicU64,
    pub activations: AtomicU64,
    /// Time spent handling coordinator messages (almost all of it the x-step).
    pub handle_ns: AtomicU64,
    /// Whether the last write of the rate table succeeded (1) or failed (0), and the failed
    /// writes (each retry counts).
    pub table_ok: AtomicU64,
    pub table_write_failures: AtomicU64,
}

impl AgentMetrics {
    pub fn render(&self, host: &str) -> String {
        let host = host.replace('\\', "\\\\").replace('"', "\\\"");
        let mut o = String::new();
        let mut line = |name: &str, kind: &str, help: &str, v: f64| {
            let _ = writeln!(
                o,
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name}{{host=\"{host}\"}} {v}"
            );
        };
        line(
            "drum_agent_live",
            "gauge",
            "1 while a member of the coordinator, 0 while fail-static.",
            self.live.load(Relaxed) as f64,
        );
        line(
            "drum_agent_epoch",
            "gauge",
            "Epoch of the last round or welcome.",
            self.epoch.load(Relaxed) as f64,
        );
        line(
            "drum_agent_iteration",
            "gauge",
            "Iteration of the last round stepped.",
            self.iteration.load(Relaxed) as f64,
        );
        line(
            "drum_agent_rounds_total",
            "counter",
            "Rounds stepped.",
            self.rounds.load(Relaxed) as f64,
        );
        line(
            "drum_agent_connects_total",
            "counter",
            "Connections established to the coordinator.",
            self.connects.load(Relaxed) as f64,
        );
        line(
            "drum_agent_connect_failures_total",
            "counter",
            "Failed connection attempts (refused handshake, unreachable, timeout).",
            self.connect_failures.load(Relaxed) as f64,
        );
        line(
            "drum_agent_fail_static_total",
            "counter",
            "Transitions to fail-static.",
            self.fail_static.load(Relaxed) as f64,
        );
        line(
            "drum_agent_refused_coordinators_total",
            "counter",
            "Connections closed because a TLS reload no longer accepts the coordinator's certificate.",
            self.refused_coordinators.load(Relaxed) as f64,
        );
        line(
            "drum_agent_selection_exchanges_total",
            "counter",
            "Selection exchanges applied to the active set (the priced restart included).",
            self.exchanges.load(Relaxed) as f64,
        );
        line(
            "drum_agent_selection_parks_total",
            "counter",
            "This host's apps parked by selection rounds.",
            self.parks.load(Relaxed) as f64,
        );
        line(
            "drum_agent_selection_activations_total",
            "counter",
            "This host's apps activated by selection rounds.",
            self.activations.load(Relaxed) as f64,
        );
        line(
            "drum_agent_rate_table_ok",
            "gauge",
            "0 while writing the rate table fails (it is retried), 1 otherwise.",
            self.table_ok.load(Relaxed) as f64,
        );
        line(
            "drum_agent_rate_table_write_failures_total",
            "counter",
            "Failed writes of the rate table (each retry counts).",
            self.table_write_failures.load(Relaxed) as f64,
        );
        line(
            "drum_agent_step_seconds_total",
            "counter",
            "Time spent handling coordinator messages, mostly the x-step.",
            self.handle_ns.load(Relaxed) as f64 * 1e-9,
        );
        o
    }
}

/// Serves `GET /metrics` (the agent's metrics, then whatever `more` renders); anything else
/// is answered 404.
pub async fn serve(
    listener: tokio::net::TcpListener,
    metrics: Arc<AgentMetrics>,
    host: String,
    more: impl Fn() -> String + Send + Sync + 'static,
) {
    let more = Arc::new(more);
    admin::serve(listener, move |req| {
        let body = metrics.render(&host) + &more();
        async move {
            Some(match req {
                AdminRequest::Metrics => Reply {
                    code: 200,
                    content_type: "text/plain; version=0.0.4",
                    body,
                },
                _ => Reply {
                    code: 404,
                    content_type: "text/plain",
                    body: "only GET /metrics here\n".into(),
                },
            })
        }
    })
    .await
}
