//! The connection manager's state, free of I/O: ids and their states, per-channel event queues,
//! what INIT_QP_ATTR answers, and what each command or peer message does. The driver
//! (`cdev.rs`) performs the socket work and feeds the outcomes in; what the state wants sent or
//! closed comes back through [`Cm::take_out`].
//!
//! The transitions follow the kernel's rdma_cm over the IB CM (`drivers/infiniband/core/cma.c`,
//! `cm.c`) as librdmacm 44 observes it through `/dev/infiniband/rdma_cm`.

use std::collections::{HashMap, VecDeque};
use std::net::{Ipv4Addr, SocketAddrV4};

use super::abi::{self, event, UverbsAhAttr, UverbsQpAttr};
use super::msg::{self, Msg, Rep, Req};
use drum_verbs_abi::consts::*;
use softrnic_abi::device;

mod mcast;
mod peer;

pub type Handle = u32;
/// A channel is identified by the file descriptor the program opened.
pub type Channel = i32;

/// IB CM reject reasons used here.
pub const REJ_INVALID_SERVICE_ID: u8 = 8;
pub const REJ_CONSUMER_DEFINED: u8 = 28;
/// SIDR REP statuses (the kernel's `enum ib_cm_sidr_status`): nobody listens on the service
/// ID; the responder refused.
pub const SIDR_UNSUPPORTED: u8 = 1;
pub const SIDR_REJECT: u8 = 2;
/// The local ACK timeout (4.096 µs · 2^18 ≈ 1 s) the kernel computes for RoCE paths.
const DEFAULT_ACK_TIMEOUT: u8 = 18;
const HOP_LIMIT: u8 = 64;

/// What the CM knows of the device it binds ids to (the host's one softrnic device).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Device {
    /// `node_guid` in network byte order, as `ibv_get_device_guid` returns it.
    pub node_guid_be: u64,
    pub gid: [u8; 16],
    /// The port's active MTU (`IBV_MTU_*`).
    pub mtu: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum State {
    Idle,
    Bound,
    AddrResolved,
    RouteResolved,
    Listening,
    /// REQ (or SIDR REQ) sent, no answer yet.
    ReqSent,
    /// The active side has the REP; RTU goes out when the program accepts it.
    RepRcvd,
    /// A new passive id: the REQ arrived, the program has not answered.
    ReqRcvd,
    RepSent,
    Established,
    DreqSent,
    DreqRcvd,
    Disconnected,
    Rejected,
}

/// The connection parameters of one side as a command gave them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ConnParam {
    pub qp_num: u32,
    pub qkey: u32,
    pub srq: bool,
    pub responder_resources: u8,
    pub initiator_depth: u8,
    pub flow_control: u8,
    pub retry_count: u8,
    pub rnr_retry_count: u8,
    pub private: Vec<u8>,
}

impl ConnParam {
    pub fn from_abi(p: &abi::ConnParam) -> ConnParam {
        let n = (p.private_data_len as usize).min(abi::MAX_PRIVATE_DATA);
        ConnParam {
            qp_num: p.qp_num,
            qkey: p.qkey,
            srq: p.srq != 0,
            responder_resources: p.responder_resources,
            initiator_depth: p.initiator_depth,
            flow_control: p.flow_control,
            retry_count: p.retry_count,
            rnr_retry_count: p.rnr_retry_count,
            private: p.private_data[..n].to_vec(),
        }
    }
}

/// The peer's side of a connection.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct Remote {
    qpn: u32,
    psn: u32,
    gid: [u8; 16],
    /// The transport retry count the requester chose (it applies to both sides).
    retry_count: u8,
    /// The RNR retry count this side must use when sending to the peer.
    rnr_retry_count: u8,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Param {
    None,
    Conn(ConnParam),
    Ud {
        qp_num: u32,
        qkey: u32,
        ah: Option<UverbsAhAttr>,
        private: Vec<u8>,
    },
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Event {
    /// The id the event is about (for a connect request: the new id).
    pub handle: Handle,
    pub uid: u64,
    pub event: u32,
    pub status: i32,
    pub param: Param,
    /// The id whose `events_reported` counts it (for a connect request: the listener).
    counted_by: Handle,
    /// The multicast membership the event is about (it counts the event instead).
    mc: Option<Handle>,
}

impl Event {
    pub fn to_abi(&self) -> abi::EventResp {
        let mut r: abi::EventResp = abi::Pod::zeroed();
        r.uid = self.uid;
        r.id = self.handle;
        r.event = self.event;
        r.status = self.status as u32;
        match &self.param {
            Param::None => {}
            Param::Conn(c) => {
                let mut p: abi::ConnParam = abi::Pod::zeroed();
                p.qp_num = c.qp_num;
                p.srq = c.srq as u8;
                p.responder_resources = c.responder_resources;
                p.initiator_depth = c.initiator_depth;
                p.flow_control = c.flow_control;
                p.retry_count = c.retry_count;
                p.rnr_retry_count = c.rnr_retry_count;
                p.private_data[..c.private.len()].copy_from_slice(&c.private);
                p.private_data_len = c.private.len() as u8;
                r.param.conn = p;
            }
            Param::Ud {
                qp_num,
                qkey,
                ah,
                private,
            } => {
                let mut p: abi::UdParam = abi::Pod::zeroed();
                p.qp_num = *qp_num;
                p.qkey = *qkey;
                p.ah_attr = ah.unwrap_or_default();
                p.private_data[..private.len()].copy_from_slice(private);
                p.private_data_len = private.len() as u8;
                r.param.ud = p;
            }
        }
        r
    }
}

#[derive(Clone, Debug)]
struct Id {
    channel: Channel,
    uid: u64,
    ps: u16,
    qp_type: u8,
    state: State,
    src: Option<SocketAddrV4>,
    dst: Option<SocketAddrV4>,
    /// Our starting PSN, drawn when the id was made.
    psn: u32,
    local: ConnParam,
    remote: Option<Remote>,
    events_reported: u32,
    /// A passive id whose connect request the program has not fetched: it dies with its
    /// listener.
    pending_child_of: Option<Handle>,
    tos: u8,
    ack_timeout: Option<u8>,
}

impl Id {
    fn ud(&self) -> bool {
        self.qp_type as i32 == IBV_QPT_UD
    }
    fn rc(&self) -> bool {
        self.qp_type as i32 == IBV_QPT_RC
    }
    /// Whether the id is tied to the device: bound to a specific address, or addressed.
    fn has_device(&self) -> bool {
        self.dst.is_some() || self.src.is_some_and(|s| !s.ip().is_unspecified())
    }
}

/// An id's membership of a multicast group.
#[derive(Clone, Debug)]
struct Mc {
    id: Handle,
    events_reported: u32,
}

/// What the driver must do on the state's behalf.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Out {
    /// Open the id's connection from its source to its destination and send `first`.
    Connect {
        handle: Handle,
        from: SocketAddrV4,
        to: SocketAddrV4,
        first: Msg,
    },
    Send(Handle, Msg),
    /// Close the id's connection (after what was sent), its listener and its bound socket.
    Close(Handle),
}

#[derive(Default)]
pub struct Cm {
    dev: Option<Device>,
    ids: HashMap<Handle, Id>,
    /// Multicast memberships (JOIN_IP_MCAST), by their own handles.
    mcs: HashMap<Handle, Mc>,
    next: Handle,
    queues: HashMap<Channel, VecDeque<Event>>,
    out: Vec<Out>,
}

type R<T> = Result<T, i32>;

impl Cm {
    pub fn new(dev: Option<Device>) -> Cm {
        Cm {
            dev,
            ..Cm::default()
        }
    }

    pub fn open_channel(&mut self, ch: Channel) {
        self.queues.insert(ch, VecDeque::new());
    }

    pub fn has_channel(&self, ch: Channel) -> bool {
        self.queues.contains_key(&ch)
    }

    /// Events waiting on each channel (the driver mirrors these counts in the channels'
    /// readiness).
    pub fn queued(&self) -> impl Iterator<Item = (Channel, usize)> + '_ {
        self.queues.iter().map(|(c, q)| (*c, q.len()))
    }

    pub fn take_out(&mut self) -> Vec<Out> {
        std::mem::take(&mut self.out)
    }

    /// The id `h` if it belongs to channel `ch` (ENOENT: no such id; EINVAL: another
    /// channel's, as the kernel answers).
    fn id_mut(&mut self, ch: Channel, h: Handle) -> R<&mut Id> {
        match self.ids.get_mut(&h) {
            None => Err(libc::ENOENT),
            Some(id) if id.channel != ch => Err(libc::EINVAL),
            Some(id) => Ok(id),
        }
    }

    fn id(&self, ch: Channel, h: Handle) -> R<&Id> {
        match self.ids.get(&h) {
            None => Err(libc::ENOENT),
            Some(id) if id.channel != ch => Err(libc::EINVAL),
            Some(id) => Ok(id),
        }
    }

    pub fn state(&self, h: Handle) -> Option<State> {
        self.ids.get(&h).map(|i| i.state)
    }

    pub fn src(&self, h: Handle) -> Option<SocketAddrV4> {
        self.ids.get(&h).and_then(|i| i.src)
    }

    fn push(&mut self, ev: Event) {
        let ch = match self.ids.get(&ev.handle) {
            Some(id) => id.channel,
            None => return,
        };
        if let Some(q) = self.queues.get_mut(&ch) {
            q.push_back(ev);
        }
    }

    fn event(&mut self, h: Handle, event: u32, status: i32, param: Param) {
        let uid = self.ids.get(&h).map_or(0, |i| i.uid);
        self.push(Event {
            handle: h,
            uid,
            event,
            status,
            param,
            counted_by: h,
            mc: None,
        });
    }

    // -- commands -------------------------------------------------------------------------

    pub fn create_id(
        &mut self,
        ch: Channel,
        uid: u64,
        ps: u16,
        qp_type: u8,
        psn: u32,
    ) -> R<Handle> {
        if !self.has_channel(ch) {
            return Err(libc::EBADF);
        }
        let ok_type = matches!(qp_type as i32, IBV_QPT_RC | IBV_QPT_UC | IBV_QPT_UD);
        if !matches!(ps, abi::PS_TCP | abi::PS_UDP | abi::PS_IB | abi::PS_IPOIB) || !ok_type {
            return Err(libc::EINVAL);
        }
        let h = self.new_handle();
        self.ids.insert(
            h,
            Id {
                channel: ch,
                uid,
                ps,
                qp_type,
                state: State::Idle,
                src: None,
                dst: None,
                psn: psn & 0xff_ffff,
                local: ConnParam::default(),
                remote: None,
                events_reported: 0,
                pending_child_of: None,
                tos: 0,
                ack_timeout: None,
            },
        );
        Ok(h)
    }

    fn new_handle(&mut self) -> Handle {
        self.next = self.next.wrapping_add(1);
        while self.ids.contains_key(&self.next) || self.mcs.contains_key(&self.next) {
            self.next = self.next.wrapping_add(1);
        }
        self.next
    }

    /// Destroy an id: its undelivered events go, its connection is refused or disconnected,
    /// and a listener takes its unfetched connect requests with it. Returns how many events
    /// the program was given about it.
    pub fn destroy_id(&mut self, ch: Channel, h: Handle) -> R<u32> {
        self.id(ch, h)?;
        Ok(self.destroy(h))
    }

    fn destroy(&mut self, h: Handle) -> u32 {
        let Some(id) = self.ids.remove(&h) else {
            return 0;
        };
        match id.state {
            State::ReqRcvd => self
                .out
                .push(Out::Send(h, reject_msg(&id, REJ_CONSUMER_DEFINED))),
            State::RepSent | State::RepRcvd | State::Established => {
                self.out.push(Out::Send(h, Msg::Dreq))
            }
            State::DreqRcvd => self.out.push(Out::Send(h, Msg::Drep)),
            _ => {}
        }
        self.out.push(Out::Close(h));
        let mine: Vec<Handle> = self
            .mcs
            .iter()
            .filter(|(_, m)| m.id == h)
            .map(|(k, _)| *k)
            .collect();
        for m in mine {
            self.drop_mc(id.channel, m);
        }
        let mut children = Vec::new();
        if let Some(q) = self.queues.get_mut(&id.channel) {
            q.retain(|e| {
                if e.counted_by == h && e.handle != h {
                    children.push(e.handle);
                }
                e.handle != h && e.counted_by != h
            });
        }
        for c in children {
            if self
                .ids
                .get(&c)
                .is_some_and(|i| i.pending_child_of == Some(h))
            {
                self.destroy(c);
            }
        }
        id.events_reported
    }

    /// The channel's file was closed: all its ids go.
    pub fn close_channel(&mut self, ch: Channel) {
        let mine: Vec<Handle> = self
            .ids
            .iter()
            .filter(|(_, i)| i.channel == ch)
            .map(|(h, _)| *h)
            .collect();
        for h in mine {
            self.destroy(h);
        }
        self.queues.remove(&ch);
    }

    /// BIND_IP/BIND: the driver has bound a socket to `addr` (port filled in).
    pub fn bind(&mut self, ch: Channel, h: Handle, addr: SocketAddrV4) -> R<()> {
        let id = self.id_mut(ch, h)?;
        if id.state != State::Idle {
            return Err(libc::EINVAL);
        }
        id.src = Some(addr);
        id.state = State::Bound;
        Ok(())
    }

    /// May the id be bound (or bound implicitly, for RESOLVE_IP and LISTEN)?
    pub fn check(&self, ch: Channel, h: Handle, states: &[State]) -> R<State> {
        let id = self.id(ch, h)?;
        if states.contains(&id.state) {
            Ok(id.state)
        } else {
            Err(libc::EINVAL)
        }
    }

    /// RESOLVE_IP: `src` is the address the driver chose (and bound, if the id was not).
    pub fn resolve_ip(
        &mut self,
        ch: Channel,
        h: Handle,
        src: SocketAddrV4,
        dst: SocketAddrV4,
    ) -> R<()> {
        if self.dev.is_none() {
            return Err(libc::ENODEV);
        }
        let id = self.id_mut(ch, h)?;
        if !matches!(id.state, State::Idle | State::Bound | State::AddrResolved) {
            return Err(libc::EINVAL);
        }
        id.src = Some(src);
        id.dst = Some(dst);
        id.state = State::AddrResolved;
        self.event(h, event::ADDR_RESOLVED, 0, Param::None);
        Ok(())
    }

    /// RESOLVE_IP for a destination with no route: the event reports it.
    pub fn resolve_ip_failed(&mut self, ch: Channel, h: Handle, errno: i32) -> R<()> {
        self.id(ch, h)?;
        self.event(h, event::ADDR_ERROR, -errno, Param::None);
        Ok(())
    }

    pub fn resolve_route(&mut self, ch: Channel, h: Handle) -> R<()> {
        let id = self.id_mut(ch, h)?;
        if id.state != State::AddrResolved {
            return Err(libc::EINVAL);
        }
        id.state = State::RouteResolved;
        self.event(h, event::ROUTE_RESOLVED, 0, Param::None);
        Ok(())
    }

    pub fn query_route(&self, ch: Channel, h: Handle) -> R<abi::QueryRouteResp> {
        let id = self.id(ch, h)?;
        let mut r: abi::QueryRouteResp = abi::Pod::zeroed();
        r.ibdev_index = u32::MAX;
        if let Some(s) = id.src {
            r.src_addr = sockaddr_in(s);
        }
        if let Some(d) = id.dst {
            r.dst_addr = sockaddr_in(d);
        }
        let (Some(dev), true) = (self.dev, id.has_device()) else {
            return Ok(r);
        };
        r.node_guid = dev.node_guid_be;
        r.port_num = 1;
        let p = &mut r.ib_route[0];
        p.sgid = dev.gid;
        p.dgid = match (&id.remote, id.dst) {
            (Some(rm), _) => rm.gid,
            (None, Some(d)) => device::gid_for(*d.ip()),
            (None, None) => [0; 16],
        };
        p.pkey = 0xffff;
        p.mtu = dev.mtu;
        p.hop_limit = HOP_LIMIT;
        p.traffic_class = id.tos;
        p.numb_path = 1;
        p.mtu_selector = 2;
        p.rate_selector = 2;
        p.packet_life_time_selector = 2;
        p.packet_life_time = DEFAULT_ACK_TIMEOUT - 1;
        if !matches!(
            id.state,
            State::Idle | State::Bound | State::AddrResolved | State::Listening
        ) {
            r.num_paths = 1;
        }
        Ok(r)
    }

    /// CONNECT: a REQ (SIDR REQ for UD) goes to the destination.
    pub fn connect(&mut self, ch: Channel, h: Handle, p: ConnParam) -> R<()> {
        let gid = self.dev.ok_or(libc::ENODEV)?.gid;
        let id = self.id_mut(ch, h)?;
        if id.state != State::RouteResolved {
            return Err(libc::EINVAL);
        }
        let max = if id.ud() {
            msg::SIDR_REQ_PRIVATE
        } else {
            msg::REQ_PRIVATE
        };
        if p.private.len() > max {
            return Err(libc::EINVAL);
        }
        let (Some(from), Some(to)) = (id.src, id.dst) else {
            return Err(libc::EINVAL);
        };
        let first = if id.ud() {
            Msg::SidrReq {
                gid,
                private: p.private.clone(),
            }
        } else {
            Msg::Req(Req {
                qpn: p.qp_num,
                psn: id.psn,
                gid,
                srq: p.srq,
                responder_resources: p.responder_resources,
                initiator_depth: p.initiator_depth,
                flow_control: p.flow_control,
                retry_count: p.retry_count,
                rnr_retry_count: p.rnr_retry_count,
                private: p.private.clone(),
            })
        };
        id.local = p;
        id.state = State::ReqSent;
        self.out.push(Out::Connect {
            handle: h,
            from,
            to,
            first,
        });
        Ok(())
    }

    /// REJECTED with `status` and the REJ's private data as the receiver sees it.
    fn rejected(&mut self, h: Handle, status: i32, private: &[u8]) {
        let param = Param::Conn(ConnParam {
            private: msg::padded(private, msg::REJ_PRIVATE),
            ..ConnParam::default()
        });
        self.event(h, event::REJECTED, status, param);
    }

    /// The driver could not reach the destination: refused (no listener) or unreachable.
    pub fn connect_failed(&mut self, h: Handle, refused: bool) {
        let Some(id) = self.ids.get_mut(&h) else {
            return;
        };
        if id.state != State::ReqSent {
            return;
        }
        id.state = State::Rejected;
        self.out.push(Out::Close(h));
        let ud = self.ids[&h].ud();
        if refused && !ud {
            self.rejected(h, REJ_INVALID_SERVICE_ID as i32, &[]);
        } else if refused {
            self.event(h, event::UNREACHABLE, SIDR_UNSUPPORTED as i32, Param::None);
        } else {
            self.event(h, event::UNREACHABLE, -libc::ETIMEDOUT, Param::None);
        }
    }

    /// LISTEN on a bound id (the driver listens on its socket).
    pub fn listen(&mut self, ch: Channel, h: Handle) -> R<()> {
        let id = self.id_mut(ch, h)?;
        if id.state != State::Bound {
            return Err(libc::EINVAL);
        }
        id.state = State::Listening;
        Ok(())
    }

    /// A REQ or SIDR REQ arrived at listener `l` over a new connection from `peer` to `local`:
    /// a new id, announced on the listener's channel. None if the listener is gone or the
    /// message opens no connection (the driver then drops the connection).
    pub fn conn_request(
        &mut self,
        l: Handle,
        peer: SocketAddrV4,
        local: SocketAddrV4,
        psn: u32,
        m: Msg,
    ) -> Option<Handle> {
        let lid = self.ids.get(&l)?;
        if lid.state != State::Listening {
            return None;
        }
        let (ch, uid, ps, qp_type, tos) = (lid.channel, lid.uid, lid.ps, lid.qp_type, lid.tos);
        let (remote, local_p, param) = match (m, lid.ud()) {
            (Msg::Req(r), false) => {
                let param = Param::Conn(ConnParam {
                    qp_num: r.qpn,
                    qkey: 0,
                    srq: r.srq,
                    responder_resources: r.initiator_depth,
                    initiator_depth: r.responder_resources,
                    flow_control: r.flow_control,
                    retry_count: r.retry_count,
                    rnr_retry_count: r.rnr_retry_count,
                    private: msg::padded(&r.private, msg::REQ_PRIVATE),
                });
                let remote = Remote {
                    qpn: r.qpn,
                    psn: r.psn,
                    gid: r.gid,
                    retry_count: r.retry_count,
                    rnr_retry_count: r.rnr_retry_count,
                };
                let local_p = ConnParam {
                    responder_resources: r.initiator_depth,
                    initiator_depth: r.responder_resources,
                    ..ConnParam::default()
                };
                (remote, local_p, param)
            }
            (Msg::SidrReq { gid, private }, true) => {
                let param = Param::Ud {
                    qp_num: 0,
                    qkey: 0,
                    ah: None,
                    private: msg::padded(&private, msg::SIDR_REQ_PRIVATE),
                };
                let remote = Remote {
                    gid,
                    ..Remote::default()
                };
                (remote, ConnParam::default(), param)
            }
            _ => return None,
        };
        let h = self.create_id(ch, 0, ps, qp_type, psn).ok()?;
        let id = self.ids.get_mut(&h)?;
        id.state = State::ReqRcvd;
        id.src = Some(local);
        id.dst = Some(peer);
        id.remote = Some(remote);
        id.local = local_p;
        id.tos = tos;
        id.pending_child_of = Some(l);
        self.push(Event {
            handle: h,
            uid,
            event: event::CONNECT_REQUEST,
            status: 0,
            param,
            counted_by: l,
            mc: None,
        });
        Some(h)
    }

    /// ACCEPT: on a passive id, the REP (SIDR REP for UD); on an active id that has the REP,
    /// the RTU.
    pub fn accept(&mut self, ch: Channel, h: Handle, uid: u64, p: Option<ConnParam>) -> R<()> {
        let gid = self.dev.ok_or(libc::ENODEV)?.gid;
        let id = self.id_mut(ch, h)?;
        if let Some(p) = &p {
            id.uid = uid;
            let max = if id.ud() {
                msg::SIDR_REP_PRIVATE
            } else {
                msg::REP_PRIVATE
            };
            if p.private.len() > max {
                return Err(libc::EINVAL);
            }
        }
        match (id.state, id.ud()) {
            (State::RepRcvd, false) => {
                id.state = State::Established;
                self.out.push(Out::Send(h, Msg::Rtu));
                Ok(())
            }
            (State::ReqRcvd, false) => {
                let p = p.ok_or(libc::EINVAL)?;
                let rep = Rep {
                    qpn: p.qp_num,
                    psn: id.psn,
                    gid,
                    srq: p.srq,
                    responder_resources: p.responder_resources,
                    initiator_depth: p.initiator_depth,
                    flow_control: p.flow_control,
                    rnr_retry_count: p.rnr_retry_count,
                    private: p.private.clone(),
                };
                id.local = p;
                id.state = State::RepSent;
                self.out.push(Out::Send(h, Msg::Rep(rep)));
                Ok(())
            }
            (State::ReqRcvd, true) => {
                let p = p.ok_or(libc::EINVAL)?;
                let qkey = if p.qkey != 0 { p.qkey } else { abi::UDP_QKEY };
                let rep = Msg::SidrRep {
                    status: 0,
                    qpn: p.qp_num,
                    qkey,
                    gid,
                    private: p.private.clone(),
                };
                id.local = p;
                id.state = State::Established;
                self.out.push(Out::Send(h, rep));
                Ok(())
            }
            _ => Err(libc::EINVAL),
        }
    }

    pub fn reject(&mut self, ch: Channel, h: Handle, reason: u8, private: Vec<u8>) -> R<()> {
        let id = self.id_mut(ch, h)?;
        if id.state != State::ReqRcvd {
            return Err(libc::EINVAL);
        }
        if private.len() > msg::REJ_PRIVATE {
            return Err(libc::EINVAL);
        }
        let reason = if reason == 0 {
            REJ_CONSUMER_DEFINED
        } else {
            reason
        };
        let m = if id.ud() {
            Msg::SidrRep {
                status: SIDR_REJECT,
                qpn: 0,
                qkey: 0,
                gid: [0; 16],
                private: private.into_iter().take(msg::SIDR_REP_PRIVATE).collect(),
            }
        } else {
            Msg::Rej { reason, private }
        };
        id.state = State::Rejected;
        self.out.push(Out::Send(h, m));
        self.out.push(Out::Close(h));
        Ok(())
    }

    pub fn disconnect(&mut self, ch: Channel, h: Handle) -> R<()> {
        let id = self.id_mut(ch, h)?;
        match id.state {
            State::Established | State::RepSent | State::RepRcvd if !id.ud() => {
                id.state = State::DreqSent;
                self.out.push(Out::Send(h, Msg::Dreq));
                Ok(())
            }
            State::DreqRcvd => {
                id.state = State::Disconnected;
                self.out.push(Out::Send(h, Msg::Drep));
                self.out.push(Out::Close(h));
                Ok(())
            }
            _ => Err(libc::EINVAL),
        }
    }

    /// What `ibv_modify_qp` needs to take the id's QP to `qp_state` (INIT_QP_ATTR).
    pub fn init_qp_attr(&self, ch: Channel, h: Handle, qp_state: u32) -> R<UverbsQpAttr> {
        let id = self.id(ch, h)?;
        let dev = self.dev.ok_or(libc::ENODEV)?;
        if !id.has_device() {
            return Err(libc::EINVAL);
        }
        let mut a = UverbsQpAttr {
            qp_state,
            port_num: 1,
            ..UverbsQpAttr::default()
        };
        let mask = match qp_state as i32 {
            IBV_QPS_INIT => {
                let mut m = IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT;
                if id.ud() {
                    a.qkey = abi::UDP_QKEY;
                    m |= IBV_QP_QKEY;
                } else {
                    if id.remote.is_some() {
                        a.qp_access_flags = IBV_ACCESS_REMOTE_WRITE;
                        if id.local.responder_resources > 0 {
                            a.qp_access_flags |= IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC;
                        }
                    }
                    m |= IBV_QP_ACCESS_FLAGS;
                }
                m
            }
            IBV_QPS_RTR if !id.ud() => {
                let r = id.remote.as_ref().ok_or(libc::EINVAL)?;
                a.ah_attr = ah_to(r.gid, id.tos);
                a.path_mtu = dev.mtu;
                a.dest_qp_num = r.qpn;
                a.rq_psn = r.psn;
                let mut m =
                    IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN;
                if id.rc() {
                    a.max_dest_rd_atomic = id.local.responder_resources;
                    a.min_rnr_timer = 0;
                    m |= IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER;
                }
                m
            }
            IBV_QPS_RTS if !id.ud() => {
                let r = id.remote.as_ref().ok_or(libc::EINVAL)?;
                a.sq_psn = id.psn;
                let mut m = IBV_QP_STATE | IBV_QP_SQ_PSN;
                if id.rc() {
                    a.timeout = id.ack_timeout.unwrap_or(DEFAULT_ACK_TIMEOUT);
                    a.retry_cnt = r.retry_count;
                    a.rnr_retry = r.rnr_retry_count;
                    a.max_rd_atomic = id.local.initiator_depth;
                    m |= IBV_QP_TIMEOUT
                        | IBV_QP_RETRY_CNT
                        | IBV_QP_RNR_RETRY
                        | IBV_QP_MAX_QP_RD_ATOMIC;
                }
                m
            }
            _ => return Err(libc::EINVAL),
        };
        a.qp_attr_mask = mask as u32;
        Ok(a)
    }

    pub fn set_option(
        &mut self,
        ch: Channel,
        h: Handle,
        level: u32,
        name: u32,
        val: &[u8],
    ) -> R<()> {
        let id = self.id_mut(ch, h)?;
        let byte = || val.first().copied().ok_or(libc::EINVAL);
        match (level, name) {
            (abi::OPTION_ID, abi::OPTION_ID_TOS) => id.tos = byte()?,
            (abi::OPTION_ID, abi::OPTION_ID_ACK_TIMEOUT) => id.ack_timeout = Some(byte()?.min(31)),
            (abi::OPTION_ID, abi::OPTION_ID_REUSEADDR | abi::OPTION_ID_AFONLY) => {
                if val.len() < 4 {
                    return Err(libc::EINVAL);
                }
            }
            // Path records: the route is always the one path between the two hosts.
            (abi::OPTION_IB, abi::OPTION_IB_PATH) => {}
            _ => return Err(libc::ENOSYS),
        }
        Ok(())
    }

    pub fn notify(&mut self, ch: Channel, h: Handle) -> R<()> {
        self.id(ch, h).map(|_| ())
    }

    /// MIGRATE_ID: move id `h` and its waiting events from channel `from` to `to`.
    pub fn migrate(&mut self, to: Channel, from: Channel, h: Handle) -> R<u32> {
        if !self.has_channel(to) || !self.has_channel(from) {
            return Err(libc::EINVAL);
        }
        let id = self.id_mut(from, h)?;
        id.channel = to;
        let reported = id.events_reported;
        let q = self.queues.get_mut(&from).expect("checked");
        let (moving, staying): (VecDeque<Event>, VecDeque<Event>) = q
            .drain(..)
            .partition(|e| e.counted_by == h && (e.handle == h || e.mc.is_some()));
        *q = staying;
        self.queues.get_mut(&to).expect("checked").extend(moving);
        Ok(reported)
    }

    /// GET_EVENT: the channel's next event, counted as reported.
    pub fn get_event(&mut self, ch: Channel) -> R<Option<Event>> {
        let q = self.queues.get_mut(&ch).ok_or(libc::EBADF)?;
        let Some(ev) = q.pop_front() else {
            return Ok(None);
        };
        if let Some(m) = ev.mc {
            if let Some(m) = self.mcs.get_mut(&m) {
                m.events_reported += 1;
            }
        } else if let Some(id) = self.ids.get_mut(&ev.counted_by) {
            id.events_reported += 1;
        }
        if ev.event == event::CONNECT_REQUEST {
            if let Some(child) = self.ids.get_mut(&ev.handle) {
                child.pending_child_of = None;
            }
        }
        Ok(Some(ev))
    }
}

/// A RoCE address vector to the port with GID `gid`.
fn ah_to(gid: [u8; 16], tos: u8) -> UverbsAhAttr {
    let mut ah = UverbsAhAttr {
        is_global: 1,
        port_num: 1,
        ..UverbsAhAttr::default()
    };
    ah.grh.dgid = gid;
    ah.grh.hop_limit = HOP_LIMIT;
    ah.grh.traffic_class = tos;
    ah
}

fn reject_msg(id: &Id, reason: u8) -> Msg {
    if id.ud() {
        Msg::SidrRep {
            status: SIDR_REJECT,
            qpn: 0,
            qkey: 0,
            gid: [0; 16],
            private: vec![],
        }
    } else {
        Msg::Rej {
            reason,
            private: vec![],
        }
    }
}

/// A `struct sockaddr_in` in the first bytes of a `sockaddr_in6`-sized buffer.
pub fn sockaddr_in(a: SocketAddrV4) -> abi::SockaddrIn6 {
    let mut b = [0u8; 28];
    b[..2].copy_from_slice(&(libc::AF_INET as u16).to_ne_bytes());
    b[2..4].copy_from_slice(&a.port().to_be_bytes());
    b[4..8].copy_from_slice(&a.ip().octets());
    b
}

/// An IPv4 socket address from a `sockaddr` in `b`: Ok(None) for AF_UNSPEC (no address),
/// EAFNOSUPPORT for other families (IPv6 and AF_IB addresses are not offered).
pub fn parse_sockaddr(b: &[u8]) -> R<Option<SocketAddrV4>> {
    if b.len() < 8 {
        return Err(libc::EINVAL);
    }
    match u16::from_ne_bytes([b[0], b[1]]) as i32 {
        libc::AF_UNSPEC => Ok(None),
        libc::AF_INET => Ok(Some(SocketAddrV4::new(
            Ipv4Addr::new(b[4], b[5], b[6], b[7]),
            u16::from_be_bytes([b[2], b[3]]),
        ))),
        _ => Err(libc::EAFNOSUPPORT),
    }
}

#[cfg(test)]
mod tests;
