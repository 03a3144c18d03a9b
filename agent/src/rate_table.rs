//! The local rate table: what the agent tells the host's shims (DESIGN.md §7). This version
//! is a JSON file, replaced atomically (write to a temporary file in the same directory, then
//! `rename`), so a reader sees either the old or the new table, never a torn one. The layout
//! (`format: "drum-rate-table/1"`) is documented in docs/control-plane.md; a shared-memory
//! table for the shim replaces it later.

use crate::shim_hub::AppDecision;
use drum_common::model::Problem;
use drum_common::protocol::agent::AgentCore;
use serde::{Deserialize, Serialize};
use std::io::Write;
use std::path::{Path, PathBuf};

pub const FORMAT: &str = "drum-rate-table/1";

/// How current the rates are.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum LinkState {
    /// Not yet joined: rates are the host's best response to zero prices.
    Starting,
    /// Member of the coordinator; rates follow the rounds.
    Live,
    /// Coordinator lost: the last rates are kept until a rejoin.
    FailStatic,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TableFile {
    pub format: String,
    pub host: String,
    pub state: LinkState,
    pub epoch: u64,
    pub iteration: u64,
    /// Wall-clock time of this version (ms since the Unix epoch).
    pub updated_unix_ms: u64,
    /// Every app present on the host, in instance order.
    pub apps: Vec<AppRate>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AppRate {
    pub app: String,
    pub active: bool,
    /// Granted WQE rate `x` (fraction of line rate); 0 when parked.
    pub rate: f64,
    /// Granted completion-polling rate `a·x`.
    pub poll_rate: f64,
    /// The facilities the app's rate loads.
    pub facilities: Vec<String>,
}

/// The host's apps and their current grants, in instance order.
pub fn app_rates(problem: &Problem, core: &AgentCore) -> Vec<AppRate> {
    let hs = core.state();
    problem.hosts[hs.host]
        .pairs
        .clone()
        .map(|p| {
            let pair = &problem.pairs[p];
            let rate = hs.active.binary_search(&p).map_or(0.0, |i| hs.x[i]);
            AppRate {
                app: problem.app_names[pair.app as usize].clone(),
                active: rate > 0.0,
                rate,
                poll_rate: pair.cqe_per_wqe * rate,
                facilities: pair
                    .uses
                    .iter()
                    .map(|&(f, _)| problem.facilities[f as usize].id.clone())
                    .collect(),
            }
        })
        .collect()
}

/// The host's apps and their current grants, for the shims: [`app_rates`] with each app's
/// completions per WQE, from which the shim hub derives the polling grant.
pub fn app_decisions(problem: &Problem, core: &AgentCore) -> Vec<AppDecision> {
    let pairs = problem.hosts[core.state().host].pairs.clone();
    app_rates(problem, core)
        .into_iter()
        .zip(pairs)
        .map(|(a, p)| AppDecision {
            app: a.app,
            active: a.active,
            rate: a.rate,
            cqe_per_wqe: problem.pairs[p].cqe_per_wqe,
            weight: problem.pairs[p].weight,
        })
        .collect()
}

pub struct RateTable {
    path: PathBuf,
}

impl RateTable {
    pub fn new(path: PathBuf) -> Self {
        Self { path }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn publish(
        &self,
        problem: &Problem,
        core: &AgentCore,
        state: LinkState,
    ) -> std::io::Result<()> {
        let host = &problem.hosts[core.state().host];
        let apps = app_rates(problem, core);
        let file = TableFile {
            format: FORMAT.into(),
            host: host.id.clone(),
            state,
            epoch: core.epoch(),
            iteration: core.iteration(),
            updated_unix_ms: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64),
            apps,
        };
        let text = serde_json::to_string_pretty(&file).expect("rate table serialises");
        let tmp = self.path.with_extension("tmp");
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(text.as_bytes())?;
        f.sync_data()?;
        std::fs::rename(&tmp, &self.path)
    }

    pub fn read(path: &Path) -> Result<TableFile, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
        serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))
    }
}
