//! The coordinator's admin endpoint (HTTP, [`drum_net::http`]): `GET /metrics` (OpenMetrics
//! text, [`crate::metrics`]), `GET /status` (JSON),
//! `GET /snapshot` (the live problem as an instance file) and the operator's changes
//! `POST /set-capacity?facility=F&value=Y`, `POST /set-weight?app=A&value=W`, `POST /drain?host=H`,
//! `POST /undrain?host=H`, plus the clients the operator CLI uses.
//!
//! Who may change the coordinator is decided by the file permissions of a Unix socket
//! ([`serve_unix`], `admin_socket`): only it takes changes. The TCP endpoint ([`serve`],
//! `admin_listen`) has no authentication, so it answers reads only and refuses every change
//! with 403 — any local user, or a web page in a local browser (a cross-origin POST needs no
//! permission), could otherwise drain hosts. A browser's request (it carries `Origin`) is
//! refused a change on the socket too.

pub use crate::metrics::Metrics;
use drum_common::protocol::coordinator::Coordinator;
pub use drum_net::http::Reply;
use drum_net::http::{self, HttpRequest, Limits};
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
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

fn text(code: u16, body: String) -> Reply {
    Reply::text(code, body)
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
            content_type: http::OPENMETRICS,
            body: crate::metrics::render(core.status(), metrics),
        },
        AdminRequest::SetCapacity { facility, capacity } => {
            match core.set_capacity(&facility, capacity) {
                Ok(()) => text(200, format!("capacity of {facility} set to {capacity}\n")),
                Err(e) => text(400, format!("{e}\n")),
            }
        }
    }
}

/// Parses one request's method and target (path and query).
pub fn parse_request(method: &str, target: &str) -> Result<AdminRequest, String> {
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
    http::serve(listener, Limits::default(), move |req, peer| {
        reply(req, peer, false, handle.clone())
    })
    .await
}

/// Serves every admin request, changes included, over a Unix socket (`admin_socket`), whose
/// file permissions decide who may connect.
pub async fn serve_unix<F, Fut>(listener: tokio::net::UnixListener, handle: F)
where
    F: Fn(AdminRequest) -> Fut + Send + Sync + 'static + Clone,
    Fut: Future<Output = Option<Reply>> + Send + 'static,
{
    http::serve(listener, Limits::default(), move |req, peer| {
        reply(req, peer, true, handle.clone())
    })
    .await
}

async fn reply<F, Fut>(req: HttpRequest, peer: Arc<str>, changes: bool, handle: F) -> Reply
where
    F: Fn(AdminRequest) -> Fut,
    Fut: Future<Output = Option<Reply>>,
{
    let reply = match parse_request(&req.method, &req.target) {
        Ok(r) if r.is_change() && !changes => text(
            403,
            "operator commands are taken only on the coordinator's admin socket (admin_socket), \
             whose file permissions decide who may send them; this endpoint is read-only\n"
                .into(),
        ),
        Ok(r) if r.is_change() && req.cross_origin => text(
            403,
            "operator commands are not taken from a web page (the request carries Origin)\n".into(),
        ),
        Ok(r) => handle(r)
            .await
            .unwrap_or_else(|| text(503, "coordinator is shutting down\n".into())),
        Err(e) => text(400, format!("{e}\n")),
    };
    debug!(%peer, method = %req.method, target = %req.target, code = reply.code, "admin request");
    reply
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
        assert_eq!(parse_request("GET", "/status"), Ok(AdminRequest::Status));
        assert_eq!(
            parse_request("POST", "/set-capacity?facility=app%2D1&value=0.5"),
            Ok(AdminRequest::SetCapacity {
                facility: "app-1".into(),
                capacity: 0.5
            })
        );
        assert!(parse_request("POST", "/set-capacity?facility=x&value=abc").is_err());
        assert!(parse_request("DELETE", "/").is_err());
        assert!(parse_request("GET", "/drain?host=h").is_err());
        assert_eq!(percent_decode(&percent_encode("a b/c%")), "a b/c%");
    }
}
