//! The shim's lock-free code, the very files the shim compiles, built against loom
//! (`cfg(loom)`, set by this crate's build script) so that `tests/` can model-check every
//! interleaving of their atomics. docs/shim.md, "Why the shim's locks are its own spin lock".

#[path = "../../src/spin.rs"]
pub mod spin;
