//! The development CA of `dev-certs` and its certificate revocation list. Issuing is the
//! coordinator's alone (the daemons only read PEM files, `drum_net::pki`), so rcgen stays out
//! of the agent's build.
//!
//! `dev-certs` keeps the throw-away CA's key (`ca.key`, mode 0600) next to its certificate so
//! that `dev-certs --revoke HOST` can sign a CRL (`crl.pem`) and `dev-certs --reissue HOST`
//! can rotate a host's certificate later. A production CA does both with its own tools; the
//! daemons only read the PEM files.

use drum_net::{NetError, TlsFiles};
use rcgen::{
    BasicConstraints, Certificate, CertificateParams, CertificateRevocationListParams, DnType,
    ExtendedKeyUsagePurpose, IsCa, KeyIdMethod, KeyPair, KeyUsagePurpose, RevokedCertParams,
    SerialNumber,
};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, CertificateRevocationListDer};
use std::path::{Path, PathBuf};

/// Why the dev CA could not issue, revoke or write.
#[derive(Debug, thiserror::Error)]
pub enum CaError {
    #[error("generating certificates: {0}")]
    Rcgen(#[from] rcgen::Error),
    #[error(transparent)]
    Net(#[from] NetError),
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("the system's random source failed")]
    Random,
}

/// The dev CA's parameters. They are fixed, so the CA can be rebuilt from its key alone: a
/// certificate or CRL signed by the rebuilt CA names the same issuer and carries the same
/// key identifier, and verifies against the original `ca.pem`.
fn ca_params() -> Result<CertificateParams, CaError> {
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
    pub fn create(dir: &Path) -> Result<Self, CaError> {
        std::fs::create_dir_all(dir)?;
        let key = KeyPair::generate()?;
        let cert = ca_params()?.self_signed(&key)?;
        std::fs::write(dir.join("ca.pem"), cert.pem())?;
        write_private(&dir.join("ca.key"), key.serialize_pem().as_bytes())?;
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
    pub fn open(dir: &Path) -> Result<Self, CaError> {
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
    ) -> Result<TlsFiles, CaError> {
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
        write_private(&files.key, key.serialize_pem().as_bytes())?;
        replace(&files.cert, cert.pem().as_bytes())?;
        Ok(files)
    }

    /// A client certificate for host `host`, carrying the host id as its DNS name (the
    /// coordinator binds joins to it): `agent-HOST.pem` and `.key`.
    pub fn issue_agent(&self, host: &str) -> Result<TlsFiles, CaError> {
        self.issue(
            &format!("agent-{host}"),
            vec![host.to_string()],
            ExtendedKeyUsagePurpose::ClientAuth,
        )
    }

    /// Adds the current certificate of host `host` (`agent-HOST.pem`) to `crl.pem`, keeping
    /// the serials revoked before; returns the CRL's path.
    pub fn revoke_agent(&self, host: &str) -> Result<PathBuf, CaError> {
        self.revoke(&format!("agent-{host}"))
    }

    /// Adds the current certificate `NAME.pem` (e.g. `coordinator`) to `crl.pem`, as
    /// [`DevCa::revoke_agent`] does.
    pub fn revoke(&self, name: &str) -> Result<PathBuf, CaError> {
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
    fn revoked(&self) -> Result<Vec<Vec<u8>>, CaError> {
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
            .map_err(|e| bad(format!("not a valid CRL: {e}")).into())
    }

    /// Signs a CRL revoking `serials`; its number is the time in seconds, which grows with
    /// every CRL issued (as RFC 5280 asks) without keeping a counter.
    fn write_crl(&self, serials: Vec<Vec<u8>>) -> Result<(), CaError> {
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
fn replace(path: &Path, data: &[u8]) -> Result<(), CaError> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, data)?;
    std::fs::rename(&tmp, path)?;
    Ok(())
}

/// Files written by [`dev_certs`].
pub struct DevCerts {
    pub ca: PathBuf,
    pub coordinator: TlsFiles,
    pub agents: Vec<(String, TlsFiles)>,
    /// The agents' DASR key, `dasr.key` (docs/dasr.md).
    pub dasr_key: PathBuf,
}

/// A throw-away CA (`ca.pem`, its key `ca.key` and an empty CRL `crl.pem`; see
/// [`DevCa`]), a coordinator certificate for `sans` (DNS names or IP addresses) and one
/// client certificate per agent name, and the agents' DASR key `dasr.key` (see
/// [`dasr_key`]). Keys are written with mode 0600.
pub fn dev_certs(dir: &Path, sans: &[String], agents: &[String]) -> Result<DevCerts, CaError> {
    let ca = DevCa::create(dir)?;
    let coordinator = ca.issue(
        "coordinator",
        sans.to_vec(),
        ExtendedKeyUsagePurpose::ServerAuth,
    )?;
    let mut out = Vec::new();
    for a in agents {
        out.push((a.clone(), ca.issue_agent(a)?));
    }
    Ok(DevCerts {
        ca: ca.ca_path(),
        coordinator,
        agents: out,
        dasr_key: dasr_key(dir)?,
    })
}

/// A relay's two certificates: upstream `agent-NAME` (a client certificate naming `name`, as
/// an agent's: the coordinator binds the relay's host id to it), downstream `relay-NAME` (a
/// server certificate for `sans` and `name`, as the coordinator's, for the agents it serves).
pub fn issue_relay(
    ca: &DevCa,
    name: &str,
    sans: &[String],
) -> Result<(TlsFiles, TlsFiles), CaError> {
    let up = ca.issue_agent(name)?;
    let mut names = sans.to_vec();
    names.push(name.to_string());
    let down = ca.issue(
        &format!("relay-{name}"),
        names,
        ExtendedKeyUsagePurpose::ServerAuth,
    )?;
    Ok((up, down))
}

/// Writes `DIR/dasr.key`: 32 random bytes, mode 0600, the key every agent's `[dasr] key_file`
/// names. Random rather than derived from the CA, whose certificate is public.
pub fn dasr_key(dir: &Path) -> Result<PathBuf, CaError> {
    use ring::rand::SecureRandom;
    let mut key = [0u8; 32];
    ring::rand::SystemRandom::new()
        .fill(&mut key)
        .map_err(|_| CaError::Random)?;
    let path = dir.join("dasr.key");
    write_private(&path, &key)?;
    Ok(path)
}

fn write_private(path: &Path, data: &[u8]) -> std::io::Result<()> {
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
