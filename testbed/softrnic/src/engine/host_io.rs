//! The engine's start ([`run`]), its threads and host I/O: the provider connections, the UDP
//! receive and transmit loops with GSO/GRO, and the counters file.

use super::*;
use crate::dart_receiver::Policy;
use crate::hosts;
use std::path::Path;

/// Send `bytes` on an event stream without blocking (a process that does not read its events
/// cannot stall the engine). Whether all of it was sent.
pub(super) fn send_nowait(sink: &UnixStream, bytes: &[u8]) -> bool {
    // SAFETY: sends from a live buffer of the given length on a socket we own.
    let n = unsafe {
        libc::send(
            sink.as_raw_fd(),
            bytes.as_ptr() as *const libc::c_void,
            bytes.len(),
            libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
        )
    };
    n == bytes.len() as isize
}

pub(super) fn peer_pid(s: &UnixStream) -> io::Result<i32> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: cred and len are valid out-parameters of the sizes passed.
    let r = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            &mut cred as *mut _ as *mut libc::c_void,
            &mut len,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(cred.pid)
}

pub(super) fn serve_conn(sh: Arc<Shared>, mut s: UnixStream, conn: u64) {
    let pid = match peer_pid(&s) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("softrnic engine: SO_PEERCRED: {e}");
            return;
        }
    };
    let mut first = true;
    while let Ok(body) = proto::read_frame(&mut s) {
        if std::mem::take(&mut first) {
            match Req::decode(&body) {
                Ok(Req::AttachChannel { id, token }) => {
                    serve_channel(&sh, s, pid, id, token);
                    return;
                }
                Ok(Req::JoinContext { conn: owner, token }) => {
                    serve_forked(&sh, s, pid, owner, token);
                    return;
                }
                _ => {}
            }
        }
        let resp = answer(&sh, conn, pid, &body, false);
        if proto::write_frame(&mut s, &resp.encode()).is_err() {
            break;
        }
    }
    sh.lock(Holder::Connection).drop_conn(conn, Instant::now());
}

/// A request of process `pid` on behalf of context `conn`; `joined`: from a process that
/// joined it, which finds it gone (`ENODEV`) once its owner's connection has closed.
fn answer(sh: &Shared, conn: u64, pid: i32, body: &[u8], joined: bool) -> Resp {
    match Req::decode(body) {
        Ok(req) => {
            let mut st = sh.lock(Holder::Verbs);
            if joined && !st.context_keys.contains_key(&conn) {
                return err(libc::ENODEV);
            }
            let r = st.request(conn, pid, req, Instant::now());
            sh.flush_out(&mut st);
            drop(st);
            sh.kick();
            r
        }
        Err(_) => err(libc::EINVAL),
    }
}

/// The connection of process `pid`, forked from the owner of context `owner`, which shows
/// the context's secret: its requests act on that context, with its own memory. The context
/// ends with its owner's connection, as before; this one ending leaves it alone.
fn serve_forked(sh: &Shared, mut s: UnixStream, pid: i32, owner: u64, token: u64) {
    let joined = sh.lock(Holder::Connection).context_keys.get(&owner) == Some(&token);
    let resp = if joined { Resp::Unit } else { err(libc::EPERM) };
    if proto::write_frame(&mut s, &resp.encode()).is_err() || !joined {
        return;
    }
    while let Ok(body) = proto::read_frame(&mut s) {
        let resp = answer(sh, owner, pid, &body, true);
        if proto::write_frame(&mut s, &resp.encode()).is_err() {
            break;
        }
    }
}

/// A channel's event connection: attach it, then wait for the process to close it.
pub(super) fn serve_channel(sh: &Shared, mut s: UnixStream, pid: i32, id: u32, token: u64) {
    let resp = match s.try_clone() {
        Ok(sink) => sh
            .lock(Holder::Connection)
            .attach_channel(pid, id, token, sink),
        Err(_) => err(libc::ENOMEM),
    };
    let ok = resp == Resp::Unit;
    if proto::write_frame(&mut s, &resp.encode()).is_err() || !ok {
        return;
    }
    // Nothing more is sent on this connection; EOF means the channel was destroyed.
    while proto::read_frame(&mut s).is_ok() {}
    let mut st = sh.lock(Holder::Connection);
    st.channels.remove(&id);
    for c in st.cqs.values_mut().filter(|c| c.channel == id) {
        c.channel = 0;
        c.armed = false;
    }
}

/// A secret that only the process that created a channel learns.
pub(super) fn random_u64() -> u64 {
    let mut b = [0u8; 8];
    // SAFETY: getrandom writes at most b.len() bytes into b.
    let n = unsafe { libc::getrandom(b.as_mut_ptr() as *mut libc::c_void, b.len(), 0) };
    if n == 8 {
        return u64::from_ne_bytes(b);
    }
    // No getrandom: the clock's nanoseconds, mixed (the socket is root-only anyway).
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    crate::faults::Rng::new(t ^ u64::from(std::process::id())).next_u64()
}

/// Only requester-side packets (ACK, NAK, READ response) and READ requests can give the
/// transmitter something to do (a window opens, a resend is due, READ responses are to go
/// out); a responder's other answers are single packets sent at once.
pub(super) fn wakes_transmitter(op: u8) -> bool {
    matches!(
        op,
        wire::OP_ACK | wire::OP_NAK | wire::OP_READ_RESP | wire::OP_ATOMIC_RESP | wire::OP_READ_REQ
    )
}

pub(super) fn rx_loop(sh: Arc<Shared>) {
    let mut buf = vec![0u8; 65536];
    // The socket's receive timeout: set while the receive port holds packets, so that they
    // are handed on when due even if nothing else arrives.
    let mut timeout = None;
    loop {
        let got = if sh.gso {
            recv_gro(&sh.udp, &mut buf)
        } else {
            sh.udp.recv_from(&mut buf).map(|(n, f)| (n, f, None))
        };
        let got = match got {
            Ok(v) => Some(v),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                None
            }
            Err(e) => {
                eprintln!("softrnic engine: udp receive: {e}");
                std::thread::sleep(TICK);
                continue;
            }
        };
        let mut st = sh.lock(Holder::Receiver);
        let held = Instant::now();
        let mut wake = false;
        let mut packets = 0;
        if let Some((n, from, seg)) = got {
            if st.fabric.up {
                // With GRO the kernel may have coalesced datagrams of one size (the last may
                // be shorter): each is one packet.
                let seg = seg.unwrap_or(n).max(1);
                packets = (n / seg).max(1);
                let mut off = 0;
                // (A zero-length datagram is one packet too: malformed.)
                while off < n || (n == 0 && off == 0) {
                    let d = &buf[off..(off + seg).min(n)];
                    off += seg;
                    st.counters.rx_packets += 1;
                    match Packet::decode(d) {
                        Some(p) => {
                            wake |= wakes_transmitter(p.op);
                            st.arrive(from, p, d.len(), Instant::now());
                        }
                        None => st.counters.rx_dropped_malformed += 1,
                    }
                }
            } else {
                st.counters.port_down_dropped += 1;
            }
        }
        let now = Instant::now();
        let (released, next_due) = st.release_waiting(now);
        // (what they are is not looked at again: one of them may be an ACK)
        wake |= released > 0;
        let arrived = held.elapsed();
        // Nothing stays gathered while the lock is free (see `placement`).
        st.place_all(now);
        let placed = held.elapsed();
        sh.flush_out(&mut st);
        drop(st);
        let total = held.elapsed();
        if total >= SLOW_LOCK {
            eprintln!(
                "softrnic engine: the receiver held the NIC's state {} ms for {} packets: {} ms \
                 taking them in, {} ms placing data into applications' memory, {} ms sending",
                total.as_millis(),
                packets + released,
                arrived.as_millis(),
                (placed - arrived).as_millis(),
                (total - placed).as_millis()
            );
        }
        if wake {
            sh.kick();
        }
        let wanted = next_due.map(|t| t.saturating_duration_since(now).max(MIN_RX_WAIT));
        if wanted != timeout {
            if let Err(e) = sh.udp.set_read_timeout(wanted) {
                // (then the held packets go on with the next packet to arrive)
                eprintln!("softrnic engine: udp receive timeout: {e}");
            }
            timeout = wanted;
        }
    }
}

/// The shortest receive timeout: the kernel's timers are no finer on a loaded machine, and a
/// zero timeout would mean none.
const MIN_RX_WAIT: Duration = Duration::from_micros(20);

/// A run-time setting of the NIC from its file (`softrnic receiver`, `softrnic dasr`):
/// `default` when there is no such file; None (keep the current value) when the file cannot
/// be read or names none of `choices`, which is said once per distinct content.
fn setting<T>(
    path: &Path,
    parse: fn(&str) -> Option<T>,
    default: T,
    choices: &str,
    refused: &mut Option<String>,
) -> Option<T> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Some(default),
        Err(_) => return None,
    };
    let value = parse(&text);
    if value.is_none() && refused.as_deref() != Some(text.as_str()) {
        eprintln!(
            "softrnic engine: {} says {:?}, not {choices}; the setting stays as it is",
            path.display(),
            text.trim()
        );
        *refused = Some(text);
    }
    value
}

fn on_off(text: &str) -> Option<bool> {
    match text.trim() {
        "on" => Some(true),
        "off" => Some(false),
        _ => None,
    }
}

/// The engine's files and log, on a thread of their own: every [`STATS_EVERY`] it takes a
/// snapshot of the counters and of stalled QPs with the NIC's state held, then writes the
/// stats file, reads the port's state and logs with it released. Never the transmitter or
/// the receiver: replacing the stats file frees the old one's blocks, and on a file system
/// mounted with `discard` that waited for the disk — up to 5 s on a busy machine, during
/// which the NIC stood still (drum-kv's READs got no response for 10 s; docs/softrnic.md).
/// `host_dir`: the host's directory, whose files carry the port's state and the run-time
/// settings ([`crate::hosts`]).
pub(super) fn housekeeping(sh: Arc<Shared>, stats: Option<PathBuf>, host_dir: Option<PathBuf>) {
    let mut written = None;
    let mut stalled = std::collections::BTreeMap::new();
    let mut port_checked = Instant::now();
    let (mut refused_policy, mut refused_dasr) = (None, None);
    loop {
        std::thread::sleep(STATS_EVERY.min(PORT_CHECK_EVERY));
        let now = Instant::now();
        let check = now.duration_since(port_checked) >= PORT_CHECK_EVERY;
        let (mut up, mut policy, mut dasr) = (None, None, None);
        if check {
            port_checked = now;
            if let Some(dir) = &host_dir {
                up = std::fs::read_to_string(hosts::port_state_path(dir))
                    .ok()
                    .map(|s| device::port_is_up(&s));
                let (policy_file, dasr_file) =
                    (hosts::receiver_policy_path(dir), hosts::dasr_caps_path(dir));
                let choices = "dcqcn or dart";
                policy = setting(
                    &policy_file,
                    Policy::parse,
                    Policy::Dcqcn,
                    choices,
                    &mut refused_policy,
                );
                dasr = setting(&dasr_file, on_off, false, "on or off", &mut refused_dasr);
            }
        }
        let mut st = sh.lock(Holder::Housekeeping);
        if let Some(up) = up {
            st.set_port(up);
        }
        if let Some(policy) = policy {
            st.dart.receiver = policy;
        }
        if let Some(on) = dasr {
            st.dart.caps = on;
        }
        let snapshot = stats.as_ref().map(|_| {
            let cc = st.dcqcn_counters();
            let auss = st.auss.report(now);
            let procs = st.rx_port.counters.lines()
                + &cc.lines()
                + &st.dart.lines()
                + &auss
                + &st.proc_tx_lines();
            (st.counters, procs)
        });
        let now_stalled = st.no_progress_qps(now);
        let mut log = Vec::new();
        for q in &now_stalled {
            if !stalled.contains_key(q) {
                log.push(format!(
                    "softrnic engine: QP {q} has had work and no progress for {} s: {}",
                    NO_PROGRESS.as_secs(),
                    st.describe_qp(*q, now)
                ));
                stalled.insert(*q, now);
            }
        }
        stalled.retain(|q, since| {
            let still = now_stalled.contains(q);
            if !still {
                log.push(format!(
                    "softrnic engine: QP {q} moves again, {} ms after it was reported: {}",
                    now.saturating_duration_since(*since).as_millis(),
                    st.describe_qp(*q, now)
                ));
            }
            still
        });
        drop(st);
        for line in take_log().into_iter().chain(log) {
            eprintln!("{line}");
        }
        if let (Some(path), Some(snap)) = (stats.as_ref(), snapshot) {
            if written.as_ref() != Some(&snap) {
                write_stats(path, &snap.0, &snap.1);
                written = Some(snap);
            }
        }
    }
}

pub(super) fn tx_loop(sh: Arc<Shared>) {
    let mut st = sh.lock(Holder::Transmitter);
    loop {
        // Read before scanning the rings: a post after this makes the wait below return.
        let seen = sh.db.seq();
        let now = Instant::now();
        st.timers(now);
        let next_held = sh.flush_held(&mut st, now);
        let mut sent = 0usize;
        let mut paced = None;
        // One packet at a time, round robin over the QPs with work, while the NIC model's
        // pipeline clock allows; a bounded burst per wakeup. One clock reading for the whole
        // burst (reading it for each packet took 2 % of the engine's time): within a burst
        // time stands still, so the pipeline clock and the pacers look further ahead than
        // they are — the model may end a burst early, never exceed a rate.
        for _ in 0..TX_BURST {
            if let Some(w) = st.nic.wait(now) {
                paced = Some(w);
                break;
            }
            if st.tx_one(now).is_none() {
                st.nic.idle();
                break;
            }
            sent += 1;
        }
        let built = now.elapsed();
        sh.flush_out(&mut st);
        if built >= SLOW_LOCK {
            log_later(format!(
                "softrnic engine: the transmitter took {} ms to build {sent} packets (reading \
                 applications' memory for them)",
                built.as_millis()
            ));
        }
        if sent == 0 {
            // Until the next held packet, paced QP or AUSS deadline is due, at most a tick.
            let wait = [next_held, st.pace_wake, st.auss.next_deadline()]
                .into_iter()
                .flatten()
                .map(|t| t.saturating_duration_since(now))
                .fold(TICK, Duration::min);
            drop(st);
            match paced {
                // Work is waiting for the NIC model's clock: nothing can go out before then.
                Some(p) => std::thread::sleep(wait.min(p.max(Duration::from_micros(10)))),
                None => sh.db.wait(seen, wait),
            }
            st = sh.lock(Holder::Transmitter);
        } else {
            // Let receivers and verbs in between bursts.
            drop(st);
            std::thread::yield_now();
            st = sh.lock(Holder::Transmitter);
        }
    }
}

/// Send `out` (drained), handing each run of consecutive packets to the same destination
/// whose sizes are equal (the last may be shorter) to the kernel as one `sendmsg` with
/// `UDP_SEGMENT`: the kernel cuts it back into exactly these datagrams (or passes it whole to
/// a receiver with UDP GRO, which splits it at the same boundaries). Returns packets sent.
pub(super) fn send_batched(udp: &UdpSocket, out: &mut Vec<(SocketAddr, Packet)>) -> u64 {
    let mut sent = 0u64;
    let mut i = 0;
    while i < out.len() {
        let (dst, seg) = (out[i].0, out[i].1.wire_len());
        let mut j = i + 1;
        let mut bytes = seg;
        while j < out.len()
            && j - i < GSO_MAX_SEGS
            && out[j].0 == dst
            && out[j].1.wire_len() <= seg
            && bytes + out[j].1.wire_len() <= GSO_MAX_BYTES
            && out[j - 1].1.wire_len() == seg
        {
            bytes += out[j].1.wire_len();
            j += 1;
        }
        if j - i == 1 || !send_gso(udp, dst, seg, &out[i..j]) {
            for (d, p) in &out[i..j] {
                if udp.send_to(&p.encode(), *d).is_ok() {
                    sent += 1;
                }
            }
        } else {
            sent += (j - i) as u64;
        }
        i = j;
    }
    out.clear();
    sent
}

/// One `sendmsg` of `pkts` (all to `dst`) with `UDP_SEGMENT = seg`. false if it failed.
/// Each packet is two iovecs, its header and its payload: the payload is not copied.
pub(super) fn send_gso(
    udp: &UdpSocket,
    dst: SocketAddr,
    seg: usize,
    pkts: &[(SocketAddr, Packet)],
) -> bool {
    let SocketAddr::V4(d) = dst else { return false };
    let headers: Vec<Vec<u8>> = pkts.iter().map(|(_, p)| p.header()).collect();
    let mut iov: Vec<libc::iovec> = headers
        .iter()
        .zip(pkts)
        .flat_map(|(h, (_, p))| [&h[..], &p.payload[..]])
        .map(|b| libc::iovec {
            iov_base: b.as_ptr() as *mut libc::c_void,
            iov_len: b.len(),
        })
        .collect();
    // SAFETY: sockaddr_in and msghdr are plain C data for which all-zero is valid.
    let mut sa: libc::sockaddr_in = unsafe { std::mem::zeroed() };
    sa.sin_family = libc::AF_INET as libc::sa_family_t;
    sa.sin_port = d.port().to_be();
    sa.sin_addr.s_addr = u32::from_ne_bytes(d.ip().octets());
    // SAFETY: CMSG_SPACE is a pure computation.
    let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<u16>() as u32) } as usize;
    let mut cbuf = vec![0u64; space.div_ceil(8)];
    // SAFETY: as above.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_name = &mut sa as *mut _ as *mut libc::c_void;
    msg.msg_namelen = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    msg.msg_iov = iov.as_mut_ptr();
    msg.msg_iovlen = iov.len();
    msg.msg_control = cbuf.as_mut_ptr() as *mut libc::c_void;
    msg.msg_controllen = space;
    // SAFETY: msg points to live buffers (address, iovecs into `headers` and `pkts`, control
    // buffer of `space` bytes); the cmsg macros stay within the control buffer.
    unsafe {
        let c = libc::CMSG_FIRSTHDR(&msg);
        (*c).cmsg_level = SOL_UDP;
        (*c).cmsg_type = UDP_SEGMENT;
        (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<u16>() as u32) as usize;
        std::ptr::write_unaligned(libc::CMSG_DATA(c) as *mut u16, seg as u16);
        libc::sendmsg(udp.as_raw_fd(), &msg, 0) >= 0
    }
}

/// Turn UDP GRO on (the kernel may then deliver several same-size datagrams of a flow as one
/// buffer with their size in a control message). false if the kernel refuses.
pub(super) fn enable_gro(udp: &UdpSocket) -> bool {
    let one: libc::c_int = 1;
    // SAFETY: setsockopt reads sizeof(c_int) bytes from a valid c_int.
    unsafe {
        libc::setsockopt(
            udp.as_raw_fd(),
            SOL_UDP,
            UDP_GRO,
            &one as *const libc::c_int as *const libc::c_void,
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        ) == 0
    }
}

/// Receive one buffer: (bytes, sender, GRO segment size if the kernel coalesced datagrams).
pub(super) fn recv_gro(
    udp: &UdpSocket,
    buf: &mut [u8],
) -> io::Result<(usize, SocketAddr, Option<usize>)> {
    // SAFETY: sockaddr_in and msghdr are plain C data for which all-zero is valid.
    let mut sa: libc::sockaddr_in = unsafe { std::mem::zeroed() };
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr() as *mut libc::c_void,
        iov_len: buf.len(),
    };
    let mut cbuf = [0u64; 8];
    // SAFETY: as above.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_name = &mut sa as *mut _ as *mut libc::c_void;
    msg.msg_namelen = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr() as *mut libc::c_void;
    msg.msg_controllen = std::mem::size_of_val(&cbuf);
    // SAFETY: msg points to live buffers of the sizes given.
    let n = unsafe { libc::recvmsg(udp.as_raw_fd(), &mut msg, 0) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let from = SocketAddr::V4(SocketAddrV4::new(
        Ipv4Addr::from(u32::from_be(sa.sin_addr.s_addr)),
        u16::from_be(sa.sin_port),
    ));
    let mut seg = None;
    // SAFETY: walking the control messages the kernel wrote into cbuf.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == SOL_UDP && (*c).cmsg_type == UDP_GRO {
                let v = std::ptr::read_unaligned(libc::CMSG_DATA(c) as *const libc::c_int);
                if v > 0 {
                    seg = Some(v as usize);
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    Ok((n as usize, from, seg))
}

/// Write the counters atomically (temporary file, then rename).
pub(super) fn write_stats(path: &std::path::Path, c: &Counters, procs: &str) {
    let tmp = path.with_extension("tmp");
    if std::fs::write(&tmp, c.encode() + procs).is_ok() {
        let _ = std::fs::rename(&tmp, path);
    }
}

/// Large socket buffers: a window of full-MTU packets from several QPs must fit.
pub(super) fn set_buffers(udp: &UdpSocket, bytes: libc::c_int) {
    for (force, plain) in [
        (libc::SO_RCVBUFFORCE, libc::SO_RCVBUF),
        (libc::SO_SNDBUFFORCE, libc::SO_SNDBUF),
    ] {
        for opt in [force, plain] {
            // SAFETY: setsockopt reads sizeof(c_int) bytes from a valid c_int.
            let r = unsafe {
                libc::setsockopt(
                    udp.as_raw_fd(),
                    libc::SOL_SOCKET,
                    opt,
                    &bytes as *const libc::c_int as *const libc::c_void,
                    std::mem::size_of::<libc::c_int>() as libc::socklen_t,
                )
            };
            if r == 0 {
                break;
            }
        }
    }
}

pub(super) const SOL_UDP: libc::c_int = 17;

pub(super) const UDP_SEGMENT: libc::c_int = 103;

pub(super) const UDP_GRO: libc::c_int = 104;

/// Most bytes and segments in one GSO send.
pub(super) const GSO_MAX_BYTES: usize = 60_000;

pub(super) const GSO_MAX_SEGS: usize = 64;

/// Packets, staged message data and gathered WRITE data are allocated and freed at the line
/// rate. glibc's defaults gave the freed memory back to the kernel after nearly every message
/// (`madvise`) and took it back page fault by page fault: a quarter of the engine's CPU in a
/// same-host `ib_write_bw`. A working set of a few MiB stays mapped instead.
fn keep_freed_memory() {
    // SAFETY: mallopt takes integer parameters and only tunes the allocator.
    unsafe {
        libc::mallopt(libc::M_TRIM_THRESHOLD, 64 << 20);
        libc::mallopt(libc::M_MMAP_THRESHOLD, 4 << 20);
    }
}

/// Now, as an `Instant` and as `CLOCK_MONOTONIC` ns, read back to back (AUSS's time base).
pub(super) fn clock_pair() -> (Instant, u64) {
    (Instant::now(), drum_table::nic_auss::monotonic_ns())
}

/// This start's incarnation: the wall clock in nanoseconds, never 0.
pub(super) fn incarnation() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| d.as_nanos() as u64)
        .max(1)
}

/// Run the engine until killed.
pub fn run(cfg: EngineConfig) -> anyhow::Result<()> {
    // The transmitter sleeps for the NIC model's clock (a packet's wire time, tens of µs):
    // Linux's default 50 µs timer slack would add up to that to every such wait, and a
    // waiting packet of another QP would pay it — no NIC pipeline has it. Inherited by the
    // engine's threads.
    // SAFETY: prctl with integer arguments only.
    unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1u64, 0, 0, 0) };
    keep_freed_memory();
    let udp = UdpSocket::bind((cfg.ip, cfg.udp_port))
        .with_context(|| format!("binding UDP {}:{}", cfg.ip, cfg.udp_port))?;
    set_buffers(&udp, 16 << 20);
    let started = Instant::now();
    let mut state = State::with_nic(cfg.nic, started);
    state.fabric.me = cfg.ip;
    state.fabric.peers = cfg.peers.clone();
    if cfg.nic.auss_expiry().is_some() {
        let table = cfg.socket.with_file_name("auss");
        state.auss = super::auss::NicAuss::on(&cfg.nic, &table, clock_pair(), incarnation())
            .with_context(|| format!("creating the AUSS table {}", table.display()))?;
    }
    if !cfg.faults.is_none() {
        state.fabric.inject = Some(fabric::Injection {
            cfg: cfg.faults.clone(),
            host: cfg.host.clone(),
            links: HashMap::new(),
            held: Default::default(),
        });
    }
    if let Some(p) = &cfg.stats {
        let procs = state.proc_tx_lines();
        write_stats(p, &state.counters, &procs);
    }
    let db_path = cfg.socket.with_file_name("doorbell");
    let db = Doorbell::open(&db_path, true)
        .with_context(|| format!("creating the doorbell {}", db_path.display()))?;
    let gso = cfg.gso && enable_gro(&udp);
    let me = udp.local_addr()?;
    let sh = Arc::new(Shared {
        st: Mutex::new(state),
        db,
        gso,
        udp,
        me,
        holder: AtomicU8::new(0),
    });
    {
        let sh = sh.clone();
        std::thread::Builder::new()
            .name("rx".into())
            .spawn(move || rx_loop(sh))?;
    }
    {
        let sh = sh.clone();
        std::thread::Builder::new()
            .name("tx".into())
            .spawn(move || tx_loop(sh))?;
    }
    {
        let sh = sh.clone();
        let stats = cfg.stats.clone();
        let host_dir = cfg.host_dir.clone();
        std::thread::Builder::new()
            .name("housekeeping".into())
            .spawn(move || housekeeping(sh, stats, host_dir))?;
    }
    eprintln!(
        "softrnic engine for {} on {}:{} ({})",
        cfg.host,
        cfg.ip,
        cfg.udp_port,
        cfg.socket.display()
    );
    eprint!("NIC model: {}", cfg.nic.encode());
    eprintln!(
        "host transport: UDP GSO/GRO {}",
        if gso { "on" } else { "off" }
    );
    if !cfg.faults.is_none() {
        eprint!("fault injection (egress):\n{}", cfg.faults.encode());
    }
    // The socket appears last: `up` takes it as the sign that the engine is ready, so the
    // doorbell and the log's settings lines must exist by then (a test read an empty log).
    let _ = std::fs::remove_file(&cfg.socket);
    let listener = UnixListener::bind(&cfg.socket)
        .with_context(|| format!("binding {}", cfg.socket.display()))?;
    // Programs of every user may use the NIC (the engine knows each connection's process by
    // SO_PEERCRED and touches only that process's memory).
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&cfg.socket, std::fs::Permissions::from_mode(0o666))?;
    }
    let mut next_conn = 1u64;
    for s in listener.incoming() {
        match s {
            Ok(s) => {
                let sh = sh.clone();
                let conn = next_conn;
                next_conn += 1;
                std::thread::Builder::new()
                    .name(format!("conn{conn}"))
                    .spawn(move || serve_conn(sh, s, conn))?;
            }
            Err(e) => eprintln!("softrnic engine: accept: {e}"),
        }
    }
    Ok(())
}

/// The I/O around the state: the doorbell, the local loop, and the socket and fault
/// injection that packets leave by. These read the clock; the state only gets `now`.
impl Shared {
    fn kick(&self) {
        self.db.ring();
    }

    /// Packets between QPs of this host go straight to its own receive path, as a NIC loops
    /// traffic between its own QPs back inside without putting it on the wire: no socket, no
    /// wake-up of the receive thread. Their answers (ACKs, READ responses) may be local too,
    /// hence the loop. Each still is a packet to the NIC model, the transport and the counters.
    /// (With fault injection configured they take the socket, to meet their fate.)
    fn loop_back(&self, st: &mut State, now: Instant) {
        if st.loop_back(self.me, now) {
            self.kick();
        }
    }

    fn flush_out(&self, st: &mut State) {
        let st = &mut *st;
        if !st.fabric.up {
            // No link: what the NIC sends goes nowhere.
            st.counters.port_down_dropped += st.fabric.out.len() as u64;
            st.fabric.out.clear();
            return;
        }
        let Some(inj) = st.fabric.inject.as_mut() else {
            self.loop_back(st, Instant::now());
            if self.gso {
                let (start, n) = (Instant::now(), st.fabric.out.len());
                st.counters.tx_packets += send_batched(&self.udp, &mut st.fabric.out);
                let took = start.elapsed();
                if took >= SLOW_LOCK {
                    log_later(format!(
                        "softrnic engine: handing {n} packets to the kernel took {} ms",
                        took.as_millis()
                    ));
                }
                return;
            }
            for (dst, p) in st.fabric.out.drain(..) {
                if self.udp.send_to(&p.encode(), dst).is_ok() {
                    st.counters.tx_packets += 1;
                }
            }
            return;
        };
        let now = Instant::now();
        let c = &mut st.counters;
        for (dst, p) in st.fabric.out.drain(..) {
            let link = inj.links.entry(dst).or_insert_with(|| {
                let ip = match dst {
                    SocketAddr::V4(a) => *a.ip(),
                    SocketAddr::V6(_) => Ipv4Addr::UNSPECIFIED,
                };
                LinkInjector::new(&inj.cfg, &inj.host, ip)
            });
            let fate = link.fate();
            c.fault_dropped += fate.dropped as u64;
            c.fault_duplicated += fate.duplicated as u64;
            c.fault_reordered += fate.reordered as u64;
            for d in fate.sends {
                if d.is_zero() {
                    if self.udp.send_to(&p.encode(), dst).is_ok() {
                        c.tx_packets += 1;
                    }
                } else {
                    c.fault_delayed += 1;
                    inj.held.push(now + d, (dst, p.clone()));
                }
            }
        }
        self.flush_held(st, now);
    }

    /// Send the held packets that are due; returns when the next one is due.
    fn flush_held(&self, st: &mut State, now: Instant) -> Option<Instant> {
        let inj = st.fabric.inject.as_mut()?;
        while let Some((dst, packet)) = inj.held.pop_due(now) {
            if !st.fabric.up {
                st.counters.port_down_dropped += 1;
            } else if self.udp.send_to(&packet.encode(), dst).is_ok() {
                st.counters.tx_packets += 1;
            }
        }
        inj.held.next_due()
    }
}
