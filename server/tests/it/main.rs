//! The server's integration tests, one binary (each file below was its own, linked against the
//! whole server every time). They drive the real `ferrite-server` binary over HTTP.
//! `gpu_serving.rs` stays apart: the GPU check carries it alone.

mod common;

mod hostile;
mod metrics_counts;
mod model_sources;
mod openai_client;
mod prefix_cache;
mod prometheus;
mod server_process;
mod serving;
mod stats_log;
