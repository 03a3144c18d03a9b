//! The verbs protocol between the provider (inside the application) and its host's NIC engine.
//!
//! Transport: a Unix stream socket per opened device context; every message is a frame
//! `u32 length (LE) | body`. A request body is `u32 opcode | fields`, a response body is
//! `i32 errno (0 = ok) | fields`. All integers are little endian.

use std::io::{self, Read, Write};

use thiserror::Error;

use drum_verbs_abi::consts::*;
use drum_verbs_abi::IbvWc;

mod resp;

pub use resp::Resp;

/// Largest frame either side accepts (inline data is bounded far below this).
pub const MAX_FRAME: usize = 1 << 20;
/// Largest flow-steering attribute (`ibv_flow_attr` with its specs, as bytes) a
/// `Req::CreateFlow` carries.
pub const MAX_FLOW_ATTR_BYTES: usize = 1024;

#[derive(Debug, Error)]
pub enum WireError {
    #[error("message truncated")]
    Truncated,
    #[error("unknown opcode {0}")]
    Opcode(u32),
    #[error("frame too large: {0} bytes")]
    TooLarge(usize),
    #[error("io: {0}")]
    Io(#[from] io::Error),
}

pub fn write_frame(w: &mut impl Write, body: &[u8]) -> io::Result<()> {
    let mut buf = Vec::with_capacity(body.len() + 4);
    buf.extend_from_slice(&(body.len() as u32).to_le_bytes());
    buf.extend_from_slice(body);
    w.write_all(&buf)
}

pub fn read_frame(r: &mut impl Read) -> Result<Vec<u8>, WireError> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_FRAME {
        return Err(WireError::TooLarge(len));
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body)?;
    Ok(body)
}

#[derive(Default)]
pub struct Enc(pub Vec<u8>);

impl Enc {
    pub fn u8(&mut self, v: u8) -> &mut Self {
        self.0.push(v);
        self
    }
    pub fn u32(&mut self, v: u32) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn i32(&mut self, v: i32) -> &mut Self {
        self.u32(v as u32)
    }
    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn bytes(&mut self, v: &[u8]) -> &mut Self {
        self.u32(v.len() as u32);
        self.0.extend_from_slice(v);
        self
    }
}

pub struct Dec<'a>(pub &'a [u8]);

impl<'a> Dec<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], WireError> {
        if self.0.len() < n {
            return Err(WireError::Truncated);
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    pub fn u8(&mut self) -> Result<u8, WireError> {
        Ok(self.take(1)?[0])
    }
    pub fn u32(&mut self) -> Result<u32, WireError> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().unwrap()))
    }
    pub fn i32(&mut self) -> Result<i32, WireError> {
        Ok(self.u32()? as i32)
    }
    pub fn u64(&mut self) -> Result<u64, WireError> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().unwrap()))
    }
    pub fn bytes(&mut self) -> Result<&'a [u8], WireError> {
        let n = self.u32()? as usize;
        self.take(n)
    }
}

/// QP capabilities as negotiated by create_qp.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Caps {
    pub max_send_wr: u32,
    pub max_recv_wr: u32,
    pub max_send_sge: u32,
    pub max_recv_sge: u32,
    pub max_inline_data: u32,
}

impl Caps {
    fn enc(&self, e: &mut Enc) {
        e.u32(self.max_send_wr)
            .u32(self.max_recv_wr)
            .u32(self.max_send_sge)
            .u32(self.max_recv_sge)
            .u32(self.max_inline_data);
    }
    fn dec(d: &mut Dec) -> Result<Self, WireError> {
        Ok(Caps {
            max_send_wr: d.u32()?,
            max_recv_wr: d.u32()?,
            max_send_sge: d.u32()?,
            max_recv_sge: d.u32()?,
            max_inline_data: d.u32()?,
        })
    }
}

/// The subset of `ibv_qp_attr` the engine implements.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct QpAttrs {
    pub qp_state: i32,
    pub cur_qp_state: i32,
    pub path_mtu: i32,
    pub qkey: u32,
    pub rq_psn: u32,
    pub sq_psn: u32,
    pub dest_qp_num: u32,
    pub access_flags: u32,
    pub pkey_index: u16,
    pub port_num: u8,
    pub max_rd_atomic: u8,
    pub max_dest_rd_atomic: u8,
    pub min_rnr_timer: u8,
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
    pub dgid: [u8; 16],
    pub sgid_index: u8,
    pub hop_limit: u8,
    pub is_global: u8,
    pub dlid: u16,
    pub sl: u8,
    pub ah_port_num: u8,
    /// Packet pacing (`IBV_QP_RATE_LIMIT`), kb/s; 0: none.
    pub rate_limit: u32,
}

impl QpAttrs {
    fn enc(&self, e: &mut Enc) {
        e.i32(self.qp_state)
            .i32(self.cur_qp_state)
            .i32(self.path_mtu)
            .u32(self.qkey)
            .u32(self.rq_psn)
            .u32(self.sq_psn)
            .u32(self.dest_qp_num)
            .u32(self.access_flags)
            .u32(self.pkey_index as u32)
            .u8(self.port_num)
            .u8(self.max_rd_atomic)
            .u8(self.max_dest_rd_atomic)
            .u8(self.min_rnr_timer)
            .u8(self.timeout)
            .u8(self.retry_cnt)
            .u8(self.rnr_retry);
        e.0.extend_from_slice(&self.dgid);
        e.u8(self.sgid_index)
            .u8(self.hop_limit)
            .u8(self.is_global)
            .u32(self.dlid as u32)
            .u8(self.sl)
            .u8(self.ah_port_num)
            .u32(self.rate_limit);
    }
    fn dec(d: &mut Dec) -> Result<Self, WireError> {
        let mut a = QpAttrs {
            qp_state: d.i32()?,
            cur_qp_state: d.i32()?,
            path_mtu: d.i32()?,
            qkey: d.u32()?,
            rq_psn: d.u32()?,
            sq_psn: d.u32()?,
            dest_qp_num: d.u32()?,
            access_flags: d.u32()?,
            pkey_index: d.u32()? as u16,
            port_num: d.u8()?,
            max_rd_atomic: d.u8()?,
            max_dest_rd_atomic: d.u8()?,
            min_rnr_timer: d.u8()?,
            timeout: d.u8()?,
            retry_cnt: d.u8()?,
            rnr_retry: d.u8()?,
            ..Default::default()
        };
        a.dgid.copy_from_slice(d.take(16)?);
        a.sgid_index = d.u8()?;
        a.hop_limit = d.u8()?;
        a.is_global = d.u8()?;
        a.dlid = d.u32()? as u16;
        a.sl = d.u8()?;
        a.ah_port_num = d.u8()?;
        a.rate_limit = d.u32()?;
        Ok(a)
    }
}

/// A scatter/gather entry, as the socket protocol carries it and as a ring slot holds it
/// (`repr(C)`: its offsets are the slot's, see `ring::put_sge`).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sge {
    pub addr: u64,
    pub length: u32,
    pub lkey: u32,
}

/// A send work request. On a UD QP the destination travels in the remote fields:
/// `remote_addr` holds the destination's IPv4 address (from the address handle), `rkey` the
/// destination QPN and `compare_add` the Q_Key. A memory-window bind (`IBV_WR_BIND_MW`)
/// carries the window's new rkey in `rkey`, the bound range in `remote_addr` and
/// `compare_add` (length), and the MR's lkey and the window's access flags in `swap`
/// ([`bind_fields`]). `IBV_WR_LOCAL_INV` and `IBV_WR_SEND_WITH_INV` carry the rkey to
/// invalidate in `imm` (the C union of `imm_data` and `invalidate_rkey`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SendWr {
    pub wr_id: u64,
    pub opcode: i32,
    pub flags: u32,
    /// Immediate data, in the byte order the application gave it (network order).
    pub imm: u32,
    pub remote_addr: u64,
    pub rkey: u32,
    /// Atomics: the compare (CMP_AND_SWP) or add (FETCH_AND_ADD) operand, and the swap value.
    pub compare_add: u64,
    pub swap: u64,
    pub sges: Vec<Sge>,
    /// Data copied at post time for `IBV_SEND_INLINE` (then `sges` is empty).
    pub inline: Option<Vec<u8>>,
    /// XRC initiator QPs: the responder's SRQ number (`wr.qp_type.xrc.remote_srqn`).
    pub xrc_srqn: u32,
}

/// The `swap` field of a bind work request: the MR's lkey and the window's access flags.
#[inline]
pub fn bind_fields(mr_lkey: u32, access: u32) -> u64 {
    u64::from(mr_lkey) << 32 | u64::from(access)
}

/// Work requests the NIC executes locally, without a packet: window binds and invalidations.
#[inline]
pub fn is_local_wr(opcode: i32) -> bool {
    matches!(opcode, IBV_WR_BIND_MW | IBV_WR_LOCAL_INV)
}

/// Whether an `ibv_wr_opcode` is one of the two atomics.
#[inline]
pub fn is_atomic_wr(opcode: i32) -> bool {
    matches!(
        opcode,
        IBV_WR_ATOMIC_CMP_AND_SWP | IBV_WR_ATOMIC_FETCH_AND_ADD
    )
}

/// Why a send work request cannot be queued on a QP of `qp_type` (`EINVAL`), checked the same
/// way by the provider (both posting paths) and the engine: an opcode the engine does not
/// execute on that transport,
/// inline data on a READ or an atomic (they write local memory), an atomic whose local buffer
/// is not exactly the 8 bytes of the original value, a window bind or invalidation with local
/// buffers, or a message larger than the port's.
#[inline]
pub fn check_send_wr(qp_type: i32, opcode: i32, inline: bool, len: u64) -> Result<(), i32> {
    let send = matches!(opcode, IBV_WR_SEND | IBV_WR_SEND_WITH_IMM);
    let write = matches!(opcode, IBV_WR_RDMA_WRITE | IBV_WR_RDMA_WRITE_WITH_IMM);
    let read_atomic = opcode == IBV_WR_RDMA_READ || is_atomic_wr(opcode);
    let local = is_local_wr(opcode);
    // RC: everything; XRC: the remote operations; UC: SEND, WRITE and windows (no
    // responses); UD: SEND only.
    let supported = match qp_type {
        IBV_QPT_RC => send || write || read_atomic || local || opcode == IBV_WR_SEND_WITH_INV,
        IBV_QPT_XRC_SEND => send || write || read_atomic,
        IBV_QPT_UC => send || write || local,
        IBV_QPT_UD => send,
        // A frame is sent as it is: no immediate data, nothing remote.
        IBV_QPT_RAW_PACKET => opcode == IBV_WR_SEND,
        _ => false,
    };
    if !supported
        || (local && (inline || len != 0))
        || (inline && (opcode == IBV_WR_RDMA_READ || is_atomic_wr(opcode)))
        || (is_atomic_wr(opcode) && len != 8)
        || len > crate::device::MAX_MSG_SZ as u64
    {
        return Err(libc::EINVAL);
    }
    Ok(())
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecvWr {
    pub wr_id: u64,
    pub sges: Vec<Sge>,
}

fn enc_sges(e: &mut Enc, s: &[Sge]) {
    e.u32(s.len() as u32);
    for g in s {
        e.u64(g.addr).u32(g.length).u32(g.lkey);
    }
}

fn dec_sges(d: &mut Dec) -> Result<Vec<Sge>, WireError> {
    let n = d.u32()? as usize;
    if n > 1024 {
        return Err(WireError::TooLarge(n));
    }
    (0..n)
        .map(|_| {
            Ok(Sge {
                addr: d.u64()?,
                length: d.u32()?,
                lkey: d.u32()?,
            })
        })
        .collect()
}

fn dec_recv_wrs(d: &mut Dec) -> Result<Vec<RecvWr>, WireError> {
    let n = d.u32()? as usize;
    let mut wrs = Vec::with_capacity(n.min(1024));
    for _ in 0..n {
        wrs.push(RecvWr {
            wr_id: d.u64()?,
            sges: dec_sges(d)?,
        });
    }
    Ok(wrs)
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Req {
    AllocPd,
    DeallocPd {
        pd: u32,
    },
    RegMr {
        pd: u32,
        addr: u64,
        len: u64,
        access: u32,
    },
    /// An MR whose work requests and remote peers name it by `iova` rather than by its
    /// address in the process (`ibv_reg_mr_iova`, zero-based MRs, device memory).
    RegMrIova {
        pd: u32,
        addr: u64,
        len: u64,
        iova: u64,
        access: u32,
    },
    DeregMr {
        lkey: u32,
    },
    /// `channel`: a completion channel of this connection (0: none); `user`: the application's
    /// `struct ibv_cq *`, which completion events carry.
    CreateCq {
        cqe: u32,
        channel: u32,
        user: u64,
    },
    DestroyCq {
        cq: u32,
    },
    PollCq {
        cq: u32,
        max: u32,
    },
    /// `srq`: the shared receive queue the QP takes its receives from (0: its own). An XRC
    /// target QP has no PD, CQs or SRQ, but an XRC domain (`xrcd`; 0 for other QPs).
    CreateQp {
        pd: u32,
        send_cq: u32,
        recv_cq: u32,
        srq: u32,
        xrcd: u32,
        qp_type: i32,
        sq_sig_all: bool,
        cap: Caps,
    },
    ModifyQp {
        qpn: u32,
        mask: i32,
        attr: QpAttrs,
    },
    QueryQp {
        qpn: u32,
    },
    DestroyQp {
        qpn: u32,
    },
    PostSend {
        qpn: u32,
        wrs: Vec<SendWr>,
    },
    PostRecv {
        qpn: u32,
        wrs: Vec<RecvWr>,
    },
    /// A completion channel; answered with its id and a secret for [`Req::AttachChannel`].
    CreateChannel,
    /// First and only request on a second connection of the same process: this connection
    /// becomes the channel's event stream (8-byte `cq_handle` records, as the kernel's
    /// `struct ib_uverbs_comp_event_desc`); closing it destroys the channel.
    AttachChannel {
        id: u32,
        token: u64,
    },
    /// Arm a CQ: the next completion added to it sends one event on its channel.
    ReqNotifyCq {
        cq: u32,
        solicited_only: bool,
    },
    /// Share a ring (see [`crate::ring`]): the requesting process's file descriptor `fd` (a
    /// memfd of at least `len` bytes), which the engine opens through `/proc/PID/fd`, becomes
    /// the completion ring of CQ `handle` (`kind` 0) or the work-request rings of QP `handle`
    /// (`kind` 1).
    AttachRing {
        kind: u8,
        handle: u32,
        fd: i32,
        len: u64,
    },
    /// A shared receive queue; answered with [`Resp::Srq`] (the granted sizes; the handle
    /// is also the SRQ number XRC initiators name). An XRC SRQ (`xrcd` not 0) belongs to an
    /// XRC domain and completes on its own CQ `cq`; a basic one (`xrcd`, `cq` 0) completes on
    /// the CQ of the QP that took the receive.
    CreateSrq {
        pd: u32,
        max_wr: u32,
        max_sge: u32,
        xrcd: u32,
        cq: u32,
    },
    /// `mask`: `IBV_SRQ_MAX_WR` (resize) and/or `IBV_SRQ_LIMIT`.
    ModifySrq {
        srq: u32,
        mask: i32,
        max_wr: u32,
        srq_limit: u32,
    },
    QuerySrq {
        srq: u32,
    },
    DestroySrq {
        srq: u32,
    },
    PostSrqRecv {
        srq: u32,
        wrs: Vec<RecvWr>,
    },
    /// The context's asynchronous event stream: answered like [`Req::CreateChannel`], attached
    /// the same way ([`Req::AttachChannel`]); the engine then writes 16-byte
    /// `struct ib_uverbs_async_event_desc` records on it, one at a time (see
    /// softrnic's `events`).
    CreateAsyncChannel,
    /// The application's pointer for an object (`kind` 1: `struct ibv_qp *` of QP `handle`,
    /// 2: `struct ibv_srq *` of SRQ `handle`), which asynchronous events carry.
    UserHandle {
        kind: u8,
        handle: u32,
        user: u64,
    },
    /// The record on the async event stream is gone: read by the application (`taken_back`
    /// false) or taken back from the socket by a destroy of its object.
    AsyncEventRead {
        taken_back: bool,
    },
    /// A memory window of type `mw_type` in PD `pd`; answered with its rkey
    /// ([`Resp::Handle`]), whose upper 24 bits name it for good.
    AllocMw {
        pd: u32,
        mw_type: i32,
    },
    DeallocMw {
        rkey: u32,
    },
    /// Open an XRC domain ([`Resp::Handle`]): a new private one (`file` None), or the one
    /// shared by every process of this host that opens the same file (`file`: its device
    /// and inode), created if missing when `oflags` has `O_CREAT` (refused if present with
    /// `O_EXCL`).
    OpenXrcd {
        file: Option<(u64, u64)>,
        oflags: i32,
    },
    CloseXrcd {
        xrcd: u32,
    },
    /// Another handle of XRC target QP `qpn` of domain `xrcd` (`ibv_open_qp`); answered
    /// like [`Req::CreateQp`].
    OpenQp {
        xrcd: u32,
        qpn: u32,
    },
    /// Attach UD QP `qpn` to multicast group `group` (`ibv_attach_mcast`; the key of
    /// [`crate::device::mcast_group`]).
    AttachMcast {
        qpn: u32,
        group: u64,
    },
    DetachMcast {
        qpn: u32,
        group: u64,
    },
    /// Steer frames matching `attr` (the application's `struct ibv_flow_attr` and its
    /// specs, as bytes; softrnic's `flow`) to raw-packet QP `qpn` ([`Resp::Handle`]).
    CreateFlow {
        qpn: u32,
        attr: Vec<u8>,
    },
    DestroyFlow {
        handle: u32,
    },
    /// Reserve `len` bytes of the host's device memory ([`Resp::Handle`]); the provider
    /// keeps the bytes, the engine the host's capacity.
    AllocDm {
        len: u64,
    },
    FreeDm {
        handle: u32,
    },
    /// `ibv_modify_qp_rate_limit` on a QP in RTS: pace it at `kbps` (0: no pacing) with
    /// bursts of up to `max_burst` bytes.
    RateLimit {
        qpn: u32,
        kbps: u32,
        max_burst: u32,
    },
    /// The secret with which another process may join this connection's context
    /// ([`Req::JoinContext`]); answered with [`Resp::ContextKey`].
    ContextKey,
    /// First request on a connection of a process that forked from the context's owner:
    /// this connection then speaks for context `conn` (its objects, its events) and for
    /// its own process's memory, so that each process has a channel of its own (a kernel
    /// device's commands are system calls, which cannot interleave). Closing it leaves the
    /// context alone.
    JoinContext {
        conn: u64,
        token: u64,
    },
}

impl Req {
    pub fn encode(&self) -> Vec<u8> {
        let mut e = Enc::default();
        match self {
            Req::AllocPd => {
                e.u32(1);
            }
            Req::DeallocPd { pd } => {
                e.u32(2).u32(*pd);
            }
            Req::RegMr {
                pd,
                addr,
                len,
                access,
            } => {
                e.u32(3).u32(*pd).u64(*addr).u64(*len).u32(*access);
            }
            Req::RegMrIova {
                pd,
                addr,
                len,
                iova,
                access,
            } => {
                e.u32(35)
                    .u32(*pd)
                    .u64(*addr)
                    .u64(*len)
                    .u64(*iova)
                    .u32(*access);
            }
            Req::DeregMr { lkey } => {
                e.u32(4).u32(*lkey);
            }
            Req::CreateCq { cqe, channel, user } => {
                e.u32(5).u32(*cqe).u32(*channel).u64(*user);
            }
            Req::DestroyCq { cq } => {
                e.u32(6).u32(*cq);
            }
            Req::PollCq { cq, max } => {
                e.u32(7).u32(*cq).u32(*max);
            }
            Req::CreateQp {
                pd,
                send_cq,
                recv_cq,
                srq,
                xrcd,
                qp_type,
                sq_sig_all,
                cap,
            } => {
                e.u32(8)
                    .u32(*pd)
                    .u32(*send_cq)
                    .u32(*recv_cq)
                    .u32(*srq)
                    .u32(*xrcd)
                    .i32(*qp_type)
                    .u8(*sq_sig_all as u8);
                cap.enc(&mut e);
            }
            Req::ModifyQp { qpn, mask, attr } => {
                e.u32(9).u32(*qpn).i32(*mask);
                attr.enc(&mut e);
            }
            Req::QueryQp { qpn } => {
                e.u32(10).u32(*qpn);
            }
            Req::DestroyQp { qpn } => {
                e.u32(11).u32(*qpn);
            }
            Req::PostSend { qpn, wrs } => {
                e.u32(12).u32(*qpn).u32(wrs.len() as u32);
                for w in wrs {
                    e.u64(w.wr_id)
                        .i32(w.opcode)
                        .u32(w.flags)
                        .u32(w.imm)
                        .u64(w.remote_addr)
                        .u32(w.rkey)
                        .u64(w.compare_add)
                        .u64(w.swap)
                        .u32(w.xrc_srqn);
                    enc_sges(&mut e, &w.sges);
                    match &w.inline {
                        Some(b) => {
                            e.u8(1).bytes(b);
                        }
                        None => {
                            e.u8(0);
                        }
                    }
                }
            }
            Req::PostRecv { qpn, wrs } => {
                e.u32(13).u32(*qpn).u32(wrs.len() as u32);
                for w in wrs {
                    e.u64(w.wr_id);
                    enc_sges(&mut e, &w.sges);
                }
            }
            Req::CreateChannel => {
                e.u32(14);
            }
            Req::AttachChannel { id, token } => {
                e.u32(15).u32(*id).u64(*token);
            }
            Req::ReqNotifyCq { cq, solicited_only } => {
                e.u32(16).u32(*cq).u8(*solicited_only as u8);
            }
            Req::AttachRing {
                kind,
                handle,
                fd,
                len,
            } => {
                e.u32(17).u8(*kind).u32(*handle).i32(*fd).u64(*len);
            }
            Req::CreateSrq {
                pd,
                max_wr,
                max_sge,
                xrcd,
                cq,
            } => {
                e.u32(18)
                    .u32(*pd)
                    .u32(*max_wr)
                    .u32(*max_sge)
                    .u32(*xrcd)
                    .u32(*cq);
            }
            Req::ModifySrq {
                srq,
                mask,
                max_wr,
                srq_limit,
            } => {
                e.u32(19).u32(*srq).i32(*mask).u32(*max_wr).u32(*srq_limit);
            }
            Req::QuerySrq { srq } => {
                e.u32(20).u32(*srq);
            }
            Req::DestroySrq { srq } => {
                e.u32(21).u32(*srq);
            }
            Req::PostSrqRecv { srq, wrs } => {
                e.u32(22).u32(*srq).u32(wrs.len() as u32);
                for w in wrs {
                    e.u64(w.wr_id);
                    enc_sges(&mut e, &w.sges);
                }
            }
            Req::CreateAsyncChannel => {
                e.u32(23);
            }
            Req::UserHandle { kind, handle, user } => {
                e.u32(24).u8(*kind).u32(*handle).u64(*user);
            }
            Req::AsyncEventRead { taken_back } => {
                e.u32(25).u8(*taken_back as u8);
            }
            Req::AllocMw { pd, mw_type } => {
                e.u32(26).u32(*pd).i32(*mw_type);
            }
            Req::DeallocMw { rkey } => {
                e.u32(27).u32(*rkey);
            }
            Req::OpenXrcd { file, oflags } => {
                e.u32(28);
                match file {
                    Some((dev, ino)) => e.u8(1).u64(*dev).u64(*ino),
                    None => e.u8(0),
                }
                .i32(*oflags);
            }
            Req::CloseXrcd { xrcd } => {
                e.u32(29).u32(*xrcd);
            }
            Req::OpenQp { xrcd, qpn } => {
                e.u32(30).u32(*xrcd).u32(*qpn);
            }
            Req::AttachMcast { qpn, group } => {
                e.u32(31).u32(*qpn).u64(*group);
            }
            Req::DetachMcast { qpn, group } => {
                e.u32(32).u32(*qpn).u64(*group);
            }
            Req::CreateFlow { qpn, attr } => {
                e.u32(33).u32(*qpn).bytes(attr);
            }
            Req::DestroyFlow { handle } => {
                e.u32(34).u32(*handle);
            }
            Req::AllocDm { len } => {
                e.u32(36).u64(*len);
            }
            Req::FreeDm { handle } => {
                e.u32(37).u32(*handle);
            }
            Req::RateLimit {
                qpn,
                kbps,
                max_burst,
            } => {
                e.u32(38).u32(*qpn).u32(*kbps).u32(*max_burst);
            }
            Req::ContextKey => {
                e.u32(39);
            }
            Req::JoinContext { conn, token } => {
                e.u32(40).u64(*conn).u64(*token);
            }
        }
        e.0
    }

    pub fn decode(b: &[u8]) -> Result<Self, WireError> {
        let mut d = Dec(b);
        let op = d.u32()?;
        Ok(match op {
            1 => Req::AllocPd,
            2 => Req::DeallocPd { pd: d.u32()? },
            3 => Req::RegMr {
                pd: d.u32()?,
                addr: d.u64()?,
                len: d.u64()?,
                access: d.u32()?,
            },
            4 => Req::DeregMr { lkey: d.u32()? },
            5 => Req::CreateCq {
                cqe: d.u32()?,
                channel: d.u32()?,
                user: d.u64()?,
            },
            6 => Req::DestroyCq { cq: d.u32()? },
            7 => Req::PollCq {
                cq: d.u32()?,
                max: d.u32()?,
            },
            8 => Req::CreateQp {
                pd: d.u32()?,
                send_cq: d.u32()?,
                recv_cq: d.u32()?,
                srq: d.u32()?,
                xrcd: d.u32()?,
                qp_type: d.i32()?,
                sq_sig_all: d.u8()? != 0,
                cap: Caps::dec(&mut d)?,
            },
            9 => Req::ModifyQp {
                qpn: d.u32()?,
                mask: d.i32()?,
                attr: QpAttrs::dec(&mut d)?,
            },
            10 => Req::QueryQp { qpn: d.u32()? },
            11 => Req::DestroyQp { qpn: d.u32()? },
            12 => {
                let qpn = d.u32()?;
                let n = d.u32()? as usize;
                let mut wrs = Vec::with_capacity(n.min(1024));
                for _ in 0..n {
                    let wr_id = d.u64()?;
                    let opcode = d.i32()?;
                    let flags = d.u32()?;
                    let imm = d.u32()?;
                    let remote_addr = d.u64()?;
                    let rkey = d.u32()?;
                    let compare_add = d.u64()?;
                    let swap = d.u64()?;
                    let xrc_srqn = d.u32()?;
                    let sges = dec_sges(&mut d)?;
                    let inline = if d.u8()? != 0 {
                        Some(d.bytes()?.to_vec())
                    } else {
                        None
                    };
                    wrs.push(SendWr {
                        wr_id,
                        opcode,
                        flags,
                        imm,
                        remote_addr,
                        rkey,
                        compare_add,
                        swap,
                        sges,
                        inline,
                        xrc_srqn,
                    });
                }
                Req::PostSend { qpn, wrs }
            }
            13 => {
                let qpn = d.u32()?;
                let wrs = dec_recv_wrs(&mut d)?;
                Req::PostRecv { qpn, wrs }
            }
            14 => Req::CreateChannel,
            15 => Req::AttachChannel {
                id: d.u32()?,
                token: d.u64()?,
            },
            16 => Req::ReqNotifyCq {
                cq: d.u32()?,
                solicited_only: d.u8()? != 0,
            },
            17 => Req::AttachRing {
                kind: d.u8()?,
                handle: d.u32()?,
                fd: d.i32()?,
                len: d.u64()?,
            },
            18 => Req::CreateSrq {
                pd: d.u32()?,
                max_wr: d.u32()?,
                max_sge: d.u32()?,
                xrcd: d.u32()?,
                cq: d.u32()?,
            },
            19 => Req::ModifySrq {
                srq: d.u32()?,
                mask: d.i32()?,
                max_wr: d.u32()?,
                srq_limit: d.u32()?,
            },
            20 => Req::QuerySrq { srq: d.u32()? },
            21 => Req::DestroySrq { srq: d.u32()? },
            22 => {
                let srq = d.u32()?;
                let wrs = dec_recv_wrs(&mut d)?;
                Req::PostSrqRecv { srq, wrs }
            }
            23 => Req::CreateAsyncChannel,
            24 => Req::UserHandle {
                kind: d.u8()?,
                handle: d.u32()?,
                user: d.u64()?,
            },
            25 => Req::AsyncEventRead {
                taken_back: d.u8()? != 0,
            },
            26 => Req::AllocMw {
                pd: d.u32()?,
                mw_type: d.i32()?,
            },
            27 => Req::DeallocMw { rkey: d.u32()? },
            28 => Req::OpenXrcd {
                file: match d.u8()? {
                    0 => None,
                    _ => Some((d.u64()?, d.u64()?)),
                },
                oflags: d.i32()?,
            },
            29 => Req::CloseXrcd { xrcd: d.u32()? },
            30 => Req::OpenQp {
                xrcd: d.u32()?,
                qpn: d.u32()?,
            },
            31 => Req::AttachMcast {
                qpn: d.u32()?,
                group: d.u64()?,
            },
            32 => Req::DetachMcast {
                qpn: d.u32()?,
                group: d.u64()?,
            },
            33 => Req::CreateFlow {
                qpn: d.u32()?,
                attr: d.bytes()?.to_vec(),
            },
            34 => Req::DestroyFlow { handle: d.u32()? },
            35 => Req::RegMrIova {
                pd: d.u32()?,
                addr: d.u64()?,
                len: d.u64()?,
                iova: d.u64()?,
                access: d.u32()?,
            },
            36 => Req::AllocDm { len: d.u64()? },
            37 => Req::FreeDm { handle: d.u32()? },
            38 => Req::RateLimit {
                qpn: d.u32()?,
                kbps: d.u32()?,
                max_burst: d.u32()?,
            },
            39 => Req::ContextKey,
            40 => Req::JoinContext {
                conn: d.u64()?,
                token: d.u64()?,
            },
            o => return Err(WireError::Opcode(o)),
        })
    }
}

#[cfg(test)]
mod tests;
