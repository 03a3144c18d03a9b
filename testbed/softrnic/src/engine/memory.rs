//! The NIC's memory table: protection domains, memory regions, memory windows and device
//! memory, each owned by the connection (the provider's context) that made it. Everything a
//! work request or a peer's request names by key is resolved here — local SGEs by lkey,
//! remote accesses by rkey through an MR or a window bound over one — and nothing here
//! touches a QP, a packet or the clock.

use super::*;

pub(super) struct Mr {
    pub(super) conn: u64,
    pub(super) pid: i32,
    pub(super) pd: u32,
    pub(super) addr: u64,
    pub(super) len: u64,
    /// The address work requests and peers use for it (`addr` unless registered with an
    /// IOVA of its own: zero-based MRs, device memory).
    pub(super) iova: u64,
    pub(super) access: u32,
}

impl Mr {
    /// The process address of `[va, va + len)` named by its IOVA, if the MR holds it all.
    fn translate(&self, va: u64, len: u64) -> Option<u64> {
        let end = va.checked_add(len)?;
        (va >= self.iova && end <= self.iova.checked_add(self.len)?)
            .then(|| self.addr + (va - self.iova))
    }
}

pub(super) struct MemoryTable {
    /// Protection domains: handle → owning connection.
    pds: IdMap<u64>,
    /// Memory regions by key (lkey = rkey); the engine's tests reach into it.
    pub(super) mrs: IdMap<Mr>,
    /// Memory windows by index (rkey >> 8).
    mws: IdMap<Mw>,
    /// Device memory reservations: handle → (connection, bytes).
    dms: IdMap<(u64, u64)>,
    /// The next MR or window key: index << 8 | an 8-bit key, never reused within a run.
    next_key: u32,
}

impl Default for MemoryTable {
    fn default() -> Self {
        MemoryTable {
            pds: IdMap::default(),
            mrs: IdMap::default(),
            mws: IdMap::default(),
            dms: IdMap::default(),
            next_key: 0x100,
        }
    }
}

impl MemoryTable {
    fn key(&mut self) -> u32 {
        let key = self.next_key;
        self.next_key = self.next_key.wrapping_add(0x101);
        key
    }

    /// Whether `pd` exists and belongs to `conn`.
    pub(super) fn pd_held_by(&self, pd: u32, conn: u64) -> bool {
        self.pds.get(&pd) == Some(&conn)
    }

    /// A new PD for `conn` under the handle `handle` gives, taken only once the device's
    /// limit allows it.
    pub(super) fn alloc_pd(&mut self, conn: u64, handle: impl FnOnce() -> u32) -> Result<u32, i32> {
        if self.pds.len() >= device::MAX_PD as usize {
            return Err(libc::ENOMEM);
        }
        let h = handle();
        self.pds.insert(h, conn);
        Ok(h)
    }

    /// Whether an MR or a window still lives in `pd`.
    pub(super) fn pd_in_use(&self, pd: u32) -> bool {
        self.mrs.values().any(|m| m.pd == pd) || self.mws.values().any(|w| w.pd == pd)
    }

    pub(super) fn remove_pd(&mut self, pd: u32) {
        self.pds.remove(&pd);
    }

    /// Whether MR `m` may be registered, before its pages are probed: its PD is its
    /// connection's, remote write or atomic access comes with local write (as the kernel
    /// enforces), its range does not wrap, and the device's limit is not reached.
    pub(super) fn admit_mr(&self, m: &Mr) -> Result<(), i32> {
        if !self.pd_held_by(m.pd, m.conn) {
            return Err(libc::EINVAL);
        }
        if m.access & (IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_ATOMIC) != 0
            && m.access & IBV_ACCESS_LOCAL_WRITE == 0
        {
            return Err(libc::EINVAL);
        }
        // Zero length only reaches here from a device-memory MR, which the kernel allows
        // (it grants nothing); plain MRs of zero bytes are refused by `RegMr` and the provider.
        if m.addr.checked_add(m.len).is_none() || m.iova.checked_add(m.len).is_none() {
            return Err(libc::EINVAL);
        }
        if self.mrs.len() >= device::MAX_MR as usize {
            return Err(libc::ENOMEM);
        }
        Ok(())
    }

    /// Register an admitted MR under a new key (its lkey and rkey).
    pub(super) fn insert_mr(&mut self, m: Mr) -> u32 {
        let key = self.key();
        self.mrs.insert(key, m);
        key
    }

    /// Deregister `conn`'s MR `lkey`; EBUSY while a window is bound over it (as the kernel).
    pub(super) fn dereg_mr(&mut self, conn: u64, lkey: u32) -> Result<(), i32> {
        match self.mrs.get(&lkey) {
            Some(m) if m.conn == conn => {
                if self
                    .mws
                    .values()
                    .any(|w| w.bound.is_some_and(|b| b.mr == lkey))
                {
                    return Err(libc::EBUSY);
                }
                self.mrs.remove(&lkey);
                Ok(())
            }
            _ => Err(libc::EINVAL),
        }
    }

    /// A new window of `kind` in `conn`'s `pd`; its rkey. Keys come from the MRs' allocator,
    /// so window and MR keys never collide.
    pub(super) fn alloc_mw(&mut self, conn: u64, pd: u32, kind: i32) -> Result<u32, i32> {
        if !self.pd_held_by(pd, conn) || !matches!(kind, IBV_MW_TYPE_1 | IBV_MW_TYPE_2) {
            return Err(libc::EINVAL);
        }
        if self.mws.len() >= device::MAX_MW as usize {
            return Err(libc::ENOMEM);
        }
        let rkey = self.key();
        self.mws.insert(
            rkey >> 8,
            Mw {
                conn,
                pd,
                kind,
                rkey,
                bound: None,
            },
        );
        Ok(rkey)
    }

    pub(super) fn dealloc_mw(&mut self, conn: u64, rkey: u32) -> Result<(), i32> {
        match self.mws.get(&(rkey >> 8)) {
            Some(w) if w.conn == conn => {
                self.mws.remove(&(rkey >> 8));
                Ok(())
            }
            _ => Err(libc::EINVAL),
        }
    }

    /// Reserve `len` bytes of device memory for `conn` under the handle `handle` gives, taken
    /// only once the reservation fits.
    pub(super) fn alloc_dm(
        &mut self,
        conn: u64,
        len: u64,
        handle: impl FnOnce() -> u32,
    ) -> Result<u32, i32> {
        let used: u64 = self.dms.values().map(|d| d.1).sum();
        if len == 0 {
            return Err(libc::EINVAL);
        }
        if len > device::MAX_DM_SIZE - used {
            return Err(libc::ENOMEM);
        }
        let h = handle();
        self.dms.insert(h, (conn, len));
        Ok(h)
    }

    pub(super) fn free_dm(&mut self, conn: u64, h: u32) -> Result<(), i32> {
        match self.dms.get(&h) {
            Some(d) if d.0 == conn => {
                self.dms.remove(&h);
                Ok(())
            }
            _ => Err(libc::EINVAL),
        }
    }

    /// Resolve local SGEs against MRs: same connection, same PD, in bounds, access; the
    /// process addresses and lengths of the non-empty ones.
    pub(super) fn resolve_local(
        &self,
        conn: u64,
        pd: u32,
        sges: &[Sge],
        need_write: bool,
    ) -> Option<Vec<(u64, u64)>> {
        let mut v = Vec::with_capacity(sges.len());
        for s in sges {
            if s.length == 0 {
                continue;
            }
            let m = self.mrs.get(&s.lkey)?;
            if m.conn != conn || m.pd != pd {
                return None;
            }
            if need_write && m.access & IBV_ACCESS_LOCAL_WRITE == 0 {
                return None;
            }
            v.push((m.translate(s.addr, s.length as u64)?, s.length as u64));
        }
        Some(v)
    }

    /// Remote access through `rkey` arriving on QP `qpn` of PD `pd` at remote address
    /// `addr`: the process to access and the address there, if an MR, or a memory window
    /// bound over one, grants it for the whole range (a zero-based window's remote addresses
    /// are offsets).
    pub(super) fn check_remote(
        &self,
        qpn: u32,
        pd: u32,
        rkey: u32,
        addr: u64,
        len: u64,
        access: u32,
    ) -> Option<(i32, u64)> {
        let m = match self.mrs.get(&rkey) {
            Some(m) => m,
            None => {
                let w = self.mws.get(&(rkey >> 8))?;
                let (mr, va) = w.grant(rkey, pd, qpn, addr, len, access)?;
                // The window lies inside its MR, which cannot go while it is bound.
                return self
                    .mrs
                    .get(&mr)
                    .and_then(|m| Some((m.pid, m.translate(va, len)?)));
            }
        };
        if m.pd != pd || m.access & access == 0 {
            return None;
        }
        Some((m.pid, m.translate(addr, len)?))
    }

    /// Execute a bind work request of QP `qpn` (connection `conn`, PD `pd`); Err: the
    /// completion status.
    pub(super) fn bind_mw(&mut self, conn: u64, pd: u32, qpn: u32, b: &BindReq) -> Result<(), i32> {
        let mr = self.mrs.get(&b.mr).map(|m| MrView {
            conn: m.conn,
            pd: m.pd,
            addr: m.iova,
            len: m.len,
            access: m.access,
        });
        match self.mws.get_mut(&(b.rkey >> 8)) {
            Some(w) => w.bind(conn, pd, qpn, b, mr),
            None => Err(IBV_WC_MW_BIND_ERR),
        }
    }

    /// Invalidate type 2 window `rkey` bound to QP `qpn` (of connection `conn`, PD `pd`).
    pub(super) fn invalidate_mw(&mut self, conn: u64, pd: u32, qpn: u32, rkey: u32) -> bool {
        self.mws
            .get_mut(&(rkey >> 8))
            .is_some_and(|w| w.invalidate(conn, pd, qpn, rkey))
    }

    /// QP `qpn` is gone: type 2 windows bound to it lose their binding with it.
    pub(super) fn unbind_qp(&mut self, qpn: u32) {
        for w in self.mws.values_mut() {
            if w.kind == IBV_MW_TYPE_2 && w.bound.is_some_and(|b| b.qpn == qpn) {
                w.bound = None;
            }
        }
    }

    /// Connection `conn` closed: everything it registered goes.
    pub(super) fn drop_conn(&mut self, conn: u64) {
        self.mws.retain(|_, w| w.conn != conn);
        self.mrs.retain(|_, m| m.conn != conn);
        self.dms.retain(|_, d| d.0 != conn);
        self.pds.retain(|_, c| *c != conn);
    }
}
