//! HTTPS clients for tests that trust exactly one certificate, so TLS is really verified.

use std::sync::Arc;
use std::time::Duration;

use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::rustls::{self, ClientConfig, RootCertStore};

pub fn roots(pem: &str) -> RootCertStore {
    let mut roots = RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(pem.as_bytes()) {
        roots.add(cert.expect("PEM")).expect("root");
    }
    assert!(!roots.is_empty());
    roots
}

/// A client certificate chain and its key.
pub type Identity = (Vec<CertificateDer<'static>>, PrivateKeyDer<'static>);

/// An [`Identity`] from PEM files.
pub fn identity_files(cert: &std::path::Path, key: &std::path::Path) -> Identity {
    let chain = CertificateDer::pem_file_iter(cert)
        .and_then(Iterator::collect)
        .unwrap_or_else(|e| panic!("{}: {e}", cert.display()));
    let key =
        PrivateKeyDer::from_pem_file(key).unwrap_or_else(|e| panic!("{}: {e}", key.display()));
    (chain, key)
}

pub fn client_config(trusted_pem: &str, client: Option<Identity>) -> ClientConfig {
    let builder =
        ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()
            .expect("versions")
            .with_root_certificates(roots(trusted_pem));
    match client {
        Some((chain, key)) => builder
            .with_client_auth_cert(chain, key)
            .expect("client cert"),
        None => builder.with_no_client_auth(),
    }
}

/// How long one request of [`agent`] may take, its body included.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// A blocking HTTPS client that trusts only `trusted_pem`.
pub fn agent(trusted_pem: &str) -> ureq::Agent {
    agent_within(trusted_pem, REQUEST_TIMEOUT)
}

/// [`agent`] for a request that may take up to `within`, body included: a long stream, which
/// on a loaded 2-core machine can take longer than [`REQUEST_TIMEOUT`].
pub fn agent_within(trusted_pem: &str, within: Duration) -> ureq::Agent {
    built(client_config(trusted_pem, None), within)
}

pub fn agent_with(config: ClientConfig) -> ureq::Agent {
    built(config, REQUEST_TIMEOUT)
}

fn built(config: ClientConfig, timeout: Duration) -> ureq::Agent {
    ureq::AgentBuilder::new()
        .tls_config(Arc::new(config))
        .timeout(timeout)
        .build()
}
