//! The load generator: `conns` connections over `threads` threads, each keeping up to
//! `window` operations in flight and posting them in batches of `wr_num` (the paper's "post
//! a batch, poll one completion, post again"). In RAW mode every connection has its own QP;
//! in SHARE mode `share` connections, on different threads, post to and poll one QP behind a
//! lock, and completions reach their connection through a mailbox (by `wr_id`, or by the
//! connection id in a reply's payload). Every value read is checked.

use crate::batch;
use crate::coalesce;
use crate::dist::{KeyDist, KeySpec, OpKind, OpMix, Rng, SizeDist, WrNum};
use crate::in_flight::Interval;
use crate::interrupt;
use crate::proto::{self, Op, Reply, Request, Status};
use crate::schedule::Schedule;
use crate::shared_qp::{Done, SharedQp};
use crate::slot::{self, Retry, Verdict, HEADER};
use crate::stats::{self, ConnThroughput, Recorder, RunInfo, Summary};
use crate::verbs::{self, SendWr};
use crate::wake::Wake;
use crate::wrid::{self, WrId, WrKind};
use std::net::SocketAddrV4;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

#[derive(Debug, Clone)]
pub struct Config {
    pub server: SocketAddrV4,
    pub conns: u32,
    pub threads: u32,
    pub op: OpMix,
    pub size: SizeDist,
    pub keys: KeySpec,
    pub wr_num: WrNum,
    pub window: u32,
    pub duration: Option<Duration>,
    pub ops: Option<u64>,
    pub bytes: Option<u64>,
    pub warmup: Duration,
    pub seed: u64,
    pub events: bool,
    pub share: u16,
    /// Fill the window at every pass and send the RPC requests posted together several to a
    /// SEND (`coalesce.rs`).
    pub coalesce: bool,
    /// Batches at set times instead of whenever the window has room.
    pub schedule: Option<Schedule>,
    /// How long operations in flight when the run stops get to complete; the rest are
    /// abandoned with their QPs.
    pub drain: Duration,
}

/// When the run ends; shared by every connection.
struct Clock {
    deadline: Option<Instant>,
    warmup_end: Instant,
    stopped: AtomicBool,
    /// When the first connection saw the run over.
    stopped_at: OnceLock<Instant>,
    drain: Duration,
}

impl Clock {
    /// False once the run is over.
    fn running(&self, now: Instant) -> bool {
        if self.stopped.load(Ordering::Relaxed) {
            return false;
        }
        if self.deadline.is_some_and(|d| now >= d) || interrupt::requested() {
            self.stopped_at.get_or_init(|| now);
            self.stopped.store(true, Ordering::Relaxed);
            return false;
        }
        true
    }

    /// The interval measured: from the warm-up's end until the run stopped (or is due to).
    fn measured(&self) -> Interval {
        let stopped = self.stopped_at.get().copied();
        Interval {
            from: self.warmup_end,
            until: match (self.deadline, stopped) {
                (Some(d), Some(s)) => Some(d.min(s)),
                (d, s) => d.or(s),
            },
        }
    }

    /// Whether operations still in flight at `now` are given up: the run stopped more than
    /// the drain time ago. Waiting for all of them is what perftest's duration mode does not
    /// do either: 99 connections with 128 READs each in flight on a thrashing NIC took 25 s
    /// to drain, four times the run they belonged to.
    fn abandons(&self, now: Instant) -> bool {
        self.stopped_at
            .get()
            .is_some_and(|&t| now.saturating_duration_since(t) >= self.drain)
    }
}

/// One connection's part of `--ops` / `--bytes`. Each connection gets its own equal part
/// (as perftest gives each QP its iterations): with one budget for all, a thread the
/// scheduler kept off the CPU found the budget spent by the others and its connections did
/// nothing, and the workload's sizes, keys and operations depended on the race.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Quota {
    ops: Option<u64>,
    bytes: Option<u64>,
}

impl Quota {
    /// Connection `i`'s part of the totals over `n` connections: the first `total mod n`
    /// connections take one more.
    fn part(cfg_ops: Option<u64>, cfg_bytes: Option<u64>, n: u32, i: u32) -> Quota {
        let part = |total: u64| total / n as u64 + u64::from((i as u64) < total % n as u64);
        Quota {
            ops: cfg_ops.map(part),
            bytes: cfg_bytes.map(part),
        }
    }

    fn spent(&self) -> bool {
        self.ops == Some(0) || self.bytes == Some(0)
    }

    /// Takes one operation of `size` bytes; the last may overshoot the byte part (it is
    /// taken while any is left).
    fn take(&mut self, size: u64) -> bool {
        if self.spent() {
            return false;
        }
        self.ops = self.ops.map(|o| o - 1);
        self.bytes = self.bytes.map(|b| b.saturating_sub(size));
        true
    }
}

/// An operation in flight.
#[derive(Debug, Clone)]
struct InFlight {
    kind: OpKind,
    key: u64,
    size: u32,
    start: Instant,
    seq: u32,
    batch: usize,
    retry: Retry,
    send_done: bool,
    reply_done: bool,
}

/// A batch in flight: when it was posted and how many of its operations are left.
struct Batch {
    start: Instant,
    ops: usize,
    left: usize,
}

/// One connection, driven by one thread.
struct Conn {
    qp: Arc<SharedQp>,
    /// Index on the QP.
    idx: usize,
    id: u32,
    slots: Vec<Option<InFlight>>,
    free: Vec<u32>,
    seqs: Vec<u32>,
    reissue: Vec<u32>,
    reposts: Vec<u32>,
    /// By the slot whose SEND carries them: the other slots whose requests it carries.
    coalesced: Vec<Vec<u32>>,
    /// The bytes of this pass's coalesced SENDs, alive until they are posted (inline, so
    /// the provider copies them then).
    outgoing: Vec<Vec<u8>>,
    batches: Vec<Option<Batch>>,
    next_batch: Option<usize>,
    rng: Rng,
    quota: Quota,
    /// With a schedule: batches posted so far, and when the next one is due.
    scheduled: u64,
    next_due: Option<Instant>,
    ops: u64,
    bytes: u64,
    finished: bool,
}

pub fn run(cfg: Config) -> anyhow::Result<Summary> {
    anyhow::ensure!(
        cfg.conns > 0 && cfg.threads > 0,
        "--conns and --threads must be at least 1"
    );
    anyhow::ensure!(cfg.share > 0, "--share must be at least 1");
    let max_size = u32::try_from(cfg.size.max()).map_err(|_| anyhow::anyhow!("size too large"))?;
    let window = cfg.window.max(1) as usize;
    let share = cfg.share as usize;
    let uses_rpc = cfg.op.uses_rpc();
    // Connect every QP.
    let mut qps = Vec::new();
    let mut first = 0u32;
    while first < cfg.conns {
        let n = (cfg.conns - first).min(cfg.share as u32) as usize;
        let qp = SharedQp::connect(cfg.server, cfg.events, first, n, window, max_size, uses_rpc)?;
        qps.push(Arc::new(qp));
        first += n as u32;
    }
    let welcome = qps[0].welcome;
    anyhow::ensure!(
        max_size <= welcome.max_value,
        "size {max_size} > the server's max value {}",
        welcome.max_value
    );
    let keys = Arc::new(KeyDist::new(cfg.keys, welcome.keys));
    if let Some(s) = cfg.schedule {
        anyhow::ensure!(
            unix_ns() < s.start_unix_ns,
            "connected after --start-unix-ms: the first scheduled batch is missed"
        );
    }
    // Connected: from here on a signal ends the run with its summary instead of killing it.
    interrupt::install();
    let start = Instant::now();
    let warmup_end = start + cfg.warmup;
    let clock = Arc::new(Clock {
        deadline: cfg.duration.and_then(|d| warmup_end.checked_add(d)),
        warmup_end,
        stopped: AtomicBool::new(false),
        stopped_at: OnceLock::new(),
        drain: cfg.drain,
    });
    // Connection c runs on thread c % threads, so the connections of a shared QP (c / share)
    // land on different threads and really contend for its lock.
    let mut per_thread: Vec<Vec<(Arc<SharedQp>, usize, u32)>> =
        vec![Vec::new(); cfg.threads as usize];
    for c in 0..cfg.conns {
        let qp = qps[c as usize / share].clone();
        per_thread[(c % cfg.threads) as usize].push((qp, c as usize % share, c));
    }
    let handles: Vec<_> = per_thread
        .into_iter()
        .enumerate()
        .filter(|(_, conns)| !conns.is_empty())
        .map(|(t, conns)| {
            let (cfg, keys, clock) = (cfg.clone(), keys.clone(), clock.clone());
            std::thread::Builder::new()
                .name(format!("client{t}"))
                .spawn(move || worker(&cfg, conns, &keys, &clock))
        })
        .collect::<Result<_, _>>()?;
    let mut rec = Recorder::default();
    let mut per_conn = Vec::new();
    for h in handles {
        let (r, conns) = h
            .join()
            .map_err(|_| anyhow::anyhow!("a client thread panicked"))??;
        rec.merge(&r);
        per_conn.extend(conns);
    }
    let measured = Instant::now()
        .saturating_duration_since(warmup_end)
        .as_secs_f64();
    for c in per_conn.iter_mut() {
        c.ops_per_s = c.ops as f64 / measured.max(1e-9);
        c.mib_per_s = c.bytes as f64 / (1 << 20) as f64 / measured.max(1e-9);
    }
    per_conn.sort_by_key(|c| c.conn);
    for qp in &qps {
        qp.ep.disconnect();
    }
    let info = RunInfo {
        mode: if cfg.share > 1 { "share" } else { "raw" }.into(),
        op: format!("{:?}", cfg.op).to_lowercase(),
        conns: cfg.conns,
        threads: cfg.threads,
        share: cfg.share as u32,
        coalesce: cfg.coalesce,
    };
    Ok(stats::summarize(info, &rec, per_conn, measured))
}

/// The wall clock, in ns since the Unix epoch (schedules are on it).
fn unix_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

/// How long a thread waits for any completion before it calls the run stalled.
const STALL: Duration = Duration::from_secs(10);

type ThreadResult = anyhow::Result<(Recorder, Vec<ConnThroughput>)>;

fn worker(
    cfg: &Config,
    conns: Vec<(Arc<SharedQp>, usize, u32)>,
    keys: &KeyDist,
    clock: &Clock,
) -> ThreadResult {
    let window = cfg.window.max(1) as usize;
    let mut rec = Recorder::default();
    let mut conns: Vec<Conn> = conns
        .into_iter()
        .map(|(qp, idx, id)| Conn {
            qp,
            idx,
            id,
            slots: vec![None; window],
            free: (0..window as u32).rev().collect(),
            seqs: vec![0; window],
            reissue: Vec::new(),
            reposts: Vec::new(),
            coalesced: vec![Vec::new(); window],
            outgoing: Vec::new(),
            batches: Vec::new(),
            next_batch: None,
            rng: Rng::new(cfg.seed ^ (id as u64).wrapping_mul(0x9e37_79b9)),
            quota: Quota::part(cfg.ops, cfg.bytes, cfg.conns, id),
            scheduled: 0,
            next_due: None,
            ops: 0,
            bytes: 0,
            finished: false,
        })
        .collect();
    // Event mode: a thread sleeps on its CQs' channels and on a wake that a thread polling
    // a shared CQ rings when it routes a completion to one of this thread's connections.
    let wake = if cfg.events {
        let w = Arc::new(Wake::new()?);
        for c in &conns {
            // each connection has one thread: set once
            let _ = c.qp.wakers[c.idx].set(w.clone());
        }
        Some(w)
    } else {
        None
    };
    let mut wcs = verbs::blank_wcs(32);
    let mut last_progress = Instant::now();
    while conns.iter().any(|c| !c.finished) {
        let mut progress = 0;
        for c in conns.iter_mut().filter(|c| !c.finished) {
            progress += c.step(cfg, keys, clock, &mut rec, &mut wcs)?;
        }
        // A connection waiting for its next scheduled batch with nothing in flight is idle,
        // not stalled.
        let waiting = conns.iter().all(|c| c.slots.iter().all(Option::is_none));
        if progress > 0 || waiting {
            last_progress = Instant::now();
        } else if last_progress.elapsed() > STALL {
            // A lost completion would otherwise hang the run: say which operations wait.
            let stuck: Vec<String> = conns
                .iter()
                .flat_map(|c| {
                    c.slots
                        .iter()
                        .flatten()
                        .map(move |o| format!("conn {}: {o:?}", c.id))
                })
                .collect();
            anyhow::bail!(
                "no completion for {STALL:?}; waiting:\n{}",
                stuck.join("\n")
            );
        }
        if progress == 0 {
            if let Some(wake) = &wake {
                wait_for_events(&conns, wake, &mut rec, &mut wcs)?;
            } else {
                // Busy polling, but a 2-core machine may run more busy threads than cores.
                std::thread::yield_now();
            }
        }
    }
    let per_conn = conns
        .iter()
        .map(|c| ConnThroughput {
            conn: c.id,
            ops: c.ops,
            bytes: c.bytes,
            ops_per_s: 0.0,
            mib_per_s: 0.0,
        })
        .collect();
    Ok((rec, per_conn))
}

/// Arms every CQ of this thread, polls once more (a completion may have come before the
/// arming), then waits up to a millisecond for an event or a ring of `wake`. The thread
/// that takes a shared CQ's event polls that CQ, so completions of connections whose
/// threads sleep on are routed (and their threads rung) even when the event was not theirs.
fn wait_for_events(
    conns: &[Conn],
    wake: &Wake,
    rec: &mut Recorder,
    wcs: &mut [rdma_sys::ibv_wc],
) -> anyhow::Result<()> {
    let live = || conns.iter().filter(|c| !c.finished);
    let mut fds = vec![libc::pollfd {
        fd: wake.fd(),
        events: libc::POLLIN,
        revents: 0,
    }];
    for c in live() {
        let _g = c.qp.lock(rec);
        c.qp.ep.cq.arm()?;
        if c.qp.poll_and_route(wcs)? > 0 {
            return Ok(());
        }
        fds.push(libc::pollfd {
            fd: c.qp.ep.cq.fd(),
            events: libc::POLLIN,
            revents: 0,
        });
    }
    // Work routed here while arming: do not sleep on it (its ring is taken below).
    if live().all(|c| c.qp.mailboxes[c.idx].lock().is_empty()) {
        // SAFETY: valid pollfds.
        unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as u64, 1) };
    }
    wake.clear();
    for c in live() {
        if c.qp.ep.cq.take_event() {
            let _g = c.qp.lock(rec);
            c.qp.poll_and_route(wcs)?;
        }
    }
    Ok(())
}

impl Conn {
    /// Handles what arrived, posts what is due, polls; returns how much happened.
    fn step(
        &mut self,
        cfg: &Config,
        keys: &KeyDist,
        clock: &Clock,
        rec: &mut Recorder,
        wcs: &mut [rdma_sys::ibv_wc],
    ) -> anyhow::Result<usize> {
        let done = std::mem::take(&mut *self.qp.mailboxes[self.idx].lock());
        let mut progress = done.len();
        let now = Instant::now();
        for d in done {
            self.complete(d, clock, rec, now);
        }
        if self.qp.broken.load(Ordering::Relaxed) {
            // Whatever was in flight is lost with the QP.
            let lost = self.slots.iter().filter(|s| s.is_some()).count() as u64;
            rec.failed_completions += lost;
            self.give_up_batches(clock, rec, now);
            self.finished = true;
            return Ok(progress + 1);
        }
        // Seen here first, the stop starts the drain time before anything more is polled, so
        // `--drain 0` gives up exactly what was in flight when the run stopped.
        clock.running(now);
        let in_flight = self.slots.iter().filter(|s| s.is_some()).count() as u64;
        if in_flight > 0 && clock.abandons(now) {
            // Their completions, if any come, are routed to a connection no one polls.
            rec.abandoned += in_flight;
            self.give_up_batches(clock, rec, now);
            self.finished = true;
            return Ok(progress + 1);
        }
        let mut wrs = self.prepare(cfg, keys, clock, now);
        if cfg.coalesce {
            wrs = self.coalesce(wrs);
        }
        let outstanding = self.slots.iter().filter(|s| s.is_some()).count();
        if outstanding == 0 && wrs.is_empty() && self.reposts.is_empty() {
            if !clock.running(now) || self.quota.spent() {
                self.finished = true;
            }
            return Ok(progress);
        }
        let reposts: Vec<_> = self
            .reposts
            .drain(..)
            .map(|b| self.qp.recv_wr(b as usize))
            .collect();
        let _g = self.qp.lock(rec);
        verbs::post_recv(self.qp.ep.qp(), self.qp.ep.mr.lkey(), &reposts)?;
        self.qp.ep.post_send(&wrs)?;
        self.outgoing.clear();
        progress += wrs.len() + self.qp.poll_and_route(wcs)?;
        Ok(progress)
    }

    /// The work requests to post now: READs to reissue after a torn read, and a new batch
    /// if the window has room for it (as many batches as it has room for, when coalescing).
    fn prepare(
        &mut self,
        cfg: &Config,
        keys: &KeyDist,
        clock: &Clock,
        now: Instant,
    ) -> Vec<SendWr> {
        let reissue = std::mem::take(&mut self.reissue);
        let mut wrs: Vec<SendWr> = reissue.into_iter().map(|s| self.read_wr(s)).collect();
        while self.next_batch(cfg, keys, clock, now, &mut wrs) && cfg.coalesce {}
        wrs
    }

    /// Appends a new batch to `wrs` if the window has room for it; whether it did.
    fn next_batch(
        &mut self,
        cfg: &Config,
        keys: &KeyDist,
        clock: &Clock,
        now: Instant,
        wrs: &mut Vec<SendWr>,
    ) -> bool {
        let wr_num = *self
            .next_batch
            .get_or_insert_with(|| cfg.wr_num.draw(&mut self.rng) as usize);
        let outstanding = self.slots.iter().filter(|s| s.is_some()).count();
        let n = batch::to_post(outstanding, self.slots.len(), wr_num);
        if n == 0 || !clock.running(now) || self.quota.spent() {
            return false;
        }
        if let Some(s) = cfg.schedule {
            let due = *self.next_due.get_or_insert_with(|| {
                let at = s.due_unix_ns(self.scheduled, &mut self.rng);
                now + Duration::from_nanos(Schedule::wait_ns(at, unix_ns()))
            });
            if now < due {
                return false;
            }
            self.next_due = None;
            self.scheduled += 1;
        }
        self.next_batch = None;
        let b = self
            .batches
            .iter()
            .position(|b| b.is_none())
            .unwrap_or_else(|| {
                self.batches.push(None);
                self.batches.len() - 1
            });
        let mut posted = 0;
        for _ in 0..n {
            let size = cfg.size.draw(&mut self.rng);
            // Warm-up operations are not counted against --ops/--bytes.
            if now >= clock.warmup_end && !self.quota.take(size) {
                break;
            }
            let key = keys.draw(&mut self.rng);
            let kind = cfg.op.draw(&mut self.rng);
            let slot = self.free.pop().expect("the window has room");
            self.seqs[slot as usize] = self.seqs[slot as usize].wrapping_add(1);
            self.slots[slot as usize] = Some(InFlight {
                kind,
                key,
                size: size as u32,
                start: now,
                seq: self.seqs[slot as usize],
                batch: b,
                retry: Retry::default(),
                send_done: false,
                reply_done: false,
            });
            wrs.push(match kind {
                OpKind::Read => self.read_wr(slot),
                OpKind::Get | OpKind::Put => self.rpc_wr(slot),
            });
            posted += 1;
        }
        if posted > 0 {
            self.batches[b] = Some(Batch {
                start: now,
                ops: posted,
                left: posted,
            });
        }
        posted > 0
    }

    /// Packs each run of consecutive RPC requests in `wrs` into as few inline SENDs as fit
    /// the server's receive buffer (`coalesce.rs`); READs and lone requests stay as they are.
    fn coalesce(&mut self, wrs: Vec<SendWr>) -> Vec<SendWr> {
        let room = self.qp.ep.max_inline().min(self.qp.request_room);
        let mut out = Vec::with_capacity(wrs.len());
        let mut rest = &wrs[..];
        while let Some(first) = rest.first() {
            let run = match first.read_from {
                Some(_) => 1,
                None => rest.iter().take_while(|w| w.read_from.is_none()).count(),
            };
            let (these, later) = rest.split_at(run);
            rest = later;
            if first.read_from.is_some() {
                out.push(*first);
                continue;
            }
            let lens: Vec<usize> = these.iter().map(|w| w.len as usize).collect();
            for g in coalesce::groups(&lens, room) {
                let group = &these[g];
                if group.len() == 1 {
                    out.push(group[0]);
                    continue;
                }
                let mut msg = vec![0u8; proto::BATCH_HEADER];
                proto::encode_batch_header(&mut msg);
                for w in group {
                    // SAFETY: the request was written into its slot's buffer by `rpc_wr` and
                    // no WR uses that buffer (only this copy of it is sent).
                    let req = unsafe {
                        self.qp
                            .ep
                            .mr
                            .buffer()
                            .slice(self.qp.off_of(w.addr), w.len as usize)
                    };
                    msg.extend_from_slice(req);
                }
                let slot_of = |w: &SendWr| WrId::decode(w.wr_id).expect("our own wr_id").index;
                self.coalesced[slot_of(&group[0]) as usize] =
                    group[1..].iter().map(slot_of).collect();
                out.push(SendWr {
                    addr: msg.as_ptr() as u64,
                    len: msg.len() as u32,
                    ..group[0]
                });
                self.outgoing.push(msg);
            }
        }
        out
    }

    fn read_wr(&self, slot: u32) -> SendWr {
        let op = self.slots[slot as usize].as_ref().expect("in flight");
        let w = &self.qp.welcome;
        SendWr {
            wr_id: WrId {
                kind: WrKind::Read,
                conn: self.idx as u16,
                index: slot,
            }
            .encode(),
            addr: self.qp.ep.mr.addr(self.qp.op_off(self.idx, slot as usize)),
            len: HEADER as u32 + op.size,
            lkey: self.qp.ep.mr.lkey(),
            read_from: Some((w.addr + op.key * w.slot_size(), w.rkey)),
        }
    }

    /// Writes the request of `slot` into its buffer and returns its SEND.
    fn rpc_wr(&mut self, slot: u32) -> SendWr {
        let op = self.slots[slot as usize].as_ref().expect("in flight");
        let off = self.qp.op_off(self.idx, slot as usize);
        let (opcode, tag) = match op.kind {
            OpKind::Put => (Op::Put, self.rng.next_u64() | 1),
            _ => (Op::Get, 0),
        };
        let mut req = Request {
            op: opcode,
            conn: self.id,
            req: wrid::request_id(slot, op.seq),
            key: op.key,
            size: op.size,
            checksum: 0,
            tag,
        };
        // SAFETY: the slot's buffer belongs to this connection and no WR uses it (the slot
        // was free).
        let buf = unsafe { self.qp.ep.mr.buffer().slice_mut(off, req.wire_len()) };
        if opcode == Op::Put {
            let value = &mut buf[proto::REQUEST_HEADER..];
            slot::fill_value(self.qp.welcome.seed, op.key, tag, value);
            req.checksum = slot::checksum(op.key, tag, value);
        }
        req.encode(buf);
        SendWr {
            wr_id: WrId {
                kind: WrKind::Send,
                conn: self.idx as u16,
                index: slot,
            }
            .encode(),
            addr: self.qp.ep.mr.addr(off),
            len: req.wire_len() as u32,
            lkey: self.qp.ep.mr.lkey(),
            read_from: None,
        }
    }

    fn complete(&mut self, d: Done, clock: &Clock, rec: &mut Recorder, now: Instant) {
        match d {
            Done::Read { slot, ok } => {
                let Some(op) = self.slots[slot as usize].as_ref() else {
                    return;
                };
                if !ok {
                    return self.finish(slot, false, clock, rec, now);
                }
                let off = self.qp.op_off(self.idx, slot as usize);
                // SAFETY: the READ completed; the buffer is this slot's.
                let got = unsafe { self.qp.ep.mr.buffer().slice(off, HEADER + op.size as usize) };
                let w = &self.qp.welcome;
                let (key, check) = (op.key, slot::check_read(w.seed, op.key, w.max_value, got));
                let op = self.slots[slot as usize].as_mut().expect("in flight");
                let verdict = op.retry.judge(check);
                match verdict {
                    Verdict::Done { tag, .. } => {
                        rec.updated_values += u64::from(tag != 0);
                        self.finish(slot, true, clock, rec, now)
                    }
                    Verdict::ReadAgain => {
                        rec.torn_retries += 1;
                        self.reissue.push(slot);
                    }
                    Verdict::Wrong => {
                        eprintln!(
                            "drum-kv client: conn {}: wrong value READ from key {key}",
                            self.id
                        );
                        rec.wrong_values += 1;
                        self.finish(slot, true, clock, rec, now);
                    }
                }
            }
            Done::Send { slot, ok } => {
                let carried = std::mem::take(&mut self.coalesced[slot as usize]);
                for slot in std::iter::once(slot).chain(carried) {
                    self.sent(slot, ok, clock, rec, now);
                }
            }
            Done::Reply { buf, len, ok } => {
                self.reposts.push(buf);
                if !ok {
                    return;
                }
                let off = buf as usize * self.qp.reply_size;
                let qp = self.qp.clone();
                // SAFETY: the RECV completed and is reposted only after this.
                let b = unsafe {
                    qp.ep
                        .mr
                        .buffer()
                        .slice(off, (len as usize).min(qp.reply_size))
                };
                // the server may have answered several requests in one message
                for r in proto::replies(b) {
                    let Some((r, payload)) = r else {
                        eprintln!("drum-kv client: conn {}: malformed reply", self.id);
                        rec.error_replies += 1;
                        break;
                    };
                    self.on_reply(r, payload, rec, clock, now);
                }
            }
        }
    }

    /// The SEND carrying the request of `slot` completed.
    fn sent(&mut self, slot: u32, ok: bool, clock: &Clock, rec: &mut Recorder, now: Instant) {
        let Some(op) = self.slots[slot as usize].as_mut() else {
            return;
        };
        op.send_done = true;
        if !ok {
            return self.finish(slot, false, clock, rec, now);
        }
        if op.reply_done {
            self.finish(slot, true, clock, rec, now);
        }
    }

    fn on_reply(
        &mut self,
        r: Reply,
        payload: &[u8],
        rec: &mut Recorder,
        clock: &Clock,
        now: Instant,
    ) {
        let (slot, seq) = wrid::split_request_id(r.req);
        let Some(op) = self
            .slots
            .get(slot as usize)
            .cloned()
            .flatten()
            .filter(|o| o.seq == seq && o.kind != OpKind::Read)
        else {
            eprintln!(
                "drum-kv client: conn {}: reply to no request ({})",
                self.id, r.req
            );
            rec.error_replies += 1;
            return;
        };
        if r.status != Status::Ok {
            eprintln!(
                "drum-kv client: conn {}: server refused key {}: {:?}",
                self.id, op.key, r.status
            );
            rec.error_replies += 1;
        } else if op.kind == OpKind::Get {
            let w = &self.qp.welcome;
            let check = (payload.len() == HEADER + op.size as usize)
                .then(|| slot::check_read(w.seed, op.key, w.max_value, payload));
            if let Some(slot::ReadCheck::Value { tag, .. }) = check {
                rec.updated_values += u64::from(tag != 0);
            } else {
                eprintln!(
                    "drum-kv client: conn {}: wrong value from GET of key {}",
                    self.id, op.key
                );
                rec.wrong_values += 1;
            }
        }
        let o = self.slots[slot as usize].as_mut().expect("in flight");
        o.reply_done = true;
        if o.send_done {
            self.finish(slot, true, clock, rec, now);
        }
    }

    /// The batches still in flight are given up at `now`: their time in flight until the
    /// run stopped still counts (`in_flight.rs`).
    fn give_up_batches(&mut self, clock: &Clock, rec: &mut Recorder, now: Instant) {
        for b in self.batches.drain(..).flatten() {
            rec.batch_in_flight
                .in_flight(b.start, now, clock.measured());
        }
    }

    /// Ends the operation in `slot`; `ok` false when its completion failed.
    fn finish(&mut self, slot: u32, ok: bool, clock: &Clock, rec: &mut Recorder, now: Instant) {
        let Some(op) = self.slots[slot as usize].take() else {
            return;
        };
        self.free.push(slot);
        if !ok {
            rec.failed_completions += 1;
        }
        let counted = op.start >= clock.warmup_end;
        if counted && ok {
            Recorder::record(&mut rec.ops, (now - op.start).as_nanos() as u64);
            self.ops += 1;
            self.bytes += op.size as u64;
        }
        if let Some(b) = self.batches.get_mut(op.batch).and_then(|b| b.as_mut()) {
            rec.batch_in_flight
                .op_completed(b.ops, now, clock.measured());
            b.left -= 1;
            if b.left == 0 {
                if counted {
                    Recorder::record(&mut rec.batches, (now - b.start).as_nanos() as u64);
                }
                rec.batch_in_flight
                    .in_flight(b.start, now, clock.measured());
                self.batches[op.batch] = None;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Quota;

    #[test]
    fn totals_are_split_with_the_remainder_on_the_first_connections() {
        let parts: Vec<Quota> = (0..4).map(|i| Quota::part(Some(10), None, 4, i)).collect();
        let ops: Vec<u64> = parts.iter().map(|q| q.ops.unwrap()).collect();
        assert_eq!(ops, [3, 3, 2, 2]);
        assert!(parts.iter().all(|q| q.bytes.is_none()));
        // fewer operations than connections: the rest have nothing to do
        assert!(Quota::part(Some(1), None, 6, 5).spent());
        assert!(!Quota::part(None, None, 6, 5).spent());
    }

    #[test]
    fn a_byte_part_is_taken_while_any_is_left() {
        let mut q = Quota::part(None, Some(100), 1, 0);
        assert!(q.take(60));
        assert!(q.take(60), "the last operation may overshoot");
        assert!(q.spent());
        assert!(!q.take(1));
        let mut q = Quota::part(Some(2), Some(1 << 20), 1, 0);
        assert!(q.take(32) && q.take(32) && !q.take(32));
    }
}
