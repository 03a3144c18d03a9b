//! Packet pacing on the NIC for the shim's byte grant, as pure decisions (the engine thread
//! applies them with `ibv_modify_qp(IBV_QP_RATE_LIMIT)`).
//!
//! The shim meters work requests: a 64 KiB WRITE admitted at the granted rate still leaves
//! the NIC as 64 packets back to back, and a NIC that serves its QPs a packet at a time in
//! turn gives each QP of that burst a slot per round, so another app's small messages wait
//! behind the burst even when the link is far from full. In the testbed, a 64 B `ib_write_bw`
//! kept 0.51 of its alone rate against eight 64 KiB QPs paced to half the line by the shim
//! (docs/shim.md, "Packet pacing on the NIC"). Where the NIC paces QPs (`IBV_QP_RATE_LIMIT`:
//! ConnectX's packet pacing, softrnic), each of the app's QPs that may send at once gets its
//! share of the grant there, and the bursts are spread at the source.

use drum_table::wire_cost::WireCost;

/// Above the QP's share of the grant, so that the NIC's pacing spreads bursts without
/// becoming the app's limit (the shim's own limiter is): uneven load over the app's QPs
/// takes some, and a QP that fell behind must catch up faster than its share. With 1.25, an
/// `ib_write_bw` granted 60 % of the line got 0.69–0.93 of its grant on a machine at load 14
/// (an emulated NIC's transmitter woke late and the QP never caught up); with 2 it is still
/// spread over 8× its line-rate time when eight QPs share half the line.
pub const HEADROOM: f64 = 2.0;

/// Header bytes per packet assumed when turning payload into the NIC's wire rate: more than
/// any RDMA transport adds (RoCE v2 with Ethernet framing 82, softrnic 90), so the NIC's
/// limit errs towards the looser side.
pub const OVERHEAD_BOUND: u32 = 128;

/// A QP's pacing is changed only when its rate moves by more than this fraction: every
/// change is a `modify_qp` (a firmware command on a real NIC).
pub const HYSTERESIS: f64 = 0.1;

/// The rate, in kb/s, each QP is paced at for a grant of `rate_bytes_per_s` of payload spread
/// over `sending` QPs whose WQEs carry `bytes_per_wqe` bytes on average through a path MTU of
/// `mtu` bytes; `None`: unpaced (no grant, no QP, sizes not known yet, or WQEs of one packet,
/// which the shim's limiter already spaces out: a packet per WQE, a doorbell per WQE).
pub fn qp_kbps(
    rate_bytes_per_s: u64,
    sending: usize,
    bytes_per_wqe: Option<f64>,
    mtu: u32,
) -> Option<u32> {
    let b = bytes_per_wqe.filter(|b| b.is_finite() && *b >= 1.0)?;
    if rate_bytes_per_s == 0 || sending == 0 || mtu == 0 {
        return None;
    }
    let wire = wire(mtu);
    if wire.packets(b) < 2.0 {
        return None;
    }
    Some(kbps(
        rate_bytes_per_s as f64 * wire.factor(Some(b)) * HEADROOM / sending as f64,
    ))
}

/// The rate, in kb/s, a QP capped at `cap_bytes_per_s` of payload towards its receiver (a
/// DASR cap) is paced at on the NIC: the cap itself on the wire, with no headroom, so that
/// the NIC — not the shim — spaces the messages and its send queue holds the next one. A
/// receiving NIC that counts active senders from their send queues (softrnic's AUSS) would
/// otherwise see a sender the shim paces leave between two messages. `bytes_per_wqe` unknown
/// counts as 64 KiB.
pub fn cap_kbps(cap_bytes_per_s: u64, bytes_per_wqe: Option<f64>, mtu: u32) -> Option<u32> {
    if cap_bytes_per_s == 0 || mtu == 0 {
        return None;
    }
    let b = bytes_per_wqe
        .filter(|b| b.is_finite() && *b >= 1.0)
        .unwrap_or(65536.0);
    let wire = wire(mtu);
    Some(kbps(cap_bytes_per_s as f64 * wire.factor(Some(b))))
}

/// The NIC's view of a payload rate: packets of `mtu` with [`OVERHEAD_BOUND`] bytes each.
fn wire(mtu: u32) -> WireCost {
    WireCost {
        mtu,
        overhead_bytes: OVERHEAD_BOUND,
        wqe_bytes: 0.0,
    }
}

/// A wire rate in bytes/s as `IBV_QP_RATE_LIMIT`'s kb/s, never 0 (which means unlimited).
fn kbps(wire_bytes_per_s: f64) -> u32 {
    (wire_bytes_per_s * 8.0 / 1000.0).clamp(1.0, u32::MAX as f64) as u32
}

/// Whether a QP paced at `current` (what the shim last asked for) should be moved to
/// `target`.
pub fn worth_changing(current: Option<u32>, target: Option<u32>) -> bool {
    match (current, target) {
        (None, None) => false,
        (Some(c), Some(t)) => (t as f64 - c as f64).abs() > HYSTERESIS * c as f64,
        _ => true,
    }
}

/// How many of a process's QPs may send at once: its connected QPs, at most its QP gate
/// (`k`, 0: none).
pub fn sending_qps(connected: usize, gate: u64) -> usize {
    match gate {
        0 => connected,
        k => connected.min(usize::try_from(k).unwrap_or(usize::MAX)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_grant_is_shared_by_the_qps_that_send_with_headroom_and_headers() {
        // 11 MB/s of 64 KiB WRITEs over 8 QPs, MTU 1024: each QP at 1/8 of it in wire
        // bytes (64 packets of 128 header bytes each), twice that.
        let k = qp_kbps(11_000_000, 8, Some(65536.0), 1024).unwrap();
        let want = 11e6 * (65536.0 + 64.0 * 128.0) / 65536.0 * 2.0 / 8.0 * 8.0 / 1000.0;
        assert!((k as f64 - want).abs() <= 1.0, "{k} vs {want}");
        // Two-packet WQEs: the headers must not make the NIC's limit the app's.
        let small = qp_kbps(5_000_000, 1, Some(1100.0), 1024).unwrap();
        assert!(
            small as f64 > 5e6 * 8.0 / 1000.0 * (1100.0 + 2.0 * 90.0) / 1100.0,
            "paced below its grant on softrnic's wire: {small}"
        );
        // One packet per WQE: the limiter already spaces them.
        assert_eq!(qp_kbps(5_000_000, 1, Some(64.0), 1024), None);
        assert_eq!(qp_kbps(5_000_000, 1, Some(1024.0), 1024), None);
    }

    /// A cap is paced at itself on the wire (no headroom: the NIC, not the shim, must space
    /// the messages), even before the WQE size is known.
    #[test]
    fn a_cap_is_paced_at_its_rate_on_the_wire() {
        let k = cap_kbps(62_500_000, Some(65536.0), 4096).unwrap();
        let on_wire = 62_500_000.0 * 8.0 / 1000.0 * (4096.0 + 128.0) / 4096.0;
        assert!((k as f64 / on_wire - 1.0).abs() < 1e-3, "{k}");
        assert_eq!(cap_kbps(62_500_000, None, 4096), Some(k));
        assert_eq!(cap_kbps(0, Some(65536.0), 4096), None);
        assert_eq!(cap_kbps(62_500_000, Some(65536.0), 0), None);
    }

    #[test]
    fn nothing_is_paced_without_a_grant_a_qp_or_a_known_size() {
        assert_eq!(qp_kbps(0, 8, Some(1024.0), 1024), None);
        assert_eq!(qp_kbps(1_000_000, 0, Some(1024.0), 1024), None);
        assert_eq!(qp_kbps(1_000_000, 1, None, 1024), None);
        assert_eq!(qp_kbps(1_000_000, 1, Some(f64::NAN), 1024), None);
        assert_eq!(qp_kbps(1_000_000, 1, Some(65536.0), 0), None);
        // A tiny grant is still a limit the NIC accepts.
        assert_eq!(qp_kbps(1, 1000, Some(65536.0), 4096), Some(1));
    }

    #[test]
    fn pacing_changes_only_when_it_moves_enough() {
        assert!(!worth_changing(None, None));
        assert!(worth_changing(None, Some(100)));
        assert!(worth_changing(Some(100), None));
        assert!(!worth_changing(Some(100), Some(109)));
        assert!(worth_changing(Some(100), Some(111)));
        assert!(worth_changing(Some(100), Some(89)));
    }

    #[test]
    fn the_gate_bounds_the_qps_that_send() {
        assert_eq!(sending_qps(8, 0), 8);
        assert_eq!(sending_qps(100, 5), 5);
        assert_eq!(sending_qps(3, 5), 3);
    }
}
