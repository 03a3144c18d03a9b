//! What the fuzz targets in `fuzz_targets/` check, one function per decoder, and the seed
//! corpus, generated from the project's own encoders (docs/fuzzing.md).
//!
//! Every check is "decode or refuse, never panic, never allocate without bound" plus an
//! invariant that catches silent misreading: whatever a decoder accepts must survive
//! encode → decode unchanged, and a stream decoder must give the same result however its
//! input is split.

use std::io::Cursor;

use drum_common::admm::FacilityTerm;
use drum_common::dasr::wire::Sealed;
use drum_common::dasr::{DasrKey, Datagram, Guard, Refusal};
use drum_common::instance::Instance;
use drum_common::protocol::wire::{self, FrameDecoder, WireError};
use serde::de::DeserializeOwned;
use serde::Serialize;
use softrnic::auss::Stamp;
use softrnic::flow::FlowRule;
use softrnic::proto::{self, Req, Resp};
use softrnic::rdma_cm::msg::Msg as CmMsg;
use softrnic::wire::{psn_add, psn_diff, Packet, PSN_MASK};

// ---------------------------------------------------------------------------------------------
// Control plane (drum_common::protocol::wire)
// ---------------------------------------------------------------------------------------------

/// Feeds `stream` to a [`FrameDecoder`] in pieces of `chunk` bytes, draining messages after
/// each piece; returns every message (re-encoded, so that NaNs compare) and how it ended.
fn drain_frames<M: DeserializeOwned + Serialize>(
    stream: &[u8],
    chunk: usize,
) -> (Vec<Vec<u8>>, Result<usize, WireError>) {
    let mut dec = FrameDecoder::new();
    let mut got = Vec::new();
    for piece in stream.chunks(chunk.max(1)) {
        dec.push(piece);
        loop {
            match dec.next_msg::<M>() {
                Ok(Some(m)) => got.push(wire::encode(&m).expect("a decoded message re-encodes")),
                Ok(None) => break,
                Err(e) => return (got, Err(e)),
            }
        }
    }
    (got, Ok(dec.buffered()))
}

/// One control-plane input: byte 0 picks a split size, the rest is a byte stream from a peer.
///
/// - the stream through a [`FrameDecoder`] whole and in pieces: same messages, same ending;
/// - the stream as one bare payload ([`wire::decode_payload`], no header), so the fuzzer
///   reaches bincode without first having to guess a header and a matching length;
/// - whatever decodes re-encodes to a frame that decodes to the same message.
pub fn control_frames<M: DeserializeOwned + Serialize>(data: &[u8]) {
    let Some((&split, stream)) = data.split_first() else {
        return;
    };
    let whole = drain_frames::<M>(stream, stream.len());
    let pieces = drain_frames::<M>(stream, split as usize % 17 + 1);
    assert_eq!(
        whole, pieces,
        "the split of the stream changed what was decoded"
    );
    for frame in &whole.0 {
        round_trip::<M>(frame);
    }
    if let Ok(m) = wire::decode_payload::<M>(stream) {
        round_trip::<M>(&wire::encode(&m).expect("a decoded message re-encodes"));
    }
    if let Some(h) = stream.first_chunk::<{ wire::HEADER_LEN }>() {
        if let Ok(len) = wire::parse_header(h) {
            assert!(len <= wire::MAX_FRAME);
        }
    }
}

/// `frame` (one encoded message) decodes to a message that encodes to `frame` again.
fn round_trip<M: DeserializeOwned + Serialize>(frame: &[u8]) {
    let mut dec = FrameDecoder::new();
    dec.push(frame);
    let m = dec
        .next_msg::<M>()
        .expect("an encoded message decodes")
        .expect("an encoded message is complete");
    assert_eq!(dec.buffered(), 0);
    assert_eq!(
        wire::encode(&m).unwrap(),
        frame,
        "encode∘decode is not the identity"
    );
}

// ---------------------------------------------------------------------------------------------
// softrnic engine ↔ engine packets (softrnic::wire)
// ---------------------------------------------------------------------------------------------

/// One UDP datagram as the engine's receive loop gets it: [`Packet::decode`], and what it
/// accepts re-encodes to the same bytes (the pad byte aside). Also the 24-bit PSN arithmetic the
/// receive path applies to the accepted PSNs, and the AUSS stamp an ACK or notification
/// carries ([`Stamp::decode`]: refused or re-encoded to itself, within the bound on `N`).
pub fn softrnic_packet(data: &[u8]) {
    if let Some(p) = Packet::decode(data) {
        if p.op == softrnic::wire::OP_AUSS
            || (p.op == softrnic::wire::OP_ACK && !p.payload.is_empty())
        {
            let max_n = p.imm;
            if let Ok(s) = Stamp::decode(&p.payload, max_n) {
                assert!(s.n <= max_n && s.incarnation != 0);
                assert_eq!(
                    s.encode(),
                    &p.payload[..],
                    "an accepted stamp does not re-encode"
                );
            }
        }
        assert!(p.psn <= PSN_MASK);
        // Byte 7 is the ECN field (two bits), re-encoded like every other.
        assert!(p.ecn <= softrnic::wire::ECN_CE);
        assert_eq!(
            p.encode(),
            data,
            "an accepted datagram does not re-encode to itself"
        );
        // Distances of up to half the PSN space survive the wrap.
        let n = p.offset & (PSN_MASK >> 1);
        assert_eq!(psn_diff(psn_add(p.psn, n), p.psn), n as i32);
        assert_eq!(psn_diff(p.psn, psn_add(p.psn, n)), -(n as i32));
    }
}

// ---------------------------------------------------------------------------------------------
// softrnic RDMA CM messages between programs (softrnic::rdma_cm::msg)
// ---------------------------------------------------------------------------------------------

/// One framed RDMA CM message body as the connection reader gets it: [`CmMsg::decode`], and
/// what it accepts encodes back to the same body.
pub fn softrnic_cm_msg(data: &[u8]) {
    if let Ok(m) = CmMsg::decode(data) {
        let e = m.encode().expect("an accepted message encodes");
        assert_eq!(
            &e[2..],
            data,
            "an accepted message does not re-encode to itself"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// softrnic flow-steering rules (softrnic::flow)
// ---------------------------------------------------------------------------------------------

/// An application's `struct ibv_flow_attr` with its specs as the engine gets it
/// ([`FlowRule::parse`]); a rule that parses is then tried on the input's bytes after the rule,
/// as an Ethernet frame. A parsed rule parses the same from its own bytes alone.
pub fn softrnic_flow_attr(data: &[u8]) {
    let Ok((rule, len)) = FlowRule::parse_prefix(data) else {
        return;
    };
    assert_eq!(FlowRule::parse(&data[..len]).as_ref(), Ok(&rule));
    let _ = rule.matches(&data[len..]);
}

// ---------------------------------------------------------------------------------------------
// softrnic provider ↔ engine (softrnic::proto)
// ---------------------------------------------------------------------------------------------

/// A provider's byte stream as the engine's connection handler reads it: length-prefixed frames
/// ([`proto::read_frame`]), each decoded with [`Req::decode`]; plus the input as one bare
/// request body. An accepted request survives encode → decode.
pub fn softrnic_request(data: &[u8]) {
    check_request(data);
    let mut r = Cursor::new(data);
    while let Ok(body) = proto::read_frame(&mut r) {
        assert!(body.len() <= proto::MAX_FRAME);
        check_request(&body);
    }
}

fn check_request(body: &[u8]) {
    if let Ok(req) = Req::decode(body) {
        let again = Req::decode(&req.encode()).expect("an encoded request decodes");
        assert_eq!(again, req, "decode∘encode is not the identity");
    }
}

/// The requests whose response layouts differ (every other one is answered with a bare errno).
fn request_for(selector: u8) -> Req {
    match selector % 9 {
        0 => Req::AllocPd,
        1 => Req::RegMr {
            pd: 1,
            addr: 0x1000,
            len: 4096,
            access: 7,
        },
        2 => Req::CreateCq {
            cqe: 16,
            channel: 0,
            user: 0,
        },
        3 => Req::CreateChannel,
        4 => Req::CreateQp {
            pd: 1,
            send_cq: 1,
            recv_cq: 1,
            qp_type: 2,
            sq_sig_all: false,
            cap: Default::default(),
            srq: 0,
            xrcd: 0,
        },
        5 => Req::QueryQp { qpn: 1 },
        6 => Req::PollCq { cq: 1, max: 16 },
        7 => Req::CreateSrq {
            pd: 1,
            max_wr: 16,
            max_sge: 1,
            xrcd: 0,
            cq: 0,
        },
        _ => Req::DestroyQp { qpn: 1 },
    }
}

/// An engine's response body as the provider decodes it: byte 0 picks the request it answers,
/// the rest is the body ([`Resp::decode`]); an accepted response survives encode → decode.
pub fn softrnic_response(data: &[u8]) {
    let Some((&sel, body)) = data.split_first() else {
        return;
    };
    let req = request_for(sel);
    if let Ok(resp) = Resp::decode(&req, body) {
        let again = Resp::decode(&req, &resp.encode()).expect("an encoded response decodes");
        assert_eq!(again, resp, "decode∘encode is not the identity");
    }
}

// ---------------------------------------------------------------------------------------------
// Instance JSON (drum_common::instance)
// ---------------------------------------------------------------------------------------------

/// An instance file: parse and validate ([`Instance::into_problem`]); a valid one written back
/// out ([`Instance::from_problem`], [`Instance::to_json`]) loads and validates again, equal —
/// exactly if serde_json reads floats back exactly, else to within a few ulps (see
/// [`json_floats_round_trip`]).
pub fn instance_json(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(inst) = Instance::from_json(text) else {
        return;
    };
    if let Ok(problem) = inst.into_problem() {
        let out = Instance::from_problem(&problem);
        let back = Instance::from_json(&out.to_json()).expect("a written instance parses");
        if json_floats_round_trip() {
            assert_eq!(
                back, out,
                "an instance does not survive to_json → from_json"
            );
        } else {
            let (a, b) = (serde_json::to_value(&back), serde_json::to_value(&out));
            assert!(
                close(&a.unwrap(), &b.unwrap()),
                "an instance does not survive to_json → from_json (beyond float rounding):\n\
                 {back:?}\n{out:?}"
            );
        }
        back.into_problem()
            .expect("a written valid instance validates");
    }
}

/// Whether serde_json reads back what it writes for every f64. Without its `float_roundtrip`
/// feature it does not: `1.3333333333333335` (its own output for 0x3ff5555555555556) reads as
/// 1.3333333333333337 (docs/fuzzing.md, findings). The instance check is exact once a crate of
/// the build enables that feature.
pub fn json_floats_round_trip() -> bool {
    static EXACT: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *EXACT.get_or_init(|| {
        let x = f64::from_bits(0x3ff5_5555_5555_5556);
        serde_json::from_str::<f64>(&serde_json::to_string(&x).unwrap()).unwrap() == x
    })
}

/// Equal JSON values, numbers to within 8 ulps.
fn close(a: &serde_json::Value, b: &serde_json::Value) -> bool {
    use serde_json::Value as V;
    match (a, b) {
        (V::Number(x), V::Number(y)) => match (x.as_f64(), y.as_f64()) {
            (Some(x), Some(y)) if x.is_finite() && y.is_finite() && x.signum() == y.signum() => {
                x == y || x.to_bits().abs_diff(y.to_bits()) <= 8
            }
            _ => x == y,
        },
        (V::Array(x), V::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(x, y)| close(x, y))
        }
        (V::Object(x), V::Object(y)) => {
            x.len() == y.len() && x.iter().all(|(k, v)| y.get(k).is_some_and(|w| close(v, w)))
        }
        _ => a == b,
    }
}

// ---------------------------------------------------------------------------------------------
// DASR datagrams between agents (drum_common::dasr::wire, drum_common::dasr::auth)
// ---------------------------------------------------------------------------------------------

/// The key of the version-2 DASR seeds and of the target's guards.
const DASR_KEY: [u8; 32] = [7; 32];
/// The wall clock the DASR target opens at; the v2 seeds are stamped with it.
const DASR_NOW: std::time::Duration = std::time::Duration::from_secs(1_790_000_000);

fn dasr_guard() -> Guard {
    Guard::new(
        DasrKey::new(&DASR_KEY),
        None,
        std::time::Duration::from_secs(2),
    )
}

/// One datagram on an agent's DASR socket: [`Datagram::decode`] as a keyless agent decodes it
/// (version 1), [`Sealed::split`] and [`Guard::open`] (MAC, window, replay rule) as a keyed one
/// does (version 2). Whatever a keyless agent accepts, sealed with the key, opens to the same
/// datagram exactly once, and is itself refused by a keyed agent as unauthenticated.
pub fn dasr_datagram(data: &[u8]) {
    if let Ok(s) = Sealed::split(data) {
        let _ = s.datagram();
    }
    let _ = dasr_guard().open(DASR_NOW, data);
    if let Ok(d) = Datagram::decode(data) {
        assert_eq!(
            d.encode(),
            data,
            "an accepted datagram does not re-encode to itself"
        );
        let sealed = dasr_guard().seal(DASR_NOW, &d);
        let mut rx = dasr_guard();
        assert_eq!(rx.open(DASR_NOW, &sealed), Ok(d));
        assert_eq!(rx.open(DASR_NOW, &sealed), Err(Refusal::Replay));
        assert_eq!(
            dasr_guard().open(DASR_NOW, data),
            Err(Refusal::Unauthenticated)
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Seeds
// ---------------------------------------------------------------------------------------------

/// The committed seed corpus: `(target, file name, bytes)`, all made by the project's encoders.
pub fn seeds() -> Vec<(&'static str, &'static str, Vec<u8>)> {
    use drum_common::protocol::wire::{
        AgentMsg, ContributionMsg, CoordMsg, HostProposal, Join, ProposalMsg, RackHostMsg,
        RackProposalsMsg, SelectedMsg, SelectionParams, Shard,
    };
    use softrnic::proto::{Caps, QpAttrs, RecvWr, SendWr, Sge};
    use softrnic::wire as sw;

    let mut out = Vec::new();

    // Control plane: byte 0 is the split size, then a stream of frames.
    let join = AgentMsg::Join(Join {
        host: "h1".into(),
        facility_digest: 0x1234_5678_9abc_def0,
        pairs: vec![(0, 2), (3, 1)],
        entries: vec![(0, 0.5), (3, 0.25)],
        last_iteration: 7,
        last_d: vec![FacilityTerm {
            facility: 0,
            d: 0.01,
            rho: 2.0,
        }],
        rank: 3,
        interest: vec![0, 3, 5],
        floor: vec![(0, 0.001), (3, 0.002)],
        exchanges: 2,
    });
    let agent: Vec<(&str, AgentMsg)> = vec![
        ("join", join),
        ("heartbeat", AgentMsg::Heartbeat { seq: 300 }),
        ("leave", AgentMsg::Leave),
        ("reselect", AgentMsg::Reselect { iteration: 41 }),
        (
            "contribution",
            AgentMsg::Contribution(ContributionMsg {
                epoch: 1,
                iteration: 70000,
                entries: vec![(1, 1.5), (2, -0.0), (9, 1e300)],
            }),
        ),
        (
            "proposal",
            AgentMsg::Proposal(ProposalMsg {
                exchange: 4,
                park: Some(vec![(1, 0.001)]),
                activate: None,
            }),
        ),
        (
            "selected",
            AgentMsg::Selected(SelectedMsg {
                exchange: 4,
                pairs: vec![(0, 1)],
                floor: vec![(0, 0.001)],
                entries: vec![(0, 2.5)],
            }),
        ),
        (
            "rack_proposals",
            AgentMsg::RackProposals(RackProposalsMsg {
                exchange: 4,
                hosts: vec![
                    HostProposal {
                        rank: 2,
                        park: Some(vec![(1, 0.001)]),
                        activate: None,
                    },
                    HostProposal {
                        rank: 0,
                        park: None,
                        activate: Some(vec![(0, 0.002), (3, 0.001)]),
                    },
                ],
            }),
        ),
        (
            "rack_host",
            AgentMsg::RackHost(RackHostMsg {
                host: "h7".into(),
                report: Some(drum_common::live::HostReport {
                    line_rate_gbps: 100.0,
                    gids: vec![[0xfe; 16]],
                    max_active: 8,
                    wqe_budget: 1.0,
                    poll_budget: 1.0,
                    apps: Vec::new(),
                }),
            }),
        ),
    ];
    let mut all = vec![3u8];
    for (name, m) in &agent {
        let f = wire::encode(m).unwrap();
        all.extend_from_slice(&f);
        out.push(("control_agent_frames", *name, [&[0u8][..], &f].concat()));
    }
    out.push(("control_agent_frames", "stream", all));
    let coord: Vec<(&str, CoordMsg)> = vec![
        (
            "welcome",
            CoordMsg::Welcome {
                epoch: 2,
                iteration: 5,
                heartbeat_ms: 500,
                shard: Shard { index: 1, count: 2 },
            },
        ),
        (
            "refused",
            CoordMsg::Refused {
                reason: "facility digest mismatch".into(),
            },
        ),
        (
            "round",
            CoordMsg::Round {
                epoch: 2,
                iteration: 6,
                d: vec![
                    FacilityTerm {
                        facility: 0,
                        d: 0.125,
                        rho: 0.5,
                    },
                    FacilityTerm {
                        facility: 4,
                        d: -2.0,
                        rho: 8.0,
                    },
                ],
            },
        ),
        ("heartbeat_ack", CoordMsg::HeartbeatAck { seq: 1 << 40 }),
        (
            "select",
            CoordMsg::Select {
                exchange: 4,
                round: 1,
                prices: vec![(0, 0.25), (3, 1.0)],
                options: SelectionParams {
                    swap_prob: 0.5,
                    hysteresis: 0.05,
                    fairness: 0.0,
                    discount: 0.9,
                    seed: 7,
                },
            },
        ),
        (
            "verdict",
            CoordMsg::Verdict {
                exchange: 4,
                activate: true,
            },
        ),
        (
            "restart",
            CoordMsg::Restart {
                exchange: 5,
                prices: vec![(0, 0.5)],
            },
        ),
        (
            "rack_verdicts",
            CoordMsg::RackVerdicts {
                exchange: 4,
                activate: vec![false, true],
            },
        ),
    ];
    let mut all = vec![5u8];
    for (name, m) in &coord {
        let f = wire::encode(m).unwrap();
        all.extend_from_slice(&f);
        out.push(("control_coord_frames", *name, [&[0u8][..], &f].concat()));
    }
    out.push(("control_coord_frames", "stream", all));

    // Engine-to-engine datagrams.
    let pkt = |op, flags, payload: &[u8]| Packet {
        op,
        flags,
        syndrome: 0,
        ecn: 0,
        dst_qpn: 17,
        src_qpn: 18,
        psn: 0x00ab_cdef,
        msg_len: 3,
        offset: 0,
        imm: 0,
        remote_addr: 0x1000,
        rkey: 77,
        srqn: 0,
        payload: payload.to_vec().into(),
    };
    let first_last = sw::F_FIRST | sw::F_LAST;
    // AUSS (softrnic::auss): N 2 of epoch 5 of a receiver's life 77.
    let auss_stamp = Stamp {
        n: 2,
        epoch: 5,
        incarnation: 77,
    }
    .encode();
    for (name, p) in [
        ("send", pkt(sw::OP_SEND, first_last | sw::F_IMM, b"abc")),
        (
            "write",
            pkt(sw::OP_WRITE, first_last | sw::F_ACKREQ, b"xyz"),
        ),
        ("read_req", pkt(sw::OP_READ_REQ, first_last, b"")),
        (
            "xrc_send",
            Packet {
                srqn: 0x42,
                ..pkt(sw::OP_SEND, first_last | sw::F_XRC, b"abc")
            },
        ),
        ("read_resp", pkt(sw::OP_READ_RESP, sw::F_FIRST, b"data")),
        ("ack", pkt(sw::OP_ACK, 0, b"")),
        (
            "write_ce",
            Packet {
                ecn: sw::ECN_CE,
                ..pkt(sw::OP_WRITE, first_last, b"xyz")
            },
        ),
        ("cnp", pkt(sw::OP_CNP, 0, b"")),
        (
            "write_idle",
            pkt(sw::OP_WRITE, first_last | sw::F_ACKREQ | sw::F_IDLE, b"xyz"),
        ),
        ("ack_auss", pkt(sw::OP_ACK, 0, &auss_stamp)),
        (
            "auss",
            Packet {
                dst_qpn: 0,
                src_qpn: 0,
                imm: 2,
                ..pkt(sw::OP_AUSS, 0, &auss_stamp)
            },
        ),
        (
            "nak",
            Packet {
                syndrome: sw::NAK_RNR,
                ..pkt(sw::OP_NAK, 0, b"")
            },
        ),
    ] {
        out.push(("softrnic_packet", name, p.encode()));
    }

    // Provider-to-engine requests: one bare body each, and a framed stream of several.
    let sge = Sge {
        addr: 0x7f00_0000_1000,
        length: 64,
        lkey: 3,
    };
    let reqs: Vec<(&str, Req)> = vec![
        ("alloc_pd", Req::AllocPd),
        (
            "reg_mr",
            Req::RegMr {
                pd: 1,
                addr: 0x7f00_0000_0000,
                len: 1 << 20,
                access: 7,
            },
        ),
        (
            "create_qp",
            Req::CreateQp {
                pd: 1,
                send_cq: 2,
                recv_cq: 2,
                qp_type: 2,
                sq_sig_all: true,
                cap: Caps {
                    max_send_wr: 16,
                    max_recv_wr: 16,
                    max_send_sge: 2,
                    max_recv_sge: 1,
                    max_inline_data: 64,
                },
                srq: 0,
                xrcd: 0,
            },
        ),
        (
            "open_xrcd",
            Req::OpenXrcd {
                file: Some((0x803, 4242)),
                oflags: 0o100,
            },
        ),
        (
            "modify_qp",
            Req::ModifyQp {
                qpn: 17,
                mask: 0x1,
                attr: QpAttrs {
                    qp_state: 3,
                    port_num: 1,
                    dest_qp_num: 18,
                    dgid: [0xfe; 16],
                    ..Default::default()
                },
            },
        ),
        (
            "post_send",
            Req::PostSend {
                qpn: 17,
                wrs: vec![
                    SendWr {
                        wr_id: 1,
                        opcode: 0,
                        flags: 2,
                        imm: 0,
                        remote_addr: 0x1000,
                        rkey: 77,
                        sges: vec![sge],
                        inline: None,
                        ..Default::default()
                    },
                    SendWr {
                        wr_id: 2,
                        opcode: 2,
                        flags: 8,
                        imm: 9,
                        remote_addr: 0,
                        rkey: 0,
                        sges: vec![],
                        inline: Some(b"inline".to_vec()),
                        ..Default::default()
                    },
                ],
            },
        ),
        (
            "post_recv",
            Req::PostRecv {
                qpn: 17,
                wrs: vec![RecvWr {
                    wr_id: 5,
                    sges: vec![sge, sge],
                }],
            },
        ),
        (
            "attach_ring",
            Req::AttachRing {
                kind: 1,
                handle: 17,
                fd: 5,
                len: 1 << 16,
            },
        ),
    ];
    let mut stream = Vec::new();
    for (name, r) in &reqs {
        let body = r.encode();
        proto::write_frame(&mut stream, &body).unwrap();
        out.push(("softrnic_request", *name, body));
    }
    out.push(("softrnic_request", "stream", stream));

    // Engine-to-provider responses: the selector of `request_for`, then the body.
    let wc = drum_verbs_abi::IbvWc {
        wr_id: 9,
        byte_len: 64,
        qp_num: 17,
        ..Default::default()
    };
    for (name, sel, resp) in [
        (
            "error",
            7u8,
            Resp::Err {
                errno: 22,
                bad_index: 1,
            },
        ),
        ("handle", 0, Resp::Handle(1)),
        ("mr", 1, Resp::Mr { lkey: 3, rkey: 4 }),
        ("channel", 3, Resp::Channel { id: 1, token: 99 }),
        (
            "qp_attr",
            5,
            Resp::QpAttr {
                attr: QpAttrs {
                    qp_state: 3,
                    ..Default::default()
                },
                cap: Caps::default(),
                qp_type: 2,
                sq_sig_all: true,
            },
        ),
        ("wcs", 6, Resp::Wcs(vec![wc, wc])),
    ] {
        out.push((
            "softrnic_response",
            name,
            [&[sel][..], &resp.encode()].concat(),
        ));
    }

    // Instance files.
    out.push((
        "instance_json",
        "small",
        br#"{"alpha":1.0,"beta":0.5,"k":2,"x_min":0.001,
"facilities":[{"id":"nic0","capacity":100.0},{"id":"l1","capacity":50.0,"cost":0.1}],
"hosts":[{"id":"h1","wqe_budget":1000.0,"poll_budget":1000.0,"apps":[
{"id":"a","weight":1.0,"cqe_per_wqe":1.0,"demand":10.0,"facility":"nic0","facility_coeff":1.0},
{"id":"b","weight":2.0,"cqe_per_wqe":0.5,"demand":20.0,"facility":"l1","facility_coeff":2.0}]}]}
"#
        .to_vec(),
    ));

    // Daemon configs, as in deploy/config/.
    {
        use softrnic::rdma_cm::msg::{Rep, Req as CmReq};
        let cm = [
            (
                "req",
                CmMsg::Req(CmReq {
                    qpn: 0x11,
                    psn: 0xabcdef,
                    gid: [9; 16],
                    responder_resources: 1,
                    initiator_depth: 1,
                    retry_count: 7,
                    rnr_retry_count: 7,
                    private: b"perftest".to_vec(),
                    ..CmReq::default()
                }),
            ),
            (
                "rep",
                CmMsg::Rep(Rep {
                    qpn: 0x22,
                    psn: 5,
                    ..Rep::default()
                }),
            ),
            ("rtu", CmMsg::Rtu),
            (
                "rej",
                CmMsg::Rej {
                    reason: 28,
                    private: vec![1, 2, 3],
                },
            ),
            ("dreq", CmMsg::Dreq),
            (
                "sidr_rep",
                CmMsg::SidrRep {
                    status: 0,
                    qpn: 7,
                    qkey: 0x0123_4567,
                    gid: [3; 16],
                    private: vec![],
                },
            ),
        ];
        for (name, m) in cm {
            out.push(("softrnic_cm_msg", name, m.encode().unwrap()[2..].to_vec()));
        }
    }
    {
        // perftest raw_ethernet_bw's rule (ETH on the destination MAC, IPv4, UDP ports), then
        // a frame it matches.
        let mut rule = vec![0u8; 20];
        rule[8..10].copy_from_slice(&100u16.to_le_bytes());
        rule[12] = 3;
        rule[13] = 1;
        let mut eth = vec![0u8; 40];
        eth[0] = 0x20;
        eth[4] = 40;
        eth[6..12].copy_from_slice(&[2, 0, 0, 0, 0, 1]);
        eth[22..28].fill(0xff);
        let mut ip = vec![0u8; 24];
        ip[0] = 0x30;
        ip[4] = 24;
        ip[8..16].copy_from_slice(&[10, 77, 0, 2, 10, 77, 0, 1]);
        ip[16..24].fill(0xff);
        let mut udp = vec![0u8; 16];
        udp[0] = 0x41;
        udp[4] = 16;
        udp[6..10].copy_from_slice(&[0x13, 0x88, 0x13, 0x89]);
        udp[10..14].fill(0xff);
        let mut frame = vec![
            2, 0, 0, 0, 0, 1, 2, 0, 0, 0, 0, 2, 0x08, 0x00, 0x45, 0, 0, 0, 0, 0,
        ];
        frame.extend_from_slice(&[0, 0, 64, 17, 0, 0, 10, 77, 0, 2, 10, 77, 0, 1]);
        frame.extend_from_slice(&[0x13, 0x89, 0x13, 0x88, 0, 8, 0, 0]);
        let seed = [rule, eth, ip, udp, frame].concat();
        out.push(("softrnic_flow_attr", "perftest_raw_bw", seed));
    }
    out.push((
        "daemon_config",
        "agent",
        b"host = \"h1\"\ninstance = \"instance.json\"\ncoordinator = \"127.0.0.1:7000\"\n\
heartbeat_ms = 500\ncoordinator_timeout_ms = 3000\nrate_table = \"rates\"\n\
metrics_listen = \"127.0.0.1:9100\"\n\n[tls]\nca = \"ca.pem\"\ncert = \"h1.pem\"\nkey = \"h1.key\"\n"
            .to_vec(),
    ));
    out.push((
        "daemon_config",
        "coordinator",
        b"listen = \"127.0.0.1:7000\"\ninstance = \"instance.json\"\nadmin_listen = \"127.0.0.1:7001\"\n\
rho = 0.5\nmin_members = 2\nround_deadline_ms = 50\nmax_staleness = 3\n\
max_iterations = 1000\nbind_host_to_certificate = true\n\n[tls]\nca = \"ca.pem\"\n\
cert = \"coordinator.pem\"\nkey = \"coordinator.key\"\n"
            .to_vec(),
    ));
    // DASR: version 1 as encoded, version 2 sealed under the target's key at its clock.
    {
        use drum_common::dasr::{Ack, Announce, Lookahead, Phase};
        let announce = Announce {
            sender: 7,
            incarnation: 3,
            seq: 1,
            phase: Phase::Start,
            msg_id: 42,
            weight: 1.0,
            lookahead: None,
        };
        let lookahead = Announce {
            phase: Phase::End,
            lookahead: Some(Lookahead {
                tenant: 1,
                group: 2,
                members: 3,
            }),
            ..announce
        };
        let ack = Ack {
            receiver_incarnation: 9,
            sender_incarnation: 3,
            epoch: 5,
            n: 2,
            omega: 2.0,
            cap: 0.5,
            acked_seq: 1,
            push: true,
            cap_off: false,
        };
        let mut guard = dasr_guard();
        for (name, d) in [
            ("announce", Datagram::Announce(announce)),
            ("announce_lookahead", Datagram::Announce(lookahead)),
            ("ack", Datagram::Ack(ack)),
        ] {
            out.push(("dasr_datagram", name, d.encode()));
        }
        out.push((
            "dasr_datagram",
            "announce_v2",
            guard.seal(DASR_NOW, &Datagram::Announce(announce)),
        ));
        out.push((
            "dasr_datagram",
            "ack_v2",
            guard.seal(DASR_NOW, &Datagram::Ack(ack)),
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    /// Every committed regression input (fuzz/regressions/TARGET/: inputs that once failed a
    /// check) passes its target's checks now.
    #[test]
    fn regressions_pass() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("regressions");
        let Ok(dirs) = std::fs::read_dir(&root) else {
            return;
        };
        for dir in dirs {
            let dir = dir.unwrap().path();
            let target = dir.file_name().unwrap().to_str().unwrap().to_owned();
            for f in std::fs::read_dir(&dir).unwrap() {
                let bytes = std::fs::read(f.unwrap().path()).unwrap();
                match target.as_str() {
                    "control_agent_frames" => control_frames::<wire::AgentMsg>(&bytes),
                    "control_coord_frames" => control_frames::<wire::CoordMsg>(&bytes),
                    "softrnic_packet" => softrnic_packet(&bytes),
                    "softrnic_cm_msg" => softrnic_cm_msg(&bytes),
                    "softrnic_flow_attr" => softrnic_flow_attr(&bytes),
                    "softrnic_request" => softrnic_request(&bytes),
                    "softrnic_response" => softrnic_response(&bytes),
                    "instance_json" => instance_json(&bytes),
                    "dasr_datagram" => dasr_datagram(&bytes),
                    _ => {}
                }
            }
        }
    }

    /// The committed corpus is what [`seeds`] makes (so a format change shows up here), and
    /// every seed passes its target's checks. `FUZZ_WRITE_SEEDS=1` rewrites the corpus.
    #[test]
    fn committed_seeds_are_current() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus");
        let write = std::env::var_os("FUZZ_WRITE_SEEDS").is_some();
        for (target, name, bytes) in seeds() {
            match target {
                "control_agent_frames" => {
                    control_frames::<wire::AgentMsg>(&bytes);
                    assert!(bytes.len() > 1);
                }
                "control_coord_frames" => control_frames::<wire::CoordMsg>(&bytes),
                "softrnic_packet" => {
                    assert!(Packet::decode(&bytes).is_some());
                    softrnic_packet(&bytes);
                }
                "softrnic_cm_msg" => {
                    assert!(CmMsg::decode(&bytes).is_ok());
                    softrnic_cm_msg(&bytes);
                }
                "softrnic_flow_attr" => {
                    let r = FlowRule::parse(&bytes).expect("the seed rule parses");
                    assert!(r.matches(&bytes[100..]), "the seed frame matches");
                    softrnic_flow_attr(&bytes);
                }
                "softrnic_request" => softrnic_request(&bytes),
                "softrnic_response" => softrnic_response(&bytes),
                "instance_json" => {
                    let i = Instance::from_json(std::str::from_utf8(&bytes).unwrap()).unwrap();
                    i.into_problem().unwrap();
                    instance_json(&bytes);
                }
                "dasr_datagram" => {
                    let v1 = Datagram::decode(&bytes).is_ok();
                    let v2 = dasr_guard().open(DASR_NOW, &bytes).is_ok();
                    assert!(v1 || v2, "a DASR seed opens as v1 or as v2");
                    dasr_datagram(&bytes);
                }
                "daemon_config" => {}
                other => panic!("seed for unknown target {other}"),
            }
            let path = root.join(target).join(name);
            if write {
                std::fs::create_dir_all(path.parent().unwrap()).unwrap();
                std::fs::write(&path, &bytes).unwrap();
            } else {
                let on_disk = std::fs::read(&path)
                    .unwrap_or_else(|e| panic!("{}: {e} (FUZZ_WRITE_SEEDS=1)", path.display()));
                assert_eq!(
                    on_disk,
                    bytes,
                    "{} is stale (FUZZ_WRITE_SEEDS=1)",
                    path.display()
                );
            }
        }
    }
}
