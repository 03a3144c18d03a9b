//! The paper's client loop, "post a batch of `wr_num` work requests, poll one completion,
//! post again", under a window: how many operations to post now.

/// Operations to post now: the whole batch of `wr_num` (capped by the window) once that
/// many slots are free, none before — a batch is posted whole, as the paper's loop does.
pub fn to_post(outstanding: usize, window: usize, wr_num: usize) -> usize {
    let batch = wr_num.clamp(1, window.max(1));
    if window.saturating_sub(outstanding) >= batch {
        batch
    } else {
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batches_are_posted_whole_within_the_window() {
        assert_eq!(to_post(0, 16, 1), 1);
        assert_eq!(to_post(15, 16, 1), 1);
        assert_eq!(to_post(16, 16, 1), 0);
        assert_eq!(to_post(0, 16, 8), 8);
        assert_eq!(to_post(8, 16, 8), 8);
        assert_eq!(to_post(9, 16, 8), 0);
        // a batch larger than the window is the window
        assert_eq!(to_post(0, 4, 100), 4);
        assert_eq!(to_post(1, 4, 100), 0);
    }
}
