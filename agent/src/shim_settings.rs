//! `[shim]` in the agent's configuration: what the shim link is told about the NIC and the
//! operator's pins, their defaults and their validation. Kept apart from the hub (which runs
//! the link) so that a reader of the settings need not read the threads that serve them.

use crate::tenants::TenantSettings;
use crate::ungoverned::UngovernedSettings;
use anyhow::{bail, Result};
use drum_common::wire_cost::WireCost;
use drum_table::layout::Grant;
use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::PathBuf;

/// `[shim]` in the agent's configuration.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ShimSettings {
    /// Where shims register (`DRUM_AGENT_SOCKET` in the applications' environment must
    /// name the same path when it is not the default).
    #[serde(default = "d_socket")]
    pub socket: PathBuf,
    /// The NIC's line rate: grants are fractions of it.
    pub line_rate_gbps: f64,
    /// The path MTU and the header bytes each packet adds on the wire (default: RoCE v2 on
    /// Ethernet, 62 header bytes and a 20-byte preamble and gap): the optimiser's rates are
    /// wire bytes, the shims meter payload (`drum_common::wire_cost`).
    #[serde(default = "d_mtu")]
    pub mtu: u32,
    #[serde(default = "d_packet_overhead")]
    pub packet_overhead_bytes: u32,
    /// The NIC time each WQE takes beyond its packets (fetching it), in ns; 0 by default.
    #[serde(default)]
    pub wqe_cost_ns: u64,
    /// Most QPs per app with work on the NIC at once (top-k gating); 0: no gating.
    #[serde(default)]
    pub max_active_qps: u64,
    /// Most QPs with work on this host's NIC at once, over all its apps (the size of the NIC's
    /// QP-context cache): split among the apps as their QP gates, weighted max-min fair over
    /// the QPs each holds (`drum_common::qp_share`); 0: no host budget.
    #[serde(default)]
    pub qp_budget: u64,
    /// How long a QP keeps its slot while others wait.
    #[serde(default = "d_quantum")]
    pub quantum_us: u64,
    /// Sends at least this long are announced for DASR; 0: no announcements.
    #[serde(default)]
    pub long_msg_bytes: u64,
    /// Rate fraction of an app the optimiser parked (not in the active set): a trickle so
    /// its connections stay alive, not zero.
    #[serde(default = "d_parked")]
    pub parked_rate: f64,
    /// Registered processes at most (each holds a table and a thread).
    #[serde(default = "d_max_shims")]
    pub max_shims: usize,
    /// Operator pins per app, overriding the optimiser.
    #[serde(default)]
    pub apps: BTreeMap<String, AppPin>,
    /// Which app each process is, by the identity the kernel reports (docs/tenants.md).
    #[serde(default)]
    pub tenants: TenantSettings,
    /// Finding the processes that use the NIC without a shim (docs/tenants.md).
    #[serde(default)]
    pub ungoverned: UngovernedSettings,
}

/// What an operator fixes for one app.
#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct AppPin {
    /// Fraction of the line rate, in (0, 1].
    pub rate: Option<f64>,
    pub rate_wqe_per_s: Option<u64>,
    /// Completions per second delivered to the app (its polling rate).
    pub rate_cqe_per_s: Option<u64>,
    pub max_active_qps: Option<u64>,
    /// Incast look-ahead (Dart, docs/design.md §4; off unless set): the app's long messages
    /// announce that they belong to an incast of `members` senders, so a receiver with
    /// `[dasr] lookahead = true` counts them all at the first announcement.
    pub incast: Option<IncastPin>,
}

/// An app's incast group, the same on every sending host.
#[derive(Clone, Copy, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct IncastPin {
    pub group: u64,
    /// Senders in the incast, this host's included (≥ 1).
    pub members: u16,
}

fn d_socket() -> PathBuf {
    PathBuf::from("/run/drum/shim.sock")
}
fn d_mtu() -> u32 {
    4096
}
fn d_packet_overhead() -> u32 {
    82
}
fn d_quantum() -> u64 {
    1000
}
fn d_parked() -> f64 {
    0.01
}
fn d_max_shims() -> usize {
    1024
}

const MAX_LINE_RATE_GBPS: f64 = 1000.0;
/// Headers larger than a small packet: surely a mistake.
const MAX_PACKET_OVERHEAD: u32 = 1024;
const MAX_WQE_COST_NS: u64 = 1_000_000_000;
/// More QP contexts than any NIC caches: surely a mistake.
const MAX_QP_BUDGET: u64 = 1 << 20;
impl ShimSettings {
    pub fn validate(&self) -> Result<()> {
        if !(self.line_rate_gbps.is_finite()
            && self.line_rate_gbps > 0.0
            && self.line_rate_gbps <= MAX_LINE_RATE_GBPS)
        {
            bail!(
                "shim.line_rate_gbps = {} must be in (0, {MAX_LINE_RATE_GBPS}]",
                self.line_rate_gbps
            );
        }
        if !(self.parked_rate.is_finite() && self.parked_rate > 0.0 && self.parked_rate <= 1.0) {
            bail!("shim.parked_rate = {} must be in (0, 1]", self.parked_rate);
        }
        if self.quantum_us == 0 || self.quantum_us > 60_000_000 {
            bail!(
                "shim.quantum_us = {} must be in [1, 60000000]",
                self.quantum_us
            );
        }
        if self.qp_budget > MAX_QP_BUDGET {
            bail!(
                "shim.qp_budget = {} must be at most {MAX_QP_BUDGET} (0: no host budget)",
                self.qp_budget
            );
        }
        if self.max_shims == 0 {
            bail!("shim.max_shims must be at least 1");
        }
        if ![256, 512, 1024, 2048, 4096].contains(&self.mtu) {
            bail!(
                "shim.mtu = {} must be an RDMA path MTU: 256, 512, 1024, 2048 or 4096",
                self.mtu
            );
        }
        if self.wqe_cost_ns > MAX_WQE_COST_NS {
            bail!(
                "shim.wqe_cost_ns = {} must be at most {MAX_WQE_COST_NS} (1 s)",
                self.wqe_cost_ns
            );
        }
        if self.packet_overhead_bytes > MAX_PACKET_OVERHEAD {
            bail!(
                "shim.packet_overhead_bytes = {} must be at most {MAX_PACKET_OVERHEAD}",
                self.packet_overhead_bytes
            );
        }
        self.tenants.validate().map_err(anyhow::Error::msg)?;
        self.ungoverned.validate().map_err(anyhow::Error::msg)?;
        for (app, pin) in &self.apps {
            if !drum_table::message::valid_app(app) {
                bail!("shim.apps.{app:?}: not a valid app name ([A-Za-z0-9._-], ≤ 64)");
            }
            if let Some(r) = pin.rate {
                if !(r.is_finite() && r > 0.0 && r <= 1.0) {
                    bail!(
                        "shim.apps.{app}.rate = {r} must be a fraction of the line rate in (0, 1]"
                    );
                }
            }
            if pin.incast.is_some_and(|i| i.members == 0) {
                bail!("shim.apps.{app}.incast.members must be at least 1");
            }
            let pinned = Grant {
                rate_wqe_per_s: pin.rate_wqe_per_s.unwrap_or(0),
                rate_cqe_per_s: pin.rate_cqe_per_s.unwrap_or(0),
                max_active_qps: pin.max_active_qps.unwrap_or(0),
                ..Grant::default()
            };
            pinned
                .validate()
                .map_err(|e| anyhow::anyhow!("shim.apps.{app}: {e}"))?;
        }
        let probe = Grant {
            max_active_qps: self.max_active_qps,
            quantum_us: self.quantum_us,
            long_msg_bytes: self.long_msg_bytes,
            ..Grant::default()
        };
        probe
            .validate()
            .map_err(|e| anyhow::anyhow!("shim settings: {e}"))?;
        Ok(())
    }

    pub(crate) fn line_rate_bytes(&self) -> f64 {
        self.line_rate_gbps * 1e9 / 8.0
    }

    pub fn wire_cost(&self) -> WireCost {
        WireCost::new(
            self.mtu,
            self.packet_overhead_bytes,
            self.wqe_cost_ns as f64,
            self.line_rate_bytes(),
        )
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::path::Path;

    /// Settings a test's hub can run with: its socket in `dir`, an app pinned.
    pub(crate) fn settings(dir: &Path) -> ShimSettings {
        ShimSettings {
            socket: dir.join("shim.sock"),
            line_rate_gbps: 8.0,
            mtu: 4096,
            packet_overhead_bytes: 0,
            wqe_cost_ns: 0,
            max_active_qps: 0,
            qp_budget: 0,
            quantum_us: 1000,
            long_msg_bytes: 0,
            parked_rate: 0.01,
            max_shims: 2,
            tenants: TenantSettings::default(),
            ungoverned: UngovernedSettings::default(),
            apps: BTreeMap::from([(
                "pinned".to_string(),
                AppPin {
                    rate: Some(0.25),
                    rate_cqe_per_s: Some(1500),
                    ..AppPin::default()
                },
            )]),
        }
    }

    #[test]
    fn pins_out_of_range_are_refused_with_the_field() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = settings(dir.path());
        s.validate().unwrap();
        s.apps.get_mut("pinned").unwrap().rate_cqe_per_s = Some(u64::MAX);
        let e = s.validate().unwrap_err().to_string();
        assert!(
            e.contains("shim.apps.pinned") && e.contains("rate_cqe_per_s"),
            "{e}"
        );
    }
}
