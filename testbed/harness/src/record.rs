//! One run's raw data, kept as JSON in `OUT/runs/SCENARIO/` so that `report` rebuilds every
//! output from it and a later `run` with the same `--out` skips what is already there.

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunRecord {
    pub scenario: String,
    /// The line of the figure the run belongs to: a mode (raw, share, drum) or a transport.
    pub series: String,
    /// Where on the figure's x axis.
    pub x: f64,
    pub repeat: u32,
    pub seed: u64,
    pub started_unix_s: f64,
    pub elapsed_s: f64,
    /// One-minute load average before and after the run.
    pub load_before: f64,
    pub load_after: f64,
    /// What makes the run doubtful (e.g. "under load", "retransmissions").
    pub flags: Vec<String>,
    /// The measures the figure and the criteria use (e.g. `p80_us`, `mib_per_s`), dilated.
    pub metrics: BTreeMap<String, f64>,
    /// The mechanism behind the result (QP-cache miss ratio, WQEs per fetch, retransmits).
    pub mechanism: BTreeMap<String, f64>,
    /// Raw samples where the figure shows a distribution (e.g. per-operation latencies).
    #[serde(default)]
    pub samples: Vec<f64>,
}

impl RunRecord {
    /// Where this run's record lives under `out`.
    pub fn path(out: &Path, scenario: &str, series: &str, x: f64, repeat: u32) -> PathBuf {
        // A series may name a mode and a role ("drum/bw"): one file name all the same.
        let series = series.replace('/', "+");
        out.join("runs")
            .join(scenario)
            .join(format!("{series}-x{x}-r{repeat}.json"))
    }

    pub fn write(&self, out: &Path) -> Result<()> {
        let p = Self::path(out, &self.scenario, &self.series, self.x, self.repeat);
        std::fs::create_dir_all(p.parent().expect("a run path has a parent"))?;
        let tmp = p.with_extension("json.tmp");
        std::fs::write(&tmp, serde_json::to_vec_pretty(self)?)?;
        // Renamed into place: an interrupted run leaves no half record to be resumed from.
        std::fs::rename(&tmp, &p).with_context(|| format!("writing {}", p.display()))
    }

    /// Every record under `out/runs`, in a stable order.
    pub fn load_all(out: &Path) -> Result<Vec<RunRecord>> {
        let mut all = Vec::new();
        let runs = out.join("runs");
        if !runs.exists() {
            return Ok(all);
        }
        for dir in std::fs::read_dir(&runs)? {
            for f in std::fs::read_dir(dir?.path())? {
                let p = f?.path();
                if p.extension().is_some_and(|e| e == "json") {
                    let text = std::fs::read(&p)?;
                    all.push(
                        serde_json::from_slice(&text)
                            .with_context(|| format!("reading {}", p.display()))?,
                    );
                }
            }
        }
        all.sort_by(|a: &RunRecord, b| {
            (&a.scenario, &a.series, a.repeat)
                .cmp(&(&b.scenario, &b.series, b.repeat))
                .then(a.x.total_cmp(&b.x))
        });
        Ok(all)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip_and_load_in_order() {
        let dir = std::env::temp_dir().join(format!("drum-record-{}", std::process::id()));
        let mut r = RunRecord {
            scenario: "fig2c".into(),
            series: "RC".into(),
            x: 20.0,
            repeat: 0,
            seed: 1,
            started_unix_s: 0.0,
            elapsed_s: 1.0,
            load_before: 0.5,
            load_after: 0.7,
            flags: vec![],
            metrics: [("mib_per_s".to_string(), 12.5)].into(),
            mechanism: BTreeMap::new(),
            samples: vec![1.0],
        };
        r.write(&dir).unwrap();
        r.x = 4.0;
        r.series = "RC/x".into();
        r.write(&dir).unwrap();
        let all = RunRecord::load_all(&dir).unwrap();
        assert_eq!(all.iter().map(|r| r.x).collect::<Vec<_>>(), [20.0, 4.0]);
        assert_eq!(all[1], r);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
