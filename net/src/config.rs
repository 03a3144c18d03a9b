//! What both daemons do at start: logging, reading their TOML config, and reading an
//! instance file as the problem to optimise.

use anyhow::{Context, Result};
use drum_common::instance::Instance;
use drum_common::model::Problem;
use serde::de::DeserializeOwned;
use std::path::{Path, PathBuf};

/// Logs to stderr, filtered by `DRUM_LOG` (default `info`), coloured only on a terminal: the
/// daemons' common setup.
pub fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("DRUM_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
}

/// Reads a daemon's TOML config; returns it with the directory its relative paths are relative to.
pub fn load_config<T: DeserializeOwned>(path: &Path) -> Result<(T, PathBuf)> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let config = toml::from_str(&text).with_context(|| format!("in {}", path.display()))?;
    Ok((
        config,
        path.parent().unwrap_or(Path::new(".")).to_path_buf(),
    ))
}

/// Reads an instance file (docs/instance-format.md) as a problem.
pub fn load_problem(path: &Path) -> Result<Problem> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    Instance::from_json(&text)
        .and_then(Instance::into_problem)
        .with_context(|| format!("in {}", path.display()))
}
