//! Dart's active unique senders (AUSS) and direct rate apportioning (DASR), docs/design.md §4 —
//! the pure core: no sockets, threads or clocks; time is an explicit `now: Duration` and every
//! effect is returned as an action. The agent's `drum_agent::dasr` runs it over UDP;
//! docs/dasr.md describes the protocol.
//!
//! - [`wire`]: the ANNOUNCE and ACK datagrams (versioned fixed layout, hard size limit);
//! - [`auth`]: version 2's MAC under the cluster key and the replay rule;
//! - [`auss`]: the receiver's set, epochs, ACKs and pushes, soft-state expiry;
//! - [`sender`]: announcements with retransmission and refresh, newest cap per destination;
//! - [`congestion`]: the per-receiver congestion state machine (when the cap applies).

pub mod auss;
pub mod auth;
pub mod congestion;
pub mod sender;
pub mod wire;

/// A sender host's identity, carried in every announcement (the agent's `host_id`).
pub type SenderId = u64;

pub use auss::{Auss, AussAction, AussConfig, AussStats};
pub use auth::{DasrKey, Guard, Refusal, KEY_LEN};
pub use congestion::{CongestionConfig, CongestionDetector, CongestionState};
pub use sender::{CapView, SenderAction, SenderConfig, SenderCore, SenderStats};
pub use wire::{Ack, Announce, Datagram, Lookahead, Phase, WireError};
