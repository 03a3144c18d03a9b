//! Warn once per process, not once per scan: the auditors that report processes (grant
//! audit, ungoverned scanner, direct verbs) run every second and must not repeat a WARN while
//! the same process lasts, yet must warn again for a new process that reuses its pid.
//!
//! Pure: the caller decides what a key is and which keys are still present.

use std::collections::BTreeSet;

/// The keys warned about and still present.
#[derive(Debug)]
pub struct WarnedOnce<K> {
    warned: BTreeSet<K>,
}

impl<K> Default for WarnedOnce<K> {
    fn default() -> Self {
        WarnedOnce {
            warned: BTreeSet::new(),
        }
    }
}

impl<K: Ord> WarnedOnce<K> {
    /// Whether `key` is new: true the first time, false until it is forgotten.
    pub fn first(&mut self, key: K) -> bool {
        self.warned.insert(key)
    }

    /// Forgets the keys for which `present` is false, so that they are new again when they
    /// come back (a reused pid is another process).
    pub fn forget_absent(&mut self, mut present: impl FnMut(&K) -> bool) {
        self.warned.retain(|k| present(k));
    }

    pub fn is_empty(&self) -> bool {
        self.warned.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_is_first_once_until_it_is_forgotten() {
        let mut w = WarnedOnce::default();
        assert!(w.first((7, "a")));
        assert!(!w.first((7, "a")));
        assert!(w.first((7, "b")), "another key is new");
        w.forget_absent(|k| k.1 == "b");
        assert!(!w.first((7, "b")), "still present: remembered");
        assert!(w.first((7, "a")), "forgotten: new again");
        w.forget_absent(|_| false);
        assert!(w.is_empty());
    }
}
