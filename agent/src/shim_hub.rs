//! The agent's side of the shim link (docs/design.md §7): a Unix `SOCK_SEQPACKET` socket where
//! every `libdrum_shim.so` on the host registers, and one shared-memory table per
//! registered process, in which the agent writes the app's grant (rates, active-QP limit,
//! DASR caps, a heartbeat) and the shim writes its counters.
//!
//! Threads, not tasks: registration and the per-shim readers block in `accept`/`recv`, and
//! the heartbeat must keep beating while the async runtime is busy. The state is small and
//! behind one mutex that no thread holds across a system call that can block.

mod grants;
mod identity;
mod registration;
mod scan;

use registration::{accept_loop, listen};

use crate::grant_audit::OverGrant;
pub use crate::shim_settings::{AppPin, IncastPin, ShimSettings};
use crate::tenants::Identity;
use crate::ungoverned::direct_verbs::DirectVerbs;
use crate::ungoverned::Ungoverned;
use anyhow::Result;
use drum_common::dasr::Lookahead;
use drum_common::live::LiveApp;
use drum_common::process_share::{ProcessMeter, ShimCounters};
use drum_common::traffic_shares::{Dest, PeerBytes, TrafficShares};
use drum_common::wire_cost::WireCost;
use drum_table::layout::monotonic_ms;
use drum_table::mapping::Mapping;
use drum_table::profile::mean_wqe_bytes;
use std::collections::{BTreeMap, BTreeSet};
use std::os::fd::{AsRawFd, OwnedFd};
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

/// What one registered process reports (its table's counters), and what it is granted.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
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
    /// The payload bytes per second its table grants it (0: unlimited): its part of its
    /// app's grant.
    pub grant_bytes_per_s: u64,
    /// That part: 1 for an app's only process (docs/tenants.md, "one app, many processes").
    pub grant_part: f64,
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
                    grant_generation: t.generation(),
                    applied_generation: s.applied_generation.load(Relaxed),
                    rate_cqe_per_s: t.grant.rate_cqe_per_s.load(Relaxed),
                    nic_outstanding_wqes: s.nic_outstanding_wqes.load(Relaxed),
                    held_polls: s.held_polls.load(Relaxed),
                    grant_bytes_per_s: t.grant.rate_bytes_per_s.load(Relaxed),
                    grant_part: c.part,
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

#[cfg(test)]
mod tests;
