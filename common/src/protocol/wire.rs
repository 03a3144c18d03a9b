//! Wire messages and framing.
//!
//! A frame is an 8-byte header — magic `b"DR"`, protocol version (u16, big endian), payload
//! length (u32, big endian) — followed by the payload, one message in bincode 2's standard
//! encoding. The header is checked as soon as its 8 bytes are in, so an unknown version or an
//! oversized length is refused before any payload is buffered. Any error poisons the stream
//! (framing is lost), so the peer's connection is closed; other connections are unaffected.

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

/// The version this build speaks. A peer announcing another one is refused, never guessed at.
pub const PROTOCOL_VERSION: u16 = 1;
pub const MAGIC: [u8; 2] = *b"DR";
pub const HEADER_LEN: usize = 8;
/// Hard limit on a payload: a host reports at most k facilities, so real messages are a few
/// hundred bytes; 1 MiB leaves room for large k while bounding what a peer can make us buffer.
pub const MAX_FRAME: usize = 1 << 20;

#[derive(Clone, Debug, thiserror::Error, PartialEq, Eq)]
pub enum WireError {
    #[error("bad magic {0:02x?}: not a DRUM control-plane frame")]
    BadMagic([u8; 2]),
    #[error("unsupported protocol version {got} (this build speaks {PROTOCOL_VERSION})")]
    UnsupportedVersion { got: u16 },
    #[error("frame of {len} bytes exceeds the limit of {MAX_FRAME} bytes")]
    Oversized { len: usize },
    #[error("malformed payload: {0}")]
    Malformed(String),
    #[error("payload has {0} trailing bytes after the message")]
    TrailingBytes(usize),
    #[error("message does not encode: {0}")]
    Encode(String),
}

/// Agent → coordinator.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum AgentMsg {
    Join(Join),
    Contribution(ContributionMsg),
    Heartbeat {
        seq: u64,
    },
    /// Orderly departure: the coordinator removes the host's contribution at once.
    Leave,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Join {
    pub host: String,
    /// [`super::facility_digest`] of the agent's facility list.
    pub facility_digest: u64,
    /// `(facility, active pairs of this host using it)`, facility ascending.
    pub pairs: Vec<(u32, u32)>,
    /// The host's current `Σ b·x` per facility: a fresh agent's best response to zero prices,
    /// a rejoining one's last rates, so a restarted coordinator resumes warm.
    pub entries: Vec<(u32, f64)>,
    /// The last iteration the agent took part in (0 if none), so numbering survives a
    /// coordinator restart.
    pub last_iteration: u64,
    /// The `d_f` of that iteration (empty if none): a restarted coordinator rebuilds its duals
    /// from them (`u_f ≈ n_f·d_f` near convergence) instead of restarting prices from zero.
    pub last_d: Vec<(u32, f64)>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ContributionMsg {
    pub epoch: u64,
    pub iteration: u64,
    /// `Σ b·x` per facility after the host's x-step for this round, facility ascending.
    pub entries: Vec<(u32, f64)>,
}

/// Coordinator → agent.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum CoordMsg {
    Welcome {
        epoch: u64,
        iteration: u64,
        heartbeat_ms: u64,
    },
    Refused {
        reason: String,
    },
    /// Run the x-step for `iteration` with these `d_f` (only the host's facilities) and `ρ`.
    Round {
        epoch: u64,
        iteration: u64,
        rho: f64,
        d: Vec<(u32, f64)>,
    },
    HeartbeatAck {
        seq: u64,
    },
}

fn config() -> impl bincode::config::Config {
    bincode::config::standard().with_limit::<MAX_FRAME>()
}

/// One complete frame (header and payload) for `msg`.
pub fn encode<M: Serialize>(msg: &M) -> Result<Vec<u8>, WireError> {
    let payload = bincode::serde::encode_to_vec(msg, config())
        .map_err(|e| WireError::Encode(e.to_string()))?;
    if payload.len() > MAX_FRAME {
        return Err(WireError::Oversized { len: payload.len() });
    }
    let mut out = Vec::with_capacity(HEADER_LEN + payload.len());
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&PROTOCOL_VERSION.to_be_bytes());
    out.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    out.extend_from_slice(&payload);
    Ok(out)
}

/// Checks a header; returns the payload length.
pub fn parse_header(h: &[u8; HEADER_LEN]) -> Result<usize, WireError> {
    let magic = [h[0], h[1]];
    if magic != MAGIC {
        return Err(WireError::BadMagic(magic));
    }
    let version = u16::from_be_bytes([h[2], h[3]]);
    if version != PROTOCOL_VERSION {
        return Err(WireError::UnsupportedVersion { got: version });
    }
    let len = u32::from_be_bytes([h[4], h[5], h[6], h[7]]) as usize;
    if len > MAX_FRAME {
        return Err(WireError::Oversized { len });
    }
    Ok(len)
}

/// Decodes one payload, which must hold exactly one message.
pub fn decode_payload<M: DeserializeOwned>(payload: &[u8]) -> Result<M, WireError> {
    let (msg, used) = bincode::serde::decode_from_slice(payload, config())
        .map_err(|e| WireError::Malformed(e.to_string()))?;
    if used != payload.len() {
        return Err(WireError::TrailingBytes(payload.len() - used));
    }
    Ok(msg)
}

/// Reassembles frames from a byte stream that arrives in arbitrary pieces.
#[derive(Debug, Default)]
pub struct FrameDecoder {
    buf: Vec<u8>,
    /// Set after the first error: the stream has lost its framing for good.
    failed: Option<WireError>,
}

impl FrameDecoder {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn push(&mut self, bytes: &[u8]) {
        if self.failed.is_none() {
            self.buf.extend_from_slice(bytes);
        }
    }

    /// Bytes received but not yet consumed.
    pub fn buffered(&self) -> usize {
        self.buf.len()
    }

    /// The next complete message, `Ok(None)` if more bytes are needed.
    pub fn next_msg<M: DeserializeOwned>(&mut self) -> Result<Option<M>, WireError> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        let r = self.try_next();
        if let Err(e) = &r {
            self.failed = Some(e.clone());
            self.buf = Vec::new();
        }
        r
    }

    fn try_next<M: DeserializeOwned>(&mut self) -> Result<Option<M>, WireError> {
        if self.buf.len() < HEADER_LEN {
            // Refuse a bad magic or version from the first bytes on, not only once 8 arrived.
            if self.buf.len() >= 2 && self.buf[..2] != MAGIC {
                return Err(WireError::BadMagic([self.buf[0], self.buf[1]]));
            }
            return Ok(None);
        }
        let header: [u8; HEADER_LEN] = self.buf[..HEADER_LEN].try_into().expect("length checked");
        let len = parse_header(&header)?;
        if self.buf.len() < HEADER_LEN + len {
            return Ok(None);
        }
        let msg = decode_payload(&self.buf[HEADER_LEN..HEADER_LEN + len])?;
        self.buf.drain(..HEADER_LEN + len);
        Ok(Some(msg))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn join() -> AgentMsg {
        AgentMsg::Join(Join {
            host: "h1".into(),
            facility_digest: 42,
            pairs: vec![(0, 2), (3, 1)],
            entries: vec![(0, 0.5), (3, 0.25)],
            last_iteration: 7,
            last_d: vec![(0, 0.01)],
        })
    }

    #[test]
    fn frames_survive_arbitrary_splits() {
        let msgs = vec![
            join(),
            AgentMsg::Heartbeat { seq: 9 },
            AgentMsg::Leave,
            AgentMsg::Contribution(ContributionMsg {
                epoch: 1,
                iteration: 2,
                entries: vec![(1, 1.5)],
            }),
        ];
        let bytes: Vec<u8> = msgs.iter().flat_map(|m| encode(m).unwrap()).collect();
        for chunk in [1, 3, 7, 64] {
            let mut dec = FrameDecoder::new();
            let mut got = Vec::new();
            for piece in bytes.chunks(chunk) {
                dec.push(piece);
                while let Some(m) = dec.next_msg::<AgentMsg>().unwrap() {
                    got.push(m);
                }
            }
            assert_eq!(got, msgs);
            assert_eq!(dec.buffered(), 0);
        }
    }

    #[test]
    fn unknown_version_is_refused_by_number() {
        let mut f = encode(&AgentMsg::Leave).unwrap();
        f[2..4].copy_from_slice(&99u16.to_be_bytes());
        let mut dec = FrameDecoder::new();
        dec.push(&f);
        assert_eq!(
            dec.next_msg::<AgentMsg>(),
            Err(WireError::UnsupportedVersion { got: 99 })
        );
        // The stream stays refused: framing is lost.
        dec.push(&encode(&AgentMsg::Leave).unwrap());
        assert!(dec.next_msg::<AgentMsg>().is_err());
    }

    #[test]
    fn oversized_length_is_refused_before_the_payload_arrives() {
        let mut h = Vec::from(MAGIC);
        h.extend_from_slice(&PROTOCOL_VERSION.to_be_bytes());
        h.extend_from_slice(&((MAX_FRAME + 1) as u32).to_be_bytes());
        let mut dec = FrameDecoder::new();
        dec.push(&h);
        assert_eq!(
            dec.next_msg::<AgentMsg>(),
            Err(WireError::Oversized { len: MAX_FRAME + 1 })
        );
    }

    #[test]
    fn garbage_and_truncation() {
        let mut dec = FrameDecoder::new();
        dec.push(b"GET / HTTP/1.1\r\n");
        assert!(matches!(
            dec.next_msg::<AgentMsg>(),
            Err(WireError::BadMagic(_))
        ));
        // A truncated frame is simply incomplete: nothing is decoded from it.
        let f = encode(&join()).unwrap();
        let mut dec = FrameDecoder::new();
        dec.push(&f[..f.len() - 1]);
        assert_eq!(dec.next_msg::<AgentMsg>(), Ok(None));
        // A header that claims fewer bytes than the message needs is malformed.
        let mut short = f.clone();
        let len = (f.len() - HEADER_LEN - 1) as u32;
        short[4..8].copy_from_slice(&len.to_be_bytes());
        short.pop();
        let mut dec = FrameDecoder::new();
        dec.push(&short);
        assert!(matches!(
            dec.next_msg::<AgentMsg>(),
            Err(WireError::Malformed(_))
        ));
        // Extra bytes inside a payload are refused, not ignored.
        let mut long = encode(&AgentMsg::Leave).unwrap();
        long[4..8].copy_from_slice(&2u32.to_be_bytes());
        long.push(0);
        let mut dec = FrameDecoder::new();
        dec.push(&long);
        assert_eq!(dec.next_msg::<AgentMsg>(), Err(WireError::TrailingBytes(1)));
    }

    fn entries() -> impl Strategy<Value = Vec<(u32, f64)>> {
        prop::collection::vec((any::<u32>(), -1e9f64..1e9), 0..20)
    }

    fn agent_msg() -> impl Strategy<Value = AgentMsg> {
        prop_oneof![
            (
                "[a-z0-9-]{0,20}",
                any::<u64>(),
                prop::collection::vec((any::<u32>(), any::<u32>()), 0..10),
                entries(),
                any::<u64>(),
                entries(),
            )
                .prop_map(
                    |(host, facility_digest, pairs, entries, last_iteration, last_d)| {
                        AgentMsg::Join(Join {
                            host,
                            facility_digest,
                            pairs,
                            entries,
                            last_iteration,
                            last_d,
                        })
                    }
                ),
            (any::<u64>(), any::<u64>(), entries()).prop_map(|(epoch, iteration, entries)| {
                AgentMsg::Contribution(ContributionMsg {
                    epoch,
                    iteration,
                    entries,
                })
            }),
            any::<u64>().prop_map(|seq| AgentMsg::Heartbeat { seq }),
            Just(AgentMsg::Leave),
        ]
    }

    fn coord_msg() -> impl Strategy<Value = CoordMsg> {
        prop_oneof![
            (any::<u64>(), any::<u64>(), any::<u64>()).prop_map(|(epoch, iteration, hb)| {
                CoordMsg::Welcome {
                    epoch,
                    iteration,
                    heartbeat_ms: hb,
                }
            }),
            ".{0,40}".prop_map(|reason| CoordMsg::Refused { reason }),
            (any::<u64>(), any::<u64>(), 0.0f64..1e6, entries()).prop_map(
                |(epoch, iteration, rho, d)| CoordMsg::Round {
                    epoch,
                    iteration,
                    rho,
                    d
                }
            ),
            any::<u64>().prop_map(|seq| CoordMsg::HeartbeatAck { seq }),
        ]
    }

    proptest! {
        #[test]
        fn agent_messages_round_trip(m in agent_msg()) {
            let f = encode(&m).unwrap();
            let mut dec = FrameDecoder::new();
            dec.push(&f);
            prop_assert_eq!(dec.next_msg::<AgentMsg>().unwrap(), Some(m));
        }

        #[test]
        fn coordinator_messages_round_trip(m in coord_msg()) {
            let f = encode(&m).unwrap();
            let mut dec = FrameDecoder::new();
            dec.push(&f);
            prop_assert_eq!(dec.next_msg::<CoordMsg>().unwrap(), Some(m));
        }

        #[test]
        fn arbitrary_bytes_never_panic_the_decoder(
            bytes in prop::collection::vec(any::<u8>(), 0..512),
            valid_header in any::<bool>(),
        ) {
            let mut input = Vec::new();
            if valid_header {
                input.extend_from_slice(&MAGIC);
                input.extend_from_slice(&PROTOCOL_VERSION.to_be_bytes());
                input.extend_from_slice(&(bytes.len() as u32).to_be_bytes());
            }
            input.extend_from_slice(&bytes);
            let mut a = FrameDecoder::new();
            a.push(&input);
            while let Ok(Some(_)) = a.next_msg::<AgentMsg>() {}
            let mut c = FrameDecoder::new();
            c.push(&input);
            while let Ok(Some(_)) = c.next_msg::<CoordMsg>() {}
        }
    }
}
