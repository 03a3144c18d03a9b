//! Write combining: the payloads of consecutive packets of one message — a WRITE or SEND
//! at the responder, the responses to a READ at the requester — that land back to back in
//! one process are gathered and placed with one `process_vm_writev` instead of one per
//! packet. The call's fixed cost (finding the process, the ptrace access check, importing
//! the iovecs) was about 40 % of the engine's CPU in a same-host `ib_write_bw -s 65536`,
//! where a message is 16 packets. Each QP gathers its own runs (up to 16 at once), so the
//! transmitter's round robin, which interleaves the packets of every QP with work, does not
//! break them up.
//!
//! Nothing may observe or overtake gathered data, so it is placed:
//! - at the message's last packet (a READ's last response), before its completion and
//!   its ACK;
//! - a QP's own run before anything tells its peer how far the QP got (its ACKs and NAKs,
//!   atomic responses);
//! - everything before the engine handles a packet that is not a WRITE, SEND or READ
//!   response (every other access to process memory happens while handling one; a
//!   completion needs only its own message placed, as there is no ordering between QPs);
//! - everything at the end of every batch of received or looped-back packets, so that nothing
//!   is gathered while the engine's lock is free (the transmitter's reads and the verbs never
//!   find any).
//!
//! A combined write never spans two messages, so when placing fails (the target unmapped
//! registered memory) the error names the message it belongs to, as a per-packet write did.
//!
//! Gathering copies nothing: a run keeps the packets' payloads (shared slices, see
//! [`Payload`]) and the write's iovecs point at them — for a looped-back packet, straight at
//! the requester's staged message bytes.

use std::io;

use super::{write_mem_parts, Payload};

/// Most bytes gathered for one run before they are placed.
const MAX_GATHERED: usize = 256 << 10;
/// Most runs gathered at once (the transmitter's round robin interleaves the
/// packets of every QP with work; with `MAX_GATHERED` it bounds the engine's memory).
const MAX_RUNS: usize = 16;

/// Whose bytes a run holds. A QP receives WRITE and SEND data as a responder and READ
/// responses as a requester, interleaved: each side has its own run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Run {
    pub qpn: u32,
    pub reading: bool,
}

impl Run {
    pub fn responder(qpn: u32) -> Self {
        Run {
            qpn,
            reading: false,
        }
    }

    pub fn read(qpn: u32) -> Self {
        Run { qpn, reading: true }
    }
}

/// Payloads gathered for one place in one process.
struct Gathered {
    run: Run,
    /// PSN of the first packet gathered and the NAK syndrome to answer it with if placing
    /// fails (a WRITE's remote access error, a SEND's remote operational error).
    psn: u32,
    syndrome: u8,
    pid: i32,
    addr: u64,
    /// The payloads, back to back from `addr`, and how many bytes they hold.
    parts: Vec<Payload>,
    len: usize,
}

/// Where placing gathered bytes failed: the run, and the PSN to NAK and how (a responder's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct PlacementFault {
    pub run: Run,
    pub psn: u32,
    pub syndrome: u8,
}

/// The runs gathered, oldest first; at most one per `Run`.
#[derive(Default)]
pub(super) struct Combiner {
    gathered: Vec<Gathered>,
    /// Part lists of earlier placements, kept for the next ones (no allocation per message).
    spare: Vec<Vec<Payload>>,
}

impl Combiner {
    pub fn is_empty(&self) -> bool {
        self.gathered.is_empty()
    }

    /// Whether bytes of `run` are gathered.
    pub fn holds(&self, run: Run) -> bool {
        self.gathered.iter().any(|g| g.run == run)
    }

    /// Whether a packet of `run` landing at `addr` in `pid` extends what is gathered for it.
    pub fn continues(&self, run: Run, pid: i32, addr: u64, len: usize) -> bool {
        self.gathered.iter().any(|g| {
            g.run == run
                && g.pid == pid
                && g.addr.checked_add(g.len as u64) == Some(addr)
                && g.len + len <= MAX_GATHERED
        })
    }

    /// Whether a run that holds nothing may start gathering only once the oldest one is
    /// placed.
    pub fn is_full(&self) -> bool {
        self.gathered.len() >= MAX_RUNS
    }

    /// Add a packet's payload; `(psn, syndrome)`: the packet's PSN and how to NAK its
    /// message if placing fails. The caller placed what `run` had gathered unless this
    /// [`continues`](Self::continues) it, and made room if [`is_full`](Self::is_full).
    pub fn gather(
        &mut self,
        run: Run,
        (psn, syndrome): (u32, u8),
        pid: i32,
        addr: u64,
        data: Payload,
    ) {
        if self.continues(run, pid, addr, data.len()) {
            if let Some(g) = self.gathered.iter_mut().find(|g| g.run == run) {
                g.len += data.len();
                g.parts.push(data);
            }
            return;
        }
        debug_assert!(!self.holds(run), "gathered bytes dropped unplaced");
        debug_assert!(!self.is_full(), "gathering past the limit");
        let mut parts = self.spare.pop().unwrap_or_default();
        let len = data.len();
        parts.push(data);
        self.gathered.push(Gathered {
            run,
            psn,
            syndrome,
            pid,
            addr,
            parts,
            len,
        });
    }

    /// Write what `run` gathered into its process (nothing gathered: Ok).
    pub fn place(&mut self, run: Run) -> Result<(), PlacementFault> {
        match self.gathered.iter().position(|g| g.run == run) {
            Some(i) => self.place_at(i),
            None => Ok(()),
        }
    }

    /// Write the oldest run gathered into its process (nothing gathered: Ok).
    pub fn place_oldest(&mut self) -> Result<(), PlacementFault> {
        if self.gathered.is_empty() {
            return Ok(());
        }
        self.place_at(0)
    }

    fn place_at(&mut self, i: usize) -> Result<(), PlacementFault> {
        let mut g = self.gathered.remove(i);
        let r: io::Result<()> = write_mem_parts(g.pid, g.addr, &g.parts);
        let fault = PlacementFault {
            run: g.run,
            psn: g.psn,
            syndrome: g.syndrome,
        };
        if self.spare.len() < MAX_RUNS {
            // Emptied: the payloads' buffers are freed once nothing else shares them.
            g.parts.clear();
            self.spare.push(g.parts);
        }
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
        let mut c = Combiner::default();
        let (r7, r8) = (Run::responder(7), Run::responder(8));
        c.gather(r7, (100, 0), pid, base, vec![1, 2, 3, 4].into());
        assert!(c.continues(r7, pid, base + 4, 4));
        assert!(!c.continues(r8, pid, base + 4, 4), "another QP");
        assert!(
            !c.continues(Run::read(7), pid, base + 4, 4),
            "the QP's READs"
        );
        assert!(!c.continues(r7, pid, base + 8, 4), "a gap");
        assert!(!c.continues(r7, pid + 1, base + 4, 4), "another process");
        assert!(
            !c.continues(r7, pid, base + 4, MAX_GATHERED),
            "too much at once"
        );
        c.gather(r7, (101, 0), pid, base + 4, vec![5, 6, 7, 8].into());
        assert_eq!(target, [0; 12], "nothing is written before placing");
        assert_eq!(c.place(r8), Ok(()), "QP 8 gathered nothing");
        assert_eq!(c.place(r7), Ok(()));
        assert!(c.is_empty());
        assert_eq!(target[..8], [1, 2, 3, 4, 5, 6, 7, 8]);
        // The next message reuses the buffer and starts afresh.
        c.gather(r7, (102, 0), pid, base + 8, vec![9, 9, 9, 9].into());
        assert_eq!(c.place(r7), Ok(()));
        assert_eq!(target[8..], [9, 9, 9, 9]);
        assert_eq!(c.place_oldest(), Ok(()), "nothing gathered, nothing to do");
    }

    #[test]
    fn qps_gather_side_by_side_up_to_the_limit() {
        let pid = std::process::id() as i32;
        let mut target = vec![0u8; 4 * MAX_RUNS];
        let base = target.as_mut_ptr() as u64;
        let mut c = Combiner::default();
        // Interleaved packets of every QP, as the round robin sends them.
        for half in 0..2u64 {
            for q in 0..MAX_RUNS as u64 {
                let at = base + 4 * q + 2 * half;
                let run = Run::responder(q as u32);
                assert_eq!(c.continues(run, pid, at, 2), half == 1);
                c.gather(run, (half as u32, 0), pid, at, vec![q as u8 + 1; 2].into());
            }
        }
        assert!(c.is_full());
        assert_eq!(c.place_oldest(), Ok(()));
        assert!(!c.holds(Run::responder(0)) && c.holds(Run::responder(1)));
        assert_eq!(target[..6], [1, 1, 1, 1, 0, 0]);
        while !c.is_empty() {
            assert_eq!(c.place_oldest(), Ok(()));
        }
        let want: Vec<u8> = (1..=MAX_RUNS as u8).flat_map(|q| [q; 4]).collect();
        assert_eq!(target, want);
    }

    #[test]
    fn a_failed_placement_names_the_first_packet_gathered() {
        let pid = std::process::id() as i32;
        let mut c = Combiner::default();
        // Page 0 is never mapped.
        let run = Run::read(9);
        c.gather(run, (40, 5), pid, 16, vec![1; 8].into());
        c.gather(run, (41, 5), pid, 24, vec![2; 8].into());
        let fault = PlacementFault {
            run,
            psn: 40,
            syndrome: 5,
        };
        assert_eq!(c.place(run), Err(fault));
        assert!(c.is_empty());
    }
}
