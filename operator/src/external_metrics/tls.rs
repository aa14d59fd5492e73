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
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use ferrite_net::tls::{CertError, ServingCert};
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinSet;
use tokio_rustls::TlsAcceptor;
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
    #[error(transparent)]
    Cert(#[from] CertError),
    #[error("a self-signed certificate needs at least one name")]
    NoNames,
    #[error("generating the self-signed certificate: {0}")]
    Generate(#[from] rcgen::Error),
    #[error("TLS configuration: {0}")]
    Rustls(#[from] rustls::Error),
}

/// A ready TLS server configuration and the certificate it presents.
#[derive(Debug, Clone)]
pub struct ServerTls {
    config: Arc<ServerConfig>,
    cert: ServingCert,
    clients: Arc<ClientAuth>,
}

/// The aggregator refuses X.509 v1 serving certificates: so does the operator, at load.
fn x509_v3(pem: &[u8], what: &str) -> Result<(), String> {
    crate::certs::check_pem(pem, what).map_err(|e| e.to_string())
}

impl ServerTls {
    pub fn new(settings: &TlsSettings) -> Result<Self, TlsError> {
        let cert = match &settings.cert {
            CertSource::Files { cert, key } => ServingCert::from_files(cert, key, Some(x509_v3))?,
            CertSource::SelfSigned { names } => {
                let (cert_pem, key_pem) = self_signed(names)?;
                ServingCert::from_pem(&cert_pem, &key_pem, Some(x509_v3))?
            }
        };
        Self::build(cert, settings.clients.clone())
    }

    /// From PEM text held in memory (the operator's own Secret).
    pub fn from_pem(
        cert_pem: &str,
        key_pem: &str,
        clients: Arc<ClientAuth>,
    ) -> Result<Self, TlsError> {
        Self::build(
            ServingCert::from_pem(cert_pem, key_pem, Some(x509_v3))?,
            clients,
        )
    }

    fn build(cert: ServingCert, clients: Arc<ClientAuth>) -> Result<Self, TlsError> {
        let verifier = clients.verifies_clients().then(|| clients.verifier());
        let config = cert.server_config(verifier, &[b"http/1.1"])?;
        Ok(Self {
            config: Arc::new(config),
            cert,
            clients,
        })
    }

    /// Presents `cert_pem`/`key_pem` from the next handshake on; the old certificate stays if
    /// the new one does not parse or does not match its key.
    pub fn replace(&self, cert_pem: &str, key_pem: &str, source: &Path) -> Result<(), TlsError> {
        Ok(self.cert.replace(cert_pem, key_pem, source)?)
    }

    /// The PEM of the certificate (chain) presented now; for a self-signed one, what clients
    /// must trust.
    pub fn cert_pem(&self) -> String {
        self.cert.cert_pem()
    }

    pub fn server_config(&self) -> Arc<ServerConfig> {
        self.config.clone()
    }

    /// The certificate presented: [`ServingCert::watch_files`] keeps it current.
    pub fn serving_cert(&self) -> ServingCert {
        self.cert.clone()
    }
}

/// A self-signed certificate for `names`, and its key, as PEM.
fn self_signed(names: &[String]) -> Result<(String, String), TlsError> {
    let first = names.first().ok_or(TlsError::NoNames)?;
    let mut params = rcgen::CertificateParams::new(names.to_vec())?;
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, first.as_str());
    let key = rcgen::KeyPair::generate()?;
    let cert = params.self_signed(&key)?;
    Ok((cert.pem(), key.serialize_pem()))
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
