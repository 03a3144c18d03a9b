//! The networked half of DRUM's control plane: QUIC transport with mutual TLS, framed message
//! streams, throw-away development certificates, and the coordinator service that drives the
//! pure state machine of `drum_common::protocol::coordinator` (docs/control-plane.md).
//! `drum-agent` reuses [`net`] for its side of the connection.

pub mod admin;
pub mod http;
pub mod metrics;
pub mod net;
pub mod pki;
pub mod server;
