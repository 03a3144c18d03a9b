//! QUIC endpoints with mutual TLS (rustls, TLS 1.3 only, ring provider) and framed message
//! streams: the transport between the agents and the coordinator.

use crate::error::NetError;
use crate::pki::{load_certs, load_key, TlsFiles};
use drum_common::protocol::wire::{encode, FrameDecoder, WireError};
use rustls::pki_types::CertificateDer;
use serde::de::DeserializeOwned;
use serde::Serialize;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

/// ALPN of protocol version 8 (`PROTOCOL_VERSION`); a peer speaking anything else, such as a
/// version-3 agent (`drum/3`), fails the handshake.
pub const ALPN: &[u8] = b"drum/8";
/// QUIC application error codes used when closing a connection.
pub const CLOSE_NORMAL: u32 = 0;
pub const CLOSE_PROTOCOL: u32 = 1;
/// The peer fell silent past its heartbeat timeout: not a violation (a partition that heals
/// before QUIC's idle timeout delivers this close to a well-behaved agent).
pub const CLOSE_TIMEOUT: u32 = 2;

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn transport(idle: Duration) -> Arc<quinn::TransportConfig> {
    let mut t = quinn::TransportConfig::default();
    t.max_idle_timeout(quinn::IdleTimeout::try_from(idle).ok());
    t.keep_alive_interval(Some(idle / 3));
    Arc::new(t)
}

/// The coordinator's TLS: the QUIC server config, and the client verifier it uses, kept to
/// check established connections again after a reload (a revoked agent must not stay).
pub struct ServerTls {
    pub config: quinn::ServerConfig,
    verifier: Arc<dyn rustls::server::danger::ClientCertVerifier>,
}

impl ServerTls {
    /// Reads `tls`: accept only clients whose certificate chains to `tls.ca` and is not
    /// revoked by `tls.crl`.
    pub fn load(tls: &TlsFiles, idle: Duration) -> Result<Self, NetError> {
        let (roots, crls) = tls.trust()?;
        let verifier =
            rustls::server::WebPkiClientVerifier::builder_with_provider(roots, provider())
                .with_crls(crls)
                .enforce_revocation_expiration()
                .build()?;
        let mut crypto = rustls::ServerConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .with_client_cert_verifier(verifier.clone())
            .with_single_cert(load_certs(&tls.cert)?, load_key(&tls.key)?)?;
        crypto.alpn_protocols = vec![ALPN.to_vec()];
        let crypto = quinn::crypto::rustls::QuicServerConfig::try_from(crypto)
            .map_err(|e| NetError::QuicCrypto(e.to_string()))?;
        let mut config = quinn::ServerConfig::with_crypto(Arc::new(crypto));
        config.transport_config(transport(idle));
        Ok(Self { config, verifier })
    }

    /// Whether the peer of an established connection would be accepted now: its chain
    /// checked as in a handshake, against this CA and CRL.
    pub fn check_peer(&self, conn: &quinn::Connection) -> Result<(), String> {
        let chain = conn
            .peer_identity()
            .and_then(|i| i.downcast::<Vec<CertificateDer<'static>>>().ok())
            .ok_or("no client certificate")?;
        let (leaf, intermediates) = chain.split_first().ok_or("empty certificate chain")?;
        self.verifier
            .verify_client_cert(leaf, intermediates, rustls::pki_types::UnixTime::now())
            .map(|_| ())
            .map_err(|e| e.to_string())
    }
}

/// A server endpoint with [`ServerTls::load`]'s config.
pub fn server_endpoint(
    tls: &TlsFiles,
    listen: SocketAddr,
    idle: Duration,
) -> Result<quinn::Endpoint, NetError> {
    let cfg = ServerTls::load(tls, idle)?.config;
    let runtime = quinn::default_runtime()
        .ok_or_else(|| std::io::Error::other("no async runtime for the QUIC endpoint"))?;
    Ok(quinn::Endpoint::new(
        quinn::EndpointConfig::default(),
        Some(cfg),
        server_socket(listen)?,
        runtime,
    )?)
}

/// Socket buffer the coordinator asks for. Every agent answers a round at the same moment; with
/// the kernel's default (~208 KiB) a burst from a few hundred agents overflows it, and the lost
/// datagrams cost a QUIC loss-recovery timeout each (measured: p50 round time 169 ms instead of
/// a few ms at 1,000 agents). The kernel caps the request at `net.core.rmem_max`.
pub const SOCKET_BUFFER: usize = 8 << 20;

fn server_socket(listen: SocketAddr) -> Result<std::net::UdpSocket, NetError> {
    use socket2::{Domain, Protocol, Socket, Type};
    let socket = Socket::new(
        Domain::for_address(listen),
        Type::DGRAM,
        Some(Protocol::UDP),
    )?;
    // Failing to enlarge the buffers costs latency, not correctness: keep going.
    let _ = socket.set_recv_buffer_size(SOCKET_BUFFER);
    let _ = socket.set_send_buffer_size(SOCKET_BUFFER);
    let got = socket.recv_buffer_size().unwrap_or(0);
    if got < (1 << 20) {
        tracing::warn!(
            bytes = got,
            "UDP receive buffer is small; raise net.core.rmem_max for large clusters"
        );
    }
    socket.bind(&listen.into())?;
    Ok(socket.into())
}

/// A client config presenting `tls.cert` and trusting only servers whose certificate chains
/// to `tls.ca` and is not revoked by `tls.crl`. Connections made after
/// `Endpoint::set_default_client_config` use a reloaded one; established ones go on unless
/// the holder checks them with [`ClientTls::check_peer`].
pub fn client_config(tls: &TlsFiles, idle: Duration) -> Result<quinn::ClientConfig, NetError> {
    Ok(ClientTls::load(tls, idle)?.config)
}

/// A client config and the verifier inside it, kept so that an agent can check its
/// established connections again after a reload (a revoked coordinator must not stay).
#[derive(Clone)]
pub struct ClientTls {
    pub config: quinn::ClientConfig,
    verifier: Arc<rustls::client::WebPkiServerVerifier>,
}

impl ClientTls {
    /// Reads `tls` (see [`client_config`]).
    pub fn load(tls: &TlsFiles, idle: Duration) -> Result<Self, NetError> {
        let (roots, crls) = tls.trust()?;
        let verifier =
            rustls::client::WebPkiServerVerifier::builder_with_provider(roots, provider())
                .with_crls(crls)
                .enforce_revocation_expiration()
                .build()?;
        let mut crypto = rustls::ClientConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .with_webpki_verifier(verifier.clone())
            .with_client_auth_cert(load_certs(&tls.cert)?, load_key(&tls.key)?)?;
        crypto.alpn_protocols = vec![ALPN.to_vec()];
        let crypto = quinn::crypto::rustls::QuicClientConfig::try_from(crypto)
            .map_err(|e| NetError::QuicCrypto(e.to_string()))?;
        let mut config = quinn::ClientConfig::new(Arc::new(crypto));
        config.transport_config(transport(idle));
        Ok(Self { config, verifier })
    }

    /// Whether the server of an established connection would be accepted now, as
    /// `server_name`: its chain checked as in a handshake, against this CA and CRL.
    pub fn check_peer(&self, conn: &quinn::Connection, server_name: &str) -> Result<(), String> {
        use rustls::client::danger::ServerCertVerifier;
        let chain = conn
            .peer_identity()
            .and_then(|i| i.downcast::<Vec<CertificateDer<'static>>>().ok())
            .ok_or("no server certificate")?;
        let (leaf, intermediates) = chain.split_first().ok_or("empty certificate chain")?;
        let name = rustls::pki_types::ServerName::try_from(server_name.to_string())
            .map_err(|e| e.to_string())?;
        self.verifier
            .verify_server_cert(
                leaf,
                intermediates,
                &name,
                &[],
                rustls::pki_types::UnixTime::now(),
            )
            .map(|_| ())
            .map_err(|e| e.to_string())
    }
}

/// A client endpoint with [`client_config`].
pub fn client_endpoint(tls: &TlsFiles, idle: Duration) -> Result<quinn::Endpoint, NetError> {
    let mut ep = bare_client_endpoint()?;
    ep.set_default_client_config(client_config(tls, idle)?);
    Ok(ep)
}

/// A client endpoint without a default config: every connection names its own
/// (`Endpoint::connect_with`), as an agent that reloads its certificates does.
pub fn bare_client_endpoint() -> Result<quinn::Endpoint, NetError> {
    let bind: SocketAddr = "0.0.0.0:0".parse().expect("valid address");
    Ok(quinn::Endpoint::client(bind)?)
}

/// Writes one framed message.
pub async fn send_msg<M: Serialize>(send: &mut quinn::SendStream, msg: &M) -> Result<(), NetError> {
    send.write_all(&encode(msg)?).await.map_err(|e| match e {
        // The connection's own error says why (closed by peer with a reason, TLS alert, ...).
        quinn::WriteError::ConnectionLost(c) => NetError::Connection(c),
        other => NetError::Write(other),
    })
}

/// Reads framed messages from a QUIC stream.
pub struct FramedRecv {
    recv: quinn::RecvStream,
    dec: FrameDecoder,
    buf: Vec<u8>,
}

impl FramedRecv {
    pub fn new(recv: quinn::RecvStream) -> Self {
        Self {
            recv,
            dec: FrameDecoder::new(),
            buf: vec![0; 16 * 1024],
        }
    }

    /// The next message; `Ok(None)` when the peer finished the stream cleanly.
    pub async fn next<M: DeserializeOwned>(&mut self) -> Result<Option<M>, NetError> {
        loop {
            if let Some(m) = self.dec.next_msg()? {
                return Ok(Some(m));
            }
            let read = self.recv.read(&mut self.buf).await.map_err(|e| match e {
                quinn::ReadError::ConnectionLost(c) => NetError::Connection(c),
                other => NetError::Read(other),
            })?;
            match read {
                Some(n) => self.dec.push(&self.buf[..n]),
                None if self.dec.buffered() == 0 => return Ok(None),
                None => {
                    return Err(WireError::Malformed(format!(
                        "stream ended inside a frame ({} bytes buffered)",
                        self.dec.buffered()
                    ))
                    .into())
                }
            }
        }
    }
}

/// Whether the peer's (already verified) leaf certificate carries `host` as a DNS name.
pub fn certificate_names(conn: &quinn::Connection, host: &str) -> bool {
    let Some(identity) = conn.peer_identity() else {
        return false;
    };
    let Ok(chain) = identity.downcast::<Vec<CertificateDer<'static>>>() else {
        return false;
    };
    let Some(leaf) = chain.first() else {
        return false;
    };
    let Ok(name) = rustls::pki_types::ServerName::try_from(host) else {
        return false;
    };
    webpki::EndEntityCert::try_from(leaf)
        .is_ok_and(|c| c.verify_is_valid_for_subject_name(&name).is_ok())
}
