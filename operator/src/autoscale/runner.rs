//! The autoscaler loop: one task per autoscaled InferenceService. The autoscaler follows the
//! InferenceServices itself ([`Autoscaler::follow`], fed by the watch caches) and starts, updates
//! or stops the tasks. Every scrape interval a task finds the pods (in the pod cache), scrapes
//! the ready ones, and in Builtin mode decides and writes the scale subresource. The signals go
//! to the [`SignalStore`] (for the External Metrics API) and a view to [`Views`], which the
//! status step reads; the reconcile that writes status is triggered from here, so status keeps
//! one writer. Nothing in the controller calls into the autoscaler.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{Api, Patch, PatchParams};
use kube::runtime::events::{Event, EventType, Recorder};
use kube::runtime::reflector::ObjectRef;
use kube::{Client, Resource, ResourceExt};
use serde_json::json;
use tokio::sync::{mpsc, watch};
use tokio::task::AbortHandle;

use super::algorithm::{Decision, Policy, ScalerState};
use super::routers::{self, RouterQueues};
use super::store::{Key, SignalStore, Snapshot};
use crate::cache::{Caches, Touch, Triggers};
use crate::config::FIELD_MANAGER;
use crate::status::{AutoscaleView, Finding, Verdict};
use crate::telemetry::AutoscalerMetrics;
use ferrite_api::crd::{AutoscalingMode, CurrentMetrics, InferenceService};
use ferrite_api::scrape::{PodResult, Scraper, pod_targets};
use ferrite_api::signal::{Signal, Signals};

/// How often metrics-only status changes are published at most (decisions publish at once).
const STATUS_REFRESH: Duration = Duration::from_secs(15);

/// What one task runs with; replaced in place when the spec changes.
#[derive(Debug, Clone, PartialEq)]
struct TaskConfig {
    mode: AutoscalingMode,
    policy: Policy,
    port: i32,
    labels: BTreeMap<String, String>,
}

struct Task {
    config: watch::Sender<TaskConfig>,
    abort: AbortHandle,
}

/// The autoscaler's published view of each InferenceService, for the status step: a read-only
/// handle, cheap to clone.
#[derive(Debug, Clone, Default)]
pub struct Views(Arc<Mutex<HashMap<Key, AutoscaleView>>>);

impl Views {
    /// The view of `key`: the last evaluation, or pending before the first.
    pub fn get(&self, key: &Key) -> AutoscaleView {
        self.0
            .lock()
            .ok()
            .and_then(|v| v.get(key).cloned())
            .unwrap_or_else(AutoscaleView::pending)
    }

    fn put(&self, key: Key, view: AutoscaleView) {
        if let Ok(mut v) = self.0.lock() {
            v.insert(key, view);
        }
    }

    fn remove(&self, key: &Key) {
        if let Ok(mut v) = self.0.lock() {
            v.remove(key);
        }
    }
}

/// The registry of autoscaler tasks, shared by every reconcile.
pub struct Autoscaler {
    client: Client,
    store: Arc<SignalStore>,
    metrics: AutoscalerMetrics,
    recorder: Recorder,
    scraper: Scraper,
    tasks: Mutex<HashMap<Key, Task>>,
    views: Views,
    caches: Caches,
    triggers: Arc<Triggers>,
    /// False on a standby replica: tasks scrape and feed the External Metrics API, but decide,
    /// write, record events and export per-InferenceService metrics only once it leads.
    acting: Arc<AtomicBool>,
    /// Requests the routers hold for each service (none without `--router-pods`).
    routers: RouterQueues,
    /// Whether this operator serves the External Metrics API HPA mode's HPAs read.
    external_metrics: bool,
}

impl std::fmt::Debug for Autoscaler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Autoscaler").finish_non_exhaustive()
    }
}

impl Autoscaler {
    /// Reads InferenceServices and pods from `caches`; publishes into `views`, and asks
    /// `triggers` for a reconcile when what the status shows changes (so status keeps one
    /// writer).
    pub fn new(
        client: Client,
        store: Arc<SignalStore>,
        metrics: AutoscalerMetrics,
        recorder: Recorder,
        caches: Caches,
        triggers: Arc<Triggers>,
        views: Views,
    ) -> Self {
        Self {
            client,
            store,
            metrics,
            recorder,
            scraper: Scraper::new(Duration::from_secs(2)),
            tasks: Mutex::new(HashMap::new()),
            views,
            caches,
            triggers,
            acting: Arc::new(AtomicBool::new(false)),
            routers: RouterQueues::default(),
            external_metrics: false,
        }
    }

    /// Says that this operator serves the External Metrics API (`--external-metrics-addr`):
    /// without it, HPA mode's status says its HPA cannot read the signals.
    pub fn serving_external_metrics(mut self, on: bool) -> Self {
        self.external_metrics = on;
        self
    }

    /// Counts the requests `routers` hold as waiting on each service's pods.
    pub fn with_routers(mut self, routers: RouterQueues) -> Self {
        self.routers = routers;
        self
    }

    /// Whether this replica acts on its decisions (it leads) or only observes (it stands by).
    pub fn set_acting(&self, acting: bool) {
        self.acting.store(acting, Ordering::Relaxed);
    }

    /// What the routers hold, by service.
    pub fn routers(&self) -> &RouterQueues {
        &self.routers
    }

    pub fn store(&self) -> &Arc<SignalStore> {
        &self.store
    }

    /// Follows the InferenceServices for the life of the process (leader and standby alike),
    /// keeping one task per autoscaled one.
    pub async fn follow(self: Arc<Self>, mut changes: mpsc::UnboundedReceiver<Touch>) {
        while let Some(t) = changes.recv().await {
            match t {
                Touch::Applied(isvc) => self.sync(&isvc),
                Touch::Deleted(r) => {
                    self.remove(&Key::new(r.namespace.unwrap_or_default(), r.name));
                }
                Touch::Owner(_) | Touch::Claim { .. } => {}
            }
        }
    }

    /// Starts, updates or stops the task of `isvc` to match its spec; cheap when nothing
    /// changed.
    fn sync(&self, isvc: &InferenceService) {
        let Some(ns) = isvc.namespace() else { return };
        let key = Key::new(ns, isvc.name_any());
        let wanted = (isvc.metadata.deletion_timestamp.is_none())
            .then_some(())
            .and(isvc.spec.autoscaling.as_ref())
            .map(|a| TaskConfig {
                mode: a.mode,
                policy: Policy::from_spec(a),
                port: isvc.port(),
                labels: isvc.labels().clone(),
            });
        let Ok(mut tasks) = self.tasks.lock() else {
            return;
        };
        match wanted {
            None => {
                if let Some(t) = tasks.remove(&key) {
                    t.abort.abort();
                    self.forget(&key);
                }
            }
            Some(config) => match tasks.get(&key) {
                Some(t) if !t.abort.is_finished() => {
                    t.config.send_if_modified(|c| {
                        let changed = *c != config;
                        *c = config;
                        changed
                    });
                }
                _ => {
                    let (tx, rx) = watch::channel(config);
                    let handle = tokio::spawn(run_task(self.task_env(key.clone()), rx));
                    tasks.insert(
                        key,
                        Task {
                            config: tx,
                            abort: handle.abort_handle(),
                        },
                    );
                }
            },
        }
    }

    fn forget(&self, key: &Key) {
        forget(&self.store, &self.views, &self.metrics, key);
    }

    /// Stops the task of an InferenceService that is gone.
    fn remove(&self, key: &Key) {
        let task = self.tasks.lock().ok().and_then(|mut t| t.remove(key));
        if let Some(t) = task {
            t.abort.abort();
            self.forget(key);
        }
    }

    fn task_env(&self, key: Key) -> TaskEnv {
        TaskEnv {
            key,
            client: self.client.clone(),
            store: self.store.clone(),
            metrics: self.metrics.clone(),
            recorder: self.recorder.clone(),
            scraper: self.scraper.clone(),
            views: self.views.clone(),
            caches: self.caches.clone(),
            triggers: self.triggers.clone(),
            acting: self.acting.clone(),
            routers: self.routers.clone(),
            external_metrics: self.external_metrics,
        }
    }
}

/// Drops everything kept about an InferenceService that is no longer autoscaled: its signals,
/// its status view and its metric series.
fn forget(store: &SignalStore, views: &Views, metrics: &AutoscalerMetrics, key: &Key) {
    store.remove(key);
    views.remove(key);
    metrics.forget(&key.namespace, &key.name);
}

/// Everything one task needs, owned.
struct TaskEnv {
    key: Key,
    client: Client,
    store: Arc<SignalStore>,
    metrics: AutoscalerMetrics,
    recorder: Recorder,
    scraper: Scraper,
    views: Views,
    caches: Caches,
    triggers: Arc<Triggers>,
    acting: Arc<AtomicBool>,
    routers: RouterQueues,
    external_metrics: bool,
}

impl TaskEnv {
    fn acting(&self) -> bool {
        self.acting.load(Ordering::Relaxed)
    }
}

async fn run_task(env: TaskEnv, mut config: watch::Receiver<TaskConfig>) {
    let epoch = Instant::now();
    let mut state = ScalerState::default();
    let mut published: Option<(AutoscaleView, Instant)> = None;
    let mut last_scale: Option<Time> = None;
    loop {
        let cfg = config.borrow_and_update().clone();
        let started = Instant::now();
        match evaluate(&env, &cfg, &mut state, epoch, &mut last_scale).await {
            Ok(Some(view)) => {
                let last = published.as_ref().map(|(v, at)| (v, at.elapsed()));
                let stale = worth_publishing(last, &view);
                env.views.put(env.key.clone(), view.clone());
                // Only the leader's reconciles write status; a standby's would pile up unread.
                if stale && env.acting() {
                    published = Some((view, Instant::now()));
                    let r = ObjectRef::new(&env.key.name).within(&env.key.namespace);
                    env.triggers.reconcile(r);
                }
            }
            Ok(None) => {
                tracing::debug!(key = %env.key, "InferenceService gone; autoscaler task ends");
                forget(&env.store, &env.views, &env.metrics, &env.key);
                return;
            }
            Err(e) => tracing::warn!(key = %env.key, error = %e, "autoscaler evaluation failed"),
        }
        let wait = cfg.policy.scrape_interval.saturating_sub(started.elapsed());
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            changed = config.changed() => if changed.is_err() { return },
        }
    }
}

/// Whether `view` should be published (a reconcile triggered to write it to status), given
/// the view last published and how long ago: a new outcome at once, new readings at most every
/// [`STATUS_REFRESH`], and an unchanged view never, so that with nothing changing nothing is
/// reconciled.
fn worth_publishing(last: Option<(&AutoscaleView, Duration)>, view: &AutoscaleView) -> bool {
    last.is_none_or(|(v, ago)| !same_outcome(v, view) || (v != view && ago >= STATUS_REFRESH))
}

/// Whether two views differ in more than their metric readings.
fn same_outcome(a: &AutoscaleView, b: &AutoscaleView) -> bool {
    a.desired_replicas == b.desired_replicas
        && a.last_scale_time == b.last_scale_time
        && a.active == b.active
        && a.limited == b.limited
        && a.scaled_to_zero == b.scaled_to_zero
}

/// One evaluation. `Ok(None)` when the InferenceService no longer exists.
async fn evaluate(
    env: &TaskEnv,
    cfg: &TaskConfig,
    state: &mut ScalerState,
    epoch: Instant,
    last_scale: &mut Option<Time>,
) -> Result<Option<AutoscaleView>, kube::Error> {
    let (ns, name) = (&env.key.namespace, &env.key.name);
    let isvcs: Api<InferenceService> = Api::namespaced(env.client.clone(), ns);
    let Some(isvc) = env.caches.isvc(ns, name) else {
        return Ok(None);
    };
    if last_scale.is_none() {
        // After a restart, keep the time the previous operator recorded.
        *last_scale = isvc.status.as_ref().and_then(|s| s.last_scale_time.clone());
    }
    let pods = env.caches.servers_of(ns, name);
    let targets = pod_targets(pods.iter().map(|p| &**p), cfg.port);
    let results = env.scraper.scrape_all(&targets).await;
    for r in &results {
        if let Some(e) = &r.error {
            tracing::debug!(key = %env.key, pod = %r.name, error = %e, "scrape failed");
            if !env.acting() {
                continue;
            }
            env.metrics
                .scrape_errors
                .with_label_values(&[ns, name, e.kind()])
                .inc();
        }
    }
    let mut samples: Vec<_> = results.iter().map(|r| r.sample).collect();
    // What the routers hold for it waits on its pods as much as their own queues do.
    routers::spread(&mut samples, env.routers.queued(&env.key));
    let signals = Signals::of(&samples);
    publish_signals(env, cfg, &signals);

    // HPA and KEDA mode: another controller writes the replicas.
    if cfg.mode != AutoscalingMode::Builtin || !env.acting() {
        let reader = match cfg.mode {
            AutoscalingMode::Hpa => Reader::Hpa {
                served: env.external_metrics,
            },
            AutoscalingMode::Keda => Reader::Keda,
            AutoscalingMode::Builtin => Reader::Standby,
        };
        return Ok(Some(reader_view(reader, &signals, &results)));
    }
    let current = isvc.desired_replicas();
    let decision = state.decide(&cfg.policy, epoch.elapsed(), current, &samples);
    let m = &env.metrics;
    m.recommended
        .with_label_values(&[ns, name])
        .set(decision.recommendation.into());
    m.desired
        .with_label_values(&[ns, name])
        .set(decision.desired.into());
    m.panic
        .with_label_values(&[ns, name])
        .set(i64::from(decision.panic));
    // spec.replicas itself may lie outside the bounds (the schema defaults it to 1): it is
    // written whenever it differs from the decision, as an HPA writes minReplicas.
    let written = isvc.spec.replicas.unwrap_or(1);
    if decision.desired != written {
        scale(env, &isvcs, &isvc, written, &decision).await?;
        *last_scale = Some(crate::status::now());
    }
    Ok(Some(builtin_view(
        &cfg.policy,
        &decision,
        &results,
        last_scale.clone(),
    )))
}

/// Writes spec.replicas through the scale subresource, then records an event and the metric.
async fn scale(
    env: &TaskEnv,
    isvcs: &Api<InferenceService>,
    isvc: &InferenceService,
    current: i32,
    decision: &Decision,
) -> Result<(), kube::Error> {
    let params = PatchParams {
        field_manager: Some(FIELD_MANAGER.into()),
        ..PatchParams::default()
    };
    let body = json!({"spec": {"replicas": decision.desired}});
    isvcs
        .patch_scale(&env.key.name, &params, &Patch::Merge(&body))
        .await?;
    let direction = if decision.desired > current {
        "up"
    } else {
        "down"
    };
    env.metrics
        .scale_actions
        .with_label_values(&[&env.key.namespace, &env.key.name, direction])
        .inc();
    let note = decision.describe(current);
    tracing::info!(key = %env.key, %note, "scaled");
    let event = Event {
        type_: EventType::Normal,
        reason: if direction == "up" {
            "ScaledUp"
        } else {
            "ScaledDown"
        }
        .into(),
        note: Some(note),
        action: "Scale".into(),
        secondary: None,
    };
    if let Err(e) = env.recorder.publish(&event, &isvc.object_ref(&())).await {
        tracing::warn!(key = %env.key, error = %e, "publishing a scale event");
    }
    Ok(())
}

fn publish_signals(env: &TaskEnv, cfg: &TaskConfig, signals: &Signals) {
    let (ns, name) = (&env.key.namespace, &env.key.name);
    let reporting = signals.reporting > 0;
    // The leader alone exports them, so dashboards that sum over operator pods count once.
    if env.acting() {
        for signal in Signal::ALL {
            let labels = [ns.as_str(), name.as_str(), signal.label()];
            let target = cfg.policy.target(signal);
            for (vec, v) in [
                (&env.metrics.signal, signal.value(signals)),
                (&env.metrics.target, target),
            ] {
                match v {
                    Some(v) => vec.with_label_values(&labels).set(v),
                    None => {
                        let _ = vec.remove_label_values(&labels);
                    }
                }
            }
        }
        env.metrics.init(ns, name);
    }
    if reporting {
        env.store.put(
            env.key.clone(),
            Snapshot {
                signals: *signals,
                at: SystemTime::now(),
                labels: cfg.labels.clone(),
            },
        );
    } else {
        // Stale numbers would mislead an HPA; absent ones make it hold still.
        env.store.remove(&env.key);
    }
}

fn current_metrics(s: &Signals) -> CurrentMetrics {
    // Rounded so that jitter in the last digits does not rewrite the status.
    let r = |v: f64| (v * 1000.0).round() / 1000.0;
    CurrentMetrics {
        queue_per_replica: s.queue_per_replica.map(r),
        kv_cache_usage: s.kv_usage.map(r),
        requests_waiting: r(s.waiting),
        requests_running: r(s.running),
        reporting_replicas: i32::try_from(s.reporting).unwrap_or(i32::MAX),
    }
}

/// `ScalingActive`: whether the signals could be read.
fn active(signals: &Signals, results: &[PodResult]) -> Verdict {
    if signals.reporting > 0 {
        let failed = results.iter().filter(|r| r.error.is_some()).count();
        let mut message = format!("read the metrics of {} ready pod(s)", signals.reporting);
        if failed > 0 {
            message.push_str(&format!("; {failed} could not be read"));
        }
        return (true, Finding::new("ValidMetricFound", message));
    }
    if let Some(e) = results
        .iter()
        .find_map(|r| r.error.as_ref().map(|e| (r, e)))
    {
        return (
            false,
            Finding::new(
                "FailedGetMetrics",
                format!("no pod's metrics could be read; pod {}: {}", e.0.name, e.1),
            ),
        );
    }
    (
        false,
        Finding::new(
            "NoReadyPods",
            "no ready pods to read metrics from; replicas are held",
        ),
    )
}

/// Who acts on the signals of a service this operator does not scale itself.
#[derive(Debug, Clone, Copy)]
enum Reader {
    /// HPA mode's HorizontalPodAutoscaler, through this operator's External Metrics API
    /// when it is `served`.
    Hpa { served: bool },
    /// KEDA's ScaledObject.
    Keda,
    /// The leading replica (this one stands by).
    Standby,
}

/// The view of a service another controller scales: the signals, and whether they reach it.
fn reader_view(reader: Reader, signals: &Signals, results: &[PodResult]) -> AutoscaleView {
    let (ok, mut f) = active(signals, results);
    let (ok, f) = match reader {
        // Whatever the pods say, the HPA reads nothing.
        Reader::Hpa { served: false } => (
            false,
            Finding::new(
                "ExternalMetricsOff",
                "HPA mode's HorizontalPodAutoscaler reads this operator's External Metrics API, \
                 which it does not serve (--external-metrics-addr off; the chart's \
                 externalMetrics.enabled): the HPA cannot read the signals",
            ),
        ),
        Reader::Hpa { served: true } if ok => {
            f.message
                .push_str("; served on the External Metrics API for the HorizontalPodAutoscaler");
            (ok, f)
        }
        _ => (ok, f),
    };
    AutoscaleView {
        desired_replicas: None,
        last_scale_time: None,
        metrics: (signals.reporting > 0).then(|| current_metrics(signals)),
        active: (ok, f),
        limited: None,
        scaled_to_zero: None,
    }
}

fn builtin_view(
    policy: &Policy,
    d: &Decision,
    results: &[PodResult],
    last_scale_time: Option<Time>,
) -> AutoscaleView {
    let scaled_to_zero = (policy.min_replicas == 0).then(|| {
        if d.desired == 0 {
            (
                true,
                Finding::new(
                    "IdleTimeout",
                    "no requests for idleTimeoutSeconds; scaled to zero. Set spec.replicas (kubectl scale) to wake it",
                ),
            )
        } else {
            (false, Finding::new("Serving", "replicas are running"))
        }
    });
    let active = if d.desired == 0 && d.signals.reporting == 0 {
        (
            false,
            Finding::new("ScaledToZero", "no pods run, so no metrics are read"),
        )
    } else {
        active(&d.signals, results)
    };
    let limited = match d.limit {
        Some(l) => (
            true,
            Finding::new(
                l.reason(),
                format!(
                    "the signals ask for {} replicas; held at {}",
                    d.recommendation, d.desired
                ),
            ),
        ),
        None => (
            false,
            Finding::new(
                "DesiredWithinRange",
                format!("the desired count {} is within range", d.desired),
            ),
        ),
    };
    AutoscaleView {
        desired_replicas: Some(d.desired),
        last_scale_time,
        metrics: (d.signals.reporting > 0).then(|| current_metrics(&d.signals)),
        active,
        limited: Some(limited),
        scaled_to_zero,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(desired: i32, waiting: f64) -> AutoscaleView {
        AutoscaleView {
            desired_replicas: Some(desired),
            last_scale_time: None,
            metrics: Some(CurrentMetrics {
                queue_per_replica: Some(waiting),
                kv_cache_usage: None,
                requests_waiting: waiting,
                requests_running: 0.0,
                reporting_replicas: 1,
            }),
            active: (true, Finding::new("ValidMetricFound", "read")),
            limited: None,
            scaled_to_zero: None,
        }
    }

    #[test]
    fn only_changed_views_are_published() {
        let (a, soon, later) = (view(2, 1.0), Duration::from_secs(1), STATUS_REFRESH);
        assert!(worth_publishing(None, &a), "the first view");
        assert!(!worth_publishing(Some((&a, soon)), &a), "unchanged, soon");
        assert!(
            !worth_publishing(Some((&a, later * 10)), &a),
            "unchanged, ever"
        );
        let readings = view(2, 3.0);
        assert!(
            !worth_publishing(Some((&a, soon)), &readings),
            "new readings, soon"
        );
        assert!(
            worth_publishing(Some((&a, later)), &readings),
            "new readings, later"
        );
        let outcome = view(3, 1.0);
        assert!(
            worth_publishing(Some((&a, soon)), &outcome),
            "a new outcome, at once"
        );
    }
}
