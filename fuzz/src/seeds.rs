//! The seed corpus, generated from the project's own encoders (docs/fuzzing.md).

use super::*;

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
        use softrnic_provider::rdma_cm::msg::{Rep, Req as CmReq};
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
