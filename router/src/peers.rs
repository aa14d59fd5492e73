//! The router's replicas, as each sees them: the Ready pods matching `--peers` in its own
//! namespace. A tenant's limits are split evenly among them ([`Peers::share`]), so that
//! several replicas together admit about what one would, with no store between them; the
//! split follows replicas as they come and go.

use k8s_openapi::api::core::v1::Pod;
use kube::runtime::reflector::{self, Store};
use kube::runtime::watcher;
use kube::{Api, Client};

use crate::registry::reflect;

/// The watched router pods.
#[derive(Clone)]
pub struct Peers {
    pods: Store<Pod>,
}

impl std::fmt::Debug for Peers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Peers")
            .field("ready", &self.count())
            .finish()
    }
}

impl Peers {
    /// Watches the pods matching the label selector `selector` in `namespace`.
    pub fn start(client: Client, namespace: &str, selector: &str) -> Peers {
        let (changed, _) = tokio::sync::watch::channel(0u64);
        let pods = reflect(
            "Pod",
            Api::<Pod>::namespaced(client, namespace),
            watcher::Config::default().labels(selector),
            std::sync::Arc::new(changed),
        );
        Peers { pods }
    }

    pub async fn ready(&self) -> Result<(), reflector::store::WriterDropped> {
        self.pods.wait_until_ready().await
    }

    /// Ready replicas, this one included (at least 1: a replica that cannot see itself yet
    /// still counts).
    pub fn count(&self) -> usize {
        self.pods
            .state()
            .iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none() && is_ready(p))
            .count()
            .max(1)
    }

    /// This replica's share of every tenant's limits.
    pub fn share(&self) -> f64 {
        1.0 / self.count() as f64
    }
}

fn is_ready(p: &Pod) -> bool {
    p.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}
