//! Who may read `/apis`: what an aggregated API server accepts (k8s.io/apiserver's
//! request-header authenticator). The aggregator proves itself with its proxy-client
//! certificate, signed by the request-header CA, whose common name must be one of the allowed
//! names (any name, when the list is empty). kube-apiserver publishes both in
//! `kube-system/extension-apiserver-authentication`; [`ClientAuth::watch`] follows that
//! ConfigMap, so a rotated CA applies from the next handshake and new allowed names from the
//! next request. Until a CA is known nothing reads `/apis`, unless the operator was started to
//! accept any client (an explicit, insecure choice).

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::pin;
use std::sync::{Arc, RwLock};

use futures::StreamExt;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::Api;
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, watcher};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, UnixTime};
use tokio_rustls::rustls::client::danger::HandshakeSignatureValid;
use tokio_rustls::rustls::crypto::{self, CryptoProvider};
use tokio_rustls::rustls::server::WebPkiClientVerifier;
use tokio_rustls::rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use tokio_rustls::rustls::{self, DigitallySignedStruct, DistinguishedName, RootCertStore};

/// The ConfigMap kube-apiserver keeps with its authentication settings for extension servers.
pub const AUTH_CONFIG_MAP: &str = "extension-apiserver-authentication";
pub const AUTH_NAMESPACE: &str = "kube-system";
const CA_KEY: &str = "requestheader-client-ca-file";
const NAMES_KEY: &str = "requestheader-allowed-names";

/// The request-header CA and the common names it may vouch for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestHeader {
    pub ca_pem: String,
    /// Empty: any certificate the CA signed.
    pub allowed_names: Vec<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum TrustError {
    #[error("{key}: {reason}")]
    Field { key: &'static str, reason: String },
    #[error("the request-header CA holds no certificate")]
    NoCertificate,
    #[error("the request-header CA: {0}")]
    Pem(#[from] rustls_pki_types::pem::Error),
    #[error("the request-header CA: {0}")]
    Rustls(#[from] rustls::Error),
    #[error("the request-header CA: {0}")]
    Verifier(#[from] rustls::server::VerifierBuilderError),
    #[error(transparent)]
    Version(#[from] crate::certs::CertError),
}

impl RequestHeader {
    /// From the ConfigMap's data; `None` when it names no request-header CA (kube-apiserver
    /// runs without `--requestheader-client-ca-file`, so no aggregator can prove itself).
    pub fn from_config_map(data: &BTreeMap<String, String>) -> Result<Option<Self>, TrustError> {
        let Some(ca_pem) = data.get(CA_KEY).filter(|p| !p.trim().is_empty()) else {
            return Ok(None);
        };
        let allowed_names = match data.get(NAMES_KEY).map(|s| s.trim()) {
            None | Some("") => Vec::new(),
            Some(json) => serde_json::from_str(json).map_err(|e| TrustError::Field {
                key: NAMES_KEY,
                reason: format!("not a JSON list of names: {e}"),
            })?,
        };
        Ok(Some(Self {
            ca_pem: ca_pem.clone(),
            allowed_names,
        }))
    }

    /// Whether a verified certificate with this common name may read metrics.
    pub fn allows(&self, common_name: Option<&str>) -> bool {
        self.allowed_names.is_empty()
            || common_name.is_some_and(|cn| self.allowed_names.iter().any(|n| n == cn))
    }
}

/// A [`RequestHeader`] with the verifier built from its CA.
#[derive(Debug)]
struct Trust {
    config: RequestHeader,
    verifier: Arc<dyn ClientCertVerifier>,
}

/// What the request layer decides for a request to `/apis`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    Allowed,
    /// 401: no identity, or none that can be checked.
    Unauthenticated(String),
    /// 403: a verified certificate whose name is not allowed.
    Forbidden(String),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Policy {
    AnyClient,
    RequestHeader,
}

/// The client policy in force, shared by the TLS verifier (chains) and the request layer
/// (names), and swapped as the ConfigMap changes.
#[derive(Debug)]
pub struct ClientAuth {
    policy: Policy,
    provider: Arc<CryptoProvider>,
    current: RwLock<Option<Arc<Trust>>>,
}

impl ClientAuth {
    /// Any client that reaches the port may read metrics (`--external-metrics-insecure-any-client`).
    pub fn any_client() -> Arc<Self> {
        Arc::new(Self {
            policy: Policy::AnyClient,
            provider: provider(),
            current: RwLock::new(None),
        })
    }

    /// Only clients the request-header CA vouches for; with `None`, nobody until [`Self::set`]
    /// (or [`Self::watch`]) supplies a CA.
    pub fn request_header(initial: Option<RequestHeader>) -> Result<Arc<Self>, TrustError> {
        let auth = Arc::new(Self {
            policy: Policy::RequestHeader,
            provider: provider(),
            current: RwLock::new(None),
        });
        auth.set(initial)?;
        Ok(auth)
    }

    /// Whether TLS asks clients for certificates at all.
    pub fn verifies_clients(&self) -> bool {
        self.policy == Policy::RequestHeader
    }

    /// Replaces the trust; on an error the previous one stays.
    pub fn set(&self, config: Option<RequestHeader>) -> Result<(), TrustError> {
        let trust = match config {
            Some(config) => Some(Arc::new(Trust {
                verifier: self.verifier_for(&config.ca_pem)?,
                config,
            })),
            None => None,
        };
        if let Ok(mut current) = self.current.write() {
            *current = trust;
        }
        Ok(())
    }

    /// The request-header settings in force.
    pub fn current(&self) -> Option<RequestHeader> {
        self.trust().map(|t| t.config.clone())
    }

    fn trust(&self) -> Option<Arc<Trust>> {
        self.current.read().ok().and_then(|c| c.clone())
    }

    fn verifier_for(&self, ca_pem: &str) -> Result<Arc<dyn ClientCertVerifier>, TrustError> {
        crate::certs::check_pem(ca_pem.as_bytes(), "the request-header client CA")?;
        let mut roots = RootCertStore::empty();
        for cert in CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
            roots.add(cert?)?;
        }
        if roots.is_empty() {
            return Err(TrustError::NoCertificate);
        }
        // Unauthenticated clients may connect (the kubelet probes /healthz); the request
        // layer keeps them off /apis.
        Ok(
            WebPkiClientVerifier::builder_with_provider(Arc::new(roots), self.provider.clone())
                .allow_unauthenticated()
                .build()?,
        )
    }

    /// The TLS side: checks presented chains against whatever CA is current at the handshake.
    pub fn verifier(self: &Arc<Self>) -> Arc<dyn ClientCertVerifier> {
        Arc::new(CurrentCa(self.clone()))
    }

    /// The request side, for a connection whose verified leaf certificate (if any) has
    /// `common_name`.
    pub fn verdict(&self, presented: bool, common_name: Option<&str>) -> Verdict {
        if self.policy == Policy::AnyClient {
            return Verdict::Allowed;
        }
        let Some(trust) = self.trust() else {
            return Verdict::Unauthenticated(format!(
                "no request-header client CA is known yet ({AUTH_NAMESPACE}/{AUTH_CONFIG_MAP}); \
                 metrics are refused until there is one"
            ));
        };
        if !presented {
            return Verdict::Unauthenticated(
                "a client certificate signed by the request-header CA is required".into(),
            );
        }
        if trust.config.allows(common_name) {
            Verdict::Allowed
        } else {
            Verdict::Forbidden(format!(
                "client certificate CN={:?} is not one of the allowed names {:?}",
                common_name.unwrap_or_default(),
                trust.config.allowed_names
            ))
        }
    }

    /// Follows `kube-system/extension-apiserver-authentication` until `shutdown`: each version
    /// of it replaces the trust (one without a CA, or its deletion, leaves none). Errors (the
    /// operator lacking the `extension-apiserver-authentication-reader` role, say) are logged
    /// and retried with backoff; until then the previous trust stays.
    pub async fn watch(self: Arc<Self>, client: kube::Client, shutdown: impl Future<Output = ()>) {
        let api: Api<ConfigMap> = Api::namespaced(client, AUTH_NAMESPACE);
        let config = watcher::Config::default().fields(&format!("metadata.name={AUTH_CONFIG_MAP}"));
        let events = watcher(api, config).default_backoff();
        let mut events = pin!(events);
        let mut shutdown = pin!(shutdown);
        let mut seen = false;
        loop {
            let event = tokio::select! {
                () = &mut shutdown => return,
                e = events.next() => match e {
                    Some(e) => e,
                    None => return,
                },
            };
            match event {
                Ok(watcher::Event::Apply(cm) | watcher::Event::InitApply(cm)) => {
                    seen = true;
                    self.apply(cm.data.unwrap_or_default());
                }
                Ok(watcher::Event::Delete(_)) => {
                    seen = false;
                    self.clear("the ConfigMap was deleted");
                }
                Ok(watcher::Event::Init) => seen = false,
                Ok(watcher::Event::InitDone) => {
                    if !seen {
                        self.clear("the ConfigMap does not exist");
                    }
                }
                Err(e) => tracing::warn!(
                    error = %e,
                    "watching {AUTH_NAMESPACE}/{AUTH_CONFIG_MAP} (the operator needs the \
                     extension-apiserver-authentication-reader role there); retrying"
                ),
            }
        }
    }

    fn apply(&self, data: BTreeMap<String, String>) {
        let parsed = RequestHeader::from_config_map(&data);
        match parsed {
            Ok(Some(config)) if self.current().as_ref() == Some(&config) => {}
            Ok(Some(config)) => {
                let names = config.allowed_names.clone();
                match self.set(Some(config)) {
                    Ok(()) => tracing::info!(
                        allowed_names = ?names,
                        "External Metrics API: request-header client CA loaded from {AUTH_NAMESPACE}/{AUTH_CONFIG_MAP}"
                    ),
                    Err(e) => {
                        tracing::warn!(error = %e, "External Metrics API: keeping the previous client CA")
                    }
                }
            }
            Ok(None) => self.clear("it holds no requestheader-client-ca-file"),
            Err(e) => {
                tracing::warn!(error = %e, "External Metrics API: keeping the previous client CA");
            }
        }
    }

    fn clear(&self, why: &str) {
        tracing::warn!(
            "External Metrics API: {AUTH_NAMESPACE}/{AUTH_CONFIG_MAP}: {why}; refusing metric \
             requests until a request-header client CA appears"
        );
        let _ = self.set(None);
    }
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Delegates chain checks to the CA current at each handshake.
#[derive(Debug)]
struct CurrentCa(Arc<ClientAuth>);

impl ClientCertVerifier for CurrentCa {
    fn client_auth_mandatory(&self) -> bool {
        false
    }

    /// No hints: the CA changes under us, and a client should send any certificate it has.
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        &[]
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        match self.0.trust() {
            Some(trust) => trust
                .verifier
                .verify_client_cert(end_entity, intermediates, now),
            None => Err(rustls::Error::General(
                "no request-header client CA is known yet".into(),
            )),
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.0
            .provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn reads_the_config_map_as_kube_apiserver_writes_it() {
        let ca = "-----BEGIN CERTIFICATE-----\nx\n-----END CERTIFICATE-----\n";
        let rh = RequestHeader::from_config_map(&data(&[
            (CA_KEY, ca),
            (NAMES_KEY, r#"["front-proxy-client"]"#),
            ("requestheader-username-headers", r#"["X-Remote-User"]"#),
        ]))
        .expect("parses")
        .expect("a CA");
        assert_eq!(rh.allowed_names, ["front-proxy-client"]);
        assert!(rh.allows(Some("front-proxy-client")));
        assert!(!rh.allows(Some("intruder")));
        assert!(!rh.allows(None));

        let any_name = RequestHeader::from_config_map(&data(&[(CA_KEY, ca), (NAMES_KEY, "[]")]))
            .expect("parses")
            .expect("a CA");
        assert!(any_name.allows(Some("anyone")));

        assert_eq!(
            RequestHeader::from_config_map(&data(&[("client-ca-file", ca)])).expect("parses"),
            None
        );
        let bad = RequestHeader::from_config_map(&data(&[(CA_KEY, ca), (NAMES_KEY, "front")]));
        assert!(matches!(bad, Err(TrustError::Field { .. })), "{bad:?}");
    }

    #[test]
    fn without_a_ca_nothing_is_allowed_and_any_client_allows_all() {
        let auth = ClientAuth::request_header(None).expect("no CA");
        assert!(matches!(
            auth.verdict(true, Some("front-proxy-client")),
            Verdict::Unauthenticated(_)
        ));
        assert_eq!(
            ClientAuth::any_client().verdict(false, None),
            Verdict::Allowed
        );
        let bad = ClientAuth::request_header(Some(RequestHeader {
            ca_pem: "not a certificate".into(),
            allowed_names: Vec::new(),
        }));
        assert!(matches!(bad, Err(TrustError::NoCertificate)), "{bad:?}");
    }
}
