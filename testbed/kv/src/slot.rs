//! The slot format: what a READ GET fetches and how the client decides whether what it got is
//! a value, a torn read or a wrong value.
//!
//! A slot is a 24-byte header followed by room for `max_value` bytes:
//! `version: u64 | tag: u64 | len: u32 | checksum: u32` (little endian). A value's bytes are a
//! pure function of `(seed, key, tag)` ([`fill_value`]), so any client can check any value it
//! reads — the initial fill (tag 0) and every PUT (a tag the writer chose) alike — without
//! having seen the write. The version is a sequence lock: odd while a PUT rewrites the slot,
//! so a reader that sees an odd version, or a value that disagrees with the header it came
//! with, read a slot in the middle of a PUT and reads again.

/// Bytes of a slot's header.
pub const HEADER: usize = 24;

/// A slot's header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub version: u64,
    pub tag: u64,
    pub len: u32,
    pub checksum: u32,
}

impl Header {
    pub fn encode(&self, out: &mut [u8]) {
        out[0..8].copy_from_slice(&self.version.to_le_bytes());
        out[8..16].copy_from_slice(&self.tag.to_le_bytes());
        out[16..20].copy_from_slice(&self.len.to_le_bytes());
        out[20..24].copy_from_slice(&self.checksum.to_le_bytes());
    }

    /// The header at the start of `b` (at least [`HEADER`] bytes).
    pub fn decode(b: &[u8]) -> Header {
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap());
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().unwrap());
        Header {
            version: u64_at(0),
            tag: u64_at(8),
            len: u32_at(16),
            checksum: u32_at(20),
        }
    }

    /// The version is odd while a PUT is rewriting the slot.
    pub fn stable(&self) -> bool {
        self.version % 2 == 0
    }
}

/// splitmix64: the generator of value bytes and of every random choice in the client
/// (fast, seedable, and good enough that a value is not confused with another's).
pub fn mix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn stream_base(seed: u64, key: u64, tag: u64) -> u64 {
    mix64(seed ^ mix64(key ^ mix64(tag)))
}

const ODD: u64 = 0x9e37_79b9_7f4a_7c15;

/// The i-th 8-byte word of the value whose stream starts at `base`: one xor and one multiply
/// (by an odd constant, so a bijection), so checking a 1 MiB value costs little; values of
/// different keys or tags differ in every word. Values of different lengths share their
/// prefix, so a GET of fewer bytes than the value holds is checkable too.
fn word(base: u64, i: u64) -> u64 {
    (base ^ i).wrapping_mul(ODD)
}

/// Writes the first `out.len()` bytes of the value of `(seed, key, tag)`.
pub fn fill_value(seed: u64, key: u64, tag: u64, out: &mut [u8]) {
    let base = stream_base(seed, key, tag);
    for (i, chunk) in out.chunks_mut(8).enumerate() {
        let w = word(base, i as u64).to_le_bytes();
        chunk.copy_from_slice(&w[..chunk.len()]);
    }
}

/// Whether `b` is the first `b.len()` bytes of the value of `(seed, key, tag)`.
#[cfg(test)]
pub fn value_matches(seed: u64, key: u64, tag: u64, b: &[u8]) -> bool {
    scan(Some(stream_base(seed, key, tag)), b).0
}

/// One pass over a value: whether it matches the stream at `base` (if given), and the sum
/// the checksum folds. The sum weighs each word by its position (words swapped do not
/// pass) without a chain of dependent multiplies.
fn scan(base: Option<u64>, b: &[u8]) -> (bool, u64) {
    let (mut ok, mut sum) = (true, 0u64);
    let mut words = b.chunks_exact(8);
    let mut i = 0u64;
    for c in &mut words {
        let w = u64::from_le_bytes(c.try_into().unwrap());
        if let Some(base) = base {
            ok &= w == word(base, i);
        }
        sum = sum.wrapping_add((w ^ i).wrapping_mul(ODD));
        i += 1;
    }
    let rest = words.remainder();
    if !rest.is_empty() {
        let mut last = [0u8; 8];
        last[..rest.len()].copy_from_slice(rest);
        if let Some(base) = base {
            ok &= rest == &word(base, i).to_le_bytes()[..rest.len()];
        }
        sum = sum.wrapping_add((u64::from_le_bytes(last) ^ i).wrapping_mul(ODD));
    }
    (ok, sum)
}

fn fold(key: u64, tag: u64, len: usize, sum: u64) -> u32 {
    let h = mix64(sum ^ mix64(key ^ 0x5bd1_e995) ^ mix64(tag) ^ (len as u64).rotate_left(32));
    (h ^ (h >> 32)) as u32
}

/// The checksum of a value: binds it to its key, tag and length, so a value of another key
/// or an older PUT does not pass.
pub fn checksum(key: u64, tag: u64, value: &[u8]) -> u32 {
    fold(key, tag, value.len(), scan(None, value).1)
}

/// What a reader makes of the bytes one READ of a slot returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadCheck {
    /// A value as some writer wrote it; `len` of its bytes were in the read.
    Value { version: u64, tag: u64, len: u32 },
    /// The slot changed while it was read: read again.
    Torn { version: u64 },
    /// A header that cannot be (length beyond the slot), or bytes that disagree with a
    /// header: torn if the version moves by the next read, wrong if it does not.
    Inconsistent { version: u64 },
}

/// Checks the bytes of a READ of `key`'s slot: header plus the first `read.len() - HEADER`
/// bytes of the value (the whole value when that is at least its length, and then the
/// checksum too).
pub fn check_read(seed: u64, key: u64, max_value: u32, read: &[u8]) -> ReadCheck {
    let h = Header::decode(read);
    if !h.stable() {
        return ReadCheck::Torn { version: h.version };
    }
    if h.len > max_value {
        return ReadCheck::Inconsistent { version: h.version };
    }
    let got = &read[HEADER..];
    let n = got.len().min(h.len as usize);
    let (matches, sum) = scan(Some(stream_base(seed, key, h.tag)), &got[..n]);
    let whole_ok = n < h.len as usize || fold(key, h.tag, n, sum) == h.checksum;
    if whole_ok && matches {
        ReadCheck::Value {
            version: h.version,
            tag: h.tag,
            len: n as u32,
        }
    } else {
        ReadCheck::Inconsistent { version: h.version }
    }
}

/// The verdict over successive reads of one slot: an inconsistent read is torn when the
/// slot's version has moved by the next read, and a wrong value when two reads in a row show
/// the same stable version and disagree with it.
#[derive(Debug, Default, Clone, Copy)]
pub struct Retry {
    last_inconsistent: Option<u64>,
}

/// What to do after a read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Done { version: u64, tag: u64, len: u32 },
    ReadAgain,
    Wrong,
}

impl Retry {
    pub fn judge(&mut self, check: ReadCheck) -> Verdict {
        match check {
            ReadCheck::Value { version, tag, len } => Verdict::Done { version, tag, len },
            ReadCheck::Torn { .. } => {
                self.last_inconsistent = None;
                Verdict::ReadAgain
            }
            ReadCheck::Inconsistent { version } => {
                if self.last_inconsistent.replace(version) == Some(version) {
                    Verdict::Wrong
                } else {
                    Verdict::ReadAgain
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn slot(seed: u64, key: u64, tag: u64, version: u64, len: usize, room: usize) -> Vec<u8> {
        let mut s = vec![0u8; HEADER + room];
        fill_value(seed, key, tag, &mut s[HEADER..HEADER + len]);
        let checksum = checksum(key, tag, &s[HEADER..HEADER + len]);
        Header {
            version,
            tag,
            len: len as u32,
            checksum,
        }
        .encode(&mut s);
        s
    }

    #[test]
    fn header_round_trips() {
        let h = Header {
            version: 7,
            tag: u64::MAX,
            len: 1 << 20,
            checksum: 0xdead_beef,
        };
        let mut b = [0u8; HEADER];
        h.encode(&mut b);
        assert_eq!(Header::decode(&b), h);
    }

    #[test]
    fn values_share_their_prefix_and_differ_by_key_tag_and_seed() {
        let mut a = vec![0u8; 100];
        let mut b = vec![0u8; 37];
        fill_value(1, 2, 3, &mut a);
        fill_value(1, 2, 3, &mut b);
        assert_eq!(&a[..37], &b[..]);
        assert!(value_matches(1, 2, 3, &a));
        assert!(!value_matches(1, 2, 4, &a));
        assert!(!value_matches(1, 3, 3, &a));
        assert!(!value_matches(2, 2, 3, &a));
    }

    #[test]
    fn the_checksum_sees_swapped_words_a_changed_tail_and_a_different_length() {
        let mut v = vec![0u8; 45];
        fill_value(1, 2, 3, &mut v);
        let c = checksum(2, 3, &v);
        let mut swapped = v.clone();
        swapped[..8].copy_from_slice(&v[8..16]);
        swapped[8..16].copy_from_slice(&v[..8]);
        assert_ne!(checksum(2, 3, &swapped), c);
        let mut tail = v.clone();
        tail[44] ^= 0x80;
        assert_ne!(checksum(2, 3, &tail), c);
        assert_ne!(checksum(2, 3, &v[..44]), c);
        assert_ne!(checksum(2, 4, &v), c);
        assert!(value_matches(1, 2, 3, &v) && !value_matches(1, 2, 3, &tail));
    }

    #[test]
    fn a_whole_value_reads_back() {
        let s = slot(9, 5, 0, 2, 32, 64);
        assert_eq!(
            check_read(9, 5, 64, &s[..HEADER + 32]),
            ReadCheck::Value {
                version: 2,
                tag: 0,
                len: 32
            }
        );
        // reading more than the value holds checks only the value
        assert!(matches!(
            check_read(9, 5, 64, &s),
            ReadCheck::Value { len: 32, .. }
        ));
        // a prefix is checked by content
        assert!(matches!(
            check_read(9, 5, 64, &s[..HEADER + 8]),
            ReadCheck::Value { len: 8, .. }
        ));
    }

    #[test]
    fn a_flipped_bit_another_key_or_a_mid_put_slot_does_not_pass() {
        let mut s = slot(9, 5, 1, 4, 64, 64);
        assert!(matches!(
            check_read(9, 6, 64, &s),
            ReadCheck::Inconsistent { .. }
        ));
        s[HEADER + 10] ^= 1;
        assert_eq!(
            check_read(9, 5, 64, &s),
            ReadCheck::Inconsistent { version: 4 }
        );
        let odd = slot(9, 5, 1, 5, 64, 64);
        assert_eq!(check_read(9, 5, 64, &odd), ReadCheck::Torn { version: 5 });
        let too_long = slot(9, 5, 1, 4, 64, 64);
        assert!(matches!(
            check_read(9, 5, 32, &too_long),
            ReadCheck::Inconsistent { .. }
        ));
    }

    #[test]
    fn a_value_half_overwritten_by_a_put_is_inconsistent() {
        let old = slot(3, 1, 0, 2, 64, 64);
        let new = slot(3, 1, 77, 4, 64, 64);
        let mut torn = old.clone();
        torn[HEADER + 32..].copy_from_slice(&new[HEADER + 32..]);
        assert!(matches!(
            check_read(3, 1, 64, &torn),
            ReadCheck::Inconsistent { .. }
        ));
    }

    #[test]
    fn retry_calls_a_stable_disagreeing_slot_wrong_and_a_moving_one_torn() {
        let mut r = Retry::default();
        assert_eq!(
            r.judge(ReadCheck::Inconsistent { version: 2 }),
            Verdict::ReadAgain
        );
        assert_eq!(
            r.judge(ReadCheck::Inconsistent { version: 4 }),
            Verdict::ReadAgain
        );
        assert_eq!(
            r.judge(ReadCheck::Inconsistent { version: 4 }),
            Verdict::Wrong
        );
        let mut r = Retry::default();
        assert_eq!(
            r.judge(ReadCheck::Inconsistent { version: 2 }),
            Verdict::ReadAgain
        );
        assert_eq!(r.judge(ReadCheck::Torn { version: 3 }), Verdict::ReadAgain);
        assert_eq!(
            r.judge(ReadCheck::Inconsistent { version: 2 }),
            Verdict::ReadAgain
        );
        assert!(matches!(
            r.judge(ReadCheck::Value {
                version: 4,
                tag: 1,
                len: 3
            }),
            Verdict::Done { .. }
        ));
    }
}
