//! The server's metrics: what it served, refused and carried, counted by its threads and read
//! as a [`Snapshot`] (JSON) — a line every `--stats-interval` and a file at exit
//! (`--stats-json`). GETs by READ are one-sided: the NIC serves them without the server
//! program, so no counter here sees them.

use crate::proto::Status;
use serde::{Deserialize, Serialize};
use std::sync::atomic::{AtomicU64, Ordering};

/// Counters shared by the CM thread and the pollers (relaxed: each is a tally on its own).
#[derive(Default)]
pub struct Metrics {
    accepted: AtomicU64,
    rejected: AtomicU64,
    /// Connections ended: the client disconnected or vanished (a DISCONNECTED event).
    disconnected: AtomicU64,
    /// Connections the server closed because their QP broke (e.g. an oversized message).
    broken: AtomicU64,
    gets: AtomicU64,
    puts: AtomicU64,
    get_value_bytes: AtomicU64,
    put_value_bytes: AtomicU64,
    request_bytes: AtomicU64,
    reply_bytes: AtomicU64,
    reply_messages: AtomicU64,
    request_messages: AtomicU64,
    /// Requests refused with an error reply, by status (index: the status's code).
    refused: [AtomicU64; 6],
}

fn add(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

impl Metrics {
    pub fn accepted(&self) {
        add(&self.accepted, 1)
    }

    pub fn rejected(&self) {
        add(&self.rejected, 1)
    }

    pub fn disconnected(&self) {
        add(&self.disconnected, 1)
    }

    pub fn broken(&self) {
        add(&self.broken, 1)
    }

    /// A request of `len` bytes arrived.
    pub fn request(&self, len: usize) {
        add(&self.request_bytes, len as u64)
    }

    /// A reply of `len` bytes was written.
    pub fn reply(&self, len: usize) {
        add(&self.reply_bytes, len as u64)
    }

    /// `n` messages of replies were posted.
    pub fn reply_messages(&self, n: usize) {
        add(&self.reply_messages, n as u64)
    }

    /// A message of requests was answered (and its receive posted again).
    pub fn request_message(&self) {
        add(&self.request_messages, 1)
    }

    pub fn get(&self, value_bytes: u32) {
        add(&self.gets, 1);
        add(&self.get_value_bytes, value_bytes as u64)
    }

    pub fn put(&self, value_bytes: u32) {
        add(&self.puts, 1);
        add(&self.put_value_bytes, value_bytes as u64)
    }

    pub fn refused(&self, why: Status) {
        add(&self.refused[why as usize], 1)
    }

    pub fn snapshot(&self, uptime_s: f64) -> Snapshot {
        let v = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let refused = |s: Status| v(&self.refused[s as usize]);
        let (accepted, disconnected, broken) =
            (v(&self.accepted), v(&self.disconnected), v(&self.broken));
        let refused = Refused {
            bad_length: refused(Status::BadLength),
            bad_op: refused(Status::BadOp),
            bad_key: refused(Status::BadKey),
            bad_size: refused(Status::BadSize),
            bad_checksum: refused(Status::BadChecksum),
        };
        Snapshot {
            uptime_s,
            connections: Connections {
                accepted,
                rejected: v(&self.rejected),
                // a broken connection is also disconnected later (its client sees the
                // close), so the two are not summed
                open: accepted.saturating_sub(disconnected),
                disconnected,
                broken,
            },
            gets: v(&self.gets),
            puts: v(&self.puts),
            get_value_bytes: v(&self.get_value_bytes),
            put_value_bytes: v(&self.put_value_bytes),
            request_bytes: v(&self.request_bytes),
            reply_bytes: v(&self.reply_bytes),
            reply_messages: v(&self.reply_messages),
            request_messages: v(&self.request_messages),
            errors: refused.total(),
            refused,
        }
    }
}

/// What the server had done by `uptime_s`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Snapshot {
    pub uptime_s: f64,
    pub connections: Connections,
    /// RPC GETs and PUTs served (READ GETs never reach the server program).
    pub gets: u64,
    pub puts: u64,
    /// Value bytes returned by GETs and stored by PUTs.
    pub get_value_bytes: u64,
    pub put_value_bytes: u64,
    /// Bytes of every request received and every reply sent (headers included).
    pub request_bytes: u64,
    pub reply_bytes: u64,
    /// SENDs that carried the replies (one carries several when requests arrive together).
    pub reply_messages: u64,
    /// RECVs that carried the requests (one carries several from a client that coalesces).
    pub request_messages: u64,
    /// Requests refused with an error reply (the sum of `refused`).
    pub errors: u64,
    pub refused: Refused,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Connections {
    pub accepted: u64,
    /// Connection requests refused (not a drum-kv client, or asking for too much).
    pub rejected: u64,
    /// Accepted and not disconnected yet.
    pub open: u64,
    pub disconnected: u64,
    /// Closed by the server because their QP broke.
    pub broken: u64,
}

/// Requests refused, by the status of their error reply.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Refused {
    pub bad_length: u64,
    pub bad_op: u64,
    pub bad_key: u64,
    pub bad_size: u64,
    pub bad_checksum: u64,
}

impl Refused {
    fn total(&self) -> u64 {
        self.bad_length + self.bad_op + self.bad_key + self.bad_size + self.bad_checksum
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_snapshot_adds_up_what_was_counted() {
        let m = Metrics::default();
        for _ in 0..3 {
            m.accepted();
        }
        m.rejected();
        m.disconnected();
        m.broken();
        m.get(32);
        m.get(4096);
        m.put(100);
        m.request(40);
        m.reply(72);
        m.reply_messages(1);
        m.request_message();
        m.refused(Status::BadKey);
        m.refused(Status::BadKey);
        m.refused(Status::BadChecksum);
        let s = m.snapshot(1.5);
        assert_eq!(
            s.connections,
            Connections {
                accepted: 3,
                rejected: 1,
                open: 2,
                disconnected: 1,
                broken: 1
            }
        );
        assert_eq!((s.gets, s.puts), (2, 1));
        assert_eq!((s.get_value_bytes, s.put_value_bytes), (4128, 100));
        assert_eq!((s.request_bytes, s.reply_bytes), (40, 72));
        assert_eq!((s.reply_messages, s.request_messages), (1, 1));
        assert_eq!((s.refused.bad_key, s.refused.bad_checksum), (2, 1));
        assert_eq!(s.errors, 3);
        let back: Snapshot = serde_json::from_str(&serde_json::to_string(&s).unwrap()).unwrap();
        assert_eq!(back, s);
    }
}
