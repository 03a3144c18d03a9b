//! One QP and the connections that share it (one in RAW mode, R in SHARE mode): its buffers,
//! the lock that serialises posting and polling, and the mailboxes through which a poller
//! hands each completion to its connection — by the connection index in `wr_id` for READs and
//! SENDs, by the connection id in the reply's payload for RECVs (any posted receive buffer
//! of the QP may catch any connection's reply). With `--poll event`, a connection's thread may
//! sleep while another thread polls its completion: the poller rings the sleeper's [`Wake`].

use crate::cm::{self, Endpoint, QueueSizes};
use crate::proto::{self, Hello, Reply, Welcome};
use crate::stats::Recorder;
use crate::verbs::{self, Mr};
use crate::wake::Wake;
use crate::wrid::{WrId, WrKind};
use parking_lot::Mutex;
use rdma_sys::ibv_wc_status;
use std::net::SocketAddrV4;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Instant;

/// The receive of reply buffer `buf` (buffers come first in the QP's memory).
fn recv_wr(mr: &Mr, buf: usize, reply_size: usize) -> (u64, u64, u32) {
    let id = WrId {
        kind: WrKind::Recv,
        conn: 0,
        index: buf as u32,
    };
    (id.encode(), mr.addr(buf * reply_size), reply_size as u32)
}

/// A completion, routed to its connection.
#[derive(Debug, Clone, Copy)]
pub enum Done {
    Read { slot: u32, ok: bool },
    Send { slot: u32, ok: bool },
    Reply { buf: u32, len: u32, ok: bool },
}

/// One QP and the connections (1 in RAW mode) that share it.
pub struct SharedQp {
    pub ep: Endpoint,
    lock: Mutex<()>,
    pub mailboxes: Vec<Mutex<Vec<Done>>>,
    /// The wake of each connection's thread, when it sleeps on completion events.
    pub wakers: Vec<OnceLock<Arc<Wake>>>,
    pub broken: AtomicBool,
    pub welcome: Welcome,
    /// Global id of the QP's first connection.
    base_conn: u32,
    window: usize,
    recvs: usize,
    pub reply_size: usize,
    op_size: usize,
    /// The server's receive buffer, the most one request message may carry.
    pub request_room: usize,
}

impl SharedQp {
    /// Connects `share` connections' QP (the first's id `base_conn`) and posts its receives.
    pub fn connect(
        server: SocketAddrV4,
        events: bool,
        base_conn: u32,
        share: usize,
        window: usize,
        max_size: u32,
        uses_rpc: bool,
    ) -> anyhow::Result<SharedQp> {
        let hello = Hello {
            share: share as u16,
            window: window as u32,
            max_size,
        };
        let recvs = if uses_rpc { share * window } else { 0 };
        let reply_size = proto::reply_room(max_size);
        let op_size = proto::REQUEST_HEADER + max_size as usize;
        let q = QueueSizes {
            send: share * window,
            recv: recvs,
            buffer: recvs * reply_size + share * window * op_size,
            events,
        };
        let (ep, answer) = cm::connect(server, &hello.encode(), q, |ep| {
            let bufs: Vec<_> = (0..recvs).map(|i| recv_wr(&ep.mr, i, reply_size)).collect();
            verbs::post_recv(ep.qp(), ep.mr.lkey(), &bufs)
        })?;
        let welcome = Welcome::decode(&answer)?;
        Ok(SharedQp {
            ep,
            lock: Mutex::new(()),
            mailboxes: (0..share).map(|_| Mutex::new(Vec::new())).collect(),
            wakers: (0..share).map(|_| OnceLock::new()).collect(),
            broken: AtomicBool::new(false),
            welcome,
            base_conn,
            window,
            recvs,
            reply_size,
            op_size,
            request_room: proto::request_room(max_size),
        })
    }

    /// Where in the buffer `addr` (an address in it) is.
    pub fn off_of(&self, addr: u64) -> usize {
        (addr - self.ep.mr.addr(0)) as usize
    }

    pub fn op_off(&self, conn: usize, slot: usize) -> usize {
        self.recvs * self.reply_size + (conn * self.window + slot) * self.op_size
    }

    pub fn recv_wr(&self, buf: usize) -> (u64, u64, u32) {
        recv_wr(&self.ep.mr, buf, self.reply_size)
    }

    /// Takes the lock, counting the wait.
    pub fn lock(&self, rec: &mut Recorder) -> parking_lot::MutexGuard<'_, ()> {
        let t = Instant::now();
        let g = self.lock.lock();
        Recorder::record(&mut rec.lock_wait, t.elapsed().as_nanos() as u64);
        g
    }

    /// Polls under the lock and hands each completion to its connection's mailbox.
    pub fn poll_and_route(&self, wcs: &mut [rdma_sys::ibv_wc]) -> anyhow::Result<usize> {
        let n = self.ep.cq.poll(wcs)?;
        for wc in &wcs[..n] {
            let ok = wc.status == ibv_wc_status::IBV_WC_SUCCESS;
            if !ok {
                eprintln!(
                    "drum-kv client: QP of connection {}: {}",
                    self.base_conn,
                    verbs::wc_status(wc.status)
                );
                self.broken.store(true, Ordering::Relaxed);
            }
            let Some(id) = WrId::decode(wc.wr_id) else {
                continue;
            };
            let (conn, done) = match id.kind {
                WrKind::Read => (id.conn as usize, Done::Read { slot: id.index, ok }),
                WrKind::Send => (id.conn as usize, Done::Send { slot: id.index, ok }),
                WrKind::Recv => {
                    // the reply names its connection; a failed receive has no payload
                    let conn = if ok {
                        // SAFETY: the RECV completed; nobody reposts it before its owner
                        // has read it.
                        let b = unsafe {
                            self.ep
                                .mr
                                .buffer()
                                .slice(id.index as usize * self.reply_size, proto::REPLY_HEADER)
                        };
                        Reply::decode(b)
                            .map(|r| r.conn.wrapping_sub(self.base_conn) as usize)
                            .unwrap_or(0)
                    } else {
                        0
                    };
                    let done = Done::Reply {
                        buf: id.index,
                        len: wc.byte_len,
                        ok,
                    };
                    (conn.min(self.mailboxes.len() - 1), done)
                }
            };
            let conn = conn.min(self.mailboxes.len() - 1);
            let mut mailbox = self.mailboxes[conn].lock();
            mailbox.push(done);
            // Its thread drains the whole mailbox after taking its rings: one ring per
            // mailbox that was empty is enough.
            if mailbox.len() == 1 {
                if let Some(w) = self.wakers[conn].get() {
                    w.ring();
                }
            }
        }
        Ok(n)
    }
}
