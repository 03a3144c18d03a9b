//! `drum-agent`: the per-host daemon of DRUM's control plane. It runs the pure agent state
//! machine (`drum_common::protocol::agent`) over a QUIC connection with mutual TLS to the
//! coordinator, performs its host's ADMM x-step each round, and publishes the host's rates and
//! active set to the local rate table ([`rate_table`]). docs/control-plane.md has the details.

pub mod metrics;
pub mod rate_table;

use anyhow::{bail, Context, Result};
use drum_common::admm::HostState;
use drum_common::model::Problem;
use drum_common::protocol::agent::{AgentAction, AgentConfig, AgentCore, AgentEvent};
use drum_common::protocol::{AgentMsg, CoordMsg};
use drum_coordinator::net::{self, FramedRecv, NetError, TlsFiles};
use rate_table::{LinkState, RateTable};
use serde::Deserialize;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tracing::{debug, info, warn};

/// `drum-agent --config FILE` (TOML); docs/control-plane.md lists every key.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct AgentSettings {
    /// This host's id in the instance.
    pub host: String,
    /// Instance file (JSON): the demand source of this version (the host's entry: apps,
    /// weights, demands, budgets) and the facility list shared with the coordinator.
    pub instance: PathBuf,
    /// The coordinator's QUIC address.
    pub coordinator: SocketAddr,
    /// Name the coordinator's certificate must carry.
    #[serde(default = "d_server_name")]
    pub server_name: String,
    pub tls: TlsFiles,
    /// Where to publish rates (rewritten atomically); none: do not publish.
    #[serde(default)]
    pub rate_table: Option<PathBuf>,
    #[serde(default = "d_heartbeat")]
    pub heartbeat_ms: u64,
    #[serde(default = "d_timeout")]
    pub coordinator_timeout_ms: u64,
    #[serde(default = "d_backoff_min")]
    pub backoff_min_ms: u64,
    #[serde(default = "d_backoff_max")]
    pub backoff_max_ms: u64,
    /// TCP address serving `GET /metrics` (Prometheus text); none: no endpoint.
    #[serde(default)]
    pub metrics_listen: Option<SocketAddr>,
}

fn d_server_name() -> String {
    "localhost".into()
}
fn d_heartbeat() -> u64 {
    500
}
fn d_timeout() -> u64 {
    3000
}
fn d_backoff_min() -> u64 {
    100
}
fn d_backoff_max() -> u64 {
    5000
}

impl AgentSettings {
    pub fn load(path: &Path) -> Result<Self> {
        let (mut s, base): (Self, _) = net::load_config(path)?;
        s.instance = base.join(&s.instance);
        s.tls.rebase(&base);
        s.rate_table = s.rate_table.map(|p| base.join(p));
        if s.heartbeat_ms == 0 || s.coordinator_timeout_ms <= s.heartbeat_ms {
            bail!(
                "coordinator_timeout_ms ({}) must exceed heartbeat_ms ({}), which must be positive",
                s.coordinator_timeout_ms,
                s.heartbeat_ms
            );
        }
        if s.backoff_min_ms == 0 || s.backoff_max_ms < s.backoff_min_ms {
            bail!("need 0 < backoff_min_ms ≤ backoff_max_ms");
        }
        Ok(s)
    }

    fn core_config(&self) -> AgentConfig {
        AgentConfig {
            heartbeat_interval: Duration::from_millis(self.heartbeat_ms),
            coordinator_timeout: Duration::from_millis(self.coordinator_timeout_ms),
            backoff_min: Duration::from_millis(self.backoff_min_ms),
            backoff_max: Duration::from_millis(self.backoff_max_ms),
        }
    }
}

/// The host's index and its active set. This version keeps active sets fixed: every agent
/// computes the same deterministic greedy initial selection over the shared instance, so the
/// sets agree cluster-wide without a selection protocol (docs/control-plane.md, "missing").
pub fn host_and_active(problem: &Problem, host: &str) -> Result<(usize, Vec<usize>)> {
    let Some(h) = problem.hosts.iter().position(|h| h.id == host) else {
        bail!("host {host:?} is not in the instance");
    };
    let active = drum_common::protocol::fixed_active_sets(problem).swap_remove(h);
    Ok((h, active))
}

/// Runs the agent for host index `host` with active pairs `active` until `shutdown` resolves;
/// then leaves the coordinator cleanly.
pub async fn run(
    settings: AgentSettings,
    problem: Arc<Problem>,
    host: usize,
    active: Vec<usize>,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<()> {
    let problem = &*problem;
    let mut core = AgentCore::new(
        problem,
        HostState::new(problem, host, active),
        settings.core_config(),
    );
    let endpoint = net::client_endpoint(
        &settings.tls,
        Duration::from_millis(settings.coordinator_timeout_ms),
    )
    .context("setting up the QUIC client")?;
    let table = settings
        .rate_table
        .as_ref()
        .map(|p| RateTable::new(p.clone()));
    let stats = Arc::new(metrics::AgentMetrics::default());
    if let Some(addr) = settings.metrics_listen {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("binding the metrics endpoint on {addr}"))?;
        info!(metrics = %listener.local_addr()?, "metrics endpoint listening");
        tokio::spawn(metrics::serve(
            listener,
            stats.clone(),
            settings.host.clone(),
        ));
    }
    let origin = Instant::now();
    let publish = |core: &AgentCore, state: LinkState| -> Result<()> {
        if let Some(t) = &table {
            t.publish(problem, core, state)
                .with_context(|| format!("writing the rate table {}", t.path().display()))?;
        }
        Ok(())
    };
    publish(&core, LinkState::Starting)?;
    tokio::pin!(shutdown);
    loop {
        // Wait for the next connection attempt (backoff), or stop.
        let wake = tokio::time::Instant::from_std(origin + core.next_wakeup());
        tokio::select! {
            _ = &mut shutdown => break,
            _ = tokio::time::sleep_until(wake) => {}
        }
        if !core.connect_due(origin.elapsed()) {
            continue;
        }
        let connected = tokio::time::timeout(
            Duration::from_millis(settings.coordinator_timeout_ms),
            connect(&endpoint, &settings),
        )
        .await;
        let (conn, send, recv) = match connected {
            Ok(Ok(c)) => c,
            Ok(Err(e)) => {
                stats.connect_failures.fetch_add(1, Relaxed);
                warn!(coordinator = %settings.coordinator, "coordinator unreachable: {e}; keeping last rates");
                core.on_connect_failed(origin.elapsed());
                continue;
            }
            Err(_) => {
                stats.connect_failures.fetch_add(1, Relaxed);
                warn!(coordinator = %settings.coordinator, "connecting timed out; keeping last rates");
                core.on_connect_failed(origin.elapsed());
                continue;
            }
        };
        stats.connects.fetch_add(1, Relaxed);
        info!(coordinator = %settings.coordinator, "connected");
        let stop = session(
            &mut core,
            problem,
            conn,
            send,
            recv,
            origin,
            &publish,
            &stats,
            &mut shutdown,
        )
        .await?;
        if stop {
            break;
        }
    }
    endpoint.close(net::CLOSE_NORMAL.into(), b"agent stopping");
    // Give the close (and a Leave sent just before) a moment to reach the coordinator.
    let _ = tokio::time::timeout(Duration::from_millis(200), endpoint.wait_idle()).await;
    info!("agent stopped");
    Ok(())
}

async fn connect(
    endpoint: &quinn::Endpoint,
    settings: &AgentSettings,
) -> Result<(quinn::Connection, quinn::SendStream, quinn::RecvStream), NetError> {
    let conn = endpoint
        .connect(settings.coordinator, &settings.server_name)?
        .await?;
    let (send, recv) = conn.open_bi().await?;
    Ok((conn, send, recv))
}

/// One connection's life; returns whether the agent should stop.
#[allow(clippy::too_many_arguments)]
async fn session(
    core: &mut AgentCore,
    problem: &Problem,
    conn: quinn::Connection,
    mut send: quinn::SendStream,
    recv: quinn::RecvStream,
    origin: Instant,
    publish: &impl Fn(&AgentCore, LinkState) -> Result<()>,
    stats: &metrics::AgentMetrics,
    shutdown: &mut std::pin::Pin<&mut impl std::future::Future<Output = ()>>,
) -> Result<bool> {
    // A reader task, so that waiting for a frame never races with the timer.
    let (tx, mut rx) = mpsc::unbounded_channel::<Result<CoordMsg, String>>();
    let reader = tokio::spawn(async move {
        let mut framed = FramedRecv::new(recv);
        loop {
            let r = framed.next::<CoordMsg>().await;
            let end = !matches!(r, Ok(Some(_)));
            let item = match r {
                Ok(Some(m)) => Ok(m),
                Ok(None) => Err("coordinator closed the stream".to_string()),
                Err(e) => Err(e.to_string()),
            };
            if tx.send(item).is_err() || end {
                break;
            }
        }
    });
    let mut actions = core.on_connected(origin.elapsed(), problem);
    let mut stop = false;
    'session: loop {
        for a in std::mem::take(&mut actions) {
            match a {
                AgentAction::Send(m) => {
                    if let AgentMsg::Contribution(c) = &m {
                        stats.rounds.fetch_add(1, Relaxed);
                        stats.iteration.store(c.iteration, Relaxed);
                    }
                    if let Err(e) = net::send_msg(&mut send, &m).await {
                        actions = core.on_disconnected(origin.elapsed(), &e.to_string());
                        warn!("lost the coordinator: {e}; keeping last rates");
                        continue 'session;
                    }
                }
                AgentAction::Disconnect(reason) => {
                    conn.close(net::CLOSE_PROTOCOL.into(), reason.as_bytes());
                }
                AgentAction::Publish => {
                    let state = if core.is_member() {
                        LinkState::Live
                    } else {
                        LinkState::FailStatic
                    };
                    stats.live.store(core.is_member() as u64, Relaxed);
                    stats.epoch.store(core.epoch(), Relaxed);
                    publish(core, state)?;
                }
                AgentAction::Event(e) => match e {
                    AgentEvent::Welcomed { epoch, iteration } => {
                        info!(epoch, iteration, "joined the coordinator")
                    }
                    AgentEvent::Refused(r) => warn!("coordinator refused us: {r}"),
                    AgentEvent::FailStatic(r) => {
                        stats.fail_static.fetch_add(1, Relaxed);
                        warn!("fail-static, keeping last rates: {r}")
                    }
                    AgentEvent::IgnoredRound { epoch, iteration } => {
                        debug!(epoch, iteration, "ignored an old round")
                    }
                },
            }
        }
        if !core.is_member()
            && !matches!(
                core.phase(),
                drum_common::protocol::agent::Phase::Joining { .. }
            )
        {
            break;
        }
        if stop {
            break;
        }
        let wake = tokio::time::Instant::from_std(origin + core.next_wakeup());
        actions = tokio::select! {
            m = rx.recv() => match m {
                Some(Ok(m)) => {
                    let t = Instant::now();
                    let out = core.on_message(origin.elapsed(), problem, m);
                    stats.handle_ns.fetch_add(t.elapsed().as_nanos() as u64, Relaxed);
                    out
                }
                Some(Err(e)) => {
                    warn!("lost the coordinator: {e}; keeping last rates");
                    core.on_disconnected(origin.elapsed(), &e)
                }
                None => core.on_disconnected(origin.elapsed(), "connection reader ended"),
            },
            _ = tokio::time::sleep_until(wake) => core.tick(origin.elapsed()),
            _ = shutdown.as_mut() => {
                stop = true;
                let _ = net::send_msg(&mut send, &AgentMsg::Leave).await;
                let _ = send.finish();
                Vec::new()
            }
        };
    }
    reader.abort();
    if !stop {
        conn.close(net::CLOSE_NORMAL.into(), b"reconnecting");
    }
    Ok(stop)
}
