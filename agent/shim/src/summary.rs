//! The one line the shim prints at exit with `DRUM_SHIM_LOG=1`: the process's totals
//! (docs/shim.md shows one).

use crate::{govern, totals, vcq, write_stderr, Totals};
use std::panic::catch_unwind;
use std::sync::atomic::Ordering::Relaxed;

/// The one-line summary printed at exit with `DRUM_SHIM_LOG=1`.
pub fn summary_line(pid: u32, t: &Totals) -> String {
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
        govern::summary(t.queued_wqes),
    )
}

extern "C" fn at_exit() {
    let _ = catch_unwind(|| {
        if std::env::var_os("DRUM_SHIM_LOG").is_some_and(|v| v == "1") {
            write_stderr(&summary_line(std::process::id(), &totals()));
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
        let s = summary_line(7, &t);
        assert!(s.ends_with('\n') && s.matches('\n').count() == 1, "{s}");
        assert!(
            s.starts_with("drum-shim: pid=7 governed_contexts=1 "),
            "{s}"
        );
        assert!(s.contains(" send_wqes=5 send_bytes=20480 "), "{s}");
        assert!(s.contains(" counting=on virtual_cqs="), "{s}");
    }
}
