//! What the engine says about itself when something is slow or stuck: who held the NIC's
//! state when another thread waited long for it, the RC QPs that make no progress, and a
//! description of a QP's requester and responder for the log. The lines are queued and
//! written by the housekeeping thread ([`host_io::housekeeping`]), never with the NIC's
//! state held.

use super::*;

/// A QP with work that has made no progress for this long is listed in the stats file.
pub(super) const NO_PROGRESS: Duration = Duration::from_secs(1);

/// Who takes the NIC's state: a wait for it of [`SLOW_LOCK`] or more is logged with the
/// holder's name, since every thread of the engine stops while one holds it.
#[derive(Clone, Copy)]
#[repr(u8)]
pub(super) enum Holder {
    Transmitter,
    Receiver,
    Verbs,
    Connection,
    Housekeeping,
}

impl Holder {
    const NAMES: [&'static str; 5] = [
        "the transmitter",
        "the receiver",
        "a verbs request",
        "a connection's setup or teardown",
        "the stats writer",
    ];

    fn name(i: u8) -> &'static str {
        Self::NAMES.get(usize::from(i)).copied().unwrap_or("?")
    }
}

/// Lines for the engine's log, written by the housekeeping thread: a write to the log file
/// may wait for the disk (see [`host_io::housekeeping`]), never with the NIC's state held.
static LOG_LATER: Mutex<Vec<String>> = Mutex::new(Vec::new());

pub(super) fn log_later(line: String) {
    LOG_LATER
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .push(line);
}

pub(super) fn take_log() -> Vec<String> {
    std::mem::take(&mut *LOG_LATER.lock().unwrap_or_else(|p| p.into_inner()))
}

/// A wait for the NIC's state, or a hand-over of packets to the kernel, this long is logged.
pub(super) const SLOW_LOCK: Duration = Duration::from_millis(200);

impl Shared {
    /// Takes the NIC's state for `who`, logging a wait of [`SLOW_LOCK`] or more with the
    /// name of the last holder.
    pub(super) fn lock(&self, who: Holder) -> MutexGuard<'_, State> {
        let start = Instant::now();
        let g = self.st.lock().unwrap_or_else(|p| p.into_inner());
        let waited = start.elapsed();
        if waited >= SLOW_LOCK {
            log_later(format!(
                "softrnic engine: {} waited {} ms for the NIC's state, last taken by {}",
                Holder::name(who as u8),
                waited.as_millis(),
                Holder::name(self.holder.load(Ordering::Relaxed))
            ));
        }
        self.holder.store(who as u8, Ordering::Relaxed);
        g
    }
}

impl State {
    /// The RC QPs that have work and have made no progress for [`NO_PROGRESS`]: what a
    /// stalled application waits for.
    pub(super) fn no_progress_qps(&self, now: Instant) -> BTreeSet<u32> {
        self.qps
            .iter()
            .filter(|(_, q)| {
                let has_work = q.req.sq_next < q.req.sq.len() || !q.req.inflight.is_empty();
                let requester_stalled =
                    has_work && now.saturating_duration_since(q.req.last_progress) >= NO_PROGRESS;
                let responder_stalled = !q.resp.read_jobs.is_empty()
                    && now.saturating_duration_since(q.resp.responded_at) >= NO_PROGRESS;
                q.qpt == IBV_QPT_RC && (requester_stalled || responder_stalled)
            })
            .map(|(n, _)| *n)
            .collect()
    }

    /// A QP's requester state, for the engine's log.
    pub(super) fn describe_qp(&self, qpn: u32, now: Instant) -> String {
        let Some(q) = self.qps.get(&qpn) else {
            return "gone".into();
        };
        let jobs = q.resp.read_jobs.front().map_or(String::new(), |j| {
            format!(
                "; answering {} READs, the oldest at PSN {} (packet {} of {}), last response \
                 {} ms ago",
                q.resp.read_jobs.len(),
                j.psn,
                j.next,
                j.n,
                now.saturating_duration_since(q.resp.responded_at)
                    .as_millis()
            )
        });
        let nic_busy = self.nic.wait(now).map_or(0, |d| d.as_millis());
        let paced = q.pacer.map_or(String::new(), |p| {
            let due = p
                .ready_at(now)
                .map_or(0, |t| t.saturating_duration_since(now).as_millis());
            format!("; paced at {} kb/s, next packet due in {due} ms", p.kbps())
        });
        format!(
            "NIC busy for {nic_busy} ms{paced}; state {} idle {} ms; send queue {} (next to send {}), {} packets in flight \
             (retransmitting from {:?}, retry {}), READs/atomics waiting for responses {} of {}{jobs}",
            q.state,
            now.saturating_duration_since(q.req.last_progress).as_millis(),
            q.req.sq.len(),
            q.req.sq_next,
            q.req.inflight.len(),
            q.req.resend,
            q.req.retries,
            q.req.reads_atomics_outstanding(),
            super::transport::requester::rd_atomic_limit(q.attr.max_rd_atomic),
        )
    }
}
