//! Plain statistics records, filled by the engine and consumed by sinks (vLLM v1's
//! `SchedulerStats` / `IterationStats` and its stat loggers). The engine never sees a metrics
//! library: the server's Prometheus sink and its stats log line are two consumers of the same
//! records, so they cannot disagree.

use super::request::FinishReason;

/// The scheduler and cache as they stand after a step; also what `EngineHandle::stats` reads.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SchedulerStats {
    pub num_running: usize,
    pub num_waiting: usize,
    pub num_swapped: usize,
    /// Preemptions since start.
    pub num_preemptions: u64,
    pub blocks_used: usize,
    pub blocks_total: usize,
    pub host_blocks_used: usize,
    /// Fraction of device blocks in use, 0 to 1.
    pub kv_cache_usage: f64,
    /// Fraction of host swap blocks in use, 0 to 1.
    pub cpu_cache_usage: f64,
    /// Model steps since start.
    pub steps: u64,
}

/// What one pass of the engine loop did: token counts and the per-request observations that
/// fell due in it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct IterationStats {
    /// Prompt tokens of requests whose prompt was processed (counted once per request, however
    /// often a preemption recomputes it).
    pub num_prompt_tokens: u64,
    pub num_generation_tokens: u64,
    pub num_preempted: u64,
    /// Prompt tokens looked up in the prefix cache (at each request's first admission).
    pub prefix_cache_queries: u64,
    /// Of those, tokens found cached.
    pub prefix_cache_hits: u64,
    /// Tokens of the forward pass, if one ran.
    pub batch_tokens: Option<usize>,
    /// Per request scheduled for the first time: arrival to first scheduled, in seconds.
    pub queue_times: Vec<f64>,
    /// Per request that produced its first token: arrival to that token, in seconds.
    pub time_to_first_tokens: Vec<f64>,
    /// Per later token: the gap since the request's previous token, in seconds.
    pub inter_token_latencies: Vec<f64>,
    pub finished: Vec<FinishedRequest>,
    /// The LoRA adapters of the running and the queued sequences after this pass.
    pub lora: LoraStats,
}

/// Which LoRA adapters are in use (vLLM's `vllm:lora_requests_info` labels).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct LoraStats {
    /// Adapters of the running sequences, by name, sorted.
    pub running: Vec<String>,
    /// Adapters of the waiting and swapped sequences, by name, sorted.
    pub waiting: Vec<String>,
}

impl IterationStats {
    /// Whether there is nothing to record.
    pub fn is_empty(&self) -> bool {
        *self == Self::default()
    }
}

/// One sequence's life, recorded when it finishes.
#[derive(Debug, Clone, PartialEq)]
pub struct FinishedRequest {
    pub reason: FinishReason,
    /// Arrival to finish, in seconds.
    pub e2e_latency: f64,
    /// First scheduled to finish (`None`: never scheduled).
    pub inference_time: Option<f64>,
    /// First scheduled to first token.
    pub prefill_time: Option<f64>,
    /// First token to last token.
    pub decode_time: Option<f64>,
    /// Decode time per token after the first (`None` below two tokens).
    pub time_per_output_token: Option<f64>,
    pub prompt_tokens: usize,
    pub generation_tokens: usize,
    /// Set on the last sequence of an API request to finish: what the request as a whole had.
    pub request: Option<RequestParams>,
}

/// The API request's parameters, recorded once per request (not per choice).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestParams {
    pub n: usize,
    pub max_tokens: usize,
    /// The most tokens any of its sequences generated.
    pub max_generation_tokens: usize,
}

/// A consumer of the engine's records. `record` runs on the engine thread after every pass of
/// its loop that did something, before the pass's events reach the clients, so a client that
/// saw a token or a finish finds it counted.
pub trait StatsSink: Send {
    fn record(&mut self, scheduler: &SchedulerStats, iteration: &IterationStats);
}

/// Several sinks fed the same records.
impl StatsSink for Vec<Box<dyn StatsSink>> {
    fn record(&mut self, scheduler: &SchedulerStats, iteration: &IterationStats) {
        for sink in self.iter_mut() {
            sink.record(scheduler, iteration);
        }
    }
}
