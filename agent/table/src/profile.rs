//! What the agent and the shim both read from an app's WQE counters. Both sides must agree
//! on when a mean WQE size is worth using: the agent turns grants into payload rates with it,
//! the shim paces the NIC with it.

/// Fewer WQEs than this in an interval say nothing reliable about an app's pattern.
pub const MIN_PROFILE_WQES: u64 = 256;

/// The mean size of `wqes` send WQEs that carried `bytes`; `None` until there are enough of
/// them to say.
pub fn mean_wqe_bytes(bytes: u64, wqes: u64) -> Option<f64> {
    (wqes >= MIN_PROFILE_WQES).then(|| bytes as f64 / wqes as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mean_size_needs_enough_wqes() {
        assert_eq!(mean_wqe_bytes(0, 0), None);
        assert_eq!(mean_wqe_bytes(64 * 255, MIN_PROFILE_WQES - 1), None);
        assert_eq!(mean_wqe_bytes(64 * 256, MIN_PROFILE_WQES), Some(64.0));
        assert_eq!(mean_wqe_bytes(0, 1000), Some(0.0));
    }
}
