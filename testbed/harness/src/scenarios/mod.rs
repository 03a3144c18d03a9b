//! The scenarios: what each reproduces (the paper's figure and numbers), the points it
//! runs, how one run is done, and the criteria its results are judged by.

mod dart;
mod fig2;
mod isolation;
mod kv;
pub mod perftest;

use crate::cluster::Cluster;
use crate::plot::Figure;
use crate::profile::{Nic, Profile, DART_DILATED, DILATED};
use crate::record::RunRecord;
use crate::summary::Summary;
use anyhow::Result;
use clap::ValueEnum;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// How the applications run: as they are, sharing QPs behind a lock (the paper's baseline),
/// or under DRUM (the shim, governed by the live cluster); for Dart's experiments, with
/// DCQCN alone, or capped by DASR through the agents or through the NIC's ACKs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, ValueEnum, Serialize, Deserialize)]
pub enum Mode {
    Raw,
    Share,
    Drum,
    /// softrnic's receive port marking ECN and DCQCN reacting; no DASR (Dart's baseline).
    Dcqcn,
    /// DCQCN, and the shim capping senders at R/N from the agents' DASR channel.
    DasrAgent,
    /// DCQCN, and the shim capping senders at R/N from the N the NIC stamps into its ACKs.
    DasrNic,
}

impl Mode {
    pub fn name(self) -> &'static str {
        match self {
            Mode::Raw => "raw",
            Mode::Share => "share",
            Mode::Drum => "drum",
            Mode::Dcqcn => "dcqcn",
            Mode::DasrAgent => "dasr-agent",
            Mode::DasrNic => "dasr-nic",
        }
    }

    /// The modes of Dart's experiments.
    pub const DART: [Mode; 3] = [Mode::Dcqcn, Mode::DasrAgent, Mode::DasrNic];

    pub fn from_name(name: &str) -> Option<Mode> {
        [Mode::Raw, Mode::Share, Mode::Drum]
            .into_iter()
            .chain(Mode::DART)
            .find(|m| m.name() == name)
    }
}

/// What a scenario's hosts run besides their NICs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Setup {
    /// The dilated NIC; a coordinator and cluster agents when a DRUM series runs.
    Drum,
    /// The dilated NIC with ECN marking (DCQCN then acts) and AUSS in its ACKs, and an
    /// agent with a DASR channel on every host, without a coordinator (`drum-agent --local`):
    /// what Dart's three modes need, so they interleave on one set of hosts.
    Dart,
}

impl Setup {
    pub const ALL: [Setup; 2] = [Setup::Drum, Setup::Dart];

    /// The dilated NIC its hosts emulate.
    pub const fn nic(self) -> Nic {
        match self {
            Setup::Drum => DILATED,
            Setup::Dart => DART_DILATED,
        }
    }

    /// Whose experiments run on it, as the report's stamp names them.
    pub fn experiments(self) -> &'static str {
        match self {
            Setup::Drum => "the DRUM paper's experiments",
            Setup::Dart => "Dart's experiments",
        }
    }
}

/// A point of the paper's figure: (series, x, y), in real (undilated) units.
pub type PaperPoint = (&'static str, f64, f64);

/// What one run measured.
#[derive(Default)]
pub struct Measured {
    pub metrics: BTreeMap<String, f64>,
    pub mechanism: BTreeMap<String, f64>,
    pub samples: Vec<f64>,
    pub flags: Vec<String>,
}

/// Where a run happens.
pub struct RunCtx<'a> {
    pub cluster: &'a Cluster,
    pub profile: Profile,
    /// The run's own seed (workloads that draw keys and sizes take it).
    pub seed: u64,
}

/// A criterion's outcome: what was measured against what it needed, and the paper's value.
#[derive(Clone, Debug, Serialize)]
pub struct Verdict {
    pub scenario: &'static str,
    pub criterion: String,
    pub measured: String,
    pub paper: String,
    /// `None`: the data needed is missing (not run at those points, or in that profile).
    pub pass: Option<bool>,
}

/// How a measure maps to real time: a latency shrinks by the dilation, a rate grows by it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Unit {
    Micros,
    Millis,
    MibPerS,
}

impl Unit {
    /// A measure on the dilated `nic` in real-time-equivalent units.
    pub fn real(self, nic: Nic, v: f64) -> f64 {
        match self {
            Unit::Micros | Unit::Millis => v / nic.time_scale,
            Unit::MibPerS => v * nic.time_scale,
        }
    }

    /// The label of a real-time-equivalent axis on `nic`.
    pub fn real_label(self, nic: Nic) -> String {
        let d = nic.time_scale;
        match self {
            Unit::Micros => format!("µs, real-time equivalent (dilated ÷ {d})"),
            Unit::Millis => format!("ms, real-time equivalent (dilated ÷ {d})"),
            Unit::MibPerS => format!("MiB/s, real-time equivalent (dilated × {d})"),
        }
    }
}

pub struct Scenario {
    pub name: &'static str,
    /// The paper's figure, e.g. "DRUM Fig. 2(c)".
    pub figure: &'static str,
    pub title: &'static str,
    /// The paper's result in words, as the report quotes it.
    pub claim: &'static str,
    pub x_label: &'static str,
    /// The measure the figure plots, and its unit.
    pub metric: &'static str,
    pub unit: Unit,
    pub y_label: &'static str,
    /// Emulated hosts it needs.
    pub hosts: fn(Profile) -> usize,
    /// The series it runs for the modes asked for.
    pub series: fn(&[Mode]) -> Vec<&'static str>,
    /// The x values it runs in a profile.
    pub xs: fn(Profile) -> Vec<f64>,
    pub paper: &'static [PaperPoint],
    pub run: fn(&RunCtx, &str, f64) -> Result<Measured>,
    pub criteria: fn(&Summary) -> Vec<Verdict>,
    pub setup: Setup,
    /// Figures beyond the measure against x (e.g. a time series from the runs' samples).
    pub figures: fn(&[RunRecord]) -> Vec<Figure<'static>>,
}

impl Scenario {
    /// Whether any run of it needs the DRUM daemons.
    pub fn needs_drum(&self, modes: &[Mode]) -> bool {
        // A series is a mode, or a mode and a role ("drum/bw").
        (self.series)(modes)
            .iter()
            .any(|s| s.split('/').next() == Some(Mode::Drum.name()))
    }
}

/// The shim's exit summary line (`drum-shim: pid=… key=value …`, with `DRUM_SHIM_LOG=1`) as
/// numbers.
fn shim_summary(stderr: &str) -> BTreeMap<String, f64> {
    stderr
        .lines()
        .filter(|l| l.starts_with("drum-shim: pid="))
        .flat_map(|l| l.split_whitespace().skip(1))
        .filter_map(|kv| {
            let (k, v) = kv.split_once('=')?;
            Some((k.to_string(), v.parse().ok()?))
        })
        .collect()
}

/// Every scenario, in the order `list` and the report show them.
pub fn all() -> Vec<Scenario> {
    vec![
        fig2::fig2a(),
        fig2::fig2c(),
        kv::tc1_batch(),
        kv::tc1(),
        kv::tc2(),
        kv::tc2_flow(),
        kv::tc3(),
        isolation::isolation(),
        dart::conv(),
        dart::incast(),
    ]
}

pub fn find(name: &str) -> Option<Scenario> {
    all().into_iter().find(|s| s.name == name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_scenario_with_a_drum_series_brings_the_daemons_up() {
        for s in all() {
            let drum = s.needs_drum(&[Mode::Raw, Mode::Drum]);
            let native = s.name.starts_with("fig2") || s.setup == Setup::Dart;
            assert_eq!(drum, !native, "{}", s.name);
            assert!(!s.needs_drum(&[Mode::Raw]), "{}", s.name);
        }
    }
}
