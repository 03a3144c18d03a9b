//! The server's store: `keys` fixed slots in one buffer that clients READ directly, filled
//! deterministically from the seed, and rewritten in place by PUTs under a sequence lock
//! (see [`crate::slot`]).

use crate::proto::slot_size;
use crate::slot::{self, Header, HEADER};
use crate::verbs::Buffer;
use parking_lot::Mutex;
use std::sync::atomic::{fence, AtomicU64, Ordering};

/// PUTs and RPC GETs of one key are serialised by one of these locks (READs need none).
const STRIPES: usize = 64;

pub struct Store {
    buf: Buffer,
    pub keys: u64,
    pub max_value: u32,
    pub seed: u64,
    slot_size: usize,
    stripes: Vec<Mutex<()>>,
}

impl Store {
    /// Every key holds a `max_value`-byte value of tag 0 at version 2.
    pub fn new(keys: u64, max_value: u32, seed: u64) -> anyhow::Result<Store> {
        anyhow::ensure!(keys > 0, "--keys must be at least 1");
        let slot_size = slot_size(max_value) as usize;
        let total = (keys as usize)
            .checked_mul(slot_size)
            .filter(|&t| t <= 64 << 30)
            .ok_or_else(|| anyhow::anyhow!("{keys} keys of {max_value} bytes exceed 64 GiB"))?;
        let s = Store {
            buf: Buffer::new(total)?,
            keys,
            max_value,
            seed,
            slot_size,
            stripes: (0..STRIPES).map(|_| Mutex::new(())).collect(),
        };
        let mut value = vec![0u8; max_value as usize];
        for key in 0..keys {
            slot::fill_value(seed, key, 0, &mut value);
            s.write(key, 0, &value);
        }
        Ok(s)
    }

    pub fn buffer(&self) -> &Buffer {
        &self.buf
    }

    /// Where `key`'s slot starts in the buffer.
    pub fn offset(&self, key: u64) -> usize {
        key as usize * self.slot_size
    }

    fn version(&self, key: u64) -> &AtomicU64 {
        // SAFETY: slots are 64-byte aligned in a page-aligned buffer, the version is their
        // first 8 bytes, and it is only ever accessed atomically by this process.
        unsafe { &*(self.buf.ptr().add(self.offset(key)) as *const AtomicU64) }
    }

    /// Rewrites `key` with `value` (tag `tag`): version odd, value, header, version even, so a
    /// concurrent READ sees an odd version or a header that disagrees with the bytes.
    fn write(&self, key: u64, tag: u64, value: &[u8]) {
        let v = self.version(key);
        let old = v.load(Ordering::Relaxed);
        v.store(old | 1, Ordering::Relaxed);
        fence(Ordering::Release);
        let off = self.offset(key);
        // SAFETY: the stripe lock (or construction) makes this the only writer of the slot;
        // readers are the NIC, which copes with torn bytes by the version.
        let s = unsafe { self.buf.slice_mut(off + 8, HEADER - 8 + value.len()) };
        s[HEADER - 8..].copy_from_slice(value);
        let mut h = [0u8; HEADER];
        Header {
            version: 0,
            tag,
            len: value.len() as u32,
            checksum: slot::checksum(key, tag, value),
        }
        .encode(&mut h);
        s[..HEADER - 8].copy_from_slice(&h[8..]);
        fence(Ordering::Release);
        v.store((old | 1) + 1, Ordering::Release);
    }

    /// A PUT (already checked by the parser: key and size in range).
    pub fn put(&self, key: u64, tag: u64, value: &[u8]) {
        let _g = self.stripes[key as usize % STRIPES].lock();
        self.write(key, tag, value);
    }

    /// An RPC GET: copies the slot's header and the first `size` bytes of its room into
    /// `out` (`HEADER + size` bytes), as a READ of the slot would, but never torn.
    pub fn get_into(&self, key: u64, out: &mut [u8]) {
        let _g = self.stripes[key as usize % STRIPES].lock();
        // SAFETY: under the stripe lock no PUT writes the slot.
        out.copy_from_slice(unsafe { self.buf.slice(self.offset(key), out.len()) });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::slot::{check_read, ReadCheck};

    #[test]
    fn a_filled_store_reads_back_and_a_put_replaces_the_value() {
        let s = Store::new(4, 100, 11).unwrap();
        let mut out = vec![0u8; HEADER + 100];
        s.get_into(3, &mut out);
        assert_eq!(
            check_read(11, 3, 100, &out),
            ReadCheck::Value {
                version: 2,
                tag: 0,
                len: 100
            }
        );
        let mut v = vec![0u8; 40];
        slot::fill_value(11, 3, 77, &mut v);
        s.put(3, 77, &v);
        s.get_into(3, &mut out);
        assert_eq!(
            check_read(11, 3, 100, &out),
            ReadCheck::Value {
                version: 4,
                tag: 77,
                len: 40
            }
        );
        // the neighbours are untouched
        s.get_into(2, &mut out);
        assert!(matches!(
            check_read(11, 2, 100, &out),
            ReadCheck::Value { tag: 0, .. }
        ));
    }

    #[test]
    fn absurd_sizes_are_refused() {
        assert!(Store::new(0, 32, 1).is_err());
        assert!(Store::new(u64::MAX / 2, 1 << 20, 1).is_err());
    }
}
