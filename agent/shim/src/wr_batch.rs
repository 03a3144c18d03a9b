//! What a QP's record keeps of its `ibv_wr_*` interface (`wr_api`): the batch being built
//! between `ibv_wr_start` and `ibv_wr_complete`.

use crate::ffi::{IbvSendWr, IbvSge};

/// The `ibv_wr_*` ops of a QP that the shim wraps (`wr_api`'s table of wrappers).
pub const EX_OPS: usize = 21;

/// The `ibv_wr_*` batch a QP is building.
#[derive(Default)]
pub enum Batch {
    #[default]
    Idle,
    /// Nothing was in force at `wr_start`: the calls go to the provider as they come; the
    /// bytes of each request are kept for the counters.
    Passing(Vec<Passed>),
    /// A grant was in force at `wr_start`: the calls are recorded as `ibv_send_wr`s and
    /// `wr_complete` posts them the governed way, as `ibv_post_send` would.
    Recording(Vec<Recorded>),
    /// A recorded batch used an op that no `ibv_send_wr` can express (named).
    Refused(&'static str),
}

/// A request passed on to the provider: its bytes, and whether it is an RDMA READ (whose
/// data comes back).
#[derive(Clone, Copy)]
pub struct Passed {
    pub bytes: u64,
    pub read: bool,
}

/// One recorded request: the WR and the buffers its lists point into once posted.
pub struct Recorded {
    pub wr: IbvSendWr,
    pub sges: Vec<IbvSge>,
    /// Inline data, copied when the application set it (it may reuse its buffer at once).
    pub inline: Option<Vec<u8>>,
}

// SAFETY: the pointers inside are the application's (an AH, an MW), valid until the request
// completes whichever thread posts it, or point into this value's own buffers.
unsafe impl Send for Recorded {}
