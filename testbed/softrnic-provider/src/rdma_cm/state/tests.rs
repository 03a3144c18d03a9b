use super::*;

const SRV: Channel = 10;
const CLI: Channel = 20;

fn dev(n: u8) -> Device {
    Device {
        node_guid_be: u64::from(n).to_be(),
        gid: [n; 16],
        mtu: IBV_MTU_4096 as u32,
    }
}

fn addr(last: u8, port: u16) -> SocketAddrV4 {
    SocketAddrV4::new(Ipv4Addr::new(10, 0, 0, last), port)
}

fn param(qpn: u32, private: &[u8]) -> ConnParam {
    ConnParam {
        qp_num: qpn,
        responder_resources: 4,
        initiator_depth: 2,
        retry_count: 7,
        rnr_retry_count: 6,
        private: private.to_vec(),
        ..ConnParam::default()
    }
}

fn next(cm: &mut Cm, ch: Channel) -> Event {
    cm.get_event(ch).unwrap().expect("an event")
}

fn sent(cm: &mut Cm) -> Vec<Msg> {
    cm.take_out()
        .into_iter()
        .filter_map(|o| match o {
            Out::Send(_, m) | Out::Connect { first: m, .. } => Some(m),
            Out::Close(_) => None,
        })
        .collect()
}

/// A listener on the server, a resolved id on the client.
fn listening_pair() -> (Cm, Handle, Cm, Handle) {
    let mut s = Cm::new(Some(dev(1)));
    s.open_channel(SRV);
    let l = s
        .create_id(SRV, 0xaa, abi::PS_TCP, IBV_QPT_RC as u8, 100)
        .unwrap();
    s.bind(SRV, l, addr(1, 7000)).unwrap();
    s.listen(SRV, l).unwrap();
    let mut c = Cm::new(Some(dev(2)));
    c.open_channel(CLI);
    let a = c
        .create_id(CLI, 0xbb, abi::PS_TCP, IBV_QPT_RC as u8, 200)
        .unwrap();
    c.resolve_ip(CLI, a, addr(2, 5000), addr(1, 7000)).unwrap();
    assert_eq!(next(&mut c, CLI).event, event::ADDR_RESOLVED);
    c.resolve_route(CLI, a).unwrap();
    assert_eq!(next(&mut c, CLI).event, event::ROUTE_RESOLVED);
    (s, l, c, a)
}

#[test]
fn handshake_data_and_disconnect_as_librdmacm_sees_them() {
    let (mut s, l, mut c, a) = listening_pair();
    c.connect(CLI, a, param(0x11, b"hi")).unwrap();
    let req = sent(&mut c).pop().unwrap();
    let p = s
        .conn_request(l, addr(2, 5000), addr(1, 7000), 300, req)
        .unwrap();
    let ev = next(&mut s, SRV);
    assert_eq!(
        (ev.event, ev.handle, ev.uid),
        (event::CONNECT_REQUEST, p, 0xaa)
    );
    let Param::Conn(cp) = &ev.param else { panic!() };
    // Seen from the responder: the requester's initiator depth is its responder resources.
    assert_eq!(
        (cp.qp_num, cp.responder_resources, cp.initiator_depth),
        (0x11, 2, 4)
    );
    assert_eq!(cp.private.len(), msg::REQ_PRIVATE);
    assert_eq!(&cp.private[..2], b"hi");

    let init = s.init_qp_attr(SRV, p, IBV_QPS_INIT as u32).unwrap();
    assert_eq!(
        init.qp_access_flags,
        IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC
    );
    let rtr = s.init_qp_attr(SRV, p, IBV_QPS_RTR as u32).unwrap();
    assert_eq!(
        (rtr.dest_qp_num, rtr.rq_psn, rtr.ah_attr.grh.dgid),
        (0x11, 200, [2; 16])
    );
    assert_eq!(rtr.ah_attr.is_global, 1);
    s.accept(SRV, p, 0xcc, Some(param(0x22, b"ok"))).unwrap();
    let rts = s.init_qp_attr(SRV, p, IBV_QPS_RTS as u32).unwrap();
    assert_eq!((rts.sq_psn, rts.retry_cnt, rts.rnr_retry), (300, 7, 6));
    let rep = sent(&mut s).pop().unwrap();

    c.on_msg(a, rep);
    let ev = next(&mut c, CLI);
    assert_eq!((ev.event, ev.uid), (event::CONNECT_RESPONSE, 0xbb));
    let rtr = c.init_qp_attr(CLI, a, IBV_QPS_RTR as u32).unwrap();
    assert_eq!((rtr.dest_qp_num, rtr.rq_psn), (0x22, 300));
    let rts = c.init_qp_attr(CLI, a, IBV_QPS_RTS as u32).unwrap();
    assert_eq!((rts.sq_psn, rts.max_rd_atomic), (200, 2));
    c.accept(CLI, a, 0, None).unwrap();
    let rtu = sent(&mut c).pop().unwrap();
    assert_eq!(rtu, Msg::Rtu);
    s.on_msg(p, rtu);
    let ev = next(&mut s, SRV);
    // The passive id carries the uid ACCEPT gave it.
    assert_eq!((ev.event, ev.uid), (event::ESTABLISHED, 0xcc));

    c.disconnect(CLI, a).unwrap();
    let dreq = sent(&mut c).pop().unwrap();
    s.on_msg(p, dreq);
    assert_eq!(next(&mut s, SRV).event, event::DISCONNECTED);
    s.disconnect(SRV, p).unwrap();
    let drep = sent(&mut s).pop().unwrap();
    c.on_msg(a, drep);
    assert_eq!(next(&mut c, CLI).event, event::DISCONNECTED);
    assert_eq!(c.disconnect(CLI, a), Err(libc::EINVAL));
    // Four events reported about the active id (address, route, response, disconnect), two
    // about the passive one, one (the request) about the listener.
    assert_eq!(c.destroy_id(CLI, a), Ok(4));
    assert_eq!(s.destroy_id(SRV, p), Ok(2));
    assert_eq!(s.destroy_id(SRV, l), Ok(1));
}

#[test]
fn rejections_refusals_and_lost_peers_become_the_kernels_events() {
    let (mut s, l, mut c, a) = listening_pair();
    c.connect(CLI, a, param(1, &[])).unwrap();
    let req = sent(&mut c).pop().unwrap();
    let p = s
        .conn_request(l, addr(2, 5000), addr(1, 7000), 1, req)
        .unwrap();
    next(&mut s, SRV);
    s.reject(SRV, p, 0, b"no".to_vec()).unwrap();
    let rej = sent(&mut s).pop().unwrap();
    c.on_msg(a, rej);
    let ev = next(&mut c, CLI);
    assert_eq!(
        (ev.event, ev.status),
        (event::REJECTED, REJ_CONSUMER_DEFINED as i32)
    );

    // No listener: reason 8 (invalid service ID); no answer at all: unreachable.
    let (_, _, mut c, a) = listening_pair();
    c.connect(CLI, a, param(1, &[])).unwrap();
    c.connect_failed(a, true);
    let ev = next(&mut c, CLI);
    assert_eq!(
        (ev.event, ev.status),
        (event::REJECTED, REJ_INVALID_SERVICE_ID as i32)
    );
    let (_, _, mut c, a) = listening_pair();
    c.connect(CLI, a, param(1, &[])).unwrap();
    c.connect_failed(a, false);
    let ev = next(&mut c, CLI);
    assert_eq!(
        (ev.event, ev.status),
        (event::UNREACHABLE, -libc::ETIMEDOUT)
    );

    // An established peer that vanishes is a disconnect; a second loss adds nothing.
    let (mut s, l, mut c, a) = listening_pair();
    c.connect(CLI, a, param(1, &[])).unwrap();
    let req = sent(&mut c).pop().unwrap();
    let p = s
        .conn_request(l, addr(2, 5000), addr(1, 7000), 1, req)
        .unwrap();
    s.accept(SRV, p, 1, Some(param(2, &[]))).unwrap();
    c.on_msg(a, sent(&mut s).pop().unwrap());
    next(&mut c, CLI);
    c.accept(CLI, a, 0, None).unwrap();
    c.on_lost(a);
    c.on_lost(a);
    assert_eq!(next(&mut c, CLI).event, event::DISCONNECTED);
    assert_eq!(c.get_event(CLI), Ok(None));
    // A message out of place ends the connection the same way.
    s.on_msg(p, Msg::Rep(Rep::default()));
    assert_eq!(next(&mut s, SRV).event, event::CONNECT_REQUEST);
    assert_eq!(next(&mut s, SRV).event, event::UNREACHABLE);
}

#[test]
fn destroying_a_listener_refuses_requests_not_yet_fetched() {
    let (mut s, l, mut c, a) = listening_pair();
    c.connect(CLI, a, param(1, &[])).unwrap();
    let req = sent(&mut c).pop().unwrap();
    let p = s
        .conn_request(l, addr(2, 5000), addr(1, 7000), 1, req)
        .unwrap();
    assert_eq!(s.destroy_id(SRV, l), Ok(0));
    let out = s.take_out();
    assert!(out.contains(&Out::Send(
        p,
        Msg::Rej {
            reason: REJ_CONSUMER_DEFINED,
            private: vec![]
        }
    )));
    assert!(out.contains(&Out::Close(p)) && out.contains(&Out::Close(l)));
    assert_eq!(s.get_event(SRV), Ok(None));
    assert_eq!(s.state(p), None);
}

#[test]
fn ud_peers_find_each_other_through_sidr() {
    let mut s = Cm::new(Some(dev(1)));
    s.open_channel(SRV);
    let l = s
        .create_id(SRV, 1, abi::PS_UDP, IBV_QPT_UD as u8, 0)
        .unwrap();
    s.bind(SRV, l, addr(1, 7000)).unwrap();
    s.listen(SRV, l).unwrap();
    let mut c = Cm::new(Some(dev(2)));
    c.open_channel(CLI);
    let a = c
        .create_id(CLI, 2, abi::PS_UDP, IBV_QPT_UD as u8, 0)
        .unwrap();
    c.resolve_ip(CLI, a, addr(2, 1), addr(1, 7000)).unwrap();
    c.resolve_route(CLI, a).unwrap();
    let init = c.init_qp_attr(CLI, a, IBV_QPS_INIT as u32).unwrap();
    assert_eq!(init.qkey, abi::UDP_QKEY);
    assert_eq!(
        c.init_qp_attr(CLI, a, IBV_QPS_RTR as u32).err(),
        Some(libc::EINVAL)
    );
    c.connect(CLI, a, param(5, b"x")).unwrap();
    let req = sent(&mut c).pop().unwrap();
    let p = s
        .conn_request(l, addr(2, 1), addr(1, 7000), 0, req)
        .unwrap();
    s.accept(SRV, p, 3, Some(param(77, &[]))).unwrap();
    c.on_msg(a, sent(&mut s).pop().unwrap());
    next(&mut c, CLI);
    next(&mut c, CLI);
    let ev = next(&mut c, CLI);
    assert_eq!(ev.event, event::ESTABLISHED);
    let Param::Ud {
        qp_num, qkey, ah, ..
    } = ev.param
    else {
        panic!()
    };
    assert_eq!((qp_num, qkey), (77, abi::UDP_QKEY));
    assert_eq!(ah.unwrap().grh.dgid, [1; 16]);
    // An RC request at a UD listener opens nothing.
    assert_eq!(
        s.conn_request(l, addr(2, 2), addr(1, 7000), 0, Msg::Req(Req::default())),
        None
    );

    // Unreachable with the SIDR REP status, as the kernel's CM reports it: "unsupported" (1)
    // when nobody listens, "reject" (2) when the listener refuses.
    let ud_client = |c: &mut Cm, uid| {
        let a = c
            .create_id(CLI, uid, abi::PS_UDP, IBV_QPT_UD as u8, 0)
            .unwrap();
        c.resolve_ip(CLI, a, addr(2, 1), addr(1, 7000)).unwrap();
        c.resolve_route(CLI, a).unwrap();
        next(c, CLI);
        next(c, CLI);
        c.connect(CLI, a, param(5, &[])).unwrap();
        a
    };
    let a = ud_client(&mut c, 3);
    c.connect_failed(a, true);
    let ev = next(&mut c, CLI);
    assert_eq!(
        (ev.event, ev.status),
        (event::UNREACHABLE, SIDR_UNSUPPORTED as i32)
    );
    let a = ud_client(&mut c, 4);
    let p = s
        .conn_request(l, addr(2, 1), addr(1, 7000), 0, sent(&mut c).pop().unwrap())
        .unwrap();
    s.reject(SRV, p, 0, vec![]).unwrap();
    c.on_msg(a, sent(&mut s).pop().unwrap());
    let ev = next(&mut c, CLI);
    assert_eq!(
        (ev.event, ev.status),
        (event::UNREACHABLE, SIDR_REJECT as i32)
    );
}

#[test]
fn commands_out_of_order_or_on_foreign_ids_are_refused() {
    let (mut s, l, mut c, a) = listening_pair();
    s.open_channel(SRV + 1);
    assert_eq!(s.resolve_route(SRV + 1, l), Err(libc::EINVAL));
    assert_eq!(s.resolve_route(SRV, 999), Err(libc::ENOENT));
    assert_eq!(s.accept(SRV, l, 0, Some(param(1, &[]))), Err(libc::EINVAL));
    assert_eq!(s.disconnect(SRV, l), Err(libc::EINVAL));
    assert_eq!(s.bind(SRV, l, addr(1, 1)), Err(libc::EINVAL));
    assert_eq!(
        c.connect(CLI, a, param(1, &[0; msg::REQ_PRIVATE + 1])),
        Err(libc::EINVAL)
    );
    assert_eq!(c.set_option(CLI, a, 9, 9, &[0]), Err(libc::ENOSYS));
    assert_eq!(
        c.create_id(CLI, 0, 0x999, IBV_QPT_RC as u8, 0),
        Err(libc::EINVAL)
    );
    assert_eq!(
        c.create_id(99, 0, abi::PS_TCP, IBV_QPT_RC as u8, 0),
        Err(libc::EBADF)
    );
    let mut nodev = Cm::new(None);
    nodev.open_channel(1);
    let h = nodev
        .create_id(1, 0, abi::PS_TCP, IBV_QPT_RC as u8, 0)
        .unwrap();
    assert_eq!(
        nodev.resolve_ip(1, h, addr(1, 1), addr(2, 2)),
        Err(libc::ENODEV)
    );
    // A wildcard listener is tied to no device: QUERY_ROUTE names none.
    let w = s
        .create_id(SRV, 0, abi::PS_TCP, IBV_QPT_RC as u8, 0)
        .unwrap();
    s.bind(SRV, w, SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, 9))
        .unwrap();
    assert_eq!(s.query_route(SRV, w).unwrap().node_guid, 0);
    assert_eq!(s.query_route(SRV, l).unwrap().node_guid, 1u64.to_be());
}

#[test]
fn migrate_moves_an_id_with_its_waiting_events() {
    let (_, _, mut c, a) = listening_pair();
    c.open_channel(CLI + 1);
    c.connect(CLI, a, param(1, &[])).unwrap();
    c.connect_failed(a, true);
    assert_eq!(c.migrate(CLI + 1, CLI, a), Ok(2));
    assert_eq!(c.get_event(CLI), Ok(None));
    assert_eq!(next(&mut c, CLI + 1).event, event::REJECTED);
    assert_eq!(c.resolve_route(CLI, a), Err(libc::EINVAL));
    c.close_channel(CLI + 1);
    assert_eq!(c.state(a), None);
}

#[test]
fn sockaddrs_parse_and_print() {
    let b = sockaddr_in(addr(7, 18515));
    assert_eq!(parse_sockaddr(&b), Ok(Some(addr(7, 18515))));
    assert_eq!(parse_sockaddr(&[0; 28]), Ok(None));
    let mut ib = [0u8; 28];
    ib[..2].copy_from_slice(&27u16.to_ne_bytes());
    assert_eq!(parse_sockaddr(&ib), Err(libc::EAFNOSUPPORT));
    assert_eq!(parse_sockaddr(&[2, 0]), Err(libc::EINVAL));
}

#[test]
fn ud_ids_join_multicast_groups_and_leave_them() {
    let mut c = Cm::new(Some(dev(2)));
    c.open_channel(CLI);
    let a = c
        .create_id(CLI, 2, abi::PS_UDP, IBV_QPT_UD as u8, 0)
        .unwrap();
    let group = Ipv4Addr::new(239, 1, 1, 1);
    assert_eq!(
        c.join_mcast(CLI, a, 9, group),
        Err(libc::EINVAL),
        "not bound"
    );
    c.resolve_ip(CLI, a, addr(2, 1), SocketAddrV4::new(group, 0))
        .unwrap();
    next(&mut c, CLI);
    let unicast = Ipv4Addr::new(10, 0, 0, 1);
    assert_eq!(c.join_mcast(CLI, a, 9, unicast), Err(libc::EINVAL));
    let m = c.join_mcast(CLI, a, 9, group).unwrap();
    let ev = next(&mut c, CLI);
    assert_eq!((ev.event, ev.handle, ev.uid), (event::MULTICAST_JOIN, m, 9));
    let Param::Ud {
        qp_num, qkey, ah, ..
    } = ev.param
    else {
        panic!()
    };
    assert_eq!((qp_num, qkey), (0xFF_FFFF, abi::UDP_QKEY));
    assert_eq!(ah.unwrap().grh.dgid, device::gid_for(group));
    assert_eq!(c.leave_mcast(CLI, m), Ok(1));
    assert_eq!(c.leave_mcast(CLI, m), Err(libc::ENOENT));
    // A membership whose event was not fetched goes with its id, event and all; the id's
    // own count is its address event only.
    let m2 = c.join_mcast(CLI, a, 10, group).unwrap();
    assert_eq!(c.destroy_id(CLI, a), Ok(1));
    assert_eq!(c.get_event(CLI), Ok(None));
    assert_eq!(c.leave_mcast(CLI, m2), Err(libc::ENOENT));
    // Connected (RC) ids do not join.
    let (_, _, mut c, a) = listening_pair();
    assert_eq!(c.join_mcast(CLI, a, 0, group), Err(libc::EINVAL));
}
