//! QUIC endpoints with mutual TLS (rustls, TLS 1.3 only, ring provider), framed streams, and
//! development certificates.

use drum_common::protocol::wire::{encode, FrameDecoder, WireError};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use serde::de::DeserializeOwned;
use serde::Serialize;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// Logs to stderr, filtered by `DRUM_LOG` (default `info`), coloured only on a terminal: the
/// daemons' common setup.
pub fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("DRUM_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
}

/// ALPN of protocol version 6 (`PROTOCOL_VERSION`); a peer speaking anything else, such as a
/// version-3 agent (`drum/3`), fails the handshake.
pub const ALPN: &[u8] = b"drum/6";
/// QUIC application error codes used when closing a connection.
pub const CLOSE_NORMAL: u32 = 0;
pub const CLOSE_PROTOCOL: u32 = 1;

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
    #[error("generating certificates: {0}")]
    Rcgen(#[from] rcgen::Error),
    #[error("certificate revocation list {path}: {reason}")]
    Crl { path: PathBuf, reason: String },
    #[error("{0}")]
    Pki(String),
}

/// Paths of a party's TLS material: the CA that signs every peer, its own chain and key, and
/// optionally a certificate revocation list of that CA. All are read again on a reload.
#[derive(Clone, Debug, serde::Deserialize, serde::Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct TlsFiles {
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
    /// PEM file of CRLs issued by `ca`: a peer whose certificate it lists is refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub crl: Option<PathBuf>,
}

/// How often the daemons look at their TLS files for changes ([`TlsFiles::watch`]).
pub const TLS_WATCH_PERIOD: Duration = Duration::from_secs(2);

impl TlsFiles {
    /// Resolves relative paths against `base`, the directory of the config file naming them.
    pub fn rebase(&mut self, base: &Path) {
        for p in [&mut self.ca, &mut self.cert, &mut self.key]
            .into_iter()
            .chain(self.crl.as_mut())
        {
            *p = base.join(&*p);
        }
    }

    /// The files, in a fixed order.
    fn paths(&self) -> impl Iterator<Item = &Path> {
        [&self.ca, &self.cert, &self.key]
            .into_iter()
            .chain(self.crl.as_ref())
            .map(PathBuf::as_path)
    }

    /// Watches the files: when one is replaced or rewritten (its modification time, size or
    /// inode changes, checked every [`TLS_WATCH_PERIOD`]), `reload` is notified, as on
    /// SIGHUP — a rotated certificate or a new CRL takes effect without `systemctl reload`.
    pub fn watch(&self, reload: Arc<tokio::sync::Notify>) -> tokio::task::JoinHandle<()> {
        let paths: Vec<PathBuf> = self.paths().map(Path::to_path_buf).collect();
        let stamps = move || -> Vec<Option<(Option<std::time::SystemTime>, u64, u64)>> {
            use std::os::unix::fs::MetadataExt;
            paths
                .iter()
                .map(|p| {
                    let m = std::fs::metadata(p).ok()?;
                    Some((m.modified().ok(), m.len(), m.ino()))
                })
                .collect()
        };
        tokio::spawn(async move {
            let mut seen = stamps();
            loop {
                tokio::time::sleep(TLS_WATCH_PERIOD).await;
                let now = stamps();
                if now != seen {
                    seen = now;
                    tracing::info!("a TLS file changed on disk: reloading");
                    reload.notify_one();
                }
            }
        })
    }

    /// The CA certificates and, if configured, the CRLs (checked against those CAs).
    fn trust(&self) -> Result<(Arc<rustls::RootCertStore>, Vec<CrlDer>), NetError> {
        let ca = load_certs(&self.ca)?;
        let crls = match &self.crl {
            Some(path) => crate::pki::load_crls(path, &ca, &load_certs(&self.cert)?)?,
            None => Vec::new(),
        };
        let mut roots = rustls::RootCertStore::empty();
        for c in ca {
            roots.add(c)?;
        }
        Ok((Arc::new(roots), crls))
    }
}

type CrlDer = rustls::pki_types::CertificateRevocationListDer<'static>;

/// Reads a daemon's TOML config; returns it with the directory its relative paths are relative to.
pub fn load_config<T: DeserializeOwned>(path: &Path) -> anyhow::Result<(T, PathBuf)> {
    use anyhow::Context;
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let config = toml::from_str(&text).with_context(|| format!("in {}", path.display()))?;
    Ok((
        config,
        path.parent().unwrap_or(Path::new(".")).to_path_buf(),
    ))
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn pem_err(path: &Path) -> impl FnOnce(rustls::pki_types::pem::Error) -> NetError + '_ {
    move |error| NetError::Pem {
        path: path.to_path_buf(),
        error,
    }
}

fn load_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, NetError> {
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(pem_err(path))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(pem_err(path))?;
    if certs.is_empty() {
        return Err(NetError::NoCertificate(path.to_path_buf()));
    }
    Ok(certs)
}

fn load_key(path: &Path) -> Result<PrivateKeyDer<'static>, NetError> {
    PrivateKeyDer::from_pem_file(path).map_err(pem_err(path))
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

/// Files written by [`dev_certs`].
pub struct DevCerts {
    pub ca: PathBuf,
    pub coordinator: TlsFiles,
    pub agents: Vec<(String, TlsFiles)>,
}

/// A throw-away CA (`ca.pem`, its key `ca.key` and an empty CRL `crl.pem`; see
/// [`crate::pki`]), a coordinator certificate for `sans` (DNS names or IP addresses) and one
/// client certificate per agent name. Keys are written with mode 0600.
pub fn dev_certs(dir: &Path, sans: &[String], agents: &[String]) -> Result<DevCerts, NetError> {
    let ca = crate::pki::DevCa::create(dir)?;
    let coordinator = ca.issue(
        "coordinator",
        sans.to_vec(),
        rcgen::ExtendedKeyUsagePurpose::ServerAuth,
    )?;
    let mut out = Vec::new();
    for a in agents {
        out.push((a.clone(), ca.issue_agent(a)?));
    }
    Ok(DevCerts {
        ca: ca.ca_path(),
        coordinator,
        agents: out,
    })
}

pub(crate) fn write_private(path: &Path, data: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)?;
    f.write_all(data)
}
