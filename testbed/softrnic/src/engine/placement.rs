//! Write combining at the responder: the payloads of consecutive packets of one RDMA WRITE
//! that land back to back in one process are gathered and placed with one
//! `process_vm_writev` instead of one per packet. The call's fixed cost (finding the process,
//! the ptrace access check, importing the iovecs) was about 40 % of the engine's CPU in a
//! same-host `ib_write_bw -s 65536`, where a message is 16 packets.
//!
//! Nothing may observe or overtake gathered data, so it is placed:
//! - at the message's last packet, before its completion and its ACK;
//! - before the engine emits any packet (an ACK must never acknowledge unplaced data) or adds
//!   any completion;
//! - before a packet other than the next WRITE packet of the same QP is handled (every other
//!   access to process memory happens while handling one);
//! - at the end of every batch of received or looped-back packets, so that nothing is gathered
//!   while the engine's lock is free (the transmitter's reads and the verbs never find any).
//!
//! A combined write never spans two messages, so when placing fails (the target unmapped
//! registered memory) the error names the message it belongs to, as a per-packet write did.

use std::io;

use super::write_mem;

/// Most bytes gathered before they are placed (bounds the engine's memory per engine).
const MAX_GATHERED: usize = 256 << 10;

/// Bytes gathered for one place in one process.
struct Gathered {
    qpn: u32,
    /// PSN of the first packet gathered (the one a NAK names if placing fails).
    psn: u32,
    pid: i32,
    addr: u64,
    data: Vec<u8>,
}

/// Where placing gathered bytes failed: the responder QP and the PSN to NAK.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct PlacementFault {
    pub qpn: u32,
    pub psn: u32,
}

#[derive(Default)]
pub(super) struct WriteCombiner {
    gathered: Option<Gathered>,
    /// The buffer of the last placement, kept for the next one (no allocation per message).
    spare: Vec<u8>,
}

impl WriteCombiner {
    pub fn is_empty(&self) -> bool {
        self.gathered.is_none()
    }

    /// Whether a WRITE packet of `qpn` to `addr` in `pid` extends what is gathered (then
    /// [`Self::gather`] needs nothing placed first).
    pub fn continues(&self, qpn: u32, pid: i32, addr: u64, len: usize) -> bool {
        self.gathered.as_ref().is_some_and(|g| {
            g.qpn == qpn
                && g.pid == pid
                && g.addr.checked_add(g.data.len() as u64) == Some(addr)
                && g.data.len() + len <= MAX_GATHERED
        })
    }

    /// Add a packet's payload. The caller placed what was gathered unless it
    /// [`continues`](Self::continues) there.
    pub fn gather(&mut self, qpn: u32, psn: u32, pid: i32, addr: u64, data: &[u8]) {
        if self.continues(qpn, pid, addr, data.len()) {
            if let Some(g) = self.gathered.as_mut() {
                g.data.extend_from_slice(data);
            }
            return;
        }
        debug_assert!(self.gathered.is_none(), "gathered bytes dropped unplaced");
        let mut buf = std::mem::take(&mut self.spare);
        buf.clear();
        buf.extend_from_slice(data);
        self.gathered = Some(Gathered {
            qpn,
            psn,
            pid,
            addr,
            data: buf,
        });
    }

    /// Write what is gathered into its process.
    pub fn place(&mut self) -> Result<(), PlacementFault> {
        let Some(g) = self.gathered.take() else {
            return Ok(());
        };
        let r: io::Result<()> = write_mem(g.pid, g.addr, &g.data);
        let fault = PlacementFault {
            qpn: g.qpn,
            psn: g.psn,
        };
        self.spare = g.data;
        r.map_err(|_| fault)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn contiguous_packets_of_one_qp_are_placed_at_once() {
        let pid = std::process::id() as i32;
        let mut target = vec![0u8; 12];
        let base = target.as_mut_ptr() as u64;
        let mut c = WriteCombiner::default();
        c.gather(7, 100, pid, base, &[1, 2, 3, 4]);
        assert!(c.continues(7, pid, base + 4, 4));
        assert!(!c.continues(8, pid, base + 4, 4), "another QP");
        assert!(!c.continues(7, pid, base + 8, 4), "a gap");
        assert!(!c.continues(7, pid + 1, base + 4, 4), "another process");
        assert!(
            !c.continues(7, pid, base + 4, MAX_GATHERED),
            "too much at once"
        );
        c.gather(7, 101, pid, base + 4, &[5, 6, 7, 8]);
        assert_eq!(target, [0; 12], "nothing is written before placing");
        assert_eq!(c.place(), Ok(()));
        assert!(c.is_empty());
        assert_eq!(target[..8], [1, 2, 3, 4, 5, 6, 7, 8]);
        // The next message reuses the buffer and starts afresh.
        c.gather(7, 102, pid, base + 8, &[9, 9, 9, 9]);
        assert_eq!(c.place(), Ok(()));
        assert_eq!(target[8..], [9, 9, 9, 9]);
        assert_eq!(c.place(), Ok(()), "nothing gathered, nothing to do");
    }

    #[test]
    fn a_failed_placement_names_the_first_packet_gathered() {
        let pid = std::process::id() as i32;
        let mut c = WriteCombiner::default();
        // Page 0 is never mapped.
        c.gather(9, 40, pid, 16, &[1; 8]);
        c.gather(9, 41, pid, 24, &[2; 8]);
        assert_eq!(c.place(), Err(PlacementFault { qpn: 9, psn: 40 }));
        assert!(c.is_empty());
    }
}
