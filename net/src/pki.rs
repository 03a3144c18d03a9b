//! The daemons' TLS material: where it lives ([`TlsFiles`]), reading it, and the checks a
//! certificate revocation list must pass before a daemon trusts it. Issuing certificates is
//! not here: only the coordinator's `dev-certs` does that (docs/design.md, "Layout").

use crate::error::NetError;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, CertificateRevocationListDer, PrivateKeyDer};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

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
    pub(crate) fn trust(&self) -> Result<(Arc<rustls::RootCertStore>, Vec<CrlDer>), NetError> {
        let ca = load_certs(&self.ca)?;
        let crls = match &self.crl {
            Some(path) => load_crls(path, &ca, &load_certs(&self.cert)?)?,
            None => Vec::new(),
        };
        let mut roots = rustls::RootCertStore::empty();
        for c in ca {
            roots.add(c)?;
        }
        Ok((Arc::new(roots), crls))
    }
}

type CrlDer = CertificateRevocationListDer<'static>;

fn pem_err(path: &Path) -> impl FnOnce(rustls::pki_types::pem::Error) -> NetError + '_ {
    move |error| NetError::Pem {
        path: path.to_path_buf(),
        error,
    }
}

pub(crate) fn load_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, NetError> {
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(pem_err(path))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(pem_err(path))?;
    if certs.is_empty() {
        return Err(NetError::NoCertificate(path.to_path_buf()));
    }
    Ok(certs)
}

pub(crate) fn load_key(path: &Path) -> Result<PrivateKeyDer<'static>, NetError> {
    PrivateKeyDer::from_pem_file(path).map_err(pem_err(path))
}

/// Reads a CRL file (PEM, one or more CRLs) and checks it against the CAs in `ca` and the
/// daemon's own chain `own`: a CRL of another CA would make every peer's revocation status
/// unknown, and so refuse every peer, so it is an error here rather than an outage later.
/// Dev CAs all carry the same name, so the check verifies the CRL's signature, by checking
/// `own` (issued by the same CA in a DRUM cluster) as a handshake would, with these CRLs.
pub fn load_crls(
    path: &Path,
    ca: &[CertificateDer<'static>],
    own: &[CertificateDer<'static>],
) -> Result<Vec<CertificateRevocationListDer<'static>>, NetError> {
    let bad = |what: String| NetError::Crl {
        path: path.to_path_buf(),
        reason: what,
    };
    let crls = CertificateRevocationListDer::pem_file_iter(path)
        .and_then(|it| it.collect::<Result<Vec<_>, _>>())
        .map_err(|e| bad(e.to_string()))?;
    if crls.is_empty() {
        return Err(bad("holds no CRL (a PEM block \"X509 CRL\")".into()));
    }
    let anchors: Vec<_> = ca
        .iter()
        .filter_map(|c| webpki::anchor_from_trusted_cert(c).ok())
        .collect();
    let mut parsed = Vec::with_capacity(crls.len());
    for der in &crls {
        let crl = webpki::BorrowedCertRevocationList::from_der(der.as_ref())
            .map_err(|e| bad(format!("not a valid CRL: {e}")))?;
        let crl = webpki::CertRevocationList::from(crl);
        if !anchors.iter().any(|a| a.subject.as_ref() == crl.issuer()) {
            return Err(bad("is not issued by the configured CA".into()));
        }
        parsed.push(crl);
    }
    let refs: Vec<&webpki::CertRevocationList<'_>> = parsed.iter().collect();
    let revocation = webpki::RevocationOptionsBuilder::new(&refs)
        .expect("at least one CRL")
        .with_expiration_policy(webpki::ExpirationPolicy::Enforce)
        .build();
    let (Some(leaf), intermediates) = (own.first(), own.get(1..).unwrap_or_default()) else {
        return Ok(crls);
    };
    let leaf = webpki::EndEntityCert::try_from(leaf).map_err(|e| NetError::Pki(format!("{e}")))?;
    let algs = rustls::crypto::ring::default_provider()
        .signature_verification_algorithms
        .all;
    let check = |usage: webpki::KeyUsage| {
        leaf.verify_for_usage(
            algs,
            &anchors,
            intermediates,
            rustls::pki_types::UnixTime::now(),
            usage,
            Some(revocation),
            None,
        )
        .map(|_| ())
    };
    // The daemon's own certificate is for serving (coordinator) or for clients (agent).
    use webpki::Error as E;
    let result = match check(webpki::KeyUsage::server_auth()) {
        Err(E::RequiredEkuNotFoundContext(_)) => check(webpki::KeyUsage::client_auth()),
        other => other,
    };
    match result {
        // Our own certificate is from another CA than the peers': nothing to check it with.
        Ok(()) | Err(E::UnknownIssuer | E::RequiredEkuNotFoundContext(_)) => Ok(crls),
        Err(E::CertRevoked) => Err(bad("revokes this daemon's own certificate".into())),
        Err(E::CrlExpired { time, next_update }) => Err(bad(format!(
            "expired {} s ago (its next update was Unix time {}): install a fresh one",
            time.as_secs().saturating_sub(next_update.as_secs()),
            next_update.as_secs()
        ))),
        Err(e) => Err(bad(format!(
            "is not a valid CRL of the configured CA (checking our own certificate: {e:?})"
        ))),
    }
}
