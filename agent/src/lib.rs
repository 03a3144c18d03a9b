//! `drum-agent`: the per-host daemon of DRUM's control plane. It runs the pure agent state
//! machine (`drum_common::protocol::agent`) over a QUIC connection with mutual TLS to the
//! coordinator, performs its host's ADMM x-step each round, and publishes the host's rates and
//! active set to the local rate table ([`rate_table`]). docs/control-plane.md has the details.

pub mod dasr;
pub mod dasr_auth;
pub mod dasr_link;
pub mod demand_feed;
pub mod gids;
pub mod grant_audit;
pub mod local;
pub mod metrics;
pub mod procfs;
pub mod rate_table;
mod settings;
pub mod shim_hub;
pub mod shim_metrics;
pub mod shim_settings;
pub mod tenants;
pub mod ungoverned;
pub mod warned_once;

use anyhow::{bail, Context, Result};
use drum_common::admm::HostState;
use drum_common::live::{max_cqe_per_wqe, Gid, LiveHost, LivePolicy};
use drum_common::model::Problem;
use drum_common::protocol::agent::{AgentAction, AgentCore, AgentEvent};
use drum_common::protocol::shard::ShardMux;
use drum_common::protocol::{AgentMsg, CoordMsg};
use drum_net::{quic, quic::FramedRecv, NetError};
use rate_table::{LinkState, TableWriter};
pub use settings::{AgentOptions, AgentSettings, NicSettings};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tracing::{debug, info, warn};

/// The host's index and its initial active set: the deterministic greedy selection at zero
/// prices over the shared instance, where `drum-coordinator solve` starts too. The selection
/// exchanges the coordinator schedules change it from there (docs/control-plane.md).
pub fn host_and_active(problem: &Problem, host: &str) -> Result<(usize, Vec<usize>)> {
    let Some(h) = problem.hosts.iter().position(|h| h.id == host) else {
        bail!("host {host:?} is not in the instance");
    };
    let active = drum_common::protocol::fixed_active_sets(problem).swap_remove(h);
    Ok((h, active))
}

/// Runs the agent for host index `host` with active pairs `active` until `shutdown` resolves;
/// then leaves the coordinator cleanly. One coordinator, no shards.
pub async fn run(
    settings: AgentSettings,
    problem: Arc<Problem>,
    host: usize,
    active: Vec<usize>,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<()> {
    run_with(
        settings,
        AgentOptions::default(),
        problem,
        host,
        active,
        shutdown,
    )
    .await
}

/// As [`run`], with the keys of [`AgentOptions`] (coordinator shards).
pub async fn run_with(
    settings: AgentSettings,
    options: AgentOptions,
    problem: Arc<Problem>,
    host: usize,
    active: Vec<usize>,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<()> {
    let never = Arc::new(tokio::sync::Notify::new());
    run_with_reload(settings, options, problem, host, active, shutdown, never).await
}

/// As [`run_with`]; every notification of `reload` reads the TLS files (certificate, key,
/// CA, CRL) again, as `drum-agent` does on SIGHUP. The next connection uses them; the
/// established one goes on, so no round is lost. Files that do not load change nothing.
pub async fn run_with_reload(
    settings: AgentSettings,
    options: AgentOptions,
    problem: Arc<Problem>,
    host: usize,
    active: Vec<usize>,
    shutdown: impl std::future::Future<Output = ()>,
    reload: Arc<tokio::sync::Notify>,
) -> Result<()> {
    run_inner(
        settings, options, problem, host, active, None, shutdown, reload,
    )
    .await
}

/// The agent of the live problem (no instance, docs/live-problem.md): its host's problem is
/// built from `[nic]`, the apps its shims run and what the coordinator sends. Needs `[shim]`.
pub async fn run_live(
    settings: AgentSettings,
    options: AgentOptions,
    shutdown: impl std::future::Future<Output = ()>,
    reload: Arc<tokio::sync::Notify>,
) -> Result<()> {
    let Some(shim) = &options.shim else {
        bail!("the live problem needs [shim]: the shims tell which apps run");
    };
    let (nic, gids) = options
        .nic
        .clone()
        .unwrap_or_default()
        .resolve(shim.line_rate_gbps)?;
    info!(
        host = %settings.host,
        line_rate_gbps = nic.line_rate_gbps,
        max_active = nic.max_active,
        gids = ?gids.iter().map(drum_table::message::gid_hex).collect::<Vec<_>>(),
        "live problem: no instance; apps come from the shims, facilities from the coordinator"
    );
    let base_budget = nic.wqe_budget;
    let view = LiveHost::new(&settings.host, nic, gids);
    let problem = Arc::new(view.problem().0);
    let live = LiveState {
        coordinator_policy: view.policy.clone(),
        tenant_weights: Default::default(),
        view,
        base_budget,
        dirty: false,
        last_report: None,
        unknown_logged: Default::default(),
    };
    run_inner(
        settings,
        options,
        problem,
        0,
        Vec::new(),
        Some(live),
        shutdown,
        reload,
    )
    .await
}

/// The live problem's state in the driver: the agent's view, whether the host's problem must
/// be rebuilt, when the host last reported, and the unknown peers already logged.
struct LiveState {
    view: LiveHost,
    /// The coordinator's policy as it sent it; `view.policy` is it with the tenant rules'
    /// weights applied.
    coordinator_policy: LivePolicy,
    tenant_weights: std::collections::BTreeMap<String, f64>,
    /// `[nic] wqe_budget`; `view.nic.wqe_budget` is it less what ungoverned processes send.
    base_budget: f64,
    dirty: bool,
    last_report: Option<Instant>,
    unknown_logged: std::collections::BTreeSet<(String, Gid)>,
}

/// What the shim link says for the live problem: the apps, the weights tenant rules give
/// them, and the share of the line ungoverned processes take.
#[derive(Default)]
struct ShimView {
    apps: Vec<drum_common::live::LiveApp>,
    weights: std::collections::BTreeMap<String, f64>,
    ungoverned: f64,
    identities: std::collections::BTreeMap<String, Vec<drum_common::app_identity::AppIdentity>>,
}

/// The coordinator's policy with the tenant rules' weights: the host's operator decides
/// what its own users' apps weigh.
fn with_weights(p: &LivePolicy, weights: &std::collections::BTreeMap<String, f64>) -> LivePolicy {
    let mut p = p.clone();
    for (app, &w) in weights {
        p.set_weight(app, Some(w));
    }
    p
}

/// How often a live host reports its row and grants (for `status` and `snapshot`).
const REPORT_PERIOD: Duration = Duration::from_millis(250);

#[allow(clippy::too_many_arguments)]
async fn run_inner(
    settings: AgentSettings,
    options: AgentOptions,
    // Shared with the caller until operator weight changes (`set-weight`) or the live
    // problem's rebuilds modify it (`Arc::make_mut`): a process running thousands of agents
    // (`examples/scale.rs`) holds one copy of the instance, not one per agent.
    mut problem: Arc<Problem>,
    host: usize,
    active: Vec<usize>,
    mut live_problem: Option<LiveState>,
    shutdown: impl std::future::Future<Output = ()>,
    reload: Arc<tokio::sync::Notify>,
) -> Result<()> {
    let (hub, dasr) = start_shim_link(&options).await?;
    let is_live = live_problem.is_some();
    let presence = |problem: &Problem| -> Option<Vec<bool>> {
        let hub = hub
            .as_ref()
            .filter(|_| options.apps_from_shims && !is_live)?;
        let running: std::collections::BTreeSet<String> =
            hub.usage().into_iter().map(|u| u.app).collect();
        Some(
            problem.hosts[host]
                .pairs
                .clone()
                .map(|p| running.contains(&problem.app_names[problem.pairs[p].app as usize]))
                .collect(),
        )
    };
    // Apps that do not run yet start parked; they arrive when their shims register.
    let mut active = active;
    let present = presence(&problem);
    if let Some(present) = &present {
        let first = problem.hosts[host].pairs.start;
        active.retain(|&p| present[p - first]);
    }
    let mut core = AgentCore::new(
        &problem,
        HostState::new(&problem, host, active),
        settings.core_config(),
    );
    if let Some(present) = present {
        core.set_present(&problem, present);
    }
    if let Some(l) = &live_problem {
        core.set_live(&l.view.host);
    }
    let traffic_clock = Instant::now();
    let live_apps = || -> ShimView {
        let Some(hub) = &hub else {
            return ShimView::default();
        };
        ShimView {
            apps: hub.live_apps(traffic_clock.elapsed()),
            weights: hub.tenant_weights(),
            ungoverned: hub.ungoverned_share(),
            identities: drum_common::app_identity::group(
                hub.usage()
                    .iter()
                    .map(|u| (u.app.as_str(), u.uid, u.gid, u.cgroup.as_str())),
            ),
        }
    };
    let shard_addrs: Vec<SocketAddr> = std::iter::once(settings.coordinator)
        .chain(options.coordinator_shards.iter().copied())
        .collect();
    let mut mux = ShardMux::new(&problem, host, shard_addrs.len() as u32);
    let addrs: Vec<SocketAddr> = mux
        .links()
        .iter()
        .map(|&s| shard_addrs[s as usize])
        .collect();
    if shard_addrs.len() > 1 {
        info!(shards = ?mux.links(), ?addrs, "talking to the shards that own this host's facilities");
    }
    let idle = Duration::from_millis(settings.coordinator_timeout_ms);
    // The TLS config of the next connection; a reload replaces it.
    let client_tls = Arc::new(std::sync::Mutex::new(
        quic::ClientTls::load(&settings.tls, idle).context("setting up the QUIC client")?,
    ));
    // The session's connections, which a reload checks against the new CA and CRL.
    let live: Arc<std::sync::Mutex<Vec<quinn::Connection>>> = Arc::default();
    let endpoint = quic::bare_client_endpoint().context("setting up the QUIC client")?;
    let stats = Arc::new(metrics::AgentMetrics::default());
    stats.table_ok.set(1);
    let table = settings
        .rate_table
        .as_ref()
        .map(|p| TableWriter::start(p.clone(), stats.clone(), rate_table::PERIOD));
    if let Some(addr) = settings.metrics_listen {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("binding the metrics endpoint on {addr}"))?;
        info!(metrics = %listener.local_addr()?, "metrics endpoint listening");
        // The shim link's and DASR's metrics, when configured, with the agent's own.
        let mut more: Vec<Box<dyn prometheus_client::collector::Collector>> = Vec::new();
        if let Some(h) = &hub {
            more.push(Box::new(shim_metrics::ShimMetrics(h.clone())));
        }
        if let Some(d) = &dasr {
            more.push(Box::new(d.metrics()));
        }
        let registry = Arc::new(stats.registry(&settings.host, more));
        tokio::spawn(metrics::serve(listener, registry));
    }
    let mut demand = match (&hub, &options.shim) {
        (Some(h), Some(s)) => Some(demand_feed::DemandFeed::new(
            h.clone(),
            &problem,
            host,
            s.line_rate_gbps,
            s.parked_rate,
        )),
        _ => None,
    };
    if let (Some(d), Some(l)) = (&mut demand, &live_problem) {
        d.rebase(
            &problem,
            host,
            max_cqe_per_wqe(&l.view.nic, problem.params.x_min),
        );
    }
    let origin = Instant::now();
    let publish = |problem: &Problem, core: &AgentCore, state: LinkState| {
        if let Some(t) = &table {
            t.publish(rate_table::table_file(problem, core, state));
        }
        // Fail-static: the shims keep the grants of the last round. The rates do not move
        // without rounds, but the demand feed goes on measuring each app's `a`, which would
        // move its polling grant with no coordinator to price it (found by the chaos soak).
        if let Some(hub) = hub.as_ref().filter(|_| state != LinkState::FailStatic) {
            hub.set_rates(&rate_table::app_decisions(problem, core));
        }
    };
    publish(&problem, &core, LinkState::Starting);
    let reloads = tokio::spawn({
        let (client_tls, tls) = (client_tls.clone(), settings.tls.clone());
        let (live, server_name) = (live.clone(), settings.server_name.clone());
        let stats = stats.clone();
        async move {
            loop {
                reload.notified().await;
                match quic::ClientTls::load(&tls, idle) {
                    Ok(c) => {
                        info!(cert = %tls.cert.display(), crl = ?tls.crl, "reloaded the TLS files; the next connection uses them");
                        // A coordinator the new files no longer vouch for (revoked, or from
                        // another CA) is left now, not at the next reconnection.
                        for conn in live.lock().expect("not poisoned").iter() {
                            if let Err(e) = c.check_peer(conn, &server_name) {
                                stats.refused_coordinators.inc();
                                warn!(remote = %conn.remote_address(), "the coordinator's certificate is no longer accepted after the reload: {e}; closing the connection");
                                let reason = format!("certificate no longer accepted: {e}");
                                conn.close(quic::CLOSE_PROTOCOL.into(), reason.as_bytes());
                            }
                        }
                        *client_tls.lock().expect("not poisoned") = c;
                    }
                    Err(e) => warn!("TLS reload failed, keeping the previous certificates: {e}"),
                }
            }
        }
    });
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
        // A session needs every shard this host talks to.
        let mut links = Vec::with_capacity(addrs.len());
        let mut failed = None;
        let mut stopping = false;
        for &addr in &addrs {
            // SIGTERM must not wait for a connection attempt (up to coordinator_timeout_ms).
            let connected = tokio::select! {
                r = tokio::time::timeout(
                    Duration::from_millis(settings.coordinator_timeout_ms),
                    connect(&endpoint, &client_tls, addr, &settings.server_name),
                ) => r,
                _ = &mut shutdown => {
                    stopping = true;
                    break;
                }
            };
            match connected {
                Ok(Ok(c)) => links.push(c),
                Ok(Err(e)) => {
                    failed = Some(format!("coordinator {addr} unreachable: {e}"));
                    break;
                }
                Err(_) => {
                    failed = Some(format!("connecting to {addr} timed out"));
                    break;
                }
            }
        }
        if stopping {
            for (conn, _, _) in &links {
                conn.close(quic::CLOSE_NORMAL.into(), b"agent stopping");
            }
            break;
        }
        if let Some(why) = failed {
            stats.connect_failures.inc();
            warn!("{why}; keeping last rates");
            for (conn, _, _) in &links {
                conn.close(quic::CLOSE_NORMAL.into(), b"another shard is unreachable");
            }
            core.on_connect_failed(origin.elapsed());
            continue;
        }
        stats.connects.inc();
        info!(coordinators = ?addrs, "connected");
        *live.lock().expect("not poisoned") = links.iter().map(|l| l.0.clone()).collect();
        mux.reset();
        let stop = session(
            &mut core,
            &mut mux,
            &mut problem,
            links,
            origin,
            &publish,
            &presence,
            &mut live_problem,
            &live_apps,
            &mut demand,
            &stats,
            &mut shutdown,
        )
        .await?;
        live.lock().expect("not poisoned").clear();
        if stop {
            break;
        }
    }
    reloads.abort();
    if let Some(t) = table {
        t.close(rate_table::table_file(&problem, &core, LinkState::Stopped))
            .await;
    }
    endpoint.close(quic::CLOSE_NORMAL.into(), b"agent stopping");
    // Give the close (and a Leave sent just before) a moment to reach the coordinator.
    let _ = tokio::time::timeout(Duration::from_millis(200), endpoint.wait_idle()).await;
    info!("agent stopped");
    Ok(())
}

/// The shim hub (and DASR) when configured: the optimiser's rates go to the host's shims,
/// the receivers' caps too.
async fn start_shim_link(
    options: &AgentOptions,
) -> Result<(Option<Arc<shim_hub::ShimHub>>, Option<dasr::DasrService>)> {
    match &options.shim {
        Some(shim) => {
            let (hub, dasr) = dasr_link::start(shim, options.dasr.clone()).await?;
            Ok((Some(hub), dasr))
        }
        None => Ok((None, None)),
    }
}

type Link = (quinn::Connection, quinn::SendStream, quinn::RecvStream);

async fn connect(
    endpoint: &quinn::Endpoint,
    tls: &std::sync::Mutex<quic::ClientTls>,
    addr: SocketAddr,
    server_name: &str,
) -> Result<Link, NetError> {
    let cfg = tls.lock().expect("not poisoned").config.clone();
    let conn = endpoint.connect_with(cfg, addr, server_name)?.await?;
    let (send, recv) = conn.open_bi().await?;
    Ok((conn, send, recv))
}

/// One session (a connection to every shard the host needs); returns whether the agent
/// should stop.
#[allow(clippy::too_many_arguments)]
async fn session(
    core: &mut AgentCore,
    mux: &mut ShardMux,
    problem: &mut Arc<Problem>,
    links: Vec<Link>,
    origin: Instant,
    publish: &impl Fn(&Problem, &AgentCore, LinkState),
    presence: &impl Fn(&Problem) -> Option<Vec<bool>>,
    live: &mut Option<LiveState>,
    live_apps: &impl Fn() -> ShimView,
    demand: &mut Option<demand_feed::DemandFeed>,
    stats: &metrics::AgentMetrics,
    shutdown: &mut std::pin::Pin<&mut impl std::future::Future<Output = ()>>,
) -> Result<bool> {
    // Reader tasks, so that waiting for a frame never races with the timer.
    let (tx, mut rx) = mpsc::unbounded_channel::<(usize, Result<CoordMsg, String>)>();
    let mut conns = Vec::with_capacity(links.len());
    let mut sends = Vec::with_capacity(links.len());
    let mut readers = Vec::with_capacity(links.len());
    for (i, (conn, send, recv)) in links.into_iter().enumerate() {
        conns.push(conn);
        sends.push(send);
        let tx = tx.clone();
        readers.push(tokio::spawn(async move {
            let mut framed = FramedRecv::new(recv);
            loop {
                let r = framed.next::<CoordMsg>().await;
                let end = !matches!(r, Ok(Some(_)));
                let item = match r {
                    Ok(Some(m)) => Ok(m),
                    Ok(None) => Err("coordinator closed the stream".to_string()),
                    Err(e) => Err(e.to_string()),
                };
                if tx.send((i, item)).is_err() || end {
                    break;
                }
            }
        }));
    }
    drop(tx);
    if let Some(l) = live.as_mut() {
        // The previous coordinator's facility numbers mean nothing to this one: until its
        // table arrives, a rebuild (an app arriving) must not name them in an `Update`.
        l.view.facilities.clear();
        // Nor may a report: the row still carries them until it is rebuilt for this
        // connection (a restarted coordinator refused such a report as a protocol violation
        // and closed the connection; found by the chaos soak).
        l.dirty = true;
    }
    let mut actions = core.on_connected(origin.elapsed(), problem);
    let mut stop = false;
    'session: loop {
        // Actions that handling these actions produced (an app arrived or left).
        let mut more = Vec::new();
        for a in std::mem::take(&mut actions) {
            match a {
                AgentAction::Send(m) => {
                    if let AgentMsg::Contribution(c) = &m {
                        stats.rounds.inc();
                        stats.iteration.set(c.iteration as i64);
                    }
                    for (link, part) in mux.outgoing(&m) {
                        if let Err(e) = quic::send_msg(&mut sends[link], &part).await {
                            actions = core.on_disconnected(origin.elapsed(), &e.to_string());
                            warn!("lost the coordinator: {e}; keeping last rates");
                            continue 'session;
                        }
                    }
                }
                AgentAction::Disconnect(reason) => {
                    for conn in &conns {
                        conn.close(quic::CLOSE_PROTOCOL.into(), reason.as_bytes());
                    }
                }
                AgentAction::Publish => {
                    let state = if core.is_member() {
                        LinkState::Live
                    } else {
                        LinkState::FailStatic
                    };
                    stats.live.set(core.is_member() as i64);
                    stats.epoch.set(core.epoch() as i64);
                    if let Some(d) = demand {
                        d.update(Arc::make_mut(problem), core);
                    }
                    publish(problem, core, state);
                    if let Some(present) = presence(problem) {
                        more.extend(core.set_present(problem, present));
                    }
                    if let Some(l) = live.as_mut() {
                        let seen = live_apps();
                        if seen.apps != l.view.apps {
                            l.view.apps = seen.apps;
                            l.dirty = true;
                        }
                        // Reported with the row, not part of the problem: no rebuild.
                        l.view.identities = seen.identities;
                        let policy = with_weights(&l.coordinator_policy, &seen.weights);
                        l.tenant_weights = seen.weights;
                        if policy != l.view.policy {
                            l.view.policy = policy;
                            l.dirty = true;
                        }
                        let floor = l.view.nic.max_active as f64 * l.view.policy.x_min;
                        let budget = ungoverned::host_budget(l.base_budget, seen.ungoverned, floor);
                        // Small moves wait for a step; the configured budget comes back
                        // whole when the last ungoverned sender stops.
                        let moved = (budget - l.view.nic.wqe_budget).abs();
                        let restored = budget == l.base_budget && moved > 0.0;
                        if moved >= ungoverned::BUDGET_STEP || restored {
                            info!(
                                wqe_budget = budget,
                                configured = l.base_budget,
                                ungoverned_share = seen.ungoverned,
                                "the host's budget less what ungoverned processes send"
                            );
                            l.view.nic.wqe_budget = budget;
                            l.dirty = true;
                        }
                        let due = l.last_report.is_none_or(|t| t.elapsed() >= REPORT_PERIOD);
                        if due && core.is_member() && !l.dirty {
                            l.last_report = Some(Instant::now());
                            more.push(AgentAction::Send(l.view.report(core, problem)));
                        }
                    }
                }
                AgentAction::Policy(p) => {
                    if let Some(l) = live.as_mut() {
                        info!(
                            default_weight = p.default_weight,
                            weights = ?p.weights,
                            "the coordinator's policy"
                        );
                        l.view.policy = with_weights(&p, &l.tenant_weights);
                        l.coordinator_policy = p;
                        l.dirty = true;
                    }
                }
                AgentAction::Facilities(f) => {
                    if let Some(l) = live.as_mut() {
                        debug!(facilities = f.len(), "the coordinator's facility table");
                        l.view.facilities = f;
                        l.dirty = true;
                    }
                }
                AgentAction::SetWeight { app, weight } => {
                    AgentCore::apply_weight(Arc::make_mut(problem), app, weight);
                }
                AgentAction::Event(e) => match e {
                    AgentEvent::Welcomed { epoch, iteration } => {
                        info!(epoch, iteration, "joined the coordinator")
                    }
                    AgentEvent::Refused(r) => warn!("coordinator refused us: {r}"),
                    AgentEvent::FailStatic(r) => {
                        stats.fail_static.inc();
                        warn!("fail-static, keeping last rates: {r}")
                    }
                    AgentEvent::IgnoredRound { epoch, iteration } => {
                        debug!(epoch, iteration, "ignored an old round")
                    }
                    AgentEvent::Selected {
                        exchange,
                        parked,
                        activated,
                    } => {
                        stats.exchanges.inc();
                        stats.parks.inc_by(parked.is_some() as u64);
                        stats
                            .activations
                            .inc_by(activated.is_some() as u64);
                        // Up to every `T_sel` for ever: DEBUG, counted in the metrics.
                        debug!(exchange, ?parked, ?activated, "selection round applied")
                    }
                    AgentEvent::Restarted { exchange } => {
                        stats.exchanges.inc();
                        debug!(exchange, "priced restart: new active set")
                    }
                    AgentEvent::AppsChanged { arrived, left } => {
                        let names = |pairs: &[usize]| -> Vec<&str> {
                            pairs
                                .iter()
                                .map(|&p| problem.app_names[problem.pairs[p].app as usize].as_str())
                                .collect()
                        };
                        info!(
                            arrived = ?names(&arrived),
                            left = ?names(&left),
                            "apps changed; asking for a re-selection"
                        )
                    }
                    AgentEvent::WeightSet { app, weight } => {
                        info!(app, weight, "operator set a weight")
                    }
                    AgentEvent::HeartbeatShortened {
                        offered,
                        used,
                        timeout,
                    } => warn!(
                        "the coordinator's heartbeat_ms ({}) does not fit three times into this agent's coordinator_timeout_ms ({}): heartbeating every {} ms instead; align the two configs",
                        offered.as_millis(),
                        timeout.as_millis(),
                        used.as_millis()
                    ),
                    AgentEvent::IgnoredWeight { app, weight } => {
                        warn!(
                            app,
                            weight, "ignored a weight change for an unknown app or a bad value"
                        )
                    }
                },
            }
        }
        if let Some(l) = live.as_mut().filter(|l| l.dirty && core.can_rebuild()) {
            l.dirty = false;
            l.last_report = Some(Instant::now());
            let r = l.view.rebuild(core, Arc::make_mut(problem));
            if !r.arrived.is_empty() || !r.left.is_empty() {
                info!(arrived = ?r.arrived, left = ?r.left, "apps changed; asking for a re-selection");
            }
            // Before the coordinator's table arrives every peer is unknown: nothing to say.
            if !l.view.facilities.is_empty() {
                for u in r.unknown {
                    if l.unknown_logged.insert((u.app.clone(), u.gid)) {
                        warn!(
                            app = %u.app,
                            peer = %drum_table::message::gid_hex(&u.gid),
                            "a connection of this app ends at a GID no agent's host owns; its traffic loads no receive link"
                        );
                    }
                }
            }
            if let Some(d) = demand.as_mut() {
                d.rebase(
                    problem,
                    0,
                    max_cqe_per_wqe(&l.view.nic, problem.params.x_min),
                );
            }
            more.extend(r.actions);
        }
        if !more.is_empty() {
            actions = more;
            continue;
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
                Some((link, Ok(m))) => match mux.incoming(link, m) {
                    Ok(None) => {
                        let mut out = Vec::new();
                        for (link, reply) in mux.take_replies() {
                            if let Err(e) = quic::send_msg(&mut sends[link], &reply).await {
                                warn!("lost the coordinator: {e}; keeping last rates");
                                out = core.on_disconnected(origin.elapsed(), &e.to_string());
                                break;
                            }
                        }
                        out
                    }
                    Ok(Some(m)) => {
                        let t = Instant::now();
                        let out = core.on_message(origin.elapsed(), problem, m);
                        stats.step_seconds.inc_by(t.elapsed().as_secs_f64());
                        out
                    }
                    Err(e) => {
                        warn!("{e}; keeping last rates");
                        let mut out = core.on_disconnected(origin.elapsed(), &e);
                        out.push(AgentAction::Disconnect(e));
                        out
                    }
                },
                Some((_, Err(e))) => {
                    warn!("lost the coordinator: {e}; keeping last rates");
                    core.on_disconnected(origin.elapsed(), &e)
                }
                None => core.on_disconnected(origin.elapsed(), "connection reader ended"),
            },
            _ = tokio::time::sleep_until(wake) => core.tick(origin.elapsed()),
            _ = shutdown.as_mut() => {
                stop = true;
                for send in &mut sends {
                    let _ = quic::send_msg(send, &AgentMsg::Leave).await;
                    let _ = send.finish();
                }
                // Closing the connection discards unacknowledged stream data: wait (briefly)
                // until each coordinator has the Leave, or it would see a lost connection.
                for send in &mut sends {
                    let _ = tokio::time::timeout(Duration::from_millis(500), send.stopped()).await;
                }
                Vec::new()
            }
        };
    }
    for r in &readers {
        r.abort();
    }
    if !stop {
        for conn in &conns {
            conn.close(quic::CLOSE_NORMAL.into(), b"reconnecting");
        }
    }
    Ok(stop)
}
