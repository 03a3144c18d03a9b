//! What a completion belongs to, packed into its `wr_id`: the kind of work request, the
//! connection on the QP (several share one in SHARE mode) and the operation slot or receive
//! buffer. A reply's connection is in its payload instead, since any posted receive buffer
//! of a shared QP may catch it.

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WrKind {
    Read = 1,
    Send = 2,
    Recv = 3,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WrId {
    pub kind: WrKind,
    /// The connection's index on its QP (0 in RAW mode).
    pub conn: u16,
    /// The operation slot (Read, Send) or receive buffer (Recv).
    pub index: u32,
}

impl WrId {
    pub fn encode(self) -> u64 {
        (self.kind as u64) << 62 | (self.conn as u64) << 32 | self.index as u64
    }

    pub fn decode(v: u64) -> Option<WrId> {
        let kind = match v >> 62 {
            1 => WrKind::Read,
            2 => WrKind::Send,
            3 => WrKind::Recv,
            _ => return None,
        };
        if (v >> 48) & 0x3fff != 0 {
            return None;
        }
        Some(WrId {
            kind,
            conn: (v >> 32) as u16,
            index: v as u32,
        })
    }
}

/// An RPC's request id: the slot it occupies and the slot's use count, so a reply to an
/// earlier use of the slot is recognised as stale.
pub fn request_id(slot: u32, seq: u32) -> u64 {
    (seq as u64) << 32 | slot as u64
}

/// (slot, seq) of a request id.
pub fn split_request_id(req: u64) -> (u32, u32) {
    (req as u32, (req >> 32) as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wr_ids_round_trip_and_foreign_ones_are_refused() {
        for kind in [WrKind::Read, WrKind::Send, WrKind::Recv] {
            let w = WrId {
                kind,
                conn: 65535,
                index: u32::MAX,
            };
            assert_eq!(WrId::decode(w.encode()), Some(w));
        }
        assert_eq!(WrId::decode(7), None);
        assert_eq!(WrId::decode(1 << 62 | 1 << 50), None);
        assert_eq!(split_request_id(request_id(5, 9)), (5, 9));
    }
}
