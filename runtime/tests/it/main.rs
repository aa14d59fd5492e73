//! The runtime's integration tests, one binary (each file below was its own, linked against
//! candle and the model code every time). `gpu.rs` stays apart: the GPU check carries it alone.

mod common;

mod architectures;
mod attention;
mod batch_invariance;
mod cuda_kernel_on_cpu;
mod engine;
mod kv_cache;
mod llama_server_agreement;
mod lora;
mod model_formats;
mod runtime_reference;
mod runtime_reference_dense;
mod scheduler;
mod structured;
mod swap_resume;
mod tokenizer;
