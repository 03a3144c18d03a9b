//! The engine's side of AUSS in ACKs ([`crate::auss`]; docs/softrnic-congestion.md): as
//! responder it feeds its host's active unique senders from the in-order requests of other
//! hosts, stamps `N`, epoch and incarnation into its ACKs to them and notifies every active
//! sender when `N` changes; as requester it keeps the newest stamp per destination host,
//! refusing stale, forged and malformed ones, and publishes it in the table programs read
//! (`drum_table::nic_auss`).

use super::*;
use crate::auss::timeline::Timeline;
use crate::auss::{ActiveSenders, Applied, Latest, Request, Stamp};
use drum_table::nic_auss::Writer;

/// The NIC's AUSS (None in `on`: off, the default).
#[derive(Default)]
pub(super) struct NicAuss {
    on: Option<On>,
    pub(super) counters: AussCounters,
}

struct On {
    set: ActiveSenders<SocketAddr>,
    latest: Latest<Ipv4Addr>,
    table: Writer,
    /// The set's clock is the time since this instant, which is `origin_ns` on
    /// CLOCK_MONOTONIC (the timeline's clock, every engine's).
    origin: Instant,
    origin_ns: u64,
    timeline: Timeline,
    /// The silence that ends a spell of data to a destination in the timeline: the END hold
    /// (a queue empty for less is not a stop either), at least 100 µs.
    gap_ns: u64,
}

impl On {
    fn ns(&self, at: Instant) -> u64 {
        self.origin_ns + at.saturating_duration_since(self.origin).as_nanos() as u64
    }
}

/// The counters `softrnic stats` prints (with AUSS on).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct AussCounters {
    /// This host as receiver: its `N` and epoch now, ACKs stamped, notifications sent.
    pub n: u64,
    pub epoch: u64,
    pub stamped_acks: u64,
    pub notifications_sent: u64,
    /// This host as sender: stamps (in ACKs and notifications) that were newer than what
    /// it had, repeated the epoch it had, or were older (refused).
    pub stamps_newer: u64,
    pub stamps_same: u64,
    pub stamps_stale: u64,
    /// Refused: a stamp that does not parse or cannot be (length, tag, incarnation 0, `N`
    /// beyond the other hosts, another `N` for an epoch it had), or a notification from an
    /// address this host has no connected QP to.
    pub refused_malformed: u64,
    pub refused_forged: u64,
    /// Destinations the table had no slot left for.
    pub table_full: u64,
}

impl AussCounters {
    pub fn lines(&self) -> String {
        [
            ("auss_n", self.n),
            ("auss_epoch", self.epoch),
            ("auss_stamped_acks", self.stamped_acks),
            ("auss_notifications_sent", self.notifications_sent),
            ("auss_stamps_newer", self.stamps_newer),
            ("auss_stamps_same", self.stamps_same),
            ("auss_stamps_stale", self.stamps_stale),
            ("auss_refused_malformed", self.refused_malformed),
            ("auss_refused_forged", self.refused_forged),
            ("auss_table_full", self.table_full),
        ]
        .iter()
        .map(|(k, v)| format!("{k} {v}\n"))
        .collect()
    }
}

/// Where a sender host is known in the set: its IPv4 address.
fn sender_id(ip: Ipv4Addr) -> u64 {
    u64::from(u32::from(ip))
}

impl NicAuss {
    /// AUSS on as `nic` says, publishing into a new table at `table`. `origin`: one moment
    /// read twice, as an `Instant` and as `CLOCK_MONOTONIC` ns (the timeline's time base,
    /// which every engine of the run shares), back to back: a gap between the two readings
    /// would shift this engine's timeline against the others'. `incarnation` must grow across
    /// restarts of the engine (as the agents' do) and not be 0 (`host_io::incarnation`).
    pub(super) fn on(
        nic: &NicConfig,
        table: &std::path::Path,
        (origin, origin_ns): (Instant, u64),
        incarnation: u64,
    ) -> io::Result<NicAuss> {
        let expiry = nic.auss_expiry().unwrap_or(Duration::ZERO);
        Ok(NicAuss {
            on: Some(On {
                set: ActiveSenders::new(expiry, nic.auss_hold(), incarnation),
                latest: Latest::default(),
                table: Writer::create(table, nic.payload_bytes_per_s())?,
                origin,
                origin_ns,
                timeline: Timeline::default(),
                gap_ns: nic.auss_hold().max(Duration::from_micros(100)).as_nanos() as u64,
            }),
            counters: AussCounters::default(),
        })
    }

    pub(super) fn is_on(&self) -> bool {
        self.on.is_some()
    }

    /// The counters' and the timeline's lines at `now` (empty with AUSS off).
    pub(super) fn report(&mut self, now: Instant) -> String {
        let counters = self.snapshot();
        let Some((on, c)) = self.on.as_mut().zip(counters) else {
            return String::new();
        };
        let t = on.ns(now);
        on.timeline.silences(t, on.gap_ns);
        c.lines() + &on.timeline.lines()
    }

    /// When the set next has an END to apply or a sender to expire (the transmitter sleeps
    /// no longer than that, so an END takes effect at its hold's end, not a tick later).
    pub(super) fn next_deadline(&self) -> Option<Instant> {
        let on = self.on.as_ref()?;
        Some(on.origin + on.set.next_deadline()?)
    }

    /// A data packet to `ip` leaves at `now` (for the timeline's spells).
    pub(super) fn data_sent(&mut self, ip: Ipv4Addr, now: Instant) {
        if let Some(on) = self.on.as_mut() {
            let t = on.ns(now);
            on.timeline.data_sent(t, ip, on.gap_ns);
        }
    }

    /// The counters, with `N` and the epoch now.
    pub(super) fn snapshot(&self) -> Option<AussCounters> {
        let on = self.on.as_ref()?;
        let s = on.set.stamp();
        Some(AussCounters {
            n: s.n.into(),
            epoch: s.epoch,
            ..self.counters
        })
    }
}

impl State {
    /// Most senders a receiver here can count: the other hosts of the run.
    fn auss_max_n(&self) -> u32 {
        self.fabric.others()
    }

    /// Responder: `p` from `from` was accepted in order; it may open, refresh or close its
    /// sender's QP in the set. Same-host traffic does not cross the port and is not counted;
    /// nor are READ and atomic requests, whose data flows to the requester.
    pub(super) fn auss_request(&mut self, from: SocketAddr, p: &Packet, now: Instant) {
        let SocketAddr::V4(v4) = from else { return };
        if !matches!(p.op, wire::OP_SEND | wire::OP_WRITE) {
            return;
        }
        let (Some(on), false) = (self.auss.on.as_mut(), *v4.ip() == self.fabric.me) else {
            return;
        };
        let t = now.saturating_duration_since(on.origin);
        let r = Request {
            sender: sender_id(*v4.ip()),
            qpn: p.src_qpn,
            msg_len: p.msg_len,
            idle: p.flags & wire::F_LAST != 0 && p.flags & wire::F_IDLE != 0,
        };
        let to = on.set.on_request(t, from, r);
        on.timeline
            .count(on.origin_ns + t.as_nanos() as u64, on.set.stamp().n);
        self.auss_notify(to, now);
    }

    /// Applies held ENDs and expires silent senders (from the transmitter's timers).
    pub(super) fn auss_tick(&mut self, now: Instant) {
        let Some(on) = self.auss.on.as_mut() else {
            return;
        };
        let t = now.saturating_duration_since(on.origin);
        if on.set.next_deadline().is_none_or(|d| d > t) {
            return;
        }
        let to = on.set.tick(t);
        on.timeline
            .count(on.origin_ns + t.as_nanos() as u64, on.set.stamp().n);
        self.auss_notify(to, now);
    }

    fn auss_notify(&mut self, to: Vec<SocketAddr>, now: Instant) {
        let Some(stamp) = self.auss.on.as_ref().map(|on| on.set.stamp()) else {
            return;
        };
        for dst in to {
            self.auss.counters.notifications_sent += 1;
            let p = Packet {
                op: wire::OP_AUSS,
                payload: stamp.encode().into(),
                ..Default::default()
            };
            self.emit(dst, p, now);
        }
    }

    /// Responder: the stamp for an ACK to `to` (None: AUSS off, or `to` on this host).
    pub(super) fn auss_stamp_for(&mut self, to: SocketAddr) -> Option<Payload> {
        let on = self.auss.on.as_ref()?;
        if to.ip() == self.fabric.me {
            return None;
        }
        self.auss.counters.stamped_acks += 1;
        Some(on.set.stamp().encode().into())
    }

    /// Requester: a notification from `from`. Only a host this one has a connected QP to
    /// sends it any; anything else is forged.
    pub(super) fn auss_notified(&mut self, from: SocketAddr, p: &Packet, now: Instant) {
        if self.auss.on.is_none() {
            self.counters.rx_dropped_malformed += 1;
            return;
        }
        let connected = self.qps.values().any(|q| q.remote == Some(from));
        if !connected || p.dst_qpn != 0 || p.src_qpn != 0 {
            self.auss.counters.refused_forged += 1;
            return;
        }
        self.auss_stamp_in(from, &p.payload, now);
    }

    /// Requester: the stamp of an ACK (whose QP's peer check it passed) or notification.
    pub(super) fn auss_stamp_in(&mut self, from: SocketAddr, b: &[u8], now: Instant) {
        let max_n = self.auss_max_n();
        let (Some(on), SocketAddr::V4(v4)) = (self.auss.on.as_mut(), from) else {
            return;
        };
        let c = &mut self.auss.counters;
        let stamp = match Stamp::decode(b, max_n) {
            Ok(s) => s,
            Err(_) => {
                c.refused_malformed += 1;
                return;
            }
        };
        match on.latest.apply(*v4.ip(), stamp) {
            Applied::Newer => {
                c.stamps_newer += 1;
                let t = on.ns(now);
                on.timeline.cap(t, *v4.ip(), stamp.n);
                if !on
                    .table
                    .publish(*v4.ip(), stamp.n, stamp.epoch, stamp.incarnation)
                {
                    c.table_full += 1;
                }
            }
            Applied::Same => c.stamps_same += 1,
            Applied::Stale => c.stamps_stale += 1,
            Applied::Conflicting => c.refused_malformed += 1,
        }
    }

    /// Requester: the active senders the newest stamp from destination `ip` counts.
    pub(super) fn auss_n_for(&self, ip: Ipv4Addr) -> Option<u32> {
        Some(self.auss.on.as_ref()?.latest.get(ip)?.n)
    }

    /// Requester: the newest stamp of destination `ip` (tests).
    #[cfg(test)]
    pub(super) fn auss_latest(&self, ip: Ipv4Addr) -> Option<Stamp> {
        self.auss.on.as_ref()?.latest.get(ip)
    }
}
