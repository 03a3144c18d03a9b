//! How big a run is (`--profile smoke|quick|full`) and the NICs the scenarios emulate.
//!
//! softrnic's engines cannot move packets as fast as a real NIC, so the scenarios run on a
//! **time-dilated** NIC: every rate divided and every per-event cost multiplied by the same
//! factor, large enough that the NIC model, not the emulator's CPU, decides the results. The
//! NIC was calibrated on `fig2a` and `fig2c` only and is frozen (docs/testbed.md); the test
//! cases never tune it.

use clap::ValueEnum;
use serde::{Deserialize, Serialize};

/// The emulated NIC (softrnic's NIC model), in dilated units.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Nic {
    pub name: &'static str,
    pub line_rate_gbps: f64,
    pub mtu: u32,
    pub qp_cache: u32,
    pub qp_miss_ns: u64,
    pub wqe_fetch_ns: u64,
    pub wqe_fetch_batch: u32,
    /// How many times slower than real time the NIC's time runs (real time = dilated ÷ it,
    /// real rates = dilated × it): its timers (a QP's retransmission timeout, DCQCN's) are
    /// stretched by it as its rates are divided.
    pub time_scale: f64,
}

/// The NIC every scenario emulates: 40 Gb/s, a 20-context QP cache (the knee the DRUM paper
/// measured), 0.5 µs per context miss, 50 ns per WQE fetched and up to 128 WQEs of one post
/// fetched in one read, slowed down `dilation` times.
const fn dilated(name: &'static str, dilation: f64) -> Nic {
    Nic {
        name,
        line_rate_gbps: 40.0 / dilation,
        mtu: 1024,
        qp_cache: 20,
        qp_miss_ns: (500.0 * dilation) as u64,
        wqe_fetch_ns: (50.0 * dilation) as u64,
        wqe_fetch_batch: 128,
        time_scale: dilation,
    }
}

/// The frozen profile of the DRUM paper's experiments, dilated 400× (calibrated on fig2a and
/// fig2c; at 200× the emulator's CPU, not the model, decided DRUM's foreground: docs/testbed.md
/// "The NIC profile").
pub const DILATED: Nic = dilated("dilated-400x", 400.0);

/// Dart's experiments keep the factor they were built and measured at: their incast period,
/// jitter and the NIC's END hold are set for it (`scenarios::dart`, `cluster::DART_NIC`).
pub const DART_DILATED: Nic = dilated("dilated-200x", 200.0);

impl Nic {
    /// The NIC time one WQE of `bytes` takes in softrnic's model, in ns: its fetch and its
    /// packets' wire time (each packet with softrnic's header and Ethernet/IPv4/UDP bytes),
    /// all on the one clock of the NIC's pipeline.
    pub fn wqe_time_ns(&self, bytes: u64) -> f64 {
        let packets = bytes.div_ceil(self.mtu as u64).max(1);
        let wire = bytes + packets * crate::configs::SOFTRNIC_PACKET_OVERHEAD as u64;
        self.wqe_fetch_ns as f64 + wire as f64 * 8.0 / self.line_rate_gbps
    }

    /// The options of `softrnic up` that set this NIC.
    pub fn softrnic_args(&self) -> Vec<String> {
        [
            ("--line-rate-gbps", self.line_rate_gbps.to_string()),
            ("--mtu", self.mtu.to_string()),
            ("--qp-cache", self.qp_cache.to_string()),
            ("--qp-miss-ns", self.qp_miss_ns.to_string()),
            ("--wqe-fetch-ns", self.wqe_fetch_ns.to_string()),
            ("--wqe-fetch-batch", self.wqe_fetch_batch.to_string()),
            ("--time-scale", self.time_scale.to_string()),
        ]
        .into_iter()
        .flat_map(|(k, v)| [k.to_string(), v])
        .collect()
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
pub enum Profile {
    /// Every scenario and mode once, tiny: outputs well-formed, no conclusions (CI).
    Smoke,
    /// Every scenario at fewer points and shorter runs (the main demo, ≤ 10 minutes).
    Quick,
    /// The points and lengths the criteria are judged on.
    Full,
}

impl Profile {
    pub fn name(self) -> &'static str {
        match self {
            Profile::Smoke => "smoke",
            Profile::Quick => "quick",
            Profile::Full => "full",
        }
    }

    pub fn default_repeats(self) -> u32 {
        match self {
            Profile::Smoke => 1,
            Profile::Quick => 1,
            Profile::Full => 3,
        }
    }

    /// Scales a measurement's length (iterations, messages) for this profile.
    pub fn length(self, full: u64) -> u64 {
        match self {
            Profile::Smoke => (full / 20).max(20),
            Profile::Quick => (full / 4).max(50),
            Profile::Full => full,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn profiles_scale_the_length_of_a_measurement() {
        assert_eq!(Profile::Smoke.length(1000), 50);
        assert_eq!(Profile::Smoke.length(100), 20);
    }

    #[test]
    fn the_dilated_nics_are_one_40_gbps_nic_slowed_down() {
        for nic in [DILATED, DART_DILATED] {
            assert_eq!(nic.line_rate_gbps * nic.time_scale, 40.0);
            assert_eq!(nic.qp_miss_ns as f64, 500.0 * nic.time_scale);
            assert_eq!(nic.wqe_fetch_ns as f64, 50.0 * nic.time_scale);
        }
        let a = DART_DILATED.softrnic_args();
        assert_eq!(a[0..2], ["--line-rate-gbps", "0.2"]);
        assert_eq!(
            a[6..10],
            ["--qp-miss-ns", "100000", "--wqe-fetch-ns", "10000"]
        );
        assert_eq!(a[12..14], ["--time-scale", "200"]);
        assert_eq!(a.len(), 14);
    }
}
