//! ferrite-runtime: everything under the HTTP server that turns token ids into token ids.
//!
//! Layers, each importing only those above it in this list: `kv` (blocks and the per-layer
//! pools; plain data), `model` (file formats, the batched forward over the paged cache, the
//! tokenizer and chat template; tensors, never requests), `engine` (sequences, the scheduler,
//! the sampler, the output processor and the loop; the only producer of statistics, as plain
//! records in `engine::stats`). `device`, `memory` and `priority` are leaves. Nothing here knows HTTP or
//! Prometheus; `ferrite-server` sits on top.

pub mod device;
pub mod engine;
pub mod kernels;
pub mod kv;
pub mod memory;
pub mod model;
pub mod priority;
