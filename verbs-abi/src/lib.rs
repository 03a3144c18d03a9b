//! The libibverbs ABI (rdma-core 44, provider ABI `IBVERBS_PRIVATE_34`) as both sides of
//! libibverbs in this project see it: the shim (interposed above libibverbs, wrapping an
//! application's objects) and softrnic's provider (below it, allocating and filling them).
//! Each structure is declared once, whole, so neither side can drift from the other.
//!
//! `tests::layout_matches_public_headers` compiles one C probe against the installed
//! `<infiniband/verbs.h>` and compares every size and offset either side relies on; the
//! private `driver.h` structures are checked against rdma-core 44's own numbers.
//!
//! Fields nobody reads or writes may be opaque padding of the exact size.

#![forbid(unsafe_code)]

mod driver;
mod extended;
mod verbs;

pub mod consts;

pub use driver::*;
pub use extended::*;
pub use verbs::*;

#[cfg(test)]
mod tests;
