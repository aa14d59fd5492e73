//! Whether the ServiceMonitor CRD is installed, found through API discovery (no extra RBAC)
//! and cached for a while, since CRDs come and go rarely and a check per reconcile would cost
//! one request per InferenceService per resync.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use kube::Client;

use crate::build::monitor::ServiceMonitor;

#[derive(Debug)]
pub struct MonitorDiscovery {
    ttl: Duration,
    cached: Mutex<Option<(Instant, bool)>>,
}

impl MonitorDiscovery {
    /// `ttl` zero checks on every call.
    pub fn new(ttl: Duration) -> Self {
        Self {
            ttl,
            cached: Mutex::new(None),
        }
    }

    pub async fn service_monitor_crd(&self, client: &Client) -> Result<bool, kube::Error> {
        if let Ok(guard) = self.cached.lock()
            && let Some((at, present)) = *guard
            && at.elapsed() < self.ttl
        {
            return Ok(present);
        }
        use kube::Resource;
        let api_version = ServiceMonitor::api_version(&());
        let present = match client.list_api_group_resources(&api_version).await {
            Ok(list) => list
                .resources
                .iter()
                .any(|r| r.name == ServiceMonitor::plural(&())),
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
