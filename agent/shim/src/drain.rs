//! Draining the software send queues: the engine thread's passes over the QPs listed as
//! pending (`govern::PENDING`), and an application thread that finds its CQ empty while work
//! is held back posting what is due itself. Each pass serves a QP's queue as far as the gate
//! and the limiters admit; a held-back WR the provider refuses becomes an error completion
//! in the QP's virtual send CQ (`vcq::fail_send`), after the completions of earlier WRs.

use crate::context::{lookup, ContextState, COLD};
use crate::ffi::*;
use crate::govern::{gate_allows, qp_id, settle, tracked, PENDING};
use crate::limits::{admit, empty_poll_pause, now_ps, LIMITS};
use crate::qp::QpRecord;
use crate::stats::{QUEUED, STATS};
use crate::trouble::{warn_once, Trouble};
use crate::vcq;
use std::ptr;
use std::sync::atomic::Ordering::Relaxed;

/// The app found its CQ empty. While the shim holds some of its work back (WRs, or
/// completions beyond its polling grant), spinning on the CQ gains nothing — what it waits
/// for comes only at the granted rate — so the poller sleeps: until the limiters' next slot
/// (nothing the shim holds can complete before it), at least 20 µs and at most 1 ms
/// (`limits::empty_poll_pause`). A throttled busy-poller thus stops crowding out its
/// neighbours and the shim's own engine on a small host (`sched_yield` alone did not: the
/// scheduler hands the CPU straight back).
pub fn on_empty_poll(completions_held: bool) {
    if completions_held || QUEUED.load(Relaxed) > 0 {
        std::thread::sleep(empty_poll_pause(now_ps()));
        if QUEUED.load(Relaxed) > 0 {
            help_drain();
        }
    }
}

/// Serves one QP's queue from the engine: posts what the gate and limiters admit now.
/// Returns `Some(wait_ps)` when its head must wait for the limiters, `None` when the queue
/// is empty or the QP waits for a gate slot (it is listed again when it gets one).
fn serve(st: &ContextState, q: &QpRecord, qpn: u32) -> Option<u64> {
    let orig = st.orig.post_send?;
    let mut g = q.gov.lock().unwrap_or_else(|e| e.into_inner());
    let id = qp_id(st.index, qpn);
    let mut wait = None;
    // A holder keeps its slot until `settle` releases it, which needs this QP's lock: asked
    // once for the whole pass.
    let gate_open = g.queue.is_empty() || gate_allows(id, now_ps() / 1000);
    loop {
        let now = now_ps();
        let qp = g.qp as *mut IbvQp;
        let Some(bytes) = g.queue.front().map(|h| h.bytes) else {
            break;
        };
        if qp.is_null() {
            break;
        }
        if !gate_open {
            break;
        }
        if let Err(w) = admit(now, bytes, g.dest()) {
            wait = Some(w);
            break;
        }
        let head = g.queue.front_mut().expect("head exists");
        let mut bad = ptr::null_mut();
        // SAFETY: the QP is alive (destroying it takes this lock and clears `qp`), and the
        // WR is our own copy.
        let rc = unsafe { orig(qp, head.as_wr(), &mut bad) };
        let o = g.queue.pop_front().expect("head exists");
        q.queued.fetch_sub(1, Relaxed);
        QUEUED.fetch_sub(1, Relaxed);
        STATS
            .queue_delay_ns
            .fetch_add((now / 1000).saturating_sub(o.queued_at), Relaxed);
        STATS.deferred_wqes.fetch_add(1, Relaxed);
        if rc == 0 {
            q.send_wqes.fetch_add(1, Relaxed);
            q.send_bytes.fetch_add(o.bytes, Relaxed);
            if o.is_read() {
                q.read_bytes.fetch_add(o.bytes, Relaxed);
            }
            st.counters.send_wqes.fetch_add(1, Relaxed);
            st.counters.send_bytes.fetch_add(o.bytes, Relaxed);
            if LIMITS.tracking.load(Relaxed) {
                tracked(&mut g).on_post(o.signalled);
            }
        } else {
            STATS.deferred_post_errors.fetch_add(1, Relaxed);
            let failed = IbvWc {
                wr_id: o.wr_id(),
                status: IBV_WC_LOC_QP_OP_ERR,
                qp_num: qpn,
                ..IbvWc::default()
            };
            // SAFETY: the QP is alive (as above).
            let told = unsafe { vcq::fail_send(qp, failed) };
            warn_once(
                Trouble::DeferredPost,
                &format!(
                    "the provider refused a held-back work request (wr_id {}, error {rc}); {}",
                    o.wr_id(),
                    if told {
                        "the application gets an error completion for it"
                    } else {
                        "it is dropped, as a device would flush it"
                    }
                ),
            );
        }
    }
    drop(g);
    settle(st, q, qpn);
    wait
}

/// Serves every QP listed as pending once; returns the shortest limiter wait of those that
/// still have work, `None` when none waits on a limiter.
pub fn drain() -> Option<u64> {
    let _g = COLD.lock();
    drain_locked()
}

/// Called by an application thread that has just paused in an empty poll because work is
/// held back: it posts what is due itself rather than wait for the engine thread, which on
/// a loaded machine wakes late, and late posts are a rate the app was granted but lost.
/// Never waits: a cold verb or another drainer busy means the engine thread will do it.
pub fn help_drain() {
    if let Some(_g) = COLD.try_lock() {
        drain_locked();
    }
}

/// [`drain`] with `COLD` held.
fn drain_locked() -> Option<u64> {
    let batch: Vec<(usize, u32)> = PENDING.lock().drain(..).collect();
    if batch.is_empty() {
        return None;
    }
    let mut wait: Option<u64> = None;
    for (key, qpn) in batch {
        let Some(st) = lookup(key as *mut _) else {
            continue;
        };
        let Some(q) = st.qps.get(qpn) else {
            continue;
        };
        q.pending.store(false, Relaxed);
        if let Some(w) = serve(st, q, qpn) {
            wait = Some(wait.map_or(w, |x| x.min(w)));
            if !q.pending.swap(true, Relaxed) {
                PENDING.lock().push_back((key, qpn));
            }
        }
    }
    wait
}
