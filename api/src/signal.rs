//! The autoscaling signals, named once. What the pods export (vLLM's metric names, which
//! ferrite-server speaks too), one pod's reading of them, their aggregate over an
//! InferenceService's pods, and the two names each aggregate goes by elsewhere: the `signal`
//! label of the operator's own series and the External Metrics API's metric name (which the
//! HPA the operator builds asks for). The operator's build step, autoscaler, External Metrics
//! API and telemetry read it, and the router's load scraper.

use k8s_openapi::apimachinery::pkg::api::resource::Quantity;

use crate::vllm;

/// Waiting requests, as vLLM and ferrite-server name it.
pub const WAITING: &str = vllm::NUM_REQUESTS_WAITING;
/// Running requests.
pub const RUNNING: &str = vllm::NUM_REQUESTS_RUNNING;
/// KV-cache usage: the current name, then the name vLLM used before v0.10.
pub const KV_USAGE: [&str; 2] = [vllm::KV_CACHE_USAGE_PERC, vllm::GPU_CACHE_USAGE_PERC];

/// Requests waiting in a ferrite-router for a saturated InferenceService (labels
/// `namespace`, `inferenceservice`, `model_name`): the autoscaler counts them as waiting on the
/// service's pods.
pub const ROUTER_QUEUED: &str = "ferrite_router_queued_requests";
/// Requests a ferrite-router holds for a service with no ready replica (scaled to zero or
/// starting), by `namespace` and `inferenceservice`: they wait on it as much as queued ones.
pub const ROUTER_HELD: &str = "ferrite_router_held_requests";

/// One aggregate signal of an InferenceService.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Signal {
    /// Waiting requests, summed over the reporting pods.
    RequestsWaiting,
    /// Running requests, summed.
    RequestsRunning,
    /// Waiting requests per reporting pod: what `targets.queuePerReplica` aims at.
    QueuePerReplica,
    /// KV-cache usage fraction 0..1, averaged: what `targets.kvCacheUsage` aims at.
    KvCacheUsage,
}

impl Signal {
    /// Every signal, in the order the External Metrics API lists them.
    pub const ALL: [Signal; 4] = [
        Signal::RequestsWaiting,
        Signal::RequestsRunning,
        Signal::QueuePerReplica,
        Signal::KvCacheUsage,
    ];

    /// The `signal` label of the operator's `ferrite_operator_autoscaler_*` series.
    pub fn label(self) -> &'static str {
        match self {
            Signal::RequestsWaiting => "requests_waiting",
            Signal::RequestsRunning => "requests_running",
            Signal::QueuePerReplica => "queue_per_replica",
            Signal::KvCacheUsage => "kv_cache_usage",
        }
    }

    /// The metric name on the External Metrics API.
    pub fn external_name(self) -> &'static str {
        match self {
            Signal::RequestsWaiting => "ferrite_requests_waiting",
            Signal::RequestsRunning => "ferrite_requests_running",
            Signal::QueuePerReplica => "ferrite_queue_per_replica",
            Signal::KvCacheUsage => "ferrite_kv_cache_usage",
        }
    }

    pub fn from_external_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|s| s.external_name() == name)
    }

    /// The value in `s`; `None` when no pod reported it (an absent value makes an HPA hold
    /// still, where a zero would scale down on missing data).
    pub fn value(self, s: &Signals) -> Option<f64> {
        if s.reporting == 0 {
            return None;
        }
        match self {
            Signal::RequestsWaiting => Some(s.waiting),
            Signal::RequestsRunning => Some(s.running),
            Signal::QueuePerReplica => s.queue_per_replica,
            Signal::KvCacheUsage => s.kv_usage,
        }
    }
}

/// The signals of one pod.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct PodMetrics {
    /// [`WAITING`].
    pub waiting: f64,
    /// [`RUNNING`].
    pub running: f64,
    /// [`KV_USAGE`], 0..1; `None` when the pod exports neither name.
    pub kv_usage: Option<f64>,
}

/// What one pod said, after scraping.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum PodSample {
    /// A ready pod whose `/metrics` was read.
    Ready(PodMetrics),
    /// A ready pod whose scrape failed or lacked a signal's metric: counted, but its value is
    /// unknown.
    Missing,
    /// A pod that is starting or not ready: no traffic reaches it yet.
    Unready,
}

/// The aggregate signals of one evaluation, for status, metrics and the External Metrics API.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Signals {
    /// Waiting requests per pod that reported, averaged.
    pub queue_per_replica: Option<f64>,
    /// KV-cache usage averaged over the pods that reported it.
    pub kv_usage: Option<f64>,
    /// Sums over the pods that reported.
    pub waiting: f64,
    pub running: f64,
    /// Pods whose metrics were read.
    pub reporting: usize,
    /// Ready pods whose scrape failed.
    pub missing: usize,
    pub unready: usize,
}

impl Signals {
    pub fn of(samples: &[PodSample]) -> Self {
        let mut s = Signals::default();
        let (mut kv_sum, mut kv_n) = (0.0, 0usize);
        for sample in samples {
            match sample {
                PodSample::Ready(m) => {
                    s.reporting += 1;
                    s.waiting += m.waiting;
                    s.running += m.running;
                    if let Some(kv) = m.kv_usage {
                        kv_sum += kv;
                        kv_n += 1;
                    }
                }
                PodSample::Missing => s.missing += 1,
                PodSample::Unready => s.unready += 1,
            }
        }
        if s.reporting > 0 {
            s.queue_per_replica = Some(s.waiting / s.reporting as f64);
        }
        if kv_n > 0 {
            s.kv_usage = Some(kv_sum / kv_n as f64);
        }
        s
    }
}

/// `v` as a Kubernetes quantity in milli-units ("1500m"), or a plain integer when whole ("3"):
/// how signal values and targets travel to an HPA. `None` for NaN and infinities, which no
/// quantity can hold.
pub fn quantity(v: f64) -> Option<Quantity> {
    if !v.is_finite() {
        return None;
    }
    let milli = (v * 1000.0).round() as i64;
    Some(Quantity(if milli % 1000 == 0 {
        (milli / 1000).to_string()
    } else {
        format!("{milli}m")
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The signals of ready pods reporting `(waiting, running, kv usage)` each.
    fn reported(pods: &[(f64, f64, Option<f64>)]) -> Signals {
        let samples: Vec<PodSample> = pods
            .iter()
            .map(|&(waiting, running, kv_usage)| {
                PodSample::Ready(PodMetrics {
                    waiting,
                    running,
                    kv_usage,
                })
            })
            .collect();
        Signals::of(&samples)
    }

    #[test]
    fn external_quantity_formats() {
        let q = |v| quantity(v).map(|q| q.0);
        assert_eq!(q(3.0), Some("3".into()));
        assert_eq!(q(0.0), Some("0".into()));
        assert_eq!(q(1.5), Some("1500m".into()));
        assert_eq!(q(0.4567), Some("457m".into()));
        assert_eq!(q(-0.25), Some("-250m".into()));
        assert_eq!(q(f64::NAN), None);
        assert_eq!(q(f64::INFINITY), None);
    }

    #[test]
    fn external_metric_values_need_reporting_pods() {
        let s = reported(&[
            (2.0, 1.0, Some(0.5)),
            (2.0, 1.0, Some(0.5)),
            (2.0, 2.0, Some(0.5)),
        ]);
        assert_eq!(Signal::RequestsWaiting.value(&s), Some(6.0));
        assert_eq!(Signal::RequestsRunning.value(&s), Some(4.0));
        assert_eq!(Signal::QueuePerReplica.value(&s), Some(2.0));
        assert_eq!(Signal::KvCacheUsage.value(&s), Some(0.5));
        let none = reported(&[]);
        for m in Signal::ALL {
            assert_eq!(m.value(&none), None, "{m:?}");
            assert_eq!(Signal::from_external_name(m.external_name()), Some(m));
        }
        assert_eq!(
            Signal::KvCacheUsage.value(&reported(&[(1.0, 1.0, None)])),
            None
        );
        assert_eq!(Signal::from_external_name("ferrite_other"), None);
    }

    #[test]
    fn every_signal_has_its_own_label() {
        let mut labels: Vec<_> = Signal::ALL.iter().map(|s| s.label()).collect();
        labels.sort_unstable();
        labels.dedup();
        assert_eq!(labels.len(), Signal::ALL.len());
    }
}
