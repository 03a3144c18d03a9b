//! The one line the shim prints at exit with `DRUM_SHIM_LOG=1`: the process's totals
//! (docs/shim.md shows one).

use crate::context::{self, Totals};
use crate::limits::{self, LIMITS};
use crate::peer_caps::NicCapCounts;
use crate::stats::STATS;
use crate::trouble::write_stderr;
use crate::vcq;
use std::panic::catch_unwind;
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

/// How long the exit summary waits for the shim's locks. Another thread holds one only
/// briefly; the exiting thread itself holds one when `exit` runs in a signal handler that
/// interrupted the shim (qperf's server exits from its SIGQUIT handler, which can arrive
/// while `fork` is in the shim's fork handlers), and then waiting would hang the process.
const EXIT_WAIT: Duration = Duration::from_millis(200);

/// The NIC caps' part of the summary: their counters and whether the NIC's table was found.
pub type NicSummary = (NicCapCounts, bool);

/// The one-line summary printed at exit with `DRUM_SHIM_LOG=1`.
pub fn summary_line(pid: u32, t: &Totals, nic: &NicSummary) -> String {
    let c = &t.counts;
    format!(
        "drum-shim: pid={pid} governed_contexts={} pass_through_contexts={} live_contexts={} \
         qps={} send_wqes={} send_bytes={} recv_wqes={} srq_recv_wqes={} completions={} \
         completion_errors={} poll_calls={} notify_arms={} qp_table_overflow={} counting={} \
         virtual_cqs={} cq_events={} delayed_cq_events={} {}\n",
        t.governed_contexts,
        t.pass_through_contexts,
        t.live_contexts,
        t.qps,
        c.send_wqes,
        c.send_bytes,
        c.recv_wqes,
        c.srq_recv_wqes,
        c.completions,
        c.completion_errors,
        c.poll_calls,
        c.notify_arms,
        t.qp_table_overflow,
        if t.counting_stopped { "stopped" } else { "on" },
        vcq::CREATED.load(Relaxed),
        vcq::EVENTS.load(Relaxed),
        vcq::DELAYED_EVENTS.load(Relaxed),
        governance(t.queued_wqes, nic),
    )
}

/// The governance part of the exit summary.
fn governance(queued: u64, (nic, nic_table): &NicSummary) -> String {
    let [rate_bytes, rate_wqe, rate_cqe] = limits::rates();
    format!(
        "extended_verbs={} direct_verbs_queues={} wr_api_qps={} governed={} grant_generation={} rate_bytes_per_s={} rate_wqe_per_s={} rate_cqe_per_s={} max_active_qps={} \
         direct_wqes={} deferred_wqes={} queue_delay_us={} queued_wqes={} deferred_post_errors={} \
         dropped_wqes={} held_polls={} nic_pacing_sets={} nic_pacing_refusals={} \
         nic_auss_table={} nic_cap_destinations={} nic_cap_stamps={} nic_cap_changes={} \
         paced_wqes={} paced_bytes={} paced_span_us={}",
        crate::extended::USES.load(Relaxed),
        crate::direct::QUEUES_TAKEN.load(Relaxed),
        crate::wr_api::WRAPPED_QPS.load(Relaxed),
        if LIMITS.active.load(Relaxed) {
            "yes"
        } else {
            "no"
        },
        LIMITS.generation.load(Relaxed),
        rate_bytes,
        rate_wqe,
        rate_cqe,
        LIMITS.k.load(Relaxed),
        STATS.direct_wqes.load(Relaxed),
        STATS.deferred_wqes.load(Relaxed),
        STATS.queue_delay_ns.load(Relaxed) / 1000,
        queued,
        STATS.deferred_post_errors.load(Relaxed),
        STATS.dropped_wqes.load(Relaxed),
        STATS.held_polls.load(Relaxed),
        STATS.nic_pacing_sets.load(Relaxed),
        STATS.nic_pacing_refusals.load(Relaxed),
        if *nic_table { "yes" } else { "no" },
        nic.listed,
        nic.stamps,
        nic.changes,
        STATS.paced_wqes.load(Relaxed),
        STATS.paced_bytes.load(Relaxed),
        STATS.paced_span_us(),
    )
}

/// The exit summary, or a line saying why there is none when the shim's state stays locked
/// past `wait`.
fn exit_line(pid: u32, wait: Duration) -> String {
    let deadline = Instant::now() + wait;
    match context::totals_until(deadline).zip(limits::nic_caps_until(deadline)) {
        Some((t, nic)) => summary_line(pid, &t, &nic),
        None => format!(
            "drum-shim: no exit summary for pid {pid}: the shim's state stayed locked for {} ms \
             (exit called from a signal handler that interrupted the shim?)\n",
            wait.as_millis()
        ),
    }
}

extern "C" fn at_exit() {
    let _ = catch_unwind(|| {
        if std::env::var_os("DRUM_SHIM_LOG").is_some_and(|v| v == "1") {
            write_stderr(&exit_line(std::process::id(), EXIT_WAIT));
        }
    });
}

/// Runs at `exit` (after the application's `atexit` handlers, so everything it did is
/// counted); a destructor rather than `atexit` so that it needs no registration call.
#[used]
#[link_section = ".fini_array"]
static FINI: extern "C" fn() = at_exit;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::counters::Snapshot;

    #[test]
    fn summary_is_one_parsable_line() {
        let t = Totals {
            governed_contexts: 1,
            qps: 2,
            counts: Snapshot {
                send_wqes: 5,
                send_bytes: 20480,
                ..Snapshot::default()
            },
            ..Totals::default()
        };
        let s = summary_line(7, &t, &(NicCapCounts::default(), false));
        assert!(s.ends_with('\n') && s.matches('\n').count() == 1, "{s}");
        assert!(
            s.starts_with("drum-shim: pid=7 governed_contexts=1 "),
            "{s}"
        );
        assert!(s.contains(" send_wqes=5 send_bytes=20480 "), "{s}");
        assert!(s.contains(" counting=on virtual_cqs="), "{s}");
        assert!(s.contains(" nic_auss_table=no "), "{s}");
    }

    /// With the cold lock held by the exiting thread (as when `exit` runs in a signal handler
    /// that interrupted a fork handler), the exit line says so instead of waiting for ever.
    #[test]
    fn exit_line_does_not_wait_for_a_lock_its_own_thread_holds() {
        let held = crate::context::COLD.lock();
        let line = exit_line(9, Duration::from_millis(10));
        drop(held);
        assert!(
            line.starts_with("drum-shim: no exit summary for pid 9: "),
            "{line}"
        );
        let line = exit_line(9, Duration::from_millis(10));
        assert!(line.starts_with("drum-shim: pid=9 "), "{line}");
    }
}
