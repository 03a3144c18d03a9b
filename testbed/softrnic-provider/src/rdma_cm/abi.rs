//! The kernel's RDMA CM command ABI (`<rdma/rdma_user_cm.h>`, ABI version 4) as librdmacm 44
//! writes it to `/dev/infiniband/rdma_cm`, and the verbs structures it answers with
//! (`<rdma/ib_user_verbs.h>`, `<rdma/ib_user_sa.h>`). Layouts are checked against the installed
//! headers by `layout_matches_kernel_headers`.

pub const ABI_VERSION: u32 = softrnic_abi::device::RDMA_CM_ABI_VERSION;

pub const CMD_CREATE_ID: u32 = 0;
pub const CMD_DESTROY_ID: u32 = 1;
pub const CMD_BIND_IP: u32 = 2;
pub const CMD_RESOLVE_IP: u32 = 3;
pub const CMD_RESOLVE_ROUTE: u32 = 4;
pub const CMD_QUERY_ROUTE: u32 = 5;
pub const CMD_CONNECT: u32 = 6;
pub const CMD_LISTEN: u32 = 7;
pub const CMD_ACCEPT: u32 = 8;
pub const CMD_REJECT: u32 = 9;
pub const CMD_DISCONNECT: u32 = 10;
pub const CMD_INIT_QP_ATTR: u32 = 11;
pub const CMD_GET_EVENT: u32 = 12;
pub const CMD_GET_OPTION: u32 = 13;
pub const CMD_SET_OPTION: u32 = 14;
pub const CMD_NOTIFY: u32 = 15;
pub const CMD_JOIN_IP_MCAST: u32 = 16;
pub const CMD_LEAVE_MCAST: u32 = 17;
pub const CMD_MIGRATE_ID: u32 = 18;
pub const CMD_QUERY: u32 = 19;
pub const CMD_BIND: u32 = 20;
pub const CMD_RESOLVE_ADDR: u32 = 21;
pub const CMD_JOIN_MCAST: u32 = 22;

pub const PS_IPOIB: u16 = 0x0002;
pub const PS_TCP: u16 = 0x0106;
pub const PS_UDP: u16 = 0x0111;
pub const PS_IB: u16 = 0x013F;

/// The Q_Key the kernel gives UD QPs of the UDP port space (`RDMA_UDP_QKEY`).
pub const UDP_QKEY: u32 = 0x0123_4567;

/// `enum rdma_cm_event_type`.
pub mod event {
    pub const ADDR_RESOLVED: u32 = 0;
    pub const ADDR_ERROR: u32 = 1;
    pub const ROUTE_RESOLVED: u32 = 2;
    pub const ROUTE_ERROR: u32 = 3;
    pub const CONNECT_REQUEST: u32 = 4;
    pub const CONNECT_RESPONSE: u32 = 5;
    pub const CONNECT_ERROR: u32 = 6;
    pub const UNREACHABLE: u32 = 7;
    pub const REJECTED: u32 = 8;
    pub const ESTABLISHED: u32 = 9;
    pub const DISCONNECTED: u32 = 10;
    pub const MULTICAST_JOIN: u32 = 12;
}

/// `rdma_set_option` levels and names.
pub const OPTION_ID: u32 = 0;
pub const OPTION_IB: u32 = 1;
pub const OPTION_ID_TOS: u32 = 0;
pub const OPTION_ID_REUSEADDR: u32 = 1;
pub const OPTION_ID_AFONLY: u32 = 2;
pub const OPTION_ID_ACK_TIMEOUT: u32 = 3;
pub const OPTION_IB_PATH: u32 = 1;

pub const MAX_PRIVATE_DATA: usize = 256;

/// A `struct sockaddr_in6` (28 bytes) or `struct __kernel_sockaddr_storage` (128 bytes) as
/// raw bytes: the family decides what is in it.
pub type SockaddrIn6 = [u8; 28];
pub type SockaddrStorage = [u8; 128];

#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct CmdHdr {
    pub cmd: u32,
    pub in_: u16,
    pub out: u16,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct CreateId {
    pub uid: u64,
    pub response: u64,
    pub ps: u16,
    pub qp_type: u8,
    pub reserved: [u8; 5],
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct CreateIdResp {
    pub id: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct DestroyId {
    pub response: u64,
    pub id: u32,
    pub reserved: u32,
}

/// The answer to DESTROY_ID, MIGRATE_ID and LEAVE_MCAST.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct EventsReportedResp {
    pub events_reported: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct BindIp {
    pub response: u64,
    pub addr: SockaddrIn6,
    pub id: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct Bind {
    pub id: u32,
    pub addr_size: u16,
    pub reserved: u16,
    pub addr: SockaddrStorage,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ResolveIp {
    pub src_addr: SockaddrIn6,
    pub dst_addr: SockaddrIn6,
    pub id: u32,
    pub timeout_ms: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ResolveAddr {
    pub id: u32,
    pub timeout_ms: u32,
    pub src_size: u16,
    pub dst_size: u16,
    pub reserved: u32,
    pub src_addr: SockaddrStorage,
    pub dst_addr: SockaddrStorage,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ResolveRoute {
    pub id: u32,
    pub timeout_ms: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct Query {
    pub response: u64,
    pub id: u32,
    pub option: u32,
}

/// `struct ib_user_path_rec`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct UserPathRec {
    pub dgid: [u8; 16],
    pub sgid: [u8; 16],
    pub dlid: u16,
    pub slid: u16,
    pub raw_traffic: u32,
    pub flow_label: u32,
    pub reversible: u32,
    pub mtu: u32,
    pub pkey: u16,
    pub hop_limit: u8,
    pub traffic_class: u8,
    pub numb_path: u8,
    pub sl: u8,
    pub mtu_selector: u8,
    pub rate_selector: u8,
    pub rate: u8,
    pub packet_life_time_selector: u8,
    pub packet_life_time: u8,
    pub preference: u8,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct QueryRouteResp {
    pub node_guid: u64,
    pub ib_route: [UserPathRec; 2],
    pub src_addr: SockaddrIn6,
    pub dst_addr: SockaddrIn6,
    pub num_paths: u32,
    pub port_num: u8,
    pub reserved: [u8; 3],
    pub ibdev_index: u32,
    pub reserved1: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct ConnParam {
    pub qp_num: u32,
    pub qkey: u32,
    pub private_data: [u8; MAX_PRIVATE_DATA],
    pub private_data_len: u8,
    pub srq: u8,
    pub responder_resources: u8,
    pub initiator_depth: u8,
    pub flow_control: u8,
    pub retry_count: u8,
    pub rnr_retry_count: u8,
    pub valid: u8,
}

/// `struct ib_uverbs_global_route`.
#[repr(C)]
#[derive(Clone, Copy, Default, Debug, PartialEq, Eq)]
pub struct UverbsGlobalRoute {
    pub dgid: [u8; 16],
    pub flow_label: u32,
    pub sgid_index: u8,
    pub hop_limit: u8,
    pub traffic_class: u8,
    pub reserved: u8,
}

/// `struct ib_uverbs_ah_attr`.
#[repr(C)]
#[derive(Clone, Copy, Default, Debug, PartialEq, Eq)]
pub struct UverbsAhAttr {
    pub grh: UverbsGlobalRoute,
    pub dlid: u16,
    pub sl: u8,
    pub src_path_bits: u8,
    pub static_rate: u8,
    pub is_global: u8,
    pub port_num: u8,
    pub reserved: u8,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct UdParam {
    pub qp_num: u32,
    pub qkey: u32,
    pub ah_attr: UverbsAhAttr,
    pub private_data: [u8; MAX_PRIVATE_DATA],
    pub private_data_len: u8,
    pub reserved: [u8; 7],
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct Ece {
    pub vendor_id: u32,
    pub attr_mod: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct Connect {
    pub conn_param: ConnParam,
    pub id: u32,
    pub reserved: u32,
    pub ece: Ece,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct Listen {
    pub id: u32,
    pub backlog: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct Accept {
    pub uid: u64,
    pub conn_param: ConnParam,
    pub id: u32,
    pub reserved: u32,
    pub ece: Ece,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct Reject {
    pub id: u32,
    pub private_data_len: u8,
    pub reason: u8,
    pub reserved: [u8; 2],
    pub private_data: [u8; MAX_PRIVATE_DATA],
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct IdOnly {
    pub id: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct InitQpAttr {
    pub response: u64,
    pub id: u32,
    pub qp_state: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct Notify {
    pub id: u32,
    pub event: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct JoinIpMcast {
    pub response: u64,
    pub uid: u64,
    pub addr: SockaddrIn6,
    pub id: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct JoinMcast {
    pub response: u64,
    pub uid: u64,
    pub id: u32,
    pub addr_size: u16,
    pub join_flags: u16,
    pub addr: SockaddrStorage,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct GetEvent {
    pub response: u64,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub union EventParam {
    pub conn: ConnParam,
    pub ud: UdParam,
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct EventResp {
    pub uid: u64,
    pub id: u32,
    pub event: u32,
    pub status: u32,
    pub param: EventParam,
    pub reserved: u32,
    pub ece: Ece,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct SetOption {
    pub optval: u64,
    pub id: u32,
    pub level: u32,
    pub optname: u32,
    pub optlen: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct MigrateId {
    pub response: u64,
    pub id: u32,
    pub fd: u32,
}

/// `struct ib_uverbs_qp_cap`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct UverbsQpCap {
    pub max_send_wr: u32,
    pub max_recv_wr: u32,
    pub max_send_sge: u32,
    pub max_recv_sge: u32,
    pub max_inline_data: u32,
}

/// `struct ib_uverbs_qp_attr`: INIT_QP_ATTR's answer, which librdmacm hands to
/// `ibv_modify_qp`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct UverbsQpAttr {
    pub qp_attr_mask: u32,
    pub qp_state: u32,
    pub cur_qp_state: u32,
    pub path_mtu: u32,
    pub path_mig_state: u32,
    pub qkey: u32,
    pub rq_psn: u32,
    pub sq_psn: u32,
    pub dest_qp_num: u32,
    pub qp_access_flags: u32,
    pub ah_attr: UverbsAhAttr,
    pub alt_ah_attr: UverbsAhAttr,
    pub cap: UverbsQpCap,
    pub pkey_index: u16,
    pub alt_pkey_index: u16,
    pub en_sqd_async_notify: u8,
    pub sq_draining: u8,
    pub max_rd_atomic: u8,
    pub max_dest_rd_atomic: u8,
    pub min_rnr_timer: u8,
    pub port_num: u8,
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
    pub alt_port_num: u8,
    pub alt_timeout: u8,
    pub reserved: [u8; 5],
}

/// A plain-data command or answer structure: any bit pattern is a valid value, so it may be
/// filled from or written out as bytes.
///
/// # Safety
/// Implementors are `repr(C)` structures of integers and byte arrays only.
pub unsafe trait Pod: Copy + 'static {
    fn zeroed() -> Self {
        // SAFETY: all-zero bytes are a valid value of a Pod type.
        unsafe { std::mem::zeroed() }
    }

    /// The value from the start of `bytes`, zero-filled where `bytes` is shorter (the kernel
    /// accepts commands of older, shorter layouts the same way).
    fn from_prefix(bytes: &[u8]) -> Self {
        let mut v = Self::zeroed();
        let n = bytes.len().min(size_of::<Self>());
        // SAFETY: n bytes fit in v and in bytes; any bytes are a valid Pod.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), &mut v as *mut Self as *mut u8, n) };
        v
    }

    fn as_bytes(&self) -> &[u8] {
        // SAFETY: a Pod value is size_of::<Self>() initialised bytes.
        unsafe { std::slice::from_raw_parts(self as *const Self as *const u8, size_of::<Self>()) }
    }
}

macro_rules! pod {
    ($($t:ty),*) => { $(
        // SAFETY: repr(C) structures of integers and byte arrays.
        unsafe impl Pod for $t {}
    )* };
}
pod!(
    CmdHdr,
    CreateId,
    CreateIdResp,
    DestroyId,
    EventsReportedResp,
    BindIp,
    Bind,
    ResolveIp,
    ResolveAddr,
    ResolveRoute,
    Query,
    QueryRouteResp,
    ConnParam,
    Connect,
    Listen,
    Accept,
    Reject,
    IdOnly,
    InitQpAttr,
    Notify,
    GetEvent,
    EventResp,
    SetOption,
    MigrateId,
    UverbsQpAttr,
    UdParam,
    JoinIpMcast,
    JoinMcast
);

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::offset_of;

    #[test]
    fn layout_matches_kernel_headers() {
        let checks: Vec<(&str, usize)> = vec![
            ("sizeof rdma_ucm_cmd_hdr", size_of::<CmdHdr>()),
            ("sizeof rdma_ucm_create_id", size_of::<CreateId>()),
            ("rdma_ucm_create_id.qp_type", offset_of!(CreateId, qp_type)),
            ("sizeof rdma_ucm_destroy_id", size_of::<DestroyId>()),
            ("sizeof rdma_ucm_bind_ip", size_of::<BindIp>()),
            ("rdma_ucm_bind_ip.id", offset_of!(BindIp, id)),
            ("sizeof rdma_ucm_bind", size_of::<Bind>()),
            ("rdma_ucm_bind.addr", offset_of!(Bind, addr)),
            ("sizeof rdma_ucm_resolve_ip", size_of::<ResolveIp>()),
            ("rdma_ucm_resolve_ip.id", offset_of!(ResolveIp, id)),
            ("sizeof rdma_ucm_resolve_addr", size_of::<ResolveAddr>()),
            (
                "rdma_ucm_resolve_addr.dst_addr",
                offset_of!(ResolveAddr, dst_addr),
            ),
            ("sizeof rdma_ucm_resolve_route", size_of::<ResolveRoute>()),
            ("sizeof rdma_ucm_query", size_of::<Query>()),
            (
                "sizeof rdma_ucm_query_route_resp",
                size_of::<QueryRouteResp>(),
            ),
            (
                "rdma_ucm_query_route_resp.src_addr",
                offset_of!(QueryRouteResp, src_addr),
            ),
            (
                "rdma_ucm_query_route_resp.num_paths",
                offset_of!(QueryRouteResp, num_paths),
            ),
            (
                "rdma_ucm_query_route_resp.ibdev_index",
                offset_of!(QueryRouteResp, ibdev_index),
            ),
            ("sizeof ib_user_path_rec", size_of::<UserPathRec>()),
            ("ib_user_path_rec.pkey", offset_of!(UserPathRec, pkey)),
            (
                "ib_user_path_rec.preference",
                offset_of!(UserPathRec, preference),
            ),
            ("sizeof rdma_ucm_conn_param", size_of::<ConnParam>()),
            (
                "rdma_ucm_conn_param.private_data_len",
                offset_of!(ConnParam, private_data_len),
            ),
            ("rdma_ucm_conn_param.valid", offset_of!(ConnParam, valid)),
            ("sizeof rdma_ucm_ud_param", size_of::<UdParam>()),
            (
                "rdma_ucm_ud_param.private_data",
                offset_of!(UdParam, private_data),
            ),
            ("sizeof ib_uverbs_ah_attr", size_of::<UverbsAhAttr>()),
            (
                "ib_uverbs_ah_attr.is_global",
                offset_of!(UverbsAhAttr, is_global),
            ),
            ("sizeof rdma_ucm_connect", size_of::<Connect>()),
            ("rdma_ucm_connect.id", offset_of!(Connect, id)),
            ("rdma_ucm_connect.ece", offset_of!(Connect, ece)),
            ("sizeof rdma_ucm_listen", size_of::<Listen>()),
            ("sizeof rdma_ucm_accept", size_of::<Accept>()),
            ("rdma_ucm_accept.id", offset_of!(Accept, id)),
            ("sizeof rdma_ucm_reject", size_of::<Reject>()),
            (
                "rdma_ucm_reject.private_data",
                offset_of!(Reject, private_data),
            ),
            ("sizeof rdma_ucm_init_qp_attr", size_of::<InitQpAttr>()),
            ("sizeof rdma_ucm_notify", size_of::<Notify>()),
            ("sizeof rdma_ucm_get_event", size_of::<GetEvent>()),
            ("sizeof rdma_ucm_join_ip_mcast", size_of::<JoinIpMcast>()),
            ("rdma_ucm_join_ip_mcast.id", offset_of!(JoinIpMcast, id)),
            ("sizeof rdma_ucm_join_mcast", size_of::<JoinMcast>()),
            ("rdma_ucm_join_mcast.addr", offset_of!(JoinMcast, addr)),
            ("sizeof rdma_ucm_event_resp", size_of::<EventResp>()),
            ("rdma_ucm_event_resp.status", offset_of!(EventResp, status)),
            ("rdma_ucm_event_resp.param", offset_of!(EventResp, param)),
            ("rdma_ucm_event_resp.ece", offset_of!(EventResp, ece)),
            ("sizeof rdma_ucm_set_option", size_of::<SetOption>()),
            ("sizeof rdma_ucm_migrate_id", size_of::<MigrateId>()),
            ("sizeof ib_uverbs_qp_attr", size_of::<UverbsQpAttr>()),
            (
                "ib_uverbs_qp_attr.ah_attr",
                offset_of!(UverbsQpAttr, ah_attr),
            ),
            (
                "ib_uverbs_qp_attr.pkey_index",
                offset_of!(UverbsQpAttr, pkey_index),
            ),
            (
                "ib_uverbs_qp_attr.max_dest_rd_atomic",
                offset_of!(UverbsQpAttr, max_dest_rd_atomic),
            ),
            (
                "ib_uverbs_qp_attr.alt_timeout",
                offset_of!(UverbsQpAttr, alt_timeout),
            ),
        ];
        drum_test_support::assert_c_layout_with(&["rdma/rdma_user_cm.h"], &checks);
    }
}
