//! A minimal spin lock (yielding) for the shim's short critical sections. Unlike std's
//! mutex it can be taken and released without a guard object, which is what `pthread_atfork`
//! handlers need: the forking thread holds every such lock across `fork`, so a child never
//! inherits one locked by a thread that does not exist in the child.

//!
//! Model-checked with `loom` (crate `drum-shim-loom`, which builds this file with `cfg(loom)`:
//! loom's atomics, cell and yield instead of std's).

use std::ops::{Deref, DerefMut};
use std::sync::atomic::Ordering::{Acquire, Relaxed, Release};

#[cfg(loom)]
use loom::{
    cell::{MutPtr, UnsafeCell},
    sync::atomic::AtomicBool,
    thread::yield_now,
};
#[cfg(not(loom))]
use std::{cell::UnsafeCell, sync::atomic::AtomicBool, thread::yield_now};

pub struct SpinLock<T> {
    held: AtomicBool,
    data: UnsafeCell<T>,
}

// SAFETY: access to `data` is serialised by `held`.
unsafe impl<T: Send> Sync for SpinLock<T> {}

pub struct SpinGuard<'a, T> {
    lock: &'a SpinLock<T>,
    /// Under loom, the cell's access, tracked for as long as the guard lives (ended before
    /// the lock is released).
    #[cfg(loom)]
    access: Option<MutPtr<T>>,
}

impl<'a, T> SpinGuard<'a, T> {
    /// The guard of a lock just taken.
    fn taken(lock: &'a SpinLock<T>) -> Self {
        SpinGuard {
            lock,
            #[cfg(loom)]
            access: Some(lock.data.get_mut()),
        }
    }
}

impl<T> SpinLock<T> {
    #[cfg(not(loom))]
    pub const fn new(v: T) -> Self {
        SpinLock {
            held: AtomicBool::new(false),
            data: UnsafeCell::new(v),
        }
    }

    #[cfg(loom)]
    pub fn new(v: T) -> Self {
        SpinLock {
            held: AtomicBool::new(false),
            data: UnsafeCell::new(v),
        }
    }

    pub fn lock(&self) -> SpinGuard<'_, T> {
        self.acquire();
        SpinGuard::taken(self)
    }

    /// The lock if it is free now; `None` instead of waiting. (The guard is made only when
    /// the lock was taken: a guard made and dropped on failure would release the holder's.)
    pub fn try_lock(&self) -> Option<SpinGuard<'_, T>> {
        self.held
            .compare_exchange(false, true, Acquire, Relaxed)
            .ok()
            .map(|_| SpinGuard::taken(self))
    }

    /// The lock once it is free, or `None` at `deadline`: for paths that must not wait for
    /// ever, such as the exit summary when `exit` runs in a signal handler that interrupted
    /// this very thread while it held the lock.
    #[cfg(not(loom))]
    pub fn lock_until(&self, deadline: std::time::Instant) -> Option<SpinGuard<'_, T>> {
        loop {
            if let Some(g) = self.try_lock() {
                return Some(g);
            }
            if std::time::Instant::now() >= deadline {
                return None;
            }
            yield_now();
        }
    }

    /// For fork handlers: acquire without a guard; pair with [`SpinLock::release`].
    pub fn acquire(&self) {
        while self
            .held
            .compare_exchange_weak(false, true, Acquire, Relaxed)
            .is_err()
        {
            yield_now();
        }
    }

    pub fn release(&self) {
        self.held.store(false, Release);
    }
}

impl<T> Deref for SpinGuard<'_, T> {
    type Target = T;
    #[cfg(not(loom))]
    fn deref(&self) -> &T {
        // SAFETY: the guard proves the lock is held.
        unsafe { &*self.lock.data.get() }
    }
    #[cfg(loom)]
    fn deref(&self) -> &T {
        let access = self.access.as_ref().expect("a live guard has its access");
        // SAFETY: the guard proves the lock is held; loom checks that it is.
        unsafe { access.deref() }
    }
}

impl<T> DerefMut for SpinGuard<'_, T> {
    #[cfg(not(loom))]
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: the guard proves the lock is held, exclusively.
        unsafe { &mut *self.lock.data.get() }
    }
    #[cfg(loom)]
    fn deref_mut(&mut self) -> &mut T {
        let access = self.access.as_ref().expect("a live guard has its access");
        // SAFETY: the guard proves the lock is held, exclusively; loom checks that it is.
        unsafe { access.deref() }
    }
}

impl<T> Drop for SpinGuard<'_, T> {
    fn drop(&mut self) {
        #[cfg(loom)]
        drop(self.access.take());
        self.lock.release();
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    /// A lock its holder never releases is given up at the deadline, and a free one is
    /// taken at once.
    #[test]
    fn lock_until_gives_up_at_the_deadline() {
        use std::time::{Duration, Instant};
        let l = SpinLock::new(0u32);
        let held = l.lock();
        let start = Instant::now();
        assert!(l.lock_until(start + Duration::from_millis(20)).is_none());
        assert!(start.elapsed() >= Duration::from_millis(20));
        drop(held);
        assert!(l.lock_until(Instant::now()).is_some());
    }

    /// A `try_lock` that fails leaves the lock to its holder.
    #[test]
    fn a_failed_try_lock_leaves_the_lock_held() {
        let l = SpinLock::new(0u32);
        let held = l.lock();
        assert!(l.try_lock().is_none());
        assert!(
            l.try_lock().is_none(),
            "the failed try_lock released the holder's lock"
        );
        drop(held);
        assert!(l.try_lock().is_some());
    }
}
