//! `drum-coordinator relay`: the pure relay state machine (`drum_common::protocol::relay`)
//! under QUIC. Downstream it is a coordinator to its rack's agents (the same accept loop and
//! connection tasks as `serve`, a server certificate); upstream it is one agent-like member of
//! the coordinator (a client certificate naming the relay's host id). docs/control-plane.md,
//! "Relays".

use crate::metrics::Metrics;
use crate::server::{accept_loop, sleep_until, ConnPolicy, Input, Link, Outgoing};
use anyhow::{Context, Result};
use drum_common::protocol::coordinator::MemberId;
use drum_common::protocol::relay::{Relay, RelayAction, RelayConfig, RelayEvent};
use drum_common::protocol::{facility_digest, AgentMsg, CoordMsg};
use drum_net::quic::{self, FramedRecv};
use drum_net::TlsFiles;
use serde::Deserialize;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tracing::{debug, info, warn};

/// `relay --config FILE` (TOML); docs/control-plane.md lists every key.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct RelaySettings {
    /// The relay's host id at the coordinator; its upstream certificate must name it.
    pub host: String,
    /// UDP address the rack's agents connect to.
    pub listen: SocketAddr,
    /// The coordinator's address.
    pub upstream: SocketAddr,
    /// The name the coordinator's certificate must carry.
    pub server_name: String,
    /// The instance file the coordinator and the agents use (its facility list); none for
    /// the live problem, whose facility table the coordinator sends.
    #[serde(default)]
    pub instance: Option<PathBuf>,
    /// Downstream, as a coordinator's: a server certificate for the address agents dial.
    pub tls: TlsFiles,
    /// Upstream, as an agent's: a client certificate naming `host`.
    pub upstream_tls: TlsFiles,
    /// Join the coordinator once this many agents have joined the relay.
    #[serde(default = "one")]
    pub min_agents: usize,
    /// Shorter than the coordinator's, so that the rack's sum goes up before it gives up.
    #[serde(default = "d_round_deadline")]
    pub round_deadline_ms: u64,
    #[serde(default = "d_staleness")]
    pub max_staleness: u32,
    #[serde(default = "d_heartbeat")]
    pub heartbeat_ms: u64,
    #[serde(default = "d_timeout")]
    pub member_timeout_ms: u64,
    #[serde(default = "d_timeout")]
    pub coordinator_timeout_ms: u64,
    #[serde(default = "yes")]
    pub bind_host_to_certificate: bool,
}

fn one() -> usize {
    1
}
fn yes() -> bool {
    true
}
fn d_round_deadline() -> u64 {
    40
}
fn d_staleness() -> u32 {
    3
}
fn d_heartbeat() -> u64 {
    500
}
fn d_timeout() -> u64 {
    3000
}

impl RelaySettings {
    /// Reads a TOML config; relative paths are taken from the config's directory.
    pub fn load(path: &Path) -> Result<Self> {
        let (mut s, base): (Self, PathBuf) = drum_net::config::load_config(path)?;
        s.instance = s.instance.map(|i| base.join(i));
        s.tls.rebase(&base);
        s.upstream_tls.rebase(&base);
        anyhow::ensure!(
            drum_common::protocol::valid_name(&s.host),
            "host {:?} must be 1 to 64 letters, digits, '.', '_' or '-'",
            s.host
        );
        Ok(s)
    }
}

enum Up {
    Connected(quinn::Connection, mpsc::UnboundedSender<AgentMsg>),
    Failed(String),
    /// From the connection with this `stable_id` (an old one's last words are dropped).
    Msg(usize, CoordMsg),
    Lost(usize, String),
}

/// Runs the relay until `shutdown` resolves.
pub async fn run(
    settings: RelaySettings,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<()> {
    let (digest, facilities) = match &settings.instance {
        Some(path) => {
            let problem = drum_net::config::load_problem(path)?;
            (facility_digest(&problem), problem.facilities.len() as u32)
        }
        None => (0, 0),
    };
    let member_timeout = Duration::from_millis(settings.member_timeout_ms);
    let endpoint = quic::server_endpoint(&settings.tls, settings.listen, member_timeout)
        .with_context(|| format!("binding QUIC on {}", settings.listen))?;
    let upstream_timeout = Duration::from_millis(settings.coordinator_timeout_ms);
    let client_tls = quic::ClientTls::load(&settings.upstream_tls, upstream_timeout)
        .context("loading the upstream TLS files")?;
    let client = quic::bare_client_endpoint().context("setting up the QUIC client")?;
    let mut core = Relay::new(RelayConfig {
        host: settings.host.clone(),
        facility_digest: digest,
        facilities,
        live: settings.instance.is_none(),
        heartbeat_interval: Duration::from_millis(settings.heartbeat_ms),
        member_timeout,
        upstream_timeout,
        round_deadline: Duration::from_millis(settings.round_deadline_ms),
        max_staleness: settings.max_staleness,
        min_agents: settings.min_agents,
        backoff_min: Duration::from_millis(200),
        backoff_max: Duration::from_secs(5),
    });
    info!(
        host = settings.host,
        listen = %endpoint.local_addr()?,
        upstream = %settings.upstream,
        "relay serving"
    );
    let metrics = Arc::new(Metrics::default());
    let (tx, mut rx) = mpsc::unbounded_channel();
    let policy = ConnPolicy {
        join_timeout: member_timeout,
        bind_host: settings.bind_host_to_certificate,
    };
    let accept = tokio::spawn(accept_loop(endpoint.clone(), tx, metrics, policy));
    let (up_tx, mut up_rx) = mpsc::unbounded_channel::<Up>();
    let origin = Instant::now();
    let mut agents: HashMap<MemberId, Link> = HashMap::new();
    let mut upstream: Option<(quinn::Connection, mpsc::UnboundedSender<AgentMsg>)> = None;
    let mut connecting = false;
    let body = async {
        loop {
            if !connecting && upstream.is_none() && core.connect_due(origin.elapsed()) {
                connecting = true;
                let (cfg, up_tx) = (client_tls.config.clone(), up_tx.clone());
                let (client, addr, name) = (
                    client.clone(),
                    settings.upstream,
                    settings.server_name.clone(),
                );
                tokio::spawn(connect_upstream(client, cfg, addr, name, up_tx));
            }
            let wake = core
                .next_wakeup()
                .map(|w| tokio::time::Instant::from_std(origin + w));
            let actions = tokio::select! {
                input = rx.recv() => {
                    let Some(input) = input else { return Ok::<(), anyhow::Error>(()) };
                    let now = origin.elapsed();
                    match input {
                        Input::Connected(link) => {
                            agents.insert(link.id, link);
                            Vec::new()
                        }
                        Input::Msg(id, m) if agents.contains_key(&id) => core.on_agent(now, id, m),
                        Input::Msg(..) => Vec::new(),
                        Input::Closed(id, timed_out) => {
                            agents.remove(&id);
                            core.on_agent_gone(now, id, timed_out)
                        }
                        // The relay has no admin endpoint and reads its TLS files at start.
                        Input::Admin(..) | Input::Reloaded(_) => Vec::new(),
                    }
                }
                up = up_rx.recv() => {
                    let now = origin.elapsed();
                    match up.expect("the relay holds a sender") {
                        Up::Connected(conn, send) => {
                            connecting = false;
                            info!(upstream = %settings.upstream, "connected to the coordinator");
                            upstream = Some((conn, send));
                            core.on_upstream_connected(now)
                        }
                        Up::Failed(e) => {
                            connecting = false;
                            warn!(upstream = %settings.upstream, "connecting to the coordinator failed: {e}");
                            core.on_connect_failed(now);
                            Vec::new()
                        }
                        Up::Msg(from, m) if current(&upstream) == Some(from) => core.on_upstream(now, m),
                        Up::Lost(from, e) if current(&upstream) == Some(from) => {
                            upstream = None;
                            core.on_upstream_lost(now, &e)
                        }
                        Up::Msg(..) | Up::Lost(..) => Vec::new(),
                    }
                }
                _ = sleep_until(wake) => core.tick(origin.elapsed()),
            };
            for a in actions {
                match a {
                    RelayAction::Down(id, m) => {
                        if let Some(l) = agents.get(&id) {
                            let _ = l.out.send(Outgoing::Msg(m));
                        }
                    }
                    RelayAction::CloseDown(id, reason) => {
                        if let Some(l) = agents.remove(&id) {
                            debug!(member = id, remote = %l.remote, "closing agent connection: {reason}");
                            let _ = l.out.send(Outgoing::Close(quic::CLOSE_PROTOCOL, reason));
                        }
                    }
                    RelayAction::ExpireDown(id) => {
                        if let Some(l) = agents.remove(&id) {
                            debug!(member = id, remote = %l.remote, "closing agent connection: heartbeat timeout");
                            let _ = l.out.send(Outgoing::Close(
                                quic::CLOSE_TIMEOUT,
                                "heartbeat timeout".into(),
                            ));
                        }
                    }
                    RelayAction::Up(m) => {
                        if let Some((_, send)) = &upstream {
                            let _ = send.send(m);
                        }
                    }
                    RelayAction::CloseUp(reason) => {
                        if let Some((conn, _)) = upstream.take() {
                            conn.close(quic::CLOSE_PROTOCOL.into(), reason.as_bytes());
                        }
                    }
                    RelayAction::Event(e) => log_event(&e),
                }
            }
        }
    };
    tokio::select! {
        r = body => r?,
        _ = shutdown => info!("relay shutting down"),
    }
    accept.abort();
    if let Some((conn, send)) = upstream.take() {
        let _ = send.send(AgentMsg::Leave);
        // Let the Leave out before the close discards it.
        tokio::time::sleep(Duration::from_millis(100)).await;
        conn.close(quic::CLOSE_NORMAL.into(), b"relay shutting down");
    }
    endpoint.close(quic::CLOSE_NORMAL.into(), b"relay shutting down");
    Ok(())
}

/// Connects to the coordinator and runs the connection: a writer task for what the relay
/// sends, this task reading what the coordinator sends.
async fn connect_upstream(
    client: quinn::Endpoint,
    cfg: quinn::ClientConfig,
    addr: SocketAddr,
    name: String,
    up: mpsc::UnboundedSender<Up>,
) {
    let link = async {
        let conn = client.connect_with(cfg, addr, &name)?.await?;
        let (send, recv) = conn.open_bi().await?;
        Ok::<_, drum_net::NetError>((conn, send, recv))
    };
    let (conn, mut send, recv) = match link.await {
        Ok(l) => l,
        Err(e) => {
            let _ = up.send(Up::Failed(e.to_string()));
            return;
        }
    };
    let (out_tx, mut out_rx) = mpsc::unbounded_channel::<AgentMsg>();
    let writer = tokio::spawn(async move {
        while let Some(m) = out_rx.recv().await {
            if quic::send_msg(&mut send, &m).await.is_err() {
                break;
            }
        }
    });
    if up.send(Up::Connected(conn.clone(), out_tx)).is_err() {
        return;
    }
    let id = conn.stable_id();
    let mut framed = FramedRecv::new(recv);
    let reason = loop {
        match framed.next::<CoordMsg>().await {
            Ok(Some(m)) => {
                if up.send(Up::Msg(id, m)).is_err() {
                    return;
                }
            }
            Ok(None) => break "the coordinator ended the stream".to_string(),
            Err(e) => break e.to_string(),
        }
    };
    writer.abort();
    let _ = up.send(Up::Lost(id, reason));
}

fn current(
    upstream: &Option<(quinn::Connection, mpsc::UnboundedSender<AgentMsg>)>,
) -> Option<usize> {
    upstream.as_ref().map(|(c, _)| c.stable_id())
}

fn log_event(e: &RelayEvent) {
    match e {
        RelayEvent::AgentJoined { member, host } => info!(member, host, "agent joined"),
        RelayEvent::AgentLeft { member, host, why } => info!(member, host, why, "agent left"),
        RelayEvent::AgentRefused { member, reason } => warn!(member, "refused: {reason}"),
        RelayEvent::Welcomed { epoch, iteration } => {
            info!(epoch, iteration, "joined the coordinator")
        }
        RelayEvent::UpstreamLost {
            reason,
            agents: 0,
            waiting,
            joined: false,
        } => info!(
            waiting,
            "the coordinator closed the connection before the rack assembled: {reason}; \
             the agents waiting wait on, and the relay connects again"
        ),
        RelayEvent::UpstreamLost {
            reason,
            agents,
            waiting,
            ..
        } => warn!(
            agents,
            waiting,
            "lost the coordinator: {reason}; closing the welcomed agents' connections (they \
             fail static), the agents waiting for their first welcome wait on"
        ),
        RelayEvent::Unsupported(what) => warn!("not supported through a relay: {what}"),
        RelayEvent::ExchangeUp {
            exchange,
            proposals: Some(n),
        } => debug!(exchange, proposals = n, "rack proposals up"),
        RelayEvent::ExchangeUp {
            exchange,
            proposals: None,
        } => debug!(exchange, "rack's new active sets up"),
        RelayEvent::RoundUp {
            iteration,
            stale,
            took,
        } => debug!(
            iteration,
            stale,
            took_ms = took.as_secs_f64() * 1e3,
            "rack round up"
        ),
    }
}
