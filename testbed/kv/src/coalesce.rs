//! Request coalescing (`drum-kv client --coalesce`): the RPC requests a connection posts at
//! once travel several to a SEND, as a batch ([`crate::proto::BATCH`]), the way eRPC and
//! HERD batch theirs. An RPC otherwise costs the NICs a message each way; with the server's
//! replies already batched, the request side is what is left (docs/kv.md, "RPC rate").
//! Off by default: it changes what a work request is in the paper's loop, which DRUM
//! governs, so the testbed's scenarios do not use it.

use crate::proto::BATCH_HEADER;
use std::ops::Range;

/// Splits requests of `lens` bytes, in order, into messages of at most `room` bytes: a run of
/// consecutive requests shares a message, behind one batch header, while it fits; a request
/// that fits with no other goes alone, as a plain request (however long it is).
pub fn groups(lens: &[usize], room: usize) -> Vec<Range<usize>> {
    let mut out = Vec::new();
    let mut start = 0;
    while start < lens.len() {
        let mut end = start + 1;
        let mut used = BATCH_HEADER + lens[start];
        while end < lens.len() && used + lens[end] <= room {
            used += lens[end];
            end += 1;
        }
        out.push(start..end);
        start = end;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn consecutive_requests_share_a_message_while_it_fits() {
        // six 40-byte GETs behind a 4-byte header fit 256 bytes, the seventh does not
        assert_eq!(groups(&[40; 7], 256), vec![0..6, 6..7]);
        // a PUT too long to share goes alone, and so does a request that fits no other
        assert_eq!(groups(&[40, 4136, 40, 40], 256), vec![0..1, 1..2, 2..4]);
        assert_eq!(groups(&[40, 220], 256), vec![0..1, 1..2]);
        assert_eq!(groups(&[40, 212], 256), vec![0..2]);
        assert_eq!(groups(&[], 256), Vec::<Range<usize>>::new());
        // no room for a batch: every request alone
        assert_eq!(groups(&[40; 3], 0), vec![0..1, 1..2, 2..3]);
    }
}
