//! A work request the shim holds back: a deep copy of the application's `ibv_send_wr`, so
//! the application may reuse its WR structures (and, for inline sends, its data buffer) as
//! soon as `ibv_post_send` returns, exactly as with a real provider. Non-inline data stays
//! in the application's registered memory, which it must not reuse before the completion
//! anyway.

use crate::ffi::{IbvSendWr, IbvSge, IBV_SEND_INLINE, IBV_SEND_SIGNALED};

/// Most scatter/gather entries a queued WR may have (real devices allow about 30).
pub const MAX_SGE: usize = 64;
/// Most inline bytes copied for one WR (real devices inline at most a few hundred).
pub const MAX_INLINE: u64 = 64 * 1024;

pub struct OwnedWr {
    wr: IbvSendWr,
    /// Kept so that `wr.sg_list` points into it (heap memory does not move with `self`).
    _sges: Vec<IbvSge>,
    _inline: Vec<u8>,
    pub bytes: u64,
    pub signalled: bool,
    /// When it was queued (the shim's clock, ns).
    pub queued_at: u64,
}

// SAFETY: the raw pointers inside point at this value's own heap buffers or at application
// memory that is valid until the WR completes, whichever thread posts it.
unsafe impl Send for OwnedWr {}

/// Why a WR is not queued (it is then handed to the provider unchanged, which reports it).
#[derive(Debug, PartialEq, Eq)]
pub enum Unqueueable {
    Sge(i32),
    NullSgList,
    InlineTooLong(u64),
}

impl OwnedWr {
    /// Copies `w` (not its successors).
    ///
    /// # Safety
    /// `w.sg_list` points to `w.num_sge` valid entries, and for an inline WR each entry's
    /// `addr` points to `length` readable bytes — what the provider itself would read.
    pub unsafe fn copy(w: &IbvSendWr, sig_all: bool, now: u64) -> Result<OwnedWr, Unqueueable> {
        let n = usize::try_from(w.num_sge)
            .ok()
            .filter(|&n| n <= MAX_SGE)
            .ok_or(Unqueueable::Sge(w.num_sge))?;
        if n > 0 && w.sg_list.is_null() {
            return Err(Unqueueable::NullSgList);
        }
        let src: &[IbvSge] = if n == 0 {
            &[]
        } else {
            // SAFETY: per the contract.
            unsafe { std::slice::from_raw_parts(w.sg_list, n) }
        };
        let bytes: u64 = src.iter().map(|s| u64::from(s.length)).sum();
        let mut inline = Vec::new();
        let mut sges: Vec<IbvSge> = src.to_vec();
        if w.send_flags & IBV_SEND_INLINE != 0 && bytes > 0 {
            if bytes > MAX_INLINE {
                return Err(Unqueueable::InlineTooLong(bytes));
            }
            inline.reserve_exact(bytes as usize);
            for s in src {
                // SAFETY: per the contract (inline data is read at post time).
                inline.extend_from_slice(unsafe {
                    std::slice::from_raw_parts(s.addr as *const u8, s.length as usize)
                });
            }
            sges = vec![IbvSge {
                addr: inline.as_ptr() as u64,
                length: bytes as u32,
                lkey: 0,
            }];
        }
        // SAFETY: IbvSendWr is plain C data; a bitwise copy is what the provider would read.
        let mut wr: IbvSendWr = unsafe { std::ptr::read(w) };
        wr.next = std::ptr::null_mut();
        wr.num_sge = sges.len() as i32;
        wr.sg_list = if sges.is_empty() {
            std::ptr::null_mut()
        } else {
            sges.as_mut_ptr()
        };
        Ok(OwnedWr {
            wr,
            _sges: sges,
            _inline: inline,
            bytes,
            signalled: sig_all || w.send_flags & IBV_SEND_SIGNALED != 0,
            queued_at: now,
        })
    }

    /// The WR to hand to the provider (a list of one).
    pub fn as_wr(&mut self) -> *mut IbvSendWr {
        &mut self.wr
    }

    /// Whether it is an RDMA READ (its data comes back from the peer).
    pub fn is_read(&self) -> bool {
        self.wr.opcode == crate::ffi::IBV_WR_RDMA_READ
    }

    pub fn wr_id(&self) -> u64 {
        self.wr.wr_id
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wr(sg: &mut [IbvSge], flags: u32) -> IbvSendWr {
        // SAFETY: an all-zero WR is valid.
        let mut w: IbvSendWr = unsafe { std::mem::zeroed() };
        w.wr_id = 7;
        w.sg_list = sg.as_mut_ptr();
        w.num_sge = sg.len() as i32;
        w.send_flags = flags;
        w
    }

    #[test]
    fn inline_data_is_copied_at_post_time() {
        let mut data = *b"hello, world";
        let mut sg = [
            IbvSge {
                addr: data.as_ptr() as u64,
                length: 5,
                lkey: 1,
            },
            IbvSge {
                addr: data[7..].as_ptr() as u64,
                length: 5,
                lkey: 1,
            },
        ];
        let w = wr(&mut sg, IBV_SEND_INLINE | IBV_SEND_SIGNALED);
        // SAFETY: valid fixtures.
        let mut o = unsafe { OwnedWr::copy(&w, false, 0) }.unwrap();
        data.fill(b'x'); // the application reuses its buffer at once
        let p = o.as_wr();
        // SAFETY: the copy's own list.
        let (n, s) = unsafe { ((*p).num_sge, *(*p).sg_list) };
        assert_eq!((n, s.length, o.bytes, o.signalled), (1, 10, 10, true));
        // SAFETY: the copy's inline buffer.
        let got = unsafe { std::slice::from_raw_parts(s.addr as *const u8, 10) };
        assert_eq!(got, b"helloworld");
    }

    #[test]
    fn non_inline_keeps_the_application_buffers_and_flags() {
        let buf = [0u8; 64];
        let mut o = {
            let mut sg = [IbvSge {
                addr: buf.as_ptr() as u64,
                length: 64,
                lkey: 9,
            }];
            let w = wr(&mut sg, 0);
            // SAFETY: valid fixtures.
            unsafe { OwnedWr::copy(&w, true, 3) }.unwrap()
            // The application's WR and sge array are gone after the post.
        };
        let p = o.as_wr();
        // SAFETY: the copy's own list.
        let s = unsafe { *(*p).sg_list };
        assert_eq!((s.addr, s.length, s.lkey), (buf.as_ptr() as u64, 64, 9));
        assert!(o.signalled, "sq_sig_all signals every WR");
        assert_eq!((o.wr_id(), o.queued_at), (7, 3));
    }

    #[test]
    fn malformed_wrs_are_not_queued() {
        let mut sg = [IbvSge {
            addr: 0,
            length: 1,
            lkey: 0,
        }];
        let mut w = wr(&mut sg, 0);
        w.num_sge = -1;
        assert_eq!(
            // SAFETY: the copy refuses before reading.
            unsafe { OwnedWr::copy(&w, false, 0) }.err(),
            Some(Unqueueable::Sge(-1))
        );
        w.num_sge = 1;
        w.sg_list = std::ptr::null_mut();
        assert_eq!(
            // SAFETY: as above.
            unsafe { OwnedWr::copy(&w, false, 0) }.err(),
            Some(Unqueueable::NullSgList)
        );
        let mut big = [IbvSge {
            addr: 0,
            length: 100_000,
            lkey: 0,
        }];
        let w = wr(&mut big, IBV_SEND_INLINE);
        assert_eq!(
            // SAFETY: as above.
            unsafe { OwnedWr::copy(&w, false, 0) }.err(),
            Some(Unqueueable::InlineTooLong(100_000))
        );
    }
}
