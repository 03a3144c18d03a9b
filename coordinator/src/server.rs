//! `drum-coordinator serve`: the pure coordinator state machine under QUIC.
//!
//! One task owns the state machine and a timer; one task per connection reads frames into it
//! and one writes its answers out. Transport failures that do not concern the rounds (a
//! handshake refused, a bad frame) close only the offending connection, with a log line.

use crate::admin::{self, AdminRequest, Metrics, Reply};
use anyhow::{bail, Context, Result};
use drum_common::live::LivePolicy;
use drum_common::model::Problem;
use drum_common::protocol::coordinator::{
    Action, Coordinator, CoordinatorConfig, Event, MemberId, OperatorState, SelectionSchedule,
};
use drum_common::protocol::{facility_digest, valid_name, AgentMsg, CoordMsg, Shard};
use drum_common::selection::SelectionOptions;
use drum_common::solver::{default_rho, SolveOptions};
use drum_net::quic::{self, FramedRecv};
use drum_net::{NetError, TlsFiles};
use serde::Deserialize;
use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot};
use tracing::{debug, info, warn};

mod state_file;

use state_file::restore_state;
pub use state_file::{read_state, set_aside, write_state, STATE_FORMAT};

/// `serve --config FILE` (TOML); docs/control-plane.md lists every key.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ServeSettings {
    /// UDP address for QUIC.
    pub listen: SocketAddr,
    /// Instance file (JSON): the facilities and, unless `rho` is set, the default penalty.
    /// None: the live problem (docs/live-problem.md), learnt from the agents as they run.
    #[serde(default)]
    pub instance: Option<PathBuf>,
    pub tls: TlsFiles,
    /// TCP address of the read-only admin endpoint (`/metrics`, `/status`, `/snapshot`); it
    /// is not authenticated, so it refuses operator commands (see `admin_socket`).
    #[serde(default)]
    pub admin_listen: Option<SocketAddr>,
    #[serde(default)]
    pub rho: Option<f64>,
    #[serde(default = "one")]
    pub min_members: usize,
    #[serde(default = "d_round_deadline")]
    pub round_deadline_ms: u64,
    #[serde(default = "d_staleness")]
    pub max_staleness: u32,
    #[serde(default = "d_interval")]
    pub round_interval_ms: u64,
    #[serde(default = "d_heartbeat")]
    pub heartbeat_ms: u64,
    #[serde(default = "d_timeout")]
    pub member_timeout_ms: u64,
    #[serde(default)]
    pub max_iterations: Option<u64>,
    /// Accept a join only if the client certificate carries the joining host id as a DNS
    /// name (as `dev-certs` issues them); otherwise any certificate from the CA may join as
    /// any host.
    #[serde(default = "yes")]
    pub bind_host_to_certificate: bool,
}

fn yes() -> bool {
    true
}

fn one() -> usize {
    1
}
fn d_round_deadline() -> u64 {
    50
}
fn d_staleness() -> u32 {
    3
}
fn d_interval() -> u64 {
    10
}
fn d_heartbeat() -> u64 {
    500
}
fn d_timeout() -> u64 {
    3000
}

/// The keys of the `serve` config beyond [`ServeSettings`]: the selection schedule (defaults:
/// those of `drum-coordinator solve`). They live in the same TOML file; they are a separate
/// struct so that code building a `ServeSettings` literal keeps compiling.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ServeOptions {
    /// Re-run the greedy initial selection at half the prices after `iters_per_round`
    /// iterations (docs/model.md), as `solve` does.
    #[serde(default = "yes")]
    pub priced_start: bool,
    /// Top-k selection rounds (0 with `priced_start = false`: fixed active sets).
    #[serde(default = "d_selection_rounds")]
    pub selection_rounds: u32,
    /// ADMM iterations between two selection rounds (fewer once both residuals are within
    /// `eps_primal` and `eps_dual`).
    #[serde(default = "d_iters_per_round")]
    pub iters_per_round: u32,
    #[serde(default = "d_eps")]
    pub eps_primal: f64,
    #[serde(default = "d_eps")]
    pub eps_dual: f64,
    /// Seed of the selection's coin flips (`solve --selection-seed`).
    #[serde(default = "d_seed")]
    pub selection_seed: u64,
    /// `T_sel` (docs/design.md §2): once the schedule is done, a selection round at most this
    /// often (and at least `iters_per_round` iterations apart); 0: none, the sets then change
    /// only when an agent's apps arrive or leave.
    #[serde(default = "d_selection_period")]
    pub selection_period_ms: u64,
    /// The facilities this process owns (`serve --shard I/N`; not a config key).
    #[serde(skip)]
    pub shard: Shard,
    /// Where operator changes (`set-capacity`, `set-weight`, drained hosts) are kept across
    /// restarts: JSON, replaced atomically after every change, loaded at start. None: they
    /// are lost with the process.
    #[serde(default)]
    pub state_file: Option<PathBuf>,
    /// The live problem's shape and weights (`[policy]`; only without an instance).
    #[serde(default)]
    pub policy: Option<PolicySettings>,
    /// Unix socket for operator commands (`set-capacity`, `set-weight`, `drain-host`,
    /// `undrain-host`) and reads: its file permissions (0660, the process's user and group)
    /// decide who may change the coordinator; `admin_listen` is read-only. None: no changes.
    #[serde(default)]
    pub admin_socket: Option<PathBuf>,
}

/// `[policy]`: the live problem's weights and shape, pushed to every agent.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct PolicySettings {
    /// The weight of every app `weights` does not name.
    #[serde(default = "d_weight")]
    pub default_weight: f64,
    /// `app = weight`.
    #[serde(default)]
    pub weights: BTreeMap<String, f64>,
    #[serde(default = "d_weight")]
    pub alpha: f64,
    #[serde(default = "d_beta")]
    pub beta: f64,
    #[serde(default = "d_x_min")]
    pub x_min: f64,
}

fn d_weight() -> f64 {
    1.0
}
fn d_beta() -> f64 {
    LivePolicy::default().beta
}
fn d_x_min() -> f64 {
    LivePolicy::default().x_min
}

impl Default for PolicySettings {
    fn default() -> Self {
        PolicySettings {
            default_weight: d_weight(),
            weights: BTreeMap::new(),
            alpha: d_weight(),
            beta: d_beta(),
            x_min: d_x_min(),
        }
    }
}

impl PolicySettings {
    /// The policy, checked: a bad weight (0, NaN, 1e308, …) or name is an error naming it.
    pub fn policy(&self) -> Result<LivePolicy> {
        if let Some(app) = self.weights.keys().find(|a| !valid_name(a)) {
            bail!("[policy.weights]: app name {app:?} is not 1 to 64 letters, digits, '.', '_' or '-'");
        }
        let p = LivePolicy {
            alpha: self.alpha,
            beta: self.beta,
            x_min: self.x_min,
            default_weight: self.default_weight,
            weights: self.weights.iter().map(|(a, &w)| (a.clone(), w)).collect(),
        };
        p.check().map_err(|e| anyhow::anyhow!("[policy]: {e}"))?;
        Ok(p)
    }
}

/// The ADMM penalty of the live problem unless `rho` is set: the default rule
/// ([`default_rho`]) on a typical live host — 16 apps of weight 1 on one receive link at a
/// fair share of the line each.
pub fn live_rho(policy: &LivePolicy) -> f64 {
    let x = (1.0f64 / 16.0).max(policy.x_min);
    let u = drum_common::utility::Utility {
        w: policy.default_weight,
        a: 1.0,
        shape: drum_common::utility::Shape {
            alpha: policy.alpha,
            beta: policy.beta,
            x_min: policy.x_min,
        },
    };
    drum_common::solver::RHO_FACTOR * -u.d2(x)
}

/// The keys that belong to [`ServeOptions`].
const OPTION_KEYS: &[&str] = &[
    "priced_start",
    "selection_rounds",
    "iters_per_round",
    "eps_primal",
    "eps_dual",
    "selection_seed",
    "selection_period_ms",
    "state_file",
    "policy",
    "admin_socket",
];

/// The longest `T_sel` accepted: anything longer is surely a unit mistake.
const MAX_SELECTION_PERIOD_MS: u64 = 3_600_000;

fn d_selection_rounds() -> u32 {
    SolveOptions::default().rounds as u32
}
fn d_iters_per_round() -> u32 {
    SolveOptions::default().iters_per_round as u32
}
fn d_eps() -> f64 {
    SolveOptions::default().eps_primal
}
fn d_seed() -> u64 {
    SelectionOptions::default().seed
}
/// The slow end of docs/design.md's 10–100 ms: a swap costs a refill of the NIC's QP cache.
fn d_selection_period() -> u64 {
    100
}

impl Default for ServeOptions {
    fn default() -> Self {
        Self {
            priced_start: true,
            selection_rounds: d_selection_rounds(),
            iters_per_round: d_iters_per_round(),
            eps_primal: d_eps(),
            eps_dual: d_eps(),
            selection_seed: d_seed(),
            selection_period_ms: d_selection_period(),
            shard: Shard::WHOLE,
            state_file: None,
            policy: None,
            admin_socket: None,
        }
    }
}

impl ServeOptions {
    /// The options of `drum-coordinator solve` with the same selection schedule.
    pub fn solve_options(&self) -> SolveOptions {
        let mut o = SolveOptions {
            priced_start: self.priced_start,
            rounds: self.selection_rounds as usize,
            iters_per_round: self.iters_per_round as usize,
            eps_primal: self.eps_primal,
            eps_dual: self.eps_dual,
            // The service runs the swap rounds of the schedule; the verified local search of
            // the offline solver is not part of the control plane (docs/model.md, "Selection").
            polish_trials: 0,
            ..SolveOptions::default()
        };
        o.selection.seed = self.selection_seed;
        o
    }

    pub fn schedule(&self) -> SelectionSchedule {
        SelectionSchedule {
            period: (self.selection_period_ms > 0)
                .then(|| Duration::from_millis(self.selection_period_ms)),
            ..SelectionSchedule::from_solve(&self.solve_options())
        }
    }

    fn validate(&self) -> Result<()> {
        if self.iters_per_round == 0 {
            bail!("iters_per_round must be at least 1");
        }
        if self.selection_period_ms > MAX_SELECTION_PERIOD_MS {
            bail!(
                "selection_period_ms must be at most {MAX_SELECTION_PERIOD_MS} (one hour), got {} \
                 (0 turns periodic re-selection off)",
                self.selection_period_ms
            );
        }
        for (name, v) in [("eps_primal", self.eps_primal), ("eps_dual", self.eps_dual)] {
            if !(v.is_finite() && v >= 0.0) {
                bail!("{name} must be finite and non-negative, got {v}");
            }
        }
        Ok(())
    }
}

impl ServeSettings {
    pub fn load(path: &Path) -> Result<Self> {
        Ok(Self::load_with_options(path)?.0)
    }

    /// Loads the whole `serve` config: the settings and the selection options.
    pub fn load_with_options(path: &Path) -> Result<(Self, ServeOptions)> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let mut table: toml::Table =
            toml::from_str(&text).with_context(|| format!("in {}", path.display()))?;
        let mut extra = toml::Table::new();
        for key in OPTION_KEYS {
            if let Some(v) = table.remove(*key) {
                extra.insert(key.to_string(), v);
            }
        }
        let mut s: Self = toml::Value::Table(table)
            .try_into()
            .with_context(|| format!("in {}", path.display()))?;
        let mut options: ServeOptions = toml::Value::Table(extra)
            .try_into()
            .with_context(|| format!("in {}", path.display()))?;
        let base = path.parent().unwrap_or(Path::new(".")).to_path_buf();
        options.state_file = options.state_file.map(|p| base.join(p));
        options.admin_socket = options.admin_socket.map(|p| base.join(p));
        s.instance = s.instance.map(|p| base.join(p));
        if s.instance.is_some() && options.policy.is_some() {
            bail!(
                "[policy] in {} belongs to the live problem; with an instance the weights are the instance's (and set-weight)",
                path.display()
            );
        }
        if let Some(p) = &options.policy {
            p.policy()
                .with_context(|| format!("in {}", path.display()))?;
        }
        s.tls.rebase(&base);
        s.validate()?;
        options
            .validate()
            .with_context(|| format!("in {}", path.display()))?;
        Ok((s, options))
    }

    fn validate(&self) -> Result<()> {
        if let Some(rho) = self.rho {
            if !(rho.is_finite() && rho > 0.0) {
                bail!("rho must be positive and finite, got {rho}");
            }
        }
        if self.heartbeat_ms == 0 || self.member_timeout_ms <= self.heartbeat_ms {
            bail!(
                "member_timeout_ms ({}) must exceed heartbeat_ms ({}), which must be positive",
                self.member_timeout_ms,
                self.heartbeat_ms
            );
        }
        if self.round_deadline_ms == 0 {
            bail!("round_deadline_ms must be positive");
        }
        Ok(())
    }
}

/// What a connection task sends to the state machine.
pub(crate) enum Input {
    Connected(Link),
    Msg(MemberId, AgentMsg),
    /// The connection ended; `true` when its idle timeout ended it (the peer went silent).
    Closed(MemberId, bool),
    Admin(AdminRequest, oneshot::Sender<Reply>),
    /// The TLS files were read again: check every established peer against them.
    Reloaded(Arc<quic::ServerTls>),
}

pub(crate) enum Outgoing {
    Msg(CoordMsg),
    Close(u32, String),
}

/// One connection as the state machine's loop sees it.
pub(crate) struct Link {
    pub(crate) id: MemberId,
    pub(crate) remote: SocketAddr,
    pub(crate) conn: quinn::Connection,
    pub(crate) out: mpsc::UnboundedSender<Outgoing>,
}

/// A bound, not yet running coordinator.
pub struct Server {
    settings: ServeSettings,
    options: ServeOptions,
    /// None: the live problem.
    problem: Option<Problem>,
    endpoint: quinn::Endpoint,
    admin: Option<tokio::net::TcpListener>,
    admin_socket: Option<(tokio::net::UnixListener, PathBuf)>,
    reload: Arc<tokio::sync::Notify>,
}

/// Binds the admin socket at `path` with mode 0660: the coordinator's user and group may
/// send operator commands, nobody else. A socket file left by a coordinator that died is
/// replaced; any other file there is an error.
fn bind_admin_socket(path: &Path) -> Result<tokio::net::UnixListener> {
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => std::fs::remove_file(path)
            .with_context(|| format!("removing the stale admin socket {}", path.display()))?,
        Ok(_) => bail!("admin_socket {} exists and is not a socket", path.display()),
        Err(_) => {}
    }
    let listener = tokio::net::UnixListener::bind(path)
        .with_context(|| format!("binding the admin socket {}", path.display()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660))
        .with_context(|| format!("setting the mode of {}", path.display()))?;
    Ok(listener)
}

impl Server {
    /// Binds with the default [`ServeOptions`] (the selection schedule of `solve`).
    pub async fn bind(settings: ServeSettings) -> Result<Self> {
        Self::bind_with(settings, ServeOptions::default()).await
    }

    pub async fn bind_with(settings: ServeSettings, options: ServeOptions) -> Result<Self> {
        options.validate()?;
        let problem = match &settings.instance {
            Some(path) => Some(drum_net::config::load_problem(path)?),
            None if options.shard != Shard::WHOLE => {
                bail!("the live problem (no instance) has one coordinator: no --shard")
            }
            None => None,
        };
        let idle = Duration::from_millis(settings.member_timeout_ms);
        let endpoint = quic::server_endpoint(&settings.tls, settings.listen, idle)
            .with_context(|| format!("binding QUIC on {}", settings.listen))?;
        let admin = match settings.admin_listen {
            Some(a) => Some(
                tokio::net::TcpListener::bind(a)
                    .await
                    .with_context(|| format!("binding admin endpoint on {a}"))?,
            ),
            None => None,
        };
        let admin_socket = match &options.admin_socket {
            Some(p) => Some((bind_admin_socket(p)?, p.clone())),
            None => None,
        };
        Ok(Self {
            settings,
            options,
            problem,
            endpoint,
            admin,
            admin_socket,
            reload: Arc::new(tokio::sync::Notify::new()),
        })
    }

    /// Notifying it makes the running server read its TLS files (certificate, key, CA, CRL)
    /// again, as `serve` does on SIGHUP: new handshakes use them, established connections go
    /// on unless their peer's certificate is no longer accepted (revoked, or from a CA no
    /// longer trusted). Files that do not load leave everything as it was.
    pub fn reloader(&self) -> Arc<tokio::sync::Notify> {
        self.reload.clone()
    }

    pub fn local_addr(&self) -> Result<SocketAddr> {
        Ok(self.endpoint.local_addr()?)
    }

    pub fn admin_addr(&self) -> Option<SocketAddr> {
        self.admin.as_ref().and_then(|a| a.local_addr().ok())
    }

    /// Runs until `shutdown` resolves.
    pub async fn run(self, shutdown: impl std::future::Future<Output = ()>) -> Result<()> {
        let Server {
            settings,
            options,
            problem,
            endpoint,
            admin,
            admin_socket,
            reload,
        } = self;
        let live_policy = match &problem {
            Some(_) => None,
            None => Some(options.policy.clone().unwrap_or_default().policy()?),
        };
        let rho = settings
            .rho
            .unwrap_or_else(|| match (&problem, &live_policy) {
                (Some(p), _) => default_rho(p),
                (None, Some(policy)) => live_rho(policy),
                (None, None) => unreachable!("a policy without an instance"),
            });
        let cfg = CoordinatorConfig {
            rho,
            facility_digest: problem.as_ref().map_or(0, facility_digest),
            heartbeat_interval: Duration::from_millis(settings.heartbeat_ms),
            member_timeout: Duration::from_millis(settings.member_timeout_ms),
            round_deadline: Duration::from_millis(settings.round_deadline_ms),
            max_staleness: settings.max_staleness,
            round_interval: Duration::from_millis(settings.round_interval_ms),
            min_members: settings.min_members,
            max_iterations: settings.max_iterations,
            selection: options.schedule(),
            shard: options.shard,
        };
        let facilities = problem
            .as_ref()
            .map_or(Vec::new(), |p| p.facilities.clone());
        let owned = facilities
            .iter()
            .filter(|f| options.shard.owns(&f.id))
            .count();
        if let Some(p) = &live_policy {
            info!(default_weight = p.default_weight, weights = ?p.weights, "live problem: no instance; hosts, apps and facilities come from the agents");
        }
        info!(
            listen = %endpoint.local_addr()?,
            facilities = facilities.len(),
            shard = %options.shard,
            owned,
            rho,
            "coordinator serving"
        );
        let metrics = Arc::new(Metrics::default());
        let (tx, rx) = mpsc::unbounded_channel();
        let forward = {
            let tx = tx.clone();
            move |req| {
                let tx = tx.clone();
                async move {
                    let (reply, answer) = oneshot::channel();
                    tx.send(Input::Admin(req, reply)).ok()?;
                    answer.await.ok()
                }
            }
        };
        if let Some(listener) = admin {
            tokio::spawn(admin::serve(listener, forward.clone()));
        }
        let socket_path = admin_socket.map(|(listener, path)| {
            info!(admin_socket = %path.display(), "operator commands on the admin socket (mode 0660)");
            tokio::spawn(admin::serve_unix(listener, forward));
            path
        });
        let policy = ConnPolicy {
            join_timeout: Duration::from_millis(settings.member_timeout_ms),
            bind_host: settings.bind_host_to_certificate,
        };
        let reloads = tokio::spawn(reload_loop(
            reload,
            endpoint.clone(),
            settings.tls.clone(),
            Duration::from_millis(settings.member_timeout_ms),
            tx.clone(),
        ));
        let accept = tokio::spawn(accept_loop(endpoint.clone(), tx, metrics.clone(), policy));
        let mut core = match (&problem, live_policy) {
            (Some(p), _) => {
                let mut core = Coordinator::new(cfg, facilities);
                core.set_apps(p.app_names.clone());
                core.set_hosts(p.hosts.iter().map(|h| h.id.clone()).collect());
                core
            }
            (None, Some(policy)) => Coordinator::new_live(cfg, policy),
            (None, None) => unreachable!("a policy without an instance"),
        };
        if let Some(p) = &options.state_file {
            restore_state(&mut core, p);
        }
        let state_file = options.state_file.clone();
        tokio::select! {
            r = core_loop(core, rx, metrics, state_file) => r?,
            _ = shutdown => info!("coordinator shutting down"),
        }
        accept.abort();
        reloads.abort();
        if let Some(p) = socket_path {
            let _ = std::fs::remove_file(p);
        }
        endpoint.close(quic::CLOSE_NORMAL.into(), b"coordinator shutting down");
        Ok(())
    }
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// Reads the TLS files again on every notification (see [`Server::reloader`]).
async fn reload_loop(
    reload: Arc<tokio::sync::Notify>,
    endpoint: quinn::Endpoint,
    tls: TlsFiles,
    idle: Duration,
    tx: mpsc::UnboundedSender<Input>,
) {
    loop {
        reload.notified().await;
        match quic::ServerTls::load(&tls, idle) {
            Ok(t) => {
                endpoint.set_server_config(Some(t.config.clone()));
                info!(
                    cert = %tls.cert.display(),
                    crl = ?tls.crl,
                    "reloaded the TLS files; new handshakes use them"
                );
                if tx.send(Input::Reloaded(Arc::new(t))).is_err() {
                    return;
                }
            }
            Err(e) => warn!("TLS reload failed, keeping the previous certificates: {e}"),
        }
    }
}

/// What a connection must do before the state machine hears of it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ConnPolicy {
    pub(crate) join_timeout: Duration,
    pub(crate) bind_host: bool,
}

pub(crate) async fn accept_loop(
    endpoint: quinn::Endpoint,
    tx: mpsc::UnboundedSender<Input>,
    metrics: Arc<Metrics>,
    policy: ConnPolicy,
) {
    while let Some(incoming) = endpoint.accept().await {
        let tx = tx.clone();
        let metrics = metrics.clone();
        tokio::spawn(async move {
            let remote = incoming.remote_address();
            let conn = match incoming.await {
                Ok(c) => c,
                Err(e) => {
                    metrics.refused_handshakes.inc();
                    warn!(%remote, "refused connection: {e}");
                    return;
                }
            };
            if let Err(e) = connection(conn, remote, tx, &metrics, policy).await {
                debug!(%remote, "connection ended: {e}");
            }
        });
    }
}

async fn connection(
    conn: quinn::Connection,
    remote: SocketAddr,
    tx: mpsc::UnboundedSender<Input>,
    metrics: &Metrics,
    policy: ConnPolicy,
) -> Result<(), NetError> {
    let join_timeout = policy.join_timeout;
    // A peer that completes the handshake but opens no stream would hold its connection
    // (and memory) for ever: it gets the join timeout, as one that opens a stream and
    // sends no join.
    let (mut send, recv) = match tokio::time::timeout(join_timeout, conn.accept_bi()).await {
        Ok(r) => r?,
        Err(_) => {
            warn!(%remote, "no stream within {join_timeout:?}; closing the connection");
            conn.close(quic::CLOSE_PROTOCOL.into(), b"no stream");
            return Ok(());
        }
    };
    let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
    let (out_tx, mut out_rx) = mpsc::unbounded_channel();
    let refuse_tx = out_tx.clone();
    let link = Link {
        id,
        remote,
        conn: conn.clone(),
        out: out_tx,
    };
    if tx.send(Input::Connected(link)).is_err() {
        return Ok(());
    }
    let writer_conn = conn.clone();
    let writer = tokio::spawn(async move {
        while let Some(o) = out_rx.recv().await {
            match o {
                Outgoing::Msg(m) => {
                    if quic::send_msg(&mut send, &m).await.is_err() {
                        break;
                    }
                }
                Outgoing::Close(code, reason) => {
                    // Let a last message (e.g. `Refused`) reach the peer before the close,
                    // which would discard unacknowledged stream data.
                    if send.finish().is_ok() {
                        let _ =
                            tokio::time::timeout(Duration::from_millis(500), send.stopped()).await;
                    }
                    writer_conn.close(code.into(), reason.as_bytes());
                    break;
                }
            }
        }
    });
    let mut framed = FramedRecv::new(recv);
    let mut joined = false;
    let result = loop {
        // A peer that connects but never joins would hold a connection forever.
        let next = if joined {
            framed.next::<AgentMsg>().await
        } else {
            match tokio::time::timeout(join_timeout, framed.next::<AgentMsg>()).await {
                Ok(r) => r,
                Err(_) => {
                    warn!(%remote, "no join within {join_timeout:?}; closing the connection");
                    conn.close(quic::CLOSE_PROTOCOL.into(), b"no join");
                    break Ok(());
                }
            }
        };
        joined = true;
        match next {
            Ok(Some(AgentMsg::Join(j)))
                if policy.bind_host && !quic::certificate_names(&conn, &j.host) =>
            {
                metrics.refused_joins.inc();
                let reason = format!(
                    "the client certificate is not issued to host {:?} (no such DNS name)",
                    j.host
                );
                warn!(%remote, member = id, "refused join: {reason}");
                let _ = refuse_tx.send(Outgoing::Msg(CoordMsg::Refused {
                    reason: reason.clone(),
                }));
                let _ = refuse_tx.send(Outgoing::Close(quic::CLOSE_PROTOCOL, reason));
                // The writer closes the connection once the refusal is delivered.
                let _ = tokio::time::timeout(Duration::from_secs(1), conn.closed()).await;
                break Ok(());
            }
            Ok(Some(m)) => {
                if tx.send(Input::Msg(id, m)).is_err() {
                    break Ok(());
                }
            }
            Ok(None) => break Ok(()),
            Err(NetError::Wire(e)) => {
                metrics.refused_frames.inc();
                warn!(%remote, member = id, "refused frame: {e}; closing the connection");
                conn.close(quic::CLOSE_PROTOCOL.into(), e.to_string().as_bytes());
                break Ok(());
            }
            Err(e) => break Err(e),
        }
    };
    // A peer that died (kill -9, a crash, a cut link) goes silent: the QUIC idle timeout
    // (the member timeout) ends its connection. That is a member timeout too.
    let timed_out = matches!(
        result,
        Err(NetError::Connection(quinn::ConnectionError::TimedOut))
    );
    let _ = tx.send(Input::Closed(id, timed_out));
    writer.abort();
    result
}

async fn core_loop(
    mut core: Coordinator,
    mut rx: mpsc::UnboundedReceiver<Input>,
    metrics: Arc<Metrics>,
    state_file: Option<PathBuf>,
) -> Result<()> {
    let origin = Instant::now();
    let mut writers: HashMap<MemberId, Link> = HashMap::new();
    let mut closing: std::collections::HashSet<MemberId> = std::collections::HashSet::new();
    loop {
        let wake = core
            .next_wakeup()
            .map(|w| tokio::time::Instant::from_std(origin + w));
        let actions = tokio::select! {
            input = rx.recv() => {
                let Some(input) = input else { return Ok(()) };
                let now = origin.elapsed();
                match input {
                    Input::Connected(link) => {
                        writers.insert(link.id, link);
                        Vec::new()
                    }
                    Input::Reloaded(tls) => {
                        let revoked: Vec<(MemberId, String)> = writers
                            .values()
                            .filter_map(|l| tls.check_peer(&l.conn).err().map(|e| (l.id, e)))
                            .collect();
                        for (id, e) in revoked {
                            let l = writers.remove(&id).expect("listed above");
                            metrics.refused_handshakes.inc();
                            warn!(
                                member = id,
                                remote = %l.remote,
                                "refused connection after the reload: {e}; closing it"
                            );
                            closing.insert(id);
                            let reason = format!("certificate no longer accepted: {e}");
                            let _ = l.out.send(Outgoing::Close(quic::CLOSE_PROTOCOL, reason));
                        }
                        Vec::new()
                    }
                    // A connection being closed may still deliver frames: ignore them.
                    Input::Msg(id, _) if closing.contains(&id) => Vec::new(),
                    Input::Msg(id, m) => core.on_message(now, id, m),
                    Input::Closed(id, timed_out) => {
                        writers.remove(&id);
                        closing.remove(&id);
                        if timed_out {
                            core.on_silence(now, id)
                        } else {
                            core.on_disconnect(now, id)
                        }
                    }
                    Input::Admin(req, reply) => {
                        let changes = req.is_change();
                        let what = changes.then(|| format!("{req:?}"));
                        let (mut answer, actions) = admin::answer(&mut core, &metrics, req, now);
                        if let (true, 200, Some(p)) = (changes, answer.code, &state_file) {
                            if let Err(e) = write_state(p, &core.operator_state()) {
                                warn!("operator change not persisted: {e:#}");
                                answer.code = 500;
                                answer.body = format!(
                                    "{}but it was NOT persisted: {e:#}\n",
                                    answer.body
                                );
                            }
                        }
                        // The audit trail of operator changes.
                        match (what, answer.code) {
                            // 500: made, but not persisted (warned above).
                            (Some(w), 200 | 500) => info!(request = %w, "operator change: {}", answer.body.trim_end()),
                            (Some(w), _) => warn!(request = %w, "operator change refused: {}", answer.body.trim_end()),
                            (None, _) => {}
                        }
                        let _ = reply.send(answer);
                        actions
                    }
                }
            }
            _ = sleep_until(wake) => core.tick(origin.elapsed()),
        };
        for a in actions {
            match a {
                Action::Send(id, m) => {
                    if let Some(l) = writers.get(&id) {
                        let _ = l.out.send(Outgoing::Msg(m));
                    }
                }
                Action::Close(id, reason) => {
                    if let Some(l) = writers.remove(&id) {
                        closing.insert(id);
                        info!(member = id, remote = %l.remote, "closing connection: {reason}");
                        let _ = l.out.send(Outgoing::Close(quic::CLOSE_PROTOCOL, reason));
                    }
                }
                Action::Expire(id) => {
                    if let Some(l) = writers.remove(&id) {
                        closing.insert(id);
                        info!(member = id, remote = %l.remote, "closing connection: heartbeat timeout");
                        let _ = l.out.send(Outgoing::Close(
                            quic::CLOSE_TIMEOUT,
                            "heartbeat timeout".into(),
                        ));
                    }
                }
                Action::Event(e) => log_event(&e, &metrics, &writers),
            }
        }
    }
}

pub(crate) async fn sleep_until(t: Option<tokio::time::Instant>) {
    match t {
        Some(t) => tokio::time::sleep_until(t).await,
        None => std::future::pending().await,
    }
}

fn log_event(e: &Event, metrics: &Metrics, writers: &HashMap<MemberId, Link>) {
    match e {
        Event::Joined {
            member,
            host,
            epoch,
        } => info!(member, host, epoch, "host joined"),
        Event::Left { member, host, why } => info!(member, host, ?why, "host left"),
        Event::Refused { member, reason } => warn!(member, "refused: {reason}"),
        Event::DuplicateHost {
            member,
            incumbent,
            host,
            quiet,
        } => {
            let remote = |id: &MemberId| writers.get(id).map(|l| l.remote.to_string());
            warn!(
                host,
                newcomer = member,
                newcomer_remote = remote(member).unwrap_or_default(),
                incumbent,
                incumbent_remote = remote(incumbent).unwrap_or_default(),
                "refused join: host {host} is already a member (connection {incumbent}, heard from {} ms ago); \
                 a second agent with this host id? the incumbent keeps its place",
                quiet.as_millis()
            )
        }
        Event::RoundDone {
            epoch,
            iteration,
            residuals,
            stale,
            took,
        } => {
            metrics.record_round(*took, *stale);
            debug!(
                epoch,
                iteration,
                primal = residuals.primal,
                dual = residuals.dual,
                stale,
                "round done"
            );
        }
        Event::Late { member, iteration } => debug!(member, iteration, "late contribution"),
        Event::Duplicate { member, iteration } => {
            debug!(member, iteration, "duplicate contribution")
        }
        Event::SelectionStarted {
            exchange,
            round,
            iteration,
        } => match round {
            // Up to every `T_sel` for ever: DEBUG, counted in the metrics.
            Some(round) => debug!(exchange, round, iteration, "selection round started"),
            None => debug!(exchange, iteration, "priced restart started"),
        },
        Event::ReselectRequested {
            member,
            host,
            iteration,
            taken: true,
        } => info!(
            member,
            host, iteration, "re-selection requested: the host's apps changed"
        ),
        Event::ReselectRequested {
            member,
            host,
            iteration,
            taken: false,
        } => info!(
            member,
            host, iteration, "re-selection request ignored: shards re-select only periodically"
        ),
        Event::SelectionDone {
            exchange,
            parks,
            activations,
            refused,
        } => debug!(
            exchange,
            parks, activations, refused, "selection exchange done"
        ),
    }
}
