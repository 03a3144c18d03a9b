//! The interface between `drum-agent` and `libdrum_shim.so` on one host (docs/design.md §7):
//!
//! - [`message`]: what travels over the agent's Unix socket (registration, QP and message
//!   events), as bounded, versioned text datagrams;
//! - [`layout`]: the per-app shared-memory table: grants written by the agent, counters
//!   written by the shim, one writer per field;
//! - [`mapping`]: creating, passing and mapping the table's memory (a memfd);
//! - [`socket`]: the registration socket (Unix `SOCK_SEQPACKET`);
//! - [`profile`]: what both sides read from an app's WQE counters;
//! - [`seqlock`]: how a grant's fields are written and read as one;
//! - [`nic_auss`]: the table a NIC running AUSS in its ACKs (softrnic) publishes each
//!   destination's active unique senders in, which the shim reads to cap QPs at R/N;
//! - [`wire_cost`]: what a payload byte costs on the wire, for the agent's grants and the
//!   shim's NIC pacing alike.
//!
//! Both sides link this crate, so they cannot disagree about a layout or an encoding.
//! See docs/shim.md, "The agent link".

pub mod auss_log;
pub mod layout;
pub mod mapping;
pub mod message;
pub mod nic_auss;
pub mod profile;
pub mod seqlock;
pub mod socket;
pub mod wire_cost;
