//! Memory windows: an rkey that grants remote access to a sub-range of an MR, with its own
//! access rights, bound and invalidated through the send queue.
//!
//! Type 1 windows are bound with `ibv_bind_mw` (the provider posts a bind work request and
//! gives the window the next rkey, `ibv_inc_rkey`), may be re-bound at any time and are
//! unbound by a bind of length 0; they grant access through any QP of their PD. Type 2
//! windows are bound with an `IBV_WR_BIND_MW` work request that names the new rkey (the
//! application chooses its low 8 bits), only while not bound, and to the QP that bound them
//! (type 2B): only that QP's peer can use the rkey. They are invalidated by
//! `IBV_WR_LOCAL_INV` or by the peer's `IBV_WR_SEND_WITH_INV`. An rkey is `index << 8 | key`:
//! the index names the window, the key byte changes with each bind, so an old rkey stops
//! working as soon as the window is bound again or invalidated. A window bound with
//! `IBV_ACCESS_ZERO_BASED` is addressed by offsets from its start instead of by virtual
//! addresses.

use drum_verbs_abi::consts::*;

/// The remote rights a window may grant.
const REMOTE_RIGHTS: u32 =
    IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC;

/// Local rights in a bind's access, which a window cannot grant and mlx5 ignores (pyverbs'
/// memory-window tests bind with `IBV_ACCESS_LOCAL_WRITE`).
const IGNORED_LOCAL: u32 = IBV_ACCESS_LOCAL_WRITE;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Binding {
    /// The MR's key (lkey = rkey in softrnic).
    pub mr: u32,
    pub addr: u64,
    pub len: u64,
    pub access: u32,
    /// Type 2: the QP it is bound to.
    pub qpn: u32,
    /// Remote addresses are offsets from `addr` (`IBV_ACCESS_ZERO_BASED`).
    pub zero_based: bool,
}

#[derive(Debug)]
pub struct Mw {
    pub conn: u64,
    pub pd: u32,
    /// `IBV_MW_TYPE_1` or `IBV_MW_TYPE_2`.
    pub kind: i32,
    pub rkey: u32,
    pub bound: Option<Binding>,
}

/// What a bind work request asks for (decoded from the send WR, see `proto::SendWr`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BindReq {
    pub rkey: u32,
    pub mr: u32,
    pub addr: u64,
    pub len: u64,
    pub access: u32,
}

/// The MR a bind names, as far as binding needs it.
#[derive(Debug, Clone, Copy)]
pub struct MrView {
    pub conn: u64,
    pub pd: u32,
    pub addr: u64,
    pub len: u64,
    pub access: u32,
}

impl Mw {
    /// Bind (or, type 1 with length 0, unbind) through QP `qpn` of connection `conn` and PD
    /// `qp_pd`. Err: the completion status (`IBV_WC_MW_BIND_ERR`); the window is unchanged.
    pub fn bind(
        &mut self,
        conn: u64,
        qp_pd: u32,
        qpn: u32,
        b: &BindReq,
        mr: Option<MrView>,
    ) -> Result<(), i32> {
        let fail = Err(IBV_WC_MW_BIND_ERR);
        if self.conn != conn || self.pd != qp_pd || b.rkey >> 8 != self.rkey >> 8 {
            return fail;
        }
        if self.kind == IBV_MW_TYPE_1 && b.len == 0 {
            self.bound = None;
            self.rkey = b.rkey;
            return Ok(());
        }
        if self.kind == IBV_MW_TYPE_2 && self.bound.is_some() {
            // A type 2 window must be invalidated before it is bound again.
            return fail;
        }
        let Some(m) = mr else { return fail };
        let end = b.addr.checked_add(b.len);
        let inside = end.is_some_and(|e| b.addr >= m.addr && e <= m.addr + m.len);
        // Remote write and atomics through a window need a locally writable MR, as on the MR.
        let needs_local_write =
            b.access & (IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_ATOMIC) != 0;
        if m.conn != conn
            || m.pd != self.pd
            || m.access & IBV_ACCESS_MW_BIND == 0
            || b.len == 0
            || !inside
            || b.access & !(REMOTE_RIGHTS | IBV_ACCESS_ZERO_BASED | IGNORED_LOCAL) != 0
            || (needs_local_write && m.access & IBV_ACCESS_LOCAL_WRITE == 0)
        {
            return fail;
        }
        self.rkey = b.rkey;
        self.bound = Some(Binding {
            mr: b.mr,
            addr: b.addr,
            len: b.len,
            access: b.access & REMOTE_RIGHTS,
            qpn: if self.kind == IBV_MW_TYPE_2 { qpn } else { 0 },
            zero_based: b.access & IBV_ACCESS_ZERO_BASED != 0,
        });
        Ok(())
    }

    /// Invalidate type 2 window `rkey` (`IBV_WR_LOCAL_INV` from QP `qpn`, or the peer's
    /// SEND_WITH_INV arriving on it). Whether it was valid and is now invalidated.
    pub fn invalidate(&mut self, conn: u64, qp_pd: u32, qpn: u32, rkey: u32) -> bool {
        let ok = self.conn == conn
            && self.kind == IBV_MW_TYPE_2
            && self.pd == qp_pd
            && self.rkey == rkey
            && self.bound.is_some_and(|b| b.qpn == qpn);
        if ok {
            self.bound = None;
        }
        ok
    }

    /// Remote access through `rkey` arriving on QP `qpn` of PD `qp_pd` at remote address
    /// `addr`: the MR key to access and the virtual address `addr` stands for, if the window
    /// is bound with that rkey, grants `access` and holds the whole range.
    pub fn grant(
        &self,
        rkey: u32,
        qp_pd: u32,
        qpn: u32,
        addr: u64,
        len: u64,
        access: u32,
    ) -> Option<(u32, u64)> {
        let b = self.bound.as_ref()?;
        let va = if b.zero_based {
            b.addr.checked_add(addr)?
        } else {
            addr
        };
        let end = va.checked_add(len)?;
        let ok = self.rkey == rkey
            && self.pd == qp_pd
            && b.access & access != 0
            && (self.kind == IBV_MW_TYPE_1 || b.qpn == qpn)
            && va >= b.addr
            && end <= b.addr + b.len;
        ok.then_some((b.mr, va))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MR: MrView = MrView {
        conn: 1,
        pd: 3,
        addr: 0x1000,
        len: 0x1000,
        access: IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_MW_BIND,
    };

    fn mw(kind: i32) -> Mw {
        Mw {
            conn: 1,
            pd: 3,
            kind,
            rkey: 0x500,
            bound: None,
        }
    }

    fn req(rkey: u32, addr: u64, len: u64, access: u32) -> BindReq {
        BindReq {
            rkey,
            mr: 0x200,
            addr,
            len,
            access,
        }
    }

    #[test]
    fn type1_grants_only_the_bound_range_and_rights_and_rebinds() {
        let mut w = mw(IBV_MW_TYPE_1);
        let rw = IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE;
        assert_eq!(
            w.grant(0x500, 3, 9, 0x1000, 8, IBV_ACCESS_REMOTE_READ),
            None
        );
        w.bind(1, 3, 9, &req(0x501, 0x1100, 0x100, rw), Some(MR))
            .unwrap();
        let g = |w: &Mw, rkey, qpn, addr, len, acc| w.grant(rkey, 3, qpn, addr, len, acc);
        assert_eq!(
            g(&w, 0x501, 7, 0x1100, 0x100, IBV_ACCESS_REMOTE_READ),
            Some((0x200, 0x1100))
        );
        // Any QP of the PD; not another PD, not outside the range, not other rights.
        assert_eq!(
            w.grant(0x501, 4, 7, 0x1100, 8, IBV_ACCESS_REMOTE_READ),
            None
        );
        assert_eq!(g(&w, 0x501, 7, 0x10ff, 8, IBV_ACCESS_REMOTE_READ), None);
        assert_eq!(g(&w, 0x501, 7, 0x11f9, 8, IBV_ACCESS_REMOTE_READ), None);
        assert_eq!(g(&w, 0x501, 7, 0x1100, 8, IBV_ACCESS_REMOTE_ATOMIC), None);
        assert_eq!(g(&w, 0x500, 7, 0x1100, 8, IBV_ACCESS_REMOTE_READ), None);
        // Re-bind: the old rkey stops working; length 0 unbinds.
        w.bind(1, 3, 9, &req(0x502, 0x1000, 0x10, rw), Some(MR))
            .unwrap();
        assert_eq!(g(&w, 0x501, 7, 0x1000, 8, IBV_ACCESS_REMOTE_READ), None);
        assert_eq!(
            g(&w, 0x502, 7, 0x1000, 8, IBV_ACCESS_REMOTE_READ),
            Some((0x200, 0x1000))
        );
        w.bind(1, 3, 9, &req(0x503, 0, 0, 0), None).unwrap();
        assert_eq!(g(&w, 0x503, 7, 0x1000, 8, IBV_ACCESS_REMOTE_READ), None);
    }

    /// A zero-based window is addressed by offsets: remote address 0 is its first byte, and
    /// its length bounds the offsets; the flag is not a right of its own.
    #[test]
    fn zero_based_windows_translate_offsets_into_their_range() {
        let mut w = mw(IBV_MW_TYPE_1);
        let zr = IBV_ACCESS_REMOTE_READ | IBV_ACCESS_ZERO_BASED;
        w.bind(1, 3, 9, &req(0x501, 0x1100, 0x100, zr), Some(MR))
            .unwrap();
        let read = |addr, len| w.grant(0x501, 3, 7, addr, len, IBV_ACCESS_REMOTE_READ);
        assert_eq!(read(0, 0x100), Some((0x200, 0x1100)));
        assert_eq!(read(0xf8, 8), Some((0x200, 0x11f8)));
        assert_eq!(read(0xf9, 8), None);
        assert_eq!(read(0x1100, 8), None, "a virtual address is out of range");
        assert_eq!(read(u64::MAX, 1), None);
        assert_eq!(
            w.grant(0x501, 3, 7, 0, 8, IBV_ACCESS_ZERO_BASED),
            None,
            "ZERO_BASED grants nothing by itself"
        );
    }

    #[test]
    fn binds_are_checked_against_the_mr_and_the_pd() {
        let mut w = mw(IBV_MW_TYPE_1);
        let r = IBV_ACCESS_REMOTE_READ;
        let bad = |w: &mut Mw, conn, pd, b: BindReq, mr: Option<MrView>| {
            assert_eq!(
                w.bind(conn, pd, 9, &b, mr),
                Err(IBV_WC_MW_BIND_ERR),
                "{b:?}"
            );
        };
        bad(&mut w, 1, 3, req(0x501, 0x1f00, 0x200, r), Some(MR)); // beyond the MR
        bad(&mut w, 1, 3, req(0x501, 0x1000, 8, r), None); // no MR
        bad(&mut w, 1, 4, req(0x501, 0x1000, 8, r), Some(MR)); // QP of another PD
        bad(&mut w, 2, 3, req(0x501, 0x1000, 8, r), Some(MR)); // another process
        bad(&mut w, 1, 3, req(0x601, 0x1000, 8, r), Some(MR)); // another window's rkey
        let no_bind = MrView {
            access: IBV_ACCESS_LOCAL_WRITE,
            ..MR
        };
        bad(&mut w, 1, 3, req(0x501, 0x1000, 8, r), Some(no_bind));
        let read_only = MrView {
            access: IBV_ACCESS_MW_BIND,
            ..MR
        };
        let wr = IBV_ACCESS_REMOTE_WRITE;
        bad(&mut w, 1, 3, req(0x501, 0x1000, 8, wr), Some(read_only));
        bad(
            &mut w,
            1,
            3,
            req(0x501, 0x1000, 8, IBV_ACCESS_MW_BIND),
            Some(MR),
        );
        assert!(w.bound.is_none());
        assert_eq!(w.rkey, 0x500);
    }

    #[test]
    fn a_bind_ignores_local_write_as_mlx5_does() {
        let mut w = mw(IBV_MW_TYPE_1);
        let access = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ;
        w.bind(1, 3, 9, &req(0x501, 0x1000, 8, access), Some(MR))
            .unwrap();
        let r = IBV_ACCESS_REMOTE_READ;
        assert_eq!(w.grant(0x501, 3, 9, 0x1000, 8, r), Some((0x200, 0x1000)));
        assert_eq!(w.bound.unwrap().access, r, "the local bit grants nothing");
    }

    #[test]
    fn type2_is_bound_to_its_qp_and_invalidated_before_rebinding() {
        let mut w = mw(IBV_MW_TYPE_2);
        let r = IBV_ACCESS_REMOTE_READ;
        w.bind(1, 3, 9, &req(0x5aa, 0x1000, 0x100, r), Some(MR))
            .unwrap();
        assert_eq!(w.grant(0x5aa, 3, 9, 0x1000, 8, r), Some((0x200, 0x1000)));
        assert_eq!(w.grant(0x5aa, 3, 7, 0x1000, 8, r), None);
        assert_eq!(
            w.bind(1, 3, 9, &req(0x5ab, 0x1000, 0x100, r), Some(MR)),
            Err(IBV_WC_MW_BIND_ERR)
        );
        assert!(!w.invalidate(1, 3, 9, 0x5ab)); // wrong rkey
        assert!(!w.invalidate(1, 3, 7, 0x5aa)); // another QP
        assert!(w.invalidate(1, 3, 9, 0x5aa));
        assert_eq!(w.grant(0x5aa, 3, 9, 0x1000, 8, r), None);
        assert!(!w.invalidate(1, 3, 9, 0x5aa)); // already invalid
        w.bind(1, 3, 9, &req(0x5ab, 0x1000, 0x100, r), Some(MR))
            .unwrap();
        assert_eq!(w.grant(0x5ab, 3, 9, 0x1000, 8, r), Some((0x200, 0x1000)));
    }
}
