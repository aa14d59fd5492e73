//! Whether the optional CRDs the operator writes (the Prometheus Operator's ServiceMonitor,
//! KEDA's ScaledObject, LeaderWorkerSet) are installed, found through API discovery (no extra RBAC) and cached
//! for a while, since CRDs come and go rarely and a check per reconcile would cost one request
//! per InferenceService per resync.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use kube::{Client, Resource};

use crate::build::keda::ScaledObject;
use crate::build::lws::LeaderWorkerSet;
use crate::build::monitor::ServiceMonitor;

/// The cached answers.
#[derive(Debug)]
pub struct MonitorDiscovery {
    monitors: Served,
    scaled_objects: Served,
    leader_worker_sets: Served,
}

impl MonitorDiscovery {
    /// `ttl` zero checks on every call.
    pub fn new(ttl: Duration) -> Self {
        Self {
            monitors: Served::new(ttl),
            scaled_objects: Served::new(ttl),
            leader_worker_sets: Served::new(ttl),
        }
    }

    pub async fn service_monitor_crd(&self, client: &Client) -> Result<bool, kube::Error> {
        self.monitors.check::<ServiceMonitor>(client).await
    }

    pub async fn scaled_object_crd(&self, client: &Client) -> Result<bool, kube::Error> {
        self.scaled_objects.check::<ScaledObject>(client).await
    }

    pub async fn leader_worker_set_crd(&self, client: &Client) -> Result<bool, kube::Error> {
        self.leader_worker_sets
            .check::<LeaderWorkerSet>(client)
            .await
    }
}

/// Whether one kind is served, as last found.
#[derive(Debug)]
struct Served {
    ttl: Duration,
    cached: Mutex<Option<(Instant, bool)>>,
}

impl Served {
    fn new(ttl: Duration) -> Self {
        Self {
            ttl,
            cached: Mutex::new(None),
        }
    }

    async fn check<K: Resource<DynamicType = ()>>(
        &self,
        client: &Client,
    ) -> Result<bool, kube::Error> {
        if let Ok(guard) = self.cached.lock()
            && let Some((at, present)) = *guard
            && at.elapsed() < self.ttl
        {
            return Ok(present);
        }
        let present = match client.list_api_group_resources(&K::api_version(&())).await {
            Ok(list) => list.resources.iter().any(|r| r.name == K::plural(&())),
            // A group nobody serves answers a plain-text 404, not a Status.
            Err(e) if super::apply::not_found(&e) => false,
            Err(e) => return Err(e),
        };
        if let Ok(mut guard) = self.cached.lock() {
            *guard = Some((Instant::now(), present));
        }
        Ok(present)
    }
}
