//! The coordinator's half of DRUM's control plane: the service that drives the pure state
//! machine of `drum_common::protocol::coordinator` over `drum-net`'s QUIC transport, its admin
//! endpoint and metrics, and the throw-away development CA of `dev-certs`
//! (docs/control-plane.md).

#![forbid(unsafe_code)]

pub mod admin;
pub mod dev_ca;
pub mod metrics;
pub mod relay;
pub mod server;
