//! vLLM's metric names that cross a process boundary: ferrite-server registers them, and the
//! operator's autoscaler and the router read them from every pod (ferrite's or vLLM's). The
//! server's other metrics are read by dashboards and alerts only (`dashboards/`).

/// Waiting requests.
pub const NUM_REQUESTS_WAITING: &str = "vllm:num_requests_waiting";
/// Requests in the running batch.
pub const NUM_REQUESTS_RUNNING: &str = "vllm:num_requests_running";
/// KV-cache usage, 0..1.
pub const KV_CACHE_USAGE_PERC: &str = "vllm:kv_cache_usage_perc";
/// KV-cache usage under the name vLLM used before v0.10.
pub const GPU_CACHE_USAGE_PERC: &str = "vllm:gpu_cache_usage_perc";
/// Which LoRA adapters a server is running and queueing: one series, whose value is the time
/// of the last update and whose labels are [`LORA_MAX`], [`LORA_WAITING`] and [`LORA_RUNNING`]
/// (adapter names, comma-separated).
pub const LORA_REQUESTS_INFO: &str = "vllm:lora_requests_info";
/// `--max-loras`.
pub const LORA_MAX: &str = "max_lora";
pub const LORA_WAITING: &str = "waiting_lora_adapters";
pub const LORA_RUNNING: &str = "running_lora_adapters";
