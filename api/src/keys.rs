//! The API keys of InferenceServices with `spec.auth`, read from the Secret each names: the
//! operator's adapter sync calls their pods' load/unload API with it, and a router with
//! tenants (which keeps each tenant's own key) sends it with every request, as the key guards
//! every `/v1` path (ferrite-server and vLLM alike).
//!
//! Only the Secret and key the InferenceService names, in its own namespace, are read: the same
//! value its pods already receive in their environment, so a reader learns nothing a pod of
//! that service does not. A key is kept for [`KEY_TTL`] and forgotten early when a pod refuses
//! it (the Secret was rotated), so a settled service costs one read per TTL.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use http::HeaderValue;
use k8s_openapi::api::core::v1::Secret;
use kube::Api;

use crate::crd::SecretKeyRef;

/// How long a key read from its Secret is used before it is read again.
pub const KEY_TTL: Duration = Duration::from_secs(300);

/// An API key, ready to send as `Authorization: Bearer …`. Its `Debug` never shows it.
#[derive(Clone, PartialEq, Eq)]
pub struct ApiKey(HeaderValue);

impl ApiKey {
    /// The key as a header value marked sensitive (HTTP/2 never indexes it), or `None` where it
    /// cannot be one (a control character): such a key could not reach the pod either.
    pub fn new(key: &str) -> Option<ApiKey> {
        let mut value = HeaderValue::from_str(&format!("Bearer {key}")).ok()?;
        value.set_sensitive(true);
        Some(ApiKey(value))
    }

    /// The `Authorization` header's value.
    pub fn header(&self) -> &HeaderValue {
        &self.0
    }
}

impl std::fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ApiKey(…)")
    }
}

/// Why a service's key could not be read; each says what to fix.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    #[error("Secret {0} (spec.auth.apiKeySecretRef) does not exist")]
    NoSecret(String),
    #[error("may not read Secret {0}; {1}")]
    Forbidden(String, &'static str),
    #[error("Secret {0} has no key {1:?}")]
    NoKey(String, String),
    #[error("the value of key {1:?} in Secret {0} is empty or not a valid header value")]
    Unusable(String, String),
    #[error("reading Secret {0}: {1}")]
    Api(String, String),
}

impl KeyError {
    /// The CamelCase reason `status.adapters` shows.
    pub fn reason(&self) -> &'static str {
        match self {
            KeyError::NoSecret(_) => "ApiKeySecretNotFound",
            KeyError::Forbidden(..) => "ApiKeySecretForbidden",
            KeyError::NoKey(..) | KeyError::Unusable(..) => "ApiKeyMissing",
            KeyError::Api(..) => "ApiKeyUnreadable",
        }
    }
}

/// Which key of which Secret: namespace, name, key.
pub type Slot = (String, String, String);

/// Keys read from Secrets, each with when it was read.
pub struct ApiKeys {
    client: kube::Client,
    /// What grants the reader `get` on the Secrets, for the message when it may not.
    granted_by: &'static str,
    read: Mutex<HashMap<Slot, (ApiKey, Instant)>>,
}

impl std::fmt::Debug for ApiKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApiKeys").finish_non_exhaustive()
    }
}

impl ApiKeys {
    /// Reads with `client`; `granted_by` says how that client is let read a service's Secret.
    pub fn new(client: kube::Client, granted_by: &'static str) -> Arc<ApiKeys> {
        Arc::new(ApiKeys {
            client,
            granted_by,
            read: Mutex::default(),
        })
    }

    /// The key `secret` names in `namespace`, read again when older than [`KEY_TTL`].
    pub async fn get(&self, namespace: &str, secret: &SecretKeyRef) -> Result<ApiKey, KeyError> {
        let slot = slot(namespace, secret);
        if let Some(key) = self.fresh(&slot) {
            return Ok(key);
        }
        let name = format!("{namespace}/{}", secret.name);
        let api: Api<Secret> = Api::namespaced(self.client.clone(), namespace);
        let found = match api.get(&secret.name).await {
            Ok(s) => s,
            Err(kube::Error::Api(e)) if e.code == 404 => return Err(KeyError::NoSecret(name)),
            Err(kube::Error::Api(e)) if e.code == 403 => {
                return Err(KeyError::Forbidden(name, self.granted_by));
            }
            Err(e) => return Err(KeyError::Api(name, e.to_string())),
        };
        let key = key_in(&found, &slot.2).map_err(|e| match e {
            Lookup::Absent => KeyError::NoKey(name.clone(), slot.2.clone()),
            Lookup::Unusable => KeyError::Unusable(name.clone(), slot.2.clone()),
        })?;
        if let Ok(mut read) = self.read.lock() {
            read.insert(slot, (key.clone(), Instant::now()));
        }
        Ok(key)
    }

    /// Drops what was read for `secret`, so that the next [`ApiKeys::get`] reads it again: a
    /// pod refused the key.
    pub fn forget(&self, namespace: &str, secret: &SecretKeyRef) {
        if let Ok(mut read) = self.read.lock() {
            read.remove(&slot(namespace, secret));
        }
    }

    /// Drops keys of Secrets no service names any more.
    pub fn retain(&self, keep: impl Fn(&Slot) -> bool) {
        if let Ok(mut read) = self.read.lock() {
            read.retain(|slot, _| keep(slot));
        }
    }

    fn fresh(&self, slot: &Slot) -> Option<ApiKey> {
        let read = self.read.lock().ok()?;
        let (key, at) = read.get(slot)?;
        (at.elapsed() < KEY_TTL).then(|| key.clone())
    }
}

/// The slot of `secret` in `namespace`, with the default key filled in.
pub fn slot(namespace: &str, secret: &SecretKeyRef) -> Slot {
    (
        namespace.to_string(),
        secret.name.clone(),
        secret.key_or_default().into(),
    )
}

/// Why a Secret gave no key.
#[derive(Debug, PartialEq, Eq)]
enum Lookup {
    Absent,
    Unusable,
}

/// `key` of `secret` as an API key: from `data` (what the API server returns), or `stringData`
/// (never returned by a read, but a Secret built by hand may carry it).
fn key_in(secret: &Secret, key: &str) -> Result<ApiKey, Lookup> {
    let bytes = secret
        .data
        .as_ref()
        .and_then(|d| d.get(key))
        .map(|b| b.0.clone())
        .or_else(|| {
            secret
                .string_data
                .as_ref()
                .and_then(|d| d.get(key))
                .map(|s| s.as_bytes().to_vec())
        })
        .ok_or(Lookup::Absent)?;
    let text = String::from_utf8(bytes).map_err(|_| Lookup::Unusable)?;
    // Empty or blank keys are refused by ferrite-server at start too.
    if text.trim().is_empty() {
        return Err(Lookup::Unusable);
    }
    ApiKey::new(&text).ok_or(Lookup::Unusable)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use k8s_openapi::ByteString;

    use super::*;

    fn secret(key: &str, value: &[u8]) -> Secret {
        Secret {
            data: Some(BTreeMap::from([(key.into(), ByteString(value.to_vec()))])),
            ..Secret::default()
        }
    }

    #[test]
    fn a_key_is_read_from_its_secret_as_a_bearer_header_that_never_prints() {
        let key = key_in(&secret("api-key", b"s3cret"), "api-key").expect("a key");
        assert_eq!(key.header(), "Bearer s3cret");
        assert!(key.header().is_sensitive());
        assert!(!format!("{key:?}").contains("s3cret"));
        assert_eq!(
            key_in(&secret("other", b"x"), "api-key"),
            Err(Lookup::Absent)
        );
        for bad in [&b""[..], b"  ", b"a\nb", &[0xff, 0xfe]] {
            assert_eq!(
                key_in(&secret("api-key", bad), "api-key"),
                Err(Lookup::Unusable),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn each_failure_has_its_reason() {
        let n = || "ns/keys".to_string();
        assert_eq!(KeyError::NoSecret(n()).reason(), "ApiKeySecretNotFound");
        let forbidden = KeyError::Forbidden(n(), "the chart grants it with rbac.readApiKeySecrets");
        assert_eq!(forbidden.reason(), "ApiKeySecretForbidden");
        assert_eq!(KeyError::NoKey(n(), "k".into()).reason(), "ApiKeyMissing");
        assert_eq!(
            forbidden.to_string(),
            "may not read Secret ns/keys; the chart grants it with rbac.readApiKeySecrets"
        );
    }

    #[test]
    fn the_default_key_is_the_pods_default() {
        let s = SecretKeyRef {
            name: "keys".into(),
            key: None,
        };
        assert_eq!(slot("ns", &s).2, "api-key");
    }
}
