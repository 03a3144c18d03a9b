//! DASR datagrams: a versioned, fixed binary layout (all integers big endian).
//!
//! Every datagram starts with a 4-byte header — magic `b"DS"`, wire version (u8), message
//! type (u8). Version 1 follows it with the message; version 2 (authenticated, see
//! [`super::auth`]) puts a key id and a stamp before the message and a MAC after it:
//!
//! ```text
//! v1: "DS" | 1 | type | message
//! v2: "DS" | 2 | type | key_id u32 | stamp u64 (ns since the Unix epoch) | message | mac [16]
//!     (the MAC covers every byte before it)
//!
//! ANNOUNCE (type 1): 46 bytes in v1, 60 with look-ahead; v2: 74 / 88
//!   flags u8 (bit 0: look-ahead present) | phase u8 (1 START, 2 END)
//!   sender u64 | incarnation u64 | seq u64 (≥ 1) | msg_id u64 | weight f64 (finite, > 0)
//!   [look-ahead: tenant u32 | group u64 | members u16 (≥ 1)]
//! ACK (type 2): 57 bytes in v1; v2: 85
//!   flags u8 (bit 0: push, bit 1: cap off) | n u32
//!   receiver_incarnation u64 | sender_incarnation u64 | epoch u64
//!   omega f64 (finite, ≥ 0) | cap f64 (finite, ≥ 0) | acked_seq u64 (0 on a push)
//! ```
//!
//! Why a hand-written layout rather than bincode: the sizes are fixed and known (so the hard
//! limit [`MAX_DATAGRAM`] is obvious and every truncation is detected at a named field), the
//! byte layout cannot shift under a serde-derive or bincode change (which would also change
//! what the MAC covers), the decoder is a bounds-checked reader that allocates nothing on the
//! receive path, and a peer written in another language (or the C side of a shim) can build
//! the 46-byte announcement from this comment alone.
//! Unknown versions, types, phases and flag bits, NaN/negative weights and trailing bytes are
//! all refused with an error naming what was wrong; decoding never panics.

use super::SenderId;

pub const MAGIC: [u8; 2] = *b"DS";
/// The unauthenticated version, spoken by agents without a DASR key.
pub const VERSION: u8 = 1;
/// The authenticated version, spoken (and alone accepted) by agents with a DASR key. Any
/// other version is refused, never guessed at.
pub const VERSION_AUTH: u8 = 2;
pub const HEADER_LEN: usize = 4;
/// Key id and stamp of a v2 datagram, between the header and the message.
pub const SEAL_LEN: usize = 4 + 8;
/// The MAC ending a v2 datagram: HMAC-SHA256 truncated to 128 bits.
pub const MAC_LEN: usize = 16;
/// Hard limit on a DASR datagram. The largest message is 88 bytes (a v2 look-ahead
/// announcement).
pub const MAX_DATAGRAM: usize = 96;

const T_ANNOUNCE: u8 = 1;
const T_ACK: u8 = 2;
const A_LOOKAHEAD: u8 = 0x01;
const K_PUSH: u8 = 0x01;
const K_CAP_OFF: u8 = 0x02;

pub const ANNOUNCE_LEN: usize = HEADER_LEN + 2 + 5 * 8;
pub const ANNOUNCE_LOOKAHEAD_LEN: usize = ANNOUNCE_LEN + 4 + 8 + 2;
pub const ACK_LEN: usize = HEADER_LEN + 1 + 4 + 6 * 8;
/// What v2 adds to a v1 message.
pub const AUTH_OVERHEAD: usize = SEAL_LEN + MAC_LEN;

#[derive(Clone, Debug, thiserror::Error, PartialEq)]
pub enum WireError {
    #[error("datagram of {len} bytes exceeds the {MAX_DATAGRAM}-byte limit")]
    TooLong { len: usize },
    #[error("truncated datagram: {field} needs {need} more bytes, {have} left")]
    Truncated {
        field: &'static str,
        need: usize,
        have: usize,
    },
    #[error("bad magic {0:02x?}: not a DASR datagram")]
    BadMagic([u8; 2]),
    #[error("unsupported DASR wire version {got} (this agent speaks {speaks})")]
    UnknownVersion { got: u8, speaks: u8 },
    #[error("unknown DASR message type {0}")]
    UnknownType(u8),
    #[error("unknown announcement phase {0} (1 START, 2 END)")]
    UnknownPhase(u8),
    #[error("unknown flag bits {bits:#04x} in {what}")]
    UnknownFlags { what: &'static str, bits: u8 },
    #[error("invalid {field}: {value} ({why})")]
    InvalidValue {
        field: &'static str,
        value: f64,
        why: &'static str,
    },
    #[error("sequence number 0 is reserved in an announcement")]
    ZeroSeq,
    #[error("look-ahead group with 0 members")]
    EmptyGroup,
    #[error("{0} trailing bytes after the message")]
    Trailing(usize),
}

impl WireError {
    /// A well-formed datagram of another wire version (counted apart from garbage).
    pub fn is_version(&self) -> bool {
        matches!(self, WireError::UnknownVersion { .. })
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Phase {
    Start,
    End,
}

/// Optional look-ahead: "this message belongs to incast group `group` of `tenant`, which has
/// `members` senders". A receiver with look-ahead enabled counts the members not yet heard from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Lookahead {
    pub tenant: u32,
    pub group: u64,
    pub members: u16,
}

/// Sender → receiver: a long message to the receiver started or ended.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Announce {
    pub sender: SenderId,
    /// Changes (grows) when the sender's agent restarts; resets the receiver's record.
    pub incarnation: u64,
    /// Per-sender announcement number, from 1; a retransmission repeats it.
    pub seq: u64,
    pub phase: Phase,
    pub msg_id: u64,
    /// ω_i, the sender's weight (DRUM weight; 1 for Dart's plain `R/N`).
    pub weight: f64,
    pub lookahead: Option<Lookahead>,
}

/// Receiver → sender: the answer to an announcement, or a push after `N` (or Ω) changed.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Ack {
    pub receiver_incarnation: u64,
    /// Echo of the incarnation of the sender this ACK is for (stale lives ignore it).
    pub sender_incarnation: u64,
    pub epoch: u64,
    pub n: u32,
    pub omega: f64,
    /// `R · ω_i / Ω` for the addressed sender.
    pub cap: f64,
    /// The announcement answered; 0 on a push.
    pub acked_seq: u64,
    pub push: bool,
    /// The receiver is in non-receiver congestion: no DASR cap applies.
    pub cap_off: bool,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Datagram {
    Announce(Announce),
    Ack(Ack),
}

impl Datagram {
    /// The version-1 (unauthenticated) encoding.
    pub fn encode(&self) -> Vec<u8> {
        let mut b = self.header(VERSION);
        self.encode_message(&mut b);
        b
    }

    /// The version-2 encoding up to its MAC, which the caller computes over these bytes and
    /// appends ([`super::auth::Guard::seal`]).
    pub fn encode_unsigned(&self, key_id: u32, stamp: u64) -> Vec<u8> {
        let mut b = self.header(VERSION_AUTH);
        b.extend_from_slice(&key_id.to_be_bytes());
        b.extend_from_slice(&stamp.to_be_bytes());
        self.encode_message(&mut b);
        // v1 is shorter by the seal and the MAC, so this bounds both.
        debug_assert!(b.len() + MAC_LEN <= MAX_DATAGRAM);
        b
    }

    fn header(&self, version: u8) -> Vec<u8> {
        let mut b = Vec::with_capacity(MAX_DATAGRAM);
        b.extend_from_slice(&MAGIC);
        b.push(version);
        b.push(match self {
            Datagram::Announce(_) => T_ANNOUNCE,
            Datagram::Ack(_) => T_ACK,
        });
        b
    }

    fn encode_message(&self, b: &mut Vec<u8>) {
        match self {
            Datagram::Announce(a) => {
                b.push(if a.lookahead.is_some() {
                    A_LOOKAHEAD
                } else {
                    0
                });
                b.push(match a.phase {
                    Phase::Start => 1,
                    Phase::End => 2,
                });
                for v in [a.sender, a.incarnation, a.seq, a.msg_id] {
                    b.extend_from_slice(&v.to_be_bytes());
                }
                b.extend_from_slice(&a.weight.to_be_bytes());
                if let Some(l) = a.lookahead {
                    b.extend_from_slice(&l.tenant.to_be_bytes());
                    b.extend_from_slice(&l.group.to_be_bytes());
                    b.extend_from_slice(&l.members.to_be_bytes());
                }
            }
            Datagram::Ack(k) => {
                b.push(if k.push { K_PUSH } else { 0 } | if k.cap_off { K_CAP_OFF } else { 0 });
                b.extend_from_slice(&k.n.to_be_bytes());
                for v in [k.receiver_incarnation, k.sender_incarnation, k.epoch] {
                    b.extend_from_slice(&v.to_be_bytes());
                }
                b.extend_from_slice(&k.omega.to_be_bytes());
                b.extend_from_slice(&k.cap.to_be_bytes());
                b.extend_from_slice(&k.acked_seq.to_be_bytes());
            }
        }
    }

    /// Decodes a version-1 datagram; any other version (v2 included) is `UnknownVersion`.
    pub fn decode(buf: &[u8]) -> Result<Self, WireError> {
        let (ty, mut r) = read_header(buf, VERSION)?;
        decode_message(ty, &mut r)
    }
}

/// A version-2 datagram cut into its parts; only the header has been read. The message is
/// decoded by [`Sealed::datagram`], after the MAC has been checked.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sealed<'a> {
    pub key_id: u32,
    pub stamp: u64,
    /// Every byte the MAC covers: the datagram without its MAC.
    pub signed: &'a [u8],
    pub mac: &'a [u8],
}

impl<'a> Sealed<'a> {
    /// Splits a version-2 datagram; any other version is `UnknownVersion`.
    pub fn split(buf: &'a [u8]) -> Result<Self, WireError> {
        let (_, mut r) = read_header(buf, VERSION_AUTH)?;
        let key_id = u32::from_be_bytes(r.take::<4>("key id")?);
        let stamp = r.u64("stamp")?;
        if r.0.len() < MAC_LEN {
            return Err(WireError::Truncated {
                field: "mac",
                need: MAC_LEN,
                have: r.0.len(),
            });
        }
        let (signed, mac) = buf.split_at(buf.len() - MAC_LEN);
        Ok(Sealed {
            key_id,
            stamp,
            signed,
            mac,
        })
    }

    /// The message between the stamp and the MAC.
    pub fn datagram(&self) -> Result<Datagram, WireError> {
        let mut r = Reader(&self.signed[HEADER_LEN + SEAL_LEN..]);
        decode_message(self.signed[3], &mut r)
    }
}

/// Magic, version (must be `version`) and type; the reader is left at what follows.
fn read_header(buf: &[u8], version: u8) -> Result<(u8, Reader<'_>), WireError> {
    if buf.len() > MAX_DATAGRAM {
        return Err(WireError::TooLong { len: buf.len() });
    }
    let mut r = Reader(buf);
    let magic = r.take::<2>("magic")?;
    if magic != MAGIC {
        return Err(WireError::BadMagic(magic));
    }
    let [got] = r.take::<1>("version")?;
    if got != version {
        return Err(WireError::UnknownVersion {
            got,
            speaks: version,
        });
    }
    let [ty] = r.take::<1>("message type")?;
    if ty != T_ANNOUNCE && ty != T_ACK {
        return Err(WireError::UnknownType(ty));
    }
    Ok((ty, r))
}

/// One message of type `ty`, which must fill the rest of `r`.
fn decode_message(ty: u8, r: &mut Reader) -> Result<Datagram, WireError> {
    let msg = match ty {
        T_ANNOUNCE => Datagram::Announce(decode_announce(r)?),
        T_ACK => Datagram::Ack(decode_ack(r)?),
        t => return Err(WireError::UnknownType(t)),
    };
    if !r.0.is_empty() {
        return Err(WireError::Trailing(r.0.len()));
    }
    Ok(msg)
}

fn decode_announce(r: &mut Reader) -> Result<Announce, WireError> {
    let [flags] = r.take::<1>("announce flags")?;
    if flags & !A_LOOKAHEAD != 0 {
        return Err(WireError::UnknownFlags {
            what: "announce",
            bits: flags & !A_LOOKAHEAD,
        });
    }
    let phase = match r.take::<1>("phase")? {
        [1] => Phase::Start,
        [2] => Phase::End,
        [p] => return Err(WireError::UnknownPhase(p)),
    };
    let sender = r.u64("sender")?;
    let incarnation = r.u64("incarnation")?;
    let seq = r.u64("seq")?;
    let msg_id = r.u64("msg_id")?;
    let weight = r.f64("weight")?;
    if !(weight.is_finite() && weight > 0.0) {
        return Err(WireError::InvalidValue {
            field: "weight",
            value: weight,
            why: "must be finite and positive",
        });
    }
    if seq == 0 {
        return Err(WireError::ZeroSeq);
    }
    let lookahead = if flags & A_LOOKAHEAD != 0 {
        let tenant = u32::from_be_bytes(r.take::<4>("look-ahead tenant")?);
        let group = r.u64("look-ahead group")?;
        let members = u16::from_be_bytes(r.take::<2>("look-ahead members")?);
        if members == 0 {
            return Err(WireError::EmptyGroup);
        }
        Some(Lookahead {
            tenant,
            group,
            members,
        })
    } else {
        None
    };
    Ok(Announce {
        sender,
        incarnation,
        seq,
        phase,
        msg_id,
        weight,
        lookahead,
    })
}

fn decode_ack(r: &mut Reader) -> Result<Ack, WireError> {
    let [flags] = r.take::<1>("ack flags")?;
    if flags & !(K_PUSH | K_CAP_OFF) != 0 {
        return Err(WireError::UnknownFlags {
            what: "ack",
            bits: flags & !(K_PUSH | K_CAP_OFF),
        });
    }
    let n = u32::from_be_bytes(r.take::<4>("n")?);
    let receiver_incarnation = r.u64("receiver incarnation")?;
    let sender_incarnation = r.u64("sender incarnation")?;
    let epoch = r.u64("epoch")?;
    let omega = r.f64("omega")?;
    let cap = r.f64("cap")?;
    let acked_seq = r.u64("acked_seq")?;
    for (field, value) in [("omega", omega), ("cap", cap)] {
        if !(value.is_finite() && value >= 0.0) {
            return Err(WireError::InvalidValue {
                field,
                value,
                why: "must be finite and non-negative",
            });
        }
    }
    Ok(Ack {
        receiver_incarnation,
        sender_incarnation,
        epoch,
        n,
        omega,
        cap,
        acked_seq,
        push: flags & K_PUSH != 0,
        cap_off: flags & K_CAP_OFF != 0,
    })
}

struct Reader<'a>(&'a [u8]);

impl Reader<'_> {
    fn take<const L: usize>(&mut self, field: &'static str) -> Result<[u8; L], WireError> {
        if self.0.len() < L {
            return Err(WireError::Truncated {
                field,
                need: L,
                have: self.0.len(),
            });
        }
        let (head, rest) = self.0.split_at(L);
        self.0 = rest;
        let mut out = [0u8; L];
        out.copy_from_slice(head);
        Ok(out)
    }
    fn u64(&mut self, field: &'static str) -> Result<u64, WireError> {
        Ok(u64::from_be_bytes(self.take::<8>(field)?))
    }
    fn f64(&mut self, field: &'static str) -> Result<f64, WireError> {
        Ok(f64::from_be_bytes(self.take::<8>(field)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn announce() -> Announce {
        Announce {
            sender: 7,
            incarnation: 3,
            seq: 1,
            phase: Phase::Start,
            msg_id: 42,
            weight: 1.0,
            lookahead: None,
        }
    }

    fn ack() -> Ack {
        Ack {
            receiver_incarnation: 9,
            sender_incarnation: 3,
            epoch: 5,
            n: 2,
            omega: 2.0,
            cap: 0.5,
            acked_seq: 1,
            push: false,
            cap_off: false,
        }
    }

    #[test]
    fn sizes_are_fixed_and_within_limit() {
        assert_eq!(Datagram::Announce(announce()).encode().len(), ANNOUNCE_LEN);
        let la = Announce {
            lookahead: Some(Lookahead {
                tenant: 1,
                group: 2,
                members: 3,
            }),
            ..announce()
        };
        assert_eq!(
            Datagram::Announce(la).encode().len(),
            ANNOUNCE_LOOKAHEAD_LEN
        );
        assert_eq!(Datagram::Ack(ack()).encode().len(), ACK_LEN);
        const {
            assert!(
                ANNOUNCE_LOOKAHEAD_LEN + AUTH_OVERHEAD <= MAX_DATAGRAM
                    && ACK_LEN + AUTH_OVERHEAD <= MAX_DATAGRAM
            )
        };
    }

    #[test]
    fn round_trips() {
        for d in [Datagram::Announce(announce()), Datagram::Ack(ack())] {
            assert_eq!(Datagram::decode(&d.encode()), Ok(d));
        }
    }

    #[test]
    fn refusals_name_the_problem() {
        let good = Datagram::Announce(announce()).encode();
        let mut v = good.clone();
        v[2] = 2;
        assert_eq!(
            Datagram::decode(&v),
            Err(WireError::UnknownVersion {
                got: 2,
                speaks: VERSION
            })
        );
        assert!(Datagram::decode(&v).unwrap_err().is_version());
        let mut m = good.clone();
        m[0] = b'X';
        assert!(matches!(Datagram::decode(&m), Err(WireError::BadMagic(_))));
        let mut t = good.clone();
        t[3] = 9;
        assert_eq!(Datagram::decode(&t), Err(WireError::UnknownType(9)));
        let mut p = good.clone();
        p[5] = 3;
        assert_eq!(Datagram::decode(&p), Err(WireError::UnknownPhase(3)));
        let mut f = good.clone();
        f[4] = 0x80;
        assert!(matches!(
            Datagram::decode(&f),
            Err(WireError::UnknownFlags { .. })
        ));
        let mut long = good.clone();
        long.push(0);
        assert_eq!(Datagram::decode(&long), Err(WireError::Trailing(1)));
        assert_eq!(
            Datagram::decode(&[0u8; MAX_DATAGRAM + 1]),
            Err(WireError::TooLong {
                len: MAX_DATAGRAM + 1
            })
        );
        let e = Datagram::decode(&good[..28]).unwrap_err();
        assert!(
            matches!(e, WireError::Truncated { field: "seq", .. }),
            "{e}"
        );
        assert!(e.to_string().contains("seq"));
        let nan = Datagram::Announce(Announce {
            weight: f64::NAN,
            ..announce()
        })
        .encode();
        assert!(matches!(
            Datagram::decode(&nan),
            Err(WireError::InvalidValue {
                field: "weight",
                ..
            })
        ));
        let zero = Datagram::Announce(Announce {
            seq: 0,
            ..announce()
        })
        .encode();
        assert_eq!(Datagram::decode(&zero), Err(WireError::ZeroSeq));
        let neg = Datagram::Ack(Ack { cap: -1.0, ..ack() }).encode();
        assert!(matches!(
            Datagram::decode(&neg),
            Err(WireError::InvalidValue { field: "cap", .. })
        ));
        assert!(Datagram::decode(&[]).is_err());
    }

    fn arb_datagram() -> impl Strategy<Value = Datagram> {
        let la = proptest::option::of((any::<u32>(), any::<u64>(), 1u16..).prop_map(
            |(tenant, group, members)| Lookahead {
                tenant,
                group,
                members,
            },
        ));
        let announce = (
            any::<u64>(),
            any::<u64>(),
            1u64..,
            any::<bool>(),
            any::<u64>(),
            1e-6f64..1e6,
            la,
        )
            .prop_map(
                |(sender, incarnation, seq, start, msg_id, weight, lookahead)| {
                    Datagram::Announce(Announce {
                        sender,
                        incarnation,
                        seq,
                        phase: if start { Phase::Start } else { Phase::End },
                        msg_id,
                        weight,
                        lookahead,
                    })
                },
            );
        let ack = (
            (any::<u64>(), any::<u64>(), any::<u64>(), any::<u32>()),
            (
                0f64..1e12,
                0f64..1e12,
                any::<u64>(),
                any::<bool>(),
                any::<bool>(),
            ),
        )
            .prop_map(
                |((ri, si, epoch, n), (omega, cap, acked_seq, push, cap_off))| {
                    Datagram::Ack(Ack {
                        receiver_incarnation: ri,
                        sender_incarnation: si,
                        epoch,
                        n,
                        omega,
                        cap,
                        acked_seq,
                        push,
                        cap_off,
                    })
                },
            );
        prop_oneof![announce, ack]
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = Datagram::decode(&bytes);
            if let Ok(s) = Sealed::split(&bytes) {
                let _ = s.datagram();
            }
        }

        #[test]
        fn v2_header_like_bytes_never_panic(tail in proptest::collection::vec(any::<u8>(), 0..90), ty in 0u8..4) {
            let mut b = vec![b'D', b'S', VERSION_AUTH, ty];
            b.extend(tail);
            if let Ok(s) = Sealed::split(&b) {
                prop_assert_eq!(s.signed.len() + MAC_LEN, b.len());
                if let Ok(d) = s.datagram() {
                    let mut again = d.encode_unsigned(s.key_id, s.stamp);
                    again.extend_from_slice(s.mac);
                    prop_assert_eq!(again, b);
                }
            }
        }

        #[test]
        fn v2_round_trip_and_every_truncation_is_refused(d in arb_datagram(), key_id in any::<u32>(), stamp in any::<u64>()) {
            let mut b = d.encode_unsigned(key_id, stamp);
            b.extend_from_slice(&[0xa5; MAC_LEN]);
            prop_assert_eq!(b.len(), d.encode().len() + AUTH_OVERHEAD);
            prop_assert!(b.len() <= MAX_DATAGRAM);
            let s = Sealed::split(&b).unwrap();
            prop_assert_eq!((s.key_id, s.stamp, s.mac), (key_id, stamp, &[0xa5; MAC_LEN][..]));
            prop_assert_eq!(s.datagram(), Ok(d));
            prop_assert!(Datagram::decode(&b).unwrap_err().is_version(), "v1 decoding refuses v2");
            for cut in 0..b.len() {
                // Cut short, the MAC is taken from the message's bytes: what is left of the
                // message is short (the unchecked MAC itself is the business of auth).
                let e = Sealed::split(&b[..cut]).and_then(|s| s.datagram()).unwrap_err();
                prop_assert!(matches!(e, WireError::Truncated { .. }), "cut {}: {}", cut, e);
            }
        }

        #[test]
        fn header_like_bytes_never_panic(tail in proptest::collection::vec(any::<u8>(), 0..70), ty in 0u8..4) {
            let mut b = vec![b'D', b'S', VERSION, ty];
            b.extend(tail);
            if let Ok(d) = Datagram::decode(&b) {
                // Whatever decodes re-encodes to the same bytes (no two spellings of a message).
                prop_assert_eq!(d.encode(), b);
            }
        }

        #[test]
        fn valid_round_trip_and_every_truncation_is_refused(d in arb_datagram()) {
            let b = d.encode();
            prop_assert!(b.len() <= MAX_DATAGRAM);
            prop_assert_eq!(Datagram::decode(&b), Ok(d));
            for cut in 0..b.len() {
                let e = Datagram::decode(&b[..cut]).unwrap_err();
                prop_assert!(matches!(e, WireError::Truncated { .. }), "cut {}: {}", cut, e);
            }
        }
    }
}
