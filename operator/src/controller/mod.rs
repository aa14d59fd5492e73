//! The I/O half of the operator: the kube-rs `Controller` over the watch caches, one reconcile
//! per InferenceService, and the retry policy. Reconcile runs dereference → validate → build →
//! apply → status.

pub mod apply;
pub mod discovery;
mod reconcile;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use kube::api::Api;
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Recorder, Reporter};
use kube::runtime::reflector::ObjectRef;
use kube::{Client, ResourceExt};
use tokio::sync::mpsc;

pub use reconcile::reconcile;

use crate::adapters::sync::AdapterViews;
use crate::autoscale::runner::Views;
use crate::build::model::claims_of;
use crate::cache::{Caches, Touch, Triggers};
use crate::config::{FIELD_MANAGER, OperatorConfig};
use crate::telemetry::Metrics;
use discovery::MonitorDiscovery;
use ferrite_api::crd::InferenceService;

/// Reconcile failures. Each is retried with backoff; none stops the controller.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{kind} {name}: {source}")]
    Kube {
        kind: String,
        name: String,
        #[source]
        source: kube::Error,
    },
    #[error("API discovery: {0}")]
    Discovery(#[source] kube::Error),
    #[error("serializing an object: {0}")]
    Serialize(#[source] serde_json::Error),
    #[error("a built object has no name")]
    Unnamed,
    #[error("the InferenceService has no {0}")]
    Metadata(&'static str),
    #[error("the {0} cache is not ready")]
    Cache(&'static str),
    /// A child was refused for good; status shows it as `Degraded`.
    #[error("{0}")]
    Refused(String),
    /// An object with a child's name exists and this InferenceService does not control it.
    #[error(
        "{kind} {name} already exists and is not controlled by this InferenceService; \
         the operator will not take it over (rename one of them, or delete the {kind})"
    )]
    ChildConflict { kind: String, name: String },
}

impl Error {
    /// Wraps a kube error with the object it concerns.
    pub fn kube(kind: impl Into<String>, name: &str) -> impl FnOnce(kube::Error) -> Error {
        let (kind, name) = (kind.into(), name.to_string());
        move |source| Error::Kube { kind, name, source }
    }

    /// Low-cardinality label for the errors metric.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Error::Kube {
                source: kube::Error::Api(s),
                ..
            } if s.code == 409 => "conflict",
            Error::Kube {
                source: kube::Error::Api(_),
                ..
            } => "api",
            Error::Kube { .. } => "transport",
            Error::Discovery(_) => "discovery",
            Error::Serialize(_) => "serialize",
            Error::Unnamed | Error::Metadata(_) => "invalid_object",
            Error::Cache(_) => "cache",
            Error::Refused(_) | Error::ChildConflict { .. } => "refused",
        }
    }
}

/// Timing knobs, shortened in tests.
#[derive(Debug, Clone)]
pub struct Timing {
    /// Requeue while a rollout is under way (pod failures are not watched; this finds them).
    pub progressing: Duration,
    /// Requeue when settled: a periodic resync.
    pub settled: Duration,
    /// Requeue when the spec cannot be applied (a missing claim may appear).
    pub blocked: Duration,
    /// First retry after an error; doubles per consecutive failure up to `max_backoff`.
    pub min_backoff: Duration,
    pub max_backoff: Duration,
    /// How long the ServiceMonitor CRD check is cached.
    pub discovery_ttl: Duration,
}

impl Default for Timing {
    fn default() -> Self {
        Self {
            progressing: Duration::from_secs(15),
            settled: Duration::from_secs(300),
            blocked: Duration::from_secs(60),
            min_backoff: Duration::from_secs(1),
            max_backoff: Duration::from_secs(300),
            discovery_ttl: Duration::from_secs(60),
        }
    }
}

/// Shared state of every reconcile.
pub struct Context {
    pub client: Client,
    pub config: OperatorConfig,
    pub metrics: Arc<Metrics>,
    pub recorder: Recorder,
    pub discovery: MonitorDiscovery,
    pub timing: Timing,
    /// What reconciles read instead of the API server.
    pub caches: Caches,
    /// Where requests for reconciles go (the controller's queue while this replica leads).
    pub triggers: Arc<Triggers>,
    /// What the autoscaler publishes for the status step; reconciles only read it.
    pub autoscale: Views,
    /// What the adapter sync publishes for the status step; reconciles only read it.
    pub adapters: AdapterViews,
    /// What each child looked like after the operator last wrote it (drift detection).
    pub applied: apply::Memo,
    failures: Mutex<HashMap<String, u32>>,
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context")
            .field("config", &self.config)
            .field("timing", &self.timing)
            .finish_non_exhaustive()
    }
}

impl Context {
    pub fn new(
        client: Client,
        config: OperatorConfig,
        metrics: Arc<Metrics>,
        timing: Timing,
        caches: Caches,
        autoscale: Views,
        adapters: AdapterViews,
    ) -> Self {
        let reporter = Reporter {
            controller: FIELD_MANAGER.into(),
            instance: std::env::var("POD_NAME").ok(),
        };
        let recorder = Recorder::new(client.clone(), reporter);
        let triggers = Arc::new(Triggers::default());
        Self {
            recorder,
            autoscale,
            adapters,
            caches,
            triggers,
            applied: apply::Memo::default(),
            discovery: MonitorDiscovery::new(timing.discovery_ttl),
            client,
            config,
            metrics,
            timing,
            failures: Mutex::new(HashMap::new()),
        }
    }

    fn key(isvc: &InferenceService) -> String {
        format!(
            "{}/{}",
            isvc.namespace().unwrap_or_default(),
            isvc.name_any()
        )
    }

    /// Clears the backoff of an object that reconciled.
    fn succeeded(&self, isvc: &InferenceService) {
        if let Ok(mut f) = self.failures.lock() {
            f.remove(&Self::key(isvc));
        }
    }

    /// The next retry delay for an object that failed: exponential, capped.
    fn backoff(&self, isvc: &InferenceService) -> Duration {
        let n = self.failures.lock().map_or(0, |mut f| {
            let n = f.entry(Self::key(isvc)).or_insert(0);
            *n = n.saturating_add(1);
            *n
        });
        crate::backoff::delay(self.timing.min_backoff, n, self.timing.max_backoff)
    }
}

/// Retry with per-object exponential backoff, so a failing object neither hot-loops nor
/// delays the others.
pub fn error_policy(isvc: Arc<InferenceService>, error: &Error, ctx: Arc<Context>) -> Action {
    let delay = ctx.backoff(&isvc);
    tracing::warn!(
        namespace = isvc.namespace().unwrap_or_default(),
        name = isvc.name_any(),
        error = %error,
        retry_in_ms = delay.as_millis() as u64,
        "reconcile failed"
    );
    Action::requeue(delay)
}

/// Turns cache changes into reconcile requests, for the life of the process (leader and
/// standby alike; a standby's requests go nowhere).
pub async fn dispatch(mut touches: mpsc::UnboundedReceiver<Touch>, ctx: Arc<Context>) {
    while let Some(t) = touches.recv().await {
        match t {
            Touch::Applied(isvc) => {
                ctx.triggers.reconcile(ObjectRef::from_obj(&*isvc));
                reconcile_name_peers(&ctx, Some(&ferrite_api::served::served_name(&isvc)));
            }
            Touch::Deleted(r) => {
                let ns = r.namespace.clone().unwrap_or_default();
                ctx.applied.forget_owner(&ns, &r.name);
                reconcile_name_peers(&ctx, None);
            }
            Touch::Owner(r) => ctx.triggers.reconcile(r),
            Touch::Claim { namespace, name } => {
                for isvc in ctx.caches.isvcs.state() {
                    if isvc.metadata.namespace.as_deref() == Some(namespace.as_str())
                        && claims_of(&isvc).iter().any(|(_, c)| *c == name)
                    {
                        ctx.triggers.reconcile(ObjectRef::from_obj(&*isvc));
                    }
                }
            }
        }
    }
}

/// A served name's holder changes when a claimant appears, renames or goes: the other
/// claimants of `name`, and every InferenceService now marked `ServedNameConflict`, are
/// reconciled so their `Ready` follows.
fn reconcile_name_peers(ctx: &Context, name: Option<&str>) {
    for other in ctx.caches.isvcs.state() {
        let claims = name.is_some_and(|n| ferrite_api::served::served_name(&other) == n);
        let marked = other
            .status
            .as_ref()
            .and_then(|s| crate::status::condition(s, crate::status::READY))
            .is_some_and(|c| c.reason == crate::status::SERVED_NAME_CONFLICT);
        if claims || marked {
            ctx.triggers.reconcile(ObjectRef::from_obj(&*other));
        }
    }
}

/// Runs the controller until `shutdown` resolves, then lets in-flight reconciles finish.
/// Every InferenceService is reconciled once at the start; after that, whatever the caches
/// and the autoscaler report. The caller says when the autoscaler acts (it leads).
pub async fn run(
    ctx: Arc<Context>,
    shutdown: impl std::future::Future<Output = ()> + Send + Sync + 'static,
) -> anyhow::Result<()> {
    let isvcs: Api<InferenceService> = Api::all(ctx.client.clone());
    let shutdown = futures::FutureExt::shared(shutdown);
    // Fail fast with a clear message when the CRD is missing (the API server answers 404)
    // instead of retrying forever. Any other failure (the API server unreachable for a moment)
    // is retried: an outage is the leader Lease's business, which ends the process once it
    // cannot renew.
    loop {
        match isvcs
            .list_metadata(&kube::api::ListParams::default().limit(1))
            .await
        {
            Ok(_) => break,
            Err(kube::Error::Api(e)) if e.code == 404 => {
                anyhow::bail!("listing InferenceServices: the CRD is not installed ({e})")
            }
            Err(e) => tracing::warn!(error = %e, "listing InferenceServices; retrying"),
        }
        tokio::select! {
            _ = tokio::time::sleep(std::time::Duration::from_secs(1)) => {}
            _ = shutdown.clone() => return Ok(()),
        }
    }
    let requests = ctx.triggers.attach();
    tokio::select! {
        r = ctx.caches.ready() => r.map_err(|e| anyhow::anyhow!("watch caches: {e}"))?,
        _ = shutdown.clone() => return Ok(()),
    }
    for isvc in ctx.caches.isvcs.state() {
        ctx.triggers.reconcile(ObjectRef::from_obj(&*isvc));
    }
    let requests = futures::stream::unfold(requests, |mut rx| async move {
        rx.recv().await.map(|r| (r, rx))
    });
    Controller::for_stream(futures::stream::pending(), ctx.caches.isvcs.clone())
        .reconcile_on(requests)
        .graceful_shutdown_on(shutdown)
        .run(reconcile, error_policy, ctx.clone())
        .for_each(|res| async move {
            match res {
                Ok((obj, _)) => tracing::debug!(object = %obj, "reconciled"),
                Err(e) => tracing::debug!(error = %e, "reconcile attempt failed"),
            }
        })
        .await;
    ctx.triggers.detach();
    Ok(())
}
