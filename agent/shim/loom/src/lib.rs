//! The lock-free code of the shim and its table, the very files they compile, built against loom
//! (`cfg(loom)`, set by this crate's build script) so that `tests/` can model-check every
//! interleaving of their atomics. docs/shim.md, "Why the shim's locks are its own spin lock".

#[path = "../../src/spin.rs"]
pub mod spin;

#[path = "../../../table/src/seqlock.rs"]
pub mod seqlock;
