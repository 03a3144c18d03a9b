//! `drum-agent --local FILE`: the agent of a host without a cluster — no coordinator, no
//! optimiser; applications are governed by the operator's pins and defaults in `[shim]`
//! alone, and, with `[dasr]`, by the caps of the receivers they send to. Useful on a single
//! machine, for testing, and to pin apps while the cluster is being set up. Also writes
//! what the shims report to a status file (JSON), replaced atomically.

use crate::dasr::{DasrConfig, DasrService};
use crate::dasr_link;
use crate::grant_audit::OverGrant;
use crate::shim_hub::{PeerCapView, ShimHub, ShimSettings, ShimUsage};
use crate::ungoverned::direct_verbs::DirectVerbs;
use crate::ungoverned::Ungoverned;
use anyhow::{Context, Result};
use serde::Deserialize;
use std::path::{Path, PathBuf};
use std::time::Duration;

#[derive(Clone, Debug, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct LocalSettings {
    pub shim: ShimSettings,
    /// Dart's sender counting with the other hosts' agents; none: no DASR caps. Its
    /// `receiver_rate` left at 1.0 means this host's line rate, in bytes/s.
    #[serde(default)]
    pub dasr: Option<DasrConfig>,
    /// Where to write the registered shims' counters; none: not written.
    #[serde(default)]
    pub status_file: Option<PathBuf>,
}

impl LocalSettings {
    pub fn load(path: &Path) -> Result<Self> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let mut s: LocalSettings =
            toml::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
        let base = path.parent().unwrap_or(Path::new("."));
        s.shim.socket = base.join(&s.shim.socket);
        s.status_file = s.status_file.map(|p| base.join(p));
        s.shim.validate()?;
        if let Some(d) = &mut s.dasr {
            d.rebase(base);
            if d.receiver_rate == 1.0 {
                d.receiver_rate = s.shim.line_rate_gbps * 1e9 / 8.0;
            }
            d.validate().map_err(|e| anyhow::anyhow!("[dasr]: {e}"))?;
        }
        Ok(s)
    }
}

#[derive(serde::Serialize)]
struct Status<'a> {
    format: &'static str,
    shims: &'a [ShimUsage],
    caps: &'a [PeerCapView],
    /// Unique senders counted by this host as a DASR receiver.
    dasr_senders: Option<u32>,
    /// Processes using the NIC without a registered shim (`[shim.ungoverned]`).
    ungoverned: &'a [Ungoverned],
    /// Registered processes sending above their grant (`grant_audit`).
    over_grant: &'a [OverGrant],
    /// Registered processes that drive hardware queues directly (governed in part).
    direct_verbs: &'a [DirectVerbs],
}

fn write_status(path: &Path, hub: &ShimHub, dasr: Option<&DasrService>) -> Result<()> {
    let tmp = path.with_extension("tmp");
    let text = serde_json::to_string_pretty(&Status {
        format: "drum-shim-status/1",
        shims: &hub.usage(),
        caps: &hub.caps(),
        dasr_senders: dasr.map(|d| d.receiver().borrow().n),
        ungoverned: &hub.ungoverned(),
        over_grant: &hub.over_grant(),
        direct_verbs: &hub.direct_verbs(),
    })?;
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, path)?;
    Ok(())
}

/// Runs until `stop` returns true (checked every 100 ms).
pub fn run(settings: LocalSettings, stop: impl Fn() -> bool) -> Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    rt.block_on(async {
        let (hub, dasr) = dasr_link::start(&settings.shim, settings.dasr.clone()).await?;
        while !stop() {
            if let Some(p) = &settings.status_file {
                if let Err(e) = write_status(p, &hub, dasr.as_ref()) {
                    tracing::warn!("writing {}: {e:#}", p.display());
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        Ok(())
    })
}
