//! The engine-to-engine packet format (UDP payload) and 24-bit PSN arithmetic.
//!
//! Header (48 bytes, little endian), then the payload:
//! `magic u32 | op u8 | flags u8 | syndrome u8 | ecn u8 | dst_qpn u32 | src_qpn u32 | psn u32 |
//!  msg_len u32 | offset u32 | imm u32 | remote_addr u64 | rkey u32 | payload_len u32`
//!
//! `ecn` is the ECN field of the IP header a RoCE v2 packet would carry (two bits; 0 as
//! sent, [`ECN_CE`] once a congested port marked it); it was a pad byte sent as 0, so
//! packets of engines that predate it read as not marked.
//!
//! AUSS ([`crate::auss`], when the run has it on): an ACK may carry a stamp as its payload
//! (`payload_len` 24: `tag u32 "AUS1" | n u32 | epoch u64 | incarnation u64`), an
//! [`OP_AUSS`] notification always does; an ACK without payload has none (engines that
//! predate AUSS sent ACKs without payload and ignore one). A request's last packet has
//! [`F_IDLE`] when the requester's send queue holds nothing after it (the flag bit was
//! unused, sent as 0).
//!
//! An XRC request ([`F_XRC`]) carries a 4-byte extension after the header, before the
//! payload: the responder's SRQ number (`srqn u32`; InfiniBand's XRCETH).

use std::ops::{Deref, Range};
use std::sync::Arc;

pub const MAGIC: u32 = 0x534e_5231;
pub const HDR_LEN: usize = 48;

pub const OP_SEND: u8 = 1;
pub const OP_WRITE: u8 = 2;
pub const OP_READ_REQ: u8 = 3;
pub const OP_READ_RESP: u8 = 4;
pub const OP_ACK: u8 = 5;
pub const OP_NAK: u8 = 6;
/// Atomic requests: payload `compare_add u64 LE | swap u64 LE`, one PSN, 8-byte target.
pub const OP_CMP_SWAP: u8 = 7;
pub const OP_FETCH_ADD: u8 = 8;
/// Atomic response: payload the original 8 bytes, PSN of the request.
pub const OP_ATOMIC_RESP: u8 = 9;
/// A UD datagram: one packet, `rkey` carries the Q_Key, no acknowledgement.
pub const OP_UD_SEND: u8 = 10;
/// The destination QPN of a UD datagram to a multicast group; the group's IPv4 address
/// travels in `remote_addr`.
pub use softrnic_abi::device::MCAST_QPN;
/// An Ethernet frame of a raw-packet QP (the payload, as the application built it), flooded
/// to every host as a switch floods unknown unicast; receivers steer it by their flow rules.
pub const OP_RAW: u8 = 11;
/// A pause from a receive port whose buffer is full (PFC's PAUSE, for the whole port): the
/// sender holds back everything for `imm` ns. Engine to engine; no QP.
pub const OP_PAUSE: u8 = 12;
/// A congestion notification (RoCE v2's CNP, BTH opcode 0x81): the receiver of an ECN-marked
/// packet tells the QP `dst_qpn` that sent it to slow down (DCQCN, [`crate::dcqcn`]).
pub const OP_CNP: u8 = 13;
/// An AUSS notification: the receiving host's `N` changed; the payload is its new stamp
/// ([`crate::auss::Stamp`]). Engine to engine, to every active sender; no QP.
pub const OP_AUSS: u8 = 14;
/// The highest op the decoder accepts.
pub const OP_MAX: u8 = OP_AUSS;

/// The ECN codepoint "congestion experienced" (RFC 3168), in [`Packet::ecn`].
pub const ECN_CE: u8 = 3;
/// The bits of the ECN field; a packet with others set is malformed.
const ECN_MASK: u8 = 3;

pub const F_FIRST: u8 = 1;
pub const F_LAST: u8 = 2;
pub const F_IMM: u8 = 4;
pub const F_ACKREQ: u8 = 8;
/// On a message's last packet: the sender asked for a solicited event (`IBV_SEND_SOLICITED`),
/// which wakes a CQ armed with `ibv_req_notify_cq(cq, 1)` when the receive completes.
pub const F_SOLICITED: u8 = 16;
/// SEND with invalidate: `imm` is the rkey of a memory window the responder invalidates.
pub const F_INV: u8 = 32;
/// An XRC request: the [`XRC_EXT_LEN`]-byte extension with the target SRQ number follows
/// the header.
pub const F_XRC: u8 = 64;
pub const XRC_EXT_LEN: usize = 4;
/// On a request's last packet: the requester's send queue holds nothing after this message
/// (Dart's END: the sender leaves the receiver's active senders unless it has other QPs
/// busy there).
pub const F_IDLE: u8 = 128;

pub const NAK_SEQ: u8 = 1;
pub const NAK_RNR: u8 = 2;
pub const NAK_REM_ACCESS: u8 = 3;
pub const NAK_REM_INVALID: u8 = 4;
pub const NAK_REM_OP: u8 = 5;

pub const PSN_MASK: u32 = 0x00ff_ffff;

pub fn psn_add(a: u32, n: u32) -> u32 {
    a.wrapping_add(n) & PSN_MASK
}

/// Signed distance `a - b` in 24-bit PSN space.
pub fn psn_diff(a: u32, b: u32) -> i32 {
    ((a.wrapping_sub(b) << 8) as i32) >> 8
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Packet {
    pub op: u8,
    pub flags: u8,
    pub syndrome: u8,
    /// The ECN field: [`ECN_CE`] when a congested receive port marked the packet.
    pub ecn: u8,
    pub dst_qpn: u32,
    pub src_qpn: u32,
    pub psn: u32,
    pub msg_len: u32,
    pub offset: u32,
    pub imm: u32,
    pub remote_addr: u64,
    pub rkey: u32,
    /// The XRC target SRQ number; on the wire only with [`F_XRC`] (else 0).
    pub srqn: u32,
    pub payload: Payload,
}

/// A packet's payload: an immutable slice of a shared buffer. A requester's packets slice
/// the message bytes it staged, so a packet travels to the transmit queue, its QP's
/// retransmission copy, the NIC's loopback and the responder's combined write without its
/// bytes being copied (only a socket send encodes it).
#[derive(Clone, Default)]
pub struct Payload {
    buf: Arc<Vec<u8>>,
    range: Range<usize>,
}

impl Payload {
    /// The bytes `r` of this payload, sharing its buffer.
    pub fn slice(&self, r: Range<usize>) -> Payload {
        assert!(
            r.start <= r.end && r.end <= self.len(),
            "slice out of range"
        );
        Payload {
            buf: self.buf.clone(),
            range: self.range.start + r.start..self.range.start + r.end,
        }
    }
}

impl From<Vec<u8>> for Payload {
    fn from(v: Vec<u8>) -> Self {
        let range = 0..v.len();
        Payload {
            buf: Arc::new(v),
            range,
        }
    }
}

impl Deref for Payload {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.buf[self.range.clone()]
    }
}

impl PartialEq for Payload {
    fn eq(&self, o: &Self) -> bool {
        **self == **o
    }
}
impl Eq for Payload {}

impl std::fmt::Debug for Payload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        (**self).fmt(f)
    }
}

impl Packet {
    /// Bytes of the datagram: header, XRC extension, payload.
    pub fn wire_len(&self) -> usize {
        let ext = if self.flags & F_XRC != 0 {
            XRC_EXT_LEN
        } else {
            0
        };
        HDR_LEN + ext + self.payload.len()
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(self.wire_len());
        self.write_header(&mut b);
        b.extend_from_slice(&self.payload);
        b
    }

    /// The datagram's bytes before the payload: header and XRC extension (a socket send
    /// hands the kernel these and the payload side by side, without joining them).
    pub fn header(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(HDR_LEN + XRC_EXT_LEN);
        self.write_header(&mut b);
        b
    }

    fn write_header(&self, b: &mut Vec<u8>) {
        b.extend_from_slice(&MAGIC.to_le_bytes());
        b.extend_from_slice(&[self.op, self.flags, self.syndrome, self.ecn]);
        for v in [
            self.dst_qpn,
            self.src_qpn,
            self.psn,
            self.msg_len,
            self.offset,
            self.imm,
        ] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        b.extend_from_slice(&self.remote_addr.to_le_bytes());
        b.extend_from_slice(&self.rkey.to_le_bytes());
        b.extend_from_slice(&(self.payload.len() as u32).to_le_bytes());
        if self.flags & F_XRC != 0 {
            b.extend_from_slice(&self.srqn.to_le_bytes());
        }
    }

    /// Parse a datagram; `None` for anything malformed (wrong magic, op, lengths, PSN range,
    /// ECN bits).
    pub fn decode(b: &[u8]) -> Option<Packet> {
        if b.len() < HDR_LEN {
            return None;
        }
        let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().unwrap());
        if u32_at(0) != MAGIC {
            return None;
        }
        let op = b[4];
        if !(OP_SEND..=OP_MAX).contains(&op) {
            return None;
        }
        let plen = u32_at(44) as usize;
        let flags = b[5];
        let ext = if flags & F_XRC != 0 { XRC_EXT_LEN } else { 0 };
        if b.len() != HDR_LEN + ext + plen {
            return None;
        }
        let psn = u32_at(16);
        if psn > PSN_MASK || b[7] & !ECN_MASK != 0 {
            return None;
        }
        Some(Packet {
            op,
            flags,
            syndrome: b[6],
            ecn: b[7],
            dst_qpn: u32_at(8),
            src_qpn: u32_at(12),
            psn,
            msg_len: u32_at(20),
            offset: u32_at(24),
            imm: u32_at(28),
            remote_addr: u64::from_le_bytes(b[32..40].try_into().unwrap()),
            rkey: u32_at(40),
            srqn: if ext != 0 { u32_at(HDR_LEN) } else { 0 },
            payload: b[HDR_LEN + ext..].to_vec().into(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn psn_math_wraps_at_24_bits() {
        assert_eq!(psn_add(PSN_MASK, 1), 0);
        assert_eq!(psn_diff(0, PSN_MASK), 1);
        assert_eq!(psn_diff(PSN_MASK, 0), -1);
        assert_eq!(psn_diff(100, 90), 10);
    }

    #[test]
    fn packet_roundtrip_and_garbage() {
        let p = Packet {
            op: OP_WRITE,
            flags: F_FIRST | F_LAST,
            dst_qpn: 17,
            src_qpn: 18,
            psn: 0xabcdef,
            msg_len: 3,
            remote_addr: 0x1000,
            rkey: 77,
            payload: vec![1, 2, 3].into(),
            ..Default::default()
        };
        let e = p.encode();
        assert_eq!(Packet::decode(&e), Some(p));
        for cut in 0..e.len() {
            assert_eq!(Packet::decode(&e[..cut]), None);
        }
        let mut bad = e.clone();
        bad[4] = 99;
        assert_eq!(Packet::decode(&bad), None);
        let mut bad = e;
        bad[0] ^= 1;
        assert_eq!(Packet::decode(&bad), None);
    }

    #[test]
    fn xrc_requests_carry_the_srq_number_between_header_and_payload() {
        let p = Packet {
            op: OP_SEND,
            flags: F_FIRST | F_LAST | F_XRC,
            dst_qpn: 17,
            src_qpn: 18,
            msg_len: 2,
            srqn: 0x0123_4567,
            payload: vec![9, 8].into(),
            ..Default::default()
        };
        let e = p.encode();
        assert_eq!(e.len(), HDR_LEN + XRC_EXT_LEN + 2);
        assert_eq!(e[HDR_LEN..HDR_LEN + 4], 0x0123_4567u32.to_le_bytes());
        assert_eq!(Packet::decode(&e), Some(p.clone()));
        // The flag without its extension (or an extension without the flag) is malformed.
        let mut no_ext = e.clone();
        no_ext.drain(HDR_LEN..HDR_LEN + XRC_EXT_LEN);
        assert_eq!(Packet::decode(&no_ext), None);
        let mut no_flag = e;
        no_flag[5] &= !F_XRC;
        assert_eq!(Packet::decode(&no_flag), None);
    }

    #[test]
    fn the_ecn_field_travels_and_only_its_two_bits_are_valid() {
        let p = Packet {
            op: OP_WRITE,
            flags: F_FIRST | F_LAST,
            ecn: ECN_CE,
            payload: vec![5].into(),
            ..Default::default()
        };
        let e = p.encode();
        assert_eq!(e[7], ECN_CE);
        assert_eq!(Packet::decode(&e), Some(p));
        // A sender that predates the field sent 0 there: not marked.
        let mut old = e.clone();
        old[7] = 0;
        assert_eq!(Packet::decode(&old).map(|p| p.ecn), Some(0));
        let mut bad = e;
        bad[7] = 4;
        assert_eq!(Packet::decode(&bad), None);
        let cnp = Packet {
            op: OP_CNP,
            dst_qpn: 0x11,
            src_qpn: 0x12,
            ..Default::default()
        };
        assert_eq!(Packet::decode(&cnp.encode()), Some(cnp));
    }

    mod fuzz {
        use super::*;
        use proptest::prelude::*;

        fn packet() -> impl Strategy<Value = Packet> {
            (
                (OP_SEND..=OP_MAX, any::<u8>(), any::<u8>(), 0..=ECN_MASK),
                (any::<u32>(), any::<u32>(), 0..=PSN_MASK),
                (any::<u32>(), any::<u32>(), any::<u32>()),
                (any::<u64>(), any::<u32>(), any::<u32>()),
                proptest::collection::vec(any::<u8>(), 0..300),
            )
                .prop_map(
                    |(
                        (op, flags, syndrome, ecn),
                        (dst_qpn, src_qpn, psn),
                        (msg_len, offset, imm),
                        (remote_addr, rkey, srqn),
                        payload,
                    )| Packet {
                        op,
                        flags,
                        syndrome,
                        ecn,
                        dst_qpn,
                        src_qpn,
                        psn,
                        msg_len,
                        offset,
                        imm,
                        remote_addr,
                        rkey,
                        srqn: if flags & F_XRC != 0 { srqn } else { 0 },
                        payload: payload.into(),
                    },
                )
        }

        proptest! {
            #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

            /// Arbitrary datagrams never panic the decoder, and what it accepts re-encodes
            /// to the same bytes (nothing is silently reinterpreted).
            #[test]
            fn decoder_takes_arbitrary_bytes(b in proptest::collection::vec(any::<u8>(), 0..400)) {
                if let Some(p) = Packet::decode(&b) {
                    prop_assert_eq!(p.encode(), b);
                }
            }

            /// Valid headers with arbitrary bytes after them, truncated or extended, or with
            /// one byte flipped: decode or refuse, never panic; length mismatches are refused.
            #[test]
            fn decoder_takes_mangled_packets(
                p in packet(),
                cut in any::<prop::sample::Index>(),
                extra in proptest::collection::vec(any::<u8>(), 1..16),
                flip in any::<prop::sample::Index>(),
                bit in 0u8..8,
            ) {
                let e = p.encode();
                prop_assert_eq!(Packet::decode(&e), Some(p.clone()));
                let n = cut.index(e.len());
                prop_assert_eq!(Packet::decode(&e[..n]), None);
                let mut longer = e.clone();
                longer.extend_from_slice(&extra);
                prop_assert_eq!(Packet::decode(&longer), None);
                let mut f = e.clone();
                f[flip.index(e.len())] ^= 1 << bit;
                let _ = Packet::decode(&f);
            }
        }
    }
}
