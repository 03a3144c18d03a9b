//! The state file: the operator's changes persisted across restarts, written atomically,
//! and a file that does not fit set aside rather than fatal.

use super::*;

/// The state file's format tag.
pub const STATE_FORMAT: &str = "drum-coordinator-state/1";

#[derive(Debug, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
struct StateFile {
    format: String,
    #[serde(default)]
    capacities: std::collections::BTreeMap<String, f64>,
    #[serde(default)]
    weights: std::collections::BTreeMap<String, f64>,
    #[serde(default)]
    drained: Vec<String>,
}

/// Reads a state file; a missing file is an empty state, anything unreadable an error that
/// names the file (the caller reports it and sets the file aside, see [`set_aside`]).
pub fn read_state(path: &Path) -> Result<OperatorState> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(OperatorState::default()),
        Err(e) => {
            return Err(e).with_context(|| format!("reading the state file {}", path.display()))
        }
    };
    let f: StateFile = serde_json::from_str(&text)
        .with_context(|| format!("the state file {} is corrupt", path.display()))?;
    if f.format != STATE_FORMAT {
        bail!(
            "the state file {} has format {:?}, expected {STATE_FORMAT:?}",
            path.display(),
            f.format
        );
    }
    Ok(OperatorState {
        capacities: f.capacities,
        weights: f.weights,
        drained: f.drained,
    })
}

/// Moves a state file that does not fit out of the way, to `PATH.rejected-UNIXSECONDS`,
/// so that the operator's changes stay at hand while the coordinator starts (issue 19: no
/// state file may make the service unstartable). Returns where it went.
pub fn set_aside(path: &Path) -> Result<PathBuf> {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let mut aside = path.as_os_str().to_owned();
    aside.push(format!(".rejected-{secs}"));
    let aside = PathBuf::from(aside);
    std::fs::rename(path, &aside)
        .with_context(|| format!("moving {} to {}", path.display(), aside.display()))?;
    Ok(aside)
}

/// Restores the operator's changes from the state file at start. What does not fit (an
/// unreadable file, a change the checks refuse) is logged as an error naming the file and
/// the reasons, the file is set aside, and what did fit is written back: the coordinator
/// always starts.
pub(super) fn restore_state(core: &mut Coordinator, path: &Path) {
    let (st, mut problems) = match read_state(path) {
        Ok(st) => (st, Vec::new()),
        Err(e) => (OperatorState::default(), vec![format!("{e:#}")]),
    };
    problems.extend(core.restore(&st));
    if problems.is_empty() {
        info!(
            state_file = %path.display(),
            capacities = st.capacities.len(),
            weights = st.weights.len(),
            drained = st.drained.len(),
            "operator changes restored"
        );
        return;
    }
    let aside = match set_aside(path) {
        Ok(p) => p.display().to_string(),
        Err(e) => format!("nowhere ({e:#})"),
    };
    tracing::error!(
        state_file = %path.display(),
        set_aside = %aside,
        "the state file does not fit; starting with the changes that do, the file is set aside: {}",
        problems.join("; ")
    );
    if let Err(e) = write_state(path, &core.operator_state()) {
        warn!("the restored operator changes are not persisted: {e:#}");
    }
}

/// Writes a state file atomically: `PATH.tmp`, fsync, rename over `PATH`, fsync the directory.
pub fn write_state(path: &Path, st: &OperatorState) -> Result<()> {
    use std::io::Write;
    let f = StateFile {
        format: STATE_FORMAT.into(),
        capacities: st.capacities.clone(),
        weights: st.weights.clone(),
        drained: st.drained.clone(),
    };
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    let body = serde_json::to_string_pretty(&f).expect("state serialises");
    let mut file =
        std::fs::File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
    file.write_all(body.as_bytes())
        .and_then(|()| file.sync_all())
        .with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("replacing {}", path.display()))?;
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        if let Ok(d) = std::fs::File::open(dir) {
            let _ = d.sync_all();
        }
    }
    Ok(())
}
