//! XRC (eXtended Reliable Connection). An XRC domain groups XRC SRQs and XRC target QPs;
//! processes of one host share a domain by opening it through the same file, as with the
//! kernel's `ibv_open_xrcd`. An initiator QP (`IBV_QPT_XRC_SEND`) is an RC requester whose
//! every request names an SRQ at the responder ([`wire::F_XRC`]); the target QP
//! (`IBV_QPT_XRC_RECV`) it is connected to checks that the SRQ belongs to its own domain and
//! then executes the request as an RC responder would, with the SRQ's receive, PD, owner
//! process and CQ — so one target QP serves every SRQ of its domain, whichever process of the
//! host created it.

use super::*;

impl Qp {
    /// Whether process `conn` has a handle of this QP (its own, or one from `ibv_open_qp`).
    pub(super) fn held_by(&self, conn: u64) -> bool {
        self.conn == conn || self.openers.iter().any(|o| o.0 == conn)
    }
}

pub(super) struct Xrcd {
    /// The file (device, inode) the domain was opened through; `None` for a private one.
    file: Option<(u64, u64)>,
    /// Opens not yet closed, per connection.
    opens: HashMap<u64, u32>,
}

impl State {
    pub(super) fn open_xrcd(&mut self, conn: u64, file: Option<(u64, u64)>, oflags: i32) -> Resp {
        let shared = file.and_then(|f| {
            self.xrcds
                .iter()
                .find(|(_, x)| x.file == Some(f))
                .map(|(h, _)| *h)
        });
        let h = match shared {
            Some(_) if oflags & libc::O_EXCL != 0 => return err(libc::EINVAL),
            Some(h) => h,
            None if file.is_some() && oflags & libc::O_CREAT == 0 => return err(libc::EINVAL),
            None => {
                if self.xrcds.len() >= device::MAX_XRCD as usize {
                    return err(libc::ENOMEM);
                }
                let h = self.handle();
                self.xrcds.insert(
                    h,
                    Xrcd {
                        file,
                        opens: HashMap::new(),
                    },
                );
                h
            }
        };
        if let Some(x) = self.xrcds.get_mut(&h) {
            *x.opens.entry(conn).or_default() += 1;
        }
        Resp::Handle(h)
    }

    /// Close one open of a domain. The last open of a process is refused (`EBUSY`) while
    /// the process still has XRC SRQs or target QPs in it; the domain goes with its last open.
    pub(super) fn close_xrcd(&mut self, conn: u64, xrcd: u32) -> Resp {
        let Some(&n) = self.xrcds.get(&xrcd).and_then(|x| x.opens.get(&conn)) else {
            return err(libc::EINVAL);
        };
        let in_use = self.srqs.values().any(|s| s.conn == conn && s.xrcd == xrcd)
            || self.qps.values().any(|q| q.held_by(conn) && q.xrcd == xrcd);
        if n == 1 && in_use {
            return err(libc::EBUSY);
        }
        self.drop_opens(xrcd, conn, n == 1);
        Resp::Unit
    }

    /// `ibv_open_qp`: another handle of XRC target `qpn` for a process that has its domain
    /// open. One handle per process (a second, or one for the QP's creator, is `EINVAL`:
    /// destroying a handle names only the QP, so two of one process could not be told apart).
    pub(super) fn open_qp(&mut self, conn: u64, xrcd: u32, qpn: u32) -> Resp {
        let opened = self.xrcd_opened_by(xrcd, conn);
        match self.qps.get_mut(&qpn) {
            Some(q)
                if opened && q.qpt == IBV_QPT_XRC_RECV && q.xrcd == xrcd && !q.held_by(conn) =>
            {
                q.openers.push((conn, 0));
                Resp::Qp { qpn, cap: q.cap }
            }
            _ => err(libc::EINVAL),
        }
    }

    /// A process gives up its handle of QP `qpn` (destroy, or exit). Returns whether that was
    /// the last handle, so the QP itself goes. An XRC target lives while any process holds
    /// it: when its creator lets go first, the oldest opener becomes the holder that gets its
    /// asynchronous events.
    pub(super) fn release_qp(&mut self, conn: u64, qpn: u32) -> bool {
        let Some(q) = self.qps.get_mut(&qpn) else {
            return false;
        };
        if let Some(i) = q.openers.iter().position(|o| o.0 == conn) {
            q.openers.remove(i);
            return false;
        }
        if q.openers.is_empty() {
            return true;
        }
        (q.conn, q.user) = q.openers.remove(0);
        false
    }

    /// A connection is gone (its SRQs and QPs went before): so are its opens.
    pub(super) fn forget_xrcd_opens(&mut self, conn: u64) {
        let mine: Vec<u32> = self
            .xrcds
            .iter()
            .filter(|(_, x)| x.opens.contains_key(&conn))
            .map(|(h, _)| *h)
            .collect();
        for h in mine {
            self.drop_opens(h, conn, true);
        }
    }

    fn drop_opens(&mut self, xrcd: u32, conn: u64, all: bool) {
        let Some(x) = self.xrcds.get_mut(&xrcd) else {
            return;
        };
        match x.opens.get_mut(&conn) {
            Some(n) if !all && *n > 1 => *n -= 1,
            _ => {
                x.opens.remove(&conn);
            }
        }
        if x.opens.is_empty() {
            self.xrcds.remove(&xrcd);
        }
    }

    /// Whether connection `conn` has domain `xrcd` open (objects may be created in it).
    pub(super) fn xrcd_opened_by(&self, xrcd: u32, conn: u64) -> bool {
        self.xrcds
            .get(&xrcd)
            .is_some_and(|x| x.opens.contains_key(&conn))
    }

    /// Whether request `p` to QP `qpn` may proceed: always, unless the QP is an XRC target
    /// and the packet's SRQ is not an XRC SRQ of the target's domain (an invalid request).
    pub(super) fn xrc_srq_ok(&self, qpn: u32, p: &Packet) -> bool {
        match self.qps.get(&qpn) {
            Some(q) if q.qpt == IBV_QPT_XRC_RECV => self
                .srqs
                .get(&p.srqn)
                .is_some_and(|s| s.xrcd != 0 && s.xrcd == q.xrcd),
            _ => true,
        }
    }

    /// The PD remote accesses of request `p` to QP `qpn` are checked against: the QP's, or
    /// for an XRC target (which has none) the PD of the SRQ the request names.
    pub(super) fn responder_pd(&self, qpn: u32, p: &Packet) -> Option<u32> {
        let q = self.qps.get(&qpn)?;
        if q.qpt != IBV_QPT_XRC_RECV {
            return Some(q.pd);
        }
        self.xrc_srq_ok(qpn, p)
            .then(|| self.srqs.get(&p.srqn).map(|s| s.pd))
            .flatten()
    }
}

/// Required and optional attribute masks of an XRC QP's transition: an initiator's are an
/// RC requester's, a target's an RC responder's (as the kernel's `ib_modify_qp_is_ok`
/// table). Each also accepts, as optional, what the other side requires, since programs
/// (perftest) set up both kinds with the same attributes.
pub(super) fn masks(qpt: i32, cur: i32, new: i32) -> Option<(i32, i32)> {
    let responder = IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER;
    let requester = IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC;
    let (rtr_extra, rts_extra) = if qpt == IBV_QPT_XRC_RECV {
        (responder, 0)
    } else {
        (0, requester)
    };
    let init = IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS;
    Some(match (cur, new) {
        (_, IBV_QPS_RESET) | (_, IBV_QPS_ERR) => (0, 0),
        (IBV_QPS_RESET, IBV_QPS_INIT) => (init, 0),
        (IBV_QPS_INIT, IBV_QPS_INIT) => (0, init),
        (IBV_QPS_INIT, IBV_QPS_RTR) => (
            IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN | rtr_extra,
            IBV_QP_PKEY_INDEX | IBV_QP_ACCESS_FLAGS | (responder & !rtr_extra),
        ),
        (IBV_QPS_RTR, IBV_QPS_RTS) => (
            IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | rts_extra,
            IBV_QP_ACCESS_FLAGS | IBV_QP_MIN_RNR_TIMER | (requester & !rts_extra),
        ),
        (IBV_QPS_RTS, IBV_QPS_RTS) => (0, IBV_QP_ACCESS_FLAGS | IBV_QP_MIN_RNR_TIMER),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn handle(r: Resp) -> u32 {
        match r {
            Resp::Handle(h) | Resp::Cq { handle: h, .. } | Resp::Srq { handle: h, .. } => h,
            Resp::Qp { qpn, .. } => qpn,
            o => panic!("{o:?}"),
        }
    }

    fn errno(r: Resp) -> i32 {
        match r {
            Resp::Err { errno, .. } => errno,
            o => panic!("{o:?}"),
        }
    }

    fn open(st: &mut State, conn: u64, file: Option<(u64, u64)>, oflags: i32) -> Resp {
        st.request(conn, 0, Req::OpenXrcd { file, oflags }, Instant::now())
    }

    fn target_qp(xrcd: u32) -> Req {
        Req::CreateQp {
            pd: 0,
            send_cq: 0,
            recv_cq: 0,
            srq: 0,
            xrcd,
            qp_type: IBV_QPT_XRC_RECV,
            sq_sig_all: false,
            cap: Caps::default(),
        }
    }

    /// Processes share a domain through its file (the kernel's O_CREAT and O_EXCL rules),
    /// create in it only while they have it open, cannot close it under their own SRQs and
    /// target QPs, and the domain goes with its last open (or its processes).
    #[test]
    fn domains_are_shared_through_their_file_and_outlive_no_open() {
        let mut st = State::new();
        let f = Some((0x803, 42));
        assert_eq!(errno(open(&mut st, 1, f, 0)), libc::EINVAL);
        let a = handle(open(&mut st, 1, f, libc::O_CREAT));
        assert_eq!(handle(open(&mut st, 2, f, libc::O_CREAT)), a);
        assert_eq!(
            errno(open(&mut st, 2, f, libc::O_CREAT | libc::O_EXCL)),
            libc::EINVAL
        );
        let private = handle(open(&mut st, 1, None, 0));
        assert_ne!(private, a);
        assert_eq!(handle(open(&mut st, 2, None, 0)), private + 1);

        let pd = handle(st.request(2, 0, Req::AllocPd, Instant::now()));
        let cq = handle(st.request(
            2,
            0,
            Req::CreateCq {
                cqe: 4,
                channel: 0,
                user: 0,
            },
            Instant::now(),
        ));
        let srq_in = |xrcd: u32, cq: u32| Req::CreateSrq {
            pd,
            max_wr: 4,
            max_sge: 1,
            xrcd,
            cq,
        };
        // Not opened by this process, or without a CQ: refused.
        assert_eq!(
            errno(st.request(3, 0, target_qp(a), Instant::now())),
            libc::EINVAL
        );
        assert_eq!(
            errno(st.request(2, 0, srq_in(a, 0), Instant::now())),
            libc::EINVAL
        );
        let srq = handle(st.request(2, 0, srq_in(a, cq), Instant::now()));
        assert_eq!(st.srqs[&srq].xrcd, a);
        assert_eq!(
            errno(st.request(2, 0, Req::DestroyCq { cq }, Instant::now())),
            libc::EBUSY
        );
        assert_eq!(
            errno(st.request(2, 0, Req::CloseXrcd { xrcd: a }, Instant::now())),
            libc::EBUSY
        );
        // A second open may be closed while the first still holds the SRQ.
        handle(open(&mut st, 2, f, libc::O_CREAT));
        assert_eq!(
            st.request(2, 0, Req::CloseXrcd { xrcd: a }, Instant::now()),
            Resp::Unit
        );
        assert_eq!(
            errno(st.request(2, 0, Req::CloseXrcd { xrcd: a }, Instant::now())),
            libc::EBUSY
        );
        let Resp::Destroyed { .. } = st.request(2, 0, Req::DestroySrq { srq }, Instant::now())
        else {
            panic!("destroy SRQ");
        };
        assert_eq!(
            st.request(2, 0, Req::CloseXrcd { xrcd: a }, Instant::now()),
            Resp::Unit
        );

        let tgt = st.request(1, 0, target_qp(a), Instant::now());
        let Resp::Qp { qpn, cap } = tgt else {
            panic!("{tgt:?}");
        };
        assert_eq!(cap.max_recv_wr, 0, "a target has no receive queue");
        assert_eq!(st.qps[&qpn].xrcd, a);
        assert!(st.xrcds.contains_key(&a));
        st.drop_conn(1, Instant::now());
        assert!(!st.xrcds.contains_key(&a) && !st.xrcds.contains_key(&private));
        st.drop_conn(2, Instant::now());
        assert!(st.xrcds.is_empty());
    }

    /// `ibv_open_qp`: only a process with the domain open, one handle each; the target lives
    /// until its last handle goes, and its creator's departure hands it to the oldest opener.
    #[test]
    fn opened_targets_outlive_their_creators_handle() {
        let mut st = State::new();
        let f = Some((1, 2));
        let x = handle(open(&mut st, 1, f, libc::O_CREAT));
        let qpn = handle(st.request(1, 0, target_qp(x), Instant::now()));
        let open_qp = |st: &mut State, conn| {
            st.request(conn, 0, Req::OpenQp { xrcd: x, qpn }, Instant::now())
        };
        assert_eq!(errno(open_qp(&mut st, 2)), libc::EINVAL, "domain not open");
        assert_eq!(errno(open_qp(&mut st, 1)), libc::EINVAL, "its creator");
        for conn in [2, 3] {
            handle(open(&mut st, conn, f, libc::O_CREAT));
            assert!(matches!(open_qp(&mut st, conn), Resp::Qp { .. }));
        }
        assert_eq!(errno(open_qp(&mut st, 2)), libc::EINVAL, "a second handle");
        let set_user = |st: &mut State, conn, user| {
            st.request(
                conn,
                0,
                Req::UserHandle {
                    kind: 1,
                    handle: qpn,
                    user,
                },
                Instant::now(),
            )
        };
        assert_eq!(set_user(&mut st, 2, 0x2000), Resp::Unit);
        assert_eq!(set_user(&mut st, 4, 0x4000), err(libc::EINVAL));
        assert!(matches!(
            st.request(1, 0, Req::DestroyQp { qpn }, Instant::now()),
            Resp::Destroyed { .. }
        ));
        let q = &st.qps[&qpn];
        assert_eq!(
            (q.conn, q.user, q.openers.clone()),
            (2, 0x2000, vec![(3, 0)])
        );
        st.drop_conn(3, Instant::now());
        assert!(st.qps.contains_key(&qpn));
        st.drop_conn(2, Instant::now());
        assert!(!st.qps.contains_key(&qpn));
    }

    #[test]
    fn initiators_and_targets_need_their_own_sides_attributes() {
        let rtr = IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN;
        let responder = IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER;
        let requester = IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC;
        let (req, opt) = masks(IBV_QPT_XRC_SEND, IBV_QPS_INIT, IBV_QPS_RTR).unwrap();
        assert_eq!((req, opt & responder), (rtr, responder));
        let (req, _) = masks(IBV_QPT_XRC_RECV, IBV_QPS_INIT, IBV_QPS_RTR).unwrap();
        assert_eq!(req, rtr | responder);
        let (req, _) = masks(IBV_QPT_XRC_SEND, IBV_QPS_RTR, IBV_QPS_RTS).unwrap();
        assert_eq!(req, IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | requester);
        let (req, opt) = masks(IBV_QPT_XRC_RECV, IBV_QPS_RTR, IBV_QPS_RTS).unwrap();
        assert_eq!(
            (req, opt & requester),
            (IBV_QP_SQ_PSN | IBV_QP_TIMEOUT, requester)
        );
        assert!(masks(IBV_QPT_XRC_RECV, IBV_QPS_RESET, IBV_QPS_RTS).is_none());
    }
}
