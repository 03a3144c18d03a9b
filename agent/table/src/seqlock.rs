//! The grant's sequence lock. One writer (the agent, under its hub's lock) updates several
//! fields that readers in other processes (the shims) need as one consistent grant, and a
//! reader must never make the writer wait. The sequence is even when no write is under way
//! and odd during one: a reader that saw the same even value before and after its reads has
//! values of one write, never a mix of two. (Bumping only after the write, as the table did
//! until 2026-11-27, let a reader that started before a write and finished before its bump
//! take new and old fields together.) The generation the table reports is the sequence / 2:
//! one more per completed write.
//!
//! Model-checked with `loom` (crate `drum-shim-loom` builds this file with `cfg(loom)`).

use std::sync::atomic::Ordering::{Acquire, Relaxed, Release};

#[cfg(loom)]
use loom::sync::atomic::{fence, AtomicU64};
#[cfg(not(loom))]
use std::sync::atomic::{fence, AtomicU64};

/// Marks a write under way; returns what [`write_end`] needs. The fields are written after.
/// A sequence left odd (a writer that died mid-write) stays odd until the next write ends.
pub fn write_begin(seq: &AtomicU64) -> u64 {
    let s = seq.load(Relaxed);
    let odd = if s % 2 == 0 {
        s.wrapping_add(1)
    } else {
        s.wrapping_add(2)
    };
    seq.store(odd, Relaxed);
    // The fields' stores that follow are not seen before the odd sequence.
    fence(Release);
    odd
}

/// Ends the write begun with `odd`: its fields are published together.
pub fn write_end(seq: &AtomicU64, odd: u64) {
    seq.store(odd.wrapping_add(1), Release);
}

/// Reads with `read` (Relaxed loads of the fields) until a read sees no write under way and
/// none completed during it, at most `tries` times. The generation and the values, or None
/// if every try overlapped a write.
pub fn read<T>(seq: &AtomicU64, tries: usize, read: impl Fn() -> T) -> Option<(u64, T)> {
    for _ in 0..tries {
        let before = seq.load(Acquire);
        if before % 2 == 1 {
            continue;
        }
        let v = read();
        // The fields' loads above are not moved after the check below.
        fence(Acquire);
        if seq.load(Relaxed) == before {
            return Some((before / 2, v));
        }
    }
    None
}

/// The generation now (completed writes), without reading the fields.
pub fn generation(seq: &AtomicU64) -> u64 {
    seq.load(Acquire) / 2
}
