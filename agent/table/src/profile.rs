//! What the agent and the shim both read from an app's WQE counters. Both sides must agree
//! on when a mean WQE size is worth using: the agent turns grants into payload rates with it,
//! the shim paces the NIC with it.

/// Fewer WQEs than this in an interval say nothing reliable about an app's pattern.
pub const MIN_PROFILE_WQES: u64 = 256;
