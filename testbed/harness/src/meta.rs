//! What an output directory was made with — commit, profile, seed, NIC and machine — kept in
//! `meta.json`, stamped on the report, and checked when a run resumes into the same
//! directory (runs of another profile, seed or NIC must not be mixed).

use crate::profile::Profile;
use crate::scenarios::Setup;
use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::path::Path;
use std::process::Command;

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Meta {
    pub commit: String,
    pub profile: Profile,
    pub seed: u64,
    /// The NICs its scenarios emulate, one per [`Setup`].
    pub nics: Vec<NicMeta>,
    pub machine: String,
    pub started_unix_s: f64,
}

/// A NIC profile as recorded (owned strings: it is read back).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NicMeta {
    /// Whose experiments run on it.
    pub experiments: String,
    pub name: String,
    pub dilation: f64,
    pub softrnic_args: Vec<String>,
}

impl NicMeta {
    fn of(setup: Setup) -> NicMeta {
        let n = setup.nic();
        NicMeta {
            experiments: setup.experiments().into(),
            name: n.name.into(),
            dilation: n.time_scale,
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
    serde_json::from_slice(&text).with_context(|| {
        format!(
            "parsing {} (a directory of another drum-testbed version: run again with another --out)",
            p.display()
        )
    })
}

fn nics() -> Vec<NicMeta> {
    Setup::ALL.map(NicMeta::of).to_vec()
}

/// Writes `meta.json` for a new directory; for one that has it, checks that the runs to add
/// are of the same profile, seed and NICs (runs on another NIC profile must not be mixed).
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
        if m.nics != nics() {
            let names: Vec<&str> = m.nics.iter().map(|n| n.name.as_str()).collect();
            bail!(
                "{} holds runs on another NIC profile ({}); choose another --out",
                out.display(),
                names.join(", ")
            );
        }
        return Ok(());
    }
    let m = Meta {
        commit: commit(),
        profile,
        seed,
        nics: nics(),
        machine: machine(),
        started_unix_s: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64()),
    };
    std::fs::write(out.join("meta.json"), serde_json::to_vec_pretty(&m)?)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_resume_only_on_the_same_profile_seed_and_nics() {
        let dir = std::env::temp_dir().join(format!("drum-meta-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        write_or_check(&dir, Profile::Quick, 7).unwrap();
        write_or_check(&dir, Profile::Quick, 7).unwrap();
        assert!(write_or_check(&dir, Profile::Full, 7).is_err());
        assert!(write_or_check(&dir, Profile::Quick, 8).is_err());
        // The same directory made on another NIC profile (the 200× of before 2026-11-28).
        let mut m = read(&dir).unwrap();
        m.nics[0] = NicMeta::of(Setup::Dart);
        std::fs::write(dir.join("meta.json"), serde_json::to_vec(&m).unwrap()).unwrap();
        let e = write_or_check(&dir, Profile::Quick, 7).unwrap_err();
        assert!(e.to_string().contains("another NIC profile"), "{e}");
        // A meta.json of a version before the NICs were recorded.
        std::fs::write(dir.join("meta.json"), br#"{"commit":"x","nic":{}}"#).unwrap();
        let e = format!("{:#}", write_or_check(&dir, Profile::Quick, 7).unwrap_err());
        assert!(e.contains("another drum-testbed version"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
