//! SIGINT and SIGTERM end a run in good order: the server stops serving and writes its
//! metrics, the client stops issuing, lets its operations in flight complete and prints its
//! summary (as `iperf` does on Ctrl-C), so a run can be ended from outside without losing
//! what it measured.

use std::sync::atomic::{AtomicBool, Ordering};

static REQUESTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: i32) {
    REQUESTED.store(true, Ordering::Relaxed);
}

/// Routes SIGINT and SIGTERM to [`requested`].
pub fn install() {
    // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
    unsafe {
        libc::signal(libc::SIGINT, on_signal as *const () as usize);
        libc::signal(libc::SIGTERM, on_signal as *const () as usize);
    }
}

/// Whether a stop was asked for.
pub fn requested() -> bool {
    REQUESTED.load(Ordering::Relaxed)
}
