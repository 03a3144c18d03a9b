//! The local rate table: the host's grants for operators and tools (the shims get theirs in
//! shared memory, docs/design.md §7). A JSON file, replaced atomically (`PATH.tmp` in the same
//! directory, then `rename`), so a reader sees either the old or the new table, never a torn
//! one. The layout
//! (`format: "drum-rate-table/1"`) is documented in docs/control-plane.md; a shared-memory
//! table for the shim replaces it later.

use crate::metrics::AgentMetrics;
use crate::shim_hub::AppDecision;
use drum_common::model::Problem;
use drum_common::protocol::agent::AgentCore;
use serde::{Deserialize, Serialize};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;
use tracing::{info, warn};

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
    /// The agent stopped: nobody updates these rates (the shims keep their last grants).
    Stopped,
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

/// The table's content for the agent's current state.
pub fn table_file(problem: &Problem, core: &AgentCore, state: LinkState) -> TableFile {
    TableFile {
        format: FORMAT.into(),
        host: problem.hosts[core.state().host].id.clone(),
        state,
        epoch: core.epoch(),
        iteration: core.iteration(),
        updated_unix_ms: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64),
        apps: app_rates(problem, core),
    }
}

/// Where a table at `path` is written before the rename: `PATH.tmp`, in the same directory
/// (a rename is atomic only within one file system).
pub fn temporary_path(path: &Path) -> PathBuf {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    PathBuf::from(tmp)
}

/// Writes `file` to `path` atomically: `PATH.tmp`, rename over `PATH`. An error names the
/// path of the step that failed. No `fsync`: the rename alone keeps readers from a torn
/// table, and after a crash the agent writes a new one at start (the table lives in `/run`,
/// gone at a reboot anyway); on a disk-backed `/run` each flush cost a disk cache flush.
pub fn write(path: &Path, file: &TableFile) -> Result<(), String> {
    let text = serde_json::to_string_pretty(file).expect("rate table serialises");
    let tmp = temporary_path(path);
    let mut f =
        std::fs::File::create(&tmp).map_err(|e| format!("creating {}: {e}", tmp.display()))?;
    f.write_all(text.as_bytes())
        .map_err(|e| format!("writing {}: {e}", tmp.display()))?;
    std::fs::rename(&tmp, path)
        .map_err(|e| format!("renaming {} to {}: {e}", tmp.display(), path.display()))
}

pub struct RateTable;

impl RateTable {
    pub fn read(path: &Path) -> Result<TableFile, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
        serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))
    }
}

/// How long a failed write waits before the next try (unless a newer table comes first).
const RETRY: Duration = Duration::from_secs(1);

/// The shortest time between two writes of the same link state. Rounds come 100 times a
/// second and every one moves the rates a little; a table written at each cost an idle agent
/// a tenth of a core (a file created and flushed per round), for readers (operators, tools,
/// tests) that need it current to a human's eye, not to a round.
pub const PERIOD: Duration = Duration::from_millis(100);

/// Writes the rate table in a task of its own, off the round path. A write that fails (disk
/// full, read-only `/run`, a directory in the way) never stops the agent: enforcement goes on
/// through the shims' shared memory, and the table only informs operators and tools. The
/// failure is logged once per distinct error, counted in the metrics, and the latest table
/// is tried again every [`RETRY`] until a write succeeds.
pub struct TableWriter {
    path: PathBuf,
    latest: watch::Sender<Option<TableFile>>,
    task: tokio::task::JoinHandle<()>,
}

impl TableWriter {
    /// `period`: [`PERIOD`] but in tests.
    pub fn start(path: PathBuf, metrics: Arc<AgentMetrics>, period: Duration) -> Self {
        let (latest, rx) = watch::channel(None);
        let task = tokio::spawn(write_loop(path.clone(), rx, metrics, period));
        Self { path, latest, task }
    }

    /// Replaces the table to write (an older one not yet written is skipped).
    pub fn publish(&self, file: TableFile) {
        self.latest.send_replace(Some(file));
    }

    /// Writes `last` (the agent is exiting) after any write under way, then stops the
    /// writer: one try, as writes are serialised in the writer task (an older table landing
    /// after it would say the agent still runs).
    pub async fn close(self, last: TableFile) {
        self.latest.send_replace(Some(last));
        drop(self.latest);
        if tokio::time::timeout(CLOSE_WAIT, self.task).await.is_err() {
            warn!(path = %self.path.display(), "the rate table's last write did not finish in {CLOSE_WAIT:?}");
        }
    }
}

/// How long an exiting agent waits for its last table write.
const CLOSE_WAIT: Duration = Duration::from_secs(2);

/// Waits out `period` after a write of a table in state `written`, unless a table in another
/// state arrives (a change of state is written at once) or the agent closes (its last table
/// too). `rx` itself is left as it was, so the newest table is the next one written.
async fn settle(rx: &watch::Receiver<Option<TableFile>>, written: LinkState, period: Duration) {
    let mut probe = rx.clone();
    let until = tokio::time::Instant::now() + period;
    while let Ok(Ok(())) = tokio::time::timeout_at(until, probe.changed()).await {
        if probe
            .borrow_and_update()
            .as_ref()
            .is_some_and(|f| f.state != written)
        {
            return;
        }
    }
}

async fn write_loop(
    path: PathBuf,
    mut rx: watch::Receiver<Option<TableFile>>,
    metrics: Arc<AgentMetrics>,
    period: Duration,
) {
    let mut failing: Option<String> = None;
    while rx.changed().await.is_ok() {
        loop {
            let Some(file) = rx.borrow_and_update().clone() else {
                break;
            };
            let state = file.state;
            let p = path.clone();
            let r = tokio::task::spawn_blocking(move || write(&p, &file))
                .await
                .unwrap_or_else(|e| Err(format!("the writer task failed: {e}")));
            match r {
                Ok(()) => {
                    metrics.table_ok.set(1);
                    if failing.take().is_some() {
                        info!(path = %path.display(), "the rate table is written again");
                    }
                    settle(&rx, state, period).await;
                    break;
                }
                Err(e) => {
                    metrics.table_ok.set(0);
                    metrics.table_write_failures.inc();
                    if failing.as_deref() != Some(e.as_str()) {
                        warn!("could not write the rate table, retrying every {RETRY:?}; the shims' grants are unaffected: {e}");
                    }
                    failing = Some(e);
                    // A newer table is tried at once; otherwise this one again after RETRY.
                    if let Ok(Err(_)) = tokio::time::timeout(RETRY, rx.changed()).await {
                        return;
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(state: LinkState, iteration: u64) -> TableFile {
        TableFile {
            format: FORMAT.into(),
            host: "h0".into(),
            state,
            epoch: 1,
            iteration,
            updated_unix_ms: 0,
            apps: Vec::new(),
        }
    }

    async fn written(path: &Path, want: impl Fn(&TableFile) -> bool) -> TableFile {
        let end = tokio::time::Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok(t) = RateTable::read(path) {
                if want(&t) {
                    return t;
                }
            }
            assert!(tokio::time::Instant::now() < end, "never written");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    #[tokio::test]
    async fn rounds_are_written_once_a_period_and_changes_of_state_and_the_last_table_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("rates.json");
        // A period no test run outlasts: whatever is written before it ends was not paced.
        let w = TableWriter::start(
            path.clone(),
            Arc::new(AgentMetrics::default()),
            Duration::from_secs(3600),
        );
        w.publish(table(LinkState::Live, 1));
        written(&path, |t| t.iteration == 1).await;
        for i in 2..=50 {
            w.publish(table(LinkState::Live, i));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(
            RateTable::read(&path).unwrap().iteration,
            1,
            "a round's table waits"
        );
        w.publish(table(LinkState::FailStatic, 51));
        written(&path, |t| t.state == LinkState::FailStatic).await;
        w.publish(table(LinkState::FailStatic, 52));
        w.close(table(LinkState::Stopped, 53)).await;
        let last = RateTable::read(&path).unwrap();
        assert_eq!((last.state, last.iteration), (LinkState::Stopped, 53));
    }
}
