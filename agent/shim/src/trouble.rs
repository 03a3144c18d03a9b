//! How the shim reports trouble: each kind once per process, on stderr, with `write(2)`
//! (usable from the exit-time destructor, no Rust lock), and the guard that turns a panic in a
//! CQ, channel or QP verb into forwarding the verb unchanged.

use libc::c_int;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU32, Ordering::Relaxed};

/// Kinds of trouble, each reported once per process.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Trouble {
    NoRealSymbol = 1,
    Install = 2,
    TableFull = 4,
    AlreadySwapped = 8,
    Counting = 16,
    CloseFailed = 32,
    Uninstall = 64,
    PacerConfig = 128,
    DeferredPost = 256,
    Engine = 512,
    NoAgent = 1024,
    AgentLost = 2048,
    Governing = 4096,
    Extended = 8192,
    Completions = 16384,
    WrApi = 32768,
    DirectVerbs = 65536,
    NicPacing = 131072,
    NoMlx5 = 262144,
    NicTable = 524288,
}

static WARNED: AtomicU32 = AtomicU32::new(0);

pub(crate) fn warn_once(kind: Trouble, msg: &str) {
    let bit = kind as u32;
    if WARNED.fetch_or(bit, Relaxed) & bit == 0 {
        write_stderr(&format!("drum-shim: {msg}\n"));
    }
}

/// Writes with `write(2)` directly: usable from the exit-time destructor, takes no Rust lock.
pub(crate) fn write_stderr(s: &str) {
    let mut b = s.as_bytes();
    while !b.is_empty() {
        // SAFETY: `b` is a valid byte slice for the duration of the call.
        let n = unsafe { libc::write(2, b.as_ptr().cast(), b.len()) };
        if n <= 0 {
            return;
        }
        b = &b[n as usize..];
    }
}

pub(crate) fn set_errno(e: c_int) {
    // SAFETY: __errno_location returns this thread's errno slot.
    unsafe { *libc::__errno_location() = e };
}

/// Runs the shim's part of a CQ or channel verb; `None` (forward to libibverbs) when it is
/// not the shim's object or the shim failed internally (reported once).
pub(crate) fn completions<T, F: FnOnce() -> Option<T>>(f: F) -> Option<T> {
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|_| {
        warn_once(
            Trouble::Completions,
            "internal error in a CQ or completion-channel verb; forwarded unchanged",
        );
        None
    })
}
