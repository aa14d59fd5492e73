//! A serving certificate that is replaced under running connections, never by a restart: PEM
//! files (a mounted cert-manager or `kubernetes.io/tls` Secret) reread while they change, or
//! PEM held in memory. Shared by the operator's External Metrics API and ferrite-router.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::pin;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::rustls::crypto::CryptoProvider;
use tokio_rustls::rustls::server::{ClientHello, ResolvesServerCert};
use tokio_rustls::rustls::sign::CertifiedKey;
use tokio_rustls::rustls::{self, ServerConfig};

/// Why a certificate could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum CertError {
    #[error("reading {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("parsing {path}: {source}")]
    Pem {
        path: PathBuf,
        #[source]
        source: rustls_pki_types::pem::Error,
    },
    #[error("{0} holds no certificate")]
    NoCertificate(PathBuf),
    #[error("{0}")]
    Refused(String),
    #[error("TLS configuration: {0}")]
    Rustls(#[from] rustls::Error),
}

/// A check of a certificate chain's PEM beyond parsing (the operator's: X.509 v3 only).
pub type Check = fn(&[u8], &str) -> Result<(), String>;

/// The certificate presented to new handshakes and its PEM, replaced together.
#[derive(Debug)]
struct Current(RwLock<(Arc<CertifiedKey>, String)>);

impl ResolvesServerCert for Current {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        self.0.read().ok().map(|c| c.0.clone())
    }
}

/// The serving certificate, cheap to clone; every clone presents the same one.
#[derive(Debug, Clone)]
pub struct ServingCert {
    current: Arc<Current>,
    provider: Arc<CryptoProvider>,
    check: Option<Check>,
}

impl ServingCert {
    /// From PEM files.
    pub fn from_files(cert: &Path, key: &Path, check: Option<Check>) -> Result<Self, CertError> {
        let (cert_pem, key_pem) = (read(cert)?, read(key)?);
        Self::build(&cert_pem, &key_pem, cert, key, check)
    }

    /// From PEM text held in memory.
    pub fn from_pem(
        cert_pem: &str,
        key_pem: &str,
        check: Option<Check>,
    ) -> Result<Self, CertError> {
        let memory = Path::new("<in memory>");
        Self::build(cert_pem, key_pem, memory, memory, check)
    }

    fn build(
        cert_pem: &str,
        key_pem: &str,
        cert_path: &Path,
        key_path: &Path,
        check: Option<Check>,
    ) -> Result<Self, CertError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let certified = certified(&provider, cert_pem, key_pem, cert_path, key_path, check)?;
        Ok(ServingCert {
            current: Arc::new(Current(RwLock::new((certified, cert_pem.to_string())))),
            provider,
            check,
        })
    }

    /// Presents `cert_pem`/`key_pem` from the next handshake on; the old certificate stays if
    /// the new one does not load or does not match its key.
    pub fn replace(&self, cert_pem: &str, key_pem: &str, source: &Path) -> Result<(), CertError> {
        let certified = certified(
            &self.provider,
            cert_pem,
            key_pem,
            source,
            source,
            self.check,
        )?;
        if let Ok(mut c) = self.current.0.write() {
            *c = (certified, cert_pem.to_string());
        }
        Ok(())
    }

    /// The PEM of the certificate (chain) presented now.
    pub fn cert_pem(&self) -> String {
        self.current
            .0
            .read()
            .map(|c| c.1.clone())
            .unwrap_or_default()
    }

    /// A rustls server configuration presenting this certificate (whatever it is replaced
    /// with), with `alpn` protocols; `clients` verifies client certificates where set.
    pub fn server_config(
        &self,
        clients: Option<Arc<dyn rustls::server::danger::ClientCertVerifier>>,
        alpn: &[&[u8]],
    ) -> Result<ServerConfig, CertError> {
        let builder = ServerConfig::builder_with_provider(self.provider.clone())
            .with_safe_default_protocol_versions()?;
        let builder = match clients {
            Some(v) => builder.with_client_cert_verifier(v),
            None => builder.with_no_client_auth(),
        };
        let mut config = builder.with_cert_resolver(self.current.clone());
        config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        Ok(config)
    }

    /// Rereads `cert` and `key` every `period` until `shutdown`, and presents them when their
    /// contents change: a kubelet updates a mounted Secret by swapping a symlink, so comparing
    /// contents (not modification times) catches every renewal. A pair that does not load (the
    /// two files caught between writes) is retried at the next poll.
    pub async fn watch_files(
        self,
        cert: PathBuf,
        key: PathBuf,
        period: Duration,
        shutdown: impl Future<Output = ()>,
    ) {
        let read_both = || {
            (
                std::fs::read(&cert).unwrap_or_default(),
                std::fs::read(&key).unwrap_or_default(),
            )
        };
        let mut loaded = read_both();
        let mut shutdown = pin!(shutdown);
        loop {
            tokio::select! {
                () = &mut shutdown => return,
                () = tokio::time::sleep(period) => {}
            }
            let now = read_both();
            if now == loaded {
                continue;
            }
            let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
            match self.replace(&text(&now.0), &text(&now.1), &cert) {
                Ok(()) => {
                    tracing::info!(cert = %cert.display(), "serving the renewed certificate");
                    loaded = now;
                }
                Err(e) => {
                    tracing::warn!(cert = %cert.display(), error = %e, "the changed certificate does not load yet; keeping the previous one");
                }
            }
        }
    }
}

fn read(path: &Path) -> Result<String, CertError> {
    std::fs::read_to_string(path).map_err(|source| CertError::Read {
        path: path.to_path_buf(),
        source,
    })
}

/// A certificate chain and its key, parsed from PEM, checked, and matched.
fn certified(
    provider: &CryptoProvider,
    cert_pem: &str,
    key_pem: &str,
    cert_path: &Path,
    key_path: &Path,
    check: Option<Check>,
) -> Result<Arc<CertifiedKey>, CertError> {
    let chain = CertificateDer::pem_slice_iter(cert_pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|source| CertError::Pem {
            path: cert_path.to_path_buf(),
            source,
        })?;
    if chain.is_empty() {
        return Err(CertError::NoCertificate(cert_path.to_path_buf()));
    }
    if let Some(check) = check {
        let what = format!("the serving certificate {}", cert_path.display());
        check(cert_pem.as_bytes(), &what).map_err(CertError::Refused)?;
    }
    let key =
        PrivateKeyDer::from_pem_slice(key_pem.as_bytes()).map_err(|source| CertError::Pem {
            path: key_path.to_path_buf(),
            source,
        })?;
    let signer = provider.key_provider.load_private_key(key)?;
    let certified = CertifiedKey::new(chain, signer);
    certified.keys_match()?;
    Ok(Arc::new(certified))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair(name: &str) -> (String, String) {
        let key = rcgen::KeyPair::generate().expect("key");
        let cert = rcgen::CertificateParams::new(vec![name.to_string()])
            .expect("params")
            .self_signed(&key)
            .expect("cert");
        (cert.pem(), key.serialize_pem())
    }

    #[test]
    fn a_replacement_that_does_not_load_keeps_the_certificate() {
        let (cert, key) = pair("a.example");
        let serving = ServingCert::from_pem(&cert, &key, None).expect("loads");
        let (other_cert, other_key) = pair("b.example");
        // A certificate with another's key is refused; the first stays.
        let mixed = serving.replace(&other_cert, &key, Path::new("x"));
        assert!(matches!(mixed, Err(CertError::Rustls(_))), "{mixed:?}");
        assert_eq!(serving.cert_pem(), cert);
        assert!(matches!(
            serving.replace("", &key, Path::new("x")),
            Err(CertError::NoCertificate(_))
        ));
        serving
            .replace(&other_cert, &other_key, Path::new("x"))
            .expect("a matching pair");
        assert_eq!(serving.cert_pem(), other_cert);
        // A check of the caller's refuses what it does not take.
        let refuse: Check = |_, what| Err(format!("{what}: no"));
        let checked = ServingCert::from_pem(&cert, &key, Some(refuse));
        assert!(matches!(checked, Err(CertError::Refused(_))));
    }
}
