//! The agent's side of the shim link (docs/design.md §7): a Unix `SOCK_SEQPACKET` socket where
//! every `libdrum_shim.so` on the host registers, and one shared-memory table per
//! registered process, in which the agent writes the app's grant (rates, active-QP limit,
//! DASR caps, a heartbeat) and the shim writes its counters.
//!
//! Threads, not tasks: registration and the per-shim readers block in `accept`/`recv`, and
//! the heartbeat must keep beating while the async runtime is busy. The state is small and
//! behind one mutex that no thread holds across a system call that can block.

mod identity;
mod scan;

use crate::grant_audit::OverGrant;
use crate::procfs;
pub use crate::shim_settings::{AppPin, IncastPin, ShimSettings};
use crate::tenants::Identity;
use crate::ungoverned::direct_verbs::DirectVerbs;
use crate::ungoverned::Ungoverned;
use anyhow::{bail, Context, Result};
use drum_common::dasr::Lookahead;
use drum_common::demand::poll_grant;
use drum_common::live::LiveApp;
use drum_common::process_share::{self, ProcessMeter, ProcessUse, ShimCounters};
use drum_common::traffic_shares::{Dest, PeerBytes, TrafficShares};
use drum_common::wire_cost::WireCost;
use drum_table::layout::{monotonic_ms, Grant, MAX_RATE_WQE, TABLE_BYTES};
use drum_table::mapping::{send_with_fd, Mapping};
use drum_table::message::{AgentMsg, ShimMsg, MAX_LEN};
use drum_table::profile::mean_wqe_bytes;
use drum_table::socket;
use std::collections::{BTreeMap, BTreeSet};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use tracing::{info, warn};

/// The optimiser's decision for one app of this host.
#[derive(Clone, Debug, PartialEq)]
pub struct AppDecision {
    pub app: String,
    pub active: bool,
    /// Fraction of the line rate.
    pub rate: f64,
    pub cqe_per_wqe: f64,
    /// The app's weight in the policy (its share of the host's QP budget).
    pub weight: f64,
}

#[derive(Clone, Copy, Debug)]
struct Decided {
    rate: f64,
    cqe_per_wqe: f64,
    weight: f64,
    /// The app's mean send size when this decision was taken, which turns its WQE rate into
    /// the polling grant: fixed with the decision, so that republishing it (a shim
    /// registering, fail-static) gives the same grant, not one following the measurement.
    bytes_per_wqe: Option<f64>,
}

const HEARTBEAT: Duration = Duration::from_millis(100);
/// How long a receiver must see no long-message traffic from this host before its end is
/// announced.
const END_LINGER: Duration = Duration::from_millis(50);
/// A shim must say who it is this quickly after connecting.
const HELLO_TIMEOUT: Duration = Duration::from_secs(2);

/// What one registered process reports (its table's counters).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct ShimUsage {
    pub pid: u32,
    pub app: String,
    /// Who the process is, as the kernel says.
    pub uid: u32,
    pub gid: u32,
    pub cgroup: String,
    /// The name it asked for (`DRUM_APP` or its executable's), where the policy mapped it.
    pub requested_app: Option<String>,
    pub send_wqes: u64,
    pub send_bytes: u64,
    pub completions: u64,
    pub deferred_wqes: u64,
    pub queued_wqes: u64,
    pub qps: u64,
    pub active_qps: u64,
    pub grant_generation: u64,
    pub applied_generation: u64,
    /// The polling grant in force, completions per second (0: none).
    pub rate_cqe_per_s: u64,
    /// WRs on the NIC not known to be complete (a gauge; 0 where the shim tracks none).
    pub nic_outstanding_wqes: u64,
    /// Polls that found completions the polling grant held back (cumulative).
    pub held_polls: u64,
}

/// A DASR cap in force for this host's shims.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct PeerCapView {
    /// The receiver's GID, as 32 hex digits.
    pub peer: String,
    pub cap_bytes_per_s: u64,
    pub senders: u64,
}

/// Long-message traffic towards a receiver started or ended (for DASR).
pub type TrafficHook = Box<dyn Fn(&Flow, bool) + Send + Sync>;

/// Long-message traffic of one app towards one receiver: one DASR message (the receiver
/// counts this host once however many it has open), so that an app's look-ahead group
/// covers its own traffic only.
#[derive(Clone, Debug, PartialEq)]
pub struct Flow {
    pub peer: [u8; 16],
    /// Stable per app name (FNV-1a), never 0.
    pub msg_id: u64,
    pub lookahead: Option<Lookahead>,
}

/// FNV-1a of an app name: the same on every host, so the tenant of a look-ahead group and
/// the message id need no coordination.
fn name_hash(app: &str) -> u64 {
    let h = app.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    h.max(1)
}

struct Conn {
    pid: u32,
    app: String,
    identity: Identity,
    /// Its start time (`/proc/PID/stat`) when it registered: whether the pid is still it.
    started: Option<u64>,
    /// The name it asked for, when the policy gave it another.
    requested: Option<String>,
    /// The weight its tenant rule gives its app.
    weight: Option<f64>,
    map: Mapping,
    sock: Arc<OwnedFd>,
    /// Connected QPs: QP number → peer GID.
    qps: BTreeMap<u32, [u8; 16]>,
    /// The last byte counts each connected QP reported (`BYTES`): the next report counts
    /// from there; a QP's first report only sets it (its slot may carry a previous QP's).
    qp_bytes: BTreeMap<u32, PeerBytes>,
    busy: BTreeSet<u32>,
    /// Whether the QP limit was hit (logged once).
    qps_clamped: bool,
    /// Its send rate and held-back work, for its part of the app's grant.
    meter: ProcessMeter,
    /// Its part of its app's grant, as last published.
    part: f64,
}

impl Conn {
    /// The QPs the process holds. The table's count is the shim's word: bounded by what the
    /// agent would track, so a table of garbage claims no more than a process with that many.
    fn qps_held(&self) -> u64 {
        let said = self.map.table().shim.qps.load(Relaxed);
        (self.qps.len() as u64).max(said.min(MAX_TRACKED_QPS as u64))
    }
}

/// Each registered process's part of its app's grant (`drum_common::process_share`), from
/// its QPs and its meter; `grants`: each app's whole payload byte grant (0: unlimited).
fn process_parts(st: &HubState, grants: &BTreeMap<&str, u64>) -> BTreeMap<u64, f64> {
    let mut apps: BTreeMap<&str, Vec<(u64, ProcessUse)>> = BTreeMap::new();
    for (&id, c) in &st.conns {
        let grant = grants.get(c.app.as_str()).copied().unwrap_or(0);
        let used = c
            .meter
            .used_bytes_per_s()
            .filter(|_| grant > 0)
            .map(|u| u / grant as f64);
        apps.entry(&c.app).or_default().push((
            id,
            ProcessUse {
                qps: c.qps_held(),
                part: c.part,
                used,
                held: c.meter.held(),
            },
        ));
    }
    let mut out = BTreeMap::new();
    for procs in apps.values() {
        let uses: Vec<ProcessUse> = procs.iter().map(|p| p.1).collect();
        for (&(id, _), part) in procs.iter().zip(process_share::process_parts(&uses)) {
            out.insert(id, part);
        }
    }
    out
}

/// A process's grant: its `part` of its app's rates. The QP gate is its own already; the
/// burst stays whole (a burst under one WQE's size would hold that WQE back).
fn part_of_grant(app: &Grant, part: f64) -> Grant {
    use process_share::part_of_rate;
    Grant {
        rate_bytes_per_s: part_of_rate(app.rate_bytes_per_s, part),
        rate_wqe_per_s: part_of_rate(app.rate_wqe_per_s, part),
        rate_cqe_per_s: part_of_rate(app.rate_cqe_per_s, part),
        ..*app
    }
}

/// Connected QPs the agent tracks per registered process.
pub const MAX_TRACKED_QPS: usize = 4096;

#[derive(Default)]
struct HubState {
    next_id: u64,
    conns: BTreeMap<u64, Conn>,
    /// The optimiser's decision per app (absent: it has not decided; unlimited).
    optimiser: BTreeMap<String, Decided>,
    /// Receivers with long-message traffic from this host: GID → busy QPs.
    busy_peers: BTreeMap<([u8; 16], String), usize>,
    caps: BTreeMap<[u8; 16], (u64, u64)>,
    /// Receivers whose traffic from this host ended, and since when: the end is announced
    /// only after [`END_LINGER`], so the gaps between back-to-back messages do not flap the
    /// receiver's sender count.
    ending: BTreeMap<([u8; 16], String), std::time::Instant>,
    /// Bytes per app and peer GID, summed from its QPs' reports since its first process
    /// registered: they outlive the QPs that carried them, so the sums only grow.
    app_bytes: BTreeMap<String, BTreeMap<[u8; 16], PeerBytes>>,
    shares: TrafficShares,
    /// What the last scan for ungoverned RDMA users found.
    ungoverned: Vec<Ungoverned>,
    /// Registered processes the last audit found sending above their grant.
    over_grant: Vec<OverGrant>,
    /// Registered processes whose shims said they took hardware queues (direct verbs).
    direct_verbs: Vec<DirectVerbs>,
}

impl HubState {
    fn app_peers(&self) -> BTreeMap<String, BTreeMap<[u8; 16], u32>> {
        let mut out: BTreeMap<String, BTreeMap<[u8; 16], u32>> = BTreeMap::new();
        for c in self.conns.values() {
            let peers = out.entry(c.app.clone()).or_default();
            for gid in c.qps.values() {
                *peers.entry(*gid).or_default() += 1;
            }
        }
        out
    }

    /// The mean size of `app`'s send WQEs so far, over its registered processes; `None`
    /// until they have posted enough to say.
    fn bytes_per_wqe(&self, app: &str) -> Option<f64> {
        let (mut wqes, mut bytes) = (0u64, 0u64);
        for c in self.conns.values().filter(|c| c.app == app) {
            let s = &c.map.table().shim;
            wqes = wqes.saturating_add(s.send_wqes.load(Relaxed));
            bytes = bytes.saturating_add(s.send_bytes.load(Relaxed));
        }
        mean_wqe_bytes(bytes, wqes)
    }

    /// The uids of the processes registered as `app`.
    fn holders(&self, app: &str) -> BTreeSet<u32> {
        self.conns
            .values()
            .filter(|c| c.app == app)
            .map(|c| c.identity.uid)
            .collect()
    }

    /// The weight of `app` on this host: the optimiser's (the coordinator's policy with the
    /// tenant rules applied), else its tenant rule's, else 1.
    fn weight(&self, app: &str) -> f64 {
        self.optimiser
            .get(app)
            .map(|d| d.weight)
            .unwrap_or_else(|| {
                self.conns
                    .values()
                    .find_map(|c| (c.app == app).then_some(c.weight).flatten())
                    .unwrap_or(1.0)
            })
    }
}

struct Shared {
    settings: ShimSettings,
    state: Mutex<HubState>,
    stop: AtomicBool,
    listener: OwnedFd,
    hook: Option<TrafficHook>,
}

/// The running hub; stops its threads and removes its socket on drop.
pub struct ShimHub {
    shared: Arc<Shared>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl ShimHub {
    pub fn start(settings: ShimSettings, hook: Option<TrafficHook>) -> Result<ShimHub> {
        settings.validate()?;
        let listener = listen(&settings.socket)?;
        info!(socket = %settings.socket.display(), "shims register here");
        let shared = Arc::new(Shared {
            settings,
            state: Mutex::new(HubState::default()),
            stop: AtomicBool::new(false),
            listener,
            hook,
        });
        let s1 = shared.clone();
        let s2 = shared.clone();
        let mut threads = vec![
            std::thread::Builder::new()
                .name("shim-accept".into())
                .spawn(move || accept_loop(s1))?,
            std::thread::Builder::new()
                .name("shim-heartbeat".into())
                .spawn(move || heartbeat_loop(s2))?,
        ];
        let s3 = shared.clone();
        threads.push(
            std::thread::Builder::new()
                .name("shim-identity".into())
                .spawn(move || identity::recheck_loop(s3))?,
        );
        if shared.settings.ungoverned.enabled {
            let (s4, cfg) = (shared.clone(), shared.settings.ungoverned.clone());
            threads.push(
                std::thread::Builder::new()
                    .name("shim-scan".into())
                    .spawn(move || scan::scan_loop(s4, cfg))?,
            );
        }
        Ok(ShimHub { shared, threads })
    }

    /// The optimiser's decision: each app's rate as a fraction of line rate, whether it is
    /// in the active set, and its completions per WQE (the model's `a`, for the polling
    /// grant). Published to every registered process of those apps.
    pub fn set_rates(&self, rates: &[AppDecision]) {
        let mut st = self.shared.lock();
        for d in rates {
            let rate = if d.active && d.rate.is_finite() && d.rate > 0.0 {
                d.rate.min(1.0)
            } else {
                self.shared.settings.parked_rate
            };
            let same = st
                .optimiser
                .get(&d.app)
                .filter(|o| (o.rate, o.cqe_per_wqe) == (rate, d.cqe_per_wqe));
            // A size not known when the decision was taken is taken as soon as it is.
            let bytes_per_wqe = match same.and_then(|o| o.bytes_per_wqe) {
                Some(b) => Some(b),
                None => st.bytes_per_wqe(&d.app),
            };
            st.optimiser.insert(
                d.app.clone(),
                Decided {
                    rate,
                    cqe_per_wqe: d.cqe_per_wqe,
                    weight: d.weight,
                    bytes_per_wqe,
                },
            );
        }
        self.shared.publish_all(&mut st);
    }

    /// A DASR cap towards receiver `gid` for every process on this host (0: none).
    pub fn set_peer_cap(&self, gid: [u8; 16], cap_bytes_per_s: u64, senders: u64) {
        let mut st = self.shared.lock();
        if cap_bytes_per_s == 0 {
            st.caps.remove(&gid);
        } else {
            st.caps.insert(gid, (cap_bytes_per_s, senders));
        }
        for c in st.conns.values() {
            if !c.map.table().set_peer_cap(gid, cap_bytes_per_s, senders) {
                warn!(
                    pid = c.pid,
                    "no free DASR cap entry in the table; cap not applied"
                );
            }
        }
    }

    pub fn caps(&self) -> Vec<PeerCapView> {
        let st = self.shared.lock();
        st.caps
            .iter()
            .map(|(g, &(cap, n))| PeerCapView {
                peer: drum_table::message::gid_hex(g),
                cap_bytes_per_s: cap,
                senders: n,
            })
            .collect()
    }

    pub fn usage(&self) -> Vec<ShimUsage> {
        let st = self.shared.lock();
        st.conns
            .values()
            .map(|c| {
                let t = c.map.table();
                let s = &t.shim;
                ShimUsage {
                    pid: c.pid,
                    app: c.app.clone(),
                    uid: c.identity.uid,
                    gid: c.identity.gid,
                    cgroup: c.identity.cgroup.clone(),
                    requested_app: c.requested.clone(),
                    send_wqes: s.send_wqes.load(Relaxed),
                    send_bytes: s.send_bytes.load(Relaxed),
                    completions: s.completions.load(Relaxed),
                    deferred_wqes: s.deferred_wqes.load(Relaxed),
                    queued_wqes: s.queued_wqes.load(Relaxed),
                    qps: s.qps.load(Relaxed),
                    active_qps: s.active_qps.load(Relaxed),
                    grant_generation: t.grant.generation.load(Relaxed),
                    applied_generation: s.applied_generation.load(Relaxed),
                    rate_cqe_per_s: t.grant.rate_cqe_per_s.load(Relaxed),
                    nic_outstanding_wqes: s.nic_outstanding_wqes.load(Relaxed),
                    held_polls: s.held_polls.load(Relaxed),
                }
            })
            .collect()
    }

    pub fn socket(&self) -> &Path {
        &self.shared.settings.socket
    }

    pub fn wire_cost(&self) -> WireCost {
        self.shared.settings.wire_cost()
    }

    /// The processes the last scan found using the NIC without a registered shim.
    pub fn ungoverned(&self) -> Vec<Ungoverned> {
        self.shared.lock().ungoverned.clone()
    }

    /// The registered processes the last audit found sending above their grant.
    pub fn over_grant(&self) -> Vec<OverGrant> {
        self.shared.lock().over_grant.clone()
    }

    /// The registered processes the last scan found driving hardware queues directly.
    pub fn direct_verbs(&self) -> Vec<DirectVerbs> {
        self.shared.lock().direct_verbs.clone()
    }

    /// What those processes send, and what registered ones send beyond their grant, as a
    /// fraction of the line rate (0 where the NIC does not count per process): the part of
    /// the host's budget the optimiser must not hand out.
    pub fn ungoverned_share(&self) -> f64 {
        let st = self.shared.lock();
        let bytes: f64 = st.ungoverned.iter().map(|u| u.tx_bytes_per_s).sum::<f64>()
            + st.over_grant
                .iter()
                .map(|o| o.excess_bytes_per_s)
                .sum::<f64>();
        (bytes / self.shared.settings.line_rate_bytes()).clamp(0.0, 1.0)
    }

    /// The weights tenant rules give the apps registered now.
    pub fn tenant_weights(&self) -> BTreeMap<String, f64> {
        let st = self.shared.lock();
        st.conns
            .values()
            .filter_map(|c| Some((c.app.clone(), c.weight?)))
            .collect()
    }

    /// Every app with a registered process, with its connected QPs per peer GID (over all its
    /// processes).
    pub fn app_peers(&self) -> BTreeMap<String, BTreeMap<[u8; 16], u32>> {
        self.shared.lock().app_peers()
    }

    /// Every app with a registered process and where its traffic goes, for the live
    /// problem's facilities: its measured byte shares per receiver (READ data on this host's
    /// own link) once it has sent anything, before that its connected QPs per peer GID.
    /// `now` is the agent's clock (any origin), for the byte rates.
    pub fn live_apps(&self, now: Duration) -> Vec<LiveApp> {
        let mut st = self.shared.lock();
        let peers = st.app_peers();
        let st = &mut *st;
        st.shares.retain(|a| peers.contains_key(a));
        let none = BTreeMap::new();
        peers
            .into_iter()
            .map(|(name, conns)| {
                let bytes = st.app_bytes.get(&name).unwrap_or(&none);
                st.shares.observe(&name, bytes, now.as_secs_f64());
                let (peers, own) = match st.shares.shares(&name) {
                    Some(shares) => {
                        let mut own = 0.0;
                        let mut peers = Vec::new();
                        for &(d, share) in shares {
                            match d {
                                Dest::Own => own = share,
                                Dest::Peer(gid) => peers.push((gid, share)),
                            }
                        }
                        (peers, own)
                    }
                    None => (conns.into_iter().map(|(g, n)| (g, n as f64)).collect(), 0.0),
                };
                LiveApp { name, peers, own }
            })
            .collect()
    }
}

impl Drop for ShimHub {
    fn drop(&mut self) {
        self.shared.stop.store(true, Relaxed);
        // Wakes the accept loop (accept fails on a shut-down listener).
        // SAFETY: shutting down our own descriptor.
        unsafe { libc::shutdown(self.shared.listener.as_raw_fd(), libc::SHUT_RDWR) };
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        let st = self.shared.lock();
        for c in st.conns.values() {
            // SAFETY: ends the reader's blocking recv; the descriptor stays owned by `c`.
            unsafe { libc::shutdown(c.sock.as_raw_fd(), libc::SHUT_RDWR) };
        }
        drop(st);
        let _ = std::fs::remove_file(&self.shared.settings.socket);
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, HubState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn flow(&self, peer: [u8; 16], app: &str) -> Flow {
        let incast = self.settings.apps.get(app).and_then(|p| p.incast);
        Flow {
            peer,
            msg_id: name_hash(app),
            lookahead: incast.map(|i| Lookahead {
                tenant: name_hash(app) as u32,
                group: i.group,
                members: i.members,
            }),
        }
    }

    /// Publishes every process's grant (after a decision, a change of who holds QPs, or a
    /// new reading of the processes' use): its part of its app's.
    fn publish_all(&self, st: &mut HubState) {
        let gates = self.qp_gates(st);
        let wholes: BTreeMap<u64, Grant> = st
            .conns
            .iter()
            .map(|(&id, c)| (id, self.grant_for(st, &c.app, gates.get(&id).copied())))
            .collect();
        let grants: BTreeMap<&str, u64> = st
            .conns
            .iter()
            .map(|(id, c)| (c.app.as_str(), wholes[id].rate_bytes_per_s))
            .collect();
        let parts = process_parts(st, &grants);
        for (id, c) in st.conns.iter_mut() {
            c.part = parts.get(id).copied().unwrap_or(1.0);
            c.map
                .table()
                .publish(&part_of_grant(&wholes[id], c.part), monotonic_ms());
        }
    }

    /// Each process's share of the host's QP budget (empty without one): the apps' gates by
    /// weight over the QPs they hold, each app's gate split among its processes alike.
    fn qp_gates(&self, st: &HubState) -> BTreeMap<u64, u64> {
        use drum_common::qp_share::{qp_gates, QpDemand};
        let budget = self.settings.qp_budget;
        if budget == 0 {
            return BTreeMap::new();
        }
        let mut apps: BTreeMap<&str, Vec<(u64, u64)>> = BTreeMap::new();
        for (&id, c) in &st.conns {
            apps.entry(&c.app).or_default().push((id, c.qps_held()));
        }
        let demands: Vec<QpDemand> = apps
            .iter()
            .map(|(app, procs)| QpDemand {
                weight: st.weight(app),
                qps: procs.iter().map(|p| p.1).sum(),
            })
            .collect();
        let mut out = BTreeMap::new();
        for (procs, gate) in apps.values().zip(qp_gates(budget, &demands)) {
            let alike: Vec<QpDemand> = procs
                .iter()
                .map(|&(_, qps)| QpDemand { weight: 1.0, qps })
                .collect();
            for (&(id, _), g) in procs.iter().zip(qp_gates(gate, &alike)) {
                out.insert(id, g);
            }
        }
        out
    }

    /// `gate`: the process's share of the host's QP budget, if there is one.
    fn grant_for(&self, st: &HubState, app: &str, gate: Option<u64>) -> Grant {
        let s = &self.settings;
        let pin = s.apps.get(app).cloned().unwrap_or_default();
        let decided = st.optimiser.get(app).copied();
        // The optimiser's rates are wire bytes, a pin is payload (docs/live-problem.md).
        let wire = |d: &Decided| s.wire_cost().factor(d.bytes_per_wqe);
        let payload = pin.rate.or(decided.map(|d| d.rate / wire(&d)));
        // The optimiser's polling rate `a·x`, unless the operator fixed the app's rate (then
        // only a polling pin meters its completions).
        let polling = || {
            let d = decided.filter(|_| pin.rate.is_none())?;
            let wire_per_wqe = d.bytes_per_wqe.map(|b| b * wire(&d));
            poll_grant(d.rate, d.cqe_per_wqe, s.line_rate_bytes(), wire_per_wqe)
        };
        Grant {
            rate_bytes_per_s: payload.map_or(0, |f| (f * s.line_rate_bytes()).round() as u64),
            rate_wqe_per_s: pin.rate_wqe_per_s.unwrap_or(0),
            rate_cqe_per_s: pin
                .rate_cqe_per_s
                .or_else(polling)
                .map_or(0, |r| r.min(MAX_RATE_WQE)),
            max_active_qps: pin
                .max_active_qps
                .unwrap_or(match (s.max_active_qps, gate) {
                    (0, g) => g.unwrap_or(0),
                    (k, g) => g.map_or(k, |g| g.min(k)),
                }),
            quantum_us: s.quantum_us,
            long_msg_bytes: s.long_msg_bytes,
            ..Grant::default()
        }
    }
}

/// Binds the registration socket, replacing a stale file left by a dead agent but never
/// one a live agent listens on.
fn listen(path: &Path) -> Result<OwnedFd> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    if path.exists() {
        if socket::connect(path).is_ok() {
            bail!("another agent is listening on {}", path.display());
        }
        std::fs::remove_file(path).with_context(|| format!("removing stale {}", path.display()))?;
    }
    let fd =
        socket::listen(path, 128).with_context(|| format!("listening on {}", path.display()))?;
    // Applications of every user may register; what they can do is bounded by the protocol.
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666))?;
    Ok(fd)
}

fn accept_loop(sh: Arc<Shared>) {
    while !sh.stop.load(Relaxed) {
        // SAFETY: accepting on our listener; the new descriptor is close-on-exec.
        let fd = unsafe {
            libc::accept4(
                sh.listener.as_raw_fd(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                libc::SOCK_CLOEXEC,
            )
        };
        if fd < 0 {
            let e = std::io::Error::last_os_error();
            if sh.stop.load(Relaxed) {
                return;
            }
            if e.kind() != std::io::ErrorKind::Interrupted {
                warn!(error = %e, "accepting a shim");
                std::thread::sleep(Duration::from_millis(10));
            }
            continue;
        }
        // SAFETY: a fresh descriptor we own.
        let sock = Arc::new(unsafe { OwnedFd::from_raw_fd(fd) });
        let s = sh.clone();
        if let Err(e) = std::thread::Builder::new()
            .name("shim-conn".into())
            .spawn(move || serve_conn(s, sock))
        {
            warn!(error = %e, "no thread for a shim connection; refused");
        }
    }
}

/// How often each process's use is read (its part of its app's grant follows it).
const READING: Duration = Duration::from_millis(250);

fn heartbeat_loop(sh: Arc<Shared>) {
    let mut last_beat = std::time::Instant::now() - HEARTBEAT;
    let clock = std::time::Instant::now();
    let mut last_reading = clock;
    while !sh.stop.load(Relaxed) {
        let mut st = sh.lock();
        if last_beat.elapsed() >= HEARTBEAT {
            let now = monotonic_ms();
            for c in st.conns.values() {
                c.map.table().beat(now);
            }
            last_beat = std::time::Instant::now();
        }
        if last_reading.elapsed() >= READING {
            // Each process's use, for its part of its app's grant.
            let now = clock.elapsed();
            for c in st.conns.values_mut() {
                let s = &c.map.table().shim;
                let counters = ShimCounters {
                    sent: s.send_bytes.load(Relaxed),
                    deferred: s.deferred_wqes.load(Relaxed),
                    held_polls: s.held_polls.load(Relaxed),
                    queued: s.queued_wqes.load(Relaxed),
                };
                c.meter.observe(counters, now);
            }
            let mut apps = BTreeSet::new();
            if st.conns.values().any(|c| !apps.insert(c.app.as_str())) {
                // an app with several processes: their parts may move
                sh.publish_all(&mut st);
            }
            last_reading = std::time::Instant::now();
        }
        let due: Vec<([u8; 16], String)> = st
            .ending
            .iter()
            .filter(|(_, t)| t.elapsed() >= END_LINGER)
            .map(|(k, _)| k.clone())
            .collect();
        for (peer, app) in due {
            st.ending.remove(&(peer, app.clone()));
            if let Some(h) = &sh.hook {
                h(&sh.flow(peer, &app), false);
            }
        }
        drop(st);
        std::thread::sleep(END_LINGER / 5);
    }
}

fn refuse(fd: RawFd, reason: &str) {
    let m = AgentMsg::Refused {
        reason: reason.into(),
    };
    let _ = socket::send(fd, m.encode().as_bytes());
}

fn serve_conn(sh: Arc<Shared>, sock: Arc<OwnedFd>) {
    let fd = sock.as_raw_fd();
    let id = match register(&sh, &sock) {
        Ok(id) => id,
        Err(e) => {
            warn!("shim registration refused: {e:#}");
            refuse(fd, &format!("{e:#}"));
            return;
        }
    };
    let mut buf = [0u8; MAX_LEN + 1];
    loop {
        let n = match socket::recv(fd, &mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(_) => break,
        };
        if n > MAX_LEN {
            warn!(
                bytes = n,
                "oversized message from a shim; connection closed"
            );
            break;
        }
        match ShimMsg::parse(&buf[..n]) {
            Ok(m) => on_message(&sh, id, m),
            Err(e) => {
                warn!("bad message from a shim ({e}); connection closed");
                break;
            }
        }
    }
    let mut st = sh.lock();
    if let Some(c) = leave(&sh, &mut st, id) {
        info!(pid = c.pid, app = %c.app, "shim left");
    }
}

/// Removes a registration: its traffic ends, its app's byte sums go with its last process,
/// and the others' QP gates take its share back.
fn leave(sh: &Shared, st: &mut HubState, id: u64) -> Option<Conn> {
    let c = st.conns.remove(&id)?;
    forget_app_if_unused(st, &c.app);
    for qpn in &c.busy {
        traffic(sh, st, c.qps.get(qpn).copied(), &c.app, false);
    }
    // The others take its part of the app's grant and its QP gate back.
    sh.publish_all(st);
    Some(c)
}

fn forget_app_if_unused(st: &mut HubState, app: &str) {
    if !st.conns.values().any(|o| o.app == app) {
        st.app_bytes.remove(app);
    }
}

fn register(sh: &Shared, sock: &Arc<OwnedFd>) -> Result<u64> {
    let fd = sock.as_raw_fd();
    socket::set_recv_timeout(fd, Some(HELLO_TIMEOUT))?;
    let mut buf = [0u8; MAX_LEN + 1];
    let n = socket::recv(fd, &mut buf).context("waiting for the shim's hello")?;
    if n > MAX_LEN {
        bail!("hello of {n} bytes (limit {MAX_LEN})");
    }
    let ShimMsg::Hello { pid, app, exe } = ShimMsg::parse(&buf[..n])? else {
        bail!("the first message must be HELLO");
    };
    let (real, uid, gid) = socket::peer_cred(fd).context("no peer credentials")?;
    if real != pid {
        bail!("hello claims pid {pid} but the peer is pid {real}");
    }
    // Who the process is comes from the kernel, never from the hello.
    let identity = Identity {
        uid,
        gid,
        cgroup: procfs::cgroup(pid),
    };
    let started = procfs::start_time(pid);
    // After registration the reader blocks until the shim talks.
    socket::set_recv_timeout(fd, None)?;
    let (map, table_fd) =
        Mapping::create(&format!("drum-table-{pid}")).context("creating the table")?;
    let mut st = sh.lock();
    if st.conns.len() >= sh.settings.max_shims {
        bail!(
            "{} shims registered already (shim.max_shims)",
            st.conns.len()
        );
    }
    for (gid, &(cap, n)) in &st.caps {
        map.table().set_peer_cap(*gid, cap, n);
    }
    let decision = sh
        .settings
        .tenants
        .decide(&identity, &app, &|name| st.holders(name));
    if let Some(why) = &decision.mapped {
        warn!(
            pid,
            uid,
            gid,
            cgroup = %identity.cgroup,
            requested = %app,
            granted = %decision.app,
            "tenant policy: the app asked for is not this identity's; governed as the granted one ({why})"
        );
    }
    let requested = decision.mapped.as_ref().map(|_| app.clone());
    let app = decision.app;
    st.next_id += 1;
    let id = st.next_id;
    st.conns.insert(
        id,
        Conn {
            pid,
            app: app.clone(),
            identity: identity.clone(),
            started,
            requested,
            weight: decision.weight,
            map,
            sock: sock.clone(),
            qps: BTreeMap::new(),
            qp_bytes: BTreeMap::new(),
            busy: BTreeSet::new(),
            qps_clamped: false,
            meter: ProcessMeter::default(),
            part: 1.0,
        },
    );
    // Its grant (and, with a QP budget, everyone's new shares) is in the table before the
    // shim maps it: a shim that finds no grant runs ungoverned.
    sh.publish_all(&mut st);
    let sent = send_with_fd(
        fd,
        AgentMsg::Welcome { app: app.clone() }.encode().as_bytes(),
        table_fd.as_raw_fd(),
    );
    if let Err(e) = sent {
        st.conns.remove(&id);
        sh.publish_all(&mut st);
        return Err(anyhow::Error::new(e).context("sending the table"));
    }
    info!(
        pid,
        app = %app,
        exe = %exe,
        uid = identity.uid,
        gid = identity.gid,
        cgroup = %identity.cgroup,
        table_bytes = TABLE_BYTES,
        "shim registered"
    );
    Ok(id)
}

fn on_message(sh: &Shared, id: u64, m: ShimMsg) {
    let mut st = sh.lock();
    let Some(c) = st.conns.get_mut(&id) else {
        return;
    };
    match m {
        ShimMsg::Hello { .. } => warn!(pid = c.pid, "second HELLO ignored"),
        ShimMsg::QpUp { qpn, peer, .. } => {
            // A process's connections are the agent's memory to spend: past the limit a new
            // one is not tracked (its traffic counts towards no receiver), and said once.
            if c.qps.len() < MAX_TRACKED_QPS || c.qps.contains_key(&qpn) {
                c.qp_bytes.remove(&qpn);
                // Grants are split by the QPs held (and so are QP gates).
                if c.qps.insert(qpn, peer).is_none() {
                    sh.publish_all(&mut st);
                }
            } else if !c.qps_clamped {
                c.qps_clamped = true;
                warn!(
                    pid = c.pid,
                    app = %c.app,
                    limit = MAX_TRACKED_QPS,
                    "shim reports more connected QPs than the agent tracks per process; ignoring the rest"
                );
            }
        }
        ShimMsg::QpGone { qpn } => {
            let peer = c.qps.remove(&qpn);
            c.qp_bytes.remove(&qpn);
            if c.busy.remove(&qpn) {
                let app = c.app.clone();
                traffic(sh, &mut st, peer, &app, false);
            }
            if peer.is_some() {
                sh.publish_all(&mut st);
            }
        }
        ShimMsg::Bytes { qpn, out, back } => {
            // Counts of a QP the agent does not track (never connected, or past the limit)
            // go nowhere: their peer is unknown.
            let Some(&peer) = c.qps.get(&qpn) else {
                return;
            };
            let now = PeerBytes { out, back };
            let Some(before) = c.qp_bytes.insert(qpn, now) else {
                return;
            };
            let app = c.app.clone();
            let sum = st
                .app_bytes
                .entry(app)
                .or_default()
                .entry(peer)
                .or_default();
            // A count that went back (the shim restarted its slot) adds nothing.
            sum.out = sum.out.saturating_add(out.saturating_sub(before.out));
            sum.back = sum.back.saturating_add(back.saturating_sub(before.back));
        }
        ShimMsg::Traffic { qpn, busy } => {
            let peer = c.qps.get(&qpn).copied();
            let changed = if busy {
                c.busy.insert(qpn)
            } else {
                c.busy.remove(&qpn)
            };
            if changed {
                let app = c.app.clone();
                traffic(sh, &mut st, peer, &app, busy);
            }
        }
    }
}

/// Tracks long-message traffic per receiver and app; the hook hears when the pair gains
/// its first busy QP, and [`END_LINGER`] after it lost its last one (unless traffic resumed
/// meanwhile).
fn traffic(sh: &Shared, st: &mut HubState, peer: Option<[u8; 16]>, app: &str, busy: bool) {
    let Some(peer) = peer else {
        return;
    };
    let key = (peer, app.to_string());
    let n = st.busy_peers.entry(key.clone()).or_insert(0);
    let before = *n;
    if busy {
        *n += 1;
    } else {
        *n = n.saturating_sub(1);
    }
    let after = *n;
    if after == 0 {
        st.busy_peers.remove(&key);
    }
    if before > 0 && after == 0 {
        st.ending.insert(key, std::time::Instant::now());
    } else if before == 0 && after > 0 && st.ending.remove(&key).is_none() {
        if let Some(h) = &sh.hook {
            h(&sh.flow(peer, app), true);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shim_metrics::ShimMetrics;
    use crate::shim_settings::tests::settings;
    use drum_table::mapping::recv_with_fd;

    /// The hub's metrics as the agent's endpoint serves them.
    fn metrics_text(hub: &Arc<ShimHub>) -> String {
        let mut registry = prometheus_client::registry::Registry::default();
        registry.register_collector(Box::new(ShimMetrics(hub.clone())));
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        text
    }

    fn decided(app: &str, active: bool, rate: f64) -> AppDecision {
        AppDecision {
            app: app.into(),
            active,
            rate,
            cqe_per_wqe: 1.0,
            weight: 1.0,
        }
    }

    fn connect(path: &Path) -> OwnedFd {
        socket::connect(path).unwrap()
    }

    fn hello(fd: &OwnedFd, pid: u32, app: &str) -> (String, Option<OwnedFd>) {
        let m = ShimMsg::Hello {
            pid,
            app: app.into(),
            exe: "/bin/test".into(),
        }
        .encode();
        socket::send(fd.as_raw_fd(), m.as_bytes()).unwrap();
        let mut buf = [0u8; MAX_LEN];
        let (n, f) = recv_with_fd(fd.as_raw_fd(), &mut buf).unwrap();
        (String::from_utf8_lossy(&buf[..n]).into_owned(), f)
    }

    fn wait_for(mut f: impl FnMut() -> bool) {
        let end = std::time::Instant::now() + Duration::from_secs(5);
        while !f() {
            assert!(
                std::time::Instant::now() < end,
                "condition not reached in 5 s"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    #[test]
    fn registration_grants_pins_and_optimiser_rates_and_refuses_liars() {
        let dir = tempfile::tempdir().unwrap();
        let hub = ShimHub::start(settings(dir.path()), None).unwrap();
        let me = std::process::id();

        let a = connect(hub.socket());
        let (m, fd) = hello(&a, me, "pinned");
        assert_eq!(m, "DRUM1 WELCOME app=pinned");
        let ta = Mapping::open(fd.unwrap().as_raw_fd()).unwrap();
        let g = ta.table().read_grant().unwrap();
        assert_eq!((g.rate_bytes_per_s, g.rate_cqe_per_s), (250_000_000, 1500));

        let b = connect(hub.socket());
        let (_, fd) = hello(&b, me, "free");
        let tb = Mapping::open(fd.unwrap().as_raw_fd()).unwrap();
        assert_eq!(
            tb.table().read_grant().unwrap().rate_bytes_per_s,
            0,
            "unlimited until the optimiser decides"
        );
        hub.set_rates(&[decided("free", true, 0.5), decided("pinned", true, 0.9)]);
        assert_eq!(
            tb.table().read_grant().unwrap().rate_bytes_per_s,
            500_000_000
        );
        assert_eq!(
            ta.table().read_grant().unwrap().rate_bytes_per_s,
            250_000_000,
            "the pin wins"
        );
        hub.set_rates(&[decided("free", false, 0.0)]);
        assert_eq!(
            tb.table().read_grant().unwrap().rate_bytes_per_s,
            10_000_000,
            "parked: a trickle"
        );

        let c = connect(hub.socket());
        let (m, fd) = hello(&c, me, "third");
        assert!(m.contains("REFUSED") && m.contains("max_shims"), "{m}");
        assert!(fd.is_none());

        let d = connect(hub.socket());
        drop(a);
        wait_for(|| hub.usage().len() == 1);
        let (m, _) = hello(&d, me + 1, "liar");
        assert!(m.contains("REFUSED") && m.contains("pid"), "{m}");

        // The heartbeat advances.
        let h0 = tb.table().heartbeat_ms();
        wait_for(|| tb.table().heartbeat_ms() > h0);
        drop(b);
        wait_for(|| hub.usage().is_empty());
        let path = hub.socket().to_path_buf();
        drop(hub);
        assert!(!path.exists(), "socket removed on stop");
    }

    /// An app's grant is split among its processes: equally while neither is measured, by
    /// use once they are (an idle one keeps a floor, a busy one the rest), and whole again
    /// when one leaves.
    #[test]
    fn an_apps_processes_share_its_grant_by_their_use() {
        let dir = tempfile::tempdir().unwrap();
        let hub = ShimHub::start(settings(dir.path()), None).unwrap();
        let me = std::process::id();
        let (a, b) = (connect(hub.socket()), connect(hub.socket()));
        let ta = Mapping::open(hello(&a, me, "split").1.unwrap().as_raw_fd()).unwrap();
        let tb = Mapping::open(hello(&b, me, "split").1.unwrap().as_raw_fd()).unwrap();
        hub.set_rates(&[decided("split", true, 0.5)]);
        let bytes = |t: &Mapping| t.table().read_grant().unwrap().rate_bytes_per_s;
        assert_eq!((bytes(&ta), bytes(&tb)), (250_000_000, 250_000_000));
        // a sends nothing; b sends and its shim defers work: b wants more
        let sent = std::sync::atomic::AtomicU64::new(0);
        wait_for(|| {
            let n = sent.fetch_add(20_000_000, Relaxed);
            tb.table().shim.send_bytes.store(n, Relaxed);
            tb.table().shim.deferred_wqes.store(n / 1000, Relaxed);
            std::thread::sleep(Duration::from_millis(50));
            bytes(&tb) > 400_000_000
        });
        // a keeps a quarter of an equal share
        assert_eq!((bytes(&ta), bytes(&tb)), (62_500_000, 437_500_000));
        drop(b);
        wait_for(|| hub.usage().len() == 1);
        wait_for(|| bytes(&ta) == 500_000_000);
    }

    /// The polling grant turns the WQE rate into completions with the app's mean send size
    /// as measured when the rate was decided: the same decision published again (a shim
    /// registering, an agent holding its grants while the coordinator is away) gives the same
    /// grant however the app's sends changed since; the next decision uses the new size.
    #[test]
    fn a_republished_decision_keeps_its_polling_grant() {
        let dir = tempfile::tempdir().unwrap();
        let hub = ShimHub::start(settings(dir.path()), None).unwrap();
        let a = connect(hub.socket());
        let (_, fd) = hello(&a, std::process::id(), "free");
        let t = Mapping::open(fd.unwrap().as_raw_fd()).unwrap();
        let sends = |wqes: u64, bytes: u64| {
            t.table().shim.send_wqes.store(wqes, Relaxed);
            t.table().shim.send_bytes.store(bytes, Relaxed);
        };
        let cqe = || t.table().read_grant().unwrap().rate_cqe_per_s;
        sends(1000, 1000 * 65536);
        hub.set_rates(&[decided("free", true, 0.5)]);
        let large = cqe();
        assert!(large > 0);
        sends(2000, 1000 * 65536 + 1000 * 512);
        hub.set_rates(&[decided("free", true, 0.5)]);
        assert_eq!(cqe(), large, "the same decision, the same grant");
        hub.set_rates(&[decided("free", true, 0.4)]);
        assert!(
            cqe() > large,
            "a new decision uses the smaller sends: {}",
            cqe()
        );
    }

    /// An app's traffic shares come from its QPs' byte reports: before it sends, its
    /// connections; then 3 parts written to one receiver for 1 to the other (0.75 / 0.25),
    /// and the bytes it reads land on this host's own link. A QP's first report is a baseline.
    #[test]
    fn byte_reports_become_the_apps_traffic_shares() {
        let dir = tempfile::tempdir().unwrap();
        let hub = ShimHub::start(settings(dir.path()), None).unwrap();
        let s = connect(hub.socket());
        let (m, _fd) = hello(&s, std::process::id(), "w");
        assert_eq!(m, "DRUM1 WELCOME app=w");
        let send = |m: ShimMsg| socket::send(s.as_raw_fd(), m.encode().as_bytes()).unwrap();
        for (qpn, peer) in [(1, [1; 16]), (2, [2; 16]), (3, [2; 16])] {
            send(ShimMsg::QpUp {
                qpn,
                peer,
                peer_qpn: 9,
            });
        }
        let bytes = |qpn, out, back| ShimMsg::Bytes { qpn, out, back };
        // Baselines (a reused slot's old counts must not count), and one for an unknown QP.
        for m in [
            bytes(1, 100, 0),
            bytes(2, 100, 0),
            bytes(3, 0, 0),
            bytes(77, 5, 5),
        ] {
            send(m);
        }
        wait_for(|| {
            hub.shared
                .lock()
                .conns
                .values()
                .all(|c| c.qp_bytes.len() == 3)
        });
        let secs = Duration::from_secs;
        let apps = hub.live_apps(secs(0));
        assert_eq!(apps.len(), 1);
        assert_eq!(apps[0].peers, vec![([1; 16], 1.0), ([2; 16], 2.0)]);
        assert_eq!(apps[0].own, 0.0, "connections until it has sent");
        for m in [bytes(1, 3100, 0), bytes(2, 600, 0), bytes(3, 500, 0)] {
            send(m);
        }
        wait_for(|| {
            hub.shared
                .lock()
                .app_bytes
                .get("w")
                .is_some_and(|b| b.len() == 2)
        });
        wait_for(|| {
            let b = &hub.shared.lock().app_bytes["w"];
            b[&[1; 16]].out == 3000 && b[&[2; 16]].out == 1000
        });
        let apps = hub.live_apps(secs(1));
        assert_eq!(apps[0].peers, vec![([1; 16], 0.75), ([2; 16], 0.25)]);
        // Now it only reads from host 2: the shares move to its own link.
        send(bytes(3, 500, 1_000_000));
        wait_for(|| hub.shared.lock().app_bytes["w"][&[2; 16]].back == 1_000_000);
        let apps = hub.live_apps(secs(2));
        assert!(apps[0].own > 0.9, "{apps:?}");
    }

    /// Absurd app names (empty, 10 KB, control characters) are refused with the reason (the
    /// same text the agent logs, `shim registration refused: …`, spaces as `_` on the wire),
    /// and a process that reports
    /// 10,000 connected QPs is tracked up to the limit; a well-behaved app registered beside
    /// them is not disturbed.
    #[test]
    fn absurd_names_are_refused_and_a_flood_of_qps_is_clamped() {
        let dir = tempfile::tempdir().unwrap();
        let hub = ShimHub::start(settings(dir.path()), None).unwrap();
        let me = std::process::id();
        let good = connect(hub.socket());
        let (m, fd) = hello(&good, me, "good");
        assert_eq!(m, "DRUM1 WELCOME app=good");
        let table = Mapping::open(fd.unwrap().as_raw_fd()).unwrap();
        let long = "x".repeat(10 * 1024);
        for (name, want) in [
            ("", "empty_value_for_app"),
            ("a\u{1}b", "\"a\\u{1}b\"_is_not_a_valid_app_name"),
            ("tab\there", "REFUSED"),
            (long.as_str(), "bytes_(limit_512)"),
        ] {
            let c = connect(hub.socket());
            let raw = format!("DRUM1 HELLO pid={me} app={name} exe=/x");
            socket::send(c.as_raw_fd(), raw.as_bytes()).unwrap();
            let mut buf = [0u8; MAX_LEN];
            let (n, fd) = recv_with_fd(c.as_raw_fd(), &mut buf).unwrap();
            let reply = String::from_utf8_lossy(&buf[..n]);
            assert!(
                reply.contains("REFUSED") && reply.contains(want),
                "{name:.20?}: {reply}"
            );
            assert!(fd.is_none());
        }
        for qpn in 0..10_000u32 {
            let up = ShimMsg::QpUp {
                qpn,
                peer: [7; 16],
                peer_qpn: 1,
            }
            .encode();
            // The shim's socket does not block: wait for the agent to drain it.
            while let Err(e) = socket::send(good.as_raw_fd(), up.as_bytes()) {
                assert_eq!(e.kind(), std::io::ErrorKind::WouldBlock, "{e}");
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        wait_for(|| {
            hub.app_peers()
                .get("good")
                .is_some_and(|p| p[&[7; 16]] as usize == MAX_TRACKED_QPS)
        });
        assert_eq!(hub.usage().len(), 1, "still registered");
        hub.set_rates(&[decided("good", true, 0.5)]);
        assert_eq!(
            table.table().read_grant().unwrap().rate_bytes_per_s,
            500_000_000
        );
    }

    /// A hub with a host QP budget of 20 and two registered apps of this process, `victim`
    /// and `attacker`: their sockets and tables.
    struct TwoApps {
        hub: Arc<ShimHub>,
        victim: OwnedFd,
        attacker: OwnedFd,
        v: Mapping,
        a: Mapping,
    }

    fn two_apps(dir: &Path) -> TwoApps {
        let hub = ShimHub::start(
            ShimSettings {
                qp_budget: 20,
                ..settings(dir)
            },
            None,
        )
        .map(Arc::new)
        .unwrap();
        let me = std::process::id();
        let (victim, attacker) = (connect(hub.socket()), connect(hub.socket()));
        let (_, fd) = hello(&victim, me, "victim");
        let v = Mapping::open(fd.unwrap().as_raw_fd()).unwrap();
        let (_, fd) = hello(&attacker, me, "attacker");
        let a = Mapping::open(fd.unwrap().as_raw_fd()).unwrap();
        TwoApps {
            hub,
            victim,
            attacker,
            v,
            a,
        }
    }

    /// The shim on `fd` reports its QP `qpn` connected.
    fn up(fd: &OwnedFd, qpn: u32) {
        let m = ShimMsg::QpUp {
            qpn,
            peer: [7; 16],
            peer_qpn: 1,
        }
        .encode();
        socket::send(fd.as_raw_fd(), m.as_bytes()).unwrap();
    }

    /// With a host QP budget, an app with one QP keeps it and one with 64 gets the rest of
    /// the budget as its gate; an app leaving gives its share back; an operator's per-app
    /// limit still caps the share.
    #[test]
    fn the_hosts_qp_budget_becomes_the_apps_gates() {
        let dir = tempfile::tempdir().unwrap();
        let TwoApps {
            hub,
            victim,
            attacker,
            v,
            a,
        } = two_apps(dir.path());
        let gate = |t: &Mapping| t.table().read_grant().unwrap().max_active_qps;
        up(&victim, 1);
        for qpn in 0..64 {
            up(&attacker, qpn);
        }
        wait_for(|| gate(&v) == 1 && gate(&a) == 19);
        // Weights from the optimiser's decisions count: 1 and 3 share what is beyond one slot.
        up(&victim, 2);
        for qpn in 3..40 {
            up(&victim, qpn);
        }
        hub.set_rates(&[
            decided("victim", true, 0.5),
            AppDecision {
                weight: 3.0,
                ..decided("attacker", true, 0.5)
            },
        ]);
        wait_for(|| gate(&v) == 5 && gate(&a) == 15);
        drop(victim);
        wait_for(|| gate(&a) == 20);
    }

    /// A shim that writes garbage over its whole table (4 KiB of pseudo-random words,
    /// extremes among them) changes no other app's grant, and the agent neither crashes nor
    /// stops serving: the other app's rate, polling grant and QP gate stay what they were
    /// (the victim holds fewer QPs than its share of the host's budget, which any claim of
    /// the attacker's, bounded by what the agent tracks, leaves it), and status and metrics
    /// still render.
    #[test]
    fn garbage_in_one_table_changes_no_other_apps_grant() {
        let dir = tempfile::tempdir().unwrap();
        let TwoApps {
            hub,
            victim,
            attacker,
            v,
            a,
        } = two_apps(dir.path());
        for qpn in 0..3 {
            up(&victim, qpn);
        }
        up(&attacker, 1);
        let decide = || {
            hub.set_rates(&[
                AppDecision {
                    cqe_per_wqe: 2.0,
                    ..decided("victim", true, 0.4)
                },
                decided("attacker", true, 0.4),
            ])
        };
        v.table().shim.send_wqes.store(1000, Relaxed);
        v.table().shim.send_bytes.store(1000 * 4096, Relaxed);
        decide();
        wait_for(|| v.table().read_grant().unwrap().max_active_qps == 3);
        let before = v.table().read_grant().unwrap();
        assert!(before.rate_cqe_per_s > 0 && before.rate_bytes_per_s > 0);
        // SAFETY: the mapping is TABLE_BYTES long and every word of it is an atomic the
        // shim may store to (a hostile shim stores anything).
        let words = unsafe {
            &*(a.table() as *const drum_table::layout::Table
                as *const [std::sync::atomic::AtomicU64; TABLE_BYTES / 8])
        };
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for (i, w) in words.iter().enumerate() {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            w.store([x, u64::MAX, 0, 1 << 63][i % 4], Relaxed);
        }
        // The agent goes on: new decisions, connections, caps, status and metrics.
        decide();
        up(&attacker, 2);
        up(&victim, 2);
        hub.set_peer_cap([9; 16], 1_000_000, 2);
        hub.set_peer_cap([9; 16], 0, 0);
        decide();
        std::thread::sleep(Duration::from_millis(100));
        let after = v.table().read_grant().unwrap();
        assert_eq!(
            Grant {
                generation: 0,
                ..after
            },
            Grant {
                generation: 0,
                ..before
            }
        );
        assert_eq!(hub.usage().len(), 2);
        assert!(metrics_text(&hub).contains("app=\"victim\""));
        let live = hub.live_apps(Duration::from_secs(1));
        assert_eq!(live.len(), 2);
    }

    /// A process whose table says it took hardware queues (direct verbs) is listed with its
    /// pid, uid, app, count and reason, and in the metrics; one that says nothing is not.
    #[test]
    fn a_process_whose_shim_reports_direct_verbs_is_listed_and_counted() {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = settings(dir.path());
        cfg.ungoverned.scan_ms = 50;
        let hub = Arc::new(ShimHub::start(cfg, None).unwrap());
        let me = std::process::id();
        let (direct, plain) = (connect(hub.socket()), connect(hub.socket()));
        let (_, fd) = hello(&direct, me, "dv");
        let t = Mapping::open(fd.unwrap().as_raw_fd()).unwrap();
        let (_, _plain_table) = hello(&plain, me, "plain");
        t.table().shim.direct_verbs_queues.store(2, Relaxed);
        wait_for(|| !hub.direct_verbs().is_empty());
        let listed = hub.direct_verbs();
        assert_eq!(listed.len(), 1, "{listed:?}");
        let d = &listed[0];
        assert_eq!((d.pid, d.app.as_str(), d.queues), (me, "dv", 2));
        // SAFETY: getuid cannot fail.
        assert_eq!(d.uid, unsafe { libc::getuid() });
        assert!(d.reason.contains("mlx5dv_init_obj on 2 queues"), "{d:?}");
        let text = metrics_text(&hub);
        assert!(
            text.contains("drum_agent_direct_verbs_processes 1"),
            "{text}"
        );
        assert!(
            text.contains(&format!(
                "drum_agent_direct_verbs_queues{{pid=\"{me}\",uid=\"{}\",app=\"dv\"}} 2",
                d.uid
            )),
            "{text}"
        );
        drop(direct);
        wait_for(|| hub.direct_verbs().is_empty());
    }

    /// The polling grant follows the optimiser: `a·x` in completions per second, for the
    /// WQE size the app's shims have measured, with headroom; nothing before that size is
    /// known, and a parked app's trickle is metered the same way.
    #[test]
    fn polling_grant_is_the_optimisers_a_times_x_at_the_measured_wqe_size() {
        let dir = tempfile::tempdir().unwrap();
        let hub = ShimHub::start(settings(dir.path()), None).unwrap();
        let s = connect(hub.socket());
        let (_, fd) = hello(&s, std::process::id(), "free");
        let t = Mapping::open(fd.unwrap().as_raw_fd()).unwrap();
        let cqe = || t.table().read_grant().unwrap().rate_cqe_per_s;
        let two = AppDecision {
            cqe_per_wqe: 2.0,
            ..decided("free", true, 0.5)
        };
        hub.set_rates(std::slice::from_ref(&two));
        assert_eq!(cqe(), 0, "WQE size not known yet: unmetered");
        t.table().shim.send_wqes.store(1000, Relaxed);
        t.table().shim.send_bytes.store(1000 * 65536, Relaxed);
        hub.set_rates(std::slice::from_ref(&two));
        // 0.5 × 1 GB/s in 64 KiB WQEs, two completions each, 25 % headroom.
        assert_eq!(cqe(), 19074);
        hub.set_rates(&[AppDecision {
            active: false,
            ..two
        }]);
        assert_eq!(cqe(), 382, "parked: 1 % of the line");
    }

    #[test]
    fn traffic_hook_hears_first_and_last_busy_qp_per_receiver() {
        let dir = tempfile::tempdir().unwrap();
        let heard = Arc::new(Mutex::new(Vec::new()));
        let h = heard.clone();
        let hub = ShimHub::start(
            settings(dir.path()),
            Some(Box::new(move |f: &Flow, busy| {
                h.lock().unwrap().push((f.peer[15], busy))
            })),
        )
        .unwrap();
        let a = connect(hub.socket());
        let (_, _fd) = hello(&a, std::process::id(), "x");
        let mut peer = [0u8; 16];
        peer[15] = 9;
        for m in [
            ShimMsg::QpUp {
                qpn: 1,
                peer,
                peer_qpn: 5,
            },
            ShimMsg::QpUp {
                qpn: 2,
                peer,
                peer_qpn: 6,
            },
            ShimMsg::Traffic { qpn: 1, busy: true },
            ShimMsg::Traffic { qpn: 2, busy: true },
            ShimMsg::Traffic {
                qpn: 1,
                busy: false,
            },
        ] {
            socket::send(a.as_raw_fd(), m.encode().as_bytes()).unwrap();
        }
        wait_for(|| heard.lock().unwrap().len() == 1);
        assert_eq!(heard.lock().unwrap()[0], (9, true));
        drop(a); // QP 2 still busy: leaving ends its traffic
        wait_for(|| heard.lock().unwrap().len() == 2);
        assert_eq!(heard.lock().unwrap()[1], (9, false));
    }

    /// Each app's traffic towards a receiver is its own DASR message, with a message id
    /// stable across hosts; an app with an incast pin carries its group, others none; a
    /// group of 0 members is refused.
    #[test]
    fn flows_are_per_app_and_carry_the_apps_incast_group() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = settings(dir.path());
        s.apps.get_mut("pinned").unwrap().incast = Some(IncastPin {
            group: 7,
            members: 0,
        });
        let e = s.validate().unwrap_err().to_string();
        assert!(e.contains("incast.members"), "{e}");
        s.apps.get_mut("pinned").unwrap().incast = Some(IncastPin {
            group: 7,
            members: 4,
        });
        let heard = Arc::new(Mutex::new(Vec::new()));
        let h = heard.clone();
        let hub = ShimHub::start(
            s,
            Some(Box::new(move |f: &Flow, busy| {
                h.lock().unwrap().push((f.clone(), busy))
            })),
        )
        .unwrap();
        let mut peer = [0u8; 16];
        peer[15] = 9;
        let socks: Vec<_> = ["pinned", "x"]
            .iter()
            .map(|app| {
                let c = connect(hub.socket());
                let (_, fd) = hello(&c, std::process::id(), app);
                for m in [
                    ShimMsg::QpUp {
                        qpn: 1,
                        peer,
                        peer_qpn: 5,
                    },
                    ShimMsg::Traffic { qpn: 1, busy: true },
                ] {
                    socket::send(c.as_raw_fd(), m.encode().as_bytes()).unwrap();
                }
                wait_for(|| {
                    heard
                        .lock()
                        .unwrap()
                        .iter()
                        .any(|h| h.0.msg_id == name_hash(app))
                });
                (c, fd)
            })
            .collect();
        let got = heard.lock().unwrap().clone();
        assert_eq!(got.len(), 2, "{got:?}");
        assert_eq!(
            got[0],
            (
                Flow {
                    peer,
                    msg_id: name_hash("pinned"),
                    lookahead: Some(Lookahead {
                        tenant: name_hash("pinned") as u32,
                        group: 7,
                        members: 4,
                    }),
                },
                true
            )
        );
        assert_eq!(got[1].0.lookahead, None);
        assert_ne!(got[0].0.msg_id, got[1].0.msg_id);
        // FNV-1a's published value for "a": the same ids on every host and build.
        assert_eq!(name_hash("a"), 0xaf63_dc4c_8601_ec8c);
        drop(socks);
    }

    #[test]
    fn a_live_socket_is_not_stolen_and_bad_settings_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let hub = ShimHub::start(settings(dir.path()), None).unwrap();
        let e = ShimHub::start(settings(dir.path()), None).err().unwrap();
        assert!(e.to_string().contains("another agent"), "{e}");
        drop(hub);
        let mut s = settings(dir.path());
        s.line_rate_gbps = f64::NAN;
        assert!(ShimHub::start(s, None).is_err());
        let mut s = settings(dir.path());
        s.apps.get_mut("pinned").unwrap().rate = Some(1.5);
        assert!(ShimHub::start(s, None)
            .err()
            .unwrap()
            .to_string()
            .contains("(0, 1]"));
    }
}
