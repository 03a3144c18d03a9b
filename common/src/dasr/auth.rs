//! Authenticated DASR datagrams (wire version 2): a MAC under a cluster key, and the
//! freshness rule that refuses replays.
//!
//! Without it anyone who can send UDP to an agent's DASR port could join its receiver's set
//! (lowering every member's cap) or forge ACKs with low caps to a sender. With a key, every
//! datagram carries `key_id | stamp` after its header and HMAC-SHA256 (truncated to 16 bytes)
//! over everything before the MAC; a receiver accepts it only if
//!
//! 1. the key id names a key it holds and the MAC checks (so only key holders speak);
//! 2. its stamp is within `window` of the receiver's clock (a captured datagram is worthless
//!    once `window` has passed);
//! 3. its stamp is newer than that of every datagram accepted from the same origin — a
//!    sender's life `(sender, incarnation)` for announcements, a receiver's life
//!    (`receiver_incarnation`) for ACKs — so a replay inside the window is refused too.
//!
//! Stamps are the sender's wall clock in ns, made strictly increasing per agent: a
//! retransmission is a new datagram with a new stamp, never a replay. A datagram overtaken
//! by a newer one of its origin is refused like a replay; to DASR that is a loss, which it
//! already repairs (retransmission until ACKed, refresh, pushes repaired by the next ACK).
//! An origin silent for `window` is forgotten: anything it sent before is outside the
//! window by then, so the memory is bounded by the peers heard from in the last `window`.
//!
//! The key id is derived from the key (one-way), so a key file is all a host needs, and a
//! host holding another key is told apart from a forger in the counters.

use super::wire::{Datagram, Sealed, WireError, MAC_LEN};
use super::SenderId;
use ring::hmac;
use std::collections::BTreeMap;
use std::time::Duration;
use subtle::ConstantTimeEq;

/// Length of a DASR key.
pub const KEY_LEN: usize = 32;

/// A cluster's DASR key with its id.
#[derive(Clone)]
pub struct DasrKey {
    id: u32,
    key: hmac::Key,
}

/// Never prints the secret.
impl std::fmt::Debug for DasrKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DasrKey({:#010x})", self.id)
    }
}

impl DasrKey {
    pub fn new(secret: &[u8; KEY_LEN]) -> Self {
        let key = hmac::Key::new(hmac::HMAC_SHA256, secret);
        let tag = hmac::sign(&key, b"drum dasr key id");
        let id = u32::from_be_bytes([
            tag.as_ref()[0],
            tag.as_ref()[1],
            tag.as_ref()[2],
            tag.as_ref()[3],
        ]);
        Self { id, key }
    }

    pub fn id(&self) -> u32 {
        self.id
    }

    fn mac(&self, signed: &[u8]) -> [u8; MAC_LEN] {
        let tag = hmac::sign(&self.key, signed);
        let mut out = [0u8; MAC_LEN];
        out.copy_from_slice(&tag.as_ref()[..MAC_LEN]);
        out
    }
}

/// Why a datagram was refused.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum Refusal {
    #[error("{0}")]
    Wire(WireError),
    #[error("unauthenticated version-1 datagram, but this agent has a DASR key")]
    Unauthenticated,
    #[error("unknown key id {0:#010x} (the peer holds another DASR key)")]
    UnknownKey(u32),
    #[error("bad MAC")]
    BadMac,
    #[error("stamp {off_ms} ms away from this clock, beyond the replay window")]
    Stale { off_ms: i64 },
    #[error("replayed: not newer than a datagram already accepted from its origin")]
    Replay,
}

impl Refusal {
    /// A short name per kind, for counters and rate-limited logs.
    pub fn kind(&self) -> &'static str {
        match self {
            Refusal::Wire(e) if e.is_version() => "wrong_version",
            Refusal::Wire(_) => "garbage",
            Refusal::Unauthenticated => "unauthenticated",
            Refusal::UnknownKey(_) => "unknown_key",
            Refusal::BadMac => "bad_mac",
            Refusal::Stale { .. } => "stale",
            Refusal::Replay => "replayed",
        }
    }
}

/// Whose stamps must grow: one sender life, or one receiver life.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Origin {
    Sender(SenderId, u64),
    Receiver(u64),
}

impl Origin {
    fn of(d: &Datagram) -> Self {
        match d {
            Datagram::Announce(a) => Origin::Sender(a.sender, a.incarnation),
            Datagram::Ack(k) => Origin::Receiver(k.receiver_incarnation),
        }
    }
}

/// One agent's sealing and opening of v2 datagrams. Time is the wall clock as a `Duration`
/// since the Unix epoch (stamps must compare across hosts), given by the caller.
#[derive(Clone, Debug)]
pub struct Guard {
    /// Seals with the first; opens with any (the second is a previous key during a rotation).
    keys: Vec<DasrKey>,
    window: Duration,
    last_stamp: u64,
    seen: BTreeMap<Origin, u64>,
    next_prune: Duration,
}

impl Guard {
    pub fn new(current: DasrKey, previous: Option<DasrKey>, window: Duration) -> Self {
        Self {
            keys: std::iter::once(current).chain(previous).collect(),
            window,
            last_stamp: 0,
            seen: BTreeMap::new(),
            next_prune: Duration::ZERO,
        }
    }

    /// The v2 bytes of `d`, stamped with `now` (or just after the last stamp).
    pub fn seal(&mut self, now: Duration, d: &Datagram) -> Vec<u8> {
        let stamp = nanos(now).max(self.last_stamp + 1);
        self.last_stamp = stamp;
        let key = &self.keys[0];
        let mut b = d.encode_unsigned(key.id, stamp);
        let mac = key.mac(&b);
        b.extend_from_slice(&mac);
        b
    }

    /// The datagram in `buf` if it is authentic and fresh; nothing is remembered otherwise.
    pub fn open(&mut self, now: Duration, buf: &[u8]) -> Result<Datagram, Refusal> {
        let sealed = match Sealed::split(buf) {
            Ok(s) => s,
            Err(WireError::UnknownVersion { got: 1, .. }) => return Err(Refusal::Unauthenticated),
            Err(e) => return Err(Refusal::Wire(e)),
        };
        let key = self
            .keys
            .iter()
            .find(|k| k.id == sealed.key_id)
            .ok_or(Refusal::UnknownKey(sealed.key_id))?;
        // Nothing unauthenticated is parsed further; the comparison takes the same time
        // wherever the MACs differ.
        if !bool::from(key.mac(sealed.signed).ct_eq(sealed.mac)) {
            return Err(Refusal::BadMac);
        }
        let d = sealed.datagram().map_err(Refusal::Wire)?;
        let now_ns = nanos(now);
        let off = i128::from(sealed.stamp) - i128::from(now_ns);
        if off.unsigned_abs() > self.window.as_nanos() {
            return Err(Refusal::Stale {
                off_ms: (off / 1_000_000).clamp(i64::MIN.into(), i64::MAX.into()) as i64,
            });
        }
        self.prune(now);
        let origin = Origin::of(&d);
        match self.seen.get(&origin) {
            Some(last) if sealed.stamp <= *last => Err(Refusal::Replay),
            _ => {
                self.seen.insert(origin, sealed.stamp);
                Ok(d)
            }
        }
    }

    /// Forgets origins silent for a window: whatever they sent is stale by now. Runs at most
    /// once per window, so it costs O(1) per datagram on average.
    fn prune(&mut self, now: Duration) {
        if now < self.next_prune {
            return;
        }
        self.next_prune = now + self.window;
        let horizon = nanos(now.saturating_sub(self.window));
        self.seen.retain(|_, last| *last >= horizon);
    }
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dasr::wire::{Ack, Announce, Phase, HEADER_LEN, SEAL_LEN};
    use proptest::prelude::*;

    const WINDOW: Duration = Duration::from_secs(2);
    /// A wall clock in 2026.
    const T0: Duration = Duration::from_secs(1_790_000_000);

    fn key(b: u8) -> DasrKey {
        DasrKey::new(&[b; KEY_LEN])
    }

    fn guard(k: u8) -> Guard {
        Guard::new(key(k), None, WINDOW)
    }

    fn start(seq: u64) -> Datagram {
        Datagram::Announce(Announce {
            sender: 7,
            incarnation: 3,
            seq,
            phase: Phase::Start,
            msg_id: 42,
            weight: 1.0,
            lookahead: None,
        })
    }

    fn ack(epoch: u64) -> Datagram {
        Datagram::Ack(Ack {
            receiver_incarnation: 9,
            sender_incarnation: 3,
            epoch,
            n: 2,
            omega: 2.0,
            cap: 0.5,
            acked_seq: 0,
            push: true,
            cap_off: false,
        })
    }

    #[test]
    fn sealed_datagrams_open_and_have_the_documented_size() {
        let (mut tx, mut rx) = (guard(1), guard(1));
        for d in [start(1), ack(1)] {
            let b = tx.seal(T0, &d);
            assert_eq!(b[2], crate::dasr::wire::VERSION_AUTH);
            let plain = d.encode().len();
            assert_eq!(b.len(), plain + SEAL_LEN + MAC_LEN);
            assert_eq!(rx.open(T0, &b), Ok(d));
        }
        assert!(key(1).id() != key(2).id());
        assert_eq!(
            format!("{:?}", key(1)),
            format!("DasrKey({:#010x})", key(1).id())
        );
    }

    /// The key id and the MAC as docs/dasr.md defines them, computed independently (Python's
    /// `hmac`), so a peer in another language can interoperate (the fuzz seeds use these too).
    #[test]
    fn key_id_and_mac_match_an_independent_hmac_sha256() {
        assert_eq!(key(7).id(), 0x1660_1251);
        let b = guard(7).seal(T0, &start(1));
        assert_eq!(
            b[b.len() - MAC_LEN..],
            [
                0xfe, 0x9f, 0x6c, 0xe1, 0xdd, 0x1b, 0x7f, 0x42, 0x44, 0xdd, 0x93, 0x32, 0x12, 0xf6,
                0x60, 0xdd
            ]
        );
    }

    #[test]
    fn every_tampered_byte_is_refused() {
        let b = guard(1).seal(T0, &start(1));
        for i in 0..b.len() {
            for flip in [0x01u8, 0x80] {
                let mut t = b.clone();
                t[i] ^= flip;
                let e = guard(1).open(T0, &t).unwrap_err();
                // The header is refused for what it says, the key id as unknown, every
                // other byte (the stamp, the message, the MAC itself) by the MAC.
                let ok = match i {
                    0..HEADER_LEN => matches!(e, Refusal::Wire(_)),
                    8.. => e == Refusal::BadMac,
                    _ => matches!(e, Refusal::UnknownKey(_)),
                };
                assert!(ok, "byte {i} ^ {flip:#x}: {e}");
            }
        }
    }

    #[test]
    fn truncated_wrong_key_and_unknown_key_id_are_refused() {
        let b = guard(1).seal(T0, &start(1));
        for cut in 0..b.len() {
            let e = guard(1).open(T0, &b[..cut]).unwrap_err();
            assert!(
                matches!(
                    e,
                    Refusal::BadMac | Refusal::Wire(WireError::Truncated { .. })
                ),
                "cut {cut}: {e}"
            );
        }
        // The same bytes MACed under another key that claims our key's id.
        let mut forged = start(1).encode_unsigned(key(1).id(), nanos(T0));
        forged.extend_from_slice(&key(2).mac(&forged));
        assert_eq!(guard(1).open(T0, &forged), Err(Refusal::BadMac));
        // Another key under its own id: unknown here, known to a guard holding it as previous.
        let other = guard(2).seal(T0, &start(1));
        assert_eq!(
            guard(1).open(T0, &other),
            Err(Refusal::UnknownKey(key(2).id()))
        );
        let mut rotating = Guard::new(key(1), Some(key(2)), WINDOW);
        assert_eq!(rotating.open(T0, &other), Ok(start(1)));
        // A v1 datagram is refused by a guard.
        assert_eq!(
            guard(1).open(T0, &start(1).encode()),
            Err(Refusal::Unauthenticated)
        );
        assert_eq!(Refusal::Unauthenticated.kind(), "unauthenticated");
    }

    #[test]
    fn replays_and_stale_stamps_are_refused() {
        let (mut tx, mut rx) = (guard(1), guard(1));
        let first = tx.seal(T0, &start(1));
        // The same announcement sent again (a retransmission) is a new datagram.
        let again = tx.seal(T0, &start(1));
        assert_ne!(first, again);
        assert_eq!(rx.open(T0, &first), Ok(start(1)));
        assert_eq!(rx.open(T0, &first), Err(Refusal::Replay));
        assert_eq!(rx.open(T0, &again), Ok(start(1)));
        // Overtaken by a newer datagram of the same origin: refused like a replay.
        let older = tx.seal(T0, &start(2));
        let newer = tx.seal(T0, &start(3));
        assert_eq!(rx.open(T0, &newer), Ok(start(3)));
        assert_eq!(rx.open(T0, &older), Err(Refusal::Replay));
        // Origins are separate: the ACKs of a receiver life have their own stamps.
        let k = tx.seal(T0, &ack(1));
        assert_eq!(rx.open(T0, &k), Ok(ack(1)));
        assert_eq!(rx.open(T0, &k), Err(Refusal::Replay));
        // Outside the window either way.
        let late = tx.seal(T0, &start(4));
        let ms = Duration::from_millis(1);
        assert!(matches!(
            rx.open(T0 + WINDOW + 10 * ms, &late),
            Err(Refusal::Stale {
                off_ms: -2010..=-2009
            })
        ));
        let early = tx.seal(T0 + WINDOW + 10 * ms, &start(5));
        assert!(matches!(
            rx.open(T0, &early),
            Err(Refusal::Stale {
                off_ms: 2009..=2010
            })
        ));
        // Just inside the window, once.
        let edge = tx.seal(T0 + WINDOW + 10 * ms, &start(6));
        assert_eq!(rx.open(T0 + 20 * ms, &edge), Ok(start(6)));
        // A forgotten origin's old datagrams are stale, so forgetting reopens nothing.
        let mut rx2 = guard(1);
        assert_eq!(rx2.open(T0, &first), Ok(start(1)));
        assert_eq!(
            rx2.open(T0 + 3 * WINDOW, &tx.seal(T0 + 3 * WINDOW, &ack(2))),
            Ok(ack(2))
        );
        assert_eq!(rx2.seen.len(), 1, "the announcing origin is forgotten");
        assert!(matches!(
            rx2.open(T0 + 3 * WINDOW, &first),
            Err(Refusal::Stale { .. })
        ));
    }

    proptest! {
        /// Arbitrary bytes, and arbitrary bytes behind a valid v2 header, never panic and
        /// never open without the key.
        #[test]
        fn arbitrary_bytes_never_open(
            bytes in proptest::collection::vec(any::<u8>(), 0..120),
            ty in 0u8..4,
            stamp_off in -3_000_000_000i64..3_000_000_000,
        ) {
            let mut g = guard(1);
            prop_assert!(g.open(T0, &bytes).is_err());
            let mut b = vec![b'D', b'S', crate::dasr::wire::VERSION_AUTH, ty];
            b.extend_from_slice(&key(1).id().to_be_bytes());
            b.extend_from_slice(&(nanos(T0) as i64 + stamp_off).to_be_bytes());
            b.extend(bytes);
            prop_assert!(g.open(T0, &b).is_err());
        }

        /// Whatever one guard seals another with the key opens once, and only once.
        #[test]
        fn sealed_opens_exactly_once(seqs in proptest::collection::vec(1u64..1000, 1..20)) {
            let (mut tx, mut rx) = (guard(3), guard(3));
            let sent: Vec<_> = seqs.iter().map(|s| (start(*s), tx.seal(T0, &start(*s)))).collect();
            for (d, b) in &sent {
                prop_assert_eq!(rx.open(T0, b), Ok(*d));
            }
            for (_, b) in &sent {
                prop_assert_eq!(rx.open(T0, b), Err(Refusal::Replay));
            }
        }
    }
}
