//! Requests waiting in the ferrite-routers. With flow control, a router holds the requests of
//! a service whose replicas are all saturated, so the servers' own queues stay short; the
//! autoscaler counts what the routers hold as waiting on the service's pods, and so adds
//! capacity before the servers' queues would have shown it.
//!
//! The router pods (a label selector in one namespace, as the chart deploys them) are watched,
//! and every ready one's `/metrics` read within the scraper's limits each interval. A router
//! that cannot be read counts nothing: its queue is extra demand, never a reason to scale down.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ferrite_api::scrape::{Scraper, pod_targets};
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use kube::runtime::{WatchStreamExt, reflector, watcher};

use super::store::Key;

/// Where the routers are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouterPods {
    pub namespace: String,
    /// A label selector of the router's pods.
    pub selector: String,
    /// The port of their `/metrics`.
    pub port: i32,
}

/// Requests waiting in all routers together, per InferenceService, as last read.
#[derive(Debug, Clone, Default)]
pub struct RouterQueues {
    queued: Arc<Mutex<HashMap<Key, f64>>>,
}

/// The most one service's router queue counts for: a router's output is read, not trusted.
const MAX_QUEUED: f64 = 1_000_000.0;

impl RouterQueues {
    /// Requests the routers hold for `key`.
    pub fn queued(&self, key: &Key) -> f64 {
        self.lock().get(key).copied().unwrap_or(0.0)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<Key, f64>> {
        self.queued.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Watches the routers at `pods` and reads their queues every `every`, for ever.
    pub fn start(client: kube::Client, pods: RouterPods, every: Duration) -> RouterQueues {
        let queues = RouterQueues::default();
        let api: Api<Pod> = Api::namespaced(client, &pods.namespace);
        let (store, writer) = reflector::store();
        let config = watcher::Config::default().labels(&pods.selector);
        let stream = watcher(api, config)
            .default_backoff()
            .reflect(writer)
            .applied_objects();
        tokio::spawn(async move {
            futures::pin_mut!(stream);
            while let Some(event) = stream.next().await {
                if let Err(e) = event {
                    tracing::debug!(error = %e, "watching the router pods");
                }
            }
        });
        let this = queues.clone();
        tokio::spawn(async move {
            let scraper =
                Scraper::new(every.clamp(Duration::from_millis(200), Duration::from_secs(2)));
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let routers = store.state();
                let targets = pod_targets(routers.iter().map(|p| &**p), pods.port);
                let mut sum: HashMap<Key, f64> = HashMap::new();
                for t in targets.iter().filter(|t| t.ready) {
                    match scraper.router_queues(&t.base_url).await {
                        Ok(q) => add(&mut sum, q.queued),
                        Err(e) => tracing::debug!(pod = %t.name, error = %e, "reading a router"),
                    }
                }
                *this.lock() = sum;
            }
        });
        queues
    }
}

/// Adds one router's queues to the sum, each within [`MAX_QUEUED`].
fn add(sum: &mut HashMap<Key, f64>, queued: HashMap<(String, String), f64>) {
    for ((namespace, name), n) in queued {
        let v = sum.entry(Key::new(namespace, name)).or_default();
        *v = (*v + n).min(MAX_QUEUED);
    }
}

/// Counts `queued` requests of the routers as waiting on the ready pods that reported,
/// spread evenly: the queue signals (per replica, and the sum) then include them, and a
/// decision on the queue target adds replicas for them. With no pod reporting there is
/// nothing to spread over (a service at zero is woken by the router's held requests).
pub fn spread(samples: &mut [ferrite_api::signal::PodSample], queued: f64) {
    use ferrite_api::signal::PodSample;
    if queued <= 0.0 || !queued.is_finite() {
        return;
    }
    let reporting = samples
        .iter()
        .filter(|s| matches!(s, PodSample::Ready(_)))
        .count();
    if reporting == 0 {
        return;
    }
    let each = queued / reporting as f64;
    for s in samples.iter_mut() {
        if let PodSample::Ready(m) = s {
            m.waiting += each;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ferrite_api::signal::{PodMetrics, PodSample, Signals};

    fn ready(waiting: f64) -> PodSample {
        PodSample::Ready(PodMetrics {
            waiting,
            running: 4.0,
            kv_usage: Some(0.5),
        })
    }

    #[test]
    fn a_routers_queue_counts_as_waiting_on_the_pods_that_reported() {
        let mut samples = vec![
            ready(1.0),
            ready(3.0),
            PodSample::Missing,
            PodSample::Unready,
        ];
        spread(&mut samples, 8.0);
        let s = Signals::of(&samples);
        assert_eq!(s.waiting, 12.0);
        assert_eq!(s.queue_per_replica, Some(6.0));
        // Nothing to spread over: unchanged.
        let mut none = vec![PodSample::Unready];
        spread(&mut none, 8.0);
        assert_eq!(none, vec![PodSample::Unready]);
        // Nonsense adds nothing.
        let mut samples = vec![ready(1.0)];
        spread(&mut samples, f64::NAN);
        spread(&mut samples, -3.0);
        assert_eq!(samples, vec![ready(1.0)]);
    }

    #[test]
    fn routers_are_summed_per_service_and_bounded() {
        let mut sum = HashMap::new();
        let one =
            |ns: &str, name: &str, n: f64| HashMap::from([((ns.to_string(), name.to_string()), n)]);
        add(&mut sum, one("a", "chat", 3.0));
        add(&mut sum, one("a", "chat", 2.0));
        add(&mut sum, one("b", "chat", 1.0));
        add(&mut sum, one("c", "x", 1e12));
        assert_eq!(sum[&Key::new("a", "chat")], 5.0);
        assert_eq!(sum[&Key::new("b", "chat")], 1.0);
        assert_eq!(sum[&Key::new("c", "x")], MAX_QUEUED);
    }
}
