//! LoRA adapters declared in `spec.model.adapters`, kept loaded on the running replicas
//! through the runtime's load/unload API, so editing the list restarts no pod.

pub mod client;
pub mod plan;
pub mod sync;
