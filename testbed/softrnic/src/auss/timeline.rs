//! When `N` changed, as each NIC saw it: the timeline `softrnic stats` prints (`auss_log`
//! lines) so a run can time the count's arrival at the senders as Dart does (its Fig. 9(b)),
//! to the nanosecond, where rates over windows cannot resolve a round trip. Pure: times are
//! CLOCK_MONOTONIC ns passed in, shared by every engine of the machine.
//!
//! - `count`: this host as receiver; its `N` became `n`;
//! - `cap`: as sender; the newest stamp of destination `peer` says `N` = `n` (the NIC's limiter
//!   paces at `R/n` from the next packet);
//! - `start` / `stop`: as sender; its first data packet to `peer` after a silence longer than
//!   the gap, and its last one before such a silence (logged once the silence is seen).

pub use drum_table::auss_log::{parse, Event, Kind, KEPT};
use std::collections::{HashMap, VecDeque};
use std::net::Ipv4Addr;

#[derive(Debug, Default)]
pub struct Timeline {
    /// The newest [`KEPT`] events of each class (counts, caps, spells' starts and stops),
    /// kept apart so that a sender's many short spells under CPU starvation cannot push out
    /// the few count and cap changes a run is timed by.
    counts: VecDeque<Event>,
    caps_log: VecDeque<Event>,
    spells: VecDeque<Event>,
    /// Per destination: its last data packet, and whether the silence after it was logged.
    sending: HashMap<Ipv4Addr, (u64, bool)>,
    /// This host's `N` as last logged, and each destination's.
    count: Option<u32>,
    caps: HashMap<Ipv4Addr, u32>,
}

impl Timeline {
    fn push(&mut self, e: Event) {
        let ring = match e.kind {
            Kind::Count => &mut self.counts,
            Kind::Cap => &mut self.caps_log,
            Kind::Start | Kind::Stop => &mut self.spells,
        };
        if ring.len() == KEPT {
            ring.pop_front();
        }
        ring.push_back(e);
    }

    /// This host's `N` is `n` at `t_ns` (logged when it changed).
    pub fn count(&mut self, t_ns: u64, n: u32) {
        if self.count.replace(n) != Some(n) {
            self.push(Event {
                kind: Kind::Count,
                t_ns,
                peer: None,
                n,
            });
        }
    }

    /// The newest stamp of `peer` says `n` at `t_ns` (logged when it changed).
    pub fn cap(&mut self, t_ns: u64, peer: Ipv4Addr, n: u32) {
        if self.caps.insert(peer, n) != Some(n) {
            self.push(Event {
                kind: Kind::Cap,
                t_ns,
                peer: Some(peer),
                n,
            });
        }
    }

    /// A data packet to `peer` left at `t_ns`; `gap` is the silence that ends a spell.
    pub fn data_sent(&mut self, t_ns: u64, peer: Ipv4Addr, gap: u64) {
        let last = self.sending.get(&peer).copied();
        let new_spell = last.is_none_or(|(at, _)| t_ns.saturating_sub(at) > gap);
        if new_spell {
            if let Some((at, false)) = last {
                // a silence `silences` had not looked at yet
                self.stop(peer, at);
            }
            self.push(Event {
                kind: Kind::Start,
                t_ns,
                peer: Some(peer),
                n: 0,
            });
        }
        // (a stop logged, then a packet within the gap after all: the spell goes on, and its
        // stop is logged again when it really falls silent)
        self.sending
            .insert(peer, (t_ns.max(last.map_or(0, |l| l.0)), false));
    }

    /// Logs the stops of destinations silent for longer than `gap` at `now_ns`.
    pub fn silences(&mut self, now_ns: u64, gap: u64) {
        let due: Vec<(Ipv4Addr, u64)> = self
            .sending
            .iter()
            .filter(|(_, (at, stopped))| !stopped && now_ns.saturating_sub(*at) > gap)
            .map(|(p, (at, _))| (*p, *at))
            .collect();
        for (peer, at) in due {
            self.stop(peer, at);
        }
    }

    fn stop(&mut self, peer: Ipv4Addr, at: u64) {
        self.sending.insert(peer, (at, true));
        self.push(Event {
            kind: Kind::Stop,
            t_ns: at,
            peer: Some(peer),
            n: 0,
        });
    }

    /// One `auss_log` line per event, oldest first (a spell's start before its stop when
    /// they fall on one nanosecond).
    pub fn lines(&self) -> String {
        let mut all: Vec<&Event> = self
            .counts
            .iter()
            .chain(&self.caps_log)
            .chain(&self.spells)
            .collect();
        all.sort_by_key(|e| e.t_ns);
        all.into_iter().map(Event::line).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 1);
    const B: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 2);

    #[test]
    fn changes_spells_and_silences_are_logged_once_and_read_back() {
        let mut t = Timeline::default();
        t.count(10, 1);
        t.count(20, 1); // unchanged: not logged
        t.count(30, 2);
        t.cap(40, A, 2);
        t.cap(50, A, 2);
        t.cap(60, B, 1);
        // a spell to A: packets within the gap of 100 ns are one spell
        for at in [100, 150, 240] {
            t.data_sent(at, A, 100);
        }
        t.silences(300, 100); // 60 ns since the last: not yet
        t.silences(400, 100); // now: its stop, at its last packet
        t.silences(500, 100); // once
        t.data_sent(1_000, A, 100); // a new spell
        t.data_sent(1_050, B, 100);
        t.data_sent(2_000, A, 100); // a silence not yet seen by `silences`: stop, then start
        t.data_sent(2_000, A, 100); // more of the same burst: nothing
        t.data_sent(2_050, A, 100);
        let got = parse(&t.lines());
        let kinds: Vec<(Kind, u64, Option<Ipv4Addr>, u32)> =
            got.iter().map(|e| (e.kind, e.t_ns, e.peer, e.n)).collect();
        assert_eq!(
            kinds,
            vec![
                (Kind::Count, 10, None, 1),
                (Kind::Count, 30, None, 2),
                (Kind::Cap, 40, Some(A), 2),
                (Kind::Cap, 60, Some(B), 1),
                (Kind::Start, 100, Some(A), 0),
                (Kind::Stop, 240, Some(A), 0),
                (Kind::Start, 1_000, Some(A), 0),
                (Kind::Stop, 1_000, Some(A), 0),
                (Kind::Start, 1_050, Some(B), 0),
                (Kind::Start, 2_000, Some(A), 0),
            ]
        );
    }

    #[test]
    fn the_log_keeps_the_newest_events_of_each_class_and_skips_other_lines() {
        let mut t = Timeline::default();
        t.cap(0, A, 2);
        for i in 0..(KEPT as u32 + 10) {
            t.count(u64::from(i), i);
        }
        // a flood of one-packet spells pushes out old spells, not the cap or the counts
        for i in 0..(2 * KEPT as u64) {
            t.data_sent(10 * i, B, 1);
        }
        let got = parse(&format!(
            "rx_packets 5\n{}auss_log bogus 1 - 2\n",
            t.lines()
        ));
        let of = |k: Kind| got.iter().filter(|e| e.kind == k).collect::<Vec<_>>();
        assert_eq!(of(Kind::Cap).len(), 1);
        let counts = of(Kind::Count);
        assert_eq!(counts.len(), KEPT);
        assert_eq!(counts[0].n, 10);
        assert_eq!(counts[KEPT - 1].n, KEPT as u32 + 9);
        assert_eq!(of(Kind::Start).len() + of(Kind::Stop).len(), KEPT);
        assert!(got.windows(2).all(|w| w[0].t_ns <= w[1].t_ns));
    }
}
