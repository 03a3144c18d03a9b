//! The agent's configuration file (`drum-agent --config FILE`, TOML): the settings every
//! agent has, the optional keys (shards, shim link, DASR, the live problem's `[nic]`), and
//! the checks that refuse a file whose keys contradict each other.

use crate::{dasr, gids, shim_hub};
use anyhow::{bail, Context, Result};
use drum_common::live::{Gid, LivePolicy, NicParams};
use drum_common::protocol::agent::AgentConfig;
use drum_net::{config, TlsFiles};
use serde::Deserialize;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// `drum-agent --config FILE` (TOML); docs/control-plane.md lists every key.
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct AgentSettings {
    /// This host's id (in the instance, when there is one).
    pub host: String,
    /// Instance file (JSON): the host's apps, weights, demands and budgets and the facility
    /// list shared with the coordinator. None: the live problem (docs/live-problem.md), which
    /// needs `[shim]`.
    #[serde(default)]
    pub instance: Option<PathBuf>,
    /// The coordinator's QUIC address.
    pub coordinator: SocketAddr,
    /// Name the coordinator's certificate must carry.
    #[serde(default = "d_server_name")]
    pub server_name: String,
    pub tls: TlsFiles,
    /// Where to publish rates (rewritten atomically); none: do not publish.
    #[serde(default)]
    pub rate_table: Option<PathBuf>,
    #[serde(default = "d_heartbeat")]
    pub heartbeat_ms: u64,
    #[serde(default = "d_timeout")]
    pub coordinator_timeout_ms: u64,
    #[serde(default = "d_backoff_min")]
    pub backoff_min_ms: u64,
    #[serde(default = "d_backoff_max")]
    pub backoff_max_ms: u64,
    /// TCP address serving `GET /metrics` (Prometheus text); none: no endpoint.
    #[serde(default)]
    pub metrics_listen: Option<SocketAddr>,
}

fn d_server_name() -> String {
    "localhost".into()
}
fn d_heartbeat() -> u64 {
    500
}
fn d_timeout() -> u64 {
    3000
}
fn d_backoff_min() -> u64 {
    100
}
fn d_backoff_max() -> u64 {
    5000
}

/// The keys of the agent config beyond [`AgentSettings`] (a separate struct so that code
/// building an `AgentSettings` literal keeps compiling; same TOML file).
#[derive(Clone, Debug, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct AgentOptions {
    /// With coordinator shards (`serve --shard I/N`): the addresses of shards 1 … N−1, in
    /// order; `coordinator` is shard 0. The agent talks to every shard that owns one of its
    /// facilities. Empty: one coordinator, no shards.
    #[serde(default)]
    pub coordinator_shards: Vec<SocketAddr>,
    /// The host's shims (docs/shim.md): where they register, the line rate that turns the
    /// optimiser's rates into bytes/s, pins. None: no shim link.
    #[serde(default)]
    pub shim: Option<shim_hub::ShimSettings>,
    /// Dart's sender counting with the other hosts' agents (docs/dasr.md); needs `[shim]`.
    #[serde(default)]
    pub dasr: Option<dasr::DasrConfig>,
    /// Which of the host's apps (those of the instance) run: false, all of them; true, those
    /// with at least one shim registered (needs `[shim]`). An app whose first shim registers
    /// arrives, one whose last shim goes leaves, and either asks for a re-selection.
    #[serde(default)]
    pub apps_from_shims: bool,
    /// The live problem: what this host's NIC offers (defaults in [`NicSettings`]).
    #[serde(default)]
    pub nic: Option<NicSettings>,
}

const OPTION_KEYS: &[&str] = &[
    "coordinator_shards",
    "shim",
    "dasr",
    "apps_from_shims",
    "nic",
];

/// `[nic]`: the host's NIC as the live problem sees it (docs/live-problem.md).
#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct NicSettings {
    /// Line rate in Gb/s; default: `[shim] line_rate_gbps`.
    #[serde(default)]
    pub line_rate_gbps: Option<f64>,
    /// `k`: apps active on the NIC at once at most (its QP-context cache's worth).
    #[serde(default = "d_max_active")]
    pub max_active: u32,
    /// `Q`: the WQE budget, as a fraction of line rate.
    #[serde(default = "d_one")]
    pub wqe_budget: f64,
    /// `C`: the completion-polling budget (Σ a·x over the host's apps).
    #[serde(default = "d_poll_budget")]
    pub poll_budget: f64,
    /// This host's GIDs (IPv4 addresses or 32 hex digits): connections to them land on this
    /// host's receive link. Default: the IPv4 addresses of the host's interfaces, as RoCE v2
    /// and softrnic derive GIDs from them.
    #[serde(default)]
    pub gids: Vec<String>,
}

impl Default for NicSettings {
    fn default() -> Self {
        NicSettings {
            line_rate_gbps: None,
            max_active: d_max_active(),
            wqe_budget: d_one(),
            poll_budget: d_poll_budget(),
            gids: Vec::new(),
        }
    }
}

fn d_max_active() -> u32 {
    16
}
fn d_one() -> f64 {
    1.0
}
fn d_poll_budget() -> f64 {
    16.0
}

impl NicSettings {
    /// The NIC parameters and GIDs, checked; `line_rate` is `[shim]`'s.
    pub fn resolve(&self, shim_line_rate: f64) -> Result<(NicParams, Vec<Gid>)> {
        let line = self.line_rate_gbps.unwrap_or(shim_line_rate);
        let sane = |v: f64| v.is_finite() && (1e-6..=1e6).contains(&v);
        if !sane(line) || !sane(self.wqe_budget) || !sane(self.poll_budget) {
            bail!(
                "[nic] line_rate_gbps ({line}), wqe_budget ({}) and poll_budget ({}) must be finite numbers in [1e-6, 1e6]",
                self.wqe_budget,
                self.poll_budget
            );
        }
        if self.max_active == 0 || self.max_active > 100_000 {
            bail!(
                "[nic] max_active must be in 1..=100000, got {}",
                self.max_active
            );
        }
        let nic = NicParams {
            line_rate_gbps: line,
            max_active: self.max_active,
            wqe_budget: self.wqe_budget,
            poll_budget: self.poll_budget,
        };
        let floor = nic.max_active as f64 * LivePolicy::default().x_min;
        if floor > nic.wqe_budget {
            bail!(
                "[nic] max_active = {} apps at the floor rate need a wqe_budget of {floor}, got {}",
                nic.max_active,
                nic.wqe_budget
            );
        }
        let gids = if self.gids.is_empty() {
            gids::local_ipv4_gids().context("listing the host's IPv4 addresses for its GIDs")?
        } else {
            self.gids
                .iter()
                .map(|g| gids::parse(g))
                .collect::<Result<Vec<_>>>()
                .context("[nic] gids")?
        };
        Ok((nic, gids))
    }
}

impl AgentSettings {
    pub fn load(path: &Path) -> Result<Self> {
        Ok(Self::load_with_options(path)?.0)
    }

    /// Loads the whole agent config: the settings and the [`AgentOptions`].
    pub fn load_with_options(path: &Path) -> Result<(Self, AgentOptions)> {
        let (mut table, base): (toml::Table, _) = config::load_config(path)?;
        let mut extra = toml::Table::new();
        for key in OPTION_KEYS {
            if let Some(v) = table.remove(*key) {
                extra.insert(key.to_string(), v);
            }
        }
        let mut options: AgentOptions = toml::Value::Table(extra)
            .try_into()
            .with_context(|| format!("in {}", path.display()))?;
        if let Some(shim) = &mut options.shim {
            shim.socket = base.join(&shim.socket);
            shim.validate()
                .with_context(|| format!("[shim] in {}", path.display()))?;
        }
        if table.get("instance").is_none() {
            if options.shim.is_none() {
                bail!(
                    "{} names no instance, so the agent runs the live problem, which needs [shim] (the shims tell which apps run)",
                    path.display()
                );
            }
            if !options.coordinator_shards.is_empty() {
                bail!(
                    "coordinator_shards in {}: the live problem (no instance) has one coordinator",
                    path.display()
                );
            }
        } else if options.nic.is_some() {
            bail!(
                "[nic] in {} belongs to the live problem; with an instance the host's budgets are the instance's",
                path.display()
            );
        }
        if options.apps_from_shims && options.shim.is_none() {
            bail!(
                "apps_from_shims in {} needs [shim] (the shims tell which apps run)",
                path.display()
            );
        }
        if let Some(d) = &mut options.dasr {
            d.rebase(&base);
            let Some(shim) = &options.shim else {
                bail!(
                    "[dasr] in {} needs [shim] (its caps go to the shims)",
                    path.display()
                );
            };
            // Left at its default, the receiver rate is this host's line rate in bytes/s.
            if d.receiver_rate == 1.0 {
                d.receiver_rate = shim.line_rate_gbps * 1e9 / 8.0;
            }
            d.validate()
                .map_err(|e| anyhow::anyhow!("[dasr] in {}: {e}", path.display()))?;
        }
        let s: Self = toml::Value::Table(table)
            .try_into()
            .with_context(|| format!("in {}", path.display()))?;
        Ok((s.finish(base)?, options))
    }

    fn finish(self, base: PathBuf) -> Result<Self> {
        let mut s = self;
        s.instance = s.instance.map(|p| base.join(p));
        s.tls.rebase(&base);
        s.rate_table = s.rate_table.map(|p| base.join(p));
        if s.heartbeat_ms == 0 || s.coordinator_timeout_ms <= s.heartbeat_ms {
            bail!(
                "coordinator_timeout_ms ({}) must exceed heartbeat_ms ({}), which must be positive",
                s.coordinator_timeout_ms,
                s.heartbeat_ms
            );
        }
        if s.backoff_min_ms == 0 || s.backoff_max_ms < s.backoff_min_ms {
            bail!("need 0 < backoff_min_ms ≤ backoff_max_ms");
        }
        Ok(s)
    }

    pub(crate) fn core_config(&self) -> AgentConfig {
        AgentConfig {
            heartbeat_interval: Duration::from_millis(self.heartbeat_ms),
            coordinator_timeout: Duration::from_millis(self.coordinator_timeout_ms),
            backoff_min: Duration::from_millis(self.backoff_min_ms),
            backoff_max: Duration::from_millis(self.backoff_max_ms),
        }
    }
}
