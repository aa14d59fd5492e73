//! The engine's metrics: the Prometheus sink of its stats records, in groups that each
//! register their own collectors and read their part of a record.

use prometheus::core::Collector;
use prometheus::{Gauge, GaugeVec, Histogram, HistogramOpts, HistogramVec, IntCounter};
use prometheus::{IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry};

use ferrite_api::vllm;
use ferrite_runtime::engine::FinishReason;
use ferrite_runtime::engine::stats::{
    FinishedRequest, IterationStats, LoraStats, SchedulerStats, StatsSink,
};

use super::{ENGINE, LABELS, MetricsError, buckets_1_2_5};

const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
const TOKEN_LATENCY_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
];
const REQUEST_LATENCY_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];
const N_BUCKETS: &[f64] = &[1.0, 2.0, 5.0, 10.0, 20.0];
const ITERATION_TOKEN_BUCKETS: &[f64] = &[
    1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0, 16384.0,
];

/// Python's spelling of a boolean, which vLLM's info labels carry.
fn python_bool(b: bool) -> &'static str {
    if b { "True" } else { "False" }
}

/// What `vllm:cache_config_info` reports.
#[derive(Debug, Clone, PartialEq)]
pub struct CacheInfo {
    pub block_size: usize,
    pub num_gpu_blocks: usize,
    pub num_cpu_blocks: usize,
    pub cache_dtype: String,
    pub swap_space_gib: f64,
    pub enable_prefix_caching: bool,
}

/// The engine's metrics, bound to this server's `model_name`.
#[derive(Debug, Clone)]
pub struct EngineMetrics {
    scheduler: SchedulerGauges,
    tokens: TokenCounters,
    finished: FinishCounters,
    latency: LatencyHistograms,
    sizes: SizeHistograms,
    lora: Option<LoraInfo>,
}

impl EngineMetrics {
    /// Registers every engine metric on `registry`. Request-size buckets run up to
    /// `max_model_len`.
    pub fn new(
        registry: &Registry,
        model_name: &str,
        max_model_len: usize,
        cache: &CacheInfo,
    ) -> Result<Self, MetricsError> {
        let b = Builder {
            registry,
            values: [model_name, ENGINE],
        };
        register_cache_info(&b, cache)?;
        Ok(Self {
            scheduler: SchedulerGauges::new(&b)?,
            tokens: TokenCounters::new(&b)?,
            finished: FinishCounters::new(&b)?,
            latency: LatencyHistograms::new(&b)?,
            sizes: SizeHistograms::new(&b, max_model_len)?,
            lora: None,
        })
    }

    /// Also reports the adapters in use (`vllm:lora_requests_info`), as vLLM does when LoRA
    /// is on.
    pub fn with_lora(
        mut self,
        registry: &Registry,
        max_loras: usize,
    ) -> Result<Self, MetricsError> {
        self.lora = Some(LoraInfo::new(registry, max_loras)?);
        Ok(self)
    }
}

/// `vllm:lora_requests_info`. vLLM adds a series for every new combination of adapters and
/// keeps the old ones; here the gauge holds only the current one, so a server whose adapters
/// change all day does not grow its exposition (readers take the newest series anyway).
#[derive(Debug, Clone)]
struct LoraInfo {
    gauge: GaugeVec,
    max_lora: String,
}

impl LoraInfo {
    fn new(registry: &Registry, max_loras: usize) -> Result<Self, MetricsError> {
        let gauge = GaugeVec::new(
            Opts::new(vllm::LORA_REQUESTS_INFO, "Running stats on lora requests."),
            &[vllm::LORA_MAX, vllm::LORA_WAITING, vllm::LORA_RUNNING],
        )?;
        registry.register(Box::new(gauge.clone()))?;
        Ok(Self {
            gauge,
            max_lora: max_loras.to_string(),
        })
    }

    fn record(&self, l: &LoraStats) {
        let (waiting, running) = (l.waiting.join(","), l.running.join(","));
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        self.gauge.reset();
        self.gauge
            .with_label_values(&[&self.max_lora, &waiting, &running])
            .set(now);
    }
}

impl StatsSink for EngineMetrics {
    fn record(&mut self, s: &SchedulerStats, it: &IterationStats) {
        self.scheduler.record(s);
        self.tokens.record(it);
        self.latency.record_step(it);
        if let Some(l) = &self.lora {
            l.record(&it.lora);
        }
        for f in &it.finished {
            self.finished.record(f.reason);
            self.latency.record_finished(f);
            self.sizes.record(f);
        }
    }
}

/// `vllm:cache_config_info`: one series, value 1, whose labels are the cache's settings.
fn register_cache_info(b: &Builder<'_>, cache: &CacheInfo) -> Result<(), MetricsError> {
    let info = b.register(GaugeVec::new(
        Opts::new(
            "vllm:cache_config_info",
            "Information of the KV cache config.",
        ),
        &[
            "model_name",
            "engine",
            "block_size",
            "num_gpu_blocks",
            "num_cpu_blocks",
            "cache_dtype",
            "swap_space",
            "enable_prefix_caching",
        ],
    )?)?;
    let [model_name, engine] = b.values;
    info.with_label_values(&[
        model_name,
        engine,
        &cache.block_size.to_string(),
        &cache.num_gpu_blocks.to_string(),
        &cache.num_cpu_blocks.to_string(),
        &cache.cache_dtype,
        &cache.swap_space_gib.to_string(),
        python_bool(cache.enable_prefix_caching),
    ])
    .set(1.0);
    Ok(())
}

/// The scheduler's state after each step.
#[derive(Debug, Clone)]
struct SchedulerGauges {
    num_requests_running: IntGauge,
    num_requests_waiting: IntGauge,
    num_requests_swapped: IntGauge,
    kv_cache_usage_perc: Gauge,
    /// The same value under the older name that some autoscalers still query.
    gpu_cache_usage_perc: Gauge,
    cpu_cache_usage_perc: Gauge,
}

impl SchedulerGauges {
    fn new(b: &Builder<'_>) -> Result<Self, MetricsError> {
        Ok(Self {
            num_requests_running: b.int_gauge(
                vllm::NUM_REQUESTS_RUNNING,
                "Number of requests in the running batch.",
            )?,
            num_requests_waiting: b.int_gauge(
                vllm::NUM_REQUESTS_WAITING,
                "Number of requests waiting to be scheduled.",
            )?,
            num_requests_swapped: b.int_gauge(
                "vllm:num_requests_swapped",
                "Number of requests swapped out to host memory.",
            )?,
            kv_cache_usage_perc: b.gauge(
                vllm::KV_CACHE_USAGE_PERC,
                "Fraction of device KV-cache blocks in use (0 to 1).",
            )?,
            gpu_cache_usage_perc: b.gauge(
                vllm::GPU_CACHE_USAGE_PERC,
                "Fraction of device KV-cache blocks in use (0 to 1); older name.",
            )?,
            cpu_cache_usage_perc: b.gauge(
                "vllm:cpu_cache_usage_perc",
                "Fraction of host swap KV-cache blocks in use (0 to 1).",
            )?,
        })
    }

    fn record(&self, s: &SchedulerStats) {
        self.num_requests_running.set(s.num_running as i64);
        self.num_requests_waiting.set(s.num_waiting as i64);
        self.num_requests_swapped.set(s.num_swapped as i64);
        self.kv_cache_usage_perc.set(s.kv_cache_usage);
        self.gpu_cache_usage_perc.set(s.kv_cache_usage);
        self.cpu_cache_usage_perc.set(s.cpu_cache_usage);
    }
}

/// Tokens processed, preemptions and prefix-cache lookups, summed over steps.
#[derive(Debug, Clone)]
struct TokenCounters {
    prompt_tokens: IntCounter,
    generation_tokens: IntCounter,
    num_preemptions: IntCounter,
    prefix_cache_queries: IntCounter,
    prefix_cache_hits: IntCounter,
    /// vLLM V0's name: hits over queries since start (older dashboards plot it directly).
    gpu_prefix_cache_hit_rate: Gauge,
}

impl TokenCounters {
    fn new(b: &Builder<'_>) -> Result<Self, MetricsError> {
        Ok(Self {
            prompt_tokens: b.counter(
                "vllm:prompt_tokens_total",
                "Number of prompt (prefill) tokens processed.",
            )?,
            generation_tokens: b.counter(
                "vllm:generation_tokens_total",
                "Number of generated tokens.",
            )?,
            num_preemptions: b.counter(
                "vllm:num_preemptions_total",
                "Number of preemptions of running requests.",
            )?,
            prefix_cache_queries: b.counter(
                "vllm:prefix_cache_queries_total",
                "Prefix cache queries, in terms of number of queried tokens.",
            )?,
            prefix_cache_hits: b.counter(
                "vllm:prefix_cache_hits_total",
                "Prefix cache hits, in terms of number of cached tokens.",
            )?,
            gpu_prefix_cache_hit_rate: b.gauge(
                "vllm:gpu_prefix_cache_hit_rate",
                "Prefix cache hit rate since start: cached over queried prompt tokens (0 to 1).",
            )?,
        })
    }

    fn record(&self, it: &IterationStats) {
        self.prompt_tokens.inc_by(it.num_prompt_tokens);
        self.generation_tokens.inc_by(it.num_generation_tokens);
        self.num_preemptions.inc_by(it.num_preempted);
        if it.prefix_cache_queries > 0 {
            self.prefix_cache_queries.inc_by(it.prefix_cache_queries);
            self.prefix_cache_hits.inc_by(it.prefix_cache_hits);
            let queries = self.prefix_cache_queries.get() as f64;
            self.gpu_prefix_cache_hit_rate
                .set(self.prefix_cache_hits.get() as f64 / queries);
        }
    }
}

/// `vllm:request_success_total` by finish reason.
#[derive(Debug, Clone)]
struct FinishCounters {
    /// Indexed by `FinishReason` (stop, length, abort).
    by_reason: [IntCounter; 3],
}

impl FinishCounters {
    fn new(b: &Builder<'_>) -> Result<Self, MetricsError> {
        let success = b.register(IntCounterVec::new(
            Opts::new(
                "vllm:request_success_total",
                "Count of finished requests by finish reason.",
            ),
            &["model_name", "engine", "finished_reason"],
        )?)?;
        let [model_name, engine] = b.values;
        let by_reason =
            |r: FinishReason| success.with_label_values(&[model_name, engine, r.as_str()]);
        Ok(Self {
            by_reason: [
                by_reason(FinishReason::Stop),
                by_reason(FinishReason::Length),
                by_reason(FinishReason::Abort),
            ],
        })
    }

    fn record(&self, reason: FinishReason) {
        let i = match reason {
            FinishReason::Stop => 0,
            FinishReason::Length => 1,
            FinishReason::Abort => 2,
        };
        self.by_reason[i].inc();
    }
}

/// Time: per step (first tokens, gaps between tokens, queueing) and per finished request.
#[derive(Debug, Clone)]
struct LatencyHistograms {
    time_to_first_token: Histogram,
    inter_token_latency: Histogram,
    /// The seed's per-token name for the same observation as `inter_token_latency`.
    time_per_output_token: Histogram,
    request_time_per_output_token: Histogram,
    e2e_request_latency: Histogram,
    request_queue_time: Histogram,
    request_inference_time: Histogram,
    request_prefill_time: Histogram,
    request_decode_time: Histogram,
    iteration_tokens: Histogram,
}

impl LatencyHistograms {
    fn new(b: &Builder<'_>) -> Result<Self, MetricsError> {
        Ok(Self {
            time_to_first_token: b.histogram(
                "vllm:time_to_first_token_seconds",
                "Time from arrival to the first generated token, in seconds.",
                TTFT_BUCKETS,
            )?,
            inter_token_latency: b.histogram(
                "vllm:inter_token_latency_seconds",
                "Time between consecutive generated tokens of a request, in seconds.",
                TOKEN_LATENCY_BUCKETS,
            )?,
            time_per_output_token: b.histogram(
                "vllm:time_per_output_token_seconds",
                "Time between consecutive generated tokens of a request, in seconds (older name).",
                TOKEN_LATENCY_BUCKETS,
            )?,
            request_time_per_output_token: b.histogram(
                "vllm:request_time_per_output_token_seconds",
                "Per request: (e2e - TTFT) / (generated tokens - 1), in seconds.",
                TOKEN_LATENCY_BUCKETS,
            )?,
            e2e_request_latency: b.histogram(
                "vllm:e2e_request_latency_seconds",
                "Time from arrival to finish, in seconds.",
                REQUEST_LATENCY_BUCKETS,
            )?,
            request_queue_time: b.histogram(
                "vllm:request_queue_time_seconds",
                "Time from arrival to first scheduled, in seconds.",
                REQUEST_LATENCY_BUCKETS,
            )?,
            request_inference_time: b.histogram(
                "vllm:request_inference_time_seconds",
                "Time from first scheduled to finish, in seconds.",
                REQUEST_LATENCY_BUCKETS,
            )?,
            request_prefill_time: b.histogram(
                "vllm:request_prefill_time_seconds",
                "Time from first scheduled to the first token, in seconds.",
                REQUEST_LATENCY_BUCKETS,
            )?,
            request_decode_time: b.histogram(
                "vllm:request_decode_time_seconds",
                "Time from the first token to the last, in seconds.",
                REQUEST_LATENCY_BUCKETS,
            )?,
            iteration_tokens: b.histogram(
                "vllm:iteration_tokens_total",
                "Tokens processed per engine step (prefill and decode).",
                ITERATION_TOKEN_BUCKETS,
            )?,
        })
    }

    fn record_step(&self, it: &IterationStats) {
        if let Some(n) = it.batch_tokens {
            self.iteration_tokens.observe(n as f64);
        }
        for &t in &it.queue_times {
            self.request_queue_time.observe(t);
        }
        for &t in &it.time_to_first_tokens {
            self.time_to_first_token.observe(t);
        }
        for &t in &it.inter_token_latencies {
            self.inter_token_latency.observe(t);
            self.time_per_output_token.observe(t);
        }
    }

    fn record_finished(&self, f: &FinishedRequest) {
        self.e2e_request_latency.observe(f.e2e_latency);
        let optional = [
            (&self.request_inference_time, f.inference_time),
            (&self.request_prefill_time, f.prefill_time),
            (&self.request_decode_time, f.decode_time),
            (&self.request_time_per_output_token, f.time_per_output_token),
        ];
        for (h, v) in optional {
            if let Some(v) = v {
                h.observe(v);
            }
        }
    }
}

/// Sizes of finished requests: their tokens and the parameters they asked for.
#[derive(Debug, Clone)]
struct SizeHistograms {
    request_prompt_tokens: Histogram,
    request_generation_tokens: Histogram,
    request_max_num_generation_tokens: Histogram,
    request_params_max_tokens: Histogram,
    request_params_n: Histogram,
    request_params_best_of: Histogram,
}

impl SizeHistograms {
    /// Token-count buckets run 1, 2, 5, … up to `max_model_len`.
    fn new(b: &Builder<'_>, max_model_len: usize) -> Result<Self, MetricsError> {
        let sizes = buckets_1_2_5(max_model_len.max(1));
        Ok(Self {
            request_prompt_tokens: b.histogram(
                "vllm:request_prompt_tokens",
                "Prompt length of finished requests, in tokens.",
                &sizes,
            )?,
            request_generation_tokens: b.histogram(
                "vllm:request_generation_tokens",
                "Generated tokens of finished requests.",
                &sizes,
            )?,
            request_max_num_generation_tokens: b.histogram(
                "vllm:request_max_num_generation_tokens",
                "Most tokens generated by any sequence of a request (n > 1).",
                &sizes,
            )?,
            request_params_max_tokens: b.histogram(
                "vllm:request_params_max_tokens",
                "The max_tokens parameter of finished requests.",
                &sizes,
            )?,
            request_params_n: b.histogram(
                "vllm:request_params_n",
                "The n parameter of finished requests.",
                N_BUCKETS,
            )?,
            request_params_best_of: b.histogram(
                "vllm:request_params_best_of",
                "The best_of parameter of finished requests.",
                N_BUCKETS,
            )?,
        })
    }

    fn record(&self, f: &FinishedRequest) {
        self.request_prompt_tokens.observe(f.prompt_tokens as f64);
        self.request_generation_tokens
            .observe(f.generation_tokens as f64);
        if let Some(r) = f.request {
            self.request_max_num_generation_tokens
                .observe(r.max_generation_tokens as f64);
            self.request_params_n.observe(r.n as f64);
            self.request_params_best_of.observe(r.n as f64);
            self.request_params_max_tokens.observe(r.max_tokens as f64);
        }
    }
}

/// Registers collectors for one model on one registry, labelled `model_name` and `engine`.
struct Builder<'a> {
    registry: &'a Registry,
    values: [&'a str; 2],
}

impl Builder<'_> {
    fn register<C: Collector + Clone + 'static>(&self, c: C) -> Result<C, MetricsError> {
        self.registry.register(Box::new(c.clone()))?;
        Ok(c)
    }
    fn int_gauge(&self, name: &str, help: &str) -> Result<IntGauge, MetricsError> {
        let v = self.register(IntGaugeVec::new(Opts::new(name, help), LABELS)?)?;
        Ok(v.with_label_values(&self.values))
    }
    fn gauge(&self, name: &str, help: &str) -> Result<Gauge, MetricsError> {
        let v = self.register(GaugeVec::new(Opts::new(name, help), LABELS)?)?;
        Ok(v.with_label_values(&self.values))
    }
    fn counter(&self, name: &str, help: &str) -> Result<IntCounter, MetricsError> {
        let v = self.register(IntCounterVec::new(Opts::new(name, help), LABELS)?)?;
        Ok(v.with_label_values(&self.values))
    }
    fn histogram(
        &self,
        name: &str,
        help: &str,
        buckets: &[f64],
    ) -> Result<Histogram, MetricsError> {
        let opts = HistogramOpts::new(name, help).buckets(buckets.to_vec());
        let v = self.register(HistogramVec::new(opts, LABELS)?)?;
        Ok(v.with_label_values(&self.values))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::encode;

    #[test]
    fn exposition_has_vllm_names_labels_and_buckets() {
        let registry = Registry::new();
        let cache = CacheInfo {
            block_size: 16,
            num_gpu_blocks: 100,
            num_cpu_blocks: 7,
            cache_dtype: "auto".into(),
            swap_space_gib: 4.0,
            enable_prefix_caching: true,
        };
        let mut m = EngineMetrics::new(&registry, "smol", 8192, &cache).expect("metrics");
        let it = IterationStats {
            prefix_cache_queries: 40,
            prefix_cache_hits: 30,
            time_to_first_tokens: vec![0.03],
            finished: vec![FinishedRequest {
                reason: FinishReason::Abort,
                e2e_latency: 0.5,
                inference_time: None,
                prefill_time: None,
                decode_time: None,
                time_per_output_token: None,
                prompt_tokens: 3,
                generation_tokens: 0,
                request: None,
            }],
            ..IterationStats::default()
        };
        m.record(&SchedulerStats::default(), &it);
        let text = encode(&registry).expect("encode");
        for line in [
            "vllm:request_success_total{engine=\"0\",finished_reason=\"abort\",model_name=\"smol\"} 1",
            "vllm:time_to_first_token_seconds_bucket{engine=\"0\",model_name=\"smol\",le=\"0.04\"} 1",
            "vllm:time_to_first_token_seconds_bucket{engine=\"0\",model_name=\"smol\",le=\"0.02\"} 0",
            "vllm:request_prompt_tokens_bucket{engine=\"0\",model_name=\"smol\",le=\"2\"} 0",
            "vllm:request_prompt_tokens_bucket{engine=\"0\",model_name=\"smol\",le=\"5000\"} 1",
            "# TYPE vllm:e2e_request_latency_seconds histogram",
            "# TYPE vllm:num_requests_running gauge",
            "# TYPE vllm:generation_tokens_total counter",
            "vllm:prefix_cache_queries_total{engine=\"0\",model_name=\"smol\"} 40",
            "vllm:prefix_cache_hits_total{engine=\"0\",model_name=\"smol\"} 30",
            "vllm:gpu_prefix_cache_hit_rate{engine=\"0\",model_name=\"smol\"} 0.75",
            "enable_prefix_caching=\"True\"",
        ] {
            assert!(text.contains(line), "missing {line}");
        }
        assert!(text.contains("num_gpu_blocks=\"100\""));
    }
}
