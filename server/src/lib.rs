//! ferrite-server: the OpenAI-compatible HTTP API and the vLLM metrics protocol on top of
//! `ferrite-runtime`. `api` knows requests, never tensors; `metrics` turns the engine's plain
//! stats records into Prometheus series and the stats log line.

pub mod api;
pub mod config;
pub mod fetch;
pub mod metrics;
