//! Reading an agent's shared-memory grant tables from outside it, as root: the agent maps
//! one memfd per registered app process (`drum-table-PID`), which `/proc/AGENT/maps` lists
//! and `/proc/AGENT/mem` reads (also while the agent is stopped), so the soak sees exactly
//! the grants the shims read, without being a shim.

use super::invariants::{grant_bytes, Grants};
use drum_table::layout::TABLE_BYTES;
use std::os::unix::fs::FileExt;

/// The name of every table the agent `pid` maps, with its grant (see [`grant_bytes`]).
/// Empty if the agent is gone; a table that does not read as one is left out.
pub fn grants(pid: i32) -> Grants {
    let mut out = Grants::new();
    let Ok(maps) = std::fs::read_to_string(format!("/proc/{pid}/maps")) else {
        return out;
    };
    let Ok(mem) = std::fs::File::open(format!("/proc/{pid}/mem")) else {
        return out;
    };
    for line in maps.lines() {
        let Some(name) = line
            .split_whitespace()
            .find_map(|f| f.strip_prefix("/memfd:drum-table-"))
        else {
            continue;
        };
        let Some(start) = line
            .split('-')
            .next()
            .and_then(|a| u64::from_str_radix(a, 16).ok())
        else {
            continue;
        };
        let mut buf = vec![0u8; TABLE_BYTES];
        if mem.read_exact_at(&mut buf, start).is_ok() {
            if let Some(g) = grant_bytes(&buf) {
                out.insert(format!("drum-table-{name}"), g);
            }
        }
    }
    out
}
