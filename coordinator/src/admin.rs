//! The coordinator's admin endpoint: a deliberately tiny HTTP/1.0 server (one request per
//! connection) for `GET /metrics` (Prometheus text format), `GET /status` (JSON),
//! `GET /snapshot` (the live problem as an instance file) and the operator's changes
//! `POST /set-capacity?facility=F&value=Y`, `POST /set-weight?app=A&value=W`, `POST /drain?host=H`,
//! `POST /undrain?host=H`, plus the clients the operator CLI uses.
//!
//! Who may change the coordinator is decided by the file permissions of a Unix socket
//! ([`serve_unix`], `admin_socket`): only it takes changes. The TCP endpoint ([`serve`],
//! `admin_listen`) has no authentication, so it answers reads only and refuses every change
//! with 403 — any local user, or a web page in a local browser (a cross-origin POST needs no
//! permission), could otherwise drain hosts.

use drum_common::protocol::coordinator::Coordinator;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tracing::debug;

#[derive(Clone, Debug, PartialEq)]
pub enum AdminRequest {
    Metrics,
    Status,
    /// The live problem as an instance file (`snapshot`).
    Snapshot,
    SetCapacity {
        facility: String,
        capacity: f64,
    },
    SetWeight {
        app: String,
        weight: f64,
    },
    Drain {
        host: String,
    },
    Undrain {
        host: String,
    },
}

impl AdminRequest {
    /// Whether the request changes the coordinator (an operator command).
    pub fn is_change(&self) -> bool {
        matches!(
            self,
            AdminRequest::SetCapacity { .. }
                | AdminRequest::SetWeight { .. }
                | AdminRequest::Drain { .. }
                | AdminRequest::Undrain { .. }
        )
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct Reply {
    pub code: u16,
    pub content_type: &'static str,
    pub body: String,
}

/// Round-time histogram bucket bounds, seconds.
const BUCKETS: [f64; 10] = [
    0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
];

/// How many recent round times the quantiles are computed over.
const RECENT: usize = 2048;

/// Transport-level counters the state machine does not see, and round times.
#[derive(Debug, Default)]
pub struct Metrics {
    recent: std::sync::Mutex<std::collections::VecDeque<Duration>>,
    pub refused_handshakes: AtomicU64,
    pub refused_frames: AtomicU64,
    pub refused_joins: AtomicU64,
    round_buckets: [AtomicU64; BUCKETS.len()],
    round_count: AtomicU64,
    round_sum_ns: AtomicU64,
    stale_rounds: AtomicU64,
}

impl Metrics {
    pub fn record_round(&self, took: Duration, stale: usize) {
        let s = took.as_secs_f64();
        for (b, bound) in self.round_buckets.iter().zip(BUCKETS) {
            if s <= bound {
                b.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.round_count.fetch_add(1, Ordering::Relaxed);
        self.round_sum_ns
            .fetch_add(took.as_nanos() as u64, Ordering::Relaxed);
        if stale > 0 {
            self.stale_rounds.fetch_add(1, Ordering::Relaxed);
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

fn text(code: u16, body: String) -> Reply {
    Reply {
        code,
        content_type: "text/plain",
        body,
    }
}

/// Answers one request against the live state machine; `drain` carries out a drain's actions
/// (closing the host's connection) in the caller.
pub fn answer(
    core: &mut Coordinator,
    metrics: &Metrics,
    req: AdminRequest,
    now: Duration,
) -> (Reply, Vec<drum_common::protocol::coordinator::Action>) {
    if let AdminRequest::Drain { host } = &req {
        let member = core.is_member(host);
        return match core.drain(now, host) {
            Ok(actions) if member => (
                text(
                    200,
                    format!("host {host} drained: removed, its joins are refused\n"),
                ),
                actions,
            ),
            Ok(actions) => (
                text(
                    200,
                    format!("host {host} drained: not a member now, its joins are refused\n"),
                ),
                actions,
            ),
            Err(e) => (text(400, format!("{e}\n")), Vec::new()),
        };
    }
    if let AdminRequest::SetWeight { app, weight } = &req {
        return match core.set_weight(app, *weight) {
            Ok(actions) => (
                text(200, format!("weight of {app} set to {weight}\n")),
                actions,
            ),
            Err(e) => (text(400, format!("{e}\n")), Vec::new()),
        };
    }
    (answer_simple(core, metrics, req), Vec::new())
}

fn answer_simple(core: &mut Coordinator, metrics: &Metrics, req: AdminRequest) -> Reply {
    match req {
        AdminRequest::Drain { .. } | AdminRequest::SetWeight { .. } => {
            unreachable!("handled by answer")
        }
        AdminRequest::Undrain { host } => {
            if core.undrain(&host) {
                text(200, format!("host {host} may join again\n"))
            } else {
                text(400, format!("host {host:?} is not drained\n"))
            }
        }
        AdminRequest::Status => Reply {
            code: 200,
            content_type: "application/json",
            body: serde_json::to_string_pretty(&core.status()).expect("status serialises"),
        },
        AdminRequest::Snapshot => match core.snapshot() {
            Some(inst) => Reply {
                code: 200,
                content_type: "application/json",
                body: inst.to_json(),
            },
            None => text(
                400,
                "this coordinator runs an instance file, not the live problem: that file is its problem\n".into(),
            ),
        },
        AdminRequest::Metrics => Reply {
            code: 200,
            content_type: "text/plain; version=0.0.4",
            body: prometheus(core, metrics),
        },
        AdminRequest::SetCapacity { facility, capacity } => {
            match core.set_capacity(&facility, capacity) {
                Ok(()) => Reply {
                    code: 200,
                    content_type: "text/plain",
                    body: format!("capacity of {facility} set to {capacity}\n"),
                },
                Err(e) => Reply {
                    code: 400,
                    content_type: "text/plain",
                    body: format!("{e}\n"),
                },
            }
        }
    }
}

fn prometheus(core: &Coordinator, m: &Metrics) -> String {
    use std::fmt::Write;
    let s = core.status();
    let c = &s.counters;
    let mut o = String::new();
    let mut gauge = |name: &str, help: &str, v: f64| {
        let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
    };
    gauge(
        "drum_coordinator_members",
        "Hosts currently members.",
        s.members.len() as f64,
    );
    gauge(
        "drum_coordinator_epoch",
        "Current membership epoch.",
        s.epoch as f64,
    );
    gauge(
        "drum_coordinator_iteration",
        "Completed ADMM iterations.",
        s.iteration as f64,
    );
    gauge(
        "drum_coordinator_primal_residual",
        "Relative primal residual of the last round.",
        s.primal_residual,
    );
    gauge(
        "drum_coordinator_dual_residual",
        "Relative dual residual of the last round.",
        s.dual_residual,
    );
    let mut counter = |name: &str, help: &str, v: u64| {
        let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}");
    };
    counter(
        "drum_coordinator_rounds_total",
        "Completed rounds.",
        c.rounds,
    );
    counter(
        "drum_coordinator_stale_reuses_total",
        "Straggler contributions reused.",
        c.stale_reuses,
    );
    counter(
        "drum_coordinator_stale_rounds_total",
        "Rounds completed with a straggler's contribution reused.",
        m.stale_rounds.load(Ordering::Relaxed),
    );
    counter("drum_coordinator_late_total", "Late contributions.", c.late);
    counter(
        "drum_coordinator_selection_exchanges_total",
        "Selection exchanges completed (the priced restart included).",
        c.exchanges,
    );
    counter(
        "drum_coordinator_selection_parks_total",
        "Active pairs parked by selection rounds.",
        c.parks,
    );
    counter(
        "drum_coordinator_selection_activations_total",
        "Pairs activated by selection rounds.",
        c.activations,
    );
    counter(
        "drum_coordinator_selection_refused_activations_total",
        "Activations refused because the facility could not carry one more pair at x_min.",
        c.refused_activations,
    );
    counter(
        "drum_coordinator_reselect_requests_total",
        "Re-selections agents asked for because their apps arrived or left.",
        c.reselect_requests,
    );
    counter(
        "drum_coordinator_input_changes_total",
        "Material changes of agents' inputs (weight, demand cap, a), which allow the next periodic re-selection.",
        c.changes,
    );
    counter(
        "drum_coordinator_duplicates_total",
        "Duplicate contributions.",
        c.duplicates,
    );
    counter(
        "drum_coordinator_member_timeouts_total",
        "Members dropped after the heartbeat timeout.",
        c.timeouts,
    );
    counter(
        "drum_coordinator_duplicate_joins_total",
        "Joins refused because their host was a member on another live connection (two agents with one host id).",
        c.duplicate_joins,
    );
    counter(
        "drum_coordinator_refused_total",
        "Protocol refusals (bad join, violations).",
        c.refused,
    );
    counter(
        "drum_coordinator_refused_handshakes_total",
        "TLS/QUIC handshakes refused.",
        m.refused_handshakes.load(Ordering::Relaxed),
    );
    counter(
        "drum_coordinator_refused_frames_total",
        "Connections closed for a bad frame.",
        m.refused_frames.load(Ordering::Relaxed),
    );
    counter(
        "drum_coordinator_refused_joins_total",
        "Joins refused because the client certificate does not name the host.",
        m.refused_joins.load(Ordering::Relaxed),
    );
    let _ = writeln!(o, "# HELP drum_coordinator_round_seconds Time from a round's start to its update.\n# TYPE drum_coordinator_round_seconds histogram");
    for (b, bound) in m.round_buckets.iter().zip(BUCKETS) {
        let _ = writeln!(
            o,
            "drum_coordinator_round_seconds_bucket{{le=\"{bound}\"}} {}",
            b.load(Ordering::Relaxed)
        );
    }
    let n = m.round_count.load(Ordering::Relaxed);
    let _ = writeln!(
        o,
        "drum_coordinator_round_seconds_bucket{{le=\"+Inf\"}} {n}"
    );
    let _ = writeln!(
        o,
        "drum_coordinator_round_seconds_sum {}",
        m.round_sum_ns.load(Ordering::Relaxed) as f64 * 1e-9
    );
    let _ = writeln!(o, "drum_coordinator_round_seconds_count {n}");
    let qs = [0.5, 0.9, 0.99];
    let _ = writeln!(o, "# HELP drum_coordinator_round_recent_seconds Round time quantiles over the last {RECENT} rounds.\n# TYPE drum_coordinator_round_recent_seconds summary");
    for (q, v) in qs.iter().zip(m.round_quantiles(&qs)) {
        let _ = writeln!(
            o,
            "drum_coordinator_round_recent_seconds{{quantile=\"{q}\"}} {}",
            v.as_secs_f64()
        );
    }
    let _ = writeln!(o, "# HELP drum_coordinator_facility_price Price of each facility.\n# TYPE drum_coordinator_facility_price gauge");
    for f in &s.facilities {
        let _ = writeln!(
            o,
            "drum_coordinator_facility_price{{facility=\"{}\"}} {}",
            escape(&f.id),
            f.price
        );
    }
    o
}

fn escape(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// Parses the request line and query of one HTTP request.
pub fn parse_request(head: &str) -> Result<AdminRequest, String> {
    let line = head.lines().next().unwrap_or_default();
    let mut parts = line.split_whitespace();
    let (method, target) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    let param = |k: &str| {
        query
            .split('&')
            .filter_map(|kv| kv.split_once('='))
            .find(|(key, _)| *key == k)
            .map(|(_, v)| percent_decode(v))
    };
    match (method, path) {
        ("GET", "/metrics") => Ok(AdminRequest::Metrics),
        ("GET", "/status") => Ok(AdminRequest::Status),
        ("GET", "/snapshot") => Ok(AdminRequest::Snapshot),
        ("POST", "/set-capacity") => {
            let facility = param("facility").ok_or("missing facility=")?;
            let value = param("value").ok_or("missing value=")?;
            let capacity = value
                .parse()
                .map_err(|_| format!("value {value:?} is not a number"))?;
            Ok(AdminRequest::SetCapacity { facility, capacity })
        }
        ("POST", "/set-weight") => {
            let app = param("app").ok_or("missing app=")?;
            let value = param("value").ok_or("missing value=")?;
            let weight = value
                .parse()
                .map_err(|_| format!("value {value:?} is not a number"))?;
            Ok(AdminRequest::SetWeight { app, weight })
        }
        ("POST", "/drain") => Ok(AdminRequest::Drain {
            host: param("host").ok_or("missing host=")?,
        }),
        ("POST", "/undrain") => Ok(AdminRequest::Undrain {
            host: param("host").ok_or("missing host=")?,
        }),
        _ => Err(format!("unknown request {method} {path}")),
    }
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = |c: u8| (c as char).to_digit(16);
        if b[i] == b'%' && i + 2 < b.len() {
            if let (Some(h), Some(l)) = (hex(b[i + 1]), hex(b[i + 2])) {
                out.push((h * 16 + l) as u8);
                i += 3;
                continue;
            }
        }
        out.push(if b[i] == b'+' { b' ' } else { b[i] });
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

pub fn percent_encode(s: &str) -> String {
    s.bytes()
        .map(|c| {
            if c.is_ascii_alphanumeric() || b"-._~".contains(&c) {
                (c as char).to_string()
            } else {
                format!("%{c:02X}")
            }
        })
        .collect()
}

/// Serves read-only admin requests over TCP (`admin_listen`, unauthenticated); changes are
/// refused with 403 and pointed at the admin socket. `handle` forwards requests to the state
/// machine's task.
pub async fn serve<F, Fut>(listener: tokio::net::TcpListener, handle: F)
where
    F: Fn(AdminRequest) -> Fut + Send + Sync + 'static + Clone,
    Fut: Future<Output = Option<Reply>> + Send + 'static,
{
    loop {
        let Ok((sock, peer)) = listener.accept().await else {
            continue;
        };
        tokio::spawn(one_request(sock, peer.to_string(), false, handle.clone()));
    }
}

/// Serves every admin request, changes included, over a Unix socket (`admin_socket`), whose
/// file permissions decide who may connect.
pub async fn serve_unix<F, Fut>(listener: tokio::net::UnixListener, handle: F)
where
    F: Fn(AdminRequest) -> Fut + Send + Sync + 'static + Clone,
    Fut: Future<Output = Option<Reply>> + Send + 'static,
{
    loop {
        let Ok((sock, _)) = listener.accept().await else {
            continue;
        };
        // The peer's uid, for the log: the socket's permissions already let it in.
        let peer = sock
            .peer_cred()
            .map_or("unix socket".into(), |c| format!("uid {}", c.uid()));
        tokio::spawn(one_request(sock, peer, true, handle.clone()));
    }
}

async fn one_request<S, F, Fut>(mut sock: S, peer: String, changes: bool, handle: F)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
    F: Fn(AdminRequest) -> Fut,
    Fut: Future<Output = Option<Reply>>,
{
    let mut buf = vec![0u8; 8192];
    let mut n = 0;
    let read = tokio::time::timeout(Duration::from_secs(5), async {
        while n < buf.len() {
            let k = sock.read(&mut buf[n..]).await?;
            if k == 0 {
                break;
            }
            n += k;
            if buf[..n].windows(4).any(|w| w == b"\r\n\r\n") {
                break;
            }
        }
        Ok::<_, std::io::Error>(())
    })
    .await;
    if !matches!(read, Ok(Ok(()))) {
        return;
    }
    let head = String::from_utf8_lossy(&buf[..n]);
    let reply = match parse_request(&head) {
        Ok(req) if req.is_change() && !changes => text(
            403,
            "operator commands are taken only on the coordinator's admin socket (admin_socket), \
             whose file permissions decide who may send them; this endpoint is read-only\n"
                .into(),
        ),
        Ok(req) => handle(req).await.unwrap_or(Reply {
            code: 503,
            content_type: "text/plain",
            body: "coordinator is shutting down\n".into(),
        }),
        Err(e) => text(400, format!("{e}\n")),
    };
    debug!(%peer, code = reply.code, "admin request");
    let text = format!(
        "HTTP/1.0 {} {}\r\nContent-Type: {}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{}",
        reply.code,
        if reply.code == 200 { "OK" } else { "Error" },
        reply.content_type,
        reply.body.len(),
        reply.body
    );
    let _ = sock.write_all(text.as_bytes()).await;
    let _ = sock.shutdown().await;
}

/// The operator CLI's side: one request, the reply's status code and body.
pub fn request(addr: SocketAddr, method: &str, target: &str) -> std::io::Result<(u16, String)> {
    let mut s = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    exchange(&mut s, &addr.to_string(), method, target)
}

/// One request over the admin socket (`admin_socket`), the reply's status code and body.
pub fn request_unix(
    path: &std::path::Path,
    method: &str,
    target: &str,
) -> std::io::Result<(u16, String)> {
    let mut s = std::os::unix::net::UnixStream::connect(path)?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    exchange(&mut s, "localhost", method, target)
}

fn exchange(
    s: &mut (impl std::io::Read + std::io::Write),
    host: &str,
    method: &str,
    target: &str,
) -> std::io::Result<(u16, String)> {
    write!(s, "{method} {target} HTTP/1.0\r\nHost: {host}\r\n\r\n")?;
    let mut text = String::new();
    s.read_to_string(&mut text)?;
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let code = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    Ok((code, body.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_parse() {
        assert_eq!(
            parse_request("GET /status HTTP/1.0\r\n"),
            Ok(AdminRequest::Status)
        );
        assert_eq!(
            parse_request("POST /set-capacity?facility=app%2D1&value=0.5 HTTP/1.0"),
            Ok(AdminRequest::SetCapacity {
                facility: "app-1".into(),
                capacity: 0.5
            })
        );
        assert!(parse_request("POST /set-capacity?facility=x&value=abc HTTP/1.0").is_err());
        assert!(parse_request("DELETE / HTTP/1.0").is_err());
        assert_eq!(percent_decode(&percent_encode("a b/c%")), "a b/c%");
    }
}
