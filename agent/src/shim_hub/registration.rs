//! Registration: the socket every shim connects to, one thread per registered process
//! reading what its shim reports (QPs, bytes per peer), and what its departure undoes.

use super::{Conn, HubState, Shared, HELLO_TIMEOUT, MAX_TRACKED_QPS};
use crate::procfs;
use crate::tenants::Identity;
use anyhow::{bail, Context, Result};
use drum_common::process_share::ProcessMeter;
use drum_common::traffic_shares::PeerBytes;
use drum_table::layout::TABLE_BYTES;
use drum_table::mapping::{send_with_fd, Mapping};
use drum_table::message::{AgentMsg, ShimMsg, MAX_LEN};
use drum_table::socket;
use std::collections::{BTreeMap, BTreeSet};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::Path;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::Duration;
use tracing::{info, warn};

/// Binds the registration socket, replacing a stale file left by a dead agent but never
/// one a live agent listens on.
pub(super) fn listen(path: &Path) -> Result<OwnedFd> {
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

pub(super) fn accept_loop(sh: Arc<Shared>) {
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
pub(super) fn leave(sh: &Shared, st: &mut HubState, id: u64) -> Option<Conn> {
    let c = st.conns.remove(&id)?;
    forget_app_if_unused(st, &c.app);
    for qpn in &c.busy {
        traffic(sh, st, c.qps.get(qpn).copied(), &c.app, false);
    }
    // The others take its part of the app's grant and its QP gate back.
    sh.publish_all(st);
    Some(c)
}

pub(super) fn forget_app_if_unused(st: &mut HubState, app: &str) {
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
pub(super) fn traffic(
    sh: &Shared,
    st: &mut HubState,
    peer: Option<[u8; 16]>,
    app: &str,
    busy: bool,
) {
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
