//! The External Metrics API's serving certificate, kept by the operator at run time: nothing
//! random is rendered by the chart, so two renders are identical and a GitOps tool never sees a
//! new CA. The operator makes a self-signed certificate for the Service's names, stores it in a
//! Secret (owned by the APIService, so it goes when the chart does), sets the APIService's
//! `caBundle`, and renews it when a third of its validity is left.
//!
//! Several replicas share one Secret: it is created once (a replica that loses the race reads
//! the winner's) and replaced only at the resourceVersion read, so they converge on one
//! certificate. A renewal puts the new certificate in the bundle next to the old one, which
//! stays trusted until it expires, and sets the bundle before the Secret: no replica ever
//! serves a certificate the aggregator does not trust.

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::pin;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use k8s_openapi::ByteString;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use k8s_openapi::kube_aggregator::pkg::apis::apiregistration::v1::APIService;
use kube::Api;
use kube::api::{Patch, PatchParams, PostParams};

use super::tls::ServerTls;
use crate::config::FIELD_MANAGER;

/// When the certificate expires, in seconds since the epoch.
const NOT_AFTER: &str = "ferrite.dev/not-after";
/// The DNS names it was made for, comma-separated: a Service renamed gets a new certificate.
const NAMES: &str = "ferrite.dev/dns-names";

#[derive(Debug, thiserror::Error)]
pub enum KeeperError {
    #[error("reading or writing Secret {secret}: {source}")]
    Secret {
        secret: String,
        #[source]
        source: kube::Error,
    },
    #[error("setting the caBundle of APIService {name}: {source}")]
    ApiService {
        name: String,
        #[source]
        source: kube::Error,
    },
    #[error("generating the certificate: {0}")]
    Generate(#[from] rcgen::Error),
    #[error("Secret {0} kept changing under concurrent writers")]
    Contended(String),
}

/// Where the certificate lives and what it is for.
#[derive(Clone)]
pub struct Keeper {
    pub client: kube::Client,
    pub namespace: String,
    pub secret: String,
    pub api_service: String,
    pub names: Vec<String>,
    /// Lifetime of each certificate; renewed when a third is left.
    pub validity: Duration,
}

impl std::fmt::Debug for Keeper {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Keeper")
            .field("namespace", &self.namespace)
            .field("secret", &self.secret)
            .field("api_service", &self.api_service)
            .field("names", &self.names)
            .field("validity", &self.validity)
            .finish_non_exhaustive()
    }
}

/// The certificate, its key, and the bundle clients should trust (it and, during a renewal,
/// its predecessor).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Material {
    pub cert_pem: String,
    pub key_pem: String,
    pub bundle: String,
    pub not_after: u64,
}

fn secs(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// What a Secret of ours holds, when it holds all of it.
fn read(secret: &Secret, names: &str) -> Option<Material> {
    let data = secret.data.as_ref()?;
    let text = |k: &str| String::from_utf8(data.get(k)?.0.clone()).ok();
    let annotations = secret.metadata.annotations.as_ref()?;
    if annotations.get(NAMES).map(String::as_str) != Some(names) {
        return None;
    }
    Some(Material {
        cert_pem: text("tls.crt")?,
        key_pem: text("tls.key")?,
        bundle: text("ca.crt")?,
        not_after: annotations.get(NOT_AFTER)?.parse().ok()?,
    })
}

impl Keeper {
    /// How often the Secret and the bundle are checked: a twelfth of the validity, at most
    /// every 10 minutes, so a renewal is seen long before the old certificate expires.
    pub fn check_interval(&self) -> Duration {
        (self.validity / 12).clamp(Duration::from_secs(1), Duration::from_secs(600))
    }

    fn due(&self, m: &Material, now: u64) -> bool {
        now + self.validity.as_secs() / 3 >= m.not_after
    }

    /// The certificate to serve now: the Secret's while it is valid (setting the bundle if it
    /// drifted), else a new one written there first.
    pub async fn ensure(&self, now: SystemTime) -> Result<Material, KeeperError> {
        let secrets: Api<Secret> = Api::namespaced(self.client.clone(), &self.namespace);
        let secret_err = |source| KeeperError::Secret {
            secret: format!("{}/{}", self.namespace, self.secret),
            source,
        };
        let names = self.names.join(",");
        let now = secs(now);
        for _ in 0..5 {
            let live = secrets.get_opt(&self.secret).await.map_err(secret_err)?;
            let held = live.as_ref().and_then(|s| read(s, &names));
            if let Some(m) = &held
                && !self.due(m, now)
            {
                self.set_bundle(&m.bundle).await?;
                return Ok(m.clone());
            }
            let fresh = self.generate(now)?;
            // The predecessor stays trusted while it is valid: replicas still serve it.
            let mut bundle = fresh.cert_pem.clone();
            if let Some(old) = held.as_ref().filter(|o| o.not_after > now) {
                bundle.push_str(&old.cert_pem);
            }
            let material = Material { bundle, ..fresh };
            let owner = self.set_bundle(&material.bundle).await?;
            let mut desired = self.secret_object(&material, &names, owner);
            let written = match &live {
                None => secrets.create(&PostParams::default(), &desired).await,
                Some(l) => {
                    desired.metadata.resource_version = l.metadata.resource_version.clone();
                    secrets
                        .replace(&self.secret, &PostParams::default(), &desired)
                        .await
                }
            };
            match written {
                Ok(_) => {
                    tracing::info!(secret = %self.secret, not_after = material.not_after, "issued the External Metrics API's serving certificate");
                    return Ok(material);
                }
                // Another replica wrote first: serve what it wrote.
                Err(kube::Error::Api(e)) if e.code == 409 => continue,
                Err(e) => return Err(secret_err(e)),
            }
        }
        Err(KeeperError::Contended(self.secret.clone()))
    }

    fn generate(&self, now: u64) -> Result<Material, KeeperError> {
        let first = self.names.first().cloned().unwrap_or_default();
        let mut params = rcgen::CertificateParams::new(self.names.clone())?;
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, first);
        let at = |t: u64| {
            time::OffsetDateTime::from_unix_timestamp(i64::try_from(t).unwrap_or(i64::MAX))
                .unwrap_or(time::OffsetDateTime::UNIX_EPOCH)
        };
        let not_after = now + self.validity.as_secs();
        // An hour's slack for clocks behind this one.
        params.not_before = at(now.saturating_sub(3600));
        params.not_after = at(not_after);
        let key = rcgen::KeyPair::generate()?;
        let cert = params.self_signed(&key)?;
        Ok(Material {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
            bundle: String::new(),
            not_after,
        })
    }

    fn secret_object(&self, m: &Material, names: &str, owner: Option<OwnerReference>) -> Secret {
        let bytes = |s: &str| ByteString(s.as_bytes().to_vec());
        Secret {
            metadata: ObjectMeta {
                name: Some(self.secret.clone()),
                namespace: Some(self.namespace.clone()),
                labels: Some(BTreeMap::from([(
                    "app.kubernetes.io/managed-by".to_string(),
                    FIELD_MANAGER.to_string(),
                )])),
                annotations: Some(BTreeMap::from([
                    (NOT_AFTER.to_string(), m.not_after.to_string()),
                    (NAMES.to_string(), names.to_string()),
                ])),
                owner_references: owner.map(|o| vec![o]),
                ..ObjectMeta::default()
            },
            type_: Some("kubernetes.io/tls".into()),
            data: Some(BTreeMap::from([
                ("tls.crt".to_string(), bytes(&m.cert_pem)),
                ("tls.key".to_string(), bytes(&m.key_pem)),
                ("ca.crt".to_string(), bytes(&m.bundle)),
            ])),
            ..Secret::default()
        }
    }

    /// Sets the APIService's `caBundle` to `bundle` unless it already is; returns an owner
    /// reference to the APIService for the Secret.
    async fn set_bundle(&self, bundle: &str) -> Result<Option<OwnerReference>, KeeperError> {
        let api: Api<APIService> = Api::all(self.client.clone());
        let err = |source| KeeperError::ApiService {
            name: self.api_service.clone(),
            source,
        };
        let live = api.get(&self.api_service).await.map_err(err)?;
        let current = live.spec.as_ref().and_then(|s| s.ca_bundle.as_ref());
        let live = if current.map(|b| b.0.as_slice()) == Some(bundle.as_bytes()) {
            live
        } else {
            let patch =
                serde_json::json!({"spec": {"caBundle": ByteString(bundle.as_bytes().to_vec())}});
            let patched = api
                .patch(
                    &self.api_service,
                    &PatchParams {
                        field_manager: Some(FIELD_MANAGER.into()),
                        ..PatchParams::default()
                    },
                    &Patch::Merge(&patch),
                )
                .await
                .map_err(err)?;
            tracing::info!(apiservice = %self.api_service, "set the caBundle");
            patched
        };
        Ok(live.metadata.uid.map(|uid| OwnerReference {
            api_version: "apiregistration.k8s.io/v1".into(),
            kind: "APIService".into(),
            name: self.api_service.clone(),
            uid,
            ..OwnerReference::default()
        }))
    }

    /// Keeps the certificate until `shutdown`: checks every [`Keeper::check_interval`] and
    /// hands a renewed one (or another replica's) to `tls`. Errors are logged and retried at
    /// the next check; the current certificate stays in service meanwhile.
    pub async fn run(
        self,
        tls: ServerTls,
        mut serving: Material,
        shutdown: impl Future<Output = ()>,
    ) {
        let mut shutdown = pin!(shutdown);
        loop {
            tokio::select! {
                () = &mut shutdown => return,
                () = tokio::time::sleep(self.check_interval()) => {}
            }
            match self.ensure(SystemTime::now()).await {
                Ok(m) if m.cert_pem != serving.cert_pem => {
                    match tls.replace(&m.cert_pem, &m.key_pem, std::path::Path::new(&self.secret)) {
                        Ok(()) => {
                            tracing::info!(secret = %self.secret, "serving the renewed certificate");
                            serving = m;
                        }
                        Err(e) => {
                            tracing::warn!(error = %e, "the Secret's certificate does not load")
                        }
                    }
                }
                Ok(_) => {}
                Err(e) => tracing::warn!(error = %e, "keeping the serving certificate"),
            }
        }
    }
}
