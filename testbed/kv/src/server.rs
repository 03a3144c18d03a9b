//! The server: accepts connections through the RDMA CM, lets clients READ its slots, and
//! answers GET/PUT RPCs from poller threads. A client that misbehaves gets an error reply,
//! or its connection closed when its QP breaks; every other client is served on.

use crate::cm::{self, Endpoint, Listener, QueueSizes};
use crate::interrupt;
use crate::metrics::Metrics;
use crate::proto::{self, Hello, Limits, Op, ProtoError, Reply, Request, Status, Welcome};
use crate::slot::HEADER;
use crate::store::Store;
use crate::verbs::{self, Mr, Pd, SendWr};
use crate::wake::Wake;
use rdma_sys::{ibv_context, ibv_wc_opcode, ibv_wc_status, rdma_cm_event_type};
use std::collections::{HashMap, VecDeque};
use std::net::SocketAddrV4;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

#[derive(Debug, Clone)]
pub struct Config {
    pub listen: SocketAddrV4,
    pub keys: u64,
    pub max_value: u32,
    pub seed: u64,
    /// The most connections a client may multiplex on one QP.
    pub share: u16,
    pub pollers: usize,
    /// Where to write the metrics at exit (JSON).
    pub stats_json: Option<std::path::PathBuf>,
    /// How often to print the metrics as a JSON line on stdout.
    pub stats_interval: Option<Duration>,
}

/// Requests buffered per QP at most (`share × window`), and the buffer memory of one
/// connection: bound what one client can make the server allocate.
const MAX_QUEUE: u32 = 4096;
const MAX_CONN_BUFFER: usize = 512 << 20;

/// A connection's receive and reply buffers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Sizes {
    /// Receive buffers: one per request the client may have outstanding.
    recvs: usize,
    recv_size: usize,
    reply_size: usize,
}

impl Sizes {
    fn of(hello: &Hello) -> Sizes {
        Sizes {
            recvs: hello.window as usize * hello.share as usize,
            recv_size: proto::request_room(hello.max_size),
            reply_size: proto::reply_room(hello.max_size),
        }
    }

    /// Twice as many reply buffers as requests: a reply's buffer is free again only when its
    /// SEND completes, which may be after the client's next request arrives.
    fn replies(&self) -> usize {
        2 * self.recvs
    }

    fn buffer(&self) -> usize {
        self.recvs * self.recv_size + self.replies() * self.reply_size
    }
}

/// The store registered in one device context's protection domain.
struct Registration {
    pd: Arc<Pd>,
    mr: Mr,
}

pub fn run(cfg: Config) -> anyhow::Result<()> {
    let store = Arc::new(Store::new(cfg.keys, cfg.max_value, cfg.seed)?);
    let listener = Listener::bind(cfg.listen)?;
    interrupt::install();
    println!(
        "drum-kv server listening on {}:{} keys={} max_value={} seed={} share={}",
        cfg.listen.ip(),
        listener.port(),
        cfg.keys,
        cfg.max_value,
        cfg.seed,
        cfg.share
    );
    let started = Instant::now();
    let metrics = Arc::new(Metrics::default());
    let mut next_report = cfg.stats_interval.map(|i| started + i);
    let mut pollers = Vec::new();
    for i in 0..cfg.pollers.max(1) {
        let (tx, rx) = mpsc::channel::<Arc<Conn>>();
        let wake = Arc::new(Wake::new()?);
        let (store, metrics, w) = (store.clone(), metrics.clone(), wake.clone());
        std::thread::Builder::new()
            .name(format!("poller{i}"))
            .spawn(move || poll_loop(rx, &w, &store, &metrics))?;
        pollers.push((tx, wake));
    }
    let mut regs: HashMap<usize, Registration> = HashMap::new();
    let mut conns: HashMap<usize, Arc<Conn>> = HashMap::new();
    let mut next_poller = 0;
    while !interrupt::requested() {
        if let Some(at) = next_report.filter(|&at| Instant::now() >= at) {
            let line = serde_json::to_string(&metrics.snapshot(started.elapsed().as_secs_f64()))?;
            println!("{line}");
            // (a loop that fell behind a short interval skips the lines it missed)
            next_report = cfg.stats_interval.map(|i| (at + i).max(Instant::now()));
        }
        if !readable(listener.channel.fd(), 200) {
            continue;
        }
        let ev = listener.channel.next()?;
        let id = ev.id();
        match ev.kind() {
            rdma_cm_event_type::RDMA_CM_EVENT_CONNECT_REQUEST => {
                let hello = Hello::decode(&ev.private_data());
                // The request's id may be accepted or rejected only after its event is
                // acknowledged (destroying it waits for that).
                drop(ev);
                match admit(&cfg, hello, cm::context_of(id), &mut regs, &store) {
                    Err(why) => {
                        metrics.rejected();
                        eprintln!("drum-kv server: refused a connection: {why}");
                        cm::reject(id, &why);
                    }
                    Ok((hello, reg)) => match Conn::accept(id, hello, reg, &store) {
                        Ok(conn) => {
                            metrics.accepted();
                            let conn = Arc::new(conn);
                            conns.insert(id as usize, conn.clone());
                            let (tx, wake) = &pollers[next_poller % pollers.len()];
                            tx.send(conn)?;
                            wake.ring();
                            next_poller += 1;
                        }
                        Err(e) => {
                            metrics.rejected();
                            eprintln!("drum-kv server: accept failed: {e:#}")
                        }
                    },
                }
            }
            rdma_cm_event_type::RDMA_CM_EVENT_DISCONNECTED
            | rdma_cm_event_type::RDMA_CM_EVENT_CONNECT_ERROR
            | rdma_cm_event_type::RDMA_CM_EVENT_UNREACHABLE
            | rdma_cm_event_type::RDMA_CM_EVENT_REJECTED => {
                drop(ev);
                if let Some(c) = conns.remove(&(id as usize)) {
                    metrics.disconnected();
                    // Its poller destroys it: every event of the id is acknowledged now.
                    c.gone.store(true, Ordering::Release);
                }
            }
            _ => drop(ev),
        }
    }
    let m = metrics.snapshot(started.elapsed().as_secs_f64());
    eprintln!(
        "drum-kv server: accepted={} rejected={} gets={} puts={} error_replies={} broken={}",
        m.connections.accepted,
        m.connections.rejected,
        m.gets,
        m.puts,
        m.errors,
        m.connections.broken,
    );
    if let Some(f) = &cfg.stats_json {
        std::fs::write(f, serde_json::to_string_pretty(&m)? + "\n")
            .map_err(|e| anyhow::anyhow!("--stats-json {}: {e}", f.display()))?;
    }
    // Exit without tearing down connections clients still hold (their pollers may be
    // mid-call); the process's exit releases everything, and atexit handlers still run.
    std::process::exit(0)
}

fn readable(fd: i32, timeout_ms: i32) -> bool {
    let mut p = libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    };
    // SAFETY: one valid pollfd.
    unsafe { libc::poll(&mut p, 1, timeout_ms) > 0 }
}

/// Checks a connection request; registers the store in its device's PD the first time.
fn admit<'a>(
    cfg: &Config,
    hello: Result<Hello, proto::ProtoError>,
    ctx: *mut ibv_context,
    regs: &'a mut HashMap<usize, Registration>,
    store: &Store,
) -> Result<(Hello, &'a Registration), String> {
    let hello = hello.map_err(|e| e.to_string())?;
    if hello.share == 0 || hello.share > cfg.share {
        return Err(format!(
            "share {} (this server allows 1..={})",
            hello.share, cfg.share
        ));
    }
    if hello.window == 0 || hello.window as u64 * hello.share as u64 > MAX_QUEUE as u64 {
        return Err(format!(
            "window {} × share {} > {MAX_QUEUE}",
            hello.window, hello.share
        ));
    }
    if hello.max_size > cfg.max_value {
        return Err(format!(
            "size {} > max value {}",
            hello.max_size, cfg.max_value
        ));
    }
    let bytes = Sizes::of(&hello).buffer();
    if bytes > MAX_CONN_BUFFER {
        return Err(format!(
            "window × share × size needs {bytes} bytes of buffers (at most {MAX_CONN_BUFFER})"
        ));
    }
    if let std::collections::hash_map::Entry::Vacant(e) = regs.entry(ctx as usize) {
        let pd = Pd::new(ctx).map_err(|e| e.to_string())?;
        // SAFETY: the store lives until the process exits.
        let mr = unsafe { Mr::register(&pd, store.buffer(), true) }.map_err(|e| e.to_string())?;
        e.insert(Registration { pd, mr });
    }
    Ok((hello, &regs[&(ctx as usize)]))
}

/// wr_id of a reply SEND (a RECV's wr_id is its buffer's index).
const SEND_BIT: u64 = 1 << 32;

/// One client QP: its receive buffers (one request each) and reply buffers.
struct Conn {
    ep: Endpoint,
    /// Set by the CM thread once the id's last event is acknowledged.
    gone: AtomicBool,
    sizes: Sizes,
    limits: Limits,
}

impl Conn {
    fn accept(
        id: *mut rdma_sys::rdma_cm_id,
        hello: Hello,
        reg: &Registration,
        store: &Store,
    ) -> anyhow::Result<Conn> {
        let sizes = Sizes::of(&hello);
        let Sizes {
            recvs, recv_size, ..
        } = sizes;
        let q = QueueSizes {
            send: sizes.replies(),
            recv: recvs,
            buffer: sizes.buffer(),
            events: true,
        };
        let welcome = Welcome {
            rkey: reg.mr.rkey(),
            addr: reg.mr.addr(0),
            keys: store.keys,
            max_value: store.max_value,
            seed: store.seed,
        }
        .encode();
        let limits = Limits {
            keys: store.keys,
            max_value: hello.max_size,
        };
        let ep = cm::accept(id, &reg.pd, q, &welcome, |ep| {
            let lkey = ep.mr.lkey();
            let bufs: Vec<_> = (0..recvs)
                .map(|i| (i as u64, ep.mr.addr(i * recv_size), recv_size as u32))
                .collect();
            verbs::post_recv(ep.qp(), lkey, &bufs)
        })?;
        Ok(Conn {
            ep,
            gone: AtomicBool::new(false),
            sizes,
            limits,
        })
    }

    fn reply_off(&self, i: usize) -> usize {
        self.sizes.recvs * self.sizes.recv_size + i * self.sizes.reply_size
    }
}

/// A poller's state of one connection.
struct Served {
    conn: Arc<Conn>,
    free_replies: Vec<usize>,
    /// Received messages (recv index, length) waiting for a free reply buffer.
    waiting: VecDeque<(usize, usize)>,
    /// Requests of the first waiting message already answered (a batch may run out of reply
    /// buffers part way).
    answered: usize,
    broken: bool,
}

fn poll_loop(rx: mpsc::Receiver<Arc<Conn>>, wake: &Wake, store: &Store, metrics: &Metrics) {
    let mut served: Vec<Served> = Vec::new();
    let mut wcs = verbs::blank_wcs(32);
    let mut idle_passes = 0;
    let mut armed = false;
    loop {
        loop {
            match rx.try_recv() {
                Ok(conn) => {
                    served.push(Served {
                        free_replies: (0..conn.sizes.replies()).rev().collect(),
                        conn,
                        waiting: VecDeque::new(),
                        answered: 0,
                        broken: false,
                    });
                    // its CQ is not armed: poll before sleeping again
                    (idle_passes, armed) = (0, false);
                }
                Err(mpsc::TryRecvError::Empty) => break,
                Err(mpsc::TryRecvError::Disconnected) => return,
            }
        }
        // A connection whose id has had its last event is destroyed here, by its poller.
        served.retain(|s| !s.conn.gone.load(Ordering::Acquire));
        let mut idle = true;
        for s in served.iter_mut() {
            match serve(s, store, metrics, &mut wcs) {
                Ok(n) => idle &= n == 0,
                Err(e) => {
                    if !s.broken {
                        eprintln!("drum-kv server: closing a connection: {e:#}");
                        metrics.broken();
                        s.broken = true;
                        s.conn.ep.disconnect();
                    }
                }
            }
        }
        if !idle {
            idle_passes = 0;
            armed = false;
        } else if idle_passes < SPIN_PASSES {
            // Nothing to do: yield the core (the machine may have fewer cores than busy
            // threads) without sleeping on the latency path.
            idle_passes += 1;
            std::thread::yield_now();
        } else if !armed {
            // Idle for a while (a READ-only load needs no server thread at all): ask for
            // completion events; the next pass still polls, so a completion that came before
            // the arming is not waited for.
            armed = served
                .iter()
                .filter(|s| !s.broken)
                .all(|s| s.conn.ep.cq.arm().is_ok());
        } else {
            wait_for_events(&served, wake);
            armed = false;
        }
    }
}

/// Idle passes over the connections before the poller sleeps on completion events.
const SPIN_PASSES: u32 = 200;

/// Waits for a completion event on any armed CQ, or for a new connection (`wake`); at most
/// 5 ms, the pace at which closed connections are noticed when nothing else happens. Frees
/// the cores for the NICs' engines and the clients while the server has nothing to do.
fn wait_for_events(served: &[Served], wake: &Wake) {
    let live = || served.iter().filter(|s| !s.broken);
    let mut fds: Vec<libc::pollfd> = live()
        .map(|s| s.conn.ep.cq.fd())
        .chain([wake.fd()])
        .map(|fd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    // SAFETY: valid pollfds.
    unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as u64, 5) };
    wake.clear();
    for s in live() {
        s.conn.ep.cq.take_event();
    }
}

/// Polls one connection's CQ and answers what arrived; returns the completions handled.
fn serve(
    s: &mut Served,
    store: &Store,
    metrics: &Metrics,
    wcs: &mut [rdma_sys::ibv_wc],
) -> anyhow::Result<usize> {
    let n = s.conn.ep.cq.poll(wcs)?;
    if s.broken {
        return Ok(n);
    }
    for wc in &wcs[..n] {
        if wc.status != ibv_wc_status::IBV_WC_SUCCESS {
            anyhow::bail!(
                "{} on {}",
                verbs::wc_status(wc.status),
                if wc.opcode & ibv_wc_opcode::IBV_WC_RECV != 0 {
                    "a request"
                } else {
                    "a reply"
                }
            );
        }
        if wc.wr_id & SEND_BIT != 0 {
            s.free_replies.push((wc.wr_id & !SEND_BIT) as usize);
        } else {
            s.waiting
                .push_back((wc.wr_id as usize, wc.byte_len as usize));
        }
    }
    let conn = &s.conn;
    let Sizes {
        recv_size,
        reply_size,
        ..
    } = conn.sizes;
    let mut reposts = Vec::new();
    let mut replies = Vec::new();
    // The requests found in this poll are answered in batches: consecutive replies to one
    // client connection share a reply buffer (and so one SEND) while the SEND stays inline
    // (a batch that the NIC must fetch from memory cost more than the messages it saved).
    let batch_room = conn.ep.max_inline().min(reply_size);
    let mut batch: Option<Batch> = None;
    'messages: while let Some(&(ri, len)) = s.waiting.front() {
        let roff = ri * recv_size;
        // SAFETY: the RECV completed, so the NIC is done with this buffer until it is
        // reposted.
        let msg = unsafe { conn.ep.mr.buffer().slice(roff, len.min(recv_size)) };
        for range in proto::request_ranges(msg, conn.limits).skip(s.answered) {
            let req = &msg[range];
            let parsed = proto::parse_request(req, conn.limits);
            let (to, need) = (reply_to(req, &parsed), reply_len(&parsed));
            if !batch.is_some_and(|b| b.conn == to && b.used + need <= batch_room) {
                let Some(buf) = s.free_replies.pop() else {
                    break 'messages;
                };
                let fresh = Batch {
                    buf,
                    conn: to,
                    used: 0,
                };
                if let Some(full) = batch.replace(fresh) {
                    replies.push(full.send(conn));
                }
            }
            let b = batch.as_mut().expect("a batch is open");
            // SAFETY: the reply buffer is free (its SEND completed) and this batch's alone;
            // `used + need` fits in it.
            let out = unsafe {
                conn.ep
                    .mr
                    .buffer()
                    .slice_mut(conn.reply_off(b.buf) + b.used, need)
            };
            answer(req, parsed, out, store, metrics);
            b.used += need;
            metrics.request(req.len());
            metrics.reply(need);
            s.answered += 1;
        }
        metrics.request_message();
        s.answered = 0;
        s.waiting.pop_front();
        reposts.push((ri as u64, conn.ep.mr.addr(roff), recv_size as u32));
    }
    replies.extend(batch.map(|b| b.send(conn)));
    metrics.reply_messages(replies.len());
    // The buffer goes back before the reply: the client's next request may follow the reply
    // at once.
    verbs::post_recv(conn.ep.qp(), conn.ep.mr.lkey(), &reposts)?;
    conn.ep.post_send(&replies)?;
    Ok(n)
}

/// Replies being gathered in one reply buffer.
#[derive(Clone, Copy)]
struct Batch {
    buf: usize,
    /// The client connection they all answer.
    conn: u32,
    used: usize,
}

impl Batch {
    fn send(self, conn: &Conn) -> SendWr {
        SendWr {
            wr_id: SEND_BIT | self.buf as u64,
            addr: conn.ep.mr.addr(conn.reply_off(self.buf)),
            len: self.used as u32,
            lkey: conn.ep.mr.lkey(),
            read_from: None,
        }
    }
}

/// The client connection a request's reply goes to (named in the request, or in whatever
/// part of it arrived).
fn reply_to(req: &[u8], parsed: &Result<Request, ProtoError>) -> u32 {
    match parsed {
        Ok(r) => r.conn,
        Err(_) => proto::reply_address(req).0,
    }
}

/// Bytes of the reply to a request.
fn reply_len(parsed: &Result<Request, ProtoError>) -> usize {
    match parsed {
        Ok(r) if r.op == Op::Get => proto::REPLY_HEADER + HEADER + r.size as usize,
        _ => proto::REPLY_HEADER,
    }
}

/// Serves one request into `out` (its reply's [`reply_len`] bytes).
fn answer(
    req: &[u8],
    parsed: Result<Request, ProtoError>,
    out: &mut [u8],
    store: &Store,
    m: &Metrics,
) {
    let payload = (out.len() - proto::REPLY_HEADER) as u32;
    match parsed {
        Ok(r) => {
            Reply {
                status: Status::Ok,
                op: r.op as u8,
                conn: r.conn,
                req: r.req,
                len: payload,
            }
            .encode(out);
            match r.op {
                Op::Get => {
                    m.get(r.size);
                    store.get_into(r.key, &mut out[proto::REPLY_HEADER..]);
                }
                Op::Put => {
                    m.put(r.size);
                    store.put(r.key, r.tag, &req[proto::REQUEST_HEADER..]);
                }
            }
        }
        Err(e) => {
            m.refused(e.status());
            let (conn, req_id) = proto::reply_address(req);
            Reply {
                status: e.status(),
                op: req.first().copied().unwrap_or(0),
                conn,
                req: req_id,
                len: payload,
            }
            .encode(out);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connection_buffers_are_sized_from_the_hello_and_bounded() {
        let hello = Hello {
            share: 5,
            window: 16,
            max_size: 1 << 20,
        };
        let s = Sizes::of(&hello);
        assert_eq!((s.recvs, s.replies()), (80, 160));
        assert_eq!(
            s.buffer(),
            80 * (40 + (1 << 20)) + 160 * (24 + 24 + (1 << 20))
        );
        assert!(s.buffer() <= MAX_CONN_BUFFER);
        let greedy = Hello {
            window: 64,
            ..hello
        };
        assert!(Sizes::of(&greedy).buffer() > MAX_CONN_BUFFER);
    }
}
