//! The wire formats: the connection handshake carried in the RDMA CM's private data, and the
//! RPC requests and replies carried by SEND/RECV. Parsing checks every field, so a bad request
//! becomes an error reply, never a crash or an out-of-range access.

use crate::slot;

/// "DKV1": first bytes of both handshake messages, so a stranger's connection is refused.
pub const MAGIC: u32 = 0x444b_5631;

/// What a client asks for when it connects (the RDMA CM REQ carries at most 56 bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hello {
    /// Connections multiplexed on this QP (1 in RAW mode).
    pub share: u16,
    /// Requests each connection keeps outstanding at most.
    pub window: u32,
    /// The largest value the client will PUT or GET.
    pub max_size: u32,
}

pub const HELLO_LEN: usize = 14;

impl Hello {
    pub fn encode(&self) -> [u8; HELLO_LEN] {
        let mut b = [0u8; HELLO_LEN];
        b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        b[4..6].copy_from_slice(&self.share.to_le_bytes());
        b[6..10].copy_from_slice(&self.window.to_le_bytes());
        b[10..14].copy_from_slice(&self.max_size.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8]) -> Result<Hello, ProtoError> {
        if b.len() < HELLO_LEN || u32_at(b, 0) != MAGIC {
            return Err(ProtoError::NotAClient);
        }
        Ok(Hello {
            share: u16::from_le_bytes([b[4], b[5]]),
            window: u32_at(b, 6),
            max_size: u32_at(b, 10),
        })
    }
}

/// What the server tells a client it accepted: where the slots are and how to check them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Welcome {
    pub rkey: u32,
    pub addr: u64,
    pub keys: u64,
    pub max_value: u32,
    pub seed: u64,
}

pub const WELCOME_LEN: usize = 36;

impl Welcome {
    pub fn encode(&self) -> [u8; WELCOME_LEN] {
        let mut b = [0u8; WELCOME_LEN];
        b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        b[4..8].copy_from_slice(&self.rkey.to_le_bytes());
        b[8..16].copy_from_slice(&self.addr.to_le_bytes());
        b[16..24].copy_from_slice(&self.keys.to_le_bytes());
        b[24..28].copy_from_slice(&self.max_value.to_le_bytes());
        b[28..36].copy_from_slice(&self.seed.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8]) -> Result<Welcome, ProtoError> {
        if b.len() < WELCOME_LEN || u32_at(b, 0) != MAGIC {
            return Err(ProtoError::NotAServer);
        }
        Ok(Welcome {
            rkey: u32_at(b, 4),
            addr: u64_at(b, 8),
            keys: u64_at(b, 16),
            max_value: u32_at(b, 24),
            seed: u64_at(b, 28),
        })
    }

    /// Bytes from one slot to the next.
    pub fn slot_size(&self) -> u64 {
        slot_size(self.max_value)
    }
}

/// Slots are 64-byte aligned so a header never straddles a cache line.
pub fn slot_size(max_value: u32) -> u64 {
    (slot::HEADER as u64 + max_value as u64).div_ceil(64) * 64
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Op {
    Get = 1,
    Put = 2,
}

/// A request: `op u8 | 0 u8 ×3 | conn u32 | req u64 | key u64 | size u32 | checksum u32 |
/// tag u64`, then for a PUT the `size` bytes of the value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    pub op: Op,
    /// The client's connection, echoed in the reply (several share a QP in SHARE mode).
    pub conn: u32,
    pub req: u64,
    pub key: u64,
    pub size: u32,
    /// PUT: the checksum of the value (as [`slot::checksum`]), checked by the server.
    pub checksum: u32,
    /// PUT: the tag the value was generated from.
    pub tag: u64,
}

pub const REQUEST_HEADER: usize = 40;

impl Request {
    pub fn encode(&self, out: &mut [u8]) {
        out[0] = self.op as u8;
        out[1..4].fill(0);
        out[4..8].copy_from_slice(&self.conn.to_le_bytes());
        out[8..16].copy_from_slice(&self.req.to_le_bytes());
        out[16..24].copy_from_slice(&self.key.to_le_bytes());
        out[24..28].copy_from_slice(&self.size.to_le_bytes());
        out[28..32].copy_from_slice(&self.checksum.to_le_bytes());
        out[32..40].copy_from_slice(&self.tag.to_le_bytes());
    }

    /// Bytes of the request on the wire.
    pub fn wire_len(&self) -> usize {
        REQUEST_HEADER
            + match self.op {
                Op::Get => 0,
                Op::Put => self.size as usize,
            }
    }
}

/// First byte of a batch: several requests in one message, as a client that coalesces
/// (`drum-kv client --coalesce`) sends them: `3 u8 | 0 u8 ×3`, then the requests back to
/// back, each exactly its [`Request::wire_len`]. A message that does not start with it is one
/// request, as before.
pub const BATCH: u8 = 3;
pub const BATCH_HEADER: usize = 4;

/// Receive buffers hold at least this much, whatever the largest value: room for a batch of
/// small requests in one inline SEND (six 40-byte GETs).
const MIN_REQUEST_ROOM: usize = 256;

/// Bytes of a request message buffer (the server's receives) for values of up to `max_size`
/// bytes: one whole PUT, and never less than [`MIN_REQUEST_ROOM`], so small requests can
/// travel in batches.
pub fn request_room(max_size: u32) -> usize {
    (REQUEST_HEADER + max_size as usize).max(MIN_REQUEST_ROOM)
}

/// Writes a batch's header into `out` (its first [`BATCH_HEADER`] bytes).
pub fn encode_batch_header(out: &mut [u8]) {
    out[0] = BATCH;
    out[1..BATCH_HEADER].fill(0);
}

/// The byte ranges of the requests in one received message, in order. A message that is
/// not a batch is one request. In a batch each request ends where its header says; where
/// that cannot be told (a short or unknown request, a size beyond `limits`, a PUT longer
/// than what is left), the rest of the message is one more range, which
/// [`parse_request`] then refuses, so every byte gets an answer and none is read twice.
pub fn request_ranges(
    msg: &[u8],
    limits: Limits,
) -> impl Iterator<Item = std::ops::Range<usize>> + '_ {
    let batch = msg.len() > BATCH_HEADER && msg[0] == BATCH && msg[1..BATCH_HEADER] == [0; 3];
    let mut at = if batch { BATCH_HEADER } else { 0 };
    std::iter::from_fn(move || {
        let rest = msg.get(at..).filter(|r| !r.is_empty() || at == 0)?;
        let framed = (batch && rest.len() >= REQUEST_HEADER)
            .then(|| match rest[0] {
                1 => Some(REQUEST_HEADER),
                2 => {
                    let size = u32_at(rest, 24);
                    (size <= limits.max_value).then(|| REQUEST_HEADER + size as usize)
                }
                _ => None,
            })
            .flatten()
            .filter(|&len| len <= rest.len());
        let start = at;
        // past the end once the message is consumed (an empty message is one empty range)
        at += framed.unwrap_or(rest.len()).max(1);
        Some(start..start + framed.unwrap_or(rest.len()))
    })
}

/// The limits a request is checked against.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub keys: u64,
    pub max_value: u32,
}

/// A request the server cannot serve, and what its reply says.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ProtoError {
    #[error("truncated request")]
    Truncated,
    #[error("unknown opcode")]
    UnknownOp,
    #[error("key out of range")]
    KeyOutOfRange,
    #[error("size out of range")]
    SizeOutOfRange,
    #[error("PUT length disagrees with its size")]
    LengthMismatch,
    #[error("PUT value disagrees with its checksum")]
    BadChecksum,
    #[error("not a drum-kv client")]
    NotAClient,
    #[error("not a drum-kv server")]
    NotAServer,
}

impl ProtoError {
    pub fn status(self) -> Status {
        match self {
            ProtoError::Truncated | ProtoError::LengthMismatch => Status::BadLength,
            ProtoError::UnknownOp | ProtoError::NotAClient | ProtoError::NotAServer => {
                Status::BadOp
            }
            ProtoError::KeyOutOfRange => Status::BadKey,
            ProtoError::SizeOutOfRange => Status::BadSize,
            ProtoError::BadChecksum => Status::BadChecksum,
        }
    }
}

/// Parses the `len` bytes a RECV delivered. A PUT's value is checked against its checksum
/// here, so a corrupted PUT never reaches the store.
pub fn parse_request(b: &[u8], limits: Limits) -> Result<Request, ProtoError> {
    if b.len() < REQUEST_HEADER {
        return Err(ProtoError::Truncated);
    }
    let op = match b[0] {
        1 => Op::Get,
        2 => Op::Put,
        _ => return Err(ProtoError::UnknownOp),
    };
    let r = Request {
        op,
        conn: u32_at(b, 4),
        req: u64_at(b, 8),
        key: u64_at(b, 16),
        size: u32_at(b, 24),
        checksum: u32_at(b, 28),
        tag: u64_at(b, 32),
    };
    if r.key >= limits.keys {
        return Err(ProtoError::KeyOutOfRange);
    }
    if r.size > limits.max_value {
        return Err(ProtoError::SizeOutOfRange);
    }
    if op == Op::Put {
        if b.len() != r.wire_len() {
            return Err(ProtoError::LengthMismatch);
        }
        if slot::checksum(r.key, r.tag, &b[REQUEST_HEADER..]) != r.checksum {
            return Err(ProtoError::BadChecksum);
        }
    }
    Ok(r)
}

/// The conn and req of whatever arrived, for the error reply to a request that did not parse
/// (zeros where it was too short to say).
pub fn reply_address(b: &[u8]) -> (u32, u64) {
    let conn = if b.len() >= 8 { u32_at(b, 4) } else { 0 };
    let req = if b.len() >= 16 { u64_at(b, 8) } else { 0 };
    (conn, req)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Status {
    Ok = 0,
    BadLength = 1,
    BadOp = 2,
    BadKey = 3,
    BadSize = 4,
    BadChecksum = 5,
}

impl Status {
    pub fn from_u8(v: u8) -> Option<Status> {
        [
            Status::Ok,
            Status::BadLength,
            Status::BadOp,
            Status::BadKey,
            Status::BadSize,
            Status::BadChecksum,
        ]
        .into_iter()
        .find(|s| *s as u8 == v)
    }
}

/// A reply: `status u8 | op u8 | 0 u16 | conn u32 | req u64 | len u32 | 0 u32`, then `len`
/// bytes: for a GET the slot's header and the first `size` bytes of its value (as a READ of
/// the slot would return), else none. One SEND carries one or more replies back to back
/// (all to the same connection): the server answers the requests it found in one poll of a
/// QP with one message, so a reply costs the NICs a fraction of a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reply {
    pub status: Status,
    pub op: u8,
    pub conn: u32,
    pub req: u64,
    /// Bytes that follow the header.
    pub len: u32,
}

pub const REPLY_HEADER: usize = 24;

/// The smallest receive buffer for replies: room for a batch of replies to small GETs
/// (12 of 32 B values).
const MIN_REPLY_ROOM: usize = 1024;

/// Bytes of a reply message buffer (the client's receives, the server's replies) for
/// values of up to `max_size` bytes: one whole GET reply, and never less than
/// [`MIN_REPLY_ROOM`], so small replies can travel in batches.
pub fn reply_room(max_size: u32) -> usize {
    (REPLY_HEADER + slot::HEADER + max_size as usize).max(MIN_REPLY_ROOM)
}

impl Reply {
    pub fn encode(&self, out: &mut [u8]) {
        out[0] = self.status as u8;
        out[1] = self.op;
        out[2..4].fill(0);
        out[4..8].copy_from_slice(&self.conn.to_le_bytes());
        out[8..16].copy_from_slice(&self.req.to_le_bytes());
        out[16..20].copy_from_slice(&self.len.to_le_bytes());
        out[20..24].fill(0);
    }

    pub fn decode(b: &[u8]) -> Option<Reply> {
        if b.len() < REPLY_HEADER {
            return None;
        }
        Some(Reply {
            status: Status::from_u8(b[0])?,
            op: b[1],
            conn: u32_at(b, 4),
            req: u64_at(b, 8),
            len: u32_at(b, 16),
        })
    }
}

/// The replies of one message in order, each with its payload; `None` for bytes that are
/// not a whole reply (the rest of the message is not read).
pub fn replies(mut b: &[u8]) -> impl Iterator<Item = Option<(Reply, &[u8])>> {
    std::iter::from_fn(move || {
        if b.is_empty() {
            return None;
        }
        let whole = Reply::decode(b).and_then(|r| {
            let end = REPLY_HEADER.checked_add(r.len as usize)?;
            (end <= b.len()).then_some((r, end))
        });
        match whole {
            Some((r, end)) => {
                let payload = &b[REPLY_HEADER..end];
                b = &b[end..];
                Some(Some((r, payload)))
            }
            None => {
                b = &[];
                Some(None)
            }
        }
    })
}

fn u32_at(b: &[u8], i: usize) -> u32 {
    u32::from_le_bytes(b[i..i + 4].try_into().unwrap())
}

fn u64_at(b: &[u8], i: usize) -> u64 {
    u64::from_le_bytes(b[i..i + 8].try_into().unwrap())
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: Limits = Limits {
        keys: 10,
        max_value: 64,
    };

    fn put(key: u64, size: u32) -> Vec<u8> {
        let mut v = vec![0u8; size as usize];
        slot::fill_value(1, key, 9, &mut v);
        let r = Request {
            op: Op::Put,
            conn: 3,
            req: 4,
            key,
            size,
            checksum: slot::checksum(key, 9, &v),
            tag: 9,
        };
        let mut b = vec![0u8; r.wire_len()];
        r.encode(&mut b);
        b[REQUEST_HEADER..].copy_from_slice(&v);
        b
    }

    #[test]
    fn handshake_round_trips_and_strangers_are_refused() {
        let h = Hello {
            share: 5,
            window: 16,
            max_size: 1 << 20,
        };
        assert_eq!(Hello::decode(&h.encode()), Ok(h));
        let w = Welcome {
            rkey: 1,
            addr: 2,
            keys: 3,
            max_value: 4,
            seed: 5,
        };
        assert_eq!(Welcome::decode(&w.encode()), Ok(w));
        assert_eq!(Hello::decode(&[0; 56]), Err(ProtoError::NotAClient));
        assert_eq!(
            Hello::decode(&h.encode()[..10]),
            Err(ProtoError::NotAClient)
        );
        assert_eq!(Welcome::decode(&[0; 3]), Err(ProtoError::NotAServer));
    }

    #[test]
    fn a_good_put_and_get_parse() {
        let b = put(2, 64);
        let r = parse_request(&b, LIMITS).unwrap();
        assert_eq!((r.op, r.conn, r.req, r.key, r.size), (Op::Put, 3, 4, 2, 64));
        let g = Request {
            op: Op::Get,
            conn: 1,
            req: 2,
            key: 9,
            size: 64,
            checksum: 0,
            tag: 0,
        };
        let mut b = [0u8; REQUEST_HEADER];
        g.encode(&mut b);
        assert_eq!(parse_request(&b, LIMITS), Ok(g));
    }

    #[test]
    fn bad_requests_name_what_is_wrong() {
        let b = put(2, 32);
        assert_eq!(parse_request(&b[..39], LIMITS), Err(ProtoError::Truncated));
        assert_eq!(
            parse_request(&b[..50], LIMITS),
            Err(ProtoError::LengthMismatch)
        );
        let mut bad = b.clone();
        bad[0] = 7;
        assert_eq!(parse_request(&bad, LIMITS), Err(ProtoError::UnknownOp));
        let mut bad = b.clone();
        bad[16] = 10;
        assert_eq!(parse_request(&bad, LIMITS), Err(ProtoError::KeyOutOfRange));
        let mut bad = b.clone();
        bad[REQUEST_HEADER + 3] ^= 0x40;
        assert_eq!(parse_request(&bad, LIMITS), Err(ProtoError::BadChecksum));
        let big = put(2, 65);
        assert_eq!(parse_request(&big, LIMITS), Err(ProtoError::SizeOutOfRange));
        assert_eq!(reply_address(&b[..3]), (0, 0));
        assert_eq!(reply_address(&b[..20]), (3, 4));
    }

    #[test]
    fn replies_round_trip_and_unknown_statuses_are_refused() {
        let r = Reply {
            status: Status::BadKey,
            op: 1,
            conn: 7,
            req: 99,
            len: 0,
        };
        let mut b = [0u8; REPLY_HEADER];
        r.encode(&mut b);
        assert_eq!(Reply::decode(&b), Some(r));
        b[0] = 200;
        assert_eq!(Reply::decode(&b), None);
    }

    #[test]
    fn a_message_of_several_replies_splits_and_a_cut_one_is_refused() {
        let first = Reply {
            status: Status::Ok,
            op: 1,
            conn: 7,
            req: 1,
            len: 5,
        };
        let second = Reply {
            status: Status::BadKey,
            req: 2,
            len: 0,
            ..first
        };
        let mut b = vec![0u8; 2 * REPLY_HEADER + 5];
        first.encode(&mut b);
        b[REPLY_HEADER..REPLY_HEADER + 5].copy_from_slice(b"value");
        second.encode(&mut b[REPLY_HEADER + 5..]);
        let got: Vec<_> = replies(&b).collect();
        assert_eq!(
            got,
            vec![Some((first, &b"value"[..])), Some((second, &[][..]))]
        );
        // a payload longer than the message, a header cut short: refused, and the end
        assert_eq!(
            replies(&b[..REPLY_HEADER + 4]).collect::<Vec<_>>(),
            vec![None]
        );
        let cut: Vec<_> = replies(&b[..2 * REPLY_HEADER]).collect();
        assert_eq!(cut, vec![Some((first, &b"value"[..])), None]);
        assert_eq!(replies(&[]).count(), 0);
        assert_eq!(reply_room(32), 1024);
        assert_eq!(reply_room(1 << 20), REPLY_HEADER + 24 + (1 << 20));
    }

    fn split(msg: &[u8], limits: Limits) -> Vec<std::ops::Range<usize>> {
        request_ranges(msg, limits).collect()
    }

    fn get(key: u64) -> Vec<u8> {
        let g = Request {
            op: Op::Get,
            conn: 1,
            req: key,
            key,
            size: 8,
            checksum: 0,
            tag: 0,
        };
        let mut b = vec![0u8; REQUEST_HEADER];
        g.encode(&mut b);
        b
    }

    #[test]
    fn a_batch_splits_into_its_requests_and_what_cannot_be_framed_is_one_refused_rest() {
        let one = put(2, 64);
        assert_eq!(split(&one, LIMITS), vec![0..one.len()]);
        let mut b = vec![0u8; BATCH_HEADER];
        encode_batch_header(&mut b);
        for part in [get(1), put(2, 10), get(3)] {
            b.extend(part);
        }
        let ranges = split(&b, LIMITS);
        assert_eq!(ranges, vec![4..44, 44..94, 94..134]);
        let parsed: Vec<_> = ranges
            .iter()
            .map(|r| parse_request(&b[r.clone()], LIMITS).map(|r| (r.op, r.key)))
            .collect();
        assert_eq!(
            parsed,
            vec![Ok((Op::Get, 1)), Ok((Op::Put, 2)), Ok((Op::Get, 3))]
        );
        // cut inside the PUT: the rest is one range, refused for its length
        let cut = &b[..90];
        assert_eq!(split(cut, LIMITS), vec![4..44, 44..90]);
        assert_eq!(
            parse_request(&cut[44..90], LIMITS),
            Err(ProtoError::LengthMismatch)
        );
        // an unknown request ends the framing; a short tail is truncated
        let mut odd = b.clone();
        odd[44] = 9;
        assert_eq!(split(&odd, LIMITS), vec![4..44, 44..134]);
        assert_eq!(split(&b[..50], LIMITS), vec![4..44, 44..50]);
        assert_eq!(
            parse_request(&b[44..50], LIMITS),
            Err(ProtoError::Truncated)
        );
        // a PUT larger than the limits is not trusted to say where it ends
        let mut big = vec![0u8; BATCH_HEADER];
        encode_batch_header(&mut big);
        big.extend(put(2, 65));
        big.extend(get(1));
        assert_eq!(split(&big, LIMITS), vec![4..big.len()]);
        // a header alone, or the batch byte with other bytes beside it, is one request
        assert_eq!(split(&b[..4], LIMITS), vec![0..4]);
        let mut not_batch = b.clone();
        not_batch[2] = 1;
        assert_eq!(split(&not_batch, LIMITS), vec![0..b.len()]);
        assert_eq!(request_room(32), 256);
        assert_eq!(request_room(1 << 20), REQUEST_HEADER + (1 << 20));
    }

    #[test]
    fn slots_are_cache_line_aligned() {
        assert_eq!(slot_size(32), 64);
        assert_eq!(slot_size(40), 64);
        assert_eq!(slot_size(41), 128);
        assert_eq!(slot_size(1 << 20) % 64, 0);
    }

    proptest::proptest! {
        #[test]
        fn no_bytes_crash_the_parser(b in proptest::collection::vec(proptest::num::u8::ANY, 0..200)) {
            let _ = parse_request(&b, LIMITS);
            let _ = Reply::decode(&b);
            proptest::prop_assert!(replies(&b).count() <= b.len() / REPLY_HEADER + 1);
            let _ = Hello::decode(&b);
            let _ = Welcome::decode(&b);
            // the ranges tile the message (after a batch's header): in order, none empty,
            // every byte once, whether or not the bytes are a batch
            let batch: Vec<u8> = [BATCH, 0, 0, 0].iter().chain(&b).copied().collect();
            for msg in [&b, &batch] {
                let ranges = split(msg, LIMITS);
                let mut at = if ranges[0].start == BATCH_HEADER { BATCH_HEADER } else { 0 };
                for r in &ranges {
                    proptest::prop_assert!(r.start == at && (r.end > r.start || msg.is_empty()));
                    at = r.end;
                }
                proptest::prop_assert_eq!(at, msg.len());
            }
        }
    }
}
