//! The operator's own observability: Prometheus metrics on `/metrics`, and `/healthz` and
//! `/readyz` for the kubelet.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use prometheus::{
    Encoder, GaugeVec, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, IntGaugeVec,
    Opts, Registry, TextEncoder,
};

use ferrite_api::signal::Signal;

/// Reconcile duration buckets (seconds): fine below 100 ms, where a healthy reconcile sits.
const DURATION_BUCKETS: &[f64] = &[
    0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0,
];

#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    pub reconciles: IntCounter,
    pub errors: IntCounterVec,
    pub duration: Histogram,
    /// 1 while this replica holds the leader Lease.
    pub leader: IntGauge,
    pub autoscaler: AutoscalerMetrics,
}

/// Per-InferenceService autoscaler series, labelled `namespace` and `inferenceservice`.
#[derive(Debug, Clone)]
pub struct AutoscalerMetrics {
    /// The signals last read, by `signal` (`Signal::label`).
    pub signal: GaugeVec,
    /// The raw recommendation and the decided replica count.
    pub recommended: IntGaugeVec,
    pub desired: IntGaugeVec,
    /// Scale actions written, by `direction` (up, down).
    pub scale_actions: IntCounterVec,
    /// Failed pod scrapes, by `error` kind.
    pub scrape_errors: IntCounterVec,
    /// 1 while in panic mode.
    pub panic: IntGaugeVec,
    /// The spec's targets, by `signal` (queue_per_replica, kv_cache_usage), to draw against the
    /// signals.
    pub target: GaugeVec,
}

const ISVC_LABELS: [&str; 2] = ["namespace", "inferenceservice"];

impl AutoscalerMetrics {
    fn new(registry: &Registry) -> Result<Self, prometheus::Error> {
        let with = |extra: &'static str| {
            let mut l = ISVC_LABELS.to_vec();
            l.push(extra);
            l
        };
        let m = Self {
            signal: GaugeVec::new(
                Opts::new(
                    "ferrite_operator_autoscaler_signal",
                    "Load signals last scraped from an InferenceService's ready pods.",
                ),
                &with("signal"),
            )?,
            recommended: IntGaugeVec::new(
                Opts::new(
                    "ferrite_operator_autoscaler_recommended_replicas",
                    "Replicas the signals ask for, clamped to min/max, before windows and rate limits.",
                ),
                &ISVC_LABELS,
            )?,
            desired: IntGaugeVec::new(
                Opts::new(
                    "ferrite_operator_autoscaler_desired_replicas",
                    "Replicas the autoscaler decided on.",
                ),
                &ISVC_LABELS,
            )?,
            scale_actions: IntCounterVec::new(
                Opts::new(
                    "ferrite_operator_autoscaler_scale_actions_total",
                    "Writes of spec.replicas by the autoscaler, by direction.",
                ),
                &with("direction"),
            )?,
            scrape_errors: IntCounterVec::new(
                Opts::new(
                    "ferrite_operator_autoscaler_scrape_errors_total",
                    "Failed scrapes of ready pods, by kind of error.",
                ),
                &with("error"),
            )?,
            panic: IntGaugeVec::new(
                Opts::new(
                    "ferrite_operator_autoscaler_panic_mode",
                    "1 while the autoscaler is in panic mode for the InferenceService.",
                ),
                &ISVC_LABELS,
            )?,
            target: GaugeVec::new(
                Opts::new(
                    "ferrite_operator_autoscaler_target",
                    "The InferenceService's autoscaling target per signal, as in its spec.",
                ),
                &with("signal"),
            )?,
        };
        registry.register(Box::new(m.signal.clone()))?;
        registry.register(Box::new(m.target.clone()))?;
        registry.register(Box::new(m.recommended.clone()))?;
        registry.register(Box::new(m.desired.clone()))?;
        registry.register(Box::new(m.scale_actions.clone()))?;
        registry.register(Box::new(m.scrape_errors.clone()))?;
        registry.register(Box::new(m.panic.clone()))?;
        Ok(m)
    }

    /// Creates the scale counters of an InferenceService at 0, so that `increase()` over them
    /// sees its first scale (a counter born at 1 shows no increase).
    pub fn init(&self, namespace: &str, name: &str) {
        for direction in ["up", "down"] {
            self.scale_actions
                .with_label_values(&[namespace, name, direction])
                .inc_by(0);
        }
    }

    /// Drops every series of an InferenceService that is no longer autoscaled. Errors mean
    /// the series never existed, which is fine.
    pub fn forget(&self, namespace: &str, name: &str) {
        for v in [&self.recommended, &self.desired, &self.panic] {
            let _ = v.remove_label_values(&[namespace, name]);
        }
        for signal in Signal::ALL.map(Signal::label) {
            let _ = self.signal.remove_label_values(&[namespace, name, signal]);
            let _ = self.target.remove_label_values(&[namespace, name, signal]);
        }
        for direction in ["up", "down"] {
            let _ = self
                .scale_actions
                .remove_label_values(&[namespace, name, direction]);
        }
        for kind in SCRAPE_ERROR_KINDS {
            let _ = self
                .scrape_errors
                .remove_label_values(&[namespace, name, kind]);
        }
    }
}

/// Values of the scrape errors' `error` label (`ScrapeError::kind`).
pub const SCRAPE_ERROR_KINDS: [&str; 5] =
    ["connect", "status", "timeout", "parse", "missing_metric"];

impl Metrics {
    pub fn new() -> Result<Self, prometheus::Error> {
        let registry = Registry::new();
        let reconciles = IntCounter::with_opts(Opts::new(
            "ferrite_operator_reconciliations_total",
            "Reconciles of InferenceServices, successful or not.",
        ))?;
        let errors = IntCounterVec::new(
            Opts::new(
                "ferrite_operator_reconcile_errors_total",
                "Failed reconciles, by kind of error.",
            ),
            &["error"],
        )?;
        let duration = Histogram::with_opts(
            HistogramOpts::new(
                "ferrite_operator_reconcile_duration_seconds",
                "Wall time of one reconcile, API calls included.",
            )
            .buckets(DURATION_BUCKETS.to_vec()),
        )?;
        let leader = IntGauge::with_opts(Opts::new(
            "ferrite_operator_leader",
            "1 while this replica holds the leader Lease.",
        ))?;
        registry.register(Box::new(reconciles.clone()))?;
        registry.register(Box::new(errors.clone()))?;
        registry.register(Box::new(duration.clone()))?;
        registry.register(Box::new(leader.clone()))?;
        let autoscaler = AutoscalerMetrics::new(&registry)?;
        #[cfg(target_os = "linux")]
        registry.register(Box::new(
            prometheus::process_collector::ProcessCollector::for_self(),
        ))?;
        Ok(Self {
            registry,
            reconciles,
            errors,
            duration,
            leader,
            autoscaler,
        })
    }

    /// Counts a reconcile; `error` is the failure's low-cardinality kind.
    pub fn observe_reconcile(&self, took: Duration, error: Option<&str>) {
        self.reconciles.inc();
        self.duration.observe(took.as_secs_f64());
        if let Some(kind) = error {
            self.errors.with_label_values(&[kind]).inc();
        }
    }

    /// The text exposition format.
    pub fn encode(&self) -> Result<String, prometheus::Error> {
        let mut buf = Vec::new();
        TextEncoder::new().encode(&self.registry.gather(), &mut buf)?;
        String::from_utf8(buf).map_err(|e| prometheus::Error::Msg(e.to_string()))
    }
}

/// Liveness and readiness as the probes see them.
#[derive(Debug, Default)]
pub struct Health {
    /// Set once the operator has reached the API server (as leader or standby).
    pub ready: AtomicBool,
    /// Set when this replica lost its leader Lease and is about to exit: `/healthz` fails
    /// first, so a kubelet that finds it before the exit restarts it anyway.
    pub failed: AtomicBool,
}

#[derive(Debug, Clone)]
struct HttpState {
    metrics: Arc<Metrics>,
    health: Arc<Health>,
}

/// `/metrics`, `/healthz` and `/readyz`.
pub fn router(metrics: Arc<Metrics>, health: Arc<Health>) -> Router {
    Router::new()
        .route("/metrics", get(metrics_handler))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .with_state(HttpState { metrics, health })
}

async fn metrics_handler(State(s): State<HttpState>) -> impl IntoResponse {
    match s.metrics.encode() {
        Ok(text) => (
            StatusCode::OK,
            [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
            text,
        ),
        Err(e) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            [(header::CONTENT_TYPE, "text/plain")],
            format!("encoding metrics: {e}"),
        ),
    }
}

async fn healthz(State(s): State<HttpState>) -> impl IntoResponse {
    if s.health.failed.load(Ordering::Relaxed) {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "lost the leader Lease; exiting",
        )
    } else {
        (StatusCode::OK, "ok")
    }
}

async fn readyz(State(s): State<HttpState>) -> impl IntoResponse {
    if s.health.failed.load(Ordering::Relaxed) {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "lost the leader Lease; exiting",
        )
    } else if s.health.ready.load(Ordering::Relaxed) {
        (StatusCode::OK, "ready")
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "not connected to the API server yet",
        )
    }
}
