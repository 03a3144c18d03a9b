//! The agent's DASR service: Dart's AUSS receiver and the DASR sender over one UDP socket
//! (docs/design.md §4, docs/dasr.md). The protocol logic is the pure core in
//! [`drum_common::dasr`]; this module owns the socket, the clock and the timers.
//!
//! The lead's entry points: [`DasrService::bind`], then on the handle
//! [`DasrHandle::message_started`] / [`DasrHandle::message_ended`] when the local shim reports a
//! long message to a peer host's agent, and [`DasrHandle::caps`] (a `watch` of destination →
//! [`CapView`]) or [`DasrHandle::cap_for`] to write the caps into the shim's table.
//! [`DasrHandle::observe_receive`] feeds the congestion state machine (non-receiver congestion
//! turns the cap off); [`DasrMetrics`] is a metrics collector.

use crate::dasr_auth::RefusalLog;
use drum_common::dasr::{
    Auss, AussAction, AussConfig, AussStats, CapView, CongestionConfig, CongestionDetector,
    CongestionState, Datagram, Guard, Lookahead, Refusal, SenderAction, SenderConfig, SenderCore,
    SenderStats,
};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::hash::{BuildHasher, Hasher};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tokio::net::UdpSocket;
use tokio::sync::{mpsc, watch};
use tracing::{debug, warn};

/// `[dasr]` settings. Rates are in whatever unit `receiver_rate` is given in: the default 1.0
/// means "fraction of line rate" (DESIGN §3 normalises rates so), a number of bytes/s makes the
/// caps bytes/s. Caps are `receiver_rate · ω_i / Ω`.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct DasrConfig {
    /// UDP address of the DASR control channel (peers announce to this address).
    pub listen: SocketAddr,
    /// `R`: this host's receive rate apportioned among its senders (default 1.0 = line rate).
    #[serde(default = "d_rate")]
    pub receiver_rate: f64,
    /// Receiver: a sender silent for this long leaves the set (default 2000).
    #[serde(default = "d_expiry")]
    pub expiry_ms: u64,
    /// Sender: retransmit an unacknowledged announcement after this long (default 10).
    #[serde(default = "d_ack_timeout")]
    pub ack_timeout_ms: u64,
    /// Sender: retransmissions before giving up on one announcement (default 5).
    #[serde(default = "d_retries")]
    pub retries: u32,
    /// Sender: re-announce in-flight messages this often (default `expiry_ms / 4`).
    #[serde(default)]
    pub refresh_ms: Option<u64>,
    /// Sender: drop a cap no ACK confirmed for this long (default `expiry_ms`).
    #[serde(default)]
    pub cap_ttl_ms: Option<u64>,
    /// This host's sender id; default: random per start (set it so that a restarted agent
    /// replaces its old entry at receivers at once instead of after `expiry_ms`).
    #[serde(default)]
    pub host_id: Option<u64>,
    /// ω of this host as a sender (default 1: Dart's plain `R/N`).
    #[serde(default = "d_weight")]
    pub weight: f64,
    /// Receiver: count announced incast-group members not heard from yet (default off).
    #[serde(default)]
    pub lookahead: bool,
    /// Receiver: time without congestion signals before leaving a congested state
    /// (default 1000).
    #[serde(default = "d_quiet")]
    pub congestion_quiet_ms: u64,
    /// The cluster's DASR key, 32 random bytes, mode 0600 (`drum-coordinator dev-certs`
    /// writes `dasr.key`). With it, datagrams are authenticated (wire version 2) and
    /// unauthenticated ones refused; without it, version 1 as before. Every agent of a
    /// cluster needs the same key.
    #[serde(default)]
    pub key_file: Option<PathBuf>,
    /// During a key rotation, the key being replaced: accepted, never sent with.
    #[serde(default)]
    pub previous_key_file: Option<PathBuf>,
    /// With a key: a datagram stamped further than this from the local clock is refused, and
    /// a replay is recognised within it (default 2000; must exceed the clocks' skew).
    #[serde(default = "d_replay_window")]
    pub replay_window_ms: u64,
}

fn d_rate() -> f64 {
    1.0
}
fn d_expiry() -> u64 {
    2000
}
fn d_ack_timeout() -> u64 {
    10
}
fn d_retries() -> u32 {
    5
}
fn d_weight() -> f64 {
    1.0
}
fn d_quiet() -> u64 {
    1000
}
fn d_replay_window() -> u64 {
    2000
}

impl DasrConfig {
    /// Defaults everywhere but the address.
    pub fn new(listen: SocketAddr) -> Self {
        Self {
            listen,
            receiver_rate: d_rate(),
            expiry_ms: d_expiry(),
            ack_timeout_ms: d_ack_timeout(),
            retries: d_retries(),
            refresh_ms: None,
            cap_ttl_ms: None,
            host_id: None,
            weight: d_weight(),
            lookahead: false,
            congestion_quiet_ms: d_quiet(),
            key_file: None,
            previous_key_file: None,
            replay_window_ms: d_replay_window(),
        }
    }

    /// Resolves the key files' paths against `base` (the config file's directory).
    pub fn rebase(&mut self, base: &std::path::Path) {
        for p in [&mut self.key_file, &mut self.previous_key_file] {
            *p = p.take().map(|p| base.join(p));
        }
    }

    pub fn refresh(&self) -> Duration {
        Duration::from_millis(self.refresh_ms.unwrap_or((self.expiry_ms / 4).max(1)))
    }

    pub fn cap_ttl(&self) -> Duration {
        Duration::from_millis(self.cap_ttl_ms.unwrap_or(self.expiry_ms))
    }

    pub fn validate(&self) -> Result<(), DasrError> {
        let bad = |m: String| Err(DasrError::Config(m));
        if !(self.receiver_rate.is_finite() && self.receiver_rate > 0.0) {
            return bad(format!(
                "receiver_rate must be positive and finite, got {}",
                self.receiver_rate
            ));
        }
        if !(self.weight.is_finite() && self.weight > 0.0) {
            return bad(format!(
                "weight must be positive and finite, got {}",
                self.weight
            ));
        }
        if self.expiry_ms == 0
            || self.ack_timeout_ms == 0
            || self.congestion_quiet_ms == 0
            || self.replay_window_ms == 0
        {
            return bad(
                "expiry_ms, ack_timeout_ms, congestion_quiet_ms and replay_window_ms must be positive"
                    .into(),
            );
        }
        let refresh = self.refresh().as_millis() as u64;
        if refresh == 0 || refresh >= self.expiry_ms {
            return bad(format!(
                "refresh_ms ({refresh}) must be positive and below expiry_ms ({}), or receivers \
                 expire senders whose messages are still running",
                self.expiry_ms
            ));
        }
        if self.cap_ttl() <= self.refresh() {
            return bad(format!(
                "cap_ttl_ms ({}) must exceed refresh_ms ({refresh}), or caps lapse between refreshes",
                self.cap_ttl().as_millis()
            ));
        }
        Ok(())
    }
}

#[derive(Debug, thiserror::Error)]
pub enum DasrError {
    #[error("invalid DASR configuration: {0}")]
    Config(String),
    #[error("DASR key: {0}")]
    Key(String),
    #[error("binding the DASR socket on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
}

/// Destination agent address → what this host's sender knows of it.
pub type CapMap = BTreeMap<SocketAddr, CapView>;

/// This host as a receiver.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct ReceiverView {
    pub n: u32,
    pub omega: f64,
    pub epoch: u64,
    pub rate: f64,
    pub congestion: CongestionState,
}

/// Counters of both roles (a snapshot; see [`DasrMetrics`]).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct DasrCounters {
    pub datagrams_received: u64,
    /// Datagrams refused as garbage: bad magic, truncated, oversized, bad values.
    pub garbage: u64,
    /// Well-formed DASR datagrams of another wire version.
    pub wrong_version: u64,
    /// With a key: version-1 datagrams (no MAC).
    pub unauthenticated: u64,
    /// With a key: MACed under a key this agent does not hold.
    pub unknown_key: u64,
    /// With a key: the MAC does not match (forged or altered).
    pub bad_mac: u64,
    /// With a key: stamped outside the replay window of this clock.
    pub stale: u64,
    /// With a key: not newer than a datagram already accepted from the same origin.
    pub replayed: u64,
    pub recv_errors: u64,
    pub send_errors: u64,
    // Receiver role.
    pub announcements_received: u64,
    pub starts: u64,
    pub ends: u64,
    pub duplicates: u64,
    pub reordered: u64,
    pub unknown_ends: u64,
    pub stale_incarnation: u64,
    pub sender_restarts: u64,
    pub expiries: u64,
    pub acks_sent: u64,
    pub pushes_sent: u64,
    pub members: u64,
    pub epoch: u64,
    // Sender role.
    pub announcements_sent: u64,
    pub retransmits: u64,
    pub refreshes: u64,
    pub give_ups: u64,
    pub acks_received: u64,
    pub stale_acks: u64,
    pub foreign_acks: u64,
    pub cap_expiries: u64,
}

impl DasrCounters {
    fn absorb(&mut self, r: &AussStats, s: &SenderStats) {
        self.announcements_received = r.announcements;
        self.starts = r.starts;
        self.ends = r.ends;
        self.duplicates = r.duplicates;
        self.reordered = r.reordered;
        self.unknown_ends = r.unknown_ends;
        self.stale_incarnation = r.stale_incarnation;
        self.sender_restarts = r.restarts;
        self.expiries = r.expiries;
        self.acks_sent = r.acks;
        self.pushes_sent = r.pushes;
        self.announcements_sent = s.announcements;
        self.retransmits = s.retransmits;
        self.refreshes = s.refreshes;
        self.give_ups = s.give_ups;
        self.acks_received = s.acks;
        self.stale_acks = s.stale_acks;
        self.foreign_acks = s.foreign_acks;
        self.cap_expiries = s.cap_expiries;
    }
}

/// The service's counters, updated by its task after every event.
#[derive(Debug, Default)]
pub struct DasrMetrics(Mutex<DasrCounters>);

impl DasrMetrics {
    pub fn snapshot(&self) -> DasrCounters {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn update(&self, f: impl FnOnce(&mut DasrCounters)) {
        f(&mut self.0.lock().unwrap_or_else(|e| e.into_inner()));
    }
}

/// DASR's series at each scrape: `drum_dasr_members` and `drum_dasr_epoch` as gauges, every
/// other count as a counter `drum_dasr_NAME_total`.
impl prometheus_client::collector::Collector for DasrMetrics {
    fn encode(
        &self,
        mut enc: prometheus_client::encoding::DescriptorEncoder,
    ) -> Result<(), std::fmt::Error> {
        use prometheus_client::encoding::EncodeMetric;
        use prometheus_client::metrics::counter::ConstCounter;
        use prometheus_client::metrics::gauge::ConstGauge;
        let v = serde_json::to_value(self.snapshot()).unwrap_or_default();
        let Some(map) = v.as_object() else {
            return Ok(());
        };
        for (k, val) in map {
            let name = format!("drum_dasr_{k}");
            let n = val.as_u64().unwrap_or(0);
            if matches!(k.as_str(), "members" | "epoch") {
                let g = ConstGauge::new(n as i64);
                g.encode(enc.encode_descriptor(&name, k, None, g.metric_type())?)?;
            } else {
                let c = ConstCounter::new(n);
                c.encode(enc.encode_descriptor(&name, k, None, c.metric_type())?)?;
            }
        }
        Ok(())
    }
}

#[derive(Debug)]
enum Cmd {
    Start(SocketAddr, u64, Option<Lookahead>),
    End(SocketAddr, u64),
    SetRate(f64),
    Observe { rate: f64, congested: bool },
}

/// A cheap, clonable handle on a running service.
#[derive(Clone, Debug)]
pub struct DasrHandle {
    local_addr: SocketAddr,
    host_id: u64,
    cmds: mpsc::UnboundedSender<Cmd>,
    caps: watch::Receiver<CapMap>,
    receiver: watch::Receiver<ReceiverView>,
    metrics: Arc<DasrMetrics>,
}

impl DasrHandle {
    /// The bound address (peers announce here).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }
    /// The sender id this host announces with.
    pub fn host_id(&self) -> u64 {
        self.host_id
    }
    /// A long message to the host whose agent listens on `dest` started. Idempotent per
    /// `(dest, msg_id)`.
    pub fn message_started(&self, dest: SocketAddr, msg_id: u64) {
        let _ = self.cmds.send(Cmd::Start(dest, msg_id, None));
    }
    /// As [`DasrHandle::message_started`], announcing the incast group the message is part of
    /// (used by receivers with `lookahead` on).
    pub fn message_started_in_group(&self, dest: SocketAddr, msg_id: u64, group: Lookahead) {
        let _ = self.cmds.send(Cmd::Start(dest, msg_id, Some(group)));
    }
    /// The message ended. Unknown ids are ignored.
    pub fn message_ended(&self, dest: SocketAddr, msg_id: u64) {
        let _ = self.cmds.send(Cmd::End(dest, msg_id));
    }
    /// Current caps, destination → view; `changed()` wakes on every change.
    pub fn caps(&self) -> watch::Receiver<CapMap> {
        self.caps.clone()
    }
    /// The cap towards `dest` now; `None` = no cap.
    pub fn cap_for(&self, dest: SocketAddr) -> Option<f64> {
        self.caps.borrow().get(&dest).and_then(|v| v.cap)
    }
    /// This host as a receiver: N, Ω, epoch, R, congestion state.
    pub fn receiver(&self) -> watch::Receiver<ReceiverView> {
        self.receiver.clone()
    }
    /// Changes `R`; every member gets a new cap.
    pub fn set_receiver_rate(&self, rate: f64) {
        let _ = self.cmds.send(Cmd::SetRate(rate));
    }
    /// One receive-rate measurement (same unit as `receiver_rate`) and whether congestion was
    /// signalled in the interval; drives the congestion state machine.
    pub fn observe_receive(&self, rate: f64, congested: bool) {
        let _ = self.cmds.send(Cmd::Observe { rate, congested });
    }
    pub fn metrics(&self) -> Arc<DasrMetrics> {
        self.metrics.clone()
    }
}

/// The running service; dropping it stops the task and closes the socket.
#[derive(Debug)]
pub struct DasrService {
    handle: DasrHandle,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl std::ops::Deref for DasrService {
    type Target = DasrHandle;
    fn deref(&self) -> &DasrHandle {
        &self.handle
    }
}

impl Drop for DasrService {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

impl DasrService {
    /// Validates `cfg`, binds the socket and starts the service task on the current runtime.
    pub async fn bind(cfg: DasrConfig) -> Result<Self, DasrError> {
        cfg.validate()?;
        let guard = crate::dasr_auth::guard(
            cfg.key_file.as_deref(),
            cfg.previous_key_file.as_deref(),
            Duration::from_millis(cfg.replay_window_ms),
        )
        .map_err(DasrError::Key)?;
        let socket = UdpSocket::bind(cfg.listen)
            .await
            .map_err(|source| DasrError::Bind {
                addr: cfg.listen,
                source,
            })?;
        let local_addr = socket.local_addr().map_err(|source| DasrError::Bind {
            addr: cfg.listen,
            source,
        })?;
        let incarnation = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1);
        let host_id = cfg.host_id.unwrap_or_else(|| {
            let mut h = std::collections::hash_map::RandomState::new().build_hasher();
            h.write_u64(incarnation);
            h.write(local_addr.to_string().as_bytes());
            h.write_u32(std::process::id());
            h.finish()
        });
        let auss = Auss::new(
            AussConfig {
                rate: cfg.receiver_rate,
                expiry: Duration::from_millis(cfg.expiry_ms),
                lookahead: cfg.lookahead,
                ..AussConfig::default()
            },
            incarnation,
        );
        let sender = SenderCore::new(SenderConfig {
            weight: cfg.weight,
            ack_timeout: Duration::from_millis(cfg.ack_timeout_ms),
            retries: cfg.retries,
            refresh: cfg.refresh(),
            cap_ttl: cfg.cap_ttl(),
            ..SenderConfig::new(host_id, incarnation)
        });
        let congestion = CongestionDetector::new(CongestionConfig {
            quiet: Duration::from_millis(cfg.congestion_quiet_ms),
            ..CongestionConfig::new(cfg.receiver_rate)
        });
        let (cmd_tx, cmd_rx) = mpsc::unbounded_channel();
        let (caps_tx, caps_rx) = watch::channel(CapMap::new());
        let view = ReceiverView {
            n: 0,
            omega: 0.0,
            epoch: 0,
            rate: cfg.receiver_rate,
            congestion: CongestionState::NoCongestion,
        };
        let (recv_tx, recv_rx) = watch::channel(view);
        let metrics = Arc::new(DasrMetrics::default());
        let state = State {
            origin: Instant::now(),
            auss,
            sender,
            congestion,
            caps: caps_tx,
            receiver: recv_tx,
            metrics: metrics.clone(),
            out: Vec::new(),
            guard,
            refusals: RefusalLog::new(Duration::from_secs(10)),
        };
        let task = tokio::spawn(run(socket, state, cmd_rx));
        Ok(Self {
            handle: DasrHandle {
                local_addr,
                host_id,
                cmds: cmd_tx,
                caps: caps_rx,
                receiver: recv_rx,
                metrics,
            },
            task: Some(task),
        })
    }

    pub fn handle(&self) -> DasrHandle {
        self.handle.clone()
    }

    /// Stops the task and waits for it (the socket is closed when this returns).
    pub async fn shutdown(mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
            let _ = task.await;
        }
    }
}

struct State {
    origin: Instant,
    auss: Auss<SocketAddr>,
    sender: SenderCore<SocketAddr>,
    congestion: CongestionDetector,
    caps: watch::Sender<CapMap>,
    receiver: watch::Sender<ReceiverView>,
    metrics: Arc<DasrMetrics>,
    out: Vec<(SocketAddr, Datagram)>,
    /// With a key: seals what is sent, opens (or refuses) what is received.
    guard: Option<Guard>,
    refusals: RefusalLog,
}

impl State {
    fn now(&self) -> Duration {
        self.origin.elapsed()
    }

    fn next_deadline(&self) -> Option<Duration> {
        [
            self.auss.next_deadline(),
            self.sender.next_deadline(),
            self.congestion.next_deadline(),
        ]
        .into_iter()
        .flatten()
        .min()
    }

    /// The wall clock: stamps are compared across hosts, so not the monotonic `now`.
    fn wall() -> Duration {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
    }

    fn encode(&mut self, d: &Datagram) -> Vec<u8> {
        match &mut self.guard {
            Some(g) => g.seal(Self::wall(), d),
            None => d.encode(),
        }
    }

    fn on_datagram(&mut self, bytes: &[u8], from: SocketAddr) {
        self.metrics.update(|c| c.datagrams_received += 1);
        let opened = match &mut self.guard {
            Some(g) => g.open(Self::wall(), bytes),
            None => Datagram::decode(bytes).map_err(Refusal::Wire),
        };
        match opened {
            Ok(Datagram::Announce(a)) => {
                let acts = self.auss.on_announce(self.now(), from, &a);
                self.receiver_actions(acts);
            }
            Ok(Datagram::Ack(k)) => {
                let acts = self.sender.on_ack(self.now(), &from, &k);
                self.sender_actions(acts);
            }
            Err(why) => {
                if self.guard.is_some() {
                    self.refusals.warn(self.now(), from, &why);
                } else {
                    // Without a key, stray bytes on the port are as before: counted, not logged.
                    debug!(%from, len = bytes.len(), "refused a DASR datagram: {why}");
                }
                self.metrics.update(|c| {
                    let n = match &why {
                        Refusal::Wire(e) if e.is_version() => &mut c.wrong_version,
                        Refusal::Wire(_) => &mut c.garbage,
                        Refusal::Unauthenticated => &mut c.unauthenticated,
                        Refusal::UnknownKey(_) => &mut c.unknown_key,
                        Refusal::BadMac => &mut c.bad_mac,
                        Refusal::Stale { .. } => &mut c.stale,
                        Refusal::Replay => &mut c.replayed,
                    };
                    *n += 1;
                });
            }
        }
    }

    fn on_cmd(&mut self, cmd: Cmd) {
        let now = self.now();
        match cmd {
            Cmd::Start(dest, msg, la) => {
                let acts = self.sender.message_started_with(now, dest, msg, la);
                self.sender_actions(acts);
            }
            Cmd::End(dest, msg) => {
                let acts = self.sender.message_ended(now, dest, msg);
                self.sender_actions(acts);
            }
            Cmd::SetRate(r) => {
                self.congestion.set_line_rate(r);
                let acts = self.auss.set_rate(r);
                self.receiver_actions(acts);
            }
            Cmd::Observe { rate, congested } => {
                if let Some(s) = self.congestion.observe(now, rate, congested) {
                    self.congestion_changed(s);
                }
            }
        }
    }

    fn tick(&mut self) {
        let now = self.now();
        let acts = self.auss.tick(now);
        self.receiver_actions(acts);
        let acts = self.sender.tick(now);
        self.sender_actions(acts);
        if let Some(s) = self.congestion.tick(now) {
            self.congestion_changed(s);
        }
    }

    fn congestion_changed(&mut self, s: CongestionState) {
        debug!(state = ?s, "DASR congestion state changed");
        let acts = self.auss.set_cap_enabled(s.cap_enabled());
        self.receiver_actions(acts);
    }

    fn receiver_actions(&mut self, acts: Vec<AussAction<SocketAddr>>) {
        for a in acts {
            let (to, ack) = a.target();
            self.out.push((*to, Datagram::Ack(*ack)));
        }
    }

    fn sender_actions(&mut self, acts: Vec<SenderAction<SocketAddr>>) {
        for a in acts {
            match a {
                SenderAction::Send { to, announce } => {
                    self.out.push((to, Datagram::Announce(announce)))
                }
                SenderAction::CapChanged { dest, view } => {
                    self.caps.send_if_modified(|m| match view {
                        Some(v) => m.insert(dest, v) != Some(v),
                        None => m.remove(&dest).is_some(),
                    });
                }
                SenderAction::GaveUp { dest, seq } => {
                    warn!(%dest, seq, "DASR announcement unanswered after every retry")
                }
            }
        }
    }

    /// Publishes the receiver view and counters after an event.
    fn publish(&mut self) {
        let view = ReceiverView {
            n: self.auss.n(),
            omega: self.auss.omega(),
            epoch: self.auss.epoch(),
            rate: self.auss.rate(),
            congestion: self.congestion.state(),
        };
        self.receiver.send_if_modified(|v| {
            let changed = *v != view;
            *v = view;
            changed
        });
        let (r, s) = (self.auss.stats(), self.sender.stats());
        let (members, epoch) = (self.auss.n() as u64, self.auss.epoch());
        self.metrics.update(|c| {
            c.absorb(r, s);
            c.members = members;
            c.epoch = epoch;
        });
    }
}

async fn run(socket: UdpSocket, mut st: State, mut cmds: mpsc::UnboundedReceiver<Cmd>) {
    // Larger than any DASR datagram, so oversized ones are seen (and refused) whole.
    let mut buf = vec![0u8; 2048];
    loop {
        let wake = st
            .next_deadline()
            .map(|d| tokio::time::Instant::from_std(st.origin + d));
        let sleep = async {
            match wake {
                Some(t) => tokio::time::sleep_until(t).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            r = socket.recv_from(&mut buf) => match r {
                Ok((len, from)) => st.on_datagram(&buf[..len], from),
                Err(e) => {
                    // ICMP errors surface here on some systems; never stop the service for them.
                    debug!("DASR receive error: {e}");
                    st.metrics.update(|c| c.recv_errors += 1);
                }
            },
            c = cmds.recv() => match c {
                Some(c) => st.on_cmd(c),
                None => break,
            },
            _ = sleep => st.tick(),
        }
        for (to, d) in std::mem::take(&mut st.out) {
            let bytes = st.encode(&d);
            if let Err(e) = socket.send_to(&bytes, to).await {
                debug!(%to, "DASR send error: {e}");
                st.metrics.update(|c| c.send_errors += 1);
            }
        }
        st.publish();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use drum_common::dasr::{Ack, Announce, DasrKey, Phase, KEY_LEN};

    const WAIT: Duration = Duration::from_secs(5);

    #[test]
    fn config_defaults_and_validation() {
        let c: DasrConfig = toml::from_str(r#"listen = "127.0.0.1:0""#).unwrap();
        assert_eq!(c, DasrConfig::new("127.0.0.1:0".parse().unwrap()));
        assert_eq!(c.refresh(), Duration::from_millis(500));
        assert_eq!(c.cap_ttl(), Duration::from_secs(2));
        c.validate().unwrap();
        let e = DasrConfig {
            refresh_ms: Some(2000),
            ..c.clone()
        }
        .validate()
        .unwrap_err();
        assert!(e.to_string().contains("refresh_ms"), "{e}");
        let e = DasrConfig {
            receiver_rate: f64::NAN,
            ..c.clone()
        }
        .validate()
        .unwrap_err();
        assert!(e.to_string().contains("receiver_rate"), "{e}");
        assert!(DasrConfig {
            cap_ttl_ms: Some(100),
            ..c
        }
        .validate()
        .is_err());
        assert!(toml::from_str::<DasrConfig>("listen = \"127.0.0.1:0\"\nbogus = 1").is_err());
        // Key paths are relative to the config file, as the TLS files are.
        let mut k: DasrConfig = toml::from_str(
            "listen = \"127.0.0.1:0\"\nkey_file = \"dasr.key\"\nprevious_key_file = \"/k/old.key\"",
        )
        .unwrap();
        k.rebase(std::path::Path::new("/etc/drum"));
        assert_eq!(k.key_file, Some("/etc/drum/dasr.key".into()));
        assert_eq!(k.previous_key_file, Some("/k/old.key".into()));
    }

    #[tokio::test]
    async fn two_services_in_process() {
        let lo: SocketAddr = "127.0.0.1:0".parse().unwrap();
        let rx = DasrService::bind(DasrConfig {
            receiver_rate: 10.0,
            ..DasrConfig::new(lo)
        })
        .await
        .unwrap();
        let a = DasrService::bind(DasrConfig::new(lo)).await.unwrap();
        let dest = rx.local_addr();
        let mut caps = a.caps();
        a.message_started(dest, 1);
        tokio::time::timeout(
            WAIT,
            caps.wait_for(|m| m.get(&dest).and_then(|v| v.cap) == Some(10.0)),
        )
        .await
        .unwrap()
        .unwrap();
        assert_eq!(a.cap_for(dest), Some(10.0));
        assert_eq!(rx.receiver().borrow().n, 1);
        let text = crate::metrics::render(
            &crate::metrics::AgentMetrics::default().registry("h\"1", vec![Box::new(rx.metrics())]),
        );
        assert!(
            text.contains("drum_dasr_starts_total{host=\"h\\\"1\"} 1\n"),
            "{text}"
        );
        assert!(text.contains("# TYPE drum_dasr_members gauge\n"), "{text}");
        // Non-receiver congestion turns the cap off; the view stays.
        rx.observe_receive(2.0, true);
        tokio::time::timeout(
            WAIT,
            caps.wait_for(|m| m.get(&dest).is_some_and(|v| v.cap.is_none())),
        )
        .await
        .unwrap()
        .unwrap();
        assert_eq!(
            rx.receiver().borrow().congestion,
            CongestionState::NonReceiverCongestion
        );
        rx.observe_receive(10.0, true);
        tokio::time::timeout(
            WAIT,
            caps.wait_for(|m| m.get(&dest).and_then(|v| v.cap) == Some(10.0)),
        )
        .await
        .unwrap()
        .unwrap();
        a.message_ended(dest, 1);
        tokio::time::timeout(WAIT, caps.wait_for(|m| m.is_empty()))
            .await
            .unwrap()
            .unwrap();
        let mut r = rx.receiver();
        tokio::time::timeout(WAIT, r.wait_for(|v| v.n == 0))
            .await
            .unwrap()
            .unwrap();
        a.shutdown().await;
        rx.shutdown().await;
    }

    async fn until(what: &str, mut ok: impl FnMut() -> bool) {
        let deadline = Instant::now() + WAIT;
        while !ok() {
            assert!(Instant::now() < deadline, "timed out waiting for {what}");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    fn announce(sender: u64, seq: u64, phase: Phase) -> Datagram {
        Datagram::Announce(Announce {
            sender,
            incarnation: 1,
            seq,
            phase,
            msg_id: 5,
            weight: 1.0,
            lookahead: None,
        })
    }

    /// With a key: forgeries (v1, a wrong MAC, another key) and a replayed captured datagram
    /// change no cap at the receiver nor at the sender, while the same traffic MACed under the
    /// key does, over real sockets.
    #[tokio::test]
    async fn with_a_key_forged_and_replayed_datagrams_change_no_cap() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let key_path = dir.path().join("dasr.key");
        std::fs::write(&key_path, [1u8; KEY_LEN]).unwrap();
        std::fs::set_permissions(&key_path, std::fs::Permissions::from_mode(0o600)).unwrap();
        let key = DasrKey::new(&[1u8; KEY_LEN]);
        let window = Duration::from_secs(2);
        let lo: SocketAddr = "127.0.0.1:0".parse().unwrap();
        let keyed = |rate| DasrConfig {
            receiver_rate: rate,
            // Caps lapse 400 ms after the last ACK (refreshes every 100 ms).
            expiry_ms: 400,
            key_file: Some(key_path.clone()),
            ..DasrConfig::new(lo)
        };
        let rx = DasrService::bind(keyed(10.0)).await.unwrap();
        let a = DasrService::bind(keyed(1.0)).await.unwrap();
        let dest = rx.local_addr();
        let (rxm, am) = (rx.metrics(), a.metrics());
        a.message_started(dest, 1);
        until("A's cap", || a.cap_for(dest) == Some(10.0)).await;

        // Receiver: a v1 START (what anyone could send before), one under our key id with a
        // wrong MAC, one under another key: nobody joins.
        let evil = UdpSocket::bind(lo).await.unwrap();
        let send = |b: Vec<u8>, to| {
            let evil = &evil;
            async move { evil.send_to(&b, to).await.unwrap() }
        };
        send(announce(99, 1, Phase::Start).encode(), dest).await;
        let mut forged = announce(99, 2, Phase::Start)
            .encode_unsigned(key.id(), State::wall().as_nanos() as u64);
        forged.extend_from_slice(&[0; 16]);
        send(forged, dest).await;
        let mut other = Guard::new(DasrKey::new(&[2u8; KEY_LEN]), None, window);
        send(
            other.seal(State::wall(), &announce(99, 3, Phase::Start)),
            dest,
        )
        .await;
        until("the receiver's refusals", || {
            let c = rxm.snapshot();
            (c.unauthenticated, c.bad_mac, c.unknown_key) == (1, 1, 1)
        })
        .await;
        assert_eq!(rx.receiver().borrow().n, 1);
        assert_eq!(a.cap_for(dest), Some(10.0));

        // A host holding the key joins and leaves: A's cap halves and comes back.
        let mut peer = Guard::new(DasrKey::new(&[1u8; KEY_LEN]), None, window);
        let captured = peer.seal(State::wall(), &announce(99, 1, Phase::Start));
        send(captured.clone(), dest).await;
        until("the legitimate START", || a.cap_for(dest) == Some(5.0)).await;
        send(peer.seal(State::wall(), &announce(99, 2, Phase::End)), dest).await;
        until("the legitimate END", || a.cap_for(dest) == Some(10.0)).await;
        // The captured START replayed: refused, the set stays as it is.
        let before = rxm.snapshot().replayed;
        send(captured, dest).await;
        until("the replay refused", || rxm.snapshot().replayed > before).await;
        assert_eq!(rx.receiver().borrow().n, 1);
        assert_eq!(a.cap_for(dest), Some(10.0));

        // Sender: a receiver holding the key (played by this test) answers A with cap 3.
        let fake = UdpSocket::bind(lo).await.unwrap();
        let fdest = fake.local_addr().unwrap();
        let mut fguard = Guard::new(DasrKey::new(&[1u8; KEY_LEN]), None, window);
        a.message_started(fdest, 2);
        let mut buf = [0u8; 128];
        let (len, from) = fake.recv_from(&mut buf).await.unwrap();
        let Ok(Datagram::Announce(ann)) = fguard.open(State::wall(), &buf[..len]) else {
            panic!("A's announcement does not open");
        };
        let ack = |cap| {
            Datagram::Ack(Ack {
                receiver_incarnation: 1,
                sender_incarnation: ann.incarnation,
                epoch: 1,
                n: 3,
                omega: 3.0,
                cap,
                acked_seq: ann.seq,
                push: false,
                cap_off: false,
            })
        };
        let captured_ack = fguard.seal(State::wall(), &ack(3.0));
        fake.send_to(&captured_ack, from).await.unwrap();
        until("the legitimate ACK", || a.cap_for(fdest) == Some(3.0)).await;
        // Forged ACKs with a lower cap, from the receiver's own address.
        fake.send_to(&ack(1.0).encode(), from).await.unwrap();
        let mut forged = ack(1.0).encode_unsigned(key.id(), State::wall().as_nanos() as u64);
        forged.extend_from_slice(&[0; 16]);
        fake.send_to(&forged, from).await.unwrap();
        until("the sender's refusals", || {
            let c = am.snapshot();
            (c.unauthenticated, c.bad_mac) == (1, 1)
        })
        .await;
        assert_eq!(a.cap_for(fdest), Some(3.0));
        // The receiver falls silent, the cap lapses; the captured ACK replayed would revive
        // it (a first ACK after a lapse is accepted) but is refused.
        until("the cap to lapse", || a.cap_for(fdest).is_none()).await;
        let before = am.snapshot().replayed;
        fake.send_to(&captured_ack, from).await.unwrap();
        until("the replayed ACK refused", || {
            am.snapshot().replayed > before
        })
        .await;
        assert_eq!(a.cap_for(fdest), None);
        a.shutdown().await;
        rx.shutdown().await;
    }
}
