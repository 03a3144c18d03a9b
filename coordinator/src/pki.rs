//! The development CA of `dev-certs`, its certificate revocation list, and the checks a CRL
//! file must pass before a daemon uses it.
//!
//! `dev-certs` keeps the throw-away CA's key (`ca.key`, mode 0600) next to its certificate so
//! that `dev-certs --revoke HOST` can sign a CRL (`crl.pem`) and `dev-certs --reissue HOST`
//! can rotate a host's certificate later. A production CA does both with its own tools; the
//! daemons only read the PEM files.

use crate::net::{NetError, TlsFiles};
use rcgen::{
    BasicConstraints, Certificate, CertificateParams, CertificateRevocationListParams, DnType,
    ExtendedKeyUsagePurpose, IsCa, KeyIdMethod, KeyPair, KeyUsagePurpose, RevokedCertParams,
    SerialNumber,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, CertificateRevocationListDer};
use std::path::{Path, PathBuf};

/// The dev CA's parameters. They are fixed, so the CA can be rebuilt from its key alone: a
/// certificate or CRL signed by the rebuilt CA names the same issuer and carries the same
/// key identifier, and verifies against the original `ca.pem`.
fn ca_params() -> Result<CertificateParams, NetError> {
    let mut p = CertificateParams::new(Vec::<String>::new())?;
    p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    p.distinguished_name
        .push(DnType::CommonName, "DRUM development CA (throw-away)");
    p.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    Ok(p)
}

/// A dev CA: its certificate and key.
pub struct DevCa {
    cert: Certificate,
    key: KeyPair,
    dir: PathBuf,
    crl_days: u32,
}

/// How long a CRL written by [`DevCa`] is valid (days to its next update), unless told.
pub const CRL_DAYS: u32 = 365;

impl DevCa {
    /// CRLs this CA writes from now on are valid for `days` (0: already past their next
    /// update, which daemons refuse).
    pub fn with_crl_days(mut self, days: u32) -> Self {
        self.crl_days = days;
        self
    }

    /// A new CA in `dir`: writes `ca.pem`, `ca.key` (mode 0600) and an empty `crl.pem`.
    pub fn create(dir: &Path) -> Result<Self, NetError> {
        std::fs::create_dir_all(dir)?;
        let key = KeyPair::generate()?;
        let cert = ca_params()?.self_signed(&key)?;
        std::fs::write(dir.join("ca.pem"), cert.pem())?;
        crate::net::write_private(&dir.join("ca.key"), key.serialize_pem().as_bytes())?;
        let ca = Self {
            cert,
            key,
            dir: dir.to_path_buf(),
            crl_days: CRL_DAYS,
        };
        ca.write_crl(Vec::new())?;
        Ok(ca)
    }

    /// The CA `dev-certs` made in `dir`, rebuilt from its key.
    pub fn open(dir: &Path) -> Result<Self, NetError> {
        let key_path = dir.join("ca.key");
        let pem = std::fs::read_to_string(&key_path).map_err(|e| {
            NetError::Pki(format!(
                "reading {}: {e} (only a CA made by `dev-certs --out {}` can revoke or reissue)",
                key_path.display(),
                dir.display()
            ))
        })?;
        let key = KeyPair::from_pem(&pem)?;
        let cert = ca_params()?.self_signed(&key)?;
        Ok(Self {
            cert,
            key,
            dir: dir.to_path_buf(),
            crl_days: CRL_DAYS,
        })
    }

    pub fn ca_path(&self) -> PathBuf {
        self.dir.join("ca.pem")
    }

    pub fn crl_path(&self) -> PathBuf {
        self.dir.join("crl.pem")
    }

    /// Issues `NAME.pem` and `NAME.key` (a fresh key) for `sans` with extended key usage
    /// `usage`, replacing any earlier certificate of that name.
    pub fn issue(
        &self,
        name: &str,
        sans: Vec<String>,
        usage: ExtendedKeyUsagePurpose,
    ) -> Result<TlsFiles, NetError> {
        let mut p = CertificateParams::new(sans)?;
        p.distinguished_name.push(DnType::CommonName, name);
        p.extended_key_usages = vec![usage];
        p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        let key = KeyPair::generate()?;
        let cert = p.signed_by(&key, &self.cert, &self.key)?;
        let files = TlsFiles {
            ca: self.ca_path(),
            cert: self.dir.join(format!("{name}.pem")),
            key: self.dir.join(format!("{name}.key")),
            crl: None,
        };
        // Key first: a reader that sees the new certificate must find its key.
        crate::net::write_private(&files.key, key.serialize_pem().as_bytes())?;
        replace(&files.cert, cert.pem().as_bytes())?;
        Ok(files)
    }

    /// A client certificate for host `host`, carrying the host id as its DNS name (the
    /// coordinator binds joins to it): `agent-HOST.pem` and `.key`.
    pub fn issue_agent(&self, host: &str) -> Result<TlsFiles, NetError> {
        self.issue(
            &format!("agent-{host}"),
            vec![host.to_string()],
            ExtendedKeyUsagePurpose::ClientAuth,
        )
    }

    /// Adds the current certificate of host `host` (`agent-HOST.pem`) to `crl.pem`, keeping
    /// the serials revoked before; returns the CRL's path.
    pub fn revoke_agent(&self, host: &str) -> Result<PathBuf, NetError> {
        self.revoke(&format!("agent-{host}"))
    }

    /// Adds the current certificate `NAME.pem` (e.g. `coordinator`) to `crl.pem`, as
    /// [`DevCa::revoke_agent`] does.
    pub fn revoke(&self, name: &str) -> Result<PathBuf, NetError> {
        let cert_path = self.dir.join(format!("{name}.pem"));
        let der = CertificateDer::from_pem_file(&cert_path).map_err(|error| NetError::Pem {
            path: cert_path.clone(),
            error,
        })?;
        let leaf = webpki::EndEntityCert::try_from(&der)
            .map_err(|e| NetError::Pki(format!("{}: {e}", cert_path.display())))?;
        let serial = minimal(leaf.serial());
        let mut serials = self.revoked()?;
        if !serials.contains(&serial) {
            serials.push(serial);
        }
        self.write_crl(serials)?;
        Ok(self.crl_path())
    }

    /// The serials `crl.pem` revokes (none if it does not exist).
    fn revoked(&self) -> Result<Vec<Vec<u8>>, NetError> {
        let path = self.crl_path();
        if !path.exists() {
            return Ok(Vec::new());
        }
        let bad = |e: String| NetError::Crl {
            path: path.clone(),
            reason: e,
        };
        let der =
            CertificateRevocationListDer::from_pem_file(&path).map_err(|e| bad(e.to_string()))?;
        let crl = webpki::BorrowedCertRevocationList::from_der(der.as_ref())
            .map_err(|e| bad(format!("not a valid CRL: {e}")))?;
        (&crl)
            .into_iter()
            .map(|r| r.map(|r| minimal(r.serial_number)))
            .collect::<Result<_, _>>()
            .map_err(|e| bad(format!("not a valid CRL: {e}")))
    }

    /// Signs a CRL revoking `serials`; its number is the time in seconds, which grows with
    /// every CRL issued (as RFC 5280 asks) without keeping a counter.
    fn write_crl(&self, serials: Vec<Vec<u8>>) -> Result<(), NetError> {
        let now = time::OffsetDateTime::now_utc();
        let number = now.unix_timestamp().max(0) as u64;
        let params = CertificateRevocationListParams {
            // Backdated a minute, as CAs do, so that a peer whose clock is a little behind
            // takes it; with 0 days of validity the CRL is past its next update at once.
            this_update: now - time::Duration::minutes(1),
            // Daemons refuse a CRL past its next update, and every peer it would vouch for:
            // a fresh one must be installed before (`dev-certs --revoke` writes one).
            next_update: now + time::Duration::days(i64::from(self.crl_days)),
            crl_number: SerialNumber::from(number),
            issuing_distribution_point: None,
            revoked_certs: serials
                .into_iter()
                .map(|s| RevokedCertParams {
                    serial_number: SerialNumber::from(s),
                    revocation_time: now,
                    reason_code: None,
                    invalidity_date: None,
                })
                .collect(),
            key_identifier_method: KeyIdMethod::Sha256,
        };
        let crl = params.signed_by(&self.cert, &self.key)?;
        replace(&self.crl_path(), crl.pem()?.as_bytes())?;
        Ok(())
    }
}

/// A serial without the sign byte DER may put in front of it (rcgen adds it back).
fn minimal(serial: &[u8]) -> Vec<u8> {
    let start = serial.iter().take_while(|&&b| b == 0).count();
    serial[start..].to_vec()
}

/// Writes `path` atomically (`PATH.tmp`, then rename), so a daemon reloading meanwhile reads
/// the old file or the new one, never half of one.
fn replace(path: &Path, data: &[u8]) -> Result<(), NetError> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, data)?;
    std::fs::rename(&tmp, path)?;
    Ok(())
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
