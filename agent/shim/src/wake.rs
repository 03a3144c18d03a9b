//! The engine thread's handle, by which whoever lists work for it (a post that queues, a
//! gate slot handed on, an event for the agent) wakes it. Its own module so that the
//! governance below the engine can wake it without knowing it.

use crate::spin::SpinLock;
use std::thread::Thread;

/// The engine of this process: (pid, thread). A forked child has no engine thread; the
/// pid tells it to start its own.
pub static ENGINE: SpinLock<Option<(u32, Thread)>> = SpinLock::new(None);

pub fn lock_for_fork() {
    ENGINE.acquire();
}

pub fn unlock_after_fork() {
    ENGINE.release();
}

pub fn wake() {
    if let Some((_, t)) = &*ENGINE.lock() {
        t.unpark();
    }
}
