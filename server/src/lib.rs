//! ferrite-server: an OpenAI-compatible LLM server on candle with a paged KV cache.
//!
//! Layers, each knowing only the one below: `model` (tensors), `kv` (blocks), and the serving
//! engine and API built on top of them.

pub mod api;
pub mod config;
pub mod device;
pub mod engine;
pub mod kv;
pub mod metrics;
pub mod model;
pub mod priority;
