//! Asynchronous events (`ibv_get_async_event`): the per-context queue of events the engine
//! raised, and the bookkeeping a destroy needs.
//!
//! libibverbs reads 16-byte `struct ib_uverbs_async_event_desc` records (`element`: the
//! application's `ibv_cq *`, `ibv_qp *` or `ibv_srq *`; `event_type`) from the context's
//! `async_fd`, then calls the provider's `async_event` hook. On a kernel device a destroy
//! discards the object's events nobody has read yet and waits until every event that *was*
//! read has been acknowledged (`events_completed` reaching the kernel's `events_reported`),
//! so no event can name freed memory. A record written into a socket cannot be taken back
//! selectively, so the engine keeps at most **one** record of a context in its socket at a
//! time: the next is written only when the provider's hook says the last one was read
//! ([`EventQueue::consumed`]). A destroy then has at most one unread record of its object to
//! deal with, which the provider takes back from the socket itself (or, if the application
//! got to it first, waits for its acknowledgement as well).

use std::collections::{HashMap, VecDeque};

/// Events a context may have queued before further ones are dropped (an application that
/// never reads its events must not grow the engine without bound).
pub const MAX_PENDING: usize = 256;

pub use softrnic_abi::async_event::{record, RECORD_LEN};

/// The object an event is about (engine handles).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Obj {
    Cq(u32),
    Qp(u32),
    Srq(u32),
    /// The device's port (never destroyed: its events need no bookkeeping for a destroy).
    Port,
}

/// One context's asynchronous events.
#[derive(Debug, Default)]
pub struct EventQueue {
    pending: VecDeque<(Obj, [u8; RECORD_LEN])>,
    /// The record in the socket and not yet reported read; `Some(None)` once its object was
    /// destroyed (the record is then either taken back or read without being counted).
    in_flight: Option<Option<Obj>>,
    /// Events of each live object that the application has read.
    reported: HashMap<Obj, u32>,
}

impl EventQueue {
    /// Queue an event; false if it was dropped (queue full).
    pub fn push(&mut self, obj: Obj, element: u64, event_type: u32) -> bool {
        if self.pending.len() >= MAX_PENDING {
            return false;
        }
        self.pending.push_back((obj, record(element, event_type)));
        true
    }

    /// The next record to write to the socket, if none is there already.
    pub fn next_record(&mut self) -> Option<[u8; RECORD_LEN]> {
        if self.in_flight.is_some() {
            return None;
        }
        let (obj, r) = self.pending.pop_front()?;
        self.in_flight = Some(Some(obj));
        Some(r)
    }

    /// The record in the socket is gone: read by the application (`taken_back` false: it
    /// counts as reported to its object) or taken back by a destroy of its object.
    pub fn consumed(&mut self, taken_back: bool) {
        if let Some(Some(obj)) = self.in_flight.take() {
            if !taken_back {
                *self.reported.entry(obj).or_default() += 1;
            }
        }
    }

    /// `obj` is destroyed: drop its queued events. Returns how many of its events were read
    /// and whether the record in the socket is one of its own (not yet reported read).
    pub fn forget(&mut self, obj: Obj) -> (u32, bool) {
        self.pending.retain(|(o, _)| *o != obj);
        let unread = self.in_flight == Some(Some(obj));
        if unread {
            self.in_flight = Some(None);
        }
        (self.reported.remove(&obj).unwrap_or(0), unread)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use drum_verbs_abi::consts::*;

    #[test]
    fn record_layout_is_the_kernels() {
        let r = record(0x1122_3344_5566_7788, IBV_EVENT_SRQ_LIMIT_REACHED);
        assert_eq!(
            u64::from_ne_bytes(r[..8].try_into().unwrap()),
            0x1122_3344_5566_7788
        );
        assert_eq!(u32::from_ne_bytes(r[8..12].try_into().unwrap()), 15);
        assert_eq!(&r[12..], &[0; 4]);
    }

    #[test]
    fn one_record_at_a_time_and_reads_are_counted_per_object() {
        let mut q = EventQueue::default();
        assert!(q.next_record().is_none());
        q.push(Obj::Qp(1), 0xa, IBV_EVENT_COMM_EST);
        q.push(Obj::Srq(2), 0xb, IBV_EVENT_SRQ_LIMIT_REACHED);
        let r = q.next_record().unwrap();
        assert_eq!(r, record(0xa, IBV_EVENT_COMM_EST));
        // Nothing more until the first is read.
        assert!(q.next_record().is_none());
        q.consumed(false);
        assert_eq!(q.next_record(), Some(record(0xb, 15)));
        q.consumed(false);
        assert!(q.next_record().is_none());
        assert_eq!(q.forget(Obj::Qp(1)), (1, false));
        assert_eq!(q.forget(Obj::Srq(2)), (1, false));
        // Counts are gone with the object (handles may be reused).
        assert_eq!(q.forget(Obj::Qp(1)), (0, false));
    }

    #[test]
    fn destroy_drops_queued_events_and_flags_the_unread_one() {
        let mut q = EventQueue::default();
        q.push(Obj::Qp(1), 0xa, IBV_EVENT_QP_FATAL);
        q.push(Obj::Qp(1), 0xa, IBV_EVENT_QP_LAST_WQE_REACHED);
        q.push(Obj::Qp(2), 0xc, IBV_EVENT_QP_FATAL);
        q.next_record().unwrap();
        assert_eq!(q.forget(Obj::Qp(1)), (0, true));
        // The orphaned record blocks the queue until it is taken back or read, uncounted.
        assert!(q.next_record().is_none());
        q.consumed(false);
        assert_eq!(q.next_record(), Some(record(0xc, IBV_EVENT_QP_FATAL)));
        q.consumed(true);
        assert_eq!(q.forget(Obj::Qp(2)), (0, false));
        assert_eq!(q.forget(Obj::Qp(1)), (0, false));
    }

    #[test]
    fn a_queue_nobody_reads_is_bounded() {
        let mut q = EventQueue::default();
        let kept = (0..MAX_PENDING + 10)
            .filter(|&i| q.push(Obj::Cq(i as u32), 0, IBV_EVENT_CQ_ERR))
            .count();
        assert_eq!(kept, MAX_PENDING);
        assert_eq!(q.pending.len(), MAX_PENDING);
    }
}
