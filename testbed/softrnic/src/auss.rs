//! AUSS in the NIC's ACKs (issue 18): the pure part — no I/O, threads or clocks; time is an
//! explicit `now: Duration`. The engine's side is `engine/auss.rs`, the table a shim reads is
//! `drum_table::nic_auss`; docs/softrnic-congestion.md, "AUSS in the NIC's ACKs".
//!
//! - [`ActiveSenders`]: the responder's set per receiving host. It is the agents' AUSS
//!   ([`drum_common::dasr::Auss`], docs/dasr.md) fed from the data path instead of UDP
//!   announcements: a sender host's RC QP busy with a long message is an open "message"
//!   (`msg_id` = the sender's QPN), refreshed by its later packets and ended by the packet
//!   that leaves the sender's send queue empty ([`crate::wire::F_IDLE`]). A sender is counted
//!   once whatever number of QPs it has open; one silent for the expiry leaves (soft state).
//!   An END is held for `hold` and dropped if the QP carries another long message by then:
//!   a queue that runs empty for a moment between messages does not move `N` (twice).
//! - [`Stamp`]: `N`, epoch and incarnation as they travel in ACKs and notifications.
//! - [`Latest`]: the requester's newest stamp per destination, refusing stale epochs.

pub mod timeline;

use drum_common::dasr::{Announce, Auss, AussAction, AussConfig, Phase, SenderId};
use std::collections::BTreeMap;
use std::time::Duration;

/// A message shorter than this does not make its sender active: it is over before a cap
/// could matter (Dart counts long flows only), and a ping-pong of small messages must not
/// flip `N` — and push to every sender — twice per message.
pub const MIN_ACTIVE_MESSAGE: u32 = 32 << 10;

/// The share of the line DASR caps give the senders together: at exactly `R/N` each, the
/// queue a burst's first round trip built never drains (the shim's caps use the same 97 %,
/// docs/shim.md, "Caps from the NIC"). The NIC's limiter keeps it for a lone sender too
/// (`N` = 1): at exactly the line, the queue an emulated transmitter's catch-up bursts build
/// at the receiver never drains either, and a new sender's first packet, and with it the
/// count, waits behind it (docs/testbed.md, "The count's arrival").
pub const DASR_UTILISATION: f64 = 0.97;

/// A sender NIC's cap, in kb/s on the wire, on a QP towards a receiver that counts `n` active
/// senders: Dart's `R/N` of a line of `line_rate_gbps`; None for no sender (no cap) or on
/// an unlimited line.
pub fn dasr_cap_kbps(line_rate_gbps: f64, n: u32) -> Option<u32> {
    (n >= 1 && line_rate_gbps > 0.0).then(|| {
        (line_rate_gbps * 1e6 * DASR_UTILISATION / n as f64).clamp(1.0, u32::MAX as f64) as u32
    })
}

/// Bytes of a stamp on the wire: `tag u32 | n u32 | epoch u64 | incarnation u64`, little
/// endian as the rest of the packet.
pub const STAMP_LEN: usize = 24;
/// The stamp's tag, "AUS1": a format version a later layout would change.
const STAMP_TAG: u32 = u32::from_le_bytes(*b"AUS1");

/// What a receiving host's NIC tells its senders: `n` active unique senders as of `epoch` of
/// the receiver engine's life `incarnation`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stamp {
    pub n: u32,
    pub epoch: u64,
    pub incarnation: u64,
}

/// Why a stamp was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum StampError {
    #[error("AUSS stamp of {0} bytes (it has {STAMP_LEN})")]
    Length(usize),
    #[error("unknown AUSS stamp tag {0:#010x}")]
    Tag(u32),
    #[error("AUSS stamp from incarnation 0")]
    Incarnation,
    #[error("AUSS stamp with {0} senders at epoch 0")]
    EpochZero(u32),
    #[error("AUSS stamp counts {n} senders, more than the {max} other hosts")]
    TooMany { n: u32, max: u32 },
}

impl Stamp {
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(STAMP_LEN);
        b.extend_from_slice(&STAMP_TAG.to_le_bytes());
        b.extend_from_slice(&self.n.to_le_bytes());
        b.extend_from_slice(&self.epoch.to_le_bytes());
        b.extend_from_slice(&self.incarnation.to_le_bytes());
        b
    }

    /// Parses and checks a stamp: a receiver can count at most `max_n` senders (the other
    /// hosts of the run), and every change of `N` moved the epoch on from 0.
    pub fn decode(b: &[u8], max_n: u32) -> Result<Stamp, StampError> {
        if b.len() != STAMP_LEN {
            return Err(StampError::Length(b.len()));
        }
        let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().unwrap());
        let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap());
        if u32_at(0) != STAMP_TAG {
            return Err(StampError::Tag(u32_at(0)));
        }
        let s = Stamp {
            n: u32_at(4),
            epoch: u64_at(8),
            incarnation: u64_at(16),
        };
        if s.incarnation == 0 {
            return Err(StampError::Incarnation);
        }
        if s.epoch == 0 && s.n != 0 {
            return Err(StampError::EpochZero(s.n));
        }
        if s.n > max_n {
            return Err(StampError::TooMany { n: s.n, max: max_n });
        }
        Ok(s)
    }
}

/// What an accepted request packet tells the set: its sender's QP `qpn` carries a message of
/// `msg_len` bytes, and (`idle`) this packet ended the message and left that QP's send
/// queue empty.
#[derive(Clone, Copy, Debug)]
pub struct Request {
    pub sender: SenderId,
    pub qpn: u32,
    pub msg_len: u32,
    pub idle: bool,
}

/// The responder's active unique senders, `A` being where a sender's notifications go.
pub struct ActiveSenders<A> {
    auss: Auss<A>,
    /// Open QPs (sender, QPN) and when each last announced (a START or refresh): later
    /// packets of an open QP re-announce only every `refresh`, so the per-packet cost is a
    /// map lookup.
    open: BTreeMap<(SenderId, u32), Duration>,
    refresh: Duration,
    /// Open QPs whose message ended with an empty send queue: the END is applied at the
    /// deadline (by [`ActiveSenders::tick`]) unless a long message comes first, `A` being
    /// where the END came from. They stay in `open` meanwhile.
    ending: BTreeMap<(SenderId, u32), (Duration, A)>,
    hold: Duration,
    /// One sequence for every announcement, so any new START is newer than any END the
    /// set still remembers for the same QPN (a QP number reused after its QP was destroyed).
    seq: u64,
}

impl<A: Clone + Ord> ActiveSenders<A> {
    /// `incarnation` (≠ 0) must grow across restarts of the engine, so that senders accept
    /// the new life's epochs, which start again at 1. An END takes effect `hold` after it
    /// arrives, unless its QP starts another long message by then (0: at once); a START is
    /// counted at once.
    pub fn new(expiry: Duration, hold: Duration, incarnation: u64) -> Self {
        Self {
            auss: Auss::new(
                AussConfig {
                    expiry,
                    ..AussConfig::default()
                },
                incarnation,
            ),
            open: BTreeMap::new(),
            // Three refreshes may be lost to scheduling before a live sender expires, as the
            // agents' default (docs/dasr.md, refresh_ms).
            refresh: expiry / 4,
            ending: BTreeMap::new(),
            hold,
            seq: 0,
        }
    }

    pub fn stamp(&self) -> Stamp {
        Stamp {
            n: self.auss.n(),
            epoch: self.auss.epoch(),
            incarnation: self.auss.incarnation(),
        }
    }

    /// An in-order request packet from the sender at `from`. Returns where notifications go:
    /// every member when `N` changed (the announcer too, whose own ACK may be a window away).
    pub fn on_request(&mut self, now: Duration, from: A, r: Request) -> Vec<A> {
        let key = (r.sender, r.qpn);
        if self.ending.contains_key(&key) {
            // Short messages, an END already held: the END stands, with its deadline.
            if r.msg_len < MIN_ACTIVE_MESSAGE || r.idle {
                return Vec::new();
            }
            // Another long message within the hold: the QP never stopped being busy.
            self.ending.remove(&key);
        }
        let phase = match (self.open.get(&key), r.idle) {
            (Some(_), true) if !self.hold.is_zero() => {
                self.ending.insert(key, (now + self.hold, from));
                return Vec::new();
            }
            (Some(_), true) => {
                self.open.remove(&key);
                Phase::End
            }
            // A QP that goes idle with a message it did not open on was never counted.
            (None, true) => return Vec::new(),
            (Some(at), false) if now.saturating_sub(*at) < self.refresh => return Vec::new(),
            (Some(_), false) => Phase::Start,
            (None, false) if r.msg_len < MIN_ACTIVE_MESSAGE => return Vec::new(),
            (None, false) => Phase::Start,
        };
        if phase == Phase::Start {
            self.open.insert(key, now);
        }
        self.announce(now, from, key, phase)
    }

    /// Tells the set of `phase` of QP `key`; returns where notifications go.
    fn announce(&mut self, now: Duration, from: A, key: (SenderId, u32), phase: Phase) -> Vec<A> {
        self.seq += 1;
        let epoch = self.auss.epoch();
        let a = Announce {
            sender: key.0,
            incarnation: 1,
            seq: self.seq,
            phase,
            msg_id: u64::from(key.1),
            weight: 1.0,
            lookahead: None,
        };
        let out = self.auss.on_announce(now, from, &a);
        // The announcer is told too while it is a member (its own ACK may be a window away);
        // one that has just left is not.
        let member = self.auss.is_member(key.0);
        self.targets(out, epoch, member)
    }

    /// Applies the ENDs held past their deadline and expires senders silent for the
    /// expiry; returns where notifications go.
    pub fn tick(&mut self, now: Duration) -> Vec<A> {
        let due: Vec<_> = self
            .ending
            .iter()
            .filter(|(_, (deadline, _))| *deadline <= now)
            .map(|(key, (_, from))| (*key, from.clone()))
            .collect();
        let mut to = Vec::new();
        for (key, from) in due {
            self.ending.remove(&key);
            self.open.remove(&key);
            to.extend(self.announce(now, from, key, Phase::End));
        }
        let epoch = self.auss.epoch();
        let expiry = self.auss.config().expiry;
        self.open.retain(|_, at| now.saturating_sub(*at) < expiry);
        let open = &self.open;
        self.ending.retain(|key, _| open.contains_key(key));
        let out = self.auss.tick(now);
        to.extend(self.targets(out, epoch, false));
        to.sort();
        to.dedup();
        to
    }

    /// When [`ActiveSenders::tick`] has an END to apply or a sender to expire.
    pub fn next_deadline(&self) -> Option<Duration> {
        let ends = self.ending.values().map(|(deadline, _)| *deadline).min();
        match (self.auss.next_deadline(), ends) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Members in the set now.
    pub fn n(&self) -> u32 {
        self.auss.n()
    }

    /// Where a change is notified: the members the set pushes to, and the announcer when
    /// `announcer` (the set answers it with an ACK, not a push).
    fn targets(&self, out: Vec<AussAction<A>>, epoch_before: u64, announcer: bool) -> Vec<A> {
        if self.auss.epoch() == epoch_before {
            return Vec::new();
        }
        let mut to: Vec<A> = out
            .into_iter()
            .filter_map(|a| match a {
                AussAction::Push { to, .. } => Some(to),
                AussAction::Ack { to, .. } => announcer.then_some(to),
            })
            .collect();
        to.sort();
        to.dedup();
        to
    }
}

/// How a requester took a stamp.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Applied {
    /// Newer than what it had (or the first): the destination's `N` is now this stamp's.
    Newer,
    /// The epoch it already had (an ACK repeats the current epoch until `N` changes).
    Same,
    /// Older than what it had — a delayed ACK overtaken by a notification, a replay, an
    /// earlier life of the receiver — and refused.
    Stale,
    /// The epoch it had with another `N`: a receiver has one `N` per epoch, so this one is
    /// forged (or corrupt) and refused.
    Conflicting,
}

/// The requester's newest stamp per destination host `D`, ordered by (incarnation, epoch).
#[derive(Clone, Debug)]
pub struct Latest<D> {
    by_dest: BTreeMap<D, Stamp>,
}

impl<D: Ord + Copy> Default for Latest<D> {
    fn default() -> Self {
        Self {
            by_dest: BTreeMap::new(),
        }
    }
}

impl<D: Ord + Copy> Latest<D> {
    pub fn apply(&mut self, dest: D, s: Stamp) -> Applied {
        match self.by_dest.get(&dest) {
            Some(old) if (s.incarnation, s.epoch) < (old.incarnation, old.epoch) => Applied::Stale,
            Some(old) if (s.incarnation, s.epoch) == (old.incarnation, old.epoch) => {
                if s.n == old.n {
                    Applied::Same
                } else {
                    Applied::Conflicting
                }
            }
            _ => {
                self.by_dest.insert(dest, s);
                Applied::Newer
            }
        }
    }

    pub fn get(&self, dest: D) -> Option<Stamp> {
        self.by_dest.get(&dest).copied()
    }
}

#[cfg(test)]
mod tests;
