//! Top-k QP gating as pure logic: at most `k` QPs of the app hold a slot, and only a slot
//! holder may put new work on the NIC. A holder that has had its slot for a quantum while
//! others wait is told to drain: it takes no new work and hands its slot on once its work
//! in flight has completed, so no QP starves and at no time do more than `k` QPs have work
//! on the NIC (DRUM's answer to QP-context cache thrashing). No clock: `now` is passed in.

use std::collections::VecDeque;

/// A QP, as the caller names it (the shim uses the QP number).
pub type QpId = u64;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Slot {
    /// May post.
    Holding,
    /// Holds a slot but must not post more; releases it when idle.
    Draining,
    /// Queued for a slot.
    Waiting,
    None,
}

#[derive(Debug, Clone)]
struct Holder {
    qp: QpId,
    since: u64,
    draining: bool,
}

#[derive(Debug, Clone, Default)]
pub struct Gate {
    holders: Vec<Holder>,
    waiting: VecDeque<QpId>,
}

impl Gate {
    pub const fn new() -> Gate {
        Gate {
            holders: Vec::new(),
            waiting: VecDeque::new(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.holders.is_empty() && self.waiting.is_empty()
    }

    pub fn waiting_qps(&self) -> Vec<QpId> {
        self.waiting.iter().copied().collect()
    }

    pub fn slot(&self, qp: QpId) -> Slot {
        match self.holders.iter().find(|h| h.qp == qp) {
            Some(h) if h.draining => Slot::Draining,
            Some(_) => Slot::Holding,
            None if self.waiting.contains(&qp) => Slot::Waiting,
            None => Slot::None,
        }
    }

    pub fn holders(&self) -> usize {
        self.holders.len()
    }

    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    /// `qp` has work to post: may it? Takes a free slot if there is one, else queues.
    pub fn request(&mut self, qp: QpId, now: u64, k: usize) -> bool {
        match self.slot(qp) {
            Slot::Holding => true,
            Slot::Draining | Slot::Waiting => false,
            Slot::None if self.holders.len() < k && self.waiting.is_empty() => {
                self.holders.push(Holder {
                    qp,
                    since: now,
                    draining: false,
                });
                true
            }
            Slot::None => {
                self.waiting.push_back(qp);
                false
            }
        }
    }

    /// `qp` has nothing queued and nothing in flight, or is gone: it gives up its slot (or
    /// its place in the queue). Returns the QPs that got a slot as a result.
    pub fn release(&mut self, qp: QpId, now: u64, k: usize) -> Vec<QpId> {
        self.holders.retain(|h| h.qp != qp);
        self.waiting.retain(|&w| w != qp);
        self.fill(now, k)
    }

    /// Hands free slots to waiting QPs in arrival order.
    pub fn fill(&mut self, now: u64, k: usize) -> Vec<QpId> {
        let mut granted = Vec::new();
        while self.holders.len() < k {
            let Some(qp) = self.waiting.pop_front() else {
                break;
            };
            self.holders.push(Holder {
                qp,
                since: now,
                draining: false,
            });
            granted.push(qp);
        }
        granted
    }

    /// Asks holders to drain: those beyond `k` (the grant shrank), and — oldest first — as
    /// many holders whose quantum has passed as there are waiting QPs not yet covered by a
    /// drain. Returns the QPs newly told to drain.
    pub fn rotate(&mut self, now: u64, quantum: u64, k: usize) -> Vec<QpId> {
        let mut told = Vec::new();
        let active = self.holders.iter().filter(|h| !h.draining).count();
        let mut excess = active.saturating_sub(k);
        let draining = self.holders.len() - active;
        let mut want = self.waiting.len().saturating_sub(draining);
        let mut order: Vec<usize> = (0..self.holders.len()).collect();
        order.sort_by_key(|&i| self.holders[i].since);
        for i in order {
            let h = &mut self.holders[i];
            if h.draining {
                continue;
            }
            if excess > 0 {
                excess -= 1;
            } else if want > 0 && now.saturating_sub(h.since) >= quantum {
                want -= 1;
            } else {
                continue;
            }
            h.draining = true;
            told.push(h.qp);
        }
        told
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn k_holders_then_queue_then_handover() {
        let mut g = Gate::default();
        assert!(g.request(1, 0, 2));
        assert!(g.request(2, 0, 2));
        assert!(!g.request(3, 0, 2));
        assert_eq!(g.slot(3), Slot::Waiting);
        assert!(g.request(1, 5, 2), "a holder keeps posting");
        assert_eq!(g.release(2, 10, 2), vec![3]);
        assert_eq!(g.slot(3), Slot::Holding);
    }

    #[test]
    fn quantum_rotates_long_holders_but_not_without_waiters() {
        let mut g = Gate::default();
        g.request(1, 0, 1);
        assert!(g.rotate(1000, 100, 1).is_empty(), "nobody waits");
        g.request(2, 1000, 1);
        assert!(g.rotate(1050, 100, 1) == vec![1]);
        assert_eq!(g.slot(1), Slot::Draining);
        assert!(!g.request(1, 1060, 1), "a draining QP takes no new work");
        assert!(
            g.rotate(2000, 100, 1).is_empty(),
            "one drain covers one waiter"
        );
        assert_eq!(g.release(1, 2000, 1), vec![2]);
        // QP 1 comes back with work: it waits its turn.
        assert!(!g.request(1, 2001, 1));
    }

    #[test]
    fn shrinking_k_drains_the_excess() {
        let mut g = Gate::default();
        for q in 0..4 {
            assert!(g.request(q, q, 4));
        }
        let told = g.rotate(10, 1_000_000, 2);
        assert_eq!(told, vec![0, 1], "the oldest holders drain");
        assert!(
            g.fill(10, 2).is_empty(),
            "no slot is free until they release"
        );
    }

    proptest! {
        /// Whatever the order of requests, releases and rotations, never more than k QPs
        /// may post, and every waiting QP eventually gets a slot once others release.
        #[test]
        fn never_more_than_k_posting_and_no_starvation(
            k in 1usize..5,
            ops in proptest::collection::vec((0u8..3, 0u64..8), 1..200),
        ) {
            let mut g = Gate::default();
            let mut now = 0;
            for (op, qp) in ops {
                now += 7;
                match op {
                    0 => { g.request(qp, now, k); }
                    1 => { g.release(qp, now, k); }
                    _ => { g.rotate(now, 20, k); }
                }
                let posting = (0..8).filter(|&q| g.slot(q) == Slot::Holding).count();
                prop_assert!(posting <= k);
                prop_assert!(g.holders() <= k.max(g.holders()));
            }
            // Everyone holding releases, repeatedly: the queue empties.
            for _ in 0..20 {
                now += 100;
                g.rotate(now, 20, k);
                for q in 0..8 {
                    if matches!(g.slot(q), Slot::Holding | Slot::Draining) {
                        g.release(q, now, k);
                    }
                }
            }
            prop_assert_eq!(g.waiting(), 0);
        }
    }
}
