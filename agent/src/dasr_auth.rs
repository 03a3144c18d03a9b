//! The DASR service's side of authentication ([`drum_common::dasr::auth`]): reading the
//! cluster key from `[dasr] key_file`, and rate-limiting the WARNs about refused datagrams
//! (a flood of forgeries must not become a flood of log lines).

use drum_common::dasr::{DasrKey, Guard, Refusal, KEY_LEN};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::Duration;

/// Reads a key file: exactly [`KEY_LEN`] bytes, readable by its owner only (like an ssh key:
/// a key the whole host can read is a key any local user can forge caps with).
pub fn load_key(path: &Path) -> Result<DasrKey, String> {
    let shown = path.display();
    let meta = std::fs::metadata(path).map_err(|e| format!("{shown}: {e}"))?;
    let mode = meta.permissions().mode() & 0o777;
    if mode & 0o077 != 0 {
        return Err(format!(
            "{shown} has mode {mode:03o}: a DASR key must be readable by its owner only (chmod 600)"
        ));
    }
    let bytes = std::fs::read(path).map_err(|e| format!("{shown}: {e}"))?;
    let secret: [u8; KEY_LEN] = bytes.as_slice().try_into().map_err(|_| {
        format!(
            "{shown} holds {} bytes; a DASR key is {KEY_LEN} random bytes (`drum-coordinator dev-certs` writes one)",
            bytes.len()
        )
    })?;
    Ok(DasrKey::new(&secret))
}

/// The guard for `key_file` (and `previous_key_file` during a rotation); `None` without a key.
pub fn guard(
    key_file: Option<&Path>,
    previous_key_file: Option<&Path>,
    window: Duration,
) -> Result<Option<Guard>, String> {
    let Some(current) = key_file.map(load_key).transpose()? else {
        if previous_key_file.is_some() {
            return Err("previous_key_file needs key_file".into());
        }
        return Ok(None);
    };
    let previous = previous_key_file.map(load_key).transpose()?;
    Ok(Some(Guard::new(current, previous, window)))
}

/// At most one WARN per kind of refusal per `every`; the next one tells how many were
/// refused in between.
#[derive(Debug)]
pub struct RefusalLog {
    every: Duration,
    /// Kind → (when its last WARN went out, refusals not logged since).
    last: BTreeMap<&'static str, (Duration, u64)>,
}

impl RefusalLog {
    pub fn new(every: Duration) -> Self {
        Self {
            every,
            last: BTreeMap::new(),
        }
    }

    /// Whether to WARN about this refusal at `now`, and how many of its kind went unlogged
    /// before it.
    pub fn admit(&mut self, now: Duration, kind: &'static str) -> Option<u64> {
        match self.last.get_mut(kind) {
            Some((at, quiet)) if now < *at + self.every => {
                *quiet += 1;
                None
            }
            Some((at, quiet)) => {
                let n = std::mem::take(quiet);
                *at = now;
                Some(n)
            }
            None => {
                self.last.insert(kind, (now, 0));
                Some(0)
            }
        }
    }

    pub fn warn(&mut self, now: Duration, from: SocketAddr, why: &Refusal) {
        if let Some(unlogged) = self.admit(now, why.kind()) {
            tracing::warn!(
                %from,
                reason = why.kind(),
                unlogged,
                "refused a DASR datagram: {why}"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn a_kind_is_logged_once_per_period_with_the_count_in_between() {
        let s = Duration::from_secs(1);
        let mut l = RefusalLog::new(10 * s);
        assert_eq!(l.admit(Duration::ZERO, "bad_mac"), Some(0));
        assert_eq!(l.admit(s, "bad_mac"), None);
        assert_eq!(l.admit(2 * s, "bad_mac"), None);
        assert_eq!(l.admit(3 * s, "replayed"), Some(0), "kinds are apart");
        assert_eq!(l.admit(10 * s, "bad_mac"), Some(2));
        assert_eq!(l.admit(11 * s, "bad_mac"), None);
    }

    #[test]
    fn key_files_must_be_private_and_32_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let write = |name: &str, data: &[u8], mode: u32| {
            let p = dir.path().join(name);
            std::fs::File::create(&p).unwrap().write_all(data).unwrap();
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).unwrap();
            p
        };
        let good = write("good", &[7; KEY_LEN], 0o600);
        assert_eq!(
            load_key(&good).unwrap().id(),
            DasrKey::new(&[7; KEY_LEN]).id()
        );
        let open = write("open", &[7; KEY_LEN], 0o644);
        assert!(load_key(&open).unwrap_err().contains("chmod 600"));
        let short = write("short", &[7; 31], 0o600);
        assert!(load_key(&short).unwrap_err().contains("31 bytes"));
        assert!(guard(None, None, Duration::from_secs(1)).unwrap().is_none());
        assert!(guard(None, Some(&good), Duration::from_secs(1)).is_err());
        assert!(guard(Some(&good), Some(&good), Duration::from_secs(1))
            .unwrap()
            .is_some());
    }
}
