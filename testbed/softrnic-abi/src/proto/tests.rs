use super::*;

#[test]
fn request_roundtrip() {
    let reqs = vec![
        Req::AllocPd,
        Req::CreateCq {
            cqe: 9,
            channel: 2,
            user: 0x7fff_0000_1234,
        },
        Req::CreateChannel,
        Req::AttachChannel {
            id: 5,
            token: 0x1122_3344_5566_7788,
        },
        Req::ReqNotifyCq {
            cq: 4,
            solicited_only: true,
        },
        Req::AttachRing {
            kind: 1,
            handle: 7,
            fd: 12,
            len: 1 << 20,
        },
        Req::RegMr {
            pd: 3,
            addr: 0xdead_beef,
            len: 4096,
            access: 7,
        },
        Req::ModifyQp {
            qpn: 17,
            mask: 0x1234,
            attr: QpAttrs {
                qp_state: 3,
                dgid: [7; 16],
                dlid: 300,
                ..Default::default()
            },
        },
        Req::PostSend {
            qpn: 9,
            wrs: vec![SendWr {
                wr_id: 42,
                opcode: 2,
                flags: 10,
                imm: 5,
                remote_addr: 1,
                rkey: 2,
                compare_add: 3,
                swap: 4,
                sges: vec![Sge {
                    addr: 1,
                    length: 2,
                    lkey: 3,
                }],
                inline: Some(vec![1, 2, 3]),
                xrc_srqn: 0x77,
            }],
        },
        Req::PostRecv {
            qpn: 9,
            wrs: vec![RecvWr {
                wr_id: 1,
                sges: vec![],
            }],
        },
        Req::CreateSrq {
            pd: 1,
            max_wr: 500,
            max_sge: 2,
            xrcd: 3,
            cq: 4,
        },
        Req::OpenXrcd {
            file: Some((0x803, 123456)),
            oflags: libc::O_CREAT,
        },
        Req::OpenXrcd {
            file: None,
            oflags: 0,
        },
        Req::CloseXrcd { xrcd: 6 },
        Req::OpenQp { xrcd: 6, qpn: 0x11 },
        Req::AttachMcast {
            qpn: 0x12,
            group: 0xef01_0101,
        },
        Req::DetachMcast {
            qpn: 0x12,
            group: 0x8123_4567_89ab_cdef,
        },
        Req::CreateFlow {
            qpn: 0x13,
            attr: vec![1, 2, 3, 4],
        },
        Req::DestroyFlow { handle: 9 },
        Req::AllocDm { len: 4096 },
        Req::FreeDm { handle: 5 },
        Req::RateLimit {
            qpn: 7,
            kbps: 8_000,
            max_burst: 4_096,
        },
        Req::RegMrIova {
            pd: 3,
            addr: 0xdead_beef,
            len: 4096,
            iova: 0,
            access: 0x27,
        },
        Req::ModifySrq {
            srq: 4,
            mask: 3,
            max_wr: 7,
            srq_limit: 9,
        },
        Req::QuerySrq { srq: 4 },
        Req::DestroySrq { srq: 4 },
        Req::CreateAsyncChannel,
        Req::UserHandle {
            kind: 2,
            handle: 9,
            user: 0x5555_0000_1000,
        },
        Req::AsyncEventRead { taken_back: true },
        Req::ContextKey,
        Req::JoinContext {
            conn: 7,
            token: u64::MAX - 1,
        },
        Req::AllocMw { pd: 2, mw_type: 2 },
        Req::DeallocMw { rkey: 0x1234 },
        Req::PostSrqRecv {
            srq: 4,
            wrs: vec![RecvWr {
                wr_id: 8,
                sges: vec![Sge {
                    addr: 5,
                    length: 6,
                    lkey: 7,
                }],
            }],
        },
    ];
    for r in reqs {
        assert_eq!(Req::decode(&r.encode()).unwrap(), r);
    }
}

#[test]
fn response_roundtrip_and_truncation() {
    let req = Req::PollCq { cq: 1, max: 4 };
    let wc = IbvWc {
        wr_id: 9,
        byte_len: 100,
        qp_num: 17,
        ..Default::default()
    };
    let r = Resp::Wcs(vec![wc, wc]);
    let enc = r.encode();
    assert_eq!(Resp::decode(&req, &enc).unwrap(), r);
    for cut in 0..enc.len() - 1 {
        assert!(Resp::decode(&req, &enc[..cut]).is_err() || cut == 0);
    }
    for cut in 0..8 {
        let _ = Req::decode(&Req::AllocPd.encode()[..cut.min(4)]);
    }
    let r = Resp::Channel {
        id: 3,
        token: u64::MAX - 5,
    };
    assert_eq!(Resp::decode(&Req::CreateChannel, &r.encode()).unwrap(), r);
    let r = Resp::ContextKey {
        conn: 12,
        token: u64::MAX - 9,
    };
    assert_eq!(Resp::decode(&Req::ContextKey, &r.encode()).unwrap(), r);
    let r = Resp::Srq {
        handle: 3,
        max_wr: 64,
        max_sge: 1,
        srq_limit: 0,
    };
    let q = Req::QuerySrq { srq: 3 };
    assert_eq!(Resp::decode(&q, &r.encode()).unwrap(), r);
    let r = Resp::Destroyed {
        events_reported: 7,
        event_unread: true,
    };
    for q in [
        Req::DestroyQp { qpn: 1 },
        Req::DestroySrq { srq: 1 },
        Req::DestroyCq { cq: 1 },
    ] {
        assert_eq!(Resp::decode(&q, &r.encode()).unwrap(), r);
        assert!(Resp::decode(&q, &r.encode()[..6]).is_err());
    }
}
