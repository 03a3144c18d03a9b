//! Connections through the RDMA connection manager (librdmacm): the client resolves and
//! connects, the server listens and accepts; the handshake messages ride in the CM's private
//! data. Each [`Endpoint`] owns its id, QP, CQ and registered buffer and frees them in order.

use crate::verbs::{self, check, os_error, Cq, Mr, Pd};
use rdma_sys::*;
use std::net::SocketAddrV4;
use std::ptr::null_mut;
use std::sync::Arc;

pub struct EventChannel(*mut rdma_event_channel);

// SAFETY: librdmacm channels may be used from any thread.
unsafe impl Send for EventChannel {}
// SAFETY: as for `Send`: librdmacm serialises the calls made on one channel.
unsafe impl Sync for EventChannel {}

impl EventChannel {
    pub fn new() -> anyhow::Result<EventChannel> {
        // SAFETY: no preconditions.
        let ch = unsafe { rdma_create_event_channel() };
        if ch.is_null() {
            return Err(os_error("rdma_create_event_channel"));
        }
        Ok(EventChannel(ch))
    }

    /// The next event (blocking); acknowledged when dropped.
    pub fn next(&self) -> anyhow::Result<Event> {
        let mut ev = null_mut();
        // SAFETY: the channel is alive.
        let rc = unsafe { rdma_get_cm_event(self.0, &mut ev) };
        check(rc, "rdma_get_cm_event")?;
        Ok(Event(ev))
    }

    /// The next event, which must be `want`.
    pub fn expect(&self, want: u32) -> anyhow::Result<Event> {
        let ev = self.next()?;
        anyhow::ensure!(
            ev.kind() == want,
            "expected {}, got {} (status {})",
            event_name(want),
            event_name(ev.kind()),
            ev.status()
        );
        Ok(ev)
    }

    pub fn fd(&self) -> i32 {
        // SAFETY: alive.
        unsafe { (*self.0).fd }
    }
}

impl Drop for EventChannel {
    fn drop(&mut self) {
        // SAFETY: every id on it is destroyed first (owners drop them before).
        unsafe { rdma_destroy_event_channel(self.0) }
    }
}

pub struct Event(*mut rdma_cm_event);

impl Event {
    pub fn kind(&self) -> u32 {
        // SAFETY: alive until acked in drop.
        unsafe { (*self.0).event }
    }

    pub fn status(&self) -> i32 {
        // SAFETY: as kind.
        unsafe { (*self.0).status }
    }

    pub fn id(&self) -> *mut rdma_cm_id {
        // SAFETY: as kind.
        unsafe { (*self.0).id }
    }

    /// The private data of a connection event (zero-padded by the CM).
    pub fn private_data(&self) -> Vec<u8> {
        // SAFETY: for connection events the conn member is the valid one; the CM owns the
        // bytes until the event is acked.
        unsafe {
            let c = (*self.0).param.conn;
            if c.private_data.is_null() {
                return Vec::new();
            }
            std::slice::from_raw_parts(c.private_data.cast::<u8>(), c.private_data_len as usize)
                .to_vec()
        }
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: got from rdma_get_cm_event, acked once.
        unsafe { rdma_ack_cm_event(self.0) };
    }
}

pub fn event_name(kind: u32) -> String {
    // SAFETY: returns a static string for any value.
    unsafe { std::ffi::CStr::from_ptr(rdma_event_str(kind)) }
        .to_string_lossy()
        .into_owned()
}

fn sockaddr(addr: SocketAddrV4) -> libc::sockaddr_in {
    libc::sockaddr_in {
        sin_family: libc::AF_INET as u16,
        sin_port: addr.port().to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from(*addr.ip()).to_be(),
        },
        sin_zero: [0; 8],
    }
}

/// An id that is destroyed on drop unless handed on.
struct Id(*mut rdma_cm_id);

impl Drop for Id {
    fn drop(&mut self) {
        if !self.0.is_null() {
            // SAFETY: our id; its QP was destroyed (or never made).
            unsafe { rdma_destroy_id(self.0) };
        }
    }
}

/// A reliable-connection id whose events arrive on `channel`; it must be dropped before the
/// channel is.
fn create_id(channel: &EventChannel) -> anyhow::Result<Id> {
    let mut id = Id(null_mut());
    // SAFETY: the channel is alive; `id.0` receives the new id.
    let rc = unsafe {
        rdma_create_id(
            channel.0,
            &mut id.0,
            null_mut(),
            rdma_port_space::RDMA_PS_TCP,
        )
    };
    check(rc, "rdma_create_id")?;
    Ok(id)
}

/// Inline bytes asked for on every QP: room for a GET request (40 B) and the reply to a GET
/// of up to 192 B (16 + 24 + 192), the small messages whose fetch from memory costs as
/// much as their transfer.
const WANTED_INLINE: u32 = 256;

/// Sizes of an endpoint's queues and memory.
#[derive(Debug, Clone, Copy)]
pub struct QueueSizes {
    pub send: usize,
    pub recv: usize,
    pub buffer: usize,
    pub events: bool,
}

/// A connected (or accepted) QP with its CQ and registered buffer.
pub struct Endpoint {
    id: *mut rdma_cm_id,
    pub cq: Cq,
    pub mr: Mr,
    /// The most bytes a SEND may carry inline on this QP.
    max_inline: u32,
    /// The client's own channel (the server's connections share the listener's).
    _channel: Option<EventChannel>,
}

// SAFETY: verbs and CM objects may be used from any thread.
unsafe impl Send for Endpoint {}
// SAFETY: as for `Send`: libibverbs and librdmacm are thread-safe for one object's verbs.
unsafe impl Sync for Endpoint {}

impl Endpoint {
    /// Makes the CQ, QP and buffer of a resolved or requested id; returns them with the QP's
    /// inline limit.
    fn build(id: *mut rdma_cm_id, pd: &Arc<Pd>, q: QueueSizes) -> anyhow::Result<(Cq, Mr, u32)> {
        // SAFETY: the id is resolved, so it has a device context.
        let ctx = unsafe { (*id).verbs };
        let cq = Cq::new(ctx, q.send + q.recv, q.events)?;
        let mr = Mr::new(pd, crate::verbs::Buffer::new(q.buffer)?)?;
        // SAFETY: plain data.
        let mut attr: ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        attr.send_cq = cq.cq;
        attr.recv_cq = cq.cq;
        attr.qp_type = ibv_qp_type::IBV_QPT_RC;
        attr.cap = ibv_qp_cap {
            max_send_wr: q.send as u32,
            max_recv_wr: q.recv.max(1) as u32,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: WANTED_INLINE,
        };
        // SAFETY: id, pd and cq are alive.
        if unsafe { rdma_create_qp(id, pd.0, &mut attr) } != 0 {
            // a device that inlines less (or nothing): without
            attr.cap.max_inline_data = 0;
            // SAFETY: as above.
            let rc = unsafe { rdma_create_qp(id, pd.0, &mut attr) };
            check(rc, "rdma_create_qp")?;
        }
        // (the provider wrote back what the QP really has)
        Ok((cq, mr, attr.cap.max_inline_data))
    }

    /// The most bytes a SEND carries inline on this QP.
    pub fn max_inline(&self) -> usize {
        self.max_inline as usize
    }

    /// Posts `wrs` on the QP (see [`verbs::post_send`]).
    pub fn post_send(&self, wrs: &[verbs::SendWr]) -> anyhow::Result<()> {
        verbs::post_send(self.qp(), self.max_inline, wrs)
    }

    pub fn qp(&self) -> *mut ibv_qp {
        // SAFETY: the QP lives as long as the endpoint.
        unsafe { (*self.id).qp }
    }

    /// Sends a disconnect request (the peer sees DISCONNECTED).
    pub fn disconnect(&self) {
        // SAFETY: alive; disconnecting twice is harmless.
        unsafe { rdma_disconnect(self.id) };
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        // SAFETY: the QP and id are ours and every event of the id was acknowledged (the
        // server destroys an endpoint only after its DISCONNECTED event). The QP goes
        // before its CQ and buffer (fields, dropped after this) and the id before its
        // channel (a field too).
        unsafe {
            rdma_destroy_qp(self.id);
            rdma_destroy_id(self.id);
        }
    }
}

/// Connects to `server` with `hello` as private data; returns the endpoint (with `prepare`
/// already applied, e.g. receives posted before the server can send) and the server's answer.
pub fn connect(
    server: SocketAddrV4,
    hello: &[u8],
    q: QueueSizes,
    prepare: impl FnOnce(&Endpoint) -> anyhow::Result<()>,
) -> anyhow::Result<(Endpoint, Vec<u8>)> {
    let channel = EventChannel::new()?;
    let mut id = create_id(&channel)?;
    let mut dst = sockaddr(server);
    // SAFETY: dst is a valid sockaddr_in.
    let rc = unsafe {
        rdma_resolve_addr(
            id.0,
            null_mut(),
            (&mut dst as *mut libc::sockaddr_in).cast(),
            2000,
        )
    };
    check(rc, "rdma_resolve_addr")?;
    drop(channel.expect(rdma_cm_event_type::RDMA_CM_EVENT_ADDR_RESOLVED)?);
    // SAFETY: address resolved.
    let rc = unsafe { rdma_resolve_route(id.0, 2000) };
    check(rc, "rdma_resolve_route")?;
    drop(channel.expect(rdma_cm_event_type::RDMA_CM_EVENT_ROUTE_RESOLVED)?);
    // SAFETY: route resolved: the id has its device context.
    let pd = Pd::new(unsafe { (*id.0).verbs })?;
    let (cq, mr, max_inline) = Endpoint::build(id.0, &pd, q)?;
    let ep = Endpoint {
        id: std::mem::replace(&mut id.0, null_mut()),
        cq,
        mr,
        max_inline,
        _channel: None,
    };
    prepare(&ep)?;
    let mut param = conn_param(hello);
    // SAFETY: the id has its QP; param points at live private data.
    check(unsafe { rdma_connect(ep.id, &mut param) }, "rdma_connect")?;
    let ev = channel.next()?;
    if ev.kind() != rdma_cm_event_type::RDMA_CM_EVENT_ESTABLISHED {
        anyhow::bail!(
            "connect to {server}: {} (status {}){}",
            event_name(ev.kind()),
            ev.status(),
            String::from_utf8(ev.private_data())
                .ok()
                .map(|s| s.trim_end_matches('\0').to_string())
                .filter(|s| !s.is_empty())
                .map(|s| format!(": {s}"))
                .unwrap_or_default()
        );
    }
    let answer = ev.private_data();
    drop(ev);
    let mut ep = ep;
    ep._channel = Some(channel);
    Ok((ep, answer))
}

fn conn_param(private: &[u8]) -> rdma_conn_param {
    rdma_conn_param {
        private_data: private.as_ptr().cast(),
        private_data_len: private.len() as u8,
        // RDMA READs in flight per QP, both ways (the requester's initiator depth is the
        // responder's resources).
        responder_resources: 16,
        initiator_depth: 16,
        flow_control: 1,
        retry_count: 7,
        // infinite RNR retries: a receiver momentarily out of buffers is waited for
        rnr_retry_count: 7,
        srq: 0,
        qp_num: 0,
    }
}

/// A listening id on its own channel.
pub struct Listener {
    id: Id,
    pub channel: EventChannel,
}

impl Listener {
    pub fn bind(addr: SocketAddrV4) -> anyhow::Result<Listener> {
        let channel = EventChannel::new()?;
        let id = create_id(&channel)?;
        let mut sa = sockaddr(addr);
        // SAFETY: a valid sockaddr_in.
        let rc = unsafe { rdma_bind_addr(id.0, (&mut sa as *mut libc::sockaddr_in).cast()) };
        check(rc, &format!("rdma_bind_addr {addr}"))?;
        // SAFETY: bound.
        check(unsafe { rdma_listen(id.0, 0) }, "rdma_listen")?;
        Ok(Listener { id, channel })
    }

    /// The port actually bound (for `--listen IP:0`).
    pub fn port(&self) -> u16 {
        // SAFETY: bound.
        u16::from_be(unsafe { rdma_get_src_port(self.id.0) })
    }
}

/// Accepts the connection request `id` with `welcome` as private data, after `prepare`
/// (posting receives, so the client's first request finds one).
pub fn accept(
    id: *mut rdma_cm_id,
    pd: &Arc<Pd>,
    q: QueueSizes,
    welcome: &[u8],
    prepare: impl FnOnce(&Endpoint) -> anyhow::Result<()>,
) -> anyhow::Result<Endpoint> {
    let (cq, mr, max_inline) = match Endpoint::build(id, pd, q) {
        Ok(x) => x,
        Err(e) => {
            reject(id, &e.to_string());
            return Err(e);
        }
    };
    let ep = Endpoint {
        id,
        cq,
        mr,
        max_inline,
        _channel: None,
    };
    prepare(&ep)?;
    let mut param = conn_param(welcome);
    // SAFETY: the id has its QP; param points at live private data.
    check(unsafe { rdma_accept(ep.id, &mut param) }, "rdma_accept")?;
    Ok(ep)
}

/// Refuses a connection request, saying why in the private data, and destroys its id.
pub fn reject(id: *mut rdma_cm_id, why: &str) {
    let b = why.as_bytes();
    let n = b.len().min(140);
    // SAFETY: a requested id; the reason is at most the REJ's private data size.
    unsafe {
        rdma_reject(id, b.as_ptr().cast(), n as u8);
        rdma_destroy_id(id);
    }
}

/// The device context of a connection request.
pub fn context_of(id: *mut rdma_cm_id) -> *mut ibv_context {
    // SAFETY: a requested id has its device.
    unsafe { (*id).verbs }
}
