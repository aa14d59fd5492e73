//! HTTPS for the External Metrics API: the serving certificate (PEM files, e.g. a cert-manager
//! Secret, reloaded when they change; one the operator keeps in a Secret of its own, see
//! `keeper`; or self-signed at start), client certificates checked against the request-header
//! CA of [`ClientAuth`], and a hyper server over rustls. The certificate is swapped under
//! running connections, never by a restart. It knows nothing of the API it serves: each request
//! carries the [`Verdict`] of [`ClientAuth`] for its connection's certificate, and the API
//! applies it to the paths that need it.

use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::pin::pin;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use axum::Router;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls::crypto::CryptoProvider;
use tokio_rustls::rustls::server::{ClientHello, ResolvesServerCert};
use tokio_rustls::rustls::sign::CertifiedKey;
use tokio_rustls::rustls::{self, ServerConfig};

use super::authn::ClientAuth;
pub use super::authn::Verdict;
use crate::certs::subject_common_name;
use tower::ServiceExt;

/// A slow or silent client cannot hold a connection task forever.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(30);
/// How long open connections get to finish after shutdown starts.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// Where the serving certificate comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CertSource {
    /// PEM files (certificate chain and private key), read at start and again whenever they
    /// change (cert-manager renewing a mounted Secret).
    Files { cert: PathBuf, key: PathBuf },
    /// A certificate made at start for these DNS names or IP addresses. Trust it through
    /// [`ServerTls::cert_pem`] (the APIService's `caBundle`) or `insecureSkipTLSVerify`.
    SelfSigned { names: Vec<String> },
}

/// How [`serve_tls`] does TLS.
#[derive(Debug, Clone)]
pub struct TlsSettings {
    pub cert: CertSource,
    /// Which clients may read `/apis`.
    pub clients: Arc<ClientAuth>,
}

impl TlsSettings {
    /// From `--tls-cert-file`/`--tls-key-file`-style flags: both files, or neither for a
    /// self-signed certificate for `names` (see [`service_names`]).
    pub fn from_flags(
        cert_file: Option<PathBuf>,
        key_file: Option<PathBuf>,
        names: Vec<String>,
        clients: Arc<ClientAuth>,
    ) -> Result<Self, TlsError> {
        let cert = match (cert_file, key_file) {
            (Some(cert), Some(key)) => CertSource::Files { cert, key },
            (None, None) => CertSource::SelfSigned { names },
            _ => return Err(TlsError::Incomplete),
        };
        Ok(Self { cert, clients })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("set both the certificate and the key file, or neither (self-signed)")]
    Incomplete,
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
    #[error("a self-signed certificate needs at least one name")]
    NoNames,
    #[error("generating the self-signed certificate: {0}")]
    Generate(#[from] rcgen::Error),
    #[error("TLS configuration: {0}")]
    Rustls(#[from] rustls::Error),
    #[error(transparent)]
    Version(#[from] crate::certs::CertError),
}

/// The certificate presented to new handshakes and its PEM, replaced together when it is
/// renewed.
#[derive(Debug)]
struct Current(RwLock<(Arc<CertifiedKey>, String)>);

impl ResolvesServerCert for Current {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        self.0.read().ok().map(|c| c.0.clone())
    }
}

/// A ready TLS server configuration and the certificate it presents.
#[derive(Debug, Clone)]
pub struct ServerTls {
    config: Arc<ServerConfig>,
    current: Arc<Current>,
    provider: Arc<CryptoProvider>,
    clients: Arc<ClientAuth>,
}

/// A certificate chain and its key, parsed from PEM and checked (X.509 v3).
fn parse_pair(
    cert_pem: &str,
    key_pem: &str,
    cert_path: &Path,
    key_path: &Path,
) -> Result<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>), TlsError> {
    let chain = CertificateDer::pem_slice_iter(cert_pem.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|source| TlsError::Pem {
            path: cert_path.to_path_buf(),
            source,
        })?;
    if chain.is_empty() {
        return Err(TlsError::NoCertificate(cert_path.to_path_buf()));
    }
    crate::certs::check_pem(
        cert_pem.as_bytes(),
        &format!("the serving certificate {}", cert_path.display()),
    )?;
    let key =
        PrivateKeyDer::from_pem_slice(key_pem.as_bytes()).map_err(|source| TlsError::Pem {
            path: key_path.to_path_buf(),
            source,
        })?;
    Ok((chain, key))
}

fn certified(
    provider: &CryptoProvider,
    chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
) -> Result<Arc<CertifiedKey>, TlsError> {
    let signer = provider.key_provider.load_private_key(key)?;
    let certified = CertifiedKey::new(chain, signer);
    certified.keys_match()?;
    Ok(Arc::new(certified))
}

impl ServerTls {
    pub fn new(settings: &TlsSettings) -> Result<Self, TlsError> {
        let (cert_pem, chain, key) = match &settings.cert {
            CertSource::Files { cert, key } => {
                let cert_pem = read_to_string(cert)?;
                let (chain, key_der) = parse_pair(&cert_pem, &read_to_string(key)?, cert, key)?;
                (cert_pem, chain, key_der)
            }
            CertSource::SelfSigned { names } => self_signed(names)?,
        };
        Self::build(cert_pem, chain, key, settings.clients.clone())
    }

    /// From PEM text held in memory (the operator's own Secret).
    pub fn from_pem(
        cert_pem: &str,
        key_pem: &str,
        clients: Arc<ClientAuth>,
    ) -> Result<Self, TlsError> {
        let memory = Path::new("<in memory>");
        let (chain, key) = parse_pair(cert_pem, key_pem, memory, memory)?;
        Self::build(cert_pem.to_string(), chain, key, clients)
    }

    fn build(
        cert_pem: String,
        chain: Vec<CertificateDer<'static>>,
        key: PrivateKeyDer<'static>,
        clients: Arc<ClientAuth>,
    ) -> Result<Self, TlsError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let current = Arc::new(Current(RwLock::new((
            certified(&provider, chain, key)?,
            cert_pem,
        ))));
        let builder = ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()?;
        let builder = if clients.verifies_clients() {
            builder.with_client_cert_verifier(clients.verifier())
        } else {
            builder.with_no_client_auth()
        };
        let mut config = builder.with_cert_resolver(current.clone());
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Self {
            config: Arc::new(config),
            current,
            provider,
            clients,
        })
    }

    /// Presents `cert_pem`/`key_pem` from the next handshake on; the old certificate stays if
    /// the new one does not parse or does not match its key.
    pub fn replace(&self, cert_pem: &str, key_pem: &str, source: &Path) -> Result<(), TlsError> {
        let (chain, key) = parse_pair(cert_pem, key_pem, source, source)?;
        let certified = certified(&self.provider, chain, key)?;
        if let Ok(mut c) = self.current.0.write() {
            *c = (certified, cert_pem.to_string());
        }
        Ok(())
    }

    /// The PEM of the certificate (chain) presented now; for a self-signed one, what clients
    /// must trust.
    pub fn cert_pem(&self) -> String {
        self.current
            .0
            .read()
            .map(|c| c.1.clone())
            .unwrap_or_default()
    }

    pub fn server_config(&self) -> Arc<ServerConfig> {
        self.config.clone()
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
        let mut loaded = (
            std::fs::read(&cert).unwrap_or_default(),
            std::fs::read(&key).unwrap_or_default(),
        );
        let mut shutdown = pin!(shutdown);
        loop {
            tokio::select! {
                () = &mut shutdown => return,
                () = tokio::time::sleep(period) => {}
            }
            let now = (
                std::fs::read(&cert).unwrap_or_default(),
                std::fs::read(&key).unwrap_or_default(),
            );
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

fn read_to_string(path: &Path) -> Result<String, TlsError> {
    std::fs::read_to_string(path).map_err(|source| TlsError::Read {
        path: path.to_path_buf(),
        source,
    })
}

type KeyMaterial = (String, Vec<CertificateDer<'static>>, PrivateKeyDer<'static>);

fn self_signed(names: &[String]) -> Result<KeyMaterial, TlsError> {
    let first = names.first().ok_or(TlsError::NoNames)?;
    let mut params = rcgen::CertificateParams::new(names.to_vec())?;
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, first.as_str());
    let key = rcgen::KeyPair::generate()?;
    let cert = params.self_signed(&key)?;
    let key_der = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key.serialize_der()));
    Ok((cert.pem(), vec![cert.der().clone()], key_der))
}

/// The names a Service is reached by in-cluster; the aggregator dials `<service>.<ns>.svc`.
pub fn service_names(service: &str, namespace: &str) -> Vec<String> {
    vec![
        service.to_string(),
        format!("{service}.{namespace}"),
        format!("{service}.{namespace}.svc"),
        format!("{service}.{namespace}.svc.cluster.local"),
    ]
}

/// Serves `app` over HTTPS (HTTP/1.1) on `listener` until `shutdown` completes, then gives
/// open connections a few seconds to finish.
pub async fn serve(
    listener: TcpListener,
    tls: ServerTls,
    app: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let acceptor = TlsAcceptor::from(tls.config.clone());
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut shutdown = pin!(shutdown);
    let mut connections = JoinSet::new();
    tracing::info!(addr = ?listener.local_addr().ok(), verifies_clients = tls.clients.verifies_clients(), "serving the External Metrics API");
    loop {
        tokio::select! {
            () = &mut shutdown => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    connections.spawn(connection(
                        acceptor.clone(),
                        stream,
                        peer,
                        app.clone(),
                        tls.clients.clone(),
                        stop_rx.clone(),
                    ));
                }
                Err(e) => {
                    // Out of file descriptors and the like: back off instead of spinning.
                    tracing::warn!(error = %e, "accepting a connection");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            },
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
    let _ = stop_tx.send(true);
    let drained = tokio::time::timeout(SHUTDOWN_GRACE, async {
        while connections.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        connections.abort_all();
    }
    Ok(())
}

async fn connection(
    acceptor: TlsAcceptor,
    stream: TcpStream,
    peer: SocketAddr,
    app: Router,
    clients: Arc<ClientAuth>,
    mut stop: watch::Receiver<bool>,
) {
    let tls = match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
        Ok(Ok(tls)) => tls,
        Ok(Err(e)) => {
            match crate::certs::explain_handshake(&format!("{e:?}")) {
                Some(why) => tracing::warn!(%peer, error = %e, "TLS handshake failed: {why}"),
                None => tracing::debug!(%peer, error = %e, "TLS handshake failed"),
            }
            return;
        }
        Err(_) => {
            tracing::debug!(%peer, "TLS handshake timed out");
            return;
        }
    };
    // The verifier already checked any certificate presented against the client CA; the
    // allowed names are checked per request, so a change applies to open connections too.
    let leaf = tls.get_ref().1.peer_certificates().and_then(|c| c.first());
    let presented = leaf.is_some();
    let common_name = leaf.and_then(|c| subject_common_name(c));
    let service = hyper::service::service_fn(move |mut req: hyper::Request<Incoming>| {
        let verdict = clients.verdict(presented, common_name.as_deref());
        req.extensions_mut().insert(verdict);
        app.clone().oneshot(req)
    });
    let conn = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_READ_TIMEOUT)
        .serve_connection(TokioIo::new(tls), service);
    let mut conn = pin!(conn);
    tokio::select! {
        res = conn.as_mut() => {
            if let Err(e) = res {
                tracing::debug!(%peer, error = %e, "connection ended with an error");
            }
        }
        () = async { let _ = stop.wait_for(|s| *s).await; } => {
            conn.as_mut().graceful_shutdown();
            let _ = conn.await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn external_tls_settings_from_flags() {
        let names = service_names("op", "sys");
        let any = ClientAuth::any_client;
        let s = TlsSettings::from_flags(None, None, names.clone(), any()).expect("self-signed");
        assert_eq!(s.cert, CertSource::SelfSigned { names });
        let files = TlsSettings::from_flags(
            Some("tls.crt".into()),
            Some("tls.key".into()),
            Vec::new(),
            any(),
        )
        .expect("files");
        assert_eq!(
            files.cert,
            CertSource::Files {
                cert: "tls.crt".into(),
                key: "tls.key".into()
            }
        );
        assert!(matches!(
            TlsSettings::from_flags(Some("tls.crt".into()), None, Vec::new(), any()),
            Err(TlsError::Incomplete)
        ));
    }

    #[test]
    fn external_service_names() {
        assert_eq!(
            service_names("ferrite-operator", "ferrite-system")[2],
            "ferrite-operator.ferrite-system.svc"
        );
    }
}
