//! An eventfd that wakes a thread sleeping in `poll(2)` on completion channels when work for
//! it arrives some other way: a new connection for a server poller, a completion another
//! thread polled and routed to a client thread's connection (SHARE mode).

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

pub struct Wake(OwnedFd);

impl Wake {
    pub fn new() -> anyhow::Result<Wake> {
        // SAFETY: no pointers; the descriptor is owned from here on.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        anyhow::ensure!(fd >= 0, "eventfd: {}", std::io::Error::last_os_error());
        // SAFETY: a fresh descriptor nobody else owns.
        Ok(Wake(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    pub fn ring(&self) {
        let one = 1u64;
        // SAFETY: writes 8 bytes from a live u64 to our eventfd.
        unsafe { libc::write(self.fd(), (&one as *const u64).cast(), 8) };
    }

    /// Takes the rings so far (the sleeper then looks for its work).
    pub fn clear(&self) {
        let mut v = 0u64;
        // SAFETY: reads 8 bytes into a live u64 (non-blocking).
        unsafe { libc::read(self.fd(), (&mut v as *mut u64).cast(), 8) };
    }

    pub fn fd(&self) -> i32 {
        self.0.as_raw_fd()
    }
}
