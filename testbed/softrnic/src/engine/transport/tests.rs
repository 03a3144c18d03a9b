//! The transport's rules alone, without an engine, processes or sockets: the requester's
//! window, acknowledgement requests, completions in order, retransmission and RNR waits;
//! the responder's sequence checks, NAKs, UC resynchronisation, atomic cache and READ jobs.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use drum_verbs_abi::consts::*;

use super::requester::{Next, ReadResponse, Requester, Route, SqWqe, Timer, ACKREQ_EVERY, WINDOW};
use super::responder::{Arrival, CurRecv, ReadJob, Responder, UcArrival, ATOMIC_CACHE};
use crate::proto::{RecvWr, SendWr};
use crate::wire::{self, Packet};

const QPN: u32 = 0x11;

fn route(uc: bool) -> Route {
    Route {
        qpn: QPN,
        dest_qpn: 0x22,
        mtu: 1024,
        xrc: false,
        uc,
    }
}

/// A signalled work request of `len` inline bytes (no memory to resolve or stage).
fn inline(opcode: i32, wr_id: u64, len: usize) -> SqWqe {
    let wr = SendWr {
        wr_id,
        opcode,
        inline: Some(vec![7; len]),
        ..Default::default()
    };
    SqWqe::new(wr, len as u32, true, true)
}

fn read(wr_id: u64, len: u32) -> SqWqe {
    let wr = SendWr {
        wr_id,
        opcode: IBV_WR_RDMA_READ,
        ..Default::default()
    };
    let mut w = SqWqe::new(wr, len, true, true);
    w.segs = vec![(0x1000, u64::from(len))];
    w
}

/// The READ response with `psn`, which must be the next expected and show nothing missing.
fn place(r: &Requester, psn: u32) -> usize {
    let got = r.read_response_for(psn).expect("a READ has the PSN");
    assert_eq!(got.ask_again, None, "nothing missing before {psn}");
    got.place.expect("the next expected response")
}

/// Build every packet the requester will send now (new data only), as the engine would.
fn send_all(r: &mut Requester, route: &Route, now: Instant) -> Vec<Packet> {
    let mut out = Vec::new();
    while let Next::New(idx) = r.next(now) {
        if r.is_request(idx) {
            out.push(r.request_packet(idx, route, now));
        } else {
            out.push(r.data_packet(idx, route, false, now).packet);
        }
    }
    out
}

#[test]
fn the_window_holds_at_most_its_packets_unacknowledged() {
    let now = Instant::now();
    let mut r = Requester::new(now);
    r.sq.extend((0..WINDOW as u64 + 10).map(|i| inline(IBV_WR_SEND, i, 8)));
    let sent = send_all(&mut r, &route(false), now);
    assert_eq!(sent.len(), WINDOW);
    assert!(matches!(r.next(now), Next::Nothing));
    // Ten acknowledged: ten more may go.
    r.acknowledge(sent[9].psn, now);
    assert_eq!(r.completions(QPN, sent[9].psn).len(), 10);
    assert_eq!(send_all(&mut r, &route(false), now).len(), 10);
}

/// A READ response beyond the next expected one asks for the rest of the READ at once,
/// once per missing PSN; the rest is placed by PSN (not by the packet's offset).
#[test]
fn a_missing_read_response_asks_for_the_rest_once() {
    let now = Instant::now();
    let mut r = Requester::new(now);
    let mut w = read(1, 3500);
    w.wr.remote_addr = 0x9000;
    r.sq.push_back(w);
    let req = send_all(&mut r, &route(false), now).remove(0);
    let p0 = req.psn;
    let idx = place(&r, p0);
    r.read_response_placed(idx, p0, now);
    // p0 + 1 is lost: p0 + 2 shows it.
    let gap = r.read_response_for(p0 + 2).unwrap();
    assert_eq!(gap.place, None);
    assert_eq!(gap.ask_again, Some(0));
    let again = r.ask_again(0).unwrap();
    assert_eq!(
        (again.op, again.psn, again.remote_addr, again.msg_len),
        (wire::OP_READ_REQ, p0 + 1, 0x9000 + 1024, 3500 - 1024)
    );
    // The next response beyond the gap asks nothing more; the timer would resend the rest.
    assert_eq!(r.read_response_for(p0 + 3).unwrap().ask_again, None);
    assert_eq!(r.inflight[0].packet.psn, p0 + 1);
    for psn in p0 + 1..=p0 + 3 {
        let idx = place(&r, psn);
        let t = r.read_target(idx, psn);
        assert_eq!(t.offset, (psn - p0) * 1024);
        assert_eq!(t.len, if psn == p0 + 3 { 3500 - 3 * 1024 } else { 1024 });
        assert_eq!(t.last, psn == p0 + 3);
        r.read_response_placed(idx, psn, now);
    }
    let ids: Vec<u64> = r.completions(QPN, p0 + 3).iter().map(|w| w.wr_id).collect();
    assert_eq!(ids, vec![1]);
}

/// A later READ's response while an earlier READ still misses its last responses: the
/// responder answers in order, so the earlier one's were lost. It is asked again, and the
/// later READ's response is still placed.
#[test]
fn a_later_reads_response_asks_again_for_the_earlier_reads_rest() {
    let now = Instant::now();
    let mut r = Requester::new(now);
    r.sq.push_back(read(1, 2048));
    r.sq.push_back(read(2, 1024));
    let sent = send_all(&mut r, &route(false), now);
    let (a, b) = (sent[0].psn, sent[1].psn);
    let idx = place(&r, a);
    r.read_response_placed(idx, a, now);
    let got = r.read_response_for(b).unwrap();
    assert_eq!(
        got,
        ReadResponse {
            place: Some(1),
            ask_again: Some(0)
        }
    );
    assert_eq!(r.ask_again(0).unwrap().psn, a + 1);
    let acked = r.read_response_placed(1, b, now);
    assert!(
        r.completions(QPN, acked).is_empty(),
        "in order: the first READ is not done"
    );
    let idx = place(&r, a + 1);
    let acked = r.read_response_placed(idx, a + 1, now);
    let ids: Vec<u64> = r.completions(QPN, acked).iter().map(|w| w.wr_id).collect();
    assert_eq!(ids, vec![1, 2]);
}

/// A timeout after a READ's last responses were lost resends the request for the rest.
#[test]
fn a_timeout_asks_a_read_only_for_what_did_not_arrive() {
    let t0 = Instant::now();
    let mut r = Requester::new(t0);
    r.sq.push_back(read(1, 3072));
    let p0 = send_all(&mut r, &route(false), t0)[0].psn;
    let idx = place(&r, p0);
    r.read_response_placed(idx, p0, t0);
    let timeout = Duration::from_millis(10);
    assert_eq!(r.timer(t0 + timeout, timeout, 7), Timer::Resend);
    let Next::Resend(p) = r.next(t0 + timeout) else {
        panic!("the READ request is resent");
    };
    assert_eq!((p.psn, p.msg_len), (p0 + 1, 2048));
}

#[test]
fn a_long_message_asks_for_an_ack_every_sixteen_packets_and_at_its_end() {
    let now = Instant::now();
    let mut r = Requester::new(now);
    r.sq.push_back(inline(IBV_WR_RDMA_WRITE, 1, 40 * 1024));
    let sent = send_all(&mut r, &route(false), now);
    assert_eq!(sent.len(), 40);
    let asked: Vec<usize> = (0..40)
        .filter(|&i| sent[i].flags & wire::F_ACKREQ != 0)
        .collect();
    let every = ACKREQ_EVERY as usize;
    assert_eq!(asked, vec![every - 1, 2 * every - 1, 39]);
    assert_ne!(sent[0].flags & wire::F_FIRST, 0);
    assert_ne!(sent[39].flags & wire::F_LAST, 0);
    assert!(sent.windows(2).all(|w| w[1].psn == w[0].psn + 1));
}

/// Completions are in order: a WRITE acknowledged behind a READ still waiting for its
/// response completes only with the READ, and without another ACK.
#[test]
fn a_write_acknowledged_behind_a_read_completes_with_it() {
    let now = Instant::now();
    let mut r = Requester::new(now);
    r.sq.push_back(read(1, 2048));
    r.sq.push_back(inline(IBV_WR_RDMA_WRITE, 2, 8));
    let sent = send_all(&mut r, &route(false), now);
    assert_eq!(sent[0].op, wire::OP_READ_REQ);
    let write_psn = sent[1].psn;
    assert_eq!(
        write_psn,
        sent[0].psn + 2,
        "a 2 KiB READ takes two response PSNs"
    );
    r.acknowledge(write_psn, now);
    assert!(r.completions(QPN, write_psn).is_empty());
    // The READ's two responses, in order; a repeat of the first is refused.
    let first = place(&r, sent[0].psn);
    let acked = r.read_response_placed(first, sent[0].psn, now);
    assert!(r.completions(QPN, acked).is_empty());
    let repeat = r.read_response_for(sent[0].psn);
    assert_eq!(
        repeat,
        Some(ReadResponse {
            place: None,
            ask_again: None
        })
    );
    let idx = place(&r, sent[0].psn + 1);
    let acked = r.read_response_placed(idx, sent[0].psn + 1, now);
    r.acknowledge(acked, now);
    let wcs = r.completions(QPN, acked);
    let ids: Vec<u64> = wcs.iter().map(|w| w.wr_id).collect();
    assert_eq!(ids, vec![1, 2]);
    assert_eq!(wcs[0].byte_len, 2048);
    assert!(r.inflight.is_empty());
}

#[test]
fn reads_beyond_max_rd_atomic_wait_for_a_response() {
    let now = Instant::now();
    let mut r = Requester::new(now);
    r.sq.push_back(read(1, 64));
    r.sq.push_back(read(2, 64));
    let Next::New(0) = r.next(now) else {
        panic!("the first READ goes")
    };
    let p = r.request_packet(0, &route(false), now);
    assert!(r.request_must_wait(1, 1));
    assert!(!r.request_must_wait(1, 2));
    r.read_response_placed(0, p.psn, now);
    assert!(!r.request_must_wait(1, 1));
}

#[test]
fn the_timer_resends_everything_then_gives_up_after_retry_cnt() {
    let t0 = Instant::now();
    let timeout = Duration::from_millis(10);
    let mut r = Requester::new(t0);
    r.sq.push_back(inline(IBV_WR_SEND, 1, 3000));
    let sent = send_all(&mut r, &route(false), t0);
    assert_eq!(sent.len(), 3);
    assert_eq!(r.timer(t0 + timeout / 2, timeout, 1), Timer::Quiet);
    let t1 = t0 + timeout;
    assert_eq!(r.timer(t1, timeout, 1), Timer::Resend);
    let resent: Vec<u32> = (0..3)
        .map(|_| match r.next(t1) {
            Next::Resend(p) => p.psn,
            _ => panic!("a retransmission"),
        })
        .collect();
    assert_eq!(resent, sent.iter().map(|p| p.psn).collect::<Vec<_>>());
    assert!(matches!(r.next(t1), Next::Nothing));
    assert_eq!(r.timer(t1 + timeout, timeout, 1), Timer::Exhausted);
    // Progress resets the count.
    let mut r = Requester::new(t0);
    r.sq.push_back(inline(IBV_WR_SEND, 1, 3000));
    let sent = send_all(&mut r, &route(false), t0);
    assert_eq!(r.timer(t1, timeout, 1), Timer::Resend);
    r.acknowledge(sent[0].psn, t1);
    assert_eq!(r.timer(t1 + timeout, timeout, 1), Timer::Resend);
}

#[test]
fn an_rnr_nak_waits_its_delay_then_resends_up_to_rnr_retry() {
    let t0 = Instant::now();
    let delay = Duration::from_millis(10);
    let mut r = Requester::new(t0);
    r.sq.push_back(inline(IBV_WR_SEND, 1, 8));
    let sent = send_all(&mut r, &route(false), t0);
    assert!(r.rnr_nak(t0, delay, 1));
    assert!(matches!(r.next(t0 + delay / 2), Next::Nothing));
    assert_eq!(
        r.timer(t0 + delay * 100, delay, 0),
        Timer::Quiet,
        "no timeout during an RNR wait"
    );
    match r.next(t0 + delay) {
        Next::Resend(p) => assert_eq!(p.psn, sent[0].psn),
        _ => panic!("the SEND again after the wait"),
    }
    assert!(
        !r.rnr_nak(t0 + delay, delay, 1),
        "the second RNR NAK exceeds 1"
    );
    let mut forever = Requester::new(t0);
    forever.sq.push_back(inline(IBV_WR_SEND, 1, 8));
    send_all(&mut forever, &route(false), t0);
    assert!(
        (0..100).all(|_| forever.rnr_nak(t0, delay, 7)),
        "7 retries forever"
    );
}

#[test]
fn a_uc_message_completes_once_sent_and_nothing_is_kept() {
    let now = Instant::now();
    let mut r = Requester::new(now);
    r.sq.push_back(inline(IBV_WR_SEND, 1, 2000));
    let Next::New(0) = r.next(now) else { panic!() };
    assert_eq!(r.data_packet(0, &route(true), false, now).uc_done, None);
    let last = r.data_packet(0, &route(true), false, now);
    assert_eq!(last.uc_done, Some(last.packet.psn));
    assert!(r.inflight.is_empty());
    assert_eq!(r.completions(QPN, last.packet.psn).len(), 1);
}

#[test]
fn responses_outside_the_window_are_not_expected() {
    let now = Instant::now();
    let mut r = Requester::new(now);
    r.next_psn = wire::PSN_MASK - 1; // the window wraps
    assert!(!r.expects(r.next_psn), "nothing in flight");
    r.sq.extend((0..4).map(|i| inline(IBV_WR_SEND, i, 8)));
    let sent = send_all(&mut r, &route(false), now);
    assert!(sent.iter().all(|p| r.expects(p.psn)));
    assert!(!r.expects(r.next_psn));
    assert!(!r.expects(sent[0].psn.wrapping_sub(1) & wire::PSN_MASK));
}

#[test]
fn a_flush_completes_every_request_in_order_with_flush_errors() {
    let now = Instant::now();
    let mut r = Requester::new(now);
    r.sq.extend((0..3).map(|i| inline(IBV_WR_SEND, i, 8)));
    send_all(&mut r, &route(false), now);
    let wcs = r.flush(QPN);
    assert_eq!(
        wcs.iter().map(|w| w.wr_id).collect::<Vec<_>>(),
        vec![0, 1, 2]
    );
    assert!(wcs.iter().all(|w| w.status == IBV_WC_WR_FLUSH_ERR));
    assert!(r.sq.is_empty() && r.inflight.is_empty() && !r.has_unsent());
}

#[test]
fn the_responder_naks_a_gap_once_until_it_makes_progress() {
    let mut r = Responder::new(Instant::now());
    r.epsn = 100;
    assert_eq!(r.arrival(99), Arrival::Duplicate);
    assert_eq!(r.last_received(), 99);
    assert_eq!(r.arrival(102), Arrival::Ahead(Some(100)));
    assert_eq!(r.arrival(103), Arrival::Ahead(None));
    assert_eq!(r.arrival(100), Arrival::InOrder);
    assert_eq!(r.accepted(1), 100);
    assert_eq!(r.arrival(102), Arrival::Ahead(Some(101)));
    // RNR NAKs once until progress; errors always.
    assert!(!r.nak(wire::NAK_RNR));
    r.accepted(1);
    assert!(r.nak(wire::NAK_RNR));
    assert!(!r.nak(wire::NAK_RNR));
    assert!(r.nak(wire::NAK_REM_ACCESS));
}

#[test]
fn a_uc_gap_drops_the_rest_of_its_message_and_resynchronises_at_the_next() {
    let mut r = Responder::new(Instant::now());
    r.epsn = 10;
    assert_eq!(r.uc_arrival(9, true), UcArrival::Duplicate);
    assert_eq!(r.uc_arrival(12, false), UcArrival::Broken, "packet 10 lost");
    assert_eq!(r.uc_arrival(13, false), UcArrival::Broken);
    assert_eq!(r.uc_arrival(14, true), UcArrival::Apply, "a new message");
    assert_eq!(r.epsn, 14);
    r.uc_applied(14);
    r.uc_failed(false);
    assert_eq!(
        r.uc_arrival(15, false),
        UcArrival::Broken,
        "its first packet failed"
    );
    assert_eq!(r.uc_arrival(16, true), UcArrival::Apply);
}

#[test]
fn the_atomic_cache_keeps_the_latest_results() {
    let mut r = Responder::new(Instant::now());
    for psn in 0..ATOMIC_CACHE as u32 + 2 {
        r.executed_atomic(psn, u64::from(psn) * 10);
    }
    assert_eq!(r.executed_value(0), None);
    assert_eq!(r.executed_value(1), None);
    assert_eq!(r.executed_value(2), Some(20));
    assert_eq!(
        r.executed_value(ATOMIC_CACHE as u32 + 1),
        Some(10 * (ATOMIC_CACHE as u64 + 1))
    );
}

/// The READ request of `len` bytes at `psn`, queued at `r` with `mtu`-sized responses of
/// the bytes at 0x1000 in process 7.
fn queue_read(r: &mut Responder, psn: u32, len: u32, now: Instant) {
    let to: SocketAddr = "10.0.0.2:4791".parse().unwrap();
    let request = Packet {
        op: wire::OP_READ_REQ,
        src_qpn: 0x22,
        psn,
        msg_len: len,
        ..Default::default()
    };
    r.queue_read(ReadJob::new(to, &request, 1024, (7, 0x1000)), now);
}

#[test]
fn read_responses_go_one_packet_at_a_time_and_a_repeat_request_restarts() {
    let t0 = Instant::now();
    let mut r = Responder::new(t0);
    queue_read(&mut r, 50, 2500, t0);
    assert_eq!(r.next_read(), Some((7, 0x1000, 1024)));
    let (_, p) = r.read_response(QPN, Some(vec![1; 1024]), t0).unwrap();
    assert_eq!(
        (p.op, p.psn, p.offset, p.flags),
        (wire::OP_READ_RESP, 50, 0, 0)
    );
    // The requester goes back to PSN 50: the job restarts.
    queue_read(&mut r, 50, 2500, t0);
    assert_eq!(r.read_jobs.len(), 1);
    let psns: Vec<(u32, u32)> = (0..3)
        .map(|_| {
            let (_, _, l) = r.next_read().unwrap();
            let (_, p) = r.read_response(QPN, Some(vec![0; l as usize]), t0).unwrap();
            (p.psn, p.payload.len() as u32)
        })
        .collect();
    assert_eq!(psns, vec![(50, 1024), (51, 1024), (52, 452)]);
    assert!(r.read_jobs.is_empty());
}

/// The PSNs of every READ response `r` has queued, sent one after another.
fn respond_all(r: &mut Responder, now: Instant) -> Vec<u32> {
    std::iter::from_fn(|| {
        r.read_response(QPN, Some(vec![0; 1024]), now)
            .map(|(_, p)| p.psn)
    })
    .collect()
}

/// The requester asking again for the rest of a READ replaces that READ's job (from the
/// PSN asked on) and keeps a later READ's job behind it.
#[test]
fn a_request_for_the_rest_of_a_read_replaces_its_job_only() {
    let t0 = Instant::now();
    let mut r = Responder::new(t0);
    queue_read(&mut r, 50, 4096, t0);
    queue_read(&mut r, 54, 1024, t0);
    for _ in 0..3 {
        r.read_response(QPN, Some(vec![0; 1024]), t0).unwrap();
    }
    // PSN 51 was lost: the rest, 3 KiB from 51.
    queue_read(&mut r, 51, 3072, t0);
    assert_eq!(r.read_jobs.len(), 2);
    assert_eq!(respond_all(&mut r, t0), vec![51, 52, 53, 54]);
}

/// A READ asked again after its job ended goes before a later READ being answered.
#[test]
fn a_read_asked_again_after_its_job_ended_goes_first() {
    let t0 = Instant::now();
    let mut r = Responder::new(t0);
    queue_read(&mut r, 50, 1024, t0);
    queue_read(&mut r, 51, 2048, t0);
    for _ in 0..2 {
        r.read_response(QPN, Some(vec![0; 1024]), t0).unwrap();
    }
    queue_read(&mut r, 50, 1024, t0);
    assert_eq!(respond_all(&mut r, t0), vec![50, 52]);
}

#[test]
fn a_read_whose_memory_went_away_ends_with_one_access_nak() {
    let t0 = Instant::now();
    let mut r = Responder::new(t0);
    queue_read(&mut r, 5, 4096, t0);
    r.read_response(QPN, Some(vec![0; 1024]), t0);
    let (_, nak) = r.read_response(QPN, None, t0).unwrap();
    assert_eq!(
        (nak.op, nak.syndrome, nak.psn),
        (wire::OP_NAK, wire::NAK_REM_ACCESS, 5)
    );
    assert!(r.read_jobs.is_empty());
}

#[test]
fn a_responder_flush_completes_the_landing_receive_first() {
    let mut r = Responder::new(Instant::now());
    r.cur_recv = Some(CurRecv {
        wr_id: 9,
        segs: Vec::new(),
        pid: 1,
        cq: 4,
    });
    r.rq.extend((1..3).map(|wr_id| RecvWr {
        wr_id,
        sges: Vec::new(),
    }));
    let wcs: Vec<(u32, u64)> = r
        .flush(QPN, 3)
        .iter()
        .map(|(cq, w)| (*cq, w.wr_id))
        .collect();
    assert_eq!(wcs, vec![(4, 9), (3, 1), (3, 2)]);
    assert!(r.rq.is_empty() && r.cur_recv.is_none());
}
