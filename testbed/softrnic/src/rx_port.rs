//! The receive port of an engine's NIC: packets arriving at the host are serialised at the
//! line rate through an ingress buffer, so several senders into one host queue there.
//!
//! The queue is kept as a clock, as the transmit pipeline is: `drained_at` is when the port
//! will have put every accepted byte through; the depth an arriving packet sees is the time
//! left until then at the line rate. A packet arrives when its sender's line could have
//! delivered it: not before it was received, and not before the previous packet of the same
//! sender plus its own wire time. Receipt times alone are not arrival times: engines send in
//! bursts of a scheduling quantum and a receiving engine that was descheduled reads a backlog
//! at once, so one sender at line rate looked like a queue of megabytes (measured: 2.9 MB,
//! pauses, half the rate). A single sender therefore never queues, and N senders at line rate
//! fill the queue at N − 1 times it. The model decides, from that state and `now`, what
//! happens to each arriving packet:
//!
//! - below the ECN threshold it is accepted; at or above, accepted and marked (the CE bit a
//!   switch or the NIC would set, which the notification point answers with a CNP);
//! - an accepted packet waits for the queue ahead of it: the engine hands it on only after
//!   that time, so N senders into one host share its line in the time they take, not only in
//!   the port's accounts. The wait is counted from the packet's arrival, not from its
//!   receipt, and leaves out other senders' packets that arrive after it by their lines: a
//!   sender that ran ahead of its line (a transmitter making up for time it was descheduled)
//!   is neither held back for it nor holds others back with it, so one sender's throughput
//!   is as it was and a queue is what several senders form together;
//! - when it does not fit into the buffer, a lossless port (InfiniBand credits, PFC-protected
//!   RoCE) holds its sender back: the packet is accepted — it has already left the sending
//!   engine — and the sender is paused for the time the queue needs to drain to half the
//!   buffer (the resume mark, PFC's XON); a lossy port drops it.
//!
//! No clocks, sockets or threads here: the engine passes `now` and sends the pauses.

use crate::due::DueQueue;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// The receive port's parameters (see docs/softrnic-congestion.md for the defaults).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RxPortConfig {
    /// Line rate in Gb/s; 0 = unlimited (the port never queues).
    pub line_rate_gbps: f64,
    /// Ingress buffer in bytes.
    pub buffer_bytes: u64,
    /// Queue depth in bytes at or above which arriving packets are marked; 0 = never.
    pub ecn_threshold_bytes: u64,
    /// Drop what does not fit instead of pausing its sender.
    pub lossy: bool,
}

/// What happens to one arriving packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Taken into the queue; `mark`: congestion experienced; `pause`: hold the sender back
    /// for this long (lossless port, buffer full), None when it is not to be told again;
    /// `wait`: the time the queue ahead of it needs (zero for a lone sender).
    Accept {
        mark: bool,
        pause: Option<Duration>,
        wait: Duration,
    },
    /// Dropped (lossy port, buffer full).
    Drop,
}

/// The port's counters, printed by `softrnic stats`.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct RxPortCounters {
    pub arrivals: u64,
    /// Largest depth an arriving packet found, and the sum of the depths found (mean =
    /// sum / arrivals: the queue as arriving packets see it).
    pub depth_max_bytes: u64,
    pub depth_sum_bytes: u128,
    pub ecn_marked: u64,
    /// Pauses sent and the time they held senders back.
    pub pauses: u64,
    pub pause_ns: u64,
    pub dropped: u64,
    /// Pauses from other hosts' receive ports that held this NIC's transmitter back.
    pub pauses_received: u64,
    /// Packets that waited for the queue ahead of them, and the time they waited.
    pub waited: u64,
    pub wait_ns: u64,
}

impl RxPortCounters {
    pub fn depth_mean_bytes(&self) -> u64 {
        if self.arrivals == 0 {
            return 0;
        }
        (self.depth_sum_bytes / self.arrivals as u128) as u64
    }

    /// `name value` lines for the stats file.
    pub fn lines(&self) -> String {
        format!(
            "rx_port_arrivals {}\nrx_queue_max_bytes {}\nrx_queue_mean_bytes {}\n\
             rx_ecn_marked {}\nrx_pauses {}\nrx_pause_ns {}\nrx_port_dropped {}\n\
             pauses_received {}\nrx_waited {}\nrx_wait_ns {}\n",
            self.arrivals,
            self.depth_max_bytes,
            self.depth_mean_bytes(),
            self.ecn_marked,
            self.pauses,
            self.pause_ns,
            self.dropped,
            self.pauses_received,
            self.waited,
            self.wait_ns
        )
    }
}

#[derive(Debug)]
pub struct RxPort {
    cfg: RxPortConfig,
    drained_at: Option<Instant>,
    /// When the port's current run of back-to-back bytes began (Dart's receiver asks whether
    /// it sees line rate: it does for as long as the queue has not emptied).
    busy_since: Option<Instant>,
    /// Each sender's last arrival, and its earliest next one (the last plus that packet's
    /// wire time).
    next_from: HashMap<SocketAddr, (Instant, Instant)>,
    /// Until when each sender is known to be paused: one pause per sender at a time, as a
    /// PFC port refreshes its pause rather than sending one per frame.
    paused_until: HashMap<SocketAddr, Instant>,
    pub counters: RxPortCounters,
}

impl RxPort {
    pub fn new(cfg: RxPortConfig) -> Self {
        RxPort {
            cfg,
            drained_at: None,
            busy_since: None,
            next_from: HashMap::new(),
            paused_until: HashMap::new(),
            counters: RxPortCounters::default(),
        }
    }

    fn ns_of(&self, bytes: u64) -> u64 {
        (bytes as f64 * 8.0 / self.cfg.line_rate_gbps) as u64
    }

    fn bytes_of(&self, d: Duration) -> u64 {
        (d.as_nanos() as f64 * self.cfg.line_rate_gbps / 8.0) as u64
    }

    /// Bytes queued at `now`.
    pub fn depth(&self, now: Instant) -> u64 {
        match self.drained_at {
            Some(t) if self.cfg.line_rate_gbps > 0.0 => {
                self.bytes_of(t.saturating_duration_since(now))
            }
            _ => 0,
        }
    }

    /// How long the port has been putting bytes through back to back, at the line rate, up
    /// to `now`; zero when it is idle at `now`.
    pub fn busy_for(&self, now: Instant) -> Duration {
        match (self.busy_since, self.drained_at) {
            (Some(since), Some(drained)) if drained > now => now.saturating_duration_since(since),
            _ => Duration::ZERO,
        }
    }

    /// A packet of `wire_bytes` (datagram and its Ethernet/IP/UDP headers) from `from`
    /// arrives at `now`.
    pub fn arrive(&mut self, now: Instant, from: SocketAddr, wire_bytes: u64) -> Verdict {
        if self.cfg.line_rate_gbps <= 0.0 {
            return Verdict::Accept {
                mark: false,
                pause: None,
                wait: Duration::ZERO,
            };
        }
        let wire = Duration::from_nanos(self.ns_of(wire_bytes));
        let at = self
            .next_from
            .get(&from)
            .map_or(now, |&(_, next)| next.max(now));
        let depth = self.depth(at);
        let c = &mut self.counters;
        c.arrivals += 1;
        c.depth_max_bytes = c.depth_max_bytes.max(depth);
        c.depth_sum_bytes += depth as u128;
        let overflow = (depth + wire_bytes).saturating_sub(self.cfg.buffer_bytes);
        if overflow > 0 && self.cfg.lossy {
            self.counters.dropped += 1;
            return Verdict::Drop;
        }
        self.next_from.insert(from, (at, at + wire));
        let mark = self.cfg.ecn_threshold_bytes > 0 && depth >= self.cfg.ecn_threshold_bytes;
        if mark {
            self.counters.ecn_marked += 1;
        }
        let start = self.drained_at.map_or(at, |t| t.max(at));
        // The queue is kept in the order packets were received, but a sender whose clock
        // runs ahead (a transmitter making up for time it was descheduled) has queued
        // packets that arrive, by its line, after this one: they are not ahead of it. (Up to
        // its last arrival; that packet's own wire time is left ahead, within one packet.)
        let later: Duration = self
            .next_from
            .iter()
            .filter(|&(&other, _)| other != from)
            .map(|(_, &(last, _))| last.saturating_duration_since(at))
            .sum();
        let wait = (start - at).saturating_sub(later);
        if !wait.is_zero() {
            self.counters.waited += 1;
            self.counters.wait_ns += wait.as_nanos() as u64;
        }
        if self.drained_at.is_none_or(|t| t < at) {
            // The queue had emptied before this packet: a new run at line rate starts.
            self.busy_since = Some(at);
        }
        self.drained_at = Some(start + wire);
        let mut pause = None;
        if overflow > 0 {
            // Until the queue has drained to the resume mark (PFC's XON), counted from the
            // packet's arrival, which is ahead of `now` when the sender ran ahead. Pausing
            // only until the packet fits paused every sender once per packet, and each
            // pause came a feedback delay late (a receiving engine's wake-up: up to
            // milliseconds on a loaded machine), so the queue stood above the buffer
            // (measured: mean 2.4 MB in a 2 MB buffer, one pause per two packets).
            let resume_at = self.cfg.buffer_bytes / 2;
            let until = at + Duration::from_nanos(self.ns_of(depth + wire_bytes - resume_at));
            let hold = until.saturating_duration_since(now);
            let held_until = self.paused_until.get(&from).copied();
            if held_until.is_none_or(|t| t < until) {
                // Only the part beyond a pause already in effect is new holding time.
                let from_t = held_until.map_or(now, |t| t.max(now));
                self.counters.pause_ns += until.saturating_duration_since(from_t).as_nanos() as u64;
                self.counters.pauses += 1;
                self.paused_until.insert(from, until);
                pause = Some(hold);
            }
        }
        Verdict::Accept { mark, pause, wait }
    }
}

/// The packets a port holds while they wait for the queue ahead of them. Each sender's
/// packets leave in the order they came (one QP's reordered packets would be NAKed); packets
/// of different senders leave when each is due.
#[derive(Debug)]
pub struct DelayLine<T> {
    held: DueQueue<(SocketAddr, T)>,
    /// Each sender's packets held: the due time of its last one, and how many.
    senders: HashMap<SocketAddr, (Instant, usize)>,
}

impl<T> Default for DelayLine<T> {
    fn default() -> Self {
        DelayLine {
            held: DueQueue::default(),
            senders: HashMap::new(),
        }
    }
}

impl<T> DelayLine<T> {
    /// Whether a packet of `from` is held.
    pub fn holds(&self, from: SocketAddr) -> bool {
        self.senders.contains_key(&from)
    }

    /// Holds `item` from `from` until `due`, or until the one ahead of it from the same
    /// sender leaves if that is later.
    pub fn push(&mut self, from: SocketAddr, due: Instant, item: T) {
        let sender = self.senders.entry(from).or_insert((due, 0));
        let due = sender.0.max(due);
        *sender = (due, sender.1 + 1);
        self.held.push(due, (from, item));
    }

    /// The next item whose time has come at `now`, with its sender.
    pub fn pop_due(&mut self, now: Instant) -> Option<(SocketAddr, T)> {
        let (from, item) = self.held.pop_due(now)?;
        if let Some(sender) = self.senders.get_mut(&from) {
            sender.1 -= 1;
            if sender.1 == 0 {
                self.senders.remove(&from);
            }
        }
        Some((from, item))
    }

    /// When the next item is due.
    pub fn next_due(&self) -> Option<Instant> {
        self.held.next_due()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn port(lossy: bool) -> RxPort {
        // 8 Gb/s: one byte per ns, so depths and times read alike.
        RxPort::new(RxPortConfig {
            line_rate_gbps: 8.0,
            buffer_bytes: 10_000,
            ecn_threshold_bytes: 4_000,
            lossy,
        })
    }

    fn peer(n: u8) -> SocketAddr {
        SocketAddr::from(([10, 77, 0, n], 4791))
    }

    fn accept(mark: bool) -> Verdict {
        Verdict::Accept {
            mark,
            pause: None,
            wait: Duration::ZERO,
        }
    }

    /// The port's verdict with its wait left out (tested on its own).
    fn arrive(p: &mut RxPort, now: Instant, from: SocketAddr, bytes: u64) -> Verdict {
        match p.arrive(now, from, bytes) {
            Verdict::Accept { mark, pause, .. } => Verdict::Accept {
                mark,
                pause,
                wait: Duration::ZERO,
            },
            drop => drop,
        }
    }

    #[test]
    fn one_sender_never_queues_even_when_its_packets_are_read_in_a_burst() {
        let mut p = port(false);
        let t0 = Instant::now();
        for i in 0..100u64 {
            let v = arrive(&mut p, t0 + Duration::from_nanos(i * 1000), peer(1), 1000);
            assert_eq!(v, accept(false));
        }
        // A backlog of 50 packets read at one instant: they arrived at the sender's line rate.
        let t1 = t0 + Duration::from_millis(1);
        for _ in 0..50 {
            assert_eq!(arrive(&mut p, t1, peer(1), 1000), accept(false));
        }
        assert_eq!(p.counters.depth_max_bytes, 0);
        assert_eq!(p.counters.pauses, 0);
    }

    #[test]
    fn two_senders_at_line_rate_queue_mark_and_pause() {
        let mut p = port(false);
        let t0 = Instant::now();
        let mut verdicts = Vec::new();
        for i in 0..12u64 {
            let now = t0 + Duration::from_nanos(i * 1000);
            verdicts.push(arrive(&mut p, now, peer(1), 1000));
            verdicts.push(arrive(&mut p, now, peer(2), 1000));
        }
        // The queue grows by 1,000 bytes per µs: at µs i the first packet finds 1,000·i
        // bytes, the second 1,000·(i + 1).
        assert_eq!(verdicts[0], accept(false));
        assert_eq!(verdicts[1], accept(false));
        // i = 3, second packet: finds 4,000 = the threshold.
        assert_eq!(verdicts[6], accept(false));
        assert_eq!(verdicts[7], accept(true));
        // i = 9, second packet: finds 10,000 and does not fit → paused until the queue,
        // 11,000 with it, has drained to 5,000: 6 µs.
        assert_eq!(verdicts[18], accept(true));
        assert_eq!(
            verdicts[19],
            Verdict::Accept {
                mark: true,
                pause: Some(Duration::from_nanos(6000)),
                wait: Duration::ZERO,
            }
        );
        // i = 10, first packet: finds 10,000 → until 10 + 6 µs. From then on every packet
        // over the buffer extends its sender's pause.
        assert_eq!(
            verdicts[20],
            Verdict::Accept {
                mark: true,
                pause: Some(Duration::from_nanos(6000)),
                wait: Duration::ZERO,
            }
        );
        assert_eq!(p.counters.depth_max_bytes, 12_000);
        assert_eq!(p.counters.depth_mean_bytes(), 6_000);
        assert_eq!(p.counters.ecn_marked, 24 - 7);
        assert_eq!(p.counters.dropped, 0);
        assert_eq!(p.counters.pauses, 5);
    }

    #[test]
    fn lossy_port_drops_what_does_not_fit_and_keeps_the_rest() {
        let mut p = port(true);
        let t0 = Instant::now();
        // Eleven senders at once: ten packets fit into 10,000 bytes, the eleventh is dropped.
        let v: Vec<_> = (1..=11)
            .map(|n| arrive(&mut p, t0, peer(n), 1000))
            .collect();
        assert!(v[..10].iter().all(|v| matches!(v, Verdict::Accept { .. })));
        assert_eq!(v[10], Verdict::Drop);
        assert_eq!(p.counters.dropped, 1);
        assert_eq!(p.counters.pauses, 0);
        // 1 µs later one packet has drained: one fits again (the dropped sender's line was
        // not taken by what was dropped).
        let t1 = t0 + Duration::from_nanos(1000);
        assert!(matches!(
            arrive(&mut p, t1, peer(11), 1000),
            Verdict::Accept { .. }
        ));
        assert_eq!(arrive(&mut p, t1, peer(12), 1000), Verdict::Drop);
    }

    #[test]
    fn a_sender_is_paused_once_per_pause_and_pause_time_is_not_double_counted() {
        let mut p = port(false);
        let t0 = Instant::now();
        for n in 1..=10 {
            arrive(&mut p, t0, peer(n), 1000);
        }
        // Peer 11 finds 10,000: paused until 11,000 − 5,000 have drained, 6 µs.
        let paused = |ns| Verdict::Accept {
            mark: true,
            pause: Some(Duration::from_nanos(ns)),
            wait: Duration::ZERO,
        };
        assert_eq!(arrive(&mut p, t0, peer(11), 1000), paused(6000));
        // Its next packet arrives 1 µs later by its line and finds 10,000: until
        // 1 + 6 = 7 µs, 1 µs more holding time.
        assert_eq!(arrive(&mut p, t0, peer(11), 1000), paused(7000));
        // A zero-length one 2 µs in finds 10,000 and fits: no pause.
        assert_eq!(
            arrive(&mut p, t0, peer(11), 0),
            Verdict::Accept {
                mark: true,
                pause: None,
                wait: Duration::ZERO,
            }
        );
        assert_eq!(p.counters.pauses, 2);
        assert_eq!(p.counters.pause_ns, 7000);
    }

    #[test]
    fn the_port_is_busy_while_its_queue_has_not_emptied() {
        let mut p = port(false);
        let t0 = Instant::now();
        let us = |n| t0 + Duration::from_micros(n);
        assert_eq!(p.busy_for(t0), Duration::ZERO);
        // One sender at exactly the line rate (1,000 bytes per µs): one run, never a gap.
        for i in 0..10 {
            arrive(&mut p, us(i), peer(1), 1000);
        }
        assert_eq!(p.busy_for(us(9)), Duration::from_micros(9));
        // Drained at 10 µs: idle after it.
        assert_eq!(p.busy_for(us(10)), Duration::ZERO);
        // A packet after the gap starts a new run.
        arrive(&mut p, us(12), peer(1), 1000);
        assert_eq!(p.busy_for(us(12)), Duration::ZERO);
        arrive(&mut p, us(12), peer(2), 1000);
        assert_eq!(
            p.busy_for(us(12) + Duration::from_nanos(1500)),
            Duration::from_nanos(1500)
        );
    }

    fn wait_of(v: Verdict) -> Duration {
        match v {
            Verdict::Accept { wait, .. } => wait,
            Verdict::Drop => panic!("dropped"),
        }
    }

    #[test]
    fn a_packet_waits_for_the_queue_other_senders_formed_ahead_of_it_and_a_lone_one_never() {
        let mut p = port(false);
        let t0 = Instant::now();
        let us = |n| t0 + Duration::from_micros(n);
        // Two senders at line rate: the queue grows by 1 µs each µs, and each packet waits
        // for what is ahead of it.
        let mut waits = Vec::new();
        for i in 0..10 {
            waits.push(wait_of(p.arrive(us(i), peer(1), 1000)).as_micros());
            waits.push(wait_of(p.arrive(us(i), peer(2), 1000)).as_micros());
        }
        assert_eq!(waits[..6], [0, 1, 1, 2, 2, 3]);
        assert_eq!(waits[18..], [9, 10]);
        assert_eq!(p.counters.waited, 19);
        assert_eq!(p.counters.wait_ns, 100_000);
        // Drained by 100 µs. A sender read in a burst ahead of its line (a transmitter
        // making up for lost time): it never waits behind itself, ...
        for _ in 0..5 {
            assert_eq!(wait_of(p.arrive(us(100), peer(1), 1000)), Duration::ZERO);
        }
        // ... and holds back another sender's packet arriving with its first only for that
        // one: the other four arrive after it, by their sender's line.
        assert_eq!(
            wait_of(p.arrive(us(100), peer(2), 1000)),
            Duration::from_micros(1)
        );
    }

    #[test]
    fn the_delay_line_keeps_each_senders_order_and_lets_senders_pass_each_other() {
        let t0 = Instant::now();
        let us = |n| t0 + Duration::from_micros(n);
        let mut d = DelayLine::default();
        assert!(!d.holds(peer(1)));
        d.push(peer(1), us(5), 'a');
        // due sooner, but behind its sender's 'a'
        d.push(peer(1), us(1), 'b');
        // another sender's, due sooner: leaves first
        d.push(peer(2), us(2), 'x');
        d.push(peer(1), us(9), 'c');
        assert!(d.holds(peer(1)) && d.holds(peer(2)));
        assert_eq!(d.next_due(), Some(us(2)));
        assert_eq!(d.pop_due(us(1)), None);
        assert_eq!(d.pop_due(us(4)), Some((peer(2), 'x')));
        assert!(!d.holds(peer(2)));
        assert_eq!(d.pop_due(us(4)), None);
        assert_eq!(d.pop_due(us(5)), Some((peer(1), 'a')));
        assert_eq!(d.pop_due(us(5)), Some((peer(1), 'b')));
        assert_eq!(d.pop_due(us(5)), None);
        assert_eq!(d.next_due(), Some(us(9)));
        assert_eq!(d.pop_due(us(10)), Some((peer(1), 'c')));
        assert!(!d.holds(peer(1)));
        assert_eq!(d.next_due(), None);
    }

    #[test]
    fn unlimited_port_counts_nothing() {
        let mut p = RxPort::new(RxPortConfig {
            line_rate_gbps: 0.0,
            buffer_bytes: 0,
            ecn_threshold_bytes: 1,
            lossy: true,
        });
        let t0 = Instant::now();
        assert_eq!(arrive(&mut p, t0, peer(1), 9000), accept(false));
        assert_eq!(p.counters, RxPortCounters::default());
    }
}
