//! Maps keyed by numbers the engine and its NIC model hand out themselves (QP numbers, keys,
//! handles).

use std::collections::HashMap;

/// A map keyed by numbers the engine hands out itself (QP numbers, keys, handles). They are
/// hashed by one multiplication rather than SipHash, whose resistance to chosen keys buys
/// nothing here (peers and programs look numbers up, the engine alone inserts them) and which
/// took 5 % of the engine's time moving data between two QPs of one host.
pub type IdMap<V> = HashMap<u32, V, std::hash::BuildHasherDefault<IdHasher>>;

/// The hasher of [`IdMap`].
#[derive(Default)]
pub struct IdHasher(u64);

impl std::hash::Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.write_u32(u32::from(*b));
        }
    }

    fn write_u32(&mut self, n: u32) {
        // Fibonacci hashing: an odd constant spreads consecutive numbers over every bit.
        self.0 = (self.0 ^ u64::from(n)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}
