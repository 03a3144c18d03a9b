//! Values of the verbs API's enums and flags that the shim, the provider and the engine use.

pub const IBV_QPS_RESET: i32 = 0;
pub const IBV_QPS_INIT: i32 = 1;
pub const IBV_QPS_RTR: i32 = 2;
pub const IBV_QPS_RTS: i32 = 3;
pub const IBV_QPS_SQD: i32 = 4;
pub const IBV_QPS_SQE: i32 = 5;
pub const IBV_QPS_ERR: i32 = 6;

pub const IBV_QPT_RC: i32 = 2;
pub const IBV_QPT_UC: i32 = 3;
pub const IBV_QPT_UD: i32 = 4;
/// Whole Ethernet frames, steered to it by flow rules (`ibv_create_flow`).
pub const IBV_QPT_RAW_PACKET: i32 = 8;
/// XRC initiator (sends into another host's XRC SRQs) and target (receives into this
/// host's XRC SRQs; no CQ, no queues of its own).
pub const IBV_QPT_XRC_SEND: i32 = 9;
pub const IBV_QPT_XRC_RECV: i32 = 10;
pub const IBV_SRQT_BASIC: i32 = 0;
pub const IBV_SRQT_XRC: i32 = 1;

pub const IBV_QP_STATE: i32 = 1;
pub const IBV_QP_CUR_STATE: i32 = 1 << 1;
pub const IBV_QP_ACCESS_FLAGS: i32 = 1 << 3;
pub const IBV_QP_PKEY_INDEX: i32 = 1 << 4;
pub const IBV_QP_PORT: i32 = 1 << 5;
pub const IBV_QP_QKEY: i32 = 1 << 6;
pub const IBV_QP_AV: i32 = 1 << 7;
pub const IBV_QP_PATH_MTU: i32 = 1 << 8;
pub const IBV_QP_TIMEOUT: i32 = 1 << 9;
pub const IBV_QP_RETRY_CNT: i32 = 1 << 10;
pub const IBV_QP_RNR_RETRY: i32 = 1 << 11;
pub const IBV_QP_RQ_PSN: i32 = 1 << 12;
pub const IBV_QP_MAX_QP_RD_ATOMIC: i32 = 1 << 13;
pub const IBV_QP_MIN_RNR_TIMER: i32 = 1 << 15;
pub const IBV_QP_SQ_PSN: i32 = 1 << 16;
pub const IBV_QP_MAX_DEST_RD_ATOMIC: i32 = 1 << 17;
pub const IBV_QP_CAP: i32 = 1 << 19;
pub const IBV_QP_DEST_QPN: i32 = 1 << 20;
pub const IBV_QP_RATE_LIMIT: i32 = 1 << 25;

pub const IBV_ACCESS_LOCAL_WRITE: u32 = 1;
pub const IBV_ACCESS_REMOTE_WRITE: u32 = 2;
pub const IBV_ACCESS_REMOTE_READ: u32 = 4;
pub const IBV_ACCESS_REMOTE_ATOMIC: u32 = 8;
pub const IBV_ACCESS_MW_BIND: u32 = 16;
pub const IBV_ACCESS_ZERO_BASED: u32 = 32;
/// On-demand paging: the pages need not exist (be pinned) at registration.
pub const IBV_ACCESS_ON_DEMAND: u32 = 64;

pub const IBV_MW_TYPE_1: i32 = 1;
pub const IBV_MW_TYPE_2: i32 = 2;

pub const IBV_WR_RDMA_WRITE: i32 = 0;
pub const IBV_WR_RDMA_WRITE_WITH_IMM: i32 = 1;
pub const IBV_WR_SEND: i32 = 2;
pub const IBV_WR_SEND_WITH_IMM: i32 = 3;
pub const IBV_WR_RDMA_READ: i32 = 4;
pub const IBV_WR_ATOMIC_CMP_AND_SWP: i32 = 5;
pub const IBV_WR_ATOMIC_FETCH_AND_ADD: i32 = 6;
pub const IBV_WR_LOCAL_INV: i32 = 7;
pub const IBV_WR_BIND_MW: i32 = 8;
pub const IBV_WR_SEND_WITH_INV: i32 = 9;

pub const IBV_SEND_SIGNALED: u32 = 2;
pub const IBV_SEND_SOLICITED: u32 = 4;
pub const IBV_SEND_INLINE: u32 = 8;

pub const IBV_WC_SUCCESS: i32 = 0;
pub const IBV_WC_LOC_LEN_ERR: i32 = 1;
pub const IBV_WC_LOC_QP_OP_ERR: i32 = 2;
pub const IBV_WC_LOC_PROT_ERR: i32 = 4;
pub const IBV_WC_WR_FLUSH_ERR: i32 = 5;
pub const IBV_WC_MW_BIND_ERR: i32 = 6;
pub const IBV_WC_REM_INV_REQ_ERR: i32 = 9;
pub const IBV_WC_REM_ACCESS_ERR: i32 = 10;
pub const IBV_WC_REM_OP_ERR: i32 = 11;
pub const IBV_WC_RETRY_EXC_ERR: i32 = 12;
pub const IBV_WC_RNR_RETRY_EXC_ERR: i32 = 13;

pub const IBV_WC_SEND: i32 = 0;
pub const IBV_WC_RDMA_WRITE: i32 = 1;
pub const IBV_WC_RDMA_READ: i32 = 2;
pub const IBV_WC_COMP_SWAP: i32 = 3;
pub const IBV_WC_FETCH_ADD: i32 = 4;
pub const IBV_WC_BIND_MW: i32 = 5;
pub const IBV_WC_LOCAL_INV: i32 = 6;
pub const IBV_WC_RECV: i32 = 128;
pub const IBV_WC_RECV_RDMA_WITH_IMM: i32 = 129;

pub const IBV_WC_GRH: u32 = 1;
pub const IBV_WC_WITH_IMM: u32 = 2;
pub const IBV_WC_WITH_INV: u32 = 8;

// enum ibv_event_type (the asynchronous events softrnic raises).
pub const IBV_EVENT_CQ_ERR: u32 = 0;
pub const IBV_EVENT_QP_FATAL: u32 = 1;
pub const IBV_EVENT_QP_REQ_ERR: u32 = 2;
pub const IBV_EVENT_QP_ACCESS_ERR: u32 = 3;
pub const IBV_EVENT_COMM_EST: u32 = 4;
pub const IBV_EVENT_PORT_ACTIVE: u32 = 9;
pub const IBV_EVENT_PORT_ERR: u32 = 10;
pub const IBV_EVENT_SRQ_LIMIT_REACHED: u32 = 15;
pub const IBV_EVENT_QP_LAST_WQE_REACHED: u32 = 16;

pub const IBV_PORT_DOWN: i32 = 1;
pub const IBV_PORT_ACTIVE: i32 = 4;
pub const IBV_LINK_LAYER_ETHERNET: u8 = 2;
pub const IBV_MTU_4096: i32 = 5;

/// Bytes of an `ibv_mtu` enum value (1 = 256 … 5 = 4096).
pub fn mtu_bytes(mtu: i32) -> Option<u32> {
    match mtu {
        1..=5 => Some(128u32 << mtu),
        _ => None,
    }
}
