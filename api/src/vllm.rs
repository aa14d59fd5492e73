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
