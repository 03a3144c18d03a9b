//! What a payload byte costs on the wire. The optimiser's rates are fractions of a link, and
//! a link carries packets: every packet adds its headers (RoCE v2: Ethernet, IPv4, UDP, BTH,
//! ICRC, FCS, and on Ethernet the preamble and inter-frame gap). For 64 KiB messages that is
//! a few per cent; for 64 B messages it is more than the payload. Counting payload alone, an
//! app of small messages was granted half the bytes it put on the link, the link was
//! overbooked, and the NIC's queue behind it never emptied (the testbed's isolation scenario,
//! docs/live-problem.md "Rates on the wire").
//!
//! A NIC also spends time on each work request beyond its packets: fetching it (the DRUM
//! paper's Fig. 2a; softrnic's model charges the fetch on the same clock as the wire). That
//! time, counted as the bytes the line would carry meanwhile, is part of a WQE's cost too, so
//! an app of small messages is charged the NIC time it takes, not just its bytes.
//!
//! So the live problem's rates, demands and budgets are in wire bytes (NIC time at line
//! rate), and the agent turns them into the payload byte rates the shims meter with each
//! app's mean WQE size.

/// A NIC's costs beyond payload: its MTU, the header bytes each packet adds on the wire,
/// and the time each WQE takes beyond its packets as bytes at line rate.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct WireCost {
    pub mtu: u32,
    pub overhead_bytes: u32,
    pub wqe_bytes: f64,
}

impl WireCost {
    /// No per-packet cost: payload bytes are wire bytes.
    pub const PAYLOAD: WireCost = WireCost {
        mtu: u32::MAX,
        overhead_bytes: 0,
        wqe_bytes: 0.0,
    };

    /// The costs of a NIC of `line_bytes_per_s` that spends `wqe_ns` on each WQE.
    pub fn new(mtu: u32, overhead_bytes: u32, wqe_ns: f64, line_bytes_per_s: f64) -> WireCost {
        let wqe_bytes = wqe_ns * 1e-9 * line_bytes_per_s;
        WireCost {
            mtu,
            overhead_bytes,
            wqe_bytes: if wqe_bytes.is_finite() && wqe_bytes > 0.0 {
                wqe_bytes
            } else {
                0.0
            },
        }
    }

    /// The packets a WQE of `bytes_per_wqe` bytes takes: at least one.
    pub fn packets(&self, bytes_per_wqe: f64) -> f64 {
        (bytes_per_wqe / self.mtu as f64).ceil().max(1.0)
    }

    /// Wire bytes per payload byte for WQEs of `bytes_per_wqe` bytes on average; 1 while the
    /// size is unknown. A mean size counts its packets as one message of that size would:
    /// exact for an app of one size, short by less than a packet per WQE for a mix.
    pub fn factor(&self, bytes_per_wqe: Option<f64>) -> f64 {
        match bytes_per_wqe.filter(|b| b.is_finite() && *b >= 1.0) {
            Some(b) if self.mtu > 0 => {
                (b + self.packets(b) * self.overhead_bytes as f64 + self.wqe_bytes) / b
            }
            _ => 1.0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_messages_cost_their_headers_and_large_ones_a_few_per_cent() {
        let softrnic = WireCost::new(1024, 90, 0.0, 25e6);
        assert_eq!(softrnic.factor(Some(64.0)), (64.0 + 90.0) / 64.0);
        assert_eq!(softrnic.factor(Some(1024.0)), (1024.0 + 90.0) / 1024.0);
        assert_eq!(softrnic.factor(Some(1025.0)), (1025.0 + 180.0) / 1025.0);
        let big = softrnic.factor(Some(65536.0));
        assert!((big - (1.0 + 90.0 / 1024.0)).abs() < 1e-12, "{big}");
    }

    #[test]
    fn unknown_sizes_and_no_overhead_cost_nothing_extra() {
        let c = WireCost::new(4096, 82, 50.0, 5e9);
        for b in [None, Some(0.0), Some(f64::NAN), Some(f64::INFINITY)] {
            assert_eq!(c.factor(b), 1.0);
        }
        assert_eq!(WireCost::PAYLOAD.factor(Some(32.0)), 1.0);
        assert_eq!(
            WireCost::new(4096, 0, f64::NAN, 5e9).factor(Some(32.0)),
            1.0
        );
    }

    #[test]
    fn a_wqe_costs_the_bytes_the_line_carries_while_the_nic_fetches_it() {
        // The testbed's dilated NIC: 10 µs a fetch at 25 MB/s is 250 bytes of line time.
        let c = WireCost::new(1024, 90, 10_000.0, 25e6);
        assert!((c.wqe_bytes - 250.0).abs() < 1e-9);
        assert!((c.factor(Some(64.0)) - (64.0 + 90.0 + 250.0) / 64.0).abs() < 1e-12);
    }
}
