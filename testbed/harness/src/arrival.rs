//! When the count reached the long flow's sender, from the NICs' `auss_log` timelines
//! (`drum_table::auss_log`): Dart's Fig. 9(b) measure. A burst's start is the burst sender's
//! first data packet to the receiver after a silence; the long sender's limiter paces at
//! `R/N` from its `cap` event on, so the time from the one to the other is how long the long
//! flow sent above its fair share. Likewise after a burst's last packet, until the cap
//! returns to `N` = 1 (which includes the receiver's END hold). Pure: events in, µs out.

use drum_table::auss_log::{Event, Kind};

/// Per burst edge, ns from the burst sender's event to the long sender's cap.
#[derive(Debug, Default, PartialEq)]
pub struct Arrivals {
    pub start_ns: Vec<u64>,
    pub end_ns: Vec<u64>,
}

/// A silence of the burst sender at least this long separates two bursts; shorter ones
/// (its transmitter paced or descheduled for a few ms) are within a burst.
pub const BURST_GAP_NS: u64 = 50_000_000;

/// `burst`: the burst sender's `start`/`stop` events towards the receiver; `caps`: the long
/// sender's `cap` events from the receiver (or the receiver's `count` events, for its own
/// part). Both in time order. The burst sender's spells are merged into bursts across
/// silences shorter than [`BURST_GAP_NS`]. A burst's start counts when the cap said one
/// sender before it, its end when the cap said two or more, each timed to the first change
/// the other way before the next burst starts.
pub fn arrivals(burst: &[Event], caps: &[Event]) -> Arrivals {
    let cap_at = |t: u64| {
        caps.iter()
            .take_while(|c| c.t_ns <= t)
            .last()
            .map_or(1, |c| c.n)
    };
    let first_after = |t: u64, until: u64, want: fn(u32) -> bool| {
        caps.iter()
            .find(|c| c.t_ns >= t && c.t_ns < until && want(c.n))
            .map(|c| c.t_ns - t)
    };
    // (first start, last stop) of each burst
    let mut bursts: Vec<(u64, Option<u64>)> = Vec::new();
    for e in burst {
        match (e.kind, bursts.last_mut()) {
            (Kind::Start, Some((_, Some(stop)))) if e.t_ns - *stop < BURST_GAP_NS => {
                bursts.last_mut().expect("a burst").1 = None;
            }
            (Kind::Start, Some((_, None))) => {}
            (Kind::Start, _) => bursts.push((e.t_ns, None)),
            (Kind::Stop, Some(b)) => b.1 = Some(e.t_ns),
            _ => {}
        }
    }
    let mut out = Arrivals::default();
    for (i, &(start, stop)) in bursts.iter().enumerate() {
        let next = bursts.get(i + 1).map_or(u64::MAX, |b| b.0);
        if cap_at(start) < 2 {
            out.start_ns.extend(first_after(start, next, |n| n >= 2));
        }
        if let Some(stop) = stop.filter(|&s| cap_at(s) >= 2) {
            out.end_ns.extend(first_after(stop, next, |n| n == 1));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(kind: Kind, t_ns: u64, n: u32) -> Event {
        Event {
            kind,
            t_ns,
            peer: None,
            n,
        }
    }

    #[test]
    fn each_burst_is_timed_to_the_cap_changes_it_caused() {
        use Kind::*;
        const MS: u64 = 1_000_000;
        let burst = [
            ev(Start, MS, 0),
            ev(Stop, 5 * MS, 0),
            // 100 ms later a burst with pauses of a few ms within it
            ev(Start, 105 * MS, 0),
            ev(Stop, 106 * MS, 0),
            ev(Start, 109 * MS, 0),
            ev(Stop, 120 * MS, 0),
            // a burst whose cap never came, and one still going
            ev(Start, 300 * MS, 0),
            ev(Stop, 301 * MS, 0),
            ev(Start, 400 * MS, 0),
        ];
        let caps = [
            ev(Cap, MS + 150, 2),
            ev(Cap, 6 * MS + 200, 1),
            ev(Cap, 105 * MS + 120, 2),
            ev(Cap, 121 * MS + 100, 1),
            ev(Cap, 400 * MS + 90, 2),
        ];
        assert_eq!(
            arrivals(&burst, &caps),
            Arrivals {
                start_ns: vec![150, 120, 90],
                end_ns: vec![MS + 200, MS + 100],
            }
        );
        assert_eq!(arrivals(&burst, &[]), Arrivals::default());
        // a cap already at two when a burst starts says nothing of that burst
        let stale = [ev(Cap, 0, 2)];
        assert_eq!(arrivals(&burst[..2], &stale).start_ns, Vec::<u64>::new());
    }
}
