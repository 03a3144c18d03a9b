//! The HTTP transport of both daemons' endpoints (the coordinator's admin endpoint and admin
//! socket, the agent's metrics): hyper's HTTP/1.1 server with the limits an endpoint that
//! every local user can reach needs. The endpoints' meaning (which requests, which replies)
//! is their callers'; this module only carries requests in and replies out.
//!
//! Limits, each a refusal rather than a resource held: a client that sends nothing, or its
//! request head a byte at a time, is cut off after [`Limits::header_timeout`] (hyper's header
//! read timer); no connection outlives [`Limits::connection_timeout`], keep-alive or not; a
//! head larger than [`Limits::max_head_bytes`] is answered 431 and a body larger than
//! [`Limits::max_body_bytes`] 413; at most [`Limits::max_connections`] connections are served
//! at once (further ones wait in the listen backlog).

use http_body_util::{BodyExt, Full, Limited};
use hyper::body::{Bytes, Incoming};
use hyper::header::{HeaderValue, CONTENT_TYPE, ORIGIN};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncWrite};
use tracing::debug;

/// The content type of OpenMetrics text (the daemons' `GET /metrics`).
pub const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// One reply: status code, content type and body.
#[derive(Clone, Debug, PartialEq)]
pub struct Reply {
    pub code: u16,
    pub content_type: &'static str,
    pub body: String,
}

impl Reply {
    /// A `text/plain` reply.
    pub fn text(code: u16, body: String) -> Self {
        Reply {
            code,
            content_type: "text/plain; charset=utf-8",
            body,
        }
    }
}

/// What an endpoint sees of a request.
#[derive(Clone, Debug, PartialEq)]
pub struct HttpRequest {
    pub method: String,
    /// Path and query, e.g. `/set-weight?app=a&value=2`.
    pub target: String,
    /// Whether a browser sent it on behalf of a web page (`Origin`, or a `Sec-Fetch-Site`
    /// other than `none`): such a request must not change anything, wherever it arrived.
    pub cross_origin: bool,
}

#[derive(Clone, Debug)]
pub struct Limits {
    pub header_timeout: Duration,
    pub connection_timeout: Duration,
    pub max_head_bytes: usize,
    pub max_body_bytes: usize,
    pub max_connections: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            header_timeout: Duration::from_secs(5),
            connection_timeout: Duration::from_secs(30),
            // hyper's smallest read buffer: a request line and headers far beyond what the
            // endpoints' clients send.
            max_head_bytes: 8192,
            // No endpoint takes a body; operator commands carry their arguments in the query.
            max_body_bytes: 1024,
            max_connections: 64,
        }
    }
}

/// A listening socket: the coordinator's TCP endpoint or its Unix admin socket.
pub trait Listener: Send + 'static {
    type Io: AsyncRead + AsyncWrite + Unpin + Send + 'static;
    /// The next connection and a description of its peer, for the log.
    fn accept(&self) -> impl Future<Output = std::io::Result<(Self::Io, String)>> + Send;
}

impl Listener for tokio::net::TcpListener {
    type Io = tokio::net::TcpStream;
    async fn accept(&self) -> std::io::Result<(Self::Io, String)> {
        let (s, peer) = tokio::net::TcpListener::accept(self).await?;
        Ok((s, peer.to_string()))
    }
}

impl Listener for tokio::net::UnixListener {
    type Io = tokio::net::UnixStream;
    async fn accept(&self) -> std::io::Result<(Self::Io, String)> {
        let (s, _) = tokio::net::UnixListener::accept(self).await?;
        // The peer's uid, for the log: the socket's permissions already let it in.
        let peer = s
            .peer_cred()
            .map_or("unix socket".into(), |c| format!("uid {}", c.uid()));
        Ok((s, peer))
    }
}

/// Serves `listener` until the task is dropped: every request goes to `handle` with its peer.
/// An accept error (out of file descriptors, say) is logged and retried after a pause, never
/// fatal.
pub async fn serve<L, F, Fut>(listener: L, limits: Limits, handle: F)
where
    L: Listener,
    F: Fn(HttpRequest, Arc<str>) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Reply> + Send + 'static,
{
    let slots = Arc::new(tokio::sync::Semaphore::new(limits.max_connections));
    let limits = Arc::new(limits);
    loop {
        let Ok(slot) = slots.clone().acquire_owned().await else {
            return; // never closed
        };
        let (io, peer) = match listener.accept().await {
            Ok(c) => c,
            Err(e) => {
                debug!("accepting an HTTP connection: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let (handle, limits) = (handle.clone(), limits.clone());
        tokio::spawn(async move {
            let peer: Arc<str> = peer.into();
            connection(io, &limits, move |req| handle(req, peer.clone())).await;
            drop(slot);
        });
    }
}

/// Serves one connection: requests until the client closes it or a limit ends it. Errors (a
/// malformed request, a timeout, a reset) end only this connection.
async fn connection<IO, F, Fut>(io: IO, limits: &Limits, handle: F)
where
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    F: Fn(HttpRequest) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Reply> + Send + 'static,
{
    let max_body = limits.max_body_bytes;
    let service = service_fn(move |req: Request<Incoming>| {
        let handle = handle.clone();
        async move { Ok::<_, Infallible>(respond(req, max_body, handle).await) }
    });
    let conn = http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_timeout)
        .max_buf_size(limits.max_head_bytes)
        .serve_connection(TokioIo::new(io), service);
    match tokio::time::timeout(limits.connection_timeout, conn).await {
        Ok(Err(e)) => debug!("HTTP connection ended: {e}"),
        Err(_) => debug!(
            "HTTP connection closed after {:?}",
            limits.connection_timeout
        ),
        Ok(Ok(())) => {}
    }
}

async fn respond<F, Fut>(
    req: Request<Incoming>,
    max_body: usize,
    handle: F,
) -> Response<Full<Bytes>>
where
    F: Fn(HttpRequest) -> Fut,
    Fut: Future<Output = Reply>,
{
    let (parts, body) = req.into_parts();
    // Read (and bound) the body even though no endpoint uses one, so that an oversized one
    // is refused rather than left unread on the connection.
    let reply = if Limited::new(body, max_body).collect().await.is_err() {
        Reply::text(
            413,
            format!("request body too large or unreadable (at most {max_body} bytes)\n"),
        )
    } else {
        let fetch_site = parts.headers.get("sec-fetch-site");
        let cross_origin = parts.headers.contains_key(ORIGIN)
            || fetch_site.is_some_and(|v| v.as_bytes() != b"none");
        handle(HttpRequest {
            method: parts.method.as_str().to_string(),
            target: parts
                .uri
                .path_and_query()
                .map_or_else(|| parts.uri.path().to_string(), |p| p.as_str().to_string()),
            cross_origin,
        })
        .await
    };
    let mut resp = Response::new(Full::new(Bytes::from(reply.body)));
    *resp.status_mut() =
        StatusCode::from_u16(reply.code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    resp.headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static(reply.content_type));
    resp
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::time::Instant;

    /// An echo endpoint with short limits on a loopback port.
    async fn start(limits: Limits) -> std::net::SocketAddr {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(serve(l, limits, |req: HttpRequest, _peer| async move {
            Reply::text(
                200,
                format!("{} {} {}", req.method, req.target, req.cross_origin),
            )
        }));
        addr
    }

    fn short() -> Limits {
        Limits {
            header_timeout: Duration::from_millis(300),
            connection_timeout: Duration::from_secs(2),
            ..Limits::default()
        }
    }

    /// Writes `bytes`, then reads until the server closes; the reply and how long it took.
    fn exchange(addr: std::net::SocketAddr, bytes: &[u8]) -> (String, Duration) {
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let t = Instant::now();
        s.write_all(bytes).unwrap();
        let mut out = Vec::new();
        let _ = s.read_to_end(&mut out);
        (String::from_utf8_lossy(&out).into_owned(), t.elapsed())
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn requests_reach_the_handler() {
        let addr = start(short()).await;
        let (r, _) = tokio::task::spawn_blocking(move || {
            exchange(addr, b"GET /a?b=c HTTP/1.0\r\nHost: x\r\n\r\n")
        })
        .await
        .unwrap();
        assert!(
            r.starts_with("HTTP/1.0 200") || r.starts_with("HTTP/1.1 200"),
            "{r}"
        );
        assert!(r.ends_with("GET /a?b=c false"), "{r}");
        let (r, _) = tokio::task::spawn_blocking(move || {
            exchange(
                addr,
                b"POST /x HTTP/1.1\r\nHost: x\r\nOrigin: http://evil.example\r\nConnection: close\r\n\r\n",
            )
        })
        .await
        .unwrap();
        assert!(r.ends_with("POST /x true"), "{r}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn malformed_and_oversized_requests_are_refused() {
        let addr = start(short()).await;
        let (r, _) =
            tokio::task::spawn_blocking(move || exchange(addr, b"\x16\x03\x01garbage\r\n\r\n"))
                .await
                .unwrap();
        assert!(r.is_empty() || r.contains(" 400 "), "{r}");
        let huge = format!(
            "GET / HTTP/1.1\r\nHost: x\r\nX-Big: {}\r\n\r\n",
            "a".repeat(20_000)
        );
        let (r, _) = tokio::task::spawn_blocking(move || exchange(addr, huge.as_bytes()))
            .await
            .unwrap();
        assert!(r.contains(" 431 "), "{r}");
        let body = format!(
            "POST /drain HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\nConnection: close\r\n\r\n{}",
            "b".repeat(5000)
        );
        let (r, _) = tokio::task::spawn_blocking(move || exchange(addr, body.as_bytes()))
            .await
            .unwrap();
        assert!(r.contains(" 413 "), "{r}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn idle_and_slow_connections_are_closed() {
        let addr = start(short()).await;
        // Nothing at all: closed after the header timeout.
        let (r, took) = tokio::task::spawn_blocking(move || exchange(addr, b""))
            .await
            .unwrap();
        assert!(took < Duration::from_secs(2), "{took:?} {r}");
        // A head trickled a byte every 100 ms never completes within the timeout.
        let took = tokio::task::spawn_blocking(move || {
            let mut s = std::net::TcpStream::connect(addr).unwrap();
            let t = Instant::now();
            for b in b"GET /metrics HTTP/1.1\r\nHost: x\r\n".iter().cycle() {
                if s.write_all(&[*b]).is_err() || t.elapsed() > Duration::from_secs(5) {
                    break;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            t.elapsed()
        })
        .await
        .unwrap();
        assert!(took < Duration::from_secs(3), "slow head held for {took:?}");
    }
}
