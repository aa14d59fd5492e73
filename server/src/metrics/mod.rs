//! vLLM-compatible Prometheus metrics. The engine thread is the only writer of engine metrics
//! (one process, one engine: nothing partial or doubled); a scrape only reads atomics, so it
//! never waits for an engine step.

use prometheus::{Encoder, Gauge, GaugeVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec};
use prometheus::{Opts, Registry, TextEncoder};

use crate::engine::core::FinishReason;

/// Labels every engine metric carries.
const LABELS: &[&str] = &["model_name", "engine"];
/// The single engine of this process.
const ENGINE: &str = "0";

#[derive(Debug, thiserror::Error)]
#[error("metrics: {0}")]
pub struct MetricsError(#[from] prometheus::Error);

/// The engine's metrics, bound to this server's `model_name`.
#[derive(Debug, Clone)]
pub struct EngineMetrics {
    registry: Registry,
    pub num_requests_running: IntGauge,
    pub num_requests_waiting: IntGauge,
    pub num_requests_swapped: IntGauge,
    pub kv_cache_usage_perc: Gauge,
    /// The same value under the older name that some autoscalers still query.
    pub gpu_cache_usage_perc: Gauge,
    pub cpu_cache_usage_perc: Gauge,
    pub prompt_tokens: IntCounter,
    pub generation_tokens: IntCounter,
    pub num_preemptions: IntCounter,
    /// Indexed by `FinishReason` (stop, length, abort).
    request_success: [IntCounter; 3],
}

impl EngineMetrics {
    pub fn new(model_name: &str) -> Result<Self, MetricsError> {
        let registry = Registry::new();
        let values = [model_name, ENGINE];
        let gauge_i = |name: &str, help: &str| -> Result<IntGauge, MetricsError> {
            let v = IntGaugeVec::new(Opts::new(name, help), LABELS)?;
            registry.register(Box::new(v.clone()))?;
            Ok(v.with_label_values(&values))
        };
        let gauge_f = |name: &str, help: &str| -> Result<Gauge, MetricsError> {
            let v = GaugeVec::new(Opts::new(name, help), LABELS)?;
            registry.register(Box::new(v.clone()))?;
            Ok(v.with_label_values(&values))
        };
        let counter = |name: &str, help: &str| -> Result<IntCounter, MetricsError> {
            let v = IntCounterVec::new(Opts::new(name, help), LABELS)?;
            registry.register(Box::new(v.clone()))?;
            Ok(v.with_label_values(&values))
        };
        let success = IntCounterVec::new(
            Opts::new(
                "vllm:request_success_total",
                "Count of finished requests by finish reason.",
            ),
            &["model_name", "engine", "finished_reason"],
        )?;
        registry.register(Box::new(success.clone()))?;
        #[cfg(target_os = "linux")]
        registry.register(Box::new(
            prometheus::process_collector::ProcessCollector::for_self(),
        ))?;
        let by_reason =
            |r: FinishReason| success.with_label_values(&[model_name, ENGINE, r.as_str()]);
        Ok(Self {
            num_requests_running: gauge_i(
                "vllm:num_requests_running",
                "Number of requests in the running batch.",
            )?,
            num_requests_waiting: gauge_i(
                "vllm:num_requests_waiting",
                "Number of requests waiting to be scheduled.",
            )?,
            num_requests_swapped: gauge_i(
                "vllm:num_requests_swapped",
                "Number of requests swapped out to host memory.",
            )?,
            kv_cache_usage_perc: gauge_f(
                "vllm:kv_cache_usage_perc",
                "Fraction of device KV-cache blocks in use (0 to 1).",
            )?,
            gpu_cache_usage_perc: gauge_f(
                "vllm:gpu_cache_usage_perc",
                "Fraction of device KV-cache blocks in use (0 to 1); older name.",
            )?,
            cpu_cache_usage_perc: gauge_f(
                "vllm:cpu_cache_usage_perc",
                "Fraction of host swap KV-cache blocks in use (0 to 1).",
            )?,
            prompt_tokens: counter(
                "vllm:prompt_tokens_total",
                "Number of prompt (prefill) tokens processed.",
            )?,
            generation_tokens: counter(
                "vllm:generation_tokens_total",
                "Number of generated tokens.",
            )?,
            num_preemptions: counter(
                "vllm:num_preemptions_total",
                "Number of preemptions of running requests.",
            )?,
            request_success: [
                by_reason(FinishReason::Stop),
                by_reason(FinishReason::Length),
                by_reason(FinishReason::Abort),
            ],
            registry,
        })
    }

    pub fn request_finished(&self, reason: FinishReason) {
        let i = match reason {
            FinishReason::Stop => 0,
            FinishReason::Length => 1,
            FinishReason::Abort => 2,
        };
        self.request_success[i].inc();
    }

    pub fn registry(&self) -> &Registry {
        &self.registry
    }

    /// The text exposition of every registered metric.
    pub fn encode(&self) -> Result<String, MetricsError> {
        let mut buf = Vec::new();
        TextEncoder::new().encode(&self.registry.gather(), &mut buf)?;
        Ok(String::from_utf8_lossy(&buf).into_owned())
    }
}
