//! Finds the table in which the NIC publishes each destination's active unique senders
//! (`drum_table::nic_auss`; softrnic with `--auss-expiry-ms`), so that [`crate::peer_caps`]
//! can cap at `R/N` without the agent. The device names it: `<ibdev_path>/softrnic_auss`
//! holds its path on a softrnic NIC running AUSS and does not exist on any other NIC.
//! `DRUM_SHIM_NIC_AUSS=0` leaves it unread. docs/shim.md, "Caps from the NIC".

use crate::ffi::IbvDevice;
use crate::limits;
use crate::trouble::{warn_once, Trouble};
use drum_table::nic_auss::Reader;
use std::ffi::CStr;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// The table's path, from the first device opened that has one (a process on one softrnic
/// host sees one table however many devices it opens).
static PATH: OnceLock<PathBuf> = OnceLock::new();

/// At `ibv_open_device`: maps the table of `device` if it has one and none is read yet.
///
/// # Safety
/// `device` is a device from `ibv_get_device_list` (or null).
pub unsafe fn watch(device: *const IbvDevice) {
    if device.is_null() || PATH.get().is_some() || !wanted() {
        return;
    }
    // SAFETY: a live `struct ibv_device`, whose `ibdev_path` libibverbs NUL-terminated.
    let dir = unsafe { CStr::from_ptr((*device).ibdev_path.as_ptr()) };
    let Some(path) = table_path(Path::new(&*dir.to_string_lossy())) else {
        return;
    };
    if PATH.set(path).is_ok() {
        recheck();
    }
}

/// From the engine thread now and then: maps the table again when a new engine replaced it,
/// and stops reading it when it is gone (the run stopped, or AUSS was turned off).
pub fn recheck() {
    let Some(path) = PATH.get() else { return };
    let inode = std::fs::metadata(path).ok().map(|m| m.ino());
    if inode == limits::nic_table_inode() {
        return;
    }
    match inode.map(|_| Reader::open(path)) {
        Some(Ok(r)) => limits::set_nic_table(Some(r)),
        Some(Err(e)) => {
            warn_once(
                Trouble::NicTable,
                &format!(
                    "the NIC's AUSS table {} cannot be read ({e}); caps come from the agent only",
                    path.display()
                ),
            );
            limits::set_nic_table(None);
        }
        None => limits::set_nic_table(None),
    }
}

/// Where `<ibdev_path>/softrnic_auss` says the table is.
fn table_path(ibdev_path: &Path) -> Option<PathBuf> {
    let named = std::fs::read_to_string(ibdev_path.join("softrnic_auss")).ok()?;
    let p = PathBuf::from(named.trim());
    p.is_absolute().then_some(p)
}

fn wanted() -> bool {
    std::env::var_os("DRUM_SHIM_NIC_AUSS").is_none_or(|v| v != "0")
}
