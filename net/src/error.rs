//! What can go wrong loading TLS material and speaking QUIC, one type for the whole crate.

use drum_common::protocol::wire::WireError;
use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum NetError {
    // Not a `source`: the message already carries it, and error chains printed in full
    // (`{:#}`) would say it twice.
    #[error("reading {path}: {error}")]
    Pem {
        path: PathBuf,
        error: rustls::pki_types::pem::Error,
    },
    #[error("{0} holds no certificate")]
    NoCertificate(PathBuf),
    #[error("TLS configuration: {0}")]
    Tls(#[from] rustls::Error),
    #[error("client certificate verifier: {0}")]
    Verifier(#[from] rustls::server::VerifierBuilderError),
    #[error("QUIC crypto configuration: {0}")]
    QuicCrypto(String),
    #[error("socket: {0}")]
    Io(#[from] std::io::Error),
    #[error("connecting: {0}")]
    Connect(#[from] quinn::ConnectError),
    #[error("connection: {0}")]
    Connection(#[from] quinn::ConnectionError),
    #[error("writing: {0}")]
    Write(#[from] quinn::WriteError),
    #[error("reading: {0}")]
    Read(#[from] quinn::ReadError),
    #[error("refused frame: {0}")]
    Wire(#[from] WireError),
    #[error("certificate revocation list {path}: {reason}")]
    Crl { path: PathBuf, reason: String },
    #[error("{0}")]
    Pki(String),
}
