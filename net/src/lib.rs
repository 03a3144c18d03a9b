//! The network plumbing both DRUM daemons share: QUIC with mutual TLS and framed messages
//! ([`quic`]), their TLS material and certificate revocation lists ([`pki`]), the HTTP
//! transport of their admin and metrics endpoints ([`http`]), and reading their configs and
//! instance files ([`config`]). What the messages and endpoints mean is the daemons' own
//! (docs/control-plane.md); `quic` builds on `pki`, never the other way round.

#![forbid(unsafe_code)]

pub mod config;
pub mod error;
pub mod http;
pub mod pki;
pub mod quic;

pub use error::NetError;
pub use pki::TlsFiles;
