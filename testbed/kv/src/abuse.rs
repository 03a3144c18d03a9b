//! A misbehaving client for the robustness tests: one connection, one malformed request,
//! and what the server answered (an error reply, or the connection closed).

use crate::cm::{self, QueueSizes};
use crate::proto::{self, Hello, Op, Request, Welcome};
use crate::verbs::{self, SendWr};
use rdma_sys::ibv_wc_status;
use std::net::SocketAddrV4;
use std::time::{Duration, Instant};

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub enum Case {
    /// A request shorter than its header.
    Truncated,
    /// An opcode the server does not know.
    UnknownOp,
    /// A key beyond the store.
    BadKey,
    /// A GET larger than the connection declared.
    BadSize,
    /// A PUT whose value disagrees with its checksum.
    BadChecksum,
    /// A message larger than the server's receive buffer (breaks the QP).
    Oversized,
    /// A PUT sent and the process gone before the reply.
    Vanish,
    /// A batch of two requests: a GET of a key beyond the store, then one cut short.
    Batch,
}

/// The largest value this client declares; its messages are sized against it.
const DECLARED: u32 = 64;

pub fn run(server: SocketAddrV4, case: Case) -> anyhow::Result<()> {
    let reply_size = proto::reply_room(DECLARED);
    let msg_size = 4096;
    let q = QueueSizes {
        send: 1,
        recv: 1,
        buffer: reply_size + msg_size,
        events: false,
    };
    let hello = Hello {
        share: 1,
        window: 1,
        max_size: DECLARED,
    };
    let (ep, answer) = cm::connect(server, &hello.encode(), q, |ep| {
        verbs::post_recv(
            ep.qp(),
            ep.mr.lkey(),
            &[(1, ep.mr.addr(0), reply_size as u32)],
        )
    })?;
    let welcome = Welcome::decode(&answer)?;
    let mut req = Request {
        op: Op::Get,
        conn: 0,
        req: 42,
        key: 0,
        size: DECLARED,
        checksum: 0,
        tag: 0,
    };
    let mut len = proto::REQUEST_HEADER;
    match case {
        Case::Truncated => len = 11,
        Case::BadKey => req.key = welcome.keys + 5,
        Case::BadSize => req.size = DECLARED + 1,
        Case::BadChecksum | Case::Vanish => {
            req.op = Op::Put;
            len = req.wire_len();
            req.checksum = u32::from(matches!(case, Case::Vanish));
        }
        Case::Oversized => len = msg_size,
        Case::UnknownOp => {}
        Case::Batch => {
            req.key = welcome.keys + 5;
            len = proto::BATCH_HEADER + proto::REQUEST_HEADER + 11;
        }
    }
    // SAFETY: nothing else uses the buffer yet.
    let buf = unsafe { ep.mr.buffer().slice_mut(reply_size, msg_size) };
    req.encode(buf);
    if matches!(case, Case::Batch) {
        let second = Request { key: 1, ..req };
        second.encode(&mut buf[proto::BATCH_HEADER + proto::REQUEST_HEADER..]);
        req.encode(&mut buf[proto::BATCH_HEADER..]);
        proto::encode_batch_header(buf);
    }
    if matches!(case, Case::UnknownOp) {
        buf[0] = 0x77;
    }
    if matches!(case, Case::Vanish) {
        // a valid PUT of key 0 that the server finishes after we are gone
        let v = &mut buf[proto::REQUEST_HEADER..len];
        crate::slot::fill_value(welcome.seed, 0, 5, v);
        req.tag = 5;
        req.checksum = crate::slot::checksum(0, 5, v);
        req.encode(buf);
    }
    let wr = SendWr {
        wr_id: 2,
        addr: ep.mr.addr(reply_size),
        len: len as u32,
        lkey: ep.mr.lkey(),
        read_from: None,
    };
    ep.post_send(&[wr])?;
    if matches!(case, Case::Vanish) {
        println!("vanished");
        // Gone without a word: no disconnect, no teardown, the request in flight.
        std::process::exit(0);
    }
    let mut wcs = verbs::blank_wcs(4);
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(10) {
        let n = ep.cq.poll(&mut wcs)?;
        for wc in &wcs[..n] {
            if wc.status != ibv_wc_status::IBV_WC_SUCCESS {
                println!("closed: {}", verbs::wc_status(wc.status));
                return Ok(());
            }
            if wc.wr_id == 1 {
                // SAFETY: the RECV completed.
                let b = unsafe { ep.mr.buffer().slice(0, wc.byte_len as usize) };
                for r in proto::replies(b) {
                    match r {
                        Some((r, _)) => println!("reply {:?} req {}", r.status, r.req),
                        None => println!("malformed reply"),
                    }
                }
                return Ok(());
            }
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    anyhow::bail!("no answer in 10 s")
}
