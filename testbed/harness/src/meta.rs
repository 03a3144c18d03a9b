//! What an output directory was made with — commit, profile, seed, NIC and machine — kept in
//! `meta.json`, stamped on the report, and checked when a run resumes into the same
//! directory (runs of another profile or seed must not be mixed).

use crate::profile::{Nic, Profile, DILATED, DILATION};
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::path::Path;
use std::process::Command;

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Meta {
    pub commit: String,
    pub profile: Profile,
    pub seed: u64,
    pub nic: NicMeta,
    pub machine: String,
    pub started_unix_s: f64,
}

/// The NIC profile as recorded (owned strings: it is read back).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct NicMeta {
    pub name: String,
    pub dilation: f64,
    pub softrnic_args: Vec<String>,
}

impl From<Nic> for NicMeta {
    fn from(n: Nic) -> NicMeta {
        NicMeta {
            name: n.name.into(),
            dilation: DILATION,
            softrnic_args: n.softrnic_args(),
        }
    }
}

fn commit() -> String {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let out = Command::new("git")
        .args(["describe", "--always", "--dirty"])
        .current_dir(dir)
        .output();
    match out {
        Ok(o) if o.status.success() => String::from_utf8_lossy(&o.stdout).trim().to_string(),
        _ => "unknown".into(),
    }
}

fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|s| s.trim().to_string())
        .unwrap_or_default();
    format!("{cores} × {cpu}, Linux {kernel}")
}

pub fn read(out: &Path) -> Result<Meta> {
    let p = out.join("meta.json");
    let text = std::fs::read(&p).with_context(|| format!("reading {}", p.display()))?;
    serde_json::from_slice(&text).with_context(|| format!("parsing {}", p.display()))
}

/// Writes `meta.json` for a new directory; for one that has it, checks that the runs to add
/// are of the same profile and seed.
pub fn write_or_check(out: &Path, profile: Profile, seed: u64) -> Result<()> {
    if out.join("meta.json").exists() {
        let m = read(out)?;
        if m.profile != profile || m.seed != seed {
            bail!(
                "{} holds runs of profile {} with seed {}; resume with those, or choose another --out",
                out.display(),
                m.profile.name(),
                m.seed
            );
        }
        return Ok(());
    }
    let m = Meta {
        commit: commit(),
        profile,
        seed,
        nic: DILATED.into(),
        machine: machine(),
        started_unix_s: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64()),
    };
    std::fs::write(out.join("meta.json"), serde_json::to_vec_pretty(&m)?)?;
    Ok(())
}
