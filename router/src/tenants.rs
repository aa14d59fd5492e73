//! Tenants: the InferenceTenants (cluster-scoped) and their API keys (the values of Secrets
//! labelled `ferrite.dev/tenant=<name>` in one namespace, the router's), watched into caches
//! and rebuilt into a [`Directory`] on every change. Keys are held only as SHA-256 digests,
//! and a presented key's digest is compared with every one in constant time.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, RwLock};

use ferrite_api::keys::ApiKeys;
use ferrite_api::tenant::{InferenceTenant, TENANT_LABEL};
use k8s_openapi::api::core::v1::Secret;
use kube::runtime::reflector::{self, Store};
use kube::runtime::watcher;
use kube::{Api, Client, ResourceExt};
use sha2::{Digest, Sha256};

use crate::quota::Limits;
use crate::registry::reflect;

/// A tenant as the router enforces it.
#[derive(Debug, Clone, PartialEq)]
pub struct Tenant {
    pub name: String,
    pub namespaces: Vec<String>,
    pub models: Vec<String>,
    pub priority: i32,
    pub limits: Limits,
}

impl Tenant {
    fn from_resource(t: &InferenceTenant) -> Tenant {
        let l = &t.spec.limits;
        let positive = |v: Option<i64>| v.filter(|&v| v >= 1);
        Tenant {
            name: t.name_any(),
            namespaces: t.spec.namespaces.clone(),
            models: t.spec.models.clone(),
            priority: t.spec.priority,
            limits: Limits {
                requests_per_minute: positive(l.requests_per_minute).map(|v| v as f64),
                tokens_per_minute: positive(l.tokens_per_minute).map(|v| v as f64),
                concurrent: positive(l.concurrent_requests).map(|v| v as u64),
            },
        }
    }

    /// Whether the tenant may use the service `namespace`/`name` serving `model` under the
    /// name `asked` (its served name, its `namespace/name`, or an adapter's name).
    pub fn may_use(&self, namespace: &str, name: &str, model: &str, asked: &str) -> bool {
        let id = format!("{namespace}/{name}");
        self.namespaces.iter().any(|n| n == namespace)
            || self
                .models
                .iter()
                .any(|m| m == asked || m == model || *m == id)
    }
}

/// Every tenant by its keys' digests.
#[derive(Debug, Default)]
pub struct Directory {
    keys: Vec<([u8; 32], Arc<Tenant>)>,
    names: HashSet<String>,
}

impl Directory {
    /// From the tenants and the Secrets holding their keys. A key listed for two tenants
    /// belongs to neither (it would be a guess which one's limits it spends), and is logged.
    pub fn build(tenants: &[InferenceTenant], secrets: &[Secret]) -> Directory {
        let by_name: HashMap<String, Arc<Tenant>> = tenants
            .iter()
            .filter(|t| t.metadata.deletion_timestamp.is_none())
            .map(|t| (t.name_any(), Arc::new(Tenant::from_resource(t))))
            .collect();
        let mut owners: HashMap<[u8; 32], Option<Arc<Tenant>>> = HashMap::new();
        for s in secrets {
            let Some(tenant) = s.labels().get(TENANT_LABEL).and_then(|n| by_name.get(n)) else {
                continue;
            };
            for value in s.data.iter().flat_map(|d| d.values()) {
                let key = trim(&value.0);
                if key.is_empty() {
                    continue;
                }
                let digest = digest(key);
                owners
                    .entry(digest)
                    .and_modify(|o| {
                        if o.as_ref().is_some_and(|t| t.name != tenant.name) {
                            tracing::warn!(
                                secret = %s.name_any(),
                                "an API key is listed for two tenants; it is refused for both"
                            );
                            *o = None;
                        }
                    })
                    .or_insert_with(|| Some(tenant.clone()));
            }
        }
        Directory {
            keys: owners
                .into_iter()
                .filter_map(|(d, t)| Some((d, t?)))
                .collect(),
            names: by_name.into_keys().collect(),
        }
    }

    /// The tenant whose key `key` is. Every digest is compared, each in constant time, so
    /// the time taken says nothing about how close a guess came.
    pub fn authenticate(&self, key: &str) -> Option<Arc<Tenant>> {
        let given = digest(key.as_bytes());
        let mut found = None;
        for (d, t) in &self.keys {
            if ferrite_net::constant_time_eq(d, &given) {
                found = Some(t.clone());
            }
        }
        found
    }

    /// The names of the declared tenants (metric series are kept for these only).
    pub fn names(&self) -> &HashSet<String> {
        &self.names
    }
}

fn digest(key: &[u8]) -> [u8; 32] {
    Sha256::digest(key).into()
}

/// A Secret's value without the surrounding whitespace (a key written with `echo` into a file
/// ends with a newline that no client sends).
fn trim(v: &[u8]) -> &[u8] {
    let start = v
        .iter()
        .position(|b| !b.is_ascii_whitespace())
        .unwrap_or(v.len());
    let end = v
        .iter()
        .rposition(|b| !b.is_ascii_whitespace())
        .map_or(start, |e| e + 1);
    &v[start..end.max(start)]
}

/// How the router may read a service's key Secret: no standing right, a grant per service.
const GRANTED_BY: &str = "the operator grants the router `get` on it when run with \
     --router-service-account (the chart does with router.tenants.enabled and \
     rbac.readApiKeySecrets)";

/// The watched tenants and keys, and the directory built from them.
#[derive(Clone)]
pub struct Tenants {
    tenants: Store<InferenceTenant>,
    secrets: Store<Secret>,
    directory: Arc<RwLock<Arc<Directory>>>,
    /// The API keys of services with `spec.auth`, sent in place of the tenant's.
    pub service_keys: Arc<ApiKeys>,
}

impl std::fmt::Debug for Tenants {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tenants")
            .field("tenants", &self.tenants.state().len())
            .finish()
    }
}

impl Tenants {
    /// Watches every InferenceTenant and the labelled Secrets in `secrets_namespace`.
    pub fn start(client: Client, secrets_namespace: &str) -> Tenants {
        let (changed, mut changes) = tokio::sync::watch::channel(0u64);
        let changed = Arc::new(changed);
        let tenants = reflect(
            "InferenceTenant",
            Api::<InferenceTenant>::all(client.clone()),
            watcher::Config::default(),
            changed.clone(),
        );
        let service_keys = ApiKeys::new(client.clone(), GRANTED_BY);
        let secrets = reflect(
            "Secret",
            Api::<Secret>::namespaced(client, secrets_namespace),
            watcher::Config::default().labels(TENANT_LABEL),
            changed,
        );
        let t = Tenants {
            tenants,
            secrets,
            directory: Arc::default(),
            service_keys,
        };
        let rebuild = t.clone();
        tokio::spawn(async move {
            while changes.changed().await.is_ok() {
                rebuild.rebuild();
            }
        });
        t
    }

    /// Waits until both caches have been listed once, and builds the first directory.
    pub async fn ready(&self) -> Result<(), reflector::store::WriterDropped> {
        self.tenants.wait_until_ready().await?;
        self.secrets.wait_until_ready().await?;
        self.rebuild();
        Ok(())
    }

    fn rebuild(&self) {
        let tenants: Vec<InferenceTenant> =
            self.tenants.state().iter().map(|t| (**t).clone()).collect();
        let secrets: Vec<Secret> = self.secrets.state().iter().map(|s| (**s).clone()).collect();
        let d = Arc::new(Directory::build(&tenants, &secrets));
        if let Ok(mut w) = self.directory.write() {
            *w = d;
        }
    }

    /// The current directory.
    pub fn directory(&self) -> Arc<Directory> {
        self.directory.read().map(|d| d.clone()).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferrite_api::tenant::InferenceTenantSpec;
    use k8s_openapi::ByteString;
    use std::collections::BTreeMap;

    fn tenant(name: &str, namespaces: &[&str], models: &[&str]) -> InferenceTenant {
        InferenceTenant::new(
            name,
            InferenceTenantSpec {
                namespaces: namespaces.iter().map(|s| s.to_string()).collect(),
                models: models.iter().map(|s| s.to_string()).collect(),
                ..Default::default()
            },
        )
    }

    fn secret(name: &str, tenant: Option<&str>, keys: &[&str]) -> Secret {
        let mut s = Secret::default();
        s.metadata.name = Some(name.into());
        if let Some(t) = tenant {
            s.metadata.labels = Some(BTreeMap::from([(TENANT_LABEL.to_string(), t.into())]));
        }
        s.data = Some(
            keys.iter()
                .enumerate()
                .map(|(i, k)| (format!("key{i}"), ByteString(k.as_bytes().to_vec())))
                .collect(),
        );
        s
    }

    #[test]
    fn keys_find_their_tenant_and_nothing_else_does() {
        let d = Directory::build(
            &[tenant("a", &["team-a"], &[]), tenant("b", &[], &["chat"])],
            &[
                secret("a-keys", Some("a"), &["sk-a1\n", "sk-a2"]),
                secret("b-keys", Some("b"), &["sk-b"]),
                // A Secret for a tenant that does not exist, and one with no tenant label.
                secret("c-keys", Some("c"), &["sk-c"]),
                secret("plain", None, &["sk-plain"]),
                // The same key for two tenants: neither.
                secret("shared-a", Some("a"), &["sk-shared", "  "]),
                secret("shared-b", Some("b"), &["sk-shared"]),
            ],
        );
        let name = |k: &str| d.authenticate(k).map(|t| t.name.clone());
        assert_eq!(name("sk-a1").as_deref(), Some("a"));
        assert_eq!(name("sk-a2").as_deref(), Some("a"));
        assert_eq!(name("sk-b").as_deref(), Some("b"));
        for k in ["sk-c", "sk-plain", "sk-shared", "", "sk-a", "sk-a1 "] {
            assert_eq!(name(k), None, "{k:?}");
        }
        assert_eq!(d.names().len(), 2);
    }

    #[test]
    fn access_is_by_namespace_or_by_model_name() {
        let t = Tenant::from_resource(&tenant("a", &["team-a"], &["chat", "ml/code", "sql"]));
        assert!(t.may_use("team-a", "anything", "m", "m"));
        assert!(t.may_use("other", "svc", "chat", "chat"));
        assert!(t.may_use("ml", "code", "code-model", "code-model"));
        assert!(t.may_use("other", "svc", "base", "sql"));
        assert!(!t.may_use("other", "svc", "base", "base"));
        assert!(!t.may_use("team-ab", "svc", "x", "x"));
    }
}
