//! The adapter sync loop: every interval, for each InferenceService with LoRA on, it reads
//! each ready replica's adapters (`/v1/models`), unloads what is no longer declared and loads
//! what is missing, then publishes `status.adapters` for the status step, asking for a
//! reconcile when it changed (status keeps one writer). Only the leader acts. A load that
//! failed on a replica is retried with backoff, not every round.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use kube::ResourceExt;
use kube::runtime::reflector::ObjectRef;

use super::client::PodApi;
use crate::autoscale::store::Key;
use crate::build::adapters::{self as plan, Outcome, Replica, Wanted};
use crate::cache::{Caches, Triggers};
use ferrite_api::crd::{AdapterStatus, InferenceService};
use ferrite_api::keys::{ApiKey, ApiKeys};
use ferrite_api::scrape::{PodTarget, pod_targets};

/// InferenceServices synced at once.
const CONCURRENCY: usize = 8;
/// Longest wait before a failed load is tried again.
const MAX_RETRY: Duration = Duration::from_secs(600);

/// What the sync loop last found per InferenceService, for the status step: a read-only
/// handle, cheap to clone.
#[derive(Debug, Clone, Default)]
pub struct AdapterViews(Arc<Mutex<HashMap<Key, Vec<AdapterStatus>>>>);

impl AdapterViews {
    /// The last summary of `key`; empty before the first.
    pub fn get(&self, key: &Key) -> Vec<AdapterStatus> {
        self.0
            .lock()
            .ok()
            .and_then(|v| v.get(key).cloned())
            .unwrap_or_default()
    }

    /// Stores `view`; whether it differs from what was there.
    fn put(&self, key: Key, view: Vec<AdapterStatus>) -> bool {
        self.0
            .lock()
            .map(|mut v| v.insert(key, view.clone()).is_none_or(|old| old != view))
            .unwrap_or(false)
    }

    fn retain(&self, keep: impl Fn(&Key) -> bool) {
        if let Ok(mut v) = self.0.lock() {
            v.retain(|k, _| keep(k));
        }
    }
}

/// A failed load of one adapter source on one pod.
#[derive(Debug, Clone)]
struct Failure {
    message: String,
    attempts: u32,
    next: Instant,
}

type FailureKey = (String, String, String);

/// The loop's state; see the module doc.
pub struct AdapterSync {
    caches: Caches,
    triggers: Arc<Triggers>,
    views: AdapterViews,
    api: PodApi,
    keys: Arc<ApiKeys>,
    interval: Duration,
    acting: AtomicBool,
    failures: Mutex<HashMap<FailureKey, Failure>>,
}

impl std::fmt::Debug for AdapterSync {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdapterSync")
            .field("interval", &self.interval)
            .finish_non_exhaustive()
    }
}

impl AdapterSync {
    pub fn new(
        caches: Caches,
        triggers: Arc<Triggers>,
        views: AdapterViews,
        keys: Arc<ApiKeys>,
        interval: Duration,
    ) -> Self {
        Self {
            caches,
            triggers,
            views,
            api: PodApi::new(Duration::from_secs(5), Duration::from_secs(600)),
            keys,
            interval,
            acting: AtomicBool::new(false),
            failures: Mutex::default(),
        }
    }

    /// Whether this replica changes the pods' adapters (it leads) or leaves them be.
    pub fn set_acting(&self, acting: bool) {
        self.acting.store(acting, Ordering::Relaxed);
    }

    /// Syncs every interval until `stop` resolves.
    pub async fn run(self: Arc<Self>, stop: impl std::future::Future<Output = ()>) {
        let mut tick = tokio::time::interval(self.interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        tokio::pin!(stop);
        loop {
            tokio::select! {
                _ = tick.tick() => {
                    if self.acting.load(Ordering::Relaxed) {
                        self.round().await;
                    }
                }
                _ = &mut stop => return,
            }
        }
    }

    /// One pass over every InferenceService with LoRA on.
    async fn round(&self) {
        let services: Vec<Arc<InferenceService>> = self
            .caches
            .isvcs
            .state()
            .into_iter()
            .filter(|i| plan::lora_enabled(i))
            .collect();
        let keys: HashSet<Key> = services.iter().map(|i| key(i)).collect();
        self.views.retain(|k| keys.contains(k));
        let secrets: HashSet<_> = services
            .iter()
            .filter_map(|i| {
                let secret = &i.spec.auth.as_ref()?.api_key_secret_ref;
                Some(ferrite_api::keys::slot(&i.namespace()?, secret))
            })
            .collect();
        self.keys.retain(|slot| secrets.contains(slot));
        let seen: Vec<Vec<String>> = futures::stream::iter(services)
            .map(|isvc| self.sync_service(isvc))
            .buffer_unordered(CONCURRENCY)
            .collect()
            .await;
        // Failures of pods that are gone (replaced, scaled away) are forgotten.
        let pods: HashSet<String> = seen.into_iter().flatten().collect();
        if let Ok(mut f) = self.failures.lock() {
            f.retain(|(pod, _, _), _| pods.contains(pod));
        }
    }

    /// Brings every ready replica of `isvc` to its declared adapters and publishes the
    /// summary; returns the pods it reached (by namespace-qualified name).
    async fn sync_service(&self, isvc: Arc<InferenceService>) -> Vec<String> {
        // An adapter the runtime cannot load is refused by the build step, as `Degraded`.
        let Ok(wanted) = plan::wanted(&isvc) else {
            return Vec::new();
        };
        let key = key(&isvc);
        // A service with an API key guards the adapter API with it too.
        let secret = isvc.spec.auth.as_ref().map(|a| &a.api_key_secret_ref);
        let api_key = match secret {
            None => None,
            Some(secret) => match self.keys.get(&key.namespace, secret).await {
                Ok(k) => Some(k),
                Err(e) => {
                    let why = AdapterStatus {
                        reason: Some(e.reason().into()),
                        message: Some(e.to_string()),
                        ..AdapterStatus::default()
                    };
                    let view = wanted
                        .iter()
                        .map(|w| AdapterStatus {
                            name: w.name.clone(),
                            ..why.clone()
                        })
                        .collect();
                    self.publish(&isvc, key, view);
                    return Vec::new();
                }
            },
        };
        let pods = self.caches.servers_of(&key.namespace, &key.name);
        let ready: Vec<PodTarget> = pod_targets(pods.iter().map(|p| &**p), isvc.port())
            .into_iter()
            .filter(|t| t.ready)
            .collect();
        let replicas = futures::future::join_all(
            ready
                .iter()
                .map(|pod| self.sync_replica(&key, pod, &wanted, api_key.as_ref())),
        )
        .await;
        // A pod that refused the key: the Secret may have been rotated since it was read.
        if let Some(secret) = secret
            && replicas.iter().any(|r| matches!(r, Replica::Refused(_)))
        {
            self.keys.forget(&key.namespace, secret);
        }
        self.publish(&isvc, key.clone(), plan::summarize(&wanted, &replicas));
        ready
            .iter()
            .map(|p| format!("{}/{}", key.namespace, p.name))
            .collect()
    }

    /// Stores `isvc`'s summary and, when it changed, asks for the reconcile that writes it.
    fn publish(&self, isvc: &InferenceService, key: Key, view: Vec<AdapterStatus>) {
        if self.views.put(key, view) {
            self.triggers.reconcile(ObjectRef::from_obj(isvc));
        }
    }

    /// One replica: unload what is not declared, load what is missing.
    async fn sync_replica(
        &self,
        key: &Key,
        pod: &PodTarget,
        wanted: &[Wanted],
        api_key: Option<&ApiKey>,
    ) -> Replica {
        let base = &pod.base_url;
        let resident = match self.api.resident(base, api_key).await {
            Ok(r) => r,
            Err(e) if e.unauthorized() => {
                return Replica::Refused(format!("pod {} refused the API key: {e}", pod.name));
            }
            Err(e) => return Replica::Unreachable(format!("pod {}: {e}", pod.name)),
        };
        let todo = plan::plan(wanted, &resident);
        for name in &todo.unload {
            match self.api.unload(base, name, api_key).await {
                Ok(()) => {
                    tracing::info!(service = %key, pod = pod.name, adapter = name, "adapter unloaded")
                }
                Err(e) => {
                    tracing::warn!(service = %key, pod = pod.name, adapter = name, error = %e, "unloading an adapter failed")
                }
            }
        }
        let mut out: BTreeMap<String, Outcome> = wanted
            .iter()
            .filter(|w| resident.get(&w.name) == Some(&w.path))
            .map(|w| (w.name.clone(), Outcome::Loaded))
            .collect();
        for w in todo.load {
            let fkey = (
                format!("{}/{}", key.namespace, pod.name),
                w.name.clone(),
                w.path.clone(),
            );
            if let Some(last) = self.retry_not_due(&fkey) {
                out.insert(w.name.clone(), Outcome::Failed(last));
                continue;
            }
            match self.api.load(base, &w, api_key).await {
                Ok(()) => {
                    tracing::info!(service = %key, pod = pod.name, adapter = w.name, path = w.path, "adapter loaded");
                    if let Ok(mut f) = self.failures.lock() {
                        f.remove(&fkey);
                    }
                    out.insert(w.name.clone(), Outcome::Loaded);
                }
                Err(e) => {
                    let message = format!("pod {}: {e}", pod.name);
                    tracing::warn!(service = %key, pod = pod.name, adapter = w.name, error = %e, "loading an adapter failed");
                    self.failed(fkey, &message);
                    out.insert(w.name.clone(), Outcome::Failed(message));
                }
            }
        }
        Replica::Reached(out)
    }

    /// The last failure's message while its retry is not due.
    fn retry_not_due(&self, k: &FailureKey) -> Option<String> {
        let f = self.failures.lock().ok()?;
        f.get(k)
            .filter(|f| Instant::now() < f.next)
            .map(|f| f.message.clone())
    }

    /// Records a failed load: the next try waits three intervals, doubling per failure.
    fn failed(&self, k: FailureKey, message: &str) {
        if let Ok(mut f) = self.failures.lock() {
            let attempts = f.get(&k).map_or(1, |x| x.attempts.saturating_add(1));
            let wait = crate::backoff::delay(self.interval.saturating_mul(3), attempts, MAX_RETRY);
            f.insert(
                k,
                Failure {
                    message: message.to_string(),
                    attempts,
                    next: Instant::now() + wait,
                },
            );
        }
    }
}

fn key(isvc: &InferenceService) -> Key {
    Key::new(isvc.namespace().unwrap_or_default(), isvc.name_any())
}
