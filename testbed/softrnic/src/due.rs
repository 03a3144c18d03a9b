//! Items held until a time: a min-heap on `(due, order of pushing)`, so items due at the same
//! instant leave in the order they came. Pure: the caller passes `now`.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::time::Instant;

#[derive(Debug)]
pub struct DueQueue<T> {
    heap: BinaryHeap<Reverse<Entry<T>>>,
    pushed: u64,
}

#[derive(Debug)]
struct Entry<T> {
    due: Instant,
    seq: u64,
    item: T,
}

impl<T> Entry<T> {
    fn key(&self) -> (Instant, u64) {
        (self.due, self.seq)
    }
}

impl<T> PartialEq for Entry<T> {
    fn eq(&self, other: &Self) -> bool {
        self.key() == other.key()
    }
}

impl<T> Eq for Entry<T> {}

impl<T> PartialOrd for Entry<T> {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl<T> Ord for Entry<T> {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.key().cmp(&other.key())
    }
}

impl<T> Default for DueQueue<T> {
    fn default() -> Self {
        DueQueue {
            heap: BinaryHeap::new(),
            pushed: 0,
        }
    }
}

impl<T> DueQueue<T> {
    pub fn push(&mut self, due: Instant, item: T) {
        self.pushed += 1;
        self.heap.push(Reverse(Entry {
            due,
            seq: self.pushed,
            item,
        }));
    }

    /// The next item due at `now`, if any.
    pub fn pop_due(&mut self, now: Instant) -> Option<T> {
        if self.next_due()? > now {
            return None;
        }
        self.heap.pop().map(|Reverse(e)| e.item)
    }

    /// When the next item is due.
    pub fn next_due(&self) -> Option<Instant> {
        self.heap.peek().map(|e| e.0.due)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn items_leave_when_due_and_ties_in_the_order_they_came() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let mut q = DueQueue::default();
        q.push(t0 + ms(2), "b");
        q.push(t0 + ms(1), "a");
        q.push(t0 + ms(2), "c");
        assert_eq!(q.next_due(), Some(t0 + ms(1)));
        assert_eq!(q.pop_due(t0), None);
        assert_eq!(q.pop_due(t0 + ms(1)), Some("a"));
        assert_eq!(q.pop_due(t0 + ms(1)), None);
        assert_eq!(q.pop_due(t0 + ms(5)), Some("b"));
        assert_eq!(q.pop_due(t0 + ms(5)), Some("c"));
        assert_eq!((q.pop_due(t0 + ms(5)), q.next_due()), (None, None));
    }
}
